"""The serving logic behind the OpenAI routes, independent of the ASGI app that mounts it:
validation of a parsed request into a :class:`~specrt.runtime.serve.responses.Work` (one
generation per prompt x ``n``, or x ``best_of``) and queueing its jobs on a pool
(:class:`~specrt.runtime.serve.jobs.Pool`); the response objects are
:class:`~specrt.runtime.serve.responses.Responses` (``service.responses``). The same
:class:`CompletionService` serves ``specrt serve`` and a Ray Serve replica;
:mod:`specrt.runtime.serve.app` mounts it on FastAPI.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from dataclasses import replace

from ..errors import InputError, SpecRTError
from .jobs import Job
from .protocol import DEFAULT_MAX_TOKENS
from .responses import GenerationRequest, Responses, Work
from .structured import request_constraint
from .tools import ToolCalling

__all__ = ["RequestError", "CompletionService"]


class RequestError(SpecRTError):
    """A request the server refuses before queueing it.

    Attributes:
        status: HTTP status (400, 404, 413, ...).
        param: the request field at fault, or None.
        err_type: OpenAI error ``type`` (``invalid_request_error`` ...).
        code: OpenAI error ``code`` (``model_not_found`` ...), or None.
    """

    def __init__(self, message: str, param: str | None = None, status: int = 400, err_type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message, param)
        self.status, self.err_type, self.code = status, err_type, code


# ---- request handling (framework-independent parts) ------------------------------------
class CompletionService:
    """The serving logic behind the routes, independent of the ASGI app that mounts it
    (the same object serves ``specrt serve`` and a Ray Serve replica).

    Args:
        pool: a :class:`~specrt.runtime.serve.jobs.Pool`: the
            :class:`~specrt.runtime.serve.jobs.WorkerPool`, or the
            :class:`~specrt.runtime.serve.batching.BatchPool` (``serve --max-batch``).
        model_name: the id clients may send as ``model`` (any other is a 404).
        chat_template: a :class:`~specrt.runtime.chat.ChatTemplate`, or None (chat
            requests then get a 400 saying so).
        completions_special_tokens: ``"special"`` (a ``/v1/completions`` text prompt's
            control-token strings become their control ids) or ``"text"`` (they stay text);
            :data:`~specrt.runtime.serve.settings.COMPLETIONS_SPECIAL_TOKENS`.
        agent_drafter: the drafter of a chat request that carries tools, a tool result or
            an earlier tool call and names no drafter, where the engine's defaults are the draft
            model with adaptive k (:attr:`~specrt.runtime.serve.settings.ServeConfig.agent_drafter`);
            None: the engine's default for every request.

    Attributes:
        created: server start (Unix seconds), the ``created`` of ``/v1/models``.
        prompt_char_limit: text prompts (and rendered chats) longer than this many
            characters are refused before tokenizing: twice ``(max_ctx - 1) x`` the most
            UTF-8 bytes one token stands for, so such a prompt cannot fit the context
            (each token covers at most that many bytes; the factor 2 leaves room for
            tokenizers that normalise text).
    """

    def __init__(self, pool, model_name: str, chat_template=None, completions_special_tokens: str = "special", agent_drafter: str | None = None):
        from .metrics import ServerMetrics

        self.pool = pool
        self.model_name = model_name
        self.engine = pool.engines[0]  # validation and tokenizing only (no generation)
        manifest = self.engine.manifest
        self.metrics = ServerMetrics(model_name, manifest.k_max, lambda: (pool.workers, pool.busy, pool.queued, pool.max_queue), lambda: pool.prefix_tokens)
        pool.attach_metrics(self.metrics)  # a pool's own metrics (the BatchPool's) join this registry
        self.chat_template = chat_template
        self.completions_special_tokens = completions_special_tokens
        # where it was measured: a draft-model default with adaptive k (suffix-model prices its rounds by those costs)
        self.agent_drafter = agent_drafter if manifest.defaults.get("drafter", "model") == "model" and manifest.defaults.get("adaptive") else None
        self.created = int(time.time())
        self.prompt_char_limit = 2 * (manifest.max_ctx - 1) * self.engine.codec.max_token_bytes
        self.responses = Responses(model_name, self.engine.codec, manifest.stop_ids())
        self._ids = itertools.count(1)

    # -- validation --
    def check_model(self, model: str | None) -> None:
        """Raises RequestError (404, ``code: model_not_found``) for an id not served here."""
        if model is not None and model != self.model_name:
            raise RequestError(
                f"The model {model!r} does not exist: this server serves {self.model_name!r} (GET /v1/models)", "model", 404, code="model_not_found"
            )

    def _base_config(self, req, max_new_tokens: int, logprobs: int | None, constraint=None, drafter: str | None = None):
        """The request's resolved GenerationConfig (seed of choice 0), its constraint compiled
        (``constraint``, else the one the request's fields ask for); ``drafter``: the one
        used when the request names none (None: the engine's default)."""
        from ..config import GenerationConfig

        try:
            constraint = constraint or request_constraint(req)
        except InputError as e:
            raise _request_error(e) from None
        stop = req.stop
        if isinstance(stop, str):
            stop = (stop,)
        cfg = GenerationConfig(
            max_new_tokens=max_new_tokens,
            k_max=req.k_max,
            threshold=req.threshold,
            speculative=True if req.speculative is None else req.speculative,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=req.top_k or 0,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed,
            stop=tuple(stop or ()),
            logprobs=logprobs,
            constraint=constraint,
            logit_bias=req.logit_bias or (),
            drafter=req.drafter if req.drafter is not None else drafter,
        )
        try:
            return self.engine.resolve(cfg)
        except InputError as e:
            raise _request_error(e) from None

    def _prompt_ids(self, prompt, where: str, tokenize=None) -> list[int]:
        """Validated ids of one prompt (text longer than :attr:`prompt_char_limit` is refused
        untokenized); ``tokenize``: ``str -> ids`` for a text prompt (default: the engine's,
        control-token strings as control ids)."""
        if isinstance(prompt, str) and len(prompt) > self.prompt_char_limit:
            raise RequestError(
                f"{where} has {len(prompt)} characters; the context holds at most {self.engine.manifest.max_ctx - 1} prompt tokens, "
                f"so a prompt longer than {self.prompt_char_limit} characters cannot fit",
                "prompt" if where.startswith("prompt") else "messages",
            )
        try:
            return self.engine.prompt_ids(tokenize(prompt) if tokenize is not None and isinstance(prompt, str) else prompt)
        except InputError as e:
            msg = str(e) if where in ("prompt", "messages") else f"{where}: {e}"
            raise RequestError(msg, "prompt" if where.startswith("prompt") else "messages") from None

    def _check_total(self, total: int, param: str) -> None:
        if total > self.pool.max_queue:
            raise RequestError(f"{param}: this request asks for {total} generations; this server queues at most {self.pool.max_queue} (--max-queue)", param)

    def prepare_completion(self, req) -> Work:
        """The :class:`Work` of a validated ``/v1/completions`` body (runs off the event loop).

        Raises:
            RequestError: wrong model (404), several ``n``/``best_of``/``echo``/``max_tokens``
                combinations OpenAI refuses, or what the engine refuses (prompt too long or
                empty, ids outside the vocabulary, k_max/threshold out of range, ...).
        """
        self.check_model(req.model)
        n = req.n or 1
        best_of = req.best_of or n
        if best_of < n:
            raise RequestError(f"best_of={best_of} must be >= n={n}", "best_of")
        stream = bool(req.stream)
        if stream and best_of > n:
            raise RequestError("best_of > n cannot be streamed (the best choices are known only at the end); use stream=false", "best_of")
        _check_stream_options(req, stream)
        echo = bool(req.echo)
        max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        if max_tokens == 0 and not echo:
            raise RequestError("max_tokens=0 is allowed only with echo=true (it returns the prompt, scored with logprobs)", "max_tokens")
        prompt = req.prompt
        prompts = [prompt] if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int) else list(prompt)
        self._check_total(len(prompts) * best_of, "n" if req.best_of is None else "best_of")
        fim = self._fim(req, prompts, echo)
        logprobs = req.logprobs
        cfg = self._base_config(req, max(max_tokens, 1), logprobs if logprobs is not None else (0 if best_of > n else None))
        gens, prompt_tokens = [], 0
        for p, pr in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{p}]"
            ids = self._prompt_ids(pr, where, self._tokenizer(fim, req.suffix))
            prompt_tokens += len(ids)
            echo_text = (pr if isinstance(pr, str) else self.engine.codec.decode(ids)) if echo else None
            for j in range(best_of):
                gens.append(GenerationRequest(p, ids, _choice_config(cfg, j), echo_text, logprobs if echo else None, max_tokens > 0))
        return Work(False, gens, n, best_of, stream, _include_usage(req), logprobs, prompt_tokens)

    def _tokenizer(self, fim, suffix: str | None):
        """``str -> ids`` of a completion's text prompt: the FIM layout with ``suffix`` (prefix
        and suffix as text), the prompt as text (``completions_special_tokens`` "text",
        BOS as the manifest says), or None (the engine's: control-token strings special)."""
        codec = self.engine.codec
        if fim is not None:
            return lambda prefix: fim.ids(codec, prefix, suffix)
        if self.completions_special_tokens == "text":
            return lambda text: codec.encode_text(text, add_special_tokens=True)
        return None

    def _fim(self, req, prompts: list, echo: bool):
        """The model's FIM tokens when the request has a ``suffix`` (None without one). An
        empty suffix is a suffix (an editor at the end of a file sends it) on a model with
        FIM tokens; on one without, the prompt is a plain completion (nothing follows it).

        Raises:
            RequestError: a suffix with token-id prompts or ``echo``, or a non-empty suffix
                on a model without FIM tokens.
        """
        if req.suffix is None:
            return None
        from .structured import fim_tokens

        fim = fim_tokens(self.engine.codec)
        if fim is None and req.suffix == "":
            return None
        if not all(isinstance(p, str) for p in prompts):
            raise RequestError("suffix needs text prompts (fill-in-the-middle lays out prefix, suffix and the model's FIM tokens); got token ids", "suffix")
        if echo:
            raise RequestError("suffix cannot be combined with echo", "suffix")
        if fim is None:
            raise RequestError(
                f"suffix: model {self.model_name!r} has no fill-in-the-middle tokens in its tokenizer (such as <|fim_prefix|>, <|fim_suffix|>, "
                "<|fim_middle|>); send the prompt without suffix",
                "suffix",
            )
        return fim

    def _check_tool_schemas(self, tools) -> None:
        """Each tool's parameters compile as a JSON-schema constraint (whatever the
        tool_choice: a schema the engine cannot enforce is refused up front, naming the tool).

        Raises:
            InputError: (param ``tools``) the first schema that does not compile.
        """
        from ..constraints import Constraint

        gt = self.engine.grammar_tokenizer()
        for i, spec in enumerate(tools.tools):
            try:
                gt.matcher(Constraint.json_schema(spec.parameters, f"tools[{i}].function.parameters ({spec.name})"))
            except InputError as e:
                raise InputError(str(e), "tools") from None

    def prepare_chat(self, req) -> Work:
        """The :class:`Work` of a validated ``/v1/chat/completions`` body: the conversation
        rendered with the chat template (:mod:`specrt.runtime.chat`), tokenized without
        adding BOS (runs off the event loop).

        Raises:
            RequestError: wrong model (404), no chat template, the template refusing the
                conversation, ``top_logprobs`` without ``logprobs``, or what the engine
                refuses.
        """
        from ..chat import normalize_messages

        self.check_model(req.model)
        if self.chat_template is None:
            raise RequestError(
                f"model {self.model_name!r} has no chat template: its engine folder has no chat_template.jinja (the target checkpoint had none) "
                "and the server was started without --chat-template FILE; use /v1/completions, or restart with --chat-template",
                "messages",
                code="chat_template_missing",
            )
        if req.top_logprobs is not None and not req.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
        stream = bool(req.stream)
        _check_stream_options(req, stream)
        n = req.n or 1
        self._check_total(n, "n")
        try:
            tools = ToolCalling.build(self.chat_template.source, req.tools, req.tool_choice, req.parallel_tool_calls, self.engine.codec.tokenizer.token_to_id)
            if tools is not None:
                self._check_tool_schemas(tools)
                if tools.constraint is not None and request_constraint(req) is not None:
                    what = {"required": 'tool_choice "required"', "named": f"tool_choice naming {tools.name!r}"}.get(
                        tools.mode, 'a strict tool under tool_choice "auto"'
                    )
                    raise InputError(
                        f"{what} constrains the output to tool calls (a grammar); it cannot be combined with response_format or a guided_* field", "tool_choice"
                    )
            codec = self.engine.codec
            # client strings escaped: only the template's own markup becomes control tokens (runtime/chat.py)
            text = self.chat_template.render(
                normalize_messages([m.model_dump(exclude_none=True) for m in req.messages]),
                add_generation_prompt=True if req.add_generation_prompt is None else req.add_generation_prompt,
                continue_final_message=bool(req.continue_final_message),
                tools=tools.openai_tools() if tools is not None else None,
                escape=codec.escape,
            )
        except InputError as e:
            raise _request_error(e) from None
        if len(text) > self.prompt_char_limit:
            self._prompt_ids(text, "the rendered conversation")
        try:
            ids = self.engine.prompt_ids(codec.encode_escaped(text))
        except InputError as e:
            raise RequestError(f"the rendered conversation: {e}", "messages") from None
        top_n = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens or req.max_tokens or (self.engine.manifest.max_ctx - len(ids))
        agent = self.agent_drafter if self.agent_drafter and is_agent_traffic(req) else None
        cfg = self._base_config(req, max_tokens, top_n, tools.constraint if tools is not None else None, agent)
        gens = [GenerationRequest(0, ids, _choice_config(cfg, j)) for j in range(n)]
        return Work(True, gens, n, n, stream, _include_usage(req), top_n, len(ids), tools)

    # -- ids, queue --
    def new_id(self, chat: bool = False) -> str:
        """A fresh response id (``cmpl-...`` or ``chatcmpl-...``)."""
        return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}{next(self._ids)}"

    def submit(self, work: Work) -> tuple[list[Job], asyncio.Queue]:
        """Queue the work's jobs (all or none); their events arrive on the returned
        asyncio.Queue (this loop's) as ``(generation index, event)``.

        Raises:
            ServerBusy: the queue has no room for all of them.
        """
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emitter(i):
            def emit(ev, _put=events.put_nowait):
                try:
                    loop.call_soon_threadsafe(_put, (i, ev))
                except RuntimeError:  # loop closed (server shutting down)
                    pass

            return emit

        jobs = [
            Job(
                ids=g.ids,
                config=g.config,
                emit=emitter(i),
                stream=work.stream,
                echo=g.echo_text is not None,
                prompt_logprobs=g.prompt_logprobs,
                generate=g.generate,
            )
            for i, g in enumerate(work.gens)
        ]
        self.pool.submit_all(jobs)
        return jobs, events

    # -- responses --


def is_agent_traffic(req) -> bool:
    """Whether a chat request is an agent's: it offers ``tools``, or its messages hold a tool
    result (role ``tool``) or an assistant's tool call."""
    if req.tools:
        return True
    for m in req.messages:
        if m.role == "tool" or (m.role == "assistant" and getattr(m, "tool_calls", None)):
            return True
    return False


def _choice_config(cfg, j: int):
    """The config of choice ``j``: the seed derived per choice (:func:`~specrt.runtime.sampling.derive_seed`)."""
    from ..sampling import derive_seed

    return cfg if j == 0 else replace(cfg, seed=derive_seed(cfg.seed, j))


def _include_usage(req) -> bool:
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


def _check_stream_options(req, stream: bool) -> None:
    if req.stream_options is not None and not stream:
        raise RequestError("stream_options: only allowed with stream=true", "stream_options")


def _request_error(e: InputError) -> RequestError:
    """An engine refusal as a 400, with GenerationConfig's names mapped to OpenAI's."""
    msg, param = str(e), e.param
    if param == "max_new_tokens":
        param, msg = "max_tokens", msg.replace("max_new_tokens", "max_tokens")
    return RequestError(msg, param)
