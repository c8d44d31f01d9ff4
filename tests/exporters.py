"""Test fixture factory: decoder-with-past ONNX graphs of HF checkpoints, from the exporters users use.

The graph-optimization passes must recognize what real exporters write, not only what `llmc export`
writes. `export_decoder` turns a checkpoint folder from `hf_checkpoints.write_hf_checkpoint` into an
ONNX decoder with past through one of:

- ``llmc``: `llmc.compiler.export.export` (llmc's own PyTorch models, dynamo exporter).
- ``dynamo``: the transformers model itself through `torch.onnx.export(..., dynamo=True)`, the
  default exporter of torch >= 2.9.
- ``torchscript``: the same transformers model through the TorchScript exporter
  (`torch.onnx.export(..., dynamo=False, opset_version=17, dynamic_axes=...)`), as Optimum uses.
- ``optimum``: Optimum itself (`main_export(task="text-generation-with-past")`, what
  `optimum-cli export onnx --task text-generation-with-past` runs), from a venv of its own because
  optimum-onnx pins transformers < 4.58 (tests/optimum_venv.py; tests/README.md). Its graph is
  transformers 4.57's sdpa attention through the TorchScript exporter at opset 18.

All three write the same interface: inputs ``input_ids``, ``attention_mask``, ``position_ids``,
``past_key_values.{i}.key|value`` [batch, kv_heads, past, head_dim]; outputs ``logits`` and
``present.{i}.key|value`` [batch, kv_heads, past + sequence, head_dim] (the whole cache, also for
Mistral's sliding window: the window is applied by the attention mask). Batch, sequence and past are
dynamic (past may be 0). Weights are inline; the ``llmc.num_heads`` / ``llmc.max_positions`` (and,
for windowed models, ``llmc.sliding_window``) metadata and the embedded tokenizer (``llmc.tokenizer``, from the folder's tokenizer.json) let `llmc compile`
take the file alone, with no config.json or tokenizer.json beside it.

`tests/EXPORTER_PATTERNS.md` describes the op patterns each (family, exporter) graph holds.

Import it as `from exporters import EXPORTERS, export_decoder` (tests/conftest.py puts `tests/` on
sys.path).
"""

from __future__ import annotations

import io
import subprocess
import tempfile
import warnings
from pathlib import Path

import onnx
import torch
import transformers
from transformers.cache_utils import DynamicCache

from llmc.compiler.build import TOKENIZER_METADATA_KEY
from llmc.formats.decoder_interface import Geometry, config_windows, geometry_metadata
from llmc.compiler.export import io_names, quiet_exporter
from llmc.formats.onnx_io import save_onnx
from llmc.models.transformers_module import FullLengthCacheLayer
from llmc.tokenizer import Tokenizer
# ExporterUnavailable: callers catch it from here.
from optimum_venv import ExporterUnavailable, optimum_python  # noqa: F401

EXPORTERS = ("llmc", "dynamo", "torchscript", "optimum")
# The same Optimum export through the command the README names, for the real-shape matrix
# (tests/compiler/test_real_shape_exports.py); it writes what ``optimum`` writes.
OPTIMUM_CLI = "optimum-cli"

_OPTIMUM_SCRIPT = Path(__file__).with_name("optimum_export.py")

# Example sizes for tracing: 0 and 1 would be specialized (torch.export) or baked in, so use larger.
_TRACE_BATCH, _TRACE_SEQ, _TRACE_PAST = 2, 3, 4
_TORCHSCRIPT_OPSET = 17


def export_decoder(folder: Path, exporter: str, output: Path, *, attention: str = "eager") -> Path:
    """Export the checkpoint in `folder` to an ONNX decoder with past at `output`; return `output`.

    Args:
        folder: a Hugging Face checkpoint folder (e.g. from `write_hf_checkpoint`).
        exporter: one of EXPORTERS.
        output: the .onnx file to write; its folder is created if missing.
        attention: the transformers attention implementation for the ``dynamo`` and
            ``torchscript`` exporters ("eager" or "sdpa"); ignored by ``llmc`` and ``optimum``
            (which exports transformers' default, sdpa).

    Raises:
        ExporterUnavailable: the ``optimum`` venv cannot be built here (tests skip on it).
    """
    folder, output = Path(folder), Path(output)
    if exporter not in (*EXPORTERS, OPTIMUM_CLI):
        raise ValueError(f"unknown exporter {exporter!r} (known: {', '.join(EXPORTERS)}, {OPTIMUM_CLI})")
    output.parent.mkdir(parents=True, exist_ok=True)
    if exporter == "llmc":
        from llmc.compiler.export import export

        export(str(folder), output, check=False)
        return output

    if exporter in ("optimum", OPTIMUM_CLI):
        config = transformers.AutoConfig.from_pretrained(folder)
        geometry = hf_geometry(config)
        proto = _export_optimum(folder, output.parent, cli=exporter == OPTIMUM_CLI)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, attn_implementation=attention, dtype=torch.float32).eval()
        config = model.config
        geometry = hf_geometry(config)
        wrapper = FlatCacheDecoder(model).eval()
        example = _example_inputs(geometry)
        with warnings.catch_warnings(), quiet_exporter(), torch.no_grad():
            warnings.simplefilter("ignore")
            if exporter == "dynamo":
                proto = _export_dynamo(wrapper, example, geometry)
            else:
                proto = _export_torchscript(wrapper, example, geometry)
    props = {p.key: p.value for p in proto.metadata_props}
    props.update(geometry_metadata(geometry, hf_windows(config)))
    props["llmc.source_model"] = f"{folder.name} ({exporter} exporter, {attention} attention)"
    if (folder / "tokenizer.json").is_file():
        props[TOKENIZER_METADATA_KEY] = Tokenizer.from_folder(folder).to_json()
    onnx.helper.set_model_props(proto, props)
    save_onnx(proto, output)
    return output


