"""Find the command-line linters for tests/deploy, and run them.

The linters of requirements-lint.txt live in .venv-lint/ (tools/setup-lint-venv.sh);
LINT_BIN may name another directory holding them, and PATH is searched last. A missing
tool skips the test on a developer's machine but fails it where CI=true, so CI can
never pass by silently skipping a linter.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _search_path() -> str:
    dirs = [os.environ.get("LINT_BIN", ""), str(ROOT / ".venv-lint" / "bin"), os.environ.get("PATH", "")]
    return os.pathsep.join(d for d in dirs if d)


def missing(what: str, how: str):
    message = f"{what} is not available: {how}"
    if os.environ.get("CI") == "true":
        pytest.fail(message + " (CI=true: a linter may not be skipped)")
    pytest.skip(message)


def tool(name: str) -> str:
    """Absolute path of a linter, or skip (fail under CI) naming how to install it."""
    found = shutil.which(name, path=_search_path())
    if found is None:
        missing(name, "run tools/setup-lint-venv.sh (installs requirements-lint.txt into .venv-lint/)")
    return found


def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        missing("kubectl (for `kubectl kustomize`)", "install kubectl (Debian/apt or the cloud SDK)")
    return found


def run(argv: list[str], *, timeout: float = 120, env_extra: dict[str, str] | None = None,
        cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # Linters that call other linters (actionlint -> shellcheck) find them here too.
    env["PATH"] = _search_path()
    env.update(env_extra or {})
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def upstream(path: Path | None = None) -> dict[str, str]:
    """The keys of a pin file: UPSTREAM (the default pin) unless ``path`` names another."""
    values = {}
    for line in (path or ROOT / "UPSTREAM").read_text().splitlines():
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            values[key.strip()] = value.strip()
    return values
