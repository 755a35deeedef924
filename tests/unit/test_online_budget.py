"""DDTree's online budget in vLLM's own scheduler, on the CPU.

vLLM's ``EngineArgs.create_engine_config`` resolves a DDTree configuration as `vllm
serve` would (an H200's device answers, tests/unit/test_ddtree_batch_defaults.py);
then vLLM's real ``AsyncScheduler`` (patch ``core_ddtree-online-budget``) schedules
requests, and the test plays the GPU: each step's output samples the tokens a
drafter of a given quality would have had accepted, and the step takes the time a
cost model says (the controller's clock). The scheduler's own code decides how many
draft tokens it schedules (``num_spec_tokens_to_schedule``) from the lookup the
controller writes.

Needs the patched vLLM (``./apply.sh``).
"""

from __future__ import annotations

import os
import random
import time

import pytest

pytest.importorskip("vllm")
import torch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from tests.unit.test_ddtree_batch_defaults import (  # noqa: E402,F401
    _server_config,
    h200,
    models,
)
from vllm_ddtree.cost_model import provisional_schedule  # noqa: E402
from vllm_ddtree.online_budget import graph_query_lens, online_budget_on  # noqa: E402

BUDGET = 8
DEPTH = 15


def _config(models, **spec):
    return _server_config(models, spec=dict({"method": "ddtree",
                                             "num_speculative_tokens": BUDGET}, **spec),
                          max_num_seqs=16, max_model_len=32768, enable_prefix_caching=False)


def _scheduler(cfg, log_stats: bool = False) -> Scheduler:
    """vLLM's scheduler for ``cfg``, the class its engine core picks (AsyncScheduler
    with asynchronous scheduling)."""
    cfg.cache_config.num_gpu_blocks = 16384  # what the engine core sets after profiling
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=16,
                             dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=16384, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layers.0"], spec)])
    cls = AsyncScheduler if cfg.scheduler_config.async_scheduling else Scheduler
    return cls(cfg, kv, StructuredOutputManager(cfg), block_size=16, log_stats=log_stats)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def step_ms(batch: int, drafts: int) -> float:
    """A GPU where drafting costs 40 % of a plain step (the drafter and the tree)."""
    return 5.0 * (1.4 if drafts else 1.0) * (1.0 + 0.002 * batch * (drafts + 1))


class Serving:
    """The scheduler with the test as its GPU: ``quality`` is the chance that each
    next draft token along the path is accepted. Works for plain decoding's scheduler
    too (no controller); ``times`` holds each step's host seconds in ``schedule()`` and
    in ``update_from_output()`` (``bench/scheduler_host.py``)."""

    def __init__(self, scheduler: AsyncScheduler, num_requests: int, seed: int = 0,
                 temperature: float = 1.0) -> None:
        self.s = scheduler
        self.clock = Clock()
        budget = getattr(scheduler, "ddtree_budget", None)
        if budget is not None:
            budget._clock = self.clock
        self.rng = random.Random(seed)
        self.req_ids: list[str] = []
        self.add(num_requests, temperature)
        self.stats: list = []  # the SchedulerStats of each step (log_stats)
        self.scheduled: list[int] = []  # num_spec_tokens_to_schedule per step
        self.times: list[tuple[float, float]] = []  # (schedule, update) seconds per step

    def add(self, num_requests: int, temperature: float) -> None:
        """``num_requests`` more requests (SamplingParams' default T=1: sampled)."""
        start = len(self.req_ids)
        for i in range(start, start + num_requests):
            self.req_ids.append(f"r{i}")
            self.s.add_request(Request(f"r{i}", list(range(10, 42)),
                                       SamplingParams(max_tokens=100_000, ignore_eos=True,
                                                      temperature=temperature), None))

    def abort_all(self) -> None:
        from vllm.v1.request import RequestStatus

        self.s.finish_requests(self.req_ids, RequestStatus.FINISHED_ABORTED)

    def run(self, steps: int, quality: float) -> list[int]:
        verified = []
        for _ in range(steps):
            t0 = time.perf_counter()
            out = self.s.schedule()
            t1 = time.perf_counter()
            self.scheduled.append(out.num_spec_tokens_to_schedule)
            req_ids = list(out.num_scheduled_tokens)
            sampled = []
            drafts_max = 0
            for r in req_ids:
                drafts = len(out.scheduled_spec_decode_tokens.get(r, ()))
                drafts_max = max(drafts_max, drafts)
                accepted = 0
                while accepted < min(drafts, DEPTH) and self.rng.random() < quality:
                    accepted += 1
                sampled.append([7] * (1 + accepted))
            verified.append(drafts_max)
            self.clock.t += step_ms(len(req_ids), drafts_max) / 1e3
            result = ModelRunnerOutput(
                req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=sampled)
            t2 = time.perf_counter()
            outputs = self.s.update_from_output(out, result)
            self.times.append((t1 - t0, time.perf_counter() - t2))
            self.stats.extend(o.scheduler_stats for o in outputs.values()
                              if o.scheduler_stats is not None)
        return verified


