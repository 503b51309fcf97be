"""Export one Hugging Face causal LM to ONNX with the IO-bound KV interface, and check
numeric parity against PyTorch.

See :mod:`specrt.export.kv_model` for the interface. The export uses
``torch.onnx.export(..., dynamo=True)`` with one named dynamic dimension per axis
(``q`` new tokens, ``past`` length); example sizes are >= 2 because the exporter
specialises dimensions whose example is 0 or 1.

Weights are written inline (one ``.onnx`` file) or, with ``external_data`` or when a graph's
weights exceed what one protobuf may hold (torch saves external data on its own above 1.5
GB, protobuf's hard limit being 2 GB), to ``<graph>.onnx.data`` beside it;
:func:`external_files` reads the locations back from the saved graph's initializers so the
manifest can record and hash them.

Memory: the PyTorch model is loaded once in float32 (the graphs are float32); the parity
references are computed with it, then it is freed before onnxruntime loads the exported
graphs for the comparison, so the two fp32 copies of the weights never coexist.
"""

from __future__ import annotations

import gc
import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from specrt.runtime.errors import ParityError  # noqa: F401  (in the SpecRTError tree)
from specrt.runtime.manifest import FileRecord, ModelEntry, sha256_file

from .kv_model import HeadModel, KVBodyModel, KVExportModel
from .resources import PhaseMeter, trim_heap

# fp32 parity: max |difference| allowed per unit of the reference's scale (parity_tolerance)
PARITY_TOL = 1e-4


def parity_tolerance(tol: float, reference: np.ndarray) -> float:
    """The absolute tolerance of a parity comparison: ``tol * max(1, max |reference|)``.

    fp32 rounding grows with the magnitude of what is computed: a tiny model's logits stay
    within +-10, a trained 1.5B model's reach the hundreds, where the same relative error
    is ~10x larger in absolute terms; a fixed absolute bound refused correct exports of
    real models. Values below 1 keep the absolute bound ``tol``.

    Args:
        tol: relative tolerance (e.g. :data:`PARITY_TOL`). reference: PyTorch's values.
    """
    return tol * max(1.0, float(np.abs(reference).max()) if reference.size else 1.0)


def _max_abs(reference: list) -> np.ndarray:
    """One array of the largest |value| of each tensor in ``reference`` (for the KV scale)."""
    return np.array([float(np.abs(a).max()) if a.size else 0.0 for a in reference], np.float32)


# automatic external data: above this many bytes of float32 weights a model's graphs keep
# their weights in <graph>.data files (protobuf cannot serialize a message over 2 GB; torch
# itself switches at 1.5 GB of initializers, this decides before the export)
EXTERNAL_DATA_ABOVE = 1536 << 20


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
        files: file name -> :class:`~specrt.runtime.manifest.FileRecord` of every file
            written for this model (graphs and their external data).
    """

    entry: ModelEntry
    path: Path
    lazy_head: dict | None = None
    files: dict[str, FileRecord] = field(default_factory=dict)


def load_hf(model_dir: str | Path, dtype: torch.dtype = torch.float32):
    """Load a local HF causal-LM checkpoint, eval mode (never from a hub).

    Args:
        model_dir: the checkpoint folder.
        dtype: parameter dtype (default float32, the dtype of the exported graphs): each
            tensor is read from the safetensors file and converted once into its parameter,
            so a bf16 checkpoint costs its fp32 size, not fp32 + bf16.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, local_files_only=True)
    model.eval()
    return model


