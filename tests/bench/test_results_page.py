"""docs/results.md is generated from bench/results/ (bench/results_page.py) and current."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bench import results_page

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_committed_page_is_the_generated_one():
    with open(results_page.PAGE) as f:
        assert f.read() == results_page.render(), (
            "docs/results.md is stale: run python3 bench/results_page.py")


def test_the_committed_plot_is_the_generated_one():
    path = os.path.join(os.path.dirname(results_page.PAGE), results_page.GOALS_PLOT)
    with open(path) as f:
        assert f.read() == results_page.render_goals_plot()


def test_check_mode_fails_on_a_stale_page_or_plot(tmp_path, monkeypatch):
    page = tmp_path / "results.md"
    page.write_text("old\n")
    monkeypatch.setattr(results_page, "PAGE", str(page))
    assert results_page.main(["--check"]) == 1
    assert page.read_text() == "old\n"  # --check writes nothing
    assert results_page.main([]) == 0 and results_page.main(["--check"]) == 0
    (tmp_path / results_page.GOALS_PLOT).write_text("<svg/>\n")
    assert results_page.main(["--check"]) == 1


def test_the_plot_draws_each_cell_and_each_files_ratio():
    cells = [{"suite": "fixture", "temperature": t, "batch": b, "ddtree_vs_no_spec": 1.1,
              "ddtree_vs_no_spec_by_file": [1.3, 0.82]} for t in (0.0, 1.0) for b in (1, 4, 16)]
    svg = results_page.goals_svg(cells)
    assert svg.count("<polyline") == 2 and svg.count("<circle") == 12
    assert "fixture, T=1: DDTree / plain decoding" in svg
    assert ">0.8<" in svg and ">1.2<" in svg  # the axis spans the lowest and highest ratio
    assert results_page.goals_svg([]) == ""


def test_the_page_shows_the_files_it_is_made_of(tmp_path):
    goals = {"git_rev": "abc", "prompt_set_held_out": "held", "goal": "the goal",
             "sources": [{"file": "run.json.gz", "command": "python bench/run.py ...",
                          "engine_order": ["no-spec", "ddtree-b64"], "gpu": "NVIDIA H100"}],
             "cells": [{"suite": "fixture", "prompt_set": "held", "mode": "waves", "batch": 4,
                        "temperature": 0.0, "tok_s": {"no-spec": 100.0, "ddtree": 120.0}, "tau": {"ddtree": 1.9},
                        "spread": {"no-spec": 0.1, "ddtree": 0.2},
                        "ddtree_vs_best_other": 1.2, "ddtree_vs_no_spec": 1.2,
                        "goal_met": True}]}
    (tmp_path / "goals.json").write_text(json.dumps(goals))
    run = tmp_path / "2026-01-02-a-run"
    run.mkdir()
    (run / "COMMANDS.md").write_text("# what the run measured\n\nbody\n")
    (run / "goals-later.json").write_text(json.dumps(goals))
    (tmp_path / "not-a-run").mkdir()
    page = results_page.render(str(tmp_path))
    assert "held out: `held`" in page and "met in 1 of 1 cells" in page
    assert "| fixture | held | waves | 4 | 0 | 100.0 |  | 120.0 | 1.2 | 1.2 |" in page
    assert "### Later run: `2026-01-02-a-run/goals-later.json`" in page
    assert "what the run measured |" in page and "not-a-run" not in page
    assert "`python bench/run.py ...`" in page
    assert "(engines in order: no-spec, ddtree-b64, NVIDIA H100)" in page    # the run's card


def test_the_script_runs_as_documented():
    out = subprocess.run([sys.executable, "bench/results_page.py", "--check"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
