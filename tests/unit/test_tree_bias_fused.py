"""write_tree_attn_bias_fused: one Triton launch == the torch write_tree_attn_bias.

Runs the kernel on CUDA when present, else on the CPU in Triton's interpreter (see
conftest.triton_device). Every comparison is bitwise (0.0 vs -0.0 and -inf count).
"""

from __future__ import annotations

import pytest
import torch

from vllm_ddtree.tree_attention import (
    allocate_tree_attn_bias,
    check_tree_parents,
    write_tree_attn_bias,
    write_tree_attn_bias_fused,
)
from tests.references import build_tree_reference

SENTINEL = 7.0  # rows past the batch must keep it


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.int32)


def _assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    assert got.shape == want.shape, what
    if not torch.equal(_bits(got), _bits(want)):
        diff = (_bits(got) != _bits(want)).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: bias differs at {diff}")


def random_parents(gen: torch.Generator, num: int, q: int) -> torch.Tensor:
    parents = torch.full((num, q), -1, dtype=torch.int32)
    for s in range(num):
        for i in range(1, q):
            parents[s, i] = int(torch.randint(0, i, (1,), generator=gen))
    return parents


def chain(q: int) -> torch.Tensor:
    return torch.arange(-1, q - 1, dtype=torch.int32)


def star(q: int) -> torch.Tensor:
    p = torch.zeros(q, dtype=torch.int32)
    p[0] = -1
    return p


def depth_of(parents: torch.Tensor) -> int:
    """Max depth over all rows of [S, Q] parents (host loop; tests only)."""
    best = 0
    for row in parents.tolist():
        depth = [0] * len(row)
        for i in range(1, len(row)):
            depth[i] = depth[row[i]] + 1
        best = max(best, max(depth))
    return best


def check_case(device, parents_by_state, idx_mapping, cu, max_depth=None, max_num_seqs=None,
               what=""):
    """Fused kernel vs write_tree_attn_bias(bias, parents_by_state[idx], has_tree)."""
    parents_by_state = parents_by_state.to(device)
    idx_mapping = idx_mapping.to(device)
    cu = cu.to(device)
    num_reqs = idx_mapping.shape[0]
    q = parents_by_state.shape[1]
    rows = max_num_seqs or num_reqs + 2
    got = allocate_tree_attn_bias(rows, q, device).fill_(SENTINEL)
    want = got.clone()
    out = write_tree_attn_bias_fused(got, parents_by_state, idx_mapping, cu, max_depth,
                                     backend="triton")
    assert out.data_ptr() == got.data_ptr() and out.shape == (num_reqs, q, q)
    has_tree = (cu[1 : num_reqs + 1] - cu[:num_reqs]) > 1
    write_tree_attn_bias(want, parents_by_state[idx_mapping.long()], has_tree)
    _assert_bitwise(got, want, what)
    assert torch.equal(got[num_reqs:].cpu(), torch.full((rows - num_reqs, q, q), SENTINEL)), what
    # The torch fallback of the fused entry point agrees as well.
    fallback = allocate_tree_attn_bias(rows, q, device).fill_(SENTINEL)
    write_tree_attn_bias_fused(fallback, parents_by_state, idx_mapping, cu, max_depth,
                               backend="torch")
    _assert_bitwise(fallback, want, what + " (torch backend)")


def random_cu(gen: torch.Generator, num_reqs: int, q: int, p_tree: float = 0.7) -> torch.Tensor:
    """cu_num_logits with a mix of no-tree (0 or 1 logit), full and prefix trees."""
    counts = []
    for _ in range(num_reqs):
        u = float(torch.rand((), generator=gen))
        if u > p_tree or q == 1:
            counts.append(int(torch.randint(0, 2, (), generator=gen)))
        else:
            counts.append(int(torch.randint(2, q + 1, (), generator=gen)))
    cu = torch.zeros(num_reqs + 1 + 3, dtype=torch.int32)  # padded like vLLM's buffers
    cu[1 : num_reqs + 1] = torch.tensor(counts, dtype=torch.int32).cumsum(0)
    cu[num_reqs + 1 :] = cu[num_reqs]
    return cu


# ---------------------------------------------------------------------------


@pytest.mark.parametrize("q, depth", [(2, 1), (5, 3), (17, 4), (33, 6), (65, 8)])
def test_fused_matches_on_builder_trees(triton_device, q, depth):
    gen = torch.Generator().manual_seed(q)
    num_states = 12
    logits = torch.randn(num_states, depth, 24, generator=gen) * 3
    tree = build_tree_reference(logits, q - 1)
    parents = tree.node_parents
    check_tree_parents(parents)
    assert depth_of(parents) <= depth
    for num_reqs in (1, 4, 9):
        idx = torch.randperm(num_states, generator=gen)[:num_reqs].to(torch.int32)
        cu = random_cu(gen, num_reqs, q)
        check_case(triton_device, parents, idx, cu, max_depth=depth, what=f"R={num_reqs}")


