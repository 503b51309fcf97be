"""Integrity of an engine folder's files: SHA-256 and size, checked before the files are used.

The manifest's ``files`` map records every file an engine needs (graphs, the ONNX
external-data files the graphs' initializers point to, the tokenizer), each with its
SHA-256 and byte size (:class:`~specrt.runtime.manifest.FileRecord`). At load:

1. every listed file must exist with its recorded size (one ``stat`` each: catches missing,
   truncated and appended files before anything reads them);
2. every file the load opens must have the recorded SHA-256 (:class:`Verification`), or a
   load returns nothing: a mismatch is refused with one line naming the file.

Digests are verified once per file identity (:class:`DigestCache`). A file's identity is
``(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)``, the same stat data git's index
uses to skip re-hashing unchanged files. Any write, truncation, rename over the file or
metadata change gives the file a new ``st_ctime``, which user space cannot set (``utime``
sets atime and mtime only; ctime is stamped by the kernel with the current time), so a
file that changed since its digest was computed never has the identity the digest was
recorded under. A recorded digest counts only when it equals the manifest's; anything else
(no record, another digest, a record from a damaged cache file) hashes the file again.
Digests are recorded only for files whose identity was the same before and after their
bytes were read and whose ctime was at least :data:`RACY_NS` older than the start of the
read (git's "racily clean" rule: a write in the same clock tick as the recorded ctime would
otherwise keep the identity).

The cache lives in the process and, so that the next process skips the work too, in a small
JSON file: ``$SPECRT_DIGEST_CACHE`` if set, else ``$XDG_CACHE_HOME/specrt/digests.json``,
else ``~/.cache/specrt/digests.json``. ``SPECRT_DIGEST_CACHE=off`` disables both (every
load hashes every byte it uses). The file is trusted as the user's own files are: it is
ignored unless owned by the current user and not writable by group or others; an
unreadable or malformed file is ignored and rewritten. What the cache does not defend
against: someone able to write that file (the user), or to set the clock back and write the
engine file (root); use ``SPECRT_DIGEST_CACHE=off`` where that matters.

Reads and digests release the GIL (``readinto`` into one reused buffer, ``hashlib`` on
blocks of 8 MiB), so several files hash at once on worker threads.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Mapping

from .errors import EngineError

__all__ = [
    "sha256_file",
    "file_sha256",
    "check_present",
    "Verification",
    "DigestCache",
    "digest_cache",
    "file_identity",
    "MISMATCH",
    "CACHE_ENV",
    "RACY_NS",
]

MISMATCH = "does not match the SHA-256 recorded in the manifest (truncated or altered)"
CACHE_ENV = "SPECRT_DIGEST_CACHE"  # path of the persistent digest cache, or "off"
RACY_NS = 2_000_000_000  # a digest is recorded only for files whose ctime is this much older than the read
CACHE_MAX_ENTRIES = 4096  # the persistent file keeps at most this many (newest) records
_BLOCK = 8 << 20  # bytes per read: long GIL-free digest calls, small resident buffer
_HEX64 = re.compile(r"[0-9a-f]{64}")
_KEY = re.compile(r"\d+:\d+:\d+:-?\d+:-?\d+")


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes.

    Reads with ``readinto`` into one reused 8 MiB buffer (both the read and the digest
    release the GIL, so other threads run meanwhile; no ``mmap``, so the file's pages are
    not added to this process's resident set while it is hashed).

    Raises:
        OSError: the file cannot be opened or read.
    """
    return _hash_file(path)[0]


