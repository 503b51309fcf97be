"""Oracles that see a bug both decoding modes share (issue 43.1).

Most exactness tests compare speculative with target-only output. A bug in what both modes
do passes them: the KV rows of a forced run left unwritten, a cache hit whose last call is
one row wide. These tests compare with what shares no code with the decode loop:

* **A fresh run of the whole sequence.** Every target logits row the loop computes on the
  committed sequence equals, bit for bit, the row of a fresh model (its own KV buffers)
  run over the whole sequence from position 0 (:func:`fresh_rows`). Among them is every
  row that decided a token: the first free position after a forced run (jump-forward), a
  prefix hit, a rollback, at every call width (:func:`decided`). The fresh run is laid out
  as the product promises equality with (runtime/prefix.py, docs/design.md section 3):
  under the "any layout" rule (the export measured every width ``min_q``..256 but
  ``avoid``) a row depends on the tokens up to it only, so the fresh run is a cold prefill
  of the whole sequence; under the aligned rule the prompt is cut as its cold prefill
  cuts it and the output in calls of the measured widths ``min_q``..``k_max + 1``.
* **Repeat and regenerate.** The same prompt twice, a prompt that is a prefix of the cached
  record, and one that adds fewer than ``min_q`` tokens to it: each equals its cold run
  (tokens and logprobs, bit for bit) and its rows equal the fresh run's.
* **The draft side applies the target's mask and bias.** No proposal is one the target's
  masked, biased row rules out (:func:`proposals` counts them); such a proposal
  cannot change the output, only waste the pass, so only a count sees it.

Engines: the toy model whose rows depend on the width of the call that computed them
(tests/test_prefix.py ``WidthSensitive``; both layouts: exact at ``min_q``..``k_max + 1``
only, and at every width to 256 but 129 and 200) and engines/default (the embedded int4
pair) twice: on specrt's kernels, its default (every width exact, 1-row steps), and on its
onnxruntime graph (``--backend ort-cpu``: ``exact_min_q`` 2, 129-row calls avoided). Mutation runs: tests/mutations/oracles.json.
"""

from __future__ import annotations

import copy
import json
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest
from test_prefix import conversation, toy_engine

from specrt import Engine, GenerationConfig
from specrt.runtime.chunks import chunk_bounds
from specrt.runtime.constraints import Constraint
from specrt.runtime.generation import Generation

REPO = Path(__file__).resolve().parents[1]
ENGINES = REPO / "engines" / "default"
PROMPTS = [json.loads(x)["prompt"] for x in (REPO / "data" / "humaneval_dev.jsonl").read_text().splitlines()[:4]]
ENGINE_NAMES = ("default", "default-ort", "toy-any", "toy-aligned")


# ---- the harness: record the loop's rows, run a fresh model, compare -------------------
@dataclass
class Traced:
    """What one generation did: every target call ``(start, tokens, logits rows copy, lo)``
    (rows below ``lo`` were not projected: a ``run_rows`` call), the round records, and the
    :class:`Generation` (its ``seq`` and ``plan``)."""

    calls: list = field(default_factory=list)
    recs: list = field(default_factory=list)
    gen: Generation | None = None


