"""Continuous batching for ``specrt serve --max-batch N``: one scheduler thread runs up to N
requests at once over one batched model (one KV slot per request, allocated once;
:func:`~specrt.runtime.backends.batched_model`: a
:class:`~specrt.runtime.backends.kern_batch.KernelBatch` for a target on specrt's kernels, a
:class:`~specrt.runtime.backends.ort_gqa_batch.BatchedGqaModel` for a builder graph on
onnxruntime CPU), with speculation per row.

Scheduler iteration (:meth:`BatchPool._iterate`)::

    drop      rows whose client went away (the slot is free at once) ...
    admit     ... queued requests, by the slot rule (prefix reuse, below), while a slot is
              free and the tokens in flight (prompt + max_tokens of the active rows) stay
              within max_tokens; each joins with a batch-1 prefill on its slot (its first token)
    choose    batched step or speculative rounds (choose_mode, from measured costs)
    run       batched: ONE target call, q = 1 per row, each row's pending token at its own
              past length -> one token per row from its own acceptor (greedy argmax, or
              a sample from its own seeded generator)
              speculate: per row one ordinary round (runtime.decode.one_round: its own
              draft fork, its own k, acceptance, commit, rollback) on its slot, batch-1;
              a row that finishes or is cancelled frees its slot at once and a waiting
              request joins before the next row's round
    finish    rows that hit EOS, a stop string or their length leave; the last active
              slot's KV is exchanged with the hole's, so active slots stay a contiguous
              prefix and the finished row's KV stays in a free slot for reuse

Prefix reuse (prefix caching): the slots are :class:`~specrt.runtime.slots.Slots` (one policy
for take, keep, trim, release and exchange, :mod:`specrt.runtime.slots`). A free slot keeps
the KV rows its last request leaves reusable (:meth:`Generation.prefix`,
:mod:`specrt.runtime.prefix`: the prefill's full aligned chunks, target and draft; every
committed target row under any layout) with the draft fork that holds the draft's rows. The
next request and its free slot are chosen by the slot rule
(:func:`~specrt.runtime.slots.pick`: a request whose history a free slot holds goes first,
to that slot; the others in arrival order, each to the free slot that serves it best; a
request passed over at most ``slot_policy``'s bound); the slot is moved to the next active
position and the prefill skips the reused rows: the output is a cold run's bit for bit (the
rows are the ones a cold prefill computes). ``prefix_cache_tokens`` bounds what each slot keeps.

Why speculative rounds are batch-1: onnxruntime's CPU GroupQueryAttention refuses batch > 1
with q > 1 after a past, so one target pass cannot verify several rows' candidates there; the
scheduler treats both batched models alike.

On an exact batched model (specrt's kernels: a row's bits do not depend on the call) an
iteration is ONE call (:func:`~specrt.runtime.serve.joint.joint_round`): in a batched iteration the ready greedy
rows feed their pending token, and every other row (every row when speculating; sampled rows
and rows with forced tokens not yet in their KV always) makes its own round whose verification rows ride in the same call.
``auto`` there compares whole iterations (:class:`~specrt.runtime.serve.joint.ModeChooser`).

Load-aware rule on onnxruntime's graph (:func:`choose_mode`): a batched step makes n tokens in ``t_step(n)``
seconds (recorded by ``specrt tune --batch-costs N`` in the manifest, else measured per
batch size at start; then a running mean of the real steps); a
speculative iteration makes ``sum(tokens_i)`` tokens in ``sum(seconds_i)`` (each row's
running means of its rounds). The faster one runs; one row alone always speculates. So
speculation turns itself off as the batch grows (as vLLM and TensorRT-LLM do under load)
and back on when the batch shrinks. One row in ``explore_every`` batched steps refreshes
its round statistics with a speculative round.

Numerics: a row's speculative rounds are the single-sequence decode loop bit for bit (its
slot is a batch-1 model of the same weights), so a request that is only ever run
speculatively equals the same request alone. On specrt's kernels a batched step's rows are
batch-1 rows bit for bit too (``KernelBatch.exact``): every output, greedy or seeded, equals
the request alone whatever the policy, and the rows a batched step writes stay reusable. On
onnxruntime's graph a batched step's rows differ from batch-1 rows by its kernels' rounding
(GroupQueryAttention's q = 1 path; about 6e-6, amplified by int8 activation quantization in
int4 accuracy-level-4 graphs; docs/guide/serving.md), so outputs after a batched step may
differ from the request alone at near-ties; ``policy="speculate"`` never makes batched
steps (exact, no batching speedup).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from ..backends import batched_model
from ..costs import EMA, BatchCosts, measure_step_costs, recorded_costs
from ..generation import Generation
from ..slots import SlotPolicy, Slots, Waiter
from .jobs import Job, ServeError, ServerBusy, fail, finish, pool_slots, run_prompt, send_text
from .joint import ModeChooser, joint_round
from .metrics import BatchMetrics
from .settings import BATCH_POLICIES, DEFAULT_BATCH_POLICY, DEFAULT_MAX_QUEUE

__all__ = ["BatchCosts", "choose_mode", "measure_step_costs", "recorded_costs", "BatchPool"]

log = logging.getLogger("specrt.serve")


def choose_mode(n: int, step_s: float, rounds: Sequence[tuple[float, float]]) -> str:
    """``"batched"`` or ``"speculate"`` for one scheduler iteration over ``n`` rows.

    Args:
        n: active rows ready for a batched step.
        step_s: seconds of one batched step of n rows.
        rounds: per row, ``(tokens, seconds)`` of its speculative round (running means;
            rows without any use the mean of the others).

    Returns:
        ``"speculate"`` when ``n < 2`` (a batched step of one row is the 1-row kernel path,
        which rounds differently; the single-sequence loop is exact), when no round has
        been measured, or when speculative rounds make more tokens per second than the
        batched step (``sum(tokens) / sum(seconds)`` vs ``n / step_s``); else ``"batched"``.
    """
    if n < 2 or not rounds:
        return "speculate"
    tok = sum(t for t, _ in rounds)
    sec = sum(s for _, s in rounds)
    if sec <= 0.0:
        return "speculate"
    return "batched" if n / step_s > tok / sec else "speculate"


def _claim(job: Job) -> int:
    """Tokens a request may hold in flight (its prompt and its whole budget): read from the
    job, so the scheduler never reads a generation's plan."""
    return len(job.ids) + job.config.max_new_tokens


