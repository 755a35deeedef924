"""The patched FlashAttention backend verifying trees (patch
attention_flash-attn-tree-split, vllm_ddtree.tree_attention_flash), on a CPU:
FlashAttention's varlen call is replaced by the dense references (causal over the
cache, or non-causal over the context with the log-sum-exp), so what is tested is
the patch's routing, the metadata it reads and the split around the Triton kernel
(interpreted), against the dense reference with each request's tree mask.
"""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("vllm")

from tests.unit.tree_split_cases import D, HKV, HQ, NODES, PARENTS, SCALE  # noqa: E402
from tests.unit.tree_split_cases import dense_reference, make_batch  # noqa: E402
from tests.references import reference_context_attention, reference_paged_attention  # noqa: E402
from vllm_ddtree.reach_ins import PIN_0_26, installed_pin  # noqa: E402


def _fake_varlen(calls):
    def flash_attn_varlen_func(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k,
                               max_seqlen_k, softmax_scale, causal, block_table,
                               return_softmax_lse=False, **kw):
        qsl = cu_seqlens_q.tolist()
        lens = seqused_k.tolist()
        calls.append(dict(causal=causal, lse=return_softmax_lse, seqused_k=lens,
                          scheduler_metadata=kw.get("scheduler_metadata")))
        # k/v arrive as the backend's [blocks, block_size, Hkv, D] views.
        if causal:
            out.copy_(reference_paged_attention(q, k, v, block_table, lens, qsl, softmax_scale,
                                                [None] * len(lens)))
            return out
        ctx, lse = reference_context_attention(q, k, v, block_table, lens, qsl, softmax_scale)
        # An empty context leaves FlashAttention's rows undefined.
        for s, c in enumerate(lens):
            if c == 0:
                ctx[qsl[s]: qsl[s + 1]] = float("nan")
        out.copy_(ctx)
        return out, lse

    return flash_attn_varlen_func


def _impl_and_metadata(b, with_tree=True):
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl, FlashAttentionMetadata

    impl = FlashAttentionImpl.__new__(FlashAttentionImpl)
    impl.__dict__.update(
        vllm_flash_attn_version=3, scale=SCALE, attn_type=AttentionType.DECODER,
        kv_cache_dtype="auto", dcp_world_size=1, supports_quant_query_input=False,
        num_kv_heads=HKV, num_heads=HQ, head_size=D, sliding_window=None, alibi_slopes=None,
        logits_soft_cap=None, sinks=None)
    if installed_pin() != PIN_0_26:
        impl.fa4_hd256 = False  # 0.33.0's FA4 head-size-256 kernel switch
    qsl = torch.tensor(b["qsl"], dtype=torch.int32)
    seq_lens = torch.tensor(b["seq_lens"], dtype=torch.int32)
    q_lens = (qsl[1:] - qsl[:-1]).tolist()
    fields = dict(
        num_actual_tokens=int(qsl[-1]), max_query_len=max(q_lens), query_start_loc=qsl,
        max_seq_len=int(seq_lens.max()), seq_lens=seq_lens, block_table=b["block_table"],
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
        scheduler_metadata=torch.zeros(1, dtype=torch.int32))
    if installed_pin() == PIN_0_26:
        # 0.26.0's required cascade-attention fields (0.33.0 removed cascade attention).
        fields.update(use_cascade=False, common_prefix_len=0, cu_prefix_query_lens=None,
                      prefix_kv_lens=None, suffix_kv_lens=None)
    md = FlashAttentionMetadata(**fields)
    if with_tree:
        md.tree_attn_bias = b["bias"]
        md.tree_context_lens = torch.tensor(b["context_lens"], dtype=torch.int32)
    # The backend's cache layout: [blocks, Hkv, block_size, 2 * D].
    kv_cache = torch.cat([b["k_cache"], b["v_cache"]], dim=-1).transpose(1, 2).contiguous()
    layer = types.SimpleNamespace(_q_scale=torch.ones(1), _k_scale=torch.ones(1),
                                  _v_scale=torch.ones(1))
    return impl, md, kv_cache, layer


