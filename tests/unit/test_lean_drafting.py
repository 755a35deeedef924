"""Lean drafting: the drafter's logits and tree follow the step's batch-aware budget.

A tree of B best-first nodes uses at most B positions and B candidates per position,
so drafting ``draft_shape(B, D, K)`` gives exactly the first B nodes of the full tree;
budget 0 drafts nothing; a drafter CUDA graph drafts the largest budget among the
batch sizes padded up to it.
"""

from __future__ import annotations

import types

import pytest
import numpy as np
import torch

from vllm_ddtree.budget import (
    OPEN_END,
    budget_schedule,
    disable_from_batch_size,
    draft_shape,
    drafting_budgets,
    expand_schedule,
)
from vllm_ddtree.context_store_graphs import padded_graph_size
from vllm_ddtree.tree_builder import DDTree, build_trees, empty_tree
from tests.references import build_tree_reference


def test_draft_shape_is_bounded_by_the_budget():
    assert draft_shape(64, 15, 64) == (15, 64)
    assert draft_shape(4, 15, 64) == (4, 4)
    assert draft_shape(32, 15, 8) == (15, 8)
    assert draft_shape(1, 15, 64) == (1, 1)
    with pytest.raises(ValueError, match="budget"):
        draft_shape(0, 15, 64)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("small_budget, top_k", [(1, 64), (4, 64), (8, 64), (16, 64), (32, 8), (20, 20)])
def test_lean_tree_is_the_full_trees_prefix(seed, small_budget, top_k):
    """The claim lean drafting rests on, against the heapq definition: the tree built
    from the first draft_shape() positions and candidates equals the first B + 1 nodes
    of the full tree (random logits: no ties at the K-th candidate)."""
    gen = torch.Generator().manual_seed(seed)
    R, D, V, B = 3, 15, 80, 64
    logits = torch.randn(R, D, V, generator=gen) * 2.0
    full = build_tree_reference(logits, B, top_k)
    depth, k = draft_shape(small_budget, D, top_k)
    lean = build_tree_reference(logits[:, :depth], small_budget, k)
    for name, a, b in zip(DDTree._fields, full, lean):
        assert torch.equal(a[:, : small_budget + 1], b), name


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_smaller_tree_in_wider_buffers_pads_the_rest(triton_device, backend):
    if backend == "torch":
        device = torch.device("cpu")
    else:
        device = triton_device
    gen = torch.Generator().manual_seed(5)
    R, D, V = 3, 4, 30
    logits = torch.randn(R, D, V, generator=gen)
    out = empty_tree(R, 64, device)
    for t in out:  # stale contents, as left by a bigger tree of an earlier step
        t.fill_(7 if t.dtype != torch.bool else True)
    build_trees(logits.to(device), 5, 3, out=out, backend=backend)
    ref = build_tree_reference(logits.to(device), 5, 3)  # same device's normaliser
    for name, a, b in zip(DDTree._fields, ref, out):
        assert torch.equal(a, b[:, :6].cpu()), name
    tokens, parents, depths, valid, scores = (t[:, 6:].cpu() for t in out)
    assert not valid.any()
    assert (tokens == 0).all() and (parents == 0).all() and (depths == 1).all()
    assert torch.isinf(scores).all() and (scores < 0).all()


def test_buffers_narrower_than_the_budget_are_refused():
    with pytest.raises(ValueError, match="fewer than budget"):
        build_trees(torch.randn(2, 3, 10), 8, out=empty_tree(2, 4), backend="torch")


def test_disable_from_batch_size():
    schedule = budget_schedule(512, 64)
    assert disable_from_batch_size(schedule, 64, 16) == [
        (1, 7, 64), (8, 15, 32), (16, OPEN_END, 0)]
    assert disable_from_batch_size(schedule, 64, 12) == [
        (1, 7, 64), (8, 11, 32), (12, OPEN_END, 0)]
    assert disable_from_batch_size(None, 32, 4) == [(1, 3, 32), (4, OPEN_END, 0)]
    table = expand_schedule(disable_from_batch_size(None, 32, 4), 6)
    assert table == [0, 32, 32, 32, 0, 0, 0]
    with pytest.raises(ValueError, match="first_disabled"):
        disable_from_batch_size(None, 32, 1)


def test_drafting_budgets_cover_graph_padding():
    # Scheduler budgets by batch size 1..8 (index 0 unused).
    lookup = [0, 64, 64, 32, 32, 16, 16, 0, 0]
    # No graphs: every size drafts its own budget.
    assert drafting_budgets(lookup, []) == lookup
    # Graphs for 1, 2, 4, 8 requests: 3 pads to 4, 5..7 pad to 8.
    assert drafting_budgets(lookup, [8, 1, 2, 4]) == [0, 64, 64, 32, 32, 16, 16, 0, 16]
    # A graph bigger than the table is ignored; a graph of every size changes nothing.
    assert drafting_budgets(lookup, range(1, 20)) == lookup


# --- the speculator's drafting step, with a fake drafter --------------------------------

vllm = pytest.importorskip("vllm")


