"""A llama.cpp vocabulary GGUF -> ``tokenizer.json`` + ``tokenizer_config.json``, faithful to
the model's own tokenizer (test infrastructure: the runtime never converts anything).

transformers 5 converts these files itself (``AutoTokenizer.from_pretrained(folder,
gguf_file=...)``), but on llama.cpp's test cases (``.inp``/``.out``) its result matches only
436 of 468 cases over the 10 vocabularies it accepts, for these reasons (all fixed here):

1. byte-level BPE: CONTROL tokens not spelled in the byte alphabet
   (``<｜begin▁of▁sentence｜>``) are respelled, then BOS/EOS are added again as *new* ids past
   the vocabulary (deepseek-coder: BOS 32013 -> 32257);
2. GPT2Tokenizer's default ``<|endoftext|>`` is added when the vocabulary lacks it (Llama-3:
   128256 ids -> 128257, one past the embedding);
3. the pre-tokenizer split (``tokenizer.ggml.pre``) is known only for the llama3/qwen2
   families: deepseek-coder, falcon and starcoder fall back to GPT-2's;
4. Llama-3's ``ignore_merges`` is not set, and its BOS (llama.cpp's default for llama3 when
   the GGUF has no ``add_bos_token`` flag) is lost;
5. SentencePiece (llama-spm): ``Metaspace(prepend_scheme="first")`` adds no dummy prefix to a
   text that already starts with a space (``" Hello"`` -> ``[15043]``, sentencepiece gives
   ``[29871, 15043]``); Llama-2's own tokenizer.json shape (normalizer ``Prepend("▁")`` +
   ``Replace(" ", "▁")``, no pre-tokenizer) is used instead;
6. a GGUF records no normalizer: Qwen2's tokenizer.json has NFC (and transformers'
   ``Qwen2Tokenizer`` imposes it), so NFC is added back for the qwen2 family.

Byte-level BPE (``tokenizer.ggml.model == "gpt2"``) is built with ``tokenizers`` directly;
SentencePiece-BPE (``"llama"``) with transformers' merges-from-scores and the normalizer of
point 5. The GGUF metadata is read with transformers' GGUF reader. The split regexes are
Hugging Face's original pre-tokenizers of each family, in the order llama.cpp applies them
(``llama-vocab.cpp``, ``LLAMA_VOCAB_PRE_TYPE_*``; each splits the pieces of the one before,
``isolated``). Other tokenizer kinds and ``pre`` values raise :class:`ValueError`.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["convert", "read_gguf", "SPLITS"]

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

# tokenizer.ggml.pre -> the split regexes (None: ByteLevel's own, i.e. GPT-2's)
SPLITS: dict[str, list[str] | None] = {
    "gpt-2": None,
    "default": None,
    "llama-bpe": [_LLAMA3],
    "llama3": [_LLAMA3],
    "qwen2": [_QWEN2],
    "deepseek-coder": ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}"],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"],
    "starcoder": [r"\p{N}", _GPT2],
}
NFC = {"qwen2"}  # Qwen2's tokenizer.json normalizes NFC; the GGUF does not say so
IGNORE_MERGES = {"llama-bpe", "llama3"}
ADD_BOS_DEFAULT = {"llama-bpe", "llama3"}  # llama.cpp adds BOS for these when the flag is absent
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types


def read_gguf(path: Path) -> dict:
    """The tokenizer metadata of a GGUF (``tokenizer.*`` keys and ``general.architecture``),
    read with transformers' GGUF reader (tokens, merges, types and scores in full)."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    keys = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")
    meta, _ = read_gguf_metadata(str(path), keys)
    return {k: v for k, v in meta.items() if k.startswith("tokenizer.") or k == "general.architecture"}


def _added_tokens(tokens: list[str], types: list[int]):
    """CONTROL tokens as special added tokens, USER_DEFINED as plain ones (their ids kept)."""
    from tokenizers import AddedToken

    out = []
    for t, ty in zip(tokens, types):
        if ty in (CONTROL, USER_DEFINED):
            out.append(AddedToken(t, special=ty == CONTROL, normalized=False))
    return out


