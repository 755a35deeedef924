"""vllm_ddtree.cost_model: ddtree_tokens_per_step="auto", the token target measured at
start-up. The grid is pure (the knee rule, vllm_ddtree.budget.knee_tokens, is tested in
test_budget.py); the worker and engine-core sides run
against fakes of vLLM's runner, workers and engine core, and the timer against a
simulated CUDA stream on a fake host clock (no test here depends on real time)."""

from __future__ import annotations

import types

import pytest

from vllm_ddtree import cost_model
from vllm_ddtree.budget import OPEN_END, batch_budget_schedule, budget_schedule
from vllm_ddtree.cost_model import (
    QueuedKernelTimer,
    apply_budget_schedule,
    forward_queueing_ms,
    largest_cuda_graph_tokens,
    measure_target_forward_ms,
    measure_tokens_per_step,
    measurement_token_counts,
    token_target_bound,
)


def test_the_grid_stops_at_what_a_step_can_verify():
    # Powers of two up to the smallest bound, which closes the grid.
    assert measurement_token_counts(8192, 256, 64, 512) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert measurement_token_counts(8192, 4, 15, 512) == [1, 2, 4, 8, 16, 32, 64]
    assert measurement_token_counts(100, 256, 64, None) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert measurement_token_counts(8192, 1, 1, None) == [1, 2]
    # "auto" measures up to half the largest graph: room for a joining prompt.
    assert token_target_bound(1024) == 512 and token_target_bound(1) == 1
    assert token_target_bound(None) is None
    with pytest.raises(ValueError, match="positive sizes"):
        measurement_token_counts(8192, 0, 64, 512)


def test_the_largest_graph_is_none_without_graphs():
    eager = types.SimpleNamespace(model_config=types.SimpleNamespace(enforce_eager=True),
                                  compilation_config=types.SimpleNamespace(
                                      max_cudagraph_capture_size=512))
    assert largest_cuda_graph_tokens(eager) is None
    graphs = types.SimpleNamespace(model_config=types.SimpleNamespace(enforce_eager=False),
                                   compilation_config=types.SimpleNamespace(
                                       max_cudagraph_capture_size=512, cudagraph_mode=None))
    assert largest_cuda_graph_tokens(graphs) == 512
    graphs.compilation_config.cudagraph_mode = types.SimpleNamespace(name="NONE")
    assert largest_cuda_graph_tokens(graphs) is None


