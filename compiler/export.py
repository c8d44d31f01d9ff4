"""`llmc export`: PyTorch decoder → ONNX with the standard decoder-with-past interface.

The graph takes ``input_ids``, ``attention_mask``, ``position_ids`` and
``past_key_values.{i}.key|value`` and returns ``logits`` and ``present.{i}.key|value``, with
batch, sequence and past length dynamic — the interface Optimum and onnxruntime-genai write, so
`llmc compile` treats their files and ours alike. The tokenizer and the geometry the interface
cannot show travel in the graph's metadata. After writing, the graph is run with onnxruntime
against PyTorch on seeded inputs (a prefill, then a decode step with past).

The model is llmc's own module for the families in its table (models/decoder.py, gpt2.py), or
transformers' module behind the same forward contract for any other decoder-only model_type
(models/transformers_module.py); both are traced and checked alike.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import logging
import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import onnx
import torch

from llmc.compiler.build import TOKENIZER_METADATA_KEY
from llmc.formats.decoder_interface import Geometry, config_windows, geometry_metadata
from llmc.errors import LlmcError, first_line
from llmc.formats.onnx_io import EXTERNAL_DATA_THRESHOLD, save_ir_model, save_serialized, save_with_external_data
from llmc.formats.sessions import session_options
from llmc.models import LoadedModel, load_model
from llmc.models.decoder import Decoder

# Example sizes for tracing: 0 and 1 would be specialized by torch.export, so use larger ones.
_TRACE_BATCH, _TRACE_SEQ, _TRACE_PAST = 2, 3, 4

# torch.onnx has two exporters. The TorchScript one traces the model once, in C++; a model whose
# layers are alike is traced with two and the rest copied on the graph's structure (`_repeat_layer`).
# The torch.export one makes two symbolic traces of every layer, then runs onnxscript's optimizer:
# SmolLM2-135M's export takes 4-5 s and 1.4 GB by the first, 106 s and 2.8 GB by the second, for
# the same fusions by `llmc compile` (bench/export_paths_bench.py). A trace fixes Python-level
# branches on shapes, so the parity check runs at other shapes than the trace's (a 5-token prefill
# of 2 sequences, then a decode with past). Its graph comes without weights; they are written
# from the model's tensors, inline or, past EXTERNAL_DATA_THRESHOLD (1.8 GB), into
# `<output>.data`. "auto" is the TorchScript one.
EXPORTERS = ("auto", "torchscript", "dynamo")
_OPSET = 20  # what the torch.export exporter writes too


@dataclass(frozen=True)
class ParityCheck:
    """Max abs difference between onnxruntime and PyTorch, per step of the seeded check."""

    prefill_logits: float
    prefill_present: float
    decode_logits: float
    decode_present: float

    @property
    def max_abs(self) -> float:
        return max(self.prefill_logits, self.prefill_present, self.decode_logits, self.decode_present)


class _FlatDecoder(torch.nn.Module):
    """Adapts the models' list-of-pairs cache to the flat tensors an ONNX interface needs."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, *past_flat):
        past = list(zip(past_flat[0::2], past_flat[1::2]))
        logits, presents = self.model(input_ids, attention_mask, position_ids, past)
        return (logits, *[t for pair in presents for t in pair])


def model_geometry(model: torch.nn.Module) -> Geometry:
    """The geometry of a model from `llmc.models`."""
    return Geometry(num_layers=model.num_layers, num_heads=model.num_heads,
                    num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
                    vocab_size=model.vocab_size, max_positions=model.max_positions)


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    """Input and output names of the decoder-with-past interface."""
    cache = [(i, part) for i in range(num_layers) for part in ("key", "value")]
    inputs = ["input_ids", "attention_mask", "position_ids"]
    inputs += [f"past_key_values.{i}.{part}" for i, part in cache]
    outputs = ["logits"] + [f"present.{i}.{part}" for i, part in cache]
    return inputs, outputs


