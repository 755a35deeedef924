"""Host time the online budget's /metrics summary costs a step (CPU only).

With stats on (``vllm serve``'s default, and the benchmark's engines, whose spec-decode
counters it reads), every step's ``SchedulerStats`` goes from the engine core to the
front end in vLLM's msgpack encoding, and the front end's ``PrometheusStatLogger``
records it. The scheduler adds DDTree's summary (:meth:`OnlineBudget.metrics`: per
sampling class, batch-size bucket and measured budget) to it, and the front end sets
one gauge per number (:class:`vllm_ddtree.metrics.DDTreeBudgetProm`). This times,
per step, what the summary adds on each side, on a controller whose buckets a trace of
batch sizes 1-64 and both sampling classes filled:

* ``core``: the scheduler's call and the encoding of ``EngineCoreOutputs`` with the
  step's ``SchedulerStats``;
* ``front``: their decoding and the DDTree gauges;

and what one rebuild of the summary costs the engine core (``rebuild_us_median``).

Two ways of sending, taken in turns (A B, B A, ...) for ``--rounds`` rounds:
``every-step`` (the summary in every step's stats) and ``on-change``
(:meth:`OnlineBudget.metrics_update`: only when it was rebuilt, at a table change and
every ``METRICS_REFRESH_STEPS`` steps; here a settled engine: the periodic rebuild
only), beside ``none`` (stats without a summary, as plain decoding sends them).

    python3 bench/budget_metrics_host.py --out bench/results/<dir>/budget-metrics-host.json
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

from bench.online_budget_host import _config, write_result  # noqa: E402
from vllm_ddtree.online_budget import METRICS_REFRESH_STEPS, OnlineBudget  # noqa: E402

MODES = ("none", "every-step", "on-change")


def filled_online_budget(seed: int = 0) -> OnlineBudget:
    """An ``OnlineBudget`` after a trace at batch sizes 1-64, greedy and sampled, so
    every bucket up to 64 has a choice and measured budgets (what a server that has
    run a while reports)."""
    rng = random.Random(seed)
    clock = types.SimpleNamespace(t=0.0)
    ob = OnlineBudget(_config(64, 15, 64), None, 64, clock=lambda: clock.t)
    live = 0
    for i in range(6000):
        batch = (1, 2, 5, 9, 20, 40, 64)[(i // 300) % 7]
        budget = ob.lookup[batch]
        ids = [f"r{live}-{k}" for k in range(batch)]
        new = []
        if i % 3000 == 0:
            # The class flips: the first half greedy, the second sampled.
            live += 1
            ids = [f"r{live}-{k}" for k in range(batch)]
            kind = types.SimpleNamespace(name="GREEDY" if i < 3000 else "RANDOM")
            new = [types.SimpleNamespace(req_id=r, sampling_params=types.SimpleNamespace(
                sampling_type=kind)) for r in ids]
        so = types.SimpleNamespace(
            num_scheduled_tokens={r: 1 + budget for r in ids},
            scheduled_spec_decode_tokens={r: [-1] * budget for r in ids} if budget else {},
            total_num_scheduled_tokens=batch * (1 + budget), scheduled_new_reqs=new,
            finished_req_ids=set(), num_spec_tokens_to_schedule=budget)
        sampled = [[1] * (1 + (min(rng.randrange(4), budget) if budget else 0)) for _ in ids]
        clock.t += 0.004
        ob.observe(so, types.SimpleNamespace(
            sampled_token_ids=sampled, req_id_to_index={r: k for k, r in enumerate(ids)}))
    return ob


def time_mode(mode: str, steps: int, seed: int) -> dict:
    """Mean microseconds a step on each side for one way of sending."""
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    ob = filled_online_budget(seed)
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    prom = _prom()
    core, front, sent = [], [], 0
    for i in range(steps):
        if i % METRICS_REFRESH_STEPS == 0:
            # The periodic rebuild of a settled engine (a table change rebuilds it too:
            # at most every refresh_steps = 16 steps while the controller moves).
            ob._metrics, ob._metrics_sent = None, False
        t0 = time.perf_counter()
        summary = (None if mode == "none" else
                   ob.metrics() if mode == "every-step" else ob.metrics_update())
        frames = encoder.encode(EngineCoreOutputs(
            scheduler_stats=SchedulerStats(ddtree_budget=summary)))
        t1 = time.perf_counter()
        stats = decoder.decode(frames).scheduler_stats
        if stats.ddtree_budget is not None:
            prom.observe(stats.ddtree_budget, 0)
            sent += 1
        t2 = time.perf_counter()
        core.append((t1 - t0) * 1e6)
        front.append((t2 - t1) * 1e6)
    return {"core_us_mean": statistics.fmean(core), "front_us_mean": statistics.fmean(front),
            "sent_share": sent / steps}


_PROM = None


def _prom():
    """One set of DDTree gauges, in a registry of their own (a registry takes a name
    once; vLLM's loggers use the default one)."""
    global _PROM
    if _PROM is None:
        import functools

        import prometheus_client

        from vllm_ddtree.metrics import DDTreeBudgetProm

        gauge = functools.partial(prometheus_client.Gauge,
                                  registry=prometheus_client.CollectorRegistry())
        _PROM = DDTreeBudgetProm(gauge, ["model_name", "engine"], {0: ["model", "0"]})
    return _PROM


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args(argv)
    runs: dict = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            runs[mode].append(time_mode(mode, args.steps, seed=r))
    rows = []
    for mode in MODES:
        core = [x["core_us_mean"] for x in runs[mode]]
        front = [x["front_us_mean"] for x in runs[mode]]
        rows.append({"mode": mode, "core_us_median": round(statistics.median(core), 2),
                     "front_us_median": round(statistics.median(front), 2),
                     "core_us_rounds": [round(x, 2) for x in core],
                     "front_us_rounds": [round(x, 2) for x in front],
                     "sent_share": round(statistics.fmean(x["sent_share"]
                                                          for x in runs[mode]), 4)})
    ob = filled_online_budget()
    rebuilds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(200):
            ob._metrics = None
            ob.metrics()
        rebuilds.append((time.perf_counter() - t0) / 200 * 1e6)
    summary = ob.metrics()
    numbers = sum(len(v) if not isinstance(v, dict) else sum(
        len(x) if isinstance(x, dict) else 1 for x in v.values())
        for m in summary["sampling"].values() for v in m.values())
    doc = {"command": "python3 bench/budget_metrics_host.py " + " ".join(
               sys.argv[1:] if argv is None else argv),
           "host": {"machine": platform.machine(), "python": platform.python_version(),
                    "cpus": os.cpu_count()},
           "what": "host microseconds per step the online budget's /metrics summary adds: "
                   "core = the scheduler's call + msgpack encoding of the step's "
                   "EngineCoreOutputs; front = decoding + the DDTree gauges; medians of "
                   "per-round means, modes in turns",
           "summary_numbers": numbers,
           "rebuild_us_median": round(statistics.median(rebuilds), 2),
           "buckets": {c: sorted(m["budget"]) for c, m in summary["sampling"].items()},
           "rows": rows}
    write_result(args.out, doc)
    print("summary numbers:", numbers, "rebuild us:", doc["rebuild_us_median"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
