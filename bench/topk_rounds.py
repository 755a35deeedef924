"""Top-K candidate selection over drafter logits on one GPU: one ``torch.topk`` per row
(what ``vllm_ddtree.tree_builder.draft_topk`` runs) against a selection in rounds
(:func:`topk_in_rounds`: the K largest of each slice of ``chunk`` tokens, then of those
candidates), at the drafting step's shapes.

The question: over vocabulary-sized rows ``torch.topk`` runs its multi-block radix
selection, several passes over the logits (at batch 64 ~0.3 ms a call, the largest
kernels of a drafting step after attention in
bench/results/2026-12-07-gap-profile-batch-16-64-drafting-host-h100/); would one pass over
short slices be cheaper? Measured on an H100: no, rounds were slower in almost every
cell (bench/results/2026-12-07-drafter-top-k-in-rounds-h100/), so the drafter keeps
``torch.topk``.

For each vocabulary (the benchmark pair's 49,152; Qwen3's 151,936), batch ``R`` and tree
level ``B`` the drafter's head selects ``K = B`` candidates at ``min(15, B)`` positions
of each request (``draft_shape``). Per call: GPU time (CUDA events around one call,
median of repeats, as bench/bench_algorithms.py times kernels) and the time of 50
back-to-back calls divided by 50 (host launches and GPU together: what an eager head
pays when the host runs ahead). Every variant's
selection is checked against ``torch.topk``'s values.

    python3 bench/topk_rounds.py --out /tmp/topk-rounds.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_algorithms import timeit  # noqa: E402


def topk_in_rounds(x: torch.Tensor, k: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, ids)`` of the ``k`` largest entries along the last dimension, in no
    particular order, as ``torch.topk(x, k, sorted=False)`` selects them (which entries
    of a tie at the k-th place enter is unspecified in both), in two rounds: the ``k``
    largest of every ``chunk`` consecutive entries, then the ``k`` largest of those.
    Every one of a row's ``k`` largest entries is among the ``k`` largest of its own
    slice, so the selection is the same. Rows shorter than two slices, or ``k`` over
    half a slice, take ``torch.topk`` whole."""
    vocab = x.shape[-1]
    if not chunk or vocab < 2 * chunk or 2 * k > chunk:
        return torch.topk(x, k, dim=-1, largest=True, sorted=False)
    lead = x.shape[:-1]
    slices = vocab // chunk
    body = x[..., : slices * chunk].reshape(-1, slices, chunk)
    vals, ids = torch.topk(body, k, dim=-1, largest=True, sorted=False)
    ids += torch.arange(0, slices * chunk, chunk, device=x.device)[:, None]  # to vocab ids
    vals, ids = vals.flatten(1), ids.flatten(1)
    rest = vocab - slices * chunk
    if rest:
        rest_vals, rest_ids = torch.topk(x[..., slices * chunk:].reshape(-1, rest),
                                         min(k, rest), dim=-1, largest=True, sorted=False)
        vals = torch.cat([vals, rest_vals], dim=1)
        ids = torch.cat([ids, rest_ids + slices * chunk], dim=1)
    vals, pick = torch.topk(vals, k, dim=-1, largest=True, sorted=False)
    return vals.view(*lead, k), torch.gather(ids, 1, pick).view(*lead, k)


def loop_ms(fn, calls: int = 50, repeats: int = 5) -> float:
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1e3 / calls)
    return statistics.median(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocabs", type=int, nargs="+", default=[49152, 151936])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--levels", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--chunks", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--max-depth", type=int, default=15)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    print(f"{'V':>7} {'R':>3} {'B':>3} {'variant':>10} {'gpu_ms':>8} {'loop_ms':>8} {'vs topk':>8}")
    for vocab in args.vocabs:
        for r in args.batches:
            for level in args.levels:
                depth, k = min(args.max_depth, level), level
                logits = torch.randn(r, depth, vocab, device="cuda").to(torch.bfloat16)
                want = torch.topk(logits, k, dim=-1).values.float().sort(-1).values
                variants = {"topk": lambda: torch.topk(logits, k, dim=-1, sorted=False)}
                for c in args.chunks:
                    variants[f"rounds-{c}"] = (lambda c=c: topk_in_rounds(logits, k, c))
                base = None
                for name, fn in variants.items():
                    vals, _ = fn()
                    same = bool(torch.equal(vals.float().sort(-1).values, want))
                    g, w = timeit(fn, args.repeats), loop_ms(fn)
                    base = g if name == "topk" else base
                    rows.append({"vocab": vocab, "batch": r, "level": level, "depth": depth,
                                 "k": k, "variant": name, "gpu_ms": round(g, 4),
                                 "loop_ms": round(w, 4), "same_values": same})
                    print(f"{vocab:>7} {r:>3} {level:>3} {name:>10} {g:8.4f} {w:8.4f} "
                          f"{g / base:8.2f}{'' if same else '  DIFFERENT'}")
                del logits
    doc = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "command": "python3 bench/topk_rounds.py " + " ".join(argv or sys.argv[1:]),
           "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0 if all(r["same_values"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
