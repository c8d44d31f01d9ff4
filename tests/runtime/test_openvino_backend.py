"""--backend openvino: the engine's segments as one OpenVINO model with OpenVINO's paged attention
(runtime/backends/openvino.py), and --bf16 with its check (precision/bf16.py).

The reference is onnxruntime on the exported, unmodified graph, each sequence computed from
scratch: the backend's logits must match it to float rounding in f32, wherever the sequences sit
in the pool and however they share a step. bf16 is compared with looser, stated tolerances.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from llmc.compiler.build import compile_model
from llmc.compiler.paged_engine import PagedOptions
from llmc.errors import LlmcError
from llmc.formats.cpu_features import cpu_flags, native_bf16
from llmc.formats.engine_file import read_engine
from llmc.inspection import inspect
from llmc.plugins.paged_attention import PagedBatch
from llmc.precision.calibration import prefill_feeds
from llmc.precision.plan import PrecisionOptions
from llmc.runtime.backends.base import BackendOptions
from llmc.runtime.backends.openvino import (BLOCK_SIZE, DECODE_STEP_TOKENS, F32_DECODES, F32_PROMPTS, FUSED_MLP,
                                            FUSED_MLP_TRIALS, ONEDNN_MIN_WIDTH, ONEDNN_PROMPTS, compute_precision,
                                            decode_model, f32_width, fused_mlp_step_limit, products_on_onednn,
                                            weight_only, weights_transposed)
from llmc.runtime.backends.registry import open_backend
from llmc.runtime.engine import Engine
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.scheduler import SchedulerConfig
from llmc.runtime.step_plan import PACKED, StepPlan

pytest.importorskip("openvino")
F32_TOLERANCE = 2e-3  # max abs logit difference (logits of order 10; measured ~1e-5)
BF16_ON_HERE = bool(native_bf16(cpu_flags()))
AMX_HERE = {"amx_bf16", "amx_tile"} <= cpu_flags()
TEXT = ("def read_lines(path):\n    with open(path) as f:\n        return [line.rstrip() for line in f]\n\n"
        "class Counter:\n    def __init__(self):\n        self.counts = {}\n")


@pytest.fixture(scope="module")
def engines(trained_onnx, tmp_path_factory):
    folder = tmp_path_factory.mktemp("openvino")
    paths = {"onnxruntime": folder / "ort.plan", "f32": folder / "ov.plan", "bf16": folder / "bf16.plan",
             "kv16": folder / "kv16.plan", "int4-bf16": folder / "int4-bf16.plan"}
    small = PagedOptions(max_seq_len=256, max_batch=8)
    compile_model(trained_onnx, paths["onnxruntime"], paged=small)
    compile_model(trained_onnx, paths["f32"], backend="openvino", paged=small)
    compile_model(trained_onnx, paths["kv16"], backend="openvino", paged=PagedOptions(max_seq_len=256, max_batch=8,
                                                                                      kv_dtype="float16"))
    if BF16_ON_HERE:
        compile_model(trained_onnx, paths["bf16"], backend="openvino", paged=small, bf16=True)
        compile_model(trained_onnx, paths["int4-bf16"], backend="openvino", paged=small, bf16=True,
                      precision=PrecisionOptions(weights="int4", force=True))
    return paths


@pytest.fixture(scope="module")
def reference(trained_onnx):
    """Logits of every position of a sequence computed from scratch on the unmodified graph."""
    session = ort.InferenceSession(str(trained_onnx), providers=["CPUExecutionProvider"])

    def logits(ids) -> np.ndarray:
        return session.run(["logits"], prefill_feeds(session, np.asarray(ids)))[0][0]
    return logits


def _ids(engine_path, count: int, offset: int = 0) -> list[int]:
    return Engine(engine_path, threads=1).tokenizer.encode(TEXT)[offset:offset + count]


def _two_steps(backend, a: list[int], b: list[int]):
    """Step 1: sequence A's prompt alone in blocks 3.. (rows: every position). Step 2: A's next
    token beside sequence B's whole prompt in blocks 9.. (rows: A's token and every B position)."""
    blocks_a, blocks_b = np.arange(3, 8), np.arange(9, 14)
    first = StepPlan(PACKED, np.array(a[:-1]), np.arange(len(a) - 1),
                     PagedBatch(blocks_a[None], np.array([0]), np.array([0, len(a) - 1])), np.arange(len(a) - 1))
    step1 = backend.run(first)
    width = max(len(blocks_a), len(blocks_b))
    tables = np.stack([np.resize(blocks_a, width), np.resize(blocks_b, width)])
    tokens = np.array([a[-1], *b])
    positions = np.concatenate([[len(a) - 1], np.arange(len(b))])
    second = StepPlan(PACKED, tokens, positions, PagedBatch(tables, np.array([len(a) - 1, 0]),
                                                           np.array([0, 1, 1 + len(b)])), np.arange(1 + len(b)))
    return step1, backend.run(second)


def _backend(path, decode_model: bool = True):
    engine = read_engine(path)
    backend, _ = open_backend(engine, BackendOptions(threads=2, decode_model=decode_model), kv_pool_mb=16)
    return backend


def test_f32_steps_match_the_unmodified_graph_wherever_the_sequences_sit(engines, reference):
    folder = engines["f32"].parent
    before = sorted(folder.iterdir())
    backend = _backend(engines["f32"])
    assert sorted(folder.iterdir()) == before  # the load writes nothing beside the engine
    assert backend.precision == "f32" and backend.kv.block_size == BLOCK_SIZE
    a, b = _ids(engines["f32"], 70), _ids(engines["f32"], 40, offset=5)  # A spans three blocks
    step1, step2 = _two_steps(backend, a, b)
    expected_a = reference(a)
    np.testing.assert_allclose(step1, expected_a[:-1], atol=F32_TOLERANCE)
    np.testing.assert_allclose(step2[0], expected_a[-1], atol=F32_TOLERANCE)  # read A's keys from the pool
    np.testing.assert_allclose(step2[1:], reference(b), atol=F32_TOLERANCE)


def test_an_f16_cache_under_f32_compute_is_stored_in_the_bound_pool(engines, reference):
    """--kv-cache-dtype fp16: the pool is float16 (twice the blocks in the same MiB), OpenVINO
    writes the steps' keys and values into it (the blocks the tables give, no others), and the
    decode reading them back stays near the unmodified graph."""
    backend = _backend(engines["kv16"])
    assert backend.precision == "f32" and backend.kv.pool.dtype == np.float16
    assert backend.kv.num_blocks == 2 * _backend(engines["f32"]).kv.num_blocks
    a, b = _ids(engines["kv16"], 70), _ids(engines["kv16"], 40, offset=5)
    assert len(a) == 51 and len(b) == 40  # the text's whole length: blocks 3-4 and 9-10
    step1, step2 = _two_steps(backend, a, b)
    pool = backend.kv.pool
    written = np.abs(pool).reshape(pool.shape[0], pool.shape[1], -1).max(axis=(0, 2)) > 0
    assert np.nonzero(written)[0].tolist() == [3, 4, 9, 10]
    expected = np.concatenate([reference(a), reference(b)])
    got = np.concatenate([step1, step2])
    # float16 keys and values (11 mantissa bits): logits move by well under 1% of their spread
    # (measured 0.1%); a near tie may flip a top-1 (measured 1 of 91)
    assert np.abs(got - expected).max() < 0.01 * expected.std()
    assert np.mean(got.argmax(-1) == expected.argmax(-1)) >= 0.97


@pytest.mark.skipif(not BF16_ON_HERE, reason="this CPU has neither avx512_bf16 nor AMX")
def test_bf16_steps_stay_near_the_unmodified_graph(engines, reference):
    backend = _backend(engines["bf16"], decode_model=False)  # one model (a second one may share a u8 pool)
    assert backend.precision == "bf16" and backend.kv.pool.dtype == np.uint16  # the pool holds bf16
    # counted in its own 2 bytes: the same MiB hold twice the float32 pool's blocks
    assert backend.kv.num_blocks == 2 * _backend(engines["f32"]).kv.num_blocks
    a, b = _ids(engines["bf16"], 70), _ids(engines["bf16"], 40, offset=5)
    step1, step2 = _two_steps(backend, a, b)
    expected = np.concatenate([reference(a), reference(b)])
    got = np.concatenate([step1, step2])
    # bf16 keeps 8 mantissa bits: logits move by a few hundredths of their spread; most top-1s hold
    assert np.abs(got - expected).mean() < 0.05 * expected.std()
    assert np.mean(got.argmax(-1) == expected.argmax(-1)) >= 0.9


def test_greedy_requests_served_together_decode_as_the_onnxruntime_engine(engines):
    prompts = [_ids(engines["f32"], n, offset=o) for n, o in ((9, 0), (37, 3), (64, 11))]
    outputs = {}
    for name in ("onnxruntime", "f32"):
        engine = Engine(engines[name], threads=2)
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=24, ignore_eos=True)) for p in prompts]
        tokens = {i: [] for i in ids}
        while engine.has_unfinished():
            for out in engine.step():
                assert out.error is None
                tokens[out.request_id] += out.new_token_ids
        outputs[name] = [tokens[i] for i in ids]
    assert all(len(t) == 24 for t in outputs["f32"])
    assert outputs["f32"] == outputs["onnxruntime"]


def test_the_default_step_budget_is_the_backends(engines):
    # OpenVINO's kernels run 2,048-token steps better than 512 (runtime/backends/openvino.py);
    # a config given wins.
    assert Engine(engines["onnxruntime"], threads=1).config.max_num_batched_tokens == 512
    assert Engine(engines["f32"], threads=1).config.max_num_batched_tokens == 2048
    given = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    assert Engine(engines["f32"], given, threads=1).config.max_num_batched_tokens == 64
    # A config that sets one limit keeps the engine's others.
    assert Engine(engines["f32"], SchedulerConfig(max_num_seqs=4), threads=1).config.max_num_batched_tokens == 2048
    seats = read_engine(engines["f32"]).manifest.paged.max_batch
    assert Engine(engines["f32"], SchedulerConfig(max_num_batched_tokens=64), threads=1).config.max_num_seqs == seats


RESIDENT = """
import sys
from pathlib import Path
from llmc.formats.engine_file import read_engine
from llmc.runtime.backends.base import BackendOptions
from llmc.runtime.backends.registry import open_backend
path = str(Path(sys.argv[1]).resolve())
backend, _ = open_backend(read_engine(path), BackendOptions(threads=1), kv_pool_mb=4)
mapped, resident, current = 0, 0, None
for line in open("/proc/self/smaps"):
    fields = line.split()
    if "-" in fields[0] and not fields[0].endswith(":"):
        current = fields[5] if len(fields) > 5 else None
        mapped += current == path
    elif fields[0] == "Rss:" and current == path:
        resident += int(fields[1]) * 1024
