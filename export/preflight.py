"""Checks an export makes before any heavy work: bad input is refused in seconds, not after
minutes of conversion.

:func:`preflight` reads only metadata (a GGUF file's key/value header and tensor list, no
tensor data, through the ``gguf`` package; a Hugging Face folder's ``config.json``, ``tokenizer.json`` and safetensors
headers) and refuses, with one line saying what was wrong and what is allowed:

* an architecture outside :data:`specrt.export.arch.REGISTRY` (the one list of supported
  families, which the full check :func:`specrt.export.arch.spec_for` also uses);
* two GGUF files whose vocabularies differ: the same rule as the check on the converted
  folders (:func:`specrt.export.pipeline.check_pair`: equal token -> id maps), applied to
  the files' ``tokenizer.ggml.tokens`` before either is converted (two folders are compared
  by that check, which comes before anything heavy);
* a GGUF file and a folder whose tokenizers differ (:func:`check_gguf_folder_vocabularies`):
  the GGUF's tokens must be the folder's ``tokenizer.json`` id for id (the check on the
  converted folders' rule: the conversion keeps every GGUF token, padding included) and the
  BPE merges must be equal;
* a disk without room for what the export writes (:func:`estimate_disk`).

A GGUF header is read with the ``gguf`` package's ``GGUFReader`` (memory-mapped, nothing
dequantized). It builds a view of every element of every array, so a Qwen file's 152k
tokens and 151k merges take 15-20 s to read on 2 cores: still well before the minutes of a
conversion.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path

from specrt.runtime.errors import ExportError, PairError

__all__ = [
    "InputInfo",
    "BYTES_PER_PARAM",
    "read_input",
    "check_architectures",
    "check_gguf_vocabularies",
    "check_gguf_folder_vocabularies",
    "tokenizer_json",
    "vocab_map",
    "estimate_disk",
    "check_disk",
    "preflight",
]

# Bytes per parameter of an exported graph (weights and their external data), per flavor.
# int4: 4-bit blocks of 32 with scales, 8-bit LM head and the 8-bit layers a GGUF target
# keeps exact (measured: 2.0 GB for the real pair's 2.0e9 parameters, docs/guide/real-pair.md).
BYTES_PER_PARAM = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.5, "int4": 1.0}
GGUF_FOLDER_BYTES_PER_PARAM = 4.0  # a GGUF file is converted into a float32 folder
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass
class InputInfo:
    """What the preflight reads of one ``--draft``/``--target`` input (metadata only).

    Attributes:
        role: ``"draft"`` or ``"target"``. path: the folder or GGUF file.
        gguf: whether it is a GGUF file.
        model_type: the Hugging Face ``model_type`` it exports as (a GGUF file's
            ``general.architecture``, ``llama`` named Mistral read as ``mistral`` as
            transformers does), or None when a folder has no readable ``config.json``.
        params: parameters (elements of every weight tensor), 0 when unknown.
        tokens: a GGUF file's vocabulary, id -> token text (empty for a folder).
        merges: a GGUF file's ``tokenizer.ggml.merges`` (``"a b"`` strings, rank order), or
            None when absent or for a folder.
    """

    role: str
    path: Path
    gguf: bool
    model_type: str | None
    params: int = 0
    tokens: list[str] = field(default_factory=list)
    merges: list[str] | None = None


def describe_vocab_difference(draft: dict[str, int], target: dict[str, int], examples: int = 3) -> str:
    """One line naming how two token -> id maps differ (sizes, tokens only in one, ids that moved)."""
    only_d = sorted(set(draft) - set(target), key=draft.get)
    only_t = sorted(set(target) - set(draft), key=target.get)
    moved = sorted((t for t in set(draft) & set(target) if draft[t] != target[t]), key=target.get)

    def ex(tokens, m):
        return ", ".join(f"{t!r}={m[t]}" for t in tokens[:examples])

    parts = [f"draft has {len(draft)} tokens, target {len(target)}"]
    if only_d:
        parts.append(f"{len(only_d)} only in the draft (e.g. {ex(only_d, draft)})")
    if only_t:
        parts.append(f"{len(only_t)} only in the target (e.g. {ex(only_t, target)})")
    if moved:
        parts.append(f"{len(moved)} with different ids (e.g. {', '.join(f'{t!r}: draft {draft[t]}, target {target[t]}' for t in moved[:examples])})")
    return "; ".join(parts)


def _gguf_info(role: str, path: Path) -> InputInfo:
    from gguf import GGUFReader

    from .gguf_import import _field, is_gguf

    if not is_gguf(path):
        raise ExportError(f"--{role} {path}: a file that is not GGUF; give a Hugging Face checkpoint folder or a .gguf file")
    try:
        r = GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - the gguf package raises many kinds; one line for the user
        raise ExportError(f"--{role} {path}: the gguf package cannot read it ({type(e).__name__}: {e})") from None
    arch = str(_field(r, "general.architecture", ""))
    name = str(_field(r, "general.name", ""))
    # transformers' GGUF loader reads llama.cpp's "llama" as Mistral when the model is named so
    mtype = "mistral" if "llama" in arch and "mistral" in name.lower() else arch

    def strings(key: str) -> list[str] | None:
        # bytes decoded as the conversion's reader does, a bad byte replaced (never a traceback)
        f = r.fields.get(key)
        return None if f is None else [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]

    return InputInfo(
        role, path, True, mtype, sum(int(t.n_elements) for t in r.tensors), strings("tokenizer.ggml.tokens") or [], strings("tokenizer.ggml.merges")
    )


def _safetensors_params(path: Path) -> int:
    """Elements of every tensor of a safetensors file, from its JSON header (8-byte length + JSON)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    total = 0
    for k, v in header.items():
        if k != "__metadata__":
            count = 1
            for d in v["shape"]:
                count *= int(d)
            total += count
    return total


