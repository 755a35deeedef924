"""The online tree budget in the engine: one :class:`BudgetController` beside vLLM's
scheduler (``ddtree_online_budget``, on by default with asynchronous scheduling).

Patch ``core_ddtree-online-budget`` adds three calls into vLLM:

* ``Scheduler.__init__`` builds :class:`OnlineBudget` (:func:`make_online_budget`)
  and hands the scheduler its :attr:`OnlineBudget.lookup` as ``dynamic_sd_lookup``:
  the list vLLM's dynamic speculative decoding already indexes by batch size every
  step (``num_spec_tokens_to_schedule``). The controller rewrites that list in place,
  so a decision costs the scheduler what a static schedule costs: one list lookup.
* ``Scheduler.update_from_output`` calls :meth:`OnlineBudget.observe` with the step's
  output: batch size, the budget the step verified, each tree-verifying request's
  accepted depth (sampled tokens - 1, what vLLM's own spec-decode counters read) and
  the step's wall time (the interval since the previous output: with asynchronous
  scheduling, the engine's period per step; an interval longer than ``MAX_STEP_MS`` or
  shorter than ``MIN_STEP_FORWARD_SHARE`` of the target's forward at that batch is no
  step's, and feeds acceptance only). Nothing waits on the GPU: the output
  is what the engine core receives anyway, one step after it was scheduled.
* the V2 runner's CUDA graph manager captures target decode graphs for every level
  the controller may choose (:func:`graph_budget_levels`), so a change of budget
  never leaves the graphs.

**Two controllers, by sampling.** How often drafts are accepted depends on the
requests' temperature far more than on anything else the scheduler knows (on the
benchmark pair, held-out chat: tau 2.0-2.7 greedy, 1.3-1.5 at T=1), so one controller
learns from the steps whose requests are all greedy and another from the steps with at
least one sampled request (temperature > 0). The lookup the scheduler reads is the
table of the class of the step last observed (the next step's batch is that one but
for the requests that join or finish): a switch of traffic between greedy and sampled
requests finds that class's measurements instead of learning again, and each class
probes on its own steps. The set of live sampled requests is kept from each step's new
and finished requests, so a step costs one set comparison.

The worker does not recompute the budget: the scheduler's
``num_spec_tokens_to_schedule`` reaches it with each step
(``DDTreeSpeculator.prepare_tree_verification``, ``TreeVerifier.prepare``), so with
tensor parallelism every rank follows the one decision of the engine core.

The step-cost model the controller starts from is the target's forward measured at
start-up (:func:`vllm_ddtree.cost_model.measure_target_forward_ms`, the same
measurement ``ddtree_tokens_per_step="auto"`` uses; it runs whenever the controller
is on) plus a drafter term scaled from it by layer count; the controller corrects
both from the measured step times, and probes budget 0 while drafting, which
measures what the drafter really costs.
"""

from __future__ import annotations

import bisect
import collections
import json
import logging
import math
import os
import time
from typing import Any

from vllm_ddtree import env
from vllm_ddtree.budget import budget_levels, table_ranges
from vllm_ddtree.budget_controller import BudgetController, StartupCost, StepStats, curve_value
from vllm_ddtree.cost_model import largest_cuda_graph_tokens, measured_forward_ms

logger = logging.getLogger("vllm.ddtree")

