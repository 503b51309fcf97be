"""Batched builder graphs on onnxruntime CPU: one KV slot per sequence, B sequences per call.

:class:`BatchedGqaModel` owns, per layer, ONE key and ONE value buffer
``[max_batch, kv_heads, max_ctx, head_dim]`` (float32, BNSH, slot-major), allocated once.
Slots ``[0, n)`` are a contiguous prefix, so a batched call binds shape ``[n, ...]`` at the
buffer's base pointer (past and present the same buffer: GroupQueryAttention writes only
each row's new token in place); slot ``j`` alone is the contiguous ``[1, ...]`` block at
``base + j * slot_bytes``, which :class:`SlotModel` binds once and runs as an ordinary
batch-1 :class:`~specrt.runtime.backends.base.Model` (prefill, speculative verification).

Per-row past lengths come from the attention mask: row i of a batched call has
``lengths[i] + 1`` ones then zeros (right padding), and GroupQueryAttention takes
``seqlens_k = sum(mask) - 1`` per row, so each row reads its own ``[0, lengths[i])`` and
writes position ``lengths[i]``.

Why batched calls are q = 1 per row: onnxruntime's CPU GroupQueryAttention refuses
``batch > 1`` when ``q > 1`` follows a past ("batch_size must be 1 when sequence_length > 1
and past context is given", measured on onnxruntime 1.32), so one target pass cannot verify
several rows' candidates; a row's speculative round is a batch-1 call on its slot.

Numerics (measured with :func:`specrt.runtime.lab.exactness.measure_batched`, recorded in
docs/guide/serving.md, "Numerics", and docs/bench/batched_exactness.json): a batched q = 1
call over ``n >= 2`` rows runs MatMulNBits with M = n rows (its GEMM path), but its rows are
NOT bit-identical to the rows of batch-1 calls at least ``exact_min_q`` wide
(GroupQueryAttention's q = 1 path; 0.02-0.05 in the int4 logits at some positions), so a
batched step may change a greedy row at a near-tie, and its rows are never reused by the
prefix cache (:class:`~specrt.runtime.decode.KVLengths`' ``batched_from``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import InputError
from .kv_layout import check_batch_step, check_call, head_tails, host_zeros, release_bytes, release_tail_rows
from .ort import _raw_binding
from .ort_gqa import OrtGqaModel

__all__ = ["BatchedGqaModel", "SlotModel"]


class BatchedGqaModel:
    """A builder graph's session with ``max_batch`` KV slots bound in place (module docstring).

    Args:
        base: an :class:`~specrt.runtime.backends.ort_gqa.OrtGqaModel` whose session (weights)
            is shared; its own buffers are not used.
        max_batch: slots (sequences at once), >= 1.
        max_q: widest batch-1 call of a :class:`SlotModel` (prefill chunks, verification).

    Buffers (allocated once): per layer key/value float32 ``[max_batch, kv_heads, max_ctx,
    head_dim]``; ids int64 ``[max(max_batch, max_q)]``; mask int64 ``[max_batch * max_ctx]``
    (laid out ``[n, total]`` per call); logits float32 ``[max(max_batch, max_q), vocab]``.
    The slot views share ids, mask and logits: calls must not overlap (one scheduler thread).

    Raises:
        InputError: ``max_batch`` or ``max_q`` below 1 (param ``max_batch`` / ``max_q``).
    """

    exact = False  # a batched row may round differently from a batch-1 row (module docstring)

    def __init__(self, base: OrtGqaModel, max_batch: int, max_q: int):
        if max_batch < 1:
            raise InputError(f"max_batch must be >= 1, got {max_batch}", "max_batch")
        if max_q < 1:
            raise InputError(f"max_q must be >= 1, got {max_q}", "max_q")
        e = base.entry
        self.session, self.entry = base.session, e
        self.max_batch, self.max_ctx, self.max_q, self.vocab = max_batch, base.max_ctx, max_q, e.vocab_size
        shape = (max_batch, e.n_kv_heads, self.max_ctx, e.head_dim)
        self.keys = [host_zeros(shape) for _ in range(e.n_layers)]
        self.values = [host_zeros(shape) for _ in range(e.n_layers)]
        self.slot_bytes = e.n_kv_heads * self.max_ctx * e.head_dim * 4
        rows = max(max_batch, max_q)
        self.ids = np.zeros(rows, np.int64)
        self.mask = np.ones(max_batch * self.max_ctx, np.int64)
        self.logits = host_zeros((rows, self.vocab))  # pages resident once written: release_logits
        self._arange = np.arange(self.max_ctx, dtype=np.int64)
        self._lens = np.zeros(max_batch, np.int64)
        self._binding = self.session.io_binding()
        self._bind_in, self._bind_out, self._run = _raw_binding(self.session, self._binding)
        self._bound_n = 0
        self.calls = 0  # batched calls made (metrics/tests)
        self.slots = [SlotModel(self, j) for j in range(max_batch)]

    def _bind_kv(self, bind_in, bind_out, n: int, offset: int) -> None:
        """Bind every layer's past and present to ``[n, ...]`` at ``base + offset`` bytes."""
        e = self.entry
        shape = [n, e.n_kv_heads, self.max_ctx, e.head_dim]
        for i in range(e.n_layers):
            for kind, buf in (("key", self.keys[i]), ("value", self.values[i])):
                ptr = buf.ctypes.data + offset
                bind_in(f"past_key_values.{i}.{kind}", np.float32, shape, ptr)
                bind_out(f"present.{i}.{kind}", np.float32, shape, ptr)

    def step(self, tokens: Sequence[int] | np.ndarray, lengths: Sequence[int] | np.ndarray) -> np.ndarray:
        """One token per slot for slots ``[0, n)``: row i feeds ``tokens[i]`` at position
        ``lengths[i]`` of slot i (reads its KV rows ``[0, lengths[i])``, writes row
        ``lengths[i]``).

        Args:
            tokens: n token ids, 1 <= n <= max_batch.
            lengths: n committed KV lengths, each ``0 <= L`` and ``L + 1 <= max_ctx``.

        Returns:
            float32 ``[n, vocab]``, a view of the shared logits buffer valid until the next
            call on this model or a slot.

        Raises:
            InputError: n outside 1..max_batch (param ``tokens``), lengths of another count
                or outside the context (param ``lengths``).
        """
        n = len(tokens)
        check_batch_step(n, lengths, self.max_batch)
        lens = self._lens[:n]
        lens[:] = lengths
        if lens.min() < 0 or lens.max() + 1 > self.max_ctx:
            raise InputError(f"lengths must be in 0..{self.max_ctx - 1}, got {lens.min()}..{lens.max()}", "lengths")
        total = int(lens.max()) + 1
        mask = self.mask[: n * total].reshape(n, total)
        np.less_equal(self._arange[:total], lens[:, None], out=mask, casting="unsafe")
        self.ids[:n] = tokens
        if n != self._bound_n:
            self._bind_kv(self._bind_in, self._bind_out, n, 0)
            self._bind_in("input_ids", np.int64, [n, 1], self.ids.ctypes.data)
            self._bind_out("logits", np.float32, [n, 1, self.vocab], self.logits.ctypes.data)
            self._bound_n = n
        self._bind_in("attention_mask", np.int64, [n, total], self.mask.ctypes.data)
        self._run()
        self.calls += 1
        return self.logits[:n]

    def move(self, src: int, dst: int, rows: int) -> None:
        """Copy KV rows ``[0, rows)`` of slot ``src`` into slot ``dst`` (every layer), so the
        active slots stay a contiguous prefix when a row in the middle finishes.

        Raises:
            InputError: a slot outside 0..max_batch-1 or rows outside 0..max_ctx (param ``slot``).
        """
        if not (0 <= src < self.max_batch and 0 <= dst < self.max_batch and 0 <= rows <= self.max_ctx):
            raise InputError(f"move of {rows} rows from slot {src} to {dst}: slots 0..{self.max_batch - 1}, rows <= {self.max_ctx}", "slot")
        if src == dst or rows == 0:
            return
        for buf in (*self.keys, *self.values):
            buf[dst, :, :rows] = buf[src, :, :rows]

    def exchange(self, a: int, b: int, rows_a: int, rows_b: int) -> None:
        """Swap slots ``a`` and ``b``: KV rows ``[0, rows_a)`` of ``a`` go to ``b`` and
        ``[0, rows_b)`` of ``b`` to ``a`` (every layer; a copy of b's rows keeps them while
        a's move).

        Raises:
            InputError: a slot outside 0..max_batch-1 or rows outside 0..max_ctx (param ``slot``).
        """
        if a == b:
            return
        keep = [buf[b, :, :rows_b].copy() for buf in (*self.keys, *self.values)]
        self.move(a, b, rows_a)
        for buf, k in zip((*self.keys, *self.values), keep):
            buf[a, :, :rows_b] = k

    def release_logits(self, start: int) -> int:
        """Give rows ``[max(start, max_batch), max(max_batch, max_q))`` of the shared logits
        buffer back to the OS (whole pages,
        :func:`~specrt.runtime.backends.kv_layout.release_tail_rows`): only a slot's wide call
        (a prefill chunk) writes past the verifications' rows, and rows ``[0, max_batch)``,
        a batched step's, are never released. Between calls only (one scheduler thread);
        rows read zeros afterwards, on Linux, until next written. Returns bytes released."""
        return release_tail_rows(self.logits, max(start, self.max_batch))

    def release_rows(self, slot: int, start: int) -> int:
        """Give slot ``slot``'s KV rows ``[start, max_ctx)`` (every layer and head) back to the
        OS (whole pages, :func:`~specrt.runtime.backends.kv_layout.release_bytes`): a free
        slot keeps resident only the rows its prefix record holds. Returns bytes released.

        Raises:
            InputError: a slot outside 0..max_batch-1 (param ``slot``).
        """
        if not 0 <= slot < self.max_batch:
            raise InputError(f"release of slot {slot}: slots 0..{self.max_batch - 1}", "slot")
        e = self.entry
        spans = head_tails(e.n_kv_heads, self.max_ctx, e.head_dim, start, base=slot * self.slot_bytes)
        return sum(release_bytes(b, spans) for b in (*self.keys, *self.values))

    def close(self) -> None:
        """Drop the buffers and bindings (the shared session lives on with its other users)."""
        self.keys = self.values = []
        self._binding = None
        for s in self.slots:
            s._binding = None
        self.slots = []


