"""The ``tiles`` linear method (pagedserve/model/float_tiles.py): a float
checkpoint's own float32 / bfloat16 weights on our exact GEMM. A layer computes
the float layer (float32 summation noise; bfloat16: the float32 sums rounded
once), a row's bits do not depend on the call's other rows, layers the kernel
cannot take are declined with the reason, and a tied embedding reads the output
layer's tiles only where that gives the module's values bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.model.float_tiles import FloatTilesMethod, why_no_tiles
from pagedserve.model.gguf_linear import GGUFEmbedding, GGUFFloatLinear


def _linear(k: int, n: int, dtype: torch.dtype, bias: bool = True, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(k, n, bias=bias).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_layer_on_the_tiles_is_the_float_layer_and_row_invariant(dtype):
    parts = [_linear(96, 40, dtype, seed=1), _linear(96, 24, dtype, bias=False, seed=2)]
    method = FloatTilesMethod(dtype)
    layer, what = method.build(parts, ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"])
    assert isinstance(layer, GGUFFloatLinear) and layer.dense is None
    assert what == f"the model's {str(dtype).removeprefix('torch.')} weights in our exact GEMM's tiles"
    assert method.native == 2 and method.declined == 0 and method.layers == [layer]
    assert layer.nbytes == 64 * 96 * (4 if dtype == torch.float32 else 2)  # the weights as they are, no copy
    x = torch.randn(13, 96, generator=torch.Generator().manual_seed(3)).to(dtype)
    got = layer(x)
    assert got.dtype == dtype and got.shape == (13, 64)
    weight = torch.cat([p.weight for p in parts]).double()
    bias = torch.cat([parts[0].bias, torch.zeros(24, dtype=dtype)]).double()
    want = F.linear(x.double(), weight, bias)
    scale = F.linear(x.double().abs(), weight.abs(), bias.abs())
    if dtype == torch.float32:
        assert bool(((got.double() - want).abs() <= 1e-5 * scale + 1e-6).all())
    else:  # float32 sums of the exact products, rounded once to bfloat16: within half a bfloat16 step (+ noise)
        assert bool(((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-4 * scale).all())
    for rows in (slice(0, 1), slice(5, 6), slice(3, 11)):
        assert torch.equal(layer(x[rows].contiguous()), got[rows])


def test_layers_the_kernel_cannot_take_are_declined_with_the_reason():
    method = FloatTilesMethod(torch.float32)
    layer, why = method.build([_linear(48, 16, torch.float32)], ["model.layers.0.self_attn.o_proj"])
    assert layer is None and why == "in_features 48 is not a multiple of 32 (the tiles' k-step)"
    layer, why = method.build([_linear(64, 16, torch.float16)], ["model.layers.0.self_attn.o_proj"])
    assert layer is None and why == "its weights are float16"
    assert method.declined == 2 and method.native == 0
    assert "float32 or bfloat16" in why_no_tiles(torch.float16, torch.device("cpu"))
    assert "CPU only" in why_no_tiles(torch.float32, torch.device("meta"))
    assert why_no_tiles(torch.bfloat16, torch.device("cpu")) is None
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        FloatTilesMethod(torch.float16)


class _Scaled(torch.nn.Embedding):
    """An embedding scaled as Gemma's (the module's own scale, in the weight's dtype)."""

    def __init__(self, *args, scale: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("embed_scale", torch.tensor(scale), persistent=False)

    def forward(self, ids):
        return super().forward(ids) * self.embed_scale.to(self.weight.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaled", [False, True])
def test_a_tied_embedding_reads_the_output_layers_tiles_with_the_modules_values(dtype, scaled):
    """One copy of a tied table; the lookups are the module's bits, a scaled bfloat16 embedding (Gemma's, whose
    module multiplies by its scale rounded to bfloat16) included."""
    torch.manual_seed(4)
    embed = (_Scaled(300, 64, scale=640.0**0.5) if scaled else torch.nn.Embedding(300, 64)).to(dtype)
    head = torch.nn.Linear(64, 300, bias=False).to(dtype)
    head.weight = embed.weight  # tied
    method = FloatTilesMethod(dtype)
    layer, _ = method.build([head], ["lm_head"])
    lookup = method.tied_embedding(embed, layer)
    assert isinstance(lookup, GGUFEmbedding) and lookup.weight_blocks is layer.weight_blocks
    ids = torch.tensor([[0, 299, 17], [5, 5, 150]])
    assert torch.equal(lookup(ids), embed(ids))
    other = torch.nn.Embedding(300, 64).to(dtype)  # not the weight the output layer was built from
    assert method.tied_embedding(other, layer) is None
