#!/usr/bin/env python3
"""Host (Python) time of the DDTree speculator's per-step kernel wrappers.

At batch 1 on the benchmark pair the GPU idles ~85 % of a step (bench/results/profile/):
the host's work sets the pace. This times what our wrappers cost the host per call:
argument checks, small tensor ops, allocation, and the Triton launch path up to the
launcher. The kernels themselves are replaced by a no-op, so it runs on any machine
(CPU tensors; Triton's launch, 15-31 us per call on the GPU host by
``--device cuda``, is not included) and isolates the part of the host time we control.

    python bench/bench_host_overhead.py [--batch-sizes 1 16 64] [--iters 2000]

``--device cuda`` (GPU host) runs the real kernels instead, each wrapper with Triton's
launch path and with the direct launcher (``VLLM_DDTREE_DIRECT_LAUNCH``), and adds baselines: a
Triton launch with 1 and with 24 arguments, small torch ops, and the replay of CUDA
graphs of 50 and 400 tiny kernels. Host time per call is the time to issue the calls
(the GPU work is tiny and asynchronous), synchronised once at the end.

Prints one JSON line per (wrapper, batch size): microseconds per call.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

DEVICE = "cuda" if "--device=cuda" in sys.argv or (
    "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1:][:1] == ["cuda"]) else "cpu"
if DEVICE == "cpu":
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
        if hasattr(m, "launcher"):
            m.launcher = lambda fn: _NoLaunch()


def step_inputs(batch: int, budget: int = 32, depth: int = 15, layers: int = 30,
                hidden: int = 576, num_states: int = 256, device: str = "cpu"):
    n = budget + 1
    g = torch.Generator().manual_seed(0)
    num_tokens = batch * n
    idx = torch.randperm(num_states, generator=g)[:batch].to(torch.int32)
    cu = torch.arange(0, num_tokens + 1, n, dtype=torch.int32)
    out = dict(
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
    )
    out = {k: ([t.to(device) for t in v] if isinstance(v, list) else v.to(device))
           for k, v in out.items()}
    out["depth"] = depth
    return out


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, iters: int, device: str = "cpu") -> float:
    for _ in range(20):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    issued = time.perf_counter() - t0
    sync(device)
    return issued / iters * 1e6


def gpu_baselines(iters: int) -> dict:
    """Launch-cost yardsticks on the GPU host: Triton launches of a kernel with 1 and
    with 24 arguments, two small torch ops, and CUDA-graph replays."""
    from vllm_ddtree._triton import jit, run_compiled, tl

    def one_arg(x_ptr):
        tl.store(x_ptr, 1)

    def many_args(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11,
                  n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11):
        tl.store(p0, n0 + n1 + n2 + n3 + n4 + n5 + n6 + n7 + n8 + n9 + n10 + n11)

    x = torch.zeros(16, dtype=torch.int32, device="cuda")
    ptrs = [torch.zeros(16, dtype=torch.int32, device="cuda") for _ in range(12)]
    ints = [3 + i for i in range(12)]
    k1, k24 = jit(one_arg), jit(many_args)
    idx = torch.arange(8, device="cuda")
    calls = {
        "triton_launch_1_arg": lambda: k1[(1,)](x),
        "triton_launch_24_args": lambda: k24[(1,)](*ptrs, *ints),
        "torch_index_select": lambda: torch.index_select(x, 0, idx),
        "torch_empty_4": lambda: [torch.empty(8, device="cuda") for _ in range(4)],
    }
    # The compiled kernel launched directly (no binder, cache key or globals check):
    # what a launcher that skips Triton's per-call Python path would cost.
    compiled = k24[(1,)](*ptrs, *ints)
    from triton.runtime.driver import driver

    def direct():
        stream = driver.active.get_current_stream(torch.cuda.current_device())
        run_compiled(compiled, (1,), stream, (*ptrs, *ints))

    calls["triton_direct_launch_24_args"] = direct
    for nodes in (50, 400):
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            x.add_(1)
            with torch.cuda.graph(g):
                for _ in range(nodes):
                    x.add_(1)
        torch.cuda.current_stream().wait_stream(s)
        calls[f"cuda_graph_replay_{nodes}_kernels"] = g.replay
    return {name: timed(fn, iters, "cuda") for name, fn in calls.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cpu: kernels stubbed out (any machine); cuda: real kernels")
    args = ap.parse_args(argv)
    dev = args.device
    if dev != DEVICE:
        raise SystemExit("--device must be given on the command line (it is read at import)")
    if dev == "cpu":
        stub_kernels()
    else:
        for name, us in gpu_baselines(args.iters).items():
            print(json.dumps({"wrapper": name, "device": dev, "host_us_per_call": round(us, 1)}),
                  flush=True)
    from vllm_ddtree.kv_compaction import build_kv_ptr_table, compact_accepted_path_
    from vllm_ddtree.tree_attention import write_tree_attn_bias_fused
    from vllm_ddtree.tree_builder import empty_tree, store_trees_by_state_
    from vllm_ddtree.tree_mask import rewrite_tree_positions_
    from vllm_ddtree.tree_walk import TreeWalk, walk_tree_fused

    for batch in args.batch_sizes:
        x = step_inputs(batch, device=dev)
        d = x["depth"]
        table = build_kv_ptr_table(x["kv"])
        trees = empty_tree(256, 32, dev)
        acc = torch.zeros(batch, d + 1, dtype=torch.int64, device=dev)
        num_acc = torch.zeros(batch, dtype=torch.int32, device=dev)

        def walk():  # as DDTreeSampler allocates its outputs
            paths = torch.empty((2, batch, d + 1), dtype=torch.int64, device=dev)
            counts = torch.empty((2, batch), dtype=torch.int32, device=dev)
            out = TreeWalk(paths[0], counts[0], paths[1], counts[1])
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
            # As the speculator copied them before store_trees_by_state_ (int32 index;
            # the reference adds a .long(), which this measurement must not).
            "store_trees_four_index_put": lambda: (
                x["tokens"].__setitem__(x["idx"], trees.node_tokens[:batch]),
                x["parents"].__setitem__(x["idx"], trees.node_parents[:batch]),
                x["depths"].__setitem__(x["idx"], trees.node_depths[:batch]),
                x["valid"].__setitem__(x["idx"], trees.node_valid[:batch])),
        }
        # On the GPU host each wrapper is timed with Triton's launch path and with the
        # direct launcher (VLLM_DDTREE_DIRECT_LAUNCH, read at every launch).
        modes = ["triton", "direct"] if dev == "cuda" else [None]
        for mode in modes:
            if mode is not None:
                os.environ[_triton.DIRECT_LAUNCH_ENV] = "1" if mode == "direct" else "0"
            for name, fn in calls.items():
                row = {"wrapper": name, "batch": batch, "device": dev}
                if mode is not None:
                    row["launch"] = mode
                row["host_us_per_call"] = round(timed(fn, args.iters, dev), 1)
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