def _folder_info(role: str, path: Path) -> InputInfo:
    mtype = None
    cfg = path / "config.json"
    if cfg.is_file():
        try:
            mtype = json.loads(cfg.read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):
            mtype = None  # the full check (transformers' AutoConfig) says what is wrong with it
    params = 0
    for f in sorted(path.glob("*.safetensors")):
        try:
            params += _safetensors_params(f)
        except (OSError, ValueError, KeyError, struct.error):
            params += f.stat().st_size // 4  # unreadable header: count it as float32
    if params == 0:  # PyTorch .bin checkpoints (no header to read): float32 assumed
        params = sum(f.stat().st_size for f in path.glob("*.bin")) // 4
    return InputInfo(role, path, False, mtype, params)


def read_input(role: str, path: str | Path) -> InputInfo:
    """The :class:`InputInfo` of a ``--draft``/``--target`` input (metadata only; seconds
    for a multi-GB file).

    Args:
        role: ``"draft"`` or ``"target"`` (named in errors). path: a folder or a GGUF file.

    Raises:
        ExportError: a path that does not exist, or a file that is not a readable GGUF file.
    """
    p = Path(path)
    if not p.exists():
        raise ExportError(f"--{role} {p} does not exist; give a Hugging Face checkpoint folder or a .gguf file")
    return _folder_info(role, p) if p.is_dir() else _gguf_info(role, p)


def check_architectures(infos: list[InputInfo]) -> None:
    """Refuse an input whose architecture no exporter supports.

    Raises:
        UnsupportedModelError: the message names the role, the file and its architecture,
            and lists the supported ones (:data:`specrt.export.arch.REGISTRY`).
    """
    from .arch import check_model_type

    for info in infos:
        if info.model_type is not None or info.gguf:
            label = "GGUF general.architecture" if info.gguf else "config.json model_type"
            check_model_type(info.model_type, f"--{info.role} {info.path}", label)


def check_gguf_vocabularies(draft: InputInfo, target: InputInfo) -> None:
    """Refuse two GGUF files whose token -> id maps differ (the rule of
    :func:`specrt.export.pipeline.check_pair`, read from ``tokenizer.ggml.tokens``); no-op
    unless both inputs are GGUF files.

    Raises:
        PairError: the message names the sizes, tokens only in one, and ids that differ.
    """
    if not (draft.gguf and target.gguf):
        return

    d = {t: i for i, t in enumerate(draft.tokens)}
    t = {tok: i for i, tok in enumerate(target.tokens)}
    if d != t:
        raise PairError(
            f"draft {draft.path.name} and target {target.path.name} have different vocabularies ({describe_vocab_difference(d, t)}); "
            "speculative decoding needs the draft to propose ids the target understands: pick a draft trained with the target's tokenizer"
        )


def tokenizer_json(role: str, folder: Path) -> Path:
    """``folder/tokenizer.json``, the file both models' vocabularies are compared on.

    Raises:
        PairError: the folder has none.
    """
    p = Path(folder) / "tokenizer.json"
    if not p.is_file():
        raise PairError(f"{role} checkpoint {folder} has no tokenizer.json; both models need the same fast tokenizer saved beside them")
    return p


def _read_tokenizer_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PairError(f"{path} is not a readable tokenizer.json ({e})") from None


def _vocab(d: dict) -> dict[str, int]:
    vocab = dict(d.get("model", {}).get("vocab", {}))
    for t in d.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
    return vocab


