"""specrt's own CPU kernels: exact q-row matmuls over a GGUF's blocks and the decoder step
around them, in C (``runtime/kernels/c/``: its source map is in docs/guide/kernels.md), built by
the package's own build at install (setup.py: gcc, no download) and loaded here with ctypes.

The library has three paths compiled in, chosen at run time by the CPU: AVX-512 VNNI, AVX2
(with FMA and F16C) and portable C. Every path computes each output with the same sequence
of operations, so a row's bits do not depend on the call width, the thread count or the path
(tests/test_kernels.py proves it on every type).

Nothing here raises on a machine without the library: :func:`status` says why it cannot run
(no compiler at install, a library built from other sources, an unknown CPU) and the runtime
keeps the onnxruntime graph with a one-line note.
"""

from __future__ import annotations

import ctypes
import hashlib
import threading
from ctypes import POINTER, c_float, c_int, c_int32, c_void_p
from pathlib import Path

import numpy as np

__all__ = [
    "ABI",
    "ISAS",
    "SkMat",
    "SkLayer",
    "SkModel",
    "SkKv",
    "SkTypeDesc",
    "MAX_THREADS",
    "c_types",
    "library",
    "status",
    "cpu_isa",
    "isa_id",
    "start_team",
    "source_hash",
    "argmax",
    "penalty_pointers",
    "check_rc",
]

ABI = 7  # sk.h's SK_ABI: the structs below and the entry points bound in _load
ISAS = ("portable", "avx2", "avx512vnni")  # ids 0, 1, 2 (sk.h; the library's sk_isa_name agrees: tests)
MAX_THREADS = 64  # sk.h's SK_MAX_THREADS: the most threads of the team (the library's sk_max_threads agrees)
HERE = Path(__file__).resolve().parent
CSRC = HERE / "c"  # the C sources (setup.py builds them)
LIBRARY_ENV = "SPECRT_KERNELS_LIB"  # path of a library to load instead of the built one (the sanitizer build)
_ERRORS = {
    -1: "the requested ISA path is not supported by this CPU",
    -2: "bad arguments (width, start, shapes or buffers)",
    -3: "a token id outside the vocabulary",
    -4: "out of memory",
    -5: "could not start the thread team",
    -6: "the model's shapes do not agree with its dims or its scratch",
}


class SkMat(ctypes.Structure):
    """sk.h ``sk_mat``: one panel matrix (type, n outputs, k inputs, panel bytes)."""

    _fields_ = [("type", c_int32), ("n", c_int32), ("k", c_int32), ("pad", c_int32), ("w", c_void_p)]


class SkLayer(ctypes.Structure):
    """sk.h ``sk_layer``: a decoder layer's seven matrices, norms, optional biases, optional
    per-head q/k norms (qwen3, gemma3), optional post-attention / post-FFN norms (gemma2/3), its
    own RoPE tables or NULL, and its sliding window (positions; 0: none)."""

    _fields_ = (
        [(n, SkMat) for n in ("wq", "wk", "wv", "wo", "wgate", "wup", "wdown")]
        + [(n, c_void_p) for n in ("attn_norm", "ffn_norm", "bq", "bk", "bv", "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm", "rope_cos", "rope_sin")]
        + [("swa", c_int32), ("pad", c_int32)]
    )


class SkModel(ctypes.Structure):
    """sk.h ``sk_model``: dims, the FFN's activation (0 SwiGLU, 1 GeGLU), the attention scale,
    embedding scale and soft-caps (0: none), RoPE tables, output norm, embedding and head, layers."""

    _fields_ = (
        [(n, c_int32) for n in ("n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_ff", "n_vocab", "max_ctx", "rope_neox", "max_q", "ffn_act", "pad1")]
        + [(n, c_float) for n in ("norm_eps", "attn_scale", "emb_scale", "attn_softcap", "final_softcap", "pad2")]
        + [
            ("rope_cos", c_void_p),
            ("rope_sin", c_void_p),
            ("out_norm", c_void_p),
            ("tok_embd", SkMat),
            ("output", SkMat),
            ("layers", POINTER(SkLayer)),
        ]
    )


class SkTypeDesc(ctypes.Structure):
    """sk.h ``sk_type_desc``: one row of the C block-type table (``sk_type_describe``)."""

    _fields_ = [(n, c_int32) for n in ("ggml_type", "block", "gguf_bytes", "panel_bytes", "act", "isa_mask")] + [("name", ctypes.c_char * 16)]


