"""bench/check_jit_during_serving.py without a GPU: reading the engine's log, and the
driver with the engine's process faked."""

import importlib.util
import json
import os
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
    def fake(cmd, stdout=None, stderr=None, text=None, timeout=None, env=None):
        assert "--serve" in cmd and cmd[cmd.index("--batch-sizes") + 1:] == ["1", "4"]
        # The engine runs with the key hook first on its path.
        assert env["JITCHECK_KEYS"] == "1"
        assert env["PYTHONPATH"].split(os.pathsep)[0] == check.KEY_HOOK_DIR
        return types.SimpleNamespace(stdout=log, returncode=returncode)
    return fake


@pytest.mark.parametrize("fail_flag, expected_rc", [([], 0), (["--fail-on-compile"], 1)])
def test_driver_writes_the_report_and_fails_on_compiles_only_when_asked(
        tmp_path, monkeypatch, capsys, fail_flag, expected_rc):
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
    # No key lines in this log: the output says the key hook did not run.
    assert "whole keys recorded: 0" in capsys.readouterr().out


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


def _key_hook_module():
    spec = importlib.util.spec_from_file_location(
        "jit_key_hook_t", os.path.join(check.KEY_HOOK_DIR, "sitecustomize.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


key_hook = _key_hook_module()


def _specialization(aligned: bool, block: int) -> str:
    """What Triton 3.6 hands its post-compile hook, made by Triton's own serialiser:
    a pointer (16-byte aligned or not), an integer and a constexpr."""
    from triton.runtime.jit import serialize_specialization_data

    attrs = {(2,): [["tt.divisibility", 16]]}
    if aligned:
        attrs[(0,)] = [["tt.divisibility", 16]]
    options = types.SimpleNamespace(num_warps=4)
    return serialize_specialization_data(
        "vllm.x._prep_kernel", {"num_sampled_ptr": "*i32", "n": "i32", "out_ptr": "*i64",
                                "BLOCK_SIZE": "constexpr"},
        {(3,): block}, attrs, options, "key")


def test_key_hook_describes_every_argument_and_constexpr():
    d = key_hook.describe(_specialization(aligned=False, block=64))
    assert d["kernel"] == "_prep_kernel" and d["function"] == "vllm.x._prep_kernel"
    assert d["args"] == {"num_sampled_ptr": "*i32", "n": "i32",
                         "out_ptr": "*i64 divisibility=16"}
    assert d["constexprs"] == {"BLOCK_SIZE": 64}


def test_key_hook_prints_a_line_and_calls_the_hook_it_replaced(capsys):
    calls = []
    hook = key_hook._hook_chained_to(lambda **kw: calls.append(kw) or "previous")
    data = _specialization(aligned=True, block=32)
    assert hook(key="k", compile={"specialization_data": data}) == "previous"
    assert calls == [{"key": "k", "compile": {"specialization_data": data}}]
    line = capsys.readouterr().err.strip()
    assert line.startswith(key_hook.KEY_MARKER + " ")
    assert json.loads(line.split(" ", 1)[1])["args"]["num_sampled_ptr"] == "*i32 divisibility=16"
    # A key it cannot read is logged, never raised into Triton's compilation.
    assert key_hook._hook_chained_to(None)(compile={"specialization_data": "{"}) is None
    assert "error" in capsys.readouterr().err


def test_report_names_the_arguments_that_differ_between_compilations():
    def key_line(aligned, block):
        described = key_hook.describe(_specialization(aligned, block))
        return f"(EngineCore pid=1) {check.KEY_MARKER} {json.dumps(described)}"
    lines = [key_line(True, 64), f"{check.MARKER} batch=8", key_line(False, 64),
             key_line(True, 32), f"{check.MARKER} done"]
    report = check.parse_log(lines)
    assert [k["phase"] for k in report["keys"]] == ["start-up", "batch=8", "batch=8"]
    assert report["varying_args"] == {"_prep_kernel": {
        "num_sampled_ptr": ["*i32 divisibility=16", "*i32"], "BLOCK_SIZE": [64, 32]}}
    assert report["total"] == 0  # the monitor's own events are what count as compiles


def test_the_engine_process_starts_with_the_hook_installed(tmp_path):
    """Python runs the folder's sitecustomize at start-up when it leads PYTHONPATH, and
    still runs one further on the path."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import builtins\nbuiltins.OTHER_SITE = 1\n")
    env = {**os.environ, "JITCHECK_KEYS": "1",
           "PYTHONPATH": os.pathsep.join([check.KEY_HOOK_DIR, str(other)])}
    probe = ("import builtins; from triton import knobs; "
             "print(knobs.runtime.jit_post_compile_hook.__name__, builtins.OTHER_SITE)")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["on_compile", "1"]
