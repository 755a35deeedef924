"""CPU tests of the benchmark harness's pure parts (bench/run.py, bench/plot.py)."""

import json
import os
import types

import pytest

from bench.run import (
    SUITES,
    SpecCounters,
    cell_summary,
    compare_greedy,
    parse_config,
    percentile,
    cycled,
    requests_for,
    spec_counters,
)


def test_configs_parse_to_speculative_configs():
    assert parse_config("no-spec").speculative_config("d") is None
    assert parse_config("dflash").speculative_config("d") == {
        "method": "dflash", "model": "d", "num_speculative_tokens": 15}
    tree = parse_config("ddtree-b64-t512").speculative_config("d")
    assert tree == {"method": "ddtree", "model": "d", "num_speculative_tokens": 64,
                    "ddtree_tokens_per_step": 512}
    chain = parse_config("dflash-t512").speculative_config("d")
    assert chain["num_speculative_tokens_per_batch_size"][0] == [1, 32, 15]
    off = parse_config("ddtree-b64-t512-d16").speculative_config("d")
    assert off == dict(tree, ddtree_disable_by_batch_size=16)
    assert parse_config("ddtree-b32-d4").speculative_config("d") == {
        "method": "ddtree", "model": "d", "num_speculative_tokens": 32,
        "ddtree_disable_by_batch_size": 4}
    # The chain gets the same policy as a schedule.
    chain_off = parse_config("dflash-t512-d40").speculative_config("d")
    assert chain_off["num_speculative_tokens_per_batch_size"] == [
        [1, 32, 15], [33, 39, 8], [40, 1 << 20, 0]]
    assert parse_config("dflash-d8").speculative_config("d")[
        "num_speculative_tokens_per_batch_size"] == [[1, 7, 15], [8, 1 << 20, 0]]
    # DDTree's -d1 never drafts: a schedule of budget 0 (the series refuses
    # ddtree_disable_by_batch_size 1); the chain's -d1 and a token target with it are
    # refused.
    assert parse_config("ddtree-b64-d1").speculative_config("d") == {
        "method": "ddtree", "model": "d", "num_speculative_tokens": 64,
        "num_speculative_tokens_per_batch_size": [[1, 1 << 20, 0]]}
    for name in ("dflash-d1", "ddtree-b64-t512-d1"):
        with pytest.raises(ValueError, match="never drafting"):
            parse_config(name)


def test_a_config_flag_sets_engine_environment_only():
    plain, direct = parse_config("ddtree-b64-t512"), parse_config("ddtree-b64-t512+direct")
    assert direct.name == "ddtree-b64-t512+direct" and plain.env == ()
    assert direct.env == (("VLLM_DDTREE_DIRECT_LAUNCH", "1"),)
    assert direct.speculative_config("d") == plain.speculative_config("d")
    assert parse_config("ddtree-b32+tritonlaunch").env == (("VLLM_DDTREE_DIRECT_LAUNCH", "0"),)
    assert parse_config("ddtree-b64-t512+fulldraft").env == (("VLLM_DDTREE_LEAN_DRAFT", "0"),)
    assert parse_config("ddtree-b64-t512+eagerctx").env == (("VLLM_DDTREE_CONTEXT_GRAPHS", "0"),)
    assert parse_config("ddtree-b64-t512+lean").env == (("VLLM_DDTREE_LEAN_DRAFT", "1"),)
    with pytest.raises(ValueError, match="flags"):
        parse_config("ddtree-b32+turbo")


def test_auto_token_target_is_ddtrees():
    cfg = parse_config("ddtree-b64-tauto-d16")
    assert cfg.speculative_config("d") == {
        "method": "ddtree", "model": "d", "num_speculative_tokens": 64,
        "ddtree_tokens_per_step": "auto", "ddtree_disable_by_batch_size": 16}
    with pytest.raises(ValueError, match="DDTree's"):
        parse_config("dflash-tauto")


@pytest.mark.parametrize("name", ["ddtree", "ddtree-b0", "ddtree-bx", "no-spec-t4",
                                  "ddtree-b8-t1", "eagle", "ddtree-b8-d0", "no-spec-d4",
                                  "ddtree-b8-d4-t16", "dflash-dx", "ddtree-b8-tAUTO",
                                  "no-spec-tauto"])
def test_bad_config_names_are_refused(name):
    with pytest.raises(ValueError, match="config"):
        parse_config(name)


def test_every_suite_config_parses():
    for suite in SUITES.values():
        for name in suite.configs:
            parse_config(name)


def test_percentile_and_waves():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4, 5], 50) == 3
    assert percentile([0, 10], 99) == pytest.approx(9.9)
    assert requests_for(1, 8) == 8
    assert requests_for(4, 8) == 8
    assert requests_for(16, 8) == 16
    assert requests_for(5, 8) == 10
    assert requests_for(16, 64, min_waves=4) == 64
    assert requests_for(64, 64, min_waves=4) == 256
    assert cycled([[1], [2], [3]], 5) == [[1], [2], [3], [1], [2]]


def _metric(name, value=None, values=None):
    return types.SimpleNamespace(name=name, value=value, values=values)


def test_spec_counters_and_tau():
    before = spec_counters([_metric("vllm:spec_decode_num_drafts", 10),
                            _metric("vllm:spec_decode_num_accepted_tokens", 5),
                            _metric("vllm:spec_decode_num_draft_tokens", 320),
                            _metric("vllm:spec_decode_num_accepted_tokens_per_pos",
                                    values=[4, 1, 0])])
    after = spec_counters([_metric("vllm:spec_decode_num_drafts", 30),
                           _metric("vllm:spec_decode_num_accepted_tokens", 35),
                           _metric("vllm:spec_decode_num_draft_tokens", 960),
                           _metric("vllm:spec_decode_num_accepted_tokens_per_pos",
                                   values=[20, 10, 5, 0])])
    d = after.minus(before).summary()
    assert d["tau"] == 2.5  # 1 + 30 accepted / 20 steps
    assert d["accepted_tokens_per_step"] == 1.5
    assert d["draft_tokens_per_step"] == 32
    assert d["acceptance_by_depth"] == [0.8, 0.45, 0.25]
    assert SpecCounters().summary() == {}


def test_greedy_comparison_finds_the_first_difference():
    ref = [[1, 2, 3], [4, 5, 6]]
    assert compare_greedy(ref, ref)["greedy_match"] is True
    r = compare_greedy([[1, 2, 3], [4, 9, 6]], ref)
    assert r["greedy_match"] is False and r["greedy_identical"] == 1
    assert r["greedy_first_difference"] == {"request": 1, "token": 1}
    assert compare_greedy([[1, 2]], [[1, 2, 3]])["greedy_first_difference"] == {
        "request": 0, "token": 2}


def test_cell_summary():
    s = cell_summary([[1] * 10, [2] * 30], 2.0, [1.0, 2.0], [0.01, 0.03])
    assert s["output_tokens"] == 40 and s["output_tokens_per_s"] == 20.0
    assert s["time_per_output_token_ms"] == 20.0
    assert s["latency_p50_s"] == 1.5


def test_a_cell_splits_each_wave_into_engine_time_and_its_edges(monkeypatch):
    """run_cell against a fake LLM on a fake clock: TTFT from the engine's stamps, and
    per wave the time before the engine queued the first request and after its last
    token (medians over the waves)."""
    import types

    from bench import run

    clock = types.SimpleNamespace(now=100.0)
    monkeypatch.setattr(run.time, "perf_counter", lambda: clock.now)
    monkeypatch.setattr(run.time, "monotonic", lambda: clock.now)

    class FakeLLM:
        def __init__(self):
            self.waves = 0

        def get_metrics(self):
            return []

        def generate(self, prompts, params, use_tqdm=False):
            start_gap, end_gap = (0.004, 0.030) if self.waves == 0 else (0.002, 0.010)
            self.waves += 1
            outs = []
            queued = clock.now + start_gap
            for i, _ in enumerate(prompts):
                q = queued + 0.001 * i
                # Scheduled 5 ms after it was queued (behind a running step), its first
                # token 15 ms after that.
                metrics = types.SimpleNamespace(queued_ts=q, scheduled_ts=q + 0.005,
                                                first_token_ts=q + 0.02,
                                                last_token_ts=q + 0.02 + 0.001 * 9)
                outs.append(types.SimpleNamespace(
                    outputs=[types.SimpleNamespace(token_ids=list(range(10)))], metrics=metrics))
            clock.now = max(o.metrics.last_token_ts for o in outs) + end_gap
            return outs

    outputs, summary, _ = run.run_cell(FakeLLM(), [[1, 2]] * 4, 2, 0.0, 10, dummy=True)
    assert len(outputs) == 4
    assert summary["ttft_p50_s"] == pytest.approx(0.02)
    # The time to first token in its two parts: waiting to be scheduled, then prefilled.
    assert summary["ttft_queued_p50_s"] == pytest.approx(0.005)
    assert summary["ttft_scheduled_p50_s"] == pytest.approx(0.015)
    assert summary["time_per_output_token_ms"] == pytest.approx(1.0)
    assert summary["wave_start_gap_ms"] == pytest.approx(3.0)  # median of 4 and 2
    assert summary["wave_end_gap_ms"] == pytest.approx(20.0)  # median of 30 and 10


