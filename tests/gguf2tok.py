"""A llama.cpp vocabulary GGUF -> ``tokenizer.json`` + ``tokenizer_config.json`` (test
infrastructure): the product's conversion (:mod:`specrt.export.gguf_tokenizer`, the
tokenizer ``specrt serve --target X.gguf`` builds from the file's metadata) saved with
transformers' ``save_pretrained``, so the folder also serves as a Hugging Face checkpoint's
tokenizer for the tests' exports. Qwen2.5-Coder's added tokens on Qwen2's vocabulary:
:func:`qwen25_coder`.
"""

from __future__ import annotations

from pathlib import Path

from specrt.export.gguf_tokenizer import SPLITS, read_tokenizer_meta, tokenizer_from_gguf

__all__ = ["convert", "read_gguf", "SPLITS"]


def read_gguf(path: Path) -> dict:
    """The tokenizer metadata of a GGUF (``tokenizer.*`` keys and ``general.architecture``)."""
    return read_tokenizer_meta(path)


def convert(gguf: Path, out: Path) -> dict:
    """Write ``out/tokenizer.json`` and ``tokenizer_config.json`` (and ``chat_template.jinja``
    when the GGUF has a template) with transformers' ``save_pretrained``.

    Returns:
        facts of the conversion: ``arch``, ``model``, ``pre``, ``n_tokens``, ``bos``/``eos``
        (token text, id), ``add_bos``.

    Raises:
        UnsupportedModelError: a tokenizer kind other than ``gpt2``/``llama``, or an unknown ``pre``.
    """
    from transformers import TokenizersBackend

    m = read_gguf(Path(gguf))
    g = tokenizer_from_gguf(gguf, m)
    tokens = m["tokenizer.ggml.tokens"]
    text = {k: (tokens[i] if i is not None else None) for k, i in (("bos", g.bos), ("eos", g.eos), ("unknown", g.unk), ("padding", g.pad))}
    hf = TokenizersBackend(
        tokenizer_object=g.tokenizer,
        bos_token=text["bos"],
        eos_token=text["eos"],
        unk_token=text["unknown"],
        pad_token=text["padding"],
        chat_template=g.chat_template,
        add_bos_token=g.add_bos,
        add_eos_token=g.add_eos,
    )
    Path(out).mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out))
    return {
        "arch": m["general.architecture"],
        "model": g.kind,
        "pre": g.pre,
        "n_tokens": g.n_tokens,
        "bos": (text["bos"], g.bos),
        "eos": (text["eos"], g.eos),
        "add_bos": g.add_bos,
    }


# Qwen2.5's added tokens past Qwen2's three (id, text, special), from Qwen2.5-Coder's
# tokenizer_config.json added_tokens_decoder; Qwen2's GGUF has "[PAD<id>]" at these ids
QWEN25_ADDED = (
    *(
        (151646 + i, f"<|{n}|>", True)
        for i, n in enumerate(
            "object_ref_start object_ref_end box_start box_end quad_start quad_end vision_start vision_end vision_pad image_pad video_pad".split()
        )
    ),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    *((151659 + i, f"<|{n}|>", False) for i, n in enumerate("fim_prefix fim_middle fim_suffix fim_pad repo_name file_sep".split())),
)


def qwen25_coder(qwen2: Path, out: Path, chat_template: Path | None = None) -> None:
    """Qwen2.5-Coder's tokenizer from Qwen2's converted one (``qwen2``, a :func:`convert`
    output folder): the same byte-level BPE vocabulary and merges, with the added tokens of
    :data:`QWEN25_ADDED` named at their ids (in the added tokens and the BPE vocabulary), EOS
    ``<|im_end|>`` as Qwen2.5's instruct models, and ``chat_template`` (if given) as its
    ``chat_template.jinja``. Written to ``out``."""
    import json
    import shutil

    d = json.loads((Path(qwen2) / "tokenizer.json").read_text(encoding="utf-8"))
    names = {i: (text, special) for i, text, special in QWEN25_ADDED}
    vocab = d["model"]["vocab"]
    for t in d["added_tokens"]:
        if t["id"] in names:
            vocab.pop(t["content"], None)
            t["content"], t["special"] = names[t["id"]]
            vocab[t["content"]] = t["id"]
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "tokenizer.json").write_text(json.dumps(d, ensure_ascii=False), encoding="utf-8")
    cfg = json.loads((Path(qwen2) / "tokenizer_config.json").read_text(encoding="utf-8"))
    cfg["eos_token"] = "<|im_end|>"
    (Path(out) / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    (Path(out) / "chat_template.jinja").unlink(missing_ok=True)
    if chat_template is not None:
        shutil.copyfile(chat_template, Path(out) / "chat_template.jinja")