print(mapped, resident)
"""


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="reads Linux's /proc/self/smaps")
def test_the_engine_file_read_to_compile_does_not_stay_resident(engines):
    """OpenVINO keeps a mapping of the engine file per segment it read; their pages are dropped."""
    done = subprocess.run([sys.executable, "-c", RESIDENT, str(engines["f32"])], capture_output=True, text=True,
                          check=True)
    mapped, resident = map(int, done.stdout.split())
    size = engines["f32"].stat().st_size
    assert mapped > 1  # OpenVINO's mappings besides llmc's own: what the release is for
    assert resident < 0.1 * size, f"{resident} of {size} bytes of the engine file resident after load"


def test_openvino_engines_keep_sibling_products_apart_at_the_same_level(engines):
    """OpenVINO fuses SiLU into a gate product only when the gate is a product of its own."""
    ort, ov = (read_engine(engines[name]).manifest for name in ("onnxruntime", "f32"))
    merged = {e["pass"]: e["matches"] for e in ort.optimization}
    assert merged["merge-sibling-matmuls"] > 0
    assert ov.build_options["level"] == ort.build_options["level"] == "2"
    assert ov.build_options["passes"] == [p for p in ort.build_options["passes"] if p != "merge-sibling-matmuls"]


def test_the_compute_precision_follows_the_engine_and_the_cpu(engines):
    f32 = read_engine(engines["f32"]).manifest
    assert compute_precision(f32, frozenset({"avx512_bf16"})) == ("f32", "fp32 compute (compiled without --bf16)")
    allowed = type(f32)(**{**f32.__dict__, "build_options": {**f32.build_options, "compute": "bf16"}})
    assert compute_precision(allowed, frozenset({"avx512f", "amx_bf16"}))[0] == "bf16"
    precision, why = compute_precision(allowed, frozenset({"avx512f"}))
    assert precision == "f32" and "neither avx512_bf16 nor AMX" in why
    # weight-only quantized: bf16 only with AMX
    linears = {"layers.0.mlp": "int4", "lm_head": "int8-weights"}
    int4 = type(f32)(**{**allowed.__dict__, "precision": {"linears": linears}})
    assert weight_only(int4)
    assert compute_precision(int4, frozenset({"avx512_bf16", "amx_bf16", "amx_tile"}))[0] == "bf16"
    assert compute_precision(int4, frozenset({"avx512_bf16"})) == (
        "f32", "fp32 compute: compiled with --bf16, but without AMX weight-only quantized products run faster in f32 "
        "(this CPU has avx512_bf16)")
    text = inspect(engines["f32"]).text()
    assert "compute       fp32 compute (compiled without --bf16)" in text
    if BF16_ON_HERE:
        text = inspect(engines["bf16"]).text()
        assert "bf16 allowed (perplexity" in text and "compute       bf16 compute (--bf16; this CPU has" in text


def test_a_second_model_of_a_kind_picked_by_the_cpu_only_under_bf16(engines):
    amx = frozenset({"avx512_bf16", "amx_bf16", "amx_tile"})
    assert decode_model("bf16", False, amx)[0] == decode_model("bf16", False, amx, threads=2)[0] == FUSED_MLP
    assert decode_model("bf16", False, amx, threads=1) == (None, "one model for every step (the fused MLP needs 2 "
                                                                 "threads or more)")
    # weight-only quantized products: an f32 decode model, whatever the threads
    assert decode_model("bf16", True, amx, threads=1)[0] == F32_DECODES
    for quantized in (False, True):
        assert decode_model("f32", quantized, amx) == (None, "one model for every step (a decode model needs bf16 "
                                                             "compute, or float32 linear layers 2,048 wide or more on "
                                                             "an AMD CPU)")
    # without AMX (float weights: a quantized engine computes in f32 there): on Intel's AVX-512,
    # decodes in bf16 and prompts on an f32 model, over a shared u8 cache; on AMD's, one bf16 model
    no_amx = frozenset({"avx512_bf16"})
    assert decode_model("bf16", False, no_amx, vendor="GenuineIntel")[0] == F32_PROMPTS
    assert decode_model("bf16", False, no_amx, threads=1, vendor="GenuineIntel")[0] == F32_PROMPTS
    assert decode_model("bf16", False, no_amx, vendor="AuthenticAMD") == (
        None, "one model for every step, in bf16 (this AMD CPU computes bf16 products at twice the f32 rate without "
              "AMX: prompts run faster in bf16 too)")
    assert decode_model("bf16", False, amx, vendor="AuthenticAMD")[0] == FUSED_MLP  # AMX decides first
    assert decode_model("f32", False, no_amx, vendor="AuthenticAMD")[0] is None
    text = inspect(engines["f32"]).text()
    assert "decode        one model for every step (a decode model needs bf16 compute, or float32" in text
    assert _backend(engines["f32"]).small_request is None
    assert not weight_only(read_engine(engines["f32"]).manifest)


def test_wide_float32_engines_run_prompts_on_onednn_where_measured_faster(engines):
    """f32 compute, every linear float32, 2,048 wide or more, on AMD's CPUs (the maker measured):
    prompts on a model whose products run on oneDNN, AMX or not; nowhere else."""
    amx, no_amx = frozenset({"avx512_bf16", "amx_bf16", "amx_tile"}), frozenset({"avx512_bf16"})
    for flags in (amx, no_amx, frozenset()):
        assert decode_model("f32", False, flags, vendor="AuthenticAMD", f32_width=ONEDNN_MIN_WIDTH)[0] == ONEDNN_PROMPTS
    assert decode_model("f32", False, no_amx, vendor="GenuineIntel", f32_width=ONEDNN_MIN_WIDTH)[0] is None
    assert decode_model("f32", False, no_amx, vendor="AuthenticAMD", f32_width=ONEDNN_MIN_WIDTH - 1)[0] is None
    assert decode_model("bf16", False, no_amx, vendor="AuthenticAMD", f32_width=ONEDNN_MIN_WIDTH)[0] is None
    geometry = read_engine(engines["f32"]).manifest.geometry
    assert f32_width(read_engine(engines["f32"]).manifest) == geometry.num_heads * geometry.head_dim > 0
    if BF16_ON_HERE:  # quantized, or compiled for bf16 compute: not every product an f32 one
        for name in ("int4-bf16", "bf16"):
            assert f32_width(read_engine(engines[name]).manifest) == 0


def test_products_on_onednn_compute_the_same_on_onednn_and_the_restored_graph_on_mlas():
    """A product followed by a clamp runs on oneDNN, the logits' product and the restored graph on
    MLAS (the CPU plugin's rule this relies on: where OpenVINO changes it, this fails), and the
    outputs stay the float rounding apart."""
    import openvino as ov
    import openvino.opset13 as ops

    rng = np.random.default_rng(0)
    x = ops.parameter([1, -1, 64], ov.Type.f32, name="x")
    hidden = ops.matmul(x, ops.constant(rng.standard_normal((64, 256)).astype(np.float32)), False, False)
    logits = ops.matmul(hidden, ops.constant(rng.standard_normal((256, 32)).astype(np.float32)), False, False)
    logits.output(0).get_tensor().set_names({"logits"})
    model = ov.Model([logits], [x])
    core, config = ov.Core(), {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": 1, "PERF_COUNT": True}
    feeds = {"x": rng.standard_normal((1, 96, 64)).astype(np.float32)}

    def run():
        request = core.compile_model(model, "CPU", config).create_infer_request()
        out = request.infer(feeds)[0]
        kernels = [info.exec_type for info in request.get_profiling_info() if info.node_type == "FullyConnected"]
        return out, kernels, sorted(node.get_type_name() for node in model.get_ordered_ops())

    plain, plain_kernels, plain_ops = run()
    restore = products_on_onednn(model)
    clamped, clamped_kernels, clamped_ops = run()
    assert clamped_ops == sorted(plain_ops + ["Clamp"])  # one clamp: the logits' product has none
    assert [kernel.startswith("gemm_mlas") for kernel in plain_kernels] == [True, True]
    assert [kernel.startswith("gemm_mlas") for kernel in clamped_kernels] == [False, True]
    np.testing.assert_allclose(clamped, plain, rtol=1e-5, atol=1e-4)
    restore()
    restored, restored_kernels, restored_ops = run()
    assert restored_ops == plain_ops and restored_kernels == plain_kernels
    np.testing.assert_array_equal(restored, plain)
    lone_logits = ops.matmul(x, ops.constant(rng.standard_normal((64, 32)).astype(np.float32)), False, False)
    lone_logits.output(0).get_tensor().set_names({"logits"})
    assert products_on_onednn(ov.Model([lone_logits], [x])) is None  # nothing to move: no second model


def test_a_wide_float32_engine_runs_long_steps_on_onednn_and_decodes_on_mlas(engines, reference, monkeypatch,
                                                                             caplog):
    """The test model made wide enough and the CPU AMD's (faked where it is another): steps of up
    to 16 tokens on the first model's MLAS products, longer ones on the second's oneDNN ones, both
    near the unmodified graph over one f32 pool; where memory holds less than three engine files,
    one model, said once."""
    from llmc.runtime.backends import openvino as backend_module

    monkeypatch.setattr(backend_module, "ONEDNN_MIN_WIDTH", 1)
    monkeypatch.setattr(backend_module, "cpu_vendor", lambda: "AuthenticAMD")
    path = engines["f32"]
    assert "decode        steps of up to 16 tokens on MLAS's f32 products, longer ones on a second model whose " \
           "products run on oneDNN's (faster there on this AMD CPU from 1 wide)" in inspect(path).text()
    backend = _backend(path)
    assert backend.small_request is not None and backend.kv.pool.dtype == np.float32
    assert backend.decode_step_tokens == DECODE_STEP_TOKENS[ONEDNN_PROMPTS] == 16
    ran, infer = [], backend._infer
    backend._infer = lambda request, plan: ran.append(request) or infer(request, plan)
    ids = _ids(path, 48)
    assert len(ids) == 48
    blocks = np.arange(2, 4)[None]
    for first, tokens, model in ((0, 30, backend.request), (30, 16, backend.small_request),
                                 (46, 2, backend.small_request)):
        ran.clear()
        logits = backend.run(StepPlan(PACKED, np.array(ids[first:first + tokens]), np.arange(first, first + tokens),
                                      PagedBatch(blocks, np.array([first]), np.array([0, tokens])), np.arange(tokens)))
        assert ran == [model]
        np.testing.assert_allclose(logits, reference(ids[:first + tokens])[first:], atol=F32_TOLERANCE)
    monkeypatch.setattr(backend_module, "available_memory", lambda: 2 ** 20)
    with caplog.at_level("WARNING", logger=backend_module.__name__):
        short = _backend(path)
    assert short.small_request is None
    [record] = caplog.records
    assert record.getMessage().startswith(f"{path}: prompts run on the decode model, on MLAS's products: the 0.0 GiB")


def test_weights_transposed_leaves_every_product_as_it_was(tmp_path):
    import openvino as ov
    import openvino.opset13 as ops

    rng = np.random.default_rng(0)
    x = ops.parameter([2, 3, 8], ov.Type.f32, name="x")
    w1, w2 = rng.standard_normal((8, 5)).astype(np.float32), rng.standard_normal((5, 4)).astype(np.float16)
    first = ops.matmul(x, ops.constant(w1), False, False)
    second = ops.matmul(first, ops.convert(ops.constant(w2), "f32"), False, False)  # not a constant: kept
    model = ov.Model([second], [x])
    mapping, short = weights_transposed(model, tmp_path)
    assert short is None and len(mapping) == w1.nbytes and list(tmp_path.iterdir()) == []  # the file is unlinked
    products = [n for n in model.get_ordered_ops() if n.get_type_name() == "MatMul"]
    assert [n.get_attributes()["transpose_b"] for n in products] == [True, False]
    assert products[0].input_value(1).get_node().get_output_shape(0) == [5, 8]
    feed = rng.standard_normal((2, 3, 8)).astype(np.float32)
    got = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})(feed)[0]
    np.testing.assert_allclose(got, feed @ w1 @ w2.astype(np.float32), rtol=1e-5, atol=1e-5)
    assert weights_transposed(ov.Model([ops.relu(x)], [x]), tmp_path) == (None, None)  # nothing to transpose


def test_the_tiled_transpose_is_numpys_whatever_the_tiles_leave_over():
    from llmc.runtime.backends.openvino import _transpose_into

    source = np.random.default_rng(1).standard_normal((7, 11)).astype(np.float32)
    for tile in (1, 3, 4, 11, 512):
        target = np.full((11, 7), np.nan, np.float32)
        _transpose_into(target, source, tile)
        np.testing.assert_array_equal(target, source.T)


def test_no_second_model_where_its_weights_leave_no_room(tmp_path):
    """A second model whose weights take more than the room given is not built: the model keeps
    its products, and no file is made."""
    import openvino as ov
    import openvino.opset13 as ops

    def model():
        x = ops.parameter([1, 4], ov.Type.f32, name="x")
        return ov.Model([ops.matmul(x, ops.constant(np.ones((4, 2), np.float32)), False, False)], [x])

    unchanged = model()
    mapping, short = weights_transposed(unchanged, tmp_path, room=31)
    assert mapping is None and short == "its weights take 0.0 GiB, more than the 0.0 GiB of memory left for them"
    assert [n.get_attributes()["transpose_b"] for n in unchanged.get_ordered_ops() if n.get_type_name() == "MatMul"] \
        == [False]
    assert len(weights_transposed(model(), tmp_path, room=32)[0]) == 32
    assert list(tmp_path.iterdir()) == []


def test_transposed_weights_go_to_the_temporary_directory_or_nowhere(tmp_path, monkeypatch):
    """A folder that cannot take the file (here: missing) falls back to the temporary directory;
    where no file has room, no second model (None), never a write to a full disk."""
    import errno
    import os

    import openvino as ov
    import openvino.opset13 as ops

    def model():
        x = ops.parameter([1, 4], ov.Type.f32, name="x")
        return ov.Model([ops.matmul(x, ops.constant(np.ones((4, 2), np.float32)), False, False)], [x])

    assert len(weights_transposed(model(), tmp_path / "missing")[0]) == 32

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    unchanged = model()
    mapping, short = weights_transposed(unchanged, tmp_path)
    assert mapping is None and f"of disk, which neither {tmp_path} nor" in short
    assert not any(n.get_attributes().get("transpose_b") for n in unchanged.get_ordered_ops()
                   if n.get_type_name() == "MatMul")


@pytest.mark.skipif(not (BF16_ON_HERE and AMX_HERE), reason="the fused-MLP decode model needs AMX and bf16")
def test_bf16_decodes_on_the_fused_mlp_model_stay_near_the_unmodified_graph(engines, reference):
    backend = _backend(engines["bf16"])
    runtime = backend.small_request.get_compiled_model().get_runtime_model()
    assert any(op.get_rt_info()["layerType"].astype(str) == "LLMMLP" for op in runtime.get_ordered_ops())
    ids = _ids(engines["bf16"], 41)
    blocks = np.arange(2, 4)[None]
    backend.run(StepPlan(PACKED, np.array(ids[:-1]), np.arange(40), PagedBatch(blocks, np.array([0]), np.array([0, 40])),
                         np.array([39])))
    decode = StepPlan(PACKED, np.array(ids[-1:]), np.array([40]), PagedBatch(blocks, np.array([40]), np.array([0, 1])),
                      np.array([0]))
    ran, infer = [], backend._infer
    backend._infer = lambda request, plan: ran.append(request) or infer(request, plan)
    fused = backend.run(decode)[0]
    assert len(decode.tokens) <= DECODE_STEP_TOKENS[FUSED_MLP] and ran == [backend.small_request]
    plain = infer(backend.request, decode)[0]
    expected = reference(ids)[-1]
    for got in (fused, plain):
        assert np.abs(got - expected).mean() < 0.05 * expected.std()
    assert fused.argmax() == plain.argmax() == expected.argmax()


@pytest.mark.parametrize("faster_through, limit", [(0, 16), (32, 32), (128, 128), (256, 256), (10_000, 256)])
def test_the_fused_mlp_takes_steps_up_to_the_first_size_timed_slower(faster_through, limit):
    timed = []

    def prompt_seconds(tokens):
        timed.append(tokens)
        return (1.0, 2.0) if tokens <= faster_through else (2.0, 2.0)  # a tie keeps the prompt model
    assert fused_mlp_step_limit(prompt_seconds) == limit
    assert timed == [t for t in FUSED_MLP_TRIALS if t <= limit] + [t for t in FUSED_MLP_TRIALS if t > limit][:1]
    assert fused_mlp_step_limit(lambda tokens: None if tokens > 64 else (1.0, 2.0)) == 64  # longer than the pool


@pytest.mark.skipif(not BF16_ON_HERE, reason="the fused-MLP decode model needs bf16")
def test_a_loaded_engine_runs_on_the_fused_mlp_the_steps_it_timed_faster_there(engines, monkeypatch):
    """Where the CPU has no AMX, the second model is built as if it had (the plugin then leaves its
    MLPs unfused): what is checked is that both models are timed and the steps go where timed."""
    from llmc.runtime.backends import openvino as backend_module

    monkeypatch.setattr(backend_module, "cpu_flags", lambda: cpu_flags() | {"amx_bf16", "amx_tile"})
    timed = []

    def faster_through_64(backend, tokens):
        seconds = original(backend, tokens)
        timed.append((tokens, seconds))
        return (0.0, 1.0) if tokens <= 64 else (1.0, 0.0)
    original = backend_module.OpenVinoBackend._prompt_seconds
    monkeypatch.setattr(backend_module.OpenVinoBackend, "_prompt_seconds", faster_through_64)
    backend = _backend(engines["bf16"])
    assert backend.decode_step_tokens == DECODE_STEP_TOKENS[FUSED_MLP] and timed == []  # until it warms up
    backend.warm_up()
    assert [tokens for tokens, _ in timed] == [32, 64, 128]
    assert all(decode > 0 and prompt > 0 for _, (decode, prompt) in timed)  # each model really timed
    assert backend.decode_step_tokens == 64
    ran, infer = [], backend._infer
    backend._infer = lambda request, plan: ran.append(request) or infer(request, plan)
    for tokens, model in ((64, backend.small_request), (65, backend.request)):
        ran.clear()
        backend.run(StepPlan(PACKED, np.zeros(tokens, np.int64), np.arange(tokens),
                             PagedBatch(np.arange(3)[None], np.array([0]), np.array([0, tokens])), np.array([0])))
        assert ran == [model]


@pytest.mark.skipif(not (BF16_ON_HERE and AMX_HERE), reason="the fused-MLP decode model needs AMX and bf16")
def test_the_decode_model_can_be_turned_off_and_a_load_without_room_for_it_says_so(engines, monkeypatch, caplog):
    from llmc.llm import LLM
    from llmc.runtime.backends import openvino as backend_module

    with caplog.at_level("WARNING", logger=backend_module.__name__):
        off = LLM(engines["bf16"], threads=2, kv_pool_mb=16, decode_model=False)
        assert off.engine.backend.small_request is None and off.engine.backend.transposed_weights is None
        assert caplog.records == []  # turned off by hand: nothing to report
        monkeypatch.setattr(backend_module, "available_memory", lambda: 2 ** 20)
        short = _backend(engines["bf16"])
    assert short.small_request is None
    [record] = caplog.records
    assert record.getMessage().startswith(f"{engines['bf16']}: decodes run on the prompt model, without OpenVINO's "
                                          "fused MLP: its weights take ")
    assert record.getMessage().endswith("GiB, more than the 0.0 GiB of memory left for them")


@pytest.mark.skipif(not (BF16_ON_HERE and AMX_HERE), reason="the f32 decode model needs AMX and bf16")
def test_int4_prompts_in_bf16_and_decodes_in_f32_share_a_u8_cache(engines, reference):
    """A weight-only int4 engine under bf16 compute: prompts on the bf16 model, decodes on an f32
    one, both reading and writing one u8 pool in OpenVINO's layout (each key block's scales and
    zero points by channel, after its rows; each value row's after it). The decode reads keys the
    prompt model quantized: its logits stay as near the unmodified graph as the prompt model's."""
    import openvino as ov

    path = engines["int4-bf16"]
    assert weight_only(read_engine(path).manifest)
    assert "decode        steps of up to 32 tokens on a second model computing in f32" in inspect(path).text()
    backend = _backend(path)
    kv, geometry = backend.kv, read_engine(path).manifest.geometry
    heads, dim = geometry.num_kv_heads, geometry.head_dim
    assert [part.dtype for part in kv.parts] == [np.uint8, np.uint8]
    key_block, value_block = (heads, BLOCK_SIZE + 8, dim), (heads, BLOCK_SIZE, dim + 8)
    assert kv.parts[0].shape[2:] == key_block and kv.parts[1].shape[2:] == value_block
    # the pool's MiB counted in its own blocks' bytes
    assert kv.num_blocks == 16 * 2**20 // (geometry.num_layers * (np.prod(key_block) + np.prod(value_block)))
    precisions = [request.get_compiled_model().get_property("INFERENCE_PRECISION_HINT")
                  for request in (backend.request, backend.small_request)]
    assert precisions == [ov.Type.bf16, ov.Type.f32]

    ids = _ids(path, 41)
    blocks = np.arange(2, 4)[None]
    prompt = backend.run(StepPlan(PACKED, np.array(ids[:-1]), np.arange(40),
                                  PagedBatch(blocks, np.array([0]), np.array([0, 40])), np.arange(40)))
    written = [np.nonzero(part.reshape(*part.shape[:2], -1).any(axis=(0, 2)))[0].tolist() for part in kv.parts]
    assert written == [[2, 3], [2, 3]]  # the prompt's two blocks, in both parts, no others
    decode = StepPlan(PACKED, np.array(ids[-1:]), np.array([40]), PagedBatch(blocks, np.array([40]), np.array([0, 1])),
                      np.array([0]))
    ran, infer = [], backend._infer
    backend._infer = lambda request, plan: ran.append(request) or infer(request, plan)
    decoded = backend.run(decode)[0]
    assert ran == [backend.small_request]
    expected = reference(ids)
    plain = infer(backend.request, decode)[0]  # the same decode on the bf16 model
    # int4 weights and a u8 cache: logits move by a few hundredths of their spread (measured:
    # prompt 0.019, decode 0.014 at f32 and at bf16; 0.06 with the keys' scales misread)
    assert np.abs(prompt - expected[:-1]).mean() < 0.04 * expected.std()
    for got in (decoded, plain):
        assert np.abs(got - expected[-1]).mean() < 0.04 * expected.std()
    assert decoded.argmax() == plain.argmax() == expected[-1].argmax()
    for tokens, model in ((DECODE_STEP_TOKENS[F32_DECODES], backend.small_request), (41, backend.request)):
        ran.clear()
        backend.run(StepPlan(PACKED, np.array(ids[:tokens]), np.arange(tokens),
                             PagedBatch(np.arange(4, 6)[None], np.array([0]), np.array([0, tokens])), np.array([0])))
        assert ran == [model]  # steps of up to 32 tokens on the f32 model, longer ones on the bf16 one


@pytest.mark.skipif(not BF16_ON_HERE, reason="this CPU has neither avx512_bf16 nor AMX")
def test_without_amx_prompts_run_in_f32_and_decodes_in_bf16_over_one_u8_cache(engines, reference, monkeypatch):
    """A bf16 engine on an Intel CPU without AMX (faked where it has one or is AMD's): prompts on an f32 model, steps of
    up to 8 tokens on a bf16 one, one u8 pool. The decode reads the keys the f32 prompt model
    stored: its logits stay as near the unmodified graph as the prompt model's."""
    import openvino as ov

    from llmc.runtime.backends import openvino as backend_module

    monkeypatch.setattr(backend_module, "cpu_flags", lambda: cpu_flags() - {"amx_bf16", "amx_tile"})
    monkeypatch.setattr(backend_module, "cpu_vendor", lambda: "GenuineIntel")
    path = engines["bf16"]
    assert "decode        steps of up to 8 tokens in bf16, longer ones on a second model computing in f32" in \
        inspect(path).text()
    backend = _backend(path)
    assert [part.dtype for part in backend.kv.parts] == [np.uint8, np.uint8]
    precisions = [request.get_compiled_model().get_property("INFERENCE_PRECISION_HINT")
                  for request in (backend.request, backend.small_request)]
    assert precisions == [ov.Type.f32, ov.Type.bf16]
    ids = _ids(path, 41)
    blocks = np.arange(2, 4)[None]
    ran, infer = [], backend._infer
    backend._infer = lambda request, plan: ran.append(request) or infer(request, plan)
    prompt = backend.run(StepPlan(PACKED, np.array(ids[:-1]), np.arange(40),
                                  PagedBatch(blocks, np.array([0]), np.array([0, 40])), np.arange(40)))
    decode = StepPlan(PACKED, np.array(ids[-1:]), np.array([40]), PagedBatch(blocks, np.array([40]), np.array([0, 1])),
                      np.array([0]))
    decoded = backend.run(decode)[0]
    assert ran == [backend.request, backend.small_request]
    expected = reference(ids)
    # a u8 cache: logits move by a few hundredths of their spread (int4 weights and u8 measured 0.014-0.019)
    assert np.abs(prompt - expected[:-1]).mean() < 0.04 * expected.std()
    assert np.abs(decoded - expected[-1]).mean() < 0.04 * expected.std()
    assert decoded.argmax() == expected[-1].argmax()
    for tokens, model in ((DECODE_STEP_TOKENS[F32_PROMPTS], backend.small_request),
                          (DECODE_STEP_TOKENS[F32_PROMPTS] + 1, backend.request)):
        ran.clear()
        backend.run(StepPlan(PACKED, np.array(ids[:tokens]), np.arange(tokens),
                             PagedBatch(np.arange(4, 6)[None], np.array([0]), np.array([0, tokens])), np.array([0])))
        assert ran == [model]


@pytest.mark.skipif(not BF16_ON_HERE, reason="this CPU has neither avx512_bf16 nor AMX")
def test_on_amds_avx512_a_bf16_engine_runs_every_step_on_one_bf16_model(engines, monkeypatch):
    """A bf16 engine on an AMD CPU without AMX (faked where it is another): no second model, the
    pool in bf16, prompts and decodes on the one bf16 model (whose logits
    test_bf16_steps_stay_near_the_unmodified_graph checks)."""
    import openvino as ov

    from llmc.runtime.backends import openvino as backend_module

    monkeypatch.setattr(backend_module, "cpu_flags", lambda: cpu_flags() - {"amx_bf16", "amx_tile"})
    monkeypatch.setattr(backend_module, "cpu_vendor", lambda: "AuthenticAMD")
    path = engines["bf16"]
    assert "decode        one model for every step, in bf16 (this AMD CPU" in inspect(path).text()
    backend = _backend(path)
    assert backend.precision == "bf16" and backend.small_request is None and backend.decode_step_tokens == 0
    assert backend.kv.pool.dtype == np.uint16
    assert backend.request.get_compiled_model().get_property("INFERENCE_PRECISION_HINT") == ov.Type.bf16


@pytest.mark.skipif(not BF16_ON_HERE, reason="this CPU has neither avx512_bf16 nor AMX")
def test_without_amx_an_int4_bf16_engine_computes_in_f32_on_one_model(engines, reference, monkeypatch):
    """A weight-only int4 engine compiled with --bf16, on a CPU without AMX (faked where it has one):
    one f32 model for every step, its cache in the engine's type (f32 here), near the unmodified
    graph as any int4 engine is."""
    import openvino as ov

    from llmc.runtime.backends import openvino as backend_module

    monkeypatch.setattr(backend_module, "cpu_flags", lambda: cpu_flags() - {"amx_bf16", "amx_tile"})
    path = engines["int4-bf16"]
    text = inspect(path).text()
    assert "compute       fp32 compute: compiled with --bf16, but without AMX weight-only quantized" in text
    assert "decode        one model for every step (a decode model needs bf16 compute, or float32" in text
    backend = _backend(path)
    assert backend.small_request is None and backend.kv.pool.dtype == np.float32
    assert backend.request.get_compiled_model().get_property("INFERENCE_PRECISION_HINT") == ov.Type.f32
    ids = _ids(path, 41)
    step1, step2 = _two_steps(backend, ids, ids[:20])
    expected = reference(ids)
    # int4 weights: logits move by a few hundredths of their spread (f32 cache; u8 measured 0.014-0.019)
    assert np.abs(step1 - expected[:-1]).mean() < 0.04 * expected.std()
    assert np.abs(step2[0] - expected[-1]).mean() < 0.04 * expected.std()  # the prompt's keys read from the pool
    assert np.abs(step2[1:] - expected[:20]).mean() < 0.04 * expected.std()


@pytest.mark.skipif(not (BF16_ON_HERE and AMX_HERE), reason="the f32 decode model needs AMX and bf16")
def test_an_int4_engine_without_room_for_its_f32_decode_model_keeps_one_in_bf16(engines, monkeypatch, caplog):
    from llmc.runtime.backends import openvino as backend_module

    monkeypatch.setattr(backend_module, "available_memory", lambda: 2 ** 20)
    with caplog.at_level("WARNING", logger=backend_module.__name__):
        short = _backend(engines["int4-bf16"])
    assert short.small_request is None and short.kv.pool.dtype == np.uint16  # the bf16 cache of one bf16 model
    [record] = caplog.records
    assert record.getMessage() == (f"{engines['int4-bf16']}: decodes run on the prompt model, in bf16: the 0.0 GiB of "
                                   "memory available hold less than three times the engine file's 0.0 GiB")


def test_bf16_is_checked_where_the_cpu_computes_it_or_refused(trained_onnx, tmp_path, monkeypatch):
    out = tmp_path / "bf16.plan"
    if BF16_ON_HERE:
        result = compile_model(trained_onnx, out, backend="openvino", bf16=True)
        accuracy = result.manifest["build_options"]["bf16_accuracy"]
        assert accuracy["passed"] and accuracy["tokens"] > 100 and accuracy["top1_agreement"] > 0.9
        assert abs(accuracy["ppl_increase_pct"]) < 3.0
        # a comparison past the limit (bf16 does not get that far on this model): refused, nothing written
        from llmc.precision import bf16

        worse = lambda *args: (683, (10.0, 10.5, 5.0), 0.9, 0.01)  # noqa: E731
        monkeypatch.setattr(bf16, "_compare", worse)
        with pytest.raises(LlmcError, match=r"--bf16: perplexity \+5.0% on 683 tokens .* exceeds --max-ppl-increase 3%"):
            compile_model(trained_onnx, tmp_path / "worse.plan", backend="openvino", bf16=True)
        assert not (tmp_path / "worse.plan").exists()
        forced = compile_model(trained_onnx, tmp_path / "forced.plan", backend="openvino", bf16=True,
                               precision=PrecisionOptions(force=True))
        assert forced.manifest["build_options"]["bf16_accuracy"]["forced"]
    else:
        with pytest.raises(LlmcError, match="neither avx512_bf16 nor AMX"):
            compile_model(trained_onnx, out, backend="openvino", bf16=True)
        assert not out.exists()


def test_a_segment_openvino_cannot_read_or_a_full_folder_is_one_line_naming_the_engine(engines, monkeypatch):
    import errno
    import re

    from llmc.formats.engine_file import FileRange
    from llmc.runtime.backends import openvino as backend_module

    engine = read_engine(engines["f32"])
    section = engine.manifest.paged.segments[0].section
    args = (engine, section, FileRange(engine.path, engine.offsets["model.onnx.data"]), engine.manifest.geometry.head_dim)
    before = sorted(engine.path.parent.iterdir())

    class Refusing:  # OpenVINO's errors: source locations, then the message
        def read_model(self, path):
            raise RuntimeError("Exception from src/frontends/onnx/frontend/src/frontend.cpp:1:\n"
                               "OnnxNode 'x' is not supported\n")

    with pytest.raises(LlmcError, match=rf"^{re.escape(str(engine.path))}: section {re.escape(section)}: OpenVINO "
                                        r"cannot read it: OnnxNode 'x' is not supported$"):
        backend_module._read_segment(Refusing(), *args)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(backend_module.tempfile, "NamedTemporaryFile", full)
    with pytest.raises(LlmcError, match=r"which its folder cannot take \(No space left on device\)$"):
        backend_module._read_segment(Refusing(), *args)
    assert sorted(engine.path.parent.iterdir()) == before


@pytest.mark.parametrize("kwargs, message", [
    ({"paged": PagedOptions(block_size=16)}, "--block-size 16: --backend openvino keeps blocks of 32"),
    ({"paged": None}, "--no-paged and --backend openvino"),
    ({"bf16": True, "precision": PrecisionOptions(fp16=True)}, "--bf16 and --fp16"),
    ({"bf16": True, "paged": PagedOptions(kv_dtype="float16")}, "--bf16 and --kv-cache-dtype fp16"),
    ({"bf16": True, "backend": "onnxruntime"}, "--bf16: only for --backend openvino"),
])
def test_what_openvino_cannot_build_is_refused_in_one_line(trained_onnx, tmp_path, kwargs, message):
    out = tmp_path / "refused.plan"
    with pytest.raises(LlmcError, match=message):
        compile_model(trained_onnx, out, **{"backend": "openvino", **kwargs})
    assert not out.exists()


def test_a_graph_the_paged_lowering_cannot_take_is_refused_before_anything_is_written(trained_onnx, tmp_path,
                                                                                     monkeypatch):
    from llmc.compiler import build

    monkeypatch.setattr(build, "lower", lambda *args, **kwargs: ("the graph has no position_ids input", None))
    out = tmp_path / "new" / "refused.plan"
    with pytest.raises(LlmcError, match=r"an OpenVINO engine needs the paged lowering, which this model cannot "
                                        r"take \(the graph has no position_ids input\)$"):
        compile_model(trained_onnx, out, backend="openvino")
    assert not out.parent.exists()


def test_the_product_command_on_openvino_agrees_with_onnxruntime(trained_onnx, tmp_path):
    """--fp16 --int8-calib DATA, on both CPU backends: the same precision plan, the same next token."""
    from pathlib import Path

    data = Path(__file__).resolve().parents[2] / "data" / "pystdlib-text" / "heldout"
    precision = PrecisionOptions(fp16=True, int8_calib=str(data))
    small = PagedOptions(max_seq_len=256, max_batch=4)
    firsts = {}
    for backend in ("onnxruntime", "openvino"):
        path = tmp_path / f"{backend}.plan"
        compile_model(trained_onnx, path, backend=backend, paged=small, precision=precision)
        engine = Engine(path, threads=2)
        assert engine.manifest.precision["linears"] and engine.manifest.precision["fp16"]
        prompt = engine.tokenizer.encode(TEXT)[:40]
        engine.add_request(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))
        tokens = []
        while engine.has_unfinished():
            tokens += [t for out in engine.step() for t in out.new_token_ids]
        assert len(tokens) == 8
        firsts[backend] = tokens[0]
    assert firsts["openvino"] == firsts["onnxruntime"]


