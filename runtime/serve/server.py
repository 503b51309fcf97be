"""``specrt serve``: the assembly of the OpenAI-compatible server from one :class:`ServeConfig`.

Layout (one process)::

    uvicorn (asyncio, FastAPI: app.py)  --parse-->  executor thread: validate, render, tokenize (service.py)
         |                                               |
         |     one asyncio.Queue per request  <----------+-- Pool (jobs.py): bounded queue --> N worker threads,
         ^   <-- text pieces / results (each generation = one Job) --         or the batch scheduler (batching.py)

Modules, one job each: :mod:`.jobs` (the job contract, the ``Pool`` protocol, the worker
pool), :mod:`.batching` (continuous batching), :mod:`.service` (request validation and
response objects), :mod:`.app` (the FastAPI routes and streaming), :mod:`.settings`
(:class:`ServeConfig` and the declared defaults), this module (building and running them).
Imports go one way: app -> service -> jobs; batching -> jobs; all -> settings.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path

from ..errors import InputError
from ..slots import SlotPolicy
from .app import create_app, require_serve_extra
from .jobs import Job, Pool, ServeError, ServerBusy, WorkerPool
from .responses import LOGPROB_FLOOR, GenerationRequest, Responses, Work, error_body, usage_block
from .service import CompletionService, RequestError
from .settings import COMPLETIONS_SPECIAL_TOKENS, DEFAULT_MAX_BODY_BYTES, ENGINE_DRAFTER, ServeConfig

__all__ = [
    "ServeConfig",
    "build_service",
    "serve",
    "available_cores",
    # re-exported: the server's public names in one place
    "DEFAULT_MAX_BODY_BYTES",
    "LOGPROB_FLOOR",
    "ServeError",
    "ServerBusy",
    "RequestError",
    "Job",
    "Pool",
    "WorkerPool",
    "GenerationRequest",
    "Work",
    "Responses",
    "usage_block",
    "CompletionService",
    "error_body",
    "create_app",
]

log = logging.getLogger("specrt.serve")


def _load_pool(cfg: ServeConfig) -> Pool:
    """The worker pool, or the batch scheduler with ``max_batch`` (each with the prefix
    cache's budget and the slot rule's bound).

    Raises:
        ServeError: bad pool settings (the pools' own checks).
    """
    try:
        policy = SlotPolicy(wait_ms=cfg.slot_wait_ms, wait_requests=cfg.slot_wait_requests)
    except InputError as e:
        raise ServeError(str(e)) from None
    if cfg.max_batch > 0:
        from .batching import BatchPool

        return BatchPool.load(
            cfg.engines,
            cfg.max_batch,
            threads=cfg.threads,
            backend=cfg.backend,
            max_queue=cfg.max_queue,
            max_tokens=cfg.max_tokens_in_flight,
            policy=cfg.batch_policy,
            round_delay=cfg.round_delay,
            prefix_cache_tokens=cfg.prefix_cache_tokens,
            slot_policy=policy,
            cache_ram_mib=cfg.cache_ram_mib,
        )
    return WorkerPool.load(
        cfg.engines,
        workers=cfg.workers,
        max_queue=cfg.max_queue,
        threads=cfg.threads,
        backend=cfg.backend,
        round_delay=cfg.round_delay,
        prefix_cache_tokens=cfg.prefix_cache_tokens,
        slot_policy=policy,
        cache_ram_mib=cfg.cache_ram_mib,
    )


def build_service(cfg: ServeConfig | str | Path, **kw) -> CompletionService:
    """Load the pool and wrap it in a :class:`CompletionService`.

    Args:
        cfg: a :class:`ServeConfig`, or the engine folder with ``kw`` its other fields.

    Raises:
        EngineError, BackendError: the engine folder cannot be loaded.
        ServeError: bad pool settings; the chat template cannot be read or compiled.
    """
    from ..chat import ChatTemplate, TemplateSourceError, load_chat_template, special_token_strings

    cfg = cfg if isinstance(cfg, ServeConfig) else ServeConfig(cfg, **kw)
    if cfg.completions_special_tokens not in COMPLETIONS_SPECIAL_TOKENS:
        raise ServeError(f"completions_special_tokens={cfg.completions_special_tokens!r}; allowed: {', '.join(COMPLETIONS_SPECIAL_TOKENS)}")
    if cfg.agent_drafter != ENGINE_DRAFTER:
        from ..config import check_drafter

        try:
            check_drafter(cfg.agent_drafter)
        except InputError as e:
            raise ServeError(f"agent_drafter: {e} (or {ENGINE_DRAFTER!r}: the engine's default)") from None
    pool = _load_pool(cfg)
    engine = pool.engines[0]
    special = special_token_strings(engine)
    try:
        if cfg.chat_template is not None:
            template = load_chat_template(cfg.chat_template, special)
        elif engine.chat_template is not None:
            template = ChatTemplate(engine.chat_template, str(Path(cfg.engines) / engine.manifest.chat_template_file), special)
        else:
            template = None
    except TemplateSourceError as e:
        pool.close()
        raise ServeError(str(e)) from None
    agent = None if cfg.agent_drafter == ENGINE_DRAFTER else cfg.agent_drafter
    return CompletionService(pool, cfg.model_name or Path(cfg.engines).resolve().name, template, cfg.completions_special_tokens, agent)


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _setup_log(level: str) -> None:
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(level.upper())


def _announce(service: CompletionService, cfg: ServeConfig, tc) -> None:
    """One line naming the model, folder, backend, workers (or batching) and threads, and a
    warning when workers x threads exceeds the cores."""
    tpl = service.chat_template.origin if service.chat_template is not None else "none (chat completions answer 400)"
    workers = 1 if cfg.max_batch > 0 else cfg.workers  # one scheduler thread runs every row
    log.info(
        "specrt serve: model %r from %s, backend %s, %s x %d thread(s) (draft %d), chat template %s, on http://%s:%d",
        service.model_name,
        Path(cfg.engines).resolve(),
        service.engine.backend,
        f"continuous batching of up to {cfg.max_batch} requests (policy {cfg.batch_policy}), 1 scheduler" if cfg.max_batch > 0 else f"{workers} worker(s)",
        tc.intra_op,
        tc.for_draft(service.engine.manifest.draft.params).intra_op,
        tpl,
        cfg.host,
        cfg.port,
    )
    cores = available_cores()
    if workers * tc.intra_op > cores:
        log.warning(
            "%d worker(s) x %d thread(s) = %d threads on %d core(s): oversubscribed, every request gets slower; use --workers x --threads <= %d",
            workers,
            tc.intra_op,
            workers * tc.intra_op,
            cores,
            cores,
        )


def serve(cfg: ServeConfig | str | Path, **kw) -> None:
    """Load the engines, then serve them with uvicorn until interrupted (Ctrl-C / SIGTERM).

    Args:
        cfg: a :class:`ServeConfig`, or the engine folder with ``kw`` its other fields.

    Raises:
        ServeError: the ``[serve]`` extra is missing; bad settings or chat template.
        EngineError, BackendError: the engine folder cannot be loaded.
    """
    cfg = cfg if isinstance(cfg, ServeConfig) else ServeConfig(cfg, **kw)
    require_serve_extra()
    try:
        import uvicorn
    except ImportError as e:
        raise ServeError(f"serving needs the [serve] extra (FastAPI, uvicorn): pip install -e '.[serve]' in the specrt checkout ({e})") from None
    from ..backends.base import ThreadConfig

    _setup_log(cfg.log_level)
    tc = cfg.threads or ThreadConfig()
    service = build_service(replace(cfg, threads=tc))
    app = create_app(service, api_key=cfg.api_key, allowed_origins=cfg.allowed_origins, max_body_bytes=cfg.max_body_bytes)
    _announce(service, cfg, tc)
    try:
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level, timeout_graceful_shutdown=5)
    finally:
        service.pool.close()
