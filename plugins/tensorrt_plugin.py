"""The paged-attention op as a TensorRT 11 plugin, ``llmc::paged_attention``.

Written against TensorRT 11.4's Python "quickly deployable plugin" API (``tensorrt.plugin``, the
pure-Python package of the bindings wheel, which the tests run with a stand-in for the compiled
core):

- ``@trtp.register`` declares the op: the eight input tensors of the contract in
  :mod:`llmc.plugins.paged_attention`, the float attribute ``scale``, the int attribute
  ``window`` (0: full attention) and the float attribute ``softcap`` (0: none), one output shaped
  and typed like ``query``. TensorRT calls it for the output type with placeholder ("fake")
  shapes, then for the output shape with symbolic ones; it reads only types (`input_types_problem`).
- ``@trtp.aot_impl`` compiles :mod:`llmc.plugins.paged_attention_triton`'s kernel to PTX while the
  engine is built; TensorRT stores the PTX, launch grid and scalar arguments in the engine, so
  running the engine needs neither Python nor Triton. Attributes are not serialized on this path,
  so ``scale``, ``window``, ``softcap`` and the static dimensions are baked into the kernel as
  compile-time constants. Dimensions arrive as ``ShapeExpr``: ``is_constant`` is a property and
  ``constant_value()`` a method (plugin/_tensor.py); attributes arrive positionally in the
  creator's field order, which is the register function's: the ONNX parser passes a plugin node's
  attributes by the creator's field names (onnx-tensorrt, ``loadFields`` in onnxOpImporters.cpp),
  whatever their order on the node.
- ``@trtp.impl`` is the JIT fallback (Python + Triton at run time) for builds that ask for it.
  TensorRT hands it raw buffers; ``Tensor.__cuda_array_interface__`` refuses bf16, so the buffers
  are described to torch here.

Types: query, key and value share fp16, bf16 or fp32; the two pools share one of those, possibly
another (``--kv-cache-dtype``): the kernel casts what it reads from the pool to the query's type,
as the reference reads any pool type. Block tables, context lengths and query_start_loc are int32
or int64, each on its own.

Launch: TensorRT launches an AOT kernel with its inputs, then the extra int32 scalars
(`EXTRA_ARG_NAMES`), then its outputs; the kernel's parameters are declared in that order. Triton
(>= 3.3) appends hidden scratch pointers that TensorRT does not pass; the kernel uses no scratch,
so they are removed from the PTX entry (checked: unused trailing parameters only). Grid and
scalars are expressions of the input dimensions (`launch_params`: TensorRT's symbolic ones while
building, ints in scripts/gpu_check.py), taken as the smallest of the dimensions that must agree,
so that inconsistent shapes keep the kernel inside every tensor (it also clamps metadata values:
TensorRT times plugins on made-up inputs).

PTX ``.target``: the build GPU's architecture (Triton writes ``sm_90a`` on Hopper: that
architecture only, like a TensorRT engine built without hardware compatibility), or ``sm_80``
after ``set_ptx_target(hardware_compatible=True)``: the driver compiles sm_80 PTX for every GPU
from Ampere on, which is what TensorRT's AMPERE_PLUS engines promise.

PTX ``.version``: Triton writes the ISA of the ptxas it bundles (Triton 3.9: 9.4 = CUDA 13.4 for
sm_90 and newer, 8.8 = CUDA 12.9 below), and a driver of an older CUDA refuses to load it
(CUDA_ERROR_UNSUPPORTED_PTX_VERSION). The kernel is compiled for the lowest ISA that holds its
target instead (`ptx_version`): 8.0 (CUDA 12.0, the first with sm_90a) up to Hopper, 9.0
(CUDA 13.0, the oldest CUDA that TensorRT 11.4's CUDA 13 build runs on, and one that knows every
Blackwell target) from sm_100 on. Triton's passes and LLVM generate for that ISA, and ptxas,
which assembles the kernel during the build, refuses any instruction the ISA lacks.

Nothing here runs at ``import llmc``: :func:`register_plugin` imports tensorrt and triton and
registers the plugin once per process; call it before building or deserializing an engine.

Limits beyond the op's contract: heads, kv heads, head_dim and block_size must be static in the
network (they are compile-time constants of the kernel); the scale attribute must be written
explicitly (TensorRT plugin attributes take no defaults).
"""

import functools
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, Tuple, Union

