"""deploy/check_install.py against fake installs, and tools/build-image.sh with a stand-in docker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lint_tools import ROOT, upstream

CHECK = ROOT / "deploy" / "check_install.py"
BUILD = ROOT / "tools" / "build-image.sh"
SHA = "ab" * 32

FAKE_MANIFEST_MODULE = '''
import json, os, vllm
def load_manifest():
    path = os.path.join(os.path.dirname(vllm.__file__), "ddtree_series.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)
'''


def fake_site(root: Path, *, vllm_version="0.26.0", ddtree_version="0.1.0", manifest=None) -> Path:
    """A site directory shaped like an installed, patched vLLM (stand-in modules)."""
    site = root / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(f"__version__ = {vllm_version!r}\n")
    (site / "vllm" / "server.py").write_text("")
    (site / "vllm" / "broken.py").write_text("raise ImportError('patched file is broken')\n")
    (site / "vllm_ddtree").mkdir()
    (site / "vllm_ddtree" / "__init__.py").write_text(f"__version__ = {ddtree_version!r}\n")
    (site / "vllm_ddtree" / "manifest.py").write_text(FAKE_MANIFEST_MODULE)
    if manifest is None:
        manifest = {"series_sha256": SHA, "patches": ["a.patch", "b.patch"], "vllm_version": "0.26.0",
                    "vllm_ddtree_version": "0.1.0"}
    if manifest is not False:
        (site / "vllm" / "ddtree_series.json").write_text(json.dumps(manifest))
    return site


def check(site: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), "--vllm-version", "0.26.0", *args],
                          env={**os.environ, "PYTHONPATH": str(site)}, cwd=cwd or site.parent,
                          capture_output=True, text=True, timeout=60)


def test_check_install_accepts_a_consistent_install(tmp_path):
    result = check(fake_site(tmp_path), "--import", "vllm.server")
    assert result.returncode == 0, result.stderr
    assert f"series {SHA[:12]} (2 patches)" in result.stdout


def test_check_install_prints_labels(tmp_path):
    site = fake_site(tmp_path)
    result = check(site, "--print-labels")
    assert result.returncode == 0, result.stderr
    labels = dict(line.split("=", 1) for line in result.stdout.splitlines())
    assert labels == {"series_sha256": SHA, "patch_count": "2", "vllm_version": "0.26.0",
                      "vllm_ddtree_version": "0.1.0", "site": str(site.resolve())}


@pytest.mark.parametrize(
    "kwargs, extra, message",
    [
        ({"vllm_version": "0.25.1"}, [], "vLLM is 0.25.1, expected the pinned 0.26.0"),
        ({"manifest": False}, [], "no series manifest: the patch series is not applied"),
        ({"manifest": {"series_sha256": SHA, "patches": ["a"], "vllm_version": "0.26.0"}}, [],
         "manifest has no 'vllm_ddtree_version'"),
        ({"manifest": {"series_sha256": "xyz", "patches": ["a"], "vllm_version": "0.26.0",
                       "vllm_ddtree_version": "0.1.0"}}, [], "series_sha256 is not a sha256 hex digest"),
        ({"manifest": {"series_sha256": SHA, "patches": [], "vllm_version": "0.26.0",
                       "vllm_ddtree_version": "0.1.0"}}, [], "patches must be a non-empty list"),
        ({"manifest": {"series_sha256": SHA, "patches": ["a"], "vllm_version": "0.25.0",
                       "vllm_ddtree_version": "0.1.0"}}, [], "manifest says vLLM 0.25.0, but 0.26.0 is installed"),
        ({"ddtree_version": "0.2.0"}, [], "manifest says vllm_ddtree 0.1.0, but 0.2.0 is installed"),
        ({}, ["--import", "vllm.broken"], "import vllm.broken failed"),
    ],
)
def test_check_install_names_the_problem(tmp_path, kwargs, extra, message):
    result = check(fake_site(tmp_path, **kwargs), *extra)
    assert result.returncode == 1
    assert message in result.stderr


def test_check_install_refuses_vllm_ddtree_from_another_directory(tmp_path):
    site = fake_site(tmp_path)
    shadow = tmp_path / "source-tree"
    shadow.mkdir()
    (site / "vllm_ddtree").rename(shadow / "vllm_ddtree")
    result = subprocess.run([sys.executable, str(CHECK), "--vllm-version", "0.26.0"],
                            env={**os.environ, "PYTHONPATH": f"{shadow}{os.pathsep}{site}"},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "is imported from" in result.stderr and "not from vLLM's site" in result.stderr


FAKE_DOCKER = r'''#!/usr/bin/env bash
# Stand-in docker: logs each call (argv, one per line, then stdin for `build -`).
{ echo "CALL $1"; printf 'ARG %s\n' "$@"; } >> "$DOCKER_LOG"
if [[ $1 == build && ${@: -1} == - ]]; then sed 's/^/STDIN /' >> "$DOCKER_LOG"; fi
if [[ $1 == run ]]; then
    [[ -n ${FAKE_RUN_FAIL:-} ]] && { echo "check_install: error: boom" >&2; exit 1; }
    printf 'series_sha256=%s\npatch_count=3\nvllm_version=0.26.0\nvllm_ddtree_version=0.1.0\nsite=/x\n' "$FAKE_SHA"
fi
exit 0
'''


def build_image(tmp_path: Path, *args: str, fail_run: bool = False,
                extra_env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, list]:
    docker = tmp_path / "docker"
    docker.write_text(FAKE_DOCKER)
    docker.chmod(0o755)
    log = tmp_path / "docker.log"
    env = {**os.environ, "DOCKER": str(docker), "DOCKER_LOG": str(log), "FAKE_SHA": SHA}
    if fail_run:
        env["FAKE_RUN_FAIL"] = "1"
    env.update(extra_env or {})
    result = subprocess.run(["bash", str(BUILD), *args], env=env, capture_output=True, text=True, timeout=60)
    calls: list[dict] = []
    for line in log.read_text().splitlines() if log.exists() else []:
        kind, _, value = line.partition(" ")
        if kind == "CALL":
            calls.append({"args": [], "stdin": []})
        else:
            calls[-1]["args" if kind == "ARG" else "stdin"].append(value)
    return result, calls


def labels_of(call: dict) -> dict[str, str]:
    args = call["args"]
    return dict(args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "--label")


_HEAD = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
needs_git = pytest.mark.skipif(_HEAD.returncode != 0, reason="not a git checkout: build-image.sh labels the revision")


@needs_git
def test_build_image_passes_pins_and_labels_from_the_built_image(tmp_path):
    result, calls = build_image(tmp_path, "-t", "reg/vllm-ddtree:test", "--build-arg", "RAY_PACKAGE=ray==2.0.0")
    assert result.returncode == 0, result.stderr
    build, run_check, relabel = calls
    pins = upstream()
    args = build["args"]
    assert args[0] == "build" and args[-1] == "."
    assert f"BASE_IMAGE={pins['BASE_IMAGE']}" in args and f"VLLM_VERSION={pins['VLLM_VERSION']}" in args
    assert "RAY_PACKAGE=ray==2.0.0" in args
    assert labels_of(build)["org.opencontainers.image.revision"] == _HEAD.stdout.strip()
    assert run_check["args"][:6] == ["run", "--rm", "--network", "none", "--entrypoint", "python3"]
    assert "reg/vllm-ddtree:test" in run_check["args"] and "--print-labels" in run_check["args"]
    assert relabel["stdin"] == ["FROM reg/vllm-ddtree:test"]
    assert labels_of(relabel) == {"io.github.vllm-ddtree.series-sha256": SHA,
                                  "io.github.vllm-ddtree.patch-count": "3",
                                  "org.opencontainers.image.version": "0.1.0"}
    assert f"series {SHA}" in result.stdout


@needs_git
def test_build_image_fails_when_the_install_check_fails(tmp_path):
    result, calls = build_image(tmp_path, fail_run=True)
    assert result.returncode == 1
    assert "failed its install check" in result.stderr
    assert len(calls) == 2, "no relabelling after a failed check"


@needs_git
def test_build_image_of_the_second_pin_takes_its_pin_file(tmp_path):
    # DDTREE_VLLM picks a pin of UPSTREAM's PINS=: FROM its base image, its vLLM version
    # in the build arguments and the default tag.
    default = upstream()
    second = [v for v in default["PINS"].split() if v != default["VLLM_VERSION"]]
    assert second, "UPSTREAM's PINS= lists a second pin"
    pins = upstream(ROOT / "patches" / f"vllm-{second[0]}" / "UPSTREAM")
    assert pins["BASE_IMAGE"] == f"vllm/vllm-openai:v{second[0]}"
    result, calls = build_image(tmp_path, extra_env={"DDTREE_VLLM": second[0]})
    assert result.returncode == 0, result.stderr
    args = calls[0]["args"]
    assert f"BASE_IMAGE={pins['BASE_IMAGE']}" in args
    assert f"VLLM_VERSION={second[0]}" in args
    assert any(a.startswith(f"vllm-ddtree:{second[0]}-") for a in calls[1]["args"])


@needs_git
def test_build_image_refuses_a_pin_it_does_not_have(tmp_path):
    result, calls = build_image(tmp_path, extra_env={"DDTREE_VLLM": "0.99.0"})
    assert result.returncode == 1 and not calls
    assert "no pin file patches/vllm-0.99.0/UPSTREAM" in result.stderr
    assert "one of UPSTREAM's PINS=" in result.stderr
