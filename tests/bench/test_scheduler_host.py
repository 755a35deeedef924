"""bench/scheduler_host.py: vLLM's real scheduler timed for plain decoding and DDTree
(CPU; needs the patched vLLM, ``./apply.sh``)."""

from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("vllm")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from bench import scheduler_host  # noqa: E402


def test_it_times_both_schedulers_with_drafting_turned_off(tmp_path, monkeypatch):
    # The module patches vLLM's platform for its process; keep that to this test.
    import vllm.config.vllm as vllm_config_module
    import vllm.engine.arg_utils as arg_utils
    import vllm.platforms

    monkeypatch.setattr(vllm.platforms, "current_platform", vllm.platforms.current_platform,
                        raising=False)
    monkeypatch.setattr(arg_utils, "current_platform", arg_utils.current_platform)
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", vllm_config_module.HAS_TRITON)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    out = tmp_path / "scheduler-host.json"
    assert scheduler_host.main(["--out", str(out), "--batch-sizes", "4", "--warmup", "800",
                                "--steps", "300", "--rounds", "2"]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["batch"] == 4 and len(row["ddtree_over_plain_paired"]) == 2
    assert row["plain_us_p50"] > 0 and row["ddtree_us_p50"] > 0
    # Plain decoding never drafts; DDTree's controller has turned drafting off by then
    # (nothing is ever accepted), its probes aside.
    assert row["plain_drafted_steps"] == [0, 0]
    assert all(d < 0.2 * 300 for d in row["ddtree_drafted_steps"]), row


def test_drafting_mode_times_the_patched_methods_against_the_pinned_release(tmp_path,
                                                                          monkeypatch):
    import inspect

    import vllm.config.vllm as vllm_config_module
    import vllm.engine.arg_utils as arg_utils
    import vllm.platforms
    from vllm.v1.core.sched.scheduler import Scheduler

    monkeypatch.setattr(vllm.platforms, "current_platform", vllm.platforms.current_platform,
                        raising=False)
    monkeypatch.setattr(arg_utils, "current_platform", arg_utils.current_platform)
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", vllm_config_module.HAS_TRITON)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    patched = Scheduler._update_request_with_output
    # The pinned release's own methods, from the original files apply.sh kept.
    [(cls, name, fn), (stats_cls, stats_name, observe)] = scheduler_host.pristine_methods()
    assert cls is Scheduler and name == "_update_request_with_output"
    assert "first_stop" in inspect.getsource(patched)
    assert "first_stop" not in inspect.getsource(fn) and "check_stop" in fn.__globals__
    assert stats_cls is SpecDecodingStats and stats_name == "observe_draft"
    assert "_accepted_lengths" in inspect.getsource(SpecDecodingStats.observe_draft)
    assert "_accepted_lengths" not in inspect.getsource(observe)
    out = tmp_path / "scheduler-host.json"
    assert scheduler_host.main(["--out", str(out), "--batch-sizes", "4", "--warmup", "50",
                                "--steps", "100", "--rounds", "2", "--drafting", "4"]) == 0
    assert Scheduler._update_request_with_output is patched  # put back after each step
    assert "_accepted_lengths" in inspect.getsource(SpecDecodingStats.observe_draft)
    [row] = json.loads(out.read_text())["rows"]
    # DDTree drafted in every step, each half of them on the pinned release's method.
    assert row["ddtree_drafted_steps"] == [100, 100]
    assert row["ddtree_pristine_drafted_steps"] == [100, 100]
    assert row["plain_drafted_steps"] == [0, 0]
    assert len(row["ddtree_over_pristine_update_paired"]) == 2
    assert row["ddtree_update_us_p50"] > 0 and row["ddtree_pristine_update_us_p50"] > 0
    for bad in (["--drafting", "0"], ["--drafting", "4", "--quality", "1.5"]):
        with pytest.raises(SystemExit):
            scheduler_host.main(["--out", str(out), *bad])
