"""What `llmc inspect` shows of an ONNX file: interface, op histogram, parameter count, size."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import numpy as np
import onnx

from llmc.formats.onnx_io import load_onnx


def summarize(path: str | os.PathLike) -> dict:
    """A JSON-ready summary of an ONNX model (weights are not loaded).

    Args:
        path: the .onnx file.
    """
    path = Path(path)
    model = load_onnx(path, load_weights=False)
    data_file = path.with_name(path.name + ".data")
    ops = Counter(op_name(n) for n in model.graph.node)
    return {
        "opsets": {i.domain or "ai.onnx": i.version for i in model.opset_import},
        "nodes": len(model.graph.node),
        "ops": dict(ops.most_common()),
        "parameters": int(sum(np.prod(t.dims, dtype=np.int64) for t in model.graph.initializer)),
        "bytes": path.stat().st_size + (data_file.stat().st_size if data_file.exists() else 0),
        "inputs": [_value(v) for v in model.graph.input],
        "outputs": [_value(v) for v in model.graph.output],
        "metadata": {p.key: p.value for p in model.metadata_props if p.key != "llmc.tokenizer"},
    }


def op_name(node: onnx.NodeProto) -> str:
    """The op type, qualified with its domain when that is not the default one."""
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"


def _value(value: onnx.ValueInfoProto) -> dict:
    tensor = value.type.tensor_type
    shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tensor.shape.dim]
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name if tensor.elem_type else "?"
    return {"name": value.name, "dtype": dtype, "shape": shape}
