"""OpenAI-compatible HTTP serving: ``POST /v1/completions`` (JSON or server-sent events),
``GET /metrics`` (Prometheus text), ``GET /v1/models``, ``GET /health``.

Layout (one process)::

    uvicorn (asyncio, FastAPI)  --validate-->  bounded queue  -->  N worker threads
         ^   one asyncio.Queue per request   <--  text pieces / result  --  each owns an Engine

- Requests are validated on the event loop (JSON body, fields, engine limits, tokenizing
  the prompt) and refused with a 4xx JSON error before anything is queued.
- A valid request becomes a :class:`Job` in a bounded ``queue.Queue`` (``max_queue``);
  a full queue answers 503 at once. ``workers`` threads each own one :class:`Engine`
  (its own KV buffers; :meth:`Engine.fork` shares the loaded sessions), take jobs in
  arrival order and run them with :meth:`Engine.stream`; onnxruntime releases the GIL
  inside its runs.
- A client that disconnects (streaming or not) sets the job's ``cancelled`` event; the
  worker checks it between the stream's pieces (each round that releases text), closes
  the stream (which releases the Engine) and takes the next job. A job cancelled while
  still queued is skipped.

FastAPI and uvicorn are the optional ``[serve]`` extra: this module imports them only in
:func:`create_app` and :func:`serve`, so the base runtime imports without them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import BackendError, InputError, SpecRTError

__all__ = [
    "OPENAI_MAX_STOPS",
    "MAX_TEMPERATURE",
    "DEFAULT_MAX_TOKENS",
    "LATENCY_BUCKETS",
    "ServeError",
    "ServerBusy",
    "RequestError",
    "Histogram",
    "Metrics",
    "Job",
    "WorkerPool",
    "usage_block",
    "CompletionService",
    "error_body",
    "request_model",
    "validation_message",
    "create_app",
    "build_service",
    "serve",
]

log = logging.getLogger("specrt.serve")

OPENAI_MAX_STOPS = 4  # what the OpenAI API allows per request
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServeError(SpecRTError):
    """The server cannot start: the ``[serve]`` extra is missing, or bad server settings."""


class ServerBusy(SpecRTError):
    """The request queue is full (answered 503 with ``Retry-After``)."""


class RequestError(SpecRTError):
    """A request the server refuses before queueing it.

    Attributes:
        status: HTTP status (400, 404, ...).
        param: the request field at fault, or None.
        err_type: OpenAI error ``type`` (``invalid_request_error`` ...).
    """

    def __init__(self, message: str, param: str | None = None, status: int = 400, err_type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.err_type = status, param, err_type


# ---- metrics -------------------------------------------------------------------------
class Histogram:
    """A Prometheus-style cumulative histogram (thread-safe through :class:`Metrics`' lock)."""

    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # last: +Inf
        self.total = 0.0
        self.n = 0

    def observe(self, v: float) -> None:
        """Count one observation ``v`` (seconds)."""
        i = 0
        while i < len(self.buckets) and v > self.buckets[i]:
            i += 1
        self.counts[i] += 1
        self.total += v
        self.n += 1

    def lines(self, name: str) -> list[str]:
        """Exposition lines: cumulative ``_bucket{le=...}``, ``_sum``, ``_count``."""
        out, cum = [], 0
        for b, c in zip(self.buckets + (math.inf,), self.counts):
            cum += c
            le = "+Inf" if b == math.inf else repr(float(b))
            out.append(f'{name}_bucket{{le="{le}"}} {cum}')
        out.append(f"{name}_sum {self.total:.6f}")
        out.append(f"{name}_count {self.n}")
        return out


class Metrics:
    """Server counters, gauges and latency histograms; :meth:`render` gives the Prometheus
    text exposition format (version 0.0.4).

    Outcomes counted in ``specrt_requests_total{outcome=...}``: ``ok`` (completed),
    ``cancelled`` (client went away), ``invalid`` (4xx), ``rejected`` (503, queue full),
    ``error`` (500).
    """

    OUTCOMES = ("ok", "cancelled", "invalid", "rejected", "error")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = dict.fromkeys(self.OUTCOMES, 0)
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.proposed = 0
        self.accepted = 0
        self.passes = 0
        self.latency = Histogram()
        self.ttft = Histogram()
        self.queue_wait = Histogram()

    def count(self, outcome: str) -> None:
        """Count one request with ``outcome`` (one of :attr:`OUTCOMES`)."""
        with self._lock:
            self.requests[outcome] += 1

    def record(self, outcome: str, stats=None, latency: float | None = None, ttft: float | None = None, queue_wait: float | None = None) -> None:
        """Count one finished request and add its generation statistics and timings."""
        with self._lock:
            self.requests[outcome] += 1
            if stats is not None:
                self.prompt_tokens += stats.prompt_tokens
                self.completion_tokens += stats.new_tokens
                self.proposed += stats.proposed
                self.accepted += stats.accepted
                self.passes += stats.passes
            if latency is not None:
                self.latency.observe(latency)
            if ttft is not None:
                self.ttft.observe(ttft)
            if queue_wait is not None:
                self.queue_wait.observe(queue_wait)

    def snapshot(self) -> dict:
        """The counters as a dict (for tests and /health)."""
        with self._lock:
            return dict(
                requests=dict(self.requests),
                prompt_tokens=self.prompt_tokens,
                completion_tokens=self.completion_tokens,
                proposed=self.proposed,
                accepted=self.accepted,
                passes=self.passes,
            )

    def render(self, gauges: dict[str, tuple[str, float]]) -> str:
        """Prometheus text; ``gauges`` maps a metric name to (help, value)."""
        with self._lock:
            lines: list[str] = []

            def metric(name, kind, help_, samples):
                lines.append(f"# HELP {name} {help_}")
                lines.append(f"# TYPE {name} {kind}")
                lines.extend(samples)

            metric(
                "specrt_requests_total",
                "counter",
                "Completion requests by outcome (ok, cancelled, invalid, rejected, error).",
                [f'specrt_requests_total{{outcome="{o}"}} {n}' for o, n in self.requests.items()],
            )
            metric("specrt_prompt_tokens_total", "counter", "Prompt tokens of finished generations.", [f"specrt_prompt_tokens_total {self.prompt_tokens}"])
            metric(
                "specrt_generation_tokens_total",
                "counter",
                "Tokens generated (finished generations).",
                [f"specrt_generation_tokens_total {self.completion_tokens}"],
            )
            metric(
                "specrt_draft_tokens_proposed_total",
                "counter",
                "Draft candidates proposed to the target.",
                [f"specrt_draft_tokens_proposed_total {self.proposed}"],
            )
            metric(
                "specrt_draft_tokens_accepted_total",
                "counter",
                "Draft candidates the target accepted.",
                [f"specrt_draft_tokens_accepted_total {self.accepted}"],
            )
            metric(
                "specrt_verify_passes_total",
                "counter",
                "Target passes after prefill (verification or plain decode).",
                [f"specrt_verify_passes_total {self.passes}"],
            )
            rate = self.accepted / self.proposed if self.proposed else math.nan
            mean = self.accepted / self.passes if self.passes else math.nan
            metric("specrt_acceptance_rate", "gauge", "Accepted / proposed draft candidates since start (NaN before any).", [f"specrt_acceptance_rate {rate}"])
            metric(
                "specrt_mean_accepted_length",
                "gauge",
                "Mean accepted draft candidates per target pass since start (tokens per pass = this + 1).",
                [f"specrt_mean_accepted_length {mean}"],
            )
            metric(
                "specrt_request_latency_seconds",
                "histogram",
                "Request arrival to last byte (finished requests).",
                self.latency.lines("specrt_request_latency_seconds"),
            )
            metric(
                "specrt_time_to_first_token_seconds",
                "histogram",
                "Request arrival to the first text piece (streamed requests).",
                self.ttft.lines("specrt_time_to_first_token_seconds"),
            )
            metric("specrt_queue_wait_seconds", "histogram", "Time a job waited in the queue for a worker.", self.queue_wait.lines("specrt_queue_wait_seconds"))
            for name, (help_, value) in gauges.items():
                metric(name, "gauge", help_, [f"{name} {value}"])
            return "\n".join(lines) + "\n"


# ---- workers -------------------------------------------------------------------------
@dataclass
class Job:
    """One generation for a worker.

    Attributes:
        ids: validated prompt token ids.
        config: resolved :class:`GenerationConfig`.
        emit: thread-safe callback receiving the events ``("text", str)``,
            ``("done", GenerationResult)``, ``("cancelled", None)``, ``("error", Exception)``.
        stream: emit ``("text", ...)`` pieces (else only the final event).
        cancelled: set it to stop the job at the next piece (or skip it while queued).
        enqueued: ``time.perf_counter()`` when queued.
    """

    ids: list[int]
    config: Any
    emit: Callable[[tuple], None]
    stream: bool = False
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.perf_counter)
    started: float | None = None


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
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise ServerBusy(f"server busy: {self.max_queue} requests already queued for {self.workers} worker(s); retry later") from None

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
        """Run one job with :meth:`Engine.stream`, checking ``job.cancelled`` between pieces."""
        job.started = time.perf_counter()
        stream = None
        try:
            stream = engine.stream(job.ids, job.config)
            for piece in stream:
                if job.cancelled.is_set():
                    break
                if job.stream:
                    job.emit(("text", piece))
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
        job.emit({"ok": ("done", payload), "cancelled": ("cancelled", None), "error": ("error", payload)}[outcome])