def _fake_speculator(drafting_budget, *, max_reqs=6, budget=64, depth=15, top_k=64, vocab=40):
    from vllm_ddtree.dflash_tree_drafter import DDTreeSpeculator

    gen = torch.Generator().manual_seed(11)
    hidden_size = 12
    query = 1 + depth
    spec = DDTreeSpeculator.__new__(DDTreeSpeculator)  # no GPU, no engine
    spec._candidate_head = False  # a DFlash drafter (no DFlash2 candidate head)
    spec.tree_budget, spec.tree_depth, spec.tree_top_k = budget, depth, top_k
    spec.max_num_reqs = max_reqs
    spec.trees = empty_tree(max_reqs, budget, "cpu")
    spec.draft_tokens = torch.full((max_reqs, budget), -1, dtype=torch.int64)
    # Request r's masked positions sit at rows r * query + 1 .. r * query + depth.
    spec.sample_indices = torch.tensor(
        [r * query + 1 + c for r in range(max_reqs) for c in range(depth)])
    spec._profiling_draft = False
    spec._drafting_budget = drafting_budget
    spec._draft_hidden, spec._heads_warm = None, False
    hidden = torch.randn(max_reqs * query, hidden_size, generator=gen)
    weight = torch.randn(hidden_size, vocab, generator=gen)
    calls = {"run_model": 0, "logit_rows": []}

    def run_model(*args, **kwargs):
        calls["run_model"] += 1
        return hidden

    def compute_logits(h):
        calls["logit_rows"].append(h.shape[0])
        return h @ weight

    spec._run_model = run_model
    spec.model = types.SimpleNamespace(compute_logits=compute_logits)
    full_logits = (hidden[spec.sample_indices] @ weight).view(max_reqs, depth, vocab)
    return spec, calls, full_logits


def _draft(spec, num_reqs):
    from vllm_ddtree.dflash_tree_drafter import DDTreeSpeculator

    DDTreeSpeculator._generate_draft(spec, num_reqs, num_reqs * (1 + spec.tree_depth),
                                     None, None, None)


def _assert_first_nodes_of_the_full_tree(spec, full_logits, num_reqs, budget):
    """The speculator's trees are the full tree's first budget + 1 nodes, nothing after
    them; returns the full tree."""
    full = build_tree_reference(full_logits[:num_reqs], 64, 64)
    for name, a, b in zip(DDTree._fields, full, spec.trees):
        a, b = a[:, : budget + 1], b[:num_reqs, : budget + 1]
        if a.is_floating_point():
            # Scores: log-probabilities from a product over fewer rows, which BLAS may
            # block differently (the last bit moves on some CPUs); the nodes are exact.
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6, msg=name)
        else:
            assert torch.equal(a, b), name
    assert not spec.trees.node_valid[:num_reqs, budget + 1:].any()
    return full


@pytest.mark.parametrize("num_reqs, budget", [(2, 64), (3, 4), (4, 1)])
def test_generate_draft_computes_only_what_the_budget_needs(num_reqs, budget):
    table = [0, 64, 64, 4, 1, 0, 0]
    spec, calls, full_logits = _fake_speculator(table)
    _draft(spec, num_reqs)
    depth, k = draft_shape(budget, 15, 64)
    assert calls["logit_rows"] == [num_reqs * depth]
    _assert_first_nodes_of_the_full_tree(spec, full_logits, num_reqs, budget)
    assert torch.equal(spec.draft_tokens[:num_reqs], spec.trees.node_tokens[:num_reqs, 1:])


def test_generate_draft_with_lean_drafting_off_drafts_the_full_tree():
    spec, calls, full_logits = _fake_speculator(None)
    _draft(spec, 4)
    assert calls["logit_rows"] == [4 * 15]
    full = build_tree_reference(full_logits[:4], 64, 64)
    for name, a, b in zip(DDTree._fields, full, spec.trees):
        assert torch.equal(a, b[:4]), name


def _online_lean(spec):
    """The fake as the online controller with lean drafting builds it: no budget
    table, the masked positions' hidden states kept for the step's head."""
    spec._drafting_budget = None
    spec._draft_hidden = torch.zeros(spec.max_num_reqs * spec.tree_depth, 12)
    spec.vllm_config = types.SimpleNamespace(
        speculative_config=types.SimpleNamespace(num_speculative_tokens=spec.tree_budget))
    return spec


@pytest.mark.parametrize("num_reqs, level", [(2, 64), (3, 16), (4, 8), (5, 2), (1, 1)])
def test_with_the_online_controller_the_head_follows_the_steps_level(num_reqs, level):
    """The drafter's forward (its graph) computes no logits; the head then computes the
    logits of the first draft_shape(level) positions only and builds the tree of the
    level, which is the full tree's first level + 1 nodes."""
    from vllm_ddtree.dflash_tree_drafter import DDTreeSpeculator

    spec, calls, full_logits = _fake_speculator(None)
    _online_lean(spec)
    _draft(spec, num_reqs)
    assert calls["run_model"] == 1 and calls["logit_rows"] == []
    DDTreeSpeculator._draft_level(spec, num_reqs, level)
    depth, _ = draft_shape(level, 15, 64)
    assert calls["logit_rows"] == [num_reqs * depth]
    full = _assert_first_nodes_of_the_full_tree(spec, full_logits, num_reqs, level)
    assert torch.equal(spec.draft_tokens[:num_reqs, :level],
                       full.node_tokens[:, 1: level + 1])


