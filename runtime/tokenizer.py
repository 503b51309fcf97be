"""Text <-> token ids with the engine folder's ``tokenizer.json`` (Hugging Face ``tokenizers``).

The same ids go to the draft, the target and the target-only baseline: BOS is prepended
only when the manifest says so (``add_bos``), and special-token text inside a prompt
(e.g. ``<|endoftext|>``) maps to its special id, as Hugging Face tokenizers do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .errors import EngineError, InputError

__all__ = ["TextCodec"]


class TextCodec:
    """Encode prompts and decode outputs.

    Args:
        path: ``tokenizer.json``.
        bos_token_id: id prepended when ``add_bos`` (None if the model has no BOS).
        add_bos: whether prompts start with BOS.

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
