"""Committed token ids -> the completion text, incrementally; stop strings.

One definition of the output text, used by :meth:`~specrt.runtime.engine.Engine.generate`,
:meth:`~specrt.runtime.engine.Engine.stream`, ``specrt generate`` and ``specrt serve`` alike
(all of them run :class:`CompletionText`).

The completion text: the characters the output ids add to the decoded prompt::

    P    = decode(prompt ids)                 special tokens left out, as everywhere
    F    = decode(prompt ids + output ids)
    text = F[len(P):]                         when F starts with P (the usual case)
         = F[len(P'):]                        else, when F starts with P' = P without its
                                              trailing run of U+FFFD: the prompt ends inside
                                              a character that the output completes, and the
                                              whole character is output text

It is not ``decode(output ids)``: SentencePiece decoders (Llama-2, Mistral, Phi-3:
``Strip``/``Metaspace``) drop the leading space of the *first* token of what they decode, so
for the prompt ``"def f(x):\\n   "`` and the output ``[▁return, ▁x]``, ``decode(output)`` is
``"return x"`` but the completion is ``" return x"``; a client that appends the completion to
its prompt needs the latter.

Computed incrementally (the prefix-offset scheme of vLLM's ``detokenize_incrementally`` and
Hugging Face's ``TextStreamer``, with a fixed context instead of the prompt's tail):

- Each step decodes a short *window*, ``decode(ctx + window)``, and the text after ``ctx``'s
  own text is the window's text. ``ctx`` is the ids of a short plain text (``"a"``,
  :attr:`~specrt.runtime.tokenizer.TextCodec.context_ids`): it stands for "there is text
  before", so a Strip/Metaspace decoder keeps the window's leading space, and being a
  complete, non-byte token it never merges with the output's bytes. Without a non-special
  token in the prompt (e.g. BOS only) there is no text before the output and no ``ctx``: the
  first token's space is dropped exactly as ``decode`` drops it.
- The window starts on a character boundary: after each id whose window text ends in a
  complete character the window moves past it, so it holds one id plus the ids of an
  unfinished character. A window text ending in U+FFFD ends inside a multi-byte character
  (or in undecodable bytes): that trailing run is held back until a later id completes the
  character, or until the end of the output (then it is released as it decodes). After
  more than ``max_pending`` ids without a complete character (only invalid bytes do that) the held text
  is released as it decodes and the window moves on, which bounds the window.
- If the prompt ends inside a character (ids given as a prompt can), the ids after its last
  complete text (found once per request, at most ``tail`` ids back) open the window, and the
  second case of the definition decides what belongs to the output: the whole character the
  output completes.
- :meth:`CompletionText.push` processes its ids one at a time, so the text and the pieces'
  concatenation depend only on the ids, never on how they were grouped into pushes (k_max,
  strategy, rollbacks, stop strings, streaming or not, server or CLI).

Cost per output id: one ``decode`` of ``len(ctx) + 1`` ids (up to ``len(ctx) + max_pending``
while a character is unfinished); with stop strings also a search of the held tail plus the
new piece. Never a decode of the whole output.

Where the incremental text equals the definition: whenever the decoder never takes back
text it has shown as complete along the ids, i.e. ``decode(ids[:k])`` without its trailing
U+FFFD is a prefix of ``decode(ids[:k+1])`` for every k. Byte-level BPE decoders (GPT-2,
Llama-3, Qwen2, StarCoder, Falcon, DeepSeek: lossy per invalid UTF-8 sequence) always
satisfy it, and so do SentencePiece vocabularies (Llama-2, Phi-3: ``ByteFallback``) as long
as every run of consecutive ``<0xNN>`` byte tokens is valid UTF-8.

Where it cannot: ``tokenizers``' ``ByteFallback`` decodes a *run* of byte tokens all or
nothing: a run that is not valid UTF-8 turns every byte of the run into U+FFFD, including
characters the run completed earlier (``[<0xE6>, <0x97>, <0xA5>]`` -> ``"日"``, one more
``<0xE6>`` -> ``"\\ufffd" * 4``; ``[x, <0x0A>, <0xE6>]`` -> ``"x\\ufffd\\ufffd"``). An output cut
by ``max_new_tokens`` inside a character after byte-fallback text, or random byte tokens, is
such a run. There ``decode(prompt + output)`` replaces text that was already complete, which
no streaming decoder can do without retracting what it sent. specrt keeps what it released
and decodes only the window: the complete characters stay (``"\\n"``), the unfinished or
invalid bytes become U+FFFD as the window decodes them (one per byte with ``ByteFallback``),
so ``[x, <0x0A>, <0xE6>]`` gives ``"x\\n\\ufffd"`` (with the first token's space when the
prompt has text). This text, too, is the same whatever the grouping. A prompt given as ids that ends inside
a character within a byte-fallback run is such a run too: ``decode(prompt)`` already shows
the run's complete characters as U+FFFD, so the definition's second case counts them as
output text. specrt gives the same text where the run's start is at most ``max_pending``
ids back (its window opens where the prompt's text, as decoded, is complete); for a longer run
it opens the window after the prompt's last complete character and gives only the characters
after it (no U+FFFD). Decoders that change text *before* the output
(cleanup of ``" ."`` to ``"."``, CTC's merging of repeats) are outside the rule as well; no
causal-LM vocabulary here uses one.

Stop strings, the exact rule, on this text::

    stable(n) = the completion text of the first n output ids, without its trailing run of
                U+FFFD (the text released after n ids)
    n*        = the smallest n such that stable(n) contains one of the stop strings
    tokens    = tokens[:n*]             (the token that completed the match is kept)
    text      = stable(n*)[:j]          j = the earliest start of a match in stable(n*)
                                         (equal starts: the stop listed first wins)
    stop_reason = that stop string

Matching is on the text with special tokens left out, so a stop string equal to a special
token's text never matches (EOS ends the output by itself). Stop strings may not contain
U+FFFD (it stands for bytes that are not text yet). While streaming, text that could be the
beginning of a stop string is held back until it is known not to be one, so nothing of a
match is ever sent.
"""

