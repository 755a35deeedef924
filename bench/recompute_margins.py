"""Near-tie margins, recomputed on the CPU, for equivalence differences that have none.

``bench/gpu_checks.py equiv-real --near-ties`` recomputes the first difference of every
speculative output from plain decoding's on the GPU (``near_tie_margins``); some result
files have none (the recomputation failed, or it asked only for the top logprobs and
one token lay outside them). This recomputes them from what the files keep: the prompt
(the fixture's prompt set, as ``gpu_checks`` built it), the common prefix (plain
decoding's tokens, ``reference_tokens``) and the two competing tokens. The target runs
in HF transformers in float32 on the CPU (not vLLM's kernels: its logits differ from
vLLM's float32 ones in their last bits, far below the 0.01 that separates a near tie
from a token plain decoding could not have chosen); at T > 0 the Gumbel noise is
vLLM's own, keyed by (seed, position), from ``tl.rand`` under Triton's interpreter (it
matched the GPU's noise, e.g. 0.8189549 for request 12 of the graphs run).

    PYTHONPATH=. python3 bench/recompute_margins.py --target SMOLLM2_HF --data FIXTURE_DATA \\
        --out bench/results/<dir>/margins-recomputed-cpu.json RESULT.json.gz [...]

``bench/equivalence.py --margins FILE`` counts these with the files' own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.result_files import read_json  # noqa: E402
from bench.gpu_checks import (NEAR_TIE_MAX_MARGIN, SAMPLING_MODES,  # noqa: E402
                              margin_not_recomputable, sampling_margin)
ENGINE = "transformers float32 on the CPU; vLLM's Gumbel noise through Triton's interpreter"


def gumbel_noise(seed: int, pos: int, tokens: list[int]) -> list[float]:
    """vLLM's Gumbel noise at (seed, position) for each of ``tokens``
    (``vllm/v1/worker/gpu/sample/gumbel.py``, fp32 path): u = tl.rand(tl.randint(seed,
    pos), token), clamped away from 0, then -log(-log1p(-u))."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _uniform_kernel(out_ptr, seeds_ptr, pos_ptr, tokens_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        gumbel_seed = tl.randint(tl.load(seeds_ptr), tl.load(pos_ptr))
        u = tl.rand(gumbel_seed, tl.load(tokens_ptr + i))
        tl.store(out_ptr + i, tl.maximum(u, 4.6566127342e-10))

    n = triton.next_power_of_2(max(len(tokens), 2))
    toks = torch.tensor(list(tokens) + [0] * (n - len(tokens)), dtype=torch.int32)
    out = torch.empty(n, dtype=torch.float32)
    _uniform_kernel[(1,)](out, torch.tensor([seed], dtype=torch.int64),
                          torch.tensor([pos], dtype=torch.int64), toks, N=n)
    u = out[: len(tokens)]
    return (-torch.log(-torch.log1p(-u))).tolist()


def _competing_tokens(diff: dict, context: int = 3) -> tuple[int | None, int | None]:
    """(output token, reference token) at the first difference; older files keep only
    the windows around it (``gpu_checks.differences``)."""
    if "output_token" in diff:
        return diff["output_token"], diff["reference_token"]
    k = diff["token"] - max(0, diff["token"] - context)
    out, ref = diff.get("output") or [], diff.get("reference") or []
    return (out[k] if k < len(out) else None), (ref[k] if k < len(ref) else None)


def _reference(doc: dict, run: dict, request: int) -> list[int] | None:
    """Plain decoding's tokens of ``request``: the run's own, else those of a run of the
    same file with the same sampling mode and batch (one reference per mode and batch)."""
    for r in [run] + doc["runs"]:
        refs = r.get("reference_tokens")
        if refs and r.get("sampling") == run.get("sampling") and r.get("batch") == run.get("batch"):
            got = refs.get(str(request), refs.get(request) if isinstance(refs, dict) else None)
            if got is not None:
                return got
    return None


def _has_margin(doc: dict, run: dict, diff: dict) -> bool:
    return any(t["config"] == run["config"] and t["batch"] == run.get("batch")
               and t["sampling"] == run.get("sampling") and t["request"] == diff["request"]
               and t["token"] == diff["token"] and t.get("margin") is not None
               for t in doc.get("near_ties") or [])


def missing(doc: dict) -> list[tuple[dict, dict]]:
    """(run, difference) of every speculative (DDTree) run's first difference from plain
    decoding that the file gives no margin for."""
    return [(run, diff) for run in doc.get("runs", [])
            if str(run.get("config", "")).startswith("ddtree")
            for diff in run.get("differences") or [] if not _has_margin(doc, run, diff)]


class Recomputer:
    def __init__(self, target: str, data: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.target, self.data = target, data
        self.tok = AutoTokenizer.from_pretrained(target)
        self.model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        self._prompts: dict[str, list[list[int]]] = {}

    def prompts(self, prompt_set: str, n: int) -> list[list[int]]:
        from bench.run import load_prompt_sets

        have = self._prompts.get(prompt_set, [])
        if len(have) < n:
            have = load_prompt_sets([prompt_set], self.data, self.tok, n)[prompt_set]
            self._prompts[prompt_set] = have
        return have

    def logprobs(self, ids: list[int]):
        with self.torch.no_grad():
            logits = self.model(self.torch.tensor([ids])).logits[0, -1]
        return self.torch.log_softmax(logits.double(), -1)

    def margin(self, doc: dict, run: dict, diff: dict) -> dict:
        mode, i, d = run.get("sampling", "greedy"), diff["request"], diff["token"]
        entry = dict(config=run["config"], batch=run.get("batch"), sampling=mode, request=i,
                     token=d, engine=ENGINE)
        out_token, ref_token = _competing_tokens(diff)
        entry.update(reference_token=ref_token, output_token=out_token)
        if out_token is None or ref_token is None:
            return dict(entry, margin=None, note="a length difference: no competing token")
        reason = margin_not_recomputable(mode, i, d)
        if reason:
            return dict(entry, margin=None, note=reason)
        ref = _reference(doc, run, i)
        if ref is None:
            return dict(entry, margin=None, note="the file keeps no reference tokens")
        lo = max(0, d - 3)
        if "reference" in diff and ref[lo:d + 4] != diff["reference"]:
            return dict(entry, margin=None, note="the reference tokens do not match the difference")
        prompt = self.prompts(doc["prompt_set"], i + 1)[i]
        lp = self.logprobs(prompt + ref[:d])
        gap = float(lp[ref_token] - lp[out_token])
        if SAMPLING_MODES[mode]["temperature"] == 0:
            entry.update(recomputed_token=int(lp.argmax()))
        return dict(entry, **sampling_margin(mode, i, len(prompt) + d - 1, gap, ref_token,
                                             out_token, gumbel_noise))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="+", help="gpu_checks equiv-real result files")
    ap.add_argument("--target", required=True, help="the target as an HF folder")
    ap.add_argument("--data", required=True, help="the fixture's prompt sets")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    rc = Recomputer(a.target, a.data)
    found = []
    for path in a.results:
        doc = read_json(path)
        for run, diff in missing(doc):
            entry = dict(rc.margin(doc, run, diff), result_file=os.path.basename(path))
            found.append(entry)
            print(json.dumps(entry), flush=True)
    with open(a.out, "w") as f:
        json.dump({"command": "python3 bench/recompute_margins.py " + " ".join(
            os.path.relpath(p) for p in a.results) + " --target TARGET --data DATA --out <this file>",
            "engine": ENGINE, "near_tie_max": NEAR_TIE_MAX_MARGIN, "margins": found}, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