def test_a_wave_cell_times_the_engine_core_steps_that_returned_tokens(monkeypatch):
    """run_cell wraps the engine core client's get_output for each wave: when the
    wave's first two steps returned their outputs, after its first request was queued,
    the median time between the later ones and the steps a wave took, from the engine
    core's stamps; the client's own method is back afterwards."""
    import types

    from bench import run

    clock = types.SimpleNamespace(now=100.0)
    monkeypatch.setattr(run.time, "perf_counter", lambda: clock.now)
    monkeypatch.setattr(run.time, "monotonic", lambda: clock.now)

    class Client:
        def __init__(self):
            self.queue = []

        def get_output(self):
            return self.queue.pop(0)

    class FakeLLM:
        def __init__(self):
            self.llm_engine = types.SimpleNamespace(engine_core=Client())
            self.first_step_s = [0.040, 0.030]

        def get_metrics(self):
            return []

        def generate(self, prompts, params, use_tqdm=False):
            core = self.llm_engine.engine_core
            assert "get_output" in vars(core)  # wrapped while the wave runs
            q = clock.now + 0.001
            # Step 1 ends first_step_s after the first request was queued, step 2 5 ms
            # later, then one step every 2 ms; an output without tokens (stats only)
            # and one stamped before the wave are not steps of it.
            ends = [q + self.first_step_s.pop(0), None]
            ends[1] = ends[0] + 0.005
            ends += [ends[1] + 0.002 * k for k in range(1, 9)]
            core.queue = [types.SimpleNamespace(timestamp=q - 1.0, outputs=[1]),
                          types.SimpleNamespace(timestamp=q + 0.0005, outputs=[])]
            core.queue += [types.SimpleNamespace(timestamp=t, outputs=[1]) for t in ends]
            while core.queue:
                core.get_output()
            outs = []
            for i, _ in enumerate(prompts):
                metrics = types.SimpleNamespace(queued_ts=q + 0.0001 * i,
                                                scheduled_ts=q + 0.0001 * i,
                                                first_token_ts=ends[1], last_token_ts=ends[-1])
                outs.append(types.SimpleNamespace(
                    outputs=[types.SimpleNamespace(token_ids=list(range(10)))],
                    metrics=metrics))
            clock.now = ends[-1] + 0.001
            return outs

    llm = FakeLLM()
    _, summary, _ = run.run_cell(llm, [[1, 2]] * 4, 2, 0.0, 10, dummy=True)
    assert "get_output" not in vars(llm.llm_engine.engine_core)
    assert summary["wave_output_steps"] == 10
    assert summary["wave_first_output_ms"] == pytest.approx(35.0)  # median of 40 and 30
    assert summary["wave_second_output_ms"] == pytest.approx(40.0)
    assert summary["wave_output_step_ms_p50"] == pytest.approx(2.0)
    # Repeats merge by their median, as every repeated field.
    merged = run.merge_repeats([summary, dict(summary, wave_first_output_ms=45.0)])
    assert merged["wave_first_output_ms"] == pytest.approx(40.0)


class FakeSteadyEngine:
    """LLMEngine's add_request / step / has_unfinished_requests on a fake clock: each
    step advances 1 ms and emits one token for every request in flight; request i
    needs ``lengths[i]`` tokens (max_tokens caps it)."""

    def __init__(self, clock, lengths):
        self.clock, self.lengths = clock, lengths
        self.live = {}  # request id -> [prompt index, tokens so far, queued, first]
        self.max_live = 0
        self.steps = 0

    def add_request(self, request_id, prompt, params):
        i = int(request_id.rsplit("-", 1)[1])
        self.live[request_id] = [i, [], self.clock.now, None]
        self.max_live = max(self.max_live, len(self.live))
        return request_id + "-1a2b3c4d"  # vLLM's internal id; outputs carry the given one

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        import types

        self.steps += 1
        self.clock.now += 0.001
        outs = []
        for rid, state in list(self.live.items()):
            i, toks, queued, first = state
            toks.append(i)
            state[3] = first or self.clock.now
            done = len(toks) >= self.lengths[i]
            # Scheduled when the step that made its first token began.
            metrics = types.SimpleNamespace(queued_ts=queued, scheduled_ts=state[3] - 0.001,
                                            first_token_ts=state[3],
                                            last_token_ts=self.clock.now)
            outs.append(types.SimpleNamespace(
                request_id=rid, finished=done, metrics=metrics,
                outputs=[types.SimpleNamespace(token_ids=list(toks))]))
            if done:
                del self.live[rid]
        return outs


def test_a_steady_cell_keeps_the_concurrency_and_refills(monkeypatch):
    import types

    from bench import run

    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(run.time, "perf_counter", lambda: clock.now)
    lengths = [4, 8, 2, 6, 3, 5]
    engine = FakeSteadyEngine(clock, lengths)
    llm = types.SimpleNamespace(llm_engine=engine, get_metrics=lambda: [])
    prompts = [[i] for i in range(len(lengths))]
    outputs, summary, _ = run.run_cell_steady(llm, prompts, 2, 0.0, 8, dummy=True)
    assert outputs == [[i] * n for i, n in enumerate(lengths)]  # prompt order
    assert engine.max_live == 2
    # Each finished request is replaced for the next step: 0 (steps 1-4), then 2 (5-6),
    # 3 (7-12); 1 (1-8), then 4 (9-11), 5 (12-16).
    assert engine.steps == 16
    assert summary["output_tokens"] == sum(lengths)
    assert summary["wall_s"] == pytest.approx(engine.steps * 0.001)
    assert summary["ttft_p50_s"] == pytest.approx(0.001)
    # Every request was scheduled at the first step after it was queued.
    assert summary["ttft_queued_p50_s"] == pytest.approx(0.0, abs=1e-9)
    assert summary["ttft_scheduled_p50_s"] == pytest.approx(0.001)
    # Steps whose outputs carry a first token prefilled someone: 1 (requests 0 and 1),
    # 5, 7, 9 and 12 (each joining request); the other 11 only decoded.
    assert (summary["prefill_steps"], summary["decode_steps"]) == (5, 11)
    assert summary["prefill_step_ms_p50"] == pytest.approx(1.0)
    assert summary["decode_step_ms_p50"] == pytest.approx(1.0)
    assert summary["decode_step_ms_mean"] == pytest.approx(1.0)
    # The last request (5) is submitted when 4 finishes, at step 11: by then 0, 1, 2 and
    # 4 are done (4 + 8 + 2 + 3 tokens) and 3 has 5 of its 6; the drain after it is out.
    assert summary["full_concurrency_s"] == pytest.approx(0.011)
    assert summary["full_concurrency_tokens_per_s"] == pytest.approx(22 / 0.011)


def test_varied_output_lengths_are_per_request_and_the_same_for_every_config(monkeypatch):
    import types

    from bench import run

    assert [run.request_max_tokens(128, i) for i in range(3)] == [128] * 3
    varied = [run.request_max_tokens(128, i, "varied") for i in range(200)]
    assert varied == [run.request_max_tokens(128, i, "varied") for i in range(200)]
    assert min(varied) >= 64 and max(varied) <= 192 and len(set(varied)) > 50
    assert 115 <= sum(varied) / len(varied) <= 141  # about max_tokens on average
    with pytest.raises(ValueError, match="output lengths 'long'"):
        run.request_max_tokens(128, 0, "long")

    # A steady cell asks each request for its own length.
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(run.time, "perf_counter", lambda: clock.now)
    engine = FakeSteadyEngine(clock, [1000] * 6)
    asked = {}
    add = engine.add_request

    def add_request(request_id, prompt, params):
        i = int(request_id.rsplit("-", 1)[1])
        asked[i] = params.max_tokens
        engine.lengths[i] = params.max_tokens  # the fake stops there, as vLLM does
        return add(request_id, prompt, params)

    engine.add_request = add_request
    llm = types.SimpleNamespace(llm_engine=engine, get_metrics=lambda: [])
    outputs, summary, _ = run.run_cell_steady(llm, [[i] for i in range(6)], 2, 0.0, 8,
                                              dummy=True, lengths="varied")
    assert asked == {i: run.request_max_tokens(8, i, "varied") for i in range(6)}
    assert [len(o) for o in outputs] == [asked[i] for i in range(6)]


def test_eos_output_lengths_stop_where_the_target_ends_its_answer():
    """--output-lengths eos: the cap stays --max-tokens and the request stops at EOS
    (acceptance measured on the text the drafter was trained on); the other modes run
    past EOS to their fixed length."""
    pytest.importorskip("vllm")
    from bench import run

    eos = run._sampling_params(0.0, 256, 3, dummy=True, lengths="eos")
    assert eos.max_tokens == 256 and not eos.ignore_eos
    for lengths in ("fixed", "varied"):
        assert run._sampling_params(0.0, 256, 3, dummy=True, lengths=lengths).ignore_eos


def test_step_intervals_split_steps_that_prefill_a_joining_request():
    import types

    from bench.run import StepIntervals

    def out(n_tokens):
        return types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[0] * n_tokens)])

    iv = StepIntervals()
    iv.add(0.002, [out(5), out(9)])
    iv.add(0.010, [out(6), out(1)])  # a request's first token: its prefill step
    iv.add(0.004, [out(7), out(3)])
    iv.add(0.015, [out(8), out(4)])  # a slow decode step: the mean sees it, the p50 not
    assert iv.summary() == {"decode_step_ms_p50": 4.0, "decode_step_ms_mean": 7.0,
                            "decode_steps": 3, "prefill_step_ms_p50": 10.0,
                            "prefill_step_ms_mean": 10.0, "prefill_steps": 1}
    assert StepIntervals().summary() == {}


def test_result_rows_satisfy_the_regression_checker(tmp_path):
    """A run's rows are what ci/check_regression.py reads."""
    from ci.check_regression import load_results

    row = dict(config="ddtree-b32", prompt_set="humaneval", batch_size=1, temperature=0.0,
               **cell_summary([[1] * 8], 1.0, [1.0], []),
               **SpecCounters(4, 128, 4, [4]).summary(),
               **compare_greedy([[1] * 8], [[1] * 8]))
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"git_rev": "x", "command": "c", "results": [row]}))
    assert len(load_results(path)) == 1


def test_plot_panels_group_by_set_and_temperature():
    from bench.plot import series_by_panel

    doc = {"results": [
        dict(config="a", prompt_set="he", temperature=0.0, batch_size=4, output_tokens_per_s=2),
        dict(config="a", prompt_set="he", temperature=0.0, batch_size=1, output_tokens_per_s=1),
        dict(config="b", prompt_set="he", temperature=1.0, batch_size=1, output_tokens_per_s=3,
             tau=2.0)]}
    panels = series_by_panel(doc)
    assert panels[("he", 0.0)]["a"] == [(1, 1, None), (4, 2, None)]
    assert panels[("he", 1.0)]["b"] == [(1, 3, 2.0)]


