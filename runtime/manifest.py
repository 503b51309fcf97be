"""``manifest.json``: the versioned contract between ``specrt export`` and the runtime.

An engine folder holds ``manifest.json``, ``draft.onnx``, ``target.onnx`` and
``tokenizer.json``; graphs whose weights are stored beside them (``ModelEntry.data_file``,
e.g. ``target.onnx.data``) have that file too; with ``--lazy-head`` (standard graphs only)
the target split at its vocabulary projection, ``target_body.onnx`` and
``target_head.onnx``, recorded in ``extra["lazy_head"]`` (:func:`lazy_head_files`), which
read the weights of ``target.onnx.data`` (stored once). The manifest records, per model,
the graph form (:data:`GRAPH_FORMS`), its precision, the dims the runtime needs to
allocate KV buffers, the I/O names, the parity figures and the width-exactness measured at
export, and the SHA-256 of every file; plus the shared tokenizer hash, vocab size, special
tokens, maximum context, the allowed k range and the default decoding settings; and, when
the target checkpoint has one, its chat template as ``chat_template.jinja``
(``chat_template_file`` and ``chat_template_sha256``; optional fields, so older manifests
stay loadable).

Graph forms (one per model, so a pair may mix them):

* ``standard``: specrt's own IO-bound graph (:mod:`specrt.export.kv_model`): inputs
  ``input_ids``/``position_ids`` ``[1, q]`` and ``past_key_i``/``past_value_i``
  ``[1, L, kv_heads, head_dim]``; outputs ``logits`` and only the q new KV rows
  (``new_key_i``/``new_value_i``). Precisions fp32, fp16, bf16 (compute; I/O float32).
* ``builder``: onnxruntime-genai's model builder graph (GroupQueryAttention,
  MatMulNBits, SkipSimplifiedLayerNormalization): inputs ``input_ids`` ``[1, q]``,
  ``attention_mask`` int64 ``[1, L + q]``, ``past_key_values.i.key``/``.value``
  ``[1, kv_heads, S, head_dim]`` (BNSH); outputs ``logits`` and ``present.i.key``/``.value``,
  which the runtime binds to the same buffer as the past (in place,
  :mod:`specrt.runtime.backends.ort_gqa`). Precisions int8, int4 (weights; fp32 for models
  the builder does not cover, see :mod:`specrt.export.builder`).

The runtime refuses a manifest whose ``format_version`` it does not know, and a pair
whose vocab sizes or tokenizer hashes differ, with a message saying what to re-run.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import EngineError

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST",
    "KV_LAYOUT",
    "GRAPH_STANDARD",
    "GRAPH_BUILDER",
    "GRAPH_FORMS",
    "PRECISIONS",
    "REEXPORT_HINT",
    "sha256_file",
    "ModelEntry",
    "Manifest",
    "LAZY_HEAD_KEY",
    "LAZY_HEAD_HINT",
    "lazy_head_files",
    "load_manifest",
    "write_defaults",
]

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
KV_LAYOUT = "BLHD"  # [batch=1, position, kv_head, head_dim], sequence-major (standard graphs)
GRAPH_STANDARD = "standard"  # specrt's IO-bound graph (new KV rows out), BLHD KV
GRAPH_BUILDER = "builder"  # onnxruntime-genai model builder graph (GQA, past/present shared), BNSH KV
GRAPH_FORMS = (GRAPH_STANDARD, GRAPH_BUILDER)
PRECISIONS = ("fp32", "fp16", "bf16", "int8", "int4")  # specrt export --precision
REEXPORT_HINT = "re-run `specrt export --draft DRAFT_DIR --target TARGET_DIR --out {folder}` (or `make export`)"


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's bytes (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class ModelEntry:
    """One exported model of the pair.

    Attributes:
        file: ONNX file name inside the engine folder.
        sha256: hex digest of that file.
        family: architecture family (``llama`` ...).
        n_layers: decoder layers (= number of past_key_i/past_value_i pairs).
        n_heads: query heads.
        n_kv_heads: key/value heads of one KV row.
        head_dim: per-head width; one KV row holds n_kv_heads * head_dim float32.
        hidden: model width.
        vocab_size: logits width (may exceed the tokenizer's real vocab by padding rows).
        params: parameter count.
        parity: max |exported - PyTorch| figures measured at export, by check name.
        inputs: ONNX input names in order.
        outputs: ONNX output names in order.
        source: the checkpoint folder it came from.
        vocab_hash: SHA-256 of the token -> id map of the tokenizer saved beside that
            checkpoint (empty in manifests written before it was recorded); the draft's
            and the target's must be equal.
        matmul_params: weights of the decoder layers' matrix multiplications (embeddings,
            norms, biases and LM head excluded), counted at export for the FLOPs figures
            (:mod:`specrt.runtime.flops`); 0 in manifests written before it was recorded.
        graph: graph form, one of :data:`GRAPH_FORMS` (``standard`` in older manifests).
        precision: one of :data:`PRECISIONS`: compute precision of a standard graph, weight
            precision of a builder graph (``fp32`` in older manifests).
        quant: how the weights were quantized (builder graphs: builder version, block size,
            accuracy level, extra options); empty otherwise.
        data_file: external-data weight file beside ``file`` (empty: weights inline).
        data_sha256: hex digest of ``data_file``.
        exact_min_q: smallest call width from which logits rows are bit-identical whatever
            the width and row offset, measured at export on this graph
            (:mod:`specrt.runtime.lab.exactness`); None when no width is (or it was not
            measured). The decode loop never calls the target narrower than this.
        exactness: the figures behind ``exact_min_q`` (widths, offsets, max differences).
        note: what the export chose for this model and why (e.g. a GPT-2 model kept the
            standard graph in an int4 export because the builder has no GPT-2).
    """

    file: str
    sha256: str
    family: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden: int
    vocab_size: int
    params: int
    parity: dict[str, float] = field(default_factory=dict)
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    source: str = ""
    vocab_hash: str = ""
    matmul_params: int = 0
    graph: str = GRAPH_STANDARD
    precision: str = "fp32"
    quant: dict = field(default_factory=dict)
    data_file: str = ""
    data_sha256: str = ""
    exact_min_q: int | None = None
    exactness: dict = field(default_factory=dict)
    note: str = ""

    @staticmethod
    def io_names(n_layers: int, graph: str = GRAPH_STANDARD) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The ONNX input and output names for ``n_layers`` layers of a graph form (one
        declaration per form; see the module docstring)."""
        if graph == GRAPH_BUILDER:
            ins, outs = ["input_ids", "attention_mask"], ["logits"]
            for i in range(n_layers):
                ins += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
                outs += [f"present.{i}.key", f"present.{i}.value"]
            return tuple(ins), tuple(outs)
        ins = ["input_ids", "position_ids"]
        outs = ["logits"]
        for i in range(n_layers):
            ins += [f"past_key_{i}", f"past_value_{i}"]
            outs += [f"new_key_{i}", f"new_value_{i}"]
        return tuple(ins), tuple(outs)

    def files(self) -> dict[str, str]:
        """``{file name: sha256}`` of this model's files in the engine folder (graph and
        external weights)."""
        out = {self.file: self.sha256}
        if self.data_file:
            out[self.data_file] = self.data_sha256
        return out


