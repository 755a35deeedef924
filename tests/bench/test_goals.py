"""bench/goals.py: the goal table from bench/run.py result files (no GPU, no vLLM)."""

from __future__ import annotations

import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from bench import goals as G  # noqa: E402
from bench.result_files import dumps_rows  # noqa: E402


def _doc(order, rates, rounds=1, suite="fixture", vllm_version="0.26.0"):
    """A result file: engines started in ``order`` (reversed every other round), one
    batch-4 T=0 cell with ``rates[config]`` tokens/s per round."""
    engines, results = [], []
    for r in range(rounds):
        for config in (order if r % 2 == 0 else order[::-1]):
            engines.append({"config": config, "round": r})
            results.append({"config": config, "prompt_set": "held", "batch_size": 4,
                            "temperature": 0.0, "output_tokens_per_s": rates[config][r],
                            "tau": 1.5 if config != "no-spec" else None})
    return {"suite": suite, "cell_mode": "waves", "engines": engines, "results": results,
            "git_rev": "abc", "vllm_version": vllm_version}


RATES = {"no-spec": [100.0, 110.0], "dflash-t512": [90.0, 95.0],
         "ddtree-b64-t512": [120.0, 100.0]}


def test_a_cell_pools_every_round_and_states_the_goal_ratios():
    doc = _doc(["no-spec", "dflash-t512", "ddtree-b64-t512"], RATES, rounds=2)
    [cell] = G.summarise(G.gather([doc]))
    assert cell["tok_s"] == {"no-spec": 105.0, "dflash": 92.5, "ddtree": 110.0}
    assert cell["repeats"] == {"no-spec": 2, "dflash": 2, "ddtree": 2}
    assert cell["ddtree_vs_best_other"] == round(110 / 105, 4) and cell["goal_met"]
    assert cell["spread"]["ddtree"] == round(20 / 110, 4)


def test_both_orders_needs_ddtree_started_first_and_last():
    two_rounds = _doc(["no-spec", "dflash-t512", "ddtree-b64-t512"], RATES, rounds=2)
    [cell] = G.summarise(G.gather([two_rounds]))
    assert cell["both_orders"]
    assert cell["engine_orders"] == [["ddtree", "dflash", "no-spec"],
                                     ["no-spec", "dflash", "ddtree"]]
    one = _doc(["no-spec", "dflash-t512", "ddtree-b64-t512"], RATES)
    [cell] = G.summarise(G.gather([one]))
    assert not cell["both_orders"] and cell["engine_orders"] == [["no-spec", "dflash", "ddtree"]]
    # DDTree in the middle of both orders is neither first nor last.
    middle = [_doc(["no-spec", "ddtree-b64-t512", "dflash-t512"], RATES),
              _doc(["dflash-t512", "ddtree-b64-t512", "no-spec"], RATES)]
    [cell] = G.summarise(G.gather(middle))
    assert not cell["both_orders"]
    # Two files in opposite orders count as both.
    files = [_doc(["no-spec", "dflash-t512", "ddtree-b64-t512"], RATES),
             _doc(["ddtree-b64-t512", "dflash-t512", "no-spec"], RATES)]
    [cell] = G.summarise(G.gather(files))
    assert cell["both_orders"]


def test_two_ddtree_configs_in_one_cell_need_a_choice():
    rates = dict(RATES, **{"ddtree-b32": [1.0, 1.0]})
    doc = _doc(["no-spec", "ddtree-b64-t512", "ddtree-b32"], rates)
    with pytest.raises(SystemExit, match="two ddtree configs"):
        G.gather([doc])
    [cell] = G.summarise(G.gather([doc], ddtree="ddtree-b32"))
    assert cell["configs"]["ddtree"] == "ddtree-b32" and not cell["goal_met"]


def test_main_writes_the_summary_and_counts_cells_met_in_both_orders(tmp_path, capsys):
    paths = []
    for i, order in enumerate((["no-spec", "ddtree-b64-t512"], ["ddtree-b64-t512", "no-spec"])):
        p = tmp_path / f"r{i}.json"
        p.write_text(json.dumps({**_doc(order, RATES), "gpu": "NVIDIA H200"}))
        paths.append(str(p))
    out = tmp_path / "goals.json"
    assert G.main(["--held-out", "held", "--out", str(out), "--table",
                   str(tmp_path / "goals.md"), *paths]) == 0
    doc = json.loads(out.read_text())
    # One line per top-level field and per cell, read back as the same document.
    lines = out.read_text().splitlines()
    assert len(lines) == 2 + (len(doc) - 1) + 2 + len(doc["cells"])
    assert json.loads(dumps_rows(doc, "cells")) == doc
    assert doc["prompt_set_held_out"] == "held" and doc["git_rev"] == "abc"
    assert [s["engine_order"] for s in doc["sources"]] == [
        ["no-spec", "ddtree-b64-t512"], ["ddtree-b64-t512", "no-spec"]]
    assert [s["gpu"] for s in doc["sources"]] == ["NVIDIA H200"] * 2    # each run's card
    assert doc["cells"][0]["both_orders"]
    assert "1 cells, goal met in 1 (1 of them with DDTree's engine started both first" \
        in capsys.readouterr().out
    assert "| 0.26.0 | NVIDIA H200 |  | fixture | held | waves | 4 | 0 |" in (tmp_path / "goals.md").read_text()