@contextmanager
def traced(engine: Engine):
    """Record the target calls (``run``, and ``run_rows`` and ``run_argmax`` where the model
    has them) and the round records of the generations run inside. A ``run_argmax`` call
    (the kernels' greedy verification: no logits written) is followed by a ``run`` of the same
    tokens at the same start, whose rows are recorded, and whose argmax must be the ids the
    loop read (the kernels' rows do not depend on the call, so the KV rows it rewrites get
    the same bits)."""
    t = Traced()
    model = engine.target
    names = [n for n in ("run", "run_rows", "run_argmax") if hasattr(model, n)]
    saved = {n: (n in vars(model), getattr(model, n)) for n in names}
    push = Generation.push

    def run(tokens, start):
        rows = saved["run"][1](tokens, start)
        t.calls.append((start, [int(x) for x in tokens], np.array(rows), 0))
        return rows

    def run_rows(tokens, start, lo):
        rows = saved["run_rows"][1](tokens, start, lo)
        t.calls.append((start, [int(x) for x in tokens], np.array(rows), lo))
        return rows

    def run_argmax(tokens, start, n_valid, pens=None):
        ids = saved["run_argmax"][1](tokens, start, n_valid, pens).copy()
        kv = (model.k.copy(), model.v.copy())  # what run_argmax wrote: the rerun must write the same bits
        rows = np.array(saved["run"][1](tokens, start))
        assert np.array_equal(model.k, kv[0]) and np.array_equal(model.v, kv[1]), ("run_argmax's KV rows differ from run's", start)
        masked = [r[:n_valid] if pens is None or pens[i] is None else np.add(r[:n_valid], pens[i]) for i, r in enumerate(rows)]
        assert np.array_equal(np.array([m.argmax() for m in masked]), ids), (start, len(tokens))
        t.calls.append((start, [int(x) for x in tokens], rows, 0))
        return ids

    def record(gen, rec):
        t.gen = gen
        t.recs.append(rec)
        return push(gen, rec)

    for n in names:
        setattr(model, n, {"run": run, "run_rows": run_rows, "run_argmax": run_argmax}[n])
    Generation.push = record
    try:
        yield t
    finally:
        Generation.push = push
        for n, (own, f) in saved.items():
            if own:
                setattr(model, n, f)
            else:
                delattr(model, n)


def fresh_model(model):
    """Another model over the same weights with its own KV buffers (the toy: a copy)."""
    try:
        return model.fork()
    except NotImplementedError:
        c = copy.copy(model)
        c.rows, c.out = np.zeros_like(model.rows), np.empty_like(model.out)
        return c


def fresh_rows(model, seq: list[int], n_prompt: int, plan) -> np.ndarray:
    """Logits rows ``[len(seq), vocab]`` of a fresh run of ``model`` over ``seq`` from
    position 0, laid out as the product promises equality with (module docstring): any
    layout, the cold prefill's chunks of the whole sequence; aligned, the cold prefill's
    chunks of ``seq[:n_prompt]`` (the prompt and the tokens a constraint forces before the
    first choice, fed with it), then the rest in calls ``min_q``..``tail_q`` wide (starting
    inside the prompt when fewer than ``min_q`` tokens follow it: those prompt rows are
    rewritten at a measured width, as the last prompt chunk computed them)."""
    n = len(seq)
    if plan.any_layout:
        cuts = chunk_bounds(n, model.max_q, plan.min_q, plan.tail_q, plan.avoid)
    else:
        lo = min(n_prompt, n - plan.min_q)
        cuts = chunk_bounds(n_prompt, model.max_q, plan.min_q, plan.tail_q) + [(lo + a, lo + b) for a, b in chunk_bounds(n - lo, plan.tail_q, plan.min_q)]
    out = np.empty((n, model.vocab), np.float32)
    for a, b in cuts:
        out[a:b] = model.run(seq[a:b], a)
    return out


def decided(recs: list, n_prompt: int, n_seq: int) -> set[int]:
    """Positions whose target row decided a committed token: the prefill's last row, and in
    each round rows 0..m of the verification (the accepted candidates, the correction or
    bonus). The first free position after forced tokens is the first row of the next round."""
    out: set[int] = set()
    for rec in recs:
        if rec.pos == 0:
            if rec.calls:  # a prefill a constraint forced to the end makes no call
                q, start, _ = rec.calls[-1]
                out.add(start + q - 1)
        else:
            first = n_prompt + rec.pos - 1
            out.update(range(first, min(first + rec.m + 1, n_seq - 1)))
    return out


@dataclass
class Checked:
    """One generation checked against a fresh run (:func:`checked`)."""

    result: object
    traced: Traced
    widths: set  # widths of the calls whose rows were compared
    positions: set  # positions compared


