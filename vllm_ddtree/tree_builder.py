"""Best-first draft-tree construction for DDTree.

The drafter gives, per request, one distribution over the vocabulary for each of the D
future positions (position ``d`` = tree depth ``d + 1``). DDTree verifies the ``B``
most probable *prefixes* under the (independent-per-position) draft distributions:

* ``logp[d] = float32(logits[d]) - lse[d]`` (= log_softmax), where ``lse`` is the
  float32 log-normaliser of :func:`draft_log_normalizer` (one fused pass over the
  logits, no full-size temporary; both the reference and the fast paths call it, so
  they see bitwise-equal log-probs; it is tested against ``torch.logsumexp``).
* Per position, the ``K = min(top_k or B, V)`` most probable tokens are the candidates,
  ranked by ``(logp descending, token id ascending)``. Which tokens of a tie *at the
  K-th place* enter the candidate set is left to ``torch.topk`` (it does not affect
  losslessness, only which draft is proposed).
* A prefix at depth ``d`` is a tuple of ranks ``(r_1, ..., r_d)``; its score is
  ``sum_i logp[i-1, id(i-1, r_i)]``, accumulated in float32 as
  ``score(prefix) = score(prefix[:-1]) + logp[...]`` (the order the kernels use).
* Best-first search: push the depth-1 rank-0 candidate; repeatedly pop the best
  candidate, make it the next node (its parent is the node of its prefix minus the
  last rank; depth-1 nodes hang under the root), then push its next sibling (same
  prefix, last rank + 1, if that rank < K) and its first child (append rank 0, if its
  depth < D). Stop after B nodes or when nothing is left (remaining nodes are padding).
* Ties: among equal scores the candidate *created first* wins. Creation indices: the
  initial candidate is 0; when the n-th node is popped (n = 1..B) its sibling gets
  ``2n - 1`` and its child ``2n`` (created or not). Score first, creation index second.

Since children are pushed only when their parent is popped, every node's parent has a
smaller node index, and siblings carry distinct tokens (distinct ranks of one
position). The heap never needs more than ``B`` live entries before the last pop.

Output format (per request r, fixed size B + 1, node 0 = root = the bonus token;
:func:`build_trees` may write into wider ``out`` buffers, whose extra nodes it pads):

    node_tokens  [R, B+1] int64   root: ``root_tokens[r]`` or 0; padding: 0
    node_parents [R, B+1] int32   root: -1; padding: 0; parent < child otherwise
    node_depths  [R, B+1] int32   root: 0; padding: 1
    node_valid   [R, B+1] bool    False only for padding nodes
    node_scores  [R, B+1] float32 root: 0; padding: -inf (summed draft log-probs)

Three implementations share these semantics exactly (tokens, parents, depths, valid,
and bitwise scores): ``tests/references.py``'s ``build_tree_reference`` (Python
``heapq``, the definition, the tests' oracle), and :func:`build_trees` with
``backend="triton"`` (one program per request; the
frontier lives in registers and each step is a vectorised arg-max) or
``backend="torch"`` (the same frontier algorithm in batched torch ops). Both fast
backends are free of host synchronisation and write fixed-shape outputs (optionally
into caller-provided buffers), so they can be captured in CUDA graphs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._triton import can_use_triton, jit, launcher, next_power_of_2, tl

__all__ = [
    "DDTree",
    "build_trees",
    "draft_log_normalizer",
    "draft_topk",
    "empty_tree",
    "fill_root_only_trees_",
    "resolve_top_k",
]


class DDTree(NamedTuple):
    """A batch of draft trees in the agreed fixed-size format (see module docstring)."""

    node_tokens: torch.Tensor  # [R, B+1] int64
    node_parents: torch.Tensor  # [R, B+1] int32
    node_depths: torch.Tensor  # [R, B+1] int32
    node_valid: torch.Tensor  # [R, B+1] bool
    node_scores: torch.Tensor  # [R, B+1] float32


def empty_tree(
    num_requests: int, budget: int, device: torch.device | str = "cpu"
) -> DDTree:
    """Allocate output buffers for :func:`build_trees` (``out=``); contents undefined."""
    shape = (num_requests, budget + 1)
    return DDTree(
        torch.empty(shape, dtype=torch.int64, device=device),
        torch.empty(shape, dtype=torch.int32, device=device),
        torch.empty(shape, dtype=torch.int32, device=device),
        torch.empty(shape, dtype=torch.bool, device=device),
        torch.empty(shape, dtype=torch.float32, device=device),
    )


def _pad_nodes_(out: DDTree, first: int) -> None:
    """Write nodes ``first ..`` of every row of ``out`` as padding (see the output
    format above), in place; the Triton builder writes the same values itself."""
    out.node_tokens[:, first:] = 0
    out.node_parents[:, first:] = 0
    out.node_depths[:, first:] = 1
    out.node_valid[:, first:] = False
    out.node_scores[:, first:] = float("-inf")


def fill_root_only_trees_(out: DDTree) -> DDTree:
    """Write trees that hold only their root (every other node padding) into ``out``,
    in place and without host sync: what a step without drafts leaves behind. The
    root's token is set to 0 like a tree built without ``root_tokens``."""
    out.node_tokens[:, 0] = 0
    out.node_parents[:, 0] = -1
    out.node_depths[:, 0] = 0
    out.node_valid[:, 0] = True
    out.node_scores[:, 0] = 0.0
    _pad_nodes_(out, 1)
    return out


