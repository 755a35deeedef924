"""vllm_ddtree.deferred_context: the drafter's context buffered while drafting is off
and stored in one pass; the drafter's cache ends up as with a store every step."""

from __future__ import annotations

import pytest
import torch

from vllm_ddtree.deferred_context import DeferredContext


class FakeCache:
    """A drafter KV cache of one value per slot and layer: what the store writes there
    is a function of the token's state and position, so that misplaced, reordered or
    lost entries show."""

    def __init__(self, slots=64, layers=2):
        self.kv = torch.full((layers, slots), -1.0)
        self.calls = []

    def store(self, states, positions, slot_rows):
        self.calls.append(states.shape[0])
        value = states.float().sum(-1) * 1000 + positions.float()
        for layer, slots in enumerate(slot_rows):
            self.kv[layer, slots] = value


def _step(n, width=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    aux = [torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)]
    return aux


def _drive(steps, capacity, deferred: bool):
    """steps: (req_ids, positions, slots) a step; returns the cache."""
    cache = FakeCache()
    buf = DeferredContext(capacity, 6, torch.float32, torch.device("cpu"))
    for i, (req_ids, positions, slots) in enumerate(steps):
        aux = _step(len(req_ids), seed=i)
        pos = torch.tensor(positions)
        rows = [torch.tensor(slots), torch.tensor(slots) + 32]
        if deferred:
            buf.append(req_ids, aux, pos, rows, cache.store)
        else:
            cache.store(torch.cat(aux, dim=-1), pos, rows)
    if deferred:
        buf.flush(cache.store)
    return cache, buf


def test_a_deferred_store_writes_what_stores_every_step_write():
    steps = [(["a", "b"], [10 + i, 20 + i], [i, 8 + i]) for i in range(7)]
    every, _ = _drive(steps, 64, deferred=False)
    later, buf = _drive(steps, 64, deferred=True)
    assert torch.equal(every.kv, later.kv)
    assert later.calls == [14] and buf.flushes == 1 and buf.count == 0


def test_a_full_buffer_flushes_before_it_overflows():
    steps = [(["a", "b"], [10 + i, 20 + i], [i, 8 + i]) for i in range(7)]
    every, _ = _drive(steps, 64, deferred=False)
    later, buf = _drive(steps, 5, deferred=True)
    assert torch.equal(every.kv, later.kv)
    # 2 + 2 fit in 5; the third step's 2 would not: 4, 4, 4, then the last 2.
    assert later.calls == [4, 4, 4, 2]


def test_changed_requests_flush_so_a_reused_slot_ends_with_its_new_owner():
    # Request "a" finishes after two steps; its slot 3 goes to request "c".
    steps = [(["a", "b"], [5, 9], [3, 8]), (["a", "b"], [6, 10], [3, 9]),
             (["c", "b"], [0, 11], [3, 10])]
    every, _ = _drive(steps, 64, deferred=False)
    later, buf = _drive(steps, 64, deferred=True)
    assert torch.equal(every.kv, later.kv)
    assert later.calls == [4, 2]


def test_a_step_larger_than_the_buffer_is_refused_and_empty_flushes_do_nothing():
    buf = DeferredContext(2, 6, torch.float32, torch.device("cpu"))
    cache = FakeCache()
    assert not buf.fits(3) and buf.fits(2)
    with pytest.raises(ValueError, match="does not fit the deferred context buffer of 2"):
        buf.append(["a", "b", "c"], _step(3), torch.arange(3), [torch.arange(3)], cache.store)
    assert buf.flush(cache.store) == 0 and cache.calls == []
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        DeferredContext(0, 6, torch.float32, torch.device("cpu"))


@pytest.mark.filterwarnings("error")
def test_views_of_persistent_buffers_rewritten_every_step_are_read_anew():
    """The runner hands each step views of the same buffers (its inputs, the target
    graph's outputs), rewritten in place: the appends reuse their views, and what they
    store is each step's contents, as a store every step writes them; a step of another
    size, or from other buffers, reads its own."""
    width = 3
    aux_bufs = [torch.zeros(8, width), torch.zeros(8, width)]
    other_bufs = [torch.zeros(8, width), torch.zeros(8, width)]
    pos_buf = torch.zeros(8, dtype=torch.int64)
    slot_buf = torch.zeros(2, 8, dtype=torch.int64)
    # (requests, positions, slots, buffers): two requests for three steps, one step
    # from other buffers (an eager step), one from the first again, then a step of one
    # request (the buffers' second rows still hold the last step's).
    plan = [(["a", "b"], [10 + i, 20 + i], [i, 8 + i], aux_bufs) for i in range(3)]
    plan.append((["a", "b"], [13, 23], [3, 11], other_bufs))
    plan.append((["a", "b"], [14, 24], [4, 12], aux_bufs))
    plan.append((["a"], [15], [5], aux_bufs))
    every, later = FakeCache(), FakeCache()
    buf = DeferredContext(64, 2 * width, torch.float32, torch.device("cpu"))
    for i, (req_ids, positions, slots, bufs) in enumerate(plan):
        n = len(req_ids)
        for b, values in zip(bufs, _step(n, width, seed=i)):
            b[:n] = values
        pos_buf[:n] = torch.tensor(positions)
        slot_buf[0, :n] = torch.tensor(slots)
        slot_buf[1, :n] = torch.tensor(slots) + 32
        rows = [slot_buf[0], slot_buf[1]]
        aux = [b[:n] for b in bufs]
        every.store(torch.cat(aux, dim=-1), pos_buf[:n].clone(), [r[:n].clone() for r in rows])
        buf.append(req_ids, aux, pos_buf[:n], rows, later.store)
    buf.flush(later.store)
    assert torch.equal(every.kv, later.kv)
    assert later.calls == [10, 1]


