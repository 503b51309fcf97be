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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from ..errors import BackendError, InputError, SpecRTError
from ..generation import prompt_only_result
from ..hostcache import HostCache
from ..slots import SlotPolicy, Slots, Waiter
from .settings import DEFAULT_MAX_QUEUE

__all__ = ["ServeError", "ServerBusy", "Job", "Pool", "WorkerPool", "run_prompt", "send_text", "finish", "fail", "pool_slots"]

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


def pool_slots(make, *args, cache_ram_mib: int = 0) -> Slots:
    """A pool's :class:`~specrt.runtime.slots.Slots` (``make(*args)``: ``Slots.of_engines`` or
    ``Slots.of_batch``) with a host prompt cache of ``cache_ram_mib`` MiB
    (:class:`~specrt.runtime.hostcache.HostCache`; 0: none), its settings' errors as
    :class:`ServeError`.

    Raises:
        ServeError: a negative ``prefix_cache_tokens`` or ``cache_ram_mib``.
    """
    if cache_ram_mib < 0:
        raise ServeError(f"cache_ram={cache_ram_mib} MiB; it must be >= 0 (0: no host prompt cache)")
    try:
        return make(*args, host=HostCache(cache_ram_mib << 20) if cache_ram_mib > 0 else None)
    except InputError as e:
        raise ServeError(str(e)) from None


class WorkerPool:
    """A fixed number of generator threads, each owning one Engine, fed by a bounded queue
    (a :class:`Pool`).

    Each worker's Engine is a slot (:mod:`specrt.runtime.slots`: it keeps the reusable KV
    rows of its last prompt). Jobs wait in one queue; whenever a worker is idle, the next job
    and its worker are chosen by the slot rule (:func:`~specrt.runtime.slots.pick`): a job
    whose history an idle worker holds goes first, to that worker, then the others in
    arrival order, each to the idle worker that serves it best (llama-server's slot
    similarity), a job passed over at most ``slot_policy``'s bound. So a conversation comes
    back to the KV it left even when its next turn queued behind others.

    Args:
        engines: one :class:`~specrt.runtime.engine.Engine` per worker (never shared).
        max_queue: jobs that may wait for a worker; :meth:`submit_all` raises
            :class:`ServerBusy` beyond it.
        round_delay: test hook: seconds to sleep after each piece (simulates a slow model
            so that a disconnect lands mid-generation); 0 in production.
        prefix_cache_tokens: the prefix cache's budget in tokens over all workers (each
            Engine keeps the reusable KV rows of its last prompt, :mod:`specrt.runtime.prefix`;
            a worker's record is cut to its share, ``budget // workers`` tokens, when its
            job ends); None: no limit but the KV buffers; 0: no prefix cache.
        slot_policy: how long a job may be passed over (:class:`~specrt.runtime.slots.SlotPolicy`).
        cache_ram_mib: the host prompt cache's budget in MiB (workers' histories kept beyond
            the workers, :mod:`specrt.runtime.hostcache`); 0: none.

    Raises:
        ServeError: no engines, ``max_queue < 1`` or a negative ``prefix_cache_tokens`` or ``cache_ram_mib``.
    """

    def __init__(
        self,
        engines: Sequence,
        max_queue: int = DEFAULT_MAX_QUEUE,
        round_delay: float = 0.0,
        prefix_cache_tokens: int | None = None,
        slot_policy: SlotPolicy = SlotPolicy(),
        cache_ram_mib: int = 0,
    ):
        if not engines:
            raise ServeError("a worker pool needs at least one engine")
        if max_queue < 1:
            raise ServeError(f"max_queue={max_queue}; it must be >= 1")
        self.engines = list(engines)
        self.slots = pool_slots(Slots.of_engines, self.engines, prefix_cache_tokens, slot_policy, cache_ram_mib=cache_ram_mib)
        self.max_queue = max_queue
        self.round_delay = round_delay
        self._cond = threading.Condition()
        self._waiting: list[Waiter] = []  # arrival order
        self._given: dict[int, Job] = {}  # worker -> the job chosen for it, not yet taken
        self._idle: set[int] = set()  # workers waiting for a job, none chosen for them yet
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
        slot_policy: SlotPolicy = SlotPolicy(),
        cache_ram_mib: int = 0,
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
        return cls(
            engines, max_queue=max_queue, round_delay=round_delay, prefix_cache_tokens=prefix_cache_tokens, slot_policy=slot_policy, cache_ram_mib=cache_ram_mib
        )

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
        """Jobs waiting for a worker (chosen for one that has not taken it yet included)."""
        return len(self._waiting) + len(self._given)

    @property
    def prefix_tokens(self) -> int:
        """Tokens whose KV rows the workers' Engines keep for reuse now (a worker running a
        job holds its record in the job's generation and is not counted)."""
        return self.slots.held_tokens(range(len(self.engines)))

    def attach_metrics(self, server_metrics) -> None:
        """Count prefix-cache evictions and the host prompt cache's restores and evictions in
        ``server_metrics`` (the server's own gauges cover the workers)."""
        server_metrics.attach_slots(self.slots)

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
            if self.queued + len(jobs) > self.max_queue:
                raise ServerBusy(f"server busy: {self.queued} generations already queued for {self.workers} worker(s) (at most {self.max_queue}); retry later")
            self._waiting.extend(Waiter(j, j.ids) for j in jobs)
            self._dispatch()

    def _dispatch(self) -> None:
        """With ``self._cond`` held: choose jobs for idle workers (the slot rule, class
        docstring) while both are there, and wake the workers chosen. An idle worker's
        record does not change meanwhile (only its own thread runs its Engine)."""
        given = False
        while self._idle and self._waiting:
            w, i = self.slots.next(self._waiting, sorted(self._idle))
            self.slots.claim(w, self._waiting)
            self._waiting.remove(w)
            self._idle.discard(i)
            self._given[i] = w.job
            given = True
        if given:
            self._cond.notify_all()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers after the jobs in hand (queued jobs are cancelled)."""
        with self._cond:
            self._closed = True
            left = [w.job for w in self._waiting] + list(self._given.values())
            self._waiting, self._given = [], {}
            self._cond.notify_all()
        for j in left:
            j.cancelled.set()
            j.emit(("cancelled", None))
        for t in self._threads:
            t.join(timeout)

    def _take(self, w: int) -> Job | None:
        """Worker ``w``'s next job (the one chosen for it, :meth:`_dispatch`); None once the
        pool is closed."""
        with self._cond:
            while not self._closed:
                job = self._given.pop(w, None)
                if job is not None:
                    return job
                self._idle.add(w)
                self._dispatch()
                if w not in self._given:
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
                self.slots[w].release()  # only this thread touches its Engine between jobs
                with self._lock:
                    self._busy -= 1

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