def checked(engine: Engine, fresh, prompt, cfg: GenerationConfig) -> Checked:
    """``engine.generate(prompt, cfg)`` with every target row on the committed sequence
    compared with :func:`fresh_rows`, and every row that decided a token among them."""
    with traced(engine) as t:
        res = engine.generate(prompt, cfg)
    gen = t.gen
    seq = gen.seq
    fed = next((c[1] + c[0] for c in t.recs[0].calls[-1:]), len(seq))  # the prefill's end: prompt + forced head
    ref = fresh_rows(fresh, seq, fed, gen.plan)
    seen, widths = set(), set()
    for start, toks, rows, lo in t.calls:
        for i, tok in enumerate(toks):
            p = start + i
            if p >= len(seq) or seq[p] != tok:
                break  # a rejected candidate: the rows after it are off the sequence
            if i < lo:
                continue  # not projected (run_rows)
            if not np.array_equal(rows[i], ref[p]):
                diff = float(np.max(np.abs(rows[i] - ref[p])))
                raise AssertionError(f"row {p} (call [{start}, {start + len(toks)}), prompt {gen.n_prompt}) != fresh run's (max |diff| {diff:.3g})")
            seen.add(p)
            widths.add(len(toks))
    missing = decided(t.recs, gen.n_prompt, len(seq)) - seen
    assert not missing, f"rows that decided tokens were never compared: {sorted(missing)[:8]}"
    return Checked(res, t, widths, seen)


# ---- engines ---------------------------------------------------------------------------
@dataclass
class Pair:
    """A warm engine (prefix cache on), a cold one (off: the oracle of a hit), and a fresh
    model over the warm target's weights (the oracle of every row)."""

    warm: Engine
    cold: Engine
    fresh: object

    @property
    def plan(self):
        return self.warm.plan(self.warm.resolve(GenerationConfig()))


@pytest.fixture(scope="module", params=ENGINE_NAMES)
def pair(request):
    name = request.param
    if name.startswith("default"):
        if not (ENGINES / "manifest.json").is_file():
            pytest.skip("engines/default not exported: run `make export`")
        backend = "ort-cpu" if name == "default-ort" else None
        warm, cold = Engine(ENGINES, backend=backend), Engine(ENGINES, prefix_cache=False, backend=backend)
        if (warm.backend == "kernels") != (name == "default"):
            pytest.skip(f"engines/default runs on {warm.backend} here (the kernels are not built, or measured slower)")
    else:
        warm, cold = toy_engine(True, any_layout=name == "toy-any"), toy_engine(False, any_layout=name == "toy-any")
    p = Pair(warm, cold, fresh_model(warm.target))
    assert p.plan.any_layout == (name != "toy-aligned") and (p.plan.min_q == 1 if name == "default" else p.plan.min_q >= 2)
    return p


def ids_of(pair: Pair, i: int, n: int) -> list[int]:
    """Prompt ``i``: ``n`` tokens of real code (the humaneval prompts, repeated)."""
    ids = pair.warm.codec.encode("".join(PROMPTS[i:] + PROMPTS[:i]) * 3)
    assert len(ids) >= n
    return ids[:n]


