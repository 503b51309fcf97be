"""``specrt export``: a draft/target pair of local HF checkpoints -> an engine folder.

Writes ``OUT/{draft.onnx, target.onnx, tokenizer.json, manifest.json}`` in the flavor asked
for (``precision``: standard fp32/fp16/bf16 graphs, or int8/int4 onnxruntime-genai builder
graphs with their weights in ``<role>.onnx.data``), plus, with ``lazy_head``, the split of the
fp32 target at its vocabulary projection (``target_body.onnx`` and ``target_head.onnx``,
sharing ``target.onnx.data`` with ``target.onnx``). The target's width exactness is measured
on the written graph. Graphs exported with external data (``--external-data``, automatic
above 1.5 GB of fp32 weights) have ``<graph>.onnx.data`` beside them. The manifest, which
records every file with its SHA-256 and size (the ``files`` map), is written last (atomically), so a folder without one is
a half-written export and the runtime refuses it. A chat template of the target checkpoint
is copied as ``chat_template.jinja``.
"""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from specrt.runtime.errors import ExportError, PairError  # noqa: F401  (in the SpecRTError tree)
from specrt.runtime.manifest import FORMAT_VERSION, LAZY_HEAD_KEY, FileRecord, Manifest

from .onnx_export import BODY_FILE, HEAD_FILE, export_model
from .preflight import describe_vocab_difference, tokenizer_json, vocab_map
from .resources import PhaseMeter
from .tokenizer_check import check_tokenizer


def vocab_hash(tokenizer_json: Path) -> str:
    """SHA-256 of the token -> id map (added tokens included) of a ``tokenizer.json``."""
    return hashlib.sha256(json.dumps(sorted(vocab_map(tokenizer_json).items())).encode()).hexdigest()


def check_pair(draft_dir: Path, target_dir: Path) -> Path:
    """Check both checkpoints share one tokenizer; returns the target's ``tokenizer.json``.

    Raises:
        PairError: a folder has no ``tokenizer.json``, or the two token -> id maps differ
            (the message names the sizes, tokens only in one, and ids that differ).
    """
    files = {role: tokenizer_json(role, d) for role, d in (("draft", draft_dir), ("target", target_dir))}
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


def checkpoint_end_ids(target_dir: Path, eos: int) -> tuple[int, ...]:
    """Every id the checkpoint declares it ends generation on, ascending: ``eos`` (the
    config's), and ``eos_token_id`` of ``generation_config.json`` (an int or a list: Qwen2.5
    lists ``<|im_end|>`` and ``<|endoftext|>``). Read, never derived: the one rule that
    derives end ids is llama.cpp's, applied by a GGUF import, which writes its ids there
    (:func:`specrt.export.gguf_import.end_of_generation_ids`)."""
    ids = {int(eos)}
    path = Path(target_dir) / "generation_config.json"
    if path.is_file():
        try:
            gen = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError) as e:
            raise PairError(f"{path} is not a readable JSON object ({e})") from None
        ids.update(int(i) for i in (gen if isinstance(gen, list) else [gen]) if isinstance(i, int))
    return tuple(sorted(ids))


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


CHAT_TEMPLATE_FILE = "chat_template.jinja"


def find_chat_template(checkpoint: str | Path) -> str | None:
    """The chat template of a Hugging Face checkpoint folder, as transformers finds it.

    ``chat_template.jinja`` beside the weights wins (transformers >= 4.43 saves templates
    there); else ``tokenizer_config.json``'s ``chat_template``: a string, or a list of
    ``{"name", "template"}`` of which the one named ``"default"`` is taken (as
    ``apply_chat_template`` does without a name).

    Returns:
        the template text, or None when the checkpoint has none.

    Raises:
        PairError: ``tokenizer_config.json`` is unreadable, or its ``chat_template`` is
            neither a string nor a list of named templates with a ``"default"``.
    """
    d = Path(checkpoint)
    jinja = d / CHAT_TEMPLATE_FILE
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    cfg = d / "tokenizer_config.json"
    if not cfg.is_file():
        return None
    try:
        tpl = json.loads(cfg.read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError, AttributeError) as e:
        raise PairError(f"{cfg} is not a readable JSON object ({e})") from None
    if tpl is None or isinstance(tpl, str):
        return tpl
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise PairError(f"{cfg}: chat_template must be a string or a list of {{name, template}} with a 'default' one; got {type(tpl).__name__}")


