"""A new backend is one class and one registry entry: a NumPy reference backend (onnx's reference
evaluator for the segments, plugins/paged_attention.py's float64 reference for attention, its own
stores into the pool) registered here serves an engine through `Engine` unchanged, and agrees with
the CPU backend: logits within 1e-4 (fp32 against float64 attention), greedy tokens equal."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx.external_data_helper import load_external_data_for_model
from onnx.reference import ReferenceEvaluator

from llmc.errors import LlmcError
from llmc.formats.engine_file import FileRange, bind_weights, read_engine
from llmc.plugins.paged_attention import paged_attention_reference
from llmc.runtime.backends import registry
from llmc.runtime.backends.base import Backend, BackendOptions, PoolPlacement
from llmc.runtime.engine import Engine
from llmc.runtime.kv_cache import KvCache
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.step_plan import PACKED, StepPaths, StepPlan

NAME = "numpy-reference"


class NumpyBackend:
    """Every step packed: each segment in onnx's reference evaluator, attention in NumPy."""

    paths = StepPaths()  # no whole graph: the planner sends every step packed
    placement = PoolPlacement()  # the host's memory, as the CPU's pool
    runs: list[str] = []  # the path of each step run, for the test to read

    def __init__(self, engine, options: BackendOptions):
        paged = engine.manifest.paged
        self.block_size, self.segments = paged.block_size, paged.segments
        weights = FileRange(engine.path, engine.offsets["model.onnx.data"])
        self.evaluators = []
        for segment in self.segments:
            if segment.section is None:
                self.evaluators.append(None)
                continue
            model = onnx.load_from_string(bind_weights(engine.sections[segment.section], weights))
            load_external_data_for_model(model, str(engine.path.parent))
            self.evaluators.append(ReferenceEvaluator(model))

    def attach(self, kv: KvCache) -> None:
        self.kv, self.pools = kv, kv.layer_pools()

    def warm_up(self) -> None:
        pass  # nothing is built lazily

    def steps_round_alike(self) -> bool:
        return False

    def run(self, plan: StepPlan) -> np.ndarray:
        assert plan.path == PACKED  # what its paths allow
        type(self).runs.append(plan.path)
        batch = plan.batch
        values = {"input_ids": plan.tokens[None], "position_ids": plan.positions[None],
                  "logits_rows": np.asarray(plan.rows, np.int64), **self.pools}
        stores = []
        for segment, evaluator in zip(self.segments, self.evaluators):
            if evaluator is not None:
                outputs = evaluator.run(list(segment.outputs), {name: values[name] for name in segment.inputs})
                values.update(zip(segment.outputs, outputs))
            call = segment.attention
            if call is not None:
                query, key, value, key_cache, value_cache = (values[name] for name in call.inputs[:5])
                values[call.output] = paged_attention_reference(
                    query, key, value, key_cache, value_cache, batch.block_tables, batch.context_lens,
                    batch.query_start_loc, call.scale, call.window, call.softcap).astype(query.dtype)
                stores += [(key_cache, key), (value_cache, value)]
        blocks, offsets = batch.slots(self.block_size)
        for pool, new in stores:  # [tokens, kv heads, head dim] → each token's slot
            pool[blocks, :, offsets] = new
        return values["logits"][0]


@pytest.fixture
def numpy_backend():
    registry.register(registry.BackendEntry(NAME, NumpyBackend))
    NumpyBackend.runs = []
    yield NumpyBackend
    registry.unregister(NAME)


def as_backend(path, name):
    engine = read_engine(path)
    return dataclasses.replace(engine, manifest=dataclasses.replace(engine.manifest, backend=name))


def test_the_reference_backend_satisfies_the_protocol():
    assert isinstance(NumpyBackend.__new__(NumpyBackend), Backend)


def test_a_backend_lacking_a_member_is_refused_in_one_line(tiny_llama_engine):
    class NoRun:  # every member but `run`
        paths, placement = StepPaths(), PoolPlacement()

        def __init__(self, engine, options):
            pass

        def attach(self, kv):
            pass

        def warm_up(self):
            pass

        def steps_round_alike(self):
            return False

    registry.register(registry.BackendEntry(NAME, NoRun))
    try:
        with pytest.raises(LlmcError, match=rf"^backend '{NAME}': NoRun lacks run \(runtime/backends/base.py"):
            Engine(as_backend(tiny_llama_engine, NAME))
    finally:
        registry.unregister(NAME)


def test_a_registered_numpy_backend_serves_greedy_tokens_through_the_engine(tiny_llama_engine, numpy_backend):
    reference = Engine(as_backend(tiny_llama_engine, NAME), kv_pool_mb=4)
    cpu = Engine(tiny_llama_engine, kv_pool_mb=4)
    assert isinstance(reference.backend, NumpyBackend)
    rng = np.random.default_rng(11)
    ids = rng.integers(3, 258, 40).tolist()
    np.testing.assert_allclose(reference.logits(ids), cpu.logits(ids), atol=1e-4, rtol=0)
    prompts = [rng.integers(3, 258, n).tolist() for n in (7, 30, 19)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    outputs, steps = [], []
    for engine in (reference, cpu):
        tokens = {engine.add_request(p, params): [] for p in prompts}  # together: prompts beside decodes
        steps.append(0)
        while engine.has_unfinished():
            steps[-1] += 1
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
        outputs.append(list(tokens.values()))
    assert outputs[0] == outputs[1] and all(len(t) == 12 for t in outputs[0])
    assert len(numpy_backend.runs) == 1 + steps[0]  # the logits call, then every step
    assert reference.blocks.num_free_blocks + sum(reference.blocks.ref_count(b) > 0 for b in
                                                  range(reference.blocks.num_blocks)) == reference.blocks.num_blocks


def test_an_unregistered_backend_is_one_line_naming_the_file(tiny_llama_engine):
    with pytest.raises(LlmcError, match=rf"{tiny_llama_engine}: backend '{NAME}' cannot run here; this build of "
                                        r"llmc runs onnxruntime, openvino, tensorrt engines"):
        Engine(as_backend(tiny_llama_engine, NAME))


def test_a_name_taken_is_refused(numpy_backend):
    with pytest.raises(LlmcError, match=f"backend '{NAME}' is registered already"):
        registry.register(registry.BackendEntry(NAME, NumpyBackend))