def test_the_bf16_check_refuses_a_cpu_without_bf16_unless_forced():
    from llmc.precision.bf16 import check_bf16

    warnings = []
    with pytest.raises(LlmcError, match="this CPU has neither avx512_bf16 nor AMX.*--force to allow it unchecked"):
        check_bf16(b"", [], max_ppl_increase=3.0, force=False, flags=frozenset({"avx512f"}))
    assert check_bf16(b"", [], max_ppl_increase=3.0, force=True, flags=frozenset({"avx512f"}),
                      progress=warnings.append) is None
    assert warnings and warnings[0].startswith("warning: --bf16:")


@pytest.mark.parametrize("with_positions, interleaved", [(False, 0), (False, 1), (True, 0)])
def test_rotary_read_with_tokens_as_batch_computes_what_the_3d_op_does(with_positions, interleaved):
    """The reading OpenVINO is given (`rotary_tokens_as_batch`) against onnxruntime on the
    unmodified 3-D op: per-token cos/sin rows, or position ids into a table."""
    from onnx import TensorProto, helper

    from llmc.runtime.backends.openvino import rotary_tokens_as_batch

    tokens, heads, head_dim, table = 7, 3, 8, 32
    rng = np.random.default_rng(0)
    positions = rng.permutation(table)[:tokens][None]  # tokens of sequences at unrelated positions
    angles = np.arange(table)[:, None] * 0.3 ** np.arange(head_dim // 2)
    feeds = {"x": rng.standard_normal((1, tokens, heads * head_dim)).astype(np.float32)}
    if with_positions:
        feeds.update(cos=np.cos(angles).astype(np.float32), sin=np.sin(angles).astype(np.float32),
                     position_ids=positions.astype(np.int64))
    else:
        feeds.update(cos=np.cos(angles[positions]).astype(np.float32), sin=np.sin(angles[positions]).astype(np.float32))
    inputs = [helper.make_tensor_value_info(name, TensorProto.INT64 if name == "position_ids" else TensorProto.FLOAT,
                                            list(value.shape)) for name, value in feeds.items()]
    node = helper.make_node("RotaryEmbedding", list(feeds), ["y"], num_heads=heads, interleaved=interleaved)
    graph = helper.make_graph([node], "rotary", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])

    def run(g):
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])
        return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]

    expected = run(graph)
    rotary_tokens_as_batch(graph, head_dim)
    assert [n.op_type for n in graph.node].count("RotaryEmbedding") == 1
    assert all(a.name != "num_heads" for a in graph.node[-2].attribute)  # read as the 4-D op
    got = run(graph)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)


