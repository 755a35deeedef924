"""Shared fixtures for the algorithm unit tests (CPU; Triton via its interpreter).

Triton chooses between compiler and CPU interpreter when a function is decorated with
``triton.jit``, and its own standard library (``tl.zeros``, ``tl.max``, ...) is
decorated when ``triton`` is first imported. On a machine without a GPU this conftest
therefore switches ``TRITON_INTERPRET=1`` on *before* Triton is imported, so the
project's kernels run in the interpreter against their reference twins. If Triton was
already imported in compiled mode (another plugin or conftest got there first), tests
that need the kernels re-run themselves in a fresh subprocess with the interpreter on.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

_HAS_CUDA = torch.cuda.is_available()
if not _HAS_CUDA and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton  # noqa: F401

    _HAS_TRITON = True
except ImportError:
    _HAS_TRITON = False


def pytest_configure(config):
    # Triton's interpreter converts 1-element arrays to ints (NumPy >= 1.25 warns).
    config.addinivalue_line(
        "filterwarnings", "ignore:Conversion of an array with ndim > 0:DeprecationWarning"
    )


def _triton_stdlib_interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    import triton.language.standard as std

    return isinstance(std.zeros, InterpretedFunction)


@pytest.fixture
def triton_device(request, monkeypatch):
    """Device on which the Triton kernels really run: CUDA when present, else the CPU
    in Triton's interpreter. Skips only when Triton itself is not importable."""
    if not _HAS_TRITON:
        pytest.skip("triton is not importable")
    if _HAS_CUDA:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        return torch.device("cuda")
    if _triton_stdlib_interpreted():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        return torch.device("cpu")
    rerun_in_interpreter_subprocess(
        request,
        "Triton interpreter could not be enabled in the subprocess",
        "passed in a subprocess with TRITON_INTERPRET=1 (Triton was imported compiled here)",
    )


@pytest.fixture
def vllm_triton(request):
    """vLLM with real Triton. Without a GPU driver vLLM hands out a Triton placeholder
    unless CUDA_VISIBLE_DEVICES is empty (and TRITON_INTERPRET=1) when it is first
    imported, so the test then runs again in a subprocess with that environment."""
    vllm_triton_utils = pytest.importorskip("vllm.triton_utils")
    if hasattr(vllm_triton_utils.triton, "next_power_of_2"):
        return
    rerun_in_interpreter_subprocess(
        request,
        "vLLM kept its Triton placeholder with CUDA_VISIBLE_DEVICES empty",
        "passed in a subprocess with vLLM's real Triton (CUDA_VISIBLE_DEVICES empty)",
        timeout=600,
    )


def rerun_in_interpreter_subprocess(request, failure_there: str, skip_reason: str,
                                    timeout: float | None = None) -> None:
    """Runs the requesting test again in a fresh pytest process with Triton's
    interpreter on and no GPU visible, then skips it here with ``skip_reason``. Fails
    with ``failure_there`` when already in such a subprocess."""
    if os.environ.get("_DDTREE_TEST_SUBPROCESS") == "1":
        pytest.fail(failure_there)
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", _DDTREE_TEST_SUBPROCESS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid],
        cwd=str(request.config.rootpath),
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    # Passed there, not skipped (pytest exits 0 for a skipped test too).
    assert proc.returncode == 0 and re.search(r"\b1 passed\b", proc.stdout), \
        f"subprocess run of {request.node.nodeid} failed:\n{proc.stdout}\n{proc.stderr}"
    pytest.skip(skip_reason)
