"""``specrt serve``'s settings and their declared defaults: :class:`ServeConfig` and the
constants the pools, the app and the CLI share. It imports nothing of the server, so the CLI
reads its options' defaults and choices here without loading the serving modules.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from ..hostcache import DEFAULT_CACHE_RAM_MIB
from ..slots import DEFAULT_SLOT_WAIT_MS, DEFAULT_SLOT_WAIT_REQUESTS

__all__ = [
    "ServeConfig",
    "serve_default",
    "BATCH_POLICIES",
    "COMPLETIONS_SPECIAL_TOKENS",
    "DEFAULT_AGENT_DRAFTER",
    "DEFAULT_BATCH_POLICY",
    "ENGINE_DRAFTER",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_QUEUE",
    "DEFAULT_SLOT_WAIT_MS",
    "DEFAULT_SLOT_WAIT_REQUESTS",
    "LOG_LEVELS",
]

BATCH_POLICIES = ("auto", "speculate", "batched")  # the batch scheduler's (batching.choose_mode)
DEFAULT_BATCH_POLICY = "auto"
DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: a request body above it gets 413 before it is parsed
DEFAULT_MAX_QUEUE = 64  # generations that may wait for a worker or a slot (503 beyond)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")  # uvicorn's levels, the server log's too
# how a /v1/completions text prompt's control-token strings are read: "special" = their
# control ids (llama-server and vLLM do the same), "text" = the text of their characters
COMPLETIONS_SPECIAL_TOKENS = ("special", "text")
# agent traffic's drafter (ServeConfig.agent_drafter): suffix-model tied the suffix and n-gram
# drafters on agent traces and keeps the draft model for long generated text where it pays
DEFAULT_AGENT_DRAFTER = "suffix-model"
ENGINE_DRAFTER = "engine"  # agent_drafter: no override, the engine's default


@dataclass(frozen=True)
class ServeConfig:
    """Every setting of ``specrt serve`` (the CLI builds one;
    :func:`~specrt.runtime.serve.server.build_service` and
    :func:`~specrt.runtime.serve.server.serve` take it).

    Attributes:
        engines: the engine folder.
        host, port: where uvicorn listens.
        workers: generator workers (Engines); workers x onnxruntime threads should not
            exceed the cores.
        max_queue: generations that may wait for a worker (503 beyond).
        threads: :class:`~specrt.runtime.backends.base.ThreadConfig` for every Engine (None:
            the default).
        backend: Engine backend (None: the machine's default).
        model_name: the ``model`` id clients use (None: the folder's name).
        log_level: uvicorn's and the server log's level.
        round_delay: test hook: seconds to sleep after each piece
            (:class:`~specrt.runtime.serve.jobs.WorkerPool`).
        chat_template: a Jinja2 template file overriding the folder's ``chat_template.jinja``.
        api_key: when set, ``/v1/*`` needs ``Authorization: Bearer <api_key>``.
        allowed_origins: browser origins allowed by CORS (``"*"`` = any).
        max_body_bytes: larger request bodies get 413 unparsed.
        max_batch: > 0: continuous batching of up to this many requests in one scheduler
            (:class:`~specrt.runtime.serve.batching.BatchPool`; ``workers`` is ignored).
        batch_policy, max_tokens_in_flight: the BatchPool's ``policy`` and ``max_tokens``.
        prefix_cache_tokens: the prefix cache's budget in tokens over all workers
            (:class:`~specrt.runtime.serve.jobs.WorkerPool`) or batch slots
            (:class:`~specrt.runtime.serve.batching.BatchPool`); None: no limit but the KV
            buffers; 0: off.
        cache_ram_mib: the host prompt cache's budget in MiB: idle slots' histories copied
            to host RAM when a request takes their slot, and back when they return
            (:mod:`specrt.runtime.hostcache`, llama-server's ``--cache-ram``); 0: off.
        slot_wait_ms, slot_wait_requests: how long a waiting request may be passed over by
            later ones that take the free slot holding their own history
            (:class:`~specrt.runtime.slots.SlotPolicy`: milliseconds from the first pass,
            passes; ``slot_wait_requests`` 0: first come first served).
        completions_special_tokens: one of :data:`COMPLETIONS_SPECIAL_TOKENS`: how a
            ``/v1/completions`` text prompt's control-token strings (``<|im_start|>``,
            ``<|endoftext|>``) are tokenized. Chat content, tool results and FIM
            prefix/suffix are always text.
        agent_drafter: the drafter of agent traffic: a chat request that carries ``tools``,
            a tool result or an earlier tool call and names no ``drafter``, on an engine
            whose defaults are the draft model with adaptive k (a GGUF pair's kernels folder;
            measured there on agent traces: the draft model took 1.37x the time of the
            suffix-based drafters, docs/guide/agents.md).
            :data:`ENGINE_DRAFTER` (``"engine"``): the engine's default, as other requests.
    """

    engines: str | Path
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1
    max_queue: int = DEFAULT_MAX_QUEUE
    threads: object = None
    backend: str | None = None
    model_name: str | None = None
    log_level: str = "info"
    round_delay: float = 0.0
    chat_template: str | Path | None = None
    api_key: str | None = None
    allowed_origins: tuple = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_batch: int = 0
    batch_policy: str = DEFAULT_BATCH_POLICY
    max_tokens_in_flight: int | None = None
    prefix_cache_tokens: int | None = None
    cache_ram_mib: int = DEFAULT_CACHE_RAM_MIB
    slot_wait_ms: float = DEFAULT_SLOT_WAIT_MS
    slot_wait_requests: int = DEFAULT_SLOT_WAIT_REQUESTS
    completions_special_tokens: str = "special"
    agent_drafter: str = DEFAULT_AGENT_DRAFTER


def serve_default(name: str):
    """The declared default of a :class:`ServeConfig` field (the CLI's defaults)."""
    return next(f.default for f in fields(ServeConfig) if f.name == name)