def test_memory_profiling_with_the_online_controller_drafts_the_full_tree():
    spec, calls, _ = _fake_speculator(None)
    _online_lean(spec)
    spec._profiling_draft = True
    _draft(spec, 5)
    assert calls["logit_rows"] == [5 * 15]


def test_the_heads_are_warmed_up_once_for_every_level():
    from vllm_ddtree.dflash_tree_drafter import DDTreeSpeculator

    spec, calls, _ = _fake_speculator(None)
    _online_lean(spec)
    DDTreeSpeculator._warm_up_heads(spec)
    # Levels 1, 2, 4, ..., 64: one request, min(level, depth 15) positions each.
    assert calls["logit_rows"] == [1, 2, 4, 8, 15, 15, 15]
    DDTreeSpeculator._warm_up_heads(spec)
    assert len(calls["logit_rows"]) == 7
    # Without lean drafting there are no heads to warm.
    spec, calls, _ = _fake_speculator(None)
    DDTreeSpeculator._warm_up_heads(spec)
    assert calls["logit_rows"] == []


def test_propose_drafts_the_level_the_scheduler_verifies_next(monkeypatch):
    """After the drafter's forward, propose() runs the head for the scheduler's
    num_spec_tokens_to_schedule (warming the heads first, once)."""
    spec, calls = _context_only_fake(monkeypatch, None)
    spec.online_budget = True
    spec._draft_hidden = torch.zeros(1)
    levels = []
    spec._warm_up_heads = lambda: levels.append("warm")
    spec._draft_level = lambda num_reqs, level: levels.append((num_reqs, level))
    _propose(spec, 2, torch.randn(2, 5))
    assert calls["super"] == 1 and levels == ["warm", (2, 8)]
    from vllm_ddtree.dflash_tree_drafter import DDTreeSpeculator
    from vllm_ddtree.tree_verifier import TreeStep

    spec.verifier.step = TreeStep(next_budget=4)
    batch = types.SimpleNamespace(num_reqs=3, num_tokens=3, idx_mapping=torch.tensor([5, 1, 3]),
                                  idx_mapping_np=np.array([5, 1, 3]))
    z = torch.zeros(3)
    DDTreeSpeculator.propose(spec, batch, {}, {}, torch.randn(3, 5), None, z, z, z, z, z, z)
    assert levels[-2:] == ["warm", (3, 4)]
    # A dummy run (memory profiling, cost measurement) drafts no level.
    DDTreeSpeculator.propose(spec, batch, {}, {}, torch.randn(3, 5), None, z, z, z, z, z, z,
                             dummy_run=True)
    assert len(levels) == 4


def test_budget_zero_skips_the_drafter_forward_and_empties_the_trees():
    spec, calls, _ = _fake_speculator([0, 64, 64, 4, 1, 0, 0])
    _draft(spec, 3)  # leaves real trees in the buffers
    calls["logit_rows"].clear()
    runs = calls["run_model"]
    _draft(spec, 5)
    assert calls["run_model"] == runs and calls["logit_rows"] == []
    assert spec.trees.node_valid[:5, 0].all() and not spec.trees.node_valid[:5, 1:].any()
    assert (spec.trees.node_parents[:5, 0] == -1).all() and (spec.trees.node_depths[:5, 0] == 0).all()
    assert (spec.trees.node_tokens[:5, 1:] == 0).all() and (spec.trees.node_depths[:5, 1:] == 1).all()
    assert (spec.draft_tokens[:5] == 0).all()


def test_memory_profiling_drafts_the_full_tree():
    spec, calls, _ = _fake_speculator([0, 64, 64, 4, 1, 0, 0])
    spec._profiling_draft = True
    _draft(spec, 5)
    assert calls["logit_rows"] == [5 * 15]


def test_drafter_graph_sizes_are_read_from_vllms_manager():
    from vllm.config.compilation import CUDAGraphMode

    from vllm_ddtree.dflash_tree_drafter import DDTreeSpeculator

    spec = DDTreeSpeculator.__new__(DDTreeSpeculator)

    spec._candidate_head = False  # a DFlash drafter (no DFlash2 candidate head)
    spec.max_num_reqs = 32
    desc = lambda n: types.SimpleNamespace(num_reqs=n)  # noqa: E731
    spec.query_cudagraph_manager = types.SimpleNamespace(_capture_descs={
        CUDAGraphMode.FULL: [desc(4), desc(2), desc(1)],
        CUDAGraphMode.PIECEWISE: [desc(None)],
    })
    assert sorted(DDTreeSpeculator._drafter_graph_batch_sizes(spec)) == [1, 2, 4]
    # An unexpected manager layout: assume everything pads up to the largest batch.
    spec.query_cudagraph_manager = types.SimpleNamespace()
    assert DDTreeSpeculator._drafter_graph_batch_sizes(spec) == [32]


