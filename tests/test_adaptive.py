"""Adaptive k (runtime/adaptive.py): the choice against hand-computed expected rates, the
running acceptance, the probe after idle rounds; and on tiny pairs, output equal to
target-only whatever the policy chooses, and a policy that stops drafting when every
candidate is rejected."""

from __future__ import annotations

import pytest

from specrt import Engine, GenerationConfig
from specrt.runtime.adaptive import AdaptiveK, expected_tokens


def test_expected_tokens_hand_computed():
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.0, 5) == 1.0


def test_choice_follows_costs_and_acceptance():
    # target call: 10 ms at q=1..2, +10 ms per extra row; draft 2 ms a step
    t = [0.010, 0.010, 0.020, 0.030, 0.040]
    p = AdaptiveK(t, 0.002, prior=0.9, weight=1e9)  # alpha pinned at 0.9
    # n=1: 1.9 / 12 ms = 158/s; n=2: 2.71 / 24 ms = 113/s; n=0: 100/s
    assert p.choose(4) == 1
    assert p.rate(1) == pytest.approx(1.9 / 0.012)
    free = AdaptiveK([0.010] * 5, 0.0, prior=0.9, weight=1e9)  # a free draft, flat target cost
    assert free.choose(4) == 4 and free.choose(2) == 2
    low = AdaptiveK(t, 0.002, prior=0.05, weight=1e9, probe_every=3)
    assert [low.choose(4) for _ in range(6)] == [0, 0, 1, 0, 0, 1]  # a probe every 3 rounds


def test_running_acceptance_decays_toward_recent_rounds():
    p = AdaptiveK([0.01, 0.01], 0.001, prior=0.5, weight=2.0, decay=0.5)
    assert p.alpha == 0.5
    p.update(4, 4)  # all accepted: no rejection
    assert p.alpha == pytest.approx((4 + 1) / (4 + 2))
    p.update(4, 0)  # rejected at once: decayed counts 2 accepted, 1 rejection
    assert (p.accepted, p.rejected) == (2.0, 1.0)
    p.update(0, 0)  # a round without candidates changes nothing
    assert (p.accepted, p.rejected) == (2.0, 1.0)
    with pytest.raises(ValueError):
        AdaptiveK([0.0], 0.001)


@pytest.mark.parametrize("pair", ["tiny_pair", "int4_pair"])
@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_adaptive_output_equals_target_only(request, pair, drafter):
    e = Engine(request.getfixturevalue(pair)[2])
    for ids in ([3, 4, 5, 3, 4, 5, 3], list(range(7, 40)), [2] * 12):
        base = e.generate(ids, GenerationConfig(max_new_tokens=30, speculative=False)).tokens
        res = e.generate(ids, GenerationConfig(max_new_tokens=30, k_max=4, adaptive=True, drafter=drafter))
        assert res.tokens == base


def test_adaptive_stops_drafting_a_draft_that_is_always_rejected(tiny_pair):
    """The tiny pair's draft is random: nearly every candidate is rejected, so the policy
    turns to plain target steps (probing now and then) and proposes far less."""
    e = Engine(tiny_pair[2])
    ids = list(range(5, 25))
    fixed = e.generate(ids, GenerationConfig(max_new_tokens=60, k_max=4, threshold=0.0))
    adap = e.generate(ids, GenerationConfig(max_new_tokens=60, k_max=4, threshold=0.0, adaptive=True))
    assert fixed.tokens == adap.tokens
    assert fixed.stats.accepted / fixed.stats.proposed < 0.3
    assert adap.stats.proposed < fixed.stats.proposed / 2
