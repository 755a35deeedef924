"""GPU gate: DDTree == decoding without speculation on the benchmark pair, greedy and
seeded at T > 0.

Runs ``bench/gpu_checks.py equiv-real`` (float32, eager: async and sync scheduling, the
batch-size budget schedule, requests aborted mid-way, KV pressure with preemption, and
the DFlash chain as a control) and fails on any differing output. Needs an NVIDIA GPU,
the patched vLLM, and the SmolLM2 target + prompt sets from
``bench/fixture/prepare.sh`` (DDTREE_BENCH_TARGET, DDTREE_BENCH_DATA); skipped elsewhere.
Results of the run on the H200: bench/results/gpu-equiv-real-fp32-eager.json.
"""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGET = os.environ.get("DDTREE_BENCH_TARGET", "/opt/smollm2-hf")
DATA = os.environ.get("DDTREE_BENCH_DATA", "/opt/smollm2-fixture/data")


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def is_control(run: dict) -> bool:
    """The DFlash chain at T > 0: vLLM's probabilistic rejection sampler keeps the
    target's distribution but not its seeded tokens, so it is reported, not gated."""
    return str(run.get("config", "")).startswith("dflash") and run.get("sampling",
                                                                        "greedy") != "greedy"


def near_ties(result: dict) -> set[tuple]:
    """(config, batch, sampling, request) of the first differences that are near ties:
    the margin between the two tokens within float32 rounding of the logits, or plain
    decoding itself choosing the speculative run's token when it computes that position
    in another batch shape (bench/gpu_checks.py near_tie_margins). Plain decoding is
    not reproducible there either: vLLM's own engine gives either token."""
    return {(t["config"], t["batch"], t["sampling"], t["request"])
            for t in result.get("near_ties", [])
            if t.get("near_tie") or t.get("recomputed_token") == t.get("output_token")}


def equivalence_failures(result: dict) -> list[str]:
    """Runs of an equiv-real result whose outputs differ (or that errored), except
    differences that are near ties (:func:`near_ties`)."""
    bad = []
    ties = near_ties(result)
    for run in result.get("runs", []):
        if is_control(run) and "error" not in run:
            continue
        sampling = run.get("sampling", "greedy")
        name = f"{run.get('config')} batch {run.get('batch')} {sampling}"
        diffs = run.get("differences")
        unexplained = None if diffs is None else [
            d for d in diffs if (run.get("config"), run.get("batch"), sampling, d["request"])
            not in ties]
        if "error" in run:
            bad.append(f"{name}: {run['error'][:300]}")
        elif unexplained is not None and run.get("identical_outputs") != run.get("num_outputs"):
            if unexplained:
                bad.append(f"{name}: {run.get('identical_outputs')}/{run.get('num_outputs')} "
                           f"identical, not near ties: {unexplained[:3]}")
        elif run.get("identical_outputs") != run.get("num_outputs"):
            bad.append(f"{name}: {run.get('identical_outputs')}/{run.get('num_outputs')} identical, "
                       f"first difference {run.get('first_difference_at')}")
        elif "aborted_outputs_are_prefixes" in run and run["aborted_outputs_are_prefixes"] != run["aborted"]:
            bad.append(f"{name}: aborted outputs are not prefixes of the reference")
    if not result.get("runs"):
        bad.append("no runs")
    return bad


