"""Text <-> token ids with the engine folder's ``tokenizer.json`` (Hugging Face ``tokenizers``).

The same ids go to the draft, the target and the target-only baseline: BOS is prepended
only when the manifest says so (``add_bos``), and special-token text inside a prompt
(e.g. ``<|endoftext|>``) maps to its special id, as Hugging Face tokenizers do.

Decoding leaves special tokens out. The output text is not ``decode(output ids)`` but the
completion text of :mod:`specrt.runtime.textstream`, which needs :attr:`TextCodec.special_ids`
and :attr:`TextCodec.context_ids`.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Sequence

from .errors import EngineError, InputError

__all__ = ["TextCodec", "byte_level_decoder", "CONTEXT_PROBES"]


@lru_cache(maxsize=1)
def byte_level_decoder() -> dict[str, int]:
    """The inverse of GPT-2's ``bytes_to_unicode`` table (character -> byte), the alphabet
    of byte-level BPE vocabularies (GPT-2, Llama 3, Qwen, the default pair).

    Source: openai/gpt-2 ``encoder.py`` ``bytes_to_unicode``; Hugging Face ``tokenizers``
    ``ByteLevel`` pre-tokenizer.
    """
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


# plain texts tried, in order, for the decode context of the completion text
CONTEXT_PROBES = ("a", "x", "0", ".", "A", "the", "Hello")


class TextCodec:
    """Encode prompts and decode outputs.

    Args:
        path: ``tokenizer.json``.
        bos_token_id: id prepended when ``add_bos`` (None if the model has no BOS).
        add_bos: whether prompts start with BOS.

    Attributes:
        tokenizer: the ``tokenizers.Tokenizer``.
        bos: the id prepended to text prompts, or None.
        special_ids: frozenset of the ids :meth:`decode` leaves out (added tokens marked
            special: BOS, EOS, pad, chat markers).
        context_ids: list of ids of a short plain text (``"a"`` for every vocabulary seen so
            far) that decodes alone to text without U+FFFD and is not changed by what
            follows it: the decode context of :class:`~specrt.runtime.textstream.CompletionText`.
            Empty when no probe qualifies (then a SentencePiece first token's space may be
            dropped at every character boundary; no known vocabulary gets there).

    Raises:
        EngineError: the tokenizer file cannot be read.
    """

    def __init__(self, path: Path, bos_token_id: int | None, add_bos: bool):
        from tokenizers import Tokenizer

        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception subclass
            raise EngineError(f"{path}: cannot read the tokenizer ({e})") from None
        self.bos = bos_token_id if add_bos else None
        self._byte_level = type(self.tokenizer.decoder).__name__ == "ByteLevel"
        self._special = {t.content for t in self.tokenizer.get_added_tokens_decoder().values()}
        self._max_token_bytes: int | None = None
        self.special_ids = frozenset(i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special)
        self.context_ids = self._find_context()

    def _find_context(self) -> list[int]:
        """The first of :data:`CONTEXT_PROBES` whose ids decode to non-empty text without
        U+FFFD, with no special id, and whose text stays a prefix when the ids repeat."""
        for probe in CONTEXT_PROBES:
            ids = self.tokenizer.encode(probe, add_special_tokens=False).ids
            if not ids or any(i in self.special_ids for i in ids):
                continue
            t = self.decode(ids)
            if t and "\ufffd" not in t and self.decode(ids + ids).startswith(t):
                return list(ids)
        return []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (list of int), BOS first when the manifest asks for it and
        ``add_special_tokens`` (False: the text alone, as transformers' ``apply_chat_template``
        tokenizes a rendered chat, whose template writes any BOS itself).

        Raises:
            InputError: ``text`` is not encodable Unicode (a lone surrogate such as
                ``"\\ud800"``, which has no UTF-8 form).
        """
        try:
            # encode_batch releases the GIL while it works (encode holds it): a long prompt
            # tokenized in a server's executor thread then does not stall its event loop
            ids = self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        except TypeError:  # tokenizers refuses str values with lone surrogates this way
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InputError(f"prompt text is not valid Unicode: {e.reason} at index {e.start} ({text[e.start]!r})") from None
            raise
        return [self.bos, *ids] if self.bos is not None and add_special_tokens else list(ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens (BOS/EOS) left out."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes one token stands for (OpenAI's ``bytes`` of a logprob entry).

        Byte-level BPE vocabularies: the exact bytes (the token's string through the inverse
        of the byte-level alphabet, :func:`byte_level_decoder`), so a token holding part of a
        multi-byte character gives those bytes. Special/added tokens: their text. Other
        tokenizers: the UTF-8 of the token decoded alone (an approximation: partial
        characters decode to U+FFFD there).
        """
        tok = self.tokenizer.id_to_token(int(token_id))
        if tok is None:
            return b""
        if tok in self._special:
            return tok.encode("utf-8")
        if self._byte_level:
            table = byte_level_decoder()
            if all(c in table for c in tok):
                return bytes(table[c] for c in tok)
        return self.tokenizer.decode([int(token_id)], skip_special_tokens=False).encode("utf-8")

    def token_text(self, token_id: int) -> str:
        """One token as text for logprob listings: its bytes as UTF-8 when they are valid
        UTF-8, else ``"bytes:\\xNN..."`` (the form OpenAI's API uses for partial characters)."""
        b = self.token_bytes(token_id)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{x:02x}" for x in b)

    @property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes any one token stands for (computed once over the vocabulary)."""
        if self._max_token_bytes is None:
            self._max_token_bytes = max(1, max(len(self.token_bytes(i)) for i in range(self.vocab_size)))
        return self._max_token_bytes

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (special tokens included)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)
