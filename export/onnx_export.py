"""Export one Hugging Face causal LM to ONNX with the IO-bound KV interface, and check
numeric parity against PyTorch.

See :mod:`specrt.export.kv_model` for the interface. The export uses
``torch.onnx.export(..., dynamo=True)`` with one named dynamic dimension per axis
(``q`` new tokens, ``past`` length); example sizes are >= 2 because the exporter
specialises dimensions whose example is 0 or 1.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specrt.runtime.errors import ParityError  # noqa: F401  (in the SpecRTError tree)
from specrt.runtime.manifest import ModelEntry, sha256_file

from .kv_model import HeadModel, KVBodyModel, KVExportModel

PARITY_TOL = 1e-4  # max |logit difference| allowed, fp32


class _NoTorchvisionNotice(logging.Filter):
    """Drops torch.onnx's "torchvision is not installed. Skipping torchvision::<op>" notices.

    torch's ONNX exporter registers its torchvision op translations on first use and logs
    one WARNING per op (8 lines) when torchvision is absent (logger
    ``torch.onnx._internal.exporter._registration``); language models use none of those
    ops, and the lines read like failures. Only records with that message are dropped;
    every other warning of that logger still shows.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("torchvision is not installed")


logging.getLogger("torch.onnx._internal.exporter._registration").addFilter(_NoTorchvisionNotice())


@dataclass(frozen=True)
class ExportedModel:
    """Result of :func:`export_model`: the manifest entry and the path written.

    Attributes:
        lazy_head: the lazy-head record (:func:`export_lazy_head`) when the body and head
            graphs were written too, else None.
    """

    entry: ModelEntry
    path: Path
    lazy_head: dict | None = None


