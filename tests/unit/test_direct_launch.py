"""The direct Triton launcher (vllm_ddtree._triton.DirectLauncher): its key and its
launch flow, with a stand-in for a jitted kernel (the compiled launch itself runs on
the GPU host: tests/unit/test_*_fused.py go through it there)."""

from __future__ import annotations

import inspect

import pytest
import torch

from vllm_ddtree import _triton, env


class _Param:
    def __init__(self, p: inspect.Parameter):
        self.name = p.name
        self.has_default = p.default is not inspect.Parameter.empty
        self.default = p.default


class FakeCompiled:
    def __init__(self):
        self.calls = []
        self.function = "fn-handle"
        self.packed_metadata = ("meta",)

    def run(self, *a):
        self.calls.append(a)


class FakeKernel:
    """``kernel[grid](*args, **kwargs)`` as Triton's JITFunction: records the call and
    returns the compiled kernel of the call's specialisation."""

    def __init__(self, fn):
        self.params = [_Param(p) for p in inspect.signature(fn).parameters.values()]
        self.pre_run_hooks = []
        self.slow_calls = []
        self.compiled = FakeCompiled()

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.slow_calls.append((grid, args, kwargs))
            return self.compiled
        return run


def _kernel(x_ptr, n, flag, BLOCK, HAS_X=True):  # signature only
    pass


@pytest.fixture
def fake_driver(monkeypatch):
    monkeypatch.setattr(_triton, "_current_device", lambda: 0)
    monkeypatch.setattr(_triton, "_current_stream", lambda device: 1234)


def test_key_separates_what_triton_specialises_on():
    key = _triton.specialization_key
    x = torch.zeros(8, dtype=torch.int32)
    base = key((x, 5, True), {"BLOCK": 16})
    assert base == key((torch.ones(8, dtype=torch.int32), 7, True), {"BLOCK": 16})
    assert base != key((x.to(torch.int64), 5, True), {"BLOCK": 16})  # dtype
    assert base != key((x[1:], 5, True), {"BLOCK": 16})  # 4-byte offset: alignment
    assert base != key((x, 1, True), {"BLOCK": 16})  # == 1
    assert base != key((x, 32, True), {"BLOCK": 16})  # % 16
    assert base != key((x, 2**31 + 3, True), {"BLOCK": 16})  # int width
    assert key((x, 2**31 + 3, True), {}) != key((x, 2**63 + 3, True), {})  # i64 vs u64
    assert base != key((x, 5, False), {"BLOCK": 16})  # bool value
    assert base != key((x, 5, True), {"BLOCK": 32})  # constexpr value
    assert base != key((x, 5, True), {"BLOCK": 16, "num_warps": 1})  # option
    assert key((x, None, 0.5), {}) is not None
    assert key((x, object()), {}) is None  # unknown kind: Triton's path
    assert key((x,), {"OUT": x}) is None  # tensor passed by keyword: Triton's path


def test_first_launch_goes_through_triton_later_ones_are_direct(fake_driver):
    k = FakeKernel(_kernel)
    launch = _triton.DirectLauncher(k)
    x = torch.zeros(4)
    launch[(3,)](x, 5, True, BLOCK=16)
    assert len(k.slow_calls) == 1 and k.compiled.calls == []
    launch[(2, 7)](x, 9, True, BLOCK=16)  # same key: direct, grid padded to 3 dims
    assert len(k.slow_calls) == 1
    (call,) = k.compiled.calls
    assert call[:7] == (2, 7, 1, 1234, "fn-handle", ("meta",), None)
    # hooks off, then every parameter in signature order, constexprs and defaults too
    assert call[7:9] == (None, None)
    assert call[9:] == (x, 9, True, 16, True)


