"""Torch module that exposes a decoder-only LM with an IO-bound KV interface for export.

Interface (one model call, batch 1; q new tokens after L past ones)::

    inputs : input_ids     int64   [1, q]
             position_ids  int64   [1, q]
             past_key_i    float32 [1, L, n_kv_heads, head_dim]   (i = 0..n_layers-1)
             past_value_i  float32 [1, L, n_kv_heads, head_dim]
    outputs: logits        float32 [1, q, vocab]
             new_key_i     float32 [1, q, n_kv_heads, head_dim]   (post-RoPE keys for RoPE families)
             new_value_i   float32 [1, q, n_kv_heads, head_dim]

For the runtime's ``lazy-head`` verification the same forward is also exported in two
parts (:class:`KVBodyModel`: the same inputs -> ``hidden`` float32 ``[1, q, hidden]`` after
the final norm + the new KV rows; :class:`HeadModel`: ``hidden`` ``[1, r, hidden]`` ->
``logits`` ``[1, r, vocab]``), so the vocabulary projection can run on fewer rows.

Only the q new KV rows are returned, never the concatenation, so that the runtime can
bind them straight into its preallocated buffer at offset L (in-place KV, no copies).
The q new tokens attend causally to the L past rows and to each other.

The forward re-uses the Hugging Face model's own submodules (embeddings, norms,
projections, MLP, rotary embedding), so weights and RoPE variants come from the
checkpoint; only the attention wiring is written here. Which submodules to use, how
q/k/v come out of a layer and how positions enter are declared per architecture in
:mod:`specrt.export.arch`; the forward has no per-model branches.
"""

from __future__ import annotations

import torch
from torch import nn

from .arch import ArchSpec, spec_for


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``cos.shape[-1]`` dims of ``x`` ``[1, q, heads, d]``; the rest pass
    through (partial rotary, e.g. Phi-3 ``partial_rotary_factor`` < 1)."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)


def _static_rotary_forward(rotary: nn.Module):
    """The rotary module's own forward, minus Hugging Face's ``dynamic_rope_update`` wrapper.

    That wrapper recomputes the frequencies from the largest position of the current call
    (``dynamic`` / ``longrope`` types; a no-op for the others). :func:`spec_for` refuses
    the contexts where it would change anything, so the load-time frequencies are exact,
    and skipping it keeps the export free of data-dependent branches and buffer writes.
    """
    from transformers.modeling_rope_utils import dynamic_rope_update

    marker = dynamic_rope_update(lambda self, x, position_ids: None).__code__
    fwd = type(rotary).forward
    if getattr(fwd, "__code__", None) is marker:
        fwd = fwd.__wrapped__
    return lambda x, position_ids: fwd(rotary, x, position_ids)


