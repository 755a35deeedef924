"""The Dockerfile: pins from UPSTREAM, the apply step, build context, user, health, linters."""

from __future__ import annotations

import json
import os
import posixpath
import re
import subprocess
import sys

import pytest

import dockerfile_parse as df
from lint_tools import ROOT, run, tool, upstream

DOCKERFILE = ROOT / "Dockerfile"
INSTRUCTIONS = df.parse(DOCKERFILE)


def instructions(keyword: str) -> list[df.Instruction]:
    return [ins for ins in INSTRUCTIONS if ins.keyword == keyword]


def index_of(predicate) -> int:
    matches = [i for i, ins in enumerate(INSTRUCTIONS) if predicate(ins)]
    assert len(matches) == 1, f"expected one matching instruction, found {len(matches)}"
    return matches[0]


def apply_step() -> df.Instruction:
    runs = [ins for ins in instructions("RUN") if "apply.sh" in ins.args]
    assert len(runs) == 1, [r.args for r in runs]
    return runs[0]


def test_base_image_and_vllm_version_are_the_upstream_pins():
    pins = upstream()
    defaults = df.arg_defaults(INSTRUCTIONS)
    assert defaults["BASE_IMAGE"] == pins["BASE_IMAGE"]
    assert defaults["VLLM_VERSION"] == pins["VLLM_VERSION"]
    (base,) = instructions("FROM")
    assert base.args == "${BASE_IMAGE}"
    # The ARG before FROM sets the default; the pinned tag is a release, never latest.
    assert INSTRUCTIONS[0].keyword == "ARG" and INSTRUCTIONS[0].args.startswith("BASE_IMAGE=")
    assert re.search(r":v\d+\.\d+\.\d+$", defaults["BASE_IMAGE"])


def test_apply_step_is_the_site_invocation_on_the_images_vllm(tmp_path):
    match = df.SITE_INVOCATION.match(apply_step().args)
    assert match, f"apply step is not `./apply.sh --site \"$(python3 -c '...')\"`: {apply_step().args}"
    # The inline Python names the directory that holds the `vllm` package (dist-packages).
    site = tmp_path / "dist-packages"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    out = subprocess.run(
        [sys.executable, "-c", match.group("code")], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(site)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(site)


def test_gpu_workflow_applies_with_the_same_invocation():
    code = df.SITE_INVOCATION.match(apply_step().args).group("code")
    workflow = (ROOT / ".github" / "workflows" / "gpu.yml").read_text()
    assert f"\"$VLLM_PYTHON\" -c '{code}'" in workflow
    assert './apply.sh --site "$site"' in workflow


def test_install_check_runs_after_apply_and_before_dropping_root():
    apply_at = index_of(lambda ins: ins.keyword == "RUN" and "apply.sh" in ins.args)
    check_at = index_of(lambda ins: ins.keyword == "RUN" and "deploy/check_install.py" in ins.args)
    assert apply_at < check_at
    check = INSTRUCTIONS[check_at].args
    assert '--vllm-version "${VLLM_VERSION}"' in check
    assert "--import vllm.entrypoints.openai.api_server" in check
    (user,) = instructions("USER")
    assert INSTRUCTIONS.index(user) > check_at
    assert not [ins for ins in INSTRUCTIONS[INSTRUCTIONS.index(user):] if ins.keyword == "RUN"]


def test_runs_as_the_non_root_user_it_creates():
    (user,) = instructions("USER")
    uid, _, gid = user.args.partition(":")
    assert uid.isdigit() and int(uid) >= 10000, "numeric UID so that runAsNonRoot can verify it"
    assert gid == "0"
    useradd = [ins.args for ins in instructions("RUN") if "useradd" in ins.args]
    assert len(useradd) == 1 and f"--uid {uid}" in useradd[0] and "--gid 0" in useradd[0]
    env = " ".join(ins.args for ins in instructions("ENV"))
    for variable in ("HOME=/home/vllm", "XDG_CACHE_HOME=/home/vllm/.cache", "HF_HOME=/home/vllm/.cache/"):
        assert variable in env


def test_copy_sources_are_in_the_build_context():
    allowed = set()
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        if line.startswith("!"):
            allowed.add(line[1:].rstrip("/"))
    assert "*" in (ROOT / ".dockerignore").read_text().splitlines(), ".dockerignore must be an allow-list"
    absent = []
    for ins in instructions("COPY"):
        sources, _ = df.copy_sources(ins)
        for source in sources:
            assert source.rstrip("/") in allowed, f"COPY {source} is excluded by .dockerignore"
            if not (ROOT / source).exists():
                absent.append(source)
    if absent:
        message = f"COPY sources not in this checkout yet: {absent}"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


def test_entrypoint_is_the_copied_script():
    (entrypoint,) = instructions("ENTRYPOINT")
    (path,) = entrypoint.exec_form()
    workdir = "/"
    copied = set()
    for ins in INSTRUCTIONS:
        if ins.keyword == "WORKDIR":
            workdir = posixpath.join(workdir, ins.args)
        elif ins.keyword == "COPY":
            sources, dest = df.copy_sources(ins)
            dest = posixpath.join(workdir, dest)
            copied.update(posixpath.join(dest, posixpath.basename(s)) for s in sources)
    assert path in copied
    assert os.access(ROOT / "deploy" / "entrypoint.sh", os.X_OK)


def test_healthcheck_probes_health_after_a_long_start_period():
    (health,) = instructions("HEALTHCHECK")
    start = re.search(r"--start-period=(\d+)s", health.args)
    assert start and int(start.group(1)) >= 600
    command = json.loads(health.args[health.args.index("["):])
    assert command[:2] == ["python3", "-c"] and "/health" in command[2]
    (expose,) = instructions("EXPOSE")
    assert expose.args == "8000"


def test_labels_name_the_vllm_version():
    labels = " ".join(ins.args for ins in instructions("LABEL"))
    assert 'io.github.vllm-ddtree.vllm-version="${VLLM_VERSION}"' in labels
    assert 'org.opencontainers.image.base.name="${BASE_IMAGE}"' in labels


def test_hadolint():
    result = run([tool("hadolint"), "--no-color", str(DOCKERFILE)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_checkov_dockerfile():
    result = run([tool("checkov"), "--quiet", "--compact", "--skip-download", "--framework", "dockerfile",
                  "-o", "json", "-f", str(DOCKERFILE)], timeout=300)
    report = json.loads(result.stdout)
    summary = report["summary"]
    assert summary["failed"] == 0 and result.returncode == 0, result.stdout
    assert summary["passed"] > 0


def test_shellcheck_scripts():
    scripts = [ROOT / "deploy" / "entrypoint.sh", ROOT / "tools" / "build-image.sh",
               ROOT / "tools" / "setup-lint-venv.sh", ROOT / "bench" / "gpu_session.sh",
               ROOT / "bench" / "compile_cache.sh",
               *sorted((ROOT / "bench" / "fixture").glob("*.sh"))]
    result = run([tool("shellcheck"), *map(str, scripts)])
    assert result.returncode == 0, result.stdout + result.stderr
