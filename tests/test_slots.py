"""KV residency (runtime/slots.py): the slot rule that gives a waiting request the free slot
holding its history, its bound, what a slot keeps, trims and releases; and six 3-turn
chats on 2 workers or 2 batch slots, where every follow-up whose history a free slot holds
when it arrives reuses at least its previous turn's aligned prefix, and every output
(tokens, logprobs) equals a cold Engine's. Before the slot rule a queued request took the
first free slot whatever it held: no follow-up got its history back (0-9 shared tokens)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from test_batching import Events

from specrt import Engine, GenerationConfig
from specrt.runtime.errors import InputError
from specrt.runtime.prefix import KVPrefix, prefill_calls
from specrt.runtime.slots import Slot, SlotPolicy, Slots, Waiter, pick

REPO = Path(__file__).resolve().parents[1]
ENGINES = REPO / "engines" / "default"
PROMPTS = [json.loads(x)["prompt"] for x in (REPO / "data" / "humaneval_dev.jsonl").read_text().splitlines()[:24]]


# ---- the slot rule (pure) -----------------------------------------------------------------
def _rec(tokens) -> KVPrefix:
    return KVPrefix(tuple(tokens), len(tokens), 0)


A, B, C = list(range(100, 200)), list(range(300, 400)), list(range(500, 600))


def test_a_waiting_request_gets_the_free_slot_holding_its_history_ahead_of_earlier_ones():
    free = {0: (_rec(A), 5.0), 1: (_rec(B), 6.0)}
    waiting = [Waiter("c", C + [1]), Waiter("b", B + [2]), Waiter("a", A + [3])]
    assert pick(free, waiting, 1, SlotPolicy(), now=0.0) == (waiting[1], 1)  # b's history in slot 1: b first
    assert pick({0: free[0]}, waiting, 1, SlotPolicy(), now=0.0) == (waiting[2], 0)  # a's in slot 0
    # nobody's history free: arrival order, to the slot that loses the fewest rows, then the least recently used
    assert pick({0: (_rec(A), 5.0), 1: (_rec(B[:50]), 6.0)}, [waiting[0]], 1, SlotPolicy(), 0.0) == (waiting[0], 1)
    assert pick({0: (_rec(A), 5.0), 1: (_rec(B), 4.0)}, [waiting[0]], 1, SlotPolicy(), 0.0) == (waiting[0], 1)
    assert pick({0: (None, 9.0), 1: (_rec(B), 0.0)}, [waiting[0]], 1, SlotPolicy(), 0.0) == (waiting[0], 0)  # an empty slot first
    assert pick({}, waiting, 1, SlotPolicy(), 0.0) is None and pick(free, [], 1, SlotPolicy(), 0.0) is None


def test_a_request_is_passed_over_at_most_the_policys_bound():
    slots = Slots([Slot(None, _Draft(), 1, 5) for _ in range(2)], policy=SlotPolicy(wait_ms=100.0, wait_requests=2))
    slots[0].rec, slots[1].rec = _rec(A), _rec(B)
    slots[0].used, slots[1].used = 2.0, 1.0  # slot 1 least recently used
    c = Waiter("c", C)
    waiting = [c] + [Waiter(f"a{i}", A + [i]) for i in range(3)]
    for i in range(2):  # two follow-ups of A pass c over (c waits; its own history is nowhere)
        w, s = slots.next(waiting, [0, 1], now=1.0)
        assert (w.job, s) == (f"a{i}", 0)
        slots.claim(w, waiting, now=1.0)
        waiting.remove(w)
    assert (c.passed, c.held) == (2, 1.0)
    assert slots.next(waiting, [0, 1], now=1.0) == (c, 1)  # passed twice: c goes first (to the least recently used)
    # the time bound: passed once, then 100 ms later
    d = Waiter("d", C)
    q = [d, Waiter("a", A)]
    slots.claim(q[1], q, now=2.0)
    assert slots.next([d, Waiter("a2", A)], [0], now=2.05)[0].job == "a2"
    assert slots.next([d, Waiter("a2", A)], [0], now=2.1)[0] is d
    # wait_requests 0: first come first served (each to its best free slot)
    fifo = SlotPolicy(wait_requests=0)
    assert pick({0: (_rec(A), 0.0)}, [Waiter("c", C), Waiter("a", A)], 1, fifo, 0.0)[0].job == "c"


def test_slot_policy_and_budget_refuse_negative_values():
    with pytest.raises(InputError, match="slot_wait_ms=-1; it must be >= 0") as e:
        SlotPolicy(wait_ms=-1)
    assert e.value.param == "slot_wait_ms"
    with pytest.raises(InputError, match="slot_wait_requests=-2") as e:
        SlotPolicy(wait_requests=-2)
    assert e.value.param == "slot_wait_requests"
    with pytest.raises(InputError, match="prefix_cache_tokens=-1; it must be >= 0"):
        Slots([Slot(None, _Draft(), 1, 5)], budget=-1)


class _Draft:
    """A draft model stand-in: its widest call and the release calls it gets."""

    max_q = 64

    def __init__(self):
        self.released = []

    def release_rows(self, start):
        self.released.append(("rows", start))
        return 0

    def release_logits(self, start):
        self.released.append(("logits", start))
        return 0


class _Gen:
    def __init__(self, rec):
        self.rec = rec

    def prefix(self):
        return self.rec


def test_a_slot_keeps_trims_and_releases_by_its_share():
    target, draft = _Draft(), _Draft()
    pool = Slots([Slot(target, draft, 8, 5), Slot(_Draft(), _Draft(), 8, 5)], budget=200)
    evicted = []
    pool.attach(evicted.append)
    s = pool[0]
    assert s.share == 100
    s.keep(_Gen(KVPrefix(tuple(range(300)), 300, 256)))  # cut to 100 rows: 96 target (whole 8-row calls), 64 draft
    assert (s.rec.target_rows, s.rec.draft_rows, evicted) == (96, 64, [300 - 96])
    assert s.take().target_rows == 96 and s.rec is None  # a generation holds it now
    s.put(KVPrefix(tuple(range(40)), 40, 0))
    s.release()
    assert target.released == [("logits", 5), ("rows", 40)] and draft.released == [("logits", 5), ("rows", 0)]
    off = Slots([Slot(_Draft(), _Draft(), 8, 5)], budget=0)
    off.attach(evicted.append)
    off[0].keep(_Gen(KVPrefix(tuple(range(300)), 300, 256)))
    assert off[0].rec is None and len(evicted) == 1  # no prefix cache: nothing kept, nothing evicted
    free = Slot(_Draft(), _Draft(), 8, 5)  # no budget: logits only
    free.release()
    assert free.target.released == [("logits", 5)]


# ---- six 3-turn chats on 2 workers / 2 batch slots ----------------------------------------
@pytest.fixture(scope="module")
def cold():
    return Engine(ENGINES, prefix_cache=False)


# chat 1 asks for logprobs, chat 2 samples with a seed, the others are greedy
CFGS = [GenerationConfig(max_new_tokens=16, **kw) for kw in ({}, dict(logprobs=2), dict(temperature=0.8, seed=5), {}, {}, {})]


def _pool(kind: str, policy: SlotPolicy, cache_ram_mib: int = 0, backend: str | None = None):
    eng = Engine(ENGINES, backend=backend)
    if kind == "workers":
        from specrt.runtime.serve.jobs import WorkerPool

        return eng, WorkerPool([eng, eng.fork()], slot_policy=policy, cache_ram_mib=cache_ram_mib)
    from specrt.runtime.costs import BatchCosts
    from specrt.runtime.serve.batching import BatchPool

    return eng, BatchPool(eng, 2, policy="speculate", costs=BatchCosts([0.0, 1e-3, 1e-3]), slot_policy=policy, cache_ram_mib=cache_ram_mib)


def _holds(slot, seq) -> bool:
    """Whether ``slot``'s record is the history ``seq`` left (its tokens a prefix of it)."""
    rec = slot.rec
    return rec is not None and rec.target_rows > 0 and list(rec.tokens) == list(seq[: len(rec.tokens)])


