"""DDTreeSpeculator._compact_accepted_path: the one-launch path (KV + hidden states +
positions restore) leaves exactly what the multi-launch path leaves."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("vllm")

from vllm_ddtree.kv_compaction import build_kv_ptr_table  # noqa: E402
from vllm_ddtree.speculator import DDTreeSpeculator  # noqa: E402

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


def _speculator(b, fused: bool) -> DDTreeSpeculator:
    spec = object.__new__(DDTreeSpeculator)  # no vLLM engine: only what the method reads
    spec.fused_kernels = fused
    spec.tree_depth = DEPTH
    spec._target_kv_caches = b["caches"]
    spec._target_layer_name = "layer.0"
    spec._kv_ptr_table = build_kv_ptr_table(b["caches"]) if fused else None
    spec._verified_rows = b["rows"]
    spec._linear_positions = b["linear"][b["rows"]]
    spec.accepted_nodes = b["acc"]
    spec.num_accepted = b["num_acc"]
    return spec


def test_one_launch_path_equals_the_multi_launch_path(triton_device):
    fused, plain = _batch(triton_device), _batch(triton_device)
    for b, on in ((fused, True), (plain, False)):
        batch = types.SimpleNamespace(positions=b["positions"], query_start_loc=b["qsl"])
        _speculator(b, on)._compact_accepted_path(batch, {"layer.0": b["slots"]}, b["hidden"])
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
        spec = object.__new__(DDTreeSpeculator)
        spec.fused_kernels = fused
        out = empty_tree(6, BUDGET, "cpu")
        trees = build_trees(torch.randn(6, DEPTH, 50, generator=torch.Generator().manual_seed(1)),
                            BUDGET, backend="torch", out=out)
        spec.trees = type(trees)(*(t.to(triton_device) for t in trees))
        n = BUDGET + 1
        spec.tokens_by_state = torch.zeros(10, n, dtype=torch.int64, device=triton_device)
        spec.parents_by_state = torch.zeros(10, n, dtype=torch.int32, device=triton_device)
        spec.depths_by_state = torch.zeros(10, n, dtype=torch.int32, device=triton_device)
        spec.valid_by_state = torch.zeros(10, n, dtype=torch.bool, device=triton_device)
        idx = torch.tensor([7, 2, 9], dtype=torch.int32, device=triton_device)
        spec._store_trees(idx)
        results.append(spec)
        # batch row 1 -> state 2
        assert torch.equal(spec.parents_by_state[2].cpu(), trees.node_parents[1])
        assert torch.equal(spec.tokens_by_state[9].cpu(), trees.node_tokens[2])
        assert not spec.valid_by_state[0].any()
    for name in ("tokens_by_state", "parents_by_state", "depths_by_state", "valid_by_state"):
        assert torch.equal(getattr(results[0], name).cpu(), getattr(results[1], name).cpu())


def test_verifying_again_before_the_last_path_was_compacted_fails_loudly():
    """Compaction runs in propose(); a runner that verified a new tree without calling
    propose() after the last walk would read KV from the wrong slots: refused."""
    spec = object.__new__(DDTreeSpeculator)
    spec.profiler = None
    spec._verified_rows = torch.arange(3)
    spec.record_walk(torch.zeros(1, DEPTH + 1, dtype=torch.int64),
                     torch.zeros(1, dtype=torch.int32))
    batch = types.SimpleNamespace(num_reqs=1, num_draft_tokens=2, num_tokens=3)
    with pytest.raises(RuntimeError, match="propose"):
        spec.prepare_tree_verification(batch, 2)
    # Without a pending path (the walk verified no tree), the hook runs on.
    spec._pending_compaction = False
    spec.prepare_tree_verification(types.SimpleNamespace(num_reqs=1, num_draft_tokens=0,
                                                         num_tokens=1), 0)
    assert spec._next_budget == 0