def _pad_id(target_dir: Path) -> int | None:
    """The target's pad token id (config first, then tokenizer), or ``None``."""
    from transformers import AutoConfig, AutoTokenizer

    pad = getattr(AutoConfig.from_pretrained(str(target_dir), local_files_only=True), "pad_token_id", None)
    if pad is None:
        pad = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True).pad_token_id
    if isinstance(pad, (list, tuple)):
        pad = pad[0] if pad else None
    return int(pad) if pad is not None else None


def _model_type(model_dir: Path) -> str:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir), local_files_only=True).model_type


def _export_model(role: str, model_dir: Path, out: Path, precision: str, quant, max_ctx: int, k_max: int, lazy_head: bool, log, external_data=None, meter=None):
    """One model of the pair in the requested flavor: ``(entry, lazy_head record or None,
    files)`` where ``files`` maps every file written for it (graphs, external data) to its
    :class:`~specrt.runtime.manifest.FileRecord` (builder graph for int8/int4 where the
    builder covers the architecture, else the standard graph)."""
    from .builder import BUILDER_PRECISIONS, build_model, builder_supports
    from .kv_model import KVExportModel
    from .onnx_export import file_records, load_hf, matmul_params, runtime_parity

    path = out / f"{role}.onnx"
    if precision in BUILDER_PRECISIONS:
        mtype = _model_type(model_dir)
        if builder_supports(mtype):
            entry = build_model(model_dir, out, role, quant, max_ctx, out / ".builder_cache", log, meter)
            if meter is not None:
                meter.phase(f"{role}: parity against PyTorch")
            held = [load_hf(model_dir)]
            counts = dict(params=sum(p.numel() for p in held[0].parameters()), matmul_params=matmul_params(KVExportModel(held[0], max_ctx)))
            # PyTorch's answers first, then the model is freed before the graph's session loads
            parity = runtime_parity(held[0], out, entry, max_ctx, qs=(1, k_max + 1), pasts=(0, 37), release=held.clear, log=log)
            entry = replace(entry, **counts, parity=parity)
            log(
                f"  {precision} vs the fp32 PyTorch model (quantization, max |logit diff|): {max(v for k, v in parity.items() if k.startswith('logits_q')):.3g}, row correlation {parity['logits_correlation']:.3f}"
            )
            if meter is not None:
                meter.phase(None)
            return entry, None, file_records(out, [path.name])
        note = f"{mtype}: onnxruntime-genai's model builder has no {mtype} models; kept specrt's standard fp32 graph in this {precision} export"
        log(f"  note: {note}")
        exported = export_model(model_dir, path, max_ctx, k_max, external_data=external_data, meter=meter)
        return replace(exported.entry, note=note), None, exported.files
    exported = export_model(model_dir, path, max_ctx, k_max, lazy_head=lazy_head, precision=precision, external_data=external_data, meter=meter)
    return exported.entry, exported.lazy_head, exported.files


def measure_exactness(out: Path, entry, max_ctx: int, k_max: int, vocab: int, log=None) -> dict:
    """Width exactness of an exported graph (:func:`specrt.runtime.lab.exactness.measure`):
    every width 1 .. k_max + 1 (each width the decode loop calls the target at, the last
    prefill chunk included: :func:`specrt.runtime.decode.chunk_bounds`) at row offsets 0, 1,
    2, with 2 and 1 intra-op threads, on the runtime's own model class for the graph.
    When widths >= 2 are exact there, also every wider width up to the prefill's widest
    call (:func:`specrt.runtime.lab.exactness.measure_wide`, 2 threads: every width at
    the first call, every 7th after ``k_max + 1`` rows of past), recorded as ``wide``: it
    lets the prefix cache reuse any committed row (:mod:`specrt.runtime.prefix`).
    ``log``: where progress lines go (patterns done and left, every few seconds), or None."""
    from specrt.runtime.backends import cpu_model
    from specrt.runtime.backends.base import ThreadConfig
    from specrt.runtime.chunks import PREFILL_CHUNK
    from specrt.runtime.lab.exactness import measure, measure_wide_engine

    from .progress import Progress

    widths = list(range(1, k_max + 2))
    length = min(max_ctx, max(40, 3 * (k_max + 1) + 4))
    q = 2 * widths[-1] + 2  # the widest pattern call (pattern_bounds folds a tail into the last call)
    models = [(f"t{t}", cpu_model(out, entry, length, q, ThreadConfig(t, False, t))) for t in (2, 1)]
    prog = Progress("  exactness probe", None, log, unit="patterns") if log is not None else None
    rec = measure(models, vocab, widths, offsets=(0, 1, 2), length=length, progress=prog)
    del models  # their sessions, before the wide probe's model
    if prog is not None:
        prog.done()
    ref_q = k_max + 1
    if rec["exact_min_q"] is not None and rec["exact_min_q"] <= ref_q and min(PREFILL_CHUNK, max_ctx - ref_q) > ref_q:
        prog = Progress("  wide-width probe", None, log, unit="widths") if log is not None else None
        rec["wide"] = measure_wide_engine(out, entry, max_ctx, vocab, ref_q, progress=prog)
        if prog is not None:
            prog.done()
    return rec