def external_files(onnx_path: Path) -> tuple[str, ...]:
    """The external-data files an ONNX graph's initializers (and constant attributes)
    read from: their ``external_data["location"]`` entries, in first-use order.

    Reads the graph without its external data (cheap for a graph whose weights are
    external; a graph with inline weights is read whole once).

    Raises:
        ExportError: a location outside the graph's folder (absolute, or with ``..``).
    """
    import onnx

    from specrt.runtime.errors import ExportError

    model = onnx.load(str(onnx_path), load_external_data=False)
    found: dict[str, None] = {}
    for t in _all_tensors(model.graph):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            loc = next((e.value for e in t.external_data if e.key == "location"), None)
            if loc is not None:
                found[loc] = None
    del model
    for loc in found:
        if Path(loc).is_absolute() or ".." in Path(loc).parts:
            raise ExportError(f"{onnx_path}: an initializer's external data location {loc!r} is outside the engine folder")
    return tuple(found)


def _all_tensors(graph):
    """Every TensorProto of a GraphProto: initializers, and tensor attributes of its
    nodes, subgraphs included."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _all_tensors(attr.g)
            for g in attr.graphs:
                yield from _all_tensors(g)


def release_exporter_caches() -> int:
    """Drop the references onnxscript's rewriter keeps to the last graph it optimized.

    Its module-level rewrite rules (e.g. ``onnxscript.rewriter.rules.common.sub_0_rule``)
    keep their matcher's last graph, node and match (``SimplePatternMatcher._graph``,
    ``_current_node``, ``_match``); through the graph's value counters that pins every weight of the
    last export (measured: the 2.9 GB float32 weights of a 714M-parameter model stayed
    resident through the parity check). Returns how many matchers were reset.
    """
    import sys

    n = 0
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith("onnxscript.rewriter"):
            continue
        for obj in list(vars(mod).values()):
            rules = getattr(obj, "rules", None)
            for rule in rules if isinstance(rules, (list, tuple)) else (obj,):
                matcher = getattr(rule, "_matcher", None)
                if matcher is None:
                    continue
                for attr in ("_graph", "_current_node", "_match", "_tracer"):
                    if getattr(matcher, attr, None) is not None:
                        setattr(matcher, attr, None)
                        n += 1
    return n


def _save(prog, path: Path, external_data: bool) -> None:
    """Save an ONNX program; weights inline, or in ``<name>.data`` beside it when
    ``external_data`` (torch also switches to external data by itself above 1.5 GB). Both are
    written in a staging folder and moved over the old files (:func:`specrt.runtime.fileio.staged_dir`);
    a stale ``<name>.data`` from an earlier export is removed when this one has none."""
    from specrt.runtime.fileio import staged_dir

    path = Path(path)
    with staged_dir(path.parent) as stage:
        prog.save(str(stage / path.name), external_data=external_data)
        if not (stage / (path.name + ".data")).exists():
            Path(str(path) + ".data").unlink(missing_ok=True)


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


def export_onnx(hf_model, out_path: Path, max_ctx: int, external_data: bool = False, save: bool = True):
    """Export ``hf_model``'s IO-bound graph. With ``save``, write ``out_path``: weights inline,
    or in ``out_path.name + ".data"`` with ``external_data`` (and always above 1.5 GB of
    weights, see :func:`_save`), and return the wrapper (its dims are needed for the
    manifest); without, return ``(wrapper, onnx.ModelProto)`` for the caller to store
    (:func:`save_sharing_weights`).
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
        if not save:
            return wrapper, prog.model_proto
        _save(prog, out_path, external_data)
    del prog
    release_exporter_caches()
    gc.collect()  # the ONNX program holds the optimizer's folded constants: free them now
    return wrapper


def _tensor_key(t) -> tuple:
    """(dtype, dims, SHA-256 of the raw little-endian bytes) of an initializer."""
    import hashlib

    from onnx import numpy_helper

    return t.data_type, tuple(t.dims), hashlib.sha256(numpy_helper.to_array(t).tobytes()).hexdigest()


def _set_external(t, location: str, offset: int, length: int) -> None:
    """Make initializer ``t`` refer to ``length`` bytes at ``offset`` of ``location``."""
    import onnx

    for name in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data"):
        t.ClearField(name)
    del t.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    t.data_location = onnx.TensorProto.EXTERNAL


