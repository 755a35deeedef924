"""FlashAttention's CUDA graph support on the V2 runner (patch
attention_flash-attn-no-full-graphs-for-prefills-on-v2, vllm_ddtree.flash_attn_graphs).

On vLLM 0.26.0's V2 runner FA3's FULL graphs gave wrong tokens for prefills
(bench/results/2026-11-30-flash-attn-full-graphs-pristine-check/graph-mode-outputs-pristine.json);
the patched builder reports UNIFORM_BATCH there, so vLLM's own resolution turns FULL into
FULL_AND_PIECEWISE. Needs the patched vLLM (``./apply.sh``); no GPU: on a CPU host
vLLM computes FA's declared support as UNIFORM_BATCH (no FA3), so the tests set the
declared value to FA3's ALWAYS themselves.
"""

import types

import pytest

pytest.importorskip("vllm")
from vllm.config import CompilationConfig  # noqa: E402
from vllm.config.compilation import CompilationMode, CUDAGraphMode  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport  # noqa: E402
from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder  # noqa: E402

from vllm_ddtree.flash_attn_graphs import flash_attn_cudagraph_support  # noqa: E402

V2 = types.SimpleNamespace(use_v2_model_runner=True)
V1 = types.SimpleNamespace(use_v2_model_runner=False)


@pytest.mark.parametrize(
    "declared, config, expected",
    [
        (AttentionCGSupport.ALWAYS, V2, AttentionCGSupport.UNIFORM_BATCH),
        (AttentionCGSupport.ALWAYS, V1, AttentionCGSupport.ALWAYS),
        (AttentionCGSupport.UNIFORM_BATCH, V2, AttentionCGSupport.UNIFORM_BATCH),
        (AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE, V2,
         AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE),
        (AttentionCGSupport.NEVER, V2, AttentionCGSupport.NEVER),
    ],
)
def test_support_capped_at_uniform_batch_on_v2_only(declared, config, expected):
    assert flash_attn_cudagraph_support(declared, config) is expected


def test_patched_builder_reports_uniform_batch_for_fa3_on_v2(monkeypatch):
    monkeypatch.setattr(FlashAttentionMetadataBuilder, "_cudagraph_support",
                        AttentionCGSupport.ALWAYS)
    assert (FlashAttentionMetadataBuilder.get_cudagraph_support(V2, None)
            is AttentionCGSupport.UNIFORM_BATCH)
    assert (FlashAttentionMetadataBuilder.get_cudagraph_support(V1, None)
            is AttentionCGSupport.ALWAYS)


def _resolve(support):
    # Every attention op among the splitting ops, as VllmConfig sets them for
    # VLLM_COMPILE (what decides FULL_AND_PIECEWISE over FULL_DECODE_ONLY).
    compilation = CompilationConfig(cudagraph_mode="FULL", mode=CompilationMode.VLLM_COMPILE)
    compilation.splitting_ops = list(compilation._attention_ops)
    return compilation.resolve_cudagraph_mode_and_sizes(
        support, "FLASH_ATTN", 1, use_v2_model_runner=True, max_num_reqs=4)


def test_requested_full_becomes_full_and_piecewise_on_v2(monkeypatch):
    monkeypatch.setattr(FlashAttentionMetadataBuilder, "_cudagraph_support",
                        AttentionCGSupport.ALWAYS)
    support = FlashAttentionMetadataBuilder.get_cudagraph_support(V2, None)
    assert _resolve(support) == CUDAGraphMode.FULL_AND_PIECEWISE
    # Control: the declared ALWAYS (the V1 runner's answer) keeps FULL.
    assert _resolve(AttentionCGSupport.ALWAYS) == CUDAGraphMode.FULL
