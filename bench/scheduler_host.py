"""Host time of vLLM's scheduler a decode step: plain decoding against DDTree with its
drafting off, or (``--drafting``) DDTree drafting against the pinned release's own
methods (CPU only).

The engine core runs ``schedule()`` and ``update_from_output()`` on its host thread
every step, which sets the pace of a small target's step. This builds vLLM's real
scheduler (``AsyncScheduler``, as `vllm serve` picks it) twice from configurations
resolved as `vllm serve` resolves them on an H200 (the device queries answered as one
does, ``tests/unit/test_ddtree_batch_defaults.py``; prefix caching off, the KV cache
of ``tests/unit/test_online_budget.py``): plain decoding, and the README's DDTree
configuration (online budget on). ``batch`` sampled requests decode; the tests' stand-in
for the GPU (``tests.unit.test_online_budget.Serving``) plays it: one token a request a
step, nothing accepted, the step times of ``step_ms`` on the controller's clock, so that the
controller turns drafting off (its probes still draft; ``drafted_steps`` counts them).
After ``--warmup`` steps it times ``--steps`` steps of each, the two configurations in
turns (A B, B A, ...) for ``--rounds`` rounds, and reports per batch size the medians of
each round's median microseconds a step and the median of the paired ratios DDTree /
plain. Stats logging is on, as `vllm serve` has it.

    .venv/bin/python bench/scheduler_host.py --out bench/results/<dir>/scheduler-host.json

``--drafting B``: DDTree drafts every step instead (online budget off, B drafts a
request at every batch size; the stand-in accepts each next draft along the path with
chance ``--quality``), and every other DDTree step runs the methods the series patches
for a drafting step's host time as the pinned release ships them (``PRISTINE``: read
from the originals ``apply.sh`` keeps in ``vllm/.ddtree_orig/``), reported apart as
``ddtree_pristine``: the patches' effect as a paired ratio on one scheduler.

Needs the patched vLLM (``./apply.sh``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.online_budget_host import write_result  # noqa: E402


# (module, class, method) the series patches for a drafting step's scheduler host
# time; ``ddtree-pristine`` runs the pinned release's own.
PRISTINE = [("vllm.v1.core.sched.scheduler", "Scheduler", "_update_request_with_output"),
            ("vllm.v1.spec_decode.metrics", "SpecDecodingStats", "observe_draft")]


def engine_config(models: dict[str, str], kind: str, drafting: int | None = None):
    """What `vllm serve <target>` resolves to: plain decoding, or with the README's
    DDTree speculative configuration; with ``drafting`` B, DDTree verifying B drafts
    a request at every batch size (online budget off, no batch-aware cut)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    from tests.unit.test_ddtree_batch_defaults import README_SPEC

    spec = None
    if kind != "plain":
        spec = dict(README_SPEC, model=models["drafter"])
        if drafting is not None:
            # Tokens a step for B drafts at up to 1024 requests: the table never cuts.
            spec.update(num_speculative_tokens=drafting, ddtree_online_budget=False,
                        ddtree_tokens_per_step=(drafting + 1) * 1024)
    args = AsyncEngineArgs(model=models["target"], skip_tokenizer_init=True,
                           speculative_config=spec, max_model_len=32768,
                           enable_prefix_caching=False)
    return args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)


def pristine_methods(names: list[str] | None = None) -> list[tuple[type, str, object]]:
    """(class, name, the pinned release's function) for each of ``PRISTINE`` (those
    whose method is in ``names``, when given): the function as vLLM ships it, from the
    original file ``apply.sh`` kept, run with that file's module globals."""
    import vllm

    from vllm_ddtree.manifest import ORIG_DIR_NAME

    orig_root = Path(vllm.__file__).parent / ORIG_DIR_NAME
    found = []
    for module, cls_name, name in PRISTINE:
        if names is not None and name not in names:
            continue
        path = orig_root / (module.replace(".", "/") + ".py")
        if not path.is_file():
            raise SystemExit(f"{path} is missing: the series does not patch {module} here "
                             f"(apply it with ./apply.sh)")
        spec = importlib.util.spec_from_file_location(f"_pristine_{module}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        cls = getattr(importlib.import_module(module), cls_name)
        found.append((cls, name, getattr(mod, cls_name).__dict__[name]))
    return found


@contextlib.contextmanager
def pristine(methods: list[tuple[type, str, object]]):
    """The pinned release's functions in place of the patched ones, for the block."""
    saved = [(cls, name, cls.__dict__[name]) for cls, name, _ in methods]
    try:
        for cls, name, fn in methods:
            setattr(cls, name, fn)
        yield
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)


def _medians(times: list[tuple[float, float]], verified: list[int]) -> dict:
    sched = [a * 1e6 for a, _ in times]
    update = [b * 1e6 for _, b in times]
    total = [a + b for a, b in zip(sched, update)]
    return {"us_p50": statistics.median(total), "schedule_us_p50": statistics.median(sched),
            "update_us_p50": statistics.median(update),
            "drafted_steps": sum(1 for d in verified if d > 0)}


