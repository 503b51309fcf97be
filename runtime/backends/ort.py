"""onnxruntime backend: one exported model, its KV buffers preallocated once and bound in place.

For a call with q new tokens after L committed rows, the binding is::

    past_key_i / past_value_i  -> buffer_i[0:L]      (read, no copy)
    new_key_i  / new_value_i   -> buffer_i[L:L+q]    (written by onnxruntime in place)
    position_ids               -> positions[L:L+q]   (a slice of a preallocated arange)
    logits                     -> logits_buf[0:q]    (preallocated)

so no KV data is copied on any step, and rolling back is only a smaller L on the next
call: rows at and beyond L are never read. Binding a pointer costs a few microseconds;
shapes change every step (L grows), so the binding is refreshed per call, nothing else.

:class:`OrtHeadSplit` runs the target's lazy-head split (body graph, then the vocabulary
projection on the rows asked for) over the *same* KV buffers, bound the same way.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..errors import EngineError, InputError
from ..manifest import LAZY_HEAD_HINT, Manifest, ModelEntry, lazy_head_files
from .base import ThreadConfig
from .kv_layout import check_call, host_zeros, release_bytes, release_tail_rows

__all__ = [
    "OrtModel",
    "OrtHeadSplit",
    "SharedHeadSessions",
    "cpu_session",
    "session_options",
    "check_graph",
    "graph_shapes",
    "head_shapes",
    "available_providers",
]


def available_providers() -> list[str]:
    """onnxruntime execution providers present in this installation."""
    import onnxruntime as ort

    return list(ort.get_available_providers())


def _raw_binding(session, binding):
    """(bind_input, bind_output, run) closures for CPU pointers.

    Uses onnxruntime's pybind objects directly when present (the public wrappers build a
    device object per call: about 8% of a draft step measured with cProfile on a 2-layer
    draft), else the public API.
    """
    try:
        from onnxruntime.capi.onnxruntime_inference_collection import OrtDevice

        dev = OrtDevice.make("cpu", 0)._get_c_device()
        raw, sess = binding._iobinding, session._sess
        raw_in, raw_out, raw_run = raw.bind_input, raw.bind_output, sess.run_with_iobinding

        def bind_in(name, dtype, shape, ptr):
            raw_in(name, dev, dtype, shape, ptr)

        def bind_out(name, dtype, shape, ptr):
            raw_out(name, dev, dtype, shape, ptr)

        def run():
            raw_run(raw, None)

        return bind_in, bind_out, run
    except (ImportError, AttributeError):  # pragma: no cover - other onnxruntime versions

        def bind_in(name, dtype, shape, ptr):
            binding.bind_input(name, "cpu", 0, dtype, shape, ptr)

        def bind_out(name, dtype, shape, ptr):
            binding.bind_output(name, "cpu", 0, dtype, shape, ptr)

        def run():
            session.run_with_iobinding(binding)

        return bind_in, bind_out, run


def graph_shapes(entry: ModelEntry, body: bool = False) -> dict[str, tuple[str, tuple]]:
    """What the manifest implies for a model's ONNX inputs and outputs: name -> (element
    type, dims), each dim None (any size), an int, or ``(manifest field, size)`` (see
    :func:`check_graph`). ``body``: the lazy-head body graph (``hidden`` in place of
    ``logits``).

    Shapes: ``input_ids``/``position_ids`` int64 ``[1, q]``; ``past_*``/``new_*`` float32
    ``[1, L or q, n_kv_heads, head_dim]``; ``logits`` float32 ``[1, q, vocab_size]``
    (``hidden`` float32 ``[1, q, hidden]`` for the body).
    """
    kv = ("tensor(float)", (1, None, ("n_kv_heads", entry.n_kv_heads), ("head_dim", entry.head_dim)))
    s = {"input_ids": ("tensor(int64)", (1, None)), "position_ids": ("tensor(int64)", (1, None))}
    if body:
        s["hidden"] = ("tensor(float)", (1, None, ("hidden", entry.hidden)))
    else:
        s["logits"] = ("tensor(float)", (1, None, ("vocab_size", entry.vocab_size)))
    for i in range(entry.n_layers):
        for name in (f"past_key_{i}", f"past_value_{i}", f"new_key_{i}", f"new_value_{i}"):
            s[name] = kv
    return s


def head_shapes(entry: ModelEntry) -> dict[str, tuple[str, tuple]]:
    """:func:`graph_shapes` of the lazy-head head graph: ``hidden`` float32 ``[1, r, hidden]``
    -> ``logits`` float32 ``[1, r, vocab_size]``."""
    return {"hidden": ("tensor(float)", (1, None, ("hidden", entry.hidden))), "logits": ("tensor(float)", (1, None, ("vocab_size", entry.vocab_size)))}


def check_graph(path: Path, session, shapes: dict[str, tuple[str, tuple]], role: str) -> None:
    """Check a session's inputs and outputs against what the manifest implies.

    Args:
        path: the graph (for messages). session: an ``onnxruntime.InferenceSession``.
        shapes: name -> (element type, dims) as :func:`graph_shapes` gives: a dim is None
            (any size), an int (that size), or ``(field, size)`` (that size, named after
            the manifest field it comes from). A graph dim given as a name (dynamic) is
            accepted for any expected size.
        role: ``draft``/``target`` (the manifest entry named in messages).

    Raises:
        EngineError: a rank, a fixed dim or an element type that differs: one line naming
            the tensor, the graph's shape and the manifest field it disagrees with.
    """
    for arg in (*session.get_inputs(), *session.get_outputs()):
        if arg.name not in shapes:
            continue
        want_type, want = shapes[arg.name]
        got = list(arg.shape)
        if arg.type != want_type:
            raise EngineError(f"{path}: {arg.name} is {arg.type} in the graph; the runtime binds {want_type} (re-export the engine)")
        shown = [w if not isinstance(w, tuple) else w[1] for w in want]
        if len(got) != len(want):
            raise EngineError(f"{path}: {arg.name} has shape {got} in the graph, the manifest implies {_dims(shown)} (re-export the engine)")
        for g, w in zip(got, want):
            size, field = (w[1], w[0]) if isinstance(w, tuple) else (w, None)
            if isinstance(g, int) and size is not None and g != size:
                why = f"{role}.{field}={size}" if field else f"size {size}"
                raise EngineError(
                    f"{path}: {arg.name} has shape {got} in the graph, but the manifest's {why} implies {_dims(shown)}; the manifest does not describe this graph"
                )


def _dims(dims) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


def session_options(threads: ThreadConfig):
    """The project's onnxruntime CPU session settings: ``threads.intra_op`` intra-op threads,
    one inter-op thread, sequential execution, every graph optimization, spinning as
    ``threads.spinning``, warnings off. Returns ``onnxruntime.SessionOptions``."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads.intra_op
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if threads.spinning else "0")
    so.log_severity_level = 3
    return so


