"""vLLM's spec-decode metrics under patches
``metrics_spec-decode-per-position-counters-stop-at-zero`` (the Prometheus per-position
counters stop at the first position no request reached, with the values every increment
gave) and ``metrics_spec-decode-stats-count-drafts-by-length-per`` (the scheduler's
stats count each request's draft by length and add the per-position counts once a
step, with the counts the per-position loop gave)."""

from __future__ import annotations

import types

import pytest

NUM_SPEC_TOKENS = 64  # a DDTree budget: tree nodes, of which at most the depth accept


@pytest.fixture()
def prom():
    import prometheus_client
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics
    from vllm.v1.spec_decode.metrics import SpecDecodingProm

    unregister_vllm_metrics()
    spec = types.SimpleNamespace(num_speculative_tokens=NUM_SPEC_TOKENS)
    p = SpecDecodingProm(spec, ["model_name", "engine"], {0: ["m", "0"]})
    yield p, prometheus_client.REGISTRY
    unregister_vllm_metrics()


def _step(accepted: list[int]):
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    stats = SpecDecodingStats.new(NUM_SPEC_TOKENS)
    for a in accepted:
        stats.observe_draft(num_draft_tokens=NUM_SPEC_TOKENS, num_accepted_tokens=a)
    return stats.finish()  # as the scheduler's make_stats does


def test_per_position_counters_hold_every_count_and_stop_at_the_first_zero(prom):
    p, registry = prom
    counters = p.counter_spec_decode_num_accepted_tokens_per_pos[0]
    assert len(counters) == NUM_SPEC_TOKENS
    calls = [0] * NUM_SPEC_TOKENS

    class Recording:
        def __init__(self, pos, counter):
            self.pos, self.counter = pos, counter

        def inc(self, n):
            calls[self.pos] += 1
            self.counter.inc(n)

    p.counter_spec_decode_num_accepted_tokens_per_pos[0] = [
        Recording(i, c) for i, c in enumerate(counters)]
    steps = [[3, 0, 1], [0, 0], [5], [2, 2, 7, 0]]
    for accepted in steps:
        p.observe(_step(accepted), 0)

    def value(pos: int) -> float:
        return registry.get_sample_value(
            "vllm:spec_decode_num_accepted_tokens_per_pos_total",
            {"model_name": "m", "engine": "0", "position": str(pos)})

    for pos in range(NUM_SPEC_TOKENS):
        expected = sum(1 for accepted in steps for a in accepted if a > pos)
        assert value(pos) == expected, pos
    # One increment per position some request of the step reached: 3 + 0 + 5 + 7, not
    # NUM_SPEC_TOKENS a step.
    assert sum(calls) == 3 + 0 + 5 + 7
    assert calls[7:] == [0] * (NUM_SPEC_TOKENS - 7)
    assert registry.get_sample_value(
        "vllm:spec_decode_num_accepted_tokens_total",
        {"model_name": "m", "engine": "0"}) == sum(map(sum, steps))


def test_per_position_counts_are_those_of_the_per_position_loop():
    """observe_draft for each request, then finish(): the counts vLLM's loop over each
    draft's positions gave (position i counts the drafts longer than i), also when
    finish() runs more than once on one object."""
    import random

    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    rng = random.Random(0)
    for case in range(300):
        n = rng.choice([1, 4, 15, NUM_SPEC_TOKENS])
        stats = SpecDecodingStats.new(n)
        accepted_per_pos, drafted_per_pos = [0] * n, [0] * n
        for _ in range(rng.randrange(1, 4)):
            for _ in range(rng.randrange(0, 40)):
                drafted = rng.randrange(0, n + 1)
                accepted = rng.randrange(0, drafted + 1)
                stats.observe_draft(num_draft_tokens=drafted, num_accepted_tokens=accepted)
                for i in range(accepted):
                    accepted_per_pos[i] += 1
                for i in range(drafted):
                    drafted_per_pos[i] += 1
            stats.finish()
            assert stats.num_accepted_tokens_per_pos == accepted_per_pos, case
            assert stats.num_draft_tokens_per_pos == drafted_per_pos, case


def test_the_scheduler_hands_out_finished_per_position_counts(tmp_path):
    """vLLM's real scheduler, DDTree verifying 4 drafts a request: every step's stats
    (SchedulerStats.spec_decoding_stats, what the front end logs and exports) carry
    per-position counts that add up to the step's drafted and accepted tokens."""
    from tests.unit.test_ddtree_batch_defaults import _server_config, patch_h200, write_models
    from tests.unit.test_online_budget import Serving, _scheduler

    models = write_models(tmp_path)
    with pytest.MonkeyPatch.context() as mp:
        patch_h200(mp)
        cfg = _server_config(models, spec={"method": "ddtree", "num_speculative_tokens": 4,
                                           "ddtree_online_budget": False,
                                           "ddtree_tokens_per_step": 5 * 1024},
                             # The stand-in's requests hash no blocks.
                             enable_prefix_caching=False)
        serving = Serving(_scheduler(cfg, log_stats=True), 8)
    serving.run(40, quality=0.7)
    spec = [s.spec_decoding_stats for s in serving.stats if s.spec_decoding_stats]
    assert len(spec) >= 30
    assert sum(s.num_accepted_tokens for s in spec) > 0
    for s in spec:
        assert sum(s.num_draft_tokens_per_pos) == s.num_draft_tokens
        assert sum(s.num_accepted_tokens_per_pos) == s.num_accepted_tokens
        assert s.num_draft_tokens_per_pos[0] == s.num_drafts
        assert s.num_accepted_tokens_per_pos == sorted(s.num_accepted_tokens_per_pos,
                                                       reverse=True)
