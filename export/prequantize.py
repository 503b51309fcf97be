"""Integer weights one tensor at a time: a Hugging Face folder -> a prequantized checkpoint that
onnxruntime-genai's model builder re-exports without ever holding the float model.

Why: for ``--precision int4|int8`` the builder loads the checkpoint in PyTorch, emits an ONNX
graph whose weights are all float32 *in memory*, and only then quantizes it with
onnxruntime's ``MatMulNBitsQuantizer``: 13.6 GB peak RSS for Qwen2.5-Coder-1.5B (measured,
docs/REAL_PAIR.md), whatever the checkpoint's dtype. A checkpoint that is already quantized
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

__all__ = ["LINEAR_SUFFIXES", "prequantize", "quantize_block", "quantize_embedding"]

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


def prequantize(folder: str | Path, out: str | Path, bits: int, block_size: int, head_bits: int | None = None, *, symmetric: bool = True, log=print) -> Path:
    """Write the prequantized checkpoint of ``folder`` into ``out`` (see the module docstring).

    Args:
        folder: a Hugging Face checkpoint folder (safetensors weights, config, tokenizer).
        out: the folder to (over)write.
        bits: 4 or 8 for the decoder's linear layers. block_size: weights per block.
        head_bits: the LM head's bits (None: ``bits``).
        symmetric: symmetric blocks (the builder's default; False: unsigned values with a
            zero point per block).

    Returns:
        ``out``: config.json with ``quantization_config`` (``quant_method`` ``olive``, bits,
        group size, the head's override), safetensors shards, the tokenizer files.

    Raises:
        ExportError: no safetensors weights, a layer width the block size does not divide.
    """
    import torch
    from safetensors import safe_open

    from .shards import ShardWriter

    src, out = Path(folder), Path(out)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ExportError(f"{src} has no .safetensors weights to quantize")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    head_bits = head_bits or bits
    t0 = time.perf_counter()
    writer = ShardWriter(out)
    quantized = 0
    embed = None

    def add_linear(name: str, w) -> None:
        q, s, z = quantize_block(w.float().numpy(), head_bits if name == "lm_head.weight" else bits, block_size, symmetric)
        base = name[: -len(".weight")]
        writer.add(base + ".qweight", torch.from_numpy(q))
        writer.add(base + ".scales", torch.from_numpy(s))
        writer.add(base + ".qzeros", torch.from_numpy(z))

    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                t = sf.get_tensor(name)
                if _is_linear(name) or name == "lm_head.weight":
                    add_linear(name, t)
                    quantized += 1
                else:
                    writer.add(name, t.contiguous())
                    if name == "model.embed_tokens.weight":
                        embed = name
                del t
    if "lm_head.qweight" not in writer.names:  # tied: the head is the embedding table
        if embed is None:
            raise ExportError(f"{src}: neither lm_head.weight nor model.embed_tokens.weight found")
        with safe_open(str(next(f for f in files if embed in safe_open(str(f), framework="pt").keys())), framework="pt") as sf:
            add_linear("lm_head.weight", sf.get_tensor(embed))
        cfg["tie_word_embeddings"] = False  # the builder reads a separate (quantized) head
    shards = writer.close()
    cfg["quantization_config"] = {
        "quant_method": "olive",
        "bits": bits,
        "group_size": block_size,
        "overrides": {"lm_head": {"bits": head_bits, "group_size": block_size}},
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in _COPIED:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    log(
        f"  prequantized {quantized} linear layers ({bits}-bit, head {head_bits}-bit, blocks of {block_size}) into {shards} shard(s): {time.perf_counter() - t0:.1f} s"
    )
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
    data = graph.with_name(graph.name + ".data")
    data.unlink(missing_ok=True)
    onnx.save(q.model.model, str(graph), save_as_external_data=True, all_tensors_to_one_file=True, location=data.name, size_threshold=1024)
    log(f"  embedding table quantized to int4 (GatherBlockQuantized, blocks of {block_size})")
    return True
