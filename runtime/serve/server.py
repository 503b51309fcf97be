"""OpenAI-compatible HTTP serving: ``POST /v1/completions`` and ``POST /v1/chat/completions``
(JSON or server-sent events), ``GET /v1/models[/{id}]``, ``GET /metrics`` (Prometheus),
``GET /health``, ``GET /docs``.

Layout (one process)::

    uvicorn (asyncio, FastAPI)  --parse-->  executor thread: validate, render, tokenize
         |                                       |
         |     one asyncio.Queue per request  <--+-- bounded queue --> N worker threads
         ^   <-- text pieces / results (each generation = one job) --   each owns an Engine

- The event loop only parses JSON (bodies are capped: 413 above ``max_body_bytes``) and
  moves events; validation, chat-template rendering, tokenization and the detokenization
  of logprob listings run in the loop's default executor, so a large prompt never stalls
  ``/health`` or other streams. A refused request gets one OpenAI error object before
  anything is queued.
- A valid request becomes one :class:`Job` per generation (prompts x ``n``, or x
  ``best_of``) in a bounded ``queue.Queue`` (``max_queue``), all or none: a full queue
  answers 503 at once. ``workers`` threads each own one Engine (:meth:`Engine.fork`
  shares the loaded sessions), take jobs in arrival order and run them with
  :meth:`Engine.stream`; onnxruntime releases the GIL inside its runs.
- A client that disconnects (streaming or not) sets its jobs' ``cancelled`` events; a
  worker checks it between the stream's pieces, closes the stream (which releases the
  Engine) and takes the next job. A job cancelled while still queued is skipped.

FastAPI, uvicorn, pydantic, jinja2 and prometheus_client are the optional ``[serve]``
extra: this module imports them only inside functions, so the base runtime imports
without them.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import math
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import BackendError, InputError, SpecRTError
from .protocol import DEFAULT_MAX_TOKENS, chat_request_model, completion_request_model, field_names, validation_message

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "LOGPROB_FLOOR",
    "ServeError",
    "ServerBusy",
    "RequestError",
    "Job",
    "WorkerPool",
    "Generation",
    "Work",
    "usage_block",
    "CompletionService",
    "error_body",
    "create_app",
    "build_service",
    "serve",
]

log = logging.getLogger("specrt.serve")

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: a request body above it gets 413 before it is parsed
LOGPROB_FLOOR = -9999.0  # JSON has no -inf: a token of probability 0 is reported with this (as vLLM)


class ServeError(SpecRTError):
    """The server cannot start: the ``[serve]`` extra is missing, or bad server settings."""


class ServerBusy(SpecRTError):
    """The request queue is full (answered 503 with ``Retry-After``)."""


class RequestError(SpecRTError):
    """A request the server refuses before queueing it.

    Attributes:
        status: HTTP status (400, 404, 413, ...).
        param: the request field at fault, or None.
        err_type: OpenAI error ``type`` (``invalid_request_error`` ...).
        code: OpenAI error ``code`` (``model_not_found`` ...), or None.
    """

    def __init__(self, message: str, param: str | None = None, status: int = 400, err_type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message, param)
        self.status, self.err_type, self.code = status, err_type, code


# ---- workers -------------------------------------------------------------------------
@dataclass
class Job:
    """One generation for a worker.

    Attributes:
        ids: validated prompt token ids.
        config: resolved :class:`GenerationConfig`.
        emit: thread-safe callback receiving the events ``("prompt", entries | None)``
            (with ``echo``, first), ``("text", (piece, new logprob entries | None))``
            (``stream`` only), ``("done", GenerationResult)``, ``("cancelled", None)``,
            ``("error", Exception)``.
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