def test_each_vllm_version_gets_its_own_cells():
    order = ["no-spec", "dflash-t512", "ddtree-b64-t512"]
    older = _doc(order, RATES)
    newer = _doc(order, {"no-spec": [200.0], "dflash-t512": [150.0], "ddtree-b64-t512": [180.0]},
                 vllm_version="0.33.0")
    cells = G.summarise(G.gather([older, newer]))
    assert [(c["vllm_version"], c["tok_s"]["no-spec"]) for c in cells] == [
        ("0.26.0", 100.0), ("0.33.0", 200.0)]
    assert cells[0]["goal_met"] and not cells[1]["goal_met"]
    # A file from before the field existed is its own version, "unknown".
    del older["vllm_version"]
    assert {c["vllm_version"] for c in G.summarise(G.gather([older, newer]))} == {
        "unknown", "0.33.0"}


def test_each_gpu_gets_its_own_cells():
    # Tokens a second of two kinds of card are never pooled into one median.
    order = ["no-spec", "dflash-t512", "ddtree-b64-t512"]
    h100 = {**_doc(order, RATES), "gpu": "NVIDIA H100 80GB HBM3"}
    h200 = {**_doc(order, {"no-spec": [200.0], "dflash-t512": [150.0],
                           "ddtree-b64-t512": [180.0]}), "gpu": "NVIDIA H200"}
    cells = G.summarise(G.gather([h100, h200]))
    assert [(c["gpu"], c["tok_s"]["no-spec"]) for c in cells] == [
        ("NVIDIA H100 80GB HBM3", 100.0), ("NVIDIA H200", 200.0)]
    assert cells[0]["goal_met"] and not cells[1]["goal_met"]
    del h100["gpu"]
    assert {c["gpu"] for c in G.summarise(G.gather([h100, h200]))} == {"unknown", "NVIDIA H200"}


def test_each_drafter_gets_its_own_cells():
    # A retrained drafter's runs are not pooled with the runs of the drafter before it;
    # the dummy-weight suites name none (None) and sort with the others.
    order = ["no-spec", "dflash-t512", "ddtree-b64-t512"]
    old = {**_doc(order, RATES), "drafter_digest": "c06a7a2074fa"}
    new = {**_doc(order, {"no-spec": [100.0], "dflash-t512": [90.0],
                          "ddtree-b64-t512": [150.0]}), "drafter_digest": "4ef2a090510f"}
    dummy = _doc(order, RATES, suite="cost8b")
    cells = G.summarise(G.gather([old, new, dummy]))
    assert [(c["suite"], c["drafter_digest"], c["tok_s"]["ddtree"]) for c in cells] == [
        ("cost8b", None, RATES["ddtree-b64-t512"][0]),
        ("fixture", "4ef2a090510f", 150.0),
        ("fixture", "c06a7a2074fa", RATES["ddtree-b64-t512"][0])]
    assert "| 4ef2a090510f | fixture |" in G.table(cells)


def test_per_file_ratios_show_what_the_pooled_median_hides():
    # Drift that favours the engine started last: each file's ratio keeps its order's
    # bias, the pooled median mixes plain's and DDTree's runs of different files.
    first = _doc(["no-spec", "ddtree-b64-t512"], {"no-spec": [100.0], "ddtree-b64-t512": [150.0]})
    second = _doc(["ddtree-b64-t512", "no-spec"], {"no-spec": [160.0], "ddtree-b64-t512": [120.0]})
    [cell] = G.summarise(G.gather([first, second]))
    assert cell["ddtree_vs_no_spec_by_file"] == [1.5, 0.75]
    assert cell["ddtree_vs_no_spec"] == round(135 / 130, 4)
    assert "| 1.50 / 0.75 |" in G.table([cell])


