"""Integer (int8 / int4 weight-only) graphs from onnxruntime-genai's model builder.

For ``specrt export --precision int8|int4`` each model is built by onnxruntime-genai's own
model builder (``python -m onnxruntime_genai.models.builder``, pinned to 0.18.0 in the
``[export]`` extra: its output format changes between releases), which emits a fused graph:
GroupQueryAttention with past and present sharing one buffer, MatMulNBits weights in
blocks, SkipSimplifiedLayerNormalization; 101 nodes for the default target against 529 in
specrt's standard graph. specrt then runs it with its own runtime through plain
onnxruntime (:mod:`specrt.runtime.backends.ort_gqa`); onnxruntime-genai is not needed to
serve it. Why this graph form and these defaults: docs/guide/engines.md.

How a model is built (memory-bounded; :mod:`specrt.export.prequantize`):

1. the checkpoint's linear layers are quantized one tensor at a time with onnxruntime's MLAS
   quantizer (the kernel the builder's own int4 path calls: symmetric, ``block_size``
   weights per block) into a prequantized checkpoint, so the builder repacks integer weights
   instead of holding the whole model as float32 (13.6 GB peak for a 1.5B model that way,
   2-3x less this way; docs/guide/real-pair.md);
2. the builder (``--extra_options block_size accuracy_level``) emits the graph;
3. for int4, the embedding table (a float Gather in the builder's graph) is quantized to
   int4 blocks (``GatherBlockQuantized``) with onnxruntime's ``MatMulNBitsQuantizer``: the
   table is the largest float tensor of a real model (151,936 x 1,536 fp32 = 933 MB of
   Qwen2.5-1.5B), and its quantized lookup is exact per row.

The graph equals the builder's own ``-p int4 --extra_options op_types_to_quantize=MatMul/Gather``
build bit for bit in its logits (checked on Qwen2.5-Coder-0.5B, docs/guide/real-pair.md).

Options: ``block_size`` (default 32) and ``accuracy_level`` (default 4: int8 activations, the
fast CPU kernels; 0/1 compute in fp32 and were 2.5-35x slower per call in research r14);
``head_bits``: the LM head's width (default: 8 for int4 models that tie it to the embedding,
the choice r14 measured: top-1 agreement with fp32 95.3% -> 98.0% at the same speed; else the
body's).

GPT-2-family models: the builder has no GPT-2; such a model keeps specrt's standard fp32
graph in an integer export, with a note in the manifest entry and the export log
(:func:`builder_supports`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from specrt.runtime.errors import ExportError, UnsupportedModelError
from specrt.runtime.manifest import GRAPH_BUILDER, ModelEntry, sha256_file

__all__ = [
    "BUILDER_PRECISIONS",
    "BUILDER_VERSION",
    "QuantOptions",
    "builder_supports",
    "build_model",
]

BUILDER_PRECISIONS = ("int8", "int4")
BUILDER_VERSION = "0.18.0"  # the onnxruntime-genai release the [export] extra pins
# model_type values of specrt's families the builder covers (gpt2 is not among its architectures)
_BUILDER_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "phi3": "Phi3ForCausalLM"}


@dataclass(frozen=True)
class QuantOptions:
    """Weight quantization of an integer export.

    Attributes:
        precision: ``int8`` or ``int4`` (weight-only; MatMulNBits).
        block_size: weights per quantization block (16..256, a power of two; must divide
            the layers' input widths, e.g. the default draft's 192).
        accuracy_level: MatMulNBits compute type: 0 (unset: fp32), 1 fp32, 2 fp16, 3 bf16,
            4 int8 activations (the fast CPU path).
        head_bits: the LM head's bits, 4 or 8 (None: 8 for an int4 model with tied
            embeddings, else the body's).
        gguf_exact: for a checkpoint converted from GGUF, take every linear layer whose
            GGUF type maps onto MatMulNBits exactly from the file's own blocks (no second
            quantization; :mod:`specrt.export.gguf_blocks`), the others quantized as
            usual. A layer then keeps the GGUF's bits (``Q6_K``/``Q5_0``/``Q8_0`` are
            8-bit), whatever ``precision`` says.
    """

    precision: str
    block_size: int = 32
    accuracy_level: int = 4
    head_bits: int | None = None
    gguf_exact: bool = False

    def __post_init__(self):
        if self.precision not in BUILDER_PRECISIONS:
            raise ValueError(f"precision={self.precision!r}; the builder path makes {', '.join(BUILDER_PRECISIONS)}")
        if self.block_size < 16 or self.block_size > 256 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size}; must be a power of two in 16..256")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise ValueError(f"accuracy_level={self.accuracy_level}; must be 0..4 (4 = int8 activations, the fast CPU kernels)")
        if self.head_bits not in (None, 4, 8):
            raise ValueError(f"head_bits={self.head_bits}; must be 4 or 8")

    @property
    def bits(self) -> int:
        """The body's weight bits (4 or 8)."""
        return 4 if self.precision == "int4" else 8

    def lm_head_bits(self, tied_embeddings: bool) -> int:
        """The LM head's bits for a model (see ``head_bits``)."""
        if self.head_bits is not None:
            return self.head_bits
        return 8 if self.precision == "int4" and tied_embeddings else self.bits

    def options(self) -> dict[str, str]:
        """The builder's ``--extra_options`` (``key -> value`` strings)."""
        return {"block_size": str(self.block_size), "accuracy_level": str(self.accuracy_level)}