def test_on_by_default_with_a_full_budget_cap_and_graphs_for_every_level(models, h200):
    cfg = _config(models)
    spec = cfg.speculative_config
    assert spec.ddtree_online_budget is True and online_budget_on(spec)
    # vLLM's dynamic speculative decoding is on, capped at the full budget.
    assert spec.num_speculative_tokens_per_batch_size == provisional_schedule(BUDGET, None)
    # Decode graphs for budgets 0, 1, 2, 4 and 8 (query lengths + the bonus token).
    assert graph_query_lens(cfg, [BUDGET + 1], 1) == [1, 2, 3, 5, 9]
    off = _config(models, ddtree_online_budget=False)
    assert off.speculative_config.ddtree_online_budget is False
    assert off.speculative_config.num_speculative_tokens_per_batch_size is None
    assert graph_query_lens(off, [BUDGET + 1], 1) == [BUDGET + 1]


def test_the_scheduler_turns_drafting_off_when_nothing_is_accepted(models, h200):
    s = _scheduler(_config(models))
    assert s.dynamic_sd_lookup is s.ddtree_budget.lookup
    serving = Serving(s, 4)
    verified = serving.run(600, quality=0.0)
    # It starts by drafting (its prior), then measures and stops.
    assert max(verified[:40]) > 0
    tail = verified[-200:]
    assert sum(1 for v in tail if v) / len(tail) < 0.1, tail
    assert s.dynamic_sd_lookup[4] == 0 or s.ddtree_budget.controller.choice_for(4) == 0
    # The report says why: the sampled class's switch off, with its estimates.
    switches = s.ddtree_budget.state()["recent_switches"]
    assert set(switches) == {"sampled"}
    assert switches["sampled"]["4-7"][-1]["to"] == 0


def test_the_scheduler_drafts_when_drafts_are_accepted_and_comes_back(models, h200):
    s = _scheduler(_config(models))
    serving = Serving(s, 4, seed=1)
    serving.run(600, quality=0.0)
    assert s.ddtree_budget.controller.choice_for(4) == 0
    verified = serving.run(3000, quality=0.9)
    tail = verified[-300:]
    # Back on, at a budget the scheduler really verifies (placeholders it scheduled).
    assert s.ddtree_budget.controller.choice_for(4) > 0
    assert sum(1 for v in tail if v) / len(tail) > 0.8, tail
    state = s.ddtree_budget.state()
    assert state["steps_observed"] == 3600
    assert "4-7" in state["buckets"]


