"""Integer weights one tensor at a time: a Hugging Face folder -> a prequantized checkpoint that
onnxruntime-genai's model builder re-exports without ever holding the float model.

Why: for ``--precision int4|int8`` the builder loads the checkpoint in PyTorch, emits an ONNX
graph whose weights are all float32 *in memory*, and only then quantizes it with
onnxruntime's ``MatMulNBitsQuantizer``: 13.6 GB peak RSS for Qwen2.5-Coder-1.5B (measured,
docs/guide/real-pair.md), whatever the checkpoint's dtype. A checkpoint that is already quantized
takes the builder's other path (its ``QuantModel`` loaders): the integer weights are repacked
into MatMulNBits initializers directly and nothing is expanded to float32.

So :func:`prequantize` reads the folder's safetensors one tensor at a time (``safe_open``),
quantizes every linear layer's weight with *the same onnxruntime kernel the builder's
default path calls* (``quantize_matmul_4bits`` / ``quantize_matmul_8bits`` from
onnxruntime's MLAS, as ``MatMulNBitsQuantizer`` does: symmetric, blocks of ``block_size``
along the input dimension, float32 scales), and writes the result in the layout the
builder's ``olive`` loader reads (``qweight`` uint8 ``[out, in * bits / 8]``, ``scales``
float32 ``[out, in / block]``, optional ``qzeros``), plus every other tensor unchanged, in
bounded shards (:class:`~specrt.export.shards.ShardWriter`). The MatMulNBits weights of the
built graph are therefore those of the builder's own int4 build; the difference is only
where the float copy lives (one tensor instead of the model).

The LM head (``lm_head.weight``, or the embedding table when the model ties them) may get
its own bit width (``head_bits``; the builder's ``matmul_mixed_precision=last_matmul:int8``).
The embedding table stays float in the checkpoint; the export quantizes its Gather afterwards
(:func:`quantize_embedding`).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np

from specrt.runtime.errors import ExportError

__all__ = ["LINEAR_SUFFIXES", "MINS_FILE", "prequantize", "quantize_block", "quantize_embedding", "add_min_corrections"]

# the decoder's linear layers (Llama/Mistral/Qwen2 names; fused Phi-3 names too)
LINEAR_SUFFIXES = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.qkv_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "mlp.gate_up_proj.weight",
)
_COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "chat_template.jinja", "vocab.json", "merges.txt")


def quantize_block(weight: np.ndarray, bits: int, block_size: int, symmetric: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Symmetric block quantization of one linear layer, as ``MatMulNBitsQuantizer`` does it.

    Args:
        weight: float32 ``[out, in]`` (PyTorch's Linear layout); ``in`` a multiple of
            ``block_size``.
        bits: 4 or 8. block_size: weights per block along ``in``.

    Returns:
        ``(qweight, scales, qzeros)``: uint8 ``[out, in * bits / 8]`` (MatMulNBits' packing:
        two 4-bit values per byte, the lower index in the low nibble), float32
        ``[out, in / block_size]``, and uint8 zero points ``[out, ceil(blocks * bits / 8)]``
        packed alike: the symmetric quantizer's implicit zero (8 for 4 bits, 128 for 8),
        written out because the builder's fused q/k/v path concatenates zero points.

    Raises:
        ExportError: ``in`` not a multiple of ``block_size``, or bits not 4/8.
    """
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    out_f, in_f = weight.shape
    if in_f % block_size:
        raise ExportError(f"a layer of input width {in_f} is not a multiple of the block size {block_size}; pick a --block-size that divides it")
    if bits not in (4, 8):
        raise ExportError(f"{bits}-bit weights: MatMulNBits here takes 4 or 8")
    k_blocks = in_f // block_size
    kpack = 8 // bits
    packed = np.zeros((out_f, k_blocks, block_size // kpack), np.uint8)
    scales = np.zeros((out_f, k_blocks), np.float32)
    zero = np.zeros((out_f, (k_blocks + kpack - 1) // kpack), np.uint8)
    fn = quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits
    fn(packed, np.ascontiguousarray(weight.T, dtype=np.float32), scales, zero, block_size, out_f, in_f, symmetric)
    if symmetric:
        zero[:] = 0x88 if bits == 4 else 128  # the symmetric zero, as MLAS stores its values (unsigned)
    return packed.reshape(out_f, -1), scales, zero


def _is_linear(name: str) -> bool:
    return name.endswith(LINEAR_SUFFIXES) and name.startswith("model.layers.")


def _olive_tensors(b) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(qweight, scales, qzeros) of :class:`~specrt.export.gguf_blocks.Blocks` in the olive
    layout the builder repacks (MatMulNBits' own: uint8 packed along the input dimension,
    the lower index in the low nibble; zero points packed alike)."""
    if b.bits == 4:
        q = (b.q[:, 0::2] | (b.q[:, 1::2] << np.uint8(4))).astype(np.uint8)
        z = b.zeros if b.zeros.shape[1] % 2 == 0 else np.pad(b.zeros, ((0, 0), (0, 1)))
        z = (z[:, 0::2] | (z[:, 1::2] << np.uint8(4))).astype(np.uint8)
    else:
        q, z = b.q, b.zeros
    return np.ascontiguousarray(q), np.ascontiguousarray(b.scales, dtype=np.float32), np.ascontiguousarray(z)


def _fused_groups(names: list[str]) -> list[list[str]]:
    """Linear weights grouped as the builder fuses them into one MatMulNBits node: a
    layer's q/k/v projections (``attn/qkv_proj``), every other layer alone."""
    groups, done, have = [], set(), set(names)
    for n in names:
        if n.endswith("self_attn.q_proj.weight"):
            stem = n[: -len("q_proj.weight")]
            trio = [stem + p + "_proj.weight" for p in "qkv"]
            if have.issuperset(trio):
                groups.append(trio)
                done.update(trio)
    return groups + [[n] for n in names if n not in done]


# per linear layer, the 32-block offsets (exact GGUF terms); not .safetensors: the builder
# reads every safetensors file of its input folder as weights
MINS_FILE = "specrt_mins.npz"


def prequantize(
    folder: str | Path,
    out: str | Path,
    bits: int,
    block_size: int,
    head_bits: int | None = None,
    *,
    symmetric: bool = True,
    layer_bits: dict[str, int] | None = None,
    exact=None,
    log=print,
) -> Path:
    """Write the prequantized checkpoint of ``folder`` into ``out`` (see the module docstring).

    Args:
        folder: a Hugging Face checkpoint folder (safetensors weights, config, tokenizer).
        out: the folder to (over)write.
        bits: 4 or 8 for the decoder's linear layers. block_size: weights per block.
        head_bits: the LM head's bits (None: ``bits``).
        symmetric: symmetric blocks (the builder's default; False: unsigned values with a
            zero point per block).
        layer_bits: per linear layer (its weight's name without ``.weight``, e.g.
            ``model.layers.3.mlp.down_proj``) bits other than ``bits``.
        exact: None, or a callable ``weight name -> Blocks | None`` giving a layer's exact
            MatMulNBits terms (:mod:`specrt.export.gguf_blocks`: a GGUF file's own blocks,
            no second quantization); layers it answers None for are quantized as above.
            A layer's 32-block offsets, when it has any, are written to :data:`MINS_FILE`
            for :func:`add_min_corrections`. Fused layers (q/k/v) share the widest bits and
            the narrowest group of their parts.

    Returns:
        ``out``: config.json with ``quantization_config`` (``quant_method`` ``olive``, bits,
        group size, per-layer overrides), safetensors shards, the tokenizer files, and
        :data:`MINS_FILE` when a layer has offsets.

    Raises:
        ExportError: no safetensors weights, a layer width the block size does not divide.
    """
    from .progress import Progress

    src, out = Path(folder), Path(out)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ExportError(f"{src} has no .safetensors weights to quantize")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    t0 = time.perf_counter()
    w = _Checkpoint(out, bits, head_bits or bits, block_size, symmetric, dict(layer_bits or {}))
    w.progress = Progress("  prequantize", _count_linear(files), log, unit="layers")
    where, embed = _copy_unquantized(files, w, quantize=exact is None)

    tied = "lm_head.weight" not in where
    if tied and embed is None:
        raise ExportError(f"{src}: neither lm_head.weight nor model.embed_tokens.weight found")
    _add_linear_layers(w, where, embed, tied, exact)
    if tied:
        cfg["tie_word_embeddings"] = False  # the builder reads a separate (quantized) head
    shards = w.close(cfg, src)
    if w.progress.lines:  # a run that printed progress says it ended; a short one only its summary below
        w.progress.done()
    how = f"{w.counts['exact']} from the source's own blocks, " if w.counts["exact"] else ""
    log(
        f"  prequantized {w.counts['exact'] + w.counts['quantized']} linear layers ({how}{w.counts['quantized']} quantized: {bits}-bit, head {w.head_bits}-bit, "
        f"blocks of {block_size}) into {shards} shard(s): {time.perf_counter() - t0:.1f} s"
    )
    return out


def _add_linear_layers(w: "_Checkpoint", where: dict, embed: str | None, tied: bool, exact) -> None:
    """Write the linear layers :func:`_copy_unquantized` left: with ``exact``, each fused
    group from the source's own blocks where it has them for every part, else quantized;
    without, only a tied LM head (quantized from the embedding ``embed``)."""
    from safetensors import safe_open

    def tensor(name: str):
        with safe_open(str(where[name]), framework="pt") as sf:
            return sf.get_tensor(name)

    if exact is None:
        if tied:
            w.add_linear("lm_head.weight", tensor(embed))
        return
    names = sorted(where) + (["lm_head.weight"] if tied else [])
    for group in _fused_groups([n for n in names if n != "model.embed_tokens.weight"]):
        parts = [exact(n) for n in group]
        if any(p is None for p in parts):
            for n in group:
                w.add_linear(n, tensor(embed if n == "lm_head.weight" and tied else n))
        else:
            w.add_exact(group, parts)


def _count_linear(files: list[Path]) -> int:
    """Linear layers of a checkpoint (its LM head counted; a tied one is quantized from the embedding)."""
    from safetensors import safe_open

    names = set()
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            names.update(sf.keys())
    return sum(1 for n in names if _is_linear(n)) + 1


def _copy_unquantized(files: list[Path], w: "_Checkpoint", quantize: bool) -> tuple[dict, str | None]:
    """Copy every tensor of ``files`` that stays unquantized into ``w`` (with ``quantize``,
    quantize the linear layers on the way); returns ``(where, embed)``: the file of each
    linear weight (and of the embedding), and the embedding's name or None."""
    from safetensors import safe_open

    embed, where = None, {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                if _is_linear(name) or name == "lm_head.weight":
                    where[name] = f
                    if quantize:
                        w.add_linear(name, sf.get_tensor(name))
                    continue
                w.writer.add(name, sf.get_tensor(name).contiguous())
                if name == "model.embed_tokens.weight":
                    embed, where[name] = name, f
    return where, embed


class _Checkpoint:
    """The prequantized checkpoint :func:`prequantize` writes: its shards, the per-layer
    bits overrides of ``quantization_config``, the 32-block offsets (:data:`MINS_FILE`)
    and the counts of exact and quantized layers."""

    def __init__(self, out: Path, bits: int, head_bits: int, block_size: int, symmetric: bool, layer_bits: dict[str, int]):
        from .shards import ShardWriter

        self.out, self.bits, self.head_bits, self.block_size, self.symmetric, self.layer_bits = out, bits, head_bits, block_size, symmetric, layer_bits
        self.writer = ShardWriter(out)
        self.overrides: dict[str, dict] = {"lm_head": {"bits": head_bits, "group_size": block_size}}
        self.overrides.update({k: {"bits": b, "group_size": block_size} for k, b in layer_bits.items()})
        self.mins: dict[str, np.ndarray] = {}
        self.counts = {"exact": 0, "quantized": 0}
        self.progress = None  # a Progress advanced per layer written (prequantize sets it)

    def write(self, base: str, q, s, z) -> None:
        """One MatMulNBits layer's olive tensors (qweight, scales, qzeros)."""
        import torch

        self.writer.add(base + ".qweight", torch.from_numpy(q))
        self.writer.add(base + ".scales", torch.from_numpy(s))
        self.writer.add(base + ".qzeros", torch.from_numpy(z))

    def add_linear(self, name: str, w) -> None:
        """Quantize the weight ``w`` (torch tensor ``[out, in]``) of layer ``name`` (:func:`quantize_block`)."""
        base = name[: -len(".weight")]
        self.write(
            base,
            *quantize_block(
                w.float().numpy(), self.head_bits if name == "lm_head.weight" else self.layer_bits.get(base, self.bits), self.block_size, self.symmetric
            ),
        )
        self.counts["quantized"] += 1
        if self.progress is not None:
            self.progress.advance()

    def add_exact(self, group: list[str], parts: list) -> None:
        """A fused group's exact blocks (:mod:`specrt.export.gguf_blocks`), regrouped to the
        widest bits and the narrowest group of its parts."""
        from .gguf_blocks import regroup

        b_bits, b_group = max(p.bits for p in parts), min(p.group for p in parts)
        any_min = any(p.mins is not None for p in parts)
        for n, p in zip(group, parts):
            base = n[: -len(".weight")]
            p = regroup(p, b_bits, b_group)
            self.write(base, *_olive_tensors(p))
            self.overrides[base] = {"bits": b_bits, "group_size": b_group}
            if any_min:
                self.mins[base] = p.mins if p.mins is not None else np.zeros((p.q.shape[0], p.q.shape[1] // 32), np.float32)
            self.counts["exact"] += 1
            if self.progress is not None:
                self.progress.advance()

    def close(self, cfg: dict, src: Path) -> int:
        """Finish the shards, write the offsets, ``config.json`` with
        ``quantization_config`` and the tokenizer files copied from ``src``; returns the
        number of shards."""
        shards = self.writer.close()
        if self.mins:
            np.savez(self.out / MINS_FILE, **self.mins)
        cfg["quantization_config"] = {"quant_method": "olive", "bits": self.bits, "group_size": self.block_size, "overrides": self.overrides}
        (self.out / "config.json").write_text(json.dumps(cfg, indent=2))
        for name in _COPIED:
            if (src / name).is_file():
                shutil.copyfile(src / name, self.out / name)
        return shards


def add_min_corrections(graph: str | Path, mins_file: str | Path, log=print) -> int:
    """Subtract each layer's 32-block offsets from its MatMulNBits output, in place:
    ``y = MatMulNBits(x) - ReduceSum(Reshape(x, [..., K/32, 32]), -1) @ M^T`` (the exact
    form of asymmetric GGUF blocks, :mod:`specrt.export.gguf_blocks`).

    The node of a layer is found by its weight initializer (the builder names them
    ``model.layers.{i}.attn.qkv_proj.MatMulNBits.qweight`` for the fused q/k/v, whose rows
    are q, k, v in that order, ``...mlp.down_proj.MatMulNBits.qweight``, ``lm_head...``).

    Returns:
        the number of nodes corrected.

    Raises:
        ExportError: a layer with offsets whose node is not found or has another width.
    """
    import onnx
    from onnx import helper, numpy_helper

    graph = Path(graph)
    with np.load(mins_file) as z:
        mins = {k: z[k] for k in z.files}
    model = onnx.load(str(graph))
    g = model.graph
    by_weight = {n.input[1]: n for n in g.node if n.op_type == "MatMulNBits"}
    done = 0
    new_nodes, inits = [], []
    for weight, node in by_weight.items():
        base = weight[: -len(".MatMulNBits.qweight")] if weight.endswith(".MatMulNBits.qweight") else None
        if base is None:
            continue
        hf = base.replace(".attn.", ".self_attn.")
        parts = [hf[: -len("qkv_proj")] + p + "_proj" for p in "qkv"] if hf.endswith("qkv_proj") else [hf]
        if not any(p in mins for p in parts):
            continue
        if not all(p in mins for p in parts):
            raise ExportError(f"{graph.name}: offsets for only some rows of {node.name}")
        m = np.concatenate([mins.pop(p) for p in parts])
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if m.shape != (attrs["N"], attrs["K"] // 32):
            raise ExportError(f"{graph.name}: offsets {m.shape} do not fit {node.name} (N={attrs['N']}, K={attrs['K']})")
        x, y = node.input[0], node.output[0]
        stem = node.name.rsplit("/", 1)[0] + "/min"
        raw = y + "/before_min"
        node.output[0] = raw
        shape, axes, mt = stem + "/shape", stem + "/axes", stem + "/MT"
        inits += [
            numpy_helper.from_array(np.array([0, 0, attrs["K"] // 32, 32], np.int64), shape),
            numpy_helper.from_array(np.array([-1], np.int64), axes),
            numpy_helper.from_array(np.ascontiguousarray(m.T), mt),
        ]
        new_nodes += [
            helper.make_node("Reshape", [x, shape], [stem + "/blocks"], name=stem + "/Reshape"),
            helper.make_node("ReduceSum", [stem + "/blocks", axes], [stem + "/sums"], name=stem + "/ReduceSum", keepdims=0),
            helper.make_node("MatMul", [stem + "/sums", mt], [stem + "/offset"], name=stem + "/MatMul"),
            helper.make_node("Sub", [raw, stem + "/offset"], [y], name=stem + "/Sub"),
        ]
        done += 1
    if mins:
        raise ExportError(f"{graph.name}: no MatMulNBits node for {', '.join(sorted(mins)[:3])}")
    g.initializer.extend(inits)
    g.node.extend(new_nodes)
    nodes = _topological(list(g.node))
    del g.node[:]
    g.node.extend(nodes)
    _save_with_data(model, graph)
    log(f"  {done} layers with asymmetric source blocks: their 32-block offsets subtracted exactly (x block sums @ M)")
    return done


def _save_with_data(model, graph: Path) -> None:
    """Save ``model`` as ``graph`` with its weights in ``<graph>.data``, both written under a
    staging folder and moved over the old files (:func:`specrt.runtime.fileio.staged_dir`)."""
    import onnx

    from specrt.runtime.fileio import staged_dir

    with staged_dir(graph.parent) as stage:
        onnx.save(model, str(stage / graph.name), save_as_external_data=True, all_tensors_to_one_file=True, location=graph.name + ".data", size_threshold=1024)


def _topological(nodes: list) -> list:
    """Nodes ordered so every input is produced before it is used (ONNX requires it)."""
    produced = {o for n in nodes for o in n.output}
    ready = set()
    out, pending = [], list(nodes)
    while pending:
        rest = []
        for n in pending:
            if all(i == "" or i not in produced or i in ready for i in n.input):
                out.append(n)
                ready.update(n.output)
            else:
                rest.append(n)
        if len(rest) == len(pending):
            raise ExportError("the graph has a cycle after inserting the offset corrections")
        pending = rest
    return out


def quantize_embedding(graph: str | Path, block_size: int, log=print) -> bool:
    """Quantize the embedding table of a builder graph to int4 (``GatherBlockQuantized``),
    with onnxruntime's ``MatMulNBitsQuantizer`` (its Gather path), in place.

    Args:
        graph: the ``.onnx`` file (weights in ``<graph>.data`` beside it).
        block_size: weights per block along the hidden dimension.

    Returns:
        True when a float ``/model/embed_tokens/Gather`` was found and quantized.
    """
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    graph = Path(graph)
    model = onnx.load(str(graph))
    if not any(n.name == "/model/embed_tokens/Gather" and n.op_type == "Gather" for n in model.graph.node):
        return False
    q = MatMulNBitsQuantizer(
        model,
        bits=4,
        block_size=block_size,
        is_symmetric=True,
        nodes_to_include=["/model/embed_tokens/Gather"],
        op_types_to_quantize=("Gather",),
    )
    q.process()
    del model
    _save_with_data(q.model.model, graph)
    log(f"  embedding table quantized to int4 (GatherBlockQuantized, blocks of {block_size})")
    return True
