"""A GGUF file's tokenizer, from the file's own metadata: a ``tokenizers`` Tokenizer, no
torch and no transformers.

llama.cpp's GGUF files carry their vocabulary (``tokenizer.ggml.tokens``, ``token_type``,
``merges`` or ``scores``) and how to split text before BPE (``tokenizer.ggml.pre``). This
module builds the equivalent Hugging Face ``tokenizer.json`` with the ``tokenizers`` library,
faithful to llama.cpp's own tokenization: its test cases (``ggml-vocab-*.gguf.inp/.out``)
are the oracle (tests/test_real_vocabs.py). transformers' own GGUF conversion
(``AutoTokenizer.from_pretrained(folder, gguf_file=...)``) matches 436 of 468 of those
cases over its 10 vocabularies; the differences fixed here:

1. byte-level BPE: CONTROL tokens are added with their ids (transformers respells those not in
   the byte alphabet and adds BOS/EOS again as new ids past the vocabulary);
2. no ``<|endoftext|>`` is added to a vocabulary without it (GPT2Tokenizer's default);
3. the split rules of every ``tokenizer.ggml.pre`` in :data:`SPLITS` (transformers knows
   the llama3 and qwen2 families only);
4. Llama-3's ``ignore_merges`` and its default BOS;
5. SentencePiece (``llama``): Llama-2's own normalizer (``Prepend("▁")`` +
   ``Replace(" ", "▁")``), so a text starting with a space still gets the dummy prefix;
6. NFC for the qwen2 family (Qwen2's tokenizer.json normalizes; the GGUF does not say so).

The split regexes are Hugging Face's original pre-tokenizers of each family, in the order
llama.cpp applies them (``src/llama-vocab.cpp``, ``LLAMA_VOCAB_PRE_TYPE_*``: each splits
the pieces of the one before, ``isolated``). Other tokenizer kinds and ``pre`` values are
refused in one line (:class:`~specrt.runtime.errors.UnsupportedModelError`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from specrt.runtime.errors import UnsupportedModelError

__all__ = ["SPLITS", "GgufTokenizer", "read_tokenizer_meta", "spm_merges", "tokenizer_from_gguf", "tokens_hash"]

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_STARCODER = [r"\p{N}", _GPT2]

# tokenizer.ggml.pre -> the split regexes (None: ByteLevel's own, i.e. GPT-2's); aliases
# as llama.cpp groups them (llama-vocab.cpp: SMOLLM, REFACT, ... share STARCODER's rules)
SPLITS: dict[str, list[str] | None] = {
    "gpt-2": None,
    "default": None,
    "mpt": None,
    "olmo": None,
    "llama-bpe": [_LLAMA3],
    "llama3": [_LLAMA3],
    "qwen2": [_QWEN2],
    "deepseek-coder": ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}"],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"],
    "starcoder": _STARCODER,
    "smollm": _STARCODER,
    "refact": _STARCODER,
    "codeshell": _STARCODER,
    "command-r": _STARCODER,
}
NFC = {"qwen2"}  # Qwen2's tokenizer.json normalizes NFC; the GGUF does not say so
IGNORE_MERGES = {"llama-bpe", "llama3"}
ADD_BOS_DEFAULT = {"llama-bpe", "llama3"}  # llama.cpp adds BOS for these when the flag is absent
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types
_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")


def read_tokenizer_meta(path: str | Path, reader=None) -> dict:
    """The tokenizer metadata of a GGUF file: every ``tokenizer.*`` key (arrays as lists:
    tokens and merges ``str``, token types ``int``, scores ``float``) and
    ``general.architecture``, read with the ``gguf`` package (``reader``: an open
    ``gguf.GGUFReader`` of that file, to read it once)."""
    if reader is None:
        import gguf

        reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.") or k == "general.architecture"}


def tokens_hash(meta: dict) -> str:
    """SHA-256 of the vocabulary of :func:`read_tokenizer_meta`'s ``meta``: tokens, types,
    merges (or scores) and the split rules; a draft must have the target's."""
    h = hashlib.sha256()
    for key in (*_ARRAYS, "tokenizer.ggml.model", "tokenizer.ggml.pre"):
        h.update(key.encode() + b"\0" + repr(meta.get(key)).encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()


def spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece-BPE vocabulary implies: every split of a token into two
    tokens, ordered by the token's score (highest first), then by the pieces' lengths, ties
    by the pieces' ids (Hugging Face's ``SentencePieceExtractor``; the same order as
    transformers' ``generate_merges``)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for merge, score in dict(zip(tokens, scores)).items():
        local = [(merge[:i], merge[i:], score) for i in range(1, len(merge)) if merge[:i] in vocab and merge[i:] in vocab]
        merges.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    merges.sort(key=lambda v: (v[2], len(v[0]), len(v[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _added_tokens(tokens: list[str], types: list[int]):
    """CONTROL tokens as special added tokens, USER_DEFINED as plain ones (their ids kept)."""
    from tokenizers import AddedToken

    return [AddedToken(t, special=ty == CONTROL, normalized=False) for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED)]


def _byte_level_bpe(m: dict, name: str):
    """Byte-level BPE (GPT-2, Llama-3, Qwen2, DeepSeek, StarCoder, Falcon, SmolLM)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    tokens = list(m["tokenizer.ggml.tokens"])
    types = list(m.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # the same text twice: the first id wins
    merges = [tuple(x.split(" ", 1)) for x in m.get("tokenizer.ggml.merges") or ()]
    pre = m.get("tokenizer.ggml.pre", "default")
    if pre not in SPLITS:
        raise UnsupportedModelError(f"{name}: tokenizer.ggml.pre={pre!r} has no split rules here; known: {', '.join(sorted(SPLITS))}", "tokenizer")
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


def _sentencepiece_bpe(m: dict, name: str):
    """SentencePiece-BPE (Llama-2, Phi-3): merges from the scores (:func:`spm_merges`), byte
    fallback, sentencepiece's dummy prefix as a normalizer (Llama-2's own tokenizer.json)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    tokens = list(m["tokenizer.ggml.tokens"])
    types = list(m.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = m.get("tokenizer.ggml.unknown_token_id")
    if unk is not None and not 0 <= int(unk) < len(tokens):
        raise UnsupportedModelError(f"{name}: tokenizer.ggml.unknown_token_id={unk} is outside its {len(tokens)} tokens", "tokenizer")
    if not m.get("tokenizer.ggml.scores"):
        raise UnsupportedModelError(f"{name}: a SentencePiece vocabulary without tokenizer.ggml.scores (its merges come from the scores)", "tokenizer")
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=spm_merges(tokens, list(m["tokenizer.ggml.scores"])),
            unk_token=tokens[int(unk)] if unk is not None else None,
            byte_fallback=True,
            fuse_unk=True,
        )
    )
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


@dataclass(frozen=True)
class GgufTokenizer:
    """A GGUF file's tokenizer and the facts the runtime needs beside it.

    Attributes:
        tokenizer: the ``tokenizers.Tokenizer`` (BOS/EOS added by its post-processor as the
            GGUF says, for ``add_special_tokens=True``).
        kind: ``tokenizer.ggml.model`` (``gpt2`` byte-level BPE, ``llama`` SentencePiece-BPE).
        pre: ``tokenizer.ggml.pre`` (``default`` when absent).
        n_tokens: vocabulary size (ids 0..n_tokens-1).
        bos, eos, unk, pad: token ids, or None.
        add_bos, add_eos: whether a prompt gets BOS prepended / EOS appended (the GGUF's
            flags; llama.cpp's default where absent: BOS for SentencePiece and Llama-3).
        chat_template: ``tokenizer.chat_template`` text, or None.
        vocab_hash: :func:`tokens_hash` of the metadata.
        end_ids: every id llama.cpp ends generation on for this vocabulary
            (:func:`specrt.export.gguf_import.end_of_generation_ids`).
    """

    tokenizer: object
    kind: str
    pre: str
    n_tokens: int
    bos: int | None
    eos: int | None
    unk: int | None
    pad: int | None
    add_bos: bool
    add_eos: bool
    chat_template: str | None
    vocab_hash: str
    end_ids: tuple[int, ...] = ()


def _post_processor(tok, tokens: list[str], bos: int | None, add_bos: bool, eos: int | None, add_eos: bool) -> None:
    """``TemplateProcessing`` that adds BOS/EOS as the GGUF says (``add_special_tokens=True``)."""
    from tokenizers import processors

    single, special = ["$A"], []
    if add_bos and bos is not None:
        single.insert(0, tokens[bos])
        special.append((tokens[bos], bos))
    if add_eos and eos is not None:
        single.append(tokens[eos])
        special.append((tokens[eos], eos))
    tok.post_processor = processors.TemplateProcessing(single=" ".join(single), pair=" ".join(single + ["$B:1"]), special_tokens=list(dict.fromkeys(special)))


def tokenizer_from_gguf(path: str | Path, meta: dict | None = None) -> GgufTokenizer:
    """The tokenizer of a GGUF file (``meta``: its :func:`read_tokenizer_meta`, when read).

    Raises:
        UnsupportedModelError: no vocabulary, a tokenizer kind other than ``gpt2``/``llama``,
            an unknown ``pre``, or a special token id outside the vocabulary (one line).
    """
    from .gguf_import import end_of_generation_ids

    name = Path(path).name
    m = read_tokenizer_meta(path) if meta is None else meta
    kind, pre = m.get("tokenizer.ggml.model"), m.get("tokenizer.ggml.pre", "default")
    tokens = m.get("tokenizer.ggml.tokens")
    if not tokens:
        raise UnsupportedModelError(f"{name} has no vocabulary (tokenizer.ggml.tokens); a GGUF made by llama.cpp's convert_hf_to_gguf.py has one", "tokenizer")
    if kind == "gpt2":
        tok = _byte_level_bpe(m, name)
    elif kind == "llama":
        tok = _sentencepiece_bpe(m, name)
    else:
        raise UnsupportedModelError(f"{name}: tokenizer.ggml.model={kind!r}; specrt converts gpt2 (byte-level BPE) and llama (SentencePiece-BPE)", "tokenizer")
    ids = {}
    for k in ("bos", "eos", "unknown", "padding"):
        v = m.get(f"tokenizer.ggml.{k}_token_id")
        if v is not None and not 0 <= int(v) < len(tokens):
            raise UnsupportedModelError(f"{name}: tokenizer.ggml.{k}_token_id={v} is outside its {len(tokens)} tokens", "tokenizer")
        ids[k] = None if v is None else int(v)
    add_bos = m.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        add_bos = kind == "llama" or pre in ADD_BOS_DEFAULT
    add_eos = bool(m.get("tokenizer.ggml.add_eos_token", False))
    _post_processor(tok, tokens, ids["bos"], bool(add_bos), ids["eos"], add_eos)
    return GgufTokenizer(
        tokenizer=tok,
        kind=kind,
        pre=pre,
        n_tokens=len(tokens),
        bos=ids["bos"],
        eos=ids["eos"],
        unk=ids["unknown"],
        pad=ids["padding"],
        add_bos=bool(add_bos),
        add_eos=add_eos,
        chat_template=m.get("tokenizer.chat_template"),
        vocab_hash=tokens_hash(m),
        end_ids=end_of_generation_ids(tokens, ids["eos"], m.get("tokenizer.ggml.eot_token_id"), m.get("tokenizer.ggml.eom_token_id")),
    )
