"""Constrained decoding (runtime/constraints.py) inside the speculative loop.

Oracles: the constrained target alone (greedy, ``speculative=False``, the same forced-token
rule), the schema itself (``jsonschema`` validates every output that finished), a fresh
llguidance matcher replaying each round (no candidate outside the grammar is ever
proposed: a draft that ignored the mask would waste its passes), and for the forced
tokens the model calls they save. The sampled case is in tests/test_sampling.py (the masked
target distribution).
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from specrt import Engine, GenerationConfig
from specrt.runtime.constraints import ConstrainedAcceptor, Constraint, check_logit_bias
from specrt.runtime.errors import InputError

REPO = Path(__file__).resolve().parents[1]
ENGINES = REPO / "engines" / "default"
needs_default = pytest.mark.skipif(not (ENGINES / "manifest.json").is_file(), reason="engines/default not exported: run `make export`")

PROMPTS = [
    'def load(path):\n    """Read the config file and return it as a dict."""\n    return ',
    "# the test fixture as JSON\nfixture = ",
]
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "enum_bool_number": {
        "type": "object",
        "properties": {"status": {"enum": ["ok", "error", "skipped"]}, "passed": {"type": "boolean"}, "ratio": {"type": "number"}},
        "required": ["status", "passed", "ratio"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {"files": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3}},
        "required": ["files"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "test": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "line": {"type": "integer"}}, "required": ["name", "line"]},
            "tags": {"type": "array", "items": {"enum": ["unit", "slow", "gpu"]}, "maxItems": 2},
        },
        "required": ["test", "tags"],
        "additionalProperties": False,
    },
    "any_object": {"type": "object"},
}
# (k_max, threshold, drafter, strategy): every drafter, k 1..8, with and without a threshold
GRID = [
    (1, 0.0, "model", "full"),
    (4, 0.7, "model", "full"),
    (8, 0.0, "model", "chunked"),
    (8, 0.7, "ngram", "full"),
    (4, 0.0, "hybrid", "full"),
    (8, 0.5, "hybrid", "full"),
]
NEW = 48


@pytest.fixture(scope="module")
def engine():
    if not (ENGINES / "manifest.json").is_file():
        pytest.skip("engines/default not exported: run `make export`")
    return Engine(ENGINES)


def replay_rounds(engine, ids, cfg) -> tuple[list[int], int]:
    """Run one generation round by round and check every proposal against a fresh matcher at
    the committed state (each candidate allowed in a row); returns (output tokens, number
    of candidates checked)."""
    gen = engine.start(ids, engine.resolve(cfg))
    matcher = engine.grammar_tokenizer().matcher(cfg.constraint)
    eos = engine.manifest.stop_ids()
    checked = 0
    recs = []
    orig_push = gen.push

    def push(rec):
        recs.append(rec)
        return orig_push(rec)

    gen.push = push
    gen.prefill(engine.target)
    while not gen.done:
        gen.step(engine.target)
    for rec in recs:
        cands = [t for t, _ in rec.steps[: rec.n]]
        if cands:
            assert matcher.validate_tokens(cands) == len(cands), f"round at {rec.pos} proposed {cands}, outside the grammar"
            checked += len(cands)
        for t in rec.commit:
            if t not in eos:
                assert matcher.consume_token(t), f"committed token {t} outside the grammar"
    return gen.tokens, checked


@needs_default
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_speculative_equals_constrained_target_only_and_validates(engine, name):
    """Greedy: for every prompt, k, threshold, drafter and strategy the constrained
    speculative output equals the constrained target-only output token for token; every
    finished output is valid JSON of the schema; forced tokens are counted; no round proposes
    a candidate the grammar refuses."""
    schema = SCHEMAS[name]
    c = Constraint.json_schema(schema)
    checked = 0
    for prompt in PROMPTS:
        base = engine.generate(prompt, GenerationConfig(max_new_tokens=NEW, speculative=False, constraint=c))
        if base.finish_reason == "stop":
            jsonschema.validate(json.loads(base.text), schema)
        if name != "any_object":
            assert base.stats.forced >= 2, base.stats  # at least the opening and a key
        assert base.stats.proposed == 0
        for k, th, drafter, strategy in GRID:
            cfg = GenerationConfig(max_new_tokens=NEW, constraint=c, k_max=k, threshold=th, drafter=drafter, strategy=strategy)
            tokens, n = replay_rounds(engine, engine.prompt_ids(prompt), cfg)
            assert tokens == base.tokens, (name, prompt[:20], k, th, drafter, strategy)
            checked += n
        spec = engine.generate(prompt, GenerationConfig(max_new_tokens=NEW, constraint=c, k_max=8, drafter="model"))
        # forced tokens committed after a round, or proposed inside one without a draft call
        assert name == "any_object" or spec.stats.forced + spec.stats.forced_accepted >= 2, spec.stats
        assert spec.stats.forced_accepted <= spec.stats.accepted
    assert checked >= 10  # the draft did propose, and every proposal was inside the grammar


@needs_default
@pytest.mark.parametrize(
    "constraint",
    [
        Constraint.regex(r"[a-z_]{1,12}\((x|y|z)(, (x|y|z)){0,2}\)"),
        Constraint.choice(["return None", "return self.value", "raise ValueError(name)"]),
        Constraint("lark", 'start: NAME " = " NUMBER\nNAME: /[a-z_]{1,10}/\nNUMBER: /[0-9]{1,4}/'),
        Constraint("grammar", 'root ::= "assert " name " == " num\nname ::= [a-z] [a-z]? [a-z]?\nnum ::= [0-9] [0-9]? [0-9]?'),
    ],
    ids=["regex", "choice", "lark", "gbnf"],
)
def test_other_constraints_speculative_equals_target_only(engine, constraint):
    """Regex, choice, Lark and GBNF constraints: equal outputs in both modes, each matching its
    constraint (checked with Python's re for the regex)."""
    import re

    for prompt in PROMPTS:
        base = engine.generate(prompt, GenerationConfig(max_new_tokens=NEW, speculative=False, constraint=constraint))
        assert base.finish_reason == "stop", base
        if constraint.kind == "regex":
            assert re.fullmatch(constraint.spec, base.text), base.text
        if constraint.kind == "choice":
            assert base.text in json.loads(constraint.spec)
        for k, th, drafter, strategy in GRID[::2]:
            cfg = GenerationConfig(max_new_tokens=NEW, constraint=constraint, k_max=k, threshold=th, drafter=drafter, strategy=strategy)
            assert engine.generate(prompt, cfg).tokens == base.tokens, (constraint.kind, k, th, drafter)


@needs_default
def test_a_fully_forced_output_needs_no_model_call(engine):
    """A constraint with one possible output: every token is forced (jump-forward), the
    generation ends with the end-of-generation id, and the target never runs (not even the
    prefill)."""
    text = "import numpy as np\nimport os\n"
    for speculative in (True, False):
        r = engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=40, constraint=Constraint.choice([text]), speculative=speculative))
        assert r.text == text and r.finish_reason == "stop"
        assert r.stats.forced == len(r.tokens) and r.tokens[-1] in engine.manifest.stop_ids()
        assert r.stats.target_calls == 0 and r.stats.prefill_flops == 0 and r.stats.draft_calls == 0