class FlatCacheDecoder(torch.nn.Module):
    """A transformers causal LM with the flat-tensor decoder-with-past signature.

    forward(input_ids, attention_mask, position_ids, *flat_past) builds a transformers 5
    `DynamicCache` of full (non-sliding) layers from the past tensors, runs the model with
    use_cache=True and returns (logits, *flat_present).
    """

    def __init__(self, model: transformers.PreTrainedModel):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, *flat_past):
        cache = DynamicCache()
        cache.layers = [FullLengthCacheLayer(k, v) for k, v in zip(flat_past[0::2], flat_past[1::2])]
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, cache=cache, use_cache=True)
        presents = [t for layer in out.cache.layers for t in (layer.keys, layer.values)]
        return (out.logits, *presents)


def hf_geometry(config: transformers.PreTrainedConfig) -> Geometry:
    """The decoder geometry of a transformers config (Llama-like or GPT-2)."""
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    return Geometry(
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or hidden // heads,
        vocab_size=config.vocab_size,
        max_positions=getattr(config, "max_position_embeddings", None) or config.n_positions,
    )


def hf_windows(config: transformers.PreTrainedConfig) -> list[int] | None:
    """Each layer's attention window (0: full), read from the config as `llmc compile` reads a
    config.json beside a graph; None when no layer is windowed."""
    return config_windows(config.to_dict())


def _export_optimum(folder: Path, workspace: Path, cli: bool) -> onnx.ModelProto:
    """Optimum's export of `folder` (`main_export`, or `optimum-cli` with `cli`), run in the
    Optimum venv, loaded with its weights."""
    python = optimum_python()
    with tempfile.TemporaryDirectory(prefix="optimum-", dir=workspace) as scratch:
        out = Path(scratch) / "out"
        run = subprocess.run([str(python), str(_OPTIMUM_SCRIPT), str(folder), str(out), *(["--cli"] if cli else [])],
                             capture_output=True, text=True, timeout=900)
        if run.returncode:
            raise RuntimeError(f"Optimum export of {folder} failed:\n{run.stderr[-3000:]}")
        return onnx.load(str(out / "model.onnx"))


def _example_inputs(geometry: Geometry) -> tuple[torch.Tensor, ...]:
    batch, seq, past = _TRACE_BATCH, _TRACE_SEQ, _TRACE_PAST
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, geometry.vocab_size, (batch, seq), generator=gen)
    mask = torch.ones(batch, past + seq, dtype=torch.int64)
    positions = torch.arange(past, past + seq).expand(batch, seq).contiguous()
    cache_shape = (batch, geometry.num_kv_heads, past, geometry.head_dim)
    flat = [torch.randn(cache_shape, generator=gen) for _ in range(2 * geometry.num_layers)]
    return (ids, mask, positions, *flat)


def _export_dynamo(wrapper: torch.nn.Module, example: tuple, geometry: Geometry) -> onnx.ModelProto:
    batch = torch.export.Dim("batch", min=1)
    seq = torch.export.Dim("sequence", min=1)
    past = torch.export.Dim("past_sequence", min=0)
    cache = tuple({0: batch, 2: past} for _ in range(2 * geometry.num_layers))
    shapes = ({0: batch, 1: seq}, {0: batch, 1: torch.export.Dim.DYNAMIC}, {0: batch, 1: seq}, cache)
    inputs, outputs = io_names(geometry.num_layers)
    program = torch.onnx.export(wrapper, example, dynamo=True, input_names=inputs,
                                output_names=outputs, dynamic_shapes=shapes, optimize=True,
                                verbose=False)
    proto = program.model_proto
    _name_dynamic_dims(proto)
    return proto


def _export_torchscript(wrapper: torch.nn.Module, example: tuple, geometry: Geometry) -> onnx.ModelProto:
    inputs, outputs = io_names(geometry.num_layers)
    axes = {"input_ids": {0: "batch", 1: "sequence"},
            "attention_mask": {0: "batch", 1: "total_sequence"},
            "position_ids": {0: "batch", 1: "sequence"},
            "logits": {0: "batch", 1: "sequence"}}
    axes.update({name: {0: "batch", 2: "past_sequence"} for name in inputs[3:]})
    axes.update({name: {0: "batch", 2: "total_sequence"} for name in outputs[1:]})
    buffer = io.BytesIO()
    torch.onnx.export(wrapper, example, buffer, dynamo=False, opset_version=_TORCHSCRIPT_OPSET,
                      input_names=inputs, output_names=outputs, dynamic_axes=axes,
                      do_constant_folding=True)
    return onnx.load_from_string(buffer.getvalue())


def _name_dynamic_dims(proto: onnx.ModelProto) -> None:
    """Name the symbolic dims of the interface as the TorchScript export names them."""
    names = {"input_ids": {0: "batch", 1: "sequence"}, "position_ids": {0: "batch", 1: "sequence"},
             "attention_mask": {0: "batch", 1: "total_sequence"},
             "logits": {0: "batch", 1: "sequence"}}
    for value in list(proto.graph.input) + list(proto.graph.output):
        axes = names.get(value.name)
        if axes is None and value.name.startswith("past_key_values."):
            axes = {0: "batch", 2: "past_sequence"}
        elif axes is None and value.name.startswith("present."):
            axes = {0: "batch", 2: "total_sequence"}
        for axis, name in (axes or {}).items():
            dim = value.type.tensor_type.shape.dim[axis]
            if not dim.HasField("dim_value"):
                dim.dim_param = name
