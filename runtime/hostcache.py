"""The host prompt cache: slots' histories kept in host RAM beyond the slots, so a follow-up
turn whose slot another request took still reuses its own prefix (llama-server's
``--cache-ram``; vLLM's CPU offloading of prefix blocks).

A slot keeps one record (:class:`~specrt.runtime.prefix.KVPrefix`: rows of the target's and
the draft's KV that a later request may reuse, :mod:`specrt.runtime.slots`). With more
conversations than slots, a request that takes a slot overwrites the record there, and that
conversation's next turn finds nothing. Here, when a request starts on a slot
(:meth:`HostCache.recall`):

1. the entry of the cache that serves its prompt best (most reusable target rows: the
   common prefix in whole ``step``-row calls, as :func:`~specrt.runtime.prefix.route_key`
   counts them) is chosen when it serves it better than the slot's own record;
2. the slot's record is copied into the cache (its KV rows' bytes, target and draft,
   :class:`~specrt.runtime.backends.base.HoldsRows`) when the request would overwrite any
   of it, unless an entry already holds it;
3. the entry chosen in 1 is copied into the slot's KV, and its record is the one the request
   reuses. The entry stays in the cache (most recently used): a request that shares only a
   system prompt with it overwrites the rest in the slot.

The copy is of the rows' bits and the record is the one the rows were kept under, so the
reuse rule of :mod:`specrt.runtime.prefix` holds as for the slot's own record: a restored
prefix gives the output of a cold run, greedy and seeded. Entries are evicted least recently
used first to stay within the byte budget; an entry that another entry extends (the same
rows and more) is dropped. The cost is a memory copy (about 40 KB a token for the 1.5B/0.5B
pair's f16 KV: 1,000 tokens in ~10 ms) against a prefill (~10 s for 1,000 tokens on 2
cores).

Thread safety: one lock around the entries; the copies into and out of a slot run under the
slot's owner (the Engine's lock, the batch scheduler's thread) as every write to its KV.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .backends.base import HoldsRows
from .errors import InputError
from .prefix import KVPrefix, common_prefix

__all__ = ["DEFAULT_CACHE_RAM_MIB", "HostEntry", "HostCache", "holds_rows"]

# llama-server's --cache-ram default is 8192 MiB; a quarter of that suits the 8 GB machines
# this project serves at the edge (an entry is only allocated when a history is evicted)
DEFAULT_CACHE_RAM_MIB = 2048


def holds_rows(*models) -> bool:
    """Whether every model (None skipped) offers :class:`~specrt.runtime.backends.base.HoldsRows`."""
    return all(m is None or isinstance(m, HoldsRows) for m in models)


@dataclass(frozen=True)
class HostEntry:
    """One history in host RAM.

    Attributes:
        rec: the record its rows were kept under (target and draft rows, tokens).
        target: copies of the target's :meth:`~specrt.runtime.backends.base.HoldsRows.kv_prefix`
            views for ``rec.target_rows``.
        draft: the same for the draft's ``rec.draft_rows`` (empty without draft rows).
        nbytes: bytes of the copies.
    """

    rec: KVPrefix
    target: tuple[np.ndarray, ...]
    draft: tuple[np.ndarray, ...]
    nbytes: int


def _copy(model, rows: int) -> tuple[np.ndarray, ...]:
    """Copies of ``model``'s KV rows ``[0, rows)`` (none for 0 rows)."""
    return tuple(v.copy() for v in model.kv_prefix(rows)) if rows > 0 else ()


def _paste(model, rows: int, saved: tuple[np.ndarray, ...]) -> None:
    """Write ``saved`` (from :func:`_copy` of a model of the same shapes) into ``model``'s
    rows ``[0, rows)``."""
    if rows > 0:
        for view, data in zip(model.kv_prefix(rows), saved, strict=True):
            view[...] = data


