"""The suffix drafter (runtime/suffix.py, runtime/drafters.py ``suffix``): the index's counts
and proposals against hand-computed ones, incremental and shared indexes equal to ones built
over the final sequences, and on the embedded pair: output == target-only (greedy and
seeded), whatever the shared index holds (another client's text included), and a repeated
request drafting from an earlier one's output."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from specrt import Engine, GenerationConfig
from specrt.runtime import suffix
from specrt.runtime.suffix import SharedSuffixIndex, SuffixIndex, expected_accepted, propose

REPO = Path(__file__).resolve().parents[1]
ENGINES = REPO / "engines" / "default"


def test_the_most_frequent_continuation_of_the_longest_context_then_the_latest():
    ix = SuffixIndex(2, 3)
    seq = [1, 2, 5, 1, 2, 5, 1, 2, 6, 9, 1, 2]
    ix.add(seq)
    # (9, 1, 2) never continued; (1, 2) continued by 5 twice and 6 once
    assert ix.next_token(seq) == (5, pytest.approx(2 / 3), 2)
    ix2 = SuffixIndex(2, 3)
    ix2.add([1, 2, 5, 1, 2, 6, 1, 2])  # a tie: the latest (6) wins
    assert ix2.next_token([1, 2])[0] == 6
    assert ix.next_token([4, 4]) is None
    longest = SuffixIndex(2, 3)
    longest.add([7, 1, 2, 5, 8, 1, 2, 6, 8, 1, 2, 6, 7, 1, 2])
    # (1, 2) alone says 6 (twice against once); the longer (7, 1, 2) says 5
    assert longest.next_token([7, 1, 2]) == (5, 1.0, 3) and longest.next_token([9, 1, 2])[0] == 6
    with pytest.raises(ValueError):
        SuffixIndex(3, 2)


def test_a_proposal_stops_where_the_path_score_falls_below_the_threshold():
    ix = SuffixIndex(2, 4)
    span = [10, 11, 12, 13, 14, 15]
    ix.add(span + [0] + span)  # every context of the span continues one way: a long copy
    toks, scores = propose(ix, [10, 11], 8)
    assert toks == [12, 13, 14, 15, 0, 10, 11, 12] and scores == [1.0] * 8
    assert expected_accepted(scores) == 8.0
    branch = SuffixIndex(2, 2)
    branch.add([1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2, 6, 3, 7])  # (1, 2) -> 3, 4, 5, 6 once each: 0.25
    assert propose(branch, [1, 2], 4, min_score=0.3) == ([], [])
    toks, scores = propose(branch, [1, 2], 4, min_score=0.2)
    assert toks == [6, 3, 7] and scores == [0.25] * 3  # the latest of the ties, then (2, 6) -> 3 and (6, 3) -> 7 for sure; (3, 7) never continued
    assert propose(branch, [1, 2], 2, min_score=0.2)[0] == [6, 3]


def test_incremental_and_shared_indexes_equal_one_built_over_the_final_sequences():
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 5, 80).tolist(), rng.integers(0, 5, 60).tolist()
    whole = SuffixIndex()
    whole.add(a)
    step = SuffixIndex()
    for n in range(1, len(a) + 1):
        step.add(a[:n], n - 1)
    assert {k: {t: c[0] for t, c in v.items()} for k, v in step.counts.items()} == {k: {t: c[0] for t, c in v.items()} for k, v in whole.counts.items()}
    shared = SharedSuffixIndex(max_tokens=1000)
    shared.extend(1, a[:30])
    shared.extend(1, a[:25] + [9, 9, 9])  # diverged (the divergent tokens are taken back out)
    shared.extend(1, a)
    shared.extend(2, b)
    both = SuffixIndex()
    both.add(a)
    both.add(b)

    def plain(ix):
        return {k: {t: c[0] for t, c in v.items()} for k, v in ix.counts.items()}

    assert plain(shared.index) == plain(both) and shared.tokens == 140
    capped = SharedSuffixIndex(max_tokens=100)
    capped.extend(1, a)
    capped.extend(2, b)  # 140 > 100: the oldest request (a) is taken out
    only_b = SuffixIndex()
    only_b.add(b)
    assert plain(capped.index) == plain(only_b) and capped.tokens == 60


class FakeDraft:
    """A draft model's stand-in where a drafter only needs its widths (never called)."""

    vocab, max_q = 8, 4


