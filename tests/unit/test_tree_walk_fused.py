"""Fused sample-gather + walk (one Triton launch) vs the Python reference walk.

The Triton kernel runs on CUDA when present, else in Triton's CPU interpreter (see
conftest.triton_device); the torch fallback runs with the interpreter off on CPU.
"""

from __future__ import annotations

import random

import pytest
import torch

import vllm_ddtree.tree_walk as tw
from vllm_ddtree.tree_builder import build_trees
from tests.references import build_tree_reference
from vllm_ddtree.tree_walk import TreeWalk, empty_walk, step_walk_outputs, walk_tree_fused
from tests.references import walk_tree_reference


# --------------------------------------------------------------------------- reference


def fused_reference(node_samples, cu_num_logits, idx_mapping, tokens_by_state, parents_by_state,
                    valid_by_state, max_depth, pad_id=-1) -> TreeWalk:
    """The definition, with Python loops: gather target_tokens, mask unscheduled nodes,
    then :func:`walk_tree_reference`."""
    samples = node_samples.cpu().tolist()
    cu = cu_num_logits.cpu().tolist()
    idx = idx_mapping.cpu().long()
    tokens = tokens_by_state.cpu()[idx]
    parents = parents_by_state.cpu()[idx]
    valid = valid_by_state.cpu()[idx].clone()
    num_req, n = tokens.shape
    target = torch.zeros(num_req, n, dtype=torch.int64)
    for r in range(num_req):
        rows = cu[r + 1] - cu[r]
        for i in range(n):
            if i < rows:
                target[r, i] = samples[cu[r] + i]
            else:
                valid[r, i] = False
    return walk_tree_reference(tokens, parents, valid, target, max_depth, pad_id=pad_id)


def assert_same_walk(ref: TreeWalk, got: TreeWalk) -> None:
    for name, a, b in zip(TreeWalk._fields, ref, got):
        assert a.dtype == b.dtype, f"{name}: {a.dtype} vs {b.dtype}"
        assert a.shape == b.shape, f"{name}: {tuple(a.shape)} vs {tuple(b.shape)}"
        assert torch.equal(a, b.cpu()), f"{name}:\nref={a}\ngot={b}"


# --------------------------------------------------------------------------- cases


def _random_tree_states(rng: random.Random, num_states: int, n: int, depth: int, vocab: int,
                        kind: str):
    """tokens [S, N] int64, parents [S, N] int32, valid [S, N] bool."""
    if n == 1:
        tokens = torch.tensor([[rng.randrange(vocab)] for _ in range(num_states)], dtype=torch.int64)
        parents = torch.full((num_states, 1), -1, dtype=torch.int32)
        valid = torch.ones(num_states, 1, dtype=torch.bool)
        return tokens, parents, valid
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    roots = torch.randint(0, vocab, (num_states,), generator=gen)
    logits = torch.randn(num_states, depth, vocab, generator=gen) * rng.choice([0.5, 2.0, 5.0])
    if kind == "builder":
        tree = build_trees(logits, n - 1, backend="torch", root_tokens=roots)
        return tree.node_tokens.clone(), tree.node_parents.clone(), tree.node_valid.clone()
    if kind == "reference_builder":
        tree = build_tree_reference(logits, n - 1, root_tokens=roots)
        return tree.node_tokens.clone(), tree.node_parents.clone(), tree.node_valid.clone()
    # "arbitrary": any parent of lower index, tiny vocab (equal-token siblings), random
    # validity (an invalid node's subtree may still claim to be valid: never reached)
    parents = torch.tensor([[-1] + [rng.randrange(i) for i in range(1, n)] for _ in range(num_states)],
                           dtype=torch.int32)
    tokens = torch.randint(0, 2, (num_states, n), generator=gen)
    valid = torch.rand(num_states, n, generator=gen) < 0.85
    valid[:, 0] = True
    return tokens, parents, valid


