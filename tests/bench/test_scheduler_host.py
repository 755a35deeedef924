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