def export(model: str | LoadedModel, output: str | os.PathLike, *, check: bool = True, exporter: str = "auto",
           progress: Callable[[str], None] = lambda message: None) -> ParityCheck | None:
    """Export a model to an ONNX decoder with past, then check it against PyTorch.

    Args:
        model: a built-in model name, a Hugging Face checkpoint folder, or a loaded model.
        output: the .onnx file to write (weights go to `<output>.data` past 2 GB).
        check: run the seeded onnxruntime-vs-PyTorch parity check after writing.
        exporter: torch.onnx's "torchscript" or "dynamo" exporter, or "auto" (see `EXPORTERS`).
        progress: called with a short line as each stage starts.
    """
    if exporter not in EXPORTERS:
        raise LlmcError(f"--exporter: '{exporter}' is not one of {', '.join(EXPORTERS)}")
    start = time.perf_counter()
    loaded = load_model(str(model)) if not isinstance(model, LoadedModel) else model
    geometry = model_geometry(loaded.model)
    weights_gb = sum(p.numel() * p.element_size() for p in loaded.model.parameters()) / 1e9
    progress(f"exporting {loaded.name}: {geometry.num_layers} layers, {geometry.num_heads} heads, "
             f"{geometry.num_kv_heads} kv heads, vocab {geometry.vocab_size}, {weights_gb:.2f} GB of weights "
             f"(loaded in {time.perf_counter() - start:.1f} s)")
    start = time.perf_counter()
    graph, exporter = _traced(loaded, geometry, exporter, progress)
    progress(f"traced to ONNX ({exporter}) in {time.perf_counter() - start:.1f} s")
    # One window for every layer, or one per layer (Gemma 2/3, Qwen2's max_window_layers), 0 = full.
    windows = [w or 0 for w in _layer_windows(loaded.model)]
    uniform = len(set(windows)) <= 1
    metadata = {**geometry_metadata(geometry, (windows[0] or None) if windows and uniform else None),
                TOKENIZER_METADATA_KEY: loaded.tokenizer.to_json(), "llmc.source_model": loaded.name,
                **({} if uniform else {"llmc.layer_windows": json.dumps(windows)})}
    if isinstance(graph, tuple):
        graph, weights = graph
        # Past what one protobuf holds, the weights go to `<output>.data`. Written on a second
        # thread while the check runs on the same tensors in memory.
        save = save_with_external_data if weights_gb * 1e9 >= EXTERNAL_DATA_THRESHOLD else save_serialized
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmc-write") as writer:
            written = writer.submit(_timed, save, graph, weights, output, metadata=metadata)
            result = _checked(loaded.model, graph, check, progress, weights)
            progress(f"wrote {output} in {written.result():.1f} s")
        return result
    graph.metadata_props.clear()
    graph.metadata_props.update(metadata)
    # Straight from the exporter's graph, whose tensors are the model's own: the weights are
    # never copied into a ModelProto (past 2 GB one cannot hold them).
    progress(f"wrote {output} in {_timed(save_ir_model, graph, output):.1f} s")
    del graph
    return _checked(loaded.model, output, check, progress)


def _traced(loaded: LoadedModel, geometry: Geometry, exporter: str, progress: Callable[[str], None]):
    """The graph by `exporter`, and the exporter that made it. "auto" takes the TorchScript one, and
    torch.export's where TorchScript cannot convert the model (transformers' modules outside the
    table may use what its converter lacks, e.g. Cohere's interleaved rotary)."""
    if exporter != "auto":
        return (_trace_torchscript if exporter == "torchscript" else _to_onnx)(loaded.model, geometry), exporter
    try:
        return _trace_torchscript(loaded.model, geometry), "torchscript"
    except Exception as torchscript_error:  # any failure of its converter: the other exporter decides
        progress(f"the TorchScript exporter cannot convert {loaded.name} ({_one_line(torchscript_error)}); "
                 "trying torch.export")
        try:
            return _to_onnx(loaded.model, geometry), "dynamo"
        except Exception as dynamo_error:
            raise LlmcError(f"export: neither torch.onnx exporter converts {loaded.name}: TorchScript: "
                            f"{_one_line(torchscript_error)}; torch.export: {_one_line(dynamo_error)}") from None


def _one_line(error: Exception) -> str:
    return f"{type(error).__name__}: {first_line(error, 160)}"


