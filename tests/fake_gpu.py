"""Recording stand-ins for ``tensorrt`` and ``cuda.bindings.runtime`` that run on CPU.

"Device" memory is host memory (so addresses are real and copies are ``ctypes.memmove``);
work queued on a stream runs at ``cudaStreamSynchronize`` (so a missing sync shows up as
stale data). The fake TensorRT builder serializes a JSON "plan" naming the ONNX file and
the profiles; the fake engine executes that ONNX with onnxruntime (CPU) on the tensors it
reads from the addresses and shapes the backend set, and writes the outputs to the bound
addresses. Every call is appended to ``log`` for call-sequence assertions.

What the stand-ins enforce, because the TensorRT / CUDA documentation says so (each
refusal is the API's own: False from a TensorRT setter, an error code from CUDA, and a
``("refused", why, ...)`` entry in ``log``):

* ``set_tensor_address``: 256-byte alignment (NvInferRuntime.h, setTensorAddress);
* ``set_input_shape``: the shape lies inside the context's selected profile;
* ``set_optimization_profile_async``: one live execution context per profile of an engine;
  a new context holds profile 0 only if no other live context does;
* ``execute_async_v3``: every shape and address set, scratch memory large enough for the
  profile (``get_device_memory_size_for_profile_v2``, which differs per profile here);
* CUDA: frees of unknown pointers, unknown streams, device ranges outside a live
  allocation, 2D copies (``cudaMemcpy2DAsync``) with pageable host memory, width > pitch,
  or overlapping areas. Live allocations and streams are tracked (:meth:`FakeCuda.outstanding`).

``FakeTRT(version=...)`` sets ``tensorrt.__version__`` (e.g. a TensorRT 9 stand-in).
"""

from __future__ import annotations

import ctypes
import json
import types
import weakref
from pathlib import Path

import numpy as np


class Err(int):
    """cudaError_t-like: an int with a name."""

    @property
    def name(self):
        return _ERR_NAMES.get(int(self), f"cudaError{int(self)}")


_ERR_NAMES = {
    0: "cudaSuccess",
    1: "cudaErrorInvalidValue",
    2: "cudaErrorMemoryAllocation",
    12: "cudaErrorInvalidPitchValue",
    400: "cudaErrorInvalidResourceHandle",
}
OK = Err(0)
INVALID_VALUE = Err(1)
INVALID_PITCH = Err(12)
INVALID_HANDLE = Err(400)
MAX_PITCH = 2**31 - 1  # cudaDevAttrMaxPitch of current NVIDIA GPUs (bytes)