def test_collapsed_reshapes_compute_the_same_and_leave_shapes_that_name_an_input_dimension():
    """A reshape to a fixed shape skips the reshapes ahead of it; one whose shape copies an input
    dimension (special zero) keeps its input. OpenVINO's outputs stay what they were."""
    import openvino as ov
    import openvino.opset13 as ops

    from llmc.runtime.backends.openvino import collapse_reshapes

    def model():
        x = ops.parameter([-1, 4, 3], ov.Type.f32, name="x")
        flat = ops.reshape(x, ops.constant(np.array([-1, 12])), special_zero=False)
        fixed = ops.reshape(flat, ops.constant(np.array([-1, 2, 6])), special_zero=True)
        copied = ops.reshape(fixed, ops.constant(np.array([0, -1])), special_zero=True)
        return ov.Model([ops.relu(copied), ops.relu(fixed)], [x]), fixed, copied

    x = np.random.default_rng(0).standard_normal((5, 4, 3)).astype(np.float32)
    before, _, _ = model()
    expected = ov.Core().compile_model(before, "CPU")(x)
    after, fixed, copied = model()
    collapse_reshapes(after)
    assert fixed.input_value(0).get_node().get_friendly_name() == "x"
    assert copied.input_value(0).get_node() is fixed
    got = ov.Core().compile_model(after, "CPU")(x)
    for i in range(2):
        np.testing.assert_array_equal(got[i], expected[i])