def test_cost_model_from_cost_rows():
    from bench.run import cost_model

    rows = [
        dict(config="no-spec", batch_size=1, time_per_output_token_ms=4.0),
        dict(config="ddtree-b64", batch_size=1, time_per_output_token_ms=4.4, tau=1.0,
             verified_tokens_per_forward=65),
        dict(config="ddtree-b64", batch_size=4, time_per_output_token_ms=6.0, tau=1.0,
             verified_tokens_per_forward=260),
        dict(config="dflash", batch_size=4, time_per_output_token_ms=4.5, tau=1.02,
             verified_tokens_per_forward=64),
    ]
    model = cost_model(rows)
    assert [p["verified_tokens"] for p in model["points"]] == [1, 64, 65, 260]
    assert model["suggested_ddtree_tokens_per_step"] == 65  # 4.4 / 4.0 <= 1.15 < 6.0 / 4.0
    assert cost_model([]) is None


def test_gpu_busy_time_is_the_union_of_kernel_intervals():
    from bench.profile_step import busy_union_us

    assert busy_union_us([]) == 0.0
    # overlap, containment, a gap, unsorted input
    assert busy_union_us([(10, 20), (0, 5), (15, 30), (16, 18), (40, 41)]) == 5 + 20 + 1
    assert busy_union_us([(0, 10), (10, 12)]) == 12


def test_engine_process_option_sets_vllms_variable(monkeypatch, tmp_path):
    import bench.run as run

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "x")
    # A missing target stops the run after the option took effect, before any GPU work.
    with pytest.raises(SystemExit):
        run.main(["--suite", "ci", "--out", str(tmp_path / "o.json"), "--engine-process",
                  "inproc", "--target", str(tmp_path / "none")])
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    with pytest.raises(SystemExit):
        run.main(["--suite", "ci", "--out", str(tmp_path / "o.json"),
                  "--target", str(tmp_path / "none")])
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_chrome_trace_summary_gives_gpu_busy_share_and_python_own_time():
    from bench.profile_step import summarize_chrome_trace

    ev = [
        # GPU: two overlapping kernels and a copy; busy = 10 + 5 of a 30 us span
        {"ph": "X", "cat": "kernel", "name": "k1", "ts": 100, "dur": 8},
        {"ph": "X", "cat": "kernel", "name": "k2", "ts": 104, "dur": 6},
        {"ph": "X", "cat": "gpu_memcpy", "name": "copy", "ts": 125, "dur": 5},
        # host thread 1: step() 100 us calls a() 60 us, which calls b() 20 us
        {"ph": "X", "cat": "python_function", "name": "step", "ts": 0, "dur": 100, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "python_function", "name": "a", "ts": 10, "dur": 60, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "python_function", "name": "b", "ts": 20, "dur": 20, "pid": 1, "tid": 1},
        # another thread, same name: counted separately from thread 1's nesting
        {"ph": "X", "cat": "python_function", "name": "b", "ts": 15, "dur": 30, "pid": 1, "tid": 2},
        {"ph": "i", "cat": "python_function", "name": "instant", "ts": 5},
    ]
    s = summarize_chrome_trace({"traceEvents": ev}, steps=1)
    assert s["gpu_busy_ms"] == 0.015 and s["gpu_span_ms"] == 0.03
    assert s["kernel_launches"] == 3
    own = {r["name"]: r["us_per_step"] for r in s["top_python_own_time"]}
    assert own == {"step": 40.0, "a": 40.0, "b": 50.0}
    assert s["top_kernels"][0]["name"] == "k1"
    incl = {r["name"]: r["us_per_step"] for r in s["top_python_inclusive_time"]}
    assert incl == {"step": 100.0, "a": 60.0, "b": 50.0}
    # Every kernel per step, copies included, as --compare-kernels reads it (the
    # in-process profiles write the same rows).
    assert s["kernels_per_step"] == [
        {"name": "k1", "us_per_step": 8.0, "calls_per_step": 1.0},
        {"name": "k2", "us_per_step": 6.0, "calls_per_step": 1.0},
        {"name": "copy", "us_per_step": 5.0, "calls_per_step": 1.0}]
    from bench.profile_step import compare_kernels
    other = dict(s, kernels_per_step=[{"name": "k1", "us_per_step": 9.5, "calls_per_step": 1.0}])
    diff = compare_kernels({"config": "a", "torch_profile": s}, {"config": "b", "torch_profile": other})
    assert diff["kernels"][0]["name"] == "k2" and diff["kernels"][0]["only_in"] == "base"


def test_chrome_trace_summary_attributes_blocking_runtime_calls_to_python_callers():
    from bench.profile_step import summarize_chrome_trace

    ev = [
        {"ph": "X", "cat": "python_function", "name": "step", "ts": 0, "dur": 100, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "python_function", "name": "walk", "ts": 10, "dur": 50, "pid": 1, "tid": 1},
        # a sync inside walk(), a launch inside walk(), a copy in step() after walk()
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 20, "dur": 30,
         "pid": 1, "tid": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 55, "dur": 4,
         "pid": 1, "tid": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 70, "dur": 6,
         "pid": 1, "tid": 1},
        # same name on another thread with no Python frame
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 5, "dur": 2,
         "pid": 1, "tid": 2},
        # a copy issued by a torch built-in: named with the function that called it
        {"ph": "X", "cat": "python_function", "name": "prepare", "ts": 200, "dur": 50, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "python_function", "name": "<built-in method copy_ of Tensor object at 0x1>",
         "ts": 210, "dur": 20, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 215, "dur": 8,
         "pid": 1, "tid": 1},
    ]
    s = summarize_chrome_trace({"traceEvents": ev}, steps=2)
    blocking = {r["name"]: r["us_per_step"] for r in s["blocking_runtime_calls_by_caller"]}
    assert blocking == {"cudaStreamSynchronize <- walk": 15.0, "cudaMemcpyAsync <- step": 3.0,
                        "cudaMemcpyAsync <- (no Python caller)": 1.0,
                        "cudaMemcpyAsync <- copy_ <- prepare": 4.0}
    # The synchronisation with its Python frames, innermost first; copies are not in it.
    stacks = {r["name"]: r["us_per_step"] for r in s["synchronizations_by_stack"]}
    assert stacks == {"cudaStreamSynchronize <- walk <- step": 15.0}
    runtime = {r["name"]: r["calls_per_step"] for r in s["cuda_runtime_per_step"]}
    assert runtime == {"cudaStreamSynchronize": 0.5, "cudaLaunchKernel": 0.5, "cudaMemcpyAsync": 1.5}
    own = {r["name"]: r["us_per_step"] for r in s["top_python_own_time"]}
    # runtime calls are not Python frames
    assert own == {"step": 25.0, "walk": 25.0, "prepare": 15.0,
                   "<built-in method copy_ of Tensor object at 0x1>": 10.0}


def test_summarize_trace_mode_writes_every_kernel(tmp_path):
    import gzip

    from bench.profile_step import main as profile_main

    trace = tmp_path / "profile-x-trace.json.gz"
    ev = [{"ph": "X", "cat": "kernel", "name": f"k{i}", "ts": 10 * i, "dur": 2} for i in range(30)]
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    assert profile_main(["--summarize-trace", str(trace), "--steps", "2",
                         "--out-dir", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "kernels-profile-x-trace.json").read_text())
    assert len(out["top_kernels"]) == 30 and out["steps"] == 2
    assert out["top_kernels"][0]["us_per_step"] == 1.0
    with pytest.raises(SystemExit):
        profile_main(["--summarize-trace", str(trace), "--out-dir", str(tmp_path)])


def test_profile_step_samples_at_the_asked_temperature_seeded_as_the_benchmark():
    """bench/profile_step.py --temperature: each request of a profiled wave carries the
    temperature and bench/run.py's per-request seed (1000 + index), none at T=0."""
    from types import SimpleNamespace

    from bench.profile_step import generate

    seen = []

    class FakeLLM:
        def generate(self, prompts, sps, use_tqdm=False):
            seen.append(sps)
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1] * sp.max_tokens)])
                    for sp in sps]

    wall, n = generate(FakeLLM(), [[1, 2], [3], [4]], 5, temperature=1.0)
    assert n == 15 and wall >= 0
    assert [(sp.temperature, sp.seed, sp.ignore_eos) for sp in seen[0]] == \
        [(1.0, 1000, True), (1.0, 1001, True), (1.0, 1002, True)]
    generate(FakeLLM(), [[1]], 3)
    assert (seen[1][0].temperature, seen[1][0].seed) == (0.0, None)


def test_code_digest_changes_with_the_measured_code_only(tmp_path):
    from bench.run import code_digest

    (tmp_path / "vllm_ddtree").mkdir()
    (tmp_path / "patches").mkdir()
    (tmp_path / "bench").mkdir()
    (tmp_path / "vllm_ddtree" / "a.py").write_text("x = 1\n")
    (tmp_path / "patches" / "series").write_text("p.patch\n")
    (tmp_path / "bench" / "run.py").write_text("# run\n")
    first = code_digest(str(tmp_path))
    assert len(first) == 12 and first == code_digest(str(tmp_path))
    (tmp_path / "README.md").write_text("docs do not count\n")
    assert code_digest(str(tmp_path)) == first
    (tmp_path / "vllm_ddtree" / "a.py").write_text("x = 2\n")
    assert code_digest(str(tmp_path)) != first