class SkKv(ctypes.Structure):
    """sk.h ``sk_kv``: the f16 K tiles and V rows of one sequence."""

    _fields_ = [("k", c_void_p), ("v", c_void_p)]


def source_hash(folder: Path = CSRC) -> str | None:
    """SHA-256 (hex, 16 digits) of the C sources (every ``*.c`` and ``*.h``, by name) in
    ``folder``, as setup.py stamps them into the library; None when there are none (a wheel
    without its sources)."""
    files = sorted(p for p in folder.glob("*") if p.suffix in (".c", ".h")) if folder.is_dir() else []
    if not files:
        return None
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


_lock = threading.Lock()
_state: dict = {}


def _find() -> Path | None:
    """The library to load: ``$SPECRT_KERNELS_LIB`` when set, else this interpreter's build
    (``_sk`` with this interpreter's extension suffix), else any ``_sk*`` build here."""
    import importlib.machinery
    import os

    if os.environ.get(LIBRARY_ENV):
        return Path(os.environ[LIBRARY_ENV])
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if (HERE / f"_sk{suffix}").is_file():
            return HERE / f"_sk{suffix}"
    found = sorted(HERE.glob("_sk*.so")) + sorted(HERE.glob("_sk*.pyd"))
    return found[0] if found else None


def _load() -> tuple[ctypes.CDLL | None, str | None]:
    path = _find()
    if path is None:
        return None, "specrt's kernels were not built at install (no C compiler then?); reinstall with gcc present (make install)"
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return None, f"specrt's kernel library {path.name} does not load: {e}"
    if lib.sk_abi() != ABI:
        return None, f"specrt's kernel library {path.name} has ABI {lib.sk_abi()}, this runtime needs {ABI}: rebuild it (make install)"
    lib.sk_sources.restype = ctypes.c_char_p
    stamp, now = lib.sk_sources().decode(), source_hash()
    if now is not None and stamp != now:
        return None, f"specrt's kernel library {path.name} was built from other sources than runtime/kernels/ holds now: rebuild it (make install)"
    lib.sk_cpu_isa.restype = c_int
    lib.sk_team_start.argtypes = [c_int, c_int]
    lib.sk_scratch_new.restype = c_void_p
    lib.sk_scratch_new.argtypes = [c_int] * 6
    lib.sk_scratch_free.argtypes = [c_void_p]
    lib.sk_matmul.argtypes = [c_int, POINTER(SkMat), c_void_p, c_int, c_void_p, c_void_p]
    lib.sk_dequant.argtypes = [POINTER(SkMat), c_int, c_int, c_void_p]
    lib.sk_scratch_attention.argtypes = [c_void_p, c_int, c_int, c_void_p]
    lib.sk_step.argtypes = [c_int, POINTER(SkModel), POINTER(SkKv), c_void_p, c_void_p, c_int, c_int, c_void_p, c_int, c_int]
    lib.sk_step_rows.argtypes = [c_int, POINTER(SkModel), c_void_p, c_void_p, c_void_p, c_void_p, c_int, c_void_p, c_int, c_int]
    lib.sk_argmax.argtypes = [c_int, c_void_p, c_int, c_int, c_int, c_float, c_void_p, c_void_p, c_void_p, c_void_p]
    lib.sk_step_argmax.argtypes = [
        c_int,
        POINTER(SkModel),
        POINTER(SkKv),
        c_void_p,
        c_void_p,
        c_int,
        c_int,
        c_void_p,
        c_void_p,
        c_int,
        c_float,
        c_int,
        c_void_p,
    ]
    lib.sk_type_describe.argtypes = [c_int, POINTER(SkTypeDesc)]
    lib.sk_isa_name.restype = ctypes.c_char_p
    lib.sk_isa_name.argtypes = [c_int]
    return lib, None


def library() -> ctypes.CDLL | None:
    """The loaded kernel library (once per process), or None when it cannot run here
    (:func:`status` says why)."""
    with _lock:
        if "lib" not in _state:
            _state["lib"], _state["why"] = _load()
        return _state["lib"]


def status() -> str | None:
    """None when the kernels can run on this machine, else why not (one line)."""
    library()
    return _state["why"]


def cpu_isa() -> str:
    """The fastest path this CPU runs (:data:`ISAS`); ``portable`` without the library."""
    lib = library()
    return ISAS[lib.sk_cpu_isa()] if lib is not None else "portable"


