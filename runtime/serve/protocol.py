"""The request bodies of the OpenAI-compatible routes (pydantic models) and their error text.

``POST /v1/completions`` and ``POST /v1/chat/completions`` take OpenAI's fields plus
specrt's ``top_k``, ``k_max``, ``threshold``, ``speculative`` and ``drafter``. Every optional field may
be sent as ``null``, which means its default (the OpenAI API allows null for all of them).
Unknown fields are refused (400, naming the allowed ones); the OpenAI fields this server
does not implement (presence and frequency penalties) are accepted only at the values that
change nothing, so a client never gets an output it did not ask for.

Structured output on both routes: OpenAI's ``response_format`` (``json_object``,
``json_schema``), ``logit_bias``, and the field's extensions: vLLM's ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar`` and llama.cpp's ``json_schema``,
``grammar`` (GBNF); one constraint per request. Chat adds ``tools``, ``tool_choice``,
``parallel_tool_calls`` (:mod:`specrt.runtime.serve.tools`); completions add ``suffix``
(fill-in-the-middle).

pydantic is part of the ``[serve]`` extra: the models are built on first use.
"""

from __future__ import annotations

import json
from typing import Sequence

__all__ = [
    "OPENAI_MAX_STOPS",
    "MAX_TEMPERATURE",
    "DEFAULT_MAX_TOKENS",
    "MAX_COMPLETION_LOGPROBS",
    "MAX_TOP_LOGPROBS",
    "MAX_N",
    "completion_request_model",
    "chat_request_model",
    "validation_message",
    "field_names",
    "CONSTRAINT_FIELDS",
]

OPENAI_MAX_STOPS = 4  # what the OpenAI API allows per request
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound for /v1/completions' logprobs
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat's top_logprobs
MAX_N = 128  # OpenAI's bound for n (and here for best_of)

# OpenAI fields accepted only at the values that change nothing (besides null)
NO_OP_VALUES = {
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
}
UNSUPPORTED_HINTS = {
    "presence_penalty": "only presence_penalty=0 (or null) is supported",
    "frequency_penalty": "only frequency_penalty=0 (or null) is supported",
}
# the request fields that carry a constraint (at most one per request), in the order named
CONSTRAINT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "json_schema", "grammar")

_models: dict[str, type] = {}