# A step whose interval since the previous output is longer than this is not a decode
# step's time (the engine was idle, or waited for requests): it feeds acceptance only.
MAX_STEP_MS = 1000.0
# ... and one shorter than this share of the target's forward at the step's batch (its
# GPU time measured at start-up) is not one either: a step cannot end sooner than its
# forward does, so such an interval is two outputs handled back to back (at the end of
# a wave, after a stall), which fed the buckets there step times far below any step's
# (0.48 ms at batch 1 on the benchmark pair, whose steps take ~1.5 ms and whose
# forward measured 1.03 ms). The share leaves room for a forward that runs faster while
# serving than when it was measured.
MIN_STEP_FORWARD_SHARE = 0.7
# The step time such a step (or one after the engine idled, with no output before it)
# is recorded with: a placeholder its statistics do not read as a decode step's time
# (it counts as prefilling); the step trace shows it as is (bench/step_trace.py).
UNTIMED_STEP_MS = 1.0
# Seconds between two log lines about the controller (each change of the table is
# logged, at most this often).
LOG_INTERVAL_S = 10.0
# Seconds between two writes of the state file (VLLM_DDTREE_BUDGET_REPORT), changed or
# not: its step trace moves every step, and a reader (bench/run.py, when an engine is
# done) should find the last few seconds in it, not the state of the last table change.
REPORT_INTERVAL_S = 2.0
# Steps kept for the report (VLLM_DDTREE_BUDGET_REPORT): each observed step's batch,
# budget verified, budget drafted, requests sampled, mean accepted depth, step time and
# prefill tokens.
TRACE_STEPS = 512
# Steps between two refreshes of the summary /metrics shows (also refreshed whenever
# the budget table changes).
METRICS_REFRESH_STEPS = 64
# Without a start-up measurement (the controller's cost model needs some curve): a
# forward flat up to this many tokens, then linear, in arbitrary units; the measured
# step times correct it.
FALLBACK_KNEE_TOKENS = 128
# The drafter's share of a target forward when either model's layer count is unknown.
FALLBACK_DRAFTER_SHARE = 0.25
# The controllers' classes of steps: every request greedy, or at least one sampled.
SAMPLING_CLASSES = ("greedy", "sampled")


def is_sampled(sampling_params: Any) -> bool:
    """A request vLLM samples (not greedy): its ``sampling_type`` is not GREEDY
    (temperature 0, as vLLM decides it). Pooling requests (no sampling) count as greedy."""
    kind = getattr(sampling_params, "sampling_type", None)
    return kind is not None and getattr(kind, "name", str(kind)) != "GREEDY"


def online_budget_on(spec_config: Any) -> bool:
    """True when a DDTree engine runs the online controller (resolved at start-up by
    :func:`vllm_ddtree.config.validate_ddtree_vllm_config`; None counts as on)."""
    if spec_config is None or getattr(spec_config, "method", None) != "ddtree":
        return False
    return getattr(spec_config, "ddtree_online_budget", None) is not False


def graph_budget_levels(vllm_config: Any) -> list[int]:
    """The budgets the controller may choose, ascending, 0 (no drafting) first: the
    tree budget B and the powers of two below it. The target's decode graphs are
    captured for each (query length = budget + 1)."""
    spec = vllm_config.speculative_config
    return [0] + sorted(budget_levels(int(spec.num_speculative_tokens)))


def graph_query_lens(vllm_config: Any, query_lens: list[int],
                     sampled_per_step: int) -> list[int]:
    """The target's decode query lengths to capture graphs for (the V2 runner's graph
    manager, patch ``core_ddtree-online-budget``): those of the schedule and, with the
    online controller, one per level (budget + the tokens sampled per step)."""
    if not online_budget_on(getattr(vllm_config, "speculative_config", None)):
        return list(query_lens)
    levels = graph_budget_levels(vllm_config)
    return sorted(set(query_lens) | {b + sampled_per_step for b in levels})


def single_token_graph_lens(vllm_config: Any) -> list[int]:
    """Under ``cudagraph_mode`` FULL vLLM captures only mixed graphs, which a DDTree
    engine captures with the tree bias (a tree may replay them), so its steps that draft
    nothing run the attention kernel compiled with the bias. With
    ``VLLM_DDTREE_SINGLE_TOKEN_GRAPHS`` (on by default) the V2 runner's graph manager (patch
    ``v2-runner_ddtree-single-token-decode-graphs``) also captures FULL decode graphs of
    one query token per request, without the bias: ``[1]``, else ``[]``. Modes with a
    separate decode routine capture decode graphs of every length anyway."""
    from vllm_ddtree.env import single_token_graphs_enabled

    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or getattr(spec, "method", None) != "ddtree":
        return []
    if not single_token_graphs_enabled():
        return []
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    if mode is None or mode.separate_routine() or not mode.has_full_cudagraphs():
        return []
    return [1]


