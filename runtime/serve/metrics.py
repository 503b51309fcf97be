"""Prometheus metrics of ``specrt serve`` (``GET /metrics``), with ``prometheus_client``.

Names and meanings follow vLLM's metrics where one exists (vLLM ``vllm/v1/metrics/loggers.py``:
``time_to_first_token_seconds``, ``time_per_output_token_seconds``,
``e2e_request_latency_seconds``, ``request_queue_time_seconds``, ``prompt_tokens_total``,
``generation_tokens_total``, ``request_success_total{finished_reason}``, acceptance per draft
position ``spec_decode_num_accepted_tokens_per_pos``), with the prefix ``specrt_`` and
every series labelled ``model_name`` (the served id) as vLLM does. prometheus_client's
process collector adds ``process_*`` (CPU seconds, resident memory, open files, start
time) and its platform collector ``python_info``. ``*_created`` series are off
(``prometheus_client.disable_created_metrics``, process-wide).

One registry per :class:`ServerMetrics` (not the global one), so two servers in one
process never collide. prometheus_client is part of the ``[serve]`` extra and imported only
when a :class:`ServerMetrics` is made.
"""

from __future__ import annotations

import threading
from typing import Callable

from ..stats import acceptance_rate, mean_accepted

__all__ = ["ServerMetrics", "BatchMetrics", "LATENCY_BUCKETS", "TPOT_BUCKETS", "QUEUE_DEPTH_BUCKETS", "TOKENS_PER_PASS_BUCKETS"]

# seconds; request latency, TTFT and queue time (vLLM's TTFT buckets start at 1 ms too)
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# seconds per output token after the first (vLLM's, with 1-5 ms added for small CPU models)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
# continuous batching (serve --max-batch): requests waiting per scheduler iteration, tokens per target call
QUEUE_DEPTH_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128)
TOKENS_PER_PASS_BUCKETS = (1, 1.5, 2, 3, 4, 6, 8, 12, 16)


