"""``GenerationConfig(logprobs=N)``: the committed tokens' log-probabilities under the target's
raw distribution, read from the verification rows (runtime/logprobs.py), checked against an
independent computation (the PyTorch target's logits over prompt + output, log_softmax in
numpy), for every verification strategy, greedy and sampled, with accepted candidates,
corrections, bonus tokens, EOS and stop strings; the tokens never change."""

from __future__ import annotations

import numpy as np
import pytest

from specrt import Engine, GenerationConfig
from specrt.runtime.config import MAX_LOGPROBS
from specrt.runtime.errors import InputError
from specrt.runtime.logprobs import LogprobRecorder, log_softmax, token_logprob
from specrt.runtime.sampling import derive_seed
from specrt.runtime.speculative import GreedyAcceptor


@pytest.fixture(scope="module")
def noisy(noisy_pair):
    return Engine(noisy_pair[1])


@pytest.fixture(scope="module")
def torch_target(noisy_pair):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(noisy_pair[0]), local_files_only=True).eval()

    def logprobs(ids: list[int]) -> np.ndarray:
        """float64 [len(ids), vocab] log_softmax of the PyTorch target's logits (numpy)."""
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].double().numpy()
        z = logits - logits.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    return logprobs


def check_against_target(engine, torch_lp, prompt, res, top_n):
    ids = engine.prompt_ids(prompt)
    ref = torch_lp(ids + res.tokens)[len(ids) - 1 : len(ids) - 1 + len(res.tokens), : engine.manifest.vocab_size]
    assert len(res.logprobs) == len(res.tokens) > 0
    for i, (tok, e) in enumerate(zip(res.tokens, res.logprobs)):
        assert e.token == tok
        assert e.logprob == pytest.approx(ref[i, tok], abs=2e-4)
        want = np.argsort(-ref[i], kind="stable")[:top_n]
        assert [t for t, _ in e.top] == list(want) or np.allclose(sorted(v for _, v in e.top), sorted(ref[i, want]), atol=2e-4)  # ties may reorder
        for t, v in e.top:
            assert v == pytest.approx(ref[i, t], abs=2e-4)
        assert [v for _, v in e.top] == sorted((v for _, v in e.top), reverse=True)


