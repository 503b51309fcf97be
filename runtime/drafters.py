"""Where a round's candidates come from: the draft model, the sequence itself (n-gram /
prompt lookup), or both.

Every drafter yields the round's draft *steps*, ``(token, confidence)`` one at a time and
only as pulled (:func:`specrt.runtime.speculative.propose` stops pulling at the threshold,
``n_max`` or EOS), and records each in ``steps``. The target verifies whatever is proposed
with the same acceptance loop, so the drafter changes only speed, never the output: greedy
output stays the target's own, sampled output its distribution.

* ``model`` (:class:`ModelDrafter`): the draft model, one call per step after feeding it the
  tokens it has not seen (Leviathan et al. 2023, Algorithm 1).
* ``ngram`` (:class:`NgramDrafter`): prompt lookup decoding (Saxena 2023; llama.cpp's
  ``ngram-simple``; Hugging Face's ``prompt_lookup_num_tokens``): the longest suffix of the
  sequence (``max_n`` down to ``min_n`` tokens) that occurred earlier, in the prompt or the
  output, proposes the tokens that followed its latest earlier occurrence. No model call.
* ``hybrid`` (:class:`HybridDrafter`): the n-gram proposal when the sequence has one, the
  draft model otherwise.
* ``suffix`` (:class:`SuffixDrafter`): frequency-weighted suffix lookup over the sequence and
  over the committed tokens of the process's recent requests (SuffixDecoding, Oliaro et al.
  2024; :mod:`specrt.runtime.suffix`): the proposal with the larger expected accepted
  length, its length adapted to how unambiguous the match is. No model call.
* ``suffix-model`` (:class:`SuffixModelDrafter`): per round, the suffix proposal or the draft
  model, whichever is expected to commit more tokens per second from the measured call costs
  (:func:`suffix_pays`: Leviathan et al. 2023, section 3.4's expected tokens per round over
  its cost, with the suffix path's score as its acceptance and the draft model's running
  acceptance); the draft model's rounds choose their own length the same way.

Under a constraint or a ``logit_bias`` (:mod:`specrt.runtime.constraints`) the acceptor
masks and biases every draft row as it does the target's, so the draft model proposes only
tokens the grammar allows and the bias does not ban, and an n-gram proposal is cut to its
longest allowed prefix (a one-hot row of a refused token would be masked into another
id). The sequence includes the whole prompt, so a fill-in-the-middle prompt's suffix (the
code after the gap) is looked up like the rest.

An n-gram proposal is a deterministic draft: its distribution is one-hot at the proposed
token, given to the acceptor as a logits row with every other id at -1e9 (``acc.draft``), so
exact speculative sampling (accept with probability p(x) / 1, else sample the residual p
without x) holds unchanged, and a greedy confidence is 1.
"""

from __future__ import annotations

import itertools
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol, Sequence

import numpy as np

from .adaptive import AdaptiveK
from .backends.base import DraftsTop1, Model
from .speculative import GreedyAcceptor
from .suffix import SharedSuffixIndex, SuffixIndex, expected_accepted, propose, shared_index

__all__ = [
    "DRAFTERS",
    "Drafter",
    "DrafterKind",
    "ModelDrafter",
    "one_hot_step",
    "NgramIndex",
    "NgramDrafter",
    "HybridDrafter",
    "SuffixDrafter",
    "SuffixModelDrafter",
    "suffix_pays",
    "make_drafter",
    "register_drafter",
    "drafter_names",
    "drafter_is_free",
]

DRAFTERS = ("model", "ngram", "hybrid", "suffix", "suffix-model")  # the built-in drafters (the CLI's choices)
NGRAM_MIN, NGRAM_MAX = 2, 4  # suffix lengths tried, longest first (HF's default lookup is 2..)


