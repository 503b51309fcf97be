"""Prefix reuse behind ``specrt serve``: a conversation's later requests report
``usage.prompt_tokens_details.cached_tokens`` (as OpenAI does) and /metrics counts the hits,
the cached tokens and the budget's evictions; every answer equals a cold Engine's."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the [serve] extra is not installed: pip install -e '.[serve]'")

from serving import Server, post, read_metrics  # noqa: E402

from specrt import Engine, GenerationConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ENGINES = REPO / "engines" / "default"
PROMPTS = [json.loads(x)["prompt"] for x in (REPO / "data" / "humaneval_dev.jsonl").read_text().splitlines()[:5]]
# the tests that read KV and logits buffers row by row run the onnxruntime graph (its layouts:
# [slots, heads, max_ctx, head_dim], [rows, vocab]); the kernels' release of rows is
# tests/test_kernels_engine.py's, and their routing test_slots.py's (the folder's default backend)
ORT = "ort-cpu"


@pytest.fixture(scope="module")
def cold():
    return Engine(ENGINES, prefix_cache=False)  # the folder's default backend, as the servers below


@pytest.fixture(scope="module")
def cold_ort():
    return Engine(ENGINES, prefix_cache=False, backend=ORT)


# one worker, or the batch scheduler with two slots (policy speculate: exact) whose budget
# gives each slot the same share
POOLS = {"workers": (("--workers", "1"), 1), "max-batch": (("--max-batch", "2", "--batch-policy", "speculate"), 2)}


@pytest.mark.parametrize("pool", sorted(POOLS))
@pytest.mark.parametrize("budget", [None, 300])
def test_conversation_reuses_prefixes_and_reports_them(cold, budget, pool):
    """Five completions, each the last prompt + its answer + one more prompt. With a budget of
    300 tokens (per worker or slot) the longer records are cut to 300 rows (an eviction each)
    and still hit."""
    args, share = POOLS[pool]
    args = args + ("--model-name", "m") + (("--prefix-cache-tokens", str(budget * share)) if budget else ())
    srv = Server(ENGINES, *args)
    try:
        before = read_metrics(srv.port)
        text, cached = "", []
        for p in PROMPTS:
            text += p
            status, out, _ = post(srv.port, dict(prompt=text, max_tokens=24, temperature=0))
            assert status == 200, out
            ref = cold.generate(text, GenerationConfig(max_new_tokens=24, temperature=0))
            assert out["choices"][0]["text"] == ref.text
            assert out["usage"]["prompt_tokens"] == ref.stats.prompt_tokens
            cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
            text += out["choices"][0]["text"]
        after = read_metrics(srv.port)
        # the gauge of tokens held now (the last record is released just after its answer)
        deadline = time.time() + 60
        while after["specrt_prefix_cache_tokens"] == 0 and time.time() < deadline:
            time.sleep(0.1)
            after = read_metrics(srv.port)
    finally:
        srv.stop()

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    # the prompts have 131, 255, 423, 552 and 717 tokens, each answer 24: a turn reuses the
    # last prompt and answer but the pending token's row (every committed row: the embedded
    # target's export measured its wide widths, runtime/prefix.py "Any layout"), within the
    # common prefix (the fifth: 551 of 575, the text re-tokenizes differently from there)
    assert cached == ([0, 154, 278, 446, 551] if budget is None else [0, 154, 278, 300, 300]), cached
    assert delta("specrt_prefix_cache_hits_total") == sum(c > 0 for c in cached)
    assert delta("specrt_prefix_cache_cached_tokens_total") == sum(cached)
    # with a budget the records of 446, 575 and 740 rows are cut to 300 (any row count stays reusable)
    assert delta('specrt_prefix_cache_evictions_total{reason="budget"}') == (0 if budget is None else 3)
    assert delta("specrt_prefix_cache_evicted_tokens_total") == (0 if budget is None else 146 + 275 + 440)
    # held now: the last record (each turn is routed back to the slot holding the last)
    assert after["specrt_prefix_cache_tokens"] == (740 if budget is None else 300)


@pytest.mark.parametrize("pool", sorted(POOLS))
def test_prefix_cache_off(cold, pool):
    srv = Server(ENGINES, *POOLS[pool][0], "--prefix-cache-tokens", "0")
    try:
        text = PROMPTS[0] + PROMPTS[1] + PROMPTS[2]
        for _ in range(2):
            status, out, _ = post(srv.port, dict(prompt=text, max_tokens=8, temperature=0))
            assert status == 200 and out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        srv.stop()


def _idle_rows_released(buf, slot: int, kept: int) -> None:
    """KV buffer ``buf`` (``[slots, heads, max_ctx, head_dim]``) of an idle slot holds rows
    ``[0, kept)`` and nothing from the first whole page after them on (released: zeros)."""
    per_page = max(1, 4096 // (buf.shape[-1] * buf.itemsize))
    assert np.count_nonzero(buf[slot, :, kept + per_page :]) == 0, (slot, kept)
    if kept:
        assert np.count_nonzero(buf[slot, :, :kept]) > 0


def _scratch_logits_released(logits, narrow: int) -> None:
    """An idle model's logits buffer (``[..., rows, vocab]``) holds nothing from the first
    whole page after row ``narrow`` on (prefill scratch, released: zeros)."""
    rows = logits.reshape(-1, logits.shape[-1])
    skip = -(-4096 // (rows.shape[1] * rows.itemsize))  # rows in the page a release may keep
    assert rows.shape[0] > narrow + skip and np.count_nonzero(rows[narrow + skip :]) == 0, narrow


@pytest.mark.parametrize("budget", [None, 1024])
def test_worker_pool_routes_a_conversation_back_to_its_kv(cold_ort, budget):
    """Two conversations take turns on a pool of two workers; each follow-up turn goes to the
    idle worker holding its history (the longest reusable prefix), so every one hits, and each
    output equals the cold Engine's. With a budget (512 tokens a worker), an idle worker's
    KV rows past its cut record are handed back to the OS (they read as zeros) and the
    outputs still equal the cold ones."""
    from test_batching import Events

    from specrt.runtime.serve.jobs import Job, WorkerPool

    first = Engine(ENGINES, backend=ORT)
    engines = [first, first.fork()]
    pool = WorkerPool(engines, prefix_cache_tokens=budget)
    try:
        convs = [PROMPTS[0] + PROMPTS[1] + PROMPTS[2], PROMPTS[3] + PROMPTS[4] + PROMPTS[0]]
        hits = []
        for turn in range(3):
            for c in range(2):
                cfg = first.resolve(GenerationConfig(max_new_tokens=16))
                ev = Events()
                pool.submit(Job(ids=first.prompt_ids(convs[c]), config=cfg, emit=ev))
                r = ev.result()
                assert r.tokens == cold_ort.generate(convs[c], GenerationConfig(max_new_tokens=16)).tokens
                hits.append(r.stats.cached_tokens)
                convs[c] += r.text + "\n# next\n"
                deadline = time.time() + 60
                while pool.busy and time.time() < deadline:  # the worker cuts and releases after emitting
                    time.sleep(0.01)
                for e in engines:  # budget or not: the prefill's logits rows go back
                    for m in (e.target, e.draft):
                        _scratch_logits_released(m.logits, first.manifest.k_max + 1)
                if budget is not None:
                    for e in engines:
                        rec = e.cached
                        assert rec is None or rec.size <= budget // 2
                        for m, kept in ((e.target, rec.target_rows if rec else 0), (e.draft, rec.draft_rows if rec else 0)):
                            for b in (*m.keys, *m.values):
                                _idle_rows_released(b, 0, kept)
        assert hits[:2] == [0, 0] and all(h >= 256 for h in hits[2:]), hits
        assert pool.queued == 0 and pool.busy == 0
    finally:
        pool.close()


@pytest.mark.parametrize("pool", [["--workers", "3"], ["--max-batch", "3", "--in-flight", "4096"]], ids=["workers", "max-batch"])
def test_short_prefix_soak_loses_nothing_and_holds_memory(tmp_path, pool):
    """specrt.bench.soak_prefix: random multi-turn chats of 3 clients on 3 workers (or 3 batch
    slots, with a 4,096-token in-flight limit) with a 1,024-token budget; every request
    answered, RSS after the warm-up within 10%, the cache used, the budget's KV bytes those of
    the engine's buffers (and the in-flight bound's, budget + limit). The phases end on work,
    not seconds (a machine 2-3x slower, or loaded, took its "warm" reading before the cache
    filled): the warm-up once 200 requests were answered and the cache has served a budget's
    worth of prompt tokens, the run 150 answers after it (10 minutes at most)."""
    from specrt.bench import soak_prefix

    out = tmp_path / "soak.json"
    args = ["--engines", str(ENGINES), *pool, "--clients", "3", "--budget", "1024", "--out", str(out)]
    args += ["--warmup-requests", "200", "--warmup-cached", "1024", "--requests", "150", "--sample-every", "2", "--minutes", "10"]
    rc = soak_prefix.main(args)
    rep = json.loads(out.read_text())
    assert rc == 0 and rep["holds"], {k: v for k, v in rep.items() if k != "samples"}
    assert rep["requests_lost"] == 0 and rep["requests_after_warmup"] >= 150 and rep["requests_sent"] >= 350
    assert rep["prefix_cache_hits"] >= 1 and rep["cached_tokens"] >= 256
    eng = Engine(ENGINES)
    kv = lambda m: (m.k, m.v) if hasattr(m, "k") else (*m.keys, *m.values)  # noqa: E731  (kernels' buffers, or the graph's per layer)
    per_token = sum(sum(a.nbytes for a in kv(m)) / m.max_ctx for m in (eng.draft, eng.target))
    assert rep["budget_kv_mib"] == round(1024 * per_token / 2**20, 1) > 0
    if "--in-flight" in pool:  # the bound on every resident KV row: budget + the running requests' limit
        assert rep["kv_bound_mib"] == round((1024 + 4096) * per_token / 2**20, 1)
        assert rep["peak_over_loaded_plus_kv_bound"] > 0
    else:
        assert rep["kv_bound_mib"] is None
    assert rep["rss_loaded_mib"] > 0 and rep["peak_over_weights_plus_budget"] > 0


@pytest.mark.parametrize("budget", [None, 1024])
def test_batch_slots_route_conversations_back_to_their_kv(cold, cold_ort, budget):
    """Two conversations (one greedy, one sampled with a seed) send each turn together to
    the batch scheduler's two slots (policy speculate); as rows finish, the KV they leave
    moves to a free slot, and each follow-up turn is admitted on the slot holding its
    history: every follow-up hits, and every output equals a cold Engine's. With a budget
    (512 tokens a slot), a free slot's target rows and its draft fork's rows past its record
    are handed back to the OS (zeros), and the outputs still equal the cold ones."""
    from test_batching import Events

    from specrt.runtime.costs import BatchCosts
    from specrt.runtime.serve.batching import BatchPool
    from specrt.runtime.serve.jobs import Job

    eng = Engine(ENGINES, backend=None if budget is None else ORT)  # with a budget it reads the graph's KV buffers row by row
    cold = cold if budget is None else cold_ort
    pool = BatchPool(eng, 2, policy="speculate", costs=BatchCosts([0.0, 1e-3, 1e-3]), prefix_cache_tokens=budget)
    try:
        convs = [PROMPTS[0] + PROMPTS[1] + PROMPTS[2], PROMPTS[3] + PROMPTS[4] + PROMPTS[0]]
        cfgs = [GenerationConfig(max_new_tokens=16), GenerationConfig(max_new_tokens=20, temperature=0.8, seed=5)]
        hits = []
        for turn in range(3):
            evs = [Events(), Events()]
            pool.submit_all([Job(ids=eng.prompt_ids(c), config=eng.resolve(g), emit=ev) for c, g, ev in zip(convs, cfgs, evs)])
            for c in range(2):
                r = evs[c].result()
                assert r.tokens == cold.generate(convs[c], cfgs[c]).tokens, (turn, c)
                hits.append(r.stats.cached_tokens)
                convs[c] += r.text + "\n# next\n"
            deadline = time.time() + 60
            while pool.busy and time.time() < deadline:
                time.sleep(0.01)
            narrow = max(2, eng.manifest.k_max + 1)  # budget or not: the prefills' logits rows go back
            _scratch_logits_released(pool.batched.logits, narrow)
            for spare in pool.slots:  # every slot is free now
                _scratch_logits_released(spare.draft.logits, narrow)
            if budget is not None:
                for slot, spare in enumerate(pool.slots):
                    rec = spare.rec
                    assert rec is None or rec.size <= budget // 2
                    for b in (*pool.batched.keys, *pool.batched.values):
                        _idle_rows_released(b, slot, rec.target_rows if rec else 0)
                    for b in (*spare.draft.keys, *spare.draft.values):
                        _idle_rows_released(b, 0, rec.draft_rows if rec else 0)
        assert hits[:2] == [0, 0] and all(h >= 256 for h in hits[2:]), hits
        assert pool.queued == 0 and pool.busy == 0
    finally:
        pool.close()


def test_batch_pool_refuses_a_negative_budget():
    from specrt.runtime.costs import BatchCosts
    from specrt.runtime.serve.batching import BatchPool
    from specrt.runtime.serve.jobs import ServeError

    with pytest.raises(ServeError, match="prefix_cache_tokens=-1; it must be >= 0"):
        BatchPool(Engine(ENGINES), 2, costs=BatchCosts([0.0, 1e-3, 1e-3]), prefix_cache_tokens=-1)


def test_route_key_prefers_a_continued_history_then_the_fewest_rows_lost():
    """llama-server's slot similarity: a holder counts its reusable rows when they are at least
    half the shorter of the prompt and its record; a few shared rows (a common first line)
    do not pull a request onto a long history another conversation comes back to."""
    from specrt.runtime.prefix import KVPrefix, route_key

    hist = list(range(1000, 1500))
    other = hist[:9] + list(range(5000, 5300))
    rec = KVPrefix(tuple(hist), 500, 256)
    assert route_key(rec, hist + [7] * 100, 1) == (500, 0)  # continues it
    assert route_key(rec, hist[:300], 1) == (300, -200)  # cut back (regenerated turn)
    assert route_key(rec, other, 1) == (0, -491)  # 9 shared rows: not similar
    assert route_key(None, other, 1) == (0, 0) > route_key(rec, other, 1)  # an empty holder wins
    assert route_key(rec, hist + [7], 256) == (256, -244)  # whole aligned calls
    assert route_key(KVPrefix(tuple(hist[:18]), 18, 0), other, 1) == (9, -9)  # half a short record: similar
    assert route_key(KVPrefix(tuple(hist[:20]), 20, 0), other, 1) == (0, -11)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_prefill_logits_rows_go_back_once_read(monkeypatch, temperature):
    """A generation hands the target's logits rows past the verification widths back to the
    OS right after its prefill, and the draft's after its first feed (both of a prompt of
    several wide chunks): they read as zeros once it ends, and the output (greedy, seeded
    sampling) is the one of a run that releases nothing."""
    import specrt.runtime.generation as generation

    eng = Engine(ENGINES, prefix_cache=False, backend=ORT)
    prompt = PROMPTS[0] + PROMPTS[1] + PROMPTS[2]
    assert len(eng.prompt_ids(prompt)) > eng.target.max_q  # a full chunk writes every logits row
    cfg = GenerationConfig(max_new_tokens=24, temperature=temperature, seed=3)
    r = eng.generate(prompt, cfg)
    for m in (eng.target, eng.draft):
        _scratch_logits_released(m.logits, eng.manifest.k_max + 1)
    monkeypatch.setattr(generation, "release_prefill_logits", lambda model, k_max: 0)
    kept = Engine(ENGINES, prefix_cache=False, backend=ORT)
    want = kept.generate(prompt, cfg)
    assert np.count_nonzero(kept.target.logits[0, eng.manifest.k_max + 2 :]) > 0  # the oracle released nothing
    assert r.tokens == want.tokens and r.stats.accepted_hist == want.stats.accepted_hist
