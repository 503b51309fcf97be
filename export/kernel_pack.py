"""Panels for specrt's kernels, written at export from a GGUF file's own blocks.

``specrt export --precision int4|int8`` with a GGUF target (or draft; a checkpoint folder is
first written as a GGUF file by :mod:`specrt.export.checkpoint_gguf`) writes ``<role>.panels`` beside the ONNX
graphs and a record in the manifest's ``extra["kernels"][role]``: the decoder's dims and the
place of every tensor in the file. The weights are the file's integers and fp16 scales in
the kernels' panel layout (:mod:`specrt.runtime.kernels.panels`); every tensor is checked at
write time: its panels, dequantized by the kernels' own C code, equal ``gguf.dequantize`` of
the same bytes bit for bit, or the export stops.

The decoder families the kernels run are llama.cpp's ``llama`` (also Mistral's GGUFs),
``qwen2``, ``qwen3``, ``phi3``, ``gemma2`` and ``gemma3``: RMSNorm, RoPE (llama.cpp's rope type
of the architecture: NORM for llama, NEOX for the others; Llama 3's ``rope_freqs``; linear
scaling), grouped-query attention with optional q/k/v biases (qwen3, gemma3: per-head q/k
norms), SwiGLU (gemma: GeGLU, the embedding scale, post-attention and post-FFN norms,
soft-capping, sliding-window layers with their own RoPE base: :func:`_gemma_dims`). phi3's fused projections
(``attn_qkv``, and ``ffn_up`` holding gate and up) are split by rows at pack time into the
panels the other families have; like llama.cpp, its sliding window is not applied.
Anything else (another architecture, rope scaling other than linear and rope_freqs, a block
type the kernels do not run) writes no record, with the reason, and the runtime keeps the ONNX graph.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np

from specrt.runtime.kernels.weights import POST_NORM_ARCHS, POST_NORMS, QK_NORM_ARCHS, QK_NORMS

__all__ = [
    "KERNEL_RECORD_VERSION",
    "ROPE_NEOX_ARCHS",
    "DRAFT_REQUANT",
    "DRAFT_HEAD",
    "plan_tensors",
    "write_panels",
    "kernels_unsupported",
    "panels_record",
    "draft_panels",
    "ranked_ids",
    "add_to_engine",
]

KERNEL_RECORD_VERSION = 1
# llama.cpp's rope type of each architecture (llama_model_rope_type)
ROPE_NEOX_ARCHS = {"qwen2": True, "qwen3": True, "phi3": True, "llama": False, "gemma2": True, "gemma3": True}
# llama.cpp's default sliding-window pattern of an architecture (set_swa_pattern: layer i slides
# unless i % n == n - 1), where the file has no attention.sliding_window_pattern
SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
# fused projections of an architecture: GGUF tensor -> the kernels' tensors its rows hold, in order
FUSED = {"phi3": {"attn_qkv": ("attn_q", "attn_k", "attn_v"), "ffn_up": ("ffn_gate", "ffn_up")}}
ALIGN = 4096  # every tensor starts on a page
DRAFT_REQUANT = 2  # Q4_0: the draft's weight matrices on the kernels (4.5 bits a weight, any K divisible by 32)
DRAFT_HEAD = 65536  # ids kept in the draft's LM head (FR-Spec); 0 keeps them all


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _dims(reader) -> dict:
    """The decoder's dims from the GGUF metadata (llama.cpp's keys)."""
    arch = _field(reader, "general.architecture")
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    n_head = int(g("attention.head_count"))
    n_embd = int(g("embedding_length"))
    head_dim = int(g("attention.key_length", n_embd // n_head))
    d = dict(
        arch=arch,
        n_layer=int(g("block_count")),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=int(g("attention.head_count_kv", n_head)),
        head_dim=head_dim,
        n_ff=int(g("feed_forward_length")),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rope_dims=int(g("rope.dimension_count", head_dim)),
        rope_scaling=str(g("rope.scaling.type", "none")),
        norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        value_dim=int(g("attention.value_length", head_dim)),
        rope_scale=_rope_scale(g),
    )
    return d | _gemma_dims(g, d)


def _rope_scale(g) -> float:
    """The linear RoPE factor as llama.cpp's ``llama_model::load_hparams`` reads it:
    ``rope.scaling.factor``, else the older ``rope.scale_linear``; absent or 0: 1 (positions
    are divided by it; plan_tensors refuses the scaling types other than none and linear)."""
    f = float(g("rope.scaling.factor", 0.0) or g("rope.scale_linear", 0.0) or 0.0)
    return f if f > 0 else 1.0


def _gemma_dims(g, d: dict) -> dict:
    """gemma2 / gemma3's part of the dims, as llama.cpp's ``llama_model_gemma2/3::
    load_arch_hparams`` reads the file: GeGLU, the embedding scale sqrt(n_embd), the attention
    scale (1 / sqrt(head_dim); 1 / sqrt(n_embd / n_head) for the 27B models), soft-caps
    (gemma2: 50 on scores, 30 on logits by default; gemma3: logits only if the file says), the
    sliding layers (window ``attention.sliding_window``, gemma2's default 4096; pattern
    ``attention.sliding_window_pattern`` or every 2nd / 6th layer global) and their RoPE
    (``rope.freq_base_swa``; gemma3: 10000 unscaled by default). Other architectures: {}."""
    arch, n_layer, n_embd, n_head, head_dim = (d[k] for k in ("arch", "n_layer", "n_embd", "n_head", "head_dim"))
    if arch not in SWA_PATTERN:
        return {}
    gemma2 = arch == "gemma2"
    big = n_layer == (46 if gemma2 else 62)  # LLM_TYPE_27B
    window = int(g("attention.sliding_window", 4096 if gemma2 else 0))
    pattern = g("attention.sliding_window_pattern", SWA_PATTERN[arch])
    if isinstance(pattern, list):
        slides = [bool(x) for x in pattern[:n_layer]] + [False] * (n_layer - len(pattern))  # llama.cpp: the rest global
    else:
        slides = [int(pattern) == 0 or i % int(pattern) < int(pattern) - 1 for i in range(n_layer)]
    scale = d["rope_scale"]
    return dict(
        ffn_act="gelu",
        emb_scale=math.sqrt(n_embd),
        attn_scale=1.0 / math.sqrt(n_embd // n_head if big else head_dim),
        attn_softcap=float(g("attn_logit_softcapping", 50.0)) if gemma2 else 0.0,
        final_softcap=float(g("final_logit_softcapping", 30.0 if gemma2 else 0.0)),
        swa=[window if s and window > 0 else 0 for s in slides],
        rope_theta_swa=float(g("rope.freq_base_swa", d["rope_theta"] if gemma2 else 10000.0)),
        rope_scale_swa=scale if gemma2 else 1.0,
    )


LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias")


def _is_vector(t) -> bool:
    """A 1-D GGUF tensor (norms, biases, rope_freqs): a float32 blob, not panels."""
    return len(t.shape) == 1 or (len(t.shape) == 2 and int(t.shape[1]) == 1)


class _Rows:
    """Rows ``[r0, r1)`` of a 2-D GGUF tensor, read as a tensor of their own: one projection of
    a fused one (phi3's ``attn_qkv``, ``ffn_up``). A row's blocks are the row's alone, so the
    split keeps every byte as the file has it."""

    def __init__(self, t, r0: int, r1: int):
        self.name, self.tensor_type = f"{t.name}[{r0}:{r1}]", t.tensor_type
        self.shape = np.array([int(t.shape[0]), r1 - r0])
        self.data = np.asarray(t.data).view(np.uint8).reshape(int(t.shape[1]), -1)[r0:r1]
        self.data_offset, self.n_bytes = t.data_offset, t.n_bytes  # the whole tensor's pages (_drop_pages)


def _split_fused(dims: dict, byname: dict, i: int) -> tuple[dict, str | None]:
    """``{key: _Rows}`` of layer ``i``'s fused projections (:data:`FUSED`), or why not."""
    q, kv, ff = dims["n_head"] * dims["head_dim"], dims["n_head_kv"] * dims["head_dim"], dims["n_ff"]
    sizes = {"attn_q": q, "attn_k": kv, "attn_v": kv, "ffn_gate": ff, "ffn_up": ff}
    out = {}
    for fused, parts in FUSED.get(dims["arch"], {}).items():
        t = byname.get(f"blk.{i}.{fused}.weight")
        if t is None:
            return {}, f"tensor blk.{i}.{fused}.weight is missing"
        if len(t.shape) != 2 or int(t.shape[1]) != sum(sizes[p] for p in parts):
            return {}, f"blk.{i}.{fused}.weight has {int(t.shape[-1])} rows; {'+'.join(parts)} need {sum(sizes[p] for p in parts)}"
        r0 = 0
        for p in parts:
            out[f"blk.{i}.{p}"] = _Rows(t, r0, r0 + sizes[p])
            r0 += sizes[p]
    return out, None


def plan_tensors(reader) -> tuple[dict, dict, str | None]:
    """(dims, {name: reader tensor}, why not) for a GGUF reader: the tensors a kernel step
    reads, or the first reason the kernels cannot run this file."""
    from specrt.runtime.kernels.panels import supported

    dims = _dims(reader)
    byname = {t.name: t for t in reader.tensors}
    if dims["arch"] not in ROPE_NEOX_ARCHS:
        return dims, {}, f"architecture {dims['arch']!r} (the kernels run {', '.join(ROPE_NEOX_ARCHS)})"
    if dims["rope_scaling"] not in ("none", "", "linear"):
        return dims, {}, f"rope scaling {dims['rope_scaling']!r} (the kernels run none, linear and Llama 3's rope_freqs)"
    if any(n.startswith("rope_factors") for n in byname):
        return dims, {}, "rope scaling (LongRoPE factors: rope_factors_long/short)"
    if dims["rope_dims"] != dims["head_dim"] or dims["value_dim"] != dims["head_dim"]:
        return dims, {}, "partial rotary or a value dim other than the key dim"
    hd = dims["head_dim"]
    if hd % 16 or hd > 256 or dims["n_head"] % dims["n_head_kv"]:
        return dims, {}, f"head_dim {hd} (a multiple of 16 up to 256) or {dims['n_head']} heads over {dims['n_head_kv']} KV heads"
    want = {
        "token_embd": "token_embd.weight",
        "output_norm": "output_norm.weight",
        # gemma2's head is its embedding, whatever else the file holds (llama.cpp: TENSOR_DUPLICATED)
        "output": "output.weight" if "output.weight" in byname and dims["arch"] != "gemma2" else "token_embd.weight",
    }
    if "rope_freqs.weight" in byname:
        want["rope_freqs"] = "rope_freqs.weight"
    split: dict = {}
    for i in range(dims["n_layer"]):
        rows, why = _split_fused(dims, byname, i)
        if why:
            return dims, {}, why
        split |= rows
        for t in LAYER_TENSORS:
            if f"blk.{i}.{t}" not in rows:
                want[f"blk.{i}.{t}"] = f"blk.{i}.{t}.weight"
        for b in BIASES:
            if f"blk.{i}.{b}" in byname:
                want[f"blk.{i}.{b}"] = f"blk.{i}.{b}"
        for arches, names in ((QK_NORM_ARCHS, QK_NORMS), (POST_NORM_ARCHS, POST_NORMS)):
            if dims["arch"] in arches:  # required: a layer without them would run as another model
                for n in names:
                    want[f"blk.{i}.{n}"] = f"blk.{i}.{n}.weight"
    tensors = {}
    for key, name in [*want.items(), *((k, r) for k, r in split.items())]:
        t = name if isinstance(name, _Rows) else byname.get(name)
        if t is None:
            return dims, {}, f"tensor {name} is missing"
        ty = int(t.tensor_type)
        if _is_vector(t):
            if ty != 0:
                return dims, {}, f"{name} is {t.tensor_type.name} (1-D tensors must be F32)"
        else:
            why = supported(ty, int(t.shape[1]), int(t.shape[0]))
            if why:
                return dims, {}, f"{t.name} ({t.tensor_type.name} [{int(t.shape[1])}, {int(t.shape[0])}]): {why}"
        tensors[key] = t
    if split:  # the file's order: each layer's tensors together (the panels file follows it)
        tensors = {k: tensors[k] for k in sorted(tensors, key=_file_order)}
    return dims, tensors, None


def _file_order(key: str) -> tuple:
    """Sort key of a panels entry: global tensors first, then layer by layer."""
    parts = key.split(".")
    return (1, int(parts[1]), key) if parts[0] == "blk" else (0, 0, key)


def kernels_unsupported(gguf_path: str | Path) -> str | None:
    """None when the kernels run this GGUF file, else why not (one line). Reads metadata only."""
    import gguf

    return plan_tensors(gguf.GGUFReader(str(gguf_path)))[2]


def _check(key: str, raw: np.ndarray, ty: int, n: int, k: int, panels: np.ndarray) -> None:
    """The panels of a tensor (``raw``: its blocks, uint8 ``[n, row bytes]``) dequantize (the
    kernels' C code) to ``gguf.dequantize`` of the same blocks, bit for bit, in chunks of rows.

    Raises:
        ExportError: a row differs (the layout is wrong: never write such a file).
    """
    import gguf
    from gguf.quants import dequantize

    from specrt.runtime import kernels
    from specrt.runtime.errors import ExportError

    step = max(16, (1 << 22) // k // 16 * 16)
    for n0 in range(0, n, step):
        n1 = min(n, n0 + step)
        want = dequantize(raw[n0:n1], gguf.GGMLQuantizationType(ty)).reshape(n1 - n0, k)
        got = kernels.dequant(ty, n, k, panels, n0, n1)
        if not np.array_equal(want.view(np.uint32), got.view(np.uint32)):
            bad = int(np.argwhere(want.view(np.uint32) != got.view(np.uint32))[0][0]) + n0
            raise ExportError(f"kernel panels of {key}: row {bad} differs from gguf.dequantize of the same blocks (a layout bug; not written)")


def _blocks(t, requant: int | None, rows: np.ndarray | None) -> tuple[int, int, int, np.ndarray]:
    """``(type, n, k, blocks uint8 [n, row bytes])`` of a 2-D GGUF tensor: its own blocks, or
    (``requant``: a ggml type) quantized again by gguf-py from ``gguf.dequantize`` of them,
    keeping only ``rows`` (ids of a trimmed head) when given."""
    import gguf
    from gguf.quants import dequantize, quantize

    ty, k, n = int(t.tensor_type), int(t.shape[0]), int(t.shape[1])
    raw = np.asarray(t.data).view(np.uint8).reshape(n, -1)
    if rows is not None:
        raw = raw[rows]
        n = len(rows)
    if requant is None or requant == ty:
        return ty, n, k, np.ascontiguousarray(raw)
    out = None
    step = max(1, (1 << 22) // k)  # rows at a time: quantization is per block, so per row; bounds the float copies
    for r0 in range(0, n, step):
        q = quantize(dequantize(raw[r0 : r0 + step], t.tensor_type).reshape(-1, k), gguf.GGMLQuantizationType(requant)).reshape(-1)
        if out is None:
            out = np.empty((n, q.size // min(step, n - r0)), dtype=np.uint8)
        out[r0 : r0 + step] = q.reshape(-1, out.shape[1])
    return requant, n, k, out


def _tensor_blob(key: str, t, requant: int | None, head_ids: np.ndarray | None) -> tuple[int, int, int, np.ndarray]:
    """``(type, n, k, bytes)`` of one entry of a panels file: the head's ids (int32), a 1-D
    float32 tensor, or a matrix's panels (:func:`_blocks`, checked by :func:`_check`)."""
    from specrt.runtime.kernels.panels import pack, panel_bytes

    if key == "head_ids":
        return 26, len(t), 1, np.ascontiguousarray(t)  # ggml's I32
    if _is_vector(t):  # F32 (plan_tensors checked it)
        blob = np.ascontiguousarray(np.asarray(t.data, dtype=np.float32).reshape(-1))
        return 0, int(blob.size), 1, blob
    ty, n, k, raw = _blocks(t, None if key == "token_embd" else requant, head_ids if key == "output" else None)
    blob = pack(raw, ty, n, k)
    assert blob.size == panel_bytes(ty, n, k)
    _check(key, raw, ty, n, k, blob)
    return ty, n, k, blob


def _checked_head(head_ids, vocab: int) -> np.ndarray:
    """``head_ids`` as int32, checked: a positive multiple of 16 ids in ``0..vocab-1``,
    ascending, each once (else ValueError)."""
    head_ids = np.asarray(head_ids, dtype=np.int32)
    if len(head_ids) % 16 or len(head_ids) == 0 or head_ids.min() < 0 or head_ids.max() >= vocab or (np.diff(head_ids) <= 0).any():
        raise ValueError(
            f"head_ids: {len(head_ids)} ids in [{head_ids.min()}, {head_ids.max()}]; need a positive multiple of 16 ids in 0..{vocab - 1}, ascending, each once"
        )
    return head_ids


def _drop_pages(reader, t) -> None:
    """Unmap the pages of tensor ``t`` from this process (the file stays in the page cache):
    a build then holds one tensor of the GGUF in its resident set at a time, not the file."""
    import mmap

    mm = getattr(reader.data, "_mmap", None)
    if mm is None or not hasattr(mm, "madvise"):
        return
    start = int(t.data_offset) // mmap.PAGESIZE * mmap.PAGESIZE
    try:
        mm.madvise(mmap.MADV_DONTNEED, start, int(t.data_offset) + int(t.n_bytes) - start)
    except (OSError, ValueError):
        pass  # only memory: a build is right either way


def write_panels(
    gguf_path: str | Path, out: Path, role: str, log=print, requant: int | None = None, head_ids: np.ndarray | None = None, reader=None
) -> dict | None:
    """Write ``out/<role>.panels`` from a GGUF file and return its manifest record, or None
    (with the reason logged) when the kernels cannot run the file or are not built here.

    Args:
        requant: None (the target: the file's own blocks), or a ggml type every weight
            matrix but the embedding is quantized to again, from its dequantized values (a
            draft, which needs speed and acceptance, not exactness to its file).
        head_ids: int ids (a multiple of 16 of them) whose LM-head rows are kept (FR-Spec,
            Zhao et al. 2025, Sec. 3: a draft proposes among the most frequent ids only);
            stored in the file (``head_ids``), the rest of the vocabulary gets no logit.
        reader: an open ``gguf.GGUFReader`` of ``gguf_path`` (opening one parses the whole
            vocabulary: 10 s for Qwen2.5's 151,936 tokens on an AMD EPYC Zen 3 core, AVX2), or None.

    Returns:
        ``{"version", "file", "gguf", "dims", "tensors": {key: {type, n, k, offset, bytes}},
        "rope_neox", "checked", "seconds"}`` (+ ``"requantized"``, ``"head"`` when asked).

    Raises:
        ExportError: a tensor's panels do not dequantize to its blocks' values.
        ValueError: ``head_ids`` not a multiple of 16 ids, or outside the vocabulary.
    """
    import gguf

    from specrt.runtime import kernels

    if kernels.status() is not None:
        log(f"  kernels: no {role} panels ({kernels.status()})")
        return None
    t0 = time.time()
    reader = reader if reader is not None else gguf.GGUFReader(str(gguf_path))
    dims, tensors, why = plan_tensors(reader)
    if why:
        log(f"  kernels: no {role} panels: the kernels do not run {Path(gguf_path).name}: {why}")
        return None
    vocab = int(tensors["token_embd"].shape[1])
    if head_ids is not None:
        head_ids = _checked_head(head_ids, vocab)
    from specrt.runtime.fileio import replaced

    path = Path(out) / f"{role}.panels"
    index, offset = {}, 0
    extra = {"head_ids": head_ids} if head_ids is not None else {}
    # a new file moved over the name: a process that mapped the old one keeps its bytes
    with replaced(path) as tmp, open(tmp, "wb") as f:
        for key, t in [*tensors.items(), *extra.items()]:
            ty, n, k, blob = _tensor_blob(key, t, requant, head_ids)
            pad = (-offset) % ALIGN
            f.write(b"\0" * pad)
            offset += pad
            f.write(blob.tobytes())
            index[key] = {"type": ty, "n": n, "k": k, "offset": offset, "bytes": int(blob.nbytes)}
            offset += int(blob.nbytes)
            if key != "head_ids":
                _drop_pages(reader, t)
    secs = time.time() - t0
    log(f"  kernels: {path.name}: {len(index)} tensors, {offset / 1e6:.1f} MB, each checked against gguf.dequantize ({secs:.0f} s)")
    dims["n_vocab"] = vocab
    rec = {
        "version": KERNEL_RECORD_VERSION,
        "file": path.name,
        "gguf": Path(gguf_path).name,
        "dims": dims,
        "rope_neox": ROPE_NEOX_ARCHS[dims["arch"]],
        "tensors": index,
        "checked": "every tensor's panels dequantize (the kernels' C code) to gguf.dequantize of its blocks, bit for bit",
        "seconds": round(secs, 1),
    }
    if requant is not None:
        rec["requantized"] = {
            "type": gguf.GGMLQuantizationType(requant).name,
            "from": "gguf.dequantize of the file's blocks, quantized by gguf-py",
            "except": ["token_embd"],
        }
    if head_ids is not None:
        rec["head"] = {"ids": len(head_ids), "of": vocab}
    return rec


def panels_record(gguf_path: str | Path, out: Path, entry, max_ctx: int, log=print) -> dict | None:
    """:func:`write_panels` for the target, with its exact step timed on the kernels and on the
    ONNX graph on this machine (``measured``: :func:`specrt.runtime.lab.kernel_paths.measure_paths`);
    None when no panels were written."""
    from specrt.runtime.lab.kernel_paths import measure_paths

    rec = write_panels(gguf_path, out, "target", log)
    if rec is None:
        return None
    m = measure_paths(Path(out), entry, rec, max_ctx, log=log)
    log(
        f"  kernels: exact target step {m['kernels_ms']:.1f} ms ({m['isa']}, 1 row) vs the ONNX graph's {m['ort_ms']:.1f} ms ({m['ort_q']} rows) on this machine"
    )
    return {**rec, "measured": [m]}


def add_to_engine(folder: str | Path, gguf_path: str | Path, log=print, draft_gguf: str | Path | None = None) -> dict | None:
    """Add the kernel panels to an engine folder exported before them (or refresh them):
    writes ``target.panels`` and, where the draft's GGUF is found (``draft_gguf``, else the
    file ``extra.gguf.draft`` names beside ``gguf_path``), ``draft.panels``
    (:func:`draft_panels`); records them in the manifest's ``files`` and ``extra["kernels"]``
    and rewrites the manifest. ``gguf_path`` must be the file the target was exported from
    (its SHA-256 is checked against ``extra.gguf.target``).

    Returns:
        The target's record, or None (the reason logged) when the kernels cannot run the file.

    Raises:
        ExportError: the folder's target was not exported from this GGUF file.
    """
    from dataclasses import replace

    from specrt.runtime.errors import ExportError
    from specrt.runtime.manifest import FileRecord, load_manifest, sha256_file

    folder = Path(folder)
    m = load_manifest(folder, verify_hashes=False)
    src = (m.extra.get("gguf") or {}).get("target") or {}
    if src.get("sha256") != sha256_file(Path(gguf_path)):
        raise ExportError(f"{folder}'s target was not exported from {gguf_path} (its SHA-256 differs from the manifest's extra.gguf.target)")
    rec = panels_record(gguf_path, folder, m.target, m.max_ctx, log)
    if rec is None:
        return None
    recs = {"target": rec}
    draft_src = Path(gguf_path).parent / ((m.extra.get("gguf") or {}).get("draft") or {}).get("file", "")
    if draft_gguf is not None or draft_src.is_file():
        d = draft_panels(draft_gguf or draft_src, folder, folder / m.tokenizer_file, (m.eos_token_id,), log=log)
        if d is not None:
            recs["draft"] = d
    files = dict(m.files)
    for r in recs.values():
        files[r["file"]] = FileRecord.of(folder / r["file"])
    replace(m, files=files, extra={**m.extra, "kernels": recs}).write(folder)
    return rec


def ranked_ids(tokenizer_json: Path, vocab: int, first: tuple[int, ...] = ()) -> np.ndarray:
    """Every id in ``0..vocab-1`` by descending count on the counting text, ``first`` (the end
    ids, which a draft must be able to propose) and the tokenizer's added tokens (chat and
    FIM markup) ahead of all (FR-Spec, Zhao et al. 2025, Sec. 3). The counting text is the
    running interpreter's stdlib sources, the files the quality record holds out excepted
    (:func:`specrt.runtime.lab.quality.stdlib_files`): code and its docstrings."""
    from collections import Counter

    from tokenizers import Tokenizer

    from specrt.runtime.lab.quality import HELDOUT_EVERY, stdlib_files

    tok = Tokenizer.from_file(str(tokenizer_json))
    counts: Counter = Counter()
    for i, p in enumerate(stdlib_files()):
        if i % HELDOUT_EVERY == 0:
            continue
        try:
            counts.update(tok.encode(p.read_text(encoding="utf-8"), add_special_tokens=False).ids)
        except (UnicodeDecodeError, OSError):
            continue
    head = [*first, *sorted(tok.get_added_tokens_decoder())]
    order = list(dict.fromkeys([t for t in head if 0 <= t < vocab] + [t for t, _ in counts.most_common() if t < vocab]))
    seen = set(order)
    return np.asarray(order + [t for t in range(vocab) if t not in seen], dtype=np.int32)


def draft_panels(gguf_path: str | Path, out: Path, tokenizer_json: Path, end_ids: tuple[int, ...], head: int = DRAFT_HEAD, log=print) -> dict | None:
    """The draft's panels (``draft.panels``): every weight matrix quantized again to
    :data:`DRAFT_REQUANT`, the LM head cut to the ``head`` most frequent ids
    (:func:`ranked_ids`; 0 = all). The draft needs speed and acceptance, not exactness: the
    target verifies every candidate. Its greedy step is timed on every ISA path this CPU runs
    (``measured``: :func:`specrt.runtime.lab.kernel_paths.measure_draft_paths`). None when the
    kernels cannot run the file."""
    import gguf

    from specrt.runtime.lab.kernel_paths import measure_draft_paths

    vocab = int(next(t for t in gguf.GGUFReader(str(gguf_path)).tensors if t.name == "token_embd.weight").shape[1])
    ids = None
    if head and head < vocab:
        ids = np.sort(ranked_ids(tokenizer_json, vocab, tuple(end_ids))[: head // 16 * 16])
    rec = write_panels(gguf_path, out, "draft", log, requant=DRAFT_REQUANT, head_ids=ids)
    if rec is None:
        return None
    rec["measured"] = measure_draft_paths(Path(out), rec)
    log("  kernels: draft step " + ", ".join(f"{m['step_ms']:.1f} ms ({m['isa']})" for m in rec["measured"]) + " on this machine")
    return rec
