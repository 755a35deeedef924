"""GPU check of the start-up cost model's timer (vllm_ddtree.cost_model.QueuedKernelTimer):
a host-bound chain of small kernels, timed behind a spin, costs what the same kernels
cost replayed from a CUDA graph, not what the host needed to launch them; a function
that waits for the GPU is late.

Run on a GPU host: ``pytest -m gpu tests/unit/test_cost_model_gpu.py``.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from vllm_ddtree.cost_model import QueuedKernelTimer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _kernel_chain(x: torch.Tensor, w: torch.Tensor, launches: int, host_pause_s: float):
    def run() -> None:
        y = x
        for _ in range(launches):
            y = torch.tanh(y @ w)
            if host_pause_s:
                time.sleep(host_pause_s)  # a slow host between launches, as in eager Python

    return run


def _graph_replay_ms(run) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def test_a_host_bound_chain_costs_its_graph_replay():
    x = torch.randn(64, 1024, device="cuda")
    w = torch.randn(1024, 1024, device="cuda") / 32
    graph_ms = _graph_replay_ms(_kernel_chain(x, w, 200, 0.0))
    slow_host = _kernel_chain(x, w, 200, 50e-6)  # ~10 ms of host for ~1 ms of kernels
    t0 = time.perf_counter()
    slow_host()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3
    timer = QueuedKernelTimer(2.5 * wall_ms + 2.0)
    timings = [timer(slow_host) for _ in range(5)]
    assert all(on_time for _, on_time in timings), timings
    queued_ms = statistics.median(ms for ms, _ in timings)
    assert queued_ms < wall_ms / 2, (queued_ms, wall_ms)
    assert queued_ms == pytest.approx(graph_ms, rel=0.5, abs=0.2), (queued_ms, graph_ms)


def test_a_function_that_waits_for_the_gpu_is_late():
    x = torch.randn(64, 1024, device="cuda")
    w = torch.randn(1024, 1024, device="cuda") / 32
    chain = _kernel_chain(x, w, 20, 0.0)

    def waits() -> None:
        chain()
        torch.cuda.synchronize()

    for spin_ms in (5.0, 200.0):
        assert QueuedKernelTimer(spin_ms)(waits)[1] is False
