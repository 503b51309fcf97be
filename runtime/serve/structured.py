"""The request fields that shape the output, turned into runtime settings: a
:class:`~specrt.runtime.constraints.Constraint` from ``response_format`` or one of the
field's extensions (vLLM's ``guided_*``, llama.cpp's ``json_schema``/``grammar``), and the
fill-in-the-middle prompt of a completion with a ``suffix``.

Fill-in-the-middle: the model's FIM tokens are read from its tokenizer (added tokens named
like ``<|fim_prefix|>``/``<|fim_suffix|>``/``<|fim_middle|>`` as Qwen2.5-Coder,
``<fim_prefix>`` as StarCoder, ``<｜fim▁begin｜>``/``hole``/``end`` as DeepSeek-Coder,
``<PRE>``/``<SUF>``/``<MID>`` as CodeLlama); the prompt is laid out prefix-suffix-middle
(PSM), as llama.cpp's ``/infill`` and the models' own FIM examples do:
``<prefix token> prefix <suffix token> suffix <middle token>``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ..constraints import Constraint
from ..errors import InputError
from .protocol import CONSTRAINT_FIELDS

__all__ = ["request_constraint", "FimTokens", "fim_tokens"]


def request_constraint(req) -> Constraint | None:
    """The constraint a request asks for, or None.

    ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}`` (any
    JSON object), ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...},
    "strict": ...}}`` (the schema, enforced whether or not ``strict`` is set, as vLLM and
    llama.cpp do; ``schema`` is optional in OpenAI's API: without it the output is any JSON
    value, as llama.cpp's server reads it). ``guided_json``/``json_schema``: a schema; ``guided_regex``: a regular
    expression; ``guided_choice``: a list of strings; ``guided_grammar``/``grammar``: a
    GBNF (or llguidance Lark) grammar.

    Raises:
        InputError: (param: the field) two constraint fields in one request, or a
            ``response_format`` of another shape.
    """
    given = [f for f in CONSTRAINT_FIELDS if getattr(req, f, None) is not None]
    if len(given) > 1:
        raise InputError(f"{given[0]} and {given[1]} both constrain the output; send one of them", given[1])
    if not given:
        return None
    field = given[0]
    value = getattr(req, field)
    if field == "response_format":
        return _response_format(value)
    if field in ("guided_json", "json_schema"):
        if isinstance(value, str):
            return Constraint("json_schema", value, field)
        return Constraint.json_schema(value, field)
    if field == "guided_regex":
        return Constraint.regex(value, field)
    if field == "guided_choice":
        return Constraint("choice", json.dumps(value), field)
    return Constraint("grammar", value, field)


def _response_format(rf: dict) -> Constraint | None:
    kind = rf.get("type")
    if kind == "text" and len(rf) == 1:
        return None
    if kind == "json_object" and len(rf) == 1:
        return Constraint.json_schema({"type": "object"}, "response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", js["name"]):
            raise InputError(
                'response_format.json_schema needs "name" (1-64 letters, digits, "_" or "-"); its "schema" (a JSON schema object) is optional '
                "(without it: any JSON value)",
                "response_format",
            )
        schema = js.get("schema")
        schema = {} if schema is None else schema
        if not isinstance(schema, dict):
            raise InputError("response_format.json_schema.schema must be a JSON schema object", "response_format")
        return Constraint.json_schema(schema, "response_format")
    raise InputError(
        f'response_format={json.dumps(rf)[:120]}; allowed: {{"type": "text"}}, {{"type": "json_object"}}, '
        '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...} (optional)}}',
        "response_format",
    )


@dataclass(frozen=True)
class FimTokens:
    """A tokenizer's fill-in-the-middle token ids (prefix, suffix, middle)."""

    prefix: int
    suffix: int
    middle: int

    def ids(self, codec, prefix: str, suffix: str) -> list[int]:
        """The PSM prompt ids: ``[BOS] <prefix> prefix <suffix> suffix <middle>``, prefix and
        suffix tokenized as text (:meth:`~specrt.runtime.tokenizer.TextCodec.encode_text`:
        a source file holding the string ``<|fim_middle|>`` or ``<|endoftext|>`` gets the
        ids of its characters, as llama.cpp's ``/infill`` tokenizes them)."""
        enc = lambda t: codec.encode_text(t) if t else []  # noqa: E731
        head = [codec.bos] if codec.bos is not None else []
        return head + [self.prefix, *enc(prefix), self.suffix, *enc(suffix), self.middle]


_ROLES = {
    "prefix": re.compile(r"fim.?(prefix|pre|begin)\b|^<pre>$|^\[prefix\]$"),
    "suffix": re.compile(r"fim.?(suffix|suf|hole)\b|^<suf>$|^\[suffix\]$"),
    "middle": re.compile(r"fim.?(middle|mid|end)\b|^<mid>$|^\[middle\]$"),
}


def fim_tokens(codec) -> FimTokens | None:
    """The FIM tokens among a tokenizer's added tokens (module docstring), or None when it
    has not all three."""
    found: dict[str, int] = {}
    for tid, tok in sorted(codec.tokenizer.get_added_tokens_decoder().items()):
        name = tok.content.strip("▁ ").lower().replace("｜", "|").replace("▁", "_")
        for role, pat in _ROLES.items():
            if role not in found and pat.search(name):
                found[role] = tid
    if len(found) < 3:
        return None
    return FimTokens(found["prefix"], found["suffix"], found["middle"])
