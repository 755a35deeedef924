"""bench/step_trace.py: a wave's full-batch and tail phases from the controller's step
trace (no GPU, no vLLM)."""

from __future__ import annotations

import gzip
import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from bench import step_trace as T  # noqa: E402


def _step(batch, budget=0, accepted=None, ms=2.0, prefill=0):
    sampled = batch if budget and not prefill else 0
    return [batch, budget, budget, sampled, accepted if sampled else None, ms, prefill]


def _wave(n, full_steps, tail, budget=4, accepted=1.0):
    """A wave of ``n`` requests: two prefilling steps, ``full_steps`` decode steps at
    batch ``n`` drafting at ``budget``, then one budget-0 step per batch in ``tail``."""
    return ([_step(n // 2, prefill=100), _step(n, prefill=100)]
            + [_step(n, budget, accepted, ms=3.0) for _ in range(full_steps)]
            + [_step(b, 0, ms=1.5) for b in tail])


def _doc(steps, config="ddtree-b64-t512"):
    return {"engines": [
        {"config": "no-spec", "round": 0},
        {"config": config, "round": 0, "online_budget": {"recent_steps": {
            "fields": list(T.FIELDS), "steps": steps}}}]}


def test_waves_are_split_at_prefills_and_phased_at_the_first_finished_request():
    steps = _wave(16, 10, [12, 5, 1]) + _wave(16, 8, [3])
    summary = T.summarize(_doc(steps))
    assert [e["config"] for e in summary] == ["ddtree-b64-t512"]  # plain keeps no trace
    waves = summary[0]["waves"]
    assert len(waves) == 2
    first, second = waves
    assert first["requests"] == 16 and first["prefill_steps"] == 2 and not first["cut"]
    assert first["full"]["steps"] == 10 and first["full"]["budgets"] == {"4": 10}
    assert first["full"]["ms"] == 30.0
    # 16 requests a step, each with one accepted draft: 32 tokens in 3 ms.
    assert first["full"]["tokens"] == 320.0
    assert first["full"]["tokens_per_ms"] == pytest.approx(32 / 3, abs=1e-3)
    assert first["full"]["step_ms_p50"] == {"0": None, "drafting": 3.0}
    assert first["tail"]["steps"] == 3 and first["tail"]["tokens"] == 18.0
    assert first["tail"]["budgets"] == {"0": 3} and first["tail"]["ms"] == 4.5
    assert second["full"]["steps"] == 8 and second["tail"]["steps"] == 1


def test_a_trace_that_starts_inside_a_wave_marks_it_cut():
    steps = _wave(8, 6, [4, 2])[5:] + _wave(8, 6, [4])
    waves = T.summarize(_doc(steps))[0]["waves"]
    assert waves[0]["cut"] and not waves[1]["cut"]
    assert waves[0]["full"]["steps"] == 3


def test_a_wave_start_gives_its_prefill_steps_and_first_full_batch_steps(tmp_path, capsys):
    # The first prefilling step untimed (the engine idled before it), the second timed;
    # then slow full-batch steps before the wave settles at 3 ms.
    steps = ([_step(3, prefill=61, ms=T.UNTIMED_MS), _step(64, prefill=1424, ms=5.7)]
             + [_step(64, 0, ms=ms) for ms in (7.0, 6.1, 6.2, 5.6)]
             + [_step(64, 0, ms=3.0) for _ in range(5)] + [_step(64, 4, 0.5, ms=9.0)]
             + [_step(10, 0, ms=1.5)])
    start = T.summarize(_doc(steps))[0]["waves"][0]["start"]
    assert start["prefill_ms"] == [None, 5.7]
    assert start["prefill_tokens"] == [61, 1424]
    assert start["first_full_ms"] == [7.0, 6.1, 6.2, 5.6]
    # The later full-batch budget-0 steps only: not the first four, not the drafting step.
    assert start["full_budget_0_ms_p50"] == 3.0
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(_doc(steps)))
    assert T.main([str(path)]) == 0
    out = capsys.readouterr().out
    row = "| ddtree-b64-t512 r0 | 0 | 61 / untimed, 1424 / 5.7 | [7.0, 6.1, 6.2, 5.6] | 3.0 |"
    assert row in out


def test_the_untimed_step_value_is_the_controllers():
    from vllm_ddtree.online_budget import UNTIMED_STEP_MS

    assert T.UNTIMED_MS == UNTIMED_STEP_MS


def test_the_table_and_the_command_line(tmp_path, capsys):
    path = tmp_path / "bench.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_doc(_wave(4, 5, [2, 1])), f)
    assert T.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "| ddtree-b64-t512 r0 | 0 | 4 | 5 / 15.0 /" in out
    assert T.main([str(path), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["engines"][0]["waves"][0]["tail"]["steps"] == 2
    assert printed["switches"] == []


def test_the_switches_the_report_kept_are_listed_in_order(tmp_path, capsys):
    doc = _doc(_wave(4, 5, [2, 1]))
    entry = {"bucket_step": 3, "margin_scale": 1.0, "mean_batch": 4.0,
             "accepted": [0.0, 1.2], "step_ms": [2.0, 3.0],
             "tokens_per_s": [2000.0, 2933.0], "compared": [2000.0, 2666.4]}
    doc["engines"][1]["online_budget"]["recent_switches"] = {
        "sampled": {"4-7": [dict(entry, step=90, **{"from": 4, "to": 0})]},
        "greedy": {"1-1": [dict(entry, step=12, **{"from": 0, "to": 4})]}}
    listed = T.switches(doc)
    assert [(e["class"], e["bucket"], e["step"]) for e in listed] == [
        ("greedy", "1-1", 12), ("sampled", "4-7", 90)]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(doc))
    assert T.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "ddtree-b64-t512 r0 greedy 1-1: step 12, budget 0 -> 4" in out
    assert out.index("greedy 1-1") < out.index("sampled 4-7")


def test_a_file_without_a_trace_is_an_error(tmp_path, capsys):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"engines": [{"config": "no-spec"}]}))
    assert T.main([str(path)]) == 1
    assert "no engine kept a step trace" in capsys.readouterr().err


def test_a_trace_without_the_fields_it_needs_is_refused():
    doc = _doc([[1, 0]])
    doc["engines"][1]["online_budget"]["recent_steps"]["fields"] = ["batch", "budget"]
    with pytest.raises(ValueError, match="lacks"):
        T.summarize(doc)
