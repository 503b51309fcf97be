"""Verification strategies (full | chunked | lazy-head), issue 6 part 1.

Oracles: the target alone (greedy: every strategy gives exactly specrt target-only's
tokens), the full strategy (sampled: with one seed the three give the same tokens),
PyTorch (parity of the lazy-head body and head graphs) and a hand count (FLOPs). Work
after a rejection is checked on ``Stats`` and on the recorded model calls: chunked runs
fewer target positions than full, lazy-head projects fewer head rows.
"""

from __future__ import annotations

import copy
import json
import math
import shutil

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import greedy_verify, speculative_verify  # noqa: F401  (the acceptance loop on explicit rows)

from specrt import Engine, GenerationConfig
from specrt.cli import cli
from specrt.runtime.errors import BackendError, EngineError, InputError
from specrt.runtime.flops import body_flops, call_flops, flop_coefficients
from specrt.runtime.manifest import ModelEntry, load_manifest
from specrt.runtime.sampling import accept_candidate, final_token
from specrt.runtime.speculative import chunk_passes, chunk_sizes, head_blocks

PROMPTS = ["def add(a, b):", "for i in range(10):\n", "x", "class Foo:\n    def __init__(self, x):\n        self.x = x\n" * 3]
STEPWISE = [("chunked", 0.3), ("chunked", 1.0), ("lazy-head", 0.3), ("lazy-head", 1.0)]


@pytest.fixture(scope="module")
def noisy(noisy_pair):
    """(target_dir, engine_dir, Engine) of the perturbed-copy pair (exported with lazy-head)."""
    target_dir, folder = noisy_pair
    return target_dir, folder, Engine(folder)


def _prompts(engine, seed):
    """The text prompts plus random id prompts of lengths 1, 2, 37 and 150."""
    rng = np.random.default_rng(seed)
    out = [engine.prompt_ids(p) for p in PROMPTS]
    out += [rng.integers(0, engine.manifest.vocab_size, size=n).tolist() for n in (1, 2, 37, 150)]
    return out


class CallLog:
    """Records the target's model calls of an Engine: ("target", q, start), ("body", q,
    start), ("head", lo, rows)."""

    def __init__(self, engine):
        self.calls = []
        self.engine = engine
        t = engine.target
        self._orig = t.run

        def run(tokens, start):
            self.calls.append(("target", len(tokens), start))
            return self._orig(tokens, start)

        t.run = run
        self.lazy = None

    def watch_lazy(self):
        lazy = self.engine.target.split_head()
        ob, oh = lazy.body, lazy.head

        def body(tokens, start):
            self.calls.append(("body", len(tokens), start))
            return ob(tokens, start)

        def head(lo, r):
            self.calls.append(("head", lo, r))
            return oh(lo, r)

        lazy.body, lazy.head = body, head
        self.lazy = (lazy, ob, oh)

    def close(self):
        del self.engine.target.run
        if self.lazy:
            lazy = self.lazy[0]
            del lazy.body, lazy.head

    def flops(self, c):
        """FLOPs of the recorded calls by :func:`call_flops`."""
        total = 0
        for kind, a, b in self.calls:
            if kind == "target":
                total += call_flops(c, a, b)
            elif kind == "body":
                total += body_flops(c, a, b)
            else:
                total += b * c.per_head_row
        return total


