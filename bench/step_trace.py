"""Where an all-at-once wave's time goes, from the online controller's step trace.

A DDTree engine with ``VLLM_DDTREE_BUDGET_REPORT`` set (``bench/run.py`` sets it) keeps
its last 512 steps (``online_budget.recent_steps`` in a result file's ``engines``: batch,
budget, drafted budget, requests sampled, mean accepted, step ms, prefill tokens). This
splits them into waves (a wave starts at a step that prefills after steps that decoded)
and, per wave, says how long its decode steps took while every request of the wave was
running ("full") and after the first one finished ("tail"), the budgets they ran, and
the tokens they produced (a request's token a step plus what it accepted): whether a
wave ended late because of its tail or because its full-batch steps were slow. Steps
that prefill, and decode steps before the batch first reaches its largest size, are in
neither phase (``prefill_steps`` counts the former). How a wave starts (``start``): the
times of its prefilling steps (None for a step the controller did not time: the first
after the engine idled) and of its first ``START_STEPS`` full-batch decode steps, against
the median of its full-batch budget-0 steps: whether the steps around a wave's prefill,
which its first tokens wait for, cost more than its steady ones.

The trace holds the engine's last steps, so it describes the last cells the engine ran:
run the cell of interest last (``GOALS_BATCH_SIZES``, ``GOALS_TEMPERATURES``). Below the
table, each bucket's last switches (``recent_switches``, where the report has them): when
the controller turned a budget on or off, and the estimates it decided on.

    python3 bench/step_trace.py bench/results/<dir>/bench-goals-<tag>.json.gz [--json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys

FIELDS = ["batch", "budget", "drafted_budget", "requests_sampled", "mean_accepted",
          "step_ms", "prefill_tokens"]
# vllm_ddtree.online_budget.UNTIMED_STEP_MS: what the controller records for a step
# whose time it does not take as a step's (the first after the engine idled; one outside
# its bounds), counted as prefilling. A copy, so that this reads result files without
# torch (tests/bench/test_step_trace.py keeps the two equal).
UNTIMED_MS = 1.0
START_STEPS = 4


def load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def traces(doc: dict) -> list[tuple[str, int, list[dict]]]:
    """(config, round, steps as dicts) of every engine whose report kept a trace."""
    out = []
    for eng in doc.get("engines", []):
        rs = (eng.get("online_budget") or {}).get("recent_steps")
        if not rs:
            continue
        fields = rs["fields"]
        missing = [f for f in FIELDS if f not in fields]
        if missing:
            raise ValueError(f"{eng.get('config')}: the trace lacks {missing}")
        out.append((eng.get("config"), eng.get("round", 0),
                    [dict(zip(fields, s)) for s in rs["steps"]]))
    return out


def split_waves(steps: list[dict]) -> list[list[dict]]:
    """Waves: a step that prefills after a step that only decoded starts a new one. The
    first wave is usually cut (the trace starts inside it)."""
    waves: list[list[dict]] = []
    cur: list[dict] = []
    for s in steps:
        if s["prefill_tokens"] and cur and not cur[-1]["prefill_tokens"]:
            waves.append(cur)
            cur = []
        cur.append(s)
    if cur:
        waves.append(cur)
    return waves


def _tokens(s: dict) -> float:
    """Tokens a decode step produced: one a request, plus the accepted drafts of the
    requests that verified some (``mean_accepted`` over ``requests_sampled``)."""
    acc = s["mean_accepted"] or 0.0
    return s["batch"] + acc * (s["requests_sampled"] or 0)


def _phase(steps: list[dict]) -> dict:
    ms = sum(s["step_ms"] for s in steps)
    tokens = sum(_tokens(s) for s in steps)
    drafting = [s for s in steps if s["budget"] > 0]
    return {
        "steps": len(steps),
        "ms": round(ms, 2),
        "tokens": round(tokens, 1),
        "tokens_per_ms": round(tokens / ms, 3) if ms else None,
        "drafting_steps": len(drafting),
        "budgets": {str(b): sum(1 for s in steps if s["budget"] == b)
                    for b in sorted({s["budget"] for s in steps})},
        "step_ms_p50": {
            "0": _median([s["step_ms"] for s in steps if s["budget"] == 0]),
            "drafting": _median([s["step_ms"] for s in drafting])},
    }


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def wave_summary(wave: list[dict], first_in_trace: bool = False) -> dict | None:
    """One wave's phases; None for a wave without a decode step. ``cut``: the trace
    began inside it (the first wave, when it has no prefilling step or its batch grew
    after decoding began)."""
    decode = [s for s in wave if not s["prefill_tokens"]]
    if not decode:
        return None
    full = max(s["batch"] for s in decode)
    first = next(i for i, s in enumerate(decode) if s["batch"] == full)
    head = decode[first:]
    end_full = next((i for i, s in enumerate(head) if s["batch"] < full), len(head))
    full_steps = head[:end_full]
    prefilling = [s for s in wave if s["prefill_tokens"]]
    return {
        "requests": full,
        "prefill_steps": len(wave) - len(decode),
        "cut": first_in_trace and (first > 0 or not wave[0]["prefill_tokens"]),
        "full": _phase(full_steps),
        "tail": _phase(head[end_full:]),
        "start": {
            "prefill_ms": [None if s["step_ms"] == UNTIMED_MS else s["step_ms"]
                           for s in prefilling],
            "prefill_tokens": [s["prefill_tokens"] for s in prefilling],
            "first_full_ms": [s["step_ms"] for s in full_steps[:START_STEPS]],
            "full_budget_0_ms_p50": _median(
                [s["step_ms"] for s in full_steps[START_STEPS:] if s["budget"] == 0]),
        },
    }


def summarize(doc: dict) -> list[dict]:
    out = []
    for config, rnd, steps in traces(doc):
        waves = [w for w in (wave_summary(w, i == 0) for i, w in enumerate(split_waves(steps)))
                 if w]
        out.append({"config": config, "round": rnd, "waves": waves})
    return out


def switches(doc: dict) -> list[dict]:
    """Every switch the engines' reports kept (``recent_switches``: per sampling class
    and bucket), in the order they happened, with its engine, class and bucket."""
    out = []
    for eng in doc.get("engines", []):
        per_class = (eng.get("online_budget") or {}).get("recent_switches") or {}
        for cls, buckets in per_class.items():
            for bucket, log in buckets.items():
                out += [{"config": eng.get("config"), "round": eng.get("round", 0),
                         "class": cls, "bucket": bucket, **entry} for entry in log]
    return sorted(out, key=lambda e: (e["config"], e["round"], e["step"]))


def switch_lines(entries: list[dict]) -> str:
    return "\n".join(
        f"{e['config']} r{e['round']} {e['class']} {e['bucket']}: step {e['step']}, "
        f"budget {e['from']} -> {e['to']} (accepted {e['accepted']}, step ms "
        f"{e['step_ms']}, tokens/s compared {e['compared']})" for e in entries)


def _wave_label(eng: dict, i: int, wave: dict) -> str:
    """A table row's first two cells: the engine (and its round) and the wave."""
    return f"| {eng['config']} r{eng['round']} | {i}{' (cut)' if wave['cut'] else ''} "