def test_budget_ranges_for_the_log():
    from vllm_ddtree.budget import table_ranges as _ranges

    assert _ranges([0, 64, 64, 32, 0]) == "1-2: 64, 3: 32, 4: 0"
    assert _ranges([0, 8]) == "1: 8"


def _context_only_fake(monkeypatch, budget_by_batch):
    from vllm.v1.worker.gpu.spec_decode.dflash import speculator as dflash_module

    from vllm_ddtree.dflash_tree_drafter import DDTreeSpeculator
    from vllm_ddtree.tree_verifier import TreeVerifier

    calls = {"prepare": [], "store": [], "super": 0}
    monkeypatch.setattr(dflash_module, "prepare_dflash_inputs",
                        lambda *args: calls["prepare"].append(args))

    def super_propose(self, *args, **kwargs):
        calls["super"] += 1
        return self.draft_tokens[:2]

    monkeypatch.setattr(dflash_module.DFlashSpeculator, "propose", super_propose)
    spec = DDTreeSpeculator.__new__(DDTreeSpeculator)
    spec._candidate_head = False  # a DFlash drafter (no DFlash2 candidate head)
    spec.tree_budget, spec.max_num_reqs = 8, 4
    spec._budget_by_batch = budget_by_batch
    spec._drafting_budget = budget_by_batch
    spec.online_budget = False
    spec.profiler = None
    spec._profiling_draft = False
    spec.draft_tokens = torch.zeros(4, 8, dtype=torch.int64)
    # The verifier (real, on the CPU): every state starts with a full tree.
    spec.verifier = TreeVerifier(6, 8, 8, 32, "cpu", False)
    n = spec.verifier.num_tree_nodes
    spec.verifier.store_trees(
        types.SimpleNamespace(node_tokens=torch.zeros(6, n, dtype=torch.int64),
                              node_parents=torch.zeros(6, n, dtype=torch.int32),
                              node_depths=torch.zeros(6, n, dtype=torch.int32),
                              node_valid=torch.ones(6, n, dtype=torch.bool)),
        torch.arange(6, dtype=torch.int32))
    spec.valid_by_state = spec.verifier.valid_by_state
    spec.trees = None
    spec.draft_kv_cache_group_ids = [0]
    # vLLM 0.26.0's block tables name the kernel's block sizes kernel_block_sizes,
    # 0.33.0's block_sizes (and add the context-parallel rank and interleave).
    spec.block_tables = types.SimpleNamespace(
        slot_mappings=[torch.zeros(16)], input_block_tables=["bt"], kernel_block_sizes=[16],
        block_sizes=[16], cp_rank=0, cp_interleave=1)
    spec._context_slot_mappings = torch.arange(32).view(1, 32)
    spec._layer_group_idx = None
    spec.context_positions = torch.arange(32)
    spec.hidden_states = torch.zeros(32, 5)
    spec._decode_context_graphs = None
    spec._context_graphs = None
    # What prepare_dflash_inputs takes from the speculator (vllm_ddtree.pin_calls), each
    # field its own name; temperature, seeds and dcp_size only on vLLM 0.33.0.
    for name in ("input_buffers", "sample_indices", "sample_pos", "sample_idx_mapping",
                 "parallel_drafting_token_id", "num_query_per_req", "num_speculative_steps",
                 "max_num_tokens", "sample_from_anchor", "temperature", "seeds", "dcp_size"):
        setattr(spec, name, name)
    # max_model_len: an attribute on vLLM 0.26.0; on 0.33.0 a property reading the model
    # config (auto-fit can lower the limit after the speculator is built).
    if isinstance(getattr(DDTreeSpeculator, "max_model_len", None), property):
        spec.vllm_config = types.SimpleNamespace(
            model_config=types.SimpleNamespace(max_model_len="max_model_len"))
    else:
        spec.max_model_len = "max_model_len"
    assert spec.max_model_len == "max_model_len"
    spec.model = types.SimpleNamespace(
        precompute_and_store_context_kv=lambda h, pos, slots: calls["store"].append(
            (h.clone(), pos.clone(), slots.clone())))
    spec.verifier.store_trees = lambda trees, idx, idx_np=None: None
    spec._input_kernel_warm = True  # tests/unit/test_dflash_input_warmup.py covers it
    spec._draft_hidden = None
    return spec, calls


def _schedule_next(spec, num_reqs):
    """What the scheduler verifies after this step (num_spec_tokens_to_schedule,
    handed over by prepare_tree_verification): its lookup at this batch size."""
    from vllm_ddtree.tree_verifier import TreeStep

    table = spec._budget_by_batch
    spec.verifier.step = TreeStep(next_budget=spec.tree_budget if table is None
                                  else table[num_reqs])


def _propose(spec, num_reqs, hidden):
    from vllm_ddtree.dflash_tree_drafter import DDTreeSpeculator

    batch = types.SimpleNamespace(num_reqs=num_reqs, num_tokens=hidden.shape[0],
                                  idx_mapping=torch.tensor([5, 1, 3][:num_reqs]),
                                  idx_mapping_np=np.array([5, 1, 3][:num_reqs]))
    _schedule_next(spec, num_reqs)
    z = torch.zeros(num_reqs)
    return DDTreeSpeculator.propose(spec, batch, {}, {}, hidden, None, z, z, z, z, z, z)


