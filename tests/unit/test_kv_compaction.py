"""KV-cache / row compaction after acceptance: Triton kernel vs torch reference."""

from __future__ import annotations

import zlib

import pytest
import torch

from vllm_ddtree import _triton
from vllm_ddtree.kv_compaction import _compact_kv_kernel, accepted_slot_moves, compact_kv_cache_, compact_kv_cache_torch_, compact_rows_
from tests.references import compact_rows_reference_
from vllm_ddtree.tree_builder import build_trees
from vllm_ddtree.tree_walk import walk_tree

NB, BS, H, HS = 12, 16, 2, 8  # blocks, block size, kv heads, head size


def _make_cache(kind: str, dtype: torch.dtype, gen: torch.Generator):
    """(kv_cache view as the attention layer holds it, layout, slot -> value fn)."""
    def rand(*shape):
        x = torch.randn(*shape, generator=gen) * 4
        return x.to(dtype) if dtype.is_floating_point else x.to(torch.int16).to(dtype)

    if kind == "vllm_nhd":  # vLLM 0.26 FA/Triton default: physical (nb, bs, H, 2hs)
        kv = rand(NB, BS, H, 2 * HS).permute(0, 2, 1, 3)
        return kv, "vllm"
    if kind == "vllm_hnd":  # physical = logical (nb, H, bs, 2hs)
        return rand(NB, H, BS, 2 * HS), "flash_attn"
    if kind == "vllm_padded_pages":  # page_size_padded: strided block dim
        page = BS * H * 2 * HS
        raw = rand(NB, page + 24)
        kv = raw[:, :page].view(NB, BS, H, 2 * HS).permute(0, 2, 1, 3)
        return kv, "triton_attn"
    if kind == "kv_first":  # older FA: (2, nb, bs, H, hs)
        return rand(2, NB, BS, H, HS), "kv_first"
    if kind == "blocks_first":  # older Triton: (nb, 2, bs, H, hs)
        return rand(NB, 2, BS, H, HS), "blocks_first"
    if kind == "explicit_dims":  # (nb, bs, H*hs) with an explicit (block, token) pair
        return rand(NB, BS, H * HS), (0, 1)
    raise AssertionError(kind)


