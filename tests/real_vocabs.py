"""Real tokenizer vocabularies for the tests, without a model hub.

llama.cpp keeps vocabulary-only GGUF files (``ggml-vocab-<name>.gguf``: tokens, merges,
scores, special ids, no weights) with its tokenizer test cases (``.gguf.inp`` inputs,
``.gguf.out`` expected ids, written from each model's own Hugging Face tokenizer) under
``vendor/llama.cpp/models/`` of the llama-cpp-python *source* distribution on PyPI.
llama.cpp is MIT-licensed (Copyright (c) 2023-2026 The ggml authors); its LICENSE is copied
next to the files as ``LICENSE.llama.cpp``. The ``.inp/.out`` format is the one of llama.cpp's
``tests/test-tokenizer-0.cpp``.

:func:`vocab_dir` downloads that sdist once (pinned version and sha256), extracts only those
files into a cache folder and returns it; offline, or on any download/hash problem, it raises
:class:`VocabsUnavailable`, which the fixtures turn into ``pytest.skip`` with the reason.

It reads the PyPI "simple" index (PEP 691 JSON, what pip and mirrors serve) with urllib,
because ``pip download --no-binary :all:`` of this sdist also installs and runs its build
backend (scikit-build-core, cmake) to prepare metadata: ~80 s, and it fails offline even with
the sdist cached. Here: ~6 s once (a 73 MiB download, sha256 check, extraction), 0 s cached.
The version is pinned because newer llama.cpp releases add or rename vocab files and may
change the expected ids: change :data:`PIN`, :data:`SHA256` and :data:`SIZE` together.

Environment: ``SPECRT_VOCAB_CACHE`` (cache folder; default ``~/.cache/specrt/vocabs``; the
files land in ``<cache>/<PIN>/`` with a ``.complete`` marker, the sdist is deleted after
extraction), ``SPECRT_OFFLINE=1`` (never touch the network: skip unless cached),
``SPECRT_PYPI_SIMPLE`` (index URL, default ``https://pypi.org/simple``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

PACKAGE = "llama-cpp-python"
PIN = "0.3.36"
SDIST = f"llama_cpp_python-{PIN}.tar.gz"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SIZE = 76_589_250  # bytes
MEMBER_DIR = "vendor/llama.cpp/models/"
LICENSE_MEMBER = "vendor/llama.cpp/LICENSE"
TIMEOUT_S = 60
CASE_SEPARATOR = "\n__ggml_vocab_test__\n"


class VocabsUnavailable(RuntimeError):
    """The vocabulary files cannot be had here (offline, index unreachable, hash mismatch,
    corrupt download); the message says which."""


def cache_root() -> Path:
    """``$SPECRT_VOCAB_CACHE`` or ``~/.cache/specrt/vocabs``."""
    env = os.environ.get("SPECRT_VOCAB_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "specrt" / "vocabs"


def _sdist_url(index: str) -> str:
    """URL of the pinned sdist on a PEP 691 index (its listed sha256 must be the pinned one)."""
    req = urllib.request.Request(f"{index.rstrip('/')}/{PACKAGE}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
        data = json.load(r)
    for f in data.get("files", []):
        if f.get("filename") == SDIST:
            listed = f.get("hashes", {}).get("sha256")
            if listed and listed != SHA256:
                raise VocabsUnavailable(f"{SDIST}: the index lists sha256 {listed}, pinned {SHA256}")
            return f["url"]
    raise VocabsUnavailable(f"{SDIST} is not on the index {index}")


def _download(url: str, dest: Path) -> None:
    """Stream ``url`` to ``dest``, checking the pinned sha256 (``dest`` removed on mismatch)."""
    h = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as r, open(dest, "wb") as out:
        while chunk := r.read(1 << 20):
            h.update(chunk)
            out.write(chunk)
    if h.hexdigest() != SHA256:
        dest.unlink(missing_ok=True)
        raise VocabsUnavailable(f"{SDIST}: sha256 {h.hexdigest()} is not the pinned {SHA256}")


def _extract(sdist: Path, dest: Path) -> None:
    """Copy ``ggml-vocab-*`` files and llama.cpp's LICENSE out of the sdist, flat (no path
    from the archive is used as a path here)."""
    top = f"llama_cpp_python-{PIN}/"
    with tarfile.open(sdist, "r:gz") as tf:
        for m in tf:
            if not m.isfile() or not m.name.startswith(top):
                continue
            rel = m.name[len(top) :]
            if rel.startswith(MEMBER_DIR) and Path(rel).name.startswith("ggml-vocab-"):
                name = Path(rel).name
            elif rel == LICENSE_MEMBER:
                name = "LICENSE.llama.cpp"
            else:
                continue
            with tf.extractfile(m) as src, open(dest / name, "wb") as out:
                shutil.copyfileobj(src, out)


def vocab_dir() -> Path:
    """The folder with ``ggml-vocab-*.gguf`` (+ ``.inp``/``.out``) and ``LICENSE.llama.cpp``,
    downloaded and extracted on the first call, cached afterwards.

    Raises:
        VocabsUnavailable: ``SPECRT_OFFLINE`` set and nothing cached, index or download
            unreachable, sha256 mismatch, corrupt archive.
    """
    root = cache_root()
    final = root / PIN
    if (final / ".complete").exists():
        return final
    if os.environ.get("SPECRT_OFFLINE"):
        raise VocabsUnavailable(f"SPECRT_OFFLINE is set and {final} holds no extracted vocabularies")
    sdist = root / SDIST
    try:
        root.mkdir(parents=True, exist_ok=True)
        if not (sdist.exists() and sdist.stat().st_size == SIZE):
            part = root / f"{SDIST}.{os.getpid()}.part"  # one per process: concurrent sessions do not mix
            _download(_sdist_url(os.environ.get("SPECRT_PYPI_SIMPLE", "https://pypi.org/simple")), part)
            part.replace(sdist)
    except (urllib.error.URLError, OSError, TimeoutError, json.JSONDecodeError) as e:
        raise VocabsUnavailable(f"cannot download {SDIST} from the package index: {e}") from e
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".extract-"))
    try:
        _extract(sdist, tmp)
        (tmp / ".complete").write_text(f"{SDIST} {SHA256}\n")
        if not (final / ".complete").exists():  # else another session finished first
            if final.exists():  # a stale, incomplete folder
                shutil.rmtree(final)
            tmp.replace(final)  # atomic: a concurrent caller sees all files or none
    except (tarfile.TarError, EOFError, OSError) as e:
        sdist.unlink(missing_ok=True)
        raise VocabsUnavailable(f"{SDIST} could not be extracted: {e}") from e
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    sdist.unlink(missing_ok=True)
    return final


def read_cases(gguf: Path) -> list[tuple[str, list[int]]]:
    """(text, expected ids) pairs of ``<gguf>.inp`` / ``<gguf>.out``, split as llama.cpp's
    ``tests/test-tokenizer-0.cpp`` splits them. The ids are the model's own tokenizer's
    ``encode(text, add_special_tokens=False)``: never BOS/EOS, SentencePiece's dummy-prefix
    ``▁`` included.

    Raises:
        ValueError: the two files have different numbers of cases.
    """
    raw = Path(str(gguf) + ".inp").read_bytes().decode("utf-8")
    texts, pos = [], 0
    while pos < len(raw):  # each case is followed by the separator, except maybe the last
        nxt = raw.find(CASE_SEPARATOR, pos)
        if nxt < 0:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:nxt])
        pos = nxt + len(CASE_SEPARATOR)
    lines = Path(str(gguf) + ".out").read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(texts) != len(lines):
        raise ValueError(f"{gguf.name}: {len(texts)} inputs, {len(lines)} outputs")
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines)]