def builder_supports(model_type: str) -> bool:
    """Whether the model builder can build this ``config.model_type`` (specrt's families
    except ``gpt2``)."""
    return model_type in _BUILDER_TYPES


def _rename_external_data(graph_path: Path, data_name: str) -> None:
    """Point every external initializer of ``graph_path`` at ``data_name`` (same folder),
    so the engine folder can name the weights after the role (``target.onnx.data``)."""
    import onnx

    m = onnx.load(str(graph_path), load_external_data=False)
    for t in m.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            for kv in t.external_data:
                if kv.key == "location":
                    kv.value = data_name
    from specrt.runtime.fileio import replaced

    with replaced(graph_path) as tmp:
        onnx.save(m, str(tmp))


def build_model(model_dir: Path, out: Path, role: str, opts: QuantOptions, max_ctx: int, cache: Path, log=print, meter=None) -> ModelEntry:
    """Build one checkpoint with the model builder into ``out/{role}.onnx`` (+ ``.data``).

    Args:
        model_dir: local HF checkpoint (config, safetensors, tokenizer).
        out: the engine folder. role: ``target`` or ``draft``.
        opts: :class:`QuantOptions`. max_ctx: the engines' context (checked against the
            graph's rotary cache, ``context_length``).
        cache: a scratch folder for the builder (``-c``); log: progress sink.
        meter: a :class:`~specrt.export.resources.PhaseMeter`: each step is its own phase
            (prequantize, the builder's process, the embedding), so a phase's peak pairs
            this process's memory with the child's only while the child runs.

    Returns:
        The model's :class:`~specrt.runtime.manifest.ModelEntry` (graph ``builder``; parity,
        vocab hash, exactness filled in by the caller).

    Raises:
        UnsupportedModelError: an architecture the builder lacks, or ``max_ctx`` beyond the
            graph's rotary cache.
        ExportError: the builder failed (its last log lines), or its graph's I/O differs from
            the interface the runtime binds.
    """
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    if not builder_supports(cfg.model_type):
        raise UnsupportedModelError(f"{model_dir}: model_type {cfg.model_type!r} is not covered by onnxruntime-genai's model builder")
    from .gguf_import import STAMP, GgufBlocks
    from .prequantize import MINS_FILE, add_min_corrections, prequantize, quantize_embedding
    from .resources import trim_heap

    def phase(name):
        if meter is not None:
            trim_heap()  # freed tensors back to the OS, so the next phase starts from what is live
            meter.phase(f"{role}: {name}" if name else None)

    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    extra = opts.options()
    head_bits = opts.lm_head_bits(tied)
    tmp = out / f".build_{role}"
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    phase(f"prequantize ({opts.precision})")
    exact = GgufBlocks(model_dir) if opts.gguf_exact and (Path(model_dir) / STAMP).is_file() else None
    source = prequantize(model_dir, cache / f"{role}.prequantized", opts.bits, opts.block_size, head_bits, exact=exact, log=log)
    del exact
    phase("onnxruntime-genai model builder (child process)")
    gcfg = _run_builder(source, tmp, cache, opts, extra, max_ctx, model_dir, meter, log)
    graph, data = out / f"{role}.onnx", out / f"{role}.onnx.data"
    os.replace(tmp / "model.onnx", graph)  # tmp is inside out: renames, over any old file
    os.replace(tmp / "model.onnx.data", data)
    _rename_external_data(graph, data.name)
    corrected = 0
    if (source / MINS_FILE).is_file():
        phase("offset corrections")
        corrected = add_min_corrections(graph, source / MINS_FILE, log)
    shutil.rmtree(source, ignore_errors=True)
    phase("embedding table")
    embedding = "int4" if opts.precision == "int4" and quantize_embedding(graph, opts.block_size, log) else "float32"
    shutil.rmtree(tmp, ignore_errors=True)
    phase(None)
    n_layers = int(gcfg["decoder"]["num_hidden_layers"])
    ins, outs = _graph_io(graph)
    want_in, want_out = ModelEntry.io_names(n_layers, GRAPH_BUILDER)
    if set(ins) != set(want_in) or set(outs) != set(want_out):
        raise ExportError(f"{graph}: builder graph I/O {ins} -> {outs} is not the interface the runtime binds ({want_in} -> {want_out})")
    log(
        f"  model builder {opts.precision} ({', '.join(f'{k}={v}' for k, v in extra.items())}, {'weights from the GGUF blocks' if opts.gguf_exact else f'LM head {head_bits}-bit'}, embedding {embedding}): {time.perf_counter() - t0:.1f} s"
    )
    quant = dict(tool="onnxruntime-genai model builder", version=_builder_version(), block_size=opts.block_size, accuracy_level=opts.accuracy_level)
    quant.update(extra_options=extra, head_bits=head_bits, embedding=embedding, gguf_exact=bool(opts.gguf_exact), offset_corrected_layers=corrected)
    quant.update(
        prequantized="onnxruntime MLAS quantize_matmul_nbits, symmetric, per tensor (specrt.export.prequantize)",
        context_length=int(gcfg.get("context_length", 0)),
    )
    return _entry(graph, data, cfg.model_type, gcfg, ins, outs, model_dir, opts.precision, quant)


