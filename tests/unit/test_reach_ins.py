"""vllm_ddtree.reach_ins: the registry of vLLM / Triton internals holds on the installed
pin's vLLM, a changed shape fails naming the reach-in, the other pin's shapes do not
hold here, each pin's adapter (vllm_ddtree.pin_calls) calls the shape its entry
registers, and no import of vLLM internals can be added to the package without an
entry."""

from __future__ import annotations

import ast
import inspect
import types
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import vllm  # noqa: E402

from vllm_ddtree import pin_calls, reach_ins  # noqa: E402
from vllm_ddtree.reach_ins import (  # noqa: E402
    PINS,
    REACH_INS,
    ReachIn,
    ReachInError,
    check_reach_ins,
    entries_for_pin,
    installed_pin,
    reach_in_problems,
)

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_ddtree"
DFLASH = "vllm.v1.worker.gpu.spec_decode.dflash.speculator"


PIN = installed_pin()
OTHER_PINS = [p for p in PINS if p != PIN]


def test_the_installed_vllm_is_a_pin():
    assert PIN is not None, f"vllm {vllm.__version__} is none of {PINS}"
    assert installed_pin(PIN + "+cu130") == PIN
    assert installed_pin("0.27.0") is None


def test_every_reach_in_holds_on_the_pinned_vllm():
    assert reach_in_problems() == []
    check_reach_ins(REACH_INS)


def test_every_entry_says_why_and_when_it_goes():
    keys = [(e.name, e.kind, e.pins) for e in REACH_INS]
    assert len(keys) == len(set(keys))
    for e in REACH_INS:
        assert e.kind in ("signature", "keywords", "attributes", "members", "source", "value")
        assert e.expect and e.used_in and e.why and e.drop_when and e.upstream, e.name
        assert e.pins and set(e.pins) <= set(PINS), e.name


@pytest.mark.parametrize("other", OTHER_PINS)
def test_the_other_pins_shapes_do_not_hold_here(other):
    """The per-pin entries are real differences: each pin's own entries checked
    against this vLLM fail, naming them (so a pin's check would fail the same way if
    its vLLM changed to the other shape)."""
    only_there = tuple(e for e in entries_for_pin(other) if PIN not in e.pins)
    assert only_there
    problems = reach_in_problems(only_there, pin=other)
    failing = {line.split(" (")[0] for line in problems}
    # Every signature and source entry of the other pin differs here.
    for e in only_there:
        if e.kind in ("signature", "source"):
            assert e.name in failing, e.name
    assert "vllm.v1.worker.gpu.spec_decode.dflash.speculator:prepare_dflash_inputs" in failing
    assert "vllm.v1.worker.gpu.sample.sampler:Sampler.sample" in failing


def test_only_the_installed_pins_entries_are_checked():
    absent = dict(module=__name__, target="_absent", kind="signature", expect=("a",),
                  used_in="t", why="t", drop_when="t")
    elsewhere = tuple(p for p in PINS if p != PIN)
    assert reach_in_problems((ReachIn(**absent, pins=elsewhere),)) == []
    assert len(reach_in_problems((ReachIn(**absent, pins=(PIN,)),))) == 1
    assert len(reach_in_problems((ReachIn(**absent),))) == 1  # every pin by default