def cpu_session(path: Path, threads: ThreadConfig, inputs: Sequence[str], outputs: Sequence[str], shapes: dict | None = None, role: str = "model"):
    """An onnxruntime CPU session with the project's settings, its I/O names checked.

    Args:
        path: the ONNX file.
        threads: :class:`ThreadConfig` (intra-op threads, spinning).
        inputs, outputs: the I/O names the manifest records (order free).
        shapes: expected element types and dims (:func:`graph_shapes`), checked with
            :func:`check_graph` when given; role: the manifest entry, for its messages.

    Returns:
        ``onnxruntime.InferenceSession``.

    Raises:
        EngineError: onnxruntime cannot load the file, its I/O names differ, or a shape
            or type disagrees with the manifest.
    """
    import onnxruntime as ort

    so = session_options(threads)
    try:
        session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own exception types
        raise EngineError(f"{path}: onnxruntime cannot load this model ({type(e).__name__}: {str(e)[:300]})") from None
    got_in = tuple(i.name for i in session.get_inputs())
    got_out = tuple(o.name for o in session.get_outputs())
    if set(got_in) != set(inputs) or set(got_out) != set(outputs):
        raise EngineError(f"{path}: I/O names {got_in} -> {got_out} differ from the manifest's {tuple(inputs)} -> {tuple(outputs)}")
    if shapes is not None:
        check_graph(path, session, shapes, role)
    return session


def _bind_step(bind_in, bind_out, kv, kv_dims, row_bytes: int, ids_ptr: int, pos_ptr: int, q: int, start: int) -> None:
    """Bind one call's inputs and KV in place (shared by :class:`OrtModel` and :class:`OrtHeadSplit`).

    ``input_ids`` [1, q] from ``ids_ptr``; ``position_ids`` [1, q] from row ``start`` of the
    int64 positions buffer at ``pos_ptr``; per layer, ``past_*`` [1, start, h, d] at the
    buffer base (rows [0, start)) and ``new_*`` [1, q, h, d] at base + start * ``row_bytes``
    (rows [start, start+q)), float32. ``kv`` holds (past name, new name, buffer base)
    triples, ``kv_dims`` (h, d). The caller binds its own output (logits or hidden).
    """
    h, d = kv_dims
    bind_in("input_ids", np.int64, [1, q], ids_ptr)
    bind_in("position_ids", np.int64, [1, q], pos_ptr + 8 * start)
    past_shape = [1, start, h, d]
    new_shape = [1, q, h, d]
    off = start * row_bytes
    for past_name, new_name, base in kv:
        bind_in(past_name, np.float32, past_shape, base)
        bind_out(new_name, np.float32, new_shape, base + off)


