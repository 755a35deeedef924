"""deploy/entrypoint.sh: the `vllm serve` command it builds (DRY_RUN) and what it refuses."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from lint_tools import ROOT

ENTRYPOINT = ROOT / "deploy" / "entrypoint.sh"
VARIABLES = ("MODEL", "DDTREE_DRAFTER", "DDTREE_BUDGET", "DDTREE_MAX_DEPTH", "DDTREE_TOKENS_PER_STEP",
             "DDTREE_DISABLE_BY_BATCH_SIZE", "SPECULATIVE_CONFIG",
             "TENSOR_PARALLEL_SIZE", "PIPELINE_PARALLEL_SIZE", "DISTRIBUTED_EXECUTOR_BACKEND", "MAX_MODEL_LEN",
             "GPU_MEMORY_UTILIZATION", "SERVED_MODEL_NAME", "HOST", "PORT", "EXTRA_ARGS", "DRY_RUN")


def entrypoint(env: dict[str, str], *args: str, dry_run: bool = True) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    clean.update(env)
    if dry_run:
        clean["DRY_RUN"] = "1"
    return subprocess.run(["bash", str(ENTRYPOINT), *args], env=clean, capture_output=True, text=True,
                          timeout=60)


def command(env: dict[str, str], *args: str) -> list[str]:
    result = entrypoint(env, *args)
    assert result.returncode == 0, result.stderr
    return shlex.split(result.stdout)


def option(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, argv
    return argv[argv.index(name) + 1]


@pytest.fixture
def models(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "target").mkdir()
    (tmp_path / "drafter dir").mkdir()  # a space, to check quoting end to end
    return {"MODEL": str(tmp_path / "target"), "DDTREE_DRAFTER": str(tmp_path / "drafter dir")}


def test_ddtree_command(models):
    argv = command({**models, "DDTREE_BUDGET": "32", "TENSOR_PARALLEL_SIZE": "2", "MAX_MODEL_LEN": "8192",
                    "GPU_MEMORY_UTILIZATION": "0.9", "PORT": "9000"})
    assert argv[:3] == ["vllm", "serve", models["MODEL"]]
    assert option(argv, "--port") == "9000"
    assert option(argv, "--host") == "0.0.0.0"
    assert option(argv, "--tensor-parallel-size") == "2"
    assert option(argv, "--max-model-len") == "8192"
    assert option(argv, "--gpu-memory-utilization") == "0.9"
    assert json.loads(option(argv, "--speculative-config")) == {
        "method": "ddtree", "model": models["DDTREE_DRAFTER"], "num_speculative_tokens": 32}


def test_max_depth_is_added_when_set(models):
    argv = command({**models, "DDTREE_BUDGET": "64", "DDTREE_MAX_DEPTH": "8"})
    config = json.loads(option(argv, "--speculative-config"))
    assert config["num_speculative_tokens"] == 64 and config["ddtree_max_depth"] == 8


def test_tokens_per_step_makes_the_budget_batch_aware(models):
    argv = command({**models, "DDTREE_BUDGET": "64", "DDTREE_TOKENS_PER_STEP": "128"})
    config = json.loads(option(argv, "--speculative-config"))
    assert config["num_speculative_tokens"] == 64 and config["ddtree_tokens_per_step"] == 128
    assert "ddtree_tokens_per_step" not in json.loads(
        option(command({**models, "DDTREE_BUDGET": "64"}), "--speculative-config"))


def test_auto_tokens_per_step_is_passed_as_the_word(models):
    argv = command({**models, "DDTREE_BUDGET": "64", "DDTREE_TOKENS_PER_STEP": "auto"})
    config = json.loads(option(argv, "--speculative-config"))
    assert config["ddtree_tokens_per_step"] == "auto"


def test_disable_by_batch_size_is_added_when_set(models):
    argv = command({**models, "DDTREE_BUDGET": "64", "DDTREE_TOKENS_PER_STEP": "512",
                    "DDTREE_DISABLE_BY_BATCH_SIZE": "16"})
    config = json.loads(option(argv, "--speculative-config"))
    assert config["ddtree_disable_by_batch_size"] == 16 and config["ddtree_tokens_per_step"] == 512


def test_print_flag_equals_dry_run_and_args_are_appended(models):
    env = {**models, "DDTREE_BUDGET": "16"}
    printed = entrypoint(env, "--print", "--seed", "7", dry_run=False)
    assert printed.returncode == 0, printed.stderr
    assert shlex.split(printed.stdout) == command(env, "--seed", "7")
    assert shlex.split(printed.stdout)[-2:] == ["--seed", "7"]


def test_extra_args_are_split_like_a_shell(models):
    argv = command({"MODEL": models["MODEL"],
                    "EXTRA_ARGS": "--enforce-eager --chat-template '/tpl dir/chat.jinja' --x \"$HOME;rm\""})
    assert argv[-5:] == ["--enforce-eager", "--chat-template", "/tpl dir/chat.jinja", "--x", "$HOME;rm"]


def test_raw_speculative_config_is_passed_through(models):
    raw = {"method": "ddtree", "model": "/m/d", "num_speculative_tokens": 48, "ddtree_top_k": 4}
    argv = command({"MODEL": models["MODEL"], "SPECULATIVE_CONFIG": json.dumps(raw)})
    assert json.loads(option(argv, "--speculative-config")) == raw


def test_without_drafter_serves_without_speculation(models):
    result = entrypoint({"MODEL": models["MODEL"]})
    assert result.returncode == 0
    assert "--speculative-config" not in shlex.split(result.stdout)
    assert "without speculative decoding" in result.stderr


def test_hub_ids_are_not_checked_as_paths():
    argv = command({"MODEL": "Qwen/Qwen3-8B", "DDTREE_DRAFTER": "z-lab/Qwen3-8B-DFlash-b16",
                    "DDTREE_BUDGET": "32"})
    assert argv[2] == "Qwen/Qwen3-8B"


def test_ray_executor_with_tensor_parallel(models):
    argv = command({**models, "DDTREE_BUDGET": "32", "TENSOR_PARALLEL_SIZE": "16", "PIPELINE_PARALLEL_SIZE": "1",
                    "DISTRIBUTED_EXECUTOR_BACKEND": "ray"})
    assert option(argv, "--distributed-executor-backend") == "ray"
    assert option(argv, "--tensor-parallel-size") == "16"
    assert option(argv, "--pipeline-parallel-size") == "1"


def test_execs_the_command(tmp_path, models):
    # Without DRY_RUN the script execs `vllm`: a stand-in records its arguments.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "vllm").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$ARGS_OUT"\n')
    (fake / "vllm").chmod(0o755)
    out = tmp_path / "args"
    result = entrypoint({**models, "DDTREE_BUDGET": "8", "PATH": f"{fake}:{os.environ['PATH']}",
                         "ARGS_OUT": str(out)}, dry_run=False)
    assert result.returncode == 0, result.stderr
    assert out.read_text().splitlines()[:2] == ["serve", models["MODEL"]]


@pytest.mark.parametrize(
    "env, message",
    [
        ({}, "MODEL is not set"),
        ({"MODEL": "/nonexistent/model"}, "MODEL=/nonexistent/model does not exist"),
        ({"DDTREE_DRAFTER": "/nonexistent/drafter", "DDTREE_BUDGET": "8"},
         "DDTREE_DRAFTER=/nonexistent/drafter does not exist"),
        ({"DDTREE_DRAFTER": "@drafter"}, "DDTREE_BUDGET is not set"),
        ({"DDTREE_DRAFTER": "@drafter", "DDTREE_BUDGET": "0"}, "DDTREE_BUDGET must be a positive integer, got '0'"),
        ({"DDTREE_DRAFTER": "@drafter", "DDTREE_BUDGET": "-3"}, "DDTREE_BUDGET must be a positive integer"),
        ({"DDTREE_DRAFTER": "@drafter", "DDTREE_BUDGET": "abc"}, "DDTREE_BUDGET must be a positive integer"),
        ({"DDTREE_DRAFTER": "@drafter", "DDTREE_BUDGET": "8", "DDTREE_MAX_DEPTH": "1.5"},
         "DDTREE_MAX_DEPTH must be a positive integer"),
        ({"DDTREE_BUDGET": "8"}, "DDTREE_BUDGET is set but DDTREE_DRAFTER is not"),
        ({"DDTREE_DRAFTER": "@drafter", "DDTREE_BUDGET": "8", "DDTREE_TOKENS_PER_STEP": "1"},
         "DDTREE_TOKENS_PER_STEP must be at least 2"),
        ({"DDTREE_DRAFTER": "@drafter", "DDTREE_BUDGET": "8", "DDTREE_TOKENS_PER_STEP": "many"},
         "DDTREE_TOKENS_PER_STEP must be a positive integer or auto, got 'many'"),
        ({"DDTREE_TOKENS_PER_STEP": "128"}, "DDTREE_TOKENS_PER_STEP is set but DDTREE_DRAFTER is not"),
        ({"DDTREE_DRAFTER": "@drafter", "DDTREE_BUDGET": "8", "DDTREE_DISABLE_BY_BATCH_SIZE": "1"},
         "DDTREE_DISABLE_BY_BATCH_SIZE must be at least 2"),
        ({"DDTREE_DISABLE_BY_BATCH_SIZE": "4"},
         "DDTREE_DISABLE_BY_BATCH_SIZE is set but DDTREE_DRAFTER is not"),
        ({"SPECULATIVE_CONFIG": "{}", "DDTREE_TOKENS_PER_STEP": "128"},
         "set either SPECULATIVE_CONFIG or DDTREE_TOKENS_PER_STEP, not both"),
        ({"SPECULATIVE_CONFIG": "{bad"}, "SPECULATIVE_CONFIG is not valid JSON"),
        ({"SPECULATIVE_CONFIG": "[1]"}, "SPECULATIVE_CONFIG must be a JSON object"),
        ({"SPECULATIVE_CONFIG": "{}", "DDTREE_DRAFTER": "@drafter"},
         "set either SPECULATIVE_CONFIG or DDTREE_DRAFTER, not both"),
        ({"TENSOR_PARALLEL_SIZE": "two"}, "TENSOR_PARALLEL_SIZE must be a positive integer"),
        ({"MAX_MODEL_LEN": "0"}, "MAX_MODEL_LEN must be a positive integer"),
        ({"PORT": "70000"}, "PORT must be an integer in 1..65535"),
        ({"GPU_MEMORY_UTILIZATION": "1.2"}, "GPU_MEMORY_UTILIZATION must be a number in (0, 1]"),
        ({"GPU_MEMORY_UTILIZATION": "0"}, "GPU_MEMORY_UTILIZATION must be a number in (0, 1]"),
        ({"DISTRIBUTED_EXECUTOR_BACKEND": "mpi"}, "DISTRIBUTED_EXECUTOR_BACKEND must be one of"),
        ({"DDTREE_DRAFTER": "@drafter", "DDTREE_BUDGET": "8", "PIPELINE_PARALLEL_SIZE": "2"},
         "DDTree does not support pipeline parallelism yet"),
        ({"EXTRA_ARGS": "--chat-template 'unclosed"}, "EXTRA_ARGS cannot be split"),
        ({"DRY_RUN": "yes"}, "DRY_RUN must be 0 or 1"),
    ],
)
def test_invalid_settings_fail_with_a_clear_message(models, env, message):
    full = {"MODEL": models["MODEL"], **env}
    if "@drafter" in full.values():
        full["DDTREE_DRAFTER"] = models["DDTREE_DRAFTER"]
    if env == {}:
        full = {}
    result = entrypoint(full, dry_run="DRY_RUN" not in env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr
    assert result.stdout == ""
