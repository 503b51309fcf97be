"""A seed pins the output (runtime/coupling.py): seeded sampling gives the target-only tokens
of that seed with speculation on or off, at any k, threshold, drafter or adaptive k, alone
or batched, cached or cold, at any thread count.

Oracles: the target alone under the same seed (the same engine, ``speculative=False``);
the exact distribution for the race itself (chi-square on explicit probabilities). The
distribution of whole speculative runs under the coupled sampler is checked against the
exact target distribution in tests/test_sampling.py (its ``coupled`` cases). Mutations:
tests/mutations/seeded.json.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from specrt import Engine, GenerationConfig
from specrt.runtime.backends.base import ThreadConfig
from specrt.runtime.coupling import CoupledAcceptor, exponential_race, position_noise
from specrt.runtime.decode import verify
from specrt.runtime.errors import InputError

REPO = Path(__file__).resolve().parents[1]
ENGINES = REPO / "engines" / "default"
PROMPTS = [json.loads(x)["prompt"] for x in (REPO / "data" / "humaneval_dev.jsonl").read_text().splitlines()[:4]]
N = 40  # tokens per run
SAMPLED = dict(temperature=0.8)


# ---- the race and the acceptor on explicit rows -------------------------------------------
def test_the_race_at_each_position_samples_the_distribution():
    """20,000 positions: the race winner follows p exactly (chi-square p > 1e-3); an id of
    probability 0 never wins; the same (seed, position) gives the same noise, another
    position or seed other noise."""
    from scipy.stats import chisquare

    p = np.array([0.5, 0.0, 0.2, 0.15, 0.1, 0.05])
    noise, work = np.empty(6), np.empty(6)
    counts = Counter(exponential_race(p, position_noise(7, t, noise), work) for t in range(20_000))
    assert counts[1] == 0
    ids = [0, 2, 3, 4, 5]
    assert chisquare([counts[i] for i in ids], [20_000 * p[i] for i in ids])[1] > 1e-3, counts
    a = position_noise(7, 3, np.empty(6)).copy()
    assert np.array_equal(a, position_noise(7, 3, np.empty(6)))
    assert not np.array_equal(a, position_noise(7, 4, np.empty(6)))
    assert not np.array_equal(a, position_noise(8, 3, np.empty(6)))


def _logits(p: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(p).astype(np.float32)


def test_a_one_hot_candidate_is_accepted_with_the_targets_probability():
    """An n-gram candidate (one-hot draft row) is accepted with probability p(x), as in
    Leviathan et al.'s Algorithm 1, and the committed token is the target's own race winner
    at that position whatever the candidate was."""
    p = np.array([0.3, 0.6, 0.1])
    acc = CoupledAcceptor(3, 2, 1.0, seed=5)
    one_hot = _logits(np.array([0.0, 1.0, 0.0]))
    hits, n = 0, 6000
    for t in range(n):
        acc.start(t)
        x, conf = acc.draft(one_hot, 0)
        assert (x, conf) == (1, 1.0)
        m, tok = verify([x], [(0, [_logits(p), _logits(p)])], acc)
        own = CoupledAcceptor(3, 2, 1.0, seed=5)
        own.start(t)
        want = own.bonus(0, _logits(p))
        assert (x if m else tok) == want, t
        hits += m
    assert abs(hits / n - 0.6) < 4 * np.sqrt(0.24 / n), hits / n


def test_coupled_acceptance_meets_the_papers_bound():
    """A model draft: acceptance of the first candidate >= (1 - TV) / (1 + TV) (Daliri et al.
    2024), below Algorithm 1's 1 - TV (within sampling error)."""
    rng = np.random.default_rng(0)
    p, q = rng.dirichlet(np.ones(8)), rng.dirichlet(np.ones(8))
    tv = 0.5 * np.abs(p - q).sum()
    acc = CoupledAcceptor(8, 1, 1.0, seed=1)
    n, hits = 8000, 0
    for t in range(n):
        acc.start(t)
        x, _ = acc.draft(_logits(q), 0)
        hits += acc.accept(0, x, _logits(p))
    rate, err = hits / n, 4 * np.sqrt(0.25 / n)
    assert (1 - tv) / (1 + tv) - err <= rate <= 1 - tv + err, (rate, tv)


def test_sampler_is_checked():
    e = Engine(ENGINES)
    with pytest.raises(InputError, match=r"sampler='gumbel'; sampler must be one of coupled, rejection"):
        e.resolve(GenerationConfig(temperature=1.0, sampler="gumbel"))
    assert e.resolve(GenerationConfig(temperature=1.0, seed=3)).sampler == "coupled"
    assert e.resolve(GenerationConfig(temperature=1.0)).sampler == "rejection"


