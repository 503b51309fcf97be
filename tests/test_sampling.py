"""Exact speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023).

Oracles: the target alone (specrt target-only sampling with the same warping), the exact
distribution of the first tokens computed from the target's own warped probabilities, and
Hugging Face's logits warpers for :func:`warp`. The pure functions are also tested on
hand-made p and q with a scripted random source, so acceptance and residual boundaries
are checked exactly.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import greedy_verify, speculative_verify  # noqa: F401  (the acceptance loop on explicit rows)

from specrt import Engine, GenerationConfig
from specrt.cli import cli
from specrt.runtime.errors import InputError, NumericsError
from specrt.runtime.lab.bench import BenchConfig, format_table, run_bench
from specrt.runtime.sampling import RESIDUAL_EPS, residual, sample_residual, sample_token, warp

V = 16  # real vocab of the small pair (id 0 is EOS)
N_RUNS = 20_000  # seeded runs per histogram
BASE_SEED = 10**6  # target-only runs use other seeds than the speculative ones
# Prompts picked on the pair below from exact figures (first candidate, averaged over t1):
# [15] at temperature 1.0: accepted 64%, warped q(x) >= 0.9 for 29% (threshold 0.9 both
# stops and continues); [9] with WARP_B: accepted 56%, two candidates every round.
PROMPT_A = [15]
PROMPT_B = [9]
WARP_A = dict(temperature=1.0)
WARP_B = dict(temperature=0.7, top_k=5, top_p=0.8)
MEASURED: dict[str, dict] = {}  # figures of the distribution tests, printed at the end (-s)


# ---- the small pair -------------------------------------------------------------------
def _word_tokenizer(n: int):
    from helpers import EOS
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [EOS] + [f"w{i}" for i in range(1, n)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([EOS])
    return tok


def build_small_pair(root):
    """Engine folder ``root/engine``: a 1-layer random target over 16 ids (sharpened so a
    few tokens carry most of the mass) and a draft = the target with noisy, sharper weights
    (overconfident: it is rejected often). Both have padded logits rows (target 3, draft 5)
    with large logits, so a padding id would show up if it were ever sampled."""
    import torch
    from helpers import save_llama

    from specrt.export.pipeline import export_pair

    tok = _word_tokenizer(V)
    kw = dict(hidden=32, layers=1, heads=2, kv_heads=1, inter=64, max_pos=64)
    target = save_llama(root / "target", tok, seed=21, vocab_pad=3, **kw)
    draft = save_llama(root / "draft", tok, seed=21, vocab_pad=5, **kw)
    g = torch.Generator().manual_seed(22)
    with torch.no_grad():
        tp = dict(target.named_parameters())
        for name, p in draft.named_parameters():  # start from the target's weights
            p[: tp[name].shape[0]] = tp[name]
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2 * p.std())
        for m, sharpen in ((target, 4.0), (draft, 6.4)):
            m.lm_head.weight[:V] *= sharpen
            m.lm_head.weight[V:] = m.lm_head.weight[1] * 3.0  # padding rows: large logits
    target.save_pretrained(root / "target")
    draft.save_pretrained(root / "draft")
    export_pair(root / "draft", root / "target", root / "engine", k_max=4, max_ctx=48, log=lambda *_: None)
    return root / "engine"


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    pytest.importorskip("torch")
    return build_small_pair(tmp_path_factory.mktemp("small_vocab"))


@pytest.fixture(scope="module")
def engine(small_pair):
    e = Engine(small_pair, backend="ort-cpu")
    assert e.manifest.vocab_size == V and e.target.vocab > V and e.draft.vocab > V
    return e


def _greedy(engine, prompt, n):
    return engine.generate(prompt, GenerationConfig(max_new_tokens=n, speculative=False)).tokens


# ---- exact distribution of the first tokens, from the target alone ---------------------
def exact_first_tokens(engine, prompt, depth, warp_kw, allowed=None):
    """{(t1, .., t_depth): probability} under the target's warped distribution; a key
    that reaches EOS early is padded with -1 (the run stops there). ``allowed(prefix)``:
    the ids a constraint allows after ``prefix`` (the others get -inf before the warp)."""
    eos = engine.manifest.eos_token_id
    t = dict(temperature=0.0, top_k=0, top_p=1.0)
    t.update(warp_kw)
    out = {}

    def rec(prefix, prob):
        if len(prefix) == depth or (prefix and prefix[-1] == eos):
            out[tuple(prefix) + (-1,) * (depth - len(prefix))] = prob
            return
        row = engine.target.run(prompt + prefix, 0)[-1].copy()
        if allowed is not None:
            keep = np.zeros(row.shape, bool)
            keep[list(allowed(prefix))] = True
            row[~keep] = -np.inf
        p = warp(row, V, t["temperature"], t["top_k"], t["top_p"])
        for tok in np.flatnonzero(p):
            rec(prefix + [int(tok)], prob * p[tok])

    rec([], 1.0)
    return out


def collect(engine, prompt, cfg, seeds, depth):
    """Histogram of the first ``depth`` generated tokens over seeded runs (-1 after EOS)."""
    counts = Counter()
    for s in seeds:
        toks = engine.generate(prompt, replace(cfg, seed=s)).tokens[:depth]
        counts[tuple(toks) + (-1,) * (depth - len(toks))] += 1
    return counts


def truncate(counts, depth):
    out = Counter()
    for k, c in counts.items():
        out[k[:depth]] += c
    return out


def two_sample(a: Counter, b: Counter):
    """(TV distance, chi-square p-value) of two histograms; bins with < 10 pooled counts merged."""
    from scipy.stats import chi2_contingency

    na, nb = sum(a.values()), sum(b.values())
    keys = sorted(set(a) | set(b))
    tv = 0.5 * sum(abs(a[k] / na - b[k] / nb) for k in keys)
    big = [k for k in keys if a[k] + b[k] >= 10]
    rare = [k for k in keys if a[k] + b[k] < 10]
    table = [[a[k] for k in big], [b[k] for k in big]]
    if rare:
        table[0].append(sum(a[k] for k in rare))
        table[1].append(sum(b[k] for k in rare))
    return tv, chi2_contingency(np.array(table), correction=False)[1]


def goodness_of_fit(obs: Counter, exact: dict):
    """(TV to the exact distribution, chi-square p-value); bins expected < 5 merged."""
    from scipy.stats import chisquare

    n = sum(obs.values())
    outside = {k: c for k, c in obs.items() if exact.get(k, 0.0) == 0.0}
    assert not outside, f"sampled token sequences the target gives probability 0: {outside}"
    tv = 0.5 * sum(abs(obs.get(k, 0) / n - p) for k, p in exact.items())
    big = [k for k, p in exact.items() if n * p >= 5]
    rare = [k for k, p in exact.items() if n * p < 5]
    o = [obs.get(k, 0) for k in big] + ([sum(obs.get(k, 0) for k in rare)] if rare else [])
    e = [n * exact[k] for k in big] + ([n * sum(exact[k] for k in rare)] if rare else [])
    e = np.array(e) * (n / sum(e))
    return tv, chisquare(o, e)[1]


# ---- distribution: speculative vs target-only, >= 20,000 seeded runs each ---------------
@pytest.fixture(scope="module")
def baselines(engine):
    """Target-only sampling, first two tokens, for both warpings (independent seeds)."""
    out = {}
    for name, prompt, kw in (("A", PROMPT_A, WARP_A), ("B", PROMPT_B, WARP_B)):
        cfg = GenerationConfig(max_new_tokens=2, speculative=False, **kw)
        out[name] = collect(engine, prompt, cfg, range(BASE_SEED, BASE_SEED + N_RUNS), 2)
    return out


REJ_A, REJ_B = dict(WARP_A, sampler="rejection"), dict(WARP_B, sampler="rejection")
DIST_CASES = {
    # name: (baseline, prompt, warping and sampler, k_max, threshold); the target-only
    # baselines are seeded, so they run the coupled sampler's race (runtime/coupling.py)
    "T1.0 k2": ("A", PROMPT_A, REJ_A, 2, 0.0),
    "T1.0 k1 (same seeds)": ("A", PROMPT_A, REJ_A, 1, 0.0),
    "T0.7 top-p0.8 top-k5 k2": ("B", PROMPT_B, REJ_B, 2, 0.0),
    "T1.0 k2 threshold0.9": ("A", PROMPT_A, REJ_A, 2, 0.9),
    "coupled T1.0 k2": ("A", PROMPT_A, WARP_A, 2, 0.0),
    "coupled T0.7 top-p0.8 top-k5 k2 threshold0.9": ("B", PROMPT_B, WARP_B, 2, 0.9),
}


@pytest.mark.parametrize("case", list(DIST_CASES))
def test_speculative_sampling_matches_target_distribution(engine, baselines, case):
    """First two tokens: speculative vs target-only histograms (TV < 0.02, chi-square p >
    1e-3); first three tokens (which reach the second candidate, the bonus token and the
    threshold stop) against the exact target distribution (chi-square p > 1e-3); the
    target-only histogram against the exact one too. No sampled sequence has target
    probability 0 (tokens outside top-k/top-p, padding ids)."""
    base_name, prompt, kw, k, th = DIST_CASES[case]
    cfg = GenerationConfig(max_new_tokens=k + 2, k_max=k, threshold=th, **kw)  # the first round drafts k
    spec3 = collect(engine, prompt, cfg, range(N_RUNS), 3)
    spec2, base2 = truncate(spec3, 2), baselines[base_name]
    tv, p = two_sample(spec2, base2)
    tv3, p3 = goodness_of_fit(spec3, exact_first_tokens(engine, prompt, 3, kw))
    tvb, pb = goodness_of_fit(base2, exact_first_tokens(engine, prompt, 2, kw))
    MEASURED[case] = dict(tv_spec_vs_base_2tok=tv, p_spec_vs_base_2tok=p, tv_spec_vs_exact_3tok=tv3, p_spec_vs_exact_3tok=p3, p_base_vs_exact_2tok=pb)
    print(f"{case:<40} " + "  ".join(f"{k}={v:.4g}" for k, v in MEASURED[case].items()))  # the figures (pytest -s)
    assert tv < 0.02 and p > 1e-3, MEASURED[case]
    assert p3 > 1e-3 and pb > 1e-3, MEASURED[case]


# a token-level grammar: ids 2, 3, 5, 8, 13 (some of the draft's and target's favourites
# among them, some not), one or more, then the end of generation
MASK_IDS = (2, 3, 5, 8, 13)
MASK_GRAMMAR = "start: (" + " | ".join(f"<[{i}]>" for i in MASK_IDS) + ")+"


@pytest.mark.parametrize("sampler", ["rejection", "coupled"])
def test_constrained_sampling_matches_the_masked_target_distribution(engine, sampler):
    """Speculative sampling under a constraint (draft and target rows masked alike) against
    the exact masked target distribution of the first three tokens (Leviathan et al. 2023,
    Algorithm 1 on the masked p and q), and the constrained target-only histogram against
    it too: chi-square p > 1e-3; no sampled sequence leaves the grammar."""
    from specrt.runtime.constraints import Constraint

    c = Constraint("lark", MASK_GRAMMAR)
    allowed = lambda prefix: MASK_IDS + ((engine.manifest.eos_token_id,) if prefix else ())  # noqa: E731
    exact = exact_first_tokens(engine, PROMPT_A, 3, WARP_A, allowed)
    n = N_RUNS // 4  # 5,000 seeded runs each
    spec = collect(engine, PROMPT_A, GenerationConfig(max_new_tokens=5, k_max=3, constraint=c, sampler=sampler, **WARP_A), range(n), 3)
    base = collect(engine, PROMPT_A, GenerationConfig(max_new_tokens=3, speculative=False, constraint=c, **WARP_A), range(BASE_SEED, BASE_SEED + n), 3)
    tv, p = goodness_of_fit(spec, exact)
    tvb, pb = goodness_of_fit(base, exact)
    MEASURED[f"constrained T1.0 k3 {sampler}"] = dict(tv_spec_vs_exact_3tok=tv, p_spec_vs_exact_3tok=p, tv_base_vs_exact_3tok=tvb, p_base_vs_exact_3tok=pb)
    print(f"constrained T1.0 k3 {sampler} " + "  ".join(f"{k}={v:.4g}" for k, v in MEASURED[f"constrained T1.0 k3 {sampler}"].items()))
    assert p > 1e-3 and pb > 1e-3, MEASURED[f"constrained T1.0 k3 {sampler}"]
    # the unmasked target puts most of its mass elsewhere: the mask really changed the distribution
    free = exact_first_tokens(engine, PROMPT_A, 1, WARP_A)
    assert sum(v for k, v in free.items() if k[0] not in MASK_IDS) > 0.3


def test_threshold_case_really_stops_and_continues(engine):
    """The threshold-0.9 case above exercises both branches: some first rounds stop after
    one candidate (q(x) < 0.9), some draft two."""
    cfg = GenerationConfig(max_new_tokens=4, k_max=2, threshold=0.9, **WARP_A)
    drafted = Counter()
    ids = engine.prompt_ids(PROMPT_A)
    for s in range(300):
        recs = list(engine.rounds(ids, engine.resolve(replace(cfg, seed=s))))
        if len(recs) > 1:
            drafted[recs[1].n] += 1  # record 0 is the prefill, record 1 the first round
    assert drafted[1] > 30 and drafted[2] > 30, drafted


# ---- end-to-end properties ------------------------------------------------------------
def test_temperature_zero_is_the_greedy_path(engine):
    for prompt in (PROMPT_A, PROMPT_B, [5, 6]):
        want = engine.generate(prompt, GenerationConfig(max_new_tokens=20, k_max=4)).tokens
        got = engine.generate(prompt, GenerationConfig(max_new_tokens=20, k_max=4, temperature=0.0, top_k=3, top_p=0.5, seed=7))
        assert got.tokens == want
        assert want == _greedy(engine, prompt, 20)


@pytest.mark.parametrize(
    "kw",
    [dict(temperature=1e-7), dict(temperature=1.0, top_k=1), dict(temperature=1.0, top_p=1e-9), dict(temperature=1e-300, top_p=0.5)],
    ids=["temperature->0", "top_k=1", "top_p keeps one", "denormal temperature"],
)
def test_degenerate_sampling_is_greedy(engine, kw):
    """One-hot p and q: acceptance p/q is 0 or 1 and the residual is the target's argmax."""
    for prompt in (PROMPT_A, PROMPT_B):
        want = _greedy(engine, prompt, 24)
        for k in (1, 4):
            for seed in (0, 1):
                for th in (0.0, 0.9):
                    res = engine.generate(prompt, GenerationConfig(max_new_tokens=24, k_max=k, threshold=th, seed=seed, **kw))
                    assert res.tokens == want, (k, seed, th)
        assert engine.generate(prompt, GenerationConfig(max_new_tokens=24, speculative=False, seed=3, **kw)).tokens == want