from llmc.errors import LlmcError
from llmc.plugins.cuda_device import current_gpu
from llmc.plugins.paged_attention import PLUGIN_ID

# The contract's tensors in order; tests check them against the contract's docstring.
INPUT_NAMES = ("query", "key", "value", "key_cache", "value_cache", "block_tables",
               "context_lens", "query_start_loc")
OUTPUT_NAMES = ("output",)
ATTRIBUTE_NAMES = ("scale", "window", "softcap")
# Scalars TensorRT passes between the input and output pointers (see the Triton kernel).
EXTRA_ARG_NAMES = ("num_seqs", "max_blocks_per_seq", "num_tokens", "num_blocks")
# Element types by name (as numpy and ONNX spell them) and the kernel signature's spelling.
FLOAT_TYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
INDEX_TYPES = {"int32": "i32", "int64": "i64"}
# Dynamic shared memory a kernel may use without cuFuncSetAttribute, which TensorRT's AOT
# launch is not documented to call.
SHARED_MEM_LIMIT = 48 * 1024
# The PTX target of engines built for every GPU from Ampere on (TensorRT's AMPERE_PLUS).
HARDWARE_COMPATIBLE_CAPABILITY = 80

# The compute capability the AOT kernel targets in this process's builds; None: the build GPU's.
_ptx_capability: int | None = None


def set_ptx_target(hardware_compatible: bool) -> None:
    """Choose the architecture of the PTX that builds in this process put in their engines.

    Args:
        hardware_compatible: sm_80, which every GPU from Ampere on runs (an engine built with
            TensorRT's AMPERE_PLUS); False: the build GPU's own architecture.
    """
    global _ptx_capability
    _ptx_capability = HARDWARE_COMPATIBLE_CAPABILITY if hardware_compatible else None


def ptx_capability() -> int:
    """The compute capability (90 for 9.0) the AOT kernel is compiled for now."""
    if _ptx_capability is not None:
        return _ptx_capability
    major, minor = current_gpu()["compute_capability"].split(".")
    return int(major) * 10 + int(minor)


def ptx_version(capability: int) -> int:
    """The PTX ISA the kernel is written in for a target, as Triton spells it (80 for 8.0): see
    the module docstring."""
    return 80 if capability < 100 else 90


def input_types_problem(types: Mapping[str, str]) -> str | None:
    """Why the plugin refuses these input element types, or None: the rule its register function
    applies while TensorRT builds, for a dry run to apply before.

    Args:
        types: each of INPUT_NAMES' element type, by name ("float16", "int64", ...).
    """
    query = types["query"]
    if query not in FLOAT_TYPES:
        return f"query is {query}; the kernel takes {', '.join(FLOAT_TYPES)}"
    for name in ("key", "value"):
        if types[name] != query:
            return f"{name} is {types[name]}, query {query}; query, key and value share one type"
    pool = types["key_cache"]
    if pool not in FLOAT_TYPES or types["value_cache"] != pool:
        return (f"the pools are {pool} and {types['value_cache']}; they share one of "
                f"{', '.join(FLOAT_TYPES)}")
    for name in INPUT_NAMES[5:]:
        if types[name] not in INDEX_TYPES:
            return f"{name} is {types[name]}, not int32 or int64"
    return None


def triton_signature(float_type: str, pool_type: str, index_types: Mapping[str, str]) -> dict[str, str]:
    """The kernel's runtime signature for ``triton.compiler.ASTSource``.

    Args:
        float_type: "fp16", "bf16" or "fp32" — query, key, value and output.
        pool_type: the same choice for key_cache and value_cache.
        index_types: "i32" or "i64" for each of block_tables, context_lens, query_start_loc.
    """
    signature = {name: f"*{float_type}" for name in INPUT_NAMES[:3]}
    signature.update({name: f"*{pool_type}" for name in INPUT_NAMES[3:5]})
    signature.update({name: f"*{index_types[name]}" for name in INPUT_NAMES[5:]})
    signature.update({name: "i32" for name in EXTRA_ARG_NAMES})
    signature.update({name: f"*{float_type}" for name in OUTPUT_NAMES})
    return signature


