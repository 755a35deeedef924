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
        row["verified_tokens_per_forward"] = verified
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
    assert "| DDTree verified tokens per forward | 65 | 260 |" in lines


def test_unknown_config_is_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="eagle"):
        markdown_tables(DOC, "eagle", ["dflash"])
    path = tmp_path / "r.json"
    path.write_text(json.dumps(DOC))
    assert main([str(path), "--ddtree", "ddtree", "--chains", "nope"]) == 2
    assert "nope" in capsys.readouterr().err
    assert main([str(path), "--ddtree", "ddtree"]) == 0
    assert "| DDTree / chain |" in capsys.readouterr().out
