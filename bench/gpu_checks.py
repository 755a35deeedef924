"""GPU-host checks of the patched vLLM: series smoke, DDTree greedy equivalence, tau.

Run on the GPU host (vLLM on PYTHONPATH, the series applied with apply.sh --site):

    python bench/gpu_checks.py smoke  --out $OUT/smoke.json
    python bench/gpu_checks.py equiv  --out $OUT/equiv.json [--target DIR --drafter DIR]

``smoke``: a tiny random Qwen3 target with a random DFlash drafter (dummy weights,
no tokenizer) generates with method "dflash"; vllm.ddtree_series must be set.
``equiv``: greedy DDTree output must equal greedy output without speculation, same
engine settings and prompts, eager and with CUDA graphs, batch 1 and 16; records the
acceptance statistics. Without --target it uses tiny random models (float32).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.tiny_models import TARGET_SHAPES, TINY_DRAFTERS, tiny_qwen3_config, tiny_target_config  # noqa: E402


def make_tiny_models(root: str, shape: str = "qwen3", drafter_kind: str = "dflash") -> tuple[str, str]:
    target = os.path.join(root, f"tiny-{shape}")
    drafter = os.path.join(root, f"tiny-{drafter_kind}")
    os.makedirs(target, exist_ok=True)
    os.makedirs(drafter, exist_ok=True)
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump(tiny_target_config(shape), f)
    with open(os.path.join(drafter, "config.json"), "w") as f:
        json.dump(dict(**TINY_DRAFTERS[drafter_kind], **tiny_qwen3_config(num_hidden_layers=1)), f)
    return target, drafter


def _prompts(n: int, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(10, 4000) for _ in range(rng.randrange(8, 48))]}
        for _ in range(n)
    ]


def _runner_env() -> dict[str, str]:
    """Every engine on vLLM's V2 model runner, whatever the method: DDTree always runs on
    it, and vLLM's V1 runner (its default for MoE targets) draws seeded samples with
    per-request generators instead of V2's (seed, position) Gumbel keys, so a seeded
    reference on V1 differs from any V2 engine from the first token (the tiny Qwen3-MoE
    run, bench/results/2026-12-02-lossless-seeded-moe-and-graphs-aborts/).
    DDTREE_CHECK_RUNNER=default leaves the choice to vLLM (empty)."""
    if os.environ.get("DDTREE_CHECK_RUNNER") == "default":
        return {}
    return {"VLLM_USE_V2_MODEL_RUNNER": "1"}


def _engine(target, spec, eager, dummy, dtype, **kw):
    """An engine for the checks, on the runner :func:`_runner_env` picks."""
    from vllm import LLM

    from bench.run import engine_environment

    with engine_environment(_runner_env()):
        return LLM(
            model=target,
            speculative_config=spec,
            enforce_eager=eager,
            load_format="dummy" if dummy else "auto",
            skip_tokenizer_init=dummy,
            dtype=dtype,
            gpu_memory_utilization=float(os.environ.get("GPU_MEM_UTIL", "0.12")),
            max_model_len=2048,
            seed=0,
            tensor_parallel_size=_parallel()["tp"],
            **_executor_kw(),
            **kw,
        )


def _parallel() -> dict:
    """The checks' tensor-parallel size and executor (DDTREE_CHECK_TP,
    DDTREE_CHECK_EXECUTOR: vLLM's own choice, mp with more than one GPU, when unset)."""
    tp = int(os.environ.get("DDTREE_CHECK_TP", "1"))
    return dict(tp=tp, executor=os.environ.get("DDTREE_CHECK_EXECUTOR", "mp" if tp > 1 else "uni"))


def _executor_kw() -> dict:
    """``distributed_executor_backend`` for the engines when DDTREE_CHECK_EXECUTOR is set."""
    backend = os.environ.get("DDTREE_CHECK_EXECUTOR")
    return {"distributed_executor_backend": backend} if backend else {}


def _rank_trace_dir(name: str) -> str | None:
    """With tensor parallelism, a fresh directory for DDTree engine ``name``'s
    VLLM_DDTREE_RANK_TRACE (vllm_ddtree.rank_trace); None with one GPU."""
    if _parallel()["tp"] <= 1:
        return None
    return tempfile.mkdtemp(prefix=f"rank-trace-{name}-")


def _rank_trace_env(directory: str | None) -> dict[str, str]:
    return {"VLLM_DDTREE_RANK_TRACE": directory} if directory else {}


def _record_rank_trace(results: dict, name: str, directory: str | None) -> None:
    """The ranks' traces of engine ``name`` in ``directory`` compared (after its last
    generation): ``results["rank_traces"][name]``."""
    if directory is None:
        return
    from vllm_ddtree.rank_trace import compare_rank_traces

    trace = compare_rank_traces(directory)
    results.setdefault("rank_traces", {})[name] = trace
    print(json.dumps(dict(rank_trace=name, **trace)), flush=True)


