"""vLLM's spec-decode Prometheus counters under patch
``metrics_spec-decode-per-position-counters-stop-at-zero``: the per-position counters
stop at the first position no request reached, with the values every increment gave."""

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
    return stats


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
