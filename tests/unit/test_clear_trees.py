"""Resetting trees to root-only on steps that draft none (vllm_ddtree.tree_verifier.clear_trees_).

A budget-0 step calls it once. CPU: it clears every node but the root of the given
states and nothing else. GPU: it never makes the host wait for the device (torch's
sync debug mode raises on a synchronising call): a Python ``False`` in the indexed
assignment did, once per step, which took the overlap of host and GPU work away from
every budget-0 step (bench/results/2026-12-01-budget-0-host-sync/).
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm_ddtree.tree_verifier import clear_trees_  # noqa: E402


def _case(device):
    valid = torch.ones(6, 5, dtype=torch.bool, device=device)
    idx = torch.tensor([4, 1, 2], dtype=torch.int32, device=device)
    return valid, idx, torch.zeros((), dtype=torch.bool, device=device)


@contextlib.contextmanager
def _syncs_are_errors():
    """torch raises on any call that synchronises the host with the GPU inside."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_clears_all_but_the_root_of_the_given_states_only():
    valid, idx, no_tree = _case("cpu")
    clear_trees_(valid, idx, no_tree)
    expect = torch.ones(6, 5, dtype=torch.bool)
    expect[[1, 2, 4], 1:] = False
    assert torch.equal(valid, expect)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_never_synchronizes_the_host_with_the_gpu():
    valid, idx, no_tree = _case("cuda")
    with _syncs_are_errors():
        clear_trees_(valid, idx, no_tree)
    expect = torch.ones(6, 5, dtype=torch.bool, device="cuda")
    expect[[1, 2, 4], 1:] = False
    assert torch.equal(valid, expect)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_sync_check_catches_a_host_scalar():
    """The check above can fail: the assignment with a Python scalar is caught."""
    valid, idx, _ = _case("cuda")
    with _syncs_are_errors(), pytest.raises(RuntimeError, match="synchroniz"):
        valid[idx, 1:] = False


def _full_trees(k: int, n: int) -> SimpleNamespace:
    """``k`` trees of ``n`` nodes, every node valid (what store_trees takes)."""
    return SimpleNamespace(node_tokens=torch.zeros(k, n, dtype=torch.int64),
                           node_parents=torch.zeros(k, n, dtype=torch.int32),
                           node_depths=torch.zeros(k, n, dtype=torch.int32),
                           node_valid=torch.ones(k, n, dtype=torch.bool))


def test_verifier_clears_only_states_that_may_hold_a_tree():
    """TreeVerifier.clear_trees with the host's state indices launches the reset once
    for a run of budget-0 steps: a state cleared since its last stored tree is skipped,
    and one that stored a tree again is cleared again."""
    import numpy as np

    from vllm_ddtree.tree_verifier import TreeVerifier

    v = TreeVerifier(max_num_reqs=6, tree_budget=4, tree_depth=3, max_num_tokens=32,
                     device="cpu", fused_kernels=False)
    idx = torch.tensor([4, 1], dtype=torch.int32)
    idx_np = np.array([4, 1], dtype=np.int32)
    n = v.num_tree_nodes
    # No state holds a tree at start: a budget-0 step launches nothing.
    v.valid_by_state[4, 2] = True  # planted behind the verifier's back
    v.clear_trees(idx, idx_np)
    assert bool(v.valid_by_state[4, 2])
    # Trees stored without host indices (a dummy run): any state may hold one.
    v.store_trees(_full_trees(6, n), torch.arange(6, dtype=torch.int32))
    v.clear_trees(idx, idx_np)
    assert not v.valid_by_state[[1, 4], 1:].any() and v.valid_by_state[0, 1:].all()
    # Nothing stored since: the next budget-0 step launches nothing (a value planted
    # behind the verifier's back stays).
    v.valid_by_state[4, 2] = True
    v.clear_trees(idx, idx_np)
    assert bool(v.valid_by_state[4, 2])
    # A full tree stored for state 4 (as propose() does): the next clear resets it.
    v.store_trees(_full_trees(1, n), idx[:1], idx_np[:1])
    assert v.valid_by_state[4].all()
    v.clear_trees(idx, idx_np)
    assert not v.valid_by_state[4, 1:].any()
    # Without host indices it always clears.
    v.valid_by_state[1, 3] = True
    v.clear_trees(idx)
    assert not v.valid_by_state[1, 1:].any()


def test_verifier_skips_the_lookup_only_when_no_state_may_hold_a_tree():
    """Once every state that stored a tree was reset, a budget-0 step returns before
    looking its states up; while another state still holds one, that state's own
    reset is not skipped."""
    import numpy as np

    from vllm_ddtree.tree_verifier import TreeVerifier

    v = TreeVerifier(max_num_reqs=6, tree_budget=4, tree_depth=3, max_num_tokens=32,
                     device="cpu", fused_kernels=False)
    n = v.num_tree_nodes
    assert not v._any_tree

    def tree_for(states):
        v.store_trees(_full_trees(len(states), n), torch.tensor(states, dtype=torch.int32),
                      np.array(states, dtype=np.int32))

    tree_for([2, 5])
    assert v._any_tree
    v.clear_trees(torch.tensor([2], dtype=torch.int32), np.array([2], dtype=np.int32))
    assert v._any_tree and not v.valid_by_state[2, 1:].any() and v.valid_by_state[5].all()
    v.clear_trees(torch.tensor([5], dtype=torch.int32), np.array([5], dtype=np.int32))
    assert not v._any_tree and not v.valid_by_state[:, 1:].any()
    # Nothing held anywhere: a reset of any states launches nothing.
    v.valid_by_state[3, 1] = True  # planted behind the verifier's back
    v.clear_trees(torch.tensor([3], dtype=torch.int32), np.array([3], dtype=np.int32))
    assert bool(v.valid_by_state[3, 1])
