"""The ``quality`` record of an export: the exported target (any flavor) against the fp32
target, on the held-out stdlib text and on HumanEval outputs.

The sets and figures are those of :mod:`specrt.runtime.lab.quality` (top-1 agreement, loss
in nats per token, teacher-forced). The reference is the checkpoint in float32: for a model
up to 1.5 GB of fp32 weights its fp32 *standard* graph, exported to a scratch folder for the
purpose (equal to PyTorch to ~1e-5, the parity every fp32 export checks) and run by the
runtime like the flavor (a forward in PyTorch took 2 s per 256-token window on this 2-core
machine, onnxruntime a tenth of that); above it PyTorch itself
(:class:`~specrt.export.torch_reference.TorchModel`), since exporting the fp32 graph of a
real model costs more memory than the rest of the export. The reference is scored first and
freed before the flavor is loaded. For large models the sets shrink so the record costs
about what it costs a 0.5B model (:meth:`QualityConfig.scaled`).
``scripts/eval_quality.py`` computes the same figures against an fp32 engine folder (all
100 HumanEval prompts) for docs/guide/engines.md.
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from specrt.runtime.lab.quality import WINDOW, compare, encode_texts, heldout_windows, score_model, stdlib_heldout_texts

__all__ = ["QualityConfig", "QUALITY_BOUNDS", "export_quality", "holds"]

# what "the quality holds" means for a flavor (docs/guide/engines.md): its argmax agrees with the
# fp32 target's at >= 95% of the positions of both sets and its loss rises by <= 0.05 nats
QUALITY_BOUNDS = {"min_top1_agreement": 0.95, "max_loss_delta": 0.05}


@dataclass(frozen=True)
class QualityConfig:
    """What the export-time quality record measures.

    Attributes:
        heldout_windows: windows of the held-out stdlib text (0 = skip).
        window: scored positions per window (capped at ``max_ctx - 1``).
        prompts: a HumanEval JSONL file (``"prompt"`` per line); "" or missing = skip.
        humaneval_prompts: prompts used from it.
        new_tokens: tokens of the fp32 greedy continuation scored per prompt.
    """

    heldout_windows: int = 64
    window: int = WINDOW
    prompts: str = "data/humaneval_dev.jsonl"
    humaneval_prompts: int = 20
    new_tokens: int = 128

    def scaled(self, params: int) -> "QualityConfig":
        """The sets for a target of ``params`` parameters: unchanged up to 5e8, above it
        windows and prompts shrink in proportion (at least 16 windows and 8 prompts of 64
        tokens: 4,096 held-out positions keep the agreement's standard error near 0.3%)."""
        f = 5e8 / params
        if f >= 1:
            return self
        return replace(
            self,
            heldout_windows=max(min(16, self.heldout_windows), int(self.heldout_windows * f)),
            humaneval_prompts=max(min(8, self.humaneval_prompts), int(self.humaneval_prompts * f)),
            new_tokens=min(self.new_tokens, 64),
        )


def holds(record: dict) -> bool:
    """Whether every measured set meets :data:`QUALITY_BOUNDS`."""
    sets = [record[k] for k in ("heldout_stdlib", "humaneval") if isinstance(record.get(k), dict) and "top1_agreement" in record[k]]
    return bool(sets) and all(s["top1_agreement"] >= QUALITY_BOUNDS["min_top1_agreement"] and s["loss_delta"] <= QUALITY_BOUNDS["max_loss_delta"] for s in sets)


def greedy(model, ids: list[int], new_tokens: int, vocab: int, eos) -> list[int]:
    """The model's greedy continuation of ``ids`` (at most ``new_tokens``, the
    end-of-generation id included when one of ``eos`` (a set) ends it): one call per token
    after a chunked prefill."""
    from specrt.runtime.decode import feed

    rows = feed(model, ids, 0)
    out = [int(rows[-1, :vocab].argmax())]
    while len(out) < new_tokens and out[-1] not in eos:
        out.append(int(model.run(out[-1:], len(ids) + len(out) - 1)[0, :vocab].argmax()))
    return out


def _reference(m, target_dir: Path, scratch: Path, max_q: int, log):
    """The fp32 reference of the quality record and the record's first keys: the float32
    PyTorch model when the target is too large for one ONNX file, else the fp32 standard
    graph exported into ``scratch``."""
    from specrt.runtime.backends import cpu_model
    from specrt.runtime.backends.base import ThreadConfig

    from .onnx_export import EXTERNAL_DATA_ABOVE, export_model

    if 4 * m.target.params > EXTERNAL_DATA_ABOVE:
        from .torch_reference import TorchModel

        log(f"  quality record: loading the float32 PyTorch reference of {target_dir}")
        return TorchModel(target_dir, m.max_ctx, max_q), dict(reference=f"float32 PyTorch model of {target_dir}", bounds=QUALITY_BOUNDS)
    log(f"  quality record: exporting the fp32 reference graph of {target_dir}")
    ref_entry = export_model(target_dir, scratch / "target.onnx", m.max_ctx, m.k_max, check=False).entry
    ref = cpu_model(scratch, ref_entry, m.max_ctx, max_q, ThreadConfig())
    return ref, dict(reference=f"fp32 standard graph of {target_dir} (exported for the comparison)", bounds=QUALITY_BOUNDS)


def _scored_sets(m, out: Path, cfg: QualityConfig, ref, rec: dict, log, progress_every: float) -> dict:
    """The sequences to score: ``name -> (sequences, first scored positions, record)`` for
    the held-out stdlib windows and the HumanEval prompts with the reference's greedy
    continuations; a set that cannot be built is recorded in ``rec`` as ``{"skipped": why}``."""
    from tokenizers import Tokenizer

    from specrt.runtime.tokenizer import TextCodec

    from .progress import Progress

    window = min(cfg.window, m.max_ctx - 1)
    sets: dict = {}
    if cfg.heldout_windows > 0:
        tok = Tokenizer.from_file(str(out / m.tokenizer_file))
        try:
            data = encode_texts(lambda t: tok.encode(t, add_special_tokens=False).ids, stdlib_heldout_texts(), m.eos_token_id)
            wins = heldout_windows(data, cfg.heldout_windows, window).tolist()
            sets["heldout_stdlib"] = (wins, [0] * len(wins), dict(windows=len(wins), window=window, tokens=int(len(data))))
        except ValueError as e:
            rec["heldout_stdlib"] = {"skipped": str(e)}
    path = Path(cfg.prompts) if cfg.prompts else None
    if not (path and path.is_file() and cfg.humaneval_prompts > 0):
        rec["humaneval"] = {"skipped": f"no prompts file {cfg.prompts!r}"}
        return sets
    codec = TextCodec(out / m.tokenizer_file, m.bos_token_id, m.add_bos)
    prompts = [json.loads(x)["prompt"] for x in path.read_text().splitlines() if x.strip()][: cfg.humaneval_prompts]
    seqs, firsts = [], []
    # a greedy continuation costs one call per token, a scored row a few: each stage has its own estimate
    gen = Progress("  quality record, fp32 greedy continuations", len(prompts), log, unit="prompts", every=progress_every)
    for p in prompts:
        ids = codec.encode(p)[: m.max_ctx - cfg.new_tokens - 1]
        seqs.append(ids + greedy(ref, ids, cfg.new_tokens, m.vocab_size, m.stop_ids()))
        firsts.append(len(ids) - 1)
        gen.advance()
    gen.done()
    sets["humaneval"] = (seqs, firsts, dict(prompts=len(prompts), new_tokens=cfg.new_tokens, file=str(path)))
    return sets


def _kernels_quality(m, out: Path, sets: dict, refs: dict, vocab: int, log) -> dict | None:
    """The same sets scored by the target's kernel panels where specrt quantized them from the
    checkpoint (``extra.kernels.target.checkpoint``: :mod:`specrt.export.checkpoint_gguf`), as
    ``{set: figures, "holds"}``; None for panels of a GGUF file's own blocks (their quality
    is the file's) or without panels."""
    from specrt.runtime.backends import KERNELS_KEY, kernel_model

    if "checkpoint" not in ((m.extra.get(KERNELS_KEY) or {}).get("target") or {}):
        return None
    model = kernel_model(out, m, "target", 64)
    try:
        rec = {name: dict(compare(refs[name], score_model(model, seqs, firsts, vocab))) for name, (seqs, firsts, _) in sets.items()}
    finally:
        model.close()
    rec["holds"] = holds(rec)
    for name, s in rec.items():
        if name != "holds":
            log(
                f"  quality vs fp32, target on specrt's kernels ({name}): top-1 agreement {s['top1_agreement']:.4f}, loss {s['loss']:.4f} vs {s['loss_reference']:.4f}"
            )
    return rec


def export_quality(manifest, out: Path, target_dir: Path, cfg: QualityConfig, log=print, progress_every: float = 10.0) -> dict:
    """Score the exported target of ``out`` against the fp32 standard graph of ``target_dir``.

    Writes ``log`` a progress line (:class:`~specrt.export.progress.Progress`) every
    ``progress_every`` seconds while it runs, per stage: the reference's greedy
    continuations (prompts done and left), then the rows (sequences) scored by the
    reference and by the flavor, with the time elapsed and left.

    Returns:
        ``{"reference", "bounds", "holds", "heldout_stdlib": {...}, "humaneval": {...},
        "seconds"}``; a set that cannot be built (no prompts file, text too short) is
        ``{"skipped": reason}``.
    """
    import shutil

    from specrt.runtime.backends import cpu_model
    from specrt.runtime.backends.base import ThreadConfig

    from .onnx_export import trim_heap
    from .progress import Progress

    t0 = time.perf_counter()
    m = manifest
    cfg = cfg.scaled(m.target.params or 1)
    scratch = out / ".quality_reference"
    shutil.rmtree(scratch, ignore_errors=True)
    max_q = max(256, m.k_max + 1)
    ref, rec = _reference(m, target_dir, scratch, max_q, log)
    vocab, min_q = m.vocab_size, m.min_q()
    sets = _scored_sets(m, out, cfg, ref, rec, log, progress_every)
    # rows: every sequence of both sets, scored by the reference, then by the exported flavor
    prog = Progress("  quality record, scoring", 2 * sum(len(seqs) for seqs, _, _ in sets.values()), log, unit="rows", every=progress_every)

    def rows(base: int):
        """A score_model progress callback counting its sequences after ``base`` rows."""
        return lambda done, _total: prog.update(base + done)

    refs = {}
    for name, (seqs, firsts, _) in sets.items():
        refs[name] = score_model(ref, seqs, firsts, vocab, progress=rows(prog.count))
    ref.close()
    del ref
    gc.collect()  # the PyTorch reference's memory-mapped weights are unmapped before the flavor loads
    trim_heap()
    shutil.rmtree(scratch, ignore_errors=True)
    model = cpu_model(out, m.target, m.max_ctx, max_q, ThreadConfig())
    for name, (seqs, firsts, info) in sets.items():
        rec[name] = dict(compare(refs[name], score_model(model, seqs, firsts, vocab, min_q, progress=rows(prog.count))), **info)
    model.close()
    prog.done()
    rec["holds"] = holds(rec)
    kern = _kernels_quality(m, out, sets, refs, vocab, log)
    if kern is not None:
        rec["kernels"] = kern
    rec["config"] = asdict(cfg)
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    for k in ("heldout_stdlib", "humaneval"):
        s = rec[k]
        if "top1_agreement" in s:
            log(
                f"  quality vs fp32 ({k}, {s['positions']} positions): top-1 agreement {s['top1_agreement']:.4f}, loss {s['loss']:.4f} vs {s['loss_reference']:.4f}"
            )
    return rec
