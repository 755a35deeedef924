#!/usr/bin/env python3
"""Markdown tables of a ``bench/run.py`` result, as docs/benchmarks.md shows them.

One table per (prompt set, temperature): output tokens/s (tau) of every configuration
by batch size (with ``--engine-rounds``, each engine's tokens/s in brackets), then
DDTree's tokens/s divided by the better of the chain configurations in each cell and
by no speculation's, and DDTree's verified tokens per target forward over all of the
cell's steps (with drafting off at large batches most steps verify none). Where either
side of a ratio ran several engines, the range of the ratio over every pair of
engines follows in brackets.

Several results of one code tree (the same ``code_digest``, e.g. successive device
calls on one code tree) are read as one: a configuration measured in one file can be
compared with one measured in another. A cell measured in two of them is refused.
Where the files ran on different hosts (their ``host`` records: CPU model, or the
fixed Python loop's time more than 10 % apart) or do not say, a note heads the
tables: with host-bound steps a ratio between two files compares two hosts too.

    python bench/tables.py bench/results/bench-fixture-mp-t512.json.gz \
        --ddtree ddtree-b64-t512 --chains dflash dflash-t512
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.result_files import read_json  # noqa: E402
from bench.run import all_steps_fields  # noqa: E402


def _verified_all_steps(row: dict) -> float | None:
    if "verified_tokens_per_forward_all_steps" in row:
        return row["verified_tokens_per_forward_all_steps"]
    # Results recorded before the field existed: the same figure from their counters.
    return all_steps_fields(row).get("verified_tokens_per_forward_all_steps")


def _fmt_cell(row: dict, steps: bool = False) -> str:
    """tokens/s (tau), and with several engine rounds each engine's tokens/s in brackets;
    with ``steps`` (steady cells), then the steps that prefilled a joining request: p50
    ms x count."""
    text = f"{row['output_tokens_per_s']:.0f}"
    if row.get("tau"):
        text += f" ({row['tau']:.2f})"
    if row.get("output_tokens_per_s_engines"):
        text += " [" + " / ".join(f"{v:.0f}" for v in row["output_tokens_per_s_engines"]) + "]"
    if steps and row.get("prefill_step_ms_p50") is not None:
        text += f" / {row['prefill_step_ms_p50']:.1f} x {row.get('prefill_steps', '?')}"
    return text


def merge_results(docs: list[dict], names: list[str]) -> dict:
    """One result document from several of the same code tree; ``names`` (the files)
    label the errors."""
    digests = {d.get("code_digest") for d in docs}
    if len(digests) > 1:
        raise ValueError(f"these results come from different code trees (code_digest "
                         f"{sorted(map(str, digests))}); compare results of one tree only")
    seen: dict[tuple, str] = {}
    results = []
    for doc, name in zip(docs, names):
        for row in doc.get("results", []):
            if "output_tokens_per_s" not in row:
                continue
            key = (row["config"], row["prompt_set"], float(row["temperature"]),
                   int(row["batch_size"]))
            if key in seen:
                raise ValueError(f"{key[0]} at {key[1]}, T={key[2]:g}, batch {key[3]} is in "
                                 f"both {seen[key]} and {name}")
            seen[key] = name
            results.append(row)
    return {"code_digest": digests.pop(), "results": results}


# Two runs' fixed Python loop times (bench/run.py host_loop_ms) this far apart count as
# two hosts.
HOST_LOOP_TOLERANCE = 0.10


def host_note(docs: list[dict], names: list[str]) -> str | None:
    """Why ratios between these result files may compare two hosts, or None."""
    hosts = [d.get("host") for d in docs]
    unknown = [n for n, h in zip(names, hosts) if not h]
    if unknown:
        return (f"{', '.join(unknown)} record no host (made before bench/run.py recorded one): ratios between "
                f"files may compare two GPU hosts' CPUs as well")
    models = {h.get("cpu_model") for h in hosts}
    loops = [h.get("python_loop_ms") or 0.0 for h in hosts]
    if len(models) > 1 or min(loops) <= 0 or max(loops) > (1 + HOST_LOOP_TOLERANCE) * min(loops):
        desc = "; ".join(f"{n}: {h.get('cpu_model')}, loop {h.get('python_loop_ms')} ms"
                         for n, h in zip(names, hosts))
        return (f"these files ran on different hosts ({desc}): ratios between them compare "
                f"the hosts too")
    return None


def _engine_values(row: dict) -> list[float]:
    return row.get("output_tokens_per_s_engines") or [row["output_tokens_per_s"]]


def _ratio(tree: dict, other: dict) -> str:
    """tree / other tokens/s, and with several engines on either side the range of the
    ratio over every pair of engines."""
    text = f"{tree['output_tokens_per_s'] / other['output_tokens_per_s']:.2f}"
    trees, others = _engine_values(tree), _engine_values(other)
    if len(trees) > 1 or len(others) > 1:
        pairs = [t / o for t in trees for o in others]
        text += f" [{min(pairs):.2f}-{max(pairs):.2f}]"
    return text


def markdown_tables(doc: dict, ddtree: str, chains: list[str], baseline: str = "no-spec",
                    steps: bool = False) -> str:
    """The tables for one result document (``bench/run.py --out``). Cells a run did not
    measure are shown as "-" and left out of the ratios. ``steps``: each cell also
    shows its prefilling steps (:func:`_fmt_cell`)."""
    cells = {(r["config"], r["prompt_set"], float(r["temperature"]), int(r["batch_size"])): r
             for r in doc.get("results", []) if "output_tokens_per_s" in r}
    if not cells:
        raise ValueError("no measured cells in this result")
    configs = list(dict.fromkeys(c for c, *_ in cells))
    for name in [ddtree, *chains]:
        if name not in configs:
            raise ValueError(f"config {name!r} is not in this result (it has {configs})")
    batches = sorted({b for *_, b in cells})
    out: list[str] = []
    for pset in dict.fromkeys(p for _, p, _, _ in cells):
        for temp in sorted({t for _, p, t, _ in cells if p == pset}):
            out += [f"**{pset}, T={temp:g}**", "",
                    "| config | " + " | ".join(f"batch {b}" for b in batches) + " |",
                    "|---|" + "---|" * len(batches)]
            for cfg in configs:
                row = [_fmt_cell(cells[(cfg, pset, temp, b)], steps)
                       if (cfg, pset, temp, b) in cells
                       else "-" for b in batches]
                out.append(f"| {cfg} | " + " | ".join(row) + " |")
            vs_chain, vs_base, verified = [], [], []
            for b in batches:
                tree = cells.get((ddtree, pset, temp, b))
                best_chain = max((cells[(c, pset, temp, b)] for c in chains
                                  if (c, pset, temp, b) in cells),
                                 key=lambda r: r["output_tokens_per_s"], default=None)
                base = cells.get((baseline, pset, temp, b))
                vs_chain.append(_ratio(tree, best_chain) if tree and best_chain else "-")
                vs_base.append(_ratio(tree, base) if tree and base else "-")
                vt = _verified_all_steps(tree) if tree else None
                verified.append(f"{vt:.0f}" if vt else "-")
            label = "better chain" if len(chains) > 1 else "chain"
            out.append(f"| DDTree / {label} | " + " | ".join(vs_chain) + " |")
            if baseline in configs:
                out.append(f"| DDTree / {baseline} | " + " | ".join(vs_base) + " |")
            out.append("| DDTree verified tokens per forward (all steps) | "
                       + " | ".join(verified) + " |")
            out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="+",
                    help="bench/run.py result JSONs (several: of one code tree, read as one)")
    ap.add_argument("--ddtree", required=True, help="the DDTree configuration to compare")
    ap.add_argument("--chains", nargs="+", default=["dflash"],
                    help="chain configurations; ratios use the best of them per cell")
    ap.add_argument("--baseline", default="no-spec")
    ap.add_argument("--steps", action="store_true",
                    help="steady cells: also each cell's steps that prefilled a joining "
                         "request (p50 ms x count)")
    args = ap.parse_args(argv)
    docs = [read_json(path) for path in args.results]
    try:
        doc = docs[0] if len(docs) == 1 else merge_results(docs, args.results)
        tables = markdown_tables(doc, args.ddtree, args.chains, args.baseline, args.steps)
        note = host_note(docs, args.results) if len(docs) > 1 else None
        if note:
            print(f"> Note: {note}.\n")
        print(tables)
    except ValueError as exc:
        print(f"tables: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
