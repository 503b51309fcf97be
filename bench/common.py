"""What the benches and the one-off measurement scripts share: the machine line, the
command line and the JSON record (printed, and written to ``--out``)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from specrt.runtime.machine import this_machine

GGUF_CACHE = Path.home() / ".cache" / "specrt" / "gguf"  # where `specrt fetch` keeps the real pair's GGUF files


def say_machine() -> None:
    """Print ``machine: <CPU, ISA, cores, onnxruntime>`` on stderr
    (:meth:`specrt.runtime.machine.Machine.describe`): every figure of a run holds on this kind of CPU."""
    print(f"machine: {this_machine().describe()}", file=sys.stderr, flush=True)


def command() -> str:
    """The command line of this process as records store it: the interpreter's file name,
    then ``-m MODULE`` when it runs a module (``python -m specrt.bench.real``) or the
    script's path, then the arguments."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    first = [f"-m {spec.name}"] if spec is not None and spec.name else sys.argv[:1]
    return " ".join([Path(sys.executable).name, *first, *sys.argv[1:]])


def source_commit() -> str | None:
    """specrt's git commit as records store it (``HEAD``'s hash, ``+dirty`` when tracked files
    differ from it), or None outside a git checkout."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def logger(tag: str = "") -> Callable[[str], None]:
    """A ``log(msg)`` printing ``[TAG HH:MM:SS] msg`` on stderr, flushed (progress lines of a long run)."""
    prefix = f"{tag} " if tag else ""

    def log(msg: str) -> None:
        print(f"[{prefix}{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    return log


def write_json(path: str | Path, obj: Any, default: Callable | None = None) -> Path:
    """Write ``obj`` as JSON (indent 1, no trailing newline) to ``path``, creating its parent
    folders; returns the path. ``default``: :func:`json.dumps`'s, for values JSON lacks
    (numpy floats: ``float``). Raises ``TypeError`` for a value JSON cannot hold and
    ``OSError`` when the file cannot be written."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj, indent=1, default=default))
    return p


def emit(result: Any, out: str | Path | None = None, *, hide: tuple[str, ...] = (), default: Callable | None = None) -> Any:
    """Print the JSON result (indent 1) on stdout and, when ``out`` is given, write it there
    (:func:`write_json`); returns ``result``.

    ``hide``: top-level keys of a dict result left out of the printed copy only (long
    per-sample lists); the file always holds the whole record. ``default``: as in
    :func:`write_json`. Raises ``TypeError`` for a value JSON cannot hold, ``OSError`` when
    ``out`` cannot be written.
    """
    shown = {k: v for k, v in result.items() if k not in hide} if hide and isinstance(result, dict) else result
    print(json.dumps(shown, indent=1, default=default), flush=True)
    if out:
        write_json(out, result, default)
    return result