BEHIND_COSTS = ([0.03, 0.031, 0.032, 0.033, 0.034], 0.006, 0.9)  # the model: well over target-only


def behind_drafter(draft, costs=BEHIND_COSTS, **kw):
    """A SuffixModelDrafter over ``draft`` with no suffix proposal, whose model makes one call
    a step (8 steps a round, the first feeding the catch-up) and records in ``d.pulled`` the
    sequence length of each round it ran."""
    from specrt.runtime.drafters import SuffixModelDrafter

    d = SuffixModelDrafter(draft, 8, 4, costs=costs, **kw)
    d.scored_proposal = lambda seq, acc: ([], [])
    d.pulled = []

    def model_steps(seq, acc, steps, pre):
        d.pulled.append(len(seq))
        for _ in range(8):
            d.model.model_calls += 1
            yield 1, 0.9

    d.model.steps = model_steps
    return d


def catch_up_need(d, n_prompt: int, feed_s: float) -> int:
    """Tokens generated after which the catch-up of a prompt of ``n_prompt`` tokens pays at
    ``feed_s`` seconds a fed token: saving * g > (n_prompt - 5 + g) * feed_s."""
    k = d.costs
    saving = k.target_s[0] - 1.0 / k.rate(k.best(4))
    return int((n_prompt - 5) * feed_s / (saving - feed_s)) + 1


@pytest.fixture(scope="module")
def eng():
    return Engine(ENGINES)


PROMPTS = [json.loads(x)["prompt"] for x in (REPO / "data" / "humaneval_dev.jsonl").read_text().splitlines()[:3]]


@pytest.fixture()
def fresh_shared(monkeypatch):
    """A new process-wide shared index for the test (the test's requests only)."""
    ix = SharedSuffixIndex()
    monkeypatch.setattr(suffix, "_SHARED", ix)
    return ix


def test_suffix_output_equals_target_only_and_a_repeat_drafts_from_the_first(eng, fresh_shared):
    for p in PROMPTS:
        base = eng.generate(p, GenerationConfig(max_new_tokens=48, speculative=False))
        runs = [eng.generate(p, GenerationConfig(max_new_tokens=48, drafter="suffix", k_max=k, threshold=0.0)) for k in (4, 1, 4)]
        assert all(r.tokens == base.tokens for r in runs), p[:40]
        assert runs[0].stats.draft_calls == 0
        # the third run finds the first two's output in the shared index
        assert runs[2].stats.accepted > runs[0].stats.accepted and runs[2].stats.accepted >= 0.7 * len(base.tokens), (runs[0].stats, runs[2].stats)
    assert fresh_shared.tokens > 0
    sd = [GenerationConfig(max_new_tokens=32, temperature=0.8, seed=s) for s in (1, 2)]
    for cfg in sd:  # seeded (coupled): the target-only sample whatever the drafts
        want = eng.generate(PROMPTS[0], GenerationConfig(**{**cfg.__dict__, "speculative": False})).tokens
        assert eng.generate(PROMPTS[0], GenerationConfig(**{**cfg.__dict__, "drafter": "suffix"})).tokens == want


def test_another_clients_text_in_the_shared_index_changes_no_output(eng, fresh_shared):
    """The shared index filled with sequences that share the prompt and continue otherwise
    (another client's text): the drafts follow them, the output stays the target's."""
    p = PROMPTS[1]
    ids = eng.prompt_ids(p)
    base = eng.generate(p, GenerationConfig(max_new_tokens=40, speculative=False)).tokens
    rng = np.random.default_rng(3)
    for i in range(3):
        fresh_shared.extend(10_000 + i, ids + rng.integers(1, eng.manifest.vocab_size, 40).tolist())
    r = eng.generate(p, GenerationConfig(max_new_tokens=40, drafter="suffix", k_max=4, threshold=0.0))
    assert r.tokens == base and r.stats.proposed > r.stats.accepted  # it drafted the other text, rejected


