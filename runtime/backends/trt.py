"""TensorRT backend: one serialized engine (``.plan``) per model with all its optimization
profiles; the same interface as :class:`~specrt.runtime.ort_backend.OrtModel`.

NOT RUN ON A GPU YET (docs/GPU.md): on CPU machines this module is tested against a
recording stand-in for ``tensorrt`` and ``cuda.bindings.runtime`` that executes the
ONNX model with onnxruntime (tests/fake_gpu.py).

Design (all allocations in ``__init__``; a call does no allocation)::

    one execution context per profile, created USER_MANAGED, all sharing ONE scratch
        allocation sized max over profiles of get_device_memory_size_for_profile_v2
        (they run one at a time on one stream, which the API allows), each bound to
        its profile once with set_optimization_profile_async
    device memory: KV (one allocation, 2 * n_layers buffers, see KVLayout), input_ids
        [max_q] int64, positions arange(max_ctx) int64 (uploaded once), logits
        [max_q, vocab] float32; pinned host: ids [max_q] int64, logits [max_q, vocab]
    constant addresses (input_ids, logits, every past input = its buffer base) are set
        once per context at load

    run(tokens, L), q = len(tokens):
        i = profiles.select(q, L)                       # pure Python, InputError if out of range
        ids (pinned) <- tokens; cudaMemcpyAsync H2D 8*q bytes
        ctx_i.set_input_shape: input_ids/position_ids (1, q); past_* (1, pad + L, h, d)
        ctx_i.set_tensor_address: position_ids -> positions + 8*L;
                                  new_* -> buffer base + (pad + L) * row_bytes
        ctx_i.execute_async_v3(stream)
        cudaMemcpyAsync D2H q * vocab * 4 bytes of logits (only the q rows of this call)
        cudaStreamSynchronize(stream)
        return pinned logits[:q]                        # float32 [q, vocab] view
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import BackendError, EngineError, InputError
from ..manifest import ModelEntry
from .cuda_mem import CudaRuntime, host_array
from .kv_layout import KVLayout, align_up
from .profiles import ProfileSet, check_engine_profiles

__all__ = ["load_tensorrt", "TrtModel"]


def load_tensorrt():
    """Import the ``tensorrt`` Python package.

    Raises:
        BackendError: not installed (NVIDIA's wheels; not on the project's CPU machines).
    """
    try:
        return importlib.import_module("tensorrt")
    except ImportError as e:
        raise BackendError(f"backend 'tensorrt' needs NVIDIA's tensorrt Python package and a GPU; import tensorrt failed ({e})") from None


def _ok(res, what: str) -> None:
    """TensorRT setters return False on refusal (and log why); turn that into EngineError."""
    if res is False:
        raise EngineError(f"TensorRT refused {what} (see the TensorRT log above)")


class TrtModel:
    """One model as a TensorRT engine with in-place device KV (see module docstring).

    Args:
        plan: the serialized engine file.
        entry: the model's manifest entry (dims, I/O names).
        profiles: its :class:`~specrt.runtime.profiles.ProfileSet` from the manifest's
            extra (the same order as the plan's profiles).
        max_q: widest call the caller wants; the model's ``max_q`` is the smaller of this
            and the profiles' widest q.
        trt: the ``tensorrt`` module or a stand-in (None imports it).
        cuda: a :class:`~specrt.runtime.cuda_mem.CudaRuntime` (None makes one on the real
            ``cuda.bindings.runtime``).

    Attributes:
        max_q, vocab: as :class:`~specrt.runtime.ort_backend.OrtModel`.
        layout: :class:`~specrt.runtime.kv_layout.KVLayout` of the device KV.

    Raises:
        BackendError: tensorrt or cuda-python missing.
        EngineError: the plan cannot be read or deserialized (other TensorRT version or
            GPU), its I/O or profiles differ from the manifest, or a CUDA call fails.
    """

    def __init__(self, plan: Path, entry: ModelEntry, profiles: ProfileSet, max_q: int, trt=None, cuda: CudaRuntime | None = None):
        trt = trt if trt is not None else load_tensorrt()
        self.trt = trt
        self.cuda = cuda = cuda if cuda is not None else CudaRuntime()
        self.entry = entry
        self.profiles = profiles
        self.max_ctx = profiles.max_ctx
        self.max_q = min(int(max_q), profiles.max_q)
        self.vocab = entry.vocab_size
        self.layout = lay = KVLayout(entry.n_layers, entry.n_kv_heads, entry.head_dim, profiles.max_ctx, profiles.pad)
        try:
            blob = Path(plan).read_bytes()
        except OSError as e:
            raise EngineError(f"{plan}: cannot read the TensorRT plan ({e.strerror}); rebuild it with `python -m specrt.export.trt_build`") from None
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = eng = self._runtime.deserialize_cuda_engine(blob)
        del blob
        if eng is None:
            raise EngineError(
                f"{plan}: TensorRT could not deserialize this plan (built by another TensorRT version or for another GPU?); "
                "rebuild it on this machine with `python -m specrt.export.trt_build`"
            )
        self._check_io(plan)
        check_engine_profiles(
            profiles,
            [{n: eng.get_tensor_profile_shape(n, i) for n in entry.inputs} for i in range(eng.num_optimization_profiles)],
            entry.inputs,
            entry.n_kv_heads,
            entry.head_dim,
        )
        # ---- device and pinned memory, once ------------------------------------------
        self.stream = cuda.stream_create()
        n_prof = len(profiles.profiles)
        if hasattr(eng, "get_device_memory_size_for_profile_v2"):
            scratch = max(int(eng.get_device_memory_size_for_profile_v2(i)) for i in range(n_prof))
        else:
            scratch = int(eng.device_memory_size_v2)
        self.scratch_bytes = scratch
        self._allocs: list[int] = []
        self._host_allocs: list[int] = []
        self.scratch = self._malloc(scratch)
        self.kv_base = self._malloc(lay.total_bytes)
        self.kv_bases = lay.buffer_bases(self.kv_base)
        cuda.memset_async(self.kv_base, 0, lay.total_bytes, self.stream)  # dummy pad rows must be finite
        self.d_ids = self._malloc(align_up(8 * self.max_q))
        self.d_pos = self._malloc(align_up(8 * self.max_ctx))
        self.d_logits = self._malloc(align_up(4 * self.max_q * self.vocab))
        self._h_ids_ptr = self._malloc_host(8 * self.max_q)
        self._h_logits_ptr = self._malloc_host(4 * self.max_q * self.vocab)
        self.h_ids = host_array(self._h_ids_ptr, (self.max_q,), np.int64)
        self.h_logits = host_array(self._h_logits_ptr, (self.max_q, self.vocab), np.float32)
        positions = np.arange(self.max_ctx, dtype=np.int64)
        cuda.htod_async(self.d_pos, positions.ctypes.data, positions.nbytes, self.stream)
        cuda.synchronize(self.stream)  # positions is a temporary: copy done before it goes
        # ---- one context per profile, shared scratch, constant addresses --------------
        self.contexts = []
        strategy = trt.ExecutionContextAllocationStrategy.USER_MANAGED
        for i in range(n_prof):
            ctx = eng.create_execution_context(strategy)
            if ctx is None:
                raise EngineError(f"{plan}: TensorRT could not create an execution context for profile {i}")
            ctx.set_device_memory(self.scratch, scratch)
            _ok(ctx.set_optimization_profile_async(i, self.stream), f"optimization profile {i} of {plan}")
            _ok(ctx.set_tensor_address("input_ids", self.d_ids), "the address of input_ids")
            _ok(ctx.set_tensor_address("logits", self.d_logits), "the address of logits")
            for (past, _), base in zip(lay.names(), self.kv_bases):
                _ok(ctx.set_tensor_address(past, base), f"the address of {past}")
            self.contexts.append(ctx)
        cuda.synchronize(self.stream)
        # hot-path tables, computed once
        self._kv = [(past, new, base) for (past, new), base in zip(lay.names(), self.kv_bases)]
        self._past_names = [p for p, _ in lay.names()]

    # ---- setup helpers -------------------------------------------------------------
    def _malloc(self, n: int) -> int:
        p = self.cuda.malloc(n)
        self._allocs.append(p)
        return p

    def _malloc_host(self, n: int) -> int:
        p = self.cuda.malloc_host(n)
        self._host_allocs.append(p)
        return p

    def _check_io(self, plan) -> None:
        """The plan's tensors, modes and dtypes must be the manifest's interface."""
        trt, eng, e = self.trt, self.engine, self.entry
        names = [eng.get_tensor_name(i) for i in range(eng.num_io_tensors)]
        ins = {n for n in names if eng.get_tensor_mode(n) == trt.TensorIOMode.INPUT}
        outs = set(names) - ins
        if ins != set(e.inputs) or outs != set(e.outputs):
            raise EngineError(f"{plan}: I/O names {sorted(ins)} -> {sorted(outs)} differ from the manifest's {e.inputs} -> {e.outputs}")
        for n in names:
            want = np.int64 if n in ("input_ids", "position_ids") else np.float32
            got = np.dtype(trt.nptype(eng.get_tensor_dtype(n)))
            if got != np.dtype(want):
                raise EngineError(f"{plan}: tensor {n!r} is {got}, the runtime binds {np.dtype(want)} (build with keep-io-types precision)")

    # ---- the call --------------------------------------------------------------------
    def run(self, tokens: Sequence[int] | np.ndarray, start: int) -> np.ndarray:
        """Run ``q = len(tokens)`` new tokens at positions ``start .. start+q-1``.

        Reads KV rows [0, start) and writes rows [start, start+q) of every layer in place
        on the device; copies back only the q logits rows of this call.

        Args:
            tokens: q token ids, 1 <= q <= max_q.
            start: committed KV length L; 0 <= L and L + q <= max_ctx.

        Returns:
            float32 ``[q, vocab]`` view of the pinned host logits buffer (valid until the
            next call; copy it to keep it).

        Raises:
            InputError: (q, L) outside every profile (message: input and allowed range).
            EngineError: TensorRT refused a shape/address or the execution failed.
        """
        q = len(tokens)
        if q < 1 or q > self.max_q:
            raise InputError(self.profiles.refusal(q, start))
        i = self.profiles.select(q, start)
        ctx = self.contexts[i]
        cuda, stream, lay = self.cuda, self.stream, self.layout
        self.h_ids[:q] = tokens
        cuda.htod_async(self.d_ids, self._h_ids_ptr, 8 * q, stream)
        tok_shape = (1, q)
        past_shape = lay.past_shape(start)
        ok = ctx.set_input_shape("input_ids", tok_shape)
        ok = ctx.set_input_shape("position_ids", tok_shape) and ok
        for name in self._past_names:
            ok = ctx.set_input_shape(name, past_shape) and ok
        ok = ctx.set_tensor_address("position_ids", self.d_pos + 8 * start) and ok
        off = lay.new_offset(start)
        for _, new, base in self._kv:
            ok = ctx.set_tensor_address(new, base + off) and ok
        _ok(ok, f"shapes/addresses for q={q}, past={start} in profile {self.profiles.profiles[i].name}")
        _ok(ctx.execute_async_v3(stream), f"execute_async_v3 (q={q}, past={start})")
        cuda.dtoh_async(self._h_logits_ptr, self.d_logits, 4 * q * self.vocab, stream)
        cuda.synchronize(stream)
        return self.h_logits[:q]

    def close(self) -> None:
        """Free device and pinned memory and the stream (the model is unusable after)."""
        cuda = self.cuda
        self.contexts = []
        for p in self._allocs:
            cuda.free(p)
        for p in self._host_allocs:
            cuda.free_host(p)
        self._allocs, self._host_allocs = [], []
        cuda.stream_destroy(self.stream)
