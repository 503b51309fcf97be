"""Export one Hugging Face causal LM to ONNX with the IO-bound KV interface, and check
numeric parity against PyTorch.

See :mod:`specrt.export.kv_model` for the interface. The export uses
``torch.onnx.export(..., dynamo=True)`` with one named dynamic dimension per axis
(``q`` new tokens, ``past`` length); example sizes are >= 2 because the exporter
specialises dimensions whose example is 0 or 1.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specrt.runtime.manifest import ModelEntry, sha256_file

from .kv_model import KVExportModel

PARITY_TOL = 1e-4  # max |logit difference| allowed, fp32


class ParityError(RuntimeError):
    """The exported ONNX model disagrees with PyTorch beyond tolerance."""


@dataclass(frozen=True)
class ExportedModel:
    """Result of :func:`export_model`: the manifest entry and the path written."""

    entry: ModelEntry
    path: Path


def load_hf(model_dir: str | Path):
    """Load a local HF causal-LM checkpoint as fp32, eval mode (never from a hub)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True)
    model.eval()
    return model


def _example_inputs(wrapper: KVExportModel, q: int, past: int) -> tuple[torch.Tensor, ...]:
    ids = torch.zeros((1, q), dtype=torch.int64)
    pos = torch.arange(past, past + q, dtype=torch.int64).unsqueeze(0)
    kv = [torch.zeros((1, past, wrapper.n_kv, wrapper.head_dim)) for _ in range(2 * wrapper.n_layers)]
    return (ids, pos, *kv)


def export_onnx(hf_model, out_path: Path, max_ctx: int) -> KVExportModel:
    """Write ``out_path`` (single ONNX file, weights inline) for ``hf_model``.

    Returns the wrapper (its dims are needed for the manifest).
    """
    from torch.export import Dim

    wrapper = KVExportModel(hf_model, max_ctx).eval()
    ins, outs = ModelEntry.io_names(wrapper.n_layers)
    q = Dim("q", min=1, max=max_ctx)
    past = Dim("past", min=0, max=max_ctx)
    dyn = ({1: q}, {1: q}, tuple({1: past} for _ in range(2 * wrapper.n_layers)))  # *past is one tuple arg
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(
            wrapper,
            _example_inputs(wrapper, 3, 5),
            dynamic_shapes=dyn,
            input_names=list(ins),
            output_names=list(outs),
            dynamo=True,
            optimize=True,
            verbose=False,
        )
        prog.save(str(out_path), external_data=False)
    return wrapper


def parity_check(hf_model, onnx_path: Path, qs: tuple[int, ...], pasts: tuple[int, ...], seed: int = 0) -> dict[str, float]:
    """Compare the ONNX model with a full PyTorch forward.

    For every (q, P): PyTorch runs a full forward over P+q random tokens; the ONNX model
    runs one q-token call with the PyTorch KV rows [0, P) as past. Logits of the last q
    positions and the new KV rows [P, P+q) are compared.

    Returns:
        ``{"logits_q{q}_L{P}": max_abs_diff, "kv_q{q}_L{P}": max_abs_diff, ...}``.

    Raises:
        ParityError: any logits difference above :data:`PARITY_TOL` or KV difference above
            10x that; the message names the check and the difference.
    """
    import onnxruntime as ort

    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    cfg = hf_model.config
    vocab = cfg.vocab_size
    rng = np.random.default_rng(seed)
    figures: dict[str, float] = {}
    n_layers = cfg.num_hidden_layers
    for q in qs:
        for p in pasts:
            ids = torch.from_numpy(rng.integers(0, vocab, size=(1, p + q)).astype(np.int64))
            with torch.no_grad():
                out = hf_model(input_ids=ids, use_cache=True)
            ref_logits = out.logits[0, p:].float().numpy()
            cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
            keys = [cache.layers[i].keys[0].transpose(0, 1).numpy() for i in range(n_layers)]  # [P+q, kv, d]
            vals = [cache.layers[i].values[0].transpose(0, 1).numpy() for i in range(n_layers)]
            feeds = {
                "input_ids": ids[:, p:].numpy(),
                "position_ids": np.arange(p, p + q, dtype=np.int64)[None],
            }
            for i in range(n_layers):
                feeds[f"past_key_{i}"] = np.ascontiguousarray(keys[i][None, :p])
                feeds[f"past_value_{i}"] = np.ascontiguousarray(vals[i][None, :p])
            res = sess.run(None, feeds)
            d_logits = float(np.abs(res[0][0] - ref_logits).max())
            d_kv = 0.0
            for i in range(n_layers):
                d_kv = max(d_kv, float(np.abs(res[1 + 2 * i][0] - keys[i][p:]).max()))
                d_kv = max(d_kv, float(np.abs(res[2 + 2 * i][0] - vals[i][p:]).max()))
            figures[f"logits_q{q}_L{p}"] = d_logits
            figures[f"kv_q{q}_L{p}"] = d_kv
            if d_logits > PARITY_TOL or d_kv > 10 * PARITY_TOL:
                raise ParityError(
                    f"{onnx_path.name}: parity failed for q={q}, past={p}: max |logit diff| {d_logits:.3g} "
                    f"(tolerance {PARITY_TOL}), max |new KV diff| {d_kv:.3g} (tolerance {10 * PARITY_TOL})"
                )
    return figures


def export_model(model_dir: str | Path, out_path: Path, max_ctx: int, k_max: int, check: bool = True) -> ExportedModel:
    """Export ``model_dir`` to ``out_path`` and check parity for q in {1, k_max+1}, L in {0, 37}.

    Raises:
        specrt.export.arch.UnsupportedModelError: architecture/config not supported.
        ParityError: exported model disagrees with PyTorch.
    """
    from .arch import spec_for

    hf = load_hf(model_dir)
    spec_for(hf.config, max_ctx)
    wrapper = export_onnx(hf, out_path, max_ctx)
    parity = parity_check(hf, out_path, qs=(1, k_max + 1), pasts=(0, 37)) if check else {}
    ins, outs = ModelEntry.io_names(wrapper.n_layers)
    cfg = hf.config
    entry = ModelEntry(
        file=out_path.name,
        sha256=sha256_file(out_path),
        family=wrapper.spec.family,
        n_layers=wrapper.n_layers,
        n_heads=wrapper.n_heads,
        n_kv_heads=wrapper.n_kv,
        head_dim=wrapper.head_dim,
        hidden=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        params=sum(p.numel() for p in hf.parameters()),
        parity=parity,
        inputs=ins,
        outputs=outs,
        source=str(model_dir),
    )
    return ExportedModel(entry=entry, path=out_path)