def load_hf(model_dir: str | Path):
    """Load a local HF causal-LM checkpoint as fp32, eval mode (never from a hub)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True)
    model.eval()
    return model


def matmul_params(wrapper: KVExportModel) -> int:
    """Weights of the decoder layers' matrix multiplications (``nn.Linear`` and GPT-2's
    ``Conv1D``: q/k/v/o projections and the MLP), embeddings, norms, biases and the LM head
    excluded: the ``N`` of Kaplan et al. 2020 (Table 1, non-embedding parameters, minus
    the norms' and biases' few weights), so a position costs 2 * N matmul FLOPs there.
    """
    s = wrapper.spec
    layers = s.get(wrapper.hf, s.layers)
    n = 0
    for mod in layers.modules():
        if isinstance(mod, torch.nn.Linear) or type(mod).__name__ == "Conv1D":
            n += mod.weight.numel()
    return int(n)


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


BODY_FILE = "target_body.onnx"
HEAD_FILE = "target_head.onnx"


def export_lazy_head(wrapper: KVExportModel, body_path: Path, head_path: Path, max_ctx: int) -> None:
    """Write the lazy-head split of ``wrapper``: ``body_path`` (the full interface's inputs
    -> ``hidden`` float32 ``[1, q, hidden]`` after the final norm, plus the q new KV rows
    per layer) and ``head_path`` (``hidden`` ``[1, r, hidden]`` -> ``logits`` float32
    ``[1, r, vocab]``). Dynamic dims: q and past as :func:`export_onnx`, r in 1..max_ctx.
    """
    from torch.export import Dim

    ins, outs = ModelEntry.io_names(wrapper.n_layers)
    q = Dim("q", min=1, max=max_ctx)
    past = Dim("past", min=0, max=max_ctx)
    dyn = ({1: q}, {1: q}, tuple({1: past} for _ in range(2 * wrapper.n_layers)))
    hidden = wrapper.hf.config.hidden_size
    r = Dim("r", min=1, max=max_ctx)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        body = torch.onnx.export(
            KVBodyModel(wrapper).eval(),
            _example_inputs(wrapper, 3, 5),
            dynamic_shapes=dyn,
            input_names=list(ins),
            output_names=["hidden", *outs[1:]],
            dynamo=True,
            optimize=True,
            verbose=False,
        )
        body.save(str(body_path), external_data=False)
        head = torch.onnx.export(
            HeadModel(wrapper).eval(),
            (torch.zeros((1, 3, hidden)),),
            dynamic_shapes=({1: r},),
            input_names=["hidden"],
            output_names=["logits"],
            dynamo=True,
            optimize=True,
            verbose=False,
        )
        head.save(str(head_path), external_data=False)


def lazy_head_parity_check(
    hf_model, wrapper: KVExportModel, body_path: Path, head_path: Path, qs: tuple[int, ...], pasts: tuple[int, ...], seed: int = 0
) -> dict[str, float]:
    """Compare the body and head graphs with PyTorch, as :func:`parity_check` does the full one.

    For every (q, P), with the PyTorch KV rows [0, P) of a full forward over P+q random
    tokens as past: the body's new KV rows against PyTorch's (``kv_*``); the body's
    ``hidden`` against the PyTorch wrapper's final-norm hidden states for the same call
    (``hidden_*``); the head graph applied to PyTorch's hidden states against PyTorch's
    LM head (``head_*``); and head(body) against the full PyTorch forward's logits
    (``logits_*``: the numbers the runtime verifies with).

    Returns:
        ``{"logits_q{q}_L{P}": ..., "hidden_q{q}_L{P}": ..., "head_q{q}_L{P}": ...,
        "kv_q{q}_L{P}": ...}``, max absolute differences.

    Raises:
        ParityError: a logits, hidden or head difference above :data:`PARITY_TOL`, or a
            KV difference above 10x that; the message names the graph, check and value.
    """
    import onnxruntime as ort

    body = ort.InferenceSession(str(body_path), providers=["CPUExecutionProvider"])
    head = ort.InferenceSession(str(head_path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    figures: dict[str, float] = {}
    n_layers = hf_model.config.num_hidden_layers
    for q in qs:
        for p in pasts:
            ref_logits, keys, vals, feeds = _reference(hf_model, rng, q, p)
            res = body.run(None, feeds)
            with torch.no_grad():
                ref_hidden, _ = wrapper.body(*(torch.from_numpy(feeds[n]) for n in ModelEntry.io_names(n_layers)[0]))
                ref_head = wrapper.head(ref_hidden)[0].numpy()
            ref_hidden = ref_hidden.float().numpy()
            d = {
                "hidden": float(np.abs(res[0] - ref_hidden).max()),
                "head": float(np.abs(head.run(None, {"hidden": ref_hidden})[0][0] - ref_head).max()),
                "logits": float(np.abs(head.run(None, {"hidden": res[0]})[0][0] - ref_logits).max()),
            }
            d_kv = 0.0
            for i in range(n_layers):
                d_kv = max(d_kv, float(np.abs(res[1 + 2 * i][0] - keys[i][p:]).max()))
                d_kv = max(d_kv, float(np.abs(res[2 + 2 * i][0] - vals[i][p:]).max()))
            for name, v in d.items():
                figures[f"{name}_q{q}_L{p}"] = v
            figures[f"kv_q{q}_L{p}"] = d_kv
            bad = [f"max |{n} diff| {v:.3g}" for n, v in d.items() if v > PARITY_TOL]
            if bad or d_kv > 10 * PARITY_TOL:
                raise ParityError(
                    f"{body_path.name}/{head_path.name}: lazy-head parity failed for q={q}, past={p}: "
                    f"{', '.join(bad) or 'logits ok'} (tolerance {PARITY_TOL}), max |new KV diff| {d_kv:.3g} (tolerance {10 * PARITY_TOL})"
                )
    return figures


def lazy_head_record(n_layers: int, body_path: Path, head_path: Path, parity: dict[str, float]) -> dict:
    """The manifest's lazy-head record (``extra["lazy_head"]``) for the two written files:
    ``{"body": {file, sha256, inputs, outputs}, "head": {...}, "parity": {...}}``."""
    ins, outs = ModelEntry.io_names(n_layers)
    return {
        "body": {"file": body_path.name, "sha256": sha256_file(body_path), "inputs": list(ins), "outputs": ["hidden", *outs[1:]]},
        "head": {"file": head_path.name, "sha256": sha256_file(head_path), "inputs": ["hidden"], "outputs": ["logits"]},
        "parity": parity,
    }


def _reference(hf_model, rng: np.random.Generator, q: int, p: int):
    """A full PyTorch forward over ``p + q`` random tokens: ``(logits of the last q
    positions [q, vocab], keys, values, feeds)``; keys/values per layer ``[p + q, kv, d]``,
    feeds the ONNX inputs of one q-token call with the PyTorch KV rows [0, p) as past."""
    cfg = hf_model.config
    n_layers = cfg.num_hidden_layers
    ids = torch.from_numpy(rng.integers(0, cfg.vocab_size, size=(1, p + q)).astype(np.int64))
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
    return ref_logits, keys, vals, feeds


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
    rng = np.random.default_rng(seed)
    figures: dict[str, float] = {}
    n_layers = hf_model.config.num_hidden_layers
    for q in qs:
        for p in pasts:
            ref_logits, keys, vals, feeds = _reference(hf_model, rng, q, p)
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


def export_model(model_dir: str | Path, out_path: Path, max_ctx: int, k_max: int, check: bool = True, lazy_head: bool = False) -> ExportedModel:
    """Export ``model_dir`` to ``out_path`` and check parity for q in {1, k_max+1}, L in {0, 37}.

    Args:
        lazy_head: also write :data:`BODY_FILE` and :data:`HEAD_FILE` beside ``out_path``
            (:func:`export_lazy_head`) and check their parity the same way
            (:func:`lazy_head_parity_check`); ``ExportedModel.lazy_head`` is then the
            manifest record (see :mod:`specrt.runtime.manifest`, ``LAZY_HEAD_KEY``).

    Raises:
        specrt.export.arch.UnsupportedModelError: architecture/config not supported.
        ParityError: exported model disagrees with PyTorch.
    """
    from .arch import spec_for

    hf = load_hf(model_dir)
    spec_for(hf.config, max_ctx)
    wrapper = export_onnx(hf, out_path, max_ctx)
    parity = parity_check(hf, out_path, qs=(1, k_max + 1), pasts=(0, 37)) if check else {}
    record = None
    if lazy_head:
        body_path, head_path = out_path.parent / BODY_FILE, out_path.parent / HEAD_FILE
        export_lazy_head(wrapper, body_path, head_path, max_ctx)
        lh_parity = lazy_head_parity_check(hf, wrapper, body_path, head_path, qs=(1, k_max + 1), pasts=(0, 37)) if check else {}
        record = lazy_head_record(wrapper.n_layers, body_path, head_path, lh_parity)
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
        matmul_params=matmul_params(wrapper),
    )
    return ExportedModel(entry=entry, path=out_path, lazy_head=record)
