"""fuse-attention: decomposed attention from either exporter → one Attention-23 node."""

import io
import math
import warnings

import onnx
import pytest
import torch
from pass_testing import export_module, op_counts, run_pass

from llmc.compiler.compare import compare_outputs, run_onnx
from llmc.compiler.pipeline import refresh_shapes
from llmc.passes.fuse_attention import FuseAttention

B, H, S, P, D = 2, 4, 3, 5, 16


class DecomposedAttention(torch.nn.Module):
    """Attention over a cache, spelled the ways exporters write it."""

    def __init__(self, kv_heads: int, mask: str, scale: str):
        super().__init__()
        self.kv_heads, self.mask, self.scale = kv_heads, mask, scale

    def forward(self, q, k_new, v_new, past_k, past_v, keep):
        k = torch.cat([past_k, k_new], dim=2)
        v = torch.cat([past_v, v_new], dim=2)
        groups = H // self.kv_heads
        k_rep, v_rep = k, v
        if groups > 1:
            b, kv, t, d = k.shape
            k_rep = k[:, :, None].expand(b, kv, groups, t, d).reshape(b, kv * groups, t, d)
            v_rep = v[:, :, None].expand(b, kv, groups, t, d).reshape(b, kv * groups, t, d)
        scores = q @ k_rep.transpose(2, 3)
        scores = scores * (D ** -0.5) if self.scale == "mul" else scores / math.sqrt(D)
        if self.mask == "where":
            scores = torch.where(keep, scores, torch.finfo(torch.float32).min)
        else:
            scores = scores + (1.0 - keep.float()) * -10000.0
        probs = torch.softmax(scores, dim=-1)
        return probs @ v_rep, k, v


def inputs(kv_heads):
    gen = torch.Generator().manual_seed(0)
    keep = torch.ones(B, 1, S, P + S, dtype=torch.bool).tril(P)
    keep[0, ..., :2] = False  # left padding in the first row
    return (torch.randn(B, H, S, D, generator=gen), torch.randn(B, kv_heads, S, D, generator=gen),
            torch.randn(B, kv_heads, S, D, generator=gen), torch.randn(B, kv_heads, P, D, generator=gen),
            torch.randn(B, kv_heads, P, D, generator=gen), keep)


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
@pytest.mark.parametrize("kv_heads,mask,scale", [(4, "where", "mul"), (2, "where", "div"),
                                                 (1, "add", "mul"), (2, "add", "div")])
def test_fuses_every_spelling(dynamo, kv_heads, mask, scale):
    model = export_module(DecomposedAttention(kv_heads, mask, scale), inputs(kv_heads), dynamo=dynamo)
    refresh_shapes(model)
    result = run_pass(FuseAttention(), model, tolerance=1e-5)
    assert result.matches == 1
    counts = op_counts(result.model)
    assert counts["Attention"] == 1 and counts["Softmax"] == 0 and counts["MatMul"] == 0
    (attention,) = [n for n in result.model.graph.node if n.op_type == "Attention"]
    graph_inputs = [i.name for i in result.model.graph.input]
    assert list(attention.input[4:]) == graph_inputs[3:5]  # past key and value straight from the inputs
    assert list(attention.output[1:]) == [o.name for o in result.model.graph.output][1:]
    scale_attr = next(a.f for a in attention.attribute if a.name == "scale")
    assert scale_attr == pytest.approx(D ** -0.5, rel=1e-6)
    assert max(o.version for o in result.model.opset_import if o.domain in ("", "ai.onnx")) == 23


def test_probabilities_read_elsewhere_block_the_fusion():
    class Leaky(DecomposedAttention):
        def forward(self, q, k_new, v_new, past_k, past_v, keep):
            k = torch.cat([past_k, k_new], 2)
            v = torch.cat([past_v, v_new], 2)
            probs = torch.softmax(torch.where(keep, q @ k.transpose(2, 3) * 0.25, -1e9), -1)
            return probs @ v, k, v, probs

    model = export_module(Leaky(4, "where", "mul"), inputs(4), dynamo=False)
    refresh_shapes(model)
    result = run_pass(FuseAttention(), model)
    assert result.matches == 0 and op_counts(result.model)["Softmax"] == 1


def test_not_a_mask_fill_value_is_refused():
    class MildMask(DecomposedAttention):
        def forward(self, q, k_new, v_new, past_k, past_v, keep):
            k = torch.cat([past_k, k_new], 2)
            v = torch.cat([past_v, v_new], 2)
            scores = torch.where(keep, q @ k.transpose(2, 3) * 0.25, -5.0)  # -5 does not mask
            return torch.softmax(scores, -1) @ v, k, v

    model = export_module(MildMask(4, "where", "mul"), inputs(4), dynamo=False)
    refresh_shapes(model)
    result = run_pass(FuseAttention(), model)
    assert result.matches == 0 and op_counts(result.model)["Attention"] == 0


