"""The real series (patches/) against the real pinned vLLM.

The pristine files come from the installed vLLM in the test environment: its files are
copied to a scratch site, any series apply.sh put there is reverted in the copy (never in
the venv itself), and every file is then checked against the sha256 in the wheel's RECORD,
so the baseline is proven pristine independently of apply.sh. No network needed: this
runs in CI right after ./apply.sh patched .venv.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _manifest_module():
    spec = importlib.util.spec_from_file_location("ddtree_manifest_real",
                                                  REPO / "vllm_ddtree" / "manifest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


manifest = _manifest_module()


def _installed_pin() -> tuple[Path, Path]:
    """(pin file, patch dir) of the pin the test environment's vLLM belongs to; the
    default pin when vLLM is missing or none of the pins."""
    try:
        _, pin_file, patch_dir = manifest.pin_for(REPO, importlib.metadata.version("vllm"))
        return pin_file, patch_dir
    except (importlib.metadata.PackageNotFoundError, manifest.SeriesError):
        return REPO / "UPSTREAM", REPO / "patches"


PIN_FILE, PATCHES = _installed_pin()
PINS = manifest.read_pin_file(PIN_FILE)


def _tool_module():
    import importlib.machinery
    import sys
    loader = importlib.machinery.SourceFileLoader("series_tool_real",
                                                  str(REPO / "tools" / "series"))
    spec = importlib.util.spec_from_loader("series_tool_real", loader)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["series_tool_real"] = mod
    loader.exec_module(mod)
    return mod


# the same text files tools/series imports from the wheel
TEXT_SUFFIXES = _tool_module().TEXT_SUFFIXES


def record_sha256(value: str) -> str:
    return base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)).hex()


def installed_vllm():
    try:
        dist = importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vllm is not installed in this environment (run ./apply.sh)")
    if dist.version != PINS["VLLM_VERSION"]:
        pytest.fail(f"installed vLLM is {dist.version}, the pin is {PINS['VLLM_VERSION']}; "
                    "run ./apply.sh")
    site = Path(dist.locate_file(""))
    return dist, site


def series_files() -> set[str]:
    out = set()
    for name in manifest.series_names(PATCHES):
        for line in (PATCHES / name).read_text().splitlines():
            if line.startswith("diff --git a/"):
                out.add(line.split(" b/", 1)[1])
    return out


@pytest.fixture(scope="module")
def pristine_site(tmp_path_factory):
    """A scratch site with the pinned vLLM's text files, verified against RECORD."""
    dist, site = installed_vllm()
    root = tmp_path_factory.mktemp("pristine") / "site"
    wanted = series_files()
    expected: dict[str, str] = {}
    for f in dist.files or []:
        rel = str(f)
        if not rel.startswith("vllm/") or f.hash is None or f.hash.mode != "sha256":
            continue
        if Path(rel).suffix in TEXT_SUFFIXES or rel in wanted:
            src = site / rel
            if src.is_file():
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, root / rel)
                expected[rel] = record_sha256(f.hash.value)
    assert expected, "vllm's RECORD lists no files"
    m = manifest.load_manifest(site / "vllm")
    if m is not None:
        # carry what --revert needs, then revert the copy
        shutil.copy2(site / "vllm" / manifest.MANIFEST_NAME, root / "vllm" / manifest.MANIFEST_NAME)
        orig = site / "vllm" / manifest.ORIG_DIR_NAME
        if orig.is_dir():
            shutil.copytree(orig, root / "vllm" / manifest.ORIG_DIR_NAME)
        for rel in m.get("created", []):
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(site / rel, root / rel)
        if m.get("package_copy"):
            shutil.copytree(site / m["package_copy"], root / m["package_copy"])
        r = subprocess.run([str(REPO / "apply.sh"), "--site", str(root), "--revert"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
    bad = [rel for rel, digest in expected.items()
           if manifest.file_sha256(root / rel) != digest]
    assert not bad, f"files differ from the wheel's RECORD after revert: {bad[:10]}"
    present = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
    assert present == set(expected), sorted(present ^ set(expected))[:10]
    return root


def tree(root: Path) -> dict[str, tuple]:
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_dir():
            out[rel + "/"] = ("dir",)
        else:
            st = p.stat()
            out[rel] = (manifest.file_sha256(p), st.st_mode, st.st_mtime_ns)
    return out


def test_real_series_applies_and_reverts_byte_identically(pristine_site, tmp_path):
    site = tmp_path / "site"
    shutil.copytree(pristine_site, site)
    before = tree(site)
    run = lambda *a: subprocess.run([str(REPO / "apply.sh"), "--site", str(site), *a],
                                    capture_output=True, text=True)
    r = run("--check")
    assert r.returncode == 0, r.stdout + r.stderr
    assert tree(site) == before
    r = run()
    assert r.returncode == 0, r.stdout + r.stderr
    m = manifest.load_manifest(site / "vllm")
    assert m["series_sha256"] == manifest.series_hash(PATCHES)
    assert m["patches"] == manifest.series_names(PATCHES)
    assert m["vllm_version"] == PINS["VLLM_VERSION"]
    assert set(m["modified"]) | set(m["created"]) | set(m["deleted"]) == series_files()
    r = run()
    assert r.returncode == 0 and "already applied" in r.stdout
    r = run("--revert")
    assert r.returncode == 0, r.stdout + r.stderr
    assert tree(site) == before


def test_real_series_reexports_byte_for_byte(pristine_site, tmp_path):
    """CI's drift check: import the series onto the pristine files and export it again."""
    patches = tmp_path / "patches"
    shutil.copytree(PATCHES, patches)
    tool = [str(REPO / "tools" / "series"), "--patches", str(patches),
            "--upstream", str(PIN_FILE)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    r = subprocess.run(tool + ["import", "--dir", str(tmp_path / "work"), "--from-site",
                               str(pristine_site)], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run(tool + ["export", "--dir", str(tmp_path / "work")],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    files = sorted(p for p in PATCHES.iterdir() if p.is_file())
    for p in files:
        assert (patches / p.name).read_bytes() == p.read_bytes(), (
            f"{p.name} changes when re-exported; run tools/series import && tools/series export")
    assert sorted(x.name for x in patches.iterdir() if x.is_file()) == [p.name for p in files]


def test_installed_vllm_carries_this_series():
    """The test environment's vLLM was patched by ./apply.sh with the current patches/."""
    _, site = installed_vllm()
    m = manifest.load_manifest(site / "vllm")
    if m is None:
        if os.environ.get("CI"):
            pytest.fail(f"{site}/vllm carries no DDTree series; CI must run ./apply.sh first")
        pytest.skip(f"{site}/vllm is not patched (run ./apply.sh)")
    assert m["series_sha256"] == manifest.series_hash(PATCHES), (
        f"{site}/vllm carries series {m['series_sha256'][:12]}, patches/ is "
        f"{manifest.series_hash(PATCHES)[:12]}: run ./apply.sh --revert && ./apply.sh")
    assert manifest.changed_since_apply(site, m) == []


def test_installed_vllm_exposes_its_series():
    """Patch core_series-manifest: the patched vLLM returns the manifest as
    vllm.ddtree_series (what the engine logs at start-up and operators check)."""
    _, site = installed_vllm()
    m = manifest.load_manifest(site / "vllm")
    if m is None:
        pytest.skip(f"{site}/vllm is not patched (run ./apply.sh)")
    import vllm
    assert vllm.ddtree_series == m
