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

All layers at once. :func:`compact_accepted_path_` does the whole post-walk compaction
(hidden-state rows and the KV of every layer) in ONE Triton launch, computing the moves
from ``accepted_nodes`` / ``num_accepted`` / ``query_start_loc`` / ``slot_mapping`` in
the kernel. The layers' caches are separate allocations of one shape/stride/dtype; a
:class:`KVPointerTable` (build once, reuse) holds each layer's element offset from the
lowest-addressed layer, and the kernel addresses layer l as ``base + offset[l] + ...``.
One program handles one (request, layer or hidden states, chunk of the row): it loads
every source of the request, synchronises, then stores, as above.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from ._triton import can_use_triton, jit, launcher, next_power_of_2, tl, varying_args

__all__ = [
    "KV_LAYOUTS",
    "KVPointerTable",
    "accepted_path_moves",
    "accepted_slot_moves",
    "build_kv_ptr_table",
    "compact_accepted_path_",
    "compact_accepted_path_torch_",
    "compact_kv_cache_",
    "compact_kv_cache_torch_",
    "compact_rows_",
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


def compact_kv_cache_torch_(
    kv_cache: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    layout: Layout = "vllm",
) -> torch.Tensor:
    """The unfused path (``VLLM_DDTREE_FUSED_KERNELS=0``, or no CUDA): gather all
    sources, then scatter, with plain torch indexing.

    Skips moves with a negative slot (a host sync). Returns
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


# Elements one program moves per chunk (BLOCK_M moves x BLOCK_E elements), held in
# registers across the barrier between the reads and the writes, and the widest chunk
# of a row. 4096 elements spilled under Triton 3.8 at 64 moves, and a 1024-wide row
# chunk (2 moves) spilled 16 bytes (tests/unit/test_kernels_compile.py); 2048 and 512
# do not, under Triton 3.6 or 3.8.
TILE_ELEMENTS = 2048
MAX_TILE_WIDTH = 512


def tile_width(block_m: int, widest: int) -> int:
    """BLOCK_E for ``block_m`` moves a program over rows of ``widest`` elements."""
    return max(16, min(next_power_of_2(widest), TILE_ELEMENTS // block_m, MAX_TILE_WIDTH))


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
        backend: ``"triton"``, ``"torch"`` (the unfused path; syncs) or ``"auto"``.
    Returns:
        ``kv_cache``.
    """
    block_dim, token_dim = _resolve_layout(kv_cache, layout)
    _check_moves(src_slots, dst_slots, kv_cache.device)
    src2, dst2 = _group_moves(src_slots, dst_slots, moves_per_group)
    if backend == "auto":
        backend = "triton" if can_use_triton(kv_cache) else "torch"
    if backend == "torch":
        return compact_kv_cache_torch_(kv_cache, src2, dst2, (block_dim, token_dim))
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
    block_e = tile_width(block_m, inner)
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


# --------------------------------------------------------------------------------------
# Whole accepted-path compaction: hidden states + every layer's KV in one launch.
# --------------------------------------------------------------------------------------


def accepted_path_moves(
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
    query_start_loc: torch.Tensor,
    slot_mapping: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The moves of :meth:`TreeVerifier.compact` (vllm_ddtree.tree_verifier), in torch.

    For request r with path ``0 = i_0 < ... < i_k`` (``k = num_accepted[r]``) and
    ``start = query_start_loc[r]``, column j <= k moves row ``start + i_j`` to row
    ``start + j`` (slot ``slot_mapping[start + i_j]`` to ``slot_mapping[start + j]``).

    Returns ``(src_rows, dst_rows, src_slots, dst_slots)``, each [R * (D+1)] int64
    request-major; entries that are not a move (off the path, padding, src == dst) are
    -1 in all four. Slots are None without ``slot_mapping``. No host synchronisation.
    """
    num_reqs, width = accepted_nodes.shape
    acc = accepted_nodes.long()
    start = query_start_loc[:num_reqs].long()[:, None]
    j = torch.arange(width, device=acc.device)[None, :]
    on_path = (acc >= 0) & (j <= num_accepted[:num_reqs].long()[:, None])
    src_rows = torch.where(on_path, start + acc, -1).flatten()
    dst_rows = torch.where(on_path, start + j, -1).flatten()
    moves = on_path.flatten() & (src_rows != dst_rows)
    src_rows = torch.where(moves, src_rows, -1)
    dst_rows = torch.where(moves, dst_rows, -1)
    if slot_mapping is None:
        return src_rows, dst_rows, None, None
    slots = slot_mapping.long()
    src_slots = torch.where(moves, slots[src_rows.clamp(min=0)], -1)
    dst_slots = torch.where(moves, slots[dst_rows.clamp(min=0)], -1)
    return src_rows, dst_rows, src_slots, dst_slots


class KVPointerTable:
    """The layers' KV caches addressed from one base pointer (built by
    :func:`build_kv_ptr_table`; build once and pass back on every call).

    Attributes:
        base: the lowest-addressed layer's cache, viewed with the widest integer word
            that keeps every stride and every layer offset whole (the kernel's pointer).
        offsets: [L] int64 on the caches' device, ``offsets[l]`` = element offset (in
            ``base``'s dtype) of layer l's first element from ``base``'s; all >= 0.
        data_ptrs: the layers' ``data_ptr()`` at build time (checked on every call).
        block_dim, token_dim, sizes, strides: the kernel's addressing (of ``base``).
    """

    def __init__(self, kv_caches: Sequence[torch.Tensor], layout: Layout = "vllm",
                 layer_names: Optional[Sequence[str]] = None):
        caches = list(kv_caches)
        if not caches:
            raise ValueError("KVPointerTable needs at least one KV cache")
        names = list(layer_names) if layer_names is not None else [f"layer {i}" for i in range(len(caches))]
        if len(names) != len(caches):
            raise ValueError(f"{len(names)} layer names for {len(caches)} KV caches")
        first = caches[0]
        block_dim, token_dim = _resolve_layout(first, layout)
        for name, t in zip(names, caches):
            if (t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype
                    or t.device != first.device):
                raise ValueError(
                    f"KV cache of {name} differs from {names[0]}'s: shape {tuple(t.shape)} / stride "
                    f"{t.stride()} / {t.dtype} / {t.device} vs {tuple(first.shape)} / {first.stride()} "
                    f"/ {first.dtype} / {first.device}"
                )
        ptrs = [t.data_ptr() for t in caches]
        lo = min(range(len(caches)), key=ptrs.__getitem__)
        esize = first.element_size()
        for name, p in zip(names, ptrs):
            if (p - ptrs[lo]) % esize:
                raise ValueError(
                    f"KV cache of {name} starts {p - ptrs[lo]} bytes from {names[lo]}'s, not a "
                    f"multiple of the element size {esize}; it cannot share a base pointer"
                )
        base = _widest_view(caches[lo], (block_dim, token_dim))
        wsize = base.element_size()
        if any((p - ptrs[lo]) % wsize for p in ptrs):
            base, wsize = caches[lo], esize
        self.layout = layout
        self.block_dim, self.token_dim = block_dim, token_dim
        self.base = base
        self.num_layers = len(caches)
        self.data_ptrs = tuple(ptrs)
        self.shape, self.stride, self.dtype = tuple(first.shape), first.stride(), first.dtype
        self.device = first.device
        self.offsets = torch.tensor([(p - ptrs[lo]) // wsize for p in ptrs], dtype=torch.int64,
                                    device=first.device)
        rest = [d for d in range(base.dim()) if d not in (block_dim, token_dim)]
        if len(rest) > 3:
            raise ValueError(f"at most 3 dims besides block and token, got shape {tuple(base.shape)}")
        sizes = [base.shape[d] for d in rest]
        strides = [base.stride(d) for d in rest]
        while len(sizes) < 3:
            sizes.insert(0, 1)
            strides.insert(0, 0)
        self.sizes, self.strides = tuple(sizes), tuple(strides)
        self.inner = sizes[0] * sizes[1] * sizes[2]
        self.block_size = base.shape[token_dim]
        self.stride_block = base.stride(block_dim)
        self.stride_token = base.stride(token_dim)

    def matches(self, kv_caches: Sequence[torch.Tensor]) -> bool:
        """Whether ``kv_caches`` are still the tensors this table was built for."""
        if len(kv_caches) != self.num_layers:
            return False
        for t, p in zip(kv_caches, self.data_ptrs):
            if t.data_ptr() != p or tuple(t.shape) != self.shape or t.stride() != self.stride:
                return False
        return True


def build_kv_ptr_table(kv_caches: Sequence[torch.Tensor], layout: Layout = "vllm",
                       layer_names: Optional[Sequence[str]] = None) -> KVPointerTable:
    """Build the :class:`KVPointerTable` of ``kv_caches`` (one small H2D copy; do it
    once, e.g. when the caches are first resolved, and pass it as ``kv_ptr_table``).
    Raises ValueError naming the layer whose cache has another shape/stride/dtype or
    whose address is not a whole number of elements away from the others."""
    return KVPointerTable(kv_caches, layout, layer_names)


@varying_args("num_slots", "num_hid_rows")
def _compact_path_kernel(
    kv_ptr,  # lowest-addressed layer's cache (widened word view)
    kv_off_ptr,  # [L] int64 element offsets of the layers from kv_ptr
    hid_ptr,  # [T, ...] hidden states (widened word view)
    acc_ptr,  # [R, D+1] accepted nodes, -1 padded
    acc_stride,
    num_acc_ptr,  # [R]
    qsl_ptr,  # [>= R] query_start_loc
    slot_ptr,  # [T] slot mapping
    num_slots,  # slot_mapping.numel(): rows past it are never read
    num_hid_rows,
    width,  # D + 1
    num_layers,
    kv_chunks,  # programs per (request, layer)
    block_size,
    stride_block,
    stride_token,
    size1,
    size2,
    stride0,
    stride1,
    stride2,
    kv_inner,
    hid_row_stride,
    hid_inner,
    pos_ptr,  # [T] positions, or a dummy (HAS_POS False)
    pos_pid,  # the program (axis 1) that restores the request's positions
    HAS_KV: tl.constexpr,
    HAS_HIDDEN: tl.constexpr,
    HAS_POS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    pid = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    m_ok = m < width
    node = tl.load(acc_ptr + req * acc_stride + m, mask=m_ok, other=-1).to(tl.int64)
    k = tl.load(num_acc_ptr + req).to(tl.int64)
    start = tl.load(qsl_ptr + req).to(tl.int64)
    src_row = start + node
    dst_row = start + m.to(tl.int64)
    move = m_ok & (node >= 0) & (m.to(tl.int64) <= k) & (src_row != dst_row)
    e_base = tl.arange(0, BLOCK_E)
    num_kv = num_layers * kv_chunks
    if HAS_KV:
        if pid < num_kv:
            layer = pid // kv_chunks
            chunk = pid % kv_chunks
            row_ok = move & (src_row < num_slots) & (dst_row < num_slots)
            src = tl.load(slot_ptr + src_row, mask=row_ok, other=-1).to(tl.int64)
            dst = tl.load(slot_ptr + dst_row, mask=row_ok, other=-1).to(tl.int64)
            kv_move = row_ok & (src >= 0) & (dst >= 0) & (src != dst)
            layer_ptr = kv_ptr + tl.load(kv_off_ptr + layer)
            # Same slot and element addressing as _compact_kv_kernel, written out again:
            # a shared helper would have to be a @triton.jit function for the compiler
            # and a plain one for the interpreter our CPU tests run (Triton refuses a
            # jitted helper inside an interpreted kernel, and a plain one when compiling).
            src_off = (src // block_size) * stride_block + (src % block_size) * stride_token
            dst_off = (dst // block_size) * stride_block + (dst % block_size) * stride_token
            e = chunk * BLOCK_E + e_base
            e_ok = e < kv_inner
            i2 = e % size2
            i1 = (e // size2) % size1
            i0 = e // (size2 * size1)
            e_off = i0.to(tl.int64) * stride0 + i1.to(tl.int64) * stride1 + i2.to(tl.int64) * stride2
            mask = kv_move[:, None] & e_ok[None, :]
            vals = tl.load(layer_ptr + src_off[:, None] + e_off[None, :], mask=mask)
            # Every source of this request must be read before any destination is written.
            tl.debug_barrier()
            tl.store(layer_ptr + dst_off[:, None] + e_off[None, :], vals, mask=mask)
    if HAS_HIDDEN:
        if pid >= num_kv:
            e = (pid - num_kv) * BLOCK_E + e_base
            e_ok = e < hid_inner
            h_move = move & (src_row < num_hid_rows) & (dst_row < num_hid_rows)
            mask = h_move[:, None] & e_ok[None, :]
            vals = tl.load(hid_ptr + src_row[:, None] * hid_row_stride + e[None, :], mask=mask)
            tl.debug_barrier()
            tl.store(hid_ptr + dst_row[:, None] * hid_row_stride + e[None, :], vals, mask=mask)
    if HAS_POS:
        if pid == pos_pid:
            # A request's query rows hold consecutive positions from its first row.
            qlen = tl.load(qsl_ptr + req + 1).to(tl.int64) - start
            p0 = tl.load(pos_ptr + start)
            for i0 in range(1, qlen, BLOCK_E):
                i = i0 + e_base.to(tl.int64)
                tl.store(pos_ptr + start + i, p0 + i, mask=i < qlen)


def _hidden_rows_view(hidden_states: torch.Tensor) -> torch.Tensor:
    """[T, inner] view of hidden states whose rows are contiguous, in the widest word."""
    t = hidden_states
    if t.dim() == 1:
        t = t[:, None]
    if t.dim() > 2:
        if not t[0].is_contiguous():
            raise ValueError("hidden_states rows (all dims but the first) must be contiguous")
        t = t.reshape(t.shape[0], -1) if t.shape[0] else t.reshape(0, max(1, t[0].numel()))
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError("hidden_states rows must be contiguous")
    if t.shape[1] == 1 and t.stride(1) != 1:
        t = t.as_strided(t.shape, (t.stride(0), 1))
    return _widest_view(t, (0,))


def compact_accepted_path_torch_(
    kv_caches: Sequence[torch.Tensor],
    hidden_states: Optional[torch.Tensor],
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
    query_start_loc: torch.Tensor,
    slot_mapping: Optional[torch.Tensor],
    *,
    layout: Layout = "vllm",
    positions: Optional[torch.Tensor] = None,
) -> None:
    """The torch path of :func:`compact_accepted_path_` (no CUDA): the per-layer
    path of ``TreeVerifier.compact`` (hidden states gathered then scattered, then
    :func:`compact_kv_cache_torch_` per layer, which syncs the host)."""
    src_rows, dst_rows, src_slots, dst_slots = accepted_path_moves(
        accepted_nodes, num_accepted, query_start_loc, slot_mapping if kv_caches else None
    )
    if hidden_states is not None:
        # Non-moves copy row 0 onto itself; no move targets row 0 (the root stays).
        safe_src = src_rows.clamp(min=0)
        safe_dst = dst_rows.clamp(min=0)
        hidden_states[safe_dst] = hidden_states[safe_src]
    for kv_cache in kv_caches:
        compact_kv_cache_torch_(kv_cache, src_slots, dst_slots, layout)
    if positions is not None:
        restore_linear_positions_torch_(positions, query_start_loc, accepted_nodes.shape[0])


def restore_linear_positions_torch_(positions: torch.Tensor, query_start_loc: torch.Tensor,
                                        num_reqs: int) -> None:
    """Row ``qsl[r] + i`` gets position ``positions[qsl[r]] + i`` for every request r < R
    (i.e. the linear positions, undoing the tree's ``start + depth``)."""
    qsl = query_start_loc.cpu().tolist()
    for r in range(num_reqs):
        a, b = qsl[r], qsl[r + 1]
        if b - a > 1:
            positions[a + 1:b] = positions[a] + torch.arange(1, b - a, device=positions.device,
                                                             dtype=positions.dtype)


def compact_accepted_path_(
    kv_caches: Sequence[torch.Tensor],
    hidden_states: Optional[torch.Tensor],
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
    query_start_loc: torch.Tensor,
    slot_mapping: Optional[torch.Tensor],
    *,
    layout: Layout = "vllm",
    kv_ptr_table: Optional[KVPointerTable] = None,
    backend: str = "auto",
    positions: Optional[torch.Tensor] = None,
    check_table: bool = True,
) -> Optional[KVPointerTable]:
    """Compact the accepted paths in hidden states and every layer's KV, in place.

    For request r with path ``0 = i_0 < ... < i_k`` (``k = num_accepted[r]``) and
    ``start = query_start_loc[r]``, for j = 1..k: row ``start + i_j`` -> ``start + j`` of
    ``hidden_states`` and KV slot ``slot_mapping[start + i_j]`` ->
    ``slot_mapping[start + j]`` of every layer (gather-then-scatter per request; moves
    with src == dst or a negative slot are skipped). Same result as
    :meth:`TreeVerifier.compact` minus the positions restore.

    Triton backend: ONE launch for everything, grid ``(R, L * kv_chunks + hid_chunks)``,
    no host sync, fixed shapes (CUDA-graph capturable as long as the caches, the table
    and the inputs keep their addresses).

    Args:
        kv_caches: the layers' caches (same shape/stride/dtype; see :data:`KV_LAYOUTS`),
            may be empty.
        hidden_states: [T, ...] rows indexed like ``slot_mapping``, or None.
        accepted_nodes: [R, D+1] int, -1 padded (rows may be strided).
        num_accepted: [R] int. query_start_loc: [>= R] int. slot_mapping: [T] int.
        kv_ptr_table: the :class:`KVPointerTable` returned by a previous call (or by
            :func:`build_kv_ptr_table`); built here when None or stale (the caches moved).
        backend: ``"triton"``, ``"torch"`` (the unfused path; syncs) or ``"auto"``.
        positions: [T] int, optional: also restore every request's linear positions
            (row ``qsl[r] + i`` gets ``positions[qsl[r]] + i``; ``query_start_loc`` then
            needs R + 1 entries), in the same launch.
        check_table: check that ``kv_ptr_table`` still matches ``kv_caches`` (one
            pointer/shape comparison per layer). A caller that built the table from
            these very tensors may skip it.
    Returns:
        The pointer table used (None with no KV caches or the torch backend): keep it
        and pass it back as ``kv_ptr_table``.
    """
    kv_caches = list(kv_caches)
    if accepted_nodes.dim() != 2:
        raise ValueError(f"accepted_nodes must be [R, D+1], got {tuple(accepted_nodes.shape)}")
    num_reqs, width = accepted_nodes.shape
    if num_accepted.shape[0] < num_reqs or query_start_loc.shape[0] < num_reqs:
        raise ValueError(
            f"num_accepted ({tuple(num_accepted.shape)}) and query_start_loc "
            f"({tuple(query_start_loc.shape)}) need at least R={num_reqs} entries"
        )
    if kv_caches and slot_mapping is None:
        raise ValueError("KV compaction needs slot_mapping")
    tensors = [accepted_nodes, num_accepted, query_start_loc]
    tensors += [t for t in (hidden_states, slot_mapping) if t is not None] + kv_caches[:1]
    for t in tensors[:3] + ([slot_mapping] if slot_mapping is not None else []):
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise TypeError("accepted_nodes, num_accepted, query_start_loc and slot_mapping must be integer tensors")
    if positions is not None:
        if query_start_loc.shape[0] < num_reqs + 1:
            raise ValueError(f"restoring positions needs R+1={num_reqs + 1} query_start_loc entries, "
                             f"got {query_start_loc.shape[0]}")
        if positions.dim() != 1 or positions.dtype.is_floating_point or positions.stride(0) != 1:
            raise ValueError("positions must be a contiguous 1-D integer tensor")
        tensors.append(positions)
    device = accepted_nodes.device
    if any(t.device != device for t in tensors):
        raise ValueError("all tensors must be on one device")
    if backend == "auto":
        backend = "triton" if can_use_triton(*tensors) else "torch"
    if backend == "torch":
        compact_accepted_path_torch_(kv_caches, hidden_states, accepted_nodes, num_accepted,
                                         query_start_loc, slot_mapping, layout=layout,
                                         positions=positions)
        return None
    if backend != "triton":
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if not can_use_triton(*tensors):
        raise RuntimeError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")

    if accepted_nodes.stride(1) != 1:
        accepted_nodes = accepted_nodes.contiguous()
    num_accepted = num_accepted.contiguous()
    query_start_loc = query_start_loc.contiguous()
    if slot_mapping is not None:
        slot_mapping = slot_mapping.contiguous()
    table = None
    if kv_caches:
        table = kv_ptr_table
        if table is None or table.layout != layout or (check_table and not table.matches(kv_caches)):
            table = KVPointerTable(kv_caches, layout)
    hid = _hidden_rows_view(hidden_states) if hidden_states is not None else None
    has_kv = table is not None and table.inner > 0
    has_hid = hid is not None and hid.shape[1] > 0 and hid.shape[0] > 0
    has_pos = positions is not None and positions.numel() > 0
    if num_reqs == 0 or width == 0 or not (has_kv or has_hid or has_pos):
        return table

    block_m = next_power_of_2(width)
    widest = max(table.inner if has_kv else 1, hid.shape[1] if has_hid else 1)
    block_e = tile_width(block_m, widest)
    kv_chunks = (table.inner + block_e - 1) // block_e if has_kv else 0
    num_layers = table.num_layers if has_kv else 0
    hid_chunks = (hid.shape[1] + block_e - 1) // block_e if has_hid else 0
    pos_pid = num_layers * kv_chunks + hid_chunks
    grid = (num_reqs, pos_pid + (1 if has_pos else 0))
    if grid[1] > 65535:
        raise ValueError(f"too many programs per request ({grid[1]}) for one launch")
    dummy = accepted_nodes  # stands in for an absent tensor (never dereferenced)
    sizes = table.sizes if has_kv else (1, 1, 1)
    strides = table.strides if has_kv else (0, 0, 0)
    launcher(_compact_path_kernel)[grid](
        table.base if has_kv else dummy,
        table.offsets if has_kv else dummy,
        hid if has_hid else dummy,
        accepted_nodes,
        accepted_nodes.stride(0),
        num_accepted,
        query_start_loc,
        slot_mapping if slot_mapping is not None else dummy,
        slot_mapping.numel() if slot_mapping is not None else 0,
        hid.shape[0] if has_hid else 0,
        width,
        num_layers,
        kv_chunks,
        table.block_size if has_kv else 1,
        table.stride_block if has_kv else 0,
        table.stride_token if has_kv else 0,
        sizes[1],
        sizes[2],
        strides[0],
        strides[1],
        strides[2],
        table.inner if has_kv else 0,
        hid.stride(0) if has_hid else 0,
        hid.shape[1] if has_hid else 0,
        positions if has_pos else dummy,
        pos_pid,
        HAS_KV=has_kv,
        HAS_HIDDEN=has_hid,
        HAS_POS=has_pos,
        BLOCK_M=block_m,
        BLOCK_E=block_e,
    )
    return table