def _common_fields():
    """The pydantic base model of both request bodies (built once)."""
    if "common" in _models:
        return _models["common"]
    from typing import Any, Optional, Union

    from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

    class StreamOptions(BaseModel):
        """``stream_options``: ``include_usage`` adds a chunk with the usage block before [DONE]
        (and ``"usage": null`` in every other chunk)."""

        model_config = ConfigDict(extra="forbid")
        include_usage: Optional[StrictBool] = None

    class Common(BaseModel):
        """Fields of both routes (OpenAI's, then specrt's extensions)."""

        model_config = ConfigDict(extra="forbid")
        model: Optional[StrictStr] = None
        temperature: Optional[StrictFloat] = Field(None, ge=0.0, le=MAX_TEMPERATURE, description="default 1.0; 0 = greedy")
        top_p: Optional[StrictFloat] = Field(None, gt=0.0, le=1.0, description="default 1.0")
        n: Optional[StrictInt] = Field(None, ge=1, le=MAX_N, description="choices per prompt, default 1")
        stop: Optional[Union[StrictStr, list[StrictStr]]] = Field(None, description=f"up to {OPENAI_MAX_STOPS} stop strings")
        stream: Optional[StrictBool] = None
        stream_options: Optional[StreamOptions] = None
        seed: Optional[StrictInt] = Field(None, ge=0, le=2**63 - 1, description="choice i > 0 uses a seed derived from it (docs/guide/serving.md)")
        presence_penalty: Optional[StrictFloat] = None
        frequency_penalty: Optional[StrictFloat] = None
        logit_bias: Optional[dict[str, Any]] = None
        user: Optional[StrictStr] = None
        top_k: Optional[StrictInt] = Field(None, ge=0, description="specrt extension; 0 = off")
        k_max: Optional[StrictInt] = Field(None, description="specrt extension: most draft candidates per verification")
        threshold: Optional[StrictFloat] = Field(None, description="specrt extension: draft confidence threshold in [0, 1]")
        speculative: Optional[StrictBool] = Field(None, description="specrt extension: false runs the target alone")
        drafter: Optional[StrictStr] = Field(None, description="specrt extension: model, ngram, hybrid, suffix or suffix-model (default: the engine's)")
        response_format: Optional[dict[str, Any]] = Field(
            None, description='{"type": "text" | "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}'
        )
        guided_json: Optional[Union[dict[str, Any], StrictStr]] = Field(None, description="vLLM extension: a JSON schema the output matches")
        guided_regex: Optional[StrictStr] = Field(None, description="vLLM extension: a regular expression the whole output matches")
        guided_choice: Optional[list[StrictStr]] = Field(None, description="vLLM extension: the output is one of these strings")
        guided_grammar: Optional[StrictStr] = Field(None, description="vLLM extension: a grammar (GBNF, or llguidance's Lark)")
        json_schema: Optional[dict[str, Any]] = Field(None, description="llama.cpp extension: a JSON schema the output matches")
        grammar: Optional[StrictStr] = Field(None, description="llama.cpp extension: a GBNF grammar the output matches")

        @field_validator("stop")
        @classmethod
        def _stops(cls, v):
            if isinstance(v, list) and len(v) > OPENAI_MAX_STOPS:
                raise ValueError(f"at most {OPENAI_MAX_STOPS} stop strings are allowed")
            return v

        @field_validator("presence_penalty", "frequency_penalty")
        @classmethod
        def _no_op_only(cls, v, info):
            if v is not None and v not in NO_OP_VALUES[info.field_name]:
                raise ValueError(UNSUPPORTED_HINTS[info.field_name])
            return v

    _models["common"] = Common
    return Common


def completion_request_model():
    """The pydantic model of a ``POST /v1/completions`` body (built once)."""
    if "completion" in _models:
        return _models["completion"]
    from typing import Optional, Union

    from pydantic import Field, StrictBool, StrictInt, StrictStr

    Common = _common_fields()

    class CompletionRequest(Common):
        """Body of ``POST /v1/completions``."""

        prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]] = Field(
            description="a string, a list of token ids, or a list of those (one choice per prompt, times n)"
        )
        max_tokens: Optional[StrictInt] = Field(None, ge=0, description=f"default {DEFAULT_MAX_TOKENS}; 0 only with echo (scores the prompt)")
        best_of: Optional[StrictInt] = Field(None, ge=1, le=MAX_N, description="generate this many per prompt, return the n most probable")
        echo: Optional[StrictBool] = None
        logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS, description="alternatives per token (target's raw distribution)")
        suffix: Optional[StrictStr] = Field(
            None,
            description='fill-in-the-middle: the text after the gap (models with FIM tokens; "" is a suffix there); prefix and suffix are text',
        )

    _models["completion"] = CompletionRequest
    return CompletionRequest