# ---- request handling (framework-independent parts) ------------------------------------
def _finite(x: float | None) -> float | None:
    """JSON has no NaN: None for NaN/inf."""
    return None if x is None or not math.isfinite(x) else round(float(x), 6)


def usage_block(result) -> dict:
    """OpenAI ``usage`` with the speculative statistics under ``usage["speculative"]``."""
    s = result.stats
    return {
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.new_tokens,
        "total_tokens": s.prompt_tokens + s.new_tokens,
        "speculative": {
            "proposed": s.proposed,
            "accepted": s.accepted,
            "acceptance_rate": _finite(s.acceptance_rate),
            "mean_accepted": _finite(s.mean_accepted),
            "tokens_per_pass": _finite(s.tokens_per_pass),
            "passes": s.passes,
            "draft_calls": s.draft_calls,
            "accepted_hist": list(s.accepted_hist),
            "prefill_seconds": _finite(s.prefill_seconds),
            "draft_seconds": _finite(s.draft_seconds),
            "target_seconds": _finite(s.target_seconds),
            "total_seconds": _finite(s.total_seconds),
            "stop_reason": getattr(result, "stop_reason", None),
        },
    }


class CompletionService:
    """The serving logic behind the routes, independent of the ASGI app that mounts it
    (the same object serves ``specrt serve`` and a Ray Serve replica).

    Args:
        pool: the :class:`WorkerPool`.
        model_name: the id clients may send as ``model`` (any other is a 404).
    """

    def __init__(self, pool: WorkerPool, model_name: str):
        self.pool = pool
        self.model_name = model_name
        self.metrics = Metrics()
        self._ids = itertools.count(1)
        self.engine = pool.engines[0]  # validation and tokenizing only (no generation)

    # -- validation --
    def prepare(self, req) -> tuple[list[int], Any]:
        """(prompt ids, resolved GenerationConfig) for a validated request model.

        Raises:
            RequestError: wrong model, several prompts, or what the engine refuses
                (prompt too long or empty, k_max/threshold out of range, ...).
        """
        from ..config import GenerationConfig

        if req.model is not None and req.model != self.model_name:
            raise RequestError(
                f"model {req.model!r} is not served here; this server serves {self.model_name!r} (GET /v1/models)", "model", 404, "model_not_found"
            )
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise RequestError(
                    f"prompt: a batch of {len(prompt)} prompts; this server takes one prompt per request (a string, a list of token ids, or a list of one of those)",
                    "prompt",
                )
            prompt = prompt[0]
        stop = req.stop
        if isinstance(stop, str):
            stop = (stop,)
        cfg = GenerationConfig(
            max_new_tokens=req.max_tokens,
            k_max=req.k_max,
            threshold=req.threshold,
            speculative=req.speculative,
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            seed=req.seed,
            stop=tuple(stop or ()),
        )
        try:
            cfg = self.engine.resolve(cfg)
            ids = self.engine.prompt_ids(prompt)
        except InputError as e:
            msg, param = str(e), e.param
            if param == "max_new_tokens":
                param, msg = "max_tokens", msg.replace("max_new_tokens", "max_tokens")
            raise RequestError(msg, param) from None
        return ids, cfg

    def new_id(self) -> str:
        """A fresh completion id (``cmpl-...``)."""
        return f"cmpl-{uuid.uuid4().hex[:16]}{next(self._ids)}"

    def submit(self, ids, cfg, stream: bool) -> tuple[Job, asyncio.Queue]:
        """Queue a job whose events arrive on the returned asyncio.Queue (this loop's).

        Raises:
            ServerBusy: the queue is full.
        """
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(ev, _put=events.put_nowait):
            try:
                loop.call_soon_threadsafe(_put, ev)
            except RuntimeError:  # loop closed (server shutting down)
                pass

        job = Job(ids=ids, config=cfg, emit=emit, stream=stream)
        self.pool.submit(job)
        return job, events

    def gauges(self) -> dict[str, tuple[str, float]]:
        """The live gauges for /metrics."""
        return {
            "specrt_workers": ("Generator workers (each owns one Engine).", self.pool.workers),
            "specrt_workers_busy": ("Workers running a generation now.", self.pool.busy),
            "specrt_queue_depth": ("Requests waiting for a worker.", self.pool.queued),
            "specrt_queue_capacity": ("Most requests that may wait (--max-queue).", self.pool.max_queue),
        }

    # -- responses --
    def completion_body(self, cid: str, created: int, result) -> dict:
        """The non-streaming ``text_completion`` object."""
        return {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": [{"text": result.text, "index": 0, "logprobs": None, "finish_reason": result.finish_reason}],
            "usage": usage_block(result),
        }

    def chunk(self, cid: str, created: int, text: str, finish_reason: str | None = None) -> str:
        """One server-sent event carrying a ``text_completion`` chunk."""
        body = {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}],
        }
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def error_body(message: str, param: str | None = None, err_type: str = "invalid_request_error", code: str | None = None) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


