"""The drafter's CUDA-graph manager must ignore the batch-size budget schedule.

On the H200, ``ddtree_tokens_per_step`` (budget 64, depth 15) failed at graph
capture (``InputBatch.make_dummy``: ``assert 0 < num_reqs <= num_tokens``;
``git show 3806e72:bench/results/gpu-ddtree-tokens-per-step-graphs-failure.log``): vLLM derives one query
length per scheduled budget as ``budget + decode_query_len - num_speculative_tokens``,
which for DDTree's drafter (query 1 + depth, not 1 + budget) goes negative.
"""

import types

import pytest

pytest.importorskip("vllm")
from vllm.config.compilation import CUDAGraphMode  # noqa: E402

from vllm_ddtree.budget import budget_schedule  # noqa: E402


def test_schedule_breaks_the_drafter_query_lengths():
    """What vLLM derives for the drafter (query 16) from a budget-64 schedule."""
    schedule = budget_schedule(512, 64)
    num_new = 16 - 64
    assert [b + num_new for _, _, b in schedule][:2] == [16, -16]  # a negative query length


def test_ddtree_builds_the_drafter_manager_without_the_schedule(monkeypatch):
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    from vllm_ddtree.dflash_tree_drafter import DDTreeSpeculator

    schedule = budget_schedule(512, 64)
    spec = types.SimpleNamespace(num_speculative_tokens_per_batch_size=schedule)
    seen = []

    def fake_init(self, mode):
        seen.append((mode, self.vllm_config.speculative_config.num_speculative_tokens_per_batch_size))

    monkeypatch.setattr(DFlashSpeculator, "init_cudagraph_manager", fake_init)
    fake = DDTreeSpeculator.__new__(DDTreeSpeculator)  # no GPU set-up
    fake.vllm_config = types.SimpleNamespace(speculative_config=spec)
    fake._drafting_budget = None  # lean drafting off: nothing to derive from the graphs
    DDTreeSpeculator.init_cudagraph_manager(fake, CUDAGraphMode.FULL_DECODE_ONLY)
    assert seen == [(CUDAGraphMode.FULL_DECODE_ONLY, None)]
    assert spec.num_speculative_tokens_per_batch_size is schedule  # restored

    def failing_init(self, mode):
        raise RuntimeError("boom")

    monkeypatch.setattr(DFlashSpeculator, "init_cudagraph_manager", failing_init)
    with pytest.raises(RuntimeError):
        DDTreeSpeculator.init_cudagraph_manager(fake, CUDAGraphMode.FULL_DECODE_ONLY)
    assert spec.num_speculative_tokens_per_batch_size is schedule  # restored on errors too
