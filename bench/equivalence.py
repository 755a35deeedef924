"""bench/results/equivalence.json from the equivalence checks' result files.

Each ``bench/gpu_checks.py equiv-real`` / ``equiv`` result carries its ``cases``: one
row per (target, method, dtype, graphs, batch, sampling, scenario) with the identical
count over the total. This gathers them, newest file last (a later file's case
replaces an earlier one with the same key), with the file each came from. A case's
``differing_near_ties`` counts its differences that are near ties, from the file's own
margins and from ``--margins`` files (``bench/recompute_margins.py``: the same margins
recomputed on the CPU for differences a file has none for):

    python3 bench/equivalence.py bench/results/equiv-*.json.gz --out bench/results/equivalence.json
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.result_files import dumps_rows, read_json  # noqa: E402

KEY = ("target", "method", "config", "vllm_version", "dtype", "graphs", "batch",
       "temperature", "top_k", "top_p", "seeded", "sampling", "scenario", "tp", "executor")


def explained(near_ties: list[dict], case: dict) -> int:
    """Differing outputs of ``case`` whose first difference is a near tie: the two
    tokens' margin within float32 rounding, or plain decoding itself choosing the
    speculative run's token when it computes that position in another batch shape
    (``bench/gpu_checks.py near_tie_margins``)."""
    return len({(t.get("request"), t.get("token")) for t in near_ties
                if t["config"] == case["config"] and t["batch"] == case["batch"]
                and t["sampling"] == case.get("sampling")
                and (t.get("near_tie") or (t.get("recomputed_token") is not None
                                           and t.get("recomputed_token") == t.get("output_token")))})


def gather(paths: list[str], allow_partial: bool = False,
           margins: list[str] | None = None) -> dict:
    extra: dict[str, list[dict]] = {}
    for mpath in margins or []:
        for m in read_json(mpath)["margins"]:
            extra.setdefault(m["result_file"], []).append(m)
    cases: dict[tuple, dict] = {}
    for path in paths:
        result = read_json(path)
        near_ties = (result.get("near_ties") or []) + extra.get(os.path.basename(path), [])
        complete = bool(result.get("complete", False))
        if not complete and not allow_partial:
            raise SystemExit(f"{path}: the run did not complete (complete != true); "
                             "--allow-partial keeps its cases, marked")
        for case in result.get("cases", []):
            row = dict(case, result_file=os.path.basename(path), run_complete=complete)
            if "sampling" not in row:  # results written before cases named their mode
                row["sampling"] = ("greedy" if not row["seeded"] else
                                   "seeded-topk-topp" if row.get("top_k") else "seeded")
            if "near_ties" in result or near_ties:
                row["differing_near_ties"] = explained(near_ties, case)
            cases[tuple(row.get(k) for k in KEY)] = row
    rows = sorted(cases.values(), key=lambda c: tuple(str(c.get(k)) for k in KEY))
    ddtree = [c for c in rows if c["method"] == "ddtree"]
    return {
        "summary": {
            "cases": len(rows),
            "identical": sum(c["identical"] for c in rows),
            "total": sum(c["total"] for c in rows),
            "ddtree_identical": sum(c["identical"] for c in ddtree),
            "ddtree_total": sum(c["total"] for c in ddtree),
            "ddtree_differing_near_ties": sum(c.get("differing_near_ties", 0) for c in ddtree),
            "all_identical_ddtree": all(c["identical"] == c["total"] for c in ddtree),
        },
        "command": "python3 bench/equivalence.py " + ("--allow-partial " if allow_partial else "")
        + "".join(f"--margins {os.path.relpath(m)} " for m in margins or [])
        + " ".join(os.path.relpath(p) for p in paths) + " --out <this file>",
        "cases": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+")
    parser.add_argument("--out")
    parser.add_argument("--allow-partial", action="store_true",
                        help="keep the cases of a run stopped by its timeout (marked)")
    parser.add_argument("--margins", action="append", default=[],
                        help="near-tie margins recomputed for these files (bench/recompute_margins.py)")
    args = parser.parse_args(argv)
    table = gather(args.results, args.allow_partial, args.margins)
    text = dumps_rows(table, "cases")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
