"""Committed token ids -> output text, incrementally: UTF-8-safe pieces and stop strings.

Used by :meth:`~specrt.runtime.generator.Engine.stream` (always) and by
:meth:`~specrt.runtime.generator.Engine.generate` when stop strings are given (without
them ``generate`` decodes the output once at the end).

Incremental decoding (the prefix/read-offset scheme of vLLM's ``detokenize_incrementally``
and Hugging Face's ``TextStreamer``): only a short window of recent ids is decoded per
step, ``decode(ids[prefix:])``, and the new text is what extends ``decode(ids[prefix:read])``.
The window moves on when its text ends in a complete character, so its left edge always
sits on a character boundary and the pieces concatenate to ``decode(ids)``.

UTF-8 safety: a window text that ends in U+FFFD ends inside a multi-byte character (or in
undecodable bytes); the trailing run of U+FFFD is held back until a later token completes
the character, or until the end of the output (then it is released as it decodes).

Stop strings, the exact rule::

    stable(n) = decode(tokens[:n]) without its trailing run of U+FFFD
    n*        = the smallest n such that stable(n) contains one of the stop strings
    tokens    = tokens[:n*]             (the token that completed the match is kept)
    text      = stable(n*)[:j]          j = the earliest start of a match in stable(n*)
                                         (equal starts: the stop listed first wins)
    stop_reason = that stop string

Matching is on the decoded text with special tokens left out, so a stop string equal to a
special token's text never matches (EOS ends the output by itself). Stop strings may not
contain U+FFFD (it stands for bytes that are not text yet). While streaming, text that could
be the beginning of a stop string is held back until it is known not to be one, so nothing
of a match is ever sent.

Cost per committed token: two decodes of the few ids in the window, and with stop strings
a search of the held tail plus the new piece (a tail shorter than the longest stop string),
never the whole output.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["REPLACEMENT", "IncrementalText"]

REPLACEMENT = "\ufffd"


class IncrementalText:
    """Turn committed token ids into text, incrementally; apply stop strings.

    Args:
        codec: an object with ``decode(ids) -> str`` (:class:`~specrt.runtime.tokenizer.TextCodec`).
        stops: stop strings (already validated: non-empty, no U+FFFD).

    Use: :meth:`push` each round's committed tokens, :meth:`take` the text that is safe to
    send, :meth:`finish` at the end of the output; :attr:`text` is the whole output text.
    After a stop, :attr:`stop_reason` is set and further pushes are refused.
    """

    __slots__ = ("_decode", "_stops", "_ids", "_prefix", "_read", "_prefix_len", "_extra", "_held", "_parts", "_taken", "stop_reason", "_done")

    def __init__(self, codec, stops: Sequence[str] = ()):
        self._decode = codec.decode
        self._stops = tuple(stops)
        self._ids: list[int] = []
        self._prefix = 0  # window start (token index, on a character boundary)
        self._read = 0  # end of the part of the window whose text was complete last time
        self._prefix_len = 0  # len(decode(ids[prefix:read]))
        self._extra = 0  # chars beyond prefix_len already released while the window ends in U+FFFD
        self._held = ""  # released by the decoder, kept back as a possible stop-string start
        self._parts: list[str] = []  # decided output text, in order
        self._taken = 0  # parts already handed out by take()
        self.stop_reason: str | None = None
        self._done = False

    # ---- decoding ----------------------------------------------------------------------
    def _decode_new(self) -> str:
        """Text that the ids pushed since the last call add, UTF-8-safe (see module doc)."""
        ids = self._ids
        full = self._decode(ids[self._prefix :])
        if not full.endswith(REPLACEMENT):
            new = full[self._prefix_len + self._extra :]
            if len(full) > self._prefix_len:  # move the window on (not past ids that added nothing)
                self._prefix, self._read = self._read, len(ids)
                self._prefix_len = len(self._decode(ids[self._prefix : self._read]))
                self._extra = 0
            return new
        stable = full.rstrip(REPLACEMENT)
        start = self._prefix_len + self._extra
        if len(stable) > start:
            self._extra = len(stable) - self._prefix_len
            return stable[start:]
        return ""

    # ---- public ------------------------------------------------------------------------
    def push(self, tokens: Sequence[int]) -> int | None:
        """Add committed tokens.

        Args:
            tokens: the ids one round committed (in order).

        Returns:
            None when no stop string matched; else the number of leading ``tokens`` that
            belong to the output (the token that completed the match included), after
            which :attr:`stop_reason` is set and the text is cut before the match.

        Raises:
            RuntimeError: a push after a stop or after :meth:`finish` (a bug in the caller).
        """
        if self._done:
            raise RuntimeError("IncrementalText: push after the output ended")
        if not self._stops:
            self._ids.extend(tokens)
            piece = self._decode_new()
            if piece:
                self._parts.append(piece)
            return None
        for i, tok in enumerate(tokens):
            self._ids.append(tok)
            piece = self._decode_new()
            if piece and self._scan(self._held + piece):
                return i + 1
        return None

    def _scan(self, buf: str) -> bool:
        """Search ``buf`` (held tail + new piece) for a stop; decide what can be released."""
        best, which = -1, None
        for s in self._stops:
            j = buf.find(s)
            if j >= 0 and (best < 0 or j < best):
                best, which = j, s
        if which is not None:
            if best:
                self._parts.append(buf[:best])
            self._held = ""
            self.stop_reason = which
            self._done = True
            return True
        h = self._hold(buf)
        if len(buf) > h:
            self._parts.append(buf[: len(buf) - h])
        self._held = buf[len(buf) - h :] if h else ""
        return False

    def _hold(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        best = 0
        n = len(buf)
        for s in self._stops:
            first = s[0]
            j = max(n - len(s) + 1, 0)  # a proper prefix is shorter than s
            while j < n and n - j > best:
                j = buf.find(first, j)
                if j < 0:
                    break
                if s.startswith(buf[j:]):
                    best = n - j
                    break
                j += 1
        return best

    def take(self) -> str:
        """Text decided since the last call (what a stream sends now); '' when none."""
        if self._taken == len(self._parts):
            return ""
        out = "".join(self._parts[self._taken :])
        self._taken = len(self._parts)
        return out

    def finish(self) -> None:
        """End of the output without a stop: release the held text and any trailing
        incomplete character (as it decodes, U+FFFD). Idempotent; a no-op after a stop."""
        if self._done:
            return
        self._done = True
        full = self._decode(self._ids[self._prefix :])
        rest = self._held + full[self._prefix_len + self._extra :]
        self._held = ""
        if rest:
            self._parts.append(rest)

    @property
    def text(self) -> str:
        """All decided output text so far (the whole output after :meth:`finish` or a stop)."""
        return "".join(self._parts)
