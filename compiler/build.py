"""`llmc compile`: validate a decoder ONNX graph and package it as one engine file.

Stages: load → validate (onnx.checker, strict shape inference) → recognize the decoder interface
and geometry → optimization pipeline (compiler/pipeline.py) → backend payload → engine file,
written atomically.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable

import onnx

import llmc
from llmc.formats.decoder_interface import recognize_decoder
from llmc.compiler.engine_checks import SourceOutputs, check_against_source, check_engine_graph, unfused_attention
from llmc.formats.engine_file import write_engine
from llmc.formats.onnx_io import engine_weights, is_large, load_onnx, serialize, validate
from llmc.compiler.paged_engine import PagedOptions, lower, plan_pool
from llmc.compiler.segments import dense_attention_sections, segment_sections
from llmc.precision.gate import check_accuracy, general_text_windows
from llmc.precision.dequantize_linear import matmulnbits_as_dequantize
from llmc.precision.int8 import lower_per_token_for_onnxruntime
from llmc.precision.linears import linear_layers
from llmc.precision.plan import PrecisionOptions, apply_precision, calibration_windows, check_options
from llmc.compiler.pipeline import DEFAULT_LEVEL, optimize, refresh_shapes, resolve
from llmc.compiler.tensorrt_network import (TensorRTOptions, check_network, map_plugin_nodes, optimization_profile,
                                            standard_norms)
from llmc.errors import LlmcError
from llmc.tokenizer import Tokenizer

BACKENDS = ("onnxruntime", "tensorrt")
SINGLE_SEQUENCE_SECTION = "single_sequence.onnx"
TOKENIZER_METADATA_KEY = "llmc.tokenizer"
# TensorRT has no run-time int8 activation scales: the form its int8 engines give the layers that
# get per-token scales on the CPU (precision/int8.py OUTLIER_FORMS).
TENSORRT_OUTLIERS = "int8-weights"


def compile_model(onnx_path: str | os.PathLike, output: str | os.PathLike, *,
                  backend: str = "onnxruntime",
                  tokenizer: str | os.PathLike | None = None,
                  level: str | int | None = None, passes: Iterable[str] | None = None,
                  verify: bool = False, paged: PagedOptions | None = PagedOptions(),
                  precision: PrecisionOptions = PrecisionOptions(),
                  tensorrt: TensorRTOptions = TensorRTOptions(),
                  progress: Callable[[str], None] = lambda message: None) -> dict[str, Any]:
    """Compile a decoder-with-past ONNX file into an engine file; returns the engine's manifest.

    Args:
        onnx_path: the decoder graph (from `llmc export`, Optimum or onnxruntime-genai).
        output: the engine file to write.
        backend: the runtime that will execute the engine; one of `BACKENDS`.
        tokenizer: a tokenizer.json file or a folder holding one; by default the tokenizer
            embedded by `llmc export`, else tokenizer.json beside the ONNX file.
        level, passes, verify: the optimization pipeline, as for `llmc optimize`.
        progress: called with a short line as each long stage starts.
        paged: build a paged-KV engine with these options (the default); None keeps the
            contiguous past/present interface. A model the paged op cannot express (e.g. a
            sliding window) falls back to contiguous, with the reason in the manifest.
        precision: fp16, int8 (calibrated Q/DQ), weight-only int8/int4 and mixed precision
            (precision/plan.py); the default keeps the exported precision.
        tensorrt: the TensorRT build's options (backend "tensorrt"); with `dry_run` nothing is
            written and the returned manifest holds the check ("tensorrt_check") and profile.
    """
    onnx_path = Path(onnx_path)
    if backend not in BACKENDS:
        raise LlmcError(f"--backend: unknown backend '{backend}' (choose from {', '.join(BACKENDS)})")
    if backend == "tensorrt" and paged is None:
        raise LlmcError("--no-paged: TensorRT engines are paged (the llmc::paged_attention plugin); drop --no-paged")
    resolve(level, passes)  # a bad option fails before the model is read
    mixed = check_options(precision, backend)
    start = time.perf_counter()
    model = load_onnx(onnx_path)
    validate(model, onnx_path)
    large = is_large(model)  # past 2 GB: weights stay in external data, and stages report their time
    if large:
        progress(f"loaded and validated {onnx_path.name} in {time.perf_counter() - start:.1f} s")
    interface = recognize_decoder(model, onnx_path)
    tok = find_tokenizer(model, onnx_path, tokenizer)
    if tok.vocab_size > interface.geometry.vocab_size:
        raise LlmcError(f"tokenizer: {tok.vocab_size} tokens do not fit the model's vocabulary of "
                        f"{interface.geometry.vocab_size}")
    g = interface.geometry
    calibration, held_back = calibration_windows(precision, tok, g.vocab_size, g.max_positions)  # bad data fails early
    source_nodes = len(model.graph.node)
    source_ops = frozenset(n.op_type for n in model.graph.node)
    pool = plan_pool(paged, interface) if paged is not None else None  # bad sizes fail early
    exact = precision.is_default
    # The source's hash and the final check's reference (skipped past 2 GB, like the check), made on
    # the second core while the passes run.
    background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmc-source")
    source_outputs = SourceOutputs(model, onnx_path, background) if exact and not large else None
    source_hash = background.submit(_file_hash, onnx_path)
    background.shutdown(wait=False)
    progress(f"optimizing {source_nodes} nodes")
    model, report = optimize(model, level=level, passes=passes, verify=verify,
                             progress=progress if large else lambda message: None)  # passes take minutes past 2 GB
    precision_entry = None
    if not precision.is_default:
        float_graph = None if large or not held_back else serialize(model)["model.onnx"]
        layers = {l.name: (l.node.input[0], l.node.output[0]) for l in linear_layers(model)}
        outliers = "per-token" if backend == "onnxruntime" else TENSORRT_OUTLIERS
        precision_entry = apply_precision(model, precision, mixed, calibration, outliers=outliers, progress=progress)
        if backend == "onnxruntime":
            precision_entry["per_token_as_matmulnbits"] = lower_per_token_for_onnxruntime(model)
        refresh_shapes(model)  # the paged lowering reads ranks
        if backend == "tensorrt":
            precision_entry["weight_only_as_dequantize_linear"] = matmulnbits_as_dequantize(model, progress)
        if float_graph is not None:
            rewritten = {name: values for name, values in layers.items() if precision_entry["linears"][name] != "fp32"}
            accuracy = check_accuracy(float_graph, model, held_back, rewritten, max_ppl_increase=precision.max_ppl_increase,
                                    force=precision.force, half=_fp16_values(model),
                                    general_windows=general_text_windows(tok, g.vocab_size, g.max_positions),
                                    float_weight_products=backend == "tensorrt", progress=progress)
            precision_entry["accuracy"] = accuracy.to_dict()
        elif held_back:
            progress("accuracy not checked: the held-back comparison runs in memory, which models past 2 GB exceed")
    check_against_source(model, onnx_path, exact=exact, level=level, passes=passes,
                         source_ops=source_ops, source_outputs=source_outputs, progress=progress)
    paged_entry, not_paged, single = None, "not requested", None
    # Weight-only linear layers compute each row alone: with the padding row, speculation keeps
    # their greedy outputs exactly (passes/lower_single_sequence.py).
    weight_only = precision_entry is not None and set(precision_entry["linears"].values()) <= {"int4", "int8-weights"}
    unfused = unfused_attention(model, interface.geometry.num_layers, report)
    if unfused:
        progress(unfused)
    if paged is not None:
        if unfused:
            not_paged = unfused
        else:
            not_paged, single = lower(model, interface, paged, single_sequence=backend == "onnxruntime",
                                      pad_lone_token=weight_only)
        if not_paged is None:
            paged_entry = pool
        elif not unfused:
            progress(f"paged KV off: {not_paged}")
    check_engine_graph(model, Path(output))
    if single is not None:
        check_engine_graph(single, Path(output))
    network = _tensorrt_network(model, onnx_path, paged_entry, not_paged, tensorrt) if backend == "tensorrt" else None
    manifest = {
        "llmc_version": llmc.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "backend": backend,
        **interface.to_dict(),
        "source": {"file": onnx_path.name, "sha256": source_hash.result(), "nodes": source_nodes},
        "build_options": {"backend": backend, "level": None if passes is not None else str(DEFAULT_LEVEL if level is None else level),
                          "passes": [entry["pass"] for entry in report], "verify": verify},
        "optimization": [{k: entry[k] for k in ("pass", "matches", "nodes_after")} for entry in report],
        "precision": precision_entry,
        "paged": paged_entry,
        **({"not_paged": not_paged} if paged_entry is None else {}),
    }
    if network is not None:
        if tensorrt.dry_run:
            return {**manifest, "tensorrt_check": network}
        if network["unsupported"]:
            raise LlmcError(f"--backend tensorrt: {len(network['unsupported'])} node(s) TensorRT cannot build, nothing "
                            f"written; first: {network['unsupported'][0]} (--dry-run lists them all)")
    start, output = time.perf_counter(), Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    # The weights are streamed into the engine from where they are (the source file, this
    # process's scratch file): never all in memory, never copied to a file in between.
    if network is not None:
        from llmc.compiler.tensorrt_build import build_engine

        paged_entry["segments"] = []  # one TensorRT engine runs the whole graph
        engine, manifest["tensorrt"] = build_engine(model, network["profile"], tensorrt, progress)
        write_engine(output, manifest, {"engine.trt": engine, "tokenizer.json": tok.to_json().encode()})
        return manifest
    weights = engine_weights(model, *([single] if single is not None else []))
    if paged_entry is not None:
        paged_entry["single_sequence"] = single and SINGLE_SEQUENCE_SECTION
        paged_entry["segments"], payload = segment_sections(model)
        if single is not None:
            payload[SINGLE_SEQUENCE_SECTION] = single.SerializeToString()
        payload.update(dense_attention_sections(paged_entry["segments"], interface.geometry,
                                                paged_entry["block_size"], paged_entry["kv_dtype"]))
    else:
        payload = {"model.onnx": model.SerializeToString()}
    write_engine(output, manifest, {**payload, "model.onnx.data": weights, "tokenizer.json": tok.to_json().encode()})
    if large:
        progress(f"wrote {output.name} ({output.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - start:.1f} s")
    return manifest


def _tensorrt_network(model: onnx.ModelProto, source: Path, paged: dict[str, Any] | None, not_paged: str,
                      options: TensorRTOptions) -> dict[str, Any]:
    """Map the plugin nodes for TensorRT's parser, derive the profile and check every node: the
    manifest's view of the network a TensorRT build would parse."""
    if paged is None:
        raise LlmcError(f"{source}: a TensorRT engine needs the paged lowering, which this model cannot take ({not_paged})")
    map_plugin_nodes(model)
    standard_norms(model)
    profile = optimization_profile(model, max_batch=paged["max_batch"], max_seq_len=paged["max_seq_len"],
                                   block_size=paged["block_size"], num_blocks=paged["num_blocks"],
                                   max_num_tokens=options.max_num_tokens)
    return {**check_network(model).to_dict(), "profile": {name: [list(s) for s in shapes] for name, shapes in profile.items()},
            "options": dataclasses.asdict(options)}


