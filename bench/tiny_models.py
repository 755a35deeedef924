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
