"""bench/check_graph_mode_outputs.py without a GPU: the comparison, and the driver
with each mode's process faked."""

import json
import subprocess
import types

import pytest

import bench.check_graph_mode_outputs as check


def test_first_difference():
    assert check.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert check.first_difference([1, 2, 3], [0, 2, 3]) == 0
    assert check.first_difference([1, 2, 3], [1, 2, 4]) == 2
    assert check.first_difference([1, 2], [1, 2, 3]) == 2


def test_compare_counts_identical_and_first_token_differences():
    ref = [[1, 2], [3, 4], [5, 6]]
    got = check.compare(ref, [[1, 2], [0, 4], [5, 0]])
    assert got == {"identical": 1, "total": 3, "first_difference_per_request": [None, 0, 1],
                   "differ_at_first_token": 1}


def test_prompts_are_fixed_by_the_seed():
    a, b = check.prompts(4), check.prompts(4)
    assert a == b and len(a) == 4 and all(100 <= len(p) < 200 for p in a)


def test_driver_compares_every_mode_with_the_first_and_records_failures(tmp_path, monkeypatch):
    tokens = {"eager": [[1, 2], [3, 4]], "full": [[0, 7], [3, 4]]}

    def fake_run(cmd, capture_output, text, timeout):
        mode = cmd[cmd.index("--one") + 1]
        if mode == "default":
            return types.SimpleNamespace(stdout="", stderr="boom", returncode=1)
        result = {"mode": mode, "tokens": tokens[mode], "ddtree_series": None}
        return types.SimpleNamespace(stdout="log\nRESULT " + json.dumps(result), stderr="",
                                     returncode=0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    out = tmp_path / "o.json"
    monkeypatch.setattr("sys.argv", ["x", "--model", "m", "--modes", "eager", "full", "default",
                                     "--out", str(out)])
    check.main()
    runs = {r["mode"]: r for r in json.loads(out.read_text())["runs"]}
    assert runs["full"]["against_eager"]["differ_at_first_token"] == 1
    assert runs["full"]["against_eager"]["identical"] == 1
    assert runs["default"]["error"] == "exit 1" and runs["default"]["stderr_tail"] == "boom"


def test_full_maxq_sets_the_capture_max_query_len_to_the_token_count_only_when_capturing():
    calls = []
    state = types.SimpleNamespace(build_attn_metadata=lambda **kw: calls.append(kw) or "meta")
    check.capture_max_query_len_as_token_count(state)
    assert state.build_attn_metadata(num_tokens=96, max_query_len=2,
                                     for_cudagraph_capture=True) == "meta"
    state.build_attn_metadata(num_tokens=96, max_query_len=7, for_cudagraph_capture=False)
    assert [c["max_query_len"] for c in calls] == [96, 7]
    assert check.MODES["full-maxq"] == check.MODES["full"]


def test_full_maxq_wraps_the_function_vllm_calls():
    vllm_default = pytest.importorskip("vllm.v1.worker.gpu.model_states.default")
    original = vllm_default.build_attn_metadata
    try:
        check.capture_max_query_len_as_token_count()
        assert vllm_default.build_attn_metadata is not original
    finally:
        vllm_default.build_attn_metadata = original