# ---- the ASGI app (FastAPI) ----------------------------------------------------------
def _require_serve_extra():
    try:
        import fastapi  # noqa: F401
        import pydantic  # noqa: F401
    except ImportError as e:
        raise ServeError(f"serving needs the [serve] extra (FastAPI, uvicorn): pip install 'specrt[serve]' ({e})") from None


def request_model():
    """The pydantic model of a ``/v1/completions`` body (built on first use: pydantic is part
    of the optional ``[serve]`` extra). Unknown fields are refused; the OpenAI fields this
    server does not implement are accepted only at their no-op values (n=1, best_of=1,
    echo=false, logprobs=null, suffix=null, zero penalties, empty logit_bias)."""
    global _RequestModel
    if _RequestModel is not None:
        return _RequestModel
    _require_serve_extra()
    from typing import Optional, Union

    from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

    class StreamOptions(BaseModel):
        """``stream_options``: ``include_usage`` adds a chunk with the usage block before [DONE]."""

        model_config = ConfigDict(extra="forbid")
        include_usage: StrictBool = False

    class CompletionRequest(BaseModel):
        """Body of ``POST /v1/completions`` (OpenAI fields, plus specrt's ``top_k``,
        ``k_max``, ``threshold``, ``speculative``)."""

        model_config = ConfigDict(extra="forbid")
        model: Optional[StrictStr] = None
        prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]] = Field(
            description="a string, a list of token ids, or a list of one of those"
        )
        max_tokens: StrictInt = Field(DEFAULT_MAX_TOKENS, ge=1, description="tokens to generate at most")
        temperature: StrictFloat = Field(1.0, ge=0.0, le=MAX_TEMPERATURE, description="0 = greedy")
        top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0)
        top_k: StrictInt = Field(0, ge=0, description="specrt extension; 0 = off")
        stop: Optional[Union[StrictStr, list[StrictStr]]] = Field(None, description=f"up to {OPENAI_MAX_STOPS} stop strings")
        stream: StrictBool = False
        stream_options: Optional[StreamOptions] = None
        seed: Optional[StrictInt] = Field(None, ge=0, le=2**63 - 1)
        n: StrictInt = 1
        best_of: Optional[StrictInt] = None
        echo: StrictBool = False
        logprobs: Optional[StrictInt] = None
        suffix: Optional[StrictStr] = None
        presence_penalty: StrictFloat = 0.0
        frequency_penalty: StrictFloat = 0.0
        logit_bias: Optional[dict[str, StrictFloat]] = None
        user: Optional[StrictStr] = None
        k_max: Optional[StrictInt] = Field(None, description="specrt extension: most draft candidates per verification")
        threshold: Optional[StrictFloat] = Field(None, description="specrt extension: draft confidence threshold in [0, 1]")
        speculative: StrictBool = Field(True, description="specrt extension: false runs the target alone")

        @field_validator("stop")
        @classmethod
        def _stops(cls, v):
            if isinstance(v, list) and len(v) > OPENAI_MAX_STOPS:
                raise ValueError(f"at most {OPENAI_MAX_STOPS} stop strings are allowed")
            return v

        @field_validator(*_NO_OP_VALUES)
        @classmethod
        def _no_op_only(cls, v, info):
            if v not in _NO_OP_VALUES[info.field_name]:
                raise ValueError(_UNSUPPORTED_HINTS[info.field_name])
            return v

    _RequestModel = CompletionRequest
    return CompletionRequest