def test_greedy_and_sampled_steps_each_have_their_controller(models, h200):
    """Greedy requests whose drafts are accepted, then sampled requests whose drafts
    are not, then greedy ones again: the sampled steps turn drafting off in their own
    controller, and when greedy requests come back the scheduler drafts again at once,
    from the greedy controller's measurements, without probing its way back."""
    s = _scheduler(_config(models))
    ob = s.ddtree_budget
    serving = Serving(s, 4, seed=5, temperature=0.0)
    serving.run(800, quality=0.9)
    assert ob.sampling_class == "greedy"
    greedy_choice = ob.controllers["greedy"].choice_for(4)
    assert greedy_choice > 0 and ob.controllers["sampled"].steps == 0
    serving.abort_all()
    serving.add(4, temperature=1.0)
    verified = serving.run(800, quality=0.0)
    assert ob.sampling_class == "sampled" and ob.controllers["sampled"].choice_for(4) == 0
    assert sum(1 for v in verified[-200:] if v) / 200 < 0.1
    # The sampled steps left the greedy controller's table as it was.
    assert ob.controllers["greedy"].choice_for(4) == greedy_choice
    serving.abort_all()
    serving.add(4, temperature=0.0)
    verified = serving.run(20, quality=0.9)
    # The first step prefills the new requests; every decode step after it drafts.
    assert ob.sampling_class == "greedy" and all(v > 0 for v in verified[2:]), verified
    state = ob.state()
    assert state["sampling_class"] == "greedy"
    assert set(state["by_sampling"]) == {"greedy", "sampled"}
    assert "[greedy]" in ob.log_line() and "[sampled]" in ob.log_line()
    # A step mixing both kinds of requests is a sampled step.
    serving.add(1, temperature=1.0)
    serving.run(5, quality=0.9)
    assert ob.sampling_class == "sampled"


def test_a_user_schedule_caps_the_controller(models, h200):
    cfg = _config(models, ddtree_tokens_per_step=20)
    s = _scheduler(cfg)
    caps = s.ddtree_budget.controller.max_budget_by_batch
    assert caps is not None and caps[4] == 4  # 20 // 4 - 1 = 4
    serving = Serving(s, 4, seed=2)
    verified = serving.run(1500, quality=0.95)
    assert max(verified) <= 4 and max(verified[-300:]) > 0


@pytest.mark.parametrize("num_requests", [1, 4])
def test_a_schedule_of_budget_0_never_drafts_nor_probes(models, h200, num_requests):
    """A cap of 0 at every batch size (``bench/run.py``'s ``ddtree-b<B>-d1``, for
    profiling the budget-0 step at batch 1): the controller has nothing to choose or
    probe, even where drafts would be accepted."""
    from vllm_ddtree.budget import OPEN_END

    cfg = _config(models, num_speculative_tokens_per_batch_size=[[1, OPEN_END, 0]])
    assert [tuple(r) for r in cfg.speculative_config.num_speculative_tokens_per_batch_size] \
        == [(1, OPEN_END, 0)]
    s = _scheduler(cfg)
    serving = Serving(s, num_requests, seed=3, temperature=0.0)
    verified = serving.run(1500, quality=0.95)
    assert set(verified) == {0} and set(serving.scheduled) == {0}
    state = s.ddtree_budget.state()
    assert all(b["probes"] == 0 and b["choice"] == 0
               for b in state["by_sampling"]["greedy"]["buckets"].values())


def test_sync_scheduling_leaves_the_online_budget_off_or_refuses_it(models, h200):
    cfg = _server_config(models, spec={"method": "ddtree", "num_speculative_tokens": BUDGET},
                         max_num_seqs=16, async_scheduling=False)
    assert cfg.speculative_config.ddtree_online_budget is False
    assert cfg.speculative_config.num_speculative_tokens_per_batch_size is None
    # vLLM's config validation reports the DDTreeConfigError (a ValueError).
    with pytest.raises(ValueError, match="ddtree_online_budget needs asynchronous"):
        _server_config(models, spec={"method": "ddtree", "num_speculative_tokens": BUDGET,
                                     "ddtree_online_budget": True},
                       max_num_seqs=16, async_scheduling=False)



def _so(sched, spec, drafted=None):
    """A scheduler output; ``drafted``: its num_spec_tokens_to_schedule (the budget the
    step drafts for the next one), None for an output without the field."""
    import types
    out = types.SimpleNamespace(num_scheduled_tokens=sched, scheduled_spec_decode_tokens=spec)
    if drafted is not None:
        out.num_spec_tokens_to_schedule = drafted
    return out


def _mro(sampled):
    import types
    ids = list(sampled)
    return types.SimpleNamespace(sampled_token_ids=[sampled[r] for r in ids],
                                 req_id_to_index={r: i for i, r in enumerate(ids)})


