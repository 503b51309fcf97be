"""Builders for tiny random-weight pairs (no hub): a byte-level BPE tokenizer and Llama models."""
from __future__ import annotations

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
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    return tok


def save_llama(out: Path, tok, seed: int, hidden=64, layers=2, heads=4, kv_heads=2, inter=128, vocab_pad=0, max_pos=512):
    """Save a random LlamaForCausalLM + tokenizer as a HF checkpoint folder; returns the model."""
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
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS).save_pretrained(out)
    return model