def _free(llm):
    import torch

    # Shut the engine core down explicitly: with tensor parallelism its worker
    # processes otherwise outlive `del llm` and keep their GPU memory (the next
    # engine then fails in cublasCreate, seen in the first TP run).
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # noqa: BLE001 - cleanup; the next engine start will tell
        print(f"gpu_checks: engine shutdown raised {exc!r}", file=sys.stderr, flush=True)
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def run_smoke(args) -> dict:
    import vllm
    from vllm import SamplingParams

    target, drafter = make_tiny_models(tempfile.mkdtemp())
    t = time.time()
    llm = _engine(
        target,
        dict(method="dflash", model=drafter, num_speculative_tokens=15),
        eager=True,
        dummy=True,
        dtype="bfloat16",
    )
    outs = llm.generate(_prompts(4), SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    result = dict(
        mode="smoke",
        method="dflash",
        init_plus_generate_s=round(time.time() - t, 1),
        num_outputs=len(outs),
        output_lengths=[len(o.outputs[0].token_ids) for o in outs],
        ddtree_series=vllm.ddtree_series,
        vllm_version=vllm.__version__,
    )
    _free(llm)
    return result


def _greedy(llm, prompts, max_tokens):
    return _generate(llm, prompts, max_tokens, "greedy")


# Sampling modes of the equivalence checks. Seeded modes give every request its own
# seed (1000 + its index): vLLM keys the sampling noise by (seed, position), so a
# lossless tree walk must reproduce decoding without speculation token for token.
SAMPLING_MODES = {
    "greedy": dict(temperature=0.0),
    "seeded": dict(temperature=1.0),
    "seeded-topk-topp": dict(temperature=0.8, top_k=40, top_p=0.9),
    # A position-keyed setting: min_tokens (stop tokens masked before it). vLLM refuses
    # logit_bias and min_p with any speculative decoding.
    "seeded-min-tokens": dict(temperature=1.0, min_tokens=96),
    # Requests DDTree decodes without drafts (penalties, bad words, structured outputs:
    # FEATURE_CYCLE, by request index) mixed with requests on trees in one batch.
    "seeded-features": dict(temperature=1.0),
    # Sample logprobs from the tree sampler: tokens compared as in every mode, and the
    # emitted tokens' logprobs against the reference's where both emitted the same.
    "seeded-logprobs": dict(temperature=1.0, logprobs=5),
    # Prompt logprobs (prefill), compared per prompt token (max_prompt_logprob_abs_diff).
    "seeded-prompt-logprobs": dict(temperature=1.0, prompt_logprobs=1),
}
# What "seeded-features" adds to request i: FEATURE_CYCLE[i % len(FEATURE_CYCLE)].
FEATURE_CYCLE = (
    {},
    {"repetition_penalty": 1.3},
    {"frequency_penalty": 0.5, "presence_penalty": 0.5},
    # Words, not "\n": vLLM 0.26.0's SamplingParams.update_from_tokenizer strips each
    # word (lstrip) and fails with IndexError on one that strips to nothing.
    {"bad_words": [" the", " a", " and"]},
    {"structured_outputs": {"json": {"type": "object",
                                     "properties": {"answer": {"type": "string"}},
                                     "required": ["answer"]}}},
)


def request_seed(mode: str, request: int) -> int | None:
    """The seed of request ``request`` (its index in the prompt list) in ``mode``."""
    return None if mode == "greedy" else 1000 + request


def sampling_params(mode: str, n: int, max_tokens: int, first: int = 0) -> list:
    """One SamplingParams per request for sampling ``mode`` (requests first, first+1...)."""
    from vllm import SamplingParams

    from vllm.sampling_params import StructuredOutputsParams

    def features(request: int) -> dict:
        if mode != "seeded-features":
            return {}
        extra = dict(FEATURE_CYCLE[request % len(FEATURE_CYCLE)])
        if "structured_outputs" in extra:
            extra["structured_outputs"] = StructuredOutputsParams(**extra["structured_outputs"])
            extra["ignore_eos"] = False  # the grammar ends the output
        return extra

    kw = SAMPLING_MODES[mode]
    out = []
    for i in range(n):
        extra = features(first + i)
        ignore_eos = extra.pop("ignore_eos", True)
        out.append(SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos,
                                  seed=request_seed(mode, first + i), **kw, **extra))
    return out


class Generated(list):
    """Token ids per request; ``logprobs``: per request, the emitted tokens' logprobs
    (None when the mode asks for none)."""

    logprobs: list[list[float]] | None = None
    prompt_logprobs: list[list[float | None]] | None = None


def emitted_logprobs(output) -> list[float] | None:
    """The logprob of each emitted token of a vLLM ``CompletionOutput`` (None without
    logprobs)."""
    if not output.logprobs:
        return None
    return [float(step[tok].logprob) for tok, step in zip(output.token_ids, output.logprobs)]


