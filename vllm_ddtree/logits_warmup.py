"""Run the target's logits GEMM once for every row count a tree step can give it, before
serving.

A tree step computes the target's logits over every verified node (vLLM's runner,
``sample()``: ``compute_logits`` over the step's logit rows, eager, once a step). Their
count, the step's requests plus the drafts it verifies, changes from step to step with
the budgets, joining and finished requests and the scheduler's token budget, while a
plain decode step's is its batch size. A GEMM of a shape the process has not run before
(cuBLAS choosing its kernel would explain it) took ~250 us of the host's time a call on
an H100 against ~31 us for a row count run before, at the benchmark pair's vocabulary
and at Qwen3-8B's (``bench/logits_rows.py``,
bench/results/2026-12-08-logits-gemm-row-counts-h100/); a
drafting step's ``aten::mm`` averaged 192 us of host time in the batch-16 gap profile.
Each row count a step met for the first time stalled that step's host by as much.

:func:`warm_up_logits_rows` calls the target's ``compute_logits`` once per row count
from 1 to :func:`max_tree_step_rows` (at most :data:`MAX_WARM_ROWS`), on zero hidden
states, when the speculator captures its graphs at start-up (an eager engine pays the
choice at each count's first step instead). Above :data:`MAX_WARM_ROWS` the GEMM's own
GPU time (~0.3 ms at the benchmark pair's shape, more at 8B's) outlasts the choice.
Every rank of a tensor-parallel engine runs the same calls, as it runs each step's
(``compute_logits`` gathers the vocabulary shards), so there a count whose logits do not
fit in GPU memory stops start-up with the allocator's error instead of leaving the ranks
apart; with one rank the counts above it are left to their first step.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import torch

logger = logging.getLogger("vllm.ddtree")

MAX_WARM_ROWS = 1024


def max_tree_step_rows(max_num_reqs: int, max_num_tokens: int, tree_budget: int,
                       budget_by_batch: Sequence[int] | None) -> int:
    """The most logit rows one step can have: each of ``n`` running requests verifies
    its root and at most the budget its batch size allows (``budget_by_batch[n]``, the
    scheduler's cap; ``tree_budget`` when there is none), and every row is a scheduled
    token (``max_num_tokens``)."""
    most = 0
    for n in range(1, max_num_reqs + 1):
        cap = tree_budget if budget_by_batch is None else budget_by_batch[
            min(n, len(budget_by_batch) - 1)]
        most = max(most, n * (1 + min(cap, tree_budget)))
        if most >= max_num_tokens:
            return max_num_tokens
    return most


def warm_up_logits_rows(compute_logits: Callable[[torch.Tensor], torch.Tensor],
                        hidden_size: int, dtype: torch.dtype, device: torch.device,
                        max_rows: int, single_rank: bool = True) -> int:
    """``compute_logits`` on ``[m, hidden_size]`` zeros for m = 1 ..
    min(``max_rows``, :data:`MAX_WARM_ROWS`); returns the largest count run. With
    ``single_rank``, stops early (and says so) when the GPU has no memory left for a
    count's logits; otherwise that error is raised (see the module's docstring)."""
    rows = min(max_rows, MAX_WARM_ROWS)
    if rows < 1:
        return 0
    start = time.perf_counter()
    done = 0
    hidden = torch.zeros(rows, hidden_size, dtype=dtype, device=device)
    try:
        with torch.inference_mode():
            for m in range(1, rows + 1):
                try:
                    compute_logits(hidden[:m])
                except torch.OutOfMemoryError:
                    if not single_rank:
                        raise
                    logger.warning(
                        "DDTree: no GPU memory for the target's logits over %d rows at "
                        "start-up; larger row counts choose their GEMM kernel at their "
                        "first step", m)
                    break
                done = m
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        del hidden
        if device.type == "cuda":
            # The logits' blocks back to the driver: vLLM counts what the allocator
            # holds after capture as graph memory (vLLM 0.33.0 sizes the KV cache by it).
            torch.cuda.empty_cache()
    logger.info("DDTree: the target's logits GEMM warmed up for 1-%d rows (%.2f s)",
                done, time.perf_counter() - start)
    return done
