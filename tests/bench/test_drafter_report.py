"""bench/drafter_report.py: drafter.json from a drafter, the trainer's eval.json and run files."""

from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from bench import drafter_report as R  # noqa: E402

DRAFTER = os.path.join(REPO, "bench", "fixture", "smollm2-dflash")


def _run_file(path, results, engines):
    with gzip.open(path, "wt") as f:
        json.dump({"git_rev": "abc1234", "results": results, "engines": engines}, f)


def _row(config, tau, prompt_set="humaneval", batch=1, t=0.0):
    return {"config": config, "prompt_set": prompt_set, "batch_size": batch, "temperature": t,
            "tau": tau, "acceptance_by_depth": [0.5, 0.2]}


def test_rows_from_runs_and_offline_eval(tmp_path):
    run = str(tmp_path / "run.json.gz")
    _run_file(run, [_row("no-spec", None), _row("dflash", 1.4), _row("ddtree-b8+static", 1.7),
                    _row("ddtree-b64-t512", 1.9, "sharegpt-untrained", t=1.0)],
              [{"config": "ddtree-b8+static"}, {"config": "ddtree-b64-t512", "online_budget": {}}])
    ev = tmp_path / "eval.json"
    ev.write_text(json.dumps({"eval": {"sharegpt": {"tau": 1.45, "p_accept_ge_k": [0.3]},
                                       "humaneval": {"tau": 1.51, "p_accept_ge_k": [0.4]}}}))
    trees = tmp_path / "offline-trees.json"
    trees.write_text(json.dumps({"trees": {"sharegpt": {"8": {"tau": 1.9, "p_accept_ge_k": [0.6]},
                                                        "128": {"tau": 2.6}}},
                                 "chain_t1": {"sharegpt": {"temperature": 1.0, "anchors": 9,
                                                           "tau_all_anchors": 1.3,
                                                           "t0_tau_all_anchors": 1.8}}}))
    out = tmp_path / "drafter.json"
    assert R.main(["--drafter", DRAFTER, "--offline", str(ev), "--offline", str(trees),
                   "--out", str(out), run]) == 0
    doc = json.loads(out.read_text())
    d = doc["drafter"]
    assert d["params"] == 8076928 and d["bytes"] == os.path.getsize(
        os.path.join(DRAFTER, "model.safetensors"))
    assert d["num_hidden_layers"] == 2 and d["block_size"] == 16
    assert doc["git_revs"] == ["abc1234"]
    # A run that does not say otherwise counted fixed-length answers (past EOS).
    assert {r["output_lengths"] for r in doc["tau"] if r["where"] == "engine"} == {"fixed"}
    got = {(r["where"], r["prompt_set"], r["method"], r["budget"], r["temperature"]):
           (r["tau"], r.get("online_budget")) for r in doc["tau"]}
    assert got == {
        ("engine", "humaneval", "dflash", 15, 0.0): (1.4, False),
        ("engine", "humaneval", "ddtree", 8, 0.0): (1.7, False),
        ("engine", "sharegpt-untrained", "ddtree", 64, 1.0): (1.9, True),
        ("offline", "sharegpt", "dflash", 15, 0.0): (1.45, None),
        ("offline", "humaneval", "dflash", 15, 0.0): (1.51, None),
        ("offline", "sharegpt", "ddtree", 8, 0.0): (1.9, None),
        ("offline", "sharegpt", "ddtree", 128, 0.0): (2.6, None),
        ("offline", "sharegpt", "dflash", 15, 1.0): (1.3, None),
    }
    assert {r.get("answers") for r in doc["tau"] if r["where"] == "offline"} == {None}
    t1 = next(r for r in doc["tau"] if r["temperature"] == 1.0 and r["where"] == "offline")
    assert t1["tau_kind"] == "mean over anchors" and t1["t0_same_anchors"] == 1.8


def test_the_safetensors_parameter_count_reads_the_header(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file
    path = str(tmp_path / "w.safetensors")
    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5)}, path, metadata={"format": "pt"})
    assert R.safetensors_params(path) == 17