class KVExportModel(nn.Module):
    """Wraps a Hugging Face ``*ForCausalLM`` (eval mode, fp32) for IO-bound KV export.

    The forward follows the family's :class:`~specrt.export.arch.ArchSpec` (module
    paths, separate or fused q/k/v, RoPE or learned positions); see the module docstring
    for the interface.

    Args:
        hf_model: a loaded causal LM whose ``config.model_type`` is in the registry of
            :mod:`specrt.export.arch`.
        max_ctx: the context the export is for (checked against the config), or ``None``.

    Raises:
        specrt.export.arch.UnsupportedModelError: unknown ``model_type`` or config option.
    """

    def __init__(self, hf_model: nn.Module, max_ctx: int | None = None):
        super().__init__()
        self.hf = hf_model
        self.spec: ArchSpec = spec_for(hf_model.config, max_ctx)
        cfg = hf_model.config
        s = self.spec
        self.n_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        layers = s.get(hf_model, s.layers)
        if len(layers) != self.n_layers:
            raise ValueError(f"config says {self.n_layers} layers, the model has {len(layers)}")
        # per-layer attention scale from the module itself (GPT-2 may scale by 1/(layer+1))
        default = self.head_dim**-0.5
        self.scales = [float(getattr(s.get(layer, s.attn), "scaling", default)) for layer in layers]
        self._rotary = _static_rotary_forward(s.get(hf_model, s.rotary)) if s.rotary else None
        q_w, kv_w = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self._split = [q_w, kv_w, kv_w]

    def _qkv(self, attn: nn.Module, x: torch.Tensor):
        """Flat q ``[1, q, H*d]``, k and v ``[1, q, KV*d]`` from separate or fused projections."""
        names = self.spec.qkv
        if len(names) == 3:
            return tuple(getattr(attn, n)(x) for n in names)
        return getattr(attn, names[0])(x).split(self._split, dim=-1)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *past: torch.Tensor):
        """``(logits [1, q, vocab] float32, *new_kv)``; see the module docstring."""
        hidden, new_kv = self.body(input_ids, position_ids, *past)
        return (self.head(hidden), *new_kv)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The vocabulary projection: final-norm hidden states ``[1, r, hidden]`` ->
        logits ``[1, r, vocab]`` float32 (the checkpoint's own ``lm_head``)."""
        return ArchSpec.get(self.hf, self.spec.lm_head)(hidden).float()

    def body(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *past: torch.Tensor):
        """Everything but the vocabulary projection: ``(hidden [1, q, hidden], new_kv)``,
        ``hidden`` after the final norm, ``new_kv`` the list of the q new key/value rows
        per layer (key_0, value_0, key_1, ...)."""
        s = self.spec
        m = self.hf
        get = ArchSpec.get
        q_len = input_ids.shape[1]
        past_len = past[0].shape[1]
        h = get(m, s.embed)(input_ids)
        if s.pos_embed is not None:
            h = h + get(m, s.pos_embed)(position_ids)
        if self._rotary is not None:
            cos, sin = self._rotary(h, position_ids)  # [1, q, rotary_dim]
            cos = cos.unsqueeze(2)
            sin = sin.unsqueeze(2)
        # causal mask over [past | new]: new token i sees past rows and new rows j <= i
        rows = torch.arange(q_len, device=h.device).unsqueeze(1)
        cols = torch.arange(past_len + q_len, device=h.device).unsqueeze(0)
        blocked = cols > rows + past_len  # [q, L+q]
        bias = torch.zeros(blocked.shape, dtype=h.dtype).masked_fill(blocked, float("-inf"))
        new_kv = []
        groups = self.n_heads // self.n_kv
        for i, layer in enumerate(get(m, s.layers)):
            attn = get(layer, s.attn)
            x = get(layer, s.norm_attn)(h)
            q, k, v = self._qkv(attn, x)
            q = q.view(1, q_len, self.n_heads, self.head_dim)
            k = k.view(1, q_len, self.n_kv, self.head_dim)
            v = v.view(1, q_len, self.n_kv, self.head_dim)
            if self._rotary is not None:
                q = _apply_rope(q, cos, sin)
                k = _apply_rope(k, cos, sin)
            new_kv += [k, v]
            k_all = torch.cat([past[2 * i], k], dim=1).transpose(1, 2)  # [1, kv, L+q, d]
            v_all = torch.cat([past[2 * i + 1], v], dim=1).transpose(1, 2)
            if groups > 1:
                k_all = k_all.repeat_interleave(groups, dim=1)
                v_all = v_all.repeat_interleave(groups, dim=1)
            scores = torch.matmul(q.transpose(1, 2), k_all.transpose(2, 3)) * self.scales[i] + bias
            probs = torch.softmax(scores.float(), dim=-1).to(h.dtype)
            ctx = torch.matmul(probs, v_all).transpose(1, 2).reshape(1, q_len, self.n_heads * self.head_dim)
            h = h + get(attn, s.o_proj)(ctx)
            h = h + get(layer, s.mlp)(get(layer, s.norm_mlp)(h))
        return get(m, s.final_norm)(h), new_kv


class KVBodyModel(nn.Module):
    """The lazy-head *body* graph of a :class:`KVExportModel`: the same inputs, outputs
    ``hidden`` float32 ``[1, q, hidden]`` (after the final norm) and the q new KV rows per
    layer, exactly as the full graph writes them. With :class:`HeadModel` it splits the
    full graph at the vocabulary projection, so the runtime can project only the rows it
    reads (``lazy-head`` verification).

    Args:
        full: the wrapper whose weights and wiring it reuses.
    """

    def __init__(self, full: KVExportModel):
        super().__init__()
        self.full = full

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *past: torch.Tensor):
        """``(hidden [1, q, hidden] float32, *new_kv)``."""
        hidden, new_kv = self.full.body(input_ids, position_ids, *past)
        return (hidden.float(), *new_kv)


class HeadModel(nn.Module):
    """The lazy-head *head* graph: ``hidden`` float32 ``[1, r, hidden]`` -> ``logits``
    float32 ``[1, r, vocab]`` (the checkpoint's ``lm_head``, any r >= 1).

    Args:
        full: the wrapper whose ``lm_head`` it reuses.
    """

    def __init__(self, full: KVExportModel):
        super().__init__()
        self.full = full

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``logits [1, r, vocab]`` float32 for ``hidden [1, r, hidden]``."""
        return self.full.head(hidden)
