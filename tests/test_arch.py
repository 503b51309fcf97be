"""Architecture families (Llama, Mistral, Qwen2, Phi-3, GPT-2) and pair compatibility.

Oracles: PyTorch (parity of exported logits and new KV rows) and Hugging Face
``generate(do_sample=False)`` on the target (greedy output). One engine per family as
target, exported once per module:

* llama: mixed pair, GPT-2 draft (per-layer attention scaling) + Llama target;
* mistral: explicit head_dim, sliding_window 4096 >= max_ctx (full attention);
* qwen2: q/k/v biases, tied embeddings, one sliding layer (window 512 >= max_ctx);
* phi3: fused qkv/gate_up, partial rotary 0.75, longrope; its draft has 64 padding vocab
  rows with the largest logits;
* gpt2: learned positions, fused Conv1D c_attn, tied embeddings, another tokenizer.

Drafts other than the mixed pair's are perturbed copies of the target, so they accept
some candidates and reject others.
"""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import EOS, make_other_tokenizer, make_tokenizer, pad_vocab, perturbed_copy, save_family, save_llama, save_model

torch = pytest.importorskip("torch")

from specrt import Engine, GenerationConfig  # noqa: E402
from specrt.export.arch import REGISTRY, UnsupportedModelError, spec_for  # noqa: E402
from specrt.export.onnx_export import PARITY_TOL, load_hf, parity_check  # noqa: E402
from specrt.export.pipeline import PairError, export_pair, vocab_hash  # noqa: E402
from specrt.runtime.errors import EngineError  # noqa: E402
from specrt.runtime.manifest import load_manifest  # noqa: E402

FAMILIES = ["llama", "mistral", "qwen2", "phi3", "gpt2"]
MAX_CTX, K_MAX, PAD = 256, 8, 64
PROMPTS = ["def add(a, b):", "for i in range(10):\n    print(i)\n" * 2]
PARITY_KEYS = {f"{kind}_q{q}_L{p}" for kind in ("logits", "kv") for q in (1, K_MAX + 1) for p in (0, 37)}


def _build(family: str, root, tok, tok2):
    """Save the checkpoints of ``family``'s pair and export it; returns (draft, target, engine) dirs."""
    d, t, e = root / "draft", root / "target", root / "engine"
    if family == "llama":
        save_llama(t, tok, seed=21, hidden=64, layers=2)
        save_family(d, tok, "gpt2", seed=22, n_embd=32, n_head=2, n_layer=2, n_inner=64, scale_attn_by_inverse_layer_idx=True)
    else:
        use = tok2 if family == "gpt2" else tok
        target = save_family(t, use, family, seed=31)
        draft = perturbed_copy(target, seed=32, scale=0.15)
        if family == "phi3":
            pad_vocab(draft, PAD, boost=10.0, seed=33)
        save_model(d, draft, use)
    export_pair(d, t, e, k_max=K_MAX, max_ctx=MAX_CTX, log=lambda *_: None)
    return d, t, e


@pytest.fixture(scope="module")
def toks():
    return make_tokenizer(), make_other_tokenizer()


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, toks):
    """``pairs(family)`` -> (draft_dir, target_dir, engine_dir), built once per module."""
    root = tmp_path_factory.mktemp("arch")
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = _build(family, root / family, *toks)
        return cache[family]

    return get


def hf_greedy(model_dir, ids, n):
    hf = load_hf(model_dir)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=hf.config.eos_token_id)
    return out[0, len(ids) :].tolist()


# ---- per family: parity and greedy equality -------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_exported_logits_and_kv_match_pytorch(pairs, family):
    draft_dir, target_dir, engine_dir = pairs(family)
    m = load_manifest(engine_dir)
    assert m.target.family == family
    assert m.draft.family == ("gpt2" if family == "llama" else family)
    for entry in (m.draft, m.target):  # figures measured at export
        assert set(entry.parity) == PARITY_KEYS
        for key, diff in entry.parity.items():
            assert 0.0 <= diff <= (PARITY_TOL if key.startswith("logits") else 10 * PARITY_TOL), (entry.family, key, diff)
    # measured again here on fresh random tokens
    for model_dir, name in ((target_dir, "target.onnx"), (draft_dir, "draft.onnx")):
        figures = parity_check(load_hf(model_dir), engine_dir / name, qs=(1, K_MAX + 1), pasts=(0, 37), seed=7)
        assert set(figures) == PARITY_KEYS
        assert max(v for k, v in figures.items() if k.startswith("logits")) <= PARITY_TOL
        assert max(v for k, v in figures.items() if k.startswith("kv")) <= 10 * PARITY_TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_equals_target_only_and_hf(pairs, family):
    _, target_dir, engine_dir = pairs(family)
    engine = Engine(engine_dir)
    proposed = accepted = 0
    for prompt in PROMPTS:
        ids = engine.prompt_ids(prompt)
        base = engine.generate(ids, GenerationConfig(max_new_tokens=40, speculative=False))
        assert len(base.tokens) == 40 or base.tokens[-1] == engine.manifest.eos_token_id
        assert base.tokens == hf_greedy(target_dir, ids, 40)
        for k in (1, 4, K_MAX):
            spec = engine.generate(ids, GenerationConfig(max_new_tokens=40, k_max=k, threshold=0.0))
            assert spec.tokens == base.tokens, (prompt, k)
            assert spec.text == base.text
            proposed += spec.stats.proposed
            accepted += spec.stats.accepted
    assert proposed > 0
    if family != "llama":  # perturbed-copy drafts: some accepted, some rejected
        assert 0 < accepted < proposed


