"""compact_accepted_path_ (hidden states + every layer's KV in one Triton launch) vs the
speculator's current per-layer path (torch gather/scatter + compact_kv_cache_ per layer)."""

from __future__ import annotations

import zlib

import pytest
import torch

from vllm_ddtree import kv_compaction as kvc
from vllm_ddtree.kv_compaction import (
    accepted_path_moves,
    build_kv_ptr_table,
    compact_accepted_path_,
    compact_accepted_path_torch_,
    compact_kv_cache_,
)

NB, BS, H, HS = 16, 8, 2, 8  # blocks, block size, kv heads, head size
DEV = "cpu"  # tests that run the kernels use conftest.triton_device instead
DEPTH = 5  # accepted_nodes has DEPTH + 1 columns
BUDGET = 9  # tree nodes besides the root


def _rand(gen, shape, dtype):
    return (torch.randn(*shape, generator=gen) * 4).to(dtype)


def _make_caches(kind: str, num_layers: int, dtype, gen, device="cpu"):
    """Separate per-layer caches as the attention layers hold them (layout "vllm":
    logical (nb, H, bs, 2*hs)), on ``device`` (random values drawn on the CPU)."""
    if kind == "hnd":  # physical = logical
        return [_rand(gen, (NB, H, BS, 2 * HS), dtype).to(device) for _ in range(num_layers)]
    if kind == "nhd":  # vLLM default: physical (nb, bs, H, 2hs), permuted to logical
        return [_rand(gen, (NB, BS, H, 2 * HS), dtype).to(device).permute(0, 2, 1, 3)
                for _ in range(num_layers)]
    if kind == "shared_buffer":  # layers carved from one raw buffer at odd element gaps
        n = NB * BS * H * 2 * HS
        raw = _rand(gen, (num_layers * (n + 3),), dtype).to(device)
        return [raw[i * (n + 3): i * (n + 3) + n].view(NB, BS, H, 2 * HS).permute(0, 2, 1, 3)
                for i in range(num_layers)]
    raise AssertionError(kind)


def _scenario(gen, num_req: int, pad_reqs: int = 0):
    """accepted_nodes / num_accepted / query_start_loc / slot_mapping of a batch.

    Request kinds cycle through: random path, k = 0, full depth, no tree (one token),
    random path with junk past k. Each request's slots start at a random in-block
    offset of its own random blocks, so paths straddle blocks. ``pad_reqs`` trailing
    CUDA-graph-padding-like requests have a path but only slot -1 (their hidden rows
    move, their KV does not)."""
    width = DEPTH + 1
    acc = torch.full((num_req + pad_reqs, width), -1, dtype=torch.int64)
    num_acc = torch.zeros(num_req + pad_reqs, dtype=torch.int64)
    lens = []
    for r in range(num_req):
        kind = r % 5
        n = 1 if kind == 3 else BUDGET + 1
        lens.append(n)
        acc[r, 0] = 0
        if kind in (1, 3):
            k = 0
        elif kind == 2:
            k = DEPTH
        else:
            k = int(torch.randint(0, DEPTH + 1, (1,), generator=gen))
        nodes = torch.randperm(n - 1, generator=gen)[:k].sort().values + 1
        acc[r, 1: k + 1] = nodes
        num_acc[r] = k
        if kind == 4 and k < DEPTH:
            acc[r, k + 1:] = torch.randint(0, n, (DEPTH - k,), generator=gen)  # ignored
    for r in range(num_req, num_req + pad_reqs):  # garbage path, all slots -1
        acc[r, :3] = torch.tensor([0, 2, 4])
        num_acc[r] = 2
        lens.append(BUDGET + 1)
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int64)
    qsl[1:] = torch.tensor(lens).cumsum(0)
    total = int(qsl[-1])
    blocks = torch.randperm(NB, generator=gen)
    slots = torch.full((total + 3,), -1, dtype=torch.int64)  # + padded tokens at the end
    for r in range(num_req):
        b0, b1 = blocks[2 * r], blocks[2 * r + 1]
        off = int(torch.randint(0, 2 * BS - lens[r] + 1, (1,), generator=gen))
        pos = off + torch.arange(lens[r])
        slots[qsl[r]: qsl[r] + lens[r]] = torch.where(pos < BS, b0 * BS + pos, b1 * BS + pos - BS)
    return acc, num_acc, qsl, slots