def test_suffix_pays_compares_expected_tokens_per_second():
    """(1 + sum of path scores) / the verification call's seconds against the model's rate."""
    from specrt.runtime.drafters import suffix_pays

    t = [0.030, 0.031, 0.032, 0.034, 0.036]  # seconds of a target call, q = 1..5
    # 3 candidates at scores 0.9, 0.8, 0.7: 3.4 tokens / 0.034 s = 100 tok/s
    assert suffix_pays([0.9, 0.8, 0.7], t, 99.0) and not suffix_pays([0.9, 0.8, 0.7], t, 101.0)
    # longer than the widest measured call: priced at the widest (4 candidates, 0.036 s)
    assert suffix_pays([1.0] * 9, t, 5.0 / 0.036 - 1e-6) and not suffix_pays([1.0] * 9, t, 5.0 / 0.036 + 1e-6)


COSTS = ([0.03, 0.031, 0.032, 0.033, 0.034], 0.006, 0.8)  # fixed (target_s by width, draft_s, prior): no timing in the tests


def test_suffix_model_takes_the_suffix_when_it_pays_and_the_model_otherwise(eng, fresh_shared, monkeypatch):
    """Output == target-only with costs (fixed, in place of the engine's measured ones),
    without (suffix whenever there is one), greedy and seeded; a repeat of a prompt drafts
    from the suffix index with fewer draft-model calls than the first run, which drafts with
    the model."""
    from specrt.runtime.drafters import SuffixModelDrafter, drafter_is_free, make_drafter

    monkeypatch.setattr(eng, "_adaptive", COSTS)

    assert drafter_is_free("suffix-model")  # adaptive k leaves the model's length to the drafter
    d = make_drafter("suffix-model", eng.draft, eng.draft.vocab, 4, costs=COSTS)
    assert isinstance(d, SuffixModelDrafter) and d.costs is not None and d.draft is eng.draft
    assert make_drafter("suffix-model", eng.draft, eng.draft.vocab, 4).costs is None
    for p in PROMPTS[:2]:
        base = eng.generate(p, GenerationConfig(max_new_tokens=48, speculative=False))
        runs = [eng.generate(p, GenerationConfig(max_new_tokens=48, drafter="suffix-model", k_max=4, adaptive=a)) for a in (True, True, False)]
        assert all(r.tokens == base.tokens for r in runs), p[:40]
        assert runs[0].stats.draft_calls > 0 and runs[1].stats.draft_calls < runs[0].stats.draft_calls, (runs[0].stats, runs[1].stats)
    cfg = GenerationConfig(max_new_tokens=32, temperature=0.8, seed=5)
    want = eng.generate(PROMPTS[0], GenerationConfig(**{**cfg.__dict__, "speculative": False})).tokens
    assert eng.generate(PROMPTS[0], GenerationConfig(**{**cfg.__dict__, "drafter": "suffix-model"})).tokens == want


def test_suffix_model_prices_the_model_rounds_by_their_own_acceptance():
    """observe() updates the model's acceptance only after a model round; with the model
    accepting everything its rate beats a weak suffix proposal, after rejections it does not."""
    from specrt.runtime.drafters import SuffixModelDrafter, suffix_pays

    d = SuffixModelDrafter(FakeDraft(), 8, 4, costs=([0.03, 0.031, 0.032, 0.033, 0.034], 0.006, 0.5))
    d.model_round = False
    d.observe(4, 0)
    assert d.costs.rejected == 0.0  # a suffix round tells nothing about the model
    d.model_round = True
    for _ in range(20):
        d.observe(4, 4)
    good = d.costs.rate(d.costs.choose(4))
    assert not suffix_pays([0.5], d.costs.target_s, good)
    for _ in range(20):
        d.observe(4, 0)
    bad = d.costs.rate(d.costs.choose(4)) if d.costs.choose(4) else 1 / 0.03
    assert bad < good and suffix_pays([0.5], d.costs.target_s, bad)


def test_the_loop_reports_each_round_and_model_rounds_draft_the_models_length(eng, fresh_shared, monkeypatch):
    """end_round calls observe() once a round with its counts; a model round drafts at most
    the length the model's own acceptance chose over its own rounds: with a prior of 0 that
    is 0, or 1 on a probe round (the engine's k_max would allow 4 at threshold 0)."""
    from specrt.runtime.drafters import SuffixModelDrafter

    seen = []
    real = SuffixModelDrafter.observe

    def record(self, proposed, accepted):
        seen.append((self.model_round, proposed, accepted))
        real(self, proposed, accepted)

    monkeypatch.setattr(SuffixModelDrafter, "observe", record)
    monkeypatch.setattr(SuffixModelDrafter, "feed_s", lambda self: 0.0)  # catch-ups free: the model's own rule alone
    monkeypatch.setattr(eng, "_adaptive", (COSTS[0], COSTS[1], 0.0))
    r = eng.generate(PROMPTS[2], GenerationConfig(max_new_tokens=48, drafter="suffix-model", k_max=4, threshold=0.0, adaptive=True))
    assert r.tokens == eng.generate(PROMPTS[2], GenerationConfig(max_new_tokens=48, speculative=False)).tokens
    assert seen and r.stats.proposed > 0
    assert sum(p for m, p, _ in seen) == r.stats.proposed and sum(a for _, _, a in seen) == r.stats.accepted
    model = [p for m, p, _ in seen if m]
    assert model and max(model) <= 1, seen  # 0, or 1 on the model's own probe