class FakeCuda:
    """The subset of ``cuda.bindings.runtime`` the backends use, recording calls.

    Enforces what the CUDA runtime documents for these calls (an error code, never a
    crash): frees of unknown pointers, unknown streams, device ranges outside a live
    ``cudaMalloc`` allocation, copy directions that do not match the pointers, 2D copies
    from or to pageable host memory, ``width > pitch``, pitches above :data:`MAX_PITCH`,
    overlapping 2D copies. Live allocations and streams are kept in :attr:`device`,
    :attr:`pinned` and :attr:`streams` so tests can assert that ``close()`` freed them.
    """

    class cudaMemcpyKind:
        cudaMemcpyHostToHost = 0
        cudaMemcpyHostToDevice = 1
        cudaMemcpyDeviceToHost = 2
        cudaMemcpyDeviceToDevice = 3

    _KIND = {0: "H2H", 1: "H2D", 2: "D2H", 3: "D2D"}

    def __init__(self, log: list, devices: int = 1):
        self.log = log
        self.devices = devices
        self.device: dict[int, int] = {}  # live cudaMalloc: address -> bytes
        self.pinned: dict[int, int] = {}  # live cudaMallocHost: address -> bytes
        self._raw: dict[int, np.ndarray] = {}
        self._freed: list[np.ndarray] = []  # freed memory stays mapped: a use after free cannot crash pytest
        self.streams: set[int] = set()
        self.queue: dict[int, list] = {}
        self._next_stream = 0x5000
        self.fail_malloc = False
        self.fail_malloc_after: int | None = None  # fail every cudaMalloc after this many successes
        self.n_malloc = 0

    # ---- bookkeeping ------------------------------------------------------------------
    def _alloc(self, n):
        raw = np.zeros(n + 256, np.uint8)
        ptr = raw.ctypes.data
        ptr += (-ptr) % 256
        self._raw[ptr] = raw
        return ptr

    def _release(self, ptr):
        self._freed.append(self._raw.pop(ptr))

    def outstanding(self) -> dict:
        """What is still allocated: ``{"device": n, "pinned": n, "streams": n}``."""
        return {"device": len(self.device), "pinned": len(self.pinned), "streams": len(self.streams)}

    def region(self, ptr: int, n: int) -> str | None:
        """``"device"`` or ``"pinned"`` when ``[ptr, ptr + n)`` lies inside one live allocation, else None."""
        for kind, table in (("device", self.device), ("pinned", self.pinned)):
            for base, size in table.items():
                if base <= ptr and ptr + n <= base + size:
                    return kind
        return None

    def _host_ok(self, ptr, n, pinned_only):
        kind = self.region(ptr, n)
        return kind == "pinned" if pinned_only else kind != "device"

    # ---- the API ----------------------------------------------------------------------
    def cudaGetDeviceCount(self):
        return (OK, self.devices)

    def cudaMalloc(self, n):
        self.log.append(("cudaMalloc", n))
        if self.fail_malloc or (self.fail_malloc_after is not None and self.n_malloc >= self.fail_malloc_after):
            return (Err(2), None)
        self.n_malloc += 1
        p = self._alloc(n)
        self.device[p] = n
        return (OK, p)

    def cudaMallocHost(self, n):
        self.log.append(("cudaMallocHost", n))
        p = self._alloc(n)
        self.pinned[p] = n
        return (OK, p)

    def cudaFree(self, p):
        self.log.append(("cudaFree", p))
        if p not in self.device:
            return (INVALID_VALUE,)
        del self.device[p]
        self._release(p)
        return (OK,)

    def cudaFreeHost(self, p):
        self.log.append(("cudaFreeHost", p))
        if p not in self.pinned:
            return (INVALID_VALUE,)
        del self.pinned[p]
        self._release(p)
        return (OK,)

    def cudaStreamCreate(self):
        self._next_stream += 1
        self.queue[self._next_stream] = []
        self.streams.add(self._next_stream)
        self.log.append(("cudaStreamCreate", self._next_stream))
        return (OK, self._next_stream)

    def cudaStreamDestroy(self, s):
        self.log.append(("cudaStreamDestroy", s))
        if s not in self.streams:
            return (INVALID_HANDLE,)
        self._drain(s)  # CUDA: pending work completes, then the stream's resources go
        self.streams.discard(s)
        del self.queue[s]
        return (OK,)

    def cudaMemcpyAsync(self, dst, src, n, kind, stream):
        name = self._KIND.get(int(kind), "?")
        self.log.append(("cudaMemcpyAsync", name, n))
        if stream not in self.streams:
            return (INVALID_HANDLE,)
        dev_dst, dev_src = name in ("H2D", "D2D"), name in ("D2H", "D2D")
        for ptr, dev in ((dst, dev_dst), (src, dev_src)):
            if n and (self.region(ptr, n) == "device") != dev:
                return (INVALID_VALUE,)
            if n and dev and self.region(ptr, n) is None:
                return (INVALID_VALUE,)
        self.queue[stream].append(lambda: ctypes.memmove(dst, src, n))
        return (OK,)

    def cudaMemcpy2DAsync(self, dst, dpitch, src, spitch, width, height, kind, stream):
        """Copy ``height`` rows of ``width`` bytes; rows ``dpitch`` / ``spitch`` bytes apart.

        As documented: width <= both pitches, pitches <= the device's maximum, host memory
        page-locked, the two areas must not overlap."""
        name = self._KIND.get(int(kind), "?")
        self.log.append(("cudaMemcpy2DAsync", name, width, height))
        if stream not in self.streams:
            return (INVALID_HANDLE,)
        if width > dpitch or width > spitch or dpitch > MAX_PITCH or spitch > MAX_PITCH:
            return (INVALID_PITCH,)
        if width == 0 or height == 0:
            return (OK,)
        span_d, span_s = (height - 1) * dpitch + width, (height - 1) * spitch + width
        for ptr, span, dev in ((dst, span_d, name in ("H2D", "D2D")), (src, span_s, name in ("D2H", "D2D"))):
            where = self.region(ptr, span)
            if where != ("device" if dev else "pinned"):  # 2D copies need page-locked host memory
                return (INVALID_VALUE,)
        if dst < src + span_s and src < dst + span_d:
            return (INVALID_VALUE,)

        def copy():
            for r in range(height):
                ctypes.memmove(dst + r * dpitch, src + r * spitch, width)

        self.queue[stream].append(copy)
        return (OK,)

    def cudaMemsetAsync(self, p, v, n, stream):
        self.log.append(("cudaMemsetAsync", n))
        if stream not in self.streams:
            return (INVALID_HANDLE,)
        if self.region(p, n) != "device":
            return (INVALID_VALUE,)
        self.queue[stream].append(lambda: ctypes.memset(p, v, n))
        return (OK,)

    def cudaStreamSynchronize(self, stream):
        self.log.append(("cudaStreamSynchronize",))
        if stream not in self.streams:
            return (INVALID_HANDLE,)
        self._drain(stream)
        return (OK,)

    def _drain(self, stream):
        q = self.queue[stream]
        while q:
            q.pop(0)()

    def enqueue(self, stream, fn):
        self.queue[stream].append(fn)


