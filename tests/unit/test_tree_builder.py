"""DDTree builder: heapq reference vs the Triton kernel and the torch fallback."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from vllm_ddtree import _triton
from vllm_ddtree.tree_builder import DDTree, _build_tree_kernel, build_trees, _logsumexp_kernel, draft_log_normalizer, draft_topk, empty_tree, resolve_top_k
from tests.references import build_tree_reference


def _assert_same_tree(ref: DDTree, got: DDTree, what: str = "") -> None:
    for name, a, b in zip(DDTree._fields, ref, got):
        b = b.cpu()
        assert a.dtype == b.dtype, f"{what} {name}: dtype {a.dtype} vs {b.dtype}"
        assert torch.equal(a, b), f"{what} {name} differs:\nref={a}\ngot={b}"


def _check_structure(tree: DDTree, depth_max: int, k: int) -> None:
    """Invariants every tree must satisfy, independent of any implementation."""
    tokens, parents, depths, valid, scores = (t.cpu() for t in tree)
    num_req, n = tokens.shape
    for r in range(num_req):
        assert parents[r, 0] == -1 and depths[r, 0] == 0 and bool(valid[r, 0])
        seen_padding = False
        children: dict[int, list[int]] = {}
        for i in range(1, n):
            if not valid[r, i]:
                seen_padding = True
                assert (parents[r, i], depths[r, i], tokens[r, i]) == (0, 1, 0)
                assert scores[r, i] == float("-inf")
                continue
            assert not seen_padding, "valid node after padding"
            p = int(parents[r, i])
            assert 0 <= p < i, "parent must precede child"
            assert depths[r, i] == depths[r, p] + 1
            assert 1 <= depths[r, i] <= depth_max
            assert scores[r, i] <= scores[r, i - 1] or i == 1, "best-first order"
            assert scores[r, i] <= scores[r, p]
            children.setdefault(p, []).append(int(tokens[r, i]))
        for p, toks in children.items():
            assert len(toks) == len(set(toks)), "siblings must carry distinct tokens"
            assert len(toks) <= k


def _run_all(logits, budget, top_k=None, root_tokens=None, device="cpu"):
    dev_logits = logits.to(device)
    dev_root = None if root_tokens is None else root_tokens.to(device)
    # The reference reads the log-normaliser of the same device as the fast paths (on
    # CUDA a Triton kernel, on the CPU torch.logsumexp: they may differ in the last
    # bit), so that scores compare bitwise.
    ref = build_tree_reference(dev_logits, budget, top_k, root_tokens=dev_root)
    tri = build_trees(dev_logits, budget, top_k, root_tokens=dev_root, backend="triton")
    tor = build_trees(dev_logits, budget, top_k, root_tokens=dev_root, backend="torch")
    return ref, tri, tor


CASES = [
    # (R, D, V, B, top_k, kind)
    (3, 4, 50, 12, None, "randn"),
    (2, 5, 1000, 24, 4, "randn"),
    (4, 3, 2, 5, None, "randn"),  # V = 2
    (2, 3, 3, 20, None, "randn"),  # V = 3
    (2, 2, 2, 10, None, "randn"),  # budget larger than the tree can hold (6 nodes)
    (3, 1, 9, 6, None, "randn"),  # D = 1
    (3, 6, 9, 1, None, "randn"),  # B = 1
    (2, 6, 9, 8, 1, "randn"),  # top_k = 1: a chain
    (3, 4, 6, 30, None, "int_ties"),  # integer logits, K = V: ties everywhere
    (3, 3, 5, 40, 5, "int_ties"),
    (2, 4, 40, 16, 6, "ties_inside_topk"),  # ties among the K, none at the cut
    (2, 3, 8, 12, None, "masked"),  # -inf logits (masked vocabulary)
    (2, 15, 64, 48, 8, "peaked"),  # deep trees, D = 15
]


def _make_logits(R, D, V, kind, gen):
    if kind == "randn":
        return torch.randn(R, D, V, generator=gen) * 2.0
    if kind == "int_ties":
        return torch.randint(0, 3, (R, D, V), generator=gen).float()
    if kind == "ties_inside_topk":
        x = torch.randint(0, 3, (R, D, V), generator=gen).float()  # background 0..2
        for r in range(R):
            for d in range(D):
                top = torch.randperm(V, generator=gen)[:6]
                x[r, d, top] = torch.randint(5, 7, (6,), generator=gen).float()  # ties, > cut
        return x
    if kind == "masked":
        x = torch.randn(R, D, V, generator=gen)
        x[..., ::2] = float("-inf")
        return x
    if kind == "peaked":
        x = torch.randn(R, D, V, generator=gen)
        x[..., 0] += 6.0
        return x
    raise AssertionError(kind)


@pytest.mark.parametrize("R,D,V,B,top_k,kind", CASES)
def test_fast_backends_match_reference(triton_device, R, D, V, B, top_k, kind):
    gen = torch.Generator().manual_seed(1000 * R + 100 * D + V + B)
    logits = _make_logits(R, D, V, kind, gen)
    ref, tri, tor = _run_all(logits, B, top_k, device=triton_device)
    k = resolve_top_k(B, V, top_k)
    _check_structure(ref, D, k)
    _assert_same_tree(ref, tri, "triton")
    _assert_same_tree(ref, tor, "torch")
    # The Triton path really ran the kernel (interpreted on CPU, compiled on CUDA).
    interp = triton_device.type == "cpu"
    assert (_build_tree_kernel, interp) in _triton._JIT_CACHE


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_request_tree_depends_only_on_its_own_logits(triton_device, backend):
    """What tensor parallelism relies on (every rank builds the tree from the same
    replicated drafter logits, docs/design.md): a request's tree is a function of its
    own logits only, bitwise: not of its batch row, the other requests, or the call."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 5, 300, generator=gen).to(triton_device)
    logits[2, :, :10] = 3.0  # ties at the top of every position of request 2
    full = build_trees(logits, 24, 8, backend=backend)
    again = build_trees(logits.clone(), 24, 8, backend=backend)
    sub = build_trees(logits[[3, 2]].contiguous(), 24, 8, backend=backend)
    for a, b in zip(full, again):
        assert torch.equal(a, b)
    for a, b in zip(full, sub):
        assert torch.equal(a[[3, 2]], b)