class Drafter(Protocol):
    """The draft side of one generation, as one object (llama.cpp's ``common_speculative``,
    vLLM's proposers): where candidates come from, the draft model and its KV length when
    there is one, and what the round cost it in model calls. The mask a constraint puts on
    each draft step comes through the acceptor (``acc.draft`` masks the row, ``acc.forced_at``
    names a forced step, ``acc.valid_prefix`` cuts a proposal): draft step r and target row r
    share one grammar state, so one owner computes its mask once for both.

    Attributes:
        draft: the draft :class:`~specrt.runtime.backends.base.Model` (None for a drafter
            without one).
        kv: rows the draft model's KV cache holds for the committed sequence (0 without a
            model); only :meth:`steps` advances it, only :meth:`rollback` shortens it.
        model_calls: draft model calls made for the steps pulled since the caller last
            set it to 0 (one per model step, the feed of unseen tokens included in the
            first; n-gram steps cost none).
        forced_steps: indices of the steps pulled since the caller last cleared it that a
            constraint forced (proposed without a model call).
        aligned: draft KV rows ``[0, aligned)`` computed in full aligned chunks of the
            draft's widest call, the ones a later request may reuse
            (:mod:`specrt.runtime.prefix`); a multiple of ``draft.max_q``.
    """

    draft: Model | None
    kv: int
    aligned: int
    model_calls: int
    forced_steps: list

    def steps(self, seq: list[int], acc, steps: list, pre: list | None) -> Iterator[tuple[int, float]]:
        """The round's draft steps over ``seq`` (prompt + committed, pending last).

        Args:
            acc: the :class:`~specrt.runtime.decode.Acceptor` (turns a row into a step).
            steps: every step pulled is appended here.
            pre: (observe) a list for the draft's top-1 of the pending token, or None.
        """
        ...

    def rollback(self, committed: int) -> None:
        """Keep only the KV rows of the first ``committed`` positions (rows beyond are
        stale and never read: :func:`~specrt.runtime.speculative.rollback_lengths`)."""
        ...

    # Optional: ``observe(proposed, accepted)``, called once per round after verification
    # with the round's candidate count and how many the target accepted
    # (:class:`SuffixModelDrafter` prices its draft model's rounds with it).


