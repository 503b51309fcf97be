"""Per-architecture declarations: where a Hugging Face causal LM keeps the pieces the
IO-bound KV export needs, and which config options are supported.

One :class:`ArchSpec` per family, keyed by ``config.model_type``; the exporter has no
per-model branches. Llama-style families (Llama, Mistral, Qwen2) share module names.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its config options cannot be exported."""


@dataclass(frozen=True)
class ArchSpec:
    """Accessors for the submodules of one architecture family (functions of the HF model)."""

    family: str  # name recorded in the manifest
    embed: Callable[[Any], Any]  # token embedding module
    layers: Callable[[Any], Any]  # list of decoder layers (self_attn.{q,k,v,o}_proj, mlp, norms)
    rotary: Callable[[Any], Any]  # rotary module: (x, position_ids) -> (cos, sin)
    final_norm: Callable[[Any], Any]
    lm_head: Callable[[Any], Any]


_LLAMA = ArchSpec(
    family="llama",
    embed=lambda m: m.model.embed_tokens,
    layers=lambda m: m.model.layers,
    rotary=lambda m: m.model.rotary_emb,
    final_norm=lambda m: m.model.norm,
    lm_head=lambda m: m.lm_head,
)

REGISTRY: dict[str, ArchSpec] = {"llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA}
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def spec_for(config: Any, max_ctx: int | None = None) -> ArchSpec:
    """Return the :class:`ArchSpec` for a HF config.

    Raises:
        UnsupportedModelError: unknown ``model_type`` (the message lists the supported ones),
            an unsupported RoPE scaling type, or a sliding attention window (Mistral/Qwen2)
            shorter than ``max_ctx``, since the export uses full causal attention.
    """
    mt = getattr(config, "model_type", None)
    if mt not in REGISTRY:
        raise UnsupportedModelError(f"model_type={mt!r} is not supported; supported: {', '.join(sorted(REGISTRY))}")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and max_ctx is not None and window < max_ctx:
        raise UnsupportedModelError(
            f"sliding_window={window} < max_ctx={max_ctx}: sliding-window attention is not exported; "
            f"export with --max-ctx {window} or less (within the window attention is full causal)"
        )
    return REGISTRY[mt]
