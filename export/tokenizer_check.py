"""Export-time guard: the checkpoint's Python tokenizer and its ``tokenizer.json`` must agree.

The runtime encodes prompts with the engine folder's ``tokenizer.json`` (``tokenizers``
alone); users of the checkpoint (and its training) use transformers'
``AutoTokenizer.from_pretrained(folder)``. The two can disagree: transformers 5 picks a
tokenizer class by ``model_type`` and some classes rebuild the pipeline instead of reading
``tokenizer.json`` (``Qwen2Tokenizer`` imposes NFC and Qwen2's split regex on any folder with
``model_type=qwen2``, whatever its tokenizer.json says); tokenizer files converted from
other formats may lack a normalizer (a GGUF records none). Then the engine would feed the
models ids they were not trained on.

:func:`check_tokenizer` encodes a fixed set of texts (:data:`PROBES`: code, whitespace runs,
NFC and NFD text, CJK, emoji, RTL and Khmer text, digits, contractions, and each special
token's text inside text) both ways, without special tokens added (BOS is the manifest's
business):

- all equal: nothing to do;
- a known reason, fixed: ``tokenizer.json`` has no NFC normalizer and the Python tokenizer
  normalizes NFC (transformers' ``Qwen2Tokenizer``; Qwen2's own tokenizer.json has NFC):
  the engine's copy of ``tokenizer.json`` gets ``NFC`` in front of its normalizer, when that
  makes every probe agree, and the export says so in one line;
- otherwise :class:`~specrt.runtime.errors.TokenizerError`, one line naming the first text
  that differs and both id lists.

Decoding is compared too (with special tokens left out, as the runtime decodes); a
difference there is reported in one line, not refused: the runtime's text follows
``tokenizer.json`` (transformers may add cleanup of spaces before punctuation).
"""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

from specrt.runtime.errors import TokenizerError

__all__ = ["PROBES", "check_tokenizer"]

_NFC_TEXT = "Café naïve résumé Ångström Ελληνικά"
PROBES: tuple[str, ...] = (
    "def f(x):\n    return x + 1\n",
    "Hello world",
    " Hello world",
    "  two  spaces   three",
    "\t\ttabs\n\n\nnewlines\r\n",
    "   \n  \n ",
    "trailing   ",
    "I'm sure they'll say we've won, can't they?",
    "3333 12345 3.14159 ½",
    _NFC_TEXT,
    unicodedata.normalize("NFD", _NFC_TEXT),
    "日本語のテキスト 中文 한국어",
    "emoji 😀👍🏽🇩🇪 👨\u200d👩\u200d👧",
    "Привет мир; مرحبا بالعالم; ក្រុមហ៊ុន",
    "\u00a0nbsp\u3000ideographic\u200bzero width ▁ \ufffd",
    "<|endoftext|> <s> </s> [INST]",
)


def _special_texts(tok) -> list[str]:
    """Each special token's text inside text (at most 12 distinct tokens)."""
    names = list(dict.fromkeys(t for t in getattr(tok, "all_special_tokens", []) if t))[:12]
    return [f"a{t}b {t} x{t}{t}\n{t}" for t in names]


def _nfc_fixed(raw):
    """``raw`` (a ``tokenizers.Tokenizer``) with NFC in front of its normalizer, or None when
    it already normalizes NFC."""
    from tokenizers import Tokenizer

    d = json.loads(raw.to_str())
    norm = d.get("normalizer")
    if norm is not None and "NFC" in json.dumps(norm):
        return None
    nfc = {"type": "NFC"}
    if norm is None:
        d["normalizer"] = nfc
    elif norm.get("type") == "Sequence":
        norm["normalizers"] = [nfc, *norm["normalizers"]]
    else:
        d["normalizer"] = {"type": "Sequence", "normalizers": [nfc, norm]}
    return Tokenizer.from_str(json.dumps(d))


def check_tokenizer(target_dir: str | Path, tokenizer_json: str | Path, log=print, auto=None) -> str | None:
    """Compare the checkpoint's ``AutoTokenizer`` with ``tokenizer_json`` on :data:`PROBES`.

    Args:
        target_dir: the target checkpoint folder (its tokenizer files and config).
        tokenizer_json: the ``tokenizer.json`` the engine folder will hold.
        log: sink of the one-line notes (a fix applied, a decode difference).
        auto: the checkpoint's ``AutoTokenizer`` when already loaded (else loaded here).

    Returns:
        None when both encode every probe alike; else the text of a fixed ``tokenizer.json``
        (NFC added, see the module doc) to write into the engine folder instead.

    Raises:
        TokenizerError: (param ``tokenizer``) they encode a probe differently for a reason
            with no known fix; the message names the first such text and both id lists.
    """
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    if auto is None:
        auto = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
    raw = Tokenizer.from_file(str(tokenizer_json))
    texts = [*PROBES, *_special_texts(auto)]
    want = [list(auto(t, add_special_tokens=False)["input_ids"]) for t in texts]

    def first_difference(tok):
        for t, w in zip(texts, want):
            got = tok.encode(t, add_special_tokens=False).ids
            if got != w:
                return t, w, got
        return None

    diff = first_difference(raw)
    fixed = None
    if diff is not None:
        fixed = _nfc_fixed(raw)
        if fixed is None or first_difference(fixed) is not None:
            t, w, got = diff
            raise TokenizerError(
                f"{target_dir}: the checkpoint's tokenizer ({type(auto).__name__}) and its tokenizer.json encode {t!r} differently "
                f"({w[:12]} vs {got[:12]}); the runtime would feed the models tokenizer.json's ids: make tokenizer.json encode as the "
                "checkpoint's tokenizer does (or fix the files AutoTokenizer reads)",
                "tokenizer",
            )
        log(f"  note: tokenizer.json has no NFC normalizer but {type(auto).__name__} normalizes NFC ({diff[0]!r}): NFC added to the engine's tokenizer.json")
    use = fixed or raw
    for t in texts:
        ids = use.encode(t, add_special_tokens=False).ids
        a, b = auto.decode(ids, skip_special_tokens=True), use.decode(ids, skip_special_tokens=True)
        if a != b:
            log(f"  note: transformers decodes the ids of {t!r} as {a!r}, tokenizer.json as {b!r}; specrt's text follows tokenizer.json")
            break
    return fixed.to_str() if fixed is not None else None
