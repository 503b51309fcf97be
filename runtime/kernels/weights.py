"""A panels file (written at export, :mod:`specrt.export.kernel_pack`) as the kernels' model.

:class:`KernelWeights` maps the file read-only (the page cache holds one copy however many
models fork from it), builds the C structs that point into it, the RoPE tables for
``max_ctx`` positions, and one scratch for steps of up to ``max_q`` rows. Steps over these
weights are serialized by :attr:`KernelWeights.lock` (they share the scratch; the thread
team runs one step at a time anyway).
"""

from __future__ import annotations

import ctypes
import math
import threading
from pathlib import Path

import numpy as np

from . import SkLayer, SkMat, SkModel, library, status

__all__ = ["KernelWeights", "rope_tables", "LAYER_KEYS"]

LAYER_KEYS = {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output", "wgate": "ffn_gate", "wup": "ffn_up", "wdown": "ffn_down"}


def rope_tables(max_ctx: int, head_dim: int, theta: float, freq_factors: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of ``pos * theta ** (-2i / head_dim) / factor_i`` as float32 ``[max_ctx,
    head_dim / 2]``, computed in float64 (RoFormer, Su et al. 2021, eq. 34; the factors are
    Llama 3's ``rope_freqs``)."""
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if freq_factors is not None:
        inv = inv / np.asarray(freq_factors, dtype=np.float64)
    ang = np.arange(max_ctx, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


class KernelWeights:
    """One panels file mapped for the kernels, with its C model struct.

    Args:
        path: the ``<role>.panels`` file; record: its manifest record (``extra.kernels[role]``).
        max_ctx: KV rows of the models over these weights (rounded up to 16 for the K tiles).
        max_q: the widest step.

    Attributes:
        dims: the record's dims; n_vocab: logits width (the vocabulary); head_ids: int32 ids
        of a trimmed LM head (None: every id has a row); ctx16: ``max_ctx`` rounded up to 16;
        model: the ``sk_model`` struct; scratch: the C scratch; lock: serializes steps.

    Raises:
        RuntimeError: the library cannot run here (:func:`specrt.runtime.kernels.status`) or
            the file does not hold what the record says.
    """

    def __init__(self, path: Path, record: dict, max_ctx: int, max_q: int):
        lib = library()
        if lib is None:
            raise RuntimeError(status())
        self.lib, self.path, self.record = lib, Path(path), record
        d = self.dims = dict(record["dims"])
        t = record["tensors"]
        size = self.path.stat().st_size
        end = max(v["offset"] + v["bytes"] for v in t.values())
        if end > size:
            raise RuntimeError(f"{self.path} holds {size} bytes; its record needs {end}: re-export the engine")
        self.map = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.n_vocab = int(d["n_vocab"])  # logits a row as the Model gives them (the embedding's ids)
        # a trimmed head (a draft's, FR-Spec): the C step writes logits of these ids only
        self.head_ids = np.frombuffer(self.map, dtype=np.int32, count=int(t["head_ids"]["n"]), offset=int(t["head_ids"]["offset"])) if "head_ids" in t else None
        self.ctx16 = (max_ctx + 15) // 16 * 16
        self.max_ctx, self.max_q = max_ctx, max_q
        hd = int(d["head_dim"])
        factors = self._f32(t["rope_freqs"]) if "rope_freqs" in t else None
        self.cos, self.sin = rope_tables(self.ctx16, hd, float(d["rope_theta"]), factors)
        self.layers = (SkLayer * int(d["n_layer"]))()
        for i in range(int(d["n_layer"])):
            L = self.layers[i]
            for field, key in LAYER_KEYS.items():
                setattr(L, field, self._mat(t[f"blk.{i}.{key}"]))
            L.attn_norm = self._ptr(t[f"blk.{i}.attn_norm"])
            L.ffn_norm = self._ptr(t[f"blk.{i}.ffn_norm"])
            for field, key in (("bq", "attn_q.bias"), ("bk", "attn_k.bias"), ("bv", "attn_v.bias")):
                setattr(L, field, self._ptr(t[f"blk.{i}.{key}"]) if f"blk.{i}.{key}" in t else None)
        m = self.model = SkModel()
        for k in ("n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_ff"):
            setattr(m, k, int(d[k]))
        m.n_vocab, m.max_ctx, m.max_q = self.n_vocab, self.ctx16, max_q
        m.rope_neox = int(bool(record["rope_neox"]))
        m.norm_eps = float(d["norm_eps"])
        m.attn_scale = float(np.float32(1.0 / math.sqrt(hd)))
        m.rope_cos, m.rope_sin = self.cos.ctypes.data, self.sin.ctypes.data
        m.out_norm = self._ptr(t["output_norm"])
        m.tok_embd, m.output = self._mat(t["token_embd"]), self._mat(t["output"])
        m.layers = ctypes.cast(self.layers, ctypes.POINTER(SkLayer))
        qd, kd = int(d["n_head"]) * hd, int(d["n_head_kv"]) * hd
        self.scratch = lib.sk_scratch_new(max_q, int(d["n_embd"]), qd, kd, int(d["n_ff"]), self.ctx16)
        if not self.scratch:
            raise RuntimeError(f"kernels: out of memory for the scratch of {max_q}-row steps")
        self.lock = threading.Lock()

    def _ptr(self, rec: dict) -> int:
        return self.map.ctypes.data + int(rec["offset"])

    def _f32(self, rec: dict) -> np.ndarray:
        return np.frombuffer(self.map, dtype=np.float32, count=int(rec["n"]), offset=int(rec["offset"]))

    def _mat(self, rec: dict) -> SkMat:
        return SkMat(int(rec["type"]), int(rec["n"]), int(rec["k"]), 0, self._ptr(rec))

    def last_attention(self, q: int) -> np.ndarray:
        """float32 ``[q, n_head * head_dim]``: the attention output of the last layer in the
        last step over these weights (before its quantization), for tests of the exactness
        contract (an attention whose sums depended on the call would show here first)."""
        cols = int(self.dims["n_head"]) * int(self.dims["head_dim"])
        out = np.empty((q, cols), np.float32)
        rc = self.lib.sk_scratch_attention(ctypes.c_void_p(self.scratch), q, cols, out.ctypes.data_as(ctypes.c_void_p))
        if rc != 0:
            raise RuntimeError(f"kernels: no attention rows for q={q}")
        return out

    @property
    def kv_elems(self) -> int:
        """f16 elements of one K (or V) cache for ``max_ctx`` rows."""
        d = self.dims
        return int(d["n_layer"]) * self.ctx16 * int(d["n_head_kv"]) * int(d["head_dim"])

    def close(self) -> None:
        """Free the scratch; the mapping goes with the last reference."""
        if getattr(self, "scratch", None):
            self.lib.sk_scratch_free(self.scratch)
            self.scratch = None
