"""The one seam for linear layers (pagedserve/model/linear_method.py): the
decision table gives each layer to the first method that takes it, records
why the preferred ones declined, and install() is the one route onto a
Hugging Face model's own nn.Linear modules."""

from __future__ import annotations

import pytest
import torch

from pagedserve.model.linear import DenseMethod, LinearChoice
from pagedserve.model.linear_method import LinearLayer, LinearMethod, LinearMethodTable, layer_type


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
    table.methods[0].note = lambda: "4 rows"  # what a method adds once its layers are settled (LinearMethod.note)
    assert "mlp.up_proj x2: only_mlp (doubled; 4 rows)" in table.summary()


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


class Blocky(LinearLayer):
    """A layer of a method the engine has never seen: it holds 1,000 bytes outside its tensors and its rows
    depend on the call's size (as a library GEMM's do)."""

    row_invariant = False

    def __init__(self, linear):
        super().__init__()
        self.inner = linear  # its own fallback module, counted with it (not listed twice)

    @property
    def nbytes(self):
        return 1000

    def forward(self, x):
        return self.inner(x)


class BlockyMethod(LinearMethod):
    name = "blocky"

    def build(self, linears, names):
        dense, _ = DenseMethod(LinearChoice("torch", "test")).build(linears, names)
        return Blocky(dense), "blocks of a kind nobody knows"

    @property
    def serves(self):
        return False  # the table's serving path is then the next method's


def test_what_a_layer_answers_is_all_the_engine_asks_of_it():
    """prepare's accounts read the LinearLayer answers, never a layer's class: a new method's layer is
    counted in the weights' bytes and named among the library GEMMs by what it says; the serving method is
    the first that serves."""
    from pagedserve.model.prepare import dense_gemm_layers, weight_bytes

    model = tiny()
    plain = weight_bytes(model)
    table = LinearMethodTable([BlockyMethod(), DenseMethod(LinearChoice("torch", "test"))])
    assert table.install(model) == 5 and table.serving.name == "torch"
    assert weight_bytes(model) == plain + 5 * 1000
    listed = dense_gemm_layers(model)
    assert "lm_head" in listed and "model.layers.0.mlp.up_proj" in listed
    assert not any(name.endswith(".inner") for name in listed)  # a layer's own fallback is the layer's
    Blocky.row_invariant = True
    try:
        assert dense_gemm_layers(model) == ["model.layers.0.mlp.other"]  # the untouched nn.Linear subclass
    finally:
        Blocky.row_invariant = False