def test_suffix_rounds_leave_the_models_probe_count_alone():
    """The model's probe (one candidate after probe_every of its own rounds at 0) counts only
    model rounds: suffix rounds look at the model's best length (AdaptiveK.best, pure) and do
    not advance it, so the first model round after many suffix rounds is not a probe."""
    from specrt.runtime.adaptive import AdaptiveK
    from specrt.runtime.drafters import SuffixModelDrafter

    k = AdaptiveK([0.03, 0.031, 0.032], 0.006, prior=0.0, probe_every=3)
    assert [k.best(2) for _ in range(5)] == [0] * 5 and k.idle == 0
    assert [k.choose(2) for _ in range(6)] == [0, 0, 1, 0, 0, 1]

    d = SuffixModelDrafter(FakeDraft(), 8, 4, costs=([0.03, 0.031, 0.032, 0.033, 0.034], 0.006, 0.0))
    d.scored_proposal = lambda seq, acc: ([3, 4], [0.99, 0.99])  # a strong suffix proposal
    d._one_hot = lambda toks, acc, steps: iter(())
    for _ in range(20):
        d.steps([1, 2, 3], None, [], None)
        assert not d.model_round
    assert d.costs.idle == 0


def test_catch_up_pays_when_the_saving_over_the_horizon_covers_it():
    """The rent-or-buy rule: (1/other - 1/model) * horizon > catch-up, never when the model
    is not faster than the alternative."""
    from specrt.runtime.drafters import catch_up_pays

    # model 40 tok/s against 25: 0.015 s saved a token
    assert catch_up_pays(0.4, 40.0, 25.0, 32) and not catch_up_pays(0.5, 40.0, 25.0, 32)
    assert catch_up_pays(0.5, 40.0, 25.0, 34)
    assert not catch_up_pays(0.1, 25.0, 25.0, 10_000) and not catch_up_pays(0.1, 20.0, 25.0, 10_000)
    assert catch_up_pays(0.0, 20.0, 25.0, 0)  # nothing to pay


def test_a_draft_model_far_behind_waits_until_its_catch_up_pays():
    """A model round that would first feed many unseen tokens is replaced by the suffix
    proposal or a target-only step until the horizon (tokens generated so far) makes the
    catch-up worth it; a model that is current drafts at once. The measured feed cost is
    kept per draft model."""
    from specrt.runtime import drafters as D

    draft = FakeDraft()
    D._FEED_S[draft] = 0.01  # 10 ms a fed token
    d = behind_drafter(draft)
    prompt = [0] * 1000
    assert list(d.steps(prompt, None, [], None)) == [] and not d.model_round  # 995 behind: a target-only step
    # g generated tokens pay when saving * g > (995 + g) * 0.01 (the catch-up grows with g too)
    need = catch_up_need(d, len(prompt), 0.01)
    assert need > D.HORIZON_MIN
    assert list(d.steps(prompt + [1] * (need - 10), None, [], None)) == [] and not d.model_round
    out = list(d.steps(prompt + [1] * (need + 10), None, [], None))
    assert d.model_round and len(out) >= 1 and d.pulled == [len(prompt) + need + 10]
    assert D._FEED_S[draft] < 0.01  # measured on that catch-up (the fake feeds at once)
    d2 = D.SuffixModelDrafter(draft, 8, 4, kv=998, costs=BEHIND_COSTS)  # current: its KV holds the prompt
    d2.scored_proposal = lambda seq, acc: ([], [])
    d2.model.steps = lambda seq, acc, steps, pre: iter([(1, 0.9)] * 8)
    assert list(d2.steps(prompt, None, [], None)) and d2.model_round