class FakeClock:
    """time.perf_counter in seconds, moved by the simulated host."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class SimulatedStream:
    """One CUDA stream as the GPU runs it, on the fake host clock: a kernel starts when
    it is queued and the kernel before it is done; every launch costs the host
    ``launch_ms``; an event is an empty kernel; a spin of c cycles runs c /
    CYCLES_PER_MS ms. The four methods QueuedKernelTimer calls, plus ``kernel``."""

    CYCLES_PER_MS = 1_000_000

    def __init__(self, clock, launch_ms=0.005):
        self.clock, self.launch_ms = clock, launch_ms
        self.free_at_ms = 0.0  # when the GPU finishes what is queued

    def kernel(self, gpu_ms, launch_ms=None):
        start = max(self.clock.now * 1e3, self.free_at_ms)
        self.free_at_ms = start + gpu_ms
        self.clock.now += (self.launch_ms if launch_ms is None else launch_ms) / 1e3
        return self.free_at_ms

    def spin(self, cycles):
        self.kernel(cycles / self.CYCLES_PER_MS)

    def event(self):
        stream = self

        class Event:
            at_ms = None

            def record(self):
                self.at_ms = stream.kernel(0.0)

            def elapsed_time(self, other):
                return other.at_ms - self.at_ms

            def synchronize(self):
                stream.clock.now = max(stream.clock.now, self.at_ms / 1e3)

        return Event()

    def synchronize(self):
        self.clock.now = max(self.clock.now, self.free_at_ms / 1e3)


class FakeRunner:
    """The V2 runner's surface the measurement uses: a dummy run of ``kernels``
    kernels costing ``cost_ms(n)`` GPU ms in all, whose launches cost the host
    ``host_ms`` in all (an eager forward: host-bound when host_ms > cost_ms(n)), and
    the speculator attribute. ``waits_for_gpu``: the run synchronises half-way."""

    def __init__(self, stream, cost_ms, vllm_config=None, speculator=None, host_ms=1.0,
                 kernels=10, waits_for_gpu=False):
        self.stream, self.cost_ms = stream, cost_ms
        self.speculator = speculator
        self.vllm_config = vllm_config
        self.host_ms, self.kernels, self.waits_for_gpu = host_ms, kernels, waits_for_gpu
        self.host_ms_by_count = {}
        self.runs = []

    def _dummy_run(self, n, skip_attn=False, is_profile=False):
        assert skip_attn and is_profile, "the measurement uses the profiling path"
        assert self.speculator is None, "the drafter is detached while measuring"
        self.runs.append(n)
        for k in range(self.kernels):
            if self.waits_for_gpu and k == self.kernels // 2:
                self.stream.synchronize()
            host_ms = self.host_ms_by_count.get(n, self.host_ms)
            self.stream.kernel(self.cost_ms(n) / self.kernels, host_ms / self.kernels)


def _stream(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(cost_model.time, "perf_counter", clock)
    return SimulatedStream(clock)


def _run(runner, n=1):
    return lambda: runner._dummy_run(n, True, True)


def test_the_timer_times_the_kernels_not_the_host_that_launches_them(monkeypatch):
    stream = _stream(monkeypatch)
    timer = QueuedKernelTimer(40.0, stream)
    # An 8B-like eager forward: the host needs 15 ms to launch what the GPU runs in 5.
    runner = FakeRunner(stream, lambda n: 5.0, host_ms=15.0, kernels=500)
    assert timer(_run(runner)) == (pytest.approx(5.0), True)
    # GPU-bound (the kernels outlast their launches): the kernels' time still.
    runner = FakeRunner(stream, lambda n: 60.0, host_ms=3.0)
    assert timer(_run(runner)) == (pytest.approx(60.0), True)


def test_the_spin_clock_is_calibrated_without_the_launch_cost(monkeypatch):
    # Ranks' spins must end together (their all-reduces pair up): a launch cost of
    # 0.05 ms in a 1 ms calibration spin would make every spin 5 % short.
    clock = FakeClock()
    monkeypatch.setattr(cost_model.time, "perf_counter", clock)
    stream = SimulatedStream(clock, launch_ms=0.05)
    timer = QueuedKernelTimer(40.0, stream)
    assert timer.cycles_per_ms == pytest.approx(SimulatedStream.CYCLES_PER_MS)
    assert timer.spin_cycles == pytest.approx(40 * SimulatedStream.CYCLES_PER_MS, rel=1e-6)


def test_a_host_slower_than_the_spin_is_late(monkeypatch):
    stream = _stream(monkeypatch)
    runner = FakeRunner(stream, lambda n: 2.0, host_ms=45.0, kernels=100)
    ms, on_time = QueuedKernelTimer(40.0, stream)(_run(runner))
    assert not on_time and ms > 2.0  # the GPU waited for the host
    # A forward that waits for the GPU is late whatever the spin.
    runner = FakeRunner(stream, lambda n: 5.0, host_ms=2.0, waits_for_gpu=True)
    for spin_ms in (10.0, 1000.0):
        assert QueuedKernelTimer(spin_ms, stream)(_run(runner))[1] is False


def test_the_worker_reports_its_queueing_time_and_puts_the_drafter_back(monkeypatch):
    drafter = object()
    runner = FakeRunner(_stream(monkeypatch), lambda n: 1.0, speculator=drafter,
                        host_ms=7.0)
    host = forward_queueing_ms(types.SimpleNamespace(model_runner=runner), [1, 64])
    assert host == pytest.approx({1: 7.0, 64: 7.0})
    assert runner.runs == [1, 64, 1, 64]  # a pass that may compile, then the timed one
    assert runner.speculator is drafter


def test_the_worker_times_each_count_and_puts_the_drafter_back(monkeypatch):
    stream = _stream(monkeypatch)
    drafter = object()
    runner = FakeRunner(stream, lambda n: 2.0 + n / 100, speculator=drafter, host_ms=8.0)
    result = measure_target_forward_ms(types.SimpleNamespace(model_runner=runner), [1, 100],
                                       20.0, iters=3, timer=QueuedKernelTimer(20.0, stream))
    assert result == {"forward_ms": pytest.approx({1: 2.01, 100: 3.0}), "late": []}
    assert runner.runs == [1] * 3 + [100] * 3
    assert runner.speculator is drafter


def test_a_late_worker_runs_the_same_forwards_and_says_where_it_was_late(monkeypatch):
    # Tensor parallelism: every rank must run as many forwards as the others (their
    # collectives pair up), so lateness is reported, never retried.
    stream = _stream(monkeypatch)
    slow_at_64 = FakeRunner(stream, lambda n: 2.0, host_ms=8.0)
    slow_at_64.host_ms_by_count = {64: 30.0}
    result = measure_target_forward_ms(types.SimpleNamespace(model_runner=slow_at_64), [1, 64],
                                       20.0, iters=2, timer=QueuedKernelTimer(20.0, stream))
    assert result["late"] == [64]
    assert slow_at_64.runs == [1, 1, 64, 64]


def test_the_worker_puts_the_drafter_back_after_a_failure(monkeypatch):
    drafter = object()

    def boom(n):
        raise RuntimeError("out of memory")

    stream = _stream(monkeypatch)
    runner = FakeRunner(stream, boom, speculator=drafter)
    with pytest.raises(RuntimeError, match="out of memory"):
        measure_target_forward_ms(types.SimpleNamespace(model_runner=runner), [1], 20.0,
                                  timer=QueuedKernelTimer(20.0, stream))
    assert runner.speculator is drafter
    with pytest.raises(RuntimeError, match="out of memory"):
        forward_queueing_ms(types.SimpleNamespace(model_runner=runner), [1])
    assert runner.speculator is drafter


def test_the_worker_needs_a_cuda_gpu_for_its_default_timer(monkeypatch):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    runner = FakeRunner(_stream(monkeypatch), lambda n: 1.0)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        measure_target_forward_ms(types.SimpleNamespace(model_runner=runner), [1], 20.0)


class FakeSpeculator:
    def __init__(self):
        self.refreshed = 0

    def refresh_budget_schedule(self):
        self.refreshed += 1


def _vllm_config(auto=True, first_disabled=None, enforce_eager=False):
    spec = types.SimpleNamespace(
        ddtree_tokens_per_step="auto" if auto else 512, num_speculative_tokens=64,
        ddtree_disable_by_batch_size=first_disabled,
        num_speculative_tokens_per_batch_size=[(1, OPEN_END, 64)])
    return types.SimpleNamespace(
        speculative_config=spec,
        scheduler_config=types.SimpleNamespace(max_num_batched_tokens=8192, max_num_seqs=256),
        model_config=types.SimpleNamespace(enforce_eager=enforce_eager),
        # DDTree's default graphs for this engine (twice its largest decode step, at
        # most 1024 tokens: vllm_ddtree.config.ddtree_cudagraph_capture_size).
        compilation_config=types.SimpleNamespace(max_cudagraph_capture_size=1024,
                                                 cudagraph_mode=None))


class FakeEngineCore:
    """collective_rpc as vLLM runs it: the callable with each worker first."""

    def __init__(self, workers):
        self.workers = workers
        self.rpcs = []

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.rpcs.append(method.__name__)
        return [method(w, *args, **(kwargs or {})) for w in self.workers]


def _worker(stream, cost_ms, host_ms=1.0):
    # Each worker its own configuration object, as in separate processes.
    runner = FakeRunner(stream, cost_ms, vllm_config=_vllm_config(), speculator=FakeSpeculator(),
                        host_ms=host_ms)
    return types.SimpleNamespace(model_runner=runner)


def _gpu(monkeypatch):
    """The simulated stream in place of the CUDA one the workers' timers open."""
    stream = _stream(monkeypatch)
    monkeypatch.setattr(cost_model, "CudaStream", lambda: stream)
    return stream


