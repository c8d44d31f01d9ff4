"""`llmc serve`: an OpenAI-compatible HTTP server over one engine (Starlette on uvicorn).

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (the tokenizer's chat template, kept in
the engine at compile), ``/v1/models``, ``/health`` and Prometheus ``/metrics``. Answers stream
as server-sent events in OpenAI's chunk format when ``stream`` is true.

One `AsyncEngine` owns the engine; every HTTP request is one or more of its requests (``n``), so
concurrent clients share the same continuous batches. Back-pressure: at most the engine's seats
plus ``max_waiting`` requests are admitted; past that the answer is 429 with ``Retry-After``,
not unbounded latency. A client that disconnects cancels its requests (their blocks are freed
at the next step). On SIGTERM the server stops accepting, answers 503 to requests on open
connections, and lets the running ones finish (uvicorn's graceful shutdown).

Errors are OpenAI's error object with the right status: 400 (bad JSON, bad values, a prompt past
the engine's limit, chat without a template), 404 (unknown model or path), 413 (body too large),
429 (queue full), 503 (draining), 500 (a step failed: the request fails, the server serves on).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from llmc.errors import LlmcError
from llmc.runtime.async_engine import AsyncEngine
from llmc.runtime.engine import Engine
from llmc.runtime.sampling_params import SamplingParams

# OpenAI's defaults where the request leaves a field out.
DEFAULT_MAX_TOKENS = 16  # completions; chat generates up to the engine's limit
DEFAULT_TEMPERATURE = 1.0
MAX_N = 16
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(frozen=True)
class ServerOptions:
    """Args:
        model_name: the name clients pass as "model" (default: the engine file's stem).
        max_waiting: requests admitted beyond the engine's seats before answering 429.
        max_body_bytes: larger request bodies get 413.
        retry_after_s: the Retry-After a 429 carries.
    """

    model_name: str
    max_waiting: int = 256
    max_body_bytes: int = 4 * 2**20
    retry_after_s: int = 1


class ApiError(Exception):
    """An OpenAI-style error answer."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers or {}


def create_app(engine: Engine, options: ServerOptions):
    """The ASGI app serving `engine` (which it then owns)."""
    from prometheus_client import CollectorRegistry
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    state = _ServerState(engine, options, CollectorRegistry())

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": options.model_name, "object": "model", "created": state.created, "owned_by": "llmc"}]})

    async def health(request: Request):
        if state.draining:
            return JSONResponse({"status": "draining", "pid": os.getpid()}, status_code=503)
        return JSONResponse({"status": "ok", "pid": os.getpid()})  # the pid tells replicas apart

    async def metrics(request: Request):
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        state.refresh_gauges()
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    def endpoint(chat: bool):
        async def handle(request: Request):
            try:
                body = await _read_json(request, options.max_body_bytes)
                job = state.job(body, chat)
                if job.stream:
                    return StreamingResponse(_sse(state.stream(job)), media_type="text/event-stream")
                answer = asyncio.ensure_future(state.complete(job))
                watcher = asyncio.ensure_future(_wait_disconnect(request))
                done, _ = await asyncio.wait({answer, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if answer not in done:  # the client left: cancelling frees its requests' blocks
                    answer.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await answer
                    return Response(status_code=499)
                watcher.cancel()
                return JSONResponse(answer.result())
            except ApiError as error:
                return _error_response(error)
        return handle

    async def not_found(request: Request, exc):
        return _error_response(ApiError(404, f"no route {request.url.path}", "not_found_error"))

    app = Starlette(routes=[Route("/v1/models", models), Route("/health", health), Route("/metrics", metrics),
                            Route("/v1/completions", endpoint(chat=False), methods=["POST"]),
                            Route("/v1/chat/completions", endpoint(chat=True), methods=["POST"])],
                    exception_handlers={404: not_found})
    app.state.llmc = state
    return app


@dataclass
class _Job:
    """One HTTP request's generation: its prompt ids and per-choice sampling settings."""

    id: str
    chat: bool
    prompt_ids: list[int]
    params: list[SamplingParams]  # one per choice (n)
    priority: int
    stream: bool
    include_usage: bool


class _ServerState:
    """The engine's async driver, admission counting and metrics: the app's one owner of them."""

    def __init__(self, engine: Engine, options: ServerOptions, registry):
        from prometheus_client import Counter, Gauge, Histogram

        self.engine, self.options, self.registry = engine, options, registry
        self.async_engine: AsyncEngine | None = None  # made on the event loop, at the first request
        self.created = int(time.time())
        self.active = 0  # engine requests admitted and not finished
        self.draining = False
        self.queue_length = Gauge("llmc_queue_length", "Requests admitted and waiting for a seat", registry=registry)
        self.running = Gauge("llmc_running_sequences", "Sequences in the engine's running batch", registry=registry)
        self.kv_utilization = Gauge("llmc_kv_utilization", "Token slots in use / slots of the KV blocks in use",
                                    registry=registry)
        self.prefix_hit_rate = Gauge("llmc_prefix_hit_rate", "Prompt blocks found in the prefix cache",
                                     registry=registry)
        self.generated = Counter("llmc_generated_tokens", "Tokens generated", registry=registry)
        self.requests = Counter("llmc_requests", "Requests by outcome", ["outcome"], registry=registry)
        self.ttft = Histogram("llmc_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              registry=registry)
        self.tpot = Histogram("llmc_time_per_output_token_seconds", "Time per output token after the first",
                              buckets=LATENCY_BUCKETS, registry=registry)

    def refresh_gauges(self) -> None:
        running = len(self.engine.scheduler.running)
        self.running.set(running)
        self.queue_length.set(max(0, self.active - running))
        blocks = self.engine.blocks.stats
        self.kv_utilization.set(blocks.utilization)
        self.prefix_hit_rate.set(blocks.prefix_hit_rate)

    def job(self, body: Any, chat: bool) -> _Job:
        """Check a request body; raises ApiError (400, 404, 429, 503)."""
        if self.draining:
            raise ApiError(503, "the server is shutting down", "service_unavailable")
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        if body.get("model") != self.options.model_name:
            raise ApiError(404, f"model '{body.get('model')}' does not exist; this server has "
                                f"'{self.options.model_name}'", "not_found_error", "model")
        for unsupported in ("logprobs", "top_logprobs", "echo", "best_of", "suffix", "tools", "functions",
                            "logit_bias"):
            if body.get(unsupported) not in ((None, 1) if unsupported == "best_of" else (None, False)):
                raise ApiError(400, f"{unsupported} is not supported", param=unsupported)
        prompt_ids = self._prompt(body, chat)
        n = _integer(body, "n", 1, 1, MAX_N)
        limit = self.engine.max_seq_len - len(prompt_ids)
        if limit < 1:
            raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens; this model takes at most "
                                f"{self.engine.max_seq_len - 1} with room for one more", param="prompt")
        key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _integer(body, key, limit if chat else min(DEFAULT_MAX_TOKENS, limit), 1, None)
        if max_tokens > limit:
            raise ApiError(400, f"{key}={max_tokens}: the prompt's {len(prompt_ids)} tokens leave room for {limit} "
                                f"(this model's limit is {self.engine.max_seq_len})", param=key)
        if body.get("frequency_penalty") not in (None, 0, 0.0):
            raise ApiError(400, "frequency_penalty is not supported (presence_penalty is)", param="frequency_penalty")
        stop = body.get("stop")
        if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list) and len(stop) <= 4
                                                                and all(isinstance(s, str) for s in stop))):
            raise ApiError(400, "stop must be a string or a list of at most 4 strings", param="stop")
        ignore_eos = body.get("ignore_eos", False)  # vLLM's extension: fixed output lengths (benchmarks)
        if not isinstance(ignore_eos, bool):
            raise ApiError(400, "ignore_eos must be true or false", param="ignore_eos")
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ApiError(400, "seed must be an integer", param="seed")
        try:
            params = [SamplingParams(
                max_new_tokens=max_tokens, temperature=_number(body, "temperature", DEFAULT_TEMPERATURE),
                top_p=_number(body, "top_p", 1.0), presence_penalty=_number(body, "presence_penalty", 0.0),
                seed=None if seed is None else seed + i, stop=() if stop is None else stop, ignore_eos=ignore_eos)
                for i in range(n)]
        except LlmcError as error:
            raise ApiError(400, str(error), param=str(error).split(" ")[0]) from None
        capacity = self.engine.config.max_num_seqs + self.options.max_waiting
        if self.active + n > capacity:
            self.requests.labels("rejected").inc()
            raise ApiError(429, f"the server is at capacity ({capacity} requests in flight); retry later",
                           "rate_limit_error", headers={"Retry-After": str(self.options.retry_after_s)})
        options = body.get("stream_options") or {}
        return _Job(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", chat, prompt_ids, params,
                    _integer(body, "priority", 0, None, None), bool(body.get("stream")),
                    bool(isinstance(options, dict) and options.get("include_usage")))

    def _prompt(self, body: dict, chat: bool) -> list[int]:
        tokenizer = self.engine.tokenizer
        if chat:
            messages = body.get("messages")
            if not (isinstance(messages, list) and messages and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages)):
                raise ApiError(400, "messages must be a non-empty list of {role, content} objects with string "
                                    "content", param="messages")
            if tokenizer.chat_template is None:
                raise ApiError(400, "this model has no chat template; use /v1/completions", param="messages")
            try:
                text = tokenizer.apply_chat_template(messages)
            except LlmcError as error:
                raise ApiError(400, str(error), param="messages") from None
            # The template writes the special tokens itself (BOS too, where the model has one), as
            # transformers' apply_chat_template(tokenize=True) encodes it.
            return tokenizer.inner.encode(text, add_special_tokens=False).ids
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.engine.manifest.geometry.vocab_size
            if not all(0 <= t < vocab for t in prompt):
                raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            return list(prompt)
        raise ApiError(400, "prompt must be a string or a list of token ids (one prompt per request)", param="prompt")

    def _driver(self) -> AsyncEngine:
        if self.async_engine is None:
            self.async_engine = AsyncEngine(self.engine)
        return self.async_engine

    async def _choice(self, job: _Job, index: int) -> AsyncIterator[tuple[int, str, str | None, int]]:
        """(index, new text, finish reason or None, new tokens) as one choice generates."""
        self.active += 1
        start, first, tokens = time.perf_counter(), None, 0
        outcome = "error"
        try:
            stream = self._driver().generate(job.prompt_ids, job.params[index], priority=job.priority)
            async with contextlib.aclosing(stream):
                async for output in stream:
                    now = time.perf_counter()
                    if output.new_token_ids and first is None:
                        first = now
                        self.ttft.observe(now - start)
                    tokens += len(output.new_token_ids)
                    self.generated.inc(len(output.new_token_ids))
                    reason = output.finish_reason if output.finished else None
                    yield index, output.text, {"abort": "stop"}.get(reason, reason), len(output.new_token_ids)
            outcome = "finished"
        except LlmcError as error:
            raise ApiError(400, str(error), param="prompt") from None
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        except Exception as error:  # a step failed this request; the server serves on
            raise ApiError(500, f"generation failed: {error}", "server_error") from None
        finally:
            self.active -= 1
            self.requests.labels(outcome).inc()
            if first is not None and tokens > 1:
                self.tpot.observe((time.perf_counter() - first) / (tokens - 1))

    async def _merged(self, job: _Job) -> AsyncIterator[tuple[int, str, str | None, int]]:
        """Every choice's items as they come (n > 1 runs the choices side by side)."""
        if len(job.params) == 1:
            async for item in self._choice(job, 0):
                yield item
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int):
            try:
                async for item in self._choice(job, index):
                    await queue.put(item)
                await queue.put((index, None, None, 0))
            except BaseException as error:
                await queue.put(error)
                raise

        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(job.params))]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item[1] is None:
                    remaining -= 1
                    continue
                yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def complete(self, job: _Job) -> dict:
        texts, reasons, counts = [""] * len(job.params), [None] * len(job.params), [0] * len(job.params)
        async for index, text, reason, tokens in self._merged(job):
            texts[index] += text
            counts[index] += tokens
            reasons[index] = reason or reasons[index]
        choices = [{"index": i, "finish_reason": reasons[i],
                    **({"message": {"role": "assistant", "content": texts[i]}} if job.chat
                       else {"text": texts[i], "logprobs": None})} for i in range(len(texts))]
        return {"id": job.id, "object": "chat.completion" if job.chat else "text_completion",
                "created": int(time.time()), "model": self.options.model_name, "choices": choices,
                "usage": _usage(job, sum(counts))}

    async def stream(self, job: _Job) -> AsyncIterator[dict]:
        """OpenAI's chunks for one streamed request (the [DONE] line is `_sse`'s)."""
        head = {"id": job.id, "object": "chat.completion.chunk" if job.chat else "text_completion",
                "created": int(time.time()), "model": self.options.model_name}
        if job.chat:  # the role comes first, alone, as OpenAI sends it
            for index in range(len(job.params)):
                yield {**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                            "finish_reason": None}]}
        total = 0
        async for index, text, reason, tokens in self._merged(job):
            total += tokens
            if not tokens and not text and reason is None:
                continue  # a chunk per step that made tokens, even while their text is held back
            choice = ({"index": index, "delta": {"content": text} if text else {}, "finish_reason": reason}
                      if job.chat else {"index": index, "text": text, "logprobs": None, "finish_reason": reason})
            yield {**head, "choices": [choice], **({"usage": None} if job.include_usage else {})}
        if job.include_usage:
            yield {**head, "choices": [], "usage": _usage(job, total)}


