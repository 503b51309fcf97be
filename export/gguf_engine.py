"""GGUF files -> an engine folder for specrt's CPU kernels, in about a minute: no torch, no
transformers model code, no ONNX graph.

``specrt serve|generate|bench --target T.gguf [--draft D.gguf]`` run GGUF files directly:
:func:`engine_for` returns a folder in the user's cache (``$SPECRT_ENGINE_CACHE``, else
``$XDG_CACHE_HOME/specrt/engines``, else ``~/.cache/specrt/engines``) keyed by the files'
SHA-256, the context size, k_max and this builder's version, building it on first use
(:func:`build_engine`) and reusing it after (the files' digests come from the digest cache,
:mod:`specrt.runtime.integrity`, so a warm start reads no GGUF byte).

The folder holds:

* ``manifest.json``: both models of graph form ``kernels`` (:data:`~specrt.runtime.manifest.GRAPH_KERNELS`),
  precision ``gguf`` (the file's own blocks), the dims from the GGUF metadata;
* ``tokenizer.json`` and ``chat_template.jinja``: from the target GGUF's own metadata
  (:mod:`specrt.export.gguf_tokenizer`);
* ``target.panels``: the target's blocks in the kernels' layout, each tensor checked against
  ``gguf.dequantize`` bit for bit (:func:`specrt.export.kernel_pack.write_panels`);
* ``draft.panels``: the draft's matrices quantized again to Q4_0 with its LM head cut to the
  most frequent ids (:func:`specrt.export.kernel_pack.draft_panels`'s recipe). Without a
  draft GGUF the target's panels serve as the draft model's and the default drafter is
  n-gram lookup in the prompt and output (``defaults.drafter = "ngram"``).

Every refusal (not a GGUF file, an architecture or block type the kernels do not run, draft
and target vocabularies that differ, the kernels not built here) is one line, raised before
any panel is written.
"""

from __future__ import annotations

import os
import platform
import resource
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrt.runtime.errors import ExportError, PairError, UnsupportedModelError

__all__ = [
    "ENGINE_BUILD_VERSION",
    "CACHE_ENV",
    "DEFAULT_MAX_CTX",
    "DEFAULT_K_MAX",
    "GgufInput",
    "default_cache",
    "read_input",
    "build_engine",
    "engine_for",
    "call_costs",
    "record_call_costs",
]

ENGINE_BUILD_VERSION = 3  # bump when the folder written for the same files changes (2: adaptive-k defaults; 3: IQ4_NL/IQ4_XS panels of nibbles)
CACHE_ENV = "SPECRT_ENGINE_CACHE"
DEFAULT_MAX_CTX = 4096  # KV rows (llama-server's default context per slot)
DEFAULT_K_MAX = 8


def default_cache() -> Path:
    """``$SPECRT_ENGINE_CACHE``, else ``$XDG_CACHE_HOME/specrt/engines``, else
    ``~/.cache/specrt/engines``."""
    env = os.environ.get(CACHE_ENV, "").strip()
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specrt" / "engines"


@dataclass(frozen=True)
class GgufInput:
    """One GGUF file, opened and checked for the kernels (:func:`read_input`).

    Attributes:
        path: the file; reader: its ``gguf.GGUFReader``; dims: the decoder's dims
            (:func:`specrt.export.kernel_pack.plan_tensors`); tensors: name -> reader tensor
            of what a step reads; meta: its tokenizer metadata
            (:func:`specrt.export.gguf_tokenizer.read_tokenizer_meta`).
    """

    path: Path
    reader: object
    dims: dict
    tensors: dict
    meta: dict


def _check_gguf(path, role: str) -> Path:
    """``path`` as a Path when it is a GGUF file (its magic read), else a one-line ExportError."""
    from .gguf_import import is_gguf

    p = Path(path)
    if not (p.is_file() and is_gguf(p)):
        raise ExportError(f"--{role} {p}: not a GGUF file (a .gguf file made by llama.cpp is needed)", role)
    return p