def test_softmax_over_another_axis_is_refused():
    class WrongAxis(DecomposedAttention):
        def forward(self, q, k_new, v_new, past_k, past_v, keep):
            k = torch.cat([past_k, k_new], 2)
            v = torch.cat([past_v, v_new], 2)
            return torch.softmax(q @ k.transpose(2, 3) * 0.25, 2) @ v, k, v

    model = export_module(WrongAxis(4, "where", "mul"), inputs(4), dynamo=False)
    refresh_shapes(model)
    assert run_pass(FuseAttention(), model).matches == 0


class SoftCapped(DecomposedAttention):
    """Gemma-2's attention: scores soft-capped, cap · tanh(scores / cap), before the mask."""

    def __init__(self, cap: float, outer: float | None = None):
        super().__init__(2, "where", "mul")
        self.cap, self.outer = cap, cap if outer is None else outer

    def forward(self, q, k_new, v_new, past_k, past_v, keep):
        k = torch.cat([past_k, k_new], dim=2)
        v = torch.cat([past_v, v_new], dim=2)
        k_rep, v_rep = (x.repeat_interleave(2, dim=1) for x in (k, v))
        scores = torch.tanh(q @ k_rep.transpose(2, 3) * (D ** -0.5) / self.cap) * self.outer
        probs = torch.softmax(torch.where(keep, scores, torch.finfo(torch.float32).min), dim=-1)
        return probs @ v_rep, k, v


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_soft_capping_becomes_the_softcap_attribute(dynamo):
    model = export_module(SoftCapped(0.5), inputs(2), dynamo=dynamo)
    refresh_shapes(model)
    result = run_pass(FuseAttention(), model, tolerance=1e-5)
    assert result.matches == 1 and op_counts(result.model)["Tanh"] == 0
    (attention,) = [n for n in result.model.graph.node if n.op_type == "Attention"]
    attributes = {a.name: a.f for a in attention.attribute}
    assert attributes["softcap"] == pytest.approx(0.5) and attributes["scale"] == pytest.approx(D ** -0.5)


def test_tanh_with_two_different_constants_is_not_a_softcap():
    model = export_module(SoftCapped(0.5, outer=3.0), inputs(2), dynamo=False)
    refresh_shapes(model)
    result = run_pass(FuseAttention(), model)
    assert result.matches == 0 and op_counts(result.model)["Tanh"] == 1


class MaskSlicedByKeyLength(DecomposedAttention):
    """transformers 4.x sdpa (Optimum's exports): the mask is cut to Shape(repeated K)[-2] columns,
    so a value outside the match is computed from an intermediate the fusion removes."""

    def forward(self, q, k_new, v_new, past_k, past_v, keep):
        k = torch.cat([past_k, k_new], dim=2)
        v = torch.cat([past_v, v_new], dim=2)
        k_rep, v_rep = (x[:, :, None].expand(B, 2, 2, x.shape[2], D).reshape(B, H, x.shape[2], D)
                        for x in (k, v))
        additive = torch.where(keep, 0.0, float("-inf"))[:, :, :, : k_rep.shape[-2]]
        probs = torch.softmax(q @ k_rep.transpose(2, 3) * (D ** -0.5) + additive, dim=-1)
        return probs @ v_rep, k, v


def test_mask_sliced_by_the_repeated_key_length_still_fuses():
    wide = inputs(2)[:-1] + (torch.ones(B, 1, S, P + S + 3, dtype=torch.bool).tril(P),)
    names = ["q", "k", "v", "past_k", "past_v", "keep"]
    axes = {"past_k": {2: "past"}, "past_v": {2: "past"}, "keep": {3: "mask_length"}}
    buffer = io.BytesIO()  # the past length dynamic, so Shape(repeated K) stays in the graph
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(MaskSlicedByKeyLength(2, "add", "mul").eval(), wide, buffer, dynamo=False,
                          input_names=names, dynamic_axes=axes, opset_version=17)
    model = onnx.load_from_string(buffer.getvalue())
    refresh_shapes(model)
    assert any(n.op_type == "Shape" and n.input[0] in {m.output[0] for m in model.graph.node
                                                       if m.op_type == "Reshape"} for n in model.graph.node)
    feeds = {name: value.numpy() for name, value in zip(names, wide)}
    want = run_onnx(model, feeds)
    result = FuseAttention().run(model)
    assert result.matches == 1 and result.skipped == {}
    counts = op_counts(result.model)
    assert counts["Attention"] == 1 and counts["Softmax"] == 0 and counts["Expand"] == 0
    onnx.checker.check_model(result.model, full_check=True)
    assert compare_outputs(want, run_onnx(result.model, feeds)).max_abs <= 1e-5