_RequestModel = None

# OpenAI fields accepted only at the values that change nothing
_NO_OP_VALUES = {
    "n": (1,),
    "best_of": (None, 1),
    "echo": (False,),
    "logprobs": (None,),
    "suffix": (None, ""),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "logit_bias": (None, {}),
}
_UNSUPPORTED_HINTS = {
    "logit_bias": "logit_bias is not supported; send null or {}",
    "n": "only n=1 is supported (one completion per request)",
    "best_of": "only best_of=1 (or null) is supported",
    "echo": "only echo=false is supported",
    "logprobs": "logprobs are not supported; send null or leave it out",
    "suffix": "suffix is not supported; send null or leave it out",
    "presence_penalty": "only presence_penalty=0 is supported",
    "frequency_penalty": "only frequency_penalty=0 is supported",
}


def validation_message(errors: list[dict], fields: Sequence[str]) -> tuple[str, str | None]:
    """One readable message (and the first field at fault) from pydantic's error list:
    one part per field, naming it, what was sent and what is allowed."""
    by_field: dict[str, list[dict]] = {}
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            return f"request body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')})", None
        if not loc:
            got = err.get("input")
            return f"request body must be a JSON object, got {type(got).__name__}", None
        by_field.setdefault(loc[0], []).append(dict(err, _loc=loc))
    parts = []
    for name, errs in by_field.items():
        err = errs[0]
        etype, got, where = err.get("type", ""), err.get("input"), ".".join(err["_loc"])
        shown = json.dumps(got) if _jsonable(got) else repr(got)
        if etype == "extra_forbidden":
            parts.append(f"{name}: unknown field; allowed fields: {', '.join(fields)}")
        elif etype == "missing":
            parts.append(f"{name}: required field missing")
        elif name == "prompt" and (len(errs) > 1 or etype.endswith("_type")):
            parts.append(f"prompt: must be a string, a list of token ids, or a list of one of those (got {shown})")
        elif name == "stop" and len(errs) > 1:
            parts.append(f"stop: must be a string or a list of at most {OPENAI_MAX_STOPS} strings (got {shown})")
        elif name in _UNSUPPORTED_HINTS and len(err["_loc"]) == 1:
            parts.append(f"{name}: {_UNSUPPORTED_HINTS[name]} (got {shown})")
        else:
            msg = err.get("msg", "invalid value").removeprefix("Value error, ")
            parts.append(f"{where}: {msg} (got {shown})")
    return "; ".join(parts), next(iter(by_field), None)