class ServerMetrics:
    """The server's counters, gauges and histograms in one prometheus_client registry.

    Args:
        model_name: value of the ``model_name`` label.
        k_max: most draft positions (the ``position`` labels ``0..k_max-1`` exist from the start).
        pool_gauges: callable returning ``(workers, busy, queued, capacity)`` now.
        prefix_tokens: callable returning the tokens the prefix cache holds now
            (``specrt_prefix_cache_tokens``); None: the gauge reads 0.

    Outcomes of ``specrt_requests_total{outcome}`` (one per HTTP request): ``ok``,
    ``cancelled`` (the client left), ``invalid`` (4xx), ``rejected`` (503, queue full),
    ``error`` (500).

    Raises:
        ImportError: prometheus_client is missing (the ``[serve]`` extra).
    """

    OUTCOMES = ("ok", "cancelled", "invalid", "rejected", "error")

    def __init__(self, model_name: str, k_max: int, pool_gauges: Callable[[], tuple[int, int, int, int]], prefix_tokens: Callable[[], int] | None = None):
        import prometheus_client as pc

        pc.disable_created_metrics()
        self.registry = reg = pc.CollectorRegistry(auto_describe=True)
        pc.ProcessCollector(registry=reg)
        pc.PlatformCollector(registry=reg)
        self.model_name = name = model_name
        self._lock = threading.Lock()
        self._proposed = self._accepted = self._passes = 0
        L = ["model_name"]

        def counter(n, doc, extra=()):
            return pc.Counter(n, doc, L + list(extra), registry=reg)

        def hist(n, doc, buckets):
            return pc.Histogram(n, doc, L, buckets=buckets, registry=reg).labels(name)

        self._requests = counter("specrt_requests", "HTTP requests by outcome (ok, cancelled, invalid = 4xx, rejected = 503, error = 500).", ["outcome"])
        for o in self.OUTCOMES:
            self._requests.labels(name, o)
        self._finished = counter("specrt_request_success", "Generations (choices) finished, by finish_reason (stop, length).", ["finished_reason"])
        for r in ("stop", "length"):
            self._finished.labels(name, r)
        self._prompt = counter("specrt_prompt_tokens", "Prompt tokens of finished generations.").labels(name)
        self._gen = counter("specrt_generation_tokens", "Tokens generated (finished generations).").labels(name)
        self._prop = counter("specrt_draft_tokens_proposed", "Draft candidates proposed to the target.").labels(name)
        self._acc = counter("specrt_draft_tokens_accepted", "Draft candidates the target accepted.").labels(name)
        self._pass = counter("specrt_verify_passes", "Target passes after prefill (verification or plain decode).").labels(name)
        self._hits = counter("specrt_prefix_cache_hits", "Generations whose prefill reused KV rows of an earlier request (prefix cache).").labels(name)
        self._cached = counter("specrt_prefix_cache_cached_tokens", "Prompt tokens whose KV rows came from the prefix cache (not computed again).").labels(name)
        self._evicted = counter("specrt_prefix_cache_evictions", "Prefix-cache records cut or dropped to stay within --prefix-cache-tokens.", ["reason"])
        self._evicted_tokens = counter("specrt_prefix_cache_evicted_tokens", "Cached tokens given up to stay within --prefix-cache-tokens.").labels(name)
        self._evicted.labels(name, "budget")
        g = pc.Gauge("specrt_prefix_cache_tokens", "Tokens whose KV rows the prefix cache holds now (idle workers, free batch slots).", L, registry=reg)
        g.labels(name).set_function(prefix_tokens or (lambda: 0))
        self._host_hits = counter("specrt_host_cache_hits", "Generations that got their history back from the host prompt cache (--cache-ram).").labels(name)
        self._host_restored = counter("specrt_host_cache_restored_tokens", "KV rows copied back from the host prompt cache into a slot.").labels(name)
        self._host_evicted = counter(
            "specrt_host_cache_evicted_tokens", "Tokens of host prompt cache entries dropped to stay within --cache-ram (least recently used first)."
        ).labels(name)
        self._host_gauges = {
            "tokens": pc.Gauge("specrt_host_cache_tokens", "Tokens whose KV rows the host prompt cache holds now.", L, registry=reg).labels(name),
            "nbytes": pc.Gauge(
                "specrt_host_cache_bytes", "Bytes of KV rows the host prompt cache holds now (at most --cache-ram MiB).", L, registry=reg
            ).labels(name),
        }
        self._prop_pos = counter(
            "specrt_draft_tokens_proposed_by_position", "Verification passes that proposed a candidate at draft position i (0-based).", ["position"]
        )
        self._acc_pos = counter(
            "specrt_draft_tokens_accepted_by_position",
            "Candidates accepted at draft position i (0-based); acceptance of position i = accepted / proposed of that position.",
            ["position"],
        )
        for i in range(k_max):
            self._prop_pos.labels(name, str(i))
            self._acc_pos.labels(name, str(i))
        g = pc.Gauge("specrt_acceptance_rate", "Accepted / proposed draft candidates since start (NaN before any).", L, registry=reg)
        g.labels(name).set_function(lambda: acceptance_rate(self._accepted, self._proposed))
        g = pc.Gauge("specrt_mean_accepted_length", "Accepted draft candidates per target pass since start (tokens per pass = this + 1).", L, registry=reg)
        g.labels(name).set_function(lambda: mean_accepted(self._accepted, self._passes))
        self.e2e = hist("specrt_e2e_request_latency_seconds", "Request arrival to the last byte of the answer (ok requests).", LATENCY_BUCKETS)
        self.ttft = hist("specrt_time_to_first_token_seconds", "Request arrival to its first generated text (ok requests, streamed or not).", LATENCY_BUCKETS)
        self.tpot = hist("specrt_time_per_output_token_seconds", "Per generation: (end - first text) / (tokens - 1), generations of 2+ tokens.", TPOT_BUCKETS)
        self.queue = hist("specrt_request_queue_time_seconds", "Time a generation waited in the queue for a worker.", LATENCY_BUCKETS)
        pool = [
            ("specrt_workers", "Generator workers (each owns one Engine).", 0),
            ("specrt_workers_busy", "Workers running a generation now.", 1),
            ("specrt_queue_depth", "Generations waiting for a worker.", 2),
            ("specrt_queue_capacity", "Most generations that may wait (--max-queue).", 3),
        ]
        for metric, doc, i in pool:
            pc.Gauge(metric, doc, L, registry=reg).labels(name).set_function(lambda i=i: pool_gauges()[i])
        self._generate_latest = pc.generate_latest
        self.content_type = pc.CONTENT_TYPE_LATEST

    def count(self, outcome: str) -> None:
        """Count one HTTP request with ``outcome`` (one of :attr:`OUTCOMES`)."""
        self._requests.labels(self.model_name, outcome).inc()

    def generation(self, stats, finish_reason: str | None, queue_time: float | None = None, tpot: float | None = None) -> None:
        """Add one finished generation (one choice): its tokens, speculative counts
        (per draft position too, from ``stats.proposed_hist``/``accepted_hist``),
        finish reason, queue time and time per output token (seconds)."""
        self._prompt.inc(stats.prompt_tokens)
        if stats.cached_tokens:
            self._hits.inc()
            self._cached.inc(stats.cached_tokens)
        self._gen.inc(stats.new_tokens)
        self._prop.inc(stats.proposed)
        self._acc.inc(stats.accepted)
        self._pass.inc(stats.passes)
        with self._lock:
            self._proposed += stats.proposed
            self._accepted += stats.accepted
            self._passes += stats.passes
        # proposed at position i = passes that proposed more than i; accepted at i = passes that accepted more than i
        for hist, counter in ((stats.proposed_hist, self._prop_pos), (stats.accepted_hist, self._acc_pos)):
            tail = 0
            for i in range(len(hist) - 1, 0, -1):
                tail += hist[i]
                if tail:
                    counter.labels(self.model_name, str(i - 1)).inc(tail)
        if finish_reason:
            self._finished.labels(self.model_name, finish_reason).inc()
        if queue_time is not None:
            self.queue.observe(queue_time)
        if tpot is not None:
            self.tpot.observe(tpot)

    def prefix_evicted(self, tokens: int) -> None:
        """Count one prefix-cache record cut or dropped for the token budget, giving up ``tokens``."""
        self._evicted.labels(self.model_name, "budget").inc()
        self._evicted_tokens.inc(tokens)

    def host_restored(self, tokens: int) -> None:
        """Count one generation that got ``tokens`` KV rows back from the host prompt cache."""
        self._host_hits.inc()
        self._host_restored.inc(tokens)

    def attach_slots(self, slots) -> None:
        """Count a pool's :class:`~specrt.runtime.slots.Slots` events here: prefix-cache
        evictions (:meth:`prefix_evicted`) and, with a host prompt cache, its restores and
        evictions, and read its size into ``specrt_host_cache_tokens`` / ``_bytes``."""
        slots.attach(self.prefix_evicted, self.host_restored, self._host_evicted.inc)
        host = slots.host
        for attr, g in self._host_gauges.items():
            g.set_function((lambda a=attr: getattr(host, a)) if host is not None else (lambda: 0))

    def request_done(self, latency: float, ttft: float | None) -> None:
        """Count one ok request and observe its latency and time to first text (seconds)."""
        self.count("ok")
        self.e2e.observe(latency)
        if ttft is not None:
            self.ttft.observe(ttft)

    def render(self) -> bytes:
        """The registry in Prometheus' text exposition format (:attr:`content_type`)."""
        return self._generate_latest(self.registry)

    def value(self, name: str, **labels) -> float:
        """One sample's current value (0 when absent), e.g. ``value("specrt_requests_total", outcome="ok")``."""
        v = self.registry.get_sample_value(name, {"model_name": self.model_name, **labels})
        return 0.0 if v is None else v

    def snapshot(self) -> dict:
        """The main counters as a dict (for ``/health``)."""
        return dict(
            requests={o: int(self.value("specrt_requests_total", outcome=o)) for o in self.OUTCOMES},
            prompt_tokens=int(self.value("specrt_prompt_tokens_total")),
            completion_tokens=int(self.value("specrt_generation_tokens_total")),
            proposed=int(self.value("specrt_draft_tokens_proposed_total")),
            accepted=int(self.value("specrt_draft_tokens_accepted_total")),
            passes=int(self.value("specrt_verify_passes_total")),
        )


