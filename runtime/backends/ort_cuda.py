"""onnxruntime on the GPU (CUDAExecutionProvider) with the in-place KV design of
:mod:`specrt.runtime.backends.ort`, the KV buffers living in device memory.

NOT RUN ON A GPU YET (docs/guide/gpu.md). The same class runs with ``device_type="cpu"``
(onnxruntime-allocated host buffers, CPU provider); the CPU tests use that mode, so
everything but the provider and the device allocation is exercised on CPU machines.

Memory, allocated once per model object by onnxruntime
(``OrtValue.ortvalue_from_shape_and_type`` on 'cuda'; no torch, no cuda-python needed)::

    KV        one device allocation, 2 * n_layers buffers (KVLayout, pad 0)
    input_ids host [max_q] int64        (onnxruntime copies the q ids to the device)
    positions host arange(max_ctx) int64 (bound at + 8*L; onnxruntime copies the q
                                         positions to the device with the ids)
    logits    host [1, max_q, vocab]    (bound as the output for q rows, so onnxruntime
                                         copies back only the q rows of the call)

Per call the binding is refreshed (shapes change with L): past inputs -> buffer base on
'cuda', new-KV outputs -> base + L * row_bytes on 'cuda'.

Alignment (decided here, unverified on a GPU). TensorRT requires 256-byte aligned tensor
addresses (:mod:`specrt.runtime.backends.trt` stages new KV rows for that); onnxruntime
documents no alignment requirement for IOBinding buffers beyond the element type, and
its CUDA kernels take the pointers they are given. So the new-KV outputs stay in place
at ``base + L * row_bytes`` (float32-aligned, row-aligned), which avoids a staging buffer
and a copy per call that would need cuda-python. The positions are bound in host memory
rather than at a device address ``+ 8*L``: that costs onnxruntime one 8*q-byte copy next
to the ids' and leaves the new-KV rows as the only device addresses not 256-aligned.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import BackendError, EngineError
from ..manifest import ModelEntry
from .base import ThreadConfig
from .kv_layout import KVLayout, check_call

__all__ = ["CUDA_EP", "ort_cuda_available", "OrtCudaModel"]

CUDA_EP = "CUDAExecutionProvider"


def ort_cuda_available(ort=None) -> str | None:
    """None when onnxruntime has the CUDA provider, else the reason it cannot be used."""
    try:
        ort = ort or importlib.import_module("onnxruntime")
    except ImportError as e:  # pragma: no cover - onnxruntime is a base dependency
        return f"onnxruntime is not importable ({e})"
    have = list(ort.get_available_providers())
    if CUDA_EP not in have:
        return f"this onnxruntime has no {CUDA_EP} (providers: {', '.join(have)}); install onnxruntime-gpu in place of onnxruntime"
    return None


class OrtCudaModel:
    """One exported model on onnxruntime with device-resident, in-place KV; implements
    :class:`~specrt.runtime.backends.base.Model`.

    Args:
        path: the ONNX file.
        entry: its manifest entry.
        max_ctx: KV rows.
        max_q: widest call (sizes the ids and logits buffers).
        threads: :class:`~specrt.runtime.backends.base.ThreadConfig` (for nodes left on CPU).
        device_type: ``"cuda"`` (the backend) or ``"cpu"`` (same code path on the CPU
            provider with onnxruntime-allocated buffers; used by the CPU tests).
        device_id: CUDA device ordinal.
        ort: the onnxruntime module or a stand-in (None imports it).

    Attributes:
        max_q, vocab, max_ctx: as :class:`~specrt.runtime.backends.base.Model`.
        layout: :class:`~specrt.runtime.backends.kv_layout.KVLayout` of the device KV.

    Raises:
        ValueError: ``device_type`` is neither ``"cuda"`` nor ``"cpu"``.
        BackendError: ``device_type="cuda"`` but onnxruntime has no CUDA provider, or the
            session fell back to CPU (no usable GPU / CUDA libraries).
        EngineError: the model cannot be loaded or its I/O names differ from the manifest.
    """

    def __init__(
        self,
        path: Path,
        entry: ModelEntry,
        max_ctx: int,
        max_q: int,
        threads: ThreadConfig = ThreadConfig(),
        device_type: str = "cuda",
        device_id: int = 0,
        ort=None,
    ):
        ort = ort or importlib.import_module("onnxruntime")
        if device_type not in ("cuda", "cpu"):
            raise ValueError(f"device_type={device_type!r}; must be 'cuda' or 'cpu'")
        if device_type == "cuda":
            reason = ort_cuda_available(ort)
            if reason:
                raise BackendError(f"backend 'ort-cuda' is unavailable: {reason}")
            providers = [(CUDA_EP, {"device_id": device_id}), "CPUExecutionProvider"]
        else:
            providers = ["CPUExecutionProvider"]
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads.intra_op
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 3
        try:
            self.session = ort.InferenceSession(str(path), so, providers=providers)
        except Exception as e:  # onnxruntime raises its own exception types
            raise EngineError(f"{path}: onnxruntime cannot load this model ({type(e).__name__}: {str(e)[:300]})") from None
        if device_type == "cuda" and self.session.get_providers()[:1] != [CUDA_EP]:
            raise BackendError(
                f"backend 'ort-cuda': onnxruntime could not start {CUDA_EP} (session providers {self.session.get_providers()}); "
                "is an NVIDIA GPU with matching CUDA/cuDNN libraries present?"
            )
        got_in = {i.name for i in self.session.get_inputs()}
        got_out = {o.name for o in self.session.get_outputs()}
        if got_in != set(entry.inputs) or got_out != set(entry.outputs):
            raise EngineError(f"{path}: I/O names {sorted(got_in)} -> {sorted(got_out)} differ from the manifest's {entry.inputs} -> {entry.outputs}")
        self._ort = ort
        from .ort import check_graph, graph_shapes

        check_graph(path, self.session, graph_shapes(entry), "model")
        self.entry = entry
        self.max_ctx = max_ctx
        self.max_q = max_q
        self.vocab = entry.vocab_size
        self.device = (device_type, device_id)
        self.layout = KVLayout(entry.n_layers, entry.n_kv_heads, entry.head_dim, max_ctx)
        self._allocate()

    def _allocate(self) -> None:
        """This object's buffers and I/O binding (the session is shared with forks)."""
        lay, (device_type, device_id) = self.layout, self.device
        new = self._ort.OrtValue.ortvalue_from_shape_and_type
        # device memory, once (the OrtValue owns it; kept alive on self)
        self._kv_value = new([lay.total_bytes // 4], np.float32, device_type, device_id)
        self.kv_bases = lay.buffer_bases(self._kv_value.data_ptr())
        # host buffers
        self.ids = np.zeros(self.max_q, np.int64)
        self.positions = np.arange(self.max_ctx, dtype=np.int64)
        self.logits = np.zeros((1, self.max_q, self.vocab), np.float32)
        self._ids_ptr = self.ids.ctypes.data
        self._pos_ptr = self.positions.ctypes.data
        self._logits_ptr = self.logits.ctypes.data
        self._binding = self.session.io_binding()
        self._kv = [(past, new_, base) for (past, new_), base in zip(lay.names(), self.kv_bases)]

    def fork(self) -> "OrtCudaModel":
        """A model over the same onnxruntime session (weights loaded once) with its own
        device KV, host ids/positions/logits and I/O binding, so two threads can run the
        two objects at once (onnxruntime's ``Run`` is thread-safe across bindings). Costs
        one KV allocation (``layout.total_bytes`` of device memory) and the host buffers.

        Raises:
            EngineError: this model is closed.
        """
        if self._binding is None:
            raise EngineError("this ort-cuda model is closed; load the Engine again")
        new = object.__new__(type(self))
        new.__dict__.update({k: getattr(self, k) for k in ("session", "_ort", "entry", "max_ctx", "max_q", "vocab", "device", "layout")})
        new._allocate()
        return new

    def close(self) -> None:
        """Drop this object's device KV, host buffers and binding (the shared session is
        freed with its last user); ``run`` raises EngineError after. Idempotent."""
        self._binding = None
        self._kv_value = None
        self._kv = []
        self.kv_bases = []

    def run(self, tokens: Sequence[int] | np.ndarray, start: int) -> np.ndarray:
        """Run ``q = len(tokens)`` new tokens at positions ``start .. start+q-1``.

        Reads device KV rows [0, start), writes rows [start, start+q) in place.

        Args:
            tokens: q token ids, 1 <= q <= max_q.
            start: committed KV length L; 0 <= L and L + q <= max_ctx.

        Returns:
            float32 view ``[q, vocab]`` of the host logits buffer (valid until the next call).

        Raises:
            InputError: q or start outside the buffers.
            EngineError: the model is closed.
        """
        q = len(tokens)
        check_call(q, start, self.max_q, self.max_ctx)
        b = self._binding
        if b is None:
            raise EngineError("this ort-cuda model is closed; load the Engine again")
        self.ids[:q] = tokens
        dev, did = self.device
        lay = self.layout
        b.bind_input("input_ids", "cpu", 0, np.int64, [1, q], self._ids_ptr)
        b.bind_input("position_ids", "cpu", 0, np.int64, [1, q], self._pos_ptr + 8 * start)
        past_shape = list(lay.past_shape(start))
        new_shape = list(lay.new_shape(q))
        off = lay.new_offset(start)
        for past_name, new_name, base in self._kv:
            b.bind_input(past_name, dev, did, np.float32, past_shape, base)
            b.bind_output(new_name, dev, did, np.float32, new_shape, base + off)
        b.bind_output("logits", "cpu", 0, np.float32, [1, q, self.vocab], self._logits_ptr)
        self.session.run_with_iobinding(b)
        return self.logits[0, :q]

    def kv_rows(self, layer: int, which: str, rows: int) -> np.ndarray:
        """Copy of KV rows [0, rows) of one buffer as float32 ``[rows, h, d]`` (tests; ``device_type="cpu"`` only).

        Args:
            layer: layer index; which: ``"key"`` or ``"value"``; rows: how many rows.

        Raises:
            ValueError: called on a 'cuda' model (device memory is not host-readable).
        """
        if self.device[0] != "cpu":
            raise ValueError("kv_rows reads host memory; it is only available with device_type='cpu'")
        j = 2 * layer + (0 if which == "key" else 1)
        flat = self._kv_value.numpy()
        start = (self.kv_bases[j] - self.kv_bases[0]) // 4
        n = rows * self.layout.row_bytes // 4
        return flat[start : start + n].reshape(rows, self.layout.n_kv_heads, self.layout.head_dim).copy()
