"""The verification-token target measured at start-up: ``ddtree_tokens_per_step="auto"``.

The batch-aware budget (:mod:`vllm_ddtree.budget`) keeps a step's verified tokens
under a target ``T``: a batch of ``n`` requests verifies trees of about ``T // n - 1``
nodes each. The right ``T`` is where the target's forward stops costing the same as a
one-token forward (about 128 tokens for an 8B model on an H200, more for a small
model, less on a slower GPU), so a fixed number is right for one model on one GPU
only. With ``"auto"`` the engine measures it instead:

1. After vLLM's memory profiling and before the KV cache and CUDA graphs exist, the
   engine core asks every worker to time the target's forward over a grid of token
   counts (powers of two up to what a step can verify, never past half the largest
   CUDA graph, :func:`token_target_bound`), through the runner's own dummy run
   without attention (the profiling path; the drafter is left out: its cost does not
   depend on the tree budget). Two RPCs:
   :func:`forward_queueing_ms` (how long each host needs to queue a forward) and
   :func:`measure_target_forward_ms` (the timing, behind a spin every rank gets the
   same length of).
2. Rank 0's curve gives ``T`` (:func:`vllm_ddtree.budget.knee_tokens`, the rule
   ``bench/run.py --suite cost8b`` suggests a target by): the largest count whose forward
   costs at most :data:`MAX_SLOWDOWN` times the one-token forward (every count below
   it too).
3. The schedule for ``T`` (with ``ddtree_disable_by_batch_size`` on top, if set)
   replaces the provisional one on the engine core, whose scheduler is built next,
   and on every worker (:func:`apply_budget_schedule`, a third RPC), before the
   workers capture their CUDA graphs, which follow the schedule.

No graph exists yet, so the forward runs eagerly, and an eager forward's wall time is
the host's: launching an 8B target's kernels one by one took 12-18 ms on the H200
at every token count, noisily, while the same forward replayed from a CUDA graph takes
5.2 ms (``bench/results/2026-11-30-engine-rounds-cost8b-auto-long-prompts/``), and a
knee read from wall times chose 2 tokens per step. What a step pays after capture is the forward's kernels run back to
back, so that is what is timed (:class:`QueuedKernelTimer`): a spin kernel holds the
GPU while the host queues the whole forward behind it, and CUDA events time the
kernels from the end of the spin to the end of the forward. The spin is 2.5x the
slowest host's queueing time, the same on every rank (with tensor parallelism a
rank's all-reduce waits for the others, so unequal spins would time the difference),
and every rank runs the same forwards whatever it measures (a retry on one rank
would pair its collectives with another's next forward and hang). A timing where a
host did not finish queueing before the spin ended (a forward that synchronises with
the host, or more launches than the GPU's queue holds) marks its count late; a late
count on any rank stops the start with an error naming the way out (a number for
``ddtree_tokens_per_step``). Data parallelism is refused with ``"auto"`` (each engine
core would measure its own schedule).
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from typing import Any

from vllm_ddtree import env
from vllm_ddtree.budget import (
    OPEN_END,
    batch_budget_schedule,
    disable_from_batch_size,
    knee_tokens,
)

TOKENS_PER_STEP_AUTO = "auto"
# Issue 6's bound: a DDTree step at the chosen budget may cost up to 1.15x a step
# that verifies one token per request.
MAX_SLOWDOWN = 1.15
# Timed forwards per token count (their median is kept), after two warm-up passes.
MEASURE_ITERS = 5
# A timing counts only if the host queued the whole forward within this share of the
# spin (the rest is slack for the launches between the spin and the forward).
MAX_QUEUEING_SHARE = 0.8
# The spin, as a multiple of the slowest host time any rank needed to queue a forward,
# plus SPIN_SLACK_MS.
SPIN_PER_HOST_MS = 2.5
SPIN_SLACK_MS = 2.0
# A spin kernel's clock rate is calibrated with this many cycles and four times as many
# (about 1 and 4 ms on an H200).
CALIBRATION_CYCLES = 2_000_000
# Where the engine core also writes the measurement as JSON (curve, token target,
# schedule), e.g. for bench/run.py; the log line has the same.
REPORT_ENV = env.COST_MODEL_REPORT.name

logger = logging.getLogger("vllm.ddtree")


def is_auto(tokens_per_step: Any) -> bool:
    return isinstance(tokens_per_step, str) and tokens_per_step.strip().lower() == TOKENS_PER_STEP_AUTO


def provisional_schedule(max_budget: int,
                         first_disabled: int | None) -> list[tuple[int, int, int]]:
    """The schedule an ``"auto"`` engine starts with, until the measurement replaces
    it: the full budget at every batch size (the largest trees, as without a target),
    drafting off from ``first_disabled`` if set. A schedule, not None, so that vLLM
    treats the budget as batch-dependent from the start."""
    return disable_from_batch_size(None, max_budget, first_disabled) if first_disabled \
        else [(1, OPEN_END, max_budget)]


def measurement_token_counts(max_num_batched_tokens: int, max_num_seqs: int,
                             max_budget: int, max_graph_tokens: int | None) -> list[int]:
    """Powers of two from 1 up to the most tokens a step can verify (every running
    request with a full tree, at most the scheduler's token budget and, with CUDA
    graphs, the largest graph: a bigger step runs without graphs, several times
    slower, which an eager measurement cannot show), and that bound."""
    sizes = [max_num_batched_tokens, max_num_seqs, max_budget]
    if max_graph_tokens is not None:
        sizes.append(max_graph_tokens)
    if min(sizes) < 1:
        raise ValueError(
            f"need positive sizes, got max_num_batched_tokens={max_num_batched_tokens}, "
            f"max_num_seqs={max_num_seqs}, max_budget={max_budget}, "
            f"max_graph_tokens={max_graph_tokens}")
    top = min(max_num_batched_tokens, max_num_seqs * (max_budget + 1))
    if max_graph_tokens is not None:
        top = min(top, max_graph_tokens)
    counts = []
    n = 1
    while n < top:
        counts.append(n)
        n *= 2
    counts.append(top)
    return counts


def largest_cuda_graph_tokens(vllm_config: Any) -> int | None:
    """Tokens of the target's largest CUDA graph; None when the engine runs eagerly."""
    if getattr(getattr(vllm_config, "model_config", None), "enforce_eager", False):
        return None
    compilation = getattr(vllm_config, "compilation_config", None)
    mode = getattr(compilation, "cudagraph_mode", None)
    if mode is not None and getattr(mode, "name", str(mode)) == "NONE":
        return None
    return getattr(compilation, "max_cudagraph_capture_size", None) or None