def isa_id(name: str) -> int:
    """The id of an ISA path name.

    Raises:
        ValueError: not one of :data:`ISAS`, or a path this CPU cannot run.
    """
    if name not in ISAS:
        raise ValueError(f"kernel ISA {name!r}; choose one of {', '.join(ISAS)}")
    if ISAS.index(name) > ISAS.index(cpu_isa()):
        raise ValueError(f"kernel ISA {name!r} does not run on this CPU (its best: {cpu_isa()})")
    return ISAS.index(name)


def start_team(threads: int, spin_us: int = 200) -> None:
    """(Re)start the kernels' thread team: ``threads`` in all, the calling thread included;
    an idle worker spins ``spin_us`` microseconds before it sleeps.

    Raises:
        RuntimeError: no library, or the threads could not be started.
    """
    lib = library()
    if lib is None:
        raise RuntimeError(status())
    with _lock:
        if _state.get("team") == (threads, spin_us):
            return
        check_rc(lib.sk_team_start(threads, spin_us), "sk_team_start")
        _state["team"] = (threads, spin_us)


def c_types() -> dict[int, dict]:
    """The C block-type table as the library describes it (``sk_type_describe``): ggml type id
    -> ``{"name", "block", "gguf_bytes", "panel_bytes", "act" ("q8_k" | "q8_0" | "f32"), "isas"
    (names of the paths with a kernel)}`` (tests check :data:`.panels.TABLE` against it).

    Raises:
        RuntimeError: no library.
    """
    lib = library()
    if lib is None:
        raise RuntimeError(status())
    out, d = {}, SkTypeDesc()
    for t in range(64):
        if lib.sk_type_describe(t, ctypes.byref(d)) == 0:
            isas = tuple(ISAS[i] for i in range(len(ISAS)) if d.isa_mask >> i & 1)
            act = {1: "q8_k", 2: "q8_0", 4: "f32"}.get(d.act, f"unknown {d.act}")
            out[t] = {"name": d.name.decode(), "block": d.block, "gguf_bytes": d.gguf_bytes, "panel_bytes": d.panel_bytes, "act": act, "isas": isas}
    return out


def check_rc(rc: int, what: str) -> None:
    """Raise for a non-zero return code of the library.

    Raises:
        RuntimeError: ``what`` failed, with the reason.
    """
    if rc != 0:
        raise RuntimeError(f"{what}: {_ERRORS.get(rc, f'error {rc}')}")


def mat(ggml_type: int, n: int, k: int, panels: np.ndarray) -> SkMat:
    """An :class:`SkMat` over ``panels`` (uint8, kept alive by the caller).

    Raises:
        ValueError: a type or shape the kernels do not run, or panels that are not a
            contiguous uint8 array of at least the bytes ``[n, k]`` takes.
    """
    from .panels import panel_bytes, supported

    why = supported(ggml_type, n, k)
    if why:
        raise ValueError(why)
    if not isinstance(panels, np.ndarray) or panels.dtype != np.uint8 or not panels.flags.c_contiguous:
        raise ValueError("panels must be a contiguous uint8 array (panels.pack's output)")
    if panels.nbytes < panel_bytes(ggml_type, n, k):
        raise ValueError(f"panels hold {panels.nbytes} bytes; a [{n}, {k}] matrix of type {ggml_type} takes {panel_bytes(ggml_type, n, k)}")
    return SkMat(ggml_type, n, k, 0, panels.ctypes.data)


