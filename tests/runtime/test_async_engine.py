"""AsyncEngine: concurrent callers each stream their own request's tokens from shared steps."""

import asyncio
import contextlib

from llmc import LLM, SamplingParams
from llmc.runtime.async_engine import AsyncEngine
from llmc.runtime.engine import Engine

PARAMS = {"short": SamplingParams(max_new_tokens=4, ignore_eos=True),
          "long": SamplingParams(max_new_tokens=20, ignore_eos=True)}


def test_concurrent_streams_get_their_own_tokens_and_short_ones_finish_first(tiny_llama_engine):
    llm = LLM(tiny_llama_engine)
    expected = {name: llm.generate(f"prompt {name}", params)[0].token_ids for name, params in PARAMS.items()}
    engine = AsyncEngine(llm.engine)  # the engine that just served generate(), its prefix cache warm
    finished = []

    async def consume(name):
        tokens = []
        async for output in engine.generate(f"prompt {name}", PARAMS[name]):
            tokens += output.new_token_ids
        finished.append(name)
        return tokens

    async def main():
        return await asyncio.gather(consume("long"), consume("short"))

    long_tokens, short_tokens = asyncio.run(main())
    assert {"long": long_tokens, "short": short_tokens} == expected
    assert finished == ["short", "long"]  # the short request streamed to completion while the long one ran


def test_a_caller_that_stops_listening_cancels_its_request(tiny_llama_engine):
    engine = AsyncEngine(Engine(tiny_llama_engine))

    async def first_token_only():
        async with contextlib.aclosing(engine.generate("abc", PARAMS["long"])) as stream:
            async for output in stream:
                break
        await engine.wait_idle()
        return output.new_token_ids

    tokens = asyncio.run(first_token_only())
    assert len(tokens) == 1 and not engine.engine.has_unfinished()
    assert engine.engine.blocks.num_free_blocks == engine.engine.blocks.num_blocks


def test_adds_and_aborts_never_run_while_a_step_does(tiny_llama_engine):
    """Requests arrive and leave while steps run in the worker thread: every call into the engine
    must come from one thread at a time (adds and aborts queued to the stepping thread)."""
    import threading
    import time

    engine = Engine(tiny_llama_engine)
    inside, overlaps, threads = threading.Lock(), [], set()

    def exclusive(method):
        def wrapped(*args, **kwargs):
            if not inside.acquire(blocking=False):
                overlaps.append(method.__name__)
                return method(*args, **kwargs)
            try:
                threads.add(threading.get_ident())
                if method.__name__ == "step":
                    time.sleep(0.01)  # a slow step: callers arrive while it runs
                return method(*args, **kwargs)
            finally:
                inside.release()
        return wrapped

    for name in ("add", "abort", "step", "has_unfinished"):
        setattr(engine, name, exclusive(getattr(engine, name)))
    served = AsyncEngine(engine)

    async def one(index):
        await asyncio.sleep(0.005 * index)  # arrivals spread over the first steps
        tokens = []
        async with contextlib.aclosing(served.generate(f"request {index}", PARAMS["long"])) as stream:
            async for output in stream:
                tokens += output.new_token_ids
                if index % 3 == 0 and len(tokens) == 3:
                    break  # leaves early: an abort while others step
        return tokens

    async def main():
        results = await asyncio.gather(*(one(i) for i in range(12)))
        await served.wait_idle()
        return results

    results = asyncio.run(main())
    assert overlaps == []
    assert [len(t) for t in results] == [3 if i % 3 == 0 else 20 for i in range(12)]
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
