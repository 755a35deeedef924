"""The batch-aware tree budget (vllm_ddtree.budget)."""

import pytest

from vllm_ddtree.budget import (
    OPEN_END,
    budget_for_batch,
    budget_levels,
    budget_schedule,
    expand_schedule,
)


def test_levels_are_the_budget_and_powers_of_two_below():
    assert budget_levels(64) == [64, 32, 16, 8, 4, 2, 1]
    assert budget_levels(48) == [48, 32, 16, 8, 4, 2, 1]
    assert budget_levels(48, min_budget=4) == [48, 32, 16, 8, 4]
    assert budget_levels(1) == [1]


@pytest.mark.parametrize("tokens, max_budget", [(512, 64), (128, 32), (4096, 64), (128, 15),
                                                (100, 7), (2, 1), (1000, 512)])
def test_schedule_matches_the_rule_for_every_batch(tokens, max_budget):
    schedule = budget_schedule(tokens, max_budget)
    # Ranges start at 1, are contiguous and end open.
    assert schedule[0][0] == 1 and schedule[-1][1] == OPEN_END
    for (_, last, _), (first, _, _) in zip(schedule, schedule[1:]):
        assert first == last + 1
    table = expand_schedule(schedule, 300)
    levels = budget_levels(max_budget)
    for n in range(1, 301):
        b = table[n]
        assert b == budget_for_batch(n, tokens, max_budget)
        assert b in levels
        # The trees fit in the token target unless even the smallest level does not.
        assert n * (b + 1) <= tokens or b == levels[-1]
        # And no larger level would have fit.
        bigger = [x for x in levels if x > b]
        assert not bigger or n * (min(bigger) + 1) > tokens
    # Budgets never grow with the batch.
    assert all(a >= b for a, b in zip(table[1:], table[2:]))


def test_512_tokens_and_budget_64():
    assert budget_schedule(512, 64)[:3] == [(1, 7, 64), (8, 15, 32), (16, 30, 16)]


@pytest.mark.parametrize("args, message", [((1, 8), "tokens_per_step"),
                                           ((64, 0), "max_budget"),
                                           ((64, 8, 9), "min_budget")])
def test_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        budget_schedule(*args)


def test_schedule_is_accepted_by_vllm():
    utils = pytest.importorskip("vllm.v1.spec_decode.dynamic.utils")
    table = utils.build_dynamic_sd_schedule_lookup(budget_schedule(512, 64), 64, 64)
    assert table[1:] == expand_schedule(budget_schedule(512, 64), 64)[1:]


def test_knee_from_measured_step_costs():
    from vllm_ddtree.budget import knee_tokens

    # The 8B weight-GEMM times of the design notes: flat to ~128 tokens, then up.
    pts = [(1, 3.67), (64, 3.90), (128, 4.26), (256, 6.51), (512, 12.19)]
    assert knee_tokens(pts) == 64  # 4.26 / 3.67 = 1.16 > 1.15
    assert knee_tokens(pts, max_slowdown=1.2) == 128
    assert knee_tokens(pts, max_slowdown=1.05) == 1
    assert knee_tokens(pts, max_slowdown=2.0) == 256
    # Unordered input, and a noisy cheap point past the first expensive one.
    assert knee_tokens([(512, 3.7), (256, 9.0), (1, 3.6), (64, 3.8)]) == 64
    with pytest.raises(ValueError):
        knee_tokens([])
    with pytest.raises(ValueError):
        knee_tokens(pts, max_slowdown=0.5)
    # A broken measurement (no time, or NaN) is refused, not read as cheap.
    for bad in (0.0, float("nan")):
        with pytest.raises(ValueError, match="positive cost"):
            knee_tokens([(1, 3.6), (64, bad)])


def test_a_token_target_and_a_drafting_off_size_compose():
    from vllm_ddtree.budget import (
        OPEN_END,
        batch_budget_schedule,
        budget_schedule,
        disable_from_batch_size,
    )

    assert batch_budget_schedule(512, 64, None) == budget_schedule(512, 64)
    assert batch_budget_schedule(512, 64, 16) == disable_from_batch_size(
        budget_schedule(512, 64), 64, 16)
    assert batch_budget_schedule(None, 32, 4) == [(1, 3, 32), (4, OPEN_END, 0)]
    assert batch_budget_schedule(None, 32, None) is None
