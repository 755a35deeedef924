"""The drafter's context store as CUDA graphs (vllm_ddtree.context_store_graphs).

CPU: which calls may replay a graph (only those reading the speculator's buffers),
the padded size, the eager fallback and the switch. GPU: a captured store equals the
eager one for every token count, padded rows included (they must write nothing).
"""

from __future__ import annotations

import pytest
import torch

from vllm_ddtree.context_store_graphs import (
    PAD_SLOT_ID,
    ContextStoreGraphs,
    context_graphs_enabled,
    padded_graph_size,
)
from vllm_ddtree.env import CONTEXT_GRAPHS

HIDDEN, MAX_TOKENS, NUM_SLOTS = 8, 64, 256


class ToyDrafter:
    """A store with the real one's contract: per layer, project the states and write
    row i into cache slot slots[i], skipping the padding slot."""

    def __init__(self, num_layers: int, device):
        gen = torch.Generator().manual_seed(0)
        self.weights = torch.randn(num_layers, HIDDEN, HIDDEN, generator=gen).to(device)
        self.cache = torch.zeros(num_layers, NUM_SLOTS, HIDDEN, device=device)
        self.calls = 0

    def store(self, states, positions, slots=None):
        self.calls += 1
        for layer in range(self.weights.shape[0]):
            kv = states @ self.weights[layer] + positions[:, None].to(states.dtype)
            if slots is None:
                continue
            layer_slots = slots[layer] if isinstance(slots, list) else slots
            keep = layer_slots >= 0
            # Graph-safe masked write: padded rows land in a scratch slot past the end.
            target = torch.where(keep, layer_slots, torch.full_like(layer_slots, NUM_SLOTS))
            padded = torch.cat([self.cache[layer], self.cache.new_zeros(1, HIDDEN)])
            padded.index_copy_(0, target, kv)
            self.cache[layer].copy_(padded[:NUM_SLOTS])


def _buffers(device, num_groups=1):
    hidden = torch.zeros(MAX_TOKENS, HIDDEN, device=device)
    positions = torch.zeros(MAX_TOKENS, dtype=torch.int64, device=device)
    slots = torch.zeros(num_groups, MAX_TOKENS, dtype=torch.int64, device=device)
    return hidden, positions, slots


def test_padded_size_is_the_smallest_graph_that_holds_the_tokens():
    sizes = [1, 2, 4, 8, 16, 24]
    assert padded_graph_size(sizes, 1) == 1
    assert padded_graph_size(sizes, 3) == 4
    assert padded_graph_size(sizes, 17) == 24
    assert padded_graph_size(sizes, 24) == 24
    assert padded_graph_size(sizes, 25) is None
    assert padded_graph_size(sizes, 0) is None
    assert padded_graph_size([], 1) is None


def test_sizes_beyond_the_buffers_are_dropped():
    hidden, positions, slots = _buffers("cpu")
    graphs = ContextStoreGraphs(lambda *a: None, hidden, positions, slots, [0], False,
                                [512, 8, 1, 64, 8, 0])
    assert graphs.sizes == [1, 8, 64]


def test_only_calls_on_the_speculators_buffers_may_replay():
    hidden, positions, slots = _buffers("cpu", num_groups=2)
    shared = ContextStoreGraphs(lambda *a: None, hidden, positions, slots, [0], False, [8])
    assert shared.reads_own_buffers(hidden[:5], positions[:5], slots[0][:5])
    # A fresh tensor (e.g. the combine's output) is not what the graph reads.
    assert not shared.reads_own_buffers(hidden[:5].clone(), positions[:5], slots[0][:5])
    assert not shared.reads_own_buffers(hidden[1:6], positions[:5], slots[0][:5])
    assert not shared.reads_own_buffers(hidden[:5], positions[:4], slots[0][:5])
    assert not shared.reads_own_buffers(hidden[:5], positions[:5], slots[0][:4])
    assert not shared.reads_own_buffers(hidden[:5], positions[:5], [slots[0][:5]])
    # Per-layer groups: layer 0 and 2 in group 1, layer 1 in group 0.
    per_layer = ContextStoreGraphs(lambda *a: None, hidden, positions, slots, [1, 0, 1], True, [8])
    good = [slots[1][:3], slots[0][:3], slots[1][:3]]
    assert per_layer.reads_own_buffers(hidden[:3], positions[:3], good)
    swapped = [slots[0][:3], slots[1][:3], slots[1][:3]]
    assert not per_layer.reads_own_buffers(hidden[:3], positions[:3], swapped)
    assert not per_layer.reads_own_buffers(hidden[:3], positions[:3], good[:2])
    assert not per_layer.reads_own_buffers(hidden[:3], positions[:3], slots[1][:3])


