"""Torch module that exposes a decoder-only LM with an IO-bound KV interface for export.

Interface (one model call, batch 1; q new tokens after L past ones)::

    inputs : input_ids     int64   [1, q]
             position_ids  int64   [1, q]
             past_key_i    float32 [1, L, n_kv_heads, head_dim]   (i = 0..n_layers-1)
             past_value_i  float32 [1, L, n_kv_heads, head_dim]
    outputs: logits        float32 [1, q, vocab]
             new_key_i     float32 [1, q, n_kv_heads, head_dim]   (post-RoPE keys)
             new_value_i   float32 [1, q, n_kv_heads, head_dim]

Only the q new KV rows are returned, never the concatenation, so that the runtime can
bind them straight into its preallocated buffer at offset L (in-place KV, no copies).
The q new tokens attend causally to the L past rows and to each other.

The forward re-uses the Hugging Face model's own submodules (embeddings, norms,
projections, MLP, rotary embedding), so weights and RoPE variants come from the
checkpoint; only the attention wiring is written here. Which submodules to use is
declared per architecture in :mod:`specrt.export.arch`.
"""
from __future__ import annotations

import torch
from torch import nn

from .arch import ArchSpec, spec_for


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class KVExportModel(nn.Module):
    """Wraps a Hugging Face ``*ForCausalLM`` (eval mode, fp32) for IO-bound KV export.

    Args:
        hf_model: a loaded causal LM whose ``config.model_type`` is in the registry of
            :mod:`specrt.export.arch`.

    Raises:
        specrt.export.arch.UnsupportedModelError: unknown ``model_type`` or config option.
    """

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model
        self.spec: ArchSpec = spec_for(hf_model.config)
        cfg = hf_model.config
        self.n_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.scale = self.head_dim**-0.5

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *past: torch.Tensor):
        s = self.spec
        m = self.hf
        q_len = input_ids.shape[1]
        past_len = past[0].shape[1]
        h = s.embed(m)(input_ids)
        cos, sin = s.rotary(m)(h, position_ids)  # [1, q, head_dim]
        cos = cos.unsqueeze(2)
        sin = sin.unsqueeze(2)
        # causal mask over [past | new]: new token i sees past rows and new rows j <= i
        rows = torch.arange(q_len, device=h.device).unsqueeze(1)
        cols = torch.arange(past_len + q_len, device=h.device).unsqueeze(0)
        blocked = cols > rows + past_len  # [q, L+q]
        bias = torch.zeros(blocked.shape, dtype=h.dtype).masked_fill(blocked, float("-inf"))
        new_kv = []
        groups = self.n_heads // self.n_kv
        for i, layer in enumerate(s.layers(m)):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(1, q_len, self.n_heads, self.head_dim)
            k = attn.k_proj(x).view(1, q_len, self.n_kv, self.head_dim)
            v = attn.v_proj(x).view(1, q_len, self.n_kv, self.head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            new_kv += [k, v]
            k_all = torch.cat([past[2 * i], k], dim=1).transpose(1, 2)  # [1, kv, L+q, d]
            v_all = torch.cat([past[2 * i + 1], v], dim=1).transpose(1, 2)
            if groups > 1:
                k_all = k_all.repeat_interleave(groups, dim=1)
                v_all = v_all.repeat_interleave(groups, dim=1)
            scores = torch.matmul(q.transpose(1, 2), k_all.transpose(2, 3)) * self.scale + bias
            probs = torch.softmax(scores.float(), dim=-1).to(h.dtype)
            ctx = torch.matmul(probs, v_all).transpose(1, 2).reshape(1, q_len, self.n_heads * self.head_dim)
            h = h + attn.o_proj(ctx)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = s.lm_head(m)(s.final_norm(m)(h))
        return (logits.float(), *new_kv)
