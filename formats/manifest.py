"""The engine manifest as a typed schema: what `llmc compile` records and the runtime reads.

`parse_manifest` checks a manifest read from an engine file field by field and returns typed
objects; a wrong field is one error naming it (``paged.num_blocks: expected an integer, got
'8'``). Free-form records meant for people and tools (the optimization report, the precision
report, build options) are checked only for their kind (object, list).

Format versions: the file header carries `FORMAT_VERSION`, bumped whenever the manifest or the
sections change meaning; a file of any other version is refused in one line that says to
recompile it. A paged engine stores its segments and their attentions' dense forms cut and built
at compile time, so the runtime serves it without the compiler or onnx, and the manifest names
every field the runtime reads.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from llmc.errors import LlmcError

FORMAT_VERSION = 3


@dataclass(frozen=True)
class Geometry:
    """The shape of a decoder: what the runtime needs to size caches and validate requests."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int


@dataclass(frozen=True)
class AttentionCall:
    """A PagedAttention node between two segments: the values it reads and writes, and its
    attributes (see plugins/paged_attention.py)."""

    inputs: tuple[str, ...]  # query, key, value, key pool, value pool (then the step layout)
    output: str
    scale: float
    window: int  # sliding window, 0 for full attention
    softcap: float  # score soft-capping, 0.0 for none
    # The section holding this call's dense form (plugins/paged_attention_onnx.py), which the CPU
    # runtime runs for prefill chunks. Every engine names one (`parse_manifest` checks); None only
    # inside the compiler, between cutting the segments and storing the dense forms.
    dense: str | None


@dataclass(frozen=True)
class Segment:
    """The graph between two attentions (an onnxruntime session) and the attention after it."""

    section: str | None  # the engine section holding the ONNX graph; None when no node falls here
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attention: AttentionCall | None  # None after the last segment


@dataclass(frozen=True)
class PagedLayout:
    """The paged KV pool and the segments of a paged engine."""

    block_size: int
    max_batch: int
    max_seq_len: int
    kv_pool_mb: float | None  # as asked; None when sized from max_batch
    kv_dtype: str
    num_blocks: int
    pool_mb: float
    window: int | None  # positions every layer reads back, when every layer has a window
    segments: tuple[Segment, ...]
    # The section of the whole graph for steps of one sequence (passes/lower_single_sequence.py);
    # None where the engine has none (compiler/paged_engine.py `single_sequence_graph` says
    # when; a TensorRT engine runs every step on its one engine).
    single_sequence: str | None


# The metadata key of a single-sequence graph that leaves room for a lone token's padding row
# (passes/lower_single_sequence.py), "1" where it does.
PADDING_ROW = "llmc.padding_row"


@dataclass(frozen=True)
class TensorRTBuild:
    """What a TensorRT engine was built with and for (compiler/tensorrt_build.py): checked at load,
    since a serialized TensorRT engine runs only on the TensorRT release and GPU that built it,
    unless it was built version- or hardware-compatible."""

    version: str  # TensorRT's, e.g. "11.4.0.106"
    gpu: str
    compute_capability: str  # "9.0"
    plugins: dict  # plugin id → version
    hardware_compatible: bool  # any Ampere-or-newer GPU
    version_compatible: bool  # later TensorRT 11 releases
    optimization_level: int
    max_num_tokens: int
    build_s: float


@dataclass(frozen=True)
class Source:
    file: str
    sha256: str
    nodes: int


@dataclass(frozen=True)
class Section:
    name: str
    offset: int
    length: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """Everything an engine file says about itself."""

    format_version: int
    llmc_version: str
    created: str
    backend: str
    geometry: Geometry
    dtype: str
    has_position_ids: bool
    sliding_window: int | None
    layer_windows: tuple[int, ...] | None
    source: Source
    build_options: dict
    optimization: list
    precision: dict | None
    paged: PagedLayout | None
    sections: tuple[Section, ...]
    not_paged: str | None = None  # why the engine is contiguous, when it is
    tensorrt: TensorRTBuild | None = None  # a TensorRT engine's build (backend "tensorrt")
    extra: dict = field(default_factory=dict)  # fields this llmc does not know (a newer minor writer)

    def to_dict(self) -> dict:
        entry = dataclasses.asdict(self)
        entry.update(entry.pop("extra"))
        return entry


