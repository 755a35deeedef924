"""The equivalence checks' bookkeeping on the CPU: how a difference is described, the
case rows of bench/results/equivalence.json and their gathering (bench/equivalence.py)."""

import gzip
import json

import pytest

from bench import equivalence
from bench.gpu_checks import SAMPLING_MODES, differences, equivalence_case


def test_differences_name_the_first_differing_token_and_a_dropped_token():
    ref = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [7, 8]]
    out = [[1, 2, 3, 4, 5, 6], [1, 2, 4, 5, 9, 9], [7, 9]]
    found = differences(out, ref)
    assert [(d["request"], d["token"]) for d in found] == [(1, 2), (2, 1)]
    assert found[0]["dropped_one"] and not found[0]["repeated_one"]
    assert not found[1]["dropped_one"]
    assert found[0]["output"] == [1, 2, 4, 5, 9, 9] and found[0]["reference"] == ref[1]
    assert (found[0]["output_token"], found[0]["reference_token"]) == (4, 3)


def test_a_repeated_token_is_named_too():
    found = differences([[1, 2, 2, 3, 4]], [[1, 2, 3, 4, 5]])
    assert found[0]["token"] == 2 and found[0]["repeated_one"]


def _result(**kw):
    return dict(target_name="smollm2-135m", vllm_version="0.26.0", dtype="float32", eager=True,
                prompt_set="sharegpt", max_tokens=128, batch_invariant=False, git_rev="abc",
                **kw)


def test_cases_carry_the_issue_fields():
    entry = dict(config="ddtree-preempt", batch=16, identical_outputs=15, num_outputs=16)
    case = equivalence_case(_result(), entry, "seeded-topk-topp")
    assert case["scenario"] == "preempt" and case["method"] == "ddtree"
    assert (case["identical"], case["total"], case["graphs"], case["seeded"]) == (15, 16, False, True)
    assert case["temperature"] == SAMPLING_MODES["seeded-topk-topp"]["temperature"]
    assert case["top_k"] == 40 and case["top_p"] == 0.9
    chain = equivalence_case(_result(), dict(config="dflash-chain-aborts", batch=16,
                                              identical_outputs=3, num_outputs=11), "greedy")
    assert chain["method"] == "dflash" and chain["scenario"] == "aborts"
    # Errors and the engine's own batch-shape control are not cases.
    assert equivalence_case(_result(), dict(config="ddtree-async", error="x"), "greedy") is None
    assert equivalence_case(_result(), dict(config="no-spec-batch-shape", batch=16,
                                            identical_outputs=16, num_outputs=16), "greedy") is None


def _write(path, cases, complete=True):
    with gzip.open(path, "wt") as f:
        json.dump(dict(complete=complete, cases=cases), f)


