"""The OpenVINO backend: a paged engine's steps as one OpenVINO model on the CPU, attention included.

An engine compiled with `--backend openvino` holds the same segments as an onnxruntime engine
(compiler/segments.py). Here OpenVINO's ONNX front end reads each segment, the segments are
joined by the names of the values that cross each cut, and every ``llmc::PagedAttention`` call
becomes OpenVINO's own paged attention (``PagedAttentionExtension``, the op OpenVINO GenAI serves
with). One compiled model then runs a whole step in one call: no per-segment calls, no kernel
between them, and the CPU plugin's bf16 matrix products where the CPU has them.

Each rotary embedding is read with the step's tokens as its batch ([tokens, heads, 1, head dim],
`rotary_tokens_as_batch`), the layout OpenVINO's own models hand its RoPE kernel: read as the
segments write it ([1, tokens, heads · head dim]), the plugin's RoPE puts the heads first and
transposes back, and a 128-token prompt's step on SmolLM2 took 2-3% longer (60 Transposes and a
slower RoPE, by the plugin's per-node counters; the logits are the same to the bit).

What stays llmc's: the KV pool (runtime/kv_cache.py allocates it, each layer's key and value
views are bound to the infer request once, and OpenVINO reads and writes them in place), the
block tables, the scheduler, the prefix cache and copy-on-write. The op stores the step's keys
and values itself, at the slots the block tables give the new tokens.

On a CPU with AMX, under bf16 compute, steps of up to 16 tokens (decodes) run on
a second compiled model of the same graph whose products take their weights transposed
(`weights_transposed`), the form in which the CPU plugin fuses each gate/up/down MLP into one
AMX kernel (LLMMLP; its pass runs only with AMX and bf16). That kernel decodes faster and
prefills slower, so long steps stay on the first model. Measured on a 2-core Xeon with AMX,
the two models alternated in one process (medians of 6-12 pairs): a decode step of one sequence
7-12% shorter (SmolLM2-135M, a 1B Llama), of 16 sequences 2-12% shorter, of 32-64 sequences
13-23% longer at 1B; a prompt of 16-64 tokens 5-8% shorter on SmolLM2, of 128 1% shorter (SmolLM2)
or 34% longer (1B), 1,024-2,048 tokens 4-17% longer. Since where it stops gaining depends on the
model, the engine times both models at load on prompts of 32, 64, 128 and 256 tokens and lets the
fused one take steps up to the last size at which it was faster (`fused_mlp_step_limit`). The
cost: the second model's own repacked weights and buffers (resident after load: SmolLM2-135M
1.1 GB against 0.7, a 1B Llama 7.5 GB against 4.1), so it is built only where
the memory available leaves room for it (`SECOND_MODEL_ROOM`), with a warning where it does not,
and not at all where `BackendOptions.decode_model` is off.

An engine whose linear layers are all weight-only quantized (`--weights int4` or int8) gets a
decode model on the same CPUs of another kind (`F32_DECODES`): the same graph compiled at f32, for
steps of up to 32 tokens, where the CPU plugin decodes such products faster than at bf16, while
prompts stay on the bf16 model, faster there. The two models share the pool in the one cache type
OpenVINO 2026.4 keeps under both precisions, u8, in the plugin's layout: a key block [kv heads,
block + 8, head dim] (each channel's scale and zero point, two float32s, in the 8 rows after the
block's tokens) and a value block [kv heads, block, head dim + 8] (each token's after its row), so
the pool holds keys and values in arrays of their own (`PoolPlacement.block_shapes`), 0.59x a
bf16 pool's bytes a block. Measured on the 2-core Xeon with AMX, against the same engine on its one
bf16 model, alternated in one process (3-4 pairs): a decode step of one sequence 0.69x the time
(SmolLM2-135M int4), 0.64x (a 1B Llama int4), 0.85x (SmolLM2-135M int8); of 16 sequences 0.79x,
0.69x, 0.85x; of 32, 0.93x and 0.78x (int4); prompts of 128 and 1,024 tokens (512 at 1B) level
(0.95-1.01x). The u8 cache costs more to read than a bf16 one as the
context grows (a float bf16 engine on u8 decoded 16 sequences of 512 tokens in 1.22x the time), so
the gain shrinks with it: SmolLM2-135M int4 decodes one sequence at 2,048 tokens in 0.86x the time
and 16 at 512 level (0.99x), and a 2,048-token prompt takes 1.06x. Accuracy, teacher-forced on
768 tokens of Python source each fed as a decode step (SmolLM2-135M int4): perplexity 10.91,
against 10.83 on the one bf16 model with its bf16 cache and 10.85 at f32 with an f32 cache; u8 is
also the cache OpenVINO's CPU plugin keeps where a model names none. The second copy of the
quantized weights is loaded where the memory available holds three times the engine file.

On a CPU with avx512_bf16 but no AMX, the CPU plugin's bf16 products run on AVX-512, and what
they gain depends on the maker. On Intel's, measured on a Xeon, they are faster than f32 where a
step reads its weights once for few tokens (half the bytes), slower where it computes many. So
there the split runs the other way (`F32_PROMPTS`): steps of up to 8 tokens on the bf16 model,
longer ones on the same graph compiled at f32, both over one u8 pool as above. Measured on 2 cores
of a Xeon without AMX (SmolLM2-135M, alternated in one process, medians of 5): f32 against bf16,
a decode of one sequence 1.27-1.35x the time, 8-token prompt level, 16 sequences 0.96x, prompts
of 32, 128 and 1,024 tokens 0.85x, 0.65x, 0.62x; the u8 cache against bf16's level at both
precisions (up to 1,024 tokens of context). Perplexity, teacher-forced on 768 tokens of held-out
Python source each fed as a decode step after a 64-token prompt: 12.12, against 12.14 on the one
bf16 model with its bf16 cache. AMD's Zen 4 and 5 compute bf16 products at twice their f32 rate
(OpenVINO GenAI's own 2,048-token prompt on SmolLM2-135M: 1.76x as fast in bf16 as in f32 on an
AMD EPYC, 0.61x on the Xeon), so there bf16 is faster on prompts and batches too, and one bf16
model runs every step (`BF16_DOUBLE_RATE_VENDORS`). Measured on 2 cores of an AMD EPYC
(SmolLM2-135M, one bf16 model against the split, 3 pairs of processes in turn): 128-token prompts
0.55-0.58x the time, 1,024-token ones 0.58-0.62x, 16 sequences' decode 1.4-1.6x the rate, one
sequence's level.

Under f32 compute the CPU plugin runs a product on MLAS where nothing is fused after it and on
oneDNN's brgemm where something is (OpenVINO 2026.4's rule), and the two are not equally fast.
Measured on 2 cores of an AMD EPYC, one product of 2,048 rows alone: from 2,048 inputs (to 256,
2,048 or 5,632 outputs) oneDNN takes 0.77-0.83x MLAS's time, from 5,632 level; at one row, 1.2-1.3x.
So a wide float32 engine there (`ONEDNN_PROMPTS`) runs its longer steps on a second model whose
products are each followed by an identity clamp, which the plugin fuses (`products_on_onednn`),
and steps of up to 16 tokens on the first, on MLAS. Measured on a 1B Llama f32 (width 2,048), the
two models alternated in one process (5-9 pairs): prompts of 2,048, 128 and 32 tokens in 0.97x,
0.955x and 0.96x the time, 16 sequences' decode step 0.94-0.99x, one sequence's 1.26x (which stays
on MLAS). SmolLM2-135M (width 576) gained nothing (2,048- and 128-token prompts 1.01x and 0.99x),
so narrower engines keep one model. The cost: the second model's repacked weights (the engine
file's size again, resident), built only where memory holds three times the engine file.

A weight-only quantized engine without AMX computes in f32 throughout, on one model, its cache in
the engine's type (`compute_precision`): its int4 or int8 weights are read alike at either
precision, and bf16 gained nothing (measured at int4, not int8; on the AMD EPYC too, 6 pairs of
processes: 128-token prompts 0.94-1.17x the time, one sequence's decode 0.82-1.02x the rate,
16 sequences' 0.88-1.22x). Measured on the Xeon (SmolLM2-135M int4, medians of 7, two runs), one
f32 model with an f32 or f16 cache against the bf16/f32 split: a decode of one sequence 0.93x the
time at 128 tokens of context and 0.81-0.86x at 1,024, of 16 sequences 0.83-0.88x, prompts of
8-128 tokens 0.96-1.03x, of 1,024 0.82-0.90x.

Compute precision is picked at load (`compute_precision`): bf16 where the engine was compiled
with `--bf16` (its accuracy checked at compile time) and the CPU has avx512_bf16 or AMX, else
f32. The pool is kept in the compute precision (bf16 stored as uint16), in u8 where a bf16 and an
f32 model share it, or in float16 for an engine compiled with `--kv-cache-dtype fp16`
(the cache OpenVINO GenAI's exported models ask for): half an f32 pool's bytes. The plugin's
block size is 32, which `--backend openvino` compiles with.

Measured on SmolLM2-135M, 2 cores of an AMD EPYC with avx512_bf16, ms a step against the
onnxruntime backend in the same run (bench/openvino_paged_probe.py): bf16 0.60-0.70x at batch 1,
0.42-0.53x at 16 sequences, 0.45-0.66x on prompts; f32 level at batch 1, 0.66-0.77x at 16.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from llmc.errors import LlmcError
from llmc.formats.cpu_features import cpu_flags, cpu_vendor, native_bf16
from llmc.formats.engine_file import EngineFile, FileRange, bind_weights
from llmc.formats.manifest import linears_in_fp32
from llmc.plugins.paged_attention import OPENVINO_BLOCK_SIZE as BLOCK_SIZE
from llmc.runtime.backends.base import BackendOptions, PoolPlacement
from llmc.runtime.kv_cache import KvCache, available_memory
from llmc.runtime.step_plan import PACKED, StepPaths, StepPlan
from llmc.runtime.timeline import OPENVINO

log = logging.getLogger(__name__)

GRAPH_INPUTS = ("input_ids", "position_ids", "logits_rows")  # the segments' own inputs
LAYOUT_INPUTS = ("past_lens", "subsequence_begins", "block_indices", "block_indices_begins", "max_context_len")
INPUT_TYPES = {**dict.fromkeys(GRAPH_INPUTS, np.int64), **dict.fromkeys(LAYOUT_INPUTS, np.int32)}
# The kinds of decode model (`decode_model`); under F32_PROMPTS the decode model is the bf16 one
# and the prompt model computes in f32; under ONEDNN_PROMPTS both compute in f32, the prompt
# model's products on oneDNN (`products_on_onednn`), the decode model's on MLAS.
FUSED_MLP, F32_DECODES, F32_PROMPTS, ONEDNN_PROMPTS = "fused MLP", "f32", "f32 prompts", "oneDNN prompts"
# The largest step each decode model runs, by where it was measured faster than the prompt model
# (see above): the fused MLP at 1 and 16 tokens on every model measured; f32 at 1-32 tokens (a 1B
# Llama int4: 0.66x, 0.65x, 0.78x the time at 1, 16, 32), level at 48, slower at 64; bf16 without
# AMX at 1 token (0.74x), level at 8, slower at 16 sequences (1.04x) and 32 tokens (1.15x); MLAS
# at 1-8 tokens (a 1B Llama f32: 0.80x, 0.86x, 0.90x the oneDNN model's time at 1, 4, 8), level
# at 16 (1.02-1.06x), slower at 32 (1.02-1.04x).
DECODE_STEP_TOKENS = {FUSED_MLP: 16, F32_DECODES: 32, F32_PROMPTS: 8, ONEDNN_PROMPTS: 16}
# The compute precisions of the prompt model and the decode model where they differ, by kind: the
# two share a u8 cache, the one type OpenVINO keeps under both.
SPLIT_PRECISIONS = {F32_DECODES: ("bf16", "f32"), F32_PROMPTS: ("f32", "bf16")}
# Longer steps the fused MLP takes where it is measured faster at load (`fused_mlp_step_limit`):
# where it stops being faster depends on the model (SmolLM2-135M: through 128 tokens; a 1B Llama:
# slower from 32 on).
FUSED_MLP_TRIALS = (32, 64, 128, 256)
TRIAL_TAKES = 3  # timed calls of each model at each size, after an untimed one (the size's first)
# AMX: what the CPU plugin's fused MLP needs; without it, bf16 products run on AVX-512.
AMX_FLAGS = frozenset({"amx_bf16", "amx_tile"})
# The makers whose AVX-512 computes bf16 products at twice the f32 rate (AMD's Zen 4 and 5), so
# that without AMX prompts run faster in bf16 too (see the module's notes).
BF16_DOUBLE_RATE_VENDORS = {"AuthenticAMD": "AMD"}  # vendor id -> the maker's name
# Where f32 prompts gain from oneDNN's products (`ONEDNN_PROMPTS`): the makers measured (AMD's
# EPYC; not measured on Intel's) and the least width (heads x head dim) measured gaining (2,048, a
# 1B Llama; SmolLM2-135M's 576 was level).
ONEDNN_PROMPT_VENDORS = BF16_DOUBLE_RATE_VENDORS
ONEDNN_MIN_WIDTH = 2048
# The pool's NumPy element type for each OpenVINO cache type (NumPy has no bf16: its bits as uint16).
POOL_STORAGE = {"bf16": np.uint16, "f16": np.float16, "f32": np.float32, "u8": np.uint8}
WEIGHT_ONLY = frozenset({"int4", "int8-weights"})  # the manifest's names of weight-only quantized linears
# The second model is built where the memory available once the first is compiled holds this many
# times its weights' float32 bytes: it took 0.8x those bytes resident (repacked weights and buffers;
# SmolLM2-135M 0.4 GB for 0.5, a 1B Llama 3.4 GB for 4.4), and the KV pool's default size is a share
# of what is left. So a model that fits in memory once never fails to load for want of the second.
SECOND_MODEL_ROOM = 2


def weight_only(manifest) -> bool:
    """Whether every linear layer of the engine keeps its weights quantized (`--weights int4` or
    int8): products that OpenVINO's CPU plugin computes faster at f32 on a decode."""
    linears = (manifest.precision or {}).get("linears") or {}
    return bool(linears) and set(linears.values()) <= WEIGHT_ONLY


