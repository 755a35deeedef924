"""bench/results/equivalence.json from the equivalence checks' result files.

Each ``bench/gpu_checks.py equiv-real`` / ``equiv`` result carries its ``cases``: one
row per (target, method, dtype, graphs, batch, sampling, scenario) with the identical
count over the total. This gathers them, newest file last (a later file's case
replaces an earlier one with the same key), with the file each came from:

    python3 bench/equivalence.py bench/results/equiv-*.json.gz --out bench/results/equivalence.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys

KEY = ("target", "method", "config", "vllm_version", "dtype", "graphs", "batch",
       "temperature", "top_k", "top_p", "seeded", "sampling", "scenario", "tp", "executor")


def read_result(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def gather(paths: list[str]) -> dict:
    cases: dict[tuple, dict] = {}
    for path in paths:
        result = read_result(path)
        if not result.get("complete", False):
            raise SystemExit(f"{path}: the run did not complete (complete != true)")
        for case in result.get("cases", []):
            row = dict(case, result_file=os.path.basename(path))
            cases[tuple(row.get(k) for k in KEY)] = row
    rows = sorted(cases.values(), key=lambda c: tuple(str(c.get(k)) for k in KEY))
    return {
        "summary": {
            "cases": len(rows),
            "identical": sum(c["identical"] for c in rows),
            "total": sum(c["total"] for c in rows),
            "all_identical_ddtree": all(c["identical"] == c["total"] for c in rows
                                        if c["method"] == "ddtree"),
        },
        "command": "python3 bench/equivalence.py " + " ".join(
            os.path.relpath(p) for p in paths) + " --out <this file>",
        "cases": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    table = gather(args.results)
    text = json.dumps(table, indent=1) + "\n"
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
