"""Host time of what DDTree adds to a budget-0 decode step (CPU only).

A step that verifies no drafts and drafts none (the online controller's budget 0) is
what a user pays on every step while drafting does not pay. Beyond plain decoding's
step it runs two things of ours on the host: the drafter's context into the deferral
buffer (``DeferredContext.append``) and the reset of trees left by the last drafting
step (``TreeVerifier.clear_trees``). At batch 1 of a small target the host sets the
step's pace, so their host time is the step's. This times both on the inputs the runner
hands them: each step new views of the same persistent buffers (the runner's positions
and slot mappings, the target graph's auxiliary outputs), ``batch`` requests of one
token, a buffer of ``max(256, 4 * max_num_seqs)`` tokens flushed when full (the flush is
timed too, spread over the steps), and the tree reset after one drafting step.

    python3 bench/budget0_host.py --out bench/results/<dir>/budget0-host.json

``--baseline REV`` also times the two modules (``vllm_ddtree/deferred_context.py``,
``vllm_ddtree/tree_verifier.py``) of git revision REV, the two taken in turns for
``--rounds`` rounds, and reports each cell's median of the paired ratios this tree /
REV. On CPU tensors (the default) the copies themselves run on the host; with
``--device cuda`` every tensor is on the GPU, each copy is a kernel launch as in the
engine, and the figure is the host time of those launches (the GPU is synchronised
only at the end of each timed loop, as the engine's budget-0 steps never wait for it).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.online_budget_host import module_at, paired_ratios, write_result  # noqa: E402

# The benchmark pair's drafter: three auxiliary states of the target's width 576.
AUX_LAYERS, HIDDEN = 3, 576
MAX_NUM_SEQS = 256


def modules(rev: str | None):
    """(DeferredContext, TreeVerifier) of this tree, or of git revision ``rev``."""
    if rev is None:
        from vllm_ddtree.deferred_context import DeferredContext
        from vllm_ddtree.tree_verifier import TreeVerifier
        return DeferredContext, TreeVerifier
    tag = rev.replace("-", "_").replace("/", "_")
    return (module_at(rev, "vllm_ddtree/deferred_context.py", f"deferred_context_{tag}").DeferredContext,
            module_at(rev, "vllm_ddtree/tree_verifier.py", f"tree_verifier_{tag}").TreeVerifier)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_budget0_steps(deferred_cls, verifier_cls, batch: int, steps: int,
                       device: str = "cpu") -> dict:
    """Microseconds a step of ``append`` + ``clear_trees`` over ``steps`` budget-0
    steps of ``batch`` requests, after one drafting step stored their trees."""
    dev = torch.device(device)
    max_tokens = 1024
    aux_out = [torch.zeros(max_tokens, HIDDEN, dtype=torch.bfloat16, device=dev)
               for _ in range(AUX_LAYERS)]
    positions_buf = torch.zeros(max_tokens, dtype=torch.int64, device=dev)
    slot_mappings = torch.zeros(1, max_tokens, dtype=torch.int64, device=dev)
    slot_rows = (slot_mappings[0],)
    deferred = deferred_cls(max(256, 4 * MAX_NUM_SEQS), AUX_LAYERS * HIDDEN, torch.bfloat16,
                            dev)
    verifier = verifier_cls(MAX_NUM_SEQS, 64, 15, max_tokens, dev, False)
    req_ids = [f"req-{i}" for i in range(batch)]
    idx = torch.arange(batch, dtype=torch.int32, device=dev)
    idx_np = np.arange(batch, dtype=np.int32)
    n = verifier.num_tree_nodes
    verifier.store_trees(SimpleNamespace(
        node_tokens=torch.zeros(batch, n, dtype=torch.int64, device=dev),
        node_parents=torch.zeros(batch, n, dtype=torch.int32, device=dev),
        node_depths=torch.zeros(batch, n, dtype=torch.int32, device=dev),
        node_valid=torch.ones(batch, n, dtype=torch.bool, device=dev)), idx, idx_np)
    stored = [0]

    def store(states, positions, slots):
        stored[0] += states.shape[0]

    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        # What the runner hands a step: new views of its persistent buffers.
        aux = [x[:batch] for x in aux_out]
        positions = positions_buf[:batch]
        deferred.append(req_ids, aux, positions, slot_rows, store)
        verifier.clear_trees(idx, idx_np)
    deferred.flush(store)
    _sync(dev)
    elapsed = time.perf_counter() - t0
    # The views above are the runner's, made every step in either tree: their cost is
    # timed alone and taken off, so that the figure is ours.
    t1 = time.perf_counter()
    for _ in range(steps):
        aux = [x[:batch] for x in aux_out]
        positions = positions_buf[:batch]
    views = time.perf_counter() - t1
    if stored[0] != steps * batch:
        raise AssertionError(f"stored {stored[0]} context entries, expected {steps * batch}")
    return {"batch": batch, "steps": steps, "device": dev.type,
            "us_per_step": round((elapsed - views) / steps * 1e6, 2)}


def compare(baseline: str, batches: list[int], steps: int, rounds: int,
            device: str = "cpu") -> list[dict]:
    impls = {"tree": modules(None), "baseline": modules(baseline)}
    for impl in impls.values():  # first calls (allocations, dispatch caches) untimed
        time_budget0_steps(*impl, batches[0], min(steps, 200), device)
    means: dict = {b: {"tree": [], "baseline": []} for b in batches}
    for r in range(rounds):
        for name in (("tree", "baseline") if r % 2 == 0 else ("baseline", "tree")):
            for b in batches:
                means[b][name].append(
                    time_budget0_steps(*impls[name], b, steps, device)["us_per_step"])
    return [{"batch": b, "baseline": baseline,
             "us_per_step_tree": m["tree"], "us_per_step_baseline": m["baseline"],
             "us_per_step_tree_median": round(statistics.median(m["tree"]), 2),
             "us_per_step_baseline_median": round(statistics.median(m["baseline"]), 2),
             **paired_ratios(m["tree"], m["baseline"])}
            for b, m in means.items()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--baseline", help="git revision whose two modules to time against, in turns")
    ap.add_argument("--rounds", type=int, default=6, help="rounds of turns with --baseline")
    ap.add_argument("--device", default="cpu",
                    help="where the tensors live: cpu (default) or cuda (each copy a launch)")
    args = ap.parse_args(argv)
    if args.device != "cpu" and not (args.device.startswith("cuda")
                                     and torch.cuda.is_available()):
        raise SystemExit(f"--device {args.device}: no such device here "
                         f"(cuda available: {torch.cuda.is_available()})")
    if args.baseline:
        rows = compare(args.baseline, args.batch_sizes, args.steps, args.rounds, args.device)
    else:
        impl = modules(None)
        time_budget0_steps(*impl, args.batch_sizes[0], min(args.steps, 200), args.device)
        rows = [time_budget0_steps(*impl, b, args.steps, args.device)
                for b in args.batch_sizes]
    doc = {"command": "python3 bench/budget0_host.py " + " ".join(
               sys.argv[1:] if argv is None else argv),
           "host": {"machine": platform.machine(), "processor": platform.processor(),
                    "python": platform.python_version(), "cpus": os.cpu_count(),
                    "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name() if args.device != "cpu" else None},
           "what": "host microseconds per budget-0 step of DeferredContext.append + "
                   f"TreeVerifier.clear_trees ({args.device} tensors)"
                   + (f", this tree's modules against {args.baseline}'s in turns"
                      if args.baseline else ""),
           "rows": rows}
    write_result(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
