"""The serving benchmark over HTTP (`llmc bench ENGINE --url URL`): the same workload as
runtime/bench.py, sent to an OpenAI-compatible server as streamed /v1/completions requests.

Each request goes at its arrival time (or, with `concurrency`, as an earlier one finishes) with
its prompt's token ids, ``max_tokens`` = its output length, greedy, ``ignore_eos`` (vLLM's
extension, which `llmc serve` honours) and ``stream_options.include_usage``. TTFT is measured as
a client sees it: from sending to the first chunk that carries tokens; the finish is the last
chunk, the token count the usage the server reports. The records are runtime/bench.py's, so
`summarize` gives the same table.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Callable, Sequence

from llmc.errors import LlmcError
from llmc.runtime.bench import BenchRequest, BenchResult, RequestRecord


def run_http_workload(url: str, model: str | None, workload: Sequence[BenchRequest],
                      progress: Callable[[int], None] | None = None,
                      concurrency: int | None = None, api_key: str | None = None) -> BenchResult:
    """Send `workload` to the server at `url` (its base, e.g. http://127.0.0.1:8000); `model`
    None asks the server for its first model; `api_key`: sent as a bearer token. An https URL's
    certificate is checked against the system's authorities (or SSL_CERT_FILE's)."""
    try:
        import httpx
    except ImportError:
        raise LlmcError("--url needs httpx: pip install 'llmc[bench]'") from None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return asyncio.run(_run(httpx, url.rstrip("/"), model, workload, progress, concurrency, headers))


async def _run(httpx, url, model, workload, progress, concurrency, headers) -> BenchResult:
    records = [RequestRecord(i, len(r.prompt), r.output_len, r.arrival_s) for i, r in enumerate(workload)]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None, connect=30), limits=limits,
                                 headers=headers) as client:
        try:
            answer = await client.get("/v1/models")
            refused = answer.status_code == 401
            if model is None and not refused:
                answer.raise_for_status()
                model = answer.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as error:
            raise LlmcError(f"--url {url}: no OpenAI-compatible server answers there ({error})") from None
        if refused:
            raise LlmcError(f"--url {url}: the server refused the API key (401)" if headers else
                            f"--url {url}: the server wants an API key: --api-key or LLMC_API_KEY")
        start = time.perf_counter()
        slots = asyncio.Semaphore(concurrency) if concurrency else None

        async def one(index: int) -> None:
            request, record = workload[index], records[index]
            if slots is None:
                await asyncio.sleep(max(0.0, request.arrival_s - (time.perf_counter() - start)))
                record.arrival_s = request.arrival_s
            else:
                await slots.acquire()
                record.arrival_s = time.perf_counter() - start
            try:
                await _send(client, model, request, record, start, progress)
            except httpx.HTTPError as error:
                record.error = f"{type(error).__name__}: {error}"
            finally:
                if slots is not None:
                    slots.release()

        await asyncio.gather(*(one(i) for i in range(len(workload))))
    result = BenchResult(records, concurrency=concurrency)
    result.duration_s = max((r.finish_s for r in records if r.finish_s is not None), default=0.0)
    return result


async def _send(client, model: str, request: BenchRequest, record: RequestRecord, start: float,
                progress: Callable[[int], None] | None) -> None:
    body = {"model": model, "prompt": request.prompt, "max_tokens": request.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            **({"priority": request.priority} if request.priority else {})}
    async with client.stream("POST", "/v1/completions", json=body) as answer:
        if answer.status_code != 200:
            text = (await answer.aread()).decode(errors="replace")
            try:
                record.error = f"HTTP {answer.status_code}: {json.loads(text)['error']['message']}"
            except (ValueError, KeyError, TypeError):
                record.error = f"HTTP {answer.status_code}"
            return
        async for line in answer.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter() - start
            if "error" in chunk:
                record.error = chunk["error"].get("message", "error")
                return
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
                if progress is not None:
                    progress(tokens - record.tokens)
                record.tokens = tokens
                record.finish_s = now
            for choice in chunk.get("choices", []):
                if record.first_token_s is None:
                    record.first_token_s = now
                if choice.get("finish_reason"):
                    record.finish_reason = choice["finish_reason"]
                    record.finish_s = now