def test_capacity_padding():
    # V = 2, D = 2 holds 2 + 4 = 6 nodes; the other 4 are padding.
    logits = torch.tensor([[[0.0, 1.0], [2.0, 0.5]]])
    tree = build_tree_reference(logits, 10)
    assert tree.node_valid.sum().item() == 7
    assert not tree.node_valid[0, 7:].any()
    tor = build_trees(logits, 10, backend="torch")
    _assert_same_tree(tree, tor)


def test_known_small_tree():
    # Two positions, three tokens; probabilities chosen so the order is clear.
    p0 = torch.tensor([0.6, 0.3, 0.1])
    p1 = torch.tensor([0.05, 0.9, 0.05])
    logits = torch.stack([p0.log(), p1.log()])
    tree = build_tree_reference(logits, 4, root_tokens=torch.tensor(7))
    # prefixes by probability: (0)=.6, (0,1)=.54, (1)=.3, (1,1)=.27, ...
    assert tree.node_tokens.tolist() == [7, 0, 1, 1, 1]
    assert tree.node_parents.tolist() == [-1, 0, 1, 0, 3]
    assert tree.node_depths.tolist() == [0, 1, 2, 1, 2]
    assert tree.node_valid.all()
    expected = [0.0, math.log(0.6), math.log(0.54), math.log(0.3), math.log(0.27)]
    assert np.allclose(tree.node_scores.numpy(), expected, atol=1e-5)


def test_tie_break_by_creation_order():
    # All logits equal: every prefix of a depth has the same score. With V = 2, D = 2,
    # B = 6 the heap pops (0) [c0], then sibling (1) [c1] beats child (0,0) [c2];
    # then (0,0) [c2], (1,0) [c4], (0,1) [c5], (1,1) [c7].
    logits = torch.zeros(2, 2)
    tree = build_tree_reference(logits, 6)
    assert tree.node_tokens.tolist() == [0, 0, 1, 0, 0, 1, 1]
    assert tree.node_parents.tolist() == [-1, 0, 0, 1, 2, 1, 2]
    fast = build_trees(logits[None], 6, backend="torch")
    _assert_same_tree(DDTree(*(t[None] for t in tree)), fast)


def test_reference_is_top_b_prefixes():
    """Independent check of the semantics: the nodes are the B best prefixes."""
    gen = torch.Generator().manual_seed(7)
    D, V = 3, 4
    logits = torch.randn(D, V, generator=gen)
    logp = (logits - torch.logsumexp(logits, -1, keepdim=True)).double()
    all_scores = []
    for depth in range(1, D + 1):
        for toks in itertools.product(range(V), repeat=depth):
            all_scores.append(sum(float(logp[i, t]) for i, t in enumerate(toks)))
    all_scores.sort(reverse=True)
    for budget in (1, 5, 17, 40, 84):
        tree = build_tree_reference(logits, budget)
        got = sorted(tree.node_scores[1:].double().tolist(), reverse=True)
        want = all_scores[:budget] + [float("-inf")] * max(0, budget - len(all_scores))
        assert np.allclose(got, want, atol=1e-5)
        # each node's score is the sum of its path's log-probs
        for i in range(1, budget + 1):
            if not tree.node_valid[i]:
                continue
            s, j = 0.0, i
            while j > 0:
                s += float(logp[tree.node_depths[j] - 1, tree.node_tokens[j]])
                j = int(tree.node_parents[j])
            assert abs(s - float(tree.node_scores[i])) < 1e-5


