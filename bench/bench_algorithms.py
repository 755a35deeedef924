"""Micro-benchmark of the DDTree algorithm kernels on one GPU.

    python bench/bench_algorithms.py [--vocab 151936] [--depth 15]

Prints milliseconds per call (CUDA events, median of repeats) for: top-K candidate
selection, the tree builder (Triton and torch backends, candidates included), the
ancestor mask + bias, the per-request attention bias the verification reads (torch
write_tree_attn_bias with its gather + has_tree, and the fused one-launch Triton
write_tree_attn_bias_fused), the verification walk (torch ops, and the fused one-launch Triton
walk that also gathers the per-node samples: ``wfused``), the KV compaction of one layer, and
the whole accepted-path compaction of ``--layers`` layers + hidden states: ``kvLx`` =
one ``compact_kv_cache_`` launch per layer (KV only, moves precomputed, as the
speculator did), ``kvfused`` = ``compact_accepted_path_`` (one launch, KV of all layers
+ hidden rows).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm_ddtree.kv_compaction import (  # noqa: E402
    accepted_slot_moves,
    build_kv_ptr_table,
    compact_accepted_path_,
    compact_kv_cache_,
)
from vllm_ddtree.tree_attention import (  # noqa: E402
    allocate_tree_attn_bias,
    write_tree_attn_bias,
    write_tree_attn_bias_fused,
)
from vllm_ddtree.tree_builder import build_trees, draft_topk, empty_tree  # noqa: E402
from vllm_ddtree.tree_mask import tree_ancestor_mask  # noqa: E402
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
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=4096)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    D, V = args.depth, args.vocab
    print(f"vocab={V} depth={D} logits dtype={dtype}  (times in ms)")
    print(f"{'R':>4} {'B':>4} {'topk':>7} {'tri':>7} {'torch':>7} {'mask':>7} {'bias':>7} {'bfused':>7} {'walk':>7} {'wfused':>7} {'kv/layer':>8} {'kvLx':>7} {'kvfused':>7}")
    for R in (1, 8, 32, 64):
        for B in (16, 64, 128, 256):
            logits = torch.randn(R, D, V, device="cuda").to(dtype)
            out = empty_tree(R, B, "cuda")
            t_topk = timeit(lambda: draft_topk(logits, B))
            t_tri = timeit(lambda: build_trees(logits, B, out=out, backend="triton"))
            t_tor = timeit(lambda: build_trees(logits, B, out=out, backend="torch"), repeats=5)
            t_mask = timeit(lambda: tree_ancestor_mask(out.node_parents))
            # Per-request bias as prepare_tree_verification writes it (buffer has
            # 2R rows of states; idx_mapping a permutation; every request a full tree).
            bias = allocate_tree_attn_bias(2 * R, B + 1, "cuda")
            by_state = torch.cat([out.node_parents, out.node_parents])
            idx = torch.randperm(2 * R, device="cuda")[:R].to(torch.int32)
            cu = (torch.arange(R + 1, device="cuda") * (B + 1)).to(torch.int32)
            t_bias = timeit(lambda: write_tree_attn_bias(
                bias, by_state[idx], (cu[1:R + 1] - cu[:R]) > 1))
            t_fused = timeit(lambda: write_tree_attn_bias_fused(bias, by_state, idx, cu, D))
            target = out.node_tokens.clone()  # accept the first-child path
            t_walk = timeit(lambda: walk_tree(out.node_tokens, out.node_parents, out.node_valid, target, D))
            walk = walk_tree(out.node_tokens, out.node_parents, out.node_valid, target, D)
            # fused: node_samples by logit row (every request verifies its full tree)
            samples = target.reshape(-1)
            wcu = (torch.arange(R + 1, device="cuda") * (B + 1)).to(torch.int32)
            widx = torch.arange(R, device="cuda", dtype=torch.int32)
            wbuf = empty_walk(R, D, "cuda")
            t_wfused = timeit(lambda: walk_tree_fused(samples, wcu, widx, out.node_tokens, out.node_parents,
                                                     out.node_valid, D, out=wbuf))
            bs, heads, hs = 16, 8, 128
            nb = R * ((B + 1) // bs + 2) + 1
            kv = torch.randn(nb, bs, heads, 2 * hs, device="cuda").to(dtype).permute(0, 2, 1, 3)
            tree_slots = (torch.arange(R, device="cuda")[:, None] * ((B + 1) // bs + 2) * bs
                          + torch.arange(B + 1, device="cuda"))
            src, dst = accepted_slot_moves(walk.accepted_nodes, tree_slots)
            t_kv = timeit(lambda: compact_kv_cache_(kv, src, dst, moves_per_group=D + 1))
            # all layers: per-layer launches vs one fused launch (+ hidden states)
            kvs = [kv] + [torch.empty_like(kv.permute(0, 2, 1, 3)).permute(0, 2, 1, 3)
                          for _ in range(args.layers - 1)]
            hidden = torch.randn(R * (B + 1), args.hidden, device="cuda").to(dtype)
            qsl = torch.arange(R + 1, device="cuda", dtype=torch.int32) * (B + 1)
            slot_mapping = tree_slots.flatten()
            table = build_kv_ptr_table(kvs)

            def per_layer():
                for c in kvs:
                    compact_kv_cache_(c, src, dst, moves_per_group=D + 1)

            t_loop = timeit(per_layer)
            t_kvfused = timeit(lambda: compact_accepted_path_(
                kvs, hidden, walk.accepted_nodes, walk.num_accepted, qsl, slot_mapping,
                kv_ptr_table=table))
            print(f"{R:>4} {B:>4} {t_topk:7.3f} {t_tri:7.3f} {t_tor:7.3f} {t_mask:7.3f} {t_bias:7.3f} {t_fused:7.3f} {t_walk:7.3f} {t_wfused:7.3f} {t_kv:8.3f}"
                  f" {t_loop:7.3f} {t_kvfused:7.3f}")
            del logits, kv, kvs, hidden


if __name__ == "__main__":
    main()
