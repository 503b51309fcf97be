"""The host prompt cache (runtime/hostcache.py): histories copied out of a slot before a
request overwrites them and back when their conversation returns, bit for bit, under an
LRU byte budget; and six 3-turn chats on 2 workers or 2 batch slots where, with the cache,
every follow-up reuses its whole previous prompt (without it only the 4 whose history a free
slot held did, tests/test_slots.py), every output (tokens, logprobs, a seeded chat's too)
equal to a cold Engine's."""

from __future__ import annotations

import numpy as np
import pytest
from test_slots import ENGINES, six_chats

from specrt import Engine
from specrt.runtime.errors import InputError
from specrt.runtime.hostcache import HostCache
from specrt.runtime.prefix import KVPrefix
from specrt.runtime.slots import Slot, SlotPolicy, Slots


class _KV:
    """A model stand-in holding KV rows: two buffers of ``[rows, 4]`` float32 (one tiled by
    8 rows, as the kernels' K tiles 16), each row's values its own."""

    max_q = 8

    def __init__(self, ctx: int = 128):
        self.k = np.zeros((ctx, 4), np.float32)
        self.v = np.zeros((ctx, 4), np.float32)

    def kv_prefix(self, rows):
        return [self.k[: -(-rows // 8) * 8], self.v[:rows]]

    def fill(self, tokens):
        """Write the rows a run over ``tokens`` would: each row a function of its prefix."""
        h = np.cumsum(np.asarray(tokens, np.float64) * 7.0 + 1.0)
        self.k[: len(tokens)] = h[:, None] + np.arange(4)
        self.v[: len(tokens)] = -h[:, None] - np.arange(4)


def _slot(cache: HostCache) -> Slot:
    s = Slot(_KV(), _KV(), 1, 5)
    s.host = cache
    return s


def _keep(slot: Slot, tokens, draft_rows: int = 0) -> KVPrefix:
    """Run ``tokens`` on ``slot`` and keep them as its record."""
    slot.target.fill(tokens)
    slot.draft.fill(tokens)
    slot.rec = KVPrefix(tuple(tokens), len(tokens), draft_rows)
    return slot.rec


A, B, C = list(range(100, 140)), list(range(200, 230)), list(range(300, 350))
ROW = 4 * 4 * 2  # bytes of one row in both buffers of a _KV (K in whole 8-row tiles)


def test_a_taken_slot_s_history_comes_back_bit_for_bit():
    cache = HostCache(1 << 20)
    s = _slot(cache)
    rec_a = _keep(s, A, draft_rows=32)
    want_k, want_dv = s.target.k[:40].copy(), s.draft.v[:32].copy()
    # B takes the slot: A's rows go to the cache before B writes
    assert s.recall(s.take(), B + [1]) is rec_a  # nothing better in the cache: the slot's own record
    assert len(cache) == 1 and cache.nbytes == 40 * ROW + 32 * ROW
    _keep(s, B)
    # A's next turn on the slot holding B: A's rows are copied back, B's go to the cache
    got = s.recall(s.take(), A + [7, 8])
    assert got == rec_a and cache.hits == 1 and cache.restored == 40
    assert np.array_equal(s.target.k[:40], want_k) and np.array_equal(s.draft.v[:32], want_dv)
    assert len(cache) == 2  # A stays (most recently used), B joined
    # a request that continues the slot's record keeps it and copies nothing
    before = cache.nbytes
    assert s.recall(got, A + [7, 8, 9]) is got and cache.nbytes == before and cache.hits == 1


def test_an_entry_without_draft_rows_keeps_the_slot_s_draft_rows():
    """An entry left by a request that drafted without the draft model (target rows only)
    serves a prompt further than the slot's own record, whose draft rows serve it: the
    entry's target rows are copied, the slot's draft rows stay, the record joins both."""
    cache = HostCache(1 << 20)
    other = _slot(cache)
    cache.put(_keep(other, A, draft_rows=0), other.target, other.draft)  # target rows only
    s = _slot(cache)
    _keep(s, A[:24], draft_rows=16)
    s.draft.k[16:] = 99.0  # the slot's draft rows past its record: must not be touched
    want = s.draft.k.copy()
    got = s.recall(s.take(), A + [7])
    assert got == KVPrefix(tuple(A), 40, 16)
    assert np.array_equal(s.draft.k, want) and np.array_equal(s.target.k[:40], other.target.k[:40])
    assert cache.restored == 40


def test_entries_are_evicted_least_recently_used_first_and_covered_ones_dropped():
    evicted = []
    cache = HostCache(100 * ROW)  # 100 rows of one _KV target (no draft rows kept)
    cache.on_evict = evicted.append
    s = _slot(cache)
    for toks in (A, B):  # 40 + 30 rows
        cache.put(_keep(s, toks), s.target, None)
    assert cache.tokens == 70 and len(cache) == 2
    assert not cache.put(_keep(s, A[:20]), s.target, None)  # A covers it: not stored twice, A used now
    assert cache.tokens == 70
    cache.put(_keep(s, C), s.target, None)  # 50 rows: B (least recently used) goes
    assert cache.tokens == 90 and evicted == [30] and cache.evicted == 30
    cache.put(_keep(s, B + [5]), s.target, None)  # 31 rows: A goes
    assert cache.tokens == 81 and evicted == [30, 40]
    cache.put(_keep(s, C + [5, 6]), s.target, None)  # covers C: C is dropped, not evicted
    assert cache.tokens == 83 and len(cache) == 2 and evicted == [30, 40]
    assert not cache.put(_keep(s, list(range(101))), s.target, None)  # alone over the budget: not kept
    assert cache.tokens == 83 and cache.nbytes <= cache.budget
    with pytest.raises(InputError, match="it must be > 0"):
        HostCache(0)


def test_a_pool_uses_the_cache_only_with_a_prefix_cache_and_models_that_hold_rows():
    cache = HostCache(1 << 20)
    assert Slots([Slot(_KV(), _KV(), 1, 5)], host=cache).host is cache
    assert Slots([Slot(_KV(), _KV(), 1, 5)], budget=0, host=cache).host is None  # prefix cache off
    assert Slots([Slot(_KV(), object(), 1, 5)], host=cache).host is None  # a draft without kv_prefix
    s = Slot(_KV(), _KV(), 1, 5)
    assert s.recall(None, A) is None  # no cache: the record as is


@pytest.fixture(scope="module")
def cold():
    return Engine(ENGINES, prefix_cache=False)


@pytest.fixture(scope="module")
def cold_ort():
    return Engine(ENGINES, prefix_cache=False, backend="ort-cpu")


@pytest.mark.parametrize("kind,backend", [("workers", None), ("max-batch", None), ("max-batch", "ort-cpu")])
def test_six_chats_on_two_slots_all_get_their_history_back_from_host_ram(cold, cold_ort, kind, backend):
    pools: list = []
    follow = six_chats(kind, SlotPolicy(), cold if backend is None else cold_ort, cache_ram_mib=64, backend=backend, pool_out=pools)
    assert len(follow) == 12
    for f in follow:  # the whole previous prompt (but its last token, which the reply's text may merge with)
        assert f["reused"] >= f["prev"] - 1, follow
    host = pools[0].slots.host
    assert host is not None and host.hits >= 8 and host.nbytes <= 64 << 20  # the 8 follow-ups no free slot held


def test_serve_settings_reach_the_host_cache():
    pytest.importorskip("fastapi")
    from specrt.runtime.serve.jobs import ServeError
    from specrt.runtime.serve.server import build_service

    svc = build_service(ENGINES, workers=2, cache_ram_mib=3)
    try:
        assert svc.pool.slots.host.budget == 3 << 20
        assert b"specrt_host_cache_bytes" in svc.metrics.render()
    finally:
        svc.pool.close()
    svc = build_service(ENGINES, cache_ram_mib=0)
    try:
        assert svc.pool.slots.host is None
    finally:
        svc.pool.close()
    with pytest.raises(ServeError, match="cache_ram=-1 MiB; it must be >= 0"):
        build_service(ENGINES, cache_ram_mib=-1)