@pytest.mark.parametrize("k", [1, 2, 4])
def test_same_seed_same_tokens(engine, k):
    cfg = GenerationConfig(max_new_tokens=30, k_max=k, seed=1234, **WARP_A)
    a, b = engine.generate(PROMPT_A, cfg), engine.generate(PROMPT_A, cfg)
    assert a.tokens == b.tokens and a.stats.accepted_hist == b.stats.accepted_hist
    assert "".join(engine.stream(PROMPT_A, cfg)) == a.text  # stream: the same run
    others = {tuple(engine.generate(PROMPT_A, replace(cfg, seed=s)).tokens) for s in range(8)}
    assert len(others) > 1
    fresh = {tuple(engine.generate(PROMPT_A, replace(cfg, seed=None)).tokens) for _ in range(4)}
    assert len(fresh) > 1


def test_no_token_outside_the_targets_top_k_top_p_set(engine):
    """Every generated token, at every position, has positive warped target probability
    (so it is inside top-k and top-p, and never a padding id)."""
    kw = dict(temperature=1.3, top_k=3, top_p=0.7)
    seen = 0
    for s in range(40):
        prompt = [1 + s % (V - 1)]
        toks = engine.generate(prompt, GenerationConfig(max_new_tokens=24, k_max=4, seed=s, **kw)).tokens
        for i, t in enumerate(toks):
            row = engine.target.run(prompt + toks[:i], 0)[-1]
            p = warp(row, V, kw["temperature"], kw["top_k"], kw["top_p"])
            assert t < V and p[t] > 0, (s, i, t)
            assert (p > 0).sum() <= 3
            seen += 1
    assert seen > 200


