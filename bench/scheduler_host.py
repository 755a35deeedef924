"""Host time of vLLM's scheduler a decode step, plain decoding against DDTree with its
drafting off (CPU only).

The engine core runs ``schedule()`` and ``update_from_output()`` on its host thread
every step, which sets the pace of a small target's step. This builds vLLM's real
scheduler (``AsyncScheduler``, as `vllm serve` picks it) twice from configurations
resolved as `vllm serve` resolves them on an H200 (the device queries answered as one
does, ``tests/unit/test_ddtree_batch_defaults.py``; prefix caching off, the KV cache
of ``tests/unit/test_online_budget.py``): plain decoding, and the README's DDTree
configuration (online budget on). ``batch`` sampled requests decode; the tests' stand-in
for the GPU (``tests.unit.test_online_budget.Serving``) plays it: one token a request a
step, nothing accepted, the step times of ``step_ms`` on the controller's clock, so that the
controller turns drafting off (its probes still draft; ``drafted_steps`` counts them).
After ``--warmup`` steps it times ``--steps`` steps of each, the two configurations in
turns (A B, B A, ...) for ``--rounds`` rounds, and reports per batch size the medians of
each round's median microseconds a step and the median of the paired ratios DDTree /
plain. Stats logging is on, as `vllm serve` has it.

    .venv/bin/python bench/scheduler_host.py --out bench/results/<dir>/scheduler-host.json

Needs the patched vLLM (``./apply.sh``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.online_budget_host import write_result  # noqa: E402


def engine_config(models: dict[str, str], kind: str):
    """What `vllm serve <target>` resolves to: plain decoding, or with the README's
    DDTree speculative configuration."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    from tests.unit.test_ddtree_batch_defaults import README_SPEC

    spec = dict(README_SPEC, model=models["drafter"]) if kind == "ddtree" else None
    args = AsyncEngineArgs(model=models["target"], skip_tokenizer_init=True,
                           speculative_config=spec, max_model_len=32768,
                           enable_prefix_caching=False)
    return args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)


def time_steps(cfg, batch: int, warmup: int, steps: int) -> dict:
    """Microseconds of ``schedule()`` and ``update_from_output()`` a decode step."""
    from tests.unit.test_online_budget import Serving, _scheduler

    # The tests' GPU stand-in: one token a request a step, nothing accepted.
    serving = Serving(_scheduler(cfg, log_stats=True), batch)
    verified = serving.run(warmup + steps, quality=0.0)
    sched = [a * 1e6 for a, _ in serving.times[warmup:]]
    update = [b * 1e6 for _, b in serving.times[warmup:]]
    total = [a + b for a, b in zip(sched, update)]
    return {"us_p50": statistics.median(total), "schedule_us_p50": statistics.median(sched),
            "update_us_p50": statistics.median(update),
            "drafted_steps": sum(1 for d in verified[warmup:] if d > 0)}


def measure(batch_sizes: list[int], warmup: int, steps: int, rounds: int) -> list[dict]:
    import pytest

    from tests.unit.test_ddtree_batch_defaults import patch_h200, write_models

    # vLLM's configuration code answered as on one H200, for the life of this process.
    patch_h200(pytest.MonkeyPatch())
    models = write_models(Path(tempfile.mkdtemp()))
    configs = {kind: engine_config(models, kind) for kind in ("plain", "ddtree")}
    rows = []
    for batch in batch_sizes:
        runs: dict[str, list[dict]] = {"plain": [], "ddtree": []}
        for r in range(rounds):
            for kind in (("plain", "ddtree") if r % 2 == 0 else ("ddtree", "plain")):
                runs[kind].append(time_steps(configs[kind], batch, warmup, steps))
        row = {"batch": batch, "steps": steps, "rounds": rounds}
        for kind, rs in runs.items():
            for key in ("us_p50", "schedule_us_p50", "update_us_p50"):
                row[f"{kind}_{key}"] = round(statistics.median(x[key] for x in rs), 2)
            row[f"{kind}_drafted_steps"] = [x["drafted_steps"] for x in rs]
        ratios = [d["us_p50"] / p["us_p50"] for d, p in zip(runs["ddtree"], runs["plain"])]
        row["ddtree_over_plain_paired_median"] = round(statistics.median(ratios), 3)
        row["ddtree_over_plain_paired"] = [round(x, 3) for x in ratios]
        row["ddtree_minus_plain_us"] = round(row["ddtree_us_p50"] - row["plain_us_p50"], 2)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--warmup", type=int, default=800,
                    help="untimed steps first (the controller turns drafting off)")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    rows = measure(args.batch_sizes, args.warmup, args.steps, args.rounds)
    doc = {"command": "python3 bench/scheduler_host.py " + " ".join(
               sys.argv[1:] if argv is None else argv),
           "host": {"machine": platform.machine(), "processor": platform.processor(),
                    "python": platform.python_version(), "cpus": os.cpu_count()},
           "what": "host microseconds of vLLM's schedule() + update_from_output() a decode "
                   "step (median), plain decoding against DDTree (README configuration, "
                   "online budget, drafting off but its probes), in turns",
           "rows": rows}
    write_result(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
