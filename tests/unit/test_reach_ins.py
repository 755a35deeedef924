"""vllm_ddtree.reach_ins: the registry of vLLM / Triton internals holds on the pinned
vLLM, a changed shape fails naming the reach-in, and no import of vLLM internals can
be added to the package without an entry."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm_ddtree import reach_ins  # noqa: E402
from vllm_ddtree.reach_ins import (  # noqa: E402
    REACH_INS,
    ReachIn,
    ReachInError,
    check_reach_ins,
    reach_in_problems,
)

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_ddtree"
DFLASH = "vllm.v1.worker.gpu.spec_decode.dflash.speculator"


def test_every_reach_in_holds_on_the_pinned_vllm():
    assert reach_in_problems() == []
    check_reach_ins(REACH_INS)


def test_every_entry_says_why_and_when_it_goes():
    names = [e.name + e.kind for e in REACH_INS]
    assert len(names) == len(set(names))
    for e in REACH_INS:
        assert e.kind in ("signature", "keywords", "attributes", "members", "source", "value")
        assert e.expect and e.used_in and e.why and e.drop_when and e.upstream, e.name


def test_a_changed_signature_is_named(monkeypatch):
    from vllm.v1.worker.gpu.spec_decode.dflash import speculator

    def prepare_dflash_inputs(input_buffers, query_slot_mapping, context_positions):
        raise AssertionError("never called")

    monkeypatch.setattr(speculator, "prepare_dflash_inputs", prepare_dflash_inputs)
    with pytest.raises(ReachInError) as info:
        check_reach_ins(REACH_INS)
    message = str(info.value)
    assert f"{DFLASH}:prepare_dflash_inputs (signature; used in speculator.py" in message
    assert "found ['input_buffers', 'query_slot_mapping', 'context_positions']" in message
    # The copied BLOCK_SIZE rule lives in the replaced function's source: named too.
    assert f"{DFLASH}:prepare_dflash_inputs (source; used in dflash_input_warmup.py" in message
    assert "vllm 0.26.0" in message


def test_a_missing_method_and_attribute_are_named_in_one_error(monkeypatch):
    from vllm.v1.worker.gpu import cudagraph_utils
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    monkeypatch.delattr(Sampler, "sample")
    # A graph manager that no longer keeps _capture_descs (assigned in __init__).
    monkeypatch.setattr(cudagraph_utils, "CudaGraphManager", type("CudaGraphManager", (), {}))
    with pytest.raises(ReachInError) as info:
        check_reach_ins(REACH_INS)
    message = str(info.value)
    assert ("vllm.v1.worker.gpu.sample.sampler:Sampler (attributes; used in tree_verifier.py "
            "(DDTreeSampler)): expected attributes ['sample', 'compute_nans', "
            "'sampling_states', 'req_states', 'returns_logprobs', 'logprobs_mode', "
            "'logprob_token_ids_state'], missing ['sample']") in message
    assert "vllm.v1.worker.gpu.sample.sampler:Sampler.sample (signature" in message
    assert "expected it to exist, found none (AttributeError" in message
    assert ("vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager (attributes; used in "
            "speculator.py (_drafter_graph_batch_sizes)): expected attributes "
            "['_capture_descs'], missing ['_capture_descs']") in message
    assert "3 reach-in(s)" in message


def test_attributes_assigned_in_a_base_init_count():
    class Base:
        def __init__(self):
            self.assigned: int = 1

    class Child(Base):
        pass

    ok = ReachIn(__name__, "", "attributes", ("PACKAGE",), "t", "t", "t")
    assert reach_in_problems((ok,)) == []
    found = reach_ins._missing_attributes(Child, ("assigned", "never_assigned"))
    assert reach_ins._missing_attributes(Child(), ("assigned",)) == []
    assert found == ["never_assigned"]


def _fake(a, b=1):
    return min(256, a + b)


@pytest.mark.parametrize("entry, ok", [
    (ReachIn(__name__, "_fake", "signature", ("a", "b"), "t", "t", "t"), True),
    (ReachIn(__name__, "_fake", "signature", ("a",), "t", "t", "t"), False),
    (ReachIn(__name__, "_fake", "keywords", ("b",), "t", "t", "t"), True),
    (ReachIn(__name__, "_fake", "keywords", ("b", "c"), "t", "t", "t"), False),
    (ReachIn(__name__, "_fake", "source", ("min(256,  a + b)",), "t", "t", "t"), True),
    (ReachIn(__name__, "_fake", "source", ("min(128, a + b)",), "t", "t", "t"), False),
    (ReachIn("vllm.config.compilation", "CUDAGraphMode", "members", ("FULL",), "t", "t", "t"),
     True),
    (ReachIn("vllm.config.compilation", "CUDAGraphMode", "members", ("HALF",), "t", "t", "t"),
     False),
    (ReachIn("vllm.v1.worker.gpu.sample.states", "NO_LOGPROBS", "value", (-2,), "t", "t", "t"),
     False),
    (ReachIn(__name__, "_absent", "signature", ("a",), "t", "t", "t", optional=True), True),
    (ReachIn(__name__, "_absent", "signature", ("a",), "t", "t", "t"), False),
])
def test_each_kind_of_check(entry, ok):
    assert (reach_in_problems((entry,)) == []) is ok


def test_the_start_up_check_runs_once_per_process(monkeypatch):
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    monkeypatch.setattr(reach_ins, "_PASSED", False)
    check_reach_ins()
    assert reach_ins._PASSED
    monkeypatch.delattr(Sampler, "sample")
    check_reach_ins()  # remembered: not checked again
    monkeypatch.setattr(reach_ins, "_PASSED", False)
    with pytest.raises(ReachInError, match="Sampler"):
        check_reach_ins()
    assert not reach_ins._PASSED


def test_the_speculator_checks_at_start_up(monkeypatch):
    from vllm_ddtree import speculator

    def refuse():
        raise ReachInError("checked")

    monkeypatch.setattr(speculator, "check_reach_ins", refuse)
    with pytest.raises(ReachInError, match="checked"):
        speculator.DDTreeSpeculator(None, None)


def _internal_imports(source: str):
    """(line, module, name) for each import of vLLM or of Triton's submodules."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "vllm" or node.module.startswith(("vllm.", "triton")):
                for alias in node.names:
                    yield node.lineno, node.module, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "vllm" or alias.name.startswith(("vllm.", "triton.runtime",
                                                                  "triton.compiler")):
                    yield node.lineno, alias.name, ""


def _covered(module: str, name: str) -> bool:
    for e in REACH_INS:
        if e.module == module and (not name or e.target.split(".")[0] == name):
            return True
        if name and e.module == f"{module}.{name}":  # a module imported from a package
            return True
    return False


def test_every_vllm_import_of_the_package_is_registered():
    uncovered = []
    for path in sorted(PACKAGE.glob("*.py")):
        for line, module, name in _internal_imports(path.read_text()):
            if not _covered(module, name):
                uncovered.append(f"{path.name}:{line}: from {module} import {name}")
    assert not uncovered, ("register these in vllm_ddtree/reach_ins.py: " + "; ".join(uncovered))


def test_the_import_check_sees_a_new_reach_in():
    source = ("from vllm.v1.worker.gpu.input_batch import InputBatch\n"
              "from vllm.v1.worker.gpu.new_module import helper\n"
              "from vllm_ddtree.env import env_flag\n"
              "import triton.runtime.autotuner\n")
    found = [(m, n) for _, m, n in _internal_imports(source) if not _covered(m, n)]
    assert found == [("vllm.v1.worker.gpu.new_module", "helper"),
                     ("triton.runtime.autotuner", "")]
