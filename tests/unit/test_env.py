"""vllm_ddtree.env: every VLLM_DDTREE_* on/off switch parses the same way, strictly."""

from __future__ import annotations

import pytest

from vllm_ddtree.env import env_flag


@pytest.mark.parametrize("value, expected", [
    ("1", True), ("true", True), ("YES", True), (" on ", True),
    ("0", False), ("False", False), ("no", False), ("off", False),
])
def test_words(monkeypatch, value, expected):
    monkeypatch.setenv("VLLM_DDTREE_X", value)
    assert env_flag("VLLM_DDTREE_X", default=not expected) is expected


@pytest.mark.parametrize("default", [True, False])
def test_unset_or_empty_is_the_default(monkeypatch, default):
    monkeypatch.delenv("VLLM_DDTREE_X", raising=False)
    assert env_flag("VLLM_DDTREE_X", default) is default
    monkeypatch.setenv("VLLM_DDTREE_X", "  ")
    assert env_flag("VLLM_DDTREE_X", default) is default


@pytest.mark.parametrize("value", ["2", "maybe", "enabled"])
def test_other_values_are_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("VLLM_DDTREE_X", value)
    with pytest.raises(ValueError, match=f"VLLM_DDTREE_X='{value}': use 1 or 0"):
        env_flag("VLLM_DDTREE_X", True)


def test_every_switch_uses_it(monkeypatch):
    pytest.importorskip("vllm")
    from vllm_ddtree import _triton, context_store_graphs, speculator

    for name, read in ((_triton.DIRECT_LAUNCH_ENV, _triton.direct_launch_enabled),
                       (context_store_graphs.CONTEXT_GRAPHS_ENV,
                        context_store_graphs.context_graphs_enabled),
                       (speculator.FUSED_KERNELS_ENV, speculator.fused_kernels_enabled),
                       (speculator.LEAN_DRAFT_ENV, speculator.lean_draft_enabled)):
        monkeypatch.setenv(name, "perhaps")
        with pytest.raises(ValueError, match=name):
            read()
        monkeypatch.delenv(name)
