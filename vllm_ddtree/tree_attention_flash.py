"""DDTree tree verification on vLLM's FlashAttention backend (route 2 of
docs/tree-attention.md; opt-in: ``VLLM_DDTREE_TREE_ATTENTION=flash``).

The patch ``attention_flash-attn-tree-split`` hands a layer's attention to
:func:`flash_tree_attention` when the step verifies trees (a tree bias is set and
some request has more than one query token). Per layer:

1. when a request has more query tokens than a tree (a long prefill chunk), the
   backend's own causal call over the cache for the whole batch;
2. a non-causal FlashAttention call over each request's committed context
   (``seqused_k = seq_len - query_len``), with the log-sum-exp;
3. :func:`vllm_ddtree.tree_attention_triton.merge_tree_suffix_attention`: the
   queries of every request of up to a tree's size over this step's fresh K/V,
   under causal AND the tree's ancestor mask, merged with (2).

Supported: dense targets without sliding windows, ALiBi, soft-capping or sinks, an
unquantized KV cache, no decode context parallelism (refused at start-up by
:func:`vllm_ddtree.config.validate_flash_tree_attention`).
"""

from __future__ import annotations

import torch

from vllm_ddtree.tree_attention_triton import split_tree_attention

__all__ = ["flash_tree_attention"]


def flash_tree_attention(
    impl,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    attn_metadata,
    q_descale: torch.Tensor | None,
    k_descale: torch.Tensor | None,
    v_descale: torch.Tensor | None,
) -> torch.Tensor:
    """One layer's attention for a step that verifies trees. ``query``, ``key``,
    ``value``: this step's tokens (``num_actual_tokens`` rows; K/V post-RoPE, the
    values just written to the cache); ``output`` [>= T, Hq * D or Hq, D]."""
    # Looked up at call time: the backend module binds it only where FA is built.
    from vllm.v1.attention.backends import flash_attn as fa

    num_tokens = query.shape[0]
    out = output[:num_tokens].view(query.shape)
    md = attn_metadata
    common = dict(
        k=key_cache,
        v=value_cache,
        cu_seqlens_q=md.query_start_loc,
        max_seqlen_q=md.max_query_len,
        max_seqlen_k=md.max_seq_len,
        softmax_scale=impl.scale,
        block_table=md.block_table,
        fa_version=impl.vllm_flash_attn_version,
        q_descale=q_descale,
        k_descale=k_descale,
        v_descale=v_descale,
        num_splits=md.max_num_splits,
    )

    def plain_attention(dst: torch.Tensor) -> None:
        fa.flash_attn_varlen_func(q=query, out=dst, seqused_k=md.seq_lens, causal=True,
                                  scheduler_metadata=md.scheduler_metadata, **common)

    def context_attention() -> tuple[torch.Tensor, torch.Tensor]:
        # The ahead-of-time schedule is for seq_lens, not the context lengths.
        ctx_out, ctx_lse = fa.flash_attn_varlen_func(
            q=query, out=torch.empty_like(query), seqused_k=md.tree_context_lens,
            causal=False, return_softmax_lse=True, scheduler_metadata=None, **common)
        return ctx_out, ctx_lse

    # The layouts come from vLLM and do not change between steps: checked at a layer's
    # first tree step only (eager and piecewise steps run this once per layer).
    checked = getattr(impl, "_ddtree_tree_inputs_checked", False)
    split_tree_attention(out, query, key, value, md.max_query_len, md.query_start_loc,
                         md.tree_context_lens, md.tree_attn_bias, impl.scale,
                         plain_attention, context_attention, check=not checked)
    if md.max_query_len > 1:
        impl._ddtree_tree_inputs_checked = True
    return output
