"""Streaming many requests at once: `async for output in engine.generate(prompt, params)`.

One stepping task drives the shared `Engine` while any request is unfinished and hands each
step's outputs to the queue of the request they belong to, so every caller streams its own
tokens while the others run in the same batches. Steps run in a worker thread: a step is
seconds of onnxruntime work that must not block the event loop.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Sequence

from llmc.runtime.engine import Engine, RequestOutput
from llmc.runtime.sampling_params import SamplingParams


class AsyncEngine:
    """An `Engine` shared by concurrent async callers.

    Args:
        engine: the engine to drive; only this object should step it.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self._queues: dict[str, asyncio.Queue] = {}
        self._aborts: list[str] = []  # applied between steps: a step runs in another thread
        self._stepping: asyncio.Task | None = None

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; raises LlmcError at once if it could never run.

        Closing the generator early (e.g. leaving `contextlib.aclosing`) cancels the request.
        """
        request_id = self.engine.add_request(prompt, params, priority=priority)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        if self._stepping is None or self._stepping.done():
            self._stepping = asyncio.create_task(self._step_until_idle())
        try:
            while True:
                output = await queue.get()
                if isinstance(output, BaseException):
                    raise output
                yield output
                if output.finished:
                    return
        finally:
            # A caller that stops listening early cancels its request.
            if self._queues.pop(request_id, None) is not None:
                if self._stepping is not None and not self._stepping.done():
                    self._aborts.append(request_id)
                else:
                    self.engine.abort(request_id)

    async def wait_idle(self) -> None:
        """Return once no request is left (aborts included)."""
        if self._stepping is not None:
            await self._stepping

    async def _step_until_idle(self) -> None:
        try:
            while True:
                while self._aborts:
                    self.engine.abort(self._aborts.pop())
                if not self.engine.has_unfinished():
                    return
                for output in await asyncio.to_thread(self.engine.step):
                    queue = self._queues.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(output)
        except Exception as error:  # a failed step fails every listener rather than hanging it
            for queue in self._queues.values():
                queue.put_nowait(error)
