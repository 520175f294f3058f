"""The one seam for linear layers (pagedserve/model/linear_method.py): the
decision table gives each layer to the first method that takes it, records
why the preferred ones declined, and install() is the one route onto a
Hugging Face model's own nn.Linear modules."""

from __future__ import annotations

import pytest
import torch

from pagedserve.model.linear import DenseMethod, LinearChoice
from pagedserve.model.linear_method import LinearMethod, LinearMethodTable, layer_type


class OnlyMlp(LinearMethod):
    """Takes the MLP layers (doubling their output, so a test sees which method ran), declines the others."""

    name = "only_mlp"

    def build(self, linears, names):
        if not all(".mlp." in n for n in names):
            return None, "not an MLP layer"
        dense, _ = DenseMethod(LinearChoice("torch", "test")).build(linears, names)
        return torch.nn.Sequential(dense, Doubled()), "doubled"


class Doubled(torch.nn.Module):
    def forward(self, x):
        return 2 * x


class Subclassed(torch.nn.Linear):
    pass


def tiny():
    layer = torch.nn.Module()
    layer.self_attn, layer.mlp = torch.nn.Module(), torch.nn.Module()
    layer.self_attn.q_proj = torch.nn.Linear(8, 8)
    layer.mlp.up_proj = torch.nn.Linear(8, 16)
    layer.mlp.other = Subclassed(8, 8)
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([layer, layer.__class__()])
    second = model.model.layers[1]
    second.self_attn, second.mlp = torch.nn.Module(), torch.nn.Module()
    second.self_attn.q_proj, second.mlp.up_proj = torch.nn.Linear(8, 8), torch.nn.Linear(8, 16)
    model.lm_head = torch.nn.Linear(8, 32, bias=False)
    return model


def test_each_layer_goes_to_the_first_method_that_takes_it_and_the_log_says_why():
    model = tiny()
    x = torch.randn(3, 8)
    up, q = model.model.layers[0].mlp.up_proj, model.model.layers[0].self_attn.q_proj
    want_up, want_q = up(x), q(x)
    table = LinearMethodTable([OnlyMlp(), DenseMethod(LinearChoice("torch", "test"))])
    assert table.install(model) == 5  # plain nn.Linear only: the subclass keeps its own forward
    assert type(model.model.layers[0].mlp.other) is Subclassed
    torch.testing.assert_close(model.model.layers[0].mlp.up_proj(x), 2 * want_up)
    torch.testing.assert_close(model.model.layers[0].self_attn.q_proj(x), want_q)
    assert table.summary().splitlines() == [
        "lm_head x1: torch (float32 weights, torch's default GEMM; declined: only_mlp: not an MLP layer)",
        "self_attn.q_proj x2: torch (float32 weights, torch's default GEMM; declined: only_mlp: not an MLP layer)",
        "mlp.up_proj x2: only_mlp (doubled)",
    ]
    assert "mlp.up_proj x2: only_mlp (doubled; 4 rows)" in table.summary({"only_mlp": "4 rows"})


def test_fused_parts_are_one_layer_of_one_type_and_a_table_nobody_takes_raises():
    a, b = torch.nn.Linear(8, 4), torch.nn.Linear(8, 6, bias=False)
    names = ["model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.k_proj"]
    assert layer_type(names) == "self_attn.q_proj+self_attn.k_proj"
    table = LinearMethodTable([DenseMethod(LinearChoice("torch", "test"))])
    fused = table([a, b], names)
    x = torch.randn(2, 8)
    torch.testing.assert_close(fused(x), torch.cat([a(x), b(x)], dim=-1))  # b's missing bias counts as zeros
    with pytest.raises(ValueError, match="no linear method takes .*q_proj.*only_mlp: not an MLP layer"):
        LinearMethodTable([OnlyMlp()])([a], names[:1])
    with pytest.raises(ValueError, match="at least one method"):
        LinearMethodTable([])