def test_host_info_names_the_cpu_and_times_the_python_loop(monkeypatch):
    """The header's host record: a CPU model (from /proc/cpuinfo where it exists),
    the CPUs this process may use, and the loop's median time; the loop's time is
    the median of its repeats."""
    import bench.run as run

    info = run.host_info()
    assert set(info) == {"cpu_model", "usable_cpus", "python_loop_ms"}
    assert info["usable_cpus"] >= 1 and info["python_loop_ms"] > 0
    if os.path.exists("/proc/cpuinfo"):
        assert info["cpu_model"]
    ticks = iter([0.0, 0.003, 1.0, 1.001, 2.0, 2.002])  # 3, 1 and 2 ms
    monkeypatch.setattr(run.time, "perf_counter", lambda: next(ticks))
    assert run.host_loop_ms(repeats=3, items=10) == 2.0


def _row(config, batch, tps, prompt_set="humaneval", temperature=0.0):
    return {"config": config, "prompt_set": prompt_set, "temperature": temperature,
            "batch_size": batch, "output_tokens_per_s": tps}


def test_speculation_crossover_finds_where_plain_decoding_wins():
    from bench.run import speculation_crossover

    rows = []
    for t in (0.0, 1.0):
        rows += [_row("no-spec", b, tps, temperature=t)
                 for b, tps in ((1, 100), (4, 400), (16, 1600), (64, 6400))]
        rows += [_row("ddtree", b, tps, temperature=t)
                 for b, tps in ((1, 150), (4, 420 if t == 0 else 380), (16, 1500), (64, 6000))]
        rows += [_row("slow", b, 50, temperature=t) for b in (1, 4)]
    rows.append(_row("no-baseline-cell", 8, 999))
    doc = speculation_crossover(rows)
    tree = doc["configs"]["ddtree"]
    # At batch 4 one cell is above plain decoding: the tree keeps drafting there.
    assert tree["suggested_ddtree_disable_by_batch_size"] == 16
    assert tree["ratio_to_baseline_by_batch_size"]["4"] == [1.05, 0.95]
    # Below plain decoding everywhere: drafting would stop from 2 requests.
    assert doc["configs"]["slow"]["suggested_ddtree_disable_by_batch_size"] == 2
    assert "no-baseline-cell" not in doc["configs"]
    rows_above = [r for r in rows if r["config"] == "no-spec"] + [
        _row("fast", b, 10 ** 6) for b in (1, 4, 16, 64)]
    assert speculation_crossover(rows_above)["configs"]["fast"][
        "suggested_ddtree_disable_by_batch_size"] is None
    assert speculation_crossover([_row("ddtree", 1, 5)]) is None


def test_merge_repeats_takes_medians_and_keeps_every_run():
    from bench.run import merge_repeats

    base = {"num_requests": 8, "output_tokens": 1024, "latency_p50_s": 0.3,
            "latency_p99_s": 0.4, "time_per_output_token_ms": 2.0}
    runs = [dict(base, wall_s=w, output_tokens_per_s=round(1024 / w, 2)) for w in (2.0, 1.0, 4.0)]
    merged = merge_repeats(runs)
    assert merged["wall_s"] == 2.0 and merged["output_tokens_per_s"] == 512.0
    assert merged["output_tokens_per_s_runs"] == [512.0, 1024.0, 256.0]
    assert merged["output_tokens_per_s_spread"] == 1.5 and merged["repeats"] == 3
    assert merged["num_requests"] == 8
    assert merge_repeats(runs[:1]) is runs[0]
    with pytest.raises(ValueError):
        merge_repeats([])


def test_spec_counters_add_up_over_repeats():
    from bench.run import SpecCounters

    total = SpecCounters(2, 30, 3, [2, 1]).plus(SpecCounters(1, 15, 2, [1, 0, 1]))
    assert total == SpecCounters(3, 45, 5, [3, 1, 1])
    assert total.summary()["tau"] == round(1 + 5 / 3, 4)


def test_repeats_must_be_positive(tmp_path):
    from bench.run import main

    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "r.json"), "--repeats", "0"])


def test_main_measures_every_cell_repeats_times(tmp_path, monkeypatch):
    """The whole loop of bench/run.py with the engine and the measurement faked: every
    cell is run --repeats times, its timings merged, its spec counters summed."""
    import json
    import types

    import bench.run as run

    calls = []
    fake_llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(vllm_config=types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(async_scheduling=True))))
    monkeypatch.setattr(run, "_engine", lambda args, suite, target, drafter, cfg: (fake_llm, None))
    monkeypatch.setattr(run, "_free", lambda llm: None)

    def fake_run_cell(llm, prompts, batch, temperature, max_tokens, dummy, lengths="fixed"):
        calls.append((len(prompts), batch, temperature, max_tokens))
        wall = 1.0 + 0.5 * (len(calls) % 2)
        return _fake_cell(prompts, max_tokens, wall)

    monkeypatch.setattr(run, "run_cell", fake_run_cell)
    out = tmp_path / "r.json"
    assert run.main(["--suite", "cost8b", "--out", str(out), "--configs", "dflash",
                     "--batch-sizes", "1", "2", "--temperatures", "0", "--max-tokens", "4",
                     "--repeats", "3"]) == 0
    doc = json.loads(out.read_text())
    cells = doc["results"]
    assert [c["batch_size"] for c in cells] == [1, 2]
    assert all(c["repeats"] == 3 and len(c["output_tokens_per_s_runs"]) == 3 for c in cells)
    # Spec counters summed over the three runs: 6 drafts, 3 accepted -> tau 1.5.
    assert all(c["tau"] == 1.5 for c in cells)
    measured = [c for c in calls if c[3] == 4]
    assert len(measured) == 2 * 3


def test_steady_cells_are_warmed_up_by_an_untimed_steady_cell(tmp_path, monkeypatch):
    """--cell-mode steady: before any timed cell, each batch size runs a wave and then
    an untimed steady cell (joining requests beside running ones) with the run's
    output lengths; the timed cells follow, --repeats each."""
    import json
    import types

    import bench.run as run

    calls = []
    fake_llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(vllm_config=types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(async_scheduling=True))))
    monkeypatch.setattr(run, "_engine", lambda args, suite, target, drafter, cfg: (fake_llm, None))
    monkeypatch.setattr(run, "_free", lambda llm: None)

    def fake(kind):
        def cell(llm, prompts, batch, temperature, max_tokens, dummy, lengths="fixed"):
            calls.append((kind, len(prompts), batch, max_tokens, lengths))
            outs = [[1] * max_tokens for _ in prompts]
            summary = run.cell_summary(outs, 1.0, [1.0] * len(prompts), [0.002] * len(prompts))
            return outs, summary, run.SpecCounters(2, 30, 1, [1])
        return cell

    monkeypatch.setattr(run, "run_cell", fake("wave"))
    monkeypatch.setattr(run, "run_cell_steady", fake("steady"))
    out = tmp_path / "r.json"
    assert run.main(["--suite", "cost8b", "--out", str(out), "--configs", "no-spec",
                     "--batch-sizes", "2", "4", "--temperatures", "0", "--max-tokens", "32",
                     "--repeats", "2", "--min-requests", "8", "--cell-mode", "steady",
                     "--output-lengths", "varied"]) == 0
    waves = run.STEADY_WARMUP_WAVES
    assert calls[:4] == [("wave", 2, 2, 8, "fixed"), ("steady", waves * 2, 2, 16, "varied"),
                         ("wave", 4, 4, 8, "fixed"), ("steady", waves * 4, 4, 16, "varied")]
    timed = calls[4:]
    assert all(c[0] == "steady" and c[3] == 32 for c in timed) and len(timed) == 2 * 2
    assert [c["batch_size"] for c in json.loads(out.read_text())["results"]] == [2, 4]


def _fake_cell(prompts, max_tokens: int, wall: float):
    """What run_cell returns for a cell of ``prompts`` that took ``wall`` seconds, each
    run 2 drafts of 30 tokens with 1 accepted."""
    import bench.run as run

    summary = run.cell_summary([[1] * max_tokens for _ in prompts], wall,
                               [wall] * len(prompts), [0.002] * len(prompts))
    return [[1] * max_tokens for _ in prompts], summary, run.SpecCounters(2, 30, 1, [1])


def test_engine_rounds_alternate_the_order_and_merge_every_engine(tmp_path, monkeypatch):
    """--engine-rounds 2: each configuration's engine starts twice, in the order A B
    then B A; a cell is one row whose median runs over both engines (its repeats count
    all runs, its counters sum them) and which keeps each engine's tokens/s."""
    import json
    import types

    import bench.run as run

    engines, calls = [], []
    fake_llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(vllm_config=types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(async_scheduling=True))))

    def fake_engine(args, suite, target, drafter, cfg):
        engines.append(cfg.name)
        return fake_llm, None

    monkeypatch.setattr(run, "_engine", fake_engine)
    monkeypatch.setattr(run, "_free", lambda llm: None)

    def fake_run_cell(llm, prompts, batch, temperature, max_tokens, dummy, lengths="fixed"):
        calls.append(engines[-1])
        # Each engine its own speed: the first engine of a config 1 s per cell, the second 2 s.
        wall = 1.0 if engines.count(engines[-1]) == 1 else 2.0
        return _fake_cell(prompts, max_tokens, wall)

    monkeypatch.setattr(run, "run_cell", fake_run_cell)
    out = tmp_path / "r.json"
    assert run.main(["--suite", "cost8b", "--out", str(out), "--configs", "no-spec", "dflash",
                     "--batch-sizes", "1", "--temperatures", "0", "--max-tokens", "4",
                     "--repeats", "2", "--engine-rounds", "2"]) == 0
    assert engines == ["no-spec", "dflash", "dflash", "no-spec"]
    doc = json.loads(out.read_text())
    assert [(e["config"], e["round"]) for e in doc["engines"]] == [
        ("no-spec", 0), ("dflash", 0), ("dflash", 1), ("no-spec", 1)]
    # Every engine and the run itself record how fast the host ran Python.
    assert all(e["host_python_loop_ms"] > 0 for e in doc["engines"])
    assert doc["host"]["python_loop_ms"] > 0 and doc["host"]["usable_cpus"] >= 1
    rows = doc["results"]
    assert [r["config"] for r in rows] == ["no-spec", "dflash"]
    for r in rows:
        tokens = r["output_tokens"]  # per run; the first engine 1 s per run, the second 2 s
        assert r["repeats"] == 4 and r["engine_rounds"] == 2
        assert r["output_tokens_per_s_engines"] == [tokens, tokens / 2]
        assert r["output_tokens_per_s_engine_spread"] == round(0.5 / 0.75, 4)
        assert r["output_tokens_per_s"] == 0.75 * tokens  # the median of t, t, t/2, t/2
    dflash = rows[1]
    # 4 runs x (2 drafts, 30 draft tokens, 1 accepted): tau 1.5; 8 drafts; over every
    # step (exact counts): 4 x tokens - 4 accepted request-steps, 8 of them drafting.
    assert dflash["tau"] == 1.5 and dflash["num_drafts"] == 8
    steps = 4 * dflash["output_tokens"] - 4
    assert dflash["drafting_share"] == round(8 / steps, 4)
    assert dflash["verified_tokens_per_forward_all_steps"] == round(1 + 120 / steps, 1)


