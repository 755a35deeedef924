"""Tree verification, drafter-agnostic: what any tree drafter (DFlash here; an EAGLE-3 or
MTP tree drafter alike) needs to have its trees verified exactly in one target forward.

Per step, all on the GPU and without host syncs, in the order vLLM's V2 runner calls it:

1. :meth:`TreeVerifier.prepare` (the runner hook before the target forward, after the
   slot mapping was computed from linear positions): each tree request's positions
   become ``start + depth`` and its ancestor-only bias is written into the persistent
   buffer the patched attention backends read. It opens the step's :class:`TreeStep`.
2. :class:`DDTreeSampler` replaces the chain rejection sampler: one target sample per
   node with vLLM's own sampler (argmax at T=0; at T>0 Gumbel noise keyed by seed and
   position = start + depth), then the walk down the tree
   (:func:`vllm_ddtree.tree_walk.walk_tree`), recorded in the step. Output rows are the
   accepted path plus the bonus token, in the runner's format.
3. :meth:`TreeVerifier.compact` (from the drafter's ``propose``, which vLLM calls after
   every sampling step): the accepted nodes' KV moves to slots ``start + j`` in every
   target layer, the hidden states the drafter reads and the positions likewise, and
   the step closes.

Trees live by request state (a request may sit out steps): the drafter hands its trees
in batch order to :meth:`TreeVerifier.store_trees`; :meth:`TreeVerifier.clear_trees`
makes them root-only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from vllm.logger import init_logger
from vllm.v1.worker.gpu.input_batch import InputBatch, get_num_sampled_and_rejected
from vllm.v1.worker.gpu.metrics.logits import get_num_nans
from vllm.v1.worker.gpu.sample.output import SamplerOutput
from vllm.v1.worker.gpu.sample.sampler import Sampler
from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS

from vllm_ddtree import pin_calls
from vllm_ddtree.kv_compaction import (
    accepted_path_moves,
    build_kv_ptr_table,
    compact_accepted_path_,
    compact_kv_cache_,
)
from vllm_ddtree.tree_attention import (
    allocate_tree_attn_bias,
    write_tree_attn_bias,
    write_tree_attn_bias_fused,
)
from vllm_ddtree.tree_builder import store_trees_by_state_, store_trees_by_state_torch_
from vllm_ddtree.tree_mask import rewrite_tree_positions_
from vllm_ddtree.tree_walk import step_walk_outputs, walk_tree, walk_tree_fused

logger = init_logger("vllm.ddtree.tree_verifier")


def clear_trees_(valid_by_state: torch.Tensor, idx_mapping: torch.Tensor,
                 no_tree: torch.Tensor) -> None:
    """Make the trees of the states in ``idx_mapping`` root-only (every node but the
    root invalid). ``no_tree`` is a 0-dim ``False`` on the device: a Python ``False``
    in an indexed assignment is copied from pageable host memory with a stream
    synchronisation on every call, which on a budget-0 step (one call a step) stalled
    the host until the GPU had finished the step and undid asynchronous scheduling's
    overlap (bench/results/2026-12-01-budget-0-host-sync/)."""
    valid_by_state[idx_mapping, 1:] = no_tree


@dataclass
class TreeStep:
    """One step's verification, handed from the runner hook (:meth:`TreeVerifier.prepare`)
    to the sampler (the walk) to the drafter's ``propose`` (:meth:`TreeVerifier.compact`).

    ``next_budget``: the drafts per request the scheduler verifies after this step (its
    ``num_spec_tokens_to_schedule``: what the drafter drafts now; 0 = none).
    ``verified_rows``: the logit rows of the tree requests (None: no tree verified);
    ``linear_positions``: their positions before the depth rewrite; ``accepted_nodes``,
    ``num_accepted``: the walk's path ([R, D+1] node indices) and lengths."""

    next_budget: int
    verified_rows: torch.Tensor | None = None
    linear_positions: torch.Tensor | None = None
    accepted_nodes: torch.Tensor | None = None
    num_accepted: torch.Tensor | None = None

    @property
    def pending_compaction(self) -> bool:
        """A walk over verified trees whose accepted path is not compacted yet."""
        return self.verified_rows is not None and self.accepted_nodes is not None