def _current_path(kv_caches, hidden, acc, num_acc, qsl, slot_mapping, kv_backend):
    """Literal copy of DDTreeSpeculator._compact_accepted_path (KV + hidden states)."""
    num_reqs = acc.shape[0]
    start = qsl[:num_reqs].to(torch.int64)[:, None]
    j = torch.arange(acc.shape[1], device=acc.device)[None, :]
    on_path = (acc >= 0) & (j <= num_acc[:num_reqs, None])
    src_rows = torch.where(on_path, start + acc, -1).flatten()
    dst_rows = torch.where(on_path, start + j, -1).flatten()
    moves = on_path.flatten() & (src_rows != dst_rows)
    src_rows = torch.where(moves, src_rows, -1)
    dst_rows = torch.where(moves, dst_rows, -1)
    safe_src = torch.where(moves, src_rows, 0)
    safe_dst = torch.where(moves, dst_rows, 0)
    hidden[safe_dst] = hidden[safe_src]
    slots = slot_mapping.to(torch.int64)
    src_slots = torch.where(moves, slots[safe_src], -1)
    dst_slots = torch.where(moves, slots[safe_dst], -1)
    for kv in kv_caches:
        compact_kv_cache_(kv, src_slots, dst_slots, "vllm", moves_per_group=acc.shape[1], backend=kv_backend)


def _bits(t):
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t


def _count_launches(monkeypatch):
    launches = []

    def counting(real):
        def wrap(fn):
            kernel = real(fn)

            class _Launcher:
                def __getitem__(self, grid):
                    launches.append((fn.__name__, grid))
                    return kernel[grid]

            return _Launcher()

        return wrap

    # Per-layer kernels launch through jit, the one-launch path through launcher.
    monkeypatch.setattr(kvc, "jit", counting(kvc.jit))
    monkeypatch.setattr(kvc, "launcher", counting(kvc.launcher))
    return launches


