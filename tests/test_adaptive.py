"""Adaptive k (runtime/adaptive.py): the choice against hand-computed expected rates, the
running acceptance, the probe after idle rounds; and on tiny pairs, output equal to
target-only whatever the policy chooses, a policy that stops drafting when every
candidate is rejected, and, with per-call costs where drafting pays, a generation that
starts from the recorded acceptance and really drafts (model and n-gram drafters)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from specrt import Engine, GenerationConfig
from specrt.runtime.adaptive import AdaptiveK, expected_tokens
from specrt.runtime.costs import Costs


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


# Stipulated per-call costs where drafting pays: a target call of any width 1..k_max+1 takes
# 10 ms, a draft step 1 ms. (The tiny pairs' own costs never pay for drafting: their drafts
# are as large as their targets, about 0.5 ms a call each on this machine.)
TARGET_S, DRAFT_S = 0.010, 0.001


def _engine_with_costs(folder, monkeypatch, acceptance=None):
    """``(engine, measured)``: an Engine of ``folder`` whose adaptive k runs on the stipulated
    costs (the measurement Engine.adaptive_costs makes when the manifest holds no tuned costs
    returns them; ``measured`` lists the widths of each such call), and with ``acceptance``
    recorded as the manifest's calibrated acceptance (``extra.calibration.acceptance``)."""
    measured = []

    def costs(engine, widths, past, reps=5, **kw):
        measured.append(list(widths))
        return Costs(draft_s_per_call=DRAFT_S, target_s_by_q={q: TARGET_S for q in widths})

    monkeypatch.setattr("specrt.runtime.costs.measure_costs", costs)
    e = Engine(folder)
    extra = {k: v for k, v in e.manifest.extra.items() if k not in ("tune", "calibration")}
    if acceptance is not None:
        extra["calibration"] = {"acceptance": acceptance}
    e.manifest = replace(e.manifest, extra=extra)
    return e, measured


@pytest.mark.parametrize("acceptance, first", [(None, 4), (0.5, 2), (0.3, 1), (0.0, 0)])
def test_adaptive_first_round_drafts_what_the_prior_pays_for(self_pair, monkeypatch, acceptance, first):
    """Guards the prior: the first round's candidates are chosen from the recorded calibrated
    acceptance a (manifest extra.calibration.acceptance; 0.7 without a record), not from zero
    acceptance, and the loop drafts the k chosen (not k_max, not 0). Tokens per second of a
    round with n candidates, E(a, n) / (10 ms + n x 1 ms) with E(a, n) = 1 + a + ... + a^n:
    a = 0.7: n=3 2.533/13 ms = 194.8, n=4 2.773/14 ms = 198.1, n=5 2.941/15 ms = 196.1 -> 4;
    a = 0.5: n=1 1.5/11 ms = 136.4, n=2 1.75/12 ms = 145.8, n=3 1.875/13 ms = 144.2 -> 2;
    a = 0.3: n=0 1/10 ms = 100, n=1 1.3/11 ms = 118.2, n=2 1.39/12 ms = 115.8 -> 1;
    a = 0: one token whatever n, so the plain step (n = 0) -> 0.
    The self pair's draft is its target: the round accepts all it drafts."""
    e, measured = _engine_with_costs(self_pair[1], monkeypatch, acceptance)
    cfg = e.resolve(GenerationConfig(max_new_tokens=40, k_max=8, threshold=0.0, adaptive=True))
    rounds = list(e.rounds(e.prompt_ids("def add(a, b):"), cfg))
    assert measured == [list(range(1, 10))]  # the stipulated costs, q = 1..k_max+1, were used
    assert rounds[0].pos == 0 and rounds[1].pos == 1  # the prefill, then the first round
    assert (rounds[1].n, rounds[1].m) == (first, first), [(r.n, r.m) for r in rounds[1:]]


def test_adaptive_drafts_and_accepts_where_the_draft_agrees(self_pair, monkeypatch):
    """Guards against adaptive k that never drafts (a policy choosing 0, a zero-acceptance
    start): with costs where drafting pays and a draft that agrees with the target everywhere
    (the self pair), a generation drafts, accepts every candidate, and accepts many per pass.
    From the prior 0.7 the rounds draft 4, then 7 (a = 6.8 / 8 = 0.85 after 4 of 4 accepted),
    then k_max = 8 until the budget's last token: 8 passes, 51 accepted, 6.4 per pass
    (measured). The bound 5.0 leaves room for a retuned policy that still drafts; a start
    from zero acceptance measured 2.1 (7 plain steps, then probes of 1, 1, 1, 2, ...), a
    policy that never drafts 0."""
    e, _ = _engine_with_costs(self_pair[1], monkeypatch)
    ids = e.prompt_ids("def add(a, b):")
    base = e.generate(ids, GenerationConfig(max_new_tokens=60, speculative=False)).tokens
    res = e.generate(ids, GenerationConfig(max_new_tokens=60, k_max=8, threshold=0.0, adaptive=True))
    s = res.stats
    assert res.tokens == base and s.new_tokens == 60
    assert s.proposed > 0 and s.accepted == s.proposed and s.draft_calls > 0, s.as_dict()
    assert s.mean_accepted >= 5.0, (s.mean_accepted, s.proposed_hist)


def test_adaptive_ngram_proposes_wherever_fixed_k_does(self_pair, monkeypatch):
    """Guards the n-gram drafter under adaptive k: its draft is free (draft_s 0), so with a
    flat target cost the rate E(a, n) / 10 ms grows with n for every acceptance a > 0 and each
    round must allow the loop's whole cap: every round proposes and accepts exactly what the
    same generation with adaptive off does (a policy choosing 0, or starting from zero
    acceptance, proposes less). The output of this prompt repeats itself, so lookup finds
    spans: candidates proposed (35 measured) and accepted (20), no draft model call."""
    e, _ = _engine_with_costs(self_pair[1], monkeypatch)
    ids = list(range(5, 25))
    kw = dict(max_new_tokens=60, k_max=8, threshold=0.0, drafter="ngram")
    fixed = list(e.rounds(ids, e.resolve(GenerationConfig(**kw))))
    adaptive = list(e.rounds(ids, e.resolve(GenerationConfig(**kw, adaptive=True))))
    assert [(r.n, r.m) for r in adaptive] == [(r.n, r.m) for r in fixed]
    res = e.generate(ids, GenerationConfig(**kw, adaptive=True))
    assert res.tokens == e.generate(ids, GenerationConfig(max_new_tokens=60, speculative=False)).tokens
    assert res.stats.proposed >= 30 and res.stats.accepted >= 15 and res.stats.draft_calls == 0, res.stats.as_dict()
