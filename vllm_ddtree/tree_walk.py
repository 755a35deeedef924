"""Verification walk over a DDTree: which draft nodes the target accepts.

Inputs (per request r, N = B + 1 nodes, node 0 = root = last committed/bonus token):

    node_tokens   [R, N] int    draft token of each node
    node_parents  [R, N] int    root -1
    node_valid    [R, N] bool   padding nodes False (never accepted)
    target_tokens [R, N] int    the target's token *at* each node: the token the target
                                proposes to follow that node's root path (argmax at
                                T = 0, one sample per node at T > 0)

Rule: the root is accepted; a child ``c`` of an accepted node ``p`` is accepted iff
``c`` is valid and ``node_tokens[c] == target_tokens[p]``. The DDTree builder gives
siblings distinct tokens, so the accepted set is a path; should a caller's tree have
equal sibling tokens, the walk takes the lowest-index match (both implementations).

Outputs:

    accepted_nodes [R, D+1] int64  root path: 0, then the accepted node at depth 1..k,
                                   then -1
    num_accepted   [R] int32       k, the number of accepted draft nodes (0..D)
    output_tokens  [R, D+1] int64  tokens of accepted nodes 1..k, then the bonus
                                   ``target_tokens[last accepted node]``, then pad_id
    num_output     [R] int32       k + 1

Why this is lossless at T > 0 (and trivially at T = 0, where it reproduces greedy
decoding). Let target_tokens[i] be drawn from the target's next-token distribution
given the committed context plus node i's root path (the ancestor-only mask makes the
target's output at node i exactly that conditional), with fresh randomness per depth.
The walk emits, at each step, the sample of the current node p: either it continues
into a matching child or it ends as the bonus token. Which node p is current at depth
d is a function of the samples at depths < d only (the samples of p's ancestors), so
the sample at p is still a fresh draw from p(. | emitted prefix) when it is emitted.
Hence every emitted token is distributed exactly as in plain autoregressive sampling
from the target, whatever the draft tree was. Nodes of the *same* depth may even
share randomness (e.g. seeds keyed by position = start + depth): only one of them is
ever on the walked path.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["TreeWalk", "walk_tree", "walk_tree_reference"]


class TreeWalk(NamedTuple):
    accepted_nodes: torch.Tensor  # [R, D+1] int64
    num_accepted: torch.Tensor  # [R] int32
    output_tokens: torch.Tensor  # [R, D+1] int64
    num_output: torch.Tensor  # [R] int32


def _check_inputs(node_tokens, node_parents, node_valid, target_tokens, max_depth) -> None:
    if node_tokens.dim() != 2:
        raise ValueError(f"node_tokens must be [R, N], got {tuple(node_tokens.shape)}")
    shape = node_tokens.shape
    for name, t in (
        ("node_parents", node_parents),
        ("node_valid", node_valid),
        ("target_tokens", target_tokens),
    ):
        if t.shape != shape:
            raise ValueError(
                f"{name} must have the shape of node_tokens {tuple(shape)}, got {tuple(t.shape)}"
            )
        if t.device != node_tokens.device:
            raise ValueError(f"{name} is on {t.device}, node_tokens on {node_tokens.device}")
    if node_valid.dtype != torch.bool:
        raise TypeError(f"node_valid must be bool, got {node_valid.dtype}")
    if not isinstance(max_depth, int) or max_depth < 0:
        raise ValueError(f"max_depth must be an int >= 0, got {max_depth!r}")
    if shape[1] < 1:
        raise ValueError("a tree needs at least the root node (N >= 1)")


def walk_tree_reference(
    node_tokens: torch.Tensor,
    node_parents: torch.Tensor,
    node_valid: torch.Tensor,
    target_tokens: torch.Tensor,
    max_depth: int,
    pad_id: int = -1,
) -> TreeWalk:
    """Plain-Python walk (the definition); see the module docstring. CPU outputs."""
    _check_inputs(node_tokens, node_parents, node_valid, target_tokens, max_depth)
    tokens = node_tokens.cpu().tolist()
    parents = node_parents.cpu().tolist()
    valid = node_valid.cpu().tolist()
    target = target_tokens.cpu().tolist()
    num_req, n = node_tokens.shape
    accepted = torch.full((num_req, max_depth + 1), -1, dtype=torch.int64)
    out_tokens = torch.full((num_req, max_depth + 1), pad_id, dtype=torch.int64)
    num_acc = torch.zeros(num_req, dtype=torch.int32)
    for r in range(num_req):
        path = [0]
        cur = 0
        while len(path) <= max_depth:
            nxt = None
            for c in range(n):  # lowest index first
                if valid[r][c] and parents[r][c] == cur and tokens[r][c] == target[r][cur]:
                    nxt = c
                    break
            if nxt is None:
                break
            path.append(nxt)
            cur = nxt
        k = len(path) - 1
        emitted = [tokens[r][i] for i in path[1:]] + [target[r][cur]]
        accepted[r, : k + 1] = torch.tensor(path)
        out_tokens[r, : k + 1] = torch.tensor(emitted)
        num_acc[r] = k
    return TreeWalk(accepted, num_acc, out_tokens, num_acc + 1)


def walk_tree(
    node_tokens: torch.Tensor,
    node_parents: torch.Tensor,
    node_valid: torch.Tensor,
    target_tokens: torch.Tensor,
    max_depth: int,
    pad_id: int = -1,
) -> TreeWalk:
    """Vectorised walk: ``max_depth`` steps of [R, N] torch ops, no host sync.

    Step d looks, for every request still walking, for a valid child of the current
    node whose token equals the target's token at the current node.

    Args:
        node_tokens, node_parents, node_valid, target_tokens: [R, N] (see module doc).
        max_depth: D, the deepest possible node (static int); outputs have D + 1 columns.
        pad_id: filler of ``output_tokens`` after the bonus token.
    Returns:
        :class:`TreeWalk` on the inputs' device.
    """
    _check_inputs(node_tokens, node_parents, node_valid, target_tokens, max_depth)
    num_req, n = node_tokens.shape
    dev = node_tokens.device
    tokens = node_tokens.long()
    parents = node_parents.long()
    target = target_tokens.long()
    node_ids = torch.arange(n, device=dev)

    cur = torch.zeros(num_req, dtype=torch.int64, device=dev)
    walking = torch.ones(num_req, dtype=torch.bool, device=dev)
    num_acc = torch.zeros(num_req, dtype=torch.int64, device=dev)
    accepted = torch.full((num_req, max_depth + 1), -1, dtype=torch.int64, device=dev)
    accepted[:, 0] = 0
    for d in range(1, max_depth + 1):
        want = target.gather(1, cur[:, None])  # [R, 1]
        match = node_valid & (parents == cur[:, None]) & (tokens == want) & walking[:, None]
        nxt = torch.where(match, node_ids, n).amin(dim=1)
        walking = nxt < n
        cur = torch.where(walking, nxt, cur)
        accepted[:, d] = torch.where(walking, nxt, -1)
        num_acc += walking

    cols = torch.arange(max_depth + 1, device=dev)
    path_tokens = tokens.gather(1, accepted[:, 1:].clamp(min=0))  # [R, D]
    path_tokens = torch.cat([path_tokens, path_tokens.new_zeros(num_req, 1)], dim=1)
    bonus = target.gather(1, cur[:, None])  # [R, 1]
    k = num_acc[:, None]
    pad = torch.full((), pad_id, dtype=torch.int64, device=dev)
    out_tokens = torch.where(cols < k, path_tokens, torch.where(cols == k, bonus, pad))
    num_acc32 = num_acc.to(torch.int32)
    return TreeWalk(accepted, num_acc32, out_tokens, num_acc32 + 1)