def _interleaved(runs: dict[str, list[float]]) -> dict:
    """A ``--interleave`` file: one batch-4 T=0 cell, repeat i of every engine taken in
    the same turn."""
    return {"suite": "fixture", "cell_mode": "steady", "interleave": True, "git_rev": "abc",
            "vllm_version": "0.26.0",
            "engines": [{"config": c, "round": 0} for c in runs],
            "results": [{"config": c, "prompt_set": "held", "batch_size": 4,
                         "temperature": 0.0, "output_tokens_per_s": sorted(r)[len(r) // 2],
                         "output_tokens_per_s_runs": r, "interleaved": True,
                         "tau": None if c == "no-spec" else 1.5} for c, r in runs.items()]}


def test_interleaved_files_judge_a_cell_on_paired_runs():
    """The host slows down over the call and both engines with it: pooled medians make
    DDTree look 0.95x, the pairs (each repeat against the other engines' same repeat,
    the better of plain and chain) say 1.0x."""
    doc = _interleaved({"no-spec": [100.0, 200.0, 300.0],
                        "dflash-t512": [50.0, 100.0, 150.0],
                        "ddtree-b64-t512": [100.0, 190.0, 330.0]})
    [cell] = G.summarise(G.gather([doc]))
    assert cell["ddtree_vs_best_other"] == 0.95
    assert cell["ddtree_vs_best_other_paired"] == {"median": 1.0, "min": 0.95, "max": 1.1,
                                                   "pairs": 3}
    assert cell["ddtree_vs_no_spec_paired"]["median"] == 1.0
    assert cell["ddtree_vs_dflash_paired"]["median"] == 2.0
    assert cell["goal_basis"] == "paired" and cell["goal_met"]
    assert "1.0 (0.95-1.1, 3)" in G.table([cell])


def test_a_cell_with_a_file_run_one_engine_after_another_is_judged_pooled():
    interleaved = _interleaved({"no-spec": [100.0, 200.0, 300.0],
                                "ddtree-b64-t512": [100.0, 190.0, 330.0]})
    sequential = _doc(["no-spec", "ddtree-b64-t512"],
                      {"no-spec": [200.0], "ddtree-b64-t512": [150.0]})
    sequential["cell_mode"] = "steady"
    [cell] = G.summarise(G.gather([interleaved, sequential]))
    # The pairs come from the interleaved file only; the goal from the pooled medians.
    assert cell["ddtree_vs_no_spec_paired"]["pairs"] == 3
    assert cell["goal_basis"] == "pooled"
    assert cell["ddtree_vs_best_other"] == round(170 / 200, 4) and not cell["goal_met"]


def test_each_cell_also_says_what_its_latest_file_gives(tmp_path, capsys):
    """Pooled over files of older trees, a cell can miss while the newest run meets the
    goal (or the other way round): ``latest`` judges the last file given that ran DDTree
    and the other engines, on its pairs when it interleaved them."""
    old = _interleaved({"no-spec": [100.0, 100.0, 100.0], "dflash-t512": [50.0, 50.0, 50.0],
                        "ddtree-b64-t512": [80.0, 85.0, 90.0]})
    old["git_rev"] = "old1"
    new = _interleaved({"no-spec": [100.0, 200.0, 300.0], "dflash-t512": [50.0, 60.0, 70.0],
                        "ddtree-b64-t512": [99.0, 210.0, 300.0]})
    new["git_rev"] = "new2"
    # A later file without the chain cannot say DDTree / the better of the two.
    plain_only = _interleaved({"no-spec": [100.0], "ddtree-b64-t512": [50.0]})
    plain_only["git_rev"] = "new3"
    [cell] = G.summarise(G.gather([old, new, plain_only]))
    assert not cell["goal_met"]  # paired median over all six pairs (and the seventh)
    assert cell["latest"] == {"file": 1, "git_rev": "new2", "ddtree_vs_best_other": 1.0,
                              "basis": "paired", "goal_met": True}
    assert "| 1.0 (new2) |" in G.table([cell])
    # One engine after another: the ratio of that file's medians.
    seq = _doc(["no-spec", "ddtree-b64-t512"], {"no-spec": [200.0], "ddtree-b64-t512": [190.0]})
    seq["cell_mode"] = "steady"
    [cell] = G.summarise(G.gather([plain_only, seq]))
    assert cell["latest"]["basis"] == "medians" and cell["latest"]["ddtree_vs_best_other"] == 0.95
    assert not cell["latest"]["goal_met"] and cell["latest"]["git_rev"] == "abc"
    # main names the file.
    paths = []
    for name, doc in (("old.json", old), ("new.json", new)):
        (tmp_path / name).write_text(json.dumps(doc))
        paths.append(str(tmp_path / name))
    out = tmp_path / "goals.json"
    assert G.main(["--held-out", "held", "--out", str(out), *paths]) == 0
    assert json.loads(out.read_text())["cells"][0]["latest"]["file"] == "new.json"
    assert "in each cell's latest file: 1 of 1" in capsys.readouterr().out