# ---- 1. after forced runs --------------------------------------------------------------
def forced_grammar(run: int) -> Constraint:
    """Forced text before the first choice (fed with the prompt), a choice, then about
    ``run`` forced tokens (jump-forward right after the prefill's first token), free text,
    another forced run once the model ends a word (after a round's token), free text."""
    lit = ": " + " ".join(["0123456789"] * max(1, run // 6)) + " -> "
    lit2 = " <= " + " ".join(["9876543210"] * max(1, run // 6)) + ";"
    return Constraint("lark", f'start: "x = (" ("1" | "2" | "3") {json.dumps(lit)} /[a-z_]{{1,20}}/ {json.dumps(lit2)} /[a-z]{{1,8}}/ "\\n"')


FORCED_CONFIGS = [
    dict(speculative=False),
    dict(k_max=8, threshold=0.0),
    dict(k_max=3, threshold=0.0, strategy="chunked"),
    dict(temperature=0.8, seed=5),
    dict(drafter="ngram"),
    dict(drafter="hybrid", k_max=6, threshold=0.0),
]


def prefill_forced_after_first(c: Checked) -> int:
    """Tokens the prefill committed without a call after its first token (the run whose
    KV rows the next round must write)."""
    pre = c.traced.recs[0]
    q, start, _ = pre.calls[-1]
    return len(pre.commit) - (start + q - c.traced.gen.n_prompt) - 1


def test_rows_after_forced_runs_equal_a_fresh_run(pair):
    """A constraint forces text before the first choice and a long run right after it:
    every row the loop then computes, the first free position after each run included,
    equals the fresh run's (rows of forced tokens the loop failed to write would differ).
    On the aligned toy the run is short enough to ride in the verification call: a longer
    one is caught up in prefill-wide calls, unmeasured widths there (both modes make the
    same calls; no later request reuses those rows)."""
    widest = pair.plan.tail_q
    run = 40 if pair.plan.any_layout else widest - 3
    for i, cfg in enumerate(FORCED_CONFIGS):
        pair.warm.cached = None
        c = checked(pair.warm, pair.fresh, ids_of(pair, i % 2, 90 + 37 * i), GenerationConfig(max_new_tokens=128, constraint=forced_grammar(run), **cfg))
        assert c.result.finish_reason == "stop", (cfg, c.result.text)
        assert prefill_forced_after_first(c) >= run // 2, (cfg, c.traced.recs[0].commit)
        assert sum(1 for r in c.traced.recs[1:] if r.forced >= run // 2) >= 1, cfg  # the second run, after a round's token
        if pair.plan.any_layout:
            assert any(q > widest for q, _, _ in c.traced.recs[1].calls), (cfg, c.traced.recs[1].calls)  # caught up in chunks first


# ---- 2. after rollbacks, at every call width ------------------------------------------
ROLLBACK_CONFIGS = [dict(k_max=k, threshold=0.0) for k in range(1, 9)] + [
    dict(k_max=8, threshold=0.0, strategy="chunked"),
    dict(speculative=False),
    dict(temperature=0.9, seed=3, k_max=6, threshold=0.0),
    dict(drafter="hybrid", k_max=8, threshold=0.0),
]


def test_rows_after_rollbacks_equal_a_fresh_run_at_every_width(pair):
    """k_max 1..8 with no threshold (verification calls min_q..k_max + 1 wide), chunked
    verification, sampling, n-gram proposals (hybrid): rounds reject candidates and roll back,
    and every row on the committed sequence equals the fresh run's."""
    widths, rejected = set(), 0
    for i, cfg in enumerate(ROLLBACK_CONFIGS):
        pair.warm.cached = None
        c = checked(pair.warm, pair.fresh, ids_of(pair, i % 4, 40 + 23 * i), GenerationConfig(max_new_tokens=40, **cfg))
        widths |= c.widths
        rejected += sum(1 for r in c.traced.recs if r.m < r.n)
    assert set(range(pair.plan.min_q, pair.plan.tail_q + 1)) <= widths, sorted(widths)
    assert rejected >= 10


# ---- 3. after prefix hits, and repeat / regenerate requests ----------------------------
def test_rows_after_prefix_hits_equal_a_fresh_run(pair):
    """A growing conversation on the warm engine: each turn hits the last one's record and
    every row equals the fresh run's (a hit that reused a row a cold run computes
    otherwise, or skipped one, would differ)."""
    warm = pair.warm
    warm.cached = None
    prompt, adds = conversation(warm.manifest.vocab_size, 3, 300, 60)
    cfg = GenerationConfig(max_new_tokens=30, k_max=5, threshold=0.0)
    hits = []
    for add in [*adds, None]:
        c = checked(warm, pair.fresh, prompt, cfg)
        hits.append(c.result.stats.cached_tokens)
        if add is not None:
            prompt = prompt + c.result.tokens + add
    assert hits[0] == 0 and min(hits[1:]) >= 256, hits


def repeat_cases(ids: list[int], out: list[int], min_q: int) -> dict[str, list[int]]:
    """Prompts a client re-sends after ``ids`` gave ``out`` (the cache then holds
    ``ids + out``, less the pending token's row): the same prompt (regenerate, retry), a
    prefix of it (an edit), a prefix of the record inside the reply (regenerate from there),
    and prompts that add fewer than ``min_q`` tokens to the prompt or to the record."""
    other = next(t for t in range(5, 50) if t != out[0])
    return {
        "same": list(ids),
        "prefix": ids[:-7],
        "into-reply": ids + out[:3],
        "adds-fewer-than-min_q": ids + [other] * (min_q - 1),
        "record-adds-fewer-than-min_q": ids + out + [other] * (min_q - 1),
    }


REPEAT_CONFIGS = {
    "greedy": dict(logprobs=2),
    "target-only": dict(speculative=False, logprobs=2),
    "sampled": dict(temperature=0.8, seed=11, logprobs=2),
    "ngram": dict(drafter="ngram"),
}


def lps(res) -> list | None:
    return None if res.logprobs is None else [(t.token, t.logprob, t.top) for t in res.logprobs]


@pytest.mark.parametrize("case", ["same", "prefix", "into-reply", "adds-fewer-than-min_q", "record-adds-fewer-than-min_q"])
def test_repeat_and_regenerate_equal_cold_runs(pair, case):
    """A request re-sent after another (the cache holds the first prompt and its reply):
    its tokens and logprobs equal the cold run's, and every row the fresh run's. Under any
    layout the hit keeps the common prefix less the ``min_q`` rows the last call needs (a
    last call narrower than ``min_q`` rounds its rows otherwise: a 1-row call on both
    engines here); under the aligned rule the prompt's leading aligned chunks."""
    warm, cold, min_q = pair.warm, pair.cold, pair.plan.min_q
    ids = ids_of(pair, 1, 300)
    for name, extra in REPEAT_CONFIGS.items():
        cfg = GenerationConfig(max_new_tokens=24, **extra)
        warm.cached = None
        out = warm.generate(ids, cfg).tokens
        again = repeat_cases(ids, out, min_q)[case]
        rec = warm.cached
        c = checked(warm, pair.fresh, again, cfg)
        ref = cold.generate(again, cfg)
        assert c.result.tokens == ref.tokens and lps(c.result) == lps(ref), (case, name)
        common = min(len(rec.tokens), next((i for i, (a, b) in enumerate(zip(rec.tokens, again)) if a != b), min(len(rec.tokens), len(again))))
        want = min(rec.target_rows, common, len(again) - min_q) if pair.plan.any_layout else 256
        assert c.result.stats.cached_tokens == want, (case, name, c.result.stats.cached_tokens, want)


# ---- 4. the draft side applies the target's mask and bias ------------------------------
@dataclass
class Proposals:
    """What one generation's drafter proposed (:func:`proposals`).

    Attributes:
        proposed: candidates its rounds proposed.
        masked: of them, those the target's masked, biased row rules out, replayed on a
            fresh grammar matcher: a token ``logit_bias`` bans (-100), or one the grammar
            refuses after the committed tokens and the candidates before it; every candidate
            after such a one counts too (none can be accepted: the pass carrying it is wasted).
        replaced: one-hot steps (an n-gram's, a forced token's) whose token the mask ruled
            out, so the acceptor proposed another id in its place (the lowest allowed one: a
            candidate no drafter chose, and the n-gram's next tokens follow the wrong one).
        result: the :class:`~specrt.runtime.generation.GenerationResult`.
    """

    proposed: int
    masked: int
    replaced: int
    result: object = field(repr=False)


def proposals(engine: Engine, prompt, cfg: GenerationConfig) -> Proposals:
    """Run one generation and count its proposals (:class:`Proposals`)."""
    from specrt.runtime import drafters

    one_hot, replaced = drafters.one_hot_step, []

    def step(row, token, acc, i):
        out = one_hot(row, token, acc, i)
        if out[0] != token:
            replaced.append((token, out[0]))
        return out

    drafters.one_hot_step = step
    try:
        with traced(engine) as t:
            res = engine.generate(prompt, cfg)
    finally:
        drafters.one_hot_step = one_hot
    matcher = engine.grammar_tokenizer().matcher(cfg.constraint) if cfg.constraint is not None else None
    banned = {int(k) for k, b in dict(cfg.logit_bias or {}).items() if b <= -100}
    eos = engine.manifest.stop_ids()
    proposed = masked = 0
    for rec in t.recs:
        cands = [tok for tok, _ in rec.steps[: rec.n]]
        ok = next((i for i, tok in enumerate(cands) if tok in banned), len(cands))
        if matcher is not None and cands:
            ok = min(ok, matcher.validate_tokens(cands))
        proposed, masked = proposed + len(cands), masked + len(cands) - ok
        for tok in rec.commit:
            if matcher is not None and tok not in eos:
                assert matcher.consume_token(tok), f"committed token {tok} outside the grammar"
    return Proposals(proposed, masked, len(replaced), res)


@pytest.fixture(scope="module")
def engine():
    if not (ENGINES / "manifest.json").is_file():
        pytest.skip("engines/default not exported: run `make export`")
    # the onnxruntime graph: helpers.scripted replaces a model's run(), which the kernels'
    # greedy loop does not call (it reads reduced rows: run_argmax, run_top1)
    return Engine(ENGINES, prefix_cache=False, backend="ort-cpu")


LINE = "the cat 1 sat on 2 the mat 3 and ran 4 far away\n"


def line_case(engine: Engine, lines: int = 4, head: int = 3) -> tuple[list[int], list[int]]:
    """``(prompt, continuation)`` ids: :data:`LINE` three times and the first ``head`` tokens
    of the fourth, then the rest of it: the n-gram drafter proposes the line's next tokens."""
    one = engine.codec.encode(LINE)
    return one * 3 + one[:head], one[head:] + one * (lines - 4)


@pytest.mark.parametrize("drafter", ["ngram", "hybrid"])
def test_ngram_proposals_are_cut_to_the_grammar(engine, drafter):
    """Both models script the line's continuation (tests/helpers.py ``scripted``); the
    grammar allows six more words, then only the end of the line: an n-gram proposal that
    runs on with the line's seventh word is cut before it (``valid_prefix``), so no
    proposal is masked and none is replaced."""
    from helpers import scripted

    prompt, rest = line_case(engine)
    cfg = GenerationConfig(max_new_tokens=40, drafter=drafter, k_max=8, threshold=0.0, constraint=Constraint.regex(r"( [a-z0-9]+){0,6}\n"))
    with scripted(engine, prompt, rest):
        p = proposals(engine, prompt, cfg)
    assert p.result.text.startswith(" 1 sat on 2 the mat") and " 3" not in p.result.text, p.result.text  # the line goes on with " 3"
    assert p.proposed >= 8 and p.masked == 0 and p.replaced == 0, p


@pytest.mark.parametrize("drafter", ["ngram", "hybrid", "model"])
def test_proposals_respect_logit_bias(engine, drafter):
    """Both models script the line's continuation; the draft model is wrong at three
    positions, where it proposes the filler ``.``. ``logit_bias`` bans the filler and the
    line's ``" 3"``: neither is ever proposed (an n-gram proposal is cut before a banned
    token; the draft model's row is biased as the target's), with or without a grammar."""
    from helpers import scripted

    prompt, rest = line_case(engine)
    dot, three = engine.codec.tokenizer.token_to_id("."), engine.codec.encode(" 3")
    assert len(three) == 1 and three[0] in rest
    bias = {str(dot): -100, str(three[0]): -100}
    wrong = {len(prompt) + 2, len(prompt) + 5, len(prompt) + 11}
    for constraint in (None, Constraint.regex(r"( [a-z0-9]+)*\n?")):
        cfg = GenerationConfig(max_new_tokens=30, drafter=drafter, k_max=8, threshold=0.0, logit_bias=bias, constraint=constraint)
        with scripted(engine, prompt, rest, wrong=wrong):
            p = proposals(engine, prompt, cfg)
        assert p.proposed >= 5 and p.masked == 0 and p.replaced == 0, (drafter, constraint, p)
        assert not {dot, three[0]} & set(p.result.tokens)


def test_real_draft_respects_logit_bias_and_grammar(engine):
    """The embedded draft model: ``logit_bias`` bans the three tokens it proposed most
    often where the target rejected them (none of them in the target's output), with and
    without a JSON schema: no proposal is masked, and the output is the target's."""
    prompt = PROMPTS[2]
    with traced(engine) as t:
        plain = engine.generate(prompt, GenerationConfig(max_new_tokens=40, k_max=8, threshold=0.0))
    rejected: dict[int, int] = {}
    for rec in t.recs:
        if rec.m < rec.n and rec.steps[rec.m][0] not in plain.tokens:
            rejected[rec.steps[rec.m][0]] = rejected.get(rec.steps[rec.m][0], 0) + 1
    top = sorted(rejected, key=rejected.get)[-3:]
    assert sum(rejected[x] for x in top) >= 5, rejected
    bias = {str(tok): -100 for tok in top}
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "n": {"type": "integer"}}, "required": ["name", "n"]}
    for constraint in (None, Constraint.json_schema(schema)):
        cfg = GenerationConfig(max_new_tokens=40, k_max=8, threshold=0.0, logit_bias=bias, constraint=constraint)
        p = proposals(engine, prompt, cfg)
        assert p.proposed >= 20 and p.masked == 0 and p.replaced == 0, (constraint, p)
        assert p.result.tokens == engine.generate(prompt, replace(cfg, speculative=False)).tokens
