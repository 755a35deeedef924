"""vllm_ddtree.dflash_input_warmup: the block sizes it compiles are the ones vLLM's
``prepare_dflash_inputs`` picks, and vLLM's kernel runs on its one-request batches
(Triton's interpreter on CPU)."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from vllm_ddtree.dflash_input_warmup import (
    OneRequestBatch,
    dflash_input_block_size,
    warm_up_dflash_input_kernel,
    warm_up_query_lengths,
)
from vllm_ddtree import pin_calls
from vllm_ddtree.reach_ins import PIN_0_33, installed_pin

dflash = pytest.importorskip("vllm.v1.worker.gpu.spec_decode.dflash.speculator")

BLOCK_SIZE_KV = 16  # the KV cache's block size (tokens), not the kernel's BLOCK_SIZE


def _buffers(max_num_reqs: int, max_num_tokens: int, num_query_per_req: int,
             num_steps: int, device) -> dict:
    """The drafter's buffers with the runner's dtypes, as prepare_dflash_inputs gets them."""
    z = lambda n, dt: torch.zeros(n, dtype=dt, device=device)  # noqa: E731
    # vLLM's InputBuffers hold max_num_tokens query tokens (at least the largest query,
    # max_num_reqs * num_query_per_req); vLLM 0.33.0's kernel pads them all.
    max_q = max(max_num_reqs * num_query_per_req, max_num_tokens)
    return dict(
        input_buffers=types.SimpleNamespace(
            input_ids=z(max_q, torch.int32), positions=z(max_q, torch.int64),
            is_padding=z(max_q, torch.bool),  # written by vLLM 0.33.0's kernel only
            query_start_loc=z(max_num_reqs + 1, torch.int32),
            seq_lens=z(max_num_reqs, torch.int32)),
        query_slot_mapping=z(max_num_tokens, torch.int64),
        context_positions=z(max_num_tokens, torch.int64),
        context_slot_mapping=z(max_num_tokens, torch.int64),
        sample_indices=z(max_num_reqs * num_steps, torch.int64),
        sample_pos=z(max_num_reqs * num_steps, torch.int64),
        sample_idx_mapping=z(max_num_reqs * num_steps, torch.int32),
        # The drafter's sampling state, which vLLM 0.33.0's kernel copies per request.
        temperature=z(max_num_reqs, torch.float32),
        seeds=z(max_num_reqs, torch.int64),
        last_sampled=torch.full((max_num_reqs,), 7, dtype=torch.int64, device=device),
        next_prefill_tokens=z(max_num_reqs, torch.int32),
        input_temperature=torch.full((max_num_reqs,), 0.5, dtype=torch.float32,
                                     device=device),
        input_seeds=torch.full((max_num_reqs,), 11, dtype=torch.int64, device=device),
        # Request state 0's blocks are 3, 4, 5, ... (slot = block * 16 + offset).
        block_table=(torch.arange(40, dtype=torch.int32, device=device) + 3).repeat(
            max_num_reqs, 1),
    )


def _fake_speculator(b: dict, num_query_per_req: int, max_num_reqs: int,
                     max_num_tokens: int, max_model_len: int):
    """What vllm_ddtree.pin_calls.prepare_dflash_inputs reads of the speculator, on
    either pin: one drafter KV group (0) over the buffers ``b``, no context parallelism."""
    return types.SimpleNamespace(
        input_buffers=b["input_buffers"],
        block_tables=types.SimpleNamespace(
            slot_mappings=[b["query_slot_mapping"]], input_block_tables=[b["block_table"]],
            kernel_block_sizes=[BLOCK_SIZE_KV],  # vLLM 0.26.0's name
            block_sizes=[BLOCK_SIZE_KV], cp_rank=0, cp_interleave=1),  # 0.33.0's
        dcp_size=1,
        context_positions=b["context_positions"],
        _context_slot_mappings=[b["context_slot_mapping"]],
        sample_indices=b["sample_indices"], sample_pos=b["sample_pos"],
        sample_idx_mapping=b["sample_idx_mapping"],
        temperature=b["temperature"], seeds=b["seeds"],
        parallel_drafting_token_id=99, num_query_per_req=num_query_per_req,
        num_speculative_steps=num_query_per_req - 1, max_num_reqs=max_num_reqs,
        max_num_tokens=max_num_tokens, max_model_len=max_model_len,
        sample_from_anchor=False,
    )


def _prepare(b: dict, num_query_per_req: int, max_num_reqs: int, max_num_tokens: int,
             max_model_len: int = 4096):
    """A prepare(batch, num_sampled, num_rejected) calling vLLM's own function, as the
    speculator does (the installed pin's call, vllm_ddtree.pin_calls)."""
    spec = _fake_speculator(b, num_query_per_req, max_num_reqs, max_num_tokens,
                            max_model_len)

    def prepare(batch, num_sampled, num_rejected):
        pin_calls.prepare_dflash_inputs(
            spec, 0, 0, batch, num_sampled, num_rejected, b["last_sampled"],
            b["next_prefill_tokens"], b["input_temperature"], b["input_seeds"])
    return prepare


def test_block_sizes_are_the_ones_vllms_prepare_picks(vllm_triton, monkeypatch):
    launched = []

    class RecordingKernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(kwargs["BLOCK_SIZE"])

    monkeypatch.setattr(dflash, "_prepare_dflash_inputs_kernel", RecordingKernel())
    for num_query_per_req in (16, 9, 1):
        for max_num_tokens in (1, 20, 48, 200, 2048):
            _check_block_sizes(launched, num_query_per_req, max_num_tokens)


def _check_block_sizes(launched: list, num_query_per_req: int, max_num_tokens: int):
    b = _buffers(4, max_num_tokens, num_query_per_req, max(num_query_per_req - 1, 1), "cpu")
    prepare = _prepare(b, num_query_per_req, 4, max_num_tokens)
    ones, zeros = torch.ones(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    # Every block size vLLM can pick for a step of at most max_num_tokens tokens...
    picked = {}
    for query_len in range(1, max_num_tokens + 1):
        launched.clear()
        prepare(OneRequestBatch(query_len, torch.device("cpu")), ones, zeros)
        picked.setdefault(launched[0], query_len)
        assert launched[0] == dflash_input_block_size(query_len, num_query_per_req)
    # ... is warmed up, each at the shortest query that picks it.
    assert warm_up_query_lengths(num_query_per_req, max_num_tokens) == picked
    launched.clear()
    blocks = warm_up_dflash_input_kernel(prepare, num_query_per_req, max_num_tokens,
                                         torch.device("cpu"))
    assert launched == blocks == sorted(picked)


def test_a_drafter_of_15_positions_needs_four_block_sizes():
    assert warm_up_query_lengths(16, 8192) == {32: 1, 64: 17, 128: 49, 256: 113}
    assert warm_up_query_lengths(16, 64) == {32: 1, 64: 17, 128: 49}


def test_vllms_kernel_runs_on_the_warm_up_batches(vllm_triton, triton_device):
    """The real kernel, for every block size: the one request's drafter query and
    context are laid out as at any step (bonus token, then the mask tokens, at the
    positions after the context; slots from the block table; padding elsewhere)."""
    nq, max_reqs, max_tokens = 16, 4, 160
    b = _buffers(max_reqs, max_tokens, nq, nq - 1, triton_device)
    seen = []

    def prepare(batch, num_sampled, num_rejected):
        _prepare(b, nq, max_reqs, max_tokens)(batch, num_sampled, num_rejected)
        q = batch.num_tokens
        ib = b["input_buffers"]
        assert ib.input_ids[0].item() == 7  # the request's last sampled token
        assert (ib.input_ids[1:nq] == 99).all()  # the drafter's mask token
        query_pos = torch.arange(q, q + nq)
        assert torch.equal(ib.positions[:nq].cpu(), query_pos)
        assert torch.equal(b["query_slot_mapping"][:nq].cpu(),
                           (query_pos // BLOCK_SIZE_KV + 3) * BLOCK_SIZE_KV
                           + query_pos % BLOCK_SIZE_KV)
        assert (b["query_slot_mapping"][nq:] == -1).all()  # PAD_SLOT_ID
        assert torch.equal(b["context_positions"][:q].cpu(), torch.arange(q))
        assert ib.seq_lens[0].item() == q + nq and (ib.seq_lens[1:] == 0).all()
        if installed_pin() == PIN_0_33:  # 0.26.0's kernel writes neither
            assert not ib.is_padding[:nq].any() and ib.is_padding[nq:].all()
            assert (ib.input_ids[nq:] == 0).all() and (ib.positions[nq:] == 0).all()
            assert b["temperature"][0].item() == 0.5 and b["seeds"][0].item() == 11
        seen.append(q)

    blocks = warm_up_dflash_input_kernel(prepare, nq, max_tokens, triton_device)
    assert blocks == [32, 64, 128, 256] and seen == [1, 17, 49, 113]


def _speculator(prepare_calls, fail=False):
    from vllm_ddtree.dflash_tree_drafter import DDTreeSpeculator

    spec = DDTreeSpeculator.__new__(DDTreeSpeculator)  # no GPU, no engine
    spec.num_query_per_req, spec.max_num_tokens, spec.device = 16, 64, torch.device("cpu")
    spec._input_kernel_warm = False

    def prepare(batch, num_sampled, num_rejected, last_sampled, next_prefill_tokens,
                temperature, seeds):
        if fail:
            raise RuntimeError("no such kernel")
        prepare_calls.append((batch.num_tokens, last_sampled, next_prefill_tokens,
                              temperature, seeds))

    spec._prepare_drafter_inputs = prepare
    return spec


def test_speculator_warm_up_uses_its_own_prepare_call(caplog):
    from vllm_ddtree.dflash_tree_drafter import DDTreeSpeculator

    calls = []
    spec = _speculator(calls)
    with caplog.at_level(logging.INFO):
        DDTreeSpeculator._warm_up_input_kernel(spec, "last", "next", "temp", "seeds")
    assert calls == [(n, "last", "next", "temp", "seeds") for n in (1, 17, 49)]
    assert spec._input_kernel_warm
    assert "block sizes [32, 64, 128]" in caplog.text


def test_a_failed_warm_up_is_a_warning_not_an_error(caplog):
    from vllm_ddtree.dflash_tree_drafter import DDTreeSpeculator

    spec = _speculator([], fail=True)
    with caplog.at_level(logging.WARNING):
        DDTreeSpeculator._warm_up_input_kernel(spec, "last", "next", "temp", "seeds")
    assert spec._input_kernel_warm  # not tried again at every step
    assert "no such kernel" in caplog.text and "compile at first use" in caplog.text
