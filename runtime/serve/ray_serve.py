"""Scale-out on Ray Serve: the same OpenAI-compatible app (:mod:`specrt.runtime.serve.server`)
as a Ray Serve deployment, ``num_replicas`` copies spread over a Ray cluster.

Each replica is a Ray actor (its own process, on whichever node has the CPUs it asks
for) that loads the engine folder and runs the FastAPI app of ``specrt serve`` with its own
worker pool; Ray Serve's HTTP proxy (one per node) routes each request to a replica,
queues beyond ``max_ongoing_requests``, cancels a request whose client disconnected, and
adds or removes replicas (``serve.run`` with a new ``num_replicas``, or autoscaling).
Nothing here schedules or balances by itself.

Two ways to start it::

    # from Python
    from ray import serve
    from specrt.runtime.serve.ray_serve import specrt_deployment
    serve.run(specrt_deployment("engines/default", num_replicas=2), route_prefix="/")

    # Ray Serve's own CLI (also usable in a Serve config file for `serve deploy`)
    serve run specrt.runtime.serve.ray_serve:app_builder engines=/abs/engines/default num_replicas=2

Requirements on every node: ``pip install -e '.[serve,ray]' in the specrt checkout`` and the engine folder at
the same path (or a shared file system). Ray is imported only inside these functions.
"""

from __future__ import annotations

from pathlib import Path

from .settings import DEFAULT_MAX_QUEUE

__all__ = ["specrt_deployment", "app_builder"]


def specrt_deployment(
    engines: str | Path,
    *,
    num_replicas: int = 2,
    workers: int = 1,
    threads: int = 1,
    max_queue: int = DEFAULT_MAX_QUEUE,
    model_name: str | None = None,
    backend: str | None = None,
    num_cpus: float | None = None,
    round_delay: float = 0.0,
):
    """A bound Ray Serve application serving ``engines`` with ``num_replicas`` replicas.

    Args:
        engines: engine folder; must exist at this path on every node that runs a replica.
        num_replicas: replicas (processes) across the cluster.
        workers: generator workers inside each replica (see :class:`~specrt.runtime.serve.server.WorkerPool`).
        threads: onnxruntime intra-op threads per session.
        max_queue: requests a replica may queue for its workers (503 beyond).
        model_name: the ``model`` id (default: the folder's name).
        backend: Engine backend per replica (None: each machine's default).
        num_cpus: CPUs Ray reserves per replica (default ``workers * threads``): Ray places
            replicas only where these are free.
        round_delay: test hook, as in ``specrt serve``.

    Returns:
        a ``ray.serve.Application`` for ``serve.run``.

    Raises:
        ImportError: ray[serve] is not installed (the ``[ray]`` extra).
        ValueError: num_replicas, workers or threads < 1.
    """
    from ray import serve

    for name, v in (("num_replicas", num_replicas), ("workers", workers), ("threads", threads), ("max_queue", max_queue)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r}; it must be an integer >= 1")
    folder = str(Path(engines).resolve())
    name = model_name or Path(folder).name

    def build_asgi_app():
        """Runs on each replica at start: load the engines, return the FastAPI app."""
        from specrt.runtime.backends.base import ThreadConfig
        from specrt.runtime.serve.server import ServeConfig, build_service, create_app

        return create_app(
            build_service(
                ServeConfig(
                    folder,
                    workers=workers,
                    max_queue=max_queue,
                    threads=ThreadConfig(intra_op=threads),
                    backend=backend,
                    model_name=name,
                    round_delay=round_delay,
                )
            )
        )

    class SpecrtReplica:
        """One replica: the ``specrt serve`` app (completions, /metrics of this replica)."""

    deployment = serve.deployment(
        serve.ingress(build_asgi_app)(SpecrtReplica),
        name="specrt",
        num_replicas=num_replicas,
        max_ongoing_requests=workers + max_queue,
        ray_actor_options={"num_cpus": float(num_cpus if num_cpus is not None else workers * threads)},
    )
    return deployment.bind()


def app_builder(args: dict):
    """Application builder for ``serve run specrt.runtime.serve.ray_serve:app_builder key=value ...``
    and Serve config files (``import_path`` + ``args``): keys are the keyword arguments of
    :func:`specrt_deployment` plus ``engines`` (required)."""
    args = dict(args)
    if "engines" not in args:
        raise ValueError("app_builder needs engines=FOLDER (the engine folder, same path on every node)")
    ints = ("num_replicas", "workers", "threads", "max_queue")
    kw = {}
    for k, v in args.items():
        if k in ints:
            kw[k] = int(v)
        elif k in ("num_cpus", "round_delay"):
            kw[k] = float(v)
        elif k in ("engines", "model_name", "backend"):
            kw[k] = v
        else:
            raise ValueError(f"app_builder: unknown argument {k!r}; known: engines, {', '.join(ints)}, num_cpus, model_name, backend")
    return specrt_deployment(kw.pop("engines"), **kw)
