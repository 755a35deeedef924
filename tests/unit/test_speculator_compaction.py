"""TreeVerifier.compact: the one-launch path (KV + hidden states + positions restore)
leaves exactly what the multi-launch path leaves; trees land by request state; the
step's order is checked."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("vllm")

from vllm_ddtree.tree_verifier import TreeStep, TreeVerifier  # noqa: E402

NB, BS, H, HS, LAYERS = 8, 8, 2, 4, 3
DEPTH, BUDGET = 4, 8


def _batch(device):
    """Two tree requests (B+1 rows each, positions rewritten to start + depth) and a
    prefill chunk of 5 rows between them (linear positions, no logit rows but its last)."""
    g = torch.Generator().manual_seed(3)
    lens = [BUDGET + 1, 5, BUDGET + 1]
    qsl = torch.tensor([0, lens[0], lens[0] + lens[1], sum(lens)], dtype=torch.int32)
    starts = [40, 7, 90]
    linear = torch.cat([s + torch.arange(n) for s, n in zip(starts, lens)])
    positions = linear.clone()
    rows = []
    for r in (0, 2):
        a = int(qsl[r])
        rows += list(range(a, a + lens[r]))
        depth = torch.randint(1, DEPTH + 1, (lens[r] - 1,), generator=g)
        positions[a + 1: a + lens[r]] = starts[r] + depth
    rows = torch.tensor(rows + [int(qsl[2]) - 1])  # the prefill's last row has a logit
    acc = torch.full((3, DEPTH + 1), -1, dtype=torch.int64)
    acc[0, :4] = torch.tensor([0, 2, 5, 7])
    acc[1, 0] = 0
    acc[2, :3] = torch.tensor([0, 1, 8])
    num_acc = torch.tensor([3, 0, 2], dtype=torch.int32)
    slots = torch.randperm(NB * BS, generator=g)[: sum(lens)]
    caches = [torch.randn(NB, BS, H, 2 * HS, generator=g).permute(0, 2, 1, 3)
              for _ in range(LAYERS)]
    hidden = torch.randn(sum(lens), 16, generator=g)
    to = lambda t: t.to(device)  # noqa: E731
    return dict(positions=to(positions), linear=to(linear), rows=to(rows), acc=to(acc),
                num_acc=to(num_acc), qsl=to(qsl), slots=to(slots),
                caches=[to(c) for c in caches], hidden=to(hidden))


def _verifier(fused: bool, device, max_num_reqs: int = 10) -> TreeVerifier:
    return TreeVerifier(max_num_reqs, BUDGET, DEPTH, 64, device, fused)


def _verified(b, fused: bool) -> TreeVerifier:
    """A verifier whose step verified the batch's trees and walked them."""
    v = _verifier(fused, b["hidden"].device)
    v.set_kv_source(lambda: [(f"layer.{i}", c) for i, c in enumerate(b["caches"])])
    v.step = TreeStep(next_budget=BUDGET, verified_rows=b["rows"],
                      linear_positions=b["linear"][b["rows"]])
    v.record_walk(b["acc"], b["num_acc"])
    return v


def test_one_launch_path_equals_the_multi_launch_path(triton_device):
    fused, plain = _batch(triton_device), _batch(triton_device)
    for b, on in ((fused, True), (plain, False)):
        batch = types.SimpleNamespace(positions=b["positions"], query_start_loc=b["qsl"])
        v = _verified(b, on)
        assert v.step.pending_compaction
        v.compact(batch, {"layer.0": b["slots"]}, b["hidden"])
        assert not v.step.pending_compaction and v.step.next_budget == BUDGET
        assert (v._kv_ptr_table is not None) == on
    assert torch.equal(fused["positions"].cpu(), fused["linear"].cpu())
    assert torch.equal(plain["positions"].cpu(), plain["linear"].cpu())
    assert torch.equal(fused["hidden"].cpu(), plain["hidden"].cpu())
    for a, b in zip(fused["caches"], plain["caches"]):
        assert torch.equal(a.cpu(), b.cpu())
    # Something moved: request 0's depth-1 row now holds node 2's hidden state.
    assert torch.equal(fused["hidden"][1].cpu(), _batch("cpu")["hidden"][2])


def test_new_trees_land_by_request_state_on_both_paths(triton_device):
    from vllm_ddtree.tree_builder import build_trees, empty_tree

    results = []
    for fused in (True, False):
        v = _verifier(fused, triton_device)
        out = empty_tree(6, BUDGET, "cpu")
        trees = build_trees(torch.randn(6, DEPTH, 50, generator=torch.Generator().manual_seed(1)),
                            BUDGET, backend="torch", out=out)
        idx = torch.tensor([7, 2, 9], dtype=torch.int32, device=triton_device)
        v.store_trees(type(trees)(*(t.to(triton_device) for t in trees)), idx)
        results.append(v)
        # batch row 1 -> state 2
        assert torch.equal(v.parents_by_state[2].cpu(), trees.node_parents[1])
        assert torch.equal(v.tokens_by_state[9].cpu(), trees.node_tokens[2])
        assert not v.valid_by_state[0].any()
    for name in ("tokens_by_state", "parents_by_state", "depths_by_state", "valid_by_state"):
        assert torch.equal(getattr(results[0], name).cpu(), getattr(results[1], name).cpu())


def test_verifying_again_before_the_last_path_was_compacted_fails_loudly():
    """Compaction runs in propose(); a runner that verified a new tree without calling
    propose() after the last walk would read KV from the wrong slots: refused."""
    v = _verifier(False, "cpu")
    v.step = TreeStep(next_budget=2, verified_rows=torch.arange(3))
    v.record_walk(torch.zeros(1, DEPTH + 1, dtype=torch.int64),
                  torch.zeros(1, dtype=torch.int32))
    batch = types.SimpleNamespace(num_reqs=1, num_draft_tokens=2, num_tokens=3)
    with pytest.raises(RuntimeError, match="propose"):
        v.prepare(batch, 2)
    # Without a pending path (the walk verified no tree), the hook runs on.
    v.end_step()
    v.prepare(types.SimpleNamespace(num_reqs=1, num_draft_tokens=0, num_tokens=1), 0)
    assert v.step.next_budget == 0 and not v.step.pending_compaction
