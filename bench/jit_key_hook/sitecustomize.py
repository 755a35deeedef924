"""Every Triton compilation's whole specialisation key, on stderr (bench only).

vLLM's JIT monitor names a kernel that compiles while serving, but cuts Triton's key
short (``_safe_repr``, 120 characters), so two compilations of one kernel with the same
``constexpr`` values (``_prepare_dflash_inputs_kernel`` twice at ``BLOCK_SIZE=64``,
``bench/results/2026-11-30-steady-plain-chain-trees-both-orders/jit-during-serving-ddtree-b64-t512.json.gz``)
cannot be told apart. ``bench/check_jit_during_serving.py`` puts this folder first on the
engine's ``PYTHONPATH`` with ``JITCHECK_KEYS=1``; Python then runs
this file at start-up in every process of the engine, and it chains a Triton
``jit_post_compile_hook`` that prints one line per compilation::

    JITCHECK-KEY {"kernel": ..., "args": {"num_sampled_ptr": "*i32 divisibility=16", ...},
                  "constexprs": {"BLOCK_SIZE": 64, ...}}

(vLLM's monitor, activated later, keeps this hook and calls it after its own.) An
argument without ``divisibility=16`` is a pointer not 16-byte aligned or an integer not
divisible by 16 at that call. Any other ``sitecustomize`` further on the path still runs.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import sys

KEY_MARKER = "JITCHECK-KEY"


def describe(specialization_data: str) -> dict:
    """Triton's serialised specialisation (``serialize_specialization_data``) as the
    kernel's name, each runtime argument's type and attributes, and its constexprs."""
    data = json.loads(specialization_data)
    names = list(data["signature"])

    def name_of(path) -> str:
        return ".".join([names[path[0]], *map(str, path[1:])])

    args = {name: str(kind) for name, kind in data["signature"].items()
            if kind != "constexpr"}
    for path, attrs in zip(data["attrs_keys"], data["attrs_vals"]):
        name = name_of(path)
        extra = " ".join(f"{attr.removeprefix('tt.')}={value}" for attr, value in attrs)
        args[name] = f"{args.get(name, '?')} {extra}".strip()
    constexprs = {}
    for path, value in zip(data["constant_keys"], data["constant_vals"]):
        if isinstance(value, dict) and "constexpr" in value:
            value = value["constexpr"]
        constexprs[name_of(path)] = value
    return {"kernel": data["name"].rsplit(".", 1)[-1], "function": data["name"],
            "args": args, "constexprs": constexprs}


def _hook_chained_to(previous):
    def on_compile(**kwargs):
        try:
            data = (kwargs.get("compile") or {}).get("specialization_data")
            line = describe(data) if data else {"error": "no specialization_data"}
        except Exception as e:  # a log line must never fail a compilation
            line = {"error": repr(e)}
        print(KEY_MARKER, json.dumps(line, sort_keys=True, default=str), file=sys.stderr,
              flush=True)
        return previous(**kwargs) if previous is not None else None
    return on_compile


def install() -> bool:
    try:
        from triton import knobs
    except ImportError:
        return False
    knobs.runtime.jit_post_compile_hook = _hook_chained_to(knobs.runtime.jit_post_compile_hook)
    return True


def _run_next_sitecustomize() -> None:
    """The ``sitecustomize`` this file shadows, if the path has another one."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if os.path.abspath(entry or os.curdir) == here:
            continue
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry or os.curdir])
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


if __name__ == "sitecustomize":  # run by Python at start-up, not when a test imports it
    if os.environ.get("JITCHECK_KEYS") == "1":
        install()
    _run_next_sitecustomize()
