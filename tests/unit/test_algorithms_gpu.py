"""GPU checks of the DDTree algorithms: compiled Triton kernels, no host sync, CUDA
graph capture, and the KV-compaction ordering under real parallelism.

Run on a GPU host: ``pytest -m gpu tests/unit/test_algorithms_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from vllm_ddtree.kv_compaction import (
    accepted_slot_moves,
    compact_kv_cache_,
    compact_kv_cache_torch_,
    compact_rows_,
)
from vllm_ddtree.tree_builder import build_trees, empty_tree
from tests.references import build_tree_reference
from vllm_ddtree.tree_mask import tree_ancestor_mask
from tests.references import tree_ancestor_mask_reference
from vllm_ddtree.tree_walk import walk_tree
from tests.references import walk_tree_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(autouse=True)
def _compiled_triton(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.parametrize("R,D,V,B,top_k", [(16, 15, 151936, 64, None), (64, 15, 32000, 64, None), (8, 15, 32000, 256, 16), (4, 3, 7, 100, None)])
def test_builder_on_gpu(R, D, V, B, top_k):
    gen = torch.Generator().manual_seed(R + B)
    logits = (torch.randn(R, D, V, generator=gen) * 3).cuda()
    tri = build_trees(logits, B, top_k, backend="triton")
    tor = build_trees(logits, B, top_k, backend="torch")
    for a, b in zip(tri, tor):
        assert torch.equal(a, b)
    # The CPU reference computes logsumexp on the CPU (a few ulps apart), so compare
    # the multiset of node scores with a tolerance and the structure exactly.
    ref = build_tree_reference(logits.cpu(), B, top_k)
    assert torch.equal(ref.node_valid, tri.node_valid.cpu())
    s_ref = ref.node_scores.sort(-1, descending=True).values
    s_tri = tri.node_scores.cpu().sort(-1, descending=True).values
    torch.testing.assert_close(s_tri, s_ref, atol=1e-4, rtol=1e-5)
    same = (ref.node_tokens == tri.node_tokens.cpu()).all(-1).float().mean().item()
    assert same > 0.9, f"only {same:.0%} of the trees identical to the reference"


def _pipeline(logits, target, tree_slots, kv, hidden, out, budget, depth):
    tree = build_trees(logits, budget, out=out, backend="triton")
    mask = tree_ancestor_mask(tree.node_parents)
    bias = torch.zeros(mask.shape, dtype=torch.bfloat16, device=mask.device).masked_fill_(
        ~mask, float("-inf"))
    walk = walk_tree(tree.node_tokens, tree.node_parents, tree.node_valid, target, depth)
    src, dst = accepted_slot_moves(walk.accepted_nodes, tree_slots)
    compact_kv_cache_(kv, src, dst, "vllm", moves_per_group=depth + 1, backend="triton")
    rows = torch.arange(tree_slots.numel(), device=tree_slots.device).view_as(tree_slots)
    rsrc, rdst = accepted_slot_moves(walk.accepted_nodes, rows)
    compact_rows_(hidden, rsrc, rdst)
    return tree, bias, walk


def _inputs(R, D, V, B, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(R, D, V, generator=gen)
    logits[..., 0] += 4.0  # deep trees
    target = torch.randint(0, 3, (R, B + 1), generator=gen)
    return logits.cuda(), target.cuda()


def test_no_host_sync_and_cuda_graph():
    R, D, V, B = 16, 8, 1000, 32
    nb, bs, heads, hs = 64, 16, 4, 64
    logits, target = _inputs(R, D, V, B, 0)
    tree_slots = (torch.arange(R * (B + 1)).view(R, B + 1) + 7).cuda()
    kv = torch.randn(nb, bs, heads, 2 * hs, device="cuda").to(torch.bfloat16).permute(0, 2, 1, 3)
    hidden = torch.randn(R * (B + 1), 32, device="cuda")
    out = empty_tree(R, B, "cuda")

    _pipeline(logits, target, tree_slots, kv, hidden, out, B, D)  # compile / warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _pipeline(logits, target, tree_slots, kv, hidden, out, B, D)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    # Capture once, replay with fresh inputs, compare with eager.
    static_logits, static_target = logits.clone(), target.clone()
    static_kv, static_hidden = kv.clone(), hidden.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _pipeline(static_logits, static_target, tree_slots, static_kv, static_hidden, out, B, D)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_tree, g_bias, g_walk = _pipeline(
            static_logits, static_target, tree_slots, static_kv, static_hidden, out, B, D
        )
    for seed in (1, 2, 3):
        new_logits, new_target = _inputs(R, D, V, B, seed)
        kv0 = torch.randn_like(kv, dtype=torch.float32).to(torch.bfloat16)
        hidden0 = torch.randn_like(hidden)
        static_logits.copy_(new_logits)
        static_target.copy_(new_target)
        static_kv.copy_(kv0)
        static_hidden.copy_(hidden0)
        graph.replay()
        eager_kv, eager_hidden = kv0.clone(), hidden0.clone()
        e_tree, e_bias, e_walk = _pipeline(
            new_logits, new_target, tree_slots, eager_kv, eager_hidden, empty_tree(R, B, "cuda"), B, D
        )
        for a, b in zip(g_tree, e_tree):
            assert torch.equal(a, b)
        assert torch.equal(g_bias, e_bias)
        for a, b in zip(g_walk, e_walk):
            assert torch.equal(a, b)
        assert torch.equal(static_kv, eager_kv)
        assert torch.equal(static_hidden, eager_hidden)
        # and against the references
        ref_walk = walk_tree_reference(e_tree.node_tokens, e_tree.node_parents, e_tree.node_valid, new_target, D)
        for a, b in zip(ref_walk, e_walk):
            assert torch.equal(a, b.cpu())
        assert torch.equal(tree_ancestor_mask_reference(e_tree.node_parents), (g_bias == 0).cpu())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_kv_compaction_aliasing_under_parallelism(dtype):
    """Maximal aliasing (i_j = j + 1: every destination is the previous move's
    source) over many requests with real head sizes; the kernel must equal the
    gather-then-scatter reference."""
    R, D, B = 256, 15, 63
    nb, bs, heads, hs = R * 4 + 8, 16, 8, 128
    gen = torch.Generator().manual_seed(0)
    raw = torch.randn(nb, bs, heads, 2 * hs, generator=gen).to(dtype)
    kv = raw.cuda().permute(0, 2, 1, 3)
    k = torch.randint(0, D + 1, (R,), generator=gen)
    cols = torch.arange(D + 1)
    acc = torch.where(cols <= k[:, None], cols + (cols > 0).long(), -1)  # 0, 2, 3, ..., k+1
    starts = torch.randperm(nb // 4 - 2, generator=gen)[:R] * 4 * bs  # disjoint 4-block spans
    tree_slots = starts[:, None] + torch.arange(B + 1)
    src, dst = accepted_slot_moves(acc, tree_slots)
    ref = raw.permute(0, 2, 1, 3).clone()
    compact_kv_cache_torch_(ref, src, dst)
    for _ in range(3):
        got = raw.cuda().permute(0, 2, 1, 3)
        compact_kv_cache_(got, src.cuda(), dst.cuda(), moves_per_group=D + 1, backend="triton")
        assert torch.equal(got.cpu().view(torch.uint8) if dtype.itemsize == 1 else got.cpu(),
                           ref.view(torch.uint8) if dtype.itemsize == 1 else ref)
    del kv