# ---- greedy: every strategy is the target's own output ------------------------------
@pytest.mark.parametrize("k_max", [1, 2, 4, 8])
@pytest.mark.parametrize("threshold", [0.0, 0.5, 0.9])
def test_every_strategy_equals_target_only_greedy(noisy, k_max, threshold):
    _, _, engine = noisy
    for ids in _prompts(engine, seed=k_max * 10 + int(threshold * 10)):
        base = engine.generate(ids, GenerationConfig(max_new_tokens=40, speculative=False))
        full = engine.generate(ids, GenerationConfig(max_new_tokens=40, k_max=k_max, threshold=threshold, strategy="full"))
        assert full.tokens == base.tokens
        for strategy, bound in STEPWISE:
            cfg = GenerationConfig(max_new_tokens=40, k_max=k_max, threshold=threshold, strategy=strategy, chunk_bound=bound)
            res = engine.generate(ids, cfg)
            assert res.tokens == base.tokens, (strategy, bound, len(ids))
            assert res.finish_reason == base.finish_reason
            s = res.stats
            # the same rounds as full, whatever the strategy: only the work differs
            assert (s.passes, s.proposed, s.accepted, s.accepted_hist) == (
                full.stats.passes,
                full.stats.proposed,
                full.stats.accepted,
                full.stats.accepted_hist,
            )
            assert s.target_positions <= full.stats.target_positions
            assert s.head_rows <= full.stats.head_rows
            assert s.target_flops <= full.stats.target_flops


@pytest.mark.parametrize("seed", [11, 12])
def test_other_random_pairs_and_budgets(self_pair, noisy, seed):
    """Draft = target (everything accepted) and the noisy pair, budgets 1..5, k 1 and 8."""
    for engine in (Engine(self_pair[1]), noisy[2]):
        rng = np.random.default_rng(seed)
        ids = rng.integers(0, engine.manifest.vocab_size, size=int(rng.integers(1, 60))).tolist()
        for n in (1, 2, 3, 5, 30):
            base = engine.generate(ids, GenerationConfig(max_new_tokens=n, speculative=False)).tokens
            for k in (1, 8):
                for strategy in ("full", "chunked", "lazy-head"):
                    for bound in (0.5, 1.0):
                        got = engine.generate(ids, GenerationConfig(max_new_tokens=n, k_max=k, strategy=strategy, chunk_bound=bound))
                        assert got.tokens == base, (strategy, k, n)


def test_context_edge(noisy):
    _, _, engine = noisy
    ids = [5] * (engine.manifest.max_ctx - 4)
    base = engine.generate(ids, GenerationConfig(max_new_tokens=10, speculative=False)).tokens
    for strategy in ("chunked", "lazy-head"):
        assert engine.generate(ids, GenerationConfig(max_new_tokens=10, k_max=8, strategy=strategy, chunk_bound=1.0)).tokens == base


# ---- sampling: one seed, the same tokens in every strategy ----------------------------
@pytest.mark.parametrize(
    "samp",
    [dict(temperature=0.9), dict(temperature=1.3, top_k=40), dict(temperature=0.7, top_p=0.9), dict(temperature=1.0, threshold=0.3)],
)
def test_sampled_tokens_identical_across_strategies(noisy, samp):
    _, _, engine = noisy
    ids = engine.prompt_ids(PROMPTS[0])
    rejections = 0
    for seed in range(6):
        for k in (2, 4, 8):
            want = engine.generate(ids, GenerationConfig(max_new_tokens=40, k_max=k, seed=seed, strategy="full", **samp))
            rejections += want.stats.proposed - want.stats.accepted
            for strategy, bound in STEPWISE:
                got = engine.generate(ids, GenerationConfig(max_new_tokens=40, k_max=k, seed=seed, strategy=strategy, chunk_bound=bound, **samp))
                assert got.tokens == want.tokens, (seed, k, strategy, bound)
                assert got.stats.accepted_hist == want.stats.accepted_hist
    assert rejections > 0  # the stepwise paths really stopped early


def test_target_only_sampling_ignores_the_strategy(noisy):
    _, _, engine = noisy
    cfg = dict(max_new_tokens=30, speculative=False, temperature=0.8, seed=4)
    want = engine.generate("def add(a, b):", GenerationConfig(**cfg)).tokens
    for strategy in ("chunked", "lazy-head"):
        assert engine.generate("def add(a, b):", GenerationConfig(strategy=strategy, **cfg)).tokens == want