def test_interleave_keeps_every_engine_alive_and_takes_the_repeats_in_turns(tmp_path,
                                                                              monkeypatch):
    """--interleave: the engines of a round start (and warm up) first, then each cell's
    repeat i runs once on every engine, A B then B A; each engine is freed once, after
    the last cell, and its GPU memory share is split between the engines."""
    import json
    import types

    import bench.run as run

    events, alive = [], []

    def fake_engine(args, suite, target, drafter, cfg):
        events.append(("start", cfg.name))
        llm = types.SimpleNamespace(name=cfg.name, llm_engine=types.SimpleNamespace(
            vllm_config=types.SimpleNamespace(
                scheduler_config=types.SimpleNamespace(async_scheduling=True))))
        alive.append(llm)
        return llm, None

    def fake_free(llm):
        events.append(("free", llm.name))
        alive.remove(llm)

    monkeypatch.setattr(run, "_engine", fake_engine)
    monkeypatch.setattr(run, "_free", fake_free)
    clock = {"t": 0.0}

    def fake_run_cell(llm, prompts, batch, temperature, max_tokens, dummy, lengths="fixed"):
        if max_tokens == 8:  # the warm-up
            events.append(("warm", llm.name))
        else:
            events.append(("run", llm.name, batch))
        # The host slows down over the call: every run takes longer than the one before,
        # whichever engine runs it.
        clock["t"] += 1.0
        wall = clock["t"]
        return _fake_cell(prompts, max_tokens, wall)

    monkeypatch.setattr(run, "run_cell", fake_run_cell)
    out = tmp_path / "r.json"
    assert run.main(["--suite", "cost8b", "--out", str(out), "--configs", "no-spec", "dflash",
                     "--batch-sizes", "1", "4", "--temperatures", "0", "--max-tokens", "4",
                     "--repeats", "3", "--interleave"]) == 0
    assert events[:4] == [("start", "no-spec"), ("warm", "no-spec"), ("warm", "no-spec"),
                          ("start", "dflash")]
    runs = [e[1:] for e in events if e[0] == "run"]
    assert runs == [("no-spec", 1), ("dflash", 1), ("dflash", 1), ("no-spec", 1),
                    ("no-spec", 1), ("dflash", 1),
                    ("no-spec", 4), ("dflash", 4), ("dflash", 4), ("no-spec", 4),
                    ("no-spec", 4), ("dflash", 4)]
    assert events[-2:] == [("free", "no-spec"), ("free", "dflash")] and not alive
    doc = json.loads(out.read_text())
    assert doc["interleave"] is True
    rows = {(r["config"], r["batch_size"]): r for r in doc["results"]}
    assert all(r["interleaved"] and r["repeats"] == 3 for r in rows.values())
    # Run i of the two engines took turns: their walls were 1 s apart, not 3 cells apart.
    plain, chain = rows[("no-spec", 1)], rows[("dflash", 1)]
    walls = [plain["output_tokens"] / t for t in plain["output_tokens_per_s_runs"]]
    assert [round(w) for w in walls] == [5, 8, 9]
    walls = [chain["output_tokens"] / t for t in chain["output_tokens_per_s_runs"]]
    assert [round(w) for w in walls] == [6, 7, 10]


def test_interleave_splits_the_gpu_and_refuses_more_than_fits(tmp_path, monkeypatch):
    import bench.run as run

    seen = []
    monkeypatch.setattr(run, "measure_interleaved",
                        lambda args, *a, **k: seen.append(args.gpu_memory_utilization))
    out = tmp_path / "r.json"
    assert run.main(["--suite", "cost8b", "--out", str(out), "--configs", "no-spec", "dflash",
                     "ddtree-b32", "--batch-sizes", "1", "--interleave"]) == 0
    assert seen == [0.3]
    with pytest.raises(SystemExit, match="--interleave keeps 3 engines alive"):
        run.main(["--suite", "cost8b", "--out", str(out), "--configs", "no-spec", "dflash",
                  "ddtree-b32", "--batch-sizes", "1", "--interleave",
                  "--gpu-memory-utilization", "0.4"])


def test_an_auto_engine_records_what_its_engine_core_measured(tmp_path, monkeypatch):
    """-tauto: the engine gets VLLM_DDTREE_COST_MODEL_REPORT, and the engine record
    keeps the report the engine core wrote there."""
    import json
    import types

    import bench.run as run

    fake_llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(vllm_config=types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(async_scheduling=True),
        compilation_config=types.SimpleNamespace(max_cudagraph_capture_size=1024))))

    def fake_engine(args, suite, target, drafter, cfg):
        path = dict(cfg.env)["VLLM_DDTREE_COST_MODEL_REPORT"]
        with open(path, "w") as f:
            json.dump({"tokens_per_step": 256, "budget_schedule": [[1, 3, 64]]}, f)
        return fake_llm, None

    monkeypatch.setattr(run, "_engine", fake_engine)
    monkeypatch.setattr(run, "_free", lambda llm: None)
    monkeypatch.setattr(run, "run_cell", lambda llm, prompts, batch, temperature, max_tokens,
                        dummy, lengths="fixed": (
        [[1] * max_tokens for _ in prompts],
        run.cell_summary([[1] * max_tokens for _ in prompts], 1.0, [1.0] * len(prompts), [0.001]),
        run.SpecCounters(2, 30, 1, [1])))
    out = tmp_path / "r.json"
    assert run.main(["--suite", "cost8b", "--out", str(out), "--configs", "ddtree-b64-tauto",
                     "--batch-sizes", "1", "--temperatures", "0", "--max-tokens", "4"]) == 0
    engine = json.loads(out.read_text())["engines"][0]
    assert engine["config"] == "ddtree-b64-tauto"
    assert engine["cost_model"] == {"tokens_per_step": 256, "budget_schedule": [[1, 3, 64]]}
    assert engine["max_cudagraph_capture_size"] == 1024  # the graphs it captured


def test_a_cell_reports_the_engine_with_the_fewest_identical_outputs():
    from bench.run import CellRuns, cell_summary

    cell = CellRuns(row=0)
    summary = cell_summary([[1, 2]], 1.0, [1.0], [0.001])
    cell.add_engine([summary], [], {"greedy_identical": 5, "greedy_total": 5})
    cell.add_engine([summary], [], {"greedy_identical": 4, "greedy_total": 5})
    entry = cell.entry("ddtree-b32", "ddtree", "humaneval", 1, 0.0)
    assert entry["greedy_identical"] == 4 and entry["engine_rounds"] == 2
    assert "tau" not in entry  # no drafts counted


@pytest.mark.parametrize("rounds", ["0", "-1"])
def test_engine_rounds_must_be_positive(tmp_path, rounds):
    from bench.run import main

    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "r.json"), "--engine-rounds", rounds])


def test_all_steps_fields_count_the_steps_that_verified_no_drafts():
    from bench.run import all_steps_fields

    # 2 runs x 100 output tokens at batch 4; 10 request-steps drafted 64 nodes and
    # accepted 20 tokens in all: 200 - 20 = 180 request-steps, 10 of them drafting.
    entry = dict(batch_size=4, output_tokens=100, repeats=2, num_drafts=10,
                 accepted_tokens_per_step=2.0, draft_tokens_per_step=64.0)
    fields = all_steps_fields(entry)
    assert fields["drafting_share"] == round(10 / 180, 4)
    assert fields["verified_tokens_per_forward_all_steps"] == round(4 * (1 + 640 / 180), 1)
    # Every step drafted: the drafting steps' figure.
    entry = dict(batch_size=1, output_tokens=50, num_drafts=25, accepted_tokens_per_step=1.0,
                 draft_tokens_per_step=8.0)
    assert all_steps_fields(entry) == {"drafting_share": 1.0,
                                       "verified_tokens_per_forward_all_steps": 9.0}
    assert all_steps_fields({"batch_size": 4}) == {}


def test_an_engine_flag_sets_an_engine_argument_not_the_environment():
    cfg = parse_config("no-spec+tritonattn")
    assert cfg.env == () and cfg.method is None
    assert dict(cfg.engine_args) == {"attention_config": (("backend", "TRITON_ATTN"),)}
    hash(cfg)  # configs stay hashable
    with pytest.raises(ValueError, match="tritonatn"):
        parse_config("no-spec+tritonatn")


def test_engine_flags_on_one_argument_merge():
    from bench.run import config_engine_kwargs

    cfg = parse_config("ddtree-b64-t512+cgfull+cg1024")
    assert config_engine_kwargs(cfg) == {"compilation_config": {
        "cudagraph_mode": "FULL", "max_cudagraph_capture_size": 1024}}
    assert config_engine_kwargs(parse_config("no-spec+tritonattn+cgfull")) == {
        "attention_config": {"backend": "TRITON_ATTN"},
        "compilation_config": {"cudagraph_mode": "FULL"}}