# ---- the embedded pair (specrt's kernels) -------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    return Engine(ENGINES)


@pytest.fixture(scope="module")
def alone(engine):
    """Target-only tokens of every (prompt, seed): the oracle."""
    return {
        (i, s): engine.generate(p, GenerationConfig(max_new_tokens=N, speculative=False, seed=s, **SAMPLED)).tokens
        for i, p in enumerate(PROMPTS)
        for s in (1, 2)
    }


SETTINGS = {
    "k1": dict(k_max=1),
    "k2 threshold0": dict(k_max=2, threshold=0.0),
    "k4": dict(k_max=4),
    "k8 threshold0": dict(k_max=8, threshold=0.0),
    "ngram": dict(drafter="ngram"),
    "hybrid": dict(drafter="hybrid", k_max=6),
    "adaptive": dict(adaptive=True),
    "top-k top-p": None,  # its own oracle below
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_speculative_equals_target_only_under_one_seed(engine, alone, name):
    kw, proposed = SETTINGS[name], 0
    for (i, s), want in alone.items():
        if kw is None:  # another warp: its own target-only run
            warp = dict(temperature=1.2, top_k=20, top_p=0.9)
            want = engine.generate(PROMPTS[i], GenerationConfig(max_new_tokens=N, speculative=False, seed=s, **warp)).tokens
            got = engine.generate(PROMPTS[i], GenerationConfig(max_new_tokens=N, k_max=4, seed=s, **warp))
        else:
            got = engine.generate(PROMPTS[i], GenerationConfig(max_new_tokens=N, seed=s, **SAMPLED, **kw))
        assert got.tokens == want, (name, i, s)
        proposed += got.stats.proposed
    assert proposed > 0  # the runs did speculate


def test_the_rejection_sampler_does_not_pin_the_output(engine, alone):
    """The oracle's reach: under Algorithm 1 the same seed gives other tokens than
    target-only on most of these runs (its draws depend on the rounds)."""
    same = [
        engine.generate(PROMPTS[i], GenerationConfig(max_new_tokens=N, seed=s, sampler="rejection", **SAMPLED)).tokens == want for (i, s), want in alone.items()
    ]
    assert same.count(False) >= len(same) // 2, same


def test_seeded_output_with_a_cache_hit_and_another_thread_count(engine, alone):
    """A prefix-cache hit (the same prompt again on a caching engine, rows reused) and a
    1-thread engine give the same seeded speculative tokens as target-only."""
    one = Engine(ENGINES, threads=ThreadConfig(intra_op=1))
    for (i, s), want in alone.items():
        cfg = GenerationConfig(max_new_tokens=N, seed=s, **SAMPLED)
        engine.generate(PROMPTS[i], cfg)
        hit = engine.generate(PROMPTS[i], cfg)
        assert hit.stats.cached_tokens > 0 and hit.tokens == want, (i, s)
        assert one.generate(PROMPTS[i], cfg).tokens == want, (i, s)


@pytest.mark.parametrize("policy", ["speculate", "batched"])
def test_seeded_output_batched_equals_alone(engine, alone, policy):
    """Six seeded requests (four speculative, two target-only) on ``--max-batch 4`` (the
    batched kernels step: each row's own rounds in one call, or under ``batched`` one token
    per seeded row per call, ``Generation.plain_ok``): each gives its target-only tokens."""
    from test_batching import Events

    from specrt.runtime.costs import BatchCosts
    from specrt.runtime.serve.batching import BatchPool
    from specrt.runtime.serve.jobs import Job

    pool = BatchPool(Engine(ENGINES), 4, policy=policy, costs=BatchCosts([0.0, 1e-3, 1e-3, 1e-3, 1e-3]))
    plain = []
    if policy == "batched":
        from specrt.runtime.generation import Generation

        push_row = Generation.push_row

        def spy(self, *a, **kw):
            plain.append(self.greedy)
            return push_row(self, *a, **kw)

        Generation.push_row = spy
    try:
        keys = list(alone)[:6]
        evs = [Events() for _ in keys]
        cfgs = [GenerationConfig(max_new_tokens=N, seed=s, speculative=j < 4, **SAMPLED) for j, (i, s) in enumerate(keys)]
        pool.submit_all([Job(ids=engine.prompt_ids(PROMPTS[i]), config=engine.resolve(c), emit=ev) for (i, s), c, ev in zip(keys, cfgs, evs)])
        for key, ev in zip(keys, evs):
            assert ev.result(120).tokens == alone[key], key
    finally:
        pool.close()
        if policy == "batched":
            Generation.push_row = push_row
    assert policy == "speculate" or plain.count(False) > 20, plain  # seeded rows took batched steps
