"""bench/check_jit_during_serving.py without a GPU: reading the engine's log, and the
driver with the engine's process faked."""

import json
import subprocess
import sys
import types

import pytest

import bench.check_jit_during_serving as check

# A verbose monitor line as vllm/utils/jit_monitor.py writes it (engine-core prefix).
WALK = ("(EngineCore pid=1807) WARNING 11-30 19:52:53 [jit_monitor.py:135] Triton kernel "
        "JIT compilation during inference: _walk_fused_kernel (constexprs={BLOCK=128}; "
        "signature={n: i32}; extra_compile_info={}; key=('a', (1, 2))). This causes a "
        "latency spike; consider extending warmup to cover this shape/config.")
POST = ("WARNING [jit_monitor.py:135] Triton kernel JIT compilation during inference: "
        "_post_update_kernel. This causes a latency spike; consider extending warmup to "
        "cover this shape/config.")


def test_events_fall_in_the_phase_of_the_last_marker():
    lines = ["INFO engine ready", f"{check.MARKER} batch=1", "noise", WALK,
             f"{check.MARKER} batch=4", POST, POST, f"{check.MARKER} done"]
    report = check.parse_log(lines)
    assert report["total"] == 3
    assert [e["phase"] for e in report["events"]] == ["batch=1", "batch=4", "batch=4"]
    first = report["events"][0]
    assert first["kernel"] == "_walk_fused_kernel" and first["backend"] == "Triton"
    assert first["detail"].startswith("constexprs={BLOCK=128}") and first["detail"].endswith("(1, 2))")
    assert report["events"][1]["detail"] is None
    assert report["compiles_by_kernel"] == {"_walk_fused_kernel": 1, "_post_update_kernel": 2}
    assert report["compiles_by_phase"] == {"batch=1": 1, "batch=4": 2}


def test_a_log_without_events_reports_none():
    report = check.parse_log(["INFO Kernel JIT monitor activated", f"{check.MARKER} done"])
    assert report["total"] == 0 and report["events"] == []


def test_autotuning_counts_as_a_compile():
    report = check.parse_log(["Triton autotuning for function _some_kernel finished after 1s"])
    assert report["events"][0]["event"] == "autotuning"


def _fake_run(log, returncode=0):
    """subprocess.run of the engine's process: its merged output is ``log``."""
    def fake(cmd, stdout=None, stderr=None, text=None, timeout=None):
        assert "--serve" in cmd and cmd[cmd.index("--batch-sizes") + 1:] == ["1", "4"]
        return types.SimpleNamespace(stdout=log, returncode=returncode)
    return fake


@pytest.mark.parametrize("fail_flag, expected_rc", [([], 0), (["--fail-on-compile"], 1)])
def test_driver_writes_the_report_and_fails_on_compiles_only_when_asked(
        tmp_path, monkeypatch, fail_flag, expected_rc):
    log = "\n".join([f"{check.MARKER} batch=1", WALK, f"{check.MARKER} done"])
    monkeypatch.setattr(subprocess, "run", _fake_run(log))
    out = tmp_path / "jit.json"
    monkeypatch.setattr(sys, "argv", ["check", "--target", "t", "--drafter", "d",
                                      "--batch-sizes", "1", "4", "--out", str(out),
                                      *fail_flag])
    assert check.main() == expected_rc
    report = json.loads(out.read_text())
    assert report["finished"] and report["total"] == 1 and report["config"] == "ddtree-b64-t512"
    assert (tmp_path / "jit.log").read_text() == log


def test_an_engine_that_never_finished_is_not_a_pass(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "run", _fake_run(f"{check.MARKER} batch=1\nTraceback", 1))
    out = tmp_path / "jit.json"
    monkeypatch.setattr(sys, "argv", ["check", "--target", "t", "--drafter", "d",
                                      "--batch-sizes", "1", "4", "--out", str(out)])
    assert check.main() == 2
    assert json.loads(out.read_text())["finished"] is False


def test_bad_arguments_are_refused_before_any_engine(monkeypatch, capsys):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("engine started"))
    for argv in (["--config", "ddtree-bx"], ["--batch-sizes", "0"]):
        monkeypatch.setattr(sys, "argv", ["check", "--target", "t", "--drafter", "d",
                                          "--out", "x.json", *argv])
        with pytest.raises(SystemExit) as e:
            check.main()
        assert e.value.code == 2
