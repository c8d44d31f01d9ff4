"""`llmc compile`: validate a decoder ONNX graph and package it as one engine file.

Stages: load → validate (onnx.checker, strict shape inference) → recognize the decoder interface
and geometry → optimization pipeline (compiler/pipeline.py) → precision → paged lowering →
backend payload → engine file, written atomically. What differs by backend comes from its
compile target (compiler/targets.py).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import onnx

import llmc
from llmc.formats.decoder_interface import recognize_decoder
from llmc.compiler.engine_checks import SourceOutputs, check_against_source, check_engine_graph, unfused_attention
from llmc.formats.engine_file import file_sha256, write_engine
from llmc.formats.manifest import build_record
from llmc.formats.onnx_io import is_large, load_onnx, serialize, validate
from llmc.compiler.paged_engine import PagedOptions, lower, plan_pool
from llmc.compiler.targets import CompileTarget, find_target
from llmc.precision.gate import check_accuracy, general_text_windows
from llmc.precision.linears import linear_layers
from llmc.precision.plan import PrecisionOptions, apply_precision, calibration_windows, check_options
from llmc.compiler.pipeline import DEFAULT_LEVEL, PIPELINES, optimize, resolve
from llmc.compiler.tensorrt_network import TensorRTOptions
from llmc.errors import LlmcError
from llmc.tokenizer import Tokenizer

TOKENIZER_METADATA_KEY = "llmc.tokenizer"


@dataclass(frozen=True)
class CompileResult(Mapping):
    """What `compile_model` built. Read as a mapping it is the engine's manifest (with
    "tensorrt_check" on a TensorRT dry run), as written into the engine file.

    Args:
        manifest: the engine's manifest.
        engine: the engine file written; None on a dry run, which writes nothing.
        tensorrt_check: a TensorRT build's check of every node and its profile (dry run or not).
        seconds: the build's wall time.
        warnings: the build's warnings, as progress reported them.
    """

    manifest: dict[str, Any]
    engine: Path | None
    tensorrt_check: dict[str, Any] | None = None
    seconds: float = 0.0
    warnings: tuple[str, ...] = ()

    def _view(self) -> dict[str, Any]:
        return self.manifest if self.engine is not None else {**self.manifest, "tensorrt_check": self.tensorrt_check}

    def __getitem__(self, key: str) -> Any:
        return self._view()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._view())

    def __len__(self) -> int:
        return len(self._view())

    def summary(self) -> dict[str, Any]:
        """`llmc compile --json`: what a CI job records of a build (the engine's hash included)."""
        if self.engine is None:
            raise LlmcError("a dry run wrote no engine to summarize")
        return {"engine": str(self.engine), "sha256": file_sha256(self.engine), "bytes": self.engine.stat().st_size,
                **build_record(self.manifest), "build_s": round(self.seconds, 2), "warnings": list(self.warnings)}


def compile_model(onnx_path: str | os.PathLike, output: str | os.PathLike, *,
                  backend: str = "onnxruntime",
                  tokenizer: str | os.PathLike | None = None,
                  level: str | int | None = None, passes: Iterable[str] | None = None,
                  verify: bool = False, paged: PagedOptions | None = PagedOptions(),
                  precision: PrecisionOptions = PrecisionOptions(),
                  tensorrt: TensorRTOptions = TensorRTOptions(), bf16: bool = False,
                  progress: Callable[[str], None] = lambda message: None) -> CompileResult:
    """Compile a decoder-with-past ONNX file into an engine file.

    Args:
        onnx_path: the decoder graph (from `llmc export`, Optimum or onnxruntime-genai).
        output: the engine file to write.
        backend: the runtime that will execute the engine; one of `BACKENDS` (compiler/targets.py).
        tokenizer: a tokenizer.json file or a folder holding one; by default the tokenizer
            embedded by `llmc export`, else tokenizer.json beside the ONNX file.
        level, passes, verify: the optimization pipeline, as for `llmc optimize`.
        progress: called with a short line as each long stage starts; lines starting with
            "warning:" are also kept in the result's `warnings`.
        paged: build a paged-KV engine with these options (the default); None keeps the
            contiguous past/present interface. A model the paged op cannot express (e.g. a
            sliding window) falls back to contiguous, with the reason in the manifest.
        precision: fp16, int8 (calibrated Q/DQ), weight-only int8/int4 and mixed precision
            (precision/plan.py); the default keeps the exported precision.
        tensorrt: the TensorRT build's options (backend "tensorrt"); with `dry_run` nothing is
            written and the result holds the check ("tensorrt_check") and profile.
        bf16: allow bf16 compute (backend "openvino", on CPUs with avx512_bf16 or AMX) once
            precision/bf16.py's check passes on this machine.
    """
    start = time.perf_counter()
    warnings: list[str] = []

    def report_progress(message: str) -> None:
        if message.startswith("warning:"):
            warnings.append(message[len("warning:"):].strip())
        progress(message)

    manifest, network, written = _compile(Path(onnx_path), Path(output), find_target(backend), tokenizer, level,
                                          passes, verify, paged, precision, tensorrt, bf16, report_progress)
    return CompileResult(manifest, Path(output) if written else None, network, time.perf_counter() - start,
                         tuple(warnings))


def _check_bf16(model, precision: PrecisionOptions, held_back, tok, g, large: bool, progress) -> dict | None:
    """precision/bf16.py's check of `model` on the held-back windows (else llmc's general text);
    its report, or None where it could not run and --force allowed bf16 unchecked."""
    from llmc.precision.bf16 import check_bf16
    from llmc.formats.cpu_features import cpu_flags

    if large:
        if not precision.force:
            raise LlmcError("--bf16: the accuracy check runs in memory, which models past 2 GB exceed; --force to "
                            "allow bf16 unchecked")
        progress("warning: --bf16 allowed unchecked (--force): the check runs in memory, which models past 2 GB exceed")
        return None
    windows = held_back or general_text_windows(tok, g.vocab_size, g.max_positions)
    report = check_bf16(serialize(model)["model.onnx"], windows, max_ppl_increase=precision.max_ppl_increase,
                        force=precision.force, flags=cpu_flags(), progress=progress)
    return None if report is None else report.to_dict()


def _compile(onnx_path: Path, output: Path, target: CompileTarget, tokenizer, level, passes, verify, paged: PagedOptions | None,
             precision: PrecisionOptions, tensorrt: TensorRTOptions, bf16: bool,
             progress: Callable[[str], None]) -> tuple[dict[str, Any], dict[str, Any] | None, bool]:
    """(manifest, the TensorRT check or None, whether the engine was written)."""
    target.check(paged, tensorrt)
    if bf16 and not target.computes_bf16:
        raise LlmcError(f"--bf16: only for --backend openvino (--backend {target.name} has no bf16 compute)")
    if bf16 and precision.fp16:
        raise LlmcError("--bf16 and --fp16: each sets the compute precision; give one")
    if bf16 and paged is not None and paged.kv_dtype == "float16":
        # OpenVINO 2026.4 keeps the cache of a bf16-compute model in bf16, whatever it is asked for
        raise LlmcError("--bf16 and --kv-cache-dtype fp16: under bf16 compute the cache is bf16 (as many bytes as "
                        "fp16); give one")
    if paged is not None and paged.block_size is None:
        paged = dataclasses.replace(paged, block_size=target.block_size)
    resolve(level, passes)  # a bad option fails before the model is read
    named_level = None if passes is not None else str(DEFAULT_LEVEL if level is None else level)
    if named_level is not None and target.skipped_passes:
        passes = [name for name in PIPELINES[named_level] if name not in target.skipped_passes]
    mixed = check_options(precision, target.name)
    if precision.weights_block_size is None and not precision.is_default:
        precision = dataclasses.replace(precision, weights_block_size=target.weights_block_size)
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
        precision_entry = apply_precision(model, precision, mixed, calibration, outliers=target.outliers,
                                          progress=progress)
        precision_entry.update(target.lower_precision(model, progress))
        if float_graph is not None:
            rewritten = {name: values for name, values in layers.items() if precision_entry["linears"][name] != "fp32"}
            accuracy = check_accuracy(float_graph, model, held_back, rewritten, max_ppl_increase=precision.max_ppl_increase,
                                      force=precision.force, half=_fp16_values(model),
                                      general_windows=general_text_windows(tok, g.vocab_size, g.max_positions),
                                      float_weight_products=target.float_weight_products, progress=progress)
            precision_entry["accuracy"] = accuracy.to_dict()
        elif held_back:
            progress("accuracy not checked: the held-back comparison runs in memory, which models past 2 GB exceed")
    bf16_accuracy = _check_bf16(model, precision, held_back, tok, g, large, progress) if bf16 else None
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
            not_paged, single = lower(model, interface, paged, single_sequence=target.single_sequence,
                                      pad_lone_token=weight_only)
        if not_paged is None:
            paged_entry = pool
        elif not unfused:
            progress(f"paged KV off: {not_paged}")
    check_engine_graph(model, output)
    if single is not None:
        check_engine_graph(single, output)
    network = target.network(model, onnx_path, paged_entry, not_paged, tensorrt)
    manifest = {
        "llmc_version": llmc.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "backend": target.name,
        **interface.to_dict(),
        "source": {"file": onnx_path.name, "sha256": source_hash.result(), "nodes": source_nodes},
        "build_options": {"backend": target.name,
                          "level": named_level,
                          "passes": [entry["pass"] for entry in report], "verify": verify,
                          **({"compute": "bf16", "bf16_accuracy": bf16_accuracy} if bf16 else {})},
        "optimization": [{k: entry[k] for k in ("pass", "matches", "nodes_after")} for entry in report],
        "precision": precision_entry,
        "paged": paged_entry,
        **({"not_paged": not_paged} if paged_entry is None else {}),
    }
    if network is not None:
        if tensorrt.dry_run:
            return manifest, network, False
        if network["unsupported"]:
            raise LlmcError(f"--backend {target.name}: {len(network['unsupported'])} node(s) TensorRT cannot build, "
                            f"nothing written; first: {network['unsupported'][0]} (--dry-run lists them all)")
    start = time.perf_counter()
    output.parent.mkdir(parents=True, exist_ok=True)
    # The weights are streamed into the engine from where they are (the source file, this
    # process's scratch file): never all in memory, never copied to a file in between.
    payload = target.payload(model, single, paged_entry, interface.geometry, network, manifest, tensorrt, progress)
    write_engine(output, manifest, {**payload, "tokenizer.json": tok.to_json().encode()})
    if large:
        progress(f"wrote {output.name} ({output.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - start:.1f} s")
    return manifest, network, True


def _fp16_values(model: onnx.ModelProto) -> frozenset[str]:
    """Values typed fp16 (the shapes were just inferred)."""
    return frozenset(v.name for v in model.graph.value_info if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16)


def _file_hash(path: Path) -> str:
    """SHA-256 of the ONNX file and its external data file, if any."""
    return file_sha256(*(part for part in (path, path.with_name(path.name + ".data")) if part.is_file()))


def find_tokenizer(model: onnx.ModelProto, source: Path, explicit: str | os.PathLike | None) -> Tokenizer:
    """The tokenizer `explicit` names, else the one `llmc export` embedded, else tokenizer.json
    beside `source`."""
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
