"""The paged-attention op as a TensorRT 11 plugin, ``llmc::paged_attention``.

Written against TensorRT's Python "quickly deployable plugin" API (``tensorrt.plugin``):

- ``@trtp.register`` declares the op: the eight input tensors of the contract in
  :mod:`llmc.plugins.paged_attention`, the float attribute ``scale``, the int attribute
  ``window`` (0: full attention) and the float attribute ``softcap`` (0: none), one output shaped
  and typed like ``query``.
- ``@trtp.aot_impl`` compiles :mod:`llmc.plugins.paged_attention_triton`'s kernel to PTX while the
  engine is built; TensorRT stores the PTX, launch grid and scalar arguments in the engine, so
  running the engine needs neither Python nor Triton. Attributes are not serialized on this path,
  so ``scale``, ``window``, ``softcap`` and the static dimensions are baked into the kernel as
  compile-time constants.
- ``@trtp.impl`` is the JIT fallback (Python + Triton at run time) for builds that ask for it.

TensorRT launches an AOT kernel with its inputs, then the extra int32 scalars, then its outputs;
the kernel's parameters are declared in that order. Triton (>= 3.3) appends two hidden scratch
pointers that TensorRT does not pass; the kernel uses no scratch, so they are removed from the
PTX entry (checked: an unused trailing parameter only).

Nothing here runs at ``import llmc``: :func:`register_plugin` imports tensorrt and triton and
registers the plugin once per process; call it before building or deserializing an engine.

Limits beyond the op's contract: heads, kv heads, head_dim and block_size must be static in the
network (they are compile-time constants of the kernel); the scale attribute must be written
explicitly (TensorRT plugin attributes take no defaults); block tables, context lengths and
query_start_loc are int32 or int64, and query/key/value/pools share fp16, bf16 or fp32.
"""

import functools
import re
from typing import Any, Tuple, Union

from llmc.errors import LlmcError
from llmc.plugins.paged_attention import PLUGIN_ID

# The contract's tensors in order; tests check them against the contract's docstring.
INPUT_NAMES = ("query", "key", "value", "key_cache", "value_cache", "block_tables",
               "context_lens", "query_start_loc")
OUTPUT_NAMES = ("output",)
ATTRIBUTE_NAMES = ("scale", "window", "softcap")
# Scalars TensorRT passes between the input and output pointers (see the Triton kernel).
EXTRA_ARG_NAMES = ("num_seqs", "max_blocks_per_seq")
FLOAT_TYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
INDEX_TYPES = {"int32": "i32", "int64": "i64"}
# Dynamic shared memory a kernel may use without cuFuncSetAttribute, which TensorRT's AOT
# launch is not documented to call.
SHARED_MEM_LIMIT = 48 * 1024


def triton_signature(float_type: str, index_types: dict[str, str]) -> dict[str, str]:
    """The kernel's runtime signature for ``triton.compiler.ASTSource``.

    Args:
        float_type: "fp16", "bf16" or "fp32" — query, key, value, pools and output.
        index_types: "i32" or "i64" for each of block_tables, context_lens, query_start_loc.
    """
    signature = {name: f"*{float_type}" for name in INPUT_NAMES[:5]}
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


def compile_kernel(cfg: Any, signature: dict[str, str], target: Any = None) -> dict[str, Any]:
    """Compile the Triton kernel to PTX for TensorRT: name, ptx, shared memory, threads.

    Args:
        cfg: a ``paged_attention_triton.KernelConfig``.
        signature: from :func:`triton_signature`.
        target: a ``triton.backends.compiler.GPUTarget``; None means the current GPU.
    """
    import triton

    from llmc.plugins.paged_attention_triton import jit_kernel

    constexprs = cfg.constexprs()
    source = triton.compiler.ASTSource(fn=jit_kernel(interpret=False),
                                       signature={**signature, **dict.fromkeys(constexprs, "constexpr")},
                                       constexprs=constexprs)
    last_shared = 0
    for num_stages in (2, 1) if cfg.fp32 else (2,):
        options = {"num_warps": cfg.num_warps, "num_stages": num_stages}
        compiled = (triton.compile(source, options=options) if target is None
                    else triton.compile(source, target=target, options=options))
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