@needs_default
def test_long_forced_runs_catch_the_kv_up_exactly(engine):
    """A forced run longer than the widest exact call (k_max + 1 = 9) after a model choice:
    the target's KV catches it up in separate chunked calls; the outputs still agree in
    every mode, including the free text after the run, and the run is counted as forced."""
    long = ": " + " ".join(["0123456789"] * 6) + " -> "
    c = Constraint("lark", f'start: ("alpha" | "beta" | "gamma") {json.dumps(long)} /[a-z_]{{1,20}}/ "\\n"')
    for prompt in PROMPTS:
        base = engine.generate(prompt, GenerationConfig(max_new_tokens=64, speculative=False, constraint=c))
        assert long in base.text and base.stats.forced > 9, base
        for k, th, drafter, strategy in GRID:
            r = engine.generate(prompt, GenerationConfig(max_new_tokens=64, constraint=c, k_max=k, threshold=th, drafter=drafter, strategy=strategy))
            assert r.tokens == base.tokens, (k, th, drafter)
        # a budget that ends inside the forced run stops there with "length"
        cut = engine.generate(prompt, GenerationConfig(max_new_tokens=6, constraint=c))
        assert cut.finish_reason == "length" and len(cut.tokens) == 6 and cut.tokens == base.tokens[:6]