def save_sharing_weights(full, full_path: Path, parts: list, size_threshold: int = 1024, align: int = 4096) -> Path:
    """Store ``full`` at ``full_path`` with its weights in ONE external-data file,
    ``full_path.name + ".data"``, and every graph of ``parts`` (``(ModelProto, path)``)
    pointing into that same file for each initializer with the same bytes (the lazy-head
    body and head graphs hold the full graph's weights: stored once, not three times).

    Initializers under ``size_threshold`` bytes stay inline; offsets are aligned to
    ``align`` bytes (so onnxruntime can map the file). Matching is by content (dtype,
    shape, SHA-256 of the bytes), so it holds whatever names the exporter gave the tensors.
    A part's initializer that the full graph does not hold stays inline.

    Returns:
        the data file's path.
    """
    import onnx
    from onnx import numpy_helper

    from specrt.runtime.fileio import replaced

    data_path = full_path.with_name(full_path.name + ".data")
    index: dict[tuple, tuple[int, int]] = {}
    # every file under a temporary name, moved over its name (graphs after the data they point to)
    with replaced(data_path) as tmp, open(tmp, "wb") as f:
        for t in full.graph.initializer:
            raw = numpy_helper.to_array(t).tobytes()
            if len(raw) < size_threshold:
                continue
            key = _tensor_key(t)
            if key not in index:
                pad = (-f.tell()) % align
                f.write(b"\0" * pad)
                index[key] = (f.tell(), len(raw))
                f.write(raw)
            _set_external(t, data_path.name, *index[key])
    with replaced(full_path) as tmp:
        onnx.save(full, str(tmp))
    for proto, path in parts:
        for t in proto.graph.initializer:
            if t.data_location != onnx.TensorProto.EXTERNAL and (key := _tensor_key(t)) in index:
                _set_external(t, data_path.name, *index[key])
        with replaced(path) as tmp:
            onnx.save(proto, str(tmp))
    return data_path


BODY_FILE = "target_body.onnx"
HEAD_FILE = "target_head.onnx"