def _jsonable(x) -> bool:
    try:
        json.dumps(x)
        return True
    except (TypeError, ValueError):
        return False


def create_app(service: CompletionService):
    """The FastAPI app serving ``service``: ``/v1/completions``, ``/v1/models``, ``/metrics``,
    ``/health``; every error is OpenAI's JSON error object with a 4xx/5xx status.

    Raises:
        ServeError: FastAPI is not installed (the ``[serve]`` extra).
    """
    _require_serve_extra()
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    CompletionRequest = request_model()
    fields = list(CompletionRequest.model_fields)
    metrics = service.metrics
    app = FastAPI(title="specrt", summary="OpenAI-compatible completions with speculative decoding", version="1")
    app.state.service = service

    err = _install_error_handlers(app, metrics, fields)

    async def completions(body, request: Request):
        """OpenAI ``/v1/completions``: JSON, or server-sent events with ``stream: true``."""
        t0 = time.perf_counter()
        ids, cfg = service.prepare(body)
        if body.stream_options is not None and not body.stream:
            raise RequestError("stream_options: only allowed with stream=true", "stream_options")
        job, events = service.submit(ids, cfg, body.stream)
        cid, created = service.new_id(), int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _sse(service, job, events, cid, created, include_usage, t0),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        ev = await _wait_or_disconnect(events, request, job)
        kind, payload = ev
        if kind == "done":
            metrics.record("ok", payload.stats, latency=time.perf_counter() - t0, queue_wait=_qwait(job))
            return JSONResponse(service.completion_body(cid, created, payload))
        if kind == "cancelled":
            metrics.record("cancelled", queue_wait=_qwait(job))
            return err(499, "request cancelled", None, "cancelled")
        return _error_response(metrics, payload, err)

    # the body model is built at run time (pydantic is optional) and this module uses
    # postponed annotations: give FastAPI the real classes
    completions.__annotations__.update(body=CompletionRequest, request=Request)
    app.post("/v1/completions")(completions)

    @app.get("/v1/models")
    async def models():
        """OpenAI ``/v1/models``: the one model this server serves."""
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": 0, "owned_by": "specrt"}]}

    @app.get("/metrics")
    async def prom_metrics():
        """Prometheus text exposition."""
        extra = service.pool.render_metrics() if hasattr(service.pool, "render_metrics") else ""
        return PlainTextResponse(metrics.render(service.gauges()) + extra, media_type="text/plain; version=0.0.4; charset=utf-8")

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

    return app