# ---- pair compatibility ---------------------------------------------------------------
def test_mixed_pair_gpt2_draft_llama_target_records_one_tokenizer(pairs, toks):
    _, target_dir, engine_dir = pairs("llama")
    m = load_manifest(engine_dir)
    assert (m.draft.family, m.target.family) == ("gpt2", "llama")
    h = vocab_hash(engine_dir / "tokenizer.json")
    assert m.draft.vocab_hash == m.target.vocab_hash == h == vocab_hash(target_dir / "tokenizer.json")
    eos = toks[0].token_to_id(EOS)
    assert m.vocab_size == toks[0].get_vocab_size() == m.draft.vocab_size == m.target.vocab_size
    assert (m.eos_token_id, m.bos_token_id) == (eos, eos)
    assert m.pad_token_id is None  # neither the Llama config nor the tokenizer has one


def test_padded_draft_never_proposes_a_padded_id(pairs):
    _, target_dir, engine_dir = pairs("phi3")
    engine = Engine(engine_dir)
    m = engine.manifest
    vocab = m.vocab_size
    assert m.draft.vocab_size == vocab + PAD and m.target.vocab_size == vocab
    assert m.pad_token_id == m.eos_token_id  # recorded from the Phi-3 config
    ids = engine.prompt_ids(PROMPTS[0])
    raw = engine.draft.run(ids, 0).copy()  # [q, vocab + PAD]
    assert (raw.argmax(axis=1) >= vocab).all()  # the padding rows do have the largest logits
    sent = []
    orig = engine.target.run

    def record(tokens, start):
        sent.extend(int(t) for t in tokens)
        return orig(tokens, start)

    base = engine.generate(ids, GenerationConfig(max_new_tokens=40, speculative=False)).tokens
    engine.target.run = record
    try:
        spec = engine.generate(ids, GenerationConfig(max_new_tokens=40, k_max=K_MAX, threshold=0.0))
    finally:
        engine.target.run = orig
    assert spec.stats.proposed > 0 and spec.stats.accepted > 0
    assert max(sent) < vocab  # candidates (and committed tokens) never hit a padded id
    assert spec.tokens == base == hf_greedy(target_dir, ids, 40)


def test_different_tokenizers_refused_at_export(pairs, tmp_path):
    other_draft, _, _ = pairs("gpt2")  # saved with the other tokenizer
    _, llama_target, _ = pairs("llama")
    with pytest.raises(PairError) as err:
        export_pair(other_draft, llama_target, tmp_path / "e", k_max=K_MAX, max_ctx=MAX_CTX, log=lambda *_: None)
    msg = str(err.value)
    assert "tokenizers differ" in msg
    assert "only in the draft" in msg and "only in the target" in msg and "different ids" in msg
    assert not list(tmp_path.glob("e/*"))  # refused before anything was exported


def test_different_tokenizers_refused_at_load(pairs, tmp_path):
    _, _, llama_engine = pairs("llama")
    _, _, gpt2_engine = pairs("gpt2")
    mixed = tmp_path / "mixed"
    shutil.copytree(llama_engine, mixed)
    other = json.loads((gpt2_engine / "manifest.json").read_text())
    manifest = json.loads((mixed / "manifest.json").read_text())
    # same widths, so only the recorded tokenizer hashes tell them apart
    assert other["draft"]["vocab_size"] == manifest["draft"]["vocab_size"] == manifest["vocab_size"]
    assert other["draft"]["vocab_hash"] != manifest["target"]["vocab_hash"]
    shutil.copyfile(gpt2_engine / other["draft"]["file"], mixed / "draft.onnx")
    manifest["draft"] = dict(other["draft"], file="draft.onnx")
    (mixed / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EngineError) as err:
        Engine(mixed)
    msg = str(err.value)
    assert "different tokenizers" in msg and "specrt export" in msg
    assert other["draft"]["vocab_hash"][:12] in msg and manifest["target"]["vocab_hash"][:12] in msg
    # manifests written before the hashes were recorded still load
    legacy = tmp_path / "legacy"
    shutil.copytree(llama_engine, legacy)
    raw = json.loads((legacy / "manifest.json").read_text())
    for role in ("draft", "target"):
        del raw[role]["vocab_hash"]
    del raw["pad_token_id"]
    (legacy / "manifest.json").write_text(json.dumps(raw))
    assert load_manifest(legacy).draft.vocab_hash == ""


