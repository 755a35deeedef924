"""Milliseconds a training step of the DFlash drafter, for each way the trainer can run
its step, on the same batches (GPU).

The drafter's training (``bench.fixture.train_dflash_drafter``) gets a few GPU calls of
at most ten minutes a session, so its steps a second bound how far it trains. Its step
can run the block attention with dense float32 scores or FlexAttention's fused kernel
(``--attention``), eagerly or through ``torch.compile`` (``--compile``). This runs each
variant from the same initial weights over the same batches of real training sequences
(target-generated, ``generate_drafter_data``), and reports per variant:

* ``ms_per_step``: median (and min-max) of CUDA-event times of ``--steps`` steps after
  ``--warmup`` steps (the first compiles), forward, backward, clipping and AdamW;
* ``peak_mib``: peak allocated GPU memory over those steps;
* ``first_step``: the loss and the gradient's norm of the first batch, before any
  update, and against the dense variant the loss's relative difference and the
  gradients' cosine (a variant that computes another function shows here);
* ``last_loss``: the loss of the last timed step (the same batches and schedule: the
  variants should train alike);
* ``compile_s``: the first step's wall time.

``--profile VARIANT`` adds that variant's top CUDA-time operators over 5 steps.

    python3 bench/drafter_train_speed.py --target /opt/smollm2-hf \\
        --sequences /opt/drafter-sequences --layers 2 --out $OUT/drafter-train-speed.json
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

from bench.fixture.dflash_drafter import DFlashDrafter, loss_weights  # noqa: E402
from bench.fixture.train_dflash_drafter import (Packed, Target,  # noqa: E402
                                               autocast_for, drafter_config,
                                               make_loss_fn, make_optimizer,
                                               needs_fixed_width, read_sequences, sync,
                                               training_batch)

VARIANTS = ("dense", "flex", "dense+compile", "flex+compile")


def parse_variant(name: str) -> tuple[str, bool]:
    """"flex+compile" -> ("flex", True)."""
    attention, _, rest = name.partition("+")
    if attention not in ("dense", "flex") or rest not in ("", "compile"):
        raise ValueError(f"unknown variant {name!r}: one of {', '.join(VARIANTS)}")
    return attention, rest == "compile"


class Timer:
    """A point in a step's time line: a CUDA event on the GPU (the step's device time),
    the host clock on a CPU."""

    def __init__(self, cuda: bool):
        self.event = torch.cuda.Event(enable_timing=True) if cuda else None
        self.t = 0.0

    def record(self) -> None:
        if self.event is not None:
            self.event.record()
        else:
            self.t = time.perf_counter()

    def elapsed_time(self, end: "Timer") -> float:
        """Milliseconds from this point to ``end``."""
        if self.event is not None:
            return self.event.elapsed_time(end.event)
        return (end.t - self.t) * 1e3


def grad_vector(drafter) -> torch.Tensor:
    return torch.cat([p.grad.float().flatten() for p in drafter.parameters()
                      if p.grad is not None])


def run_variant(name: str, dc, train: Packed, embed, lm_head, args, device,
                profile: bool = False) -> tuple[dict, torch.Tensor]:
    """Train a fresh drafter (seeded weights) with variant ``name`` over the seeded
    batches; returns its record and the first batch's gradient."""
    attention, compile_ = parse_variant(name)
    # As the trainer draws them: a fixed width for a compiled step or FlexAttention,
    # the batch's own otherwise; with --fixed-width every variant the fixed one.
    fixed_width = args.fixed_width or needs_fixed_width(attention, compile_)
    torch.manual_seed(args.seed)
    drafter = DFlashDrafter(dc)
    drafter.reset_parameters(generator=torch.Generator().manual_seed(args.seed))
    drafter.to(device).train()
    cuda = device.type == "cuda"
    opt = make_optimizer(drafter, args.lr, device)
    loss_fn = make_loss_fn(drafter, embed, lm_head, loss_weights(dc.block_size),
                           autocast_for(device), attention, compile_)
    agen = torch.Generator(device=device).manual_seed(args.seed + 1)
    perm = torch.randperm(train.n, generator=torch.Generator().manual_seed(args.seed + 2))
    perm = perm.to(device)
    total = args.warmup + args.steps
    if (total + 1) * args.batch > train.n:
        raise SystemExit(f"{train.n} sequences are too few for {total + 1} batches of "
                         f"{args.batch}")
    record: dict = {"variant": name}
    first_grad = None
    times: list = []
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    prof = None
    for s in range(total + (5 if profile else 0)):
        rows = perm[s * args.batch:(s + 1) * args.batch] if s < total else perm[:args.batch]
        batch = training_batch(train, rows, args.anchors, agen, dc.block_size,
                               fixed_width=fixed_width)
        if s == total and profile:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        start, end = Timer(cuda), Timer(cuda)
        t0 = time.time()
        start.record()
        loss, correct, nvalid = loss_fn(*batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if s == 0:
            first_grad = grad_vector(drafter)
            record["first_step"] = {"loss": float(loss), "grad_norm": float(first_grad.norm())}
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        end.record()
        if s == 0:
            sync(device)
            record["compile_s"] = round(time.time() - t0, 2)
        if args.warmup <= s < total:
            times.append((start, end))
        if s == total - 1:
            sync(device)
            record["last_loss"] = float(loss)
            record["accuracy_last"] = round(float(correct) / max(1, int(nvalid)), 4)
            if cuda:
                record["peak_mib"] = round(torch.cuda.max_memory_allocated(device) / 2 ** 20)
    sync(device)
    ms = [a.elapsed_time(b) for a, b in times]
    record["ms_per_step"] = {"median": round(statistics.median(ms), 2),
                             "min": round(min(ms), 2), "max": round(max(ms), 2), "n": len(ms)}
    if prof is not None:
        sync(device)
        prof.__exit__(None, None, None)
        rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:25]
        record["profile_top_cuda_ms_per_step"] = [
            {"op": e.key[:80], "ms": round(e.device_time_total / 1e3 / 5, 3), "calls": e.count}
            for e in rows]
    del drafter, opt, loss_fn
    if cuda:
        torch.cuda.empty_cache()
    return record, first_grad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help="HF target folder")
    ap.add_argument("--sequences", action="append", required=True, metavar="PATH",
                    help="training sequences (generate_drafter_data output); repeatable")
    ap.add_argument("--out", required=True, help="JSON result")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--n-sequences", type=int, default=3000,
                    help="the first N sequences (their features are computed once)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=None,
                    help="the drafter's MLP width (default: the target's)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-prompt-tokens", type=int, default=384)
    ap.add_argument("--fixed-width", action="store_true",
                    help="every variant's batches at the fixed width (default: the dense "
                         "eager variant's as wide as each batch, as the trainer draws them)")
    ap.add_argument("--profile", default=None, metavar="VARIANT",
                    help="also profile this variant's CUDA time by operator")
    ap.add_argument("--device", default="cuda",
                    help="cuda, or cpu for the dense variant alone (its timings are then "
                         "the host's, in float32)")
    a = ap.parse_args(argv)
    for v in a.variants + ([a.profile] if a.profile else []):
        try:
            parse_variant(v)
        except ValueError as e:
            ap.error(str(e))
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA GPU here (--device cpu runs the dense variant alone)")
    if device.type != "cuda" and (set(a.variants) - {"dense"} or a.profile):
        ap.error("only the dense variant runs on a CPU (FlexAttention has no backward "
                 "there, and compiling is what the GPU's kernels are measured for)")
    torch.backends.cuda.matmul.allow_tf32 = True
    t0 = time.time()
    tgt = Target(a.target, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    dc = drafter_config(tgt.cfg, a.layers, a.intermediate)
    seqs = [x for p in a.sequences for x in read_sequences(p, a.max_prompt_tokens)]
    seqs = [x for x in seqs if len(x[0]) - x[1] >= 2][:a.n_sequences]
    feats = tgt.features([s for s, _ in seqs], list(dc.target_layer_ids), 64)
    train = Packed([s for s, _ in seqs], [p for _, p in seqs], feats, device)
    embed, lm_head = tgt.embed.detach(), tgt.lm_head.detach()
    del feats
    result = {"device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                         else f"cpu ({os.cpu_count()} cores)"), "torch": torch.__version__,
              "settings": {k: v for k, v in vars(a).items() if k != "out"},
              "drafter_layers": dc.num_hidden_layers,
              "drafter_intermediate": dc.intermediate_size, "sequences": train.n,
              "width": train.width, "prepare_s": round(time.time() - t0, 1), "variants": []}
    reference = None
    for name in a.variants:
        try:
            rec, grad = run_variant(name, dc, train, embed, lm_head, a, device,
                                    profile=name == a.profile)
        except Exception as e:  # a variant that fails is a result, not the end of the run
            rec, grad = {"variant": name, "error": f"{type(e).__name__}: {str(e)[:400]}"}, None
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if grad is not None:
            if name == "dense" and reference is None:
                reference = (rec["first_step"]["loss"], grad)
            elif reference is not None:
                rec["first_step"]["loss_rel_diff_vs_dense"] = round(
                    abs(rec["first_step"]["loss"] - reference[0]) / abs(reference[0]), 6)
                rec["first_step"]["grad_cosine_vs_dense"] = round(float(
                    torch.nn.functional.cosine_similarity(grad, reference[1], dim=0)), 6)
        result["variants"].append(rec)
        print(json.dumps(rec)[:600], flush=True)
    result["wall_s"] = round(time.time() - t0, 1)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
