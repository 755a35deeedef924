"""tools/series: import/export round trip (byte for byte), lint, docs, naming."""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import re
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load_tool():
    loader = importlib.machinery.SourceFileLoader("series_tool", str(REPO / "tools" / "series"))
    spec = importlib.util.spec_from_loader("series_tool", loader)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["series_tool"] = mod  # dataclasses look their module up there
    loader.exec_module(mod)
    return mod


tool = _load_tool()


@pytest.fixture
def fake_pin(tmp_path, kit):
    """A small wheel with the fake vLLM's files (and a binary) plus an UPSTREAM naming it."""
    src = tmp_path / "wheel-src"
    kit.write_fake_vllm(src)
    wheel = tmp_path / "vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for p in sorted(src.rglob("*")):
            if p.is_file():
                z.write(p, str(p.relative_to(src)))
        z.writestr("vllm/_C.abi3.so", b"\x7fELF\0\0binary")
        z.writestr("vllm-0.26.0.dist-info/RECORD", "")
    upstream = tmp_path / "UPSTREAM"
    upstream.write_text(
        "VLLM_VERSION=0.26.0\nVLLM_COMMIT=ffd46bfab\n"
        f"VLLM_WHEEL={wheel.name}\n"
        f"VLLM_WHEEL_SHA256={hashlib.sha256(wheel.read_bytes()).hexdigest()}\n")
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "series").write_text(tool.SERIES_HEADER)
    return {"wheel": wheel, "upstream": upstream, "patches": patches,
            "docs": tmp_path / "docs" / "patches.md", "work": tmp_path / "work"}


def series_args(pin, *args):
    return ["--patches", str(pin["patches"]), "--upstream", str(pin["upstream"]),
            "--docs", str(pin["docs"]), *args]


def import_(run_series, pin, *extra):
    r = run_series(*series_args(pin, "import", "--dir", str(pin["work"]),
                                "--wheel", str(pin["wheel"]), *extra))
    assert r.returncode == 0, r.stderr
    return r


def commit(kit, work, edit, msg):
    edit(work)
    kit.git(work, "add", "-A")
    kit.git(work, "commit", "-q", "-m", msg)