@needs_default
def test_sampled_constrained_outputs_are_valid_and_seeded(engine):
    """Sampling under a schema: every finished output validates; the same seed gives the same
    tokens; speculative sampling never proposes outside the grammar (distribution: test_sampling)."""
    schema = SCHEMAS["enum_bool_number"]
    c = Constraint.json_schema(schema)
    for seed in range(6):
        cfg = GenerationConfig(max_new_tokens=NEW, constraint=c, temperature=1.0, seed=seed, top_p=0.95)
        r = engine.generate(PROMPTS[seed % 2], cfg)
        assert r.finish_reason == "stop", r
        jsonschema.validate(json.loads(r.text), schema)
        assert engine.generate(PROMPTS[seed % 2], cfg).tokens == r.tokens
        tokens, _ = replay_rounds(engine, engine.prompt_ids(PROMPTS[seed % 2]), cfg)
        assert tokens == r.tokens


@needs_default
def test_logit_bias_is_exact_under_speculation(engine):
    """logit_bias: -100 bans the target-only output's most frequent tokens (they never
    appear), the output changes, and speculative output equals target-only output with the
    same bias; +100 on one id makes it the whole output (a greedy loop of it)."""
    prompt = PROMPTS[0]
    plain = engine.generate(prompt, GenerationConfig(max_new_tokens=32, speculative=False)).tokens
    banned = {str(t): -100 for t in sorted(set(plain), key=plain.count)[-3:]}
    base = engine.generate(prompt, GenerationConfig(max_new_tokens=32, speculative=False, logit_bias=banned))
    assert base.tokens != plain and not set(map(int, banned)) & set(base.tokens)
    for k, th, drafter, _ in GRID:
        assert engine.generate(prompt, GenerationConfig(max_new_tokens=32, logit_bias=banned, k_max=k, threshold=th, drafter=drafter)).tokens == base.tokens
    forced = engine.generate(prompt, GenerationConfig(max_new_tokens=8, logit_bias={"42": 100}))
    assert forced.tokens == [42] * 8


@needs_default
def test_constrained_greedy_on_reduced_rows_equals_masking_full_rows(engine, monkeypatch):
    """Constrained greedy verification on specrt's kernels reduces each row in C with its
    penalty row (``Plan.argmax`` with ``ConstrainedAcceptor.penalties``: no logits row), and
    its tokens equal those of masking full logits rows in numpy (the same request with
    ``logprobs``, which reads whole rows), at every verification width (k 1..8, threshold 0),
    under a JSON schema, a logit bias and both; target-only too. Most calls did carry
    penalty rows."""
    from specrt.runtime.decode import Plan  # noqa: F401  (the path under test)

    if not getattr(engine.target, "argmax_head", False):
        pytest.skip("the target's head is not reduced here (not specrt's kernels)")
    calls = {"pens": 0, "plain": 0}
    run_argmax = engine.target.run_argmax

    def spy(toks, start, n, pens=None):
        calls["pens" if pens is not None and any(p is not None for p in pens) else "plain"] += 1
        return run_argmax(toks, start, n, pens)

    monkeypatch.setattr(engine.target, "run_argmax", spy)
    plain = engine.generate(PROMPTS[1], GenerationConfig(max_new_tokens=NEW, speculative=False)).tokens
    bias = {str(t): -100 for t in sorted(set(plain), key=plain.count)[-2:]} | {"90": 4.5}
    cases = [
        dict(constraint=Constraint.json_schema(SCHEMAS["nested"])),
        dict(logit_bias=bias),
        dict(constraint=Constraint.json_schema(SCHEMAS["person"]), logit_bias={"1": -100, "90": 3.0}),
    ]
    for kw in cases:
        for prompt in PROMPTS:
            want = engine.generate(prompt, GenerationConfig(max_new_tokens=NEW, speculative=False, logprobs=0, **kw))
            assert want.logprobs is not None  # the full-row path
            for k in (None, 1, 2, 3, 4, 5, 6, 7, 8):
                cfg = GenerationConfig(max_new_tokens=NEW, speculative=k is not None, k_max=k, threshold=0.0, **kw)
                got = engine.generate(prompt, cfg)
                assert got.tokens == want.tokens, (kw, prompt[:20], k)
    assert calls["pens"] > 10 * max(1, calls["plain"]), calls


