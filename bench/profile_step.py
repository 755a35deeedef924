#!/usr/bin/env python3
"""Where a decode step's time goes: host (Python) and GPU, per engine configuration.

For each configuration (names as in ``bench/run.py``: ``no-spec``, ``dflash``,
``ddtree-b32`` ...) this starts the engine in this process (CUDA graphs on unless
``--eager``), warms it up, and generates ``--max-tokens`` tokens for ``--batch-size``
prompts three times:

1. plain, timed: output tokens/s and engine steps (spec-decode counters), and with the
   engine in this process the CUDA caching allocator's driver calls, retries and
   stream synchronisations over the pass, per step (``allocator``);
2. under ``cProfile``: the host's Python time per function (engine core, scheduler,
   model runner, speculator), the top entries by own and by cumulative time;
3. under ``torch.profiler`` (CPU + CUDA): every kernel's GPU time, the GPU's busy
   time (union of kernel intervals) against the wall time, so the GPU's idle share
   says how far the step is bound by the host; top kernels and top CPU-side ops.

``--steady-requests N`` replaces the wave by a constant-concurrency cell of N prompts,
``--batch-size`` in flight (``bench/run.py --cell-mode steady``), so the profiles also
hold the steps that prefill a joining request.

Writes ``<out-dir>/profile-<config>.json`` (numbers), ``profile-<config>-cprofile.txt``
(and the raw ``profile-<config>.pstats``, for callers: ``python -m pstats``)
and, with ``--trace``, ``profile-<config>-trace.json.gz`` (Chrome trace, for
https://ui.perfetto.dev). Needs a GPU and the patched vLLM.

``--suite cost8b`` profiles Qwen3-8B's shape with dummy weights and a drafter of
DFlash-8B's shape on random prompts, as ``bench/run.py --suite cost8b`` measures it (a
budget-0 step there cost ~1.05x a plain one at batch 16,
bench/results/2026-12-04-cost8b-interleaved-priced-first-probe/). Every profile keeps
each kernel's GPU time per step (``kernels_per_step``, in-process and from the engine
process's Chrome trace alike); ``--compare-kernels A B`` (no
GPU) writes, kernel by kernel, what B's step costs beyond A's.

``--sync-stacks`` adds one more pass under torch.profiler with Python stacks: every
call that makes the host wait for the GPU (``cudaStreamSynchronize``...), by the Python
frames around it (``sync_stacks`` in the numbers). With asynchronous scheduling a
decode step should have none: one takes away the overlap of host and GPU work.

``--engine-process mp`` profiles the engine as ``vllm serve`` runs it, in its own
process: through vLLM's own torch profiler (``profiler_config``, with Python stacks),
whose trace of the engine process is summarised the same way plus the Python
functions with the most own time per step (no cProfile there).

    python bench/profile_step.py --configs dflash ddtree-b32 --out-dir /tmp/prof
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import io
import json
import os
import pstats
import shutil
import sys
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.result_files import read_json  # noqa: E402
from bench.run import (  # noqa: E402
    DEFAULT_DRAFTER,
    STEADY_WARMUP_WAVES,
    _free,
    _sampling_params,
    config_engine_kwargs,
    engine_environment,
    file_stem,
    load_prompt_sets,
    make_8b_models,
    parse_config,
    refuse_full_graphs_on_flash_attention,
    run_cell_steady,
    spec_counters,
)


def busy_union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (the GPU's busy time)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def summarize_torch_profile(prof, top: int = 25, steps: int | None = None) -> dict:
    """GPU busy share and the top kernels / CPU ops of a ``torch.profiler`` run; with
    ``steps``, every kernel's GPU time and launches per step too (``kernels_per_step``,
    what ``--compare-kernels`` reads)."""
    from torch.autograd import DeviceType

    kernels: list[tuple[float, float]] = []
    by_kernel: dict[str, list[float]] = {}
    cpu_start, cpu_end = None, None
    for ev in prof.events():
        tr = ev.time_range
        if ev.device_type == DeviceType.CUDA:
            kernels.append((tr.start, tr.end))
            agg = by_kernel.setdefault(ev.name, [0.0, 0])
            agg[0] += tr.end - tr.start
            agg[1] += 1
        else:
            cpu_start = tr.start if cpu_start is None else min(cpu_start, tr.start)
            cpu_end = tr.end if cpu_end is None else max(cpu_end, tr.end)
    span = (max(e for _, e in kernels) - min(s for s, _ in kernels)) if kernels else 0.0
    busy = busy_union_us(kernels)
    ranked = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])
    cpu_ops = sorted(
        (e for e in prof.key_averages() if e.self_cpu_time_total > 0),
        key=lambda e: -e.self_cpu_time_total,
    )
    out = {
        "gpu_span_ms": round(span / 1e3, 3),
        "gpu_busy_ms": round(busy / 1e3, 3),
        "gpu_busy_fraction": round(busy / span, 4) if span else None,
        "kernel_launches": len(kernels),
        "top_kernels": [
            {"name": name[:120], "total_ms": round(t / 1e3, 3), "calls": n}
            for name, (t, n) in ranked[:top]
        ],
        "top_cpu_ops": [
            {"name": e.key[:120], "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3),
             "calls": e.count}
            for e in cpu_ops[:top]
        ],
    }
    if steps:
        out["kernels_per_step"] = kernels_per_step(by_kernel, steps)
    return out


def kernels_per_step(by_kernel: dict, steps: int) -> list[dict]:
    """Every kernel's GPU time (us) and launches per step, largest first; names are
    kept whole, since two variants of one kernel differ only in their tails."""
    n = max(steps, 1)
    return [{"name": name, "us_per_step": round(t / n, 2), "calls_per_step": round(c / n, 3)}
            for name, (t, c) in sorted(by_kernel.items(), key=lambda kv: -kv[1][0])]


def compare_kernels(base: dict, other: dict) -> dict:
    """What ``other``'s step costs on the GPU beyond ``base``'s, kernel by kernel: two
    profiles written by this script (``torch_profile.kernels_per_step``). Rows are sorted
    by the size of the difference; ``only_in`` says which profile alone ran a kernel."""
    def table(rec: dict, which: str) -> dict:
        rows = (rec.get("torch_profile") or {}).get("kernels_per_step")
        if rows is None:
            raise ValueError(f"{which} profile ({rec.get('config')}) has no kernels_per_step: "
                             "profile it again with this version of bench/profile_step.py")
        return {r["name"]: r for r in rows}

    a, b = table(base, "the base"), table(other, "the other")
    rows = []
    for name in a.keys() | b.keys():
        ra, rb = a.get(name), b.get(name)
        us_a = ra["us_per_step"] if ra else 0.0
        us_b = rb["us_per_step"] if rb else 0.0
        row = {"name": name, "base_us": us_a, "other_us": us_b, "diff_us": round(us_b - us_a, 2),
               "base_calls": ra["calls_per_step"] if ra else 0.0,
               "other_calls": rb["calls_per_step"] if rb else 0.0}
        if not (ra and rb):
            row["only_in"] = "base" if ra else "other"
        rows.append(row)
    rows.sort(key=lambda r: (-abs(r["diff_us"]), r["name"]))
    busy = [(rec.get("torch_profile") or {}).get("gpu_busy_ms_per_step") for rec in (base, other)]
    return {"base": base.get("config"), "other": other.get("config"),
            "gpu_busy_ms_per_step": {"base": busy[0], "other": busy[1]},
            "kernel_us_per_step": {"base": round(sum(r["base_us"] for r in rows), 1),
                                   "other": round(sum(r["other_us"] for r in rows), 1)},
            "kernels": rows}


# CUDA runtime calls that can make the host wait for the GPU (a D2H copy into
# pageable memory blocks too); their time is attributed to the calling Python function.
BLOCKING_RUNTIME_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                          "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpyAsync")
# The calls that always wait for the GPU (a copy may not): ``--sync-stacks`` reports
# each with the Python frames around it.
SYNC_RUNTIME_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize")
SYNC_STACK_FRAMES = 10


def _caller(stack: list[list]) -> str:
    """The innermost frame of a call stack, and when that is a torch built-in (``<built-in
    method copy_ ...>``), the Python function that called it too."""
    if not stack:
        return "(no Python caller)"
    inner = stack[-1][0]["name"]
    if not inner.startswith("<built-in"):
        return inner
    outer = next((f[0]["name"] for f in reversed(stack) if not f[0]["name"].startswith("<built-in")),
                 None)
    short = inner.split(" of ")[0].replace("<built-in method ", "").replace("<built-in function ", "")
    return f"{short} <- {outer}" if outer else inner


def summarize_chrome_trace(doc: dict, steps: int, top: int = 25) -> dict:
    """The same summary from a Chrome trace (vLLM's profiler in the engine process),
    plus per Python function (``python_function`` events, nested per thread) its own
    and inclusive time, the CUDA runtime calls per step, and which Python functions
    issued the calls that can block on the GPU (synchronisations, copies)."""
    def add(table: dict, key: str, us: float) -> None:
        agg = table.setdefault(key, [0.0, 0])
        agg[0] += us
        agg[1] += 1

    events = [e for e in doc.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kernels: list[tuple[float, float]] = []
    by_kernel: dict[str, list[float]] = {}
    own: dict[str, list[float]] = {}
    inclusive: dict[str, list[float]] = {}
    runtime: dict[str, list[float]] = {}
    blocking: dict[str, list[float]] = {}
    sync_stacks: dict[str, list[float]] = {}
    threads: dict[tuple, list[dict]] = {}
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels.append((e["ts"], e["ts"] + e["dur"]))
            add(by_kernel, e["name"], e["dur"])
        elif e.get("cat") in ("python_function", "cuda_runtime"):
            threads.setdefault((e.get("pid"), e.get("tid")), []).append(e)

    for evs in threads.values():
        # Outer before inner at equal start; runtime calls are leaves.
        evs.sort(key=lambda e: (e["ts"], -e["dur"], e.get("cat") == "cuda_runtime"))
        stack: list[list] = []  # [event, time of its children]
        for e in evs + [None]:
            while stack and (e is None or e["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]):
                done, children = stack.pop()
                add(own, done["name"], done["dur"] - children)
                if all(done["name"] != outer[0]["name"] for outer in stack):
                    add(inclusive, done["name"], done["dur"])
                if stack:
                    stack[-1][1] += done["dur"]
            if e is None:
                continue
            if e.get("cat") == "cuda_runtime":
                add(runtime, e["name"], e["dur"])
                if e["name"] in BLOCKING_RUNTIME_CALLS:
                    add(blocking, f"{e['name']} <- {_caller(stack)}", e["dur"])
                if e["name"] in SYNC_RUNTIME_CALLS:
                    frames = [f[0]["name"] for f in stack[-SYNC_STACK_FRAMES:]]
                    add(sync_stacks, " <- ".join([e["name"]] + frames[::-1]), e["dur"])
                continue
            stack.append([e, 0.0])
    span = (max(b for _, b in kernels) - min(a for a, _ in kernels)) if kernels else 0.0
    busy = busy_union_us(kernels)
    n = max(steps, 1)

    def ranked(table: dict, label: str, width: int) -> list[dict]:
        return [
            {"name": k[:width], label: round(t / n, 1), "calls_per_step": round(c / n, 2)}
            for k, (t, c) in sorted(table.items(), key=lambda kv: -kv[1][0])[:top]
        ]

    return {
        "gpu_span_ms": round(span / 1e3, 3),
        "gpu_busy_ms": round(busy / 1e3, 3),
        "gpu_busy_fraction": round(busy / span, 4) if span else None,
        "gpu_busy_ms_per_step": round(busy / 1e3 / n, 3),
        "kernel_launches": len(kernels),
        "top_kernels": ranked(by_kernel, "us_per_step", 120),
        "kernels_per_step": kernels_per_step(by_kernel, steps),
        "top_python_own_time": ranked(own, "us_per_step", 160),
        "top_python_inclusive_time": ranked(inclusive, "us_per_step", 160),
        "cuda_runtime_per_step": ranked(runtime, "us_per_step", 80),
        "blocking_runtime_calls_by_caller": ranked(blocking, "us_per_step", 200),
        # Innermost frame first.
        "synchronizations_by_stack": ranked(sync_stacks, "us_per_step", 2000),
    }


def cprofile_text(prof: cProfile.Profile, top: int = 45) -> str:
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out)
    st.strip_dirs()
    out.write("=== by own time (tottime) ===\n")
    st.sort_stats("tottime").print_stats(top)
    out.write("\n=== by cumulative time ===\n")
    st.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def generate(llm, prompts, max_tokens: int, temperature: float = 0.0,
             dummy: bool = False) -> tuple[float, int]:
    """One wave; at T > 0 each request seeded as in bench/run.py's cells; ``dummy``: no
    tokenizer (the cost8b suite), so nothing is detokenized."""
    sps = [_sampling_params(temperature, max_tokens, i, dummy=dummy)
           for i in range(len(prompts))]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)


def workload(llm, args, prompts) -> tuple[float, int]:
    """One timed pass: a wave of ``--batch-size`` prompts, or with ``--steady-requests``
    a constant-concurrency cell (``bench/run.py --cell-mode steady``) over all prompts,
    ``--batch-size`` of them in flight, so steps that prefill a joining request are
    profiled beside decode steps as a server sees them."""
    dummy = getattr(args, "dummy", False)
    if not args.steady_requests:
        return generate(llm, prompts, args.max_tokens, args.temperature, dummy)
    outputs, summary, _ = run_cell_steady(llm, prompts, args.batch_size, args.temperature,
                                          args.max_tokens, dummy=dummy)
    return summary["wall_s"], sum(len(o) for o in outputs)


def start_engine(args, name: str, **extra):
    """The engine of one configuration, as both profiling modes start it."""
    from vllm import LLM

    cfg = parse_config(name)
    memory = 0.2
    if getattr(args, "dummy", False):
        # The cost8b suite's engine, as bench/run.py starts it: dummy weights, no tokenizer.
        extra = dict(extra, load_format="dummy", skip_tokenizer_init=True)
        memory = 0.4
    with engine_environment(dict(cfg.env)):
        return LLM(model=args.target, speculative_config=cfg.speculative_config(args.drafter),
                   enforce_eager=args.eager, dtype=args.dtype, gpu_memory_utilization=memory,
                   max_model_len=2048, max_num_seqs=max(args.batch_size, 4), seed=0,
                   disable_log_stats=False, **config_engine_kwargs(cfg), **extra)


# The CUDA caching allocator's counters that say whether the timed pass went to the
# driver (a cudaMalloc or cudaFree blocks the host and may synchronise the device) or
# waited for streams: a slow eager launch in the step's logits GEMM (~0.08-0.27 ms of
# host time a call, bench/results/2026-12-07-gap-profile-batch-16-64-drafting-host-h100/)
# could be either.
ALLOCATOR_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries",
                      "num_sync_all_streams", "segment.all.allocated",
                      "segment.all.freed", "allocation.all.allocated")


def allocator_delta(before: dict, after: dict, steps: int) -> dict:
    """``ALLOCATOR_COUNTERS`` of ``torch.cuda.memory_stats()`` over a pass: the change,
    and per engine step. A counter this torch does not keep is left out."""
    out: dict = {}
    for key in ALLOCATOR_COUNTERS:
        if key in before and key in after:
            change = after[key] - before[key]
            out[key] = change
            out[key + "_per_step"] = round(change / max(steps, 1), 3)
    return out


def plain_run(llm, args, prompts) -> tuple[dict, int]:
    """Warm up, then one timed generation without profilers: its numbers and the
    engine steps per request (spec-decode drafts; one per token without speculation)."""
    dummy = getattr(args, "dummy", False)
    generate(llm, prompts[: args.batch_size], 16, args.temperature, dummy)  # warm-up
    if args.steady_requests:
        # Joining steps' first-use costs too (the first of three steady passes was
        # slower than the cProfiled one,
        # bench/results/2026-11-30-steady-full-graphs-host-profile/),
        # as bench/run.py's steady warm-up.
        run_cell_steady(llm, prompts[: STEADY_WARMUP_WAVES * args.batch_size],
                        args.batch_size, args.temperature, max(8, args.max_tokens // 2),
                        dummy=dummy)
    before = spec_counters(llm.get_metrics())
    in_process = getattr(args, "engine_process", "inproc") == "inproc"
    memory_before = _memory_stats() if in_process else None
    wall, n = workload(llm, args, prompts)
    memory_after = _memory_stats() if in_process else None
    delta = spec_counters(llm.get_metrics()).minus(before)
    # A step drafts for (and, without speculation, emits one token to) each request in
    # flight.
    steps = (delta.drafts or n) // args.batch_size
    rec = {"wall_s": round(wall, 4), "output_tokens": n,
           "output_tokens_per_s": round(n / wall, 1), **delta.summary(),
           "step_ms": round(wall / max(steps, 1) * 1e3, 3)}
    if memory_before is not None:
        rec["allocator"] = allocator_delta(memory_before, memory_after, steps)
    return rec, steps


def _memory_stats() -> dict | None:
    """This process's CUDA allocator counters (the engine's, with ``--engine-process
    inproc``); None without CUDA."""
    import torch

    return torch.cuda.memory_stats() if torch.cuda.is_available() else None


def profile_config(args, name: str, prompts) -> dict:
    import torch

    llm = start_engine(args, name)
    rec: dict = {"config": name, "batch_size": args.batch_size, "max_tokens": args.max_tokens,
                 "temperature": args.temperature,
                 "steady_requests": args.steady_requests or None, "cuda_graphs": not args.eager}
    rec["plain"], steps = plain_run(llm, args, prompts)

    prof = cProfile.Profile()
    prof.enable()
    wall_c, _ = workload(llm, args, prompts)
    prof.disable()
    rec["cprofile_wall_s"] = round(wall_c, 4)
    with open(os.path.join(args.out_dir, f"profile-{file_stem(name)}-cprofile.txt"), "w") as f:
        f.write(cprofile_text(prof))
    # The raw statistics too, for callers and callees (python -m pstats FILE).
    prof.dump_stats(os.path.join(args.out_dir, f"profile-{file_stem(name)}.pstats"))

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tprof:
        wall_t, _ = workload(llm, args, prompts)
        torch.cuda.synchronize()
    rec["torch_profile_wall_s"] = round(wall_t, 4)
    rec["torch_profile"] = summarize_torch_profile(tprof, steps=steps)
    rec["torch_profile"]["gpu_busy_ms_per_step"] = round(
        rec["torch_profile"]["gpu_busy_ms"] / max(steps, 1), 3)
    if args.sync_stacks:
        rec["sync_stacks"] = sync_stacks_pass(llm, args, prompts, steps)
    if args.trace:
        raw = os.path.join(args.out_dir, f"profile-{file_stem(name)}-trace.json")
        tprof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(raw)
    _free(llm)
    return rec


def sync_stacks_pass(llm, args, prompts, steps: int) -> dict:
    """One more pass under torch.profiler with Python stacks: every call that makes the
    host wait for the GPU (``SYNC_RUNTIME_CALLS``) with the Python frames around it, and
    the calls that may block (copies) by caller. A synchronisation inside the decode loop
    takes away asynchronous scheduling's overlap of host and GPU work."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 with_stack=True) as tprof:
        workload(llm, args, prompts)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        tprof.export_chrome_trace(path)
        summary = summarize_chrome_trace(read_json(path), steps)
    return {k: summary[k] for k in ("synchronizations_by_stack",
                                     "blocking_runtime_calls_by_caller")}


