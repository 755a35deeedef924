"""The calls into vLLM whose shape differs between the pins, one small adapter each.

Each :class:`PinCall` holds one implementation per pin of
:data:`vllm_ddtree.reach_ins.PINS` and runs the installed pin's (chosen at first use).
The shape each implementation relies on is a pin's entry in
``vllm_ddtree.reach_ins.REACH_INS`` (``pins=``), checked at start-up like every other
reach-in; the rest of the package calls these adapters and never asks which vLLM it
runs on.
"""

from __future__ import annotations

from typing import Any, Callable

from vllm_ddtree.reach_ins import PIN_0_26, PIN_0_33, PINS, ReachInError, installed_pin


class PinCall:
    """One call with an implementation per pin (``impls``: pin -> function)."""

    def __init__(self, name: str, impls: dict[str, Callable[..., Any]]) -> None:
        if set(impls) != set(PINS):
            raise ValueError(f"{name}: implementations for {sorted(impls)}, pins are {PINS}")
        self.name = name
        self.impls = impls
        self._chosen: Callable[..., Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self._chosen
        if fn is None:
            pin = installed_pin()
            if pin is None:
                raise ReachInError(
                    f"{self.name}: the installed vLLM is none of the pins {', '.join(PINS)}")
            fn = self._chosen = self.impls[pin]
        return fn(*args, **kwargs)


# ------------------------------------------------------------------ the sampler


def _returns_logprobs_0_26(sampler: Any, idx_mapping_np: Any) -> bool:
    return sampler.returns_logprobs(idx_mapping_np)


def _returns_logprobs_0_33(sampler: Any, idx_mapping_np: Any) -> bool:
    # None when no request of the batch wants top logprobs or given token ids' scores:
    # 0.26.0's returns_logprobs under its new name.
    return sampler.get_logprobs_dims(idx_mapping_np) is not None


returns_logprobs = PinCall("returns_logprobs", {
    PIN_0_26: _returns_logprobs_0_26, PIN_0_33: _returns_logprobs_0_33})


def _sample_0_26(sampler, logits, input_batch, pos, input_ids, return_logprobs):
    return sampler.sample(logits, input_batch.expanded_idx_mapping, input_batch.idx_mapping_np,
                          pos, input_ids, input_batch.expanded_local_pos,
                          return_logprobs=return_logprobs)


def _sample_0_33(sampler, logits, input_batch, pos, input_ids, return_logprobs):
    return sampler.sample(logits, input_batch.expanded_idx_mapping, input_batch.idx_mapping,
                          input_batch.idx_mapping_np, pos, input_ids,
                          input_batch.expanded_local_pos,
                          input_batch.seq_lens_cpu_upper_bound.numpy(),
                          return_logprobs=return_logprobs)


#: ``sampler_sample(sampler, logits, input_batch, pos, input_ids, return_logprobs)``:
#: vLLM's ``Sampler.sample`` (one target sample per logit row) -> (samples, processed).
sampler_sample = PinCall("sampler_sample", {PIN_0_26: _sample_0_26, PIN_0_33: _sample_0_33})


# ------------------------------------------------------- the DFlash input kernel


def _prepare_dflash_inputs_0_26(spec, group, gid, input_batch, num_sampled, num_rejected,
                                last_sampled, next_prefill_tokens, temperature, seeds):
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import prepare_dflash_inputs

    prepare_dflash_inputs(
        spec.input_buffers, spec.block_tables.slot_mappings[gid], spec.context_positions,
        spec._context_slot_mappings[group], spec.sample_indices, spec.sample_pos,
        spec.sample_idx_mapping, input_batch, num_sampled, num_rejected, last_sampled,
        next_prefill_tokens, spec.block_tables.input_block_tables[gid],
        spec.block_tables.kernel_block_sizes[gid], spec.parallel_drafting_token_id,
        spec.num_query_per_req, spec.num_speculative_steps, spec.max_num_reqs,
        spec.max_num_tokens, spec.max_model_len, spec.sample_from_anchor,
    )


def _prepare_dflash_inputs_0_33(spec, group, gid, input_batch, num_sampled, num_rejected,
                                last_sampled, next_prefill_tokens, temperature, seeds):
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import prepare_dflash_inputs

    tables = spec.block_tables
    prepare_dflash_inputs(
        spec.input_buffers, tables.slot_mappings[gid], spec.context_positions,
        spec._context_slot_mappings[group], spec.sample_indices, spec.sample_pos,
        spec.sample_idx_mapping, spec.temperature, spec.seeds, input_batch, num_sampled,
        num_rejected, last_sampled, next_prefill_tokens, temperature, seeds,
        tables.input_block_tables[gid], tables.block_sizes[gid], tables.cp_rank,
        spec.dcp_size, tables.cp_interleave, spec.parallel_drafting_token_id,
        spec.num_query_per_req, spec.num_speculative_steps, spec.max_num_reqs,
        spec.max_num_tokens, spec.max_model_len, spec.sample_from_anchor,
    )


#: ``prepare_dflash_inputs(spec, group, gid, input_batch, num_sampled, num_rejected,
#: last_sampled, next_prefill_tokens, temperature, seeds)``: vLLM's DFlash input kernel
#: for the drafter's ``group``-th KV group (KV-cache group ``gid``), with the
#: speculator's buffers, as DFlash's ``propose`` calls it.
prepare_dflash_inputs = PinCall("prepare_dflash_inputs", {
    PIN_0_26: _prepare_dflash_inputs_0_26, PIN_0_33: _prepare_dflash_inputs_0_33})

ADAPTERS: tuple[PinCall, ...] = (returns_logprobs, sampler_sample, prepare_dflash_inputs)