# ---- saved work -----------------------------------------------------------------------
def test_chunked_and_lazy_head_save_target_work_on_rejections(noisy):
    _, _, engine = noisy
    totals = {}
    for strategy in ("full", "chunked", "lazy-head"):
        t = totals[strategy] = dict(positions=0, rows=0, flops=0, rejected=0, calls=0, head_calls=0)
        for ids in _prompts(engine, seed=3):
            s = engine.generate(ids, GenerationConfig(max_new_tokens=48, k_max=8, threshold=0.0, strategy=strategy, chunk_bound=0.5)).stats
            t["positions"] += s.target_positions
            t["rows"] += s.head_rows
            t["flops"] += s.target_flops
            t["rejected"] += s.passes - s.accepted_hist[-1]
            t["calls"] += s.target_calls
            t["head_calls"] += s.head_calls
    full, ch, lz = totals["full"], totals["chunked"], totals["lazy-head"]
    assert full["rejected"] > 0
    assert ch["positions"] < full["positions"] and ch["flops"] < full["flops"] and ch["rows"] == ch["positions"]
    assert ch["calls"] >= full["calls"]
    assert lz["positions"] == full["positions"]  # the body runs every position ...
    assert lz["rows"] < full["rows"] and lz["flops"] < full["flops"]  # ... the head does not
    assert full["head_calls"] == ch["head_calls"] == 0 < lz["head_calls"]


def test_stats_count_exactly_the_recorded_calls(noisy):
    _, _, engine = noisy
    c = flop_coefficients(engine.manifest.target)
    ids = engine.prompt_ids(PROMPTS[3])
    for strategy in ("full", "chunked", "lazy-head"):
        for sampled in (False, True):
            log = CallLog(engine)
            if strategy == "lazy-head":
                log.watch_lazy()
            try:
                cfg = GenerationConfig(max_new_tokens=40, k_max=6, strategy=strategy, chunk_bound=0.6, temperature=0.8 if sampled else 0.0, seed=1)
                s = engine.generate(ids, cfg).stats
            finally:
                log.close()
            assert s.target_flops + s.prefill_flops == log.flops(c)
            prefill = [x for x in log.calls if x[0] == "target" and x[2] < len(ids)]
            assert sum(q for _, q, _ in prefill) == len(ids) - s.cached_tokens  # a prefix-cache hit skips rows
            assert s.prefill_flops == sum(call_flops(c, q, start) for _, q, start in prefill)
            runs = [x for x in log.calls if x[0] in ("target", "body") and x not in prefill]
            assert s.target_calls == len(runs) and s.target_positions == sum(q for _, q, _ in runs)
            heads = [x for x in log.calls if x[0] == "head"]
            assert s.head_calls == len(heads)
            if strategy == "lazy-head":
                assert s.head_rows == sum(r for _, _, r in heads) + sum(q for kind, q, _ in runs if kind == "target")
            else:
                assert s.head_rows == s.target_positions
            if strategy == "full":
                assert s.target_calls == s.passes