class SlotModel:
    """Slot ``j`` of a :class:`BatchedGqaModel` as a batch-1
    :class:`~specrt.runtime.backends.base.Model`: ``run(tokens, start)`` reads and writes
    only that slot's KV (its ``[1, ...]`` block, bound once, in place). Shares the parent's
    ids/mask/logits buffers (calls must not overlap)."""

    def __init__(self, parent: BatchedGqaModel, j: int):
        self.parent, self.slot = parent, j
        self.max_q, self.max_ctx, self.vocab = parent.max_q, parent.max_ctx, parent.vocab
        self._binding = parent.session.io_binding()
        self._bind_in, self._bind_out, self._run = _raw_binding(parent.session, self._binding)
        parent._bind_kv(self._bind_in, self._bind_out, 1, j * parent.slot_bytes)
        self._bound_q = 0

    def run(self, tokens: Sequence[int] | np.ndarray, start: int) -> np.ndarray:
        """Run ``q = len(tokens)`` tokens at positions ``start .. start+q-1`` of this slot.

        Returns:
            float32 ``[q, vocab]`` view of the shared logits buffer (valid until the next call).

        Raises:
            InputError: q or start outside the buffers.
        """
        p = self.parent
        q = len(tokens)
        check_call(q, start, self.max_q, self.max_ctx)
        p.ids[:q] = tokens
        if q != self._bound_q:
            self._bind_in("input_ids", np.int64, [1, q], p.ids.ctypes.data)
            self._bind_out("logits", np.float32, [1, q, self.vocab], p.logits.ctypes.data)
            self._bound_q = q
        p.mask[: start + q] = 1
        self._bind_in("attention_mask", np.int64, [1, start + q], p.mask.ctypes.data)
        self._run()
        return p.logits[:q]

    def kv_prefix(self, rows: int) -> list[np.ndarray]:
        """Views of this slot's KV rows ``[0, rows)``: each layer's keys then values, float32
        ``[kv_heads, rows, head_dim]`` (:class:`~.base.HoldsRows`)."""
        j = self.slot
        return [b[j, :, :rows] for b in (*self.parent.keys, *self.parent.values)]

    def release_logits(self, start: int) -> int:
        """:meth:`BatchedGqaModel.release_logits` of the shared buffer (between calls only)."""
        return self.parent.release_logits(start)

    def fork(self):
        """Not offered: a slot's KV belongs to its batch.

        Raises:
            InputError: always (param ``fork``).
        """
        raise InputError("a batch slot cannot be forked; fork the Engine instead", "fork")

    def close(self) -> None:
        """Nothing to free (the parent owns the buffers)."""
