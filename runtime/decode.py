"""The decode loop: prefill, then rounds of propose -> verify -> commit and roll back.

One round (Leviathan et al. 2023, Algorithm 1; confidence-threshold drafting as Hugging
Face assisted generation's ``assistant_confidence_threshold``)::

    propose   the draft feeds the tokens it has not seen, then proposes c_1, c_2, ... one
              call per step, until the threshold rule, k_max, EOS or the budget stops it
              (speculative.propose, speculative.draft_limit); or an n-gram of the sequence
              proposes them (drafters: model, ngram, hybrid, suffix, suffix-model)
    verify    target logits for [pending, c_1..c_n] arrive in blocks; ONE acceptance loop
              (verify) reads them left to right and stops at the first rejection, so no
              block after it is computed
    commit    c_1..c_m and the target's token (correction or bonus), cut after EOS
    rollback  target KV length = len(S) - 1, the drafter's KV length = min(its length, that)
              (speculative.rollback_lengths, Drafter.rollback): rows beyond are never read again

Verification strategies only change how the blocks are made (:func:`target_blocks`):
``full`` one target pass; ``chunked`` one pass per chunk of candidates; ``lazy-head`` one
body pass, then the vocabulary projection per block. A round without candidates is one
pass of the full target over the pending token in every strategy.

Exactness by construction (``Plan.min_q``): a kernel may round a 1-row call differently
from a wider one (onnxruntime's GEMV path vs its GEMM path, measured per engine at export:
``ModelEntry.exact_min_q``, :mod:`specrt.runtime.lab.exactness`), while every call from
``min_q`` to ``k_max + 1`` wide (every width the export measures) gives bit-identical rows
whatever its width and offset. So the loop never
calls the target narrower than ``min_q``: a call that would be narrower starts earlier and
recomputes the committed tokens before it (their KV rows are rewritten with the same bits;
:func:`call_start`), e.g. a target-only step runs ``[previous, pending]`` at ``start - 1``
and reads row 1; the prefill never ends in a chunk narrower than ``min_q``
or wider than ``tail_q`` (the widest measured width, so the rows a round recomputes come
from a measured width; :func:`chunk_bounds`), and a prompt shorter than ``min_q`` leaves its rows to be recomputed
by the first round. Every logits row and every KV row the target produces is then the same
in speculative and target-only decoding, so the greedy outputs are equal bit for bit.

The acceptor decides the tokens: :class:`~specrt.runtime.speculative.GreedyAcceptor`
(argmax; the output is the target's own greedy output) or
:class:`~specrt.runtime.sampling.SampledAcceptor` (exact speculative sampling; the output
follows the target's warped distribution) or :class:`~specrt.runtime.coupling.CoupledAcceptor`
(the same distribution, and under one seed the target-only tokens whatever the rounds did). The loop yields one :class:`Round` record per
round; statistics, traces and server metrics read those records (the loop has no hooks).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Iterator, Protocol, Sequence

import numpy as np

from .adaptive import AdaptiveK
from .backends.base import Model, reduces_head, run_tail
from .chunks import call_start, chunk_bounds, feed
from .drafters import Drafter, drafter_is_free, make_drafter
from .prefix import KVPrefix, prefill_calls
from .speculative import GreedyAcceptor, chunk_passes, chunk_sizes, commit, draft_limit, head_blocks, propose, rollback_lengths

__all__ = [
    "Acceptor",
    "Plan",
    "Round",
    "KVLengths",
    "decode",
    "prefill",
    "one_round",
    "Drafted",
    "plan_drafter",
    "draft_round",
    "verification_call",
    "end_round",
    "bonus_round",
    "catch_up",
    "commit_forced",
    "observe_tail",
    "length_finish",
    "verify",
    "target_blocks",
    "feed",
    "chunk_bounds",
    "call_start",
    "adaptive_policy",
    "reads_reduced_rows",
]

Call = tuple  # (positions through the body, past length, rows projected to logits) of one target call


class Acceptor(Protocol):
    """Proposal and acceptance rule of one generation (greedy or sampled).

    Attributes:
        greedy: True for argmax decoding (traces record draft top-1s only then).
        propose_below: whether a draft token below the threshold is still proposed
            (:func:`~specrt.runtime.speculative.propose`).
    """

    greedy: bool
    propose_below: bool

    def start(self, pos: int) -> None:
        """The next token decided goes to sequence position ``pos`` (prompt included): the
        round's c_1 and row 0, the prefill's first token, a batched step's token. Draft step
        i and target row r then decide position ``pos + i`` / ``pos + r`` (a coupled
        sampler keys its noise by position: :mod:`specrt.runtime.coupling`)."""
        ...

    def draft(self, row: np.ndarray, i: int) -> tuple[int, float]:
        """Candidate i of the round from a draft logits row, and its confidence."""
        ...

    def accept(self, r: int, x: int, row: np.ndarray) -> bool:
        """Whether target row r accepts candidate x (= c_{r+1})."""
        ...

    def correction(self, r: int, row: np.ndarray) -> int:
        """The target's token at row r after :meth:`accept` rejected its candidate."""
        ...

    def bonus(self, r: int, row: np.ndarray) -> int:
        """The target's token at row r when no candidate is left to check."""
        ...

    def forced(self, limit: int) -> list[int]:
        """Tokens a constraint forces after the last commit, at most ``limit``, committed
        without a model call ([] without a constraint;
        :class:`~specrt.runtime.constraints.ConstrainedAcceptor`)."""
        ...

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` a constraint (its grammar, and ``logit_bias`` bans) allows
        in a row from the committed state (``len(tokens)`` without one): an n-gram proposal
        is cut there."""
        ...

    def forced_at(self, i: int) -> int | None:
        """The token a constraint forces at draft step i of this round, or None: the draft
        model then proposes it without a call."""
        ...


@dataclass(frozen=True)
class Plan:
    """The resolved settings the loop runs with (from a resolved GenerationConfig and the manifest).

    Attributes:
        k_max, threshold, speculative, strategy, chunk_bound: as GenerationConfig.
        budget: max_new_tokens. eos: the end-of-generation ids (a frozenset: the
            manifest's :meth:`~specrt.runtime.manifest.Manifest.stop_ids`). max_ctx: the engines' context.
        observe: also record the draft's top-1 of the pending token (``Round.pre``) and,
            after the last round, of the committed tokens the draft has not seen
            (``Round.tail``), for replayable traces; greedy only; costs one extra draft
            call per generation and a softmax per fed row.
        min_q: the narrowest target call (exactness by construction, module docstring).
        tail_q: the widest last prefill chunk (0: no limit): the widest call width the
            export measured bit-identical, ``k_max + 1`` of the engine (:func:`chunk_bounds`).
        any_layout: every target call width from ``min_q`` to the widest prefill call but
            ``avoid`` was measured exact (:mod:`specrt.runtime.prefix`, "Any layout"):
            every committed row is reusable and a cache hit reuses the whole common prefix.
        avoid: call widths the prefill never makes (measured inexact; under ``any_layout``).
        drafter: where candidates come from: one of
            :func:`~specrt.runtime.drafters.drafter_names` (:mod:`specrt.runtime.drafters`).
        adaptive: None (draft up to ``k_max`` every round), or ``(target_s, draft_s,
            prior)``: each round's candidates are chosen by
            :class:`~specrt.runtime.adaptive.AdaptiveK` from these per-call costs (seconds of
            a target call of width q = 1..k_max+1, of a draft step) and the request's running
            acceptance (``prior`` before any round).
        argmax: greedy verification with nothing but the token to read (no logprobs or
            observe): the ``full`` strategy's call returns each row's argmax over ids
            ``[0, argmax)`` (the target's ``run_argmax``: the LM head reduced in the kernels,
            no logits row written), which the greedy acceptor reads as the row's token; under
            a constraint or logit bias each row's penalty row (``acc.penalties``) is added in
            the kernels first, so the token is the masked row's argmax, bit for bit as numpy's
            (:mod:`specrt.runtime.constraints`); 0: logits rows. Used where the target offers
            it (``argmax_head``).
    """

    k_max: int
    threshold: float
    budget: int
    eos: frozenset
    max_ctx: int
    speculative: bool = True
    strategy: str = "full"
    chunk_bound: float = 0.5
    observe: bool = False
    min_q: int = 1
    tail_q: int = 0
    any_layout: bool = False
    avoid: frozenset = frozenset()
    drafter: str = "model"
    adaptive: tuple | None = None
    argmax: int = 0


@dataclass
class KVLengths:
    """Rows the target's KV cache holds for the committed sequence (with the drafter's
    ``kv``, the only state that rolls back), and ``aligned``: rows ``[0, aligned)`` the
    prefill computed in full aligned chunks, the ones a later request may reuse
    (:mod:`specrt.runtime.prefix`; never rewritten after the prefill). Under
    ``Plan.any_layout`` rows ``[0, target)`` are the reusable ones (any later call that
    rewrites one is at a measured width: the same bits), up to ``batched_from``: the first
    row a batched step computed (None: none did), whose rounding a batch-1 call does not
    reproduce (:mod:`specrt.runtime.backends.ort_gqa_batch`), nor the rows after it."""

    target: int = 0
    aligned: int = 0
    batched_from: int | None = None


@dataclass
class Round:
    """What one round did (the prefill is the record with ``pos == 0``).

    Attributes:
        pos: output index of the round's first new token (tokens committed before it).
        steps: the draft's (token, confidence) per draft step, the one a greedy threshold
            stopped included; ``n <= len(steps)``.
        n: candidates proposed. m: candidates accepted.
        commit: tokens committed (accepted + correction/bonus, cut after EOS).
        finish: None, ``"stop"`` (EOS) or ``"length"`` (budget or context).
        draft_calls: draft model calls (= ``len(steps)`` for the draft model, the feed being
            one; 0 for n-gram steps).
        draft_s, target_s: seconds spent drafting and verifying (prefill: in target_s).
        calls: one ``(positions, past, head_rows)`` per target call (a lazy-head body call
            has head_rows 0, its head calls positions 0).
        pre: (observe) the draft's (top-1, confidence) of the pending token, when the
            round's feed had two or more tokens; else None.
        tail: (observe, last round) ``(output index, [(top-1, confidence), ...])`` of the
            committed tokens the draft had not seen.
        forced: of ``commit``, the tokens a constraint forced after the target's token
            (jump-forward: no model call made them; :func:`commit_forced`).
        forced_accepted: of the m accepted candidates, those a constraint forced (the
            drafter proposed them without a draft call; the target's masked row allowed
            them alone).
        cached: (prefill) prompt positions whose target KV rows came from an earlier
            request (prefix reuse, :mod:`specrt.runtime.prefix`): not computed again.
    """

    pos: int
    steps: list
    n: int
    m: int
    commit: list
    finish: str | None
    draft_calls: int = 0
    draft_s: float = 0.0
    target_s: float = 0.0
    calls: list = field(default_factory=list)
    pre: tuple | None = None
    tail: tuple | None = None
    forced: int = 0
    forced_accepted: int = 0
    cached: int = 0


def verify(cands: Sequence[int], blocks, acc: Acceptor) -> tuple[int, int]:
    """Accept candidates left to right over blocks of target logits; stop at the first rejection.

    Row r of the verification (r = 0 is the pending token's position) checks c_{r+1}; row
    n gives the bonus token. Blocks are pulled lazily, so nothing after a rejection runs.

    Args:
        cands: the n candidates.
        blocks: iterable of ``(lo, rows)``: rows ``[lo, lo + len(rows))`` of the
            verification, in order, covering 0..n.
        acc: the :class:`Acceptor`.

    Returns:
        ``(m, token)``: accepted candidates and the target's token at row m (correction
        after a rejection, bonus when all were accepted).

    Source: Leviathan et al. 2023, Algorithm 1 (the acceptance loop with early stop);
    gpt-fast's ``speculative_decode``.
    """
    n = len(cands)
    for lo, rows in blocks:
        for r in range(lo, lo + len(rows)):
            row = rows[r - lo]
            if r == n:
                return n, acc.bonus(r, row)
            if not acc.accept(r, cands[r], row):
                return r, acc.correction(r, row)
    raise AssertionError(f"verification blocks ended before row {n}")  # pragma: no cover


def target_blocks(target: Model, seq: list[int], cands: list[int], valid: int, confs: Sequence[float], plan: Plan, calls: list, acc: Acceptor) -> Iterator:
    """Blocks of target logits for the verification rows ``[pending, c_1..c_n]`` (pending =
    ``seq[-1]``, at position ``len(seq) - 1``), computed only when pulled (see :func:`verify`);
    each target call is appended to ``calls``. Strategy per the module docstring; chunks
    from the draft confidences (:func:`~specrt.runtime.speculative.chunk_sizes`).

    Every call is at least ``plan.min_q`` wide where the committed prefix allows: it starts
    at :func:`call_start` (``valid`` = the target's valid KV length), recomputing committed
    tokens before the pending one, and the rows before the verification rows are dropped.
    With ``plan.argmax``, an acceptor that has ``penalties`` (a constraint) gives the
    reduced head each verification row's penalty row.
    """
    pend, n, min_q = len(seq) - 1, len(cands), plan.min_q

    def tokens(s: int, hi: int) -> list[int]:  # tokens of positions [s, pend + hi)
        return seq[s:] + cands[max(0, s - pend - 1) : hi - 1]

    if plan.strategy == "full" or n == 0:
        toks, s, off = verification_call(seq, cands, valid, min_q)
        calls.append((len(toks), s, len(toks)))
        if plan.argmax and reduces_head(target):
            pens = acc.penalties(n) if hasattr(acc, "penalties") else None  # a constraint's masks, added in C
            ids = target.run_argmax(toks, s, plan.argmax) if pens is None else target.run_argmax(toks, s, plan.argmax, [None] * off + pens)
            yield 0, ids[off:]  # each row's token (Plan.argmax)
        else:
            yield 0, target.run(toks, s)[off:]
        return
    sizes = chunk_sizes(confs, plan.chunk_bound)
    if plan.strategy == "chunked":
        for lo, hi in chunk_passes(sizes):
            s = call_start(pend + lo, pend + hi, valid if lo == 0 else pend + lo, min_q)
            toks = tokens(s, hi)
            calls.append((len(toks), s, len(toks)))
            yield lo, target.run(toks, s)[pend + lo - s :]
        return
    split = target.split_head()  # lazy-head: Engine.resolve checked the capability
    s = call_start(pend, pend + n + 1, valid, min_q)
    toks = tokens(s, n + 1)
    split.body(toks, s)
    calls.append((len(toks), s, 0))
    off = pend - s  # body row of the pending token
    done = 0  # verification rows already projected
    for lo, hi in head_blocks(sizes):
        lo = max(lo, done)
        if lo >= hi:
            continue
        # a head block at least min_q rows wide, too: extended over the next rows (projected
        # once: the next block starts after them), else over earlier body rows at the end
        e = min(off + n + 1, max(off + hi, off + lo + min_q))
        h = max(0, min(off + lo, e - min_q))
        calls.append((0, s, e - h))
        done = e - off
        yield lo, split.head(h, e - h)[off + lo - h :]


@dataclass
class Drafted:
    """A round between its candidates and its verification (:func:`draft_round` ->
    :func:`end_round`): the sequence length before it, the candidates and their
    confidences, the draft's steps (and ``pre``: see :class:`Round`), the target calls made so
    far (a catch-up's), and the clock at the round's start, the draft's start and its end."""

    seq_len: int
    cands: list
    confs: list
    steps: list
    pre: list | None
    calls: list
    t0: float
    t1: float
    t2: float


def plan_drafter(plan: Plan, draft: Model, n_prompt: int, kv: int = 0) -> Drafter:
    """The drafter of a generation of ``n_prompt`` prompt tokens under ``plan``
    (:func:`~specrt.runtime.drafters.make_drafter`): the plan's measured costs when it
    speculates, and the sequence length it stops at, at the latest (its token budget or the
    context, whichever comes first); ``kv``: draft KV rows already holding the prompt."""
    end = min(n_prompt + plan.budget, plan.max_ctx)
    return make_drafter(plan.drafter, draft, draft.vocab, plan.k_max, kv, plan.adaptive if plan.speculative else None, end)


def draft_round(target: Model, seq: list[int], n_prompt: int, kv: KVLengths, plan: Plan, acc: Acceptor, drafter: Drafter, policy=None) -> Drafted:
    """The first half of :func:`one_round`: bring the target's KV up to the pending token
    (:func:`catch_up`) and propose this round's candidates (the draft's calls happen here)."""
    clock = time.perf_counter
    seq_len = len(seq)
    calls: list = []
    t0 = clock()
    room = catch_up(target, seq, n_prompt, kv, plan, calls)
    n_max = min(room, draft_limit(plan.k_max, plan.budget - (seq_len - n_prompt), seq_len, plan.max_ctx)) if plan.speculative else 0
    if policy is not None:
        n_max = policy.choose(n_max)
    steps: list = []
    pre: list | None = [] if plan.observe and acc.greedy else None
    t1 = clock()
    acc.start(seq_len)
    drafter.model_calls = 0
    drafter.forced_steps.clear()
    cands, confs = propose(drafter.steps(seq, acc, steps, pre), n_max, plan.threshold, plan.eos, acc.propose_below)
    return Drafted(seq_len, cands, confs, steps, pre, calls, t0, t1, clock())


def verification_call(seq: list[int], cands: Sequence[int], valid: int, min_q: int) -> tuple[list[int], int, int]:
    """The one target call that verifies ``cands`` (the ``full`` strategy of
    :func:`target_blocks`): ``(tokens, start, off)``, the call's tokens from position
    ``start`` (:func:`call_start`: at least ``min_q`` wide where the committed prefix allows)
    and the row of the pending token in its output (verification rows ``[off, off + n + 1)``)."""
    pend, n = len(seq) - 1, len(cands)
    s = call_start(pend, pend + n + 1, valid, min_q)
    return seq[s:] + list(cands), s, pend - s


def end_round(
    d: Drafted, m: int, token: int, target_s: float, seq: list[int], n_prompt: int, kv: KVLengths, plan: Plan, acc: Acceptor, drafter: Drafter, policy=None
) -> Round:
    """The second half of :func:`one_round`, once :func:`verify` gave ``(m, token)``:
    commit, roll back, and the round's record (``target_s``: seconds of its verification)."""
    if policy is not None:
        policy.update(len(d.cands), m)
    observe = getattr(drafter, "observe", None)  # optional (Drafter's docstring)
    if observe is not None:
        observe(len(d.cands), m)
    new, ended, forced = commit_forced(commit(d.cands, m, token, plan.eos), d.seq_len, n_prompt, plan, acc)
    seq.extend(new)
    kv.target, kept = rollback_lengths(d.seq_len, drafter.kv, m)
    drafter.rollback(kept)
    finish = "stop" if ended else length_finish(seq, n_prompt, plan)
    return Round(
        pos=d.seq_len - n_prompt,
        steps=d.steps,
        n=len(d.cands),
        m=m,
        commit=new,
        finish=finish,
        draft_calls=drafter.model_calls,
        draft_s=d.t2 - d.t1 if d.steps else 0.0,
        target_s=d.t1 - d.t0 + target_s,
        calls=d.calls,
        pre=d.pre[0] if d.pre else None,
        forced=forced,
        forced_accepted=sum(1 for i in drafter.forced_steps if i < m),
    )


def one_round(target: Model, seq: list[int], n_prompt: int, kv: KVLengths, plan: Plan, acc: Acceptor, drafter: Drafter, policy=None) -> Round:
    """One round on ``seq`` (prompt + committed tokens; extended in place); see the module
    docstring. ``drafter``: the draft side (:mod:`specrt.runtime.drafters`: candidates, the
    draft model and its KV length); ``policy``: an :class:`~specrt.runtime.adaptive.AdaptiveK`
    choosing how many candidates this round may propose (None: up to ``k_max``).
    :func:`draft_round`, :func:`verify` over :func:`target_blocks`, :func:`end_round`."""
    d = draft_round(target, seq, n_prompt, kv, plan, acc, drafter, policy)
    m, token = verify(d.cands, target_blocks(target, seq, d.cands, kv.target, d.confs, plan, d.calls, acc), acc)
    return end_round(d, m, token, time.perf_counter() - d.t2, seq, n_prompt, kv, plan, acc, drafter, policy)


def catch_up(target: Model, seq: list[int], n_prompt: int, kv: KVLengths, plan: Plan, calls: list) -> int:
    """Bring the target's KV up to the pending token when output tokens were committed
    without a model call (a constraint's forced tokens, jump-forward), and return how many
    candidates this round's verification call may still carry.

    The missing tokens ride in the verification call, which must stay within the widths
    measured bit-identical (``plan.tail_q``, else the target's widest call): when they alone
    would not fit, they are fed first in chunks (:func:`~specrt.runtime.chunks.chunk_bounds`,
    the prefill's rule: the last chunk within the measured widths), each call appended to
    ``calls``. Speculative and target-only decoding meet the same forced tokens at the same
    positions, so both make the same calls for them. (A prompt shorter than ``min_q`` also
    leaves rows to the first round, as before: :func:`prefill`; those do not count here.)
    """
    pend = len(seq) - 1
    widest = plan.tail_q or target.max_q
    if pend - max(kv.target, n_prompt) <= 0:  # no forced token is missing
        return widest - 1
    if pend - kv.target + 1 > widest:
        at = kv.target
        for lo, hi in chunk_bounds(pend - at, target.max_q, plan.min_q, plan.tail_q, plan.avoid):
            run_tail(target, seq[at + lo : at + hi], at + lo, 0)  # KV only: no row is read
            calls.append((hi - lo, at + lo, hi - lo))
        kv.target = pend
    return widest - 1 - (pend - kv.target)


def commit_forced(committed: tuple[list[int], bool], seq_len: int, n_prompt: int, plan: Plan, acc: Acceptor) -> tuple[list[int], bool, int]:
    """A round's commit (:func:`~specrt.runtime.speculative.commit`) followed by the tokens a
    constraint forces after it (``acc.forced``, jump-forward), within the budget and the
    context; returns ``(tokens, ended, forced count)``."""
    new, ended = committed
    if ended:
        return new, True, 0
    total = seq_len + len(new)
    forced = acc.forced(min(plan.budget - (total - n_prompt), plan.max_ctx - total))
    return new + forced, bool(forced) and forced[-1] in plan.eos, len(forced)


def adaptive_policy(plan: Plan) -> AdaptiveK | None:
    """The adaptive-k policy of one generation (:class:`~specrt.runtime.adaptive.AdaptiveK`,
    a free draft step for a drafter without model calls, e.g. the n-gram), or None when
    ``plan.adaptive`` is off."""
    if plan.adaptive is None or not plan.speculative:
        return None
    target_s, draft_s, prior = plan.adaptive
    return AdaptiveK(target_s, 0.0 if drafter_is_free(plan.drafter) else draft_s, prior)


def length_finish(seq: list[int], n_prompt: int, plan: Plan) -> str | None:
    """ "length" when the budget or the context is used up (``seq`` = prompt + output), else None."""
    return "length" if len(seq) - n_prompt >= plan.budget or len(seq) >= plan.max_ctx else None


def prefill(target: Model, seq: list[int], plan: Plan, acc: Acceptor, kv: KVLengths, cached: KVPrefix | None = None) -> Round:
    """Run the prompt ``seq`` through the target (chunked, :func:`chunk_bounds`), append the
    first token (the acceptor's bonus at the last row) to ``seq`` and set ``kv.target`` and
    ``kv.aligned``; returns the prefill record (``pos`` 0). A prompt shorter than ``min_q``
    is run narrower and its rows are left to the first round to recompute (``kv.target``
    stays at the last chunk's start). Tokens a constraint forces before the first choice
    are output tokens fed with the prompt (and when they end the output, no model call is
    made). With ``cached`` (what the target's KV holds from an earlier request), the chunks
    below :func:`~specrt.runtime.prefix.reuse_target` are not run: the rest are the chunks a
    cold run makes, so every row and the output are the cold run's (under ``plan.any_layout``
    the rows below :func:`~specrt.runtime.prefix.reuse_any` are not run, the rest chunked
    from there: measured widths, the same rows)."""
    t0 = time.perf_counter()
    n_prompt = len(seq)
    head = acc.forced(min(plan.budget, plan.max_ctx - n_prompt))
    seq.extend(head)
    if head and (head[-1] in plan.eos or length_finish(seq, n_prompt, plan)):
        finish = "stop" if head[-1] in plan.eos else "length"
        return Round(pos=0, steps=[], n=0, m=0, commit=head, finish=finish, target_s=time.perf_counter() - t0, forced=len(head))
    n_fed = len(seq)
    reused, run, aligned = prefill_calls(cached, seq, target.max_q, plan.min_q, plan.tail_q, plan.avoid, plan.any_layout)
    for i, (a, b) in enumerate(run):
        rows = run_tail(target, seq[a:b], a, 1 if i == len(run) - 1 else 0)  # only the last row is read
    acc.start(n_fed)
    first = acc.bonus(0, rows[-1])
    new, ended, forced = commit_forced(([first], first in plan.eos), n_fed, n_prompt, plan, acc)
    seq.extend(new)
    lo, hi = run[-1]
    kv.target = n_fed if hi - lo >= plan.min_q else lo
    kv.aligned = aligned
    finish = "stop" if ended else length_finish(seq, n_prompt, plan)
    return Round(
        pos=0,
        steps=[],
        n=0,
        m=0,
        commit=head + new,
        finish=finish,
        target_s=time.perf_counter() - t0,
        calls=[(b - a, a, b - a) for a, b in run],
        forced=len(head) + forced,
        cached=reused,
    )


def bonus_round(seq: list[int], n_prompt: int, kv: KVLengths, plan: Plan, acc: Acceptor, row: np.ndarray, seconds: float, exact: bool = False) -> Round:
    """A round without candidates whose target row (the logits of the pending token
    ``seq[-1]`` at position ``kv.target``) was computed elsewhere, e.g. by a batched step
    over several generations: commits the acceptor's token (and what a constraint forces
    after it) and returns the record (``seconds``: this generation's share of the call;
    ``exact``: the call's rows are a batch-1 call's bit for bit, so its KV row stays
    reusable, else ``kv.batched_from`` marks it)."""
    acc.start(len(seq))
    tok = acc.bonus(0, row)
    if not exact and kv.batched_from is None:  # rows from here on are not a batch-1 call's (prefix reuse stops here)
        kv.batched_from = kv.target
    pos, seq_len = len(seq) - n_prompt, len(seq)
    new, ended, forced = commit_forced(([tok], tok in plan.eos), seq_len, n_prompt, plan, acc)
    seq.extend(new)
    kv.target += 1
    finish = "stop" if ended else length_finish(seq, n_prompt, plan)
    return Round(pos=pos, steps=[], n=0, m=0, commit=new, finish=finish, target_s=seconds, calls=[(1, kv.target - 1, 1)], forced=forced)


def observe_tail(rec: Round, drafter: Drafter, seq: list[int], n_prompt: int, plan: Plan, acc: Acceptor) -> Round:
    """``rec`` with its ``tail`` set when it ends the generation and ``plan.observe`` asks
    for it (greedy, a drafter with a draft model; :func:`_draft_tail`)."""
    if rec.finish is not None and plan.observe and acc.greedy and drafter.draft is not None:
        rec.tail = _draft_tail(drafter.draft, seq, n_prompt, drafter.kv, acc)
    return rec


def decode(target: Model, draft: Model, prompt: Sequence[int], plan: Plan, acc: Acceptor) -> Iterator[Round]:
    """Generate from ``prompt``: yields the prefill record (``pos`` 0, the first token),
    then one :class:`Round` per round until EOS, the budget or the context ends the output.

    Args:
        target, draft: the pair's :class:`~specrt.runtime.backends.base.Model` objects
            (their KV buffers are this generation's until it ends).
        prompt: token ids, ``1 <= len < max_ctx`` (validated by the caller).
        plan: :class:`Plan`. acc: the generation's :class:`Acceptor`.

    Raises:
        NumericsError: NaN/inf logits. InputError: a model call outside the buffers.
    """
    seq, kv = list(prompt), KVLengths()
    n_prompt = len(seq)
    if plan.argmax and not reads_reduced_rows(acc, target):  # a caller's acceptor may read whole rows (a LogprobRecorder does)
        plan = replace(plan, argmax=0)
    rec = prefill(target, seq, plan, acc, kv)
    drafter = plan_drafter(plan, draft, n_prompt)
    policy = adaptive_policy(plan)
    while True:
        yield observe_tail(rec, drafter, seq, n_prompt, plan, acc)
        if rec.finish is not None:
            return
        rec = one_round(target, seq, n_prompt, kv, plan, acc, drafter, policy)


def reads_reduced_rows(acc, target) -> bool:
    """Whether ``acc`` decides from each verification row's reduced token alone (``Plan.argmax``):
    the greedy acceptor, or a constraint over it (which gives the call its rows' penalty rows,
    ``penalties``, so the head reduces the masked, biased rows) on a ``target`` whose head
    takes them (``penalty_rows``)."""
    if type(acc) is GreedyAcceptor:
        return True
    return hasattr(acc, "penalties") and type(getattr(acc, "inner", None)) is GreedyAcceptor and bool(getattr(target, "penalty_rows", False))


def _draft_tail(draft: Model, seq: list[int], n_prompt: int, draft_kv: int, acc: Acceptor) -> tuple | None:
    """(observe) After the last round: the draft's (top-1, confidence) of the committed
    tokens it has not seen (one extra draft call, in no statistic), so a replay knows every
    on-trajectory position (specrt.runtime.lab.replay). None when there are none or they
    do not fit one call."""
    if not (0 < draft_kv < len(seq) - 1 <= draft_kv + draft.max_q):
        return None
    rows = feed(draft, seq[draft_kv:-1], draft_kv)
    return draft_kv + 1 - n_prompt, [acc.draft(r, 0) for r in rows]
