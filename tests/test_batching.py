"""Continuous batching (issue 17): the slot-major batched builder model, its slot views, the
batch scheduler behind ``specrt serve --max-batch``.

Oracles: a slot view against an ordinary batch-1 model (bit for bit); batched rows against
the same sequence alone (independent of the other rows bit for bit; close to the batch-1
rows, which differ only by the kernels' rounding); greedy requests under batching against
the same request alone (exact when the scheduler speculates per row; near-ties reported
when it makes batched steps). Tiny int4 builder pair from conftest (seconds)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specrt import Engine
from specrt.runtime.backends import cpu_model
from specrt.runtime.backends.base import ThreadConfig
from specrt.runtime.backends.ort_gqa_batch import BatchedGqaModel
from specrt.runtime.errors import InputError
from specrt.runtime.lab.exactness import measure_batched, pattern_bounds, run_pattern
from specrt.runtime.machine import this_machine
from specrt.runtime.manifest import load_manifest


@pytest.fixture(scope="module")
def int4(int4_pair):
    return Engine(int4_pair[2])


@pytest.fixture(scope="module")
def batched(int4):
    return BatchedGqaModel(int4.target, 4, 32)


def test_slot_views_equal_a_batch1_model_bit_for_bit(int4_pair, int4, batched):
    m = load_manifest(int4_pair[2])
    ref_model = cpu_model(int4_pair[2], m.target, m.max_ctx, 32, ThreadConfig())
    rng = np.random.default_rng(0)
    seq = rng.integers(0, m.vocab_size, size=30).tolist()
    want = run_pattern(ref_model, seq, pattern_bounds(30, 4, 1))
    for j in (0, 3):
        got = run_pattern(batched.slots[j], seq, pattern_bounds(30, 4, 1))
        assert np.array_equal(got, want)
    # slot 3's run left slot 0's rows alone; slot 0's KV rows are the batch-1 model's
    run_pattern(batched.slots[0], seq, pattern_bounds(30, 4, 1))
    before = batched.keys[0][0].copy()
    batched.slots[3].run(rng.integers(0, m.vocab_size, size=10).tolist(), 0)
    assert np.array_equal(batched.keys[0][0], before)
    assert np.array_equal(batched.keys[0][0, :, :30], ref_model.keys[0][0, :, :30])


def test_batched_rows_are_independent_and_close_to_batch1(int4, batched):
    """Row 0 of a batched step gives the same bits whatever the other rows hold and however
    long they are; its rows stay within the kernels' rounding of the batch-1 rows."""
    rng = np.random.default_rng(1)
    V = int4.manifest.vocab_size
    s = rng.integers(0, V, size=40).tolist()
    L, steps = 20, 6
    ref = run_pattern(batched.slots[0], s, pattern_bounds(len(s), 9))[L - 1 : L - 1 + steps].copy()
    outs = []
    for other_len in (20, 25, 12):
        other = rng.integers(0, V, size=40).tolist()
        for n in (2, 4):
            run_pattern(batched.slots[0], s[:L], pattern_bounds(L, 9))
            for j in range(1, n):
                run_pattern(batched.slots[j], other[:other_len], pattern_bounds(other_len, 9))
            rows = []
            for t in range(steps):
                toks = [s[L - 1 + t]] + [other[other_len - 1 + t]] * (n - 1)
                rows.append(batched.step(toks, [L - 1 + t] + [other_len - 1 + t] * (n - 1))[0].copy())
            outs.append(np.stack(rows))
    for o in outs[1:]:
        assert np.array_equal(o, outs[0])
    assert np.abs(outs[0] - ref).max() < 0.1
    rec = measure_batched(batched, V, [1, 2, 4], steps=6, prefix=12)
    assert set(rec["max_abs_diff"]) == {"n1", "n2", "n4"} and max(rec["max_abs_diff"].values()) < 0.1