def read_input(path: str | Path, role: str) -> GgufInput:
    """Open a GGUF file and check that the kernels run it (metadata only; no block is read).

    Raises:
        ExportError: not a GGUF file, or one the gguf package cannot read.
        UnsupportedModelError: an architecture, a block type or a shape the kernels do not
            run (one line naming the file and the reason).
    """
    import gguf

    from .gguf_tokenizer import read_tokenizer_meta
    from .kernel_pack import plan_tensors

    p = _check_gguf(path, role)
    try:
        reader = gguf.GGUFReader(str(p))
    except Exception as e:  # noqa: BLE001 - the gguf package raises many kinds; one line for the user
        raise ExportError(f"--{role} {p}: the gguf package cannot read it ({type(e).__name__}: {e})", role) from None
    dims, tensors, why = plan_tensors(reader)
    if why:
        raise UnsupportedModelError(f"--{role} {p.name}: specrt's kernels do not run it: {why}", role)
    meta = read_tokenizer_meta(p, reader)
    for key in [k for k, f in reader.fields.items() if len(f.data) > 1024]:
        del reader.fields[key]  # the parsed vocabulary arrays: 490 MB of small numpy views for Qwen2.5's, read once into meta
    return GgufInput(p, reader, dims, tensors, meta)


def _counts(inp: GgufInput) -> tuple[int, int]:
    """``(params, matmul_params)``: weights of every tensor a step reads, and of the decoder
    layers' matrices (norms, biases, embedding and head excluded)."""
    params = matmul = 0
    for key, t in inp.tensors.items():
        n = int(np.prod([int(x) for x in t.shape]))
        if key == "output" and inp.tensors.get("token_embd") is t:
            continue  # a tied head is the embedding's rows, counted once
        params += n
        if key.startswith("blk.") and len(t.shape) == 2 and int(t.shape[1]) > 1:
            matmul += n
    return params, matmul


def _entry(rec: dict, counts: tuple[int, int], source: str, files: dict, vocab_hash: str, note: str, out: Path):
    """The manifest's :class:`~specrt.runtime.manifest.ModelEntry` of panels ``rec``
    (``counts``: :func:`_counts`; its file recorded in ``files`` here)."""
    from specrt.runtime.manifest import GRAPH_KERNELS, KERNEL_PRECISION, FileRecord, ModelEntry

    d = rec["dims"]
    params, matmul = counts
    files[rec["file"]] = FileRecord.of(out / rec["file"])
    return ModelEntry(
        file=rec["file"],
        sha256=files[rec["file"]].sha256,
        family=d["arch"],
        n_layers=d["n_layer"],
        n_heads=d["n_head"],
        n_kv_heads=d["n_head_kv"],
        head_dim=d["head_dim"],
        hidden=d["n_embd"],
        vocab_size=int(d["n_vocab"]),
        params=params,
        matmul_params=matmul,
        source=source,
        vocab_hash=vocab_hash,
        graph=GRAPH_KERNELS,
        precision=KERNEL_PRECISION,
        note=note,
    )


