"""GGUF weight blocks as MatMulNBits terms, without a second quantization.

A GGUF tensor stores each row in blocks: integers ``q`` with a float scale per block, and for
the asymmetric types a float offset (``Q4_1``: ``w = d q + m``; ``Q4_K``: ``w = d sc q - dmin mn``
per 32 weights). onnxruntime's ``MatMulNBits`` computes ``w = s (q - z)`` with an integer
zero point ``z`` per block; a float offset is not an integer zero point (and MatMulNBits'
float zero points run on a slow fallback: 80-100 ms for a 1536 x 8960 layer against 1.1 ms,
measured, docs/guide/real-pair.md). So a layer is written as two terms::

    W x = MatMulNBits(q, s, z) x - M . blocksum32(x)

where ``M`` [rows, K / 32] holds each 32-block's offset (0 for the symmetric types) and
``blocksum32(x)`` the sums of ``x`` over each 32 inputs (what llama.cpp's K-quant dot products
do with the activations' ``bsums``). Every GGUF type used for LLM weights maps exactly:

====== ===== ===== ==================== =====================
type   bits  block q                    z, M
====== ===== ===== ==================== =====================
Q4_0   4     32    4-bit                z 8
Q4_1   4     32    4-bit                z 0, M = -m
Q4_K   4     32    4-bit                z 0, M = dmin mn
Q5_0   8     32    5-bit                z 16
Q6_K   8     16    6-bit                z 32
Q8_0   8     32    8-bit + 128          z 128
====== ===== ===== ==================== =====================

The integers and scales are read with the ``gguf`` package's block layout (the same splits
its ``dequantize_blocks`` makes; ``Q4_K.get_scale_min`` for the packed 6-bit scales), and
every unpacked tensor is checked against ``gguf.dequantize`` of the same bytes
(:func:`unpack` refuses a difference), so this module can only regroup what gguf computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specrt.runtime.errors import ExportError

__all__ = ["Blocks", "EXACT_TYPES", "unpack", "regroup"]

MIN_GROUP = 32  # the offsets' block (every asymmetric GGUF type keeps one per 32 weights)


@dataclass
class Blocks:
    """One weight matrix as MatMulNBits terms.

    Attributes:
        q: uint8 ``[rows, K]`` unsigned integers (< 2**bits).
        scales: float32 ``[rows, K / group]``.
        zeros: uint8 ``[rows, K / group]`` integer zero points.
        mins: float32 ``[rows, K / 32]`` offsets subtracted per 32-block, or None.
        bits: 4 or 8. group: weights per scale (16 or 32).
    """

    q: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray
    mins: np.ndarray | None
    bits: int
    group: int

    def dense(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """float32 ``[hi - lo, K]``: ``s (q - z) - M`` of rows ``[lo, hi)`` (the oracle comparison)."""
        r = slice(lo, hi)
        w = (self.q[r].astype(np.float32) - np.repeat(self.zeros[r], self.group, 1).astype(np.float32)) * np.repeat(self.scales[r], self.group, 1)
        if self.mins is not None:
            w = w - np.repeat(self.mins[r], MIN_GROUP, 1)
        return w


def _nibbles(qs: np.ndarray, n_blocks: int, half: int) -> np.ndarray:
    """Low nibbles then high nibbles of each block (gguf's Q4_0 order): uint8 [n_blocks, 2 half]."""
    q = qs.reshape((n_blocks, -1, 1, half)) >> np.array([0, 4], dtype=np.uint8).reshape((1, 1, 2, 1))
    return (q & np.uint8(0x0F)).reshape((n_blocks, -1))


def _q4_0(b: np.ndarray):
    d, qs = np.hsplit(b, [2])
    return _nibbles(qs, len(b), 16), d.view(np.float16).astype(np.float32), 8, None, 4, 32


def _q4_1(b: np.ndarray):
    d, rest = np.hsplit(b, [2])
    m, qs = np.hsplit(rest, [2])
    return _nibbles(qs, len(b), 16), d.view(np.float16).astype(np.float32), 0, -m.view(np.float16).astype(np.float32), 4, 32


def _q5_0(b: np.ndarray):
    n = len(b)
    d, rest = np.hsplit(b, [2])
    qh, qs = np.hsplit(rest, [4])
    qh = (qh.copy().view(np.uint32).reshape((n, 1)) >> np.arange(32, dtype=np.uint32).reshape((1, 32))) & np.uint32(1)
    q = _nibbles(qs, n, 16) | (qh.astype(np.uint8) << np.uint8(4))
    return q, d.view(np.float16).astype(np.float32), 16, None, 8, 32


def _q8_0(b: np.ndarray):
    d, x = np.split(b, [2], axis=1)
    q = (x.view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q, d.view(np.float16).astype(np.float32), 128, None, 8, 32


def _q4_k(b: np.ndarray):
    from gguf.quants import Q4_K

    n = len(b)
    d, rest = np.hsplit(b, [2])
    dmin, rest = np.hsplit(rest, [2])
    scales, qs = np.hsplit(rest, [Q4_K.K_SCALE_SIZE])
    sc, mn = Q4_K.get_scale_min(scales)
    d = d.view(np.float16).astype(np.float32)
    dmin = dmin.view(np.float16).astype(np.float32)
    q = qs.reshape((n, -1, 1, 32)) >> np.array([0, 4], dtype=np.uint8).reshape((1, 1, 2, 1))
    q = (q & np.uint8(0x0F)).reshape((n, 256))
    return q, (d * sc.astype(np.float32)), 0, (dmin * mn.astype(np.float32)), 4, 32


def _q6_k(b: np.ndarray):
    n = len(b)
    ql, rest = np.hsplit(b, [128])
    qh, rest = np.hsplit(rest, [64])
    scales, d = np.hsplit(rest, [16])
    s = d.view(np.float16).astype(np.float32) * scales.view(np.int8).astype(np.float32)
    ql = ql.reshape((n, -1, 1, 64)) >> np.array([0, 4], dtype=np.uint8).reshape((1, 1, 2, 1))
    ql = (ql & np.uint8(0x0F)).reshape((n, -1, 32))
    qh = qh.reshape((n, -1, 1, 32)) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape((1, 1, 4, 1))
    qh = (qh & np.uint8(0x03)).reshape((n, -1, 32))
    q = (ql | (qh << np.uint8(4))).reshape((n, 256))  # unsigned 0..63; gguf subtracts 32
    return q, s, 32, None, 8, 16


_UNPACK = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q5_0": _q5_0, "Q6_K": _q6_k, "Q8_0": _q8_0}
EXACT_TYPES = tuple(_UNPACK)


def unpack(tensor) -> Blocks:
    """The MatMulNBits terms of one 2-D GGUF tensor (a ``gguf.ReaderTensor``), checked
    against ``gguf.dequantize`` of the same bytes.

    Raises:
        ExportError: a type outside :data:`EXACT_TYPES`, a tensor that is not 2-D, or
            terms that do not reproduce gguf's dequantized values.
    """
    from gguf import GGML_QUANT_SIZES, dequantize

    kind = tensor.tensor_type.name
    if kind not in _UNPACK:
        raise ExportError(f"{tensor.name}: {kind} blocks have no exact MatMulNBits form here (exact: {', '.join(EXACT_TYPES)})")
    raw = np.asarray(tensor.data)
    if raw.ndim != 2:
        raise ExportError(f"{tensor.name}: {raw.ndim}-D; only 2-D weights map onto MatMulNBits")
    rows = raw.shape[0]
    block, size = GGML_QUANT_SIZES[tensor.tensor_type]
    blocks = raw.reshape(-1, size)
    q, s, z, mins, bits, group = _UNPACK[kind](blocks)
    K = q.size // rows
    q = q.reshape(rows, K)
    s = np.ascontiguousarray(s.reshape(rows, K // group), dtype=np.float32)
    zeros = np.full(s.shape, z, np.uint8)
    mins = None if mins is None else np.ascontiguousarray(mins.reshape(rows, K // MIN_GROUP), dtype=np.float32)
    out = Blocks(q, s, zeros, mins, bits, group)
    step = max(1, (1 << 22) // K)  # rows per check: 16 MiB of float32 at a time
    for lo in range(0, rows, step):
        want = dequantize(raw[lo : lo + step], tensor.tensor_type).reshape(-1, K)
        got = out.dense(lo, lo + step)
        diff = float(np.abs(got - want).max())
        if diff > 1e-6 * max(1.0, float(np.abs(want).max())):
            raise ExportError(f"{tensor.name}: the unpacked {kind} blocks differ from gguf's dequantization by {diff:.3g} (rows {lo}..)")
    return out


def regroup(b: Blocks, bits: int, group: int) -> Blocks:
    """``b`` stored at ``bits`` (>= its own: the integers are unchanged) and ``group``
    (a divisor of its own: each scale and zero point repeated per smaller block), for a
    node it shares with other layers (the builder fuses q/k/v into one MatMulNBits)."""
    if bits < b.bits or b.group % group:
        raise ExportError(f"cannot store {b.bits}-bit blocks of {b.group} as {bits}-bit blocks of {group}")
    r = b.group // group
    return Blocks(b.q, np.repeat(b.scales, r, 1), np.repeat(b.zeros, r, 1), b.mins, bits, group)
