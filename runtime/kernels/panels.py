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
Q6_K    3360     ql[8 p][4 t][16 c][4 e] = lo4 q(32p+4t+e) | lo4 q(32p+16+4t+e) << 4;
                 qh[4 g][4 t][16 c][4 e] = sum_u hi2 q(16(4g+u)+4t+e) << 2u;
                 sc[16][16] i8; d[16] f16
Q8_0    544      qs[8 t][16 c][4 e] = q(4t+e) (int8); d[16] f16
Q5_0    544      as Q8_0 with q - 16 (int8, -16..15)
Q5_1    576      qs[8 t][16 c][4 e] = q(4t+e) (uint8, 0..31); d[16] f16; m[16] f16
Q4_0    288      qs[4 t][16 c][4 e] = q(4t+e) | q(16+4t+e) << 4 (GGUF's bytes); d[16] f16
Q4_1    320      as Q4_0; d[16] f16; m[16] f16
======= ======== ==================================================================

Q4_K and Q4_0/Q4_1 hold exactly the GGUF's bytes per column (Q4_K adds 4 bytes a block: its
6-bit scales unpacked); Q6_K and Q8_0 are the same size as the GGUF; Q5_0 grows from 22 to
34 bytes a block (5-bit values unpacked to bytes: its kernel is Q8_0's), Q5_1 from 24 to 36.
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
    from gguf.quants import Q4_K

    npan, _, nb, _ = b.shape
    d, dmin, scales, qs = b[..., 0:2], b[..., 2:4], b[..., 4:16], b[..., 16:144]
    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(scales).reshape(-1, 12))
    sc, mn = sc.reshape(npan, P, nb, 8), mn.reshape(npan, P, nb, 8)
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


def _q6k(b: np.ndarray) -> list[np.ndarray]:
    npan, _, nb, _ = b.shape
    q = _q6k_values(b).reshape(npan, P, nb, 256)
    sub = q.reshape(npan, P, nb, 8, 2, 4, 4)  # [p][c][b][pair][half][t][e]
    ql = (sub[..., 0, :, :] & 0x0F) | ((sub[..., 1, :, :] & 0x0F) << 4)  # [p][c][b][pair][t][e]
    g = q.reshape(npan, P, nb, 4, 4, 4, 4) >> 4  # [p][c][b][group][u][t][e]
    qh = g[..., 0, :, :] | (g[..., 1, :, :] << 2) | (g[..., 2, :, :] << 4) | (g[..., 3, :, :] << 6)
    ql = np.moveaxis(ql.reshape(npan, P, nb, 32, 4), 1, 3)
    qh = np.moveaxis(qh.reshape(npan, P, nb, 16, 4), 1, 3)
    sc = b[..., 192:208]
    d = b[..., 208:210]
    return [ql.astype(np.uint8), qh.astype(np.uint8), _cols_last(sc), _lanes(d.reshape(npan, P, nb, 1, 2))]


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
        activation: the activations its kernels read: ``"q8_k"`` (per 256) or ``"q8_0"`` (per 32).
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
    BlockType(2, "Q4_0", 32, 18, 288, "q8_0", _q4_0),
    BlockType(3, "Q4_1", 32, 20, 320, "q8_0", _q4_1),
    BlockType(6, "Q5_0", 32, 22, 544, "q8_0", _q5_0),
    BlockType(7, "Q5_1", 32, 24, 576, "q8_0", _q5_1),
    BlockType(8, "Q8_0", 32, 34, 544, "q8_0", _q8_0),
    BlockType(12, "Q4_K", 256, 144, 2368, "q8_k", _q4k),
    BlockType(14, "Q6_K", 256, 210, 3360, "q8_k", _q6k),
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
    parts = _BY_ID[ggml_type].pack(_blocks(raw, ggml_type, n, k))
    npan, nb = n // P, k // BLOCK[ggml_type]
    # each part [np, nb, ...]: per (panel, block) its bytes, then the parts one after the other
    out = np.concatenate([np.ascontiguousarray(x).reshape(npan, nb, -1) for x in parts], axis=-1)
    assert out.shape[-1] == PANEL_BLOCK_BYTES[ggml_type], (TYPES[ggml_type], out.shape)
    return out.reshape(-1)
