"""store_trees_by_state_ (one Triton launch) vs the four indexed copies it replaces."""

from __future__ import annotations

import pytest
import torch

from vllm_ddtree.tree_builder import (
    build_trees,
    empty_tree,
    store_trees_by_state_,
    store_trees_by_state_torch_,
)


def tables(num_states: int, n: int, device, fill: int = 7):
    return (
        torch.full((num_states, n), fill, dtype=torch.int64, device=device),
        torch.full((num_states, n), fill, dtype=torch.int32, device=device),
        torch.full((num_states, n), fill, dtype=torch.int32, device=device),
        torch.ones((num_states, n), dtype=torch.bool, device=device),
    )


@pytest.mark.parametrize("num_reqs, budget, vocab", [(1, 32, 100), (5, 16, 3), (7, 64, 50)])
def test_matches_the_indexed_copies(triton_device, num_reqs, budget, vocab):
    gen = torch.Generator().manual_seed(num_reqs * 100 + budget)
    logits = torch.randn(num_reqs, 4, vocab, generator=gen)
    # The buffer holds more rows than this step's batch, as the speculator's does.
    out = empty_tree(num_reqs + 3, budget, "cpu")
    trees = build_trees(logits, budget, backend="torch",
                        out=type(out)(*(t[:num_reqs] for t in out)))
    trees = type(out)(*(t.to(triton_device) for t in out))
    states = 12
    idx = torch.randperm(states, generator=gen)[:num_reqs].to(torch.int32).to(triton_device)
    got = tables(states, budget + 1, triton_device)
    want = tables(states, budget + 1, triton_device)
    store_trees_by_state_(trees, idx, *got)
    store_trees_by_state_torch_(trees, idx, *want)
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w.cpu())
    # Rows of states outside the batch are untouched.
    untouched = sorted(set(range(states)) - set(idx.cpu().tolist()))
    assert torch.equal(got[0][untouched].cpu(), torch.full((len(untouched), budget + 1), 7))


def test_empty_batch_and_bad_tables_are_refused_or_noops(triton_device):
    trees = empty_tree(2, 8, triton_device)
    got = tables(4, 9, triton_device)
    store_trees_by_state_(trees, torch.zeros(0, dtype=torch.int32, device=triton_device), *got)
    assert torch.equal(got[0].cpu(), torch.full((4, 9), 7))
    bad = (got[0], got[1].to(torch.int64), got[2], got[3])
    with pytest.raises(ValueError, match="parents_by_state"):
        store_trees_by_state_(trees, torch.zeros(1, dtype=torch.int32, device=triton_device), *bad)
    with pytest.raises(ValueError, match="idx_mapping has 3"):
        store_trees_by_state_(trees, torch.arange(3, dtype=torch.int32, device=triton_device), *got)