def test_batched_step_refuses_bad_input(batched):
    with pytest.raises(InputError, match="1..4 rows") as ei:
        batched.step([1] * 5, [3] * 5)
    assert ei.value.param == "tokens"
    with pytest.raises(InputError) as ei:
        batched.step([1, 2], [3])
    assert ei.value.param == "lengths"
    with pytest.raises(InputError) as ei:
        batched.step([1], [batched.max_ctx])
    assert ei.value.param == "lengths"
    with pytest.raises(InputError) as ei:
        BatchedGqaModel(None, 0, 4)
    assert ei.value.param == "max_batch"


def test_move_compacts_a_slot(int4, batched):
    rng = np.random.default_rng(2)
    s = rng.integers(0, int4.manifest.vocab_size, size=16).tolist()
    batched.slots[3].run(s, 0)
    batched.move(3, 1, 16)
    for buf in (*batched.keys, *batched.values):
        assert np.array_equal(buf[1, :, :16], buf[3, :, :16])


# ---- the scheduler ---------------------------------------------------------------------------
import threading  # noqa: E402
import time  # noqa: E402

from specrt import GenerationConfig  # noqa: E402
from specrt.runtime.lab.bench import divergences  # noqa: E402
from specrt.runtime.serve.batching import BatchCosts, BatchPool, choose_mode  # noqa: E402
from specrt.runtime.serve.jobs import Job, ServeError  # noqa: E402

PROMPTS = ["def add(a, b):", "for i in range(10):\n", "x", "class Foo:\n    def __init__(self, x):\n", "import os\nimport sys\n", "while True:"]


class Events:
    """A job's events with arrival times; ``done`` is set by the last one."""

    def __init__(self):
        self.items, self.done = [], threading.Event()

    def __call__(self, ev):
        self.items.append((time.perf_counter(), ev))
        if ev[0] in ("done", "cancelled", "error"):
            self.done.set()

    def result(self, timeout=60):
        assert self.done.wait(timeout), self.items
        kind, payload = self.items[-1][1]
        assert kind == "done", (kind, payload)
        return payload


def submit(pool, engine, prompt, stream=False, **cfg):
    ev = Events()
    job = Job(ids=engine.prompt_ids(prompt), config=engine.resolve(GenerationConfig(**cfg)), emit=ev, stream=stream)
    pool.submit(job)
    return job, ev


def submit_together(pool, engine, prompts, cfgs):
    """Queue one job per (prompt, config) in one call (admitted in the same iteration);
    returns [(job, events)]."""
    pairs = [
        (Job(ids=engine.prompt_ids(p), config=engine.resolve(GenerationConfig(**c)), emit=(ev := Events()), stream=False), ev) for p, c in zip(prompts, cfgs)
    ]
    pool.submit_all([job for job, _ in pairs])
    return pairs


def flat_costs(max_batch, s=1e-3):
    return BatchCosts([0.0] + [s] * max_batch)


def test_choose_mode_follows_the_costs():
    assert choose_mode(1, 1e-3, [(3.0, 1e-3)]) == "speculate"  # one row: always its own round
    assert choose_mode(4, 1e-3, []) == "speculate"  # nothing measured yet
    assert choose_mode(4, 2e-3, [(3.0, 4e-3)] * 4) == "batched"  # 2000 tok/s vs 750
    assert choose_mode(4, 8e-3, [(3.0, 4e-3)] * 4) == "speculate"  # 500 tok/s vs 750
    assert choose_mode(2, 2e-3, [(1.0, 4e-3), (5.0, 4e-3)]) == "batched"  # 1000 vs 750


def test_pool_refuses_bad_settings(int4, tiny_pair):
    with pytest.raises(ServeError, match="max_batch"):
        BatchPool(int4, 0, costs=flat_costs(1))
    with pytest.raises(ServeError, match="policy"):
        BatchPool(int4, 2, policy="fast", costs=flat_costs(2))
    with pytest.raises(ServeError, match="builder-graph"):
        BatchPool(Engine(tiny_pair[2]), 2, costs=flat_costs(2))


