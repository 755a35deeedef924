"""bench/recompute_margins.py: near-tie margins recomputed on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from bench import recompute_margins as M  # noqa: E402


def test_the_competing_tokens_come_from_the_windows_of_older_files():
    assert M._competing_tokens({"token": 47, "output_token": 1, "reference_token": 2}) == (1, 2)
    # gpu_checks.differences keeps tokens d-3 .. d+3 around the first difference d.
    diff = {"token": 10, "output": [7, 8, 9, 100, 5], "reference": [7, 8, 9, 200, 6]}
    assert M._competing_tokens(diff) == (100, 200)
    assert M._competing_tokens({"token": 1, "output": [3, 4], "reference": [3, 5]}) == (4, 5)
    assert M._competing_tokens({"token": 0, "output": [], "reference": [9]}) == (None, 9)


def test_missing_skips_what_the_file_has_a_margin_for_and_the_chain():
    doc = {"runs": [
        {"config": "ddtree-async", "batch": 16, "sampling": "seeded",
         "differences": [{"request": 4, "token": 96}, {"request": 6, "token": 98}]},
        {"config": "dflash", "batch": 16, "sampling": "seeded",
         "differences": [{"request": 1, "token": 3}]}],
        "near_ties": [{"config": "ddtree-async", "batch": 16, "sampling": "seeded",
                       "request": 4, "token": 96, "margin": 0.0004},
                      {"config": "ddtree-async", "batch": 16, "sampling": "seeded",
                       "request": 6, "token": 98, "margin": None}]}
    assert [(r["config"], d["request"]) for r, d in M.missing(doc)] == [("ddtree-async", 6)]


def test_the_gumbel_noise_is_the_one_the_gpu_drew():
    """vLLM's noise at (seed 1012, position 143) for two tokens, as the GPU's sampling
    kernel gave it in bench/results/2026-12-01-lossless-seeded-fp32 (near_ties of
    equiv-smollm2-fp32-graphs.json.gz), through Triton's interpreter here."""
    pytest.importorskip("triton")
    code = ("import json, sys; sys.path.insert(0, '.'); from bench.recompute_margins import "
            "gumbel_noise; print(json.dumps(gumbel_noise(1012, 143, [5587, 4421])))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, TRITON_INTERPRET="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    g_ref, g_out = json.loads(r.stdout.strip().splitlines()[-1])
    assert g_ref == pytest.approx(0.8189549446105957, abs=1e-6)
    assert g_out == pytest.approx(0.044564731419086456, abs=1e-6)


@pytest.mark.slow
def test_a_greedy_margin_on_a_tiny_target(tmp_path):
    """Prompt i of the set, plain decoding's prefix, the two tokens: the margin is the
    two tokens' logprob gap there, and a reference window that does not match is
    refused instead of scored."""
    torch = pytest.importorskip("torch")
    from tests.fixture.test_fixture import _write_prompts, make_tiny_target
    tgt, data = str(tmp_path / "tgt"), str(tmp_path / "data")
    make_tiny_target(tgt)
    _write_prompts(data)
    rc = M.Recomputer(tgt, data)
    prompt = rc.prompts("sharegpt", 3)[2]
    ref = [40, 41, 42, 43, 44, 45]
    doc = {"prompt_set": "sharegpt", "runs": [
        {"config": "ddtree-async", "batch": 16, "sampling": "greedy",
         "reference_tokens": {"2": ref},
         "differences": [{"request": 2, "token": 4, "output_token": 50, "reference_token": 44,
                          "reference": ref[1:]}]}]}
    (run, diff), = M.missing(doc)
    got = rc.margin(doc, run, diff)
    with torch.no_grad():
        lp = torch.log_softmax(rc.model(torch.tensor([prompt + ref[:4]])).logits[0, -1].double(), -1)
    assert got["margin"] == pytest.approx(float(lp[44] - lp[50]))
    assert got["recomputed_token"] == int(lp.argmax())
    assert got["near_tie"] == (abs(got["margin"]) <= 0.01)
    diff["reference"] = [0, 0, 0, 0, 0]
    assert rc.margin(doc, run, diff)["note"] == "the reference tokens do not match the difference"


def test_the_sampling_margin_adds_the_noise_at_the_requests_key():
    """gpu_checks.sampling_margin, the one definition both recomputations use: the
    logprob gap at T=0; gap / T plus the noise difference at (the request's seed, pos)
    at T > 0; a near tie within NEAR_TIE_MAX_MARGIN."""
    from bench.gpu_checks import NEAR_TIE_MAX_MARGIN, SAMPLING_MODES, request_seed, sampling_margin
    keys = []

    def noise(seed, pos, tokens):
        keys.append((seed, pos, tokens))
        return [0.30, 0.10]

    greedy = sampling_margin("greedy", 3, 50, -0.004, 7, 9, noise)
    assert greedy == {"logprob_gap": -0.004, "margin": -0.004, "near_tie": True} and not keys
    t = SAMPLING_MODES["seeded-topk-topp"]["temperature"]
    m = sampling_margin("seeded-topk-topp", 3, 50, -0.2, 7, 9, noise)
    assert keys == [(request_seed("seeded-topk-topp", 3), 50, [7, 9])]
    assert m["margin"] == pytest.approx(-0.2 / t + 0.2)
    assert (m["noise_reference"], m["noise_output"]) == (0.30, 0.10)
    assert m["near_tie"] == (abs(m["margin"]) <= NEAR_TIE_MAX_MARGIN)
    assert not sampling_margin("seeded", 3, 50, 0.5, 7, 9, noise)["near_tie"]


def test_a_min_tokens_difference_is_recomputable_from_min_tokens_on():
    """Before min_tokens the run masked stop tokens, which a recomputation from the
    prompt and prefix alone does not know; from there on the position is sampled as
    without the setting, so its margin is the seeded one."""
    from bench.gpu_checks import SAMPLING_MODES, margin_not_recomputable

    n = SAMPLING_MODES["seeded-min-tokens"]["min_tokens"]
    assert "before min_tokens" in margin_not_recomputable("seeded-min-tokens", 4, n - 1)
    assert margin_not_recomputable("seeded-min-tokens", 4, n) is None
    assert margin_not_recomputable("seeded", 4, 0) is None
    assert margin_not_recomputable("seeded-features", 1, 50) is not None