def f32_width(manifest) -> int:
    """The width (heads x head dim) of the engine's products where its linear layers are all
    float32, else 0: what `decode_model` weighs for `ONEDNN_PROMPTS`."""
    geometry = manifest.geometry
    return geometry.num_heads * geometry.head_dim if linears_in_fp32(manifest) else 0


def compute_precision(manifest, flags: frozenset[str] | None = None) -> tuple[str, str]:
    """(precision, why): "bf16" where the engine allows it and the CPU computes it natively, else
    "f32"; `why` says which, in words for `llmc inspect` and the load log. A weight-only quantized
    engine computes in f32 on a CPU without AMX: its bf16 products there are no faster on a decode
    (they read the same int4 or int8 weights) and slower on a prompt."""
    flags = cpu_flags() if flags is None else flags
    if manifest.build_options.get("compute") != "bf16":
        return "f32", "fp32 compute (compiled without --bf16)"
    native = native_bf16(flags)
    if not native:
        return "f32", "fp32 compute: compiled with --bf16, but this CPU has neither avx512_bf16 nor AMX"
    if weight_only(manifest) and not AMX_FLAGS <= flags:
        return "f32", ("fp32 compute: compiled with --bf16, but without AMX weight-only quantized products run "
                       f"faster in f32 (this CPU has {', '.join(native)})")
    return "bf16", f"bf16 compute (--bf16; this CPU has {', '.join(native)})"


