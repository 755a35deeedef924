"""Keep only the accepted path's KV cache entries and hidden-state rows.

During verification tree node ``i`` of request r is written at the KV slot of the
*linear* position ``start + i`` (``tree_slots[r, i]``), while the model sees position
``start + depth``. After the walk the accepted path 0 = i_0 < i_1 < ... < i_k must
end up where a plain sequence would have it: node ``i_j`` at slot ``tree_slots[r, j]``.
Everything past ``start + k`` is simply overwritten by the next step.

Safety of the copies. Moves of one request are ``tree_slots[i_j] -> tree_slots[j]``
with ``i_j >= j`` and i_j strictly increasing:

* applied one by one in increasing j, move j reads slot ``i_j``, which no earlier move
  wrote (earlier moves wrote slots j' < j <= i_j), so an in-order copy is correct;
* "gather all sources, then scatter" is correct as well (nothing is read after a
  write). A fully parallel copy is *not*: move j may write slot j while move j' < j
  still has to read it (i_j' = j). The Triton kernel below therefore handles all moves
  of a request in one program: it loads every source row, synchronises the program,
  then stores.

Padding moves (past the accepted path) and identity moves (i_j == j, e.g. the root)
have ``src == dst`` and are skipped by the kernel; negative slots (vLLM's
``PAD_SLOT_ID = -1``, e.g. CUDA-graph padding requests) are skipped too.

KV cache layouts (vLLM 0.26 on CUDA). FLASH_ATTN and TRITON_ATTN both declare the
logical shape ``(num_blocks, num_kv_heads, block_size, 2 * head_size)`` (K and V packed
in the last dim; fp8 per-token-head scales, when used, live inside that padded last
dim) and allocate it with stride order NHD = physical
``(num_blocks, block_size, num_kv_heads, 2 * head_size)`` or HND = the logical order.
The layer receives the logical-shaped, permuted view, so the block dim is 0 and the
in-block token dim is 2 (layout ``"vllm"``), whatever the stride order. Older vLLM
layouts are accepted by name too (``"kv_first"``: ``(2, num_blocks, block_size,
num_kv_heads, head_size)``; ``"blocks_first"``: ``(num_blocks, 2, block_size, ...)``),
or any layout via an explicit ``(block_dim, token_dim)`` pair. Slot s lives at block
``s // block_size``, offset ``s % block_size``; every other dim is copied whole.
"""

from __future__ import annotations

from typing import Union

import torch

from ._triton import can_use_triton, jit, next_power_of_2, tl

__all__ = [
    "KV_LAYOUTS",
    "accepted_slot_moves",
    "compact_kv_cache_",
    "compact_kv_cache_reference_",
    "compact_rows_",
    "compact_rows_reference_",
]

# name -> (block_dim, token_dim) of the tensor the attention layer holds.
KV_LAYOUTS: dict[str, tuple[int, int]] = {
    "vllm": (0, 2),  # vLLM 0.26 FLASH_ATTN / TRITON_ATTN: (nb, H, bs, 2*hs) view
    "flash_attn": (0, 2),
    "triton_attn": (0, 2),
    "kv_first": (1, 2),  # (2, nb, bs, H, hs)
    "blocks_first": (0, 2),  # (nb, 2, bs, H, hs)
}

Layout = Union[str, tuple[int, int]]