def test_engine_flags_reach_the_engine_and_refuse_a_clash(monkeypatch):
    import types

    import vllm

    from bench import run as bench_run

    seen = {}
    monkeypatch.setattr(vllm, "LLM", lambda **kw: seen.update(kw) or "engine")
    args = types.SimpleNamespace(eager=False, gpu_memory_utilization=0.2, max_model_len=2048,
                                 async_scheduling="auto", attention_backend=None,
                                 tensor_parallel_size=1, profile_dir=None, suite="fixture")
    suite = types.SimpleNamespace(dtype="bfloat16", batch_sizes=[1, 4], dummy=False)
    llm, _ = bench_run._engine(args, suite, "t", "d", parse_config("no-spec+tritonattn"))
    assert llm == "engine" and seen["attention_config"] == {"backend": "TRITON_ATTN"}
    args.attention_backend = "FLASH_ATTN"
    with pytest.raises(ValueError, match="attention_config"):
        bench_run._engine(args, suite, "t", "d", parse_config("no-spec+tritonattn"))


def test_the_profiler_starts_flagged_configs_like_the_benchmark(monkeypatch):
    """bench/profile_step.py: a flag's environment is set while the engine starts (and
    only then), an engine flag reaches the engine."""
    import os
    import types

    import vllm

    from bench import profile_step

    seen = {}

    def fake_llm(**kw):
        seen.update(kw, ctx_graphs=os.environ.get("VLLM_DDTREE_CONTEXT_GRAPHS"))
        return "engine"

    monkeypatch.setattr(vllm, "LLM", fake_llm)
    monkeypatch.delenv("VLLM_DDTREE_CONTEXT_GRAPHS", raising=False)
    args = types.SimpleNamespace(target="t", drafter="d", eager=False, dtype="bfloat16",
                                 batch_size=4)
    assert profile_step.start_engine(args, "ddtree-b64-t512-d4+eagerctx") == "engine"
    assert seen["ctx_graphs"] == "0" and "VLLM_DDTREE_CONTEXT_GRAPHS" not in os.environ
    assert seen["speculative_config"]["ddtree_disable_by_batch_size"] == 4
    profile_step.start_engine(args, "no-spec+tritonattn")
    assert seen["attention_config"] == {"backend": "TRITON_ATTN"}


def test_defer_flag_buffers_the_drafter_context_while_drafting_is_off():
    assert parse_config("ddtree-b64-t512+flashtree+defer").env == (
        ("VLLM_DDTREE_TREE_ATTENTION", "flash"), ("VLLM_DDTREE_DEFER_CONTEXT", "1"))


def test_flashtree_flag_selects_flashattention_tree_verification():
    assert parse_config("ddtree-b64-t512-d4+flashtree").env == (
        ("VLLM_DDTREE_TREE_ATTENTION", "flash"),)


def test_q1graphs_flag_asks_for_single_token_decode_graphs():
    config = parse_config("ddtree-b64-t512-d2+static+q1graphs")
    assert config.env == (("VLLM_DDTREE_SINGLE_TOKEN_GRAPHS", "1"),)


def test_file_names_of_flagged_configs_avoid_the_plus():
    from bench import profile_step
    from bench.run import file_stem

    assert file_stem("ddtree-b64-t512+flashtree+eagerctx") == "ddtree-b64-t512_flashtree_eagerctx"
    assert profile_step.file_stem is file_stem  # the profiler names its files the same way


class _WordTokenizer:
    """A chat template of one token per word, plus 3 framing tokens."""

    def __init__(self):
        self.calls = 0

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        self.calls += 1
        return [1] + [len(w) for w in messages[0]["content"].split()] + [2, 3]


def _prompt_file(tmp_path, texts):
    import json

    (tmp_path / "sharegpt_bench.jsonl").write_text(
        "".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return str(tmp_path)


def test_prompt_sets_keep_short_prompts_and_stop_at_the_limit(tmp_path):
    from bench.run import load_prompt_sets

    data = _prompt_file(tmp_path, ["a b", "word " * 800, "c d e", "f", "g h"])
    tok = _WordTokenizer()
    sets = load_prompt_sets(["sharegpt"], data, tok, limit=2)
    assert sets["sharegpt"] == [[1, 1, 1, 2, 3], [1, 1, 1, 1, 2, 3]]  # the 803-token one dropped
    assert tok.calls == 3  # stops once it has enough


def test_the_long_prompt_set_joins_requests_into_long_contexts(tmp_path, monkeypatch):
    import bench.run as run

    monkeypatch.setattr(run, "LONG_PROMPT_TOKENS", (40, 60))
    texts = (["w " * 14 + "x" * (i + 1) for i in range(6)] + ["w " * 100]
             + ["w " * 24 + "y" * (i + 1) for i in range(4)])  # 15, 100 and 25 words
    sets = run.load_prompt_sets(["sharegpt-long"], _prompt_file(tmp_path, texts), _WordTokenizer(),
                                limit=5)
    lengths = [len(p) for p in sets["sharegpt-long"]]
    # Header (8 words) + 2 x 15 words + 3 framing = 41 >= 40: the six short prompts make
    # three requests; the 100-word prompt alone overshoots (111 > 60: dropped); two
    # 25-word prompts make 61 > 60 (dropped), twice: nothing else fits.
    assert lengths == [41, 41, 41]
    assert all(40 <= n <= 60 for n in lengths)
    with pytest.raises(SystemExit, match="sharegpt-long"):
        run.load_prompt_sets(["long"], str(tmp_path), _WordTokenizer(), limit=1)


def test_long_prompts_rotate_for_more_groups_without_repeats(monkeypatch):
    import bench.run as run

    monkeypatch.setattr(run, "LONG_PROMPT_TOKENS", (40, 60))
    texts = ["w " * 15 + "x" * (i + 1) for i in range(4)]  # 16 words each, all different
    got = run._long_prompts(_WordTokenizer(), texts, limit=10, rotation=1)
    # Pairs (0,1) (2,3), then from the 2nd prompt on (1,2) (3,0); later passes repeat them.
    assert len(got) == 4 and len({tuple(p) for p in got}) == 4
    assert all(len(p) == 8 + 32 + 3 for p in got)


def test_profile_step_steady_workload_keeps_the_batch_in_flight(monkeypatch):
    """bench/profile_step.py --steady-requests: each timed pass is a steady cell over
    all prompts with --batch-size in flight; steps count per request in flight."""
    import types

    from bench import profile_step, run

    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(run.time, "perf_counter", lambda: clock.now)
    engine = FakeSteadyEngine(clock, [8] * 6)
    warmups = []
    llm = types.SimpleNamespace(llm_engine=engine, get_metrics=lambda: [],
                                generate=lambda prompts, *a, **k: warmups.append(len(prompts)) or [])
    args = types.SimpleNamespace(steady_requests=6, batch_size=2, max_tokens=8,
                                 temperature=0.0)
    prompts = [[i] for i in range(6)]
    plain, steps = profile_step.plain_run(llm, args, prompts)
    # The warm-up: one wave of --batch-size prompts, then an untimed steady cell of two
    # generations of them (this fake gives every request 8 tokens: 4 x 8, 2 at a time).
    assert warmups == [2]
    assert engine.max_live == 2 and engine.steps == 16 + 24  # then 6 requests x 8 tokens
    assert plain["output_tokens"] == 48 and steps == 24
    assert plain["wall_s"] == pytest.approx(0.024)


def test_profile_step_refuses_a_steady_cell_no_larger_than_the_batch(tmp_path):
    from bench.profile_step import main as profile_main

    with pytest.raises(SystemExit, match="--steady-requests must exceed --batch-size"):
        profile_main(["--configs", "no-spec", "--batch-size", "4", "--steady-requests", "4",
                      "--out-dir", str(tmp_path)])


def test_a_second_plain_engine_is_compared_with_the_first(tmp_path, monkeypatch):
    """The first plain (no speculation) engine of a cell is the greedy reference; a
    later plain engine (another backend or graph mode, e.g. ``no-spec+tritonattn``) is
    compared with it like the speculative ones (FULL graphs on FlashAttention gave other
    tokens from the first one on: bench/results/2026-11-30-flash-attn-full-graphs-pristine-check/)."""
    import json
    import types

    import transformers

    import bench.run as run

    target, drafter = tmp_path / "target", tmp_path / "drafter"
    target.mkdir()
    drafter.mkdir()
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path: None)
    monkeypatch.setattr(run, "load_prompt_sets",
                        lambda names, data, tok, limit: {n: [[5, 6]] * limit for n in names})

    def engine(args, suite, target, drafter, cfg):
        return types.SimpleNamespace(name=cfg.name, llm_engine=types.SimpleNamespace(
            vllm_config=types.SimpleNamespace(
                scheduler_config=types.SimpleNamespace(async_scheduling=True)))), None

    monkeypatch.setattr(run, "_engine", engine)
    monkeypatch.setattr(run, "_free", lambda llm: None)
    tokens = {"no-spec": [1, 2, 3], "no-spec+tritonattn": [9, 2, 3], "dflash": [1, 2, 3]}

    def cell(llm, prompts, batch, temperature, max_tokens, dummy, lengths="fixed"):
        outs = [list(tokens[llm.name]) for _ in prompts]
        summary = run.cell_summary(outs, 1.0, [1.0] * len(prompts), [0.002] * len(prompts))
        return outs, summary, run.SpecCounters(2, 30, 1, [1])

    monkeypatch.setattr(run, "run_cell", cell)
    out = tmp_path / "r.json"
    assert run.main(["--suite", "fixture", "--out", str(out), "--target", str(target),
                     "--drafter", str(drafter), "--data", str(tmp_path), "--prompt-sets",
                     "humaneval", "--configs", "no-spec", "no-spec+tritonattn", "dflash",
                     "--batch-sizes", "2", "--temperatures", "0", "--max-tokens", "3",
                     "--min-requests", "2"]) == 0
    rows = {r["config"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["no-spec"].get("greedy_identical") is None
    assert rows["no-spec+tritonattn"]["greedy_identical"] == 0
    assert rows["no-spec+tritonattn"]["greedy_first_difference"] == {"request": 0, "token": 0}
    assert rows["dflash"]["greedy_identical"] == rows["dflash"]["greedy_total"] == 2


@pytest.mark.parametrize("name, backend, refused", [
    ("no-spec+cgfull+cg1024", None, True),
    ("dflash-t512+cgfull+cg1024", None, True),
    ("no-spec+tritonattn+cgfull+cg1024", None, False),
    ("no-spec+cgfull", "TRITON_ATTN", False),
    ("no-spec+cgfull", "FLASH_ATTN", True),
    ("ddtree-b64-t512+cgfull", None, False),
    ("ddtree-b64-t512+flashtree+cgfull", None, True),
    ("no-spec+cg1024", None, False),
    ("no-spec", None, False),
])
def test_full_graphs_on_flash_attention(name, backend, refused):
    from bench.run import full_graphs_on_flash_attention, parse_config

    assert full_graphs_on_flash_attention(parse_config(name), backend) is refused


def test_full_graphs_on_flash_attention_refused_before_any_engine(tmp_path, monkeypatch):
    import bench.run as run

    monkeypatch.setattr(run, "_engine", lambda *a: pytest.fail("an engine was started"))
    with pytest.raises(SystemExit, match="wrong tokens"):
        run.main(["--suite", "cost8b", "--out", str(tmp_path / "r.json"),
                  "--configs", "no-spec", "no-spec+cgfull+cg1024"])


def test_profile_step_refuses_full_graphs_on_flash_attention(tmp_path):
    from bench.profile_step import main

    with pytest.raises(SystemExit, match="wrong tokens"):
        main(["--configs", "dflash-t512+cgfull+cg1024", "--out-dir", str(tmp_path)])


def test_every_timed_run_records_the_host_pace_before_it(tmp_path, monkeypatch):
    """Each timed run of a cell carries the fixed Python loop's time measured just
    before it; a cell with repeats keeps every run's value and their median."""
    import json
    import types

    import bench.run as run

    fake_llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(vllm_config=types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(async_scheduling=True))))
    monkeypatch.setattr(run, "_engine", lambda args, suite, target, drafter, cfg: (fake_llm, None))
    monkeypatch.setattr(run, "_free", lambda llm: None)
    paces = iter([40.0, 30.0, 20.0, 10.0, 50.0, 60.0])
    monkeypatch.setattr(run, "host_loop_ms", lambda: next(paces))

    def cell(llm, prompts, batch, temperature, max_tokens, dummy, lengths="fixed"):
        outs = [[1] * max_tokens for _ in prompts]
        summary = run.cell_summary(outs, 1.0, [1.0] * len(prompts), [0.002] * len(prompts))
        return outs, summary, run.SpecCounters(2, 30, 1, [1])

    monkeypatch.setattr(run, "run_cell", cell)
    out = tmp_path / "r.json"
    assert run.main(["--suite", "cost8b", "--out", str(out), "--configs", "no-spec",
                     "--batch-sizes", "1", "--temperatures", "0", "--max-tokens", "4",
                     "--repeats", "3"]) == 0
    doc = json.loads(out.read_text())
    # In order: the run's header, the engine row (before it starts), the three runs.
    assert doc["host"]["python_loop_ms"] == 40.0
    assert doc["engines"][0]["host_python_loop_ms"] == 30.0
    (cell_row,) = doc["results"]
    assert cell_row["host_python_loop_ms_runs"] == [20.0, 10.0, 50.0]
    assert cell_row["host_python_loop_ms"] == 20.0


