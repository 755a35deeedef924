"""bench/compile_cache.sh: the GPU host's compile caches saved in one loan and restored
in the next (vLLM's torch.compile cache and Triton's kernel cache, under $HOME)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "compile_cache.sh"


def _run(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ, HOME=str(home), COMPILE_CACHE_MARKER=str(home / "restored"), **env)
    return subprocess.run(["bash", str(SCRIPT), *args], env=full, text=True,
                          capture_output=True, timeout=60)


def _fill(home: Path) -> dict[str, bytes]:
    files = {
        ".cache/vllm/torch_compile_cache/671e0f2fdd/rank_0_0/backbone/cache_key": b"k" * 100,
        ".triton/cache/ABC123/_tree_walk_kernel.cubin": os.urandom(4096),
    }
    for rel, data in files.items():
        (home / rel).parent.mkdir(parents=True, exist_ok=True)
        (home / rel).write_bytes(data)
    # Other caches under $HOME stay behind.
    (home / ".cache/huggingface").mkdir(parents=True)
    (home / ".cache/huggingface/token").write_text("x")
    return files


def test_a_saved_cache_restores_into_a_new_home_once(tmp_path):
    loan1, loan2 = tmp_path / "loan1", tmp_path / "loan2"
    files = _fill(loan1)
    tarball = tmp_path / "compile-cache.tar.gz"
    r = _run(loan1, "save", str(tarball))
    assert r.returncode == 0 and "saved" in r.stdout, r.stderr
    loan2.mkdir()
    r = _run(loan2, "restore", str(tarball))
    assert r.returncode == 0 and "restored" in r.stdout, r.stderr
    for rel, data in files.items():
        assert (loan2 / rel).read_bytes() == data
    assert not (loan2 / ".cache/huggingface").exists()
    # Once per machine: a later call of the same loan keeps what it compiled since.
    newer = loan2 / ".triton/cache/ABC123/_tree_walk_kernel.cubin"
    newer.write_bytes(b"newer")
    r = _run(loan2, "restore", str(tarball))
    assert r.returncode == 0 and "already restored" in r.stdout
    assert newer.read_bytes() == b"newer"


def test_a_cache_over_the_size_limit_is_not_saved(tmp_path):
    _fill(tmp_path / "home")
    out = tmp_path / "compile-cache.tar.gz"
    r = _run(tmp_path / "home", "save", str(out), COMPILE_CACHE_MAX_MIB="0")
    assert r.returncode == 0 and "not saved" in r.stdout
    assert not out.exists() and not Path(str(out) + ".tmp").exists()


def test_nothing_to_save_and_a_missing_tarball(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    out = tmp_path / "compile-cache.tar.gz"
    r = _run(home, "save", str(out))
    assert r.returncode == 0 and "nothing to save" in r.stdout and not out.exists()
    r = _run(home, "restore", str(tmp_path / "missing.tar.gz"))
    assert r.returncode == 1 and "no " in r.stderr
    assert _run(home, "bogus").returncode == 2
