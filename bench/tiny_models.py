"""Tiny Qwen3 configurations for tests and GPU checks (random or dummy weights).

One definition shared by ``bench/gpu_checks.py`` (a tiny random target + DFlash
drafter that vLLM really runs) and the CPU config tests (``tests/unit``), so the two
never drift apart. No side effects at import.
"""

from __future__ import annotations

TINY_QWEN3 = dict(
    model_type="qwen3",
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    torch_dtype="float32",
    hidden_act="silu",
)


def tiny_qwen3_config(**overrides) -> dict:
    """A copy of :data:`TINY_QWEN3` with ``overrides`` applied (HF config.json fields)."""
    cfg = dict(TINY_QWEN3)
    cfg.update(overrides)
    return cfg


# Target shapes of the families that public DFlash drafters serve, as tiny random
# models: (architecture, HF config fields). The drafter is always the tiny Qwen3-shaped
# DFlash model of the same hidden size.
TARGET_SHAPES = {
    "qwen3": ("Qwen3ForCausalLM", {}),
    "llama3": ("LlamaForCausalLM", dict(
        model_type="llama", attention_bias=False, mlp_bias=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=1024),
    )),
    "qwen3-moe": ("Qwen3MoeForCausalLM", dict(
        model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True, output_router_logits=False,
    )),
}


def tiny_target_config(shape: str) -> dict:
    """config.json of a tiny random target of ``shape`` (a key of TARGET_SHAPES)."""
    arch, fields = TARGET_SHAPES[shape]
    return dict(architectures=[arch], **tiny_qwen3_config(**fields))


# The tiny random drafters' own fields (beside a one-layer tiny Qwen3 config): a DFlash
# drafter (block 16) and a DFlash2 drafter (vLLM 0.33.0's DFlash2Qwen3ForCausalLM:
# block 8, grouped convolutions, a candidate selector of top 8).
TINY_DRAFTERS = {
    "dflash": dict(architectures=["DFlashDraftModel"], block_size=16,
                   dflash_config=dict(mask_token_id=0, target_layer_ids=[1, 2])),
    "dflash2": dict(architectures=["DFlash2DraftModel"], block_size=8,
                    dflash_config=dict(mask_token_id=0, target_layer_ids=[1, 2],
                                       conv_kernel_size=3, conv_group_size=16,
                                       selector_rank=8, selector_top_k=8)),
}