def strip_unused_trailing_params(ptx: str, kernel_name: str, keep: int) -> str:
    """Drop PTX entry parameters past the first ``keep`` if the kernel body never reads them.

    Args:
        ptx: PTX text with one ``.entry kernel_name``.
        kernel_name: the entry's name.
        keep: how many parameters the launcher passes.
    """
    match = re.search(r"(\.entry\s+" + re.escape(kernel_name) + r"\s*\()(.*?)(\))", ptx, re.S)
    if match is None:
        raise LlmcError(f"tensorrt_plugin: no .entry {kernel_name} in the compiled PTX")
    params = [p.strip() for p in match.group(2).split(",") if p.strip()]
    if len(params) < keep:
        raise LlmcError(f"tensorrt_plugin: kernel {kernel_name} declares {len(params)} "
                        f"parameters, TensorRT passes {keep}")
    body = ptx[match.end():]
    for param in params[keep:]:
        name = param.split()[-1]
        if re.search(r"\b" + re.escape(name) + r"\b", body):
            raise LlmcError(f"tensorrt_plugin: kernel {kernel_name} reads its hidden parameter "
                            f"{name}, which TensorRT's AOT launch does not pass")
    kept = ",\n\t".join(params[:keep])
    return ptx[:match.start(2)] + "\n\t" + kept + "\n" + ptx[match.end(2):]


def compile_kernel(cfg: Any, signature: dict[str, str], capability: int) -> dict[str, Any]:
    """Compile the Triton kernel to PTX for TensorRT: name, ptx, shared memory, threads.

    Runs in a process whose triton was imported without TRITON_INTERPRET (the interpreter
    replaces triton's own jit functions, which the kernel calls).

    Args:
        cfg: a ``paged_attention_triton.KernelConfig``.
        signature: from :func:`triton_signature`.
        capability: the target's compute capability (90 for 9.0).
    """
    import triton
    from triton.backends.compiler import GPUTarget

    from llmc.plugins.paged_attention_triton import jit_kernel

    constexprs = cfg.constexprs()
    source = triton.compiler.ASTSource(fn=jit_kernel(interpret=False),
                                       signature={**signature, **dict.fromkeys(constexprs, "constexpr")},
                                       constexprs=constexprs)
    target = GPUTarget("cuda", capability, 32)
    last_shared = 0
    for num_stages in (2, 1) if cfg.fp32 else (2,):
        options = {"num_warps": cfg.num_warps, "num_stages": num_stages,
                   "ptx_version": ptx_version(capability)}
        compiled = triton.compile(source, target=target, options=options)
        meta = compiled.metadata
        if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
            raise LlmcError("tensorrt_plugin: the compiled kernel needs Triton scratch memory, "
                            "which TensorRT's AOT launch cannot provide")
        last_shared = meta.shared
        if meta.shared <= SHARED_MEM_LIMIT:
            ptx = strip_unused_trailing_params(compiled.asm["ptx"], meta.name, len(signature))
            return {"name": meta.name, "ptx": ptx, "shared": meta.shared,
                    "threads": meta.num_warps * 32}
    raise LlmcError(f"tensorrt_plugin: kernel needs {last_shared} bytes of shared memory "
                    f"(limit {SHARED_MEM_LIMIT})")


def aot_kernel(float_type: str, pool_type: str, index_types: Mapping[str, str], num_heads: int,
               num_kv_heads: int, head_dim: int, block_size: int, scale: float, capability: int,
               window: int = 0, softcap: float = 0.0):
    """Choose tiles that fit shared memory and compile; returns (KernelConfig, compiled dict).

    Args: the op's static dimensions and types (as in :func:`triton_signature`); capability as
    in :func:`compile_kernel`.
    """
    from llmc.plugins.paged_attention_triton import kernel_config

    signature = triton_signature(float_type, pool_type, index_types)
    errors = []
    # fp16/bf16 fit the first; fp32 with head_dim 128 needs the smaller K/V tiles.
    for max_rows, block_n in ((64, 64), (32, 32), (16, 16)):
        cfg = kernel_config(num_heads, num_kv_heads, head_dim, block_size, scale,
                            fp32=float_type == "fp32", max_rows=max_rows, block_n=block_n, window=window,
                            softcap=softcap)
        try:
            return cfg, compile_kernel(cfg, signature, capability)
        except LlmcError as exc:  # too much shared memory: try a smaller tile
            errors.append(f"{max_rows}x{block_n}: {exc}")
    raise LlmcError(f"{PLUGIN_ID}: no tile size fits: {'; '.join(errors)}")