def test_new_specialisation_or_hooks_take_tritons_path(fake_driver, monkeypatch):
    k = FakeKernel(_kernel)
    launch = _triton.DirectLauncher(k)
    x = torch.zeros(4)
    launch[(1,)](x, 5, True, BLOCK=16)
    launch[(1,)](x, 1, True, BLOCK=16)  # n == 1 is another key
    launch[(1,)](x, 5, True, BLOCK=32)  # another constexpr
    assert len(k.slow_calls) == 3 and k.compiled.calls == []
    launch[(1,)](x, 5, True, BLOCK=16)  # cached: direct
    assert len(k.slow_calls) == 3 and len(k.compiled.calls) == 1
    from triton import knobs

    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    launch[(1,)](x, 5, True, BLOCK=16)  # cached key, but a profiler hook is set
    assert len(k.slow_calls) == 4 and len(k.compiled.calls) == 1


class _RefusingCompiled(FakeCompiled):
    def run(self, *a):  # a Triton whose launcher takes other arguments
        raise TypeError("run() takes 12 positional arguments")


def test_a_refused_direct_launch_falls_back_to_tritons_path_for_good(fake_driver, caplog):
    k = FakeKernel(_kernel)
    k.compiled = _RefusingCompiled()
    launch = _triton.DirectLauncher(k)
    x = torch.zeros(4)
    launch[(1,)](x, 5, True, BLOCK=16)
    with caplog.at_level("WARNING", logger="vllm.ddtree"):
        launch[(1,)](x, 5, True, BLOCK=16)  # direct call refused: relaunched by Triton
    assert len(k.slow_calls) == 2 and "refused" in caplog.text
    launch[(1,)](x, 5, True, BLOCK=16)  # never tries the direct call again
    assert len(k.slow_calls) == 3 and launch.cache == {}


def test_missing_parameter_is_never_cached(fake_driver):
    k = FakeKernel(_kernel)
    launch = _triton.DirectLauncher(k)
    x = torch.zeros(4)
    launch[(1,)](x, 5, True)  # BLOCK missing (Triton itself would raise here)
    launch[(1,)](x, 5, True)
    assert len(k.slow_calls) == 2 and k.compiled.calls == []


def test_hooks_count_only_when_they_would_run():
    from triton.knobs import HookChain

    chain = HookChain()
    assert not _triton._has_hooks(None) and not _triton._has_hooks(chain)
    chain.add(print)
    assert _triton._has_hooks(chain) and _triton._has_hooks(print)


def test_launcher_is_plain_jit_under_the_interpreter_or_when_switched_off(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(env.DIRECT_LAUNCH.name, "1")
    assert not isinstance(_triton.launcher(_kernel), _triton.DirectLauncher)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv(env.DIRECT_LAUNCH.name)
    assert isinstance(_triton.launcher(_kernel), _triton.DirectLauncher)  # on by default
    monkeypatch.setenv(env.DIRECT_LAUNCH.name, "0")
    assert not isinstance(_triton.launcher(_kernel), _triton.DirectLauncher)
    monkeypatch.setenv(env.DIRECT_LAUNCH.name, "1")
    assert isinstance(_triton.launcher(_kernel), _triton.DirectLauncher)


tl = _triton.tl


def _axpb_kernel(out_ptr, x_ptr, n, scale, BLOCK: tl.constexpr, OFFSET: tl.constexpr = 3):
    i = tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(x_ptr + i, mask=m)
    tl.store(out_ptr + i, x * scale + OFFSET, mask=m)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled launch needs CUDA")
def test_direct_launch_on_the_gpu_matches_tritons_launch(monkeypatch):
    """First launch through Triton, the next ones straight to the compiled launcher:
    same results, the constexpr default passed, one cache entry per specialisation."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv(env.DIRECT_LAUNCH.name, "1")
    launch = _triton.launcher(_axpb_kernel)
    assert isinstance(launch, _triton.DirectLauncher)
    x = torch.arange(64, dtype=torch.float32, device="cuda")
    for n, scale in ((50, 2), (61, 5), (7, 3)):
        out = torch.full((64,), -1.0, device="cuda")
        launch[(1,)](out, x, n, scale, BLOCK=64)
        want = torch.full((64,), -1.0, device="cuda")
        want[:n] = x[:n] * scale + 3
        torch.testing.assert_close(out, want)
    assert len(launch.cache) == 1
    compiled, tail = next(iter(launch.cache.values()))
    assert tail == (64, 3)