def max_logprob_difference(out: Generated, ref: Generated) -> float | None:
    """The largest |logprob difference| of the same token at the same position, over
    each request's prefix identical to the reference's (None without logprobs)."""
    if out.logprobs is None or ref.logprobs is None:
        return None
    worst = 0.0
    for o, r, lo, lr in zip(out, ref, out.logprobs, ref.logprobs):
        for a, b, x, y in zip(o, r, lo or [], lr or []):
            if a != b:
                break
            worst = max(worst, abs(x - y))
    return worst


def max_prompt_logprob_difference(out: Generated, ref: Generated) -> float | None:
    """The largest |logprob difference| of a prompt token between two runs (None
    without prompt logprobs)."""
    if out.prompt_logprobs is None or ref.prompt_logprobs is None:
        return None
    return max((abs(x - y) for lo, lr in zip(out.prompt_logprobs, ref.prompt_logprobs)
                for x, y in zip(lo or [], lr or []) if x is not None and y is not None),
               default=0.0)


def _generate(llm, prompts, max_tokens, mode: str, first: int = 0):
    sps = sampling_params(mode, len(prompts), max_tokens, first)
    t = time.time()
    outs = llm.generate(prompts, sps, use_tqdm=False)
    tokens = Generated(list(o.outputs[0].token_ids) for o in outs)
    if SAMPLING_MODES[mode].get("logprobs") is not None:
        tokens.logprobs = [emitted_logprobs(o.outputs[0]) for o in outs]
    if SAMPLING_MODES[mode].get("prompt_logprobs") is not None:
        tokens.prompt_logprobs = [
            [None if e is None else float(e[t].logprob)
             for e, t in zip(o.prompt_logprobs or [], o.prompt_token_ids)] for o in outs]
    return tokens, time.time() - t


def _spec_stats(llm) -> dict:
    stats = {}
    try:
        for metric in llm.get_metrics():
            if "spec_decode" in metric.name:
                value = getattr(metric, "value", None)
                if value is None:
                    value = getattr(metric, "values", None)
                stats[metric.name] = value
    except Exception as exc:  # metrics are informative only
        stats["error"] = repr(exc)
    return stats


def run_equiv(args) -> dict:
    """DDTree (and the chain) == decoding without speculation on tiny random targets
    (dummy weights) of each ``--target-shapes`` shape, greedy and seeded."""
    dummy = args.target is None
    if args.prompts:
        with open(args.prompts) as f:
            prompts = [json.loads(line) for line in f][: args.num_prompts]
        prompts = [{"prompt_token_ids": p["prompt_token_ids"]} if "prompt_token_ids" in p else p["prompt"] for p in prompts]
    else:
        prompts = _prompts(args.num_prompts)
    results = dict(mode="equiv", dummy=dummy, dtype=args.dtype, sampling=args.sampling,
                   **_provenance(), **_parallel(), max_tokens=args.max_tokens, runs=[], cases=[])
    shapes = args.target_shapes if dummy else [None]
    for shape in shapes:
        if dummy:
            target, drafter = make_tiny_models(tempfile.mkdtemp(), shape, args.drafter_kind)
        else:
            target, drafter = args.target, args.drafter
        name = f"tiny-{shape}" if dummy else os.path.basename(target.rstrip("/"))
        if dummy and args.drafter_kind != "dflash":
            name += f"+{args.drafter_kind}"
        for eager in args.eager_modes:
            try:
                base = _engine(target, None, eager, dummy, args.dtype)
            except Exception as exc:
                results["runs"].append(dict(target=name, config="no-spec", eager=eager,
                                            error=repr(exc)[:1500]))
                print(json.dumps(results["runs"][-1]), flush=True)
                continue
            ref = {}
            for m in args.sampling:
                for bs in args.batch_sizes:
                    ref[m, bs], base_s = _generate(base, prompts[:bs], args.max_tokens, m)
                    results["runs"].append(dict(target=name, config="no-spec", eager=eager,
                                                batch=bs, sampling=m, seconds=round(base_s, 3)))
            _free(base)
            # The chain drafts the drafter's whole block (block_size - 1 tokens); it runs
            # after DDTree, so a chain engine that stalls (vLLM 0.33.0's DFlash2 chain
            # builds a FlashInfer top-k module on first use) leaves DDTree's cases written.
            chain = (TINY_DRAFTERS[args.drafter_kind]["block_size"] - 1) if dummy else 15
            engines = [("ddtree", b) for b in args.budgets]
            if not args.no_chain:
                engines.append(("dflash", chain))
            for method, budget in engines:
                spec = dict(method=method, model=drafter, num_speculative_tokens=budget)
                try:
                    llm = _engine(target, spec, eager, dummy, args.dtype)
                except Exception as exc:
                    results["runs"].append(dict(target=name, config=f"{method}-{budget}",
                                                eager=eager, error=repr(exc)[:1500]))
                    print(json.dumps(results["runs"][-1]), flush=True)
                    continue
                for m in args.sampling:
                    for bs in args.batch_sizes:
                        out, secs = _generate(llm, prompts[:bs], args.max_tokens, m)
                        entry = dict(target=name, config=f"{method}-{budget}", eager=eager,
                                     batch=bs, sampling=m, seconds=round(secs, 3),
                                     **_compare(out, ref[m, bs]))
                        results["runs"].append(entry)
                        results["cases"].append(case_row(
                            results, target=name, config=f"{method}-{budget}", graphs=not eager,
                            batch=bs, sampling=m, scenario="random-prompts",
                            identical=entry["identical_outputs"], total=entry["num_outputs"],
                            **_parallel()))
                        print(json.dumps(entry), flush=True)
                        with open(args.out, "w") as f:  # what a stopped run measured
                            json.dump(dict(results, complete=False, command=" ".join(sys.argv)),
                                      f, indent=2, default=str)
                results["runs"][-1]["spec_metrics"] = _spec_stats(llm)
                _free(llm)
    return results


