"""Which captured CUDA graph the V2 runner replays for a batch, under a DDTree
budget schedule (patch cudagraph_dispatch-ladders-per-query-length).

vLLM 0.26 staged every graph on one ladder of token counts: a batch took the graphs
at the nearest level at or above its size. A DDTree schedule captures FULL decode
graphs for several query lengths (budget + 1 per batch-size range), at sizes rounded
to each length, so the nearest level often held only another length's decode
graphs: a mixed step (a joining request's prompt beside the trees) then ran with no
graph at all. On the H200 such steps cost 10-32 ms against 2-4 ms for a decode step
(bench/results/2026-11-30-steady-concurrency-cost8b-auto/). Built on the CPU from the manager's own
candidate code; only the captured-graph lookup is exercised.
"""

from __future__ import annotations

import types

import pytest

from vllm_ddtree.budget import budget_schedule

cudagraph_utils = pytest.importorskip("vllm.v1.worker.gpu.cudagraph_utils")
CUDAGraphMode = pytest.importorskip("vllm.config").CUDAGraphMode


def default_capture_sizes(largest: int) -> list[int]:
    """vLLM's default capture sizes up to ``largest`` tokens."""
    return [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, largest + 1, 16))


CAPTURE_SIZES = default_capture_sizes(512)


def graph_manager(decode_query_len: int, num_spec: int, schedule=None, max_num_reqs: int = 64,
                  mode=CUDAGraphMode.FULL_AND_PIECEWISE, capture_sizes=CAPTURE_SIZES,
                  ddtree_online: bool = False):
    """A CudaGraphManager with only what candidate staging and dispatch read."""
    manager = object.__new__(cudagraph_utils.CudaGraphManager)
    manager.compilation_config = types.SimpleNamespace(
        cudagraph_capture_sizes=capture_sizes, max_cudagraph_capture_size=max(capture_sizes))
    manager.max_num_reqs = max_num_reqs
    manager.decode_query_len = decode_query_len
    manager.cudagraph_mode = mode
    # vLLM 0.33.0's staging also reads these (varlen decode graphs and micro-batch
    # twins, both off for DDTree's drafter-less target); 0.26.0 has neither.
    manager.varlen_decode = False
    manager.ubatch_runner = None
    manager.lora_capture_cases = [0]
    manager._lora_dispatch_map, manager._max_lora_case = {}, 0
    spec = None
    if num_spec:
        spec = types.SimpleNamespace(
            uses_dynamic_speculative_decoding=lambda: schedule is not None,
            num_speculative_tokens_per_batch_size=schedule,
            use_ddtree=lambda: ddtree_online, method="ddtree" if ddtree_online else "dflash",
            ddtree_online_budget=ddtree_online, num_speculative_tokens=num_spec)
    # cache_config: vLLM 0.33.0 keeps mixed graphs within a recoverSSM workspace
    # (use_kda_recoverssm, off here); 0.26.0 does not read it.
    manager.vllm_config = types.SimpleNamespace(
        speculative_config=spec, num_speculative_tokens=num_spec,
        cache_config=types.SimpleNamespace(use_kda_recoverssm=False),
        compilation_config=types.SimpleNamespace(cudagraph_mode=mode))
    manager._candidates, manager._capture_descs = {}, {}
    manager.use_breakable_cg = False
    manager._init_candidates()
    manager._graphs_captured = True
    return manager


def smallest_full_graph(manager, query_len: int, num_tokens: int) -> int:
    """Tokens of the smallest captured FULL decode graph of ``query_len`` that holds
    ``num_tokens``."""
    return min(d.num_tokens for d in manager._capture_descs[CUDAGraphMode.FULL]
               if d.uniform_token_count == query_len and d.num_tokens >= num_tokens)


def ddtree_manager(tokens_per_step: int = 512, max_budget: int = 64,
                   capture_sizes=CAPTURE_SIZES):
    return graph_manager(max_budget + 1, max_budget, budget_schedule(tokens_per_step, max_budget),
                         capture_sizes=capture_sizes)


# The largest graph: vLLM's default, and DDTree's default under the 512-token schedule
# (patch config_ddtree-cuda-graphs-for-joining-requests), where a step of up to 510
# tokens of trees plus a joining prompt must still find a graph.
LARGEST_GRAPHS = [512, 1024]


@pytest.mark.parametrize("largest", LARGEST_GRAPHS)
def test_every_mixed_step_within_the_largest_graph_replays_a_piecewise_graph(largest):
    sizes = default_capture_sizes(largest)
    manager = ddtree_manager(capture_sizes=sizes)
    for num_tokens in range(2, largest + 1):
        desc = manager.dispatch(2, num_tokens, None, 0)
        assert desc.cg_mode == CUDAGraphMode.PIECEWISE, num_tokens
        # The smallest captured size that holds the batch.
        assert desc.num_tokens == min(s for s in sizes if s >= num_tokens)
    # Past them all.
    assert manager.dispatch(2, largest + 88, None, 0).cg_mode == CUDAGraphMode.NONE


