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
    """Pending context entries in one persistent buffer; the count is kept on the host
    (each step's token count is), so appending and flushing never synchronise.

    Each row holds a token's auxiliary states, then its position and its drafter slot
    in each slot row, the int64 index reinterpreted as the states' dtype
    (``8 // itemsize`` columns each): one ``torch.cat`` writes a step's entries, one
    kernel launch where a separate index buffer took a second (``torch.stack``). A
    budget-0 step at batch 1 of a small target is host-bound, and a launch is its cost.
    """

    def __init__(self, capacity: int, width: int, dtype: torch.dtype, device: torch.device,
                 max_slot_rows: int = 1):
        if capacity < 1:
            raise ValueError(f"deferred context capacity must be >= 1 token, got {capacity}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        if 8 % itemsize:
            raise ValueError(f"the deferred context cannot hold int64 indices in {dtype} "
                             f"columns ({itemsize}-byte elements)")
        self.capacity = capacity
        self.width = width
        self.dtype = dtype
        self.device = device
        self._per_index = 8 // itemsize        # columns of one int64 index value
        # Room for the slot rows a drafter can have (one per layer with per-layer KV
        # groups), so that the rows are laid out again, not allocated, when the first
        # append says how many it has: the buffer is allocated with the model, before
        # vLLM sizes the KV cache from the memory left.
        self._flat = torch.empty(0, dtype=dtype, device=device)
        self._lay_out(max(1, max_slot_rows))
        self.count = 0
        self.req_ids: tuple | None = None          # the requests the entries belong to
        self.flushes = 0
        self.flushed_tokens = 0
        # A budget-0 step is the one a user pays on every step while drafting is off,
        # and at batch 1 of a small target the host is its critical path: a slice costs
        # about as much host time as the copy it feeds. The views an append reads are
        # those of the last append while the step's tensors are views of the same
        # buffers (the runner's persistent inputs and the target graphs' outputs), and
        # the views it writes are one per (offset, tokens) (``_targets``, emptied
        # whenever the rows are laid out); both are kept.
        self._sources: tuple | None = None

    def _lay_out(self, slot_rows: int) -> None:
        """Rows of this many slot rows over the flat buffer (grown if they do not fit):
        the states, then the position and each slot row's slot as index columns."""
        cols = self.width + (1 + slot_rows) * self._per_index
        if self.capacity * cols > self._flat.numel():
            self._flat = torch.zeros(self.capacity * cols, dtype=self.dtype, device=self.device)
        self.rows = self._flat[:self.capacity * cols].view(self.capacity, cols)
        self.states = self.rows[:, :self.width]
        self.slot_rows = slot_rows
        self._targets: dict[tuple[int, int], torch.Tensor] = {}

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.capacity

    def _as_columns(self, index: torch.Tensor) -> torch.Tensor:
        """``[n]`` int64 as ``[n, 8 // itemsize]`` of the buffer's dtype (same bytes)."""
        if index.dtype != torch.int64:
            index = index.to(torch.int64)
        return index.unsqueeze(1).view(self.dtype)

    def _source_views(self, n: int, aux_hidden_states: Sequence[torch.Tensor],
                      positions: torch.Tensor, slot_rows: Sequence[torch.Tensor]
                      ) -> list[torch.Tensor]:
        """The first ``n`` rows of each input, the indices as the buffer's columns: the
        last append's views when every input starts where it did then (the same memory:
        the cache keeps those tensors alive, so no other tensor can start there)."""
        key = [n, positions.data_ptr(), *[h.data_ptr() for h in aux_hidden_states],
               *[r.data_ptr() for r in slot_rows]]
        cached = self._sources
        if cached is not None and cached[0] == key:
            return cached[1]
        views = [h[:n] if h.dtype == self.dtype else h[:n].to(self.dtype)
                 for h in aux_hidden_states]
        views += [self._as_columns(x[:n]) for x in (positions, *slot_rows)]
        if (any(x.dtype != torch.int64 for x in (positions, *slot_rows))
                or any(h.dtype != self.dtype for h in aux_hidden_states)):
            # Converted copies, not views: read anew every step.
            return views
        # The inputs themselves are kept too, so that their memory stays theirs.
        self._sources = (key, views, (aux_hidden_states, positions, slot_rows))
        return views

    def _target_view(self, c: int, n: int) -> torch.Tensor:
        view = self._targets.get((c, n))
        if view is None:
            if len(self._targets) >= 4 * self.capacity:
                self._targets.clear()
            view = self._targets[(c, n)] = self.rows[c:c + n]
        return view

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
        if len(slot_rows) != self.slot_rows:
            if c:
                raise AssertionError("the drafter's slot rows changed with entries pending")
            self._lay_out(len(slot_rows))
        sources = self._source_views(n, aux_hidden_states, positions, slot_rows)
        torch.cat(sources, dim=-1, out=self._target_view(c, n))
        self.count = c + n

    def flush(self, store: Callable) -> int:
        """Store every pending entry: ``store(states, positions, slots)`` with the
        concatenated auxiliary states, their positions and one slot tensor per row.
        Returns the number of tokens stored."""
        n = self.count
        if n:
            index = self.rows[:n, self.width:].contiguous().view(torch.int64).t().contiguous()
            store(self.states[:n], index[0], list(index[1:]))
            self.flushes += 1
            self.flushed_tokens += n
        self.count = 0
        self.req_ids = None
        return n