def _draft_ids(tokenizer_json: Path, vocab: int, first: tuple[int, ...], cache: Path | None, vocab_hash: str) -> np.ndarray | None:
    """The draft's LM-head ids (FR-Spec, :func:`specrt.export.kernel_pack.ranked_ids`, the
    :data:`~specrt.export.kernel_pack.DRAFT_HEAD` most frequent), cached per vocabulary
    (the ranking tokenizes the stdlib: 15 s for Qwen2.5's vocabulary on an AMD EPYC Zen 3 core, AVX2)."""
    from .kernel_pack import DRAFT_HEAD, ranked_ids

    if not DRAFT_HEAD or DRAFT_HEAD >= vocab:
        return None
    f = None if cache is None else cache / "ranks" / f"{vocab_hash[:32]}-{vocab}-{'_'.join(map(str, first))}-py{platform.python_version()}.npy"
    if f is not None and f.is_file():
        try:
            ranks = np.load(f)
            if ranks.dtype == np.int32 and ranks.shape == (vocab,):
                return np.sort(ranks[: DRAFT_HEAD // 16 * 16])
        except (OSError, ValueError):
            pass
    ranks = ranked_ids(tokenizer_json, vocab, first)
    if f is not None:
        from specrt.runtime.fileio import replaced

        f.parent.mkdir(parents=True, exist_ok=True)
        with replaced(f) as tmp, open(tmp, "wb") as fh:
            np.save(fh, ranks)
    return np.sort(ranks[: DRAFT_HEAD // 16 * 16])


def _draft_job(conn, draft: str, out: str, cache: str | None) -> None:
    """The draft's half of a build, in its own process (the target's runs at the same time on
    the other core): open and check the file, send its vocabulary hash (``("vocab", hash)``),
    rank its ids (FR-Spec head) and write ``draft.panels``; then ``("done", record)``. Any
    error is sent as ``("error", class name, message)``."""
    from specrt.runtime import errors

    from .gguf_tokenizer import tokenizer_from_gguf
    from .kernel_pack import DRAFT_REQUANT, write_panels

    _die_with_parent()
    try:
        d_in = read_input(draft, "draft")
        tok = tokenizer_from_gguf(d_in.path, d_in.meta)
        conn.send(("vocab", tok.vocab_hash))
        tj = Path(out) / ".draft_tokenizer.json"
        tok.tokenizer.save(str(tj))
        first = (tok.eos if tok.eos is not None else 0, *tok.end_ids)
        ids = _draft_ids(tj, int(d_in.tensors["token_embd"].shape[1]), first, None if cache is None else Path(cache), tok.vocab_hash)
        tj.unlink()
        rec = write_panels(d_in.path, Path(out), "draft", lambda s: conn.send(("log", s)), requant=DRAFT_REQUANT, head_ids=ids, reader=d_in.reader)
        params = _counts(d_in)
        conn.send(("done", rec, params) if rec is not None else ("error", "UnsupportedModelError", f"--draft {d_in.path.name}: no panels written"))
    except errors.SpecRTError as e:
        conn.send(("error", type(e).__name__, str(e)))
    except KeyboardInterrupt:
        pass  # the parent reports the interruption
    except Exception as e:  # noqa: BLE001 - reported in one line by the parent
        conn.send(("error", "ExportError", f"--draft {draft}: {type(e).__name__}: {e}"))
    finally:
        conn.close()


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (``prctl(PR_SET_PDEATHSIG)``), so a
    killed build leaves no draft build running; elsewhere nothing."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class _DraftBuild:
    """The draft's build in a spawned process (:func:`_draft_job`), read through a pipe."""

    def __init__(self, draft: Path, out: Path, cache: Path | None, log):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # no fork of a process that may hold threads
        self.conn, child = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_draft_job, args=(child, str(draft), str(out), None if cache is None else str(cache)), daemon=True)
        self.proc.start()
        child.close()
        self.log = log

    def _next(self, want: str):
        from specrt.runtime import errors

        while True:
            try:
                msg = self.conn.recv()
            except EOFError:
                self.proc.join(5)
                raise ExportError(f"the draft's build process ended without a result (exit code {self.proc.exitcode})", "draft") from None
            if msg[0] == "log":
                self.log(msg[1])
            elif msg[0] == "error":
                raise getattr(errors, msg[1], ExportError)(msg[2], "draft")
            elif msg[0] == want:
                return msg[1:]

    def vocab_hash(self) -> str:
        return self._next("vocab")[0]

    def result(self) -> tuple[dict, tuple[int, int]]:
        rec, params = self._next("done")
        self.proc.join()
        return rec, params

    def stop(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()


def build_engine(
    target: str | Path,
    draft: str | Path | None,
    out: str | Path,
    max_ctx: int = DEFAULT_MAX_CTX,
    k_max: int = DEFAULT_K_MAX,
    log=print,
    cache: Path | None = None,
):
    """Write an engine folder for the kernels from GGUF files (see the module docstring).
    The draft is built in a second process beside the target (2 cores: a cold build of
    Qwen2.5-Coder 1.5B + 0.5B takes the target's time); its vocabulary is checked against
    the target's before the target's panels are written.

    Args:
        target, draft: GGUF files (``draft`` None: n-gram drafting over the target's panels).
        out: the folder to write (created; files in it are replaced).
        max_ctx: KV rows (k_max+2..the target's ``context_length``; None: the smaller of
            :data:`DEFAULT_MAX_CTX` and that length); k_max: most candidates per
            verification pass (1..64).
        cache: where the draft's id ranking is kept between builds (None: not kept).

    Returns:
        the written :class:`~specrt.runtime.manifest.Manifest`.

    Raises:
        ExportError, UnsupportedModelError: see :func:`read_input`; the kernels library is
            not built here.
        PairError: the draft's vocabulary differs from the target's.
        InputError: max_ctx or k_max out of range.
    """
    from specrt.runtime import kernels
    from specrt.runtime.errors import InputError

    t0 = time.time()
    if kernels.status() is not None:
        raise ExportError(f"specrt's kernels are not available here: {kernels.status()}", "backend")
    if not 1 <= k_max <= 64:
        raise InputError(f"k_max={k_max}; allowed: 1..64", "k_max")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    job = None
    if draft is not None:
        _check_gguf(draft, "draft")
        job = _DraftBuild(Path(draft), out, cache, log)
    try:
        return _build(target, draft, job, out, max_ctx, k_max, log, t0)
    finally:
        if job is not None:
            job.stop()


def _write_tokenizer(tok, out: Path) -> dict:
    """Write ``tokenizer.json`` and ``chat_template.jinja`` (when the GGUF has one) of a
    :class:`~specrt.export.gguf_tokenizer.GgufTokenizer`; returns their file records."""
    from specrt.runtime.fileio import write_text
    from specrt.runtime.manifest import FileRecord

    tok.tokenizer.save(str(out / "tokenizer.json.tmp"))
    os.replace(out / "tokenizer.json.tmp", out / "tokenizer.json")
    files = {"tokenizer.json": FileRecord.of(out / "tokenizer.json")}
    if tok.chat_template:
        write_text(out / "chat_template.jinja", tok.chat_template)
        files["chat_template.jinja"] = FileRecord.of(out / "chat_template.jinja")
    return files


def _version() -> str:
    """specrt's installed version ("" when it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specrt")
    except PackageNotFoundError:
        return ""


def _build(target, draft, job: _DraftBuild | None, out: Path, max_ctx: int, k_max: int, log, t0: float):
    """:func:`build_engine`'s target half and the manifest (``job``: the draft's process)."""
    from specrt.runtime.errors import InputError

    from .gguf_tokenizer import tokenizer_from_gguf
    from .kernel_pack import write_panels

    t_in = read_input(target, "target")
    ctx_key = f"{t_in.dims['arch']}.context_length"
    ctx_len = int(t_in.reader.fields[ctx_key].contents()) if ctx_key in t_in.reader.fields else 1 << 20
    max_ctx = max_ctx or min(DEFAULT_MAX_CTX, ctx_len)
    if not k_max + 2 <= max_ctx <= ctx_len:
        raise InputError(f"max_ctx={max_ctx}; allowed: {k_max + 2}..{ctx_len} (the target's context length)", "max_ctx")
    tok = tokenizer_from_gguf(t_in.path, t_in.meta)
    rows = int(t_in.tensors["token_embd"].shape[1])
    if tok.n_tokens > rows:
        raise UnsupportedModelError(f"--target {t_in.path.name}: its vocabulary has {tok.n_tokens} tokens but its embedding {rows} rows", "target")
    if job is not None and job.vocab_hash() != tok.vocab_hash:
        raise PairError(
            f"--draft {Path(draft).name} and --target {t_in.path.name} have different vocabularies (tokens, merges or split rules); "
            "the draft must propose ids the target reads: give a draft of the target's model family",
            "draft",
        )
    log(f"building a kernels engine for {t_in.path.name}" + (f" + draft {Path(draft).name}" if job else " (n-gram drafting)") + f" in {out}")
    files = _write_tokenizer(tok, out)
    eos, eog = (tok.eos if tok.eos is not None else 0), tok.end_ids
    recs = {"target": write_panels(t_in.path, out, "target", log, reader=t_in.reader)}
    if recs["target"] is None:
        raise UnsupportedModelError(f"--target {t_in.path.name}: no panels written (see the line above)", "target")
    target_entry = _entry(recs["target"], _counts(t_in), t_in.path.name, files, tok.vocab_hash, "the GGUF file's own blocks on specrt's kernels", out)
    draft_entry = target_entry
    recs["draft"] = recs["target"]
    if job is not None:
        recs["draft"], counts = job.result()
        note = f"quantized again to Q4_0, LM head cut to {recs['draft'].get('head', {}).get('ids', 'all')} ids"
        draft_entry = _entry(recs["draft"], counts, Path(draft).name, files, tok.vocab_hash, note, out)
    return _write_manifest(
        out, tok, {"target": target_entry, "draft": draft_entry}, recs, files, (eos, eog), (max_ctx, k_max), {"target": target, "draft": draft}, t0, log
    )


def _write_manifest(out: Path, tok, entries: dict, recs: dict, files: dict, ends: tuple, sizes: tuple, inputs: dict, t0: float, log):
    """Write the kernels folder's manifest (``ends``: ``(eos, end-of-generation ids)``;
    ``sizes``: ``(max_ctx, k_max)``; ``inputs``: role -> GGUF path or None) and return it."""
    import gguf
    import tokenizers

    from specrt.runtime.manifest import FORMAT_VERSION, KERNEL_PRECISION, Manifest

    (eos, eog), (max_ctx, k_max), has_draft = ends, sizes, inputs["draft"] is not None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    peak_children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        name=out.name,
        draft=entries["draft"],
        target=entries["target"],
        tokenizer_file="tokenizer.json",
        tokenizer_sha256=files["tokenizer.json"].sha256,
        vocab_size=tok.n_tokens,
        eos_token_id=eos,
        eos_token_ids=tuple(i for i in eog if i < tok.n_tokens),
        bos_token_id=tok.bos,
        add_bos=tok.add_bos,
        pad_token_id=tok.pad,
        chat_template_file="chat_template.jinja" if tok.chat_template else None,
        chat_template_sha256=files["chat_template.jinja"].sha256 if tok.chat_template else None,
        max_ctx=max_ctx,
        k_min=1,
        k_max=k_max,
        # adaptive k: on a 2-core Zen 3 (AVX2) with the real pair
        # fixed k=8 ran 0.86-0.96x target-only where adaptive ran 1.00-1.02x
        # (docs/bench/gguf_start/bench_defaults_zen3_2026-12-06.json); `specrt tune` re-tunes per machine
        defaults={"k_max": k_max, "threshold": 0.3, "adaptive": True, "strategy": "full", **({} if has_draft else {"drafter": "ngram"})},
        tools={"python": platform.python_version(), "specrt": _version(), "gguf": getattr(gguf, "__version__", ""), "tokenizers": tokenizers.__version__},
        extra={
            "kernels": recs,
            "gguf": {r: {"file": Path(p).name, "bytes": Path(p).stat().st_size} for r, p in inputs.items() if p is not None},
            "build": {
                "version": ENGINE_BUILD_VERSION,
                "seconds": round(time.time() - t0, 1),
                "peak_rss_mib": {"target": round(peak), "draft": round(peak_children) if has_draft else None},
                "tokenizer": f"{tok.kind}/{tok.pre} from the GGUF metadata",
            },
        },
        precision=KERNEL_PRECISION,
        files=files,
    )
    manifest.write(out)
    log(
        f"wrote {out / 'manifest.json'} ({time.time() - t0:.0f} s; peak RSS {peak:,.0f} MiB"
        + (f", the draft's process {peak_children:,.0f} MiB)" if has_draft else ")")
    )
    return manifest


def _key(target_sha: str, draft_sha: str | None, max_ctx: int | None, k_max: int) -> str:
    """The cache folder's name for these files and settings."""
    import hashlib

    h = hashlib.sha256(f"{target_sha}|{draft_sha or '-'}|{max_ctx or 'auto'}|{k_max}|{ENGINE_BUILD_VERSION}|{_version()}".encode()).hexdigest()
    return h[:24]


def _usable(folder: Path) -> bool:
    """Whether ``folder`` holds a complete engine of this build version (its manifest loads)."""
    from specrt.runtime.errors import EngineError
    from specrt.runtime.manifest import load_manifest

    if not (folder / "manifest.json").is_file():
        return False
    try:
        return (load_manifest(folder, verify_hashes=False).extra.get("build") or {}).get("version") == ENGINE_BUILD_VERSION
    except EngineError:
        return False


def engine_for(
    target: str | Path, draft: str | Path | None = None, cache: str | Path | None = None, max_ctx: int | None = None, k_max: int = DEFAULT_K_MAX, log=print
) -> Path:
    """The engine folder of these GGUF files in the cache: reused when built before (its
    manifest loads and is of this build version), else built (:func:`build_engine`).

    A build holds an exclusive lock on ``<cache>/<key>.lock`` (a second process asking for
    the same folder waits, then reuses it), writes into a fresh temporary folder beside the
    final one (``tempfile.mkdtemp``; those a killed build left are removed under the lock),
    checks it loads, and renames it into place; a stale folder is renamed aside before it is
    removed. So a half-built folder is never used and a folder another process serves from
    is never deleted under it. SIGTERM during a build ends it through the same cleanup.

    Args:
        target, draft: GGUF files; cache: the cache folder (None: :func:`default_cache`);
            max_ctx: KV rows (None: the smaller of :data:`DEFAULT_MAX_CTX` and the target's
            context length); k_max: as :func:`build_engine`.

    Returns:
        the folder (``<cache>/<key>``).

    Raises:
        as :func:`build_engine`; ExportError (one line) for a cache folder that cannot be
            made or written (a file in its place, no space, no permission).
    """
    import multiprocessing

    from specrt.runtime.integrity import file_sha256

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        # the draft's build process (spawned) runs the caller's main module again first: a
        # script without a main guard would wait here for the lock its parent holds, forever
        raise ExportError(
            "engine_for ran while a spawned process imported the calling script: put the script's code under "
            '`if __name__ == "__main__":` (the draft is built in a spawned process, which imports the main module)',
            "target",
        )
    for role, p in (("target", target), ("draft", draft)):
        if p is not None:
            _check_gguf(p, role)
    root = Path(cache).expanduser() if cache is not None else default_cache()
    shas = [file_sha256(target), None if draft is None else file_sha256(draft)]
    folder = root / _key(shas[0], shas[1], max_ctx, k_max)
    if _usable(folder):
        return folder
    try:
        with _build_lock(root, folder.name), _sigterm_exits():
            if _usable(folder):  # another process built it while this one waited
                return folder
            if folder.exists():
                log(f"{folder}: incomplete or stale; building it again")
            _build_into(folder, target, draft, shas, max_ctx, k_max, log)
    except OSError as e:
        raise ExportError(
            f"engine cache {root}: {e.strerror or e} ({e.filename or root}); choose another with --engine-cache DIR or $SPECRT_ENGINE_CACHE", "engine_cache"
        ) from None
    return folder


@contextmanager
def _build_lock(root: Path, key: str):
    """An exclusive ``flock`` on ``<root>/<key>.lock`` for one build; the temporary folders of
    builds of ``key`` that were killed are removed once it is held."""
    import fcntl

    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{key}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            for old in root.glob(f".{key}.*"):
                shutil.rmtree(old, ignore_errors=True)  # a killed build's (the lock says none runs)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextmanager
def _sigterm_exits():
    """SIGTERM raises SystemExit while a build runs (main thread only), so its ``finally``
    blocks remove the temporary folder and stop the draft's process."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _exit(signum, frame):
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def call_costs(folder: Path, log) -> dict:
    """``extra["tune"]`` with the per-call costs adaptive k decides with
    (:meth:`specrt.runtime.engine.Engine.adaptive_costs`), measured here once as the Engine
    would at its first adaptive request (5 interleaved repetitions, 256 rows of past; about
    10 s for the real pair on 2 AMD EPYC Zen 3 cores, AVX2): every later start on this kind of machine
    reuses them (:func:`specrt.runtime.costs.recorded_call_costs`)."""
    from specrt.runtime.costs import measure_costs
    from specrt.runtime.engine import Engine
    from specrt.runtime.machine import this_machine

    t0 = time.time()
    eng = Engine(folder, verify_hashes=False, backend="kernels", prefix_cache=False)
    try:
        m = eng.manifest
        costs = measure_costs(eng, range(1, m.k_max + 2), min(256, m.max_ctx - m.k_max - 2), reps=5)
    finally:
        eng.close()
    log(f"  per-call costs for adaptive k measured ({time.time() - t0:.0f} s)")
    return {"costs": {**costs.to_json(), "backend": "kernels"}, "machine": this_machine().to_json(), "source": "measured at build (specrt tune re-measures)"}


def record_call_costs(folder: str | Path, log=print) -> bool:
    """Measure the kernels' per-call costs on ``folder`` (:func:`call_costs`) and record them
    in its manifest (``extra.tune``), as a cached ``serve --target`` folder has them, so the
    first adaptive request does not measure them. Nothing is recorded where the kernels
    library is not built (this machine would not run them).

    Returns:
        whether the costs were recorded.
    """
    from dataclasses import replace

    from specrt.runtime import kernels
    from specrt.runtime.manifest import load_manifest

    why = kernels.status()
    if why is not None:
        log(f"  per-call costs not recorded: {why}")
        return False
    folder = Path(folder)
    m = load_manifest(folder, verify_hashes=False)
    replace(m, extra={**m.extra, "tune": call_costs(folder, log)}).write(folder)
    return True


def _build_into(folder: Path, target, draft, shas: list, max_ctx: int | None, k_max: int, log) -> None:
    """Build in a fresh temporary folder beside ``folder``, check it loads, rename it into
    place (a stale ``folder`` renamed aside first, then removed)."""
    import tempfile
    from dataclasses import replace

    from specrt.runtime.manifest import load_manifest

    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        m = build_engine(target, draft, tmp, max_ctx, k_max, log, cache=folder.parent)
        extra = dict(m.extra)
        extra["gguf"] = {r: {**extra["gguf"][r], "sha256": s} for r, s in zip(("target", "draft"), shas) if r in extra["gguf"]}
        extra["tune"] = call_costs(tmp, log)
        replace(m, name=folder.name, extra=extra).write(tmp)
        load_manifest(tmp, verify_hashes=False)  # the folder as the runtime reads it (its digests were just computed)
        if folder.exists():
            aside = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
            os.rename(folder, aside / "stale")
        os.rename(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        for old in folder.parent.glob(f".{folder.name}.*"):
            shutil.rmtree(old, ignore_errors=True)
