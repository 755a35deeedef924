"""Two pins: UPSTREAM's PINS=, the pin of a vLLM, apply.sh choosing the series of the vLLM
it finds, tools/series --pin."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _manifest_module():
    spec = importlib.util.spec_from_file_location("ddtree_manifest_pins",
                                                  REPO / "vllm_ddtree" / "manifest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


manifest = _manifest_module()


def test_upstream_names_both_pins_each_with_its_pin_file_and_series():
    pins = manifest.supported_pins(REPO)
    assert list(pins) == ["0.26.0", "0.33.0"]
    assert pins["0.26.0"] == (REPO / "UPSTREAM", REPO / "patches")
    for version, (pin_file, patch_dir) in pins.items():
        keys = manifest.read_pin_file(pin_file)
        assert keys["VLLM_VERSION"] == version
        for key in ("VLLM_TAG", "VLLM_COMMIT", "VLLM_WHEEL", "VLLM_WHEEL_SHA256",
                    "BASE_IMAGE", "TORCH_VERSION"):
            assert keys.get(key), f"{pin_file} has no {key}="
        assert keys["BASE_IMAGE"] == f"vllm/vllm-openai:v{version}"
        assert keys["VLLM_WHEEL"].startswith(f"vllm-{version}-")
        assert manifest.series_names(patch_dir)


def test_pin_for_takes_local_builds_and_names_every_pin_when_none_fits():
    assert manifest.pin_for(REPO, "0.33.0+cu130")[0] == "0.33.0"
    assert manifest.pin_for(REPO, "0.26.0")[2] == REPO / "patches"
    with pytest.raises(manifest.SeriesError, match="0.26.0 and 0.33.0"):
        manifest.pin_for(REPO, "0.30.0")


def test_a_dropped_patch_is_not_in_the_second_pin():
    # 0.33.0 reserves no drafter slots in the target's batch (docs/vllm-0.33.0-rebase.md)
    assert "engine_ddtree-batch-defaults.patch" in manifest.series_names(REPO / "patches")
    assert "engine_ddtree-batch-defaults.patch" not in manifest.series_names(
        REPO / "patches" / "vllm-0.33.0")


def test_apply_refuses_a_vllm_of_no_pin_naming_both(tmp_path, run_apply, kit):
    site = tmp_path / "site"
    kit.write_fake_vllm(site, version="0.30.0")
    r = run_apply("--site", str(site), "--check")
    assert r.returncode == 1
    assert "0.26.0 and 0.33.0" in r.stderr and "0.30.0" in r.stderr


def test_apply_with_another_pin_refuses_the_default_pins_vllm(fake_site, run_apply):
    r = run_apply("--site", str(fake_site), "--check", "--pin", "0.33.0")
    assert r.returncode == 1
    assert "0.26.0" in r.stderr and "0.33.0" in r.stderr


def test_series_tool_lints_the_second_pin(run_series):
    r = run_series("--pin", "0.33.0", "lint")
    assert r.returncode == 0, r.stderr
    r = run_series("--pin", "0.30.0", "lint")
    assert r.returncode == 1 and "0.26.0 and 0.33.0" in r.stderr
