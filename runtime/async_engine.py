"""Streaming many requests at once: `async for output in engine.generate(prompt, params)`.

One worker thread drives the shared `Engine` while any request is unfinished and hands each
step's outputs to the event loop, which puts them in the queue of the request they belong to, so
every caller streams its own tokens while the others run in the same batches. Only that thread
touches the engine: new requests and aborts are queued (from the event loop) and applied by the
worker just before its next step. It steps back to back, without waiting for the event loop to
hand each step over: the loop's own work (a server's JSON and sockets) runs beside the steps,
not between them. A step that fails fails the requests it held, with the error; the others keep
streaming.
"""

from __future__ import annotations

import asyncio
import threading
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
        self._lock = threading.Lock()
        self._adds: list[Request] = []
        self._aborts: list[str] = []
        self._submitted = 0  # submissions so far (under the lock)
        self._wake = threading.Event()
        self._worker: threading.Thread | None = None
        self._idle: asyncio.Event | None = None  # set while the worker has nothing to do
        self._loop: asyncio.AbstractEventLoop | None = None

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; raises LlmcError at once if it could never run, and the
        error it failed with if a step failed it.

        Closing the generator early (e.g. leaving `contextlib.aclosing`) cancels the request.
        """
        request = self.engine.request(prompt, params, priority=priority)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request.request_id] = queue
        self._submit(adds=[request])
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
                self._submit(aborts=[request.request_id])

    async def wait_idle(self) -> None:
        """Return once no request is left (aborts included)."""
        if self._idle is not None:
            await self._idle.wait()

    def _submit(self, adds: list[Request] = (), aborts: list[str] = ()) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # first use, or a new event loop (the worker delivers to it)
            self._loop, self._idle = loop, asyncio.Event()
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name="llmc-engine-steps", daemon=True)
            self._worker.start()
        self._idle.clear()
        with self._lock:
            self._adds += adds
            self._aborts += aborts
            self._submitted += 1
        self._wake.set()

    def _deliver(self, outputs: list[RequestOutput], idle_after: int | None) -> None:
        """On the event loop: each output to its request's queue; `idle_after`: the worker went
        idle having taken every submission up to this count."""
        for output in outputs:
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)
        if idle_after is not None and idle_after == self._submitted:
            self._idle.set()

    def _run(self) -> None:
        """The worker thread: the only code that touches the engine while serving."""
        while True:
            self._wake.wait()
            with self._lock:
                adds, aborts, taken = self._adds, self._aborts, self._submitted
                self._adds, self._aborts = [], []
                self._wake.clear()
            outputs = []
            for request in adds:
                try:
                    self.engine.add(request)
                except Exception as error:
                    outputs.append(RequestOutput(request.request_id, [], "", True, "error", error))
            for request_id in aborts:
                self.engine.abort(request_id)
            if self.engine.has_unfinished():
                try:
                    outputs += self.engine.step()
                except Exception as error:  # not a request's fault (those come back as outputs)
                    failed = [r.request_id for r in self.engine.scheduler.running + self.engine.scheduler.waiting]
                    for request_id in failed:
                        self.engine.abort(request_id)
                    outputs += [RequestOutput(request_id, [], "", True, "error", error) for request_id in failed]
            idle = not self.engine.has_unfinished()
            if not idle:
                self._wake.set()  # step again at once
            try:
                self._loop.call_soon_threadsafe(self._deliver, outputs, taken if idle else None)
            except RuntimeError:  # the event loop is closed: its callers are gone
                pass