def test_budget_zero_batches_store_only_the_drafter_context(monkeypatch):
    spec, calls = _context_only_fake(monkeypatch, [0, 8, 8, 0, 0])
    hidden = torch.randn(3, 5)
    _propose(spec, 3, hidden)
    assert calls["super"] == 0, "no drafter query forward at budget 0"
    assert len(calls["prepare"]) == 1
    # vLLM's kernel wrapper gets the speculator's limits (the installed pin's call).
    assert {"max_model_len", "max_num_tokens", "num_query_per_req"} <= set(
        a for a in calls["prepare"][0] if isinstance(a, str))
    (h, pos, slots), = calls["store"]
    assert torch.equal(h, hidden) and torch.equal(pos, torch.arange(3))
    # Read from the speculator's persistent buffer, which the context-store graphs read.
    assert torch.equal(spec.hidden_states[:3], hidden)
    assert torch.equal(slots, torch.arange(3))
    # The three requests' trees are root-only now; other states untouched.
    assert not spec.valid_by_state[[5, 1, 3], 1:].any()
    assert spec.valid_by_state[[5, 1, 3], 0].all() and spec.valid_by_state[[0, 2, 4]].all()


def test_dflash_input_kernel_warms_up_after_the_first_step_that_ran_it(monkeypatch):
    """A budget-0 step's context store runs vLLM's DFlash input kernel too: an engine
    that starts with drafting off warms it up there, once; vLLM's dummy runs do not
    count."""
    from vllm_ddtree.dflash_tree_drafter import DDTreeSpeculator

    spec, calls = _context_only_fake(monkeypatch, [0, 8, 8, 0, 0])
    spec._input_kernel_warm = False
    warm_ups = []

    def warm_up(last_sampled, next_prefill_tokens, temperature, seeds):
        warm_ups.append((calls["super"], len(calls["prepare"])))
        spec._input_kernel_warm = True

    spec._warm_up_input_kernel = warm_up
    z = torch.zeros(2)
    batch = types.SimpleNamespace(num_reqs=2, num_tokens=2, idx_mapping=torch.tensor([5, 1]),
                                  idx_mapping_np=np.array([5, 1]))
    DDTreeSpeculator.propose(spec, batch, {}, {}, torch.randn(2, 5), None, z, z, z, z, z, z,
                             dummy_run=True)
    assert warm_ups == []
    _propose(spec, 3, torch.randn(3, 5))  # budget 0: the context store only
    # After the store's input kernel (the dummy run's draft is the only one so far).
    assert warm_ups == [(1, 1)]
    for _ in range(3):
        _propose(spec, 2, torch.randn(2, 5))  # drafting steps
        _propose(spec, 3, torch.randn(3, 5))
    assert warm_ups == [(1, 1)]  # once


def test_dflash_input_kernel_warms_up_after_the_first_drafting_step(monkeypatch):
    spec, calls = _context_only_fake(monkeypatch, [0, 8, 8, 0, 0])
    spec._input_kernel_warm = False
    warm_ups = []

    def warm_up(last_sampled, next_prefill_tokens, temperature, seeds):
        warm_ups.append(calls["super"])  # how many drafting steps had run by then
        spec._input_kernel_warm = True

    spec._warm_up_input_kernel = warm_up
    for _ in range(3):
        _propose(spec, 2, torch.randn(2, 5))
    assert warm_ups == [1]


def _decode_graph_fake(spec, calls, positions):
    from vllm_ddtree.context_store_graphs import ContextStoreGraphs

    aux_states = torch.zeros(4, 10)
    replays = []
    graphs = ContextStoreGraphs(lambda *a: calls["store"].append(a), aux_states, positions,
                                torch.zeros(1, 16, dtype=torch.int64), [0], False, [4],
                                combine_fn=lambda x: x, pad_slots=False)
    graphs.graphs[4] = types.SimpleNamespace(replay=lambda: replays.append(aux_states.clone()))
    spec._decode_context_graphs = graphs
    spec.model.combine_hidden_states = lambda x: x[:, :5]
    return replays


def _propose_aux(spec, num_reqs, num_tokens, positions, req_ids=None):
    from vllm_ddtree.dflash_tree_drafter import DDTreeSpeculator

    # int32, as the runner's idx_mapping.
    batch = types.SimpleNamespace(num_reqs=num_reqs, num_tokens=num_tokens,
                                  idx_mapping=torch.tensor([5, 1, 3][:num_reqs], dtype=torch.int32),
                                  idx_mapping_np=np.array([5, 1, 3][:num_reqs]),
                                  positions=positions[:num_tokens], req_ids=req_ids)
    aux = [torch.randn(num_tokens, 5), torch.randn(num_tokens, 5)]
    _schedule_next(spec, num_reqs)
    z = torch.zeros(num_reqs)
    DDTreeSpeculator.propose(spec, batch, {}, {}, torch.zeros(num_tokens, 5), aux,
                             z, z, z, z, z, z)
    return torch.cat(aux, dim=-1)