def chat_request_model():
    """The pydantic model of a ``POST /v1/chat/completions`` body (built once)."""
    if "chat" in _models:
        return _models["chat"]
    from typing import Any, Literal, Optional, Union

    from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

    Common = _common_fields()

    class TextPart(BaseModel):
        """A content part (only ``text`` parts are rendered)."""

        model_config = ConfigDict(extra="allow")
        type: StrictStr
        text: Optional[StrictStr] = None

    class Message(BaseModel):
        """One chat message; other OpenAI message fields pass through to the template."""

        model_config = ConfigDict(extra="allow")
        role: Literal["system", "developer", "user", "assistant", "tool"]
        content: Optional[Union[StrictStr, list[TextPart]]] = None
        name: Optional[StrictStr] = None

    class ChatCompletionRequest(Common):
        """Body of ``POST /v1/chat/completions``."""

        messages: list[Message] = Field(min_length=1, description="the conversation, rendered with the model's chat template")
        add_generation_prompt: Optional[StrictBool] = Field(None, description="open an assistant turn after the messages (default true; vLLM/SGLang's field)")
        continue_final_message: Optional[StrictBool] = Field(
            None, description="continue the last message instead of opening a new turn (an assistant prefill; needs add_generation_prompt=false)"
        )
        max_tokens: Optional[StrictInt] = Field(None, ge=1, description="deprecated OpenAI name of max_completion_tokens")
        max_completion_tokens: Optional[StrictInt] = Field(None, ge=1, description="default: the rest of the context")
        logprobs: Optional[StrictBool] = Field(None, description="log-probabilities of the output tokens (target's raw distribution)")
        top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="alternatives per token; needs logprobs=true")
        tools: Optional[list[dict[str, Any]]] = Field(None, description='[{"type": "function", "function": {"name", "description", "parameters", "strict"}}]')
        tool_choice: Optional[Union[Literal["none", "auto", "required"], dict[str, Any]]] = Field(
            None, description='"none", "auto" (default with tools), "required", or {"type": "function", "function": {"name": ...}}'
        )
        parallel_tool_calls: Optional[StrictBool] = Field(None, description="several calls per turn (default true)")
        metadata: Optional[dict[str, Any]] = None
        store: Optional[StrictBool] = None

    _models["chat"] = ChatCompletionRequest
    return ChatCompletionRequest


def field_names(model) -> list[str]:
    """A request model's fields for messages: ``model``, then the route's own fields
    (``prompt``/``messages`` first), then the shared ones."""
    common = list(_common_fields().model_fields)
    own = [f for f in model.model_fields if f not in common]
    return ["model", *own, *(f for f in common if f != "model")]


def validation_message(errors: list[dict], fields: Sequence[str]) -> tuple[str, str | None]:
    """One readable message (and the first field at fault) from pydantic's error list:
    one part per field, naming it, what was sent and what is allowed."""
    by_field: dict[str, list[dict]] = {}
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            return f"request body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')})", None
        if not loc:
            got = err.get("input")
            if isinstance(got, (bytes, str)):
                # FastAPI parses JSON only under a JSON content type; anything else arrives raw
                return "request body must be a JSON object sent with Content-Type: application/json (this body was not read as JSON)", None
            return f"request body must be a JSON object, got {type(got).__name__}", None
        by_field.setdefault(loc[0], []).append(dict(err, _loc=loc))
    parts = []
    for name, errs in by_field.items():
        err = errs[0]
        etype, got, where = err.get("type", ""), err.get("input"), ".".join(err["_loc"])
        shown = json.dumps(got) if _jsonable(got) else repr(got)
        if len(shown) > 200:
            shown = shown[:200] + "..."
        if etype == "extra_forbidden" and len(err["_loc"]) == 1:
            parts.append(f"{name}: unknown field; allowed fields: {', '.join(fields)}")
        elif etype == "missing":
            parts.append(f"{where}: required field missing")
        elif name == "prompt" and (len(errs) > 1 or etype.endswith("_type")):
            parts.append(f"prompt: must be a string, a list of token ids, or a list of those (got {shown})")
        elif name == "stop" and len(errs) > 1:
            parts.append(f"stop: must be a string or a list of at most {OPENAI_MAX_STOPS} strings (got {shown})")
        elif name in UNSUPPORTED_HINTS and len(err["_loc"]) == 1:
            parts.append(f"{name}: {UNSUPPORTED_HINTS[name]} (got {shown})")
        elif name == "messages" and len(errs) > 1:
            parts.append(
                f"{where}: {err.get('msg', 'invalid value')} (got {shown}); a message is {{role, content}} with content a string or a list of text parts"
            )
        else:
            msg = err.get("msg", "invalid value").removeprefix("Value error, ")
            parts.append(f"{where}: {msg} (got {shown})")
    return "; ".join(parts), next(iter(by_field), None)


def _jsonable(x) -> bool:
    try:
        json.dumps(x)
        return True
    except (TypeError, ValueError):
        return False
