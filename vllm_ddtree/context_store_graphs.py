"""CUDA graphs of the DFlash drafter's context store.

Every step, DFlash writes the target's hidden states of the step's tokens into the
drafter's KV cache (``precompute_and_store_context_kv``: one K/V projection, a
grouped RMSNorm, RoPE and one cache insert per drafter layer). vLLM 0.26 runs it
eagerly, outside the drafter's CUDA graph, because the number of context tokens
changes from step to step. On a small target that is most of a step's drafter-side
host time (~0.6-0.7 ms of a 2.8 ms step at batch 4 on the benchmark pair,
``docs/benchmarks.md``), and a step whose tree budget is 0 does nothing else on the
drafter's side.

The store reads only three persistent buffers of the speculator: the hidden states,
the context positions and the per-KV-group context slot mappings. So one graph per
token count (the target's capture sizes) covers it: a store of n tokens replays the
graph of the smallest captured size m >= n after setting the slot rows n..m-1 to the
padding slot, which the cache insert skips. Anything else (other tensors, more tokens
than the largest graph, the memory-profiling run without slots) runs eagerly, as
before.

A step whose budget is 0 and that verified no drafts (one token per request) needs
even less: its context is exactly the target's tokens, so their positions and the
drafter group's slots are the runner's own persistent buffers, already padded. Its
graph also combines the target's auxiliary hidden states (one eager copy into a fixed
buffer before the replay), so the drafter's side of such a step is that copy and one
replay instead of a combine, a copy, vLLM's input-preparation kernel and the store.

``VLLM_DDTREE_CONTEXT_GRAPHS=0`` keeps the store eager (vLLM's behaviour).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch

from vllm_ddtree import env

context_graphs_enabled = env.context_graphs_enabled
# vLLM's PAD_SLOT_ID: KV-cache inserts skip negative slots.
PAD_SLOT_ID = -1

StoreFn = Callable[..., None]


def padded_graph_size(sizes: Sequence[int], num_tokens: int) -> int | None:
    """The smallest of the sorted ``sizes`` that holds ``num_tokens``, or None."""
    if num_tokens <= 0:
        return None
    i = bisect.bisect_left(sizes, num_tokens)
    return sizes[i] if i < len(sizes) else None


class ContextStoreGraphs:
    """CUDA graphs of ``store_fn(states, positions, slots)`` over fixed buffers, one
    per token count.

    ``slot_mappings`` is a ``[rows, max_num_tokens]`` tensor; ``slot_rows`` names the
    row each drafter layer reads (``per_layer``) or the one row all layers share.
    With ``combine_fn`` the graph first combines ``states`` (the target's
    concatenated auxiliary hidden states) into the drafter's context states.
    ``pad_slots``: set the slot rows past the call's tokens to the padding slot before
    a replay (the speculator's own buffers); False where the owner already pads them
    (the runner's slot mappings).

    Called like the drafter model's ``precompute_and_store_context_kv`` it replays a
    graph when the call reads these buffers and runs ``store_fn`` eagerly otherwise.
    """

    def __init__(
        self,
        store_fn: StoreFn,
        states: torch.Tensor,
        positions: torch.Tensor,
        slot_mappings: torch.Tensor,
        slot_rows: list[int],
        per_layer: bool,
        sizes: Sequence[int],
        combine_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
        pad_slots: bool = True,
    ) -> None:
        if not per_layer and len(slot_rows) != 1:
            raise ValueError("one shared slot row expected when the layers share it")
        limit = min(states.shape[0], positions.shape[0], slot_mappings.shape[1])
        self.sizes = sorted({int(s) for s in sizes if 0 < int(s) <= limit})
        self._store = store_fn
        self._combine = combine_fn
        self.states = states
        self.positions = positions
        self.slot_mappings = slot_mappings
        self.slot_rows = list(slot_rows)
        self.per_layer = per_layer
        self.pad_slots = pad_slots
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Counters for tests and logs: how many stores replayed a graph / ran eagerly.
        self.num_replays = 0
        self.num_eager = 0

    def _slots(self, num_tokens: int) -> torch.Tensor | list[torch.Tensor]:
        if not self.per_layer:
            return self.slot_mappings[self.slot_rows[0]][:num_tokens]
        return [self.slot_mappings[r][:num_tokens] for r in self.slot_rows]

    def _store_args(self, num_tokens: int):
        return (self.states[:num_tokens], self.positions[:num_tokens],
                self._slots(num_tokens))

    def _run(self, num_tokens: int) -> None:
        states, positions, slots = self._store_args(num_tokens)
        if self._combine is not None:
            states = self._combine(states)
        self._store(states, positions, slots)

    def capture(self, pool=None) -> None:
        """One graph per size, largest first (smaller ones reuse its pool memory).
        Every slot read is the padding slot while capturing, so nothing is written;
        the owner of the slot mappings refills them before the next real store."""
        for row in set(self.slot_rows):
            self.slot_mappings[row].fill_(PAD_SLOT_ID)
        for size in reversed(self.sizes):
            self._run(size)  # warm-up: lazy buffers, kernel autotuning
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self._run(size)
            self.graphs[size] = graph

    def replay(self, num_tokens: int) -> bool:
        """Store the first ``num_tokens`` rows of the buffers with a graph; False (and
        nothing done) when no captured size holds them."""
        size = padded_graph_size(self.sizes, num_tokens) if self.graphs else None
        if size is None:
            return False
        if self.pad_slots and size > num_tokens:
            # Rows past this step's tokens: stale states, never written.
            for row in set(self.slot_rows):
                self.slot_mappings[row][num_tokens:size].fill_(PAD_SLOT_ID)
        self.num_replays += 1
        self.graphs[size].replay()
        return True

    def reads_own_buffers(self, context_states, context_positions, context_slot_mapping) -> bool:
        """True when the call's tensors are the leading rows of the captured buffers."""
        n = context_states.shape[0]
        if (context_states.data_ptr() != self.states.data_ptr()
                or context_states.shape[1:] != self.states.shape[1:]
                or context_positions.data_ptr() != self.positions.data_ptr()
                or context_positions.shape[0] != n):
            return False
        if isinstance(context_slot_mapping, torch.Tensor):
            if self.per_layer:
                return False
            slots = [context_slot_mapping]
        elif isinstance(context_slot_mapping, (list, tuple)):
            if not self.per_layer or len(context_slot_mapping) != len(self.slot_rows):
                return False
            slots = list(context_slot_mapping)
        else:
            return False
        return all(
            isinstance(s, torch.Tensor)
            and s.data_ptr() == self.slot_mappings[r].data_ptr()
            and s.shape[0] == n
            for s, r in zip(slots, self.slot_rows)
        )

    def store_copy(self, states: torch.Tensor, positions: torch.Tensor,
                   slots: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """``store_fn(states, positions, slots)`` for tensors that are not the
        captured buffers (the deferred context's flush, :mod:`vllm_ddtree.deferred_context`):
        copied into the buffers first (one copy per input and slot row) and stored by
        one replay, instead of the store's kernels launched one by one. ``slots``
        follows the store's contract (a tensor for a shared row, else one per entry of
        ``slot_rows``; entries that share a row must be equal). Eager, on the caller's
        tensors, where no graph holds them (a combining graph takes other inputs)."""
        n = states.shape[0]
        rows = [slots] if isinstance(slots, torch.Tensor) else list(slots)
        if len(rows) != len(self.slot_rows) or (
                isinstance(slots, torch.Tensor) == self.per_layer):
            raise ValueError(f"{len(rows)} slot tensor(s) for the slot rows {self.slot_rows} "
                             f"(per_layer={self.per_layer})")
        size = (padded_graph_size(self.sizes, n)
                if self.graphs and self._combine is None
                and states.shape[1:] == self.states.shape[1:] else None)
        if size is None:
            self.num_eager += 1
            self._store(states, positions, slots)
            return
        self.states[:n].copy_(states)
        self.positions[:n].copy_(positions)
        copied = set()
        for row, src in zip(self.slot_rows, rows):
            if row not in copied:
                self.slot_mappings[row][:n].copy_(src)
                copied.add(row)
        self.replay(n)

    def __call__(self, context_states, context_positions, context_slot_mapping=None) -> None:
        if (self._combine is None and context_slot_mapping is not None
                and self.reads_own_buffers(context_states, context_positions,
                                           context_slot_mapping)
                and self.replay(context_states.shape[0])):
            return
        self.num_eager += 1
        self._store(context_states, context_positions, context_slot_mapping)
