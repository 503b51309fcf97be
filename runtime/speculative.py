"""The speculative-decoding algorithm as small pure functions (no model calls, no I/O).

Names follow Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding" (ICML), Algorithm 1: ``q`` is the draft (approximation) model's distribution,
``p`` the target's; ``gamma`` (here ``k``) the number of candidates per round. For greedy
decoding the acceptance rule degenerates to "candidate == argmax p", which makes the
output identical to the target's own greedy output (Leviathan et al. 2023, section 3.3).

Sequence bookkeeping used by the decode loop (``S`` = prompt + committed tokens; the last
token of ``S`` is *pending*: committed, but not yet in the target's KV cache)::

    target KV holds S[:-1]          (length len(S) - 1)
    draft  KV holds S[:draft_len]   (draft_len <= len(S) - 1 between rounds)

The greedy acceptor (:class:`GreedyAcceptor`) lives here; the sampled one in
:mod:`specrt.runtime.sampling`; the acceptance loop that drives either is
:func:`specrt.runtime.decode.verify`.
"""

from __future__ import annotations

from typing import Container, Iterable, Sequence

import numpy as np

from .errors import NumericsError, raise_nonfinite

__all__ = [
    "Unconstrained",
    "top1",
    "argmax_token",
    "draft_limit",
    "propose",
    "commit",
    "rollback_lengths",
    "chunk_sizes",
    "chunk_passes",
    "head_blocks",
    "GreedyAcceptor",
]


def top1(logits_row: np.ndarray, vocab: int, scratch: np.ndarray | None = None, inv_temp: float = 1.0) -> tuple[int, float]:
    """Greedy token and its softmax probability from one logits row.

    Args:
        logits_row: ``[V_padded]`` logits of one position, float32 or float64 (float16 and
            other narrower floats are upcast to float32 first, so no exponential or sum is
            ever formed in half precision).
        vocab: real vocab size; ids >= vocab (padding rows) are never returned.
        scratch: optional float32 ``[>= vocab]`` work buffer (avoids an allocation).
        inv_temp: 1 / T of the *confidence* (draft calibration, :mod:`specrt.runtime.calibration`;
            Guo et al. 2017, section 4.2): the probability returned is
            softmax(logits[:vocab] / T)[token_id]. The token is the argmax whatever T is
            (T > 0 does not change the order), so only the confidence changes. 1.0 (the
            default) takes exactly the code path without scaling (bit-identical results).

    Returns:
        ``(token_id, probability)`` where probability = softmax(logits[:vocab] / T)[token_id],
        computed in float32 or the logits' wider dtype, max-subtracted so it cannot
        overflow (logits of +-1e5 or more are fine).

    Raises:
        NumericsError: NaN or inf in the row.
    """
    row = logits_row[:vocab]
    if row.dtype.itemsize < 4:  # float16 / bfloat16-like: upcast before any arithmetic
        row = row.astype(np.float32)
    idx = int(row.argmax())
    m = row[idx]
    if not np.isfinite(m):  # argmax returns the first NaN if there is one
        raise_nonfinite(row)
    if scratch is None:
        z = np.exp(row - m) if inv_temp == 1.0 else np.exp((row - m) * inv_temp)
    else:
        z = scratch[:vocab]
        np.subtract(row, m, out=z)
        if inv_temp != 1.0:
            np.multiply(z, inv_temp, out=z)
        np.exp(z, out=z)
    s = float(z.sum())
    if not np.isfinite(s):
        raise_nonfinite(row)
    return idx, 1.0 / s


def argmax_token(logits_row: np.ndarray, vocab: int) -> int:
    """Greedy token of one logits row (ids >= ``vocab`` excluded), or of a row the target's
    argmax head already reduced to its token (0-d int: ``Plan.argmax``; -1 where the row's
    maximum was not finite).

    Raises:
        NumericsError: NaN or inf where the maximum is.
    """
    if logits_row.ndim == 0:  # the argmax head's token (runtime.decode.Plan.argmax)
        t = int(logits_row)
        if t < 0:
            raise NumericsError("model produced non-finite logits (NaN or inf at a row's maximum, found by the argmax head); refusing to emit a token")
        return t
    row = logits_row[:vocab]
    idx = int(row.argmax())
    if not np.isfinite(row[idx]):
        raise_nonfinite(row)
    return idx


def draft_limit(k_max: int, remaining: int, seq_len: int, max_ctx: int) -> int:
    """Most candidates a round may draft so that nothing overshoots.

    A round commits at most n+1 tokens (n candidates + correction/bonus), so
    ``n <= remaining - 1`` keeps the output within ``max_new_tokens``; and the sequence
    after the round must fit the context, ``seq_len + n + 1 <= max_ctx``.

    Args:
        k_max: configured maximum candidates per round (>= 1).
        remaining: tokens still allowed by ``max_new_tokens`` (>= 1).
        seq_len: len(S), prompt + committed, pending token included.
        max_ctx: context size of the engines.

    Returns:
        n_max >= 0 (0 means: run the target alone for this round).
    """
    return max(0, min(k_max, remaining - 1, max_ctx - seq_len - 1))


