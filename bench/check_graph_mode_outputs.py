"""Does a CUDA-graph mode give the greedy tokens eager execution gives? (GPU host)

A steady benchmark found plain decoding with ``cudagraph_mode=FULL`` on FLASH_ATTN (the
benchmarks' ``no-spec+cgfull+cg1024``) differing from vLLM's default graphs from the
first token in 16 of 16 requests at batch 4, and the DFlash chain in that mode
accepting almost nothing (tau 1.004): prefills replayed in whole-forward graphs
(``bench/results/2026-11-30-flash-attn-full-graphs-pristine-check/bench-steady-b4-default-graph-reference.json.gz``).
This asks the question without speculation and without the series' DDTree paths:
each mode runs in its own process (two FULL engines cannot share one, see
docs/operations.md) on the same prompts, submitted together so that their prefills
share steps, and every mode's tokens are compared with the first mode's.

    python bench/check_graph_mode_outputs.py --model /opt/smollm2-hf \\
        --modes eager full default --out $OUT/graph-mode-outputs.json

Modes: ``eager`` (enforce_eager), ``default`` (vLLM's FULL_AND_PIECEWISE),
``full`` (FULL, graphs up to 1024 tokens), ``full-decode`` (FULL_DECODE_ONLY), and
``full-maxq``: ``full`` with the V2 runner capturing its graphs with ``max_query_len``
set to the graph's token count, as the V1 runner does (the suspected cause, read in the sources;
engine in this process so the change reaches it; run it with the series reverted,
``GRAPHMODES_PRISTINE=1``, since patch 10 turns FULL on FlashAttention into
FULL_AND_PIECEWISE). The JSON also records whether the series was applied
(``vllm.ddtree_series``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.run import first_difference  # noqa: E402

MODES = {
    "eager": {"enforce_eager": True},
    "default": {},
    "full": {"compilation_config": {"cudagraph_mode": "FULL",
                                    "max_cudagraph_capture_size": 1024}},
    "full-decode": {"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}},
}
MODES["full-maxq"] = MODES["full"]


def capture_max_query_len_as_token_count(default_state=None) -> None:
    """Make vLLM's V2 runner capture CUDA graphs with ``max_query_len`` = the graph's
    token count (the V1 runner's choice) instead of the dummy batch's equal query
    length: it wraps ``build_attn_metadata`` as
    ``vllm/v1/worker/gpu/model_states/default.py`` calls it (keyword arguments)."""
    if default_state is None:
        import vllm.v1.worker.gpu.model_states.default as default_state
    original = default_state.build_attn_metadata

    def build_attn_metadata(**kwargs):
        if kwargs.get("for_cudagraph_capture"):
            kwargs["max_query_len"] = kwargs["num_tokens"]
        return original(**kwargs)

    default_state.build_attn_metadata = build_attn_metadata


def prompts(num: int, seed: int = 0, lengths: tuple[int, int] = (100, 200)) -> list[list[int]]:
    """Token-id prompts of ``lengths`` tokens (end exclusive; ids 100-30000: inside
    SmolLM2's and Qwen's vocabularies)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 30000) for _ in range(rng.randrange(*lengths))]
            for _ in range(num)]


def compare(reference: list[list[int]], outputs: list[list[int]]) -> dict:
    firsts = [first_difference(r, o) for r, o in zip(reference, outputs)]
    return {"identical": sum(f is None for f in firsts), "total": len(reference),
            "first_difference_per_request": firsts,
            "differ_at_first_token": sum(f == 0 for f in firsts)}


def run_one(args) -> dict:
    if args.one == "full-maxq":
        # The change must reach the worker: keep the engine core in this process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        capture_max_query_len_as_token_count()
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, seed=0, max_model_len=2048,
              max_num_seqs=args.num_prompts, gpu_memory_utilization=0.2,
              **MODES[args.one])
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts(args.num_prompts)],
                        params, use_tqdm=False)
    import vllm

    return {"mode": args.one, "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "ddtree_series": getattr(vllm, "ddtree_series", None)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--modes", nargs="+", default=["eager", "full", "default"],
                    choices=sorted(MODES))
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--timeout-s", type=float, default=240.0, help="per mode")
    ap.add_argument("--out")
    ap.add_argument("--one", choices=sorted(MODES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return
    if not args.out:
        ap.error("--out is required")
    runs = []
    for mode in args.modes:
        cmd = [sys.executable, os.path.abspath(__file__), "--one", mode, "--model",
               args.model, "--num-prompts", str(args.num_prompts), "--max-tokens",
               str(args.max_tokens), "--dtype", args.dtype]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            runs.append({"mode": mode, "error": f"timed out after {args.timeout_s:.0f} s"})
            continue
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            runs.append({"mode": mode, "error": f"exit {proc.returncode}",
                         "stderr_tail": proc.stderr[-3000:]})
            continue
        runs.append(json.loads(line[len("RESULT "):]))
    ok = [r for r in runs if "tokens" in r]
    for r in ok[1:]:
        r["against_" + ok[0]["mode"]] = compare(ok[0]["tokens"], r["tokens"])
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "dtype": args.dtype, "runs": runs}, f, indent=1)
    for r in runs:
        print(r["mode"], r.get("error") or r.get("against_" + ok[0]["mode"] if ok else ""),
              flush=True)


if __name__ == "__main__":
    main()