def _random_case(seed: int, n: int | None = None):
    rng = random.Random(seed)
    n = n if n is not None else rng.choice([1, 2, 3, 5, 8, 16, 17, 33, 64, 65, rng.randint(1, 65)])
    depth = rng.randint(1, 15)
    vocab = rng.choice([2, 3, 5, 50])
    num_req = rng.randint(1, 9)
    num_states = num_req + rng.randint(0, 4)
    kind = rng.choice(["builder", "builder", "reference_builder", "arbitrary"])
    tokens, parents, valid = _random_tree_states(rng, num_states, n, depth, vocab, kind)
    if rng.random() < 0.3:  # some states hold no tree beyond the root
        valid[rng.randrange(num_states), 1:] = False
    idx_mapping = torch.tensor(rng.sample(range(num_states), num_req), dtype=torch.int32)
    # walk depth: the tree depth, or less (caps the walk), or more
    max_depth = max(0, depth + rng.choice([0, 0, 0, -1, -3, 2]))

    # rows per request: the full tree, a prefix of it, a single row (prefill / plain
    # decode); rarely none or more rows than nodes (ignored past N)
    rows = []
    for _ in range(num_req):
        u = rng.random()
        if u < 0.45:
            rows.append(n)
        elif u < 0.75:
            rows.append(rng.randint(1, n))
        elif u < 0.92:
            rows.append(1)
        elif u < 0.96:
            rows.append(0)
        else:
            rows.append(n + rng.randint(1, 3))
    cu = [0]
    for k in rows:
        cu.append(cu[-1] + k)
    num_logits = cu[-1] + rng.choice([0, 0, 3])  # CUDA-graph padding rows after the batch
    samples = [rng.randrange(vocab + 1) for _ in range(num_logits)]
    # adversarial targets: follow a random root path of (scheduled, valid) nodes
    for r in range(num_req):
        s = int(idx_mapping[r])
        cand = [i for i in range(min(n, rows[r])) if bool(valid[s, i])]
        if not cand or rng.random() < 0.15:
            continue
        node = rng.choice(cand) if rng.random() < 0.5 else max(cand)
        while node > 0:
            p = int(parents[s, node])
            if p < rows[r]:
                samples[cu[r] + p] = int(tokens[s, node])
            node = p
    return dict(
        node_samples=torch.tensor(samples, dtype=torch.int64),
        cu_num_logits=torch.tensor(cu, dtype=torch.int32),
        idx_mapping=idx_mapping,
        tokens_by_state=tokens,
        parents_by_state=parents,
        valid_by_state=valid,
        max_depth=max_depth,
    )


def _to(case: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}