def static_dims(shapes: Sequence[Sequence[Any]]) -> tuple[int, int, int, int]:
    """(heads, kv heads, head_dim, block_size) from TensorRT's symbolic shapes of the first five
    inputs; LlmcError unless each is a build-time constant and the tensors agree."""
    def constant(name: str, axis: int) -> int:
        dim = shapes[INPUT_NAMES.index(name)][axis]
        if not dim.is_constant:
            raise LlmcError(f"{PLUGIN_ID}: {name}'s dimension {axis} must be static in the network")
        return dim.constant_value()

    ranks = {"query": 3, "key": 3, "value": 3, "key_cache": 4, "value_cache": 4}
    for name, rank in ranks.items():
        if len(shapes[INPUT_NAMES.index(name)]) != rank:
            raise LlmcError(f"{PLUGIN_ID}: {name} has rank {len(shapes[INPUT_NAMES.index(name)])}, "
                            f"the op takes {rank}")
    heads, head_dim = constant("query", 1), constant("query", 2)
    kv_heads, block_size = constant("key", 1), constant("key_cache", 2)
    for name in INPUT_NAMES[1:5]:
        want = (kv_heads, head_dim) if ranks[name] == 3 else (kv_heads, block_size, head_dim)
        got = tuple(constant(name, axis) for axis in range(1, ranks[name]))
        if got != want:
            raise LlmcError(f"{PLUGIN_ID}: {name} is [*, {', '.join(map(str, got))}], "
                            f"expected [*, {', '.join(map(str, want))}]")
    return heads, kv_heads, head_dim, block_size


@dataclass(frozen=True)
class Launch:
    """One launch of the AOT kernel: ints, or TensorRT's symbolic expressions while building."""

    grid: tuple[Any, Any]        # programs along x (query tiles) and y (kv heads)
    block_x: int                 # threads
    shared_mem: int              # dynamic shared memory, bytes
    extra_args: tuple[Any, ...]  # EXTRA_ARG_NAMES' values, int32


def launch_params(cfg: Any, kernel: Mapping[str, Any], shapes: Sequence[Sequence[Any]],
                  minimum: Callable = min, maximum: Callable = max) -> Launch:
    """The launch TensorRT makes for inputs of these shapes.

    Args:
        cfg, kernel: from :func:`aot_kernel`.
        shapes: the eight inputs' shapes in INPUT_NAMES order.
        minimum, maximum: min and max of two dimensions (``trtp.min`` / ``trtp.max`` for
            TensorRT's symbolic ones).
    """
    query, key, value, key_cache, value_cache, block_tables, context_lens, query_start_loc = shapes
    tokens = minimum(minimum(query[0], key[0]), value[0])
    seqs = maximum(minimum(minimum(context_lens[0], block_tables[0]), query_start_loc[0] - 1), 0)
    blocks = minimum(key_cache[0], value_cache[0])
    return Launch(grid=(cfg.num_programs(tokens, seqs), cfg.num_kv_heads), block_x=kernel["threads"],
                  shared_mem=kernel["shared"], extra_args=(seqs, block_tables[1], tokens, blocks))


class _Buffer:
    """A buffer TensorRT owns, described for torch (device memory) or NumPy (host memory, under
    Triton's interpreter) without a copy."""

    def __init__(self, tensor: Any, typestr: str, device: str):
        itemsize = int(typestr[2:])
        interface = {"shape": tuple(int(d) for d in tensor.shape), "typestr": typestr, "version": 3,
                     "data": (int(tensor.data_ptr), False),
                     "strides": tuple(int(s) * itemsize for s in tensor.strides)}
        if device == "cuda":
            self.__cuda_array_interface__ = interface
        else:
            self.__array_interface__ = interface


