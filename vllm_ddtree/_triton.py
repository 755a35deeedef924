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

import logging
import os
from typing import Any, Callable

import torch

from vllm_ddtree import env
from vllm_ddtree.env import TRUE_WORDS

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
    return os.environ.get("TRITON_INTERPRET", "0").lower() in TRUE_WORDS


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


# Our per-step kernels launch through the compiled kernel's launcher once Triton has
# compiled them for a call's specialisation (:class:`DirectLauncher`); "0" keeps
# Triton's own launch path. On by default: the fused-kernel GPU tests
# pass through it (bench/results/gpu-direct-launch-tests.log) and engines with and
# without it accept identically (bench/results/bench-direct-launch.json.gz).
direct_launch_enabled = env.direct_launch_enabled
logger = logging.getLogger("vllm.ddtree")


def _int_width(v: int) -> str:
    """The integer type Triton gives a Python int argument."""
    if -(2**31) <= v < 2**31:
        return "i32"
    return "i64" if -(2**63) <= v < 2**63 else "u64"


def specialization_key(args: tuple, kwargs: dict) -> tuple | None:
    """A key at least as fine as what Triton specialises a launch on, or None when an
    argument is of a kind this does not handle (the caller then takes Triton's path).

    Triton compiles one variant per (tensor dtypes and 16-byte alignment; integer
    width, == 1 and % 16 == 0 unless marked not to; bools, floats, Nones; constexpr and
    option values). This key records all of that for every argument whatever the
    kernel's ``do_not_specialize`` marks, so equal keys always mean the same compiled
    variant; it may split one variant into several keys, which only costs a first
    launch through Triton's path for each."""
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.dtype, a.data_ptr() % 16 == 0))
        elif a is None:
            key.append(None)
        elif a is True or a is False:
            key.append(("u1", a))
        elif type(a) is int:
            key.append((_int_width(a), a == 1, a % 16 == 0))
        elif type(a) is float:
            key.append(("f",))
        else:
            return None
    for name, value in kwargs.items():
        if not (value is None or type(value) in (int, bool, float, str)):
            return None
        key.append((name, value))
    return tuple(key)


def _has_hooks(hook: Any) -> bool:
    """Whether a Triton launch hook would do anything: Triton 3.6 keeps an (often
    empty) chain of hooks, older versions None or a plain callable."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return True if calls is None else bool(calls)


def _current_device() -> int:
    from triton.runtime.driver import driver

    return driver.active.get_current_device()


def _current_stream(device: int) -> int:
    from triton.runtime.driver import driver

    return driver.active.get_current_stream(device)


def run_compiled(compiled: Any, grid: tuple, stream: int, args: tuple) -> None:
    """Launch a Triton-compiled kernel with its full argument list (every parameter in
    signature order), as Triton 3.6's launch path does after its checks: grid padded to
    three dims, no launch hooks. The one place that knows the launcher's layout."""
    g = tuple(grid) + (1, 1)
    compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata,
                 None, None, None, *args)


class DirectLauncher:
    """``launcher[grid](*args, **kwargs)`` for one Triton kernel, like ``kernel[grid]``,
    without Triton's per-call Python path (binder, cache key, checks: ~15-18 us of host
    time for a kernel of ~24 arguments on the GPU host, ``host-overhead-gpu.txt``).

    The first launch with a given :func:`specialization_key` goes through Triton (which
    compiles if needed and returns the compiled kernel); later ones call the compiled
    kernel's launcher with the same full argument list Triton would pass. Triton's path
    is kept for the interpreter, for launch hooks (profilers), for kernels with pre-run
    hooks and for arguments :func:`specialization_key` does not handle.
    """

    def __init__(self, kernel: Any):
        self.kernel = kernel
        self.params = list(getattr(kernel, "params", ()))
        self.cache: dict[tuple, tuple[Any, tuple]] = {}
        # Set when this Triton's compiled launcher refused a direct call: Triton's path.
        self.refused = False

    def __getitem__(self, grid: tuple):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def _tail(self, num_args: int, kwargs: dict) -> tuple | None:
        """Values of the parameters after the positional ones, in signature order (given
        as keywords, all part of the key, or defaulted); None when one is neither (the
        first launch through Triton's path raised then anyway)."""
        values = []
        for p in self.params[num_args:]:
            if p.name in kwargs:
                values.append(kwargs[p.name])
            elif p.has_default:
                values.append(p.default)
            else:
                return None
        return tuple(values)

    def launch(self, grid: tuple, args: tuple, kwargs: dict) -> None:
        from triton import knobs

        runtime = knobs.runtime
        hooked = (_has_hooks(runtime.launch_enter_hook) or _has_hooks(runtime.launch_exit_hook)
                  or getattr(self.kernel, "pre_run_hooks", None))
        key = (None if hooked or self.refused or not self.params
               else specialization_key(args, kwargs))
        if key is None:
            self.kernel[grid](*args, **kwargs)
            return
        device = _current_device()
        key = (device, len(args)) + key
        hit = self.cache.get(key)
        if hit is None:
            compiled = self.kernel[grid](*args, **kwargs)
            if hasattr(compiled, "result"):
                compiled = compiled.result()
            tail = self._tail(len(args), kwargs)
            if compiled is not None and tail is not None:
                self.cache[key] = (compiled, tail)
            return
        compiled, tail = hit
        try:
            run_compiled(compiled, grid, _current_stream(device), args + tail)
        except TypeError as exc:
            # A Triton whose compiled launcher takes other arguments than 3.6's (the
            # call is refused before anything is launched): Triton's path from now on.
            logger.warning("ddtree: direct Triton launch of %s refused (%s); using Triton's "
                           "launch path for it", getattr(self.kernel, "__name__", self.kernel), exc)
            self.refused = True
            self.cache.clear()
            self.kernel[grid](*args, **kwargs)


# Direct launchers exist only for compiled kernels (never under the interpreter).
_LAUNCHERS: dict[Callable[..., Any], DirectLauncher] = {}


def launcher(fn: Callable[..., Any]) -> Any:
    """What to index with a grid to launch ``fn``: a :class:`DirectLauncher` around
    :func:`jit` (``fn``) unless ``VLLM_DDTREE_DIRECT_LAUNCH=0``, else (and always under
    the interpreter) the jitted kernel itself."""
    if triton_interpreting() or not direct_launch_enabled():
        return jit(fn)
    hit = _LAUNCHERS.get(fn)
    if hit is None:
        hit = _LAUNCHERS[fn] = DirectLauncher(jit(fn))
    return hit


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
