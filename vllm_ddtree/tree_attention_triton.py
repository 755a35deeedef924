"""Route 2 of docs/tree-attention.md: attention over the committed context (one
non-causal FlashAttention call) merged with attention over this step's tree tokens.

The target's attention for a request that verifies a tree splits into two
disjoint key sets:

* the committed context ``[0, start)``, which every tree node sees in full:
  one non-causal FlashAttention call over the paged cache with ``seqused_k =
  context_lens`` and ``return_softmax_lse=True``;
* the B+1 tree tokens of this step, under causal AND the ancestor mask:
  :func:`merge_tree_suffix_attention`, one Triton program per (request, query
  head) reading the fresh K/V of this forward (no cache), which also merges the
  two parts by log-sum-exp.

:func:`split_tree_attention` sequences the calls for one layer;
:mod:`vllm_ddtree.tree_attention_flash` is the FlashAttention backend's entry.

Imports ``triton`` directly (not ``vllm.triton_utils``), so on a CPU it needs
``TRITON_INTERPRET=1`` set before this module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["check_tree_suffix_inputs", "merge_tree_suffix_attention", "split_tree_attention"]


@triton.jit
def _merge_tree_suffix_kernel(
    out_ptr,  # [T, Hq, D]: written for requests of 1..N query tokens
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [T, Hkv, D]: this forward's fresh K/V
    v_ptr,  # [T, Hkv, D]
    ctx_out_ptr,  # [T, Hq, D]: attention over the committed context
    ctx_lse_ptr,  # [Hq, T] float32
    query_start_loc_ptr,  # [R + 1] int32
    context_lens_ptr,  # [R] int32
    bias_ptr,  # [>= R, N, N] float32, 0 / -inf
    scale,
    N,
    stride_q_t, stride_q_h,
    stride_k_t, stride_k_h,
    stride_v_t, stride_v_h,
    stride_o_t, stride_o_h,
    stride_c_t, stride_c_h,
    stride_lse_h,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    N_PADDED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // QUERIES_PER_KV
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    ctx_len = tl.load(context_lens_ptr + req)
    rows = tl.arange(0, N_PADDED)
    dims = tl.arange(0, HEAD_SIZE_PADDED)
    # Requests with more query tokens than a tree (long prefills) are left alone.
    row_ok = (rows < q_len) & (q_len <= N)
    dim_ok = dims < HEAD_SIZE
    tok = (q_start + rows).to(tl.int64)
    io_mask = row_ok[:, None] & dim_ok[None, :]

    q = tl.load(q_ptr + tok[:, None] * stride_q_t + head * stride_q_h + dims[None, :],
                mask=io_mask, other=0.0)
    k = tl.load(k_ptr + tok[:, None] * stride_k_t + kv_head * stride_k_h + dims[None, :],
                mask=io_mask, other=0.0)
    v = tl.load(v_ptr + tok[:, None] * stride_v_t + kv_head * stride_v_h + dims[None, :],
                mask=io_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(tl.float32) * scale
    # Causal and the tree's ancestor mask (ancestors precede their nodes; rows
    # of requests without a tree are 0, i.e. plain causal).
    pair_ok = row_ok[:, None] & row_ok[None, :] & (rows[:, None] >= rows[None, :])
    bias = tl.load(bias_ptr + req.to(tl.int64) * N * N + rows[:, None] * N + rows[None, :],
                   mask=pair_ok, other=float("-inf"))
    s = tl.where(pair_ok, s + bias, float("-inf"))
    m = tl.max(s, axis=1)
    m = tl.where(m > float("-inf"), m, 0.0)  # padding rows: avoid -inf - -inf
    p = tl.exp(s - m[:, None])
    l_sfx = tl.sum(p, axis=1)
    acc = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION).to(tl.float32)

    # Merge with the context part by log-sum-exp; no context (a first prefill
    # chunk) means the context part's output and LSE are undefined: weight 0.
    has_ctx = ctx_len > 0
    lse_c = tl.load(ctx_lse_ptr + head.to(tl.int64) * stride_lse_h + tok,
                    mask=row_ok & has_ctx, other=float("-inf"))
    lse_c = tl.where(has_ctx, lse_c, float("-inf"))
    o_c = tl.load(ctx_out_ptr + tok[:, None] * stride_c_t + head * stride_c_h + dims[None, :],
                  mask=io_mask & has_ctx, other=0.0).to(tl.float32)
    big = tl.maximum(lse_c, m)
    w_sfx = tl.exp(m - big)
    w_ctx = tl.where(lse_c > float("-inf"), tl.exp(lse_c - big), 0.0)
    denom = l_sfx * w_sfx + w_ctx
    denom = tl.where(denom > 0.0, denom, 1.0)
    merged = (acc * w_sfx[:, None] + o_c * w_ctx[:, None]) / denom[:, None]
    tl.store(out_ptr + tok[:, None] * stride_o_t + head * stride_o_h + dims[None, :],
             merged.to(out_ptr.dtype.element_ty), mask=io_mask)


def merge_tree_suffix_attention(
    output: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    ctx_out: torch.Tensor,
    ctx_lse: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    tree_bias: torch.Tensor,
    scale: float,
    check: bool = True,
) -> None:
    """For every request of 1..N query tokens (N = ``tree_bias.shape[1]``, the tree
    size): attention of its queries over its own fresh K/V under causal AND the
    tree's ancestor mask, merged by log-sum-exp with the attention over its
    committed context (``ctx_out`` [T, Hq, D], ``ctx_lse`` [Hq, T], e.g. a
    non-causal FlashAttention call with ``seqused_k = context_lens``), written into
    ``output`` [T, Hq, D]. Requests with more than N query tokens are not touched.

    ``query_start_loc`` [R + 1] and ``context_lens`` [R] are int32 on the device;
    one program per (request, query head); no host synchronisation. ``check=False``
    skips :func:`check_tree_suffix_inputs` (a caller that checked the same layouts
    before, e.g. once per attention layer)."""
    if check:
        check_tree_suffix_inputs(output, query, key, value, ctx_out, ctx_lse,
                                 query_start_loc, context_lens, tree_bias)
    num_tokens, num_q_heads, head_size = query.shape
    num_reqs = query_start_loc.shape[0] - 1
    if num_reqs <= 0 or num_tokens == 0:
        return
    n = tree_bias.shape[1]
    _merge_tree_suffix_kernel[(num_reqs, num_q_heads)](
        output, query, key, value, ctx_out, ctx_lse, query_start_loc, context_lens,
        tree_bias, scale, n,
        query.stride(0), query.stride(1),
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        output.stride(0), output.stride(1),
        ctx_out.stride(0), ctx_out.stride(1),
        ctx_lse.stride(0),
        QUERIES_PER_KV=num_q_heads // key.shape[1],
        HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=triton.next_power_of_2(head_size),
        N_PADDED=max(16, triton.next_power_of_2(n)),
        # float32 models (the exactness checks) keep float32 products; TF32 would
        # round them to 10 mantissa bits (1e-3 errors on the GPU).
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )


def check_tree_suffix_inputs(
    output: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    ctx_out: torch.Tensor,
    ctx_lse: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    tree_bias: torch.Tensor,
) -> None:
    """The shapes and layouts :func:`merge_tree_suffix_attention` needs; a
    ValueError naming the first one that is wrong."""
    if query.ndim != 3 or key.ndim != 3 or value.shape != key.shape:
        raise ValueError("query must be [T, Hq, D] and key/value [T, Hkv, D]")
    num_tokens, num_q_heads, head_size = query.shape
    if key.shape[0] != num_tokens or key.shape[2] != head_size:
        raise ValueError(f"key {tuple(key.shape)} does not match query {tuple(query.shape)}")
    if num_q_heads % key.shape[1]:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {key.shape[1]} KV heads")
    if output.shape != query.shape or ctx_out.shape != query.shape:
        raise ValueError("output and ctx_out must have the query's shape")
    if ctx_lse.shape != (num_q_heads, num_tokens) or ctx_lse.stride(1) != 1:
        raise ValueError(f"ctx_lse must be [{num_q_heads}, {num_tokens}] with unit token stride")
    if tree_bias.ndim != 3 or tree_bias.shape[1] != tree_bias.shape[2]:
        raise ValueError(f"tree_bias must be [R, N, N], got {tuple(tree_bias.shape)}")
    if tree_bias.dtype != torch.float32 or not tree_bias.is_contiguous():
        raise ValueError("tree_bias must be a contiguous float32 tensor")
    num_reqs = query_start_loc.shape[0] - 1
    if context_lens.shape[0] < num_reqs or tree_bias.shape[0] < num_reqs:
        raise ValueError(f"{num_reqs} requests but context_lens has {context_lens.shape[0]} "
                         f"and tree_bias {tree_bias.shape[0]} rows")
    for name, t in (("query", query), ("key", key), ("value", value), ("output", output),
                    ("ctx_out", ctx_out)):
        if t.stride(2) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")


def split_tree_attention(
    output: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    max_query_len: int,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    tree_bias: torch.Tensor,
    scale: float,
    plain_attention,
    context_attention,
    check: bool = True,
) -> torch.Tensor:
    """Route 2 of docs/tree-attention.md for one layer and one step (``check``: see
    :func:`merge_tree_suffix_attention`).

    ``plain_attention(output)``: the backend's own call (causal over the cache,
    e.g. FlashAttention with ``seqused_k = seq_lens``) into ``output``.
    ``context_attention() -> (out, lse)``: non-causal over each request's first
    ``context_lens`` cached keys, with the log-sum-exp ``[Hq, T]``.

    A step whose requests have one query token each verifies no tree: the plain
    call alone, exactly what the backend does without DDTree. Otherwise requests
    of up to N = tree size tokens (trees, decodes, short prefills) get the context
    call merged with :func:`merge_tree_suffix_attention`; when some request has
    more (a long prefill chunk), the plain call runs first for those rows.
    """
    if max_query_len <= 1:
        plain_attention(output)
        return output
    if max_query_len > tree_bias.shape[1]:
        plain_attention(output)
    ctx_out, ctx_lse = context_attention()
    merge_tree_suffix_attention(output, query, key, value, ctx_out, ctx_lse,
                                query_start_loc, context_lens, tree_bias, scale, check)
    return output