def _engine_copy(folder, dst, **changes):
    """Copy of an engine folder with manifest fields changed (the files stay the same)."""
    shutil.copytree(folder, dst)
    m = json.loads((dst / "manifest.json").read_text())
    m.update(changes)
    (dst / "manifest.json").write_text(json.dumps(m))
    return Engine(dst, backend="ort-cpu")


def test_draft_equal_to_target_accepts_every_proposal(small_pair, tmp_path):
    """Draft = the target's own ONNX file: p == q, so p/q = 1 > r and nothing is rejected."""
    m = json.loads((small_pair / "manifest.json").read_text())
    engine = _engine_copy(small_pair, tmp_path / "self", draft=m["target"])
    for kw in (WARP_A, WARP_B, dict(temperature=1.5, top_p=0.95)):
        for k in (1, 4):
            for prompt in (PROMPT_A, PROMPT_B, [3, 4]):
                s = engine.generate(prompt, GenerationConfig(max_new_tokens=40, k_max=k, seed=5, **kw)).stats
                assert s.accepted == s.proposed, (kw, k, prompt)
                assert s.proposed > 0 or s.new_tokens == 1  # (EOS first)


def test_eos_sampled_mid_run_ends_the_output(small_pair, tmp_path):
    """Make a frequent token the EOS: runs stop right after it, wherever it is sampled
    (candidate accepted mid-round, correction, bonus, first token)."""
    engine = _engine_copy(small_pair, tmp_path / "eos_engine", eos_token_id=5, eos_token_ids=[5])
    stops = Counter()
    for s in range(200):
        for spec in (True, False):
            res = engine.generate(PROMPT_A, GenerationConfig(max_new_tokens=12, k_max=4, seed=s, speculative=spec, **WARP_A))
            assert 5 not in res.tokens[:-1]
            assert (res.finish_reason == "stop") == (res.tokens[-1] == 5)
            assert res.finish_reason == "stop" or len(res.tokens) == 12
            stops[spec, res.finish_reason] += 1
    assert stops[True, "stop"] > 20 and stops[True, "length"] > 20, stops
    # same stopping frequency with and without speculation (binomial, loose)
    assert abs(stops[True, "stop"] - stops[False, "stop"]) < 40, stops


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(temperature=-0.1), "temperature=-0.1; temperature must be a finite number >= 0"),
        (dict(temperature=float("nan")), "temperature=nan"),
        (dict(temperature=float("inf")), "temperature=inf"),
        (dict(temperature=True), "temperature=True"),
        (dict(temperature=1.0, top_p=0.0), "top_p=0.0; top_p must be a number in (0, 1]"),
        (dict(temperature=1.0, top_p=1.5), "top_p=1.5"),
        (dict(temperature=1.0, top_p=-0.2), "top_p=-0.2"),
        (dict(temperature=1.0, top_k=-1), "top_k=-1; top_k must be an integer >= 0"),
        (dict(temperature=1.0, top_k=2.5), "top_k=2.5"),
        (dict(temperature=1.0, seed=-3), "seed=-3; seed must be None or an integer >= 0"),
        (dict(temperature=1.0, seed="x"), "seed='x'"),
    ],
)
def test_bad_sampling_parameters(engine, kw, needle):
    with pytest.raises(InputError) as e:
        engine.generate(PROMPT_A, GenerationConfig(**kw))
    assert needle in str(e.value)