def decode_model(precision: str, quantized: bool, flags: frozenset[str] | None = None, threads: int | None = None,
                 vendor: str | None = None, f32_width: int = 0) -> tuple[str | None, str]:
    """(kind, why): which second model decode steps run on, `FUSED_MLP`, `F32_DECODES`,
    `F32_PROMPTS`, `ONEDNN_PROMPTS` or None (one model for every step); `why` in words for `llmc
    inspect`. Under bf16 compute, with AMX: the fused MLP needs float weights and 2 threads or more
    (OpenVINO 2026.4 fails compiling it for one thread with a floating-point exception); weight-only
    quantized products decode faster at f32 (`quantized`). Without AMX, bf16 products run on
    AVX-512: on Intel's, faster than f32 on a decode (half the weight bytes) and slower on a prompt,
    so prompts go to an f32 model; on AMD's (`vendor`), faster on both, so one bf16 model runs every
    step. Under f32 compute, an engine whose linear layers are all float32, `f32_width` wide (heads x
    head dim; 0 where they are not all float32), runs its prompts on oneDNN's products where that was
    measured faster (`ONEDNN_PROMPT_VENDORS`, `ONEDNN_MIN_WIDTH`). `threads` None: not known yet;
    `flags` and `vendor` None: this machine's."""
    flags = cpu_flags() if flags is None else flags
    if precision != "bf16":
        vendor = (cpu_vendor() if vendor is None else vendor) if f32_width >= ONEDNN_MIN_WIDTH else None
        if vendor in ONEDNN_PROMPT_VENDORS:
            return ONEDNN_PROMPTS, (f"steps of up to {DECODE_STEP_TOKENS[ONEDNN_PROMPTS]} tokens on MLAS's f32 "
                                    "products, longer ones on a second model whose products run on oneDNN's (faster "
                                    f"there on this {ONEDNN_PROMPT_VENDORS[vendor]} CPU from {ONEDNN_MIN_WIDTH:,} "
                                    "wide), where memory holds three times the engine file at load; off with "
                                    "--no-decode-model")
        return None, ("one model for every step (a decode model needs bf16 compute, or float32 linear layers "
                      f"{ONEDNN_MIN_WIDTH:,} wide or more on an AMD CPU)")
    if not AMX_FLAGS <= flags:
        vendor = cpu_vendor() if vendor is None else vendor
        if vendor in BF16_DOUBLE_RATE_VENDORS:
            return None, (f"one model for every step, in bf16 (this {BF16_DOUBLE_RATE_VENDORS[vendor]} CPU "
                          "computes bf16 products at twice the f32 rate without AMX: prompts run faster in bf16 too)")
        return F32_PROMPTS, (f"steps of up to {DECODE_STEP_TOKENS[F32_PROMPTS]} tokens in bf16, longer ones on a "
                             "second model computing in f32 (without AMX, prompts run faster in it), over a u8 KV "
                             "cache both models share, where memory holds three times the engine file at load; off "
                             "with --no-decode-model")
    if quantized:
        return F32_DECODES, (f"steps of up to {DECODE_STEP_TOKENS[F32_DECODES]} tokens on a second model computing "
                             "in f32 (weight-only quantized products decode faster in it), over a u8 KV cache both "
                             "models share, where memory holds three times the engine file at load; off with "
                             "--no-decode-model; prompts on the first, in bf16")
    if threads is not None and threads < 2:
        return None, "one model for every step (the fused MLP needs 2 threads or more)"
    return FUSED_MLP, (f"steps of up to {DECODE_STEP_TOKENS[FUSED_MLP]} tokens on a second model with OpenVINO's "
                       f"fused MLP, up to {FUSED_MLP_TRIALS[-1]} where timed faster at load (this CPU has AMX; with "
                       "2 threads or more, where memory and disk hold twice and once its weights' float32 bytes at "
                       "load; off with --no-decode-model); longer prompts on the first")