def vocab_map(tokenizer_json: Path) -> dict[str, int]:
    """The token -> id map (added tokens included) of a ``tokenizer.json``.

    Raises:
        PairError: the file is not readable JSON.
    """
    return _vocab(_read_tokenizer_json(tokenizer_json))


def _label(info: InputInfo) -> str:
    """A GGUF file by its name, a folder by its path (a folder's name is often just "draft")."""
    return info.path.name if info.gguf else str(info.path)


def check_gguf_folder_vocabularies(draft: InputInfo, target: InputInfo) -> None:
    """Refuse a GGUF file and a Hugging Face folder whose tokenizers would give different
    ids; no-op unless exactly one input is a GGUF file.

    The rule is the one :func:`specrt.export.pipeline.check_pair` applies after the
    conversion (equal token -> id maps), on the GGUF's ``tokenizer.ggml.tokens`` against the
    folder's ``tokenizer.json`` (model vocabulary and added tokens), so a pair it refuses
    is refused here before minutes of conversion: the conversion keeps every GGUF token, so
    padding ids (llama.cpp pads Qwen's 151,665 ids to 151,936 as ``[PADn]``) that the
    folder lacks make the converted vocabularies differ too. Where both have BPE merges
    (``tokenizer.ggml.merges``, ``model.merges``), they must also be equal, in order (the
    same text would split into other ids).

    Raises:
        PairError: the message names the sizes, tokens only in one, ids that differ (or the
            first merge that differs); also a folder without a readable ``tokenizer.json``.
    """
    if draft.gguf == target.gguf:
        return
    g, f = (draft, target) if draft.gguf else (target, draft)
    d = _read_tokenizer_json(tokenizer_json(f.role, f.path))
    fmap, merges = _vocab(d), d.get("model", {}).get("merges")
    # tokenizers >= 0.20 writes [a, b] pairs, older ones "a b" strings (as GGUF does)
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges] if merges is not None else None
    gmap = {t: i for i, t in enumerate(g.tokens)}
    if gmap != fmap or len(gmap) != len(g.tokens):
        dm, tm = (gmap, fmap) if g is draft else (fmap, gmap)
        diff = describe_vocab_difference(dm, tm)
        if dm == tm:  # the same maps, yet the GGUF holds a token text at two ids
            diff += f"; {g.path.name} holds {len(g.tokens)} ids for {len(gmap)} token texts"
        raise PairError(
            f"draft {_label(draft)} and target {_label(target)} have different vocabularies ({diff}); "
            "speculative decoding needs the draft to propose ids the target understands: pick a draft trained with the target's tokenizer"
        )
    if g.merges is not None and merges is not None and g.merges != merges:
        dm, tm = (g.merges, merges) if g is draft else (merges, g.merges)
        r = next((i for i, (a, b) in enumerate(zip(dm, tm)) if a != b), min(len(dm), len(tm)))
        at = lambda ms: repr(ms[r]) if r < len(ms) else "none"
        raise PairError(
            f"draft {_label(draft)} and target {_label(target)} have the same tokens but different BPE merges (draft has {len(dm)} merges, "
            f"target {len(tm)}; first difference at rank {r}: draft {at(dm)}, target {at(tm)}); the same text would split into different ids: "
            "pick a draft trained with the target's tokenizer"
        )


def _size(n: float) -> str:
    """Bytes as ``"1.2 GB"`` (``"35 MB"`` below 0.1 GB, ``"12 kB"`` below 1 MB, where a GB figure would read 0.0)."""
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def _existing(path: Path) -> Path:
    """The nearest existing folder at or above ``path``."""
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p if p.is_dir() else p.parent