def _usage(job: _Job, completion_tokens: int) -> dict:
    prompt = len(job.prompt_ids) * len(job.params)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}


async def _sse(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Server-sent events; an error after the first chunk goes as an error event, then [DONE]."""
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
    except ApiError as error:
        yield f"data: {json.dumps(_error_body(error))}\n\n"
    yield "data: [DONE]\n\n"


async def _read_json(request, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is larger than {limit} bytes", "invalid_request_error")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"the request body is larger than {limit} bytes", "invalid_request_error")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}") from None


async def _wait_disconnect(request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.05)


def _error_body(error: ApiError) -> dict:
    return {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": None}}


def _error_response(error: ApiError):
    from starlette.responses import JSONResponse

    return JSONResponse(_error_body(error), status_code=error.status, headers=error.headers)


def _number(body: dict, key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ApiError(400, f"{key} must be a number, got {value!r}", param=key)
    return float(value)


def _integer(body: dict, key: str, default: int, low: int | None, high: int | None) -> int:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or (low is not None and value < low) \
            or (high is not None and value > high):
        bounds = f" in [{low}, {high}]" if high is not None else f" ≥ {low}" if low is not None else ""
        raise ApiError(400, f"{key} must be an integer{bounds}, got {value!r}", param=key)
    return value


def serve(app, host: str, port: int, on_ready=None) -> None:
    """Run `app` until SIGTERM/SIGINT; on either, stop accepting and answer 503 while the running
    requests finish."""
    import signal
    import threading

    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            app.state.llmc.draining = True
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn's own re-raises the signal after the drain, so the process would end as
            # killed by it; a drained server exits 0.
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    server = Server(uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=30))
    server.run()