def test_observe_reads_the_step_and_skips_what_is_not_a_decode_step(models, h200):
    from vllm_ddtree.online_budget import OnlineBudget

    seen = []
    ob = OnlineBudget(_config(models), None, 16, clock=Clock())
    ob.controller.observe = lambda stats: seen.append(stats) or False
    clock = ob._clock
    clock.t = 1.0
    # A tree step of budget 8: one request cut short to 3 drafts (not a budget-8 sample).
    ob.observe(_so({"a": 9, "b": 9, "c": 4}, {"a": [-1] * 8, "b": [-1] * 8, "c": [-1] * 3}),
               _mro({"a": [1, 2, 3], "b": [1], "c": [1, 2, 3, 4]}))
    clock.t += 0.004
    ob.observe(_so({"a": 9, "b": 9}, {"a": [-1] * 8, "b": [-1] * 8}),
               _mro({"a": [1] * 6, "b": [1]}))
    # A step that also prefilled a joining request: acceptance only.
    clock.t += 0.020
    ob.observe(_so({"a": 9, "d": 40}, {"a": [-1] * 8}), _mro({"a": [1], "d": [1]}))
    # An empty step (the engine idles), then a decode step: its interval is unknown.
    ob.observe(_so({}, {}), _mro({}))
    clock.t += 5.0
    ob.observe(_so({"a": 1}, {}), _mro({"a": [1]}))
    first, second, joined, after_idle = seen
    assert first.prefill_tokens > 0  # no previous output: no interval
    assert (second.batch_size, second.budget, second.depth_hits) == (2, 8, [2, 1, 1, 1, 1, 1, 0, 0, 0])
    assert second.prefill_tokens == 0 and abs(second.step_ms - 4.0) < 1e-9
    assert first.depth_hits == [2, 1, 1, 0, 0, 0, 0, 0, 0]  # "c" verified a 3-node tree
    assert joined.prefill_tokens == 39 and joined.depth_hits == [1] + [0] * 8
    assert after_idle.budget == 0 and after_idle.prefill_tokens > 0
    assert first.drafted_budget is None  # an output without num_spec_tokens_to_schedule


def test_an_interval_shorter_than_the_forward_is_not_a_step(models, h200):
    """Two outputs handled back to back (a wave's end, after a stall) are closer than
    any step can be: below 0.7x the target's forward measured at start-up for the
    step's batch, the interval feeds acceptance only. Without a measurement (the
    fallback curve) nothing is below a floor."""
    from vllm_ddtree.online_budget import MIN_STEP_FORWARD_SHARE, OnlineBudget

    forward = {1: 1.0, 4: 1.2, 64: 2.0}
    for measured in (forward, None):
        seen = []
        ob = OnlineBudget(_config(models), None, 16, forward_ms=measured, clock=Clock())
        ob.controller.observe = lambda stats: seen.append(stats) or False
        for gap_ms, reqs in ((2.0, "a"), (0.5, "a"), (1.5, "a"), (0.72, "a"), (0.9, "abcd"),
                             (0.8, "abcd")):
            ob._clock.t += gap_ms / 1e3
            ob.observe(_so(dict.fromkeys(reqs, 1), {}), _mro({r: [1] for r in reqs}))
        timed = [round(x.step_ms, 6) for x in seen if x.prefill_tokens == 0]
        if measured:
            # 1 request: floor 0.7 ms; 4 requests: 0.7 x 1.2 = 0.84 ms.
            assert MIN_STEP_FORWARD_SHARE == 0.7
            assert timed == [1.5, 0.72, 0.9]
        else:
            assert timed == [0.5, 1.5, 0.72, 0.9, 0.8]
        assert seen[0].prefill_tokens > 0  # no previous output: no interval


def test_observe_marks_steps_that_drafted_another_budget(models, h200):
    """The budget a step drafts is the scheduler's num_spec_tokens_to_schedule (at a
    level: 5 drafts are a budget-4 tree); the controller keeps such steps out of the
    cost of the budget they verified."""
    from vllm_ddtree.online_budget import OnlineBudget

    seen = []
    ob = OnlineBudget(_config(models), None, 16, clock=Clock())
    ob.controller.observe = lambda stats: seen.append(stats) or False
    for drafted in (8, 0, 0, 5):
        ob._clock.t += 0.004
        ob.observe(_so({"a": 9}, {"a": [-1] * 8}, drafted), _mro({"a": [1, 2]}))
    assert [(x.budget, x.drafted_budget) for x in seen] == [(8, 8), (8, 0), (8, 0), (8, 4)]