def time_steps(cfg, batch: int, warmup: int, steps: int, quality: float = 0.0,
               methods: list | None = None) -> dict:
    """Microseconds of ``schedule()`` and ``update_from_output()`` a decode step.
    With ``methods`` (:func:`pristine_methods`), every other step runs the pinned
    release's own and is reported apart (``pristine``): both on one scheduler, so that
    the host's drift falls on both alike."""
    from tests.unit.test_online_budget import Serving, _scheduler

    # The tests' GPU stand-in: one token a request a step, plus the accepted drafts.
    serving = Serving(_scheduler(cfg, log_stats=True), batch)
    if not methods:
        verified = serving.run(warmup + steps, quality=quality)
        return _medians(serving.times[warmup:], verified[warmup:])
    serving.run(warmup, quality=quality)
    del serving.times[:]
    verified = []
    for i in range(2 * steps):
        with pristine(methods) if i % 2 else contextlib.nullcontext():
            verified += serving.run(1, quality=quality)
    result = _medians(serving.times[0::2], verified[0::2])
    result["pristine"] = _medians(serving.times[1::2], verified[1::2])
    return result


def measure(batch_sizes: list[int], warmup: int, steps: int, rounds: int,
            drafting: int | None = None, quality: float = 0.0,
            pristine_names: list[str] | None = None) -> list[dict]:
    import pytest

    from tests.unit.test_ddtree_batch_defaults import patch_h200, write_models

    # vLLM's configuration code answered as on one H200, for the life of this process.
    patch_h200(pytest.MonkeyPatch())
    models = write_models(Path(tempfile.mkdtemp()))
    kinds = ["plain", "ddtree"]
    configs = {kind: engine_config(models, kind, drafting) for kind in kinds}
    methods = pristine_methods(pristine_names) if drafting is not None else None
    rows = []
    for batch in batch_sizes:
        runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
        for r in range(rounds):
            for kind in (kinds if r % 2 == 0 else kinds[::-1]):
                runs[kind].append(time_steps(configs[kind], batch, warmup, steps, quality,
                                             methods if kind == "ddtree" else None))
        if methods:
            runs["ddtree-pristine"] = [x.pop("pristine") for x in runs["ddtree"]]
        row = {"batch": batch, "steps": steps, "rounds": rounds}
        for kind, rs in runs.items():
            key_kind = kind.replace("-", "_")
            for key in ("us_p50", "schedule_us_p50", "update_us_p50"):
                row[f"{key_kind}_{key}"] = round(statistics.median(x[key] for x in rs), 2)
            row[f"{key_kind}_drafted_steps"] = [x["drafted_steps"] for x in rs]

        def paired(a: str, b: str, key: str = "us_p50") -> list[float]:
            return [x[key] / y[key] for x, y in zip(runs[a], runs[b])]

        ratios = paired("ddtree", "plain")
        row["ddtree_over_plain_paired_median"] = round(statistics.median(ratios), 3)
        row["ddtree_over_plain_paired"] = [round(x, 3) for x in ratios]
        row["ddtree_minus_plain_us"] = round(row["ddtree_us_p50"] - row["plain_us_p50"], 2)
        if "ddtree-pristine" in runs:
            for key, name in (("us_p50", ""), ("update_us_p50", "update_")):
                ratios = paired("ddtree", "ddtree-pristine", key)
                row[f"ddtree_over_pristine_{name}paired_median"] = round(
                    statistics.median(ratios), 3)
                row[f"ddtree_over_pristine_{name}paired"] = [round(x, 3) for x in ratios]
            row["ddtree_minus_pristine_update_us"] = round(
                row["ddtree_update_us_p50"] - row["ddtree_pristine_update_us_p50"], 2)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--warmup", type=int, default=800,
                    help="untimed steps first (the controller turns drafting off)")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--drafting", type=int, metavar="B",
                    help="DDTree verifies B drafts a request every step (online budget "
                         "off), against plain decoding and the pinned release's own "
                         "methods (ddtree-pristine)")
    ap.add_argument("--quality", type=float, default=0.7,
                    help="with --drafting: the chance each next draft along the path is "
                         "accepted")
    ap.add_argument("--pristine", nargs="+", metavar="METHOD",
                    choices=[name for _, _, name in PRISTINE],
                    help="with --drafting: put back only these of the patched methods "
                         "(default: all of them)")
    args = ap.parse_args(argv)
    if args.drafting is not None and args.drafting < 1:
        ap.error(f"--drafting must be >= 1, got {args.drafting}")
    if not 0.0 <= args.quality < 1.0:
        ap.error(f"--quality must be in [0, 1), got {args.quality}")
    put_back = [f"{c}.{m}" for _, c, m in PRISTINE if not args.pristine or m in args.pristine]
    rows = measure(args.batch_sizes, args.warmup, args.steps, args.rounds,
                   args.drafting, args.quality if args.drafting is not None else 0.0,
                   args.pristine)
    doc = {"command": "python3 bench/scheduler_host.py " + " ".join(
               sys.argv[1:] if argv is None else argv),
           "host": {"machine": platform.machine(), "processor": platform.processor(),
                    "python": platform.python_version(), "cpus": os.cpu_count()},
           "what": ("host microseconds of vLLM's schedule() + update_from_output() a "
                    "decode step (median), plain decoding against DDTree (README "
                    "configuration, online budget, drafting off but its probes), in turns"
                    if args.drafting is None else
                    f"host microseconds of vLLM's schedule() + update_from_output() a "
                    f"decode step (median): plain decoding, DDTree verifying "
                    f"{args.drafting} drafts a request every step (each next draft "
                    f"accepted with chance {args.quality}), and the same with the "
                    f"pinned release's own {', '.join(put_back)} (ddtree-pristine), every "
                    f"other step"),
           "rows": rows}
    write_result(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
