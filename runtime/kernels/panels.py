"""The panel layout of specrt's kernels, written from a GGUF tensor's own blocks.

A weight matrix ``W [n, k]`` (GGUF: ``n`` rows of ``k / block`` blocks) becomes panels of
:data:`P` = 16 output columns. Per panel and per K block, the block's integers are
interleaved by column, four consecutive k of one column in one 32-bit lane, so that one
64-byte load serves 16 columns and every row of a q-row call (runtime/kernels/c/dot_*.h).
The integers and fp16 scales are the file's own: nothing is requantized, so the layout is
exact by construction, and :func:`check_tensor` proves it per tensor by dequantizing the
panels in C and comparing bit for bit with ``gguf.dequantize`` of the same bytes.

Per panel and K block (``c`` = column in the panel, ``e`` = byte in the lane):

======= ======== ==================================================================
type    bytes    layout
======= ======== ==================================================================
Q4_K    2368     qs[4 i][8 t][16 c][4 e] = q(64i+4t+e) | q(64i+32+4t+e) << 4 (GGUF's own
                 qs bytes, transposed); sc[8][16] u8; mn[8][16] u8; d[16] f16; dmin[16] f16
Q5_K    2880     as Q4_K, with qh[8 t][16 c][4 e] (GGUF's qh bytes: bit j = the fifth bit of
                 sub-block j's value 4t+e) after qs
Q6_K    3360     ql[8 p][4 t][16 c][4 e] = lo4 q(32p+4t+e) | lo4 q(32p+16+4t+e) << 4;
                 qh[4 g][4 t][16 c][4 e] = sum_u hi2 q(16(4g+u)+4t+e) << 2u;
                 sc[16][16] i8; d[16] f16
Q3_K    3360     as Q6_K with q = v + 32 (v = -4..3) and sc = s - 32 (its 6-bit scale)
Q2_K    1600     qs[2 g][8 t][16 c][4 e] = GGUF's byte 32g+4t+e (value 128g+32s+4t+e in bits
                 2s); sc[16][16] u8; mn[16][16] u8 (the scale bytes' nibbles); d, dmin f16
IQ4_XS  2208     qs[8 j][4 t][16 c][4 e] = GGUF's byte 16j+4t+e (sub-block j's nibbles, as
                 Q4_0's); sc[8][16] i8 = ls - 32; d[16] f16
Q8_0    544      qs[8 t][16 c][4 e] = q(4t+e) (int8); d[16] f16
Q5_0    544      as Q8_0 with q - 16 (int8, -16..15)
Q5_1    576      qs[8 t][16 c][4 e] = q(4t+e) (uint8, 0..31); d[16] f16; m[16] f16
Q4_0    288      qs[4 t][16 c][4 e] = q(4t+e) | q(16+4t+e) << 4 (GGUF's bytes); d[16] f16
Q4_1    320      as Q4_0; d[16] f16; m[16] f16
IQ4_NL  288      as Q4_0 (the kernels look each nibble up in the table, -127..113)
F32     64       per k: w[16 c] f32 (a "block" is one k)
F16     32       per k: w[16 c] f16
BF16    32       per k: w[16 c] bf16
======= ======== ==================================================================

Q4_K, Q4_0/Q4_1, IQ4_NL, IQ4_XS and Q2_K hold the GGUF's bytes per column (Q4_K adds 4 bytes
a block: its 6-bit scales unpacked; IQ4_XS 2: its scales unpacked; Q2_K 16: its scale bytes
split), Q5_K adds 4; Q6_K, Q8_0 and the floats are the same size as the GGUF. Three types are
unpacked to bytes so that a simple (or an existing) kernel reads them: Q5_0 grows from 22 to
34 bytes a block (Q8_0's kernel), Q5_1 from 24 to 36, Q3_K from 110 to 210 (Q6_K's kernel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

__all__ = ["P", "BlockType", "TABLE", "TYPES", "BLOCK", "GGUF_BLOCK_BYTES", "PANEL_BLOCK_BYTES", "panel_bytes", "pack", "supported"]

P = 16  # output columns per panel


def supported(ggml_type: int, n: int, k: int) -> str | None:
    """None when the kernels run a ``[n, k]`` matrix of ``ggml_type``, else why not (one line)."""
    if ggml_type not in TYPES:
        return f"type {ggml_type} is not one the kernels run ({', '.join(TYPES.values())})"
    if n % P:
        return f"{n} output columns is not a multiple of {P}"
    if k % BLOCK[ggml_type]:
        return f"{k} inputs is not a multiple of the {TYPES[ggml_type]} block ({BLOCK[ggml_type]})"
    return None


def panel_bytes(ggml_type: int, n: int, k: int) -> int:
    """Bytes of the panel form of an ``[n, k]`` matrix."""
    return (n // P) * (k // BLOCK[ggml_type]) * PANEL_BLOCK_BYTES[ggml_type]


def _blocks(raw: np.ndarray, ggml_type: int, n: int, k: int) -> np.ndarray:
    """The GGUF bytes as ``uint8 [n // P, P, nb, block_bytes]`` (panel, column, block, byte)."""
    nb, bb = k // BLOCK[ggml_type], GGUF_BLOCK_BYTES[ggml_type]
    a = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if a.size != n * nb * bb:
        raise ValueError(f"{a.size} bytes for a [{n}, {k}] {TYPES[ggml_type]} tensor; expected {n * nb * bb}")
    return a.reshape(n // P, P, nb, bb)


def _cols_last(x: np.ndarray) -> np.ndarray:
    """``[np, P, nb, ...]`` -> ``[np, nb, ..., P]`` bytes (columns innermost, before the lane bytes)."""
    return np.moveaxis(x, 1, -1)


def _lanes(x: np.ndarray) -> np.ndarray:
    """``[np, P, nb, G, 4]`` (4 bytes of one column a lane) -> ``[np, nb, G, P, 4]`` bytes."""
    return np.moveaxis(x, 1, 3)


def _q4k(b: np.ndarray) -> list[np.ndarray]:
    npan, _, nb, _ = b.shape
    d, dmin, scales, qs = b[..., 0:2], b[..., 2:4], b[..., 4:16], b[..., 16:144]
    sc, mn = _k_scales(scales)
    return [
        _lanes(qs.reshape(npan, P, nb, 32, 4)),
        _cols_last(sc),
        _cols_last(mn),
        _lanes(d.reshape(npan, P, nb, 1, 2)),
        _lanes(dmin.reshape(npan, P, nb, 1, 2)),
    ]


def _q6k_values(b: np.ndarray) -> np.ndarray:
    """Q6_K blocks ``[..., 210]`` -> unsigned 6-bit values ``[..., 256]`` (gguf-py's order)."""
    lead = b.shape[:-1]
    flat = b.reshape(-1, 210)
    ql, qh = flat[:, :128], flat[:, 128:192]
    lo = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    hi = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    return (lo.reshape(-1, 256) | (hi.reshape(-1, 256) << 4)).reshape(*lead, 256)


def _q6k_layout(q: np.ndarray, sc: np.ndarray, d: np.ndarray) -> list[np.ndarray]:
    """Q6_K's panel parts from unsigned 6-bit values ``q [np, P, nb, 256]``, int8 scales
    ``sc [np, P, nb, 16]`` (as bytes) and f16 ``d [np, P, nb, 2]`` (as bytes)."""
    npan, _, nb, _ = q.shape
    sub = q.reshape(npan, P, nb, 8, 2, 4, 4)  # [p][c][b][pair][half][t][e]
    ql = (sub[..., 0, :, :] & 0x0F) | ((sub[..., 1, :, :] & 0x0F) << 4)  # [p][c][b][pair][t][e]
    g = q.reshape(npan, P, nb, 4, 4, 4, 4) >> 4  # [p][c][b][group][u][t][e]
    qh = g[..., 0, :, :] | (g[..., 1, :, :] << 2) | (g[..., 2, :, :] << 4) | (g[..., 3, :, :] << 6)
    ql = np.moveaxis(ql.reshape(npan, P, nb, 32, 4), 1, 3)
    qh = np.moveaxis(qh.reshape(npan, P, nb, 16, 4), 1, 3)
    return [ql.astype(np.uint8), qh.astype(np.uint8), _cols_last(sc), _lanes(d.reshape(npan, P, nb, 1, 2))]


def _q6k(b: np.ndarray) -> list[np.ndarray]:
    npan, _, nb, _ = b.shape
    return _q6k_layout(_q6k_values(b).reshape(npan, P, nb, 256), b[..., 192:208], b[..., 208:210])


def _q3k(b: np.ndarray) -> list[np.ndarray]:
    """Q3_K as Q6_K panels (its kernel is Q6_K's): value v in -4..3 stored as v + 32 (Q6_K
    subtracts 32), 6-bit scale s stored as the int8 s - 32 (Q6_K's signed scale); d as is.
    The unpacking follows gguf-py's Q3_K.dequantize_blocks."""
    npan, _, nb, _ = b.shape
    hmask, qs, scales, d = b[..., 0:32], b[..., 32:96], b[..., 96:108], b[..., 108:110]
    lead = (npan, P, nb)
    lo = (scales[..., 0:8, None] >> np.array([0, 4], np.uint8)) & 0x0F  # [.., 8, 2]
    lo = np.moveaxis(lo, -1, -2).reshape(*lead, 16)  # scale j: byte j % 8, nibble j // 8
    hi = (scales[..., 8:12, None] >> np.array([0, 2, 4, 6], np.uint8)) & 0x03  # [.., 4, 4]
    hi = np.moveaxis(hi, -1, -2).reshape(*lead, 16)  # scale j: byte 8 + j % 4, bits 2 (j // 4)
    sc = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8).view(np.uint8)
    ql = (qs.reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 0x03  # [.., 2, 4, 32]
    qh = (hmask.reshape(*lead, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 0x01  # [.., 8, 32]
    v = ql.reshape(*lead, 256).astype(np.int16) - ((qh.reshape(*lead, 256) ^ 1).astype(np.int16) << 2)
    return _q6k_layout((v + 32).astype(np.uint8), sc, d)


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit scales and mins of Q4_K/Q5_K blocks' 12 scale bytes ``[np, P, nb, 12]``:
    gguf-py's own unpacking (``Q4_K.get_scale_min``), each ``[np, P, nb, 8]``."""
    from gguf.quants import Q4_K

    npan, _, nb, _ = b.shape
    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b).reshape(-1, 12))
    return sc.reshape(npan, P, nb, 8), mn.reshape(npan, P, nb, 8)


def _q5k(b: np.ndarray) -> list[np.ndarray]:
    """Q5_K: Q4_K's parts with GGUF's qh bytes (bit j of byte l: the fifth bit of value l of
    sub-block j) as a plane after the nibbles."""
    npan, _, nb, _ = b.shape
    d, dmin, scales, qh, qs = b[..., 0:2], b[..., 2:4], b[..., 4:16], b[..., 16:48], b[..., 48:176]
    sc, mn = _k_scales(scales)
    return [
        _lanes(qs.reshape(npan, P, nb, 32, 4)),
        _lanes(qh.reshape(npan, P, nb, 8, 4)),
        _cols_last(sc),
        _cols_last(mn),
        _lanes(d.reshape(npan, P, nb, 1, 2)),
        _lanes(dmin.reshape(npan, P, nb, 1, 2)),
    ]


def _q2k(b: np.ndarray) -> list[np.ndarray]:
    """Q2_K: GGUF's 2-bit bytes as they are, each scale byte split into its scale (low nibble)
    and min (high nibble)."""
    npan, _, nb, _ = b.shape
    scales, qs, d, dmin = b[..., 0:16], b[..., 16:80], b[..., 80:82], b[..., 82:84]
    return [
        _lanes(qs.reshape(npan, P, nb, 16, 4)),
        _cols_last(scales & 0x0F),
        _cols_last(scales >> 4),
        _lanes(d.reshape(npan, P, nb, 1, 2)),
        _lanes(dmin.reshape(npan, P, nb, 1, 2)),
    ]


def _iq4_nl(b: np.ndarray) -> list[np.ndarray]:
    """IQ4_NL as Q4_0 panels: the file's nibble bytes and d (the kernels look the nibbles up)."""
    return _q4_0(b)


def _iq4_xs(b: np.ndarray) -> list[np.ndarray]:
    """IQ4_XS: the file's nibble bytes (16 a sub-block of 32), the 6-bit scale of each 32 as
    the int8 ls - 32 (gguf-py's unpacking: 4 low bits from scales_l, 2 high from scales_h), d as is."""
    npan, _, nb, _ = b.shape
    d, sh, sl, qs = b[..., 0:2], b[..., 2:4], b[..., 4:8], b[..., 8:136]
    lo = ((sl[..., None] >> np.array([0, 4], np.uint8)) & 0x0F).reshape(npan, P, nb, 8)
    h16 = np.ascontiguousarray(sh).view(np.uint16)  # [.., 1]
    hi = ((h16 >> (2 * np.arange(8, dtype=np.uint16))) & 0x03).astype(np.uint8)
    sc = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8).view(np.uint8)
    return [_lanes(qs.reshape(npan, P, nb, 32, 4)), _cols_last(sc), _lanes(d.reshape(npan, P, nb, 1, 2))]


def _q8_0(b: np.ndarray) -> list[np.ndarray]:
    npan, _, nb, _ = b.shape
    return [_lanes(b[..., 2:34].reshape(npan, P, nb, 8, 4)), _lanes(b[..., 0:2].reshape(npan, P, nb, 1, 2))]


def _q5_0(b: np.ndarray) -> list[np.ndarray]:
    npan, _, nb, _ = b.shape
    qh = b[..., 2:6].copy().view(np.uint32)[..., 0]  # [p][c][b]
    bits = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    ql = b[..., 6:22]
    lo = np.concatenate([ql & 0x0F, ql >> 4], axis=-1)  # k = 0..15 low nibbles, 16..31 high
    q = ((lo | (bits << 4)).astype(np.int16) - 16).astype(np.int8).view(np.uint8)
    return [_lanes(q.reshape(npan, P, nb, 8, 4)), _lanes(b[..., 0:2].reshape(npan, P, nb, 1, 2))]


def _q5_1(b: np.ndarray) -> list[np.ndarray]:
    npan, _, nb, _ = b.shape
    qh = b[..., 4:8].copy().view(np.uint32)[..., 0]  # [p][c][b]
    bits = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    ql = b[..., 8:24]
    q = np.concatenate([ql & 0x0F, ql >> 4], axis=-1) | (bits << 4)  # 0..31: k = 0..15 low nibbles, 16..31 high
    return [
        _lanes(q.astype(np.uint8).reshape(npan, P, nb, 8, 4)),
        _lanes(b[..., 0:2].reshape(npan, P, nb, 1, 2)),
        _lanes(b[..., 2:4].reshape(npan, P, nb, 1, 2)),
    ]


def _q4_0(b: np.ndarray) -> list[np.ndarray]:
    npan, _, nb, _ = b.shape
    return [_lanes(b[..., 2:18].reshape(npan, P, nb, 4, 4)), _lanes(b[..., 0:2].reshape(npan, P, nb, 1, 2))]


def _q4_1(b: np.ndarray) -> list[np.ndarray]:
    npan, _, nb, _ = b.shape
    return [
        _lanes(b[..., 4:20].reshape(npan, P, nb, 4, 4)),
        _lanes(b[..., 0:2].reshape(npan, P, nb, 1, 2)),
        _lanes(b[..., 2:4].reshape(npan, P, nb, 1, 2)),
    ]


def _float(b: np.ndarray) -> list[np.ndarray]:
    """F32/F16/BF16: per k, the 16 columns' values as the file stores them."""
    return [np.moveaxis(b, 1, 2)]  # [np, P, k, bytes] -> [np, k, P, bytes]


@dataclass(frozen=True)
class BlockType:
    """One GGUF block type the kernels run: a row of the block-type table, the Python half of
    the C table in ``runtime/kernels/c/types.c`` (tests/test_kernels.py checks the two against
    each other through the library's ``sk_type_describe``).

    Attributes:
        ggml_type: ggml's type id; name: ggml's name.
        block: weights (k) per block; gguf_bytes: bytes of one block in a GGUF file;
        panel_bytes: bytes of one block of one panel of :data:`P` columns (the layouts: the
        module docstring).
        activation: the activations its kernels read: ``"q8_k"`` (per 256), ``"q8_0"`` (per 32)
            or ``"f32"`` (the float rows themselves: float weights).
        pack: ``[np, P, nb, gguf_bytes]`` GGUF bytes -> the parts of each panel block, in order.
    """

    ggml_type: int
    name: str
    block: int
    gguf_bytes: int
    panel_bytes: int
    activation: str
    pack: Callable[[np.ndarray], list[np.ndarray]]


# Adding a block type: a row here and one in types.c (the C table), its packer above, its
# dequantizer and panel kernels in C (docs/guide/kernels.md, "Adding a block type").
TABLE: tuple[BlockType, ...] = (
    BlockType(0, "F32", 1, 4, 64, "f32", _float),
    BlockType(1, "F16", 1, 2, 32, "f32", _float),
    BlockType(2, "Q4_0", 32, 18, 288, "q8_0", _q4_0),
    BlockType(3, "Q4_1", 32, 20, 320, "q8_0", _q4_1),
    BlockType(6, "Q5_0", 32, 22, 544, "q8_0", _q5_0),
    BlockType(7, "Q5_1", 32, 24, 576, "q8_0", _q5_1),
    BlockType(8, "Q8_0", 32, 34, 544, "q8_0", _q8_0),
    BlockType(10, "Q2_K", 256, 84, 1600, "q8_k", _q2k),
    BlockType(11, "Q3_K", 256, 110, 3360, "q8_k", _q3k),
    BlockType(12, "Q4_K", 256, 144, 2368, "q8_k", _q4k),
    BlockType(13, "Q5_K", 256, 176, 2880, "q8_k", _q5k),
    BlockType(14, "Q6_K", 256, 210, 3360, "q8_k", _q6k),
    BlockType(20, "IQ4_NL", 32, 18, 288, "q8_0", _iq4_nl),
    BlockType(23, "IQ4_XS", 256, 136, 2208, "q8_k", _iq4_xs),
    BlockType(30, "BF16", 1, 2, 32, "f32", _float),
)
_BY_ID = {t.ggml_type: t for t in TABLE}
# views of the table by ggml type id
TYPES = {t.ggml_type: t.name for t in TABLE}
BLOCK = {t.ggml_type: t.block for t in TABLE}  # K per block
GGUF_BLOCK_BYTES = {t.ggml_type: t.gguf_bytes for t in TABLE}
PANEL_BLOCK_BYTES = {t.ggml_type: t.panel_bytes for t in TABLE}  # per panel (16 columns) and block


def pack(raw: np.ndarray, ggml_type: int, n: int, k: int) -> np.ndarray:
    """The panel form of one GGUF tensor.

    Args:
        raw: the tensor's bytes as the file holds them (``n`` rows of ``k / block`` blocks),
            e.g. ``gguf.GGUFReader(...).tensors[i].data`` viewed as uint8.
        ggml_type: its ggml type id (a key of :data:`TYPES`); n: rows (output columns);
            k: inputs per row.

    Returns:
        uint8 ``[panel_bytes(ggml_type, n, k)]``: panel-major, K blocks contiguous in a panel.

    Raises:
        ValueError: a type or shape :func:`supported` refuses, or a byte count that does not
            match ``[n, k]``.
    """
    why = supported(ggml_type, n, k)
    if why:
        raise ValueError(why)
    blocks = _blocks(raw, ggml_type, n, k)
    nb = k // BLOCK[ggml_type]
    out = np.empty((n // P, nb, PANEL_BLOCK_BYTES[ggml_type]), dtype=np.uint8)
    # panel-major: a run of whole panels packs alone, so a big tensor goes a few MB of rows at
    # a time (the packers' integer temporaries of a whole 151,936-row head took 1 GB)
    step = max(1, (1 << 22) // (k * P))  # panels at a time
    for p0 in range(0, n // P, step):
        parts = _BY_ID[ggml_type].pack(blocks[p0 : p0 + step])
        npan = len(blocks[p0 : p0 + step])
        # each part [np, nb, ...]: per (panel, block) its bytes, then the parts one after the other
        chunk = np.concatenate([np.ascontiguousarray(x).reshape(npan, nb, -1) for x in parts], axis=-1)
        assert chunk.shape[-1] == PANEL_BLOCK_BYTES[ggml_type], (TYPES[ggml_type], chunk.shape)
        out[p0 : p0 + npan] = chunk
    return out.reshape(-1)
