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

``VLLM_DDTREE_CONTEXT_GRAPHS=0`` keeps the store eager (vLLM's behaviour).
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable, Sequence

import torch

CONTEXT_GRAPHS_ENV = "VLLM_DDTREE_CONTEXT_GRAPHS"
# vLLM's PAD_SLOT_ID: KV-cache inserts skip negative slots.
PAD_SLOT_ID = -1

StoreFn = Callable[..., None]


def context_graphs_enabled() -> bool:
    value = os.environ.get(CONTEXT_GRAPHS_ENV, "1").strip().lower()
    if value not in ("0", "1", "false", "true", "no", "yes", "off", "on"):
        raise ValueError(f"{CONTEXT_GRAPHS_ENV} must be 0 or 1, got {value!r}")
    return value in ("1", "true", "yes", "on")


def padded_graph_size(sizes: Sequence[int], num_tokens: int) -> int | None:
    """The smallest of the sorted ``sizes`` that holds ``num_tokens``, or None."""
    if num_tokens <= 0:
        return None
    i = bisect.bisect_left(sizes, num_tokens)
    return sizes[i] if i < len(sizes) else None


class ContextStoreGraphs:
    """Drop-in for the drafter model's ``precompute_and_store_context_kv`` that
    replays a captured graph when the call reads the speculator's own buffers.

    ``slot_mappings`` is the speculator's ``[num_groups, max_num_tokens]`` tensor;
    ``layer_group_idx`` maps each drafter layer to its row (None: one shared row).
    """

    def __init__(
        self,
        store_fn: StoreFn,
        hidden_states: torch.Tensor,
        positions: torch.Tensor,
        slot_mappings: torch.Tensor,
        layer_group_idx: list[int] | None,
        sizes: Sequence[int],
    ) -> None:
        limit = min(hidden_states.shape[0], positions.shape[0], slot_mappings.shape[1])
        self.sizes = sorted({int(s) for s in sizes if 0 < int(s) <= limit})
        self._store = store_fn
        self.hidden_states = hidden_states
        self.positions = positions
        self.slot_mappings = slot_mappings
        self.layer_group_idx = layer_group_idx
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Counters for tests and logs: how many stores replayed a graph / ran eagerly.
        self.num_replays = 0
        self.num_eager = 0

    def _slots(self, num_tokens: int) -> torch.Tensor | list[torch.Tensor]:
        if self.layer_group_idx is None:
            return self.slot_mappings[0][:num_tokens]
        return [self.slot_mappings[g][:num_tokens] for g in self.layer_group_idx]

    def _store_args(self, num_tokens: int):
        return (self.hidden_states[:num_tokens], self.positions[:num_tokens],
                self._slots(num_tokens))

    def capture(self, pool=None) -> None:
        """One graph per size, largest first (smaller ones reuse its pool memory).
        Every slot is the padding slot while capturing, so nothing is written."""
        self.slot_mappings.fill_(PAD_SLOT_ID)
        for size in reversed(self.sizes):
            args = self._store_args(size)
            self._store(*args)  # warm-up: lazy buffers, kernel autotuning
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self._store(*args)
            self.graphs[size] = graph

    def reads_own_buffers(self, context_states, context_positions, context_slot_mapping) -> bool:
        """True when the call's tensors are the leading rows of the captured buffers."""
        n = context_states.shape[0]
        if (context_states.data_ptr() != self.hidden_states.data_ptr()
                or context_states.shape[1:] != self.hidden_states.shape[1:]
                or context_positions.data_ptr() != self.positions.data_ptr()
                or context_positions.shape[0] != n):
            return False
        if isinstance(context_slot_mapping, torch.Tensor):
            if self.layer_group_idx is not None:
                return False
            slots = [context_slot_mapping]
            rows = [0]
        elif isinstance(context_slot_mapping, (list, tuple)):
            if self.layer_group_idx is None or len(context_slot_mapping) != len(
                self.layer_group_idx
            ):
                return False
            slots = list(context_slot_mapping)
            rows = self.layer_group_idx
        else:
            return False
        return all(
            isinstance(s, torch.Tensor)
            and s.data_ptr() == self.slot_mappings[r].data_ptr()
            and s.shape[0] == n
            for s, r in zip(slots, rows)
        )

    def __call__(self, context_states, context_positions, context_slot_mapping=None) -> None:
        n = context_states.shape[0]
        size = padded_graph_size(self.sizes, n) if self.graphs else None
        if (size is None or context_slot_mapping is None
                or not self.reads_own_buffers(context_states, context_positions,
                                              context_slot_mapping)):
            self.num_eager += 1
            self._store(context_states, context_positions, context_slot_mapping)
            return
        if size > n:
            # Rows past this step's tokens: stale hidden states, never written.
            self.slot_mappings[:, n:size].fill_(PAD_SLOT_ID)
        self.num_replays += 1
        self.graphs[size].replay()