def _token_prompts(args, n: int) -> list[dict]:
    """Chat-templated token prompts from the fixture's prompt sets (bench/run.py)."""
    from transformers import AutoTokenizer

    from bench.run import load_prompt_sets

    tok = AutoTokenizer.from_pretrained(args.target)
    ids = load_prompt_sets([args.prompt_set], args.data, tok, n)[args.prompt_set]
    return [{"prompt_token_ids": p} for p in ids]


def _compare(out, ref) -> dict:
    from bench.run import compare_greedy

    c = compare_greedy(out, ref)
    return dict(identical_outputs=c["greedy_identical"], num_outputs=c["greedy_total"],
                first_difference_at=c["greedy_first_difference"],
                differences=differences(out, ref))


def differences(out: list[list[int]], ref: list[list[int]], context: int = 3) -> list[dict]:
    """Each differing request: where it first differs, the tokens around that point in
    both, and whether the output there is the reference moved by one token (a token
    dropped or repeated: bookkeeping, not rounding)."""
    from bench.run import first_difference

    found = []
    for i, (a, b) in enumerate(zip(out, ref)):
        d = first_difference(a, b)
        if d is None:
            continue
        lo = max(0, d - context)
        found.append(dict(
            request=i, token=d, output=a[lo:d + context + 1], reference=b[lo:d + context + 1],
            output_token=a[d] if d < len(a) else None,
            reference_token=b[d] if d < len(b) else None,
            dropped_one=a[d:d + 2] == b[d + 1:d + 3] and len(a) > d + 1,
            repeated_one=a[d + 1:d + 3] == b[d:d + 2] and len(b) > d + 1,
        ))
    return found


def _generate_with_aborts(llm, prompts, max_tokens, abort_every: int, abort_after_steps: int,
                          mode: str = "greedy"):
    """Requests through the engine's step loop; every ``abort_every``-th request is
    aborted after ``abort_after_steps`` steps. Returns outputs by index (aborted
    requests: the tokens they had) and the aborted indices."""
    engine = llm.llm_engine
    sps = sampling_params(mode, len(prompts), max_tokens)
    ids = [f"abort-test-{i}" for i in range(len(prompts))]
    for rid, p, sp in zip(ids, prompts, sps):
        engine.add_request(rid, p, sp)
    outputs: dict[str, list[int]] = {}
    aborted = [rid for i, rid in enumerate(ids) if i % abort_every == 1]
    steps = 0
    deadline = time.time() + 300
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps == abort_after_steps:
            engine.abort_request(aborted)
        if time.time() > deadline:
            raise TimeoutError("abort test did not finish in 300 s")
    return [outputs.get(rid, []) for rid in ids], {ids.index(r) for r in aborted}, steps


EQUIV_REAL_VARIANTS = ("ddtree-async", "ddtree-sync", "ddtree-tokens-per-step",
                       "ddtree-disable-by-batch", "dflash-chain", "no-spec-preempt",
                       "ddtree-preempt")
# Opt-in: a control of the engine itself (no speculation), and paths off by default
# that must give the same tokens: the multi-launch kernels (VLLM_DDTREE_FUSED_KERNELS=0)
# and the drafter's context stored every step while drafting is off
# (VLLM_DDTREE_DEFER_CONTEXT=0; deferred by default).
EQUIV_REAL_CONTROLS = ("no-spec-batch-shape", "ddtree-unfused", "ddtree-stored-context")


def equivalence_case(results: dict, entry: dict, sampling: str) -> dict | None:
    """One row of bench/results/equivalence.json from an equiv-real entry."""
    if "identical_outputs" not in entry or entry["config"] == "no-spec-batch-shape":
        return None
    config = entry["config"]
    scenario = ("preempt" if config.endswith("preempt") else
                "aborts" if config.endswith("aborts") else config.split("-", 1)[1])
    return case_row(results, target=results["target_name"], config=config,
                    graphs=not results["eager"], batch=entry["batch"], sampling=sampling,
                    scenario=scenario, identical=entry["identical_outputs"],
                    total=entry["num_outputs"], prompt_set=results["prompt_set"],
                    batch_invariant=results["batch_invariant"], **_parallel())