def test_a_result_names_the_drafter_weights_it_measured(tmp_path):
    from bench.run import ROOT, weights_digest

    assert weights_digest(str(tmp_path)) is None
    (tmp_path / "model.safetensors").write_bytes(b"one")
    first = weights_digest(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"two")
    assert len(first) == 12 and weights_digest(str(tmp_path)) != first
    committed = os.path.join(ROOT, "bench", "fixture", "smollm2-dflash")
    assert weights_digest(committed) == "4ef2a090510f"


def test_engine_spec_counters_read_each_engines_own_logger_with_several_alive():
    """With two engines in one process, vLLM's second stat logger unregisters the first
    one's metrics, so the process registry (``LLM.get_metrics()``) shows the second
    engine's counters only; each engine's own logger still holds its own."""
    pytest.importorskip("vllm")
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics
    from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats
    from vllm.v1.metrics.reader import get_metrics_snapshot
    from bench.run import engine_spec_counters

    def engine(num_spec: int, drafts: list[tuple[int, int]]):
        unregister_vllm_metrics()  # what every PrometheusStatLogger does first
        prom = SpecDecodingProm(types.SimpleNamespace(num_speculative_tokens=num_spec),
                                ["model_name", "engine"], {0: ["m", "0"]})
        stats = SpecDecodingStats.new(num_spec)
        for draft, accepted in drafts:
            stats.observe_draft(draft, accepted)
        prom.observe(stats.finish(), 0)  # as the scheduler's make_stats hands it out
        manager = types.SimpleNamespace(stat_loggers=[
            types.SimpleNamespace(), types.SimpleNamespace(spec_decoding_prom=prom)])
        return types.SimpleNamespace(llm_engine=types.SimpleNamespace(logger_manager=manager),
                                     get_metrics=get_metrics_snapshot)

    try:
        first = engine(4, [(4, 2), (4, 0)])
        second = engine(3, [(3, 3)])
        assert engine_spec_counters(first) == SpecCounters(2, 8, 2, [1, 1, 0, 0])
        assert engine_spec_counters(second) == SpecCounters(1, 3, 3, [1, 1, 1])
        # The registry path sees the second engine only.
        assert spec_counters(first.get_metrics()) == SpecCounters(1, 3, 3, [1, 1, 1])
        # No spec-decode logger (plain decoding): nothing counted.
        plain = types.SimpleNamespace(llm_engine=types.SimpleNamespace(
            logger_manager=types.SimpleNamespace(stat_loggers=[types.SimpleNamespace(
                spec_decoding_prom=SpecDecodingProm(None, ["model_name", "engine"],
                                                    {0: ["m", "0"]}))])))
        assert engine_spec_counters(plain) == SpecCounters()
    finally:
        unregister_vllm_metrics()


def test_budget_metrics_host_sends_the_summary_as_each_mode_says(tmp_path):
    """``bench/budget_metrics_host.py``: stats without a summary, with it every step,
    and with it only on the steps that rebuilt it (every 64 here), through vLLM's own
    encoding and the DDTree gauges."""
    from bench import budget_metrics_host as M
    from vllm_ddtree.online_budget import METRICS_REFRESH_STEPS

    out = tmp_path / "metrics-host.json"
    assert M.main(["--out", str(out), "--steps", "128", "--rounds", "1"]) == 0
    doc = json.loads(out.read_text())
    share = {r["mode"]: r["sent_share"] for r in doc["rows"]}
    assert share == {"none": 0.0, "every-step": 1.0,
                     "on-change": round(128 // METRICS_REFRESH_STEPS / 128, 4)}
    assert doc["summary_numbers"] > 14 and doc["rebuild_us_median"] > 0
    assert sorted(doc["buckets"]) == ["greedy", "sampled"]


def test_spec_decode_metrics_host_times_vllms_counters_and_names_the_series(tmp_path):
    """``bench/spec_decode_metrics_host.py``: a row per (positions, batch), and the
    series of the vLLM it ran on (the stop at the first zero is a patch of it)."""
    from bench import spec_decode_metrics_host as S

    out = tmp_path / "spec-metrics.json"
    assert S.main(["--out", str(out), "--steps", "50", "--rounds", "1",
                   "--num-spec-tokens", "4", "64", "--batch-sizes", "2"]) == 0
    doc = json.loads(out.read_text())
    assert [(r["num_spec_tokens"], r["batch"]) for r in doc["rows"]] == [(4, 2), (64, 2)]
    assert all(r["us_median"] > 0 for r in doc["rows"])
    import vllm

    series = getattr(vllm, "ddtree_series", None)
    assert doc["series_sha256"] == (series["series_sha256"][:12] if series else None)


def test_online_budget_host_times_a_baseline_controller_in_turns(tmp_path):
    """``bench/online_budget_host.py --baseline REV`` loads REV's controller from git
    and reports paired ratios per cell; the real tree's controller is back afterwards."""
    import subprocess

    from bench import online_budget_host as H
    from vllm_ddtree import budget_controller, online_budget

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    out = tmp_path / "host.json"
    assert H.main(["--out", str(out), "--steps", "40", "--batch-sizes", "1",
                   "--budgets", "0", "8", "--baseline", "HEAD", "--rounds", "2"]) == 0
    doc = json.loads(out.read_text())
    assert "against HEAD" in doc["what"]
    assert [(r["batch"], r["budget"]) for r in doc["rows"]] == [(1, 0), (1, 8)]
    for r in doc["rows"]:
        assert len(r["us_mean_tree"]) == len(r["us_mean_baseline"]) == 2
        assert len(r["tree_over_baseline_paired"]) == 2
        assert r["tree_over_baseline_paired_median"] > 0
    assert online_budget.BudgetController is budget_controller.BudgetController


def test_same_decisions_counts_traces_where_two_controllers_differ(tmp_path):
    """``--same-decisions``: the tree's controller against itself differs nowhere; one
    with another switching margin differs in some trace; the count reaches the file."""
    import subprocess

    from bench import online_budget_host as H
    from vllm_ddtree.budget_controller import BudgetController

    class WiderMargin(BudgetController):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, margin=0.3, **kwargs)

    same = H.same_decisions(BudgetController, BudgetController, traces=3, steps=600)
    assert same == {"traces": 3, "steps_per_trace": 600, "steps_compared": 1800,
                    "traces_that_differed": 0}
    other = H.same_decisions(BudgetController, WiderMargin, traces=3, steps=600)
    assert other["traces_that_differed"] > 0 and other["steps_compared"] < 1800
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    out = tmp_path / "host.json"
    assert H.main(["--out", str(out), "--steps", "40", "--batch-sizes", "1", "--budgets", "0",
                   "--baseline", "HEAD", "--rounds", "1", "--same-decisions", "2"]) == 0
    assert json.loads(out.read_text())["same_decisions"]["traces"] == 2
    with pytest.raises(SystemExit):
        H.main(["--out", str(out), "--same-decisions", "2"])


def test_online_budget_host_can_time_a_controller_with_measured_buckets():
    """``--measured-buckets``: the timed steps run on a controller whose other buckets
    hold measurements (as after other traffic), which the row says."""
    from bench import online_budget_host as H

    row = H.time_observe(1, 0, 50, measured_buckets=True)
    assert row["measured_buckets"] is True and row["us_mean"] > 0
    assert H.time_observe(1, 0, 20)["measured_buckets"] is False


def test_budget0_host_times_this_tree_against_a_baseline_in_turns(tmp_path):
    """``bench/budget0_host.py --baseline REV`` loads REV's deferral buffer and verifier
    from git and times a budget-0 step's host work of both on the runner's kind of
    inputs; every step's context reaches the store (the timing checks it)."""
    import subprocess

    from bench import budget0_host as H

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    out = tmp_path / "budget0.json"
    assert H.main(["--out", str(out), "--steps", "30", "--batch-sizes", "1", "16",
                   "--baseline", "HEAD", "--rounds", "2"]) == 0
    doc = json.loads(out.read_text())
    assert "against HEAD" in doc["what"]
    assert [r["batch"] for r in doc["rows"]] == [1, 16]
    for r in doc["rows"]:
        assert len(r["us_per_step_tree"]) == len(r["us_per_step_baseline"]) == 2
        assert r["tree_over_baseline_paired_median"] > 0
    # A buffer that loses entries is caught.
    from vllm_ddtree.deferred_context import DeferredContext
    from vllm_ddtree.tree_verifier import TreeVerifier

    class Lossy(DeferredContext):
        def flush(self, store):
            self.count = 0
            return 0

    with pytest.raises(AssertionError, match="stored 0 context entries"):
        H.time_budget0_steps(Lossy, TreeVerifier, 2, 10)
    # A device this machine lacks is refused by name before anything runs.
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="--device cuda: no such device here"):
            H.main(["--out", str(out), "--device", "cuda"])