def accepted_slot_moves(
    accepted_nodes: torch.Tensor, tree_slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Source and destination slots (or rows) that compact each accepted path.

    Args:
        accepted_nodes: [R, D+1] int, the walk's path (root 0 first, -1 padded).
        tree_slots: [R, B+1] int, ``tree_slots[r, i]`` = KV slot (or flat row index)
            written by tree node i of request r, i.e. the slot of linear position
            ``start_r + i``.
    Returns:
        ``(src, dst)``, each [R * (D+1)] int64, request-major: entry ``r*(D+1) + j``
        moves ``tree_slots[r, i_j]`` to ``tree_slots[r, j]``. Padding entries (no
        accepted node at depth j) are the no-op ``tree_slots[r, 0] -> tree_slots[r, 0]``.
        No host synchronisation.
    """
    if accepted_nodes.dim() != 2 or tree_slots.dim() != 2:
        raise ValueError(
            "accepted_nodes must be [R, D+1] and tree_slots [R, B+1], got "
            f"{tuple(accepted_nodes.shape)} and {tuple(tree_slots.shape)}"
        )
    if accepted_nodes.shape[0] != tree_slots.shape[0]:
        raise ValueError(
            f"batch mismatch: accepted_nodes has {accepted_nodes.shape[0]} requests, "
            f"tree_slots {tree_slots.shape[0]}"
        )
    if accepted_nodes.device != tree_slots.device:
        raise ValueError("accepted_nodes and tree_slots must be on the same device")
    num_req, width = accepted_nodes.shape
    n = tree_slots.shape[1]
    if width < 1 or n < 1:
        raise ValueError("need at least the root column in accepted_nodes and tree_slots")
    slots = tree_slots.long()
    nodes = accepted_nodes.long()
    present = nodes >= 0
    src = slots.gather(1, nodes.clamp(min=0, max=n - 1))
    cols = torch.arange(width, device=slots.device).clamp(max=n - 1)
    dst = slots.gather(1, cols.expand(num_req, width))
    root = slots[:, :1]
    src = torch.where(present, src, root)
    dst = torch.where(present, dst, root)
    return src.reshape(-1), dst.reshape(-1)


def _resolve_layout(kv_cache: torch.Tensor, layout: Layout) -> tuple[int, int]:
    if isinstance(layout, str):
        if layout not in KV_LAYOUTS:
            raise ValueError(f"unknown KV layout {layout!r}; known: {sorted(KV_LAYOUTS)}")
        block_dim, token_dim = KV_LAYOUTS[layout]
    else:
        block_dim, token_dim = layout
    nd = kv_cache.dim()
    if not (0 <= block_dim < nd and 0 <= token_dim < nd) or block_dim == token_dim:
        raise ValueError(
            f"layout dims (block_dim={block_dim}, token_dim={token_dim}) do not fit a "
            f"{nd}-d KV cache of shape {tuple(kv_cache.shape)}"
        )
    return block_dim, token_dim


def _check_moves(src: torch.Tensor, dst: torch.Tensor, device: torch.device) -> None:
    if src.shape != dst.shape:
        raise ValueError(f"src and dst must match in shape, got {tuple(src.shape)} and {tuple(dst.shape)}")
    if src.dtype.is_floating_point or dst.dtype.is_floating_point:
        raise TypeError("src/dst slots must be integer tensors")
    if src.device != device or dst.device != device:
        raise ValueError(f"src/dst must be on the cache's device {device}")


def _group_moves(src: torch.Tensor, dst: torch.Tensor, moves_per_group: int | None):
    """[G, M] views of the moves; moves of different groups must touch disjoint slots.

    Each Triton program holds a whole group in registers, so M should be small
    (D + 1 <= 64 or so); the reference path accepts any grouping."""
    if src.dim() == 2:
        if moves_per_group is not None and moves_per_group != src.shape[1]:
            raise ValueError("moves_per_group disagrees with the 2-D src/dst shape")
        return src, dst
    if src.dim() != 1:
        raise ValueError(f"src/dst must be 1-D or 2-D, got {tuple(src.shape)}")
    total = src.shape[0]
    if moves_per_group is None:
        raise ValueError(
            "1-D src/dst need moves_per_group (D + 1 for accepted_slot_moves output), or "
            "pass [G, M] tensors; one program copies one group, so groups must stay small"
        )
    m = moves_per_group
    if m < 1 or total % m:
        raise ValueError(f"moves_per_group={moves_per_group} must divide the {total} moves")
    return src.reshape(-1, m), dst.reshape(-1, m)


def compact_kv_cache_reference_(
    kv_cache: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    layout: Layout = "vllm",
) -> torch.Tensor:
    """Reference: gather all sources, then scatter, with plain torch indexing.

    Skips moves with a negative slot (host sync: this is the reference). Returns
    ``kv_cache`` (modified in place).
    """
    block_dim, token_dim = _resolve_layout(kv_cache, layout)
    _check_moves(src_slots, dst_slots, kv_cache.device)
    bs = kv_cache.shape[token_dim]
    src = src_slots.reshape(-1).long()
    dst = dst_slots.reshape(-1).long()
    keep = (src >= 0) & (dst >= 0)
    src, dst = src[keep], dst[keep]
    view = kv_cache.movedim((block_dim, token_dim), (0, 1))
    values = view[src // bs, src % bs].clone()
    view[dst // bs, dst % bs] = values
    return kv_cache


def _compact_kv_kernel(
    kv_ptr,
    src_ptr,  # [G, M] int
    dst_ptr,  # [G, M] int
    num_moves,  # M
    block_size,
    stride_block,
    stride_token,
    size1,
    size2,
    stride0,
    stride1,
    stride2,
    inner_numel,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    group = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    m_ok = m < num_moves
    src = tl.load(src_ptr + group * num_moves + m, mask=m_ok, other=-1).to(tl.int64)
    dst = tl.load(dst_ptr + group * num_moves + m, mask=m_ok, other=-1).to(tl.int64)
    move = m_ok & (src >= 0) & (dst >= 0) & (src != dst)
    src_off = (src // block_size) * stride_block + (src % block_size) * stride_token
    dst_off = (dst // block_size) * stride_block + (dst % block_size) * stride_token

    e = chunk * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < inner_numel
    i2 = e % size2
    i1 = (e // size2) % size1
    i0 = e // (size2 * size1)
    e_off = i0.to(tl.int64) * stride0 + i1.to(tl.int64) * stride1 + i2.to(tl.int64) * stride2

    mask = move[:, None] & e_ok[None, :]
    vals = tl.load(kv_ptr + src_off[:, None] + e_off[None, :], mask=mask)
    # Every source of this request must be read before any destination is written.
    tl.debug_barrier()
    tl.store(kv_ptr + dst_off[:, None] + e_off[None, :], vals, mask=mask)


def _widest_view(kv_cache: torch.Tensor, dims: tuple[int, int]) -> torch.Tensor:
    """The same bytes viewed with the widest integer element (<= 8 bytes) that keeps
    every stride whole, so fp8/bf16 caches are copied in larger words. Only when the
    last dim is a copied (contiguous) dim."""
    last = kv_cache.dim() - 1
    if last in dims or kv_cache.stride(last) != 1:
        return kv_cache
    size = kv_cache.element_size()
    for word in (torch.int64, torch.int32, torch.int16):
        wsize = torch.empty((), dtype=word).element_size()
        if wsize <= size or (kv_cache.shape[last] * size) % wsize:
            continue
        if any((kv_cache.stride(d) * size) % wsize for d in range(last)):
            continue
        if (kv_cache.storage_offset() * size) % wsize:
            continue
        try:
            return kv_cache.view(word)
        except RuntimeError:
            continue
    return kv_cache


def compact_kv_cache_(
    kv_cache: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    layout: Layout = "vllm",
    *,
    moves_per_group: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Move KV entries ``src_slots -> dst_slots`` in place (one attention layer).

    Semantics: gather every source, then scatter (see the module docstring); moves
    with ``src == dst`` or a negative slot do nothing.

    Args:
        kv_cache: one layer's KV cache, any strides; ``layout`` says which dim is the
            block and which the in-block token (see :data:`KV_LAYOUTS`). At most three
            other dims (they are copied whole).
        src_slots, dst_slots: [G, M] or [G*M] int slots. Moves of different groups
            (requests) must touch disjoint slots; within a group any aliasing of one
            move's destination with another's source is fine. For the output of
            :func:`accepted_slot_moves` pass ``moves_per_group=D+1`` (or reshape).
        moves_per_group: M, required for 1-D inputs.
        backend: ``"triton"``, ``"torch"`` (the reference; syncs) or ``"auto"``.
    Returns:
        ``kv_cache``.
    """
    block_dim, token_dim = _resolve_layout(kv_cache, layout)
    _check_moves(src_slots, dst_slots, kv_cache.device)
    src2, dst2 = _group_moves(src_slots, dst_slots, moves_per_group)
    if backend == "auto":
        backend = "triton" if can_use_triton(kv_cache) else "torch"
    if backend == "torch":
        return compact_kv_cache_reference_(kv_cache, src2, dst2, (block_dim, token_dim))
    if backend != "triton":
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if not can_use_triton(kv_cache):
        raise RuntimeError("backend='triton' needs a CUDA cache (or TRITON_INTERPRET=1 on CPU)")

    target = _widest_view(kv_cache, (block_dim, token_dim))
    rest = [d for d in range(target.dim()) if d not in (block_dim, token_dim)]
    if len(rest) > 3:
        raise ValueError(f"at most 3 dims besides block and token, got shape {tuple(target.shape)}")
    sizes = [target.shape[d] for d in rest]
    strides = [target.stride(d) for d in rest]
    while len(sizes) < 3:
        sizes.insert(0, 1)
        strides.insert(0, 0)
    inner = sizes[0] * sizes[1] * sizes[2]
    groups, m = src2.shape
    if groups == 0 or m == 0 or inner == 0:
        return kv_cache
    src2 = src2.contiguous()
    dst2 = dst2.contiguous()
    block_m = next_power_of_2(m)
    block_e = max(16, min(next_power_of_2(inner), max(64, 2048 // block_m)))
    grid = (groups, (inner + block_e - 1) // block_e)
    jit(_compact_kv_kernel)[grid](
        target,
        src2,
        dst2,
        m,
        target.shape[token_dim],
        target.stride(block_dim),
        target.stride(token_dim),
        sizes[1],
        sizes[2],
        strides[0],
        strides[1],
        strides[2],
        inner,
        BLOCK_M=block_m,
        BLOCK_E=block_e,
    )
    return kv_cache


def compact_rows_reference_(
    tensor: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor
) -> torch.Tensor:
    """Loop reference for :func:`compact_rows_` (gather all rows first, then write)."""
    src = src_rows.reshape(-1).tolist()
    dst = dst_rows.reshape(-1).tolist()
    saved = [tensor[s].clone() for s in src]
    for d, v in zip(dst, saved):
        tensor[d] = v
    return tensor


def compact_rows_(tensor: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> torch.Tensor:
    """``tensor[dst_rows] = tensor[src_rows]`` along dim 0, gather-then-scatter, in place.

    For hidden states [T, H], positions [T] etc. Rows must be valid indices in
    ``[0, T)``; a row may appear several times in ``dst_rows`` only with the same
    source row's value (e.g. the padding of :func:`accepted_slot_moves`, which writes
    the root row onto itself). No host synchronisation.

    Args:
        tensor: [T, ...].
        src_rows, dst_rows: any-shaped int tensors of equal shape (flattened).
    Returns:
        ``tensor``.
    """
    _check_moves(src_rows, dst_rows, tensor.device)
    src = src_rows.reshape(-1).long()
    dst = dst_rows.reshape(-1).long()
    tensor.index_copy_(0, dst, tensor.index_select(0, src))
    return tensor