def test_a_vllm_that_is_no_pin_fails_the_check(monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.27.0")
    problems = reach_in_problems(())
    assert problems == [f"vllm 0.27.0 is none of the pins {', '.join(PINS)} "
                        "(vllm_ddtree.reach_ins.PINS)"]
    with pytest.raises(ReachInError, match="none of the pins"):
        check_reach_ins(())


def test_a_changed_signature_is_named(monkeypatch):
    from vllm.v1.worker.gpu.spec_decode.dflash import speculator

    def prepare_dflash_inputs(input_buffers, query_slot_mapping, context_positions):
        raise AssertionError("never called")

    monkeypatch.setattr(speculator, "prepare_dflash_inputs", prepare_dflash_inputs)
    with pytest.raises(ReachInError) as info:
        check_reach_ins(REACH_INS)
    message = str(info.value)
    assert f"{DFLASH}:prepare_dflash_inputs (signature; used in pin_calls.py" in message
    assert "found ['input_buffers', 'query_slot_mapping', 'context_positions']" in message
    # The copied BLOCK_SIZE rule lives in the replaced function's source: named too.
    assert f"{DFLASH}:prepare_dflash_inputs (source; used in dflash_input_warmup.py" in message
    assert f"vllm {vllm.__version__}" in message


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
            "'sampling_states', 'req_states', 'logprobs_mode', "
            "'logprob_token_ids_state'], missing ['sample']") in message
    assert "vllm.v1.worker.gpu.sample.sampler:Sampler.sample (signature" in message
    assert "expected it to exist, found none (AttributeError" in message
    assert ("vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager (attributes; used in "
            "dflash_tree_drafter.py (_drafter_graph_batch_sizes)): expected attributes "
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
    from vllm_ddtree import dflash_tree_drafter as speculator

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


# ------------------------------------------------------------ the per-pin adapters


def test_every_adapter_has_one_implementation_per_pin():
    assert pin_calls.ADAPTERS
    for adapter in pin_calls.ADAPTERS:
        assert set(adapter.impls) == set(PINS), adapter.name
    with pytest.raises(ValueError, match="pins are"):
        pin_calls.PinCall("half", {PINS[0]: print})


def _bind(module: str, target: str, pin: str, args, kwargs, defaulted=()) -> dict:
    """``args`` and ``kwargs`` bound to the parameters ``pin``'s signature entry of
    ``module:target`` registers; every parameter but ``defaulted`` must be given."""
    (entry,) = [e for e in entries_for_pin(pin) if e.module == module and e.target == target
                and e.kind == "signature"]
    signature = inspect.Signature([
        inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in entry.expect])
    bound = signature.bind_partial(*args, **kwargs).arguments
    assert set(entry.expect) - set(bound) == set(defaulted)
    return bound


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return "sampled", "processed"


def _batch():
    import torch

    return types.SimpleNamespace(
        expanded_idx_mapping="eim", idx_mapping="im", idx_mapping_np="imnp",
        expanded_local_pos="elp", seq_lens_cpu_upper_bound=torch.tensor([3, 4]))


@pytest.mark.parametrize("pin", PINS)
def test_each_pins_sampler_call_binds_that_pins_signature(pin):
    sample = _Recorder()
    sampler = types.SimpleNamespace(sample=sample)
    out = pin_calls.sampler_sample.impls[pin](sampler, "logits", _batch(), "pos", "ids", True)
    assert out == ("sampled", "processed")
    ((args, kwargs),) = sample.calls
    bound = _bind("vllm.v1.worker.gpu.sample.sampler", "Sampler.sample", pin,
                  ("self",) + args, kwargs)
    assert bound["pos"] == "pos" and bound["return_logprobs"] is True
    assert (bound["idx_mapping_np"], bound["expanded_local_pos"]) == ("imnp", "elp")
    if "seq_lens_upper_bound_np" in bound:
        assert bound["idx_mapping"] == "im"
        assert list(bound["seq_lens_upper_bound_np"]) == [3, 4]


def test_returns_logprobs_on_each_pin():
    dims = {"none": None, "some": (5, 0)}
    sampler = types.SimpleNamespace(
        returns_logprobs=lambda idx: idx == "some",
        get_logprobs_dims=lambda idx: dims[idx])
    for pin in PINS:
        fn = pin_calls.returns_logprobs.impls[pin]
        assert fn(sampler, "some") is True and fn(sampler, "none") is False


@pytest.mark.parametrize("pin", PINS)
def test_each_pins_dflash_input_call_binds_that_pins_signature(pin, monkeypatch):
    from vllm.v1.worker.gpu.spec_decode.dflash import speculator

    record = _Recorder()
    monkeypatch.setattr(speculator, "prepare_dflash_inputs", record)
    tables = types.SimpleNamespace(
        slot_mappings=["slots0", "slots1"], input_block_tables=["bt0", "bt1"],
        kernel_block_sizes=[16, 32], block_sizes=[16, 32], cp_rank=0, cp_interleave=1)
    spec = types.SimpleNamespace(
        input_buffers="buffers", block_tables=tables, context_positions="ctx_pos",
        _context_slot_mappings=["ctx_slots0", "ctx_slots1"], sample_indices="si",
        sample_pos="sp", sample_idx_mapping="sim", temperature="own_temp",
        seeds="own_seeds", dcp_size=1, parallel_drafting_token_id=7, num_query_per_req=8,
        num_speculative_steps=7, max_num_reqs=4, max_num_tokens=64, max_model_len=2048,
        sample_from_anchor=False)
    pin_calls.prepare_dflash_inputs.impls[pin](
        spec, 1, 1, "batch", "num_sampled", "num_rejected", "last", "next", "temp", "seeds")
    ((args, kwargs),) = record.calls
    # num_reqs_override (0.33.0) stays at its default, the whole batch.
    a = _bind(DFLASH, "prepare_dflash_inputs", pin, args, kwargs,
              defaulted={"num_reqs_override"} & set(
                  e for entry in entries_for_pin(pin) if entry.target == "prepare_dflash_inputs"
                  for e in entry.expect))
    assert (a["query_slot_mapping"], a["context_slot_mapping"], a["block_table"],
            a["block_size"]) == ("slots1", "ctx_slots1", "bt1", 32)
    assert (a["input_batch"], a["num_query_per_req"], a["max_model_len"]) == ("batch", 8, 2048)
    assert a["sample_from_anchor"] is False
    if "input_temperature" in a:  # the step's sampling state, into the drafter's copy
        assert (a["temperature"], a["input_temperature"], a["input_seeds"]) == (
            "own_temp", "temp", "seeds")
        assert (a["cp_rank"], a["cp_size"], a["cp_interleave"]) == (0, 1, 1)


def test_an_adapter_refuses_a_vllm_that_is_no_pin(monkeypatch):
    adapter = pin_calls.PinCall("probe", {p: (lambda p=p: p) for p in PINS})
    assert adapter() == PIN
    other = pin_calls.PinCall("probe", {p: (lambda p=p: p) for p in PINS})
    monkeypatch.setattr(vllm, "__version__", "0.27.0")
    with pytest.raises(ReachInError, match="probe: the installed vLLM is none of the pins"):
        other()
