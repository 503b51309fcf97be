"""Writing an engine folder's files so that a process using the folder never sees a change.

Every file the export writes (panels, graphs and their external data, the tokenizer, the chat
template, TensorRT plans, the manifest) is written under a temporary name in the same folder
and moved over its name with ``os.replace`` (one ``rename``: atomic on POSIX file systems). A
process that opened or mapped the old file keeps its inode and its bytes: re-exporting into a
folder a server runs from neither crashes the server (a truncated mapping is SIGBUS) nor
changes its output behind the hash check it passed at load; a reader that opens the name gets
the old file or the new one, never half of one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

__all__ = ["replaced", "write_bytes", "write_text", "staged_dir"]


@contextmanager
def replaced(path: str | Path) -> Iterator[Path]:
    """A temporary path in ``path``'s folder to write the new file at; on leaving the block
    without an error it is moved over ``path`` (``os.replace``), else removed.

    Yields:
        the temporary path (a hidden name ``.<name>.<random>.tmp``; nothing exists there yet).
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` as the new ``path`` (:func:`replaced`); returns ``path``."""
    with replaced(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text(path: str | Path, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` as the new ``path`` (:func:`replaced`); returns ``path``."""
    with replaced(path) as tmp:
        tmp.write_text(text, encoding=encoding)
    return Path(path)


@contextmanager
def staged_dir(folder: str | Path) -> Iterator[Path]:
    """A temporary folder inside ``folder`` for writers that name files themselves (an ONNX
    graph and its ``.data`` file, whose name the graph records): on leaving the block without
    an error every file written there is moved (``os.replace``) to the same name in
    ``folder``, external data before the graphs that point to it; the temporary folder is
    removed either way.

    Yields:
        the staging folder (empty).
    """
    folder = Path(folder)
    stage = Path(tempfile.mkdtemp(prefix=".staged.", dir=folder))
    try:
        yield stage
        names = sorted(p.name for p in stage.iterdir() if p.is_file())
        for name in sorted(names, key=lambda n: not n.endswith(".data")):  # data first
            os.replace(stage / name, folder / name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
