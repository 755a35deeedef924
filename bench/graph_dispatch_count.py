#!/usr/bin/env python3
"""How many step shapes find no CUDA graph of their kind under a DDTree budget
schedule, with vLLM 0.26's pristine candidate staging and with the installed
(patched) one. CPU only: the V2 runner's CudaGraphManager is built as in
tests/unit/test_cudagraph_dispatch.py and only its lookup runs.

    tools/series import   # build/series: pristine vLLM at tag `base`
    .venv/bin/python bench/graph_dispatch_count.py

Mixed steps (a joining request's prompt beside the decodes) of 20-512 tokens should
replay a piecewise graph; every scheduled decode shape up to 512 tokens a FULL graph
of its own query length.
"""

from __future__ import annotations

import collections
import importlib.util
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MODULE = "vllm.v1.worker.gpu.cudagraph_utils"


def pristine_module():
    src = subprocess.run(["git", "-C", os.path.join(ROOT, "build", "series"), "show",
                          "base:vllm/v1/worker/gpu/cudagraph_utils.py"],
                         capture_output=True, text=True, check=True).stdout
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader(MODULE, loader=None))
    exec(compile(src, "pristine cudagraph_utils.py", "exec"), mod.__dict__)
    return mod


def count(tokens_per_step: int = 512, max_budget: int = 64) -> dict:
    from vllm.config import CUDAGraphMode

    from vllm_ddtree.budget import budget_schedule

    # Imported afresh (not `from tests.unit import ...`, which reuses the package's
    # attribute): it binds whichever cudagraph_utils sys.modules holds now.
    t = importlib.import_module("tests.unit.test_cudagraph_dispatch")
    manager = t.ddtree_manager(tokens_per_step, max_budget)
    mixed = collections.Counter(manager.dispatch(2, n, None, 0).cg_mode.name
                                for n in range(20, 513))
    off_full = 0
    for first, last, budget in budget_schedule(tokens_per_step, max_budget):
        q = budget + 1
        for n in range(first, min(last, 64) + 1):
            if n * q <= 512 and manager.dispatch(n, n * q, q, 0).cg_mode != CUDAGraphMode.FULL:
                off_full += 1
    return {"mixed_20_512_by_mode": dict(mixed), "decode_shapes_not_on_full": off_full}


def main() -> int:
    installed = sys.modules.get(MODULE) or importlib.import_module(MODULE)
    results = {}
    for label, module in (("pristine 0.26.0", pristine_module()), ("installed", installed)):
        sys.modules[MODULE] = module
        sys.modules.pop("tests.unit.test_cudagraph_dispatch", None)
        results[label] = count()
        print(label, results[label], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