@pytest.mark.parametrize("kind", ["hnd", "nhd", "shared_buffer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_launch_matches_per_layer_path(triton_device, monkeypatch, kind, dtype):
    DEV = triton_device
    gen = torch.Generator().manual_seed(zlib.crc32(f"{kind}-{dtype}".encode()))
    num_layers = 4
    acc, num_acc, qsl, slots = _scenario(gen, num_req=7, pad_reqs=2)
    acc, num_acc, qsl, slots = (t.to(DEV) for t in (acc, num_acc, qsl, slots))
    num_reqs = acc.shape[0]
    caches = _make_caches(kind, num_layers, dtype, gen, DEV)
    hidden = _rand(gen, (slots.shape[0], 24), dtype).to(DEV)

    want_kv = [c.clone() for c in caches]
    want_h = hidden.clone()
    _current_path(want_kv, want_h, acc, num_acc, qsl, slots, "torch")
    # the per-layer Triton path agrees with the torch path (sanity of the comparison)
    per_layer = [c.clone() for c in caches]
    _current_path(per_layer, hidden.clone(), acc, num_acc, qsl, slots, "triton")
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(per_layer, want_kv))
    assert any(not torch.equal(_bits(a), _bits(b)) for a, b in zip(want_kv, caches))
    assert not torch.equal(want_h, hidden)

    # the fused call, on caches that keep the original strides and layer spacing
    got_kv = caches  # compacted in place (the caches are not needed afterwards)
    got_h = hidden.clone()
    launches = _count_launches(monkeypatch)
    # the runner's dtypes: num_accepted int32 (walk), query_start_loc int32
    table = compact_accepted_path_(got_kv, got_h, acc, num_acc[:num_reqs].int(), qsl.int(), slots,
                                   backend="triton")
    assert [name for name, _ in launches] == ["_compact_path_kernel"]
    assert launches[0][1][0] == num_reqs
    assert table is not None and table.num_layers == num_layers
    for layer, (a, b) in enumerate(zip(got_kv, want_kv)):
        assert torch.equal(_bits(a), _bits(b)), f"layer {layer}"
    assert torch.equal(got_h, want_h)

    # the returned table is reused as is on the next call (no rebuild)
    monkeypatch.setattr(kvc, "KVPointerTable", None)  # building one now would fail
    again = compact_accepted_path_(got_kv, got_h, acc, num_acc[:num_reqs], qsl, slots,
                                   kv_ptr_table=table, backend="triton")
    assert again is table


def test_semantics_by_loop(triton_device):
    DEV = triton_device
    gen = torch.Generator().manual_seed(11)
    acc, num_acc, qsl, slots = _scenario(gen, num_req=6, pad_reqs=1)
    acc, num_acc, qsl, slots = (t.to(DEV) for t in (acc, num_acc, qsl, slots))
    caches = _make_caches("nhd", 3, torch.float32, gen, DEV)
    hidden = _rand(gen, (slots.shape[0], 5, 3), torch.float32).to(DEV)  # 3-d hidden rows
    before_kv = [c.clone() for c in caches]
    before_h = hidden.clone()
    wide = torch.full((acc.shape[0], acc.shape[1] + 3), -1, dtype=torch.int64, device=DEV)
    wide[:, : acc.shape[1]] = acc  # strided accepted_nodes rows, like a [:num_reqs] slice
    compact_accepted_path_(caches, hidden, wide[:, : acc.shape[1]], num_acc, qsl, slots, backend="triton")
    touched_rows, touched_slots = set(), set()
    for r in range(acc.shape[0]):
        s = int(qsl[r])
        for j in range(1, int(num_acc[r]) + 1):
            i = int(acc[r, j])
            assert torch.equal(hidden[s + j], before_h[s + i])
            touched_rows.add(s + j)
            src, dst = int(slots[s + i]), int(slots[s + j])
            if src >= 0 and dst >= 0:
                touched_slots.add(dst)
                for c, b in zip(caches, before_kv):
                    assert torch.equal(c[dst // BS, :, dst % BS], b[src // BS, :, src % BS])
    for row in range(hidden.shape[0]):
        if row not in touched_rows:
            assert torch.equal(hidden[row], before_h[row])
    for s in range(NB * BS):
        if s not in touched_slots:
            for c, b in zip(caches, before_kv):
                assert torch.equal(c[s // BS, :, s % BS], b[s // BS, :, s % BS])


def test_overlapping_moves_need_gather_then_scatter(triton_device):
    DEV = triton_device
    # path 0 -> 2 -> 3 -> 5 inside one block: move 1 reads slot 2, which move 2 writes
    caches = [(torch.arange(NB * H * BS * 2 * HS, dtype=torch.float32).view(NB, H, BS, 2 * HS)
               + 1000 * i).to(DEV) for i in range(2)]
    acc = torch.tensor([[0, 2, 3, 5, -1, -1]], device=DEV)
    slots = torch.arange(3 * BS, 3 * BS + 8, device=DEV)
    hidden = torch.arange(8 * 4, dtype=torch.float32).view(8, 4).to(DEV)
    want = [c.clone() for c in caches]
    want_h = hidden.clone()
    for j, i in enumerate([0, 2, 3, 5]):
        for w, c in zip(want, caches):
            w[3, :, j] = c[3, :, i]
        want_h[j] = hidden[i]
    compact_accepted_path_(caches, hidden, acc, torch.tensor([3], device=DEV),
                           torch.tensor([0, 8], device=DEV), slots, backend="triton")
    assert all(torch.equal(a, b) for a, b in zip(caches, want))
    assert torch.equal(hidden, want_h)


def test_kv_only_hidden_only_and_empty(triton_device):
    DEV = triton_device
    gen = torch.Generator().manual_seed(5)
    acc, num_acc, qsl, slots = _scenario(gen, num_req=5)
    acc, num_acc, qsl, slots = (t.to(DEV) for t in (acc, num_acc, qsl, slots))
    caches = _make_caches("hnd", 2, torch.bfloat16, gen, DEV)
    hidden = _rand(gen, (slots.shape[0], 16), torch.bfloat16).to(DEV)
    want_kv, want_h = [c.clone() for c in caches], hidden.clone()
    compact_accepted_path_torch_(want_kv, want_h, acc, num_acc, qsl, slots)
    compact_accepted_path_(caches, None, acc, num_acc, qsl, slots, backend="triton")
    assert all(torch.equal(a, b) for a, b in zip(caches, want_kv))
    assert compact_accepted_path_([], hidden, acc, num_acc, qsl, None, backend="triton") is None
    assert torch.equal(hidden, want_h)
    # no requests: nothing happens, no error
    compact_accepted_path_(caches, hidden, acc[:0], num_acc[:0], qsl, slots, backend="triton")
    assert torch.equal(hidden, want_h)


def test_torch_backend_is_the_current_path():
    gen = torch.Generator().manual_seed(6)
    acc, num_acc, qsl, slots = _scenario(gen, num_req=6, pad_reqs=1)
    acc, num_acc, qsl, slots = (t.to(DEV) for t in (acc, num_acc, qsl, slots))
    caches = _make_caches("nhd", 3, torch.float32, gen, DEV)
    hidden = _rand(gen, (slots.shape[0], 8), torch.float32).to(DEV)
    want_kv, want_h = [c.clone() for c in caches], hidden.clone()
    _current_path(want_kv, want_h, acc, num_acc, qsl, slots, "torch")
    assert compact_accepted_path_(caches, hidden, acc, num_acc, qsl, slots, backend="torch") is None
    assert all(torch.equal(a, b) for a, b in zip(caches, want_kv))
    assert torch.equal(hidden, want_h)


def test_accepted_path_moves():
    acc = torch.tensor([[0, 2, 3, -1], [0, 1, 7, 8], [0, -1, -1, -1]])
    num_acc = torch.tensor([2, 1, 0])
    qsl = torch.tensor([0, 10, 20, 21])
    slots = torch.arange(21) + 100
    src_r, dst_r, src_s, dst_s = accepted_path_moves(acc, num_acc, qsl, slots)
    # request 1: column 1 is the identity (node 1 at depth 1), column 2 is past k
    assert src_r.tolist() == [-1, 2, 3, -1] + [-1] * 4 + [-1] * 4
    assert dst_r.tolist() == [-1, 1, 2, -1] + [-1] * 4 + [-1] * 4
    assert src_s.tolist() == [-1, 102, 103, -1] + [-1] * 8
    assert dst_s.tolist() == [-1, 101, 102, -1] + [-1] * 8


def test_pointer_table_checks():
    gen = torch.Generator().manual_seed(7)
    caches = _make_caches("nhd", 3, torch.bfloat16, gen, DEV)
    table = build_kv_ptr_table(caches)
    assert table.matches(caches)
    assert (table.offsets >= 0).all() and int(table.offsets.min()) == 0
    assert not table.matches(caches[:2])
    assert not table.matches([caches[0], caches[1], caches[2].clone()])
    # widened to 8-byte words when the spacing allows; shared buffer at odd gaps: not
    shared = build_kv_ptr_table(_make_caches("shared_buffer", 3, torch.bfloat16, gen, DEV))
    assert table.base.dtype == torch.int64  # separate allocations are 8-byte aligned
    n = NB * BS * H * 2 * HS + 3
    assert shared.base.dtype == torch.bfloat16 and shared.offsets.tolist() == [0, n, 2 * n]
    with pytest.raises(ValueError, match="layer 1"):
        build_kv_ptr_table([caches[0], caches[1].float(), caches[2]])
    with pytest.raises(ValueError, match="attn.2"):
        build_kv_ptr_table([caches[0], caches[1], caches[2].contiguous()], layer_names=["a", "b", "attn.2"])
    # layers whose addresses are not a whole number of elements apart
    buf = bytearray(4 * 64 + 8)
    a = torch.frombuffer(buf, dtype=torch.float32, count=64, offset=0).view(2, 2, 4, 4)
    b = torch.frombuffer(buf, dtype=torch.float32, count=64, offset=2).view(2, 2, 4, 4)
    with pytest.raises(ValueError, match="not a multiple of the element size"):
        build_kv_ptr_table([a, b], layer_names=["attn.0", "attn.1"])


def test_stale_table_is_rebuilt(triton_device):
    DEV = triton_device
    gen = torch.Generator().manual_seed(8)
    acc, num_acc, qsl, slots = _scenario(gen, num_req=4)
    acc, num_acc, qsl, slots = (t.to(DEV) for t in (acc, num_acc, qsl, slots))
    old = _make_caches("nhd", 2, torch.float32, gen, DEV)
    table = build_kv_ptr_table(old)
    caches = _make_caches("nhd", 2, torch.float32, gen, DEV)
    want = [c.clone() for c in caches]
    compact_accepted_path_torch_(want, None, acc, num_acc, qsl, slots)
    new_table = compact_accepted_path_(caches, None, acc, num_acc, qsl, slots, kv_ptr_table=table,
                                       backend="triton")
    assert new_table is not table and new_table.matches(caches)
    assert all(torch.equal(a, b) for a, b in zip(caches, want))


def _tree_positions(qsl, base, gen, depth_of):
    """Positions as the verification left them: a request's first row keeps its linear
    position, the others hold start + depth (here random depths >= 1), except prefill-
    like requests (``depth_of(r)`` None) whose rows stay linear."""
    total = int(qsl[-1])
    pos = torch.zeros(total + 3, dtype=torch.int64)  # + padded rows past the last request
    pos[total:] = -5
    linear = pos.clone()
    for r in range(qsl.shape[0] - 1):
        a, b = int(qsl[r]), int(qsl[r + 1])
        start = base + 37 * r
        linear[a:b] = start + torch.arange(b - a)
        pos[a:b] = linear[a:b]
        if depth_of(r) is not None and b - a > 1:
            pos[a + 1:b] = start + torch.randint(1, 6, (b - a - 1,), generator=gen)
    return pos, linear


@pytest.mark.parametrize("with_kv", [True, False])
def test_positions_are_restored_in_the_same_launch(triton_device, monkeypatch, with_kv):
    DEV = triton_device
    gen = torch.Generator().manual_seed(21)
    acc, num_acc, qsl, slots = _scenario(gen, num_req=7)
    # request 6 is a long prefill chunk: rows past BLOCK_E in the restore loop
    lens = (qsl[1:] - qsl[:-1]).tolist()
    lens[-1] = 300
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int64)
    qsl[1:] = torch.tensor(lens).cumsum(0)
    slots = torch.cat([slots, torch.full((int(qsl[-1]) + 3 - slots.shape[0],), -1)])
    pos, linear = _tree_positions(qsl, 100, gen, lambda r: None if r == 6 else 1)
    acc, num_acc, qsl, slots, pos = (t.to(DEV) for t in (acc, num_acc, qsl, slots, pos))
    caches = _make_caches("nhd", 2, torch.float32, gen, DEV) if with_kv else []
    hidden = _rand(gen, (slots.shape[0], 8), torch.float32).to(DEV)
    want_kv, want_h = [c.clone() for c in caches], hidden.clone()
    compact_accepted_path_torch_(want_kv, want_h, acc, num_acc, qsl, slots if with_kv else None)
    launches = _count_launches(monkeypatch)
    compact_accepted_path_(caches, hidden, acc, num_acc, qsl, slots if with_kv else None,
                           backend="triton", positions=pos)
    assert len(launches) == 1
    assert torch.equal(pos.cpu(), linear)  # padded rows past the last request untouched
    assert all(torch.equal(a, b) for a, b in zip(caches, want_kv))
    assert torch.equal(hidden, want_h)


def test_positions_restore_reference_and_checks():
    gen = torch.Generator().manual_seed(22)
    acc, num_acc, qsl, slots = _scenario(gen, num_req=4)
    pos, linear = _tree_positions(qsl, 7, gen, lambda r: 1)
    compact_accepted_path_([], None, acc, num_acc, qsl, None, backend="torch", positions=pos)
    assert torch.equal(pos, linear)
    with pytest.raises(ValueError, match="R\\+1=5 query_start_loc"):
        compact_accepted_path_([], None, acc, num_acc, qsl[:4], None, backend="torch", positions=pos)
    with pytest.raises(ValueError, match="1-D integer"):
        compact_accepted_path_([], None, acc, num_acc, qsl, None, backend="torch",
                               positions=pos.float())


def test_step_varying_counts_are_not_specialised(monkeypatch):
    """Token/row counts change every step; specialising on them (== 1, % 16 == 0) would
    compile new kernel variants in the middle of serving."""
    from vllm_ddtree import _triton
    from vllm_ddtree.tree_mask import _rewrite_positions_kernel

    assert kvc._compact_path_kernel._ddtree_varying_args == ("num_slots", "num_hid_rows")
    assert _rewrite_positions_kernel._ddtree_varying_args == ("n",)
    if not _triton.HAS_TRITON:
        pytest.skip("triton is not importable")
    seen = {}

    def fake_jit(fn, **kw):
        seen[fn.__name__] = kw
        return fn

    monkeypatch.setattr(_triton.triton, "jit", fake_jit)
    monkeypatch.setattr(_triton, "_JIT_CACHE", {})
    _triton.jit(kvc._compact_path_kernel)
    _triton.jit(kvc._compact_kv_kernel)
    assert seen["_compact_path_kernel"]["do_not_specialize"] == ["num_slots", "num_hid_rows"]
    assert seen["_compact_kv_kernel"]["do_not_specialize"] is None