def test_logit_width_below_the_tokenizer_is_refused(toks, tmp_path):
    tok = toks[0]
    save_llama(tmp_path / "t", tok, seed=1, hidden=32, layers=1, heads=2, kv_heads=1, inter=64)
    save_family(tmp_path / "d", tok, "gpt2", seed=2, n_embd=32, n_head=2, n_layer=1, vocab_size=tok.get_vocab_size() - 8)
    with pytest.raises(PairError, match=r"draft .* vocab_size=312 logits but the shared tokenizer has 320 ids"):
        export_pair(tmp_path / "d", tmp_path / "t", tmp_path / "e", k_max=K_MAX, max_ctx=MAX_CTX, log=lambda *_: None)


# ---- sliding window, RoPE and registry refusals (config-level) -----------------------------
def test_sliding_window_below_max_ctx_is_refused_at_export(toks, tmp_path):
    tok = toks[0]
    save_family(tmp_path / "m", tok, "mistral", seed=3, num_hidden_layers=1, sliding_window=64)
    with pytest.raises(UnsupportedModelError, match=r"sliding_window=64 < max_ctx=256.*--max-ctx 64"):
        export_pair(tmp_path / "m", tmp_path / "m", tmp_path / "e", k_max=K_MAX, max_ctx=MAX_CTX, log=lambda *_: None)
    assert not (tmp_path / "e").exists() or not list((tmp_path / "e").glob("*.onnx"))


def test_sliding_window_rules():
    import transformers as tf

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2)
    m = tf.MistralConfig(**small, sliding_window=256)
    assert spec_for(m, 256).family == "mistral"  # window covers every position: full attention
    with pytest.raises(UnsupportedModelError, match="sliding_window=255 < max_ctx=256"):
        spec_for(tf.MistralConfig(**small, sliding_window=255), 256)
    q_sliding = tf.Qwen2Config(**small, use_sliding_window=True, sliding_window=64, max_window_layers=1)
    with pytest.raises(UnsupportedModelError, match="sliding_window=64"):
        spec_for(q_sliding, 256)
    q_full = tf.Qwen2Config(**small, use_sliding_window=True, sliding_window=64, max_window_layers=2)
    assert q_full.layer_types == ["full_attention", "full_attention"]
    assert spec_for(q_full, 256).family == "qwen2"  # no layer actually slides
    assert spec_for(tf.Qwen2Config(**small, use_sliding_window=False, sliding_window=64), 256).family == "qwen2"


def test_rope_variants_read_or_refused():
    import transformers as tf

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1)
    cfg = tf.LlamaConfig(**small, max_position_embeddings=512)
    cfg.rope_parameters = {"rope_type": "proportional", "rope_theta": 10000.0}
    with pytest.raises(UnsupportedModelError, match=r"rope type 'proportional' is not supported; supported: default, linear"):
        spec_for(cfg, 256)
    for rope in (
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    ):
        cfg = tf.LlamaConfig(**small, max_position_embeddings=512, rope_parameters={**rope, "rope_theta": 5e5})
        assert spec_for(cfg, 512).family == "llama"
    dyn = tf.LlamaConfig(**small, max_position_embeddings=512, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    assert spec_for(dyn, 512).family == "llama"
    with pytest.raises(UnsupportedModelError, match="max_ctx=1024 > max_position_embeddings=512"):
        spec_for(dyn, 1024)
    from helpers import family_config

    phi = family_config("phi3", 64, 0)  # longrope, original context 256
    assert spec_for(phi, 256).family == "phi3"
    with pytest.raises(UnsupportedModelError, match=r"longrope with max_ctx=512 > original_max_position_embeddings=256"):
        spec_for(phi, 512)


def test_registry_refusals():
    import transformers as tf

    with pytest.raises(UnsupportedModelError) as err:
        spec_for(tf.GPTNeoXConfig(vocab_size=64, hidden_size=32, num_attention_heads=2, num_hidden_layers=1, intermediate_size=64), 64)
    assert "model_type='gpt_neox' is not supported; supported: gpt2, llama, mistral, phi3, qwen2" in str(err.value)
    assert sorted(REGISTRY) == sorted(FAMILIES)
    with pytest.raises(UnsupportedModelError, match="add_cross_attention=True"):
        spec_for(tf.GPT2Config(n_embd=32, n_head=2, n_layer=1, add_cross_attention=True), 64)
    with pytest.raises(UnsupportedModelError, match="max_ctx=2048 > max_position_embeddings=1024"):
        spec_for(tf.GPT2Config(n_embd=32, n_head=2, n_layer=1), 2048)  # learned positions end at n_positions
