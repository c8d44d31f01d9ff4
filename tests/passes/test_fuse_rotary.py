"""fuse-rotary: rotate-half rotary embedding → one RotaryEmbedding-23 node."""

import pytest
import torch
from pass_testing import export_module, op_counts, run_pass

from llmc.compiler.pipeline import refresh_shapes
from llmc.passes.fuse_rotary import FuseRotary

B, H, S, D = 2, 4, 6, 16


def rotate_half(x):
    return torch.cat((-x[..., D // 2:], x[..., : D // 2]), dim=-1)


class ComputedRotary(torch.nn.Module):
    """As llmc's and Hugging Face's Llama compute it: cos/sin from position_ids · inv_freq."""

    def __init__(self, scaling: float = 1.0):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D))
        self.scaling = scaling

    def forward(self, q, k, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = (emb.cos() * self.scaling)[:, None], (emb.sin() * self.scaling)[:, None]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class CachedRotary(torch.nn.Module):
    """As older exports write it: cos/sin gathered from precomputed caches."""

    def __init__(self, duplicated: bool = True):
        super().__init__()
        angles = torch.arange(64).float()[:, None] * torch.rand(D // 2, generator=torch.Generator().manual_seed(1))
        table = torch.cat((angles, angles), -1) if duplicated else torch.rand(64, D) * 6
        self.register_buffer("cos_cached", table.cos())
        self.register_buffer("sin_cached", table.sin())

    def forward(self, q, k, position_ids):
        cos, sin = self.cos_cached[position_ids][:, None], self.sin_cached[position_ids][:, None]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def inputs():
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(B, H, S, D, generator=gen), torch.randn(B, 2, S, D, generator=gen),
            torch.arange(3, 3 + S).expand(B, S).contiguous())


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
@pytest.mark.parametrize("module", [ComputedRotary(), ComputedRotary(scaling=0.8), CachedRotary()],
                         ids=["computed", "computed-scaled", "cached"])
def test_fuses_query_and_key(dynamo, module):
    model = export_module(module, inputs(), dynamo=dynamo)
    refresh_shapes(model)
    result = run_pass(FuseRotary(), model, tolerance=1e-5)
    assert result.matches == 2
    counts = op_counts(result.model)
    assert counts["RotaryEmbedding"] == 2 and counts["Neg"] == 0
    ropes = [n for n in result.model.graph.node if n.op_type == "RotaryEmbedding"]
    assert [r.input[0] for r in ropes] == [i.name for i in result.model.graph.input][:2]
    assert [r.output[0] for r in ropes] == [o.name for o in result.model.graph.output]


def test_tables_without_repeated_halves_are_refused():
    model = export_module(CachedRotary(duplicated=False), inputs(), dynamo=False)
    refresh_shapes(model)
    result = run_pass(FuseRotary(), model)
    assert result.matches == 0 and op_counts(result.model)["RotaryEmbedding"] == 0


def test_rotation_without_negation_is_refused():
    class NoNeg(ComputedRotary):
        def forward(self, q, k, position_ids):
            freqs = position_ids[..., None].float() * self.inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos()[:, None], emb.sin()[:, None]
            swapped = torch.cat((q[..., D // 2:], q[..., : D // 2]), dim=-1)
            return q * cos + swapped * sin, k

    model = export_module(NoNeg(), inputs(), dynamo=False)
    refresh_shapes(model)
    assert run_pass(FuseRotary(), model).matches == 0


class SharedPositionsRotary(ComputedRotary):
    """Optimum's Gemma exports: one row of positions for the whole batch (cos/sin [1, S, D]),
    broadcast over it; RotaryEmbedding takes no broadcast, so the fused op needs it expanded."""

    def forward(self, q, k, position_ids):
        return super().forward(q, k, position_ids[:1])


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_table_for_batch_one_is_expanded_to_the_batch(dynamo):
    model = export_module(SharedPositionsRotary(), inputs(), dynamo=dynamo)
    refresh_shapes(model)
    result = run_pass(FuseRotary(), model, tolerance=1e-5)  # onnxruntime rejects unexpanded tables
    assert result.matches == 2 and op_counts(result.model)["Expand"] >= 1
