"""The backend contract: what the decode loop needs of one exported model.

Every backend (onnxruntime CPU, onnxruntime CUDA, TensorRT) implements :class:`Model`; a
backend that can also run the target split at its vocabulary projection (the ``lazy-head``
verification strategy) implements :class:`SplitsHead` as well. The decode loop
(:mod:`specrt.runtime.decode`) sees nothing else, so a new backend is one class.

KV rule (the same for all): a model owns its KV buffers, allocated once for ``max_ctx``
rows. ``run(tokens, start)`` reads rows ``[0, start)`` and writes rows
``[start, start + q)`` in place; rows at or beyond ``start`` are never read, so rolling
back is calling the next ``run`` with a smaller ``start``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

__all__ = ["Model", "HeadSplit", "SplitsHead", "ThreadConfig", "DRAFT_ONE_THREAD_BELOW", "release_scratch", "run_tail"]


@runtime_checkable
class Model(Protocol):
    """One exported model with its KV cache preallocated (Polygraphy-style small runner).

    Attributes:
        max_q: widest call (tokens per ``run``).
        max_ctx: KV rows; ``start + q <= max_ctx``.
        vocab: logits width (may exceed the tokenizer's vocabulary by padding rows).

    Optional: ``release_rows(start) -> int`` gives KV rows ``[start, max_ctx)`` back to the
    OS (the onnxruntime CPU models: their buffers are page-aligned mappings); the server calls
    it, where present, on idle slots past their prefix record so that ``--prefix-cache-tokens``
    bounds what idle KV keeps resident. ``release_logits(start) -> int`` does the same for
    logits rows ``[start, max_q)`` (written only by wide calls: prefill scratch), called on
    idle models between requests and by a ``Generation`` mid-request, right after it has read
    its prefill's rows (target) and its first round's draft feed (draft), with ``start`` =
    ``k_max + 1``: a drafter or acceptor must read the rows a call returns before the round
    ends, never keep a view of them for a later round.
    """

    max_q: int
    max_ctx: int
    vocab: int

    def run(self, tokens: Sequence[int] | np.ndarray, start: int) -> np.ndarray:
        """Run ``q = len(tokens)`` new tokens at positions ``start .. start+q-1``.

        Reads KV rows ``[0, start)``, writes rows ``[start, start+q)`` in place.

        Returns:
            float32 ``[q, vocab]`` logits, a view of a preallocated buffer valid until
            the next call (or a ``release_logits`` of its rows: read them now).

        Raises:
            InputError: ``q`` outside ``1..max_q`` or ``start + q > max_ctx``.
        """
        ...

    def fork(self) -> "Model":
        """Another model object over the same loaded weights with its own KV buffers
        (one per concurrent generation).

        Raises:
            BackendError: the backend cannot share its weights (load another instead).
        """
        ...

    def close(self) -> None:
        """Free what the model allocated (device memory, sessions); unusable after."""
        ...


class HeadSplit(Protocol):
    """The target split at its vocabulary projection, over the target's own KV buffers:
    :meth:`body` runs every layer but the LM head, :meth:`head` projects hidden rows to
    logits block by block, so rows after a rejection are never projected."""

    def body(self, tokens: Sequence[int] | np.ndarray, start: int) -> None:
        """As :meth:`Model.run` without the head: writes KV rows ``[start, start+q)`` and
        keeps the q final-norm hidden rows for :meth:`head`."""
        ...

    def head(self, lo: int, r: int) -> np.ndarray:
        """float32 ``[r, vocab]`` logits of hidden rows ``[lo, lo+r)`` of the last body call."""
        ...


@runtime_checkable
class SplitsHead(Protocol):
    """Optional capability of a target :class:`Model`: it can hand out a :class:`HeadSplit`."""

    def split_head(self) -> HeadSplit:
        """The body/head split over this model's KV buffers.

        Raises:
            EngineError: the engine folder has no body/head graphs (exported without them).
        """
        ...


# Below this many parameters a draft runs on one thread: its step is too short for a second
# thread's hand-over to pay (measured on the 1.6M-parameter embedded draft); above it the
# step is compute (a 0.5B draft's matrices), which a second core shortens.
DRAFT_ONE_THREAD_BELOW = 50_000_000


@dataclass(frozen=True)
class ThreadConfig:
    """CPU thread settings of the model sessions.

    Attributes:
        intra_op: intra-op threads per session. The draft and target run one after the
            other, never at once.
        spinning: let idle pool threads spin. Off by default: with two sessions on few
            cores, spinning threads of the idle session steal the busy one's cores.
        draft_intra_op: intra-op threads of the draft session; None (default) sizes them by
            the draft (:meth:`for_draft`): one thread below :data:`DRAFT_ONE_THREAD_BELOW`
            parameters (the embedded 1.6M-parameter draft: 1.10 vs 1.47 ms per step with
            two, scripts/measure_costs.py), ``intra_op`` above (Qwen2.5-Coder-0.5B int4: 19.3 ms per
            step on two threads, 26.0 on one, docs/guide/real-pair.md).
    """

    intra_op: int = 2
    spinning: bool = False
    draft_intra_op: int | None = None

    def for_draft(self, params: int = 0) -> "ThreadConfig":
        """The settings for the draft session: ``draft_intra_op`` when set, else one thread
        for a draft of fewer than :data:`DRAFT_ONE_THREAD_BELOW` parameters (``params``;
        0 = unknown counts as small), else ``intra_op``."""
        n = self.draft_intra_op or (1 if params < DRAFT_ONE_THREAD_BELOW else self.intra_op)
        return ThreadConfig(n, self.spinning, n)


def release_scratch(model, start: int) -> int:
    """Hand ``model``'s logits rows ``[start, max_q)`` back to the OS where it can
    (``model.release_logits``, :class:`Model`'s optional method; other backends: nothing).
    Call it only once the last call's logits have been read. Returns bytes released."""
    rel = getattr(model, "release_logits", None)
    return rel(start) if rel is not None else 0


def run_tail(model, tokens: Sequence[int] | np.ndarray, start: int, need: int) -> np.ndarray:
    """``model.run(tokens, start)`` whose caller reads only the last ``need`` logits rows
    (0: none, e.g. a prefill chunk before the last). A model that can leave the other rows
    unprojected (optional ``run_rows(tokens, start, lo)``: the kernels) does, saving their
    share of the LM head; any other model runs as usual. The KV rows are written either way.

    Returns:
        float32 ``[q, vocab]``; only the last ``need`` rows are defined.
    """
    rr = getattr(model, "run_rows", None)
    if rr is None:
        return model.run(tokens, start)
    q = len(tokens)
    return rr(tokens, start, q - min(max(0, need), q))
