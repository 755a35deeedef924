"""The target's logits GEMM over a tree step's rows on one GPU: what one call costs the
host when its row count is one it has run before, one it has not, or rounded up to a
bucket of a few sizes.

The question: in DDTree's drafting steps the target's vocabulary projection over the
tree's rows (``compute_logits`` in the runner's ``sample()``, eager, once a step) took
~192 us of the host's own time a call in ``aten::mm`` against plain decoding's 42.5, and
its row count changes from step to step (the requests' budgets, joining and finished
requests) while plain decoding's is the batch size
(bench/results/2026-12-07-gap-profile-batch-16-64-drafting-host-h100/). Does a GEMM of a
row count the process has not run before cost the host more, and would rows rounded up
to a bucket avoid it?

For each vocabulary (the benchmark pair's 49,152 x 576; Qwen3-8B's 151,936 x 4,096) and
each way of choosing row counts, ``calls`` calls of ``F.linear(hidden[:rows], weight)``
as the runner makes them, each on an idle GPU (synchronised before it), timed on the
host around the call alone (launch and whatever the host does first; the GPU's work is
not waited for), and with CUDA events recorded before and after the call (on an idle GPU
that span holds the host's time to the launch too, then the kernel):

- ``same``: one row count every call (plain decoding's case);
- ``new``: a row count no earlier call used, every call;
- ``seen``: the ``new`` sequence again, every count run once before;
- ``bucket``: the ``new`` sequence rounded up to the next multiple of ``--bucket`` rows.

The allocator's counters (driver allocations, frees, retries) over each pass are
reported beside it.

    python3 bench/logits_rows.py --out /tmp/logits-rows.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {"smollm2": (49152, 576), "qwen3-8b": (151936, 4096)}


def row_counts(kind: str, calls: int, start: int, bucket: int) -> list[int]:
    """The row count of each call of a pass (``start``: the first new count)."""
    if kind == "same":
        return [start] * calls
    counts = [start + 1 + i for i in range(calls)]  # never the ``same`` pass's count
    if kind == "bucket":
        return [-(-n // bucket) * bucket for n in counts]
    return counts


def allocator_counters() -> dict:
    s = torch.cuda.memory_stats()
    return {k: s.get(k, 0) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}


def run_pass(weight: torch.Tensor, hidden: torch.Tensor, counts: list[int]) -> dict:
    host_us, gpu_us = [], []
    before = allocator_counters()
    for rows in counts:
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        out = F.linear(hidden[:rows], weight)
        t1 = time.perf_counter()
        b.record()
        torch.cuda.synchronize()
        host_us.append((t1 - t0) * 1e6)
        gpu_us.append(a.elapsed_time(b) * 1e3)
        del out
    after = allocator_counters()
    q = statistics.quantiles(host_us, n=10)
    return {
        "calls": len(counts),
        "distinct_rows": len(set(counts)),
        "host_us_p50": round(statistics.median(host_us), 1),
        "host_us_p10": round(q[0], 1),
        "host_us_p90": round(q[-1], 1),
        "host_us_mean": round(statistics.fmean(host_us), 1),
        "gpu_us_p50": round(statistics.median(gpu_us), 1),
        "allocator": {k: after[k] - before[k] for k in after},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--start-rows", type=int, nargs="+", default=[16, 512],
                    help="the first row count of each sequence (a batch of 16; a full tree step)")
    ap.add_argument("--bucket", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    dev = torch.device("cuda")
    cells = []
    for shape in args.shapes:
        vocab, hidden_size = SHAPES[shape]
        weight = torch.randn(vocab, hidden_size, device=dev, dtype=dtype) * 0.02
        max_rows = max(args.start_rows) + args.calls + args.bucket + 1
        hidden = torch.randn(max_rows, hidden_size, device=dev, dtype=dtype)
        F.linear(hidden[:8], weight)  # cuBLAS's handle and workspace, once
        for start in args.start_rows:
            for kind in ("same", "new", "seen", "bucket"):
                counts = row_counts("new" if kind == "seen" else kind, args.calls, start,
                                    args.bucket)
                rec = {"shape": shape, "vocab": vocab, "hidden": hidden_size,
                       "start_rows": start, "rows": kind, **run_pass(weight, hidden, counts)}
                cells.append(rec)
                print(json.dumps(rec), flush=True)
        del weight, hidden
        torch.cuda.empty_cache()
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "dtype": args.dtype, "bucket": args.bucket,
           "cells": cells}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