def profile_config_mp(args, name: str, prompts) -> dict:
    """The engine core in its own process; vLLM's profiler traces it."""
    import glob

    from vllm.config import ProfilerConfig

    trace_dir = os.path.abspath(os.path.join(args.out_dir, f"trace-{file_stem(name)}"))
    os.makedirs(trace_dir, exist_ok=True)
    llm = start_engine(args, name, profiler_config=ProfilerConfig(
        profiler="torch", torch_profiler_dir=trace_dir, torch_profiler_with_stack=True))
    rec: dict = {"config": name, "batch_size": args.batch_size, "max_tokens": args.max_tokens,
                 "temperature": args.temperature,
                 "steady_requests": args.steady_requests or None, "cuda_graphs": not args.eager,
                 "engine_process": "mp"}
    rec["plain"], steps = plain_run(llm, args, prompts)
    llm.start_profile()
    wall_t, _ = workload(llm, args, prompts)
    llm.stop_profile()
    rec["torch_profile_wall_s"] = round(wall_t, 4)
    deadline = time.time() + 120
    traces: list[str] = []
    while time.time() < deadline:  # the engine process writes the trace after stopping
        traces = glob.glob(os.path.join(trace_dir, "**", "*.json*"), recursive=True)
        if traces:
            break
        time.sleep(1)
    if traces:
        time.sleep(2)
        path = max(traces, key=os.path.getsize)
        rec["torch_profile"] = summarize_chrome_trace(read_json(path), steps)
        if args.trace:
            shutil.copy(path, os.path.join(args.out_dir, f"profile-{file_stem(name)}-trace.json.gz"
                                           if path.endswith(".gz") else f"profile-{file_stem(name)}-trace.json"))
    else:
        rec["torch_profile_error"] = f"no trace under {trace_dir} after 120 s"
    shutil.rmtree(trace_dir, ignore_errors=True)
    _free(llm)
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", nargs="+", default=["dflash", "ddtree-b32"])
    ap.add_argument("--target", default=os.environ.get("DDTREE_BENCH_TARGET", "/opt/smollm2-hf"))
    ap.add_argument("--drafter", default=os.environ.get("DDTREE_BENCH_DRAFTER", DEFAULT_DRAFTER))
    ap.add_argument("--data", default=os.environ.get("DDTREE_BENCH_DATA", "/opt/smollm2-fixture/data"))
    ap.add_argument("--suite", choices=["fixture", "cost8b"], default="fixture",
                    help="fixture: --target and --drafter; cost8b: Qwen3-8B's shape and a "
                         "drafter of DFlash-8B's shape, dummy weights, random prompts "
                         "(bench/run.py --suite cost8b)")
    ap.add_argument("--prompt-set", default=None,
                    help="default: humaneval (fixture), random (cost8b)")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--steady-requests", type=int, default=0, metavar="N",
                    help="profile a constant-concurrency cell of N requests (N > "
                         "--batch-size), --batch-size in flight, instead of one wave")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature (T > 0: each request seeded as in bench/run.py)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--trace", action="store_true", help="also write the Chrome trace (gzip)")
    ap.add_argument("--sync-stacks", action="store_true",
                    help="one more pass with Python stacks: where the host waits for the GPU")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--engine-process", choices=["inproc", "mp"], default="inproc",
                    help="inproc: cProfile + torch.profiler in this process; mp: the engine "
                         "core in its own process, traced by vLLM's profiler")
    ap.add_argument("--summarize-trace", metavar="TRACE",
                    help="no GPU run: summarise a Chrome trace written earlier (--trace) into "
                         "<out-dir>/kernels-<name>.json, every kernel per step")
    ap.add_argument("--steps", type=int, default=None,
                    help="with --summarize-trace: engine steps in the trace")
    ap.add_argument("--compare-kernels", nargs=2, metavar=("BASE", "OTHER"),
                    help="no GPU run: two profile-<config>.json files of this script -> "
                         "<out-dir>/kernel-diff-<base>-vs-<other>.json, what OTHER's step "
                         "costs beyond BASE's, kernel by kernel")
    args = ap.parse_args(argv)
    if args.compare_kernels:
        os.makedirs(args.out_dir, exist_ok=True)
        base, other = (read_json(p) for p in args.compare_kernels)
        diff = compare_kernels(base, other)
        name = f"kernel-diff-{file_stem(str(diff['base']))}-vs-{file_stem(str(diff['other']))}.json"
        with open(os.path.join(args.out_dir, name), "w") as f:
            json.dump(diff, f, indent=1)
        print(json.dumps({k: diff[k] for k in ("base", "other", "gpu_busy_ms_per_step",
                                                "kernel_us_per_step")}))
        for row in diff["kernels"][:15]:
            print(f"{row['diff_us']:+9.2f} us  {row['name'][:110]}")
        return 0
    if args.summarize_trace:
        if not args.steps or args.steps < 1:
            raise SystemExit("--summarize-trace needs --steps >= 1")
        os.makedirs(args.out_dir, exist_ok=True)
        summary = summarize_chrome_trace(read_json(args.summarize_trace), args.steps, top=10_000)
        name = os.path.basename(args.summarize_trace).split(".")[0]
        summary.update(trace=os.path.basename(args.summarize_trace), steps=args.steps)
        with open(os.path.join(args.out_dir, f"kernels-{file_stem(name)}.json"), "w") as f:
            json.dump(summary, f, indent=1)
        return 0
    # Read by vLLM when an engine starts.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.engine_process == "mp" else "0"
    for c in args.configs:
        # bad names, and FULL graphs on FlashAttention, fail before any GPU work
        refuse_full_graphs_on_flash_attention(parse_config(c), None)
    if args.batch_size < 1:
        raise SystemExit("--batch-size must be >= 1")
    if args.steady_requests and args.steady_requests <= args.batch_size:
        raise SystemExit(f"--steady-requests must exceed --batch-size ({args.batch_size}): "
                         f"got {args.steady_requests}")
    os.makedirs(args.out_dir, exist_ok=True)
    args.dummy = args.suite == "cost8b"
    if args.prompt_set is None:
        args.prompt_set = "random" if args.dummy else "humaneval"
    tok = None
    if args.dummy:
        import tempfile

        args.target, args.drafter = make_8b_models(tempfile.mkdtemp())
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.target)
    prompts = load_prompt_sets([args.prompt_set], args.data, tok,
                               max(args.batch_size, args.steady_requests))[args.prompt_set]
    results = []
    for name in args.configs:
        try:
            run = profile_config_mp if args.engine_process == "mp" else profile_config
            rec = run(args, name, prompts)
        except Exception as exc:  # record and go on
            rec = {"config": name, "error": repr(exc)[:2000],
                   "traceback": traceback.format_exc()[-4000:]}
        results.append(rec)
        with open(os.path.join(args.out_dir, f"profile-{file_stem(name)}.json"), "w") as f:
            json.dump(rec, f, indent=1)
        tp = rec.get("torch_profile", {})
        print(json.dumps({"config": name, **rec.get("plain", {}),
                          "gpu_busy_fraction": tp.get("gpu_busy_fraction"),
                          "gpu_busy_ms_per_step": tp.get("gpu_busy_ms_per_step"),
                          "error": rec.get("error")}), flush=True)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
