"""``llmc::paged_attention`` driven the way TensorRT 11.4 drives a quickly deployable plugin, through
the real ``tensorrt.plugin`` package of the 11.4 bindings wheel (tests/tensorrt_wheel.py; skipped
with the reason when the registry is unreachable).

Only the compiled core is stood in for: the builder's calls into the plugin object
(plugin/_plugin_class.py: get_output_data_types with placeholder shapes, get_output_shapes with
symbolic ones, format combinations, get_launch_params, get_kernel; enqueue for the JIT plugin)
are the package's own code. Symbolic dimensions are `IDimensionExpr`s from an `IExprBuilder`
that folds constants, as TensorRT's does (a dynamic dimension is never constant; its
``get_constant_value`` is int64's minimum, as the 11.4 docstring says); evaluating them at a
binding of the dynamic dimensions checks the grid and scalars TensorRT would store.

The AOT kernel compiles for real, in a fresh process: this session's triton runs the
interpreter (TRITON_INTERPRET=1, which the JIT implementation here runs under).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import json
import operator
import re
import subprocess
import sys
import types

import numpy as np
import pytest

from llmc.errors import LlmcError
from llmc.plugins import tensorrt_plugin
from llmc.plugins.paged_attention import PLUGIN_ID, paged_attention_reference

tensorrt_wheel = pytest.importorskip("tensorrt_wheel")

NAMESPACE, NAME = PLUGIN_ID.split("::")
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 64, 16
DYNAMIC = ("tokens", "seqs", "seqs_plus_1", "max_blocks", "blocks")


@pytest.fixture(scope="module")
def wheel():
    try:
        return tensorrt_wheel.wheel_folder()
    except RuntimeError as exc:
        pytest.skip(str(exc))


@pytest.fixture
def trt(wheel, monkeypatch):
    """The stand-in as `tensorrt` with the plugin registered under the wheel's package; plugin
    fields and dimension lists as plain Python values (the core's containers)."""
    pytest.importorskip("triton", reason="triton is not installed (pip install 'llmc[gpu]')")
    stub = tensorrt_wheel.StubTensorRT(wheel)
    stub.overrides["PluginField"] = lambda name, data, type: types.SimpleNamespace(name=name, data=data, type=type)
    stub.overrides["PluginFieldCollection"] = list
    stub.overrides["DimsExprs"] = lambda length: [None] * length
    for name in [m for m in sys.modules if m == "tensorrt" or m.startswith("tensorrt.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorrt", stub)
    tensorrt_plugin.register_plugin.cache_clear()
    tensorrt_plugin.register_plugin()
    yield stub
    tensorrt_plugin.register_plugin.cache_clear()
    tensorrt_plugin.set_ptx_target(hardware_compatible=False)
    for name in [m for m in sys.modules if m.startswith("tensorrt.")]:
        del sys.modules[name]


class Symbolic:
    """TensorRT's dimension expressions on the stand-in: `Dim` and an `IExprBuilder`."""

    def __init__(self, trt):
        ops = trt.DimensionOperation
        self.ops = {ops.SUM: operator.add, ops.SUB: operator.sub, ops.PROD: operator.mul,
                    ops.FLOOR_DIV: operator.floordiv, ops.CEIL_DIV: lambda a, b: -(-a // b), ops.MAX: max,
                    ops.MIN: min, ops.EQUAL: lambda a, b: int(a == b), ops.LESS: lambda a, b: int(a < b)}
        symbolic = self

        class Dim(trt.IDimensionExpr):
            def __init__(self, evaluate, value=None):
                self.evaluate, self.value = evaluate, value

            def is_constant(self):
                return self.value is not None

            def get_constant_value(self):
                return self.value if self.value is not None else -2**63

        class Builder(trt.IExprBuilder):
            def constant(self, value):
                return Dim(lambda env: value, value)

            def operation(self, op, first, second):
                fn = symbolic.ops[op]
                if first.is_constant() and second.is_constant():
                    return self.constant(fn(first.value, second.value))
                return Dim(lambda env: fn(first.evaluate(env), second.evaluate(env)))

        self.Dim, self.builder = Dim, Builder()
        # The stand-in only answers to names TensorRT 11.4 has; these fakes must keep to them too.
        assert {"is_constant", "get_constant_value", "constant", "operation"} <= trt.names

    def dim(self, value):
        return self.builder.constant(value) if isinstance(value, int) else self.Dim(lambda env: env[value])


def shapes(heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE):
    """The inputs' shapes as the paged lowering declares them: names for dynamic dimensions."""
    return [("tokens", heads, head_dim), ("tokens", kv_heads, head_dim), ("tokens", kv_heads, head_dim),
            ("blocks", kv_heads, block_size, head_dim), ("blocks", kv_heads, block_size, head_dim),
            ("seqs", "max_blocks"), ("seqs",), ("seqs_plus_1",)]


def plugin_types(trt, query="float16", pool=None, index="int32"):
    pool = pool or query
    return [getattr(trt, t) for t in (query, query, query, pool, pool, index, index, index)]


class PluginBuild:
    """One plugin node through the package's plugin object, call by call as TensorRT builds."""

    def __init__(self, trt, dtypes, dims, attrs, request="PREFER_AOT"):
        self.trt, self.symbolic, self.dtypes, self.dims = trt, Symbolic(trt), dtypes, dims
        creator = next(c for c, namespace in trt.registered if namespace == NAMESPACE)
        # The ONNX parser passes the node's attributes by the creator's field names, as
        # float32 / int32 arrays (onnx-tensorrt's loadFields).
        fields = [types.SimpleNamespace(name=f.name, data=np.array(
                      [attrs[f.name]], np.float32 if isinstance(attrs[f.name], float) else np.int32))
                  for f in creator.field_names]
        self.plugin = creator.create_plugin(NAME, NAMESPACE, fields, trt.TensorRTPhase.BUILD,
                                            getattr(trt.QuickPluginCreationRequest, request))

    def output_types(self):
        return self.plugin.get_output_data_types(self.dtypes, [len(d) for d in self.dims])

    def output_shapes(self):
        self.output_types()
        exprs = [[self.symbolic.dim(d) for d in dims] for dims in self.dims]
        return self.plugin.get_output_shapes(exprs, [], self.symbolic.builder)

    def descs(self, concrete, dtypes):
        trt = self.trt

        class PluginTensorDesc(trt.PluginTensorDesc):
            def __init__(self, dims, dtype):
                self.dims, self.type, self.format, self.scale = dims, dtype, trt.TensorFormat.LINEAR, 1.0

        class DynamicPluginTensorDesc(trt.DynamicPluginTensorDesc):
            def __init__(self, dims, dtype):
                self.desc = PluginTensorDesc(dims, dtype)

        return [DynamicPluginTensorDesc(dims, dtype) for dims, dtype in zip(concrete, dtypes)]

    def aot(self):
        """The kernel TensorRT would store: (name, ptx, launch, extra args) as the package hands
        them to the core."""
        output_types = self.output_types()
        self.output_shapes()
        # While building, dynamic dimensions are unknown (-1).
        concrete = [tuple(-1 if isinstance(d, str) else d for d in dims) for dims in self.dims]
        in_out = self.descs(concrete + [concrete[0]], self.dtypes + output_types)
        self.plugin.get_supported_format_combinations(in_out, len(self.dims))
        self.plugin.configure_plugin(in_out[:-1], in_out[-1:])
        assert self.plugin.get_valid_tactics() == []  # one kernel, no custom tactics
        self.plugin.set_tactic(0)
        launch, extra = types.SimpleNamespace(), {}

        class Setter:
            def __setitem__(self, index, value):
                extra[index] = value

        self.plugin.get_launch_params(None, in_out, len(self.dims), launch, Setter(), self.symbolic.builder)
        name, ptx = self.plugin.get_kernel([d.desc for d in in_out[:-1]], [in_out[-1].desc])
        return name, ptx, launch, [extra[i] for i in range(len(extra))]


COMPILE = """
import dataclasses, json, sys
from llmc.plugins import tensorrt_plugin
args, kwargs = json.loads(sys.argv[1])
cfg, kernel = tensorrt_plugin.aot_kernel(*args, **kwargs)
print(json.dumps([dataclasses.asdict(cfg), kernel]))
"""


@pytest.fixture
def compiles(monkeypatch):
    """aot_kernel runs in a fresh process without the interpreter; the calls are recorded."""
    from llmc.plugins.paged_attention_triton import KernelConfig

    calls = []
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}

    def aot_kernel(*args, **kwargs):
        calls.append(kwargs)
        done = subprocess.run([sys.executable, "-c", COMPILE, json.dumps([args, kwargs])], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        cfg, kernel = json.loads(done.stdout.splitlines()[-1])
        return KernelConfig(**cfg), kernel

    monkeypatch.setattr(tensorrt_plugin, "aot_kernel", aot_kernel)
    return calls


def entry_params(ptx: str, name: str) -> list[str]:
    entry = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\((.*?)\)", ptx, re.S)
    return [p.split()[1] for p in entry.group(1).split(",") if p.strip()]


@pytest.mark.parametrize("case", [
    # (query, pool, index types, build GPU, hardware compatible, expected .target, .version)
    ("float16", "float16", "int32", "9.0", False, "sm_90a", "8.0"),
    ("bfloat16", "float32", "int64", "9.0", True, "sm_80", "8.0"),   # --kv-cache-dtype float32
    ("float16", "bfloat16", "int64", "10.0", False, "sm_100a", "9.0"),
], ids=["fp16-H200", "bf16-fp32-pool-hardware-compatible", "fp16-bf16-pool-B200"])
def test_aot_kernel_as_tensorrt_builds_it(trt, compiles, monkeypatch, case):
    query, pool, index, gpu, hardware_compatible, target, version = case
    monkeypatch.setattr(tensorrt_plugin, "current_gpu", lambda: {"name": "GPU", "compute_capability": gpu})
    tensorrt_plugin.set_ptx_target(hardware_compatible=hardware_compatible)
    attrs = {"scale": 0.125, "window": 7, "softcap": 30.0}
    build = PluginBuild(trt, plugin_types(trt, query, pool, index), shapes(), attrs)
    name, ptx, launch, extra = build.aot()

    # The attributes reached the kernel in their own places (they arrive positionally).
    (call,) = compiles
    assert (call["scale"], call["window"], call["softcap"]) == (0.125, 7, 30.0)
    assert (call["num_heads"], call["num_kv_heads"], call["head_dim"], call["block_size"]) == \
        (HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE)

    # The PTX a driver of CUDA 12.0 (8.0) or 13.0 (9.0) loads, for the architecture asked for.
    text = ptx.decode()
    assert re.search(r"^\.version (\S+)$", text, re.M).group(1) == version
    assert re.search(r"^\.target (\S+)$", text, re.M).group(1) == target
    # TensorRT passes inputs, then the int32 scalars, then the output.
    params = entry_params(text, name)
    assert len(params) == 8 + len(tensorrt_plugin.EXTRA_ARG_NAMES) + 1
    assert params == [".u64"] * 8 + [".u32"] * len(tensorrt_plugin.EXTRA_ARG_NAMES) + [".u64"]

    # Grid and scalars, evaluated as TensorRT would at run time.
    block_q = 64 // 2  # 64 rows of tokens x grouped heads (2 heads per kv head)
    for env, seqs in (({"tokens": 37, "seqs": 3, "seqs_plus_1": 4, "max_blocks": 5, "blocks": 20}, 3),
                      ({"tokens": 5, "seqs": 5, "seqs_plus_1": 6, "max_blocks": 1, "blocks": 9}, 5),
                      # Shapes that disagree: the kernel sees the sequences every tensor has.
                      ({"tokens": 64, "seqs": 4, "seqs_plus_1": 3, "max_blocks": 2, "blocks": 7}, 2)):
        assert launch.grid_x.expr.evaluate(env) == env["tokens"] // block_q + seqs + 1
        assert launch.grid_y.expr.evaluate(env) == KV_HEADS
        assert [e.expr.evaluate(env) for e in extra] == [seqs, env["max_blocks"], env["tokens"], env["blocks"]]
    assert launch.grid_y.expr.is_constant() and launch.block_x.expr.is_constant()
    assert launch.block_x.expr.value in (128, 256)
    assert 0 < launch.shared_mem.expr.value <= tensorrt_plugin.SHARED_MEM_LIMIT
    assert not launch.grid_x.expr.is_constant()


def test_launch_params_with_ints_is_what_tensorrt_evaluates(trt, compiles, monkeypatch):
    """scripts/gpu_check.py launches with `launch_params` on ints: the same numbers."""
    monkeypatch.setattr(tensorrt_plugin, "current_gpu", lambda: {"name": "GPU", "compute_capability": "8.0"})
    name, ptx, launch, extra = PluginBuild(trt, plugin_types(trt), shapes(), {"scale": 0.125, "window": 0,
                                                                            "softcap": 0.0}).aot()
    from llmc.plugins.paged_attention_triton import kernel_config

    cfg = kernel_config(HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, 0.125, fp32=False)
    kernel = {"threads": launch.block_x.expr.value, "shared": launch.shared_mem.expr.value}
    env = {"tokens": 100, "seqs": 7, "seqs_plus_1": 8, "max_blocks": 3, "blocks": 11}
    concrete = [tuple(env.get(d, d) for d in dims) for dims in shapes()]
    plan = tensorrt_plugin.launch_params(cfg, kernel, concrete)
    assert plan.grid == (launch.grid_x.expr.evaluate(env), launch.grid_y.expr.evaluate(env))
    assert list(plan.extra_args) == [e.expr.evaluate(env) for e in extra]


def test_output_is_query_shaped_and_typed(trt):
    build = PluginBuild(trt, plugin_types(trt, "bfloat16"), shapes(), {"scale": 0.125, "window": 0, "softcap": 0.0})
    assert build.output_types() == [trt.bfloat16]
    (output,) = build.output_shapes()
    env = {"tokens": 13}
    assert [d.evaluate(env) for d in output] == [13, HEADS, HEAD_DIM]
    assert [d.is_constant() for d in output] == [False, True, True]


@pytest.mark.parametrize("types_, message", [
    (("float16", "float32", "float16", "float16", "float16", "int32", "int32", "int32"),
     "key is float32, query float16"),
    (("float16", "float16", "float16", "float16", "float32", "int32", "int32", "int32"),
     "the pools are float16 and float32"),
    (("float16", "float16", "float16", "float16", "float16", "int32", "float32", "int32"),
     "context_lens is float32, not int32 or int64"),
    (("int8",) * 5 + ("int32",) * 3, "query is .*(?i:int8).*; the kernel takes"),
])
def test_types_the_kernel_lacks_are_refused_while_building(trt, types_, message):
    build = PluginBuild(trt, [getattr(trt, t) for t in types_], shapes(), {"scale": 0.125, "window": 0, "softcap": 0.0})
    with pytest.raises(LlmcError, match=f"^{PLUGIN_ID}: {message}"):
        build.output_types()
    named = dict(zip(tensorrt_plugin.INPUT_NAMES, types_))
    assert re.match(message, tensorrt_plugin.input_types_problem(named))


def test_dynamic_heads_are_refused_naming_the_dimension(trt, compiles, monkeypatch):
    monkeypatch.setattr(tensorrt_plugin, "current_gpu", lambda: {"name": "GPU", "compute_capability": "9.0"})
    dims = shapes()
    dims[0] = ("tokens", "heads", HEAD_DIM)
    with pytest.raises(LlmcError, match="query's dimension 1 must be static"):
        PluginBuild(trt, plugin_types(trt), dims, {"scale": 0.125, "window": 0, "softcap": 0.0}).aot()
    dims = shapes()
    dims[3] = ("blocks", KV_HEADS, 32, HEAD_DIM)  # key_cache's block size is not value_cache's
    with pytest.raises(LlmcError, match=r"value_cache is \[\*, 2, 16, 64\], expected \[\*, 2, 32, 64\]"):
        PluginBuild(trt, plugin_types(trt), dims, {"scale": 0.125, "window": 0, "softcap": 0.0}).aot()
    assert not compiles  # refused before any compile


def batch(rng, index_dtype):
    """A prefill chunk, a decode and a fresh prompt over shuffled pool blocks (float32)."""
    from paged_cases import build_case

    inputs, _ = build_case(rng, [33, 20, 0], [5, 1, 7], HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE)
    return [np.ascontiguousarray(a) for a in inputs[:5]] + [a.astype(index_dtype) for a in inputs[5:]]


def enqueue(trt, dtype, pool_dtype, index_dtype):
    """The JIT plugin's enqueue on host buffers in the engine's types (bf16 as torch keeps it:
    NumPy has none): returns the output buffer and the reference on the same rounded inputs."""
    torch = pytest.importorskip("torch")
    host = batch(np.random.default_rng(0), index_dtype)
    tensors = [torch.from_numpy(a).to(getattr(torch, dtype if i < 3 else pool_dtype)) if i < 5 else torch.from_numpy(a)
               for i, a in enumerate(host)]
    want = paged_attention_reference(*(t.float().numpy() if t.is_floating_point() else t.numpy() for t in tensors),
                                     scale=0.125, window=0, softcap=0.0)
    output = torch.full_like(tensors[0], float("nan"))
    build = PluginBuild(trt, plugin_types(trt, dtype, pool_dtype, index_dtype), shapes(),
                        {"scale": 0.125, "window": 0, "softcap": 0.0}, request="PREFER_JIT")
    build.output_shapes()
    descs = build.descs([tuple(t.shape) for t in tensors + [output]], build.dtypes + [getattr(trt, dtype)])
    build.plugin.enqueue([d.desc for d in descs[:-1]], [descs[-1].desc], [t.data_ptr() for t in tensors],
                         [output.data_ptr()], [t.stride() for t in tensors], [output.stride()], 0)
    return output.float().numpy(), want


@pytest.mark.parametrize("dtype,pool_dtype,index_dtype,tolerance", [
    ("float32", "float32", "int64", 2e-5),
    ("float16", "float32", "int32", 4e-3),  # --kv-cache-dtype float32 under an fp16 model
])
def test_jit_impl_runs_the_kernel_through_enqueue(trt, dtype, pool_dtype, index_dtype, tolerance):
    """enqueue hands raw buffers and element strides to the impl function, which runs the kernel
    (Triton's interpreter here) into TensorRT's output buffer."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (host buffers)")
    got, want = enqueue(trt, dtype, pool_dtype, index_dtype)
    np.testing.assert_allclose(got, want, atol=tolerance, rtol=0)


def test_jit_impl_hands_bf16_buffers_to_the_kernel(trt, monkeypatch):
    """The package's Tensor refuses bf16 through __cuda_array_interface__; the impl describes the
    buffers itself. Triton 3.9's interpreter computes bf16 wrongly, so the kernel is replaced by
    the reference here (scripts/gpu_check.py runs bf16 on a GPU)."""
    torch = pytest.importorskip("torch")
    from llmc.plugins import paged_attention_triton

    seen = []

    def kernel(*inputs, scale, window, softcap, out):
        seen.append([t.dtype for t in inputs] + [out.dtype])
        host = [t.float().numpy() if t.is_floating_point() else t.numpy() for t in inputs]
        out.copy_(torch.from_numpy(paged_attention_reference(*host, scale=scale, window=window, softcap=softcap)))

    monkeypatch.setattr(paged_attention_triton, "paged_attention_triton", kernel)
    monkeypatch.setattr(paged_attention_triton, "interpreting", lambda: True)  # host buffers
    got, want = enqueue(trt, "bfloat16", "float16", "int64")
    assert seen == [[torch.bfloat16] * 3 + [torch.float16] * 2 + [torch.int64] * 3 + [torch.bfloat16]]
    np.testing.assert_allclose(got, want, atol=1e-2, rtol=0)  # the output rounded to bf16