def _fp16_values(model: onnx.ModelProto) -> frozenset[str]:
    """Values typed fp16 (the shapes were just inferred)."""
    return frozenset(v.name for v in model.graph.value_info if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16)


def _file_hash(path: Path) -> str:
    """SHA-256 of the ONNX file and its external data file, if any, read in chunks."""
    digest = hashlib.sha256()
    for part in (path, path.with_name(path.name + ".data")):
        if part.is_file():
            with open(part, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 24), b""):
                    digest.update(chunk)
    return digest.hexdigest()


def find_tokenizer(model: onnx.ModelProto, source: Path, explicit: str | os.PathLike | None) -> Tokenizer:
    if explicit is not None:
        path = Path(explicit)
        folder = path if path.is_dir() else path.parent
        if not (folder / "tokenizer.json").is_file():
            raise LlmcError(f"--tokenizer: no tokenizer.json at {path}")
        return Tokenizer.from_folder(folder)
    for prop in model.metadata_props:
        if prop.key == TOKENIZER_METADATA_KEY:
            return Tokenizer.from_json(prop.value)
    if (source.parent / "tokenizer.json").is_file():
        return Tokenizer.from_folder(source.parent)
    raise LlmcError(f"{source}: no tokenizer embedded and no tokenizer.json beside it; pass --tokenizer")
