"""vllm_ddtree.env: every VLLM_DDTREE_* on/off switch parses the same way, strictly."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

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
    from vllm_ddtree import _triton, context_store_graphs, dflash_tree_drafter, env

    for name, read in ((env.DIRECT_LAUNCH.name, _triton.direct_launch_enabled),
                       (env.CONTEXT_GRAPHS.name,
                        context_store_graphs.context_graphs_enabled),
                       (env.FUSED_KERNELS.name, dflash_tree_drafter.fused_kernels_enabled),
                       (env.LEAN_DRAFT.name, dflash_tree_drafter.lean_draft_enabled)):
        monkeypatch.setenv(name, "perhaps")
        with pytest.raises(ValueError, match=name):
            read()
        monkeypatch.delenv(name)


def test_choice_switch_is_strict(monkeypatch):
    from vllm_ddtree import env

    monkeypatch.delenv(env.TREE_ATTENTION.name, raising=False)
    assert env.tree_attention_choice() == "triton"
    monkeypatch.setenv(env.TREE_ATTENTION.name, " FLASH ")
    assert env.tree_attention_choice() == "flash"
    monkeypatch.setenv(env.TREE_ATTENTION.name, "cuda")
    with pytest.raises(ValueError, match="VLLM_DDTREE_TREE_ATTENTION='cuda'"):
        env.tree_attention_choice()


def test_path_switches_unset_or_empty_mean_off(monkeypatch):
    from vllm_ddtree import env

    for switch, read in ((env.PROFILE, env.profile_path),
                         (env.COST_MODEL_REPORT, env.cost_model_report_path)):
        monkeypatch.setenv(switch.name, "")
        assert read() is None
        monkeypatch.setenv(switch.name, "/tmp/x.json")
        assert read() == "/tmp/x.json"


PACKAGE = Path(__file__).resolve().parents[2] / "vllm_ddtree"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def _environment_reads(tree: ast.AST):
    """(line, key) for every read of the environment in a module: the key of
    ``os.environ.get(k)`` / ``os.getenv(k)`` / ``os.environ[k]`` when it is a string
    literal, else None (the environment handed on whole, or a key computed)."""
    keyed = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                node.func.attr == "getenv" or (
                    node.func.attr in ("get", "pop", "setdefault")
                    and isinstance(node.func.value, ast.Attribute)
                    and node.func.value.attr == "environ")):
            target = node.args[0] if node.args else None
            keyed.add(id(node.func) if node.func.attr == "getenv" else id(node.func.value))
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "environ":
            target = node.slice
            keyed.add(id(node.value))
        else:
            continue
        key = target.value if isinstance(target, ast.Constant) else None
        yield node.lineno, key
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") \
                and id(node) not in keyed:
            yield node.lineno, None
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                a.name in ("environ", "getenv") for a in node.names):
            yield node.lineno, None


def test_only_env_reads_ddtree_variables():
    """Outside env.py the package reads the environment only with a literal key that
    is not a VLLM_DDTREE_ name (Triton's and vLLM's own variables)."""
    offenders = []
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name == "env.py":
            continue
        for line, key in _environment_reads(ast.parse(path.read_text())):
            if key is None or str(key).startswith("VLLM_DDTREE_"):
                offenders.append(f"{path.name}:{line} reads {key or 'the environment'}")
    assert not offenders, offenders


@pytest.mark.parametrize("source, key", [
    ('import os\nx = os.environ.get("VLLM_DDTREE_NEW")\n', "VLLM_DDTREE_NEW"),
    ('import os\nx = os.getenv(NAME)\n', None),
    ('import os\nx = os.environ["VLLM_DDTREE_NEW"]\n', "VLLM_DDTREE_NEW"),
    ('import os\nf(os.environ)\n', None),
    ('from os import environ\n', None),
])
def test_the_check_sees_a_reader(source, key):
    assert [k for _, k in _environment_reads(ast.parse(source))] == [key]


def test_every_switch_is_declared_once_and_documented():
    from vllm_ddtree import env

    names = [s.name for s in env.SWITCHES]
    assert len(names) == len(set(names)) == 11
    text = DOCS.read_text()
    table = text[text.index("### Environment variables"):]
    table = table[:table.index("\n#")]
    for switch in env.SWITCHES:
        assert f"| `{switch.name}` |" in table, switch.name
    # Every VLLM_DDTREE_ name the package spells is declared.
    spelled = set()
    for path in PACKAGE.glob("*.py"):
        spelled |= set(re.findall(r"VLLM_DDTREE_[A-Z_]*[A-Z]", path.read_text()))
    assert spelled <= set(names), spelled - set(names)


def _vllm_environ_check():
    """vLLM's check of the environment as the engine arguments call it: a function of
    vllm.envs on 0.26.0, the platform's class method on 0.33.0."""
    pytest.importorskip("vllm")
    from vllm import envs

    if hasattr(envs, "validate_environ"):
        return envs.validate_environ
    from vllm.platforms.interface import Platform

    return Platform.validate_environ


def test_vllm_knows_the_documented_switches_and_still_reports_a_typo(monkeypatch):
    """Patch engine_ddtree-environment-variables: with vLLM's strict check
    (fail_on_environ_validation) every VLLM_DDTREE_* switch the package declares is
    accepted, and a name it does not declare is still refused by name."""
    from vllm_ddtree.env import SWITCHES, known_names

    check = _vllm_environ_check()
    for name in [n for n in os.environ if n.startswith("VLLM_")]:
        monkeypatch.delenv(name)
    assert known_names() == {s.name for s in SWITCHES}
    for s in SWITCHES:
        monkeypatch.setenv(s.name, "1" if s.kind == "flag" else "x")
    check(True)  # no error: all declared
    monkeypatch.setenv("VLLM_DDTREE_DEFER_CONTXT", "1")
    with pytest.raises(ValueError, match="VLLM_DDTREE_DEFER_CONTXT"):
        check(True)
