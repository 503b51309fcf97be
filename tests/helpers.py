"""Builders for tiny random-weight pairs (no hub): a byte-level BPE tokenizer and Llama models."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

EOS = "<|endoftext|>"
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i)\n",
    "class Foo:\n    def __init__(self, x):\n        self.x = x\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    main()\n",
    "héllo wörld — ünïcode ✓ 日本語\n",
]


def make_tokenizer(vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    return tok


# the tiny pair's chat template (tests/conftest.py tiny_pair): BOS written by the template,
# a raise_exception for roles it does not know, trim_blocks/lstrip_blocks-sensitive layout
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('this template knows no role ' ~ message['role']) }}"
    "{% endif %}\n"
    "<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def save_llama(out: Path, tok, seed: int, hidden=64, layers=2, heads=4, kv_heads=2, inter=128, vocab_pad=0, max_pos=512, chat_template=None):
    """Save a random LlamaForCausalLM + tokenizer (with ``chat_template`` when given) as a HF
    checkpoint folder; returns the model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    eos = tok.token_to_id(EOS)
    cfg = LlamaConfig(
        vocab_size=tok.get_vocab_size() + vocab_pad,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos,
        bos_token_id=eos,
        eos_token_id=eos,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    # sharper, more varied logits than the default init so greedy paths are non-trivial
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, chat_template=chat_template).save_pretrained(out)
    return model


# ---- other architecture families (tiny random weights, no hub) -------------------------
OTHER_CORPUS = [
    "SELECT name, age FROM users WHERE age > 30 ORDER BY name;\n",
    "<html><body><p>Hello</p></body></html>\n",
    "fn main() { let v: Vec<u32> = (0..10).collect(); }\n",
    "The quick brown fox jumps over the lazy dog.\n",
]


