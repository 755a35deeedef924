"""Tree attention mask / bias / positions: vectorised vs loop reference."""

from __future__ import annotations

import pytest
import torch

from vllm_ddtree.tree_builder import build_trees
from vllm_ddtree.tree_mask import tree_ancestor_mask, tree_attention_bias, tree_positions
from tests.references import tree_ancestor_mask_reference, tree_positions_reference


def _random_parents(num_req: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """Random trees in the agreed format: parent[i] uniform in [0, i)."""
    parents = torch.zeros(num_req, n, dtype=torch.int32)
    parents[:, 0] = -1
    for i in range(1, n):
        parents[:, i] = torch.randint(0, i, (num_req,), generator=gen)
    return parents


def _depths(parents: torch.Tensor) -> torch.Tensor:
    depths = torch.zeros_like(parents)
    for i in range(1, parents.shape[1]):
        depths[:, i] = depths.gather(1, parents[:, i : i + 1].long())[:, 0] + 1
    return depths


@pytest.mark.parametrize("num_req,n", [(1, 1), (3, 2), (4, 17), (2, 65)])
def test_mask_matches_reference_random_trees(num_req, n):
    gen = torch.Generator().manual_seed(n)
    parents = _random_parents(num_req, n, gen)
    ref = tree_ancestor_mask_reference(parents)
    assert torch.equal(tree_ancestor_mask(parents), ref)
    # the true max depth is enough steps
    max_depth = int(_depths(parents).max())
    assert torch.equal(tree_ancestor_mask(parents, max_depth), ref)
    if max_depth > 1:  # too few steps must miss ancestors (the bound matters)
        assert not torch.equal(tree_ancestor_mask(parents, max_depth - 1), ref)


def test_mask_chain_and_star():
    n = 6
    chain = torch.tensor([[-1, 0, 1, 2, 3, 4]])
    assert torch.equal(tree_ancestor_mask(chain)[0], torch.ones(n, n, dtype=torch.bool).tril())
    star = torch.tensor([[-1, 0, 0, 0, 0, 0]])
    want = torch.eye(n, dtype=torch.bool)
    want[:, 0] = True
    assert torch.equal(tree_ancestor_mask(star)[0], want)


def test_mask_on_built_trees_with_padding():
    # V = 2, D = 2 holds 6 nodes; B = 9 gives 3 padding nodes (parent 0, depth 1).
    gen = torch.Generator().manual_seed(0)
    tree = build_trees(torch.randn(3, 2, 2, generator=gen), 9, backend="torch")
    mask = tree_ancestor_mask(tree.node_parents, max_depth=2)
    assert torch.equal(mask, tree_ancestor_mask_reference(tree.node_parents))
    pad = ~tree.node_valid
    assert pad.sum() == 9
    # padding nodes: root + themselves only; nobody else sees them
    for r in range(3):
        for i in torch.nonzero(pad[r]).flatten().tolist():
            row = torch.zeros(10, dtype=torch.bool)
            row[[0, i]] = True
            assert torch.equal(mask[r, i], row)
            col = mask[r, :, i].clone()
            col[i] = False
            assert not col.any()
    # mask depth agrees with node depths: row i has depth_i + 1 entries
    assert torch.equal(mask.sum(-1), tree.node_depths.long() + 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_bias(dtype):
    parents = torch.tensor([[-1, 0, 1, 0], [-1, 0, 0, 2]])
    mask = tree_ancestor_mask(parents)
    bias = tree_attention_bias(mask, dtype)
    assert bias.dtype == dtype and bias.shape == (2, 4, 4)
    assert torch.equal(bias == 0, mask)
    assert torch.isneginf(bias[~mask]).all()
    # softmax with the bias ignores the masked scores entirely
    scores = torch.randn(2, 4, 4).to(dtype)
    probs = torch.softmax((scores + bias).float(), -1)
    assert torch.all(probs[~mask] == 0)


def test_positions():
    gen = torch.Generator().manual_seed(1)
    parents = _random_parents(3, 12, gen)
    depths = _depths(parents)
    start = torch.tensor([0, 5, 1000])
    pos = tree_positions(depths, start)
    assert pos.dtype == torch.int64
    assert torch.equal(pos, tree_positions_reference(depths, start))
    assert torch.equal(pos[:, 0], start)


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"\[R, N\]"):
        tree_ancestor_mask(torch.tensor([-1, 0, 1]))
    with pytest.raises(TypeError, match="integer"):
        tree_ancestor_mask(torch.tensor([[-1.0, 0.0]]))
    with pytest.raises(TypeError, match="bool"):
        tree_attention_bias(torch.zeros(2, 2))
    with pytest.raises(TypeError, match="floating"):
        tree_attention_bias(torch.zeros(2, 2, dtype=torch.bool), torch.int32)
    with pytest.raises(ValueError, match="start_positions"):
        tree_positions(torch.zeros(2, 3, dtype=torch.int32), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="broken parent chain"):
        tree_ancestor_mask_reference(torch.tensor([[-1, 5, 1]]))
