#!/usr/bin/env python3
"""Turn a benchmark result (``bench/run.py --suite ci``) into the committed baseline.

    python3 ci/make_baseline.py --from bench/results/ci-fp32-graphs.json \
        --out bench/results/baseline.json

The baseline is the result itself, with two changes:

* ``greedy_match`` is kept only where the run was exact (``bench.run.greedy_exact``:
  float32 without CUDA graphs). Elsewhere greedy
  outputs may differ from the reference in the last bits of a near-tie for the chain
  and DDTree alike, so the gate must not demand equality there; the counts
  (``greedy_identical`` / ``greedy_total``) stay as information. Results written by
  ``bench/run.py`` since that rule exist already carry it; this applies it to older files.
* ``baseline_from`` records the source file, its git revision and command.

The output is checked with ``ci/check_regression.py``'s own reader before it is written,
so a baseline that the gate cannot read is never produced. Exit status: 0 written, 2 bad
input (with a message naming the file and the problem).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.run import greedy_exact, strip_inexact_greedy  # noqa: E402
from ci.check_regression import EXIT_BAD_INPUT, InputError, load_results  # noqa: E402


def make_baseline(doc: dict, source: str) -> dict:
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
        raise InputError(f"{source}: not a benchmark result (no 'results' list)")
    exact = doc.get("greedy_exact")
    if exact is None:
        if "dtype" not in doc or "cuda_graphs" not in doc:
            raise InputError(f"{source}: needs 'greedy_exact', or 'dtype' and 'cuda_graphs', "
                             "to tell whether greedy outputs were compared exactly")
        exact = greedy_exact(str(doc["dtype"]), not doc["cuda_graphs"])
    out = {k: v for k, v in doc.items() if k != "results"}
    out["greedy_exact"] = exact
    out["baseline_from"] = {"file": source, "git_rev": doc.get("git_rev"),
                            "command": doc.get("command")}
    out["results"] = strip_inexact_greedy(doc["results"], exact)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--from", dest="source", required=True, help="bench/run.py result JSON")
    ap.add_argument("--out", required=True, help="baseline JSON to write")
    args = ap.parse_args(argv)
    try:
        try:
            with open(args.source, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise InputError(f"{args.source}: cannot read a JSON result: {exc}") from exc
        base = make_baseline(doc, os.path.relpath(args.source, ROOT))
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as tmp:
            json.dump(base, tmp, indent=1)
        try:
            load_results(Path(tmp.name))  # the gate must be able to read it
        finally:
            os.unlink(tmp.name)
    except InputError as exc:
        print(f"make_baseline: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(base, f, indent=1)
        f.write("\n")
    n = len(base["results"])
    print(f"wrote {args.out}: {n} entries, greedy gated: {base['greedy_exact']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