def aot_kernel(float_type: str, index_types: dict[str, str], num_heads: int, num_kv_heads: int,
               head_dim: int, block_size: int, scale: float, target: Any = None, window: int = 0,
               softcap: float = 0.0):
    """Choose tiles that fit shared memory and compile; returns (KernelConfig, compiled dict).

    Args: the op's static dimensions and dtypes; target as in :func:`compile_kernel`.
    """
    from llmc.plugins.paged_attention_triton import kernel_config

    signature = triton_signature(float_type, index_types)
    errors = []
    # fp16/bf16 fit the first; fp32 with head_dim 128 needs the smaller K/V tiles.
    for max_rows, block_n in ((64, 64), (32, 32), (16, 16)):
        cfg = kernel_config(num_heads, num_kv_heads, head_dim, block_size, scale,
                            fp32=float_type == "fp32", max_rows=max_rows, block_n=block_n, window=window,
                            softcap=softcap)
        try:
            return cfg, compile_kernel(cfg, signature, target)
        except LlmcError as exc:  # too much shared memory: try a smaller tile
            errors.append(f"{max_rows}x{block_n}: {exc}")
    raise LlmcError(f"{PLUGIN_ID}: no tile size fits: {'; '.join(errors)}")


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

    float_types = {trt.float16: "fp16", trt.bfloat16: "bf16", trt.float32: "fp32"}
    index_types = {trt.int32: "i32", trt.int64: "i64"}

    def static_dim(desc: Any, axis: int, what: str) -> int:
        dim = desc.shape_expr[axis]
        if not dim.is_constant:
            raise LlmcError(f"{PLUGIN_ID}: {what} must be static in the network")
        return int(dim.constant_value)

    @trtp.register(PLUGIN_ID)
    def paged_attention_desc(query: trtp.TensorDesc, key: trtp.TensorDesc,
                             value: trtp.TensorDesc, key_cache: trtp.TensorDesc,
                             value_cache: trtp.TensorDesc, block_tables: trtp.TensorDesc,
                             context_lens: trtp.TensorDesc, query_start_loc: trtp.TensorDesc,
                             scale: float, window: int, softcap: float) -> trtp.TensorDesc:
        for name, desc in (("key", key), ("value", value), ("key_cache", key_cache),
                           ("value_cache", value_cache)):
            if desc.dtype != query.dtype:
                raise LlmcError(f"{PLUGIN_ID}: {name} is {desc.dtype}, query is {query.dtype}")
        if query.dtype not in float_types:
            raise LlmcError(f"{PLUGIN_ID}: query type {query.dtype} is not fp16, bf16 or fp32")
        for name, desc in (("block_tables", block_tables), ("context_lens", context_lens),
                           ("query_start_loc", query_start_loc)):
            if desc.dtype not in index_types:
                raise LlmcError(f"{PLUGIN_ID}: {name} is {desc.dtype}, not int32 or int64")
        return query.like()

    @trtp.aot_impl(PLUGIN_ID)
    def paged_attention_aot(
        query: trtp.TensorDesc, key: trtp.TensorDesc, value: trtp.TensorDesc,
        key_cache: trtp.TensorDesc, value_cache: trtp.TensorDesc, block_tables: trtp.TensorDesc,
        context_lens: trtp.TensorDesc, query_start_loc: trtp.TensorDesc, scale: float, window: int,
        softcap: float, outputs: Tuple[trtp.TensorDesc], tactic: int,
    ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymIntExprs]:
        cfg, kernel = aot_kernel(
            float_types[query.dtype],
            {"block_tables": index_types[block_tables.dtype],
             "context_lens": index_types[context_lens.dtype],
             "query_start_loc": index_types[query_start_loc.dtype]},
            num_heads=static_dim(query, 1, "num_heads"),
            num_kv_heads=static_dim(key, 1, "num_kv_heads"),
            head_dim=static_dim(query, 2, "head_dim"),
            block_size=static_dim(key_cache, 2, "block_size"),
            scale=scale, window=window, softcap=softcap)
        tokens = query.shape_expr[0]
        num_seqs = context_lens.shape_expr[0]
        launch = trtp.KernelLaunchParams()
        # Ragged batch: an upper bound on query tiles; the kernel's surplus programs exit.
        launch.grid_x = trtp.SymInt32(tokens // cfg.block_q + num_seqs)
        launch.grid_y = cfg.num_kv_heads
        launch.block_x = kernel["threads"]
        launch.shared_mem = kernel["shared"]
        extra_args = trtp.SymIntExprs(len(EXTRA_ARG_NAMES))
        extra_args[0] = trtp.SymInt32(num_seqs)
        extra_args[1] = trtp.SymInt32(block_tables.shape_expr[1])
        return kernel["name"], kernel["ptx"], launch, extra_args

    @trtp.impl(PLUGIN_ID)
    def paged_attention_impl(
        query: trtp.Tensor, key: trtp.Tensor, value: trtp.Tensor, key_cache: trtp.Tensor,
        value_cache: trtp.Tensor, block_tables: trtp.Tensor, context_lens: trtp.Tensor,
        query_start_loc: trtp.Tensor, scale: float, window: int, softcap: float,
        outputs: Tuple[trtp.Tensor], stream: int,
    ) -> None:
        import torch

        from llmc.plugins.paged_attention_triton import paged_attention_triton

        tensors = [torch.as_tensor(t, device="cuda") for t in (
            query, key, value, key_cache, value_cache, block_tables, context_lens, query_start_loc)]
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            result = paged_attention_triton(*tensors, scale=scale, window=window, softcap=softcap)
            torch.as_tensor(outputs[0], device="cuda").copy_(result)