@pytest.mark.parametrize("first_disabled", [None, 16])
def test_the_engine_core_applies_rank_zeros_knee_everywhere(monkeypatch, first_disabled):
    stream = _gpu(monkeypatch)
    # Rank 0: flat to 128 tokens; rank 1 (say, a slower link) would say 64: rank 0 decides.
    rank0 = _worker(stream, lambda n: 10.0 if n <= 128 else 10.0 + n / 20)
    rank1 = _worker(stream, lambda n: 10.0 if n <= 64 else 10.0 + n / 10)
    core = FakeEngineCore([rank0, rank1])
    cfg = _vllm_config(first_disabled=first_disabled)
    assert measure_tokens_per_step(core, cfg) == 128
    expected = batch_budget_schedule(128, 64, first_disabled)
    assert core.rpcs == ["forward_queueing_ms", "measure_target_forward_ms", "apply_budget_schedule"]
    assert cfg.speculative_config.num_speculative_tokens_per_batch_size == expected
    for w in (rank0, rank1):
        runner = w.model_runner
        assert runner.vllm_config.speculative_config.num_speculative_tokens_per_batch_size == expected
        assert runner.speculator.refreshed == 1
        # The grid stops at half the largest CUDA graph (1024 tokens): room for a
        # joining request's prompt beside a full step of trees.
        assert max(runner.runs) == 512