def test_cli_generate_and_bench_sampling(small_pair, tmp_path):
    args = ["generate", "--engines", str(small_pair), "--prompt", "w1 w2", "--max-new-tokens", "12", "--no-stats", "--backend", "ort-cpu"]
    samp = ["--temperature", "0.8", "--top-k", "5", "--top-p", "0.9", "--seed", "3"]
    a = CliRunner().invoke(cli, args + samp)
    b = CliRunner().invoke(cli, args + samp)
    assert a.exit_code == 0 and a.output == b.output and a.output.strip(), a.output
    for bad, needle in ((["--top-p", "1.5"], "top_p=1.5"), (["--temperature", "-1"], "temperature=-1.0"), (["--top-k", "-2"], "top_k=-2")):
        r = CliRunner().invoke(cli, args + ["--temperature", "1"] + bad)
        assert r.exit_code != 0 and needle in r.output and "Traceback" not in r.output
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w1 w2 w3"}\n{"prompt": "w11"}\n')
    out = tmp_path / "bench.json"
    r = CliRunner().invoke(
        cli,
        [
            "bench",
            "--engines",
            str(small_pair),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "16",
            "--k-max",
            "2",
            "--out",
            str(out),
            "--backend",
            "ort-cpu",
            "--no-fastest-baseline",
        ]
        + samp,
    )
    assert r.exit_code == 0, r.output
    rows = json.loads(out.read_text())["rows"]
    assert [row["temperature"] for row in rows] == [0.8, 0.8]
    assert rows[1]["acceptance_rate"] is not None and rows[1]["speedup"] > 0
    assert all(row["equal_to_target"] is None for row in rows)


