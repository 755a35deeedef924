"""vllm_ddtree.rank_trace: each rank's step lines, and their comparison."""

from types import SimpleNamespace

import pytest

from vllm_ddtree.rank_trace import RankTrace, compare_rank_traces


def _write(directory, rank, lines):
    (directory / f"rank-{rank}.txt").write_text("".join(f"{line}\n" for line in lines))


def test_switch_off_by_default(monkeypatch):
    monkeypatch.delenv("VLLM_DDTREE_RANK_TRACE", raising=False)
    assert RankTrace.from_env() is None
    monkeypatch.setenv("VLLM_DDTREE_RANK_TRACE", "/tmp/x")
    assert RankTrace.from_env().directory == "/tmp/x"


def test_verifier_writes_one_line_a_step(tmp_path):
    """TreeVerifier.prepare appends the step's requests, tokens, draft tokens and the
    next budget to this process's file (rank 0 without a process group)."""
    pytest.importorskip("torch")
    from vllm_ddtree.tree_verifier import TreeVerifier

    v = TreeVerifier(max_num_reqs=4, tree_budget=4, tree_depth=3, max_num_tokens=32,
                     device="cpu", fused_kernels=False, rank_trace=RankTrace(str(tmp_path)))
    # A step without drafts: one token per request (prepare returns early).
    v.prepare(SimpleNamespace(num_reqs=3, num_tokens=3, num_draft_tokens=0), next_budget=0)
    v.prepare(SimpleNamespace(num_reqs=2, num_tokens=2, num_draft_tokens=0), next_budget=8)
    assert (tmp_path / "rank-0.txt").read_text() == "3 3 0 0\n2 2 0 8\n"


def test_identical_ranks(tmp_path):
    lines = ["1 1 0 32", "1 33 32 32", "16 16 0 0", "16 16 0 8"]
    _write(tmp_path, 0, lines)
    _write(tmp_path, 1, lines)
    got = compare_rank_traces(str(tmp_path))
    assert got["identical"] and got["first_difference"] is None
    assert got["ranks"] == ["0", "1"] and got["steps"] == {"0": 4, "1": 4}
    assert got["verified_draft_tokens"] == {0: 3, 32: 1}
    assert got["next_budgets"] == {0: 1, 8: 1, 32: 2}


@pytest.mark.parametrize("other", [["1 1 0 32", "1 33 32 16"], ["1 1 0 32"]])
def test_a_difference_or_a_missing_step_shows(tmp_path, other):
    _write(tmp_path, 0, ["1 1 0 32", "1 33 32 32"])
    _write(tmp_path, 1, other)
    got = compare_rank_traces(str(tmp_path))
    assert not got["identical"] and got["first_difference"] == 1


def test_one_rank_is_not_agreement(tmp_path):
    _write(tmp_path, 0, ["1 1 0 32"])
    assert not compare_rank_traces(str(tmp_path))["identical"]