def export_lazy_head(wrapper: KVExportModel, max_ctx: int) -> tuple:
    """The lazy-head split of ``wrapper`` as ``(body, head)`` ONNX ModelProtos: the body
    (the full interface's inputs -> ``hidden`` float32 ``[1, q, hidden]`` after the final
    norm, plus the q new KV rows per layer) and the head (``hidden`` ``[1, r, hidden]`` ->
    ``logits`` float32 ``[1, r, vocab]``). Dynamic dims: q and past as :func:`export_onnx`,
    r in 1..max_ctx. Stored by :func:`save_sharing_weights` beside the full graph.
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
    return body.model_proto, head.model_proto


@dataclass
class Reference:
    """PyTorch's answer for one parity case: one q-token call after P past positions.

    Attributes:
        q, p: new tokens and past length.
        feeds: the ONNX inputs of that call (``input_ids``/``position_ids`` int64
            ``[1, q]``; ``past_*`` float32 ``[1, P, kv, d]``: PyTorch's KV rows [0, P)).
        logits: float32 ``[q, vocab]``, the full forward's logits of the last q positions.
        keys, values: per layer float32 ``[P + q, kv, d]`` (rows [P, P+q) are the new ones).
        hidden, head: (lazy-head cases) the wrapper's final-norm hidden states float32
            ``[1, q, hidden]`` for the call and its LM head applied to them ``[q, vocab]``.
    """

    q: int
    p: int
    feeds: dict
    logits: np.ndarray
    keys: list
    values: list
    hidden: np.ndarray | None = None
    head: np.ndarray | None = None


def references(hf_model, qs: tuple[int, ...], pasts: tuple[int, ...], seed: int = 0, wrapper: KVExportModel | None = None) -> list[Reference]:
    """PyTorch references for every (q, P) in ``qs`` x ``pasts`` (random tokens from
    ``seed``, drawn in that order), computed before any graph is loaded so the PyTorch
    model can be freed first. With ``wrapper``, also the lazy-head references.

    Returns:
        one :class:`Reference` per case, in order (a few MB: logits rows and KV rows).
    """
    rng = np.random.default_rng(seed)
    out = []
    n_layers = hf_model.config.num_hidden_layers
    for q in qs:
        for p in pasts:
            ref_logits, keys, vals, feeds = _reference(hf_model, rng, q, p)
            r = Reference(q, p, feeds, ref_logits, keys, vals)
            if wrapper is not None:
                with torch.no_grad():
                    hidden, _ = wrapper.body(*(torch.from_numpy(feeds[n]) for n in ModelEntry.io_names(n_layers)[0]))
                    r.head = wrapper.head(hidden)[0].numpy()
                r.hidden = hidden.float().numpy()
            out.append(r)
    return out


def _kv_diff(res: list, refs: Reference, n_layers: int) -> float:
    """Max |new KV rows of an ONNX call - PyTorch's rows [P, P+q)| over every layer."""
    d = 0.0
    for i in range(n_layers):
        d = max(d, float(np.abs(res[1 + 2 * i][0] - refs.keys[i][refs.p :]).max()))
        d = max(d, float(np.abs(res[2 + 2 * i][0] - refs.values[i][refs.p :]).max()))
    return d


def _parity_session(path: Path):
    """An onnxruntime CPU session for the parity checks (freed by the caller).

    Weight prepacking is off: it copies every MatMul weight into a packed layout at
    session creation (measured on a 714M-parameter graph with external data: 18 s and
    2.8 GB peak RSS, against 0.1 s and the weights left memory-mapped without it), which
    pays off over many runs, not the four calls of a parity check. The arithmetic is the
    same MLAS kernels either way.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", "1")
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def compare_full(refs: list[Reference], onnx_path: Path, tol: float = PARITY_TOL) -> dict[str, float]:
    """Run the full graph on every reference case and compare (see :func:`parity_check`).

    Raises:
        ParityError: a logits difference above :func:`parity_tolerance` of ``tol`` (default
            :data:`PARITY_TOL`) and PyTorch's logits, or a KV difference above 10x that
            relative to PyTorch's KV rows.
    """
    sess = _parity_session(onnx_path)
    figures: dict[str, float] = {}
    n_layers = len(refs[0].keys) if refs else 0
    for r in refs:
        res = sess.run(None, r.feeds)
        d_logits = float(np.abs(res[0][0] - r.logits).max())
        d_kv = _kv_diff(res, r, n_layers)
        figures[f"logits_q{r.q}_L{r.p}"] = d_logits
        figures[f"kv_q{r.q}_L{r.p}"] = d_kv
        t_logits, t_kv = parity_tolerance(tol, r.logits), parity_tolerance(10 * tol, _max_abs(r.keys + r.values))
        if d_logits > t_logits or d_kv > t_kv:
            raise ParityError(
                f"{onnx_path.name}: parity failed for q={r.q}, past={r.p}: max |logit diff| {d_logits:.3g} "
                f"(tolerance {t_logits:.3g} = {tol} x the logits' scale), max |new KV diff| {d_kv:.3g} (tolerance {t_kv:.3g})"
            )
    return figures


def compare_lazy_head(refs: list[Reference], body_path: Path, head_path: Path) -> dict[str, float]:
    """Run the body and head graphs on every reference case (made with the wrapper) and
    compare (see :func:`lazy_head_parity_check`).

    Raises:
        ParityError: as :func:`lazy_head_parity_check`.
    """
    body, head = _parity_session(body_path), _parity_session(head_path)
    figures: dict[str, float] = {}
    n_layers = len(refs[0].keys) if refs else 0
    for r in refs:
        res = body.run(None, r.feeds)
        d = {
            "hidden": float(np.abs(res[0] - r.hidden).max()),
            "head": float(np.abs(head.run(None, {"hidden": r.hidden})[0][0] - r.head).max()),
            "logits": float(np.abs(head.run(None, {"hidden": res[0]})[0][0] - r.logits).max()),
        }
        d_kv = _kv_diff(res, r, n_layers)
        for name, v in d.items():
            figures[f"{name}_q{r.q}_L{r.p}"] = v
        figures[f"kv_q{r.q}_L{r.p}"] = d_kv
        scale = {"hidden": r.hidden, "head": r.head, "logits": r.logits}
        bad = [
            f"max |{n} diff| {v:.3g} (tolerance {parity_tolerance(PARITY_TOL, scale[n]):.3g})"
            for n, v in d.items()
            if v > parity_tolerance(PARITY_TOL, scale[n])
        ]
        t_kv = parity_tolerance(10 * PARITY_TOL, _max_abs(r.keys + r.values))
        if bad or d_kv > t_kv:
            raise ParityError(
                f"{body_path.name}/{head_path.name}: lazy-head parity failed for q={r.q}, past={r.p}: "
                f"{', '.join(bad) or 'logits ok'} ({PARITY_TOL} x each reference's scale), max |new KV diff| {d_kv:.3g} (tolerance {t_kv:.3g})"
            )
    return figures


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
        ParityError: a logits, hidden or head difference above :data:`PARITY_TOL` relative to
            its reference's scale (:func:`parity_tolerance`), or a KV difference above 10x
            that; the message names the graph, check and value.
    """
    return compare_lazy_head(references(hf_model, qs, pasts, seed, wrapper), body_path, head_path)


def lazy_head_record(n_layers: int, body_path: Path, head_path: Path, parity: dict[str, float], files: dict | None = None) -> dict:
    """The manifest's lazy-head record (``extra["lazy_head"]``) for the two written files:
    ``{"body": {file, sha256, inputs, outputs}, "head": {...}, "parity": {...}}`` (the
    hashes from ``files``, :func:`file_records`, when given, else computed here)."""
    ins, outs = ModelEntry.io_names(n_layers)

    def digest(p: Path) -> str:
        return files[p.name].sha256 if files and p.name in files else sha256_file(p)

    return {
        "body": {"file": body_path.name, "sha256": digest(body_path), "inputs": list(ins), "outputs": ["hidden", *outs[1:]]},
        "head": {"file": head_path.name, "sha256": digest(head_path), "inputs": ["hidden"], "outputs": ["logits"]},
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


def parity_check(hf_model, onnx_path: Path, qs: tuple[int, ...], pasts: tuple[int, ...], seed: int = 0, tol: float = PARITY_TOL) -> dict[str, float]:
    """Compare the ONNX model with a full PyTorch forward.

    For every (q, P): PyTorch runs a full forward over P+q random tokens; the ONNX model
    runs one q-token call with the PyTorch KV rows [0, P) as past. Logits of the last q
    positions and the new KV rows [P, P+q) are compared.

    Returns:
        ``{"logits_q{q}_L{P}": max_abs_diff, "kv_q{q}_L{P}": max_abs_diff, ...}``.

    Raises:
        ParityError: any logits difference above ``tol`` (default :data:`PARITY_TOL`) or KV
            difference above 10x that; the message names the check and the difference.
    """
    return compare_full(references(hf_model, qs, pasts, seed), onnx_path, tol)


def file_records(folder: Path, graphs: list[str]) -> dict[str, FileRecord]:
    """:class:`~specrt.runtime.manifest.FileRecord` (SHA-256, bytes, external-data files)
    of each graph in ``folder`` and of every external-data file it references
    (:func:`external_files`).

    Raises:
        ExportError: an external-data file a graph references is missing.
    """
    from specrt.runtime.errors import ExportError

    out: dict[str, FileRecord] = {}
    for g in graphs:
        ext = external_files(folder / g)
        for name in (g, *ext):
            p = folder / name
            if not p.is_file():
                raise ExportError(f"{folder / g} references external data {name!r}, which was not written")
            if name not in out:
                out[name] = FileRecord.of(p)
        out[g] = FileRecord(sha256=out[g].sha256, bytes=out[g].bytes, external=ext)
    return out


STANDARD_PRECISIONS = ("fp32", "fp16", "bf16")
# max |logit diff| allowed against the fp32 PyTorch model per compute precision (fp16: the
# default target measured 5.6e-3, its draft 3.8e-3); bf16 cannot run on onnxruntime's CPU
PARITY_TOLS = {"fp32": PARITY_TOL, "fp16": 0.05}


def export_model(
    model_dir: str | Path,
    out_path: Path,
    max_ctx: int,
    k_max: int,
    check: bool = True,
    lazy_head: bool = False,
    precision: str = "fp32",
    external_data: bool | None = None,
    meter: PhaseMeter | None = None,
) -> ExportedModel:
    """Export ``model_dir`` to ``out_path`` and check parity for q in {1, k_max+1}, L in {0, 37}.

    Order (memory): load the checkpoint in float32, export the graph(s), compute the
    PyTorch parity references, free the PyTorch model, then load each graph in
    onnxruntime and compare; so the peak is about one fp32 copy of the weights plus the
    exporter's working set, never PyTorch's and onnxruntime's copies at once.

    Args:
        lazy_head: also write :data:`BODY_FILE` and :data:`HEAD_FILE` beside ``out_path``
            (:func:`export_lazy_head`), all three graphs reading one external weight file
            ``out_path.name + ".data"`` (:func:`save_sharing_weights`), and check the split's
            parity the same way (:func:`compare_lazy_head`); ``ExportedModel.lazy_head``
            is then the manifest record (see :mod:`specrt.runtime.manifest`,
            ``LAZY_HEAD_KEY``). fp32 only.
        precision: compute precision of the graph, one of :data:`STANDARD_PRECISIONS`
            (fp16/bf16: :func:`specrt.export.onnx_precision.convert_precision`, float32 I/O;
            bf16's parity cannot be checked on the CPU and is recorded as not measured).
        external_data: True: weights in ``<graph>.data`` files beside the graphs; False:
            inline where they fit (torch still writes external data above 1.5 GB); None
            (default): external when the model's float32 weights exceed
            :data:`EXTERNAL_DATA_ABOVE`. (The lazy-head graphs always share one external file.)
        meter: a :class:`~specrt.export.resources.PhaseMeter` to record the phases' peak
            RSS and seconds in, or None.

    Returns:
        :class:`ExportedModel` whose ``files`` records every file written (graphs and
        external data, SHA-256 and size).

    Raises:
        specrt.export.arch.UnsupportedModelError: architecture/config not supported.
        ParityError: exported model disagrees with PyTorch.
        PrecisionError: lazy-head with a precision other than fp32, or a precision that is
            not a standard-graph one.
    """
    from specrt.runtime.errors import PrecisionError

    from .arch import spec_for

    if precision not in STANDARD_PRECISIONS or (lazy_head and precision != "fp32"):
        raise PrecisionError(
            f"precision={precision!r}; standard graphs are {', '.join(STANDARD_PRECISIONS)}, and --lazy-head is available with --precision fp32 only"
        )
    meter, tag = meter or PhaseMeter(), out_path.stem
    meter.phase(f"{tag}: load checkpoint (float32)")
    hf = load_hf(model_dir)
    spec_for(hf.config, max_ctx)
    n_params = sum(p.numel() for p in hf.parameters())
    external = external_data if external_data is not None else 4 * n_params > EXTERNAL_DATA_ABOVE
    Path(str(out_path) + ".data").unlink(missing_ok=True)  # a previous export's weights
    meter.phase(f"{tag}: export ONNX")
    wrapper = _write_graphs(hf, out_path, max_ctx, external, lazy_head, precision)
    checked = check and precision in PARITY_TOLS
    meter.phase(f"{tag}: PyTorch references")
    refs = references(hf, (1, k_max + 1), (0, 37), seed=0, wrapper=wrapper if lazy_head else None) if checked else []
    cfg = hf.config
    dims = dict(family=wrapper.spec.family, n_layers=wrapper.n_layers, n_heads=wrapper.n_heads, n_kv_heads=wrapper.n_kv, head_dim=wrapper.head_dim)
    dims.update(hidden=cfg.hidden_size, vocab_size=cfg.vocab_size, params=n_params, matmul_params=matmul_params(wrapper))
    del hf, wrapper, cfg
    gc.collect()  # free the fp32 PyTorch weights before onnxruntime loads its own copy
    trim_heap()
    meter.phase(f"{tag}: parity (onnxruntime)")
    parity = compare_full(refs, out_path, PARITY_TOLS[precision]) if checked else {}
    lh_parity = compare_lazy_head(refs, out_path.parent / BODY_FILE, out_path.parent / HEAD_FILE) if (checked and lazy_head) else {}
    gc.collect()
    trim_heap()
    meter.phase(f"{tag}: hash files")
    exported = _exported(out_path, model_dir, precision, dims, parity, lh_parity if lazy_head else None)
    meter.phase(None)
    return exported


def _write_graphs(hf, out_path: Path, max_ctx: int, external: bool, lazy_head: bool, precision: str):
    """Export the graph of ``hf`` to ``out_path`` (with ``lazy_head`` also the body/head
    split sharing one weight file), converted to ``precision``; returns the export wrapper."""
    if lazy_head:
        wrapper, full = export_onnx(hf, out_path, max_ctx, save=False)
        body, head = export_lazy_head(wrapper, max_ctx)
        save_sharing_weights(full, out_path, [(body, out_path.parent / BODY_FILE), (head, out_path.parent / HEAD_FILE)])
        del full, body, head
        release_exporter_caches()
        gc.collect()
    else:
        wrapper = export_onnx(hf, out_path, max_ctx, external)
    if precision != "fp32":
        from .onnx_precision import write_variant

        write_variant(out_path, out_path, precision, 0)
    return wrapper


def _exported(out_path: Path, model_dir, precision: str, dims: dict, parity: dict, lh_parity: dict | None) -> ExportedModel:
    """The :class:`ExportedModel` of the written graph(s): files hashed, the model entry,
    and the lazy-head record when ``lh_parity`` is given (the split was written)."""
    lazy_head = lh_parity is not None
    ins, outs = ModelEntry.io_names(dims["n_layers"])
    files = file_records(out_path.parent, [out_path.name, *((BODY_FILE, HEAD_FILE) if lazy_head else ())])
    ext = files[out_path.name].external
    data_file = ext[0] if len(ext) == 1 else ""  # ModelEntry.data_file: the one weights file, if one
    record = None
    if lazy_head:
        record = lazy_head_record(dims["n_layers"], out_path.parent / BODY_FILE, out_path.parent / HEAD_FILE, lh_parity, files)
        record["data_file"] = data_file
    entry = ModelEntry(
        file=out_path.name,
        sha256=files[out_path.name].sha256,
        parity=parity,
        inputs=ins,
        outputs=outs,
        source=str(model_dir),
        precision=precision,
        data_file=data_file,
        data_sha256=files[data_file].sha256 if data_file else "",
        note="" if precision in PARITY_TOLS else f"{precision}: parity not checked (onnxruntime's CPU provider has no {precision} kernels)",
        **dims,
    )
    return ExportedModel(entry=entry, path=out_path, lazy_head=record, files=files)


# A quantized graph's logits rows against PyTorch's on random tokens (the parity cases):
# mean correlation 0.86 for SmolLM2-135M int4 at accuracy level 4, 0.96 for Qwen2.5-0.5B,
# 0.999 in int8 at level 0; rows of *other* positions of the same forward (what a miswired
# graph resembles) correlate at 0.43-0.49: token-frequency structure all rows share.
# (The argmax agreement is no wiring test on random tokens: 46% for that correct SmolLM2 graph.)
WIRING_MIN_CORRELATION = 0.7


def row_correlation(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pearson correlation of each row of ``a`` with the same row of ``b`` (float ``[n, V]``
    each): ``[n]`` in [-1, 1]."""
    a = a.astype(np.float64) - a.mean(-1, keepdims=True)
    b = b.astype(np.float64) - b.mean(-1, keepdims=True)
    return (a * b).sum(-1) / np.sqrt((a * a).sum(-1) * (b * b).sum(-1) + 1e-300)


def runtime_parity(
    hf_model, folder: Path, entry: ModelEntry, max_ctx: int, qs: tuple[int, ...], pasts: tuple[int, ...], seed: int = 0, release=None, log=None
) -> dict[str, float]:
    """Compare an exported graph, run by the runtime's own model class for its graph form
    (:func:`specrt.runtime.backends.cpu_model`), with a full PyTorch forward.

    For every (q, P): P random tokens are fed (one call), then q more at position P; the q
    logits rows are compared with PyTorch's over the same P + q tokens. PyTorch's answers
    are computed first; ``release`` (when given) is then called, e.g. to drop the caller's
    last reference to the PyTorch model, so the two never share memory (a 1.5B model is
    6 GB in float32). With ``log``, progress lines (forwards done and left, PyTorch's then
    the graph's) go there every few seconds. For a quantized
    graph the figures are the quantization error (recorded, not a pass/fail tolerance;
    the quality record measures what it does to the output).

    Returns:
        ``{"logits_q{q}_L{P}": max_abs_diff, ..., "logits_correlation": mean}``.

    Raises:
        ParityError: non-finite logits, or logits rows whose mean correlation with
            PyTorch's (:func:`row_correlation`) is below :data:`WIRING_MIN_CORRELATION`
            (a wiring fault, not quantization).
    """
    from specrt.runtime.backends import cpu_model
    from specrt.runtime.backends.base import ThreadConfig

    from .progress import Progress

    n = max(pasts) + max(qs)
    rng = np.random.default_rng(seed)
    prog = Progress("  parity check", 2 * len(qs) * len(pasts), log, unit="forwards") if log is not None else None
    cases = []  # PyTorch's answers first, so a caller can free the model before the graph loads
    for q in qs:
        for p in pasts:
            ids = rng.integers(0, hf_model.config.vocab_size, size=p + q)
            with torch.no_grad():
                cases.append((q, p, ids, hf_model(input_ids=torch.from_numpy(ids[None].astype(np.int64))).logits[0, p:].float().numpy()))
            if prog is not None:
                prog.advance()
    vocab_size = hf_model.config.vocab_size
    del hf_model
    if release is not None:
        release()
        gc.collect()
    model = cpu_model(folder, entry, min(max_ctx, n), max(max(qs), max(pasts), 1), ThreadConfig())
    figures: dict[str, float] = {}
    corr = []
    for q, p, ids, ref in cases:
        if p:
            model.run(ids[:p], 0)
        rows = model.run(ids[p:], p)[:, :vocab_size]
        if not np.isfinite(rows).all():
            raise ParityError(f"{entry.file}: non-finite logits for q={q}, past={p}")
        figures[f"logits_q{q}_L{p}"] = float(np.abs(rows - ref).max())
        corr.extend(row_correlation(rows, ref).tolist())
        if prog is not None:
            prog.advance()
    figures["logits_correlation"] = float(np.mean(corr))
    if figures["logits_correlation"] < WIRING_MIN_CORRELATION:
        raise ParityError(
            f"{entry.file}: its logits rows correlate with PyTorch's at {figures['logits_correlation']:.3f} on average "
            f"(below {WIRING_MIN_CORRELATION}; max |logit diff| {max(v for k, v in figures.items() if k.startswith('logits_q')):.3g}): the graph is miswired"
        )
    model.close()
    return figures
