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

Evaluation tools score an engine through ``logprobs`` (completions: OpenAI's legacy format, with
``echo`` for the prompt's own tokens, ``max_tokens`` 0 to score without generating, several
prompts in one request; chat: ``logprobs``/``top_logprobs``), streamed or not. The figures are
runtime/logprobs.py's, the prompt's from its prefill.

With an API key every route but ``/health`` (and ``/metrics`` where it is public) wants
``Authorization: Bearer KEY``, compared in constant time. A request still unanswered after the
request timeout is aborted (its blocks freed at the next step) and answered 504, or, once its
stream has begun, ends with an error event.

Errors are OpenAI's error object with the right status: 400 (bad JSON, bad values, a prompt past
the engine's limit, chat without a template), 401 (no or wrong API key), 404 (unknown model or
path), 413 (body too large), 429 (queue full), 503 (draining), 504 (past the request timeout),
500 (a step failed: the request fails, the server serves on).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterable, NamedTuple, Sequence

from llmc.errors import LlmcError
from llmc.runtime.async_engine import AsyncEngine
from llmc.runtime.engine import Engine
from llmc.runtime.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from llmc.runtime.sampling_params import SamplingParams

# OpenAI's defaults where the request leaves a field out.
DEFAULT_MAX_TOKENS = 16  # completions; chat generates up to the engine's limit
DEFAULT_TEMPERATURE = 1.0
MAX_N = 16
MAX_PROMPTS = 64  # prompts in one completions request (evaluation tools send batches)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(frozen=True)
class ServerOptions:
    """Args:
        model_name: the name clients pass as "model" (default: the engine file's stem).
        max_waiting: requests admitted beyond the engine's seats before answering 429.
        max_body_bytes: larger request bodies get 413.
        retry_after_s: the Retry-After a 429 carries.
        api_key: when set, every route but /health (and /metrics when `public_metrics`) wants
            `Authorization: Bearer <api_key>`; 401 otherwise.
        public_metrics: /metrics answers without the key (a scraper inside the network).
        request_timeout_s: a request unanswered this long after it arrived is aborted; None: no limit.
    """

    model_name: str
    max_waiting: int = 256
    max_body_bytes: int = 4 * 2**20
    retry_after_s: int = 1
    api_key: str | None = None
    public_metrics: bool = False
    request_timeout_s: float | None = None

    def __post_init__(self):
        if self.api_key is not None and not self.api_key.strip():
            raise LlmcError("--api-key: must not be empty")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise LlmcError(f"--request-timeout: must be > 0 seconds, got {self.request_timeout_s}")


class ApiError(Exception):
    """An OpenAI-style error answer."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers or {}
        self.code = code


def create_app(engine: Engine, options: ServerOptions):
    """The ASGI app serving `engine` (which it then owns)."""
    from prometheus_client import CollectorRegistry
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
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

    open_paths = {"/health", *(["/metrics"] if options.public_metrics else [])}
    app = Starlette(routes=[Route("/v1/models", models), Route("/health", health), Route("/metrics", metrics),
                            Route("/v1/completions", endpoint(chat=False), methods=["POST"]),
                            Route("/v1/chat/completions", endpoint(chat=True), methods=["POST"])],
                    exception_handlers={404: not_found},
                    middleware=[Middleware(_RequireKey, key=options.api_key, open_paths=frozenset(open_paths))]
                    if options.api_key else [])
    app.state.llmc = state
    return app


class _RequireKey:
    """ASGI middleware: a request to a path not in `open_paths` without `Authorization: Bearer
    <key>` gets 401. The key is compared in constant time (hmac.compare_digest), so that how long
    a refusal takes tells nothing of how much of a guess was right."""

    def __init__(self, app, key: str, open_paths: frozenset[str]):
        self.app, self.key, self.open_paths = app, key.encode(), open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and _route(scope) not in self.open_paths:
            header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            scheme, _, given = header.partition(b" ")
            if not (hmac.compare_digest(given.strip(), self.key) and scheme.lower() == b"bearer"):
                refusal = ApiError(401, "a valid API key is required: send the header Authorization: Bearer <key>",
                                   "authentication_error", headers={"WWW-Authenticate": "Bearer"},
                                   code="invalid_api_key")
                await _error_response(refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _route(scope) -> str:
    """The request's path under the app's prefix (Ray Serve's route_prefix, a proxy's root_path)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