def files_of(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.fixture
def exported(fake_pin, run_series, kit):
    """Import the empty series, add three commits, export and document them."""
    pin = fake_pin
    import_(run_series, pin)
    work = pin["work"]
    assert (work / "vllm" / "alpha.py").is_file()
    assert not (work / "vllm" / "_C.abi3.so").exists()  # binaries are not imported
    commit(kit, work, kit.replace_line("vllm/alpha.py", "line 7\n", "line seven\n"),
           kit.message("spec-decode: add the DDTree config"))
    commit(kit, work, kit.create_file("vllm/sub/tree.py", "TREE = True\n"),
           kit.message("v2 runner: select the DDTree speculator"))
    commit(kit, work, kit.replace_line("vllm/sub/beta.py", "beta 9\n", "beta nine\n"),
           "attention: tree mask hook\n\nWhy: FA3 has no tree masks; this routes trees.\n"
           "Second line of why | with a pipe.\n\n" + kit.good_trailers
           + "Tested-By: tests/test_x.py\n")
    r = run_series(*series_args(pin, "export", "--dir", str(work)))
    assert r.returncode == 0, r.stderr
    r = run_series(*series_args(pin, "docs"))
    assert r.returncode == 0, r.stderr
    (pin["patches"].parent / "tests").mkdir()
    (pin["patches"].parent / "tests" / "test_x.py").write_text("")  # the Tested-By target
    return pin


def test_export_writes_named_patches_and_series(exported):
    pin = exported
    names = ["spec-decode_add-the-ddtree-config.patch",
             "v2-runner-select-the-ddtree-speculator.patch",
             "attention_tree-mask-hook.patch"]
    assert (pin["patches"] / "series").read_text() == tool.SERIES_HEADER + "".join(
        n + "\n" for n in names)
    for n in names:
        text = (pin["patches"] / n).read_text()
        assert text.startswith(tool.ZERO_FROM + "\n")
        assert "Patch-Name" not in text
        assert "\n-- \n" not in text  # no signature
    assert "index 0000000" not in (pin["patches"] / names[0]).read_text()


def test_untouched_series_reexports_byte_for_byte(exported, run_series):
    pin = exported
    before = files_of(pin["patches"])
    mtimes = {p.name: p.stat().st_mtime_ns for p in pin["patches"].iterdir()}
    # straight re-export from the same work repo
    r = run_series(*series_args(pin, "export", "--dir", str(pin["work"])))
    assert r.returncode == 0 and "(no change)" in r.stdout
    assert files_of(pin["patches"]) == before
    assert {p.name: p.stat().st_mtime_ns for p in pin["patches"].iterdir()} == mtimes
    # fresh import of the exported files (git am + Patch-Name trailers), then export
    import_(run_series, pin, "--force")
    r = run_series(*series_args(pin, "export", "--dir", str(pin["work"])))
    assert r.returncode == 0 and "(no change)" in r.stdout, r.stdout + r.stderr
    assert files_of(pin["patches"]) == before


def test_reworded_subject_keeps_patch_name(exported, run_series, kit):
    pin = exported
    work = pin["work"]
    import_(run_series, pin, "--force")
    msg = kit.git(work, "log", "-1", "--format=%B")
    assert "Patch-Name: attention_tree-mask-hook" in msg
    kit.git(work, "commit", "-q", "--amend", "-m", msg.replace("tree mask hook", "tree masks"))
    r = run_series(*series_args(pin, "export", "--dir", str(work)))
    assert r.returncode == 0, r.stderr
    assert "wrote   attention_tree-mask-hook.patch" in r.stdout
    assert "Subject: [PATCH] attention: tree masks" in (
        pin["patches"] / "attention_tree-mask-hook.patch").read_text()


def test_dropping_a_commit_removes_its_patch(exported, run_series, kit):
    pin = exported
    work = pin["work"]
    kit.git(work, "rebase", "-q", "--onto", "HEAD~2", "HEAD~1")  # drop the middle commit
    r = run_series(*series_args(pin, "export", "--dir", str(work)))
    assert r.returncode == 0, r.stderr
    assert "removed v2-runner-select-the-ddtree-speculator.patch" in r.stdout
    assert "v2-runner" not in (pin["patches"] / "series").read_text()


def test_export_refuses_dirty_work_tree(exported, run_series):
    pin = exported
    (pin["work"] / "vllm" / "alpha.py").write_text("dirty\n")
    r = run_series(*series_args(pin, "export", "--dir", str(pin["work"])))
    assert r.returncode == 1 and "uncommitted" in r.stderr


def test_lint_and_docs_on_a_good_series(exported, run_series):
    pin = exported
    r = run_series(*series_args(pin, "lint"))
    assert r.returncode == 0, r.stderr
    docs = pin["docs"].read_text()
    assert "| 1 | [`spec-decode_add-the-ddtree-config.patch`]" in docs
    assert "`vllm/sub/tree.py`" in docs
    assert "Inappropriate [DDTree is not upstream]" in docs
    assert "Second line of why \\| with a pipe." in docs  # escaped for the table
    # the series hash in the docs is the one apply.sh records
    assert tool.manifest.series_hash(pin["patches"]) in docs


@pytest.mark.parametrize("breakage, message", [
    ("unlisted", "not listed in"),
    ("no-drop-when", "no 'Drop-When:' trailer"),
    ("bad-status", "Upstream-Status 'Maybe"),
    ("no-why", "no paragraph saying why"),
    ("stale-docs", "is stale; run tools/series docs"),
    ("not-exported", "not written by tools/series export"),
    ("outside-vllm", "not under vllm/"),
    ("short-index", "abbreviated 'index' lines"),
    ("tested-by", "Tested-By names tests/test_x.py, which does not exist"),
    ("missing", "does not exist"),
])
def test_lint_catches(exported, run_series, breakage, message):
    pin = exported
    patches = pin["patches"]
    first = patches / "spec-decode_add-the-ddtree-config.patch"
    text = first.read_text()
    if breakage == "unlisted":
        (patches / "extra.patch").write_text(text)
    elif breakage == "no-drop-when":
        first.write_text(text.replace("Drop-When: vLLM ships tree speculation natively\n", ""))
    elif breakage == "bad-status":
        first.write_text(text.replace("Upstream-Status: Inappropriate", "Upstream-Status: Maybe"))
    elif breakage == "no-why":
        first.write_text(text.replace("The hook needs this change because tests say so.\n\n", ""))
    elif breakage == "stale-docs":
        pin["docs"].write_text(pin["docs"].read_text() + "\nhand edit\n")
    elif breakage == "not-exported":
        first.write_text(text.replace(tool.ZERO_FROM, "From 1234567890abcdef1234567890abcdef12345678 Mon Sep 17 00:00:00 2001"))
    elif breakage == "outside-vllm":
        first.write_text(text.replace("a/vllm/alpha.py", "a/setup.py"))
    elif breakage == "short-index":
        first.write_text(re.sub(r"^index ([0-9a-f]{7})[0-9a-f]{33}\.\.([0-9a-f]{7})[0-9a-f]{33}",
                                r"index \1..\2", text, flags=re.M))
    elif breakage == "tested-by":
        (patches.parent / "tests" / "test_x.py").unlink()
    elif breakage == "missing":
        first.unlink()
    r = run_series(*series_args(pin, "lint"))
    assert r.returncode == 1
    assert message in r.stderr, r.stderr


def test_import_refuses_wrong_wheel_hash(fake_pin, run_series):
    pin = fake_pin
    pin["upstream"].write_text(pin["upstream"].read_text().replace(
        "VLLM_WHEEL_SHA256=", "VLLM_WHEEL_SHA256=00"))
    r = run_series(*series_args(pin, "import", "--dir", str(pin["work"]),
                                "--wheel", str(pin["wheel"])))
    assert r.returncode == 1 and "does not match VLLM_WHEEL_SHA256" in r.stderr


def test_import_names_a_patch_that_does_not_apply(exported, run_series):
    pin = exported
    first = pin["patches"] / "spec-decode_add-the-ddtree-config.patch"
    first.write_text(first.read_text().replace(" line 6\n", " line six\n"))
    r = run_series(*series_args(pin, "import", "--dir", str(pin["work"]), "--force",
                                "--wheel", str(pin["wheel"])))
    assert r.returncode == 1 and "spec-decode_add-the-ddtree-config.patch" in r.stderr


def test_check_applies_and_reverts_on_pristine_wheel(exported, run_series):
    r = run_series(*series_args(exported, "check", "--wheel", str(exported["wheel"])))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "check ok" in r.stdout


@pytest.mark.parametrize("subject, name", [
    ("spec-decode: add DDTree config", "spec-decode_add-ddtree-config"),
    ("v2 runner: pick the tree speculator", "v2-runner-pick-the-tree-speculator"),
    ("Fix   THE  thing!", "fix-the-thing"),
    ("attention: " + "very long words " * 10, None),
])
def test_name_from_subject(subject, name):
    got = tool.name_from_subject(subject)
    if name is not None:
        assert got == name
    assert len(got) <= 60
    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*(_[a-z0-9]+(-[a-z0-9]+)*)?", got), got


def test_real_series_lints_clean(run_series):
    """The repo's own patches/ and docs/patches.md (CI runs this)."""
    r = run_series("lint")
    assert r.returncode == 0, r.stderr
