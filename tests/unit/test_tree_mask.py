"""The tree ancestor mask: vectorised vs loop reference."""

from __future__ import annotations

import pytest
import torch

from vllm_ddtree.tree_builder import build_trees
from vllm_ddtree.tree_mask import tree_ancestor_mask
from tests.references import tree_ancestor_mask_reference


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
    # every row holds the node's depth + 1 entries (itself and each ancestor)
    assert torch.equal(tree_ancestor_mask(parents).sum(-1), _depths(parents).long() + 1)


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
    mask = tree_ancestor_mask(tree.node_parents)
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


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"\[R, N\]"):
        tree_ancestor_mask(torch.tensor([-1, 0, 1]))
    with pytest.raises(TypeError, match="integer"):
        tree_ancestor_mask(torch.tensor([[-1.0, 0.0]]))
    with pytest.raises(ValueError, match="at least the root"):
        tree_ancestor_mask(torch.zeros(2, 0, dtype=torch.int64))
    with pytest.raises(ValueError, match="broken parent chain"):
        tree_ancestor_mask_reference(torch.tensor([[-1, 5, 1]]))
