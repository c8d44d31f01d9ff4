"""Sizing and building the paged form of an engine: block size, pool size, the lowering.

`llmc compile` builds paged engines by default: the KV cache lives in one pool of fixed-size
blocks (plugins/paged_attention.py) sized here from --kv-pool-mb, or from --max-batch requests of
--max-seq-len tokens.

What the manifest records is a ceiling, not an allocation. The machine that runs an engine is
not the one that built it, so the memory budget is applied at load
(runtime/kv_cache.py, `pool_blocks`): a pool sized with --kv-pool-mb is kept as
asked; the default (room for min(max batch, `POOL_SEQUENCES`) sequences of max_seq_len tokens,
the most the engine can use well) is capped at half the memory available when the engine
loads; `Engine(..., kv_pool_mb=...)` overrides both. The runtime maps the pool's pages on first
write, so a large ceiling costs no start-up time and no resident memory until requests use it
(SmolLM2-135M's default is 5.76 GB of float32 blocks at 8,192 positions).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import onnx

from llmc.formats.decoder_interface import DecoderInterface
from llmc.formats.manifest import blocks_in, kv_block_bytes
from llmc.errors import LlmcError
from llmc.passes.fuse_skip_norm import FuseSkipNorm
from llmc.passes.lower_paged_attention import LowerPagedAttention, to_3d_attention
from llmc.passes.lower_single_sequence import LowerSingleSequence
from llmc.plugins.paged_attention import BLOCK_SIZES


POOL_SEQUENCES = 16  # full-length sequences the default pool holds
# --kv-cache-dtype's names and the pool element types they stand for (auto: the model's).
KV_DTYPES = {"auto": None, "fp16": "float16", "fp32": "float32"}


@dataclass(frozen=True)
class PagedOptions:
    """What the user asked for; validated when the model's geometry is known.

    Args:
        block_size: tokens per block, a power of two from 1 to 256; None: the backend's (16, or
            OpenVINO's 32).
        max_batch: sequences one step may hold (the Engine's seats).
        max_seq_len: longest sequence (prompt + output); default the model's positions.
        kv_pool_mb: pool size in MiB; default room for `POOL_SEQUENCES` (or max_batch, if fewer)
            sequences of max_seq_len. Seats are cheap and blocks are not: most sequences are far
            shorter than max_seq_len, so more of them share the pool, and the scheduler preempts
            when it runs out.
        kv_dtype: the pool's element type, "float16" or "float32"; None keeps the model's. A
            float16 pool of a float32 model holds twice the tokens and halves what decode
            attention reads; keys and values are rounded to float16 when stored, and attention
            reads them back rounded in every step, the one that made them included.
    """

    block_size: int | None = None
    # Measured (bench/serving_bench.py): 64 seats served its 64-request workload 15-20% faster
    # than 16, in the same pool.
    max_batch: int = 64
    max_seq_len: int | None = None
    kv_pool_mb: float | None = None
    kv_dtype: str | None = None

    def __post_init__(self):
        if self.block_size is not None and self.block_size not in BLOCK_SIZES:
            raise LlmcError(f"--block-size: {self.block_size} is not supported (powers of two from 1 to 256)")
        if self.max_batch < 1:
            raise LlmcError(f"--max-batch: must be ≥ 1, got {self.max_batch}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise LlmcError(f"--max-seq-len: must be ≥ 2, got {self.max_seq_len}")
        if self.kv_pool_mb is not None and not 0 < self.kv_pool_mb < math.inf:
            raise LlmcError(f"--kv-pool-mb: must be a size > 0, got {self.kv_pool_mb}")
        if self.kv_dtype not in KV_DTYPES.values():
            names = ", ".join(KV_DTYPES)
            raise LlmcError(f"--kv-cache-dtype: '{self.kv_dtype}' is not one of {names}")


def plan_pool(options: PagedOptions, interface: DecoderInterface) -> dict:
    """The manifest's "paged" entry: block size, pool blocks, limits."""
    g = interface.geometry
    max_seq_len = options.max_seq_len or g.max_positions
    if max_seq_len > g.max_positions:
        raise LlmcError(f"--max-seq-len: {max_seq_len} exceeds the model's {g.max_positions} positions")
    kv_dtype = options.kv_dtype or interface.dtype
    block_bytes = kv_block_bytes(g, options.block_size, kv_dtype)
    if options.kv_pool_mb is None:
        num_blocks = min(options.max_batch, POOL_SEQUENCES) * -(-max_seq_len // options.block_size)
    else:
        num_blocks = blocks_in(options.kv_pool_mb, block_bytes, options.block_size, max_seq_len, "--kv-pool-mb")
    return {**asdict(options), "kv_dtype": kv_dtype, "max_seq_len": max_seq_len, "num_blocks": num_blocks,
            "pool_mb": round(num_blocks * block_bytes / 2**20, 3), "window": reusable_window(interface.windows)}


def reusable_window(windows: tuple[int, ...]) -> int | None:
    """Positions any layer still reads behind a sequence's next token, when every layer has a
    window (the block manager frees blocks wholly behind it); None when some layer attends to the
    whole past (Gemma-2/3's global layers, every Llama layer): then no block can ever be freed."""
    return max(windows) if windows and all(windows) else None


def lower(model: onnx.ModelProto, interface: DecoderInterface, options: PagedOptions,
          single_sequence: bool = False, pad_lone_token: bool = False) -> tuple[str | None, onnx.ModelProto | None]:
    """Lower the optimized graph to the paged interface. Returns why not, when it can't be (else
    None), and with `single_sequence` the graph for steps of one sequence
    (passes/lower_single_sequence.py, `pad_lone_token` passed on), or None when the engine
    cannot have one (see `single_sequence_graph`)."""
    computed = any("position_ids" in n.output for n in model.graph.node)  # canonicalize-gqa's, from the mask
    if not interface.has_position_ids and not computed:
        return "the graph has no position_ids input", None
    # Both lowerings read 3-D attention; the query heads come from the interface where the graph
    # does not carry them (a file with a config.json beside it and no llmc metadata).
    to_3d_attention(model, interface.geometry.num_heads)
    single = single_sequence_graph(model, interface, options, pad_lone_token) if single_sequence else None
    LowerPagedAttention(options.block_size, options.kv_dtype, interface.windows,
                        interface.geometry.num_heads).run(model)
    return None, single


def single_sequence_graph(model: onnx.ModelProto, interface: DecoderInterface, options: PagedOptions,
                          pad_lone_token: bool = False) -> onnx.ModelProto | None:
    """A copy of the optimized graph lowered for one sequence at a time, or None where its buffer
    could not mirror the pool: a pool in another type than the model's float32 (the paged path
    rounds keys and values to it), or windows on every layer (the block manager then frees
    blocks behind them, which the buffer would still hold); or where the lowering refuses the
    graph (a node other than attention reading the past): the engine then runs every step on its
    segments."""
    kv_dtype = options.kv_dtype or interface.dtype
    if interface.dtype != "float32" or kv_dtype != "float32" or reusable_window(interface.windows) is not None:
        return None
    single = onnx.ModelProto()
    single.CopyFrom(model)  # weights are references (onnx_io): the copy is the graph's structure
    # Each residual Add and the RMS norm after it as one onnxruntime op: 60 fewer nodes a step on
    # SmolLM2-135M, whose int4 decode step then took 0.96x the time, a 128-token prompt 0.97x
    # (alternated in one process, 2 threads). This graph runs on onnxruntime only.
    FuseSkipNorm(norms=("RMSNormalization",)).run(single)
    try:
        LowerSingleSequence(interface.windows, options.max_seq_len or interface.geometry.max_positions,
                            pad_lone_token).run(single)
    except LlmcError:
        return None
    return single
