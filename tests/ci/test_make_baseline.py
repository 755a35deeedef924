"""ci/make_baseline.py and the greedy-exactness rule it shares with bench/run.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.run import greedy_exact, strip_inexact_greedy

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "ci" / "make_baseline.py"
CHECK = ROOT / "ci" / "check_regression.py"


def result(dtype="float32", cuda_graphs=True, **extra):
    return {
        "git_rev": "abc1234", "command": "python bench/run.py --suite ci", "dtype": dtype,
        "cuda_graphs": cuda_graphs, **extra,
        "results": [
            {"config": "no-spec", "prompt_set": "humaneval", "batch_size": 1,
             "temperature": 0.0, "output_tokens_per_s": 390.0},
            {"config": "ddtree-b32", "prompt_set": "humaneval", "batch_size": 16,
             "temperature": 0.0, "tau": 2.0, "output_tokens_per_s": 1200.0,
             "greedy_match": False, "greedy_identical": 14, "greedy_total": 16},
        ],
    }


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT)


def test_greedy_is_exact_only_in_float32_eager():
    assert greedy_exact("float32", eager=True)
    assert not greedy_exact("float32", eager=False)
    assert not greedy_exact("bfloat16", eager=True)
    rows = result()["results"]
    assert strip_inexact_greedy(rows, True) == rows
    stripped = strip_inexact_greedy(rows, False)
    assert "greedy_match" not in stripped[1] and stripped[1]["greedy_identical"] == 14


def test_graph_run_becomes_a_baseline_the_gate_reads(tmp_path):
    src, out = tmp_path / "ci.json", tmp_path / "baseline.json"
    src.write_text(json.dumps(result()))
    proc = run("--from", src, "--out", out)
    assert proc.returncode == 0, proc.stderr
    base = json.loads(out.read_text())
    assert base["greedy_exact"] is False
    assert base["baseline_from"]["git_rev"] == "abc1234"
    assert all("greedy_match" not in r for r in base["results"])
    # The same run, written by the current bench/run.py (no greedy_match), passes the gate.
    cur = tmp_path / "cur.json"
    cur.write_text(json.dumps({**result(), "results": base["results"]}))
    gate = subprocess.run([sys.executable, str(CHECK), "--baseline", str(out), "--current",
                           str(cur)], capture_output=True, text=True)
    assert gate.returncode == 0, gate.stdout + gate.stderr


def test_exact_run_keeps_greedy_match_so_the_gate_enforces_it(tmp_path):
    src, out = tmp_path / "ci.json", tmp_path / "baseline.json"
    src.write_text(json.dumps(result(cuda_graphs=False)))
    assert run("--from", src, "--out", out).returncode == 0
    base = json.loads(out.read_text())
    assert base["greedy_exact"] is True
    assert base["results"][1]["greedy_match"] is False


@pytest.mark.parametrize("doc, needle", [
    ("not json", "cannot read a JSON result"),
    ({"results": "x"}, "not a benchmark result"),
    ({"results": [{"config": "a"}]}, "greedy_exact"),
    ({"dtype": "float32", "cuda_graphs": True, "results": []}, "'results' is empty"),
])
def test_bad_input_is_refused_with_a_message(tmp_path, doc, needle):
    src, out = tmp_path / "ci.json", tmp_path / "baseline.json"
    src.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    proc = run("--from", src, "--out", out)
    assert proc.returncode == 2
    assert needle in proc.stderr
    assert not out.exists()