from __future__ import annotations

from typing import Collection, Sequence

__all__ = ["REPLACEMENT", "CompletionText"]

REPLACEMENT = "\ufffd"


class CompletionText:
    """Turn committed output ids into the completion text, incrementally; apply stop strings.

    Args:
        codec: the tokenizer: ``decode(ids) -> str`` (special tokens left out),
            ``context_ids`` (list of int, see the module doc) and ``special_ids`` (set of
            int: the ids ``decode`` leaves out), as
            :class:`~specrt.runtime.tokenizer.TextCodec` has them.
        prompt: the prompt ids as the models saw them (BOS included).
        stops: stop strings (already validated: non-empty, no U+FFFD).
        max_pending: ids a window may hold while its character is unfinished; with one
            more the held text is released as it decodes (a UTF-8 character has at most 4
            bytes, so only invalid bytes get there).
        tail: how many of the prompt's last ids are decoded to see whether it ends inside a
            character.

    Use: :meth:`push` each round's committed ids, :meth:`take` the text that is safe to
    send, :meth:`finish` at the end of the output; :attr:`text` is the whole completion
    text (``str``). After a stop, :attr:`stop_reason` is set and further pushes are refused.
    :attr:`forced` counts windows released with no complete character (invalid bytes).

    Source: the prefix/read-offset scheme of vLLM's ``detokenize_incrementally`` and Hugging
    Face's ``TextStreamer``, with a fixed decode context instead of the prompt's tail and
    one id per step (the module doc says what differs and why).

    Raises:
        Whatever ``codec.decode`` raises (nothing for ids inside the vocabulary; the Engine
        only passes ids its models produced or that :meth:`Engine.prompt_ids` validated).
    """

    __slots__ = (
        "_decode",
        "_special",
        "_ctx",
        "_ctx_len",
        "_seen_text",
        "_win",
        "_dangling",
        "_done",
        "_stops",
        "_held",
        "_parts",
        "_taken",
        "_finished",
        "max_pending",
        "stop_reason",
        "forced",
    )

    def __init__(self, codec, prompt: Sequence[int], stops: Sequence[str] = (), max_pending: int = 8, tail: int = 32):
        self._decode = codec.decode
        self._special: Collection[int] = codec.special_ids
        self._ctx = list(codec.context_ids)
        self._seen_text = any(int(t) not in self._special for t in prompt)  # text before the output
        self._ctx_len = len(self._decode(self._ctx)) if self._seen_text else 0
        self.max_pending = max_pending
        self._stops = tuple(stops)
        self._held = ""  # released by the decoder, kept back as a possible stop-string start
        self._parts: list[str] = []  # decided output text, in order
        self._taken = 0  # parts already handed out by take()
        self._finished = False
        self.stop_reason: str | None = None
        self.forced = 0
        self._done = 0  # chars of the window's text (beyond the prompt's part) released
        self._win: list[int] = []  # ids since the last character boundary
        self._dangling = ""  # text of the prompt's unfinished last character, if any
        if self._seen_text:
            self._win, self._dangling = self._open([int(t) for t in prompt[-tail:]])

    # ---- decoding ----------------------------------------------------------------------
    def _rel(self, window: list[int]) -> str:
        """Text of ``window`` after the context (``decode(ctx + window)`` less ``ctx``'s text)."""
        if not self._seen_text:
            return self._decode(window)
        return self._decode(self._ctx + window)[self._ctx_len :]

    def _open(self, tail: list[int]) -> tuple[list[int], str]:
        """(window ids, their text) when the prompt ends inside a character, else ([], "").

        The window opens at the token boundary where the prompt's complete text ends: the
        last token whose text (decoded to the end of the tail) starts a character, i.e. does
        not start with U+FFFD, is found, then the last boundary after it before which the text
        is complete and agrees with that decode. Without such a token, or when that leaves
        more than ``max_pending`` ids in the window (a byte-fallback run that ends unfinished
        decodes to U+FFFD throughout, so nothing in it agrees), :meth:`_after_last_character`
        decides. At most 2 x ``tail`` + ``max_pending ** 2`` + 3 decodes, once per request,
        only for a prompt that ends in U+FFFD."""
        whole = self._rel(tail)
        if not whole.endswith(REPLACEMENT):
            return [], ""
        for i in range(len(tail) - 1, -1, -1):
            s = self._rel(tail[i:])
            if s and not s.startswith(REPLACEMENT):
                break
        else:
            return self._after_last_character(tail, whole)
        stable = s.rstrip(REPLACEMENT)
        j = i
        for k in range(i + 1, len(tail) + 1):
            t = self._rel(tail[i:k])
            if t and not t.endswith(REPLACEMENT) and stable.startswith(t):
                j = k
        if len(tail) - j > self.max_pending:
            return self._after_last_character(tail, whole)
        return tail[j:], self._rel(tail[j:])

    def _after_last_character(self, tail: list[int], whole: str) -> tuple[list[int], str]:
        """The window after the tail's last complete character, decoded in short spans: the
        largest boundary ``j`` (at most ``max_pending`` ids from the end) such that some
        ``tail[i:j]`` (``i`` at most ``max_pending`` ids before) decodes to text that neither
        starts nor ends in U+FFFD; none: all of the tail. At most ``max_pending ** 2 + 1``
        decodes."""
        n, m = len(tail), self.max_pending
        for j in range(n - 1, max(n - 1 - m, 0), -1):
            for i in range(j - 1, max(j - 1 - m, -1), -1):
                t = self._rel(tail[i:j])
                if t and not t.startswith(REPLACEMENT) and not t.endswith(REPLACEMENT):
                    return tail[j:], self._rel(tail[j:])
        return tail, whole

    def _base(self, rel: str) -> int:
        """Chars of the window's text that belong to the prompt (its unfinished character):
        all of them while the text still starts with them, none of the completed character."""
        d = self._dangling
        if not d:
            return 0
        return len(d) if rel.startswith(d) else len(d.rstrip(REPLACEMENT))

    def _step(self, tok: int) -> str:
        """Add one id; return the text it releases (UTF-8-safe, before stop strings)."""
        self._win.append(tok)
        rel = self._rel(self._win)
        done = self._base(rel) + self._done
        if rel.endswith(REPLACEMENT):
            if len(self._win) <= self.max_pending:  # wait for the character to complete
                stable = rel.rstrip(REPLACEMENT)
                if len(stable) > done:  # text before the unfinished character
                    self._done += len(stable) - done
                    return stable[done:]
                return ""
            self.forced += 1
        piece = rel[done:]
        if not self._seen_text and any(t not in self._special for t in self._win):
            self._seen_text = True
            self._ctx_len = len(self._decode(self._ctx))
        self._win, self._dangling, self._done = [], "", 0  # the window moves past its ids
        return piece

    # ---- public ------------------------------------------------------------------------
    def push(self, tokens: Sequence[int]) -> int | None:
        """Add committed output ids (one at a time: any grouping gives the same text).

        Args:
            tokens: the ids one round committed, in order.

        Returns:
            None when no stop string matched; else the number of leading ``tokens`` that
            belong to the output (the token that completed the match included), after
            which :attr:`stop_reason` is set and the text is cut before the match.

        Raises:
            RuntimeError: a push after a stop or after :meth:`finish` (a bug in the caller).
        """
        if self._finished:
            raise RuntimeError("CompletionText: push after the output ended")
        for i, tok in enumerate(tokens):
            piece = self._step(int(tok))
            if not piece:
                continue
            if not self._stops:
                self._parts.append(piece)
            elif self._scan(self._held + piece):
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
            self._finished = True
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
        unfinished character (as it decodes: U+FFFD). Idempotent; a no-op after a stop."""
        if self._finished:
            return
        self._finished = True
        rest = self._held
        if self._win:
            rel = self._rel(self._win)
            rest += rel[self._base(rel) + self._done :]
        self._held = ""
        if rest:
            self._parts.append(rest)

    @property
    def text(self) -> str:
        """All decided output text so far (the whole completion text after :meth:`finish`
        or a stop)."""
        return "".join(self._parts)
