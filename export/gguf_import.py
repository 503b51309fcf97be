"""GGUF files as export input: one GGUF checkpoint -> a Hugging Face folder the export reads.

``specrt export --draft X.gguf --target Y.gguf`` accepts GGUF files (llama.cpp's format)
beside Hugging Face folders. Each file is turned into a cached Hugging Face folder by
maintained libraries, never by a parser of our own:

* architecture and config: transformers' GGUF metadata mapping
  (``AutoConfig.from_pretrained(folder, gguf_file=name)``);
* tokenizer and chat template: transformers' conversion of the GGUF vocabulary
  (``AutoTokenizer.from_pretrained(folder, gguf_file=name)``, saved as ``tokenizer.json``,
  ``tokenizer_config.json`` and ``chat_template.jinja``): the same text as a user of
  transformers gets from that file;
* weights: the ``gguf`` package's reader and dequantization (``gguf.dequantize``), named
  and un-permuted by transformers' own GGUF mapping (``get_gguf_hf_weights_map`` and the
  architecture's ``TensorProcessor``), one tensor at a time and written in safetensors
  shards (:class:`specrt.export.shards.ShardWriter`), so the conversion never holds the whole model
  (transformers' ``from_pretrained(gguf_file=...)`` dequantizes everything at once);
* end-of-generation ids (:func:`end_of_generation_ids`): every id llama.cpp ends
  generation on for this file (its EOS, EOT, EOM and FIM-separator ids and the tokens whose
  text marks an end of turn), written to ``generation_config.json`` as ``eos_token_id``
  (a list, as Qwen's own generation_config has it) so the export records them all.

The folder's weights are float32 by default: the dequantized values exactly, and a folder
PyTorch memory-maps without a copy when the export loads it in float32 for its parity check
and quality reference (a float16 folder loaded as float32 peaked at 10.5 GB RSS for
Qwen2.5-1.5B, the float32 one at the size of the file pages it touches; docs/guide/real-pair.md).
``dtype="float16"`` halves the disk (float16 rounds the values by < 2^-11 relative).
A folder is reused while the GGUF file's size, mtime and the
conversion settings are unchanged (``specrt_gguf.json`` records them and the file's SHA-256).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from specrt.runtime.errors import ExportError, UnsupportedModelError

__all__ = [
    "GGUF_MAGIC",
    "IMPORT_VERSION",
    "EOG_TEXTS",
    "GgufSummary",
    "is_gguf",
    "read_summary",
    "end_of_generation_ids",
    "import_gguf",
    "default_cache",
    "checkpoint_folder",
    "conversion_folder",
    "converted",
    "source_record",
]

GGUF_MAGIC = b"GGUF"
IMPORT_VERSION = 2  # bump when the folder written for the same file changes
STAMP = "specrt_gguf.json"
# Token texts llama.cpp ends generation on whatever the metadata says (src/llama-vocab.cpp,
# llama_vocab::impl::load, the special_eog_ids loop; llama-cpp-python 0.3.36's vendored copy)
EOG_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
)
# FIM separators llama.cpp also ends on when the vocabulary has them (same loop)
_FIM_EOG_TEXTS = ("<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<fim-pad>", "<fim-repo>", "<fim-sep>")
_DTYPES = ("float16", "bfloat16", "float32")


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic (``b"GGUF"``)."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == GGUF_MAGIC


@dataclass(frozen=True)
class GgufSummary:
    """What a GGUF file declares (metadata only; no tensor is read).

    Attributes:
        path: the file. bytes: its size.
        architecture: ``general.architecture`` (llama.cpp's name, e.g. ``qwen2``, ``llama``).
        name: ``general.name`` ("" when absent).
        tensor_types: tensors per GGML type name (``{"Q4_K": 169, "F32": 141, ...}``).
        n_vocab: tokens in ``tokenizer.ggml.tokens``.
        bos, eos, pad: the metadata's special ids (None when absent).
        eog_ids: every id generation ends on (:func:`end_of_generation_ids`), ascending.
        add_bos: ``tokenizer.ggml.add_bos_token`` (False when absent).
        chat_template: whether ``tokenizer.chat_template`` is present.
    """

    path: str
    bytes: int
    architecture: str
    name: str
    tensor_types: dict
    n_vocab: int
    bos: int | None
    eos: int | None
    pad: int | None
    eog_ids: tuple[int, ...]
    add_bos: bool
    chat_template: bool


def _field(reader, key: str, default=None):
    """A scalar or string metadata value of a GGUFReader (``default`` when absent)."""
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


def end_of_generation_ids(tokens: list[str], eos: int | None, eot: int | None = None, eom: int | None = None) -> tuple[int, ...]:
    """The ids llama.cpp ends generation on for a vocabulary (ascending).

    llama.cpp's rule (src/llama-vocab.cpp, ``special_eog_ids``): the metadata's EOS, EOT and
    EOM ids, every token whose text is one of :data:`EOG_TEXTS` (``<|im_end|>``,
    ``<|endoftext|>``, ``<|eot_id|>``, ...), and the FIM pad / repo / file separators when
    the vocabulary has them. Qwen2.5 therefore ends on ``<|endoftext|>`` 151643 and
    ``<|im_end|>`` 151645 (and its FIM separators), as its Hugging Face
    ``generation_config.json`` lists the first two.

    Args:
        tokens: the vocabulary, id -> text. eos, eot, eom: metadata ids or None.

    Returns:
        The ids, ascending, each in ``0..len(tokens)-1``.
    """
    ids = {i for i in (eos, eot, eom) if i is not None and 0 <= i < len(tokens)}
    wanted = set(EOG_TEXTS) | set(_FIM_EOG_TEXTS)
    ids.update(i for i, t in enumerate(tokens) if t in wanted)
    return tuple(sorted(ids))


def read_summary(path: str | Path) -> GgufSummary:
    """Read a GGUF file's metadata (memory-mapped; tensors are not dequantized).

    Raises:
        ExportError: the file is not a readable GGUF file (one line naming it).
    """
    from gguf import GGUFReader

    p = Path(path)
    if not is_gguf(p):
        raise ExportError(f"{p} is not a GGUF file (it does not start with the GGUF magic); give a .gguf file or a Hugging Face folder")
    try:
        r = GGUFReader(str(p))
    except Exception as e:  # noqa: BLE001 - the gguf package raises many kinds; one line for the user
        raise ExportError(f"{p}: the gguf package cannot read it ({type(e).__name__}: {e})") from None
    tok_field = r.fields.get("tokenizer.ggml.tokens")
    tokens = [bytes(tok_field.parts[i]).decode("utf-8", errors="replace") for i in tok_field.data] if tok_field is not None else []

    def ident(key):
        v = _field(r, key)
        return int(v) if v is not None else None

    eos = ident("tokenizer.ggml.eos_token_id")
    return GgufSummary(
        path=str(p),
        bytes=p.stat().st_size,
        architecture=str(_field(r, "general.architecture", "")),
        name=str(_field(r, "general.name", "")),
        tensor_types=dict(Counter(t.tensor_type.name for t in r.tensors)),
        n_vocab=len(tokens),
        bos=ident("tokenizer.ggml.bos_token_id"),
        eos=eos,
        pad=ident("tokenizer.ggml.padding_token_id"),
        eog_ids=end_of_generation_ids(tokens, eos, ident("tokenizer.ggml.eot_token_id"), ident("tokenizer.ggml.eom_token_id")),
        add_bos=bool(_field(r, "tokenizer.ggml.add_bos_token", False)),
        chat_template="tokenizer.chat_template" in r.fields,
    )


def _sha256(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def default_cache(gguf_path: str | Path) -> Path:
    """Where the Hugging Face folder of a GGUF file is cached by default: beside the file,
    ``<name>.hf/`` (the export reads it; delete it to convert again)."""
    p = Path(gguf_path)
    return p.with_name(p.name + ".hf")


def checkpoint_folder(path: str | Path, role: str, cache: str | Path | None = None, dtype: str = "float32", log=print) -> tuple[Path, dict | None]:
    """The Hugging Face folder an export reads for ``--draft``/``--target``.

    A folder is returned as it is (no record); a GGUF file is converted (cached,
    :func:`import_gguf`) into ``cache/<file name>.hf`` (``cache`` None: beside the file, or
    ``$XDG_CACHE_HOME/specrt/gguf`` when that folder is not writable).

    Returns:
        ``(folder, record)``: ``record`` (:func:`source_record`) for a GGUF file, else None.

    Raises:
        ExportError: a file that is not GGUF (one line naming the role and the file).
    """
    p = Path(path)
    if p.is_dir():
        return p, None
    if not is_gguf(p):
        raise ExportError(f"--{role} {p}: a file that is not GGUF; give a Hugging Face checkpoint folder or a .gguf file")
    folder = import_gguf(p, conversion_folder(p, cache), dtype, log)
    return folder, source_record(folder)


def conversion_folder(path: str | Path, cache: str | Path | None = None) -> Path:
    """The folder :func:`checkpoint_folder` converts the GGUF file ``path`` into:
    ``cache/<file name>.hf`` (``cache`` None: beside the file, or
    ``$XDG_CACHE_HOME/specrt/gguf`` when that folder is not writable)."""
    import os

    p = Path(path)
    if cache is None:
        cache = p.parent if os.access(p.parent, os.W_OK) else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specrt" / "gguf"
    return Path(cache) / (p.name + ".hf")


def converted(path: str | Path, folder: str | Path, dtype: str = "float32") -> bool:
    """Whether ``folder`` holds the conversion of the GGUF file ``path`` that
    :func:`import_gguf` would reuse (same size, mtime and settings)."""
    return _cached(Path(folder), _stamp(Path(path), dtype))


def source_record(folder: str | Path) -> dict:
    """What the manifest records of a converted GGUF file: ``{"file", "bytes", "sha256",
    "architecture", "name", "tensor_types", "eog_ids", "dtype", "import_version"}``
    (from the folder's ``specrt_gguf.json``)."""
    rec = json.loads((Path(folder) / STAMP).read_text())
    s = rec["summary"]
    return dict(
        file=Path(rec["source"]).name,
        bytes=rec["bytes"],
        sha256=rec["sha256"],
        architecture=s["architecture"],
        name=s["name"],
        tensor_types=s["tensor_types"],
        eog_ids=list(s["eog_ids"]),
        dtype=rec["dtype"],
        import_version=rec["version"],
    )


def _stamp(path: Path, dtype: str) -> dict:
    st = path.stat()
    return {"source": str(path.resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "dtype": dtype, "version": IMPORT_VERSION}


def _cached(out: Path, want: dict) -> bool:
    try:
        have = json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return {k: have.get(k) for k in want} == want


def import_gguf(path: str | Path, out: str | Path | None = None, dtype: str = "float32", log=print) -> Path:
    """Convert a GGUF checkpoint into a Hugging Face folder (see the module docstring).

    Args:
        path: the ``.gguf`` file (one file; split GGUFs are not supported).
        out: the folder to write (default :func:`default_cache`); reused when its
            ``specrt_gguf.json`` matches the file (size, mtime) and these settings.
        dtype: ``float32`` (default), ``float16`` or ``bfloat16`` for the weights.
        log: progress sink.

    Returns:
        The folder: ``config.json``, ``generation_config.json`` (``eos_token_id`` = every
        end-of-generation id), tokenizer files, ``chat_template.jinja`` when the file has a
        template, ``model-*.safetensors`` + index, and ``specrt_gguf.json`` (source, SHA-256,
        tensor types, seconds).

    Raises:
        ExportError: not a GGUF file, a dtype outside :data:`_DTYPES`, a tensor the
            architecture's parameters do not take, or a parameter no tensor fills.
        UnsupportedModelError: an architecture transformers cannot read from GGUF.
    """
    if dtype not in _DTYPES:
        raise ExportError(f"GGUF import dtype {dtype!r} is not allowed: one of {', '.join(_DTYPES)}")
    src = Path(path)
    summary = read_summary(src)
    out = Path(out) if out is not None else default_cache(src)
    want = _stamp(src, dtype)
    if _cached(out, want):
        log(f"  {src.name}: using the converted folder {out} (delete it to convert again)")
        return out
    t0 = time.perf_counter()
    log(
        f"  {src.name}: {summary.architecture} '{summary.name}', {summary.bytes / 2**20:,.0f} MiB, tensors {', '.join(f'{k} x{v}' for k, v in sorted(summary.tensor_types.items()))}"
    )
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = _write_config_and_tokenizer(src, summary, tmp, dtype)
    shards = _write_weights(src, config, tmp, dtype, log)
    record = dict(want, sha256=_sha256(src), summary=asdict(summary), shards=shards, seconds=round(time.perf_counter() - t0, 1))
    (tmp / STAMP).write_text(json.dumps(record, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log(f"  {src.name} -> {out} ({dtype}, {shards} shard(s), {record['seconds']:.0f} s)")
    return out


def _write_config_and_tokenizer(src: Path, summary: GgufSummary, out: Path, dtype: str):
    """config.json, generation_config.json and the tokenizer files (transformers' GGUF
    conversion); returns the config."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    try:
        config = AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name)
    except (ValueError, KeyError, NotImplementedError) as e:
        raise UnsupportedModelError(f"{src}: transformers cannot read architecture {summary.architecture!r} from GGUF ({e})") from None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config.dtype = dtype  # what the weights are stored as ("auto" loads them so)
    # tools that dispatch on it (onnxruntime-genai's builder) need the class a checkpoint names
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.save_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    tok.save_pretrained(str(out))
    gen = GenerationConfig(
        bos_token_id=summary.bos,
        eos_token_id=list(summary.eog_ids) if summary.eog_ids else summary.eos,
        pad_token_id=summary.pad,
    )
    gen.save_pretrained(str(out))
    return config


def _write_weights(src: Path, config, out: Path, dtype: str, log) -> int:
    """Dequantize tensor by tensor (gguf), name them as transformers does, write shards."""
    import numpy as np
    import torch
    from gguf import GGUFReader, dequantize
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    from .progress import Progress
    from .shards import ShardWriter

    reader = GGUFReader(str(src))
    arch = str(reader.fields["general.architecture"].contents())
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    name_map = get_gguf_hf_weights_map(skeleton, processor)
    wanted = set(skeleton.state_dict().keys())
    if getattr(config, "tie_word_embeddings", False):
        wanted.discard("lm_head.weight")
    del skeleton
    torch_dtype = getattr(torch, dtype)
    writer = ShardWriter(out)
    parsed = {"config": config.to_dict(), "tensors": {}}
    n = len(reader.tensors)
    prog = Progress(f"    {src.name}: dequantized", n, log, unit="tensors")
    for t in reader.tensors:
        res = processor.process(weights=dequantize(t.data, t.tensor_type), name=t.name, tensor_key_mapping=name_map, parsed_parameters=parsed)
        if res.name not in name_map:
            if t.name.startswith("rope_") or t.name.endswith("rope_freqs.weight"):
                continue  # recomputed from the config, as transformers does
            raise ExportError(
                f"{src}: tensor {t.name} ({t.tensor_type.name}, shape {list(t.shape)}) has no parameter in transformers' {config.model_type} model"
            )
        w = res.weights if res.weights.flags.writeable else np.array(res.weights)  # F32 tensors are views of the read-only map
        tensor = torch.from_numpy(np.ascontiguousarray(w)).to(torch_dtype)
        if dtype == "float16" and not torch.isfinite(tensor).all():
            raise ExportError(f"{src}: tensor {t.name} overflows float16; convert with dtype float32")
        writer.add(name_map[res.name], tensor)
        del w, res, tensor
        prog.advance()
    prog.done()
    missing = sorted(wanted - writer.names)
    if missing:
        raise ExportError(f"{src}: no tensor for {len(missing)} parameter(s) of the {config.model_type} model (e.g. {', '.join(missing[:3])})")
    return writer.close()


class GgufBlocks:
    """The exact MatMulNBits terms of a converted folder's linear layers, read from its GGUF
    file (:func:`specrt.export.gguf_blocks.unpack`), by Hugging Face weight name.

    Rows are reordered as transformers' conversion reorders them (Llama's q/k projections
    are stored permuted for llama.cpp's rotary layout; the architecture's
    ``TensorProcessor`` undoes it, and the same permutation is applied to the blocks' rows).

    Args:
        folder: a folder written by :func:`import_gguf` (its ``specrt_gguf.json`` names the
            source file, which must still be unchanged: same size and SHA-256).

    Calling it with a weight name (``model.layers.0.self_attn.q_proj.weight``,
    ``lm_head.weight``; the embedding table for a tied head) returns the
    :class:`~specrt.export.gguf_blocks.Blocks`, or None when the tensor's type has no exact
    form (it is then quantized as usual).

    Raises:
        ExportError: the source file is missing or changed since the conversion.
    """

    def __init__(self, folder: str | Path):
        import numpy as np
        import torch
        from gguf import GGUFReader
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

        rec = json.loads((Path(folder) / STAMP).read_text())
        src = Path(rec["source"])
        if not src.is_file() or src.stat().st_size != rec["bytes"] or _sha256(src) != rec["sha256"]:
            raise ExportError(f"{src}: the GGUF file {folder} was converted from is missing or changed; convert it again")
        self.reader = GGUFReader(str(src))
        arch = str(self.reader.fields["general.architecture"].contents())
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        self._processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
        to_hf = get_gguf_hf_weights_map(skeleton, self._processor)
        self._by_hf = {hf: name for name, hf in to_hf.items()}
        self._tensors = {t.name: t for t in self.reader.tensors}
        self._np = np

    def _row_order(self, gguf_name: str, rows: int):
        """The row permutation transformers' processor applies to this tensor (None: none)."""
        probe = self._np.arange(rows, dtype=self._np.float32)[:, None]
        res = self._processor.process(weights=probe, name=gguf_name, tensor_key_mapping={}, parsed_parameters={"config": {}, "tensors": {}})
        order = self._np.asarray(res.weights)[:, 0].astype(self._np.int64)
        return None if (order == self._np.arange(rows)).all() else order

    def __call__(self, hf_name: str):
        from .gguf_blocks import EXACT_TYPES, Blocks, unpack

        t = self._tensors.get(self._by_hf.get(hf_name, ""))
        if t is None and hf_name == "lm_head.weight":  # a tied head reads the embedding table
            t = self._tensors.get(self._by_hf.get("model.embed_tokens.weight", ""))
        if t is None or t.tensor_type.name not in EXACT_TYPES:
            return None
        b = unpack(t)
        order = self._row_order(t.name, b.q.shape[0])
        if order is not None:
            b = Blocks(b.q[order], b.scales[order], b.zeros[order], None if b.mins is None else b.mins[order], b.bits, b.group)
        return b
