"""Greedy speculative decoding: oracle = the target model alone (specrt target-only and
Hugging Face ``generate(do_sample=False)`` on the PyTorch target)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from helpers import greedy_verify, speculative_verify  # noqa: F401  (the acceptance loop on explicit rows)

from specrt import Engine, GenerationConfig
from specrt.runtime.speculative import draft_limit, rollback_lengths

PROMPTS = ["def add(a, b):", "for i in range(10):\n", "x", "class Foo:\n    def __init__(self, x):\n        self.x = x\n" * 3]


def hf_greedy(model_dir, ids, n):
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    hf.eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=hf.config.eos_token_id)
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def noisy(noisy_pair):
    target_dir, folder = noisy_pair
    return target_dir, Engine(folder)


@pytest.mark.parametrize("k_max", [1, 2, 4, 8])
@pytest.mark.parametrize("threshold", [0.0, 0.5, 0.9])
def test_speculative_equals_target_only_and_hf(noisy, k_max, threshold):
    target_dir, engine = noisy
    for prompt in PROMPTS:
        ids = engine.prompt_ids(prompt)
        base = engine.generate(ids, GenerationConfig(max_new_tokens=48, speculative=False))
        spec = engine.generate(ids, GenerationConfig(max_new_tokens=48, k_max=k_max, threshold=threshold))
        assert spec.tokens == base.tokens
        assert spec.text == base.text
        assert spec.finish_reason == base.finish_reason
        s = spec.stats
        assert s.accepted <= s.proposed
        assert sum(s.accepted_hist) == s.passes
        assert s.new_tokens == len(spec.tokens)
    # the HF oracle once per config family (it is the slow part)
    if threshold == 0.0:
        ids = engine.prompt_ids(PROMPTS[0])
        spec = engine.generate(ids, GenerationConfig(max_new_tokens=48, k_max=k_max, threshold=threshold))
        assert spec.tokens == hf_greedy(target_dir, ids, 48)


def test_noisy_draft_accepts_some_and_rejects_some(noisy):
    _, engine = noisy
    s = engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=64, k_max=4, threshold=0.0)).stats
    assert 0 < s.accepted < s.proposed


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_random_pairs_several_seeds_match_hf(tmp_path, seed):
    """Independent random pairs (seeds), prompt lengths 1 and long, k in {1, 8}."""
    from helpers import make_tokenizer, save_llama

    from specrt.export.pipeline import export_pair

    tok = make_tokenizer()
    save_llama(tmp_path / "t", tok, seed=seed, hidden=48, layers=2, heads=4, kv_heads=1)
    save_llama(tmp_path / "d", tok, seed=seed + 100, hidden=32, layers=1, heads=2, kv_heads=2, inter=64)
    export_pair(tmp_path / "d", tmp_path / "t", tmp_path / "e", k_max=8, max_ctx=200, log=lambda *_: None)
    engine = Engine(tmp_path / "e")
    rng = np.random.default_rng(seed)
    for plen in (1, 2, 37, 150):
        ids = rng.integers(0, engine.manifest.vocab_size, size=plen).tolist()
        want = hf_greedy(tmp_path / "t", ids, 30)
        for k in (1, 8):
            got = engine.generate(ids, GenerationConfig(max_new_tokens=30, k_max=k)).tokens
            assert got == want, (plen, k)


def test_draft_equal_to_target_accepts_everything(self_pair):
    _, folder = self_pair
    engine = Engine(folder, prefix_cache=False)  # every generation starts from position 0
    calls = []
    for name in ("draft", "target"):
        model = getattr(engine, name)
        orig = model.run

        def rec(tokens, start, _orig=orig, _name=name):
            calls.append((_name, start, len(tokens)))
            return _orig(tokens, start)

        model.run = rec
    for k in (1, 3, 8):
        calls.clear()
        res = engine.generate("def add(a, b):", GenerationConfig(max_new_tokens=60, k_max=k, threshold=0.0))
        s = res.stats
        assert s.proposed > 0 and s.accepted == s.proposed
        assert s.accepted_hist[k] >= s.passes - 2  # all rounds full, except budget-clamped last ones
        # committed KV lengths: before each round's drafting the draft catches up to the
        # committed sequence, so its first call in a round starts where the target's
        # verification starts (both hold the same committed prefix)
        rounds = []
        for i, (who, start, q) in enumerate(calls):
            if who == "target" and start > 0:
                rounds.append(start)
        draft_first = [start + q - 1 for j, (who, start, q) in enumerate(calls) if who == "draft" and (j == 0 or calls[j - 1][0] == "target")]
        assert draft_first == rounds[: len(draft_first)]


def test_draft_that_always_disagrees_commits_one_token_per_round(noisy):
    _, engine = noisy
    prompt = engine.prompt_ids(PROMPTS[1])
    base = engine.generate(prompt, GenerationConfig(max_new_tokens=40, speculative=False)).tokens
    full = prompt + base
    vocab = engine.manifest.vocab_size
    logits = np.zeros((256, engine.draft.vocab), np.float32)
    orig = engine.draft.run

    def wrong(tokens, start):
        orig(tokens, start)
        q = len(tokens)
        for i in range(q):
            pos = start + i
            logits[i] = 0
            nxt = full[pos + 1] if pos + 1 < len(full) else 0
            logits[i, (nxt + 1) % vocab] = 50.0  # confident, always wrong
        return logits[:q]

    engine.draft.run = wrong
    try:
        res = engine.generate(prompt, GenerationConfig(max_new_tokens=40, k_max=4, threshold=0.0))
    finally:
        engine.draft.run = orig
    assert res.tokens == base
    s = res.stats
    assert s.accepted == 0 and s.proposed > 0
    assert s.passes == len(base) - 1  # one token per verification pass (prefill gave the first)


def test_junk_beyond_committed_length_changes_nothing(noisy):
    _, engine = noisy
    ids = engine.prompt_ids(PROMPTS[0])
    want = engine.generate(ids, GenerationConfig(max_new_tokens=50, k_max=4)).tokens
    originals = {}
    for name in ("draft", "target"):
        model = getattr(engine, name)
        originals[name] = model.run

        def junk(tokens, start, _m=model, _orig=model.run):
            end = start + len(tokens)
            for buf in _m.keys + _m.values:
                buf[0, end:] = 1e30
                buf[0, end : end + 3] = np.nan
            return _orig(tokens, start)

        model.run = junk
    try:
        got = engine.generate(ids, GenerationConfig(max_new_tokens=50, k_max=4)).tokens
    finally:
        for name, f in originals.items():
            getattr(engine, name).run = f
    assert got == want


def test_kv_is_written_in_place(noisy):
    _, engine = noisy
    t = engine.target
    engine.generate("x", GenerationConfig(max_new_tokens=5, speculative=False))
    t.run([1, 2, 3], 17)
    ptrs = t.output_pointers()
    assert ptrs["new_key_0"] == t.keys[0].ctypes.data + 17 * t.row_bytes
    assert ptrs["new_value_1"] == t.values[1].ctypes.data + 17 * t.row_bytes
    assert ptrs["logits"] == t.logits.ctypes.data


def _engine_with_eos(folder, tmp_path, eos):
    dst = tmp_path / "eos_engine"
    shutil.copytree(folder, dst)
    m = json.loads((dst / "manifest.json").read_text())
    m["eos_token_id"] = int(eos)
    (dst / "manifest.json").write_text(json.dumps(m))
    return Engine(dst)


def test_eos_inside_an_accepted_run_ends_the_output(self_pair, tmp_path):
    _, folder = self_pair
    engine = Engine(folder)
    base = engine.generate("def add(a, b):", GenerationConfig(max_new_tokens=40, speculative=False)).tokens
    eos = base[7]
    j = base.index(eos)  # its first occurrence
    e2 = _engine_with_eos(folder, tmp_path, eos)
    for k in (1, 4, 8):
        res = e2.generate("def add(a, b):", GenerationConfig(max_new_tokens=40, k_max=k))
        assert res.tokens == base[: j + 1]
        assert res.finish_reason == "stop"
    res = e2.generate("def add(a, b):", GenerationConfig(max_new_tokens=40, speculative=False))
    assert res.tokens == base[: j + 1]


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_max_new_tokens_exact(self_pair, n):
    _, folder = self_pair
    engine = Engine(folder)
    res = engine.generate("def add(a, b):", GenerationConfig(max_new_tokens=n, k_max=4))
    base = engine.generate("def add(a, b):", GenerationConfig(max_new_tokens=n, speculative=False))
    assert len(res.tokens) == n == len(base.tokens)
    assert res.tokens == base.tokens
    assert res.finish_reason == "length"


def test_context_limit_never_overflows(noisy):
    _, engine = noisy
    max_ctx = engine.manifest.max_ctx
    ids = [5] * (max_ctx - 3)
    res = engine.generate(ids, GenerationConfig(max_new_tokens=10, k_max=4))
    assert len(res.tokens) <= 3
    assert res.finish_reason in ("length", "stop")
    base = engine.generate(ids, GenerationConfig(max_new_tokens=10, speculative=False))
    assert res.tokens == base.tokens


def test_int_types_give_same_output(noisy):
    _, engine = noisy
    ids = engine.prompt_ids(PROMPTS[0])
    cfg = GenerationConfig(max_new_tokens=20, k_max=4)
    a = engine.generate(ids, cfg).tokens
    assert engine.generate(np.array(ids, np.int32), cfg).tokens == a
    assert engine.generate(np.array(ids, np.int64), cfg).tokens == a


# ---- pure functions -------------------------------------------------------------------
def test_greedy_verify_first_mismatch_and_bonus():
    logits = np.zeros((4, 10), np.float32)
    for i, t in enumerate([3, 4, 5, 6]):
        logits[i, t] = 1
    assert greedy_verify([3, 4, 5], logits, 10) == (3, 6)  # all accepted + bonus
    assert greedy_verify([3, 9, 5], logits, 10) == (1, 4)  # stop at first mismatch
    assert greedy_verify([], logits, 10) == (0, 3)


def test_greedy_verify_ignores_padding_rows():
    logits = np.zeros((2, 12), np.float32)
    logits[0, 11] = 100  # padded id (vocab 10) must never be chosen
    logits[0, 2] = 1
    assert greedy_verify([2], logits, 10)[0] == 1


def test_draft_limit_and_rollback():
    assert draft_limit(8, remaining=1, seq_len=10, max_ctx=100) == 0
    assert draft_limit(8, remaining=3, seq_len=10, max_ctx=100) == 2
    assert draft_limit(8, remaining=50, seq_len=97, max_ctx=100) == 2
    assert draft_limit(4, remaining=50, seq_len=10, max_ctx=100) == 4
    # drafted n=4 (draft fed S and c1..c3): reject at m=2 -> both keep S + c1, c2
    assert rollback_lengths(seq_len_before=10, draft_len=13, n_accepted=2) == (12, 12)
    # all 4 accepted: the draft has not seen c4 yet
    assert rollback_lengths(seq_len_before=10, draft_len=13, n_accepted=4) == (14, 13)
