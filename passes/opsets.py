"""Raising a model's opset imports when a fusion emits a newer op.

The default domain is upgraded with onnx's version converter, which rewrites the ops whose
signatures changed on the way (e.g. ReduceMean's axes moving from attribute to input in 18);
other domains just get their import added or raised.
"""

from __future__ import annotations

import onnx
import onnx.version_converter

from llmc.formats.onnx_io import apply_without_weights
from llmc.errors import LlmcError
from llmc.passes.graph import DEFAULT_DOMAINS


def require_opset(model: onnx.ModelProto, version: int, domain: str = "") -> onnx.ModelProto:
    """Return `model` importing `domain` at `version` or later (the same object when possible).

    Args:
        model: the model.
        version: the lowest opset the new nodes need.
        domain: "" for the default ONNX domain, e.g. "com.microsoft" for onnxruntime's ops.
    """
    current = {("" if o.domain == "ai.onnx" else o.domain): o for o in model.opset_import}
    if domain in current and current[domain].version >= version:
        return model
    if domain != "":
        if domain in current:
            current[domain].version = version
        else:
            model.opset_import.append(onnx.helper.make_opsetid(domain, version))
        return model
    try:
        apply_without_weights(model, lambda m: onnx.version_converter.convert_version(m, version))
    except Exception as exc:  # the converter raises bare RuntimeErrors naming the op
        raise LlmcError(f"cannot upgrade the graph to opset {version}: "
                        f"{str(exc).strip().splitlines()[0][:200]}") from None
    return model


def default_opset(model: onnx.ModelProto) -> int:
    """The model's default-domain opset version (0 when it imports none)."""
    return max((o.version for o in model.opset_import if o.domain in DEFAULT_DOMAINS), default=0)
