"""Steps of one sequence, and decodes of several, on the single-sequence graph
(passes/lower_single_sequence.py, runtime/backends/whole_graph.py): the graph equals the original
one, and an engine that switches between it and the segments makes the same tokens and logits as
one that never does."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from llmc.compiler.compare import run_onnx
from llmc.compiler.pipeline import optimize
from llmc.formats.engine_file import read_manifest
from llmc.formats.onnx_io import serialize
from llmc.formats.sessions import open_session, session_options
from llmc.passes.graph import attr
from llmc.passes.lower_single_sequence import LowerSingleSequence
from llmc.runtime.engine import Engine
from llmc.runtime.sampling_params import SamplingParams
from paged_cases import Stepper


@pytest.mark.parametrize("positions", [None, 64])
def test_graph_in_chunks_equals_the_original_graph_at_once(tiny_llama_onnx, positions):
    """Prefill chunks with and without a past, then decodes, through one buffer bound as both
    past and present: every position's logits equal the original graph's over the whole
    sequence (4 layers, 2 kv heads, head dim 64), with rotary embedding left to its own nodes or,
    given the positions, applied by the attention op from tables evaluated at compile time."""
    original = onnx.load(tiny_llama_onnx)
    model, _ = optimize(onnx.load(tiny_llama_onnx), level=2)
    LowerSingleSequence(positions=positions).run(model)
    attentions = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(attentions) == 4 and not any(n.op_type == "Attention" for n in model.graph.node)
    count = {op: sum(n.op_type == op for n in model.graph.node) for op in ("RotaryEmbedding", "Split")}
    assert count == ({"RotaryEmbedding": 0, "Split": 4} if positions else {"RotaryEmbedding": 8, "Split": 8})
    assert all(attr(n, "do_rotary") == int(positions is not None) for n in attentions)
    session = open_session(serialize(model), session_options(1))
    binding = session.io_binding()
    binding.bind_output("logits")
    buffers = []
    for layer in range(4):
        for part in ("key", "value"):
            buffer = ort.OrtValue.ortvalue_from_numpy(np.full((1, 2, 64, 64), np.nan, np.float32))
            binding.bind_ortvalue_input(f"past_key_values.{layer}.{part}", buffer)
            binding.bind_ortvalue_output(f"present.{layer}.{part}", buffer)
            buffers.append(buffer)
    ids = np.random.default_rng(0).integers(0, 258, 31)
    got, past = [], 0
    for count in (12, 9, 1, 1, 1, 1, 5, 1):
        total = past + count
        binding.bind_cpu_input("input_ids", ids[None, past:total])
        binding.bind_cpu_input("position_ids", np.arange(past, total)[None])
        binding.bind_cpu_input("seqlens_k", np.array([total - 1], np.int32))
        binding.bind_cpu_input("total_sequence_length", np.array(total, np.int32))
        binding.bind_cpu_input("logits_rows", np.arange(count))
        binding.bind_output("logits")
        session.run_with_iobinding(binding)
        got.append(binding.get_outputs()[0].numpy()[0])
        past = total
    feeds = {"input_ids": ids[None], "attention_mask": np.ones((1, 31), np.int64), "position_ids": np.arange(31)[None]}
    feeds.update({f"past_key_values.{i}.{part}": np.zeros((1, 2, 0, 64), np.float32)
                  for i in range(4) for part in ("key", "value")})
    want = run_onnx(original, feeds)["logits"][0]
    np.testing.assert_allclose(np.concatenate(got), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("positions", [None, 64])
def test_a_decode_of_several_sequences_equals_each_alone(tiny_llama_onnx, positions):
    """Three sequences of different lengths in rows of one buffer, each prefilled alone, then
    decoded together (one token each, a row per sequence): every logits row equals the original
    graph's at that sequence's last position. With rotary inside the attention op every other
    node computes each token alone, so the whole step runs as [sequences, tokens each] (three
    reshapes in all: the token inputs', and the two values whose logits rows are gathered packed,
    the last attention's output and the residual beside it); with RotaryEmbedding nodes left,
    which the layout check does not pass, each attention op reshapes its query, key, value and
    output."""
    original = onnx.load(tiny_llama_onnx)
    model, _ = optimize(onnx.load(tiny_llama_onnx), level=2)
    LowerSingleSequence(positions=positions).run(model)
    reshapes = sum(n.op_type == "Reshape" for n in model.graph.node)
    assert reshapes == 3 if positions else reshapes >= 4 * 4
    session = open_session(serialize(model), session_options(1))
    buffers = {f"{layer}.{part}": np.full((3, 2, 64, 64), np.nan, np.float32)
               for layer in range(4) for part in ("key", "value")}

    def run(rows: slice, ids: np.ndarray, positions: np.ndarray, totals: list[int], logits_rows) -> np.ndarray:
        binding = session.io_binding()
        binding.bind_output("logits")
        values = []
        for name, buffer in buffers.items():
            values.append(ort.OrtValue.ortvalue_from_numpy(buffer[rows]))
            binding.bind_ortvalue_input(f"past_key_values.{name}", values[-1])
            binding.bind_ortvalue_output(f"present.{name}", values[-1])
        binding.bind_cpu_input("input_ids", ids[None])
        binding.bind_cpu_input("position_ids", positions[None])
        binding.bind_cpu_input("seqlens_k", np.array(totals, np.int32) - 1)
        binding.bind_cpu_input("total_sequence_length", np.array(max(totals), np.int32))
        binding.bind_cpu_input("logits_rows", np.asarray(logits_rows, np.int64))
        session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()[0]

    rng = np.random.default_rng(3)
    sequences = [rng.integers(0, 258, n) for n in (7, 30, 18)]
    for row, ids in enumerate(sequences):
        run(slice(row, row + 1), ids[:-1], np.arange(len(ids) - 1), [len(ids) - 1], [len(ids) - 2])
    got = run(slice(0, 3), np.array([ids[-1] for ids in sequences]), np.array([len(ids) - 1 for ids in sequences]),
              [len(ids) for ids in sequences], [2, 0, 1])
    for row, ids in zip((1, 2, 0), sequences):
        n = len(ids)
        feeds = {"input_ids": ids[None], "attention_mask": np.ones((1, n), np.int64), "position_ids": np.arange(n)[None]}
        feeds.update({f"past_key_values.{i}.{part}": np.zeros((1, 2, 0, 64), np.float32)
                      for i in range(4) for part in ("key", "value")})
        want = run_onnx(original, feeds)["logits"][0, -1]
        np.testing.assert_allclose(got[row], want, atol=1e-4, rtol=0)


def run_traffic(engine: Engine) -> list[list[int]]:
    """A request alone, a second joining it, the first alone again, then a third sharing the
    first's prompt (a prefix-cache hit) alone: single-sequence steps before, between and after
    steps of two sequences."""
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompt = list(range(40, 90))
    first = engine.add_request(prompt, params)
    tokens = {first: []}
    for _ in range(4):
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    second = engine.add_request(list(range(100, 120)), SamplingParams(max_new_tokens=3, ignore_eos=True))
    tokens[second] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    third = engine.add_request(prompt + [7, 8, 9], params)
    tokens[third] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[first], tokens[second], tokens[third]]


def test_switching_paths_makes_the_tokens_of_the_segments_alone(tiny_llama_engine):
    assert read_manifest(tiny_llama_engine)["paged"]["single_sequence"] == "single_sequence.onnx"
    # One token a step (no speculation): the count of whole-graph steps below is the steps'.
    switching = Engine(tiny_llama_engine, kv_pool_mb=4, speculative_tokens=0)
    assert switching.backend._sessions is None  # not built until a step holds two sequences
    segments = Engine(tiny_llama_engine, kv_pool_mb=4, single_sequence=False, speculative_tokens=0)
    assert segments.backend.whole is None
    both = Engine(tiny_llama_engine, kv_pool_mb=4, concurrent=True)  # a server's: both paths built at load
    assert both.backend.whole is not None and both.backend._sessions is not None
    calls = []
    run = switching.backend.whole.run
    switching.backend.whole.run = lambda plan: calls.append(len(plan.tokens)) or run(plan)
    got = run_traffic(switching)
    assert got == run_traffic(segments)
    assert [len(t) for t in got] == [12, 3, 12]
    assert switching.backend._sessions is not None and len(calls) > 12
    assert switching.blocks.stats.prefix_hit_rate > 0  # the third request read the first's blocks


def run_batch_traffic(engine: Engine) -> list[list[int]]:
    """Six requests of different lengths at once, two more joining while they decode, ending at
    different steps: decodes of several sequences between the steps that prefill."""
    rng = np.random.default_rng(5)
    requests = [(rng.integers(3, 258, n).tolist(), new) for n, new in ((5, 9), (33, 14), (17, 3), (40, 11), (9, 16), (24, 6))]
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=new, ignore_eos=True)) for p, new in requests]
    tokens = {i: [] for i in ids}
    for step in range(60):
        if step == 6:
            for prompt in (rng.integers(3, 258, 21).tolist(), requests[1][0][:20] + [4]):  # the second: a prefix hit
                ids.append(engine.add_request(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True)))
                tokens[ids[-1]] = []
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        if step > 6 and not engine.has_unfinished():
            break
    return [tokens[i] for i in ids]


def test_decodes_of_several_sequences_make_the_tokens_of_the_segments_alone(tiny_llama_engine):
    # No guesses: a decode step with one runs on the segments.
    whole = Engine(tiny_llama_engine, kv_pool_mb=4, speculative_tokens=0)
    segments = Engine(tiny_llama_engine, kv_pool_mb=4, single_sequence=False)
    decodes = []
    run = whole.backend.whole.run
    whole.backend.whole.run = lambda plan: decodes.append(plan.num_seqs) or run(plan)
    got = run_batch_traffic(whole)
    assert got == run_batch_traffic(segments)
    assert [len(t) for t in got] == [9, 14, 3, 11, 16, 6, 8, 8]
    assert sum(n > 1 for n in decodes) >= 8 and max(decodes) >= 6


def test_blocks_rewritten_by_the_segments_are_not_read_from_a_row(tiny_llama_engine):
    """Sequences A and C decode together (rows); a segmented step then writes a different prompt
    B into A's blocks (A finished, B got its blocks) beside C's decode; the next decode of B and
    C must read B's keys and values from the pool, not A's from the row. Logits equal a decoder
    that runs every step on the segments."""
    from llmc.plugins.paged_attention import PagedBatch

    rng = np.random.default_rng(7)
    a, b, c = (rng.integers(3, 258, 20) for _ in range(3))
    tables = np.array([[0, 1], [4, 5]])

    def steps(decoder) -> list[np.ndarray]:
        def step(tokens, positions, pasts, counts):
            starts = np.concatenate([[0], np.cumsum(counts)])
            return decoder.step(np.asarray(tokens), np.asarray(positions), PagedBatch(tables, np.array(pasts), starts))
        return [step(np.concatenate([a[:19], c[:19]]), np.tile(np.arange(19), 2), [0, 0], [19, 19]),
                step([a[19], c[19]], [19, 19], [19, 19], [1, 1]),  # rows: A and C
                step(np.concatenate([b[:19], [7]]), [*range(19), 20], [0, 20], [19, 1]),  # segments: B over A
                step([b[19], 9], [19, 21], [19, 21], [1, 1])]  # rows again: B must not be A

    whole = Engine(tiny_llama_engine, kv_pool_mb=4)
    runs = []
    run = whole.backend.whole.run
    whole.backend.whole.run = lambda plan: runs.append(plan.num_seqs) or run(plan)
    got = steps(Stepper(whole.backend, whole.kv))
    segments = Engine(tiny_llama_engine, kv_pool_mb=4, single_sequence=False)
    want = steps(Stepper(segments.backend, segments.kv))
    assert runs == [2, 2]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=0)


def test_a_flush_gives_the_pool_what_the_segments_would_have_written(tiny_llama_engine):
    """Decodes on the whole graph leave their keys and values in the rows until something reads
    the pool; a flush then writes exactly the values the segments write at each step."""
    engines = [Engine(tiny_llama_engine, kv_pool_mb=4), Engine(tiny_llama_engine, kv_pool_mb=4, single_sequence=False)]
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 258, n).tolist() for n in (20, 33, 9)]
    for engine in engines:
        for prompt in prompts:
            engine.add_request(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))
        for _ in range(14):  # the prompts (one segmented step), then decodes of all three
            engine.step()
    whole, segments = engines
    rows = whole.kv.rows
    assert (rows._stored < rows._held).any()  # the decodes are in the rows only
    rows.flush()
    for request in whole.scheduler.running:
        table = whole.blocks.block_table(request.request_id)
        assert table == segments.blocks.block_table(request.request_id)
        positions = request.num_computed
        assert positions > len(request.prompt_ids) + 8
        got, want = (e.kv.pool[:, table].transpose(0, 2, 1, 3, 4) for e in engines)
        shape = (got.shape[0], got.shape[1], -1, got.shape[-1])  # [parts, kv heads, positions, head dim]
        np.testing.assert_allclose(got.reshape(shape)[:, :, :positions], want.reshape(shape)[:, :, :positions],
                                   atol=1e-4, rtol=0)


def test_logits_equal_the_segments_path(tiny_llama_engine):
    ids = np.random.default_rng(1).integers(0, 258, 70)
    single = Engine(tiny_llama_engine, kv_pool_mb=4).logits(ids)
    segments = Engine(tiny_llama_engine, kv_pool_mb=4, single_sequence=False).logits(ids)
    np.testing.assert_allclose(single, segments, atol=1e-4, rtol=0)


@pytest.mark.parametrize("options", [["--kv-cache-dtype", "fp16"], ["--backend", "onnxruntime", "--no-paged"]])
def test_engines_the_buffer_cannot_mirror_have_no_single_sequence_graph(tiny_llama_onnx, tmp_path, options):
    from click.testing import CliRunner

    from llmc.cli import main

    result = CliRunner().invoke(main, ["compile", str(tiny_llama_onnx), "-o", str(tmp_path / "e.plan"), *options])
    assert result.exit_code == 0, result.output
    paged = read_manifest(tmp_path / "e.plan")["paged"]
    assert paged is None or paged["single_sequence"] is None


def test_a_graph_reading_the_past_elsewhere_gets_no_single_sequence_graph(tiny_llama_onnx):
    """A node other than attention reading a past input would see the buffer's length, not the
    past's: the lowering refuses the graph, naming the node, and the engine keeps only segments."""
    from onnx import helper

    from llmc.compiler.paged_engine import PagedOptions, single_sequence_graph
    from llmc.errors import LlmcError
    from llmc.formats.decoder_interface import recognize_decoder

    model, _ = optimize(onnx.load(tiny_llama_onnx), level=2)
    interface = recognize_decoder(model, tiny_llama_onnx)
    head = next(n for n in model.graph.node if "logits" in n.output)
    head.output[list(head.output).index("logits")] = "logits_raw"
    model.graph.initializer.append(helper.make_tensor("zero", onnx.TensorProto.FLOAT, [], [0.0]))
    model.graph.node.extend([
        helper.make_node("Shape", ["past_key_values.0.key"], ["past_length"], name="reads_the_past", start=2, end=3),
        helper.make_node("Cast", ["past_length"], ["past_length_f"], to=onnx.TensorProto.FLOAT),
        helper.make_node("Mul", ["past_length_f", "zero"], ["nothing"]),
        helper.make_node("Add", ["logits_raw", "nothing"], ["logits"])])
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    with pytest.raises(LlmcError, match="node 'reads_the_past' \\(Shape\\) still reads past_key_values.0.key"):
        LowerSingleSequence(positions=64).run(copy)
    assert single_sequence_graph(model, interface, PagedOptions()) is None
