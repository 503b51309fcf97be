"""Thin layer over ``cuda.bindings.runtime`` (NVIDIA cuda-python): device and pinned host
memory, one stream, async copies. Never torch.

Every call checks the returned ``cudaError_t`` and raises :class:`~specrt.runtime.errors.EngineError`
naming the call. The module object is injectable (``CudaRuntime(rt=fake)``) so that the
GPU backends' call sequences are tested on CPU machines with a recording stand-in.

cuda-python's convention (checked against cuda-bindings 13.x): each function returns a
tuple ``(err, *results)``, e.g. ``err, ptr = cudaMalloc(n)``; pointers are ints; a
``cudaStream_t`` converts to its handle with ``int(stream)``.
"""

from __future__ import annotations

import ctypes
import importlib

import numpy as np

from ..errors import BackendError, EngineError

__all__ = ["load_cuda_runtime", "gpu_count", "CudaRuntime", "host_array"]


def load_cuda_runtime():
    """Import cuda-python's runtime module (``cuda.bindings.runtime``, or ``cuda.cudart``
    in cuda-python < 12.6).

    Raises:
        BackendError: cuda-python is not installed.
    """
    for name in ("cuda.bindings.runtime", "cuda.cudart"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise BackendError("the GPU backends need NVIDIA's cuda-python (pip install 'cuda-bindings>=12.6'); it is not installed")


def gpu_count(rt=None) -> int:
    """Number of CUDA devices visible (0 when cuda-python, the driver or a GPU is missing)."""
    try:
        rt = rt or load_cuda_runtime()
        err, n = rt.cudaGetDeviceCount()
    except Exception:  # no driver library, no device: all mean "no GPU here"
        return 0
    return int(n) if int(err) == 0 and n else 0


class CudaRuntime:
    """The handful of CUDA runtime calls the GPU backends use.

    Args:
        rt: the ``cuda.bindings.runtime`` module or a stand-in with the same functions;
            ``None`` imports the real one.

    Raises:
        BackendError: cuda-python missing (when ``rt`` is None).
    """

    def __init__(self, rt=None):
        self.rt = rt if rt is not None else load_cuda_runtime()
        self._h2d = self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        self._d2h = self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        self._d2d = self.rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice

    def _check(self, res, what: str):
        err = res[0] if isinstance(res, tuple) else res
        if int(err) != 0:
            name = getattr(err, "name", str(err))
            raise EngineError(f"CUDA call {what} failed: {name}")
        if isinstance(res, tuple):
            return res[1] if len(res) == 2 else res[1:]
        return None

    def malloc(self, nbytes: int) -> int:
        """Device allocation of ``nbytes`` (>= 1) bytes; returns its address (256-byte aligned by CUDA)."""
        return int(self._check(self.rt.cudaMalloc(max(1, int(nbytes))), f"cudaMalloc({nbytes})"))

    def free(self, ptr: int) -> None:
        """Release a :meth:`malloc` allocation."""
        self._check(self.rt.cudaFree(ptr), "cudaFree")

    def malloc_host(self, nbytes: int) -> int:
        """Pinned (page-locked) host allocation; returns its address."""
        return int(self._check(self.rt.cudaMallocHost(max(1, int(nbytes))), f"cudaMallocHost({nbytes})"))

    def free_host(self, ptr: int) -> None:
        """Release a :meth:`malloc_host` allocation."""
        self._check(self.rt.cudaFreeHost(ptr), "cudaFreeHost")

    def stream_create(self) -> int:
        """A new non-default stream; returns its handle (int)."""
        return int(self._check(self.rt.cudaStreamCreate(), "cudaStreamCreate"))

    def stream_destroy(self, stream: int) -> None:
        """Destroy a stream made by :meth:`stream_create`."""
        self._check(self.rt.cudaStreamDestroy(stream), "cudaStreamDestroy")

    def htod_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Queue a host-to-device copy of ``nbytes`` on ``stream``."""
        self._check(self.rt.cudaMemcpyAsync(dst, src, nbytes, self._h2d, stream), "cudaMemcpyAsync(host->device)")

    def dtoh_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Queue a device-to-host copy of ``nbytes`` on ``stream``."""
        self._check(self.rt.cudaMemcpyAsync(dst, src, nbytes, self._d2h, stream), "cudaMemcpyAsync(device->host)")

    def htod_2d_async(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: int) -> None:
        """Queue a strided host-to-device copy (``cudaMemcpy2DAsync``): ``height`` rows of
        ``width`` bytes, source rows ``spitch`` bytes apart in page-locked host memory,
        destination rows ``dpitch`` bytes apart. ``width`` <= both pitches."""
        self._check(self.rt.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, self._h2d, stream), "cudaMemcpy2DAsync(host->device)")

    def dtod_2d_async(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: int) -> None:
        """Queue a strided device-to-device copy (``cudaMemcpy2DAsync``), as :meth:`htod_2d_async`;
        the two areas must not overlap."""
        self._check(self.rt.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, self._d2d, stream), "cudaMemcpy2DAsync(device->device)")

    def memset_async(self, ptr: int, value: int, nbytes: int, stream: int) -> None:
        """Queue a byte fill of device memory on ``stream``."""
        self._check(self.rt.cudaMemsetAsync(ptr, value, nbytes, stream), "cudaMemsetAsync")

    def synchronize(self, stream: int) -> None:
        """Wait until everything queued on ``stream`` has finished."""
        self._check(self.rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")


def host_array(ptr: int, shape: tuple[int, ...], dtype) -> np.ndarray:
    """A numpy view (no copy) of ``prod(shape)`` elements of ``dtype`` at host address ``ptr``.

    Used for pinned staging buffers; the caller keeps the allocation alive.
    """
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    buf = (ctypes.c_uint8 * n).from_address(ptr)
    return np.frombuffer(buf, dtype=dtype).reshape(shape)
