"""Batch-aware tree budget: verify about the same number of tokens per forward.

A target forward costs about the same from 1 token to a knee (about 128 tokens for an
8B target on an H200, see docs/benchmarks.md) and grows past it. A request's tree of
B nodes puts B + 1 tokens into the verification forward, so a batch of n requests
verifies n (B + 1). Keeping that under the knee as n grows means shrinking B:

    B(n) = the largest budget level <= tokens_per_step // n - 1

(levels: max_budget and the powers of two below it, never below min_budget).

Because DDTree's nodes are ordered best-first (each node's cumulative probability is
no higher than any node before it), the first B(n) nodes of the full tree are exactly
the best tree of B(n) nodes: the runner verifies a prefix of the drafted tree and
nothing else changes. vLLM's scheduler already schedules a batch-size-dependent
number of draft tokens (``num_speculative_tokens_per_batch_size``, "dynamic
speculative decoding", async scheduling only); :func:`budget_schedule` produces that
schedule, and CUDA graphs are captured for each budget in it.

Budget 0 (``ddtree_disable_by_batch_size``, :func:`disable_from_batch_size`) means no
drafts: from that batch size on the step is plain decoding, for targets whose forward
grows with the verified tokens early (a small target, or a big batch), where a tree
costs more than it gains. The drafter then only stores its context (the target's
hidden states of the new tokens), so drafting resumes at full acceptance when the
batch shrinks again.

The drafter's own work follows the budget too (:func:`draft_shape`,
:func:`drafting_budgets`): a tree of B nodes needs at most B positions and B
candidates per position, so at large batches the drafter computes logits for a few
positions instead of all of them.
"""

from __future__ import annotations

# Upper end of the last batch-size range; vLLM caps it at max_num_seqs.
OPEN_END = 1 << 20


def budget_levels(max_budget: int, min_budget: int = 1) -> list[int]:
    """Budgets a schedule may use: max_budget and the powers of two below it.
    Few levels mean few extra CUDA graphs (one set per verification length)."""
    levels = {max_budget}
    p = 1
    while p < max_budget:
        if p >= min_budget:
            levels.add(p)
        p *= 2
    return sorted(levels, reverse=True)


def budget_for_batch(batch_size: int, tokens_per_step: int, max_budget: int,
                     min_budget: int = 1) -> int:
    """Largest budget level whose trees for ``batch_size`` requests fit in
    ``tokens_per_step`` verified tokens (never below ``min_budget``)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    fit = tokens_per_step // batch_size - 1
    for b in budget_levels(max_budget, min_budget):
        if b <= fit:
            return b
    return min_budget


def budget_schedule(tokens_per_step: int, max_budget: int,
                    min_budget: int = 1) -> list[tuple[int, int, int]]:
    """``num_speculative_tokens_per_batch_size`` for a verification-token target:
    inclusive batch-size ranges ``(first, last, budget)`` covering 1..OPEN_END,
    budgets from :func:`budget_levels`."""
    if max_budget < 1:
        raise ValueError(f"max_budget must be >= 1, got {max_budget}")
    if not 1 <= min_budget <= max_budget:
        raise ValueError(f"min_budget must be between 1 and max_budget={max_budget}, "
                         f"got {min_budget}")
    if tokens_per_step < 2:
        raise ValueError(f"tokens_per_step must be >= 2, got {tokens_per_step}")
    ranges: list[tuple[int, int, int]] = []
    n = 1
    while True:
        b = budget_for_batch(n, tokens_per_step, max_budget, min_budget)
        if b == min(budget_levels(max_budget, min_budget)) or b == min_budget:
            ranges.append((n, OPEN_END, b))
            return ranges
        # Budget b fits while n (b + 1) <= tokens_per_step.
        last = max(n, tokens_per_step // (b + 1))
        ranges.append((n, last, b))
        n = last + 1


def disable_from_batch_size(schedule: list[tuple[int, int, int]] | None, max_budget: int,
                            first_disabled: int) -> list[tuple[int, int, int]]:
    """A schedule that decodes without drafts (budget 0) from ``first_disabled``
    running requests on: ``schedule`` (or ``max_budget`` at every batch size) below
    it, ``(first_disabled, OPEN_END, 0)`` from it."""
    if first_disabled < 2:
        raise ValueError(
            f"first_disabled must be >= 2 (at 1 speculation would never run), got "
            f"{first_disabled}")
    if schedule is None:
        schedule = [(1, OPEN_END, max_budget)]
    kept = [(first, min(last, first_disabled - 1), b)
            for first, last, b in schedule if first < first_disabled]
    return kept + [(first_disabled, OPEN_END, 0)]


def batch_budget_schedule(tokens_per_step: int | None, max_budget: int,
                          first_disabled: int | None) -> list[tuple[int, int, int]] | None:
    """``num_speculative_tokens_per_batch_size`` for a token target and/or a
    drafting-off batch size: :func:`budget_schedule`, then
    :func:`disable_from_batch_size` (None when neither is set: the full budget
    always)."""
    schedule = None if tokens_per_step is None else budget_schedule(tokens_per_step, max_budget)
    if first_disabled is not None:
        schedule = disable_from_batch_size(schedule, max_budget, first_disabled)
    return schedule


def draft_shape(budget: int, max_depth: int, top_k: int) -> tuple[int, int]:
    """``(depth, top-K)`` a tree of ``budget`` best-first nodes can use.

    A tree of B nodes is at most B deep and no node ranks B or lower among its
    siblings, so drafting ``min(max_depth, B)`` positions with ``min(top_k, B)``
    candidates each gives exactly the first B nodes of the full tree (nodes are
    best-first, so the full tree's first B nodes are the best tree of B nodes; up to
    ties at the K-th candidate, where ``torch.topk`` picks). Fewer positions mean
    fewer drafter logits and a smaller top-K: the drafting work shrinks with the
    batch-aware budget instead of staying at the largest tree's."""
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    return min(max_depth, budget), min(top_k, budget)


