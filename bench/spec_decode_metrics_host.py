"""Front-end host time of vLLM's spec-decode Prometheus counters per drafting step (CPU).

Each step that verified drafts reaches the front end's ``PrometheusStatLogger`` as a
``SpecDecodingStats``; ``SpecDecodingProm.observe`` then increments vLLM's counters,
among them one per draft position (``num_speculative_tokens`` of them: 64 for the
benchmark's DDTree budget, 15 for the chain). This times ``observe`` on steps of
``--batch`` requests whose accepted lengths are drawn from the per-depth acceptance of
``--accept-rate`` (each next token accepted with that probability, up to
``--max-accepted``), with whatever vLLM is installed: run it on the patched series and
on the reverted one (``./apply.sh --revert``) to compare.

    python3 bench/spec_decode_metrics_host.py --out bench/results/<dir>/spec-decode-metrics-host.json
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.online_budget_host import write_result  # noqa: E402


def time_observe(num_spec_tokens: int, batch: int, accept_rate: float, max_accepted: int,
                 steps: int, seed: int) -> float:
    """Mean microseconds of one ``SpecDecodingProm.observe`` call."""
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics
    from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats

    rng = random.Random(seed)
    unregister_vllm_metrics()
    prom = SpecDecodingProm(types.SimpleNamespace(num_speculative_tokens=num_spec_tokens),
                            ["model_name", "engine"], {0: ["model", "0"]})
    stats = []
    for _ in range(64):
        s = SpecDecodingStats.new(num_spec_tokens)
        for _ in range(batch):
            a = 0
            while a < max_accepted and rng.random() < accept_rate:
                a += 1
            s.observe_draft(num_draft_tokens=num_spec_tokens, num_accepted_tokens=a)
        # The per-position counts, as the scheduler's make_stats adds them up under
        # patch metrics_spec-decode-stats-count-drafts-by-length-per (without the
        # series observe_draft fills them as it goes).
        finish = getattr(s, "finish", None)
        stats.append(finish() if finish is not None else s)
    t0 = time.perf_counter()
    for i in range(steps):
        prom.observe(stats[i % len(stats)], 0)
    us = (time.perf_counter() - t0) / steps * 1e6
    unregister_vllm_metrics()
    return us


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-spec-tokens", type=int, nargs="+", default=[15, 64])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--accept-rate", type=float, default=0.6)
    ap.add_argument("--max-accepted", type=int, default=15)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    import vllm

    rows = []
    for k in args.num_spec_tokens:
        for n in args.batch_sizes:
            runs = [time_observe(k, n, args.accept_rate, min(args.max_accepted, k),
                                 args.steps, seed=r) for r in range(args.rounds)]
            rows.append({"num_spec_tokens": k, "batch": n,
                         "us_median": round(statistics.median(runs), 2),
                         "us_rounds": [round(x, 2) for x in runs]})
    series = getattr(vllm, "ddtree_series", None) or {}
    doc = {"command": "python3 bench/spec_decode_metrics_host.py " + " ".join(
               sys.argv[1:] if argv is None else argv),
           "host": {"machine": platform.machine(), "python": platform.python_version(),
                    "cpus": os.cpu_count()},
           "vllm_version": vllm.__version__,
           "series_sha256": (series.get("series_sha256") or "")[:12] or None,
           "patches": len(series.get("patches", [])),
           "what": "mean microseconds of SpecDecodingProm.observe per drafting step, "
                   "median of rounds",
           "accept_rate": args.accept_rate, "max_accepted": args.max_accepted,
           "rows": rows}
    write_result(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