class WorkerPool:
    """A fixed number of generator threads, each owning one Engine, fed by a bounded queue.

    Args:
        engines: one :class:`~specrt.runtime.engine.Engine` per worker (never shared).
        max_queue: jobs that may wait for a worker; :meth:`submit` raises
            :class:`ServerBusy` beyond it.
        round_delay: test hook: seconds to sleep after each piece (simulates a slow model
            so that a disconnect lands mid-generation); 0 in production.
    """

    def __init__(self, engines: Sequence, max_queue: int = 64, round_delay: float = 0.0):
        if not engines:
            raise ServeError("a worker pool needs at least one engine")
        if max_queue < 1:
            raise ServeError(f"max_queue={max_queue}; it must be >= 1")
        self.engines = list(engines)
        self.max_queue = max_queue
        self.round_delay = round_delay
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._busy = 0
        self._lock = threading.Lock()
        self._submit_lock = threading.Lock()
        self._threads = [threading.Thread(target=self._work, args=(e,), name=f"specrt-worker-{i}", daemon=True) for i, e in enumerate(self.engines)]
        for t in self._threads:
            t.start()

    @classmethod
    def load(
        cls, folder: str | Path, workers: int = 1, max_queue: int = 64, threads=None, backend: str | None = None, round_delay: float = 0.0
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
        return cls(engines, max_queue=max_queue, round_delay=round_delay)

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
        """Jobs waiting for a worker (approximate, as ``queue.Queue.qsize``)."""
        return self._queue.qsize()

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
        with self._submit_lock:  # only submitters put; workers only take: the free room cannot shrink meanwhile
            if self._queue.qsize() + len(jobs) > self.max_queue:
                raise ServerBusy(
                    f"server busy: {self._queue.qsize()} generations already queued for {self.workers} worker(s) (at most {self.max_queue}); retry later"
                )
            for j in jobs:
                self._queue.put_nowait(j)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers after the jobs in hand (queued jobs are cancelled)."""
        while True:
            try:
                j = self._queue.get_nowait()
            except queue.Empty:
                break
            if j is not None:
                j.cancelled.set()
                j.emit(("cancelled", None))
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout)

    def _work(self, engine) -> None:
        """Worker thread: take jobs until the ``None`` sentinel."""
        while True:
            job = self._queue.get()
            if job is None:
                return
            if job.cancelled.is_set():
                self._finish(job, "cancelled", None)
                continue
            with self._lock:
                self._busy += 1
            try:
                self._run(engine, job)
            finally:
                with self._lock:
                    self._busy -= 1

    def _run(self, engine, job: Job) -> None:
        """Run one job: the prompt scoring pass (echo), then :meth:`Engine.stream`, checking
        ``job.cancelled`` between pieces."""
        job.started = time.perf_counter()
        stream = None
        try:
            if job.echo:
                if job.prompt_logprobs is not None:
                    job.prompt_lps = engine.prompt_logprobs(job.ids, job.prompt_logprobs)
                if job.stream:
                    job.emit(("prompt", job.prompt_lps))
            if not job.generate:
                self._finish(job, "ok", _prompt_only_result(job))
                return
            stream = engine.stream(job.ids, job.config)
            for piece in stream:
                if job.cancelled.is_set():
                    break
                if job.first is None:
                    job.first = time.perf_counter()
                if job.stream:
                    new = None
                    if stream.logprobs is not None:
                        new = stream.logprobs[job.lp_sent :]
                        job.lp_sent += len(new)
                    job.emit(("text", (piece, new)))
                if self.round_delay:
                    time.sleep(self.round_delay)
            if job.cancelled.is_set() or stream.result is None:
                stream.close()
                self._finish(job, "cancelled", None)
            else:
                self._finish(job, "ok", stream.result)
        except Exception as e:  # noqa: BLE001 - reported to the client as a 4xx/500 event
            if stream is not None:
                stream.close()
            if not isinstance(e, SpecRTError):
                log.exception("generation failed")
            self._finish(job, "error", e)

    def _finish(self, job: Job, outcome: str, payload) -> None:
        """Hand the job's end to its client."""
        job.finished = time.perf_counter()
        job.emit({"ok": ("done", payload), "cancelled": ("cancelled", None), "error": ("error", payload)}[outcome])


def _prompt_only_result(job: Job):
    """The result of an ``echo`` job with ``max_tokens: 0``: no output token."""
    from ..engine import GenerationResult
    from ..stats import Stats

    lps = [] if job.config.logprobs is not None else None
    return GenerationResult(tokens=[], text="", finish_reason="length", stats=Stats(prompt_tokens=len(job.ids)), logprobs=lps)


# ---- request handling (framework-independent parts) ------------------------------------
@dataclass
class Generation:
    """One generation a request asks for (becomes one :class:`Job`).

    Attributes:
        prompt_index: which prompt of the request.
        ids: its validated token ids.
        config: the resolved GenerationConfig (seed derived per choice).
        echo_text: the prompt text to echo before the output (completions' ``echo``), or None.
        prompt_logprobs: alternatives per prompt token to score (echo + logprobs), or None.
        generate: False: echo only (``max_tokens: 0``).
    """

    prompt_index: int
    ids: list[int]
    config: Any
    echo_text: str | None = None
    prompt_logprobs: int | None = None
    generate: bool = True


@dataclass
class Work:
    """A validated request: its generations and how to answer.

    Attributes:
        chat: True for ``/v1/chat/completions``.
        gens: the generations, ``best_of`` per prompt, prompts in order.
        n: choices returned per prompt. best_of: generations per prompt (>= n).
        stream: server-sent events. include_usage: ``stream_options.include_usage``.
        top_n: logprob alternatives shown per token, or None when logprobs are not shown.
        prompt_tokens: prompt tokens of the request (each prompt counted once).
    """

    chat: bool
    gens: list[Generation]
    n: int
    best_of: int
    stream: bool
    include_usage: bool
    top_n: int | None
    prompt_tokens: int


def _finite(x: float | None) -> float | None:
    """JSON has no NaN: None for NaN/inf."""
    return None if x is None or not math.isfinite(x) else round(float(x), 6)


def usage_block(results: Sequence, prompt_tokens: int | None = None) -> dict:
    """OpenAI ``usage`` of one request, with the speculative statistics of all its
    generations summed under ``usage["speculative"]``.

    Args:
        results: the :class:`GenerationResult` of every generation (best_of ones included:
            ``completion_tokens`` counts every generated token).
        prompt_tokens: the request's prompt tokens (default: the first result's).
    """
    if not isinstance(results, (list, tuple)):
        results = [results]
    st = [r.stats for r in results]
    prompt = st[0].prompt_tokens if prompt_tokens is None else prompt_tokens
    new = sum(s.new_tokens for s in st)
    proposed, accepted, passes = sum(s.proposed for s in st), sum(s.accepted for s in st), sum(s.passes for s in st)
    width = max(len(s.accepted_hist) for s in st)
    hist = [sum(s.accepted_hist[i] if i < len(s.accepted_hist) else 0 for s in st) for i in range(width)]
    after_first = sum(max(s.new_tokens - 1, 0) for s in st)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": new,
        "total_tokens": prompt + new,
        "speculative": {
            "proposed": proposed,
            "accepted": accepted,
            "acceptance_rate": _finite(accepted / proposed if proposed else math.nan),
            "mean_accepted": _finite(accepted / passes if passes else math.nan),
            "tokens_per_pass": _finite(after_first / passes if passes else math.nan),
            "passes": passes,
            "draft_calls": sum(s.draft_calls for s in st),
            "accepted_hist": hist,
            "prefill_seconds": _finite(sum(s.prefill_seconds for s in st)),
            "draft_seconds": _finite(sum(s.draft_seconds for s in st)),
            "target_seconds": _finite(sum(s.target_seconds for s in st)),
            "total_seconds": _finite(sum(s.total_seconds for s in st)),
            "stop_reason": results[0].stop_reason if len(results) == 1 else None,
        },
    }


def _lp(x: float) -> float:
    return max(float(x), LOGPROB_FLOOR)


