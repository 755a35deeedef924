"""Benchmark harness: no speculation vs the DFlash chain vs DDTree, in one run.

Runs on the GPU host with the series applied (``./apply.sh --site``) and vLLM on
PYTHONPATH. One vLLM engine per configuration (CUDA graphs on unless ``--eager``);
inside it every cell of (prompt set x temperature x batch size). A cell submits its
requests in waves of ``batch`` concurrent requests (``LLM.generate`` of one wave),
so ``batch`` is the number of requests decoding together.

Suites:
  fixture  SmolLM2-135M-Instruct + the committed DFlash drafter; HumanEval and
           held-out ShareGPT prompts; batch 1/4/16/64; T=0 and T=1.
  ci       a small slice of ``fixture`` in float32 for the GPU regression job
           (``ci/check_regression.py`` reads its JSON; format in ci/README.md).
  cost8b   Qwen3-8B's shape with dummy weights and a drafter of DFlash-8B's shape:
           only the cost of a step means anything there (drafts are random and
           nearly never accepted), so it reports time per engine step against the
           number of tokens verified per target forward.

    python bench/run.py --suite fixture --target /opt/smollm2-hf \
        --drafter bench/fixture/smollm2-dflash --data /opt/smollm2-fixture/data \
        --out $OUT/bench-fixture.json

Per cell it records: tau (mean tokens per target forward = 1 + accepted/drafts, from
vLLM's spec-decode counters), per-depth acceptance (vLLM's per-position counter: for
a tree, position i counts steps whose accepted path reached depth i + 1), output
tokens/s, mean time per output token, p50/p99 request latency, and at T=0 whether
the outputs equal the no-speculation outputs of the same cell token for token.

The JSON is rewritten after every cell, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import itertools
import json
import math
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file: make `bench` and `vllm_ddtree` importable
from bench.stats import percentile  # noqa: E402
DEFAULT_DRAFTER = os.path.join(ROOT, "bench", "fixture", "smollm2-dflash")
DFLASH_CHAIN_TOKENS = 15  # a block-16 drafter predicts 15 tokens per pass


# ----------------------------------------------------------------------------- configs
@dataclass(frozen=True)
class BenchConfig:
    """One engine: ``no-spec``, ``dflash`` (the chain, K=15) or ``ddtree-b<B>``;
    a ``-t<T>`` suffix makes the budget batch-aware: about T verified tokens per
    forward (:mod:`vllm_ddtree.budget`; for the chain, the same rule caps K;
    ``-tauto``: T measured at start-up, DDTree only, :mod:`vllm_ddtree.cost_model`); a
    ``-d<N>`` suffix stops drafting from N running requests on (budget 0:
    ``ddtree_disable_by_batch_size``; for the chain, the same schedule). DDTree's
    ``-d1`` never drafts (every step at budget 0, as vLLM's
    ``num_speculative_tokens_per_batch_size`` ``[[1, OPEN_END, 0]]``, which caps the
    online controller at 0 too): the budget-0 step at batch 1, for profiling it."""

    name: str
    method: str | None
    num_speculative_tokens: int = 0
    tokens_per_step: int | str | None = None  # "auto": measured at start-up (DDTree)
    disable_by_batch_size: int | None = None
    # Environment for the engine (its engine-core process inherits it at start).
    env: tuple[tuple[str, str], ...] = ()
    # Extra engine arguments (name, value), e.g. another attention backend.
    engine_args: tuple[tuple[str, object], ...] = ()
    # DDTree's online budget controller (None: the engine's default, on).
    online_budget: bool | None = None

    def speculative_config(self, drafter: str) -> dict | None:
        if self.method is None:
            return None
        spec = {
            "method": self.method,
            "model": drafter,
            "num_speculative_tokens": self.num_speculative_tokens,
        }
        if self.method == "ddtree":
            if self.tokens_per_step is not None:
                spec["ddtree_tokens_per_step"] = self.tokens_per_step
            if self.disable_by_batch_size == 1:
                from vllm_ddtree.budget import OPEN_END

                # ddtree_disable_by_batch_size refuses 1 (a user would never draft).
                spec["num_speculative_tokens_per_batch_size"] = [[1, OPEN_END, 0]]
            elif self.disable_by_batch_size is not None:
                spec["ddtree_disable_by_batch_size"] = self.disable_by_batch_size
            if self.online_budget is not None:
                spec["ddtree_online_budget"] = self.online_budget
            return spec
        from vllm_ddtree.budget import batch_budget_schedule

        schedule = batch_budget_schedule(self.tokens_per_step, self.num_speculative_tokens,
                                         self.disable_by_batch_size)
        if schedule is not None:
            spec["num_speculative_tokens_per_batch_size"] = [list(r) for r in schedule]
        return spec


# Name suffixes that set an engine environment variable, so that two engines differing
# only in it can be measured side by side (e.g. ddtree-b64-t512 ddtree-b64-t512+tritonlaunch;
# the direct launcher is on by default, "+direct" names it explicitly).
CONFIG_FLAGS = {"direct": ("VLLM_DDTREE_DIRECT_LAUNCH", "1"),
                "tritonlaunch": ("VLLM_DDTREE_DIRECT_LAUNCH", "0"),
                # drafter logits and tree bounded by the step's budget (opt-in) ...
                "lean": ("VLLM_DDTREE_LEAN_DRAFT", "1"),
                # ... or the full tree at every batch size (the default)
                "fulldraft": ("VLLM_DDTREE_LEAN_DRAFT", "0"),
                # the drafter's context store eager, as in vLLM (graphs are the default)
                "eagerctx": ("VLLM_DDTREE_CONTEXT_GRAPHS", "0"),
                # trees verified on FlashAttention (context call + tree kernel, opt-in)
                "flashtree": ("VLLM_DDTREE_TREE_ATTENTION", "flash"),
                # the drafter's context buffered while drafting is off (the default) ...
                "defer": ("VLLM_DDTREE_DEFER_CONTEXT", "1"),
                # ... or stored every step
                "storectx": ("VLLM_DDTREE_DEFER_CONTEXT", "0"),
                # the unfused (torch) tree kernels instead of the fused Triton ones
                "unfused": ("VLLM_DDTREE_FUSED_KERNELS", "0"),
                # FULL decode graphs of one token a request, without the tree bias,
                # beside the mixed graphs (opt-in)
                "q1graphs": ("VLLM_DDTREE_SINGLE_TOKEN_GRAPHS", "1")}


# Name suffixes that set an engine argument instead: "no-spec+tritonattn" is plain
# decoding on the attention backend DDTree verifies on, which separates the backend's
# cost from speculation's.
# Values are tuples of pairs (hashable, like the config); the engine gets a dict.
# "+cg1024" / "+cg2048": CUDA graphs captured up to that many tokens (vLLM's default
# stops at 512, or 2 x max_num_seqs for plain decoding): a step that prefills a joining
# request beside 512 tokens of trees is larger and otherwise runs without a graph.
# "+cgfull": cudagraph_mode FULL, one whole-forward graph for every batch up to the
# largest size, mixed (prefilling) steps included; vLLM's default FULL_AND_PIECEWISE
# replays mixed steps piecewise, launching each layer's attention from the host.
# On FLASH_ATTN the series' patch 10 turns FULL into FULL_AND_PIECEWISE inside the
# engine core (FA3's FULL graphs gave wrong tokens for prefills:
# bench/results/2026-11-30-flash-attn-full-graphs-pristine-check/graph-mode-outputs-pristine.json);
# the engine row records the mode the front end asked for.
# Flags that set the same argument merge ("+cgfull+cg1024").
CONFIG_ENGINE_FLAGS = {"tritonattn": ("attention_config", (("backend", "TRITON_ATTN"),)),
                       **{f"cg{n}": ("compilation_config", (("max_cudagraph_capture_size", n),))
                          for n in (1024, 2048)},
                       "cgfull": ("compilation_config", (("cudagraph_mode", "FULL"),)),
                       # vLLM's default mode, e.g. DDTree before patch 9 made it FULL
                       "cgpiecewise": ("compilation_config",
                                       (("cudagraph_mode", "FULL_AND_PIECEWISE"),))}


# "+static": DDTree without its online budget controller (ddtree_online_budget=False):
# every step verifies the configured budget or schedule, as before the controller.
CONFIG_SPEC_FLAGS = {"static": False}


def parse_config(name: str) -> BenchConfig:
    core, *flags = name.split("+")
    known = set(CONFIG_FLAGS) | set(CONFIG_ENGINE_FLAGS) | set(CONFIG_SPEC_FLAGS)
    unknown = [f for f in flags if f not in known]
    if unknown:
        raise ValueError(f"unknown benchmark config {name!r}: flags {unknown} "
                         f"(known: {sorted(known)})")
    cfg = _parse_core_config(core)
    if any(f in CONFIG_SPEC_FLAGS for f in flags) and cfg.method != "ddtree":
        raise ValueError(f"benchmark config {name!r}: +static is DDTree's")
    online = next((CONFIG_SPEC_FLAGS[f] for f in flags if f in CONFIG_SPEC_FLAGS), None)
    return replace(cfg, name=name, online_budget=online,
                   env=tuple(CONFIG_FLAGS[f] for f in flags if f in CONFIG_FLAGS),
                   engine_args=tuple(CONFIG_ENGINE_FLAGS[f] for f in flags
                                     if f in CONFIG_ENGINE_FLAGS))


def full_graphs_on_flash_attention(cfg: BenchConfig, attention_backend: str | None) -> bool:
    """Whether ``cfg`` asks for FULL CUDA graphs (``+cgfull``) on FlashAttention: plain
    decoding and the chain run FLASH_ATTN on Hopper unless ``+tritonattn`` or
    ``--attention-backend`` says otherwise; DDTree runs TRITON_ATTN unless
    ``+flashtree``."""
    engine = config_engine_kwargs(cfg)
    if engine.get("compilation_config", {}).get("cudagraph_mode") != "FULL":
        return False
    backend = engine.get("attention_config", {}).get("backend") or attention_backend
    if backend is not None:
        return backend == "FLASH_ATTN"
    if cfg.method == "ddtree":
        return dict(cfg.env).get("VLLM_DDTREE_TREE_ATTENTION") == "flash"
    return True


def refuse_full_graphs_on_flash_attention(cfg: BenchConfig,
                                          attention_backend: str | None) -> None:
    """SystemExit for a config :func:`full_graphs_on_flash_attention` flags."""
    if full_graphs_on_flash_attention(cfg, attention_backend):
        raise SystemExit(
            f"config {cfg.name}: cudagraph_mode FULL on FLASH_ATTN computes wrong tokens "
            "for prefills on vLLM 0.26's V2 runner (docs/benchmarks.md, "
            "bench/results/2026-11-30-flash-attn-full-graphs-pristine-check/), "
            "and the series' patch 10 turns it into FULL_AND_PIECEWISE: no baseline. "
            "For a plain engine with FULL graphs add +tritonattn "
            "(e.g. no-spec+tritonattn+cgfull+cg1024).")


_CONFIG_NAME = re.compile(r"(?P<base>no-spec|dflash|ddtree-b(?P<budget>\d+))"
                          r"(?:-t(?P<tokens>\d+|auto))?(?:-d(?P<disable>\d+))?")


def _parse_core_config(name: str) -> BenchConfig:
    m = _CONFIG_NAME.fullmatch(name)
    if m is None or (m["base"] == "no-spec" and (m["tokens"] or m["disable"])) or (
        m["budget"] is not None and int(m["budget"]) < 1
    ):
        raise ValueError(
            f"unknown benchmark config {name!r}: use no-spec, dflash[-t<T>][-d<N>] or "
            "ddtree-b<budget>[-t<T>][-d<N>] (e.g. ddtree-b32, ddtree-b64-t512, "
            "ddtree-b64-t512-d16)"
        )
    if m["tokens"] == "auto" and m["base"] == "dflash":
        raise ValueError(f"bad benchmark config {name!r}: -tauto (the token target "
                         "measured at start-up) is DDTree's; give the chain a number")
    tokens = m["tokens"] if m["tokens"] == "auto" else int(m["tokens"]) if m["tokens"] else None
    if isinstance(tokens, int) and tokens < 2:
        raise ValueError(f"bad benchmark config {name!r}: -t<tokens per step> needs "
                         "an integer >= 2")
    disable = int(m["disable"]) if m["disable"] else None
    never = disable == 1 and m["base"] != "dflash" and tokens is None
    if disable is not None and disable < 2 and not never:
        raise ValueError(f"bad benchmark config {name!r}: -d<first batch size without "
                         "drafts> needs an integer >= 2 (DDTree's -d1, without -t: "
                         "never drafting)")
    if m["base"] == "no-spec":
        return BenchConfig(name, None)
    if m["base"] == "dflash":
        return BenchConfig(name, "dflash", DFLASH_CHAIN_TOKENS, tokens, disable)
    return BenchConfig(name, "ddtree", int(m["budget"]), tokens, disable)


@dataclass
class Suite:
    configs: list[str]
    batch_sizes: list[int]
    prompt_sets: list[str]
    temperatures: list[float]
    max_tokens: int
    min_requests: int
    dtype: str
    dummy: bool = False


SUITES: dict[str, Suite] = {
    "fixture": Suite(
        configs=["no-spec", "dflash", "ddtree-b16", "ddtree-b32", "ddtree-b64"],
        batch_sizes=[1, 4, 16, 64],
        prompt_sets=["humaneval", "sharegpt"],
        temperatures=[0.0, 1.0],
        max_tokens=128,
        min_requests=8,
        dtype="bfloat16",
    ),
    "ci": Suite(
        configs=["no-spec", "dflash", "ddtree-b32"],
        batch_sizes=[1, 16],
        prompt_sets=["humaneval"],
        temperatures=[0.0],
        max_tokens=96,
        min_requests=8,
        dtype="float32",
    ),
    "cost8b": Suite(
        configs=["dflash", "ddtree-b64-t128", "ddtree-b64", "no-spec"],
        batch_sizes=[1, 4, 16, 64],
        prompt_sets=["random"],
        temperatures=[0.0],
        max_tokens=64,
        min_requests=4,
        dtype="bfloat16",
        dummy=True,
    ),
}


# ----------------------------------------------------------------------------- pure helpers
def requests_for(batch: int, min_requests: int, min_waves: int = 1) -> int:
    """Whole waves of ``batch`` requests, at least ``min_requests`` in all and at least
    ``min_waves`` waves (in a steady cell: generations of requests)."""
    waves = max(1, min_waves, math.ceil(min_requests / batch))
    return waves * batch


# Generations of requests in the untimed steady cell that warms each batch size up.
STEADY_WARMUP_WAVES = 2
# The share of GPU memory the engines of an interleaved round (--interleave) take in
# all, split evenly unless --gpu-memory-utilization is given.
INTERLEAVED_MEMORY = 0.9


def cycled(prompts: list, n: int) -> list:
    """``n`` prompts, the set repeated when it has fewer."""
    return [prompts[i % len(prompts)] for i in range(n)]


@dataclass
class SpecCounters:
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_pos: list[int] = field(default_factory=list)

    def minus(self, before: "SpecCounters") -> "SpecCounters":
        return self._combine(before, -1)

    def plus(self, other: "SpecCounters") -> "SpecCounters":
        return self._combine(other, 1)

    def _combine(self, other: "SpecCounters", sign: int) -> "SpecCounters":
        n = max(len(self.per_pos), len(other.per_pos))
        a = self.per_pos + [0] * (n - len(self.per_pos))
        b = other.per_pos + [0] * (n - len(other.per_pos))
        return SpecCounters(
            self.drafts + sign * other.drafts,
            self.draft_tokens + sign * other.draft_tokens,
            self.accepted + sign * other.accepted,
            [x + sign * y for x, y in zip(a, b)],
        )

    def summary(self) -> dict:
        if self.drafts <= 0:
            return {}
        depth = [round(x / self.drafts, 4) for x in self.per_pos]
        while depth and depth[-1] == 0:
            depth.pop()
        return {
            "tau": round(1.0 + self.accepted / self.drafts, 4),
            "accepted_tokens_per_step": round(self.accepted / self.drafts, 4),
            "num_drafts": self.drafts,
            "draft_tokens_per_step": round(self.draft_tokens / self.drafts, 2),
            "acceptance_by_depth": depth,
        }


def all_steps_fields(entry: dict) -> dict:
    """Drafting over every step of a cell, not only the steps that drafted (with
    drafting off at large batches, ``-d<N>``, most steps verify no drafts).

    Each request-step emits one token plus its accepted drafts, so the cell's
    request-steps are its output tokens minus the accepted ones.
    ``drafting_share``: the fraction of request-steps that verified drafts;
    ``verified_tokens_per_forward_all_steps``: batch x (1 + drafts per request-step).
    Empty when the entry lacks the counters."""
    try:
        drafts = entry["num_drafts"]
        return all_steps_from_counts(
            entry["batch_size"], drafts, entry["accepted_tokens_per_step"] * drafts,
            entry["draft_tokens_per_step"] * drafts,
            entry["output_tokens"] * entry.get("repeats", 1))
    except (KeyError, TypeError):
        return {}


def all_steps_from_counts(batch: int, drafts: float, accepted: float, draft_tokens: float,
                          outputs: int) -> dict:
    """:func:`all_steps_fields` from the counts themselves (exact while a run records
    its cells; from a result row's rounded per-step fields otherwise)."""
    steps = outputs - accepted
    if steps <= 0:
        return {}
    return {"drafting_share": round(drafts / steps, 4),
            "verified_tokens_per_forward_all_steps": round(batch * (1 + draft_tokens / steps), 1)}


def engine_spec_counters(llm) -> SpecCounters:
    """This engine's spec-decode counters, read from its own Prometheus stat logger.

    vLLM keeps one Prometheus registry per process, and every engine's logger
    unregisters the metrics already there when it starts (``unregister_vllm_metrics``),
    so with several engines alive in one process (``--interleave``) ``LLM.get_metrics()``
    reads the last-started engine's counters only: the others' cells got no tau and no
    drafting share. Each logger still holds and counts its own; an engine without one
    (no spec decoding, or a vLLM laid out otherwise) falls back to the registry."""
    manager = getattr(getattr(llm, "llm_engine", None), "logger_manager", None)
    for logger in getattr(manager, "stat_loggers", None) or []:
        prom = getattr(logger, "spec_decoding_prom", None)
        if prom is None:
            continue
        if not getattr(prom, "spec_decoding_enabled", False):
            return SpecCounters()
        try:
            return SpecCounters(
                int(sum(_child_value(c) for c in prom.counter_spec_decode_num_drafts.values())),
                int(sum(_child_value(c)
                        for c in prom.counter_spec_decode_num_draft_tokens.values())),
                int(sum(_child_value(c)
                        for c in prom.counter_spec_decode_num_accepted_tokens.values())),
                [int(sum(vals)) for vals in zip(*(
                    [_child_value(c) for c in per_pos] for per_pos in
                    prom.counter_spec_decode_num_accepted_tokens_per_pos.values()))])
        except (AttributeError, TypeError):
            break  # laid out otherwise (another vLLM): the registry, as before
    return spec_counters(llm.get_metrics())


def _child_value(counter) -> float:
    """A labelled Prometheus counter's value, from its own samples (registered or not)."""
    return sum(s.value for metric in counter.collect() for s in metric.samples
               if s.name.endswith("_total"))


def spec_counters(metrics) -> SpecCounters:
    """vLLM's spec-decode counters from ``LLM.get_metrics()`` (summed over engines)."""
    c = SpecCounters()
    for m in metrics:
        if m.name == "vllm:spec_decode_num_drafts":
            c.drafts += int(m.value)
        elif m.name == "vllm:spec_decode_num_draft_tokens":
            c.draft_tokens += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            c.accepted += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = [int(v) for v in m.values]
            if len(vals) > len(c.per_pos):
                c.per_pos += [0] * (len(vals) - len(c.per_pos))
            for i, v in enumerate(vals):
                c.per_pos[i] += v
    return c


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two outputs differ (a length difference counts
    at the shorter one's end); None if they are equal."""
    if a == b:
        return None
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare_greedy(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    """Token-for-token comparison with the no-speculation outputs of the same cell."""
    same = sum(a == b for a, b in zip(outputs, reference))
    first = None
    for i, (a, b) in enumerate(zip(outputs, reference)):
        pos = first_difference(a, b)
        if pos is not None:
            first = {"request": i, "token": pos}
            break
    total = len(reference)
    return {
        "greedy_match": same == total and len(outputs) == total,
        "greedy_identical": same,
        "greedy_total": total,
        "greedy_first_difference": first,
    }


def greedy_exact(dtype: str, eager: bool) -> bool:
    """Whether greedy outputs must equal the no-speculation ones token for token.

    Only float32 without CUDA graphs (every run so far identical,
    ``gpu-equiv-real-fp32-eager.json``). With CUDA graphs and torch.compile, float32
    logits still differ in the last bits between token counts per forward; near-ties
    then flip, for the DFlash chain as for DDTree (``ci-fp32-graphs.json``). vLLM's
    batch-invariant kernels do not make it exact either: a tree verification reads a
    node's ancestors from other KV slots than sequential decoding, so its attention
    rounds differently (bf16, batch 1: the chain identical, DDTree not;
    ``bench/results/exact/``). There the match rate is reported, not gated."""
    return eager and dtype in ("float32", "fp32")


def strip_inexact_greedy(results: list[dict], exact: bool) -> list[dict]:
    """Result rows with ``greedy_match`` kept only when the run was exact."""
    if exact:
        return results
    return [{k: v for k, v in r.items() if k != "greedy_match"} for r in results]


def greedy_fields(outputs: list[list[int]], reference: list[list[int]], exact: bool) -> dict:
    """:func:`compare_greedy`'s fields for a result row, ``greedy_match`` only if exact."""
    return strip_inexact_greedy([compare_greedy(outputs, reference)], exact)[0]


def cell_summary(
    outputs: list[list[int]],
    wall_s: float,
    latencies: list[float],
    tpots: list[float],
    ttfts: list[float] | None = None,
    wave_edges: list[tuple[float, float]] | None = None,
    ttft_splits: list[tuple[float, float]] | None = None,
    wave_outputs: list[list[float]] | None = None,
) -> dict:
    """A cell's figures. ``ttfts``: each request's engine-side time to first token
    (queued to first token); ``wave_edges``: per wave, the seconds from calling
    ``generate`` to the engine core queueing its first request, and from the engine's
    last token to ``generate`` returning (where a wave's time outside the engine's
    request lifetimes goes); ``ttft_splits``: per request, its time to first token in
    two parts, queued to first scheduled (``ttft_queued_p50_s``: waiting for a step to
    take it, e.g. behind the step already running when a wave's first request came)
    and first scheduled to first token (``ttft_scheduled_p50_s``: its prefill step and
    the output of it); ``wave_outputs``: per wave, the engine core's stamps of the
    steps that returned tokens, in seconds after the wave's first request was queued
    (:class:`OutputSteps`): when its first two steps' outputs came
    (``wave_first_output_ms``, ``wave_second_output_ms``: most first tokens of a wave
    come with one of them), the median time between later ones
    (``wave_output_step_ms_p50``) and how many steps a wave took
    (``wave_output_steps``), for every engine alike."""
    n_tokens = sum(len(o) for o in outputs)
    summary = {
        "num_requests": len(outputs),
        "output_tokens": n_tokens,
        "wall_s": round(wall_s, 4),
        "output_tokens_per_s": round(n_tokens / wall_s, 2) if wall_s > 0 else 0.0,
        "time_per_output_token_ms": round(sum(tpots) / len(tpots) * 1e3, 4) if tpots else None,
        "latency_p50_s": _r(percentile(latencies, 50)),
        "latency_p99_s": _r(percentile(latencies, 99)),
    }
    if ttfts:
        summary["ttft_p50_s"] = _r(percentile(ttfts, 50))
    if ttft_splits:
        summary["ttft_queued_p50_s"] = _r(percentile([a for a, _ in ttft_splits], 50))
        summary["ttft_scheduled_p50_s"] = _r(percentile([b for _, b in ttft_splits], 50))
    if wave_edges:
        summary["wave_start_gap_ms"] = _r(statistics.median(a for a, _ in wave_edges) * 1e3)
        summary["wave_end_gap_ms"] = _r(statistics.median(b for _, b in wave_edges) * 1e3)
    waves = [w for w in wave_outputs or () if w]
    if waves:
        summary["wave_output_steps"] = statistics.median(len(w) for w in waves)
        summary["wave_first_output_ms"] = _r(statistics.median(w[0] for w in waves) * 1e3)
        seconds = [w[1] for w in waves if len(w) > 1]
        if seconds:
            summary["wave_second_output_ms"] = _r(statistics.median(seconds) * 1e3)
        later = [b - a for w in waves for a, b in zip(w[2:], w[3:])]
        if later:
            summary["wave_output_step_ms_p50"] = _r(statistics.median(later) * 1e3)
    return summary


def cost_model(results: list[dict], max_slowdown: float = 1.15) -> dict | None:
    """Step cost against verified tokens per forward, and the knee that
    ``ddtree_tokens_per_step`` should use (:func:`vllm_ddtree.budget.knee_tokens`).

    A step emits tau tokens per request, so its cost is TPOT x tau (no speculation:
    TPOT, one token per request per step, ``batch`` tokens per forward)."""
    from vllm_ddtree.budget import knee_tokens

    points = []
    for r in results:
        tpot = r.get("time_per_output_token_ms")
        if not tpot:
            continue
        tokens = r.get("verified_tokens_per_forward") or (r["batch_size"] if not r.get("tau") else None)
        if not tokens:
            continue
        points.append({"config": r["config"], "batch_size": r["batch_size"],
                       "verified_tokens": tokens, "step_ms": round(tpot * (r.get("tau") or 1.0), 4)})
    if not points:
        return None
    knee = knee_tokens([(p["verified_tokens"], p["step_ms"]) for p in points], max_slowdown)
    return {"points": sorted(points, key=lambda p: p["verified_tokens"]),
            "max_slowdown": max_slowdown, "suggested_ddtree_tokens_per_step": knee}


def speculation_crossover(results: list[dict], baseline: str = "no-spec") -> dict | None:
    """Where plain decoding overtakes each speculative configuration of a run.

    For every configuration: tokens/s over ``baseline``'s by batch size (each cell,
    prompt set x temperature) and ``suggested_ddtree_disable_by_batch_size``, the
    smallest measured batch size from which the configuration is below the baseline
    in every cell of that and every larger measured batch size (None when it never
    is). A value for ``ddtree_disable_by_batch_size``; with one run per cell it
    inherits the run's noise, so read the ratios beside it."""
    base = {(r["prompt_set"], r["temperature"], r["batch_size"]): r["output_tokens_per_s"]
            for r in results if r["config"] == baseline and r.get("output_tokens_per_s")}
    if not base:
        return None
    out = {}
    for cfg in sorted({r["config"] for r in results} - {baseline}):
        by_batch: dict[int, list[float]] = {}
        for r in results:
            key = (r["prompt_set"], r["temperature"], r["batch_size"])
            if r["config"] == cfg and base.get(key) and r.get("output_tokens_per_s"):
                by_batch.setdefault(r["batch_size"], []).append(
                    round(r["output_tokens_per_s"] / base[key], 3))
        if not by_batch:
            continue
        suggestion = None
        for b in sorted(by_batch, reverse=True):
            if all(x < 1.0 for x in by_batch[b]):
                suggestion = b
            else:
                break
        if suggestion == min(by_batch):
            suggestion = max(suggestion, 2)  # a config below the baseline everywhere
        out[cfg] = {"ratio_to_baseline_by_batch_size": {str(b): by_batch[b] for b in sorted(by_batch)},
                    "suggested_ddtree_disable_by_batch_size": suggestion}
    return {"baseline": baseline, "configs": out}


REPEATED_FIELDS = ("wall_s", "output_tokens_per_s", "time_per_output_token_ms",
                   "latency_p50_s", "latency_p99_s", "ttft_p50_s", "ttft_queued_p50_s",
                   "ttft_scheduled_p50_s", "wave_start_gap_ms",
                   "wave_end_gap_ms", "wave_first_output_ms", "wave_second_output_ms",
                   "wave_output_step_ms_p50", "wave_output_steps",
                   "full_concurrency_tokens_per_s", "host_python_loop_ms")


def spread(values: list[float]) -> float | None:
    """(max - min) / median: how far repeated measurements of one thing scatter."""
    med = statistics.median(values)
    return round((max(values) - min(values)) / med, 4) if med else None


def merge_repeats(summaries: list[dict]) -> dict:
    """One cell measured ``len(summaries)`` times in a row on the same engine: the
    median of each timing field, every run's tokens/s, and their spread ((max - min)
    / median), so that a difference between configurations can be read against the
    noise of the cell itself. One summary is returned unchanged."""
    if not summaries:
        raise ValueError("merge_repeats needs at least one summary")
    if len(summaries) == 1:
        return summaries[0]
    merged = dict(summaries[0])
    for key in REPEATED_FIELDS:
        values = [s[key] for s in summaries if s.get(key) is not None]
        merged[key] = _r(statistics.median(values)) if values else None
    runs = [s["output_tokens_per_s"] for s in summaries]
    merged["output_tokens_per_s_runs"] = runs
    if any(s.get("host_python_loop_ms") is not None for s in summaries):
        merged["host_python_loop_ms_runs"] = [s.get("host_python_loop_ms") for s in summaries]
    merged["output_tokens_per_s_spread"] = spread(runs)
    merged["repeats"] = len(summaries)
    return merged


@dataclass
class CellRuns:
    """Every measured run of one cell (config, prompt set, batch size, temperature)
    over the engine rounds of a run (``--engine-rounds``): its row in the result, the
    runs' summaries, the median tokens/s of each engine, the spec counters summed
    over all runs and each round's greedy comparison."""
    row: int  # its index in the result's "results"
    summaries: list[dict] = field(default_factory=list)
    engine_tokens_per_s: list[float] = field(default_factory=list)
    counters: SpecCounters = field(default_factory=SpecCounters)
    greedy: list[dict] = field(default_factory=list)

    def add_engine(self, summaries: list[dict], counters: list[SpecCounters],
                   greedy: dict | None) -> None:
        self.summaries += summaries
        self.engine_tokens_per_s.append(
            _r(statistics.median(s["output_tokens_per_s"] for s in summaries), 2))
        for c in counters:
            self.counters = self.counters.plus(c)
        if greedy:
            self.greedy.append(greedy)

    def entry(self, config: str, method: str | None, prompt_set: str, batch: int,
              temperature: float) -> dict:
        """The cell's result row: :func:`merge_repeats` over every run of every engine
        (medians; ``repeats`` counts them all), the summed counters and, with more
        than one engine, each engine's tokens/s and their spread. Greedy fields: the
        engine with the fewest outputs identical to no speculation's."""
        entry = dict(config=config, prompt_set=prompt_set, batch_size=batch,
                     temperature=temperature, **merge_repeats(self.summaries),
                     **self.counters.summary())
        if len(self.engine_tokens_per_s) > 1:
            tps = self.engine_tokens_per_s
            entry["engine_rounds"] = len(tps)
            entry["output_tokens_per_s_engines"] = list(tps)
            entry["output_tokens_per_s_engine_spread"] = spread(tps)
        if method is not None and self.counters.drafts:
            # Each step verifies batch * (1 + drafts) tokens.
            c = self.counters
            entry["verified_tokens_per_forward"] = round(batch * (1 + c.draft_tokens / c.drafts), 1)
            entry.update(all_steps_from_counts(batch, c.drafts, c.accepted, c.draft_tokens,
                                               sum(s["output_tokens"] for s in self.summaries)))
        if self.greedy:
            entry.update(min(self.greedy, key=lambda g: g["greedy_identical"]))
        return entry


def round_order(configs: list, round_index: int) -> list:
    """Engine order of one round: as given in even rounds, reversed in odd ones (A B C,
    C B A, ...), so a drift of the machine over the run weighs on every configuration
    alike."""
    return list(configs) if round_index % 2 == 0 else list(reversed(configs))


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


# ----------------------------------------------------------------------------- prompts
PROMPT_FILES = {"humaneval": "humaneval.jsonl", "sharegpt": "sharegpt_bench.jsonl",
                "sharegpt-long": "sharegpt_bench.jsonl",
                "sharegpt-untrained": "sharegpt_train.jsonl"}
# sharegpt-untrained: the held-out set of the never-slower-than-plain-decoding results
# (bench/results/goals.json), fixed before the online budget controller was tuned and
# read only by final runs. ShareGPT first turns of the *training* split that the
# committed drafter never saw: its training kept prompts of at most
# DRAFTER_TRAINING_PROMPT_TOKENS (bench/results/drafter-training/train.log), these are
# longer (up to 768), and no benchmark before used them.
DRAFTER_TRAINING_PROMPT_TOKENS = 384
# sharegpt-long: held-out ShareGPT requests joined into one request of this many
# prompt tokens (chat template included), for attention over long contexts; with 128
# new tokens and a tree of up to 65 it stays inside --max-model-len 2048.
LONG_PROMPT_TOKENS = (1024, 1792)
LONG_PROMPT_HEADER = "Answer each of the following requests in turn.\n\n"


def chat_ids(tokenizer, text: str) -> list[int]:
    out = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def load_prompt_sets(names: list[str], data_dir: str | None, tokenizer, limit: int,
                     seed: int = 0) -> dict[str, list[list[int]]]:
    """Token ids per prompt set: the chat template applied to each prompt, as in
    training (``bench.fixture.train_dflash_drafter.Target.encode_chat``); prompts of
    at most 768 tokens, except ``sharegpt-long`` (:data:`LONG_PROMPT_TOKENS`); those of
    ``sharegpt-untrained`` are longer than the drafter's training prompts."""
    sets: dict[str, list[list[int]]] = {}
    for name in names:
        if name == "random":
            rng = random.Random(seed)
            sets[name] = [[rng.randrange(100, 30000) for _ in range(rng.randrange(64, 256))]
                          for _ in range(limit)]
            continue
        if data_dir is None:
            raise SystemExit(f"prompt set {name!r} needs --data (bench.fixture.prompts output)")
        file = PROMPT_FILES.get(name)
        if file is None:
            raise SystemExit(f"unknown prompt set {name!r}: use {', '.join(PROMPT_FILES)} "
                             "or random")
        path = os.path.join(data_dir, file)
        if not os.path.exists(path):
            raise SystemExit(f"{path} is missing (python -m bench.fixture.prompts builds it)")
        with open(path, encoding="utf-8") as f:
            texts = [json.loads(line)["prompt"] for line in f if line.strip()]
        shortest = DRAFTER_TRAINING_PROMPT_TOKENS + 1 if name == "sharegpt-untrained" else 0
        ids = (_long_prompts(tokenizer, texts, limit) if name == "sharegpt-long"
               else list(itertools.islice((out for out in (chat_ids(tokenizer, t) for t in texts)
                                           if shortest <= len(out) <= 768), limit)))
        sets[name] = ids
    return sets


def _long_prompts(tokenizer, texts: list[str], limit: int,
                  rotation: int = 13) -> list[list[int]]:
    """Consecutive prompts joined under :data:`LONG_PROMPT_HEADER` until the request
    has at least ``LONG_PROMPT_TOKENS[0]`` tokens; kept if at most the upper bound.
    When one pass gives too few (200 held-out ShareGPT prompts give ~9), further
    passes start ``rotation`` prompts later, so the groups differ; no request twice."""
    low, high = LONG_PROMPT_TOKENS
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for start in range(0, len(texts), rotation):
        parts: list[str] = []
        for text in texts[start:] + texts[:start]:
            parts.append(text)
            ids = chat_ids(tokenizer, LONG_PROMPT_HEADER + "\n\n".join(parts))
            if len(ids) < low:
                continue
            if len(ids) <= high and tuple(ids) not in seen:
                seen.add(tuple(ids))
                out.append(ids)
                if len(out) >= limit:
                    return out
            parts = []
    return out


# ----------------------------------------------------------------------------- 8B shapes
QWEN3_8B = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936,
    hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
    tie_word_embeddings=False, torch_dtype="bfloat16", hidden_act="silu",
    attention_bias=False,
)


def make_8b_models(root: str) -> tuple[str, str]:
    """Qwen3-8B's config and a drafter of DFlash-8B's shape (5 layers, block 16,
    five target layers), both for ``load_format="dummy"``."""
    target, drafter = os.path.join(root, "qwen3-8b-shape"), os.path.join(root, "dflash-8b-shape")
    os.makedirs(target, exist_ok=True)
    os.makedirs(drafter, exist_ok=True)
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump(QWEN3_8B, f)
    d = dict(QWEN3_8B, architectures=["DFlashDraftModel"], num_hidden_layers=5,
             block_size=16, dflash_config=dict(mask_token_id=151669,
                                               target_layer_ids=[1, 9, 17, 25, 33]))
    with open(os.path.join(drafter, "config.json"), "w") as f:
        json.dump(d, f)
    return target, drafter


# ----------------------------------------------------------------------------- GPU run
# What decides the measured code: our package, the series and the benchmark itself.
CODE_DIGEST_PATHS = ("vllm_ddtree", "patches", "bench/run.py")


def code_digest(root: str = ROOT) -> str:
    """sha256 (first 12 hex digits) over the files that decide what a run measures.
    Recorded beside ``git_rev``: a copied working tree may carry a stale ``.git``
    (the GPU host's copy did), while this digest is always of the files that ran."""
    h = hashlib.sha256()
    for rel in CODE_DIGEST_PATHS:
        path = os.path.join(root, rel)
        files = [path] if os.path.isfile(path) else sorted(
            os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs
            if not f.endswith((".pyc", ".pyo")) and "__pycache__" not in d)
        for f in files:
            h.update(os.path.relpath(f, root).encode() + b"\0")
            with open(f, "rb") as fh:
                h.update(fh.read())
            h.update(b"\0")
    return h.hexdigest()[:12]


def weights_digest(model_dir: str) -> str | None:
    """sha256 (first 12 hex digits) of a model directory's weight files, so that a
    result names the weights it measured: ``--drafter bench/fixture/smollm2-dflash``
    meant another drafter before the two-layer one was committed."""
    files = sorted(f for f in os.listdir(model_dir) if f.endswith((".safetensors", ".gguf")))
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        with open(os.path.join(model_dir, f), "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:12]


# A fixed pure-Python workload, timed before each engine: with the engine core's
# steps bound by the host (the same code and configuration stepped
# 1.35-1.66x faster on one GPU host than on another,
# bench/results/2026-11-30-steady-full-graphs-host-profile/),
# tokens/s from two calls compare two host CPUs as much as two engines. Its median time
# says how fast the host ran
# Python then; compare it before comparing numbers across calls.
HOST_LOOP_REPEATS = 5
HOST_LOOP_ITEMS = 200_000


def host_loop_ms(repeats: int = HOST_LOOP_REPEATS, items: int = HOST_LOOP_ITEMS) -> float:
    """Median wall time (ms) of a fixed loop of dict and list operations, the kind of
    work a scheduler step does."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        table: dict[int, list[int]] = {}
        for i in range(items):
            table.setdefault(i & 1023, []).append(i)
        sum(len(v) for v in table.values())
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 3)


def timed_on_this_host(cell_runner, *args):
    """``cell_runner(*args)`` with the host's speed just before it in the summary
    (``host_python_loop_ms``, :func:`host_loop_ms`): the loop took 24-50 ms within one
    call (``bench/results/2026-11-30-flash-attn-full-graphs-pristine-check/``),
    so a run's tokens/s is read beside its host's pace."""
    loop_ms = host_loop_ms()
    outs, summary, counters = cell_runner(*args)
    summary["host_python_loop_ms"] = loop_ms
    return outs, summary, counters


def host_info() -> dict:
    """The host CPU as a run's header records it: model name, CPUs this process may
    use, and :func:`host_loop_ms` at the start."""
    model = platform.processor() or None
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f
                          if ln.startswith("model name")), model)
    except OSError:
        pass
    usable = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
              else os.cpu_count())
    return {"cpu_model": model, "usable_cpus": usable, "python_loop_ms": host_loop_ms()}


def git_rev() -> str:
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def _engine(args, suite: Suite, target: str, drafter: str, cfg: BenchConfig):
    from vllm import LLM

    kw = dict(
        model=target,
        speculative_config=cfg.speculative_config(drafter),
        enforce_eager=args.eager,
        dtype=suite.dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        max_num_seqs=max(suite.batch_sizes),
        seed=0,
        disable_log_stats=False,
    )
    if args.async_scheduling != "auto":
        kw["async_scheduling"] = args.async_scheduling == "on"
    if args.attention_backend:
        # E.g. TRITON_ATTN for every engine: DDTree verifies on it, so greedy
        # comparisons then carry no backend rounding differences.
        kw["attention_config"] = {"backend": args.attention_backend}
    for key, value in config_engine_kwargs(cfg).items():
        if key in kw:
            raise ValueError(f"{cfg.name}: {key} is already set by the command line")
        kw[key] = value
    if args.tensor_parallel_size > 1:
        kw["tensor_parallel_size"] = args.tensor_parallel_size
    if suite.dummy:
        kw.update(load_format="dummy", skip_tokenizer_init=True)
    # Set only while the engine starts (a separate engine process inherits them then).
    engine_env = dict(cfg.env)
    profile = None
    if args.profile_dir and cfg.method == "ddtree":
        # Per-stage GPU times of DDTree steps (vllm_ddtree.step_profile).
        os.makedirs(args.profile_dir, exist_ok=True)
        profile = os.path.join(args.profile_dir,
                               f"step-profile-{args.suite}-{file_stem(cfg.name)}.json")
        engine_env["VLLM_DDTREE_PROFILE"] = profile
    with engine_environment(engine_env):
        return LLM(**kw), profile


def file_stem(config_name: str) -> str:
    """A config name as part of a file name: "+" (config flags) is not a safe file-name
    character for every tool that carries results back (the GPU host's tool refuses
    it), so "+x" becomes "_x"."""
    return config_name.replace("+", "_")


def config_engine_kwargs(cfg: BenchConfig) -> dict:
    """The engine arguments a config's flags set (``+tritonattn``); two flags setting
    the same argument (``+cgfull+cg1024``) merge into one dict."""
    kwargs: dict = {}
    for key, value in cfg.engine_args:
        kwargs.setdefault(key, {}).update(value)
    return kwargs


@contextlib.contextmanager
def engine_environment(env: dict[str, str]):
    """``env`` set only while an engine starts (its engine-core process inherits it
    then), the caller's environment restored afterwards."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _free(llm) -> None:
    import torch

    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()
    torch.cuda.empty_cache()


class CellTimes:
    """Per-request figures of a cell from vLLM's request metrics (engine-core stamps)."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.tpots: list[float] = []
        self.ttfts: list[float] = []
        self.ttft_splits: list[tuple[float, float]] = []  # (queued -> scheduled, -> first)

    def add(self, out, fallback_latency: float) -> tuple[float, float] | None:
        """One finished request; returns its (queued, last token) stamps if it has them."""
        m = getattr(out, "metrics", None)
        q, f, last = (getattr(m, "queued_ts", 0.0), getattr(m, "first_token_ts", 0.0),
                      getattr(m, "last_token_ts", 0.0)) if m is not None else (0, 0, 0)
        s = getattr(m, "scheduled_ts", 0.0) if m is not None else 0.0
        n = len(out.outputs[0].token_ids)
        self.latencies.append(last - q if q > 0 and last >= q else fallback_latency)
        if last > f > 0 and n > 1:
            self.tpots.append((last - f) / (n - 1))
        if f >= q > 0:
            self.ttfts.append(f - q)
            if f >= s >= q:
                self.ttft_splits.append((s - q, f - s))
            return q, last
        return None


OUTPUT_LENGTHS = ("fixed", "varied", "eos")


def request_max_tokens(max_tokens: int, index: int, lengths: str = "fixed") -> int:
    """The new tokens request ``index`` of a cell asks for. "fixed": ``max_tokens`` for
    every request (so plain decoding's requests of a generation finish in the same
    step and the next ones join together). "varied": between 0.5x and 1.5x
    ``max_tokens``, drawn per index (the same in every configuration and run), so
    requests finish apart and join one by one for every configuration alike, as a
    server's traffic does. "eos": ``max_tokens`` at most, each request ending where the
    target ends its answer (no ``ignore_eos``): acceptance measured on the text a
    deployment gets, which is the text the drafter was trained on (past the EOS the
    target's continuation is text no drafter saw)."""
    if lengths in ("fixed", "eos"):
        return max_tokens
    if lengths != "varied":
        raise ValueError(f"output lengths {lengths!r}: use one of {OUTPUT_LENGTHS}")
    return max(1, round(max_tokens * random.Random(7919 + index).uniform(0.5, 1.5)))


def _sampling_params(temperature: float, max_tokens: int, seed_index: int, dummy: bool,
                     lengths: str = "fixed"):
    from vllm import SamplingParams

    return SamplingParams(temperature=temperature,
                          max_tokens=request_max_tokens(max_tokens, seed_index, lengths),
                          ignore_eos=lengths != "eos",
                          seed=(1000 + seed_index) if temperature > 0 else None,
                          detokenize=not dummy)


class OutputSteps:
    """The engine core's stamp (``EngineCoreOutputs.timestamp``, ``time.monotonic()``
    where the step's outputs were made, the clock of the requests' stamps) of every step
    that returned tokens while the block runs: the front end's ``get_output`` wrapped
    for its duration, an append a step. Plain decoding keeps no step trace of its own,
    so this times both engines' steps alike. An engine without that client (a stand-in)
    records nothing."""

    def __init__(self, llm):
        self.core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        self.stamps: list[float] = []

    def __enter__(self) -> "OutputSteps":
        get = getattr(self.core, "get_output", None)
        if get is None:
            return self
        stamps = self.stamps

        def get_output(*args, **kwargs):
            out = get(*args, **kwargs)
            stamp = getattr(out, "timestamp", None)
            if stamp and getattr(out, "outputs", None):
                stamps.append(stamp)
            return out

        try:
            self.core.get_output = get_output
        except AttributeError:  # a client whose attributes are fixed: nothing recorded
            self.core = None
        return self

    def __exit__(self, *exc) -> None:
        # The instance attribute shadowed the client's method: drop it.
        if self.core is not None and "get_output" in getattr(self.core, "__dict__", {}):
            del self.core.get_output

    def after(self, start: float) -> list[float]:
        """The stamps, in seconds after ``start`` (the wave's first request queued)."""
        return [t - start for t in self.stamps if t >= start]


def run_cell(llm, prompts: list[list[int]], batch: int, temperature: float, max_tokens: int,
             dummy: bool, lengths: str = "fixed") -> tuple[list[list[int]], dict, SpecCounters]:
    """Waves: ``batch`` requests at a time, one ``generate`` call each; a wave ends with
    its slowest request."""
    before = engine_spec_counters(llm)
    outputs: list[list[int]] = []
    times = CellTimes()
    wave_edges: list[tuple[float, float]] = []
    wave_outputs: list[list[float]] = []
    t0 = time.perf_counter()
    for w in range(0, len(prompts), batch):
        wave = prompts[w:w + batch]
        sps = [_sampling_params(temperature, max_tokens, w + i, dummy, lengths)
               for i in range(len(wave))]
        # The engine core stamps requests with time.monotonic(), one clock for every
        # process of the machine: the wave's edges are comparable with its stamps.
        tw, tw_mono = time.perf_counter(), time.monotonic()
        with OutputSteps(llm) as steps:
            outs = llm.generate([{"prompt_token_ids": p} for p in wave], sps,
                                use_tqdm=False)
        wave_s, end_mono = time.perf_counter() - tw, time.monotonic()
        stamps = []
        for o in outs:
            outputs.append(list(o.outputs[0].token_ids))
            stamp = times.add(o, wave_s)
            if stamp is not None:
                stamps.append(stamp)
        if stamps and len(stamps) == len(outs):
            first_queued = min(q for q, _ in stamps)
            wave_edges.append((first_queued - tw_mono,
                               end_mono - max(last for _, last in stamps)))
            wave_outputs.append(steps.after(first_queued))
    wall = time.perf_counter() - t0
    delta = engine_spec_counters(llm).minus(before)
    return outputs, cell_summary(outputs, wall, times.latencies, times.tpots, times.ttfts,
                                 wave_edges, times.ttft_splits, wave_outputs), delta


def run_cell_steady(llm, prompts: list[list[int]], batch: int, temperature: float,
                    max_tokens: int, dummy: bool,
                    lengths: str = "fixed") -> tuple[list[list[int]], dict, SpecCounters]:
    """Constant concurrency: ``batch`` requests in flight from the start, a new one
    added as soon as one finishes (as a server with ``batch`` busy clients), all in
    one engine loop; only the last ``batch`` requests drain. Outputs in prompt order.

    Besides the whole cell's tokens/s, ``full_concurrency_tokens_per_s``: the tokens
    generated from the start to the last request's submission, over that time, i.e.
    while exactly ``batch`` requests were in flight. The drain after it weighs on a
    configuration whose requests finish unevenly (speculation: acceptance varies per
    request) and not on plain decoding's lockstep; a server under constant load has
    no drain."""
    engine = llm.llm_engine
    before = engine_spec_counters(llm)
    pending = list(range(len(prompts)))[::-1]
    index_of: dict[str, int] = {}
    finished: dict[int, object] = {}
    cell = f"steady-{time.monotonic_ns()}"
    times = CellTimes()

    def submit() -> None:
        i = pending.pop()
        given = f"{cell}-{i}"
        # Outputs carry the id given (vLLM 0.26); add_request returns its internal one.
        internal = engine.add_request(given, {"prompt_token_ids": prompts[i]},
                                      _sampling_params(temperature, max_tokens, i, dummy,
                                                       lengths))
        index_of[given] = index_of[internal or given] = i

    # At most `batch` in flight by construction: one submitted per one finished.
    t0 = last = time.perf_counter()
    for _ in range(min(batch, len(prompts))):
        submit()
    intervals = StepIntervals()
    generated: dict[str, int] = {}  # request id -> tokens so far (outputs are cumulative)
    full_concurrency = None  # (seconds, tokens) at the last request's submission
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        if outs:
            intervals.add(now - last, outs)
            last = now
        for out in outs:
            generated[out.request_id] = len(out.outputs[0].token_ids)
            if not getattr(out, "finished", False):
                continue
            finished[index_of[out.request_id]] = out
            times.add(out, now - t0)
            if pending:
                submit()
                if not pending:
                    full_concurrency = (now - t0, sum(generated.values()))
    wall = time.perf_counter() - t0
    if len(finished) != len(prompts):
        raise RuntimeError(f"steady cell: {len(finished)} of {len(prompts)} requests finished")
    outputs = [list(finished[i].outputs[0].token_ids) for i in range(len(prompts))]
    delta = engine_spec_counters(llm).minus(before)
    summary = cell_summary(outputs, wall, times.latencies, times.tpots, times.ttfts,
                           ttft_splits=times.ttft_splits)
    if full_concurrency is not None and full_concurrency[0] > 0:
        seconds, tokens = full_concurrency
        summary["full_concurrency_s"] = round(seconds, 4)
        summary["full_concurrency_tokens_per_s"] = round(tokens / seconds, 2)
    return outputs, {**summary, **intervals.summary()}, delta


class StepIntervals:
    """Time between consecutive engine outputs of a steady cell, split by whether the
    outputs carry some request's first token: then the step that made them prefilled a
    joining request beside the decodes. Under constant concurrency a request joins
    every few steps, so what such a step costs weighs on tokens/s (measured from the
    client, so it works for every configuration, with or without speculation)."""

    def __init__(self) -> None:
        self.decode: list[float] = []
        self.with_prefill: list[float] = []

    def add(self, seconds: float, outs) -> None:
        first = any(len(o.outputs[0].token_ids) == 1 for o in outs if o.outputs)
        (self.with_prefill if first else self.decode).append(seconds)

    def summary(self) -> dict:
        out = {}
        for name, xs in (("decode_step", self.decode), ("prefill_step", self.with_prefill)):
            if xs:
                out[f"{name}_ms_p50"] = _r(percentile(xs, 50) * 1e3)
                # The mean too: p50 hides a tail (e.g. a few steps without graphs), and
                # count x mean is the time those steps took.
                out[f"{name}_ms_mean"] = _r(statistics.fmean(xs) * 1e3)
                out[f"{name}s"] = len(xs)
        return out


CELL_MODES = ("waves", "steady")


class Recorder:
    def __init__(self, path: str, header: dict):
        self.path = path
        self.doc = dict(header, results=[], engines=[], skipped=[])

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.doc, f, indent=1, default=str)
        os.replace(tmp, self.path)


@dataclass
class EngineRun:
    """One started engine of a run: its LLM, its row in ``engines`` and the files its
    engine core writes (the online controller's report, the step profile)."""
    cfg: BenchConfig
    llm: Any
    eng: dict
    t_start: float
    budget_report: str | None = None
    profile: str | None = None


def start_engine(args, suite: Suite, target: str, drafter: str, cfg: BenchConfig,
                 rnd: int, prompt_sets: dict, rec: Recorder) -> EngineRun | None:
    """Start one engine of ``cfg`` (engine round ``rnd``) and warm it up at every batch
    size and temperature; None (recorded in ``engines``) when it fails to start."""
    t_engine = time.time()
    report = None
    if cfg.tokens_per_step == "auto":
        from vllm_ddtree.cost_model import REPORT_ENV

        report = os.path.join(tempfile.mkdtemp(), "cost-model.json")
        cfg = replace(cfg, env=cfg.env + ((REPORT_ENV, report),))
    budget_report = None
    if cfg.method == "ddtree" and cfg.online_budget is not False:
        from vllm_ddtree.env import BUDGET_REPORT

        # The online controller's last logged state (budget by batch size, acceptance
        # and step time per budget), kept in the engine row.
        budget_report = os.path.join(tempfile.mkdtemp(), "online-budget.json")
        cfg = replace(cfg, env=cfg.env + ((BUDGET_REPORT.name, budget_report),))
    try:
        llm, profile = _engine(args, suite, target, drafter, cfg)
    except Exception as exc:  # record and go on with the next config
        rec.doc["engines"].append({"config": cfg.name, "round": rnd, "error": repr(exc)[:2000]})
        rec.save()
        print(f"engine {cfg.name} failed: {exc!r}", flush=True)
        return None
    sched = llm.llm_engine.vllm_config.scheduler_config
    compilation = getattr(llm.llm_engine.vllm_config, "compilation_config", None)
    eng = {"config": cfg.name, "round": rnd, "startup_s": round(time.time() - t_engine, 1),
           # The host's Python speed as this engine's cells begin (host_info).
           "host_python_loop_ms": host_loop_ms(),
           "async_scheduling": getattr(sched, "async_scheduling", None),
           # The largest CUDA graph the engine captured (DDTree's default: patch 9).
           "max_cudagraph_capture_size": getattr(compilation, "max_cudagraph_capture_size",
                                                 None),
           # FULL for DDTree on Triton attention by default (patch 9), as the engine saw it.
           "cudagraph_mode": getattr(getattr(compilation, "cudagraph_mode", None), "name", None),
           "speculative_config": cfg.speculative_config(drafter)}
    if report and os.path.exists(report):
        # -tauto: what the engine core measured (the front end keeps the provisional schedule).
        with open(report) as f:
            eng["cost_model"] = json.load(f)
    # Warm-up outside the measurement, at every batch size and temperature: the
    # first use of a shape compiles kernel variants (vLLM's and ours) and
    # allocates; the 2026-11-29 mp run, warmed at batch 2 only, shows such stalls
    # as a few slow cells (e.g. DDTree batch 4 HumanEval T=0: 1.02 s vs 0.65 s).
    first = next(iter(prompt_sets.values()))
    for temp in sorted(set(suite.temperatures)):
        for batch in suite.batch_sizes:
            run_cell(llm, first[:batch], batch, temp, 8, suite.dummy)
            if args.cell_mode == "steady":
                # Steady cells also run steps that prefill a joining request beside
                # the running ones, token counts a wave never makes: without this,
                # each cell's first repeat paid their first-use costs (the trees' second
                # repeat was the faster one in 8 of 8 cells,
                # bench/results/2026-11-30-steady-full-graphs-host-profile/).
                run_cell_steady(llm, cycled(first, STEADY_WARMUP_WAVES * batch), batch,
                                temp, max(8, suite.max_tokens // 2), suite.dummy,
                                args.output_lengths)
    return EngineRun(cfg, llm, eng, t_engine, budget_report, profile)


def timed_run(args, suite: Suite, run: EngineRun, prompts: list, batch: int,
              temperature: float):
    """One timed run of a cell on ``run``'s engine: (outputs, summary, counters)."""
    cell_runner = run_cell_steady if args.cell_mode == "steady" else run_cell
    reqs = cycled(prompts, requests_for(batch, suite.min_requests, args.min_waves))
    return timed_on_this_host(cell_runner, run.llm, reqs, batch, temperature,
                              suite.max_tokens, suite.dummy, args.output_lengths)


# What a cell's row keeps of the online controller's bucket for its batch size.
BUDGET_BUCKET_FIELDS = ("choice", "steps", "switches", "probes", "accepted_measured",
                        "step_ms", "tokens_per_s")


def budget_bucket_snapshot(report_path: str | None, batch: int) -> dict | None:
    """The online controller's bucket for ``batch`` as its engine core last wrote it
    (``VLLM_DDTREE_BUDGET_REPORT``, rewritten every 2 s of decoding), after a cell's
    runs: why the cell drafted or not (its choice, switches and probes so far, the
    measured step time and tokens/s per budget). The sampling class in use; None
    without a report or a bucket holding ``batch``."""
    if not report_path or not os.path.exists(report_path):
        return None
    try:
        with open(report_path) as f:
            report = json.load(f)
    except (OSError, ValueError):
        return None  # being rewritten: the engine's final report still comes
    for name, bucket in (report.get("buckets") or {}).items():
        lo, _, hi = name.partition("-")
        if lo.isdigit() and hi.isdigit() and int(lo) <= batch <= int(hi):
            snap = {k: bucket[k] for k in BUDGET_BUCKET_FIELDS if k in bucket}
            return {"bucket": name, "sampling_class": report.get("sampling_class"),
                    "controller_step": report.get("step"), **snap}
    return None


def record_cell(args, suite: Suite, run: EngineRun, rnd: int, key: tuple, runs: list,
                rec: Recorder, cells: dict, reference: dict, exact: bool) -> None:
    """A cell's runs on one engine into its row (which merges every engine so far)."""
    set_name, batch, temp = key
    cfg = run.cfg
    outs = runs[0][0]  # the repeats generate the same tokens
    greedy = None
    if temp == 0.0:
        if cfg.method is None and key not in reference:
            # The first plain engine is the reference; a later one (another
            # graph mode or backend) is compared with it like the others.
            reference[key] = outs
        elif key in reference and not suite.dummy:
            greedy = greedy_fields(outs, reference[key], exact)
    cell = cells.get((cfg.name, *key))
    if cell is None:
        cell = cells[(cfg.name, *key)] = CellRuns(row=len(rec.doc["results"]))
        rec.doc["results"].append(None)
    cell.add_engine([r[1] for r in runs], [r[2] for r in runs], greedy)
    entry = cell.entry(cfg.name, cfg.method, set_name, batch, temp)
    if args.interleave:
        # The engines took turns run by run (--interleave): run i of every engine's
        # row was measured in the same turn.
        entry["interleaved"] = True
    snapshot = budget_bucket_snapshot(run.budget_report, batch)
    if snapshot is not None:
        entry["online_budget_bucket"] = snapshot
    rec.doc["results"][cell.row] = entry
    rec.save()
    print(json.dumps({k: entry.get(k) for k in (
        "config", "prompt_set", "batch_size", "temperature", "tau",
        "output_tokens_per_s", "full_concurrency_tokens_per_s",
        "time_per_output_token_ms", "ttft_p50_s", "ttft_queued_p50_s",
        "ttft_scheduled_p50_s", "wave_first_output_ms", "wave_second_output_ms",
        "wave_output_step_ms_p50", "greedy_match", "greedy_identical")}
        | {k: entry[k] for k in ("decode_step_ms_p50", "prefill_step_ms_p50") if k in entry}
        | ({"round": rnd} if args.engine_rounds > 1 else {})),
        flush=True)


def finish_engine(run: EngineRun, rec: Recorder) -> None:
    """The engine's row (with what its engine core reported) into ``engines``; frees it."""
    eng = run.eng
    eng["engine_s"] = round(time.time() - run.t_start, 1)
    if run.budget_report and os.path.exists(run.budget_report):
        with open(run.budget_report) as f:
            eng["online_budget"] = json.load(f)
    if run.profile and os.path.exists(run.profile):
        with open(run.profile) as f:
            eng["step_profile"] = json.load(f)
    rec.doc["engines"].append(eng)
    rec.save()
    _free(run.llm)


def cell_keys(suite: Suite, prompt_sets: dict) -> list[tuple]:
    """Every cell of a run, in the order it is measured: (prompt set, batch, T)."""
    return [(set_name, batch, temp) for set_name in prompt_sets
            for temp in suite.temperatures for batch in suite.batch_sizes]


def measure_engine(args, suite: Suite, target: str, drafter: str, cfg: BenchConfig,
                   rnd: int, prompt_sets: dict, rec: Recorder, cells: dict,
                   reference: dict, exact: bool) -> None:
    """One engine of ``cfg`` (engine round ``rnd``): warm-up, then every cell
    ``args.repeats`` times; each cell's row in ``rec`` merges every engine so far."""
    run = start_engine(args, suite, target, drafter, cfg, rnd, prompt_sets, rec)
    if run is None:
        return
    for key in cell_keys(suite, prompt_sets):
        set_name, batch, temp = key
        runs = [timed_run(args, suite, run, prompt_sets[set_name], batch, temp)
                for _ in range(args.repeats)]
        record_cell(args, suite, run, rnd, key, runs, rec, cells, reference, exact)
    finish_engine(run, rec)


def measure_interleaved(args, suite: Suite, target: str, drafter: str, configs: list,
                        rnd: int, prompt_sets: dict, rec: Recorder, cells: dict,
                        reference: dict, exact: bool) -> None:
    """Every engine of the round started and warmed up first (in ``configs``' order),
    then each cell's repeats taken in turns: repeat i runs the cell once on every
    engine, in the order of ``round_order(started, i)`` (A B, B A, ...). A drift of the
    host within the call then weighs on every engine alike, and run i of two engines
    is a pair measured seconds apart (``bench/goals.py``: paired ratios)."""
    started = []
    for cfg in configs:
        run = start_engine(args, suite, target, drafter, cfg, rnd, prompt_sets, rec)
        if run is not None:
            started.append(run)
    engines = range(len(started))
    for key in cell_keys(suite, prompt_sets):
        set_name, batch, temp = key
        runs: list[list] = [[] for _ in started]
        for i in range(args.repeats):
            for j in round_order(engines, i):
                runs[j].append(timed_run(args, suite, started[j], prompt_sets[set_name],
                                         batch, temp))
        # Plain decoding's rows first: its outputs are the greedy reference of the others.
        for j in sorted(engines, key=lambda j: started[j].cfg.method is not None):
            record_cell(args, suite, started[j], rnd, key, runs[j], rec, cells, reference,
                        exact)
    for run in started:
        finish_engine(run, rec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--suite", choices=sorted(SUITES), default="fixture")
    ap.add_argument("--out", required=True, help="result JSON (format: ci/README.md)")
    ap.add_argument("--target", default=os.environ.get("DDTREE_BENCH_TARGET", "/opt/smollm2-hf"))
    ap.add_argument("--drafter", default=os.environ.get("DDTREE_BENCH_DRAFTER", DEFAULT_DRAFTER))
    ap.add_argument("--data", default=os.environ.get("DDTREE_BENCH_DATA", "/opt/smollm2-fixture/data"))
    ap.add_argument("--configs", nargs="+", help="override the suite's configs")
    ap.add_argument("--batch-sizes", type=int, nargs="+")
    ap.add_argument("--prompt-sets", nargs="+")
    ap.add_argument("--temperatures", type=float, nargs="+")
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument("--min-requests", type=int)
    ap.add_argument("--repeats", type=int, default=1,
                    help="measure every cell this many times in a row (median + spread)")
    ap.add_argument("--cell-mode", choices=CELL_MODES, default="waves",
                    help="waves: BATCH requests per generate() call, each wave ending with "
                         "its slowest request; steady: BATCH requests in flight, refilled as "
                         "each finishes (a server at that concurrency)")
    ap.add_argument("--engine-rounds", type=int, default=1,
                    help="start every configuration's engine this many times, in "
                         "alternating order (A B, B A, ...); a cell's tokens/s is the median "
                         "over all its runs, each engine's median and their spread are kept")
    ap.add_argument("--interleave", action="store_true",
                    help="keep every engine of a round alive (each with its share of GPU "
                         "memory) and take each cell's repeats in turns, A B then B A, "
                         "instead of one engine after another: run i of every engine is "
                         "measured within seconds of the others' (paired ratios)")
    ap.add_argument("--dtype")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (correctness runs)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="default: 0.2 (fixture, ci), 0.4 (cost8b)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--attention-backend", default=None,
                    help="attention backend for every engine (default: vLLM's choice; "
                         "DDTree always uses TRITON_ATTN)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--batch-invariant", action="store_true",
                    help="VLLM_BATCH_INVARIANT=1: vLLM's batch-invariant kernels for every "
                         "engine (recorded in the result; greedy_match stays float32 eager "
                         "only, see greedy_exact)")
    ap.add_argument("--engine-process", choices=["inproc", "mp"], default="mp",
                    help="mp (vLLM's default, as `vllm serve` runs): the engine core in its "
                         "own process, output processing beside it; inproc: both in this "
                         "process and thread, so the host's output processing sits in every "
                         "step (the runs before this option)")
    ap.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto",
                    help="vLLM's asynchronous scheduling (auto: vLLM's default, on for "
                         "DFlash and DDTree)")
    ap.add_argument("--output-lengths", choices=OUTPUT_LENGTHS, default="fixed",
                    help="fixed: every request generates --max-tokens (ignore_eos); varied: "
                         "0.5-1.5x that, drawn per request index, the same for every config "
                         "(requests then finish and join apart for plain decoding too); eos: "
                         "at most --max-tokens, each request ending at the target's EOS")
    ap.add_argument("--min-waves", type=int, default=1,
                    help="at least this many waves of BATCH requests per cell (steady: "
                         "generations), prompts repeated when a set has too few")
    ap.add_argument("--time-budget-s", type=float, default=0.0,
                    help="skip engines that would start after this many seconds (0: no limit)")
    ap.add_argument("--engine-estimate-s", type=float, default=60.0,
                    help="time an engine and its cells are assumed to need, for the budget")
    ap.add_argument("--plots", default=None, help="directory for PNG plots (needs matplotlib)")
    ap.add_argument("--profile-dir", default=None,
                    help="record DDTree per-stage step times (VLLM_DDTREE_PROFILE) here")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.min_waves < 1:
        ap.error(f"--min-waves must be >= 1, got {args.min_waves}")
    if args.engine_rounds < 1:
        ap.error(f"--engine-rounds must be >= 1, got {args.engine_rounds}")

    # Read by vLLM when an engine starts; request timestamps are monotonic-clock
    # readings either way, comparable across the two processes.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.engine_process == "mp" else "0"
    if args.batch_invariant:
        os.environ["VLLM_BATCH_INVARIANT"] = "1"
    suite = SUITES[args.suite]
    for name in ("configs", "batch_sizes", "prompt_sets", "temperatures", "max_tokens",
                 "min_requests", "dtype"):
        if getattr(args, name) is not None:
            setattr(suite, name, getattr(args, name))
    configs = [parse_config(c) for c in suite.configs]  # bad names fail before any GPU work
    for cfg in configs:
        refuse_full_graphs_on_flash_attention(cfg, args.attention_backend)
    if any(b < 1 for b in suite.batch_sizes):
        raise SystemExit("--batch-sizes must be >= 1")

    if args.gpu_memory_utilization is None:
        args.gpu_memory_utilization = 0.4 if suite.dummy else 0.2
        if args.interleave:
            # All engines of a round share the GPU.
            args.gpu_memory_utilization = min(args.gpu_memory_utilization,
                                              round(INTERLEAVED_MEMORY / len(configs), 3))
    elif args.interleave and args.gpu_memory_utilization * len(configs) > INTERLEAVED_MEMORY:
        raise SystemExit(f"--interleave keeps {len(configs)} engines alive: "
                         f"--gpu-memory-utilization {args.gpu_memory_utilization} each is more "
                         f"than {INTERLEAVED_MEMORY} of the GPU in all")
    t_start = time.time()
    if suite.dummy:
        target, drafter = make_8b_models(tempfile.mkdtemp())
    else:
        target, drafter = args.target, args.drafter
        for what, path in (("target", target), ("drafter", drafter)):
            if not os.path.isdir(path):
                raise SystemExit(f"--{what} {path} is not a directory")

    import torch
    import vllm

    n_prompts = requests_for(max(suite.batch_sizes), suite.min_requests, args.min_waves)
    tokenizer = None
    if not suite.dummy:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(target)
    prompt_sets = load_prompt_sets(suite.prompt_sets, args.data, tokenizer, n_prompts)
    for name, ps in prompt_sets.items():
        # --min-waves may ask for more requests than a set has: they repeat (a repeat
        # finds its prompt in the prefix cache, as every cell's second run does).
        needed = n_prompts if args.min_waves <= 1 else max(suite.batch_sizes)
        if len(ps) < needed:
            raise SystemExit(f"prompt set {name} has {len(ps)} usable prompts, {needed} needed")

    rec = Recorder(args.out, dict(
        git_rev=git_rev(),
        code_digest=code_digest(),
        command="python " + " ".join([os.path.relpath(__file__, ROOT)] + sys.argv[1:] if argv is None
                                     else [os.path.relpath(__file__, ROOT)] + argv),
        suite=args.suite, target=target, drafter=drafter,
        drafter_digest=None if suite.dummy else weights_digest(drafter), dtype=suite.dtype,
        cuda_graphs=not args.eager, max_tokens=suite.max_tokens,
        engine_process=args.engine_process, batch_invariant=args.batch_invariant,
        cell_mode=args.cell_mode, min_waves=args.min_waves, interleave=args.interleave,
        output_lengths=args.output_lengths, greedy_exact=greedy_exact(suite.dtype, args.eager),
        gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        host=host_info(),
        vllm_version=vllm.__version__, ddtree_series=getattr(vllm, "ddtree_series", None),
    ))
    reference: dict[tuple, list[list[int]]] = {}
    exact = rec.doc["greedy_exact"]
    cells: dict[tuple, CellRuns] = {}
    def out_of_time(cfgs: list, rnd: int) -> bool:
        """Whether ``cfgs``' engines would run past the time budget: then each is
        recorded as skipped."""
        elapsed = time.time() - t_start
        if not args.time_budget_s or \
                elapsed + args.engine_estimate_s * len(cfgs) <= args.time_budget_s:
            return False
        for cfg in cfgs:
            rec.doc["skipped"].append({"config": cfg.name, "round": rnd,
                                       "reason": f"time budget ({elapsed:.0f}s used)"})
            print(f"skip {cfg.name} (round {rnd}): time budget", flush=True)
        rec.save()
        return True

    for rnd in range(args.engine_rounds):
        if args.interleave:
            if not out_of_time(configs, rnd):
                measure_interleaved(args, suite, target, drafter, round_order(configs, rnd),
                                    rnd, prompt_sets, rec, cells, reference, exact)
            continue
        for cfg in round_order(configs, rnd):
            if not out_of_time([cfg], rnd):
                measure_engine(args, suite, target, drafter, cfg, rnd, prompt_sets, rec,
                               cells, reference, exact)
    rec.doc["wall_s"] = round(time.time() - t_start, 1)
    if suite.dummy:
        rec.doc["cost_model"] = cost_model(rec.doc["results"])
    else:
        rec.doc["crossover"] = speculation_crossover(rec.doc["results"])
    rec.save()
    if args.plots:
        from bench.plot import plot_results

        try:
            print("plots:", plot_results(rec.doc, args.plots), flush=True)
        except ImportError as exc:
            print(f"no plots: {exc}", flush=True)
    failed = [e for e in rec.doc["engines"] if "error" in e]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
