"""TensorRT backend: one serialized engine (``.plan``) per model with all its optimization
profiles; the same interface as :class:`~specrt.runtime.backends.ort.OrtModel`. Needs
TensorRT >= 10.1 (:data:`MIN_TENSORRT`).

NOT RUN ON A GPU YET (docs/guide/gpu.md): on CPU machines this module is tested against a
stand-in for ``tensorrt`` and ``cuda.bindings.runtime`` that executes the ONNX model with
onnxruntime and refuses what TensorRT documents as refused (tests/fake_gpu.py).

Design (all allocations in ``__init__``; a call does no allocation)::

    one execution context per profile, created USER_MANAGED, all sharing ONE scratch
        allocation sized max over profiles of get_device_memory_size_for_profile_v2
        (they run one at a time on one stream, which the API allows), each bound to
        its profile once with set_optimization_profile_async. TensorRT allows one live
        context per profile of an engine, so a model cannot fork (see :meth:`TrtModel.fork`)
    device memory (every tensor address 256-byte aligned, as setTensorAddress requires):
        KV        one allocation, 2 * n_layers buffers (KVLayout), each base aligned
        tokens    [2, P] int64, P = align_up(8 * max_q): row 0 input_ids, row 1 position_ids
        logits    [max_q, vocab] float32
        staging   2 * n_layers buffers of align_up(max_q * row_bytes), only when
                  row_bytes % 256 != 0 (see "new KV rows" below)
    pinned host: tokens [2, P] int64, logits [max_q, vocab] float32
    constant addresses, set once per context at load: input_ids, position_ids, logits,
        every past input (= its buffer base), and with staging every new-KV output

    run(tokens, L), q = len(tokens):
        i = profiles.select(q, L)                       # pure Python, InputError if out of range
        pinned tokens[0, :q] <- ids; tokens[1, :q] <- L .. L+q-1
        cudaMemcpy2DAsync H2D: 2 rows of 8*q bytes (pitch P) -> both aligned device rows
        ctx_i.set_input_shape: input_ids/position_ids (1, q); past_* (1, pad + L, h, d)
        in place only:  ctx_i.set_tensor_address new_* -> base + (pad + L) * row_bytes
        ctx_i.execute_async_v3(stream)
        staging only:   cudaMemcpy2DAsync D2D: 2 * n_layers rows of q * row_bytes bytes,
                        from the staging buffers (pitch align_up(max_q * row_bytes)) to
                        base_0 + (pad + L) * row_bytes (pitch = the KV buffer stride)
        cudaMemcpyAsync D2H q * vocab * 4 bytes of logits (only the q rows of this call)
        cudaStreamSynchronize(stream)
        return pinned logits[:q]                        # float32 [q, vocab] view

New KV rows. Writing them in place needs ``base + (pad + L) * row_bytes`` to be 256-byte
aligned for every L, i.e. ``row_bytes % 256 == 0`` (``n_kv_heads * head_dim`` a multiple
of 64 at float32: e.g. the default target, 2 x 64). Otherwise (the default draft, 2 x 48 =
384 bytes; the tests' tiny pair, 64 and 128 bytes) TensorRT writes the q new rows into the
aligned staging buffers and one strided device-to-device copy moves them into place.
Cost of staging: 2 * n_layers * q * row_bytes bytes copied on the device per call (the
default draft: 1.5 KiB per decode step, 384 KiB per 256-token prefill chunk) plus one
more copy launch on the stream; device memory 2 * n_layers * align_up(max_q * row_bytes)
bytes (384 KiB for the default draft). The copy needs the KV buffer stride to be at most
the device's maximum pitch (:data:`MAX_PITCH`), checked at load. Positions no longer point
into an ``arange`` at ``+ 8 * L`` (misaligned for most L): they travel with the ids in the
one host-to-device copy above, 8 * q bytes more per call.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import BackendError, EngineError, InputError
from ..manifest import ModelEntry
from .cuda_mem import CudaRuntime, host_array
from .kv_layout import KVLayout, align_up
from .profiles import ProfileSet, check_engine_profiles

__all__ = ["MIN_TENSORRT", "MAX_PITCH", "load_tensorrt", "tensorrt_version_problem", "check_tensorrt_version", "TrtModel"]

MIN_TENSORRT = (10, 1)
"""Oldest TensorRT this runtime and the plan builder accept. What they call is TensorRT 10
API: strongly typed networks created without ``EXPLICIT_BATCH`` (TensorRT 8 would build an
implicit-batch network from those flags), ``execute_async_v3``, USER_MANAGED contexts,
and the V2 device-memory calls ``get_device_memory_size_for_profile_v2`` /
``set_device_memory(ptr, size)``, which TensorRT 10.0 does not have yet (its
ICudaEngine member list ends at getDeviceMemorySizeForProfile)."""

MAX_PITCH = 2**31 - 1  # cudaDevAttrMaxPitch of current NVIDIA GPUs: largest pitch of cudaMemcpy2DAsync (bytes)


def tensorrt_version_problem(trt) -> str | None:
    """None when the ``tensorrt`` module ``trt`` is recent enough (:data:`MIN_TENSORRT`),
    else one line naming the installed version and what is needed."""
    v = str(getattr(trt, "__version__", "unknown"))
    m = re.match(r"\s*(\d+)\.(\d+)", v)
    if m and (int(m.group(1)), int(m.group(2))) >= MIN_TENSORRT:
        return None
    need = ".".join(map(str, MIN_TENSORRT))
    return (
        f"specrt needs TensorRT >= {need}, the installed tensorrt is {v} (specrt uses strongly typed networks, execute_async_v3 "
        f"and the V2 device-memory API of TensorRT {need}); install NVIDIA's tensorrt >= {need} wheels"
    )


def check_tensorrt_version(trt) -> None:
    """Refuse a ``tensorrt`` module older than :data:`MIN_TENSORRT`.

    Raises:
        BackendError: one line naming the installed version and the version needed.
    """
    problem = tensorrt_version_problem(trt)
    if problem:
        raise BackendError(f"backend 'tensorrt': {problem}")


def load_tensorrt():
    """Import the ``tensorrt`` Python package and check its version.

    Raises:
        BackendError: not installed (NVIDIA's wheels; not on the project's CPU machines),
            or older than :data:`MIN_TENSORRT`.
    """
    try:
        trt = importlib.import_module("tensorrt")
    except ImportError as e:
        raise BackendError(f"backend 'tensorrt' needs NVIDIA's tensorrt Python package and a GPU; import tensorrt failed ({e})") from None
    check_tensorrt_version(trt)
    return trt


def _ok(res, what: str) -> None:
    """TensorRT setters return False on refusal (and log why); turn that into EngineError."""
    if res is False:
        raise EngineError(f"TensorRT refused {what} (see the TensorRT log above)")


class TrtModel:
    """One model as a TensorRT engine with device-resident KV (see module docstring);
    implements :class:`~specrt.runtime.backends.base.Model`.

    Args:
        plan: the serialized engine file.
        entry: the model's manifest entry (dims, I/O names).
        profiles: its :class:`~specrt.runtime.backends.profiles.ProfileSet` from the
            manifest's extra (the same order as the plan's profiles).
        max_q: widest call the caller wants; the model's ``max_q`` is the smaller of this
            and the profiles' widest q.
        trt: the ``tensorrt`` module or a stand-in (None imports it).
        cuda: a :class:`~specrt.runtime.backends.cuda_mem.CudaRuntime` (None makes one on
            the real ``cuda.bindings.runtime``).

    Attributes:
        max_q, max_ctx, vocab: as :class:`~specrt.runtime.backends.base.Model`.
        layout: :class:`~specrt.runtime.backends.kv_layout.KVLayout` of the device KV.
        in_place: True when new KV rows are written in place (``row_bytes % 256 == 0``),
            False when they go through the staging buffers.
        scratch_bytes: the shared scratch size (max over profiles of
            ``get_device_memory_size_for_profile_v2``).

    Raises:
        BackendError: tensorrt or cuda-python missing, or TensorRT older than
            :data:`MIN_TENSORRT`.
        EngineError: the plan cannot be read or deserialized (other TensorRT version or
            GPU), its I/O or profiles differ from the manifest, the KV stride exceeds
            :data:`MAX_PITCH`, TensorRT refuses a setting, or a CUDA call fails. Whatever
            was allocated before the failure is freed.
    """

    def __init__(self, plan: Path, entry: ModelEntry, profiles: ProfileSet, max_q: int, trt=None, cuda: CudaRuntime | None = None):
        trt = trt if trt is not None else load_tensorrt()
        check_tensorrt_version(trt)
        self.trt = trt
        self.cuda = cuda if cuda is not None else CudaRuntime()
        self.entry = entry
        self.profiles = profiles
        self.max_ctx = profiles.max_ctx
        self.max_q = min(int(max_q), profiles.max_q)
        self.vocab = entry.vocab_size
        self.layout = KVLayout(entry.n_layers, entry.n_kv_heads, entry.head_dim, profiles.max_ctx, profiles.pad)
        self.in_place = self.layout.rows_aligned
        self.engine = self._runtime = self.stream = None
        self.contexts: list = []
        self._allocs: list[int] = []
        self._host_allocs: list[int] = []
        self._closed = False
        try:
            self._load(Path(plan))
        except BaseException:
            try:
                self.close()
            except EngineError:
                pass  # the load failure is the error to report
            raise

    # ---- setup -------------------------------------------------------------------------
    def _load(self, plan: Path) -> None:
        """Deserialize, check, allocate and bind (the body of ``__init__``)."""
        trt, cuda, lay, entry, profiles = self.trt, self.cuda, self.layout, self.entry, self.profiles
        try:
            blob = plan.read_bytes()
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
        if not self.in_place and lay.stride > MAX_PITCH:
            raise EngineError(
                f"{plan}: KV buffers of {lay.stride} bytes exceed cudaMemcpy2DAsync's maximum pitch {MAX_PITCH} "
                f"(rows of {lay.row_bytes} bytes are not 256-byte aligned, so new rows are copied into place); lower max_ctx"
            )
        # ---- device and pinned memory, once ------------------------------------------
        self.stream = cuda.stream_create()
        n_prof = len(profiles.profiles)
        self.scratch_bytes = scratch = max(int(eng.get_device_memory_size_for_profile_v2(i)) for i in range(n_prof))
        self.scratch = self._malloc(scratch)
        self.kv_base = self._malloc(lay.total_bytes)
        self.kv_bases = lay.buffer_bases(self.kv_base)
        cuda.memset_async(self.kv_base, 0, lay.total_bytes, self.stream)  # dummy pad rows must be finite
        self.tok_pitch = align_up(8 * self.max_q)
        self.d_ids = self._malloc(2 * self.tok_pitch)
        self.d_pos = self.d_ids + self.tok_pitch
        self.d_logits = self._malloc(align_up(4 * self.max_q * self.vocab))
        if self.in_place:
            self.stage_pitch, self.stage_bases = 0, []
        else:
            self.stage_pitch = align_up(self.max_q * lay.row_bytes)
            self.d_stage = self._malloc(2 * lay.n_layers * self.stage_pitch)
            self.stage_bases = [self.d_stage + j * self.stage_pitch for j in range(2 * lay.n_layers)]
        self._h_tok_ptr = self._malloc_host(2 * self.tok_pitch)
        self._h_logits_ptr = self._malloc_host(4 * self.max_q * self.vocab)
        self.h_tok = host_array(self._h_tok_ptr, (2, self.tok_pitch // 8), np.int64)
        self.h_logits = host_array(self._h_logits_ptr, (self.max_q, self.vocab), np.float32)
        self._arange = np.arange(self.max_q, dtype=np.int64)
        # ---- one context per profile, shared scratch, constant addresses --------------
        strategy = trt.ExecutionContextAllocationStrategy.USER_MANAGED
        for i in range(n_prof):
            ctx = eng.create_execution_context(strategy)
            if ctx is None:
                raise EngineError(f"{plan}: TensorRT could not create an execution context for profile {i}")
            self.contexts.append(ctx)
            ctx.set_device_memory(self.scratch, scratch)
            _ok(ctx.set_optimization_profile_async(i, self.stream), f"optimization profile {i} of {plan}")
            fixed = [("input_ids", self.d_ids), ("position_ids", self.d_pos), ("logits", self.d_logits)]
            fixed += [(past, base) for (past, _), base in zip(lay.names(), self.kv_bases)]
            fixed += [(new, base) for (_, new), base in zip(lay.names(), self.stage_bases)]
            for name, addr in fixed:
                _ok(ctx.set_tensor_address(name, addr), f"the address of {name}")
        cuda.synchronize(self.stream)
        # hot-path tables, computed once
        self._new_kv = [(new, base) for (_, new), base in zip(lay.names(), self.kv_bases)]
        self._past_names = [p for p, _ in lay.names()]

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

        Reads KV rows [0, start) and writes rows [start, start+q) of every layer on the
        device (in place, or through the staging buffers; module docstring); copies back
        only the q logits rows of this call.

        Args:
            tokens: q token ids, 1 <= q <= max_q.
            start: committed KV length L; 0 <= L and L + q <= max_ctx.

        Returns:
            float32 ``[q, vocab]`` view of the pinned host logits buffer (valid until the
            next call; copy it to keep it).

        Raises:
            InputError: (q, L) outside every profile (message: input and allowed range).
            EngineError: the model is closed, TensorRT refused a shape/address, or the
                execution or a copy failed.
        """
        if self._closed:
            raise EngineError("this TensorRT model is closed; load the Engine again")
        q = len(tokens)
        if q < 1 or q > self.max_q:
            raise InputError(self.profiles.refusal(q, start))
        i = self.profiles.select(q, start)
        ctx = self.contexts[i]
        cuda, stream, lay, pitch = self.cuda, self.stream, self.layout, self.tok_pitch
        h = self.h_tok
        h[0, :q] = tokens
        np.add(self._arange[:q], start, out=h[1, :q])
        cuda.htod_2d_async(self.d_ids, pitch, self._h_tok_ptr, pitch, 8 * q, 2, stream)
        tok_shape = (1, q)
        past_shape = lay.past_shape(start)
        ok = ctx.set_input_shape("input_ids", tok_shape)
        ok = ctx.set_input_shape("position_ids", tok_shape) and ok
        for name in self._past_names:
            ok = ctx.set_input_shape(name, past_shape) and ok
        off = lay.new_offset(start)
        if self.in_place:
            for new, base in self._new_kv:
                ok = ctx.set_tensor_address(new, base + off) and ok
        _ok(ok, f"shapes/addresses for q={q}, past={start} in profile {self.profiles.profiles[i].name}")
        _ok(ctx.execute_async_v3(stream), f"execute_async_v3 (q={q}, past={start})")
        if not self.in_place:
            cuda.dtod_2d_async(self.kv_base + off, lay.stride, self.d_stage, self.stage_pitch, q * lay.row_bytes, 2 * lay.n_layers, stream)
        cuda.dtoh_async(self._h_logits_ptr, self.d_logits, 4 * q * self.vocab, stream)
        cuda.synchronize(stream)
        return self.h_logits[:q]

    def fork(self) -> "TrtModel":
        """Not possible: TensorRT allows one live execution context per optimization
        profile of an engine, and this model's contexts hold every profile, so a second
        model over the same deserialized engine could not select any. Load another
        Engine instead (its own deserialized engine, weights loaded again); the server's
        worker pool does this by itself.

        Raises:
            BackendError: always.
        """
        raise BackendError(
            "backend 'tensorrt' cannot fork a model: TensorRT allows one execution context per optimization profile, "
            "and this model's contexts hold every profile; load another Engine for each concurrent generation"
        )

    def close(self) -> None:
        """Free the contexts, the engine, device and pinned memory and the stream; the
        model is unusable after (``run`` raises EngineError). Idempotent.

        Work queued on the stream is finished first; every allocation is released even
        if one release fails.

        Raises:
            EngineError: a CUDA call failed (the first failure, after trying all).
        """
        if self._closed:
            return
        self._closed = True
        cuda, first = self.cuda, None

        def attempt(fn, *args):
            nonlocal first
            try:
                fn(*args)
            except EngineError as e:
                first = first or e

        if self.stream is not None:
            attempt(cuda.synchronize, self.stream)
        self.contexts = []  # contexts go before their scratch memory and their engine
        self.engine = self._runtime = None
        self.h_tok = self.h_logits = None
        for p in self._allocs:
            attempt(cuda.free, p)
        for p in self._host_allocs:
            attempt(cuda.free_host, p)
        self._allocs, self._host_allocs = [], []
        if self.stream is not None:
            attempt(cuda.stream_destroy, self.stream)
            self.stream = None
        if first is not None:
            raise first
