"""`llmc serve`: an engine behind an OpenAI-compatible HTTP API (llmc/server.py, llmc/server_ray.py)."""

import os
from pathlib import Path

import click

from llmc.cli.common import existing, main, share_threads, speculative_tokens_option
from llmc.errors import LlmcError


@main.command()
@click.argument("engine", type=click.Path(dir_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--model-name", help="The model name clients pass (default: the engine file's name without .plan).")
@click.option("--max-waiting", default=256, show_default=True, type=int,
              help="Requests admitted beyond the running seats; past it, HTTP 429 with Retry-After.")
@click.option("--max-num-seqs", type=int, help="Scheduler: sequences per step (default: the engine's max batch).")
@click.option("--max-num-batched-tokens", type=int, help="Scheduler: tokens per step (default 512).")
@click.option("--max-wait-ms", default=0.0, show_default=True, type=float,
              help="Scheduler: hold new requests this long to fill a batch (latency for throughput).")
@click.option("--policy", default="priority", show_default=True,
              help="Scheduler: priority (a request's \"priority\" field, lower first, then arrival) or fifo.")
@click.option("--threads", type=int, help="CPU threads (default: every core).")
@click.option("--kv-pool-mb", type=float, help="KV pool size (default: the compiled size or the load-time rule).")
@click.option("--decode-model/--no-decode-model", default=True, show_default=True,
              help="OpenVINO engines: decodes on a second model where the CPU and memory allow it; "
                   "off: one model for every step (less memory, a faster load).")
@click.option("--ray", "use_ray", is_flag=True, help="Serve replicas as Ray Serve deployments behind Ray's HTTP proxy "
              "(a local Ray cluster, or RAY_ADDRESS's).")
@click.option("--replicas", default=2, show_default=True, type=int, help="With --ray: engine replicas.")
@click.option("--api-key", envvar="LLMC_API_KEY", show_envvar=True,
              help="Require `Authorization: Bearer KEY` on every route but /health (401 otherwise).")
@click.option("--public-metrics", is_flag=True, help="With --api-key: /metrics answers without the key.")
@click.option("--ssl-keyfile", type=click.Path(dir_okay=False), help="Serve HTTPS: the private key (PEM).")
@click.option("--ssl-certfile", type=click.Path(dir_okay=False), help="Serve HTTPS: the certificate chain (PEM).")
@click.option("--request-timeout", type=float,
              help="Seconds a request may take from arrival; past it, it is aborted and answered 504.")
@speculative_tokens_option
def serve(engine, host, port, model_name, max_waiting, max_num_seqs, max_num_batched_tokens, max_wait_ms, policy,
          threads, kv_pool_mb, decode_model, use_ray, replicas, api_key, public_metrics, ssl_keyfile, ssl_certfile,
          request_timeout, speculative_tokens):
    """Serve ENGINE over an OpenAI-compatible HTTP API (completions, chat, models, health, metrics)."""
    import importlib.util

    from llmc.formats.engine_file import read_manifest
    from llmc.runtime.engine import Engine
    from llmc.runtime.scheduler import SERVER_DEFAULTS, SchedulerConfig
    from llmc.server import ServerOptions, create_app, serve as run_server

    missing = [m for m in ("starlette", "uvicorn", "prometheus_client", "jinja2") if importlib.util.find_spec(m) is None]
    if missing:
        raise LlmcError(f"llmc serve needs {', '.join(missing)}: pip install 'llmc[serve]'")

    if max_waiting < 0:
        raise LlmcError(f"--max-waiting: must be ≥ 0, got {max_waiting}")
    if replicas < 1:
        raise LlmcError(f"--replicas: must be ≥ 1, got {replicas}")
    paged = read_manifest(existing(engine))["paged"]
    if not paged:
        raise LlmcError(f"{engine}: llmc serve needs a paged engine (compiled without --no-paged)")
    scheduler = {**SERVER_DEFAULTS, "max_num_seqs": max_num_seqs or paged["max_batch"], "max_wait_ms": max_wait_ms,
                 "policy": policy, **({"max_num_batched_tokens": max_num_batched_tokens} if max_num_batched_tokens else {})}
    config = SchedulerConfig(**scheduler)  # a bad value fails here, before any replica starts
    if public_metrics and not api_key:
        raise LlmcError("--public-metrics: only with --api-key (without a key every route is public)")
    tls = tls_files(ssl_keyfile, ssl_certfile)
    options = ServerOptions(model_name=model_name or Path(engine).stem, max_waiting=max_waiting, api_key=api_key,
                            public_metrics=public_metrics, request_timeout_s=request_timeout)
    scheme = "https" if tls else "http"
    if use_ray:
        from llmc import server_ray

        cores = os.cpu_count() or 1
        app = server_ray.application(str(Path(engine).resolve()), options, scheduler, replicas,
                                     cpus_per_replica=cores / replicas, threads=threads or max(1, cores // replicas),
                                     kv_pool_mb=kv_pool_mb, speculative_tokens=speculative_tokens,
                                     decode_model=decode_model)
        click.echo(f"serving {options.model_name} on {scheme}://{host}:{port}/v1 with {replicas} Ray Serve replicas "
                   f"(Ctrl-C or SIGTERM stops)", err=True)
        server_ray.run(app, host, port, tls=tls)
        return
    share_threads(threads)
    loaded = Engine(engine, config, threads=threads, kv_pool_mb=kv_pool_mb, concurrent=config.max_num_seqs > 1,
                    speculative_tokens=speculative_tokens, decode_model=decode_model)
    app = create_app(loaded, options)
    click.echo(f"serving {options.model_name} on {scheme}://{host}:{port}/v1 (Ctrl-C or SIGTERM drains and stops)",
               err=True)
    run_server(app, host, port, tls=tls)


def tls_files(keyfile: str | None, certfile: str | None) -> dict[str, str]:
    """uvicorn's ssl_keyfile/ssl_certfile, checked now: both or neither, and a pair that loads."""
    import ssl

    if (keyfile is None) != (certfile is None):
        raise LlmcError("--ssl-keyfile and --ssl-certfile go together: give both for HTTPS, or neither")
    if keyfile is None:
        return {}
    existing(keyfile)
    existing(certfile)
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except (ssl.SSLError, ValueError) as error:
        raise LlmcError(f"--ssl-certfile {certfile} / --ssl-keyfile {keyfile}: not a certificate and its private "
                        f"key in PEM ({error})") from None
    return {"ssl_keyfile": keyfile, "ssl_certfile": certfile}