def test_equivalence_failures_reads_results():
    ok = {"runs": [{"config": "a", "batch": 1, "identical_outputs": 1, "num_outputs": 1},
                   {"config": "a-aborts", "batch": 4, "identical_outputs": 3, "num_outputs": 3,
                    "aborted": 1, "aborted_outputs_are_prefixes": 1}]}
    assert equivalence_failures(ok) == []
    bad = {"runs": [{"config": "a", "batch": 16, "identical_outputs": 15, "num_outputs": 16,
                     "first_difference_at": {"request": 3, "token": 9}},
                    {"config": "b", "error": "RuntimeError('x')"}]}
    assert len(equivalence_failures(bad)) == 2
    assert equivalence_failures({"runs": []}) == ["no runs"]
    # The chain's seeded runs are a control; DDTree's are gated.
    seeded = {"runs": [{"config": "dflash-chain", "batch": 16, "sampling": "seeded",
                        "identical_outputs": 3, "num_outputs": 16},
                       {"config": "ddtree-async", "batch": 16, "sampling": "seeded",
                        "identical_outputs": 15, "num_outputs": 16}]}
    assert [f.split(":")[0] for f in equivalence_failures(seeded)] == [
        "ddtree-async batch 16 seeded"]
    # A first difference at a near tie is no failure; one with a clear margin is.
    diff = {"request": 4, "token": 96}
    tied = {"runs": [{"config": "ddtree-async", "batch": 16, "sampling": "seeded",
                      "identical_outputs": 15, "num_outputs": 16, "differences": [diff]}],
            "near_ties": [{"config": "ddtree-async", "batch": 16, "sampling": "seeded",
                           "request": 4, "token": 96, "margin": 0.003, "near_tie": True,
                           "recomputed_token": 7, "output_token": 8}]}
    assert equivalence_failures(tied) == []
    tied["near_ties"][0].update(margin=2.0, near_tie=False)
    assert len(equivalence_failures(tied)) == 1
    tied["near_ties"][0].update(recomputed_token=8)  # plain decoding picks it too
    assert equivalence_failures(tied) == []


@pytest.mark.gpu
@pytest.mark.timeout(900)
@pytest.mark.skipif(not _cuda(), reason="needs an NVIDIA GPU")
@pytest.mark.skipif(not (os.path.isdir(TARGET) and os.path.isdir(DATA)),
                    reason="set DDTREE_BENCH_TARGET/DDTREE_BENCH_DATA (bench/fixture/prepare.sh)")
def test_ddtree_equals_decoding_without_speculation_greedy_and_seeded(tmp_path):
    """Greedy and seeded T > 0 (T=1; T=0.8 with top-k and top-p), per-request seeds."""
    out = tmp_path / "equiv.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "gpu_checks.py"), "equiv-real",
         "--target", TARGET, "--drafter", os.path.join(REPO, "bench", "fixture", "smollm2-dflash"),
         "--data", DATA, "--out", str(out), "--dtype", "float32", "--num-prompts", "16",
         "--max-tokens", "64", "--budgets", "32", "--batch-sizes", "1", "16",
         "--sampling", "greedy", "seeded", "seeded-topk-topp", "--near-ties"],
        cwd=REPO, capture_output=True, text=True, timeout=840,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    failures = equivalence_failures(json.loads(out.read_text()))
    assert not failures, failures


def _num_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


@pytest.mark.gpu
@pytest.mark.timeout(900)
@pytest.mark.skipif(_num_gpus() < 2, reason="needs two NVIDIA GPUs")
def test_greedy_ddtree_with_tensor_parallelism_2(tmp_path):
    """TP=2 on the tiny random Qwen3 pair (SmolLM2's 9 heads do not split over 2 ranks):
    DDTree and the chain equal TP=2 without speculation, eager and with CUDA graphs.
    Ranks that built different trees would diverge or hang. On two H200s:
    eager identical (bench/results/gpu-equiv-tiny-tp2.log.gz)."""
    out = tmp_path / "equiv-tp2.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "gpu_checks.py"), "equiv", "--out", str(out),
         "--dtype", "float32", "--num-prompts", "16", "--max-tokens", "64", "--budgets", "32",
         "--batch-sizes", "1", "16", "--eager-modes", "eager", "graphs"],
        cwd=REPO, capture_output=True, text=True, timeout=840,
        env=dict(os.environ, DDTREE_CHECK_TP="2"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    failures = equivalence_failures(result)
    assert not failures, failures
    assert {r["config"] for r in result["runs"]} >= {"no-spec", "dflash-15", "ddtree-32"}
