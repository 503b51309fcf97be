"""Text <-> token ids with the engine folder's ``tokenizer.json`` (Hugging Face ``tokenizers``).

The same ids go to the draft, the target and the target-only baseline: BOS is prepended
only when the manifest says so (``add_bos``), and special-token text inside a prompt
(e.g. ``<|endoftext|>``) maps to its special id, as Hugging Face tokenizers do.

Decoding leaves special tokens out. The output text is not ``decode(output ids)`` but the
completion text of :mod:`specrt.runtime.textstream`, which needs :attr:`TextCodec.special_ids`
and :attr:`TextCodec.context_ids`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .errors import EngineError, InputError

__all__ = ["TextCodec", "CONTEXT_PROBES"]

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

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (list of int), BOS first when the manifest asks for it.

        Raises:
            InputError: ``text`` is not encodable Unicode (a lone surrogate such as
                ``"\\ud800"``, which has no UTF-8 form).
        """
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        except TypeError:  # tokenizers refuses str values with lone surrogates this way
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InputError(f"prompt text is not valid Unicode: {e.reason} at index {e.start} ({text[e.start]!r})") from None
            raise
        return [self.bos, *ids] if self.bos is not None else list(ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens (BOS/EOS) left out."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (special tokens included)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)