def file_identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """``(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)``: changes whenever the file's
    contents (or metadata) change, since the kernel stamps ctime on every change."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _hash_file(path: str | Path) -> tuple[str, tuple | None, tuple | None]:
    """(hex SHA-256, identity to record it under or None when it must not be recorded (the
    file changed while it was read, or its ctime is too recent, see :data:`RACY_NS`), identity
    the digest is of or None when the file changed while it was read)."""
    h = hashlib.sha256()
    buf = bytearray(_BLOCK)
    view = memoryview(buf)
    start = time.time_ns()
    with open(path, "rb", buffering=0) as f:
        before = file_identity(os.fstat(f.fileno()))
        while n := f.readinto(buf):
            h.update(view[:n])
        after = file_identity(os.fstat(f.fileno()))
    stable = before == after and before[4] < start - RACY_NS
    return h.hexdigest(), (before if stable else None), (before if before == after else None)


def _key(ident: tuple) -> str:
    return ":".join(str(x) for x in ident)


class DigestCache:
    """SHA-256 digests by file identity (:func:`file_identity`): in memory, and in a JSON
    file when ``path`` is given (read once, on first use; written on :meth:`save`).

    File format: ``{"format": 1, "entries": {"dev:ino:size:mtime_ns:ctime_ns":
    {"sha256": hex, "path": str}}}``. Entries that do not parse are skipped; a file that
    cannot be read, is not JSON, is not owned by this user or is writable by others is
    ignored (and replaced on the next save when it is ours).
    """

    def __init__(self, path: Path | None):
        self.path = path
        self._entries: dict[str, dict] = {}
        self._dirty = False
        self._loaded = path is None
        self._lock = threading.Lock()

    def _load(self) -> None:
        self._loaded = True
        try:
            st = os.stat(self.path)
            if st.st_uid != os.geteuid() or st.st_mode & 0o022:
                return
            raw = json.loads(Path(self.path).read_text())
            entries = raw["entries"] if isinstance(raw, dict) and raw.get("format") == 1 else {}
        except (OSError, ValueError, KeyError, TypeError):
            return
        if not isinstance(entries, dict):
            return
        for k, v in entries.items():
            if isinstance(k, str) and _KEY.fullmatch(k) and isinstance(v, dict) and isinstance(v.get("sha256"), str) and _HEX64.fullmatch(v["sha256"]):
                self._entries.setdefault(k, dict(sha256=v["sha256"], path=str(v.get("path", ""))))

    def matches(self, ident: tuple, digest: str) -> bool:
        """Whether ``digest`` is recorded for the identity ``ident``."""
        return self.digest(ident) == digest

    def digest(self, ident: tuple) -> str | None:
        """The digest recorded for the identity ``ident``, or None."""
        with self._lock:
            if not self._loaded:
                self._load()
            rec = self._entries.get(_key(ident))
        return None if rec is None else rec["sha256"]

    def record(self, ident: tuple, digest: str, path: str | Path) -> None:
        """Record that the file of identity ``ident`` (at ``path``) has ``digest``."""
        with self._lock:
            if not self._loaded:
                self._load()
            k = _key(ident)
            self._entries.pop(k, None)  # re-inserted last: the newest are kept by save
            self._entries[k] = dict(sha256=digest, path=str(Path(path).resolve()))
            self._dirty = True

    def save(self) -> None:
        """Write new records to the JSON file (merged with what another process wrote since,
        records whose path no longer has their identity dropped, the newest
        :data:`CACHE_MAX_ENTRIES` kept; written to a temporary file, then renamed). Never
        raises: a cache that cannot be written only costs a later hash."""
        with self._lock:
            if self.path is None or not self._dirty:
                return
            mine, self._entries = self._entries, {}
            self._load()  # what is on disk now (another process may have saved)
            for k, v in mine.items():
                self._entries.pop(k, None)
                self._entries[k] = v
            live = {}
            for k, v in self._entries.items():
                try:
                    if _key(file_identity(os.stat(v["path"]))) == k:
                        live[k] = v
                except OSError:
                    pass
            self._entries = dict(list(live.items())[-CACHE_MAX_ENTRIES:])
            self._dirty = False
            path = Path(self.path)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            try:
                path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                if path.exists():
                    st = os.stat(path)
                    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
                        return  # not ours to replace
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    json.dump(dict(format=1, entries=self._entries), f)
                os.replace(tmp, path)
            except OSError:
                try:
                    tmp.unlink()
                except OSError:
                    pass


_CACHES: dict[str, DigestCache] = {}
_CACHES_LOCK = threading.Lock()


def cache_path() -> Path | None:
    """Where the persistent digest cache is (None: ``SPECRT_DIGEST_CACHE=off``)."""
    env = os.environ.get(CACHE_ENV, "").strip()
    if env.lower() == "off":
        return None
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specrt" / "digests.json"


def digest_cache() -> DigestCache | None:
    """The process's digest cache for the current :data:`CACHE_ENV` setting (None: off)."""
    p = cache_path()
    if p is None:
        return None
    with _CACHES_LOCK:
        return _CACHES.setdefault(str(p), DigestCache(p))


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file, from the digest cache (:func:`digest_cache`) when its identity
    (:func:`file_identity`) has one recorded, else hashed and recorded (a warm start of
    ``specrt serve --target X.gguf`` reads none of the GGUF's bytes)."""
    cache = digest_cache()
    ident = file_identity(os.stat(path))
    if cache is not None:
        known = cache.digest(ident)
        if known is not None:
            return known
    digest, stable, _ = _hash_file(path)
    if cache is not None and stable is not None:
        cache.record(stable, digest, path)
        cache.save()
    return digest


def check_present(folder: Path, files: Mapping[str, object], hint: str) -> None:
    """Every file of ``files`` (name -> record with ``bytes``) exists in ``folder`` with
    its recorded size.

    Raises:
        EngineError: (param ``files``) the first file that is missing, is not a regular
            file, or whose size differs from the record (the message names the file and
            both sizes).
    """
    for name, rec in files.items():
        p = folder / name
        try:
            st = p.stat()
        except OSError:
            raise EngineError(f"{p} is missing (the manifest lists it as a file of this engine); {hint}", "files") from None
        if not p.is_file():
            raise EngineError(f"{p} is not a regular file (the manifest lists it as a file of this engine); {hint}", "files")
        want = getattr(rec, "bytes", None)
        if want is not None and st.st_size != want:
            raise EngineError(f"{p} has {st.st_size} bytes, the manifest records {want} (truncated or altered); {hint}", "files")


class Verification:
    """SHA-256 checks of some files of an engine folder: files whose identity has the
    expected digest in the :class:`DigestCache` pass at once; the others are hashed on
    worker threads from construction on; :meth:`wait` joins them.

    Files are started largest first (the longest hash starts at once) on up to
    ``workers`` threads (default: one fewer than the CPUs, at least one, at most the
    number of files: on the 2 shared cores of docs/real_shapes/load_strategy_e714.json one
    hashing thread took 9.6 s and 5.3 CPU-s where two took 11.7 s and 7.1 CPU-s).

    Args:
        folder: the engine folder.
        digests: file name -> expected hex SHA-256.
        hint: what to re-run, appended to error messages.
        workers: worker threads (>= 1), or None for the default.
        cache: the digest cache, ``None`` for the process's (:func:`digest_cache`), False
            for none (hash everything).

    Attributes:
        cached: names of the files that passed on their recorded digest (no read).
        hashed: names of the files that are hashed.
        identities: after :meth:`wait`, per file the :func:`file_identity` its digest was
            verified under (None where the file changed while it was read), so that whoever
            opens it next can check it still is that file (the kernels' panels are).
    """

    def __init__(self, folder: Path, digests: Mapping[str, str], hint: str, workers: int | None = None, cache: DigestCache | None | bool = None):
        self.folder, self.hint = Path(folder), hint
        self._expected = dict(digests)
        self._cache = digest_cache() if cache is None else (cache or None)
        self.cached: list[str] = []
        self.identities: dict[str, tuple | None] = {}
        sizes = {}
        for n, want in self._expected.items():
            try:
                st = os.stat(self.folder / n)
            except OSError:
                sizes[n] = 0  # hashed: the read reports why it cannot be
                continue
            if self._cache is not None and self._cache.matches(file_identity(st), want):
                self.cached.append(n)
                self.identities[n] = file_identity(st)
            else:
                sizes[n] = st.st_size
        self.hashed = sorted(sizes, key=lambda n: -sizes[n])
        n_workers = max(1, min(len(self.hashed), workers or (os.cpu_count() or 2) - 1))
        self._pool = ThreadPoolExecutor(max_workers=n_workers, thread_name_prefix="specrt-verify") if self.hashed else None
        self._futures: dict[str, Future] = {n: self._pool.submit(_hash_file, self.folder / n) for n in self.hashed}

    def wait(self) -> None:
        """Block until every digest is known; refuse the first file (in the order given)
        whose digest differs or that could not be read. Digests that matched are recorded
        in the cache (and the cache file written) only when every file passed.

        Raises:
            EngineError: (param ``files``) ``<file> does not match the SHA-256 recorded in
                the manifest``, or the file could not be read.
        """
        try:
            good = []
            for name in self._expected:
                fut = self._futures.get(name)
                if fut is None:
                    continue  # cached: the recorded digest of this identity is the manifest's
                try:
                    got, ident, self.identities[name] = fut.result()
                except OSError as e:
                    raise EngineError(f"{self.folder / name} cannot be read ({e.strerror or e}); {self.hint}", "files") from None
                if got != self._expected[name]:
                    raise EngineError(f"{self.folder / name} {MISMATCH}; {self.hint}", "files")
                if ident is not None:
                    good.append((ident, got, self.folder / name))
            if self._cache is not None and good:
                for ident, got, p in good:
                    self._cache.record(ident, got, p)
                self._cache.save()
        finally:
            self.close()

    def close(self) -> None:
        """Stop the workers (files not started are skipped); idempotent."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
