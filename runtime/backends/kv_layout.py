"""Byte layout of the preallocated KV buffers on a device, shared by the GPU backends.

One buffer per layer and per K/V, each ``[1, pad + max_ctx, n_kv_heads, head_dim]``
(sequence-major, ``BLHD``), carved from one allocation at 256-byte aligned offsets.
For a call with q new tokens after L committed rows::

    past input   -> base                       shape [1, pad + L, h, d]  (read)
    new rows     -> base + (pad + L) * row     shape [1, q, h, d]        (written)

``row`` = ``n_kv_heads * head_dim * itemsize`` bytes. ``pad`` is 0, or 1 for the
min-past workaround of :mod:`specrt.runtime.backends.profiles` (row 0 is a dummy that the
graph slices off). Rolling back is a smaller L on the next call; nothing is copied.

``base + (pad + L) * row`` is 256-byte aligned for every L only when ``row % 256 == 0``
(:attr:`KVLayout.rows_aligned`). TensorRT needs aligned tensor addresses, so the TensorRT
backend binds new rows there only in that case and otherwise stages them
(:mod:`specrt.runtime.backends.trt`); onnxruntime-CUDA binds them in place
(:mod:`specrt.runtime.backends.ort_cuda`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InputError

__all__ = ["ALIGN", "check_call", "align_up", "KVLayout"]

ALIGN = 256  # TensorRT/CUDA alignment for tensor and scratch addresses (bytes)


def check_call(q: int, start: int, max_q: int, max_ctx: int) -> None:
    """Refuse a model call of ``q`` new tokens at past length ``start`` that does not fit the
    buffers (1 <= q <= max_q, 0 <= start, start + q <= max_ctx); shared by the backends.

    Raises:
        InputError: naming q, start and the allowed ranges.
    """
    if q < 1 or q > max_q or start < 0 or start + q > max_ctx:
        raise InputError(f"model call with q={q} new tokens at past length {start}: allowed 1 <= q <= {max_q} and past + q <= max_ctx={max_ctx}")


def align_up(n: int, a: int = ALIGN) -> int:
    """Smallest multiple of ``a`` that is >= ``n`` (bytes)."""
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class KVLayout:
    """KV buffer geometry of one model.

    Attributes:
        n_layers: decoder layers (2 buffers each: key, value).
        n_kv_heads, head_dim: one row holds ``n_kv_heads * head_dim`` elements.
        max_ctx: rows a call can reach (L + q <= max_ctx).
        pad: dummy rows ahead of row 0 (0 or 1).
        itemsize: bytes per element (4 for float32).
    """

    n_layers: int
    n_kv_heads: int
    head_dim: int
    max_ctx: int
    pad: int = 0
    itemsize: int = 4

    @property
    def row_bytes(self) -> int:
        """Bytes of one KV row (one position of one layer's K or V)."""
        return self.n_kv_heads * self.head_dim * self.itemsize

    @property
    def buffer_bytes(self) -> int:
        """Bytes of one buffer (``pad + max_ctx`` rows)."""
        return (self.pad + self.max_ctx) * self.row_bytes

    @property
    def stride(self) -> int:
        """Distance between consecutive buffers in the shared allocation (aligned)."""
        return align_up(self.buffer_bytes)

    @property
    def total_bytes(self) -> int:
        """Size of the one allocation holding all ``2 * n_layers`` buffers."""
        return 2 * self.n_layers * self.stride

    def buffer_bases(self, base: int) -> list[int]:
        """Base address of every buffer, in interface order (key_0, value_0, key_1, ...).

        Args:
            base: address of the shared allocation (256-byte aligned).
        """
        return [base + j * self.stride for j in range(2 * self.n_layers)]

    def names(self) -> list[tuple[str, str]]:
        """(past input, new output) names, in the order of :meth:`buffer_bases`."""
        out = []
        for i in range(self.n_layers):
            out.append((f"past_key_{i}", f"new_key_{i}"))
            out.append((f"past_value_{i}", f"new_value_{i}"))
        return out

    def past_shape(self, past: int) -> tuple[int, int, int, int]:
        """Shape bound to a past input for L = ``past``: ``(1, pad + L, h, d)``."""
        return (1, self.pad + past, self.n_kv_heads, self.head_dim)

    def new_shape(self, q: int) -> tuple[int, int, int, int]:
        """Shape of a new-KV output for q tokens: ``(1, q, h, d)``."""
        return (1, q, self.n_kv_heads, self.head_dim)

    @property
    def rows_aligned(self) -> bool:
        """Whether every row offset is a multiple of :data:`ALIGN` (``row_bytes % ALIGN == 0``)."""
        return self.row_bytes % ALIGN == 0

    def new_offset(self, past: int) -> int:
        """Byte offset of the first new row inside a buffer: ``(pad + L) * row_bytes``."""
        return (self.pad + past) * self.row_bytes