def test_logit_bias_validation():
    assert check_logit_bias({"5": -100, 3: 2.5}, 10) == ((3, 2.5), (5, -100.0))
    for bad, needle in [({"x": 1}, "not a token id"), ({"10": 1}, "0..9"), ({"1": 101}, "[-100, 100]"), ({"1": True}, "[-100, 100]"), (5, "maps token ids")]:
        with pytest.raises(InputError, match=needle.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
            check_logit_bias(bad, 10)


@needs_default
@pytest.mark.parametrize(
    "constraint, needle",
    [
        (Constraint.json_schema({"type": "object", "properties": {"a": {"type": "string", "format": "hostname-ish"}}}), "Unknown format: hostname-ish"),
        (Constraint.json_schema({"type": "strange"}), "Invalid type: strange"),
        (Constraint.json_schema('{"type": "object",'), "not valid JSON"),
        (Constraint.json_schema({"$ref": "#/definitions/nope"}), "does not exist"),
        (Constraint("lark", "start: foo"), 'unknown name: "foo"'),
        (Constraint.regex("[a-"), "unclosed character class"),
        (Constraint("grammar", "root ::= [a-"), "grammar"),
        (Constraint("choice", "[]"), "non-empty list"),
        (Constraint("yaml", "a: b"), "constraint kind 'yaml'"),
    ],
)
def test_bad_constraints_are_one_line_refusals(engine, constraint, needle):
    """A schema keyword llguidance does not support, a grammar that does not compile, bad
    JSON: InputError at resolve (before anything runs), one line naming what was wrong."""
    with pytest.raises(InputError, match=None) as e:
        engine.resolve(GenerationConfig(constraint=constraint))
    msg = str(e.value)
    assert needle in msg and "\n" not in msg and len(msg) < 400, msg
    with pytest.raises(InputError, match="constraint"):
        engine.resolve(GenerationConfig(constraint={"type": "object"}))


@needs_default
def test_trace_with_a_constraint_is_refused(engine, tmp_path):
    from specrt.runtime.lab.trace import TraceWriter

    with pytest.raises(InputError, match="trace"):
        engine.start(
            engine.prompt_ids("x = "), engine.resolve(GenerationConfig(constraint=Constraint.regex("[0-9]+"))), trace=TraceWriter(tmp_path / "t.jsonl", engine)
        )


# ---- the small word-level pair (test_sampling's): a grammar that dead-ends ---------------
def test_a_dead_end_grammar_ends_with_finish_reason_constraint(tmp_path_factory):
    """After ``w1`` the grammar wants text no token can write: the generation ends there with
    finish_reason "constraint" (no exception), the same in both modes; a constraint no
    token can start is refused at resolve."""
    pytest.importorskip("torch")
    from test_sampling import build_small_pair

    eng = Engine(build_small_pair(tmp_path_factory.mktemp("dead_end")))
    c = Constraint("lark", 'start: "w1" "zz"')
    outs = [eng.generate([3], GenerationConfig(max_new_tokens=8, constraint=c, speculative=s, k_max=4)) for s in (False, True)]
    for r in outs:
        assert r.finish_reason == "constraint" and r.tokens[0] == 1 and r.tokens[-1] == eng.manifest.eos_token_id, r
    assert outs[0].tokens == outs[1].tokens
    with pytest.raises(InputError, match="no token"):
        eng.resolve(GenerationConfig(constraint=Constraint.regex("zz")))


def test_constrained_acceptor_masks_rows_once_per_state_and_rolls_back():
    """Unit: a token-level grammar over 8 ids; the draft row of step i and the target row i
    share one mask; after a rejection the matcher is at the commit (the next mask is the
    committed state's)."""
    import llguidance

    from specrt.runtime.constraints import GrammarTokenizer
    from specrt.runtime.speculative import GreedyAcceptor

    class Codec:  # the shape GrammarTokenizer reads: a word-level vocabulary llguidance cannot decode itself
        bos = None
        special_ids = frozenset({0})

        class tokenizer:
            @staticmethod
            def to_str():
                return "{}"

        def token_bytes(self, i):
            return b"<eos>" if i == 0 else f"t{i}".encode()

        def encode(self, text, add_special_tokens=False):
            return []

    gt = GrammarTokenizer(Codec(), 8, [0])
    assert isinstance(gt.tok, llguidance.LLTokenizer)
    # after 3 comes 4 or 5; after 4 comes 6; after 5 comes 7; then the end
    m = gt.matcher(Constraint("lark", "start: <[3]> (<[4]> <[6]> | <[5]> <[7]>)"))
    acc = ConstrainedAcceptor(GreedyAcceptor(8, 8), m, 8, 4, frozenset({0}), 0)
    assert acc.forced(10) == [3]  # the only start is forced
    row = np.zeros(8, np.float32)
    row[[4, 5]] = [1.0, 2.0]  # the draft prefers 5
    x, conf = acc.draft(row, 0)
    assert x == 5 and conf == pytest.approx(np.exp(2) / (np.exp(1) + np.exp(2)), rel=1e-5)
    assert acc.forced_at(1) == 7  # after 5 the grammar forces 7 (the drafter skips its model call)
    target = np.zeros(8, np.float32)
    target[[4, 5, 1]] = [3.0, 1.0, 9.0]  # id 1 is the target's raw argmax but not allowed
    assert not acc.accept(0, 5, target)
    assert acc.correction(0, target) == 4  # the masked argmax
    assert acc.forced(10) == [6, 0]  # after 4: 6 is forced, then the end of generation
    assert acc.failed is None


@needs_default
def test_logprobs_under_a_constraint_are_the_same_in_both_modes(engine):
    """A token the grammar forces is listed with logprob 0 (alone among its alternatives)
    whether it was committed by jump-forward (target-only) or proposed and verified inside a
    round (speculative); every other entry is the target's raw distribution, equal in both."""
    c = Constraint.json_schema(SCHEMAS["person"])
    base = engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=NEW, constraint=c, speculative=False, logprobs=2))
    assert any(e.logprob == 0.0 and e.top == ((e.token, 0.0),) for e in base.logprobs)
    for drafter in ("model", "ngram", "hybrid"):
        spec = engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=NEW, constraint=c, k_max=8, drafter=drafter, logprobs=2))
        assert spec.tokens == base.tokens
        assert [(e.token, e.logprob, e.top) for e in spec.logprobs] == [(e.token, e.logprob, e.top) for e in base.logprobs], drafter


