"""Online tree-budget controller: each step's budget from measured acceptance and cost.

The engine runs one beside its scheduler (:mod:`vllm_ddtree.online_budget`;
docs/operations.md, "The online budget controller").

The batch-aware budget of :mod:`vllm_ddtree.budget` is fixed at start-up: a table
from batch size to tree budget, chosen from the target's forward alone. What a tree
earns depends on the traffic (how often the drafter is right) and what it costs on
the whole step (host work, the drafter, the tree kernels), so a fixed table can be
slower than plain decoding. :class:`BudgetController` chooses, per batch-size bucket,
the budget ``b`` among ``{0, 1, 2, 4, ..., B}`` (``0``: no drafting) that maximises
expected output tokens per second::

    tokens/s(b) = batch * (E[accepted | b] + 1) / step_ms(b)      (b > 0)
    tokens/s(0) = batch / step_ms(0)                              (plain decoding)

**What it is fed.** :meth:`BudgetController.observe` takes one :class:`StepStats` per
engine step, lagging by any number of steps (the engine copies small host arrays
asynchronously and hands them over when they arrive; the controller never waits):
the batch size, the budget the step verified, each tree-verifying request's accepted
depth (or per-depth hit counts), and the step's wall time.

**Acceptance model.** Per bucket (batch sizes 1, 2-3, 4-7, ... up to
``max_batch_size``) and budget, decayed sums of accepted depth and per-depth hits,
weighted by requests. Two decay rates: a fast one (``half_life_steps``, 64 by
default) gives the *level* a budget reaches now; a slow one
(``shape_half_life_steps``, 2048) keeps the *shape* of the curve (how budget ``b``
compares with budget ``a``), which changes with the drafter more than with the
traffic. A budget not recently used is inferred from those that were: the fast mean of
each recently measured budget ``a`` times the slow ratio ``E(b) / E(a)`` (the prior's
ratio ``prior(b) / prior(a)`` where the slow statistics lack either), averaged with the
fast weights (ratios kept within ``SHAPE_CLIP`` of the prior's, since two slow means
may come from different periods); a measured budget is shrunk toward that inference,
which weighs ``inference_weight`` (0.1) of the other budgets' fresh weight (at least
``prior_weight`` = 4 requests), so a stale measurement fades into what the fresh ones
imply. Because a best-first tree of ``b`` nodes contains the tree of ``b / 2``,
the estimates are then made non-decreasing in ``b`` (weighted isotonic regression)
and capped at ``min(b, max_depth)``. A bucket with no data borrows the nearest
bucket's estimates, else the prior (``prior_accepted``; by default
``0.4 * log2(1 + b)``).

**Cost model.** ``startup_cost(batch, budget) -> ms`` (a callable, e.g.
:class:`StartupCost` built from the start-up measurement of
:mod:`vllm_ddtree.cost_model`: target forward against verified tokens, drafter
against batch size, a tree overhead), times a per-(bucket, budget) multiplicative
correction: the decayed mean of measured / modelled step time, inferred for
unmeasured budgets like acceptance (a correction of 1 where nothing is known), and
made non-decreasing in ``b`` (a larger tree never costs less) and bounded by what a
bucket of larger batches measured at the same budget (fewer requests never cost more:
:meth:`BudgetController._larger_batch_bounds`). A bucket that never ran budget 0
takes its correction from the nearest bucket that did, not from its own drafting
steps (:meth:`BudgetController._corrections`). Steps that also
prefilled (``prefill_tokens > 0``), and steps that verified one budget and drafted
another (``drafted_budget``), feed acceptance but not cost.

**Home bucket.** At constant concurrency the batch dips below its bucket's range
for a step or two whenever a request finishes and before its successor joins (16 ->
15), so by range alone two buckets would take turns: the one below sees only those
steps, decides from them (or holds the start-up prior), and where it decides
otherwise every dip switches the budget, each switch a step between two budgets. The
*home* bucket is that of the largest batch of the last ``home_window_steps`` (32)
observed steps; a batch at most two requests or a quarter below that largest batch
(whichever is more: 48 for 64, 12 for 16, 2 for 4) runs the home's budget and feeds
its statistics (a user's cap by batch size still holds there). A batch that stays
lower for a window moves the home, and its own range decides again.

**Decision.** Every ``refresh_steps`` observed steps (and when a probe ends, and at a
bucket's first step, so that a batch size range seen for the first time, or back
after ``RETURN_HALF_LIVES`` fast half-lives without a step, decides from what the
other buckets measured instead of holding the start-up prior or its old choice, and
again after ``probe_steps`` of its own steps, on their measurement; a switch at the
first step starts no hold), for each
bucket that saw steps since: the best budget by the formula above, at the bucket's
mean batch size; budgets whose trees would not fit in ``max_verified_tokens`` at the
bucket's largest batch, or above ``max_budget_by_batch`` (a cap by batch size, e.g.
the user's ``ddtree_tokens_per_step`` schedule) anywhere in the bucket, are never
chosen. Drafting is weighed against budget 0 with ``drafting_margin`` (10 %): a
drafting budget counts as ``1 / 1.1`` of its expected tokens/s there, since its
estimate leaves out costs only drafting brings (its prefilling steps, switches,
probes) while budget 0 is a plain decoding step; near break-even the engine decodes
as plain decoding does. Hysteresis: the choice changes only when the
best beats the current by more than ``margin`` (5 %) and the current has been held
for ``min_hold_steps`` (32) of the bucket's steps; a bucket that switches back to the
budget it just left (two budgets within noise of each other) doubles its margin each
time, up to 8x, so it settles instead of flapping. Between refreshes a decision is a
list lookup (:meth:`BudgetController.budget_for`, :meth:`BudgetController.budget_table`).

**Exploration.** A bucket that is off (budget 0) measures no acceptance, so it probes:
after ``probe_interval`` of its steps it verifies ``probe_budget`` (4) for at least
``probe_steps`` (6) steps and ``probe_requests`` (64) tree-verifying requests, then
decides with the new data. A probe whose acceptance so far cannot reach what its
budget needs to pay, even ``PROBE_BOUND_Z`` standard errors up, ends after
``probe_steps`` (:meth:`BudgetController._probe_cannot_pay`: at batch 1, where
``probe_requests`` make a probe 64 steps long, one that cannot pay ends within 32 in
the unit tests' host-bound engine at ~0.46 accepted).
Drafting comes back on only on a measured lower bound (a budget accepts at least what
a smaller one just measured), never on an extrapolation of a short probe, and only at
a budget whose step time the bucket measured recently (a probe's, typically), never at
one the start-up model alone prices. A bucket that drafts probes, in turn, budget 0
(what a step costs without drafting is what no drafting step's time tells: the
drafter's share), and the next allowed budget above and below its choice
(``probe_when_drafting``), so a pessimistic prior, a drift or an under-modelled
drafter is corrected. A probe that
changes nothing doubles the interval (from ``probe_interval_min`` = 32 up to
``probe_interval_max`` = 1024 of the bucket's steps); a change of choice resets it.
Exploration is also priced (:meth:`BudgetController.probe_spacing`): a probe whose
steps the estimates expect to take ``x`` times longer than the choice's for the same
tokens waits ``x * (L + 2) / share`` of the bucket's steps from that budget's last
probe (``L``: its length; ``share``: ``probe_cost_share`` = 1 % split between the
bucket's candidates), so probing costs at most ~1 % of the time even where drafting
costs most (a drafting step of an 8B-shaped target at batch 64 that accepts nothing
takes ~3x a step without drafts; at batch 1 a probe is 64 steps long) and a probe
expected to pay is not delayed. A budget the bucket never ran is priced by the
nearest bucket that measured it, if any (else it waits the doubling interval alone).
So a workload change is noticed within about ``probe_interval_max`` + a probe +
``refresh_steps`` of a bucket's steps, and within ``probe_spacing_max`` (4096) where a
probe is dear for its length.

**Stalls.** A step's time counts for at most ``STALL_FACTOR`` (4) times its budget's
recent estimate, and a budget-0 step's for at most the bucket's recent estimate of its
smallest measured drafting budget (a step without drafts does less work): a single
stall (a kernel compiled at first use, a garbage collection) in a 4-step probe of
budget 0 otherwise priced not drafting above drafting for thousands of steps
(:meth:`BudgetController._cost_cap`). Slow stretches (a shared host's CPU busy
elsewhere: ~1.5x for 10-20 steps at a time) are clipped too: a step counts for at most
``STRETCH_CLIP`` (15 %) above the median of its budget's last ``STRETCH_WINDOW`` (64)
step times within ``STRETCH_MAX_AGE`` (256) steps, so budget 0, measured on most
steps, and a drafting budget, measured in short probes, are compared at the host's
typical pace whichever of them took in the stretches; a lasting change of pace moves
that median within half a window.

**Determinism.** No clocks, no random numbers, no iteration over hashed containers:
the table is a function of the sequence of :class:`StepStats` fed to it and the
constructor's arguments. Every tensor-parallel rank (or the engine core and the
workers) fed the same statistics in the same order takes the same decisions; feed
every rank rank 0's step time, not its own, or run one controller beside the
scheduler and broadcast its budget (the scheduler's output already reaches every rank).

:meth:`BudgetController.state` returns a JSON-serialisable dict for a /metrics exporter or
a log line (:meth:`BudgetController.log_line`): per bucket, the chosen budget, the
estimated and measured acceptance per budget, the step-time estimate per budget and
the expected tokens/s.
"""