def _slot_of(kv: torch.Tensor, layout, slot: int) -> torch.Tensor:
    from vllm_ddtree.kv_compaction import _resolve_layout

    block_dim, token_dim = _resolve_layout(kv, layout)
    return kv.movedim((block_dim, token_dim), (0, 1))[slot // BS, slot % BS]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t


def _scenario(gen: torch.Generator, num_req: int = 4, budget: int = 10, depth: int = 4):
    """Trees, a walk with real acceptance, and tree slots scattered over blocks."""
    vocab = 3
    logits = torch.randn(num_req, depth, vocab, generator=gen)
    tree = build_trees(logits, budget, backend="torch")
    greedy = logits.argmax(-1)
    target = greedy.gather(1, tree.node_depths.long().clamp(max=depth - 1))
    noise = torch.randint(0, vocab, target.shape, generator=gen)
    target = torch.where(torch.rand(target.shape, generator=gen) < 0.3, noise, target)
    walk = walk_tree(tree.node_tokens, tree.node_parents, tree.node_valid, target, depth)
    # each request owns 2 random blocks (disjoint), tree starts at a random offset
    blocks = torch.randperm(NB, generator=gen)[: 2 * num_req].view(num_req, 2)
    start = torch.randint(0, 2 * BS - (budget + 1) + 1, (num_req,), generator=gen)
    pos = start[:, None] + torch.arange(budget + 1)
    tree_slots = blocks.gather(1, pos // BS) * BS + pos % BS
    return walk, tree_slots


def test_accepted_slot_moves_matches_loop():
    gen = torch.Generator().manual_seed(0)
    walk, tree_slots = _scenario(gen, num_req=6)
    src, dst = accepted_slot_moves(walk.accepted_nodes, tree_slots)
    width = walk.accepted_nodes.shape[1]
    assert src.shape == dst.shape == (6 * width,)
    for r in range(6):
        for j in range(width):
            i = int(walk.accepted_nodes[r, j])
            want = (int(tree_slots[r, i]), int(tree_slots[r, j])) if i >= 0 else (int(tree_slots[r, 0]),) * 2
            assert (int(src[r * width + j]), int(dst[r * width + j])) == want
    assert walk.num_accepted.max() >= 2


@pytest.mark.parametrize("kind", ["vllm_nhd", "vllm_hnd", "vllm_padded_pages", "kv_first", "blocks_first", "explicit_dims"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_kernel_matches_reference_and_semantics(triton_device, kind, dtype):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{kind}-{dtype}".encode()))
    walk, tree_slots = _scenario(gen)
    kv, layout = _make_cache(kind, dtype, gen)
    width = walk.accepted_nodes.shape[1]
    src, dst = accepted_slot_moves(walk.accepted_nodes, tree_slots)
    before = kv.clone()
    ref = kv.clone()
    compact_kv_cache_torch_(ref, src, dst, layout)

    dev_kv = kv.to(triton_device)
    if kind == "vllm_nhd":  # keep the permuted strides on the device copy
        dev_kv = kv.permute(0, 2, 1, 3).contiguous().to(triton_device).permute(0, 2, 1, 3)
    compact_kv_cache_(dev_kv, src.to(triton_device), dst.to(triton_device), layout,
                      moves_per_group=width, backend="triton")
    assert (_compact_kv_kernel, triton_device.type == "cpu") in _triton._JIT_CACHE
    assert torch.equal(_bits(dev_kv.cpu()), _bits(ref))

    # semantics: slot(start + j) now holds node i_j's entry, nothing else changed
    touched = set()
    for r in range(tree_slots.shape[0]):
        for j in range(int(walk.num_accepted[r]) + 1):
            i = int(walk.accepted_nodes[r, j])
            got = _slot_of(ref, layout, int(tree_slots[r, j]))
            assert torch.equal(_bits(got), _bits(_slot_of(before, layout, int(tree_slots[r, i]))))
            touched.add(int(tree_slots[r, j]))
    for s in range(NB * BS):
        if s not in touched:
            assert torch.equal(_bits(_slot_of(ref, layout, s)), _bits(_slot_of(before, layout, s)))


def test_overlapping_moves_need_gather_then_scatter(triton_device):
    # Path 0 -> 2 -> 3 -> 5: move 1 reads slot 2 which move 2 writes; move 2 reads
    # slot 3 which move 3 writes. Applying the moves in reverse order would be wrong.
    kv = torch.arange(NB * H * BS * 2 * HS, dtype=torch.float32).view(NB, H, BS, 2 * HS)
    acc = torch.tensor([[0, 2, 3, 5]])
    slots = torch.arange(3 * BS, 3 * BS + 8)[None]  # block 3, offsets 0..7
    src, dst = accepted_slot_moves(acc, slots)
    naive = kv.clone()
    for s, d in reversed(list(zip(src.tolist(), dst.tolist()))):
        naive[d // BS, :, d % BS] = naive[s // BS, :, s % BS]
    good = kv.clone()
    compact_kv_cache_torch_(good, src, dst)
    assert not torch.equal(naive, good), "the case must be sensitive to the copy order"
    for j, i in enumerate([0, 2, 3, 5]):
        assert torch.equal(good[3, :, j], kv[3, :, i])
    out = kv.clone().to(triton_device)
    compact_kv_cache_(out, src.to(triton_device), dst.to(triton_device), moves_per_group=4, backend="triton")
    assert torch.equal(out.cpu(), good)


def test_negative_and_identity_slots_are_skipped(triton_device):
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(NB, H, BS, 2 * HS, generator=gen)
    # request 0 real, request 1 a CUDA-graph padding request (slots -1)
    src = torch.tensor([[5, 9, 7, 5], [-1, -1, -1, -1]])
    dst = torch.tensor([[5, 6, 7, 5], [-1, -1, -1, -1]])
    want = kv.clone()
    want[0, :, 6] = kv[0, :, 9]
    for backend in ("triton", "torch"):
        got = kv.clone().to(triton_device) if backend == "triton" else kv.clone()
        compact_kv_cache_(got, src.to(got.device), dst.to(got.device), backend=backend)
        assert torch.equal(got.cpu(), want), backend


def test_many_groups_and_flat_input(triton_device):
    gen = torch.Generator().manual_seed(4)
    walk, tree_slots = _scenario(gen, num_req=6, budget=8, depth=5)
    kv = torch.randn(NB, H, BS, 2 * HS, generator=gen)
    src, dst = accepted_slot_moves(walk.accepted_nodes, tree_slots)
    ref = compact_kv_cache_torch_(kv.clone(), src, dst)
    w = walk.accepted_nodes.shape[1]
    one = (src.view(1, -1), dst.view(1, -1), None)  # a single group is always safe
    for s_, d_, mpg in ((src, dst, w), (src.view(-1, w), dst.view(-1, w), None), one):
        got = kv.clone().to(triton_device)
        compact_kv_cache_(got, s_.to(triton_device), d_.to(triton_device), moves_per_group=mpg, backend="triton")
        assert torch.equal(got.cpu(), ref)


def test_compact_rows():
    gen = torch.Generator().manual_seed(5)
    walk, _ = _scenario(gen, num_req=5, budget=9)
    n = 10
    rows = torch.arange(5 * n).view(5, n)  # request r's tree tokens at rows r*n .. r*n+9
    src, dst = accepted_slot_moves(walk.accepted_nodes, rows)
    hidden = torch.randn(5 * n, 7, generator=gen)
    positions = torch.arange(5 * n) * 3
    for t in (hidden, positions):
        ref = compact_rows_reference_(t.clone(), src, dst)
        got = compact_rows_(t.clone(), src, dst)
        assert torch.equal(got, ref)
    for r in range(5):
        for j in range(int(walk.num_accepted[r]) + 1):
            i = int(walk.accepted_nodes[r, j])
            assert torch.equal(got[r * n + j], positions[r * n + i])


def test_bad_inputs():
    kv = torch.zeros(NB, H, BS, 2 * HS)
    s = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="unknown KV layout"):
        compact_kv_cache_(kv, s, s, "paged")
    with pytest.raises(ValueError, match="do not fit"):
        compact_kv_cache_(kv, s, s, (0, 4))
    with pytest.raises(ValueError, match="match in shape"):
        compact_kv_cache_(kv, s, s[:3])
    with pytest.raises(ValueError, match="moves_per_group"):
        compact_kv_cache_(kv, s, s, moves_per_group=3)
    with pytest.raises(ValueError, match="need moves_per_group"):
        compact_kv_cache_(kv, s, s)
    with pytest.raises(TypeError, match="integer"):
        compact_kv_cache_(kv, s.float(), s.float())
    with pytest.raises(ValueError, match="batch mismatch"):
        accepted_slot_moves(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(3, 5, dtype=torch.int64))