class CompletionService:
    """The serving logic behind the routes, independent of the ASGI app that mounts it
    (the same object serves ``specrt serve`` and a Ray Serve replica).

    Args:
        pool: the :class:`WorkerPool`, or a
            :class:`~specrt.runtime.serve.batching.BatchPool` (``serve --max-batch``).
        model_name: the id clients may send as ``model`` (any other is a 404).
        chat_template: a :class:`~specrt.runtime.serve.chat.ChatTemplate`, or None (chat
            requests then get a 400 saying so).

    Attributes:
        created: server start (Unix seconds), the ``created`` of ``/v1/models``.
        prompt_char_limit: text prompts (and rendered chats) longer than this many
            characters are refused before tokenizing: twice ``(max_ctx - 1) x`` the most
            UTF-8 bytes one token stands for, so such a prompt cannot fit the context
            (each token covers at most that many bytes; the factor 2 leaves room for
            tokenizers that normalise text).
    """

    def __init__(self, pool, model_name: str, chat_template=None):
        from .metrics import ServerMetrics

        self.pool = pool
        self.model_name = model_name
        self.engine = pool.engines[0]  # validation and tokenizing only (no generation)
        m = self.engine.manifest
        self.metrics = ServerMetrics(model_name, m.k_max, lambda: (pool.workers, pool.busy, pool.queued, pool.max_queue))
        if hasattr(pool, "attach_metrics"):  # the BatchPool's batching metrics join this registry
            pool.attach_metrics(self.metrics)
        self.chat_template = chat_template
        self.created = int(time.time())
        self.prompt_char_limit = 2 * (m.max_ctx - 1) * self.engine.codec.max_token_bytes
        self._ids = itertools.count(1)

    # -- validation --
    def check_model(self, model: str | None) -> None:
        """Raises RequestError (404, ``code: model_not_found``) for an id not served here."""
        if model is not None and model != self.model_name:
            raise RequestError(
                f"The model {model!r} does not exist: this server serves {self.model_name!r} (GET /v1/models)", "model", 404, code="model_not_found"
            )

    def _base_config(self, req, max_new_tokens: int, logprobs: int | None):
        """The request's resolved GenerationConfig (seed of choice 0)."""
        from ..config import GenerationConfig

        stop = req.stop
        if isinstance(stop, str):
            stop = (stop,)
        cfg = GenerationConfig(
            max_new_tokens=max_new_tokens,
            k_max=req.k_max,
            threshold=req.threshold,
            speculative=True if req.speculative is None else req.speculative,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=req.top_k or 0,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed,
            stop=tuple(stop or ()),
            logprobs=logprobs,
        )
        try:
            return self.engine.resolve(cfg)
        except InputError as e:
            raise _request_error(e) from None

    def _prompt_ids(self, prompt, where: str) -> list[int]:
        """Validated ids of one prompt (text longer than :attr:`prompt_char_limit` is refused untokenized)."""
        if isinstance(prompt, str) and len(prompt) > self.prompt_char_limit:
            raise RequestError(
                f"{where} has {len(prompt)} characters; the context holds at most {self.engine.manifest.max_ctx - 1} prompt tokens, "
                f"so a prompt longer than {self.prompt_char_limit} characters cannot fit",
                "prompt" if where.startswith("prompt") else "messages",
            )
        try:
            return self.engine.prompt_ids(prompt)
        except InputError as e:
            msg = str(e) if where in ("prompt", "messages") else f"{where}: {e}"
            raise RequestError(msg, "prompt" if where.startswith("prompt") else "messages") from None

    def _check_total(self, total: int, param: str) -> None:
        if total > self.pool.max_queue:
            raise RequestError(f"{param}: this request asks for {total} generations; this server queues at most {self.pool.max_queue} (--max-queue)", param)

    def prepare_completion(self, req) -> Work:
        """The :class:`Work` of a validated ``/v1/completions`` body (runs off the event loop).

        Raises:
            RequestError: wrong model (404), several ``n``/``best_of``/``echo``/``max_tokens``
                combinations OpenAI refuses, or what the engine refuses (prompt too long or
                empty, ids outside the vocabulary, k_max/threshold out of range, ...).
        """
        self.check_model(req.model)
        n = req.n or 1
        best_of = req.best_of or n
        if best_of < n:
            raise RequestError(f"best_of={best_of} must be >= n={n}", "best_of")
        stream = bool(req.stream)
        if stream and best_of > n:
            raise RequestError("best_of > n cannot be streamed (the best choices are known only at the end); use stream=false", "best_of")
        _check_stream_options(req, stream)
        echo = bool(req.echo)
        max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        if max_tokens == 0 and not echo:
            raise RequestError("max_tokens=0 is allowed only with echo=true (it returns the prompt, scored with logprobs)", "max_tokens")
        prompt = req.prompt
        prompts = [prompt] if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int) else list(prompt)
        self._check_total(len(prompts) * best_of, "n" if req.best_of is None else "best_of")
        logprobs = req.logprobs
        cfg = self._base_config(req, max(max_tokens, 1), logprobs if logprobs is not None else (0 if best_of > n else None))
        gens, prompt_tokens = [], 0
        for p, pr in enumerate(prompts):
            ids = self._prompt_ids(pr, "prompt" if len(prompts) == 1 else f"prompt[{p}]")
            prompt_tokens += len(ids)
            echo_text = (pr if isinstance(pr, str) else self.engine.codec.decode(ids)) if echo else None
            for j in range(best_of):
                gens.append(Generation(p, ids, _choice_config(cfg, j), echo_text, logprobs if echo else None, max_tokens > 0))
        return Work(False, gens, n, best_of, stream, _include_usage(req), logprobs, prompt_tokens)

    def prepare_chat(self, req) -> Work:
        """The :class:`Work` of a validated ``/v1/chat/completions`` body: the conversation
        rendered with the chat template (:mod:`specrt.runtime.serve.chat`), tokenized without
        adding BOS (runs off the event loop).

        Raises:
            RequestError: wrong model (404), no chat template, the template refusing the
                conversation, ``top_logprobs`` without ``logprobs``, or what the engine
                refuses.
        """
        from .chat import normalize_messages

        self.check_model(req.model)
        if self.chat_template is None:
            raise RequestError(
                f"model {self.model_name!r} has no chat template: its engine folder has no chat_template.jinja (the target checkpoint had none) "
                "and the server was started without --chat-template FILE; use /v1/completions, or restart with --chat-template",
                "messages",
                code="chat_template_missing",
            )
        if req.top_logprobs is not None and not req.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
        stream = bool(req.stream)
        _check_stream_options(req, stream)
        n = req.n or 1
        self._check_total(n, "n")
        try:
            text = self.chat_template.render(
                normalize_messages([m.model_dump(exclude_none=True) for m in req.messages]),
                add_generation_prompt=True if req.add_generation_prompt is None else req.add_generation_prompt,
                continue_final_message=bool(req.continue_final_message),
            )
        except InputError as e:
            raise _request_error(e) from None
        if len(text) > self.prompt_char_limit:
            self._prompt_ids(text, "the rendered conversation")
        try:
            ids = self.engine.prompt_ids(self.engine.codec.encode(text, add_special_tokens=False))
        except InputError as e:
            raise RequestError(f"the rendered conversation: {e}", "messages") from None
        top_n = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens or req.max_tokens or (self.engine.manifest.max_ctx - len(ids))
        cfg = self._base_config(req, max_tokens, top_n)
        gens = [Generation(0, ids, _choice_config(cfg, j)) for j in range(n)]
        return Work(True, gens, n, n, stream, _include_usage(req), top_n, len(ids))

    # -- ids, queue --
    def new_id(self, chat: bool = False) -> str:
        """A fresh response id (``cmpl-...`` or ``chatcmpl-...``)."""
        return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}{next(self._ids)}"

    def submit(self, work: Work) -> tuple[list[Job], asyncio.Queue]:
        """Queue the work's jobs (all or none); their events arrive on the returned
        asyncio.Queue (this loop's) as ``(generation index, event)``.

        Raises:
            ServerBusy: the queue has no room for all of them.
        """
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emitter(i):
            def emit(ev, _put=events.put_nowait):
                try:
                    loop.call_soon_threadsafe(_put, (i, ev))
                except RuntimeError:  # loop closed (server shutting down)
                    pass

            return emit

        jobs = [
            Job(
                ids=g.ids,
                config=g.config,
                emit=emitter(i),
                stream=work.stream,
                echo=g.echo_text is not None,
                prompt_logprobs=g.prompt_logprobs,
                generate=g.generate,
            )
            for i, g in enumerate(work.gens)
        ]
        self.pool.submit_all(jobs)
        return jobs, events

    # -- responses --
    def pick(self, work: Work, results: list) -> list[int]:
        """Generation indices of the returned choices, in choice order: per prompt the
        first ``n``, or with ``best_of > n`` the ``n`` with the highest cumulative logprob
        (sum over the output tokens, target's raw distribution; ties: lower index first)."""
        out = []
        for p in range(len(work.gens) // work.best_of):
            idx = list(range(p * work.best_of, (p + 1) * work.best_of))
            if work.best_of > work.n:
                idx.sort(key=lambda i: -sum(e.logprob for e in results[i].logprobs))
            out.extend(idx[: work.n])
        return out

    def _offsets(self, ids: Sequence[int], start: int, count: int, base: int) -> list[int]:
        """Character offsets of tokens ``start..start+count-1`` of ``ids`` in their text
        (``len(decode(ids[:k]))`` + ``base``)."""
        if count <= 0:
            return []
        dec = self.engine.codec.tokenizer.decode_batch([list(ids[:k]) for k in range(start, start + count)], skip_special_tokens=True)
        return [base + len(t) for t in dec]

    def completion_logprobs(self, entries: Sequence, tokens_before: Sequence[int], base: int, top_n: int) -> dict:
        """OpenAI's completions ``logprobs`` object for ``entries`` (TokenLogprob or None for
        a first prompt token): ``tokens``, ``token_logprobs``, ``top_logprobs`` (a dict of the
        ``top_n`` most probable tokens plus the chosen one, as OpenAI), ``text_offset``
        (characters into the choice's text; ``tokens_before`` are the ids already in it,
        ``base`` where their text starts)."""
        codec = self.engine.codec
        ids = [e.token for e in entries]
        seq = list(tokens_before) + ids
        toks, lps, tops = [], [], []
        for e in entries:
            toks.append(codec.token_text(e.token))
            if e.logprob is None:
                lps.append(None)
                tops.append(None)
                continue
            lps.append(_lp(e.logprob))
            d = {codec.token_text(t): _lp(v) for t, v in e.top[:top_n]}
            d.setdefault(codec.token_text(e.token), _lp(e.logprob))
            tops.append(d)
        return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": self._offsets(seq, len(tokens_before), len(ids), base)}

    def chat_logprobs(self, entries: Sequence, top_n: int) -> dict:
        """OpenAI's chat ``logprobs`` object: ``{"content": [{token, logprob, bytes,
        top_logprobs: [{token, logprob, bytes}, ...]}], "refusal": null}``, one entry per
        token of the message's content: the end-of-generation token that ended it (e.g.
        ``<|im_end|>``) is not listed, as OpenAI lists none (``usage.completion_tokens``
        still counts it: it was generated, as vLLM counts it)."""
        codec = self.engine.codec
        stop = self.engine.manifest.stop_ids()

        def one(t, lp):
            return {"token": codec.token_text(t), "logprob": _lp(lp), "bytes": list(codec.token_bytes(t))}

        content = [dict(one(e.token, e.logprob), top_logprobs=[one(t, v) for t, v in e.top[:top_n]]) for e in entries if e.token not in stop]
        return {"content": content, "refusal": None}

    def response_body(self, work: Work, cid: str, created: int, results: list, jobs: list[Job]) -> dict:
        """The non-streaming ``text_completion`` / ``chat.completion`` object (runs off the
        event loop: it detokenizes logprob listings)."""
        choices = []
        for k, i in enumerate(self.pick(work, results)):
            res, g = results[i], work.gens[i]
            lp = None
            if work.chat:
                if work.top_n is not None:
                    lp = self.chat_logprobs(res.logprobs, work.top_n)
                choices.append(
                    {
                        "index": k,
                        "message": {"role": "assistant", "content": res.text, "refusal": None},
                        "logprobs": lp,
                        "finish_reason": res.finish_reason,
                        "stop_reason": res.stop_reason,
                    }
                )
                continue
            text = res.text
            if g.echo_text is not None:
                text = g.echo_text + text
            if work.top_n is not None:
                if g.echo_text is not None:
                    plp = self._prompt_entries(jobs[i].prompt_lps, g.ids)
                    lp = self.completion_logprobs(plp, [], 0, work.top_n)
                    rest = self.completion_logprobs(res.logprobs, g.ids, 0, work.top_n)
                    rest["text_offset"] = [len(g.echo_text) + o - len(self.engine.codec.decode(g.ids)) for o in rest["text_offset"]]
                    for key in lp:
                        lp[key] = lp[key] + rest[key]
                else:
                    lp = self.completion_logprobs(res.logprobs, [], 0, work.top_n)
            choices.append({"text": text, "index": k, "logprobs": lp, "finish_reason": res.finish_reason, "stop_reason": res.stop_reason})
        return {
            "id": cid,
            "object": "chat.completion" if work.chat else "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": choices,
            "usage": usage_block(results, work.prompt_tokens),
        }

    @staticmethod
    def _prompt_entries(prompt_lps, ids):
        """Prompt logprob entries for the listing: the first token (no logprob) as a
        placeholder with ``logprob`` None."""
        from types import SimpleNamespace

        if prompt_lps is None:
            return []
        return [SimpleNamespace(token=ids[0], logprob=None, top=())] + list(prompt_lps[1:])

    def chunk(self, work: Work, cid: str, created: int, index: int, text: str | None = None, finish_reason=None, logprobs=None, role: bool = False) -> str:
        """One server-sent event with a ``text_completion`` or ``chat.completion.chunk``
        for choice ``index`` (``usage: null`` when the client asked for usage)."""
        if work.chat:
            delta: dict = {}
            if role:
                delta = {"role": "assistant", "content": ""}
            elif text:
                delta = {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"text": text or "", "index": index, "logprobs": logprobs, "finish_reason": finish_reason}
        body = {
            "id": cid,
            "object": "chat.completion.chunk" if work.chat else "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": [choice],
        }
        if work.include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def usage_chunk(self, work: Work, cid: str, created: int, results: list) -> str:
        """The last event with ``stream_options.include_usage``: ``choices: []`` and the usage."""
        body = {
            "id": cid,
            "object": "chat.completion.chunk" if work.chat else "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": [],
            "usage": usage_block(results, work.prompt_tokens),
        }
        return f"data: {json.dumps(body)}\n\n"


def _choice_config(cfg, j: int):
    """The config of choice ``j``: the seed derived per choice (:func:`~specrt.runtime.sampling.derive_seed`)."""
    from ..sampling import derive_seed

    return cfg if j == 0 else replace(cfg, seed=derive_seed(cfg.seed, j))


def _include_usage(req) -> bool:
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


def _check_stream_options(req, stream: bool) -> None:
    if req.stream_options is not None and not stream:
        raise RequestError("stream_options: only allowed with stream=true", "stream_options")


def _request_error(e: InputError) -> RequestError:
    """An engine refusal as a 400, with GenerationConfig's names mapped to OpenAI's."""
    msg, param = str(e), e.param
    if param == "max_new_tokens":
        param, msg = "max_tokens", msg.replace("max_new_tokens", "max_tokens")
    return RequestError(msg, param)


def error_body(message: str, param: str | None = None, err_type: str = "invalid_request_error", code: str | None = None) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


# ---- the ASGI app (FastAPI) ----------------------------------------------------------
def _require_serve_extra():
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import pydantic  # noqa: F401
    except ImportError as e:
        raise ServeError(f"serving needs the [serve] extra (FastAPI, uvicorn, jinja2, prometheus_client): pip install 'specrt[serve]' ({e})") from None


class _ApiKey:
    """ASGI middleware: ``/v1/*`` requests need ``Authorization: Bearer KEY`` (else 401
    with OpenAI's ``invalid_api_key`` error); other routes and CORS preflights pass."""

    def __init__(self, app, key: str, metrics):
        self.app, self.expected, self.metrics = app, f"Bearer {key}".encode(), metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            got = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                self.metrics.count("invalid")
                msg = (
                    "Incorrect API key provided"
                    if got
                    else "You didn't provide an API key. You need to provide your API key in an Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)"
                )
                await _send_json(send, 401, error_body(msg, None, "invalid_request_error", "invalid_api_key"), [(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)


class _BodyLimit:
    """ASGI middleware: a request body above ``limit`` bytes gets 413 before the app parses
    it (by ``Content-Length`` at once, else while it arrives); the body is then replayed."""

    def __init__(self, app, limit: int, metrics):
        self.app, self.limit, self.metrics = app, limit, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        too_big = length is not None and length.isdigit() and int(length) > self.limit
        messages, size = [], 0
        while not too_big:
            msg = await receive()
            messages.append(msg)
            if msg["type"] != "http.request":
                break
            size += len(msg.get("body", b""))
            too_big = size > self.limit
            if not msg.get("more_body", False):
                break
        if too_big:
            self.metrics.count("invalid")
            await _send_json(
                send,
                413,
                error_body(
                    f"request body is larger than {self.limit} bytes (the server's --max-body-bytes)", None, "invalid_request_error", "request_too_large"
                ),
            )
            return

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


async def _send_json(send, status: int, body: dict, headers=()) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": data})


def create_app(service: CompletionService, api_key: str | None = None, allowed_origins: Sequence[str] = (), max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
    """The FastAPI app serving ``service``; every error is OpenAI's JSON error object.

    Args:
        service: the :class:`CompletionService`.
        api_key: when set, ``/v1/*`` needs ``Authorization: Bearer <api_key>`` (401 otherwise).
        allowed_origins: browser origins allowed by CORS (Starlette's ``CORSMiddleware``;
            ``"*"`` = any); empty = no CORS headers.
        max_body_bytes: larger request bodies get 413 unparsed.

    Raises:
        ServeError: the ``[serve]`` extra is not installed, or ``max_body_bytes`` < 1.
    """
    _require_serve_extra()
    from fastapi import FastAPI, Request
    from fastapi.middleware.cors import CORSMiddleware
    from fastapi.responses import JSONResponse, StreamingResponse

    if max_body_bytes < 1:
        raise ServeError(f"max_body_bytes={max_body_bytes}; it must be >= 1")
    CompletionRequest, ChatRequest = completion_request_model(), chat_request_model()
    metrics = service.metrics
    app = FastAPI(title="specrt", summary="OpenAI-compatible completions and chat completions with speculative decoding", version="1")
    app.state.service = service
    fields = {"/v1/completions": field_names(CompletionRequest), "/v1/chat/completions": field_names(ChatRequest)}
    err = _install_error_handlers(app, metrics, fields)

    async def handle(body, request: Request, prepare):
        """Validate (off the loop), queue, then answer JSON or server-sent events."""
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        work = await loop.run_in_executor(None, prepare, body)
        jobs, events = service.submit(work)
        cid, created = service.new_id(work.chat), int(time.time())
        if work.stream:
            return StreamingResponse(
                _sse(service, work, jobs, events, cid, created, t0),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        kind, payload = await _collect(events, request, jobs)
        if kind == "done":
            body = await loop.run_in_executor(None, service.response_body, work, cid, created, payload, jobs)
            _record(service, work, jobs, payload, t0)
            return JSONResponse(body)
        if kind == "cancelled":
            metrics.count("cancelled")
            return err(499, "request cancelled", None, "cancelled")
        return _error_response(metrics, payload, err)

    async def completions(body, request: Request):
        """OpenAI ``/v1/completions``: JSON, or server-sent events with ``stream: true``."""
        return await handle(body, request, service.prepare_completion)

    async def chat_completions(body, request: Request):
        """OpenAI ``/v1/chat/completions``: the conversation rendered with the model's chat
        template; JSON, or server-sent ``chat.completion.chunk`` events with ``stream: true``."""
        return await handle(body, request, service.prepare_chat)

    # the body models are built at run time (pydantic is optional) and this module uses
    # postponed annotations: give FastAPI the real classes
    completions.__annotations__.update(body=CompletionRequest, request=Request)
    chat_completions.__annotations__.update(body=ChatRequest, request=Request)
    errors_doc = _error_responses()
    app.post("/v1/completions", responses=errors_doc)(completions)
    app.post("/v1/chat/completions", responses=errors_doc)(chat_completions)

    _add_info_routes(app, service, errors_doc)
    _document_400(app)
    app.add_middleware(_BodyLimit, limit=max_body_bytes, metrics=metrics)
    if api_key:
        app.add_middleware(_ApiKey, key=api_key, metrics=metrics)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"])
    return app


def _add_info_routes(app, service: CompletionService, errors_doc: dict) -> None:
    """``GET /v1/models``, ``/v1/models/{id}``, ``/metrics`` and ``/health`` on ``app``."""
    from fastapi.responses import Response

    metrics = service.metrics

    def model_card():
        return {"id": service.model_name, "object": "model", "created": service.created, "owned_by": "specrt", "max_model_len": service.engine.manifest.max_ctx}

    @app.get("/v1/models")
    async def models():
        """OpenAI ``/v1/models``: the one model this server serves (``created`` = server start)."""
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", responses={404: errors_doc[404]})
    async def model(model_id: str):
        """OpenAI ``/v1/models/{id}``: the model, or 404 ``model_not_found``."""
        service.check_model(model_id)
        return model_card()

    @app.get("/metrics")
    async def prom_metrics():
        """Prometheus text exposition (prometheus_client)."""
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/health")
    async def health():
        """Liveness plus the worker and queue figures."""
        return {
            "status": "ok",
            "model": service.model_name,
            "workers": service.pool.workers,
            "busy": service.pool.busy,
            "queued": service.pool.queued,
            **metrics.snapshot(),
        }


def _error_responses() -> dict:
    """OpenAPI ``responses`` of the POST routes: OpenAI's error object per status."""
    from pydantic import BaseModel

    class ErrorDetail(BaseModel):
        """OpenAI's error fields."""

        message: str
        type: str
        param: str | None = None
        code: str | None = None

    class ErrorResponse(BaseModel):
        """OpenAI's error object."""

        error: ErrorDetail

    doc = {
        400: "invalid request: JSON, a field's type or range, an unsupported value, or what the engine refuses (the message names the field)",
        401: "missing or wrong API key (only with --api-key)",
        404: "model not served here (code model_not_found)",
        413: "request body larger than --max-body-bytes",
        503: "queue full (type server_busy, Retry-After: 1)",
    }
    return {k: {"model": ErrorResponse, "description": v} for k, v in doc.items()}


def _document_400(app) -> None:
    """The OpenAPI schema says what the server answers: FastAPI documents 422 for body
    validation, this server answers 400 with OpenAI's error object, so 422 is dropped."""
    from fastapi.openapi.utils import get_openapi

    def openapi():
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            for ops in schema.get("paths", {}).values():
                for op in ops.values():
                    op.get("responses", {}).pop("422", None)
            comps = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                comps.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _install_error_handlers(app, metrics, fields: dict[str, list[str]]):
    """OpenAI-style JSON errors for validation failures, refusals, a full queue and unknown
    routes; returns ``err(status, message, param, type, headers, code)`` building such a response."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    def err(status: int, message: str, param=None, err_type="invalid_request_error", headers=None, code=None):
        return JSONResponse(error_body(message, param, err_type, code), status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        metrics.count("invalid")
        msg, param = validation_message(list(exc.errors()), fields.get(request.url.path, []))
        return err(400, msg, param)

    @app.exception_handler(RequestError)
    async def _refused(request: Request, exc: RequestError):
        metrics.count("invalid")
        return err(exc.status, str(exc), exc.param, exc.err_type, code=exc.code)

    @app.exception_handler(ServerBusy)
    async def _busy(request: Request, exc: ServerBusy):
        metrics.count("rejected")
        return err(503, str(exc), None, "server_busy", headers={"Retry-After": "1"})

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        hint = {
            404: f"no route {request.url.path}; routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /metrics, GET /health",
            405: f"method {request.method} not allowed on {request.url.path}",
        }.get(exc.status_code, str(exc.detail))
        return err(exc.status_code, hint, None, "invalid_request_error")

    return err


def _record(service: CompletionService, work: Work, jobs: list[Job], results: list, t0: float) -> None:
    """Metrics of one ok request: per generation (tokens, acceptance, queue time, time per
    output token), then the request (latency, time to first text)."""
    metrics = service.metrics
    for job, res in zip(jobs, results):
        tpot = None
        if job.first is not None and job.finished is not None and len(res.tokens) > 1:
            tpot = (job.finished - job.first) / (len(res.tokens) - 1)
        qt = None if job.started is None else job.started - job.enqueued
        metrics.generation(res.stats, res.finish_reason if job.generate else None, qt, tpot)
    firsts = [j.first for j in jobs if j.first is not None]
    metrics.request_done(time.perf_counter() - t0, min(firsts) - t0 if firsts else None)


def _error_response(metrics, exc: Exception, err):
    """A generation that raised: 400 for the project's input errors, else 500."""
    if isinstance(exc, InputError):
        metrics.count("invalid")
        return err(400, str(exc), exc.param)
    metrics.count("error")
    return err(500, f"generation failed: {type(exc).__name__}: {exc}", None, "server_error")


async def _wait_disconnect(request) -> None:
    """Return when the client has gone (``http.disconnect``); the body was already read."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(events: asyncio.Queue, request, jobs: list[Job]) -> tuple:
    """Every job's result (``("done", [results])``), or ``("cancelled", None)`` after
    cancelling them when the client disconnects first, or ``("error", exception)`` at the
    first failed generation (the others are cancelled)."""
    gone = asyncio.ensure_future(_wait_disconnect(request))
    results: list = [None] * len(jobs)
    pending = len(jobs)
    try:
        while pending:
            get = asyncio.ensure_future(events.get())
            done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()
                return ("cancelled", None)  # the workers drop the jobs at their next piece (or skip them)
            i, (kind, payload) = get.result()
            if kind == "done":
                results[i] = payload
                pending -= 1
            elif kind in ("cancelled", "error"):
                return (kind, payload)
        return ("done", results)
    finally:
        for j in jobs:
            j.cancelled.set()  # no-op once a job is done; cancels the rest
        gone.cancel()


async def _sse(service: CompletionService, work: Work, jobs: list[Job], events: asyncio.Queue, cid: str, created: int, t0: float):
    """Server-sent events for one streamed request (every choice interleaved, each chunk
    naming its ``index``); cancels the jobs if the client goes (Starlette cancels this
    generator on ``http.disconnect``).

    Per choice: chat sends a first chunk with ``delta.role``; completions with ``echo``
    send the prompt (and its logprobs) first; then text pieces; then a chunk with the
    ``finish_reason``. Logprob entries travel with the piece of the round that committed
    their tokens (their text may be held back to a later piece: UTF-8 boundaries, possible
    stop-string starts)."""
    metrics = service.metrics
    loop = asyncio.get_running_loop()
    results: list = [None] * len(jobs)
    seen: list[list[int]] = [[] for _ in jobs]  # output ids sent so far per choice (text offsets)
    left = len(jobs)
    ended = False

    def piece_logprobs(i: int, entries) -> dict | None:
        if work.top_n is None or entries is None:
            return None
        if work.chat:
            return service.chat_logprobs(entries, work.top_n)
        g = work.gens[i]
        if g.echo_text is not None:
            base = len(g.echo_text) - len(service.engine.codec.decode(g.ids))
            out = service.completion_logprobs(entries, list(g.ids) + seen[i], 0, work.top_n)
            out["text_offset"] = [base + o for o in out["text_offset"]]
        else:
            out = service.completion_logprobs(entries, seen[i], 0, work.top_n)
        seen[i].extend(e.token for e in entries)
        return out

    def prompt_chunk(i: int, entries) -> str:
        g = work.gens[i]
        lp = None
        if work.top_n is not None and entries is not None:
            lp = service.completion_logprobs(service._prompt_entries(entries, g.ids), [], 0, work.top_n)
        return service.chunk(work, cid, created, i, g.echo_text, None, lp)

    try:
        if work.chat:
            for i in range(len(jobs)):
                yield service.chunk(work, cid, created, i, role=True)
        while left:
            i, (kind, payload) = await events.get()
            if kind == "prompt":
                yield await loop.run_in_executor(None, prompt_chunk, i, payload)
            elif kind == "text":
                piece, entries = payload
                if work.top_n is not None:
                    lp = await loop.run_in_executor(None, piece_logprobs, i, entries)
                    yield service.chunk(work, cid, created, i, piece, None, lp)
                else:
                    yield service.chunk(work, cid, created, i, piece)
            elif kind == "done":
                results[i] = payload
                left -= 1
                rest = payload.logprobs[jobs[i].lp_sent :] if payload.logprobs is not None and work.top_n is not None else None
                lp = await loop.run_in_executor(None, piece_logprobs, i, rest) if rest else None
                yield service.chunk(work, cid, created, i, "", payload.finish_reason, lp)
            else:
                ended = True
                if kind == "cancelled":
                    metrics.count("cancelled")
                    yield f"data: {json.dumps(error_body('request cancelled', None, 'cancelled'))}\n\n"
                elif isinstance(payload, InputError):
                    metrics.count("invalid")
                    yield f"data: {json.dumps(error_body(str(payload), payload.param))}\n\n"
                else:
                    metrics.count("error")
                    yield f"data: {json.dumps(error_body(f'generation failed: {type(payload).__name__}: {payload}', None, 'server_error'))}\n\n"
                yield "data: [DONE]\n\n"
                return
        ended = True
        _record(service, work, jobs, results, t0)
        if work.include_usage:
            yield service.usage_chunk(work, cid, created, results)
        yield "data: [DONE]\n\n"
    finally:
        for j in jobs:
            j.cancelled.set()
        if not ended:
            metrics.count("cancelled")  # the client left mid-stream


# ---- running -------------------------------------------------------------------------
def build_service(
    engines: str | Path,
    workers: int = 1,
    max_queue: int = 64,
    threads=None,
    backend: str | None = None,
    model_name: str | None = None,
    round_delay: float = 0.0,
    chat_template: str | Path | None = None,
    max_batch: int = 0,
    batch_policy: str = "auto",
    max_tokens_in_flight: int | None = None,
) -> CompletionService:
    """Load the worker pool and wrap it in a :class:`CompletionService`.

    Args:
        engines: the engine folder.
        workers: generator workers (Engines); workers x onnxruntime threads should not
            exceed the cores.
        max_queue: generations that may wait for a worker (503 beyond).
        threads: :class:`~specrt.runtime.backends.base.ThreadConfig` for every Engine.
        backend: Engine backend (None: the machine's default).
        model_name: the ``model`` id clients use (default: the folder's name).
        round_delay: test hook (see :class:`WorkerPool`).
        chat_template: a Jinja2 template file overriding the folder's ``chat_template.jinja``.
        max_batch: > 0: continuous batching of up to this many requests in one scheduler
            (:class:`~specrt.runtime.serve.batching.BatchPool`; ``workers`` is ignored).
        batch_policy, max_tokens_in_flight: the BatchPool's ``policy`` and ``max_tokens``.

    Raises:
        EngineError, BackendError: the engine folder cannot be loaded.
        ServeError: the chat template cannot be read or compiled.
    """
    from .chat import ChatTemplate, TemplateSourceError, load_chat_template, special_token_strings

    if max_batch > 0:
        from .batching import BatchPool

        pool = BatchPool.load(
            engines,
            max_batch,
            threads=threads,
            backend=backend,
            max_queue=max_queue,
            max_tokens=max_tokens_in_flight,
            policy=batch_policy,
            round_delay=round_delay,
        )
    else:
        pool = WorkerPool.load(engines, workers=workers, max_queue=max_queue, threads=threads, backend=backend, round_delay=round_delay)
    engine = pool.engines[0]
    m = engine.manifest
    special = special_token_strings(engine)
    try:
        if chat_template is not None:
            template = load_chat_template(chat_template, special)
        elif engine.chat_template is not None:
            template = ChatTemplate(engine.chat_template, str(Path(engines) / m.chat_template_file), special)
        else:
            template = None
    except TemplateSourceError as e:
        pool.close()
        raise ServeError(str(e)) from None
    return CompletionService(pool, model_name or Path(engines).resolve().name, template)


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def serve(
    engines: str | Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    workers: int = 1,
    max_queue: int = 64,
    threads=None,
    backend: str | None = None,
    model_name: str | None = None,
    log_level: str = "info",
    round_delay: float = 0.0,
    chat_template: str | Path | None = None,
    api_key: str | None = None,
    allowed_origins: Sequence[str] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_batch: int = 0,
    batch_policy: str = "auto",
    max_tokens_in_flight: int | None = None,
) -> None:
    """Load the engines, then serve them with uvicorn until interrupted (Ctrl-C / SIGTERM).

    Logs one line naming the model, engine folder, backend, workers (or the batching
    settings with ``max_batch``) and threads (and the chat template), and a warning when
    workers x threads exceeds the cores (``max_batch``: one scheduler thread).

    Raises:
        ServeError: the ``[serve]`` extra is missing; a bad chat template.
        EngineError, BackendError: the engine folder cannot be loaded.
    """
    _require_serve_extra()
    try:
        import uvicorn
    except ImportError as e:
        raise ServeError(f"serving needs the [serve] extra (FastAPI, uvicorn): pip install 'specrt[serve]' ({e})") from None
    from ..backends.base import ThreadConfig

    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(log_level.upper())
    tc = threads or ThreadConfig()
    service = build_service(engines, workers, max_queue, tc, backend, model_name, round_delay, chat_template, max_batch, batch_policy, max_tokens_in_flight)
    app = create_app(service, api_key=api_key, allowed_origins=allowed_origins, max_body_bytes=max_body_bytes)
    tpl = service.chat_template.origin if service.chat_template is not None else "none (chat completions answer 400)"
    if max_batch > 0:  # one scheduler thread runs every row
        workers = 1
    log.info(
        "specrt serve: model %r from %s, backend %s, %s x %d thread(s) (draft %d), chat template %s, on http://%s:%d",
        service.model_name,
        Path(engines).resolve(),
        service.engine.backend,
        f"continuous batching of up to {max_batch} requests (policy {batch_policy}), 1 scheduler" if max_batch > 0 else f"{workers} worker(s)",
        tc.intra_op,
        tc.for_draft(service.engine.manifest.draft.params).intra_op,
        tpl,
        host,
        port,
    )
    cores = available_cores()
    if workers * tc.intra_op > cores:
        log.warning(
            "%d worker(s) x %d thread(s) = %d threads on %d core(s): oversubscribed, every request gets slower; use --workers x --threads <= %d",
            workers,
            tc.intra_op,
            workers * tc.intra_op,
            cores,
            cores,
        )
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    finally:
        service.pool.close()
