"""Frequency-weighted suffix lookup for drafting from the conversation and from earlier
requests (SuffixDecoding: Oliaro et al. 2024, "SuffixDecoding: Extreme Speculative Decoding
for Emerging AI Applications", sections 3-4; Snowflake's Arctic Inference ships it).

Agents re-type what is in their context (file contents, tool results, earlier answers) and
repeat what earlier requests wrote. Prompt lookup (:class:`~specrt.runtime.drafters.NgramIndex`)
copies the tokens after the latest earlier occurrence of the sequence's last 2-4 tokens.
Here every context of ``min_n..max_n`` tokens counts the tokens that followed it
(:class:`SuffixIndex`), and a proposal is built token by token (:func:`propose`): the longest
context that matches the sequence's end picks its most frequent continuation (ties: the
latest), the empirical probability of that choice multiplies into the path's score, and the
proposal stops when the score falls below ``min_score``: a long copied span (every context
followed by one token) drafts up to ``k`` tokens, an ambiguous one drafts little or nothing
(the paper's adaptive speculation length).

:class:`SharedSuffixIndex` is one index over the committed tokens of a process's recent
requests (prompt and output, newest ``max_tokens`` kept), shared by every request of a server
(the paper's global tree). Drafts change only speed, never the output (the target verifies
every candidate: :mod:`specrt.runtime.drafters`), so one client's text reaching another's
drafts cannot reach its output; the timing of a request can still depend on other clients'
text, as with any shared cache.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Sequence

from .prefix import common_prefix

__all__ = ["SUFFIX_MIN", "SUFFIX_MAX", "SuffixIndex", "SharedSuffixIndex", "propose", "expected_accepted", "shared_index"]

SUFFIX_MIN, SUFFIX_MAX = 2, 8  # context lengths tried, longest first
MIN_SCORE = 0.1  # SuffixDecoding's threshold on the path's product of empirical probabilities


class SuffixIndex:
    """Counts of the token that followed every context of ``min_n..max_n`` tokens.

    ``counts[context][token] = (times seen, latest position)``. :meth:`add` indexes a
    sequence's positions ``[lo, len)`` (each context that ends before a token).

    Raises:
        ValueError: not ``1 <= min_n <= max_n``.
    """

    def __init__(self, min_n: int = SUFFIX_MIN, max_n: int = SUFFIX_MAX):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"suffix context lengths {min_n}..{max_n}; need 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n
        self.counts: dict[tuple, dict[int, list[int]]] = {}
        self.clock = 0  # positions indexed so far: the tie-break "latest"

    def add(self, seq: Sequence[int], lo: int = 0, sign: int = 1) -> None:
        """Count the continuations ``seq[end]`` of the contexts ending at ``end`` for ``end`` in
        ``[max(lo, min_n), len(seq))``; ``sign`` -1 takes a sequence's counts back out."""
        counts = self.counts
        for end in range(max(lo, self.min_n), len(seq)):
            tok = seq[end]
            self.clock += 1
            for n in range(self.min_n, min(self.max_n, end) + 1):
                key = tuple(seq[end - n : end])
                nxt = counts.get(key)
                if nxt is None:
                    if sign < 0:
                        continue
                    nxt = counts[key] = {}
                c = nxt.get(tok)
                if c is None:
                    if sign > 0:
                        nxt[tok] = [1, self.clock]
                    continue
                c[0] += sign
                if sign > 0:
                    c[1] = self.clock
                elif c[0] <= 0:
                    del nxt[tok]
                    if not nxt:
                        del counts[key]

    def next_token(self, tail: Sequence[int]) -> tuple[int, float, int] | None:
        """``(token, empirical probability, context length)`` of the most frequent continuation
        of the longest context that ends ``tail``, or None when no context matches."""
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            nxt = self.counts.get(tuple(tail[len(tail) - n :]))
            if nxt:
                tok, (c, _) = max(nxt.items(), key=lambda kv: (kv[1][0], kv[1][1]))
                return tok, c / sum(v[0] for v in nxt.values()), n
        return None


def propose(index: SuffixIndex, seq: Sequence[int], k: int, min_score: float = MIN_SCORE) -> tuple[list[int], list[float]]:
    """Up to ``k`` candidate tokens after ``seq`` from ``index`` (module docstring): each the
    most frequent continuation of the longest matching context, until the product of their
    empirical probabilities falls below ``min_score``.

    Returns:
        ``(tokens, scores)``: the candidates and the path's score after each (non-increasing,
        each >= ``min_score``); empty when the end of ``seq`` matches no context.
    """
    tail = list(seq[len(seq) - index.max_n :])
    toks, scores, score = [], [], 1.0
    for _ in range(k):
        got = index.next_token(tail)
        if got is None:
            break
        tok, p, _ = got
        score *= p
        if score < min_score:
            break
        toks.append(tok)
        scores.append(score)
        tail = tail[1:] + [tok] if len(tail) >= index.max_n else tail + [tok]
    return toks, scores


def expected_accepted(scores: Sequence[float]) -> float:
    """A proposal's expected accepted length when each score is the probability that the
    candidates up to it are all accepted (SuffixDecoding's tree score): their sum."""
    return float(sum(scores))


class SharedSuffixIndex:
    """A :class:`SuffixIndex` over the committed tokens of recent requests, shared by the
    requests of a process (module docstring), under a lock.

    Args:
        max_tokens: the most tokens kept; the oldest requests' counts are taken out first.

    Each request is a stream: :meth:`extend` indexes what it committed since its last call.
    """

    def __init__(self, max_tokens: int = 1 << 16, min_n: int = SUFFIX_MIN, max_n: int = SUFFIX_MAX):
        self.index = SuffixIndex(min_n, max_n)
        self.max_tokens = max_tokens
        self._lock = threading.Lock()
        self._seqs: OrderedDict[int, list[int]] = OrderedDict()  # request -> its tokens, oldest first
        self.tokens = 0

    def extend(self, key: int, seq: Sequence[int]) -> None:
        """Index request ``key``'s sequence ``seq`` from where its last call ended (a
        shorter or different ``seq``, e.g. after a rollback, is re-indexed from the
        divergence), then drop the oldest requests past ``max_tokens``."""
        with self._lock:
            old = self._seqs.pop(key, [])
            n = common_prefix(old, seq)
            if n < len(old):  # take back what changed (context runs up to max_n before it)
                self.index.add(old, n, sign=-1)
            self.index.add(seq, n)
            self.tokens += len(seq) - len(old)
            self._seqs[key] = list(seq)
            while self.tokens > self.max_tokens and len(self._seqs) > 1:
                _, first = self._seqs.popitem(last=False)
                self.index.add(first, 0, sign=-1)
                self.tokens -= len(first)

    def propose(self, seq: Sequence[int], k: int, min_score: float = MIN_SCORE) -> tuple[list[int], list[float]]:
        """:func:`propose` over the shared index."""
        with self._lock:
            return propose(self.index, seq, k, min_score)


_SHARED: SharedSuffixIndex | None = None
_SHARED_LOCK = threading.Lock()


def shared_index() -> SharedSuffixIndex:
    """This process's :class:`SharedSuffixIndex` (made on first use)."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = SharedSuffixIndex()
        return _SHARED
