"""Tree attention for DDTree verification: masks, the per-request bias, a reference.

The target verifies every request's tree of B+1 nodes (node 0 = root, parents
before children) in one forward. The nodes of request r occupy the linear KV
slots ``start_r .. start_r + B`` right after its committed context; node i may
attend the whole context ``[0, start_r)``, its ancestors and itself. Causal
masking over the linear layout is a superset of that (a parent always has a
smaller index), so the Triton unified attention kernel, patched by
``patches/attention_triton-per-request-tree-bias.patch``, adds a per-request
query-query bias (0 for ancestor-or-self, -inf otherwise) on top of it.

What lives here (torch, plus one Triton kernel; no host sync, usable inside CUDA graphs):

* :func:`allocate_tree_attn_bias` / :func:`write_tree_attn_bias`: the persistent
  ``[max_num_seqs, B+1, B+1]`` float32 buffer the kernel reads, rewritten in
  place before each target forward.
* :func:`write_tree_attn_bias_fused`: the same bias in ONE Triton launch,
  straight from the per-state parents, ``idx_mapping`` and ``cu_num_logits``
  (no gather, no ``has_tree`` tensor, no closure matmuls); falls back to
  :func:`write_tree_attn_bias` where Triton cannot run.
* :func:`register_tree_attn_bias`: hands that buffer to the target's
  TRITON_ATTN metadata builders (before CUDA-graph capture).
* A dense, slow reference over a paged KV cache with per-request tree masks, the
  tests' oracle: ``tests/references.py`` (``reference_paged_attention``).

Rule for mixed batches (what the patched kernel does): the bias row block
``bias[s]`` is applied to sequence s of the batch only when s has exactly Q =
B+1 query tokens, and only to its first Q rows and keys. Prefill chunks and
plain decodes of another length are never touched. A request that has exactly
Q query tokens but verifies no tree (e.g. a prefill chunk of B+1 tokens) must
have an all-zero ``bias[s]``: :func:`write_tree_attn_bias` zeroes every row
whose ``has_tree`` flag is False.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ._triton import can_use_triton, launcher, next_power_of_2, tl
from .tree_mask import tree_ancestor_mask

__all__ = [
    "allocate_tree_attn_bias",
    "check_tree_parents",
    "register_tree_attn_bias",
    "write_tree_attn_bias",
    "write_tree_attn_bias_fused",
]


def check_tree_parents(node_parents: torch.Tensor) -> None:
    """Validate the agreed tree format (host sync: for tests and debugging).

    ``node_parents`` [R, B+1] int: node 0 is the root (parent -1), every other
    node has a parent with a smaller index. Raises ``ValueError`` naming the
    first problem.
    """
    if node_parents.ndim != 2 or node_parents.shape[1] < 1:
        raise ValueError(
            f"node_parents must be [num_reqs, B+1], got shape {tuple(node_parents.shape)}"
        )
    if node_parents.dtype.is_floating_point or node_parents.dtype == torch.bool:
        raise ValueError(f"node_parents must be an integer tensor, got {node_parents.dtype}")
    p = node_parents.detach().to("cpu", torch.int64)
    if (p[:, 0] != -1).any():
        r = int((p[:, 0] != -1).nonzero()[0, 0])
        raise ValueError(f"node_parents[{r}, 0] must be -1 (root), got {int(p[r, 0])}")
    if p.shape[1] > 1:
        idx = torch.arange(1, p.shape[1]).expand(p.shape[0], -1)
        bad = (p[:, 1:] < 0) | (p[:, 1:] >= idx)
        if bad.any():
            r, c = (int(x) for x in bad.nonzero()[0])
            raise ValueError(
                f"node_parents[{r}, {c + 1}] = {int(p[r, c + 1])}: a node's parent "
                "must be a valid node with a smaller index"
            )


def allocate_tree_attn_bias(
    max_num_seqs: int, num_nodes: int, device: torch.device | str
) -> torch.Tensor:
    """The persistent bias buffer: float32 [max_num_seqs, num_nodes, num_nodes].

    Allocate once, register with :func:`register_tree_attn_bias` before CUDA
    graph capture, and only ever write it in place afterwards. Zero-filled, so
    it is a no-op until a tree is written.
    """
    if max_num_seqs < 1 or num_nodes < 1:
        raise ValueError(
            f"max_num_seqs ({max_num_seqs}) and num_nodes ({num_nodes}) must be >= 1"
        )
    return torch.zeros(
        (max_num_seqs, num_nodes, num_nodes), dtype=torch.float32, device=device
    )


def write_tree_attn_bias(
    bias: torch.Tensor,
    node_parents: torch.Tensor,
    has_tree: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write this step's per-request tree bias into ``bias`` in place.

    ``bias``: the persistent buffer [max_num_seqs, Q, Q] float32.
    ``node_parents``: [R, Q] int in the batch's request order (row r is the
    r-th request of ``query_start_loc``), agreed tree format.
    ``has_tree``: optional bool [R]; rows where it is False get an all-zero
    bias (requests that verify no tree this step). Padding nodes (parent 0,
    depth 1) simply attend the root and themselves.

    Rows ``[R, max_num_seqs)`` are left as they are: the kernel reads only the
    batch's sequences, and CUDA-graph padding sequences have no query tokens.
    Returns ``bias[:R]``. No host sync; fixed shapes, so graph-capturable.
    """
    if bias.ndim != 3 or bias.shape[1] != bias.shape[2]:
        raise ValueError(f"bias must be [max_num_seqs, Q, Q], got {tuple(bias.shape)}")
    if bias.dtype != torch.float32 or not bias.is_contiguous():
        raise ValueError("bias must be a contiguous float32 tensor")
    if node_parents.ndim != 2 or node_parents.shape[1] != bias.shape[1]:
        raise ValueError(
            f"node_parents must be [num_reqs, {bias.shape[1]}], got "
            f"{tuple(node_parents.shape)}"
        )
    num_reqs = node_parents.shape[0]
    if num_reqs > bias.shape[0]:
        raise ValueError(
            f"{num_reqs} requests do not fit a bias buffer of {bias.shape[0]} rows"
        )
    if node_parents.device != bias.device:
        raise ValueError(
            f"node_parents is on {node_parents.device}, bias on {bias.device}"
        )
    allowed = tree_ancestor_mask(node_parents)
    if has_tree is not None:
        if has_tree.shape != (num_reqs,) or has_tree.dtype != torch.bool:
            raise ValueError(f"has_tree must be bool [{num_reqs}], got {has_tree.dtype} {tuple(has_tree.shape)}")
        allowed = allowed | ~has_tree[:, None, None]
    out = bias[:num_reqs]
    out.fill_(float("-inf"))
    out.masked_fill_(allowed, 0.0)
    return out