def _provenance() -> dict:
    """What ran: vLLM's version, git_rev, and the digest of the files that ran (a
    copied working tree may carry a stale .git, so git_rev alone does not say)."""
    import vllm

    from bench.run import code_digest, git_rev

    return dict(vllm_version=vllm.__version__, git_rev=git_rev(), code_digest=code_digest(),
                model_runner="v2" if _runner_env() else "vLLM's default")


def case_row(results: dict, *, target: str, config: str, graphs: bool, batch: int,
             sampling: str, scenario: str, identical: int, total: int, **extra) -> dict:
    """One row of bench/results/equivalence.json (bench/equivalence.py gathers them)."""
    kw = SAMPLING_MODES[sampling]
    method = ("dflash" if config.startswith("dflash") else
              "no-spec" if config.startswith("no-spec") else "ddtree")
    return dict(target=target, method=method, config=config,
                vllm_version=results["vllm_version"], dtype=results["dtype"], graphs=graphs,
                batch=batch, temperature=kw["temperature"], top_k=kw.get("top_k"),
                top_p=kw.get("top_p"), seeded=sampling != "greedy", sampling=sampling,
                scenario=scenario, identical=identical, total=total,
                max_tokens=results["max_tokens"], git_rev=results["git_rev"], **extra)


def gumbel_noise(seed: int, pos: int, tokens: list[int], vocab_size: int) -> list[float]:
    """vLLM's own Gumbel noise (its sampling kernel, fp32) at (seed, position) for each
    of ``tokens``: a row of -inf logits but 0 at the token gives the noise as the row's
    block maximum."""
    import torch
    from vllm.triton_utils import triton
    from vllm.v1.worker.gpu.sample.gumbel import _gumbel_sample_kernel

    n = len(tokens)
    logits = torch.full((n, vocab_size), float("-inf"), dtype=torch.float32, device="cuda")
    logits[torch.arange(n), torch.tensor(tokens)] = 0.0
    block = 1024
    num_blocks = triton.cdiv(vocab_size, block)
    local_argmax = torch.empty(n, num_blocks, dtype=torch.int64, device="cuda")
    local_max = torch.empty(n, num_blocks, dtype=torch.float32, device="cuda")
    # The kernel's arguments by name: 0.33.0 added a logits cache and IS_DRAFTING,
    # unused (None / 0 / False) for plain decoding's noise, as on 0.26.0.
    args = dict(
        local_argmax_ptr=local_argmax, local_argmax_stride=local_argmax.stride(0),
        local_max_ptr=local_max, local_max_stride=local_max.stride(0),
        processed_logits_ptr=None, processed_logits_stride=0, processed_logits_col_ptr=None,
        logits_cache_ptr=None, logits_cache_stride_0=0, logits_cache_stride_1=0,
        logits_cache_col_ptr=None, logits_cache_source_ptr=None,
        logits_cache_source_stride=0,
        logits_ptr=logits, logits_stride=logits.stride(0),
        expanded_idx_mapping_ptr=torch.zeros(n, dtype=torch.int32, device="cuda"),
        seeds_ptr=torch.tensor([seed], dtype=torch.int64, device="cuda"),
        pos_ptr=torch.full((n,), pos, dtype=torch.int64, device="cuda"),
        temp_ptr=torch.ones(1, dtype=torch.float32, device="cuda"),
        vocab_size=vocab_size, BLOCK_SIZE=block, IS_DRAFTING=False,
        APPLY_TEMPERATURE=False, USE_FP64=False, PER_TOKEN_COL=False,
    )
    missing = [a for a in _gumbel_sample_kernel.arg_names if a not in args]
    if missing:
        raise RuntimeError(f"vLLM's _gumbel_sample_kernel takes arguments this check does "
                           f"not know: {missing}")
    _gumbel_sample_kernel[(n, num_blocks)](
        **{a: args[a] for a in _gumbel_sample_kernel.arg_names})
    return [float(local_max[i, t // block]) for i, t in enumerate(tokens)]


# A first difference whose margin is at most this is a near tie: float32 rounding of the
# logits, not a token plain decoding could not have chosen.
NEAR_TIE_MAX_MARGIN = 1e-2


def margin_not_recomputable(mode: str, request: int, token: int) -> str | None:
    """Why the first difference of ``request`` in sampling ``mode``, at output token
    ``token``, cannot be recomputed from its prompt and common prefix alone (None: it
    can). ``min_tokens`` masks stop tokens only before that many output tokens: from
    there on a position is sampled as without it."""
    min_tokens = SAMPLING_MODES[mode].get("min_tokens")
    if min_tokens and token < min_tokens:
        return (f"token {token} lies before min_tokens ({min_tokens}), where stop tokens "
                f"were masked")
    if mode == "seeded-features" and FEATURE_CYCLE[request % len(FEATURE_CYCLE)]:
        return "penalties and grammars count the output, not a prompt"
    return None


def sampling_margin(mode: str, request: int, pos: int, gap: float, ref_token: int,
                    out_token: int, noise, max_margin: float = NEAR_TIE_MAX_MARGIN) -> dict:
    """The margin by which the reference's token beat the other at ``pos``: their
    logprob gap at T=0; at T > 0 gap / T plus vLLM's Gumbel noise difference at the
    request's (seed, position) key, ``noise(seed, pos, tokens)``."""
    temp = SAMPLING_MODES[mode]["temperature"]
    fields: dict = {"logprob_gap": gap}
    if temp == 0:
        margin = gap
    else:
        g_ref, g_out = noise(request_seed(mode, request), pos, [ref_token, out_token])
        margin = gap / temp + (g_ref - g_out)
        fields.update(noise_reference=g_ref, noise_output=g_out)
    return dict(fields, margin=margin, near_tie=abs(margin) <= max_margin)


def near_tie_margins(llm, prompts, results: dict,
                     max_margin: float = NEAR_TIE_MAX_MARGIN) -> list[dict]:
    """For every first difference of a DDTree (or chain) run from the reference: the
    reference engine recomputes that position (prompt + the common prefix, one token,
    the same seed and so the same noise key) with both tokens' logprobs, and the margin by
    which the reference's token beat the other one is computed from the logprobs
    (and, seeded, vLLM's own noise at that key). A margin within float32 rounding of
    the logits means the two engines' logits differed in their last bits at a near
    tie; a large margin means the speculative run chose a token plain decoding could
    not have (a bug)."""
    from vllm import SamplingParams

    vocab = llm.llm_engine.vllm_config.model_config.get_vocab_size()
    found = []
    for run in results["runs"]:
        mode = run.get("sampling", "greedy")
        for diff in run.get("differences", []) or []:
            i, d = diff["request"], diff["token"]
            ref = run.get("reference_tokens", {}).get(i)
            out_token, ref_token = diff["output_token"], diff["reference_token"]
            if ref is None or out_token is None or ref_token is None:
                continue  # a length difference has no competing token
            base = prompts[i]["prompt_token_ids"]
            if margin_not_recomputable(mode, i, d):
                continue
            kw = dict(SAMPLING_MODES[mode])
            kw.pop("min_tokens", None)  # past min_tokens (above): no longer in effect
            kw.pop("logprobs", None)  # the two tokens' logprobs are asked by id below
            kw.pop("prompt_logprobs", None)
            seed = request_seed(mode, i)
            # The two tokens' logprobs by id: at T > 0 either may lie far outside a top-k.
            sp = SamplingParams(max_tokens=1, logprob_token_ids=[ref_token, out_token],
                                seed=seed, ignore_eos=True, **kw)
            got = llm.generate([{"prompt_token_ids": base + ref[:d]}], sp, use_tqdm=False)[0]
            lp = got.outputs[0].logprobs[0]
            entry = dict(config=run["config"], batch=run.get("batch"), sampling=mode,
                         request=i, token=d, reference_token=ref_token, output_token=out_token,
                         recomputed_token=got.outputs[0].token_ids[0])
            if ref_token not in lp or out_token not in lp:
                entry["margin"] = None
                entry["note"] = "the engine returned no logprob for one of the two tokens"
                found.append(entry)
                continue
            gap = lp[ref_token].logprob - lp[out_token].logprob
            entry.update(sampling_margin(
                mode, i, len(base) + d - 1, gap, ref_token, out_token,
                lambda s, p, t: gumbel_noise(s, p, t, vocab), max_margin))
            found.append(entry)
            print(json.dumps(dict(near_tie=entry)), flush=True)
    return found


def run_equiv_real(args) -> dict:
    """DDTree == decoding without speculation on the real pair (float32, eager by
    default), greedy and seeded (per-request seeds, T > 0): async and sync scheduling,
    a batch-aware budget, KV-cache pressure that forces preemption, and requests
    aborted mid-way. The DFlash chain runs the same cases as a control."""
    from bench.run import engine_environment

    target, drafter = args.target, args.drafter
    n = max(args.batch_sizes)
    prompts = _token_prompts(args, n)
    eager = args.eager_modes[0]
    results = dict(mode="equiv-real", target=target, drafter=drafter, dtype=args.dtype,
                   eager=eager, prompt_set=args.prompt_set, max_tokens=args.max_tokens,
                   sampling=args.sampling, **_provenance(),
                   target_name=args.target_name or os.path.basename(target.rstrip("/")),
                   **_parallel(), runs=[], cases=[])
    results["batch_invariant"] = os.environ.get("VLLM_BATCH_INVARIANT", "0") == "1"
    wanted = set(args.variants or EQUIV_REAL_VARIANTS)

    def record(entry, sampling="greedy"):
        entry = dict(entry, sampling=sampling)
        results["runs"].append(entry)
        case = equivalence_case(results, entry, sampling)
        if case is not None:
            results["cases"].append(case)
        print(json.dumps(entry), flush=True)
        # Written after every entry: a run stopped by its timeout keeps what it measured
        # (main() rewrites the file, with the command, when the run completes).
        with open(args.out, "w") as f:
            json.dump(dict(results, complete=False, command=" ".join(sys.argv)), f, indent=2,
                      default=str)

    modes = args.sampling
    base = _engine(target, None, eager, False, args.dtype)
    ref = {m: {} for m in modes}
    for m in modes:
        for bs in args.batch_sizes:
            ref[m][bs], _ = _generate(base, prompts[:bs], args.max_tokens, m)
    if "no-spec-batch-shape" in wanted:
        # Control without speculation: each prompt alone vs. in the batch of n. Any
        # difference is the engine's own dependence on the batch's shape, which bounds
        # what exactness the speculative runs can show in this mode.
        for m in modes:
            runs = [_generate(base, [p], args.max_tokens, m, first=i)[0]
                    for i, p in enumerate(prompts[:n])]
            alone = Generated(r[0] for r in runs)
            if runs and runs[0].logprobs is not None:
                alone.logprobs = [r.logprobs[0] for r in runs]
            if runs and runs[0].prompt_logprobs is not None:
                alone.prompt_logprobs = [r.prompt_logprobs[0] for r in runs]
            extra = {}
            for key, fn in (("max_logprob_abs_diff", max_logprob_difference),
                            ("max_prompt_logprob_abs_diff", max_prompt_logprob_difference)):
                diff = fn(alone, ref[m][n])
                if diff is not None:
                    extra[key] = round(diff, 6)
            record(dict(config="no-spec-batch-shape", batch=n, **_compare(alone, ref[m][n]),
                        **extra), m)
    _free(base)

    budget = args.budgets[0]
    disable_by_batch = dict(num_speculative_tokens=64, ddtree_tokens_per_step=256,
                            ddtree_disable_by_batch_size=4)
    variants = [
        ("ddtree-async", dict(num_speculative_tokens=budget), {}, {}),
        ("ddtree-unfused", dict(num_speculative_tokens=budget), {},
         {"VLLM_DDTREE_FUSED_KERNELS": "0"}),
        ("ddtree-sync", dict(num_speculative_tokens=budget), dict(async_scheduling=False), {}),
        ("ddtree-tokens-per-step", dict(num_speculative_tokens=64, ddtree_tokens_per_step=512),
         {}, {}),
        # Budget 0 (drafter context only) from 4 requests on: a batch of 16 decodes
        # without drafts and drafts again in its tail. The budget-0 stretch buffers the
        # drafter's context (the default), the tail's first drafting step stores it
        # before drafting ...
        ("ddtree-disable-by-batch", disable_by_batch, {}, {}),
        # ... or each budget-0 step stores it (VLLM_DDTREE_DEFER_CONTEXT=0).
        ("ddtree-stored-context", disable_by_batch, {}, {"VLLM_DDTREE_DEFER_CONTEXT": "0"}),
        ("dflash-chain", dict(num_speculative_tokens=15), {}, {}),
    ]
    for name, spec_extra, engine_kw, env in variants:
        if name not in wanted:
            continue
        method = "dflash" if name.startswith("dflash") else "ddtree"
        spec = dict(method=method, model=drafter, **spec_extra)
        try:
            trace_dir = _rank_trace_dir(name) if method == "ddtree" else None
            with engine_environment(dict(env, **_rank_trace_env(trace_dir))):
                llm = _engine(target, spec, eager, False, args.dtype, disable_log_stats=False,
                              **engine_kw)
        except Exception as exc:
            record(dict(config=name, error=repr(exc)[:1500]))
            continue
        async_on = llm.llm_engine.vllm_config.scheduler_config.async_scheduling
        for m in modes:
            for bs in args.batch_sizes:
                try:
                    out, secs = _generate(llm, prompts[:bs], args.max_tokens, m)
                    extra = {}
                    diff = max_logprob_difference(out, ref[m][bs])
                    if diff is not None:
                        extra["max_logprob_abs_diff"] = round(diff, 6)
                    diff = max_prompt_logprob_difference(out, ref[m][bs])
                    if diff is not None:
                        extra["max_prompt_logprob_abs_diff"] = round(diff, 6)
                    record(dict(config=name, batch=bs, async_scheduling=async_on,
                                seconds=round(secs, 3), **_compare(out, ref[m][bs]),
                                reference_tokens=_differing(out, ref[m][bs]), **extra), m)
                except Exception as exc:
                    record(dict(config=name, batch=bs, error=repr(exc)[:1500]), m)
        results["runs"][-1]["spec_metrics"] = _spec_stats(llm)
        if name in ("ddtree-async", "dflash-chain"):
            for m in modes:
                try:
                    outs, aborted, steps = _generate_with_aborts(
                        llm, prompts[:n], args.max_tokens, 3, 8, m)
                    kept = [i for i in range(n) if i not in aborted]
                    same = sum(outs[i] == ref[m][n][i] for i in kept)
                    prefix_ok = sum(ref[m][n][i][:len(outs[i])] == outs[i] for i in aborted)
                    # Differences of the requests that ran to the end, by request index.
                    kept_out = [outs[i] if i in kept else ref[m][n][i] for i in range(n)]
                    record(dict(config=name + "-aborts", batch=n, aborted=len(aborted),
                                steps=steps, identical_outputs=same, num_outputs=len(kept),
                                aborted_outputs_are_prefixes=prefix_ok,
                                differences=differences(kept_out, ref[m][n]),
                                reference_tokens=_differing(kept_out, ref[m][n])), m)
                except Exception as exc:
                    record(dict(config=name + "-aborts", error=repr(exc)[:1500]), m)
        _record_rank_trace(results, name, trace_dir)
        _free(llm)

    # KV-cache pressure: few blocks, so the scheduler preempts and recomputes.
    blocks = args.preempt_blocks
    for name, spec in (("no-spec-preempt", None),
                       ("ddtree-preempt", dict(method="ddtree", model=drafter,
                                               num_speculative_tokens=budget))):
        if name not in wanted:
            continue
        try:
            trace_dir = _rank_trace_dir(name) if spec else None
            with engine_environment(_rank_trace_env(trace_dir)):
                llm = _engine(target, spec, eager, False, args.dtype, disable_log_stats=False,
                              num_gpu_blocks_override=blocks)
            for m in modes:
                out, secs = _generate(llm, prompts[:n], args.max_tokens, m)
                stats = {}
                try:
                    for metric in llm.get_metrics():
                        if "preempt" in metric.name:
                            stats[metric.name] = getattr(metric, "value", None)
                except Exception as exc:
                    stats["error"] = repr(exc)
                record(dict(config=name, batch=n, num_gpu_blocks=blocks, seconds=round(secs, 3),
                            preemption_metrics=stats, **_compare(out, ref[m][n]),
                            reference_tokens=_differing(out, ref[m][n])), m)
            _record_rank_trace(results, name, trace_dir)
            _free(llm)
        except Exception as exc:
            record(dict(config=name, error=repr(exc)[:1500]))
    if args.near_ties and any(r.get("differences") for r in results["runs"]):
        # Eager: the recomputation is a prefill, whatever mode the runs used.
        base = _engine(target, None, True, False, args.dtype)
        try:
            results["near_ties"] = near_tie_margins(base, prompts, results)
        except Exception as exc:
            results["near_ties_error"] = repr(exc)[:1500]
        _free(base)
    return results


def _differing(out: list[list[int]], ref: list[list[int]]) -> dict[int, list[int]]:
    """The reference tokens of the requests whose outputs differ, by request index."""
    return {i: b for i, (a, b) in enumerate(zip(out, ref)) if a != b}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["smoke", "equiv", "equiv-real"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--target")
    parser.add_argument("--drafter")
    parser.add_argument("--prompts")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--data", default="/opt/smollm2-fixture/data")
    parser.add_argument("--prompt-set", default="humaneval")
    parser.add_argument("--preempt-blocks", type=int, default=160)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--budgets", type=int, nargs="+", default=[32])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--sampling", nargs="+", choices=list(SAMPLING_MODES), default=["greedy"],
                        help="equiv-real: sampling modes (seeded: per-request seeds, T > 0)")
    parser.add_argument("--target-name", help="equiv-real: the target's name in the cases")
    parser.add_argument("--near-ties", action="store_true",
                        help="equiv-real: the margin of every first difference (near_tie_margins)")
    parser.add_argument("--target-shapes", nargs="+", choices=list(TARGET_SHAPES),
                        default=["qwen3"], help="equiv without --target: tiny random shapes")
    parser.add_argument("--drafter-kind", choices=list(TINY_DRAFTERS), default="dflash",
                        help="equiv without --target: the tiny random drafter (dflash2: vLLM 0.33.0)")
    parser.add_argument("--variants", nargs="+", choices=EQUIV_REAL_VARIANTS + EQUIV_REAL_CONTROLS,
                        help="equiv-real: run only these (default: all but the controls; "
                             "ddtree-async includes the aborts run)")
    parser.add_argument("--no-chain", action="store_true",
                        help="equiv: leave out vLLM's DFlash chain engine")
    parser.add_argument(
        "--eager-modes", type=lambda s: s.lower() == "eager", nargs="+", default=[True]
    )
    args = parser.parse_args()
    run = {"smoke": run_smoke, "equiv": run_equiv, "equiv-real": run_equiv_real}[args.mode]
    result = run(args)
    if result.get("rank_traces"):
        result["rank_traces_identical"] = all(t["identical"] for t in result["rank_traces"].values())
    result["command"] = " ".join(sys.argv)
    result["complete"] = True
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2, default=str)
    print(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
