"""The kind of machine a cost, a tuned default or a benchmark figure was measured on.

onnxruntime runs different kernels on different CPUs (e.g. MatMulNBits' 8-bit path has a
single-row VNNI kernel on AVX-512 VNNI parts and none on AVX2-only Zen 3), so a per-call
cost or a ``specrt tune`` choice measured on one kind of CPU says little about another.
Every record that holds such figures stores :func:`this_machine` (``Machine.to_json``),
and the engine re-measures recorded costs, and says so about tuned defaults, when it runs
on a different kind (:func:`tuned_elsewhere`).
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["ISA_FLAGS", "Machine", "parse_cpuinfo", "this_machine", "machine_record", "differs", "tuned_elsewhere"]

# The /proc/cpuinfo flags that select onnxruntime's (MLAS) and llama.cpp's kernels on x86-64
# (the 8-bit dot products: VNNI, AMX) and on aarch64 (dot product, i8mm, SVE).
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8", "asimddp", "i8mm", "sve")


@dataclass(frozen=True)
class Machine:
    """One kind of machine, as far as measured speed goes.

    Attributes:
        cpu: the CPU model name (``/proc/cpuinfo`` "model name"; else the platform's name).
        isa: the flags of :data:`ISA_FLAGS` this CPU has, in that order.
        cores: CPUs this process may run on (its affinity mask, not the host's count).
        onnxruntime: onnxruntime's version ("" when it is not installed).
    """

    cpu: str
    isa: tuple[str, ...]
    cores: int
    onnxruntime: str

    def describe(self) -> str:
        """One line, e.g. ``"AMD EPYC 9R14 (avx2 fma avx512f avx512bw avx512_vnni), 2 cores, onnxruntime 1.23.2"``."""
        return f"{self.cpu} ({' '.join(self.isa) or 'no listed ISA extensions'}), {self.cores} cores, onnxruntime {self.onnxruntime or 'absent'}"

    def to_json(self) -> dict:
        """JSON-ready dict (``isa`` as a list)."""
        d = asdict(self)
        d["isa"] = list(self.isa)
        return d

    @staticmethod
    def from_json(d: object) -> "Machine | None":
        """Inverse of :meth:`to_json`; None for anything that is not such a record (an
        older record without a machine, or a malformed one)."""
        if not isinstance(d, dict):
            return None
        try:
            return Machine(str(d["cpu"]), tuple(str(f) for f in d["isa"]), int(d["cores"]), str(d["onnxruntime"]))
        except (KeyError, TypeError, ValueError):
            return None


def parse_cpuinfo(text: str) -> tuple[str, tuple[str, ...]]:
    """``(model name, flags of ISA_FLAGS present)`` from the text of ``/proc/cpuinfo``
    (x86-64 "model name"/"flags"; aarch64 "Features", whose model is left "")."""
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    return model, tuple(f for f in ISA_FLAGS if f in flags)


@functools.lru_cache(maxsize=1)
def this_machine() -> Machine:
    """The :class:`Machine` this process runs on (read once per process)."""
    try:
        model, isa = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        model, isa = "", ()
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        import onnxruntime

        ort = onnxruntime.__version__
    except ImportError:
        ort = ""
    return Machine(model or platform.processor() or platform.machine(), isa, cores, ort)


def machine_record() -> dict:
    """What a benchmark or measurement record stores about where it ran: this
    :class:`Machine` (``to_json``), the platform string and the 1/5/15-minute load
    averages at the call (the start of a run; the caller adds the end's)."""
    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    return dict(this_machine().to_json(), platform=platform.platform(), loadavg_start=load)


def differs(recorded: object, here: Machine | None = None) -> str | None:
    """Why figures recorded on ``recorded`` (a :meth:`Machine.to_json` dict, or None for
    a record that names no machine) do not carry to ``here`` (default: this machine), or
    None when it is the same kind (CPU model, ISA flags, cores and onnxruntime all equal)."""
    here = here or this_machine()
    then = Machine.from_json(recorded)
    if then is None:
        return f"the record does not name its machine; this is {here.describe()}"
    what = [name for name in ("cpu", "isa", "cores", "onnxruntime") if getattr(then, name) != getattr(here, name)]
    if not what:
        return None
    return f"recorded on {then.describe()}; this is {here.describe()} ({', '.join(what)} differ)"


def tuned_elsewhere(manifest, folder: object = None) -> str | None:
    """One line when ``manifest``'s decoding defaults came from a tune (``specrt tune``, or
    ``specrt export --defaults FILE``) on another kind of machine, or on one it did not
    record; None when they were tuned here or never tuned (the export's own defaults).

    The line ends with the hint to re-tune here (``specrt tune --engines FOLDER``)."""
    extra = manifest.extra or {}
    if "tune" in extra:
        where = (extra["tune"] or {}).get("machine")
    elif "defaults_from" in extra:
        where = (extra["defaults_from"] or {}).get("machine")
    else:
        return None
    why = differs(where)
    if why is None:
        return None
    return (
        f"decoding defaults {dict(manifest.defaults)} were not tuned on this kind of machine ({why}); "
        f"`specrt tune --engines {folder or manifest.name} --prompts FILE` chooses them here"
    )