def test_without_graphs_every_call_runs_the_store_eagerly():
    hidden, positions, slots = _buffers("cpu")
    drafter = ToyDrafter(2, "cpu")
    graphs = ContextStoreGraphs(drafter.store, hidden, positions, slots, [0], False, [4, 8])
    hidden[:3] = 1.0
    slots[0, :3] = torch.tensor([5, 6, 7])
    graphs(hidden[:3], positions[:3], slots[0][:3])
    graphs(hidden[:3], positions[:3], None)  # memory profiling: no slots
    assert (drafter.calls, graphs.num_eager, graphs.num_replays) == (2, 2, 0)
    assert torch.allclose(drafter.cache[:, 5:8], hidden[:3] @ drafter.weights)


@pytest.mark.parametrize("value, expected", [("1", True), ("0", False), ("off", False), ("yes", True)])
def test_switch(monkeypatch, value, expected):
    monkeypatch.setenv(CONTEXT_GRAPHS.name, value)
    assert context_graphs_enabled() is expected


def test_switch_rejects_garbage(monkeypatch):
    monkeypatch.setenv(CONTEXT_GRAPHS.name, "maybe")
    with pytest.raises(ValueError, match=CONTEXT_GRAPHS.name):
        context_graphs_enabled()


def test_a_single_shared_row_is_required_without_per_layer_slots():
    hidden, positions, slots = _buffers("cpu", num_groups=2)
    with pytest.raises(ValueError, match="shared slot row"):
        ContextStoreGraphs(lambda *a: None, hidden, positions, slots, [0, 1], False, [8])


def test_a_combining_graph_is_never_a_drop_in_for_the_store():
    """With combine_fn the buffers hold the target's auxiliary states, not context
    states: a call through the drop-in path must run the store eagerly."""
    hidden, positions, slots = _buffers("cpu")
    drafter = ToyDrafter(1, "cpu")
    graphs = ContextStoreGraphs(drafter.store, hidden, positions, slots, [0], False, [8],
                                combine_fn=lambda x: x * 2)
    graphs.graphs[8] = None  # as if captured: the call must still not replay
    graphs(hidden[:3], positions[:3], slots[0][:3])
    assert (graphs.num_eager, graphs.num_replays, drafter.calls) == (1, 0, 1)


def test_a_copied_store_without_a_graph_runs_eagerly_on_the_callers_tensors():
    """store_copy (the deferred context's flush) before capture, for a combining graph
    and past the largest size: the caller's tensors go to the store, the buffers stay."""
    hidden, positions, slots = _buffers("cpu", num_groups=2)
    drafter = ToyDrafter(3, "cpu")
    graphs = ContextStoreGraphs(drafter.store, hidden, positions, slots, [1, 0, 1], True, [4, 8])
    states = torch.ones(3, HIDDEN)
    mine = torch.tensor([5, 6, 7])
    graphs.store_copy(states, torch.zeros(3, dtype=torch.int64), [mine, mine + 10, mine])
    assert (drafter.calls, graphs.num_eager, graphs.num_replays) == (1, 1, 0)
    assert torch.allclose(drafter.cache[1, 15:18], states @ drafter.weights[1])
    assert hidden.abs().sum() == 0 and slots.abs().sum() == 0
    combining = ContextStoreGraphs(drafter.store, hidden, positions, slots, [0], False, [8],
                                   combine_fn=lambda x: x * 2)
    combining.graphs[8] = None  # as if captured: its buffers take other inputs
    combining.store_copy(states, torch.zeros(3, dtype=torch.int64), mine)
    assert (combining.num_eager, combining.num_replays) == (1, 0)


