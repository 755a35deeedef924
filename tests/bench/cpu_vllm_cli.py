"""Runs the `vllm` CLI (vllm.entrypoints.cli.main) on a machine without a GPU.

vLLM cannot infer a device type without a GPU (or a CPU build of vLLM), and then fails
while building its argument parser. The startup checks in tests/bench/test_serve_e2e.py
only need argument parsing and config validation, so this shim installs vLLM's
CpuPlatform first, then runs the CLI exactly as ``python -m vllm.entrypoints.cli.main``.
"""
import runpy
import sys

import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform

platforms.current_platform = CpuPlatform()
sys.argv = ["vllm"] + sys.argv[1:]
runpy.run_module("vllm.entrypoints.cli.main", run_name="__main__", alter_sys=True)