def test_speculating_rows_equal_the_requests_alone_and_join_between_rounds(int4):
    """policy speculate: every greedy row is the single-sequence loop bit for bit; 6
    requests through 3 slots, so requests join as others finish; sampled rows keep their
    own seeds (equal to the request alone with that seed)."""
    pool = BatchPool(int4, 3, policy="speculate", costs=flat_costs(3))
    try:
        cfgs = [dict(max_new_tokens=n, k_max=k) for n, k in zip((40, 6, 25, 9, 30, 12), (3, 1, 4, 8, 2, 3))]
        cfgs[2] = dict(max_new_tokens=25, temperature=0.8, top_p=0.95, seed=7, k_max=4)
        cfgs[4] = dict(max_new_tokens=30, temperature=0.9, seed=8, k_max=2)
        jobs = [submit(pool, int4, p, stream=i % 2 == 0, **c) for i, (p, c) in enumerate(zip(PROMPTS, cfgs))]
        results = [ev.result() for _, ev in jobs]
        for p, c, r, (_, ev) in zip(PROMPTS, cfgs, results, jobs):
            alone = int4.generate(p, GenerationConfig(**c))
            assert r.tokens == alone.tokens and r.text == alone.text and r.finish_reason == alone.finish_reason
            if ev.items[0][1][0] == "text":
                assert "".join(e[1][0] for _, e in ev.items if e[0] == "text") == r.text
        # the 4th request (queued behind 3) started before the 1st (40 tokens) finished
        assert jobs[3][0].started < jobs[0][1].items[-1][0]
        m = pool.metrics
        assert m.value("specrt_batch_size_bucket", le="3.0") - m.value("specrt_batch_size_bucket", le="2.0") > 0  # iterations with 3 rows
        assert pool.steps["batched"] == 0 and pool.busy == 0 and pool.queued == 0
    finally:
        pool.close()


def test_batched_steps_diverge_only_at_near_ties(int4):
    """policy batched: rows make one token per batched step; greedy outputs equal the
    requests alone except where the target's top-2 margin is within the kernels' rounding."""
    pool = BatchPool(int4, 4, policy="batched", costs=flat_costs(4))
    try:
        cfg = dict(max_new_tokens=32, k_max=3)
        # queued in one call: one at a time, a loaded machine let the first run alone for a while
        jobs = submit_together(pool, int4, PROMPTS[:4], [cfg] * 4)
        got = {i: ev.result().tokens for i, (_, ev) in enumerate(jobs)}
        # every row that takes a batched step is ready for the next one (its KV length
        # advanced with its token): after admission, iterations stay batched
        assert pool.steps["batched"] >= 24 and pool.steps["speculate"] <= 3, pool.steps
        ids = [int4.prompt_ids(p) for p in PROMPTS[:4]]
        base = {i: int4.generate(p, GenerationConfig(**cfg)).tokens for i, p in enumerate(PROMPTS[:4])}
        divs = divergences(int4, ids, base, got)
        assert len(divs) < 4
        for d in divs:
            assert d["target_top2_margin"] < 0.1, d
        assert pool.metrics.value("specrt_batch_size_count") > 0 and pool.metrics.value("specrt_tokens_per_forward_pass_count") > 0
    finally:
        pool.close()


def test_cancellation_frees_the_slot_at_once(int4):
    pool = BatchPool(int4, 1, policy="auto", round_delay=0.05, costs=flat_costs(1))
    try:
        a, ea = submit(pool, int4, "def f(", stream=True, max_new_tokens=200)
        b, eb = submit(pool, int4, "x", max_new_tokens=5)
        while not ea.items:
            time.sleep(0.01)
        assert pool.busy == 1 and pool.queued == 1
        t0 = time.perf_counter()
        a.cancelled.set()
        assert ea.done.wait(5) and ea.items[-1][1] == ("cancelled", None)
        r = eb.result()
        assert b.started - t0 < 1.0  # within an iteration, not after a's 200 tokens
        assert len(r.tokens) == 5 and pool.busy == 0
    finally:
        pool.close()


