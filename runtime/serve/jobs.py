"""The job contract between the HTTP side and whatever generates: :class:`Job` (one
generation and the events it emits), the :class:`Pool` protocol every generator pool
implements, the errors, and :class:`WorkerPool` (N threads, each owning an Engine).

Events a job emits, in order (``Job.emit``, thread-safe): ``("prompt", entries | None)``
(with ``echo`` and ``stream``, first), ``("text", (piece, new logprob entries | None))``
(``stream`` only, one per released piece), then exactly one of ``("done",
GenerationResult)``, ``("cancelled", None)``, ``("error", Exception)``. The helpers below
(:func:`run_prompt`, :func:`send_text`, :func:`finish`) are the one implementation of that
contract, used by :class:`WorkerPool` and by the batch scheduler
(:class:`~specrt.runtime.serve.batching.BatchPool`).

No HTTP framework is imported here: the base runtime imports this module without the
``[serve]`` extra.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from ..backends.base import release_scratch
from ..errors import BackendError, SpecRTError
from ..generation import prompt_only_result
from ..prefix import aligned_match
from .settings import DEFAULT_MAX_QUEUE

__all__ = ["ServeError", "ServerBusy", "Job", "Pool", "WorkerPool", "run_prompt", "send_text", "finish", "fail", "route_key"]

log = logging.getLogger("specrt.serve")


class ServeError(SpecRTError):
    """The server cannot start: the ``[serve]`` extra is missing, or bad server settings."""


class ServerBusy(SpecRTError):
    """The request queue is full (answered 503 with ``Retry-After``)."""


@dataclass
class Job:
    """One generation for a pool (the module docstring lists the events it emits).

    Attributes:
        ids: validated prompt token ids.
        config: resolved :class:`~specrt.runtime.config.GenerationConfig`.
        emit: thread-safe callback receiving the events.
        stream: emit ``("text", ...)`` and ``("prompt", ...)`` events (else only the final one).
        echo: score the prompt first (:meth:`Engine.prompt_logprobs` when
            ``prompt_logprobs`` is not None) and emit ``("prompt", ...)``.
        prompt_logprobs: alternatives per prompt token, or None (no scoring pass).
        generate: False for ``max_tokens: 0`` with ``echo`` (the prompt only).
        cancelled: set it to stop the job at the next piece (or skip it while queued).
        enqueued, started, first, finished: ``time.perf_counter()`` when queued, taken by a
            worker, when its first text piece came, when it ended.
        prompt_lps: the prompt's logprob entries once scored.
        lp_sent: output logprob entries already emitted with ``("text", ...)`` events.
    """

    ids: list[int]
    config: Any
    emit: Callable[[tuple], None]
    stream: bool = False
    echo: bool = False
    prompt_logprobs: int | None = None
    generate: bool = True
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.perf_counter)
    started: float | None = None
    first: float | None = None
    finished: float | None = None
    prompt_lps: list | None = None
    lp_sent: int = 0


@runtime_checkable
class Pool(Protocol):
    """What the service needs from a generator pool (:class:`WorkerPool`, ``BatchPool``).

    Attributes:
        engines: loaded Engines; ``engines[0]`` validates and tokenizes for the service.
        max_queue: jobs that may wait (:class:`ServerBusy` beyond).
        workers: generations that can run at once. busy: running now. queued: waiting.
        prefix_tokens: tokens whose KV rows the prefix cache holds now (idle workers or
            free slots; a record in use by a generation is not counted).
    """

    engines: list
    max_queue: int

    @property
    def workers(self) -> int: ...

    @property
    def busy(self) -> int: ...

    @property
    def queued(self) -> int: ...

    @property
    def prefix_tokens(self) -> int: ...

    def submit_all(self, jobs: Sequence[Job]) -> None:
        """Queue all ``jobs`` or none, without waiting; raises :class:`ServerBusy`."""
        ...

    def close(self, timeout: float = 10.0) -> None:
        """Stop; queued and running jobs end (cancelled or after their piece)."""
        ...

    def attach_metrics(self, server_metrics) -> None:
        """Register the pool's own metrics (if any) in the server's registry."""
        ...


def finish(job: Job, outcome: str, payload) -> None:
    """Hand the job's end to its client: ``outcome`` ``"ok"`` (payload: the
    GenerationResult), ``"cancelled"`` or ``"error"`` (payload: the exception)."""
    job.finished = time.perf_counter()
    job.emit({"ok": ("done", payload), "cancelled": ("cancelled", None), "error": ("error", payload)}[outcome])


def fail(job: Job, e: Exception) -> None:
    """End ``job`` with an error event (logged with its trace unless it is the project's own error)."""
    if not isinstance(e, SpecRTError):
        log.exception("generation failed", exc_info=e)
    finish(job, "error", e)


def run_prompt(engine, job: Job) -> bool:
    """The prompt part of a job, before any generation: marks it started; with ``echo``
    scores the prompt (``prompt_logprobs``) and emits ``("prompt", ...)`` when streaming; a
    job that only echoes (``generate`` False) ends here with its result.

    Returns:
        True when the job goes on to generate.

    Raises:
        what :meth:`Engine.prompt_logprobs` raises (the caller ends the job with it).
    """
    job.started = time.perf_counter()
    if job.echo:
        if job.prompt_logprobs is not None:
            job.prompt_lps = engine.prompt_logprobs(job.ids, job.prompt_logprobs)
        if job.stream:
            job.emit(("prompt", job.prompt_lps))
    if not job.generate:
        finish(job, "ok", prompt_only_result(len(job.ids), job.config.logprobs is not None))
        return False
    return True


def send_text(job: Job, piece: str, logprobs: list | None) -> None:
    """A released text piece of ``job`` (nothing when empty): sets ``Job.first``, and with
    ``stream`` emits ``("text", (piece, entries))`` with the output logprob entries of
    ``logprobs`` (the generation's live list, or None) not sent before."""
    if not piece:
        return
    if job.first is None:
        job.first = time.perf_counter()
    if job.stream:
        new = None
        if logprobs is not None:
            new = logprobs[job.lp_sent :]
            job.lp_sent += len(new)
        job.emit(("text", (piece, new)))


def route_key(rec, ids: Sequence[int], step: int) -> tuple[int, int]:
    """How well a KV holder serves a prompt, for routing a request (larger is better).

    llama-server's slot-similarity rule (``--slot-prompt-similarity`` 0.5): a holder counts
    its reusable rows when they are at least half of the shorter of the prompt and its
    record (the request continues or cuts back that history); otherwise reusing a few
    shared rows (a shared import line) would overwrite a history another request comes
    back to, so the holder that loses the fewest cached rows is preferred (an empty one
    first).

    Args:
        rec: what the holder's KV keeps for reuse (a :class:`~specrt.runtime.prefix.KVPrefix`),
            or None.
        ids: the request's prompt token ids.
        step: the granularity of reusable rows (the target's call width: whole aligned
            calls; 1 under any layout, :meth:`~specrt.runtime.manifest.Manifest.reuse_step`).

    Returns:
        ``(similar rows, -cached rows lost)``: the reusable target rows when similar (else
        0), then minus the rows the request would overwrite; ``(0, 0)`` without a record.
    """
    if rec is None:
        return (0, 0)
    rows = min(rec.target_rows, aligned_match(rec, ids, step))
    return (rows if 2 * rows >= min(rec.size, len(ids)) else 0, -(rec.size - rows))


class WorkerPool:
    """A fixed number of generator threads, each owning one Engine, fed by a bounded queue
    (a :class:`Pool`).

    Routing (llama-server's slot-similarity rule): a job that arrives while workers are idle
    goes to the idle worker whose Engine holds the longest similar prefix of its prompt
    (:func:`route_key`, :mod:`specrt.runtime.prefix`), so a conversation comes back to the KV it left; a job
    that arrives while all are busy waits in arrival order for the first one free.

    Args:
        engines: one :class:`~specrt.runtime.engine.Engine` per worker (never shared).
        max_queue: jobs that may wait for a worker; :meth:`submit_all` raises
            :class:`ServerBusy` beyond it.
        round_delay: test hook: seconds to sleep after each piece (simulates a slow model
            so that a disconnect lands mid-generation); 0 in production.
        prefix_cache_tokens: the prefix cache's budget in tokens over all workers (each
            Engine keeps the reusable KV rows of its last prompt, :mod:`specrt.runtime.prefix`;
            a worker's record is cut to its share, ``budget // workers`` tokens, after each
            job); None: no limit but the KV buffers; 0: no prefix cache.

    Raises:
        ServeError: no engines, ``max_queue < 1`` or a negative ``prefix_cache_tokens``.
    """

    def __init__(self, engines: Sequence, max_queue: int = DEFAULT_MAX_QUEUE, round_delay: float = 0.0, prefix_cache_tokens: int | None = None):
        if not engines:
            raise ServeError("a worker pool needs at least one engine")
        if max_queue < 1:
            raise ServeError(f"max_queue={max_queue}; it must be >= 1")
        if prefix_cache_tokens is not None and prefix_cache_tokens < 0:
            raise ServeError(f"prefix_cache_tokens={prefix_cache_tokens}; it must be >= 0 (0: no prefix cache)")
        self.engines = list(engines)
        self.share = None if prefix_cache_tokens is None else prefix_cache_tokens // len(self.engines)
        for e in self.engines:
            e.prefix_cache = prefix_cache_tokens != 0
        self.metrics = None
        self.max_queue = max_queue
        self.round_delay = round_delay
        self._cond = threading.Condition()
        self._waiting: deque = deque()  # (job, worker index it is routed to, or None: the first free)
        self._idle: set[int] = set()  # workers waiting for a job, none routed to them yet
        self._closed = False
        self._busy = 0
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._work, args=(i,), name=f"specrt-worker-{i}", daemon=True) for i in range(len(self.engines))]
        for t in self._threads:
            t.start()

    @classmethod
    def load(
        cls,
        folder: str | Path,
        workers: int = 1,
        max_queue: int = DEFAULT_MAX_QUEUE,
        threads=None,
        backend: str | None = None,
        round_delay: float = 0.0,
        prefix_cache_tokens: int | None = None,
    ) -> "WorkerPool":
        """Load the engine folder once and give each of ``workers`` threads its own Engine:
        :meth:`Engine.fork` where the backend can (shared onnxruntime sessions, own KV and
        work buffers), else one more loaded Engine per worker.

        Raises:
            ServeError: workers < 1 or max_queue < 1.
            EngineError, BackendError: what :class:`Engine` raises.
        """
        from ..engine import Engine

        if workers < 1:
            raise ServeError(f"workers={workers}; it must be >= 1")
        first = Engine(folder, threads=threads, backend=backend)
        engines = [first]
        for _ in range(workers - 1):
            try:
                engines.append(first.fork())
            except BackendError:
                engines.append(Engine(folder, threads=threads, backend=first.backend, verify_hashes=False))
        return cls(engines, max_queue=max_queue, round_delay=round_delay, prefix_cache_tokens=prefix_cache_tokens)

    @property
    def workers(self) -> int:
        """Number of worker threads."""
        return len(self.engines)

    @property
    def busy(self) -> int:
        """Workers running a job now."""
        return self._busy

    @property
    def queued(self) -> int:
        """Jobs waiting for a worker."""
        return len(self._waiting)

    @property
    def prefix_tokens(self) -> int:
        """Tokens whose KV rows the idle workers' Engines keep for reuse now (a worker
        running a job holds its record outside ``Engine.cached`` and is not counted; a record
        just left by a job counts at most the worker's share: it is cut to it right after)."""
        cap = self.share if self.share is not None else float("inf")
        return int(sum(min(rec.size, cap) for rec in [e.cached for e in self.engines] if rec is not None))

    def attach_metrics(self, server_metrics) -> None:
        """Keep ``server_metrics`` to count prefix-cache evictions (the server's own gauges
        cover the workers)."""
        self.metrics = server_metrics

    def submit(self, job: Job) -> None:
        """Queue ``job`` without waiting.

        Raises:
            ServerBusy: ``max_queue`` jobs are already waiting.
        """
        self.submit_all([job])

    def submit_all(self, jobs: Sequence[Job]) -> None:
        """Queue all ``jobs`` or none (one request's generations), without waiting.

        Raises:
            ServerBusy: fewer than ``len(jobs)`` places are free in the queue.
        """
        with self._cond:
            if len(self._waiting) + len(jobs) > self.max_queue:
                raise ServerBusy(
                    f"server busy: {len(self._waiting)} generations already queued for {self.workers} worker(s) (at most {self.max_queue}); retry later"
                )
            for j in jobs:
                w = self._route(j)
                self._idle.discard(w)
                self._waiting.append((j, w))
            self._cond.notify_all()

    def _route(self, job: Job) -> int | None:
        """The idle worker for ``job`` (with ``self._cond`` held): by :func:`route_key` (the
        longest similar prefix of its prompt, then the fewest cached rows lost); None when
        none is idle."""
        best, key = None, None
        for w in sorted(self._idle):
            eng = self.engines[w]
            k = route_key(eng.cached, job.ids, eng.manifest.reuse_step(eng.target.max_q))  # an idle worker's record does not change meanwhile
            if key is None or k > key:
                best, key = w, k
        return best

    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers after the jobs in hand (queued jobs are cancelled)."""
        with self._cond:
            self._closed = True
            left, self._waiting = list(self._waiting), deque()
            self._cond.notify_all()
        for j, _ in left:
            j.cancelled.set()
            j.emit(("cancelled", None))
        for t in self._threads:
            t.join(timeout)

    def _take(self, w: int) -> Job | None:
        """Worker ``w``'s next job: the first routed to it, else the first routed to no one;
        None once the pool is closed."""
        with self._cond:
            while not self._closed:
                for i, (job, to) in enumerate(self._waiting):
                    if to == w or to is None:
                        del self._waiting[i]
                        self._idle.discard(w)
                        return job
                self._idle.add(w)
                self._cond.wait()
            return None

    def _work(self, w: int) -> None:
        """Worker thread ``w``: take jobs until the pool closes."""
        engine = self.engines[w]
        while True:
            job = self._take(w)
            if job is None:
                return
            if job.cancelled.is_set():
                finish(job, "cancelled", None)
                continue
            with self._lock:
                self._busy += 1
            try:
                self._run(engine, job)
            finally:
                self._fit_cache(engine)
                with self._lock:
                    self._busy -= 1

    def _fit_cache(self, engine) -> None:
        """Cut ``engine``'s prefix-cache record to this worker's share of the budget and
        release the KV rows past it (only its own thread touches its record between jobs).
        The logits rows past the verification widths go back to the OS after every job, budget
        or not (prefill scratch: 148 MiB a model for a 152k vocabulary)."""
        for model in (engine.target, engine.draft):
            release_scratch(model, engine.manifest.k_max + 1)
        rec = engine.cached
        if self.share is None:
            return
        if rec is not None and rec.size > self.share:
            engine.cached = rec.trimmed(self.share, engine.manifest.reuse_step(engine.target.max_q), engine.draft.max_q)
            if self.metrics is not None:
                self.metrics.prefix_evicted(rec.size - (engine.cached.size if engine.cached is not None else 0))
        # rows past the kept record go back to the OS: an idle worker holds its share, no more
        kept = engine.cached
        for model, rows in ((engine.target, 0 if kept is None else kept.target_rows), (engine.draft, 0 if kept is None else kept.draft_rows)):
            rel = getattr(model, "release_rows", None)
            if rel is not None:
                rel(rows)

    def _run(self, engine, job: Job) -> None:
        """Run one job: :func:`run_prompt`, then :meth:`Engine.stream`, checking
        ``job.cancelled`` between pieces."""
        stream = None
        try:
            if not run_prompt(engine, job):
                return
            stream = engine.stream(job.ids, job.config)
            for piece in stream:
                if job.cancelled.is_set():
                    break
                send_text(job, piece, stream.logprobs)
                if self.round_delay:
                    time.sleep(self.round_delay)
            if job.cancelled.is_set() or stream.result is None:
                stream.close()
                finish(job, "cancelled", None)
            else:
                finish(job, "ok", stream.result)
        except Exception as e:  # noqa: BLE001 - reported to the client as a 4xx/500 event
            if stream is not None:
                stream.close()
            fail(job, e)