def resolve_top_k(budget: int, vocab_size: int, top_k: int | None = None) -> int:
    """K = min(top_k or budget, vocab_size), with argument checks."""
    if not isinstance(budget, int) or budget < 1:
        raise ValueError(f"DDTree budget must be an int >= 1, got {budget!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"DDTree top_k must be None or an int >= 1, got {top_k!r}")
    if vocab_size < 1:
        raise ValueError(f"draft vocabulary must be non-empty, got size {vocab_size}")
    return min(top_k if top_k is not None else budget, vocab_size)


def _as_batched_logits(draft_logits: torch.Tensor) -> tuple[torch.Tensor, bool]:
    if not isinstance(draft_logits, torch.Tensor):
        raise TypeError(f"draft_logits must be a torch.Tensor, got {type(draft_logits)}")
    if not draft_logits.is_floating_point():
        raise TypeError(f"draft_logits must be floating point, got {draft_logits.dtype}")
    if draft_logits.dim() == 2:
        return draft_logits.unsqueeze(0), True
    if draft_logits.dim() == 3:
        return draft_logits, False
    raise ValueError(
        "draft_logits must have shape [D, V] or [R, D, V], got "
        f"{tuple(draft_logits.shape)}"
    )


def _check_root_tokens(root_tokens: torch.Tensor | None, num_requests: int) -> None:
    if root_tokens is None:
        return
    if root_tokens.shape != (num_requests,):
        raise ValueError(
            f"root_tokens must have shape [R]=({num_requests},), got "
            f"{tuple(root_tokens.shape)}"
        )


# ----------------------------------------------------------------------------------
# Candidates per position (shared by the fast backends)
# ----------------------------------------------------------------------------------


def _logsumexp_kernel(
    x_ptr,  # [rows, V] (row stride given; last dim contiguous)
    out_ptr,  # [rows] float32
    row_stride,
    vocab,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * row_stride
    offs = tl.arange(0, BLOCK)
    m = float("-inf")
    s = 0.0
    for start in range(0, vocab, BLOCK):
        x = tl.load(base + start + offs, mask=start + offs < vocab, other=float("-inf"))
        x = x.to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, axis=0))
        safe_m = tl.where(new_m == float("-inf"), 0.0, new_m)
        s = s * tl.exp(m - safe_m) + tl.sum(tl.exp(x - safe_m), axis=0)
        m = new_m
    lse = tl.where(m == float("-inf"), float("-inf"), m + tl.log(tl.where(s > 0.0, s, 1.0)))
    tl.store(out_ptr + row, lse)


