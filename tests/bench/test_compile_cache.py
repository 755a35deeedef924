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


def test_a_cache_over_one_file_comes_back_in_parts_and_restores_from_them(tmp_path):
    """The device tool returns files of at most 16 MiB: a larger cache is saved as
    parts of COMPILE_CACHE_MAX_MIB, which restore as one."""
    loan1, loan2 = tmp_path / "loan1", tmp_path / "loan2"
    files = _fill(loan1)
    big = ".triton/cache/DEF456/_kv_compaction_kernel.cubin"
    (loan1 / big).parent.mkdir(parents=True)
    files[big] = os.urandom(1536 * 1024)              # incompressible: 1.5 MiB
    (loan1 / big).write_bytes(files[big])
    out = tmp_path / "out" / "compile-cache.tar.gz"
    out.parent.mkdir()
    r = _run(loan1, "save", str(out), COMPILE_CACHE_MAX_MIB="1")
    assert r.returncode == 0 and "in parts" in r.stdout, r.stdout + r.stderr
    assert sorted(p.name for p in out.parent.iterdir()) == [
        "compile-cache.tar.gz.00", "compile-cache.tar.gz.01"]
    assert (out.parent / "compile-cache.tar.gz.00").stat().st_size == 1024 * 1024
    loan2.mkdir()
    r = _run(loan2, "restore", str(out))
    assert r.returncode == 0 and "restored" in r.stdout, r.stderr
    for rel, data in files.items():
        assert (loan2 / rel).read_bytes() == data
    # More parts than a call can carry back: not saved.
    for p in out.parent.iterdir():
        p.unlink()
    r = _run(loan1, "save", str(out), COMPILE_CACHE_MAX_MIB="1", COMPILE_CACHE_MAX_PARTS="1")
    assert r.returncode == 0 and "not saved" in r.stdout and not any(out.parent.iterdir())