@pytest.mark.parametrize("largest", LARGEST_GRAPHS)
def test_every_scheduled_decode_step_replays_a_full_graph_of_its_query_length(largest):
    schedule = budget_schedule(512, 64)
    manager = ddtree_manager(capture_sizes=default_capture_sizes(largest))
    for first, last, budget in schedule:
        query_len = budget + 1
        for num_reqs in range(first, min(last, 64) + 1):
            num_tokens = num_reqs * query_len
            if num_tokens > largest:
                continue
            desc = manager.dispatch(num_reqs, num_tokens, query_len, 0)
            assert desc.cg_mode == CUDAGraphMode.FULL, (num_reqs, query_len)
            assert desc.uniform_token_count == query_len and desc.num_reqs >= num_reqs
            assert desc.num_tokens == smallest_full_graph(manager, query_len, num_tokens)


@pytest.mark.parametrize("largest", LARGEST_GRAPHS)
def test_under_full_mode_every_step_within_the_largest_graph_replays_a_full_graph(largest):
    """DDTree's default mode on Triton attention (vllm_ddtree.config.ddtree_cudagraph_mode):
    a step that prefills a joining request beside the trees replays one whole-forward
    graph, as decode steps of every scheduled query length do."""
    sizes = default_capture_sizes(largest)
    manager = graph_manager(65, 64, budget_schedule(512, 64), mode=CUDAGraphMode.FULL,
                            capture_sizes=sizes)
    for num_tokens in range(2, largest + 1):
        for num_reqs in {1, min(num_tokens, 64) // 2 or 1, min(num_tokens, 64)}:
            desc = manager.dispatch(num_reqs, num_tokens, None, 0)
            assert desc.cg_mode == CUDAGraphMode.FULL, (num_reqs, num_tokens)
            assert desc.num_tokens == min(s for s in sizes if s >= num_tokens)
            assert desc.num_reqs >= num_reqs
    for first, last, budget in budget_schedule(512, 64):
        for num_reqs in range(first, min(last, 64) + 1):
            num_tokens = num_reqs * (budget + 1)
            if num_tokens <= largest:
                desc = manager.dispatch(num_reqs, num_tokens, budget + 1, 0)
                assert desc.cg_mode == CUDAGraphMode.FULL and desc.num_reqs >= num_reqs
    assert manager.dispatch(2, largest + 88, None, 0).cg_mode == CUDAGraphMode.NONE


@pytest.mark.parametrize("decode_query_len, num_spec", [(1, 0), (16, 15)])
def test_one_query_length_dispatches_as_before(decode_query_len, num_spec):
    """Plain decoding and the DFlash chain (one decode length): decode batches on FULL
    graphs, mixed ones on the smallest piecewise graph."""
    manager = graph_manager(decode_query_len, num_spec)
    for num_reqs in (1, 3, 16, 32):
        desc = manager.dispatch(num_reqs, num_reqs * decode_query_len, decode_query_len, 0)
        assert desc.cg_mode == CUDAGraphMode.FULL and desc.num_reqs >= num_reqs
        assert desc.num_tokens == smallest_full_graph(manager, decode_query_len,
                                                      num_reqs * decode_query_len)
    for num_tokens in (5, 100, 300, 512):
        desc = manager.dispatch(2, num_tokens, None, 0)
        assert desc.cg_mode == CUDAGraphMode.PIECEWISE
        assert desc.num_tokens == min(s for s in CAPTURE_SIZES if s >= num_tokens)


def test_without_mixed_graphs_a_mixed_step_runs_eagerly():
    manager = graph_manager(65, 64, budget_schedule(512, 64), mode=CUDAGraphMode.FULL_DECODE_ONLY)
    assert manager.dispatch(2, 200, None, 0).cg_mode == CUDAGraphMode.NONE
    assert manager.dispatch(4, 4 * 65, 65, 0).cg_mode == CUDAGraphMode.FULL


def test_one_query_length_that_skips_capture_sizes_keeps_mixed_steps_on_graphs():
    """A decode length that does not divide the capture sizes (3: two speculative
    tokens) staged decode-only levels (9, 18, ...) on the old ladder, where mixed
    batches found no graph."""
    manager = graph_manager(3, 2)
    for num_tokens in (9, 17, 18, 100):
        desc = manager.dispatch(2, num_tokens, None, 0)
        assert desc.cg_mode == CUDAGraphMode.PIECEWISE, num_tokens
        assert desc.num_tokens == min(s for s in CAPTURE_SIZES if s >= num_tokens)
    desc = manager.dispatch(3, 9, 3, 0)
    assert desc.cg_mode == CUDAGraphMode.FULL and desc.num_tokens == 9


def test_ddtree_online_budget_captures_decode_graphs_for_every_level():
    # A full-budget cap (budget 8) schedules one query length; the controller may
    # verify 0, 1, 2, 4 or 8 drafts at any batch size, so each has FULL decode graphs.
    manager = graph_manager(9, 8, schedule=[(1, 64, 8)], ddtree_online=True)
    lens = {d.uniform_token_count for d in manager._capture_descs[CUDAGraphMode.FULL]}
    assert lens == {1, 2, 3, 5, 9}
    assert smallest_full_graph(manager, 1, 16) == 16
    assert smallest_full_graph(manager, 5, 4 * 5) == 20


def _full_mode_ddtree_manager(monkeypatch, single_token_graphs: bool, largest: int = 512,
                              mode=CUDAGraphMode.FULL):
    monkeypatch.setenv("VLLM_DDTREE_SINGLE_TOKEN_GRAPHS", "1" if single_token_graphs else "0")
    return graph_manager(65, 64, budget_schedule(512, 64), mode=mode,
                         capture_sizes=default_capture_sizes(largest), ddtree_online=True)


def test_full_mode_captures_only_mixed_graphs_unless_single_token_graphs_are_asked_for(monkeypatch):
    """DDTree's default FULL mode: one mixed graph per token count, captured with the
    tree bias, which its drafting-off steps replay. VLLM_DDTREE_SINGLE_TOKEN_GRAPHS=1
    adds FULL decode graphs of one query token per request (patch
    v2-runner_ddtree-single-token-decode-graphs) at every capture size up to
    max_num_seqs, and nothing else."""
    off = _full_mode_ddtree_manager(monkeypatch, False)
    assert {d.uniform_token_count for d in off._capture_descs[CUDAGraphMode.FULL]} == {None}
    on = _full_mode_ddtree_manager(monkeypatch, True)
    full = on._capture_descs[CUDAGraphMode.FULL]
    single = sorted(d.num_tokens for d in full if d.uniform_token_count == 1)
    assert single == [s for s in default_capture_sizes(512) if s <= 64]
    assert all(d.num_reqs == d.num_tokens for d in full if d.uniform_token_count == 1)
    assert {d.uniform_token_count for d in full} == {None, 1}
    # The mixed graphs are those of the engine without the switch.
    assert sorted(d.num_tokens for d in full if d.uniform_token_count is None) == sorted(
        d.num_tokens for d in off._capture_descs[CUDAGraphMode.FULL])
    # Modes with a separate decode routine already capture every level's decode graphs.
    for mode in (CUDAGraphMode.FULL_AND_PIECEWISE,):
        a = _full_mode_ddtree_manager(monkeypatch, False, mode=mode)
        b = _full_mode_ddtree_manager(monkeypatch, True, mode=mode)
        assert a._capture_descs == b._capture_descs


@pytest.mark.parametrize("largest", LARGEST_GRAPHS)
def test_a_batch_that_can_verify_a_tree_never_replays_a_single_token_decode_graph(
        monkeypatch, largest):
    """Those graphs are captured without the tree bias. That is sound only if no batch
    with a tree replays one: a mixed batch (a tree beside one-token decodes, or a
    joining prompt) and a uniform batch of more than one token a request find a mixed
    graph; a batch of one token a request (a step that drafts nothing) finds one."""
    manager = _full_mode_ddtree_manager(monkeypatch, True, largest)
    for num_tokens in range(2, largest + 1):
        for num_reqs in {1, min(num_tokens, 64) // 2 or 1, min(num_tokens, 64)}:
            desc = manager.dispatch(num_reqs, num_tokens, None, 0)
            assert desc.cg_mode == CUDAGraphMode.FULL and desc.uniform_token_count is None
        for query_len in range(2, 66):
            if num_tokens % query_len == 0 and num_tokens // query_len <= 64:
                desc = manager.dispatch(num_tokens // query_len, num_tokens, query_len, 0)
                assert desc.cg_mode == CUDAGraphMode.FULL, (num_tokens, query_len)
                assert desc.uniform_token_count is None, (num_tokens, query_len)
    for num_reqs in range(1, 65):
        desc = manager.dispatch(num_reqs, num_reqs, 1, 0)
        assert desc.cg_mode == CUDAGraphMode.FULL and desc.uniform_token_count == 1
        assert desc.num_reqs >= num_reqs


def test_single_token_decode_graphs_are_captured_without_the_tree_bias(monkeypatch):
    """The runner drops the bias from the metadata of the FULL decode graphs of one query
    token per request, and only from them (every other capture keeps what the builder
    gave it)."""
    drop = getattr(cudagraph_utils, "drop_tree_bias_from_single_token_decode_graph", None)
    if drop is None:
        pytest.skip("this pin's series has no one-token decode graphs under FULL mode")
    manager = _full_mode_ddtree_manager(monkeypatch, True)
    bias = object()
    seen = set()
    for desc in manager._capture_descs[CUDAGraphMode.FULL]:
        shared = types.SimpleNamespace(tree_attn_bias=bias)
        metadata = {"layers.0.attn": shared, "layers.1.attn": shared,
                    "drafter.attn": types.SimpleNamespace(tree_attn_bias=None),
                    "other.attn": types.SimpleNamespace()}
        drop(desc, metadata)
        assert (shared.tree_attn_bias is bias) == (desc.uniform_token_count != 1), desc
        assert metadata["drafter.attn"].tree_attn_bias is None
        assert not hasattr(metadata["other.attn"], "tree_attn_bias")
        seen.add(desc.uniform_token_count)
    assert seen == {None, 1}
    drop(manager._capture_descs[CUDAGraphMode.FULL][0], None)  # no metadata: nothing to do