def test_the_script_runs_as_documented(tmp_path):
    out = tmp_path / "d.json"
    r = subprocess.run([sys.executable, "bench/drafter_report.py", "--drafter", DRAFTER,
                        "--offline", "bench/results/drafter-training/eval.json", "--out", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert {x["prompt_set"] for x in json.loads(out.read_text())["tau"]} == {"sharegpt", "humaneval"}


def test_files_of_another_drafter_are_refused(tmp_path):
    """drafter.json describes one drafter: a run or offline file that measured other
    weights (its drafter_digest) stops the report with both digests named; a file
    measuring this drafter, or naming none, passes."""
    from bench.run import weights_digest

    mine = weights_digest(DRAFTER)
    run = str(tmp_path / "run.json.gz")
    with gzip.open(run, "wt") as f:
        json.dump({"git_rev": "abc1234", "drafter_digest": "000000000000",
                   "results": [_row("dflash", 1.4)], "engines": []}, f)
    with pytest.raises(SystemExit, match=f"weights 000000000000, not {mine}"):
        R.main(["--drafter", DRAFTER, "--out", str(tmp_path / "d.json"), run])
    off = tmp_path / "offline.json"
    off.write_text(json.dumps({"drafter_digest": "111111111111",
                               "eval": {"sharegpt": {"tau": 2.0}}}))
    with pytest.raises(SystemExit, match="offline.json: measured the drafter with weights 1111"):
        R.main(["--drafter", DRAFTER, "--offline", str(off), "--out", str(tmp_path / "d.json")])
    off.write_text(json.dumps({"drafter_digest": mine, "eval": {"sharegpt": {"tau": 2.0}}}))
    assert R.main(["--drafter", DRAFTER, "--offline", str(off),
                   "--out", str(tmp_path / "d.json")]) == 0
    doc = json.loads((tmp_path / "d.json").read_text())
    assert doc["drafter"]["digest"] == mine and doc["tau"][0]["tau"] == 2.0


def test_the_curve_reads_the_training_history_oldest_run_first():
    def run(steps, tokens, sharegpt, humaneval, seconds=None):
        r = {"start_step": 0, "end_step": steps, "response_tokens": tokens,
             "data": ["d"], "eval": {"sharegpt": sharegpt, "humaneval": humaneval}}
        if seconds is not None:
            r["seconds"] = seconds
        return r
    first = {"settings": {"layers": 2}, "runs": [run(1000, 10, 1.5, 1.4, seconds=80.0)]}
    second = {"settings": {"layers": 2, "init_from": first},
              "runs": [run(1718, 20, 1.5 + 0.3, 1.4 + 0.1, seconds=120.0)]}
    third = {"settings": {"layers": 3, "init_from": second}, "runs": [run(4671, 30, 1.5 + 0.6, 1.4)]}
    curve = R.training_curve(third, {"sharegpt": 2.4, "humaneval": 3.0})
    assert [p["steps"] for p in curve["runs"]] == [1000, 2718, 7389]
    assert [p["layers"] for p in curve["runs"]] == [2, 2, 3]
    # ln(steps) rises by 1 a run: sharegpt rises 0.3 an e-fold, exactly on the line.
    sg = curve["fit"]["sharegpt"]
    assert sg["b_per_e_fold"] == pytest.approx(0.3) and sg["last"] == pytest.approx(2.1)
    assert sg["steps_to_goal"] == pytest.approx(7389 * math.e, rel=1e-3)  # 0.3 more: an e-fold
    # A set that does not rise over the runs has no step count to its goal.
    assert curve["fit"]["humaneval"]["steps_to_goal"] is None
    assert curve["seconds_per_step"] == pytest.approx(200.0 / 2718, abs=1e-4)
    assert R.training_curve(None) is None


def test_the_committed_drafters_curve_is_in_drafter_json():
    with open(os.path.join(REPO, "bench", "results", "drafter.json")) as f:
        doc = json.load(f)
    with open(os.path.join(DRAFTER, "config.json")) as f:
        cfg = json.load(f)
    assert doc["curve"] == R.training_curve(cfg["fixture_training"])
