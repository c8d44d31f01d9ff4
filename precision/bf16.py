"""`llmc compile --bf16`: allow an OpenVINO engine to compute in bf16, once its accuracy is checked.

bf16 keeps fp32's range and 8 bits of its mantissa; OpenVINO's CPU plugin computes matrix
products (and most other ops) in it where the CPU has avx512_bf16 or AMX, with bf16 weights
(half the bytes to read) and twice the peak. The check runs the compiled graph twice on the
held-back windows (--calib's, else llmc's general text): in onnxruntime at fp32, and in
OpenVINO with bf16 compute, and compares their next-token distributions as the accuracy gate
does (precision/gate.py). It has to run where bf16 is computed natively: elsewhere OpenVINO
would compute in f32 and the check would prove nothing, so it is refused there unless forced.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx
from onnx.external_data_helper import load_external_data_for_model

from llmc.errors import LlmcError
from llmc.formats.cpu_features import native_bf16
from llmc.formats.engine_file import EXTERNAL_ROOT
from llmc.precision.gate import GateReport, _compare, _session


@dataclass(frozen=True)
class _Input:
    name: str
    shape: list
    type: str


class OpenVinoSession:
    """A serialized ONNX graph compiled by OpenVINO for the CPU at `precision`, with the part of
    onnxruntime's session interface the gate uses (`get_inputs`, `run`)."""

    def __init__(self, model: onnx.ModelProto, precision: str, threads: int | None = None):
        import openvino as ov

        core = ov.Core()
        config = {"INFERENCE_PRECISION_HINT": precision, "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1}
        if threads:
            config["INFERENCE_NUM_THREADS"] = threads
        self.compiled = core.compile_model(core.read_model(io.BytesIO(model.SerializeToString())), "CPU", config)
        self.request = self.compiled.create_infer_request()
        self._inputs = [_Input(port.get_any_name(), [d.get_length() if d.is_static else None
                                                     for d in port.get_partial_shape()],
                               "tensor(float16)" if port.get_element_type() == ov.Type.f16 else "tensor(float)")
                        for port in self.compiled.inputs]

    def get_inputs(self) -> list[_Input]:
        return self._inputs

    def run(self, names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        results = self.request.infer(feeds)
        by_name = {name: value for port, value in results.items() for name in port.get_names()}
        return [np.array(by_name[name]) for name in names]


def check_bf16(graph: bytes, windows: list[np.ndarray], *, max_ppl_increase: float, force: bool,
               flags: frozenset[str], progress: Callable[[str], None] = lambda message: None) -> GateReport | None:
    """Compare `graph` (`onnx_io.serialize`'s bytes: weights referenced from `EXTERNAL_ROOT`) at
    fp32 in onnxruntime and in bf16 in OpenVINO on `windows`; raise past `max_ppl_increase`
    percent unless `force`. None when the check cannot run here and `force` allows bf16 unchecked."""
    try:
        import openvino  # noqa: F401
    except ImportError as error:
        raise LlmcError("--bf16: checking bf16 compute needs OpenVINO: pip install 'llmc[openvino]'") from error
    if not native_bf16(flags):
        message = ("--bf16: this CPU has neither avx512_bf16 nor AMX, where OpenVINO would compute in f32, so bf16's "
                   "accuracy cannot be checked here")
        if not force:
            raise LlmcError(f"{message}; compile on the machine that serves, or --force to allow it unchecked")
        progress(f"warning: {message}; allowed unchecked (--force)")
        return None
    if not windows:
        raise LlmcError("--bf16: no text to check the accuracy on (give --calib DIR)")
    reference = _session(graph, optimized=False)
    loaded = onnx.load_from_string(graph)
    load_external_data_for_model(loaded, EXTERNAL_ROOT)  # OpenVINO reads the weights from memory
    tokens, (ppl_ref, ppl, increase), top1, kl = _compare(reference, OpenVinoSession(loaded, "bf16"), windows, None)
    passed = increase <= max_ppl_increase
    report = GateReport(tokens, ppl_ref, ppl, increase, top1, kl, max_ppl_increase, passed, force and not passed, None)
    progress(f"bf16 compute on {tokens} tokens: perplexity {increase:+.2f}% (limit {max_ppl_increase:g}%), "
             f"top-1 agreement {top1:.3f}")
    if not passed:
        message = (f"--bf16: perplexity {increase:+.1f}% on {tokens} tokens in bf16 compute exceeds "
                   f"--max-ppl-increase {max_ppl_increase:g}%")
        if not force:
            raise LlmcError(f"{message} (compile without --bf16, or --force to allow it anyway)")
        progress(f"warning: {message}; allowed anyway (--force)")
    return report