def _tree_attn_bias_kernel(
    bias_ptr,  # [>= R, Q, Q] float32, contiguous
    parents_ptr,  # [num_states, >= Q] int (row stride parents_stride)
    idx_ptr,  # [R] int: batch row r -> request state
    cu_ptr,  # [>= R + 1] int: cumulative logits per request
    q,  # Q = B + 1
    parents_stride,
    max_depth,  # walk at most this many parent steps
    ROWS: tl.constexpr,  # rows (nodes) per program
    BLOCK: tl.constexpr,  # power of two >= Q
):
    r = tl.program_id(0)
    blk = tl.program_id(1)
    state = tl.load(idx_ptr + r).to(tl.int64)
    has_tree = (tl.load(cu_ptr + r + 1) - tl.load(cu_ptr + r)) > 1
    rows = blk * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    row_ok = rows < q
    col_ok = cols < q
    allowed = rows[:, None] == cols[None, :]  # self
    # Walk every row's parent chain in lock step: cur = the current ancestor,
    # -1 once the walk passed the root (or the request has no tree).
    cur = tl.where(row_ok & has_tree, rows, -1)
    base = parents_ptr + state * parents_stride
    limit = tl.where(has_tree, max_depth, 0)
    step = 0
    while (step < limit) & (tl.max(cur, axis=0) >= 0):
        live = (cur >= 0) & (cur < q)
        nxt = tl.load(base + cur, mask=live, other=-1).to(tl.int32)
        cur = tl.where(live, nxt, -1)
        allowed = allowed | (cols[None, :] == cur[:, None])
        step += 1
    allowed = allowed | (has_tree == 0)
    val = tl.where(allowed, 0.0, float("-inf"))
    out = bias_ptr + r.to(tl.int64) * q * q + rows[:, None] * q + cols[None, :]
    tl.store(out, val, mask=row_ok[:, None] & col_ok[None, :])


