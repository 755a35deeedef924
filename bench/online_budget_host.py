"""Host time the online budget adds to each engine step (CPU only).

``OnlineBudget.observe`` runs in the scheduler's ``update_from_output`` every step, on
the engine core's host thread, which sets the pace of small targets' steps. This
times it on the objects vLLM hands it (a scheduler output and a model-runner output
of ``batch`` decoding requests, each having verified ``budget`` drafts and accepted
some), with the real controller behind it; ``metrics()`` (what the scheduler's stats
carry each step) is timed too.

    python3 bench/online_budget_host.py --out bench/results/<dir>/online-budget-host.json

``--baseline REV`` also times the controller (``vllm_ddtree/budget_controller.py``) of
git revision REV behind the same ``OnlineBudget``, the two taken in turns (A B, B A,
...) for ``--rounds`` rounds, and reports each cell's median of the paired ratios this
tree / REV: this machine's pace drifts by more than a change of the controller moves it.

``--same-decisions N`` (with ``--baseline``) first feeds N random traces (batch sizes
that change, acceptance that drifts, stalls, steps that prefill) to this tree's
controller and REV's, each step's budget read from each one's own table, and counts
the steps where their budgets, their answers to ``observe`` or their ``state()``
differ: a rewrite meant to be exact (the same decisions, faster) shows 0.

``--report`` (with ``--baseline``) times ``OnlineBudget.write_report`` instead: the
controller's state rewritten to ``VLLM_DDTREE_BUDGET_REPORT`` (the benchmark's engines
set it) inside the step that finds 2 s passed since the last report, after a serving
engine's traffic (``--measured-buckets``'s) and a full step trace; this tree's method
and REV's on the same object, in turns.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from vllm_ddtree.online_budget import OnlineBudget  # noqa: E402


def _config(budget: int, depth: int, max_num_seqs: int):
    spec = types.SimpleNamespace(method="ddtree", ddtree_online_budget=True,
                                 num_speculative_tokens=budget, ddtree_max_depth=depth,
                                 draft_model_config=None)
    return types.SimpleNamespace(
        speculative_config=spec, model_config=None,
        scheduler_config=types.SimpleNamespace(max_num_scheduled_tokens=8192,
                                               max_num_batched_tokens=8192,
                                               max_num_seqs=max_num_seqs),
        compilation_config=types.SimpleNamespace(max_cudagraph_capture_size=1024,
                                                 cudagraph_mode=None))


def _step(batch: int, budget: int, rng: random.Random, variants: int = 16,
          accepted: int = 4):
    """A scheduler output of ``batch`` decoding requests verifying ``budget`` drafts,
    and ``variants`` model-runner outputs accepting 0 to ``accepted`` - 1 of them."""
    ids = [f"req-{i}" for i in range(batch)]
    spec = {r: [-1] * budget for r in ids} if budget else {}
    so = types.SimpleNamespace(num_scheduled_tokens={r: 1 + budget for r in ids},
                               scheduled_spec_decode_tokens=spec,
                               total_num_scheduled_tokens=batch * (1 + budget))
    outs = []
    for _ in range(variants):
        sampled = [[1] * (1 + (min(rng.randrange(accepted), budget) if budget else 0))
                   for _ in ids]
        outs.append(types.SimpleNamespace(sampled_token_ids=sampled,
                                          req_id_to_index={r: i for i, r in enumerate(ids)}))
    return so, outs


# --measured-buckets: what a serving engine's controller holds after traffic where
# drafting does not pay (T=1 on the benchmark pair): 300 steps at each of these batch
# sizes and the timed one, at these budgets in turn, nothing accepted, before the
# timed steps; every bucket then holds measurements and is off.
MEASURED_BATCHES = (64, 16, 4, 2)
MEASURED_BUDGETS = (4, 0, 8, 0)


def online_budget(rng: random.Random, measured_batch: int | None = None):
    """(OnlineBudget, its clock) on the controller's own clock; with ``measured_batch``,
    fed the ``--measured-buckets`` traffic first, that batch size last."""
    clock = types.SimpleNamespace(t=0.0)
    ob = OnlineBudget(_config(64, 15, 1024), None, 1024, clock=lambda: clock.t)
    if measured_batch is not None:
        for n in MEASURED_BATCHES + (measured_batch,):
            for b in MEASURED_BUDGETS:
                so, outs = _step(n, b, rng, 1, accepted=1)
                for _ in range(300):
                    clock.t += 0.003
                    ob.observe(so, outs[0])
    return ob, clock


def time_observe(batch: int, budget: int, steps: int, seed: int = 0,
                 measured_buckets: bool = False) -> dict:
    rng = random.Random(seed)
    ob, clock = online_budget(rng, batch if measured_buckets else None)
    so, outs = _step(batch, budget, rng)
    per_call = []
    for i in range(steps):
        clock.t += 0.004
        t0 = time.perf_counter()
        ob.observe(so, outs[i % len(outs)])
        ob.metrics()
        per_call.append((time.perf_counter() - t0) * 1e6)
    per_call.sort()
    return {"batch": batch, "budget": budget, "steps": steps,
            "measured_buckets": measured_buckets,
            "us_p50": round(statistics.median(per_call), 2),
            "us_p90": round(per_call[int(0.9 * len(per_call))], 2),
            "us_mean": round(statistics.fmean(per_call), 2)}


def module_at(rev: str, relpath: str, name: str):
    """The module ``relpath`` (e.g. ``vllm_ddtree/budget_controller.py``) as git
    revision ``rev`` had it, loaded from ``git show`` under the module name ``name``."""
    import importlib.util
    import subprocess
    import tempfile

    source = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{relpath}"],
                            check=True, capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), f"{name}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def controller_at(rev: str):
    """``BudgetController`` as git revision ``rev`` had it (its module loaded from
    ``git show``, under a name of its own)."""
    return module_at(rev, "vllm_ddtree/budget_controller.py",
                     "budget_controller_baseline").BudgetController


def compare(baseline_rev: str, cells: list[tuple[int, int]], steps: int, rounds: int,
            measured_buckets: bool = False) -> list[dict]:
    """This tree's controller against ``baseline_rev``'s, in turns; per cell the
    per-round means and the median of the paired ratios (this tree / baseline)."""
    from vllm_ddtree import online_budget

    controllers = {"tree": online_budget.BudgetController,
                   "baseline": controller_at(baseline_rev)}
    means: dict = {cell: {"tree": [], "baseline": []} for cell in cells}
    try:
        for r in range(rounds):
            for name in (("tree", "baseline") if r % 2 == 0 else ("baseline", "tree")):
                online_budget.BudgetController = controllers[name]
                for n, b in cells:
                    means[(n, b)][name].append(
                        time_observe(n, b, steps, seed=r,
                                     measured_buckets=measured_buckets)["us_mean"])
    finally:
        online_budget.BudgetController = controllers["tree"]
    return [{"batch": n, "budget": b, "baseline": baseline_rev,
             "us_mean_tree": [round(x, 2) for x in m["tree"]],
             "us_mean_baseline": [round(x, 2) for x in m["baseline"]],
             **paired_ratios(m["tree"], m["baseline"])}
            for (n, b), m in means.items()]


def same_decisions(tree_cls, baseline_cls, traces: int, steps: int) -> dict:
    """Steps where ``tree_cls`` and ``baseline_cls`` (two ``BudgetController``
    classes) fed the same random traces decided differently: a budget, ``observe``'s
    answer, or (every 250 steps and at the end) the whole ``state()``."""
    from vllm_ddtree.budget_controller import StartupCost, StepStats

    def forward(t: int) -> float:
        return 1.0 + 0.004 * max(0, t - 128)

    true_cost = StartupCost(target_forward_ms=forward, drafter_ms=lambda n: 0.6 + 0.01 * n,
                            tree_ms_per_step=0.3, tree_ms_per_node=0.001, host_ms=1.2)
    models = [true_cost, StartupCost(target_forward_ms=1.0, drafter_ms=0.05)]
    differing, total = 0, 0
    for seed in range(traces):
        rng = random.Random(seed)
        model = models[seed % len(models)]
        a = tree_cls(64, 15, model, max_batch_size=256)
        b = baseline_cls(64, 15, model, max_batch_size=256)
        n, quality = rng.choice([1, 4, 16, 64]), rng.random()
        for t in range(steps):
            if rng.random() < 0.01:
                n = rng.choice([1, 2, 3, 4, 6, 8, 15, 16, 31, 64, 100, 200])
            if rng.random() < 0.002:
                quality = rng.random()
            budget = a.budget_for(n)
            total += 1
            if budget != b.budget_for(n):
                differing += 1
                break
            depths = []
            for _ in range(n if budget else 0):
                d = 0
                while d < min(budget, 15) and rng.random() < 0.9 * quality:
                    d += 1
                depths.append(d)
            ms = true_cost(n, budget) * (1.0 + 0.3 * (2 * rng.random() - 1))
            if rng.random() < 0.01:
                ms *= 20.0  # a stall
            stats = StepStats(n, budget, ms, accepted_depths=depths if budget else None,
                              prefill_tokens=5 if rng.random() < 0.03 else 0,
                              drafted_budget=budget)
            if a.observe(stats) != b.observe(stats) or (
                    t % 250 == 0 or t == steps - 1) and json.dumps(
                    a.state(), sort_keys=True) != json.dumps(b.state(), sort_keys=True):
                differing += 1
                break
    return {"traces": traces, "steps_per_trace": steps, "steps_compared": total,
            "traces_that_differed": differing}


def time_report(batch: int, writes: int, rounds: int, baseline_rev: str) -> dict:
    """Microseconds of one ``write_report`` (the mean of ``writes``), this tree's and
    ``baseline_rev``'s on one ``OnlineBudget`` fed a serving engine's traffic, in turns."""
    import tempfile

    from vllm_ddtree import env

    baseline = module_at(baseline_rev, "vllm_ddtree/online_budget.py",
                         "online_budget_baseline").OnlineBudget.write_report
    path = os.path.join(tempfile.mkdtemp(), "online-budget.json")
    saved = os.environ.get(env.BUDGET_REPORT.name)
    os.environ[env.BUDGET_REPORT.name] = path
    try:
        ob, _ = online_budget(random.Random(0), batch)
    finally:
        if saved is None:
            os.environ.pop(env.BUDGET_REPORT.name, None)
        else:
            os.environ[env.BUDGET_REPORT.name] = saved
    fns = {"tree": OnlineBudget.write_report, "baseline": baseline}
    means: dict = {"tree": [], "baseline": []}
    for r in range(rounds):
        for name in (("tree", "baseline") if r % 2 == 0 else ("baseline", "tree")):
            t0 = time.perf_counter()
            for _ in range(writes):
                fns[name](ob, path)
            means[name].append((time.perf_counter() - t0) / writes * 1e6)
    return {"batch": batch, "writes": writes, "baseline": baseline_rev,
            "report_bytes": os.path.getsize(path),
            "us_mean_tree": [round(x, 1) for x in means["tree"]],
            "us_mean_baseline": [round(x, 1) for x in means["baseline"]],
            "us_tree_median": round(statistics.median(means["tree"]), 1),
            "us_baseline_median": round(statistics.median(means["baseline"]), 1),
            **paired_ratios(means["tree"], means["baseline"])}


def paired_ratios(tree: list[float], baseline: list[float]) -> dict:
    """Round by round this tree's figure over the baseline's, and their median."""
    ratios = [t / base for t, base in zip(tree, baseline)]
    return {"tree_over_baseline_paired_median": round(statistics.median(ratios), 3),
            "tree_over_baseline_paired": [round(x, 3) for x in ratios]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--budgets", type=int, nargs="+", default=[0, 8, 64])
    ap.add_argument("--baseline", help="git revision whose controller to time against, in turns")
    ap.add_argument("--rounds", type=int, default=6, help="rounds of turns with --baseline")
    ap.add_argument("--same-decisions", type=int, default=0, metavar="TRACES",
                    help="with --baseline: first compare the two controllers' decisions "
                         "on this many random traces of --steps steps")
    ap.add_argument("--measured-buckets", action="store_true",
                    help="first feed 300 steps at each of batch 64, 16, 4, 2 and the timed "
                         "one (budgets 4, 0, 8, 0 in turn, nothing accepted), so that every "
                         "bucket holds measurements and is off, as in an engine that served "
                         "traffic where drafting does not pay")
    ap.add_argument("--report", type=int, default=0, metavar="WRITES",
                    help="with --baseline: time write_report instead (this many writes a "
                         "round and batch size), this tree's against the baseline's")
    args = ap.parse_args(argv)
    if (args.same_decisions or args.report) and not args.baseline:
        ap.error("--same-decisions and --report need --baseline")
    cells = [(n, b) for n in args.batch_sizes for b in args.budgets]
    decisions = None
    if args.same_decisions:
        from vllm_ddtree.budget_controller import BudgetController
        decisions = same_decisions(BudgetController, controller_at(args.baseline),
                                   args.same_decisions, args.steps)
        print(json.dumps(decisions))
    if args.report:
        rows = [time_report(n, args.report, args.rounds, args.baseline)
                for n in args.batch_sizes]
    elif args.baseline:
        rows = compare(args.baseline, cells, args.steps, args.rounds, args.measured_buckets)
    else:
        rows = [time_observe(n, b, args.steps, measured_buckets=args.measured_buckets)
                for n, b in cells]
    doc = {"command": "python3 bench/online_budget_host.py " + " ".join(
               sys.argv[1:] if argv is None else argv),
           "host": {"machine": platform.machine(), "processor": platform.processor(),
                    "python": platform.python_version(), "cpus": os.cpu_count()},
           "what": (f"host microseconds of OnlineBudget.write_report, this tree's against "
                    f"{args.baseline}'s in turns" if args.report else
                    "host microseconds per step of OnlineBudget.observe + metrics()"
                    + (f", this tree's controller against {args.baseline}'s in turns"
                       if args.baseline else "")),
           "rows": rows}
    if decisions is not None:
        doc["same_decisions"] = decisions
    write_result(args.out, doc)
    return 0


def write_result(path: str, doc: dict) -> None:
    """``doc`` as JSON to ``path``, and its rows, one JSON line each, to stdout."""
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    for r in doc["rows"]:
        print(json.dumps(r))


if __name__ == "__main__":
    sys.exit(main())