@dataclass(frozen=True)
class Manifest:
    """The parsed ``manifest.json`` of an engine folder (see module docstring)."""

    format_version: int
    name: str
    draft: ModelEntry
    target: ModelEntry
    tokenizer_file: str
    tokenizer_sha256: str
    vocab_size: int  # real vocab of the tokenizer; ids >= this are padding rows, never proposed
    eos_token_id: int
    bos_token_id: int | None
    add_bos: bool  # whether prompts get BOS prepended (the same for draft, target, baseline)
    max_ctx: int  # positions 0..max_ctx-1 exist; KV buffers hold max_ctx rows
    k_min: int
    k_max: int  # largest number of draft candidates per verification pass
    kv_layout: str = KV_LAYOUT
    kv_dtype: str = "float32"
    defaults: dict[str, Any] = field(default_factory=dict)  # decoding defaults, e.g. k_max, threshold
    tools: dict[str, str] = field(default_factory=dict)  # tool versions used at export
    extra: dict[str, Any] = field(default_factory=dict)  # backend files etc. (forward compatible)
    pad_token_id: int | None = None  # the target's pad token (recorded; batch-1 decoding never pads)
    chat_template_file: str | None = None  # the target's chat template copied at export (None: it had none)
    chat_template_sha256: str | None = None  # its SHA-256, checked at load like the other files
    precision: str = "fp32"  # specrt export --precision (per model: ModelEntry.precision)

    def min_q(self) -> int:
        """Narrowest target call the decode loop may make: the target's measured
        ``exact_min_q`` (1 when none was measured or no width is bit-identical)."""
        return max(1, self.target.exact_min_q or 1)

    def to_json(self) -> str:
        """The manifest as indented JSON text (the dataclass fields, in order)."""
        return json.dumps(asdict(self), indent=1, sort_keys=False)

    def write(self, folder: Path) -> Path:
        """Write ``folder/manifest.json`` atomically (temp file + rename); returns its path."""
        folder = Path(folder)
        tmp = folder / (MANIFEST + ".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(folder / MANIFEST)
        return folder / MANIFEST


LAZY_HEAD_KEY = "lazy_head"  # key of the optional lazy-head record in Manifest.extra
LAZY_HEAD_HINT = (
    "this engine folder was exported without the lazy-head target (target_body.onnx + target_head.onnx); "
    "re-run `specrt export --draft DRAFT_DIR --target TARGET_DIR --out {folder} --precision fp32 --lazy-head`, "
    "or use strategy 'full' or 'chunked'"
)


def lazy_head_files(manifest: Manifest, folder: str | Path, verify_hashes: bool = True) -> tuple[dict, dict]:
    """The lazy-head graphs of an engine folder, checked: ``(body, head)`` records of
    ``manifest.extra["lazy_head"]``, each ``{"file", "sha256", "inputs", "outputs"}``.

    The record is optional: the export writes it with ``--lazy-head`` (fp32 standard
    graphs only; format version 1 manifests without it stay loadable). Body: the target's inputs -> ``hidden``
    float32 ``[1, q, hidden]`` + new KV; head: ``hidden`` ``[1, r, hidden]`` -> ``logits``
    float32 ``[1, r, vocab]``.

    Raises:
        EngineError: no record (:data:`LAZY_HEAD_HINT`), a malformed one, a file missing, or
            (``verify_hashes``) a file whose SHA-256 differs from the record.
    """
    folder = Path(folder)
    rec = manifest.extra.get(LAZY_HEAD_KEY)
    if rec is None:
        raise EngineError(LAZY_HEAD_HINT.format(folder=folder))
    hint = REEXPORT_HINT.format(folder=folder)
    try:
        parts = (dict(rec["body"]), dict(rec["head"]))
        for part in parts:
            str(part["file"]), str(part["sha256"])
    except (KeyError, TypeError, ValueError) as e:
        raise EngineError(f"{folder / MANIFEST}: the lazy_head record is malformed ({e!r}); {hint}") from None
    for part in parts:
        p = folder / part["file"]
        if not p.is_file():
            raise EngineError(f"{p} is missing (the manifest lists it as the lazy-head target); {hint}")
        if verify_hashes and sha256_file(p) != part["sha256"]:
            raise EngineError(f"{p} does not match the SHA-256 recorded in the manifest (truncated or altered); {hint}")
    return parts


def _entry(d: dict, role: str, folder: Path) -> ModelEntry:
    try:
        d = dict(d)
        d["inputs"] = tuple(d.get("inputs", ()))
        d["outputs"] = tuple(d.get("outputs", ()))
        return ModelEntry(**d)
    except TypeError as e:
        raise EngineError(f"{folder / MANIFEST}: the {role} entry is malformed ({e}); {REEXPORT_HINT.format(folder=folder)}") from None


def load_manifest(folder: str | Path, verify_hashes: bool = True) -> Manifest:
    """Read and validate ``folder/manifest.json``.

    Args:
        folder: the engine folder.
        verify_hashes: also recompute the SHA-256 of the ONNX and tokenizer files and
            compare them with the manifest (catches truncated or altered files).

    Returns:
        The :class:`Manifest`.

    Raises:
        EngineError: folder or file missing, JSON unreadable, unknown ``format_version``,
            draft/target vocab sizes that differ, draft/target tokenizer vocab hashes that
            differ, or a file whose hash does not match (the chat template included, when
            the manifest records one).
    """
    folder = Path(folder)
    hint = REEXPORT_HINT.format(folder=folder)
    if not folder.is_dir():
        raise EngineError(f"engine folder {folder} does not exist; {hint}")
    path = folder / MANIFEST
    if not path.is_file():
        raise EngineError(f"{path} is missing (the export did not finish or this is not an engine folder); {hint}")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise EngineError(f"{path} is not readable JSON ({e}); {hint}") from None
    if not isinstance(raw, dict):
        raise EngineError(f"{path} is not a JSON object; {hint}")
    ver = raw.get("format_version")
    if ver != FORMAT_VERSION:
        raise EngineError(f"{path}: format_version={ver!r}, this runtime understands only {FORMAT_VERSION}; {hint} with this version of specrt")
    try:
        raw["draft"] = _entry(raw["draft"], "draft", folder)
        raw["target"] = _entry(raw["target"], "target", folder)
        m = Manifest(**raw)
    except (KeyError, TypeError) as e:
        raise EngineError(f"{path} is malformed ({e}); {hint}") from None
    if m.draft.vocab_size < m.vocab_size or m.target.vocab_size < m.vocab_size:
        raise EngineError(
            f"{path}: vocab sizes differ (draft {m.draft.vocab_size}, target {m.target.vocab_size}, tokenizer {m.vocab_size}); "
            "the draft and the target must share one tokenizer; export a matching pair"
        )
    if m.draft.vocab_hash and m.target.vocab_hash and m.draft.vocab_hash != m.target.vocab_hash:
        raise EngineError(
            f"{path}: the draft and the target come from different tokenizers (vocab hash {m.draft.vocab_hash[:12]} "
            f"vs {m.target.vocab_hash[:12]}); speculative decoding needs the draft to propose ids the target understands. "
            f"Re-export the pair together from checkpoints that share the target's tokenizer: {hint}"
        )
    if m.kv_layout != KV_LAYOUT or m.kv_dtype != "float32":
        raise EngineError(f"{path}: KV layout {m.kv_layout}/{m.kv_dtype} is not supported (need {KV_LAYOUT}/float32); {hint}")
    for role, e in (("draft", m.draft), ("target", m.target)):
        if e.graph not in GRAPH_FORMS or e.precision not in PRECISIONS:
            raise EngineError(
                f"{path}: the {role} has graph form {e.graph!r} / precision {e.precision!r}; this runtime knows "
                f"graph forms {', '.join(GRAPH_FORMS)} and precisions {', '.join(PRECISIONS)}; {hint} with this version of specrt"
            )
    files = {**m.draft.files(), **m.target.files(), m.tokenizer_file: m.tokenizer_sha256}
    if m.chat_template_file is not None:
        if not isinstance(m.chat_template_file, str) or not isinstance(m.chat_template_sha256, str):
            raise EngineError(f"{path}: chat_template_file/chat_template_sha256 must both be strings; {hint}")
        files[m.chat_template_file] = m.chat_template_sha256
    for name, digest in files.items():
        p = folder / name
        if not p.is_file():
            raise EngineError(f"{p} is missing; {hint}")
        if verify_hashes and sha256_file(p) != digest:
            raise EngineError(f"{p} does not match the SHA-256 recorded in the manifest (truncated or altered); {hint}")
    return m


def write_defaults(folder: str | Path, defaults: dict, extra: dict | None = None, replace: bool = False) -> dict:
    """Update ``defaults`` (and top-level keys of ``extra``) in ``folder/manifest.json``.

    The file is rewritten atomically (a temporary file in the same folder, then
    ``os.replace``); every other field, the file hashes included, is kept as it was, so the
    hash checks still pass. The result is loaded again (without rehashing the models); if
    that fails the previous file is put back.

    Args:
        folder: the engine folder.
        defaults: keys to set in ``defaults`` (e.g. k_max, threshold, strategy,
            draft_confidence_temperature).
        extra: keys to set in ``extra`` (e.g. ``"tune"``, ``"calibration"`` records).
        replace: ``defaults`` replaces the whole ``defaults`` object instead of updating it
            (``specrt tune --restore-previous``).

    Returns:
        the new ``defaults`` dict.

    Raises:
        EngineError: the folder has no readable manifest, or the new one does not load.
    """
    folder = Path(folder)
    path = folder / MANIFEST
    load_manifest(folder, verify_hashes=False)  # refuse a broken folder before touching it
    old_text = path.read_text()
    raw = json.loads(old_text)
    if replace:
        raw["defaults"] = dict(defaults)
    else:
        raw.setdefault("defaults", {}).update(defaults)
    if extra:
        raw.setdefault("extra", {}).update(extra)
    tmp = folder / (MANIFEST + ".tune.tmp")
    tmp.write_text(json.dumps(raw, indent=1))
    os.replace(tmp, path)
    try:
        load_manifest(folder, verify_hashes=False)
    except EngineError:
        tmp.write_text(old_text)
        os.replace(tmp, path)
        raise
    return raw["defaults"]