def _layer_windows(model: torch.nn.Module) -> Sequence[int | None]:
    """Each layer's attention window (None or 0: full); the table's models keep them in their args,
    transformers' (models/transformers_module.py) in their Hugging Face config."""
    if hasattr(model, "args"):
        return getattr(model.args, "layer_windows", ())
    return config_windows(model.hf_config) or [0] * model.num_layers


def _timed(function: Callable, *args, **kwargs) -> float:
    start = time.perf_counter()
    function(*args, **kwargs)
    return time.perf_counter() - start


def _checked(model: torch.nn.Module, graph: bytes | Path, check: bool, progress: Callable[[str], None],
             weights: Sequence[Initializer] = ()) -> ParityCheck | None:
    if not check:
        return None
    progress("checking onnxruntime against PyTorch on seeded inputs")
    start = time.perf_counter()
    result = check_parity(model, graph, weights=weights)
    progress(f"checked in {time.perf_counter() - start:.1f} s")
    return result


def _trace_torchscript(model: torch.nn.Module, geometry: Geometry) -> tuple[bytes, list[Initializer]]:
    """The decoder by torch.onnx's TorchScript exporter (see `EXPORTERS`): a serialized
    ModelProto without its weights, and the weights (see `_with_weights`). A model whose layers
    are all alike is traced with two and its second layer repeated for the rest (`_repeat_layer`):
    the trace's cost grows with the graph (SmolLM2-135M's 30 layers: 8.7 s), a copy of a layer's
    nodes costs next to nothing, and the parity check runs the whole model against PyTorch either
    way."""
    short = _first_layers(model, TRACED_LAYERS)
    if short is not None:
        graph = _trace(short, model_geometry(short))
        flat = _FlatDecoder(model)
        tensors = {name for name, _ in [*flat.named_parameters(), *flat.named_buffers()]}
        if _repeat_layer(graph, _layer_boundaries(flat), tensors):
            return _with_weights(graph, flat)
    return _with_weights(_trace(model, geometry), _FlatDecoder(model))


TRACED_LAYERS = 2  # layer 0 may hold what the trace shares between layers; layer 1 is the pattern


def _trace(model: torch.nn.Module, geometry: Geometry) -> onnx.ModelProto:
    """torch.onnx's TorchScript export of the decoder, its weights left as graph inputs named as
    the module's parameters (or only read by that name: see `_with_weights`)."""
    inputs = sample_inputs(geometry, _TRACE_BATCH, _TRACE_SEQ, _TRACE_PAST, seed=0)
    input_names, output_names = io_names(geometry.num_layers)
    buffer = io.BytesIO()
    with warnings.catch_warnings(), quiet_exporter(), _without_whole_graph_shape_inference():
        # Its deprecation notice, and a TracerWarning per shape the model compares in Python
        # (the parity check is what tells whether a trace generalizes).
        warnings.simplefilter("ignore")
        # Without the weights: carried through its passes and serialized by it, they cost 6 of
        # SmolLM2-135M's 12 s of export; `_with_weights` adds them in one copy. Its constant
        # folding is left to `llmc compile` (which folds the graph anyway).
        torch.onnx.export(_FlatDecoder(model).eval(), tuple(inputs.values()), buffer, dynamo=False,
                          input_names=input_names, output_names=output_names, opset_version=_OPSET,
                          dynamic_axes={name: _dynamic_axes(name) for name in [*input_names, *output_names]},
                          export_params=False, do_constant_folding=False)
    return onnx.load_from_string(buffer.getvalue())


def _first_layers(model: torch.nn.Module, count: int) -> Decoder | None:
    """A view of `model` with only its first `count` layers (sharing their weights), when its
    layers are all alike and it has more; else None."""
    if type(model) is not Decoder or model.num_layers <= count or len(set(model.args.layer_windows)) > 1 \
            or model.args.sliding_layers is not None:
        return None
    short = copy.copy(model)
    short._modules = dict(model._modules)  # a shallow copy would share them: changed here, changed there
    backbone = copy.copy(model.model)
    backbone._modules = dict(model.model._modules)
    backbone.layers = torch.nn.ModuleList(list(model.model.layers)[:count])
    short.model = backbone
    short.args = dataclasses.replace(model.args, num_layers=count)
    return short


