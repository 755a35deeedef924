"""Every use of vLLM or Triton internals by ``vllm_ddtree``, in one registry, with a
start-up check that the shape relied on still holds.

Each :class:`ReachIn` says what is used, why, the upstream issue or PR that would
make it unnecessary (``none filed`` when there is none), when it can go, and a
machine check of its shape:

* ``signature``: a function or method's parameter names, in order
  (``inspect.signature``);
* ``attributes``: attributes a class (or an object) must have: class attributes,
  properties and methods, dataclass / msgspec / pydantic fields, and attributes its
  methods (of the class or a base) assign to ``self``;
* ``keywords``: parameters a function called by keyword must accept;
* ``members``: enum members;
* ``source``: code fragments a function's source must contain (a copied rule, a
  launcher layout), whitespace-insensitive;
* ``value``: a module constant, with the value we copied.

The package serves two vLLM pins (:data:`PINS`). An entry holds on every pin unless
its ``pins`` names the ones it applies to: where a shape differs between pins there is
one entry per shape, and the call itself goes through one small adapter per pin
(:mod:`vllm_ddtree.pin_calls`), chosen once for the installed pin. Only the installed
pin's entries are checked; a vLLM that is none of the pins fails the check.

:func:`check_reach_ins` runs every check and raises one :class:`ReachInError` naming
each reach-in whose shape changed (expected, found, where it is used).
``DDTreeSpeculator.__init__`` calls it once per process, so a vLLM or Triton bump
fails at start-up with that message instead of silently mid-run. Adding a
``from vllm... import`` to the package without an entry here fails
tests/unit/test_reach_ins.py.
"""

from __future__ import annotations

import dataclasses
import dis
import importlib
import inspect
import re
import types
from dataclasses import dataclass
from typing import Any

from vllm_ddtree.manifest import version_matches

# The vLLM releases the package serves, the default pin first (UPSTREAM's PINS=).
PINS: tuple[str, ...] = ("0.26.0", "0.33.0")
PIN_0_26 = "0.26.0"
PIN_0_33 = "0.33.0"
# The pins whose vLLM serves DFlash2 drafters (config.py refuses them elsewhere).
DFLASH2_PINS: tuple[str, ...] = (PIN_0_33,)


@dataclass(frozen=True)
class ReachIn:
    module: str
    target: str  # dotted path inside ``module``; "" for the module itself
    kind: str  # "signature" | "keywords" | "attributes" | "members" | "source" | "value"
    expect: tuple  # what the check wants (names, fragments, or (value,))
    used_in: str
    why: str
    drop_when: str
    upstream: str = "none filed"
    # Absent where vLLM does not build it (FlashAttention on a CPU-only install):
    # checked when present.
    optional: bool = False
    # The pins whose vLLM has this shape (default: all of them).
    pins: tuple[str, ...] = PINS

    @property
    def name(self) -> str:
        return f"{self.module}:{self.target}" if self.target else self.module


def _sig(module, target, params, used_in, why, drop_when, **kw) -> ReachIn:
    return ReachIn(module, target, "signature", tuple(params.split()), used_in, why,
                   drop_when, **kw)


def _attrs(module, target, names, used_in, why, drop_when, **kw) -> ReachIn:
    return ReachIn(module, target, "attributes", tuple(names.split()), used_in, why,
                   drop_when, **kw)


_SPEC = "vllm.v1.worker.gpu.spec_decode.dflash.speculator"
_DFLASH_DROP = ("vLLM ships a tree verifier in its V2 spec-decode code (then "
                "DDTreeSpeculator is vLLM's own)")

