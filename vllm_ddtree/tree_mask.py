"""Tree attention mask, additive bias and positions for verifying a DDTree.

All B + 1 nodes of a request's tree are verified in one target forward. Node ``i`` may
attend the committed context (the attention backend's business, not this module's)
and, inside the tree, exactly the nodes on its own root path: itself and its
ancestors. Its position is ``start_position + depth`` (the position it would have in
a plain sequence), while its KV slot stays linear (``start + i``).

Padding nodes (``node_valid`` False; parent 0, depth 1) get the row of a depth-1 node
(root + itself). No real node lists them as an ancestor, so they never leak into real
nodes; their outputs are ignored because they are never accepted.

Shapes: ``node_parents`` [R, N] int (root: -1, parent index < child index), N = B + 1.

:func:`rewrite_tree_positions_` rewrites the runner's linear positions of the verified
rows to ``root + depth`` in ONE Triton launch (torch fallback where Triton cannot run).
"""

from __future__ import annotations

import torch

from ._triton import can_use_triton, launcher, tl, varying_args

__all__ = [
    "rewrite_tree_positions_",
    "tree_ancestor_mask",
    "tree_attention_bias",
    "tree_positions",
]


def _check_parents(node_parents: torch.Tensor) -> None:
    if node_parents.dim() != 2:
        raise ValueError(f"node_parents must be [R, N], got {tuple(node_parents.shape)}")
    if node_parents.dtype.is_floating_point or node_parents.dtype == torch.bool:
        raise TypeError(f"node_parents must be an integer tensor, got {node_parents.dtype}")
    if node_parents.shape[1] < 1:
        raise ValueError("a tree needs at least the root node (N >= 1)")


def tree_ancestor_mask(node_parents: torch.Tensor, max_depth: int | None = None) -> torch.Tensor:
    """Vectorised ancestor mask, no host synchronisation.

    ``max_depth`` pointer-jumping steps: after step t every node has marked its
    ancestors up to t levels up.

    Args:
        node_parents: [R, N] int, root -1, ``parent < child``.
        max_depth: a bound on the tree depth (a static int; the drafter's D).
            Defaults to N - 1, always enough.
    Returns:
        [R, N, N] bool on the parents' device; ``mask[r, i, j]`` iff j is i or an
        ancestor of i.
    """
    _check_parents(node_parents)
    num_req, n = node_parents.shape
    if max_depth is None:
        max_depth = n - 1
    if max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")
    dev = node_parents.device
    parents = node_parents.long()
    cols = torch.arange(n, device=dev)
    mask = (cols[:, None] == cols[None, :]).expand(num_req, n, n).clone()
    cur = cols.expand(num_req, n)
    for _ in range(min(max_depth, n - 1)):
        has = cur >= 0
        cur = torch.where(has, parents.gather(1, cur.clamp(min=0)), -1)
        mask |= (cur[:, :, None] == cols[None, None, :]) & (cur >= 0)[:, :, None]
    return mask


