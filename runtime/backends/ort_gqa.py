"""onnxruntime CPU backend for *builder* graphs (onnxruntime-genai's model builder): fused
GroupQueryAttention, MatMulNBits int4/int8 weights, SkipSimplifiedLayerNormalization.

The graph's interface (see :mod:`specrt.runtime.manifest`, graph form ``builder``)::

    input_ids                 int64   [1, q]
    attention_mask            int64   [1, total]              all ones; total = start + q
    past_key_values.i.key     float32 [1, kv_heads, S, head_dim] (BNSH; also .value)
    logits                    float32 [1, q, vocab]
    present.i.key             float32 [1, kv_heads, S', head_dim] (also .value)

GroupQueryAttention takes its positions from the mask (``seqlens_k = sum(mask) - 1``,
positions ``total - q .. total - 1``; no ``position_ids`` input) and, when the past and the
present of a layer are *the same buffer*, writes only the q new rows at
``[start, start + q)`` and reads rows ``[0, start + q)`` (onnxruntime's shared-buffer path,
the one onnxruntime-genai uses with ``past_present_share_buffer``). So this class binds, per
layer, ONE preallocated buffer ``[1, kv_heads, max_ctx, head_dim]`` to both
``past_key_values.i.*`` and ``present.i.*``, ONCE, when the binding is made; per call only
``input_ids`` ``[1, q]``, ``attention_mask`` (a view ``[1, start + q]`` of a preallocated
ones buffer) and ``logits`` ``[1, q, vocab]`` are bound, and the ids and logits bindings
only when q changes. Rolling back is the next call with a smaller ``start`` (a shorter
mask): rows at and beyond it are never read.

Limits of the graph (onnxruntime's GroupQueryAttention on CPU, measured in research r14):
batch 1 when q > 1 follows a past; contiguous positions only; ``start + q`` at most the
rotary cache rows (the checkpoint's ``max_position_embeddings``; the export checks
``max_ctx`` against it); head_dim a multiple of 16 with rotary. onnxruntime >= 1.23 loads
builder-0.18 graphs (GroupQueryAttention with 12 inputs, GatherBlockQuantized ``bits``).

No body/head split: the builder graph computes the LM head inside (``lazy-head`` is
offered for standard graphs only), so this class does not implement
:class:`~specrt.runtime.backends.base.SplitsHead`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from ..manifest import ModelEntry
from .base import ThreadConfig
from .kv_layout import check_call, head_tails, host_zeros, release_bytes, release_tail_rows
from .ort import _raw_binding, cpu_session

__all__ = ["OrtGqaModel"]


class OrtGqaModel:
    """One builder graph on onnxruntime CPU with its KV bound once, in place (see the module
    docstring); implements :class:`~specrt.runtime.backends.base.Model`.

    Args:
        path: the ONNX file (its external weights beside it).
        entry: its manifest entry (graph form ``builder``; dims and I/O names).
        max_ctx: KV buffer rows; ``start + q <= max_ctx``.
        max_q: widest call; sizes the ids and logits buffers.
        threads: :class:`~specrt.runtime.backends.base.ThreadConfig`.

    Buffers (all allocated here, once): per layer key and value float32
    ``[1, n_kv_heads, max_ctx, head_dim]``; ``input_ids`` int64 ``[1, max_q]``;
    ``attention_mask`` int64 ones ``[1, max_ctx]``; ``logits`` float32 ``[1, max_q, vocab]``.

    Raises:
        EngineError: onnxruntime cannot load the file (e.g. onnxruntime < 1.23), or its I/O
            names differ from the manifest's.
    """

    def __init__(self, path: Path, entry: ModelEntry, max_ctx: int, max_q: int, threads: ThreadConfig = ThreadConfig()):
        self.session = cpu_session(path, threads, entry.inputs, entry.outputs)
        self._allocate(entry, max_ctx, max_q)

    def _allocate(self, entry: ModelEntry, max_ctx: int, max_q: int) -> None:
        """Buffers and binding of one model object; the KV is bound here, once."""
        self.entry, self.max_ctx, self.max_q, self.vocab = entry, max_ctx, max_q, entry.vocab_size
        shape = (1, entry.n_kv_heads, max_ctx, entry.head_dim)
        self.keys = [host_zeros(shape) for _ in range(entry.n_layers)]
        self.values = [host_zeros(shape) for _ in range(entry.n_layers)]
        self.ids = np.zeros((1, max_q), np.int64)
        self.mask = np.ones((1, max_ctx), np.int64)
        self.logits = host_zeros((1, max_q, self.vocab))  # pages resident once written: release_logits
        self._binding = self.session.io_binding()
        self._bind_in, self._bind_out, self._run = _raw_binding(self.session, self._binding)
        kv_shape = list(shape)
        for i in range(entry.n_layers):
            for kind, buf in (("key", self.keys[i]), ("value", self.values[i])):
                ptr = buf.ctypes.data
                # the same pointer and shape for past and present: GQA's in-place path
                self._bind_in(f"past_key_values.{i}.{kind}", np.float32, kv_shape, ptr)
                self._bind_out(f"present.{i}.{kind}", np.float32, kv_shape, ptr)
        self._ids_ptr, self._mask_ptr, self._logits_ptr = self.ids.ctypes.data, self.mask.ctypes.data, self.logits.ctypes.data
        self._bound_q = 0  # q of the current ids/logits bindings (0: none yet)

    def run(self, tokens: Sequence[int] | np.ndarray, start: int) -> np.ndarray:
        """Run ``q = len(tokens)`` new tokens at positions ``start .. start+q-1``.

        Reads KV rows [0, start) and writes rows [start, start+q) of every layer in place.

        Args:
            tokens: q token ids (list or int array), 1 <= q <= max_q.
            start: committed KV length L; 0 <= start and start + q <= max_ctx.

        Returns:
            float32 view ``[q, vocab]`` of the preallocated logits buffer (valid until the
            next call; copy it to keep it).

        Raises:
            InputError: q or start outside the buffers.
        """
        q = len(tokens)
        check_call(q, start, self.max_q, self.max_ctx)
        self.ids[0, :q] = tokens
        if q != self._bound_q:
            self._bind_in("input_ids", np.int64, [1, q], self._ids_ptr)
            self._bind_out("logits", np.float32, [1, q, self.vocab], self._logits_ptr)
            self._bound_q = q
        self._bind_in("attention_mask", np.int64, [1, start + q], self._mask_ptr)
        self._run()
        return self.logits[0, :q]

    def fork(self) -> "OrtGqaModel":
        """A model over the same onnxruntime session (weights loaded once) with its own KV,
        ids, mask and logits buffers and its own binding (thread-safe across bindings).
        Costs ``2 * n_layers * max_ctx * n_kv_heads * head_dim * 4`` bytes of KV plus
        ``max_q * vocab * 4`` of logits."""
        new = object.__new__(type(self))
        new.session = self.session
        new._allocate(self.entry, self.max_ctx, self.max_q)
        return new

    def close(self) -> None:
        """Drop the buffers and the binding (the shared session is freed with its last user)."""
        self.keys = self.values = []
        self._binding = None

    def release_logits(self, start: int = 0) -> int:
        """Give logits rows ``[start, max_q)`` back to the OS (whole pages,
        :func:`~specrt.runtime.backends.kv_layout.release_tail_rows`): only a wide call (a
        prefill chunk) writes them, and a ``max_q x vocab`` float32 buffer is 148 MiB for a
        152k vocabulary, resident from the first wide call on otherwise. Once the last call's
        rows have been read (:class:`~specrt.runtime.backends.base.Model`); they read zeros
        afterwards, on Linux, until next written. Returns bytes released."""
        return release_tail_rows(self.logits, start)

    def release_rows(self, start: int) -> int:
        """Give KV rows ``[start, max_ctx)`` of every layer and head back to the OS (whole
        pages, :func:`~specrt.runtime.backends.kv_layout.release_bytes`); on Linux they read as
        zeros until next written. For rows nothing will read again (past a kept prefix record).
        Returns bytes released."""
        return sum(release_bytes(b, head_tails(self.entry.n_kv_heads, self.max_ctx, self.entry.head_dim, start)) for b in (*self.keys, *self.values))

    def output_pointers(self) -> dict[str, int]:
        """Data pointers of the outputs of the last call by name (tests check that every
        ``present.*`` is its layer's KV buffer, i.e. nothing was allocated or copied)."""
        names = [o.name for o in self.session.get_outputs()]
        bound = {}
        for name, v in zip(self._output_order(), self._binding.get_outputs()):
            bound[name] = v.data_ptr()
        return {n: bound[n] for n in names if n in bound}

    def _output_order(self) -> list[str]:
        """Output names in the order they were first bound (onnxruntime keeps that order)."""
        names = []
        for i in range(self.entry.n_layers):
            names += [f"present.{i}.key", f"present.{i}.value"]
        return names + ["logits"]

    def kv_prefix(self, rows: int) -> list[np.ndarray]:
        """Views of KV rows ``[0, rows)``: each layer's keys then values, float32 ``[1,
        kv_heads, rows, head_dim]`` (:class:`~.base.HoldsRows`)."""
        return [b[:, :, :rows] for b in (*self.keys, *self.values)]

    def kv_rows(self, layer: int, lo: int, hi: int) -> np.ndarray:
        """Key rows ``[lo, hi)`` of a layer as ``[rows, kv_heads, head_dim]`` (BLHD, for
        comparisons with standard graphs)."""
        return self.keys[layer][0, :, lo:hi].transpose(1, 0, 2)