class BatchMetrics:
    """The continuous-batching scheduler's metrics (``specrt serve --max-batch``,
    :class:`~specrt.runtime.serve.batching.BatchPool`), labelled ``model_name`` like the
    server's, in a prometheus_client registry (the server's :attr:`ServerMetrics.registry`
    once the pool is attached to a service, else a registry of their own).

    Series: histograms ``specrt_batch_size`` (active rows per scheduler iteration, buckets
    1..max_batch), ``specrt_batch_queue_depth`` (requests waiting for a slot, per
    iteration), ``specrt_tokens_per_forward_pass`` (tokens committed per target call, per
    iteration); counter ``specrt_batch_iterations_total{mode}`` (``batched``,
    ``speculate``); gauge ``specrt_batch_step_seconds{n}`` (the running mean seconds of a
    batched step of n rows, read from ``step_s`` at each scrape).

    Args:
        model_name: value of the ``model_name`` label.
        max_batch: slots (the batch size buckets and the ``n`` labels are 1..max_batch).
        step_s: callable returning the running step costs, index n = 1..max_batch.
        registry: the registry to register in (None: a new one).

    Raises:
        ImportError: prometheus_client is missing (the ``[serve]`` extra).
    """

    MODES = ("batched", "speculate")

    def __init__(self, model_name: str, max_batch: int, step_s: Callable[[], list[float]], registry=None):
        import prometheus_client as pc

        pc.disable_created_metrics()
        self.registry = reg = registry if registry is not None else pc.CollectorRegistry(auto_describe=True)
        self.model_name = name = model_name
        L = ["model_name"]

        def hist(n, doc, buckets):
            return pc.Histogram(n, doc, L, buckets=buckets, registry=reg).labels(name)

        self.batch_size = hist("specrt_batch_size", "Active rows per scheduler iteration (--max-batch).", tuple(range(1, max_batch + 1)))
        self.queue_depth = hist("specrt_batch_queue_depth", "Requests waiting for a slot, per scheduler iteration.", QUEUE_DEPTH_BUCKETS)
        self.tokens_per_pass = hist("specrt_tokens_per_forward_pass", "Tokens committed per target call, per scheduler iteration.", TOKENS_PER_PASS_BUCKETS)
        self._iterations = pc.Counter("specrt_batch_iterations", "Scheduler iterations by mode (batched step, speculative rounds).", L + ["mode"], registry=reg)
        self.iterations = {m: self._iterations.labels(name, m) for m in self.MODES}
        g = pc.Gauge("specrt_batch_step_seconds", "Running mean seconds of one batched step of n rows.", L + ["n"], registry=reg)
        for n in range(1, max_batch + 1):
            g.labels(name, str(n)).set_function(lambda n=n: step_s()[n])

    def iteration(self, mode: str) -> None:
        """Count one scheduler iteration of ``mode`` (one of :attr:`MODES`)."""
        self.iterations[mode].inc()

    def value(self, name: str, **labels) -> float:
        """One sample's current value (0 when absent), e.g. ``value("specrt_batch_iterations_total", mode="batched")``."""
        v = self.registry.get_sample_value(name, {"model_name": self.model_name, **labels})
        return 0.0 if v is None else v
