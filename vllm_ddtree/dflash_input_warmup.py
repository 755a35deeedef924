"""Compile vLLM's DFlash input kernel for every block size before serving.

vLLM's ``prepare_dflash_inputs`` (``spec_decode/dflash/speculator.py``, 0.26.0 and
0.33.0 alike) launches ``_prepare_dflash_inputs_kernel`` with ``BLOCK_SIZE = min(256,
next_pow2(longest target query of a request + num_query_per_req))``, a ``constexpr``:
32 for decode steps, 64 to 256 for steps that prefill a prompt. Triton compiles the
kernel once per block size, and vLLM's start-up warm-up reaches only some of them, so
the others compiled at the first requests of each prompt-length range (block sizes 32
to 256 while serving,
``bench/results/2026-11-30-steady-plain-chain-trees-both-orders/jit-during-serving-ddtree-b64-t512.json.gz``),
a latency spike for those requests.

:func:`warm_up_dflash_input_kernel` launches the kernel once per block size that a step
can select, on a one-request batch whose target query is the shortest one that selects
it, with the same argument types and 16-byte aligned tensors (what a real step passes
once the walk's outputs are aligned, :func:`vllm_ddtree.tree_walk.step_walk_outputs`).
The speculator runs it after the first step that ran the kernel, drafting or storing
a budget-0 step's context (block tables and buffers are real then, and every buffer it
writes is rewritten by the next step before being read). Drop with a vLLM whose warm-up covers every block size.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

MAX_BLOCK_SIZE = 256  # vLLM's cap (both pins) in prepare_dflash_inputs


def dflash_input_block_size(max_query_len: int, num_query_per_req: int) -> int:
    """The ``BLOCK_SIZE`` vLLM's ``prepare_dflash_inputs`` picks for a step whose
    longest per-request target query has ``max_query_len`` tokens."""
    span = max(1, max_query_len + num_query_per_req)
    return min(MAX_BLOCK_SIZE, 1 << (span - 1).bit_length())


def warm_up_query_lengths(num_query_per_req: int, max_num_tokens: int) -> dict[int, int]:
    """Each block size a step of at most ``max_num_tokens`` target tokens can select,
    mapped to the shortest per-request target query that selects it."""
    lengths: dict[int, int] = {}
    for query_len in range(1, max_num_tokens + 1):
        block = dflash_input_block_size(query_len, num_query_per_req)
        lengths.setdefault(block, query_len)
        if block == MAX_BLOCK_SIZE:
            break
    return lengths


class OneRequestBatch:
    """What ``prepare_dflash_inputs`` reads of an ``InputBatch``, for one request
    (request state 0) whose target query is ``query_len`` tokens at positions
    0..query_len-1; the dtypes are the runner's."""

    def __init__(self, query_len: int, device: torch.device):
        self.num_reqs = 1
        self.num_tokens = query_len
        self.num_scheduled_tokens = np.array([query_len], dtype=np.int32)
        self.positions = torch.arange(query_len, dtype=torch.int64, device=device)
        self.query_start_loc = torch.tensor([0, query_len], dtype=torch.int32, device=device)
        self.idx_mapping = torch.zeros(1, dtype=torch.int32, device=device)


def warm_up_dflash_input_kernel(
    prepare: Callable[[OneRequestBatch, torch.Tensor, torch.Tensor], None],
    num_query_per_req: int,
    max_num_tokens: int,
    device: torch.device,
) -> list[int]:
    """Calls ``prepare(batch, num_sampled, num_rejected)`` (the speculator's
    ``prepare_dflash_inputs`` call for each drafter KV group) once per block size;
    returns the block sizes."""
    # One token sampled, none rejected: the shape of a step after a prefill.
    num_sampled = torch.ones(1, dtype=torch.int32, device=device)
    num_rejected = torch.zeros(1, dtype=torch.int32, device=device)
    lengths = warm_up_query_lengths(num_query_per_req, max_num_tokens)
    for query_len in lengths.values():
        prepare(OneRequestBatch(query_len, device), num_sampled, num_rejected)
    return list(lengths)
