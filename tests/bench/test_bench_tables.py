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


def test_ratios_against_several_engines_show_their_range():
    base = dict(_cell("no-spec", 16, 7000.0), output_tokens_per_s_engines=[6800.0, 7400.0])
    tree = dict(_cell("ddtree", 16, 5200.0, 2.1), output_tokens_per_s_engines=[4900.0, 5500.0])
    lines = markdown_tables({"results": [base, tree, _cell("dflash", 16, 4300.0, 1.4)]},
                            "ddtree", ["dflash"]).splitlines()
    # 5200/7000; pairs 4900/7400 .. 5500/6800
    assert "| DDTree / no-spec | 0.74 [0.66-0.81] |" in lines
    assert "| DDTree / chain | 1.21 [1.14-1.28] |" in lines  # one chain engine, two trees


def test_results_of_one_tree_are_read_as_one(tmp_path, capsys):
    first = {"code_digest": "abc", "results": [_cell("no-spec", 4, 2000.0)]}
    second = {"code_digest": "abc", "results": [_cell("dflash", 4, 1200.0, 1.4),
                                                _cell("ddtree", 4, 1800.0, 2.0)]}
    paths = []
    for i, doc in enumerate((first, second)):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(doc))
    assert main([*map(str, paths), "--ddtree", "ddtree"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "| DDTree / no-spec | 0.90 |" in out and "| DDTree / chain | 1.50 |" in out


def test_results_from_different_or_unknown_hosts_get_a_note(tmp_path, capsys):
    """Files of one tree read as one: a note heads the tables when their hosts differ
    (CPU model, or the Python loop's time more than 10 % apart) or are not recorded;
    none when they agree."""
    host = {"cpu_model": "Xeon A", "usable_cpus": 16, "python_loop_ms": 20.0}
    first = {"code_digest": "abc", "host": host, "results": [_cell("no-spec", 4, 2000.0)]}
    second = {"code_digest": "abc", "host": dict(host, python_loop_ms=21.0),
              "results": [_cell("dflash", 4, 1200.0, 1.4), _cell("ddtree", 4, 1800.0, 2.0)]}

    def tables(*docs):
        paths = []
        for i, doc in enumerate(docs):
            paths.append(tmp_path / f"r{i}.json")
            paths[-1].write_text(json.dumps(doc))
        assert main([*map(str, paths), "--ddtree", "ddtree"]) == 0
        return capsys.readouterr().out

    assert "Note" not in tables(first, second)  # 5 % apart: one host
    out = tables(first, dict(second, host=dict(host, python_loop_ms=30.0)))
    assert out.startswith("> Note: these files ran on different hosts") and "loop 30.0 ms" in out
    assert "different hosts" in tables(first, dict(second, host=dict(host, cpu_model="Epyc B")))
    out = tables(first, {k: v for k, v in second.items() if k != "host"})
    assert "r1.json record no host" in out and "| DDTree / chain | 1.50 |" in out


def test_results_of_different_trees_or_twice_measured_cells_are_refused(tmp_path, capsys):
    docs = {"a": {"code_digest": "abc", "results": [_cell("no-spec", 4, 2000.0),
                                                    _cell("ddtree", 4, 1800.0, 2.0),
                                                    _cell("dflash", 4, 1200.0, 1.4)]},
            "b": {"code_digest": "def", "results": [_cell("no-spec", 16, 7000.0)]},
            "c": {"code_digest": "abc", "results": [_cell("no-spec", 4, 2100.0)]}}
    for name, doc in docs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    assert main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--ddtree", "ddtree"]) == 2
    assert "different code trees" in capsys.readouterr().err
    assert main([str(tmp_path / "a.json"), str(tmp_path / "c.json"), "--ddtree", "ddtree"]) == 2
    assert "no-spec at humaneval, T=0, batch 4 is in both" in capsys.readouterr().err


def test_main_reads_a_gzipped_result_as_the_plain_one(tmp_path, capsys):
    import gzip

    plain, packed = tmp_path / "r.json", tmp_path / "r.json.gz"
    plain.write_text(json.dumps(DOC))
    with gzip.open(packed, "wt") as f:
        json.dump(DOC, f)
    assert main([str(plain), "--ddtree", "ddtree"]) == 0
    from_plain = capsys.readouterr().out
    assert main([str(packed), "--ddtree", "ddtree"]) == 0
    assert capsys.readouterr().out == from_plain and "| no-spec | 500 | 2000 |" in from_plain


def test_steps_show_each_steady_cells_prefilling_steps():
    rows = [dict(_cell("no-spec", 64, 19073.0), prefill_step_ms_p50=32.8906, prefill_steps=9),
            dict(_cell("ddtree", 64, 5960.0, 1.59), prefill_step_ms_p50=23.4408,
                 prefill_steps=101),
            _cell("dflash", 64, 10550.0, 1.41)]  # a waves cell: nothing to add
    lines = markdown_tables({"results": rows}, "ddtree", ["dflash"], steps=True).splitlines()
    assert "| no-spec | 19073 / 32.9 x 9 |" in lines
    assert "| ddtree | 5960 (1.59) / 23.4 x 101 |" in lines
    assert "| dflash | 10550 (1.41) |" in lines
    plain = markdown_tables({"results": rows}, "ddtree", ["dflash"]).splitlines()
    assert "| no-spec | 19073 |" in plain
