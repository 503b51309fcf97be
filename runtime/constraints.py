"""Constrained decoding: what the output must match (a JSON schema, a regular expression, a
Lark or GBNF grammar, a list of choices) and a static ``logit_bias``, applied inside the
speculative loop without changing what it proves.

The grammar engine is ``llguidance`` (its matcher and numpy bitmasks; no torch): an
``LLMatcher`` per generation says which tokens may come next (a bitmask over the
vocabulary), consumes the committed tokens, rolls back, and computes *forced* tokens (the
canonical tokens of text the grammar leaves no choice about).

How a constraint meets the loop (:class:`ConstrainedAcceptor`, an
:class:`~specrt.runtime.decode.Acceptor` around the greedy or sampled one):

* every row, draft or target, is masked before the inner acceptor reads it: disallowed ids
  get -inf (``logit_bias`` is added first, as OpenAI applies it). Row r of a verification
  pass and draft step r see the same grammar state (committed tokens + c_1..c_r), so its
  mask is computed once per round and read by both; the draft therefore never proposes a
  token the grammar refuses, and the target's masked p and the draft's masked q enter the
  acceptance rule, so greedy output equals the constrained target-only output and sampled
  output follows the constrained target distribution (Leviathan et al. 2023, Algorithm 1,
  on the masked distributions).
* the matcher follows the round: it consumes candidates as the drafter pulls them (the
  next mask needs them) and, once the target's token is known, rolls back the rejected
  ones and consumes that token (``rollback(n - m)``; nothing else is recomputed).
* jump-forward (:meth:`ConstrainedAcceptor.forced`): after each commit, the tokens the
  grammar forces (llguidance's ``compute_ff_tokens``; the end of generation once the
  grammar is complete) are committed without a model call, in speculative and target-only
  decoding alike (so the two still agree token for token); the target's KV catches them
  up in its next call (:mod:`specrt.runtime.decode`), and they are counted apart
  (``Round.forced``, ``Stats.forced``).
* ``logit_bias`` is added to every free row (-100 bans: -inf); a token it pushes down (a
  negative bias) is never forced: where the grammar would force it, the masked, biased row
  decides. llguidance allows forced text in its canonical tokens only, so a banned forced
  token leaves that state without a token: the generation ends there ("constraint").
* an n-gram proposal is cut to its longest prefix the grammar accepts, and before any
  token ``logit_bias`` bans (:meth:`ConstrainedAcceptor.valid_prefix`), before it is proposed.
* a state where no token is allowed (the grammar cannot be completed) ends the
  generation with ``finish_reason`` ``"constraint"`` (the rows there allow only the end of
  generation, in both modes), never an exception.

Sources: llguidance's Python API (``LLMatcher``, ``llguidance.numpy``); its use for
speculative decoding in vLLM (``vllm/v1/structured_output/backend_guidance.py``: a bitmask
per draft position, rollback of rejected tokens) and TensorRT-LLM's guided decoder;
jump-forward decoding as SGLang's (Zheng et al. 2024, "SGLang", section 4).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .errors import InputError

__all__ = [
    "CONSTRAINT_KINDS",
    "JSON_OPTIONS",
    "Constraint",
    "GrammarTokenizer",
    "ConstrainedAcceptor",
    "check_logit_bias",
    "short_error",
]

CONSTRAINT_KINDS = ("json_schema", "regex", "lark", "grammar", "choice", "llguidance")
# JSON as Python's json.dumps writes it (", " and ": ", no other whitespace): the layout
# models saw most, and every separator is then forced text (jump-forward) instead of a choice
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
MAX_ERROR_CHARS = 240  # an llguidance message is cut to this many characters in a refusal
# compiled, checked constraints a GrammarTokenizer keeps (least recently used dropped): an
# agent resends the same tools and response_format every turn
CACHED_GRAMMARS = 64


@dataclass(frozen=True)
class Constraint:
    """What the generated text must match (a field of
    :class:`~specrt.runtime.config.GenerationConfig`).

    Attributes:
        kind: one of :data:`CONSTRAINT_KINDS`: ``json_schema`` (``spec`` the schema as JSON
            text; ``{}`` or ``{"type": "object"}`` for any JSON object), ``regex`` (Rust
            ``regex`` syntax, matched against the whole output), ``lark`` (llguidance's
            Lark dialect, ``%json`` and special tokens included), ``grammar`` (a GBNF
            grammar as llama.cpp writes them, or Lark: converted by llguidance),
            ``choice`` (``spec`` a JSON list of strings: the output is one of them),
            ``llguidance`` (a grammar object as llguidance's JSON).
        spec: the text of the constraint (str).
        name: where it came from, for messages (e.g. ``"response_format"``).

    The constructors :meth:`json_schema`, :meth:`regex`, :meth:`choice` build one from
    Python values; validation happens when an Engine compiles it
    (:meth:`GrammarTokenizer.compile`).
    """

    kind: str
    spec: str
    name: str = "constraint"

    @classmethod
    def json_schema(cls, schema: dict | str | bool, name: str = "json_schema") -> "Constraint":
        """A JSON-schema constraint (``schema`` a dict or its JSON text)."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema), name)

    @classmethod
    def regex(cls, pattern: str, name: str = "regex") -> "Constraint":
        """The output matches ``pattern`` (whole output)."""
        return cls("regex", pattern, name)

    @classmethod
    def choice(cls, options: Sequence[str], name: str = "choice") -> "Constraint":
        """The output is one of ``options``."""
        return cls("choice", json.dumps(list(options)), name)

    def grammar(self) -> str:
        """The llguidance grammar text of this constraint (not yet checked).

        Raises:
            InputError: (param ``name``) an unknown kind, JSON that does not parse, a
                choice list that is not a non-empty list of strings, or a GBNF grammar
                llguidance cannot convert.
        """
        import llguidance

        kind, spec, name = self.kind, self.spec, self.name
        if kind not in CONSTRAINT_KINDS:
            raise InputError(f"{name}: constraint kind {kind!r}; allowed: {', '.join(CONSTRAINT_KINDS)}", name)
        if not isinstance(spec, str):
            raise InputError(f"{name}: the constraint must be given as text (str), got {type(spec).__name__}", name)
        if kind == "json_schema":
            try:
                schema = json.loads(spec)
            except ValueError as e:
                raise InputError(f"{name}: the JSON schema is not valid JSON ({e})", name) from None
            if schema is True:  # the schema that accepts any JSON value
                spec = "{}"
            elif not isinstance(schema, dict):
                raise InputError(f"{name}: a JSON schema is an object (or true: any JSON value), got {json.dumps(schema)[:40]}", name)
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
            except ValueError as e:
                raise InputError(f"{name}: {short_error(str(e))}", name) from None
        if kind == "choice":
            try:
                options = json.loads(spec)
            except ValueError:
                options = None
            if not isinstance(options, list) or not options or not all(isinstance(o, str) and o for o in options):
                raise InputError(f"{name}: choices must be a non-empty list of non-empty strings", name)
            # one lexeme (a terminal), not parser alternatives: the parser caps items per row
            # (about 2,000), a lexeme holds any number of options
            return llguidance.LLMatcher.grammar_from_lark("start: CHOICE\nCHOICE: " + " | ".join(json.dumps(o) for o in options))
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(spec)
        if kind == "grammar":
            try:
                return llguidance.grammar_from("grammar", spec)
            except ValueError as e:
                raise InputError(f"{name}: the grammar does not compile: {short_error(str(e))}", name) from None
        return spec  # llguidance: its own JSON


def short_error(msg: str) -> str:
    """An llguidance message as one line: whitespace runs collapsed, cut to
    :data:`MAX_ERROR_CHARS` characters."""
    one = " ".join(msg.split())
    return one if len(one) <= MAX_ERROR_CHARS else one[: MAX_ERROR_CHARS - 3] + "..."


def check_logit_bias(bias: Any, vocab: int) -> tuple[tuple[int, float], ...]:
    """A ``logit_bias`` as sorted ``((token id, bias), ...)``.

    Args:
        bias: a mapping (or pairs) of token id -> bias; ids as ints or decimal strings (the
            OpenAI API's JSON keys), biases numbers in [-100, 100] (OpenAI's range: -100
            bans a token, 100 makes it near certain).
        vocab: the tokenizer's vocabulary size (ids in 0..vocab-1).

    Raises:
        InputError: (param ``logit_bias``) otherwise.
    """
    items = bias.items() if isinstance(bias, dict) else bias
    out = {}
    try:
        pairs = list(items)
    except TypeError:
        raise InputError(f"logit_bias={bias!r}; logit_bias maps token ids to numbers in [-100, 100]", "logit_bias") from None
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise InputError(f"logit_bias entry {pair!r}; logit_bias maps token ids to numbers in [-100, 100]", "logit_bias")
        k, v = pair
        if isinstance(k, (int, np.integer)) and not isinstance(k, bool):
            tid = int(k)
        elif isinstance(k, str) and k.isascii() and k.isdigit():  # decimal ASCII digits only (no sign, space, other scripts)
            tid = int(k)
        else:
            tid = None
        if tid is None or not 0 <= tid < vocab:
            raise InputError(f"logit_bias: key {k!r} is not a token id in 0..{vocab - 1}", "logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not -100 <= v <= 100:
            raise InputError(f"logit_bias[{k!r}]={str(v)[:40]}; a bias is a number in [-100, 100]", "logit_bias")
        out[tid] = float(v)
    return tuple(sorted(out.items()))


class GrammarTokenizer:
    """An engine's vocabulary as llguidance sees it (built once per Engine: about 1 s for a
    150k vocabulary), and the compiler of :class:`Constraint` objects into matchers.

    llguidance reads the ``tokenizer.json`` itself when it knows its decoder (byte-level
    BPE, SentencePiece); otherwise it gets each token's bytes and the tokenizer's encode
    from ``codec`` (``llguidance.TokenizerWrapper``).

    Args:
        codec: the engine's :class:`~specrt.runtime.tokenizer.TextCodec`.
        vocab: the tokenizer's vocabulary size (the manifest's ``vocab_size``).
        eos_ids: the end-of-generation ids (any of them ends an output the grammar accepts).

    Attributes:
        compiled: how many constraints were compiled so far (each distinct one once while
            it stays among the last :data:`CACHED_GRAMMARS` used; tests count them).

    Raises:
        InputError: llguidance can read the tokenizer neither way.
    """

    def __init__(self, codec, vocab: int, eos_ids: Sequence[int]):
        import llguidance

        self.vocab = vocab
        self.eos_ids = sorted(eos_ids)
        self.compiled = 0
        self._checked: OrderedDict = OrderedDict()  # Constraint -> its checked matcher, never stepped
        self._lock = threading.Lock()
        try:
            self.tok = llguidance.LLTokenizer(codec.tokenizer.to_str(), n_vocab=vocab, eos_token=self.eos_ids)
        except ValueError:  # a decoder llguidance does not know (e.g. word-level vocabularies)
            try:
                self.tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_CodecView(codec, vocab, self.eos_ids[0])), n_vocab=vocab, eos_token=self.eos_ids)
            except Exception as e:  # noqa: BLE001 - llguidance raises plain exceptions for tokenizers it cannot use
                raise InputError(f"constraints: llguidance cannot read this engine's tokenizer ({short_error(str(e))})", "constraint") from None

    def matcher(self, constraint: Constraint):
        """A fresh ``llguidance.LLMatcher`` for ``constraint``, checked, at the output's start.

        A constraint is compiled and checked once (:meth:`_compile`); later calls with an
        equal one get a copy of that matcher (``LLMatcher.deep_copy``, about a microsecond):
        a request's constraint is compiled once although the server's validation
        (:meth:`Engine.resolve`), the worker's :meth:`Engine.stream` and each choice's
        acceptor all ask for it.

        Raises:
            InputError: (param ``constraint.name``) the grammar does not compile, a schema
                keyword llguidance does not support (the message names it), or no token
                can start the output.
        """
        with self._lock:
            proto = self._checked.get(constraint)
            if proto is not None:
                self._checked.move_to_end(constraint)
                return proto.deep_copy()
        proto = self._compile(constraint)
        with self._lock:
            self._checked[constraint] = proto
            while len(self._checked) > CACHED_GRAMMARS:
                self._checked.popitem(last=False)
            return proto.deep_copy()

    def _compile(self, constraint: Constraint):
        """A new checked matcher for ``constraint`` (:meth:`matcher`'s errors)."""
        import llguidance

        self.compiled += 1

        grammar = constraint.grammar()
        name = constraint.name
        err, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tok)
        if err:
            what = "JSON schema" if constraint.kind == "json_schema" else constraint.kind
            raise InputError(f"{name}: the {what} is not supported: {short_error(msgs[0])}", name)
        m = llguidance.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise InputError(f"{name}: {short_error(m.get_error())}", name)
        allowed = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), count=self.vocab, bitorder="little")
        allowed[self.eos_ids] = 0
        if m.is_error() or (not allowed.any() and not m.is_accepting()):
            raise InputError(f"{name}: no token of this vocabulary can start an output that matches it", name)
        return m