def propose(
    steps: Iterable[tuple[int, float]], n_max: int, threshold: float, eos: Container[int], propose_below: bool = False
) -> tuple[list[int], list[float]]:
    """Confidence-threshold drafting: the candidates of one round from the draft's steps.

    Pulls ``(token, confidence)`` steps one at a time (the decode loop's iterator runs one
    draft call per step, so a step that is not pulled is never computed; the replay's
    iterator reads recorded steps) and stops:

    * greedy (``propose_below`` False): *before* a step whose confidence is below
      ``threshold`` (the token is not proposed; exact, since it precedes the proposal);
    * sampling (``propose_below`` True): *after* a step whose warped q(x) is below it (the
      token is still proposed: dropping x when q(x) is small would make the proposals
      follow q restricted to {q >= threshold}, not q, and the ratio p/q would then bias the
      output; stopping after x only shortens the round, a decision from the draft's own
      information, so the output stays exactly p);
    * at ``n_max`` candidates, or after proposing an end-of-generation id (``eos``).

    Args:
        steps: iterable of (token id, confidence in [0, 1]).
        n_max: most candidates (:func:`draft_limit`); 0 proposes nothing and pulls no step.
        threshold: in [0, 1]; 0 = fixed ``n_max``.
        eos: the end-of-generation ids (a set: every id the checkpoint ends on).
        propose_below: the sampling rule (above).

    Returns:
        ``(candidates, confidences)``: lists of equal length <= n_max.

    Source: confidence-threshold drafting as Hugging Face assisted generation's
    ``assistant_confidence_threshold``; Leviathan et al. 2023, Algorithm 1 (the proposals).
    """
    cands: list[int] = []
    confs: list[float] = []
    if n_max <= 0:
        return cands, confs
    for tok, conf in steps:
        below = conf < threshold
        if below and not propose_below:
            break
        cands.append(tok)
        confs.append(conf)
        if below or len(cands) == n_max or tok in eos:
            break
    return cands, confs


def commit(candidates: Sequence[int], n_accepted: int, token: int, eos: Container[int]) -> tuple[list[int], bool]:
    """Tokens one round commits: the accepted candidates, then the target's token
    (correction or bonus), cut after the first end-of-generation id.

    Args:
        eos: the end-of-generation ids (a set).

    Returns:
        ``(tokens, ended)``: ``ended`` is True when an end-of-generation id is among them.
    """
    new = list(candidates[:n_accepted])
    new.append(token)
    for i, t in enumerate(new):
        if t in eos:
            return new[: i + 1], True
    return new, False


def rollback_lengths(seq_len_before: int, draft_len: int, n_accepted: int) -> tuple[int, int]:
    """KV lengths after a round (the only state that rolls back).

    Args:
        seq_len_before: len(S) at the start of the round (pending token included).
        draft_len: draft KV rows after drafting (it fed S and c_1..c_{n-1}).
        n_accepted: accepted candidates m.

    Returns:
        ``(target_len, draft_len)``: the target verified [pending, c_1..c_n] and keeps
        the rows up to c_m, ``seq_len_before + m``; the draft keeps its rows that are
        still on the committed path, ``min(draft_len, seq_len_before + m)``. Rows beyond
        are stale and get overwritten later; they are never read.
    """
    target_len = seq_len_before + n_accepted
    return target_len, min(draft_len, target_len)


# ---- verification strategies ----------------------------------------------------------


def chunk_sizes(confidences: Sequence[float], bound: float) -> list[int]:
    """Split n candidates into consecutive chunks from the draft's confidences.

    A chunk grows candidate by candidate and ends at the first candidate at which the
    product of the confidences since the chunk's start is <= ``bound`` (that candidate is
    the chunk's last). The product estimates the chance that the target accepts every
    candidate of the chunk so far (for a calibrated draft), so a chunk ends where running
    further in the same target pass is more likely wasted than not; the next chunk is run
    only when the previous one was accepted, and its product restarts at 1 (conditioned
    on that acceptance). ``bound = 1`` gives one candidate per chunk; a bound below every
    product gives one chunk (the ``full`` strategy).

    Args:
        confidences: n draft probabilities of the proposed candidates, floats in [0, 1]
            (greedy: the draft's top-1 probability; sampling: the warped q(x) of the
            sampled x).
        bound: number in (0, 1] (``GenerationConfig.chunk_bound``).

    Returns:
        ``list[int]`` of chunk sizes, each >= 1, summing to n (``[]`` for n = 0).

    Source: the rule asked for in issue 6 ("verify first up to the point where the
    cumulative product of draft probabilities falls below a bound"); the product as
    the expected acceptance of a prefix follows Leviathan et al. 2023, section 3.5
    (acceptance of gamma tokens modelled as independent with rate alpha).
    """
    sizes: list[int] = []
    size, prod = 0, 1.0
    for c in confidences:
        size += 1
        prod *= c
        if prod <= bound:
            sizes.append(size)
            size, prod = 0, 1.0
    if size:
        sizes.append(size)
    return sizes