from __future__ import annotations

import collections
import math
import statistics
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence, Union

from vllm_ddtree.budget import budget_levels

# A curve: a number (constant), a {x: y} table (piecewise linear), or a callable.
Curve = Union[float, int, Mapping[int, float], Callable[[int], float]]

# A cell's decayed weight below this does not count as a measurement for the shape
# (slow) ratios, nor as an anchor for inference.
MIN_WEIGHT = 1.0
# A switch back to the budget left within this many of a bucket's steps counts as a
# flap and doubles the bucket's margin, up to MAX_MARGIN_SCALE times the margin.
FLAP_WINDOW_STEPS = 2048
MAX_MARGIN_SCALE = 8.0
# A step's time counts for at most this many times its level's recent estimate (once
# that rests on STALL_MIN_WEIGHT decayed steps): one stall (a compilation, a garbage
# collection, the host's noise) moves a budget's step-time estimate by a bounded amount.
STALL_FACTOR = 4.0
STALL_MIN_WEIGHT = 8.0
# Slow stretches: on a shared host steps run ~1.5x slower for 10-20 steps at a time, at
# every budget alike (the benchmark pair's budget-0 steps at batch 64: ~2.2 ms, ~3.4 in
# a stretch; bench/results/2026-12-06-goals-every-cell-host-stretches-held-out-sharegpt/).
# Budget 0 is measured on most steps and a drafting budget in short probes, so a probe
# in quiet steps against a budget-0 estimate that took in a stretch (or the reverse)
# decided which one pays. A step counts for at most STRETCH_CLIP above its level's
# typical time: the median of that level's last STRETCH_WINDOW step times (relative to
# the start-up model, uncapped) within STRETCH_MAX_AGE steps, taken every
# STALL_MIN_WEIGHT of them once there are that many, and used for STRETCH_MAX_AGE steps
# (a probe after a long pause is not clipped by the pace of the probe before). A lasting
# change of pace moves the median after half a window, and is followed from then on.
STRETCH_CLIP = 0.15
STRETCH_WINDOW = 64
STRETCH_MAX_AGE = 256
# Switches each bucket keeps, with the estimates they were decided on, for the report.
SWITCH_LOG = 8
# How far the measured shape E(b) / E(a) may stray from the prior's ratio.
SHAPE_CLIP = 2.0
# A bucket whose last step is more than RETURN_HALF_LIVES fast half-lives back (its
# fast statistics down to 1/16) decides again at its first step back, as a bucket seen
# for the first time does: on the benchmark pair the batch-4 bucket saw a few steps of
# the start-up warm-up's drain, and ~7600 steps later the batch-4 waves ran its
# drafting choice until the next routine refresh (9-18 steps at ~2x a budget-0 step's
# time at T = 1).
RETURN_HALF_LIVES = 4
# A bucket that is off and not probing is decided again every OFF_REFRESH_FACTOR
# refreshes, not every one: between its probes (whose end decides at once) no
# acceptance reaches it, and the estimate is most of a refresh's host time (~0.24 ms
# one step in 16 at batch 1 on the benchmark pair's host, ~1 % of that cell).
OFF_REFRESH_FACTOR = 4
# A probe that would turn drafting on ends early once the upper bound of its mean
# accepted length, PROBE_BOUND_Z standard errors above the mean (the sample variance,
# at least PROBE_VARIANCE_FLOOR: a few requests that all accepted nothing have none),
# falls short of what its budget needs to pay (:meth:`BudgetController._probe_cannot_pay`).
PROBE_BOUND_Z = 2.0
PROBE_VARIANCE_FLOOR = 0.25


def interpolate(points: Mapping[int, float], x: float) -> float:
    """Piecewise-linear ``points`` at ``x``: flat below the first point, the last
    segment's slope (never negative) beyond the last."""
    if not points:
        raise ValueError("interpolate needs at least one point")
    pts = sorted((float(k), float(v)) for k, v in points.items())
    if len(pts) == 1 or x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    return y1 + max(0.0, (y1 - y0) / (x1 - x0)) * (x - x1)


def curve_value(curve: Curve, x: int) -> float:
    """``curve`` at ``x``: a number, a ``{x: y}`` table (:func:`interpolate`) or a callable."""
    if callable(curve):
        return float(curve(x))
    if isinstance(curve, Mapping):
        return interpolate(curve, x)
    return float(curve)


@dataclass(frozen=True)
class StartupCost:
    """A step-time model in ms from start-up measurements, callable as
    ``(batch, budget) -> ms``:

    * budget > 0: ``host_ms + target_forward_ms(batch * (budget + 1)) +
      drafter_ms(batch) + tree_ms_per_step + tree_ms_per_node * batch * budget``
    * budget 0: ``host_ms + target_forward_ms(batch) + context_store_ms(batch)``

    ``target_forward_ms`` is the forward's time against the verified tokens (e.g. the
    ``forward_ms`` of :func:`vllm_ddtree.cost_model.measure_tokens_per_step`'s report),
    ``drafter_ms`` a drafting step's drafter against the batch size,
    ``context_store_ms`` what a budget-0 step still pays for the drafter (its context
    store). Curves are numbers, ``{x: ms}`` tables (piecewise linear) or callables.
    """

    target_forward_ms: Curve
    drafter_ms: Curve = 0.0
    context_store_ms: Curve = 0.0
    tree_ms_per_step: float = 0.0
    tree_ms_per_node: float = 0.0
    host_ms: float = 0.0

    def __call__(self, batch: int, budget: int) -> float:
        if budget == 0:
            return (self.host_ms + curve_value(self.target_forward_ms, batch)
                    + curve_value(self.context_store_ms, batch))
        return (self.host_ms + curve_value(self.target_forward_ms, batch * (budget + 1))
                + curve_value(self.drafter_ms, batch) + self.tree_ms_per_step
                + self.tree_ms_per_node * batch * budget)


@dataclass(frozen=True)
class StepStats:
    """One engine step, as the engine reports it (any number of steps late).

    ``batch_size``: requests decoding in the step. ``budget``: the tree budget the
    step verified (0: no drafts), one of the controller's levels. ``step_ms``: the
    step's wall time. Acceptance, for the requests that verified a tree (not those
    whose first decode step it was, which had none): either ``accepted_depths``, one
    accepted depth (accepted draft nodes, bonus token excluded) per request, or
    ``depth_hits``, where ``depth_hits[d]`` counts requests whose accepted path
    reached depth ``d`` (``depth_hits[0]``: requests with a tree; non-increasing).
    ``prefill_tokens`` > 0 marks a step that also prefilled: its time is not a decode
    step's, so it feeds acceptance only. ``drafted_budget``: the budget the step drafted
    for the next one (None: not known). A step that verified one budget and drafted
    another (the first and the last step of a probe, a switch) costs part of each, so it
    too feeds acceptance only: a probe of budget 0 would otherwise count a drafter in
    its last step and tell the controller that turning drafting off saves less than it
    does."""

    batch_size: int
    budget: int
    step_ms: float
    accepted_depths: Sequence[int] | None = None
    depth_hits: Sequence[int] | None = None
    prefill_tokens: int = 0
    drafted_budget: int | None = None


