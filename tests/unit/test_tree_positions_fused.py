"""rewrite_tree_positions_: one Triton launch == torch fallback == Python loops.

The kernel runs on CUDA when present, else on the CPU in Triton's interpreter (see
conftest.triton_device); every tensor is built on that device.
"""

from __future__ import annotations

import pytest
import torch

from vllm_ddtree.tree_mask import rewrite_tree_positions_
from tests.references import rewrite_tree_positions_reference

SENTINEL = -7  # linear_out entries past n must keep it


def random_batch(gen: torch.Generator, num_states: int, n_nodes: int, num_reqs: int,
                 pos_dtype=torch.int64, idx_dtype=torch.int32, strided=True):
    """A runner-like batch: each request has 1 row (prefill/no tree), a full tree or a
    prefix; its tokens sit at linear positions start + l. Requests' token blocks are
    separated by non-logit rows (prefill chunks), whose positions must stay put."""
    num_reqs = min(num_reqs, num_states)
    states = torch.randperm(num_states, generator=gen)[:num_reqs]
    # Depths of random trees (parent uniform in [0, i)), in a strided table.
    width = n_nodes + (5 if strided else 0)
    table = torch.full((num_states, width), 99, dtype=torch.int32)
    for s in range(num_states):
        d = [0] * n_nodes
        for i in range(1, n_nodes):
            d[i] = d[int(torch.randint(0, i, (1,), generator=gen))] + 1
        table[s, :n_nodes] = torch.tensor(d, dtype=torch.int32)
    depths = table[:, :n_nodes]
    positions, rows, local, idx = [], [], [], []
    for r in range(num_reqs):
        kind = int(torch.randint(0, 3, (1,), generator=gen))
        count = 1 if kind == 0 else n_nodes if kind == 1 else int(torch.randint(1, n_nodes + 1, (1,), generator=gen))
        # A non-logit chunk (prefill) before this request's rows.
        pad = int(torch.randint(0, 4, (1,), generator=gen))
        positions += torch.randint(0, 1000, (pad,), generator=gen).tolist()
        start = int(torch.randint(0, 5000, (1,), generator=gen))
        rows += list(range(len(positions), len(positions) + count))
        positions += [start + l for l in range(count)]
        local += list(range(count))
        idx += [int(states[r])] * count
    positions += torch.randint(0, 1000, (3,), generator=gen).tolist()
    return (torch.tensor(positions, dtype=pos_dtype), torch.tensor(rows, dtype=idx_dtype),
            torch.tensor(local, dtype=torch.int32), torch.tensor(idx, dtype=idx_dtype), depths)


def check(device, positions, rows, local, idx, depths, backends=("triton", "torch")):
    want_pos, want_lin = rewrite_tree_positions_reference(positions, rows, local, idx, depths)
    n = rows.numel()
    for backend in backends:
        pos = positions.to(device).clone()
        out = torch.full((n + 4,), SENTINEL, dtype=positions.dtype, device=device)
        lin = rewrite_tree_positions_(pos, rows.to(device), local.to(device), idx.to(device),
                                      depths.to(device), out, backend=backend)
        assert lin.shape == (n,) and lin.data_ptr() == out.data_ptr(), backend
        assert torch.equal(pos.cpu(), want_pos), backend
        assert torch.equal(lin.cpu(), want_lin), backend
        assert (out[n:].cpu() == SENTINEL).all(), backend
        # The restore (plain torch index_put) gives back the linear positions.
        pos[rows.to(device).long()] = lin
        assert torch.equal(pos.cpu(), positions), backend


def test_reference_small():
    # Request A: tree of 4 nodes at 10..13, depths 0,1,1,2; request B: 1 row at 50.
    positions = torch.tensor([3, 10, 11, 12, 13, 50, 8])
    rows = torch.tensor([1, 2, 3, 4, 5])
    local = torch.tensor([0, 1, 2, 3, 0], dtype=torch.int32)
    idx = torch.tensor([1, 1, 1, 1, 0], dtype=torch.int32)
    depths = torch.tensor([[0, 5, 5, 5], [0, 1, 1, 2]], dtype=torch.int32)
    pos, lin = rewrite_tree_positions_reference(positions, rows, local, idx, depths)
    assert pos.tolist() == [3, 10, 11, 11, 12, 50, 8]
    assert lin.tolist() == [10, 11, 12, 13, 50]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("pos_dtype,idx_dtype", [(torch.int64, torch.int32), (torch.int64, torch.int64),
                                                 (torch.int32, torch.int32)])
def test_random_batches(triton_device, seed, pos_dtype, idx_dtype):
    gen = torch.Generator().manual_seed(seed)
    n_nodes = [2, 5, 17, 65, 9, 33][seed]
    batch = random_batch(gen, num_states=12, n_nodes=n_nodes, num_reqs=3 + 3 * seed,
                         pos_dtype=pos_dtype, idx_dtype=idx_dtype, strided=seed % 2 == 0)
    check(triton_device, *batch)


def test_many_blocks(triton_device):
    # More logit rows than one program's block: several programs.
    gen = torch.Generator().manual_seed(123)
    batch = random_batch(gen, num_states=64, n_nodes=33, num_reqs=64)
    assert batch[1].numel() > 512
    check(triton_device, *batch)


def test_transposed_depths(triton_device):
    gen = torch.Generator().manual_seed(5)
    positions, rows, local, idx, depths = random_batch(gen, num_states=6, n_nodes=9, num_reqs=6)
    depths_t = depths.t().contiguous().t()  # column stride != 1
    assert depths_t.stride(1) != 1
    check(triton_device, positions, rows, local, idx, depths_t)