class SharedHeadSessions:
    """The lazy-head (body, head) sessions of one engine folder: loaded on first use, once,
    and shared by every fork of the target (thread-safe).

    Args:
        folder: the engine folder; manifest: its manifest; threads: session settings;
        verify_hashes: check the graphs' SHA-256 when loading.
    """

    __slots__ = ("_load", "_lock", "_sessions")

    def __init__(self, folder: Path, manifest: Manifest, threads: ThreadConfig, verify_hashes: bool = True):
        self._load: Callable[[], tuple] = lambda: lazy_head_sessions(folder, manifest, threads, verify_hashes)
        self._lock, self._sessions = threading.Lock(), None

    def get(self) -> tuple:
        """``(body, head)`` onnxruntime sessions.

        Raises:
            EngineError: the folder has no lazy-head graphs, or they are missing or altered.
        """
        with self._lock:
            if self._sessions is None:
                self._sessions = self._load()
            return self._sessions


class OrtModel:
    """One exported model on onnxruntime with in-place KV (see module docstring); implements
    :class:`~specrt.runtime.backends.base.Model` and, for the target,
    :class:`~specrt.runtime.backends.base.SplitsHead`.

    Args:
        path: the ONNX file.
        entry: its manifest entry (dims and I/O names).
        max_ctx: KV buffer rows; positions 0..max_ctx-1.
        max_q: widest call (tokens per run); sizes the ``input_ids`` and logits buffers.
        threads: :class:`~specrt.runtime.backends.base.ThreadConfig`.
        head_sessions: the folder's :class:`SharedHeadSessions` (target only), None when
            this model offers no body/head split.
        role: ``"draft"`` or ``"target"``: the manifest entry named in error messages.

    Buffers (all allocated here, once): per layer key and value float32
    ``[1, max_ctx, n_kv_heads, head_dim]``; ``logits`` float32 ``[1, max_q, vocab]``.

    Raises:
        EngineError: the ONNX file cannot be loaded, or its I/O names, KV dims or logits
            width differ from the manifest (:func:`check_graph`).
    """

    def __init__(
        self,
        path: Path,
        entry: ModelEntry,
        max_ctx: int,
        max_q: int,
        threads: ThreadConfig = ThreadConfig(),
        head_sessions: SharedHeadSessions | None = None,
        role: str = "model",
    ):
        self.session = cpu_session(path, threads, entry.inputs, entry.outputs, graph_shapes(entry), role)
        self._head_sessions = head_sessions
        self._allocate(entry, max_ctx, max_q)

    def fork(self) -> "OrtModel":
        """A model over the same onnxruntime session (weights loaded once) with its own KV,
        ids, positions and logits buffers and its own I/O binding, so that two threads can
        run the two objects at once (onnxruntime's ``Run`` is thread-safe across
        bindings). Costs the buffers: ``2 * n_layers * max_ctx * n_kv_heads * head_dim * 4``
        bytes of KV plus ``max_q * vocab * 4`` of logits.
        """
        new = object.__new__(type(self))
        new.session = self.session
        new._head_sessions = self._head_sessions
        new._allocate(self.entry, self.max_ctx, self.max_q)
        return new

    def split_head(self) -> "OrtHeadSplit":
        """This model's body/head split over its own KV buffers, made on first use (the
        sessions are loaded once per folder and shared by forks).

        Raises:
            EngineError: no lazy-head graphs in the folder, or altered ones.
        """
        if self._split is None:
            if self._head_sessions is None:
                raise EngineError(LAZY_HEAD_HINT.format(folder="the engine folder"))
            body, head = self._head_sessions.get()
            self._split = OrtHeadSplit(body, head, self, self.entry.hidden)
        return self._split

    def close(self) -> None:
        """Drop the buffers and the binding (the shared session is freed with its last user)."""
        self.keys = self.values = []
        self._kv = []
        self._binding = self._split = None

    def _allocate(self, entry: ModelEntry, max_ctx: int, max_q: int) -> None:
        """Buffers and binding of one model object (see the class docstring)."""
        self.entry = entry
        self.max_ctx = max_ctx
        self.max_q = max_q
        self.vocab = entry.vocab_size
        shape = (1, max_ctx, entry.n_kv_heads, entry.head_dim)
        self.keys = [host_zeros(shape) for _ in range(entry.n_layers)]
        self.values = [host_zeros(shape) for _ in range(entry.n_layers)]
        self.row_bytes = entry.n_kv_heads * entry.head_dim * 4
        self.ids = np.zeros((1, max_q), np.int64)
        self.positions = np.arange(max_ctx, dtype=np.int64)[None, :]
        self.logits = host_zeros((1, max_q, self.vocab))  # pages resident once written: release_logits
        self._binding = self.session.io_binding()
        self._bind_in, self._bind_out, self._run = _raw_binding(self.session, self._binding)
        # (input name, output name, buffer base pointer) per KV tensor, computed once
        self._kv = []
        for i in range(entry.n_layers):
            self._kv.append((f"past_key_{i}", f"new_key_{i}", self.keys[i].ctypes.data))
            self._kv.append((f"past_value_{i}", f"new_value_{i}", self.values[i].ctypes.data))
        self._kv_dims = (entry.n_kv_heads, entry.head_dim)
        self._ids_ptr = self.ids.ctypes.data
        self._pos_ptr = self.positions.ctypes.data
        self._logits_ptr = self.logits.ctypes.data
        self._split: OrtHeadSplit | None = None

    def run(self, tokens: Sequence[int] | np.ndarray, start: int) -> np.ndarray:
        """Run ``q = len(tokens)`` new tokens at positions ``start .. start+q-1``.

        Reads KV rows [0, start) and writes rows [start, start+q) of every layer in place.

        Args:
            tokens: q token ids (list or int array), 1 <= q <= max_q.
            start: committed KV length L; 0 <= start and start + q <= max_ctx.

        Returns:
            float32 view ``[q, vocab]`` of the preallocated logits buffer (valid until the
            next call; copy it to keep it).

        Raises:
            InputError: q or start outside the buffers.
        """
        q = len(tokens)
        check_call(q, start, self.max_q, self.max_ctx)
        self.ids[0, :q] = tokens
        _bind_step(self._bind_in, self._bind_out, self._kv, self._kv_dims, self.row_bytes, self._ids_ptr, self._pos_ptr, q, start)
        self._bind_out("logits", np.float32, [1, q, self.vocab], self._logits_ptr)
        self._run()
        return self.logits[0, :q]

    def release_logits(self, start: int = 0) -> int:
        """Give logits rows ``[start, max_q)`` back to the OS (whole pages,
        :func:`~specrt.runtime.backends.kv_layout.release_tail_rows`): only a wide call (a
        prefill chunk) writes them, and a ``max_q x vocab`` float32 buffer is 148 MiB for a
        152k vocabulary, resident from the first wide call on otherwise. Once the last call's
        rows have been read (:class:`~specrt.runtime.backends.base.Model`); they read zeros
        afterwards, on Linux, until next written. Returns bytes released."""
        return release_tail_rows(self.logits, start)

    def release_rows(self, start: int) -> int:
        """Give KV rows ``[start, max_ctx)`` of every layer back to the OS (whole pages:
        :func:`~specrt.runtime.backends.kv_layout.release_bytes`); on Linux they read as zeros
        until next written. For rows nothing will read again (past a kept prefix record). Returns bytes
        released."""
        span = [(max(0, start) * self.row_bytes, self.max_ctx * self.row_bytes)]
        return sum(release_bytes(b, span) for b in (*self.keys, *self.values))

    def output_pointers(self) -> dict[str, int]:
        """Data pointers of the outputs of the last call (tests check they are the buffers')."""
        names = [new for _, new, _ in self._kv] + ["logits"]  # the order run() binds them in
        return {n: v.data_ptr() for n, v in zip(names, self._binding.get_outputs())}


