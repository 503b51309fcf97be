"""A Hugging Face checkpoint's weights as a GGUF file of blocks quantized by specrt, for the kernels.

An int8/int4 CPU export of a checkpoint folder (not a GGUF file) gets panels for specrt's
kernels too (:func:`specrt.export.pipeline._kernel_records`): its weights are quantized here
into llama.cpp's block types with gguf-py's quantizers (numpy ports of llama.cpp's reference
``quantize_row_q8_0_ref`` / ``quantize_row_q4_0_ref``), written as a GGUF file of the
``llama``/``qwen2``/``qwen3``/``phi3`` layout llama.cpp's ``convert_hf_to_gguf.py`` writes (the
``llama`` q/k rows permuted from Hugging Face's rotate-half order to GGUF's interleaved
pairs), and then packed and checked exactly as a downloaded GGUF file is
(:mod:`specrt.export.kernel_pack`). The file is a scratch input: the engine keeps only the
panels.

Types: ``int8`` -> every matrix Q8_0; ``int4`` -> the layers' matrices Q4_0, the embedding
and LM head Q8_0 (the head decides every token; llama.cpp's Q4_0 files keep it wider too).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

__all__ = ["CHECKPOINT_TYPES", "checkpoint_unsupported", "write_checkpoint_gguf"]

Q4_0, Q8_0 = 2, 8  # ggml type ids
CHECKPOINT_TYPES = {"int8": {"layers": Q8_0, "embd": Q8_0}, "int4": {"layers": Q4_0, "embd": Q8_0}}
_ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3"}  # model_type -> llama.cpp architecture
_LAYER = {  # Hugging Face name under model.layers.{i}. -> GGUF name under blk.{i}.
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",  # phi3's fused projections, kept fused (split at pack time)
    "mlp.gate_up_proj.weight": "ffn_up.weight",
}


def _config(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def _rope(cfg: dict) -> tuple[float, str]:
    """(rope theta, rope type) from a config of transformers 4 (``rope_theta``,
    ``rope_scaling``) or 5 (``rope_parameters``)."""
    p = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = float(p.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = p.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return theta, str(kind)


def checkpoint_unsupported(model_dir: str | Path) -> str | None:
    """None when :func:`write_checkpoint_gguf` can write this checkpoint for the kernels, else
    why not (one line). Reads ``config.json`` only."""
    cfg = _config(Path(model_dir))
    mt = cfg.get("model_type")
    if mt not in _ARCHS:
        return f"model_type {mt!r} (the kernels run {', '.join(sorted(_ARCHS))} checkpoints)"
    _, kind = _rope(cfg)
    if kind != "default":
        return f"rope type {kind!r} (the kernels' checkpoint path takes plain RoPE)"
    if float(cfg.get("partial_rotary_factor") or 1.0) != 1.0:
        return f"partial rotary ({cfg['partial_rotary_factor']} of each head)"
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", mt in ("mistral", "phi3")):
        return f"sliding-window attention ({cfg['sliding_window']} positions)"
    if mt in ("llama", "mistral", "qwen3", "phi3") and cfg.get("attention_bias"):
        return f"{mt} with attention biases"
    if cfg.get("mlp_bias"):
        return "MLP biases"
    if cfg.get("quantization_config"):
        return f"a pre-quantized checkpoint ({(cfg['quantization_config'] or {}).get('quant_method', 'quantization_config')})"
    return None


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of a ``llama`` q or k projection (or bias) from Hugging Face's rotate-half RoPE
    order to GGUF's interleaved pairs: llama.cpp's ``LlamaModel.permute`` in
    ``convert_hf_to_gguf.py``."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(model_dir: Path):
    """``(Hugging Face name, GGUF name, float32 array)`` of every weight the decoder reads, one
    at a time (a name the layout does not need is skipped before its bytes are read). With a
    ``model.safetensors.index.json`` only the files its ``weight_map`` names are read (a
    folder may hold a second copy of the weights, e.g. Mistral's ``consolidated``). Read with
    safetensors' torch framework: numpy has no bfloat16, the dtype of most checkpoints."""
    from safetensors import safe_open

    index = Path(model_dir) / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({Path(model_dir) / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors file (the kernels' checkpoint path reads safetensors)")
    for f in files:
        with safe_open(str(f), framework="pt") as s:
            for name in s.keys():
                gname = _gguf_name(name)
                if gname is not None:
                    yield name, gname, s.get_tensor(name).float().numpy()


def write_checkpoint_gguf(model_dir: str | Path, path: str | Path, precision: str) -> dict:
    """Write the checkpoint in ``model_dir`` to the GGUF file ``path`` with its matrices
    quantized for ``precision`` (:data:`CHECKPOINT_TYPES`).

    Args:
        model_dir: a Hugging Face folder (``config.json``, ``*.safetensors``) of a model
            :func:`checkpoint_unsupported` accepts.
        path: the GGUF file to write.
        precision: ``int8`` or ``int4``.

    Returns:
        ``{"arch", "types": {"layers", "embd"} (ggml type names), "by"}``: the record the
        manifest keeps of how the panels were quantized.

    Raises:
        ValueError: an unsupported checkpoint (:func:`checkpoint_unsupported`'s reason), a
            precision other than int8/int4, or a tensor the layout does not know.
    """
    import gguf
    from gguf.quants import quantize

    model_dir = Path(model_dir)
    why = checkpoint_unsupported(model_dir)
    if why:
        raise ValueError(f"{model_dir}: the kernels cannot run this checkpoint: {why}")
    if precision not in CHECKPOINT_TYPES:
        raise ValueError(f"precision {precision!r}; the kernels' checkpoint path takes {', '.join(CHECKPOINT_TYPES)}")
    cfg = _config(model_dir)
    arch = _ARCHS[cfg["model_type"]]
    n_head, n_embd = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    n_head_kv = int(cfg.get("num_key_value_heads") or n_head)
    head_dim = int(cfg.get("head_dim") or n_embd // n_head)
    theta, _ = _rope(cfg)
    types = CHECKPOINT_TYPES[precision]
    w = gguf.GGUFWriter(str(path), arch, use_temp_file=True)  # each tensor's blocks leave RAM as they are added
    w.add_block_count(int(cfg["num_hidden_layers"]))
    w.add_context_length(int(cfg.get("max_position_embeddings", 4096)))
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    for _, gname, a in _tensors(model_dir):
        if gname == "output.weight" and cfg.get("tie_word_embeddings"):
            continue  # a tied head is the embedding's rows (plan_tensors takes token_embd then)
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):
            a = _permute(a, n_head if "attn_q" in gname else n_head_kv)
        ty = types["embd"] if gname in ("token_embd.weight", "output.weight") else types["layers"]
        if a.ndim == 2 and a.shape[1] % 32 == 0:
            w.add_tensor(gname, quantize(a, gguf.GGMLQuantizationType(ty)), raw_dtype=gguf.GGMLQuantizationType(ty))
        else:  # norms and biases stay float32, as llama.cpp writes them
            w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    name = lambda t: gguf.GGMLQuantizationType(t).name  # noqa: E731
    return {
        "arch": arch,
        "types": {"layers": name(types["layers"]), "embd": name(types["embd"])},
        "by": "gguf-py's quantize (llama.cpp's reference quantizers) from the checkpoint's weights",
    }


def _gguf_name(name: str) -> str | None:
    """The GGUF name of a Hugging Face tensor name (None: not a weight the decoder reads, e.g.
    rotary caches). Raises ValueError for a layer tensor the layout does not know."""
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    if name.startswith("model.layers."):
        i, rest = name[len("model.layers.") :].split(".", 1)
        if rest.endswith("rotary_emb.inv_freq"):
            return None
        if rest not in _LAYER:
            raise ValueError(f"checkpoint tensor {name}: not a tensor of the llama/qwen2/qwen3/phi3 layout the kernels run")
        return f"blk.{i}.{_LAYER[rest]}"
    return None