def matmul(ggml_type: int, n: int, k: int, panels: np.ndarray, x: np.ndarray, isa: str | None = None, threads: int | None = None) -> np.ndarray:
    """``y [q, n]`` = the kernels' product of float rows ``x [q, k]`` with a panel matrix,
    activations quantized as a decoder step quantizes them (tests and benchmarks).

    Args:
        isa: the path (default the CPU's best); threads: restart the team with this many.

    Raises:
        RuntimeError: no library; ValueError: a bad ISA name.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != k or x.shape[0] < 1:
        raise ValueError(f"x is {list(x.shape)}; the matrix takes rows of {k}")
    q = x.shape[0]
    y = np.empty((q, n), np.float32)
    m = mat(ggml_type, n, k, panels)
    _scratch_call("sk_matmul", threads, q, k, lambda lib, s: lib.sk_matmul(isa_id(isa or cpu_isa()), ctypes.byref(m), x.ctypes.data, q, y.ctypes.data, s))
    return y


def _scratch_call(what: str, threads: int | None, q: int, k: int, call) -> None:
    """``call(lib, scratch)`` (returning the library's code) with a scratch of ``q`` rows of
    width ``k`` made and freed around it; the team restarted with ``threads`` first when given.

    Raises:
        RuntimeError: no library, or ``what`` failed.
    """
    lib = library()
    if lib is None:
        raise RuntimeError(status())
    if threads is not None:
        start_team(threads)
    s = lib.sk_scratch_new(q, k, 0, 0, 0, 0)
    try:
        check_rc(call(lib, s), what)
    finally:
        lib.sk_scratch_free(s)


def penalty_pointers(pens, n: int, out: np.ndarray | None = None) -> np.ndarray | None:
    """The ``pens`` argument of ``sk_step_argmax`` / ``sk_argmax``: one pointer per head row.

    Args:
        pens: a sequence (one entry per reduced row) of None (no penalty) or a C-contiguous
            float32 row of at least ``n`` entries, or None (no row has one).
        n: the ids that compete (the call's ``n_valid``).
        out: uint64 buffer of at least ``len(pens)`` entries to fill (else a new one).

    Returns:
        uint64 array of addresses (0 = none), or None when ``pens`` is None. The rows must
        stay alive until the call returns.

    Raises:
        ValueError: a row not float32, not contiguous, or shorter than ``n``.
    """
    if pens is None:
        return None
    ptrs = np.zeros(len(pens), np.uint64) if out is None else out
    for r, p in enumerate(pens):
        if p is None:
            ptrs[r] = 0
            continue
        if p.dtype != np.float32 or not p.flags.c_contiguous or p.ndim != 1 or len(p) < n:
            raise ValueError(f"penalty row {r}: {p.dtype} {list(p.shape)}; need a contiguous float32 row of at least {n} entries")
        ptrs[r] = p.ctypes.data
    return ptrs


def argmax(x: np.ndarray, isa: str | None = None, threads: int | None = None, inv_temp: float = 0.0, pens=None) -> tuple[np.ndarray, np.ndarray]:
    """Each row's first maximum of float rows ``x [q, n]`` by the reduced head's own code (its
    chunks, scan, sums and merge: ``sk_step_argmax`` on rows the caller chooses; tests).
    ``pens``: per row None or a float32 penalty row added first (:func:`penalty_pointers`).

    Returns:
        ``(ids int32 [q], vals float32 [q])``: ``np.argmax`` of each row (NaN ranks highest,
        the first NaN wins; among equal maxima the lowest id) and the value there, or with
        ``inv_temp > 0`` its softmax probability ``softmax(x * inv_temp)[id]`` (NaN where the
        maximum is not finite).

    Raises:
        RuntimeError: no library; ValueError: a bad ISA name, or x not 2-D.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or min(x.shape) < 1:
        raise ValueError(f"x is {list(x.shape)}; need [q, n] rows")
    q, n = x.shape
    ids, vals = np.empty(q, np.int32), np.empty(q, np.float32)
    if pens is not None and len(pens) != q:
        raise ValueError(f"pens has {len(pens)} entries for {q} rows; give one (None or a row) per row")
    ptrs = penalty_pointers(pens, n)
    pp = None if ptrs is None else ptrs.ctypes.data
    _scratch_call(
        "sk_argmax",
        threads,
        q,
        32,
        lambda lib, s: lib.sk_argmax(isa_id(isa or cpu_isa()), x.ctypes.data, q, n, n, inv_temp, ids.ctypes.data, vals.ctypes.data, s, pp),
    )
    return ids, vals


def dequant(ggml_type: int, n: int, k: int, panels: np.ndarray, n0: int = 0, n1: int | None = None) -> np.ndarray:
    """Rows ``[n0, n1)`` of a panel matrix as float32 ``[n1 - n0, k]``, read from the panels
    by the C code the kernels use (the export's exactness check against ``gguf.dequantize``).

    Raises:
        RuntimeError: no library. ValueError: bad rows or panels (:func:`mat`).
    """
    lib = library()
    if lib is None:
        raise RuntimeError(status())
    n1 = n if n1 is None else n1
    if not 0 <= n0 <= n1 <= n:
        raise ValueError(f"rows {n0}..{n1} of {n}")
    m = mat(ggml_type, n, k, panels)
    out = np.empty((n1 - n0, k), np.float32)
    check_rc(lib.sk_dequant(ctypes.byref(m), n0, n1, out.ctypes.data), "sk_dequant")
    return out