@dataclass(frozen=True)
class ExportOptions:
    """What ``specrt export`` makes of a pair (every field but the folders; :func:`export_pair`).

    Attributes:
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
            strategy; the three graphs share one weight file (``target.onnx.data``).
            Standard fp32 graphs only. False (the default) removes stale ones from ``out``.
        precision: one of :data:`~specrt.runtime.manifest.PRECISIONS`. fp32/fp16/bf16:
            specrt's standard graphs (fp16/bf16 compute, float32 I/O); int8/int4:
            onnxruntime-genai model builder graphs (:mod:`specrt.export.builder`; a GPT-2
            model keeps the standard fp32 graph, noted in its entry).
        quant: :class:`specrt.export.builder.QuantOptions` for int8/int4 (None: block 32,
            accuracy level 4, specrt's default builder options).
        exactness: measure the target's width exactness (``ModelEntry.exact_min_q``); off
            only for tests that do not decode.
        quality: None, or a :class:`specrt.export.quality.QualityConfig`: score the exported
            target against the fp32 PyTorch target (``extra["quality"]``).
        external_data: True: every standard graph keeps its weights in a ``<graph>.data``
            file beside it; None (default): only models whose float32 weights exceed 1.5 GB
            (protobuf cannot hold a graph over 2 GB); False: inline where torch allows.
            (Builder graphs always keep their weights in ``<role>.onnx.data``.)
        gguf_cache: where GGUF inputs are converted (None: beside each file).
        gguf_weights: ``exact`` (default): an integer target converted from GGUF takes every
            linear layer whose block type maps onto MatMulNBits from the file's own blocks
            (:mod:`specrt.export.gguf_blocks`; top-1 agreement with llama.cpp on the same
            file 97.6% against 91.8% requantized, for an 18% slower step, docs/guide/real-pair.md);
            ``requantize``: every layer quantized again from the dequantized weights. The
            draft is always requantized (its speed matters, its exactness does not).
        kernels: with a target exported int8/int4, also write panels for specrt's CPU kernels
            (``target.panels``, ``draft.panels``, ``extra["kernels"]``:
            :mod:`specrt.export.kernel_pack`, each tensor checked against ``gguf.dequantize``)
            and time the kernels' 1-row step against the ONNX graph's on this machine; the
            runtime takes the kernels where they run
            (:func:`specrt.runtime.target_path.kernels_choice`). A GGUF file gives its own
            blocks; a checkpoint folder is quantized by specrt (Q4_0 or Q8_0 layers, Q8_0
            embedding and head: :mod:`specrt.export.checkpoint_gguf`), and its quality on the
            kernels joins the quality record. A model the kernels cannot run writes no panels,
            with the reason.
        draft_precision: the draft's flavor when it differs from the target's (None: the
            same), e.g. an int4 draft for an fp32 target: with ``--draft`` and ``--target``
            the same checkpoint, the model's own int4 graph drafts for its exact one (a
            self-draft, for a user with one model). Integer drafts use ``quant``'s block
            size and accuracy level (or the defaults).

    Raises (:meth:`quants`):
        ValueError: bad k_max/max_ctx/precision/draft_precision/quant/gguf_weights.
        PrecisionError: lazy-head with a builder or non-fp32 flavor.
    """

    k_max: int = 8
    max_ctx: int = 1024
    tensorrt: str | None = None
    lazy_head: bool = False
    precision: str = "fp32"
    quant: object = None
    exactness: bool = True
    quality: object = None
    external_data: bool | None = None
    gguf_cache: str | Path | None = None
    draft_precision: str | None = None
    gguf_weights: str = "exact"
    kernels: bool = True

    def precision_of(self, role: str) -> str:
        """The flavor of ``role`` (``draft`` or ``target``)."""
        return self.draft_precision or self.precision if role == "draft" else self.precision

    def quants(self) -> dict:
        """Checked options; the :class:`~specrt.export.builder.QuantOptions` of each role
        exported by the model builder (int8/int4), by role."""
        from specrt.runtime.errors import PrecisionError
        from specrt.runtime.manifest import PRECISIONS

        from .builder import BUILDER_PRECISIONS, QuantOptions

        if not 1 <= self.k_max <= 64:
            raise ValueError(f"k_max={self.k_max}; k_max must be 1..64")
        if self.max_ctx < 2:
            raise ValueError(f"max_ctx={self.max_ctx}; max_ctx must be >= 2")
        for name, p in (("precision", self.precision), ("draft_precision", self.precision_of("draft"))):
            if p not in PRECISIONS:
                raise ValueError(f"{name}={p!r}; choose one of {', '.join(PRECISIONS)}")
        if self.lazy_head and self.precision != "fp32":
            raise PrecisionError(
                f"--lazy-head is offered for --precision fp32 (standard graphs) only; {self.precision} graphs "
                + ("compute their LM head inside (onnxruntime-genai builder graphs)" if self.precision in BUILDER_PRECISIONS else "have no body/head split")
            )
        quant, quants = self.quant, {}
        for role in ("target", "draft"):
            p = self.precision_of(role)
            if p in BUILDER_PRECISIONS:
                q = quant if quant is not None and quant.precision == p else None
                if q is None and quant is not None:
                    q = QuantOptions(p, quant.block_size, quant.accuracy_level, quant.head_bits)
                quants[role] = q or QuantOptions(p)
        if quant is not None and not quants:
            raise ValueError(f"block size / accuracy level apply to int8/int4 exports, not {self.precision}")
        if self.gguf_weights not in ("exact", "requantize"):
            raise ValueError(f"gguf_weights={self.gguf_weights!r}; choose exact or requantize")
        return quants