def _forward(b, monkeypatch, with_tree=True, extra_rows=3):
    from vllm.v1.attention.backends import flash_attn

    calls = []
    monkeypatch.setattr(flash_attn, "flash_attn_varlen_func", _fake_varlen(calls), raising=False)
    impl, md, kv_cache, layer = _impl_and_metadata(b, with_tree)
    t = b["query"].shape[0]
    pad = lambda x: torch.cat([x, torch.zeros(extra_rows, *x.shape[1:])])  # noqa: E731
    # Padded rows past num_actual_tokens, as in a CUDA-graph batch.
    output = torch.full((t + extra_rows, HQ, D), 7.0)
    impl.forward(layer, pad(b["query"]), pad(b["key"]), pad(b["value"]), kv_cache, md, output)
    return output, calls


@pytest.fixture
def interpreted(triton_device):
    if triton_device.type != "cpu":
        pytest.skip("the faked FlashAttention call is a CPU reference")
    return triton_device


def test_a_tree_step_is_the_context_call_plus_the_tree_kernel(interpreted, monkeypatch):
    requests = [(9, NODES, PARENTS[0]), (3, 1, None), (0, 3, None), (13, NODES, PARENTS[1])]
    b = make_batch(requests, 7)
    output, calls = _forward(b, monkeypatch)
    t = b["query"].shape[0]
    want = dense_reference(b)
    assert torch.allclose(output[:t], want, atol=2e-4), (output[:t] - want).abs().max()
    assert (output[t:] == 7.0).all(), "rows past the step's tokens are not written"
    # One non-causal call over the committed context, without the AOT schedule
    # (made for seq_lens); no plain call: every request fits a tree.
    assert calls == [dict(causal=False, lse=True, seqused_k=b["context_lens"],
                          scheduler_metadata=None)]


def test_a_layer_checks_its_input_layouts_at_its_first_tree_step_only(interpreted, monkeypatch):
    from vllm.v1.attention.backends import flash_attn

    from vllm_ddtree import tree_attention_triton

    checks = []
    real = tree_attention_triton.check_tree_suffix_inputs
    monkeypatch.setattr(tree_attention_triton, "check_tree_suffix_inputs",
                        lambda *a: checks.append(1) or real(*a))
    monkeypatch.setattr(flash_attn, "flash_attn_varlen_func", _fake_varlen([]), raising=False)
    b = make_batch([(9, NODES, PARENTS[0]), (3, 1, None)], 7)
    impl, md, kv_cache, layer = _impl_and_metadata(b)
    t = b["query"].shape[0]
    for _ in range(3):
        output = torch.zeros((t, HQ, D))
        impl.forward(layer, b["query"], b["key"], b["value"], kv_cache, md, output)
        assert torch.allclose(output, dense_reference(b), atol=2e-4)
    assert checks == [1]


def test_a_long_prefill_adds_the_plain_call(interpreted, monkeypatch):
    requests = [(9, NODES, PARENTS[1]), (4, NODES + 4, None)]
    b = make_batch(requests, 8)
    output, calls = _forward(b, monkeypatch)
    t = b["query"].shape[0]
    assert torch.allclose(output[:t], dense_reference(b), atol=2e-4)
    assert [c["causal"] for c in calls] == [True, False]
    assert calls[0]["seqused_k"] == b["seq_lens"] and calls[0]["scheduler_metadata"] is not None


def test_one_token_per_request_takes_flashattentions_own_path(interpreted, monkeypatch):
    b = make_batch([(5, 1, None), (8, 1, None), (2, 1, None)], 9)
    for with_tree in (True, False):
        output, calls = _forward(b, monkeypatch, with_tree=with_tree)
        t = b["query"].shape[0]
        assert torch.allclose(output[:t], dense_reference(b), atol=1e-5)
        assert len(calls) == 1 and calls[0]["causal"] is True and not calls[0]["lse"]


def test_without_a_tree_bias_the_backend_is_unchanged(interpreted, monkeypatch):
    """A target on FLASH_ATTN without DDTree: causal even for multi-token queries."""
    b = make_batch([(6, 4, None), (3, 2, None)], 10)
    output, calls = _forward(b, monkeypatch, with_tree=False)
    t = b["query"].shape[0]
    assert torch.allclose(output[:t], dense_reference(b, causal_only=True), atol=1e-5)
    assert len(calls) == 1 and calls[0]["causal"] is True


@pytest.mark.skipif(installed_pin() != PIN_0_26,
                    reason="vLLM 0.33.0 removed cascade attention (no use_cascade_attention "
                           "for the tree split to refuse); 0.26.0 only")