def make_other_tokenizer(vocab_size: int = 320):
    """A byte-level BPE with the same size as :func:`make_tokenizer` but trained on another
    corpus, so its token -> id map differs (for the mismatched-tokenizer tests)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(OTHER_CORPUS * 20, trainer=trainer)
    return tok


def family_config(family: str, vocab: int, eos: int, **overrides):
    """A tiny HF config of ``family`` (llama, mistral, qwen2, phi3, gpt2); ``overrides`` win.

    Defaults exercise what differs per family: Mistral an explicit head_dim and a sliding
    window larger than the test contexts; Qwen2 attention biases, tied embeddings and one
    sliding layer (window 512); Phi-3 fused qkv/gate_up, partial rotary (0.75) and
    longrope (original context 256); GPT-2 learned positions, fused Conv1D c_attn, tied
    embeddings.
    """
    import transformers as tf

    common = dict(vocab_size=vocab, bos_token_id=eos, eos_token_id=eos)
    if family == "gpt2":
        # a larger init than GPT-2's 0.02: with tied embeddings a tiny random model otherwise
        # just repeats its input token (the embedding dominates the residual stream)
        kw = dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, n_inner=128, initializer_range=0.4, **common)
        kw.update(overrides)
        return tf.GPT2Config(**kw)
    kw = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        **common,
    )
    if family == "llama":
        cls = tf.LlamaConfig
    elif family == "mistral":
        cls = tf.MistralConfig
        kw.update(head_dim=32, sliding_window=4096)
    elif family == "qwen2":
        cls = tf.Qwen2Config
        kw.update(tie_word_embeddings=True, initializer_range=0.3, use_sliding_window=True, sliding_window=512, max_window_layers=1, rope_theta=1e6)
    elif family == "phi3":
        cls = tf.Phi3Config
        rot_half = int(16 * 0.75) // 2  # head_dim 16, partial rotary 0.75
        kw.update(
            max_position_embeddings=1024,
            original_max_position_embeddings=256,  # Phi3Config copies it into rope_parameters
            pad_token_id=eos,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=10000.0,
                partial_rotary_factor=0.75,
                original_max_position_embeddings=256,
                short_factor=[1.0 + 0.1 * i for i in range(rot_half)],
                long_factor=[2.0 + 0.5 * i for i in range(rot_half)],
            ),
        )
    else:
        raise ValueError(f"family={family!r}; known: llama, mistral, qwen2, phi3, gpt2")
    kw.update(overrides)
    return cls(**kw)


def save_family(out: Path, tok, family: str, seed: int, vocab_pad: int = 0, **overrides):
    """Save a random ``family`` causal LM + tokenizer as a HF checkpoint folder; returns the model.

    Untied output weights are sharpened (x8) so greedy paths are non-trivial (tied ones get
    a larger init in :func:`family_config` instead); projection biases (Qwen2 q/k/v, GPT-2)
    get random values so they matter numerically.
    """
    import torch
    from transformers import AutoModelForCausalLM

    eos = tok.token_to_id(EOS)
    cfg = family_config(family, tok.get_vocab_size() + vocab_pad, eos, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        if not cfg.tie_word_embeddings:
            model.get_output_embeddings().weight.mul_(8.0)
        for name, p in model.named_parameters():
            if name.endswith(".bias") and ("proj" in name or ".c_" in name):
                p.normal_(0.0, 0.5)
    model.eval()
    save_model(out, model, tok)
    return model


def qwen2_style(tok):
    """A copy of ``tok`` with the normalizer (NFC) and split regex that transformers'
    ``Qwen2Tokenizer`` imposes on every ``model_type=qwen2`` folder, so that ``AutoTokenizer``
    and the saved tokenizer.json agree (the export refuses a folder where they do not)."""
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    t = Tokenizer.from_str(tok.to_str())
    t.normalizer = normalizers.NFC()
    t.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    return t


def save_model(out: Path, model, tok) -> None:
    """Write ``model`` and ``tok`` (EOS doubling as BOS) to the checkpoint folder ``out``
    (for Qwen2 models ``tok`` in :func:`qwen2_style`)."""
    from transformers import PreTrainedTokenizerFast

    if model.config.model_type == "qwen2":
        tok = qwen2_style(tok)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS).save_pretrained(out)


def perturbed_copy(model, seed: int, scale: float = 0.35):
    """A deep copy of ``model`` with Gaussian noise (``scale`` x each tensor's std) added:
    a draft that agrees with ``model`` often but not always."""
    import copy

    import torch

    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            if p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    return draft


def pad_vocab(model, n_pad: int, boost: float = 10.0, seed: int = 0):
    """Grow ``model``'s vocab by ``n_pad`` padding rows whose output weights are ``boost`` x
    random real rows, so the padded ids get the largest logits; returns the model."""
    import torch

    v = model.config.vocab_size
    model.resize_token_embeddings(v + n_pad, mean_resizing=False)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, v, (n_pad,), generator=g)
    with torch.no_grad():
        w = model.get_output_embeddings().weight
        w[v:] = boost * w[idx]
    return model


# ---- the acceptance loop on explicit logits / probabilities (unit tests of Algorithm 1) ----
def greedy_verify(cands, logits, vocab):
    """decode.verify with the greedy acceptor over one block of target logits [n+1, V]."""
    from specrt.runtime.decode import verify
    from specrt.runtime.speculative import GreedyAcceptor

    return verify(list(cands), [(0, logits)], GreedyAcceptor(vocab, logits.shape[-1]))


def speculative_verify(cands, q_rows, p_rows, rng, work=None):
    """decode.verify with the sampled acceptor over explicit draft (q [n, W]) and target
    (p [n+1, W]) probabilities, one block (Leviathan et al. 2023, Algorithm 1)."""
    import numpy as np

    from specrt.runtime.decode import verify
    from specrt.runtime.sampling import SampledAcceptor

    acc = SampledAcceptor.over_probabilities(np.asarray(q_rows, np.float64).reshape(len(cands), -1) if len(cands) else np.zeros((1, np.shape(p_rows)[-1])), rng)
    return verify(list(cands), [(0, p_rows)], acc)


# ---- tiny random models around a real vocabulary (tests/test_real_vocabs.py) ------------
def save_vocab_model(tok_dir: Path, out: Path, seed: int, family: str = "llama", hidden: int = 32, layers: int = 1):
    """Save a tiny random ``family`` (llama or qwen2) causal LM with the tokenizer files of
    ``tok_dir`` (a converted real vocabulary) as a HF checkpoint folder; returns the model.

    vocab_size = the tokenizer's size rounded up to a multiple of 64 (real checkpoints pad
    alike; rows past the tokenizer are padding); BOS/EOS/pad from the tokenizer. Untied output
    weights, sharpened (x8) so that greedy outputs wander over the vocabulary.
    """
    import json
    import shutil

    import torch
    from tokenizers import Tokenizer
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tok = Tokenizer.from_file(str(Path(tok_dir) / "tokenizer.json"))  # AutoTokenizer would take seconds at 128k ids
    names = json.loads((Path(tok_dir) / "tokenizer_config.json").read_text())
    bos, eos, pad = (tok.token_to_id(names[k]) if names.get(k) else None for k in ("bos_token", "eos_token", "pad_token"))
    pad = eos if pad is None else pad
    cfg_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[family]
    cfg = cfg_cls(
        vocab_size=(tok.get_vocab_size(with_added_tokens=True) + 63) // 64 * 64,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=pad, do_sample=False).save_pretrained(out)
    for f in Path(tok_dir).iterdir():
        if f.is_file():
            shutil.copy2(f, out / f.name)
    return model


# ---- scripted models: both predict a given continuation (text and grouping tests) ----------
@contextmanager
def scripted(engine, prompt_ids, continuation, wrong=(), calls=None):
    """Make both models predict ``prompt_ids + continuation`` with one-hot logits.

    The draft is wrong (proposes another token) at the absolute positions in ``wrong``,
    so those rounds roll back; elsewhere it is right, so rounds commit several tokens.
    ``calls`` collects (model name, start, q) of every run.
    """
    import numpy as np

    full = list(prompt_ids) + list(continuation)
    filler = engine.codec.tokenizer.token_to_id(".")
    max_ctx = engine.manifest.max_ctx
    saved = {}
    for name in ("target", "draft"):
        model = getattr(engine, name)
        saved[name] = model.run
        buf = np.zeros((model.max_q, model.vocab), np.float32)

        def run(tokens, start, _name=name, _buf=buf):
            q = len(tokens)
            assert start + q <= max_ctx, (_name, start, q)
            if calls is not None:
                calls.append((_name, start, q))
            _buf[:q] = 0.0
            for i in range(q):
                pos = start + i + 1
                t = full[pos] if pos < len(full) else filler
                if _name == "draft" and pos in wrong:
                    t = filler if t != filler else filler + 1
                _buf[i, t] = 30.0
            return _buf[:q]

        model.run = run
    engine.cached = None  # the scripted calls write no real KV: no record may cross in or out
    try:
        yield full
    finally:
        engine.cached = None
        for name, f in saved.items():
            getattr(engine, name).run = f
