"""`llmc serve --ray --replicas N`: the same server as N Ray Serve replicas behind Ray's HTTP proxy.

Each replica is a Ray actor that loads the engine once and serves server.py's app (Ray Serve's
ASGI ingress, built by the replica after its constructor, Ray >= 2.56); Ray's proxy spreads
requests over the replicas and passes streaming answers and client disconnects through. The
engine file must be readable at the same path on every node that runs a replica.

Locally `llmc serve ENGINE --ray --replicas 2` starts a Ray cluster in the process; with
``RAY_ADDRESS`` set (e.g. ``ray://head:10001``) the replicas go to that cluster instead. For
`serve deploy`, `application` is the builder a Serve config's ``import_path`` can name
(``llmc.server_ray:application``, with ``args`` holding its keyword arguments).
"""

from __future__ import annotations

from typing import Any

from llmc.errors import LlmcError
from llmc.server import ServerOptions

# Ray Serve's ASGI ingress built by the replica itself (`__serve_build_asgi_app__`).
MIN_RAY = (2, 56)


class Replica:
    """One Serve replica: an engine and the HTTP app that owns it."""

    def __init__(self, engine_path: str, options: ServerOptions, scheduler: dict[str, Any],
                 threads: int | None, kv_pool_mb: float | None, speculative_tokens: int | None = None,
                 decode_model: bool = True):
        from llmc.runtime.engine import Engine
        from llmc.runtime.scheduler import SERVER_DEFAULTS, SchedulerConfig
        from llmc.server import create_app

        config = SchedulerConfig(**{**SERVER_DEFAULTS, **scheduler})
        engine = Engine(engine_path, config, threads=threads, kv_pool_mb=kv_pool_mb, concurrent=config.max_num_seqs != 1,
                        speculative_tokens=speculative_tokens, decode_model=decode_model)
        self._app = create_app(engine, options)

    def __serve_build_asgi_app__(self):
        return self._app


def application(engine_path: str, options: ServerOptions | dict, scheduler: dict[str, Any] | None = None,
                replicas: int = 2, cpus_per_replica: float = 1.0, threads: int | None = None,
                kv_pool_mb: float | None = None, speculative_tokens: int | None = None, decode_model: bool = True):
    """The Ray Serve application: `replicas` copies of the server for `engine_path`."""
    serve = require_ray()
    if isinstance(options, dict):  # from a Serve config file's args
        options = ServerOptions(**options)
    deployment = serve.deployment(name="llmc", num_replicas=replicas,
                                  ray_actor_options={"num_cpus": cpus_per_replica})(serve.ingress()(Replica))
    return deployment.bind(str(engine_path), options, scheduler or {}, threads, kv_pool_mb, speculative_tokens,
                           decode_model)


def require_ray():
    """ray.serve, or one line saying what to install."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise LlmcError("--ray needs Ray Serve: pip install 'llmc[ray]'") from None
    version = tuple(int(part) for part in ray.__version__.split(".")[:2])
    if version < MIN_RAY:
        raise LlmcError(f"--ray: Ray {ray.__version__} is installed; llmc needs Ray >= {'.'.join(map(str, MIN_RAY))} "
                        f"(pip install 'llmc[ray]')")
    return serve


def http_options(host: str, port: int, tls: dict[str, str] | None = None) -> dict:
    """Serve's proxy options: where it listens, and its TLS files (HTTPOptions takes uvicorn's
    names: ssl_keyfile, ssl_certfile)."""
    return {"host": host, "port": port, **(tls or {})}


def run(app, host: str, port: int, num_cpus: int | None = None, tls: dict[str, str] | None = None) -> None:
    """Start Ray (or join RAY_ADDRESS's cluster) and Serve's proxy on host:port, deploy `app`,
    and serve until SIGTERM/SIGINT, then shut the application down; `tls`: as `http_options`."""
    import os
    import signal
    import threading

    import ray

    serve = require_ray()
    ray.init(**({} if os.environ.get("RAY_ADDRESS") else {"num_cpus": num_cpus, "include_dashboard": False}))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options=http_options(host, port, tls))
        serve.run(app, name="llmc", route_prefix="/")
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
