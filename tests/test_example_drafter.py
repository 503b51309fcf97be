"""The worked example of docs/howto/drafter.md (examples/successor_drafter.py): its proposals
on hand-made sequences (exact tokens and confidences), and greedy speculative decoding with
it on the tiny pair giving exactly the target-only greedy output while really proposing
(candidates accepted, no draft model call)."""

from __future__ import annotations

import importlib.util
from itertools import islice
from pathlib import Path

import numpy as np
import pytest

from specrt import Engine, GenerationConfig, InputError, register_drafter
from specrt.runtime.decode import Plan, adaptive_policy
from specrt.runtime.drafters import drafter_is_free, drafter_names
from specrt.runtime.speculative import GreedyAcceptor, propose

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "successor_drafter.py"


def _example():
    spec = importlib.util.spec_from_file_location("successor_drafter", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ex = _example()
NAME = ex.register()  # "successor", as the how-to does it
V = 16  # vocabulary of the hand-made sequences


def _pull(seq, n, acc=None):
    """The first ``n`` steps a fresh drafter yields over ``seq``, and its ``steps`` record."""
    d, rec = ex.SuccessorDrafter(V), []
    got = list(islice(d.steps(seq, acc or GreedyAcceptor(V, V), rec, None), n))
    assert rec == got  # every pulled step is recorded
    return got


def test_chain_of_most_frequent_successors():
    # pairs: 5->7 twice, 5->9 once, 7->5 twice, 9->5 once; the pending token is 5
    seq = [5, 7, 5, 7, 5, 9, 5]
    steps = _pull(seq, 5)
    assert [t for t, _ in steps] == [7, 5, 7, 5, 7]
    assert [c for _, c in steps] == pytest.approx([2 / 3, 1.0, 2 / 3, 1.0, 2 / 3], abs=1e-6)


def test_the_round_rules_cut_the_chain():
    seq = [5, 7, 5, 7, 5, 9, 5]

    def rnd(n_max, threshold, eos=frozenset()):
        return propose(ex.SuccessorDrafter(V).steps(seq, GreedyAcceptor(V, V), [], None), n_max, threshold, eos)[0]

    assert rnd(4, 0.5) == [7, 5, 7, 5]  # n_max
    assert rnd(4, 0.7) == []  # the first step's confidence 2/3 is below the threshold
    assert rnd(4, 0.5, frozenset({5})) == [7, 5]  # an end-of-generation id ends the round


def test_ties_unknown_tokens_and_incremental_counts():
    # 2 was followed once by 4 and once by 3: the argmax takes the lowest id, confidence 1/2
    assert _pull([2, 4, 2, 3, 2], 3) == [(3, pytest.approx(0.5)), (2, pytest.approx(1.0)), (3, pytest.approx(0.5))]
    assert _pull([5, 7, 5, 3], 3) == []  # 3 was never followed by anything: no proposal
    rng = np.random.default_rng(0)
    seq = rng.integers(0, V, size=50).tolist()
    whole, step = ex.SuccessorDrafter(V), ex.SuccessorDrafter(V)
    whole.update(seq)
    for n in range(1, len(seq) + 1):  # as the sequence grows round by round
        step.update(seq[:n])
    assert step.counts == whole.counts
    assert sum(sum(a.values()) for a in whole.counts.values()) == len(seq) - 1


def _prompts(engine):
    """Prompts with repeats (successors to learn) and one plain random prompt."""
    rng = np.random.default_rng(5)
    v = engine.manifest.vocab_size
    span = rng.integers(1, v, size=8).tolist()
    return ["def add(a, b):\n    return a + b\n\ndef", span + rng.integers(1, v, size=4).tolist() + span, rng.integers(1, v, size=20).tolist()]


def test_greedy_output_equals_target_only_and_the_drafter_proposes(tiny_pair):
    e = Engine(tiny_pair[2])
    proposed = accepted = 0
    for prompt in _prompts(e):
        base = e.generate(prompt, GenerationConfig(max_new_tokens=40, speculative=False)).tokens  # the oracle: the target alone
        for k, threshold in ((1, 0.0), (4, 0.0), (8, 0.3)):
            res = e.generate(prompt, GenerationConfig(max_new_tokens=40, k_max=k, threshold=threshold, drafter=NAME))
            assert res.tokens == base, (prompt, k, threshold)
            assert res.stats.draft_calls == 0  # the registered drafter ran: the draft model never did
            proposed += res.stats.proposed
            accepted += res.stats.accepted
    assert accepted > 0, (proposed, accepted)  # it really drafts, and some drafts are right
    assert accepted < proposed  # and some are wrong: the rejection path ran too
    # the built-in drafter still gives the same output after the registered one's runs
    first = _prompts(e)[0]
    assert (
        e.generate(first, GenerationConfig(max_new_tokens=40, k_max=4)).tokens
        == e.generate(first, GenerationConfig(max_new_tokens=40, speculative=False)).tokens
    )


def test_sampled_decoding_runs_the_drafter_and_is_seeded(tiny_pair):
    """Under sampling the acceptor draws each candidate from the drafter's row (q = the
    successor frequencies); the same seed gives the same tokens."""
    e = Engine(tiny_pair[2])
    cfg = GenerationConfig(max_new_tokens=30, k_max=4, threshold=0.0, temperature=0.8, seed=3, drafter=NAME)
    prompt = _prompts(e)[1]
    a, b = e.generate(prompt, cfg), e.generate(prompt, cfg)
    assert a.tokens == b.tokens and len(a.tokens) == 30
    assert a.stats.proposed > 0 and a.stats.draft_calls == 0


def test_registration_rules(tiny_pair):
    """A registered drafter is a name like the built-ins: listed, priced as free by adaptive
    k, refused when unknown; a built-in cannot be replaced."""
    assert drafter_names()[:3] == ("model", "ngram", "hybrid") and NAME in drafter_names()
    assert drafter_is_free(NAME) and drafter_is_free("ngram") and not drafter_is_free("model")
    with pytest.raises(ValueError, match="other than the built-ins model, ngram, hybrid"):
        register_drafter("model", lambda draft, vocab, k_max, kv: None)
    with pytest.raises(ValueError, match="make must be callable"):
        register_drafter("other", 3)
    e = Engine(tiny_pair[2])
    with pytest.raises(InputError, match=r"drafter='nope'; drafter must be one of model, ngram, hybrid, suffix, suffix-model, successor"):
        e.generate("x", GenerationConfig(max_new_tokens=4, drafter="nope"))
    # adaptive k prices a step of the registered (free) drafter at 0 s, a draft-model step at its cost
    costs = ((0.01, 0.011, 0.012), 0.004, 0.7)
    plan = dict(k_max=2, threshold=0.0, budget=8, eos=frozenset(), max_ctx=64, adaptive=costs)
    assert adaptive_policy(Plan(**plan, drafter=NAME)).draft_s == 0.0
    assert adaptive_policy(Plan(**plan, drafter="model")).draft_s == 0.004
