"""``specrt export``: a draft/target pair of local HF checkpoints -> an engine folder.

Writes ``OUT/{draft.onnx, target.onnx, tokenizer.json, manifest.json}``; the manifest is
written last (atomically), so a folder without one is a half-written export and the
runtime refuses it.
"""
from __future__ import annotations

import hashlib
import json
import platform
import shutil
from pathlib import Path

from specrt.runtime.manifest import FORMAT_VERSION, Manifest, sha256_file

from .onnx_export import export_model


class PairError(ValueError):
    """The draft and target cannot form a pair (different tokenizers or vocabularies)."""


def vocab_hash(tokenizer_json: Path) -> str:
    """SHA-256 of the token -> id map (added tokens included) of a ``tokenizer.json``."""
    d = json.loads(Path(tokenizer_json).read_text())
    vocab = dict(d.get("model", {}).get("vocab", {}))
    for t in d.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
    return hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()


def check_pair(draft_dir: Path, target_dir: Path) -> Path:
    """Check both checkpoints share one tokenizer; returns the target's ``tokenizer.json``.

    Raises:
        PairError: a folder has no ``tokenizer.json``, or the two vocabularies differ.
    """
    files = {}
    for role, d in (("draft", draft_dir), ("target", target_dir)):
        p = Path(d) / "tokenizer.json"
        if not p.is_file():
            raise PairError(f"{role} checkpoint {d} has no tokenizer.json; both models need the same fast tokenizer saved beside them")
        files[role] = p
    hd, ht = vocab_hash(files["draft"]), vocab_hash(files["target"])
    if hd != ht:
        raise PairError(
            f"draft and target tokenizers differ (vocab hash {hd[:12]} vs {ht[:12]}); "
            "speculative decoding needs the draft to propose ids the target understands: pick a draft trained with the target's tokenizer"
        )
    return files["target"]


def _special_ids(target_dir: Path) -> tuple[int, int | None, bool, int]:
    """(eos id, bos id, whether the tokenizer prepends BOS, tokenizer vocab size)."""
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(str(target_dir), local_files_only=True)
    tok = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
    eos = cfg.eos_token_id if cfg.eos_token_id is not None else tok.eos_token_id
    if isinstance(eos, (list, tuple)):
        eos = eos[0]
    bos = cfg.bos_token_id if cfg.bos_token_id is not None else tok.bos_token_id
    if isinstance(bos, (list, tuple)):
        bos = bos[0]
    probe = tok("x").input_ids
    add_bos = bool(bos is not None and probe and probe[0] == bos)
    return int(eos), (int(bos) if bos is not None else None), add_bos, len(tok)


def export_pair(
    draft_dir: str | Path, target_dir: str | Path, out: str | Path, k_max: int = 8, max_ctx: int = 1024, log=print, tensorrt: str | None = None
) -> Manifest:
    """Export both models, check parity, and write the manifest.

    Args:
        draft_dir, target_dir: local HF checkpoint folders (config, safetensors, tokenizer).
        out: engine folder to (over)write.
        k_max: largest number of draft candidates per verification pass (1..64);
            the target is verified with q up to k_max + 1.
        max_ctx: context size (KV buffer rows), 2..max_position_embeddings.
        log: progress sink.
        tensorrt: None (default), or ``fp32``/``fp16``/``bf16``: also build TensorRT plans
            where tensorrt and a GPU are present, else log that it skipped
            (:func:`specrt.export.trt_build.tensorrt_hook`; unverified on a GPU).

    Returns:
        The written :class:`~specrt.runtime.manifest.Manifest`.

    Raises:
        PairError, specrt.export.arch.UnsupportedModelError, specrt.export.onnx_export.ParityError,
        ValueError: bad k_max/max_ctx.
    """
    import onnx
    import onnxruntime
    import torch
    import transformers

    if not 1 <= k_max <= 64:
        raise ValueError(f"k_max={k_max}; k_max must be 1..64")
    if max_ctx < 2:
        raise ValueError(f"max_ctx={max_ctx}; max_ctx must be >= 2")
    draft_dir, target_dir, out = Path(draft_dir), Path(target_dir), Path(out)
    for role, d in (("draft", draft_dir), ("target", target_dir)):
        if not (d / "config.json").is_file():
            raise ValueError(f"{role} folder {d} is not a Hugging Face checkpoint (no config.json)")
    tok_json = check_pair(draft_dir, target_dir)
    eos, bos, add_bos, n_vocab = _special_ids(target_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").unlink(missing_ok=True)  # half-written until the new one lands
    log(f"exporting target {target_dir} -> {out / 'target.onnx'}")
    target = export_model(target_dir, out / "target.onnx", max_ctx, k_max)
    log(f"  parity (max |diff|): {max(target.entry.parity.values()):.2e}")
    log(f"exporting draft {draft_dir} -> {out / 'draft.onnx'}")
    draft = export_model(draft_dir, out / "draft.onnx", max_ctx, k_max)
    log(f"  parity (max |diff|): {max(draft.entry.parity.values()):.2e}")
    for e, role in ((draft.entry, "draft"), (target.entry, "target")):
        if e.vocab_size < n_vocab:
            raise PairError(f"{role} has {e.vocab_size} logits but the tokenizer has {n_vocab} ids; they must come from one tokenizer")
    shutil.copyfile(tok_json, out / "tokenizer.json")
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        name=out.name,
        draft=draft.entry,
        target=target.entry,
        tokenizer_file="tokenizer.json",
        tokenizer_sha256=sha256_file(out / "tokenizer.json"),
        vocab_size=n_vocab,
        eos_token_id=eos,
        bos_token_id=bos,
        add_bos=add_bos,
        max_ctx=max_ctx,
        k_min=1,
        k_max=k_max,
        defaults={"k_max": min(k_max, 4), "threshold": 0.0},
        tools={
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__,
        },
    )
    if tensorrt:
        from .trt_build import tensorrt_hook

        manifest = tensorrt_hook(out, manifest, tensorrt, log)
    manifest.write(out)
    log(f"wrote {out / 'manifest.json'}")
    return manifest