def tree_attention_bias(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive attention bias from a boolean mask: 0 where allowed, -inf elsewhere.

    Args:
        mask: [..., N, N] bool (e.g. from :func:`tree_ancestor_mask`).
        dtype: a floating dtype of the attention scores.
    Returns:
        [..., N, N] ``dtype``.
    """
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be bool, got {mask.dtype}")
    if not dtype.is_floating_point:
        raise TypeError(f"bias dtype must be floating point, got {dtype}")
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    neg_inf = torch.full((), float("-inf"), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, neg_inf)


def tree_positions(node_depths: torch.Tensor, start_positions: torch.Tensor) -> torch.Tensor:
    """Positions of tree nodes: ``start_positions[r] + node_depths[r, i]``.

    Args:
        node_depths: [R, N] int (root 0).
        start_positions: [R] int, the position of the root (bonus) token.
    Returns:
        [R, N] int64.
    """
    if node_depths.dim() != 2:
        raise ValueError(f"node_depths must be [R, N], got {tuple(node_depths.shape)}")
    if start_positions.shape != (node_depths.shape[0],):
        raise ValueError(
            f"start_positions must be [R]=({node_depths.shape[0]},), got "
            f"{tuple(start_positions.shape)}"
        )
    return start_positions.long()[:, None] + node_depths.long()


# ----------------------------------------------- in-place rewrite of verified positions

REWRITE_POSITIONS_BLOCK = 512


@varying_args("n")
def _rewrite_positions_kernel(
    pos_ptr,  # [num_tokens] int32/int64, rewritten in place
    rows_ptr,  # [n] int: logit row i -> token row
    local_ptr,  # [n] int: node index l of logit row i within its request
    idx_ptr,  # [n] int: request state s of logit row i
    depths_ptr,  # [S, N] int32 (strides depths_stride0, depths_stride1)
    lin_ptr,  # [>= n] same dtype as positions: the linear positions, out
    n,
    depths_stride0,
    depths_stride1,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    row = tl.load(rows_ptr + i, mask=ok, other=0).to(tl.int64)
    local = tl.load(local_ptr + i, mask=ok, other=0).to(tl.int64)
    state = tl.load(idx_ptr + i, mask=ok, other=0).to(tl.int64)
    lin = tl.load(pos_ptr + row, mask=ok, other=0)
    depth = tl.load(depths_ptr + state * depths_stride0 + local * depths_stride1, mask=ok, other=0)
    tl.store(lin_ptr + i, lin, mask=ok)
    new = lin.to(tl.int64) - local + depth.to(tl.int64)
    tl.store(pos_ptr + row, new.to(lin.dtype), mask=ok)


def _check_rewrite_args(positions, logits_indices, expanded_local_pos, expanded_idx_mapping,
                        depths_by_state, linear_out) -> int:
    if positions.ndim != 1 or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be 1-D int32/int64, got {tuple(positions.shape)} {positions.dtype}")
    if not positions.is_contiguous():
        raise ValueError("positions must be contiguous")
    if depths_by_state.ndim != 2:
        raise ValueError(f"depths_by_state must be [S, N], got {tuple(depths_by_state.shape)}")
    n = logits_indices.numel()
    for name, t in (("logits_indices", logits_indices), ("expanded_local_pos", expanded_local_pos),
                    ("expanded_idx_mapping", expanded_idx_mapping), ("depths_by_state", depths_by_state)):
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
        if t.device != positions.device:
            raise ValueError(f"{name} is on {t.device}, positions on {positions.device}")
    for name, t in (("logits_indices", logits_indices), ("expanded_local_pos", expanded_local_pos),
                    ("expanded_idx_mapping", expanded_idx_mapping)):
        if t.ndim != 1 or t.shape[0] != n:
            raise ValueError(f"{name} must be 1-D of {n} entries, got {tuple(t.shape)}")
    if linear_out.ndim != 1 or linear_out.shape[0] < n or linear_out.dtype != positions.dtype:
        raise ValueError(
            f"linear_out must be 1-D {positions.dtype} with >= {n} entries, got "
            f"{tuple(linear_out.shape)} {linear_out.dtype}"
        )
    if linear_out.device != positions.device or not linear_out.is_contiguous():
        raise ValueError("linear_out must be contiguous and on the positions' device")
    return n


def rewrite_tree_positions_(
    positions: torch.Tensor,
    logits_indices: torch.Tensor,
    expanded_local_pos: torch.Tensor,
    expanded_idx_mapping: torch.Tensor,
    depths_by_state: torch.Tensor,
    linear_out: torch.Tensor,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Linear positions of the verified rows -> ``root + depth``, in place, one launch.

    For every logit row ``i < n = logits_indices.numel()``, with ``row =
    logits_indices[i]``, ``l = expanded_local_pos[i]``, ``s = expanded_idx_mapping[i]``::

        lin = positions[row]
        linear_out[i] = lin
        positions[row] = lin - l + depths_by_state[s, l]

    The runner lays a request's nodes out linearly, so ``lin - l`` is the root's
    position; the root (l = 0, depth 0) keeps it. Rows must be distinct. Positions
    outside ``logits_indices`` and ``linear_out[n:]`` are untouched.

    ``positions``: [num_tokens] int32/int64, contiguous. Index tensors: [n] int32/int64.
    ``depths_by_state``: [S, N] int (any strides). ``linear_out``: [>= n], the dtype of
    ``positions``, contiguous. ``backend``: ``"auto"`` (Triton where it can run: CUDA,
    or CPU with ``TRITON_INTERPRET=1``; else torch), ``"triton"`` or ``"torch"``.
    Returns ``linear_out[:n]``. No host sync.

    Undo with ``positions[logits_indices] = linear_out[:n]`` (one torch launch already).
    """
    n = _check_rewrite_args(positions, logits_indices, expanded_local_pos,
                            expanded_idx_mapping, depths_by_state, linear_out)
    tensors = (positions, logits_indices, expanded_local_pos, expanded_idx_mapping,
               depths_by_state, linear_out)
    if backend == "auto":
        backend = "triton" if can_use_triton(*tensors) else "torch"
    linear = linear_out[:n]
    if backend == "torch":
        rows = logits_indices.long()
        local = expanded_local_pos.long()
        torch.index_select(positions, 0, rows, out=linear)
        depth = depths_by_state[expanded_idx_mapping.long(), local].long()
        positions[rows] = (linear.long() - local + depth).to(positions.dtype)
        return linear
    if backend != "triton":
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if not can_use_triton(*tensors):
        raise RuntimeError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    if n == 0:
        return linear
    block = REWRITE_POSITIONS_BLOCK
    launcher(_rewrite_positions_kernel)[((n + block - 1) // block,)](
        positions,
        logits_indices,
        expanded_local_pos,
        expanded_idx_mapping,
        depths_by_state,
        linear_out,
        n,
        depths_by_state.stride(0),
        depths_by_state.stride(1),
        BLOCK=block,
        num_warps=4,
    )
    return linear