def test_tokens_in_flight_limit_keeps_first_come_first_served(int4):
    pool = BatchPool(int4, 4, policy="speculate", max_tokens=60, costs=flat_costs(4))
    try:
        a, ea = submit(pool, int4, "def f(", max_new_tokens=40)
        b, eb = submit(pool, int4, "x", max_new_tokens=40)  # 40 + 40 + prompts > 60: waits for a
        ra, rb = ea.result(), eb.result()
        assert b.started >= ea.items[-1][0] and len(ra.tokens) == len(rb.tokens) == 40
    finally:
        pool.close()


def test_stop_strings_and_eos_under_batching(int4):
    pool = BatchPool(int4, 2, policy="speculate", costs=flat_costs(2))
    try:
        alone = int4.generate("def add(a, b):", GenerationConfig(max_new_tokens=30))
        stop = alone.text[5:8] if len(alone.text) > 8 else None
        if stop:
            _, ev = submit(pool, int4, "def add(a, b):", stream=True, max_new_tokens=30, stop=[stop])
            want = int4.generate("def add(a, b):", GenerationConfig(max_new_tokens=30, stop=[stop]))
            r = ev.result()
            assert r.text == want.text and r.finish_reason == want.finish_reason == "stop" and r.tokens == want.tokens
    finally:
        pool.close()