def test_bench_greedy_rows_still_count_equal_outputs(engine):
    prompts = [{"prompt": "w1 w2 w3"}]
    configs = [
        BenchConfig("target-only", GenerationConfig(max_new_tokens=10, speculative=False)),
        BenchConfig("spec", engine.resolve(GenerationConfig(max_new_tokens=10, k_max=2))),
        BenchConfig("spec sampled", engine.resolve(GenerationConfig(max_new_tokens=10, k_max=2, temperature=0.9, seed=1))),
    ]
    r = run_bench(engine, prompts, configs)
    assert [row["equal_to_target"] for row in r["rows"]] == [1, 1, None]
    assert "spec sampled" in format_table(r)


# ---- pure functions -------------------------------------------------------------------
class ScriptedRng:
    """Stands in for numpy's Generator: ``random()`` returns the scripted values in order."""

    def __init__(self, *values):
        self.values = list(values)

    def random(self):
        return self.values.pop(0)


def _hf_warp(row, vocab, temperature, top_k, top_p):
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = torch.tensor(row[:vocab], dtype=torch.float64)[None]
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(-1)[0].numpy()


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 0.8), (1.3, 0, 0.9), (0.5, 20, 1.0), (2.0, 7, 0.5), (1.0, 3, 0.999)])
def test_warp_matches_hugging_face_warpers(temperature, top_k, top_p):
    rng = np.random.default_rng(0)
    for vocab, pad in ((50, 0), (1000, 24), (8000, 0)):
        for _ in range(4):
            row = (rng.standard_normal(vocab + pad) * 3).astype(np.float32)
            row[vocab:] = 100.0  # padding rows with huge logits must get 0
            got = warp(row, vocab, temperature, top_k, top_p)
            assert got.dtype == np.float64 and got.shape == (vocab + pad,)
            assert np.all(got[vocab:] == 0) and abs(got.sum() - 1) < 1e-12
            np.testing.assert_allclose(got[:vocab], _hf_warp(row, vocab, temperature, top_k, top_p), rtol=1e-9, atol=1e-15)