def six_chats(kind: str, policy: SlotPolicy, cold, cache_ram_mib: int = 0, backend: str | None = None, pool_out: list | None = None) -> list[dict]:
    """Six 3-turn chats on a pool of 2 (each turn's six requests queued together, the next
    turn once all are answered); per follow-up: its chat, the reused rows, the aligned
    prefix of its previous turn, whether a free slot held that turn's history when it was
    queued. Every output is checked against the cold Engine. ``cache_ram_mib``: the pool's
    host prompt cache; ``pool_out`` gets the pool."""
    eng, pool = _pool(kind, policy, cache_ram_mib, backend)
    if pool_out is not None:
        pool_out.append(pool)
    plan = eng.plan(eng.resolve(CFGS[0]))
    texts = [PROMPTS[i] + PROMPTS[i + 6] + PROMPTS[i + 12] + PROMPTS[i + 18] for i in range(6)]  # 338-537 tokens
    prev: list = [None] * 6  # (prompt ids, whole sequence) of each chat's last turn
    out = []
    try:
        for turn in range(3):
            ids = [eng.prompt_ids(t) for t in texts]
            held = [p is not None and any(_holds(s, p[1]) for s in pool.slots) for p in prev]
            evs = [Events() for _ in texts]
            from specrt.runtime.serve.jobs import Job

            pool.submit_all([Job(ids=i, config=eng.resolve(c), emit=ev) for i, c, ev in zip(ids, CFGS, evs)])
            for c, ev in enumerate(evs):
                r = ev.result(120)
                ref = cold.generate(ids[c], CFGS[c])
                assert r.tokens == ref.tokens and r.logprobs == ref.logprobs, (kind, turn, c)
                if prev[c] is not None:
                    aligned = prefill_calls(None, prev[c][0], eng.target.max_q, plan.min_q, plan.tail_q)[2]
                    out.append(dict(chat=c, turn=turn, reused=r.stats.cached_tokens, aligned=aligned, held=held[c], prev=len(prev[c][0])))
                prev[c] = (ids[c], ids[c] + r.tokens)
                texts[c] += r.text + "\n# next\n"
            deadline = time.time() + 10
            while (pool.busy or pool.queued) and time.time() < deadline:  # a worker keeps its record after the answer
                time.sleep(0.01)
    finally:
        pool.close()
    return out