@dataclass(frozen=True)
class LayerBoundary:
    """What one decoder layer reads that no other layer does, and what it returns besides the
    hidden state, by the names a graph of the model gives them: its weights (the module's
    parameter names, in the module's order, so alike layers list them alike), past and present."""

    weights: tuple[str, ...]
    past: tuple[str, str]
    presents: tuple[str, str]

    @property
    def inputs(self) -> tuple[str, ...]:
        return (*self.weights, *self.past)


def _layer_boundaries(flat: torch.nn.Module) -> list[LayerBoundary]:
    """Each layer's `LayerBoundary` in a `_FlatDecoder` of a `Decoder`."""
    module_names = {id(module): name for name, module in flat.named_modules()}
    boundaries = []
    for i, layer in enumerate(flat.model.model.layers):
        prefix = module_names[id(layer)]
        tensors = [*layer.named_parameters(), *layer.named_buffers()]
        boundaries.append(LayerBoundary(weights=tuple(f"{prefix}.{name}" for name, _ in tensors),
                                        past=(f"past_key_values.{i}.key", f"past_key_values.{i}.value"),
                                        presents=(f"present.{i}.key", f"present.{i}.value")))
    return boundaries


def _repeat_layer(graph: onnx.ModelProto, layers: Sequence[LayerBoundary], weights: set[str]) -> bool:
    """Grow a graph traced with the first `TRACED_LAYERS` of `layers` to all of them by copying
    its last layer once per missing layer, found by the graph's structure alone:

    - a layer's output is the first value every path from its own inputs (weights, past) to the
      logits goes through (the residual stream after it);
    - the last layer is what its output and presents are computed from that the layer before's
      output is not: its nodes, and any value the trace computes for it alone.

    Each copy reads the layer before's output, its own weights and past in the pattern's places,
    and writes its own presents; what comes after the layers reads the last copy's output.
    Returns False, leaving the graph as it was, where the last layer is not a pattern it can copy
    (a value of its own read outside it, or one of the layer before's inputs read inside it)."""
    last = TRACED_LAYERS - 1
    # A node that only gives a weight another name (the exporter shares equal weights that way:
    # layer norms still at ones) would join layers that are apart; it goes, and every layer reads
    # its own weights.
    nodes = [n for n in graph.graph.node if not (n.output and all(o in weights for o in n.output))]
    made_by = {o: n for n in nodes for o in n.output if o}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in nodes:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    sinks = {o.name for o in graph.graph.output} - {name for layer in layers for name in layer.presents}
    previous_out = _layer_output(nodes, readers, layers[last - 1].inputs, sinks)
    out = _layer_output(nodes, readers, layers[last].inputs, sinks)
    if previous_out is None or out is None:
        return False
    before = _ancestors([previous_out], made_by)
    pattern_ids = _ancestors([out, *layers[last].presents], made_by) - before
    pattern = [n for n in nodes if id(n) in pattern_ids]
    made = {o for n in pattern for o in n.output if o}
    leaving = {i for n in nodes if id(n) not in pattern_ids for i in n.input if i in made}
    leaving |= {o.name for o in graph.graph.output} & made
    read = {i for n in pattern for i in n.input}
    if leaving - {out, *layers[last].presents} or not set(layers[last].presents) <= made \
            or previous_out not in read or read & set(layers[last - 1].inputs):
        return False
    taken = set(made_by) | {i.name for i in graph.graph.input} | {t.name for t in graph.graph.initializer}
    copies = []
    for i in range(last + 1, len(layers)):
        renamed = {previous_out: out if i == last + 1 else f"{out}/layer{i - 1}",
                   **dict(zip(layers[last].inputs, layers[i].inputs)),
                   **dict(zip(layers[last].presents, layers[i].presents))}
        for name in made - set(renamed):
            renamed[name] = f"{name}/layer{i}"
        if taken & {renamed[name] for name in made}:
            return False  # a copy's value would take a name the graph already gives
        for node in pattern:
            copy_ = onnx.NodeProto()
            copy_.CopyFrom(node)
            copy_.name = f"{node.name}/layer{i}" if node.name else ""
            copy_.input[:] = [renamed.get(name, name) for name in node.input]  # "": an absent input
            copy_.output[:] = [renamed.get(name, name) for name in node.output]
            copies.append(copy_)
    final = f"{out}/layer{len(layers) - 1}"
    downstream_ids, reached = set(), set(made)
    for node in nodes:
        if id(node) not in pattern_ids and any(i in reached for i in node.input):
            downstream_ids.add(id(node))
            reached.update(node.output)
            node.input[:] = [final if name == out else name for name in node.input]
    upstream = [n for n in nodes if id(n) not in pattern_ids and id(n) not in downstream_ids]
    downstream = [n for n in nodes if id(n) in downstream_ids]
    types = {value.name: value.type for value in [*graph.graph.input, *graph.graph.output]}
    for i in range(last + 1, len(layers)):
        graph.graph.input.extend(onnx.ValueInfoProto(name=new, type=types[old])
                                 for old, new in zip(layers[last].past, layers[i].past))
        graph.graph.output.extend(onnx.ValueInfoProto(name=new, type=types[old]) for old, new
                                  in zip(layers[last].presents, layers[i].presents))
    del graph.graph.node[:]
    graph.graph.node.extend([*upstream, *pattern, *copies, *downstream])
    return True


