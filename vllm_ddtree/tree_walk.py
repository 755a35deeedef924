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

from ._triton import can_use_triton, launcher, next_power_of_2, tl

__all__ = ["TreeWalk", "empty_walk", "walk_tree", "walk_tree_fused"]


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


# ---------------------------------------------------------------------------------------
# Fused walk: gather of the per-node target samples + walk in one Triton launch.
# ---------------------------------------------------------------------------------------


def empty_walk(num_requests: int, max_depth: int, device: torch.device | str = "cpu") -> TreeWalk:
    """Preallocated :class:`TreeWalk` buffers for ``walk_tree_fused(..., out=...)``."""
    w = max_depth + 1
    return TreeWalk(
        torch.full((num_requests, w), -1, dtype=torch.int64, device=device),
        torch.zeros(num_requests, dtype=torch.int32, device=device),
        torch.full((num_requests, w), -1, dtype=torch.int64, device=device),
        torch.ones(num_requests, dtype=torch.int32, device=device),
    )


# Triton specialises a pointer argument on 16-byte alignment; an output whose
# alignment changed with the batch size compiled its consumers again while serving.
_ALIGN_BYTES = 16


def step_walk_outputs(num_requests: int, max_depth: int,
                      device: torch.device | str = "cpu") -> TreeWalk:
    """Fresh, uninitialised :class:`TreeWalk` outputs for one step (the fused walk
    writes every element): two allocations instead of four, every output starting
    on a 16-byte boundary whatever ``num_requests`` is.

    vLLM's JIT monitor (bench/results/2026-11-30-steady-plain-chain-trees-both-orders/)
    saw the walk and vLLM's ``_get_num_sampled_and_rejected_kernel`` and
    ``_post_update_kernel`` compile
    again at the first batch-1 step: the counts' second row began ``4 * num_requests``
    bytes in, off a 16-byte boundary unless ``num_requests`` is a multiple of 4 (the
    start-up warm-up's batch), so Triton built a second, unaligned specialisation
    (the cause as the kernels' signatures show it: pointers only). Rows padded to a
    multiple of 4 requests keep every slice aligned."""
    per_block = _ALIGN_BYTES // 4  # int32 counts; an int64 path row is 8 * (D+1) bytes
    padded = -(-num_requests // per_block) * per_block
    w = max_depth + 1
    paths = torch.empty((2, padded, w), dtype=torch.int64, device=device)
    counts = torch.empty((2, padded), dtype=torch.int32, device=device)
    return TreeWalk(paths[0, :num_requests], counts[0, :num_requests],
                    paths[1, :num_requests], counts[1, :num_requests])


def fused_target_tokens(
    node_samples: torch.Tensor, cu_num_logits: torch.Tensor, num_reqs: int, num_nodes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of the kernel's gather: ``target_tokens[r, i] = node_samples[cu[r] + i]``
    for ``i < num_rows[r] = cu[r+1] - cu[r]``, else 0; and the mask ``i < num_rows[r]``.
    Both [num_reqs, num_nodes]. No host sync."""
    dev = node_samples.device
    cu = cu_num_logits[: num_reqs + 1].to(device=dev, dtype=torch.int64)
    rows = cu[1:] - cu[:-1]  # [R]
    node = torch.arange(num_nodes, device=dev, dtype=torch.int64)
    scheduled = node[None, :] < rows[:, None]  # [R, N]
    if node_samples.numel() == 0:
        return torch.zeros(num_reqs, num_nodes, dtype=torch.int64, device=dev), scheduled
    idx = (cu[:-1, None] + node[None, :]).clamp(0, node_samples.numel() - 1)
    target = torch.where(scheduled, node_samples.reshape(-1).long()[idx], 0)
    return target, scheduled


def _walk_fused_kernel(
    samples_ptr,  # [num_logits] int
    cu_ptr,  # [>=R+1] int (int32 in vLLM)
    idx_ptr,  # [R] int (int32 in vLLM)
    tokens_ptr,  # [S, N] int
    parents_ptr,  # [S, N] int
    valid_ptr,  # [S, N] bool
    acc_ptr,  # [>=R, D+1] int64
    num_acc_ptr,  # [>=R] int32
    out_tok_ptr,  # [>=R, D+1] int64
    num_out_ptr,  # [>=R] int32
    n,
    max_depth,
    pad_id,
    stride_tok,
    stride_par,
    stride_val,
    stride_acc,
    stride_out,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    state = tl.load(idx_ptr + r).to(tl.int64)
    start = tl.load(cu_ptr + r).to(tl.int32)
    num_rows = tl.load(cu_ptr + r + 1).to(tl.int32) - start
    lanes = tl.arange(0, BLOCK)
    # Node i is a candidate iff it is in the tree, valid, and was scheduled (has a row).
    ok = (lanes < n) & (lanes < num_rows)
    tokens = tl.load(tokens_ptr + state * stride_tok + lanes, mask=ok, other=0).to(tl.int64)
    parents = tl.load(parents_ptr + state * stride_par + lanes, mask=ok, other=-2).to(tl.int32)
    valid = tl.load(valid_ptr + state * stride_val + lanes, mask=ok, other=0) != 0
    ok = ok & valid

    acc_row = acc_ptr + r.to(tl.int64) * stride_acc
    out_row = out_tok_ptr + r.to(tl.int64) * stride_out
    tl.store(acc_row, 0)
    cur = start * 0  # int32 scalar: the current (last accepted) node
    walking = start * 0 + 1  # 1 while the walk goes on
    num_acc = start * 0
    for d in range(0, max_depth):
        # target sample at the current node (only rows < num_rows exist; others read 0)
        want = tl.load(samples_ptr + start + cur, mask=cur < num_rows, other=0).to(tl.int64)
        # walking: column d is an accepted node's token (== want) or the bonus (== want)
        tl.store(out_row + d, tl.where(walking != 0, want, pad_id))
        match = ok & (parents == cur) & (tokens == want) & (walking != 0)
        nxt = tl.min(tl.where(match, lanes, BLOCK), axis=0)
        found = nxt < BLOCK
        walking = tl.where(found, 1, 0)
        cur = tl.where(found, nxt, cur)
        num_acc += walking
        tl.store(acc_row + d + 1, tl.where(found, nxt, -1).to(tl.int64))
    want = tl.load(samples_ptr + start + cur, mask=cur < num_rows, other=0).to(tl.int64)
    tl.store(out_row + max_depth, tl.where(walking != 0, want, pad_id))
    tl.store(num_acc_ptr + r, num_acc)
    tl.store(num_out_ptr + r, num_acc + 1)


def _check_fused_inputs(
    node_samples, cu_num_logits, idx_mapping, tokens_by_state, parents_by_state,
    valid_by_state, max_depth, out,
) -> None:
    if tokens_by_state.dim() != 2:
        raise ValueError(f"tokens_by_state must be [S, N], got {tuple(tokens_by_state.shape)}")
    shape = tokens_by_state.shape
    if shape[1] < 1:
        raise ValueError("a tree needs at least the root node (N >= 1)")
    for name, t in (("parents_by_state", parents_by_state), ("valid_by_state", valid_by_state)):
        if t.shape != shape:
            raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if valid_by_state.dtype != torch.bool:
        raise TypeError(f"valid_by_state must be bool, got {valid_by_state.dtype}")
    if idx_mapping.dim() != 1:
        raise ValueError(f"idx_mapping must be [R], got {tuple(idx_mapping.shape)}")
    if cu_num_logits.dim() != 1 or cu_num_logits.numel() < idx_mapping.numel() + 1:
        raise ValueError(
            f"cu_num_logits must be 1-D with >= R + 1 = {idx_mapping.numel() + 1} entries, "
            f"got {tuple(cu_num_logits.shape)}"
        )
    for name, t in (
        ("node_samples", node_samples), ("cu_num_logits", cu_num_logits),
        ("idx_mapping", idx_mapping), ("tokens_by_state", tokens_by_state),
        ("parents_by_state", parents_by_state), ("valid_by_state", valid_by_state),
    ):
        if t.dtype.is_floating_point or t.dtype.is_complex:
            raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
        if t.device != tokens_by_state.device:
            raise ValueError(f"{name} is on {t.device}, tokens_by_state on {tokens_by_state.device}")
    if not isinstance(max_depth, int) or max_depth < 0:
        raise ValueError(f"max_depth must be an int >= 0, got {max_depth!r}")
    if out is not None:
        r = idx_mapping.numel()
        w = max_depth + 1
        want = (((r, w), torch.int64), ((r,), torch.int32), ((r, w), torch.int64), ((r,), torch.int32))
        for name, t, (shp, dt) in zip(TreeWalk._fields, out, want):
            if t.dtype != dt or t.dim() != len(shp) or t.shape[0] < r or tuple(t.shape[1:]) != shp[1:]:
                raise ValueError(
                    f"out.{name} must be {dt} of shape (>= {r}{', ' + str(w) if len(shp) == 2 else ''}), "
                    f"got {t.dtype} {tuple(t.shape)}"
                )
            if t.device != tokens_by_state.device:
                raise ValueError(f"out.{name} is on {t.device}, tokens_by_state on {tokens_by_state.device}")
            if t.dim() == 2 and t.stride(1) != 1 or t.dim() == 1 and t.stride(0) != 1:
                raise ValueError(f"out.{name} needs unit stride along its last dim")


def walk_tree_fused(
    node_samples: torch.Tensor,
    cu_num_logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    tokens_by_state: torch.Tensor,
    parents_by_state: torch.Tensor,
    valid_by_state: torch.Tensor,
    max_depth: int,
    pad_id: int = -1,
    out: TreeWalk | None = None,
) -> TreeWalk:
    """Gather the target's per-node samples and walk every tree: one Triton launch.

    Equivalent to (R = ``idx_mapping.numel()``, N = ``tokens_by_state.shape[1]``)::

        rows = cu[1:R+1] - cu[:R]
        target[r, i] = node_samples[cu[r] + i] if i < rows[r] else 0
        walk_tree(tokens_by_state[idx], parents_by_state[idx],
                  valid_by_state[idx] & (i < rows[:, None]), target, max_depth, pad_id)

    i.e. row ``cu[r] + i`` of the verification logits is tree node i of request r, and
    nodes without a row (a verified prefix of the tree, a 1-row prefill/plain decode)
    are never accepted. Rows past N of a request are ignored.

    Args:
        node_samples: [num_logits] int, the target's sample at every logit row.
        cu_num_logits: [>= R+1] int, row offsets of the requests.
        idx_mapping: [R] int, batch row -> request state index.
        tokens_by_state, parents_by_state, valid_by_state: [S, N] (int, int, bool),
            the trees of every request state (row stride any, unit column stride for
            the Triton path).
        max_depth: D (static int); outputs have D + 1 columns.
        pad_id: filler of ``output_tokens`` after the bonus token.
        out: optional preallocated :class:`TreeWalk` (e.g. :func:`empty_walk`) with
            >= R rows; rows ``[:R]`` are written and returned as views.
    Returns:
        :class:`TreeWalk` on the inputs' device. No host synchronisation. One kernel
        launch on CUDA (or under ``TRITON_INTERPRET=1`` on CPU); otherwise a torch
        fallback (gather + :func:`walk_tree`).
    """
    _check_fused_inputs(
        node_samples, cu_num_logits, idx_mapping, tokens_by_state, parents_by_state,
        valid_by_state, max_depth, out,
    )
    num_req = idx_mapping.numel()
    n = tokens_by_state.shape[1]
    dev = tokens_by_state.device
    tensors = (node_samples, cu_num_logits, idx_mapping, tokens_by_state, parents_by_state, valid_by_state)
    if not can_use_triton(*tensors):
        target, scheduled = fused_target_tokens(node_samples, cu_num_logits, num_req, n)
        idx = idx_mapping.long()
        walk = walk_tree(
            tokens_by_state[idx], parents_by_state[idx], valid_by_state[idx] & scheduled,
            target, max_depth, pad_id,
        )
        if out is None:
            return walk
        res = TreeWalk(*(t[:num_req] for t in out))
        for dst, src in zip(res, walk):
            dst.copy_(src)
        return res

    if out is None:
        out = empty_walk(num_req, max_depth, dev)
    res = TreeWalk(*(t[:num_req] for t in out))
    if num_req == 0:
        return res
    samples = node_samples.reshape(-1)
    if samples.numel() == 0:  # nothing to read; every load is masked then, but keep a pointer
        samples = torch.zeros(1, dtype=torch.int64, device=dev)
    tokens, parents, valid = tokens_by_state, parents_by_state, valid_by_state
    if tokens.stride(1) != 1:
        tokens = tokens.contiguous()
    if parents.stride(1) != 1:
        parents = parents.contiguous()
    if valid.stride(1) != 1:
        valid = valid.contiguous()
    block = max(16, next_power_of_2(n))
    launcher(_walk_fused_kernel)[(num_req,)](
        samples.contiguous(), cu_num_logits.contiguous(), idx_mapping.contiguous(), tokens, parents, valid,
        res.accepted_nodes, res.num_accepted, res.output_tokens, res.num_output,
        n, max_depth, pad_id,
        tokens.stride(0), parents.stride(0), valid.stride(0),
        res.accepted_nodes.stride(0), res.output_tokens.stride(0),
        BLOCK=block,
        num_warps=1 if block <= 128 else 4,
    )
    return res