def _bos_template(tok, bos: str | None, bos_id: int | None, add_bos: bool, eos: str | None, eos_id: int | None, add_eos: bool) -> None:
    """``TemplateProcessing`` that adds BOS/EOS as the GGUF says (``add_special_tokens=True``)."""
    from tokenizers import processors

    single, special = ["$A"], []
    if add_bos and bos is not None:
        single.insert(0, bos)
        special.append((bos, bos_id))
    if add_eos and eos is not None:
        single.append(eos)
        special.append((eos, eos_id))
    tok.post_processor = processors.TemplateProcessing(single=" ".join(single), pair=" ".join(single + ["$B:1"]), special_tokens=list(dict.fromkeys(special)))


def _byte_level_bpe(m: dict):
    """Byte-level BPE (GPT-2, Llama-3, Qwen2, DeepSeek, StarCoder, Falcon) built directly."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    tokens = list(m["tokenizer.ggml.tokens"])
    types = list(m.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # the same text twice: the first id wins
    merges = [tuple(x.split(" ", 1)) for x in m["tokenizer.ggml.merges"]]
    pre = m.get("tokenizer.ggml.pre", "default")
    if pre not in SPLITS:
        raise ValueError(f"no split rules for tokenizer.ggml.pre={pre!r}; known: {sorted(SPLITS)}")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in IGNORE_MERGES, fuse_unk=False))
    splits = SPLITS[pre]
    if splits:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=True)
    if pre in NFC:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens(_added_tokens(tokens, types))  # their texts are in the vocab: ids unchanged
    return tok


def _sentencepiece_bpe(m: dict):
    """SentencePiece-BPE (Llama-2, Phi-3): transformers' merges from the scores, byte
    fallback, sentencepiece's dummy prefix as a normalizer (Llama-2's own tokenizer.json)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import get_merges

    tokens = list(m["tokenizer.ggml.tokens"])
    types = list(m.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = get_merges({"tokens": tokens, "scores": list(m["tokenizer.ggml.scores"])})
    unk = m.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=tokens[unk] if unk is not None else None, byte_fallback=True, fuse_unk=True))
    prefix = m.get("tokenizer.ggml.add_space_prefix", True)
    norm = [normalizers.Replace(" ", "▁")]
    if prefix:
        norm.insert(0, normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(norm)
    tok.pre_tokenizer = None
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    tok.add_tokens(_added_tokens(tokens, types))
    return tok


def convert(gguf: Path, out: Path) -> dict:
    """Write ``out/tokenizer.json`` and ``tokenizer_config.json`` (and ``chat_template.jinja``
    when the GGUF has a template) with transformers' ``save_pretrained``.

    Returns:
        facts of the conversion: ``arch``, ``model``, ``pre``, ``n_tokens``, ``bos``/``eos``
        (token text, id), ``add_bos``.

    Raises:
        ValueError: a tokenizer kind other than ``gpt2``/``llama``, or an unknown ``pre``.
    """
    from transformers import TokenizersBackend

    m = read_gguf(Path(gguf))
    kind, pre = m.get("tokenizer.ggml.model"), m.get("tokenizer.ggml.pre", "default")
    if kind == "gpt2":
        tok = _byte_level_bpe(m)
    elif kind == "llama":
        tok = _sentencepiece_bpe(m)
    else:
        raise ValueError(f"{Path(gguf).name}: tokenizer.ggml.model={kind!r} is not converted here (gpt2, llama)")
    tokens = m["tokenizer.ggml.tokens"]
    ids = {k: m.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown", "padding")}
    text = {k: (tokens[i] if i is not None else None) for k, i in ids.items()}
    add_bos = m.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        add_bos = kind == "llama" or pre in ADD_BOS_DEFAULT
    add_eos = bool(m.get("tokenizer.ggml.add_eos_token", False))
    _bos_template(tok, text["bos"], ids["bos"], add_bos, text["eos"], ids["eos"], add_eos)
    hf = TokenizersBackend(
        tokenizer_object=tok,
        bos_token=text["bos"],
        eos_token=text["eos"],
        unk_token=text["unknown"],
        pad_token=text["padding"],
        chat_template=m.get("tokenizer.chat_template"),
        add_bos_token=add_bos,
        add_eos_token=add_eos,
    )
    Path(out).mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out))
    return {
        "arch": m["general.architecture"],
        "model": kind,
        "pre": pre,
        "n_tokens": len(tokens),
        "bos": (text["bos"], ids["bos"]),
        "eos": (text["eos"], ids["eos"]),
        "add_bos": bool(add_bos),
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
