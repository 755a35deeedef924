"""ci/check_regression.py: pass, each kind of failure, missing entries and unusable input."""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "ci" / "check_regression.py"

_spec = importlib.util.spec_from_file_location("check_regression", SCRIPT)
assert _spec is not None and _spec.loader is not None
check_regression = importlib.util.module_from_spec(_spec)
sys.modules["check_regression"] = check_regression
_spec.loader.exec_module(check_regression)

BASELINE = {
    "git_rev": "abc1234",
    "command": "python bench/run.py --suite ci --out bench/results/ci-latest.json",
    "results": [
        {"config": "no-spec", "prompt_set": "humaneval", "batch_size": 1, "temperature": 0.0,
         "output_tokens_per_s": 390.0},
        {"config": "ddtree-b32", "prompt_set": "humaneval", "batch_size": 1, "temperature": 0.0,
         "tau": 4.0, "output_tokens_per_s": 900.0, "greedy_match": True},
        {"config": "ddtree-b32", "prompt_set": "humaneval", "batch_size": 16, "temperature": 0.0,
         "tau": 3.5, "output_tokens_per_s": 4000.0, "greedy_match": True},
    ],
}


def write(path: Path, doc) -> Path:
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc), encoding="utf-8")
    return path


def run(tmp_path: Path, current, baseline=BASELINE, *extra: str) -> tuple[int, str, str]:
    base = write(tmp_path / "baseline.json", baseline)
    cur = write(tmp_path / "current.json", current)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--baseline", str(base), "--current", str(cur), *extra],
        capture_output=True, text=True, timeout=60,
    )
    return proc.returncode, proc.stdout, proc.stderr


def changed(**by_index) -> dict:
    doc = copy.deepcopy(BASELINE)
    for index, fields in by_index.items():
        entry = doc["results"][int(index.lstrip("e"))]
        for field, value in fields.items():
            if value is ...:
                entry.pop(field, None)
            else:
                entry[field] = value
    return doc


def test_identical_results_pass(tmp_path):
    rc, out, err = run(tmp_path, BASELINE)
    assert rc == 0, out + err
    assert "PASS: 7 checks over 3 baseline entries" in out
    assert "FAIL" not in out


def test_drops_within_tolerance_pass(tmp_path):
    # tau 4.0 -> 3.81 is -4.75% (< 5%); 900 -> 811 tokens/s is -9.9% (< 10%).
    rc, out, _ = run(tmp_path, changed(e1={"tau": 3.81, "output_tokens_per_s": 811.0}))
    assert rc == 0, out
    assert "PASS" in out


def test_tau_drop_past_tolerance_fails(tmp_path):
    rc, out, _ = run(tmp_path, changed(e1={"tau": 3.79}))
    assert rc == 1
    line = next(l for l in out.splitlines() if "ddtree-b32/humaneval/bs1/T0" in l and " tau " in l)
    assert "FAIL" in line and ">= 3.800" in line
    assert "FAIL: 1 of 7 checks failed" in out


def test_tokens_per_s_drop_past_tolerance_fails(tmp_path):
    rc, out, _ = run(tmp_path, changed(e2={"output_tokens_per_s": 3599.0}))
    assert rc == 1
    line = next(l for l in out.splitlines() if "bs16" in l and "output_tokens_per_s" in l)
    assert "FAIL" in line and "-10.0%" in line


def test_baseline_config_throughput_is_checked_too(tmp_path):
    rc, out, _ = run(tmp_path, changed(e0={"output_tokens_per_s": 300.0}))
    assert rc == 1
    assert "no-spec/humaneval/bs1/T0" in out


def test_tolerances_are_configurable(tmp_path):
    current = changed(e1={"tau": 3.5})  # -12.5%
    assert run(tmp_path, current)[0] == 1
    assert run(tmp_path, current, BASELINE, "--tau-tolerance", "0.2")[0] == 0


def test_greedy_mismatch_fails_even_when_faster(tmp_path):
    rc, out, _ = run(tmp_path, changed(e1={"greedy_match": False, "tau": 9.0, "output_tokens_per_s": 2000.0}))
    assert rc == 1
    line = next(l for l in out.splitlines() if "greedy_match" in l and "bs1" in l)
    assert "FAIL" in line and "outputs differ" in line


def test_greedy_mismatch_in_entry_without_baseline_flag_fails(tmp_path):
    rc, _, _ = run(tmp_path, changed(e0={"greedy_match": False}))
    assert rc == 1


def test_greedy_flag_dropped_from_current_fails(tmp_path):
    rc, out, _ = run(tmp_path, changed(e2={"greedy_match": ...}))
    assert rc == 1
    assert "missing" in next(l for l in out.splitlines() if "greedy_match" in l and "bs16" in l)


def test_missing_entry_fails(tmp_path):
    current = copy.deepcopy(BASELINE)
    del current["results"][2]
    rc, out, _ = run(tmp_path, current)
    assert rc == 1
    line = next(l for l in out.splitlines() if "bs16" in l)
    assert "FAIL" in line and "no current result" in line