def parse_manifest(data: Any, where: str) -> Manifest:
    """Check a manifest read from JSON; `where` (the file) starts every error."""
    if not isinstance(data, dict):
        raise LlmcError(f"{where}: manifest is not a JSON object")
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        raise LlmcError(f"{where}: engine format {version} was written by another llmc (this one reads "
                        f"format {FORMAT_VERSION}); recompile it with `llmc compile`")
    known = {f.name for f in dataclasses.fields(Manifest)} - {"extra"}
    manifest = _parse(Manifest, {k: v for k, v in data.items() if k in known}, where, "")
    _check_values(manifest, where)
    names = {section.name for section in manifest.sections}
    if manifest.backend == "tensorrt":
        if manifest.tensorrt is None:
            raise LlmcError(f"{where}: manifest field 'tensorrt' is missing (a TensorRT engine's build)")
        payload = ["engine.trt"]
    elif manifest.paged is None:
        payload = ["model.onnx"]
    else:
        for k, segment in enumerate(manifest.paged.segments):
            if segment.attention is not None and segment.attention.dense is None:
                raise LlmcError(f"{where}: manifest field 'paged.segments[{k}].attention.dense' is missing (the "
                                f"attention's dense form)")
        payload = [name for s in manifest.paged.segments for name in (s.section, s.attention and s.attention.dense) if name]
        payload += [manifest.paged.single_sequence] if manifest.paged.single_sequence else []
    missing = [name for name in ["tokenizer.json", *payload] if name not in names]
    if missing:
        raise LlmcError(f"{where}: the manifest names no section '{missing[0]}'")
    return dataclasses.replace(manifest, extra={k: v for k, v in data.items() if k not in known})


def linears_in_fp32(manifest: Manifest) -> bool:
    """Whether every linear layer of the engine computes in float32: no fp16, no quantized
    weights, and not compiled for bf16 compute (which OpenVINO may give them)."""
    precision = manifest.precision
    if manifest.build_options.get("compute") == "bf16":
        return False
    return precision is None or (not precision.get("fp16") and set(precision.get("linears", {}).values()) <= {"fp32"})


def kv_block_bytes(geometry: Geometry, block_size: int, kv_dtype: str) -> int:
    """Bytes one pool block takes: keys and values of `block_size` tokens in every layer."""
    itemsize = np.dtype(kv_dtype).itemsize
    return 2 * geometry.num_layers * geometry.num_kv_heads * block_size * geometry.head_dim * itemsize