@dataclass
class _Row:
    """One active request: its job, its :class:`~specrt.runtime.generation.Generation`
    (sequence, KV lengths, acceptor, text, stats, its slot's draft fork), its slot, and the
    running means of its speculative rounds (:func:`choose_mode`)."""

    job: Job
    gen: Generation
    slot: int
    failed: bool = False
    round_tok: float = 0.0
    round_s: float = 0.0
    rounds: int = 0

    @property
    def done(self) -> bool:
        """Ended (EOS, stop string, length, or an error)."""
        return self.failed or self.gen.done

    def observe(self, tok: int, dt: float) -> None:
        """Fold one speculative round (``tok`` tokens in ``dt`` seconds) into the running means."""
        if self.rounds:
            self.round_tok += EMA * (tok - self.round_tok)
            self.round_s += EMA * (dt - self.round_s)
        else:
            self.round_tok, self.round_s = float(tok), dt
        self.rounds += 1


def _fail_row(row: _Row, e: Exception) -> None:
    """End ``row`` alone with the error ``e`` (the others go on)."""
    row.failed = True
    fail(row.job, e)


class _GraphModes:
    """``auto``'s choice on onnxruntime's batched graph (:func:`choose_mode` over the rows'
    running means and the step costs), and the row that makes a speculative round after a
    batched step to refresh its statistics (one every ``explore_every`` batched steps)."""

    def __init__(self, policy: str, explore_every: int):
        self.policy, self.explore_every = policy, explore_every
        self.since_explore, self.explore_row = 0, 0

    def choose(self, ready: list, step_s: Sequence[float]) -> tuple[str, object]:
        """``(mode, explore row or None)`` for an iteration over ``ready`` (``step_s[n]``:
        seconds of a batched step of n rows)."""
        n = len(ready)
        if self.policy == "speculate" or n < 2:
            return "speculate", None
        if self.policy == "batched":
            return "batched", None
        measured = [(r.round_tok, r.round_s) for r in ready if r.rounds]
        if measured:
            mt, ms = sum(t for t, _ in measured) / len(measured), sum(s for _, s in measured) / len(measured)
            rounds = [(r.round_tok, r.round_s) if r.rounds else (mt, ms) for r in ready]
        else:
            rounds = []
        mode = choose_mode(n, step_s[n], rounds)
        explore = None
        if mode == "batched":
            self.since_explore += 1
            if self.since_explore >= self.explore_every:
                self.since_explore = 0
                self.explore_row = (self.explore_row + 1) % n
                explore = ready[self.explore_row]
        return mode, explore