# ---- specrt serve --max-batch (a real server process) ------------------------------------------
def test_serve_max_batch_concurrent_clients_metrics_and_disconnect(int4_pair, int4):
    """8 concurrent clients through 4 slots (policy speculate: exact) equal the requests
    alone; /metrics has the batching histograms; a disconnected stream frees its slot."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import concurrent.futures as cf
    import socket

    from test_server import HOST, Server, post, post_stream, read_metrics, stream_text

    srv = Server(int4_pair[2], "--max-batch", "4", "--batch-policy", "speculate", "--max-queue", "16", "--round-delay", "0.01")
    try:
        bodies = [dict(prompt=p, max_tokens=20 + 3 * i, temperature=0) for i, p in enumerate(PROMPTS + PROMPTS[:2])]
        with cf.ThreadPoolExecutor(8) as ex:
            futs = [ex.submit(post_stream if i % 2 else post, srv.port, b) for i, b in enumerate(bodies)]
            outs = [f.result() for f in futs]
        for i, (b, o) in enumerate(zip(bodies, outs)):
            want = int4.generate(b["prompt"], GenerationConfig(max_new_tokens=b["max_tokens"])).text
            assert o[0] == 200
            assert (stream_text(o[1]) if i % 2 else o[1]["choices"][0]["text"]) == want
        m = read_metrics(srv.port)
        assert m["specrt_batch_size_count"] > 0 and m['specrt_batch_size_bucket{le="4.0"}'] == m["specrt_batch_size_count"]
        assert m["specrt_batch_size_sum"] / m["specrt_batch_size_count"] > 1.0  # rows really shared iterations
        assert m["specrt_tokens_per_forward_pass_count"] > 0 and m["specrt_workers"] == 4
        # a client that goes away frees its slot before its 300 tokens are made
        sock = socket.create_connection((HOST, srv.port), timeout=30)
        data = json.dumps(dict(prompt="def f(", max_tokens=300, temperature=0, stream=True)).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        head = b""
        while b"data: {" not in head:
            head += sock.recv(4096)
        sock.close()
        deadline = time.time() + 60  # a condition, not a measurement: a loaded machine may take long
        while read_metrics(srv.port)["specrt_workers_busy"] != 0:
            assert time.time() < deadline, "the slot was not freed"
            time.sleep(0.05)
        assert read_metrics(srv.port)['specrt_requests_total{outcome="cancelled"}'] >= 1
    finally:
        srv.stop()


def test_auto_policy_turns_speculation_off_when_batched_steps_are_cheaper(int4):
    """The load-aware rule on the measured costs: cheap batched steps -> rows share batched
    steps (and one row alone still speculates); dear ones -> every iteration speculates."""
    for step_s, want_batched in ((1e-6, True), (10.0, False)):
        pool = BatchPool(int4, 4, policy="auto", costs=flat_costs(4, step_s))
        try:
            jobs = [submit(pool, int4, p, max_new_tokens=24) for p in PROMPTS[:4]]
            for _, ev in jobs:
                assert len(ev.result().tokens) == 24
            assert (pool.steps["batched"] > 0) == want_batched, pool.steps
            assert pool.steps["speculate"] > 0  # the first iterations measure the rounds
        finally:
            pool.close()
    pool = BatchPool(int4, 4, policy="auto", costs=flat_costs(4, 1e-6))
    try:
        _, ev = submit(pool, int4, "def f(", max_new_tokens=24)
        assert ev.result().tokens == int4.generate("def f(", GenerationConfig(max_new_tokens=24)).tokens
        assert pool.steps["batched"] == 0
    finally:
        pool.close()


def test_tune_records_batch_costs_and_the_pool_starts_from_them(int4, tiny_pair):
    import copy
    from dataclasses import replace

    from specrt.runtime.lab.tune import batch_step_costs
    from specrt.runtime.serve.batching import recorded_costs

    rec = batch_step_costs(int4, 3, past=20, reps=2)
    assert rec.pop("backend") == "ort-cpu" and set(rec) == {"1", "2", "3"} and min(rec.values()) > 0
    assert batch_step_costs(Engine(tiny_pair[2]), 3, past=20) is None  # standard graphs: no batched model
    eng = copy.copy(int4)
    eng.manifest = replace(int4.manifest, extra={**int4.manifest.extra, "tune": {"batch_step_costs": rec, "machine": this_machine().to_json()}})
    assert recorded_costs(eng.manifest, 4) is None  # does not cover size 4
    assert recorded_costs(eng.manifest, 3, "kernels") is None  # measured on another backend
    pool = BatchPool(eng, 3, policy="auto")
    try:
        assert pool.costs.as_dict() == {n: round(s, 6) for n, s in rec.items()}
    finally:
        pool.close()


# ---- main's Job contract under BatchPool: echo, prompt-only jobs, logprobs, submit_all ------------
def test_pool_logprobs_echo_and_prompt_only_jobs_follow_the_job_contract(int4):
    """policy speculate: a row's logprobs equal Engine.generate's and stream with the pieces
    (Job.lp_sent); echo scores the prompt first (Engine.prompt_logprobs); a prompt-only job
    (generate False) ends without a slot; submit_all queues all or none."""
    from specrt.runtime.serve.jobs import ServerBusy

    pool = BatchPool(int4, 2, policy="speculate", max_queue=3, costs=flat_costs(2))
    try:
        p = PROMPTS[0]
        cfg = dict(max_new_tokens=16, k_max=3, logprobs=2)
        alone = int4.generate(p, GenerationConfig(**cfg))
        ev = Events()
        job = Job(ids=int4.prompt_ids(p), config=int4.resolve(GenerationConfig(**cfg)), emit=ev, stream=True, echo=True, prompt_logprobs=1)
        ev2 = Events()
        job2 = Job(ids=int4.prompt_ids(p), config=int4.resolve(GenerationConfig(max_new_tokens=1)), emit=ev2, echo=True, prompt_logprobs=0, generate=False)
        pool.submit_all([job, job2])
        r = ev.result()
        assert r.tokens == alone.tokens and r.text == alone.text and r.logprobs == alone.logprobs
        kinds = [e[0] for _, e in ev.items]
        assert kinds[0] == "prompt" and kinds[-1] == "done"
        assert ev.items[0][1][1] == job.prompt_lps == int4.prompt_logprobs(p, 1)
        streamed = [x for _, e in ev.items if e[0] == "text" for x in e[1][1]]
        assert streamed == r.logprobs[: job.lp_sent] and "".join(e[1][0] for _, e in ev.items if e[0] == "text") == r.text
        assert job.started <= job.first <= job.finished
        r2 = ev2.result()
        assert r2.tokens == [] and job2.prompt_lps == int4.prompt_logprobs(p, 0) and [e[0] for _, e in ev2.items] == ["done"]
        jobs = [Job(ids=[1], config=job2.config, emit=Events()) for _ in range(4)]
        with pytest.raises(ServerBusy):
            pool.submit_all(jobs)  # 4 > max_queue 3: none is queued
        assert pool.queued == 0
    finally:
        pool.close()


def test_pool_logprobs_under_batched_steps(int4):
    """policy batched: each row's token and logprob come from its row of the batched call;
    one entry per token, the streamed entries are the result's."""
    pool = BatchPool(int4, 3, policy="batched", costs=flat_costs(3))
    try:
        jobs = [submit(pool, int4, p, stream=True, max_new_tokens=20, logprobs=1) for p in PROMPTS[:3]]
        for job, ev in jobs:
            r = ev.result()
            assert len(r.logprobs) == len(r.tokens) and [e.token for e in r.logprobs] == r.tokens
            assert all(e.logprob <= 0 and len(e.top) == 1 for e in r.logprobs)
            streamed = [x for _, e in ev.items if e[0] == "text" for x in e[1][1]]
            assert streamed == r.logprobs[: job.lp_sent]
        assert pool.steps["batched"] > 0
    finally:
        pool.close()