def estimate_disk(infos: list[InputInfo], out: str | Path, opts, gguf_folders: dict[str, Path] | None = None) -> dict[Path, dict]:
    """Bytes the export writes, per folder it writes into (the engine folder, and the
    GGUF conversion folders).

    The engine folder: each model's graph (params x :data:`BYTES_PER_PARAM` of its
    precision), plus for int8/int4 the model builder's prequantized copy (the same again,
    deleted after both models), plus with a quality record the target's fp32 reference
    graph (4 bytes/param, deleted afterwards; only for targets up to 1.5 GB of fp32
    weights, larger ones use PyTorch), plus for int8/int4 with ``opts.kernels`` each model's
    kernel panels and (a checkpoint folder's) scratch GGUF (1.07 bytes/param each: Q8_0),
    less the bytes of the files already in it (which the export replaces). A GGUF input not yet converted: its float32 folder (4
    bytes/param). Sizes are estimates (the graph's other tensors and metadata are small).

    Args:
        infos: the draft's and target's :class:`InputInfo`.
        out: the engine folder. opts: the :class:`~specrt.export.pipeline.ExportOptions`.
        gguf_folders: role -> the folder a GGUF input will be converted into, for inputs
            not converted yet (None: none).

    Returns:
        ``{folder: {"bytes": int, "parts": [str, ...]}}``, keyed by the folder named in a
        refusal (the engine folder, or a conversion folder's parent).
    """
    from .builder import BUILDER_PRECISIONS
    from .onnx_export import EXTERNAL_DATA_ABOVE

    out = Path(out)
    need: dict[Path, dict] = {}

    def add(folder: Path, n: float, what: str) -> None:
        rec = need.setdefault(folder, {"bytes": 0, "parts": []})
        rec["bytes"] += int(n)
        rec["parts"].append(f"{what} {_size(n)}")

    for info in infos:
        p = opts.precision_of(info.role)
        add(out, info.params * BYTES_PER_PARAM[p], f"{info.role} {p}")
        if p in BUILDER_PRECISIONS:
            add(out, info.params * BYTES_PER_PARAM[p], f"{info.role} prequantized copy")
        if info.role == "target" and opts.quality is not None and 4 * info.params <= EXTERNAL_DATA_ABOVE:
            add(out, 4 * info.params, "fp32 quality reference")
        if gguf_folders and info.role in gguf_folders:
            add(gguf_folders[info.role].parent, info.params * GGUF_FOLDER_BYTES_PER_PARAM, f"{info.role} float32 folder from GGUF")
        if getattr(opts, "kernels", False) and opts.precision in ("int8", "int4"):
            # kernel panels (8.5 bits a weight at most, Q8_0), and for a checkpoint folder the scratch GGUF they are packed from
            add(out, info.params * 1.07, f"{info.role} kernel panels")
            if not info.gguf:
                add(out, info.params * 1.07, f"{info.role} scratch GGUF (deleted after packing)")
    if out.is_dir() and out in need:
        need[out]["bytes"] = max(0, need[out]["bytes"] - sum(f.stat().st_size for f in out.iterdir() if f.is_file()))
    return need


def check_disk(need: dict[Path, dict]) -> list[str]:
    """Refuse when a file system has less free space than the export writes into it.

    Folders on one file system (same ``st_dev``) are added up; free space is
    ``shutil.disk_usage`` of the nearest existing folder.

    Args:
        need: :func:`estimate_disk`'s answer.

    Returns:
        One line per file system: ``"about X GB in DIR, Y GB free"``.

    Raises:
        ExportError: ``"not enough disk space: the export needs about X GB in DIR (...), Y GB free"``.
    """
    by_dev: dict[int, list[Path]] = {}
    for folder in need:
        by_dev.setdefault(os.stat(_existing(folder)).st_dev, []).append(folder)
    lines = []
    for folders in by_dev.values():
        total = sum(need[f]["bytes"] for f in folders)
        free = shutil.disk_usage(_existing(folders[0])).free
        where = " and ".join(f"{f} ({', '.join(need[f]['parts'])})" for f in folders)
        if total > free:
            raise ExportError(
                f"not enough disk space: the export needs about {_size(total)} in {where}, {_size(free)} free; "
                "free some space or write elsewhere (--out, --gguf-cache)"
            )
        lines.append(f"about {_size(total)} in {' and '.join(str(f) for f in folders)}, {_size(free)} free")
    return lines


def preflight(draft: str | Path, target: str | Path, out: str | Path, opts, log=None) -> list[InputInfo]:
    """Every check an export makes before converting or exporting anything (module
    docstring): architectures, the vocabularies of a pair with a GGUF input, disk space.

    Args:
        draft, target: the ``--draft``/``--target`` inputs (folders or GGUF files).
        out: the engine folder. opts: :class:`~specrt.export.pipeline.ExportOptions`.
        log: where the disk estimate and the free space are written (one line), or None.

    Returns:
        The two :class:`InputInfo` (draft, target).

    Raises:
        ExportError (a file that is not GGUF, not enough disk), UnsupportedModelError,
        PairError.
    """
    from .gguf_import import conversion_folder, converted

    infos = [read_input("draft", draft), read_input("target", target)]
    check_architectures(infos)
    check_gguf_vocabularies(*infos)
    check_gguf_folder_vocabularies(*infos)
    pending = {}
    for info in infos:
        if info.gguf:
            folder = conversion_folder(info.path, opts.gguf_cache)
            if not converted(info.path, folder) and folder not in pending.values():  # a self-draft converts once
                pending[info.role] = folder
    lines = check_disk(estimate_disk(infos, out, opts, pending))
    if log is not None:
        log(f"disk: the export writes {'; '.join(lines)}")
    return infos