def _reusable(rec: KVPrefix | None, ids: Sequence[int], step: int, target: bool) -> int:
    """Rows of ``rec`` (its target's, or its draft's) that a request for ``ids`` may keep:
    within the common prefix, in whole ``step``-row calls (0 without a record)."""
    if rec is None:
        return 0
    return min(rec.target_rows if target else rec.draft_rows, common_prefix(rec.tokens, ids) // step * step)


def _covers(a: KVPrefix, b: KVPrefix) -> bool:
    """Whether record ``a`` holds all of ``b``: the same tokens over ``b``'s rows and at least
    as many target and draft rows."""
    return a.target_rows >= b.target_rows and a.draft_rows >= b.draft_rows and common_prefix(a.tokens, b.tokens) >= b.size


class HostCache:
    """The host prompt cache (module docstring), shared by a pool's slots.

    Args:
        budget_bytes: the most bytes of KV copies held (> 0); entries past it are evicted,
            least recently used first; one history larger than the budget is not kept.

    Attributes:
        hits: requests that got a history back from the cache.
        restored: target rows those requests got back.
        evicted: tokens of entries dropped for the budget.
        on_restore, on_evict: called with the tokens restored / evicted each time (the
            server's metrics), or None.

    Raises:
        InputError: ``budget_bytes`` < 1 (param ``cache_ram``).
    """

    def __init__(self, budget_bytes: int):
        if budget_bytes < 1:
            raise InputError(f"cache_ram budget of {budget_bytes} bytes; it must be > 0 (turn the host cache off with --cache-ram 0)", "cache_ram")
        self.budget = int(budget_bytes)
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, HostEntry] = OrderedDict()  # oldest use first
        self._next = 0
        self.nbytes = 0
        self.hits = self.restored = self.evicted = 0
        self.on_restore: Callable[[int], None] | None = None
        self.on_evict: Callable[[int], None] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        """Tokens whose KV rows the cache holds now."""
        with self._lock:
            return sum(e.rec.size for e in self._entries.values())

    def recall(self, rec: KVPrefix | None, ids: Sequence[int], target, draft, step: int) -> KVPrefix | None:
        """The record a request for ``ids`` starting on a slot reuses (module docstring).

        Args:
            rec: the slot's own record (taken from the slot), or None.
            ids: the sequence the request's prefill feeds (its prompt ids).
            target, draft: the slot's models (:class:`~specrt.runtime.backends.base.HoldsRows`;
                draft None when the slot has none). The caller holds their KV.
            step: the granularity of reusable target rows (:meth:`~specrt.runtime.manifest.Manifest.reuse_step`).

        Returns:
            ``rec``, or the record of an entry now copied into the slot's KV. When the slot's
            own draft rows serve the request further than the entry's (the entry came from a
            request that drafted without the draft model), only the entry's target rows are
            copied and the record joins them with the slot's draft rows.
        """
        own = _reusable(rec, ids, step, True)
        with self._lock:
            found = self._best(ids, step, own)
        if rec is not None and (found is not None or own < rec.size):
            self.put(rec, target, draft)
        if found is None:
            return rec
        _paste(target, found.rec.target_rows, found.target)
        out = found.rec
        d_step = getattr(draft, "max_q", 1)
        own_d = _reusable(rec, ids, d_step, False)
        if own_d > _reusable(found.rec, ids, d_step, False):
            t = _reusable(found.rec, ids, step, True)
            out = KVPrefix(tuple(ids[: max(t, own_d)]), t, own_d)  # both runs of rows equal ids there
        else:
            _paste(draft, found.rec.draft_rows, found.draft)
        with self._lock:
            self.hits += 1
            self.restored += out.target_rows
        if self.on_restore is not None:
            self.on_restore(out.target_rows)
        return out

    def _best(self, ids: Sequence[int], step: int, own: int) -> HostEntry | None:
        """With the lock held: the entry with the most reusable target rows for ``ids`` when
        that is more than ``own`` (now the most recently used), else None."""
        best, rows = None, own
        for key, e in self._entries.items():
            r = _reusable(e.rec, ids, step, True)
            if r > rows:
                best, rows = key, r
        if best is None:
            return None
        self._entries.move_to_end(best)
        return self._entries[best]

    def put(self, rec: KVPrefix, target, draft) -> bool:
        """Copy the rows of ``rec`` from ``target``'s and ``draft``'s KV into the cache (the
        caller holds their KV and nothing has overwritten them since ``rec`` was kept).
        Entries it covers are dropped; nothing is copied when an entry covers it or it alone
        exceeds the budget. Returns whether it was stored."""
        with self._lock:
            for key, e in self._entries.items():
                if _covers(e.rec, rec):
                    self._entries.move_to_end(key)
                    return False
        t = _copy(target, rec.target_rows)
        d = _copy(draft, rec.draft_rows) if draft is not None else ()
        nbytes = sum(a.nbytes for a in (*t, *d))
        if nbytes > self.budget:
            return False
        dropped = 0
        with self._lock:
            for key in [k for k, e in self._entries.items() if _covers(rec, e.rec)]:
                self.nbytes -= self._entries.pop(key).nbytes
            while self._entries and self.nbytes + nbytes > self.budget:
                _, old = self._entries.popitem(last=False)
                self.nbytes -= old.nbytes
                dropped += old.rec.size
            self._entries[self._next] = HostEntry(rec, t, d if draft is not None and rec.draft_rows else (), nbytes)
            self._next += 1
            self.nbytes += nbytes
            self.evicted += dropped
        if dropped and self.on_evict is not None:
            self.on_evict(dropped)
        return True
