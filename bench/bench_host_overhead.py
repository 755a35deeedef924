#!/usr/bin/env python3
"""Host (Python) time of the DDTree speculator's per-step kernel wrappers.

At batch 1 on the benchmark pair the GPU idles ~85 % of a step (bench/results/profile/):
the host's work sets the pace. This times what our wrappers cost the host per call:
argument checks, small tensor ops, allocation, and the Triton launch path up to the
launcher. The kernels themselves are replaced by a no-op, so it runs on any machine
(CPU tensors; Triton's launcher, ~20-40 us per launch on the GPU host, is not
included) and isolates the part of the host time we control.

    python bench/bench_host_overhead.py [--batch-sizes 1 16 64] [--iters 2000]

Prints one JSON line per (wrapper, batch size): microseconds per call.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"  # the wrappers then take their Triton path on CPU
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from vllm_ddtree import _triton  # noqa: E402


class _NoLaunch:
    """Stands in for a jitted kernel: ``kernel[grid](*args)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def stub_kernels() -> None:
    for mod in ("tree_attention", "tree_mask", "tree_walk", "kv_compaction", "tree_builder"):
        m = __import__(f"vllm_ddtree.{mod}", fromlist=["jit"])
        m.jit = lambda fn: _NoLaunch()


def step_inputs(batch: int, budget: int = 32, depth: int = 15, layers: int = 30,
                hidden: int = 576, num_states: int = 256):
    n = budget + 1
    g = torch.Generator().manual_seed(0)
    num_tokens = batch * n
    idx = torch.randperm(num_states, generator=g)[:batch].to(torch.int32)
    cu = torch.arange(0, num_tokens + 1, n, dtype=torch.int32)
    return dict(
        bias=torch.zeros(num_states, n, n),
        parents=torch.zeros(num_states, n, dtype=torch.int32),
        depths=torch.ones(num_states, n, dtype=torch.int32),
        tokens=torch.zeros(num_states, n, dtype=torch.int64),
        valid=torch.ones(num_states, n, dtype=torch.bool),
        idx=idx,
        cu=cu,
        qsl=cu.clone(),
        positions=torch.arange(num_tokens, dtype=torch.int64),
        rows=torch.arange(num_tokens, dtype=torch.int64),
        local=torch.arange(n, dtype=torch.int32).repeat(batch),
        expanded_idx=idx.repeat_interleave(n),
        linear=torch.zeros(num_tokens, dtype=torch.int64),
        samples=torch.zeros(num_tokens, dtype=torch.int64),
        hidden=torch.zeros(num_tokens, hidden),
        slots=torch.arange(num_tokens, dtype=torch.int64),
        kv=[torch.zeros(64, 3, 16, 128) for _ in range(layers)],
        depth=depth,
    )


def timed(fn, iters: int) -> float:
    for _ in range(20):
        fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--iters", type=int, default=2000)
    args = ap.parse_args(argv)
    stub_kernels()
    from vllm_ddtree.kv_compaction import build_kv_ptr_table, compact_accepted_path_
    from vllm_ddtree.tree_attention import write_tree_attn_bias_fused
    from vllm_ddtree.tree_builder import empty_tree, store_trees_by_state_
    from vllm_ddtree.tree_mask import rewrite_tree_positions_
    from vllm_ddtree.tree_walk import TreeWalk, walk_tree_fused

    for batch in args.batch_sizes:
        x = step_inputs(batch)
        d = x["depth"]
        table = build_kv_ptr_table(x["kv"])
        trees = empty_tree(256, 32)
        acc = torch.zeros(batch, d + 1, dtype=torch.int64)
        num_acc = torch.zeros(batch, dtype=torch.int32)

        def walk():
            out = TreeWalk(torch.empty((batch, d + 1), dtype=torch.int64),
                           torch.empty(batch, dtype=torch.int32),
                           torch.empty((batch, d + 1), dtype=torch.int64),
                           torch.empty(batch, dtype=torch.int32))
            walk_tree_fused(x["samples"], x["cu"], x["idx"], x["tokens"], x["parents"],
                            x["valid"], d, out=out)

        calls = {
            "tree_bias": lambda: write_tree_attn_bias_fused(x["bias"], x["parents"], x["idx"],
                                                            x["cu"], d),
            "tree_positions": lambda: rewrite_tree_positions_(
                x["positions"], x["rows"], x["local"], x["expanded_idx"], x["depths"],
                x["linear"]),
            "walk": walk,
            "compaction_with_positions": lambda: compact_accepted_path_(
                x["kv"], x["hidden"], acc, num_acc, x["qsl"], x["slots"], kv_ptr_table=table,
                positions=x["positions"], check_table=False),
            "compaction_checked_table": lambda: compact_accepted_path_(
                x["kv"], x["hidden"], acc, num_acc, x["qsl"], x["slots"], kv_ptr_table=table),
            "positions_restore_index_put": lambda: x["positions"].__setitem__(
                x["rows"], x["linear"]),
            "store_trees_by_state": lambda: store_trees_by_state_(
                trees, x["idx"], x["tokens"], x["parents"], x["depths"], x["valid"]),
            "store_trees_four_index_put": lambda: (
                x["tokens"].__setitem__(x["idx"], trees.node_tokens[:batch]),
                x["parents"].__setitem__(x["idx"], trees.node_parents[:batch]),
                x["depths"].__setitem__(x["idx"], trees.node_depths[:batch]),
                x["valid"].__setitem__(x["idx"], trees.node_valid[:batch])),
        }
        for name, fn in calls.items():
            print(json.dumps({"wrapper": name, "batch": batch,
                              "host_us_per_call": round(timed(fn, args.iters), 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
