"""The backend contract: what the decode loop needs of one exported model.

Every backend (onnxruntime CPU, onnxruntime CUDA, TensorRT, specrt's kernels) implements
:class:`Model`. What a backend can do beyond it is an optional capability, a protocol of its
own that the loop probes with ``isinstance``: :class:`SplitsHead` (the target split at its
vocabulary projection: the ``lazy-head`` strategy), :class:`ProjectsRows` (logits for some
rows only), :class:`ReducesHead` and :class:`DraftsTop1` (greedy tokens reduced in the
backend, no logits row), :class:`WidthExact` (rows independent of the call's width),
:class:`ReleasesRows` and :class:`ReleasesLogits` (buffers back to the OS). The decode loop
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

__all__ = [
    "Model",
    "HeadSplit",
    "SplitsHead",
    "ProjectsRows",
    "ReducesHead",
    "DraftsTop1",
    "WidthExact",
    "ReleasesRows",
    "ReleasesLogits",
    "reduces_head",
    "is_width_exact",
    "ThreadConfig",
    "MAX_THREADS",
    "DRAFT_ONE_THREAD_BELOW",
    "release_scratch",
    "HoldsRows",
    "run_tail",
]


@runtime_checkable
class Model(Protocol):
    """One exported model with its KV cache preallocated (Polygraphy-style small runner).

    Attributes:
        max_q: widest call (tokens per ``run``).
        max_ctx: KV rows; ``start + q <= max_ctx``.
        vocab: logits width (may exceed the tokenizer's vocabulary by padding rows).

    Optional (:class:`ReleasesRows`): ``release_rows(start) -> int`` gives KV rows ``[start,
    max_ctx)`` back to the OS (the onnxruntime CPU models: their buffers are page-aligned
    mappings); the server calls it, where present, on idle slots past their prefix record so
    that ``--prefix-cache-tokens`` bounds what idle KV keeps resident. :class:`ReleasesLogits`:
    ``release_logits(start) -> int`` does the same for logits rows ``[start, max_q)`` (written only by wide calls: prefill scratch), called on
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


# ---- optional capabilities: a backend offers what it can; the loop probes with isinstance ----


@runtime_checkable
class ProjectsRows(Protocol):
    """Optional capability of a :class:`Model`: a call whose caller reads only some logits rows
    leaves the others unprojected (specrt's kernels; :func:`run_tail` uses it)."""

    def run_rows(self, tokens: Sequence[int] | np.ndarray, start: int, lo: int) -> np.ndarray:
        """As :meth:`Model.run`, projecting to the vocabulary only rows ``[lo, q)``; the KV rows
        of every token are written. Returns float32 ``[q, vocab]`` (rows below ``lo`` stale)."""
        ...


@runtime_checkable
class ReducesHead(Protocol):
    """Optional capability of a target :class:`Model`: greedy verification reads each row's
    token, reduced in the backend, instead of logits rows (:func:`reduces_head`; specrt's
    kernels, ``sk_step_argmax``). ``argmax_head`` False: the method exists but this model's head
    cannot (a trimmed head's ids are not the vocabulary's). ``penalty_rows`` (optional, default
    False): ``run_argmax`` also takes ``pens``, and constrained greedy verification uses it."""

    argmax_head: bool

    def run_argmax(self, tokens: Sequence[int] | np.ndarray, start: int, n_valid: int) -> np.ndarray:
        """As :meth:`Model.run`, returning int32 ``[q]``: ``argmax(run(tokens, start)[r, :n_valid])``
        per row (the first maximum), -1 where it is not finite. With ``penalty_rows``, a fourth
        argument ``pens`` (one entry per row: None or a float32 row added first) gives
        ``argmax(run(...)[r, :n_valid] + pens[r])``."""
        ...


@runtime_checkable
class DraftsTop1(Protocol):
    """Optional capability of a draft :class:`Model`: a greedy draft step reads the last row's
    token and its softmax probability, reduced in the backend (``run_top1``; the drafter uses
    it for a plain greedy acceptor)."""

    def run_top1(self, tokens: Sequence[int] | np.ndarray, start: int, vocab: int, inv_temp: float) -> tuple[int, float]:
        """As :meth:`Model.run`, returning ``top1(run(tokens, start)[-1], vocab, inv_temp)``:
        ``(token, confidence)`` (:func:`~specrt.runtime.speculative.top1`)."""
        ...


@runtime_checkable
class WidthExact(Protocol):
    """Optional capability of a target :class:`Model`: ``width_exact`` True when every logits
    row is bit-identical whatever the call's width, layout and thread split (specrt's kernels):
    the Engine then calls it 1 row wide and reuses rows of any earlier call
    (:func:`~specrt.runtime.engine.target_exactness`)."""

    width_exact: bool


@runtime_checkable
class ReleasesRows(Protocol):
    """Optional capability of a :class:`Model`: hand KV rows ``[start, max_ctx)`` back to the OS
    (page-aligned buffers); the server calls it on idle slots past their prefix record."""

    def release_rows(self, start: int) -> int:
        """Release the rows; returns bytes released."""
        ...


@runtime_checkable
class HoldsRows(Protocol):
    """Optional capability of a :class:`Model`: the host buffers that hold KV rows ``[0,
    rows)``, as writable numpy views (every layer's keys and values; a view may reach a few
    rows past ``rows`` where the layout tiles rows, which the contract never reads). The
    host prompt cache (:mod:`specrt.runtime.hostcache`) copies them out before a request
    overwrites an idle slot's history and back when that history returns: the rows'
    bits, so a restored prefix gives a cold run's output."""

    def kv_prefix(self, rows: int) -> list[np.ndarray]:
        """Views of the buffers' regions holding rows ``[0, rows)``, in a fixed order."""
        ...


@runtime_checkable
class ReleasesLogits(Protocol):
    """Optional capability of a :class:`Model`: hand logits rows ``[start, max_q)`` (wide
    calls' prefill scratch) back to the OS (:func:`release_scratch`)."""

    def release_logits(self, start: int) -> int:
        """Release the rows; returns bytes released."""
        ...


def reduces_head(model) -> bool:
    """Whether ``model`` reduces its head to each row's token (:class:`ReducesHead` with
    ``argmax_head`` True)."""
    return isinstance(model, ReducesHead) and bool(model.argmax_head)


def is_width_exact(model) -> bool:
    """Whether ``model``'s rows do not depend on the call (:class:`WidthExact`, True)."""
    return isinstance(model, WidthExact) and bool(model.width_exact)


# The most threads a session may have: specrt's kernels' thread team holds at most this many
# (sk.h's SK_MAX_THREADS; tests/test_kernels.py checks the library agrees), and one limit for
# every backend keeps --threads meaning the same whichever backend a folder runs on.
MAX_THREADS = 64

# Below this many parameters a draft runs on one thread: its step is too short for a second
# thread's hand-over to pay (measured on the 1.6M-parameter embedded draft); above it the
# step is compute (a 0.5B draft's matrices), which a second core shortens.
DRAFT_ONE_THREAD_BELOW = 50_000_000


@dataclass(frozen=True)
class ThreadConfig:
    """CPU thread settings of the model sessions.

    Attributes:
        intra_op: intra-op threads per session, 1..:data:`MAX_THREADS`. The draft and target run one after the
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

    def __post_init__(self):
        """Raises:
        InputError: ``intra_op`` or ``draft_intra_op`` not an int in 1..:data:`MAX_THREADS`
            (param ``threads``)."""
        from ..errors import InputError

        for name, n in (("threads", self.intra_op), ("draft threads", self.draft_intra_op)):
            if n is None and name == "draft threads":
                continue
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_THREADS:
                raise InputError(f"{name}={n!r}: allowed 1..{MAX_THREADS} (the most threads specrt's kernels' team holds)", "threads")

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
    return model.release_logits(start) if isinstance(model, ReleasesLogits) else 0


def run_tail(model, tokens: Sequence[int] | np.ndarray, start: int, need: int) -> np.ndarray:
    """``model.run(tokens, start)`` whose caller reads only the last ``need`` logits rows
    (0: none, e.g. a prefill chunk before the last). A model that can leave the other rows
    unprojected (optional ``run_rows(tokens, start, lo)``: the kernels) does, saving their
    share of the LM head; any other model runs as usual. The KV rows are written either way.

    Returns:
        float32 ``[q, vocab]``; only the last ``need`` rows are defined.
    """
    if not isinstance(model, ProjectsRows):
        return model.run(tokens, start)
    q = len(tokens)
    return model.run_rows(tokens, start, q - min(max(0, need), q))
