"""Recording stand-ins for ``tensorrt`` and ``cuda.bindings.runtime`` that run on CPU.

"Device" memory is host memory (so addresses are real and copies are ``ctypes.memmove``);
work queued on a stream runs at ``cudaStreamSynchronize`` (so a missing sync shows up as
stale data). The fake TensorRT builder serializes a JSON "plan" naming the ONNX file and
the profiles; the fake engine executes that ONNX with onnxruntime (CPU) on the tensors it
reads from the addresses and shapes the backend set, checks every shape against the
active profile as TensorRT would, and writes the outputs to the bound addresses. Every
call is appended to ``log`` for call-sequence assertions.
"""

from __future__ import annotations

import ctypes
import json
import types
from pathlib import Path

import numpy as np


class Err(int):
    """cudaError_t-like: an int with a name."""

    @property
    def name(self):
        return "cudaSuccess" if self == 0 else f"cudaError{int(self)}"


OK = Err(0)


class FakeCuda:
    """The subset of ``cuda.bindings.runtime`` the backends use, recording calls."""

    class cudaMemcpyKind:
        cudaMemcpyHostToDevice = 1
        cudaMemcpyDeviceToHost = 2

    def __init__(self, log: list, devices: int = 1):
        self.log = log
        self.devices = devices
        self.buffers: dict[int, np.ndarray] = {}
        self.host: set[int] = set()
        self.queue: dict[int, list] = {}
        self._next_stream = 0x5000
        self.fail_malloc = False

    def _alloc(self, n):
        raw = np.zeros(n + 256, np.uint8)
        ptr = raw.ctypes.data
        ptr += (-ptr) % 256
        self.buffers[ptr] = raw
        return ptr

    def cudaGetDeviceCount(self):
        return (OK, self.devices)

    def cudaMalloc(self, n):
        self.log.append(("cudaMalloc", n))
        if self.fail_malloc:
            return (Err(2), None)
        return (OK, self._alloc(n))

    def cudaMallocHost(self, n):
        self.log.append(("cudaMallocHost", n))
        p = self._alloc(n)
        self.host.add(p)
        return (OK, p)

    def cudaFree(self, p):
        self.log.append(("cudaFree", p))
        del self.buffers[p]
        return (OK,)

    def cudaFreeHost(self, p):
        self.log.append(("cudaFreeHost", p))
        del self.buffers[p]
        return (OK,)

    def cudaStreamCreate(self):
        self._next_stream += 1
        self.queue[self._next_stream] = []
        self.log.append(("cudaStreamCreate", self._next_stream))
        return (OK, self._next_stream)

    def cudaStreamDestroy(self, s):
        self.log.append(("cudaStreamDestroy", s))
        return (OK,)

    def cudaMemcpyAsync(self, dst, src, n, kind, stream):
        name = {1: "H2D", 2: "D2H"}[kind]
        self.log.append(("cudaMemcpyAsync", name, n))
        self.queue[stream].append(lambda: ctypes.memmove(dst, src, n))
        return (OK,)

    def cudaMemsetAsync(self, p, v, n, stream):
        self.log.append(("cudaMemsetAsync", n))
        self.queue[stream].append(lambda: ctypes.memset(p, v, n))
        return (OK,)

    def cudaStreamSynchronize(self, stream):
        self.log.append(("cudaStreamSynchronize",))
        q = self.queue[stream]
        while q:
            q.pop(0)()
        return (OK,)

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
    def __init__(self, log):
        self.log = log
        self.shapes = {}

    def set_shape(self, name, mn, opt, mx):
        self.log.append(("profile.set_shape", name, tuple(mn), tuple(opt), tuple(mx)))
        self.shapes[name] = [tuple(mn), tuple(opt), tuple(mx)]


class FakeConfig:
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
    def __init__(self, flags):
        self.flags = flags
        self.onnx = None


class FakeParser:
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
    def __init__(self, engine, log):
        self.engine, self.log = engine, log
        self.profile = 0
        self.shapes: dict[str, tuple] = {}
        self.addresses: dict[str, int] = {}
        self.device_memory = None

    def set_device_memory(self, ptr, size):
        self.log.append(("ctx.set_device_memory", id(self), ptr, size))
        self.device_memory = (ptr, size)

    def set_optimization_profile_async(self, i, stream):
        self.log.append(("ctx.set_optimization_profile_async", id(self), i, stream))
        if not 0 <= i < len(self.engine.profiles):
            return False
        self.profile = i
        self.shapes = {}
        return True

    def set_input_shape(self, name, shape):
        shape = tuple(shape)
        self.log.append(("ctx.set_input_shape", id(self), name, shape))
        mn, _, mx = self.engine.profiles[self.profile][name]
        if len(shape) != len(mn) or any(not a <= s <= b for a, s, b in zip(mn, shape, mx)):
            return False
        self.shapes[name] = shape
        return True

    def set_tensor_address(self, name, ptr):
        self.log.append(("ctx.set_tensor_address", id(self), name, ptr))
        if name not in self.engine.dtypes:
            return False
        self.addresses[name] = ptr
        return True

    def execute_async_v3(self, stream):
        self.log.append(("ctx.execute_async_v3", id(self), self.profile, stream))
        eng = self.engine
        missing = [n for n in eng.inputs if n not in self.shapes] + [n for n in eng.dtypes if n not in self.addresses]
        if missing or self.device_memory is None:
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
    def __init__(self, plan: dict, log, cuda):
        import onnxruntime as ort

        self.log, self.cuda = log, cuda
        self.session = ort.InferenceSession(plan["onnx"], providers=["CPUExecutionProvider"])
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.dtypes = {n: (np.int64 if n in ("input_ids", "position_ids") else np.float32) for n in self.inputs + self.outputs}
        self.profiles = [{n: [tuple(s) for s in v] for n, v in p.items()} for p in plan["profiles"]]
        self.num_optimization_profiles = len(self.profiles)
        self.names = self.inputs + self.outputs
        self.num_io_tensors = len(self.names)
        self.contexts = []

    def get_tensor_name(self, i):
        return self.names[i]

    def get_tensor_mode(self, name):
        return FakeTRT.TensorIOMode.INPUT if name in self.inputs else FakeTRT.TensorIOMode.OUTPUT

    def get_tensor_dtype(self, name):
        return self.dtypes[name]

    def get_tensor_profile_shape(self, name, i):
        return self.profiles[i][name]

    def get_device_memory_size_for_profile_v2(self, i):
        return 4096 * (i + 1)

    def create_execution_context(self, strategy):
        self.log.append(("engine.create_execution_context", repr(strategy)))
        c = FakeContext(self, self.log)
        self.contexts.append(c)
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

    def __init__(self, log: list, cuda: FakeCuda, fail_build: bool = False):
        super().__init__("tensorrt")
        self.__version__ = "10.99-fake"
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


def install(monkeypatch, log=None, devices=1, fail_build=False):
    """Put fake ``tensorrt`` and ``cuda.bindings.runtime`` into ``sys.modules``; returns (trt, cuda, log)."""
    import sys

    log = [] if log is None else log
    cuda = FakeCuda(log, devices)
    trt = FakeTRT(log, cuda, fail_build)
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