def _no_fallback(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the torch fallback ran where the Triton kernel should")

    monkeypatch.setattr(tw, "walk_tree", boom)


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("seed", range(40))
def test_fused_matches_reference_triton(seed, triton_device, monkeypatch):
    _no_fallback(monkeypatch)
    case = _random_case(seed)
    pad_id = [-1, 0, 12345][seed % 3]
    ref = fused_reference(**case, pad_id=pad_id)
    got = walk_tree_fused(**_to(case, triton_device), pad_id=pad_id)
    assert_same_walk(ref, got)


@pytest.mark.parametrize("seed", range(40))
def test_fused_matches_reference_torch_fallback(seed, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors + no interpreter: fallback
    assert not tw.can_use_triton(torch.zeros(1))
    case = _random_case(seed)
    ref = fused_reference(**case, pad_id=-3)
    assert_same_walk(ref, walk_tree_fused(**case, pad_id=-3))


def test_fused_walks_go_deep():
    """The generator really produces deep acceptances (the tests have power)."""
    deep = 0
    for seed in range(40):
        case = _random_case(seed)
        deep = max(deep, int(fused_reference(**case).num_accepted.max()))
    assert deep >= 8


@pytest.mark.parametrize("fallback", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_fused_out_buffers(seed, fallback, triton_device, monkeypatch):
    if fallback:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        device = torch.device("cpu")
        if triton_device.type == "cuda":
            pytest.skip("the fallback is exercised on CPU")
    else:
        _no_fallback(monkeypatch)
        device = triton_device
    case = _random_case(100 + seed)
    num_req, width = case["idx_mapping"].numel(), case["max_depth"] + 1
    out = empty_walk(num_req + 3, case["max_depth"], device)
    for t in out:
        t.fill_(777)  # stale values from an earlier step
    ref = fused_reference(**case)
    got = walk_tree_fused(**_to(case, device), out=out)
    assert_same_walk(ref, got)
    for t, g in zip(out, got):
        assert g.data_ptr() == t.data_ptr()  # views of the buffers, nothing allocated
        assert t[num_req:].eq(777).all()  # rows past R untouched
    # a second step into the same buffers
    case2 = _random_case(200 + seed)
    case2["max_depth"] = case["max_depth"]
    if case2["idx_mapping"].numel() <= num_req + 3:
        assert_same_walk(fused_reference(**case2), walk_tree_fused(**_to(case2, device), out=out))
    assert out.accepted_nodes.shape[1] == width


def test_fused_dtypes_and_strides(triton_device, monkeypatch):
    _no_fallback(monkeypatch)
    for seed in range(6):
        case = _random_case(300 + seed)
        ref = fused_reference(**case)
        s, n = case["tokens_by_state"].shape
        alt = dict(case)
        alt["node_samples"] = case["node_samples"].to(torch.int32)
        alt["cu_num_logits"] = case["cu_num_logits"].long()
        alt["idx_mapping"] = case["idx_mapping"].long()
        # by-state tables as column slices of wider tables (row stride != N)
        wide_t = torch.full((s, n + 5), 3, dtype=torch.int32)
        wide_t[:, :n] = case["tokens_by_state"]
        wide_p = torch.zeros(s, n + 5, dtype=torch.int64)
        wide_p[:, :n] = case["parents_by_state"]
        wide_v = torch.ones(s, n + 5, dtype=torch.bool)
        wide_v[:, :n] = case["valid_by_state"]
        alt["tokens_by_state"] = wide_t[:, :n]
        alt["parents_by_state"] = wide_p[:, :n]
        alt["valid_by_state"] = wide_v[:, :n]
        assert_same_walk(ref, walk_tree_fused(**_to(alt, triton_device)))


def test_fused_wide_tree(triton_device, monkeypatch):
    """N = 513 (BLOCK 1024), the largest tree budget the server allows."""
    _no_fallback(monkeypatch)
    for seed in range(2):
        case = _random_case(400 + seed, n=513)
        assert_same_walk(fused_reference(**case), walk_tree_fused(**_to(case, triton_device)))


def test_fused_special_cases(triton_device, monkeypatch):
    _no_fallback(monkeypatch)
    dev = triton_device
    # duplicate sibling tokens: lowest index wins; request 1 has only the root row
    tokens = torch.tensor([[0, 7, 7, 8], [0, 1, 2, 3]])
    parents = torch.tensor([[-1, 0, 0, 2], [-1, 0, 1, 2]], dtype=torch.int32)
    valid = torch.ones(2, 4, dtype=torch.bool)
    samples = torch.tensor([7, 8, 8, 0, 1, 2])
    cu = torch.tensor([0, 4, 5], dtype=torch.int32)
    idx = torch.tensor([0, 1], dtype=torch.int32)
    args = [t.to(dev) for t in (samples, cu, idx, tokens, parents, valid)]
    got = walk_tree_fused(*args, 2)
    assert_same_walk(fused_reference(samples, cu, idx, tokens, parents, valid, 2), got)
    assert got.accepted_nodes.tolist() == [[0, 1, -1], [0, -1, -1]]
    assert got.output_tokens.tolist() == [[7, 8, -1], [1, -1, -1]]
    # a prefix of 3 rows: node 3 (child of 2) is not scheduled
    cu = torch.tensor([0, 3, 4], dtype=torch.int32)
    samples = torch.tensor([1, 2, 3, 1])
    idx = torch.tensor([1, 0], dtype=torch.int32)
    args = [t.to(dev) for t in (samples, cu, idx, tokens, parents, valid)]
    got = walk_tree_fused(*args, 3, pad_id=9)
    assert_same_walk(fused_reference(samples, cu, idx, tokens, parents, valid, 3, pad_id=9), got)
    assert got.accepted_nodes.tolist() == [[0, 1, 2, -1], [0, -1, -1, -1]]
    assert got.output_tokens.tolist() == [[1, 2, 3, 9], [1, 9, 9, 9]]
    assert got.num_output.tolist() == [3, 1]
    # max_depth = 0: only the bonus token
    got = walk_tree_fused(*args, 0)
    assert got.accepted_nodes.tolist() == [[0], [0]]
    assert got.output_tokens.tolist() == [[1], [1]]
    assert got.num_accepted.tolist() == [0, 0]


def test_fused_bad_inputs():
    t = torch.zeros(2, 4, dtype=torch.int64)
    v = torch.ones(2, 4, dtype=torch.bool)
    s = torch.zeros(5, dtype=torch.int64)
    cu = torch.tensor([0, 4, 5], dtype=torch.int32)
    idx = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(TypeError, match="valid_by_state"):
        walk_tree_fused(s, cu, idx, t, t, t, 3)
    with pytest.raises(ValueError, match="parents_by_state"):
        walk_tree_fused(s, cu, idx, t, t[:, :3], v, 3)
    with pytest.raises(ValueError, match="cu_num_logits"):
        walk_tree_fused(s, cu[:2], idx, t, t, v, 3)
    with pytest.raises(ValueError, match="max_depth"):
        walk_tree_fused(s, cu, idx, t, t, v, -1)
    with pytest.raises(ValueError, match="out.accepted_nodes"):
        walk_tree_fused(s, cu, idx, t, t, v, 3, out=empty_walk(2, 4))
    with pytest.raises(ValueError, match="out.num_accepted"):
        bad = empty_walk(2, 3)
        walk_tree_fused(s, cu, idx, t, t, v, 3, out=bad._replace(num_accepted=bad.num_accepted[:1]))


@pytest.mark.parametrize("num_requests", [1, 2, 3, 4, 5, 7, 16, 17, 63])
@pytest.mark.parametrize("max_depth", [15, 4, 0])
def test_step_walk_outputs_start_on_16_byte_boundaries_at_every_batch_size(num_requests, max_depth):
    # Triton specialises pointers on 16-byte alignment: an output off it at some batch
    # sizes compiled the walk and vLLM's post-sampling kernels again while serving.
    out = step_walk_outputs(num_requests, max_depth)
    for t in out:
        assert t.data_ptr() % 16 == 0
        assert t.shape[0] == num_requests and t.is_contiguous()
    assert out.accepted_nodes.shape == out.output_tokens.shape == (num_requests, max_depth + 1)
    assert out.num_accepted.dtype == out.num_output.dtype == torch.int32
    # Four distinct outputs: no two share memory.
    ptrs = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in out)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ptrs, ptrs[1:]))