def isotonic_non_decreasing(values: Sequence[float], weights: Sequence[float]) -> list[float]:
    """Weighted least-squares non-decreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights):
        blocks.append([float(v), max(float(w), 1e-12), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, c2 = blocks.pop()
            m1, w1, c1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    out: list[float] = []
    for m, _, c in blocks:
        out.extend([m] * int(c))
    return out


class _Cell:
    """Decayed sum and weight of one quantity at two half-lives (decayed lazily)."""

    __slots__ = ("fast_sum", "fast_w", "slow_sum", "slow_w", "depth_sums", "step")

    def __init__(self, depths: int = 0) -> None:
        self.fast_sum = self.fast_w = self.slow_sum = self.slow_w = 0.0
        self.depth_sums = [0.0] * depths  # fast per-depth hits (acceptance cells)
        self.step = 0

    def add(self, now: int, value_sum: float, weight: float, fast: float, slow: float,
            depth_hits: Sequence[float] = ()) -> None:
        if now != self.step:
            df = 0.5 ** ((now - self.step) / fast)
            ds = 0.5 ** ((now - self.step) / slow)
            self.fast_sum *= df
            self.fast_w *= df
            self.slow_sum *= ds
            self.slow_w *= ds
            for d in range(len(self.depth_sums)):
                self.depth_sums[d] *= df
            self.step = now
        self.fast_sum += value_sum
        self.fast_w += weight
        self.slow_sum += value_sum
        self.slow_w += weight
        for d in range(min(len(depth_hits), len(self.depth_sums))):
            self.depth_sums[d] += depth_hits[d]

    def weights(self, now: int, fast: float, slow: float) -> tuple[float, float]:
        dt = now - self.step
        return self.fast_w * 0.5 ** (dt / fast), self.slow_w * 0.5 ** (dt / slow)

    def fast_mean(self) -> float | None:
        return self.fast_sum / self.fast_w if self.fast_w > 0 else None

    def slow_mean(self) -> float | None:
        return self.slow_sum / self.slow_w if self.slow_w > 0 else None


class _Bucket:
    __slots__ = ("lo", "hi", "acc", "cost", "batch_sum", "batch_w", "batch_step",
                 "choice", "since_switch", "since_probe", "probe_interval", "probing",
                 "probe_done", "probe_requests", "probe_seen", "probe_turn", "probed_at",
                 "probe_acc", "probe_ms", "probes_cut", "dirty", "estimated_at", "cap_from",
                 "steps", "switches", "probes", "estimate", "margin_scale", "left",
                 "left_at", "recent_cost", "typical_cost", "typical_at", "typical_due",
                 "switch_log", "redecide_at")

    def __init__(self, lo: int, hi: int, num_levels: int, max_depth: int,
                 initial: int, probe_interval: int, min_hold: int) -> None:
        self.lo, self.hi = lo, hi
        self.acc = [_Cell(max_depth + 1) for _ in range(num_levels)]
        self.cost = [_Cell() for _ in range(num_levels)]
        # Per level: its last STRETCH_WINDOW (step, time relative to the model), their
        # median (None until STALL_MIN_WEIGHT of them) and the step it was taken at,
        # and the samples until it is taken again.
        self.recent_cost = [collections.deque(maxlen=STRETCH_WINDOW)
                            for _ in range(num_levels)]
        self.typical_cost: list[float | None] = [None] * num_levels
        self.typical_at = [0] * num_levels
        self.typical_due = [int(STALL_MIN_WEIGHT)] * num_levels
        self.batch_sum = self.batch_w = 0.0
        self.batch_step = 0
        self.choice = initial
        self.since_switch = min_hold  # the initial choice may change at once
        # The bucket's step at which it decides again on its own steps since it was
        # reached (or came back): None when not due.
        self.redecide_at: int | None = None
        self.since_probe = 0
        self.probe_interval = probe_interval
        self.probing: int | None = None  # the budget being probed
        self.probe_done = self.probe_requests = self.probe_seen = 0
        self.probe_turn = 0  # while drafting: probe off, above, below in turn
        self.probed_at: dict[int, int] = {}  # budget -> the bucket's step its last probe began
        # The running probe's accepted depths (sum, sum of squares) and timed steps
        # (sum of ms, count); probes ended early because they could not pay.
        self.probe_acc = [0.0, 0.0]
        self.probe_ms = [0.0, 0]
        self.probes_cut = 0
        self.dirty = False
        self.steps = self.switches = self.probes = 0
        self.estimate: dict | None = None
        self.estimated_at = 0  # the controller's step of the last estimate
        # The smallest drafting level whose step-time cell may still be recent (the
        # cells below it were not, and none of them was fed since): where the cap of
        # a budget-0 step's time starts looking (BudgetController._cost_cap).
        self.cap_from = 1
        # Damping: a switch back to the budget just left (within FLAP_WINDOW_STEPS of
        # the bucket's steps) doubles the margin this bucket needs, up to
        # MAX_MARGIN_SCALE times; a switch to any other budget resets it.
        self.margin_scale = 1.0
        self.left: int | None = None
        self.left_at = 0
        # The last SWITCH_LOG switches, each with the estimates it was decided on
        # (BudgetController.switches).
        self.switch_log: collections.deque = collections.deque(maxlen=SWITCH_LOG)

    def mean_batch(self) -> float | None:
        """The bucket's decayed mean batch size; None before its first step."""
        return self.batch_sum / self.batch_w if self.batch_w > 0 else None

    def typical_batch(self) -> float:
        """The batch size the bucket's estimates are for: its mean batch, or the
        middle of its range (geometric) before its first step."""
        mean = self.mean_batch()
        return mean if mean is not None else math.sqrt(self.lo * self.hi)


