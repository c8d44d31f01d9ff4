"""Faults made on purpose: corrupted and truncated engine files, requests aborted at
random points, a KV pool far too small for a burst, and a step that raises. Each must end in a
clean `LlmcError` or in exactly the tokens of an unloaded run, with every KV block back."""

import asyncio
import itertools
import random
import threading

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from llmc import LLM, SamplingParams
from llmc.compiler.build import compile_model
from llmc.compiler.paged_engine import PagedOptions
from llmc.errors import LlmcError
from llmc.formats.engine_file import HEADER, read_engine
from llmc.runtime.async_engine import AsyncEngine
from llmc.runtime.engine import Engine
from llmc.runtime.scheduler import SchedulerConfig

GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n"]
LOGITS_PROMPT = "class Node:\n    def __init__(self):"
SMALL_CONFIG = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64)  # a quick warm-up


# ---- corrupted and truncated engine files ----------------------------------------------------

class Pristine:
    """The fixture engine's bytes, its layout, and what it generates."""

    def __init__(self, path):
        self.data = path.read_bytes()
        self.manifest_start = HEADER.size
        self.data_start = HEADER.size + HEADER.unpack_from(self.data)[2]
        sections = sorted(read_engine(path).manifest.sections, key=lambda s: s.offset)
        # Bytes between sections, where the writer aligns the next section: no checksum covers them.
        self.padding = [self.data_start + p for a, b in zip(sections, sections[1:])
                        for p in range(a.offset + a.length, b.offset)]
        self.boundaries = sorted({self.data_start + s.offset for s in sections}
                                 | {self.data_start + s.offset + s.length - 1 for s in sections})
        self.tokens, self.logits = generated(LLM(path, config=SMALL_CONFIG))


def generated(llm):
    tokens = [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]
    return tokens, llm.logits(llm.tokenizer.encode(LOGITS_PROMPT))


@pytest.fixture(scope="module")
def pristine(tiny_llama_engine):
    return Pristine(tiny_llama_engine)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    # A fresh name for every file: an LLM still alive maps its file, which must not be truncated.
    folder = tmp_path_factory.mktemp("faults")
    return (folder / f"{n}.plan" for n in itertools.count())


def check_loads_cleanly_or_not_at_all(path, pristine):
    """A damaged file is refused with LlmcError, or it runs exactly as the pristine one."""
    try:
        read_engine(path)
    except LlmcError:
        return "refused"
    try:
        llm = LLM(path, config=SMALL_CONFIG)
    except LlmcError:
        return "refused"
    tokens, logits = generated(llm)
    assert tokens == pristine.tokens
    np.testing.assert_array_equal(logits, pristine.logits)
    return "loaded"


@st.composite
def flips(draw, pristine):
    """1-8 bytes XORed with non-zero values, anywhere or in the padding only."""
    region = draw(st.sampled_from(["anywhere", "anywhere", "padding"]))
    # Uniform positions (hypothesis's integers favour the ends of their range).
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    count = draw(st.integers(1, 8))
    if region == "padding":
        positions = rng.sample(pristine.padding, min(count, len(pristine.padding)))
    else:
        positions = rng.sample(range(len(pristine.data)), count)
    return region, [(p, rng.randint(1, 255)) for p in positions]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_flipped_bytes_are_refused_or_harmless(pristine, scratch, data):
    damaged = bytearray(pristine.data)
    region, changes = data.draw(flips(pristine))
    for position, value in changes:
        damaged[position] ^= value
    path = next(scratch)
    path.write_bytes(damaged)
    try:
        event(f"{region}: {check_loads_cleanly_or_not_at_all(path, pristine)}")
    finally:
        path.unlink()


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_flipped_manifest_byte_is_refused(pristine, scratch, data):
    # Refused by read_engine itself, harmless or not: a damaged manifest may name the wrong
    # section, attention scale or dtype (see the next test), and only a checksum tells.
    damaged = bytearray(pristine.data)
    for position in data.draw(st.lists(st.integers(pristine.manifest_start, pristine.data_start - 1), min_size=1, max_size=2,
                                       unique=True)):
        damaged[position] ^= data.draw(st.integers(1, 255))
    path = next(scratch)
    path.write_bytes(damaged)
    try:
        with pytest.raises(LlmcError):
            read_engine(path)
    finally:
        path.unlink()


