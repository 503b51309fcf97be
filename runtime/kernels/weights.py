"""A panels file (written at export, :mod:`specrt.export.kernel_pack`) as the kernels' model.

:class:`KernelWeights` opens the file once, checks that the file it opened is the one that was
verified (its identity, else the SHA-256 of the bytes it maps), maps that descriptor read-only
(the page cache holds one copy however many models fork from it), checks every record against
its block type and the model's dims (:func:`check_record`) before C sees it, and builds the C
structs that point into the mapping, the RoPE tables for ``max_ctx`` positions, and one
scratch for steps of up to ``max_q`` rows. Steps over these weights are serialized by
:attr:`KernelWeights.lock` (they share the scratch; the thread team runs one step at a time
anyway). The scratch is freed with the weights (or at :meth:`KernelWeights.close`).

An engine folder's files are replaced by renaming a new file over the old name (the export
writes every file that way), so a process that mapped the old file keeps its inode and its
bytes: re-exporting into a folder a server runs from changes nothing in that server.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import mmap
import os
import threading
import weakref
from pathlib import Path

import numpy as np

from . import SkLayer, SkMat, SkModel, library, status
from .panels import BLOCK, TYPES, panel_bytes, supported

__all__ = [
    "KernelWeights",
    "rope_tables",
    "arch_params",
    "check_record",
    "LAYER_KEYS",
    "QK_NORM_ARCHS",
    "QK_NORMS",
    "POST_NORM_ARCHS",
    "POST_NORMS",
    "RecordError",
]

LAYER_KEYS = {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output", "wgate": "ffn_gate", "wup": "ffn_up", "wdown": "ffn_down"}
# architectures whose layers RMS-normalize each head of q and k before RoPE (llama.cpp's
# attn_q_norm / attn_k_norm, [head_dim] each): every layer of theirs must have both
QK_NORM_ARCHS = ("qwen3", "gemma3")
QK_NORMS = ("attn_q_norm", "attn_k_norm")
# architectures that RMS-normalize each block's attention and FFN output before its residual add
# (llama.cpp's attn_post_norm / ffn_post_norm, [n_embd] each): every layer of theirs has both
POST_NORM_ARCHS = ("gemma2", "gemma3")
POST_NORMS = ("post_attention_norm", "post_ffw_norm")
FFN_ACTS = ("silu", "gelu")  # the C's SK_FFN_SILU, SK_FFN_GELU
_F32, _I32 = 0, 26  # ggml type ids of the 1-D tensors (norms, biases, rope_freqs) and the head's ids
_MAX_LAYERS = 512  # the C's SK_MAX_LAYERS
_DIMS = ("n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_ff", "n_vocab")


class RecordError(RuntimeError):
    """A kernels record (or its panels file) that does not describe what the kernels can run."""


def rope_tables(max_ctx: int, head_dim: int, theta: float, freq_factors: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of ``pos * theta ** (-2i / head_dim) / factor_i`` as float32 ``[max_ctx,
    head_dim / 2]``, computed in float64 (RoFormer, Su et al. 2021, eq. 34; the factors are
    Llama 3's ``rope_freqs``)."""
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if freq_factors is not None:
        inv = inv / np.asarray(freq_factors, dtype=np.float64)
    ang = np.arange(max_ctx, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def _int(x) -> int | None:
    return int(x) if isinstance(x, (int, np.integer)) and not isinstance(x, bool) else None


def check_record(record: dict, size: int) -> str | None:
    """Why a kernels record cannot run over a panels file of ``size`` bytes, or None.

    Every tensor the step reads must be present, inside the file, 4-byte aligned and of the
    bytes its type and shape take (:func:`~.panels.panel_bytes`); every matrix's shape must be
    the one the dims give it (``attn_q [n_head * head_dim, n_embd]``, ...), every 1-D tensor
    float32 of its dims' length, a trimmed head's ids int32 of the head's rows. Checked before
    C sees any pointer: a record with a wrong shape would make C read other tensors' bytes.

    Returns:
        One line naming the first bad field, or None.
    """
    try:
        d, t = record["dims"], record["tensors"]
        dims = {k: _int(d[k]) for k in _DIMS}
    except (KeyError, TypeError) as e:
        return f"the record has no {e} (dims and tensors)"
    bad = [k for k, v in dims.items() if v is None or v < 1]
    if bad:
        return f"dims {', '.join(bad)} must be positive integers"
    L, E, nh, nkv, hd, F, V = (dims[k] for k in _DIMS)
    if L > _MAX_LAYERS or hd % 16 or hd > 256 or nh % nkv:
        return f"dims: {L} layers (at most {_MAX_LAYERS}), head_dim {hd} (a multiple of 16 up to 256), {nh} heads over {nkv} KV heads"
    if not isinstance(t, dict):
        return "tensors is not a map"
    why = _check_arch_dims(d, L)
    if why:
        return why
    head = t.get("head_ids")
    rows = _int(head.get("n")) if isinstance(head, dict) else V
    want: dict[str, tuple] = {"token_embd": ("m", V, E), "output": ("m", rows, E), "output_norm": ("v", E)}
    for i in range(L):
        want |= {
            f"blk.{i}.attn_q": ("m", nh * hd, E),
            f"blk.{i}.attn_k": ("m", nkv * hd, E),
            f"blk.{i}.attn_v": ("m", nkv * hd, E),
            f"blk.{i}.attn_output": ("m", E, nh * hd),
            f"blk.{i}.ffn_gate": ("m", F, E),
            f"blk.{i}.ffn_up": ("m", F, E),
            f"blk.{i}.ffn_down": ("m", E, F),
            f"blk.{i}.attn_norm": ("v", E),
            f"blk.{i}.ffn_norm": ("v", E),
        }
        for b, n in (("attn_q.bias", nh * hd), ("attn_k.bias", nkv * hd), ("attn_v.bias", nkv * hd), ("attn_q_norm", hd), ("attn_k_norm", hd)):
            if f"blk.{i}.{b}" in t or (b in QK_NORMS and d.get("arch") in QK_NORM_ARCHS):
                want[f"blk.{i}.{b}"] = ("v", n)
        for b in POST_NORMS:
            if f"blk.{i}.{b}" in t or d.get("arch") in POST_NORM_ARCHS:
                want[f"blk.{i}.{b}"] = ("v", E)
    if "rope_freqs" in t:
        want["rope_freqs"] = ("v", hd // 2)
    if head is not None:
        want["head_ids"] = ("i", rows)
    for key, spec in want.items():
        r = t.get(key)
        if not isinstance(r, dict):
            return f"tensor {key} is missing"
        ty, n, k, off, nbytes = (_int(r.get(f)) for f in ("type", "n", "k", "offset", "bytes"))
        if None in (ty, n, k, off, nbytes) or min(n, k, off, nbytes) < 0:
            return f"tensor {key}: type, n, k, offset and bytes must be non-negative integers"
        if off % 4 or off + nbytes > size:
            return f"tensor {key}: bytes [{off}, {off + nbytes}) are not 4-byte aligned inside the file's {size}"
        if spec[0] == "m":
            if ty not in TYPES:
                return f"tensor {key}: type {ty} is not one the kernels run ({', '.join(TYPES.values())})"
            why = supported(ty, n, k)
            if why:
                return f"tensor {key}: {why}"
            if (n, k) != spec[1:]:
                return f"tensor {key} is [{n}, {k}]; the dims make it [{spec[1]}, {spec[2]}]"
            if nbytes != panel_bytes(ty, n, k):
                return f"tensor {key}: {nbytes} bytes; a [{n}, {k}] {TYPES[ty]} matrix takes {panel_bytes(ty, n, k)} (blocks of {BLOCK[ty]})"
        else:
            want_ty = _I32 if spec[0] == "i" else _F32
            if ty != want_ty or k != 1 or n != spec[1] or nbytes != 4 * n:
                return f"tensor {key}: type {ty}, [{n}, {k}], {nbytes} bytes; need type {want_ty}, [{spec[1]}, 1], {4 * spec[1]} bytes"
    return None


def _check_arch_dims(d: dict, n_layer: int) -> str | None:
    """Why the record's optional per-architecture dims (:func:`arch_params`) are unusable, or None."""
    if d.get("ffn_act", "silu") not in FFN_ACTS:
        return f"dims ffn_act {d.get('ffn_act')!r} must be one of {', '.join(FFN_ACTS)}"
    for k in ("emb_scale", "attn_scale", "attn_softcap", "final_softcap", "rope_scale", "rope_scale_swa", "rope_theta_swa"):
        v = d.get(k, 1.0)
        positive = k.startswith("rope")  # a divisor or a base: 0 would make NaN tables
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (positive and v == 0):
            return f"dims {k} must be a finite number {'> 0' if positive else '>= 0'}, not {v!r}"
    swa = d.get("swa", [0] * n_layer)
    if not isinstance(swa, list) or len(swa) != n_layer or any(_int(w) is None or w < 0 for w in swa):
        return f"dims swa must be {n_layer} sliding windows (integers >= 0; 0: none), one a layer"
    return None


def arch_params(dims: dict) -> dict:
    """The per-architecture numbers of a record's dims, with the defaults of a record that has
    none (llama, qwen2, qwen3, phi3): ``ffn_act`` (``silu`` SwiGLU, ``gelu`` GeGLU),
    ``emb_scale`` (0: none), ``attn_scale`` (``1 / sqrt(head_dim)``), ``attn_softcap`` and
    ``final_softcap`` (0: none), ``swa`` (a sliding window a layer, positions; 0: none),
    RoPE ``rope_scale`` (linear: positions / scale) and, for the sliding layers,
    ``rope_theta_swa`` and ``rope_scale_swa``."""
    n, hd = int(dims["n_layer"]), int(dims["head_dim"])
    out = dict(ffn_act="silu", emb_scale=0.0, attn_scale=1.0 / math.sqrt(hd), attn_softcap=0.0, final_softcap=0.0, swa=[0] * n, rope_scale=1.0)
    out |= {k: dims[k] for k in out if k in dims}
    out["rope_theta_swa"] = float(dims.get("rope_theta_swa", dims["rope_theta"]))
    out["rope_scale_swa"] = float(dims.get("rope_scale_swa", out["rope_scale"]))
    return out


_LIVE: "weakref.WeakSet[KernelWeights]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked child has only the forking thread: a step lock another thread held at the fork
    would never be released there, so every live weights object gets a new one (the C team is
    reset by the library's own fork handler; no C step is in flight across a fork)."""
    for w in list(_LIVE):
        w.lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class KernelWeights:
    """One panels file mapped for the kernels, with its C model struct.

    Args:
        path: the ``<role>.panels`` file; record: its manifest record (``extra.kernels[role]``).
        max_ctx: KV rows of the models over these weights (rounded up to 16 for the K tiles).
        max_q: the widest step.
        verified: what the load verified of this file: ``(identity, sha256)`` where identity is
            :func:`~specrt.runtime.integrity.file_identity` of the file it hashed (or None) and
            sha256 the manifest's digest. The file opened here must have that identity, or the
            bytes it maps must have that digest. None: no check (a file written just now).

    Attributes:
        dims: the record's dims; n_vocab: logits width (the vocabulary); head_ids: int32 ids
        of a trimmed LM head (None: every id has a row); ctx16: ``max_ctx`` rounded up to 16;
        model: the ``sk_model`` struct; scratch: the C scratch (None once closed); lock:
        serializes steps.

    Raises:
        RuntimeError: the library cannot run here (:func:`specrt.runtime.kernels.status`).
        RecordError: the file is not the one verified, or does not hold what the record says
            (:func:`check_record`), or a trimmed head's ids are not ascending ids of the vocabulary.
    """

    def __init__(self, path: Path, record: dict, max_ctx: int, max_q: int, verified: tuple | None = None):
        lib = library()
        if lib is None:
            raise RuntimeError(status())
        self.lib, self.path, self.record = lib, Path(path), record
        self.scratch = None
        self.map = self._map(verified)
        why = check_record(record, self.map.size)
        if why:
            raise RecordError(f"{self.path}: {why}; re-export the engine")
        d = self.dims = dict(record["dims"])
        t = record["tensors"]
        self.n_vocab = int(d["n_vocab"])  # logits a row as the Model gives them (the embedding's ids)
        # a trimmed head (a draft's, FR-Spec): the C step writes logits of these ids only
        self.head_ids = None
        if "head_ids" in t:
            h = np.frombuffer(self.map, dtype=np.int32, count=int(t["head_ids"]["n"]), offset=int(t["head_ids"]["offset"]))
            if h.size and (int(h[0]) < 0 or int(h[-1]) >= self.n_vocab or (np.diff(h) <= 0).any()):
                raise RecordError(f"{self.path}: the head's ids must be ascending, each once, in 0..{self.n_vocab - 1}; re-export the engine")
            self.head_ids = h
        self.ctx16 = (max_ctx + 15) // 16 * 16
        self.max_ctx, self.max_q = max_ctx, max_q
        hd = int(d["head_dim"])
        ap = arch_params(d)
        freqs = self._f32(t["rope_freqs"]) if "rope_freqs" in t else np.ones(hd // 2)
        self.cos, self.sin = rope_tables(self.ctx16, hd, float(d["rope_theta"]), freqs * ap["rope_scale"])
        swa_rope = (ap["rope_theta_swa"], ap["rope_scale_swa"]) != (float(d["rope_theta"]), ap["rope_scale"])
        # gemma3's sliding layers rotate with another base (and no scaling): their own tables
        self.cos_swa, self.sin_swa = rope_tables(self.ctx16, hd, ap["rope_theta_swa"], freqs * ap["rope_scale_swa"]) if swa_rope else (None, None)
        self.layers = (SkLayer * int(d["n_layer"]))()
        for i in range(int(d["n_layer"])):
            L = self.layers[i]
            for field, key in LAYER_KEYS.items():
                setattr(L, field, self._mat(t[f"blk.{i}.{key}"]))
            L.attn_norm = self._ptr(t[f"blk.{i}.attn_norm"])
            L.ffn_norm = self._ptr(t[f"blk.{i}.ffn_norm"])
            for field, key in (("bq", "attn_q.bias"), ("bk", "attn_k.bias"), ("bv", "attn_v.bias"), ("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm")):
                setattr(L, field, self._ptr(t[f"blk.{i}.{key}"]) if f"blk.{i}.{key}" in t else None)
            for field, key in (("post_attn_norm", "post_attention_norm"), ("post_ffn_norm", "post_ffw_norm")):
                setattr(L, field, self._ptr(t[f"blk.{i}.{key}"]) if f"blk.{i}.{key}" in t else None)
            L.swa = int(ap["swa"][i])
            if L.swa and self.cos_swa is not None:
                L.rope_cos, L.rope_sin = self.cos_swa.ctypes.data, self.sin_swa.ctypes.data
        m = self.model = SkModel()
        for k in ("n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_ff"):
            setattr(m, k, int(d[k]))
        m.n_vocab, m.max_ctx, m.max_q = self.n_vocab, self.ctx16, max_q
        m.rope_neox = int(bool(record["rope_neox"]))
        m.norm_eps = float(d["norm_eps"])
        m.attn_scale = float(np.float32(ap["attn_scale"]))
        m.ffn_act = FFN_ACTS.index(ap["ffn_act"])
        m.emb_scale, m.attn_softcap, m.final_softcap = (float(np.float32(ap[k])) for k in ("emb_scale", "attn_softcap", "final_softcap"))
        m.rope_cos, m.rope_sin = self.cos.ctypes.data, self.sin.ctypes.data
        m.out_norm = self._ptr(t["output_norm"])
        m.tok_embd, m.output = self._mat(t["token_embd"]), self._mat(t["output"])
        m.layers = ctypes.cast(self.layers, ctypes.POINTER(SkLayer))
        qd, kd = int(d["n_head"]) * hd, int(d["n_head_kv"]) * hd
        scratch = lib.sk_scratch_new(max_q, int(d["n_embd"]), qd, kd, int(d["n_ff"]), self.ctx16)
        if not scratch:
            raise RuntimeError(f"kernels: out of memory for the scratch of {max_q}-row steps")
        self.scratch = scratch
        # freed with the weights (every model over them holds a reference), or by close()
        self._free = weakref.finalize(self, lib.sk_scratch_free, ctypes.c_void_p(scratch))
        self.lock = threading.Lock()
        _LIVE.add(self)

    def _map(self, verified: tuple | None) -> np.ndarray:
        """Open the file once, check it is the one verified, and map that descriptor (uint8)."""
        from ..integrity import file_identity

        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise RecordError(f"{self.path} cannot be opened ({e.strerror or e}); re-export the engine") from None
        try:
            st = os.fstat(fd)
            if st.st_size == 0:
                raise RecordError(f"{self.path} is empty; re-export the engine")
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)  # the mapping keeps the file (this inode) open
        if verified is not None:
            ident, digest = verified
            # another file at this name since it was verified (renamed over it, or rewritten):
            # the bytes mapped here must have the digest, or nothing runs over them
            if (ident is None or file_identity(st) != tuple(ident)) and hashlib.sha256(mm).hexdigest() != digest:
                mm.close()
                raise RecordError(f"{self.path} changed after it was verified (it does not match the SHA-256 recorded in the manifest); reload the engine")
        return np.frombuffer(mm, dtype=np.uint8)

    def _ptr(self, rec: dict) -> int:
        return self.map.ctypes.data + int(rec["offset"])

    def _f32(self, rec: dict) -> np.ndarray:
        return np.frombuffer(self.map, dtype=np.float32, count=int(rec["n"]), offset=int(rec["offset"]))

    def _mat(self, rec: dict) -> SkMat:
        return SkMat(int(rec["type"]), int(rec["n"]), int(rec["k"]), 0, self._ptr(rec))

    def last_attention(self, q: int) -> np.ndarray:
        """float32 ``[q, n_head * head_dim]``: the attention output of the last layer in the
        last step over these weights (before its quantization), for tests of the exactness
        contract (an attention whose sums depended on the call would show here first).

        Raises:
            RuntimeError: q outside 1..max_q, or the weights are closed.
        """
        cols = int(self.dims["n_head"]) * int(self.dims["head_dim"])
        out = np.empty((q, cols), np.float32)
        rc = self.lib.sk_scratch_attention(ctypes.c_void_p(self.scratch), q, cols, out.ctypes.data_as(ctypes.c_void_p)) if self.scratch else -2
        if rc != 0:
            raise RuntimeError(f"kernels: no attention rows for q={q} (1..{self.max_q}, weights open)")
        return out

    @property
    def kv_elems(self) -> int:
        """f16 elements of one K (or V) cache for ``max_ctx`` rows."""
        d = self.dims
        return int(d["n_layer"]) * self.ctx16 * int(d["n_head_kv"]) * int(d["head_dim"])

    @property
    def closed(self) -> bool:
        """True once :meth:`close` freed the scratch (every step over these weights then refuses)."""
        return self.scratch is None

    def close(self) -> None:
        """Free the scratch now (models over these weights refuse every call after); the
        mapping goes with the last reference. Idempotent."""
        with self.lock:
            if self.scratch is not None:
                self.scratch = None
                self._free()