@dataclass
class _Job:
    """One HTTP request's generations: its prompts, and per choice its sampling settings (prompt
    i's `n` choices are i·n … i·n + n − 1, OpenAI's order)."""

    id: str
    chat: bool
    prompts: list[list[int]]
    echoes: list[str]  # each prompt as text, for `echo`
    params: list[SamplingParams]  # one per choice
    n: int
    priority: int
    stream: bool
    include_usage: bool
    logprobs: int | None  # alternatives reported per token; None: no log-probabilities
    echo: bool  # completions: the prompt before the completion, its tokens' log-probabilities too
    generate: bool  # False: max_tokens 0 with echo, the prompt scored and nothing generated
    deadline: float | None  # time.monotonic() past which it is aborted


class _Piece(NamedTuple):
    """What one choice produced in one engine step."""

    index: int
    text: str
    finish_reason: str | None
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    prompt_logprobs: list[TokenLogprob | None] | None


class _ServerState:
    """The engine's async driver, admission counting and metrics: the app's one owner of them."""

    def __init__(self, engine: Engine, options: ServerOptions, registry):
        from prometheus_client import Counter, Gauge, Histogram

        self.engine, self.options, self.registry = engine, options, registry
        self._token_texts: dict[int, tuple[str, int]] = {}
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
        arrived = time.monotonic()
        if self.draining:
            raise ApiError(503, "the server is shutting down", "service_unavailable")
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        if body.get("model") != self.options.model_name:
            raise ApiError(404, f"model '{body.get('model')}' does not exist; this server has "
                                f"'{self.options.model_name}'", "not_found_error", "model")
        for unsupported in ("best_of", "suffix", "tools", "functions", "logit_bias"):
            if body.get(unsupported) not in ((None, 1) if unsupported == "best_of" else (None, False)):
                raise ApiError(400, f"{unsupported} is not supported", param=unsupported)
        logprobs, echo = self._logprobs(body, chat)
        prompts, texts = zip(*self._prompts(body, chat))
        n = _integer(body, "n", 1, 1, MAX_N)
        longest = max(len(p) for p in prompts)
        limit = self.engine.max_seq_len - longest
        if limit < 1:
            raise ApiError(400, f"the prompt has {longest} tokens; this model takes at most "
                                f"{self.engine.max_seq_len - 1} with room for one more", param="prompt")
        key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        # max_tokens 0 scores an echoed prompt without generating (evaluation tools send it).
        max_tokens = _integer(body, key, limit if chat else min(DEFAULT_MAX_TOKENS, limit), 0 if echo else 1, None)
        if max_tokens > limit:
            raise ApiError(400, f"{key}={max_tokens}: the prompt's {longest} tokens leave room for {limit} "
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
                max_new_tokens=max(max_tokens, 1), temperature=_number(body, "temperature", DEFAULT_TEMPERATURE),
                top_p=_number(body, "top_p", 1.0), presence_penalty=_number(body, "presence_penalty", 0.0),
                seed=None if seed is None else seed + i, stop=() if stop is None else stop, ignore_eos=ignore_eos,
                logprobs=logprobs, prompt_logprobs=logprobs if echo else None)
                for _ in prompts for i in range(n)]
        except LlmcError as error:
            raise ApiError(400, str(error), param=str(error).split(" ")[0]) from None
        capacity = self.engine.config.max_num_seqs + self.options.max_waiting
        if len(params) > capacity:
            raise ApiError(400, f"{len(params)} generations (prompts × n) in one request; this server admits "
                                f"{capacity} at once", param="n")
        if self.active + len(params) > capacity:
            self.requests.labels("rejected").inc()
            raise ApiError(429, f"the server is at capacity ({capacity} requests in flight); retry later",
                           "rate_limit_error", headers={"Retry-After": str(self.options.retry_after_s)})
        options = body.get("stream_options") or {}
        timeout = self.options.request_timeout_s
        # echo returns a prompt as sent, or a token-id prompt as its text
        echoes = [self.engine.tokenizer.decode(ids) if text is None else text
                  for ids, text in zip(prompts, texts)] if echo else []
        return _Job(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", chat, list(prompts), echoes, params,
                    n, _integer(body, "priority", 0, None, None), bool(body.get("stream")),
                    bool(isinstance(options, dict) and options.get("include_usage")), logprobs, echo,
                    max_tokens > 0, None if timeout is None else arrived + timeout)

    @staticmethod
    def _logprobs(body: dict, chat: bool) -> tuple[int | None, bool]:
        """(alternatives per token or None, echo) from OpenAI's fields: completions' `logprobs`
        (an integer) and `echo`; chat's `logprobs` (true/false) and `top_logprobs`."""
        if chat:
            if body.get("echo") not in (None, False):
                raise ApiError(400, "echo is for /v1/completions", param="echo")
            wanted = body.get("logprobs")
            if wanted is not None and not isinstance(wanted, bool):
                raise ApiError(400, f"logprobs must be true or false, got {wanted!r}", param="logprobs")
            top = _integer(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
            if top is not None and not wanted:
                raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            return (top or 0) if wanted else None, False
        if body.get("top_logprobs") is not None:
            raise ApiError(400, "top_logprobs is for chat; completions take logprobs: <alternatives>",
                           param="top_logprobs")
        echo = body.get("echo", False)
        if not isinstance(echo, bool):
            raise ApiError(400, f"echo must be true or false, got {echo!r}", param="echo")
        return _integer(body, "logprobs", None, 0, MAX_TOP_LOGPROBS), echo

    def _prompts(self, body: dict, chat: bool) -> list[tuple[list[int], str | None]]:
        """The request's prompts, each as token ids and the string it was sent as (None: sent as
        ids, or chat's): chat's one, or completions' string, token ids, or a list of either."""
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
            return [(tokenizer.inner.encode(text, add_special_tokens=False).ids, None)]
        prompt = body.get("prompt")
        if isinstance(prompt, str) or _token_ids(prompt):
            prompt = [prompt]
        if not (isinstance(prompt, list) and 0 < len(prompt) <= MAX_PROMPTS
                and all(isinstance(p, str) or _token_ids(p) for p in prompt)):
            raise ApiError(400, f"prompt must be a string, a list of token ids, or a list of up to {MAX_PROMPTS} "
                                "of either", param="prompt")
        vocab = self.engine.manifest.geometry.vocab_size
        if not all(0 <= t < vocab for p in prompt if not isinstance(p, str) for t in p):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        return [(tokenizer.encode(p), p) if isinstance(p, str) else (list(p), None) for p in prompt]

    def _driver(self) -> AsyncEngine:
        if self.async_engine is None:
            self.async_engine = AsyncEngine(self.engine)
        return self.async_engine

    async def _choice(self, job: _Job, index: int) -> AsyncIterator[_Piece]:
        """The pieces of one choice as it generates."""
        self.active += 1
        start, first, tokens = time.perf_counter(), None, 0
        outcome = "error"
        try:
            stream = self._driver().generate(job.prompts[index // job.n], job.params[index], priority=job.priority)
            async with contextlib.aclosing(stream):
                async for output in _until(stream, job.deadline):
                    now = time.perf_counter()
                    if output.new_token_ids and first is None:
                        first = now
                        self.ttft.observe(now - start)
                    tokens += len(output.new_token_ids)
                    self.generated.inc(len(output.new_token_ids))
                    reason = output.finish_reason if output.finished else None
                    if not job.generate:  # the one token made to score the prompt is not the answer's
                        yield _Piece(index, "", "length", [], None, output.prompt_logprobs)
                        break
                    yield _Piece(index, output.text, {"abort": "stop"}.get(reason, reason), output.new_token_ids,
                                 output.logprobs, output.prompt_logprobs)
            outcome = "finished"
        except LlmcError as error:
            raise ApiError(400, str(error), param="prompt") from None
        except TimeoutError:
            outcome = "timeout"
            raise ApiError(504, f"the request took longer than the server's limit of "
                                f"{self.options.request_timeout_s:g} s (--request-timeout); it was stopped",
                           "timeout_error") from None
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

    async def _merged(self, job: _Job) -> AsyncIterator[_Piece]:
        """Every choice's pieces as they come (several choices run side by side)."""
        if len(job.params) == 1:
            async for piece in self._choice(job, 0):
                yield piece
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int):
            try:
                async for piece in self._choice(job, index):
                    await queue.put(piece)
                await queue.put(index)  # this choice is done
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
                if isinstance(item, int):
                    remaining -= 1
                    continue
                yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def complete(self, job: _Job) -> dict:
        count = len(job.params)
        texts, reasons = [""] * count, [None] * count
        tokens: list[list[int]] = [[] for _ in range(count)]
        found: list[list[TokenLogprob]] = [[] for _ in range(count)]
        prompt_found: list[list | None] = [None] * count
        async for piece in self._merged(job):
            texts[piece.index] += piece.text
            tokens[piece.index] += piece.token_ids
            found[piece.index] += piece.logprobs or []
            reasons[piece.index] = piece.finish_reason or reasons[piece.index]
            if piece.prompt_logprobs is not None:
                prompt_found[piece.index] = piece.prompt_logprobs
        choices = []
        for i in range(count):
            if job.chat:
                choices.append({"index": i, "finish_reason": reasons[i],
                                "message": {"role": "assistant", "content": texts[i]},
                                "logprobs": None if job.logprobs is None else self._chat_logprobs(found[i])})
                continue
            echoed = self._echoed(job, i, prompt_found[i]) if job.echo else ("", [])
            entries = echoed[1] + list(zip(tokens[i], found[i]))
            choices.append({"index": i, "finish_reason": reasons[i], "text": echoed[0] + texts[i],
                            "logprobs": None if job.logprobs is None else self._legacy_logprobs(entries, 0)[0]})
        return {"id": job.id, "object": "chat.completion" if job.chat else "text_completion",
                "created": int(time.time()), "model": self.options.model_name, "choices": choices,
                "usage": _usage(job, sum(map(len, tokens)))}

    async def stream(self, job: _Job) -> AsyncIterator[dict]:
        """OpenAI's chunks for one streamed request (the [DONE] line is `_sse`'s)."""
        head = {"id": job.id, "object": "chat.completion.chunk" if job.chat else "text_completion",
                "created": int(time.time()), "model": self.options.model_name}
        usage = {"usage": None} if job.include_usage else {}
        if job.chat:  # the role comes first, alone, as OpenAI sends it
            for index in range(len(job.params)):
                yield {**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]}
        total = 0
        offsets = [0] * len(job.params)  # each choice's text so far, for text_offset
        echoed: set[int] = set()
        async for piece in self._merged(job):
            index = piece.index
            total += len(piece.token_ids)
            if job.echo and index not in echoed:  # the prompt first, as its own chunk
                echoed.add(index)
                text, entries = self._echoed(job, index, piece.prompt_logprobs)
                logprobs = None
                if job.logprobs is not None:
                    logprobs, offsets[index] = self._legacy_logprobs(entries, 0)
                yield {**head, "choices": [{"index": index, "text": text, "finish_reason": None,
                                            "logprobs": logprobs}], **usage}
            if not piece.token_ids and not piece.text and piece.finish_reason is None:
                continue  # a chunk per step that made tokens, even while their text is held back
            if job.chat:
                choice = {"index": index, "delta": {"content": piece.text} if piece.text else {},
                          "logprobs": None if job.logprobs is None else self._chat_logprobs(piece.logprobs or []),
                          "finish_reason": piece.finish_reason}
            else:
                logprobs = None
                if job.logprobs is not None:
                    logprobs, offsets[index] = self._legacy_logprobs(zip(piece.token_ids, piece.logprobs or []),
                                                                     offsets[index])
                choice = {"index": index, "text": piece.text, "finish_reason": piece.finish_reason,
                          "logprobs": logprobs}
            yield {**head, "choices": [choice], **usage}
        if job.include_usage:
            yield {**head, "choices": [], "usage": _usage(job, total)}

    def _echoed(self, job: _Job, index: int, prompt_logprobs) -> tuple[str, list[tuple[int, TokenLogprob | None]]]:
        """A choice's echoed prompt: its text, and (token, log-probability) for each of its tokens."""
        prompt = job.prompts[index // job.n]
        return job.echoes[index // job.n], list(zip(prompt, prompt_logprobs or [None] * len(prompt)))

    def _token_text(self, token: int) -> tuple[str, int]:
        """A token's text, special tokens included (a log-probability names the token it is for),
        and how many characters it adds to the choice's text, where special tokens add none."""
        found = self._token_texts.get(token)
        if found is None:
            tokenizer = self.engine.tokenizer
            found = self._token_texts[token] = (tokenizer.inner.decode([token], skip_special_tokens=False),
                                                len(tokenizer.decode([token])))
        return found

    def _legacy_logprobs(self, entries: Iterable[tuple[int, TokenLogprob | None]], offset: int) -> tuple[dict, int]:
        """OpenAI's completions `logprobs` object for (token, log-probability) pairs whose text
        starts at character `offset` of the choice's text; and the offset after them. A character
        made of several tokens' bytes counts in each of them."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, found in entries:
            text, width = self._token_text(token)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if found is None else found.logprob)
            out["top_logprobs"].append(None if found is None else
                                       {self._token_text(t)[0]: lp for t, lp in found.top})
            out["text_offset"].append(offset)
            offset += width
        return out, offset

    def _chat_logprobs(self, found: Sequence[TokenLogprob]) -> dict:
        """OpenAI's chat `logprobs` object for generated tokens."""
        def entry(token: int, logprob: float) -> dict:
            text = self._token_text(token)[0]
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**entry(f.token, f.logprob), "top_logprobs": [entry(t, lp) for t, lp in f.top]}
                            for f in found], "refusal": None}


def _usage(job: _Job, completion_tokens: int) -> dict:
    prompt = sum(len(job.prompts[i // job.n]) for i in range(len(job.params)))
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}


def _token_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                            for t in value)


async def _until(stream: AsyncIterator, deadline: float | None) -> AsyncIterator:
    """`stream`'s items until `deadline` (time.monotonic()); then TimeoutError, the stream's
    pending read cancelled (which aborts its request)."""
    while True:
        try:
            if deadline is None:
                item = await anext(stream)
            else:
                item = await asyncio.wait_for(anext(stream), max(0.0, deadline - time.monotonic()))
        except StopAsyncIteration:
            return
        yield item


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
    return {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": error.code}}


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


def serve(app, host: str, port: int, tls: dict[str, str] | None = None) -> None:
    """Run `app` until SIGTERM/SIGINT; on either, stop accepting and answer 503 while the running
    requests finish. `tls`: uvicorn's ssl_keyfile and ssl_certfile, for HTTPS."""
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

    server = Server(uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=30,
                                   **(tls or {})))
    server.run()
