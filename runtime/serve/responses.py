"""The response side of the OpenAI routes: a validated request (:class:`Work`, one
:class:`GenerationRequest` per generation) and the objects answered for it
(:class:`Responses`: JSON bodies, stream chunks, logprob listings; :func:`usage_block`;
:func:`error_body`). No HTTP framework is imported here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Sequence

from ..stats import acceptance_rate, mean_accepted
from .jobs import Job

__all__ = ["LOGPROB_FLOOR", "GenerationRequest", "Work", "Responses", "usage_block", "chat_message", "error_body"]

LOGPROB_FLOOR = -9999.0  # JSON has no -inf: a token of probability 0 is reported with this (as vLLM)


@dataclass
class GenerationRequest:
    """One generation a request asks for (becomes one :class:`~specrt.runtime.serve.jobs.Job`).

    Attributes:
        prompt_index: which prompt of the request.
        ids: its validated token ids.
        config: the resolved GenerationConfig (seed derived per choice).
        echo_text: the prompt text to echo before the output (completions' ``echo``), or None.
        prompt_logprobs: alternatives per prompt token to score (echo + logprobs), or None.
        generate: False: echo only (``max_tokens: 0``).
    """

    prompt_index: int
    ids: list[int]
    config: Any
    echo_text: str | None = None
    prompt_logprobs: int | None = None
    generate: bool = True


@dataclass
class Work:
    """A validated request: its generations and how to answer.

    Attributes:
        chat: True for ``/v1/chat/completions``.
        gens: the generations, ``best_of`` per prompt, prompts in order.
        n: choices returned per prompt. best_of: generations per prompt (>= n).
        stream: server-sent events. include_usage: ``stream_options.include_usage``.
        top_n: logprob alternatives shown per token, or None when logprobs are not shown.
        prompt_tokens: prompt tokens of the request (each prompt counted once).
        tools: the chat request's :class:`~specrt.runtime.serve.tools.ToolCalling` (its
            output is read back into ``tool_calls``), or None.
    """

    chat: bool
    gens: list[GenerationRequest]
    n: int
    best_of: int
    stream: bool
    include_usage: bool
    top_n: int | None
    prompt_tokens: int
    tools: Any = None


def _finite(x: float | None) -> float | None:
    """JSON has no NaN: None for NaN/inf."""
    return None if x is None or not math.isfinite(x) else round(float(x), 6)


def usage_block(results: Sequence, prompt_tokens: int | None = None) -> dict:
    """OpenAI ``usage`` of one request, with the speculative statistics of all its
    generations summed under ``usage["speculative"]``.

    Args:
        results: the :class:`GenerationResult` of every generation (best_of ones included:
            ``completion_tokens`` counts every generated token).
        prompt_tokens: the request's prompt tokens (default: the first result's).
    """
    if not isinstance(results, (list, tuple)):
        results = [results]
    st = [r.stats for r in results]
    prompt = st[0].prompt_tokens if prompt_tokens is None else prompt_tokens
    new = sum(s.new_tokens for s in st)
    proposed, accepted, passes = sum(s.proposed for s in st), sum(s.accepted for s in st), sum(s.passes for s in st)
    width = max(len(s.accepted_hist) for s in st)
    hist = [sum(s.accepted_hist[i] if i < len(s.accepted_hist) else 0 for s in st) for i in range(width)]
    after_first = sum(max(s.new_tokens - 1, 0) for s in st)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": new,
        "total_tokens": prompt + new,
        # as OpenAI reports prompt caching: prompt tokens whose KV came from an earlier request
        "prompt_tokens_details": {"cached_tokens": max(s.cached_tokens for s in st)},
        # OpenAI's own fields for predicted tokens (Predicted Outputs), which agent
        # frameworks already read: draft candidates the target accepted / rejected
        "completion_tokens_details": {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": proposed - accepted},
        "speculative": {
            "proposed": proposed,
            "accepted": accepted,
            "acceptance_rate": _finite(acceptance_rate(accepted, proposed)),
            "mean_accepted": _finite(mean_accepted(accepted, passes)),
            "tokens_per_pass": _finite(after_first / passes if passes else math.nan),
            "passes": passes,
            "draft_calls": sum(s.draft_calls for s in st),
            "forced": sum(s.forced for s in st),
            "forced_accepted": sum(s.forced_accepted for s in st),
            "accepted_hist": hist,
            "prefill_seconds": _finite(sum(s.prefill_seconds for s in st)),
            "draft_seconds": _finite(sum(s.draft_seconds for s in st)),
            "target_seconds": _finite(sum(s.target_seconds for s in st)),
            "total_seconds": _finite(sum(s.total_seconds for s in st)),
            "stop_reason": results[0].stop_reason if len(results) == 1 else None,
        },
    }


def _lp(x: float) -> float:
    return max(float(x), LOGPROB_FLOOR)


class Responses:
    """The response objects of one served model.

    Args:
        model_name: the ``model`` of every object.
        codec: the tokenizer (:class:`~specrt.runtime.tokenizer.TextCodec`): token texts,
            bytes and text offsets in logprob listings.
        stop_ids: end-of-generation ids (left out of chat logprob listings).
    """

    def __init__(self, model_name: str, codec, stop_ids):
        self.model_name, self.codec, self.stop_ids = model_name, codec, stop_ids

    def pick(self, work: Work, results: list) -> list[int]:
        """Generation indices of the returned choices, in choice order: per prompt the
        first ``n``, or with ``best_of > n`` the ``n`` with the highest cumulative logprob
        (sum over the output tokens, target's raw distribution; ties: lower index first)."""
        out = []
        for p in range(len(work.gens) // work.best_of):
            idx = list(range(p * work.best_of, (p + 1) * work.best_of))
            if work.best_of > work.n:
                idx.sort(key=lambda i: -sum(e.logprob for e in results[i].logprobs))
            out.extend(idx[: work.n])
        return out

    def _offsets(self, ids: Sequence[int], start: int, count: int, base: int) -> list[int]:
        """Character offsets of tokens ``start..start+count-1`` of ``ids`` in their text
        (``len(decode(ids[:k]))`` + ``base``)."""
        if count <= 0:
            return []
        dec = self.codec.tokenizer.decode_batch([list(ids[:k]) for k in range(start, start + count)], skip_special_tokens=True)
        return [base + len(t) for t in dec]

    def completion_logprobs(self, entries: Sequence, tokens_before: Sequence[int], base: int, top_n: int) -> dict:
        """OpenAI's completions ``logprobs`` object for ``entries`` (TokenLogprob or None for
        a first prompt token): ``tokens``, ``token_logprobs``, ``top_logprobs`` (a dict of the
        ``top_n`` most probable tokens plus the chosen one, as OpenAI), ``text_offset``
        (characters into the choice's text; ``tokens_before`` are the ids already in it,
        ``base`` where their text starts)."""
        codec = self.codec
        ids = [e.token for e in entries]
        seq = list(tokens_before) + ids
        toks, lps, tops = [], [], []
        for e in entries:
            toks.append(codec.token_text(e.token))
            if e.logprob is None:
                lps.append(None)
                tops.append(None)
                continue
            lps.append(_lp(e.logprob))
            d = {codec.token_text(t): _lp(v) for t, v in e.top[:top_n]}
            d.setdefault(codec.token_text(e.token), _lp(e.logprob))
            tops.append(d)
        return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": self._offsets(seq, len(tokens_before), len(ids), base)}

    def chat_logprobs(self, entries: Sequence, top_n: int) -> dict:
        """OpenAI's chat ``logprobs`` object: ``{"content": [{token, logprob, bytes,
        top_logprobs: [{token, logprob, bytes}, ...]}], "refusal": null}``, one entry per
        token of the message's content: the end-of-generation token that ended it (e.g.
        ``<|im_end|>``) is not listed, as OpenAI lists none (``usage.completion_tokens``
        still counts it: it was generated, as vLLM counts it)."""
        codec = self.codec
        stop = self.stop_ids

        def one(t, lp):
            return {"token": codec.token_text(t), "logprob": _lp(lp), "bytes": list(codec.token_bytes(t))}

        content = [dict(one(e.token, e.logprob), top_logprobs=[one(t, v) for t, v in e.top[:top_n]]) for e in entries if e.token not in stop]
        return {"content": content, "refusal": None}

    def response_body(self, work: Work, cid: str, created: int, results: list, jobs: list[Job]) -> dict:
        """The non-streaming ``text_completion`` / ``chat.completion`` object (runs off the
        event loop: it detokenizes logprob listings)."""
        choices = []
        for k, i in enumerate(self.pick(work, results)):
            res, g = results[i], work.gens[i]
            lp = None
            if work.chat:
                if work.top_n is not None:
                    lp = self.chat_logprobs(res.logprobs, work.top_n)
                message, finish = chat_message(work, res)
                choices.append({"index": k, "message": message, "logprobs": lp, "finish_reason": finish, "stop_reason": res.stop_reason})
                continue
            text = res.text
            if g.echo_text is not None:
                text = g.echo_text + text
            if work.top_n is not None:
                if g.echo_text is not None:
                    plp = self._prompt_entries(jobs[i].prompt_lps, g.ids)
                    lp = self.completion_logprobs(plp, [], 0, work.top_n)
                    rest = self.completion_logprobs(res.logprobs, g.ids, 0, work.top_n)
                    rest["text_offset"] = [len(g.echo_text) + o - len(self.codec.decode(g.ids)) for o in rest["text_offset"]]
                    for key in lp:
                        lp[key] = lp[key] + rest[key]
                else:
                    lp = self.completion_logprobs(res.logprobs, [], 0, work.top_n)
            choices.append({"text": text, "index": k, "logprobs": lp, "finish_reason": res.finish_reason, "stop_reason": res.stop_reason})
        return {
            "id": cid,
            "object": "chat.completion" if work.chat else "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": choices,
            "usage": usage_block(results, work.prompt_tokens),
        }

    @staticmethod
    def _prompt_entries(prompt_lps, ids):
        """Prompt logprob entries for the listing: the first token (no logprob) as a
        placeholder with ``logprob`` None."""
        from types import SimpleNamespace

        if prompt_lps is None:
            return []
        return [SimpleNamespace(token=ids[0], logprob=None, top=())] + list(prompt_lps[1:])

    def chunk(
        self, work: Work, cid: str, created: int, index: int, text: str | None = None, finish_reason=None, logprobs=None, role: bool = False, delta=None
    ) -> str:
        """One server-sent event with a ``text_completion`` or ``chat.completion.chunk``
        for choice ``index`` (``usage: null`` when the client asked for usage); ``delta``:
        a chat delta given whole (tool-call deltas, :class:`~specrt.runtime.serve.tools.ToolStream`)."""
        if work.chat:
            if delta is None:
                delta = {}
            if role:
                delta = {"role": "assistant", "content": ""}
            elif text:
                delta = {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"text": text or "", "index": index, "logprobs": logprobs, "finish_reason": finish_reason}
        body = {
            "id": cid,
            "object": "chat.completion.chunk" if work.chat else "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": [choice],
        }
        if work.include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def piece_logprobs(self, work: Work, i: int, entries, seen: list[int]) -> dict | None:
        """The logprobs object of a streamed piece of choice ``i`` (None when the request
        shows none); ``seen`` (the output ids already sent for that choice, for text
        offsets) is extended with the entries' tokens."""
        if work.top_n is None or entries is None:
            return None
        if work.chat:
            return self.chat_logprobs(entries, work.top_n)
        g = work.gens[i]
        if g.echo_text is not None:
            base = len(g.echo_text) - len(self.codec.decode(g.ids))
            out = self.completion_logprobs(entries, list(g.ids) + seen, 0, work.top_n)
            out["text_offset"] = [base + o for o in out["text_offset"]]
        else:
            out = self.completion_logprobs(entries, seen, 0, work.top_n)
        seen.extend(e.token for e in entries)
        return out

    def prompt_chunk(self, work: Work, cid: str, created: int, i: int, entries) -> str:
        """The first streamed event of an ``echo`` choice ``i``: its prompt text (and the
        prompt's logprobs when shown)."""
        g = work.gens[i]
        lp = None
        if work.top_n is not None and entries is not None:
            lp = self.completion_logprobs(self._prompt_entries(entries, g.ids), [], 0, work.top_n)
        return self.chunk(work, cid, created, i, g.echo_text, None, lp)

    def usage_chunk(self, work: Work, cid: str, created: int, results: list) -> str:
        """The last event with ``stream_options.include_usage``: ``choices: []`` and the usage."""
        body = {
            "id": cid,
            "object": "chat.completion.chunk" if work.chat else "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": [],
            "usage": usage_block(results, work.prompt_tokens),
        }
        return f"data: {json.dumps(body)}\n\n"


def chat_message(work: Work, res) -> tuple[dict, str]:
    """The ``message`` of a chat choice and its ``finish_reason``: with tools, the calls read
    from the text (:func:`~specrt.runtime.serve.tools.parse_tool_calls`) go to
    ``tool_calls`` (``content`` null when nothing else is left) and a choice that stopped
    after calling ends with ``"tool_calls"``, as OpenAI answers; a call cut by the length is
    the last call, its arguments as far as they go, with ``"length"``."""
    if work.tools is None:
        return {"role": "assistant", "content": res.text, "refusal": None}, res.finish_reason
    from .tools import parse_tool_calls

    content, calls = parse_tool_calls(work.tools.format, res.text, res.finish_reason == "length")
    message = {"role": "assistant", "content": content, "refusal": None}
    if not calls:
        return message, res.finish_reason
    message["tool_calls"] = calls
    return message, "tool_calls" if res.finish_reason == "stop" else res.finish_reason


def error_body(message: str, param: str | None = None, err_type: str = "invalid_request_error", code: str | None = None) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}