def test_the_controller_keeps_steps_between_two_budgets_out_of_the_cost():
    from vllm_ddtree.budget_controller import BudgetController, StepStats

    def cost(n, b):
        return 2.0 + 0.1 * b

    def estimate(ctl):
        return ctl.state()["buckets"]["2-3"]["step_ms"]

    a, b = BudgetController(8, 8, cost, max_batch_size=4), BudgetController(8, 8, cost,
                                                                              max_batch_size=4)
    for ctl in (a, b):
        for _ in range(40):
            ctl.observe(StepStats(2, 0, 2.0, drafted_budget=0))
    # b also sees the last step of a probe of 0: it verified no drafts, but drafted 8.
    for _ in range(8):
        b.observe(StepStats(2, 0, 9.0, drafted_budget=8))
        a.observe(StepStats(2, 0, 9.0, prefill_tokens=5))
    assert estimate(a) == estimate(b)
    assert estimate(b)["0"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="drafted budget 3"):
        a.observe(StepStats(2, 0, 2.0, drafted_budget=3))


def test_the_budget_reaches_vllms_prometheus_metrics(models, h200):
    """The scheduler's stats carry the controller's summary; vLLM's Prometheus logger
    turns it into gauges (what `vllm serve` exposes at /metrics)."""
    import prometheus_client
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    cfg = _config(models)
    s = _scheduler(cfg, log_stats=True)
    serving = Serving(s, 4, seed=3)
    serving.run(300, quality=0.0)
    # Each step's stats carry the summary only when it was rebuilt (a table change,
    # or every METRICS_REFRESH_STEPS steps): Prometheus gauges keep their values, so
    # the steps between send nothing to serialise and set.
    from vllm_ddtree.online_budget import METRICS_REFRESH_STEPS

    sent = [st.ddtree_budget for st in serving.stats if st.ddtree_budget is not None]
    assert len(serving.stats) == 300
    assert 300 // METRICS_REFRESH_STEPS <= len(sent) <= 60
    assert sent[-1] == s.ddtree_budget.metrics()
    # Serving's requests are sampled (T=1): the sampled class's controller.
    assert list(sent[-1]["sampling"]) == ["sampled"]
    assert sent[-1]["sampling"]["sampled"]["budget"]["4-7"] == s.dynamic_sd_lookup[4]
    logger = PrometheusStatLogger(cfg)
    for st in serving.stats:
        logger.record(st, None)
    text = prometheus_client.generate_latest().decode()
    budget = [line for line in text.splitlines()
              if line.startswith("vllm:ddtree_budget{") and 'bucket="4-7"' in line
              and 'sampling="sampled"' in line]
    assert len(budget) == 1 and budget[0].endswith(f" {float(s.dynamic_sd_lookup[4])}")
    assert 'vllm:ddtree_accepted_tokens_per_step{' in text
    assert 'vllm:ddtree_expected_tokens_per_step{' in text
    # Nothing accepted: every measured budget shows 0 accepted tokens.
    measured = [line for line in text.splitlines()
                if line.startswith("vllm:ddtree_accepted_tokens_per_step{")]
    assert measured and all(line.endswith(" 0.0") for line in measured)
    # A step that sent nothing leaves the gauges as they were.
    assert serving.stats[-1].ddtree_budget is None or s.make_stats().ddtree_budget is None
    def ddtree_lines(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith("vllm:ddtree_")]

    logger.record(s.make_stats(), None)
    assert ddtree_lines(prometheus_client.generate_latest().decode()) == ddtree_lines(text)


def test_the_summary_survives_the_engine_core_to_front_end_message():
    """SchedulerStats travel from the engine core to the front end in vLLM's msgpack
    encoding of EngineCoreOutputs."""
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    summary = {"sampling": {
        "greedy": {"budget": {"1-1": 32, "4-7": 0}, "expected_tokens_per_step": {"1-1": 1.8},
                   "accepted_measured": {"1-1": {"4": 0.21, "32": 0.8}}},
        "sampled": {"budget": {"1-1": 0}, "expected_tokens_per_step": {"1-1": 1.0},
                    "accepted_measured": {"1-1": {"4": 0.05}}}}}
    out = EngineCoreOutputs(scheduler_stats=SchedulerStats(ddtree_budget=summary))
    frames = MsgpackEncoder().encode(out)
    back = MsgpackDecoder(EngineCoreOutputs).decode(frames)
    assert back.scheduler_stats.ddtree_budget == summary


