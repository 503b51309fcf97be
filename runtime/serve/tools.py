"""Tool calling (OpenAI's ``tools``/``tool_choice``) for the models' own chat templates: the
call format read from the template, a grammar that makes forced calls parse and match their
schemas, and the parsers that turn the model's text into ``message.tool_calls`` (whole, or
as streamed deltas).

Formats, chosen from the template's text (never from the model's name):

=============== ============================================================ ==================
format          a call as the model writes it                                templates
=============== ============================================================ ==================
``hermes``      ``<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>`` Qwen2.5, Qwen3, Hermes
``llama3_json`` ``{"name": N, "parameters": {...}}`` (after ``<|python_tag|>``)  Llama 3.1-3.3
``mistral``     ``[TOOL_CALLS][{"name": N, "arguments": {...}}, ...]``          Mistral (v3 tokenizer)
=============== ============================================================ ==================

A template without any of these markers has no tool support here (``tools`` gets a 400).

``tool_choice``: ``none`` renders the conversation without tools and parses nothing;
``auto`` lets the model choose (calls are parsed from its text; with a ``strict`` tool, a
lazy grammar constrains what follows the call marker: llguidance's ``StructTag``);
``required`` and a named function are enforced by the grammar (one call, or one or more
with ``parallel_tool_calls``), so their arguments always parse and match the schema.

Sources: llama.cpp ``common/chat.cpp`` (per-template formats, lazy grammars triggered by the
opening tag); vLLM ``entrypoints/openai/tool_parsers`` (``hermes_tool_parser.py``,
``llama_tool_parser.py``, ``mistral_tool_parser.py``); OpenAI's chat completions API
reference (``tool_calls``, streamed ``delta.tool_calls`` with ``index``).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..constraints import JSON_OPTIONS, Constraint
from ..errors import InputError

__all__ = ["TOOL_FORMATS", "ToolSpec", "ToolCalling", "template_tool_format", "parse_tool_calls", "ToolStream"]

TOOL_FORMATS = ("hermes", "llama3_json", "mistral")
_MARKERS = {"hermes": ("<tool_call>", "</tool_call>"), "mistral": ("[TOOL_CALLS]", ""), "llama3_json": ("<|python_tag|>", "")}


def template_tool_format(source: str | None) -> str | None:
    """The tool-call format a chat template teaches (one of :data:`TOOL_FORMATS`), or None
    when it has none: ``<tool_call>`` (hermes), ``[TOOL_CALLS]`` (mistral),
    ``<|python_tag|>`` or Llama 3's ``"parameters"`` JSON instruction (llama3_json); the
    template must also read ``tools``."""
    if not source or "tools" not in source:
        return None
    if "<tool_call>" in source:
        return "hermes"
    if "[TOOL_CALLS]" in source:
        return "mistral"
    if "<|python_tag|>" in source or (re.search(r'\\?"parameters\\?"', source) and "ipython" in source):
        return "llama3_json"
    return None


@dataclass(frozen=True)
class ToolSpec:
    """One function of ``tools``: name, description, JSON-schema ``parameters``, ``strict``."""

    name: str
    parameters: dict
    description: str = ""
    strict: bool = False

    def as_openai(self) -> dict:
        """The ``{"type": "function", "function": {...}}`` object templates render."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


