"""Fixtures for the patch-series tooling tests: a tiny fake vLLM site and fake series
built with git, so every apply.sh failure mode runs in well under a second."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parents[2]
APPLY = REPO / "apply.sh"
SERIES_TOOL = REPO / "tools" / "series"

GIT_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_AUTHOR_NAME": "Test Author", "GIT_AUTHOR_EMAIL": "author@example.com",
    "GIT_COMMITTER_NAME": "Test Author", "GIT_COMMITTER_EMAIL": "author@example.com",
    "GIT_AUTHOR_DATE": "2026-01-02T03:04:05Z", "GIT_COMMITTER_DATE": "2026-01-02T03:04:05Z",
}

GOOD_TRAILERS = ("Upstream-Status: Inappropriate [DDTree is not upstream]\n"
                 "Drop-When: vLLM ships tree speculation natively\n")


def git(cwd: Path, *args: str) -> str:
    env = {**os.environ, **GIT_ENV}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, text=True,
                          capture_output=True).stdout


def write_fake_vllm(root: Path, version: str = "0.26.0") -> None:
    pkg = root / "vllm"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .version import __version__\n")
    (pkg / "_version.py").write_text(
        f"__version__ = version = '{version}'\n__commit_id__ = commit_id = 'gffd46bfab'\n")
    (pkg / "version.py").write_text("from ._version import __version__\n")
    (pkg / "alpha.py").write_text("".join(f"line {i}\n" for i in range(1, 41)))
    (pkg / "sub" / "beta.py").write_text("".join(f"beta {i}\n" for i in range(1, 21)))
    (pkg / "gone.py").write_text("to be deleted\n")
    os.chmod(pkg / "sub" / "beta.py", 0o640)


def snapshot(root: Path) -> dict[str, tuple]:
    """Every file and directory under root: content hash, mode and mtime."""
    out: dict[str, tuple] = {}
    for dirpath, dirs, files in os.walk(root):
        for d in dirs:
            p = Path(dirpath) / d
            out[str(p.relative_to(root)) + "/"] = ("dir",)
        for f in files:
            p = Path(dirpath) / f
            st = p.stat()
            out[str(p.relative_to(root))] = (
                hashlib.sha256(p.read_bytes()).hexdigest(), st.st_mode, st.st_mtime_ns)
    return out


def content(root: Path) -> dict[str, tuple]:
    """Like snapshot() without mtimes (restored files keep their mtime, new copies not)."""
    return {k: v[:2] for k, v in snapshot(root).items()}


@pytest.fixture
def fake_site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    write_fake_vllm(site)
    return site


Edit = Callable[[Path], None]


@pytest.fixture
def make_series(tmp_path: Path):
    """make_series(site, [(name, message, edit), ...], out=None) -> patch dir.

    Builds a git repo from site/vllm, makes one commit per entry (edit(worktree) then
    commit with message), exports with `git format-patch --zero-commit` and names the
    files `name`; writes the series file.
    """
    counter = [0]

    def make(site: Path, entries: list[tuple[str, str, Edit]], out: Path | None = None) -> Path:
        counter[0] += 1
        work = tmp_path / f"series-work-{counter[0]}"
        shutil.copytree(site / "vllm", work / "vllm")
        git(work, "init", "-q")
        git(work, "add", "-A")
        git(work, "commit", "-q", "-m", "base")
        git(work, "tag", "base")
        for _, message, edit in entries:
            edit(work)
            git(work, "add", "-A")
            git(work, "commit", "-q", "-m", message)
        out = out or tmp_path / f"patches-{counter[0]}"
        out.mkdir(parents=True, exist_ok=True)
        raw = tmp_path / f"raw-{counter[0]}"
        git(work, "format-patch", "-q", "--zero-commit", "--no-signature", "--full-index",
            "-o", str(raw), "base..HEAD")
        produced = sorted(raw.glob("*.patch"))
        assert len(produced) == len(entries)
        for src, (name, _, _) in zip(produced, entries):
            shutil.copy(src, out / name)
        (out / "series").write_text("# test series\n" + "".join(n + "\n" for n, _, _ in entries))
        return out

    return make


def replace_line(path: str, old: str, new: str) -> Edit:
    def edit(work: Path) -> None:
        p = work / path
        text = p.read_text()
        assert old in text, (old, path)
        p.write_text(text.replace(old, new, 1))
    return edit


def create_file(path: str, text: str) -> Edit:
    def edit(work: Path) -> None:
        p = work / path
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return edit


def delete_file(path: str) -> Edit:
    def edit(work: Path) -> None:
        (work / path).unlink()
    return edit


def message(subject: str) -> str:
    return f"{subject}\n\nThe hook needs this change because tests say so.\n\n{GOOD_TRAILERS}"


@pytest.fixture
def run_apply():
    def run(*args: str, upstream: Path | None = None) -> subprocess.CompletedProcess:
        cmd = [str(APPLY), *args]
        if upstream is not None:
            cmd += ["--upstream", str(upstream)]
        return subprocess.run(cmd, capture_output=True, text=True)
    return run


@pytest.fixture
def run_series():
    def run(*args: str) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
        return subprocess.run(["python3", str(SERIES_TOOL), *args], capture_output=True,
                              text=True, env=env)
    return run


@pytest.fixture
def kit():
    """The helper functions above, for the test modules."""
    from types import SimpleNamespace
    return SimpleNamespace(
        replace_line=replace_line, create_file=create_file, delete_file=delete_file,
        message=message, snapshot=snapshot, content=content, git=git,
        write_fake_vllm=write_fake_vllm, repo=REPO, good_trailers=GOOD_TRAILERS)
