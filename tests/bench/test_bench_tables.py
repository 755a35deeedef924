"""bench/tables.py: docs/benchmarks.md's tables from a bench/run.py result."""

from __future__ import annotations

import json

import pytest

from bench.tables import main, markdown_tables


def _cell(config, batch, tps, tau=None, verified=None, temp=0.0, pset="humaneval"):
    row = {"config": config, "prompt_set": pset, "temperature": temp, "batch_size": batch,
           "output_tokens_per_s": tps}
    if tau is not None:
        row["tau"] = tau
    if verified is not None:
        row["verified_tokens_per_forward_all_steps"] = verified
    return row


DOC = {"results": [
    _cell("no-spec", 1, 500.0), _cell("no-spec", 4, 2000.0),
    _cell("dflash", 1, 300.0, 1.36), _cell("dflash", 4, 1200.0, 1.36),
    _cell("dflash-t512", 1, 400.0, 1.36),  # batch 4 not measured
    _cell("ddtree", 1, 520.0, 2.01, 65.0), _cell("ddtree", 4, 1800.0, 2.0, 260.0),
    {"config": "ddtree", "prompt_set": "humaneval", "temperature": 0.0, "batch_size": 16,
     "error": "engine failed"},  # a failed cell has no tokens/s: ignored
]}


def test_ratios_use_the_better_chain_per_cell_and_skip_missing_cells():
    text = markdown_tables(DOC, "ddtree", ["dflash", "dflash-t512"])
    lines = text.splitlines()
    assert lines[0] == "**humaneval, T=0**"
    assert "| dflash-t512 | 400 (1.36) | - |" in lines
    assert "| no-spec | 500 | 2000 |" in lines
    assert "| DDTree / better chain | 1.30 | 1.50 |" in lines  # 520/400, 1800/1200
    assert "| DDTree / no-spec | 1.04 | 0.90 |" in lines
    assert "| DDTree verified tokens per forward (all steps) | 65 | 260 |" in lines


def test_engine_rounds_show_each_engines_tokens_per_second():
    row = dict(_cell("no-spec", 1, 500.0), output_tokens_per_s_engines=[480.4, 521.0])
    text = markdown_tables({"results": [row, _cell("dflash", 1, 300.0, 1.36),
                                        _cell("ddtree", 1, 520.0, 2.01)]},
                           "ddtree", ["dflash"])
    assert "| no-spec | 500 [480 / 521] |" in text.splitlines()


def test_verified_tokens_of_older_results_come_from_their_counters():
    """Results recorded before the all-steps field: recomputed from the counters, so
    a cell where drafting was mostly off shows the few tokens it really verified."""
    tree = _cell("ddtree-b64-d4", 4, 1300, tau=2.0)
    # 8 drafting request-steps of 64 nodes, 8 accepted, 256 output tokens in 1 run.
    tree.update(output_tokens=256, num_drafts=8, accepted_tokens_per_step=1.0,
                draft_tokens_per_step=64.0, verified_tokens_per_forward=260.0)
    doc = {"results": [_cell("no-spec", 4, 1400), _cell("dflash", 4, 1200, tau=1.4), tree]}
    lines = markdown_tables(doc, "ddtree-b64-d4", ["dflash"]).splitlines()
    assert "| DDTree verified tokens per forward (all steps) | 12 |" in lines  # 4*(1+512/248)


def test_unknown_config_is_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="eagle"):
        markdown_tables(DOC, "eagle", ["dflash"])
    path = tmp_path / "r.json"
    path.write_text(json.dumps(DOC))
    assert main([str(path), "--ddtree", "ddtree", "--chains", "nope"]) == 2
    assert "nope" in capsys.readouterr().err
    assert main([str(path), "--ddtree", "ddtree"]) == 0
    assert "| DDTree / chain |" in capsys.readouterr().out
