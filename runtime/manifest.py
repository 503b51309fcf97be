"""``manifest.json``: the versioned contract between ``specrt export`` and the runtime.

An engine folder holds ``manifest.json``, ``draft.onnx``, ``target.onnx`` and
``tokenizer.json``; graphs whose weights are stored beside them (``ModelEntry.data_file``,
e.g. ``target.onnx.data``) have that file too; with ``--lazy-head`` (standard graphs only)
the target split at its vocabulary projection, ``target_body.onnx`` and
``target_head.onnx``, recorded in ``extra["lazy_head"]`` (:func:`lazy_head_files`), which
read the weights of ``target.onnx.data`` (stored once). The manifest records, per model,
the graph form (:data:`GRAPH_FORMS`), its precision, the dims the runtime needs to
allocate KV buffers, the I/O names, the parity figures and the width-exactness measured at
export; plus the shared tokenizer hash, vocab size, special
tokens, maximum context, the allowed k range and the default decoding settings; and, when
the target checkpoint has one, its chat template as ``chat_template.jinja``
(``chat_template_file`` and ``chat_template_sha256``; optional fields, so older manifests
stay loadable); and (format version 2) one ``files`` map with the SHA-256 and byte size of
every file the engine needs, external-data weight files included (:class:`FileRecord`;
checked at load by :mod:`specrt.runtime.integrity`).

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

* ``kernels``: no graph. The model runs on specrt's CPU kernels from its panels file
  (``file``: ``target.panels``/``draft.panels``, described by ``extra["kernels"][role]``,
  :mod:`specrt.export.kernel_pack`); no inputs or outputs; precision ``gguf`` (the GGUF
  file's own blocks). Written by ``specrt serve|generate|bench --target X.gguf``
  (:mod:`specrt.export.gguf_engine`): such a folder runs on the ``kernels`` backend only.

Loading validates the whole manifest (:func:`load_manifest`): its structure and types
against the dataclasses below with pydantic (strict JSON types: ``"1024"`` is not an
integer), then ranges and cross-field rules; the graphs are checked against it when the
sessions are created (:func:`specrt.runtime.backends.ort.cpu_session`). Every refusal is
one line naming the field, the value and what is allowed.

Versions: 2 is written (files map); 1 (written before the files map: per-model and
tokenizer hashes only, no external data) still loads. Any other version is refused with a
message saying what to re-run.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import EngineError
from .integrity import Verification, check_present, sha256_file

__all__ = [
    "FORMAT_VERSION",
    "READABLE_VERSIONS",
    "MANIFEST",
    "KV_LAYOUT",
    "GRAPH_STANDARD",
    "GRAPH_BUILDER",
    "GRAPH_KERNELS",
    "GRAPH_FORMS",
    "KERNEL_PRECISION",
    "PRECISIONS",
    "REEXPORT_HINT",
    "sha256_file",
    "FileRecord",
    "ModelEntry",
    "Manifest",
    "LAZY_HEAD_KEY",
    "LAZY_HEAD_HINT",
    "lazy_head_files",
    "load_manifest",
    "validate_manifest",
    "check_files",
    "write_defaults",
]

FORMAT_VERSION = 2  # written by this exporter: 2 = the files map (every file, SHA-256 and size)
READABLE_VERSIONS = (1, 2)  # 1: written before the files map (no external data); still loads
MANIFEST = "manifest.json"
KV_LAYOUT = "BLHD"  # [batch=1, position, kv_head, head_dim], sequence-major (standard graphs)
GRAPH_STANDARD = "standard"  # specrt's IO-bound graph (new KV rows out), BLHD KV
GRAPH_BUILDER = "builder"  # onnxruntime-genai model builder graph (GQA, past/present shared), BNSH KV
GRAPH_KERNELS = "kernels"  # no graph: specrt's CPU kernels over the panels file (extra.kernels[role])
GRAPH_FORMS = (GRAPH_STANDARD, GRAPH_BUILDER, GRAPH_KERNELS)
PRECISIONS = ("fp32", "fp16", "bf16", "int8", "int4")  # specrt export --precision
KERNEL_PRECISION = "gguf"  # a kernels entry: the GGUF file's own blocks
REEXPORT_HINT = "re-run `specrt export --draft DRAFT_DIR --target TARGET_DIR --out {folder}` (or `make export`)"
K_LIMIT = 64  # largest k_max the exporter writes (specrt export --k-max 1..64)
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class FileRecord:
    """One file of an engine folder, as the manifest's ``files`` map records it.

    Attributes:
        sha256: hex SHA-256 (64 lowercase hex digits) of the file's bytes.
        bytes: its size in bytes.
        external: for an ONNX graph, the files its initializers read their data from
            (ONNX external data, ``TensorProto.external_data["location"]``, found at export
            by reading the graph), each itself a key of ``files``; empty otherwise.
    """

    sha256: str
    bytes: int
    external: tuple[str, ...] = ()

    @classmethod
    def of(cls, path: str | Path, external: tuple[str, ...] = ()) -> "FileRecord":
        """The record of the file at ``path`` as it is now (its SHA-256 and size)."""
        p = Path(path)
        return cls(sha256=sha256_file(p), bytes=p.stat().st_size, external=external)


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

    Schema: this dataclass is the schema of a model entry (:func:`validate_manifest` checks
    a manifest's ``"draft"``/``"target"`` objects against these annotations with pydantic,
    strict JSON types). A field added here with a default is an optional field of the
    schema, type-checked from its annotation, and manifests without it still load; keys
    that no field declares are ignored (a newer exporter's optional fields do not break
    an older runtime).
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
        declaration per form; see the module docstring; none for ``kernels``)."""
        if graph == GRAPH_KERNELS:
            return (), ()
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
    """The parsed ``manifest.json`` of an engine folder (see module docstring).

    Like :class:`ModelEntry`, this dataclass is the schema of the top-level object (types
    checked by pydantic at load; keys no field declares are ignored).
    """

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
    # every id generation ends on (the checkpoint's generation_config / GGUF end-of-generation
    # ids; eos_token_id among them); empty in engines exported before it: eos_token_id alone
    eos_token_ids: tuple[int, ...] = ()

    def stop_ids(self) -> frozenset:
        """The ids that end a generation (draft, target and baseline alike):
        ``eos_token_ids`` and ``eos_token_id``."""
        return frozenset((self.eos_token_id, *self.eos_token_ids))

    def kernels_only(self) -> bool:
        """Whether the folder has no graphs: both models on specrt's kernels only
        (:data:`GRAPH_KERNELS`)."""
        return self.target.graph == GRAPH_KERNELS

    def min_q(self) -> int:
        """Narrowest target call the decode loop may make: the target's measured
        ``exact_min_q`` (1 when none was measured or no width is bit-identical)."""
        return max(1, self.target.exact_min_q or 1)

    def layout_avoid(self, widest: int) -> frozenset | None:
        """Call widths a prefill must not make for any-layout prefix reuse
        (:mod:`specrt.runtime.prefix`, "Any layout"): the target's measured inexact wide
        widths (``exactness["wide"]``, :func:`specrt.runtime.lab.exactness.measure_wide`);
        None when that was not measured up to ``widest`` (the prefill's widest call, capped
        by the context) right above the decode loop's widths, or when ``widest`` itself is
        inexact (aligned records hold rows of ``widest``-row calls): reuse then keeps whole
        aligned calls."""
        wide = self.target.exactness.get("wide") if self.target.exact_min_q else None
        if not wide:
            return None
        top = min(widest, self.max_ctx)
        bad = frozenset(int(q) for q in wide.get("inexact", ()))
        if wide.get("lo", 0) > self.k_max + 2 or wide.get("hi", 0) < top or top in bad:
            return None
        return bad

    def reuse_step(self, widest: int) -> int:
        """The granularity of reusable target KV rows, for cutting prefix records to a budget
        and routing requests: 1 under any layout (:meth:`layout_avoid`: a record's rows of
        any count are reusable, :mod:`specrt.runtime.prefix`), else ``widest`` (the
        prefill's widest call: whole aligned calls)."""
        return 1 if self.layout_avoid(widest) is not None else widest

    files: dict[str, FileRecord] = field(default_factory=dict)  # every file of the engine (format 2; empty in format 1)

    def load_files(self) -> dict[str, str]:
        """File name -> expected SHA-256 of the files an Engine load opens: both graphs,
        the external-data files they reference, the tokenizer and the chat template when
        there is one (format 1: the recorded hashes of the graphs, their ``data_file``
        and the tokenizer)."""
        if not self.files:
            out = {**self.draft.files(), **self.target.files(), self.tokenizer_file: self.tokenizer_sha256}
        else:
            out = self.files_with_external(self.draft.file, self.target.file, self.tokenizer_file)
        if self.chat_template_file is not None and self.chat_template_sha256 is not None:
            out[self.chat_template_file] = self.chat_template_sha256
        return out

    def files_with_external(self, *names: str) -> dict[str, str]:
        """Name -> SHA-256 of ``names`` and the external-data files they reference, from
        the ``files`` map (format 2; validated to hold every one of them)."""
        out: dict[str, str] = {}
        for name in names:
            rec = self.files[name]
            out[name] = rec.sha256
            for ext in rec.external:
                out[ext] = self.files[ext].sha256
        return out

    def to_json(self) -> str:
        """The manifest as indented JSON text (the dataclass fields, in order)."""
        return json.dumps(asdict(self), indent=1, sort_keys=False)

    def write(self, folder: Path) -> Path:
        """Write ``folder/manifest.json`` atomically (temp file + rename); returns its path."""
        from .fileio import write_text

        return write_text(Path(folder) / MANIFEST, self.to_json())


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
    The record's structure was validated at load (:func:`validate_manifest`); the files are
    hashed here, when first used, with the external-data files they reference (format 2),
    since an Engine load does not open them.

    Raises:
        EngineError: no record (:data:`LAZY_HEAD_HINT`), a file missing, or
            (``verify_hashes``) a file whose SHA-256 differs from the record.
    """
    folder = Path(folder)
    rec = manifest.extra.get(LAZY_HEAD_KEY)
    if rec is None:
        raise EngineError(LAZY_HEAD_HINT.format(folder=folder))
    hint = REEXPORT_HINT.format(folder=folder)
    parts = (dict(rec["body"]), dict(rec["head"]))
    digests = manifest.files_with_external(*(p["file"] for p in parts)) if manifest.files else {p["file"]: p["sha256"] for p in parts}
    check_files(manifest, folder, digests, verify_hashes, hint)
    if verify_hashes:
        Verification(folder, digests, hint).wait()
    return parts


def check_files(manifest: Manifest, folder: str | Path, names, sizes: bool, hint: str) -> None:
    """Each file of ``names`` exists in ``folder``, and (``sizes``, format 2) has the byte
    size the ``files`` map records: one ``stat`` each, so a truncated or extended file is
    refused before anything reads it.

    Raises:
        EngineError: (param ``files``) the first file missing or of another size.
    """
    check_present(Path(folder), {n: (manifest.files.get(n) if sizes else None) for n in names}, hint)


# ---- validation -------------------------------------------------------------------------
_ADAPTERS: dict[type, Any] = {}


def _adapter(cls: type):
    """pydantic ``TypeAdapter`` of a dataclass (built once; importing pydantic is deferred
    to the first load)."""
    if cls not in _ADAPTERS:
        from pydantic import TypeAdapter

        _ADAPTERS[cls] = TypeAdapter(cls)
    return _ADAPTERS[cls]


def _show(value: Any, limit: int = 80) -> str:
    """A JSON rendering of ``value`` for a one-line message, cut at ``limit`` characters."""
    try:
        s = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        s = repr(value)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _loc(parts) -> str:
    """A field path: ``draft.n_layers``, ``files["target.onnx"].bytes``."""
    out = ""
    for p in parts:
        if isinstance(p, int) or (isinstance(p, str) and not p.isidentifier()):
            out += f"[{_show(p)}]"
        else:
            out += ("." if out else "") + str(p)
    return out or "(top level)"


def _declared(loc: tuple) -> str | None:
    """The annotation (as written) of the schema field at ``loc``: a top-level field, a
    model entry's, or a file record's; None for anything deeper."""
    cls, name = Manifest, (loc[0] if loc else None)
    if len(loc) == 2 and loc[0] in ("draft", "target"):
        cls, name = ModelEntry, loc[1]
    elif len(loc) == 3 and loc[0] == "files":
        cls, name = FileRecord, loc[2]
    elif len(loc) != 1:
        return None
    f = cls.__dataclass_fields__.get(name) if isinstance(name, str) else None
    return None if f is None else str(f.type)


def _allowed(err: dict) -> str:
    """What a field allows, for one pydantic error record (types of the dataclass schema)."""
    kind = err["type"]
    loc = tuple(err["loc"])
    if kind == "missing":
        t = _declared(loc)
        return f"required: {t}" if t else "required"
    if kind == "int_type" and "None" in (_declared(loc) or ""):
        return "an integer or null"
    if kind == "dataclass_type":
        cls = err.get("ctx", {}).get("class_name", "")
        fields_of = {"ModelEntry": ModelEntry, "FileRecord": FileRecord}.get(cls)
        names = ", ".join(f.name for f in fields_of.__dataclass_fields__.values()) if fields_of else ""
        return f"an object ({cls}: {names})" if names else "an object"
    return {
        "int_type": "an integer",
        "float_type": "a number",
        "string_type": "a string",
        "bool_type": "true or false",
        "dict_type": "an object",
        "list_type": "a list",
        "tuple_type": "a list",
    }.get(kind, err["msg"])


def _field_error(path: Path, loc: str, value: Any, allowed: str, hint: str, missing: bool = False, more: str = "") -> EngineError:
    """The one-line error for field ``loc``: its value (or that it is missing), what is
    allowed, ``more`` (how many other problems there are), what to re-run."""
    what = f"field {loc} is missing ({allowed}){more}" if missing else f"field {loc} = {_show(value)} is not allowed: {allowed}{more}"
    return EngineError(f"{path}: {what}; {hint}", loc)


def _schema_error(path: Path, e, hint: str) -> EngineError:
    """One line for a pydantic ``ValidationError``: the first problem (field, value, what is
    allowed) and how many more there are."""
    errs = e.errors(include_url=False)
    first = errs[0]
    more = f" ({len(errs) - 1} more problem{'s' if len(errs) > 2 else ''} after this one)" if len(errs) > 1 else ""
    return _field_error(path, _loc(first["loc"]), first.get("input"), _allowed(first), hint, first["type"] == "missing", more)


def _check_entry(role: str, e: ModelEntry, k_max: int, bad) -> None:
    """The value checks of one model entry (:func:`validate_manifest`); ``bad(loc, value,
    allowed)`` makes the EngineError raised."""
    for name in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden", "vocab_size"):
        if getattr(e, name) < 1:
            raise bad(f"{role}.{name}", getattr(e, name), "an integer >= 1")
    for name in ("params", "matmul_params"):
        if getattr(e, name) < 0:
            raise bad(f"{role}.{name}", getattr(e, name), "an integer >= 0")
    if not e.file or not _inside(e.file):
        raise bad(f"{role}.file", e.file, "a file name inside the engine folder")
    if not _HEX64.match(e.sha256):
        raise bad(f"{role}.sha256", e.sha256, "64 lowercase hex digits")
    if e.graph not in GRAPH_FORMS:
        raise bad(f"{role}.graph", e.graph, f"one of {', '.join(GRAPH_FORMS)} (a newer specrt wrote this engine, or it was edited)")
    if e.graph == GRAPH_KERNELS:
        if e.precision != KERNEL_PRECISION:
            raise bad(f"{role}.precision", e.precision, f'"{KERNEL_PRECISION}" for a kernels entry')
    elif e.precision not in PRECISIONS:
        raise bad(f"{role}.precision", e.precision, f"one of {', '.join(PRECISIONS)}")
    if e.data_file and not _inside(e.data_file):
        raise bad(f"{role}.data_file", e.data_file, "a file name inside the engine folder")
    if e.exact_min_q is not None and not 1 <= e.exact_min_q <= k_max + 1:
        raise bad(f"{role}.exact_min_q", e.exact_min_q, f"null or an integer in 1..k_max+1 = {k_max + 1}")
    ins, outs = ModelEntry.io_names(e.n_layers, e.graph)
    if e.graph == GRAPH_KERNELS:
        want_in = want_out = "none (a kernels entry has no graph)"
    elif e.graph == GRAPH_BUILDER:
        want_in = f"input_ids, attention_mask, past_key_values.i.key/value for i in 0..{e.n_layers - 1}"
        want_out = f"logits, present.i.key/value for i in 0..{e.n_layers - 1}"
    else:
        want_in = f"input_ids, position_ids, past_key_i, past_value_i for i in 0..{e.n_layers - 1}"
        want_out = f"logits, new_key_i, new_value_i for i in 0..{e.n_layers - 1}"
    # names, not order: the runtime binds by name (the model builder lists keys before values)
    if sorted(e.inputs) != sorted(ins) or len(set(e.inputs)) != len(e.inputs):
        raise bad(f"{role}.inputs", list(e.inputs), f"the inputs of a {e.graph} graph of n_layers={e.n_layers} layers: {want_in}")
    if sorted(e.outputs) != sorted(outs) or len(set(e.outputs)) != len(e.outputs):
        raise bad(f"{role}.outputs", list(e.outputs), f"the outputs of a {e.graph} graph of n_layers={e.n_layers} layers: {want_out}")


def _check_kernel_entries(m: Manifest, bad) -> None:
    """A ``kernels`` entry has its panels' record (``extra.kernels[role]`` naming its file),
    and the draft is one when the target is (a kernels folder runs both on the kernels)."""
    kernels = m.extra.get("kernels") if isinstance(m.extra.get("kernels"), dict) else {}
    for role, e in (("draft", m.draft), ("target", m.target)):
        rec = kernels.get(role)
        if e.graph == GRAPH_KERNELS and (not isinstance(rec, dict) or rec.get("file") != e.file):
            where = rec.get("file") if isinstance(rec, dict) else rec
            raise bad(f"extra.kernels.{role}", where, f"the kernels record of the {role}'s panels file {e.file!r} (its graph is kernels)")
    if (m.target.graph == GRAPH_KERNELS) != (m.draft.graph == GRAPH_KERNELS):
        raise bad("draft.graph", m.draft.graph, f"the {m.target.graph} graph form, as the target's (a kernels folder runs both models on the kernels)")


def _check_tokens(m: Manifest, bad, path: Path, hint: str) -> None:
    """The tokenizer checks of :func:`validate_manifest`: vocab sizes and hashes of the
    pair, and every special token id inside the vocabulary."""
    if m.vocab_size < 1:
        raise bad("vocab_size", m.vocab_size, "an integer >= 1")
    if m.draft.vocab_size < m.vocab_size or m.target.vocab_size < m.vocab_size:
        raise EngineError(
            f"{path}: vocab sizes differ (draft {m.draft.vocab_size}, target {m.target.vocab_size}, tokenizer {m.vocab_size}); "
            "the draft and the target must share one tokenizer; export a matching pair",
            "vocab_size",
        )
    if m.draft.vocab_hash and m.target.vocab_hash and m.draft.vocab_hash != m.target.vocab_hash:
        raise EngineError(
            f"{path}: the draft and the target come from different tokenizers (vocab hash {m.draft.vocab_hash[:12]} "
            f"vs {m.target.vocab_hash[:12]}); speculative decoding needs the draft to propose ids the target understands. "
            f"Re-export the pair together from checkpoints that share the target's tokenizer: {hint}",
            "vocab_hash",
        )
    for name in ("eos_token_id", "bos_token_id"):
        v = getattr(m, name)
        if v is not None and not 0 <= v < m.vocab_size:
            raise bad(name, v, f"a token id in 0..{m.vocab_size - 1}" + (" or null" if name == "bos_token_id" else ""))
    for i, v in enumerate(m.eos_token_ids):
        if not 0 <= v < m.vocab_size:
            raise bad(f"eos_token_ids[{i}]", v, f"a token id in 0..{m.vocab_size - 1}")
    if m.pad_token_id is not None and not 0 <= m.pad_token_id < m.target.vocab_size:
        raise bad("pad_token_id", m.pad_token_id, f"a token id in 0..{m.target.vocab_size - 1} or null")


def validate_manifest(raw: dict, folder: str | Path) -> Manifest:
    """The :class:`Manifest` of a parsed ``manifest.json`` object, validated whole.

    Structure and types: the dataclasses :class:`Manifest`, :class:`ModelEntry` and
    :class:`FileRecord` are the schema, checked by pydantic v2 in strict JSON mode (an
    integer field takes a JSON integer, not ``"1024"`` or ``1.0``; an object field an
    object, not ``"draft.onnx"``; unknown keys are ignored). Then the values:

    * ``format_version`` in :data:`READABLE_VERSIONS`; ``kv_layout``/``kv_dtype``
      ``BLHD``/``float32``;
    * per model: ``n_layers``, ``n_heads``, ``n_kv_heads``, ``head_dim``, ``hidden``,
      ``vocab_size`` >= 1; ``sha256`` 64 hex digits; ``inputs``/``outputs`` the names of
      the interface of ``n_layers`` layers of the entry's graph form, in any order
      (:meth:`ModelEntry.io_names`); ``graph``, ``precision`` known; ``exact_min_q`` null or
      1..k_max+1;
    * ``vocab_size`` (the tokenizer's) 1..each model's logits width, equal tokenizer
      vocab hashes; ``eos_token_id``, every ``eos_token_ids`` entry, ``bos_token_id`` in
      0..vocab_size-1, ``pad_token_id``
      below the target's logits width;
    * ``max_ctx`` >= 2; ``1 <= k_min <= k_max <= min(64, max_ctx - 1)``;
    * ``defaults`` an object (its values are checked, one line naming the key, when a
      generation config is resolved against them: a request can still override a stale
      default; :func:`specrt.runtime.config.resolve_config`);
    * ``files`` (format 2): names inside the folder; it lists both graphs, the tokenizer,
      the lazy-head graphs when recorded, and every external-data file a graph
      references; each recorded hash equals the model entry's / tokenizer's copy of it;
    * ``extra["lazy_head"]`` (when present): body/head records with a file, a SHA-256 and
      the body/head interfaces.

    The graphs themselves are checked against the entries when their sessions are created
    (I/O names, KV dims, logits width: :func:`specrt.runtime.backends.ort.cpu_session`).

    Args:
        raw: the parsed JSON object. folder: the engine folder (for messages).

    Returns:
        the :class:`Manifest`.

    Raises:
        EngineError: one line naming the field (``param``), the value and what is allowed,
            and what to re-run.
    """
    folder = Path(folder)
    path = folder / MANIFEST
    hint = REEXPORT_HINT.format(folder=folder)
    ver = raw.get("format_version")
    if type(ver) is not int or ver not in READABLE_VERSIONS:
        raise EngineError(
            f"{path}: format_version={ver!r}, this runtime understands {' and '.join(map(str, READABLE_VERSIONS))}; {hint} with this version of specrt",
            "format_version",
        )
    from pydantic import ValidationError

    try:
        manifest = _adapter(Manifest).validate_json(json.dumps(raw), strict=True)
    except ValidationError as e:
        raise _schema_error(path, e, hint) from None

    def bad(loc: str, value: Any, allowed: str) -> EngineError:
        return _field_error(path, loc, value, allowed, hint)

    for role, e in (("draft", manifest.draft), ("target", manifest.target)):
        _check_entry(role, e, manifest.k_max, bad)
    _check_kernel_entries(manifest, bad)
    if manifest.kv_layout != KV_LAYOUT:
        raise bad("kv_layout", manifest.kv_layout, f'"{KV_LAYOUT}"')
    if manifest.kv_dtype != "float32":
        raise bad("kv_dtype", manifest.kv_dtype, '"float32"')
    _check_tokens(manifest, bad, path, hint)
    if manifest.max_ctx < 2:
        raise bad("max_ctx", manifest.max_ctx, "an integer >= 2")
    k_top = min(K_LIMIT, manifest.max_ctx - 1)
    if not 1 <= manifest.k_min <= k_top:
        raise bad("k_min", manifest.k_min, f"an integer in 1..{k_top} (and <= k_max)")
    if not manifest.k_min <= manifest.k_max <= k_top:
        raise bad("k_max", manifest.k_max, f"an integer in k_min={manifest.k_min}..{k_top} (at most 64 and max_ctx - 1 = {manifest.max_ctx - 1})")
    lazy = _check_lazy_head(manifest, bad)
    if ver >= 2:
        _check_files(manifest, lazy, bad, path, hint)
    return manifest


def _inside(name: str) -> bool:
    """Whether ``name`` is a relative path that stays inside the engine folder."""
    p = Path(name)
    return bool(name) and not p.is_absolute() and ".." not in p.parts and "\\" not in name


def _check_lazy_head(m: Manifest, bad) -> list[str]:
    """Validate ``extra["lazy_head"]`` when present; returns its two file names ([] if absent)."""
    rec = m.extra.get(LAZY_HEAD_KEY)
    if rec is None:
        return []
    if not isinstance(rec, dict):
        raise bad(f"extra.{LAZY_HEAD_KEY}", rec, "an object with body and head records")
    ins, outs = ModelEntry.io_names(m.target.n_layers)
    want = {"body": (list(ins), ["hidden", *outs[1:]]), "head": (["hidden"], ["logits"])}
    names = []
    for part, (w_in, w_out) in want.items():
        loc = f"extra.{LAZY_HEAD_KEY}.{part}"
        r = rec.get(part)
        if not isinstance(r, dict):
            raise bad(loc, r, "an object with file, sha256, inputs, outputs")
        if not isinstance(r.get("file"), str) or not _inside(r["file"]):
            raise bad(f"{loc}.file", r.get("file"), "a file name inside the engine folder")
        if not isinstance(r.get("sha256"), str) or not _HEX64.match(r["sha256"]):
            raise bad(f"{loc}.sha256", r.get("sha256"), "64 lowercase hex digits")
        if r.get("inputs") != w_in:
            raise bad(f"{loc}.inputs", r.get("inputs"), f"the {part} interface of the target ({_show(w_in, 60)})")
        if r.get("outputs") != w_out:
            raise bad(f"{loc}.outputs", r.get("outputs"), f"the {part} interface of the target ({_show(w_out, 60)})")
        names.append(r["file"])
    return names


def _check_files(m: Manifest, lazy: list[str], bad, path: Path, hint: str) -> None:
    """Format 2: the ``files`` map lists every file and agrees with the other records."""
    if not m.files:
        raise bad("files", {}, "an object listing every file of the engine (format_version 2)")
    for name, rec in m.files.items():
        loc = f"files[{_show(name)}]"
        if not _inside(name):
            raise bad(loc, name, "a file name inside the engine folder")
        if not _HEX64.match(rec.sha256):
            raise bad(f"{loc}.sha256", rec.sha256, "64 lowercase hex digits")
        if rec.bytes < 0:
            raise bad(f"{loc}.bytes", rec.bytes, "an integer >= 0")
        for ext in rec.external:
            if ext not in m.files:
                raise bad(f"{loc}.external", list(rec.external), f"names of files listed in files ({ext!r} is not)")
    copies = {
        m.draft.file: ("draft.sha256", m.draft.sha256),
        m.target.file: ("target.sha256", m.target.sha256),
        m.tokenizer_file: ("tokenizer_sha256", m.tokenizer_sha256),
    }
    for part, name in zip(("body", "head"), lazy):
        copies[name] = (f"extra.{LAZY_HEAD_KEY}.{part}.sha256", m.extra[LAZY_HEAD_KEY][part]["sha256"])
    for role, e in (("draft", m.draft), ("target", m.target)):
        if e.data_file:
            copies[e.data_file] = (f"{role}.data_sha256", e.data_sha256)
    if m.chat_template_file is not None:
        if not m.chat_template_sha256:
            raise bad("chat_template_sha256", m.chat_template_sha256, "the SHA-256 of chat_template_file (64 lowercase hex digits)")
        copies[m.chat_template_file] = ("chat_template_sha256", m.chat_template_sha256)
    for name, (loc, digest) in copies.items():
        if name not in m.files:
            raise bad("files", sorted(m.files), f"a record for every file of the engine ({name!r} is missing)")
        if m.files[name].sha256 != digest:
            raise EngineError(
                f"{path}: {loc} ({digest[:12]}) differs from files[{_show(name)}].sha256 ({m.files[name].sha256[:12]}): the manifest was edited; {hint}",
                loc,
            )


def load_manifest(folder: str | Path, verify_hashes: bool = True) -> Manifest:
    """Read and validate ``folder/manifest.json`` (:func:`validate_manifest`), and check the
    files it lists.

    The files an Engine load opens (:meth:`Manifest.load_files`: both graphs, the
    external-data files they reference, the tokenizer) must exist; with ``verify_hashes``
    they must also have their recorded sizes (format 2) and SHA-256 (hashed on worker
    threads unless the file's identity was verified before, see
    :mod:`specrt.runtime.integrity`). An :class:`Engine` passes False here and runs the
    same checks itself before creating its sessions. The lazy-head graphs, optional until used,
    are checked the same way when first loaded (:func:`lazy_head_files`).

    Args:
        folder: the engine folder.
        verify_hashes: also check the sizes and recompute the SHA-256 of those files
            (False: presence only, the contents are trusted).

    Returns:
        The :class:`Manifest`.

    Raises:
        EngineError: folder or manifest missing, JSON unreadable, unknown
            ``format_version``, a field of the wrong type or out of range (one line naming
            the field, the value and what is allowed), a mismatched pair, or a file
            missing, of the wrong size or (``verify_hashes``) of the wrong hash (the chat
            template included, when the manifest records one).
    """
    folder = Path(folder)
    hint = REEXPORT_HINT.format(folder=folder)
    if folder.exists() and not folder.is_dir():
        raise EngineError(f"engine folder {folder} is a file, not a folder: give the folder that holds manifest.json", "engines")
    if not folder.is_dir():
        raise EngineError(f"engine folder {folder} does not exist; {hint}")
    path = folder / MANIFEST
    if not path.is_file():
        raise EngineError(f"{path} is missing (the export did not finish or this is not an engine folder); {hint}")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EngineError(f"{path} is not readable JSON ({e}); {hint}") from None
    if not isinstance(raw, dict):
        raise EngineError(f"{path} is not a JSON object; {hint}")
    manifest = validate_manifest(raw, folder)
    check_files(manifest, folder, manifest.load_files(), verify_hashes, hint)
    if verify_hashes:
        Verification(folder, manifest.load_files(), hint).wait()
    return manifest


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