@pytest.mark.parametrize("strategy", ["full", "chunked", "lazy-head"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_equal_the_target_and_leave_tokens_alone(noisy, torch_target, strategy, temperature):
    prompt = "def add(a, b):"
    cfg = GenerationConfig(max_new_tokens=40, k_max=4, temperature=temperature, top_k=50, top_p=0.9, seed=7, strategy=strategy)
    plain = noisy.generate(prompt, cfg)
    res = noisy.generate(prompt, GenerationConfig(**{**cfg.__dict__, "logprobs": 3}))
    assert res.tokens == plain.tokens and res.text == plain.text and plain.logprobs is None
    assert res.stats.accepted > 0 and res.stats.accepted < res.stats.proposed  # accepted candidates and corrections both occur
    check_against_target(noisy, torch_target, prompt, res, 3)
    if temperature == 0:
        assert all(e.top[0][0] == e.token for e in res.logprobs)  # greedy: the chosen token is the row's argmax


def test_logprobs_follow_eos_and_stop_cuts(noisy, torch_target):
    prompt = "for i in range(10):"
    full = noisy.generate(prompt, GenerationConfig(max_new_tokens=60, temperature=0, logprobs=0))
    stop = full.text[20:23]
    cut = noisy.generate(prompt, GenerationConfig(max_new_tokens=60, temperature=0, logprobs=0, stop=(stop,)))
    assert cut.finish_reason == "stop" and len(cut.tokens) < len(full.tokens)
    assert cut.logprobs == full.logprobs[: len(cut.tokens)]
    assert all(e.top == () for e in cut.logprobs)
    # sampled at a high temperature some generations end at EOS: the EOS entry is the last one
    eos = []
    for s in range(60):  # until two of them did
        r = noisy.generate(prompt, GenerationConfig(max_new_tokens=60, temperature=1.5, seed=s, logprobs=1))
        if r.tokens[-1] == noisy.manifest.eos_token_id:
            eos.append(r)
        if len(eos) == 2:
            break
    assert eos, "no sampled generation reached EOS"
    for r in eos:
        assert len(r.logprobs) == len(r.tokens)
        check_against_target(noisy, torch_target, prompt, r, 1)


def test_stream_exposes_logprobs_as_rounds_commit(noisy):
    cfg = GenerationConfig(max_new_tokens=30, temperature=0, logprobs=2)
    st = noisy.stream("class Foo:", cfg)
    seen = []
    for _ in st:
        assert len(st.logprobs) == len(st.tokens)
        seen.append(len(st.tokens))
    assert st.result.logprobs == st.logprobs and st.result.tokens == st.tokens
    assert seen == sorted(seen) and seen[-1] == 30
    assert noisy.stream("class Foo:", GenerationConfig(max_new_tokens=3)).logprobs is None


def test_prompt_logprobs(noisy, torch_target):
    ids = noisy.prompt_ids("import os\nimport sys\n")
    got = noisy.prompt_logprobs(ids, 2)
    ref = torch_target(ids)
    assert got[0] is None and len(got) == len(ids)
    for i in range(1, len(ids)):
        assert got[i].token == ids[i]
        assert got[i].logprob == pytest.approx(ref[i - 1, ids[i]], abs=2e-4)
        assert len(got[i].top) == 2 and got[i].top[0][1] == pytest.approx(ref[i - 1].max(), abs=2e-4)
    long_ids = [int(t) for t in np.random.default_rng(0).integers(1, noisy.manifest.vocab_size, 255)]  # the longest prompt that fits
    got = noisy.prompt_logprobs(long_ids, 0)
    ref = torch_target(long_ids)
    assert max(abs(got[i].logprob - ref[i - 1, long_ids[i]]) for i in range(1, 255)) < 2e-4


def test_recorder_forwards_everything():
    rng = np.random.default_rng(1)
    rows = rng.normal(size=(3, 12)).astype(np.float32)
    inner = GreedyAcceptor(10, 12)
    rec = LogprobRecorder(GreedyAcceptor(10, 12), 10, 2)
    assert rec.greedy and not rec.propose_below
    x = int(rows[0, :10].argmax())
    assert rec.accept(0, x, rows[0]) is True and inner.accept(0, x, rows[0]) is True
    assert rec.accept(1, (int(rows[1, :10].argmax()) + 1) % 10, rows[1]) is False
    assert rec.correction(1, rows[1]) == int(rows[1, :10].argmax())
    assert rec.bonus(2, rows[2]) == int(rows[2, :10].argmax())
    got = rec.take()
    assert [e.token for e in got] == [x, int(rows[1, :10].argmax()), int(rows[2, :10].argmax())] and rec.take() == []
    lp = log_softmax(rows[1], 10)
    assert got[1].logprob == pytest.approx(lp.max()) and np.exp(lp).sum() == pytest.approx(1.0)
    e = token_logprob(np.array([0.0, 1.0, 1.0, -np.inf, 5.0]), 4, 1, 3)  # ties: lower id first; padding id 4 dropped
    assert [t for t, _ in e.top] == [1, 2, 0] and e.logprob == pytest.approx(np.log(np.e / (1 + 2 * np.e)))
    assert token_logprob(np.array([0.0, -np.inf]), 2, 1, 0).logprob == -np.inf


def test_logprobs_setting_is_validated(noisy):
    for bad in (-1, MAX_LOGPROBS + 1, 1.5, True):
        with pytest.raises(InputError) as e:
            noisy.resolve(GenerationConfig(logprobs=bad))
        assert e.value.param == "logprobs" and f"0..{MAX_LOGPROBS}" in str(e.value)
    assert noisy.resolve(GenerationConfig(logprobs=MAX_LOGPROBS)).logprobs == MAX_LOGPROBS


def test_derived_seeds():
    assert derive_seed(None, 3) is None and derive_seed(5, 0) == 5
    seeds = [derive_seed(5, i) for i in range(1, 50)]
    assert len(set(seeds)) == 49 and all(0 <= s < 2**64 for s in seeds) and 5 not in seeds
    assert seeds[:3] == [derive_seed(5, i) for i in range(1, 4)]  # deterministic
    assert derive_seed(6, 1) != derive_seed(5, 1)
