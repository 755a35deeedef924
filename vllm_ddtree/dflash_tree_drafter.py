"""DDTree speculator for vLLM's V2 model runner (``vllm/v1/worker/gpu``): the DFlash
tree drafter, and vLLM's speculator interface around it.

Verification is :mod:`vllm_ddtree.tree_verifier` (drafter-agnostic: depth positions
and tree bias before the target forward, one target sample per node and the walk, the
accepted path's compaction), which this speculator holds as ``self.verifier`` and calls
at the runner's hooks. What is DFlash's here, per step, after the walk
(:meth:`DDTreeSpeculator.propose`): the drafter's context (the target's hidden states
of the accepted tokens into its KV cache), its one forward over the masked positions,
and the best-first tree of the step's budget from its per-position logits
(:func:`vllm_ddtree.tree_builder.build_trees`), whose tokens become next step's draft
tokens and whose parents and depths go to the verifier by request state. A step whose
budget is 0 stores only the drafter's context (one CUDA graph when the step verified no
drafts).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.logger import init_logger
from vllm.v1.worker.gpu.input_batch import InputBatch
from vllm.v1.worker.gpu.sample.sampler import Sampler
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

from vllm_ddtree._triton import direct_launch_enabled
from vllm_ddtree.budget import draft_shape, drafting_budgets, table_ranges
from vllm_ddtree.config import is_dflash2_drafter
from vllm_ddtree.context_store_graphs import (
    ContextStoreGraphs,
    context_graphs_enabled,
    padded_graph_size,
)
from vllm_ddtree.deferred_context import DeferredContext, deferral_capacity
from vllm_ddtree.dflash_input_warmup import warm_up_dflash_input_kernel
from vllm_ddtree import env, pin_calls
from vllm_ddtree.kv_layout import check_tree_kv_layout
from vllm_ddtree.logits_warmup import max_tree_step_rows, warm_up_logits_rows
from vllm_ddtree.online_budget import graph_budget_levels, online_budget_on
from vllm_ddtree.reach_ins import check_reach_ins
from vllm_ddtree.rank_trace import RankTrace
from vllm_ddtree.step_profile import StepProfiler
from vllm_ddtree.tree_attention import register_tree_attn_bias
from vllm_ddtree.tree_builder import build_trees, empty_tree, fill_root_only_trees_
from vllm_ddtree.tree_verifier import DDTreeSampler, TreeVerifier

# One Triton launch each for the tree bias, the tree positions, the walk (with the
# sample gather), the compaction (all KV layers + hidden states + positions restore)
# and the copy of the new trees into the by-state tables.
# VLLM_DDTREE_FUSED_KERNELS=0 selects the earlier multi-launch torch/Triton paths
# (same results), e.g. to bisect a problem.
fused_kernels_enabled = env.fused_kernels_enabled


# VLLM_DDTREE_LEAN_DRAFT=1: the drafter computes logits and builds trees only as deep
# and wide as the step's budget needs (vllm_ddtree.budget.draft_shape; the verified
# trees are the same up to top-K ties): with a fixed batch-aware table inside the
# drafter's graphs, with the online controller in an eager head after them that
# follows the step's level. Off by default: on the H200 with the benchmark pair the
# table form made the batch-64 drafting stage slower, not faster (1.97 -> 3.43 ms p50,
# bench/results/2026-11-29-drafting-off-lean-drafting/), for a reason not yet found;
# the online form is not measured yet.
lean_draft_enabled = env.lean_draft_enabled


# Under vLLM's logger, so its handler and level apply (a logger outside the "vllm"
# tree only prints warnings, through Python's last-resort handler).
logger = init_logger("vllm.ddtree.speculator")


class DDTreeSpeculator(DFlashSpeculator):
    _speculator_name = "DDTree"
    # VLLM_DDTREE_DEFER_CONTEXT (on by default): budget-0 decode steps buffer the drafter's context
    # instead of storing it (vllm_ddtree.deferred_context); the buffer is allocated with
    # the drafter (load_model), before vLLM measures memory. None: stored every step.
    _deferred: DeferredContext | None = None
    # (the runner's slot mappings, the views of its rows the drafter's context goes to)
    _deferred_slot_rows: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None

    def __init__(self, vllm_config: VllmConfig, device: torch.device):
        # vLLM/Triton internals this package relies on still have their shape (once
        # per process; vllm_ddtree/reach_ins.py).
        check_reach_ins()
        # DraftModelSpeculator sizes draft_tokens by num_speculative_tokens = B, the
        # tree budget, which is what the runner schedules and stores per request.
        super().__init__(vllm_config, device)
        spec = vllm_config.speculative_config
        self.tree_budget: int = spec.num_speculative_tokens
        self.tree_depth: int = spec.ddtree_max_depth
        self.tree_top_k: int = spec.ddtree_top_k

        # The drafter itself predicts `tree_depth` positions per pass.
        self.num_speculative_steps = self.tree_depth
        self.num_query_per_req = 1 + self.tree_depth
        max_num_sampled = self.max_num_reqs * self.tree_depth
        self.sample_indices = torch.zeros(max_num_sampled, dtype=torch.int64, device=device)
        self.sample_pos = torch.zeros(max_num_sampled, dtype=torch.int64, device=device)
        self.sample_idx_mapping = torch.zeros(
            max_num_sampled, dtype=self.sample_idx_mapping.dtype, device=device
        )
        self.sample_col = torch.arange(
            self.tree_depth, dtype=torch.int32, device=device
        ).repeat(self.max_num_reqs)
        # The tree is built from the drafter's logits, not from sampled drafts.
        self.draft_logits = None
        # propose() hands DFlash's propose the target's hidden states combined and
        # compacted, and no auxiliary states: a FULL drafter graph of vLLM 0.33.0 must
        # read those (self.hidden_states) instead of combining staged auxiliary states.
        self._aux_staging = None
        # A DFlash2 drafter (vLLM 0.33.0) ranks its candidates with its own logits
        # processor (output scale, soft cap); the trees take its per-position logits.
        self._candidate_head = is_dflash2_drafter(self.draft_model_config.hf_config)

        # This step's trees, in batch order (written inside the drafter graph).
        self.trees = empty_tree(self.max_num_reqs, self.tree_budget, device)
        self.fused_kernels = fused_kernels_enabled()
        # Opt-in per-stage GPU times (VLLM_DDTREE_PROFILE=<path.json>).
        self.profiler = StepProfiler.from_env()
        # Verification of the trees (drafter-agnostic): by-state trees, tree bias,
        # positions, the walk and the accepted path's compaction, one TreeStep a step.
        self.verifier = TreeVerifier(self.max_num_reqs, self.tree_budget, self.tree_depth,
                                     self.max_num_tokens, device, self.fused_kernels,
                                     self.profiler, RankTrace.from_env())
        # Budget to draft for, by the batch size the drafter runs at (None: always the
        # full tree). The scheduler's lookup is vLLM's own, so both agree; graph padding
        # is accounted for once the drafter's graphs are known (init_cudagraph_manager).
        self.online_budget = online_budget_on(spec)
        self.refresh_budget_schedule()
        # Lean drafting with the online controller: any step may verify any level, so
        # the drafter's graph runs its transformer only and keeps the hidden states of
        # the masked positions here; the logits, top-K and tree then follow the level
        # the controller chose for the step (_draft_level, after the graph).
        self._draft_hidden: torch.Tensor | None = (
            torch.zeros(self.max_num_reqs * self.tree_depth, self.hidden_size,
                        dtype=self.dtype, device=device)
            if self.online_budget and lean_draft_enabled() else None)
        self._heads_warm = False
        # The target's logits GEMM is warmed up once a process (cuBLAS keeps its choices).
        self._logits_warm = False
        # True while propose() runs for memory profiling: draft the full tree there,
        # so the profile sees the largest drafting buffers.
        self._profiling_draft = False
        # The drafter's context store as CUDA graphs (captured with the drafter's).
        self.context_graphs_wanted = context_graphs_enabled()
        self._context_graphs: ContextStoreGraphs | None = None
        self._decode_context_graphs: ContextStoreGraphs | None = None
        # vLLM's DFlash input kernel is compiled for every block size after the first
        # drafting step (vllm_ddtree.dflash_input_warmup).
        self._input_kernel_warm = False
        if self.profiler is not None:
            self.profiler.info = {"tree_budget": self.tree_budget, "tree_depth": self.tree_depth}
        logger.info(
            "DDTree: budget %d nodes, depth %d, top-k %d per position, %s kernels%s",
            self.tree_budget,
            self.tree_depth,
            self.tree_top_k,
            "fused" if self.fused_kernels else "unfused",
            ", direct launches" if direct_launch_enabled() else "",
        )

    # ----------------------------------------------------------------- set-up

    def _scheduler_budget_lookup(self, vllm_config: VllmConfig) -> list[int] | None:
        """The scheduler's tree budget by batch size (index = batch size), or None when
        every step verifies the full budget."""
        schedule = vllm_config.speculative_config.num_speculative_tokens_per_batch_size
        if not schedule:
            return None
        from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

        return build_dynamic_sd_schedule_lookup(
            schedule,
            vllm_max_batch_size=self.max_num_reqs,
            vllm_num_speculative_tokens=self.tree_budget,
        )

    def _aux_width(self) -> int | None:
        """Width of the target's concatenated auxiliary hidden states the drafter's
        ``fc`` takes; None for a drafter that takes none."""
        inner = getattr(self.model, "model", None)
        width = getattr(getattr(inner, "fc", None), "input_size", None)
        if not getattr(inner, "use_aux_hidden_state", False) or not isinstance(width, int):
            return None
        return width

    def _context_slot_rows(self) -> list[int]:
        """Rows of the runner's slot mappings (``block_tables.slot_mappings``) that the
        drafter's context goes to: one per drafter layer with per-layer KV groups, else
        the one drafter group's."""
        gids = self.draft_kv_cache_group_ids
        if self._layer_group_idx is not None:
            return [gids[g] for g in self._layer_group_idx]
        return [gids[0]]

    def load_model(self, target_model, *args: Any, **kwargs: Any) -> None:
        super().load_model(target_model, *args, **kwargs)
        # The target's logits over a tree step's rows, warmed up at capture.
        self._target_compute_logits = getattr(target_model, "compute_logits", None)
        if env.defer_context_enabled():
            width = self._aux_width()
            if width is None:
                if env.defer_context_requested():
                    raise ValueError(
                        "VLLM_DDTREE_DEFER_CONTEXT=1 needs a drafter that takes the target's "
                        "auxiliary hidden states through fc (a DFlash drafter); this one "
                        "does not")
                logger.info("DDTree: the drafter takes no auxiliary hidden states, so its "
                            "context is stored every step while drafting is off")
                return
            # A slot row per drafter layer at most (per-layer KV groups).
            layers = getattr(getattr(self.model, "model", None), "layers", None)
            self._deferred = DeferredContext(
                deferral_capacity(self.max_num_reqs, self._context_graph_sizes()),
                width, self.dtype, self.device,
                max_slot_rows=len(layers) if layers is not None else 1)
            logger.info("DDTree: the drafter's context is deferred while drafting is off "
                        "(buffer of %d tokens)", self._deferred.capacity)

    def _store_deferred(self, states: torch.Tensor, positions: torch.Tensor,
                        slots: list[torch.Tensor]) -> None:
        """The deferred entries into the drafter's KV cache: ``fc`` over the buffered
        auxiliary states, then the store: copied into the speculator's buffers and
        stored by their context-store graph where one holds them, else eagerly. A
        flush comes every few steps at a large batch and whenever the batch's requests
        change; eager, its kernels launched one by one made every 4th budget-0 step at
        batch 64 on the benchmark pair 1.0-1.1 ms slower (of ~4.4 ms)."""
        hidden = self.model.combine_hidden_states(states)
        slots_arg = slots if self._layer_group_idx is not None else slots[0]
        graphs = self._context_graphs
        if graphs is not None:
            graphs.store_copy(hidden, positions, slots_arg)
        else:
            self.model.precompute_and_store_context_kv(hidden, positions, slots_arg)

    def _defer_decode_context(self, input_batch: InputBatch, aux_hidden_states) -> bool:
        """A budget-0 step that verified no drafts: its context into the deferral
        buffer. False (nothing done) when the step is not one token per request."""
        deferred = self._deferred
        num_tokens = input_batch.num_tokens
        if (deferred is None or not aux_hidden_states or num_tokens != input_batch.num_reqs
                or not deferred.fits(num_tokens)):
            return False
        slot_mappings = self.block_tables.slot_mappings
        cached = self._deferred_slot_rows
        if cached is None or cached[0] is not slot_mappings:
            # Views of the runner's persistent slot mappings, made once.
            cached = self._deferred_slot_rows = (
                slot_mappings, tuple(slot_mappings[r] for r in self._context_slot_rows()))
        deferred.append(input_batch.req_ids, aux_hidden_states, input_batch.positions,
                        cached[1], self._store_deferred)
        self.verifier.clear_trees(input_batch.idx_mapping, input_batch.idx_mapping_np)
        return True

    def _store_drafter_context_only(
        self,
        input_batch: InputBatch,
        hidden_states: torch.Tensor,
        num_sampled: torch.Tensor,
        num_rejected: torch.Tensor,
        last_sampled: torch.Tensor,
        next_prefill_tokens: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
    ) -> None:
        """The context half of DFlash's propose(): the target's hidden states of this
        step's tokens into the drafter's KV cache (vLLM's ``prepare_dflash_inputs`` +
        ``precompute_and_store_context_kv``), without the query forward. Trees of these requests become root-only, so none that
        sits out steps keeps an old tree."""
        num_tokens = input_batch.num_tokens
        # Into the persistent buffer that the context-store graphs read.
        self.hidden_states[:num_tokens].copy_(hidden_states[:num_tokens])
        self._prepare_drafter_inputs(
            input_batch, num_sampled, num_rejected, last_sampled, next_prefill_tokens,
            temperature, seeds,
        )
        if self._layer_group_idx is not None:
            context_slots = [
                self._context_slot_mappings[g][:num_tokens] for g in self._layer_group_idx
            ]
        else:
            context_slots = self._context_slot_mappings[0][:num_tokens]
        self.model.precompute_and_store_context_kv(
            self.hidden_states[:num_tokens], self.context_positions[:num_tokens], context_slots
        )
        self.verifier.clear_trees(input_batch.idx_mapping, input_batch.idx_mapping_np)

    def _prepare_drafter_inputs(
        self,
        input_batch: InputBatch,
        num_sampled: torch.Tensor,
        num_rejected: torch.Tensor,
        last_sampled: torch.Tensor,
        next_prefill_tokens: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
    ) -> None:
        """vLLM's ``prepare_dflash_inputs`` for each drafter KV group, as DFlash's
        propose() calls it (:data:`vllm_ddtree.pin_calls.prepare_dflash_inputs`): the
        drafter's query, context positions and slots."""
        for i, gid in enumerate(self.draft_kv_cache_group_ids):
            pin_calls.prepare_dflash_inputs(
                self, i, gid, input_batch, num_sampled, num_rejected, last_sampled,
                next_prefill_tokens, temperature, seeds,
            )

    def _warm_up_input_kernel(
        self, last_sampled: torch.Tensor, next_prefill_tokens: torch.Tensor,
        temperature: torch.Tensor, seeds: torch.Tensor,
    ) -> None:
        """vLLM's DFlash input kernel compiled for every block size a step can select
        (:mod:`vllm_ddtree.dflash_input_warmup`), once, after the first step that ran
        it (a drafting step, or a budget-0 step's context store): the buffers it writes
        are rewritten by the next step before anything reads them. A failure only
        leaves those sizes to compile at first use."""
        self._input_kernel_warm = True
        start = time.perf_counter()
        try:
            blocks = warm_up_dflash_input_kernel(
                lambda batch, num_sampled, num_rejected: self._prepare_drafter_inputs(
                    batch, num_sampled, num_rejected, last_sampled, next_prefill_tokens,
                    temperature, seeds,
                ),
                self.num_query_per_req,
                self.max_num_tokens,
                self.device,
            )
        except Exception as e:  # an optimisation: never fail the step over it
            logger.warning(
                "DDTree: warming up vLLM's DFlash input kernel failed (%s); its block "
                "sizes compile at first use instead", e,
            )
            return
        logger.info(
            "DDTree: vLLM's DFlash input kernel warmed up for block sizes %s (%.2f s)",
            blocks, time.perf_counter() - start,
        )

    def _draft_budget(self, num_reqs: int) -> int:
        """Tree budget to draft for a drafter batch of ``num_reqs`` (padded) requests."""
        if self._profiling_draft or self._drafting_budget is None:
            return self.tree_budget
        return self._drafting_budget[min(num_reqs, self.max_num_reqs)]

    def set_attn(
        self,
        model_state,
        kv_cache_config,
        block_tables,
        target_input_buffers,
        target_attn_groups,
    ) -> None:
        # At start-up, before any request: refuse a KV layout that one tree mask and
        # one slot mapping for KV compaction cannot follow (vllm_ddtree.kv_layout).
        check_tree_kv_layout(kv_cache_config, target_attn_groups,
                             self.vllm_config.compilation_config.static_forward_context)
        super().set_attn(
            model_state,
            kv_cache_config,
            block_tables,
            target_input_buffers,
            target_attn_groups,
        )
        self.target_input_buffers = target_input_buffers
        register_tree_attn_bias(target_attn_groups, self.verifier.tree_attn_bias)
        names: list[str] = []
        for groups in target_attn_groups:
            for group in groups:
                names.extend(group.layer_names)
        self._target_layer_names = names
        # The caches are bound to the layers after set_attn; resolved on first use.
        self.verifier.set_kv_source(self._target_kv_caches)

    def refresh_budget_schedule(self) -> None:
        """Re-read the budget schedule from the configuration after it changed at
        start-up (``ddtree_tokens_per_step="auto"``, :mod:`vllm_ddtree.cost_model`),
        before the graphs are captured."""
        self._budget_by_batch = self._scheduler_budget_lookup(self.vllm_config)
        # With the online controller any batch size may verify any level: no table
        # (lean drafting follows the step's level after the graph, _draft_level).
        self._drafting_budget = (
            drafting_budgets(self._budget_by_batch, [])
            if self._budget_by_batch is not None and lean_draft_enabled()
            and not self.online_budget
            else None
        )

    def init_cudagraph_manager(self, cudagraph_mode: CUDAGraphMode) -> None:
        """The drafter's graphs, for its query of 1 + depth tokens per request.

        vLLM's graph manager expands a batch-size schedule of the budget
        (``num_speculative_tokens_per_batch_size``, e.g. from
        ``ddtree_tokens_per_step``) into one graph family per budget, deriving each
        query length as ``budget + (decode_query_len - num_speculative_tokens)``.
        That fits the chain, whose drafter query grows with K, but not DDTree: the
        budget only changes how many tree nodes the *target* verifies, while the
        drafter always queries 1 + depth tokens per request (with a budget of 64
        and depth 15 the derived lengths go negative and capture fails). So the
        drafter's manager is built without the schedule.
        """
        spec = self.vllm_config.speculative_config
        schedule = spec.num_speculative_tokens_per_batch_size
        spec.num_speculative_tokens_per_batch_size = None
        try:
            super().init_cudagraph_manager(cudagraph_mode)
        finally:
            spec.num_speculative_tokens_per_batch_size = schedule
        if self._drafting_budget is not None:
            self._drafting_budget = drafting_budgets(
                self._budget_by_batch, self._drafter_graph_batch_sizes()
            )
            logger.info(
                "DDTree: drafting budget by batch size (drafter graphs included): %s",
                table_ranges(self._drafting_budget),
            )

    def _context_graph_sizes(self) -> list[int]:
        """The token counts the context store's graphs are captured for (the target's
        CUDA graph capture sizes); none when those graphs are off."""
        if not self.context_graphs_wanted:
            return []
        return self.vllm_config.compilation_config.cudagraph_capture_sizes or []

    def capture(self) -> None:
        """vLLM's drafter graphs, then the context store's (one per target capture
        size; see :mod:`vllm_ddtree.context_store_graphs`); the lean heads' kernels;
        the target's logits GEMM for every row count a tree step can have
        (:mod:`vllm_ddtree.logits_warmup`)."""
        super().capture()
        self._warm_up_heads()
        self._warm_up_target_logits()
        sizes = self._context_graph_sizes()
        if not sizes:
            return
        from vllm.distributed.parallel_state import graph_capture
        from vllm.platforms import current_platform

        store = self.model.precompute_and_store_context_kv
        per_layer = self._layer_group_idx is not None
        graphs = ContextStoreGraphs(
            store,
            self.hidden_states,
            self.context_positions,
            self._context_slot_mappings,
            self._layer_group_idx if per_layer else [0],
            per_layer,
            sizes,
        )
        decode_graphs = self._decode_context_graphs_for(store, per_layer, sizes)
        pool = current_platform.get_global_graph_pool()
        with graph_capture(device=self.device):
            graphs.capture(pool)
            if decode_graphs is not None:
                decode_graphs.capture(pool)
        # The drafter's own calls (vLLM's propose, the budget-0 store) now replay
        # a graph whenever they read the speculator's buffers.
        self.model.precompute_and_store_context_kv = graphs
        self._context_graphs = graphs
        self._decode_context_graphs = decode_graphs
        logger.info(
            "DDTree: drafter context store captured for %d token counts (up to %d); "
            "budget-0 decode steps: %s",
            len(graphs.sizes), graphs.sizes[-1] if graphs.sizes else 0,
            f"{len(decode_graphs.sizes)} graphs" if decode_graphs else "none",
        )

    def _warm_up_target_logits(self) -> None:
        compute_logits = getattr(self, "_target_compute_logits", None)
        if compute_logits is None or self._logits_warm:
            return
        self._logits_warm = True
        model_config = self.vllm_config.model_config
        try:
            warm_up_logits_rows(
                compute_logits, model_config.get_hidden_size(), model_config.dtype,
                self.device,
                max_tree_step_rows(self.max_num_reqs, self.max_num_tokens, self.tree_budget,
                                   self._budget_by_batch),
                single_rank=self.vllm_config.parallel_config.world_size == 1,
            )
        except torch.OutOfMemoryError:
            raise  # several ranks: see vllm_ddtree.logits_warmup
        except Exception as e:  # an optimisation: never fail start-up over it
            logger.warning(
                "DDTree: warming up the target's logits GEMM failed (%s); each row count "
                "chooses its kernel at its first step instead", e)

    def _decode_context_graphs_for(self, store, per_layer: bool, sizes) -> ContextStoreGraphs | None:
        """Graphs for steps with budget 0 that verified no drafts: the context is the
        target's tokens, at the runner's positions and the drafter groups' slots the
        runner computed (padded). None without such batch sizes or without the
        drafter's combine of auxiliary hidden states."""
        if not self.online_budget and (
                self._budget_by_batch is None or 0 not in self._budget_by_batch[1:]):
            return None
        width = self._aux_width()
        if width is None:
            return None
        # The online controller may turn drafting off at any batch size.
        first_off = 1 if self.online_budget else self._budget_by_batch.index(0, 1)
        # A decode-only step has one token per request; pad up to a captured size.
        decode_sizes = [s for s in sorted(sizes) if s >= first_off]
        decode_sizes = [s for s in decode_sizes if s < self.max_num_reqs] + [
            s for s in decode_sizes if s >= self.max_num_reqs][:1]
        if not decode_sizes:
            return None
        aux_states = torch.zeros(max(decode_sizes), width, dtype=self.dtype, device=self.device)
        return ContextStoreGraphs(
            store,
            aux_states,
            self.target_input_buffers.positions,
            self.block_tables.slot_mappings,
            self._context_slot_rows(),
            per_layer,
            decode_sizes,
            combine_fn=self.model.combine_hidden_states,
            pad_slots=False,
        )

    def _store_decode_context(self, input_batch: InputBatch, aux_hidden_states) -> bool:
        """A budget-0 step that verified no drafts: the target's auxiliary states into
        the decode graph's buffer, one replay. False (nothing done) when the graph
        cannot take the step."""
        graphs = self._decode_context_graphs
        num_tokens = input_batch.num_tokens
        if (graphs is None or not aux_hidden_states or num_tokens != input_batch.num_reqs
                or input_batch.positions.data_ptr() != graphs.positions.data_ptr()
                or padded_graph_size(graphs.sizes, num_tokens) is None):
            return False
        torch.cat([h[:num_tokens] for h in aux_hidden_states], dim=-1,
                  out=graphs.states[:num_tokens])
        graphs.replay(num_tokens)
        self.verifier.clear_trees(input_batch.idx_mapping, input_batch.idx_mapping_np)
        return True

    def _drafter_graph_batch_sizes(self) -> list[int]:
        """Request counts of the drafter's full CUDA graphs (each also runs the smaller
        batch sizes padded up to it). Read from vLLM's graph manager; if its layout is
        not the expected one, every batch size counts as padded up to the largest,
        which drafts the largest budget of all (safe, not lean)."""
        manager = self.query_cudagraph_manager
        descs = getattr(manager, "_capture_descs", None)
        if not isinstance(descs, dict):
            logger.warning(
                "ddtree: cannot read the drafter's CUDA graph sizes; drafting the "
                "largest scheduled budget at every batch size"
            )
            return [self.max_num_reqs]
        return [
            d.num_reqs
            for mode, group in descs.items()
            if mode == CUDAGraphMode.FULL
            for d in group
            if d.num_reqs
        ]

    def _target_kv_caches(self) -> list[tuple[str, torch.Tensor]]:
        """(layer name, KV cache) of every target layer, as the layers hold them."""
        forward_context = self.vllm_config.compilation_config.static_forward_context
        caches = []
        for name in self._target_layer_names:
            kv_cache = forward_context[name].kv_cache
            if isinstance(kv_cache, (list, tuple)):
                kv_cache = kv_cache[0]
            if kv_cache.numel() == 0:
                raise RuntimeError(f"ddtree: KV cache of {name} is not allocated")
            caches.append((name, kv_cache))
        return caches

    def make_tree_sampler(self, sampler: Sampler) -> DDTreeSampler:
        return DDTreeSampler(sampler, self.verifier)

    # ------------------------------------------------------------ verification

    def prepare_tree_verification(self, input_batch: InputBatch, next_budget: int) -> None:
        """Runner hook before the target forward (:meth:`TreeVerifier.prepare`: depth
        positions and tree masks). ``next_budget`` is the scheduler's
        ``num_spec_tokens_to_schedule``: the drafts per request it verifies after this
        step, which propose() drafts."""
        self.verifier.prepare(input_batch, next_budget)

    @property
    def _next_budget(self) -> int:
        return self.verifier.step.next_budget

    def propose(
        self,
        input_batch: InputBatch,
        attn_metadata: dict[str, Any],
        slot_mappings: dict[str, torch.Tensor],
        last_hidden_states: torch.Tensor,
        aux_hidden_states: list[torch.Tensor] | None,
        num_sampled: torch.Tensor,
        num_rejected: torch.Tensor,
        last_sampled: torch.Tensor,
        next_prefill_tokens: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        dummy_run: bool = False,
        skip_attn_for_dummy_run: bool = False,
        mm_inputs=None,
        is_profile: bool = False,
        **pin_kwargs: Any,
    ) -> torch.Tensor | None:
        """DFlash's propose with compaction before and trees after. ``pin_kwargs``
        are the pin's further keywords, passed on to DFlash's propose as given: the
        data-parallel sync (``num_tokens_across_dp`` on 0.26.0, ``dp_sync_state`` on
        0.33.0) and, on 0.33.0, the step's ``num_speculative_tokens`` (the scheduler's
        budget after this step, as ``TreeVerifier.prepare`` got it).

        Returns the step's draft tokens, or None when the step drafts nothing (the
        scheduler verifies no drafts after it, budget 0): the runner then stores no
        draft rows (patch ``spec-decode_ddtree-runner-hooks``). A budget-0 decode step
        is the one a user pays on every step while drafting does not pay, so its
        common case (the context deferred or stored in one graph replay) returns
        before anything else, without entering a new inference-mode scope (the
        runner's sample_tokens runs in one)."""
        profiler = None if dummy_run else self.profiler
        if profiler is not None:
            profiler.mark("propose")
        no_drafts = not dummy_run and (
            self._next_budget == 0 or pin_kwargs.get("num_speculative_tokens") == 0)
        if no_drafts and self._defer_decode_context(input_batch, aux_hidden_states):
            done = True
        else:
            if self._deferred is not None and not dummy_run:
                # Every other step reads or writes the drafter's cache: what is
                # deferred goes in first.
                self._deferred.flush(self._store_deferred)
            done = no_drafts and self._store_decode_context(input_batch, aux_hidden_states)
        if done:
            # No drafts verified, none to draft: the drafter's context buffered, or
            # stored in one replay.
            self.verifier.end_step()
            if profiler is not None:
                profiler.mark("compacted")
                profiler.mark("drafted")
            return None
        num_tokens = input_batch.num_tokens
        with torch.inference_mode():
            if aux_hidden_states:
                hidden_states = self.model.combine_hidden_states(
                    torch.cat([h[:num_tokens] for h in aux_hidden_states], dim=-1)
                )
            else:
                hidden_states = last_hidden_states[:num_tokens].clone()
            if not dummy_run:
                # A dummy run (data parallelism, cost measurements) between a walk and
                # its propose must leave the pending compaction for the real one.
                self.verifier.compact(input_batch, slot_mappings, hidden_states)
            if profiler is not None:
                profiler.mark("compacted")

            if no_drafts:
                # Store the drafter's context (so drafting resumes at full acceptance
                # when the batch shrinks) and skip the drafter's query forward, its
                # attention metadata and the trees.
                self._store_drafter_context_only(
                    input_batch, hidden_states, num_sampled, num_rejected, last_sampled,
                    next_prefill_tokens, temperature, seeds,
                )
                draft_tokens = None
            else:
                self._profiling_draft = is_profile or (dummy_run and skip_attn_for_dummy_run)
                try:
                    draft_tokens = super().propose(
                        input_batch,
                        attn_metadata,
                        slot_mappings,
                        hidden_states,
                        None,
                        num_sampled,
                        num_rejected,
                        last_sampled,
                        next_prefill_tokens,
                        temperature,
                        seeds,
                        dummy_run=dummy_run,
                        skip_attn_for_dummy_run=skip_attn_for_dummy_run,
                        mm_inputs=mm_inputs,
                        is_profile=is_profile,
                        **pin_kwargs,
                    )
                finally:
                    self._profiling_draft = False
                if not dummy_run:
                    if self._draft_hidden is not None:
                        self._warm_up_heads()
                        self._draft_level(input_batch.num_reqs, self._next_budget)
                    self.verifier.store_trees(self.trees, input_batch.idx_mapping,
                                               input_batch.idx_mapping_np)
            if not dummy_run and not self._input_kernel_warm:
                # Both branches ran vLLM's DFlash input kernel (the context-only store
                # too: an engine that starts with drafting off, a large batch, would
                # otherwise compile its other block sizes at the first prompts of each
                # length range).
                self._warm_up_input_kernel(last_sampled, next_prefill_tokens, temperature,
                                           seeds)
            if profiler is not None:
                profiler.mark("drafted")
            return draft_tokens

    def _generate_draft(
        self,
        num_reqs: int,
        num_tokens_padded: int,
        attn_metadata: dict[str, Any] | None,
        slot_mappings: dict[str, torch.Tensor] | None,
        num_tokens_across_dp: torch.Tensor | None,
        cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
    ) -> None:
        # Runs eagerly or inside the drafter's CUDA graph for num_reqs (padded)
        # requests; the budget is a host-side function of num_reqs, so each graph
        # holds the drafting work of its own budget.
        out = type(self.trees)(*(t[:num_reqs] for t in self.trees))
        budget = self._draft_budget(num_reqs)
        if budget == 0:
            # No drafts at this batch size: the scheduler verifies none. The drafter's
            # context was stored by propose() before this; only mark the trees empty
            # (a request that sits out steps must not keep an old tree).
            fill_root_only_trees_(out)
            self.draft_tokens[:num_reqs] = 0
            return
        last_hidden_states = self._run_model(
            num_tokens_padded,
            attn_metadata,
            slot_mappings,
            num_tokens_across_dp,
            cudagraph_runtime_mode,
        )
        rows = self.sample_indices[: num_reqs * self.tree_depth]
        if self._draft_hidden is not None and not self._profiling_draft:
            # The head runs after the graph, for the step's level (_draft_level).
            torch.index_select(last_hidden_states, 0, rows,
                               out=self._draft_hidden[: num_reqs * self.tree_depth])
            return
        depth, _ = draft_shape(budget, self.tree_depth, self.tree_top_k)
        if depth < self.tree_depth:
            # The first `depth` masked positions of each request (request-major rows).
            rows = rows.view(num_reqs, self.tree_depth)[:, :depth].reshape(-1)
        self._draft_trees(last_hidden_states[rows], num_reqs, budget, out)

    def _draft_trees(self, hidden: torch.Tensor, num_reqs: int, budget: int, out) -> None:
        """The drafter's head for trees of ``budget`` nodes: ``hidden`` holds the first
        ``draft_shape(budget, ...)`` masked positions of each request (request-major);
        their logits, top-K, the trees (into ``out``) and the draft tokens."""
        depth, top_k = draft_shape(budget, self.tree_depth, self.tree_top_k)
        if self._candidate_head:
            draft_logits = self.model.candidate_logits_processor(self.model.lm_head, hidden)
        else:
            draft_logits = self.model.compute_logits(hidden)
        trees = build_trees(draft_logits.view(num_reqs, depth, -1), budget, top_k, out=out)
        self.draft_tokens[:num_reqs] = trees.node_tokens[:, 1:]

    def _draft_level(self, num_reqs: int, level: int) -> None:
        """Lean drafting with the online controller: the head for the ``level`` the
        step verifies next, from the hidden states the drafter's forward kept
        (_generate_draft). Eager: its shapes follow the level, which a graph of the
        drafter's forward cannot know."""
        level = int(level)  # 1..tree_budget: draft_shape and build_trees refuse others
        depth, _ = draft_shape(level, self.tree_depth, self.tree_top_k)
        hidden = self._draft_hidden[: num_reqs * self.tree_depth]
        if depth < self.tree_depth:
            hidden = hidden.view(num_reqs, self.tree_depth, -1)[:, :depth]
            hidden = hidden.reshape(num_reqs * depth, -1)
        out = type(self.trees)(*(t[:num_reqs] for t in self.trees))
        self._draft_trees(hidden, num_reqs, level, out)

    def _warm_up_heads(self) -> None:
        """Compile the head's kernels for every level the controller may choose (the
        tree builder specialises on the tree's size) before they serve: at capture, or
        at the first drafting step of an eager engine. Writes request row 0's draft,
        which the step's own head then overwrites."""
        if self._draft_hidden is None or self._heads_warm:
            return
        self._heads_warm = True
        start = time.perf_counter()
        levels = [b for b in graph_budget_levels(self.vllm_config) if b > 0]
        for level in levels:
            self._draft_level(1, level)
        logger.info("DDTree: lean drafting heads warmed up for levels %s (%.2f s)",
                    levels, time.perf_counter() - start)