@pytest.mark.parametrize("kind", ["workers", "max-batch"])
def test_six_chats_on_two_slots_get_their_history_back(cold, kind):
    follow = six_chats(kind, SlotPolicy(), cold)
    assert len(follow) == 12 and all(f["aligned"] >= 256 for f in follow), follow  # every previous turn left a full aligned chunk
    found = [f for f in follow if f["held"]]
    # two slots hold two chats' last turns when the next turn is queued: 2 of 6 follow-ups a turn
    assert len(found) == 4, follow
    for f in found:
        assert f["reused"] >= f["aligned"], f


def test_six_chats_first_come_first_served_lose_their_history(cold):
    """The oracle for the rule above: with ``wait_requests=0`` (a queued request takes the
    free slot that serves it best in arrival order, as before the slot rule) the follow-ups
    whose history a free slot held lose it to earlier requests."""
    follow = six_chats("workers", SlotPolicy(wait_requests=0), cold)
    found = [f for f in follow if f["held"]]
    assert len(found) == 4 and all(f["reused"] < f["aligned"] for f in found), follow


def test_serve_settings_reach_the_pools_slot_policy():
    pytest.importorskip("fastapi")
    from specrt.runtime.serve.jobs import ServeError
    from specrt.runtime.serve.server import build_service

    for extra in ({}, dict(max_batch=2, batch_policy="speculate")):
        svc = build_service(ENGINES, slot_wait_ms=250.0, slot_wait_requests=0, **extra)
        try:
            assert svc.pool.slots.policy == SlotPolicy(wait_ms=250.0, wait_requests=0)
        finally:
            svc.pool.close()
    with pytest.raises(ServeError, match="slot_wait_requests=-1; it must be >= 0"):
        build_service(ENGINES, slot_wait_requests=-1)
