"""Tree attention mask and positions for verifying a DDTree.

All B + 1 nodes of a request's tree are verified in one target forward. Node ``i`` may
attend the committed context (the attention backend's business, not this module's)
and, inside the tree, exactly the nodes on its own root path: itself and its
ancestors. Its position is ``start_position + depth`` (the position it would have in
a plain sequence), while its KV slot stays linear (``start + i``).

Padding nodes (``node_valid`` False; parent 0, depth 1) get the row of a depth-1 node
(root + itself). No real node lists them as an ancestor, so they never leak into real
nodes; their outputs are ignored because they are never accepted.

Shapes: ``node_parents`` [R, N] int (root: -1, parent index < child index), N = B + 1.

:func:`tree_ancestor_mask` gives each request's ancestor-or-self mask (the unfused
bias, :func:`vllm_ddtree.tree_attention.write_tree_attn_bias`, is built from it).
:func:`rewrite_tree_positions_` rewrites the runner's linear positions of the verified
rows to ``root + depth`` in ONE Triton launch (torch fallback where Triton cannot run).
"""

from __future__ import annotations

import math

import torch

from ._triton import can_use_triton, launcher, tl, varying_args

__all__ = [
    "rewrite_tree_positions_",
    "tree_ancestor_mask",
]


def _check_parents(node_parents: torch.Tensor) -> None:
    if node_parents.dim() != 2:
        raise ValueError(f"node_parents must be [R, N], got {tuple(node_parents.shape)}")
    if node_parents.dtype.is_floating_point or node_parents.dtype == torch.bool:
        raise TypeError(f"node_parents must be an integer tensor, got {node_parents.dtype}")
    if node_parents.shape[1] < 1:
        raise ValueError("a tree needs at least the root node (N >= 1)")


def tree_ancestor_mask(node_parents: torch.Tensor) -> torch.Tensor:
    """Ancestor-or-self mask of each request's tree.

    ``node_parents`` [R, N] int (root -1, parent < child). Returns bool [R, N, N] with
    ``mask[r, i, j]`` True iff node j is node i or one of its ancestors. On the parents'
    device, no host synchronisation (usable inside a CUDA graph): the transitive
    closure of "self or parent" by repeated boolean squaring, ceil(log2 N) batched
    matmuls.
    """
    _check_parents(node_parents)
    num_reqs, n = node_parents.shape
    device = node_parents.device
    # float32 matmul of 0/1 matrices with at most n terms is exact.
    step = torch.eye(n, device=device, dtype=torch.float32).expand(num_reqs, n, n).clone()
    parents = node_parents.to(torch.int64)
    has_parent = parents >= 0
    step.scatter_add_(2, parents.clamp(min=0).unsqueeze(-1),
                      has_parent.to(torch.float32).unsqueeze(-1))
    step.clamp_(max=1.0)
    closure = step
    # After k squarings the closure covers paths of up to 2**k edges; depths are at
    # most n - 1.
    for _ in range(max(1, math.ceil(math.log2(max(n - 1, 1))))):
        closure = torch.bmm(closure, closure).clamp_(max=1.0)
    return closure > 0.5


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