def test_a_model_at_length_0_far_behind_still_probes():
    """A model whose best length is 0 is not priced for its catch-up: its rounds draft
    nothing, and every probe_every-th of them probes one candidate (feeding what it has not
    seen), so its acceptance can recover; a forced first step (no model call) measures no
    feed cost."""
    from specrt.runtime import drafters as D

    draft = FakeDraft()
    D._FEED_S[draft] = 0.01
    d = D.SuffixModelDrafter(draft, 8, 4, costs=([0.03, 0.031, 0.032, 0.033, 0.034], 0.006, 0.0))
    d.scored_proposal = lambda seq, acc: ([], [])
    d.model.steps = lambda seq, acc, steps, pre: iter([(1, 0.9)] * 8)  # calls nothing: as a forced step
    prompt = [0] * 1000
    got = [len(list(d.steps(prompt, None, [], None))) for _ in range(d.costs.probe_every)]
    assert got == [0] * (d.costs.probe_every - 1) + [1] and d.model_round
    assert D._FEED_S[draft] == 0.01  # no model call in that step: the measured cost is kept


def test_the_catch_up_horizon_ends_at_the_requests_last_token():
    """The horizon is the tokens generated so far (at least HORIZON_MIN) but never more than
    remain before ``end`` (prompt + budget, within the context): near a request's end a
    catch-up that would pay over a longer run waits, and a drafter made by the decode loop
    knows its end."""
    from specrt.runtime import drafters as D

    draft = FakeDraft()
    D._FEED_S[draft] = 0.01
    free = D.SuffixModelDrafter(draft, 8, 4, costs=BEHIND_COSTS)
    free.start = 100
    assert [free.horizon(n) for n in (100, 131, 133, 1000)] == [32, 32, 33, 900]
    ends = behind_drafter(draft, end=1050)
    ends.start = 100
    assert [ends.horizon(n) for n in (100, 1000, 1040, 1050, 1060)] == [32, 50, 10, 0, 0]
    # the scenario of the test above: enough generated to pay, but too few tokens left
    ends.start = None
    prompt = [0] * 1000
    need = catch_up_need(ends, len(prompt), 0.01)
    ends.end = len(prompt) + need + 20  # 10 tokens left at need + 10 generated
    assert list(ends.steps(prompt, None, [], None)) == []
    assert list(ends.steps(prompt + [1] * (need + 10), None, [], None)) == [] and not ends.model_round and not ends.pulled
    assert D.make_drafter("suffix-model", draft, 8, 4, costs=BEHIND_COSTS, end=77).end == 77


def test_the_decode_loop_tells_the_drafter_where_the_request_ends(eng, fresh_shared, monkeypatch):
    """The drafter of Engine.generate, Engine.start (the server's) and Engine.rounds (the
    one-shot loop) gets ``end`` = prompt + max_new_tokens (the context is longer), the length
    its catch-up horizon stops at."""
    from specrt.runtime.drafters import SuffixModelDrafter

    ends = []
    real = SuffixModelDrafter.observe

    def record(self, proposed, accepted):
        ends.append(self.end)
        real(self, proposed, accepted)

    monkeypatch.setattr(SuffixModelDrafter, "observe", record)
    monkeypatch.setattr(eng, "_adaptive", (COSTS[0], COSTS[1], 0.5))
    r = eng.generate(PROMPTS[1], GenerationConfig(max_new_tokens=24, drafter="suffix-model", k_max=4, threshold=0.0, adaptive=True))
    assert ends and set(ends) == {r.stats.prompt_tokens + 24}
    # the server's path (Engine.start: a Generation) makes its drafter with the same end
    ids = eng.prompt_ids(PROMPTS[1])
    g = eng.start(ids, eng.resolve(GenerationConfig(max_new_tokens=24, drafter="suffix-model", k_max=4, threshold=0.0, adaptive=True)))
    assert isinstance(g.drafter, SuffixModelDrafter) and g.drafter.end == len(ids) + 24
    ends.clear()  # and the one-shot loop (Engine.rounds: decode.decode)
    assert list(eng.rounds(ids, eng.resolve(GenerationConfig(max_new_tokens=24, drafter="suffix-model", k_max=4, threshold=0.0, adaptive=True))))
    assert ends and set(ends) == {len(ids) + 24}