def chunk_passes(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Target passes of ``chunked`` verification, as ranges over ``[pending, c_1..c_n]``.

    Pass j feeds tokens ``[lo, hi)`` of that list (``lo`` = 0 is the pending token) at KV
    offset ``seq_len - 1 + lo``, and its logits row r is row ``lo + r`` of a full pass: it
    verifies candidate c_{lo+r+1}, or gives the bonus token when ``lo + r == n``. So the
    first pass is the pending token + chunk 1, each later pass is its chunk alone, and a
    pass's last row verifies the next chunk's first candidate.

    Args:
        sizes: :func:`chunk_sizes` output (each >= 1, summing to n).

    Returns:
        ``[(lo, hi), ...]`` covering ``[0, n + 1)`` in order; ``[(0, 1)]`` for n = 0.
    """
    passes = []
    lo, hi = 0, 1
    for s in sizes:
        hi += s
        passes.append((lo, hi))
        lo = hi
    return passes or [(0, 1)]


def head_blocks(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Row blocks projected by the LM head in ``lazy-head`` verification.

    Block j holds the logits rows that verify chunk j's candidates (row i verifies
    c_{i+1}); the bonus row n joins the last block. Blocks after a rejection are never
    projected.

    Args:
        sizes: :func:`chunk_sizes` output (each >= 1, summing to n).

    Returns:
        ``[(lo, hi), ...]`` row ranges covering ``[0, n + 1)`` in order; ``[(0, 1)]`` for n = 0.
    """
    blocks = []
    lo = 0
    for s in sizes:
        blocks.append((lo, lo + s))
        lo += s
    if not blocks:
        return [(0, 1)]
    blocks[-1] = (blocks[-1][0], lo + 1)
    return blocks


# ---- the greedy acceptor ---------------------------------------------------------------
class Unconstrained:
    """The :class:`~specrt.runtime.decode.Acceptor` methods of an acceptor without a
    constraint (a :class:`~specrt.runtime.constraints.ConstrainedAcceptor` wraps one to add
    it): nothing is forced, every token allowed; and, unless it keys draws by position
    (:class:`~specrt.runtime.coupling.CoupledAcceptor`), nothing depends on the position."""

    __slots__ = ()

    def start(self, pos: int) -> None:
        """Nothing depends on the position."""
        return None

    def forced(self, limit: int) -> list[int]:
        """No constraint: nothing is forced."""
        return []

    def valid_prefix(self, tokens) -> int:
        """No constraint: every token is allowed."""
        return len(tokens)

    def forced_at(self, i: int) -> None:
        """No constraint: no draft step is forced."""
        return None


class GreedyAcceptor(Unconstrained):
    """Greedy proposal and acceptance (Leviathan et al. 2023, section 3.3: with one-hot p
    and q the acceptance rule is "candidate == argmax p", so the output is the target's own
    greedy output). Used by :func:`specrt.runtime.decode.verify` and the decode loop.

    Args:
        vocab: real vocabulary size (ids >= vocab, padding rows, are never chosen).
        draft_width: width of the draft's logits rows (sizes the float32 scratch buffer).
        inv_temp: 1 / T of the draft's *confidence* (calibration; never changes the token).

    Attributes:
        greedy: True (traces record the draft's top-1 only for greedy runs).
        propose_below: False: a draft token below the threshold is not proposed.
    """

    greedy = True
    propose_below = False
    __slots__ = ("vocab", "inv_temp", "scratch", "_last")

    def __init__(self, vocab: int, draft_width: int, inv_temp: float = 1.0):
        self.vocab, self.inv_temp = vocab, inv_temp
        self.scratch = np.empty(draft_width, np.float32)  # top1's softmax work buffer, reused
        self._last = -1

    def draft(self, row: np.ndarray, i: int) -> tuple[int, float]:
        """Candidate ``i`` of a round and its confidence from a draft logits row: the
        argmax and its softmax(logits / T) probability (:func:`top1`)."""
        return top1(row, self.vocab, self.scratch, self.inv_temp)

    def accept(self, r: int, x: int, row: np.ndarray) -> bool:
        """Does target row r (the position before candidate x) choose x?"""
        self._last = t = argmax_token(row, self.vocab)
        return t == x

    def correction(self, r: int, row: np.ndarray) -> int:
        """The target's token at row r after it rejected its candidate (the argmax that
        :meth:`accept` just computed for this row)."""
        return self._last

    def bonus(self, r: int, row: np.ndarray) -> int:
        """The target's token at row r when there is no candidate to check (all accepted,
        the prefill's first token, or a target-only step): the argmax."""
        return argmax_token(row, self.vocab)