def test_a_flat_curve_takes_half_the_largest_graph_and_eager_the_whole_grid(monkeypatch):
    stream = _gpu(monkeypatch)
    core = FakeEngineCore([_worker(stream, lambda n: 5.0)])
    assert measure_tokens_per_step(core, _vllm_config()) == 512
    core = FakeEngineCore([_worker(stream, lambda n: 5.0)])
    # Without graphs: up to max_num_seqs x (budget + 1) capped by the token budget.
    assert measure_tokens_per_step(core, _vllm_config(enforce_eager=True)) == 8192


def test_a_target_whose_cost_grows_at_once_still_verifies_two_tokens(monkeypatch):
    stream = _gpu(monkeypatch)
    core = FakeEngineCore([_worker(stream, lambda n: float(n))])
    cfg = _vllm_config()
    assert measure_tokens_per_step(core, cfg) == 2
    assert cfg.speculative_config.num_speculative_tokens_per_batch_size == budget_schedule(2, 64)


def test_engines_without_auto_are_left_alone():
    core = FakeEngineCore([])
    cfg = _vllm_config(auto=False)
    assert measure_tokens_per_step(core, cfg) is None
    assert core.rpcs == []
    assert measure_tokens_per_step(core, types.SimpleNamespace(speculative_config=None)) is None


def test_apply_reaches_a_speculator_without_the_refresh_hook():
    runner = FakeRunner(None, lambda n: 1.0, vllm_config=_vllm_config(), speculator=None)
    apply_budget_schedule(types.SimpleNamespace(model_runner=runner), [(1, OPEN_END, 8)])
    assert runner.vllm_config.speculative_config.num_speculative_tokens_per_batch_size == [
        (1, OPEN_END, 8)]