def test_budget_zero_decode_steps_replay_one_graph(monkeypatch):
    """One token per request and budget 0: the target's auxiliary states go into the
    decode graph's buffer and one replay stores the context (no input preparation,
    no eager store, no drafter forward); the requests' trees become root-only."""
    spec, calls = _context_only_fake(monkeypatch, [0, 8, 8, 0, 0])
    positions = torch.arange(16)
    replays = _decode_graph_fake(spec, calls, positions)
    aux = _propose_aux(spec, 3, 3, positions)
    assert (calls["prepare"], calls["store"], calls["super"]) == ([], [], 0)
    assert len(replays) == 1 and torch.equal(replays[0][:3], aux)
    assert not spec.valid_by_state[[5, 1, 3], 1:].any()
    assert spec.valid_by_state[[0, 2, 4]].all()


def test_budget_zero_steps_the_decode_graph_cannot_take_run_eagerly(monkeypatch):
    spec, calls = _context_only_fake(monkeypatch, [0, 8, 8, 0, 0])
    positions = torch.arange(16)
    replays = _decode_graph_fake(spec, calls, positions)
    # Drafts verified (or a prefill chunk): more tokens than requests.
    _propose_aux(spec, 3, 6, positions)
    # Positions from another buffer than the one captured.
    _propose_aux(spec, 3, 3, torch.arange(16))
    assert replays == []
    assert len(calls["prepare"]) == 2 and len(calls["store"]) == 2 and calls["super"] == 0


def test_batches_with_a_budget_draft_as_usual(monkeypatch):
    spec, calls = _context_only_fake(monkeypatch, [0, 8, 8, 0, 0])
    _propose(spec, 2, torch.randn(2, 5))
    assert calls["super"] == 1 and calls["store"] == [] and spec.valid_by_state.all()
    # Without a schedule every batch size drafts.
    spec, calls = _context_only_fake(monkeypatch, None)
    _propose(spec, 3, torch.randn(3, 5))
    assert calls["super"] == 1 and calls["store"] == []


def test_lean_drafting_is_opt_in(monkeypatch):
    from vllm_ddtree.env import LEAN_DRAFT, lean_draft_enabled

    LEAN_DRAFT_ENV = LEAN_DRAFT.name

    monkeypatch.delenv(LEAN_DRAFT_ENV, raising=False)
    assert not lean_draft_enabled()
    monkeypatch.setenv(LEAN_DRAFT_ENV, "1")
    assert lean_draft_enabled()
    monkeypatch.setenv(LEAN_DRAFT_ENV, "off")
    assert not lean_draft_enabled()


def _decode_graph_spec(budget_by_batch, use_aux=True, layer_group_idx=None):
    from vllm_ddtree.dflash_tree_drafter import DDTreeSpeculator

    spec = DDTreeSpeculator.__new__(DDTreeSpeculator)

    spec._candidate_head = False  # a DFlash drafter (no DFlash2 candidate head)
    spec._budget_by_batch = budget_by_batch
    spec.online_budget = False
    spec.max_num_reqs = 8
    spec.context_graphs_wanted = True
    spec.vllm_config = types.SimpleNamespace(compilation_config=types.SimpleNamespace(
        cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32]))
    spec.dtype, spec.device = torch.float32, torch.device("cpu")
    spec.draft_kv_cache_group_ids = [2, 5]
    spec._layer_group_idx = layer_group_idx
    spec.target_input_buffers = types.SimpleNamespace(positions=torch.zeros(64, dtype=torch.int64))
    spec.block_tables = types.SimpleNamespace(slot_mappings=torch.zeros(6, 64, dtype=torch.int64))
    inner = types.SimpleNamespace(use_aux_hidden_state=use_aux,
                                  fc=types.SimpleNamespace(input_size=12))
    spec.model = types.SimpleNamespace(model=inner, combine_hidden_states=lambda x: x)
    return spec


def test_decode_graphs_cover_the_batch_sizes_that_draft_nothing():
    capture_sizes = [1, 2, 4, 8, 16, 32]
    spec = _decode_graph_spec([0, 8, 8, 0, 0, 0, 0, 0, 0])
    graphs = spec._decode_context_graphs_for(lambda *a: None, False, capture_sizes)
    # Budget 0 from 3 requests on, at most 8 requests: sizes 4 and 8 (3 pads to 4).
    assert graphs.sizes == [4, 8] and padded_graph_size(graphs.sizes, 3) == 4
    assert graphs.slot_rows == [2] and not graphs.per_layer and not graphs.pad_slots
    assert graphs.states.shape == (8, 12)
    # Per-layer groups: each layer reads its own group's row of the runner's slots.
    spec = _decode_graph_spec([0, 8, 8, 0, 0, 0, 0, 0, 0], layer_group_idx=[1, 0, 1])
    graphs = spec._decode_context_graphs_for(lambda *a: None, True, capture_sizes)
    assert graphs.slot_rows == [5, 2, 5] and graphs.per_layer


def test_with_the_online_budget_every_batch_size_has_a_decode_graph():
    # The controller may turn drafting off at any batch size, whatever the cap table.
    spec = _decode_graph_spec([0, 8, 8, 8, 8, 8, 8, 8, 8])
    spec.online_budget = True
    graphs = spec._decode_context_graphs_for(lambda *a: None, False, [1, 2, 4, 8, 16])
    assert graphs.sizes == [1, 2, 4, 8]
    spec = _decode_graph_spec(None)
    spec.online_budget = True
    assert spec._decode_context_graphs_for(lambda *a: None, False, [1, 2]).sizes == [1, 2]