def blocks_in(pool_mb: float, block_bytes: int, block_size: int, max_seq_len: int, option: str) -> int:
    """Blocks of `block_bytes` a pool of `pool_mb` MiB holds; raises LlmcError naming `option` when
    that is fewer than one sequence of max_seq_len tokens needs. Shared by compile (--kv-pool-mb)
    and load."""
    blocks = int(pool_mb * 2**20 // block_bytes)
    per_sequence = -(-max_seq_len // block_size)
    if blocks < per_sequence:
        raise LlmcError(f"{option}: {pool_mb} MiB holds {blocks} blocks of {block_size} tokens, fewer than "
                        f"the {per_sequence} blocks one sequence of {max_seq_len} tokens needs")
    return blocks


DTYPES = ("float32", "float16", "bfloat16")
KV_DTYPES = ("float32", "float16")


def precision_summary(manifest: dict) -> str:
    """The model's dtype and, when a precision option rewrote it, what its linear layers became
    ("float32 model; linears: int8 ×90, int8-weights ×31; fp16 elsewhere")."""
    precision = manifest.get("precision")
    if not precision:
        return manifest["dtype"]
    counts: dict[str, int] = {}
    for kind in precision["linears"].values():
        counts[kind] = counts.get(kind, 0) + 1
    linears = ", ".join(f"{kind} ×{count}" for kind, count in sorted(counts.items(), key=lambda item: -item[1]))
    return f"{manifest['dtype']} model; linears: {linears}" + ("; fp16 elsewhere" if precision.get("fp16") else "")


def kv_cache_summary(manifest: dict) -> str:
    """The KV cache's layout in one line (paged blocks and seats, or why it is contiguous)."""
    paged = manifest["paged"]
    if not paged:
        return f"contiguous past/present ({manifest['not_paged']})"
    return (f"paged: {paged['num_blocks']} blocks of {paged['block_size']} tokens ({paged['pool_mb']} MiB, "
            f"{paged['kv_dtype']}), max batch {paged['max_batch']}, max sequence {paged['max_seq_len']}"
            + (f", {len(paged['segments'])} segments" if paged["segments"] else ""))


def build_options_summary(options: dict) -> str:
    """The build options in one line: backend, pass level or list, verify."""
    passes = options.get("passes", [])
    level = f"level {options['level']}" if options.get("level") is not None else "passes " + ",".join(passes)
    summary = f"backend {options.get('backend')}, {level} ({len(passes)} passes), verify {options.get('verify')}"
    if options.get("compute") == "bf16":
        accuracy = options.get("bf16_accuracy")
        summary += (f", bf16 allowed (perplexity {accuracy['ppl_increase_pct']:+.2f}% on {accuracy['tokens']} tokens)"
                    if accuracy else ", bf16 allowed unchecked (--force)")
    return summary


def build_record(manifest: dict) -> dict:
    """What a CI job records of a build, from its manifest: backend, precision (layers per
    precision), geometry, the KV layout, node counts, matches per pass, the source's hash."""
    precision = manifest.get("precision") or {}
    paged = manifest.get("paged")
    kinds = list(precision.get("linears", {}).values())
    return {"backend": manifest["backend"], "dtype": manifest["dtype"],
            "precision": None if not precision else {
                "fp16": precision.get("fp16", False), "accuracy": precision.get("accuracy"),
                **({"weights_symmetric": precision["weights_symmetric"]} if "weights_symmetric" in precision else {}),
                "linears": {kind: kinds.count(kind) for kind in sorted(set(kinds))}},
            "geometry": manifest["geometry"],
            "paged": None if not paged else {k: paged[k] for k in ("block_size", "max_batch", "max_seq_len",
                                                                   "num_blocks", "kv_dtype")},
            "nodes": {"source": manifest["source"]["nodes"],
                      "final": manifest["optimization"][-1]["nodes_after"] if manifest["optimization"] else None},
            "passes": {e["pass"]: e["matches"] for e in manifest["optimization"]},
            "source_sha256": manifest["source"]["sha256"], "llmc_version": manifest["llmc_version"],
            **({"tensorrt": manifest["tensorrt"]} if manifest.get("tensorrt") else {})}


def _check_values(manifest: Manifest, where: str) -> None:
    """Values the runtime would choke on deep inside NumPy or onnxruntime."""
    checks = [("dtype", manifest.dtype, manifest.dtype in DTYPES),
              *((f"geometry.{k}", v, v > 0) for k, v in dataclasses.asdict(manifest.geometry).items())]
    if manifest.paged is not None:
        paged = manifest.paged
        checks += [("paged.kv_dtype", paged.kv_dtype, paged.kv_dtype in KV_DTYPES),
                   ("paged.block_size", paged.block_size, paged.block_size > 0),
                   ("paged.num_blocks", paged.num_blocks, paged.num_blocks > 0),
                   ("paged.max_seq_len", paged.max_seq_len, paged.max_seq_len > 1)]
    for name, value, good in checks:
        if not good:
            raise LlmcError(f"{where}: manifest field '{name}': {value!r} is not a valid value")


def _parse(kind: Any, value: Any, where: str, name: str) -> Any:
    """`value` checked against the type annotation `kind`; errors name the dotted field."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _parse(inner, value, where, name)
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            raise _wrong(where, name, "an object", value)
        hints = typing.get_type_hints(kind)
        fields = [f for f in dataclasses.fields(kind) if f.name != "extra"]
        parsed = {}
        for f in fields:
            path = f"{name}.{f.name}" if name else f.name
            if f.name not in value:
                if f.default is not dataclasses.MISSING:
                    continue
                raise LlmcError(f"{where}: manifest field '{path}' is missing")
            parsed[f.name] = _parse(hints[f.name], value[f.name], where, path)
        return kind(**parsed)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):  # a list from JSON, a tuple from the compiler
            raise _wrong(where, name, "a list", value)
        return tuple(_parse(args[0], item, where, f"{name}[{i}]") for i, item in enumerate(value))
    checks = {int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
              float: (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
              str: (lambda v: isinstance(v, str), "a string"),
              bool: (lambda v: isinstance(v, bool), "true or false"),
              dict: (lambda v: isinstance(v, dict), "an object"),
              list: (lambda v: isinstance(v, (list, tuple)), "a list")}
    check, expected = checks[kind]
    if not check(value):
        raise _wrong(where, name, expected, value)
    return float(value) if kind is float else value


def _wrong(where: str, name: str, expected: str, value: Any) -> LlmcError:
    shown = repr(value) if len(repr(value)) < 40 else type(value).__name__
    return LlmcError(f"{where}: manifest field '{name}': expected {expected}, got {shown}")
