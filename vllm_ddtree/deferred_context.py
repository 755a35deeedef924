"""The drafter's context store, deferred while drafting is off (on by default;
``VLLM_DDTREE_DEFER_CONTEXT=0`` stores it every step).

A step that verified no drafts and will draft none (budget 0, one token per request)
still stores the drafter's context: the target's auxiliary hidden states of its tokens,
projected (``fc``) and turned into K/V for every drafter layer. That is a pass over the
drafter's projection weights for a handful of tokens, the same cost at batch 1 as at
batch 64 (0.10-0.17 ms a step at Qwen3-8B's shape, ~3 % of a plain decoding step;
docs/benchmarks.md). While drafting is off this module only copies the auxiliary states,
positions and drafter slots of each step into a buffer, and stores them all in one pass
(:meth:`DeferredContext.flush`; the speculator's store replays its context-store graph,
:meth:`vllm_ddtree.context_store_graphs.ContextStoreGraphs.store_copy`) when the buffer
is full (:func:`deferral_capacity` sizes it), before any step that drafts, verifies or
prefills, and whenever the batch's requests change (a finished request's blocks may go
to a new one: the stale entries are written before anything of the new request). The
drafter's context is then the same as without deferral when drafting resumes; only the
time it is written moves.

Lossless either way: the drafter's cache holds only what drafts are made from, and every
draft is verified by the target.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

# The buffer holds at least this many tokens, and grows to the largest context-store
# graph up to MAX_GRAPH_TOKENS: a full buffer still flushes in one replay of a graph, and
# a larger one flushes less often (a batch of 64 flushed every 4th budget-0 step with 256
# tokens, ~0.17 ms a flush on the benchmark pair; every 16th with 1024).
MIN_TOKENS = 256
MAX_GRAPH_TOKENS = 1024


def deferral_capacity(max_num_reqs: int, graph_sizes: Sequence[int] = ()) -> int:
    """Tokens the deferral buffer holds: four steps of the largest batch, at least
    ``MIN_TOKENS``, and the largest context-store graph (``graph_sizes``, the target's
    capture sizes; none when the store runs eagerly) up to ``MAX_GRAPH_TOKENS``, so
    that a full buffer still flushes in one replay while growing it costs at most
    ``MAX_GRAPH_TOKENS`` rows of auxiliary states."""
    largest = min(max(graph_sizes, default=0), MAX_GRAPH_TOKENS)
    return max(MIN_TOKENS, 4 * max_num_reqs, largest)


class DeferredContext:
    """Pending context entries in persistent buffers; the count is kept on the host
    (each step's token count is), so appending and flushing never synchronise."""

    def __init__(self, capacity: int, width: int, dtype: torch.dtype, device: torch.device):
        if capacity < 1:
            raise ValueError(f"deferred context capacity must be >= 1 token, got {capacity}")
        self.capacity = capacity
        self.states = torch.zeros(capacity, width, dtype=dtype, device=device)
        self.device = device
        # [capacity, 1 + slot rows]: each entry's position, then its drafter slot in
        # each slot row; sized at the first append, so that one kernel writes a step.
        self.index: torch.Tensor | None = None
        self.count = 0
        self.req_ids: tuple | None = None          # the requests the entries belong to
        self.flushes = 0
        self.flushed_tokens = 0
        # A budget-0 step is the one a user pays on every step while drafting is off,
        # and at batch 1 of a small target the host is its critical path: a slice costs
        # about as much host time as the copy it feeds. The views an append reads are
        # those of the last append while the step's tensors are views of the same
        # buffers (the runner's persistent inputs and the target graphs' outputs), and
        # the views it writes are one per (offset, tokens); both are kept.
        self._sources: tuple | None = None
        self._targets: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.capacity

    def _source_views(self, n: int, aux_hidden_states: Sequence[torch.Tensor],
                      positions: torch.Tensor, slot_rows: Sequence[torch.Tensor]
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The first ``n`` rows of each input: the last append's views when every input
        starts where it did then (the same memory: the cache keeps those tensors alive,
        so no other tensor can start there)."""
        key = [n, positions.data_ptr(), *[h.data_ptr() for h in aux_hidden_states],
               *[r.data_ptr() for r in slot_rows]]
        cached = self._sources
        if cached is not None and cached[0] == key:
            return cached[1], cached[2]
        states = [h[:n] for h in aux_hidden_states]
        index = [positions[:n], *(row[:n] for row in slot_rows)]
        # The inputs themselves are kept too, so that their memory stays theirs.
        self._sources = (key, states, index, (aux_hidden_states, positions, slot_rows))
        return states, index

    def _target_views(self, c: int, n: int, index: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        views = self._targets.get((c, n))
        if views is None:
            if len(self._targets) >= 4 * self.capacity:
                self._targets.clear()
            views = self._targets[(c, n)] = (self.states[c:c + n], index[c:c + n])
        return views

    def append(self, req_ids: Sequence, aux_hidden_states: Sequence[torch.Tensor],
               positions: torch.Tensor, slot_rows: Sequence[torch.Tensor],
               store: Callable) -> None:
        """One budget-0 decode step's entries: its tokens' auxiliary states
        (concatenated, as the drafter's ``fc`` takes them), positions and the drafter
        slots of each slot row. Flushes first when the requests changed or the buffer
        would overflow."""
        n = positions.shape[0]
        if not self.fits(n):
            raise ValueError(f"a step of {n} tokens does not fit the deferred context "
                             f"buffer of {self.capacity}")
        ids = tuple(req_ids)
        if self.count and (ids != self.req_ids or self.count + n > self.capacity):
            self.flush(store)
        self.req_ids = ids
        c = self.count
        index = self.index
        if index is None or index.shape[1] != 1 + len(slot_rows):
            if c:
                raise AssertionError("the drafter's slot rows changed with entries pending")
            index = self.index = torch.zeros(self.capacity, 1 + len(slot_rows),
                                             dtype=torch.int64, device=self.device)
            self._targets.clear()
        states_in, index_in = self._source_views(n, aux_hidden_states, positions, slot_rows)
        states_out, index_out = self._target_views(c, n, index)
        torch.cat(states_in, dim=-1, out=states_out)
        torch.stack(index_in, dim=1, out=index_out)
        self.count = c + n

    def flush(self, store: Callable) -> int:
        """Store every pending entry: ``store(states, positions, slots)`` with the
        concatenated auxiliary states, their positions and one slot tensor per row.
        Returns the number of tokens stored."""
        n = self.count
        if n:
            index = self.index[:n].t().contiguous()
            store(self.states[:n], index[0], list(index[1:]))
            self.flushes += 1
            self.flushed_tokens += n
        self.count = 0
        self.req_ids = None
        return n