REACH_INS: tuple[ReachIn, ...] = (
    # ---------------------------------------------------------------- configuration
    _attrs("vllm.config", "VllmConfig",
           "speculative_config compilation_config scheduler_config model_config "
           "parallel_config cache_config attention_config observability_config "
           "use_v2_model_runner",
           "dflash_tree_drafter.py, config.py, cost_model.py, flash_attn_graphs.py",
           "the sub-configs DDTree validates and adjusts at start-up",
           "never (public configuration)"),
    _attrs("vllm.config.speculative", "SpeculativeConfig",
           "num_speculative_tokens num_speculative_tokens_per_batch_size model "
           "draft_model_config target_model_config rejection_sample_method "
           "max_num_new_slots_for_drafting ddtree_max_depth ddtree_top_k "
           "ddtree_tokens_per_step ddtree_disable_by_batch_size",
           "dflash_tree_drafter.py, config.py, cost_model.py",
           "the budget (num_speculative_tokens), vLLM's dynamic schedule by batch "
           "size, which the speculator sets to None around the drafter's graph "
           "manager (init_cudagraph_manager) and cost_model.py writes; ddtree_* are "
           "added by patch spec-decode_ddtree-config",
           "never for the public fields; ddtree_* go with that patch"),
    _attrs("vllm.config.compilation", "CompilationConfig",
           "static_forward_context cudagraph_capture_sizes cudagraph_mode "
           "max_cudagraph_capture_size",
           "dflash_tree_drafter.py (target KV caches by layer name, context-store graph "
           "sizes), config.py, cost_model.py",
           "the target's attention layers (their kv_cache) and the CUDA graph sizes",
           "vLLM hands a speculator the target's KV caches (then static_forward_context "
           "goes)"),
    ReachIn("vllm.config.compilation", "CUDAGraphMode", "members",
            ("NONE", "FULL", "FULL_AND_PIECEWISE"),
            "dflash_tree_drafter.py, config.py",
            "graph modes: FULL entries of the drafter's graph manager, DDTree's FULL "
            "default for joining requests", "never (public enum)"),
    _attrs("vllm.config.compilation", "CUDAGraphMode", "separate_routine has_full_cudagraphs",
           "online_budget.py (single_token_graph_lens)",
           "whether a mode captures decode graphs of every length already, and FULL graphs "
           "at all", "never (public enum methods)"),
    _attrs("vllm.config.model", "ModelConfig",
           "architectures hf_config hf_text_config uses_mrope get_sliding_window "
           "is_hybrid max_model_len enforce_eager dtype",
           "config.py (start-up refusals), cost_model.py",
           "what a tree cannot serve (M-RoPE, sliding windows, hybrids) and the dtype",
           "never (public configuration)"),
    _attrs("vllm.config.model", "ModelConfig", "uses_xdrope_dim",
           "config.py (target_attention_refusal)",
           "XD-RoPE targets are refused like M-RoPE ones (0.33.0 folds xdrope_section "
           "into uses_mrope, so there uses_mrope alone refuses both)",
           "never (public configuration)", pins=(PIN_0_26,)),
    _attrs("vllm.config.parallel", "ParallelConfig",
           "data_parallel_size decode_context_parallel_size", "config.py",
           "DDTree refuses decode context parallelism and auto budgets with data "
           "parallelism", "never (public configuration)"),
    _attrs("vllm.config.scheduler", "SchedulerConfig",
           "max_num_seqs max_num_batched_tokens async_scheduling max_num_scheduled_tokens",
           "config.py, cost_model.py, online_budget.py",
           "the largest batch and step the budget is sized for; the online budget needs "
           "the async scheduler", "never (public configuration)"),
    _attrs("vllm.v1.core.sched.output", "SchedulerOutput",
           "num_scheduled_tokens scheduled_spec_decode_tokens num_spec_tokens_to_schedule",
           "online_budget.py (observe), the runner-hooks patch",
           "a step's batch, the drafts each request verified and the budget scheduled next",
           "vLLM chooses the speculative budget from measured acceptance itself"),
    _attrs("vllm.v1.outputs", "ModelRunnerOutput", "sampled_token_ids req_id_to_index",
           "online_budget.py (observe)", "each request's accepted tokens in a step",
           "vLLM chooses the speculative budget from measured acceptance itself"),
    _attrs("vllm.config.cache", "CacheConfig", "cache_dtype", "config.py",
           "the FlashAttention tree route refuses fp8 KV caches", "never (public configuration)"),
    _attrs("vllm.config.attention", "AttentionConfig", "backend", "config.py",
           "DDTree selects the tree-capable attention backend", "never (public configuration)"),
    _attrs("vllm.config.observability", "ObservabilityConfig", "jit_monitor_mode", "config.py",
           "DDTree refuses jit_monitor_mode=error (its kernels compile after start-up)",
           "every DDTree kernel compiles before serving"),
    _attrs("vllm.sampling_params", "SamplingParams",
           "n temperature top_p top_k min_p seed logit_bias allowed_token_ids min_tokens "
           "max_tokens stop stop_token_ids logprobs prompt_logprobs presence_penalty "
           "frequency_penalty repetition_penalty bad_words structured_outputs",
           "config.py (validate_ddtree_request)",
           "the per-request allowlist classifies SamplingParams' fields "
           "(tests/unit/test_ddtree_requests.py checks that every field is classified)",
           "the tree sampler supports every sampling parameter"),
    _sig("vllm.logger", "init_logger", "name", "dflash_tree_drafter.py",
         "the speculator logs under vLLM's logger tree", "never (public)"),
    _sig("vllm.model_executor.models", "ModelRegistry.resolve_model_cls",
         "architectures model_config", "config.py",
         "resolves the target class to ask whether it returns auxiliary hidden states",
         "vLLM validates aux-hidden-state support for DFlash targets itself"),
    _sig("vllm.model_executor.models.interfaces", "supports_eagle3", "model", "config.py",
         "DFlash drafters read the target's auxiliary hidden states (EAGLE-3 interface)",
         "vLLM validates aux-hidden-state support for DFlash targets itself"),
    ReachIn("vllm.v1.attention.backends.registry", "AttentionBackendEnum", "members",
            ("TRITON_ATTN", "FLASH_ATTN"), "config.py",
            "the backend DDTree verifies trees with", "never (public enum)"),
    ReachIn("vllm.v1.attention.backend", "AttentionCGSupport", "members",
            ("ALWAYS", "UNIFORM_BATCH", "UNIFORM_SINGLE_TOKEN_DECODE", "NEVER"),
            "flash_attn_graphs.py",
            "caps FlashAttention's graph support at UNIFORM_BATCH on the V2 runner "
            "(compares the members' values)",
            "vLLM's V2 runner computes prefills right under FULL graphs on FlashAttention "
            "(bench/results/2026-11-30-flash-attn-full-graphs-pristine-check)"),
    _attrs("vllm.v1.kv_cache_interface", "FullAttentionSpec",
           "sliding_window attention_chunk_size", "kv_layout.py",
           "refuses KV layouts one tree mask and one slot mapping cannot follow",
           "never (public KV-cache spec)"),
    _attrs("vllm.v1.kv_cache_interface", "SinkFullAttentionSpec", "sink_len", "kv_layout.py",
           "refuses attention sinks", "never (public KV-cache spec)"),
    _attrs("vllm.v1.kv_cache_interface", "KVCacheConfig", "kv_cache_groups", "kv_layout.py",
           "all compacted layers must share one KV-cache group", "never"),
    _attrs("vllm.v1.kv_cache_interface", "KVCacheGroupSpec", "layer_names kv_cache_spec",
           "kv_layout.py", "the layers and spec of each KV-cache group", "never"),
    _attrs("vllm.v1.worker.utils", "AttentionGroup",
           "backend layer_names metadata_builders", "tree_attention.py, dflash_tree_drafter.py",
           "points the target's metadata builders at the tree-bias buffer and lists the "
           "target's layers for KV compaction",
           "vLLM passes a tree mask through attention metadata itself"),
    _attrs("vllm.model_executor.layers.attention", "Attention", "kv_cache",
           "dflash_tree_drafter.py (_target_kv_caches)",
           "KV compaction moves the accepted path's KV in every target layer's cache",
           "vLLM hands a speculator the target's KV caches"),
    # ------------------------------------------------------------ V2 model runner
    _attrs("vllm.v1.worker.gpu.input_batch", "InputBatch",
           "num_reqs num_tokens idx_mapping idx_mapping_np expanded_idx_mapping "
           "expanded_local_pos num_scheduled_tokens num_draft_tokens query_start_loc "
           "seq_lens input_ids positions logits_indices cu_num_logits req_ids",
           "dflash_tree_drafter.py, dflash_input_warmup.py (OneRequestBatch mimics the fields "
           "prepare_dflash_inputs reads)",
           "tree positions, the walk's logit rows and KV compaction read the step's batch",
           "never (the runner's step input)"),
    _attrs("vllm.v1.worker.gpu.input_batch", "InputBuffers", "positions",
           "dflash_tree_drafter.py (decode context-store graphs)",
           "the runner's persistent positions buffer the budget-0 graphs read", "never"),
    _sig("vllm.v1.worker.gpu.input_batch", "get_num_sampled_and_rejected",
         "num_sampled seq_lens cu_num_logits idx_mapping prefill_len",
         "tree_verifier.py (DDTreeSampler)",
         "the walk's output counts in the runner's format", "never (a V2 helper)"),
    _sig("vllm.v1.worker.gpu.metrics.logits", "get_num_nans", "logits",
         "tree_verifier.py (DDTreeSampler)", "the sampler's NaN count, as vLLM's sampler does",
         "never"),
    _attrs("vllm.v1.worker.gpu.sample.output", "SamplerOutput",
           "sampled_token_ids logprobs_tensors num_nans num_sampled num_rejected",
           "tree_verifier.py (DDTreeSampler)", "the tree sampler returns the runner's type",
           "never"),
    _attrs("vllm.v1.worker.gpu.sample.sampler", "Sampler",
           "sample compute_nans sampling_states req_states logprobs_mode "
           "logprob_token_ids_state", "tree_verifier.py (DDTreeSampler)",
           "one target sample per node through vLLM's own sampler (penalties, bias, "
           "Gumbel noise keyed by seed and position)",
           "vLLM's V2 runner takes a tree sampler (the tree walk upstream)"),
    _sig("vllm.v1.worker.gpu.spec_decode.rejection_sampler", "RejectionSampler.__call__",
         "self logits input_batch draft_logits", "tree_verifier.py (DDTreeSampler.__call__)",
         "the runner calls the tree sampler in place of its rejection sampler, with the "
         "same arguments", "vLLM's V2 runner takes a tree sampler", pins=(PIN_0_26,)),
    _sig("vllm.v1.worker.gpu.spec_decode.rejection_sampler", "RejectionSampler.__call__",
         "self logits input_batch draft_logits invalid_drafts",
         "tree_verifier.py (DDTreeSampler.__call__)",
         "as on 0.26.0, with the grammar's invalid-draft mask (never set on a tree row)",
         "vLLM's V2 runner takes a tree sampler", pins=(PIN_0_33,)),
    _attrs("vllm.v1.worker.gpu.spec_decode.rejection_sampler", "RejectionSampler",
           "enable_adaptive_verification", "tree_verifier.py (DDTreeSampler)",
           "the runner's kernel warm-up reads it from its rejection sampler",
           "vLLM's V2 runner takes a tree sampler", pins=(PIN_0_33,)),
    _attrs("vllm.v1.worker.gpu.sample.sampler", "Sampler", "returns_logprobs",
           "pin_calls.py (returns_logprobs)", "whether the batch asks for logprobs",
           "vLLM's V2 runner takes a tree sampler", pins=(PIN_0_26,)),
    _sig("vllm.v1.worker.gpu.sample.sampler", "Sampler.get_logprobs_dims",
         "self idx_mapping_np include_token_ids", "pin_calls.py (returns_logprobs)",
         "whether the batch asks for logprobs (None: none do)",
         "vLLM's V2 runner takes a tree sampler", pins=(PIN_0_33,)),
    _sig("vllm.v1.worker.gpu.sample.sampler", "Sampler.sample",
         "self logits expanded_idx_mapping idx_mapping_np pos input_ids expanded_local_pos "
         "return_logprobs", "pin_calls.py (sampler_sample, from DDTreeSampler.__call__)",
         "called positionally with pos = start + depth, so seeded noise matches plain "
         "decoding", "vLLM's V2 runner takes a tree sampler", pins=(PIN_0_26,)),
    _sig("vllm.v1.worker.gpu.sample.sampler", "Sampler.sample",
         "self logits expanded_idx_mapping idx_mapping idx_mapping_np pos input_ids "
         "expanded_local_pos seq_lens_upper_bound_np return_logprobs",
         "pin_calls.py (sampler_sample, from DDTreeSampler.__call__)",
         "as on 0.26.0, with the batch's idx_mapping and the host's upper bound of its "
         "sequence lengths (InputBatch.seq_lens_cpu_upper_bound), as the sampler's own "
         "__call__ passes them", "vLLM's V2 runner takes a tree sampler", pins=(PIN_0_33,)),
    _attrs("vllm.v1.worker.gpu.input_batch", "InputBatch", "seq_lens_cpu_upper_bound",
           "pin_calls.py (sampler_sample)", "Sampler.sample's seq_lens_upper_bound_np",
           "never (the runner's step input)", pins=(PIN_0_33,)),
    _sig("vllm.v1.worker.gpu.sample.states", "SamplingStates.max_num_logprobs",
         "self idx_mapping_np", "tree_verifier.py (DDTreeSampler._path_logprobs)",
         "how many top logprobs the batch asks for", "never (a V2 helper)"),
    _sig("vllm.v1.worker.gpu.sample.logprob", "compute_topk_scores",
         "logits num_logprobs sampled_token_ids cu_num_logits logprob_token_ids_state "
         "expanded_idx_mapping max_per_req_token_ids logits_mode",
         "tree_verifier.py (DDTreeSampler._path_logprobs)",
         "the emitted tokens' logprobs, scored as vLLM's samplers score them",
         "vLLM's V2 runner takes a tree sampler"),
    ReachIn("vllm.v1.worker.gpu.sample.states", "NO_LOGPROBS", "value", (-1,),
            "tree_verifier.py (DDTreeSampler)", "the 'no logprobs' sentinel", "never"),
    _attrs("vllm.v1.worker.gpu.states", "RequestState", "prefill_len",
           "tree_verifier.py (sampler.req_states.prefill_len.gpu)",
           "get_num_sampled_and_rejected needs the prompt lengths", "never"),
    _attrs("vllm.v1.worker.gpu.block_table", "BlockTables",
           "slot_mappings input_block_tables",
           "dflash_tree_drafter.py (decode context graphs), pin_calls.py (prepare_dflash_inputs)",
           "the drafter groups' slot mappings and block tables for prepare_dflash_inputs",
           _DFLASH_DROP),
    _attrs("vllm.v1.worker.gpu.block_table", "BlockTables", "kernel_block_sizes",
           "pin_calls.py (prepare_dflash_inputs)", "each KV group's block size",
           _DFLASH_DROP, pins=(PIN_0_26,)),
    _attrs("vllm.v1.worker.gpu.block_table", "BlockTables", "block_sizes cp_rank cp_interleave",
           "pin_calls.py (prepare_dflash_inputs)",
           "each KV group's block size and the context-parallel layout, as DFlash's "
           "propose passes them", _DFLASH_DROP, pins=(PIN_0_33,)),
    ReachIn("vllm.v1.worker.gpu.model_runner", "GPUModelRunner._dummy_run", "keywords",
         ("num_tokens", "skip_attn", "is_profile"),
         "cost_model.py (_forward: num_tokens positionally, the rest by keyword)",
         "times the target's forward at start-up (ddtree_tokens_per_step=auto) with the "
         "runner's profiling dummy run", "vLLM exposes a target-forward timing hook"),
    _attrs("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "speculator vllm_config",
           "cost_model.py (_DrafterDetached, apply_budget_schedule)",
           "the drafter is detached while the target's forward is timed, and the chosen "
           "schedule reaches the speculator", "vLLM exposes a target-forward timing hook"),
    _attrs("vllm.v1.worker.gpu_worker", "Worker", "model_runner", "cost_model.py",
           "the measurement RPCs run on the worker's model runner", "as above"),
    _sig("vllm.v1.engine.core", "EngineCore.collective_rpc", "self method timeout args kwargs",
         "cost_model.py (measure_tokens_per_step)", "the measurement runs on every rank",
         "never (public executor API)"),
    _sig("vllm.v1.spec_decode.dynamic.utils", "build_dynamic_sd_schedule_lookup",
         "num_speculative_tokens_per_batch_size vllm_max_batch_size "
         "vllm_num_speculative_tokens", "dflash_tree_drafter.py (_scheduler_budget_lookup)",
         "the scheduler's budget by batch size, computed the scheduler's way", "never"),
    ReachIn("vllm.distributed.parallel_state", "graph_capture", "keywords", ("device",),
         "dflash_tree_drafter.py (capture, by keyword)", "captures the context-store graphs in vLLM's capture "
         "context", "vLLM captures the drafter's context store itself"),
    _attrs("vllm.platforms", "current_platform", "get_global_graph_pool",
           "dflash_tree_drafter.py (capture)", "the context-store graphs share vLLM's graph pool",
           "vLLM captures the drafter's context store itself"),
    # --------------------------------------------------------------- DFlash drafter
    _attrs(_SPEC, "DFlashSpeculator",
           "propose _generate_draft _run_model set_attn init_cudagraph_manager capture "
           "vllm_config device dtype hidden_size model max_num_reqs max_num_tokens max_model_len "
           "draft_model_config draft_tokens draft_logits num_speculative_steps num_query_per_req "
           "sample_indices sample_pos sample_idx_mapping hidden_states context_positions "
           "_context_slot_mappings _layer_group_idx input_buffers block_tables "
           "draft_kv_cache_group_ids parallel_drafting_token_id sample_from_anchor "
           "query_cudagraph_manager",
           "dflash_tree_drafter.py (DDTreeSpeculator subclasses it)",
           "DDTree reuses DFlash's drafter, buffers and graphs, and replaces sampling the "
           "drafts with building trees", _DFLASH_DROP),
    _sig(_SPEC, "DFlashSpeculator.__init__", "self vllm_config device", "dflash_tree_drafter.py",
         "DDTreeSpeculator.__init__ calls it first", _DFLASH_DROP),
    _sig(_SPEC, "DFlashSpeculator.load_model", "self target_model",
         "dflash_tree_drafter.py (load_model: the deferred context's buffer)",
         "DDTreeSpeculator.load_model calls it, then sizes the buffer from the drafter's fc "
         "before vLLM measures memory", _DFLASH_DROP),
    _sig("vllm.model_executor.models.interfaces_base",
         "VllmModelForTextGeneration.compute_logits", "self hidden_states",
         "dflash_tree_drafter.py (_warm_up_target_logits), logits_warmup.py",
         "the target model's logits (the runner's own call), run at capture for every row "
         "count a tree step can have so that no step waits for cuBLAS to choose a kernel",
         "cuBLAS chooses kernels for new GEMM shapes without a host stall, or vLLM warms "
         "its logits GEMM up for every row count itself"),
    _sig(_SPEC, "DFlashSpeculator.propose",
         "self input_batch attn_metadata slot_mappings last_hidden_states "
         "aux_hidden_states num_sampled num_rejected last_sampled next_prefill_tokens "
         "temperature seeds num_tokens_across_dp dummy_run skip_attn_for_dummy_run "
         "mm_inputs is_profile", "dflash_tree_drafter.py (propose overrides and calls it)",
         "compaction before, trees after DFlash's drafting (the data-parallel argument "
         "passes through by keyword)", _DFLASH_DROP, pins=(PIN_0_26,)),
    _sig(_SPEC, "DFlashSpeculator.propose",
         "self input_batch attn_metadata slot_mappings last_hidden_states "
         "aux_hidden_states num_sampled num_rejected last_sampled next_prefill_tokens "
         "temperature seeds dp_sync_state dummy_run skip_attn_for_dummy_run "
         "mm_inputs is_profile num_speculative_tokens",
         "dflash_tree_drafter.py (propose overrides and calls it)",
         "as on 0.26.0; dp_sync_state and the step's num_speculative_tokens pass through "
         "by keyword (0 means no drafts, as DDTree's own budget 0)", _DFLASH_DROP,
         pins=(PIN_0_33,)),
    _attrs(_SPEC, "DFlashSpeculator", "_aux_staging temperature seeds dcp_size",
           "dflash_tree_drafter.py (__init__), pin_calls.py (prepare_dflash_inputs)",
           "DDTree combines and compacts the target's hidden states before DFlash's "
           "propose and hands it no auxiliary states, so the FULL drafter graph must "
           "read the combined states (_aux_staging off); the drafter's sampling copies "
           "and the decode context-parallel size go to prepare_dflash_inputs",
           _DFLASH_DROP, pins=(PIN_0_33,)),
    _sig(_SPEC, "DFlashSpeculator._generate_draft",
         "self num_reqs num_tokens_padded attn_metadata slot_mappings num_tokens_across_dp "
         "cudagraph_runtime_mode", "dflash_tree_drafter.py (_generate_draft overrides it)",
         "the drafter's logits go to the tree builder instead of a sampler (runs inside "
         "DFlash's drafter graphs)",
         "vLLM splits drafting into forward + draft selection (a hook a tree builder can "
         "fill)"),
    _sig(_SPEC, "DFlashSpeculator._run_model",
         "self num_tokens attn_metadata slot_mappings num_tokens_across_dp "
         "cudagraph_runtime_mode", "dflash_tree_drafter.py (_generate_draft)",
         "the drafter's forward, reused as is", "as _generate_draft"),
    _sig(_SPEC, "DFlashSpeculator.set_attn",
         "self model_state kv_cache_config block_tables target_input_buffers "
         "target_attn_groups", "dflash_tree_drafter.py (set_attn overrides it)",
         "registers the tree-bias buffer with the target's attention groups", _DFLASH_DROP),
    _sig(_SPEC, "DFlashSpeculator.init_cudagraph_manager", "self cudagraph_mode",
         "dflash_tree_drafter.py", "built without the batch-size schedule (the drafter's query is "
         "1 + depth tokens whatever the budget)",
         "vLLM derives drafter query lengths per method"),
    _sig(_SPEC, "DFlashSpeculator.capture", "self", "dflash_tree_drafter.py",
         "the context-store graphs are captured after DFlash's", _DFLASH_DROP),
    _sig(_SPEC, "prepare_dflash_inputs",
         "input_buffers query_slot_mapping context_positions context_slot_mapping "
         "sample_indices sample_pos sample_idx_mapping input_batch num_sampled "
         "num_rejected last_sampled next_prefill_tokens block_table block_size "
         "parallel_drafting_token_id num_query_per_req num_speculative_steps max_num_reqs "
         "max_num_tokens max_model_len sample_from_anchor",
         "pin_calls.py (prepare_dflash_inputs: 21 positional arguments, as DFlash's "
         "propose passes them)",
         "budget-0 steps store the drafter's context without its query forward, and the "
         "input kernel is warmed up for every block size",
         "DFlashSpeculator has a context-only store method", pins=(PIN_0_26,)),
    _sig(_SPEC, "prepare_dflash_inputs",
         "input_buffers query_slot_mapping context_positions context_slot_mapping "
         "sample_indices sample_pos sample_idx_mapping temperature seeds input_batch "
         "num_sampled num_rejected last_sampled next_prefill_tokens input_temperature "
         "input_seeds block_table block_size cp_rank cp_size cp_interleave "
         "parallel_drafting_token_id num_query_per_req num_speculative_steps max_num_reqs "
         "max_num_tokens max_model_len sample_from_anchor num_reqs_override",
         "pin_calls.py (prepare_dflash_inputs: 28 positional arguments, as DFlash's "
         "propose passes them; num_reqs_override left at None, the whole batch)",
         "as on 0.26.0; the kernel also copies the step's temperatures and seeds into "
         "the drafter's buffers and maps slots under context parallelism",
         "DFlashSpeculator has a context-only store method", pins=(PIN_0_33,)),
    ReachIn(_SPEC, "prepare_dflash_inputs", "source",
            ("max_target_query_len = int(input_batch.num_scheduled_tokens.max())",
             "max_tokens_per_req = max_target_query_len + num_query_per_req",
             "BLOCK_SIZE = min(256, triton.next_power_of_2(max(1, max_tokens_per_req)))"),
            "dflash_input_warmup.py (dflash_input_block_size, MAX_BLOCK_SIZE)",
            "the BLOCK_SIZE rule is copied to compile the kernel for every block size a "
            "step can select before serving",
            "vLLM's warm-up compiles every block size of _prepare_dflash_inputs_kernel",
            pins=(PIN_0_26,)),
    ReachIn(_SPEC, "prepare_dflash_inputs", "source",
            ("max_target_query_len = int(input_batch.num_scheduled_tokens[:num_reqs].max())",
             "max_tokens_per_req = max_target_query_len + num_query_per_req",
             "BLOCK_SIZE = min(256, triton.next_power_of_2(max(1, max_tokens_per_req)))"),
            "dflash_input_warmup.py (dflash_input_block_size, MAX_BLOCK_SIZE)",
            "the same BLOCK_SIZE rule over the first num_reqs requests (the whole batch "
            "when num_reqs_override is None, as DDTree calls it)",
            "vLLM's warm-up compiles every block size of _prepare_dflash_inputs_kernel",
            pins=(PIN_0_33,)),
    _attrs("vllm.model_executor.models.qwen3_dflash", "DFlashQwen3ForCausalLM",
           "precompute_and_store_context_kv combine_hidden_states compute_logits model",
           "dflash_tree_drafter.py (the drafter model: self.model)",
           "context store (also replaced by its CUDA graphs), aux-state combine, logits "
           "of the masked positions", _DFLASH_DROP),
    _sig("vllm.model_executor.models.qwen3_dflash",
         "DFlashQwen3ForCausalLM.precompute_and_store_context_kv",
         "self context_states context_positions context_slot_mapping",
         "dflash_tree_drafter.py, context_store_graphs.py (captured and replayed)",
         "the drafter's context KV store, called positionally", _DFLASH_DROP),
    _attrs("vllm.model_executor.models.qwen3_dflash", "DFlashQwen3Model",
           "fc use_aux_hidden_state", "dflash_tree_drafter.py (_decode_context_graphs_for)",
           "the width of the auxiliary states a budget-0 decode graph takes (fc.input_size)",
           _DFLASH_DROP),
    _attrs("vllm.model_executor.models.qwen3_dflash2", "DFlash2Qwen3ForCausalLM",
           "candidate_logits_processor lm_head", "dflash_tree_drafter.py (_generate_draft)",
           "a DFlash2 drafter's per-position logits for the tree: its LM head through "
           "the candidate head's logits processor (output scale, soft cap)",
           _DFLASH_DROP, pins=DFLASH2_PINS),
    _sig("vllm.model_executor.layers.logits_processor", "LogitsProcessor.forward",
         "self lm_head hidden_states embedding_bias skip_gather",
         "dflash_tree_drafter.py (_generate_draft, DFlash2 drafters)",
         "called with (lm_head, hidden_states)", _DFLASH_DROP, pins=DFLASH2_PINS),
    _attrs("vllm.v1.worker.gpu.cudagraph_utils", "CudaGraphManager", "_capture_descs",
           "dflash_tree_drafter.py (_drafter_graph_batch_sizes)",
           "the request counts of the drafter's FULL graphs, for the lean drafting budget "
           "(a dict by CUDAGraphMode of descriptors with num_reqs)",
           "the graph manager exposes its captured batch sizes"),
    ReachIn("vllm.v1.attention.backends.utils", "PAD_SLOT_ID", "value", (-1,),
            "context_store_graphs.py (PAD_SLOT_ID)", "padded context-store slots are skipped "
            "by KV-cache inserts (copied so the module imports no vLLM)", "never"),
    # ------------------------------------------------------ FlashAttention tree route
    _attrs("vllm.v1.attention.backends.flash_attn", "FlashAttentionMetadata",
           "query_start_loc max_query_len max_seq_len seq_lens block_table "
           "scheduler_metadata max_num_splits tree_attn_bias tree_context_lens",
           "tree_attention_flash.py",
           "the split's FlashAttention calls; tree_* are added by patch "
           "attention_flash-attn-tree-split", "that patch goes (a tree mask upstream)"),
    _attrs("vllm.v1.attention.backends.flash_attn", "FlashAttentionImpl",
           "scale vllm_flash_attn_version", "tree_attention_flash.py",
           "the split calls FlashAttention with the layer's scale and version",
           "as above"),
    ReachIn("vllm.v1.attention.backends.flash_attn", "flash_attn_varlen_func", "keywords",
            ("q", "k", "v", "out", "cu_seqlens_q", "max_seqlen_q", "seqused_k",
             "max_seqlen_k", "softmax_scale", "causal", "block_table", "fa_version",
             "q_descale", "k_descale", "v_descale", "num_splits", "scheduler_metadata",
             "return_softmax_lse"),
            "tree_attention_flash.py",
            "context and plain attention of the split, called by keyword (bound only where "
            "vLLM's FlashAttention is built)", "as above", optional=True),
    # ------------------------------------------------------------------- Triton
    _sig("triton", "jit",
         "fn version repr launch_metadata do_not_specialize do_not_specialize_on_alignment "
         "debug noinline", "_triton.py (jit)",
         "kernels jitted lazily with do_not_specialize for step-varying integers",
         "never (public)"),
    _attrs("triton.runtime.jit", "JITFunction", "params pre_run_hooks run",
           "_triton.py (DirectLauncher)",
           "the direct launcher reads the parameter list and skips kernels with pre-run "
           "hooks", "Triton offers a cheap launch path for a compiled specialisation"),
    _attrs("triton.runtime.jit", "KernelParam", "name has_default default",
           "_triton.py (DirectLauncher._tail)", "defaults of trailing parameters",
           "as above"),
    ReachIn("triton.runtime.jit", "JITFunction.run", "source",
            ("kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, "
             "kernel.packed_metadata, launch_metadata, knobs.runtime.launch_enter_hook, "
             "knobs.runtime.launch_exit_hook, *bound_args.values())",),
            "_triton.py (run_compiled)",
            "the compiled launcher's argument layout, copied (grid, stream, function, "
            "packed metadata, launch metadata and hooks, then every argument)",
            "as above"),
    _attrs("triton.compiler.compiler", "CompiledKernel", "run function packed_metadata",
           "_triton.py (run_compiled)", "the compiled kernel launched directly", "as above"),
    _attrs("triton.knobs", "runtime", "launch_enter_hook launch_exit_hook",
           "_triton.py (DirectLauncher.launch)",
           "launch hooks (profilers) keep Triton's own path", "as above"),
    _attrs("triton.runtime.driver", "DriverConfig", "active", "_triton.py",
           "the current device and stream of a direct launch (driver.active)", "as above"),
    _attrs("triton.runtime.driver", "driver", "active", "_triton.py",
           "the driver object itself (its active backend is read at launch)", "as above"),
    _attrs("triton.backends.driver", "GPUDriver", "get_current_device get_current_stream",
           "_triton.py (_current_device, _current_stream)", "as DriverConfig", "as above"),
)


