"""``bench/results/drafter.json``: what a DFlash drafter accepts, offline and in the engine.

From the drafter's directory (its config and weights), the trainer's offline evaluations
(``eval.json`` of ``bench.fixture.train_dflash_drafter``: simulated chain decoding at T=0
over the target's own greedy answers) and ``bench/run.py`` result files (the chain and
DDTree with fixed budgets, ``ddtree-b<B>+static``, so that the online controller does not
move the budget), one row per (prompt set, method, budget, temperature, batch size):
tau (tokens per verification step: accepted + 1) and the acceptance by depth (the
share of steps whose draft was accepted at least to that depth). Never written by hand.

    python3 bench/drafter_report.py --drafter bench/fixture/smollm2-dflash \\
        --offline bench/results/drafter-training/eval.json \\
        --out bench/results/drafter.json RUN.json [RUN.json ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.result_files import read_json  # noqa: E402
from bench.run import parse_config, weights_digest  # noqa: E402

def safetensors_params(path: str) -> int:
    """Number of parameters in a safetensors file, read from its header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    total = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        count = 1
        for d in t["shape"]:
            count *= d
        total += count
    return total


def drafter_info(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    weights = os.path.join(path, "model.safetensors")
    dflash = cfg.get("dflash_config") or {}
    return {"path": os.path.relpath(path, ROOT) if os.path.isabs(path) else path,
            "architectures": cfg.get("architectures"),
            "num_hidden_layers": cfg.get("num_hidden_layers"),
            "hidden_size": cfg.get("hidden_size"),
            "intermediate_size": cfg.get("intermediate_size"),
            "block_size": cfg.get("block_size"),
            "target_layer_ids": dflash.get("target_layer_ids"),
            "params": safetensors_params(weights), "bytes": os.path.getsize(weights),
            "digest": weights_digest(path),
            "training": cfg.get("fixture_training")}


def check_same_drafter(doc: dict, path: str, digest: str | None) -> None:
    """A run or offline file that names its drafter's weights (``drafter_digest``, as
    bench/run.py and bench.fixture.offline_tau write it) must name this drafter's: the
    committed drafter changes as it trains on, and a row of another drafter would be
    silently mixed in. Files without a digest (the trainer's eval.json, which evaluates
    the drafter it wrote) pass."""
    got = doc.get("drafter_digest")
    if got is not None and digest is not None and got != digest:
        raise SystemExit(f"{path}: measured the drafter with weights {got}, not {digest} "
                         "(--drafter): give only files of this drafter")


def offline_rows(eval_doc: dict, source: str, chain_length: int | None) -> list[dict]:
    """The trainer's simulated chain (``chain_length`` = block size - 1 drafts a step) and,
    from ``bench.fixture.offline_tau``, DDTree's trees by budget (``trees``); the
    evaluation sets carry the engine's prompt-set names (sharegpt, humaneval).
    ``answers``: the first N answers of each set that were measured (``--limit``), None
    for all of them."""
    rows = []
    answers = eval_doc.get("limit")
    for name, r in (eval_doc.get("eval") or {}).items():
        rows.append({"prompt_set": name, "method": "dflash",
                     "budget": chain_length, "temperature": 0.0, "batch_size": None,
                     "tau": r.get("tau"), "acceptance_by_depth": r.get("p_accept_ge_k"),
                     "answers": answers, "where": "offline", "source": source})
    for name, r in (eval_doc.get("chain_t1") or {}).items():
        # Not the walk's tau: the expected tokens per step from a random anchor of the
        # greedy answers (at T > 0 the walk leaves them), with the same anchors' T=0
        # figure to compare it with.
        if r.get("anchors"):
            rows.append({"prompt_set": name, "method": "dflash", "budget": chain_length,
                         "temperature": r["temperature"], "batch_size": None,
                         "tau": r["tau_all_anchors"], "tau_kind": "mean over anchors",
                         "t0_same_anchors": r["t0_tau_all_anchors"],
                         "acceptance_by_depth": r.get("p_accept_ge_k"),
                         "answers": answers, "where": "offline", "source": source})
    for name, by_budget in (eval_doc.get("trees") or {}).items():
        for budget, r in by_budget.items():
            rows.append({"prompt_set": name, "method": "ddtree",
                         "budget": int(budget), "temperature": 0.0, "batch_size": None,
                         "tau": r.get("tau"), "acceptance_by_depth": r.get("p_accept_ge_k"),
                         "answers": answers, "where": "offline", "source": source})
    return rows


def engine_rows(doc: dict, source: str) -> list[dict]:
    """One row per chain or DDTree result; ``online_budget``: the engine chose each step's
    budget itself (bench/run.py records its controller), so ``budget`` is its cap."""
    online = {e["config"] for e in doc.get("engines") or [] if "online_budget" in e}
    rows = []
    for r in doc.get("results") or []:
        cfg = parse_config(r["config"])
        if cfg.method not in ("dflash", "ddtree") or r.get("tau") is None:
            continue
        rows.append({"prompt_set": r["prompt_set"], "method": cfg.method,
                     "budget": cfg.num_speculative_tokens, "config": r["config"],
                     "online_budget": r["config"] in online,
                     "temperature": r["temperature"], "batch_size": r["batch_size"],
                     "tau": r["tau"], "acceptance_by_depth": r.get("acceptance_by_depth"),
                     # what was counted: answers of at most max_tokens, ending at the
                     # target's EOS ("eos") or continuing past it ("fixed")
                     "max_tokens": doc.get("max_tokens"),
                     "output_lengths": doc.get("output_lengths", "fixed"),
                     "where": "engine", "source": source})
    return rows


# The goal for the chain at T=0 (engine, batch 1), which the curve's projection
# reads on the trainer's offline chain of the same sets.
CHAIN_GOALS = {"humaneval": 3.0, "sharegpt": 2.5}


def training_curve(training: dict | None, goals: dict[str, float] = CHAIN_GOALS) -> dict | None:
    """The drafter's acceptance against its training, from the history its config keeps
    (``fixture_training``: each ``drafter-train`` run, the one it started from under
    ``settings.init_from``): per run, the steps and answer tokens so far and the trainer's
    offline chain tau at its end. ``fit``: per evaluation set, the least-squares line
    tau = a + b ln(steps) over those points and, where it rises, the steps at which it
    would reach the goal -- an extrapolation of a few points, not a measurement."""
    if not training:
        return None
    history = []
    node = training
    while node:
        history.append(node)
        node = (node.get("settings") or {}).get("init_from")
    points, steps, tokens, seconds, timed_steps = [], 0, 0, 0.0, 0
    for node in reversed(history):
        for run in node.get("runs") or []:
            n = run["end_step"] - run["start_step"]
            steps += n
            tokens += run.get("response_tokens") or 0
            if run.get("seconds"):
                seconds += run["seconds"]
                timed_steps += n
            points.append({"steps": steps, "run_steps": n, "layers": node["settings"].get("layers"),
                           "data": run.get("data"), "response_tokens": run.get("response_tokens"),
                           "eval": run.get("eval") or {}})
    fit = {}
    for name in sorted({k for p in points for k in p["eval"]}):
        xy = [(math.log(p["steps"]), p["eval"][name]) for p in points if name in p["eval"]]
        if len(xy) < 2:
            continue
        mx = sum(x for x, _ in xy) / len(xy)
        my = sum(y for _, y in xy) / len(xy)
        sxx = sum((x - mx) ** 2 for x, _ in xy)
        if sxx == 0:
            continue
        b = sum((x - mx) * (y - my) for x, y in xy) / sxx
        a = my - b * mx
        row = {"points": len(xy), "a": round(a, 4), "b_per_e_fold": round(b, 4),
               "last": xy[-1][1]}
        goal = goals.get(name)
        if goal is not None:
            row["goal"] = goal
            row["steps_to_goal"] = (round(math.exp((goal - a) / b)) if b > 0 else None)
        fit[name] = row
    out = {"runs": points, "fit": fit}
    if timed_steps:
        out["seconds_per_step"] = round(seconds / timed_steps, 4)
    return out


def build(drafter: str, offline: list[str], runs: list[str]) -> dict:
    info = drafter_info(drafter)
    chain_length = info["block_size"] - 1 if info["block_size"] else None
    rows: list[dict] = []
    for path in offline:
        with open(path) as f:
            doc = json.load(f)
        check_same_drafter(doc, path, info["digest"])
        rows += offline_rows(doc, os.path.relpath(path, ROOT), chain_length)
    revs = set()
    for path in runs:
        doc = read_json(path)
        check_same_drafter(doc, path, info["digest"])
        revs.add(doc.get("git_rev"))
        rows += engine_rows(doc, os.path.relpath(path, ROOT))
    rows.sort(key=lambda x: (x["where"], x["prompt_set"], x["method"], x["budget"] or 0,
                             x["temperature"], x["batch_size"] or 0, x.get("answers") or 0))
    return {"drafter": info, "git_revs": sorted(r for r in revs if r),
            "curve": training_curve(info["training"]), "tau": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="*", help="bench/run.py result JSON(s), .json or .json.gz")
    ap.add_argument("--drafter", required=True, help="the drafter's directory")
    ap.add_argument("--offline", action="append", default=[],
                    help="the trainer's eval.json or bench.fixture.offline_tau's output "
                         "(repeatable)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    doc = build(a.drafter, a.offline, a.runs)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    for name, f in ((doc["curve"] or {}).get("fit") or {}).items():
        print(f"curve   {name:18} tau {f['last']} after the last run, {f['b_per_e_fold']:+} "
              f"an e-fold of steps; goal {f.get('goal')} at ~{f.get('steps_to_goal')} steps")
    for r in doc["tau"]:
        print(f"{r['where']:7} {r['prompt_set']:18} {r['method']:6} B={r['budget']} "
              f"T={r['temperature']} batch={r['batch_size']}: tau {r['tau']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