class BudgetController:
    """Chooses each step's tree budget per batch-size bucket (module docstring).

    Feed :meth:`observe` one :class:`StepStats` per step; read :meth:`budget_for`
    (one bucket) or :meth:`budget_table` (by batch size, the layout of vLLM's dynamic
    speculative-decoding lookup) whenever a step is scheduled; :attr:`version` grows
    whenever the table changes. Deterministic given its inputs.
    """

    def __init__(
        self,
        max_budget: int,
        max_depth: int,
        startup_cost: Callable[[int, int], float],
        *,
        max_batch_size: int = 1024,
        levels: Sequence[int] | None = None,
        max_verified_tokens: int | None = None,
        max_budget_by_batch: Sequence[int] | None = None,
        prior_accepted: Curve | None = None,
        half_life_steps: float = 64.0,
        shape_half_life_steps: float = 2048.0,
        prior_weight: float = 4.0,
        inference_weight: float = 0.1,
        refresh_steps: int = 16,
        margin: float = 0.05,
        drafting_margin: float = 0.10,
        min_hold_steps: int = 32,
        probe_budget: int = 4,
        probe_steps: int = 6,
        probe_requests: int = 64,
        probe_interval_min: int = 32,
        probe_interval_max: int = 1024,
        probe_when_drafting: bool = True,
        probe_cost_share: float = 0.01,
        probe_spacing_max: int = 4096,
        home_window_steps: int = 32,
    ) -> None:
        if max_budget < 1 or max_depth < 1 or max_batch_size < 1:
            raise ValueError("max_budget, max_depth and max_batch_size must be >= 1")
        if levels is None:
            levels = budget_levels(max_budget)
        lv = sorted(set(int(b) for b in levels) | {0})
        if lv[-1] > max_budget or lv[0] < 0:
            raise ValueError(f"levels must lie in 0..{max_budget}, got {list(levels)}")
        if len(lv) < 2:
            raise ValueError("levels need at least one budget > 0")
        if not (half_life_steps > 0 and shape_half_life_steps >= half_life_steps):
            raise ValueError("need 0 < half_life_steps <= shape_half_life_steps")
        if refresh_steps < 1 or min_hold_steps < 0 or probe_steps < 1:
            raise ValueError("refresh_steps and probe_steps must be >= 1, min_hold_steps >= 0")
        if not 1 <= probe_interval_min <= probe_interval_max <= probe_spacing_max:
            raise ValueError("need 1 <= probe_interval_min <= probe_interval_max "
                             "<= probe_spacing_max")
        if margin < 0 or drafting_margin < 0 or prior_weight <= 0:
            raise ValueError("need margin >= 0, drafting_margin >= 0 and prior_weight > 0")
        if not 0 < probe_cost_share <= 1:
            raise ValueError(f"probe_cost_share must lie in (0, 1], got {probe_cost_share}")
        if home_window_steps < 0:
            raise ValueError(f"home_window_steps must be >= 0, got {home_window_steps}")
        self.levels: list[int] = lv
        self._index = {b: i for i, b in enumerate(lv)}
        self.max_depth = int(max_depth)
        self.max_batch_size = int(max_batch_size)
        self.startup_cost = startup_cost
        self.max_verified_tokens = max_verified_tokens
        if max_budget_by_batch is not None and len(max_budget_by_batch) < 2:
            raise ValueError("max_budget_by_batch is indexed by batch size (index 0 unused)")
        self.max_budget_by_batch = (None if max_budget_by_batch is None
                                    else [int(b) for b in max_budget_by_batch])
        self.prior_accepted: Curve = (prior_accepted if prior_accepted is not None
                                      else (lambda b: 0.4 * math.log2(1 + b)))
        self.half_life = float(half_life_steps)
        self.shape_half_life = float(shape_half_life_steps)
        self.prior_weight = float(prior_weight)
        self.inference_weight = float(inference_weight)
        self.refresh_steps = int(refresh_steps)
        self.margin = float(margin)
        self.drafting_margin = float(drafting_margin)
        self.min_hold = int(min_hold_steps)
        drafting = [b for b in lv if b > 0]
        self.probe_budget = max([b for b in drafting if b <= probe_budget] or [drafting[0]])
        self.probe_steps = int(probe_steps)
        self.probe_requests = int(probe_requests)
        self.probe_when_drafting = bool(probe_when_drafting)
        self.probe_interval_min = int(probe_interval_min)
        self.probe_interval_max = int(probe_interval_max)
        self.probe_cost_share = float(probe_cost_share)
        self.probe_spacing_max = int(probe_spacing_max)
        self.home_window = int(home_window_steps)
        # The home bucket: that of the largest batch of the last home_window steps
        # (a sliding maximum: (step, batch) pairs with decreasing batches), and the
        # smallest batch it decides for.
        self._window: collections.deque = collections.deque()
        self._home: int | None = None
        self._floor = 0
        self._step = 0
        self.version = 0
        self._model_cache: dict[int, list[float]] = {}
        # _larger_batch_bounds' table (per bucket; filled from the largest range
        # down to _bounds_lo) and the step it was built at (None: stale).
        self._bounds: list[list[float | None] | None] = []
        self._bounds_lo = 0
        self._bounds_step: int | None = None
        self._buckets: list[_Bucket] = []
        for i in range(self.max_batch_size.bit_length()):
            lo, hi = 1 << i, min((1 << (i + 1)) - 1, self.max_batch_size)
            self._buckets.append(_Bucket(lo, hi, len(lv), self.max_depth, 0,
                                         self.probe_interval_min, self.min_hold))
        # Initial choice: the prior and the start-up model alone.
        for i, bk in enumerate(self._buckets):
            bk.estimate = self._estimate(i)
            bk.choice = bk.estimate["best"]
        self._table = [bk.choice for bk in self._buckets]

    # ------------------------------------------------------------------ reading

    def bucket_of(self, batch_size: int) -> int:
        """The bucket of ``batch_size`` by its range alone (1, 2-3, 4-7, ...)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        return min(batch_size, self.max_batch_size).bit_length() - 1

    def home_floor(self) -> int | None:
        """The smallest batch size the home bucket decides for: the window's largest
        batch ``M`` less two requests or a quarter of ``M``, whichever is more (48 for
        ``M`` = 64, 12 for 16, 2 for 4, 1 for 2); None without a home."""
        return None if self._home is None else self._floor

    def effective_bucket(self, batch_size: int) -> int:
        """The bucket that decides and learns for ``batch_size``: the home bucket
        (:attr:`home`) for a batch that dipped at most :meth:`home_floor` below the
        window's largest, as a batch at constant concurrency does for a step or two
        between a request that finished and the one that joins; else the batch
        size's own."""
        own = self.bucket_of(batch_size)
        h = self._home
        if h is not None and h > own and batch_size >= self._floor:
            return h
        return own

    @property
    def home(self) -> str | None:
        """The home bucket's range ("64-127"), None before any step or without one."""
        if self._home is None:
            return None
        bk = self._buckets[self._home]
        return f"{bk.lo}-{bk.hi}"

    def budget_for(self, batch_size: int) -> int:
        """The budget to verify at ``batch_size`` (a list lookup)."""
        return self._budget_at(batch_size, self.effective_bucket(batch_size))

    def _budget_at(self, batch_size: int, i: int) -> int:
        """The budget at ``batch_size`` when bucket ``i`` decides for it: its choice,
        unless it is the home deciding below its range and the user's cap at
        ``batch_size`` does not allow it (then the batch size's own bucket's)."""
        own = self.bucket_of(batch_size)
        if i != own and not self._fits_cap(batch_size, self._table[i]):
            i = own
        return self._table[i]

    def _fits_cap(self, batch_size: int, budget: int) -> bool:
        """Whether ``max_budget_by_batch`` allows ``budget`` at ``batch_size`` (a
        home bucket's choice is allowed over the home's range, not below it)."""
        caps = self.max_budget_by_batch
        return caps is None or budget <= caps[min(batch_size, len(caps) - 1)]

    @property
    def steps(self) -> int:
        """The steps observed so far."""
        return self._step

    def choice_for(self, batch_size: int) -> int:
        """The budget chosen for ``batch_size``'s bucket: :meth:`budget_for` except
        while a probe verifies another budget for a few steps."""
        return self._buckets[self.effective_bucket(batch_size)].choice

    def budget_table(self, max_batch: int | None = None) -> list[int]:
        """Budget by batch size, index = batch size (index 0 unused, 0): the layout of
        the scheduler's ``dynamic_sd_lookup``."""
        n_max = self.max_batch_size if max_batch is None else max_batch
        table = [0] * (n_max + 1)
        for i, bk in enumerate(self._buckets):
            hi = n_max if i == len(self._buckets) - 1 else min(bk.hi, n_max)
            if bk.lo <= hi:
                table[bk.lo:hi + 1] = [self._table[i]] * (hi - bk.lo + 1)
        h = self._home
        if h is not None:
            # The batch sizes below the home's range that it decides for.
            for n in range(self._floor, min(self._buckets[h].lo, n_max + 1)):
                table[n] = self._budget_at(n, h)
        return table

    # ---------------------------------------------------------------- observing

    def observe(self, stats: StepStats) -> bool:
        """One step's statistics; returns whether the budget table changed."""
        n, b = int(stats.batch_size), int(stats.budget)
        if n < 1:
            raise ValueError(f"batch_size must be >= 1, got {n}")
        if b not in self._index:
            raise ValueError(f"budget {b} is not one of the levels {self.levels}")
        if not (math.isfinite(stats.step_ms) and stats.step_ms > 0):
            raise ValueError(f"step_ms must be positive and finite, got {stats.step_ms}")
        if stats.drafted_budget is not None and stats.drafted_budget not in self._index:
            raise ValueError(f"drafted budget {stats.drafted_budget} is not one of the "
                             f"levels {self.levels}")
        hits = self._depth_hits(stats, b, n)
        # The bucket whose budget the step ran (the table it was scheduled from had
        # the home bucket this step has not moved yet).
        i = self.effective_bucket(n)
        bk = self._buckets[i]
        changed = False
        if self._step > 0 and (bk.steps == 0 or self._step - bk.batch_step
                               > RETURN_HALF_LIVES * self.half_life):
            # A batch size range seen for the first time holds the start-up prior's
            # choice (one back after a long absence, what it chose then): decide now
            # from what the other buckets measured (before this step's own sample, a
            # single step's worth of noise). That decision rests on other batch sizes'
            # data: it starts no hold, and the bucket decides again once it has timed
            # ``probe_steps`` of its own steps.
            bk.redecide_at = bk.steps + self.probe_steps
            changed = self._refresh(i, first=True)
        self._step += 1
        now = self._step
        li = self._index[b]
        bk.steps += 1
        # Mean batch size in the bucket (fast decay).
        df = 0.5 ** ((now - bk.batch_step) / self.half_life)
        bk.batch_sum = bk.batch_sum * df + n
        bk.batch_w = bk.batch_w * df + 1.0
        bk.batch_step = now
        # An accepted depth is the number of depths >= 1 its path reached: the step's
        # accepted sum is that of the hit counts past the root.
        accepted = sum(hits[1:]) if hits is not None else 0
        if hits is not None and hits[0] > 0:
            bk.acc[li].add(now, float(accepted), float(hits[0]), self.half_life,
                           self.shape_half_life, hits)
        if stats.prefill_tokens == 0 and stats.drafted_budget in (None, b):
            models = self._model_levels(min(max(n, 1), self.max_batch_size))
            model = models[li]
            if not model > 0:
                raise ValueError(f"startup_cost({n}, {b}) = {model}; it must be positive")
            step_ms = stats.step_ms
            cap = self._cost_cap(bk, li, now, models)
            # The level's window takes the uncapped time; its median again every
            # STALL_MIN_WEIGHT samples (the typical time of the stretch clip).
            window = bk.recent_cost[li]
            window.append((now, step_ms / model))
            due = bk.typical_due[li] - 1
            if due <= 0:
                due = int(STALL_MIN_WEIGHT)
                while window[0][0] < now - STRETCH_MAX_AGE:
                    window.popleft()
                bk.typical_cost[li] = (statistics.median(v for _, v in window)
                                       if len(window) >= STALL_MIN_WEIGHT else None)
                bk.typical_at[li] = now
            bk.typical_due[li] = due
            if cap is not None:
                step_ms = min(step_ms, cap)
            bk.cost[li].add(now, step_ms / model, 1.0, self.half_life, self.shape_half_life)
            if li and li < bk.cap_from:
                bk.cap_from = li
            self._bounds_step = None
            if bk.probing == b:
                bk.probe_ms[0] += step_ms
                bk.probe_ms[1] += 1
        bk.since_switch += 1
        bk.dirty = True
        if bk.probing is not None:
            # Statistics lag: count only the steps that verified the probed budget; a
            # probe that sees too few of them (the table was overridden) is ended.
            bk.probe_seen += 1
            if b == bk.probing:
                bk.probe_done += 1
                if hits is not None:
                    bk.probe_requests += hits[0]
                    # ... and its square the sum of 2d - 1 over the depths d it reached.
                    bk.probe_acc[0] += accepted
                    bk.probe_acc[1] += sum((2 * d - 1) * h for d, h in enumerate(hits) if d)
            enough = bk.probe_done >= self.probe_steps and (
                bk.probing == 0 or bk.probe_requests >= self.probe_requests)
            cut = not enough and self._probe_cannot_pay(bk)
            if enough or cut or bk.probe_seen >= 3 * max(self.probe_steps,
                                                          -(-self.probe_requests // n)):
                bk.probes_cut += cut
                changed |= self._end_probe(i, cut)
        else:
            bk.since_probe += 1
            if bk.redecide_at is not None and bk.steps >= bk.redecide_at:
                # A bucket reached (or back) has timed its decision for as long as a
                # probe runs: decide again on that, before the next routine refresh.
                bk.redecide_at = None
                changed |= self._refresh(i)
        if now % self.refresh_steps == 0:
            for j, other in enumerate(self._buckets):
                if other.dirty:
                    changed |= self._refresh(j, routine=True)
        changed |= self._move_home(now, n)
        if changed:
            self.version += 1
        return changed

    def _cost_cap(self, bk: _Bucket, li: int, now: int,
                  models: Sequence[float]) -> float | None:
        """The most a step of level ``li`` counts for in the bucket's step-time
        statistics (None: no bound yet). A stall (a compilation, a garbage collection,
        the host's noise) is not a budget's price:

        * every level: ``STALL_FACTOR`` times its own recent estimate, once that rests
          on ``STALL_MIN_WEIGHT`` steps. Capped steps still count, so a lasting change
          of pace moves the estimate by up to that factor a step and is followed.
        * budget 0: at most the recent estimate of the smallest drafting budget the
          bucket measured. A step without drafts does less work than a drafting step
          of the same batch, so one measured slower is a stall; uncapped, one stall in
          a 4-step probe of budget 0 made drafting look cheaper than not drafting for
          thousands of steps (one 50 ms step kept a simulated host-bound batch-1
          bucket drafting at 0.85x plain decoding's pace for ~4800 steps). Where the
          two cost about the same this biases budget 0 a little low, towards plain
          decoding's pace. Drafting budgets are not capped by each other: two of them
          can cost the same within the noise, and capping one by the other biased the
          smaller one."""
        own = self._recent_mean(bk.cost[li], now, STALL_MIN_WEIGHT)
        cap = None if own is None else STALL_FACTOR * own * models[li]
        typical = bk.typical_cost[li]
        if typical is not None and now - bk.typical_at[li] <= STRETCH_MAX_AGE:
            stretch = (1.0 + STRETCH_CLIP) * typical * models[li]
            cap = stretch if cap is None else min(cap, stretch)
        if li != 0:
            return cap
        # A cell's weight only decays until it is fed again, so the levels below
        # bk.cap_from, found too old at an earlier step and not fed since, still are.
        for j in range(bk.cap_from, len(models)):
            mean = self._recent_mean(bk.cost[j], now, MIN_WEIGHT)
            if mean is not None:
                bk.cap_from = j
                above = mean * models[j]
                return above if cap is None else min(above, cap)
        bk.cap_from = len(models)
        return cap

    def _recent_mean(self, cell: _Cell, now: int, min_weight: float) -> float | None:
        """The cell's fast mean when its decayed fast weight is at least
        ``min_weight``, else None. (Decay only lowers a weight, so a cell whose weight
        at its last sample is below ``min_weight`` is None without the decay: the
        budget-0 step's cap reads every drafting level's cell each step.)"""
        if cell.fast_w < min_weight or \
                cell.weights(now, self.half_life, self.shape_half_life)[0] < min_weight:
            return None
        return cell.fast_mean()

    def _move_home(self, now: int, n: int) -> bool:
        """The sliding maximum of the batch over the last ``home_window`` steps, and
        the home bucket from it; True when that changed the table (a batch size now
        decided by a bucket of another budget)."""
        if self.home_window == 0:
            return False
        w = self._window
        while w and w[-1][1] <= n:
            w.pop()
        w.append((now, n))
        while w[0][0] <= now - self.home_window:
            w.popleft()
        m = w[0][1]
        home, floor = self.bucket_of(m), max(1, min(m - 2, m - m // 4))
        if (home, floor) == (self._home, self._floor):
            return False
        before = self._extension()
        self._home, self._floor = home, floor
        after = self._extension()
        # The table changes only where a batch size changed bucket and the two buckets'
        # budgets differ there (a batch draining a step at a time moves the floor
        # every step, mostly between buckets of one budget).
        return any(self._budget_at(n, before.get(n, self.bucket_of(n)))
                   != self._budget_at(n, after.get(n, self.bucket_of(n)))
                   for n in set(before) ^ set(after))

    def _extension(self) -> dict[int, int]:
        """The batch sizes below the home's range that the home decides for, with the
        home's bucket index."""
        if self._home is None:
            return {}
        return dict.fromkeys(range(self._floor, self._buckets[self._home].lo), self._home)

    def _depth_hits(self, stats: StepStats, b: int, n: int) -> list[int] | None:
        cap = min(b, self.max_depth)
        if stats.accepted_depths is not None and stats.depth_hits is not None:
            raise ValueError("give accepted_depths or depth_hits, not both")
        if b == 0:
            if (stats.accepted_depths is not None and len(stats.accepted_depths)) or \
                    (stats.depth_hits is not None and any(stats.depth_hits)):
                raise ValueError("a budget-0 step verified no trees; it has no acceptance")
            return None
        hits = [0] * (self.max_depth + 1)
        if stats.accepted_depths is not None:
            for d in stats.accepted_depths:
                d = int(d)
                if not 0 <= d <= cap:
                    raise ValueError(f"accepted depth {d} outside 0..{cap} (budget {b})")
                for k in range(d + 1):
                    hits[k] += 1
        elif stats.depth_hits is not None:
            given = [int(h) for h in stats.depth_hits]
            if any(h < 0 for h in given) or any(x < y for x, y in zip(given, given[1:])):
                raise ValueError("depth_hits must be non-negative and non-increasing")
            if any(given[cap + 1:]):
                raise ValueError(f"depth_hits beyond depth {cap} (budget {b})")
            for k in range(min(len(given), cap + 1)):
                hits[k] = given[k]
        else:
            return None
        if hits[0] > n:
            raise ValueError(f"{hits[0]} requests with trees in a batch of {n}")
        return hits

    # ---------------------------------------------------------------- deciding

    def _allowed(self, bk: _Bucket) -> list[bool]:
        cap = self.max_verified_tokens
        caps = self.max_budget_by_batch
        # The smallest cap over the bucket's batch sizes (a table given by batch size).
        top = (None if caps is None
               else min(caps[min(n, len(caps) - 1)] for n in range(bk.lo, bk.hi + 1)))
        return [b == 0 or ((cap is None or bk.hi * (b + 1) <= cap)
                           and (top is None or b <= top)) for b in self.levels]

    def _refresh(self, i: int, routine: bool = False, first: bool = False) -> bool:
        """Decide bucket ``i`` again (a probe to start, a better budget). A
        ``routine`` refresh (every ``refresh_steps``) of a bucket that is off and not
        probing waits until ``OFF_REFRESH_FACTOR`` refresh periods have passed since
        its last estimate (it stays dirty). A switch at the bucket's ``first`` step
        starts no hold (``min_hold_steps``)."""
        bk = self._buckets[i]
        if (routine and bk.choice == 0 and bk.probing is None
                and self._step - bk.estimated_at < OFF_REFRESH_FACTOR * self.refresh_steps):
            return False
        bk.dirty = False
        est = bk.estimate = self._estimate(i)
        bk.estimated_at = self._step
        if bk.probing is not None:
            return False
        if bk.since_switch >= self.min_hold and bk.since_probe >= bk.probe_interval:
            target = self._probe_target(bk, est)
            if target is not None:
                bk.probing, bk.probe_done, bk.probe_requests, bk.probe_seen = target, 0, 0, 0
                bk.probe_acc, bk.probe_ms = [0.0, 0.0], [0.0, 0]
                bk.probes += 1
                bk.probed_at[target] = bk.steps
                return self._set(i, target)
        best = self._better(bk, est)
        if best is not None and bk.since_switch >= self.min_hold:
            self._switch(bk, best)
            if first:
                bk.since_switch = self.min_hold
            return self._set(i, best)
        return False

    def _better(self, bk: _Bucket, est: dict) -> int | None:
        """The bucket's best budget if it beats the current choice by the bucket's
        margin, else None. From off, only on measured evidence (the lower bound).
        Scores are compared as :meth:`_weighed` (the estimate's ``weighed``): drafting
        against budget 0 must also clear ``drafting_margin``."""
        cur = bk.choice
        if cur == 0:
            weighed, best = est["weighed_lower"], est["best_lower"]
        else:
            weighed, best = est["weighed"], est["best"]
        margin = 1.0 + self.margin * bk.margin_scale
        if best != cur and weighed[self._index[best]] > margin * weighed[self._index[cur]]:
            return best
        return None

    def _weighed(self, scores: list[float]) -> list[float]:
        """Expected tokens/s with every drafting budget's divided by ``1 +
        drafting_margin``: budget 0 is a plain decoding step, whose cost the
        controller measures as it is, while a drafting budget's estimate leaves out
        costs only drafting brings (its steps that also prefill, which draft for the
        whole batch; the steps between two budgets; the drafter's context written back
        when drafting resumes; probes) and rests on acceptance that drifts. So the
        engine drafts only where the estimates give drafting a clear lead, and near
        break-even it decodes as plain decoding does instead of staking the user's
        speed on the noise of its estimates."""
        scale = 1.0 / (1.0 + self.drafting_margin)
        return [s if b == 0 else s * scale for b, s in zip(self.levels, scores)]

    def _probe_candidates(self, bk: _Bucket) -> list[int]:
        """What the bucket may probe, in the order of its turn: ``probe_budget`` when
        off; while drafting, budget 0 and the next allowed level above and below the
        choice."""
        allowed = [b for b, ok in zip(self.levels, self._allowed(bk)) if ok]
        if bk.choice == 0:
            first = self.probe_budget if self.probe_budget in allowed else (
                min((b for b in allowed if b > 0), default=None))
            return [] if first is None else [first]
        if not self.probe_when_drafting:
            return []
        up = [b for b in allowed if b > bk.choice]
        down = [b for b in allowed if 0 < b < bk.choice]
        # Off first: what a step costs without drafting is what a drafting step's
        # measured time cannot tell (the drafter's share of it), and it decides
        # whether speculation pays at all.
        order = [0, min(up) if up else None, max(down) if down else None]
        k = bk.probe_turn % 3
        return [t for t in order[k:] + order[:k] if t is not None]

    def _probe_target(self, bk: _Bucket, est: dict) -> int | None:
        """The first candidate in turn whose own spacing (:meth:`probe_spacing`, from
        that budget's last probe) has passed; None: no probe now. Each candidate
        prices its probes with an equal part of ``probe_cost_share``, so a costly probe
        (off while drafting pays) waits long without holding back cheap ones."""
        cands = self._probe_candidates(bk)
        for j, target in enumerate(cands):
            since = bk.steps - bk.probed_at.get(target, 0)
            if since >= self.probe_spacing(bk, target, est, len(cands)):
                if bk.choice != 0:
                    bk.probe_turn += j + 1
                return target
        return None

    def probe_length(self, bk: _Bucket, target: int) -> int:
        """Steps a probe of ``target`` verifies it (the shortest probe that ends)."""
        if target == 0:
            return self.probe_steps
        mean = bk.mean_batch()
        n = max(1, int(mean) if mean is not None else bk.lo)
        return max(self.probe_steps, -(-self.probe_requests // n))

    def probe_spacing(self, bk: _Bucket, target: int, est: dict, parts: int = 1) -> int:
        """The bucket's steps from its last probe of ``target`` before it probes it
        again: a probe whose steps take ``x`` times longer than the choice's for the
        same tokens (the expected tokens/s: ``x = score(choice) / score(target) - 1``)
        costs ``x * (L + 2)`` steps over its ``L`` steps plus the step between two
        budgets at each end; spaced by that over its part of ``probe_cost_share``
        (``parts`` candidates share it), exploration costs at most that share of the
        time the estimates expect, and a probe they say would pay is not held back.
        At most ``probe_spacing_max`` (4096), so a change of workload is still
        noticed: above ``probe_interval_max`` only for a probe that is dear for its
        length (at batch 1 a probe verifies 64 steps for ``probe_requests``; where a
        drafting step costs 1.7x one without drafts, as on a small target whose host
        sets the pace, 1024 steps between such probes spent ~4 % of the time); 0
        (the doubling interval alone) for a budget without a measurement in the slow
        statistics, whose estimate is the prior's or the start-up model's. A budget
        this bucket never ran, but another bucket measured (acceptance and step time),
        is priced as measured: a batch size reached for the first time
        decides from its neighbours' measurements (:meth:`observe`), and probes what
        they found dear no sooner than its own measurement would let it (an 8B-shaped
        target that accepts nothing probed each new batch size's budget 4 within its
        first 64-step wave, at 2.8x a step without drafts at batch 64)."""
        li = self._index[target]
        if not self._measured(bk, li, target):
            # Else the nearest bucket that measured this budget: the nearest bucket with
            # any data may not have (a new batch size's first steps run the prior's
            # budget, not the probe's).
            if target == 0 or not any(self._measured(self._buckets[j], li, target)
                                      for j in self._neighbours(bk.lo.bit_length() - 1)):
                return 0  # never measured (or long ago): nothing to price it with
        scores = est["scores"]
        cur, new = scores[self._index[bk.choice]], scores[li]
        if not new > 0:
            return self.probe_spacing_max
        # The time a probe step takes beyond a step of the choice for the same tokens.
        extra = max(0.0, cur / new - 1.0)
        share = self.probe_cost_share / max(1, parts)
        steps = extra * (self.probe_length(bk, target) + 2) / share
        return min(self.probe_spacing_max, math.ceil(steps))

    def _measured(self, bk: _Bucket, li: int, target: int) -> bool:
        """Whether ``bk``'s slow statistics hold a measurement of level ``li``: its
        step time, and for a drafting budget its acceptance."""
        now = self._step
        measured = bk.cost[li].weights(now, self.half_life, self.shape_half_life)[1]
        if target > 0:
            measured = min(measured, bk.acc[li].weights(now, self.half_life,
                                                        self.shape_half_life)[1])
        return measured >= MIN_WEIGHT

    def _probe_cannot_pay(self, bk: _Bucket) -> bool:
        """Whether a probe that would turn drafting on (the bucket is off) can stop
        before ``probe_requests``: after ``probe_steps`` of its steps, the upper bound
        of its mean accepted length (``PROBE_BOUND_Z`` standard errors above the mean)
        is below what its budget ``p`` must accept to be chosen, ``(1 + margin) (1 +
        drafting_margin) t_p / t_0 - 1``, with ``t_p`` the probe's own mean step time
        (the estimate's before two of its steps were timed) and ``t_0`` the estimate's
        step without drafts. Drafting comes back only on the lower bound of a budget
        at least the probe's, whose steps take at least the probe's, so no budget
        could have been chosen on the rest of the probe's data. At batch 1 a probe is
        ``probe_requests`` (64) steps long; where a drafting step costs ~1.7x one
        without drafts and ~0.46 is accepted against ~0.95 needed (the unit tests'
        host-bound engine, as the benchmark pair at T=1), it ends within 32."""
        p, k = bk.probing, bk.probe_requests
        est = bk.estimate
        if (bk.choice != 0 or not p or k <= 0 or bk.probe_done < self.probe_steps
                or est is None):
            return False
        mean = bk.probe_acc[0] / k
        var = max(bk.probe_acc[1] / k - mean * mean, PROBE_VARIANCE_FLOOR)
        upper = mean + PROBE_BOUND_Z * math.sqrt(var / k)
        t0 = est["step_ms"][0]
        tp = (bk.probe_ms[0] / bk.probe_ms[1] if bk.probe_ms[1] >= 2
              else est["step_ms"][self._index[p]])
        if not (t0 > 0 and tp > 0):
            return False
        need = ((1.0 + self.margin * bk.margin_scale) * (1.0 + self.drafting_margin)
                * tp / t0 - 1.0)
        return upper < need

    def _end_probe(self, i: int, cut: bool = False) -> bool:
        """A probe's data is in: switch if the bucket's best now beats its choice by
        the margin (the probe interval starts again from its minimum), else double
        the interval and go back to the choice. A probe ``cut`` short
        (:meth:`_probe_cannot_pay`) found that drafting does not pay: it stays off."""
        bk = self._buckets[i]
        bk.probing = None
        bk.dirty = False
        bk.since_probe = 0
        est = bk.estimate = self._estimate(i)
        bk.estimated_at = self._step
        best = None if cut else self._better(bk, est)
        if best is not None:
            self._switch(bk, best)
            return self._set(i, best)
        bk.probe_interval = min(2 * bk.probe_interval, self.probe_interval_max)
        return self._set(i, bk.choice)

    def _switch(self, bk: _Bucket, budget: int) -> None:
        est = bk.estimate
        if est is not None:
            pair = (self._index[bk.choice], self._index[budget])
            bk.switch_log.append({
                "step": self._step, "bucket_step": bk.steps, "from": bk.choice, "to": budget,
                "margin_scale": bk.margin_scale, "mean_batch": round(est["batch"], 3),
                **{key: [round(est[field][j], 4) for j in pair]
                   for key, field in (("accepted", "accepted"), ("step_ms", "step_ms"),
                                      ("tokens_per_s", "scores"))},
                # What _better compared: the lower bound's scores from budget 0.
                "compared": [round((est["weighed_lower"] if bk.choice == 0
                                    else est["weighed"])[j], 2) for j in pair]})
        if budget == bk.left and bk.steps - bk.left_at <= FLAP_WINDOW_STEPS:
            bk.margin_scale = min(2.0 * bk.margin_scale, MAX_MARGIN_SCALE)
        elif budget != bk.left:
            bk.margin_scale = 1.0
        bk.left, bk.left_at = bk.choice, bk.steps
        bk.choice = budget
        bk.since_switch = 0
        bk.since_probe = 0
        bk.switches += 1
        bk.probe_interval = self.probe_interval_min

    def _set(self, i: int, budget: int) -> bool:
        if self._table[i] == budget:
            return False
        self._table[i] = budget
        return True

    # -------------------------------------------------------------- estimating

    def _infer(self, cells: list[_Cell], prior: list[float], monotone: bool = False,
               first_alone: bool = False) -> tuple[list[float], list[float]] | None:
        """Per-level values (and weights) from a bucket's cells: each level's fast mean
        shrunk toward what the other recently measured levels imply (their fast mean
        times the slow ratio, or the prior's); None without any data. A level without
        slow statistics borrows the slow ratio of the nearest level that has them
        (times the prior's ratio between the two); ``first_alone``: the first level
        (budget 0 of the cost cells, a step without a drafter) lends to and borrows
        from no other, so budgets never measured do not look as cheap as no drafting
        where the start-up model leaves the drafter out."""
        if not any(c.fast_w > 0 for c in cells):
            return None  # never fed: nothing to infer from
        now = self._step
        fw, sw = zip(*(c.weights(now, self.half_life, self.shape_half_life) for c in cells))
        fm = [c.fast_mean() for c in cells]
        sm = [c.slow_mean() for c in cells]
        anchors = [j for j in range(len(cells)) if fw[j] >= MIN_WEIGHT]
        if not anchors:
            anchors = [j for j in range(len(cells)) if fw[j] > 0]
        if not anchors:
            return None

        def nearest_slow(i: int) -> int | None:
            """The nearest level with slow statistics (the smaller on a tie)."""
            if sw[i] >= MIN_WEIGHT:
                return i
            for dist in range(1, len(cells)):
                for m in (i - dist, i + dist):
                    if 0 <= m < len(cells) and sw[m] >= MIN_WEIGHT and not (
                            first_alone and (m == 0) != (i == 0)):
                        return m
            return None

        # Once per level: ratio() asks for it for every pair of levels.
        proxies = [nearest_slow(i) for i in range(len(cells))]

        def ratio(i: int, j: int) -> float:
            p = proxies[i]
            if p is not None and p != i and p != j:
                # i's shape from its nearest measured neighbour p: E(i)/E(j) =
                # E(p)/E(j) * prior(i)/prior(p).
                lift = prior[i] / prior[p] if prior[p] > 0 else 1.0
                return ratio(p, j) * lift
            base = prior[i] / prior[j] if prior[j] > 0 else 1.0
            if sw[i] >= MIN_WEIGHT and sw[j] >= MIN_WEIGHT and sm[j] > 0:
                # Slow means of two budgets may come from different periods (one
                # measured before a change, one after): keep their ratio within
                # SHAPE_CLIP of the prior's.
                r = min(max(sm[i] / sm[j], base / SHAPE_CLIP), base * SHAPE_CLIP)
                # Monotone callers (acceptance) also never infer a larger budget below
                # a smaller one.
                if monotone:
                    r = max(r, 1.0) if i > j else min(r, 1.0) if i < j else r
                return r
            return base

        values, weights = [], []
        for i in range(len(cells)):
            others = [j for j in anchors if j != i]
            inferred, k = None, self.prior_weight
            if others:
                total = sum(fw[j] for j in others)
                inferred = sum(fw[j] * fm[j] * ratio(i, j) for j in others) / total
                # What the others imply weighs a share of their own fresh weight.
                k = max(self.prior_weight, self.inference_weight * total)
            if fw[i] > 0 and inferred is not None:
                values.append((fw[i] * fm[i] + k * inferred) / (fw[i] + k))
                # In the isotonic fit an inference weighs no more than the prior.
                weights.append(fw[i] + self.prior_weight)
            elif fw[i] > 0:
                values.append(fm[i])
                weights.append(fw[i])
            else:
                values.append(inferred)
                weights.append(self.prior_weight)
        return values, weights

    def _nearest(self, i: int, get) -> tuple[list[float], list[float]] | None:
        """``get(bucket)`` for bucket i, else for the nearest bucket that has data
        (the smaller on a tie); weights there count as the prior's."""
        own = get(self._buckets[i])
        if own is not None:
            return own
        for j in self._neighbours(i):
            found = get(self._buckets[j])
            if found is not None:
                return found[0], [self.prior_weight] * len(found[0])
        return None

    def _corrections(self, i: int) -> tuple[list[float], list[float]]:
        """Bucket ``i``'s step-time corrections (measured / modelled) per level, and
        their weights: :meth:`_infer` on its cells, else the nearest bucket's. Budget
        0 (a step without a drafter) that the bucket never ran takes the nearest
        bucket's that did: inferred from the bucket's drafting steps, whose correction
        carries the drafter's and the tree's host work that the start-up model leaves
        out, it looked as dear as drafting. A batch-size range reached for the first
        time ran the start-up prior's budget and kept it until its own probe of 0 (its
        first 41-46 steps at batch 4 on the benchmark pair at T = 1, drafting at ~2x a
        budget-0 step's time for ~0.55 accepted) although the batch-1 bucket had
        measured budget 0 all along."""
        n = len(self.levels)
        found = self._nearest(i, lambda x: self._infer(x.cost, [1.0] * n, first_alone=True))
        if found is None:
            return [1.0] * n, [self.prior_weight] * n
        corr, corr_w = list(found[0]), list(found[1])
        if not self._buckets[i].cost[0].fast_w > 0:
            zero = self._nearest(i, lambda x: (
                ([x.cost[0].fast_mean()], [x.cost[0].fast_w]) if x.cost[0].fast_w > 0
                else None))
            if zero is not None:
                corr[0], corr_w[0] = zero[0][0], self.prior_weight
        return corr, corr_w

    def _neighbours(self, i: int):
        """The other buckets' indices, nearest to bucket ``i`` first (the smaller on a
        tie)."""
        for dist in range(1, len(self._buckets)):
            for j in (i - dist, i + dist):
                if 0 <= j < len(self._buckets):
                    yield j

    def _model_levels(self, batch: int) -> list[float]:
        """The start-up model's step time at each level for ``batch``: a fixed model,
        computed once per batch size (observe and every refresh read it on the engine's
        host thread)."""
        values = self._model_cache.get(batch)
        if values is None:
            values = self._model_cache[batch] = [float(self.startup_cost(batch, b))
                                                 for b in self.levels]
        return values

    def _larger_batch_bounds(self, i: int) -> list[float | None]:
        """Per level, the least step time a bucket of larger batches measured there
        (its slow mean correction times the start-up model at its mean batch, on at
        least ``STALL_MIN_WEIGHT`` steps); None where none did. A step of fewer
        requests at the same budget does no more work, so this bounds bucket ``i``'s
        estimate. A bucket that sees only a few steps (the end of a wave or of a run
        draining 4 -> 3 -> 2 -> 1, the steps where requests finish and their output is
        processed) measured budget 0 up to its cap, the smallest drafting budget's
        estimate (:meth:`_cost_cap`); the isotonic fit then priced no drafting like
        drafting, and any acceptance at all turned drafting on there (at T = 1 on the
        benchmark pair: 2-3 requests drafting at 2.2x the step time of budget 0, for
        an accepted 0.3 tokens a step)."""
        now = self._step
        if self._bounds_step != now:
            # Built once a step, from the largest range down as far as a refresh
            # asks (a suffix minimum): the refreshes of one step see the same
            # statistics.
            top = len(self._buckets) - 1
            self._bounds = [None] * top + [[None] * len(self.levels)]
            self._bounds_lo, self._bounds_step = top, now
        while self._bounds_lo > i:
            k = self._bounds_lo
            run = list(self._bounds[k])
            other = self._buckets[k]
            if other.steps > 0 and other.mean_batch() is not None:
                models = None
                for li, cell in enumerate(other.cost):
                    if cell.weights(now, self.half_life,
                                    self.shape_half_life)[1] < STALL_MIN_WEIGHT:
                        continue
                    if models is None:
                        models = self._model_levels(self._model_batch(other))
                    value = cell.slow_mean() * models[li]
                    if run[li] is None or value < run[li]:
                        run[li] = value
            self._bounds[k - 1], self._bounds_lo = run, k - 1
        return self._bounds[i]

    def _model_batch(self, bk: _Bucket) -> int:
        """The batch size the start-up model prices the bucket at: its typical batch
        rounded, within its range."""
        return min(max(int(round(bk.typical_batch())), bk.lo), bk.hi)

    def _estimate(self, i: int) -> dict:
        bk = self._buckets[i]
        lv = self.levels
        n_rep = bk.typical_batch()
        # Acceptance, budgets > 0 (index 0 of the cells is budget 0, unused).
        prior = [0.0] + [max(0.0, curve_value(self.prior_accepted, b)) for b in lv[1:]]
        found = self._nearest(i, lambda x: self._infer(x.acc[1:], prior[1:], True))
        if found is None:
            acc_v, acc_w = prior[1:], [self.prior_weight] * (len(lv) - 1)
        else:
            acc_v, acc_w = found
        acc = [0.0] + [min(v, float(min(b, self.max_depth)))
                       for v, b in zip(isotonic_non_decreasing(acc_v, acc_w), lv[1:])]
        # Step time: the start-up model times a correction.
        model = self._model_levels(self._model_batch(bk))
        corr, corr_w = self._corrections(i)
        values = [m * c for m, c in zip(model, corr)]
        for li, bound in enumerate(self._larger_batch_bounds(i)):
            if bound is not None and bound < values[li]:
                values[li] = bound
        step_ms = isotonic_non_decreasing(values, corr_w)
        # A lower bound for turning drafting on: a budget accepts at least what the
        # largest smaller budget measured recently did (its raw fast mean), nothing
        # inferred. Extrapolating a short probe of a small tree to large ones would
        # turn drafting on from noise. A measurement older than a smaller budget's
        # latest is superseded by it: a probe of budget 4 that accepted nothing,
        # 280 steps after budget 16 last accepted ~1, otherwise left 16's figure
        # standing as the lower bound of every budget from 16 up, and drafting came
        # back on at 32 from it.
        lower, run, newest = [0.0], 0.0, -1
        for b, cell in zip(lv[1:], bk.acc[1:]):
            fw, _ = cell.weights(self._step, self.half_life, self.shape_half_life)
            if fw >= MIN_WEIGHT:
                if cell.step >= newest:
                    run = max(run, cell.fast_mean())
                    newest = cell.step
            lower.append(min(run, float(min(b, self.max_depth))))
        allowed = self._allowed(bk)
        # ... and only to a budget whose step time this bucket measured recently: a
        # budget never run here is priced by the start-up model, which on a host-bound
        # engine prices a large tree like a small one (its verified tokens are cheap,
        # its host work is not), so a probe of a small tree would turn on the largest.
        # Larger budgets follow from there by the probes above the choice.
        measured = [b == 0 or cell.weights(self._step, self.half_life,
                                           self.shape_half_life)[0] >= MIN_WEIGHT
                    for b, cell in zip(lv, bk.cost)]

        def rank(accepted: list[float],
                 ok_lv: list[bool]) -> tuple[list[float], list[float], int]:
            scores = [n_rep * (a + 1.0) * 1e3 / t if ok else 0.0
                      for a, t, ok in zip(accepted, step_ms, ok_lv)]
            weighed = self._weighed(scores)
            best = 0
            for j in range(1, len(lv)):
                if weighed[j] > weighed[best]:
                    best = j
            return scores, weighed, lv[best]

        scores, weighed, best = rank(acc, allowed)
        scores_lower, weighed_lower, best_lower = rank(
            lower, [a and m for a, m in zip(allowed, measured)])
        return {"batch": n_rep, "accepted": acc, "step_ms": step_ms,
                "scores": scores, "weighed": weighed, "best": best, "accepted_lower": lower,
                "scores_lower": scores_lower, "weighed_lower": weighed_lower,
                "best_lower": best_lower}

    # ----------------------------------------------------------------- metrics

    def state(self) -> dict:
        """Operator-facing state (JSON-serialisable): the margins it decides with, and
        per bucket with steps, the chosen budget, whether it is probing, and per budget
        the estimated and measured (fast, decayed) acceptance, per-depth hit rates of
        the measured budgets, the step-time estimate and the expected tokens/s."""
        out = {"step": self._step, "version": self.version, "levels": list(self.levels),
               "half_life_steps": self.half_life, "margin": self.margin,
               "drafting_margin": self.drafting_margin, "home": self.home,
               "home_window_steps": self.home_window, "buckets": {}}
        for i, bk in enumerate(self._buckets):
            if bk.steps == 0:
                continue
            est = bk.estimate if bk.estimate is not None else self._estimate(i)
            measured = self._measured_acceptance(bk)
            hit_rates = {str(b): [round(h / cell.fast_w, 4)
                                  for h in cell.depth_sums[1:min(b, self.max_depth) + 1]]
                         for b, cell in zip(self.levels, bk.acc) if str(b) in measured}
            out["buckets"][f"{bk.lo}-{bk.hi}"] = {
                "budget": self._table[i],
                "choice": bk.choice,
                "probing": bk.probing is not None,
                "probe_interval": bk.probe_interval,
                "steps": bk.steps,
                "switches": bk.switches,
                "probes": bk.probes,
                "probes_cut": bk.probes_cut,
                "mean_batch": round(est["batch"], 3),
                "accepted": {str(b): round(a, 4) for b, a in zip(self.levels, est["accepted"])},
                "accepted_measured": measured,
                "depth_hit_rate": hit_rates,
                "step_ms": {str(b): round(t, 4) for b, t in zip(self.levels, est["step_ms"])},
                "tokens_per_s": {str(b): round(s, 2) for b, s in zip(self.levels, est["scores"])},
            }
        return out

    def switches(self) -> dict[str, list[dict]]:
        """Per bucket that switched, its last ``SWITCH_LOG`` switches: the controller's
        step and the bucket's, the budgets ``from`` and ``to``, and the estimates the
        switch was decided on, each as ``[from, to]`` (accepted, step_ms, tokens_per_s,
        and ``compared``: the tokens/s the margins were applied to, drafting's divided
        by ``1 + drafting_margin``, from budget 0 on the acceptance's lower bound). For
        the report: why the engine drafted or not when it did."""
        return {f"{bk.lo}-{bk.hi}": list(bk.switch_log)
                for bk in self._buckets if bk.switch_log}

    def summary(self) -> dict:
        """What the ``/metrics`` gauges show (:mod:`vllm_ddtree.metrics`), per bucket
        with steps: the chosen ``budget``, the ``expected_tokens_per_step`` there
        (accepted + 1) and the ``accepted_measured`` per budget; the same numbers as
        :meth:`state`, without the rest of it (a quarter of its time)."""
        out: dict = {"budget": {}, "expected_tokens_per_step": {}, "accepted_measured": {}}
        for i, bk in enumerate(self._buckets):
            if bk.steps == 0:
                continue
            est = bk.estimate if bk.estimate is not None else self._estimate(i)
            name, chosen = f"{bk.lo}-{bk.hi}", self._table[i]
            out["budget"][name] = chosen
            out["expected_tokens_per_step"][name] = round(
                1.0 + round(est["accepted"][self._index[chosen]], 4), 4)
            out["accepted_measured"][name] = self._measured_acceptance(bk)
        return out

    def _measured_acceptance(self, bk: _Bucket) -> dict[str, float]:
        """Per measured budget (``str(b)``), the bucket's fast mean accepted depth."""
        return {str(b): round(cell.fast_mean(), 4)
                for b, cell in zip(self.levels, bk.acc) if b > 0 and cell.fast_w > 0}

    def log_line(self) -> str:
        """One line for the log: budget by bucket with its expected tokens/s and
        acceptance, e.g. ``ddtree budget: 1-1: 16 (tau 2.10, 143 tok/s), 64-127: 0``."""
        parts = []
        for name, b in self.state()["buckets"].items():
            acc, tps = b["accepted"][str(b["budget"])], b["tokens_per_s"][str(b["budget"])]
            probe = " probing" if b["probing"] else ""
            parts.append(f"{name}: {b['budget']}{probe} (tau {acc + 1:.2f}, {tps:.0f} tok/s)")
        return "ddtree budget: " + (", ".join(parts) if parts else "no steps yet")