def token_target_bound(largest_graph_tokens: int | None) -> int | None:
    """The most tokens per step "auto" may choose: half the largest CUDA graph, so that
    a step that admits a joining request (its prompt beside a full step of trees) still
    replays a graph (DDTree's default graphs are twice its largest decode step,
    :func:`vllm_ddtree.config.ddtree_cudagraph_capture_size`; a prompt of more than the
    other half runs eagerly, as in any engine). None: no graphs, no bound."""
    if largest_graph_tokens is None:
        return None
    return max(1, largest_graph_tokens // 2)


class CudaStream:
    """The CUDA calls :class:`QueuedKernelTimer` makes, on torch's current stream (a
    test stands in a simulated GPU with the same three methods)."""

    def __init__(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("measuring the target's forward needs a CUDA GPU")
        self._cuda = torch.cuda

    def spin(self, cycles: int) -> None:
        self._cuda._sleep(cycles)

    def event(self) -> Any:
        return self._cuda.Event(enable_timing=True)

    def synchronize(self) -> None:
        self._cuda.synchronize()


class QueuedKernelTimer:
    """GPU milliseconds of a function's kernels run back to back, as a CUDA graph
    replays them, however slowly the host launches them.

    Each timing: synchronise; record event A; a spin kernel of ``spin_ms``; event B;
    call the function once (the host only queues its kernels behind the spin); event
    C. B..C is the kernels' time if the host finished queueing before the spin ended,
    which holds when the host's queueing time is under :data:`MAX_QUEUEING_SHARE` of
    A..B (the spin as the GPU ran it); otherwise the timing is *late* (a function that
    waits for the GPU always is: its host time includes the spin).
    """

    def __init__(self, spin_ms: float, stream: Any = None) -> None:
        if not spin_ms > 0:
            raise ValueError(f"spin_ms must be positive, got {spin_ms}")
        self.stream = stream if stream is not None else CudaStream()
        self.cycles_per_ms = self._calibrate()
        self.spin_cycles = max(1, int(spin_ms * self.cycles_per_ms))

    def _spin_elapsed_ms(self, cycles: int) -> float:
        before, after = self.stream.event(), self.stream.event()
        self.stream.synchronize()
        before.record()
        self.stream.spin(cycles)
        after.record()
        after.synchronize()
        return before.elapsed_time(after)

    def _calibrate(self) -> float:
        """Cycles per ms from the difference of a long and a short spin, so that the
        fixed cost of a launch cancels (with tensor parallelism every rank calibrates
        its own GPU, and their spins must end together); the fastest of three each."""
        short = min(self._spin_elapsed_ms(CALIBRATION_CYCLES) for _ in range(3))
        long = min(self._spin_elapsed_ms(4 * CALIBRATION_CYCLES) for _ in range(3))
        if not long > short > 0:
            raise RuntimeError(f"spins of {CALIBRATION_CYCLES} and {4 * CALIBRATION_CYCLES} "
                               f"cycles timed {short} and {long} ms")
        return 3 * CALIBRATION_CYCLES / (long - short)

    def __call__(self, fn: Any) -> tuple[float, bool]:
        """(the kernels' ms, whether the host queued them in time)."""
        start, queued, end = self.stream.event(), self.stream.event(), self.stream.event()
        self.stream.synchronize()
        start.record()
        self.stream.spin(self.spin_cycles)
        queued.record()
        t0 = time.perf_counter()
        fn()
        host_ms = (time.perf_counter() - t0) * 1e3
        end.record()
        end.synchronize()
        return queued.elapsed_time(end), host_ms <= MAX_QUEUEING_SHARE * start.elapsed_time(queued)


class _DrafterDetached:
    """The runner without its drafter for the measurement, put back afterwards."""

    def __init__(self, worker: Any) -> None:
        self.runner = worker.model_runner

    def __enter__(self) -> Any:
        self.speculator, self.runner.speculator = self.runner.speculator, None
        return self.runner

    def __exit__(self, *exc: Any) -> None:
        self.runner.speculator = self.speculator


def _forward(runner: Any, n: int) -> None:
    runner._dummy_run(n, skip_attn=True, is_profile=True)


def forward_queueing_ms(worker: Any, token_counts: list[int]) -> dict[int, float]:
    """Worker side (the first RPC): how long, in ms, this host needs to queue the
    target's forward at each token count (the second of two warm-up passes; the
    first may compile). The engine core sizes the timing's spin from every rank's
    answer."""
    with _DrafterDetached(worker) as runner:
        for n in token_counts:
            _forward(runner, n)
        host: dict[int, float] = {}
        for n in token_counts:
            t0 = time.perf_counter()
            _forward(runner, n)
            host[n] = (time.perf_counter() - t0) * 1e3
    return host


def measure_target_forward_ms(worker: Any, token_counts: list[int], spin_ms: float,
                              iters: int = MEASURE_ITERS,
                              timer: Any = None) -> dict[str, Any]:
    """Worker side (the second RPC; ``worker`` is vLLM's worker or its wrapper): the
    median GPU time, in ms, of the target's forward at each token count, its kernels
    run back to back behind a ``spin_ms`` spin (:class:`QueuedKernelTimer`, or
    ``timer``), through the V2 runner's profiling dummy run (no attention, no KV cache
    yet), and the counts where the host was late. Exactly ``iters`` forwards a count
    on every rank, whatever is measured. The drafter is detached meanwhile."""
    with _DrafterDetached(worker) as runner:
        timer = timer if timer is not None else QueuedKernelTimer(spin_ms)
        forward_ms: dict[int, float] = {}
        late: list[int] = []
        for n in token_counts:
            timings = [timer(lambda: _forward(runner, n)) for _ in range(iters)]
            forward_ms[n] = statistics.median(ms for ms, _ in timings)
            if not all(on_time for _, on_time in timings):
                late.append(n)
    return {"forward_ms": forward_ms, "late": late}


def apply_budget_schedule(worker: Any, schedule: list[tuple[int, int, int]]) -> None:
    """Worker side (an RPC): the measured schedule into the worker's configuration
    (read when its CUDA graphs are captured) and the DDTree speculator's lookups."""
    runner = worker.model_runner
    runner.vllm_config.speculative_config.num_speculative_tokens_per_batch_size = schedule
    refresh = getattr(runner.speculator, "refresh_budget_schedule", None)
    if refresh is not None:
        refresh()


# The engine core's last measurement, {tokens: GPU ms}: the online budget controller's
# cost model (vllm_ddtree.online_budget), read when the scheduler is built next.
_MEASURED_FORWARD_MS: dict[int, float] | None = None


def measured_forward_ms() -> dict[int, float] | None:
    """The target's forward time by token count measured at this engine's start-up
    (None before, or when nothing was measured)."""
    return None if _MEASURED_FORWARD_MS is None else dict(_MEASURED_FORWARD_MS)


def measure_tokens_per_step(engine_core: Any, vllm_config: Any) -> int | None:
    """Engine-core side, called between memory profiling and KV-cache creation: for a
    ``ddtree_tokens_per_step="auto"`` engine, measure, choose and apply the schedule
    and return the chosen token target; for an engine with the online budget
    controller only measure (its cost model); None for any other engine."""
    global _MEASURED_FORWARD_MS
    from vllm_ddtree.online_budget import online_budget_on

    spec = getattr(vllm_config, "speculative_config", None)
    auto = spec is not None and is_auto(getattr(spec, "ddtree_tokens_per_step", None))
    if not auto and not online_budget_on(spec):
        return None
    budget = spec.num_speculative_tokens
    sched = vllm_config.scheduler_config
    counts = measurement_token_counts(sched.max_num_batched_tokens, sched.max_num_seqs, budget,
                                      token_target_bound(largest_cuda_graph_tokens(vllm_config)))
    try:
        host = engine_core.collective_rpc(forward_queueing_ms, args=(counts,))
        spin_ms = SPIN_PER_HOST_MS * max(max(h.values()) for h in host) + SPIN_SLACK_MS
        results = engine_core.collective_rpc(measure_target_forward_ms, args=(counts, spin_ms))
        forward_ms = results[0]["forward_ms"]  # rank 0's; every rank uses one schedule
        # Any rank's: a late rank also delays the others' collectives.
        late = sorted(set().union(*(r["late"] for r in results)))
        if late:
            raise RuntimeError(
                f"the host did not queue the forward at {late} tokens within "
                f"a {spin_ms:.1f} ms spin, so the GPU time cannot be told from the host's "
                "(a host sync in the forward, or more launches than the GPU's queue holds)")
        tokens = max(2, knee_tokens(list(forward_ms.items()), MAX_SLOWDOWN))
    except Exception as exc:
        if not auto:
            # The controller only loses its start-up curve (it corrects a generic one
            # from measured steps); "auto" cannot choose without it.
            logger.warning("DDTree online budget: the start-up measurement of the "
                           "target's forward failed (%r); starting from a generic cost "
                           "curve", exc)
            return None
        raise RuntimeError(
            f'ddtree_tokens_per_step="auto": measuring the target\'s forward at '
            f"{counts} tokens failed ({exc!r}); set ddtree_tokens_per_step to a number "
            "instead (docs/operations.md, 'Choosing the budget')."
        ) from exc
    _MEASURED_FORWARD_MS = dict(forward_ms)
    if not auto:
        logger.info("DDTree online budget: target forward by tokens (GPU ms, kernels back "
                    "to back) %s", {n: round(t, 3) for n, t in sorted(forward_ms.items())})
        return None
    schedule = batch_budget_schedule(tokens, budget,
                                      getattr(spec, "ddtree_disable_by_batch_size", None))
    spec.num_speculative_tokens_per_batch_size = schedule
    engine_core.collective_rpc(apply_budget_schedule, args=(schedule,))
    report = {"forward_ms": {str(n): round(t, 4) for n, t in sorted(forward_ms.items())},
              "timing": "GPU time of the forward's kernels queued back to back",
              "spin_ms": round(spin_ms, 3),
              "max_slowdown": MAX_SLOWDOWN, "tokens_per_step": tokens,
              "budget_schedule": [list(r) for r in schedule]}
    path = env.cost_model_report_path()
    if path:
        with open(path, "w") as f:
            json.dump(report, f)
    logger.info(
        "DDTree cost model: target forward by tokens (GPU ms, kernels back to back) %s; "
        "%d tokens per step (forward <= %.2fx the %d-token one); budget by batch size %s",
        {n: round(t, 3) for n, t in sorted(forward_ms.items())}, tokens, MAX_SLOWDOWN,
        min(forward_ms), schedule)
    return tokens