class TreeVerifier:
    """The by-state trees, the tree bias and the per-step :class:`TreeStep` of one
    engine's target (module docstring)."""

    def __init__(self, max_num_reqs: int, tree_budget: int, tree_depth: int,
                 max_num_tokens: int, device: torch.device | str, fused_kernels: bool,
                 profiler: Any = None, rank_trace: Any = None) -> None:
        self.tree_budget = tree_budget
        self.tree_depth = tree_depth
        self.num_tree_nodes = tree_budget + 1
        self.fused_kernels = fused_kernels
        self.profiler = profiler
        # Opt-in: what this rank verified each step (VLLM_DDTREE_RANK_TRACE).
        self.rank_trace = rank_trace
        shape = (max_num_reqs, self.num_tree_nodes)
        self.parents_by_state = torch.zeros(shape, dtype=torch.int32, device=device)
        self.depths_by_state = torch.zeros(shape, dtype=torch.int32, device=device)
        self.valid_by_state = torch.zeros(shape, dtype=torch.bool, device=device)
        self.tokens_by_state = torch.zeros(shape, dtype=torch.int64, device=device)
        # The value clear_trees_ writes, kept on the device.
        self._no_tree = torch.zeros((), dtype=torch.bool, device=device)
        # States that may hold a tree beyond the root (host side): a budget-0 step
        # clears only those, so a run of budget-0 steps launches the reset once, not
        # every step (its indexed assignment took ~60 us of host time a step,
        # bench/results/2026-12-02-gap-profile-budget-0-t1-batch-4/).
        # None does yet: ``valid_by_state`` starts all False.
        self._may_hold_tree = np.zeros(max_num_reqs, dtype=bool)
        # Whether any state may: while drafting is off none does once their trees are
        # reset, and a budget-0 step then skips even the lookup above (host time).
        self._any_tree = False
        # Per-request ancestor-only bias read by the patched attention backends.
        self.tree_attn_bias = allocate_tree_attn_bias(max_num_reqs, self.num_tree_nodes, device)
        # Linear positions of the verified rows (one per logit), restored after the walk.
        self._linear_positions_buf = torch.zeros(max_num_tokens, dtype=torch.int64,
                                                 device=device)
        self.step = TreeStep(next_budget=tree_budget)
        # The target's KV caches, resolved from the layers on first use.
        self._kv_source: Callable[[], list[tuple[str, torch.Tensor]]] | None = None
        self._kv_caches: list[torch.Tensor] = []
        self._kv_layer_name: str | None = None
        self._kv_ptr_table = None

    # ------------------------------------------------------------------- set-up

    def set_kv_source(self, layer_caches: Callable[[], list[tuple[str, torch.Tensor]]]) -> None:
        """Where the target's KV caches are: ``layer_caches()`` gives (layer name, cache)
        per target layer once the caches are allocated (read on the first compaction)."""
        self._kv_source = layer_caches
        self._kv_caches = []
        self._kv_ptr_table = None

    def kv_caches(self) -> list[torch.Tensor]:
        if not self._kv_caches:
            assert self._kv_source is not None, "set_kv_source was not called"
            named = self._kv_source()
            self._kv_caches = [cache for _, cache in named]
            self._kv_layer_name = named[0][0]
            if self.fused_kernels:
                try:
                    self._kv_ptr_table = build_kv_ptr_table(
                        self._kv_caches, "vllm", [name for name, _ in named])
                except ValueError as exc:
                    # E.g. layers whose caches differ in shape: compact layer by layer.
                    logger.warning("ddtree: one-launch KV compaction unavailable (%s); "
                                   "compacting layer by layer", exc)
                    self._kv_ptr_table = None
        return self._kv_caches

    # -------------------------------------------------------------------- trees

    def store_trees(self, trees: Any, idx_mapping: torch.Tensor,
                    idx_mapping_np: np.ndarray | None = None) -> None:
        """A step's trees (``TreeBuffers`` in batch order) into the by-state tables the
        next verification reads. ``idx_mapping_np``: the same states on the host (None:
        any state may now hold a tree)."""
        if idx_mapping_np is None:
            self._may_hold_tree[:] = True
        else:
            self._may_hold_tree[idx_mapping_np] = True
        self._any_tree = True
        by_state = (self.tokens_by_state, self.parents_by_state, self.depths_by_state,
                    self.valid_by_state)
        if self.fused_kernels:
            store_trees_by_state_(trees, idx_mapping, *by_state)
        else:
            store_trees_by_state_torch_(trees, idx_mapping, *by_state)

    def clear_trees(self, idx_mapping: torch.Tensor,
                    idx_mapping_np: np.ndarray | None = None) -> None:
        """Make the trees of these states root-only; with ``idx_mapping_np`` (the same
        states on the host) nothing is launched when none of them may hold a tree."""
        if idx_mapping_np is not None:
            if not self._any_tree or not self._may_hold_tree[idx_mapping_np].any():
                return
            self._may_hold_tree[idx_mapping_np] = False
            self._any_tree = bool(self._may_hold_tree.any())
        clear_trees_(self.valid_by_state, idx_mapping, self._no_tree)

    # ------------------------------------------------------------------ the step

    def prepare(self, input_batch: InputBatch, next_budget: int) -> None:
        """Runner hook before the target forward: depth positions and tree masks, and a
        new :class:`TreeStep`."""
        if self.step.pending_compaction:
            # The last walk's accepted path is compacted in propose(); a step that
            # verifies again before that would read KV and drafter context from the
            # wrong slots. vLLM's runner proposes after every sampling step: if that
            # ever changes, stop here instead of serving wrong tokens.
            raise RuntimeError(
                "DDTree: a tree was verified again before the accepted path of the "
                "previous verification was compacted (the runner did not call "
                "propose() after the tree walk); the runner's step order has changed "
                "and DDTree cannot serve it"
            )
        step = self.step = TreeStep(next_budget=int(next_budget))
        num_reqs = input_batch.num_reqs
        if self.profiler is not None:
            # Tokens beyond each request's root and drafts are prompt tokens.
            with_prefill = input_batch.num_tokens > num_reqs + input_batch.num_draft_tokens
            self.profiler.mark("verify", num_reqs, with_prefill, input_batch.num_tokens)
        if self.rank_trace is not None:
            self.rank_trace.record(num_reqs, input_batch.num_tokens,
                                   input_batch.num_draft_tokens, step.next_budget)
        if input_batch.num_draft_tokens == 0 and input_batch.num_tokens == num_reqs:
            # One query token per request (decodes without drafts, budget-0 steps):
            # attention reads only bias[r, 0, 0], which is 0 in every tree written
            # and in the zeroed buffer, so the bias needs no rewrite.
            return
        idx_mapping = input_batch.idx_mapping
        cu = input_batch.cu_num_logits
        if self.fused_kernels:
            write_tree_attn_bias_fused(
                self.tree_attn_bias, self.parents_by_state, idx_mapping, cu, self.tree_depth
            )
        else:
            has_tree = (cu[1 : num_reqs + 1] - cu[:num_reqs]) > 1
            write_tree_attn_bias(
                self.tree_attn_bias, self.parents_by_state[idx_mapping], has_tree
            )
        if input_batch.num_draft_tokens == 0:
            return
        # Logit rows of tree requests are exactly their tokens: root + drafts.
        rows = input_batch.logits_indices
        positions = input_batch.positions
        if self.fused_kernels:
            # One launch: positions[row] = (root + l) - l + depth, linear saved.
            step.linear_positions = rewrite_tree_positions_(
                positions,
                rows,
                input_batch.expanded_local_pos,
                input_batch.expanded_idx_mapping,
                self.depths_by_state,
                self._linear_positions_buf,
            )
        else:
            local = input_batch.expanded_local_pos.to(torch.int64)
            depth = self.depths_by_state[input_batch.expanded_idx_mapping, local]
            step.linear_positions = positions[rows].clone()
            root_position = positions[rows - local]
            positions[rows] = root_position + depth.to(positions.dtype)
        step.verified_rows = rows

    def record_walk(self, accepted_nodes: torch.Tensor, num_accepted: torch.Tensor) -> None:
        self.step.accepted_nodes = accepted_nodes
        self.step.num_accepted = num_accepted

    def compact(self, input_batch: InputBatch, slot_mappings: dict[str, torch.Tensor],
                hidden_states: torch.Tensor) -> None:
        """Close the step: the accepted path's KV (every target layer), ``hidden_states``
        rows and positions moved to ``start + j`` when trees were verified."""
        step = self.step
        if step.pending_compaction:
            self._compact_accepted_path(step, input_batch, slot_mappings, hidden_states)
        self.end_step()

    def end_step(self) -> None:
        """Close the step without compaction (it verified no trees)."""
        self.step = TreeStep(next_budget=self.step.next_budget)

    def _compact_accepted_path(self, step: TreeStep, input_batch: InputBatch,
                               slot_mappings: dict[str, torch.Tensor],
                               hidden_states: torch.Tensor) -> None:
        rows = step.verified_rows
        assert rows is not None and step.linear_positions is not None
        assert step.accepted_nodes is not None and step.num_accepted is not None
        kv_caches = self.kv_caches()
        slots = slot_mappings[self._kv_layer_name]
        if self.fused_kernels and self._kv_ptr_table is not None:
            # One launch: the accepted path's hidden rows and KV in every layer, and
            # the positions back to linear (a request's rows are consecutive from its
            # root, so row start + j, which holds the depth-j node after the copy,
            # gets start + j). The table was built from these very caches.
            self._kv_ptr_table = compact_accepted_path_(
                kv_caches,
                hidden_states,
                step.accepted_nodes,
                step.num_accepted,
                input_batch.query_start_loc,
                slots,
                kv_ptr_table=self._kv_ptr_table,
                positions=input_batch.positions,
                check_table=False,
            )
            return
        # Positions back to linear: row start + j holds the depth-j node after the
        # copy below, whose position is start + j.
        input_batch.positions[rows] = step.linear_positions
        # Unfused (VLLM_DDTREE_FUSED_KERNELS=0, or caches that differ per layer):
        # the same moves, hidden rows by gather-then-scatter, KV layer by layer.
        src_rows, dst_rows, src_slots, dst_slots = accepted_path_moves(
            step.accepted_nodes, step.num_accepted, input_batch.query_start_loc, slots
        )
        # Non-moves copy row 0 onto itself (no move ever targets row 0: the root
        # stays where it is).
        hidden_states[dst_rows.clamp(min=0)] = hidden_states[src_rows.clamp(min=0)]
        for kv_cache in kv_caches:
            compact_kv_cache_(
                kv_cache,
                src_slots,
                dst_slots,
                "vllm",
                moves_per_group=self.tree_depth + 1,
            )