# ---------------------------------------------------------------------------- TensorRT


class _Enum:
    def __init__(self, name, value):
        self.name, self.value = name, value

    def __int__(self):
        return self.value

    def __repr__(self):
        return self.name


def _read(ptr, shape, dtype):
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if n == 0:
        return np.zeros(shape, dtype)
    return np.frombuffer((ctypes.c_uint8 * n).from_address(ptr), dtype=dtype).reshape(shape).copy()


class FakeProfile:
    """``IOptimizationProfile``: records ``set_shape(name, min, opt, max)``."""

    def __init__(self, log):
        self.log = log
        self.shapes = {}

    def set_shape(self, name, mn, opt, mx):
        self.log.append(("profile.set_shape", name, tuple(mn), tuple(opt), tuple(mx)))
        self.shapes[name] = [tuple(mn), tuple(opt), tuple(mx)]


class FakeConfig:
    """``IBuilderConfig``: records the memory pool limit and the profiles added (their indices)."""

    def __init__(self, log):
        self.log = log
        self.profiles = []

    def set_memory_pool_limit(self, pool, n):
        self.log.append(("config.set_memory_pool_limit", repr(pool), n))

    def add_optimization_profile(self, p):
        self.profiles.append(p)
        self.log.append(("config.add_optimization_profile", len(self.profiles) - 1))
        return len(self.profiles) - 1


class FakeNetwork:
    """``INetworkDefinition``: the creation flags and the parsed ONNX path."""

    def __init__(self, flags):
        self.flags = flags
        self.onnx = None


class FakeParser:
    """``OnnxParser``: checks that the file is ONNX (``onnx.load``), reports errors like the real one."""

    def __init__(self, network, logger, log):
        self.network, self.log = network, log
        self.num_errors = 0
        self.errors = []

    def parse_from_file(self, path):
        self.log.append(("parser.parse_from_file", str(path)))
        import onnx

        try:
            onnx.load(str(path), load_external_data=False)
        except Exception as e:  # noqa: BLE001 - the fake reports like the real parser
            self.errors = [str(e)]
            self.num_errors = 1
            return False
        self.network.onnx = str(path)
        return True

    def get_error(self, i):
        return self.errors[i]


class FakeBuilder:
    """``Builder``: records ``create_network(flags)`` and serializes a JSON plan (ONNX path + profiles)."""

    def __init__(self, logger, log, fail=False):
        self.log, self.fail = log, fail

    def create_network(self, flags):
        self.log.append(("builder.create_network", flags))
        return FakeNetwork(flags)

    def create_builder_config(self):
        return FakeConfig(self.log)

    def create_optimization_profile(self):
        return FakeProfile(self.log)

    def build_serialized_network(self, network, config):
        self.log.append(("builder.build_serialized_network", len(config.profiles)))
        if self.fail:
            return None
        return json.dumps({"onnx": network.onnx, "profiles": [p.shapes for p in config.profiles]}).encode()


