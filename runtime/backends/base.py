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

__all__ = ["Model", "HeadSplit", "SplitsHead", "ThreadConfig"]


@runtime_checkable
class Model(Protocol):
    """One exported model with its KV cache preallocated (Polygraphy-style small runner).

    Attributes:
        max_q: widest call (tokens per ``run``).
        max_ctx: KV rows; ``start + q <= max_ctx``.
        vocab: logits width (may exceed the tokenizer's vocabulary by padding rows).
    """

    max_q: int
    max_ctx: int
    vocab: int

    def run(self, tokens: Sequence[int] | np.ndarray, start: int) -> np.ndarray:
        """Run ``q = len(tokens)`` new tokens at positions ``start .. start+q-1``.

        Reads KV rows ``[0, start)``, writes rows ``[start, start+q)`` in place.

        Returns:
            float32 ``[q, vocab]`` logits, a view of a preallocated buffer valid until
            the next call.

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


@dataclass(frozen=True)
class ThreadConfig:
    """CPU thread settings of the model sessions.

    Attributes:
        intra_op: intra-op threads per session. The draft and target run one after the
            other, never at once.
        spinning: let idle pool threads spin. Off by default: with two sessions on few
            cores, spinning threads of the idle session steal the busy one's cores.
        draft_intra_op: intra-op threads of the draft session (None = ``intra_op``). The
            default draft is 1.6M parameters: one thread was faster than two in every
            interleaved measurement here (scripts/measure_costs.py: 1.10 vs 1.47 ms per
            decode step with spinning off, 2 cores).
    """

    intra_op: int = 2
    spinning: bool = False
    draft_intra_op: int | None = 1

    def for_draft(self) -> "ThreadConfig":
        """The settings for the draft session (``intra_op`` = ``draft_intra_op`` when set)."""
        return ThreadConfig(self.draft_intra_op or self.intra_op, self.spinning, self.draft_intra_op)