class _CodecView:
    """A vocabulary in the shape ``llguidance.TokenizerWrapper`` reads: token bytes per id
    (the codec's), special ids, and a tokenize function: llguidance's own greedy longest
    match over these bytes (a vocabulary llguidance cannot read from its JSON has no byte
    fallback to encode arbitrary text with, e.g. a word-level one)."""

    def __init__(self, codec, vocab: int, eos_id: int):
        import llguidance

        self.eos_token_id, self.bos_token_id = eos_id, codec.bos
        self.tokens = [codec.token_bytes(i) for i in range(vocab)]
        self.special_token_ids = sorted(codec.special_ids)
        self._greedy = lambda text: []
        self._greedy = llguidance.LLTokenizer(llguidance.TokenizerWrapper(self), n_vocab=vocab, eos_token=eos_id).greedy_tokenize

    def __call__(self, text) -> list[int]:
        return self._greedy(text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text)


class ConstrainedAcceptor:
    """An :class:`~specrt.runtime.decode.Acceptor` that masks every row with a grammar
    matcher (and adds a static logit bias) before ``inner`` decides (module docstring).

    Args:
        inner: the greedy or sampled acceptor.
        matcher: an ``llguidance.LLMatcher`` at the start of the output, or None (logit
            bias alone).
        vocab: the tokenizer's vocabulary size (rows are read up to it).
        k_max: most candidates per round (sizes the per-row masks: k_max + 2 rows).
        eos: the end-of-generation ids; eos_id: the one a complete grammar commits.
        bias: ``((token id, bias), ...)`` added to every row (:func:`check_logit_bias`);
            -100 bans the token (-inf), as OpenAI documents it.

    Attributes:
        greedy, propose_below: ``inner``'s.
        failed: None, or the reason the grammar could not go on (the generation then ends
            with ``finish_reason`` ``"constraint"``).

    Memory: float32 penalty rows ``[k_max + 2, vocab]`` (0 allowed, -inf not) and two
    float32 ``[vocab]`` work rows, allocated once per generation.
    """

    def __init__(self, inner, matcher, vocab: int, k_max: int, eos: frozenset, eos_id: int, bias: tuple = ()):
        self.inner, self.matcher, self.vocab = inner, matcher, vocab
        self.greedy, self.propose_below = inner.greedy, inner.propose_below
        self.eos, self.eos_id = eos, eos_id
        self.bias_row = None  # the static bias as a row (-100 bans: -inf, as OpenAI documents it), or None
        if bias:
            self.bias_row = np.zeros(vocab, np.float32)
            for t, b in bias:
                self.bias_row[t] = -np.inf if b <= -100 else b
        self.banned = np.array([t for t, b in bias if b <= -100], np.int64)
        self.banned_set = frozenset(self.banned.tolist())  # an n-gram proposal is cut before one (valid_prefix)
        self.negative = frozenset(t for t, b in bias if b < 0)  # never forced (jump-forward skips them)
        rows = k_max + 2
        self.bits = np.zeros((rows, (vocab + 31) // 32), np.int32)  # llguidance's bitmask per row
        self.penalty = np.zeros((rows, vocab), np.float32)  # 0 / -inf per row, from bits
        self.dead = [False] * rows  # row r's state allows no token (only the end is let through)
        self.force: list[int | None] = [None] * rows  # row r's forced token, if any
        self.work = np.empty((2, vocab), np.float32)  # masked draft row, masked target row
        self.toks: list[int] = []  # the round's tokens as drafted (c_1, c_2, ...)
        self.consumed = 0  # of toks, how many the matcher has consumed this round
        self.ready = 0  # penalty rows [0, ready) hold this round's masks
        self.failed: str | None = None
        self._last = None  # the row the last accept() read (its correction reads it again)

    # ---- the grammar state of row r: committed tokens + c_1..c_r -------------------------
    def _advance(self, r: int) -> bool:
        """Put the matcher at row r's state; False when a token before it ends the output
        (rows after an end of generation are never committed: no mask)."""
        if self.consumed > r:
            self.matcher.rollback(self.consumed - r)
            self.consumed = r
        while self.consumed < r:
            t = self.toks[self.consumed]
            if t in self.eos:
                return False
            self.matcher.consume_token(t)
            self.consumed += 1
        return True

    def _dead(self) -> str | None:
        """Why the matcher's state allows no continuation (an error, or stopped before the
        grammar is complete), or None."""
        m = self.matcher
        if m.is_error():
            return short_error(m.get_error()) or "the grammar failed"
        if m.is_stopped() and not m.is_accepting():
            return "no token can continue the output the grammar asks for"
        return None

    def _next_forced(self) -> int | None:
        """The token the grammar forces at the matcher's (live) state, or None when it
        leaves a choice: the end of generation once the grammar is complete, else the first
        of llguidance's fast-forward tokens (one at a time, so committing a forced run and
        verifying it row by row give the same tokens)."""
        m = self.matcher
        if m.is_stopped():
            return self.eos_id
        ff = m.compute_ff_tokens()
        if not ff or ff[0] in self.negative:  # a token the bias pushes down: the masked, biased row decides
            return None
        return ff[0]

    def _penalty(self, r: int) -> np.ndarray | None:
        """Row r's penalty row (computed once per round and state), or None: no mask. A
        state with a forced token allows that token alone; one that allows nothing (the
        grammar failed) allows the end of generation alone and is marked dead."""
        if self.matcher is None:
            return self.bias_row
        from llguidance.numpy import fill_next_token_bitmask

        while self.ready <= r:  # rows are asked for in order; fill any skipped one too
            j = self.ready
            if not self._advance(j):
                return None
            pen = self.penalty[j]
            self.dead[j] = self._dead() is not None
            f = self.eos_id if self.dead[j] else self._next_forced()  # a dead state: the end alone, and the generation fails there
            self.force[j] = f
            if f is None:
                fill_next_token_bitmask(self.matcher, self.bits, j)
                allowed = np.unpackbits(self.bits[j].view(np.uint8), count=self.vocab, bitorder="little")
                allowed[self.banned] = 0
                if allowed.any() and self._dead() is None:  # computing the mask can reveal a dead end
                    np.copyto(pen, allowed)
                    with np.errstate(divide="ignore"):
                        np.log(pen, out=pen)  # 1 -> 0, 0 -> -inf: one add masks a row
                    if self.bias_row is not None:
                        pen += self.bias_row
                else:
                    self.dead[j], f = True, self.eos_id
            if f is not None:
                pen.fill(-np.inf)
                pen[f] = 0.0
            self.ready = j + 1
        return self.penalty[r]

    def forced_at(self, i: int) -> int | None:
        """The token the grammar forces at draft step i (state: committed + c_1..c_i), or
        None: a drafter proposes it without a model call."""
        if self.matcher is None or self._penalty(i) is None:
            return None
        return self.force[i]

    def _row(self, row: np.ndarray, pen: np.ndarray | None, buf: int) -> np.ndarray:
        """``row`` plus its penalty row (the mask and the logit bias; a forced or dead state's
        one-hot row carries no bias), in a work row; ``row`` itself without one, or when the
        target's head already reduced it with that penalty row (a 0-d token:
        :meth:`penalties`)."""
        if pen is None or row.ndim == 0:
            return row
        out = self.work[buf]
        np.add(row[: self.vocab], pen, out=out)
        return out

    def _settle(self, r: int, token: int) -> None:
        """The round committed c_1..c_r and ``token``: the matcher goes there, the round's
        masks are dropped."""
        if self.matcher is not None:
            if self.dead[r] and r < self.ready:
                self._advance(r)
                self.failed = self._dead() or "the grammar allows no token after the output so far"
            if self._advance(r) and token not in self.eos and not self.matcher.consume_token(token):
                self.failed = self.matcher.get_error() or f"token {token} does not match the grammar"
        self.toks.clear()
        self.consumed = self.ready = 0
        self.dead[:] = [False] * len(self.dead)

    # ---- the Acceptor protocol -------------------------------------------------------
    def start(self, pos: int) -> None:
        """Forwarded."""
        self.inner.start(pos)

    def draft(self, row: np.ndarray, i: int) -> tuple[int, float]:
        """Draft step i on the masked row (state: committed + c_1..c_i)."""
        x, conf = self.inner.draft(self._row(row, self._penalty(i), 0), i)
        del self.toks[i:]
        self.toks.append(x)
        return x, conf

    def accept(self, r: int, x: int, row: np.ndarray) -> bool:
        """The inner rule on target row r, masked."""
        self._last = self._row(row, self._penalty(r), 1)
        return self.inner.accept(r, x, self._last)

    def correction(self, r: int, row: np.ndarray) -> int:
        """The inner correction at row r (the masked row :meth:`accept` just made); the
        matcher moves to the commit."""
        t = self.inner.correction(r, self._last if self._last is not None else row)
        self._settle(r, t)
        return t

    def bonus(self, r: int, row: np.ndarray) -> int:
        """The inner bonus token at row r, masked; the matcher moves to the commit."""
        t = self.inner.bonus(r, self._row(row, self._penalty(r), 1))
        self._settle(r, t)
        return t

    def penalties(self, n: int) -> list[np.ndarray | None]:
        """The penalty rows of verification rows 0..n of this round (the round's n candidates
        drafted), float32 ``[vocab]`` each, or None for a row without one (after an end of
        generation among the candidates; no constraint and no bias): what the target's
        reduced head adds before it takes each row's argmax (``Plan.argmax``), so the greedy
        token is this acceptor's masked row's, bit for bit, without a logits row. Computes
        row n's mask too (state: every candidate consumed)."""
        return [self._penalty(r) for r in range(n + 1)]

    def forced(self, limit: int) -> list[int]:
        """Tokens the grammar forces after the last commit (at most ``limit``), consumed,
        one at a time (:meth:`_next_forced`); the end of generation once the grammar is
        complete, or where it can go no further (:attr:`failed` then says why). [] without a
        grammar."""
        m = self.matcher
        out: list[int] = []
        if m is None or self.failed is not None:
            return out
        while len(out) < limit:
            why = self._dead()
            if why is not None:
                self.failed = why
                out.append(self.eos_id)
                break
            f = self._next_forced()
            if f is None:
                break
            out.append(f)
            if f == self.eos_id:
                break
            m.consume_token(f)
        return out

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (from the committed state) the target's masked row allows
        in a row: none from the first token ``logit_bias`` bans (-100), and the grammar's
        longest accepted prefix of the rest. (A one-hot draft row of a refused token would
        be masked into another id: a candidate no drafter chose.)"""
        n = len(tokens)
        if self.banned_set:
            n = next((i for i, t in enumerate(tokens) if t in self.banned_set), n)
        if self.matcher is None or n == 0:
            return n
        return self.matcher.validate_tokens(list(tokens[:n]))