def export_pair(draft_dir: str | Path, target_dir: str | Path, out: str | Path, opts: ExportOptions | None = None, log=print, **kw) -> Manifest:
    """Check the pair, export both models, check parity, measure the target's width
    exactness, and write the manifest.

    Checked first, from metadata only (:func:`specrt.export.preflight.preflight`): both
    architectures are supported, a GGUF input shares one vocabulary with the other input (GGUF or folder), and the disk holds
    what the export writes. Progress lines go to ``log`` every few seconds in the long
    phases; the INFO records of the ONNX libraries are silenced for the export's duration
    (:func:`specrt.export.progress.quiet_third_party_logs`).

    Pair rules, checked before anything is exported: one tokenizer (equal token -> id
    map hashes), whose ``tokenizer.json`` encodes like the target's ``AutoTokenizer``
    (:func:`specrt.export.tokenizer_check.check_tokenizer`; a missing NFC normalizer is
    added to the engine's copy); each model's logit width >= the tokenizer's size (extra
    rows are padding: the runtime slices them off, so no padded id is ever proposed or
    chosen); both architectures and config options supported for ``max_ctx``. The target's
    special tokens (BOS/EOS/pad) are recorded in the manifest and used for draft, target
    and baseline alike; the tokenizer's vocab hash is recorded per model so the runtime
    can refuse a mismatched pair at load. The target's chat template
    (:func:`find_chat_template`), when it has one, is copied as ``chat_template.jinja``.

    Args:
        draft_dir, target_dir: local HF checkpoint folders (config, safetensors, tokenizer),
            or GGUF files (converted first into cached HF folders by
            :func:`specrt.export.gguf_import.checkpoint_folder`; recorded in ``extra["gguf"]``).
        out: engine folder to (over)write.
        opts: :class:`ExportOptions` (None: from ``kw``, its fields by name).
        log: progress sink.

    Every file written is recorded in the manifest's ``files`` map with its SHA-256 and
    size; the export's peak RSS (per phase and overall) is logged and recorded in
    ``extra["export"]``.

    Returns:
        The written :class:`~specrt.runtime.manifest.Manifest`.

    Raises:
        PairError, TokenizerError, specrt.export.arch.UnsupportedModelError,
        specrt.export.onnx_export.ParityError, ExportError (the model builder failed, not
        enough disk space), and what :meth:`ExportOptions.quants` raises.
    """
    from .preflight import preflight
    from .progress import quiet_third_party_logs

    o = replace(opts, **kw) if opts is not None else ExportOptions(**kw)
    quants = o.quants()
    preflight(draft_dir, target_dir, out, o, log)  # architectures, vocabularies of GGUF inputs, disk: before any conversion
    with quiet_third_party_logs():
        return _export_pair(Path(draft_dir), Path(target_dir), Path(out), o, quants, log)