def products_on_onednn(model) -> Callable[[], None] | None:
    """Follow every product of `model` with a float32 weight, the logits' excepted, by
    Clamp(-inf, inf), in place; returns what takes the clamps out again, or None where no product
    has such a weight (a float16 export's: a second model would be the first again). The CPU
    plugin runs an f32 product on MLAS where nothing is fused after it and on oneDNN's brgemm where
    something is: the clamp, an identity, is fused as that something. The logits' product keeps
    MLAS: a prompt's logits are one row a sequence, where MLAS is the faster."""
    import openvino.opset13 as ops

    logits = model.output("logits").get_node().input_value(0).get_node()
    while logits.get_type_name() != "MatMul" and logits.get_input_size():
        logits = logits.input_value(0).get_node()
    clamps = []
    for node in model.get_ordered_ops():
        if node.get_type_name() != "MatMul" or node is logits:
            continue
        weight = node.input_value(1).get_node()
        if weight.get_type_name() != "Constant" or weight.get_output_element_type(0).get_type_name() != "f32":
            continue
        readers = list(node.output(0).get_target_inputs())
        clamp = ops.clamp(node.output(0), float("-inf"), float("inf"))
        for reader in readers:
            reader.replace_source_output(clamp.output(0))
        clamps.append(clamp)
    if not clamps:
        return None

    def restore() -> None:
        for clamp in clamps:
            for reader in list(clamp.output(0).get_target_inputs()):
                reader.replace_source_output(clamp.input_value(0))
    return restore