def test_warp_degenerate_cases_and_buffers():
    row = np.array([0.5, 2.0, -1.0, 1.9, 50.0], np.float32)  # id 4 is padding (vocab 4)
    onehot = np.array([0, 1, 0, 0, 0], float)
    assert np.array_equal(warp(row, 4, 0.0), onehot)  # temperature 0: greedy
    assert np.array_equal(warp(row, 4, 1e-6), onehot)  # -> 0: greedy, no overflow
    assert np.array_equal(warp(row, 4, 5e-324), onehot)
    assert np.array_equal(warp(row, 4, 1.0, top_k=1), onehot)
    assert np.array_equal(warp(row, 4, 1.0, top_p=1e-9), onehot)  # top-p keeps one token
    # top-k >= vocab and top-k 0 are both "off"
    assert np.array_equal(warp(row, 4, 1.0, top_k=4), warp(row, 4, 1.0)) and np.array_equal(warp(row, 4, 1.0, top_k=99), warp(row, 4, 1.0))
    # top-p keeps the token that crosses the mass (ids 1 and 3 here)
    p = warp(row, 4, 1.0)
    assert p[1] < 0.6 < p[1] + p[3]
    np.testing.assert_allclose(warp(row, 4, 1.0, top_p=0.6), [0, p[1], 0, p[3], 0] / (p[1] + p[3]))
    # ties at the k-th value are kept
    np.testing.assert_allclose(warp(np.array([1.0, 3.0, 3.0, 0.0]), 4, 1.0, top_k=1), [0, 0.5, 0.5, 0])
    # out buffer wider than the row's vocab: the rest is zeroed, the buffer is returned
    out = np.full(6, 7.0)
    assert warp(row, 4, 1.0, out=out) is out and np.all(out[4:] == 0)
    # fp16 logits are upcast before the softmax (same result as from float64 logits)
    h = np.array([10.0, 10.01, 9.0, -3.0], np.float16)
    np.testing.assert_allclose(warp(h, 4, 0.3), warp(h.astype(np.float64), 4, 0.3), rtol=0, atol=0)
    assert warp(h, 4, 0.3).dtype == np.float64
    for bad in (np.nan, np.inf):
        r = row.copy()
        r[2] = bad
        with pytest.raises(NumericsError):
            warp(r, 4, 1.0)
    with pytest.raises(InputError):
        warp(row, 4, -1.0)
    with pytest.raises(InputError):
        warp(row, 4, 1.0, top_p=0.0)