def test_missing_tau_in_current_fails(tmp_path):
    rc, out, _ = run(tmp_path, changed(e1={"tau": ...}))
    assert rc == 1
    assert "missing in current" in out


def test_extra_current_entries_are_reported_not_failed(tmp_path):
    current = copy.deepcopy(BASELINE)
    current["results"].append({"config": "ddtree-b64", "prompt_set": "humaneval", "batch_size": 1,
                               "temperature": 0.0, "tau": 4.4, "output_tokens_per_s": 950.0,
                               "greedy_match": True})
    rc, out, _ = run(tmp_path, current)
    assert rc == 0
    assert "without a baseline (tau and tokens/s not checked): ddtree-b64/humaneval/bs1/T0" in out


def test_greedy_mismatch_in_an_entry_without_baseline_fails(tmp_path):
    current = copy.deepcopy(BASELINE)
    current["results"].append({"config": "ddtree-b64", "prompt_set": "humaneval", "batch_size": 1,
                               "temperature": 0.0, "tau": 4.4, "output_tokens_per_s": 950.0,
                               "greedy_match": False})
    rc, out, _ = run(tmp_path, current)
    assert rc == 1
    assert "ddtree-b64/humaneval/bs1/T0" in out and "FAIL" in out


def _run_without_baseline(tmp_path, current, *extra):
    cur = write(tmp_path / "current.json", current)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--baseline", str(tmp_path / "absent.json"),
         "--current", str(cur), *extra],
        capture_output=True, text=True, timeout=60,
    )
    return proc.returncode, proc.stdout, proc.stderr


def test_missing_baseline_is_an_error_unless_allowed(tmp_path):
    rc, _, err = _run_without_baseline(tmp_path, BASELINE)
    assert rc == 2 and "absent.json" in err
    rc, out, err = _run_without_baseline(tmp_path, BASELINE, "--allow-missing-baseline")
    assert rc == 0 and "only greedy equivalence is checked" in err
    assert "PASS" in out


def test_missing_baseline_still_gates_greedy_equivalence(tmp_path):
    rc, out, _ = _run_without_baseline(tmp_path, changed(e2={"greedy_match": False}),
                                       "--allow-missing-baseline")
    assert rc == 1 and "FAIL" in out


def test_entries_match_on_temperature(tmp_path):
    current = changed(e1={"temperature": 1.0})
    rc, out, _ = run(tmp_path, current)
    assert rc == 1
    assert "no current result" in out


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not valid JSON"),
        ("[]", "expected a JSON object with a 'results' list"),
        (json.dumps({"results": []}), "'results' is empty"),
        (json.dumps({"results": [1]}), "results[0]: each result must be a JSON object"),
        (json.dumps(changed(e1={"tau": "3.1"})), "results[1]: 'tau' must be a number"),
        (json.dumps(changed(e1={"output_tokens_per_s": ...})), "'output_tokens_per_s' is required"),
        (json.dumps(changed(e0={"batch_size": 0})), "'batch_size' must be an integer >= 1"),
        (json.dumps(changed(e0={"config": ""})), "'config' must be a non-empty string"),
        (json.dumps(changed(e1={"greedy_match": "yes"})), "'greedy_match' must be true or false"),
        (json.dumps(changed(e2={"batch_size": 1})), "results[2]: duplicate entry ddtree-b32/humaneval/bs1/T0"),
    ],
)
def test_malformed_current_is_a_clear_error(tmp_path, content, message):
    rc, out, err = run(tmp_path, content)
    assert rc == 2, out + err
    assert message in err
    assert "current.json" in err
    assert out == ""


def test_malformed_baseline_is_a_clear_error(tmp_path):
    rc, _, err = run(tmp_path, BASELINE, "{}")
    assert rc == 2
    assert "baseline.json" in err


def test_unreadable_file_is_a_clear_error(tmp_path):
    write(tmp_path / "current.json", BASELINE)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--baseline", str(tmp_path / "nope.json"),
         "--current", str(tmp_path / "current.json")],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "nope.json: cannot read" in proc.stderr


@pytest.mark.parametrize("value", ["1.5", "-0.1", "abc"])
def test_bad_tolerance_is_rejected(tmp_path, value):
    rc, _, err = run(tmp_path, BASELINE, BASELINE, "--tps-tolerance", value)
    assert rc == 2
    assert "--tps-tolerance" in err


def test_compare_in_process_counts_checks():
    base = {e.key: e for e in (check_regression._parse_entry(r, "x") for r in BASELINE["results"])}
    checks = check_regression.compare(base, base, 0.05, 0.10)
    # no-spec: tokens/s only; each ddtree entry: greedy_match, tau, tokens/s.
    assert [c.metric for c in checks] == [
        "output_tokens_per_s",
        "greedy_match", "tau", "output_tokens_per_s",
        "greedy_match", "tau", "output_tokens_per_s",
    ]
    assert all(c.ok for c in checks)
