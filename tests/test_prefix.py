"""Prefix reuse (runtime/prefix.py): a cache hit gives the output of a cold run, token for
token, greedy and seeded sampling, speculative and target-only, every drafter.

The oracle is the same request on a cold Engine (``prefix_cache=False``). On the shipped
engines a row's bits rarely move an argmax, so the rule is also proven on a toy model whose
rows depend on the width of the call that computed them, as onnxruntime's kernels do (a
1-row call and a call wider than the measured widths round otherwise): there a cache hit
that reused a row a cold run computes in another call changes the output
(:func:`test_misaligned_reuse_changes_the_output`: the any-layout rule on a model whose wide
widths were not measured). Mutation runs of these rules: tests/mutations/prefix_rules.json.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from specrt import Engine, GenerationConfig
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
    width is in ``[exact_lo, exact_hi]`` (the widths an export measures bit-identical) and
    not in ``inexact``. Its logits: ``bias[token] + chain_weight * table[row % 251]`` (the
    bias table makes a draft with the same bias agree with the target often)."""

    def __init__(self, vocab: int, max_q: int, max_ctx: int, seed: int, exact: tuple[int, int], chain_weight: float, inexact=frozenset()):
        rng = np.random.default_rng(seed)
        self.vocab, self.max_q, self.max_ctx = vocab, max_q, max_ctx
        self.exact, self.seed, self.inexact = exact, seed, frozenset(inexact)
        self.bias = np.random.default_rng(0).standard_normal((vocab, vocab // 16)).astype(np.float32)
        self.table = (chain_weight * rng.standard_normal((251, vocab))).astype(np.float32)
        self.rows = np.zeros(max_ctx, np.uint64)
        self.out = np.empty((max_q, vocab), np.float32)

    def run(self, tokens, start):
        q = len(tokens)
        assert 1 <= q <= self.max_q and start + q <= self.max_ctx
        width = 0 if self.exact[0] <= q <= self.exact[1] and q not in self.inexact else q
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


TOY_INEXACT = (129, 200)  # the any-layout toy's wide widths that round differently


def toy_engine(cache: bool, any_layout: bool = False) -> Engine:
    """The embedded engine's manifest, tokenizer and plan around two toy models (the draft
    agrees with the target where the chains matter little). ``any_layout``: the target is
    exact at every width from ``min_q`` to 256 but :data:`TOY_INEXACT`, and the manifest
    says so (a ``wide`` record); else exact at ``min_q .. k_max + 1`` only and the manifest
    has no ``wide`` record (aligned reuse). The engine is loaded on its onnxruntime graph: the
    toys stand in for a graph whose rows depend on the call's width (the kernels' do not)."""
    e = Engine(ENGINES, prefix_cache=cache, backend="ort-cpu")
    m = e.manifest
    ex = {k: v for k, v in m.target.exactness.items() if k != "wide"}
    if any_layout:
        ex["wide"] = dict(lo=m.k_max + 2, hi=e.target.max_q, inexact=list(TOY_INEXACT))
    e.manifest = m = replace(m, target=replace(m.target, exactness=ex))
    exact = (m.min_q(), e.target.max_q if any_layout else m.k_max + 1)
    e.target = WidthSensitive(m.vocab_size, e.target.max_q, m.max_ctx, 11, exact, 0.35, TOY_INEXACT if any_layout else ())
    e.draft = WidthSensitive(m.vocab_size, e.draft.max_q, m.max_ctx, 12, (m.min_q(), m.k_max + 1), 0.35)
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
    """The product's any-layout rule (:func:`~specrt.runtime.prefix.reuse_any`: every row of
    the common prefix, the rest chunked from there, as llama.cpp's cache_prompt does) on a
    model whose wide widths were not measured exact: rows a cold run computes in a 256-wide
    call then come from calls of other widths, and the toy model's output changes. So
    ``Engine.plan`` keeps an engine without a ``wide`` record on the aligned rule (checked
    first), which the equality test above holds."""
    warm, cold = toys
    assert not warm.plan(warm.resolve(GenerationConfig())).any_layout and warm.manifest.layout_avoid(warm.target.max_q) is None
    monkeypatch.setattr(warm, "plan", lambda c, observe=False: replace(Engine.plan(warm, c, observe), any_layout=True))
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


# ---- any layout: every committed row, when the export measured the wide widths ---------------
@pytest.fixture(scope="module")
def layout_toys():
    return toy_engine(True, any_layout=True), toy_engine(False, any_layout=True)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_any_layout_hit_equals_cold_run_and_reuses_the_reply(layout_toys, name):
    """With a ``wide`` record the cache keeps every committed row: a later turn reuses the
    last prompt and the reply (all but the pending token's row), and equals the cold run."""
    warm, cold = layout_toys
    warm.cached = None
    cfg = GenerationConfig(max_new_tokens=40, **CONFIGS[name])
    prompt, adds = conversation(warm.manifest.vocab_size)
    pairs = run_turns(warm, cold, cfg, (prompt, adds))
    for i, (a, b) in enumerate(pairs):
        assert a.tokens == b.tokens, (name, i)
    for i, (a, _) in enumerate(pairs[1:]):
        prompt = prompt + pairs[i][0].tokens
        assert a.stats.cached_tokens == len(prompt) - 1, (name, i)
        prompt = prompt + adds[i]


def _layout_case(warm, cfg):
    """A first turn, then a second whose prefill after the hit runs 138 rows: 129 + a tail
    of 9 unless 129 is avoided (127 + 2 + 9); the cold run cuts 468 + 9 otherwise."""
    first = conversation(warm.manifest.vocab_size, 1, 300)[0]
    warm.cached = None
    out = warm.generate(first, cfg).tokens
    second = first + out + conversation(warm.manifest.vocab_size, 2, 300, 137)[1][0]
    return second, len(first) + len(out) - 1


def measured_129_exact(engine: Engine):
    """``engine``'s manifest as an export that measured 129-row calls exact would write it
    (its ``wide`` record without 129 among the inexact widths)."""
    m = engine.manifest
    wide = m.target.exactness["wide"]
    return replace(m, target=replace(m.target, exactness={**m.target.exactness, "wide": {**wide, "inexact": [q for q in wide["inexact"] if q != 129]}}))


def prefill_widths(engine: Engine, monkeypatch) -> list:
    """Record the widths of ``engine``'s target calls made from now on (a live list)."""
    widths, run = [], engine.target.run

    def recorded(tokens, start):
        widths.append(len(tokens))
        return run(tokens, start)

    monkeypatch.setattr(engine.target, "run", recorded)
    return widths


def test_any_layout_prefill_avoids_the_inexact_widths(layout_toys, monkeypatch):
    """A hit whose prefill after the reused rows runs 138 rows: the product's plan (from the
    manifest's ``wide`` record) cuts it 127 + 2 + 9, and the output equals the cold run's.
    With a manifest whose record says 129 is exact, the same rule calls 129 rows, which the
    toy (as the embedded int4 target) rounds otherwise: the output changes."""
    warm, cold = layout_toys
    cfg = GenerationConfig(max_new_tokens=30)
    second, reused = _layout_case(warm, cfg)
    widths = prefill_widths(warm, monkeypatch)
    a, b = warm.generate(second, cfg), cold.generate(second, cfg)
    assert a.stats.cached_tokens == reused and a.tokens == b.tokens
    assert widths[:3] == [127, 2, 9], widths
    monkeypatch.setattr(warm, "manifest", measured_129_exact(warm))
    _layout_case(warm, cfg)
    widths.clear()
    a, b = warm.generate(second, cfg), cold.generate(second, cfg)
    assert a.stats.cached_tokens == reused and widths[:2] == [129, 9] and a.tokens != b.tokens, widths[:3]


def test_an_unfinished_generation_leaves_out_the_rows_a_call_may_be_rewriting(layout_toys):
    """Under any layout a generation's record is its committed rows; one that has not ended
    (closed early, or a call raised) leaves out the last ``min_q - 1``, which the next call
    may have begun to rewrite; a later hit on it still equals the cold run."""
    warm, cold = layout_toys
    prompt = conversation(warm.manifest.vocab_size, 1, 300)[0]
    cfg = warm.resolve(GenerationConfig(max_new_tokens=40))
    gen = warm.start(prompt, cfg)
    gen.prefill(warm.target)
    for _ in range(3):
        gen.step(warm.target)
    assert not gen.done and gen.kv.target > 300
    rec = gen.prefix()
    assert rec.target_rows == gen.kv.target - (warm.manifest.min_q() - 1) and rec.tokens == tuple(gen.seq[: rec.target_rows])
    while not gen.done:
        gen.step(warm.target)
    assert gen.prefix().target_rows == gen.kv.target == len(gen.seq) - 1
    warm.cached = rec
    more = list(rec.tokens) + [5, 6, 7]
    a, b = warm.generate(more, GenerationConfig(max_new_tokens=20)), cold.generate(more, GenerationConfig(max_new_tokens=20))
    assert a.tokens == b.tokens and a.stats.cached_tokens == rec.target_rows


def test_rows_after_a_batched_step_are_not_reused(layout_toys):
    """A batched step's row rounds otherwise than a batch-1 call (docs/guide/serving.md,
    Numerics), and every later row reads it: the record stops at the first such row."""
    warm, _ = layout_toys
    prompt = conversation(warm.manifest.vocab_size, 1, 300)[0]
    gen = warm.start(prompt, warm.resolve(GenerationConfig(max_new_tokens=30)))
    gen.prefill(warm.target)
    gen.step(warm.target)
    first = gen.kv.target
    row = np.array(warm.target.run([gen.seq[-1]], first)[0])  # a 1-row call stands in for the batched one
    gen.push_row(row, 0.0)
    while not gen.done:
        gen.step(warm.target)
    assert gen.kv.target > first + 5 and gen.kv.batched_from == first
    assert gen.prefix().target_rows == first


def test_measure_wide_finds_every_inexact_width():
    """The export's probe on a toy whose widths 20 and 33 round otherwise (and 1, and every
    width the toy's exact range leaves out): it names exactly those, at the first call."""
    from specrt.runtime.lab.exactness import measure_wide

    toy = WidthSensitive(64, 64, 128, 3, (2, 64), 0.35, (20, 33))
    rec = measure_wide(toy, 64, 9)
    assert (rec["lo"], rec["hi"], rec["inexact"]) == (10, 64, [20, 33])
    assert rec["checked"] == {"o0": [55, 64], "o9": [8, 59]} and set(rec["max_abs_diff"]) == {"q20@o0", "q33@o0"}
    assert measure_wide(WidthSensitive(64, 64, 128, 3, (2, 50), 0.35), 64, 9)["inexact"] == list(range(51, 65))
    assert "every width 10..64" in measure_wide(WidthSensitive(64, 64, 128, 3, (2, 64), 0.35), 64, 9)["note"]
    with pytest.raises(ValueError, match="reference width 1"):
        measure_wide(toy, 64, 1)


def test_layout_avoid_reads_the_manifest():
    """Any layout only with a ``wide`` record reaching the prefill's widest call, starting
    right above the decode loop's widths, and the widest call itself exact (the onnxruntime
    graph's record: on the kernels every width is exact)."""
    e = Engine(ENGINES, backend="ort-cpu")
    m = e.manifest
    assert e.plan(e.resolve(GenerationConfig())).any_layout
    assert not e.plan(e.resolve(GenerationConfig(exact_widths=False))).any_layout  # 1-row calls: aligned only
    e.backend = "tensorrt"  # measured on onnxruntime's CPU kernels only
    assert not e.plan(e.resolve(GenerationConfig())).any_layout

    def with_wide(**wide):
        return replace(m, target=replace(m.target, exactness={**m.target.exactness, "wide": dict(dict(lo=m.k_max + 2, hi=256, inexact=[129]), **wide)}))

    assert with_wide().layout_avoid(256) == frozenset({129})
    assert with_wide(hi=255).layout_avoid(256) is None
    assert with_wide(lo=m.k_max + 3).layout_avoid(256) is None
    assert with_wide(inexact=[256]).layout_avoid(256) is None
    assert replace(m, target=replace(m.target, exactness={})).layout_avoid(256) is None
    assert replace(m, target=replace(m.target, exact_min_q=None)).layout_avoid(256) is None


def test_chunks_avoid_the_given_widths():
    rng = np.random.default_rng(3)
    for _ in range(300):
        n, avoid = int(rng.integers(1, 900)), frozenset(int(x) for x in rng.integers(10, 257, 6))
        c = chunk_bounds(n, 256, 2, 9, avoid)
        assert c[0][0] == 0 and c[-1][1] == n and all(a[1] == b[0] for a, b in zip(c, c[1:]))
        assert all(hi - lo not in avoid for lo, hi in c), (n, avoid, c)
        assert n < 2 or all(hi - lo >= 2 for lo, hi in c), (n, c)
        assert n < 4 or c[-1][1] - c[-1][0] <= 9
    assert chunk_bounds(129, 256, 2, 0, frozenset({129})) == [(0, 127), (127, 129)]
    assert chunk_bounds(600, 256, 2, 9, frozenset({129, 85})) == [(0, 256), (256, 512), (512, 591), (591, 600)]


# ---- the shipped engines ----------------------------------------------------------------
@pytest.fixture(scope="module", params=["kernels", "ort-cpu"])
def pair(request):
    """(warm, cold) engines/default on the folder's default backend (specrt's kernels where
    they run) or on its onnxruntime graph."""
    backend = None if request.param == "kernels" else request.param
    warm = Engine(ENGINES, backend=backend)
    if warm.backend != request.param:
        pytest.skip(f"engines/default runs on {warm.backend} here, not {request.param}")
    return warm, Engine(ENGINES, prefix_cache=False, backend=backend)


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
    assert warm.plan(warm.resolve(GenerationConfig())).any_layout  # the export measured every wide width
    warm.cached = None
    cfg = GenerationConfig(max_new_tokens=32, **CONFIGS[name])
    text, hits, want, prev = "", [], [], None
    for p in history:
        text += p
        a, b = warm.generate(text, cfg), cold.generate(text, cfg)
        assert a.tokens == b.tokens and a.text == b.text, name
        assert b.stats.cached_tokens == 0
        hits.append(a.stats.cached_tokens)
        ids = warm.codec.encode(text)
        # any layout: every committed row of the last turn (its prompt and its reply, less
        # the pending token's) within the common prefix, less the last call's min_q rows
        want.append(0 if prev is None else min(len(prev) - 1, common_prefix(prev, ids), len(ids) - warm.manifest.min_q()))
        prev = ids + a.tokens
        text += a.text
    assert hits == want and hits[0] == 0 and min(hits[1:]) > 100, (hits, want)
    if name == "greedy":  # the prompts have 131, 262, 438, 571 and 750 tokens
        assert any(h % 256 for h in hits[1:]), hits


def test_any_layout_hits_give_the_cold_runs_bits_on_the_shipped_engine(pair, history, monkeypatch):
    """The rows, not only the tokens: every logprob of a hit equals the cold run's bit for
    bit, including a hit whose prefill after the reused rows is 138 rows (the embedded int4
    target rounds a 129-row call's last row differently, its export measured; the prefill
    cuts 127 + 2 + 9: the product's calls, recorded). With a manifest whose record says 129
    is exact, the same rule calls 129 rows and the logprobs change."""
    warm, cold = pair
    if warm.backend == "kernels":
        pytest.skip("the kernels' rows do not depend on the call's width: no width to avoid")
    if 129 not in warm.manifest.target.exactness.get("wide", {}).get("inexact", []):  # the record, not the plan read from it
        pytest.skip("this engine's export measured 129-row calls exact")
    ids = warm.codec.encode("".join(history))
    cfg = GenerationConfig(max_new_tokens=24, logprobs=2)

    def case():
        warm.cached = None
        out = warm.generate(ids[:300], cfg).tokens
        return ids[:300] + out + ids[400:537], 300 + len(out) - 1

    def lps(r):
        return [(t.token, t.logprob, t.top) for t in r.logprobs]

    second, reused = case()
    widths = prefill_widths(warm, monkeypatch)
    a, b = warm.generate(second, cfg), cold.generate(second, cfg)
    assert a.stats.cached_tokens == reused and lps(a) == lps(b)
    assert widths[:3] == [127, 2, 9], widths
    monkeypatch.setattr(warm, "manifest", measured_129_exact(warm))
    second, reused = case()
    widths.clear()
    a, b = warm.generate(second, cfg), cold.generate(second, cfg)
    assert a.stats.cached_tokens == reused and widths[:2] == [129, 9] and lps(a) != lps(b), widths[:3]


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


def test_released_kv_rows_leave_the_rss_and_read_zero():
    """kv_layout.host_zeros / release_bytes / head_tails (what bounds idle slots' memory under
    a prefix-cache budget): rows past ``start`` of every head read zero after a release,
    rows before it keep their values (the partial page at the cut is kept whole), and the
    process's anonymous RSS drops by the pages released; an ordinary numpy array is left alone."""
    from specrt.runtime.backends.kv_layout import head_tails, host_zeros, release_bytes

    def rss_anon() -> int:
        for ln in open("/proc/self/status"):
            if ln.startswith("RssAnon"):
                return int(ln.split()[1]) * 1024
        pytest.skip("no RssAnon in /proc/self/status")

    heads, ctx, dim = 2, 16384, 128  # 16 MiB, 512 B a row, 8 rows a page
    a = host_zeros((1, heads, ctx, dim))
    a[:] = 1.0
    before = rss_anon()
    start = 1001  # not on a page boundary: rows 1001..1007 share a page with 1000
    done = release_bytes(a, head_tails(heads, ctx, dim, start))
    after = rss_anon()
    assert done == heads * (ctx - 1008) * dim * 4
    assert before - after >= 0.9 * done
    assert np.all(a[0, :, :1008] == 1.0) and not np.any(a[0, :, 1008:])
    a[0, 0, 2000] = 3.0  # released pages are writable again (zero-filled)
    assert a[0, 0, 2000, 0] == 3.0 and a[0, 0, 2001, 0] == 0.0
    b = np.ones((4, 1024), np.float32)
    assert release_bytes(b, [(0, b.nbytes)]) == 0 and np.all(b == 1.0)
    # a view: offsets count from the view's first byte, not the mapping's
    c = host_zeros((2, 4096))
    c[:] = 2.0
    assert release_bytes(c[1], [(0, c[1].nbytes)]) == c[1].nbytes
    assert np.all(c[0] == 2.0) and not np.any(c[1])
    with pytest.raises(ValueError, match="outside the"):
        release_bytes(c[1], [(0, 2 * c[1].nbytes)])
    assert head_tails(2, 10, 4, 3, base=100) == [(100 + 48, 100 + 160), (100 + 160 + 48, 100 + 320)]


def test_standard_graph_model_releases_rows_past_start(tiny_pair):
    """OrtModel (standard graphs, KV ``[1, max_ctx, heads, dim]``: rows first) releases whole
    pages of rows ``[start, max_ctx)`` in every layer and keeps the rows before them; a call
    after the release over the kept rows gives the logits of a model never released."""
    from specrt.runtime.backends.ort import OrtModel

    eng = Engine(tiny_pair[2])
    m = eng.target
    assert isinstance(m, OrtModel)
    seq = list(range(5, 205))
    per_page = 4096 // m.row_bytes
    cut = per_page * (150 // per_page + 1)  # a page boundary: a release one page early would show
    assert 4096 % m.row_bytes == 0 and cut < 200
    ref = m.fork()
    ref.run(seq[:cut], 0)
    want = ref.run(seq[cut : cut + 4], cut).copy()
    m.run(seq[:200], 0)
    done = m.release_rows(cut)
    assert done == 2 * len(m.keys) * (m.max_ctx - cut) * m.row_bytes
    for b in (*m.keys, *m.values):
        assert np.all(np.any(b[0, :cut], axis=(1, 2))) and not np.any(b[0, cut:])
    assert np.array_equal(m.run(seq[cut : cut + 4], cut), want)