@pytest.mark.parametrize("build", [Engine, LLM])
def test_a_corrupted_section_is_named_when_checked_while_sessions_build(pristine, tiny_llama_engine, scratch, build):
    # Engine and LLM verify checksums in a thread (formats/engine_file.py, `SectionCheck`). A
    # flipped graph byte may first fail inside onnxruntime: the checksum error is what building
    # raises. A flipped weight byte builds fine and is found while serving: waiting for the check
    # raises it, and so does every later step.
    sections = read_engine(tiny_llama_engine).manifest.sections
    for section in [next(s for s in sections if s.name == "model.onnx.data"),
                    next(s for s in sections if s.name.startswith("segment."))]:
        for where in (section.length // 2, 3):
            damaged = bytearray(pristine.data)
            damaged[pristine.data_start + section.offset + where] ^= 0x5A
            path = next(scratch)
            path.write_bytes(damaged)
            corrupted = f"corrupted engine file .*'{section.name}'"
            try:
                if section.name != "model.onnx.data":
                    with pytest.raises(LlmcError, match=corrupted):
                        build(path)
                    continue
                built = build(path)
                with pytest.raises(LlmcError, match=corrupted):
                    built.section_check.wait()
                if build is LLM:
                    with pytest.raises(LlmcError, match=corrupted):
                        built.generate("hello")
                else:
                    built.add_request("hello")
                    (output,) = built.step()
                    assert isinstance(output.error, LlmcError) and output.finish_reason == "error"
                    assert "corrupted engine file" in str(output.error)
            finally:
                path.unlink()


def test_flips_in_padding_between_sections_load_and_change_nothing(pristine, scratch):
    damaged = bytearray(pristine.data)
    for position in pristine.padding:
        damaged[position] ^= 0xFF
    path = next(scratch)
    path.write_bytes(damaged)
    assert check_loads_cleanly_or_not_at_all(path, pristine) == "loaded"


# One byte of the manifest: without the manifest's checksum each would load (the JSON parses and
# its types check) and then compute something else or fail inside onnxruntime or NumPy.
MANIFEST_FLIPS = {  # (bytes to find, offset of the byte in them, XOR)
    "attention scale 0.125 -> 0.135 (other logits)": (b'"scale": 0.125', 12, ord("2") ^ ord("3")),
    "attention window 0 -> 1 (other tokens)": (b'"window": 0,', 10, ord("0") ^ ord("1")),
    "segment input input_ids -> inpuu_ids (KeyError)": (b'"input_ids"', 5, ord("t") ^ ord("u")),
    "kv_dtype float32 -> float33 (TypeError)": (b'"kv_dtype": "float32"', 19, ord("2") ^ ord("3")),
    "segment.1.onnx -> segment.0.onnx (ValueError)": (b'"section": "segment.1.onnx"', 20, ord("1") ^ ord("0")),
}


@pytest.mark.parametrize("needle, offset, value", MANIFEST_FLIPS.values(), ids=MANIFEST_FLIPS.keys())
def test_a_flipped_manifest_field_is_refused(pristine, scratch, needle, offset, value):
    damaged = bytearray(pristine.data)
    damaged[pristine.data.index(needle) + offset] ^= value
    path = next(scratch)
    path.write_bytes(damaged)
    assert check_loads_cleanly_or_not_at_all(path, pristine) == "refused"


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_truncated_files_are_refused(pristine, scratch, data):
    edges = [0, 7, 8, 19, 20, pristine.manifest_start - 1, pristine.manifest_start, pristine.data_start - 1,
             pristine.data_start, *pristine.boundaries]
    length = data.draw(st.one_of(st.integers(0, len(pristine.data) - 1), st.sampled_from(edges)))
    path = next(scratch)
    path.write_bytes(pristine.data[:length])
    try:
        with pytest.raises(LlmcError, match="truncated|not an llmc engine|corrupted"):
            read_engine(path)
    finally:
        path.unlink()


# ---- requests under load: aborts, pool exhaustion, failing steps ------------------------------

BLOCK, SEQ = 16, 64


@pytest.fixture(scope="module")
def small_pool(tiny_llama_onnx, tmp_path_factory):
    """8 blocks of 16 tokens: room for 2 sequences of the 64 positions, 12 seats."""
    path = tmp_path_factory.mktemp("small-pool") / "small.plan"
    compile_model(tiny_llama_onnx, path, paged=PagedOptions(block_size=BLOCK, kv_pool_mb=0.5, max_seq_len=SEQ,
                                                            max_batch=12))
    return path


@pytest.fixture(scope="module")
def alone(small_pool):
    """Greedy tokens of a request run alone on an idle engine of the same file, memoized."""
    engine, memo = Engine(small_pool), {}

    def run(prompt_ids, max_new_tokens):
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in memo:
            request_id = engine.add_request(prompt_ids, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
            tokens = []
            while engine.has_unfinished():
                for out in engine.step():
                    assert out.request_id == request_id and out.error is None
                    tokens += out.new_token_ids
            memo[key] = tokens
        return memo[key]
    return run


def random_requests(rng, count, vocab):
    """(prompt ids, max new tokens) pairs that fit 64 positions: 1 to 4 blocks each."""
    requests = []
    for _ in range(count):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        requests.append((prompt, rng.randint(1, SEQ - len(prompt) - 1)))
    return requests


def assert_pool_empty(engine):
    assert not engine.has_unfinished()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert engine.blocks.stats.blocks_in_use == 0


def state(engine, request_id):
    for request in engine.scheduler.waiting:
        if request.request_id == request_id:
            return "waiting"
    for request in engine.scheduler.running:
        if request.request_id == request_id:
            return "prefill" if request.num_computed < len(request.prompt_ids) else "decoding"
    return None


def test_requests_aborted_at_random_points_free_every_block(small_pool, alone):
    # A prefill cap below the prompts' lengths keeps prompts in prefill over several steps.
    engine = Engine(small_pool, SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, max_prefill_tokens=12))
    vocab = engine.tokenizer.vocab_size
    aborted_in = set()
    for seed in range(4):  # one engine for all schedules: a leak would add up
        rng = random.Random(seed)
        requests = random_requests(rng, 12, vocab)
        pending = list(range(len(requests)))  # not yet added
        ids, tokens, aborted, finished = {}, {}, set(), set()
        while pending or engine.has_unfinished():
            for _ in range(min(rng.randint(0, 2), len(pending))):
                index = pending.pop(0)
                prompt, max_new = requests[index]
                ids[engine.add_request(prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True))] = index
                tokens[index] = []
            live = [r for r in ids if ids[r] not in aborted | finished]
            if live and rng.random() < 0.25:
                victim = rng.choice(live)
                aborted_in.add(state(engine, victim))
                assert engine.abort(victim) and not engine.abort(victim)
                aborted.add(ids[victim])
            for out in engine.step():
                index = ids[out.request_id]
                assert index not in aborted and index not in finished and out.error is None
                tokens[index] += out.new_token_ids
                if out.finished:
                    assert out.finish_reason == "length"
                    finished.add(index)
        assert_pool_empty(engine)
        assert aborted and finished and len(aborted | finished) == len(requests)
        for index in finished:
            assert tokens[index] == alone(*requests[index]), index
    assert aborted_in == {"waiting", "prefill", "decoding"}
    assert engine.scheduler.preemptions > 0


