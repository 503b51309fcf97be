"""Drafters (runtime/drafters.py): the n-gram index against hand-computed continuations; greedy
output with ``ngram`` and ``hybrid`` equal to target-only on tiny pairs (standard fp32 and
int4 builder graphs), and the n-gram drafter really proposing; sampled output with the
one-hot n-gram draft following the target's exact distribution."""

from __future__ import annotations

import numpy as np
import pytest

from specrt import Engine, GenerationConfig
from specrt.runtime.drafters import NgramIndex
from specrt.runtime.errors import InputError


def test_ngram_index_latest_longest_match():
    seq = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    ix = NgramIndex(2, 3)
    ix.update(seq)
    # suffix (1, 2, 3) occurred at [4, 7) (followed by 7, 5, 1) and [0, 3): the latest wins
    assert ix.continuation(seq, 3) == [7, 5, 1]
    assert ix.continuation(seq, 10) == [7, 5, 1, 2, 3]  # up to the end of the sequence
    seq2 = seq + [4]
    ix.update(seq2)
    assert ix.continuation(seq2, 3) == []  # (3, 4) never occurred before
    seq3 = [5, 6, 7, 5, 6]
    ix3 = NgramIndex(2, 4)
    ix3.update(seq3)
    assert ix3.continuation(seq3, 2) == [7, 5]  # the 2-gram (5, 6) when no longer suffix matched
    with pytest.raises(ValueError):
        NgramIndex(3, 2)


def test_ngram_index_is_incremental():
    """Updating token by token indexes exactly what one update over the whole sequence does."""
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 6, size=60).tolist()
    whole, step = NgramIndex(2, 4), NgramIndex(2, 4)
    whole.update(seq)
    for n in range(1, len(seq) + 1):
        step.update(seq[:n])
    assert step.table == whole.table


def _repetitive_prompts(engine):
    """Prompts with repeated spans (where prompt lookup has something to find), and plain ones."""
    rng = np.random.default_rng(5)
    v = engine.manifest.vocab_size
    out = []
    for n in (6, 11):
        span = rng.integers(1, v, size=n).tolist()
        out.append(span + rng.integers(1, v, size=5).tolist() + span[: n - 2])
    out.append(rng.integers(1, v, size=30).tolist())
    return out


@pytest.mark.parametrize("pair", ["tiny_pair", "int4_pair"])
@pytest.mark.parametrize("drafter", ["ngram", "hybrid", "suffix", "suffix-model"])
def test_greedy_output_equals_target_only(request, pair, drafter):
    e = Engine(request.getfixturevalue(pair)[2])
    proposed = 0
    for ids in _repetitive_prompts(e):
        base = e.generate(ids, GenerationConfig(max_new_tokens=40, speculative=False)).tokens
        for k in (1, 4):
            res = e.generate(ids, GenerationConfig(max_new_tokens=40, k_max=k, threshold=0.0, drafter=drafter))
            assert res.tokens == base, (drafter, k)
            proposed += res.stats.proposed
    assert proposed > 0


def test_ngram_drafter_calls_no_model_and_hybrid_calls_both(tiny_pair):
    e = Engine(tiny_pair[2])
    found = False
    for ids in _repetitive_prompts(e):  # outputs of a random model loop, so lookup finds spans
        ng = e.generate(ids, GenerationConfig(max_new_tokens=60, k_max=4, drafter="ngram"))
        assert ng.stats.draft_calls == 0
        if ng.stats.proposed == 0:
            continue
        found = True
        hy = e.generate(ids, GenerationConfig(max_new_tokens=60, k_max=4, drafter="hybrid"))
        md = e.generate(ids, GenerationConfig(max_new_tokens=60, k_max=4, drafter="model"))
        assert 0 < hy.stats.draft_calls < md.stats.draft_calls
    assert found


def test_bad_drafter_is_one_line(tiny_pair):
    e = Engine(tiny_pair[2])
    with pytest.raises(InputError, match=r"drafter='nope'; drafter must be one of model, ngram, hybrid") as ei:
        e.generate("x", GenerationConfig(drafter="nope"))
    assert ei.value.param == "drafter"


def test_sampled_ngram_follows_the_target_distribution(tmp_path_factory):
    """A prompt whose suffix repeats, so the first round proposes from the n-gram (a one-hot
    draft): the first three tokens over 20,000 seeds against the exact target distribution."""
    pytest.importorskip("scipy")
    from test_sampling import build_small_pair, collect, exact_first_tokens, goodness_of_fit

    e = Engine(build_small_pair(tmp_path_factory.mktemp("ngram_sampling")))
    prompt = [15, 9, 15, 9, 15]  # after a first token 9, the suffix (15, 9) occurred: the round proposes [15, 9, 15]
    kw = dict(temperature=1.0)
    proposing = sum(e.generate(prompt, GenerationConfig(max_new_tokens=5, k_max=3, drafter="ngram", seed=s, **kw)).stats.proposed > 0 for s in range(200))
    assert proposing >= 20, proposing  # the n-gram draft is really exercised
    spec = collect(e, prompt, GenerationConfig(max_new_tokens=5, k_max=3, drafter="ngram", **kw), range(20_000), 3)
    tv, p = goodness_of_fit(spec, exact_first_tokens(e, prompt, 3, kw))
    # chi-square against the exact distribution, as test_sampling's 3-token cases (a TV over
    # this many rare 3-token outcomes has a noise floor near 0.02: target-only itself gave 0.027)
    assert p > 1e-3, (tv, p)


def test_bench_reports_the_fastest_baseline_and_drafters(tiny_pair, tmp_path):
    """``specrt bench`` runs target-only at its fastest width (1-row steps) beside the exact
    one by default, and one row per --drafter / --adaptive."""
    import json

    from click.testing import CliRunner

    from specrt.cli import cli

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f(x):"}\n')
    out = tmp_path / "b.json"
    args = ["bench", "--engines", str(tiny_pair[2]), "--prompts", str(prompts), "--max-new-tokens", "8", "--k-max", "2", "--threshold", "0"]
    r = CliRunner().invoke(cli, args + ["--drafter", "model", "--drafter", "ngram", "--adaptive", "on", "--out", str(out)])
    assert r.exit_code == 0, r.output
    labels = [row["label"] for row in json.loads(out.read_text())["rows"]]
    assert labels == ["target-only", "target-only 1-row", "spec k=2 th=0 model adaptive", "spec k=2 th=0 ngram adaptive"]
