"""Text <-> token ids with the engine folder's ``tokenizer.json`` (Hugging Face ``tokenizers``).

The same ids go to the draft, the target and the target-only baseline: BOS is prepended
only when the manifest says so (``add_bos``), and special-token text inside a prompt
(e.g. ``<|endoftext|>``) maps to its special id, as Hugging Face tokenizers do
(:meth:`TextCodec.encode`: a ``/v1/completions`` prompt, a ``specrt generate`` prompt).

Text a client sends inside a structure (chat message content, tool results, tool-call
arguments, FIM prefix and suffix) is text: a control token's string there (``<|im_end|>``,
``<|fim_middle|>``) gets the ids of its characters, never the control id, so no content
can forge a role or a FIM layout. :meth:`TextCodec.encode_text` tokenizes such a string;
for a chat template, :meth:`TextCodec.escape` replaces control strings in each client
string by placeholders before rendering and :meth:`TextCodec.encode_escaped` tokenizes
the rendered text: the template's own control tokens get their ids, the placeholders their
text. A control token is an added token marked special, or one whose text looks like one
(llama.cpp's rule: ``convert_hf_to_gguf.py`` ``does_token_look_special``, and
``llama-vocab.cpp``, which makes the FIM tokens control tokens): :data:`LOOKS_CONTROL`.
Inside a chat's client strings the added tokens a template writes as markup are text too
(:attr:`TextCodec.markup_ids`: the control tokens and the tag-like added tokens,
:data:`LOOKS_MARKUP`, e.g. Qwen's ``<tool_call>``, ``</tool_response>``): a tool call
recorded in a history cannot close itself early. A ``/v1/completions`` prompt keeps them as
tokens (the model writes them so; llama.cpp reads them so).

Decoding leaves special tokens out. The output text is not ``decode(output ids)`` but the
completion text of :mod:`specrt.runtime.textstream`, which needs :attr:`TextCodec.special_ids`
and :attr:`TextCodec.context_ids`.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
from functools import lru_cache
from pathlib import Path
from typing import Sequence

from .errors import EngineError, InputError

__all__ = ["TextCodec", "byte_level_decoder", "CONTEXT_PROBES", "LOOKS_CONTROL", "LOOKS_MARKUP", "is_control_token"]


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

# added tokens that are control tokens whatever their "special" flag (llama.cpp's
# convert_hf_to_gguf.py does_token_look_special: "<|...|>", "<｜...｜>", "<unused...>",
# "<pad>", "<mask>", "<2mass>", "[@BOS@]"; llama-vocab.cpp's FIM/EOT names: "<fim_prefix>",
# "<fim-middle>", "<PRE>", "▁<SUF>", "<reponame>", ...), matched on the text without "▁"
LOOKS_CONTROL = re.compile(
    r"<\|.*\|>|<｜.*｜>|<unused.*>|<pad>|<mask>|<2mass>|\[@BOS@\]|<fim[-_].*>|<(?:PRE|SUF|MID|EOT|PAD|REPO)>|<reponame>|<filename>|<file_sep>",
    re.S,
)
_ESC = "\U000f0000"  # a placeholder's first character (plane-15 private use); escaped itself in client text
_CODE0 = 0xF0001  # a placeholder's second character: _CODE0 + index into (_ESC, *control strings)


# an added token that is not a control token but a chat template's markup: an XML-like tag
# ("<tool_call>", "</tool_response>", "<think>"), matched on the text without "▁"
LOOKS_MARKUP = re.compile(r"</?[A-Za-z][\w.:-]*>")


def is_control_token(content: str, special: bool) -> bool:
    """Whether an added token is a control token: marked special, or its text looks like
    one (:data:`LOOKS_CONTROL`)."""
    return special or LOOKS_CONTROL.fullmatch(content.strip("▁")) is not None


def _trie_pattern(words: Sequence[str]) -> str:
    """A regular expression matching any of ``words``, longest first at each position, as a
    trie of alternations (a flat alternation of thousands of strings, e.g. Gemma's
    ``<unused...>`` tokens, would try each one at every candidate position)."""
    trie: dict = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}

    def pat(node: dict) -> str:
        alts = [re.escape(ch) + pat(child) for ch, child in sorted(node.items()) if ch]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if "" in node else body

    return pat(trie)


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
        control_ids: frozenset of the control tokens' ids (module docstring).
        markup_ids: frozenset: the control ids and the ids of tag-like added tokens
            (:data:`LOOKS_MARKUP`): what a chat's client strings and text-mode prompts hold
            as text only.
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
        added = self.tokenizer.get_added_tokens_decoder()
        self.control_ids = frozenset(i for i, t in added.items() if is_control_token(t.content, t.special))
        self.markup_ids = self.control_ids | frozenset(i for i, t in added.items() if LOOKS_MARKUP.fullmatch(t.content.strip("▁")))
        markup = sorted({added[i].content for i in self.markup_ids})
        if len(markup) + 1 > 0x10FFFD - _CODE0:
            raise EngineError(f"{path}: {len(markup)} control and markup tokens; text escaping handles at most {0x10FFFD - _CODE0 - 1}")
        self._escaped = (_ESC, *markup)  # placeholder i stands for this string
        self._codes = {t: _ESC + chr(_CODE0 + i) for i, t in enumerate(self._escaped)}
        self._escape_re = re.compile(_trie_pattern(self._escaped))
        self._control_re = re.compile(_trie_pattern(markup)) if markup else None  # encode_text's trigger: control or markup strings
        self._placeholder_re = re.compile(re.escape(_ESC) + "(.)", re.S)
        self._text_lock = threading.Lock()
        self._text: tuple | None = None  # (tokenizer with control strings as text, its separator, the separator's id)

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

    def encode_text(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text`` with every control token's string in it encoded as text
        (module docstring): FIM prefix and suffix, ``/v1/completions`` prompts under
        ``--completions-special-tokens text``; BOS first as in :meth:`encode` when
        ``add_special_tokens``. Markup tokens' strings (:attr:`markup_ids`) are text too. A
        text without control or markup strings gets exactly :meth:`encode`'s ids.

        Raises:
            InputError: ``text`` is not encodable Unicode, or this tokenizer maps the text
                of a control string to a control id (a Unigram vocabulary can).
        """
        if self._control_re is None or not self._control_re.search(text):
            return self.encode(text, add_special_tokens)
        tok, _, _ = self._text_tokenizer()
        ids = self._checked(self._batch(tok, [text])[0].ids)
        return [self.bos, *ids] if self.bos is not None and add_special_tokens else ids

    def escape(self, text: str) -> str:
        """``text`` with each control or markup token's string (:attr:`markup_ids`; and the
        placeholder character itself) replaced by a 2-character placeholder, for a chat
        template to render as it renders any text; :meth:`encode_escaped` turns each
        placeholder back into its text."""
        return self._escape_re.sub(lambda m: self._codes[m[0]], text) if self._escape_re.search(text) else text

    def encode_escaped(self, rendered: str) -> list[int]:
        """Token ids (no BOS) of a chat template's output whose client strings went
        through :meth:`escape`: each control or markup string the template wrote gets its
        id (split as :meth:`encode` splits it, with the token's own strip rules); each text
        between two of them that holds a placeholder is tokenized with the placeholders'
        strings as text, the same way :meth:`encode` tokenizes the text between two
        such tokens. Without placeholders: exactly :meth:`encode`'s ids.

        Raises:
            InputError: as :meth:`encode_text`.
        """
        if _ESC not in rendered:
            return self.encode(rendered, add_special_tokens=False)
        enc = self._batch(self.tokenizer, [rendered])[0]
        out: list = []  # ids, and for a text to re-tokenize its slot: (text, after a control token)
        seg: list[int] = []
        start = 0
        for tid, (s, e) in zip(enc.ids, enc.offsets):
            if tid not in self.markup_ids:
                seg.append(tid)
                continue
            self._segment(rendered[start:s], seg, start > 0, out)
            out.append(tid)
            seg, start = [], e
        self._segment(rendered[start:], seg, start > 0, out)
        return self._fill(out)

    def _segment(self, piece: str, ids: list[int], after: bool, out: list) -> None:
        """Append a segment between control tokens: its ids, or its unescaped text to re-tokenize."""
        if _ESC in piece:
            out.append((self._placeholder_re.sub(lambda m: self._unescape(m[1]), piece), after))
        else:
            out.extend(ids)

    def _unescape(self, code: str) -> str:
        i = ord(code) - _CODE0
        return self._escaped[i] if 0 <= i < len(self._escaped) else _ESC + code  # a placeholder the template cut: kept as it is

    def _fill(self, out: list) -> list[int]:
        """``out`` with each ``(text, after)`` slot replaced by the text's ids, all tokenized in
        one batch; a text that follows a control token is tokenized after the separator
        token (then dropped), so that the pre-tokenizer sees it where :meth:`encode` does
        (e.g. Metaspace's prepend_scheme "first" marks only the text at offset 0)."""
        tok, sep, sep_id = self._text_tokenizer()
        texts = [t for t in out if isinstance(t, tuple)]
        encs = self._batch(tok, [sep + t if after else t for t, after in texts])
        ids: list[int] = []
        k = 0
        for item in out:
            if not isinstance(item, tuple):
                ids.append(item)
                continue
            got = encs[k].ids
            if item[1]:
                if not got or got[0] != sep_id or sep_id in got[1:]:
                    raise InputError("prompt text holds the tokenizer's reserved separator characters")
                got = got[1:]
            ids.extend(self._checked(got))
            k += 1
        return ids

    def _checked(self, ids: list[int]) -> list[int]:
        if any(i in self.markup_ids for i in ids):
            raise InputError("this tokenizer cannot encode the text of a control or markup token in a message as text (it maps it to the token's id)")
        return list(ids)

    def _batch(self, tok, texts: list[str]):
        """``tok.encode_batch(texts)`` without special tokens (releases the GIL), with
        :meth:`encode`'s error for text that is not encodable Unicode."""
        try:
            return tok.encode_batch(texts, add_special_tokens=False)
        except TypeError:
            for text in texts:
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise InputError(f"prompt text is not valid Unicode: {e.reason} at index {e.start} ({text[e.start]!r})") from None
            raise

    def _text_tokenizer(self) -> tuple:
        """``(tokenizer, separator, separator id)``: a copy of the tokenizer that encodes
        every control or markup token's string as text (each marked special, special tokens encoded
        as text: ``encode_special_tokens``), plus a separator added token (random
        private-use characters, non-special: still split out) that stands for a control
        token when a segment is tokenized alone. Built on first use (about 0.3 s for a
        150k vocabulary), then shared."""
        with self._text_lock:
            if self._text is None:
                from tokenizers import AddedToken, Tokenizer

                d = json.loads(self.tokenizer.to_str())
                for t in d.get("added_tokens", []):
                    if t["id"] in self.markup_ids:  # text here: a placeholder's string, a completions prompt's in text mode
                        t["special"] = True
                tok = Tokenizer.from_str(json.dumps(d))
                tok.encode_special_tokens = True
                sep = "".join(chr(0xF8000 + secrets.randbelow(0x7000)) for _ in range(12))
                tok.add_tokens([AddedToken(sep, normalized=False, special=False)])
                self._text = (tok, sep, tok.token_to_id(sep))
            return self._text

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
