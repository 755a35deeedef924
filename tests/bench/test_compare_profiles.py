"""bench/compare_profiles.py: per-step own time of two cProfile reports."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.compare_profiles import compare, engine_steps, main, parse_cprofile

ROOT = Path(__file__).resolve().parents[2]

REPORT = """=== by own time (tottime) ===
         100 function calls in 0.5 seconds

   ncalls  tottime  percall  cumtime  percall filename:lineno(function)
      {steps}    {sched}    0.000    0.020    0.000 scheduler.py:425(schedule)
      {steps}    {prop}    0.000    0.060    0.000 speculator.py:310(propose)
  400/200    0.010    0.000    0.030    0.000 model_runner.py:883(prepare_inputs)

=== by cumulative time ===
   ncalls  tottime  percall  cumtime  percall filename:lineno(function)
      999    9.999    0.000    9.999    0.000 scheduler.py:425(schedule)
"""


def test_times_are_per_engine_step_and_missing_rows_count_as_zero():
    base = parse_cprofile(REPORT.format(steps=100, sched="0.010", prop="0.000"))
    other = parse_cprofile(REPORT.format(steps=50, sched="0.010", prop="0.025"))
    assert engine_steps(base) == 100 and engine_steps(other) == 50
    assert base["model_runner.py:883(prepare_inputs)"]["ncalls"] == 400  # recursive calls
    rows = {r["function"]: r for r in compare(base, other)}
    assert rows["speculator.py:310(propose)"] == {
        "function": "speculator.py:310(propose)", "base_us": 0.0, "other_us": 500.0,
        "delta_us": 500.0}
    # The same total over half the steps: twice the time per step.
    assert rows["scheduler.py:425(schedule)"]["delta_us"] == 100.0
    assert compare(base, other, top=1)[0]["function"] == "speculator.py:310(propose)"


def test_a_report_without_the_scheduler_is_refused(tmp_path, capsys):
    text = REPORT.replace("scheduler.py:425(schedule)", "other.py:1(f)")
    with pytest.raises(ValueError, match="engine steps"):
        engine_steps(parse_cprofile(text))
    a = tmp_path / "a.txt"
    a.write_text(text)
    assert main([str(a), str(a)]) == 1
    assert "cannot count the engine steps" in capsys.readouterr().err


def test_the_committed_step_profiles_compare(capsys):
    prof = ROOT / "bench" / "results" / "profile"
    assert main([str(prof / "profile-no-spec-cprofile.txt"),
                 str(prof / "profile-ddtree-b32-cprofile.txt"), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "engine steps: base 129, other 73" in out and len(out.splitlines()) == 5
