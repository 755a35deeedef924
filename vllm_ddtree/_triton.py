"""Lazy Triton access shared by the DDTree kernels.

Kernels are written as plain Python functions and turned into Triton kernels on first
use, not at import time. Triton decides between the compiler and its CPU interpreter
when ``triton.jit`` runs (it reads ``TRITON_INTERPRET`` then), so jitting lazily lets
CPU tests switch the interpreter on after this package was imported, and keeps the
package importable where Triton is missing.

We import ``triton`` directly rather than through ``vllm.triton_utils``: vLLM hands out
a placeholder when no GPU driver is active, which would hide the interpreter.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

try:  # pragma: no cover - exercised implicitly by every Triton test
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - the venv always has triton
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False

_JIT_CACHE: dict[tuple[Callable[..., Any], bool], Any] = {}


def triton_interpreting() -> bool:
    """True when Triton kernels will run in Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def can_use_triton(*tensors: torch.Tensor) -> bool:
    """Whether a Triton kernel can run on ``tensors``: Triton is importable and either
    all tensors live on a CUDA device or the interpreter is on (CPU tensors)."""
    if not HAS_TRITON:
        return False
    if triton_interpreting():
        return all(t.device.type == "cpu" for t in tensors)
    return all(t.is_cuda for t in tensors)


def varying_args(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark integer arguments of a kernel function that change from step to step (token
    counts, row counts). :func:`jit` compiles them without Triton's value
    specialisation (== 1, divisible by 16): otherwise each new combination compiles a
    new variant the first time it occurs, a stall of a few hundred milliseconds in the
    middle of serving."""

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn._ddtree_varying_args = tuple(names)  # type: ignore[attr-defined]
        return fn

    return mark


def jit(fn: Callable[..., Any]) -> Any:
    """``triton.jit(fn)``, cached per (function, interpreter on/off); arguments marked
    by :func:`varying_args` are not specialised on their values."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not importable; use the torch backend instead")
    key = (fn, triton_interpreting())
    kernel = _JIT_CACHE.get(key)
    if kernel is None:
        varying = getattr(fn, "_ddtree_varying_args", None)
        kernel = triton.jit(fn, do_not_specialize=list(varying) if varying else None)
        _JIT_CACHE[key] = kernel
    return kernel


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
