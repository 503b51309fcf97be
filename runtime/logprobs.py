"""Log-probabilities of the committed tokens under the *target's raw* distribution.

What is recorded (``GenerationConfig(logprobs=N)``): for every committed token, its
log-probability ``log_softmax(target_logits)[token]`` at temperature 1, before top-k and
top-p (vLLM's default "raw logprobs"), and the N most probable tokens of the same row with
theirs. Greedy: the token is the row's argmax. Under sampling the numbers are still the
model's own distribution, not the warped one the token was drawn from (so a sampled token's
logprob can be low, and top-k/top-p never show in them).

Where they come from: the verification rows the acceptance loop already reads.
:class:`LogprobRecorder` wraps the generation's acceptor (:class:`specrt.runtime.decode.Acceptor`)
and forwards every call unchanged; when a row's token is committed (an accepted candidate,
the correction after a rejection, the bonus token, the prefill's first token) it computes
that row's log-softmax *at that moment*: the chunked and lazy-head strategies overwrite
the logits buffers between blocks, so a row is never read later. The decode loop
(:mod:`specrt.runtime.decode`) is not changed; without ``logprobs`` no recorder exists and
nothing is computed.

Entries per round are in commit order (c_1..c_m, then the target's token); the Engine cuts
them as the round's commit is cut (after EOS), and again at a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .errors import raise_nonfinite

__all__ = ["TokenLogprob", "log_softmax", "token_logprob", "LogprobRecorder", "score_prompt"]


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability and the most probable alternatives at its position.

    Attributes:
        token: the token id.
        logprob: natural-log probability of ``token`` under the target's raw distribution
            (float, <= 0).
        top: ``((id, logprob), ...)``: the N most probable ids of the same distribution,
            most probable first (equal logprobs: lower id first); empty when N = 0.
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_softmax(row: np.ndarray, vocab: int) -> np.ndarray:
    """float64 ``[vocab]`` log-softmax of one logits row (padding ids >= ``vocab`` dropped).

    Args:
        row: ``[V_padded]`` logits, any float dtype (upcast to float64 first).
        vocab: real vocabulary size.

    Returns:
        ``row - max - log(sum(exp(row - max)))`` over the first ``vocab`` entries (a
        ``-inf`` logit gives ``-inf``).

    Raises:
        NumericsError: NaN or +inf in the row, or every entry -inf.
    """
    x = np.asarray(row[:vocab], dtype=np.float64)
    m = x.max()
    if not np.isfinite(m):
        raise_nonfinite(x)
    z = x - m
    return z - np.log(np.exp(z).sum())


def token_logprob(row: np.ndarray, vocab: int, token: int, top_n: int) -> TokenLogprob:
    """The :class:`TokenLogprob` of ``token`` at one logits row, with the ``top_n`` most
    probable ids (float64 arithmetic; one log-softmax over the vocabulary, then a partial
    sort of ``top_n`` entries).

    Raises:
        NumericsError: NaN or +inf in the row.
    """
    lp = log_softmax(row, vocab)
    top: tuple = ()
    if top_n > 0:
        n = min(top_n, vocab)
        idx = np.argpartition(-lp, n - 1)[:n] if n < vocab else np.arange(vocab)
        idx = idx[np.lexsort((idx, -lp[idx]))]  # logprob descending, then id ascending
        top = tuple((int(i), float(lp[i])) for i in idx)
    return TokenLogprob(int(token), float(lp[token]), top)


class LogprobRecorder:
    """An acceptor that forwards to ``inner`` and records the committed tokens' logprobs.

    Implements :class:`specrt.runtime.decode.Acceptor`: ``draft`` is forwarded untouched;
    ``accept`` records the candidate's entry when ``inner`` accepts it; ``correction`` and
    ``bonus`` record the token ``inner`` returns. The tokens are exactly ``inner``'s (its
    random draws are untouched). :meth:`take` hands out the entries since the last call.

    Args:
        inner: the real acceptor (greedy or sampled).
        vocab: real vocabulary size (ids >= vocab are padding rows).
        top_n: alternatives per token (0 = only the chosen token's logprob).

    Attributes:
        greedy, propose_below: ``inner``'s.
    """

    __slots__ = ("inner", "vocab", "top_n", "greedy", "propose_below", "_entries")

    def __init__(self, inner, vocab: int, top_n: int = 0):
        self.inner, self.vocab, self.top_n = inner, vocab, top_n
        self.greedy, self.propose_below = inner.greedy, inner.propose_below
        self._entries: list[TokenLogprob] = []

    def start(self, pos: int) -> None:
        """Forwarded."""
        self.inner.start(pos)

    def draft(self, row: np.ndarray, i: int) -> tuple[int, float]:
        """Forwarded (draft rows carry no target logprob)."""
        return self.inner.draft(row, i)

    def accept(self, r: int, x: int, row: np.ndarray) -> bool:
        """Forwarded; an accepted candidate's entry is recorded from ``row`` now."""
        forced = self.inner.forced_at(r)
        ok = self.inner.accept(r, x, row)
        if ok:
            self._entries.append(self._entry(row, x, forced))
        return ok

    def correction(self, r: int, row: np.ndarray) -> int:
        """Forwarded; the correction token's entry is recorded from ``row``."""
        forced = self.inner.forced_at(r)  # before the call: the round's grammar state ends with it
        t = self.inner.correction(r, row)
        self._entries.append(self._entry(row, t, forced))
        return t

    def bonus(self, r: int, row: np.ndarray) -> int:
        """Forwarded; the bonus (or first) token's entry is recorded from ``row``."""
        forced = self.inner.forced_at(r)
        t = self.inner.bonus(r, row)
        self._entries.append(self._entry(row, t, forced))
        return t

    def _entry(self, row: np.ndarray, t: int, forced: int | None) -> TokenLogprob:
        """A token's entry: from ``row``, or, where a constraint forced it, the forced entry
        (the same as :meth:`forced` records, so speculative and target-only runs list the
        same logprobs)."""
        if forced is not None and forced == t:
            return TokenLogprob(int(t), 0.0, ((int(t), 0.0),) if self.top_n else ())
        return token_logprob(row, self.vocab, t, self.top_n)

    def forced(self, limit: int) -> list[int]:
        """Forwarded; a forced token's entry is log-probability 0 (probability 1 under the
        constraint: no model row chose it, or the masked row allowed it alone), listed alone
        among its alternatives."""
        toks = self.inner.forced(limit)
        for t in toks:
            self._entries.append(TokenLogprob(int(t), 0.0, ((int(t), 0.0),) if self.top_n else ()))
        return toks

    def valid_prefix(self, tokens) -> int:
        """Forwarded."""
        return self.inner.valid_prefix(tokens)

    def forced_at(self, i: int):
        """Forwarded."""
        return self.inner.forced_at(i)

    def take(self) -> list[TokenLogprob]:
        """The entries recorded since the last call, in commit order."""
        out, self._entries = self._entries, []
        return out


def score_prompt(target, ids: Sequence[int], vocab: int, top_n: int) -> list[TokenLogprob | None]:
    """The prompt's own tokens scored by ``target`` (a
    :class:`~specrt.runtime.backends.base.Model`, one pass over ``ids`` in chunks of its
    widest call, from KV row 0): ``[None, entry of ids[1], ...]``, each entry from the raw
    distribution at the position before it with the ``top_n`` most probable ids."""
    out: list[TokenLogprob | None] = [None]
    step = target.max_q
    for lo in range(0, len(ids), step):
        rows = target.run(ids[lo : lo + step], lo)  # rows are overwritten by the next call: read them now
        for j in range(len(rows)):
            if lo + j + 1 < len(ids):
                out.append(token_logprob(rows[j], vocab, ids[lo + j + 1], top_n))
    return out
