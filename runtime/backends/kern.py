"""The target (or draft) on specrt's own CPU kernels: :class:`KernelModel`.

One ``run`` is one call into C (``sk_step``): embedding, every layer (RMSNorm, q/k/v with
biases, RoPE, grouped-query attention over an f16 KV cache, SwiGLU) and the LM head, on the
kernels' persistent thread team, over the GGUF's own blocks in panel layout
(:mod:`specrt.runtime.kernels`). Each output's operations are the same whatever the call
width, thread count or ISA path, so every row is bit-identical at every width: the loop may
call the target 1 row wide (``exact_min_q = 1``) and speculative output still equals
target-only output.

The KV buffers are allocated once per model (:func:`~.kv_layout.host_zeros`, so released
rows leave the RSS) and written in place, rows ``[start, start + q)`` per call; rows at or
past ``start`` are never read (the backend contract, :mod:`.base`).
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np

from ..errors import EngineError, InputError, NumericsError
from ..kernels import SkKv, check_rc, isa_id, penalty_pointers
from ..kernels.weights import KernelWeights
from .kv_layout import check_call, host_zeros, release_bytes, release_tail_rows

__all__ = ["KernelModel", "token_ids", "int_array"]


def int_array(values, what: str, param: str) -> np.ndarray:
    """``values`` as a 1-D int64 array, before anything narrows them to the kernels' int32
    buffers (numpy would wrap ``2**32 + 7`` to 7 silently; the caller range-checks these).

    Raises:
        InputError: not a 1-D sequence of integers (bools and floats refused; param ``param``).
    """
    a = np.asarray(values)
    if a.ndim != 1 or (a.size and (a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer))):
        raise InputError(f"{what} must be a 1-D sequence of integers, got {a.dtype} with shape {a.shape}", param)
    return a.astype(np.int64, copy=False)


def token_ids(tokens, vocab: int) -> np.ndarray:
    """``tokens`` as int64 ``[q]`` (:func:`int_array`), each an id in ``0..vocab-1``.

    Raises:
        InputError: not integers, or an id outside the vocabulary (param ``tokens``).
    """
    a = int_array(tokens, "token ids", "tokens")
    if a.size and (int(a.min()) < 0 or int(a.max()) >= vocab):
        raise InputError(f"a token id in {a.tolist()[:16]} is outside the vocabulary 0..{vocab - 1}", "tokens")
    return a


class KernelModel:
    """A :class:`~specrt.runtime.backends.base.Model` over :class:`KernelWeights`.

    Args:
        weights: the mapped panels (shared by forks).
        isa: the kernels' path (``avx512vnni``, ``avx2``, ``portable``).

    Attributes:
        max_q, max_ctx, vocab: the Model contract. exact_min_q: 1; width_exact: True (rows do
        not depend on the call's width, layout or thread split). isa: the path in use.
        argmax_head: :meth:`run_argmax` is available (the head is not trimmed).

    Buffers (once): K ``[n_layer, ctx16 / 16, n_kv, head_dim, 16]`` and V ``[n_layer, ctx16,
    n_kv, head_dim]`` f16 (as uint16); logits float32 ``[max_q, vocab]``; token ids int32.
    """

    exact_min_q = 1
    width_exact = True  # rows do not depend on the call's width, layout or thread split (the Engine reads it)

    def __init__(self, weights: KernelWeights, isa: str):
        self.w, self.isa, self._isa = weights, isa, isa_id(isa)
        self.max_q, self.max_ctx, self.vocab = weights.max_q, weights.max_ctx, weights.n_vocab
        self.k = host_zeros((weights.kv_elems,), np.uint16)
        self.v = host_zeros((weights.kv_elems,), np.uint16)
        self.logits = host_zeros((self.max_q, self.vocab))  # rows past a verification pass: prefill scratch
        self.ids = np.zeros(self.max_q, np.int32)
        self.argmax_ids = np.zeros(self.max_q, np.int32)  # run_argmax's rows: each row's greedy token ...
        self.argmax_vals = np.zeros(self.max_q, np.float32)  # ... and its logit
        self._pen_ptrs = np.zeros(self.max_q, np.uint64)  # run_argmax's penalty rows' addresses (constrained greedy)
        self.argmax_head = weights.head_ids is None  # run_argmax needs the whole head (a trimmed one's ids are not the vocabulary's)
        self.penalty_rows = True  # run_argmax takes penalty rows (constrained greedy verification)
        self._conf = np.zeros(self.max_q, np.float32)  # run_top1's confidences
        self._top1_valid: dict[int, int] = {}  # run_top1's vocab -> head ids below it (a trimmed head's are sorted)
        # a trimmed head: the step writes [q, len(head_ids)] here, scattered into logits rows whose
        # other ids hold -inf (filled once a row: rows_ready)
        self.head = None if weights.head_ids is None else np.zeros((self.max_q, len(weights.head_ids)), np.float32)
        self._out = self.logits if self.head is None else self.head  # what the C step writes, and its row stride
        self._ld = self._out.shape[1]
        self.rows_ready = 0
        self._kv = SkKv(self.k.ctypes.data, self.v.ctypes.data)
        self._args = (ctypes.byref(weights.model), ctypes.byref(self._kv))

    def run(self, tokens: Sequence[int] | np.ndarray, start: int) -> np.ndarray:
        """Run ``q = len(tokens)`` new tokens at positions ``start .. start+q-1``: reads KV
        rows ``[0, start)``, writes rows ``[start, start+q)``.

        Returns:
            float32 ``[q, vocab]``, a view of the logits buffer valid until the next call.

        Raises:
            InputError: q or start outside the buffers, or a token id outside the vocabulary.
        """
        return self.run_rows(tokens, start, 0)

    def run_rows(self, tokens: Sequence[int] | np.ndarray, start: int, lo: int) -> np.ndarray:
        """As :meth:`run`, projecting to the vocabulary only rows ``[lo, q)`` (a prefill chunk
        whose other rows nobody reads: ``lo = q - 1``, or ``lo = q`` for none). The KV rows of
        every token are written as by :meth:`run`; logits rows below ``lo`` are not written.

        Returns:
            float32 ``[q, vocab]`` (rows below ``lo``: stale).
        """
        toks = self._tokens(tokens, start)
        q = len(toks)
        w = self.w
        with w.lock:  # the ids buffer too: another thread's call on this model cannot change it before C copies it
            self._open()
            self.ids[:q] = toks
            rc = w.lib.sk_step(self._isa, *self._args, w.scratch, self.ids.ctypes.data, q, start, self._out.ctypes.data, self._ld, lo)
        self._check(rc, q)
        if self.head is not None and lo < q:
            if self.rows_ready < q:
                self.logits[self.rows_ready : q] = -np.inf
                self.rows_ready = q
            self.logits[lo:q, w.head_ids] = self.head[lo:q]
        return self.logits[:q]

    def run_argmax(self, tokens: Sequence[int] | np.ndarray, start: int, n_valid: int, pens=None) -> np.ndarray:
        """As :meth:`run`, with the LM head reduced to each row's greedy token: what greedy
        verification reads (one ``sk_step_argmax`` call; no logits row is written).

        Row r's entry is ``np.argmax(run(tokens, start)[r, :n_valid])`` (the same logits bit
        for bit, the first maximum), or -1 where that maximum is not finite (NaN or inf: the
        caller raises, as :func:`~specrt.runtime.speculative.argmax_token` does on the row).
        With ``pens[r]`` it is ``np.argmax(np.add(row[:n_valid], pens[r]))``: constrained
        greedy verification (:mod:`specrt.runtime.constraints`) without a logits row.

        Args:
            n_valid: ids ``[0, n_valid)`` compete (the tokenizer's vocabulary; padding ids
                past it never win), ``1 <= n_valid <= vocab``.
            pens: None, or one entry per call row: None or a contiguous float32 penalty row
                of at least ``n_valid`` entries (a grammar's 0 / -inf mask plus a logit bias).

        Returns:
            int32 ``[q]``, a view of a buffer valid until the next call.

        Raises:
            InputError: as :meth:`run`; ``n_valid`` outside ``1..vocab``.
            RuntimeError: the model's head is trimmed (``argmax_head`` False).
        """
        if not self.argmax_head:
            raise RuntimeError("run_argmax needs the whole LM head; this model's head is trimmed (argmax_head is False)")
        if not 1 <= n_valid <= self.vocab:
            raise InputError(f"n_valid={n_valid}; it must be in 1..{self.vocab} (the head's ids)")
        if pens is not None and len(pens) != len(tokens):
            raise InputError(f"pens has {len(pens)} rows for a call of {len(tokens)}; give one entry (None or a row) per row")
        out, v = self._reduced(tokens, start, n_valid, 0.0, self.argmax_vals, 0, pens)
        if not np.isfinite(v).all():
            out[~np.isfinite(v)] = -1
        return out

    def run_top1(self, tokens: Sequence[int] | np.ndarray, start: int, vocab: int, inv_temp: float) -> tuple[int, float]:
        """As :meth:`run`, for a greedy draft step: the last row's greedy token and its
        confidence, ``top1(run(tokens, start)[-1], vocab, inv_temp=inv_temp)``
        (:func:`~specrt.runtime.speculative.top1`), reduced in the kernels (one
        ``sk_step_argmax`` call: no logits row is written, no row is scattered out of a trimmed
        head, no softmax runs in numpy). The token is the same; the confidence is the same
        softmax summed in another order (chunks of 1,024 ids, 16 lanes each), the same bits on
        every ISA path and thread count, within float32 rounding of numpy's.

        Args:
            vocab: ids ``[0, vocab)`` compete (the tokenizer's); inv_temp: ``1 / T`` (> 0).

        Returns:
            ``(token, confidence)``.

        Raises:
            InputError: as :meth:`run`; ``vocab`` < 1 or ``inv_temp`` <= 0.
            NumericsError: NaN or inf at the row's maximum.
        """
        if vocab < 1 or not inv_temp > 0.0:
            raise InputError(f"vocab={vocab}, inv_temp={inv_temp}; need vocab >= 1 and inv_temp > 0")
        n = self._top1_valid.get(vocab)
        if n is None:
            h = self.w.head_ids
            n = self._top1_valid[vocab] = min(vocab, self.vocab) if h is None else int(np.searchsorted(h, vocab))  # the export sorts head ids
        if n == 0:
            raise InputError(f"vocab={vocab}: no id of this model's head is below it (its lowest is {int(self.w.head_ids[0])})")
        out, v = self._reduced(tokens, start, n, inv_temp, self._conf, len(tokens) - 1)
        conf = float(v[-1])
        if not np.isfinite(conf):
            raise NumericsError("model produced non-finite logits (NaN or inf at the draft row's maximum); refusing to emit a token")
        t = int(out[-1])
        return (t if self.w.head_ids is None else int(self.w.head_ids[t])), conf

    def _reduced(self, tokens, start: int, n_valid: int, inv_temp: float, vals: np.ndarray, lo: int, pens=None) -> tuple[np.ndarray, np.ndarray]:
        """One ``sk_step_argmax`` call (rows ``[lo, q)`` reduced, ``pens`` per row of the call,
        :func:`~specrt.runtime.kernels.penalty_pointers`): views of its ids and vals."""
        toks = self._tokens(tokens, start)
        q = len(toks)
        out, w = self.argmax_ids, self.w
        pp = None
        if pens is not None and any(p is not None for p in pens[lo:]):
            pp = penalty_pointers(pens[lo:], n_valid, self._pen_ptrs).ctypes.data
        with w.lock:
            self._open()
            self.ids[:q] = toks
            rc = w.lib.sk_step_argmax(
                self._isa,
                *self._args,
                w.scratch,
                self.ids.ctypes.data,
                q,
                start,
                out.ctypes.data,
                vals.ctypes.data,
                n_valid,
                inv_temp,
                lo,
                pp,
            )
        self._check(rc, q)
        return out[lo:q], vals[lo:q]

    def _tokens(self, tokens, start: int) -> np.ndarray:
        """The call's ids, checked (:func:`token_ids`: range first, then int32), and its rows
        against the buffers (:func:`~.kv_layout.check_call`)."""
        self._open()
        toks = token_ids(tokens, self.w.n_vocab)
        check_call(len(toks), start, self.max_q, self.max_ctx)
        return toks

    def _open(self) -> None:
        """Raise unless this model and its weights are open.

        Raises:
            EngineError: :meth:`close` was called (on this model or its weights)."""
        if self._kv is None or self.w.closed:
            raise EngineError("this kernels model is closed (Engine.close or KernelModel.close); load the engine again", "engine")

    def _check(self, rc: int, q: int) -> None:
        """Raise for a step's return code: InputError for a token id outside the vocabulary
        (the ``q`` ids of the call named), else :func:`~specrt.runtime.kernels.check_rc`."""
        if rc == -3:
            raise InputError(f"a token id in {list(map(int, self.ids[:q]))} is outside the vocabulary 0..{self.vocab - 1}", "tokens")
        check_rc(rc, "kernels step")

    def fork(self) -> "KernelModel":
        """Another model over the same weights with its own KV, logits and ids buffers.

        Raises:
            EngineError: this model is closed."""
        self._open()
        return KernelModel(self.w, self.isa)

    def swap_kv(self, other: "KernelModel") -> None:
        """Exchange KV caches with ``other`` (a model over the same weights): each then holds
        the other's rows. O(1): the buffers change owner (continuous batching moves slots so).

        Raises:
            EngineError: either model is closed."""
        self._open()
        other._open()
        for name in ("k", "v", "_kv", "_args"):
            a, b = getattr(self, name), getattr(other, name)
            setattr(self, name, b)
            setattr(other, name, a)

    def close(self) -> None:
        """Drop this model's buffers (the weights go with their last user); every call after
        raises :class:`~specrt.runtime.errors.EngineError`. Idempotent."""
        with self.w.lock:  # not while a step of another thread is in C over these buffers
            self._kv = self._args = None
            self.k = self.v = self.logits = self.head = self._out = None

    def release_logits(self, start: int = 0) -> int:
        """Give logits rows ``[start, max_q)`` back to the OS (whole pages); returns bytes (0
        once closed: nothing is held)."""
        if self.logits is None:
            return 0
        self.rows_ready = min(self.rows_ready, max(0, start))  # released rows read zeros, not -inf
        return release_tail_rows(self.logits, start)

    def kv_prefix(self, rows: int) -> list[np.ndarray]:
        """Views of KV rows ``[0, rows)`` (:class:`~.base.HoldsRows`): K as uint16 ``[n_layer,
        ceil(rows / 16) * 16 * n_kv * head_dim]`` (whole 16-row tiles: the last may hold rows
        past ``rows``), V as ``[n_layer, rows * n_kv * head_dim]``.

        Raises:
            EngineError: this model is closed."""
        self._open()
        d = self.w.dims
        n, per = int(d["n_layer"]), int(d["n_head_kv"]) * int(d["head_dim"])  # elements of one position in one layer
        k, v = self.k[: n * self.w.ctx16 * per].reshape(n, -1), self.v[: n * self.w.ctx16 * per].reshape(n, -1)
        return [k[:, : -(-rows // 16) * 16 * per], v[:, : rows * per]]

    def release_rows(self, start: int) -> int:
        """Give KV rows ``[start, max_ctx)`` of every layer back to the OS (whole pages; a K
        tile holding a row below ``start`` is kept). Returns bytes released (0 once closed)."""
        if self.k is None:
            return 0
        d = self.w.dims
        per_row = int(d["n_head_kv"]) * int(d["head_dim"]) * 2  # bytes of one position in one layer
        layer = self.w.ctx16 * per_row
        t0 = -(-max(0, start) // 16) * 16
        v0 = max(0, start)
        n = int(d["n_layer"])
        return release_bytes(self.k, [(i * layer + t0 * per_row, (i + 1) * layer) for i in range(n)]) + release_bytes(
            self.v, [(i * layer + v0 * per_row, (i + 1) * layer) for i in range(n)]
        )