def weights_transposed(model, folder: Path, room: int | None = None) -> tuple[mmap.mmap | None, str | None]:
    """Give every MatMul of `model` whose weight is a 2-D float32 constant [K, N] that weight as
    [N, K] with transpose_b, in place: the form OpenVINO's MLP fusion matches (a PyTorch
    Linear's). Weight-only quantized products (a decompression subgraph, not a constant) keep
    theirs. The new weights live in an unlinked file in `folder` (`_scratch_mapping`), mapped: the
    compiled model keeps its source constants, and file pages can be dropped once it has repacked
    them (`mapping.madvise(mmap.MADV_DONTNEED)`), where copies in memory would stay resident (SmolLM2:
    0.5 GB).

    Returns:
        (the mapping, None), or (None, why) with the model unchanged: why is None where no product
        qualified, else what was short: `room` bytes of memory (None: no limit), or a file.
    """
    import openvino as ov
    import openvino.opset13 as ops

    products = []
    for node in model.get_ordered_ops():
        weight = node.input_value(1).get_node() if node.get_type_name() == "MatMul" else None
        if (weight is not None and not node.get_attributes()["transpose_b"] and weight.get_type_name() == "Constant"
                and weight.get_element_type() == ov.Type.f32 and len(weight.get_output_shape(0)) == 2):
            products.append((node, weight))
    if not products:
        return None, None
    sizes = [int(np.prod(weight.get_output_shape(0))) * 4 for _, weight in products]
    needed = f"{sum(sizes) / 2**30:.1f} GiB"
    if room is not None and sum(sizes) > room:
        return None, f"its weights take {needed}, more than the {room / 2**30:.1f} GiB of memory left for them"
    mapping = _scratch_mapping(sum(sizes), folder)
    if mapping is None:
        return None, f"its weights need {needed} of disk, which neither {folder} nor {tempfile.gettempdir()} has"
    offset = 0
    for (node, weight), size in zip(products, sizes):
        k, n = weight.get_output_shape(0)
        values = np.frombuffer(mapping, np.float32, size // 4, offset).reshape(n, k)
        _transpose_into(values, weight.get_data())
        transposed = ov.op.Constant(ov.Tensor(values, [n, k], ov.Type.f32), shared_memory=True)
        product = ops.matmul(node.input_value(0), transposed, node.get_attributes()["transpose_a"], True)
        product.set_friendly_name(node.get_friendly_name())
        for target in list(node.output(0).get_target_inputs()):
            target.replace_source_output(product.output(0))
        offset += size
    return mapping, None


def _transpose_into(target: np.ndarray, source: np.ndarray, tile: int = 512) -> None:
    """target[...] = source.T, a tile at a time: a whole-array copy reads `source` a column at a
    time, a cache miss per element (0.9 GB/s against 2.6 for 512-square tiles, a 2,048 x 5,632
    float32 matrix on a Xeon core)."""
    rows, columns = source.shape
    for i in range(0, rows, tile):
        for j in range(0, columns, tile):
            target[j:j + tile, i:i + tile] = source[i:i + tile, j:j + tile].T


def _scratch_mapping(size: int, folder: Path) -> mmap.mmap | None:
    """`size` bytes of an unlinked file, mapped: in `folder`, else in the temporary directory;
    None where neither has room or lets us write. The space is reserved up front: a write
    through the mapping to a full disk would kill the process (SIGBUS)."""
    for where in (folder, None):
        try:
            with tempfile.TemporaryFile(dir=where) as file:
                os.posix_fallocate(file.fileno(), 0, size)
                return mmap.mmap(file.fileno(), size)
        except OSError:
            continue
    return None


def paged_model(engine: EngineFile):
    """The engine's segments joined into one ov.Model, each PagedAttention call OpenVINO's, over
    per-layer cache parameters `key_cache.i`/`value_cache.i` [blocks, kv heads, block, head dim]
    and the step's layout in `LAYOUT_INPUTS` (shared by every layer). The caches' element type is
    left dynamic, for the plugin to give them its KV_CACHE_PRECISION (as OpenVINO GenAI's models
    do): OpenVINO 2026.4 does not write a bound pool whose declared type differs from it."""
    import openvino as ov
    import openvino.opset13 as ops
    from openvino._pyopenvino.op import _PagedAttentionExtension

    core = ov.Core()
    paged, geometry = engine.manifest.paged, engine.manifest.geometry
    weights = FileRange(engine.path, engine.offsets["model.onnx.data"])
    params: dict[str, object] = {}

    def param(name: str, element_type, shape):
        if name not in params:
            params[name] = ops.parameter(shape, element_type, name=name)
            params[name].output(0).set_names({name})
        return params[name].output(0)

    def const(value, dtype=np.int32):
        return ops.constant(np.asarray(value, dtype)).output(0)

    for name in LAYOUT_INPUTS:
        param(name, ov.Type.i32, [] if name == "max_context_len" else [-1])
    values, logits = {}, None  # every value crossing a cut, by its ONNX name
    for segment in paged.segments:
        model = _read_segment(core, engine, segment.section, weights, geometry.head_dim)
        for p in model.get_parameters():
            name = p.get_friendly_name()
            source = values[name] if name in values else param(name, p.get_element_type(), p.get_partial_shape())
            for target in list(p.output(0).get_target_inputs()):
                target.replace_source_output(source)
        for result in model.outputs:
            values[result.get_any_name()] = result.get_node().input_value(0)
            if result.get_any_name() == "logits":
                logits = result.get_node()
        call = segment.attention
        if call is None:
            continue
        if call.softcap:
            raise LlmcError(f"{engine.path}: {segment.section}: attention soft-capping ({call.softcap}) has no "
                            "OpenVINO paged attention; compile with --backend onnxruntime")
        # llmc's [tokens, heads, head dim] is OpenVINO's [tokens, heads · head dim]: shapes of fixed
        # sizes but the tokens, as `collapse_reshapes` needs.
        heads = (geometry.num_heads, geometry.num_kv_heads, geometry.num_kv_heads)
        q, k, v = (ops.reshape(values[n], const([-1, h * geometry.head_dim]), special_zero=False).output(0)
                   for n, h in zip(call.inputs[:3], heads))
        caches = [param(n, ov.Type.dynamic, [-1, geometry.num_kv_heads, paged.block_size, geometry.head_dim])
                  for n in call.inputs[3:5]]
        empty_i32, empty_f32 = const(np.zeros(0)), const(np.zeros(0), np.float32)
        # OpenVINO 2026.4's 28 inputs; those past the 13th switch off what llmc does not use
        # (score aggregation, cache rotation, xattention, sinks, adaptive R-KV, token types).
        inputs = [q, k, v, *caches, *(params[n].output(0) for n in LAYOUT_INPUTS[:4]),
                  const(call.scale, np.float32), const(call.window), empty_f32, params["max_context_len"].output(0),
                  empty_i32, empty_i32, empty_i32, empty_f32, empty_f32, const(0), const(0),
                  const(np.zeros((0, 0, 0, 0)), np.float32), const(0), empty_i32, empty_i32, empty_i32, empty_i32,
                  const(np.zeros(0), np.uint8), empty_i32]
        attention = _PagedAttentionExtension(inputs)
        # The CPU plugin refuses the node without its head counts and sizes.
        for key, value in (("num_k_heads", geometry.num_kv_heads), ("k_head_size", geometry.head_dim),
                           ("num_v_heads", geometry.num_kv_heads), ("v_head_size", geometry.head_dim)):
            attention.get_rt_info()[key] = value
        shape = const([-1, geometry.num_heads, geometry.head_dim])
        values[call.output] = ops.reshape(attention.output(0), shape, special_zero=False).output(0)
    order = [n for n in GRAPH_INPUTS if n in params] + [n for n in params if n not in GRAPH_INPUTS]
    model = ov.Model([logits], [params[n] for n in order], "llmc_paged")
    collapse_reshapes(model)
    return model


def collapse_reshapes(model) -> None:
    """Give every reshape to a fixed shape (a constant that names no input dimension) the value
    ahead of any chain of reshapes before it: the chain is one reshape. The layout changes at each
    attention call (the segments' [tokens, heads, head dim] on either side of OpenVINO's [tokens,
    heads · head dim], and the rotary's own) leave chains the CPU plugin does not merge, every
    reshape a node each step visits: SmolLM2-135M's decode model ran 273 of them, against 185 in
    OpenVINO GenAI's export of it, 0.35 ms of a 17 ms step (int4 at f32 compute, 2 threads)."""
    for node in model.get_ordered_ops():
        if node.get_type_name() != "Reshape":
            continue
        shape = node.input_value(1).get_node()
        if shape.get_type_name() != "Constant" or (node.get_special_zero() and 0 in shape.get_vector()):
            continue
        source = node.input_value(0)
        while source.get_node().get_type_name() == "Reshape":
            source = source.get_node().input_value(0)
        node.input(0).replace_source_output(source)


def cache_block_shapes(compiled) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of one layer's key block and value block in `compiled`'s cache inputs."""
    shapes = {put.get_any_name(): put.get_partial_shape() for put in compiled.inputs}
    return tuple(tuple(d.get_length() for d in shapes[f"{part}_cache.0"][1:]) for part in ("key", "value"))


def _reason(error: RuntimeError) -> str:
    """An OpenVINO error's last line: its message (the lines above it name source locations)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def _compiled(core, model, config: dict, engine: EngineFile):
    try:
        return core.compile_model(model, "CPU", config)
    except RuntimeError as error:
        raise LlmcError(f"{engine.path}: OpenVINO's CPU plugin cannot compile it: "
                        f"{_reason(error)}") from None


def _read_segment(core, engine: EngineFile, section: str, weights: FileRange, head_dim: int):
    graph = onnx.ModelProto()
    graph.ParseFromString(bytes(engine.sections[section]))
    rotary_tokens_as_batch(graph.graph, head_dim)
    # The bound graph names its weights by the engine file's name, and OpenVINO reads external
    # weights only from the graph file's own folder (it refuses a link out of it): the segment is
    # written beside the engine, for as long as the read takes.
    try:
        with tempfile.NamedTemporaryFile(prefix=".llmc-segment-", suffix=".onnx", dir=engine.path.parent) as file:
            file.write(bind_weights(graph.SerializeToString(), weights))
            file.flush()
            return core.read_model(file.name)
    except OSError as error:
        raise LlmcError(f"{engine.path}: OpenVINO reads the engine's graphs from a file beside it, which its folder "
                        f"cannot take ({error.strerror})") from None
    except RuntimeError as error:
        raise LlmcError(f"{engine.path}: section {section}: OpenVINO cannot read it: {_reason(error)}") from None


def rotary_tokens_as_batch(graph: onnx.GraphProto, head_dim: int) -> None:
    """Rewrite each 3-D RotaryEmbedding-23 ([1, tokens, heads · head_dim], `num_heads` set) in
    place as the 4-D op over [tokens, heads, 1, head_dim], every token a batch row of one position:
    its cos/sin rows ([1, tokens, half]) become [tokens, 1, half], or its position ids [1, tokens]
    become [tokens, 1]. The output keeps its name and its 3-D shape."""
    nodes, reshaped = [], {}

    def reshape(name: str, shape: list[int], output: str) -> str:
        shape_name = f"{output}/shape"
        graph.initializer.append(numpy_helper.from_array(np.asarray(shape, np.int64), shape_name))
        nodes.append(helper.make_node("Reshape", [name, shape_name], [output]))
        return output

    def per_token(name: str, shape: list[int]) -> str:  # shared by every rotary reading `name`
        if name not in reshaped:
            reshaped[name] = reshape(name, shape, f"{name}/per_token")
        return reshaped[name]

    for node in graph.node:
        heads = next((a.i for a in node.attribute if a.name == "num_heads"), None)
        if node.op_type != "RotaryEmbedding" or node.domain not in ("", "ai.onnx") or heads is None:
            nodes.append(node)
            continue
        x, cos, sin, *positions = node.input
        output = node.output[0]
        rows = reshape(x, [-1, heads, 1, head_dim], f"{output}/tokens_as_batch")
        if positions and positions[0]:  # cos/sin are tables indexed by position
            inputs = [rows, cos, sin, per_token(positions[0], [-1, 1])]
        else:  # cos/sin hold each token's row; 0 keeps the rotary half-width
            inputs = [rows, per_token(cos, [-1, 1, 0]), per_token(sin, [-1, 1, 0])]
        rotary = helper.make_node("RotaryEmbedding", inputs, [f"{output}/rotated"], name=node.name)
        rotary.attribute.extend(a for a in node.attribute if a.name != "num_heads")
        nodes.append(rotary)
        reshape(rotary.output[0], [1, -1, heads * head_dim], output)
    del graph.node[:]
    graph.node.extend(nodes)


def release_file_pages(path: Path) -> None:
    """Drop this process's resident pages of every read-only mapping of `path`. OpenVINO's ONNX
    front end maps the engine file once for each segment it reads, and the compiled model keeps
    those mappings though it computes from its own repacked weights: the pages its compilation read
    would stay counted in the process's memory, about the whole file (SmolLM2-135M: 1.3 GB
    resident after load, 0.7 GB without them). A page read again faults back in from the page
    cache; a read-only mapping holds nothing that could be lost."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except OSError:
        return  # not Linux: nothing to drop this way
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    target = str(Path(path).resolve())
    for line in maps:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == target and "w" not in fields[1]:
            begin, end = (int(x, 16) for x in fields[0].split("-"))
            libc.madvise(begin, end - begin, mmap.MADV_DONTNEED)  # a refusal leaves the pages where they were


class OpenVinoBackend:
    """One compiled OpenVINO model for every step (two where `decode_model` says so), over
    the engine's KV pool.

    Args:
        engine: an engine compiled with `--backend openvino`.
        options: threads (None: every core); the whole-graph options do not apply (every step
            is one call already).
    """

    # Every step packed: the one model runs them all. Steps of up to 2,048 tokens (measured,
    # SmolLM2-135M and a 32M Llama, 2 threads, against 512): a lone 2,048-token prompt's first
    # token 5% sooner, 64 requests at once 5% more tokens a second, for 35 MB more at the peak.
    paths = StepPaths(step_tokens=2048)

    def __init__(self, engine: EngineFile, options: BackendOptions = BackendOptions()):
        import openvino as ov

        manifest, paged = engine.manifest, engine.manifest.paged
        if paged is None:
            raise LlmcError(f"{engine.path}: not a paged engine ({manifest.not_paged})")
        if paged.block_size != BLOCK_SIZE:
            raise LlmcError(f"{engine.path}: block size {paged.block_size}; OpenVINO's CPU paged attention keeps "
                            f"blocks of {BLOCK_SIZE} (recompile with --backend openvino)")
        self.precision, _ = compute_precision(manifest)
        kind = (decode_model(self.precision, weight_only(manifest), f32_width=f32_width(manifest))[0]
                if options.decode_model else None)
        if kind in SPLIT_PRECISIONS or kind == ONEDNN_PROMPTS:
            kind = self._room_for_second_model(engine, kind)
        # Under bf16 compute OpenVINO keeps the cache in bf16 whatever it is asked, except u8, which it
        # also keeps under f32, in the same layout: the cache a bf16 and an f32 model share. Under f32
        # alone, in the engine's type (float16 with --kv-cache-dtype fp16, or from a float16 export).
        cache = ("u8" if kind in SPLIT_PRECISIONS else "bf16" if self.precision == "bf16"
                 else "f16" if paged.kv_dtype == "float16" else "f32")
        self.cache_type = getattr(ov.Type, cache)
        self._inputs: dict[int, dict[str, np.ndarray]] = {}  # each request's arrays under its input tensors
        config = {"NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY", "KV_CACHE_PRECISION": cache,
                  "INFERENCE_PRECISION_HINT": SPLIT_PRECISIONS[kind][0] if kind in SPLIT_PRECISIONS
                  else self.precision}
        if options.threads:
            config["INFERENCE_NUM_THREADS"] = options.threads
        core = ov.Core()
        model = paged_model(engine)
        restore = products_on_onednn(model) if kind == ONEDNN_PROMPTS else None
        if restore is None and kind == ONEDNN_PROMPTS:
            kind = None
        compiled = _compiled(core, model, config, engine)
        if restore is not None:
            restore()  # the decode model's products stay on MLAS
        given = {put.get_element_type() for put in compiled.inputs if "_cache." in put.get_any_name()}
        if given != {self.cache_type}:  # a pool of another type would be read as garbage
            raise LlmcError(f"{engine.path}: OpenVINO gave the KV cache {', '.join(map(str, given))}, not {cache}")
        self.request = compiled.create_infer_request()
        self.transposed_weights = None  # the fused MLP's weights, for as long as its model lives
        second = self._decode_model(kind, core, model, config, compiled, engine)
        self.small_request = None if second is None else second.create_infer_request()
        self.decode_step_tokens = DECODE_STEP_TOKENS.get(kind, 0)
        del model
        release_file_pages(engine.path)
        self.engine_path = engine.path
        if self.transposed_weights is not None:
            self.transposed_weights.madvise(mmap.MADV_DONTNEED)
        self.timeline = options.timeline
        self.block_size = paged.block_size
        # A u8 block holds its scales and zero points (keys' by channel, values' by token): its own shapes.
        self.placement = PoolPlacement(dtype=np.dtype(POOL_STORAGE[cache]).name,
                                       block_shapes=cache_block_shapes(compiled) if cache == "u8" else None)
        self.kv: KvCache | None = None

    def _decode_model(self, kind: str | None, core, model, config: dict, compiled, engine: EngineFile):
        """The decode model of `kind` (`decode_model`) compiled beside `compiled`, or None where
        the threads, the memory or the disk leave no room for it (with a warning for the last two).
        compile_model compiled a copy of `model`: it may be rewritten here."""
        if kind == FUSED_MLP:
            kind, _ = decode_model(self.precision, False, threads=int(compiled.get_property("INFERENCE_NUM_THREADS")))
        if kind == ONEDNN_PROMPTS:
            return _compiled(core, model, config, engine)
        if kind in SPLIT_PRECISIONS:
            second = _compiled(core, model, {**config, "INFERENCE_PRECISION_HINT": SPLIT_PRECISIONS[kind][1]}, engine)
            if cache_block_shapes(second) != cache_block_shapes(compiled):
                raise LlmcError(f"{engine.path}: OpenVINO lays out a u8 KV cache differently at f32 and bf16 "
                                f"({cache_block_shapes(second)}, {cache_block_shapes(compiled)}); "
                                "load it with decode_model off (--no-decode-model)")
            return second
        if kind != FUSED_MLP:
            return None
        # Built only where it leaves room (`SECOND_MODEL_ROOM`): a model that fits once must still load.
        available = available_memory()
        room = None if available is None else available // SECOND_MODEL_ROOM
        self.transposed_weights, short = weights_transposed(model, engine.path.parent, room)
        if short:
            log.warning("%s: decodes run on the prompt model, without OpenVINO's fused MLP: %s", engine.path, short)
        return None if self.transposed_weights is None else _compiled(core, model, config, engine)

    @staticmethod
    def _room_for_second_model(engine: EngineFile, kind: str) -> str | None:
        """`kind` (one of `SPLIT_PRECISIONS` or `ONEDNN_PROMPTS`) where the memory available holds
        three times the engine file (two compiled models of its weights, and room for the pool),
        else None, with a warning."""
        available, size = available_memory(), engine.path.stat().st_size
        if available is None or 3 * size <= available:
            return kind
        instead = {F32_DECODES: "decodes run on the prompt model, in bf16",
                   F32_PROMPTS: "prompts run on the decode model, in bf16",
                   ONEDNN_PROMPTS: "prompts run on the decode model, on MLAS's products"}[kind]
        log.warning("%s: %s: the %.1f GiB of memory available hold less than three times the engine file's %.1f GiB",
                    engine.path, instead, available / 2**30, size / 2**30)
        return None

    def attach(self, kv: KvCache) -> None:
        import openvino as ov

        self.kv = kv
        for name, view in kv.layer_pools().items():
            for request in self._requests():
                request.set_tensor(name, ov.Tensor(view, list(view.shape), self.cache_type))

    def _requests(self):
        return [self.request] + ([self.small_request] if self.small_request is not None else [])

    def feeds(self, plan: StepPlan) -> dict[str, np.ndarray]:
        """The step's inputs, in any integer type (`_infer` writes them into arrays of the model's,
        `INPUT_TYPES`): OpenVINO's block list holds each sequence's blocks through its new tokens'
        (it stores them there), flattened. As few NumPy calls as can be: after a step's call, each
        costs ~10 us of a decode step's few ms (its caches cold)."""
        batch = plan.batch
        starts, past = np.asarray(batch.query_start_loc), np.asarray(batch.context_lens)
        total = past + np.diff(starts)
        used = -(-total // self.block_size)
        tables = np.asarray(batch.block_tables)
        blocks = tables[0, :used[0]] if len(used) == 1 else tables[np.arange(tables.shape[1]) < used[:, None]]
        return {"input_ids": np.asarray(plan.tokens)[None], "position_ids": np.asarray(plan.positions)[None],
                "logits_rows": np.asarray(plan.rows), "past_lens": past, "subsequence_begins": starts,
                "block_indices": blocks, "block_indices_begins": np.concatenate(([0], np.cumsum(used))),
                "max_context_len": total.max()}

    def run(self, plan: StepPlan) -> np.ndarray:
        small = self.small_request is not None and len(plan.tokens) <= self.decode_step_tokens
        return self._infer(self.small_request if small else self.request, plan)

    def _infer(self, request, plan: StepPlan) -> np.ndarray:
        import openvino as ov

        with self.timeline.span("openvino step", OPENVINO):
            # Each input a tensor over an array the backend owns, set once per shape: a step whose
            # input has the last one's shape writes into that array. Setting a new tensor makes the
            # plugin prepare the request again: 0.5-0.6 ms a step (SmolLM2-135M int4 decodes of
            # 8 ms, 7% of them), and handing it the dict of arrays (`infer(feeds)`) as much.
            # A tensor over an array does not keep the array alive: `_inputs` does.
            held = self._inputs.setdefault(id(request), {})
            for name, array in self.feeds(plan).items():
                if name in held and held[name].shape == np.shape(array):
                    np.copyto(held[name], array, casting="unsafe")  # ids, positions, block numbers: in range
                else:
                    held[name] = np.array(array, INPUT_TYPES[name], order="C")  # (max_context_len: 0-d)
                    request.set_tensor(name, ov.Tensor(held[name], shared_memory=True))
            request.infer()
        return np.array(request.get_tensor("logits").data[0])

    def steps_round_alike(self) -> bool:
        # A step's rows go through the CPU plugin's kernels together: how a sequence's tokens are
        # cut into steps changes their rounding (not checked bit for bit here).
        return False

    def warm_up(self) -> None:
        """One throw-away step on each model, a prompt chunk and a decode, in blocks no request
        owns yet: the first calls' allocations and kernel selection."""
        from llmc.plugins.paged_attention import PagedBatch

        seqs = 2 if self.kv.num_blocks >= 2 else 1
        prompt = min(16, self.block_size)
        tables = np.arange(seqs, dtype=np.int64)[:, None]
        starts = np.array([0, prompt, prompt + 1][:seqs + 1])
        batch = PagedBatch(tables, np.array([0, 1][:seqs]), starts)
        positions = np.concatenate([np.arange(prompt), np.ones(seqs - 1, np.int64)])
        for request in self._requests():
            self._infer(request, StepPlan(PACKED, np.zeros(len(positions), np.int64), positions, batch, starts[1:] - 1))
        # oneDNN's products repack their weights at their first call, from the engine file's pages
        # (a 1B Llama f32 on ONEDNN_PROMPTS: 3.7 GB of them resident after the call, 0.1 GB once dropped)
        release_file_pages(self.engine_path)
        if self.transposed_weights is not None:  # the fused MLP repacks its weights at its first call
            self.transposed_weights.madvise(mmap.MADV_DONTNEED)
            self.decode_step_tokens = fused_mlp_step_limit(self._prompt_seconds)
            log.info("steps of up to %d tokens run on the fused-MLP model (timed faster than the prompt model "
                     "up to there)", self.decode_step_tokens)

    def _prompt_seconds(self, tokens: int) -> tuple[float, float] | None:
        """(decode model, prompt model): the shortest of `TRIAL_TAKES` calls of each on a prompt
        of `tokens` tokens, the two alternated, each size's first call untimed; None where the
        step is longer than the backend takes or the pool holds. In blocks no request owns yet."""
        from llmc.plugins.paged_attention import PagedBatch

        blocks = -(-tokens // self.block_size)
        if tokens > self.paths.step_tokens or blocks > self.kv.num_blocks:
            return None
        plan = StepPlan(PACKED, np.zeros(tokens, np.int64), np.arange(tokens),
                        PagedBatch(np.arange(blocks)[None], np.array([0]), np.array([0, tokens])), np.array([tokens - 1]))
        best = {"decode": float("inf"), "prompt": float("inf")}
        for take in range(TRIAL_TAKES + 1):
            for model, request in (("decode", self.small_request), ("prompt", self.request)):
                start = time.perf_counter()
                self._infer(request, plan)
                if take:
                    best[model] = min(best[model], time.perf_counter() - start)
        return best["decode"], best["prompt"]


def fused_mlp_step_limit(prompt_seconds) -> int:
    """The longest step the fused-MLP model runs: `DECODE_STEP_TOKENS[FUSED_MLP]`, raised through
    `FUSED_MLP_TRIALS` for as long as `prompt_seconds(tokens)` ((decode model, prompt model) seconds,
    or None where that step cannot be timed) finds the decode model faster."""
    limit = DECODE_STEP_TOKENS[FUSED_MLP]
    for tokens in FUSED_MLP_TRIALS:
        seconds = prompt_seconds(tokens)
        if seconds is None or seconds[0] >= seconds[1]:
            break
        limit = tokens
    return limit


def deploy_checks(manifest, record) -> None:
    """The compute precision this machine gives the engine, and whether its decodes get a model of their own."""
    precision, why = compute_precision(manifest)
    record("compute precision", True, why)
    why = decode_model(precision, weight_only(manifest), f32_width=f32_width(manifest))[1]
    record("decode model", True, why)
