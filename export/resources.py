"""Peak resident memory of the export process, per phase (Linux ``/proc``; elsewhere the
process-lifetime peak from ``getrusage``).

Linux keeps the peak RSS of a process (``VmHWM`` in ``/proc/self/status``); writing ``5``
to ``/proc/self/clear_refs`` resets it to the current RSS (proc(5), "clear_refs"), so each
phase of an export can report its own peak. Where that is not available, every phase
reports the process peak so far (``resource.getrusage(RUSAGE_SELF).ru_maxrss``).
"""

from __future__ import annotations

import resource
import sys
import threading
import time
from pathlib import Path

__all__ = ["rss_mib", "peak_rss_mib", "reset_peak", "run_measured", "PhaseMeter", "trim_heap"]

_STATUS = Path("/proc/self/status")
_CLEAR = Path("/proc/self/clear_refs")


def _status_kib(key: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_mib() -> float | None:
    """Current resident set size in MiB (Linux), else None."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib / 1024


def peak_rss_mib() -> float:
    """Peak resident set size in MiB since the last :func:`reset_peak` (Linux ``VmHWM``),
    else since the process started (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib / 1024
    ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return ru / (1024 * 1024) if sys.platform == "darwin" else ru / 1024


def run_measured(cmd: list[str], log=None, what: str = "child process", every: float = 30.0) -> tuple[int, str, float | None]:
    """Run ``cmd`` to its end; ``(exit code, stdout + stderr, its peak RSS in MiB)``.

    With ``log``, a line ``"<what>: running, N s elapsed"`` is written every ``every``
    seconds while the child runs (its own output is collected, not shown: a long child
    would otherwise leave the export's log silent for minutes).

    The peak is the child's own (``os.wait4``'s resource usage of that one process), not
    ``getrusage(RUSAGE_CHILDREN)``, which would also count any other child: a short helper
    forked from a large process reports the parent's RSS as its own. None where ``wait4`` is
    missing.
    """
    import os
    import subprocess

    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stop = threading.Event()
    if log is not None:
        from .progress import format_seconds

        t0 = time.monotonic()

        def beat() -> None:
            while not stop.wait(every):
                log(f"{what}: running, {format_seconds(time.monotonic() - t0)} elapsed")

        threading.Thread(target=beat, name="specrt-heartbeat", daemon=True).start()
    try:
        out = p.stdout.read()
    finally:
        stop.set()
    p.stdout.close()
    if not hasattr(os, "wait4"):
        return p.wait(), out, None
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    return p.returncode, out, ru.ru_maxrss / (1024 * 1024 if sys.platform == "darwin" else 1024)


def reset_peak() -> bool:
    """Reset the peak RSS to the current RSS; False where the kernel offers no reset."""
    try:
        _CLEAR.write_text("5")
        return True
    except OSError:
        return False


class _AnonSampler:
    """Peak of ``RssAnon`` (anonymous memory: heap, tensors; not file pages the kernel can
    drop) sampled every ``interval`` seconds on a daemon thread (Linux; else inactive)."""

    def __init__(self, interval: float = 0.05):
        self.peak_kib = 0
        self._stop = threading.Event()
        self.active = _status_kib("RssAnon") is not None
        if self.active:
            threading.Thread(target=self._run, args=(interval,), name="specrt-rss", daemon=True).start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.peak_kib = max(self.peak_kib, _status_kib("RssAnon") or 0)

    def take(self) -> float | None:
        """Peak since the last take, in MiB (also counting now), and restart; None if inactive."""
        if not self.active:
            return None
        peak = max(self.peak_kib, _status_kib("RssAnon") or 0)
        self.peak_kib = 0
        return peak / 1024

    def stop(self) -> None:
        self._stop.set()


class PhaseMeter:
    """Peak RSS and wall time per phase of an export, and overall.

    ``meter.phase("name")`` ends the current phase (recording its peak RSS in MiB, the
    sampled peak of its anonymous memory, and its seconds) and starts the next;
    :attr:`phases` holds ``{name: {"peak_rss_mib", "peak_anon_mib", "seconds"}}`` in order.

    Peak RSS (the kernel's ``VmHWM``) counts file pages mapped into the process too: a
    memory-mapped checkpoint being read, or an ONNX external-data file onnxruntime maps.
    Those are clean page-cache pages the kernel can drop under pressure; the anonymous
    peak (``RssAnon``, sampled every 50 ms, so a shorter spike can be missed) is the
    memory the export itself needs.

    A phase that runs a child process (the model builder, :func:`run_measured`) records the
    child's own peak (:meth:`child`) and ``total_peak_mib`` = the phase's own peak + the
    child's: an upper bound of what the machine held at once. :meth:`summary` gives the
    largest ``total_peak_mib`` over the phases.

    Args:
        log: called with one line per finished phase (e.g. the export log), or None.
    """

    def __init__(self, log=None):
        self.log = log
        # with per-phase peaks the overall peak is the max over the phases, nothing from before
        # the meter started (the process peak read here before the reset could exceed them all)
        before = peak_rss_mib()
        self.resettable = reset_peak()
        self.phases: dict[str, dict] = {}
        self.peak_mib = 0.0 if self.resettable else before
        self.peak_anon_mib = 0.0
        self._anon = _AnonSampler()
        self.total_peak_mib = self.peak_mib
        self._child: float | None = None
        self._name: str | None = None
        self._t0 = time.perf_counter()
        self._start = self._t0

    def phase(self, name: str | None) -> None:
        """End the current phase (if any) and start ``name`` (None: just end it).

        Between phases, unreachable objects are collected and freed heap pages given back
        (:func:`trim_heap`), so a phase does not carry the previous
        one's freed memory in its RSS (measured: the quality record's peak held ~2 GB of
        earlier phases' freed heap without it)."""
        import gc

        gc.collect()
        trim_heap()
        now = time.perf_counter()
        anon = self._anon.take()
        if self._name is not None:
            peak = peak_rss_mib()
            self.peak_mib = max(self.peak_mib, peak)
            rec = {"peak_rss_mib": round(peak, 1), "seconds": round(now - self._t0, 2)}
            if anon is not None:
                self.peak_anon_mib = max(self.peak_anon_mib, anon)
                rec["peak_anon_mib"] = round(anon, 1)
            total = peak
            children = self._child
            if children is not None:
                rec["child_peak_rss_mib"] = round(children, 1)
                total = peak + children
                self._child = None
            rec["total_peak_mib"] = round(total, 1)
            self.total_peak_mib = max(self.total_peak_mib, total)
            self.phases[self._name] = rec
            if self.log is not None:
                extra = f", anonymous {anon:,.0f} MiB" if anon is not None else ""
                if "child_peak_rss_mib" in rec:
                    extra += f", child process {children:,.0f} MiB"
                self.log(f"  [{self._name}: {now - self._t0:.1f} s, peak RSS {peak:,.0f} MiB{extra}]")
            if self.resettable:
                reset_peak()
        self._name, self._t0 = name, now

    def child(self, peak_mib: float | None) -> None:
        """Record the peak RSS (MiB) of a child process the current phase ran."""
        if peak_mib is not None:
            self._child = max(self._child or 0.0, peak_mib)

    def summary(self) -> dict:
        """``{"peak_rss_mib", "total_peak_mib", "peak_anon_mib", "seconds", "phases",
        "per_phase_peaks"}``: the largest peak RSS of this process, the largest phase total
        with its child process, and the sampled anonymous peak (MiB) over the phases, total seconds,
        the phases, and whether the peaks are per phase (Linux) or process-lifetime peaks.
        Stops the sampler."""
        self.phase(None)
        self._anon.stop()
        return {
            "peak_rss_mib": round(self.peak_mib, 1),
            "total_peak_mib": round(self.total_peak_mib, 1),
            "peak_anon_mib": round(self.peak_anon_mib, 1) if self._anon.active else None,
            "seconds": round(time.perf_counter() - self._start, 1),
            "phases": self.phases,
            "per_phase_peaks": self.resettable,
        }


def trim_heap() -> bool:
    """Give freed heap memory back to the operating system (glibc ``malloc_trim(0)``).

    Weight matrices under glibc's dynamic mmap threshold (up to 32 MiB) live in the malloc
    heap; freeing them leaves the pages mapped, so without a trim a freed model keeps
    counting in the process's RSS (measured: 1.9 GB after freeing a Qwen2.5-0.5B-shaped
    float32 model, whose matrices are 17 MB each). Returns False where glibc is absent.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False
