"""Build of specrt's C kernels (runtime/kernels/c/) at install; everything else is in pyproject.toml.

The library is a plain shared object loaded with ctypes (specrt.runtime.kernels), built by
the machine's C compiler from the package's own sources: nothing is downloaded. It is
optional: where no compiler works, the install goes on without it and the runtime runs the
onnxruntime graph with a one-line note (``specrt.runtime.kernels.status``). The library carries
the SHA-256 of the sources it was built from (``sk_sources()``), so that a checkout whose
sources changed since says so instead of running a stale build.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

KDIR = Path("runtime") / "kernels" / "c"
# the library's translation units (the rest of KDIR: headers and kernel bodies they include)
UNITS = ("api.c", "team.c", "types.c", "isa_portable.c", "isa_avx2.c", "isa_avx512.c")
# warnings the sources are kept clean of (make lint-c builds with -Werror on top)
WARNINGS = ["-Wall", "-Wextra", "-Wshadow"]


def sources() -> list[Path]:
    """Every C source and header of the kernels, in name order (what the stamp covers)."""
    return sorted(p for p in KDIR.iterdir() if p.suffix in (".c", ".h"))


def source_hash() -> str:
    """SHA-256 (16 hex digits) of the kernels' sources: specrt.runtime.kernels.source_hash."""
    h = hashlib.sha256()
    for p in sources():
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


class BuildKernels(build_ext):
    """build_ext that compiles the sources' stamp into the library (``sk_sources()``) and
    says in one line when the kernels could not be built (the Extension is optional)."""

    def copy_file(self, infile, outfile, *args, **kwargs):
        """``--inplace``: the library moved over the old one (a temporary file and
        ``os.replace``), not written into it: a process that loaded the old library keeps it
        (rewriting a mapped library in place crashes that process)."""
        out = Path(outfile)
        if not out.suffix == ".so" or not out.exists():
            return super().copy_file(infile, outfile, *args, **kwargs)
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        shutil.copyfile(infile, tmp)
        shutil.copymode(infile, tmp)
        os.replace(tmp, out)
        return str(out), True

    def build_extension(self, ext):
        ext.define_macros = [("SK_SOURCES", f'"{source_hash()}"')]
        try:
            super().build_extension(ext)
        except Exception as e:  # optional: the runtime falls back to onnxruntime
            print(f"specrt: the C kernels were not built ({e}); the runtime will run the onnxruntime graph")


KERNELS = Extension(
    "specrt.runtime.kernels._sk",
    sources=[str(KDIR / n) for n in UNITS],
    depends=[str(p) for p in sources()],
    # -ffp-contract=off: no multiply-add contracted into an FMA the source did not write, so every
    # ISA path rounds the same; no -march: the ISA paths are chosen at run time (sk_cpu_isa)
    extra_compile_args=["-O3", "-std=gnu11", "-ffp-contract=off", "-fno-fast-math", "-fvisibility=hidden", "-pthread", *WARNINGS],
    extra_link_args=["-pthread", "-lm"],
    optional=True,
)

setup(ext_modules=[KERNELS], cmdclass={"build_ext": BuildKernels})
