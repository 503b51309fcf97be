"""One request in flight: :class:`Generation`, the object every driver of the decode loop
steps (``Engine.generate``/``stream``, the server's worker pool through them, and the
continuous-batching scheduler).

A generation owns what one request needs between rounds: the sequence (prompt + output),
the target's KV length, the :class:`~specrt.runtime.decode.Plan`, the acceptor (a
:class:`~specrt.runtime.logprobs.LogprobRecorder` around it when logprobs are asked for; a
:class:`~specrt.runtime.constraints.ConstrainedAcceptor` inside it under a constraint), its
drafter (the draft side: the draft model's KV length included) and adaptive-k policy, the :class:`~specrt.runtime.stats.Stats`, the completion
text (:class:`~specrt.runtime.textstream.CompletionText`, stop strings included) and the
output logprob entries. It does not own the target model: each call names the target it
runs on (the Engine's, or a batch slot), so a scheduler may move a generation between
slots. The draft model (its KV) is the generation's until it ends. Its slot
(:mod:`specrt.runtime.slots`) hands it the prefix record it starts from (:meth:`Generation.reuse`)
and keeps what it leaves (:meth:`Generation.prefix`); the generation hands its prefill's
logits rows back to the OS once read (:func:`~specrt.runtime.slots.release_prefill_logits`).

Calls::

    gen = engine.start(ids, cfg)          # validated ids, resolved cfg
    piece = gen.prefill(target)           # the first token; returns released text
    while not gen.done:
        piece = gen.step(target)          # one round (runtime.decode.one_round)
    result = gen.result()

or, for a batched step, ``gen.push_row(logits_row, seconds)`` in place of ``step`` (the
pending token's target row computed by a call over several generations). Each call goes
through :meth:`Generation.push`, the one place where a round record becomes output: so the
batch scheduler's output equals the Engine's by construction.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .backends.base import Model
from .constraints import ConstrainedAcceptor
from .decode import (
    Drafted,
    KVLengths,
    Plan,
    Round,
    adaptive_policy,
    bonus_round,
    draft_round,
    end_round,
    observe_tail,
    one_round,
    plan_drafter,
    prefill,
    verification_call,
    verify,
)
from .logprobs import LogprobRecorder, TokenLogprob
from .prefix import KVPrefix, reuse_draft
from .slots import release_prefill_logits
from .stats import Stats
from .textstream import CompletionText

__all__ = ["Generation", "GenerationResult", "prompt_only_result"]


@dataclass
class GenerationResult:
    """Output of one generation (:meth:`Engine.generate`, :attr:`Stream.result`, a server job).

    Attributes:
        tokens: generated ids (EOS included when it ended the output; after a stop string,
            the shortest prefix whose text contains the match).
        text: the completion text of ``tokens``: the characters they add to the decoded
            prompt, ``decode(prompt + tokens)[len(decode(prompt)):]`` (special tokens left
            out; the exact rule and where it cannot hold: :mod:`specrt.runtime.textstream`),
            cut before a stop string's match. Equal tokens give equal text, whatever the
            k_max, strategy, stop strings or streaming.
        finish_reason: ``"stop"`` (EOS, a stop string, or a constraint's grammar complete),
            ``"length"`` (max_new_tokens or context full) or ``"constraint"`` (the grammar
            allowed no token after the output so far: the generation ended there with an
            end-of-generation id, :mod:`specrt.runtime.constraints`).
        stats: :class:`~specrt.runtime.stats.Stats` (``new_tokens`` == ``len(tokens)``).
        stop_reason: the stop string that ended the output; None when EOS ended it or
            the reason is "length".
        logprobs: with ``GenerationConfig(logprobs=N)``, one
            :class:`~specrt.runtime.logprobs.TokenLogprob` per entry of ``tokens`` (the
            target's raw distribution, :mod:`specrt.runtime.logprobs`); else None.
    """

    tokens: list[int]
    text: str
    finish_reason: str
    stats: Stats
    stop_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None


def prompt_only_result(n_prompt: int, logprobs: bool) -> GenerationResult:
    """The result of a request that generates nothing (``echo`` with ``max_tokens: 0``):
    no token, finish ``"length"``; ``logprobs`` an empty list when they were asked for."""
    return GenerationResult(tokens=[], text="", finish_reason="length", stats=Stats(prompt_tokens=n_prompt), logprobs=[] if logprobs else None)


class Generation:
    """One request in flight (module docstring); made by :meth:`Engine.start`.

    Args:
        ids: validated prompt ids (``1 <= len < max_ctx``).
        cfg: the resolved :class:`~specrt.runtime.config.GenerationConfig`.
        plan: the decode loop's :class:`~specrt.runtime.decode.Plan` for ``cfg``.
        acceptor: the generation's acceptor (greedy or sampled), unwrapped.
        draft: the draft :class:`~specrt.runtime.backends.base.Model` whose KV this
            generation owns until it ends.
        codec: the tokenizer (:class:`~specrt.runtime.tokenizer.TextCodec`).
        vocab: the tokenizer's ids (logprob entries are over these).
        flops: the target's FLOP coefficients (:mod:`specrt.runtime.flops`) for the stats.
        trace: a :class:`~specrt.runtime.lab.trace.TraceWriter` recording every round, or None.

    Attributes:
        seq: prompt + committed tokens (the target's tokens, uncut by stop strings).
        n_prompt: prompt length. kv: :class:`~specrt.runtime.decode.KVLengths`.
        tokens: the output ids so far (a live list; cut at a stop string).
        logprobs: their :class:`~specrt.runtime.logprobs.TokenLogprob` entries (live, same
            length) with ``cfg.logprobs``, else None.
        stats: :class:`~specrt.runtime.stats.Stats`. done: True once EOS, a stop string,
            the budget or the context ended it.
        finish_reason, stop_reason: as :class:`GenerationResult`.
    """

    def __init__(self, ids: Sequence[int], cfg, plan: Plan, acceptor, draft: Model, codec, vocab: int, flops, trace=None):
        self.seq, self.n_prompt, self.kv = list(ids), len(ids), KVLengths()
        self.plan, self.draft, self.flops, self.trace = plan, draft, flops, trace
        self.constrained = acceptor if isinstance(acceptor, ConstrainedAcceptor) else None
        self.recorder = LogprobRecorder(acceptor, vocab, cfg.logprobs) if cfg.logprobs is not None else None
        self.acc = self.recorder if self.recorder is not None else acceptor
        self.reuse(None)  # the drafter, starting cold
        self._draft_scratch = True  # the draft's prompt-feed logits rows not yet released
        self._drafted: Drafted | None = None  # a draft_step waiting for its verify_step
        self.policy = adaptive_policy(plan)
        self.stats = Stats(prompt_tokens=self.n_prompt, accepted_hist=[0] * (cfg.k_max + 1), proposed_hist=[0] * (cfg.k_max + 1))
        self.text = CompletionText(codec, list(ids), cfg.stop)
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if self.recorder is not None else None
        self.finish_reason, self.stop_reason, self.done = "length", None, False
        self.t0 = time.perf_counter()
        if trace is not None:
            trace.begin(self.seq, cfg)

    # ---- driving ---------------------------------------------------------------------
    def prefill(self, target: Model) -> str:
        """Run the prompt on ``target`` and commit the first token
        (:func:`~specrt.runtime.decode.prefill`); returns the text released."""
        rec = prefill(target, self.seq, self.plan, self.acc, self.kv, self.cached)
        # the prompt's wide calls wrote logits rows no round reads: back to the OS now
        release_prefill_logits(target, self.plan.k_max)
        return self.push(self._observed(rec))

    def reuse(self, cached: KVPrefix | None) -> None:
        """Before :meth:`prefill`: let the prefill and the draft's first feed start from
        ``cached``, what the target's and the draft's KV buffers hold from an earlier request
        (:class:`~specrt.runtime.prefix.KVPrefix`, or None: cold). They skip only the rows
        :mod:`specrt.runtime.prefix` proves equal to a cold run's, so the output is the
        cold run's."""
        self.cached = cached
        kv = reuse_draft(cached, self.seq, self.draft.max_q)
        self.drafter = plan_drafter(self.plan, self.draft, self.n_prompt, kv)

    def prefix(self) -> KVPrefix | None:
        """What the target's and the draft's KV buffers hold for a later request once this
        generation has been prefilled (:mod:`specrt.runtime.prefix`; the rows stay valid
        whatever the rounds do after), or None before its prefill or when nothing is
        reusable. Under ``plan.any_layout`` every committed target row is (the reply's too),
        up to the first one a batched step computed."""
        t, d = self.kv.aligned, self.drafter.aligned
        if self.plan.any_layout:
            # unfinished (closed early, or a call raised): the next call may have begun
            # rewriting the last min_q - 1 rows, so they are left out
            t = self.kv.target if self.done else max(0, self.kv.target - self.plan.min_q + 1)
            if self.kv.batched_from is not None:
                t = min(t, self.kv.batched_from)
        if t == 0 and d == 0:
            return None
        return KVPrefix(tuple(self.seq[: max(t, d)]), t, d)

    def step(self, target: Model) -> str:
        """One round on ``target`` (:func:`~specrt.runtime.decode.one_round`: draft,
        verify, commit, roll back); returns the text released."""
        rec = one_round(target, self.seq, self.n_prompt, self.kv, self.plan, self.acc, self.drafter, self.policy)
        return self._pushed_round(rec)

    @property
    def greedy(self) -> bool:
        """Its acceptor is greedy (its token at a row is the row's argmax, so a call over
        several generations may give it one token without a round: :meth:`push_row`)."""
        return bool(self.acc.greedy)

    @property
    def plain_ok(self) -> bool:
        """A call over several generations may give it one token without a round
        (:meth:`push_row`) and its output stays the request's alone: greedy, or seeded
        sampling whose token at a position depends on that position alone (the coupled
        sampler's ``by_position``; :mod:`specrt.runtime.coupling`)."""
        acc = self.acc
        while not hasattr(acc, "by_position") and hasattr(acc, "inner"):
            acc = acc.inner
        return self.greedy or bool(getattr(acc, "by_position", False))

    def draft_step(self, target: Model) -> tuple[list[int], int, int]:
        """The first half of :meth:`step` for a verification made by a call over several
        generations (continuous batching on specrt's kernels): catch up and propose the
        candidates (:func:`~specrt.runtime.decode.draft_round`; ``target`` is this
        generation's batch-1 model, for a catch-up); returns the verification call
        ``(tokens, start, off)`` (:func:`~specrt.runtime.decode.verification_call`), which
        the caller makes and hands to :meth:`verify_step`."""
        d = draft_round(target, self.seq, self.n_prompt, self.kv, self.plan, self.acc, self.drafter, self.policy)
        self._drafted = d
        return verification_call(self.seq, d.cands, self.kv.target, self.plan.min_q)

    def verify_step(self, rows: np.ndarray, seconds: float) -> str:
        """The second half: accept over the verification rows (float32 ``[n + 1, >= vocab]``,
        the pending token's row first, from a call whose rows are a batch-1 call's bit for
        bit), commit and roll back as :meth:`step` does; ``seconds``: this generation's share
        of the call. Returns the text released.

        Raises:
            RuntimeError: no :meth:`draft_step` is waiting for its rows.
        """
        d = self._drafted
        if d is None:
            raise RuntimeError("verify_step without a draft_step before it")
        self._drafted = None
        m, token = verify(d.cands, [(0, rows)], self.acc)
        rec = end_round(d, m, token, seconds, self.seq, self.n_prompt, self.kv, self.plan, self.acc, self.drafter, self.policy)
        return self._pushed_round(rec)

    def _pushed_round(self, rec: Round) -> str:
        if self._draft_scratch and getattr(self.drafter, "model_calls", 0):
            # the draft's first feed (the prompt, in wide chunks) is in this round: as prefill
            release_prefill_logits(self.draft, self.plan.k_max)
            self._draft_scratch = False
        return self.push(self._observed(rec))

    def push_row(self, row: np.ndarray, seconds: float, exact: bool = False) -> str:
        """Commit one token from the pending token's target logits ``row`` (float32
        ``[>= vocab]``) computed by a call over several generations
        (:func:`~specrt.runtime.decode.bonus_round`; ``exact``: that call's rows are a
        batch-1 call's bit for bit); returns the text released."""
        return self.push(self._observed(bonus_round(self.seq, self.n_prompt, self.kv, self.plan, self.acc, row, seconds, exact)))

    def push(self, rec: Round) -> str:
        """Count a round record and append its committed tokens (and logprob entries) to
        the output, cut where a stop string ends it; returns the text released by it (at
        the end, everything left).

        Raises:
            RuntimeError: the generation has already ended.
        """
        if self.done:
            raise RuntimeError("this generation has ended; start another")
        self.stats.add(rec, self.flops)
        if self.trace is not None:
            self.trace.add(rec)
        piece = rec.commit
        kept = self.text.push(piece)
        self.tokens.extend(piece if kept is None else piece[:kept])
        if self.recorder is not None:
            entries = self.recorder.take()[: len(piece)]  # the commit is cut after EOS
            self.logprobs.extend(entries if kept is None else entries[:kept])
        if kept is not None:
            self.finish_reason, self.stop_reason, self.done = "stop", self.text.stop_reason, True
        else:
            self.finish_reason = rec.finish or self.finish_reason
            self.done = rec.finish is not None
        if self.done:
            if self.constrained is not None and self.constrained.failed is not None:
                self.finish_reason = "constraint"
            self.text.finish()
        return self.text.take()

    def result(self) -> GenerationResult:
        """The :class:`GenerationResult` (stats' ``total_seconds`` from the start to now);
        ends the trace.

        Raises:
            RuntimeError: the generation has not ended.
        """
        if not self.done:
            raise RuntimeError("the generation has not ended; step it until done")
        self.stats.total_seconds = time.perf_counter() - self.t0
        self.stats.new_tokens = len(self.tokens)
        res = GenerationResult(
            list(self.tokens), self.text.text, self.finish_reason, self.stats, self.stop_reason, list(self.logprobs) if self.logprobs is not None else None
        )
        if self.trace is not None:
            self.trace.end(res)
        return res

    def _observed(self, rec: Round) -> Round:
        return observe_tail(rec, self.drafter, self.seq, self.n_prompt, self.plan, self.acc)
