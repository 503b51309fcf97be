"""Prefix reuse (runtime/prefix.py): a cache hit gives the output of a cold run, token for
token, greedy and seeded sampling, speculative and target-only, every drafter.

The oracle is the same request on a cold Engine (``prefix_cache=False``). On the shipped
engines a row's bits rarely move an argmax, so the rule is also proven on a toy model whose
rows depend on the width of the call that computed them, as onnxruntime's kernels do (a
1-row call and a call wider than the measured widths round otherwise): there a cache hit
that reused a row a cold run computes in another call changes the output
(:func:`test_misaligned_reuse_changes_the_output`, the mutation the rule guards against).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from specrt import Engine, GenerationConfig
from specrt.runtime import decode
from specrt.runtime.chunks import chunk_bounds
from specrt.runtime.prefix import KVPrefix, aligned_rows, common_prefix, reuse_draft, reuse_target

REPO = Path(__file__).resolve().parents[1]
ENGINES = REPO / "engines" / "default"
PROMPTS = REPO / "data" / "humaneval_dev.jsonl"

CONFIGS = {
    "greedy": dict(),
    "target-only": dict(speculative=False),
    "sampled": dict(temperature=0.8, seed=7),
    "sampled-target-only": dict(temperature=0.8, seed=7, speculative=False),
    "hybrid": dict(drafter="hybrid"),
    "ngram-sampled": dict(drafter="ngram", temperature=0.7, seed=3),
}


# ---- the rule, as pure functions --------------------------------------------------------
def test_aligned_rows_counts_the_leading_full_aligned_chunks():
    assert aligned_rows([(0, 256), (256, 512), (512, 600)], 256) == 512
    assert aligned_rows(chunk_bounds(700, 256, 2, 9), 256) == 512  # [0,256) [256,512) [512,691) [691,700)
    assert aligned_rows(chunk_bounds(300, 256, 2, 9), 256) == 256
    assert aligned_rows(chunk_bounds(200, 256, 2, 9), 256) == 0
    assert aligned_rows([(0, 255), (255, 510)], 255) == 510
    assert aligned_rows([(0, 100), (100, 356)], 256) == 0  # full width but not at a multiple


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([5], [6]) == 0


def test_reuse_stays_within_the_cold_layout_and_the_common_prefix():
    toks = tuple(range(2000))
    rec = KVPrefix(toks[:768], 768, 512)
    seq = list(toks[:1000])
    chunks = chunk_bounds(len(seq), 256, 2, 9)
    assert reuse_target(rec, seq, chunks, 256) == 768
    assert reuse_draft(rec, seq, 256) == 512
    # a change at position 600: only the aligned chunks before it
    seq2 = seq[:600] + [9999] + seq[601:]
    assert reuse_target(rec, seq2, chunks, 256) == 512
    # the same prompt again (700 tokens): its cold layout is aligned up to 512 only
    assert reuse_target(rec, seq[:700], chunk_bounds(700, 256, 2, 9), 256) == 512
    # the last chunk always runs, even when it is a full aligned one (no tail limit)
    assert reuse_target(KVPrefix(toks[:512], 512, 0), seq[:512], chunk_bounds(512, 256), 256) == 256
    assert reuse_target(None, seq, chunks, 256) == 0 and reuse_draft(None, seq, 256) == 0


def test_trimmed_record_keeps_aligned_rows_only():
    rec = KVPrefix(tuple(range(1024)), 1024, 768)
    cut = rec.trimmed(600, 256, 256)
    assert (cut.target_rows, cut.draft_rows, len(cut.tokens)) == (512, 512, 512)
    assert rec.trimmed(100, 256, 256) is None
    assert rec.size == 1024 and cut.size == 512


# ---- a toy model whose rows depend on the call's width --------------------------------
class WidthSensitive:
    """A :class:`~specrt.runtime.backends.base.Model` whose KV row ``p`` is a hash chain over
    the tokens up to ``p`` that also mixes in the width of the call that wrote it, unless the
    width is in ``[exact_lo, exact_hi]`` (the widths an export measures bit-identical). Its
    logits: ``bias[token] + chain_weight * table[row % 251]`` (the bias table makes a draft
    with the same bias agree with the target often)."""

    def __init__(self, vocab: int, max_q: int, max_ctx: int, seed: int, exact: tuple[int, int], chain_weight: float):
        rng = np.random.default_rng(seed)
        self.vocab, self.max_q, self.max_ctx = vocab, max_q, max_ctx
        self.exact, self.seed = exact, seed
        self.bias = np.random.default_rng(0).standard_normal((vocab, vocab // 16)).astype(np.float32)
        self.table = (chain_weight * rng.standard_normal((251, vocab))).astype(np.float32)
        self.rows = np.zeros(max_ctx, np.uint64)
        self.out = np.empty((max_q, vocab), np.float32)

    def run(self, tokens, start):
        q = len(tokens)
        assert 1 <= q <= self.max_q and start + q <= self.max_ctx
        width = 0 if self.exact[0] <= q <= self.exact[1] else q
        h = int(self.rows[start - 1]) if start else self.seed
        for i, t in enumerate(tokens):
            h = (h * 6364136223846793005 + int(t) * 1442695040888963407 + (start + i) + width * 40503) % (1 << 61)
            self.rows[start + i] = h
            # the bias row of the token (tiled to the vocabulary) plus the chain's row
            self.out[i] = np.resize(self.bias[int(t) % self.vocab], self.vocab) + self.table[h % 251]
        return self.out[:q]

    def fork(self):
        raise NotImplementedError

    def close(self):
        pass


def toy_engine(cache: bool) -> Engine:
    """The embedded engine's manifest, tokenizer and plan around two toy models (the draft
    agrees with the target where the chains matter little)."""
    e = Engine(ENGINES, prefix_cache=cache)
    m = e.manifest
    exact = (m.min_q(), m.k_max + 1)
    e.target = WidthSensitive(m.vocab_size, e.target.max_q, m.max_ctx, 11, exact, 0.35)
    e.draft = WidthSensitive(m.vocab_size, e.draft.max_q, m.max_ctx, 12, exact, 0.35)
    return e


def conversation(vocab: int, n_turns: int = 4, first: int = 300, more: int = 140) -> tuple[list[int], list[list[int]]]:
    """Token ids of a conversation: the first prompt, and what each later turn adds after the
    previous output (a user message, a tool result)."""
    rng = np.random.default_rng(5)
    return [int(x) for x in rng.integers(1, vocab, first)], [[int(x) for x in rng.integers(1, vocab, more)] for _ in range(n_turns - 1)]


def run_turns(warm: Engine, cold: Engine, cfg: GenerationConfig, conv) -> list:
    """Each turn's prompt is the last turn's prompt + its output + the turn's new ids, as
    chat clients and agents send it; returns [(warm result, cold result)] per turn."""
    prompt, adds = conv
    out = []
    for add in [*adds, None]:
        a, b = warm.generate(prompt, cfg), cold.generate(prompt, cfg)
        out.append((a, b))
        if add is not None:
            prompt = prompt + a.tokens + add
    return out


@pytest.fixture(scope="module")
def toys():
    return toy_engine(True), toy_engine(False)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cache_hit_equals_cold_run_on_a_width_sensitive_model(toys, name):
    warm, cold = toys
    cfg = GenerationConfig(max_new_tokens=40, **CONFIGS[name])
    pairs = run_turns(warm, cold, cfg, conversation(warm.manifest.vocab_size))
    for i, (a, b) in enumerate(pairs):
        assert a.tokens == b.tokens, (name, i)
        assert b.stats.cached_tokens == 0
    assert [a.stats.cached_tokens for a, _ in pairs[1:]] and all(a.stats.cached_tokens >= 256 for a, _ in pairs[1:])


def test_misaligned_reuse_changes_the_output(toys, monkeypatch):
    """The mutation: reuse every row of the common prefix and prefill the rest from there
    (as llama.cpp's cache_prompt does). Rows a cold run computes in a 256-wide call then come
    from calls of other widths, and the toy model's output changes: the equality test above
    fails under this mutation."""
    from specrt.runtime.chunks import chunk_bounds as bounds

    warm, cold = toys

    def naive(cached, seq, step, min_q, tail_q):
        n = min(cached.target_rows, common_prefix(cached.tokens, seq), len(seq) - 1) if cached is not None else 0
        return n, [(n + a, n + b) for a, b in bounds(len(seq) - n, step, min_q, tail_q)], len(seq) - 1

    monkeypatch.setattr(decode, "prefill_calls", naive)
    warm.cached = None
    pairs = run_turns(warm, cold, GenerationConfig(max_new_tokens=40), conversation(warm.manifest.vocab_size))
    warm.cached = None
    assert any(a.stats.cached_tokens % 256 for a, _ in pairs[1:])
    assert any(a.tokens != b.tokens for a, b in pairs[1:])


@pytest.mark.parametrize("cut", [517, 515, 700])
def test_a_cut_back_prompt_reuses_only_its_own_aligned_chunks(toys, cut):
    """A regenerated or edited turn: the cache holds rows [0, 512) of a 700-token prompt and
    the new prompt is its first ``cut`` tokens. A cold run of 517 tokens calls [0, 256),
    [256, 508), [508, 517) (the tail takes rows from the second chunk), so only [0, 256) is
    reusable; reusing [256, 508) from the cached 256-wide call changes the toy's output."""
    warm, cold = toys
    ids = conversation(warm.manifest.vocab_size, 1, 700)[0]
    cfg = GenerationConfig(max_new_tokens=24)
    warm.cached = None
    warm.generate(ids, cfg)
    assert warm.cached.target_rows == 512
    a, b = warm.generate(ids[:cut], cfg), cold.generate(ids[:cut], cfg)
    assert a.tokens == b.tokens
    assert a.stats.cached_tokens == {517: 256, 515: 256, 700: 512}[cut]


# ---- the shipped engines ----------------------------------------------------------------
@pytest.fixture(scope="module")
def pair():
    return Engine(ENGINES), Engine(ENGINES, prefix_cache=False)


@pytest.fixture(scope="module")
def history(pair):
    """A growing code history of real prompts (text), each turn adding one."""
    lines = [json.loads(x)["prompt"] for x in PROMPTS.read_text().splitlines()[:5]]
    return lines


@pytest.mark.parametrize("name", list(CONFIGS))
def test_multi_turn_cache_hits_equal_cold_runs(pair, history, name):
    """Engine.generate with a growing history (a chat or an agent loop): every turn equals the
    cold run, text included, and later turns reuse rows."""
    warm, cold = pair
    warm.cached = None
    cfg = GenerationConfig(max_new_tokens=32, **CONFIGS[name])
    text, hits = "", []
    for p in history:
        text += p
        a, b = warm.generate(text, cfg), cold.generate(text, cfg)
        assert a.tokens == b.tokens and a.text == b.text, name
        assert b.stats.cached_tokens == 0
        hits.append(a.stats.cached_tokens)
        text += a.text
    # greedy, the prompts have 131, 262, 438, 571 and 750 tokens, and the hits are
    # [0, 0, 0, 256, 512]: a prefill leaves its full aligned chunks before the last one
    # (262 tokens: [0, 253) [253, 262), none)
    assert hits[0] == 0 and all(h % 256 == 0 for h in hits) and min(hits[-2:]) >= 256, hits
    if name == "greedy":
        assert hits == [0, 0, 0, 256, 512]


def test_stream_and_constraint_reuse_too(pair, history):
    from specrt.runtime.constraints import Constraint

    warm, cold = pair
    text = history[0] + history[1] + history[2]  # 430 tokens: [0, 256) is reusable
    warm.generate(text, GenerationConfig(max_new_tokens=4))
    cfg = GenerationConfig(max_new_tokens=24, constraint=Constraint.regex(r"# [a-z ]{3,30}\n"))
    s = warm.stream(text + "\n", cfg)
    pieces = list(s)
    ref = cold.generate(text + "\n", cfg)
    assert "".join(pieces) == ref.text and s.result.tokens == ref.tokens
    assert s.result.stats.cached_tokens >= 256


def test_other_uses_of_the_kv_drop_the_record(pair, history):
    warm, _ = pair
    text = history[0] + history[1] + history[2]
    warm.generate(text, GenerationConfig(max_new_tokens=4))
    assert warm.cached is not None and warm.cached.target_rows >= 256
    warm.prompt_logprobs(text[:50])  # a scoring pass writes KV rows from 0
    assert warm.cached is None
    assert warm.generate(text, GenerationConfig(max_new_tokens=4)).stats.cached_tokens == 0
    assert warm.fork().cached is None
    _, cold = pair
    cold.generate(text, GenerationConfig(max_new_tokens=4))
    assert cold.cached is None


# ---- the rollback the cache relies on ----------------------------------------------------
def test_target_kv_is_shortened_after_every_rejection():
    """After each round the target's KV length is the committed length minus the pending
    token: rows of rejected candidates are never counted as held (only this length tells a
    batched step or a prefix record which rows are valid)."""
    e = toy_engine(False)
    ids = conversation(e.manifest.vocab_size, 1, 120)[0]
    gen = e.start(ids, e.resolve(GenerationConfig(max_new_tokens=60, k_max=6, threshold=0.0)))
    gen.prefill(e.target)
    rejected = 0
    while not gen.done:
        before = gen.stats.proposed - gen.stats.accepted
        gen.step(e.target)
        rejected += (gen.stats.proposed - gen.stats.accepted) > before
        assert gen.kv.target == len(gen.seq) - 1, (gen.kv.target, len(gen.seq))
    assert rejected >= 3
