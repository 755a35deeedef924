"""Requests DDTree decodes without drafts (patch core_ddtree-requests-without-drafts):
vLLM's real schedulers, asynchronous and synchronous, on the CPU, with an engine
configuration resolved as `vllm serve` resolves it (an H200's device answers,
tests/unit/test_ddtree_batch_defaults.py).

A request that sets a penalty, bad words or structured outputs gets no draft slots,
step after step, while the other requests of the batch keep theirs."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from tests.unit.test_ddtree_batch_defaults import _server_config, h200, models  # noqa: E402,F401
from tests.unit.test_online_budget import _scheduler  # noqa: E402

BUDGET = 8
REQUESTS = {
    "plain": SamplingParams(max_tokens=1000, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=1000, ignore_eos=True, temperature=1.0, seed=3),
    "penalty": SamplingParams(max_tokens=1000, ignore_eos=True, repetition_penalty=1.2),
    "presence": SamplingParams(max_tokens=1000, ignore_eos=True, presence_penalty=0.5),
    "bad-words": SamplingParams(max_tokens=1000, ignore_eos=True, bad_words=["foo"]),
}
ON_TREES = {"plain", "seeded"}


def _config(models, **engine_args):
    return _server_config(models, spec={"method": "ddtree", "num_speculative_tokens": BUDGET,
                                        "ddtree_online_budget": False},
                          max_num_seqs=16, max_model_len=32768, enable_prefix_caching=False,
                          **engine_args)


def _add(s):
    for i, (name, params) in enumerate(REQUESTS.items()):
        s.add_request(Request(name, list(range(10 + i, 42 + i)), params, None))


def _output(out):
    ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[7] for _ in ids])


def test_async_scheduling_gives_them_no_draft_slots(models, h200):
    cfg = _config(models)
    assert cfg.scheduler_config.async_scheduling
    s = _scheduler(cfg)
    assert isinstance(s, AsyncScheduler)
    _add(s)
    assert {r: s.requests[r].ddtree_no_drafts for r in REQUESTS} == {
        r: r not in ON_TREES for r in REQUESTS}
    drafted = []
    for _ in range(6):
        out = s.schedule()
        drafted.append({r: len(t) for r, t in out.scheduled_spec_decode_tokens.items()})
        s.update_from_output(out, _output(out))
    # After the prefill step, every step verifies drafts for the tree requests only.
    assert drafted[0] == {}
    assert all(d == {r: BUDGET for r in ON_TREES} for d in drafted[2:]), drafted


def test_sync_scheduling_drops_their_drafts(models, h200):
    cfg = _config(models, async_scheduling=False)
    assert not cfg.scheduler_config.async_scheduling
    s = _scheduler(cfg)
    assert not isinstance(s, AsyncScheduler)
    _add(s)
    out = s.schedule()
    s.update_from_output(out, _output(out))
    # The drafter proposed for every request; the scheduler keeps the tree requests'.
    s.update_draft_token_ids(DraftTokenIds(list(REQUESTS), [[5] * BUDGET for _ in REQUESTS]))
    out = s.schedule()
    assert {r: len(t) for r, t in out.scheduled_spec_decode_tokens.items()} == {
        r: BUDGET for r in ON_TREES}
    assert all(out.num_scheduled_tokens[r] == 1 for r in REQUESTS if r not in ON_TREES)


def test_other_engines_do_not_mark_requests(models, h200):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    cfg = AsyncEngineArgs(model=models["target"], skip_tokenizer_init=True, max_num_seqs=16,
                          max_model_len=32768, enable_prefix_caching=False,
                          speculative_config={"method": "dflash", "model": models["drafter"],
                                              "num_speculative_tokens": 4}
                          ).create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    s = _scheduler(cfg)
    _add(s)
    assert not s.ddtree_without_drafts
    assert not any(hasattr(s.requests[r], "ddtree_no_drafts") for r in REQUESTS)


def test_a_batch_of_such_requests_drafts_nothing(models, h200):
    """When no request of a step verifies drafts, the scheduler tells the drafter to
    draft none (num_spec_tokens_to_schedule 0): the step is a budget-0 step."""
    s = _scheduler(_config(models))
    for i, name in enumerate(n for n in REQUESTS if n not in ON_TREES):
        s.add_request(Request(name, list(range(10 + i, 42 + i)), REQUESTS[name], None))
    scheduled = []
    for _ in range(4):
        out = s.schedule()
        scheduled.append(out.num_spec_tokens_to_schedule)
        s.update_from_output(out, _output(out))
    assert scheduled == [0, 0, 0, 0]
    # One tree request joins: its batch drafts again.
    s.add_request(Request("plain", list(range(60, 92)), REQUESTS["plain"], None))
    out = s.schedule()
    assert out.num_spec_tokens_to_schedule == BUDGET