def fallback_forward_ms(tokens: int) -> float:
    return 1.0 + max(0, tokens - FALLBACK_KNEE_TOKENS) / FALLBACK_KNEE_TOKENS


def startup_cost(vllm_config: Any, forward_ms: dict[int, float] | None) -> StartupCost:
    """The controller's step-time model: the target's forward against verified tokens
    (the start-up measurement, else :func:`fallback_forward_ms`), and a drafter that
    costs its share of layers of a target forward over its query (1 + depth tokens
    per request). Only ratios matter before the controller has measured steps."""
    spec = vllm_config.speculative_config
    curve: Any = dict(forward_ms) if forward_ms else fallback_forward_ms
    target_layers = _num_layers(getattr(vllm_config, "model_config", None))
    drafter_layers = _num_layers(getattr(spec, "draft_model_config", None))
    share = (drafter_layers / target_layers if target_layers and drafter_layers
             else FALLBACK_DRAFTER_SHARE)
    query = 1 + int(spec.ddtree_max_depth)
    return StartupCost(target_forward_ms=curve,
                       drafter_ms=lambda n: share * curve_value(curve, n * query))


def _num_layers(model_config: Any) -> int | None:
    hf = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    n = getattr(hf, "num_hidden_layers", None)
    return int(n) if isinstance(n, int) and n > 0 else None


