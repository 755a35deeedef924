"""The GitHub workflows: lint, one copy of each, and the steps the CI design relies on."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import yaml

from lint_tools import ROOT, run, tool

WORKFLOWS = ROOT / ".github" / "workflows"


def workflow(name: str) -> dict:
    return yaml.safe_load((WORKFLOWS / name).read_text())


def steps(name: str) -> list[dict]:
    (job,) = workflow(name)["jobs"].values()
    return job["steps"]


def step(name: str, title: str) -> dict:
    (found,) = [s for s in steps(name) if s.get("name") == title]
    return found


def test_actionlint():
    # actionlint also runs shellcheck on every `run:` script when shellcheck is on PATH.
    tool("shellcheck")
    result = run([tool("actionlint"), "-config-file", str(ROOT / ".github" / "actionlint.yaml"),
                  *map(str, sorted(WORKFLOWS.glob("*.yml")))])
    assert result.returncode == 0, result.stdout + result.stderr


def test_one_copy_of_each_workflow():
    assert sorted(p.name for p in WORKFLOWS.iterdir()) == ["cpu.yml", "gpu.yml"]
    assert not list((ROOT / "ci").rglob("*.yml")) and not list((ROOT / "ci").rglob("*.yaml"))


def test_cpu_workflow_runs_the_layered_checks_in_order():
    commands = [s["run"] for s in steps("cpu.yml") if "run" in s]
    other_pins = step("cpu.yml", "Series lint and apply check of the other pins")["run"]
    other_tests = step("cpu.yml", "Unit tests of the other pins")["run"]
    assert commands == ["tools/series lint", "./apply.sh --check", other_pins, "./apply.sh",
                        "tools/setup-lint-venv.sh", ".venv/bin/python -m pytest -q",
                        other_tests]
    assert 'tools/series --pin "$pin" lint' in other_pins
    assert 'tools/series --pin "$pin" check' in other_pins
    assert 'DDTREE_VENV=".venv-$pin" DDTREE_VLLM="$pin" ./apply.sh' in other_tests
    assert 'DDTREE_VENV=".venv-$pin" tools/test tests/unit' in other_tests
    assert workflow("cpu.yml")["env"]["CI"] == "true"


def test_gpu_workflow_runs_on_the_h200_runner():
    (job,) = workflow("gpu.yml")["jobs"].values()
    assert job["runs-on"] == ["self-hosted", "linux", "x64", "gpu", "h200"]
    config = yaml.safe_load((ROOT / ".github" / "actionlint.yaml").read_text())
    assert {"gpu", "h200"} <= set(config["self-hosted-runner"]["labels"])
    assert step("gpu.yml", "GPU tests")["run"] == '"$VLLM_PYTHON" -m pytest -q -m gpu'
    bench = shlex.split(step("gpu.yml", "Benchmark")["run"])
    assert bench[:6] == ["$VLLM_PYTHON", "bench/run.py", "--suite", "ci", "--out",
                         "bench/results/ci-latest.json"]
    # The benchmark pair comes from the preparation step (bench/fixture/prepare.sh).
    prepare = step("gpu.yml", "Prepare the benchmark pair (SmolLM2 target, prompts; drafter is committed)")
    assert "bench/fixture/prepare.sh" in prepare["run"]
    assert bench[bench.index("--target") + 1] == "$RUNNER_TEMP/fixture/smollm2-hf"
    assert bench[bench.index("--data") + 1] == "$RUNNER_TEMP/fixture/smollm2-fixture/data"
    revert = step("gpu.yml", "Revert the series")
    assert revert["if"].startswith("always()")


def test_gpu_regression_step_runs_check_regression(tmp_path):
    argv = shlex.split(step("gpu.yml", "Regression check against the committed baseline")["run"])
    assert argv[:2] == ["python3", "ci/check_regression.py"]
    # A baseline is committed, so a missing one must fail the job.
    assert "--allow-missing-baseline" not in argv
    assert (ROOT / "bench" / "results" / "baseline.json").is_file()
    valued = argv[2:]
    options = dict(zip(valued[0::2], valued[1::2]))
    assert options == {"--baseline": "bench/results/baseline.json", "--current": "bench/results/ci-latest.json",
                       "--tau-tolerance": "0.05", "--tps-tolerance": "0.20"}
    # The same command line works on files of the documented format.
    result_file = {"git_rev": "x", "command": "bench/run.py --suite ci", "results": [
        {"config": "ddtree-b32", "prompt_set": "p", "batch_size": 1, "temperature": 0.0, "tau": 3.0,
         "output_tokens_per_s": 100.0, "greedy_match": True}]}
    for key in ("--baseline", "--current"):
        path = tmp_path / key.strip("-")
        path.write_text(json.dumps(result_file))
        options[key] = str(path)
    args = [word for pair in options.items() for word in pair]
    proc = subprocess.run([sys.executable, str(ROOT / argv[1]), *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_checkov_github_actions():
    result = run([tool("checkov"), "--quiet", "--compact", "--skip-download", "--framework", "github_actions",
                  "-o", "json", "-d", str(ROOT / ".github")], timeout=300)
    report = json.loads(result.stdout)
    assert result.returncode == 0 and report["summary"]["failed"] == 0, result.stdout
    assert report["summary"]["passed"] > 0
