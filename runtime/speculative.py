"""The speculative-decoding algorithm as small pure functions (no model calls, no I/O).

Names follow Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding" (ICML), Algorithm 1: ``q`` is the draft (approximation) model's distribution,
``p`` the target's; ``gamma`` (here ``k``) the number of candidates per round. For greedy
decoding the acceptance rule degenerates to "candidate == argmax p", which makes the
output identical to the target's own greedy output (Leviathan et al. 2023, section 3.3).

Sequence bookkeeping used by the generator (``S`` = prompt + committed tokens; the last
token of ``S`` is *pending*: committed, but not yet in the target's KV cache)::

    target KV holds S[:-1]          (length len(S) - 1)
    draft  KV holds S[:draft_len]   (draft_len <= len(S) - 1 between rounds)
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .errors import SpecRTError


class NumericsError(SpecRTError):
    """A model produced NaN or infinite logits."""


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
        _raise_nonfinite(row)
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
        _raise_nonfinite(row)
    return idx, 1.0 / s


def argmax_token(logits_row: np.ndarray, vocab: int) -> int:
    """Greedy token of one logits row (ids >= ``vocab`` excluded).

    Raises:
        NumericsError: NaN or inf where the maximum is.
    """
    row = logits_row[:vocab]
    idx = int(row.argmax())
    if not np.isfinite(row[idx]):
        _raise_nonfinite(row)
    return idx


def _raise_nonfinite(row: np.ndarray) -> None:
    n_nan = int(np.isnan(row).sum())
    n_inf = int(np.isinf(row).sum())
    raise NumericsError(f"model produced non-finite logits ({n_nan} NaN, {n_inf} inf of {row.size}); refusing to emit a token")


def greedy_verify(candidates: Sequence[int], target_logits: np.ndarray, vocab: int) -> tuple[int, int]:
    """Verify draft candidates against the target's logits, left to right, greedy.

    Args:
        candidates: the n draft tokens c_1..c_n.
        target_logits: ``[n+1, V]`` target logits for the positions of
            [pending, c_1, ..., c_n]; row i predicts the token after position i.
        vocab: real vocab size.

    Returns:
        ``(n_accepted, next_token)``: the length m of the longest prefix with
        c_{i+1} == argmax p_i, and the target's token at row m: the correction at the
        first mismatch, or the bonus token when all n were accepted. Rows after the first
        mismatch are never read (early stop).
    """
    for i, c in enumerate(candidates):
        t = argmax_token(target_logits[i], vocab)
        if t != c:
            return i, t
    n = len(candidates)
    return n, argmax_token(target_logits[n], vocab)


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
STRATEGIES = ("full", "chunked", "lazy-head")  # GenerationConfig.strategy values
DEFAULT_CHUNK_BOUND = 0.5  # GenerationConfig.chunk_bound when the manifest has none


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
        bound: number in (0, 1] (:attr:`GenerationConfig.chunk_bound`).

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