def _export_pair(draft_dir: Path, target_dir: Path, out: Path, o: ExportOptions, quants: dict, log) -> Manifest:
    """:func:`export_pair` after its options are checked and its preflight passed."""
    meter = PhaseMeter(log)
    target_src, draft_src = target_dir, draft_dir
    (draft_dir, target_dir), gguf = _from_gguf(draft_dir, target_dir, o, quants, meter, log)
    for role, d in (("draft", draft_dir), ("target", target_dir)):
        if not (d / "config.json").is_file():
            raise ValueError(f"{role} folder {d} is not a Hugging Face checkpoint (no config.json)")
    tok_json = check_pair(draft_dir, target_dir)
    fixed_tokenizer = check_tokenizer(target_dir, tok_json, log)  # AutoTokenizer == tokenizer.json, or NFC added
    special = _special_ids(target_dir)
    _check_configs(draft_dir, target_dir, o.max_ctx, special[3], log)
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").unlink(missing_ok=True)  # half-written until the new one lands
    for name in (BODY_FILE, HEAD_FILE, "target.onnx.data", "draft.onnx.data", "target.panels", "draft.panels"):  # stale files of another flavor
        (out / name).unlink(missing_ok=True)
    entries, lazy, files = _export_models({"target": target_dir, "draft": draft_dir}, out, o, quants, special[3], meter, log)
    template = _write_tokenizer_files(out, tok_json, fixed_tokenizer, target_dir, files, log)
    kernels = _kernel_records(target_src, draft_src, out, entries, o, special, files, meter, log)
    for name, rec in files.items():
        if rec.external:
            log(f"  {name}: weights in {', '.join(rec.external)} ({sum(files[x].bytes for x in rec.external) / 2**30:.2f} GiB)")
    extra: dict = {
        **({LAZY_HEAD_KEY: lazy} if lazy is not None else {}),
        **({"gguf": gguf} if gguf else {}),
        **({"kernels": kernels} if kernels else {}),
    }
    manifest = _manifest(out, o, entries, vocab_hash(tok_json), special, target_dir, template, files, extra)
    if o.quality is not None:
        from .quality import export_quality

        meter.phase("target: quality record")
        rec = export_quality(manifest, out, target_dir, o.quality, log)
        manifest = replace(manifest, extra={**manifest.extra, "quality": rec})
    usage = meter.summary()
    anon = f", anonymous memory {usage['peak_anon_mib']:,.0f} MiB" if usage["peak_anon_mib"] is not None else ""
    log(
        f"export peak RSS {usage['peak_rss_mib']:,.0f} MiB{anon} ({'max over phases' if usage['per_phase_peaks'] else 'process peak'}; "
        f"with the model builder's process {usage['total_peak_mib']:,.0f} MiB), {usage['seconds']:.0f} s"
    )
    manifest = replace(manifest, extra={**manifest.extra, "export": {"external_data": any(r.external for r in files.values()), **usage}})
    if o.tensorrt:
        from .trt_build import tensorrt_hook

        manifest = tensorrt_hook(out, manifest, o.tensorrt, log)
    manifest.write(out)
    log(f"wrote {out / 'manifest.json'}")
    return manifest