def _layer_output(nodes: Sequence[onnx.NodeProto], readers: dict[str, list[onnx.NodeProto]],
                  inputs: Sequence[str], sinks: set[str]) -> str | None:
    """The first value (in the graph's topological order) that every path from `inputs` to
    `sinks` goes through: for a layer's own inputs, the hidden state it returns. None where the
    inputs reach no sink, or reach them by two ways that never meet."""
    reached = _reached(inputs, readers)
    if not reached & sinks:
        return None
    for node in nodes:
        for value in node.output:
            if value in reached and not _reached(inputs, readers, without=value) & sinks:
                return value
    return None


def _reached(starts: Sequence[str], readers: dict[str, list[onnx.NodeProto]], without: str = "") -> set[str]:
    """The values computed from `starts` (them included), not going through `without`."""
    seen, frontier = set(starts) - {without}, [s for s in starts if s != without]
    while frontier:
        for node in readers.get(frontier.pop(), ()):
            for value in node.output:
                if value and value != without and value not in seen:
                    seen.add(value)
                    frontier.append(value)
    return seen


def _ancestors(values: Sequence[str], made_by: dict[str, onnx.NodeProto]) -> set[int]:
    """The ids of the nodes `values` are computed by, directly or not."""
    found, frontier = set(), [made_by[v] for v in values if v in made_by]
    while frontier:
        node = frontier.pop()
        if id(node) not in found:
            found.add(id(node))
            frontier.extend(made_by[i] for i in node.input if i in made_by)
    return found


Initializer = tuple[onnx.TensorProto, memoryview]  # a TensorProto's header (name, type, dims) and its bytes


def _with_weights(proto: onnx.ModelProto, module: torch.nn.Module) -> tuple[bytes, list[Initializer]]:
    """The exporter's graph (its weights left as inputs named as the module's parameters),
    serialized without them, and them as initializers for it. A weight that reaches a MatMul
    through a 2-D Transpose is stored transposed in that Transpose's place: the weights reach
    their MatMuls as initializers, as the precision passes and torch.export's graphs have them."""
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in proto.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    weights, folded = [], set()
    # By the nodes that read them, unless a node makes them: the exporter gives a weight equal to
    # another (layer norms still at ones) as an Identity of it. A copied layer reads its own.
    made = {o for node in proto.graph.node for o in node.output}
    for name in [name for name in readers if name in tensors and name not in made]:
        tensor = tensors[name].detach()
        kept = False
        for node in readers.get(name, []):
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), [1, 0])
            if node.op_type == "Transpose" and tensor.dim() == 2 and perm == [1, 0]:
                weights.append(_initializer(node.output[0], tensor.t()))
                folded.add(id(node))
            else:
                kept = True
        if kept:
            weights.append(_initializer(name, tensor))
    nodes = [n for n in proto.graph.node if id(n) not in folded]
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    interface = [i for i in proto.graph.input if i.name not in tensors]
    del proto.graph.input[:]
    proto.graph.input.extend(interface)
    return proto.SerializeToString(), weights