def table(summary: list[dict]) -> str:
    lines = ["| engine | wave | requests | full: steps / ms / tok per ms / budgets "
             "| tail: steps / ms / tok per ms / budgets | tail share of ms |",
             "|---|---|---|---|---|---|"]
    for eng in summary:
        for i, w in enumerate(eng["waves"]):
            f, t = w["full"], w["tail"]
            total = f["ms"] + t["ms"]
            lines.append(
                f"{_wave_label(eng, i, w)}| {w['requests']} | {f['steps']} / {f['ms']} / "
                f"{f['tokens_per_ms']} / {f['budgets']} | {t['steps']} / {t['ms']} / "
                f"{t['tokens_per_ms']} / {t['budgets']} | "
                f"{round(t['ms'] / total, 3) if total else None} |")
    return "\n".join(lines)


def start_table(summary: list[dict]) -> str:
    """How each wave started: its prefilling steps and its first full-batch steps."""
    lines = ["| engine | wave | prefill steps: tokens / ms | first full-batch steps, ms "
             "| later full-batch budget-0 step, median ms |", "|---|---|---|---|---|"]
    for eng in summary:
        for i, w in enumerate(eng["waves"]):
            st = w["start"]
            pre = ", ".join(f"{t} / {'untimed' if m is None else m}"
                            for t, m in zip(st["prefill_tokens"], st["prefill_ms"]))
            lines.append(f"{_wave_label(eng, i, w)}| {pre or '-'} | {st['first_full_ms']} "
                         f"| {st['full_budget_0_ms_p50']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", help="a bench/run.py result file (.json or .json.gz)")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args(argv)
    doc = load(args.result)
    summary = summarize(doc)
    if not summary:
        print(f"{args.result}: no engine kept a step trace", file=sys.stderr)
        return 1
    switched = switches(doc)
    if args.json:
        print(json.dumps({"engines": summary, "switches": switched}, indent=1))
    else:
        print(table(summary))
        print("\nHow each wave started:\n" + start_table(summary))
        if switched:
            print("\nSwitches (the reports' last per bucket):\n" + switch_lines(switched))
    return 0


if __name__ == "__main__":
    sys.exit(main())