def test_the_builder_never_chooses_cascade_attention_with_a_tree():
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder

    builder = FlashAttentionMetadataBuilder.__new__(FlashAttentionMetadataBuilder)
    builder.tree_attn_bias = torch.zeros(1, 2, 2)
    assert builder.use_cascade_attention(common_prefix_len=4096) is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention needs a GPU")
def test_real_flashattention_tree_split_matches_the_dense_reference(monkeypatch):
    """On the GPU host: vLLM's own FlashAttention (FA3 on Hopper) for both calls and
    the compiled tree kernel, bf16, head size 64, 16-token blocks."""
    from vllm.v1.attention.backends import flash_attn
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

    if not hasattr(flash_attn, "flash_attn_varlen_func"):
        pytest.skip("this vLLM build has no FlashAttention varlen kernel")
    requests = [(40, NODES, PARENTS[0]), (17, 1, None), (0, 3, None), (33, NODES, PARENTS[1]),
                (25, NODES + 9, None)]
    b = make_batch(requests, 11, block=16, head_size=64, dtype=torch.bfloat16)
    impl, md, kv_cache, layer = _impl_and_metadata(b)
    impl.vllm_flash_attn_version = get_flash_attn_version(head_size=64)
    impl.scale = b["scale"]
    impl.head_size = 64
    md.scheduler_metadata = None
    dev = torch.device("cuda")
    for name in ("query_start_loc", "seq_lens", "block_table", "tree_attn_bias",
                 "tree_context_lens", "slot_mapping"):
        setattr(md, name, getattr(md, name).to(dev))
    layer = types.SimpleNamespace(**{k: v.to(dev) for k, v in vars(layer).items()})
    t = b["query"].shape[0]
    output = torch.zeros(t, HQ, 64, dtype=torch.bfloat16, device=dev)
    impl.forward(layer, b["query"].to(dev), b["key"].to(dev), b["value"].to(dev),
                 kv_cache.to(dev), md, output)
    want = dense_reference(b).float()
    err = (output.cpu().float() - want).abs().max().item()
    assert err < 3e-2, err
    assert (output.cpu().float() - dense_reference(b, causal_only=True).float()).abs().max() > 0.1


def _cpu_builder(tree_bias):
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder

    builder = FlashAttentionMetadataBuilder.__new__(FlashAttentionMetadataBuilder)
    builder.__dict__.update(
        aot_schedule=False, aot_sliding_window=(-1, -1), use_full_cuda_graph=False,
        max_cudagraph_size=None, max_num_splits=0, dcp_world_size=1, rswa_window=None,
        cache_config=types.SimpleNamespace(cache_dtype="auto"), kv_cache_dtype=torch.float16,
        num_heads_q=HQ, num_heads_kv=HKV, headdim=D, block_size=16,
        kv_cache_spec=types.SimpleNamespace(sliding_window=None), device=torch.device("cpu"),
        tree_attn_bias=tree_bias,
        _tree_context_lens=torch.full((8,), -7, dtype=torch.int32))
    return builder


def _common_metadata(q_lens, seq_lens):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq,
        num_reqs=len(q_lens), num_actual_tokens=int(qsl[-1]), max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), block_table_tensor=torch.zeros(len(q_lens), 4, dtype=torch.int32),
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64))


def test_the_builder_writes_context_lengths_into_its_persistent_buffer():
    """build() with a tree bias: seq_len - query_len per request, in the builder's own
    buffer (the address FULL CUDA graphs read), the rest of it untouched."""
    bias = torch.zeros(8, NODES, NODES)
    builder = _cpu_builder(bias)
    md = builder.build(0, _common_metadata([NODES, 1, 3], [20, 9, 3]))
    assert md.tree_attn_bias is bias
    assert md.tree_context_lens.tolist() == [20 - NODES, 8, 0]
    assert md.tree_context_lens.data_ptr() == builder._tree_context_lens.data_ptr()
    assert builder._tree_context_lens[3:].tolist() == [-7] * 5
    # Without a bias (the drafter's builders, plain FLASH_ATTN): no tree fields.
    md = _cpu_builder(None).build(0, _common_metadata([2], [5]))
    assert md.tree_attn_bias is None and md.tree_context_lens is None
