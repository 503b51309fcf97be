"""KV residency: what a slot keeps for reuse between requests, who gets which slot, and
what goes back to the OS, in one place (as :mod:`specrt.runtime.drafters` owns the draft
side of a round).

A *slot* (:class:`Slot`) is one place a request runs: the target's KV (an Engine's target,
or one slot of a batched model), the draft model whose KV goes with it (the Engine's
draft, or the batch slot's draft fork), and its prefix record
(:class:`~specrt.runtime.prefix.KVPrefix`: the rows of both that a later request may reuse,
:mod:`specrt.runtime.prefix`). The :class:`~specrt.runtime.engine.Engine` is one slot; the
server's worker pool is its workers' Engines' slots; the batch scheduler is one slot per
row of its batched model (:class:`Slots` holds either). One policy for all:

====================  =====================================================================
take                  a generation that starts on a slot is handed its record
                      (:meth:`Generation.reuse`); the slot holds none while it runs (it may
                      write any row)
recall                with a host prompt cache (:mod:`specrt.runtime.hostcache`), the record
                      that serves the generation's prompt best, the slot's own or one the
                      cache copies back into the KV; the slot's rows are copied out first
                      when the request would overwrite them (:meth:`Slot.recall`)
keep                  when the generation ends (done, cancelled or failed: rows proved
                      reusable are never rewritten after its prefill), the slot keeps what it
                      leaves (:meth:`Generation.prefix`)
trim                  a kept record is cut to the slot's share of the prefix cache's budget
                      (``prefix_cache_tokens // slots``; an eviction, counted)
release               a generation hands its prefill's logits rows back to the OS as soon as
                      it has read them (:func:`release_prefill_logits`); an idle slot hands
                      back the logits rows only a prefill writes (budget or not: scratch) and,
                      with a budget, its KV rows past its record (:meth:`Slot.release`)
exchange              two slots of a batched model swap their KV rows and what goes with them
                      (draft fork, record), so the active slots stay a contiguous prefix
                      (:meth:`Slots.exchange`)
choose                which waiting request gets which free slot (:func:`pick`, below)
====================  =====================================================================

Choosing a slot (:func:`pick`; llama-server's slot-similarity rule, ``--slot-prompt-similarity``,
applied to the whole queue as SGLang's longest-prefix-match policy orders its waiting queue):
a request takes the free slot whose record serves its prompt best
(:func:`~specrt.runtime.prefix.route_key`: the longest similar prefix, then the fewest cached
rows lost, then the least recently used). When slots free up, the first waiting request
whose own history (a similar prefix) is in a free slot takes that slot, ahead of earlier
requests that would only overwrite it; the others follow in arrival order. So a
conversation whose next turn queued behind others still gets its KV back instead of the
first free slot. The bound (:class:`SlotPolicy`): a request passed over by
``wait_requests`` later requests, or for ``wait_ms`` since it was first passed over, takes
the next free slot before anyone else, whatever that slot holds.

Not done: a request never waits for a busy slot (one running a request that shares its
prompt): n choices of one prompt, and parallel requests over one context, would then run
one after another. A freed slot is never held back for its conversation's next turn
either: under load the first waiting request takes it (a turn that arrives after its slot
was taken finds its history in the host prompt cache, when the pool has one, and else
gone).

The slot module uses only the :class:`~specrt.runtime.backends.base.Model` protocol's
optional methods (``release_rows``, ``release_logits`` through
:func:`~specrt.runtime.backends.base.release_scratch`), and of a batched model the
multi-slot interface of :class:`~specrt.runtime.backends.ort_gqa_batch.BatchedGqaModel`
(``slots``, ``keys``/``values`` slot-major, ``move``, ``release_rows(slot, start)``): any
backend that offers them is served the same way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterable, Mapping, Sequence

from .backends.base import Model, ReleasesRows, release_scratch
from .errors import InputError
from .hostcache import HostCache, holds_rows
from .prefix import KVPrefix, route_key

__all__ = [
    "DEFAULT_SLOT_WAIT_MS",
    "DEFAULT_SLOT_WAIT_REQUESTS",
    "SlotPolicy",
    "Slot",
    "SlotRecord",
    "Slots",
    "Waiter",
    "pick",
    "release_prefill_logits",
]

# A request passed over for requests that get their own history back waits at most this
# long (from the first pass) or this many passes, then goes first: with 2-4 slots that is
# about one turn of every slot, and a pass costs it one generation at most.
DEFAULT_SLOT_WAIT_MS = 1000.0
DEFAULT_SLOT_WAIT_REQUESTS = 4


def release_prefill_logits(model: Model, k_max: int) -> int:
    """A generation has read the logits of its prefill (target) or of the draft's first
    feed: hand ``model``'s rows past the verification widths (``k_max + 1``) back to the OS
    now, not when the request ends (148 MiB a model at a 152k vocabulary). Returns bytes
    released (0 for a backend without ``release_logits``)."""
    return release_scratch(model, k_max + 1)


@dataclass(frozen=True)
class SlotPolicy:
    """How long a waiting request may be passed over (module docstring, "Choosing a slot").

    Attributes:
        wait_ms: milliseconds from the first time a request is passed over after which it
            takes the next free slot before anyone else (>= 0).
        wait_requests: later requests that may take a slot before it (>= 0; 0: first come
            first served, each request to the free slot that serves it best).

    Raises:
        InputError: a negative value (param ``slot_wait_ms`` / ``slot_wait_requests``).
    """

    wait_ms: float = DEFAULT_SLOT_WAIT_MS
    wait_requests: int = DEFAULT_SLOT_WAIT_REQUESTS

    def __post_init__(self):
        if not self.wait_ms >= 0:
            raise InputError(f"slot_wait_ms={self.wait_ms}; it must be >= 0 (milliseconds)", "slot_wait_ms")
        if self.wait_requests < 0:
            raise InputError(f"slot_wait_requests={self.wait_requests}; it must be >= 0 (0: first come first served)", "slot_wait_requests")

    def expired(self, w: "Waiter", now: float) -> bool:
        """Whether ``w`` has been passed over long enough (``now``: ``time.perf_counter()``)."""
        return w.passed >= self.wait_requests or (w.held is not None and (now - w.held) * 1000.0 >= self.wait_ms)


@dataclass
class Waiter:
    """A request waiting for a slot.

    Attributes:
        job: the pool's item (a :class:`~specrt.runtime.serve.jobs.Job`).
        ids: its prompt token ids.
        passed: later requests given a slot before it.
        held: ``time.perf_counter()`` when it was first passed over, or None.
    """

    job: object
    ids: Sequence[int]
    passed: int = 0
    held: float | None = None


def pick(free: Mapping[int, tuple[KVPrefix | None, float]], waiting: Sequence[Waiter], step: int, policy: SlotPolicy, now: float) -> tuple[Waiter, int] | None:
    """The next request to start and its slot (module docstring, "Choosing a slot").

    Args:
        free: free slot index -> (its record or None, when it was last used).
        waiting: the waiting requests in arrival order.
        step: the granularity of reusable target rows (:func:`~specrt.runtime.prefix.route_key`).
        policy: the bound on passing a request over.
        now: ``time.perf_counter()``.

    Returns:
        ``(waiter, slot index)``: the first waiting request that has waited its bound or
        whose best free slot holds a similar prefix of its prompt, else the first waiting
        request; its best free slot by (:func:`route_key`, least recently used, lowest
        index). None when no slot is free or nobody waits.
    """
    if not free or not waiting:
        return None

    def best(w: Waiter) -> tuple[int, int]:
        key, s = max(((route_key(rec, w.ids, step), -used, -s), s) for s, (rec, used) in free.items())
        return s, key[0][0]

    for w in waiting:
        s, similar = best(w)
        if similar > 0 or policy.expired(w, now):
            return w, s
    return waiting[0], best(waiting[0])[0]


class Slot:
    """One slot: a target's KV, the draft model whose KV goes with it, and the prefix record
    they hold (module docstring).

    Args:
        target: the target :class:`~specrt.runtime.backends.base.Model` whose KV the slot
            holds (an Engine's, or a batch slot's view).
        draft: the draft Model whose KV goes with the record.
        t_step: the granularity of reusable target rows
            (:meth:`~specrt.runtime.manifest.Manifest.reuse_step`); the draft's is its widest call.
        narrow: logits rows a verification or a batched step may write (``k_max + 1``):
            the rows past them are prefill scratch.
        release_target: hands the target's KV rows ``[start, max_ctx)`` back to the OS
            (default: the target's ``release_rows`` where the Model offers it).

    Attributes:
        rec: the record the slot holds for reuse (None: nothing, or a generation holds the KV).
        share: the most tokens its record may keep (None: no limit; 0: none).
        used: ``time.monotonic()`` when it last kept a record (0.0: never).
        on_evict: called with the tokens given up whenever :meth:`keep` cuts a record to
            :attr:`share` (the server's ``prefix_evicted`` metric), or None.
        host: the pool's host prompt cache (:class:`~specrt.runtime.hostcache.HostCache`),
            or None (:meth:`recall` then gives the record back as is).
    """

    def __init__(self, target: Model, draft: Model, t_step: int, narrow: int, release_target: Callable[[int], int] | None = None):
        self.target, self.draft, self.t_step, self.narrow = target, draft, t_step, narrow
        self.release_target = release_target if release_target is not None else (target.release_rows if isinstance(target, ReleasesRows) else None)
        self.rec: KVPrefix | None = None
        self.share: int | None = None
        self.used = 0.0
        self.on_evict: Callable[[int], None] | None = None
        self.host: HostCache | None = None

    def recall(self, rec: KVPrefix | None, ids: Sequence[int]) -> KVPrefix | None:
        """The record a generation for ``ids`` starting here reuses: ``rec`` (what :meth:`take`
        gave), or a history the host prompt cache (:attr:`host`) copied back into the KV,
        ``rec``'s rows copied out first when the request would overwrite them
        (:meth:`~specrt.runtime.hostcache.HostCache.recall`). The caller holds the KV."""
        if self.host is None:
            return rec
        return self.host.recall(rec, ids, self.target, self.draft, self.t_step)

    def take(self) -> KVPrefix | None:
        """Hand the record to a generation starting here (it may write any row: the slot
        holds none until :meth:`keep`)."""
        rec, self.rec = self.rec, None
        return rec

    def put(self, rec: KVPrefix | None) -> None:
        """Set the record as is (a caller that knows what the KV holds: None after writing it)."""
        self.rec = rec

    def keep(self, gen) -> None:
        """Keep what generation ``gen`` leaves (:meth:`Generation.prefix`; None, or a share
        of 0: nothing), cut to :attr:`share` (an eviction, counted), once it has ended or
        stopped: rows proved reusable are never rewritten after its prefill."""
        rec = gen.prefix() if gen is not None and self.share != 0 else None
        if rec is not None and self.share is not None and rec.size > self.share:
            cut = rec.trimmed(self.share, self.t_step, self.draft.max_q)
            if self.on_evict is not None:
                self.on_evict(rec.size - (cut.size if cut is not None else 0))
            rec = cut
        self.rec, self.used = rec, time.monotonic()

    def release(self) -> int:
        """An idle slot's memory back to the OS: the target's and the draft's logits rows
        past :attr:`narrow` (prefill scratch, budget or not) and, with a budget
        (:attr:`share` not None), the KV rows past the record (so idle slots hold at most
        their share resident, not the longest request they ever ran). Returns bytes released."""
        done = release_scratch(self.target, self.narrow) + release_scratch(self.draft, self.narrow)
        if self.share is None:
            return done
        rec = self.rec
        for rel, rows in (
            (self.release_target, 0 if rec is None else rec.target_rows),
            (self.draft.release_rows if isinstance(self.draft, ReleasesRows) else None, 0 if rec is None else rec.draft_rows),
        ):
            if rel is not None:
                done += rel(rows)
        return done


class SlotRecord:
    """The ``cached`` attribute of an owner with a :class:`Slot` in ``slot`` (the
    :class:`~specrt.runtime.engine.Engine`): reads the slot's record; setting it puts a
    record as is (:meth:`Slot.put`: None after writing the KV by other means)."""

    def __get__(self, obj, owner=None) -> "KVPrefix | None | SlotRecord":
        return self if obj is None else obj.slot.rec

    def __set__(self, obj, rec: KVPrefix | None) -> None:
        obj.slot.put(rec)


class Slots:
    """A pool's slots under one policy (module docstring): the worker pool's (one per
    Engine, :meth:`of_engines`) or the batch scheduler's (one per row of a batched model,
    :meth:`of_batch`).

    Args:
        slots: the slots.
        budget: the prefix cache's budget in tokens over all slots (``budget // len(slots)``
            each); None: no limit but the KV buffers; 0: no prefix cache.
        policy: the :class:`SlotPolicy` for :meth:`next`.
        kv: the batched model whose slots these are (:meth:`exchange`), or None.
        host: a host prompt cache the slots share (:class:`~specrt.runtime.hostcache.HostCache`:
            histories kept beyond the slots), or None; not used with a budget of 0 or on
            models without :class:`~specrt.runtime.backends.base.HoldsRows`.

    Raises:
        InputError: no slots, or a negative budget (param ``prefix_cache_tokens``).
    """

    def __init__(self, slots: Sequence[Slot], budget: int | None = None, policy: SlotPolicy = SlotPolicy(), kv=None, host: HostCache | None = None):
        if not slots:
            raise InputError("a slot pool needs at least one slot", "slots")
        if budget is not None and budget < 0:
            raise InputError(f"prefix_cache_tokens={budget}; it must be >= 0 (0: no prefix cache)", "prefix_cache_tokens")
        self.slots, self.policy, self.kv = list(slots), policy, kv
        self.share = None if budget is None else budget // len(self.slots)
        self.host = host if budget != 0 and all(holds_rows(s.target, s.draft) for s in self.slots) else None
        for s in self.slots:
            s.share, s.host = self.share, self.host

    @classmethod
    def of_engines(cls, engines: Sequence, budget: int | None = None, policy: SlotPolicy = SlotPolicy(), host: HostCache | None = None) -> "Slots":
        """The slots of ``engines`` (:attr:`Engine.slot`; each Engine's prefix cache on unless
        ``budget`` is 0)."""
        for e in engines:
            e.prefix_cache = budget != 0
        return cls([e.slot for e in engines], budget, policy, host=host)

    @classmethod
    def of_batch(cls, batched, engine, budget: int | None = None, policy: SlotPolicy = SlotPolicy(), host: HostCache | None = None) -> "Slots":
        """One slot per row of ``batched`` (a batched model over ``engine``'s target), each
        with its own fork of ``engine``'s draft."""
        m = engine.manifest
        return cls(
            [
                # the Engine's own step (1 on width-exact kernels, whatever the manifest measured)
                Slot(batched.slots[j], engine.draft.fork(), engine.slot.t_step, m.k_max + 1, partial(batched.release_rows, j))
                for j in range(batched.max_batch)
            ],
            budget,
            policy,
            kv=batched,
            host=host,
        )

    def __len__(self) -> int:
        return len(self.slots)

    def __getitem__(self, i: int) -> Slot:
        return self.slots[i]

    def attach(
        self, on_evict: Callable[[int], None] | None, on_restore: Callable[[int], None] | None = None, on_host_evict: Callable[[int], None] | None = None
    ) -> None:
        """Count the budget's evictions with ``on_evict(tokens)`` from now on, and the host
        prompt cache's restores and evictions with ``on_restore`` / ``on_host_evict``."""
        for s in self.slots:
            s.on_evict = on_evict
        if self.host is not None:
            self.host.on_restore, self.host.on_evict = on_restore, on_host_evict

    def held_tokens(self, free: Iterable[int]) -> int:
        """Tokens whose KV rows the slots ``free`` hold for reuse now (a record that a
        generation holds is not counted)."""
        return sum(r.size for r in [self.slots[i].rec for i in free] if r is not None)

    def next(self, waiting: Sequence[Waiter], free: Iterable[int], now: float | None = None) -> tuple[Waiter, int] | None:
        """The next request to start and its free slot (:func:`pick`; ``now``:
        ``time.perf_counter()``); nothing changes until the caller :meth:`claim` s it."""
        now = time.perf_counter() if now is None else now
        return pick({i: (self.slots[i].rec, self.slots[i].used) for i in free}, waiting, self.slots[0].t_step, self.policy, now)

    def claim(self, w: Waiter, waiting: Sequence[Waiter], now: float | None = None) -> None:
        """``w``'s request starts now (the caller then takes it out of ``waiting``): the
        requests before it in ``waiting`` have been passed over once more (:class:`Waiter`'s
        ``passed`` and ``held``)."""
        now = time.perf_counter() if now is None else now
        for x in waiting:
            if x is w:
                break
            x.passed += 1
            x.held = now if x.held is None else x.held

    def exchange(self, a: int, b: int, rows_a: int, rows_b: int) -> None:
        """Swap slots ``a`` and ``b`` of the batched model: KV rows ``[0, rows_a)`` of ``a``
        go to ``b`` and ``[0, rows_b)`` of ``b`` to ``a`` (the batched model's ``exchange``),
        with their draft forks and records."""
        if a == b:
            return
        self.kv.exchange(a, b, rows_a, rows_b)
        sa, sb = self.slots[a], self.slots[b]
        for name in ("draft", "rec", "used"):
            va, vb = getattr(sa, name), getattr(sb, name)
            setattr(sa, name, vb)
            setattr(sb, name, va)
