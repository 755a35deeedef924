"""StepProfiler's bookkeeping, with fake CUDA events (the real ones need a GPU)."""

import json

import pytest

from vllm_ddtree import step_profile
from vllm_ddtree.step_profile import MARKS, StepProfiler


class FakeClock:
    now = 0.0


class FakeEvent:
    def __init__(self, enable_timing=True):
        self.t = None

    def record(self):
        self.t = FakeClock.now

    def query(self):
        return self.t is not None

    def elapsed_time(self, other):
        return other.t - self.t


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(step_profile.torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(step_profile.torch.cuda, "is_current_stream_capturing", lambda: False)
    FakeClock.now = 0.0


def _step(prof, batch, durations):
    for mark, d in zip(MARKS, durations):
        prof.mark(mark, batch if mark == "verify" else None)
        FakeClock.now += d


def test_stages_by_batch_size(fake_cuda, tmp_path):
    prof = StepProfiler(str(tmp_path / "p.json"), dump_every=2)
    prof.clock = lambda: FakeClock.now / 1e3 + 100.0  # the host's clock, in seconds
    # verify->sample 5, sample->walked 1, walked->propose 0.5, propose->compacted 0.25,
    # compacted->drafted 2, drafted->next verify 0.25: a step of 9 ms.
    for _ in range(3):
        _step(prof, 4, [5, 1, 0.5, 0.25, 2, 0.25])
    _step(prof, 16, [7, 1, 0.5, 0.25, 2, 0.25])
    prof.mark("verify", 16)  # closes the batch-16 step
    summary = prof.summary()
    b4 = summary["by_batch_size"]["4"]
    assert b4["verify_forward"]["mean"] == 5
    assert b4["draft_tree"]["mean"] == 2
    assert b4["step"]["mean"] == 9 and b4["step"]["n"] == 3
    assert b4["to_propose"]["mean"] == 6.5  # forward + sample/walk + runner gap
    assert summary["by_batch_size"]["16"]["step"]["mean"] == 11
    # Host times of the same stages (here the fake host clock runs with the GPU's).
    assert b4["host_verify_forward"]["mean"] == pytest.approx(5)
    assert b4["host_draft_tree"]["mean"] == pytest.approx(2)
    assert b4["host_step"]["mean"] == pytest.approx(9)
    assert summary["measured_steps"] == 4
    dumped = json.loads((tmp_path / "p.json").read_text())
    assert dumped["measured_steps"] == 4


def test_unfinished_events_wait(fake_cuda, tmp_path, monkeypatch):
    prof = StepProfiler(str(tmp_path / "p.json"))
    _step(prof, 1, [1, 1, 1, 1, 1, 1])
    monkeypatch.setattr(FakeEvent, "query", lambda self: False)  # GPU still busy
    prof.mark("verify", 1)
    assert prof.measured == 0 and len(prof.pending) == 1
    monkeypatch.setattr(FakeEvent, "query", lambda self: True)
    prof._resolve()
    assert prof.measured == 1 and not prof.pending


def test_off_by_default(monkeypatch):
    monkeypatch.delenv(step_profile.ENV, raising=False)
    assert StepProfiler.from_env() is None


def test_a_step_without_drafts_still_splits_forward_and_context(fake_cuda, tmp_path):
    """Budget-0 steps have no sample/walked marks (the plain sampler runs): their
    forward side is to_propose, the drafter's context store is draft_tree."""
    prof = StepProfiler(str(tmp_path / "p.json"))
    for _ in range(2):
        for mark, d in (("verify", 2.0), ("propose", 0.1), ("compacted", 0.5), ("drafted", 0.4)):
            prof.mark(mark, 64 if mark == "verify" else None)
            FakeClock.now += d
    prof.mark("verify", 64)
    b64 = prof.summary()["by_batch_size"]["64"]
    assert b64["to_propose"]["mean"] == 2.0 and b64["draft_tree"]["mean"] == 0.5
    assert b64["step"]["mean"] == 3.0 and "verify_forward" not in b64


def test_steps_with_prompt_tokens_are_grouped_apart(fake_cuda, tmp_path):
    """A decode step and one that also prefills a joining request land in separate
    groups ("16" and "16+prefill"), listed by request count, decode-only first."""
    prof = StepProfiler(str(tmp_path / "p.json"))
    for with_prefill, forward, tokens in ((False, 3.0, 272), (True, 9.0, 700), (False, 3.0, 288)):
        prof.mark("verify", 16, with_prefill, tokens)
        FakeClock.now += forward
    prof.mark("verify", 4)
    FakeClock.now += 1.0
    prof.mark("verify", 4)
    groups = prof.summary()["by_batch_size"]
    assert list(groups) == ["4", "16", "16+prefill"]
    assert groups["16"]["step"]["n"] == 2 and groups["16"]["step"]["mean"] == 3.0
    assert groups["16+prefill"]["step"]["n"] == 1 and groups["16+prefill"]["step"]["mean"] == 9.0
    # The steps' scheduled tokens beside their times (none given for the batch-4 step).
    assert groups["16"]["scheduled_tokens"]["mean"] == 280.0
    assert groups["16+prefill"]["scheduled_tokens"]["p50"] == 700.0
    assert "scheduled_tokens" not in groups["4"]
