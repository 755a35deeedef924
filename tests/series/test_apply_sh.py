"""apply.sh against a tiny fake vLLM site and fake series: every success and failure mode."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _manifest_module():
    spec = importlib.util.spec_from_file_location("ddtree_manifest_t",
                                                  REPO / "vllm_ddtree" / "manifest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


manifest = _manifest_module()


@pytest.fixture
def two_patches(fake_site, make_series, kit):
    """A modify patch and a patch that creates a file in a new dir and deletes one."""
    return make_series(fake_site, [
        ("core_change-alpha.patch", kit.message("core: change alpha"),
         kit.replace_line("vllm/alpha.py", "line 10\n", "line ten\n")),
        ("core_add-new-module.patch", kit.message("core: add a module, drop gone.py"),
         lambda w: (kit.create_file("vllm/newpkg/mod.py", "x = 1\n")(w),
                    kit.delete_file("vllm/gone.py")(w),
                    kit.replace_line("vllm/sub/beta.py", "beta 5\n", "beta five\n")(w))),
    ])


def test_apply_writes_files_manifest_and_package(fake_site, two_patches, run_apply):
    r = run_apply("--site", str(fake_site), "--patches", str(two_patches))
    assert r.returncode == 0, r.stderr
    vllm = fake_site / "vllm"
    assert "line ten\n" in (vllm / "alpha.py").read_text()
    assert "beta five\n" in (vllm / "sub" / "beta.py").read_text()
    assert (vllm / "newpkg" / "mod.py").read_text() == "x = 1\n"
    assert not (vllm / "gone.py").exists()
    # a modified file keeps its mode
    assert (vllm / "sub" / "beta.py").stat().st_mode & 0o777 == 0o640
    m = json.loads((vllm / "ddtree_series.json").read_text())
    assert m["series_sha256"] == manifest.series_hash(two_patches)
    assert m["patches"] == ["core_change-alpha.patch", "core_add-new-module.patch"]
    assert m["vllm_version"] == "0.26.0"
    assert m["vllm_ddtree_version"] == manifest.package_version(REPO / "vllm_ddtree")
    assert m["modified"] == ["vllm/alpha.py", "vllm/sub/beta.py"]
    assert m["created"] == ["vllm/newpkg/mod.py"]
    assert m["deleted"] == ["vllm/gone.py"]
    assert m["package_copy"] == "vllm_ddtree"
    assert manifest.load_manifest(vllm) == m
    # originals kept for --revert
    assert (vllm / ".ddtree_orig" / "vllm" / "alpha.py").read_text().count("line 10\n") == 1
    assert (vllm / ".ddtree_orig" / "vllm" / "gone.py").exists()
    # package copied beside vllm, byte-identical to ours
    for src in (REPO / "vllm_ddtree").rglob("*.py"):
        rel = src.relative_to(REPO)
        assert (fake_site / rel).read_bytes() == src.read_bytes(), rel


def test_reapply_says_already_and_changes_nothing(fake_site, two_patches, run_apply, kit):
    assert run_apply("--site", str(fake_site), "--patches", str(two_patches)).returncode == 0
    before = kit.snapshot(fake_site)
    for extra in ([], ["--check"]):
        r = run_apply("--site", str(fake_site), "--patches", str(two_patches), *extra)
        assert r.returncode == 0, r.stderr
        assert "already applied" in r.stdout
        assert kit.snapshot(fake_site) == before


def test_revert_restores_byte_identical_tree(fake_site, two_patches, run_apply, kit):
    before = kit.snapshot(fake_site)
    assert run_apply("--site", str(fake_site), "--patches", str(two_patches)).returncode == 0
    assert kit.snapshot(fake_site) != before
    r = run_apply("--site", str(fake_site), "--patches", str(two_patches), "--revert")
    assert r.returncode == 0, r.stderr
    # content, modes, mtimes of restored files; created dir, manifest, backups, package gone
    assert kit.snapshot(fake_site) == before
    r = run_apply("--site", str(fake_site), "--revert")
    assert r.returncode == 0 and "nothing to revert" in r.stdout


def test_conflicting_hunk_aborts_naming_patch_and_file(fake_site, two_patches, run_apply, kit):
    # The second patch's context around "beta 5" no longer matches.
    beta = fake_site / "vllm" / "sub" / "beta.py"
    beta.write_text(beta.read_text().replace("beta 4\n", "beta four\n"))
    before = kit.snapshot(fake_site)
    for extra in ([], ["--check"]):
        r = run_apply("--site", str(fake_site), "--patches", str(two_patches), *extra)
        assert r.returncode == 1
        assert "core_add-new-module.patch" in r.stderr
        assert "vllm/sub/beta.py" in r.stderr
        assert "was not changed" in r.stderr
        # the first patch applied in the scratch copy only: the tree is untouched
        assert kit.snapshot(fake_site) == before


def test_one_line_offset_applies_but_changed_context_does_not(fake_site, make_series,
                                                             run_apply, kit):
    patches = make_series(fake_site, [
        ("a.patch", kit.message("core: change alpha"),
         kit.replace_line("vllm/alpha.py", "line 20\n", "line twenty\n"))])
    alpha = fake_site / "vllm" / "alpha.py"
    # context shifted by a line elsewhere: a plain offset, still exact context
    alpha.write_text("# header\n" + alpha.read_text())
    r = run_apply("--site", str(fake_site), "--patches", str(patches), "--check")
    assert r.returncode == 0, r.stderr
    # one context line differs: fuzz would take it, strict mode must not
    alpha.write_text(alpha.read_text().replace("line 18\n", "line 18 \n"))
    r = run_apply("--site", str(fake_site), "--patches", str(patches), "--check")
    assert r.returncode == 1 and "a.patch" in r.stderr and "vllm/alpha.py" in r.stderr


def test_patch_for_missing_file_names_it(fake_site, two_patches, run_apply, kit):
    (fake_site / "vllm" / "alpha.py").unlink()
    before = kit.snapshot(fake_site)
    r = run_apply("--site", str(fake_site), "--patches", str(two_patches))
    assert r.returncode == 1
    assert "core_change-alpha.patch" in r.stderr and "vllm/alpha.py" in r.stderr
    assert kit.snapshot(fake_site) == before


def test_wrong_vllm_version_refused(fake_site, two_patches, run_apply, kit):
    (fake_site / "vllm" / "_version.py").write_text("__version__ = version = '0.25.1'\n")
    before = kit.snapshot(fake_site)
    r = run_apply("--site", str(fake_site), "--patches", str(two_patches))
    assert r.returncode == 1
    assert "0.25.1" in r.stderr and "0.26.0" in r.stderr
    assert kit.snapshot(fake_site) == before


def test_version_read_from_version_py_and_local_build_accepted(fake_site, two_patches,
                                                                run_apply):
    (fake_site / "vllm" / "_version.py").unlink()
    (fake_site / "vllm" / "version.py").write_text('__version__ = "0.26.0+cu130"\n')
    r = run_apply("--site", str(fake_site), "--patches", str(two_patches), "--check")
    assert r.returncode == 0, r.stderr
    (fake_site / "vllm" / "version.py").write_text("from somewhere import __version__\n")
    r = run_apply("--site", str(fake_site), "--patches", str(two_patches), "--check")
    assert r.returncode == 1 and "cannot tell the vLLM version" in r.stderr


def test_other_series_refused_until_revert(fake_site, two_patches, make_series, run_apply,
                                           kit):
    other = make_series(fake_site, [
        ("other.patch", kit.message("core: other change"),
         kit.replace_line("vllm/alpha.py", "line 30\n", "line thirty\n"))])
    assert run_apply("--site", str(fake_site), "--patches", str(two_patches)).returncode == 0
    before = kit.snapshot(fake_site)
    r = run_apply("--site", str(fake_site), "--patches", str(other))
    assert r.returncode == 1
    assert "another DDTree series" in r.stderr and "--revert" in r.stderr
    assert kit.snapshot(fake_site) == before
    assert run_apply("--site", str(fake_site), "--revert").returncode == 0
    r = run_apply("--site", str(fake_site), "--patches", str(other))
    assert r.returncode == 0, r.stderr


def test_check_changes_nothing(fake_site, two_patches, run_apply, kit):
    before = kit.snapshot(fake_site)
    r = run_apply("--site", str(fake_site), "--patches", str(two_patches), "--check")
    assert r.returncode == 0, r.stderr
    for line in ("modify  vllm/alpha.py", "create  vllm/newpkg/mod.py", "delete  vllm/gone.py",
                 "nothing was changed"):
        assert line in r.stdout
    assert kit.snapshot(fake_site) == before
    assert run_apply("--site", str(fake_site), "--patches", str(two_patches)).returncode == 0
    applied = kit.snapshot(fake_site)
    r = run_apply("--site", str(fake_site), "--revert", "--check")
    assert r.returncode == 0 and "restore vllm/alpha.py" in r.stdout
    assert kit.snapshot(fake_site) == applied


def test_empty_series_writes_manifest_only(fake_site, tmp_path, run_apply, kit):
    patches = tmp_path / "empty"
    patches.mkdir()
    (patches / "series").write_text("# nothing yet\n")
    before = kit.snapshot(fake_site)
    r = run_apply("--site", str(fake_site), "--patches", str(patches), "--no-package")
    assert r.returncode == 0, r.stderr
    after = kit.snapshot(fake_site)
    new = set(after) - set(before)
    assert new == {"vllm/ddtree_series.json", "vllm/.ddtree_orig/"}
    m = manifest.load_manifest(fake_site / "vllm")
    assert m["patches"] == [] and m["package_copy"] is None
    assert m["series_sha256"] == manifest.series_hash(patches)
    assert run_apply("--site", str(fake_site), "--revert").returncode == 0
    assert kit.snapshot(fake_site) == before


def test_bad_series_files_refused(fake_site, tmp_path, run_apply, kit):
    patches = tmp_path / "bad"
    patches.mkdir()
    (patches / "series").write_text("missing.patch\n")
    r = run_apply("--site", str(fake_site), "--patches", str(patches))
    assert r.returncode == 1 and "missing.patch does not exist" in r.stderr
    (patches / "missing.patch").write_text("")
    (patches / "series").write_text("missing.patch\nmissing.patch\n")
    r = run_apply("--site", str(fake_site), "--patches", str(patches))
    assert r.returncode == 1 and "listed twice" in r.stderr


def test_patch_outside_vllm_refused(fake_site, make_series, run_apply, kit):
    patches = make_series(fake_site, [
        ("evil.patch", kit.message("core: escape"), kit.create_file("other/x.py", "x\n"))])
    before = kit.snapshot(fake_site)
    r = run_apply("--site", str(fake_site), "--patches", str(patches))
    assert r.returncode == 1 and "outside vllm/" in r.stderr and "evil.patch" in r.stderr
    assert kit.snapshot(fake_site) == before


def test_files_changed_after_apply_are_detected(fake_site, two_patches, run_apply):
    assert run_apply("--site", str(fake_site), "--patches", str(two_patches)).returncode == 0
    (fake_site / "vllm" / "alpha.py").write_text("someone reinstalled or edited this\n")
    r = run_apply("--site", str(fake_site), "--patches", str(two_patches))
    assert r.returncode == 1 and "vllm/alpha.py" in r.stderr and "--revert" in r.stderr
    r = run_apply("--site", str(fake_site), "--revert")
    assert r.returncode == 0 and "changed after the series was applied" in r.stdout
    assert "line 10\n" in (fake_site / "vllm" / "alpha.py").read_text()


def test_foreign_package_copy_refused_unless_no_package(fake_site, two_patches, run_apply,
                                                        kit):
    (fake_site / "vllm_ddtree").mkdir()
    (fake_site / "vllm_ddtree" / "__init__.py").write_text("# pip-installed\n")
    before = kit.snapshot(fake_site)
    r = run_apply("--site", str(fake_site), "--patches", str(two_patches))
    assert r.returncode == 1 and "--no-package" in r.stderr
    assert kit.snapshot(fake_site) == before
    r = run_apply("--site", str(fake_site), "--patches", str(two_patches), "--no-package")
    assert r.returncode == 0, r.stderr
    assert (fake_site / "vllm_ddtree" / "__init__.py").read_text() == "# pip-installed\n"
    assert run_apply("--site", str(fake_site), "--revert").returncode == 0
    assert kit.snapshot(fake_site) == before


def test_stale_package_copy_refreshed_on_reapply(fake_site, two_patches, run_apply):
    assert run_apply("--site", str(fake_site), "--patches", str(two_patches)).returncode == 0
    copy = fake_site / "vllm_ddtree" / "__init__.py"
    copy.write_text("# stale\n")
    r = run_apply("--site", str(fake_site), "--patches", str(two_patches))
    assert r.returncode == 0 and "refreshed" in r.stdout
    assert copy.read_bytes() == (REPO / "vllm_ddtree" / "__init__.py").read_bytes()


def test_source_checkout_mode(tmp_path, make_series, run_apply, kit):
    src = tmp_path / "vllm-src"
    kit.write_fake_vllm(src)
    (src / "vllm" / "_version.py").unlink()  # a source checkout has no generated _version
    kit.git(src, "init", "-q")
    kit.git(src, "add", "-A")
    kit.git(src, "commit", "-q", "-m", "upstream")
    head = kit.git(src, "rev-parse", "HEAD").strip()
    patches = make_series(src, [("a.patch", kit.message("core: change alpha"),
                                 kit.replace_line("vllm/alpha.py", "line 3\n", "line 3!\n"))])
    pins = (REPO / "UPSTREAM").read_text()
    wrong = tmp_path / "UPSTREAM.wrong"
    wrong.write_text(pins)
    r = run_apply("--source", str(src), "--patches", str(patches), upstream=wrong)
    assert r.returncode == 1 and head[:12] in r.stderr and "0.26.0" in r.stderr
    right = tmp_path / "UPSTREAM.right"
    right.write_text(pins.replace("VLLM_COMMIT=", f"VLLM_COMMIT={head[:10]}\n#"))
    r = run_apply("--source", str(src), "--patches", str(patches), upstream=right)
    assert r.returncode == 0, r.stderr
    assert "pip install" in r.stdout
    assert not (src / "vllm_ddtree").exists()
    assert "line 3!\n" in (src / "vllm" / "alpha.py").read_text()
    r = run_apply("--source", str(src), "--revert", upstream=right)
    assert r.returncode == 0, r.stderr
    assert kit.git(src, "status", "--porcelain") == ""


def _repo_copy_without_venv(tmp_path: Path) -> Path:
    """What apply.sh reads of a fresh clone, without .venv."""
    repo = tmp_path / "clone"
    (repo / "patches").mkdir(parents=True)
    (repo / "vllm_ddtree").mkdir()
    for name in ("apply.sh", "UPSTREAM", "requirements-test.txt"):
        shutil.copy2(REPO / name, repo / name)
    shutil.copy2(REPO / "vllm_ddtree" / "manifest.py", repo / "vllm_ddtree" / "manifest.py")
    return repo


@pytest.mark.parametrize("need, message", [
    ("100000000", "MiB free on the disk holding"),  # 100 PB: never there
    ("ten", "DDTREE_MIN_FREE_GB must be a whole number of GiB, got 'ten'"),
])
def test_venv_setup_refuses_before_installing_without_disk_space(tmp_path, need, message):
    repo = _repo_copy_without_venv(tmp_path)
    r = subprocess.run([str(repo / "apply.sh")], capture_output=True, text=True,
                       env={**os.environ, "DDTREE_MIN_FREE_GB": need}, timeout=60)
    assert r.returncode == 1 and message in r.stderr, r.stderr
    assert not (repo / ".venv").exists()  # refused before creating anything


def test_ddtree_venv_sets_up_another_venv_than_dot_venv(tmp_path):
    """DDTREE_VENV=DIR: the venv set-up (here its dry run) targets DIR, relative to the
    working directory, and leaves .venv alone; tools/test reads the same variable."""
    repo = _repo_copy_without_venv(tmp_path)
    r = subprocess.run([str(repo / "apply.sh"), "--check"], capture_output=True, text=True,
                       cwd=tmp_path, env={**os.environ, "DDTREE_VENV": "pin-venv"}, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"would set up {tmp_path / 'pin-venv'} (vllm==" in r.stdout
    assert not (repo / ".venv").exists() and not (tmp_path / "pin-venv").exists()
    t = subprocess.run([str(REPO / "tools" / "test")], capture_output=True, text=True,
                       cwd=tmp_path, env={**os.environ, "DDTREE_VENV": "pin-venv"}, timeout=60)
    assert t.returncode == 1 and f"no {tmp_path / 'pin-venv'}; run ./apply.sh first" in t.stderr