def test_a_copied_store_refuses_slots_that_do_not_match_the_rows():
    hidden, positions, slots = _buffers("cpu", num_groups=2)
    per_layer = ContextStoreGraphs(lambda *a: None, hidden, positions, slots, [1, 0, 1], True, [8])
    shared = ContextStoreGraphs(lambda *a: None, hidden, positions, slots, [0], False, [8])
    one = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="slot rows"):
        per_layer.store_copy(hidden[:2].clone(), one, [one, one])
    with pytest.raises(ValueError, match="slot rows"):
        per_layer.store_copy(hidden[:2].clone(), one, one)
    with pytest.raises(ValueError, match="slot rows"):
        shared.store_copy(hidden[:2].clone(), one, [one])


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def _random_step(gen, hidden, positions, slots, n, step, device, pad_rest):
    hidden[:n] = torch.randn(n, hidden.shape[1], generator=gen).to(device)
    positions[:n] = torch.arange(n) + step
    for g in range(slots.shape[0]):
        slots[g, :n] = torch.randperm(NUM_SLOTS // 2, generator=gen)[:n].to(device) + 128 * g
        if pad_rest:
            # As the runner does for its own slot mappings.
            slots[g, n:] = PAD_SLOT_ID


def _captured(layer_group_idx):
    """Graphs of a three-layer toy store over fresh buffers (sizes 1-32), and a toy of the
    same weights to run eagerly beside them."""
    device = torch.device("cuda")
    num_groups = 1 if layer_group_idx is None else 2
    hidden, positions, slots = _buffers(device, num_groups)
    graphed, eager = ToyDrafter(3, device), ToyDrafter(3, device)
    rows = [0] if layer_group_idx is None else layer_group_idx
    graphs = ContextStoreGraphs(graphed.store, hidden, positions, slots, rows,
                                layer_group_idx is not None, [1, 2, 4, 8, 16, 32])
    graphs.capture()
    return device, num_groups, (hidden, positions, slots), graphed, eager, graphs


@CUDA
@pytest.mark.parametrize("layer_group_idx", [None, [1, 0, 1]])
def test_replayed_store_equals_the_eager_store(layer_group_idx):
    device, _, (hidden, positions, slots), graphed, eager, graphs = _captured(layer_group_idx)
    assert sorted(graphs.graphs) == [1, 2, 4, 8, 16, 32]
    assert graphed.cache.abs().sum().item() == 0, "capture wrote into the cache"
    gen = torch.Generator(device="cpu").manual_seed(1)
    for step, n in enumerate([1, 3, 4, 7, 16, 20, 32, 40]):
        # Rows n.. keep old slots (stale): the replay must pad them itself.
        _random_step(gen, hidden, positions, slots, n, step, device, pad_rest=False)
        args = graphs._store_args(n)
        replays = graphs.num_replays
        graphs(*args)
        eager.store(hidden[:n].clone(), positions[:n].clone(),
                    [s.clone() for s in args[2]] if isinstance(args[2], list) else args[2].clone())
        torch.cuda.synchronize()
        assert graphs.num_replays == replays + (1 if n <= 32 else 0)
        assert torch.allclose(graphed.cache, eager.cache, atol=1e-5), f"n={n}"


@CUDA
def test_combining_graph_on_prepadded_slots_equals_the_eager_combine_and_store():
    """The budget-0 decode graph: combine + store over buffers whose owner pads the
    slots (pad_slots=False)."""
    device = torch.device("cuda")
    aux, positions, slots = _buffers(device, num_groups=2)
    graphed, eager = ToyDrafter(2, device), ToyDrafter(2, device)
    mix = torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(3)).to(device)
    combine = lambda x: torch.tanh(x @ mix)  # noqa: E731
    graphs = ContextStoreGraphs(graphed.store, aux, positions, slots, [1], False,
                                [2, 4, 8, 16], combine_fn=combine, pad_slots=False)
    graphs.capture()
    gen = torch.Generator(device="cpu").manual_seed(2)
    for step, n in enumerate([1, 2, 5, 8, 13, 16]):
        _random_step(gen, aux, positions, slots, n, step, device, pad_rest=True)
        assert graphs.replay(n)
        eager.store(combine(aux[:n]), positions[:n].clone(), slots[1][:n].clone())
        torch.cuda.synchronize()
        assert torch.allclose(graphed.cache, eager.cache, atol=1e-5), f"n={n}"
    assert not graphs.replay(17)


@CUDA
@pytest.mark.parametrize("layer_group_idx", [None, [1, 0, 1]])
def test_a_copied_store_equals_the_eager_store(layer_group_idx):
    """The deferred context's flush: entries from buffers of its own, copied into the
    captured buffers (whose rows past them hold stale slots) and stored by one replay,
    write what the eager store writes; past the largest graph it runs eagerly."""
    device, num_groups, (hidden, positions, slots), graphed, eager, graphs = _captured(
        layer_group_idx)
    gen = torch.Generator(device="cpu").manual_seed(4)
    for step, n in enumerate([1, 3, 4, 7, 16, 20, 32, 40, 5]):
        # The captured buffers hold another store's rows (stale, longer).
        _random_step(gen, hidden, positions, slots, MAX_TOKENS, 100 + step, device,
                     pad_rest=False)
        states = torch.randn(n, HIDDEN, generator=gen).to(device)
        pos = (torch.arange(n) + step).to(device)
        own = [(torch.randperm(NUM_SLOTS // 2, generator=gen)[:n] + 128 * g).to(device)
               for g in range(num_groups)]
        arg = own[0] if layer_group_idx is None else [own[g] for g in layer_group_idx]
        replays = graphs.num_replays
        graphs.store_copy(states, pos, arg)
        eager.store(states, pos, arg)
        torch.cuda.synchronize()
        assert graphs.num_replays == replays + (1 if n <= 32 else 0)
        assert torch.allclose(graphed.cache, eager.cache, atol=1e-5), f"n={n}"