def test_empty(triton_device):
    positions = torch.arange(5, device=triton_device)
    empty = torch.zeros(0, dtype=torch.int32, device=triton_device)
    depths = torch.zeros(2, 3, dtype=torch.int32, device=triton_device)
    out = torch.full((2,), SENTINEL, dtype=torch.int64, device=triton_device)
    for backend in ("triton", "torch"):
        lin = rewrite_tree_positions_(positions, empty, empty, empty, depths, out, backend=backend)
        assert lin.numel() == 0
        assert positions.cpu().tolist() == list(range(5)) and (out.cpu() == SENTINEL).all()


def test_auto_backend_on_plain_cpu(monkeypatch):
    # Without the interpreter, CPU tensors take the torch fallback.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gen = torch.Generator().manual_seed(9)
    positions, rows, local, idx, depths = random_batch(gen, num_states=5, n_nodes=7, num_reqs=5)
    want_pos, want_lin = rewrite_tree_positions_reference(positions, rows, local, idx, depths)
    out = torch.empty(rows.numel(), dtype=torch.int64)
    lin = rewrite_tree_positions_(positions, rows, local, idx, depths, out)
    assert torch.equal(positions, want_pos) and torch.equal(lin, want_lin)


def test_bad_arguments():
    positions = torch.arange(4)
    rows = torch.tensor([0, 1])
    local = torch.tensor([0, 1], dtype=torch.int32)
    depths = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError):
        rewrite_tree_positions_(positions, rows, local, rows[:1], depths, torch.empty(2, dtype=torch.int64))
    with pytest.raises(ValueError):  # linear_out too short
        rewrite_tree_positions_(positions, rows, local, rows, depths, torch.empty(1, dtype=torch.int64))
    with pytest.raises(ValueError):  # linear_out of another dtype
        rewrite_tree_positions_(positions, rows, local, rows, depths, torch.empty(2, dtype=torch.int32))
    with pytest.raises(ValueError):
        rewrite_tree_positions_(positions.float(), rows, local, rows, depths, torch.empty(2))


@pytest.mark.parametrize("fused", [True, False])
def test_speculator_prepare_and_restore(triton_device, fused):
    """TreeVerifier.prepare rewrites positions the same way in both modes, and the
    restore line of its compaction gives the linear positions back."""
    pytest.importorskip("vllm")
    import types

    from vllm_ddtree.tree_verifier import TreeVerifier

    dev = triton_device
    gen = torch.Generator().manual_seed(31)
    n_nodes, num_states = 9, 6
    positions, rows, local, idx, depths = random_batch(gen, num_states, n_nodes, num_reqs=5,
                                                       strided=False)
    rows = rows.long()  # as vLLM's logits_indices
    want_pos, want_lin = rewrite_tree_positions_reference(positions, rows, local, idx, depths)
    # Request order as the logit rows list them; cu_num_logits from their counts.
    reqs = list(dict.fromkeys(idx.tolist()))
    counts = [idx.tolist().count(s) for s in reqs]
    cu = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device=dev)

    v = TreeVerifier(num_states, n_nodes - 1, n_nodes - 1, positions.numel() + 8, dev, fused)
    v.depths_by_state = depths.to(dev)
    v.parents_by_state = torch.full((num_states, n_nodes), -1, dtype=torch.int32, device=dev)
    v.parents_by_state[:, 1:] = 0
    v._linear_positions_buf.fill_(SENTINEL)
    batch = types.SimpleNamespace(
        num_reqs=len(reqs),
        idx_mapping=torch.tensor(reqs, dtype=torch.int32, device=dev),
        cu_num_logits=cu,
        num_draft_tokens=int(rows.numel()) - len(reqs),
        logits_indices=rows.to(dev),
        expanded_local_pos=local.to(dev),
        expanded_idx_mapping=idx.to(dev),
        positions=positions.to(dev).clone(),
    )
    assert batch.num_draft_tokens > 0
    v.prepare(batch, 4)
    step = v.step
    assert torch.equal(batch.positions.cpu(), want_pos)
    assert torch.equal(step.linear_positions.cpu(), want_lin)
    assert step.verified_rows is batch.logits_indices and step.next_budget == 4
    if fused:  # a view of the preallocated buffer, the rest untouched
        assert step.linear_positions.data_ptr() == v._linear_positions_buf.data_ptr()
        assert (v._linear_positions_buf[rows.numel():].cpu() == SENTINEL).all()
    # The compaction's restore.
    batch.positions[step.verified_rows] = step.linear_positions
    assert torch.equal(batch.positions.cpu(), positions)


def test_one_token_per_request_leaves_the_bias_alone(monkeypatch):
    """Decodes without drafts read only bias[r, 0, 0] (0 in every tree): no rewrite.
    A multi-token request without a tree (a short prefill chunk) still gets its row
    zeroed, since the kernels apply the bias to its first tokens."""
    pytest.importorskip("vllm")
    import types

    from vllm_ddtree import tree_verifier as verifier_module
    from vllm_ddtree.tree_verifier import TreeVerifier

    writes = []
    monkeypatch.setattr(verifier_module, "write_tree_attn_bias_fused",
                        lambda *a: writes.append(a))
    v = TreeVerifier(4, 4, 4, 16, "cpu", True)
    decodes = types.SimpleNamespace(num_reqs=3, num_tokens=3, num_draft_tokens=0,
                                    idx_mapping=None, cu_num_logits=None)
    v.prepare(decodes, 0)
    assert writes == [] and v.step.verified_rows is None
    prefill = types.SimpleNamespace(num_reqs=2, num_tokens=5, num_draft_tokens=0,
                                    idx_mapping=None, cu_num_logits=None)
    v.prepare(prefill, 4)
    assert len(writes) == 1 and v.step.verified_rows is None