def test_always_wrong_draft_bound_1_runs_one_short_pass_per_round(noisy):
    """A confident draft that is always wrong: full runs n + 1 positions per round, chunked
    with chunk_bound 1 only [pending, c_1] (the chunk ends at every candidate), lazy-head
    projects one head row; with chunk_bound 0.5 the confidence product (1.0) never falls to
    the bound, so chunked is one pass, as full."""
    _, _, engine = noisy
    prompt = engine.prompt_ids(PROMPTS[1])
    base = engine.generate(prompt, GenerationConfig(max_new_tokens=30, speculative=False)).tokens
    seq = prompt + base
    vocab = engine.manifest.vocab_size
    logits = np.zeros((256, engine.draft.vocab), np.float32)
    orig = engine.draft.run

    def wrong(tokens, start):
        orig(tokens, start)
        for i in range(len(tokens)):
            pos = start + i
            logits[i] = 0
            nxt = seq[pos + 1] if pos + 1 < len(seq) else 0
            logits[i, (nxt + 1) % vocab] = 50.0  # confident (probability 1.0), always wrong
        return logits[: len(tokens)]

    engine.draft.run = wrong
    try:
        got = {}
        for strategy, bound in (("full", 1.0), ("chunked", 1.0), ("chunked", 0.5), ("lazy-head", 1.0)):
            log = CallLog(engine)
            if strategy == "lazy-head":
                log.watch_lazy()
            try:
                res = engine.generate(prompt, GenerationConfig(max_new_tokens=30, k_max=4, strategy=strategy, chunk_bound=bound))
            finally:
                log.close()
            assert res.tokens == base
            assert res.stats.accepted == 0
            got[strategy, bound] = (res.stats, [x for x in log.calls if not (x[0] == "target" and x[2] < len(prompt))])
    finally:
        engine.draft.run = orig
    full_s, full_calls = got["full", 1.0]
    mq = engine.manifest.min_q()  # every target call is at least this wide (exactness by construction)
    ns = [4] * (full_s.passes - 4) + [3, 2, 1, 0]  # candidates per round: k_max, then the budget's end
    assert full_s.proposed == sum(ns) and full_s.passes == len(ns)
    full_q = [q for _, q, _ in full_calls]
    assert full_q == [max(n + 1, mq) for n in ns]
    ch_s, ch_calls = got["chunked", 1.0]
    assert [q for _, q, _ in ch_calls] == [max(min(2, n + 1), mq) for n in ns]  # [pending, c_1] only
    assert ch_s.target_positions == sum(max(min(2, n + 1), mq) for n in ns) < full_s.target_positions
    assert got["chunked", 0.5][0].target_positions == full_s.target_positions  # one chunk
    lz_s, lz_calls = got["lazy-head", 1.0]
    # one head row per round (row 0 rejects c_1; min_q rows when the exact width is wider),
    # two when n = 1 (the bonus row joins the last block); n = 0 rounds are one pass of the full target
    want_heads = [(0, max(mq, 1 if n > 1 else 2)) for n in ns if n > 0]
    assert lz_s.head_calls == len(want_heads)
    assert lz_s.head_rows == sum(r for _, r in want_heads) + max(1, mq) * ns.count(0)
    assert lz_s.target_positions == full_s.target_positions
    assert [(lo, r) for kind, lo, r in lz_calls if kind == "head"] == want_heads
    assert full_s.target_flops > lz_s.target_flops and full_s.target_flops > ch_s.target_flops
    c = flop_coefficients(engine.manifest.target)
    assert full_s.target_flops - lz_s.target_flops == (full_s.head_rows - lz_s.head_rows) * c.per_head_row


def test_strategies_mix_on_one_engine_and_share_the_kv_buffers(noisy):
    _, _, engine = noisy
    ids = engine.prompt_ids(PROMPTS[0])
    want = engine.generate(ids, GenerationConfig(max_new_tokens=40, speculative=False)).tokens
    for strategy in ("lazy-head", "full", "chunked", "lazy-head", "chunked", "full"):
        assert engine.generate(ids, GenerationConfig(max_new_tokens=40, k_max=4, strategy=strategy, chunk_bound=0.8)).tokens == want
    lazy, t = engine.target.split_head(), engine.target
    assert lazy.target is t and lazy._kv is t._kv
    lazy.body([1, 2, 3], 17)
    ptrs = lazy.output_pointers()
    assert ptrs["new_key_0"] == t.keys[0].ctypes.data + 17 * t.row_bytes
    assert ptrs["new_value_1"] == t.values[1].ctypes.data + 17 * t.row_bytes
    assert ptrs["hidden"] == lazy.hidden_states.ctypes.data
    # a fork: its own buffers (its own target KV), the same sessions, the same tokens
    fork = engine.fork()
    assert fork.generate(ids, GenerationConfig(max_new_tokens=40, k_max=4, strategy="lazy-head")).tokens == want
    fl = fork.target.split_head()
    assert fl is not lazy and fl.target is fork.target and fl.body_session is lazy.body_session
    assert fl.hidden_states.ctypes.data != lazy.hidden_states.ctypes.data