_ONNX_TYPES = {torch.float32: onnx.TensorProto.FLOAT, torch.float16: onnx.TensorProto.FLOAT16,
               torch.bfloat16: onnx.TensorProto.BFLOAT16, torch.int64: onnx.TensorProto.INT64,
               torch.int32: onnx.TensorProto.INT32, torch.bool: onnx.TensorProto.BOOL}


def _initializer(name: str, tensor: torch.Tensor) -> Initializer:
    """A weight's TensorProto header and its bytes (bfloat16 too, which NumPy has no type for)."""
    if tensor.dtype not in _ONNX_TYPES:
        raise LlmcError(f"export: weight '{name}' has type {tensor.dtype}, which the ONNX export does not handle")
    header = onnx.TensorProto(name=name, data_type=_ONNX_TYPES[tensor.dtype], dims=list(tensor.shape))
    return header, memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


@contextlib.contextmanager
def _without_whole_graph_shape_inference():
    """Skip the TorchScript exporter's two whole-graph ONNX shape inferences: they only annotate
    value types, which `llmc compile` infers again anyway, and they copy every weight to do it
    (5.6 s of SmolLM2-135M's export). Each node's types are still inferred as it is converted,
    which is what the conversion reads; the written graph is the same to the byte (a test
    checks)."""
    whole_graph = torch._C._jit_pass_onnx_graph_shape_type_inference
    torch._C._jit_pass_onnx_graph_shape_type_inference = lambda graph, params, opset: None
    try:
        yield
    finally:
        torch._C._jit_pass_onnx_graph_shape_type_inference = whole_graph


def _to_onnx(model: torch.nn.Module, geometry: Geometry):
    """The decoder as an `onnx_ir.Model` (torch.onnx's own graph; its tensors share the model's)."""
    batch = torch.export.Dim("batch", min=1)
    seq = torch.export.Dim("sequence", min=1)
    past = torch.export.Dim("past_sequence", min=0)
    inputs = sample_inputs(geometry, _TRACE_BATCH, _TRACE_SEQ, _TRACE_PAST, seed=0)
    # The mask spans past + new tokens; torch.export infers that relation from the model's code.
    mask_len = torch.export.Dim.DYNAMIC
    # The cache tensors arrive through *past_flat, which torch.export sees as one tuple argument.
    cache_shapes = tuple({0: batch, 2: past} for _ in range(2 * geometry.num_layers))
    shapes = ({0: batch, 1: seq}, {0: batch, 1: mask_len}, {0: batch, 1: seq}, cache_shapes)
    input_names, output_names = io_names(geometry.num_layers)
    with warnings.catch_warnings(), quiet_exporter():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(_FlatDecoder(model).eval(), tuple(inputs.values()),
                                    dynamo=True, input_names=input_names,
                                    output_names=output_names, dynamic_shapes=shapes,
                                    optimize=True, verbose=False)
    graph = program.model
    _name_dynamic_dims(graph)
    return graph


def sample_inputs(geometry: Geometry, batch: int, seq: int, past: int, *, seed: int) -> dict[str, torch.Tensor]:
    """Seeded decoder inputs: random tokens, a full mask, positions after `past` cached tokens."""
    gen = torch.Generator().manual_seed(seed)
    inputs = {
        "input_ids": torch.randint(0, geometry.vocab_size, (batch, seq), generator=gen),
        "attention_mask": torch.ones(batch, past + seq, dtype=torch.int64),
        "position_ids": torch.arange(past, past + seq).expand(batch, seq).contiguous(),
    }
    cache_shape = (batch, geometry.num_kv_heads, past, geometry.head_dim)
    for i in range(geometry.num_layers):
        for part in ("key", "value"):
            inputs[f"past_key_values.{i}.{part}"] = torch.randn(cache_shape, generator=gen)
    return inputs


