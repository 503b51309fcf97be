"""Integrity of an engine folder's files: SHA-256 and size, checked before the files are used.

The manifest's ``files`` map records every file an engine needs (graphs, the ONNX
external-data files the graphs' initializers point to, the tokenizer), each with its
SHA-256 and byte size (:class:`~specrt.runtime.manifest.FileRecord`). At load:

1. every listed file must exist with its recorded size (one ``stat`` each: catches missing,
   truncated and appended files before anything reads them);
2. the files the load opens are hashed on worker threads (:class:`Verification`) while the
   tokenizer and the onnxruntime sessions are created on the calling thread, and the
   load only returns once every digest matched; a mismatch is refused with one line naming
   the file, and the sessions are dropped.

Reads and digests release the GIL (``readinto`` into one reused buffer, ``hashlib`` on
blocks of 8 MiB), so hashing and session creation overlap on separate cores. Nothing is
cached between loads: every load hashes every byte it uses.
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Mapping

from .errors import EngineError

__all__ = ["sha256_file", "check_present", "Verification", "MISMATCH"]

MISMATCH = "does not match the SHA-256 recorded in the manifest (truncated or altered)"
_BLOCK = 8 << 20  # bytes per read: long GIL-free digest calls, small resident buffer


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes.

    Reads with ``readinto`` into one reused 8 MiB buffer (both the read and the digest
    release the GIL, so other threads run meanwhile; no ``mmap``, so the file's pages are
    not added to this process's resident set while it is hashed).

    Raises:
        OSError: the file cannot be opened or read.
    """
    h = hashlib.sha256()
    buf = bytearray(_BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


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
    """SHA-256 checks of some files of an engine folder, running on worker threads from
    construction on; :meth:`wait` joins them.

    Files are started largest first (the longest hash starts at once) on up to
    ``workers`` threads (default: the number of CPUs, at most the number of files).

    Args:
        folder: the engine folder.
        digests: file name -> expected hex SHA-256.
        hint: what to re-run, appended to error messages.
        workers: worker threads (>= 1), or None for the default.
    """

    def __init__(self, folder: Path, digests: Mapping[str, str], hint: str, workers: int | None = None):
        self.folder, self.hint = Path(folder), hint
        self._expected = dict(digests)
        names = sorted(self._expected, key=lambda n: -_size(self.folder / n))
        n_workers = max(1, min(len(names), workers or os.cpu_count() or 1))
        self._pool = ThreadPoolExecutor(max_workers=n_workers, thread_name_prefix="specrt-verify") if names else None
        self._futures: dict[str, Future] = {n: self._pool.submit(sha256_file, self.folder / n) for n in names} if self._pool else {}
        self._done = threading.Event()

    def wait(self) -> None:
        """Block until every digest is known; refuse the first file (in the order given)
        whose digest differs or that could not be read.

        Raises:
            EngineError: (param ``files``) ``<file> does not match the SHA-256 recorded in
                the manifest``, or the file could not be read.
        """
        try:
            for name in self._expected:
                fut = self._futures[name]
                try:
                    got = fut.result()
                except OSError as e:
                    raise EngineError(f"{self.folder / name} cannot be read ({e.strerror or e}); {self.hint}", "files") from None
                if got != self._expected[name]:
                    raise EngineError(f"{self.folder / name} {MISMATCH}; {self.hint}", "files")
        finally:
            self.close()

    def close(self) -> None:
        """Stop the workers (files not started are skipped); idempotent."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0