class ReachInError(RuntimeError):
    """vLLM or Triton internals vllm_ddtree relies on changed shape."""


# ------------------------------------------------------------------- the checks


def _resolve(module: str, target: str) -> Any:
    obj = importlib.import_module(module)
    for part in filter(None, target.split(".")):
        obj = getattr(obj, part)
    return obj


def _params(obj: Any) -> list[str]:
    return list(inspect.signature(obj).parameters)


def _stored_on_self(code: types.CodeType, self_name: str, wanted: set[str]) -> set[str]:
    """Which of ``wanted`` ``self.<name> = ...`` stores in ``code`` and the code nested
    in it (bytecode: parsing the source files would cost seconds at start-up)."""
    names: set[str] = set()
    if wanted & set(code.co_names):
        previous = None
        for ins in dis.get_instructions(code):
            if (ins.opname == "STORE_ATTR" and ins.argval in wanted and previous is not None
                    and previous.opname in ("LOAD_FAST", "LOAD_DEREF")
                    and previous.argval == self_name):
                names.add(ins.argval)
            previous = ins
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _stored_on_self(const, self_name, wanted)
    return names


def _self_assigned(cls: type, wanted: set[str]) -> set[str]:
    """Which of ``wanted`` the methods of ``cls`` and its bases assign to ``self``."""
    names: set[str] = set()
    for klass in getattr(cls, "__mro__", ())[:-1]:
        for value in vars(klass).values():
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            elif isinstance(value, property):
                value = value.fget
            if not isinstance(value, types.FunctionType):
                continue
            # A decorator's wrapper (vLLM's @support_torch_compile replaces __init__)
            # holds the original in a closure cell or __wrapped__.
            functions = {value, inspect.unwrap(value)} | {
                cell.cell_contents for cell in value.__closure__ or ()
                if isinstance(cell.cell_contents, types.FunctionType)}
            for fn in functions:
                code = fn.__code__
                if code.co_argcount:
                    names |= _stored_on_self(code, code.co_varnames[0], wanted)
    return names


