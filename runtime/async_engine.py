"""Streaming many requests at once: `async for output in engine.generate(prompt, params)`.

One serving task drives the shared `Engine` while any request is unfinished and hands each step's
outputs to the queue of the request they belong to, so every caller streams its own tokens while
the others run in the same batches. Steps run in a worker thread (a step is milliseconds to
seconds of onnxruntime work that must not block the event loop), and only that thread touches the
engine: new requests and aborts are queued on the event loop and applied by the worker just
before its next step. A step that fails fails the requests it held, with the error; the others
keep streaming.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Sequence

from llmc.runtime.engine import Engine, RequestOutput
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.scheduler import Request


class AsyncEngine:
    """An `Engine` shared by concurrent async callers of one event loop.

    Args:
        engine: the engine to drive; nothing else may call it while this object serves.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self._queues: dict[str, asyncio.Queue] = {}
        # Filled on the event loop, applied by the worker thread before its next step.
        self._adds: list[Request] = []
        self._aborts: list[str] = []
        self._serving: asyncio.Task | None = None

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; raises LlmcError at once if it could never run, and the
        error it failed with if a step failed it.

        Closing the generator early (e.g. leaving `contextlib.aclosing`) cancels the request.
        """
        request = self.engine.request(prompt, params, priority=priority)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request.request_id] = queue
        self._adds.append(request)
        self._serve_soon()
        try:
            while True:
                output = await queue.get()
                if output.error is not None:
                    raise output.error
                yield output
                if output.finished:
                    return
        finally:
            if self._queues.pop(request.request_id, None) is not None:  # left before the end
                self._aborts.append(request.request_id)
                self._serve_soon()

    async def wait_idle(self) -> None:
        """Return once no request is left (aborts included)."""
        while self._serving is not None and not self._serving.done():
            await self._serving

    def _serve_soon(self) -> None:
        if self._serving is None or self._serving.done():
            self._serving = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            adds, aborts = self._adds, self._aborts
            self._adds, self._aborts = [], []
            try:
                outputs = await asyncio.to_thread(self._step, adds, aborts)
            except Exception as error:  # not a request's fault (those come back as outputs)
                outputs = [RequestOutput(request_id, [], "", True, "error", error) for request_id in self._queues]
                for request_id in self._queues:
                    self.engine.abort(request_id)
            for output in outputs:
                queue = self._queues.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)
            if not (self._adds or self._aborts or self.engine.has_unfinished()):
                return

    def _step(self, adds: list[Request], aborts: list[str]) -> list[RequestOutput]:
        """The worker thread's turn: the only code that touches the engine while serving."""
        outputs = []
        for request in adds:
            try:
                self.engine.add(request)
            except Exception as error:
                outputs.append(RequestOutput(request.request_id, [], "", True, "error", error))
        for request_id in aborts:
            self.engine.abort(request_id)
        if self.engine.has_unfinished():
            outputs += self.engine.step()
        return outputs
