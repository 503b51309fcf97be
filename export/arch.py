"""Per-architecture declarations: where a Hugging Face causal LM keeps the pieces the
IO-bound KV export needs, how they differ between families, and which config options
are supported.

One :class:`ArchSpec` per family, keyed by ``config.model_type`` in :data:`REGISTRY`; the
exporter (:mod:`specrt.export.kv_model`) reads the declaration and has no per-model
branches. What differs between the supported families:

============  ==========================  =============  ==========  ====================
family        q/k/v                       positions      norms       notes
============  ==========================  =============  ==========  ====================
llama         q_proj, k_proj, v_proj      RoPE           RMSNorm     GQA, optional biases
mistral       q_proj, k_proj, v_proj      RoPE           RMSNorm     sliding_window config
qwen2         q_proj, k_proj, v_proj      RoPE           RMSNorm     q/k/v biases, sliding
                                                                     layers (layer_types)
phi3          fused qkv_proj [q|k|v]      RoPE (partial  RMSNorm     fused gate_up MLP,
                                          rotary ok)                 longrope
gpt2          fused c_attn (Conv1D)       learned wpe    LayerNorm   tied embeddings
============  ==========================  =============  ==========  ====================

The MLP, norms, projections and rotary module are the checkpoint's own modules, so their
biases, activations and epsilons come from the checkpoint; the attention scale is read
from each attention module's ``scaling`` (GPT-2's ``scale_attn_by_inverse_layer_idx``
included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specrt.runtime.errors import UnsupportedModelError  # noqa: F401  (in the SpecRTError tree)


@dataclass(frozen=True)
class ArchSpec:
    """What one architecture family looks like, as dotted attribute paths.

    Paths starting at the ``*ForCausalLM`` model: ``embed``, ``layers``, ``final_norm``,
    ``lm_head``, ``rotary`` and ``pos_embed``. Paths inside one decoder layer: ``attn``,
    ``norm_attn``, ``norm_mlp``, ``mlp``. Paths inside the attention module: ``qkv`` and
    ``o_proj``.

    Attributes:
        family: name recorded in the manifest.
        embed: token embedding (``nn.Embedding``: int64 ``[1, q]`` -> ``[1, q, hidden]``).
        layers: the list of decoder layers.
        final_norm: norm applied before the LM head.
        lm_head: ``[1, q, hidden]`` -> logits ``[1, q, vocab]`` (tied weights are fine).
        attn: the self-attention module of a layer.
        qkv: three names (separate q, k, v projections) or one name (one fused projection
            whose output is ``[q (n_heads*d) | k (n_kv*d) | v (n_kv*d)]``, which covers
            Phi-3's ``qkv_proj`` and GPT-2's Conv1D ``c_attn``).
        o_proj: the attention output projection.
        norm_attn, norm_mlp: the pre-attention and pre-MLP norms (pre-norm residual blocks).
        mlp: the MLP module, called as ``mlp(x)``.
        rotary: the rotary module ``(x, position_ids) -> (cos, sin)`` for RoPE families,
            else ``None``.
        pos_embed: learned absolute position embedding (added to the token embedding),
            else ``None``. Exactly one of ``rotary`` / ``pos_embed`` is set.
        must_be_off: config flags this export does not implement (refused when truthy).
    """

    family: str
    embed: str
    layers: str
    final_norm: str
    lm_head: str
    attn: str
    qkv: tuple[str, ...]
    o_proj: str
    norm_attn: str
    norm_mlp: str
    mlp: str
    rotary: str | None = None
    pos_embed: str | None = None
    must_be_off: tuple[str, ...] = ()

    def __post_init__(self):
        if (self.rotary is None) == (self.pos_embed is None):
            raise ValueError(f"{self.family}: declare exactly one of rotary / pos_embed")
        if len(self.qkv) not in (1, 3):
            raise ValueError(f"{self.family}: qkv must name 1 fused or 3 separate projections, got {self.qkv}")

    @staticmethod
    def get(obj: Any, path: str) -> Any:
        """Follow a dotted attribute path (``"model.layers"``) from ``obj``."""
        for name in path.split("."):
            obj = getattr(obj, name)
        return obj


_LLAMA = ArchSpec(
    family="llama",
    embed="model.embed_tokens",
    layers="model.layers",
    final_norm="model.norm",
    lm_head="lm_head",
    attn="self_attn",
    qkv=("q_proj", "k_proj", "v_proj"),
    o_proj="o_proj",
    norm_attn="input_layernorm",
    norm_mlp="post_attention_layernorm",
    mlp="mlp",
    rotary="model.rotary_emb",
)
_MISTRAL = ArchSpec(**{**_LLAMA.__dict__, "family": "mistral"})
_QWEN2 = ArchSpec(**{**_LLAMA.__dict__, "family": "qwen2"})  # q/k/v biases live in the Linear modules
_PHI3 = ArchSpec(**{**_LLAMA.__dict__, "family": "phi3", "qkv": ("qkv_proj",)})  # MLP: fused gate_up_proj inside
_GPT2 = ArchSpec(
    family="gpt2",
    embed="transformer.wte",
    pos_embed="transformer.wpe",
    layers="transformer.h",
    final_norm="transformer.ln_f",
    lm_head="lm_head",
    attn="attn",
    qkv=("c_attn",),
    o_proj="c_proj",
    norm_attn="ln_1",
    norm_mlp="ln_2",
    mlp="mlp",
    must_be_off=("add_cross_attention",),
)

REGISTRY: dict[str, ArchSpec] = {"llama": _LLAMA, "mistral": _MISTRAL, "qwen2": _QWEN2, "phi3": _PHI3, "gpt2": _GPT2}

# RoPE types whose frequencies are fixed at load time (exact for every position).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# RoPE types Hugging Face recomputes from the current sequence length; exported with the
# load-time frequencies, which is exact only while every position stays below the
# length where Hugging Face would switch (checked against max_ctx).
LENGTH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")
SUPPORTED_ROPE_TYPES = STATIC_ROPE_TYPES + LENGTH_DEPENDENT_ROPE_TYPES
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


def check_model_type(model_type: str | None, source: str | None = None, label: str = "model_type") -> ArchSpec:
    """The :class:`ArchSpec` of a ``model_type`` in :data:`REGISTRY` (the one list of
    supported families, for the full check :func:`spec_for` and the export's early one).

    Args:
        model_type: a Hugging Face ``model_type`` (``"qwen2"``, ...), or None.
        source: what the value was read from, starting the message (e.g. the file), or None.
        label: the value's name in the message (e.g. ``"GGUF general.architecture"``).

    Raises:
        UnsupportedModelError: ``model_type`` is not supported (the message lists the
            supported ones).
    """
    if model_type not in REGISTRY:
        where = f"{source}: " if source else ""
        raise UnsupportedModelError(f"{where}{label}={model_type!r} is not supported; supported: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[model_type]


def rope_type(config: Any) -> str | None:
    """The RoPE scaling type of a config (``"default"`` when none), ``None`` if it has no RoPE parameters."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if rope is None:
        return None
    if not isinstance(rope, dict):
        raise UnsupportedModelError(f"rope_parameters={rope!r} is not a dict; per-layer-type RoPE is not supported")
    if all(isinstance(v, dict) for v in rope.values()) and rope:
        raise UnsupportedModelError(f"per-layer-type rope_parameters ({', '.join(rope)}) are not supported")
    return rope.get("rope_type", rope.get("type", "default"))


def _config_max_pos(config: Any) -> int | None:
    return getattr(config, "max_position_embeddings", None)


def spec_for(config: Any, max_ctx: int | None = None) -> ArchSpec:
    """Return the :class:`ArchSpec` for a HF config, after checking the config options.

    Args:
        config: a Hugging Face ``PretrainedConfig`` (``model_type`` selects the family).
        max_ctx: the context the export is for (positions ``0..max_ctx-1``); ``None``
            skips the checks that depend on it.

    Raises:
        UnsupportedModelError: with a message naming the value and what is allowed, for
            an unknown ``model_type`` (the message lists the supported ones); a config
            flag the family's export does not implement (e.g. GPT-2
            ``add_cross_attention``); ``max_ctx`` above ``max_position_embeddings``; an
            unsupported RoPE scaling type; ``dynamic`` RoPE with ``max_ctx`` above
            ``max_position_embeddings`` or ``longrope`` with ``max_ctx`` above
            ``original_max_position_embeddings`` (Hugging Face would switch frequencies
            mid-sequence); a ``layer_types`` entry other than full/sliding attention; or a
            sliding attention window shorter than ``max_ctx`` (the export uses full
            causal attention, which equals sliding attention only within the window).
    """
    mt = getattr(config, "model_type", None)
    spec = check_model_type(mt)
    for flag in spec.must_be_off:
        if getattr(config, flag, False):
            raise UnsupportedModelError(f"{mt}: {flag}={getattr(config, flag)!r} is not supported by the export; it must be off")
    max_pos = _config_max_pos(config)
    if max_ctx is not None and max_pos is not None and max_ctx > max_pos:
        raise UnsupportedModelError(f"max_ctx={max_ctx} > max_position_embeddings={max_pos} of this {mt} checkpoint; export with --max-ctx {max_pos} or less")
    if spec.rotary is not None:
        rt = rope_type(config) or "default"
        if rt not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(f"{mt}: rope type {rt!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        if rt == "longrope" and max_ctx is not None:
            rope = getattr(config, "rope_parameters", None) or {}
            orig = rope.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
            if orig is None:
                raise UnsupportedModelError(f"{mt}: longrope without original_max_position_embeddings is not supported")
            if max_ctx > orig:
                raise UnsupportedModelError(
                    f"{mt}: longrope with max_ctx={max_ctx} > original_max_position_embeddings={orig}: Hugging Face switches "
                    f"to the long factors beyond {orig} tokens, which the export does not implement; export with --max-ctx {orig} or less"
                )
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        odd = sorted(set(layer_types) - set(ATTENTION_LAYER_TYPES))
        if odd:
            raise UnsupportedModelError(f"{mt}: layer_types {odd} are not supported; supported: {', '.join(ATTENTION_LAYER_TYPES)}")
    window = getattr(config, "sliding_window", None)
    sliding = bool(window) and getattr(config, "use_sliding_window", True)
    if layer_types is not None and "sliding_attention" not in layer_types:
        sliding = False  # e.g. Qwen2 with every layer below max_window_layers
    if sliding and max_ctx is not None and window < max_ctx:
        raise UnsupportedModelError(
            f"sliding_window={window} < max_ctx={max_ctx}: sliding-window attention is not exported; "
            f"export with --max-ctx {window} or less (within the window attention is full causal)"
        )
    return spec
