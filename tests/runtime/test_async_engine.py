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