def _run_builder(source: Path, tmp: Path, cache: Path, opts: QuantOptions, extra: dict, max_ctx: int, model_dir: Path, meter, log=None) -> dict:
    """Run the model builder in a child process on the prequantized ``source`` into ``tmp``
    (its peak RSS recorded by ``meter``; a line to ``log`` every 30 s while it runs);
    returns the graph's ``genai_config.json`` model record.

    Raises:
        ExportError: the builder failed (its last log lines).
        UnsupportedModelError: ``max_ctx`` beyond the graph's rotary cache.
    """
    from .resources import run_measured

    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source), "-o", str(tmp), "-p", opts.precision, "-e", "cpu", "-c", str(cache)]
    cmd += ["--extra_options", *(f"{k}={v}" for k, v in extra.items())]
    code, output, child_peak = run_measured(cmd, log, "  model builder (child process)")
    if meter is not None:
        meter.child(child_peak)
    if code != 0 or not (tmp / "model.onnx").is_file():
        tail = " | ".join([ln for ln in output.splitlines() if ln.strip() and "Saving " not in ln][-5:])
        raise ExportError(f"onnxruntime-genai model builder failed for {model_dir} ({opts.precision}, exit {code}): {tail[-800:]}")
    gcfg = json.loads((tmp / "genai_config.json").read_text())["model"]
    if gcfg.get("context_length", max_ctx) < max_ctx:
        raise UnsupportedModelError(f"{model_dir}: the builder graph's rotary cache has {gcfg['context_length']} positions < --max-ctx {max_ctx}")
    return gcfg


def _entry(graph: Path, data: Path, family: str, gcfg: dict, ins, outs, model_dir: Path, precision: str, quant: dict) -> ModelEntry:
    """The :class:`ModelEntry` of a builder graph from its ``genai_config.json`` record."""
    dec = gcfg["decoder"]
    return ModelEntry(
        file=graph.name,
        sha256=sha256_file(graph),
        family=family,
        n_layers=int(dec["num_hidden_layers"]),
        n_heads=int(dec["num_attention_heads"]),
        n_kv_heads=int(dec["num_key_value_heads"]),
        head_dim=int(dec["head_size"]),
        hidden=int(dec["hidden_size"]),
        vocab_size=int(gcfg["vocab_size"]),
        params=0,
        inputs=ins,
        outputs=outs,
        source=str(model_dir),
        graph=GRAPH_BUILDER,
        precision=precision,
        quant=quant,
        data_file=data.name,
        data_sha256=sha256_file(data),
    )


def _graph_io(path: Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(input names, output names) of an ONNX file, weights not loaded."""
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    return tuple(i.name for i in m.graph.input), tuple(o.name for o in m.graph.output)


def _builder_version() -> str:
    try:
        from importlib.metadata import version

        return version("onnxruntime-genai")
    except Exception:  # noqa: BLE001 - recorded only
        return "unknown"