def _declared(obj: Any) -> set[str]:
    """Fields of a dataclass / msgspec struct / pydantic model."""
    cls = obj if isinstance(obj, type) else type(obj)
    names: set[str] = set()
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    names |= set(getattr(cls, "__struct_fields__", ()) or ())
    names |= set(getattr(cls, "model_fields", {}) or {})
    names |= set(getattr(cls, "__annotations__", {}) or {})
    return names


_ABSENT = object()


def _has_static(obj: Any, name: str) -> bool:
    """``hasattr`` without running properties (some would start a GPU driver)."""
    return inspect.getattr_static(obj, name, _ABSENT) is not _ABSENT


def _missing_attributes(obj: Any, names: tuple) -> list[str]:
    missing = [n for n in names if not _has_static(obj, n)]
    if not missing:
        return []
    have = _declared(obj)
    missing = [n for n in missing if n not in have]
    if missing:
        assigned = _self_assigned(obj if isinstance(obj, type) else type(obj), set(missing))
        missing = [n for n in missing if n not in assigned]
    return missing


def _normalise(text: str) -> str:
    return re.sub(r"\s+", "", text)


def _problem(entry: ReachIn) -> str | None:
    """What differs from what ``entry`` expects, or None."""
    try:
        obj = _resolve(entry.module, entry.target)
    except (ImportError, AttributeError) as exc:
        if entry.optional:
            return None
        return f"expected it to exist, found none ({type(exc).__name__}: {exc})"
    if entry.kind == "signature":
        try:
            found = _params(obj)
        except (TypeError, ValueError) as exc:
            return f"expected parameters {list(entry.expect)}, found no signature ({exc})"
        if found != list(entry.expect):
            return f"expected parameters {list(entry.expect)}, found {found}"
    elif entry.kind == "keywords":
        try:
            found = _params(obj)
        except (TypeError, ValueError) as exc:
            return f"expected keyword parameters {list(entry.expect)}, found no signature ({exc})"
        missing = [n for n in entry.expect if n not in found]
        if missing:
            return f"expected keyword parameters {list(entry.expect)}, missing {missing}"
    elif entry.kind == "attributes":
        missing = _missing_attributes(obj, entry.expect)
        if missing:
            return f"expected attributes {list(entry.expect)}, missing {missing}"
    elif entry.kind == "members":
        members = list(getattr(obj, "__members__", {}))
        missing = [m for m in entry.expect if m not in members]
        if missing:
            return f"expected members {list(entry.expect)}, found {members}"
    elif entry.kind == "source":
        try:
            source = _normalise(inspect.getsource(obj))
        except (OSError, TypeError) as exc:
            return f"expected source containing {list(entry.expect)}, found none ({exc})"
        missing = [f for f in entry.expect if _normalise(f) not in source]
        if missing:
            return f"expected source containing {missing}, not found"
    elif entry.kind == "value":
        if obj != entry.expect[0]:
            return f"expected value {entry.expect[0]!r}, found {obj!r}"
    else:
        return f"unknown check kind {entry.kind!r}"
    return None