def test_a_burst_far_beyond_the_pool_preempts_and_completes_every_request(small_pool, alone):
    engine = Engine(small_pool)
    assert engine.blocks.num_blocks == 2 * SEQ // BLOCK
    rng = random.Random(7)
    vocab = engine.tokenizer.vocab_size
    requests = [([rng.randrange(vocab) for _ in range(rng.randint(16, 32))], 30) for _ in range(12)]
    needed = sum(-(-(len(p) + n) // BLOCK) for p, n in requests)
    assert needed >= 4 * engine.blocks.num_blocks
    ids = {engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)): i
           for i, (p, n) in enumerate(requests)}
    tokens, reasons = [[] for _ in requests], [None] * len(requests)
    while engine.has_unfinished():
        for out in engine.step():
            tokens[ids[out.request_id]] += out.new_token_ids
            reasons[ids[out.request_id]] = out.finish_reason
    assert engine.scheduler.preemptions > 0
    assert reasons == ["length"] * len(requests)
    assert tokens == [alone(p, n) for p, n in requests]
    assert_pool_empty(engine)


class FailingStep:
    """Wraps the backend's run: the calls numbered in `fail_at` raise before computing anything
    (the pool's new slots stay unwritten), noting which requests were running."""

    def __init__(self, engine, fail_at):
        self.engine, self.step, self.fail_at, self.calls = engine, engine.backend.run, fail_at, 0
        self.failed_ids = []

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls in self.fail_at:
            self.failed_ids.append({r.request_id for r in self.engine.scheduler.running})
            raise RuntimeError("injected fault")
        return self.step(*args, **kwargs)