def test_numpy_scalar_settings_resolve_to_the_same_values_and_tokens(engine):
    """numpy scalars are accepted, resolved to Python numbers of equal value, and sample
    exactly what the same Python numbers sample."""
    np_cfg = GenerationConfig(max_new_tokens=np.int64(6), temperature=np.float32(0.5), top_k=np.int64(3), top_p=np.float64(0.9), seed=np.uint32(7))
    py_cfg = GenerationConfig(max_new_tokens=6, temperature=0.5, top_k=3, top_p=0.9, seed=7)
    r = engine.resolve(np_cfg)
    got = (r.max_new_tokens, r.temperature, r.top_k, r.top_p, r.seed)
    assert got == (6, 0.5, 3, 0.9, 7) and [type(x) for x in got] == [int, float, int, float, int]
    assert engine.generate(PROMPT_A, np_cfg).tokens == engine.generate(PROMPT_A, py_cfg).tokens


def test_sample_token_inverse_cdf_and_zero_weights():
    w = np.array([0.0, 0.5, 0.0, 0.5, 0.0])
    assert sample_token(w, ScriptedRng(0.0)) == 1  # never the zero-weight id 0
    assert sample_token(w, ScriptedRng(0.4999)) == 1
    assert sample_token(w, ScriptedRng(0.5)) == 3
    assert sample_token(w, ScriptedRng(1 - 2**-53)) == 3  # never the zero-weight id 4
    assert sample_token(w * 3e-7, ScriptedRng(0.7)) == 3  # unnormalised weights
    with pytest.raises(ValueError):
        sample_token(np.zeros(3), ScriptedRng(0.1))


P = np.array([0.5, 0.3, 0.2, 0.0])
Q = np.array([0.2, 0.6, 0.1, 0.1])


def test_speculative_verify_acceptance_is_min_1_p_over_q_exactly():
    # x = 1: p/q = 0.5 -> accepted iff r < 0.5
    p_rows = np.array([P, [0, 0, 0, 1.0]])
    assert speculative_verify([1], Q[None], p_rows, ScriptedRng(np.nextafter(0.5, 0), 0.3)) == (1, 3)  # accepted + bonus
    n, tok = speculative_verify([1], Q[None], p_rows, ScriptedRng(0.5, 0.0))
    assert n == 0
    # x = 0: p/q = 2.5 -> always accepted, even at r -> 1
    assert speculative_verify([0], Q[None], p_rows, ScriptedRng(1 - 2**-53, 0.0))[0] == 1
    # x = 3: p(x) = 0 -> always rejected
    assert speculative_verify([3], Q[None], p_rows, ScriptedRng(0.0, 0.0))[0] == 0