def check_pool_args(max_batch: int, max_queue: int, max_tokens: int | None, policy: str) -> None:
    """Validate :class:`BatchPool`'s arguments (see there).

    Raises:
        ServeError: max_batch < 1, max_queue < 1, max_tokens < 1, or an unknown policy.
    """
    if max_batch < 1:
        raise ServeError(f"max_batch={max_batch}; it must be >= 1")
    if max_queue < 1:
        raise ServeError(f"max_queue={max_queue}; it must be >= 1")
    if max_tokens is not None and max_tokens < 1:
        raise ServeError(f"max_tokens={max_tokens}; it must be >= 1 (or None)")
    if policy not in BATCH_POLICIES:
        raise ServeError(f"policy={policy!r}; one of {', '.join(BATCH_POLICIES)}")


class BatchPool:
    """The continuous-batching scheduler, a :class:`~specrt.runtime.serve.jobs.Pool` (module
    docstring). Jobs follow the contract of :mod:`specrt.runtime.serve.jobs` through its
    helpers (``run_prompt``: echo and prompt scoring before the row takes a slot;
    ``send_text``; ``finish``); each row is a :class:`~specrt.runtime.generation.Generation`
    stepped on its slot, so its text, stop strings, logprobs and result are the Engine's.
    Under a batched step a row's token and logprob come from its row of the batched target
    call (on onnxruntime's graph, its rounding: module docstring).

    Args:
        engine: a loaded :class:`~specrt.runtime.engine.Engine` whose target runs on specrt's
            kernels (:class:`~specrt.runtime.backends.kern.KernelModel`) or is a builder
            graph (:class:`~specrt.runtime.backends.ort_gqa.OrtGqaModel`); its weights
            are shared, its own KV is not used for serving.
        max_batch: slots (requests at once), >= 1.
        max_queue: requests that may wait (:class:`ServerBusy` beyond).
        max_tokens: most tokens in flight (sum of prompt + max_tokens over the active
            rows); None: no limit but the slots.
        policy: ``"auto"`` (:func:`choose_mode`), ``"speculate"`` (never a batched step:
            greedy rows equal the request alone), ``"batched"`` (a batched step whenever
            two or more rows are ready).
        explore_every: in ``auto``, one row makes a speculative round every this many
            batched steps (keeps its acceptance statistics fresh).
        prefix_cache_tokens: prefix cache budget over all slots (``// max_batch`` each;
            module docstring); None: no limit but the KV buffers; 0: off.
        slot_policy: how long a request may be passed over (:class:`~specrt.runtime.slots.SlotPolicy`).
        cache_ram_mib: the host prompt cache's budget in MiB (histories kept beyond the
            slots, :mod:`specrt.runtime.hostcache`); 0: none.
        round_delay: test hook: seconds to sleep after each iteration.
        costs: :class:`BatchCosts` to start from (None: the manifest's
            ``extra.tune.batch_step_costs`` from ``specrt tune --batch-costs N`` when it
            covers 1..max_batch, else measured here, about ``6 * max_batch`` steps).

    Raises:
        ServeError: max_batch < 1, max_queue < 1, max_tokens < 1, an unknown policy, a
            negative prefix_cache_tokens or cache_ram_mib, or a target with no batched model.
    """

    def __init__(
        self,
        engine,
        max_batch: int,
        max_queue: int = DEFAULT_MAX_QUEUE,
        max_tokens: int | None = None,
        policy: str = DEFAULT_BATCH_POLICY,
        explore_every: int = 16,
        round_delay: float = 0.0,
        costs: BatchCosts | None = None,
        prefix_cache_tokens: int | None = None,
        slot_policy: SlotPolicy = SlotPolicy(),
        cache_ram_mib: int = 0,
    ):
        check_pool_args(max_batch, max_queue, max_tokens, policy)
        self.engine = engine
        self.engines = [engine]  # the service validates and tokenizes with engines[0]
        self.max_batch, self.max_queue, self.max_tokens = max_batch, max_queue, max_tokens
        self.policy, self.explore_every, self.round_delay = policy, explore_every, round_delay
        self.batched = batched_model(engine.target, max_batch)
        if self.batched is None:
            raise ServeError(
                f"--max-batch needs a target on specrt's kernels or a builder-graph target on ort-cpu (int4/int8 export); {engine.folder} has a {engine.manifest.target.graph} graph on {engine.backend}"
            )
        self.costs = costs or recorded_costs(engine.manifest, max_batch, engine.backend) or measure_step_costs(self.batched, vocab=engine.manifest.vocab_size)
        self.slots = pool_slots(Slots.of_batch, self.batched, engine, prefix_cache_tokens, slot_policy, cache_ram_mib=cache_ram_mib)
        self._queue: list[Waiter] = []  # arrival order
        self._rows: list[_Row] = []
        self._cond = threading.Condition()
        self._closed = False
        self._graph_modes = _GraphModes(policy, explore_every)  # onnxruntime's graph
        self._modes = ModeChooser(policy, explore_every)  # exact batches: auto by measured iterations
        # prometheus_client metrics: their own registry until attach_metrics (CompletionService)
        self.metrics = BatchMetrics(engine.folder.name, max_batch, lambda: self.costs.step_s)
        self._thread = threading.Thread(target=self._loop, name="specrt-batch", daemon=True)
        self._thread.start()

    @classmethod
    def load(cls, folder, max_batch: int, threads=None, backend: str | None = None, **kw) -> "BatchPool":
        """Load the engine folder and start a pool over it (``kw``: the other arguments).

        Raises:
            EngineError, BackendError: what :class:`~specrt.runtime.engine.Engine` raises.
            ServeError: see the class.
        """
        from ..engine import Engine

        return cls(Engine(folder, threads=threads, backend=backend), max_batch, **kw)

    # ---- the WorkerPool interface ----------------------------------------------------
    @property
    def workers(self) -> int:
        """Slots (the most requests generating at once)."""
        return self.max_batch

    @property
    def busy(self) -> int:
        """Rows generating now."""
        return len(self._rows)

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return len(self._queue)

    @property
    def prefix_tokens(self) -> int:
        """Tokens whose KV rows the free slots keep for reuse now."""
        return self.slots.held_tokens(range(len(self._rows), self.max_batch))

    @property
    def steps(self) -> dict[str, int]:
        """Scheduler iterations so far by mode (``batched``, ``speculate``)."""
        return {m: int(self.metrics.value("specrt_batch_iterations_total", mode=m)) for m in BatchMetrics.MODES}

    def attach_metrics(self, server_metrics) -> None:
        """Register the batching metrics in ``server_metrics``' registry (a
        :class:`~specrt.runtime.serve.metrics.ServerMetrics`), labelled with its model name;
        they start from zero there."""
        self.metrics = BatchMetrics(server_metrics.model_name, self.max_batch, lambda: self.costs.step_s, server_metrics.registry)
        server_metrics.attach_slots(self.slots)

    def submit(self, job: Job) -> None:
        """Queue ``job`` without waiting.

        Raises:
            ServerBusy: ``max_queue`` generations already wait.
        """
        self.submit_all([job])

    def submit_all(self, jobs: Sequence[Job]) -> None:
        """Queue all ``jobs`` or none (one request's generations), in order, without waiting.

        Raises:
            ServerBusy: fewer than ``len(jobs)`` places are free in the queue.
        """
        with self._cond:
            if len(self._queue) + len(jobs) > self.max_queue:
                raise ServerBusy(
                    f"server busy: {len(self._queue)} generations already queued for {self.max_batch} slot(s) (at most {self.max_queue}); retry later"
                )
            self._queue.extend(Waiter(j, j.ids) for j in jobs)
            self._cond.notify()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the scheduler; queued and active requests end as cancelled."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)

    # ---- the scheduler ---------------------------------------------------------------
    def _loop(self) -> None:
        """Scheduler thread: iterate while rows are active or requests wait."""
        while True:
            with self._cond:
                while not self._closed and not self._rows and not self._queue:
                    self._cond.wait()
                if self._closed:
                    break
            try:
                self._iterate()
            except Exception:  # noqa: BLE001 - never let the scheduler thread die silently
                log.exception("batch scheduler iteration failed")
                for r in list(self._rows):
                    self._end(r, "error", ServeError("internal error in the batch scheduler"))
            if self.round_delay:
                time.sleep(self.round_delay)
        for r in list(self._rows):
            self._end(r, "cancelled", None)
        with self._cond:
            left, self._queue = [w.job for w in self._queue], []
        for job in left:
            job.cancelled.set()
            finish(job, "cancelled", None)

    def _in_flight(self) -> int:
        return sum(_claim(r.job) for r in self._rows)

    def _iterate(self) -> None:
        """One scheduler iteration (module docstring)."""
        for r in [r for r in self._rows if r.job.cancelled.is_set()]:
            self._end(r, "cancelled", None)
        self._admit_waiting()
        rows = self._rows
        if not rows:
            return
        self.metrics.batch_size.observe(len(rows))
        self.metrics.queue_depth.observe(len(self._queue))
        ready = [r for r in rows if not r.done and r.gen.kv.target == len(r.gen.seq) - 1]
        if self.batched.exact:
            # specrt's kernels: ONE call for every row, each row's bits a batch-1 call's. In a
            # batched iteration the ready greedy (and seeded) rows take one token each (q = 1); every other
            # row makes its own speculative round (its own k and accepted length), verified in
            # the same call: each output is the request's alone, greedy and seeded
            active = [r for r in rows if not r.done]
            mode = self._modes.choose(len(active))
            plain = [r for r in ready if r.gen.plain_ok] if mode == "batched" else []
            t0, before = time.perf_counter(), sum(len(r.gen.seq) for r in active)
            calls, tokens = joint_round(self.batched, active, plain, self._run, _fail_row, _Row.observe, self.costs.observe)
            self._modes.observe(mode, len(active), sum(len(r.gen.seq) for r in active) - before, time.perf_counter() - t0)
            self.metrics.iteration(mode)
            if calls:
                self.metrics.tokens_per_pass.observe(tokens / calls)
            for r in active:
                if r.job.cancelled.is_set() and not r.done:
                    self._end(r, "cancelled", None)
            for r in [r for r in rows if r.done]:
                self._release(r)
            return
        mode, explore = self._graph_modes.choose(ready, self.costs.step_s)
        if mode == "batched":
            self._batched_step(ready)
            for r in list(rows):
                if (r not in ready or r is explore) and not r.done:
                    self._round(r)
        else:
            calls = tokens = 0
            for r in list(rows):
                if not r.done:
                    c, t = self._round(r)
                    calls, tokens = calls + c, tokens + t
                if r.done or r.job.cancelled.is_set():
                    # free the slot now and let a waiting request join (and get its first
                    # token) without waiting for the other rows' rounds
                    if not r.done:
                        self._end(r, "cancelled", None)
                    self._release(r)
                    self._admit_waiting()
            self.metrics.iteration("speculate")
            if calls:
                self.metrics.tokens_per_pass.observe(tokens / calls)
        for r in [r for r in rows if r.done]:
            self._release(r)

    def _admit_waiting(self) -> None:
        """Admit queued requests while a slot is free, the next by the slot rule and its
        slot (:meth:`Slots.next`) each, until one does not fit the tokens-in-flight limit
        (requests cancelled while queued end here)."""
        while len(self._rows) < self.max_batch:
            with self._cond:
                got = self.slots.next(self._queue, range(len(self._rows), self.max_batch))
                if got is None:
                    return
                w, slot = got
                job = w.job
                if self.max_tokens is not None and self._rows and self._in_flight() + _claim(job) > self.max_tokens and not job.cancelled.is_set():
                    return
                self.slots.claim(w, self._queue)
                self._queue.remove(w)
            if job.cancelled.is_set():
                finish(job, "cancelled", None)
                continue
            self._admit(job, slot)

    def _admit(self, job: Job, free: int) -> None:
        """Start ``job``: its prompt part (:func:`~specrt.runtime.serve.jobs.run_prompt`);
        then, unless it only echoes, on free slot ``free`` moved to the next active position:
        its generation (on that slot's draft fork, reusing the slot's record) and the
        prefill (first token)."""
        eng, slot, slots = self.engine, len(self._rows), self.slots
        try:
            if not run_prompt(eng, job):
                return
            slots.exchange(free, slot, *(0 if s.rec is None else s.rec.target_rows for s in (slots[free], slots[slot])))
            gen = eng.start(job.ids, job.config, draft=slots[slot].draft)
        except Exception as e:  # noqa: BLE001 - this request fails, the others go on (a refused config: the slot keeps its record)
            fail(job, e)
            return
        gen.reuse(slots[slot].recall(slots[slot].take(), gen.seq))
        row = _Row(job, gen, slot)
        self._rows.append(row)
        self._run(row, lambda: row.gen.prefill(self.batched.slots[row.slot]))

    def _run(self, row: _Row, call) -> bool:
        """Make ``call`` (one of ``row.gen``'s steps, returning released text), hand the text
        to the client and the result when it ends; an exception ends the row alone.
        Returns whether the call completed."""
        try:
            piece = call()
        except Exception as e:  # noqa: BLE001 - this request fails, the others go on
            row.failed = True
            fail(row.job, e)
            return False
        send_text(row.job, piece, row.gen.logprobs)
        if row.gen.done:
            finish(row.job, "ok", row.gen.result())
        return True

    def _round(self, row: _Row) -> tuple[int, int]:
        """One speculative (or target-only) round of ``row`` on its slot; returns (target
        calls, tokens committed)."""
        gen = row.gen
        calls, committed = gen.stats.target_calls, len(gen.seq)
        t0 = time.perf_counter()
        if not self._run(row, lambda: gen.step(self.batched.slots[row.slot])):
            return 0, 0
        tok = len(gen.seq) - committed
        row.observe(tok, time.perf_counter() - t0)
        return gen.stats.target_calls - calls, tok

    def _batched_step(self, ready: list) -> None:
        """One target call over the slots of ``ready`` (q = 1 each); each row then commits
        the token of its own row of logits (:meth:`Generation.push_row`)."""
        t0 = time.perf_counter()
        n = len(ready)
        # ready rows must be slots [0, n): the not-ready ones (short prompts) are rare;
        # swap them behind the ready ones first
        self._compact_ready(ready)
        ready = sorted(ready, key=lambda r: r.slot)
        logits = self.batched.step([r.gen.seq[-1] for r in ready], [r.gen.kv.target for r in ready])
        dt = time.perf_counter() - t0
        for i, r in enumerate(ready):
            self._run(r, lambda: r.gen.push_row(logits[i], dt / n, self.batched.exact))
        self.costs.observe(n, time.perf_counter() - t0)
        self.metrics.iteration("batched")
        self.metrics.tokens_per_pass.observe(float(n))

    def _compact_ready(self, ready: list) -> None:
        """Give the ready rows slots ``[0, len(ready))`` (swapping KV rows with the others)."""
        n = len(ready)
        for r in ready:
            if r.slot >= n:
                other = next(o for o in self._rows if o.slot < n and o not in ready)
                self.slots.exchange(r.slot, other.slot, r.gen.kv.target, other.gen.kv.target)
                r.slot, other.slot = other.slot, r.slot
        self._rows.sort(key=lambda r: r.slot)

    def _end(self, row: _Row, outcome: str, payload) -> None:
        """End ``row`` now (cancelled or failed; a row that already ended emits nothing
        more) and free its slot."""
        if not row.done:
            row.failed = True
            finish(row.job, outcome, payload)
        self._release(row)

    def _release(self, row: _Row) -> None:
        """Free ``row``'s slot: it keeps what ``row`` leaves for reuse (with its draft fork);
        the last active slot's row moves into the hole and the hole's KV and record into
        the slot it frees, which then releases its memory (:meth:`Slot.release`)."""
        if row not in self._rows:
            return
        self._rows.remove(row)
        free, slots = row.slot, self.slots
        slots[free].keep(row.gen)
        last = max(self._rows, key=lambda r: r.slot, default=None)
        if last is not None and last.slot > row.slot:
            kept = slots[free].rec
            slots.exchange(last.slot, row.slot, last.gen.kv.target, 0 if kept is None else kept.target_rows)
            free, last.slot = last.slot, row.slot
        slots[free].release()
        self._rows.sort(key=lambda r: r.slot)