def test_serve_max_batch_chat_logprobs_and_metrics_equal_a_worker_server(int4_pair, tmp_path):
    """--max-batch 3 --batch-policy speculate answers chat completions, logprobs (streamed
    too), echo with prompt logprobs, n and best_of exactly as a worker server does; /metrics
    has the batching series (prometheus_client, model_name label)."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from helpers import TINY_CHAT_TEMPLATE
    from serving import Server, get, post, post_stream, read_metrics

    tpl = tmp_path / "chat.jinja"
    tpl.write_text(TINY_CHAT_TEMPLATE)
    common = ("--chat-template", str(tpl), "--model-name", "tiny4", "--max-queue", "16")
    bodies = [
        ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)),
        ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x"}], max_tokens=10, temperature=0.8, seed=5, n=2)),
        ("/v1/completions", dict(prompt="for i in range(10):\n", max_tokens=10, temperature=0, logprobs=3)),
        ("/v1/completions", dict(prompt="import os\n", max_tokens=6, temperature=0, logprobs=1, echo=True)),
        ("/v1/completions", dict(prompt="import os\n", max_tokens=0, logprobs=2, echo=True)),
        ("/v1/completions", dict(prompt="while True:", max_tokens=8, temperature=0.9, seed=3, best_of=3, n=2)),
    ]
    stream_body = dict(prompt="class Foo:\n", max_tokens=12, temperature=0, logprobs=2, stream_options={"include_usage": True})

    def answers(srv):
        out = []
        for path, b in bodies:
            status, body, _ = post(srv.port, b, path=path)
            assert status == 200, body
            out.append(body["choices"])
        status, events, done = post_stream(srv.port, stream_body)
        assert status == 200 and done
        out.append([e["choices"] for e in events if e.get("choices")])
        return out

    ref = Server(int4_pair[2], "--workers", "1", *common)
    try:
        want = answers(ref)
    finally:
        ref.stop()
    srv = Server(int4_pair[2], "--max-batch", "3", "--batch-policy", "speculate", *common)
    try:
        got = answers(srv)
        for (path, b), g, w in zip(bodies + [("stream", stream_body)], got, want):
            assert g == w, (path, b)
        assert got[0][0]["message"]["content"] and got[0][0]["logprobs"]["content"]
        m = read_metrics(srv.port)
        assert m["specrt_batch_size_count"] > 0 and m["specrt_batch_queue_depth_count"] > 0
        assert m["specrt_tokens_per_forward_pass_count"] > 0 and m['specrt_batch_iterations_total{mode="speculate"}'] > 0
        assert m['specrt_batch_iterations_total{mode="batched"}'] == 0 and m['specrt_batch_step_seconds{n="3"}'] > 0
        assert m["specrt_workers"] == 3 and m["specrt_queue_capacity"] == 16 and m["specrt_workers_busy"] == 0
        assert m['specrt_requests_total{outcome="ok"}'] == len(bodies) + 1 and m["specrt_time_to_first_token_seconds_count"] > 0
        text = get(srv.port, "/metrics")[1]
        for name in ("specrt_batch_size_bucket", "specrt_batch_iterations_total", "specrt_batch_step_seconds", "specrt_tokens_per_forward_pass_sum"):
            assert any(line.startswith(name + "{") and 'model_name="tiny4"' in line for line in text.splitlines()), name
    finally:
        srv.stop()


def test_constrained_rows_under_batching(int4):
    """Constraints in the batch scheduler (one Generation per row, its own matcher): under
    policy speculate every row equals its request alone; under batched steps every output
    still matches its constraint (a row with forced tokens not yet in its KV takes its own
    round: the catch-up), and forced tokens are counted."""
    import re

    from specrt.runtime.constraints import Constraint

    regex = r"[a-f]{2,6}\((x|y), [0-9]{1,3}\)"
    cons = [
        Constraint.regex(regex),
        Constraint.choice(["import os", "import sys", "pass"]),
        Constraint.regex(regex),
        Constraint.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}),
    ]
    for policy in ("speculate", "batched"):
        pool = BatchPool(int4, 4, policy=policy, costs=flat_costs(4))
        try:
            cfgs = [dict(max_new_tokens=24, k_max=3, constraint=c) for c in cons]
            # queued at once, so they are admitted together: rows whose next token is forced
            # are not ready for a batched step, and these rows are short, so rows arriving one
            # by one (measured: 10 ms apart) can finish without ever sharing a step
            jobs = submit_together(pool, int4, PROMPTS, cfgs)
            results = [ev.result() for _, ev in jobs]
            assert (pool.steps["batched"] > 0) == (policy == "batched"), pool.steps
        finally:
            pool.close()
        for p, c, r in zip(PROMPTS, cfgs, results):
            if policy == "speculate":
                alone = int4.generate(p, GenerationConfig(**c))
                assert r.tokens == alone.tokens and r.finish_reason == alone.finish_reason
            if r.finish_reason == "stop":
                con = c["constraint"]
                if con.kind == "regex":
                    assert re.fullmatch(regex, r.text), r.text
                elif con.kind == "choice":
                    assert r.text in ("import os", "import sys", "pass")
                else:
                    assert isinstance(json.loads(r.text)["n"], int)
            assert r.stats.forced > 0


def test_auto_on_an_exact_batch_follows_measured_iterations():
    """On an exact batched model (specrt's kernels) auto compares whole iterations: each mode
    twice first (the first of each replaced by the second), then the faster, the other one
    at the exploration period scaled by the ratio; a row count above one where batched
    steps won starts batched; one row always speculates; the fixed policies never switch."""
    from specrt.runtime.serve.joint import ModeChooser, packed

    ch = ModeChooser("auto", explore_every=4)

    def run(n, iters, tok_s):
        seen = []
        for _ in range(iters):
            m = ch.choose(n)
            seen.append(m)
            ch.observe(m, n, tok_s[m], 1.0)
        return seen

    assert run(1, 3, {"speculate": 5, "batched": 50}) == ["speculate"] * 3
    got = run(2, 24, {"speculate": 10, "batched": 20})
    assert got[:4] == ["speculate", "speculate", "batched", "batched"] and ch.best(2) == "batched"
    assert 1 <= got[4:].count("speculate") <= 3  # explored every 4 x 2 = 8 iterations
    assert ch.tps[2]["speculate"][0] == 10 and ch.tps[2]["batched"][0] == 20
    ch.since_explore = 0
    got = run(3, 6, {"speculate": 10, "batched": 30})
    assert got == ["batched"] * 6  # batched won at 2 rows: no speculative trial at once
    ch.observe("speculate", 5, 99, 0.0)  # a zero-length iteration is ignored
    assert "speculate" not in ch.tps.get(5, {})
    for fixed in ("speculate", "batched"):
        assert {ModeChooser(fixed).choose(4) for _ in range(10)} == {fixed}
    # calls are split past max_rows, an item never
    work = [(None, [1] * 3), (None, [1] * 2), (None, [1] * 6), (None, [1])]
    assert [[len(w[1]) for w in p] for p in packed(work, 5)] == [[3, 2], [6], [1]]


def test_joint_round_hands_each_row_its_own_rows():
    """joint_round (one call an iteration on an exact batch): rows of several generations in
    one call, in order; a plain row gets its one row; a speculating row gets its
    verification rows (from its pending token's row, after the catch-up rows its call
    starts with); calls split past max_rows; a row whose draft raises ends alone."""
    from types import SimpleNamespace

    from specrt.runtime.serve.joint import joint_round

    class Batch:
        max_rows, calls = 6, []
        slots = [object()] * 4

        def rows(self, slots, toks, pos):
            self.calls.append((list(slots), list(toks), list(pos)))
            return np.array([[float(t)] for t in toks])  # a row's "logits": its token

    class Gen:
        def __init__(self, seq, kv, call=None, boom=False):
            self.seq, self.kv, self.call, self.boom, self.got = list(seq), SimpleNamespace(target=kv), call, boom, None

        def draft_step(self, target):
            if self.boom:
                raise ValueError("draft failed")
            return self.call

        def verify_step(self, rows, seconds):
            self.got = [int(r[0]) for r in rows]
            self.seq.append(0)
            return ""

        def push_row(self, row, seconds, exact):
            self.got, self.exact = [int(row[0])], exact
            self.seq.append(0)
            return ""

    plain = SimpleNamespace(gen=Gen([1, 2, 7], 2), slot=0)
    spec = SimpleNamespace(gen=Gen([5, 6, 40, 41, 42], 2, call=([40, 41, 42, 90, 91], 2, 2)), slot=1)  # 2 catch-up rows
    wide = SimpleNamespace(gen=Gen([8, 50], 1, call=([50, 60, 61], 1, 0)), slot=2)
    bad = SimpleNamespace(gen=Gen([9], 0, boom=True), slot=3)
    failed, rounds, steps = [], [], []
    b = Batch()
    calls, tokens = joint_round(
        b,
        [plain, spec, wide, bad],
        [plain],
        lambda r, call: call(),
        lambda r, e: failed.append(r),
        lambda r, t, s: rounds.append(r),
        lambda n, s: steps.append(n),
    )
    assert plain.gen.got == [7] and plain.gen.exact is True
    assert spec.gen.got == [42, 90, 91]  # its verification rows: pending token and candidates, not the catch-up rows
    assert wide.gen.got == [50, 60, 61]
    assert failed == [bad] and rounds == [spec, wide] and steps == []
    assert calls == 2 and tokens == 3  # 1 + 5 rows fill max_rows 6; the next row in a call of its own
    assert b.calls[0] == ([0, 1, 1, 1, 1, 1], [7, 40, 41, 42, 90, 91], [2, 2, 3, 4, 5, 6]) and b.calls[1][0] == [2, 2, 2]
