"""Chat templates: a conversation -> the prompt text the model was trained on, rendered as
transformers' ``apply_chat_template`` renders it. One module below its users: the server's
chat completions, ``specrt generate --chat`` and the bench's ``messages`` prompts.

The template (Jinja2 source) comes from the engine folder (``chat_template.jinja``, copied by
``specrt export`` from the target checkpoint and hashed in the manifest) or from
``specrt serve --chat-template FILE``. It is compiled once in Jinja2's
``ImmutableSandboxedEnvironment`` with the environment transformers gives templates
(``transformers.utils.chat_template_utils._cached_compile_jinja_template``): ``trim_blocks``
and ``lstrip_blocks``, the ``loopcontrols`` extension, the globals ``raise_exception`` and
``strftime_now``, and a ``tojson`` filter that does not escape non-ASCII
(``ensure_ascii=False``). A template is untrusted code: the sandbox refuses attribute access
to Python internals, and the immutable variant refuses mutating lists and dicts.

Rendering passes ``messages``, ``add_generation_prompt=True``, and the tokenizer's special
tokens as strings (``bos_token``, ``eos_token``, as transformers' ``special_tokens_map``);
the rendered text is then tokenized *without* adding BOS (transformers' rule for
``apply_chat_template(tokenize=True)``): a template that wants BOS writes ``{{ bos_token }}``
itself.

Roles cannot be forged: every string the client sent (message content of every role, tool
results, tool-call arguments, names, tool descriptions) goes through
:meth:`~specrt.runtime.tokenizer.TextCodec.escape` before rendering (:func:`escape_strings`)
and the output is tokenized with
:meth:`~specrt.runtime.tokenizer.TextCodec.encode_escaped`: a ``<|im_end|>`` typed in a
message is text, only the template's own markup gets control ids (:func:`chat_ids`). A chat
without control-token strings in it gets exactly the ids of ``encode(rendered text)``.

Jinja2 is part of the ``[serve]`` extra; it is imported only when a template is compiled.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Sequence

from .errors import InputError, SpecRTError

__all__ = [
    "ChatTemplate",
    "TemplateSourceError",
    "chat_ids",
    "engine_chat_ids",
    "escape_strings",
    "load_chat_template",
    "normalize_messages",
    "special_token_strings",
]


class TemplateSourceError(SpecRTError):
    """A chat template that cannot be read or compiled (the server refuses to start)."""


class ChatTemplate:
    """A compiled chat template.

    Args:
        source: the Jinja2 template text.
        origin: where it came from (named in messages: a file path).
        special_tokens: the strings passed to the template besides ``messages`` (e.g.
            ``{"bos_token": "<s>", "eos_token": "</s>"}``).

    Attributes:
        source, origin, special_tokens: as given.

    Raises:
        TemplateSourceError: Jinja2 is missing or the template does not compile (the
            message names ``origin`` and the line).
    """

    def __init__(self, source: str, origin: str, special_tokens: dict[str, str] | None = None):
        try:
            import jinja2
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as e:
            raise TemplateSourceError(f"chat templates need jinja2 (the [serve] extra): pip install -e '.[serve]' in the specrt checkout ({e})") from None

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        def strftime_now(fmt):
            return datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise TemplateSourceError(f"chat template {origin}: line {e.lineno}: {e.message}") from None
        self._errors = (jinja2.exceptions.TemplateError,)
        self.source, self.origin = source, origin
        self.special_tokens = dict(special_tokens or {})

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list | None = None,
        escape: Callable[[str], str] | None = None,
    ) -> str:
        """The prompt text of a conversation.

        Args:
            messages: ``[{"role": ..., "content": str, ...}, ...]`` (see :func:`normalize_messages`).
            add_generation_prompt: append the template's opening of an assistant turn.
            continue_final_message: leave the last message open, so the model continues it
                (an assistant prefill), as transformers' ``apply_chat_template(...,
                continue_final_message=True)``: the last message's content gets
                transformers' marker appended, and the rendered text is cut where the
                marker appears (its end-of-turn tokens dropped; when the template trims
                the content, trailing whitespace is removed too: :func:`_cut_at_tag`).
            tools: OpenAI tool objects (``{"type": "function", "function": {...}}``) the
                template renders (transformers' ``tools``), or None.
            escape: applied to every string of ``messages`` and ``tools`` before rendering
                (:func:`escape_strings`; :meth:`~specrt.runtime.tokenizer.TextCodec.escape`
                so that the output goes to ``encode_escaped``), or None.

        Returns:
            the rendered text (to be tokenized without adding BOS).

        Raises:
            InputError: (param ``messages``) the template refused the conversation
                (``raise_exception``, a sandbox violation, or any other template error);
                the message carries the template's own text. (param
                ``continue_final_message``) both flags set, or the last message's content
                is not found in the rendered text.
        """
        if continue_final_message and add_generation_prompt:
            raise InputError(
                "continue_final_message and add_generation_prompt cannot both be true: a continued message is the "
                "generation's start (send add_generation_prompt: false)",
                "continue_final_message",
            )
        if escape is not None:
            messages, tools = escape_strings(messages, escape), (escape_strings(tools, escape) if tools is not None else None)
        messages = list(messages)
        final = None
        if continue_final_message:
            final = messages[-1].get("content", "") if messages else ""
            if not isinstance(final, str) or not final.strip():
                raise InputError("continue_final_message: the last message has no content to continue", "continue_final_message")
            messages[-1] = dict(messages[-1], content=final + _CONTINUE_TAG)
        try:
            text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools, documents=None, **self.special_tokens)
        except (*self._errors, TypeError, ValueError) as e:  # a template tripping over a value (e.g. tojson of an undefined field) is the request's fault
            raise InputError(f"messages: the chat template refused the conversation: {type(e).__name__}: {e}", "messages") from None
        return text if final is None else _cut_at_tag(text, final)


# transformers' marker for continue_final_message (render_jinja_template): appended to the
# last message's content, then the rendered text is cut where it appears
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _cut_at_tag(text: str, final: str) -> str:
    """``text`` cut where the continued message ends (transformers' rule in
    ``render_jinja_template``: at the tag when the template kept the tag's trailing space,
    else at the tag with trailing whitespace removed: the template trimmed the content).

    Raises:
        InputError: (param ``continue_final_message``) the content or the tag is not in ``text``.
    """
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise InputError(
            "continue_final_message: the last message's content does not appear in the rendered conversation "
            "(the chat template rewrites it); send it without continue_final_message",
            "continue_final_message",
        )
    at = text.rindex(tag)
    return text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()


def special_token_strings(engine) -> dict[str, str]:
    """The special tokens a template sees, as strings (``bos_token``, ``eos_token``,
    ``pad_token``: transformers' ``special_tokens_map``), from an Engine's manifest ids."""
    m, out = engine.manifest, {}
    for key, tid in (("bos_token", m.bos_token_id), ("eos_token", m.eos_token_id), ("pad_token", m.pad_token_id)):
        if tid is not None and (tok := engine.codec.tokenizer.id_to_token(tid)) is not None:
            out[key] = tok
    return out


def engine_chat_ids(engine, messages: Sequence[dict[str, Any]]) -> list[int]:
    """Token ids of ``messages`` rendered with the engine folder's own chat template and a
    generation prompt, tokenized without adding BOS: what the server's chat completions feed
    the model (``specrt generate --chat``, ``specrt bench``/``tune`` prompt files with
    ``messages`` lines).

    Raises:
        InputError: the engine folder has no chat template (its target checkpoint had none),
            or a message part that is not text.
        TemplateSourceError: the template does not compile.
    """
    if engine.chat_template is None:
        raise InputError(f"the engine folder {engine.folder} has no chat template (its target checkpoint had none); give plain prompts", "messages")
    tpl = ChatTemplate(engine.chat_template, str(engine.folder / engine.manifest.chat_template_file), special_token_strings(engine))
    return chat_ids(tpl, engine.codec, normalize_messages(messages))


def escape_strings(value: Any, escape: Callable[[str], str]) -> Any:
    """``value`` (messages, tools: dicts, lists, strings, numbers) with ``escape`` applied
    to every string in it, dict keys included (a tool-call argument's name is client text
    too)."""
    if isinstance(value, str):
        return escape(value)
    if isinstance(value, dict):
        return {escape(k) if isinstance(k, str) else k: escape_strings(v, escape) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [escape_strings(v, escape) for v in value]
    return value


def chat_ids(template: "ChatTemplate", codec, messages: Sequence[dict[str, Any]], tools: list | None = None, **flags) -> list[int]:
    """Token ids (no BOS added) of ``messages`` (normalized: :func:`normalize_messages`) and
    ``tools`` rendered by ``template``, client strings as text (module docstring).

    Args:
        codec: the :class:`~specrt.runtime.tokenizer.TextCodec`.
        flags: :meth:`ChatTemplate.render`'s ``add_generation_prompt``, ``continue_final_message``.

    Raises:
        InputError: what :meth:`ChatTemplate.render` and
            :meth:`~specrt.runtime.tokenizer.TextCodec.encode_escaped` raise.
    """
    return codec.encode_escaped(template.render(messages, tools=tools, escape=codec.escape, **flags))


def load_chat_template(path: str | Path, special_tokens: dict[str, str] | None = None) -> ChatTemplate:
    """Read and compile a template file (``specrt serve --chat-template FILE``).

    Raises:
        TemplateSourceError: the file cannot be read as UTF-8 text, or does not compile.
    """
    p = Path(path)
    try:
        source = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TemplateSourceError(f"--chat-template {p}: cannot read it ({e})") from None
    return ChatTemplate(source, str(p), special_tokens)


def normalize_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages -> the dicts a template sees.

    Each message keeps its fields (``None`` values dropped); ``content`` given as a list of
    parts must hold only ``{"type": "text", "text": ...}`` parts, which are joined with
    ``"\\n"`` into one string (vLLM's "string" content format; templates written for
    transformers read ``message['content']`` as a string); ``None`` content becomes ``""``.
    An assistant message's ``tool_calls`` keep their fields, with ``function.arguments``
    given as JSON text parsed into an object (templates write ``arguments | tojson``; vLLM
    and transformers pass them as objects).

    Raises:
        InputError: (param ``messages``) a part that is not text.
    """
    out = []
    for i, m in enumerate(messages):
        d = {k: v for k, v in m.items() if v is not None}
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise InputError(f"messages[{i}].content[{j}]: only text parts are supported (type 'text'), got {kind!r}", "messages")
                texts.append(part["text"])
            content = "\n".join(texts)
        d["content"] = "" if content is None else content
        if "tool_calls" in d:
            d["tool_calls"] = [_parsed_arguments(c) for c in _checked_tool_calls(d["tool_calls"], i)]
        out.append(d)
    return out


def _checked_tool_calls(calls: Any, i: int) -> list:
    """An assistant message's ``tool_calls`` as OpenAI defines them: a list of
    ``{"id", "type": "function", "function": {"name": str, "arguments": str or object}}``.

    Raises:
        InputError: (param ``messages``) another shape, naming the message and the call.
    """
    if not isinstance(calls, list):
        raise InputError(f"messages[{i}].tool_calls must be a list of tool calls, got {type(calls).__name__}", "messages")
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments", "{}"), (str, dict)):
            raise InputError(
                f'messages[{i}].tool_calls[{j}]: a tool call is {{"id", "type": "function", "function": {{"name": str, "arguments": str}}}}', "messages"
            )
    return calls


def _parsed_arguments(call: Any) -> Any:
    """A tool call with its ``function.arguments`` JSON text parsed (left as it is when it
    is not a JSON object)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call
    return dict(call, function=dict(fn, arguments=args)) if isinstance(args, dict) else call