def test_profile_kernel_comparison_names_what_the_other_step_adds():
    """bench/profile_step.py --compare-kernels: kernel by kernel, what one profile's step
    costs beyond another's, largest difference first, kernels of one side marked."""
    from bench.profile_step import compare_kernels

    def prof(config, rows, busy):
        return {"config": config, "torch_profile": {"gpu_busy_ms_per_step": busy,
                                                     "kernels_per_step": rows}}

    base = prof("no-spec", [{"name": "gemm", "us_per_step": 4000.0, "calls_per_step": 36},
                            {"name": "attn_3d", "us_per_step": 300.0, "calls_per_step": 36}], 4.3)
    other = prof("ddtree", [{"name": "gemm", "us_per_step": 4010.0, "calls_per_step": 36},
                            {"name": "attn_2d", "us_per_step": 520.0, "calls_per_step": 36},
                            {"name": "copy", "us_per_step": 6.5, "calls_per_step": 2}], 4.55)
    d = compare_kernels(base, other)
    assert [r["name"] for r in d["kernels"]] == ["attn_2d", "attn_3d", "gemm", "copy"]
    assert d["kernels"][0]["diff_us"] == 520.0 and d["kernels"][0]["only_in"] == "other"
    assert d["kernels"][1]["diff_us"] == -300.0 and d["kernels"][1]["only_in"] == "base"
    assert "only_in" not in d["kernels"][2] and d["kernels"][2]["diff_us"] == 10.0
    assert d["kernel_us_per_step"] == {"base": 4300.0, "other": 4536.5}
    assert d["gpu_busy_ms_per_step"] == {"base": 4.3, "other": 4.55}
    with pytest.raises(ValueError, match="no kernels_per_step"):
        compare_kernels({"config": "old", "torch_profile": {}}, other)


def test_profile_kernel_comparison_from_the_command_line(tmp_path, capsys):
    import json

    from bench.profile_step import main as profile_main

    for name, us in (("no-spec", 10.0), ("ddtree-b64-t512", 12.5)):
        (tmp_path / f"profile-{name}.json").write_text(json.dumps(
            {"config": name, "torch_profile": {"gpu_busy_ms_per_step": us / 1000,
                                               "kernels_per_step": [
                                                   {"name": "k", "us_per_step": us,
                                                    "calls_per_step": 1.0}]}}))
    assert profile_main(["--compare-kernels", str(tmp_path / "profile-no-spec.json"),
                         str(tmp_path / "profile-ddtree-b64-t512.json"),
                         "--out-dir", str(tmp_path / "out")]) == 0
    diff = json.loads((tmp_path / "out" / "kernel-diff-no-spec-vs-ddtree-b64-t512.json").read_text())
    assert diff["kernels"] == [{"name": "k", "base_us": 10.0, "other_us": 12.5, "diff_us": 2.5,
                                "base_calls": 1.0, "other_calls": 1.0}]
    assert "+2.50 us  k" in capsys.readouterr().out


def test_kernels_per_step_keeps_every_kernel_whole():
    from bench.profile_step import kernels_per_step

    long_name = "kernel_unified_attention_" + "x" * 200
    rows = kernels_per_step({long_name: [300.0, 6], "small": [1.0, 2]}, steps=2)
    assert rows == [{"name": long_name, "us_per_step": 150.0, "calls_per_step": 3.0},
                    {"name": "small", "us_per_step": 0.5, "calls_per_step": 1.0}]


def test_the_profiler_starts_the_cost8b_shape_as_the_benchmark(monkeypatch, tmp_path):
    """bench/profile_step.py --suite cost8b: Qwen3-8B's shape and DFlash-8B's drafter
    shape with dummy weights, no tokenizer, random prompts, and requests that are not
    detokenized, as bench/run.py --suite cost8b runs them."""
    import json
    import types

    import vllm

    from bench import profile_step

    seen = {}

    class FakeLLM:
        def __init__(self, **kw):
            seen["engine"] = kw

    monkeypatch.setattr(vllm, "LLM", FakeLLM)

    def fake_profile(args, name, prompts):
        seen["engine_llm"] = profile_step.start_engine(args, name)
        seen["prompts"] = prompts
        seen["dummy"] = args.dummy
        return {"config": name, "plain": {}}

    monkeypatch.setattr(profile_step, "profile_config", fake_profile)
    assert profile_step.main(["--suite", "cost8b", "--configs", "no-spec", "--batch-size", "4",
                              "--out-dir", str(tmp_path)]) == 0
    kw = seen["engine"]
    assert kw["load_format"] == "dummy" and kw["skip_tokenizer_init"] is True
    assert kw["gpu_memory_utilization"] == 0.4
    with open(f"{kw['model']}/config.json") as f:
        assert json.load(f)["hidden_size"] == 4096
    assert seen["dummy"] is True and len(seen["prompts"]) == 4
    assert all(isinstance(t, int) for p in seen["prompts"] for t in p)
    # Requests of the dummy suite are not detokenized.
    got = []
    llm = types.SimpleNamespace(generate=lambda prompts, sps, use_tqdm: got.extend(sps) or [])
    profile_step.generate(llm, [[1, 2]], 4, 0.0, dummy=True)
    assert got[0].detokenize is False


def test_online_budget_host_times_the_report_against_a_baseline(tmp_path, monkeypatch):
    """``--report``: both revisions' ``write_report`` rewrite one controller's report,
    a whole JSON file holding the step trace; the environment is as it was; without
    ``--baseline`` it is refused."""
    import subprocess

    from bench import online_budget_host as H
    from vllm_ddtree import env

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    monkeypatch.delenv(env.BUDGET_REPORT.name, raising=False)
    out = tmp_path / "report.json"
    assert H.main(["--out", str(out), "--batch-sizes", "1", "4", "--baseline", "HEAD",
                   "--rounds", "2", "--report", "3"]) == 0
    doc = json.loads(out.read_text())
    assert "write_report" in doc["what"] and [r["batch"] for r in doc["rows"]] == [1, 4]
    for r in doc["rows"]:
        assert r["writes"] == 3 and r["report_bytes"] > 1000
        assert len(r["us_mean_tree"]) == len(r["us_mean_baseline"]) == 2
        assert r["tree_over_baseline_paired_median"] > 0
    assert env.BUDGET_REPORT.name not in os.environ
    with pytest.raises(SystemExit):
        H.main(["--out", str(out), "--report", "3"])


def test_profile_step_allocator_delta_counts_driver_calls_per_step():
    """bench/profile_step.py: the allocator's counters over a timed pass, as changes and
    per step; counters the running torch does not keep are left out."""
    from bench.profile_step import allocator_delta

    before = {"num_device_alloc": 10, "num_device_free": 4, "segment.all.allocated": 10,
              "allocation.all.allocated": 1000}
    after = {"num_device_alloc": 26, "num_device_free": 4, "segment.all.allocated": 18,
             "allocation.all.allocated": 1800}
    got = allocator_delta(before, after, steps=8)
    assert got["num_device_alloc"] == 16 and got["num_device_alloc_per_step"] == 2.0
    assert got["num_device_free"] == 0 and got["segment.all.allocated_per_step"] == 1.0
    assert got["allocation.all.allocated_per_step"] == 100.0
    assert "num_alloc_retries" not in got and "num_sync_all_streams" not in got
    assert allocator_delta(before, after, steps=0)["num_device_alloc_per_step"] == 16.0
