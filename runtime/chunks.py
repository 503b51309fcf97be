"""How a run of tokens is cut into model calls: :func:`chunk_bounds` (widths within the
call limits and the measured exact widths), :func:`feed` (run tokens in such chunks) and
:func:`call_start` (where a target call must start to be at least ``min_q`` wide). Used by
the decode loop (:mod:`specrt.runtime.decode`), the drafters and the quality scorer; and
:data:`PREFILL_CHUNK`, the widest prefill call (the Engine's models and the TensorRT plans
are sized by it).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .backends.base import Model, run_tail

__all__ = ["PREFILL_CHUNK", "chunk_bounds", "feed", "call_start"]

PREFILL_CHUNK = 256  # widest prefill call; longer prompts are fed in chunks


def chunk_bounds(n: int, step: int, min_q: int = 1, tail_q: int = 0, avoid: frozenset = frozenset()) -> list[tuple[int, int]]:
    """``[lo, hi)`` chunks of at most ``step`` tokens covering ``0..n`` in order, each at
    least ``min_q`` wide whenever ``n >= min_q`` (a chunk before a short one gives up tokens),
    and, with ``tail_q``, the last one at most ``tail_q`` wide when ``n >= 2 * min_q``; no
    chunk is a width in ``avoid`` (widths the export measured rounding differently,
    :func:`specrt.runtime.lab.exactness.measure_wide`: such a chunk gives up tokens to the
    next) unless only such widths fit.

    Why the tail: the decode loop may recompute the last ``min_q - 1`` prompt rows at a
    narrow width (:func:`call_start`), and onnxruntime's kernels are bit-identical across
    widths only within the widths the export measured (``q = min_q .. k_max + 1``): a wide
    call such as 129 rows splits into 128 + 1 inside the GEMM and rounds its last row like
    a 1-row call. A tail of at most ``tail_q`` rows makes every recomputed row come from a
    measured width, so speculative and target-only decoding hold the same KV bits.

    Raises:
        ValueError: ``step < min_q``, or ``0 < tail_q < min_q`` (no chunking can satisfy both).
    """
    if step < min_q:
        raise ValueError(f"chunk step {step} < min_q {min_q}")
    if 0 < tail_q < min_q:
        raise ValueError(f"tail width {tail_q} < min_q {min_q}")
    if tail_q and n > tail_q and n >= 2 * min_q:
        tail = min(tail_q, step, n - min_q)  # the rows before the tail must fill a chunk >= min_q
        return chunk_bounds(n - tail, step, min_q, 0, avoid) + [(n - tail, n)]
    out, i = [], 0
    while i < n:
        w = min(step, n - i)
        rest = n - i - w
        if 0 < rest < min_q:
            w -= min_q - rest
        if w in avoid:
            w = _avoiding(w, n - i, min_q, avoid)
        out.append((i, i + w))
        i += w
    return out


def _avoiding(w: int, left: int, min_q: int, avoid: frozenset) -> int:
    """The widest chunk narrower than ``w`` that is not in ``avoid`` and leaves ``left - w``
    tokens that can still be cut (none, or at least ``min_q``); ``w`` when there is none."""
    for v in range(w - 1, min_q - 1, -1):
        if v not in avoid and (left - v == 0 or left - v >= min_q):
            return v
    return w


def feed(model: Model, tokens: Sequence[int], start: int, min_q: int = 1, tail_q: int = 0, need: int | None = None) -> np.ndarray:
    """Run ``tokens`` from KV length ``start`` in chunks of at most ``model.max_q``
    (:func:`chunk_bounds`: every chunk at least ``min_q`` wide when possible, the last at most
    ``tail_q``); returns the logits rows of the last chunk (float32 ``[q_last, vocab]``, a
    view valid until the next call). ``need``: the caller reads only the last ``need`` rows
    (None: all of them), so a model that can skip the others' LM head does, and no earlier
    chunk is projected at all (:func:`~specrt.runtime.backends.base.run_tail`; the KV rows are
    written either way, and the rows read are the same bits)."""
    bounds = list(chunk_bounds(len(tokens), model.max_q, min_q, tail_q))
    for i, (lo, hi) in enumerate(bounds):
        last = i == len(bounds) - 1
        rows = run_tail(model, tokens[lo:hi], start + lo, (hi - lo if need is None else need) if last else 0)
    return rows


def call_start(lo: int, hi: int, valid: int, min_q: int) -> int:
    """First position of a target call that must produce the rows of positions ``[lo, hi)``.

    KV rows ``[0, valid)`` hold committed tokens computed at a width >= ``min_q``, so a call
    may start anywhere in ``[0, min(valid, lo)]`` (it rewrites those rows with the same bits).
    It starts as late as possible, but early enough to be at least ``min_q`` wide when the
    committed prefix allows it.
    """
    return max(0, min(valid, lo, hi - min_q))
