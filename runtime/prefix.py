"""Prefix reuse (prefix caching) that never changes the output: which KV rows a finished
generation leaves that a later request may keep, and the rule that makes a cache hit give
the bits of a cold run.

Why a rule at all: a kernel may round a row differently by the width and offset of the call
that computed it (onnxruntime's 1-row GEMV path against its GEMM path; a 257-row call
splits into 256 + 1 inside the GEMM; :mod:`specrt.runtime.decode`, "Exactness by
construction"). A cold prefill of prompt ``P`` runs the chunks
:func:`~specrt.runtime.chunks.chunk_bounds` gives for ``len(P)``: full chunks of
``step`` rows at absolute multiples of ``step`` from position 0, then a short last part
(the tail rule). A cached row is the row a cold run would compute only if the cached
request computed it in the *same call* (same start, same width, same tokens before it).
The full aligned chunks are such calls for every prompt that contains them, so:

* a generation leaves ``rows``: the end of the leading run of full aligned chunks of its
  prefill (:func:`aligned_rows`), for the target and for the draft (whose first feed is
  chunked the same way from its reused length);
* a new request keeps ``min(rows, common prefix)`` rounded down to a multiple of the call
  width, and never beyond the aligned part of its own cold layout (:func:`reuse_target`, :func:`reuse_draft`);
  its prefill then runs exactly the cold layout's chunks from there.

Rows the old request computed in its short last chunk, in its rounds (the reply) or in a
batched step are recomputed: they came from calls a cold run of the new prompt does not
make. llama.cpp's ``cache_prompt`` and vLLM's prefix caching reuse them and document that a
hit may change the output; this rule gives up at most ``step - 1`` rows per request to keep
it unchanged, greedy and sampled (the draft's rows too: seeded sampling reads the draft's
distribution).

Any layout (:func:`reuse_any`): when the export measured that every call width from
``min_q`` to the widest prefill call gives the same rows except a few widths
(:func:`specrt.runtime.lab.exactness.measure_wide`; the prefill then never calls those,
:func:`~specrt.runtime.chunks.chunk_bounds`' ``avoid``), a row does not depend on the call
that computed it, only on the tokens up to it: every committed target row is reusable,
the reply's and a batched step's included (batched q = 1 rows over two or more slots
equal batch-1 rows, :mod:`specrt.runtime.backends.ort_gqa_batch`). A request then keeps
the whole common prefix (less the ``min_q`` rows its last call needs) and prefills the
rest from there. The real pair's target measured so at every width 10..256; the embedded
int4 target rounds a 129-row call's last row like a 1-row call (128 + 1 inside
MatMulNBits), so its prefill cuts 129 as 127 + 2. The draft keeps the aligned rule (its
rounds are 1-row calls), and so do backends other than onnxruntime's CPU provider (the
widths were measured on its kernels).

Routing (:func:`route_key`): how many of a record's rows a prompt would reuse, which
:mod:`specrt.runtime.slots` uses to choose a request's slot (llama-server's slot similarity).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .chunks import chunk_bounds

__all__ = ["KVPrefix", "aligned_rows", "common_prefix", "aligned_match", "route_key", "reuse_target", "reuse_any", "reuse_draft", "prefill_calls"]


@dataclass(frozen=True)
class KVPrefix:
    """What a pair of KV buffers (a target's and its draft's) holds for reuse.

    Attributes:
        tokens: the token ids at positions ``[0, max(target_rows, draft_rows))``.
        target_rows: rows ``[0, target_rows)`` of the target's KV equal a cold prefill's
            (a multiple of the target's call width, or 0; any count under any layout).
        draft_rows: the same for the draft's KV (a multiple of the draft's call width).
    """

    tokens: tuple[int, ...]
    target_rows: int
    draft_rows: int

    @property
    def size(self) -> int:
        """Cached tokens this record keeps (its longest run of reusable rows)."""
        return max(self.target_rows, self.draft_rows)

    def trimmed(self, budget: int, t_step: int, d_step: int) -> "KVPrefix | None":
        """This record cut to at most ``budget`` tokens (rows rounded down to the call widths
        ``t_step`` / ``d_step``: a shorter aligned run is still reusable), None when
        nothing is left."""
        t, d = (min(self.target_rows, budget) // t_step) * t_step, (min(self.draft_rows, budget) // d_step) * d_step
        if t == 0 and d == 0:
            return None
        return KVPrefix(self.tokens[: max(t, d)], t, d)


def aligned_rows(chunks: Sequence[tuple[int, int]], step: int) -> int:
    """End of the leading run of ``[lo, hi)`` chunks that are full ``step``-row calls at
    multiples of ``step`` (``[0, step), [step, 2 * step), ...``); 0 when the first is not."""
    end = 0
    for lo, hi in chunks:
        if lo != end or hi - lo != step:
            break
        end = hi
    return end


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x, y = np.asarray(a[:n], dtype=np.int64), np.asarray(b[:n], dtype=np.int64)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


def aligned_match(cached: KVPrefix, seq: Sequence[int], step: int) -> int:
    """The common prefix of ``cached.tokens`` and ``seq`` rounded down to a multiple of the
    call width ``step``: rows are reused in whole aligned calls, a shorter match is none."""
    return common_prefix(cached.tokens, seq) // step * step


def route_key(rec: KVPrefix | None, ids: Sequence[int], step: int) -> tuple[int, int]:
    """How well a KV holder serves a prompt, for routing a request (larger is better).

    llama-server's slot-similarity rule (``--slot-prompt-similarity`` 0.5): a holder counts
    its reusable rows when they are at least half of the shorter of the prompt and its
    record (the request continues or cuts back that history); otherwise reusing a few
    shared rows (a shared import line) would overwrite a history another request comes
    back to, so the holder that loses the fewest cached rows is preferred (an empty one
    first).

    Args:
        rec: what the holder's KV keeps for reuse, or None.
        ids: the request's prompt token ids.
        step: the granularity of reusable rows (the target's call width: whole aligned
            calls; 1 under any layout, :meth:`~specrt.runtime.manifest.Manifest.reuse_step`).

    Returns:
        ``(similar rows, -cached rows lost)``: the reusable target rows when similar (else
        0), then minus the rows the request would overwrite; ``(0, 0)`` without a record.
    """
    if rec is None:
        return (0, 0)
    rows = min(rec.target_rows, aligned_match(rec, ids, step))
    return (rows if 2 * rows >= min(rec.size, len(ids)) else 0, -(rec.size - rows))


def reuse_target(cached: KVPrefix | None, seq: Sequence[int], cold_chunks: Sequence[tuple[int, int]], step: int) -> int:
    """Target KV rows a request whose prefill feeds ``seq`` keeps from ``cached`` (module
    docstring): a boundary of ``cold_chunks`` (the prefill's chunks on a cold run,
    :func:`~specrt.runtime.chunks.chunk_bounds`) below which every chunk is a full aligned
    ``step``-row call, so the prefill runs the cold chunks from there. 0 without ``cached``."""
    if cached is None:
        return 0
    # the last chunk always runs: its last row gives the first token
    return min(cached.target_rows, aligned_match(cached, seq, step), aligned_rows(cold_chunks[:-1], step))


def reuse_any(cached: KVPrefix | None, seq: Sequence[int], min_q: int) -> int:
    """Target KV rows a request whose prefill feeds ``seq`` keeps from ``cached`` under any
    layout (module docstring): the common prefix within ``cached.target_rows``, less what
    the last call needs to be ``min_q`` wide (it gives the first token). 0 without ``cached``."""
    if cached is None:
        return 0
    return max(0, min(cached.target_rows, common_prefix(cached.tokens, seq), len(seq) - min_q))


def reuse_draft(cached: KVPrefix | None, prompt: Sequence[int], step: int) -> int:
    """Draft KV rows a request for ``prompt`` keeps from ``cached``: a multiple of the draft's
    widest call ``step`` within the common prefix, so the draft's first feed (chunked by
    ``step`` from there) makes the calls a cold run makes. 0 without ``cached``."""
    if cached is None:
        return 0
    return min(cached.draft_rows, aligned_match(cached, prompt, step))


def prefill_calls(
    cached: KVPrefix | None, seq: Sequence[int], step: int, min_q: int, tail_q: int, avoid: frozenset = frozenset(), any_layout: bool = False
) -> tuple[int, list[tuple[int, int]], int]:
    """The target calls of a prefill that feeds ``seq`` over what ``cached`` holds.

    Args:
        step, min_q, tail_q, avoid: the chunking (:func:`~specrt.runtime.chunks.chunk_bounds`).
        any_layout: the export measured every width from ``min_q`` to ``step`` but ``avoid``
            exact (module docstring, "Any layout"): reuse by :func:`reuse_any`.

    Returns:
        ``(reused, calls, aligned)``: rows kept from ``cached`` (:func:`reuse_target`, or
        :func:`reuse_any`), the ``[lo, hi)`` calls to make (the cold run's chunks from
        ``reused`` on; under any layout the chunks of the rest from ``reused``; the last one
        always), and the rows this prefill leaves reusable (its leading full aligned chunks,
        the last chunk left out: a round may recompute its rows at another width; 0 under
        any layout, where every committed row is: :class:`~specrt.runtime.decode.KVLengths`'s
        ``target``).
    """
    if any_layout:
        reused = reuse_any(cached, seq, min_q)
        return reused, [(reused + a, reused + b) for a, b in chunk_bounds(len(seq) - reused, step, min_q, tail_q, avoid)], 0
    chunks = chunk_bounds(len(seq), step, min_q, tail_q)
    reused = reuse_target(cached, seq, chunks, step)
    return reused, [(a, b) for a, b in chunks if a >= reused], aligned_rows(chunks[:-1], step)