def test_no_decode_graphs_without_budget_zero_or_auxiliary_states():
    assert _decode_graph_spec(None)._decode_context_graphs_for(None, False, [1, 2]) is None
    assert _decode_graph_spec([0, 8, 8, 8])._decode_context_graphs_for(None, False, [1, 2]) is None
    spec = _decode_graph_spec([0, 8, 0, 0], use_aux=False)
    assert spec._decode_context_graphs_for(None, False, [1, 2]) is None


def _deferring_fake(monkeypatch, capacity=8):
    """The speculator fake with VLLM_DDTREE_DEFER_CONTEXT's buffer and a drafter whose
    fc takes the first 5 of the 10 concatenated auxiliary features."""
    from vllm_ddtree.deferred_context import DeferredContext

    spec, calls = _context_only_fake(monkeypatch, [0, 8, 8, 0, 0])
    spec._deferred = DeferredContext(capacity, 10, torch.float32, torch.device("cpu"))
    spec.block_tables.slot_mappings = [torch.arange(100, 116)]
    spec.model.combine_hidden_states = lambda x: x[:, :5]
    return spec, calls


def _propose_deferring(spec, req_ids, num_tokens):
    return _propose_aux(spec, len(req_ids), num_tokens, torch.arange(40, 40 + num_tokens),
                        list(req_ids))


def test_deferred_budget_zero_steps_store_nothing_until_drafting_resumes(monkeypatch):
    """VLLM_DDTREE_DEFER_CONTEXT=1: budget-0 decode steps only buffer their context (no
    store, no input preparation, no drafter forward; trees root-only); the next step
    that drafts first stores all of it, fc'd, at the steps' positions and slots."""
    spec, calls = _deferring_fake(monkeypatch)
    first = _propose_deferring(spec, ["a", "b", "c"], 3)     # 3 requests: budget 0
    second = _propose_deferring(spec, ["a", "b", "c"], 3)
    assert (calls["prepare"], calls["store"], calls["super"]) == ([], [], 0)
    assert not spec.valid_by_state[[5, 1, 3], 1:].any()
    _propose_deferring(spec, ["a", "b"], 2)                  # 2 requests: drafting
    assert calls["super"] == 1
    (h, pos, slots), = calls["store"]
    assert torch.equal(h, torch.cat([first, second])[:, :5])
    assert torch.equal(pos, torch.arange(40, 43).repeat(2))
    assert torch.equal(slots, torch.arange(100, 103).repeat(2))
    assert spec._deferred.count == 0


def test_deferral_flushes_when_the_requests_change_or_the_buffer_fills(monkeypatch):
    spec, calls = _deferring_fake(monkeypatch, capacity=7)
    for _ in range(2):
        _propose_deferring(spec, ["a", "b", "c"], 3)
    assert calls["store"] == []
    _propose_deferring(spec, ["a", "b", "c"], 3)              # 6 + 3 > 7
    assert [c[0].shape[0] for c in calls["store"]] == [6]
    _propose_deferring(spec, ["a", "d", "c"], 3)              # "b" left, "d" joined
    assert [c[0].shape[0] for c in calls["store"]] == [6, 3]
    assert spec._deferred.count == 3 and calls["super"] == 0


def test_a_flush_goes_through_the_speculators_buffers_to_its_context_store_graph(monkeypatch):
    """With the context-store graphs captured, a flush copies the entries (fc'd) into
    the speculator's hidden states, context positions and slot row, where the graph of
    the padded size stores them (its rows past the entries padded). On the CPU the
    replay runs the captured function eagerly on the same buffers."""
    from vllm_ddtree.context_store_graphs import PAD_SLOT_ID, ContextStoreGraphs

    spec, calls = _deferring_fake(monkeypatch)
    graphs = ContextStoreGraphs(spec.model.precompute_and_store_context_kv, spec.hidden_states,
                                spec.context_positions, spec._context_slot_mappings, [0],
                                False, [4, 8])
    # What graph 8 would replay: the captured function on the buffers' first 8 rows.
    graph = types.SimpleNamespace(replay=lambda: graphs._run(8))
    graphs.graphs = {4: None, 8: graph}
    spec._context_graphs = graphs
    first = _propose_deferring(spec, ["a", "b", "c"], 3)
    second = _propose_deferring(spec, ["a", "b", "c"], 3)
    _propose_deferring(spec, ["a", "b"], 2)                  # drafting: flush first
    assert (graphs.num_replays, graphs.num_eager) == (1, 0)
    (h, pos, slots), = calls["store"][:1]
    assert h.shape[0] == 8
    assert torch.equal(h[:6], torch.cat([first, second])[:, :5])
    assert torch.equal(pos[:6], torch.arange(40, 43).repeat(2))
    assert torch.equal(slots, torch.tensor([100, 101, 102] * 2 + [PAD_SLOT_ID] * 2))
    assert spec._deferred.count == 0


