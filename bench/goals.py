"""``bench/results/goals.json``: DDTree against plain decoding and the DFlash chain, per
cell, from ``bench/run.py`` result files (one per engine round; alternate the engine
order between rounds), never written by hand.

Per cell (suite, prompt set, batch, temperature, mode, vLLM version, GPU, drafter) and engine: the median of every
repeat of every round (``output_tokens_per_s_runs``), the spread (max - min) / median,
and tau; and the orders the engines were started in (``engine_orders``; ``both_orders``:
DDTree's engine started first in one round and last in another, so that drift over a
call does not favour it). The engines are matched by role, from their config names
(bench/run.py): ``no-spec`` (plain decoding as vLLM runs it; its ``+flag`` variants are
left out); the chain is the config named ``dflash...``; DDTree the one named
``ddtree...`` (give ``--ddtree`` / ``--dflash`` to pick one when a file has several).
Also writes a markdown table (``--table``) with the ratios the goal is stated in: DDTree
/ the better of plain decoding and the chain (goal >= 0.97 everywhere), DDTree / plain
decoding, and DDTree / plain decoding within each file.

Files from ``bench/run.py --interleave`` (engines alive together, each cell's repeat i
run once on every engine in turn) also give **paired** ratios: repeat i of DDTree over
repeat i of the other engines (the better of the two where both ran), measured seconds
apart, so a drift of the host over the call cancels. A cell whose files are all
interleaved is judged on the median of its paired ratios (``goal_basis: "paired"``),
any other on the ratio of pooled medians (``"pooled"``).

Pooling keeps every round of every file given, older trees' included. So each cell also
says what its **latest** file alone gives (``latest``: the last file given that ran
DDTree and every other engine of the cell; its ``git_rev``, DDTree / the better of the
others, paired where that file interleaved its engines, and whether that meets the
goal). Neither replaces the other: the pooled figure has more runs, the latest says
what the newest code measured.

    python3 bench/goals.py --held-out sharegpt-untrained --out bench/results/goals.json \\
        --table bench/results/<dir>/goals.md <round 1 json> <round 2 json>
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.result_files import dumps_rows, read_json  # noqa: E402

GOAL_RATIO = 0.97


def _role(result: dict, ddtree: str | None, dflash: str | None) -> str | None:
    config = result["config"]
    if config == "no-spec":
        return "no-spec"
    if config.startswith("dflash") and (dflash is None or config == dflash):
        return "dflash"
    if config.startswith("ddtree") and (ddtree is None or config == ddtree):
        return "ddtree"
    return None


def engine_orders(doc: dict, ddtree: str | None = None, dflash: str | None = None) -> set:
    """The orders in which a result file started its engines, one per engine round:
    tuples of roles (``("no-spec", "ddtree")``), each role once, first start first."""
    rounds: dict = {}
    for e in doc.get("engines") or []:
        role = _role(e, ddtree, dflash)
        order = rounds.setdefault(e.get("round", 0), [])
        if role is not None and role not in order:
            order.append(role)
    return {tuple(o) for o in rounds.values() if o}


def both_orders(orders: set) -> bool:
    """DDTree started before every other engine of one round and after every other
    engine of another."""
    rounds = [o for o in orders if "ddtree" in o and len(o) > 1]
    return any(o[0] == "ddtree" for o in rounds) and any(o[-1] == "ddtree" for o in rounds)


def gather(docs: list[dict], ddtree: str | None = None, dflash: str | None = None) -> dict:
    """{cell key: {role: {"runs": [...], "tau": [...], "config": name}, "_orders": set}}"""
    cells: dict = {}
    for index, doc in enumerate(docs):
        suite = doc.get("suite")
        mode = doc.get("cell_mode") or "waves"
        version = doc.get("vllm_version") or "unknown"
        # Tokens a second are pooled only within one kind of card: an H100's and an
        # H200's runs of the same cell are two cells.
        gpu = doc.get("gpu") or "unknown"
        # And only with one drafter: a retrained drafter's runs start cells of their own
        # (its weights digest; None where a file names none: the dummy-weight suites and
        # the fixture's files of before the field).
        drafter = doc.get("drafter_digest")
        orders = engine_orders(doc, ddtree, dflash)
        interleaved = bool(doc.get("interleave"))
        for r in doc.get("results") or []:
            if not r:
                continue
            role = _role(r, ddtree, dflash)
            if role is None:
                continue
            key = (suite, r["prompt_set"], r["batch_size"], r["temperature"], mode, version, gpu,
                   drafter)
            cells.setdefault(key, {}).setdefault("_orders", set()).update(orders)
            cells[key].setdefault("_interleaved", {})[index] = interleaved
            cells[key].setdefault("_revs", {})[index] = doc.get("git_rev")
            slot = cells[key].setdefault(role, {"runs": [], "tau": [], "by_file": {},
                                                "config": r["config"]})
            if slot["config"] != r["config"]:
                raise SystemExit(f"two {role} configs in one cell ({slot['config']}, "
                                 f"{r['config']}): pick one with --{role}")
            runs = r.get("output_tokens_per_s_runs") or [r["output_tokens_per_s"]]
            slot["runs"].extend(runs)
            slot["by_file"].setdefault(index, []).extend(runs)
            if r.get("tau") is not None:
                slot["tau"].append(r["tau"])
    return cells


def per_file_ratios(ddtree: dict, plain: dict) -> list[float]:
    """DDTree / plain decoding within each result file that ran both (medians of that
    file's runs), in the order the files were given: with one engine order a file, this
    shows what the pooled median hides when drift over a call favours one order."""
    return [round(statistics.median(ddtree["by_file"][i]) / statistics.median(runs), 4)
            for i, runs in sorted(plain["by_file"].items()) if i in ddtree["by_file"]]


def file_pairs(roles: dict, others: tuple[str, ...], index: int) -> list[float] | None:
    """Repeat i of DDTree over the best of ``others``' repeat i in file ``index``, or None
    unless that file interleaved its engines and ran DDTree and all of ``others`` the
    same number of times."""
    if not roles.get("_interleaved", {}).get(index) or "ddtree" not in roles:
        return None
    ddtree = roles["ddtree"]["by_file"].get(index)
    base = [roles[r]["by_file"].get(index) for r in others if r in roles]
    if not ddtree or len(base) != len(others) or any(
            b is None or len(b) != len(ddtree) for b in base):
        return None
    return [d / max(col) for d, col in zip(ddtree, zip(*base))]


def paired_ratios(roles: dict, others: tuple[str, ...]) -> list[float]:
    """:func:`file_pairs` of every file, in the order the files were given."""
    ratios = []
    for index in sorted(roles.get("_interleaved", {})):
        ratios += file_pairs(roles, others, index) or []
    return ratios


def _paired(ratios: list[float]) -> dict:
    med = statistics.median(ratios)
    return {"median": round(med, 4), "min": round(min(ratios), 4),
            "max": round(max(ratios), 4), "pairs": len(ratios)}


def latest_file(roles: dict, others: tuple[str, ...]) -> dict | None:
    """DDTree / the better of ``others`` in the last file (by index) that ran DDTree and
    all of ``others``: the paired median where that file interleaved its engines with
    equal repeats, else the ratio of that file's medians."""
    if "ddtree" not in roles or not others:
        return None
    files = [i for i in roles["ddtree"]["by_file"]
             if all(i in roles[r]["by_file"] for r in others)]
    if not files:
        return None
    index = max(files)
    pairs = file_pairs(roles, others, index)
    if pairs:
        ratio, basis = statistics.median(pairs), "paired"
    else:
        ratio = (statistics.median(roles["ddtree"]["by_file"][index])
                 / max(statistics.median(roles[r]["by_file"][index]) for r in others))
        basis = "medians"
    return {"file": index, "git_rev": roles.get("_revs", {}).get(index),
            "ddtree_vs_best_other": round(ratio, 4), "basis": basis,
            "goal_met": ratio >= GOAL_RATIO}


def summarise(cells: dict) -> list[dict]:
    out = []
    for key, roles in sorted(cells.items(), key=lambda kv: tuple("" if k is None else k
                                                                  for k in kv[0])):
        suite, prompt_set, batch, temp, mode, version, gpu, drafter = key
        tok_s, spread, tau, configs, repeats = {}, {}, {}, {}, {}
        orders = roles.get("_orders", set())
        for role, slot in roles.items():
            if role.startswith("_"):
                continue
            med = statistics.median(slot["runs"])
            tok_s[role] = round(med, 2)
            spread[role] = round((max(slot["runs"]) - min(slot["runs"])) / med, 4)
            repeats[role] = len(slot["runs"])
            configs[role] = slot["config"]
            if slot["tau"]:
                tau[role] = round(statistics.median(slot["tau"]), 4)
        cell = {"suite": suite, "prompt_set": prompt_set, "batch": batch,
                "temperature": temp, "mode": mode, "vllm_version": version, "gpu": gpu,
                "drafter_digest": drafter, "tok_s": tok_s, "tau": tau,
                "spread": spread, "repeats": repeats, "configs": configs,
                "engine_orders": sorted(list(o) for o in orders),
                "both_orders": both_orders(orders)}
        if "ddtree" in tok_s:
            base = [tok_s[r] for r in ("no-spec", "dflash") if r in tok_s]
            if base:
                cell["ddtree_vs_best_other"] = round(tok_s["ddtree"] / max(base), 4)
                cell["goal_met"] = cell["ddtree_vs_best_other"] >= GOAL_RATIO
            if "no-spec" in tok_s:
                cell["ddtree_vs_no_spec"] = round(tok_s["ddtree"] / tok_s["no-spec"], 4)
                cell["ddtree_vs_no_spec_by_file"] = per_file_ratios(roles["ddtree"],
                                                                    roles["no-spec"])
            if "dflash" in tok_s:
                cell["ddtree_vs_dflash"] = round(tok_s["ddtree"] / tok_s["dflash"], 4)
            others = tuple(r for r in ("no-spec", "dflash") if r in tok_s)
            for name, roles_of in (("ddtree_vs_no_spec_paired", ("no-spec",)),
                                   ("ddtree_vs_dflash_paired", ("dflash",)),
                                   ("ddtree_vs_best_other_paired", others)):
                # A role the cell lacks, or no others at all, leaves no pairs.
                ratios = paired_ratios(roles, roles_of)
                if ratios:
                    cell[name] = _paired(ratios)
            best = cell.get("ddtree_vs_best_other_paired")
            cell["goal_basis"] = "pooled"
            if best and all(roles["_interleaved"].values()):
                cell["goal_basis"] = "paired"
                cell["goal_met"] = best["median"] >= GOAL_RATIO
            latest = latest_file(roles, others)
            if latest:
                cell["latest"] = latest
        out.append(cell)
    return out


def table(cells: list[dict]) -> str:
    lines = ["| vLLM | GPU | drafter | suite | set | mode | batch | T | plain tok/s | chain tok/s | DDTree tok/s | DDTree / best | "
             "DDTree / plain | DDTree / plain by file | DDTree / best, paired (min-max, pairs) | "
             "tau chain / DDTree | spread plain / chain / DDTree | latest file: DDTree / best (rev) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        t, s, tau = c["tok_s"], c["spread"], c["tau"]
        p = c.get("ddtree_vs_best_other_paired")
        paired = f"{p['median']} ({p['min']}-{p['max']}, {p['pairs']})" if p else ""
        lt = c.get("latest")
        latest = f"{lt['ddtree_vs_best_other']} ({lt['git_rev']})" if lt else ""
        lines.append(
            f"| {c.get('vllm_version', '')} | {c.get('gpu', '')} | {c.get('drafter_digest') or ''} | {c.get('suite', '')} | {c['prompt_set']} | {c.get('mode', '')} | {c['batch']} | "
            f"{c['temperature']:g} | "
            f"{t.get('no-spec', '')} | {t.get('dflash', '')} | {t.get('ddtree', '')} | "
            f"{c.get('ddtree_vs_best_other', '')} | {c.get('ddtree_vs_no_spec', '')} | "
            f"{' / '.join(f'{r:.2f}' for r in c.get('ddtree_vs_no_spec_by_file', []))} | "
            f"{paired} | {tau.get('dflash', '')} / {tau.get('ddtree', '')} | "
            f"{s.get('no-spec', '')} / {s.get('dflash', '')} / {s.get('ddtree', '')} | {latest} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="bench/run.py result JSON(s), .json or .json.gz")
    ap.add_argument("--held-out", required=True, help="the prompt set held out from tuning")
    ap.add_argument("--out", required=True)
    ap.add_argument("--table", help="also write the markdown table here")
    ap.add_argument("--ddtree")
    ap.add_argument("--dflash")
    args = ap.parse_args(argv)
    docs = [read_json(f) for f in args.files]
    cells = summarise(gather(docs, args.ddtree, args.dflash))
    for c in cells:
        if "latest" in c:
            c["latest"]["file"] = os.path.basename(args.files[c["latest"]["file"]])
    revs = sorted({d.get("git_rev") for d in docs if d.get("git_rev")})
    doc = {"git_rev": revs[0] if len(revs) == 1 else revs,
           "prompt_set_held_out": args.held_out,
           "command": "python3 bench/goals.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "sources": [{"file": os.path.basename(f), "command": d.get("command"),
                        "engine_order": [e["config"] for e in d.get("engines", [])],
                        "gpu": d.get("gpu")}
                       for f, d in zip(args.files, docs)],
           "goal": f"DDTree >= {GOAL_RATIO}x the better of plain decoding and the chain",
           "cells": cells}
    with open(args.out, "w") as f:
        f.write(dumps_rows(doc, "cells"))
    if args.table:
        with open(args.table, "w") as f:
            f.write(table(cells))
    met = sum(1 for c in cells if c.get("goal_met"))
    alternated = sum(1 for c in cells if c.get("goal_met") and c["both_orders"])
    paired = sum(1 for c in cells if c.get("goal_basis") == "paired")
    latest_cells = sum(1 for c in cells if "latest" in c)
    latest_met = sum(1 for c in cells if c.get("latest", {}).get("goal_met"))
    print(f"{len(cells)} cells, goal met in {met} ({alternated} of them with DDTree's "
          f"engine started both first and last; {paired} cells judged on paired runs); "
          f"in each cell's latest file: {latest_met} of {latest_cells}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