def test_lazy_head_sessions_load_on_first_use(noisy_pair):
    engine = Engine(noisy_pair[1])
    heads = engine.target._head_sessions
    assert engine.target._split is None and heads._sessions is None
    engine.generate("x", GenerationConfig(max_new_tokens=5, strategy="chunked"))
    assert heads._sessions is None
    engine.generate("x", GenerationConfig(max_new_tokens=5, strategy="lazy-head"))
    assert engine.target._split is not None and heads._sessions is not None
    assert engine.fork().target._head_sessions is heads  # forks share the loaded sessions


# ---- errors ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(strategy="fast"), "strategy='fast'; strategy must be one of full, chunked, lazy-head"),
        (dict(strategy="Full"), "strategy='Full'"),
        (dict(strategy=1), "strategy=1"),
        (dict(chunk_bound=0.0), "chunk_bound=0.0; chunk_bound must be a number in (0, 1]"),
        (dict(chunk_bound=-0.5), "chunk_bound=-0.5"),
        (dict(chunk_bound=1.5), "chunk_bound=1.5"),
        (dict(chunk_bound=math.nan), "chunk_bound=nan"),
        (dict(chunk_bound=True), "chunk_bound=True"),
        (dict(chunk_bound="0.5"), "chunk_bound='0.5'"),
    ],
)
def test_bad_strategy_values(noisy, kwargs, needle):
    _, _, engine = noisy
    with pytest.raises(InputError) as e:
        engine.generate("def f():", GenerationConfig(**kwargs))
    assert needle in str(e.value)