def test_gather_keeps_the_newest_case_per_key_and_names_its_file(tmp_path):
    base = equivalence_case(_result(), dict(config="ddtree-async", batch=16, identical_outputs=15,
                                            num_outputs=16), "seeded")
    newer = dict(base, identical=16)
    other = dict(base, batch=1, identical=1, total=1)
    _write(tmp_path / "a.json.gz", [base, other])
    _write(tmp_path / "b.json.gz", [newer])
    table = equivalence.gather([str(tmp_path / "a.json.gz"), str(tmp_path / "b.json.gz")])
    assert table["summary"]["cases"] == 2 and table["summary"]["all_identical_ddtree"]
    assert (table["summary"]["ddtree_identical"], table["summary"]["ddtree_total"]) == (17, 17)
    by_batch = {c["batch"]: c for c in table["cases"]}
    assert by_batch[16]["result_file"] == "b.json.gz" and by_batch[1]["result_file"] == "a.json.gz"
    # The file: one line per case (a case's change is one line of a diff).
    out = tmp_path / "equivalence.json"
    assert equivalence.main([str(tmp_path / "a.json.gz"), str(tmp_path / "b.json.gz"),
                             "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert json.loads(out.read_text()) == table
    assert sum(line.startswith('  {"target"') for line in lines) == 2 and len(lines) == 8


def test_gather_refuses_an_incomplete_run(tmp_path):
    _write(tmp_path / "a.json.gz", [], complete=False)
    with pytest.raises(SystemExit, match="did not complete"):
        equivalence.gather([str(tmp_path / "a.json.gz")])


def test_the_features_mode_mixes_requests_without_drafts_with_tree_requests():
    """bench/gpu_checks.py --sampling seeded-features: request i gets FEATURE_CYCLE's
    entry i (penalties, bad words, a JSON grammar) on top of seeded T=1; the
    requests without a feature stay on trees."""
    pytest.importorskip("vllm")
    from bench.gpu_checks import FEATURE_CYCLE, sampling_params
    from vllm_ddtree.config import decode_without_drafts

    sps = sampling_params("seeded-features", 2 * len(FEATURE_CYCLE), 32)
    assert [decode_without_drafts(p) for p in sps] == [bool(f) for f in FEATURE_CYCLE] * 2
    assert all(p.temperature == 1.0 and p.seed == 1000 + i for i, p in enumerate(sps))
    grammar = sps[4]
    assert grammar.structured_outputs.json["required"] == ["answer"]
    assert not grammar.ignore_eos and sps[1].ignore_eos
    assert all(decode_without_drafts(p) is False for p in sampling_params("seeded", 3, 8))


def test_logprob_differences_are_read_over_identical_prefixes():
    from bench.gpu_checks import Generated, emitted_logprobs, max_logprob_difference
    import types

    ref, out = Generated([[1, 2, 3], [4, 5]]), Generated([[1, 2, 9], [4, 5]])
    ref.logprobs = [[-0.1, -0.2, -0.3], [-1.0, -2.0]]
    out.logprobs = [[-0.1, -0.25, -5.0], [-1.0, -2.001]]
    # Request 0 diverges at position 2: that token's logprob is not compared.
    assert max_logprob_difference(out, ref) == pytest.approx(0.05)
    assert max_logprob_difference(Generated([[1]]), ref) is None
    step = {7: types.SimpleNamespace(logprob=-0.5), 8: types.SimpleNamespace(logprob=-3.0)}
    output = types.SimpleNamespace(token_ids=[7, 8], logprobs=[step, step])
    assert emitted_logprobs(output) == [-0.5, -3.0]
    assert emitted_logprobs(types.SimpleNamespace(token_ids=[7], logprobs=None)) is None


def test_recomputed_margins_count_each_difference_once(tmp_path):
    """--margins: near ties recomputed for a file (bench/recompute_margins.py) join the
    file's own; a difference both name counts once, and a margin of another file or
    case, or one that is no near tie, counts nothing."""
    case = equivalence_case(_result(), dict(config="ddtree-sync", batch=16, identical_outputs=13,
                                            num_outputs=16), "seeded")
    path = tmp_path / "equiv.json.gz"
    tie = dict(config="ddtree-sync", batch=16, sampling="seeded", near_tie=True)
    with gzip.open(path, "wt") as f:
        json.dump(dict(complete=True, cases=[case], near_ties=[dict(tie, request=4, token=96)]), f)
    margins = tmp_path / "margins.json"
    margins.write_text(json.dumps({"margins": [
        dict(tie, request=4, token=96, result_file="equiv.json.gz"),      # the file's own
        dict(tie, request=6, token=98, result_file="equiv.json.gz"),      # a new one
        dict(tie, request=7, token=9, near_tie=False, margin=0.5, result_file="equiv.json.gz"),
        dict(tie, request=8, token=1, result_file="other.json.gz"),
        dict(tie, request=9, token=1, sampling="greedy", result_file="equiv.json.gz")]}))
    (row,) = equivalence.gather([str(path)])["cases"]
    assert row["differing_near_ties"] == 1
    table = equivalence.gather([str(path)], margins=[str(margins)])
    assert table["cases"][0]["differing_near_ties"] == 2
    assert table["summary"]["ddtree_differing_near_ties"] == 2
    assert "--margins" in table["command"]
