"""Slow, plain references of the per-step tree operations: the oracles the kernel
tests compare the product's paths with. They define what each operation computes
(Python loops, ``heapq``, dense attention over a paged cache) and are never on an
engine's path, so they live here and not in ``vllm_ddtree/``.

* :func:`build_tree_reference`: the best-first tree (vllm_ddtree.tree_builder).
* :func:`tree_ancestor_mask_reference`, :func:`rewrite_tree_positions_reference`: the
  mask and the positions (vllm_ddtree.tree_mask).
* :func:`walk_tree_reference`: the walk down a verified tree (vllm_ddtree.tree_walk).
* :func:`reference_paged_attention`, :func:`reference_context_attention`: attention
  over a paged KV cache with per-request tree masks (vllm_ddtree.tree_attention).
* :func:`compact_rows_reference_`: row compaction (vllm_ddtree.kv_compaction).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np
import torch

from vllm_ddtree.tree_builder import (
    DDTree,
    _as_batched_logits,
    _check_root_tokens,
    draft_log_normalizer,
    resolve_top_k,
)
from vllm_ddtree.tree_mask import _check_parents
from vllm_ddtree.tree_walk import TreeWalk, _check_inputs


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


def reference_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: Sequence[int],
    query_start_loc: Sequence[int],
    scale: float,
    tree_masks: Sequence[torch.Tensor | None],
) -> torch.Tensor:
    """Dense, slow reference attention over a paged KV cache (float64 softmax).

    ``query`` [T, Hq, D]; ``key_cache``/``value_cache`` [num_blocks,
    block_size, Hkv, D] (vLLM's unified-attention layout); ``block_table``
    [num_seqs, max_blocks]. Sequence s has query tokens
    ``query_start_loc[s]:query_start_loc[s+1]`` whose keys are the last
    ``L`` of its ``seq_lens[s]`` KV positions. ``tree_masks[s]`` is None
    (plain causal) or a bool [L, L] mask over its query tokens (True = may
    attend); every query token may attend the whole committed context
    ``[0, seq_lens[s] - L)``. Returns [T, Hq, D] in ``query``'s dtype.
    """
    num_q_heads = query.shape[1]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(query)
    for s in range(len(seq_lens)):
        q0, q1 = int(query_start_loc[s]), int(query_start_loc[s + 1])
        qlen, slen = q1 - q0, int(seq_lens[s])
        if qlen == 0:
            continue
        ctx = slen - qlen
        if ctx < 0:
            raise ValueError(f"sequence {s}: {qlen} query tokens but seq_len {slen}")
        pos = torch.arange(slen)
        blocks = block_table[s, pos // block_size].long().cpu()
        k = key_cache[blocks, pos % block_size].double()  # [S, Hkv, D]
        v = value_cache[blocks, pos % block_size].double()
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        q = query[q0:q1].double()  # [L, Hq, D]
        allowed = torch.zeros(qlen, slen, dtype=torch.bool)
        allowed[:, :ctx] = True
        mask = tree_masks[s]
        if mask is None:
            mask = torch.ones(qlen, qlen, dtype=torch.bool).tril()
        elif tuple(mask.shape) != (qlen, qlen):
            raise ValueError(f"sequence {s}: tree mask {tuple(mask.shape)} for {qlen} query tokens")
        allowed[:, ctx:] = mask.cpu().bool()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


def reference_context_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: Sequence[int],
    query_start_loc: Sequence[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal attention of each sequence's queries over its first
    ``context_lens[s]`` cached keys, with the log-sum-exp: the stand-in for
    the FA3 context call of route 2 (``return_softmax_lse=True``). Returns
    ``(out [T, Hq, D], lse [Hq, T])``; no context gives out 0, lse -inf."""
    num_q_heads = query.shape[1]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(query)
    lse = torch.full((num_q_heads, query.shape[0]), float("-inf"))
    for s in range(len(context_lens)):
        q0, q1, ctx = int(query_start_loc[s]), int(query_start_loc[s + 1]), int(context_lens[s])
        if q1 == q0 or ctx == 0:
            continue
        pos = torch.arange(ctx)
        blocks = block_table[s, pos // block_size].long().cpu()
        k = key_cache[blocks, pos % block_size].double().repeat_interleave(group, dim=1)
        v = value_cache[blocks, pos % block_size].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query[q0:q1].double(), k) * scale
        lse[:, q0:q1] = torch.logsumexp(scores, dim=-1).float()
        probs = torch.softmax(scores, dim=-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out, lse


def build_tree_reference(
    draft_logits: torch.Tensor,
    budget: int,
    top_k: int | None = None,
    root_tokens: torch.Tensor | None = None,
) -> DDTree:
    """Slow, obviously-correct best-first tree builder (Python ``heapq``).

    Args:
        draft_logits: [D, V] or [R, D, V] float logits of the drafter, position d =
            depth d + 1.
        budget: B, the number of draft nodes per request (the root not counted).
        top_k: candidates per position (default: B), capped at V.
        root_tokens: optional [R] (or [] for 2-D input) tokens for node 0.

    Returns:
        :class:`DDTree` on the CPU with leading dim R (R = 1 for 2-D input is
        squeezed away again, giving [B+1] tensors).
    """
    logits, squeeze = _as_batched_logits(draft_logits)
    num_req, depth_max, vocab = logits.shape
    k = resolve_top_k(budget, vocab, top_k)
    if depth_max < 1:
        raise ValueError("draft_logits must have at least one position (D >= 1)")
    if root_tokens is not None and squeeze:
        root_tokens = root_tokens.reshape(1)
    _check_root_tokens(root_tokens, num_req)

    # The definition of the draft log-probs; the fast path computes the same formula.
    lse = draft_log_normalizer(logits)[..., None]
    logp_all = (logits.float() - lse).cpu().numpy()

    n_nodes = budget + 1
    tokens = np.zeros((num_req, n_nodes), dtype=np.int64)
    parents = np.zeros((num_req, n_nodes), dtype=np.int32)
    depths = np.ones((num_req, n_nodes), dtype=np.int32)
    valid = np.zeros((num_req, n_nodes), dtype=bool)
    scores = np.full((num_req, n_nodes), -np.inf, dtype=np.float32)

    for r in range(num_req):
        # Candidate ranks per position: sort all tokens by (logp desc, id asc).
        cand_ids = []
        cand_lp = []
        for d in range(depth_max):
            row = logp_all[r, d]
            # lexsort: primary key -logp (ascending), secondary token id.
            order = np.lexsort((np.arange(vocab), -row))[:k].tolist()
            cand_ids.append(order)
            cand_lp.append([np.float32(row[t]) for t in order])

        tokens[r, 0] = 0 if root_tokens is None else int(root_tokens[r])
        parents[r, 0] = -1
        depths[r, 0] = 0
        valid[r, 0] = True
        scores[r, 0] = np.float32(0.0)

        # Heap entries: (-score, creation index, depth, rank, parent node, parent score)
        heap: list[tuple[float, int, int, int, int, np.float32]] = []
        root_score = np.float32(0.0)
        first = np.float32(root_score + cand_lp[0][0])
        heapq.heappush(heap, (-float(first), 0, 1, 0, 0, root_score))
        for n in range(1, budget + 1):
            if not heap:
                break
            neg_score, _, depth, rank, parent, parent_score = heapq.heappop(heap)
            score = np.float32(-neg_score)
            tokens[r, n] = cand_ids[depth - 1][rank]
            parents[r, n] = parent
            depths[r, n] = depth
            valid[r, n] = True
            scores[r, n] = score
            if rank + 1 < k:  # next sibling: same prefix, next rank
                s = np.float32(parent_score + cand_lp[depth - 1][rank + 1])
                heapq.heappush(heap, (-float(s), 2 * n - 1, depth, rank + 1, parent, parent_score))
            if depth < depth_max:  # first child: append rank 0
                s = np.float32(score + cand_lp[depth][0])
                heapq.heappush(heap, (-float(s), 2 * n, depth + 1, 0, n, score))

    out = DDTree(
        torch.from_numpy(tokens),
        torch.from_numpy(parents),
        torch.from_numpy(depths),
        torch.from_numpy(valid),
        torch.from_numpy(scores),
    )
    if squeeze:
        out = DDTree(*(t[0] for t in out))
    return out


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


def rewrite_tree_positions_reference(
    positions: torch.Tensor,
    logits_indices: torch.Tensor,
    expanded_local_pos: torch.Tensor,
    expanded_idx_mapping: torch.Tensor,
    depths_by_state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loop version of :func:`rewrite_tree_positions_` (tests): returns new
    ``(positions, linear)`` on the CPU and leaves the inputs alone."""
    pos = positions.cpu().tolist()
    rows = logits_indices.cpu().tolist()
    local = expanded_local_pos.cpu().tolist()
    states = expanded_idx_mapping.cpu().tolist()
    depths = depths_by_state.cpu().tolist()
    linear = []
    for row, l, s in zip(rows, local, states):
        linear.append(pos[row])
        pos[row] = pos[row] - l + depths[s][l]
    return (torch.tensor(pos, dtype=positions.dtype),
            torch.tensor(linear, dtype=positions.dtype))


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