def _kernel_records(target_src: Path, draft_src: Path, out: Path, entries: dict, o: ExportOptions, special: tuple, files: dict, meter, log) -> dict | None:
    """``extra["kernels"]``: the target's panels (:func:`specrt.export.kernel_pack.panels_record`,
    timed against the ONNX graph) for a target exported int8/int4, and, with them, the
    draft's (:func:`~specrt.export.kernel_pack.draft_panels`); each file recorded in
    ``files``. A GGUF input gives its own blocks; a Hugging Face folder is quantized by specrt
    first (:mod:`specrt.export.checkpoint_gguf`: a scratch GGUF, deleted after packing). None
    when the kernels do not apply."""
    from .kernel_pack import draft_panels, panels_record

    if not o.kernels:
        return None
    if o.precision not in ("int8", "int4"):
        log(
            f"  kernels: no target panels for a {o.precision} target (they compute 4/8-bit blocks with 8-bit activations, as llama.cpp; export --precision int4 or int8 for them)"
        )
        return None
    from specrt.runtime import kernels

    if kernels.status() is not None:  # before any quantizing
        log(f"  kernels: no panels ({kernels.status()})")
        return None
    scratch, recs, srcs = out / ".kernels_scratch", {}, {}
    try:
        meter.phase("target: kernel panels")
        srcs["target"] = _kernel_source("target", target_src, scratch, o.precision, log)
        recs["target"] = srcs["target"] and panels_record(srcs["target"][0], out, entries["target"], o.max_ctx, log)
        if recs["target"]:
            meter.phase("draft: kernel panels")
            srcs["draft"] = _kernel_source("draft", draft_src, scratch, "int8", log)  # 8-bit scratch: draft_panels requantizes to Q4_0 once
            recs["draft"] = srcs["draft"] and draft_panels(srcs["draft"][0], out, out / "tokenizer.json", (special[0],), log=log)  # added tokens first too
    except (ValueError, TypeError, OSError) as e:  # an optional step: the graphs stand; ExportError (a layout bug) stays fatal
        if isinstance(e, ExportError):
            raise
        log(f"  kernels: no panels: {e}")
        for name in ("target.panels", "draft.panels"):
            (out / name).unlink(missing_ok=True)
        return None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    recs = {k: v for k, v in recs.items() if v}
    for role, rec in recs.items():
        if srcs[role][1] is not None:
            rec.pop("gguf", None)  # the scratch file's name: gone
            rec["checkpoint"] = srcs[role][1]
        files[rec["file"]] = FileRecord.of(out / rec["file"])
    return recs or None


def _kernel_source(role: str, src: Path, scratch: Path, precision: str, log) -> tuple[Path, dict | None] | None:
    """``(GGUF file, checkpoint record or None)`` the kernels' panels of ``role`` are packed
    from: a GGUF input itself, or a checkpoint folder written as a scratch GGUF quantized
    for ``precision`` (int4/int8); None (with the reason logged) when the kernels cannot run
    the checkpoint.

    Raises:
        ValueError, TypeError, OSError: the checkpoint could not be read or written (the
            caller logs it and writes no panels)."""
    if src.is_file():
        return src, None
    from .checkpoint_gguf import checkpoint_unsupported, write_checkpoint_gguf

    why = checkpoint_unsupported(src)
    if why:
        log(f"  kernels: no {role} panels: {why}")
        return None
    scratch.mkdir(parents=True, exist_ok=True)
    path = scratch / f"{role}.gguf"
    rec = write_checkpoint_gguf(src, path, precision)
    log(f"  kernels: {role} checkpoint quantized by specrt ({rec['types']['layers']} layers, {rec['types']['embd']} embedding and head)")
    return path, {"folder": src.name, **rec}


def _from_gguf(draft_dir: Path, target_dir: Path, o: ExportOptions, quants: dict, meter, log) -> tuple:
    """``((draft folder, target folder), gguf record)``: GGUF inputs converted into cached
    Hugging Face folders; with ``gguf_weights="exact"`` an integer target takes the file's
    own blocks (``quants["target"]`` updated in place)."""
    gguf: dict = {}
    paths = {}
    for role, d in (("draft", draft_dir), ("target", target_dir)):
        if d.is_file():
            from .gguf_import import checkpoint_folder

            meter.phase(f"{role}: GGUF -> Hugging Face folder")
            d, gguf[role] = checkpoint_folder(d, role, o.gguf_cache, log=log)
        paths[role] = d
    if "target" in gguf and "target" in quants and o.gguf_weights == "exact":
        quants["target"] = replace(quants["target"], gguf_exact=True)
    if gguf:
        meter.phase(None)  # ends the conversion phase (the meter collects and trims the heap)
    return (paths["draft"], paths["target"]), gguf