class DDTreeSampler:
    """Replaces the chain rejection sampler: one target sample per tree node, then
    the walk down the tree. Lossless: see :mod:`vllm_ddtree.tree_walk`."""

    # vLLM 0.33.0's runner reads this from its rejection sampler (kernel warm-up);
    # config.py refuses adaptive verification with method ddtree.
    enable_adaptive_verification = False

    def __init__(self, sampler: Sampler, verifier: TreeVerifier):
        self.sampler = sampler
        self.verifier = verifier
        self.num_tree_nodes = verifier.num_tree_nodes
        self.tree_depth = verifier.tree_depth

    def __call__(
        self,
        logits: torch.Tensor,
        input_batch: InputBatch,
        draft_logits: torch.Tensor | None = None,
        invalid_drafts: torch.Tensor | None = None,
    ) -> SamplerOutput:
        # Called as the runner calls its rejection sampler (reach-in
        # RejectionSampler.__call__). ``invalid_drafts`` (vLLM 0.33.0) marks the logit
        # rows of grammar requests past the drafts their grammar accepts. A request
        # with a grammar is decoded without drafts (TREE_WITHOUT_DRAFTS_REQUEST_FIELDS):
        # its one row sits at local position 0, which the mask never marks, so no row
        # of a tree is ever marked and the walk needs no change.
        sampler = self.sampler
        verifier = self.verifier
        profiler = verifier.profiler
        if profiler is not None:
            profiler.mark("sample")
        num_nans = get_num_nans(logits) if sampler.compute_nans else None
        return_logprobs = pin_calls.returns_logprobs(sampler, input_batch.idx_mapping_np)
        # pos = start + depth for tree rows (set by TreeVerifier.prepare), so seeded
        # Gumbel noise is keyed exactly as without speculation. With raw logprobs
        # asked for, vLLM's sampler processes a copy: ``logits`` stays raw.
        pos = input_batch.positions[input_batch.logits_indices]
        input_ids = input_batch.input_ids[input_batch.logits_indices]
        node_samples, processed_logits = pin_calls.sampler_sample(
            sampler, logits, input_batch, pos, input_ids, return_logprobs)

        cu = input_batch.cu_num_logits
        idx_mapping = input_batch.idx_mapping
        if verifier.fused_kernels:
            # One launch: node i of request r is logit row cu[r] + i; nodes the
            # scheduler did not schedule (a prefix of the tree was verified) and
            # requests without a tree are never accepted.
            # Fresh outputs every step: output_tokens becomes the runner's sampled
            # tokens, which vLLM may still be copying to the host asynchronously when
            # the next step samples; aligned at every batch size (no JIT while serving).
            out = step_walk_outputs(input_batch.num_reqs, self.tree_depth, logits.device)
            walk = walk_tree_fused(
                node_samples,
                cu,
                idx_mapping,
                verifier.tokens_by_state,
                verifier.parents_by_state,
                verifier.valid_by_state,
                self.tree_depth,
                out=out,
            )
        else:
            walk = self._walk_unfused(logits, input_batch, node_samples)
        verifier.record_walk(walk.accepted_nodes, walk.num_accepted)
        if profiler is not None:
            profiler.mark("walked")

        logprobs_tensors = None
        if return_logprobs:
            processed = sampler.logprobs_mode in ("processed_logprobs", "processed_logits")
            logprobs_tensors = self._path_logprobs(
                processed_logits if processed else logits, input_batch, walk)

        num_sampled, num_rejected = get_num_sampled_and_rejected(
            walk.num_output.to(torch.int32),
            input_batch.seq_lens,
            cu,
            idx_mapping,
            sampler.req_states.prefill_len.gpu,
        )
        return SamplerOutput(
            sampled_token_ids=walk.output_tokens,
            logprobs_tensors=logprobs_tensors,
            num_nans=num_nans,
            num_sampled=num_sampled,
            num_rejected=num_rejected,
        )

    def _path_logprobs(self, logits: torch.Tensor, input_batch: InputBatch, walk) -> Any:
        """Logprobs of the emitted tokens, in the layout vLLM's rejection sampler gives
        a chain: row ``cu[r] + j`` holds request r's j-th output token with the scores
        of the logit row it was sampled from, the row of the accepted path's depth-j
        node (the root for j = 0; the bonus token's node for the last). Rows past a
        request's outputs keep their own logits and are never read. Computed by
        vLLM's ``compute_topk_scores`` (top-k, the requested token ids, ranks), so the
        values are the target's at those nodes, as plain decoding computes them at
        the same positions."""
        from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores

        sampler = self.sampler
        num_logits = logits.shape[0]
        num_reqs = input_batch.num_reqs
        cu = input_batch.cu_num_logits
        rows = torch.arange(num_logits, device=logits.device)
        local = input_batch.expanded_local_pos.to(torch.int64)
        # The batch row of each logit row: requests' rows are consecutive from cu[r].
        req = torch.searchsorted(cu[1 : num_reqs + 1].to(torch.int64), rows, right=True)
        depth = local.clamp(max=self.tree_depth)
        on_path = local < walk.num_output.to(torch.int64)[req]
        node = walk.accepted_nodes.to(torch.int64)[req, depth]
        path_logits = logits[torch.where(on_path, (rows - local) + node.clamp(min=0), rows)]
        tokens = torch.where(on_path, walk.output_tokens.to(torch.int64)[req, depth],
                             torch.zeros_like(rows))
        max_num_logprobs = sampler.sampling_states.max_num_logprobs(input_batch.idx_mapping_np)
        expanded = num_logits != input_batch.idx_mapping_np.shape[0]
        return compute_topk_scores(
            path_logits,
            max_num_logprobs if max_num_logprobs != NO_LOGPROBS else 0,
            tokens,
            input_batch.cu_num_logits_np.tolist() if expanded else None,
            logprob_token_ids_state=sampler.logprob_token_ids_state,
            expanded_idx_mapping=input_batch.expanded_idx_mapping,
            max_per_req_token_ids=sampler.logprob_token_ids_state.max_num_token_ids(
                input_batch.idx_mapping_np),
            logits_mode=sampler.logprobs_mode in ("raw_logits", "processed_logits"),
        )

    def _walk_unfused(self, logits, input_batch: InputBatch, node_samples):
        """The multi-launch walk (VLLM_DDTREE_FUSED_KERNELS=0): same result."""
        num_reqs = input_batch.num_reqs
        device = logits.device
        cu = input_batch.cu_num_logits
        num_logits = logits.shape[0]
        logit_req = torch.searchsorted(
            cu[1 : num_reqs + 1],
            torch.arange(num_logits, device=device, dtype=cu.dtype),
            right=True,
        )
        local = input_batch.expanded_local_pos.to(torch.int64)
        target_tokens = torch.zeros(
            (num_reqs, self.num_tree_nodes), dtype=torch.int64, device=device
        )
        target_tokens[logit_req, local] = node_samples.to(torch.int64)

        spec = self.verifier
        idx_mapping = input_batch.idx_mapping
        num_nodes = (cu[1 : num_reqs + 1] - cu[:num_reqs]).to(torch.int64)
        node_index = torch.arange(self.num_tree_nodes, device=device)[None, :]
        # Nodes the scheduler did not schedule (drafts cut near max_model_len or by
        # the token budget) and requests without a tree are never accepted.
        valid = spec.valid_by_state[idx_mapping] & (node_index < num_nodes[:, None])
        walk = walk_tree(
            spec.tokens_by_state[idx_mapping],
            spec.parents_by_state[idx_mapping],
            valid,
            target_tokens,
            self.tree_depth,
        )
        return walk
