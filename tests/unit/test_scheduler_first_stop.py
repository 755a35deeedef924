"""vLLM's scheduler under patch ``core_append-a-step-s-new-tokens-at-once``: a step's
several new tokens (accepted drafts and the bonus token) are appended at once, up to
where ``check_stop`` would first stop, and leave every request as appending and
checking them one at a time does (vLLM's loop, kept here as the reference)."""

from __future__ import annotations

import random

import pytest

from tests.unit.test_ddtree_batch_defaults import ON_0_26

MAX_MODEL_LEN = 96
BLOCK = 4
ON_0_33 = not ON_0_26  # the second pin: min_tokens gates only repetition detection there


def _reference(request, new_token_ids: list[int], max_model_len: int):
    """vLLM's per-token loop (the pinned release's Scheduler._update_request_with_output
    before the patch): append one token, check for a stop, trim after a stop; on
    0.33.0 also the computed-token count trimmed with the tokens and the placeholders
    resolved."""
    from vllm.v1.core.sched.utils import check_stop

    num_new_tokens = len(new_token_ids)
    stopped = False
    for num_new, token_id in enumerate(new_token_ids, 1):
        request.append_output_token_ids(token_id)
        stopped = check_stop(request, max_model_len)
        if stopped:
            if ON_0_33:
                request.num_computed_tokens -= len(new_token_ids) - num_new
            del new_token_ids[num_new:]
            break
    if ON_0_33 and request.num_output_placeholders > 0:
        request.num_output_placeholders -= num_new_tokens
    return new_token_ids, stopped


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory):
    """vLLM's real scheduler as `vllm serve` builds it for the README's DDTree
    configuration on an H200, ``max_model_len`` MAX_MODEL_LEN."""
    from tests.unit.test_ddtree_batch_defaults import (
        _server_config,
        patch_h200,
        write_models,
    )
    from tests.unit.test_online_budget import _scheduler

    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    # Once: the chain's first hash is random unless PYTHONHASHSEED is set.
    init_none_hash(sha256)
    models = write_models(tmp_path_factory.mktemp("models"))
    with pytest.MonkeyPatch.context() as mp:
        patch_h200(mp)
        s = _scheduler(_server_config(models, max_model_len=MAX_MODEL_LEN))
    assert s.max_model_len == MAX_MODEL_LEN
    return s


def _request(rng: random.Random, repetition: bool = False):
    """A sampling request with random limits, stop tokens and output so far, hashing
    its blocks (prefix caching's hasher) so that block hashes are compared too."""
    from vllm.sampling_params import RepetitionDetectionParams, SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    prompt = [rng.randrange(3, 12) for _ in range(rng.randrange(1, 30))]
    max_tokens = rng.randrange(1, 60)
    params = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=rng.choice([0, 0, rng.randrange(0, max_tokens + 1)]),
        stop_token_ids=rng.choice([None, [], [4], [5, 7]]),
        ignore_eos=rng.random() < 0.2,
        repetition_detection=(RepetitionDetectionParams(max_pattern_size=2, min_count=3)
                              if repetition else None),
    )
    params.update_from_generation_config({}, eos_token_id=rng.choice([None, 3, 6]))
    request = Request("r", prompt, params, None,
                      block_hasher=get_request_block_hasher(BLOCK, sha256))
    done = rng.randrange(0, max(1, max_tokens - 1))
    request.append_output_token_ids([rng.randrange(8, 12) for _ in range(done)])
    return request


def _update(scheduler, request, new_token_ids: list[int]):
    """The patched method, vLLM's Scheduler's (AsyncScheduler's own adds the
    placeholder bookkeeping of requests it scheduled around it)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler._update_request_with_output(scheduler, request, new_token_ids)


def _state(request):
    return (list(request.output_token_ids), list(request.all_token_ids),
            list(request.block_hashes), request.status, request.stop_reason,
            request.num_computed_tokens, request.num_output_placeholders)


def _tokens(rng: random.Random) -> list[int]:
    """A step's new tokens: 1-16 (a bonus token and up to 15 accepted drafts), stop
    and EOS candidates among them."""
    return [rng.choice([3, 4, 5, 6, 7, 8, 9, 10, 11]) for _ in range(rng.randrange(1, 17))]


def _compare(scheduler, seed: int, repetition: bool = False) -> set:
    """Decodes one random request twice, through the patched method and the loop,
    until it stops; the same returns and request state after every step. Returns how
    it finished."""
    rng = random.Random(seed + 10_000)
    a, b = (_request(random.Random(seed), repetition) for _ in range(2))
    while not a.is_finished():
        tokens = _tokens(rng)
        for r in (a, b):
            # As the scheduler leaves a request it scheduled for these tokens.
            r.num_computed_tokens = r.num_tokens + len(tokens) - 1
            r.num_output_placeholders += len(tokens)
        got = _update(scheduler, a, list(tokens))
        want = _reference(b, list(tokens), MAX_MODEL_LEN)
        assert got == want, (seed, tokens)
        assert _state(a) == _state(b), (seed, tokens)
    return (a.status, a.stop_reason is not None)


def test_several_new_tokens_leave_the_request_as_the_per_token_loop_does(scheduler):
    from vllm.v1.request import RequestStatus

    finished = {_compare(scheduler, seed) for seed in range(600)}
    # The random cases reach every way a request stops.
    assert finished == {(RequestStatus.FINISHED_STOPPED, False),
                        (RequestStatus.FINISHED_STOPPED, True),
                        (RequestStatus.FINISHED_LENGTH_CAPPED, False)}


def test_a_request_reaching_max_model_len_is_capped_where_the_loop_caps_it(scheduler):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    a = Request("a", list(range(10, 10 + MAX_MODEL_LEN - 3)),
                SamplingParams(max_tokens=50, ignore_eos=True), None)
    tokens, stopped = _update(scheduler, a, [20, 21, 22, 23, 24])
    assert (tokens, stopped) == ([20, 21, 22], True)
    assert a.num_tokens == MAX_MODEL_LEN
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_several_new_tokens_are_not_checked_one_at_a_time(scheduler, monkeypatch):
    """The patch's point: check_stop is not called per token when a step brings
    several; one token a step still goes through it."""
    import vllm.v1.core.sched.scheduler as sched_mod
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    calls = []
    real = sched_mod.check_stop
    monkeypatch.setattr(sched_mod, "check_stop",
                        lambda *a: calls.append(1) or real(*a))
    r = Request("c", [5, 6, 7], SamplingParams(max_tokens=40), None)
    _update(scheduler, r, [8, 9, 10, 11])
    assert calls == [] and r.num_output_tokens == 4
    _update(scheduler, r, [8])
    assert calls == [1]


def test_repetition_detection_still_checks_each_token(scheduler):
    from vllm.v1.request import RequestStatus

    finished = {_compare(scheduler, seed, repetition=True) for seed in range(200)}
    assert (RequestStatus.FINISHED_REPETITION, True) in finished
