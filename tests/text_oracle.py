"""The oracle of the completion text, by whole decodes (runtime/textstream.py's definition),
and helpers to stream ids through :class:`~specrt.runtime.textstream.CompletionText`."""

from __future__ import annotations

from typing import Callable, Sequence

from specrt.runtime.textstream import CompletionText

FFFD = "\ufffd"
Decode = Callable[[Sequence[int]], str]


def completion_text(decode: Decode, prompt: Sequence[int], out: Sequence[int]) -> str | None:
    """decode(prompt + out) minus decode(prompt): ``F[len(P):]`` when F starts with P, else
    ``F[len(P'):]`` with P' = P less its trailing U+FFFD when F starts with that; None when
    neither (only a byte-fallback run that is not valid UTF-8 gets there)."""
    p = decode(list(prompt))
    f = decode(list(prompt) + list(out))
    if f.startswith(p):
        return f[len(p) :]
    s = p.rstrip(FFFD)
    return f[len(s) :] if f.startswith(s) else None


def prefix_stable(decode: Decode, ids: Sequence[int]) -> bool:
    """Whether the decoder never takes back text it showed as complete along ``ids``:
    decode(ids[:k]) less its trailing U+FFFD is a prefix of the next one and of decode(ids)."""
    ids = list(ids)
    full, prev = decode(ids), ""
    for k in range(1, len(ids) + 1):
        s = decode(ids[:k]).rstrip(FFFD)
        if not s.startswith(prev) or not full.startswith(s):
            return False
        prev = s
    return True


def invalid_byte_run(tokenizer, ids: Sequence[int]) -> bool:
    """A maximal run of ``<0xNN>`` byte-fallback tokens in ``ids`` that is not valid UTF-8
    (``tokenizers``' ByteFallback then turns the whole run into U+FFFD: outside the rule)."""
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    run: list[int] = []
    for t in [i for i in ids if i not in special] + [None]:  # decode leaves specials out first
        tok = tokenizer.id_to_token(t) if t is not None else None
        if tok is not None and len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
            run.append(int(tok[3:5], 16))
            continue
        if run:
            try:
                bytes(run).decode("utf-8")
            except UnicodeDecodeError:
                return True
            run = []
    return False


def stream_text(codec, prompt: Sequence[int], out: Sequence[int], groups: Sequence[int] | None = None, stops=()) -> tuple[str, list[str], CompletionText]:
    """Push ``out`` in ``groups`` (sizes; default one id at a time), taking the pieces after
    each push and at the end; returns (text, pieces, the CompletionText)."""
    ct = CompletionText(codec, prompt, stops)
    pieces, i = [], 0
    for g in groups if groups is not None else [1] * len(out):
        if ct.push(out[i : i + g]) is not None:
            break
        pieces.append(ct.take())
        i += g
    else:
        if i < len(out):
            ct.push(out[i:])
    ct.finish()
    pieces.append(ct.take())
    return ct.text, [p for p in pieces if p], ct