def test_residual_is_norm_max_0_p_minus_q():
    # max(0, p - q) = [0.3, 0, 0.1, 0] -> norm [0.75, 0, 0.25, 0]
    np.testing.assert_allclose(residual(P, Q), [0.3, 0, 0.1, 0], atol=1e-15)
    p_rows = np.array([P, P])
    assert speculative_verify([1], Q[None], p_rows, ScriptedRng(0.9, 0.7499)) == (0, 0)
    assert speculative_verify([1], Q[None], p_rows, ScriptedRng(0.9, 0.7501)) == (0, 2)
    assert speculative_verify([1], Q[None], p_rows, ScriptedRng(0.9, 1 - 2**-53)) == (0, 2)


def test_residual_numerically_zero_falls_back_to_p():
    p = np.array([0.25, 0.25, 0.5, 0.0])
    q = p.copy()
    q[0] += 1e-17  # round-off: p == q on the support
    assert residual(p, q).sum() <= RESIDUAL_EPS
    # force the (in exact arithmetic impossible) rejection of x = 2 with r = 1.0
    assert sample_residual(p, p, ScriptedRng(0.6)) == 2
    assert speculative_verify([2], p[None], np.array([p, p]), ScriptedRng(1.0, 0.1)) == (0, 0)
    assert speculative_verify([2], q[None], np.array([p, p]), ScriptedRng(1.0, 0.3)) == (0, 1)
    assert speculative_verify([2], q[None], np.array([p, p]), ScriptedRng(1.0, 0.99)) == (0, 2)


def test_speculative_verify_early_stop_reads_no_later_rows():
    class Rows:
        def __init__(self, rows):
            self.rows, self.read = rows, []

        def __getitem__(self, i):
            self.read.append(i)
            return self.rows[i]

        def __len__(self):
            return len(self.rows)

    rows = Rows(np.array([P, P, P, P]))
    q = np.array([Q, Q, Q])
    assert speculative_verify([0, 3, 0], q, rows, ScriptedRng(0.1, 0.1, 0.0)) == (1, 0)  # 0 accepted, 3 rejected
    assert rows.read == [0, 1]


def test_speculative_verify_equal_distributions_accept_everything_and_one_hot_is_greedy():
    rng = np.random.default_rng(0)
    for _ in range(200):
        p = rng.dirichlet(np.ones(6))
        cands = [int(rng.choice(6, p=p)) for _ in range(3)]
        assert speculative_verify(cands, np.array([p] * 3), np.array([p] * 4), rng)[0] == 3
    logits = rng.standard_normal((4, 6)).astype(np.float32)
    p1 = np.array([warp(r, 6, 0.0) for r in logits])
    for cands in ([int(logits[0].argmax())], [int(logits[0].argmax()), 5, 5], [0, 1, 2]):
        q1 = np.array([np.eye(6)[c] for c in cands])
        assert speculative_verify(cands, q1, p1, rng) == greedy_verify(cands, logits, 6)


def test_speculative_verify_output_distribution_monte_carlo():
    """One step with x ~ q: the committed token follows p and the acceptance rate is
    sum(min(p, q)) (40,000 draws; hand-made p and q with zeros where top-k/top-p cut)."""
    rng = np.random.default_rng(1)
    p = np.array([0.45, 0.05, 0.3, 0.0, 0.2, 0.0])
    q = np.array([0.1, 0.5, 0.1, 0.2, 0.0, 0.1])
    p_rows, q_rows, work = np.array([p, p]), q[None], np.empty((2, 6))
    n, got, accepted = 40_000, np.zeros(6), 0
    for _ in range(n):
        x = sample_token(q, rng)
        m, tok = speculative_verify([x], q_rows, p_rows, rng, work)
        got[x if m == 1 else tok] += 1
        accepted += m
    assert 0.5 * np.abs(got / n - p).sum() < 0.01
    assert got[3] == 0 and got[5] == 0
    assert abs(accepted / n - np.minimum(p, q).sum()) < 0.01
