"""Raising a model's opset imports when a fusion emits a newer op.

Going from default-domain opset 18–22 to 23 changes the semantics of no op an LLM graph uses
(opsets 21–23 add types, and GroupNormalization-21 changes its scale shape, so a graph holding
GroupNormalization is refused rather than silently reinterpreted).
"""

from __future__ import annotations

import onnx

from llmc.errors import LlmcError

_CHANGED_SEMANTICS = {"GroupNormalization": 21}


def require_opset(model: onnx.ModelProto, version: int, domain: str = "") -> None:
    """Make `model` import `domain` at `version` or later.

    Args:
        model: the model to update in place.
        version: the lowest opset the new nodes need.
        domain: "" for the default ONNX domain, e.g. "com.microsoft" for onnxruntime's ops.
    """
    for opset in model.opset_import:
        if opset.domain in (domain, "ai.onnx" if domain == "" else domain):
            if opset.version >= version:
                return
            if domain == "":
                for node in model.graph.node:
                    since = _CHANGED_SEMANTICS.get(node.op_type)
                    if node.domain in ("", "ai.onnx") and since and opset.version < since <= version:
                        raise LlmcError(f"node '{node.name}': {node.op_type} changes meaning between "
                                        f"opset {opset.version} and {version}; not upgrading")
            opset.version = version
            break
    else:
        model.opset_import.append(onnx.helper.make_opsetid(domain, version))
    if domain == "":
        needed = onnx.helper.find_min_ir_version_for([onnx.helper.make_opsetid("", version)])
        model.ir_version = max(model.ir_version, needed)