def test_deferral_leaves_steps_that_are_not_one_token_per_request_to_the_store(monkeypatch):
    """A budget-0 step with more tokens than requests (drafts verified, a prefill)
    stores its context at once, after what was deferred."""
    spec, calls = _deferring_fake(monkeypatch)
    _propose_deferring(spec, ["a", "b", "c"], 3)
    _propose_deferring(spec, ["a", "b", "c"], 6)
    assert [c[0].shape[0] for c in calls["store"]] == [3, 6]
    assert len(calls["prepare"]) == 1 and spec._deferred.count == 0


def test_deferral_is_on_by_default_and_asked_for_by_name_needs_auxiliary_states(monkeypatch):
    from vllm.v1.worker.gpu.spec_decode.dflash import speculator as dflash_module

    from vllm_ddtree.dflash_tree_drafter import DDTreeSpeculator
    from vllm_ddtree.env import DEFER_CONTEXT, defer_context_enabled, defer_context_requested

    monkeypatch.delenv(DEFER_CONTEXT.name, raising=False)
    assert defer_context_enabled() and not defer_context_requested()
    # vLLM's own load_model (it loads the drafter; nothing to load here).
    monkeypatch.setattr(dflash_module.DFlashSpeculator, "load_model",
                        lambda self, target: None, raising=False)
    spec = _decode_graph_spec(None)
    DDTreeSpeculator.load_model(spec, object())
    assert spec._deferred.capacity == 256 and spec._deferred.states.shape == (256, 12)
    # Graphs up to 1024 tokens: the buffer grows to the largest, so that a batch of 64
    # flushes every 16th step in one replay; without context-store graphs it does not.
    spec = _decode_graph_spec(None)
    spec.vllm_config.compilation_config.cudagraph_capture_sizes = [1, 8, 512, 1024]
    DDTreeSpeculator.load_model(spec, object())
    assert spec._deferred.capacity == 1024
    spec = _decode_graph_spec(None)
    spec.vllm_config.compilation_config.cudagraph_capture_sizes = [1, 8, 512, 1024]
    spec.context_graphs_wanted = False
    DDTreeSpeculator.load_model(spec, object())
    assert spec._deferred.capacity == 256
    monkeypatch.setenv(DEFER_CONTEXT.name, "0")
    assert not defer_context_enabled() and not defer_context_requested()
    spec = _decode_graph_spec(None)
    DDTreeSpeculator.load_model(spec, object())
    assert spec._deferred is None
    # A drafter without auxiliary states: by default it stores its context every step ...
    monkeypatch.delenv(DEFER_CONTEXT.name)
    spec = _decode_graph_spec(None, use_aux=False)
    DDTreeSpeculator.load_model(spec, object())
    assert spec._deferred is None
    # ... and asking for the deferral by name is an error naming the variable.
    monkeypatch.setenv(DEFER_CONTEXT.name, "1")
    assert defer_context_requested()
    with pytest.raises(ValueError, match="VLLM_DDTREE_DEFER_CONTEXT=1 needs a drafter"):
        DDTreeSpeculator.load_model(spec, object())


def test_a_step_that_drafts_nothing_returns_no_drafts(monkeypatch):
    """propose() returns None on each route of a budget-0 step (the context deferred,
    stored in one graph replay, stored eagerly), so the runner stores no draft rows
    (patch spec-decode_ddtree-runner-hooks); a drafting step and vLLM's dummy runs
    return the drafts."""
    from vllm_ddtree.dflash_tree_drafter import DDTreeSpeculator

    def propose(spec, num_reqs, num_tokens, positions, dummy_run=False):
        batch = types.SimpleNamespace(
            num_reqs=num_reqs, num_tokens=num_tokens,
            idx_mapping=torch.tensor([5, 1, 3][:num_reqs], dtype=torch.int32),
            idx_mapping_np=np.array([5, 1, 3][:num_reqs]), positions=positions[:num_tokens],
            req_ids=["a", "b", "c"][:num_reqs])
        _schedule_next(spec, num_reqs)
        z = torch.zeros(num_reqs)
        aux = [torch.randn(num_tokens, 5), torch.randn(num_tokens, 5)]
        return DDTreeSpeculator.propose(spec, batch, {}, {}, torch.zeros(num_tokens, 5), aux,
                                        z, z, z, z, z, z, dummy_run=dummy_run)

    spec, calls = _deferring_fake(monkeypatch)
    positions = torch.arange(40, 56)
    assert propose(spec, 3, 3, positions) is None                    # deferred
    assert spec._deferred.count == 3
    assert propose(spec, 3, 6, positions) is None                    # eager store
    assert [c[0].shape[0] for c in calls["store"]] == [3, 6]
    drafts = propose(spec, 2, 2, positions)                          # drafting
    assert drafts is not None and calls["super"] == 1
    assert propose(spec, 3, 3, positions, dummy_run=True) is not None
    spec, calls = _context_only_fake(monkeypatch, [0, 8, 8, 0, 0])
    positions = torch.arange(16)
    replays = _decode_graph_fake(spec, calls, positions)
    assert propose(spec, 3, 3, positions) is None and len(replays) == 1  # one replay
