"""``specrt export``: a draft/target pair of local HF checkpoints -> an engine folder.

Writes ``OUT/{draft.onnx, target.onnx, tokenizer.json, manifest.json}`` (plus the lazy-head
split of the target, ``target_body.onnx`` and ``target_head.onnx``, unless ``lazy_head`` is
off, and ``<graph>.onnx.data`` weight files beside graphs exported with external data); the
manifest, which records every one of those files with its SHA-256 and size, is written
last (atomically), so a folder without one is a half-written export and the runtime
refuses it.
"""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
from dataclasses import replace
from pathlib import Path

from specrt.runtime.errors import PairError  # noqa: F401  (in the SpecRTError tree)
from specrt.runtime.manifest import FORMAT_VERSION, LAZY_HEAD_KEY, FileRecord, Manifest, sha256_file

from .onnx_export import BODY_FILE, HEAD_FILE, export_model
from .resources import PhaseMeter


def vocab_map(tokenizer_json: Path) -> dict[str, int]:
    """The token -> id map (added tokens included) of a ``tokenizer.json``.

    Raises:
        PairError: the file is not readable JSON.
    """
    try:
        d = json.loads(Path(tokenizer_json).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PairError(f"{tokenizer_json} is not a readable tokenizer.json ({e})") from None
    vocab = dict(d.get("model", {}).get("vocab", {}))
    for t in d.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
    return vocab


def vocab_hash(tokenizer_json: Path) -> str:
    """SHA-256 of the token -> id map (added tokens included) of a ``tokenizer.json``."""
    return hashlib.sha256(json.dumps(sorted(vocab_map(tokenizer_json).items())).encode()).hexdigest()


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


def check_pair(draft_dir: Path, target_dir: Path) -> Path:
    """Check both checkpoints share one tokenizer; returns the target's ``tokenizer.json``.

    Raises:
        PairError: a folder has no ``tokenizer.json``, or the two token -> id maps differ
            (the message names the sizes, tokens only in one, and ids that differ).
    """
    files = {}
    for role, d in (("draft", draft_dir), ("target", target_dir)):
        p = Path(d) / "tokenizer.json"
        if not p.is_file():
            raise PairError(f"{role} checkpoint {d} has no tokenizer.json; both models need the same fast tokenizer saved beside them")
        files[role] = p
    hd, ht = vocab_hash(files["draft"]), vocab_hash(files["target"])
    if hd != ht:
        diff = describe_vocab_difference(vocab_map(files["draft"]), vocab_map(files["target"]))
        raise PairError(
            f"draft and target tokenizers differ (vocab hash {hd[:12]} vs {ht[:12]}: {diff}); "
            "speculative decoding needs the draft to propose ids the target understands: pick a draft trained with the target's tokenizer"
        )
    return files["target"]


def _check_configs(draft_dir: Path, target_dir: Path, max_ctx: int, n_vocab: int, log) -> None:
    """Before exporting anything: both architectures/config options are supported for
    ``max_ctx``, and both logit widths cover the tokenizer (extra rows are padding, which
    the runtime never proposes). A draft whose special tokens differ from the target's is
    only reported: the target's (recorded in the manifest) are used for both.

    Raises:
        specrt.export.arch.UnsupportedModelError, PairError.
    """
    from transformers import AutoConfig

    from .arch import spec_for

    cfgs = {}
    for role, d in (("draft", draft_dir), ("target", target_dir)):
        cfg = AutoConfig.from_pretrained(str(d), local_files_only=True)
        spec_for(cfg, max_ctx)
        if cfg.vocab_size < n_vocab:
            raise PairError(
                f"{role} {d} has vocab_size={cfg.vocab_size} logits but the shared tokenizer has {n_vocab} ids; "
                "each model needs a logit row for every token id (rows beyond the tokenizer are padding)"
            )
        cfgs[role] = cfg
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        d, t = getattr(cfgs["draft"], name, None), getattr(cfgs["target"], name, None)
        if d is not None and t is not None and d != t:
            log(f"  note: draft {name}={d}, target {name}={t}; the target's is used for draft, target and baseline")


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


def _pad_id(target_dir: Path) -> int | None:
    """The target's pad token id (config first, then tokenizer), or ``None``."""
    from transformers import AutoConfig, AutoTokenizer

    pad = getattr(AutoConfig.from_pretrained(str(target_dir), local_files_only=True), "pad_token_id", None)
    if pad is None:
        pad = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True).pad_token_id
    if isinstance(pad, (list, tuple)):
        pad = pad[0] if pad else None
    return int(pad) if pad is not None else None