@functools.lru_cache(maxsize=None)
def register_plugin() -> None:
    """Register ``llmc::paged_attention`` with TensorRT (once per process).

    Raises LlmcError when tensorrt (>= 10.12, for aot_impl) or triton is missing.
    """
    try:
        import tensorrt as trt
        import tensorrt.plugin as trtp
    except ImportError as exc:
        raise LlmcError(f"the TensorRT plugin needs tensorrt: pip install 'llmc[tensorrt]' "
                        f"({exc})") from exc
    if not hasattr(trtp, "aot_impl"):
        raise LlmcError(f"tensorrt {trt.__version__} has no tensorrt.plugin.aot_impl; "
                        f"llmc needs TensorRT 11")
    from llmc.plugins.paged_attention_triton import require_triton
    require_triton()

    type_names = {trt.float16: "float16", trt.bfloat16: "bfloat16", trt.float32: "float32",
                  trt.int32: "int32", trt.int64: "int64"}

    def kernel_types(descs: Sequence[Any]) -> dict[str, str]:
        return {name: type_names.get(desc.dtype, str(desc.dtype)) for name, desc in zip(INPUT_NAMES, descs)}

    @trtp.register(PLUGIN_ID)
    def paged_attention_desc(query: trtp.TensorDesc, key: trtp.TensorDesc,
                             value: trtp.TensorDesc, key_cache: trtp.TensorDesc,
                             value_cache: trtp.TensorDesc, block_tables: trtp.TensorDesc,
                             context_lens: trtp.TensorDesc, query_start_loc: trtp.TensorDesc,
                             scale: float, window: int, softcap: float) -> trtp.TensorDesc:
        problem = input_types_problem(kernel_types((query, key, value, key_cache, value_cache, block_tables,
                                                    context_lens, query_start_loc)))
        if problem:
            raise LlmcError(f"{PLUGIN_ID}: {problem}")
        return query.like()

    @trtp.aot_impl(PLUGIN_ID)
    def paged_attention_aot(
        query: trtp.TensorDesc, key: trtp.TensorDesc, value: trtp.TensorDesc,
        key_cache: trtp.TensorDesc, value_cache: trtp.TensorDesc, block_tables: trtp.TensorDesc,
        context_lens: trtp.TensorDesc, query_start_loc: trtp.TensorDesc, scale: float, window: int,
        softcap: float, outputs: Tuple[trtp.TensorDesc], tactic: int,
    ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymIntExprs]:
        inputs = (query, key, value, key_cache, value_cache, block_tables, context_lens, query_start_loc)
        shapes = [desc.shape_expr for desc in inputs]
        num_heads, num_kv_heads, head_dim, block_size = static_dims(shapes)
        types = kernel_types(inputs)
        cfg, kernel = aot_kernel(
            FLOAT_TYPES[types["query"]], FLOAT_TYPES[types["key_cache"]],
            {name: INDEX_TYPES[types[name]] for name in INPUT_NAMES[5:]},
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
            scale=scale, capability=ptx_capability(), window=window, softcap=softcap)
        plan = launch_params(cfg, kernel, shapes, minimum=trtp.min, maximum=trtp.max)
        launch = trtp.KernelLaunchParams()
        launch.grid_x, launch.grid_y = plan.grid
        launch.block_x = plan.block_x
        launch.shared_mem = plan.shared_mem
        extra_args = trtp.SymIntExprs(len(EXTRA_ARG_NAMES))
        for i, arg in enumerate(plan.extra_args):
            extra_args[i] = trtp.SymInt32(arg)
        return kernel["name"], kernel["ptx"], launch, extra_args

    @trtp.impl(PLUGIN_ID)
    def paged_attention_impl(
        query: trtp.Tensor, key: trtp.Tensor, value: trtp.Tensor, key_cache: trtp.Tensor,
        value_cache: trtp.Tensor, block_tables: trtp.Tensor, context_lens: trtp.Tensor,
        query_start_loc: trtp.Tensor, scale: float, window: int, softcap: float,
        outputs: Tuple[trtp.Tensor], stream: int,
    ) -> None:
        import contextlib

        import numpy as np
        import torch

        from llmc.plugins.paged_attention_triton import interpreting, paged_attention_triton

        # bf16 travels as int16 (neither interface has a bf16 type string) and is viewed back.
        layouts = {trt.float16: ("<f2", torch.float16), trt.bfloat16: ("<i2", torch.bfloat16),
                   trt.float32: ("<f4", torch.float32), trt.int32: ("<i4", torch.int32),
                   trt.int64: ("<i8", torch.int64)}
        device = "cpu" if interpreting() else "cuda"

        def as_torch(tensor: Any) -> Any:
            typestr, dtype = layouts[tensor.dtype]
            buffer = _Buffer(tensor, typestr, device)
            view = (torch.as_tensor(buffer, device="cuda") if device == "cuda"
                    else torch.from_numpy(np.asarray(buffer)))
            return view.view(dtype)

        inputs = [as_torch(t) for t in (query, key, value, key_cache, value_cache, block_tables,
                                        context_lens, query_start_loc)]
        on_stream = (torch.cuda.stream(torch.cuda.ExternalStream(stream)) if device == "cuda"
                     else contextlib.nullcontext())
        with on_stream:
            paged_attention_triton(*inputs, scale=scale, window=window, softcap=softcap,
                                   out=as_torch(outputs[0]))
