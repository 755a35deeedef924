"""Micro-benchmark of the DDTree algorithm kernels on one GPU.

    python bench/bench_algorithms.py [--vocab 151936] [--depth 15]

Prints milliseconds per call (CUDA events, median of repeats) for: top-K candidate
selection, the tree builder (Triton and torch backends, candidates included), the
ancestor mask + bias, the verification walk (torch ops, and the fused one-launch
Triton walk that also gathers the per-node samples), and the KV compaction of one layer.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm_ddtree.kv_compaction import accepted_slot_moves, compact_kv_cache_  # noqa: E402
from vllm_ddtree.tree_builder import build_trees, draft_topk, empty_tree  # noqa: E402
from vllm_ddtree.tree_mask import tree_ancestor_mask, tree_attention_bias  # noqa: E402
from vllm_ddtree.tree_walk import empty_walk, walk_tree, walk_tree_fused  # noqa: E402


def timeit(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    D, V = args.depth, args.vocab
    print(f"vocab={V} depth={D} logits dtype={dtype}  (times in ms)")
    print(f"{'R':>4} {'B':>4} {'topk':>7} {'tri':>7} {'torch':>7} {'mask':>7} {'walk':>7} {'fused':>7} {'kv/layer':>8}")
    for R in (1, 8, 32, 64):
        for B in (16, 64, 128, 256):
            logits = torch.randn(R, D, V, device="cuda").to(dtype)
            out = empty_tree(R, B, "cuda")
            t_topk = timeit(lambda: draft_topk(logits, B))
            t_tri = timeit(lambda: build_trees(logits, B, out=out, backend="triton"))
            t_tor = timeit(lambda: build_trees(logits, B, out=out, backend="torch"), repeats=5)
            t_mask = timeit(lambda: tree_attention_bias(tree_ancestor_mask(out.node_parents, D), dtype))
            target = out.node_tokens.clone()  # accept the first-child path
            t_walk = timeit(lambda: walk_tree(out.node_tokens, out.node_parents, out.node_valid, target, D))
            walk = walk_tree(out.node_tokens, out.node_parents, out.node_valid, target, D)
            # fused: node_samples by logit row (every request verifies its full tree)
            samples = target.reshape(-1)
            cu = (torch.arange(R + 1, device="cuda") * (B + 1)).to(torch.int32)
            idx = torch.arange(R, device="cuda", dtype=torch.int32)
            wbuf = empty_walk(R, D, "cuda")
            t_fused = timeit(lambda: walk_tree_fused(samples, cu, idx, out.node_tokens, out.node_parents,
                                                     out.node_valid, D, out=wbuf))
            bs, heads, hs = 16, 8, 128
            nb = R * ((B + 1) // bs + 2) + 1
            kv = torch.randn(nb, bs, heads, 2 * hs, device="cuda").to(dtype).permute(0, 2, 1, 3)
            tree_slots = (torch.arange(R, device="cuda")[:, None] * ((B + 1) // bs + 2) * bs
                          + torch.arange(B + 1, device="cuda"))
            src, dst = accepted_slot_moves(walk.accepted_nodes, tree_slots)
            t_kv = timeit(lambda: compact_kv_cache_(kv, src, dst, moves_per_group=D + 1))
            print(f"{R:>4} {B:>4} {t_topk:7.3f} {t_tri:7.3f} {t_tor:7.3f} {t_mask:7.3f} {t_walk:7.3f} {t_fused:7.3f} {t_kv:8.3f}")
            del logits, kv


if __name__ == "__main__":
    main()