def drafting_budgets(budget_by_batch: list[int], graph_batch_sizes) -> list[int]:
    """Tree budget to draft for, by the batch size the drafter runs at (index 0
    unused).

    ``budget_by_batch`` is the scheduler's budget by batch size (vLLM's dense
    dynamic-speculative-decoding lookup). A drafter CUDA graph captured for ``p``
    requests also runs the batch sizes above the next smaller captured size, padded
    up to ``p``; inside the graph the real size is unknown, so it drafts for the
    largest budget among them (never a smaller tree than the scheduler verifies).
    Batch sizes without a graph run eagerly and draft exactly their own budget."""
    table = list(budget_by_batch)
    prev = 0
    for p in sorted(set(int(x) for x in graph_batch_sizes)):
        if p < 1:
            continue
        if p >= len(table):
            break
        table[p] = max(budget_by_batch[prev + 1:p + 1])
        prev = p
    return table


def expand_schedule(schedule: list[tuple[int, int, int]], max_batch: int) -> list[int]:
    """Budget by batch size (index = batch size, index 0 unused), for reading a
    schedule; vLLM's scheduler builds the same table itself."""
    table = [0] * (max_batch + 1)
    for first, last, b in schedule:
        for n in range(first, min(last, max_batch) + 1):
            table[n] = b
    return table


def knee_tokens(points: list[tuple[float, float]], max_slowdown: float = 1.15) -> int:
    """The largest verified-token count whose step cost stays within ``max_slowdown``
    of the cheapest measured step, from ``(tokens per forward, step ms)`` points
    (e.g. ``bench/run.py --suite cost8b``). A token target for
    ``ddtree_tokens_per_step``: beyond it, a bigger tree costs real time.

    Points are read in increasing token order and the scan stops at the first
    point over the limit, so a noisy cheap point after an expensive one does not
    extend the knee.
    """
    if not points:
        raise ValueError("knee_tokens needs at least one (tokens, ms) point")
    if max_slowdown < 1.0:
        raise ValueError(f"max_slowdown must be >= 1, got {max_slowdown}")
    pts = sorted((float(t), float(ms)) for t, ms in points)
    if any(t < 1 or not ms > 0 for t, ms in pts):  # "not >": NaN is refused too
        raise ValueError("points must have tokens >= 1 and a positive cost")
    limit = pts[0][1] * max_slowdown
    knee = pts[0][0]
    for tokens, ms in pts:
        if ms > limit:
            break
        knee = tokens
    return int(knee)


def table_ranges(table: list[int]) -> str:
    """A lookup by batch size as ranges: ``[0, 64, 64, 32]`` (index 0 unused) ->
    ``"1-2: 64, 3: 32"``."""
    parts, start = [], 1
    for n in range(2, len(table) + 1):
        if n == len(table) or table[n] != table[start]:
            parts.append(f"{start}-{n - 1}: {table[start]}" if n - 1 > start
                         else f"{start}: {table[start]}")
            start = n
    return ", ".join(parts)
