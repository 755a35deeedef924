"""Prototype of the faster route: attention over the tree tokens only, merged by LSE.

Route 2 of docs/tree-attention.md. The target's attention for a request that
verifies a tree splits into two disjoint key sets:

* the committed context ``[0, start)``, which every tree node sees in full:
  one non-causal FA3 call over the paged cache with ``seqused_k =
  context_lens`` and ``return_softmax_lse=True`` (what FlashAttentionImpl
  already does for decode-context-parallel);
* the B+1 tree tokens of this step, under the ancestor mask: the small
  Triton kernel below, reading the fresh K/V of this forward (no cache).

The two partial results are merged with vLLM's ``merge_attn_states`` (or
:func:`merge_by_lse` here, its torch twin for tests). Not wired into vLLM yet.

Imports ``triton`` directly (not ``vllm.triton_utils``), so on a CPU it needs
``TRITON_INTERPRET=1`` set before this module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["merge_by_lse", "tree_token_attention"]


@triton.jit
def _tree_token_attention_kernel(
    out_ptr,  # [R * N, Hq, D]
    lse_ptr,  # [Hq, R * N] float32
    q_ptr,  # [R * N, Hq, D]
    k_ptr,  # [R * N, Hkv, D]
    v_ptr,  # [R * N, Hkv, D]
    bias_ptr,  # [>= R, N, N] float32, 0 / -inf
    scale,
    N,
    num_tokens,
    stride_q_t, stride_q_h,
    stride_k_t, stride_k_h,
    stride_v_t, stride_v_h,
    stride_o_t, stride_o_h,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    N_PADDED: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // QUERIES_PER_KV
    rows = tl.arange(0, N_PADDED)
    dims = tl.arange(0, HEAD_SIZE_PADDED)
    row_ok = rows < N
    dim_ok = dims < HEAD_SIZE
    tok = (req * N + rows).to(tl.int64)

    q = tl.load(
        q_ptr + tok[:, None] * stride_q_t + head * stride_q_h + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
    )
    k = tl.load(
        k_ptr + tok[:, None] * stride_k_t + kv_head * stride_k_h + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
    )
    v = tl.load(
        v_ptr + tok[:, None] * stride_v_t + kv_head * stride_v_h + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
    )
    s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
    pair_ok = row_ok[:, None] & row_ok[None, :]
    bias = tl.load(
        bias_ptr + req.to(tl.int64) * N * N + rows[:, None] * N + rows[None, :],
        mask=pair_ok, other=float("-inf"),
    )
    s = tl.where(pair_ok, s + bias, float("-inf"))
    m = tl.max(s, axis=1)
    m = tl.where(m > float("-inf"), m, 0.0)  # padding rows: avoid -inf - -inf
    p = tl.exp(s - m[:, None])
    l = tl.sum(p, axis=1)
    acc = tl.dot(p.to(v.dtype), v).to(tl.float32)
    l_safe = tl.where(l > 0.0, l, 1.0)
    acc = acc / l_safe[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_o_t + head * stride_o_h + dims[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )
    lse = tl.where(l > 0.0, m + tl.log(l), float("-inf"))
    tl.store(lse_ptr + head.to(tl.int64) * num_tokens + tok, lse, mask=row_ok)


def tree_token_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    tree_bias: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every tree node over its own request's tree tokens.

    ``query`` [R*N, Hq, D], ``key``/``value`` [R*N, Hkv, D]: the tokens of R
    requests of N = B+1 nodes each, request-major (a uniform verification
    batch). ``tree_bias`` [>= R, N, N] float32 (0 / -inf, from
    ``write_tree_attn_bias``). Returns ``(out [R*N, Hq, D], lse [Hq, R*N])``
    with lse the natural-log-sum-exp of the scaled, biased scores, the layout
    ``merge_attn_states`` takes.
    """
    if query.ndim != 3 or key.ndim != 3 or value.shape != key.shape:
        raise ValueError("query must be [T, Hq, D] and key/value [T, Hkv, D]")
    num_tokens, num_q_heads, head_size = query.shape
    if key.shape[0] != num_tokens or key.shape[2] != head_size:
        raise ValueError(f"key {tuple(key.shape)} does not match query {tuple(query.shape)}")
    if num_q_heads % key.shape[1]:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {key.shape[1]} KV heads")
    if tree_bias.ndim != 3 or tree_bias.shape[1] != tree_bias.shape[2]:
        raise ValueError(f"tree_bias must be [R, N, N], got {tuple(tree_bias.shape)}")
    if tree_bias.dtype != torch.float32 or not tree_bias.is_contiguous():
        raise ValueError("tree_bias must be a contiguous float32 tensor")
    n = tree_bias.shape[1]
    if num_tokens % n:
        raise ValueError(f"{num_tokens} tokens are not a whole number of {n}-node trees")
    num_reqs = num_tokens // n
    if num_reqs > tree_bias.shape[0]:
        raise ValueError(f"{num_reqs} trees but tree_bias has {tree_bias.shape[0]} rows")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.stride(2) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    out = torch.empty_like(query)
    lse = torch.empty(num_q_heads, num_tokens, dtype=torch.float32, device=query.device)
    if num_reqs == 0:
        return out, lse
    _tree_token_attention_kernel[(num_reqs, num_q_heads)](
        out, lse, query, key, value, tree_bias, scale, n, num_tokens,
        query.stride(0), query.stride(1),
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        out.stride(0), out.stride(1),
        QUERIES_PER_KV=num_q_heads // key.shape[1],
        HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=triton.next_power_of_2(head_size),
        N_PADDED=max(16, triton.next_power_of_2(n)),
    )
    return out, lse


def merge_by_lse(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Torch twin of vLLM's ``merge_attn_states``: combine two partial
    attentions over disjoint key sets. ``out_*`` [T, H, D], ``lse_*`` [H, T];
    a side with lse = -inf (no keys) contributes nothing."""
    lse_a = lse_a.transpose(0, 1).float()[..., None]
    lse_b = lse_b.transpose(0, 1).float()[..., None]
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    merged = (out_a.float() * wa + out_b.float() * wb) / (wa + wb)
    return merged.to(out_a.dtype)
