"""vllm_ddtree.logits_warmup: the row counts a tree step can give the target's logits
GEMM, and the warm-up that runs each of them once (CPU tensors)."""

from __future__ import annotations

import types

import pytest
import torch

from vllm_ddtree import logits_warmup
from vllm_ddtree.logits_warmup import MAX_WARM_ROWS, max_tree_step_rows, warm_up_logits_rows


class Logits:
    """A target's compute_logits that records the row count of each call."""

    def __init__(self, vocab: int = 11, oom_at: int | None = None):
        self.rows: list[int] = []
        self.weight = torch.randn(vocab, 4)
        self.oom_at = oom_at

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.oom_at is not None and hidden.shape[0] >= self.oom_at:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        self.rows.append(hidden.shape[0])
        assert not torch.is_grad_enabled()
        return hidden @ self.weight.t()


def test_rows_without_a_schedule_are_every_request_s_full_tree():
    assert max_tree_step_rows(4, 8192, 63, None) == 4 * 64


def test_rows_never_exceed_the_scheduled_tokens():
    assert max_tree_step_rows(64, 300, 63, None) == 300


def test_rows_follow_the_budget_cap_by_batch_size():
    # index = batch size: 64 nodes up to 8 requests, 32 up to 16, 8 up to 64, 0 beyond.
    cap = [64] * 9 + [32] * 8 + [8] * 48 + [0] * 64
    assert max_tree_step_rows(128, 8192, 64, cap) == max(8 * 65, 16 * 33, 64 * 9, 128)
    # A cap above the tree budget counts as the tree budget.
    assert max_tree_step_rows(2, 8192, 4, [99, 99, 99]) == 2 * 5
    # Batch sizes past the table take its last entry.
    assert max_tree_step_rows(10, 8192, 4, [4, 4, 2]) == 10 * 3


def test_warm_up_runs_every_row_count_once_without_grad():
    logits = Logits()
    assert warm_up_logits_rows(logits, 4, torch.float32, torch.device("cpu"), 37) == 37
    assert logits.rows == list(range(1, 38))


def test_warm_up_stops_at_the_cap(monkeypatch):
    monkeypatch.setattr(logits_warmup, "MAX_WARM_ROWS", 20)
    logits = Logits()
    assert warm_up_logits_rows(logits, 4, torch.float32, torch.device("cpu"), 500) == 20
    assert logits.rows == list(range(1, 21))
    assert MAX_WARM_ROWS >= 576  # the README configuration's largest step at batch 64


def test_warm_up_of_no_rows_runs_nothing():
    logits = Logits()
    assert warm_up_logits_rows(logits, 4, torch.float32, torch.device("cpu"), 0) == 0
    assert logits.rows == []


def test_out_of_memory_stops_one_rank_and_says_so(caplog):
    logits = Logits(oom_at=9)
    with caplog.at_level("WARNING", logger="vllm.ddtree"):
        done = warm_up_logits_rows(logits, 4, torch.float32, torch.device("cpu"), 30)
    assert done == 8 and logits.rows == list(range(1, 9))
    assert "no GPU memory for the target's logits over 9 rows" in caplog.text


def test_out_of_memory_with_several_ranks_is_raised():
    """Ranks gather each count's logits: one rank stopping alone would leave the others
    waiting, so the error stops start-up instead."""
    with pytest.raises(torch.OutOfMemoryError):
        warm_up_logits_rows(Logits(oom_at=3), 4, torch.float32, torch.device("cpu"), 30,
                            single_rank=False)


def test_the_speculator_warms_the_target_s_logits_for_its_largest_step():
    """DDTreeSpeculator._warm_up_target_logits: the target's compute_logits (kept by
    load_model), the target's hidden size and dtype, the rows of its largest step."""
    drafter = pytest.importorskip("vllm_ddtree.dflash_tree_drafter")
    logits = Logits()
    spec = types.SimpleNamespace(
        _target_compute_logits=logits, _logits_warm=False, max_num_reqs=3, max_num_tokens=8192, tree_budget=5,
        _budget_by_batch=[5, 5, 5, 2], device=torch.device("cpu"),
        vllm_config=types.SimpleNamespace(
            model_config=types.SimpleNamespace(get_hidden_size=lambda: 4,
                                               dtype=torch.float32),
            parallel_config=types.SimpleNamespace(world_size=1)))
    drafter.DDTreeSpeculator._warm_up_target_logits(spec)
    assert logits.rows == list(range(1, 2 * 6 + 1))  # 2 requests x (1 + 5) beat 3 x 3
    # A second capture in the same process (cuBLAS keeps its choices) runs nothing.
    drafter.DDTreeSpeculator._warm_up_target_logits(spec)
    assert logits.rows == list(range(1, 2 * 6 + 1))


def test_a_failing_warm_up_leaves_start_up_going(caplog):
    """Any error but running out of memory is logged and start-up goes on: each row
    count then pays its kernel choice at its first step."""
    drafter = pytest.importorskip("vllm_ddtree.dflash_tree_drafter")

    def broken(hidden):
        raise RuntimeError("no logits here")

    spec = types.SimpleNamespace(
        _target_compute_logits=broken, _logits_warm=False, max_num_reqs=2, max_num_tokens=64, tree_budget=3,
        _budget_by_batch=None, device=torch.device("cpu"),
        vllm_config=types.SimpleNamespace(
            model_config=types.SimpleNamespace(get_hidden_size=lambda: 4,
                                               dtype=torch.float32),
            parallel_config=types.SimpleNamespace(world_size=2)))
    with caplog.at_level("WARNING", logger="vllm.ddtree"):
        drafter.DDTreeSpeculator._warm_up_target_logits(spec)
    assert "warming up the target's logits GEMM failed (no logits here)" in caplog.text
