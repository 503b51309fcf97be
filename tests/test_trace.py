"""Replayable traces (runtime/trace.py): round trip, tracing changes nothing, offline replay
equals actually running the policy, bad inputs."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from specrt import Engine, GenerationConfig
from specrt.cli import cli
from specrt.runtime.errors import InputError
from specrt.runtime.lab.replay import check_replayable, position_views, replay
from specrt.runtime.lab.trace import Costs, TraceWriter, load_trace, manifest_identity

PROMPTS = ["def add(a, b):", "for i in range(10):\n", "x", "class Foo:\n    def __init__(self, x):\n        self.x = x\n" * 2, "import os\n"]
N = 40


@pytest.fixture(scope="module")
def engine(noisy_pair):
    return Engine(noisy_pair[1])


def record(engine, path, cfg, prompts=PROMPTS):
    with TraceWriter(path, engine, note="test") as tw:
        return [engine.generate(p, cfg, trace=tw) for p in prompts]


@pytest.fixture(scope="module")
def wide(engine, tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "wide.jsonl"
    record(engine, path, GenerationConfig(max_new_tokens=N, k_max=engine.manifest.k_max, threshold=0.0))
    return path


def real_run(engine, cfg, prompts=PROMPTS):
    tot = dict(hist=[0] * (cfg.k_max + 1), passes=0, proposed=0, accepted=0, draft_calls=0, tokens=0)
    for p in prompts:
        s = engine.generate(p, cfg).stats
        tot["hist"] = [a + b for a, b in zip(tot["hist"], s.accepted_hist)]
        for key in ("passes", "proposed", "accepted", "draft_calls"):
            tot[key] += getattr(s, key)
        tot["tokens"] += s.new_tokens
    return tot


def test_round_trip(engine, tmp_path):
    path = tmp_path / "t.jsonl"
    cfg = GenerationConfig(max_new_tokens=N, k_max=3, threshold=0.0)
    results = record(engine, path, cfg, PROMPTS[:3])
    tr = load_trace(path)
    assert tr.header["kind"] == "specrt-trace" and tr.header["version"] == 1
    assert tr.header["manifest"]["pair_sha256"] == manifest_identity(engine.manifest)["pair_sha256"]
    assert tr.header["manifest"]["k_max"] == 8 and tr.header["costs"] is None
    assert len(tr.gens) == 3
    for g, res in zip(tr.gens, results):
        s = res.stats
        assert g.tokens == res.tokens
        assert g.finish == res.finish_reason and g.new_tokens == len(res.tokens)
        assert g.settings["k_max"] == 3 and g.settings["threshold"] == 0.0 and g.settings["confidence_temperature"] == 1.0
        assert g.prompt_tokens == s.prompt_tokens
        assert len(g.rounds) == s.passes
        hist = [0] * 4
        for r in g.rounds:
            hist[r.m] += 1
            assert r.q == r.n + 1 and 0 <= r.m <= r.n <= len(r.draft)
            assert all(0.0 < c <= 1.0 for _, c in r.draft)
        assert hist == s.accepted_hist
        assert sum(r.n for r in g.rounds) == s.proposed
        assert sum(r.draft_calls for r in g.rounds) == s.draft_calls
        assert sum(r.draft_s for r in g.rounds) == pytest.approx(s.draft_seconds, abs=1e-9)
        assert sum(r.target_s for r in g.rounds) == pytest.approx(s.target_seconds, abs=1e-9)
        pos = 1
        for r in g.rounds:  # rounds tile the output
            assert r.pos == pos
            pos += len(r.commit)
    # every line is one JSON object; header first
    lines = path.read_text().splitlines()
    assert json.loads(lines[0])["kind"] == "specrt-trace"
    assert {json.loads(x)["rec"] for x in lines[1:]} <= {"gen", "round", "tail", "end"}


def test_tracing_changes_nothing(engine, tmp_path):
    for cfg in (GenerationConfig(max_new_tokens=N, k_max=4, threshold=0.1), GenerationConfig(max_new_tokens=N, k_max=4, temperature=0.8, seed=3)):
        with TraceWriter(tmp_path / "x.jsonl", engine) as tw:
            a = engine.generate(PROMPTS[0], cfg, trace=tw)
        b = engine.generate(PROMPTS[0], cfg)
        assert a.tokens == b.tokens
        for key in ("passes", "proposed", "accepted", "draft_calls", "accepted_hist"):
            assert getattr(a.stats, key) == getattr(b.stats, key), key


def test_stream_closed_early_is_written_as_closed(engine, tmp_path):
    path = tmp_path / "s.jsonl"
    with TraceWriter(path, engine) as tw:
        st = engine.stream(PROMPTS[1], GenerationConfig(max_new_tokens=N, k_max=2), trace=tw)
        next(iter(st))
        st.close()
        engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=8, k_max=2), trace=tw)
    tr = load_trace(path)
    assert [g.finish for g in tr.gens] == ["closed", tr.gens[1].finish] and tr.gens[1].finish in ("stop", "length")


def test_wide_trace_knows_every_position(wide):
    views = position_views(load_trace(wide))
    assert len(views) == len(PROMPTS)
    for v in views:
        assert v.known_share == 1.0  # tail + pre records cover every on-trajectory position


def _thresholds(views):
    conf = np.concatenate([v.on_conf[v.on_tok >= 0] for v in views])
    return [0.0] + [round(float(x), 4) for x in np.quantile(conf, [0.25, 0.5, 0.75])]


def test_replay_equals_real_run(engine, wide):
    """Accepted-length histograms, passes and accepted counts equal the real run for every
    policy; proposals and draft calls too, except where the replay says it approximated a
    draft step after a rejection (threshold > 0 only, docstring of replay)."""
    views = position_views(load_trace(wide))
    exact_calls = 0
    for k in (1, 2, 3, 5, 8):
        for th in _thresholds(views):
            cfg = GenerationConfig(max_new_tokens=N, k_max=k, threshold=th)
            want = real_run(engine, cfg)
            got = replay(views, k, th)
            assert got.accepted_hist == want["hist"], (k, th)
            assert (got.passes, got.accepted, got.new_tokens) == (want["passes"], want["accepted"], want["tokens"]), (k, th)
            assert got.approximated["unknown_position"] == 0
            if got.approximated["missing_continuation"] == 0:
                assert (got.proposed, got.draft_calls) == (want["proposed"], want["draft_calls"]), (k, th)
                exact_calls += 1
            else:
                assert th > 0
    assert exact_calls >= 15
    # the other verification strategies accept exactly the same candidates
    from specrt.runtime.config import STRATEGIES

    th = _thresholds(views)[2]
    for strategy in STRATEGIES:
        for k in (3, 8):
            want = real_run(engine, GenerationConfig(max_new_tokens=N, k_max=k, threshold=th, strategy=strategy))
            got = replay(views, k, th)
            assert got.accepted_hist == want["hist"] and got.passes == want["passes"], (strategy, k)


def test_replay_with_calibrated_confidence(engine, tmp_path):
    """A trace recorded at confidence temperature T replays thresholds read at T."""
    path = tmp_path / "t05.jsonl"
    record(engine, path, GenerationConfig(max_new_tokens=N, k_max=8, threshold=0.0, confidence_temperature=0.5))
    tr = load_trace(path)
    assert tr.gens[0].settings["confidence_temperature"] == 0.5
    views = position_views(tr)
    for th in _thresholds(views)[1:]:
        want = real_run(engine, GenerationConfig(max_new_tokens=N, k_max=3, threshold=th, confidence_temperature=0.5))
        got = replay(views, 3, th)
        assert got.accepted_hist == want["hist"] and got.passes == want["passes"]


def test_replay_cost_model():
    costs = Costs(0.001, {1: 0.004, 2: 0.005, 4: 0.007})
    assert costs.target(3) == pytest.approx(0.006)
    assert costs.target(9) == pytest.approx(0.004 + 8 * 0.001)
    assert Costs.from_json(costs.to_json()) == costs
    with pytest.raises(InputError, match="at least two widths"):
        Costs(0.001, {1: 0.004}).target(3)
    with pytest.raises(InputError, match="positive finite"):
        Costs.from_json({"draft_s_per_call": -1, "target_s_by_q": {"1": 0.1}})
    with pytest.raises(InputError, match="malformed costs"):
        Costs.from_json({"target_s_by_q": {"1": 0.1}})


def test_replay_predicts_time(wide):
    views = position_views(load_trace(wide))
    costs = Costs(0.001, {q: 0.004 + 0.0005 * (q - 1) for q in range(1, 10)})
    r = replay(views, 2, 0.0, costs)
    tokens = sum(len(v.out) for v in views)
    prefill = sum(v.prefill_s for v in views)
    want = prefill + r.draft_calls * 0.001 + sum(c * (0.004 + 0.0005 * (q - 1)) for q, c in enumerate(r.q_hist) if c)
    assert r.seconds == pytest.approx(want)
    assert r.baseline_seconds == pytest.approx(prefill + sum(len(v.out) - 1 for v in views) * 0.004)
    assert r.tokens_per_second == pytest.approx(tokens / want)
    assert replay(views, 2, 0.0).seconds is None


# ---- bad inputs ---------------------------------------------------------------------------------
def test_missing_and_malformed_trace(tmp_path, wide):
    with pytest.raises(InputError, match="does not exist"):
        load_trace(tmp_path / "nope.jsonl")
    lines = wide.read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(lines[0] + "\n{not json\n")
    with pytest.raises(InputError, match=r"bad.jsonl:2: not valid JSON"):
        load_trace(bad)
    bad.write_text('{"kind": "other"}\n')
    with pytest.raises(InputError, match="bad.jsonl:1: not a trace header"):
        load_trace(bad)
    rec = json.loads(next(x for x in lines if '"rec": "round"' in x))
    del rec["m"]
    bad.write_text("\n".join([lines[0], lines[1], json.dumps(rec)]) + "\n")
    with pytest.raises(InputError, match=r"bad.jsonl:3: field 'm' is None; expected int"):
        load_trace(bad)
    bad.write_text(lines[0] + "\n" + json.dumps(dict(rec="round", gen=7)) + "\n")
    with pytest.raises(InputError, match="no gen record before it"):
        load_trace(bad)
    bad.write_text(lines[0] + "\n")
    with pytest.raises(InputError, match="has no generation"):
        load_trace(bad)
    bad.write_text("")
    with pytest.raises(InputError, match="empty trace"):
        load_trace(bad)


def test_replay_refuses_what_it_cannot_predict(engine, tmp_path, wide):
    views = position_views(load_trace(wide))
    with pytest.raises(InputError, match="k_max=0; k_max must be an integer >= 1"):
        replay(views, 0, 0.0)
    with pytest.raises(InputError, match=r"threshold=1.5; threshold must be a number in \[0, 1\]"):
        replay(views, 2, 1.5)
    path = tmp_path / "narrow.jsonl"
    record(engine, path, GenerationConfig(max_new_tokens=8, k_max=2, threshold=0.1), PROMPTS[:1])
    tr = load_trace(path)
    with pytest.raises(InputError, match="k_max=3; this trace was recorded with k_max <= 2"):
        check_replayable(tr, 3, 0.2)
    with pytest.raises(InputError, match="threshold=0.05; this trace was recorded with threshold >= 0.1"):
        check_replayable(tr, 2, 0.05)
    sampled = tmp_path / "sampled.jsonl"
    record(engine, sampled, GenerationConfig(max_new_tokens=8, k_max=2, temperature=0.7, seed=1), PROMPTS[:1])
    with pytest.raises(InputError, match="no greedy speculative generation"):
        position_views(load_trace(sampled))


# ---- CLI ------------------------------------------------------------------------------------------
def test_cli_generate_and_bench_trace(noisy_pair, tmp_path):
    folder = str(noisy_pair[1])
    r = CliRunner().invoke(
        cli,
        [
            "generate",
            "--engines",
            folder,
            "--prompt",
            "def f(x):",
            "--max-new-tokens",
            "12",
            "--k-max",
            "3",
            "--trace",
            str(tmp_path / "g.jsonl"),
            "--no-stats",
        ],
    )
    assert r.exit_code == 0, r.output
    tr = load_trace(tmp_path / "g.jsonl")
    assert len(tr.gens) == 1 and tr.gens[0].settings["k_max"] == 3 and tr.header["note"] == "specrt generate"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f(x):"}\n{"prompt": "import os"}\n')
    r = CliRunner().invoke(
        cli,
        [
            "bench",
            "--engines",
            folder,
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "8",
            "--k-max",
            "2",
            "--threshold",
            "0",
            "--trace",
            str(tmp_path / "b.jsonl"),
            "--no-fastest-baseline",
        ],
    )
    assert r.exit_code == 0, r.output
    tr = load_trace(tmp_path / "b.jsonl")
    assert len(tr.gens) == 2 * 2  # prompts x (target-only + one speculative config); warm-ups not recorded
    assert sorted(g.settings["speculative"] for g in tr.gens) == [False, False, True, True]