class OnlineBudget:
    """The controller and the scheduler's lookup it writes (module docstring)."""

    def __init__(self, vllm_config: Any, static_lookup: list[int] | None,
                 max_num_seqs: int, forward_ms: dict[int, float] | None = None,
                 clock=time.perf_counter) -> None:
        spec = vllm_config.speculative_config
        self.max_budget = int(spec.num_speculative_tokens)
        self.max_depth = int(spec.ddtree_max_depth)
        self.levels = graph_budget_levels(vllm_config)
        scheduler = vllm_config.scheduler_config
        verified_cap = getattr(scheduler, "max_num_scheduled_tokens", None) or \
            getattr(scheduler, "max_num_batched_tokens", None)
        graphs = largest_cuda_graph_tokens(vllm_config)
        if graphs is not None:
            # A decode step larger than the largest CUDA graph runs without one.
            verified_cap = min(verified_cap, graphs) if verified_cap else graphs
        self.max_num_seqs = int(max_num_seqs)
        cost = startup_cost(vllm_config, forward_ms)
        # The shortest interval that counts as a step, by batch size (none without a
        # start-up measurement: the fallback curve is no time).
        self._min_step_ms = [0.0] + [
            MIN_STEP_FORWARD_SHARE * curve_value(forward_ms, n) if forward_ms else 0.0
            for n in range(1, self.max_num_seqs + 1)]
        self.controllers = {
            c: BudgetController(
                self.max_budget, self.max_depth, cost,
                max_batch_size=self.max_num_seqs, levels=self.levels,
                max_verified_tokens=verified_cap,
                # The user's (or "auto"'s) schedule is a cap by batch size.
                max_budget_by_batch=static_lookup,
            ) for c in SAMPLING_CLASSES}
        # The class whose table the lookup holds: that of the step last observed.
        self.sampling_class = SAMPLING_CLASSES[0]
        self._sampled_ids: set[str] = set()
        self.lookup: list[int] = self.controller.budget_table(self.max_num_seqs)
        self._clock = clock
        self._last_output_t: float | None = None
        self._last_log_t = self._last_report_t = -math.inf
        self._changed_since_log = False
        self.report_path = env.budget_report_path()
        self.steps_observed = 0
        self._metrics: dict | None = None
        self._metrics_sent = False
        self._trace = collections.deque(maxlen=TRACE_STEPS) if self.report_path else None
        logger.info("DDTree online budget: levels %s, start %s", self.levels,
                    table_ranges(self.lookup))

    @property
    def controller(self) -> BudgetController:
        """The controller whose table the scheduler reads now (:attr:`sampling_class`)."""
        return self.controllers[self.sampling_class]

    def _step_class(self, scheduler_output: Any) -> str:
        """The class of the step: keeps the set of live sampled requests from the step's
        new and finished requests, then "sampled" if one of them is scheduled."""
        sampled = self._sampled_ids
        finished = getattr(scheduler_output, "finished_req_ids", None)
        if finished and sampled:
            sampled.difference_update(finished)
        for req in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
            if is_sampled(getattr(req, "sampling_params", None)):
                sampled.add(req.req_id)
        if sampled and not sampled.isdisjoint(scheduler_output.num_scheduled_tokens):
            return "sampled"
        return "greedy"

    def _level(self, drafts: int) -> int:
        """The largest level at most ``drafts`` (a step whose requests were all cut
        short of the scheduled budget, e.g. near max_model_len)."""
        return self.levels[bisect.bisect_right(self.levels, drafts) - 1]

    def observe(self, scheduler_output: Any, model_runner_output: Any) -> None:
        """One step's output (the scheduler's hook in ``update_from_output``)."""
        now = self._clock()
        last, self._last_output_t = self._last_output_t, now
        num_scheduled = scheduler_output.num_scheduled_tokens
        step_class = self._step_class(scheduler_output)
        if not num_scheduled:
            self._last_output_t = None  # an empty step: the engine is idle
            return
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        sampled = model_runner_output.sampled_token_ids
        index = model_runner_output.req_id_to_index
        drafts_max, prefill, verified = 0, 0, []
        if not spec_tokens:
            # No drafts verified (budget 0): no per-request work on the host, which
            # sets the pace of these steps on small targets.
            total = getattr(scheduler_output, "total_num_scheduled_tokens", None)
            if total is None:
                total = sum(num_scheduled.values())
            prefill = total - len(num_scheduled)
        else:
            get_spec, get_index, num_rows = spec_tokens.get, index.get, len(sampled or ())
            for req_id, n in num_scheduled.items():
                spec = get_spec(req_id)
                drafts = len(spec) if spec else 0
                if n > 1 + drafts:
                    prefill += n - 1 - drafts
                if drafts:
                    if drafts > drafts_max:
                        drafts_max = drafts
                    i = get_index(req_id)
                    if i is not None and i < num_rows:
                        row = len(sampled[i])
                        if row:
                            verified.append((drafts, row - 1))
        budget = self._level(drafts_max)
        cap = min(budget, self.max_depth)
        # Per-depth hit counts (hits[d]: requests whose path reached depth d), only from
        # trees of the step's budget: a request the scheduler cut short (near
        # max_model_len) verified a smaller tree.
        hits, accepted_sum = None, 0
        if budget:
            counts = [0] * (cap + 2)
            for drafts, d in verified:
                if drafts >= budget:
                    d = cap if d > cap else (0 if d < 0 else d)
                    counts[d] += 1
                    accepted_sum += d
            for k in range(cap - 1, -1, -1):
                counts[k] += counts[k + 1]
            hits = counts[:cap + 1]
        batch = min(len(num_scheduled), self.max_num_seqs)
        step_ms = (now - last) * 1e3 if last is not None else math.nan
        if not (0 < step_ms <= MAX_STEP_MS) or step_ms < self._min_step_ms[batch]:
            prefill = max(prefill, 1)  # not a decode step's time: acceptance only
            step_ms = UNTIMED_STEP_MS
        # What this step drafted for the next (the scheduler's decision for it): a step
        # between two budgets costs part of each.
        drafted = getattr(scheduler_output, "num_spec_tokens_to_schedule", None)
        stats = StepStats(
            batch_size=batch, budget=budget,
            step_ms=step_ms, depth_hits=hits, prefill_tokens=prefill,
            drafted_budget=None if drafted is None else self._level(int(drafted)))
        self.steps_observed += 1
        if self._trace is not None:
            sampled_reqs = hits[0] if hits else 0
            self._trace.append((stats.batch_size, budget, stats.drafted_budget, sampled_reqs,
                                round(accepted_sum / sampled_reqs, 3) if sampled_reqs else None,
                                round(step_ms, 4), prefill))
        changed = self.controllers[step_class].observe(stats)
        if step_class != self.sampling_class:
            self.sampling_class = step_class
            changed = True
        if changed:
            self.lookup[:] = self.controller.budget_table(self.max_num_seqs)
            self._changed_since_log = True
        if changed or self.steps_observed % METRICS_REFRESH_STEPS == 0:
            self._metrics = None
            self._metrics_sent = False
        if self._changed_since_log and now - self._last_log_t >= LOG_INTERVAL_S:
            self._last_log_t = now
            self._changed_since_log = False
            logger.info("%s", self.log_line())
        if self.report_path and now - self._last_report_t >= REPORT_INTERVAL_S:
            self._last_report_t = now
            self.write_report(self.report_path)

    def _active(self) -> list[tuple[str, BudgetController]]:
        """The classes that have observed steps, with their controllers."""
        return [(c, ctl) for c, ctl in self.controllers.items() if ctl.steps]

    def log_line(self) -> str:
        """Each class's :meth:`BudgetController.log_line`, the current one first."""
        active = sorted(self._active(), key=lambda item: item[0] != self.sampling_class)
        return "; ".join(f"{ctl.log_line()} [{c}]" for c, ctl in active) or \
            self.controller.log_line()

    def metrics(self) -> dict:
        """What ``/metrics`` shows (:mod:`vllm_ddtree.metrics`), per sampling class;
        rebuilt when the budget table changes and every ``METRICS_REFRESH_STEPS``
        steps, cached between."""
        if self._metrics is None:
            self._metrics = {"sampling": {c: ctl.summary() for c, ctl in self._active()}}
        return self._metrics

    def metrics_update(self) -> dict | None:
        """:meth:`metrics` when it was rebuilt since the last call, else None: what the
        scheduler puts into each step's ``SchedulerStats``. Prometheus gauges keep
        their last value, so a step that changed nothing sends nothing: the dict
        (per class, bucket and measured budget) is serialised to the front end and
        set gauge by gauge there, ~100 us a step sent every step
        (``bench/budget_metrics_host.py``)."""
        if self._metrics_sent and self._metrics is not None:
            return None
        self._metrics_sent = True
        return self.metrics()

    def state(self) -> dict:
        """The current class's controller state (:meth:`BudgetController.state`), the
        scheduler's table, every class's state under ``by_sampling`` and its buckets'
        last switches under ``recent_switches`` (:meth:`BudgetController.switches`)."""
        by_sampling = {c: ctl.state() for c, ctl in self._active()}
        state = dict(by_sampling.get(self.sampling_class) or self.controller.state())
        state["sampling_class"] = self.sampling_class
        state["by_sampling"] = by_sampling
        state["steps_observed"] = self.steps_observed
        state["budget_by_batch"] = table_ranges(self.lookup)
        state["recent_switches"] = {c: ctl.switches() for c, ctl in self._active()}
        if self._trace is not None:
            state["recent_steps"] = {
                "fields": ["batch", "budget", "drafted_budget", "requests_sampled",
                           "mean_accepted", "step_ms", "prefill_tokens"],
                "steps": [list(t) for t in self._trace]}
        return state

    def write_report(self, path: str) -> None:
        # It runs inside a step's update_from_output, so it delays that step's outputs
        # (a wave's first tokens, when 2 s passed since the last report): serialised in
        # one call, since json.dump writes the state chunk by chunk, ~3x slower
        # (bench/online_budget_host.py --report). Written whole, then moved into place:
        # a reader (bench/run.py after each cell) never finds half a file.
        text = json.dumps(self.state())
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)


def make_online_budget(vllm_config: Any, static_lookup: list[int] | None,
                       max_num_seqs: int) -> OnlineBudget | None:
    """The scheduler's controller, or None when this engine does not run one."""
    spec = getattr(vllm_config, "speculative_config", None)
    if not online_budget_on(spec):
        return None
    return OnlineBudget(vllm_config, static_lookup, max_num_seqs,
                        forward_ms=measured_forward_ms())