def tree_attn_bias_launch_config(q: int) -> tuple[int, int, int]:
    """``(BLOCK, ROWS, num_warps)`` of the fused bias kernel for Q nodes: one
    program covers ROWS full rows (BLOCK >= Q lanes each), about 4096 elements."""
    block = next_power_of_2(max(q, 1))
    rows = max(1, min(next_power_of_2(max(q, 1)), 4096 // block))
    num_warps = min(4, max(1, (rows * block) // 512))
    return block, rows, num_warps


def write_tree_attn_bias_fused(
    bias: torch.Tensor,
    parents_by_state: torch.Tensor,
    idx_mapping: torch.Tensor,
    cu_num_logits: torch.Tensor,
    max_depth: int | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """:func:`write_tree_attn_bias` fused into one kernel launch.

    Equivalent (bitwise, 0.0 / -inf) to::

        R = idx_mapping.shape[0]
        has_tree = (cu_num_logits[1:R+1] - cu_num_logits[:R]) > 1
        write_tree_attn_bias(bias, parents_by_state[idx_mapping], has_tree)

    for valid trees (root parent -1, ``0 <= parent < child`` otherwise) whose
    depth is at most ``max_depth``.

    ``bias``: the persistent [max_num_seqs, Q, Q] float32 buffer (contiguous).
    ``parents_by_state``: [num_states, Q] int32/int64, the trees by request
    state (any row stride, unit column stride).
    ``idx_mapping``: [R] int, batch row r -> state; R is its length.
    ``cu_num_logits``: [>= R+1] int; request r verifies a tree iff it has more
    than one logit. Rows without a tree get all zeros.
    ``max_depth``: a bound on every tree's depth (the drafter's D); the walk
    stops after this many parent steps, or earlier once every walk reached
    the root. Default Q - 1 (always enough).
    ``backend``: ``"auto"`` (Triton where it can run: CUDA, or CPU with
    ``TRITON_INTERPRET=1``; else the torch path), ``"triton"`` or ``"torch"``.

    All Q rows of ``bias[r]`` are written from the parents, also those past the
    request's query length (prefix verification reads only the first rows and
    columns). Rows ``[R, max_num_seqs)`` are untouched. Returns ``bias[:R]``.
    No host sync; fixed shapes, so graph-capturable.
    """
    if bias.ndim != 3 or bias.shape[1] != bias.shape[2]:
        raise ValueError(f"bias must be [max_num_seqs, Q, Q], got {tuple(bias.shape)}")
    if bias.dtype != torch.float32 or not bias.is_contiguous():
        raise ValueError("bias must be a contiguous float32 tensor")
    q = bias.shape[1]
    if parents_by_state.ndim != 2 or parents_by_state.shape[1] != q:
        raise ValueError(
            f"parents_by_state must be [num_states, {q}], got {tuple(parents_by_state.shape)}"
        )
    for name, t in (("parents_by_state", parents_by_state), ("idx_mapping", idx_mapping),
                    ("cu_num_logits", cu_num_logits)):
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
        if t.device != bias.device:
            raise ValueError(f"{name} is on {t.device}, bias on {bias.device}")
    if idx_mapping.ndim != 1 or cu_num_logits.ndim != 1:
        raise ValueError("idx_mapping and cu_num_logits must be 1-D")
    num_reqs = idx_mapping.shape[0]
    if num_reqs > bias.shape[0]:
        raise ValueError(
            f"{num_reqs} requests do not fit a bias buffer of {bias.shape[0]} rows"
        )
    if cu_num_logits.shape[0] < num_reqs + 1:
        raise ValueError(
            f"cu_num_logits has {cu_num_logits.shape[0]} entries, need >= {num_reqs + 1}"
        )
    if max_depth is None:
        max_depth = q - 1
    if max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")
    out = bias[:num_reqs]
    if backend == "auto":
        backend = "triton" if can_use_triton(bias, parents_by_state, idx_mapping, cu_num_logits) else "torch"
    if backend == "torch":
        has_tree = (cu_num_logits[1 : num_reqs + 1] - cu_num_logits[:num_reqs]) > 1
        return write_tree_attn_bias(bias, parents_by_state[idx_mapping.long()], has_tree)
    if backend != "triton":
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if not can_use_triton(bias, parents_by_state, idx_mapping, cu_num_logits):
        raise RuntimeError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    if num_reqs == 0:
        return out
    if parents_by_state.stride(1) != 1:
        parents_by_state = parents_by_state.contiguous()
    block, rows, num_warps = tree_attn_bias_launch_config(q)
    grid = (num_reqs, (q + rows - 1) // rows)
    launcher(_tree_attn_bias_kernel)[grid](
        bias,
        parents_by_state,
        idx_mapping,
        cu_num_logits,
        q,
        parents_by_state.stride(0),
        min(int(max_depth), q - 1) if q > 1 else 0,
        ROWS=rows,
        BLOCK=block,
        num_warps=num_warps,
    )
    return out


# Backends whose patched builders apply the tree bias, and the patch that adds it.
TREE_BIAS_PATCHES = {
    "TRITON_ATTN": "patches/attention_triton-per-request-tree-bias.patch",
    "FLASH_ATTN": "patches/attention_flash-attn-tree-split.patch",
}


def register_tree_attn_bias(attn_groups: Iterable, bias: torch.Tensor) -> int:
    """Point the target's attention metadata builders at ``bias``.

    ``attn_groups``: the target model runner's attention groups (a list of
    lists of ``vllm.v1.worker.utils.AttentionGroup``, or a flat list). Needs
    the patched vLLM (``tree_attn_bias`` attribute on the builder); raises a
    clear error when a group uses a backend that cannot apply the tree mask
    (TRITON_ATTN, or FLASH_ATTN with ``VLLM_DDTREE_TREE_ATTENTION=flash``). Call
    before CUDA-graph capture. Never pass the drafter's groups: the drafter
    attends without a tree mask. Returns the number of builders set.
    """
    count = 0
    for group in _flatten(attn_groups):
        backend_name = group.backend.get_name()
        if backend_name not in TREE_BIAS_PATCHES:
            raise ValueError(
                f"DDTree tree verification needs attention backend TRITON_ATTN (or "
                f"FLASH_ATTN with VLLM_DDTREE_TREE_ATTENTION=flash) for the target, but "
                f"layers {group.layer_names[:3]}... use {backend_name}; "
                'start vLLM with attention_config={"backend": "TRITON_ATTN"}'
            )
        for builder in group.metadata_builders:
            if not hasattr(builder, "tree_attn_bias"):
                raise RuntimeError(
                    f"this vLLM lacks the tree_attn_bias hook of {backend_name}: apply "
                    f"{TREE_BIAS_PATCHES[backend_name]}"
                )
            builder.tree_attn_bias = bias
            count += 1
    return count


def _flatten(groups: Iterable) -> Iterable:
    for g in groups:
        if isinstance(g, (list, tuple)):
            yield from _flatten(g)
        else:
            yield g