def lazy_head_sessions(folder: Path, manifest: Manifest, threads: ThreadConfig, verify_hashes: bool = True) -> tuple:
    """``(body, head)`` onnxruntime CPU sessions of an engine folder's lazy-head target.

    Raises:
        EngineError: the folder was exported without them (the message says how to
            re-export), a file is missing or altered, or it cannot be loaded
            (:func:`~specrt.runtime.manifest.lazy_head_files`, :func:`cpu_session`).
    """
    body, head = lazy_head_files(manifest, folder, verify_hashes)
    t = manifest.target
    return (
        cpu_session(Path(folder) / body["file"], threads, body["inputs"], body["outputs"], graph_shapes(t, body=True), "target"),
        cpu_session(Path(folder) / head["file"], threads, head["inputs"], head["outputs"], head_shapes(t), "target"),
    )


class OrtHeadSplit:
    """The target split at its vocabulary projection (``lazy-head`` verification), on the
    KV buffers of the target's :class:`OrtModel`.

    :meth:`body` runs the body graph exactly as :meth:`OrtModel.run` runs the full one
    (same in-place binding of the *same* KV buffers, so full, chunked and lazy-head calls
    can follow each other on one Engine) and leaves the final-norm hidden states in a
    preallocated buffer; :meth:`head` projects a block of those rows to logits, into a
    preallocated logits buffer at the same row offsets, so the rows a verification never
    reads are never projected.

    Args:
        body_session, head_session: from :class:`SharedHeadSessions` (shareable by forks).
        target: the target model whose KV buffers, positions and ``max_q`` it uses.
        hidden: width of ``hidden`` (the target's ``hidden``).

    Buffers (allocated here, once): ids int64 ``[1, max_q]``, hidden float32
    ``[1, max_q, hidden]``, logits float32 ``[1, max_q, vocab]``.
    """

    def __init__(self, body_session, head_session, target: OrtModel, hidden: int):
        self.body_session, self.head_session, self.target = body_session, head_session, target
        self.max_q, self.vocab, self.hidden = target.max_q, target.vocab, hidden
        self.ids = np.zeros((1, self.max_q), np.int64)
        self.hidden_states = np.zeros((1, self.max_q, hidden), np.float32)
        self.logits = np.zeros((1, self.max_q, self.vocab), np.float32)
        self._body_binding = body_session.io_binding()
        self._head_binding = head_session.io_binding()
        self._bind_in, self._bind_out, self._run_body = _raw_binding(body_session, self._body_binding)
        self._head_in, self._head_out, self._run_head = _raw_binding(head_session, self._head_binding)
        self._kv = target._kv  # the target's (past name, new name, buffer base) triples: same buffers
        self._ids_ptr = self.ids.ctypes.data
        self._hidden_ptr = self.hidden_states.ctypes.data
        self._logits_ptr = self.logits.ctypes.data
        self._hidden_row, self._logits_row = 4 * hidden, 4 * self.vocab

    def body(self, tokens: Sequence[int] | np.ndarray, start: int) -> None:
        """Run the body over ``q = len(tokens)`` tokens at positions ``start .. start+q-1``:
        reads the target's KV rows [0, start), writes rows [start, start+q) in place, and
        the q hidden rows into rows [0, q) of the hidden buffer.

        Raises:
            InputError: q or start outside the buffers.
        """
        t = self.target
        q = len(tokens)
        check_call(q, start, self.max_q, t.max_ctx)
        self.ids[0, :q] = tokens
        _bind_step(self._bind_in, self._bind_out, self._kv, t._kv_dims, t.row_bytes, self._ids_ptr, t._pos_ptr, q, start)
        self._bind_out("hidden", np.float32, [1, q, self.hidden], self._hidden_ptr)
        self._run_body()

    def head(self, lo: int, r: int) -> np.ndarray:
        """Project hidden rows [lo, lo+r) of the last :meth:`body` call to logits.

        Args:
            lo: first row (0 <= lo), r: rows (>= 1), lo + r <= the body call's q.

        Returns:
            float32 view ``[r, vocab]`` of rows [lo, lo+r) of the preallocated logits
            buffer (valid until the next call).

        Raises:
            InputError: rows outside the buffers (0 <= lo, 1 <= r, lo + r <= max_q).
        """
        if lo < 0 or r < 1 or lo + r > self.max_q:
            raise InputError(f"head call for rows [{lo}, {lo + r}): allowed 0 <= lo, r >= 1, lo + r <= max_q={self.max_q}")
        self._head_in("hidden", np.float32, [1, r, self.hidden], self._hidden_ptr + lo * self._hidden_row)
        self._head_out("logits", np.float32, [1, r, self.vocab], self._logits_ptr + lo * self._logits_row)
        self._run_head()
        return self.logits[0, lo : lo + r]

    def output_pointers(self) -> dict[str, int]:
        """Data pointers of the body's outputs in its last call (tests check they are the target's KV buffers)."""
        names = [new for _, new, _ in self._kv] + ["hidden"]
        return {n: v.data_ptr() for n, v in zip(names, self._body_binding.get_outputs())}