@pytest.mark.parametrize("q", [1, 2, 3, 8, 16, 17, 64, 65])
def test_fused_chains_and_stars(triton_device, q):
    # Chains need max_depth = Q - 1 (the default); stars depth 1.
    parents = torch.stack([chain(q), star(q), chain(q), star(q)])
    idx = torch.tensor([2, 1, 0, 3], dtype=torch.int32)
    full = torch.tensor([0, q, 2 * q, 3 * q, 4 * q], dtype=torch.int32)
    check_case(triton_device, parents, idx, full, what="default depth")
    check_case(triton_device, parents, idx, full, max_depth=max(q - 1, 0), what="tight depth")
    mixed = torch.tensor([0, q, q + 1, 2 * q + 1, 2 * q + 1], dtype=torch.int32)
    check_case(triton_device, parents, idx, mixed, what="mixed has_tree")
    if q > 1:
        stars = parents[[1, 3]]
        check_case(triton_device, stars, torch.tensor([1, 0], dtype=torch.int32),
                   torch.tensor([0, q, 2 * q], dtype=torch.int32), max_depth=1, what="stars")


def test_fused_random_sizes(triton_device):
    gen = torch.Generator().manual_seed(1234)
    for trial in range(40):
        q = int(torch.randint(1, 66, (), generator=gen))
        num_reqs = int(torch.randint(1, 10, (), generator=gen))
        num_states = num_reqs + int(torch.randint(0, 4, (), generator=gen))
        parents = random_parents(gen, num_states, q)
        if num_states > 1:
            parents[0] = chain(q)
            parents[1] = star(q)
        idx = torch.randperm(num_states, generator=gen)[:num_reqs].to(torch.int32)
        cu = random_cu(gen, num_reqs, q)
        depth = depth_of(parents)
        max_depth = depth + int(torch.randint(0, 3, (), generator=gen))
        check_case(triton_device, parents, idx, cu, max_depth=max_depth,
                   max_num_seqs=num_reqs + int(torch.randint(0, 3, (), generator=gen)),
                   what=f"trial {trial}: q={q} R={num_reqs}")


def test_fused_prefix_verification_and_no_tree_rows(triton_device):
    q = 17
    gen = torch.Generator().manual_seed(5)
    parents = random_parents(gen, 5, q)
    idx = torch.tensor([4, 0, 2, 1, 3], dtype=torch.int32)
    # logits per request: 3 (prefix), 1 (no tree), 17 (full), 0 (nothing), 2 (prefix)
    cu = torch.tensor([0, 3, 4, 21, 21, 23], dtype=torch.int32)
    check_case(triton_device, parents, idx, cu, max_depth=q - 1)
    bias = allocate_tree_attn_bias(5, q, triton_device).fill_(SENTINEL)
    write_tree_attn_bias_fused(bias, parents.to(triton_device), idx.to(triton_device),
                               cu.to(triton_device), q - 1, backend="triton")
    assert torch.equal(bias[1].cpu(), torch.zeros(q, q))
    assert torch.equal(bias[3].cpu(), torch.zeros(q, q))
    assert not torch.equal(bias[0].cpu(), torch.zeros(q, q))


def test_fused_int64_strided_parents_and_int64_indices(triton_device):
    q = 9
    gen = torch.Generator().manual_seed(9)
    wide = random_parents(gen, 6, q + 4).to(torch.int64)
    parents = wide[:, :q]  # row stride q + 4; still valid trees
    assert not parents.is_contiguous()
    idx = torch.tensor([5, 3, 1], dtype=torch.int64)
    cu = torch.tensor([0, 9, 10, 19], dtype=torch.int64)
    check_case(triton_device, parents, idx, cu)


def test_fused_zero_initialised_state(triton_device):
    # parents_by_state starts as zeros (root's parent 0, not -1) for states that
    # never built a tree: the walk must still end and match the torch path.
    q = 8
    parents = torch.zeros(3, q, dtype=torch.int32)
    parents[1] = chain(q)
    idx = torch.tensor([0, 1, 2], dtype=torch.int32)
    check_case(triton_device, parents, idx, torch.tensor([0, 1, 9, 17], dtype=torch.int32))


def test_fused_untouched_past_batch_and_empty_batch(triton_device):
    q = 6
    bias = allocate_tree_attn_bias(4, q, triton_device).fill_(SENTINEL)
    parents = torch.stack([chain(q), star(q)]).to(triton_device)
    empty = torch.zeros(0, dtype=torch.int32, device=triton_device)
    cu = torch.zeros(1, dtype=torch.int32, device=triton_device)
    out = write_tree_attn_bias_fused(bias, parents, empty, cu, backend="triton")
    assert out.shape == (0, q, q)
    assert torch.equal(bias.cpu(), torch.full((4, q, q), SENTINEL))


def test_fused_rejects_bad_input():
    bias = allocate_tree_attn_bias(2, 8, "cpu")
    parents = torch.zeros(3, 8, dtype=torch.int32)
    idx = torch.zeros(2, dtype=torch.int32)
    cu = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="parents_by_state must be"):
        write_tree_attn_bias_fused(bias, torch.zeros(3, 5, dtype=torch.int32), idx, cu)
    with pytest.raises(ValueError, match="do not fit"):
        write_tree_attn_bias_fused(bias, parents, torch.zeros(3, dtype=torch.int32),
                                   torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_num_logits has 2 entries"):
        write_tree_attn_bias_fused(bias, parents, idx, cu[:2])
    with pytest.raises(ValueError, match="float32"):
        write_tree_attn_bias_fused(bias.half(), parents, idx, cu)
    with pytest.raises(ValueError, match="integer"):
        write_tree_attn_bias_fused(bias, parents.float(), idx, cu)
    with pytest.raises(ValueError, match="max_depth"):
        write_tree_attn_bias_fused(bias, parents, idx, cu, -1)
    with pytest.raises(ValueError, match="backend"):
        write_tree_attn_bias_fused(bias, parents, idx, cu, backend="cuda")