class ModelDrafter:
    """The draft model proposes (one call per step, as pulled). A step a constraint forces
    (``acc.forced_at``) is proposed without a call; the draft sees it with the next call.
    Under a plain greedy acceptor (nothing else reads the draft's rows) a draft that offers
    ``run_top1`` (specrt's kernels) gives each step's token and confidence straight from its
    reduced head, no logits row. The token is the same; the confidence equals numpy's to
    float32 rounding, so a step right at the threshold may be proposed where a traced run
    (full rows) would not, or the reverse: rounds may differ, the output cannot.

    Args:
        draft: the draft model. kv: rows its KV already holds for the sequence (prefix
            reuse: a multiple of ``draft.max_q``, :func:`~specrt.runtime.prefix.reuse_draft`).
    """

    def __init__(self, draft: Model, kv: int = 0):
        self.draft = draft
        self.kv = self.aligned = kv
        self._fed = False
        self.model_calls = 0
        self.forced_steps: list[int] = []
        self.row = np.full(draft.vocab, -1e9, np.float32)  # a forced step's one-hot row, reused

    def rollback(self, committed: int) -> None:
        self.kv = min(self.kv, committed)

    def steps(self, seq, acc, steps, pre) -> Iterator[tuple[int, float]]:
        from .chunks import feed

        draft = self.draft
        unseen = seq[self.kv :]  # tokens the draft's KV lacks (the first call feeds them)
        top1 = draft.run_top1 if pre is None and type(acc) is GreedyAcceptor and isinstance(draft, DraftsTop1) else None
        i = 0
        while True:
            f = acc.forced_at(i)
            if f is None and top1 is not None and self._fed and len(unseen) <= draft.max_q:
                step = top1(unseen, self.kv, acc.vocab, acc.inv_temp)
                self.kv += len(unseen)
                unseen = []
                self.model_calls += 1
            elif f is None:
                rows = feed(draft, unseen, self.kv, need=2)  # the step's row and `pre`'s
                if not self._fed:
                    # the first feed runs from an aligned length in max_q chunks, as a cold
                    # run's does: its full chunks over committed tokens are reusable
                    self._fed, self.aligned = True, (len(seq) // draft.max_q) * draft.max_q
                if pre is not None and i == 0 and len(rows) > 1:
                    pre.append(acc.draft(rows[-2], 0))
                self.kv += len(unseen)
                unseen = []
                step = acc.draft(rows[-1], i)
                self.model_calls += 1
            else:
                step = one_hot_step(self.row, f, acc, i)
                self.forced_steps.append(i)
            steps.append(step)
            yield step
            unseen.append(step[0])
            i += 1


def one_hot_step(row: np.ndarray, token: int, acc, i: int) -> tuple[int, float]:
    """Draft step i proposing ``token`` deterministically: the acceptor reads a one-hot draft
    row (``row``: a -1e9 buffer, restored after), so exact sampling holds with q(token) = 1."""
    row[token] = 0.0
    step = acc.draft(row, i)
    row[token] = -1e9
    return step


class NgramIndex:
    """The latest earlier occurrence of every n-gram of a growing sequence.

    ``table[ngram] = end`` where ``seq[end - n : end] == ngram`` and ``end < len(seq)`` (the
    n-gram has a continuation, ``seq[end]``); a later occurrence replaces an earlier one.
    :meth:`update` adds the n-grams that gained a continuation since the last call, so each
    position is indexed once per generation.
    """

    def __init__(self, min_n: int = NGRAM_MIN, max_n: int = NGRAM_MAX):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram lengths {min_n}..{max_n}; need 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n
        self.table: dict[tuple, int] = {}
        self.upto = 0

    def update(self, seq: Sequence[int]) -> None:
        """Index the n-grams ending at positions ``[upto, len(seq))`` (each followed by a token)."""
        for end in range(max(self.upto, self.min_n), len(seq)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.table[tuple(seq[end - n : end])] = end
        self.upto = len(seq)

    def continuation(self, seq: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
        suffix of ``seq`` (``max_n`` down to ``min_n`` tokens) found; [] when none is.
        Call :meth:`update` with ``seq`` first."""
        for n in range(min(self.max_n, len(seq)), self.min_n - 1, -1):
            end = self.table.get(tuple(seq[len(seq) - n :]))
            if end is not None:
                return list(seq[end : end + k])
        return []


class NgramDrafter:
    """Prompt lookup decoding (module docstring): no model call; a round with no match
    proposes nothing (a plain target step)."""

    draft = None  # no model: the draft's KV is left as it is

    def __init__(self, vocab: int, k_max: int, min_n: int = NGRAM_MIN, max_n: int = NGRAM_MAX, kv: int = 0):
        self.kv = self.aligned = kv  # the draft KV's reusable rows stay reusable
        self.index = NgramIndex(min_n, max_n)
        self.k_max = k_max
        self.model_calls = 0
        self.forced_steps: list[int] = []  # n-gram steps are free anyway: none is counted here
        self.row = np.full(vocab, -1e9, np.float32)  # the one-hot draft distribution, reused

    def proposal(self, seq: list[int], acc) -> list[int]:
        """This round's n-gram continuation of ``seq`` (indexed first), cut to the longest
        prefix the target's masked row allows (``acc.valid_prefix``: the grammar, and no
        token ``logit_bias`` bans; a refused candidate would waste the pass)."""
        self.index.update(seq)
        toks = self.index.continuation(seq, self.k_max)
        return self._allowed(toks, acc)

    @staticmethod
    def _allowed(toks: list[int], acc) -> list[int]:
        """``toks`` cut to the longest prefix the target's masked row allows."""
        return toks[: acc.valid_prefix(toks)] if toks else toks

    def rollback(self, committed: int) -> None:
        pass

    def steps(self, seq, acc, steps, pre) -> Iterator[tuple[int, float]]:
        return self._one_hot(self.proposal(seq, acc), acc, steps)

    def _one_hot(self, tokens: list[int], acc, steps: list) -> Iterator[tuple[int, float]]:
        for i, t in enumerate(tokens):
            step = one_hot_step(self.row, t, acc, i)
            steps.append(step)
            yield step


class _ModelSide:
    """A lookup drafter's draft model (``self.model``, a :class:`ModelDrafter`): the model's
    call count, forced steps, KV length and reusable rows are the drafter's (the lookup's
    own assignments in ``NgramDrafter.__init__`` are ignored). Set ``self.model`` before
    the lookup's ``__init__`` runs."""

    model: ModelDrafter

    @property
    def model_calls(self) -> int:
        return self.model.model_calls

    @model_calls.setter
    def model_calls(self, n: int) -> None:
        self.model.model_calls = n

    @property
    def draft(self) -> Model:
        return self.model.draft

    @property
    def forced_steps(self) -> list:
        return self.model.forced_steps

    @forced_steps.setter
    def forced_steps(self, v: list) -> None:
        pass  # NgramDrafter.__init__ sets its own: the model's list is the one counted

    @property
    def kv(self) -> int:
        return self.model.kv

    @kv.setter
    def kv(self, n: int) -> None:
        pass  # NgramDrafter.__init__ sets its own: the model drafter's is the one kept

    @property
    def aligned(self) -> int:
        return self.model.aligned

    @aligned.setter
    def aligned(self, n: int) -> None:
        pass

    def rollback(self, committed: int) -> None:
        self.model.rollback(committed)


class HybridDrafter(_ModelSide, NgramDrafter):
    """The n-gram proposal when the sequence has one, else the draft model."""

    def __init__(self, draft: Model, vocab: int, k_max: int, min_n: int = NGRAM_MIN, max_n: int = NGRAM_MAX, kv: int = 0):
        self.model = ModelDrafter(draft, kv)  # first: NgramDrafter.__init__ sets model_calls
        super().__init__(vocab, k_max, min_n, max_n)

    def steps(self, seq, acc, steps, pre) -> Iterator[tuple[int, float]]:
        toks = self.proposal(seq, acc)
        return self._one_hot(toks, acc, steps) if toks else self.model.steps(seq, acc, steps, pre)


class SuffixDrafter(NgramDrafter):
    """Suffix lookup (module docstring, :mod:`specrt.runtime.suffix`): this generation's own
    :class:`~specrt.runtime.suffix.SuffixIndex` and, unless ``shared`` is None, the process's
    :class:`~specrt.runtime.suffix.SharedSuffixIndex`, which this generation's committed
    tokens join as they come; each round proposes the path with the larger expected accepted
    length. No model call; a round with no match proposes nothing."""

    _keys = itertools.count()

    def __init__(self, vocab: int, k_max: int, kv: int = 0, shared: SharedSuffixIndex | None = None):
        super().__init__(vocab, k_max, kv=kv)
        self.local, self.upto = SuffixIndex(), 0
        self.shared, self.key = shared, next(self._keys)

    def proposal(self, seq: list[int], acc) -> list[int]:
        """This round's candidates (class docstring), cut to the longest prefix the target's
        masked row allows (as :meth:`NgramDrafter.proposal`)."""
        return self.scored_proposal(seq, acc)[0]

    def scored_proposal(self, seq: list[int], acc) -> tuple[list[int], list[float]]:
        """:meth:`proposal` with its path scores (:func:`~specrt.runtime.suffix.propose`),
        both cut to the allowed prefix."""
        self.local.add(seq, self.upto)
        self.upto = len(seq)
        toks, scores = propose(self.local, seq, self.k_max)
        if self.shared is not None:
            self.shared.extend(self.key, seq)
            other, s2 = self.shared.propose(seq, self.k_max)
            if expected_accepted(s2) > expected_accepted(scores):
                toks, scores = other, s2
        toks = self._allowed(toks, acc)
        return toks, scores[: len(toks)]


def suffix_pays(scores: Sequence[float], target_s: Sequence[float], model_rate: float) -> bool:
    """Whether a suffix proposal is expected to commit more tokens per second than the draft
    model's best round (Leviathan et al. 2023, section 3.4: expected tokens per round over
    the round's cost).

    Args:
        scores: the proposal's path scores (:func:`~specrt.runtime.suffix.propose`; score i is
            the probability that candidates 0..i are all accepted), length n >= 1.
        target_s: seconds of a target call by width (``target_s[q - 1]``, q = 1..); a
            proposal longer than the widest measured call is priced at the widest.
        model_rate: the draft model's best expected tokens per second
            (:meth:`~specrt.runtime.adaptive.AdaptiveK.rate` at its chosen length).

    Returns:
        ``(1 + sum(scores)) / target_s[n] >= model_rate``: the suffix round is free to
        draft, so its cost is the verification call alone.
    """
    n = min(len(scores), len(target_s) - 1)
    return (1.0 + expected_accepted(scores[:n])) / target_s[n] >= model_rate


def catch_up_pays(catch_up_s: float, model_rate: float, other_rate: float, horizon: int) -> bool:
    """Whether feeding the draft model the tokens it has not seen is worth it now: the draft
    model's rounds save ``1 / other_rate - 1 / model_rate`` seconds a token against the other
    option (the suffix proposal, or target-only steps), and that saving over the next
    ``horizon`` tokens must exceed the one-off catch-up (a rent-or-buy rule: pay a fixed cost
    once the use it buys is expected to cover it). A free catch-up always pays.

    Args:
        catch_up_s: seconds to feed the unseen tokens (>= 0).
        model_rate, other_rate: expected tokens per second of a model round and of the
            alternative (> 0).
        horizon: tokens the saving is counted over (>= 0).
    """
    if catch_up_s <= 0:
        return True  # nothing to pay
    saving = 1.0 / other_rate - 1.0 / model_rate
    return saving > 0 and saving * horizon > catch_up_s


# seconds a token of the draft model's catch-up feed (its wide calls), measured per draft model
# by SuffixModelDrafter and kept for the process's later requests (speed only, never output)
_FEED_S: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
FEED_GUESS = 0.125  # a fed token's cost as a fraction of a 1-row draft step, until one is measured
HORIZON_MIN = 32  # tokens a catch-up is amortized over at a request's start


class SuffixModelDrafter(_ModelSide, SuffixDrafter):
    """Per round, the suffix proposal (:class:`SuffixDrafter`) or the draft model, whichever
    :func:`suffix_pays` expects to commit more tokens per second; the draft model's rounds
    draft the length its own running acceptance and the costs favour
    (:class:`~specrt.runtime.adaptive.AdaptiveK` over the draft model's rounds alone).

    A draft model that has fallen behind (the suffix path's rounds, a new prompt not in its
    prefix cache) must first be fed the tokens it has not seen. That catch-up is priced:
    :func:`catch_up_pays` over a horizon of the tokens generated so far (at least
    :data:`HORIZON_MIN`: a request is expected to go on about as long as it has run), else
    the round takes the suffix proposal, or none (a target-only step). A model whose best
    length is 0 is not priced: its round drafts nothing, or its probe. A fed token's seconds
    are measured on each catch-up that called the model, per draft model (a guess,
    :data:`FEED_GUESS` of a draft step, before the first). The horizon never runs past
    ``end``: a catch-up near the request's last tokens has few tokens left to pay it back.

    Args:
        draft, vocab, k_max, kv, shared: as :class:`ModelDrafter` and :class:`SuffixDrafter`.
        costs: ``(target_s, draft_s, prior)`` (the plan's measured costs and tuned acceptance,
            :class:`~specrt.runtime.adaptive.AdaptiveK`'s arguments), or None: no measured
            costs, the suffix proposal whenever there is one (as :class:`HybridDrafter`).
        end: the sequence length (prompt + output) the generation stops at, at the latest
            (its token budget or the context), or None: unknown.
    """

    def __init__(self, draft: Model, vocab: int, k_max: int, kv: int = 0, shared: SharedSuffixIndex | None = None, costs=None, end: int | None = None):
        self.model = ModelDrafter(draft, kv)  # first: the lookup's __init__ sets model_calls
        super().__init__(vocab, k_max, kv=kv, shared=shared)
        self.costs = AdaptiveK(*costs) if costs is not None else None
        self.model_round = False  # whether the round in flight is the draft model's
        self.start = None  # the sequence's length at the first round (the prompt)
        self.end = end

    def feed_s(self) -> float:
        """Seconds a token of the draft model's catch-up (measured, or the guess)."""
        try:
            return _FEED_S.get(self.model.draft, FEED_GUESS * self.costs.draft_s)
        except TypeError:  # a draft model that cannot be weakly referenced: the guess
            return FEED_GUESS * self.costs.draft_s

    def horizon(self, n: int) -> int:
        """Tokens a catch-up at sequence length ``n`` is amortized over: those generated so
        far, at least :data:`HORIZON_MIN`, and never more than remain before ``end``."""
        h = max(HORIZON_MIN, n - self.start)
        return h if self.end is None else max(0, min(h, self.end - n))

    def steps(self, seq, acc, steps, pre) -> Iterator[tuple[int, float]]:
        toks, scores = self.scored_proposal(seq, acc)
        k = self.costs
        if k is None:
            self.model_round = not toks
            return self.model.steps(seq, acc, steps, pre) if self.model_round else self._one_hot(toks, acc, steps)
        self.start = len(seq) if self.start is None else self.start
        n = k.best(self.k_max)  # the draft model's best length, looked at without a probe's count
        rate = k.rate(n) if n > 0 else 1.0 / k.target_s[0]
        suffix = bool(toks) and suffix_pays(scores, k.target_s, rate)
        unseen = len(seq) - self.model.kv
        behind = unseen - (self.k_max + 1)  # beyond what a model round feeds anyway
        # n == 0: the model's round drafts nothing (or its probe, one candidate every
        # probe_every of its rounds), so it is not priced: its probe keeps counting
        if not suffix and behind > 0 and n > 0:
            m = min(len(toks), len(k.target_s) - 1)
            other = (1.0 + expected_accepted(scores[:m])) / k.target_s[m]  # toks, or a target-only step
            suffix = not catch_up_pays(behind * self.feed_s(), rate, other, self.horizon(len(seq)))
        self.model_round = not suffix
        if suffix:
            return self._one_hot(toks, acc, steps)  # no toks: no candidates, a target-only step
        # the model's own decision (probes after its rounds at 0): suffix rounds do not count
        gen = self.model.steps(seq, acc, steps, pre)
        return itertools.islice(self._timed(gen, unseen) if behind > 0 else gen, k.choose(self.k_max))

    def _timed(self, gen: Iterator[tuple[int, float]], unseen: int) -> Iterator[tuple[int, float]]:
        """``gen``'s steps; its first step, which feeds the ``unseen`` tokens, is timed and sets
        the draft model's seconds a fed token (one draft step's own seconds taken off)."""
        t0, calls = time.perf_counter(), self.model.model_calls
        step = next(gen, None)
        if step is None:
            return
        if self.model.model_calls > calls:  # a forced first step feeds nothing: nothing measured
            try:
                _FEED_S[self.model.draft] = max(0.0, time.perf_counter() - t0 - self.costs.draft_s) / unseen
            except TypeError:  # a draft model that cannot be weakly referenced keeps the guess
                pass
        yield step
        yield from gen

    def observe(self, proposed: int, accepted: int) -> None:
        """The round's outcome (:func:`~specrt.runtime.decode.end_round`): a draft-model
        round's counts update the model's running acceptance."""
        if self.model_round and self.costs is not None:
            self.costs.update(proposed, accepted)


@dataclass(frozen=True)
class DrafterKind:
    """One drafter name's recipe.

    Attributes:
        make: ``make(draft, vocab, k_max, kv) -> Drafter`` for one generation: ``draft`` the
            engine's draft :class:`~specrt.runtime.backends.base.Model` (a drafter may ignore
            it), ``vocab`` the width of a draft logits row, ``k_max`` the most candidates a
            round may propose, ``kv`` the draft KV rows the prefix cache already holds for
            this prompt (0 for a drafter that does not use the draft model).
        free: its steps cost no model call, so adaptive k prices a draft step at 0 s
            (:func:`specrt.runtime.decode.adaptive_policy`).
        costs: ``make`` also takes ``costs`` (the plan's ``(target_s, draft_s, prior)`` or
            None) and ``end`` (the sequence length the generation stops at, or None), as
            positional arguments after ``kv``, and prices its own model steps, so adaptive k
            prices its steps at 0 s.
    """

    make: Callable[..., Drafter]
    free: bool = False
    costs: bool = False


_KINDS: dict[str, DrafterKind] = {
    "model": DrafterKind(lambda draft, vocab, k_max, kv: ModelDrafter(draft, kv)),
    "ngram": DrafterKind(lambda draft, vocab, k_max, kv: NgramDrafter(vocab, k_max, kv=kv), free=True),
    "hybrid": DrafterKind(lambda draft, vocab, k_max, kv: HybridDrafter(draft, vocab, k_max, kv=kv)),
    "suffix": DrafterKind(lambda draft, vocab, k_max, kv: SuffixDrafter(vocab, k_max, kv=kv, shared=shared_index()), free=True),
    "suffix-model": DrafterKind(
        lambda draft, vocab, k_max, kv, costs, end: SuffixModelDrafter(draft, vocab, k_max, kv=kv, shared=shared_index(), costs=costs, end=end), costs=True
    ),
}


def register_drafter(name: str, make: Callable[[Model, int, int, int], Drafter], *, free: bool = False) -> None:
    """Make ``name`` a drafter every entry point of this process accepts
    (``GenerationConfig(drafter=name)``, ``Engine.generate``, an in-process server's
    ``drafter`` field); docs/howto/drafter.md walks through one.

    Args:
        name: the drafter's name; a built-in (:data:`DRAFTERS`) cannot be replaced.
        make: ``make(draft, vocab, k_max, kv) -> Drafter``, called once per generation
            (:class:`DrafterKind`).
        free: True when its steps call no model (adaptive k then prices them at 0 s).

    Raises:
        ValueError: an empty or built-in name, or ``make`` not callable.
    """
    if not isinstance(name, str) or not name or name in DRAFTERS:
        raise ValueError(f"drafter name {name!r}: give a non-empty name other than the built-ins {', '.join(DRAFTERS)}")
    if not callable(make):
        raise ValueError(f"drafter {name!r}: make must be callable as make(draft, vocab, k_max, kv), got {type(make).__name__}")
    _KINDS[name] = DrafterKind(make, bool(free))


def drafter_names() -> tuple[str, ...]:
    """Every drafter name this process accepts: the built-ins, then the registered ones."""
    return tuple(_KINDS)


def drafter_is_free(name: str) -> bool:
    """Whether adaptive k prices drafter ``name``'s steps at 0 s: it drafts without a model
    call, or prices its own model steps (:attr:`DrafterKind.costs`); False for an unknown name."""
    kind = _KINDS.get(name)
    return kind is not None and (kind.free or kind.costs)


def make_drafter(name: str, draft: Model, vocab: int, k_max: int, kv: int = 0, costs=None, end: int | None = None) -> Drafter:
    """The drafter ``name`` (one of :func:`drafter_names`) of one generation; ``kv``: rows
    the draft's KV already holds for its prompt (prefix reuse, a multiple of ``draft.max_q``);
    ``costs``: the plan's measured ``(target_s, draft_s, prior)`` or None, and ``end``: the
    sequence length the generation stops at, at the latest (prompt + budget, within the
    context) or None, both for a drafter that prices its own steps
    (:attr:`DrafterKind.costs`; the others ignore them).

    Raises:
        ValueError: an unknown name.
    """
    kind = _KINDS.get(name)
    if kind is None:
        raise ValueError(f"drafter={name!r}; choose one of {', '.join(_KINDS)}")
    return kind.make(draft, vocab, k_max, kv, costs, end) if kind.costs else kind.make(draft, vocab, k_max, kv)