def draft_log_normalizer(draft_logits: torch.Tensor) -> torch.Tensor:
    """float32 ``logsumexp`` over the vocabulary, the log-normaliser of the draft.

    Args:
        draft_logits: [..., V] float logits (fp32/bf16/fp16), last dim contiguous for
            the Triton path.
    Returns:
        [...] float32. One fused pass on CUDA (Triton; no fp32 copy of the logits);
        ``torch.logsumexp(logits.float())`` elsewhere. Rows that are all -inf give -inf.
    """
    vocab = draft_logits.shape[-1]
    lead = draft_logits.shape[:-1]
    if can_use_triton(draft_logits) and vocab > 0:
        rows = draft_logits.reshape(-1, vocab)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
        if rows.shape[0]:
            block = min(4096, next_power_of_2(vocab))
            jit(_logsumexp_kernel)[(rows.shape[0],)](
                rows, out, rows.stride(0), vocab, BLOCK=block, num_warps=4 if block >= 1024 else 1
            )
        return out.view(lead)
    return torch.logsumexp(draft_logits.float(), dim=-1)


def draft_topk(draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` draft candidates per position, in canonical rank order.

    Args:
        draft_logits: [R, D, V] float logits (any float dtype; not copied except for
            the float32 log-normaliser).
        k: candidates per position, 1 <= k <= V.

    Returns:
        ``(ids [R, D, k] int64, logp [R, D, k] float32)`` where
        ``logp = float32(logit) - draft_log_normalizer(logits)`` and ranks are ordered by
        ``(logp descending, token id ascending)``.
    """
    if draft_logits.dim() != 3:
        raise ValueError(f"draft_logits must be [R, D, V], got {tuple(draft_logits.shape)}")
    vocab = draft_logits.shape[-1]
    if not 1 <= k <= vocab:
        raise ValueError(f"k must be in [1, V={vocab}], got {k}")
    # Ordering by raw logits equals ordering by logp up to rounding ties; the canonical
    # re-sort below settles the order inside the selected set.
    vals, ids = torch.topk(draft_logits, k, dim=-1, largest=True, sorted=False)
    lse = draft_log_normalizer(draft_logits)[..., None]
    logp = vals.float() - lse
    # Canonical order: sort by id, then stable sort by logp descending.
    ids, perm = torch.sort(ids, dim=-1)
    logp = torch.gather(logp, -1, perm)
    logp, perm = torch.sort(logp, dim=-1, descending=True, stable=True)
    ids = torch.gather(ids, -1, perm)
    return ids.contiguous(), logp.contiguous()


# ----------------------------------------------------------------------------------
# Fast: Triton, one program per request, frontier in registers
# ----------------------------------------------------------------------------------


def _build_tree_kernel(
    topk_ids_ptr,  # [R, D, K] int64
    topk_logp_ptr,  # [R, D, K] float32
    root_tokens_ptr,  # [R] int (ignored unless HAS_ROOT)
    tokens_ptr,  # [R, B+1] int64
    parents_ptr,  # [R, B+1] int32
    depths_ptr,  # [R, B+1] int32
    valid_ptr,  # [R, B+1] bool
    scores_ptr,  # [R, B+1] float32
    max_depth,
    k,
    budget,
    row_nodes,  # nodes per output row (>= budget + 1); nodes past budget are padding
    HAS_ROOT: tl.constexpr,
    BLOCK: tl.constexpr,  # power of two >= budget + 1
    PAD_BLOCK: tl.constexpr,  # power of two >= row_nodes - budget - 1 (0: no padding)
):
    req = tl.program_id(0).to(tl.int64)
    out_base = req * row_nodes
    cand_base = req * max_depth * k

    # Root node.
    if HAS_ROOT:
        tl.store(tokens_ptr + out_base, tl.load(root_tokens_ptr + req).to(tl.int64))
    else:
        tl.store(tokens_ptr + out_base, 0)
    tl.store(parents_ptr + out_base, -1)
    tl.store(depths_ptr + out_base, 0)
    tl.store(valid_ptr + out_base, 1)
    tl.store(scores_ptr + out_base, 0.0)

    # Frontier slots. Slot 0 holds the initial candidate; the child pushed at pop n
    # goes to (fresh) slot n and the sibling reuses the popped slot, so B + 1 slots
    # are enough.
    offs = tl.arange(0, BLOCK)
    big = 2 * budget + 2  # larger than any creation index
    first_lp = tl.load(topk_logp_ptr + cand_base)
    slot0 = offs == 0
    alive = slot0
    score = tl.where(slot0, 0.0 + first_lp, float("-inf"))
    base = tl.zeros((BLOCK,), dtype=tl.float32)  # score of the parent node
    depth = tl.full((BLOCK,), 1, dtype=tl.int32)
    rank = tl.zeros((BLOCK,), dtype=tl.int32)
    parent = tl.zeros((BLOCK,), dtype=tl.int32)
    created = tl.where(slot0, 0, big)

    for n in range(1, budget + 1):
        # Best live candidate: max score, then smallest creation index.
        best = tl.max(tl.where(alive, score, float("-inf")), axis=0)
        is_best = alive & (score == best)
        first_created = tl.min(tl.where(is_best, created, big), axis=0)
        has = first_created < big
        sel = is_best & (created == first_created)

        d = tl.sum(tl.where(sel, depth, 0), axis=0)
        r = tl.sum(tl.where(sel, rank, 0), axis=0)
        p = tl.sum(tl.where(sel, parent, 0), axis=0)
        b = tl.sum(tl.where(sel, base, 0.0), axis=0)
        s = tl.sum(tl.where(sel, score, 0.0), axis=0)

        pos_off = cand_base + (d - 1).to(tl.int64) * k
        tok = tl.load(topk_ids_ptr + pos_off + r, mask=has, other=0)
        o = out_base + n
        tl.store(tokens_ptr + o, tl.where(has, tok, 0))
        tl.store(parents_ptr + o, tl.where(has, p, 0))
        tl.store(depths_ptr + o, tl.where(has, d, 1))
        tl.store(valid_ptr + o, has.to(tl.int1))
        tl.store(scores_ptr + o, tl.where(has, s, float("-inf")))

        # Sibling (creation 2n - 1) into the popped slot.
        sib_ok = has & (r + 1 < k)
        sib_lp = tl.load(topk_logp_ptr + pos_off + r + 1, mask=sib_ok, other=0.0)
        sib_score = b + sib_lp
        rank = tl.where(sel, r + 1, rank)
        score = tl.where(sel, sib_score, score)
        alive = tl.where(sel, sib_ok, alive)
        created = tl.where(sel, 2 * n - 1, created)

        # First child (creation 2n) into fresh slot n.
        child_ok = has & (d < max_depth)
        child_lp = tl.load(topk_logp_ptr + pos_off + k, mask=child_ok, other=0.0)
        child_score = s + child_lp
        cs = offs == n
        depth = tl.where(cs, d + 1, depth)
        rank = tl.where(cs, 0, rank)
        parent = tl.where(cs, n, parent)
        base = tl.where(cs, s, base)
        score = tl.where(cs, child_score, score)
        alive = tl.where(cs, child_ok, alive)
        created = tl.where(cs, 2 * n, created)

    if PAD_BLOCK > 0:
        # Nodes beyond this call's budget (a smaller tree in wider buffers): padding.
        pad = budget + 1 + tl.arange(0, PAD_BLOCK)
        in_row = pad < row_nodes
        o = out_base + pad
        tl.store(tokens_ptr + o, tl.zeros((PAD_BLOCK,), dtype=tl.int64), mask=in_row)
        tl.store(parents_ptr + o, tl.zeros((PAD_BLOCK,), dtype=tl.int32), mask=in_row)
        tl.store(depths_ptr + o, tl.full((PAD_BLOCK,), 1, dtype=tl.int32), mask=in_row)
        tl.store(valid_ptr + o, tl.zeros((PAD_BLOCK,), dtype=tl.int1), mask=in_row)
        tl.store(scores_ptr + o, tl.full((PAD_BLOCK,), float("-inf"), dtype=tl.float32),
                 mask=in_row)


def _build_trees_triton(
    ids: torch.Tensor, logp: torch.Tensor, budget: int, root_tokens, out: DDTree
) -> None:
    num_req, depth_max, k = ids.shape
    kernel = jit(_build_tree_kernel)
    has_root = root_tokens is not None
    row_nodes = out.node_tokens.shape[1]
    num_pad = row_nodes - budget - 1
    kernel[(num_req,)](
        ids,
        logp,
        root_tokens if has_root else ids,
        out.node_tokens,
        out.node_parents,
        out.node_depths,
        out.node_valid,
        out.node_scores,
        depth_max,
        k,
        budget,
        row_nodes,
        HAS_ROOT=has_root,
        BLOCK=next_power_of_2(budget + 1),
        PAD_BLOCK=next_power_of_2(num_pad) if num_pad > 0 else 0,
        num_warps=1 if budget < 256 else 4,
    )


# ----------------------------------------------------------------------------------
# Fast: batched torch ops (same algorithm; fallback where Triton is unavailable)
# ----------------------------------------------------------------------------------


def _build_trees_torch(
    ids: torch.Tensor, logp: torch.Tensor, budget: int, root_tokens, out: DDTree
) -> None:
    num_req, depth_max, k = ids.shape
    dev = ids.device
    n_slots = budget + 1
    big = 2 * budget + 2
    neg_inf = torch.tensor(float("-inf"), device=dev)
    flat_ids = ids.reshape(num_req, depth_max * k)
    flat_lp = logp.reshape(num_req, depth_max * k)
    rows = torch.arange(num_req, device=dev)
    slot_ids = torch.arange(n_slots, device=dev)

    alive = torch.zeros(num_req, n_slots, dtype=torch.bool, device=dev)
    alive[:, 0] = True
    score = torch.full((num_req, n_slots), float("-inf"), dtype=torch.float32, device=dev)
    score[:, 0] = 0.0 + flat_lp[:, 0]
    base = torch.zeros(num_req, n_slots, dtype=torch.float32, device=dev)
    depth = torch.ones(num_req, n_slots, dtype=torch.int64, device=dev)
    rank = torch.zeros(num_req, n_slots, dtype=torch.int64, device=dev)
    parent = torch.zeros(num_req, n_slots, dtype=torch.int64, device=dev)
    created = torch.full((num_req, n_slots), big, dtype=torch.int64, device=dev)
    created[:, 0] = 0

    tokens_out = torch.zeros(num_req, n_slots, dtype=torch.int64, device=dev)
    parents_out = torch.zeros(num_req, n_slots, dtype=torch.int64, device=dev)
    depths_out = torch.ones(num_req, n_slots, dtype=torch.int64, device=dev)
    valid_out = torch.zeros(num_req, n_slots, dtype=torch.bool, device=dev)
    scores_out = torch.full((num_req, n_slots), float("-inf"), dtype=torch.float32, device=dev)

    for n in range(1, budget + 1):
        best = torch.where(alive, score, neg_inf).amax(dim=1, keepdim=True)
        is_best = alive & (score == best)
        cmin = torch.where(is_best, created, big).amin(dim=1)
        has = cmin < big
        slot = torch.where(is_best & (created == cmin[:, None]), slot_ids, n_slots).amin(dim=1)
        slot_c = slot.clamp(max=n_slots - 1)

        d = depth[rows, slot_c]
        r = rank[rows, slot_c]
        p = parent[rows, slot_c]
        b = base[rows, slot_c]
        s = score[rows, slot_c]
        pos = (d - 1) * k

        tok = flat_ids.gather(1, (pos + r).clamp(max=depth_max * k - 1)[:, None])[:, 0]
        tokens_out[:, n] = torch.where(has, tok, 0)
        parents_out[:, n] = torch.where(has, p, 0)
        depths_out[:, n] = torch.where(has, d, 1)
        valid_out[:, n] = has
        scores_out[:, n] = torch.where(has, s, neg_inf)

        sel = (slot_ids[None, :] == slot[:, None]) & has[:, None]
        sib_ok = has & (r + 1 < k)
        sib_lp = flat_lp.gather(1, (pos + r + 1).clamp(max=depth_max * k - 1)[:, None])[:, 0]
        sib_score = b + torch.where(sib_ok, sib_lp, 0.0)
        rank = torch.where(sel, (r + 1)[:, None], rank)
        score = torch.where(sel, sib_score[:, None], score)
        alive = torch.where(sel, sib_ok[:, None], alive)
        created = torch.where(sel, 2 * n - 1, created)

        if n < n_slots:
            child_ok = has & (d < depth_max)
            child_lp = flat_lp.gather(1, (pos + k).clamp(max=depth_max * k - 1)[:, None])[:, 0]
            child_score = s + torch.where(child_ok, child_lp, 0.0)
            depth[:, n] = d + 1
            rank[:, n] = 0
            parent[:, n] = n
            base[:, n] = s
            score[:, n] = child_score
            alive[:, n] = child_ok
            created[:, n] = 2 * n

    if root_tokens is not None:
        tokens_out[:, 0] = root_tokens.to(torch.int64)
    parents_out[:, 0] = -1
    depths_out[:, 0] = 0
    valid_out[:, 0] = True
    scores_out[:, 0] = 0.0
    width = budget + 1
    out.node_tokens[:, :width].copy_(tokens_out)
    out.node_parents[:, :width].copy_(parents_out)
    out.node_depths[:, :width].copy_(depths_out)
    out.node_valid[:, :width].copy_(valid_out)
    out.node_scores[:, :width].copy_(scores_out)
    # Nodes beyond this call's budget (a smaller tree in wider buffers): padding.
    _pad_nodes_(out, width)


# ----------------------------------------------------------------------------------
# Public fast entry point
# ----------------------------------------------------------------------------------


def build_trees(
    draft_logits: torch.Tensor,
    budget: int,
    top_k: int | None = None,
    *,
    root_tokens: torch.Tensor | None = None,
    out: DDTree | None = None,
    backend: str = "auto",
) -> DDTree:
    """Build the DDTree draft trees of a batch on the logits' device, without host sync.

    Args:
        draft_logits: [R, D, V] float drafter logits; position d is depth d + 1.
        budget: B, draft nodes per request (root not counted); outputs have B + 1 nodes.
        top_k: candidates per position (default B), capped at V. Static per engine.
        root_tokens: optional [R] integer tensor written to node 0 (else 0).
        out: optional preallocated :class:`DDTree` of [R, W] buffers, W >= B + 1 (see
            :func:`empty_tree`), on the logits' device; filled in place and returned.
            Nodes B + 1 .. W - 1 are written as padding, so a step can build a smaller
            tree than the buffers hold (the runner's batch-aware budget).
        backend: ``"triton"``, ``"torch"`` or ``"auto"`` (Triton when it can run on
            these tensors: CUDA, or CPU with ``TRITON_INTERPRET=1``; else torch).

    Returns:
        :class:`DDTree` with [R, B+1] tensors, identical to ``build_tree_reference``
        (tokens, parents, depths, valid; scores bitwise) whenever the candidate sets
        agree (always, unless two tokens tie at the K-th place of a position).
    """
    logits, _ = _as_batched_logits(draft_logits)
    if draft_logits.dim() != 3:
        raise ValueError(f"draft_logits must be [R, D, V], got {tuple(draft_logits.shape)}")
    num_req, depth_max, vocab = logits.shape
    if depth_max < 1:
        raise ValueError("draft_logits must have at least one position (D >= 1)")
    k = resolve_top_k(budget, vocab, top_k)
    _check_root_tokens(root_tokens, num_req)
    if root_tokens is not None and root_tokens.device != logits.device:
        raise ValueError("root_tokens must be on the same device as draft_logits")
    if out is None:
        out = empty_tree(num_req, budget, logits.device)
    else:
        _check_out(out, num_req, budget, logits.device)

    if backend == "auto":
        backend = "triton" if can_use_triton(logits) else "torch"
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "triton" and not can_use_triton(logits):
        raise RuntimeError(
            "backend='triton' needs Triton and CUDA tensors (or TRITON_INTERPRET=1 "
            "with CPU tensors)"
        )

    if num_req == 0:
        return out
    ids, logp = draft_topk(logits, k)
    if backend == "triton":
        _build_trees_triton(ids, logp, budget, root_tokens, out)
    else:
        _build_trees_torch(ids, logp, budget, root_tokens, out)
    return out


def _check_out(out: DDTree, num_req: int, budget: int, device: torch.device) -> None:
    width = out.node_tokens.shape[-1] if out.node_tokens.dim() == 2 else -1
    if width < budget + 1:
        raise ValueError(
            f"out buffers hold {width} nodes per request, fewer than budget + 1 = "
            f"{budget + 1}"
        )
    want = (
        ("node_tokens", torch.int64),
        ("node_parents", torch.int32),
        ("node_depths", torch.int32),
        ("node_valid", torch.bool),
        ("node_scores", torch.float32),
    )
    for name, dtype in want:
        t = getattr(out, name)
        if t.shape != (num_req, width) or t.dtype != dtype or t.device != device:
            raise ValueError(
                f"out.{name} must be a {dtype} tensor of shape ({num_req}, {width}) "
                f"on {device}, got {t.dtype} {tuple(t.shape)} on {t.device}"
            )
        if not t.is_contiguous():
            raise ValueError(f"out.{name} must be contiguous")


# ----------------------------------------------------------------------------------
# Trees by request state (after drafting, read at the next verification)
# ----------------------------------------------------------------------------------


def store_trees_by_state_torch_(
    trees: DDTree,
    idx_mapping: torch.Tensor,
    tokens_by_state: torch.Tensor,
    parents_by_state: torch.Tensor,
    depths_by_state: torch.Tensor,
    valid_by_state: torch.Tensor,
) -> None:
    """The unfused path (``VLLM_DDTREE_FUSED_KERNELS=0``, or no CUDA): row r of the
    batch's trees -> row ``idx_mapping[r]`` of each by-state table (four indexed
    copies; R = ``idx_mapping.numel()``)."""
    r = idx_mapping.numel()
    idx = idx_mapping.long()
    tokens_by_state[idx] = trees.node_tokens[:r]
    parents_by_state[idx] = trees.node_parents[:r]
    depths_by_state[idx] = trees.node_depths[:r]
    valid_by_state[idx] = trees.node_valid[:r]


def _store_by_state_kernel(
    tok_ptr, par_ptr, dep_ptr, val_ptr,  # [>= R, N] this step's trees (contiguous)
    idx_ptr,  # [R] batch row -> request state
    tok_out, par_out, dep_out, val_out,  # [S, N] by-state tables (contiguous)
    n,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    state = tl.load(idx_ptr + r).to(tl.int64)
    i = tl.arange(0, BLOCK)
    ok = i < n
    src = r * n + i
    dst = state * n + i
    tl.store(tok_out + dst, tl.load(tok_ptr + src, mask=ok), mask=ok)
    tl.store(par_out + dst, tl.load(par_ptr + src, mask=ok), mask=ok)
    tl.store(dep_out + dst, tl.load(dep_ptr + src, mask=ok), mask=ok)
    tl.store(val_out + dst, tl.load(val_ptr + src, mask=ok), mask=ok)


def store_trees_by_state_(
    trees: DDTree,
    idx_mapping: torch.Tensor,
    tokens_by_state: torch.Tensor,
    parents_by_state: torch.Tensor,
    depths_by_state: torch.Tensor,
    valid_by_state: torch.Tensor,
) -> None:
    """Copy this step's trees (batch order) into the by-state tables: ONE launch.

    Same result as :func:`store_trees_by_state_torch_` (four ``index_put_`` calls,
    ~8 launches). Every table must be contiguous with
    N = B + 1 columns, the trees' dtypes (int64, int32, int32, bool), and on one
    device; ``idx_mapping`` holds distinct state indices (the runner's). Falls back to
    the torch path without CUDA (or ``TRITON_INTERPRET=1``). No host synchronisation.
    """
    tables = (tokens_by_state, parents_by_state, depths_by_state, valid_by_state)
    srcs = (trees.node_tokens, trees.node_parents, trees.node_depths, trees.node_valid)
    r = idx_mapping.numel()
    n = trees.node_tokens.shape[1]
    for name, src, dst in zip(("tokens", "parents", "depths", "valid"), srcs, tables):
        if dst.dim() != 2 or dst.shape[1] != n or dst.dtype != src.dtype:
            raise ValueError(f"{name}_by_state must be [S, {n}] {src.dtype}, got "
                             f"{dst.dtype} {tuple(dst.shape)}")
        if src.shape[0] < r:
            raise ValueError(f"trees hold {src.shape[0]} rows, idx_mapping has {r}")
    if r == 0:
        return
    tensors = (idx_mapping, *srcs, *tables)
    if not can_use_triton(*tensors):
        store_trees_by_state_torch_(trees, idx_mapping, *tables)
        return
    if not all(t.is_contiguous() for t in (*srcs, *tables)):
        raise ValueError("store_trees_by_state_ needs contiguous trees and tables")
    if idx_mapping.stride(0) != 1:
        idx_mapping = idx_mapping.contiguous()
    launcher(_store_by_state_kernel)[(r,)](
        *srcs, idx_mapping, *tables, n, BLOCK=max(16, next_power_of_2(n)), num_warps=1,
    )