def test_manifest_defaults(noisy, tmp_path):
    _, folder, engine = noisy
    r = engine.resolve(GenerationConfig())
    assert (r.strategy, r.chunk_bound) == ("full", 0.5)
    dst = tmp_path / "e"
    shutil.copytree(folder, dst)
    m = json.loads((dst / "manifest.json").read_text())
    m["defaults"].update(strategy="chunked", chunk_bound=0.25)
    (dst / "manifest.json").write_text(json.dumps(m))
    r = Engine(dst).resolve(GenerationConfig())
    assert (r.strategy, r.chunk_bound) == ("chunked", 0.25)
    del m["defaults"]["strategy"], m["defaults"]["chunk_bound"]  # manifests written before issue 6
    (dst / "manifest.json").write_text(json.dumps(m))
    r = Engine(dst).resolve(GenerationConfig())
    assert (r.strategy, r.chunk_bound) == ("full", 0.5)
    m["defaults"]["strategy"] = "bogus"
    (dst / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(InputError, match="strategy='bogus'"):
        Engine(dst).generate("x")


def test_folder_without_lazy_head_gives_the_clear_error(tiny_pair):
    """tiny_pair is exported with lazy_head=False: the other strategies work, lazy-head is
    refused at the call (before anything runs) with what to re-run."""
    folder = tiny_pair[2]
    m = load_manifest(folder)
    assert "lazy_head" not in m.extra and not (folder / "target_body.onnx").exists()
    engine = Engine(folder)
    want = engine.generate("def f(", GenerationConfig(max_new_tokens=12, speculative=False)).tokens
    assert engine.generate("def f(", GenerationConfig(max_new_tokens=12, strategy="chunked")).tokens == want
    with pytest.raises(InputError) as e:
        engine.generate("def f(", GenerationConfig(strategy="lazy-head"))
    msg = str(e.value)
    assert "exported without the lazy-head target" in msg and "re-run `specrt export" in msg and str(folder) in msg
    res = CliRunner().invoke(cli, ["generate", "--engines", str(folder), "--prompt", "x", "--strategy", "lazy-head"])
    assert res.exit_code != 0 and "exported without the lazy-head target" in res.output and "Traceback" not in res.output


def test_missing_or_altered_lazy_head_file(noisy, tmp_path):
    _, folder, _ = noisy
    for name, change, needle in (
        ("target_head.onnx", "delete", "target_head.onnx is missing"),
        ("target_body.onnx", "delete", "target_body.onnx is missing"),
        ("target_body.onnx", "truncate", "(truncated or altered)"),
    ):
        dst = tmp_path / f"{name}_{change}"
        shutil.copytree(folder, dst)
        if change == "delete":
            (dst / name).unlink()
        else:
            b = (dst / name).read_bytes()
            (dst / name).write_bytes(b[: len(b) // 2])
        engine = Engine(dst)  # loads: the lazy-head files are optional until used
        engine.generate("x", GenerationConfig(max_new_tokens=5, strategy="chunked"))
        with pytest.raises(EngineError) as e:
            engine.generate("x", GenerationConfig(max_new_tokens=5, strategy="lazy-head"))
        assert needle in str(e.value) and "re-run `specrt export" in str(e.value)


def test_lazy_head_needs_a_backend_with_a_body_head_split(noisy):
    """lazy-head is a capability (SplitsHead), not a backend name: a target model without
    split_head() is refused with the reason, the other strategies still resolve."""
    _, _, engine = noisy

    class NoSplit:  # a Model without the optional capability
        max_q, max_ctx, vocab = engine.target.max_q, engine.target.max_ctx, engine.target.vocab
        run, fork, close = engine.target.run, engine.target.fork, engine.target.close

    other = copy.copy(engine)
    other.target, other.backend = NoSplit(), "ort-cuda"
    with pytest.raises(BackendError, match="'lazy-head' needs a backend with a body/head split; 'ort-cuda' has none") as e:
        other.resolve(GenerationConfig(strategy="lazy-head"))
    assert e.value.param == "strategy"
    assert other.resolve(GenerationConfig(strategy="chunked")).strategy == "chunked"


# ---- FLOPs formula ----------------------------------------------------------------------
def test_flops_formula_against_a_hand_count(noisy):
    """The noisy pair's target: Llama, hidden 64, 2 layers, 4 heads, 2 KV heads (head_dim
    16), MLP 128, vocab 320; counted layer by layer, matrix by matrix."""
    m = load_manifest(noisy[1])
    e = m.target
    assert (e.hidden, e.n_layers, e.n_heads, e.n_kv_heads, e.head_dim, e.vocab_size) == (64, 2, 4, 2, 16, 320)
    macs_layer = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 64 * 128 + 64 * 128 + 128 * 64  # q k v o gate up down
    assert e.matmul_params == 2 * macs_layer == 73728
    c = flop_coefficients(e)
    assert not c.estimated
    for q, past in ((1, 0), (3, 5), (9, 37)):
        hand = 0
        for _ in range(q):  # every new position of the call
            for _ in range(2):  # layers
                hand += 2 * macs_layer
                hand += 4 * (2 * 16 + 2 * 16) * (past + q)  # 4 heads: scores over past + q keys, then values
            hand += 2 * 64 * 320  # LM head
        assert call_flops(c, q, past) == hand
        assert call_flops(c, q, past, head_rows=0) == body_flops(c, q, past) == hand - q * 2 * 64 * 320
    assert call_flops(c, 3, 5) == 577536
    # a manifest written before matmul_params: estimated from params (embedding + head removed)
    old = ModelEntry(**{**e.__dict__, "matmul_params": 0})
    c_old = flop_coefficients(old)
    assert c_old.estimated and c_old.per_position == 2 * (e.params - 2 * 320 * 64)


# ---- pure functions -------------------------------------------------------------------
def test_chunk_sizes_rule():
    assert chunk_sizes([], 0.5) == []
    assert chunk_sizes([0.9, 0.8, 0.5, 0.9], 0.5) == [3, 1]  # 0.9, 0.72, 0.36 <= 0.5 ends it
    assert chunk_sizes([0.9, 0.8, 0.5, 0.9], 0.3) == [4]
    assert chunk_sizes([0.2, 0.2, 0.2], 0.5) == [1, 1, 1]
    assert chunk_sizes([1.0, 1.0, 1.0], 1.0) == [1, 1, 1]  # bound 1: one candidate per chunk
    assert chunk_sizes([1.0, 1.0, 1.0], 0.99) == [3]
    assert chunk_sizes([0.5, 0.9, 0.9], 0.5) == [1, 2]  # product restarts after a chunk
    rng = np.random.default_rng(0)
    for _ in range(200):
        confs = rng.random(int(rng.integers(0, 9))).tolist()
        sizes = chunk_sizes(confs, float(rng.uniform(0.01, 1.0)))
        assert sum(sizes) == len(confs) and all(s >= 1 for s in sizes)


def test_chunk_passes_and_head_blocks():
    assert chunk_passes([]) == [(0, 1)] == head_blocks([])
    assert chunk_passes([3, 1]) == [(0, 4), (4, 5)]
    assert head_blocks([3, 1]) == [(0, 3), (3, 5)]
    assert chunk_passes([1, 1, 1]) == [(0, 2), (2, 3), (3, 4)]
    assert head_blocks([1, 1, 1]) == [(0, 1), (1, 2), (2, 4)]
    for sizes in ([4], [2, 2], [1, 3, 1]):
        n = sum(sizes)
        for blocks in (chunk_passes(sizes), head_blocks(sizes)):
            assert blocks[0][0] == 0 and blocks[-1][1] == n + 1
            assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(blocks, blocks[1:] + [(n + 1, n + 2)]))


def test_stepwise_acceptance_consumes_random_numbers_like_speculative_verify():
    rng0 = np.random.default_rng(5)
    for _ in range(300):
        n, w = int(rng0.integers(0, 6)), 7
        q = rng0.dirichlet(np.ones(w), size=n)
        p = rng0.dirichlet(np.ones(w) * 0.5, size=n + 1)
        cands = [int(rng0.choice(w, p=q[i])) for i in range(n)]
        seed = int(rng0.integers(1 << 30))
        want = speculative_verify(cands, q, p, np.random.default_rng(seed))
        rng = np.random.default_rng(seed)
        got = None
        for i in range(n + 1):
            if i == n:
                got = (n, final_token(p[n], None, rng))
            elif not accept_candidate(cands[i], q[i], p[i], rng):
                got = (i, final_token(p[i], q[i], rng))
            if got:
                break
        assert got == want
        rng_a, rng_b = np.random.default_rng(seed), np.random.default_rng(seed)
        speculative_verify(cands, q, p, rng_a)
        for i in range(n + 1):
            if i == n:
                final_token(p[n], None, rng_b)
                break
            if not accept_candidate(cands[i], q[i], p[i], rng_b):
                final_token(p[i], q[i], rng_b)
                break
        assert rng_a.random() == rng_b.random()  # the same number of draws


# ---- export parity of the lazy-head graphs -------------------------------------------------
@pytest.mark.parametrize("past", [0, 37])
@pytest.mark.parametrize("q", [1, 5])
def test_lazy_head_graphs_match_full_pytorch_forward(noisy, past, q):
    """body + head through the runtime (KV filled by the full target graph, body rows
    written into the same buffers, head per row and as one block) equal a full PyTorch
    forward over past + q tokens (fp32, 1e-4); the manifest records the export's parity."""
    import torch
    from transformers import AutoModelForCausalLM

    target_dir, folder, _ = noisy
    m = load_manifest(folder)
    rec = m.extra["lazy_head"]
    assert rec["body"]["outputs"][0] == "hidden" and rec["head"] == {**rec["head"], "inputs": ["hidden"], "outputs": ["logits"]}
    assert max(rec["parity"].values()) < 1e-4
    assert set(rec["parity"]) >= {f"{k}_q{qq}_L{p}" for k in ("logits", "hidden", "head", "kv") for qq in (1, 9) for p in (0, 37)}
    engine = Engine(folder)
    hf = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    rng = np.random.default_rng(past * 10 + q)
    ids = rng.integers(0, m.vocab_size, size=past + q).tolist()
    with torch.no_grad():
        out = hf(torch.tensor([ids]), use_cache=True)
    ref = out.logits[0, past:].numpy()
    if past:
        engine.target.run(ids[:past], 0)
    lazy = engine.target.split_head()
    lazy.body(ids[past:], past)
    one_block = lazy.head(0, q).copy()
    per_row = np.stack([lazy.head(i, 1)[0].copy() for i in range(q)])
    assert np.abs(one_block - ref).max() < 1e-4
    assert np.abs(per_row - ref).max() < 1e-4
    # the body wrote the new KV rows into the target's buffers, as the full graph does
    cache = out.past_key_values
    for i in range(m.target.n_layers):
        k_ref = cache.layers[i].keys[0].transpose(0, 1).numpy()[past:]
        assert np.abs(engine.target.keys[i][0, past : past + q] - k_ref).max() < 1e-3


# ---- CLI and bench ------------------------------------------------------------------------
def test_cli_generate_and_bench_strategies(noisy, tmp_path):
    _, folder, _ = noisy
    r = CliRunner()
    texts = []
    for strategy in ("full", "chunked", "lazy-head"):
        res = r.invoke(
            cli,
            [
                "generate",
                "--engines",
                str(folder),
                "--prompt",
                "def add(a, b):",
                "--max-new-tokens",
                "24",
                "--strategy",
                strategy,
                "--chunk-bound",
                "0.7",
                "--no-stats",
            ],
        )
        assert res.exit_code == 0, res.output
        texts.append(res.output)
    assert texts[0] == texts[1] == texts[2]
    res = r.invoke(cli, ["generate", "--engines", str(folder), "--prompt", "x", "--strategy", "lazy"])
    assert res.exit_code != 0 and "lazy" in res.output
    res = r.invoke(cli, ["generate", "--engines", str(folder), "--prompt", "x", "--chunk-bound", "2"])
    assert res.exit_code != 0 and "chunk_bound=2.0" in res.output and "Traceback" not in res.output
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:3]))
    out = tmp_path / "b.json"
    res = r.invoke(
        cli,
        [
            "bench",
            "--engines",
            str(folder),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "24",
            "--k-max",
            "4",
            "--strategy",
            "full",
            "--strategy",
            "chunked",
            "--strategy",
            "lazy-head",
            "--out",
            str(out),
            "--no-fastest-baseline",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "MFLOP/tok" in res.output and "ms/tok" in res.output
    rows = {row["label"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"target-only", "spec k=4 th=0 full", "spec k=4 th=0 chunked", "spec k=4 th=0 lazy-head"}
    for label, row in rows.items():
        assert row["equal_to_target"] == 3
        assert row["ms_per_token"] > 0 and row["target_flops_per_token"] > 0
    full, ch, lz = (rows[f"spec k=4 th=0 {s}"] for s in ("full", "chunked", "lazy-head"))
    assert (full["strategy"], ch["strategy"], lz["strategy"]) == ("full", "chunked", "lazy-head")
    assert ch["target_flops_per_token"] <= full["target_flops_per_token"]
    assert lz["head_rows_per_token"] <= full["head_rows_per_token"]
    assert lz["target_positions_per_token"] == full["target_positions_per_token"]
