"""Which Triton kernels still compile while an engine serves? (GPU host)

vLLM's V2 runner compiles its Triton kernels in a start-up warm-up (one prefill and
one decode step at the largest batch), then its JIT monitor logs every kernel that
compiles during inference: a latency spike for the request that meets it, and an
error under ``--jit-monitor-mode error``. Triton compiles a kernel again for each
new specialisation of its arguments (an integer equal to 1 or divisible by 16, a
new ``constexpr`` such as a block size), so a warm-up at one batch size leaves the
others to the first requests that reach them. The engine logs of
``bench/results/2026-11-30-flash-attn-full-graphs-pristine-check/``
showed four kernels compiling at the first tree steps of every DDTree engine.

This starts one engine of a benchmark config (``bench/run.py`` names) with the
monitor verbose, sends a wave of requests at each batch size in turn, and records
every compile event with the batch size during which it happened (the engine's log
lines, in order, between markers this script writes):

    python bench/check_jit_during_serving.py --target /opt/smollm2-hf \\
        --drafter bench/fixture/smollm2-dflash --config ddtree-b64-t512 \\
        --out $OUT/jit-during-serving-ddtree.json

``--fail-on-compile`` exits 1 when any kernel compiled after the warm-up.

The monitor cuts Triton's key short, so the engine also runs with
``bench/jit_key_hook/sitecustomize.py``, which prints each compilation's whole key
(start-up ones included); the report's ``keys`` lists them by phase and
``varying_args`` names, for each kernel compiled more than once, the arguments and
constexprs whose specialisation differed between its compilations (what a warm-up has
to cover).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MARKER = "JITCHECK-PHASE"
KEY_HOOK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jit_key_hook")
KEY_MARKER = "JITCHECK-KEY"  # bench/jit_key_hook/sitecustomize.py's lines
# vllm/utils/jit_monitor.py: "<backend> <event> during inference: <name>[ (<detail>)]. ..."
_EVENT = re.compile(r"(?P<backend>Triton|CuTeDSL|TileLang) (?P<event>[\w ]+?) during "
                    r"inference: (?P<name>[\w.<>]+)(?: \((?P<detail>.*)\))?\. This causes")
_AUTOTUNE = re.compile(r"Triton autotuning for function (?P<name>\w+)")
DEFAULT_BATCH_SIZES = (1, 2, 3, 4, 8, 16, 17, 32, 48, 64)


def parse_log(lines: list[str]) -> dict:
    """Compile events of an engine log, each with the phase (marker) it fell in.
    Events before the first marker belong to phase "start-up" (after the warm-up
    the monitor only activates once the engine is ready)."""
    phase = "start-up"
    events: list[dict] = []
    keys: list[dict] = []
    for line in lines:
        if MARKER in line:
            phase = line.split(MARKER, 1)[1].strip()
            continue
        if KEY_MARKER in line:
            try:
                key = json.loads(line.split(KEY_MARKER, 1)[1])
            except json.JSONDecodeError:
                key = {"error": "unreadable key line"}
            keys.append({"phase": phase, **key})
            continue
        m = _EVENT.search(line)
        if m:
            events.append({"phase": phase, "backend": m["backend"], "event": m["event"],
                           "kernel": m["name"], "detail": m["detail"]})
            continue
        m = _AUTOTUNE.search(line)
        if m:
            events.append({"phase": phase, "backend": "Triton", "event": "autotuning",
                           "kernel": m["name"], "detail": None})
    return {"events": events,
            "compiles_by_kernel": dict(Counter(e["kernel"] for e in events)),
            "compiles_by_phase": dict(Counter(e["phase"] for e in events)),
            "total": len(events),
            "keys": keys,
            "varying_args": varying_args(keys)}


def varying_args(keys: list[dict]) -> dict[str, dict[str, list]]:
    """For each kernel compiled more than once (start-up included): every argument or
    constexpr whose specialisation was not the same in all its compilations, with the
    values seen, in order of first appearance."""
    by_kernel: dict[str, list[dict]] = {}
    for key in keys:
        if "kernel" in key:
            by_kernel.setdefault(key["function"], []).append(
                {**key.get("args", {}), **key.get("constexprs", {})})
    out: dict[str, dict[str, list]] = {}
    for function, specs in by_kernel.items():
        names = dict.fromkeys(name for spec in specs for name in spec)
        varying = {}
        for name in names:
            seen = list(dict.fromkeys(json.dumps(spec.get(name)) for spec in specs))
            if len(seen) > 1:
                varying[name] = [json.loads(v) for v in seen]
        if varying:
            out[function.rsplit(".", 1)[-1]] = varying
    return out


def serve(args) -> None:
    """The engine side (a child process): markers on stderr, one wave a batch size."""
    from vllm import LLM, SamplingParams

    from bench.check_graph_mode_outputs import prompts
    from bench.run import config_engine_kwargs, engine_environment, parse_config

    cfg = parse_config(args.config)
    kw = dict(model=args.target, speculative_config=cfg.speculative_config(args.drafter),
              dtype=args.dtype, seed=0, max_model_len=2048,
              max_num_seqs=max(args.batch_sizes), gpu_memory_utilization=0.3,
              jit_monitor_mode="warn", jit_monitor_verbose=True)
    kw.update(config_engine_kwargs(cfg))
    with engine_environment(dict(cfg.env)):
        llm = LLM(**kw)
    for i, batch in enumerate(args.batch_sizes):
        print(f"{MARKER} batch={batch}", file=sys.stderr, flush=True)
        params = [SamplingParams(temperature=float(j % 2), max_tokens=args.max_tokens,
                                 ignore_eos=True, seed=j)
                  for j in range(batch)]
        # Token-id prompts of 40-120 tokens, another set at each batch size.
        llm.generate([{"prompt_token_ids": p} for p in prompts(batch, seed=i, lengths=(40, 120))],
                     params,
                     use_tqdm=False)
    print(f"{MARKER} done", file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--config", default="ddtree-b64-t512")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=list(DEFAULT_BATCH_SIZES))
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--out")
    ap.add_argument("--log", help="the engine's whole log (default: beside --out)")
    ap.add_argument("--fail-on-compile", action="store_true")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if any(b < 1 for b in args.batch_sizes):
        ap.error("--batch-sizes must be >= 1")
    if args.serve:
        serve(args)
        return 0
    if not args.out:
        ap.error("--out is required")
    from bench.run import parse_config

    try:
        parse_config(args.config)
    except ValueError as e:
        ap.error(str(e))
    cmd = [sys.executable, os.path.abspath(__file__), "--serve", "--target", args.target,
           "--drafter", args.drafter, "--config", args.config, "--max-tokens",
           str(args.max_tokens), "--dtype", args.dtype, "--batch-sizes",
           *map(str, args.batch_sizes)]
    python_path = [KEY_HOOK_DIR, *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "JITCHECK_KEYS": "1", "PYTHONPATH": os.pathsep.join(python_path)}
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=args.timeout_s, env=env)
        text, rc = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout or ""
        text = out.decode(errors="replace") if isinstance(out, bytes) else out
        rc = None
    log_path = args.log or os.path.splitext(args.out)[0] + ".log"
    with open(log_path, "w") as f:
        f.write(text)
    lines = text.splitlines()
    report = parse_log(lines)
    finished = any(f"{MARKER} done" in ln for ln in lines)
    report.update(config=args.config, batch_sizes=args.batch_sizes, returncode=rc,
                  finished=finished, command=" ".join(sys.argv))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"{args.config}: finished={finished} rc={rc} compiles after warm-up: "
          f"{report['total']} {report['compiles_by_phase']}", flush=True)
    for e in report["events"]:
        print(f"  [{e['phase']}] {e['kernel']}: {(e['detail'] or '')[:600]}", flush=True)
    keys = report["keys"]
    print(f"whole keys recorded: {len(keys)} "
          f"({sum(k['phase'] == 'start-up' for k in keys)} at start-up)", flush=True)
    if not keys:
        print("  none: the key hook did not run in the engine (was Triton's "
              "jit_post_compile_hook replaced?); varying_args is empty for that reason",
              flush=True)
    for kernel, varying in report["varying_args"].items():
        print(f"  {kernel} compiled with differing {json.dumps(varying)}", flush=True)
    if not finished:
        return 2
    return 1 if args.fail_on_compile and report["total"] else 0


if __name__ == "__main__":
    sys.exit(main())
