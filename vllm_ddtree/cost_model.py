"""The verification-token target measured at start-up: ``ddtree_tokens_per_step="auto"``.

The batch-aware budget (:mod:`vllm_ddtree.budget`) keeps a step's verified tokens
under a target ``T``: a batch of ``n`` requests verifies trees of about ``T // n - 1``
nodes each. The right ``T`` is where the target's forward stops costing the same as a
one-token forward (about 128 tokens for an 8B model on an H200, more for a small
model, less on a slower GPU), so a fixed number is right for one model on one GPU
only. With ``"auto"`` the engine measures it instead:

1. After vLLM's memory profiling and before the KV cache and CUDA graphs exist, the
   engine core asks every worker (:func:`measure_target_forward_ms`, one RPC) to time
   the target's forward over a grid of token counts (powers of two up to what a step
   can verify, never past the largest CUDA graph), through the runner's own dummy run
   without attention (the profiling path; the drafter is left out: its cost does not
   depend on the tree budget).
2. Rank 0's curve gives ``T`` (:func:`vllm_ddtree.budget.knee_tokens`, the rule
   ``bench/run.py --suite cost8b`` suggests a target by): the largest count whose forward
   costs at most :data:`MAX_SLOWDOWN` times the one-token forward (every count below
   it too).
3. The schedule for ``T`` (with ``ddtree_disable_by_batch_size`` on top, if set)
   replaces the provisional one on the engine core, whose scheduler is built next,
   and on every worker (:func:`apply_budget_schedule`, a second RPC), before the
   workers capture their CUDA graphs, which follow the schedule.

No graph exists yet, so the forward runs eagerly, and an eager forward's wall time is
the host's: launching an 8B target's ~500 kernels one by one took 12-18 ms on the H200
at every token count, noisily, while the same forward replayed from a CUDA graph takes
5.2 ms (session 9, ``bench/results/session9/``), and a knee read from wall times chose
2 tokens per step. What a step pays after capture is the forward's kernels run back to
back, so that is what is timed (:class:`QueuedKernelTimer`): a spin kernel holds the
GPU while the host queues the whole forward behind it, and CUDA events time the
kernels from the end of the spin to the end of the forward. A measurement where the
host did not finish queueing before the spin ended (a forward that synchronises with
the host, or more launches than the GPU's queue holds) is retried with a longer spin
and, failing that, stops the start with an error naming the way out (a number for
``ddtree_tokens_per_step``). Data parallelism is refused with ``"auto"`` (each engine
core would measure its own schedule).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from typing import Any

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
# Timed forwards per token count (their median is kept), after one warm-up forward.
MEASURE_ITERS = 5
# A timing counts only if the host queued the whole forward within this share of the
# spin (the rest is slack for the launches between the spin and the forward).
MAX_QUEUEING_SHARE = 0.8
# The first spin, and how often a spin too short for the host is lengthened.
FIRST_SPIN_MS = 20.0
SPIN_ATTEMPTS = 4
# A spin kernel's clock rate is calibrated with this many cycles (about 1 ms on an H200).
CALIBRATION_CYCLES = 2_000_000
# Where the engine core also writes the measurement as JSON (curve, token target,
# schedule), e.g. for bench/run.py; the log line has the same.
REPORT_ENV = "VLLM_DDTREE_COST_MODEL_REPORT"

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


class QueueingFailed(RuntimeError):
    """The host could not queue a whole forward ahead of the GPU."""


class CudaStream:
    """The CUDA calls :class:`QueuedKernelTimer` makes, on torch's current stream (a
    test stands in a simulated GPU with the same four methods)."""

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
    call the function (the host only queues its kernels behind the spin); event C.
    B..C is the kernels' time if the host finished queueing before the spin ended,
    which holds when the host's queueing time is under :data:`MAX_QUEUEING_SHARE` of
    A..B (the spin as the GPU ran it). Otherwise the spin is lengthened to cover the
    host and the timing repeated, :data:`SPIN_ATTEMPTS` times at most; a function that
    waits for the GPU never fits (its host time grows with the spin) and raises
    :class:`QueueingFailed`.
    """

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream if stream is not None else CudaStream()
        self.spin_ms = FIRST_SPIN_MS
        self.cycles_per_ms = self._calibrate()

    def _spin_ms_elapsed(self, cycles: int) -> float:
        before, after = self.stream.event(), self.stream.event()
        self.stream.synchronize()
        before.record()
        self.stream.spin(cycles)
        after.record()
        after.synchronize()
        return before.elapsed_time(after)

    def _calibrate(self) -> float:
        # The fastest of three: launch latency can only lengthen a spin as timed.
        elapsed = min(self._spin_ms_elapsed(CALIBRATION_CYCLES) for _ in range(3))
        if not elapsed > 0:
            raise QueueingFailed(f"a spin of {CALIBRATION_CYCLES} cycles timed {elapsed} ms")
        return CALIBRATION_CYCLES / elapsed

    def __call__(self, fn: Any) -> float:
        host_ms = spun_ms = 0.0
        for _ in range(SPIN_ATTEMPTS):
            start, queued, end = self.stream.event(), self.stream.event(), self.stream.event()
            self.stream.synchronize()
            start.record()
            self.stream.spin(max(1, int(self.spin_ms * self.cycles_per_ms)))
            queued.record()
            t0 = time.perf_counter()
            fn()
            host_ms = (time.perf_counter() - t0) * 1e3
            end.record()
            end.synchronize()
            spun_ms = start.elapsed_time(queued)
            if host_ms <= MAX_QUEUEING_SHARE * spun_ms:
                # Keep the spin at about twice what this host needed.
                self.spin_ms = max(1.0, min(self.spin_ms, 2.0 * host_ms))
                return queued.elapsed_time(end)
            self.spin_ms = max(2.0 * self.spin_ms, 2.5 * host_ms)
        raise QueueingFailed(
            f"the host needed {host_ms:.1f} ms to queue the forward behind a "
            f"{spun_ms:.1f} ms spin, {SPIN_ATTEMPTS} times: the forward waits for the GPU "
            "(a host sync) or has more launches than the GPU's queue holds")