def parse_tools(tools: list) -> list[ToolSpec]:
    """OpenAI ``tools`` -> :class:`ToolSpec` list.

    Raises:
        InputError: (param ``tools``) an entry that is not ``{"type": "function",
            "function": {"name": ..., "parameters": {...}}}``, a name outside
            ``[A-Za-z0-9_-]{1,64}`` (OpenAI's rule), or a name given twice.
    """
    out, seen = [], set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InputError(f'tools[{i}]: a tool is {{"type": "function", "function": {{"name": ..., "parameters": {{...}}}}}}', "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise InputError(f"tools[{i}].function.name={name!r}; a function name is 1-64 letters, digits, '_' or '-'", "tools")
        if name in seen:
            raise InputError(f"tools[{i}].function.name={name!r} is given twice; function names must be unique", "tools")
        seen.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise InputError(
                f"tools[{i}].function.parameters must be a JSON schema of an object (arguments are a JSON object), got {json.dumps(params)[:80]}", "tools"
            )
        desc = fn.get("description") or ""
        out.append(ToolSpec(name, params, desc if isinstance(desc, str) else "", bool(fn.get("strict"))))
    return out


def _choice(tool_choice, specs: list[ToolSpec]) -> tuple[str, str | None]:
    """``(mode, function name)`` of ``tool_choice`` (mode: none, auto, required, named).

    Raises:
        InputError: (param ``tool_choice``) an unknown value, or a named function not in ``tools``.
    """
    if tool_choice is None:
        return ("auto" if specs else "none"), None
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise InputError(f'tool_choice={tool_choice!r}; use "none", "auto", "required" or {{"type": "function", "function": {{"name": ...}}}}', "tool_choice")
    if name not in {s.name for s in specs}:
        raise InputError(f"tool_choice names function {name!r}, which is not in tools ({', '.join(s.name for s in specs) or 'none given'})", "tool_choice")
    return "named", name


@dataclass(frozen=True)
class ToolCalling:
    """Tool calling for one chat request: what the template renders and how the output is
    read back.

    Attributes:
        format: one of :data:`TOOL_FORMATS`.
        tools: the :class:`ToolSpec` list (rendered when ``mode != "none"``).
        mode: ``none``, ``auto``, ``required`` or ``named``. name: the named function.
        parallel: ``parallel_tool_calls`` (default true): required may make several calls.
        constraint: the grammar enforcing the calls (required, named, or auto with a strict
            tool), or None.
    """

    format: str
    tools: tuple = ()
    mode: str = "auto"
    name: str | None = None
    parallel: bool = True
    constraint: Constraint | None = field(default=None, compare=False)

    @classmethod
    def build(cls, template_source: str | None, tools, tool_choice, parallel, vocab_id) -> "ToolCalling | None":
        """The request's tool calling, or None when it has no tools (or ``tool_choice``
        ``none``).

        Args:
            template_source: the chat template's text (its format is read from it).
            tools, tool_choice, parallel: the request's fields (None when not sent).
            vocab_id: ``str -> int | None``, the id of a token given by its text (the
                markers that are single tokens are matched as those tokens).

        Raises:
            InputError: tools with a template that has no tool support, ``tool_choice``
                naming a function not in ``tools`` (or any choice but none without tools),
                bad ``tools`` entries.
        """
        specs = parse_tools(tools or [])
        mode, name = _choice(tool_choice, specs)
        if mode == "none":
            return None
        if not specs:
            raise InputError(f"tool_choice={tool_choice!r} needs tools; send tools, or leave tool_choice out", "tool_choice")
        fmt = template_tool_format(template_source)
        if fmt is None:
            raise InputError(
                "tools: this model's chat template has no tool-call format specrt reads (<tool_call> as Qwen2.5/Hermes, "
                "Llama 3 JSON, Mistral [TOOL_CALLS]); serve it with such a template (--chat-template) or send no tools",
                "tools",
            )
        par = True if parallel is None else bool(parallel)
        grammar = _grammar(fmt, specs, mode, name, par, vocab_id)
        return cls(fmt, tuple(specs), mode, name, par, Constraint("lark", grammar, "tools") if grammar else None)

    def openai_tools(self) -> list[dict]:
        """The tools as the template sees them."""
        return [s.as_openai() for s in self.tools]


def _lit(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _marker(text: str, vocab_id) -> str:
    """A marker as a grammar item: its token (``<[id]>``) when it is one token, else the text."""
    tid = vocab_id(text) if text else None
    return f"<[{tid}]>" if tid is not None else _lit(text)


def _args_schema(spec: ToolSpec) -> str:
    schema = dict(spec.parameters)
    schema.setdefault("x-guidance", JSON_OPTIONS)
    return json.dumps(schema, ensure_ascii=False)


def _grammar(fmt: str, specs: list[ToolSpec], mode: str, name: str | None, parallel: bool, vocab_id) -> str | None:
    """The Lark grammar (llguidance's dialect) of the calls ``mode`` enforces, or None
    (auto without a strict tool, or auto in the llama3_json format, which has no marker to
    trigger on: the model is free, its calls are parsed afterwards).

    ``required``/named: the output is the calls alone. ``auto`` with a strict tool: free
    text, and after each call marker a call whose arguments match its tool's schema
    (llguidance's lazy trigger, as its ``StructTag`` builds it)."""
    if mode == "auto" and (fmt == "llama3_json" or not any(s.strict for s in specs)):
        return None
    chosen = [s for s in specs if s.name == name] if mode == "named" else specs
    key = "parameters" if fmt == "llama3_json" else "arguments"
    rules = [f"fn_{i}: {_lit(s.name + chr(34) + ', ' + chr(34) + key + chr(34) + ': ')} %json {_args_schema(s)}" for i, s in enumerate(chosen)]
    body = '"{\\"name\\": \\"" (' + " | ".join(f"fn_{i}" for i in range(len(chosen))) + ') "}"'
    many = parallel and mode != "named" and fmt != "llama3_json"
    if fmt == "hermes":
        open_, close = (_marker(m, vocab_id) for m in _MARKERS["hermes"])
        after = f'"\\n" {body} "\\n" {close}'
        # a newline may follow the last call (the model often writes one before its end of turn)
        calls = f'{open_} after ("\\n" {open_} after)* "\\n"?' if many else f'{open_} after "\\n"?'
    elif fmt == "mistral":
        open_ = _marker("[TOOL_CALLS]", vocab_id)
        after = f'"[" {body} (", " {body})* "]"' if many else f'"[" {body} "]"'
        calls = f"{open_} after"
    else:
        open_, after, calls = "", "", body
    lines = ([f"after: {after}"] if after else []) + rules
    if mode != "auto":
        return "\n".join(["start: " + calls, *lines])
    if open_.startswith("<["):  # the marker is a token text cannot contain: text ends where it comes
        head = ["start: (TEXT " + open_ + " after)* TEXT"]
    else:  # a text marker: the lazy trigger ends the free text at its first occurrence
        head = ["start: (trig after)* TEXT", "trig[lazy]: TEXT " + open_]
    return "\n".join(["%llguidance {}", *head, "TEXT: /(.|\\n)*/", *lines])


# ---- reading calls back ----------------------------------------------------------------
def _call(name: str, args: Any) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _as_call(obj: Any, key: str) -> dict | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return _call(obj["name"], args) if isinstance(args, dict) else None


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_DECODER = json.JSONDecoder()


def _hermes_call(text: str, at: int) -> tuple[dict | None, int]:
    """The call whose ``<tool_call>`` starts at ``at``: ``(call, end)`` when a JSON object
    follows (decoded whole, so a ``</tool_call>`` inside a string argument is text) and then
    ``</tool_call>``; ``(None, -1)`` when the text cannot be one (yet)."""
    i = at + len(_OPEN)
    while i < len(text) and text[i].isspace():
        i += 1
    try:
        obj, j = _DECODER.raw_decode(text, i)
    except ValueError:
        return None, -1
    while j < len(text) and text[j].isspace():
        j += 1
    if not text.startswith(_CLOSE, j):
        return None, -1
    return _as_call(obj, "arguments"), j + len(_CLOSE)


def _hermes(text: str, truncated: bool = False) -> tuple[list[str], list[dict]]:
    """The text outside the calls (parts, one more than the calls) and the calls, left to
    right; a ``<tool_call>`` that does not open a well-formed call stays text, except the
    last one of an output cut by the length (``truncated``) when what follows it is a call
    cut short (:func:`_cut_call`): that call is the last one, as far as it goes (dropped
    when its name is not complete)."""
    parts, calls, at, scan = [], [], 0, 0
    while (k := text.find(_OPEN, scan)) >= 0:
        call, end = _hermes_call(text, k)
        if call is None:
            scan = k + len(_OPEN)
            continue
        parts.append(text[at:k])
        calls.append(call)
        at = scan = end
    parts.append(text[at:])
    if truncated and (k := parts[-1].rfind(_OPEN)) >= 0:
        cut, call = _cut_call(parts[-1][k + len(_OPEN) :])
        if cut:
            parts[-1] = parts[-1][:k]
            if call is not None:
                parts.append("")
                calls.append(call)
    return parts, calls


# the start of a hermes call object up to its arguments' value: {"name": "...", "arguments":
_CUT_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*(,\s*"arguments"\s*:\s*)?', re.S)


def _cut_call(body: str) -> tuple[bool, dict | None]:
    """``(cut, call)`` for the text after a ``<tool_call>`` at the end of an output cut by
    the length. ``cut``: it is a call's beginning (nothing yet, a JSON object's prefix, or a
    whole object followed by at most a prefix of ``</tool_call>``), not some other text.
    ``call``: the call as far as it goes, its ``arguments`` the JSON text generated so far
    (it does not parse when the cut fell inside them), as OpenAI and llama-server return a
    call cut by ``max_tokens``; None when the name is not complete."""
    s = body.lstrip()
    if not s:
        return True, None
    try:
        obj, j = _DECODER.raw_decode(s)
    except json.JSONDecodeError as e:
        # a prefix of valid JSON fails at its end, or inside a string that runs to the end
        if e.pos < len(s.rstrip()) and not e.msg.startswith("Unterminated string"):
            return False, None
        m = _CUT_HEAD.match(s)
        if m is None:
            return True, None
        args = s[m.end() :].rstrip() if m[2] else ""
        return True, {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": json.loads(m[1]), "arguments": args}}
    rest = s[j:].strip()
    if rest and not _CLOSE.startswith(rest):
        return False, None
    return True, _as_call(obj, "arguments")


def parse_tool_calls(fmt: str, text: str, truncated: bool = False) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` of a model's output ``text`` in format ``fmt``.

    ``tool_calls`` are OpenAI's objects (``id``, ``type``, ``function.name``,
    ``function.arguments`` as JSON text); ``content`` is the text outside the calls,
    stripped (None when nothing is left). A block that does not parse as a call stays in
    the content, as vLLM's parsers leave it. ``truncated`` (the output was cut by the
    length): a hermes call cut short is the last call, its ``arguments`` as far as they go
    (:func:`_cut_call`), never raw ``<tool_call>`` text in the content.
    """
    calls: list[dict] = []
    if fmt == "hermes":
        parts, calls = _hermes(text, truncated)
        content = "".join(parts)
    else:
        body = text.strip().removeprefix("<|python_tag|>").removeprefix("[TOOL_CALLS]").strip()
        content = text
        try:
            objs = json.loads(body) if body[:1] in "[{" else None
        except ValueError:
            objs = _split_json_objects(body) if fmt == "llama3_json" else None
        objs = [objs] if isinstance(objs, dict) else objs
        if isinstance(objs, list) and objs:
            parsed = [_as_call(o, "parameters" if fmt == "llama3_json" else "arguments") for o in objs]
            if all(p is not None for p in parsed):
                calls, content = parsed, ""
    content = content.strip()
    return (content or None), calls


def _split_json_objects(body: str) -> list | None:
    """Llama 3's several calls ``{...}; {...}`` as a list, or None."""
    try:
        return [json.loads(p) for p in body.split(";") if p.strip()]
    except ValueError:
        return None


class ToolStream:
    """Incremental :func:`parse_tool_calls` for a streamed choice: text pieces in, OpenAI
    deltas out, whose concatenation equals the non-streamed message (content and calls).

    hermes: content streams until ``<tool_call>`` (a piece that may begin it is held back);
    each call is sent once its JSON object and ``</tool_call>`` are complete, as two deltas (``id``, ``type``,
    ``function.name`` with empty ``arguments``, then the ``arguments``), as OpenAI streams
    them. Leading and trailing whitespace of the content is held back as
    :func:`parse_tool_calls` strips it. Other formats: everything is held to the end.
    """

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.buf = ""  # text not yet classified
        self.ws = ""  # whitespace held back inside the content
        self.started = False  # content sent so far (leading whitespace dropped)
        self.calls = 0
        self.all = ""

    def push(self, piece: str) -> list[dict]:
        """Deltas (``{"content": ...}`` or ``{"tool_calls": [...]}``) released by ``piece``."""
        self.all += piece
        if self.fmt != "hermes":
            return []
        self.buf += piece
        out: list[dict] = []
        while True:
            at = self.buf.find(_OPEN)
            if at < 0:
                keep = _partial_suffix(self.buf, _OPEN)
                self._content(self.buf[: len(self.buf) - keep], out)
                self.buf = self.buf[len(self.buf) - keep :]
                return out
            self._content(self.buf[:at], out)
            self.buf = self.buf[at:]
            call, end = _hermes_call(self.buf, 0)
            if call is None:  # not (yet) a complete call: held; at the end it is read as parse_tool_calls reads it
                return out
            out.extend(self._call_deltas(call))
            self.buf = self.buf[end:]

    def finish(self, truncated: bool = False) -> list[dict]:
        """The deltas left at the end of the output (``truncated``: it was cut by the
        length, as :func:`parse_tool_calls` takes it)."""
        out: list[dict] = []
        if self.fmt != "hermes":
            content, calls = parse_tool_calls(self.fmt, self.all, truncated)
            out = [{"content": content}] if content else []
            for c in calls:
                out.extend(self._call_deltas(c))
            return out
        parts, calls = _hermes(self.buf, truncated)  # what was held: text and calls as the whole-text parse splits them
        for text, call in zip(parts, [*calls, None]):
            self._content(text, out)
            if call is not None:
                out.extend(self._call_deltas(call))
        self.buf = ""
        return out

    def _content(self, text: str, out: list[dict]) -> None:
        if not text:
            return
        if not self.started:
            text = text.lstrip()
            if not text:
                return
        stripped = text.rstrip()
        if stripped:
            out.append({"content": self.ws + stripped})
            self.started, self.ws = True, ""
        self.ws += text[len(stripped) :]

    def _call_deltas(self, call: dict) -> list[dict]:
        i = self.calls
        self.calls += 1
        head = {"index": i, "id": call["id"], "type": "function", "function": {"name": call["function"]["name"], "arguments": ""}}
        return [{"tool_calls": [head]}, {"tool_calls": [{"index": i, "function": {"arguments": call["function"]["arguments"]}}]}]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