def _export_models(dirs: dict, out: Path, o: ExportOptions, quants: dict, n_vocab: int, meter, log) -> tuple:
    """Export the target, then the draft (:func:`_export_model`), check their logit widths
    and measure the target's width exactness; returns ``(entries, lazy-head record or
    None, files)``."""
    entries, lazy, files = {}, None, {}
    for role in ("target", "draft"):
        p, d = o.precision_of(role), dirs[role]
        log(f"exporting {role} {d} -> {out / (role + '.onnx')} ({p})")
        entry, rec, model_files = _export_model(
            role, d, out, p, quants.get(role), o.max_ctx, o.k_max, o.lazy_head and role == "target", log, o.external_data, meter
        )
        files.update(model_files)
        if entry.graph == "standard" and entry.parity:
            log(f"  parity (max |diff|): {max(entry.parity.values()):.2e}")
        if rec is not None:
            lazy = rec
            log(f"  lazy-head graphs {BODY_FILE} + {HEAD_FILE} (weights shared in {rec['data_file']}), parity (max |diff|): {max(rec['parity'].values()):.2e}")
        entries[role] = entry
    shutil.rmtree(out / ".builder_cache", ignore_errors=True)
    for role, e in entries.items():
        if e.vocab_size < n_vocab:
            raise PairError(f"{role} has {e.vocab_size} logits but the tokenizer has {n_vocab} ids; they must come from one tokenizer")
    if o.exactness:
        rec = measure_exactness(out, entries["target"], o.max_ctx, o.k_max, n_vocab, log)
        entries["target"] = replace(entries["target"], exact_min_q=rec["exact_min_q"], exactness=rec)
        log(f"  width exactness of the target: {rec['note']} (q=1 vs wider: max |diff| {rec['max_abs_diff']['q1']:.3g})")
        if "wide" in rec:
            log(f"  wide widths: {rec['wide']['note']}")
    return entries, lazy, files


def _write_tokenizer_files(out: Path, tok_json: Path, fixed: str | None, target_dir: Path, files: dict, log) -> str | None:
    """Write ``tokenizer.json`` (the target's, or its fixed text) and the chat template
    (removing a stale one), record both in ``files``; returns the template or None."""
    from specrt.runtime.fileio import replaced, write_text

    if fixed is None:
        with replaced(out / "tokenizer.json") as tmp:
            shutil.copyfile(tok_json, tmp)
    else:
        write_text(out / "tokenizer.json", fixed)
    template = find_chat_template(target_dir)
    if template is not None:
        write_text(out / CHAT_TEMPLATE_FILE, template)
        log(f"chat template of {target_dir} -> {out / CHAT_TEMPLATE_FILE}")
    else:
        (out / CHAT_TEMPLATE_FILE).unlink(missing_ok=True)
    for name in ("tokenizer.json", *((CHAT_TEMPLATE_FILE,) if template is not None else ())):
        files[name] = FileRecord.of(out / name)
    return template


def _tools(entries: dict) -> dict:
    """Versions of the tools that made the export."""
    import onnx
    import onnxruntime
    import torch
    import transformers

    tools = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
    }
    if any(e.graph == "builder" for e in entries.values()):
        tools["onnxruntime_genai"] = next(e.quant["version"] for e in entries.values() if e.graph == "builder")
    return tools


def _manifest(out: Path, o: ExportOptions, entries: dict, v_hash: str, special: tuple, target_dir: Path, template, files: dict, extra: dict) -> Manifest:
    """The pair's :class:`~specrt.runtime.manifest.Manifest` (not yet written)."""
    eos, bos, add_bos, n_vocab = special
    return Manifest(
        format_version=FORMAT_VERSION,
        name=out.name,
        draft=replace(entries["draft"], vocab_hash=v_hash),
        target=replace(entries["target"], vocab_hash=v_hash),
        tokenizer_file="tokenizer.json",
        tokenizer_sha256=files["tokenizer.json"].sha256,
        vocab_size=n_vocab,
        eos_token_id=eos,
        eos_token_ids=tuple(i for i in checkpoint_end_ids(target_dir, eos) if i < n_vocab),
        bos_token_id=bos,
        add_bos=add_bos,
        pad_token_id=_pad_id(target_dir),
        chat_template_file=CHAT_TEMPLATE_FILE if template is not None else None,
        chat_template_sha256=files[CHAT_TEMPLATE_FILE].sha256 if template is not None else None,
        max_ctx=o.max_ctx,
        k_min=1,
        k_max=o.k_max,
        defaults={"k_max": min(o.k_max, 4), "threshold": 0.0, "strategy": "full", "chunk_bound": 0.5},
        tools=_tools(entries),
        extra=extra,
        precision=o.precision,
        files=files,
    )
