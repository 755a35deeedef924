"""CPU tests of bench/serve_e2e.py, the one-shot end-to-end server check for GPU hosts.

* Pure parts: SSE parsing, percentiles, Prometheus parsing, error messages, greedy
  comparison, prompt selection, argument handling, the serve command line.
* The whole flow against tests/bench/fake_openai_server.py (a stand-in for `vllm
  serve`, no model): a passing run, and runs with injected faults that must fail (or
  trip the watchdog) without hanging.
* The real patched vLLM CLI refusing the two bad DDTree configs at startup, on CPU
  (config validation happens before any device work; tests/bench/cpu_vllm_cli.py
  gives vLLM a CPU platform so that its argument parser can be built).
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import types

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from bench import serve_e2e as E  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(REPO, "bench", "serve_e2e.py")
FAKE = os.path.join(HERE, "fake_openai_server.py")
FAKE_OFFLINE = os.path.join(HERE, "fake_offline_worker.py")
DRAFTER = os.path.join(REPO, "bench", "fixture", "smollm2-dflash")

LLAMA_135M = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152,
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
    rope_theta=100000.0, tie_word_embeddings=True, torch_dtype="bfloat16", hidden_act="silu",
)


# ----------------------------------------------------------------------------- SSE
def test_sse_parser_reassembles_events_split_anywhere():
    stream = (b'data: {"choices": [{"text": "Hel"}]}\n\n'
              b': keep-alive comment\n\n'
              b'event: message\r\ndata: {"choices": [{"text": "lo"}]}\r\n\r\n'
              b"data: [DONE]\n\n")
    for size in (1, 3, 7, len(stream)):
        parser, events = E.SSEParser(), []
        for i in range(0, len(stream), size):
            events += parser.feed(stream[i:i + size])
        events += parser.close()
        assert events == [{"choices": [{"text": "Hel"}]}, {"choices": [{"text": "lo"}]}, "[DONE]"]
        assert parser.done


def test_sse_parser_reports_bad_json_and_a_last_line_without_newline():
    parser = E.SSEParser()
    assert parser.feed(b"data: {not json}\n") == [{"_unparsed": "{not json}"}]
    assert parser.feed(b'data: {"a": 1}') == []
    assert parser.close() == [{"a": 1}]
    assert not parser.done


def test_stream_text_helpers():
    events = [{"choices": [{"text": "a", "token_ids": [1], "prompt_token_ids": [9, 8]}]},
              {"choices": [{"text": "b", "token_ids": [2]}]},
              {"choices": [], "usage": {"completion_tokens": 2}}, "[DONE]"]
    assert E.stream_completion_text(events) == ("ab", [1, 2], [9, 8], {"completion_tokens": 2})
    chat = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"delta": {"content": "Hi"}}]}, {"choices": [{"delta": {}}]}, "[DONE]"]
    assert E.stream_chat_text(chat) == "Hi"


# ----------------------------------------------------------------------------- numbers
def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    xs = [0.3, 0.1, 0.9, 0.5, 0.7, 0.2, 1.5]
    for q in (0, 1, 25, 50, 90, 99, 100):
        assert E.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert E.percentile([], 50) is None
    assert E.percentile([2.0], 99) == 2.0


def test_latency_summary():
    s = E.latency_summary([1.0, 2.0, 3.0, 4.0])
    assert s["count"] == 4 and s["p50_s"] == 2.5 and s["max_s"] == 4.0
    assert E.latency_summary([]) == {"count": 0}


def test_spec_decode_summary_sums_labels_and_skips_created():
    text = "\n".join([
        "# HELP vllm:spec_decode_num_drafts_total Number of drafts.",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0',
        'vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 10.0',
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9',
        'vllm:spec_decode_num_draft_tokens_total{engine="0"} 640.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 70.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 20.0',
        "vllm:num_requests_running 3.0",
    ])
    s = E.spec_decode_summary(text)
    assert s["num_drafts"] == 20.0 and s["num_accepted_tokens"] == 70.0
    assert s["num_draft_tokens"] == 640.0
    assert s["mean_acceptance_length"] == 4.5 and s["counters_positive"]
    assert len(s["lines"]) == 6 and all(ln.startswith("vllm:spec_decode") for ln in s["lines"])


def test_spec_decode_summary_without_counters():
    s = E.spec_decode_summary("vllm:num_requests_running 0.0\n")
    assert s["num_drafts"] is None and not s["counters_positive"]
    assert s["mean_acceptance_length"] is None


def test_error_message_shapes():
    assert E.error_message('{"error": {"message": "bad logprobs", "code": 400}}') == "bad logprobs"
    assert E.error_message('{"object": "error", "message": "nope"}') == "nope"
    assert "loc" in E.error_message('{"detail": [{"loc": ["body"], "msg": "x"}]}')
    assert E.error_message("Internal Server Error") == "Internal Server Error"
    assert E.error_message("") == ""


def test_compare_greedy_reports_the_first_difference():
    same = E.compare_greedy([[1, 2], [3]], [[1, 2], [3]])
    assert same["all_identical"] and same["first_difference"] is None
    diff = E.compare_greedy([[1, 2], [3, 4, 5], [6]], [[1, 2], [3, 9, 5], [7]])
    assert (diff["identical"], diff["total"]) == (1, 3)
    assert diff["first_difference"]["request"] == 1 and diff["first_difference"]["position"] == 1
    prefix = E.compare_greedy([[1, 2]], [[1, 2, 3]])
    assert prefix["first_difference"]["position"] == 2


# ----------------------------------------------------------------------------- inputs
def test_json_answer_ok_accepts_whole_objects_and_cut_off_prefixes_only():
    assert E.json_answer_ok('{"name": "Ada"}', "name", "stop")
    assert not E.json_answer_ok('{"other": 1}', "name", "stop")
    assert not E.json_answer_ok('{"name": "Ada', "name", "stop")  # stopped, yet cut off
    # Cut off by max_tokens: anywhere inside the object.
    for text in ('{"name": "The Roman Em', '{"name" \n: \n', '{"na', '{'):
        assert E.json_answer_ok(text, "name", "length"), text
    assert not E.json_answer_ok("not json", "name", "length")
    assert not E.json_answer_ok('["name"', "name", "length")


def test_feature_requests_follow_vllms_request_rules():
    reqs = E.feature_requests("m")
    # vLLM refuses prompt_logprobs on a streamed request, with or without speculation.
    assert not any(r["stream"] and r["body"].get("prompt_logprobs") for r in reqs)
    assert any(r["body"].get("prompt_logprobs") for r in reqs)
    grammar = [r for r in reqs if r["json_field"]]
    assert grammar and all("ignore_eos" not in r["body"] for r in grammar)
    assert all(r["body"]["max_tokens"] > E.FEATURE_MAX_TOKENS for r in grammar)


def test_builtin_prompts_are_distinct_and_enough():
    prompts, source = E.select_prompts(128)
    assert source == "builtin" and len(prompts) == 128 == len(set(prompts))
    assert any(p.startswith("def ") for p in prompts)


def test_prompts_from_jsonl(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"id": 1, "prompt": "chat turn"}, {"id": 2, "completion_prompt": "def f():", "prompt": "x"},
            {"id": 3, "prompt": "chat turn"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    prompts, source = E.select_prompts(5, str(path))
    assert source.startswith("file:")
    assert prompts[:2] == ["chat turn", "def f():"] and len(set(prompts)) == 5


def test_parse_args_defaults_and_errors(tmp_path):
    out = str(tmp_path / "r" / "e2e.json")
    a = E.parse_args(["--target", "T", "--drafter", "D", "--out", out])
    assert (a.time_budget, a.budget, a.concurrency, a.num_requests, a.max_tokens) == (420.0, 32, 64, 128, 64)
    assert a.log_dir == os.path.dirname(out) and not a.strict_greedy
    with pytest.raises(SystemExit):
        E.parse_args(["--target", "T", "--out", out])
    with pytest.raises(SystemExit):
        E.parse_args(["--target", "T", "--drafter", "D", "--out", out, "--concurrency", "0"])
    w = E.parse_args(["--offline-worker", "spec.json", "out.json"])
    assert w.offline_worker == ["spec.json", "out.json"]


def test_serve_command_line():
    cmd = E.serve_command(E.server_prefix(None), "/m", E.speculative_config("/d", 32), 8123)
    assert cmd[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "/m"]
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec == {"method": "ddtree", "model": "/d", "num_speculative_tokens": 32}
    for flag in ("--enforce-eager", "--seed", "--served-model-name", "--gpu-memory-utilization"):
        assert flag in cmd
    assert E.server_prefix("python fake.py") == ["python", "fake.py"]


def test_cli_module_exists_in_installed_vllm():
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    assert importlib.util.find_spec("vllm.entrypoints.cli.main") is not None


def test_bad_config_needles_match_vllm_ddtree_messages():
    """The needles serve_e2e looks for are what vllm_ddtree.config says (no vLLM needed)."""
    from vllm_ddtree.config import DDTreeConfigError, resolve_ddtree_options

    with open(os.path.join(DRAFTER, "config.json")) as f:
        hf = types.SimpleNamespace(**json.load(f))
    for bad in E.bad_speculative_configs(DRAFTER):
        spec = types.SimpleNamespace(**bad["config"], draft_model_config=types.SimpleNamespace(hf_config=hf))
        spec.__dict__.setdefault("ddtree_max_depth", None)
        spec.__dict__.setdefault("ddtree_top_k", None)
        with pytest.raises(DDTreeConfigError) as info:
            resolve_ddtree_options(spec)
        assert bad["needle"] in str(info.value), (bad["name"], str(info.value))


# ----------------------------------------------------------------------------- whole flow
def _run_script(tmp_path, *extra, mode="", timeout=90, env_extra=None, offline=False):
    out = tmp_path / "e2e.json"
    env = dict(os.environ, FAKE_MODE=mode, **(env_extra or {}))
    offline_args = (["--offline-cmd", f"{sys.executable} {FAKE_OFFLINE}"] if offline
                    else ["--skip-offline"])
    argv = [sys.executable, SCRIPT, "--target", str(tmp_path), "--drafter", DRAFTER,
            "--out", str(out), "--log-dir", str(tmp_path / "logs"),
            "--server-cmd", f"{sys.executable} {FAKE}", *offline_args,
            "--concurrency", "8", "--num-requests", "24", "--max-tokens", "16",
            "--feature-load", "30", *extra]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    result = json.loads(out.read_text()) if out.exists() else None
    return proc, result


def test_flow_against_fake_server_passes(tmp_path):
    proc, r = _run_script(tmp_path, "--time-budget", "60")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert r["passed"] and r["failures"] == []
    assert [b["returncode"] for b in r["bad_configs"]] == [1, 1]
    assert all(b["message"] for b in r["bad_configs"])
    assert {b["name"]: b["status"] for b in r["bad_requests"]}["unknown_model"] == 404
    assert all(400 <= b["status"] < 500 for b in r["bad_requests"])
    # Logprobs on trees; penalties, bad words, a JSON schema without drafts: each at
    # T=0 and T=1, streamed and not (prompt logprobs not streamed: 26 requests sent at
    # once), and the chat route.
    features = r["features"]
    assert len(features) == 26 and all(f["status"] == 200 for f in features)
    assert {f["name"] for f in features} == {
        "ordinary", "logprobs", "presence_penalty", "repetition_frequency_penalties",
        "bad_words", "structured_output_json", "prompt_logprobs"}
    for f in features:
        if f["name"] == "logprobs":  # streamed answers reassembled from their chunks
            assert len(f["token_logprobs"]) == len(f["token_ids"]) == E.FEATURE_MAX_TOKENS
        if f["name"] == "structured_output_json":
            assert "name" in json.loads(f["text"])
        if f["name"] == "prompt_logprobs" and not f["stream"]:
            assert f["prompt_token_logprobs"][0] is None
            assert len(f["prompt_token_logprobs"]) == len(f["prompt_token_ids"])
    names = {c["name"] for c in r["checks"]["features"]}
    assert "chat_response_format_json_schema" in names and "logprobs_T1_stream" in names
    assert r["load"]["errors"] == 0 and r["load"]["num_requests"] == 24
    fl = r["feature_load"]
    assert (fl["num_requests"], fl["errors"], fl["concurrency"]) == (30, 0, 8)
    assert set(fl["settings"]) == {f["name"] for f in features}
    assert "zero_errors" in {c["name"] for c in r["checks"]["feature_load"]}
    assert r["load"]["latency"]["p99_s"] is not None
    m = r["spec_decode_metrics"]["after_load"]
    assert m["counters_positive"] and m["mean_acceptance_length"] > 1
    assert os.path.exists(r["server"]["logs"]["stderr"])
    assert r["server"]["stop"]["returncode"] is not None and not r["server"]["stop"]["sigkill"]
    assert "serve_e2e.py" in r["command"]


def test_offline_references_both_compared_token_for_token(tmp_path):
    proc, r = _run_script(tmp_path, "--skip-bad-configs", "--strict-greedy", "--time-budget", "60",
                          offline=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for key, reference in (("greedy", "no-spec"), ("greedy_same_config", "same-config")):
        g = r[key]
        assert g["reference"] == reference and g["returncode"] == 0
        assert (g["identical"], g["total"], g["all_identical"]) == (24, 24, True)
        assert g["identical_texts"] == 24 and g["prompts_as_token_ids"]
    spec = json.loads((tmp_path / "logs" / "offline-same-config-spec.json").read_text())
    assert spec["speculative_config"] == r["server"]["speculative_config"]
    assert spec["attention_backend"] is None and spec["max_num_seqs"] == 64
    assert "greedy vs offline same-config: 24/24 identical" in proc.stdout
    # The feature requests replayed without speculation, with their sampling fields.
    f = r["features_vs_no_spec"]
    assert (f["identical"], f["total"]) == (26, 26) and f["max_logprob_abs_diff"] == 0.0
    assert f["max_prompt_logprob_abs_diff"] == 0.0
    assert sum("max_prompt_logprob_abs_diff" in q for q in f["requests"]) == 2
    assert "features/identical_to_no_spec" not in r["failures"]
    spec = json.loads((tmp_path / "logs" / "offline-spec.json").read_text())
    seeded = [q for q in spec["requests"] if q["params"]["temperature"]
              and not q["check"].startswith("load")]
    assert len(seeded) == 13 and all(q["params"]["seed"] >= 1000 for q in seeded)
    # The mixed feature load replayed beside them, each request with its own seed.
    loaded = [q for q in spec["requests"] if q["check"].startswith("load")]
    assert len(loaded) == 30 and len({q["check"] for q in loaded}) == 30
    assert len({q["params"].get("seed") for q in loaded if q["params"]["temperature"]}) == 15
    m = r["feature_load_vs_no_spec"]
    assert (m["identical"], m["total"]) == (30, 30)
    assert any("structured_outputs" in q["params"] and "ignore_eos" not in q["params"]
               for q in spec["requests"])


needs_port_8000 = pytest.mark.skipif(not E.port_free(E.VLLM_DEFAULT_PORT),
                                     reason="port 8000 (vLLM's default) is in use here")


@needs_port_8000
def test_server_defaults_start_with_only_the_speculative_config(tmp_path):
    proc, r = _run_script(tmp_path, "--skip-bad-configs", "--server-defaults",
                          "--time-budget", "60")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    d = r["server_defaults"]
    argv = shlex.split(d["command"])
    # Nothing but the target and the speculative config after `serve`.
    assert argv[argv.index("serve") + 1:] == [
        str(tmp_path), "--speculative-config",
        json.dumps(E.speculative_config(DRAFTER, 64, ddtree_tokens_per_step=512))]
    assert d["startup"]["ok"] and d["model"] == str(tmp_path)
    assert d["load"] == dict(d["load"], num_requests=8, errors=0)
    assert [c["name"] for c in r["checks"]["server_defaults"]] == [
        "server_healthy", "completion", "chat", "load_zero_errors"]
    assert any("fake server on port 8000" in line for line in d["ddtree_log_lines"])
    assert d["stop"]["returncode"] is not None


@needs_port_8000
def test_a_server_that_fails_on_vllms_defaults_fails_the_run(tmp_path):
    proc, r = _run_script(tmp_path, "--skip-bad-configs", "--server-defaults",
                          "--time-budget", "60", mode="defaults_die")
    assert proc.returncode == 1
    assert r["failures"] == ["server_defaults/server_healthy"]
    # The configured server still ran its phases.
    assert r["startup"]["ok"] and r["load"]["errors"] == 0


SHIPPED_ENV = os.path.join(REPO, "deploy", "k8s", "base", "ddtree.env")


@needs_port_8000
def test_server_entrypoint_starts_the_kubernetes_bases_configuration(tmp_path):
    """--server-entrypoint: the image's entrypoint with the shipped env file builds the
    `vllm serve` line and execs it through the `vllm` on its PATH; the run checks that
    server as a user would."""
    proc, r = _run_script(tmp_path, "--skip-bad-configs", "--server-entrypoint", SHIPPED_ENV,
                          "--time-budget", "60")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    d = r["server_entrypoint"]
    shipped = E.read_env_file(SHIPPED_ENV)
    assert d["variables"] == dict(shipped, MODEL=str(tmp_path), DDTREE_DRAFTER=DRAFTER)
    argv = shlex.split(d["vllm_command"])
    assert argv[:3] == ["vllm", "serve", str(tmp_path)]
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "ddtree", "model": DRAFTER,
                    "num_speculative_tokens": int(shipped["DDTREE_BUDGET"]),
                    "ddtree_tokens_per_step": int(shipped["DDTREE_TOKENS_PER_STEP"])}
    assert argv[argv.index("--max-model-len") + 1] == shipped["MAX_MODEL_LEN"]
    assert argv[argv.index("--port") + 1] == shipped["PORT"]
    assert d["startup"]["ok"] and d["model"] == str(tmp_path)
    assert d["load"] == dict(d["load"], num_requests=8, errors=0)
    assert [c["name"] for c in r["checks"]["server_entrypoint"]] == [
        "entrypoint_accepts_the_variables", "server_healthy", "completion", "chat",
        "load_zero_errors"]
    assert any("fake server on port 8000" in line for line in d["ddtree_log_lines"])


def test_an_env_file_the_entrypoint_refuses_fails_the_run(tmp_path):
    env_file = tmp_path / "bad.env"
    env_file.write_text(open(SHIPPED_ENV).read().replace("DDTREE_BUDGET=64", "DDTREE_BUDGET=many"))
    proc, r = _run_script(tmp_path, "--skip-bad-configs", "--server-entrypoint", str(env_file),
                          "--time-budget", "60")
    assert proc.returncode == 1
    assert r["failures"] == ["server_entrypoint/entrypoint_accepts_the_variables"]
    (check,) = r["checks"]["server_entrypoint"]
    assert "DDTREE_BUDGET must be a positive integer" in check["message"]


def test_read_env_file_takes_key_value_lines_and_names_a_bad_one(tmp_path):
    f = tmp_path / "x.env"
    f.write_text("# comment\n\nA=1\nB=x=y\nC=\n")
    assert E.read_env_file(str(f)) == {"A": "1", "B": "x=y", "C": ""}
    f.write_text("A=1\njust words\n")
    with pytest.raises(ValueError, match=r"x.env:2: not KEY=VALUE"):
        E.read_env_file(str(f))


def test_plain_server_control_is_compared_with_the_ddtree_server_and_offline(tmp_path):
    proc, r = _run_script(tmp_path, "--skip-bad-configs", "--strict-greedy", "--plain-server",
                          "--time-budget", "80", "--offline-references", "no-spec", offline=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    p = r["plain_server"]
    assert "--speculative-config" not in p["command"] and p["startup"]["ok"]
    assert "--speculative-config" in r["server"]["command"]
    assert p["load"]["errors"] == 0 and p["load"]["num_requests"] == 24
    assert (p["greedy_vs_ddtree"]["identical"], p["greedy_vs_ddtree"]["total"]) == (24, 24)
    f = p["features_vs_ddtree"]
    assert (f["identical"], f["total"]) == (26, 26) and f["max_logprob_abs_diff"] == 0.0
    assert p["greedy_vs_offline_no_spec"]["all_identical"]
    assert p["features_vs_offline_no_spec"]["identical"] == 26
    assert "DDTree server vs plain server: features 26/26 identical" in proc.stdout


def test_a_plain_server_that_differs_is_reported_and_fails_only_when_strict(tmp_path):
    args = ("--skip-bad-configs", "--plain-server", "--time-budget", "80",
            "--offline-references", "no-spec")
    proc, r = _run_script(tmp_path, *args, mode="plain_differs", offline=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    p = r["plain_server"]
    assert p["greedy_vs_ddtree"]["identical"] == 0
    assert p["greedy_vs_ddtree"]["first_difference"]["position"] == 15  # the last of 16
    # The control: the plain server against plain decoding offline differs the same way.
    assert p["greedy_vs_offline_no_spec"]["identical"] == 0
    # The mixed feature load went to the plain server too.
    assert p["feature_load_vs_ddtree"]["total"] == 30
    proc, r = _run_script(tmp_path, *args, "--strict-greedy", mode="plain_differs", offline=True)
    assert proc.returncode == 1
    assert "plain_server/greedy_matches" in r["failures"]
    assert "plain_server/features_identical" in r["failures"]
    assert "plain_server/feature_load_identical" in r["failures"]
    # Plain decoding offline explained every difference: the plain server's last token.
    margins = r["greedy"]["margins"]
    assert {m["position"] for m in margins["ddtree_server_vs_plain_server"]} == {15}
    assert len(margins["plain_server"]) == 24 and not margins["ddtree_server"]
    # The same differences at near ties of plain decoding pass the strict greedy check.
    proc, r = _run_script(tmp_path, *args, "--strict-greedy", mode="plain_differs", offline=True,
                          env_extra={"FAKE_OFFLINE_GAP": "0.001"})
    assert "plain_server/greedy_matches" not in r["failures"]
    [check] = [c for c in r["checks"]["plain_server"] if c["name"] == "greedy_matches"]
    assert check["ok"] and "0/24 identical; the 24 others first differ at near ties" in check["message"]
    assert r["failures"] == ["plain_server/features_identical",
                             "plain_server/feature_load_identical"]


def test_a_feature_request_that_differs_from_the_reference_fails_when_strict(tmp_path):
    proc, r = _run_script(tmp_path, "--skip-bad-configs", "--strict-greedy", "--time-budget",
                          "60", "--offline-references", "no-spec", offline=True,
                          env_extra={"FAKE_OFFLINE_DIFFER": "features"})
    assert proc.returncode == 1
    assert r["failures"] == ["features/identical_to_no_spec"]
    f = r["features_vs_no_spec"]
    assert f["identical"] == 25
    assert [q["first_difference"] for q in f["requests"] if not q["identical"]] == [3]


@pytest.mark.parametrize("strict, gap", [(True, "0.5"), (False, "0.5"), (True, "0.004")])
def test_a_differing_offline_reference_fails_when_strict_unless_a_near_tie(tmp_path, strict, gap):
    extra = ["--strict-greedy"] if strict else []
    proc, r = _run_script(tmp_path, "--skip-bad-configs", "--time-budget", "60", *extra,
                          offline=True, env_extra={"FAKE_OFFLINE_DIFFER": "same-config",
                                                   "FAKE_OFFLINE_GAP": gap})
    assert r["greedy"]["all_identical"]
    g = r["greedy_same_config"]
    assert (g["identical"], g["all_identical"]) == (23, False)
    assert g["first_difference"]["request"] == 1 and g["first_difference"]["position"] == 3
    [m] = r["greedy"]["margins"]["ddtree_server_vs_same_config"]
    assert (m["request"], m["position"], m["logprob_gap"]) == (1, 3, float(gap))
    assert m["near_tie"] == (float(gap) <= E.NEAR_TIE_LOGPROB_GAP)
    if strict and not m["near_tie"]:
        assert proc.returncode == 1
        assert r["failures"] == ["greedy/matches_offline_same_config"]
    else:
        assert proc.returncode == 0 and r["passed"]


def test_first_divergences_and_margins():
    own = [[1, 2, 3], [1, 2, 3], [4, 5], None]
    divs = E.first_divergences({"x": [[[1, 2, 3], [1, 9, 3], [4, 5, 6], [7]], None]}, own)
    assert [(d["request"], d["position"], d["a_token"], d["b_token"], d["prefix"])
            for d in divs] == [(1, 1, 9, 2, [1]), (2, 2, 6, None, [4, 5])]
    tie = E.margin_entry(divs[0], {9: -0.7, 2: -0.695}, 2)
    assert tie["near_tie"] and tie["logprob_gap"] == -0.005 and "prefix" not in tie
    assert not E.margin_entry(divs[0], {9: -0.7, 2: -0.1}, 2)["near_tie"]
    length = E.margin_entry(divs[1], None, None)
    assert length["logprob_gap"] is None and not length["near_tie"]


def test_an_offline_reference_that_fails_is_a_failure(tmp_path):
    proc, r = _run_script(tmp_path, "--skip-bad-configs", "--time-budget", "60",
                          "--offline-references", "no-spec", offline=True,
                          env_extra={"FAKE_OFFLINE_FAIL": "no-spec"})
    assert proc.returncode == 1
    assert r["failures"] == ["greedy/offline_no-spec_ran"]
    assert "fails" in r["greedy"]["log_tail"] and "greedy_same_config" not in r


@pytest.mark.parametrize("mode, failed", [
    ("logprobs_500", "features/logprobs_T0_nonstream"),
    ("bad_json", "features/structured_output_json_T1_stream"),
    ("short", "load/zero_errors"),
])
def test_flow_fails_on_server_faults(tmp_path, mode, failed):
    proc, r = _run_script(tmp_path, "--skip-bad-configs", "--time-budget", "60", mode=mode)
    assert proc.returncode == 1
    assert failed in r["failures"] and not r["passed"]


def test_a_feature_request_failing_under_load_fails_the_feature_load(tmp_path):
    proc, r = _run_script(tmp_path, "--skip-bad-configs", "--time-budget", "60",
                          mode="logprobs_500")
    assert proc.returncode == 1 and "feature_load/zero_errors" in r["failures"]
    fl = r["feature_load"]
    assert fl["errors"] == sum(1 for i in range(30) if E.feature_requests("m")[i % 26]["logprobs"])
    assert all(e["status"] == 500 and "logprobs" in e["check"] for e in fl["error_samples"])


def test_flow_reports_a_server_that_dies_at_startup(tmp_path):
    proc, r = _run_script(tmp_path, "--skip-bad-configs", mode="die")
    assert proc.returncode == 1
    assert r["failures"] == ["startup/server_healthy"]
    assert r["startup"]["returncode"] == 3 and "fake startup failure" in r["startup"]["log_tail"]


def test_flow_bounds_startup_wait(tmp_path):
    proc, r = _run_script(tmp_path, "--skip-bad-configs", "--startup-timeout", "3", mode="no_health")
    assert proc.returncode == 1
    assert r["startup"]["timed_out"] and r["startup"]["seconds"] < 10


def test_watchdog_kills_a_server_that_ignores_sigterm(tmp_path):
    proc, r = _run_script(tmp_path, "--skip-bad-configs", "--time-budget", "4",
                          "--startup-timeout", "2", mode="ignore_term",
                          env_extra={"SERVE_E2E_WATCHDOG_GRACE_S": "1"})
    # The startup wait passes (health is fine), the checks run, and stopping the server
    # waits out SIGTERM's 30 s: the watchdog must fire first and kill the group.
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert any(f.startswith("watchdog") for f in r["failures"])


# ----------------------------------------------------------------------------- real vLLM, CPU
def _patched_vllm() -> bool:
    try:
        import vllm
    except Exception:  # noqa: BLE001 - any import failure means: skip
        return False
    return bool(getattr(vllm, "ddtree_series", None))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not _patched_vllm(), reason="needs the patched vLLM (./apply.sh)")
def test_real_vllm_refuses_bad_ddtree_configs_at_startup(tmp_path):
    """`vllm serve` with each bad config exits non-zero naming the setting, before any
    device work (both run in parallel; about 10-20 s on 2 cores)."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(LLAMA_135M))
    args = E.parse_args(["--target", str(target), "--drafter", DRAFTER,
                         "--out", str(tmp_path / "r.json"), "--bad-config-timeout", "240"])
    run = E.Run(args=args, deadline=E.Deadline(280))
    try:
        E.run_bad_configs(run, [sys.executable, os.path.join(HERE, "cpu_vllm_cli.py")])
    finally:
        run.procs.kill_all()
    records = {b["name"]: b for b in run.result["bad_configs"]}
    assert run.failures == [], json.dumps(run.result["bad_configs"], indent=1)[-4000:]
    assert "ddtree_max_depth=16 is out of range" in records["max_depth_beyond_block"]["message"]
    assert "tree budget)=513" in records["budget_above_512"]["message"]
