"""JSON-lines protocol shared by the benchmark workers (stdlib only: every venv imports it).

A worker is started by the benches (``specrt.bench.compare``, ``specrt.bench.real``) with the python of the venv it needs.
It reads one JSON object per line on stdin and answers one per line on stdout:

    -> {"init": {...}}                            first line: settings of this worker
    <- {"ready": true, "info": {...}}             after loading and warming up
       {"ready": false, "error": "..."}           (then it exits)
    -> {"op": "run", "ids": [...], "max_new_tokens": N}
    <- {"ok": true, "tokens": [...], "seconds": s, "ttft": s, "extra": {...}}
    -> {"op": "rss"}  <- {"ok": true, "peak_rss_mb": x}
    -> {"op": NAME, ...}  worker-specific operations (sweep, costs, profile)
    -> {"op": "exit"}

Any error inside an operation is answered as {"ok": false, "error": "Type: message"} and the
worker goes on. Libraries that print to stdout cannot corrupt the protocol: ``serve`` points
fd 1 at stderr first, and the answers go to a private duplicate of the original stdout.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import traceback
from typing import Callable

_OUT = None


def claim_stdout() -> None:
    """Keep the real stdout for the protocol; point fd 1 (and sys.stdout) at stderr."""
    global _OUT
    if _OUT is None:
        _OUT = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr


def send(obj: dict) -> None:
    """Write ``obj`` as one JSON line on the protocol's stdout (claimed first)."""
    claim_stdout()
    _OUT.write(json.dumps(obj) + "\n")
    _OUT.flush()


def peak_rss_mb() -> float:
    """Peak resident set size of this worker's own memory since it started its program,
    MiB (stdlib only: a copy of :func:`specrt.runtime.lab.bench.peak_rss_mb`, which this
    worker's venv may lack): Linux ``VmHWM`` (``/proc/self/status``). Not ``ru_maxrss``: across fork + exec it
    keeps the parent's peak (the kernel carries the old memory's high-water mark into the
    exec'd process), so a worker started by a large parent reported the parent's size.
    ``ru_maxrss`` (KiB) only where /proc is absent."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def error_text(e: BaseException) -> str:
    """``"Type: message"`` of ``e``, cut at 2,000 characters."""
    msg = f"{type(e).__name__}: {e}"
    return msg if len(msg) < 2000 else msg[:2000] + " ..."


def serve(setup: Callable[[dict], tuple[Callable, dict, dict]]) -> int:
    """Run the protocol loop.

    Args:
        setup: ``init -> (run, info, ops)``; ``run(ids, max_new_tokens)`` returns
            ``(tokens, seconds, ttft, extra)``; ``ops`` maps op names to ``fn(msg) -> dict``.
    """
    claim_stdout()
    line = sys.stdin.readline()
    if not line:
        return 1
    init = json.loads(line)["init"]
    try:
        run, info, ops = setup(init)
    except BaseException as e:  # report, never hide
        traceback.print_exc()
        send({"ready": False, "error": error_text(e)})
        return 1
    info = dict(info)
    info["peak_rss_mb_after_load"] = peak_rss_mb()
    send({"ready": True, "info": info})
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        op = msg.get("op")
        if op == "exit":
            break
        try:
            if op == "run":
                tokens, seconds, ttft, extra = run(msg["ids"], int(msg["max_new_tokens"]))
                send({"ok": True, "tokens": [int(t) for t in tokens], "seconds": seconds, "ttft": ttft, "extra": extra})
            elif op == "rss" and "rss" not in ops:  # a worker whose model lives in a child process reports that one
                send({"ok": True, "peak_rss_mb": peak_rss_mb()})
            elif op in ops:
                out = ops[op](msg)
                send(dict(ok=True, **out))
            else:
                send({"ok": False, "error": f"unknown op {op!r}"})
        except BaseException as e:
            traceback.print_exc()
            send({"ok": False, "error": error_text(e)})
    return 0


def set_thread_env(threads: int) -> None:
    """OpenMP/MKL thread counts for libraries that read them at import (call before importing torch)."""
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[k] = str(threads)


class FirstTokenClock:
    """A Hugging Face streamer that records when the first generated token arrives.

    ``generate`` calls ``put`` once with the prompt, then with each new token (or with the
    accepted block in assisted generation); the second call is the first output.
    """

    def __init__(self, clock):
        self.clock = clock
        self.calls = 0
        self.first = None

    def put(self, value):
        """A streamer's call: the second one (the first holds the prompt) stamps the first token's time."""
        self.calls += 1
        if self.calls == 2 and self.first is None:
            self.first = self.clock()

    def end(self):
        """A streamer's end of generation: nothing to do."""
        pass