def _install_error_handlers(app, metrics: Metrics, fields: list[str]):
    """OpenAI-style JSON errors for validation failures, refusals, a full queue and unknown
    routes; returns ``err(status, message, param, type, headers)`` building such a response."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    def err(status: int, message: str, param=None, err_type="invalid_request_error", headers=None):
        return JSONResponse(error_body(message, param, err_type), status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        metrics.count("invalid")
        msg, param = validation_message(list(exc.errors()), fields)
        return err(400, msg, param)

    @app.exception_handler(RequestError)
    async def _refused(request: Request, exc: RequestError):
        metrics.count("invalid")
        return err(exc.status, str(exc), exc.param, exc.err_type)

    @app.exception_handler(ServerBusy)
    async def _busy(request: Request, exc: ServerBusy):
        metrics.count("rejected")
        return err(503, str(exc), None, "server_busy", headers={"Retry-After": "1"})

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        hint = {
            404: f"no route {request.url.path}; routes: POST /v1/completions, GET /v1/models, GET /metrics, GET /health",
            405: f"method {request.method} not allowed on {request.url.path}",
        }.get(exc.status_code, str(exc.detail))
        return err(exc.status_code, hint, None, "invalid_request_error")

    return err


def _qwait(job: Job) -> float | None:
    return None if job.started is None else job.started - job.enqueued


def _error_response(metrics: Metrics, exc: Exception, err):
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


async def _wait_or_disconnect(events: asyncio.Queue, request, job: Job) -> tuple:
    """The job's final event, or ``("cancelled", None)`` after cancelling it when the
    client disconnects first."""
    get = asyncio.ensure_future(events.get())
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
        if get in done:
            return get.result()
        return ("cancelled", None)  # the worker drops the job at its next piece (or skips it)
    finally:
        job.cancelled.set()  # no-op once the job is done; cancels it if this task is cancelled
        for t in (get, gone):
            t.cancel()


async def _sse(service: CompletionService, job: Job, events: asyncio.Queue, cid: str, created: int, include_usage: bool, t0: float):
    """Server-sent events for one streamed completion; cancels the job if the client goes
    (Starlette cancels this generator on ``http.disconnect``)."""
    metrics = service.metrics
    first = None
    finished = False
    try:
        while True:
            kind, payload = await events.get()
            if kind == "text":
                if first is None:
                    first = time.perf_counter() - t0
                yield service.chunk(cid, created, payload)
                continue
            finished = True
            if kind == "done":
                metrics.record("ok", payload.stats, latency=time.perf_counter() - t0, ttft=first, queue_wait=_qwait(job))
                yield service.chunk(cid, created, "", payload.finish_reason)
                if include_usage:
                    body = {
                        "id": cid,
                        "object": "text_completion",
                        "created": created,
                        "model": service.model_name,
                        "choices": [],
                        "usage": usage_block(payload),
                    }
                    yield f"data: {json.dumps(body)}\n\n"
            elif kind == "cancelled":
                metrics.record("cancelled", queue_wait=_qwait(job))
                yield f"data: {json.dumps(error_body('request cancelled', None, 'cancelled'))}\n\n"
            else:
                if isinstance(payload, InputError):
                    metrics.count("invalid")
                    body = error_body(str(payload), payload.param)
                else:
                    metrics.count("error")
                    body = error_body(f"generation failed: {type(payload).__name__}: {payload}", None, "server_error")
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
            return
    finally:
        if not finished:
            job.cancelled.set()
            # the worker still reports the job's end; count it as cancelled there
            metrics.count("cancelled")


# ---- running -------------------------------------------------------------------------
def build_service(
    engines: str | Path,
    workers: int = 1,
    max_queue: int = 64,
    threads=None,
    backend: str | None = None,
    model_name: str | None = None,
    round_delay: float = 0.0,
    max_batch: int = 0,
    batch_policy: str = "auto",
    max_tokens_in_flight: int | None = None,
) -> CompletionService:
    """Load the worker pool and wrap it in a :class:`CompletionService`.

    Args:
        engines: the engine folder.
        workers: generator workers (Engines); workers x onnxruntime threads should not
            exceed the cores.
        max_queue: requests that may wait for a worker (503 beyond).
        threads: :class:`~specrt.runtime.ort_backend.ThreadConfig` for every Engine.
        backend: Engine backend (None: the machine's default).
        model_name: the ``model`` id clients use (default: the folder's name).
        round_delay: test hook (see :class:`WorkerPool`).
        max_batch: > 0: continuous batching of up to this many requests in one scheduler
            (:class:`~specrt.runtime.serve.batching.BatchPool`; ``workers`` is ignored).
        batch_policy, max_tokens_in_flight: the BatchPool's ``policy`` and ``max_tokens``.
    """
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
    return CompletionService(pool, model_name or Path(engines).resolve().name)


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
    max_batch: int = 0,
    batch_policy: str = "auto",
    max_tokens_in_flight: int | None = None,
) -> None:
    """Load the engines, then serve them with uvicorn until interrupted (Ctrl-C / SIGTERM).

    Raises:
        ServeError: the ``[serve]`` extra is missing.
        EngineError, BackendError: the engine folder cannot be loaded.
    """
    _require_serve_extra()
    try:
        import uvicorn
    except ImportError as e:
        raise ServeError(f"serving needs the [serve] extra (FastAPI, uvicorn): pip install 'specrt[serve]' ({e})") from None
    service = build_service(engines, workers, max_queue, threads, backend, model_name, round_delay, max_batch, batch_policy, max_tokens_in_flight)
    app = create_app(service)
    log.info("serving %s with %d worker(s) on http://%s:%d", service.model_name, workers, host, port)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    finally:
        service.pool.close()