def test_the_buffer_grows_to_the_largest_context_store_graph_up_to_a_cap():
    """Four steps of the largest batch, at least 256 tokens, and the largest graph a
    flush can replay, capped: a graph larger than the cap leaves the buffer at the cap
    (its rows of auxiliary states are memory the KV cache does not get)."""
    from vllm_ddtree.deferred_context import MAX_GRAPH_TOKENS, MIN_TOKENS, deferral_capacity

    assert deferral_capacity(1) == MIN_TOKENS == 256
    assert deferral_capacity(64) == 256 and deferral_capacity(128) == 512
    assert deferral_capacity(64, [1, 2, 4, 128]) == 256
    assert deferral_capacity(64, [1, 512, 528]) == 528
    assert deferral_capacity(64, [1, 8, 1024]) == 1024
    assert deferral_capacity(64, [1, 8, 4096]) == MAX_GRAPH_TOKENS == 1024
    assert deferral_capacity(512, [1, 8, 1024]) == 2048


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_random_indices_over_the_whole_int64_range_survive_a_flush(dtype, device):
    """Every int64 bit pattern (the NaN and infinity patterns of the states' dtype
    among them) comes back from the rows as it went in, on the engine's device too,
    after appends at successive offsets; the states are the steps' to the bit."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)
    buf = DeferredContext(64, 3 * 8, dtype, dev, max_slot_rows=2)
    aux = [torch.randn(64, 8, device=dev, generator=g).to(dtype) for _ in range(3)]
    pos = torch.randint(-2**62, 2**62, (64,), device=dev, generator=g)
    rows = [torch.randint(-2**63, 2**63 - 1, (64,), device=dev, generator=g) for _ in range(2)]
    rows[0][:8] = -1
    got = []
    for k in range(4):
        step = slice(16 * k, 16 * k + 16)
        buf.append([f"r{i}" for i in range(16)], [a[step] for a in aux], pos[step],
                   [r[step] for r in rows], got.append)
    buf.flush(lambda s, p, sl: got.append((s.clone(), p.clone(), [x.clone() for x in sl])))
    states, positions, slots = got[0]
    bits = {2: torch.int16, 4: torch.int32}[states.element_size()]
    assert torch.equal(states.contiguous().view(bits), torch.cat(aux, -1).view(bits))
    assert torch.equal(positions, pos) and all(torch.equal(a, b) for a, b in zip(slots, rows))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_indices_keep_every_bit_in_the_states_columns(dtype):
    """Positions and slots ride in the states' buffer as raw bytes: negative slots
    (vLLM's padding -1, whose bytes are a NaN in every float dtype) and values past
    any float's exact range come back unchanged, and the states are the step's."""
    buf = DeferredContext(8, 4, dtype, torch.device("cpu"), max_slot_rows=2)
    got = []
    positions = torch.tensor([0, 2**40 + 3, -1], dtype=torch.int64)
    rows = [torch.tensor([-1, 7, 2**62 + 1]), torch.tensor([5, -2**63, 0])]
    aux = [torch.arange(6, dtype=dtype).view(3, 2), -torch.arange(6, dtype=dtype).view(3, 2)]
    buf.append(["a", "b", "c"], aux, positions, rows,
               lambda s, p, sl: got.append((s.clone(), p.clone(), [x.clone() for x in sl])))
    buf.flush(lambda s, p, sl: got.append((s.clone(), p.clone(), [x.clone() for x in sl])))
    states, pos, slots = got[0]
    assert torch.equal(states, torch.cat(aux, dim=-1))
    assert torch.equal(pos, positions)
    assert len(slots) == 2 and all(torch.equal(a, b) for a, b in zip(slots, rows))


def test_an_append_is_one_copy_and_fewer_slot_rows_reuse_the_buffer():
    """A step's entries are written by one op (``cat``), no ``stack`` or second copy;
    the first append's slot-row count lays the rows out over the buffer allocated at
    start-up (allocated with the model, before vLLM sizes the KV cache)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    buf = DeferredContext(4, 6, torch.bfloat16, torch.device("cpu"), max_slot_rows=4)
    flat = buf._flat
    aux_bufs = [torch.randn(8, 3).to(torch.bfloat16) for _ in range(2)]
    pos_buf = torch.arange(8)
    slot_buf = torch.arange(16).view(2, 8)
    cache = FakeCache()
    buf.append(["a", "b"], [b[:2] for b in aux_bufs], pos_buf[:2], [slot_buf[0]], cache.store)
    assert buf._flat is flat and buf.slot_rows == 1 and buf.rows.shape == (4, 6 + 2 * 4)
    # Two more steps: the buffer fills, flushes, and every offset has been written once.
    for _ in range(2):
        buf.append(["a", "b"], [b[:2] for b in aux_bufs], pos_buf[:2], [slot_buf[0]],
                   cache.store)
    # The runner's next step: new views of the same buffers (made before, as the
    # runner makes them); the append reuses its views of them and of its buffer.
    step = ([b[:2] for b in aux_bufs], pos_buf[:2], [slot_buf[0]])
    with Ops() as ops:
        buf.append(["a", "b"], *step, cache.store)
    assert ops.names == ["cat"]
    assert buf.count == 4 and cache.calls == [4]