def test_root_tokens_and_out_buffers(triton_device):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 4, 20, generator=gen)
    roots = torch.tensor([11, 12, 13])
    ref = build_tree_reference(logits.to(triton_device), 9, root_tokens=roots)
    assert ref.node_tokens[:, 0].tolist() == [11, 12, 13]
    for backend in ("triton", "torch"):
        out = empty_tree(3, 9, triton_device)
        res = build_trees(
            logits.to(triton_device), 9, root_tokens=roots.to(triton_device), out=out, backend=backend
        )
        assert all(a is b for a, b in zip(res, out)), "must fill the given buffers"
        _assert_same_tree(ref, out, backend)
        # reuse the buffers with other logits (what a CUDA graph replay does)
        logits2 = torch.randn(3, 4, 20, generator=gen)
        build_trees(logits2.to(triton_device), 9, root_tokens=roots.to(triton_device), out=out, backend=backend)
        _assert_same_tree(build_tree_reference(logits2.to(triton_device), 9, root_tokens=roots),
                          out, backend)


def test_half_precision_logits(triton_device):
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(2, 5, 300, generator=gen) * 3).to(torch.bfloat16)
    ref, tri, tor = _run_all(logits, 20, 8, device=triton_device)
    # bf16 logits tie a lot; the K-th place may tie (torch.topk picks there), so
    # compare the fast backends exactly with each other and with the reference when
    # every cut is tie-free.
    _assert_same_tree(DDTree(*(t.cpu() for t in tri)), tor, "triton vs torch")
    lp = logits.float() - draft_log_normalizer(logits)[..., None]
    srt = lp.sort(-1, descending=True).values
    if bool((srt[..., 7] > srt[..., 8]).all()):
        _assert_same_tree(ref, tri)


def test_draft_topk_canonical_order_and_set():
    gen = torch.Generator().manual_seed(11)
    logits = torch.randint(0, 4, (3, 5, 30), generator=gen).float()
    ids, logp = draft_topk(logits, 7)
    full = logits - draft_log_normalizer(logits)[..., None]
    assert torch.equal(logp, full.gather(-1, ids))
    for r, d in itertools.product(range(3), range(5)):
        pairs = list(zip(logp[r, d].tolist(), ids[r, d].tolist()))
        assert pairs == sorted(pairs, key=lambda t: (-t[0], t[1])), "canonical rank order"
        chosen = set(ids[r, d].tolist())
        assert len(chosen) == 7
        others = [full[r, d, t].item() for t in range(30) if t not in chosen]
        assert min(logp[r, d].tolist()) >= max(others), "a real top-K set"


@pytest.mark.parametrize(
    "kwargs,exc,msg",
    [
        (dict(budget=0), ValueError, "budget"),
        (dict(budget=4, top_k=0), ValueError, "top_k"),
        (dict(budget=4, backend="cuda"), ValueError, "backend"),
    ],
)
def test_bad_arguments(kwargs, exc, msg):
    logits = torch.randn(2, 3, 5)
    with pytest.raises(exc, match=msg):
        build_trees(logits, **kwargs)


def test_bad_shapes():
    with pytest.raises(ValueError, match=r"\[R, D, V\]"):
        build_trees(torch.randn(3, 5), 4)
    with pytest.raises(TypeError, match="floating point"):
        build_trees(torch.ones(1, 3, 5, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="root_tokens"):
        build_trees(torch.randn(2, 3, 5), 4, root_tokens=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="out.node_parents"):
        out = empty_tree(2, 4)
        out = out._replace(node_parents=torch.empty(2, 5, dtype=torch.int64))
        build_trees(torch.randn(2, 3, 5), 4, out=out)
    with pytest.raises(ValueError, match="at least one position"):
        build_trees(torch.randn(2, 0, 5), 4)


@pytest.mark.parametrize("V,dtype", [(1, torch.float32), (7, torch.float32), (5000, torch.float32),
                                     (9000, torch.bfloat16), (300, torch.float16)])
def test_log_normalizer_matches_torch(triton_device, V, dtype):
    gen = torch.Generator().manual_seed(V)
    x = (torch.randn(3, 4, V, generator=gen) * 5 + 20).to(dtype)
    x[0, 0] = float("-inf")  # fully masked row
    if V > 2:
        x[1, 1, : V // 2] = float("-inf")  # partly masked row, mask spans chunks
    got = draft_log_normalizer(x.to(triton_device)).cpu()
    assert got.dtype == torch.float32 and got.shape == (3, 4)
    assert (_logsumexp_kernel, triton_device.type == "cpu") in _triton._JIT_CACHE
    want = torch.logsumexp(x.double(), -1).float()
    assert torch.isneginf(got[0, 0])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-6)
    # strided (non-contiguous leading dims) input
    got_t = draft_log_normalizer(x.transpose(0, 1).to(triton_device)).cpu()
    torch.testing.assert_close(got_t, want.transpose(0, 1), atol=2e-5, rtol=2e-6)