@needs_default
def test_a_choice_of_many_options_and_a_banned_forced_token(engine):
    """20,000 options are one lexeme (the parser's per-row item cap does not apply); a
    forced token that logit_bias bans is not committed: the generation ends with
    finish_reason "constraint" where the grammar has no other token, in both modes."""
    import random
    import string

    rng = random.Random(0)
    opts = sorted({"".join(rng.choice(string.ascii_lowercase) for _ in range(6)) for _ in range(20_000)})
    r = engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=12, constraint=Constraint.choice(opts)))
    assert r.finish_reason == "stop" and r.text in opts
    text = "import numpy as np"
    c = Constraint.choice([text])
    free = engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=20, constraint=c))
    banned = {str(free.tokens[0]): -100}
    outs = [engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=20, constraint=c, logit_bias=banned, speculative=s)) for s in (False, True)]
    # llguidance allows forced text in its canonical tokens only: with the first one banned,
    # nothing can start the output, and the generation ends there, the same in both modes
    assert outs[0].tokens == outs[1].tokens == [engine.manifest.eos_token_id] and outs[0].finish_reason == outs[1].finish_reason == "constraint"
    assert engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=20, constraint=Constraint.json_schema(True))).finish_reason in ("stop", "length")


def test_logit_bias_keys_and_values_are_strict():
    for bad in ({" 5": 1}, {"٣": 1}, {"-1": 1}, {"5": 10**400}, {"5": float("nan")}):
        with pytest.raises(InputError, match="logit_bias"):
            check_logit_bias(bad, 10)