class FakeContext:
    """An execution context. Refuses (returns False, as TensorRT's setters do) what the
    TensorRT API reference says it must not be given: a tensor address that is not
    256-byte aligned (``setTensorAddress``: "The pointer must have at least 256-byte
    alignment"), an input shape outside the selected profile, a profile that another live
    context of the same engine has selected (one execution context per optimization
    profile at a time). ``execute_async_v3`` refuses a call with a missing shape or
    address, too little or misaligned scratch memory, or a tensor (at the shapes set)
    that does not lie inside one live ``cudaMalloc`` allocation; and (a check of the
    backend's design, not a TensorRT rule) an output range that overlaps any other
    tensor's range."""

    def __init__(self, engine, log):
        self.engine, self.log = engine, log
        # a new context holds profile 0 if no other live context does, else none (-1)
        # until set_optimization_profile_async (IExecutionContext::getOptimizationProfile)
        self.profile = -1 if any(c.profile == 0 for c in engine.contexts) else 0
        self.shapes: dict[str, tuple] = {}
        self.addresses: dict[str, int] = {}
        self.device_memory = None

    def set_device_memory(self, ptr, size):
        self.log.append(("ctx.set_device_memory", id(self), ptr, size))
        self.device_memory = (ptr, size)

    def set_optimization_profile_async(self, i, stream):
        self.log.append(("ctx.set_optimization_profile_async", id(self), i, stream))
        if not 0 <= i < len(self.engine.profiles) or stream not in self.engine.cuda.streams:
            return False
        if any(c is not self and c.profile == i for c in self.engine.contexts):
            self.log.append(("refused", "profile in use by another context", i))
            return False
        self.profile = i
        self.shapes = {}
        return True

    def set_input_shape(self, name, shape):
        shape = tuple(shape)
        self.log.append(("ctx.set_input_shape", id(self), name, shape))
        if self.profile < 0 or name not in self.engine.inputs:
            return False
        mn, _, mx = self.engine.profiles[self.profile][name]
        if len(shape) != len(mn) or any(not a <= s <= b for a, s, b in zip(mn, shape, mx)):
            self.log.append(("refused", "shape outside the profile", name, shape))
            return False
        self.shapes[name] = shape
        return True

    def set_tensor_address(self, name, ptr):
        self.log.append(("ctx.set_tensor_address", id(self), name, ptr))
        if name not in self.engine.dtypes:
            return False
        if ptr % 256:
            self.log.append(("refused", "address not 256-byte aligned", name, ptr))
            return False
        self.addresses[name] = ptr
        return True

    def output_shape(self, name):
        """The shape TensorRT would give output ``name`` for the input shapes set."""
        q = self.shapes["input_ids"][1]
        if name == "logits":
            return (1, q, self.engine.vocab)
        past = self.shapes[name.replace("new_", "past_", 1)]
        return (1, q) + tuple(past[2:])

    def _problem(self):
        eng, cuda = self.engine, self.engine.cuda
        if self.profile < 0:
            return "no optimization profile selected"
        missing = [n for n in eng.inputs if n not in self.shapes] + [n for n in eng.dtypes if n not in self.addresses]
        if missing:
            return f"missing shapes/addresses {missing}"
        if self.device_memory is None:
            return "no device memory (USER_MANAGED context)"
        ptr, size = self.device_memory
        need = eng.get_device_memory_size_for_profile_v2(self.profile)
        if ptr % 256 or size < need or cuda.region(ptr, size) != "device":
            return f"scratch ({ptr:#x}, {size}) misaligned, smaller than {need} or not device memory"
        ranges = []
        for n in eng.names:
            shape = self.shapes[n] if n in eng.inputs else self.output_shape(n)
            nbytes = int(np.prod(shape)) * np.dtype(eng.dtypes[n]).itemsize
            if nbytes and cuda.region(self.addresses[n], nbytes) != "device":
                return f"tensor {n} {shape} at {self.addresses[n]:#x} is not inside one device allocation"
            ranges.append((n, self.addresses[n], nbytes))
        for n, a, k in ranges:
            if n in eng.outputs and k:
                for m, b, j in ranges:
                    if m != n and j and a < b + j and b < a + k:
                        return f"output {n} overlaps {m}"
        return None

    def execute_async_v3(self, stream):
        self.log.append(("ctx.execute_async_v3", id(self), self.profile, stream))
        eng = self.engine
        problem = self._problem() if stream in eng.cuda.streams else "unknown stream"
        if problem:
            self.log.append(("refused", problem))
            return False
        shapes, addresses = dict(self.shapes), dict(self.addresses)

        def execute():
            feeds = {n: _read(addresses[n], shapes[n], eng.dtypes[n]) for n in eng.inputs}
            outs = eng.session.run(eng.outputs, feeds)
            for n, v in zip(eng.outputs, outs):
                v = np.ascontiguousarray(v, dtype=eng.dtypes[n])
                ctypes.memmove(addresses[n], v.ctypes.data, v.nbytes)

        eng.cuda.enqueue(stream, execute)
        return True


