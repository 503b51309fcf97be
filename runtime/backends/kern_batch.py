"""Continuous batching on specrt's kernels: :class:`KernelBatch`, ``max_batch`` KV slots over
one target's panels, several sequences per C call.

Each slot is a :class:`~.kern.KernelModel` fork (its own KV buffers, allocated once; a batch-1
``run`` for the prefill and a speculative round). A batched call is ONE ``sk_step_rows`` over
rows of several slots: row i feeds a token at a position of its own slot's cache
(:meth:`KernelBatch.rows`); :meth:`KernelBatch.step` is the scheduler's q = 1 step over slots
``[0, n)``. The kernels compute every row by the same operations whatever else shares the call
(sk.h's exactness contract; the attention of a row reads only its own cache), so a row of a
batched call is bit-identical to the same row of a batch-1 call: continuous batching changes
no output, greedy or seeded, and the rows it writes stay reusable by the prefix cache
(``exact = True``, which :class:`~specrt.runtime.serve.batching.BatchPool` reads).

Slots move by exchanging buffers, not copying rows (:meth:`KernelBatch.exchange`): each slot's
cache is its own allocation.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np

from ..errors import EngineError, InputError
from ..kernels import check_rc
from .kern import KernelModel, int_array, token_ids
from .kv_layout import check_batch_step, host_zeros

__all__ = ["KernelBatch"]


class KernelBatch:
    """``max_batch`` slots over ``base``'s weights (module docstring); the batched-model
    interface of :class:`~specrt.runtime.backends.ort_gqa_batch.BatchedGqaModel` (``step``,
    ``slots``, ``exchange``, ``release_rows``, ``release_logits``, ``close``).

    Args:
        base: the target's :class:`~.kern.KernelModel` (its weights are shared, its own KV
            is not used).
        max_batch: slots, >= 1.
        max_rows: the most rows of one batched call (:meth:`rows`), 1..the weights' max_q;
            default ``max_batch``.

    Buffers (once): per slot a fork's K/V caches (f16; pages resident once written); ids and
    positions int32 ``[max_rows]``; cache pointers ``[max_rows]``; logits float32
    ``[max_rows, vocab]``.

    Raises:
        InputError: ``max_batch`` < 1 (param ``max_batch``), ``max_rows`` outside
            1..max_q (param ``max_rows``), or a target whose LM head is trimmed (a draft's).
    """

    exact = True  # a batched row's bits are a batch-1 row's (module docstring)

    def __init__(self, base: KernelModel, max_batch: int, max_rows: int | None = None):
        if max_batch < 1:
            raise InputError(f"max_batch must be >= 1, got {max_batch}", "max_batch")
        max_rows = max_batch if max_rows is None else max_rows
        if not 1 <= max_rows <= base.max_q:
            raise InputError(f"max_rows must be in 1..{base.max_q}, got {max_rows}", "max_rows")
        if base.head is not None:
            raise InputError("a batched target needs its full LM head (this model's is trimmed)", "base")
        self.w, self.isa, self._isa = base.w, base.isa, base._isa
        self.max_batch, self.max_rows = max_batch, max_rows
        self.max_q, self.max_ctx, self.vocab = base.max_q, base.max_ctx, base.vocab
        self.slots = [base.fork() for _ in range(max_batch)]
        self.ids = np.zeros(max_rows, np.int32)
        self.pos = np.zeros(max_rows, np.int32)
        self._kvp = (ctypes.c_void_p * max_rows)()
        self.logits = host_zeros((max_rows, self.vocab))
        self.calls = 0  # batched calls made (metrics/tests)

    def rows(self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        """One call over rows of several slots: row i feeds ``tokens[i]`` at position
        ``positions[i]`` of slot ``slots[i]``'s cache (reads its rows ``[0, positions[i]]``,
        this call's lower rows of the same slot included; writes row ``positions[i]``).

        Returns:
            float32 ``[len(tokens), vocab]``, a view of the batch's logits buffer valid until
            the next call.

        Raises:
            InputError: lengths differ, no rows or more than ``max_rows``, a slot outside
                0..max_batch-1, a position outside the context, one (slot, position) twice,
                or a token id outside the vocabulary.
        """
        if not self.slots:
            raise EngineError("this kernels batch is closed; build another", "engine")
        q = len(tokens)
        if not (len(slots) == q == len(positions)):
            raise InputError(f"{len(slots)} slots, {q} tokens and {len(positions)} positions: one each per row", "tokens")
        if not 1 <= q <= self.max_rows:
            raise InputError(f"a batched call takes 1..{self.max_rows} rows, got {q}", "tokens")
        toks = token_ids(tokens, self.w.n_vocab)
        at = int_array(positions, "positions", "lengths")  # range-checked before the int32 buffer: no wrap
        if int(at.min()) < 0 or int(at.max()) >= self.max_ctx:
            raise InputError(f"positions must be in 0..{self.max_ctx - 1}, got {int(at.min())}..{int(at.max())}", "lengths")
        sl = [int(j) for j in slots]
        if any(not 0 <= j < self.max_batch for j in sl):
            raise InputError(f"slots {sl}: slots 0..{self.max_batch - 1}", "slot")
        if len(set(zip(sl, at.tolist()))) != q:
            raise InputError("a batched call names one (slot, position) twice", "lengths")
        w = self.w
        with w.lock:  # the buffers C reads are filled under the lock that serializes calls
            for i, j in enumerate(sl):
                self.slots[j]._open()
                self._kvp[i] = ctypes.addressof(self.slots[j]._kv)
            self.ids[:q] = toks
            self.pos[:q] = at
            rc = w.lib.sk_step_rows(
                self._isa, ctypes.byref(w.model), self._kvp, w.scratch, self.ids.ctypes.data, self.pos.ctypes.data, q, self.logits.ctypes.data, self.vocab, 0
            )
        if rc == -3:
            raise InputError(f"a token id in {list(map(int, self.ids[:q]))} is outside the vocabulary 0..{self.vocab - 1}", "tokens")
        check_rc(rc, "kernels batched step")
        self.calls += 1
        return self.logits[:q]

    def step(self, tokens: Sequence[int] | np.ndarray, lengths: Sequence[int] | np.ndarray) -> np.ndarray:
        """One token per slot for slots ``[0, n)``: row i feeds ``tokens[i]`` at position
        ``lengths[i]`` of slot i (:meth:`rows`).

        Returns:
            float32 ``[n, vocab]`` (valid until the next call).

        Raises:
            InputError: n outside 1..max_batch (param ``tokens``), lengths of another count
                or outside the context (param ``lengths``).
        """
        n = len(tokens)
        check_batch_step(n, lengths, self.max_batch)
        return self.rows(range(n), tokens, lengths)

    def exchange(self, a: int, b: int, rows_a: int = 0, rows_b: int = 0) -> None:
        """Swap slots ``a`` and ``b``'s caches (every row; O(1): the buffers change owner, the
        slot objects stay). ``rows_a``/``rows_b``: unused (the ONNX batch copies that many).

        Raises:
            InputError: a slot outside 0..max_batch-1 (param ``slot``).
        """
        if not (0 <= a < self.max_batch and 0 <= b < self.max_batch):
            raise InputError(f"exchange of slots {a} and {b}: slots 0..{self.max_batch - 1}", "slot")
        if a != b:
            self.slots[a].swap_kv(self.slots[b])

    def release_rows(self, slot: int, start: int) -> int:
        """Give slot ``slot``'s KV rows ``[start, max_ctx)`` back to the OS (whole pages);
        returns bytes released.

        Raises:
            InputError: a slot outside 0..max_batch-1 (param ``slot``).
        """
        if not 0 <= slot < self.max_batch:
            raise InputError(f"release of slot {slot}: slots 0..{self.max_batch - 1}", "slot")
        return self.slots[slot].release_rows(start)

    def close(self) -> None:
        """Drop the slots' buffers and the batch's (the weights live on with their other users)."""
        for s in self.slots:
            s.close()
        self.slots = []
        self.logits = None