def _report_after_three_steps(models, tmp_path, monkeypatch):
    """A controller's report (VLLM_DDTREE_BUDGET_REPORT) after three batch-1 steps that
    verified budget 8, 3 ms apart."""
    from vllm_ddtree.online_budget import OnlineBudget

    report = tmp_path / "budget.json"
    monkeypatch.setenv("VLLM_DDTREE_BUDGET_REPORT", str(report))
    ob = OnlineBudget(_config(models), None, 16, clock=Clock())
    ob._clock.t = 1.0
    for _ in range(3):
        ob.observe(_so({"a": 9}, {"a": [-1] * 8}), _mro({"a": [1, 2]}))
        ob._clock.t += 0.003
    ob.write_report(str(report))
    return report


def test_the_report_keeps_recent_steps(models, h200, tmp_path, monkeypatch):
    import json

    report = _report_after_three_steps(models, tmp_path, monkeypatch)
    state = json.loads(report.read_text())
    steps = state["recent_steps"]["steps"]
    fields = state["recent_steps"]["fields"]
    assert fields[:3] == ["batch", "budget", "drafted_budget"]
    assert len(steps) == 3 and steps[-1][:5] == [1, 8, None, 1, 1.0]
    assert abs(steps[-1][5] - 3.0) < 1e-6 and steps[-1][6] == 0


def test_the_benchmark_keeps_the_cells_bucket_from_the_report(models, h200, tmp_path,
                                                              monkeypatch):
    """bench/run.py records, after each cell, the controller's bucket for the cell's
    batch from the report the engine core rewrites (written whole, then moved into
    place, so the reader never finds half a file)."""
    import json

    from bench.run import budget_bucket_snapshot

    report = _report_after_three_steps(models, tmp_path, monkeypatch)
    assert sorted(os.listdir(tmp_path)) == ["budget.json"]
    snap = budget_bucket_snapshot(str(report), 1)
    bucket = json.loads(report.read_text())["buckets"][snap["bucket"]]
    assert snap["bucket"].split("-")[0] == "1" and snap["choice"] == bucket["choice"]
    assert snap["steps"] == 3 and snap["step_ms"] == bucket["step_ms"]
    assert snap["sampling_class"] == "greedy"
    assert budget_bucket_snapshot(str(report), 10 ** 6) is None   # no bucket holds it
    assert budget_bucket_snapshot(str(tmp_path / "none.json"), 1) is None
    report.write_text('{"buckets": {"1-1": ')                     # half a file
    assert budget_bucket_snapshot(str(report), 1) is None


def test_the_report_is_rewritten_every_interval_without_a_change(models, h200, tmp_path,
                                                                  monkeypatch):
    """The state file follows the steps (every REPORT_INTERVAL_S), not only the last
    change of the table: a reader at the end of a run finds its last steps."""
    import json

    from vllm_ddtree import online_budget
    from vllm_ddtree.online_budget import OnlineBudget

    report = tmp_path / "budget.json"
    monkeypatch.setenv("VLLM_DDTREE_BUDGET_REPORT", str(report))
    ob = OnlineBudget(_config(models), None, 16, clock=Clock())
    ob._clock.t = 1.0
    ob.observe(_so({"a": 9}, {"a": [-1] * 8}), _mro({"a": [1, 2]}))
    first = json.loads(report.read_text())["steps_observed"]
    steps = 0
    while ob._clock.t < 1.0 + online_budget.REPORT_INTERVAL_S * 1.5:
        ob._clock.t += 0.003
        ob.observe(_so({"a": 9}, {"a": [-1] * 8}), _mro({"a": [1, 2]}))
        steps += 1
    later = json.loads(report.read_text())["steps_observed"]
    assert first == 1
    assert later > first + steps // 2