def installed_pin(version: str | None = None) -> str | None:
    """The pin the installed vLLM (or ``version``) is, a release or a local build of
    one (``0.33.0+cu130``); None when it is none of :data:`PINS`."""
    if version is None:
        version = importlib.import_module("vllm").__version__
    return next((pin for pin in PINS if version_matches(version, pin)), None)


def entries_for_pin(pin: str, entries: tuple[ReachIn, ...] = REACH_INS) -> tuple[ReachIn, ...]:
    """The entries whose shape the vLLM of ``pin`` has."""
    return tuple(e for e in entries if pin in e.pins)


def reach_in_problems(entries: tuple[ReachIn, ...] = REACH_INS,
                      pin: str | None = None) -> list[str]:
    """One line per entry whose shape changed: name, expected, found, where used.
    Only the entries of ``pin`` (default: the installed vLLM's) are checked; a vLLM
    that is none of the pins is a problem itself, and then the newest pin's entries
    are checked, to say what differs."""
    problems = []
    if pin is None:
        pin = installed_pin()
        if pin is None:
            problems.append(
                f"vllm {importlib.import_module('vllm').__version__} is none of the pins "
                f"{', '.join(PINS)} (vllm_ddtree.reach_ins.PINS)")
            pin = PINS[-1]
    for entry in entries_for_pin(pin, entries):
        problem = _problem(entry)
        if problem is not None:
            problems.append(f"{entry.name} ({entry.kind}; used in {entry.used_in}): {problem}")
    return problems


def _versions() -> str:
    found = []
    for name in ("vllm", "triton"):
        try:
            found.append(f"{name} {importlib.import_module(name).__version__}")
        except Exception:
            found.append(f"{name} not importable")
    return ", ".join(found)


_PASSED = False


def check_reach_ins(entries: tuple[ReachIn, ...] | None = None) -> None:
    """Check every registered reach-in (or ``entries``); raise one
    :class:`ReachInError` naming each one whose shape changed. The full registry's
    success is remembered for the process (DDTree start-up calls this once per
    speculator)."""
    global _PASSED
    if entries is None:
        if _PASSED:
            return
        problems = reach_in_problems(REACH_INS)
    else:
        problems = reach_in_problems(entries)
    if problems:
        raise ReachInError(
            f"DDTree relies on vLLM/Triton internals that changed ({_versions()}; the "
            f"pins are {', '.join(PINS)}). {len(problems)} reach-in(s) of "
            "vllm_ddtree/reach_ins.py no longer hold:\n  " + "\n  ".join(problems)
        )
    if entries is None:
        _PASSED = True