def check_parity(model: torch.nn.Module, onnx_model: str | os.PathLike | bytes, *,
                 weights: Sequence[Initializer] = (), batch: int = 2, seq: int = 5) -> ParityCheck:
    """Run a prefill and a decode step in onnxruntime and PyTorch; return the max abs differences.

    Args:
        model: the PyTorch model.
        onnx_model: its export: an ONNX file, or a serialized model (with its weights inline,
            or without those given as `weights`).
        weights: initializers the serialized model leaves out (as `onnx_io.save_serialized`
            takes them). They are fed as inputs from where they are: onnxruntime copies
            initializers while building a session (SmolLM2-135M's: 1.5-2.9 s), never inputs.
    """
    import onnxruntime as ort

    geometry = model_geometry(model)
    if weights:
        onnx_model = _weights_as_inputs(onnx_model, weights)
    # The graph as exported, not as onnxruntime would rewrite it.
    options = session_options(alone=True, optimize=False, once=True)
    session = ort.InferenceSession(onnx_model if isinstance(onnx_model, bytes) else str(onnx_model), options,
                                   providers=["CPUExecutionProvider"])
    fed = {header.name: _ort_value(header, data) for header, data in weights}
    prefill = sample_inputs(geometry, batch, seq, past=0, seed=1)
    diffs_prefill, presents = _compare_step(model, session, prefill, fed)
    decode = sample_inputs(geometry, batch, 1, past=seq, seed=2)
    for name, value in zip(io_names(geometry.num_layers)[0][3:], presents):
        decode[name] = torch.from_numpy(value)
    diffs_decode, _ = _compare_step(model, session, decode, fed)
    return ParityCheck(*diffs_prefill, *diffs_decode)


def _weights_as_inputs(model: bytes, weights: Sequence[Initializer]) -> bytes:
    """A serialized model without `weights`, with them declared as graph inputs."""
    proto = onnx.load_from_string(model)
    proto.graph.input.extend(onnx.helper.make_tensor_value_info(header.name, header.data_type, list(header.dims))
                             for header, _ in weights)
    return proto.SerializeToString()


def _ort_value(header: onnx.TensorProto, data: memoryview):
    """A weight as an onnxruntime value over its own bytes (bfloat16 too, which NumPy lacks)."""
    import onnxruntime as ort

    element = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(header.data_type))
    array = np.frombuffer(data, dtype=f"u{element.itemsize}" if element.kind == "V" else element)
    return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.reshape(list(header.dims)), header.data_type)


def _compare_step(model, session, inputs: dict[str, torch.Tensor], weights: dict):
    import onnxruntime as ort

    feeds = {name: ort.OrtValue.ortvalue_from_numpy(tensor.numpy()) for name, tensor in inputs.items()}
    ort_out = [value.numpy() for value in session.run_with_ort_values(None, {**feeds, **weights})]
    with torch.no_grad():
        torch_out = _FlatDecoder(model)(*inputs.values())
    diffs = [float(np.max(np.abs(o - t.numpy()), initial=0.0)) for o, t in zip(ort_out, torch_out)]
    return (diffs[0], max(diffs[1:])), ort_out[1:]


def _dynamic_axes(name: str) -> dict[int, str]:
    """The dynamic axes of an interface input or output, by name."""
    if name.startswith(("past_key_values.", "present.")):
        return {0: "batch", 2: "past_sequence" if name.startswith("past") else "total_sequence"}
    return {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "total_sequence"},
            "position_ids": {0: "batch", 1: "sequence"}, "logits": {0: "batch", 1: "sequence"}}.get(name, {})


def _name_dynamic_dims(model) -> None:
    """Give the symbolic dims of an `onnx_ir.Model` readable names (the exporter writes s0, s1 + s2, ...)."""
    import onnx_ir as ir

    for value in [*model.graph.inputs, *model.graph.outputs]:
        axes = _dynamic_axes(value.name)
        if not axes or value.shape is None:
            continue
        dims = list(value.shape)
        for axis, name in axes.items():
            # position_ids is named even where the exporter fixed a dim (as the proto version did).
            if not isinstance(dims[axis], int) or value.name == "position_ids":
                dims[axis] = ir.SymbolicDim(name)
        value.shape = ir.Shape(dims)


@contextlib.contextmanager
def quiet_exporter():
    """The dynamo exporter prints banners for every stage and logs at INFO; keep stdout clean."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)