def test_an_engines_model_has_no_reshape_of_a_reshape(engines):
    from llmc.runtime.backends.openvino import paged_model

    model = paged_model(read_engine(engines["f32"]))
    chained = [node.get_friendly_name() for node in model.get_ordered_ops()
               if node.get_type_name() == "Reshape" and node.input_value(0).get_node().get_type_name() == "Reshape"]
    assert not chained
    assert sum(node.get_type_name() == "PagedAttentionExtension" for node in model.get_ordered_ops()) > 0


def test_a_steps_inputs_stay_readable_and_the_next_step_of_their_shapes_replaces_them(engines):
    """The tensors a step sets point into arrays the backend holds, not the arrays `feeds` made:
    freed, their memory would be handed out again (here, to arrays filled with -7) while OpenVINO
    still reads it. A next step whose inputs have the same shapes writes its values into the same
    arrays, and OpenVINO reads those."""
    backend = _backend(engines["f32"])
    ids = _ids(engines["f32"], 40)

    def plan(tokens, blocks):
        return StepPlan(PACKED, np.array(tokens), np.arange(len(tokens)),
                        PagedBatch(blocks[None], np.array([0]), np.array([0, len(tokens)])), np.arange(len(tokens)))
    for step in (plan(ids, np.arange(2, 4)), plan(ids[::-1], np.arange(5, 7))):
        backend.run(step)
        expected = backend.feeds(step)
        reused = [np.full(np.shape(array) or 1, -7, np.asarray(array).dtype) for _ in range(64)
                  for array in expected.values()]
        for name, array in expected.items():
            np.testing.assert_array_equal(backend.request.get_tensor(name).data, array, err_msg=name)
        del reused  # held until the inputs were read
