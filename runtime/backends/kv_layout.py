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

import mmap
from dataclasses import dataclass

import numpy as np

from ..errors import InputError

__all__ = ["ALIGN", "check_call", "check_batch_step", "align_up", "KVLayout", "host_zeros", "release_bytes", "release_tail_rows", "head_tails"]

ALIGN = 256  # TensorRT/CUDA alignment for tensor and scratch addresses (bytes)


def check_call(q: int, start: int, max_q: int, max_ctx: int) -> None:
    """Refuse a model call of ``q`` new tokens at past length ``start`` that does not fit the
    buffers (1 <= q <= max_q, 0 <= start, start + q <= max_ctx); shared by the backends.

    Raises:
        InputError: naming q, start and the allowed ranges.
    """
    if q < 1 or q > max_q or start < 0 or start + q > max_ctx:
        raise InputError(f"model call with q={q} new tokens at past length {start}: allowed 1 <= q <= {max_q} and past + q <= max_ctx={max_ctx}")


def check_batch_step(n: int, lengths, max_batch: int) -> None:
    """Refuse a batched step of ``n`` rows (one token each) over ``lengths`` that the batch
    cannot take (1 <= n <= max_batch, one length a row); shared by the batched models.

    Raises:
        InputError: n outside 1..max_batch (param ``tokens``), lengths of another count
            (param ``lengths``).
    """
    if not 1 <= n <= max_batch:
        raise InputError(f"a batched step takes 1..{max_batch} rows, got {n}", "tokens")
    if len(lengths) != n:
        raise InputError(f"{len(lengths)} lengths for {n} tokens", "lengths")


class _KVMap(mmap.mmap):
    """A private anonymous mapping made by :func:`host_zeros` (only these are released:
    a file mapping's pages, or another owner's, must never be dropped)."""


# Linux (and the BSDs): MAP_PRIVATE anonymous mappings whose pages MADV_DONTNEED drops; elsewhere
# (Windows) the buffers are plain numpy memory and nothing is released
_CAN_RELEASE = hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MADV_DONTNEED")


def host_zeros(shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """A zero-filled host array in its own private anonymous memory mapping (page-aligned),
    for KV buffers: its pages become resident only once written, and :func:`release_bytes`
    can hand ranges of them back to the OS (a prefix cache's budget bounds what idle slots
    keep resident; ``np.zeros`` memory could not be released without freeing the array).
    Transparent huge pages are refused for it (``MADV_NOHUGEPAGE``): khugepaged could
    otherwise fold released pages back into a resident huge page. Where the OS has no
    private mappings with ``MADV_DONTNEED`` (Windows), plain ``np.zeros``.

    Args:
        shape: the array's shape (elements). dtype: a numpy dtype.

    Returns:
        A writable C-contiguous array viewing the mapping (the mapping lives as long as it).
    """
    dt = np.dtype(dtype)
    if not _CAN_RELEASE:
        return np.zeros(shape, dt)
    count = int(np.prod(shape, dtype=np.int64))
    # private: MADV_DONTNEED then drops the pages (a shared mapping keeps them in shmem)
    buf = _KVMap(-1, max(1, count * dt.itemsize), flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, dt, count).reshape(shape)


def release_bytes(arr: np.ndarray, ranges) -> int:
    """Hand the whole pages inside byte ranges of ``arr`` back to the OS
    (``madvise(MADV_DONTNEED)``): they stop counting in the RSS and, on Linux, read as zeros
    until next written. Partial pages at a range's ends are kept (their other bytes may be
    live).

    Args:
        arr: an array from :func:`host_zeros`, or a view into one (else nothing happens:
            0 is returned; file mappings and other memory are never touched).
        ranges: ``(start, stop)`` byte offsets from ``arr``'s first element, stop exclusive;
            they must lie inside the mapping.

    Returns:
        Bytes released (whole pages).

    Raises:
        ValueError: a range outside the mapping.
    """
    mm = arr.base
    while mm is not None and not isinstance(mm, mmap.mmap):  # array -> ... -> memoryview -> mmap
        mm = mm.obj if isinstance(mm, memoryview) else getattr(mm, "base", None)
    if not isinstance(mm, _KVMap) or not _CAN_RELEASE:
        return 0
    first = arr.ctypes.data - np.frombuffer(mm, np.uint8, 1).ctypes.data  # arr's offset in the mapping
    page, done, size = mmap.PAGESIZE, 0, len(mm)
    for lo, hi in ranges:
        lo, hi = first + int(lo), first + int(hi)
        if lo < 0 or hi > size:
            raise ValueError(f"byte range [{lo}, {hi}) is outside the {size}-byte mapping")
        lo, hi = -(-lo // page) * page, hi // page * page
        if hi > lo:
            mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            done += hi - lo
    return done


def release_tail_rows(buf: np.ndarray, start: int) -> int:
    """:func:`release_bytes` of rows ``[start, n)`` of C-contiguous ``buf`` viewed as
    ``[n, buf.shape[-1]]`` (a logits buffer ``[1, max_q, vocab]`` or ``[rows, vocab]``);
    ``start`` is clamped to ``[0, n]``. Returns bytes released."""
    row, n = buf.shape[-1] * buf.itemsize, buf.size // buf.shape[-1]
    return release_bytes(buf, [(min(max(0, start), n) * row, n * row)])


def head_tails(heads: int, max_ctx: int, head_dim: int, start: int, base: int = 0, itemsize: int = 4) -> list[tuple[int, int]]:
    """Byte ranges of rows ``[start, max_ctx)`` in a head-major KV block ``[heads, max_ctx,
    head_dim]`` beginning ``base`` bytes into its buffer (one range per head), for
    :func:`release_bytes`."""
    per = max_ctx * head_dim * itemsize
    lo = max(0, start) * head_dim * itemsize
    return [(base + h * per + lo, base + (h + 1) * per) for h in range(heads)]


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