def steps(engine, count, tokens, outputs):
    for _ in range(count):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            outputs[out.request_id] = out


def assert_failed(outputs, tokens, request_ids, produced, engine):
    for request_id in request_ids:
        out = outputs[request_id]
        assert out.finished and out.finish_reason == "error" and out.new_token_ids == []
        assert isinstance(out.error, RuntimeError) and str(out.error) == "injected fault"
        assert len(tokens.get(request_id, [])) == produced and not engine.abort(request_id)


def test_a_step_that_raises_fails_its_requests_and_the_engine_keeps_serving(small_pool, alone, monkeypatch):
    engine = Engine(small_pool, SchedulerConfig(max_num_seqs=2))
    rng = random.Random(3)
    vocab = engine.tokenizer.vocab_size
    # The first prompt fills two blocks: a failed prefill must not leave them in the prefix cache.
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (2 * BLOCK, 9, 13, 21)]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    failing = FailingStep(engine, fail_at={1, 4})  # the first prefill; later, a decode
    monkeypatch.setattr(engine.backend, "run", failing)
    tokens, outputs = {}, {}
    first, second, third = (engine.add_request(p, params) for p in prompts[:3])
    steps(engine, 1, tokens, outputs)
    assert failing.failed_ids == [{first, second}]  # two seats: the third request waits
    assert_failed(outputs, tokens, (first, second), 0, engine)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    again, fourth = engine.add_request(prompts[0], params), engine.add_request(prompts[3], params)
    steps(engine, 3, tokens, outputs)  # a prefill, a decode, then a decode that fails
    assert failing.failed_ids[1] == {third, again}
    assert_failed(outputs, tokens, (third, again), 2, engine)
    assert tokens[third] == alone(prompts[2], 10)[:2] and tokens[again] == alone(prompts[0], 10)[:2]
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks  # the fourth is still waiting
    last = engine.add_request(prompts[0], params)
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id in (fourth, last) and out.error is None
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert tokens[fourth] == alone(prompts[3], 10)
    assert tokens[last] == alone(prompts[0], 10)
    assert_pool_empty(engine)


def test_async_callers_in_a_failed_step_get_the_error_and_the_others_finish(small_pool, alone, monkeypatch):
    engine = Engine(small_pool, SchedulerConfig(max_num_seqs=2))
    rng = random.Random(5)
    vocab = engine.tokenizer.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (11, 24, 6, 17)]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    failing = FailingStep(engine, fail_at={4})  # a prefill, two decodes, then the fault
    monkeypatch.setattr(engine.backend, "run", failing)
    server = AsyncEngine(engine)

    async def consume(prompt):
        seen, tokens = set(), []
        try:
            async for out in server.generate(prompt, params):
                seen.add(out.request_id)
                tokens += out.new_token_ids
        except RuntimeError as error:
            return seen, tokens, error
        return seen, tokens, None

    # The worker's first step waits until all three requests are submitted: taken one by one, the
    # first could be stepped alone and the fault would find the requests at different counts.
    gate, wake = threading.Event(), server._wake.wait
    server._wake.wait = lambda: gate.wait() and wake()

    async def main():
        callers = [asyncio.ensure_future(consume(p)) for p in prompts[:3]]
        while server._submitted < 3:
            await asyncio.sleep(0)
        gate.set()
        results = await asyncio.gather(*callers)
        after = await consume(prompts[3])
        await server.wait_idle()
        return results, after

    # A bounded wait: a broken fan-out of the error would leave the callers waiting for ever.
    results, after = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert len(failing.failed_ids) == 1 and failing.calls > 4
    for prompt, (seen, tokens, error) in zip(prompts, results):
        if seen & failing.failed_ids[0]:
            assert str(error) == "injected fault" and tokens == alone(prompt, 10)[:3]
        else:
            assert error is None and tokens == alone(prompt, 10)
    assert [error is None for _, _, error in results] == [False, False, True]
    assert after[2] is None and after[1] == alone(prompts[3], 10)
    assert_pool_empty(engine)
