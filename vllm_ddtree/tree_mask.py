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
"""

from __future__ import annotations

import torch

__all__ = [
    "tree_ancestor_mask",
    "tree_ancestor_mask_reference",
    "tree_attention_bias",
    "tree_positions",
    "tree_positions_reference",
]


def _check_parents(node_parents: torch.Tensor) -> None:
    if node_parents.dim() != 2:
        raise ValueError(f"node_parents must be [R, N], got {tuple(node_parents.shape)}")
    if node_parents.dtype.is_floating_point or node_parents.dtype == torch.bool:
        raise TypeError(f"node_parents must be an integer tensor, got {node_parents.dtype}")
    if node_parents.shape[1] < 1:
        raise ValueError("a tree needs at least the root node (N >= 1)")


def tree_ancestor_mask_reference(node_parents: torch.Tensor) -> torch.Tensor:
    """Loop version: ``mask[r, i, j]`` is True iff j == i or j is an ancestor of i.

    Args:
        node_parents: [R, N] int, root -1.
    Returns:
        [R, N, N] bool (CPU).
    """
    _check_parents(node_parents)
    parents = node_parents.cpu().tolist()
    num_req, n = node_parents.shape
    mask = torch.zeros(num_req, n, n, dtype=torch.bool)
    for r in range(num_req):
        for i in range(n):
            j = i
            steps = 0
            while j >= 0:
                if j >= n or steps > n:
                    raise ValueError(f"request {r}: node {i} has a broken parent chain")
                mask[r, i, j] = True
                j = parents[r][j]
                steps += 1
    return mask


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


def tree_positions_reference(node_depths: torch.Tensor, start_positions: torch.Tensor) -> torch.Tensor:
    """Loop version of :func:`tree_positions`."""
    num_req, n = node_depths.shape
    out = torch.empty(num_req, n, dtype=torch.int64)
    for r in range(num_req):
        for i in range(n):
            out[r, i] = int(start_positions[r]) + int(node_depths[r, i])
    return out
