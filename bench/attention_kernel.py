"""Triton's unified attention (vLLM's TRITON_ATTN kernel with the series' tree bias) on
one decode step, timed outside the engine, two ways of running it on the same inputs:
with and without the tree-bias argument (``--compare bias``), or on vLLM's 2D grid
against its 3D, split-softmax one (``--compare split``).

Why: at Qwen3-8B's shape and batch 16 the kernel took 606-611 us a step in DDTree's
drafting-off steps against 513 us in plain decoding's on the same backend
(bench/results/2026-12-04-gap-profile-cost8b-budget-0-batch-16-kernels/). DDTree's CUDA
graphs are captured with the bias, so its one-token steps run the variant compiled
with it (``USE_QQ_BIAS``), though a one-token query's bias is zero. This separates that
variant's own cost from everything else that differs between the engines (graph
capture, KV-cache placement, sequence lengths):

    python3 bench/attention_kernel.py --out $OUT/attention-kernel.json

Each cell (batch size, KV-block placement) runs both variants on identical inputs,
each in a CUDA graph of ``--calls`` back-to-back kernel calls (as the 36 layers of a
forward would), replayed ``--replays`` times per round, rounds alternating the order
(A B, B A, ...); it reports each variant's microseconds a call (median over rounds, and
the spread) and their ratio. Decode steps are the engine's: one query token a sequence,
the 3D (split-softmax) kernel up to vLLM's threshold, the 2D kernel above it.
``--placement interleaved`` gives a sequence every other KV block, as a block pool
shared with a second KV-cache group (the drafter's) hands them out.

``--compare split --shape smollm2``: the kernel without the bias on the 2D grid (one
program per sequence and KV head) and on the 3D grid (``NUM_PAR_SOFTMAX_SEGMENTS``
segments a sequence, then the segments' reduction), whatever vLLM's threshold would
pick. Why: at batch 64 on the benchmark pair a budget-0 step's attention, on the 2D
grid (vLLM's threshold is 128 // 3 KV heads -> 40 sequences), took 521 us a step
against FlashAttention's ~403 us in plain decoding; at batch 4, on the 3D grid, 170
against 272 (bench/results/2026-12-06-gap-profile-budget-0-batch-64-kernels/).

On a machine without CUDA, ``--device cpu`` runs each variant once at a small shape in
Triton's interpreter (``TRITON_INTERPRET=1``) and checks both against a dense reference
(nothing is timed); on the GPU every cell is checked the same way before it is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Qwen3-8B's attention: 32 query heads, 8 KV heads of 128.
SHAPE_8B = dict(q_heads=32, kv_heads=8, head_size=128)
# The cost8b suite's random prompts (64-255 tokens) after 0-63 generated tokens.
SEQ_LEN_RANGE = (64, 320)
# The benchmark pair's target, SmolLM2-135M: 9 query heads, 3 KV heads of 64, 30 layers;
# goal cells decode 192 tokens after chat prompts of a few dozen to a few hundred tokens.
SHAPES = {"qwen3-8b": (SHAPE_8B, SEQ_LEN_RANGE, 36),
          "smollm2": (dict(q_heads=9, kv_heads=3, head_size=64), (32, 600), 30)}


def unified_attention_module():
    """The installed vLLM's kernel module; it must carry the series' per-request bias."""
    from vllm.v1.attention.ops import triton_unified_attention as ua

    with open(ua.__file__) as f:
        if "qq_bias_stride_req" not in f.read():
            raise SystemExit(f"{ua.__file__} lacks the tree bias: apply the series (./apply.sh)")
    return ua


def three_d_threshold(kv_heads: int, capture_sizes: list[int]) -> int:
    """vLLM's TritonAttentionMetadataBuilder: the 3D kernel runs up to this many sequences
    (128 // KV heads, moved to the nearest CUDA-graph capture size)."""
    from vllm.v1.attention.backends.triton_attn import MIN_LAUNCH_GRID_SIZE_2D

    target = MIN_LAUNCH_GRID_SIZE_2D // kv_heads
    return min(capture_sizes, key=lambda x: abs(x - target))


def build_inputs(num_seqs: int, *, q_heads: int, kv_heads: int, head_size: int,
                 block_size: int, tree_nodes: int, placement: str, dtype: torch.dtype,
                 device: str, seed: int, seq_len_range=SEQ_LEN_RANGE,
                 three_d_max_seqs: int | None = None, segments: int = 16) -> dict:
    """One decode step: ``num_seqs`` sequences of one query token each, their KV in a
    paged cache laid out as vLLM's Triton backend reads it (logical (blocks, heads,
    block, 2 x head) stored block-major, split into K and V views)."""
    # Imported here: it imports Triton, which must not be imported while pytest collects
    # this module (tests/unit/conftest.py picks Triton's interpreter before that).
    from vllm_ddtree.tree_attention import allocate_tree_attn_bias

    gen = torch.Generator().manual_seed(seed)
    lo, hi = seq_len_range
    seq_lens = torch.randint(lo, hi + 1, (num_seqs,), generator=gen, dtype=torch.int32)
    blocks_per_seq = [(int(s) + block_size - 1) // block_size for s in seq_lens]
    max_blocks = max(blocks_per_seq)
    stride = 2 if placement == "interleaved" else 1
    num_blocks = stride * sum(blocks_per_seq) + 1
    block_table = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
    nxt = 0
    for s, nb in enumerate(blocks_per_seq):
        for b in range(nb):
            block_table[s, b] = nxt
            nxt += stride
    kv = torch.randn(num_blocks, block_size, kv_heads, 2 * head_size, generator=gen).to(dtype)
    query = torch.randn(num_seqs, q_heads, head_size, generator=gen).to(dtype)
    bias = allocate_tree_attn_bias(num_seqs, tree_nodes, "cpu")  # zero rows: no tree
    threshold = three_d_max_seqs if three_d_max_seqs is not None else num_seqs
    batch = dict(
        q=query, out=torch.empty_like(query),
        cu_seqlens_q=torch.arange(num_seqs + 1, dtype=torch.int32), seqused_k=seq_lens,
        block_table=block_table, bias=bias, kv=kv,
        segm_output=torch.empty(threshold, q_heads, segments, head_size, dtype=torch.float32),
        segm_max=torch.empty(threshold, q_heads, segments, dtype=torch.float32),
        segm_expsum=torch.empty(threshold, q_heads, segments, dtype=torch.float32),
    )
    moved = {k: v.to(device) for k, v in batch.items()}
    # K and V: views into one cache tensor, as the backend splits it.
    moved["k"], moved["v"] = moved.pop("kv").split(head_size, dim=-1)
    moved.update(threshold=threshold, segments=segments, max_seq_len=int(seq_lens.max()),
                 head_size=head_size, kv_heads=kv_heads)
    return moved


def variants(compare: str, num_seqs: int, threshold: int) -> dict[str, tuple[bool, int]]:
    """Each timed variant: (tree-bias argument passed, the kernel's 3D threshold). The
    3D grid runs when the batch is at most the threshold (vLLM's rule)."""
    if compare == "bias":
        return {"no-bias": (False, threshold), "bias": (True, threshold)}
    return {"2d": (False, 0), "3d": (False, num_seqs)}


def call_kernel(ua, b: dict, with_bias: bool, threshold: int) -> None:
    ones = torch.ones(b["q"].shape[0], b["kv_heads"], device=b["q"].device)
    ua.unified_attention(
        q=b["q"], k=b["k"], v=b["v"], out=b["out"], cu_seqlens_q=b["cu_seqlens_q"],
        max_seqlen_q=1, seqused_k=b["seqused_k"], max_seqlen_k=b["max_seq_len"],
        softmax_scale=b["head_size"] ** -0.5, causal=True, window_size=(-1, -1),
        block_table=b["block_table"], softcap=0, q_descale=None, k_descale=ones,
        v_descale=ones, seq_threshold_3D=threshold,
        num_par_softmax_segments=b["segments"], softmax_segm_output=b["segm_output"],
        softmax_segm_max=b["segm_max"], softmax_segm_expsum=b["segm_expsum"],
        qq_bias=b["bias"] if with_bias else None)


def reference_decode(b: dict) -> torch.Tensor:
    """Dense attention of each sequence's one query token over its paged KV (float32)."""
    q, k, v = b["q"].float().cpu(), b["k"].float().cpu(), b["v"].float().cpu()
    group = q.shape[1] // k.shape[2]
    block = k.shape[1]
    out = torch.empty_like(q)
    for s, n in enumerate(b["seqused_k"].tolist()):
        blocks = b["block_table"][s, : (n + block - 1) // block].cpu().long()
        keys = k[blocks].reshape(-1, k.shape[2], k.shape[3])[:n].repeat_interleave(group, dim=1)
        vals = v[blocks].reshape(-1, v.shape[2], v.shape[3])[:n].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[s], keys) * b["head_size"] ** -0.5
        out[s] = torch.einsum("hn,nhd->hd", scores.softmax(-1), vals)
    return out


def output_errors(ua, b: dict, compare: str = "bias") -> dict:
    """Both variants against the dense reference (a one-token query's bias is zero, and
    the grid only splits the work, so both must match it)."""
    ref = reference_decode(b)
    errs = {}
    for variant, (with_bias, threshold) in variants(compare, b["q"].shape[0],
                                                   b["threshold"]).items():
        b["out"].zero_()
        call_kernel(ua, b, with_bias, threshold)
        errs[variant] = float((b["out"].float().cpu() - ref).abs().max())
    return errs


def time_cell(ua, b: dict, calls: int, replays: int, rounds: int,
              compare: str = "bias") -> dict:
    """Microseconds a kernel call for each variant, from CUDA graphs of ``calls`` calls."""
    graphs = {}
    specs = variants(compare, b["q"].shape[0], b["threshold"])
    for variant, (with_bias, threshold) in specs.items():
        call_kernel(ua, b, with_bias, threshold)  # compile outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                call_kernel(ua, b, with_bias, threshold)
        graphs[variant] = g
    names = list(specs)
    per_call: dict[str, list[float]] = {v: [] for v in names}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for variant in order:
            graphs[variant].replay()  # warm
            start.record()
            for _ in range(replays):
                graphs[variant].replay()
            end.record()
            end.synchronize()
            per_call[variant].append(1000.0 * start.elapsed_time(end) / (replays * calls))
    out = {}
    for variant, xs in per_call.items():
        med = statistics.median(xs)
        out[variant] = {"us_per_call": round(med, 3),
                        "spread": round((max(xs) - min(xs)) / med, 4), "rounds": len(xs)}
    key = "bias_over_no_bias" if compare == "bias" else "3d_over_2d"
    out[key] = round(out[names[1]]["us_per_call"] / out[names[0]]["us_per_call"], 4)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--compare", default="bias", choices=["bias", "split"],
                    help="bias: with / without the tree bias at vLLM's grid choice; "
                         "split: the 2D grid against the 3D one, without the bias")
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES),
                    help="the target's attention heads and its sequence lengths")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--placements", nargs="+", default=["contiguous", "interleaved"],
                    choices=["contiguous", "interleaved"])
    ap.add_argument("--tree-nodes", type=int, default=65,
                    help="the bias's Q: budget + 1 (DDTree's default budget 64)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--calls", type=int, default=None,
                    help="kernel calls a graph (default: the shape's layers)")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the JSON here (also printed)")
    a = ap.parse_args(argv)

    ua = unified_attention_module()
    record: dict = {"command": " ".join(["python3", "bench/attention_kernel.py", *(argv or sys.argv[1:])]),
                    "device": a.device, "compare": a.compare, "cells": []}
    if a.device == "cpu":
        # Interpreter check: a small shape, each variant once, outputs compared.
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--device cpu needs TRITON_INTERPRET=1 (Triton's interpreter)")
        shape = dict(q_heads=4, kv_heads=2, head_size=32)
        for n in a.batch_sizes:
            for placement in a.placements:
                b = build_inputs(n, **shape, block_size=a.block_size, tree_nodes=a.tree_nodes,
                                 placement=placement, dtype=torch.float32, device="cpu",
                                 seed=a.seed, seq_len_range=(5, 40), three_d_max_seqs=n)
                record["cells"].append({"batch": n, "placement": placement,
                                        "max_abs_err": output_errors(ua, b, a.compare)})
    else:
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device (use --device cpu for the check)")
        record["gpu"] = torch.cuda.get_device_name()
        heads, seq_lens, layers = SHAPES[a.shape]
        calls = a.calls or layers
        record["shape"] = dict(heads, name=a.shape, block_size=a.block_size,
                               tree_nodes=a.tree_nodes, seq_len_range=list(seq_lens),
                               dtype="bfloat16", calls_per_graph=calls)
        # vLLM's default capture sizes up to 512 tokens.
        capture_sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))
        threshold = three_d_threshold(heads["kv_heads"], capture_sizes)
        record["three_d_max_seqs"] = threshold
        t0 = time.time()
        for n in a.batch_sizes:
            for placement in a.placements:
                b = build_inputs(n, **heads, block_size=a.block_size, tree_nodes=a.tree_nodes,
                                 placement=placement, dtype=torch.bfloat16, device="cuda",
                                 seed=a.seed, seq_len_range=seq_lens,
                                 three_d_max_seqs=max(threshold, n))
                b["threshold"] = threshold  # vLLM's choice; the buffers hold a 3D batch of n
                cell = {"batch": n, "placement": placement,
                        "vllm_kernel": "3d" if n <= threshold else "2d",
                        "max_abs_err": output_errors(ua, b, a.compare)}
                cell.update(time_cell(ua, b, calls, a.replays, a.rounds, a.compare))
                record["cells"].append(cell)
                print(json.dumps(cell), flush=True)
        record["wall_s"] = round(time.time() - t0, 1)
    text = json.dumps(record, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text)
    worst = max(e for c in record["cells"] for e in c["max_abs_err"].values())
    tol = 1e-4 if a.device == "cpu" else 3e-2  # bf16 on the GPU
    if worst > tol:
        print(f"attention_kernel: a variant is {worst} off the dense reference (> {tol})",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