class FakeEngine:
    """A deserialized engine: the ONNX run by onnxruntime CPU, the plan's profiles, and a
    scratch size per profile that differs from profile to profile (so a caller has to ask)."""

    def __init__(self, plan: dict, log, cuda):
        import onnxruntime as ort

        self.log, self.cuda = log, cuda
        self.session = ort.InferenceSession(plan["onnx"], providers=["CPUExecutionProvider"])
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.vocab = int(self.session.get_outputs()[self.outputs.index("logits")].shape[-1])
        self.dtypes = {n: (np.int64 if n in ("input_ids", "position_ids") else np.float32) for n in self.inputs + self.outputs}
        self.profiles = [{n: [tuple(s) for s in v] for n, v in p.items()} for p in plan["profiles"]]
        self.num_optimization_profiles = len(self.profiles)
        self.names = self.inputs + self.outputs
        self.num_io_tensors = len(self.names)
        self.contexts = weakref.WeakSet()  # live contexts (a dropped context releases its profile)

    def get_tensor_name(self, i):
        return self.names[i]

    def get_tensor_mode(self, name):
        return FakeTRT.TensorIOMode.INPUT if name in self.inputs else FakeTRT.TensorIOMode.OUTPUT

    def get_tensor_dtype(self, name):
        return self.dtypes[name]

    def get_tensor_profile_shape(self, name, i):
        return self.profiles[i][name]

    def get_device_memory_size_for_profile_v2(self, i):
        q_max = self.profiles[i]["input_ids"][2][1]
        return (1 << 20) * ((5 * i + 2) % 7) + 1024 * q_max + 768  # largest at neither end, not a multiple of 256

    @property
    def device_memory_size_v2(self):
        return max(self.get_device_memory_size_for_profile_v2(i) for i in range(len(self.profiles)))

    def create_execution_context(self, strategy):
        self.log.append(("engine.create_execution_context", repr(strategy)))
        c = FakeContext(self, self.log)
        self.contexts.add(c)
        return c


class FakeTRT(types.ModuleType):
    """A ``tensorrt`` stand-in module (pass as ``trt=`` or put in ``sys.modules``)."""

    class TensorIOMode:
        INPUT = _Enum("INPUT", 0)
        OUTPUT = _Enum("OUTPUT", 1)

    class NetworkDefinitionCreationFlag:
        EXPLICIT_BATCH = _Enum("EXPLICIT_BATCH", 0)
        STRONGLY_TYPED = _Enum("STRONGLY_TYPED", 1)

    class MemoryPoolType:
        WORKSPACE = _Enum("WORKSPACE", 0)

    class ExecutionContextAllocationStrategy:
        STATIC = _Enum("STATIC", 0)
        USER_MANAGED = _Enum("USER_MANAGED", 2)

    class Logger:
        WARNING = 2

        def __init__(self, level=2):
            self.level = level

    def __init__(self, log: list, cuda: FakeCuda, fail_build: bool = False, version: str = "10.99-fake"):
        super().__init__("tensorrt")
        self.__version__ = version
        self.log, self.cuda = log, cuda
        fake = self

        class Builder(FakeBuilder):
            def __init__(self, logger):
                super().__init__(logger, fake.log, fail_build)

        class OnnxParser(FakeParser):
            def __init__(self, network, logger):
                super().__init__(network, logger, fake.log)

        class Runtime:
            def __init__(self, logger):
                pass

            def deserialize_cuda_engine(self, blob):
                fake.log.append(("runtime.deserialize_cuda_engine", len(blob)))
                try:
                    plan = json.loads(bytes(blob))
                except ValueError:
                    return None
                return FakeEngine(plan, fake.log, fake.cuda)

        self.Builder, self.OnnxParser, self.Runtime = Builder, OnnxParser, Runtime

    @staticmethod
    def nptype(dt):
        return dt


def install(monkeypatch, log=None, devices=1, fail_build=False, version="10.99-fake"):
    """Put fake ``tensorrt`` (``__version__`` = ``version``) and ``cuda.bindings.runtime``
    into ``sys.modules``; returns (trt, cuda, log)."""
    import sys

    log = [] if log is None else log
    cuda = FakeCuda(log, devices)
    trt = FakeTRT(log, cuda, fail_build, version)
    from importlib.machinery import ModuleSpec

    cuda_pkg = types.ModuleType("cuda")
    bindings = types.ModuleType("cuda.bindings")
    cuda_pkg.bindings = bindings
    bindings.runtime = cuda
    for mod in (trt, cuda_pkg, bindings):  # importlib.util.find_spec needs a spec
        mod.__spec__ = ModuleSpec(mod.__name__, None)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "cuda", cuda_pkg)
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", cuda)
    return trt, cuda, log


def write_plan(path: Path, onnx_path: Path, pset, entry) -> Path:
    """A fake plan (JSON) for ``onnx_path`` with the profiles of ``pset``."""
    shapes = [p.shapes(entry.inputs, entry.n_kv_heads, entry.head_dim, pset.pad) for p in pset.profiles]
    Path(path).write_text(json.dumps({"onnx": str(onnx_path), "profiles": [{k: [list(s) for s in v] for k, v in d.items()} for d in shapes]}))
    return Path(path)