def export_pair(
    draft_dir: str | Path,
    target_dir: str | Path,
    out: str | Path,
    k_max: int = 8,
    max_ctx: int = 1024,
    log=print,
    tensorrt: str | None = None,
    lazy_head: bool = True,
    external_data: bool | None = None,
) -> Manifest:
    """Check the pair, export both models, check parity, and write the manifest.

    Pair rules, checked before anything is exported: one tokenizer (equal token -> id
    map hashes); each model's logit width >= the tokenizer's size (extra rows are
    padding: the runtime slices them off, so no padded id is ever proposed or chosen);
    both architectures and config options supported for ``max_ctx``. The target's
    special tokens (BOS/EOS/pad) are recorded in the manifest and used for draft, target
    and baseline alike; the tokenizer's vocab hash is recorded per model so the runtime
    can refuse a mismatched pair at load.

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
        lazy_head: also write the target split at its vocabulary projection
            (``target_body.onnx``: hidden states + new KV; ``target_head.onnx``: hidden ->
            logits), parity-checked like the full graph and recorded in
            ``manifest.extra["lazy_head"]``, for the runtime's ``lazy-head`` verification
            strategy. False removes stale ones from ``out``.
        external_data: True: every graph keeps its weights in a ``<graph>.data`` file
            beside it; None (default): only models whose float32 weights exceed 1.5 GB
            (protobuf cannot hold a graph over 2 GB); False: inline where torch allows.

    Every file written (graphs, external-data files found in the graphs' initializers,
    the tokenizer) is recorded in the manifest's ``files`` map with its SHA-256 and size;
    the export's peak RSS (per phase and overall) is logged and recorded in
    ``extra["export"]``.

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
    _check_configs(draft_dir, target_dir, max_ctx, n_vocab, log)
    v_hash = vocab_hash(tok_json)
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").unlink(missing_ok=True)  # half-written until the new one lands
    meter = PhaseMeter(log)
    log(f"exporting target {target_dir} -> {out / 'target.onnx'}")
    if not lazy_head:
        for name in (BODY_FILE, HEAD_FILE, BODY_FILE + ".data", HEAD_FILE + ".data"):
            (out / name).unlink(missing_ok=True)
    target = export_model(target_dir, out / "target.onnx", max_ctx, k_max, lazy_head=lazy_head, external_data=external_data, meter=meter)
    log(f"  parity (max |diff|): {max(target.entry.parity.values()):.2e}")
    if target.lazy_head is not None:
        log(f"  lazy-head graphs {BODY_FILE} + {HEAD_FILE}, parity (max |diff|): {max(target.lazy_head['parity'].values()):.2e}")
    log(f"exporting draft {draft_dir} -> {out / 'draft.onnx'}")
    draft = export_model(draft_dir, out / "draft.onnx", max_ctx, k_max, external_data=external_data, meter=meter)
    log(f"  parity (max |diff|): {max(draft.entry.parity.values()):.2e}")
    for e, role in ((draft.entry, "draft"), (target.entry, "target")):
        if e.vocab_size < n_vocab:
            raise PairError(f"{role} has {e.vocab_size} logits but the tokenizer has {n_vocab} ids; they must come from one tokenizer")
    shutil.copyfile(tok_json, out / "tokenizer.json")
    tok_rec = FileRecord(sha256=sha256_file(out / "tokenizer.json"), bytes=(out / "tokenizer.json").stat().st_size)
    files = {**target.files, **draft.files, "tokenizer.json": tok_rec}
    for name, rec in files.items():
        if rec.external:
            log(f"  {name}: weights in {', '.join(rec.external)} ({sum(files[x].bytes for x in rec.external) / 2**30:.2f} GiB)")
    usage = meter.summary()
    anon = f", anonymous memory {usage['peak_anon_mib']:,.0f} MiB" if usage["peak_anon_mib"] is not None else ""
    log(
        f"export peak RSS {usage['peak_rss_mib']:,.0f} MiB{anon} ({'max over phases' if usage['per_phase_peaks'] else 'process peak'}), {usage['seconds']:.0f} s"
    )
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        name=out.name,
        draft=replace(draft.entry, vocab_hash=v_hash),
        target=replace(target.entry, vocab_hash=v_hash),
        tokenizer_file="tokenizer.json",
        tokenizer_sha256=tok_rec.sha256,
        vocab_size=n_vocab,
        eos_token_id=eos,
        bos_token_id=bos,
        add_bos=add_bos,
        pad_token_id=_pad_id(target_dir),
        max_ctx=max_ctx,
        k_min=1,
        k_max=k_max,
        defaults={"k_max": min(k_max, 4), "threshold": 0.0, "strategy": "full", "chunk_bound": 0.5},
        tools={
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__,
        },
        extra={
            **({LAZY_HEAD_KEY: target.lazy_head} if target.lazy_head is not None else {}),
            "export": {"external_data": any(r.external for r in files.values()), **usage},
        },
        files=files,
    )
    if tensorrt:
        from .trt_build import tensorrt_hook

        manifest = tensorrt_hook(out, manifest, tensorrt, log)
    manifest.write(out)
    log(f"wrote {out / 'manifest.json'}")
    return manifest
