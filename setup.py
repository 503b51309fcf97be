"""Build of specrt's C kernels (runtime/kernels/sk.c) at install; everything else is in pyproject.toml.

The library is a plain shared object loaded with ctypes (specrt.runtime.kernels), built by
the machine's C compiler from the package's own sources: nothing is downloaded. It is
optional: where no compiler works, the install goes on without it and the runtime runs the
onnxruntime graph with a one-line note (``specrt.runtime.kernels.status``). The library carries
the SHA-256 of the sources it was built from (``sk_sources()``), so that a checkout whose
sources changed since says so instead of running a stale build.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

KDIR = Path("runtime") / "kernels"
SOURCES = ("sk.c", "sk.h", "sk_isa.h", "sk_vec.h")  # the order of specrt.runtime.kernels.SOURCES


def source_hash() -> str:
    h = hashlib.sha256()
    for name in SOURCES:
        h.update((KDIR / name).read_bytes())
    return h.hexdigest()[:16]


class BuildKernels(build_ext):
    """build_ext that compiles the sources' stamp into the library (``sk_sources()``) and
    says in one line when the kernels could not be built (the Extension is optional)."""

    def build_extension(self, ext):
        ext.define_macros = [("SK_SOURCES", f'"{source_hash()}"')]
        try:
            super().build_extension(ext)
        except Exception as e:  # optional: the runtime falls back to onnxruntime
            print(f"specrt: the C kernels were not built ({e}); the runtime will run the onnxruntime graph")


KERNELS = Extension(
    "specrt.runtime.kernels._sk",
    sources=[str(KDIR / "sk.c")],
    depends=[str(KDIR / n) for n in SOURCES[1:]],
    # -ffp-contract=off: no multiply-add contracted into an FMA the source did not write, so every
    # ISA path rounds the same; no -march: the ISA paths are chosen at run time (sk_cpu_isa)
    extra_compile_args=["-O3", "-std=gnu11", "-ffp-contract=off", "-fno-fast-math", "-fvisibility=hidden", "-pthread"],
    extra_link_args=["-pthread", "-lm"],
    optional=True,
)

setup(ext_modules=[KERNELS], cmdclass={"build_ext": BuildKernels})