def measure_target_forward_ms(worker: Any, token_counts: list[int],
                              iters: int = MEASURE_ITERS,
                              timer: Any = None) -> dict[int, float]:
    """Worker side (an RPC; ``worker`` is vLLM's worker or its wrapper): the median
    GPU time, in ms, of the target's forward at each token count with its kernels run
    back to back (:class:`QueuedKernelTimer`, or ``timer``), through the V2 runner's
    profiling dummy run (no attention, no KV cache yet). The drafter is detached for
    the measurement and put back afterwards."""
    runner = worker.model_runner
    speculator = runner.speculator
    runner.speculator = None
    times: dict[int, float] = {}
    try:
        for n in token_counts:  # warm-up: first use of a shape may compile
            runner._dummy_run(n, skip_attn=True, is_profile=True)
        timer = timer if timer is not None else QueuedKernelTimer()
        for n in token_counts:
            def forward(n: int = n) -> None:
                runner._dummy_run(n, skip_attn=True, is_profile=True)

            times[n] = statistics.median(timer(forward) for _ in range(iters))
    finally:
        runner.speculator = speculator
    return times


def apply_budget_schedule(worker: Any, schedule: list[tuple[int, int, int]]) -> None:
    """Worker side (an RPC): the measured schedule into the worker's configuration
    (read when its CUDA graphs are captured) and the DDTree speculator's lookups."""
    runner = worker.model_runner
    runner.vllm_config.speculative_config.num_speculative_tokens_per_batch_size = schedule
    refresh = getattr(runner.speculator, "refresh_budget_schedule", None)
    if refresh is not None:
        refresh()


def measure_tokens_per_step(engine_core: Any, vllm_config: Any) -> int | None:
    """Engine-core side, called between memory profiling and KV-cache creation: for a
    ``ddtree_tokens_per_step="auto"`` engine, measure, choose and apply the schedule;
    returns the chosen token target (None for any other engine)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or not is_auto(getattr(spec, "ddtree_tokens_per_step", None)):
        return None
    budget = spec.num_speculative_tokens
    sched = vllm_config.scheduler_config
    counts = measurement_token_counts(sched.max_num_batched_tokens, sched.max_num_seqs, budget,
                                      largest_cuda_graph_tokens(vllm_config))
    try:
        curves = engine_core.collective_rpc(measure_target_forward_ms, args=(counts,))
        forward_ms = curves[0]  # rank 0's; every rank must use the same schedule
        tokens = max(2, knee_tokens(list(forward_ms.items()), MAX_SLOWDOWN))
    except Exception as exc:
        raise RuntimeError(
            f'ddtree_tokens_per_step="auto": measuring the target\'s forward at '
            f"{counts} tokens failed ({exc!r}); set ddtree_tokens_per_step to a number "
            "instead (docs/operations.md, 'Choosing the budget')."
        ) from exc
    schedule = batch_budget_schedule(tokens, budget,
                                      getattr(spec, "ddtree_disable_by_batch_size", None))
    spec.num_speculative_tokens_per_batch_size = schedule
    engine_core.collective_rpc(apply_budget_schedule, args=(schedule,))
    report = {"forward_ms": {str(n): round(t, 4) for n, t in sorted(forward_ms.items())},
              "timing": "GPU time of the forward's kernels queued back to back",
              "max_slowdown": MAX_SLOWDOWN, "tokens_per_step": tokens,
              "budget_schedule": [list(r) for r in schedule]}
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "w") as f:
            json.dump(report, f)
    logger.info(
        "DDTree cost model: target forward by tokens (GPU ms, kernels back to back) %s; %d tokens per step "
        "(forward <= %.2fx the %d-token one); budget by batch size %s",
        {n: round(t, 3) for n, t in sorted(forward_ms.items())}, tokens, MAX_SLOWDOWN,
        min(forward_ms), schedule)
    return tokens
