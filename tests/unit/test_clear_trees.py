"""Resetting trees to root-only on steps that draft none (vllm_ddtree.tree_verifier.clear_trees_).

A budget-0 step calls it once. CPU: it clears every node but the root of the given
states and nothing else. GPU: it never makes the host wait for the device (torch's
sync debug mode raises on a synchronising call): a Python ``False`` in the indexed
assignment did, once per step, which took the overlap of host and GPU work away from
every budget-0 step (bench/results/2026-12-01-budget-0-host-sync/).
"""

from __future__ import annotations

import contextlib

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