def test_the_measurement_is_written_where_the_environment_says(monkeypatch, tmp_path):
    import json

    stream = _gpu(monkeypatch)
    report = tmp_path / "cost.json"
    monkeypatch.setenv(cost_model.REPORT_ENV, str(report))
    core = FakeEngineCore([_worker(stream, lambda n: 10.0 if n <= 64 else 20.0)])
    assert measure_tokens_per_step(core, _vllm_config()) == 64
    doc = json.loads(report.read_text())
    assert doc["tokens_per_step"] == 64 and doc["max_slowdown"] == 1.15
    assert doc["forward_ms"]["64"] == 10.0 and doc["forward_ms"]["128"] == 20.0
    assert doc["budget_schedule"] == [list(r) for r in budget_schedule(64, 64)]


def test_a_failed_measurement_stops_the_start_naming_the_way_out(monkeypatch):
    def boom(n):
        raise RuntimeError("CUDA out of memory")

    core = FakeEngineCore([_worker(_gpu(monkeypatch), boom)])
    with pytest.raises(RuntimeError, match='"auto".*CUDA out of memory.*set ddtree_tokens_per_step'):
        measure_tokens_per_step(core, _vllm_config())


def test_a_host_bound_eager_forward_does_not_hide_the_knee(monkeypatch):
    # An 8B start on the H200 (bench/results/2026-11-30-engine-rounds-cost8b-auto-long-prompts/):
    # launching the eager forward took the host 12-18 ms at every count (noisily), its kernels 5 ms up to 128 tokens and more beyond. Wall times
    # chose 2 tokens; the kernels' times choose 128.
    stream = _gpu(monkeypatch)
    host = iter([12.0, 18.0, 13.0, 17.0, 14.0, 16.0] * 100)
    worker = _worker(stream, lambda n: 5.0 if n <= 128 else 5.0 + n / 50)
    runner = worker.model_runner
    real_run = runner._dummy_run

    def noisy_host_run(n, skip_attn=False, is_profile=False):
        runner.host_ms = next(host)
        real_run(n, skip_attn, is_profile)

    runner._dummy_run = noisy_host_run
    assert measure_tokens_per_step(FakeEngineCore([worker]), _vllm_config()) == 128


def test_a_forward_that_waits_for_the_gpu_stops_the_start_naming_the_way_out(monkeypatch):
    worker = _worker(_gpu(monkeypatch), lambda n: 5.0)
    worker.model_runner.waits_for_gpu = True
    with pytest.raises(RuntimeError, match='"auto".*host sync.*set ddtree_tokens_per_step'):
        measure_tokens_per_step(FakeEngineCore([worker]), _vllm_config())


def test_every_rank_spins_as_long_as_the_slowest_host_needs(monkeypatch, tmp_path):
    import json

    stream = _gpu(monkeypatch)
    report = tmp_path / "cost.json"
    monkeypatch.setenv(cost_model.REPORT_ENV, str(report))
    rank0 = _worker(stream, lambda n: 5.0, host_ms=4.0)
    rank1 = _worker(stream, lambda n: 5.0, host_ms=6.0)
    rank1.model_runner.host_ms_by_count = {512: 16.0}
    assert measure_tokens_per_step(FakeEngineCore([rank0, rank1]), _vllm_config()) == 512
    expected = cost_model.SPIN_PER_HOST_MS * 16.0 + cost_model.SPIN_SLACK_MS
    assert json.loads(report.read_text())["spin_ms"] == pytest.approx(expected, abs=0.01)


def test_a_late_rank_stops_the_start_after_every_rank_ran_the_same_forwards(monkeypatch):
    stream = _gpu(monkeypatch)
    rank0 = _worker(stream, lambda n: 5.0)
    rank1 = _worker(stream, lambda n: 5.0)
    rank1.model_runner.waits_for_gpu = True
    with pytest.raises(RuntimeError, match=r"did not queue the forward at \[1, 2, 4"):
        measure_tokens_per_step(FakeEngineCore([rank0, rank1]), _vllm_config())
    assert rank0.model_runner.runs == rank1.model_runner.runs
