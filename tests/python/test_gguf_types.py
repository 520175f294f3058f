"""Every common GGUF block type on the native kernels
(pagedserve._core.cpu.QuantizedWeight: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
Q5_K, Q6_K, and the unquantised F32, F16, BF16): on random blocks of each type, for weights whose rows hold one
and several blocks and a partial last row group, the C++ de-quantisation is
gguf-py's bit for bit (the sign of zero included; Q4_0, run on Q4_1 tiles
with m = -8 d, gives a zero of either sign), the embedding lookup reads
those rows, and linear_f32 in every kernel variant this CPU runs gives those
values exactly for one-hot rows and agrees with a float64 F.linear on them
within float32 summation noise."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedserve import _core
from pagedserve.errors import KernelArgumentError

cpu = _core.cpu
gguf = pytest.importorskip("gguf", reason="gguf-py is not installed")
from gguf.quants import dequantize  # noqa: E402

TYPES = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k"]
# byte offsets of each block's fp16 scales (set to finite values; every other byte is random)
SCALES = {"q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,), "q4_k": (0, 2),
          "q5_k": (0, 2), "q6_k": (208,)}


def gguf_type(name):
    return gguf.GGMLQuantizationType[name.upper()]


def random_blocks(name: str, n: int, k: int, seed: int) -> np.ndarray:
    """uint8 [n, k / block * bytes]: random quants, scales fp16 of either sign
    in about [2^-10, 2), one block's scale a subnormal and one a negative zero."""
    block, size = gguf.GGML_QUANT_SIZES[gguf_type(name)]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n * (k // block), size), dtype=np.uint8)
    for off in SCALES[name]:
        scale = (rng.uniform(2.0**-10, 2.0, size=raw.shape[0]) * rng.choice([-1, 1], size=raw.shape[0]))
        raw[:, off:off + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    raw[0, SCALES[name][0]:SCALES[name][0] + 2] = np.array([3], dtype=np.uint16).view(np.uint8)  # subnormal
    raw[-1, SCALES[name][0]:SCALES[name][0] + 2] = np.array([0x8000], dtype=np.uint16).view(np.uint8)  # -0.0
    return raw.reshape(n, -1)


def reference(name: str, raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(dequantize(raw, gguf_type(name)), dtype=np.float32))


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n,k", [(1, 256), (37, 512), (48, 768)])
def test_dequantize_is_gguf_pys_bit_for_bit(name, n, k):
    raw = random_blocks(name, n, k, seed=n * 1000 + k)
    w = cpu.QuantizedWeight(torch.from_numpy(raw), name, n, k)
    assert (w.qtype, w.out_features, w.in_features) == (name, n, k)
    assert w.integer_kernels  # every type runs with int8 activations too (tests/cpp/test_gguf_types.cc checks them)
    out = torch.full((n, k), float("nan"))
    w.dequantize(out, 2)
    want = reference(name, raw)
    if name == "q4_0":  # d q + m with m = -8 d: d (q - 8) exactly, but q = 8 gives +0 where numpy's d * 0 is -0 (d < 0)
        out, want = out + 0.0, want + 0.0  # -0 + 0 = +0: the values, bit for bit, zeros as +0
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))  # bits, so -0.0 too
    ids = torch.tensor([n - 1, 0, n // 2], dtype=torch.int64)
    rows = torch.empty(3, k)
    w.embedding(ids, rows)
    assert torch.equal((rows + 0.0 if name == "q4_0" else rows).view(torch.int32), want[ids].view(torch.int32))


@pytest.mark.parametrize("name", TYPES)
def test_linear_f32_expands_every_type_exactly(quant_variant, name):
    n, k = 40, 512
    raw = random_blocks(name, n, k, seed=7)
    w = cpu.QuantizedWeight(torch.from_numpy(raw), name, n, k)
    dense = reference(name, raw)
    eye = torch.eye(k)
    out = torch.empty(k, n)
    w.linear_f32(eye, out, None, 2)
    assert torch.equal(out, dense.T), f"{quant_variant}: the one-hot rows are not the weights"
    g = torch.Generator().manual_seed(1)
    for m in (1, 4, 13, 40):
        x, bias = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
        got = torch.empty(m, n)
        w.linear_f32(x, got, bias, 2)
        want = F.linear(x.double(), dense.double(), bias.double())
        scale = F.linear(x.double().abs(), dense.double().abs(), bias.double().abs())  # float32 summation noise
        close = (got.double() - want).abs() <= 1e-5 * scale + 1e-6
        assert close.all(), f"{quant_variant}: not the float32 layer"
        one = torch.empty(1, n)
        w.linear_f32(x[-1:].contiguous(), one, bias, 1)
        assert torch.equal(one[0], got[-1]), f"{quant_variant}: a row's result depends on its batch"


def test_bad_types_and_shapes_raise_kernel_argument_error():
    raw = torch.from_numpy(random_blocks("q4_k", 2, 256, seed=1))
    with pytest.raises(KernelArgumentError, match="q3_k"):
        cpu.QuantizedWeight(raw, "q3_k", 2, 256)
    with pytest.raises(KernelArgumentError, match="multiple of 256"):
        cpu.QuantizedWeight(raw, "q4_k", 2, 160)
    w = cpu.QuantizedWeight(raw, "q4_k", 2, 256)
    with pytest.raises(KernelArgumentError, match="out"):
        w.linear(torch.randn(1, 256), torch.empty(1, 3), None, 1)


FLOAT_TYPES = {"f32": np.float32, "f16": np.float16, "bf16": None}


def float_tensor(name: str, n: int, k: int, seed: int) -> np.ndarray:
    """A GGUF F32 / F16 / BF16 tensor's data as gguf-py's reader gives it: float32 / float16 [n, k], or for
    BF16 uint8 [n, 2 k] (numpy has no bfloat16): random normal values, a -0.0 and an infinity among them."""
    v = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    v[0, 0], v[-1, -1] = -0.0, np.inf
    if name == "bf16":
        return (torch.from_numpy(v).bfloat16().view(torch.int16).numpy().view(np.uint8)).reshape(n, 2 * k)
    return v.astype(FLOAT_TYPES[name])


@pytest.mark.parametrize("name", list(FLOAT_TYPES))
def test_unquantised_types_hold_gguf_pys_values_and_run_only_in_float32(quant_variant, name):
    """F32 / F16 / BF16 tensors (a GGUF of unquantised weights; a float checkpoint's own weights take the
    same tiles): raw_bytes turns the reader's array into the rows' bytes, dequantize gives gguf-py's float32
    values bit for bit (-0.0 and inf included), linear_f32 gives them exactly for one-hot rows and a row's
    bits alone as in its batch; linear (int8 activations) refuses them."""
    from pagedserve.model.gguf_format import raw_bytes

    n, k = 37, 96
    data = float_tensor(name, n, k, seed=5)
    raw = raw_bytes(data)
    assert raw.dtype == torch.uint8 and raw.shape == (n, k * (4 if name == "f32" else 2))
    w = cpu.QuantizedWeight(raw, name, n, k)
    assert w.qtype == name and not w.integer_kernels
    want = torch.from_numpy(np.ascontiguousarray(dequantize(data, gguf_type(name)), dtype=np.float32))
    out = torch.full((n, k), float("nan"))
    w.dequantize(out, 2)
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
    eye = torch.eye(k)
    t = torch.empty(k, n)
    w.linear_f32(eye, t, None, 2)
    finite = torch.isfinite(want).all(dim=1)  # (the weight row holding inf: 0 * inf is NaN in the other rows)
    assert bool((t[:, finite] == want.T[:, finite]).all())  # ==: a sum from +0 gives +0 for a -0.0 weight
    assert torch.isinf(t[k - 1, n - 1])
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(2))
    w2 = cpu.QuantizedWeight(raw_bytes(np.where(np.isinf(data), 1, data).astype(data.dtype)), name, n, k)
    batch, one = torch.empty(9, n), torch.empty(1, n)
    w2.linear_f32(x, batch, None, 2)
    w2.linear_f32(x[4:5].contiguous(), one, None, 1)
    assert torch.equal(one[0], batch[4])
    with pytest.raises(KernelArgumentError, match="linear_f32"):
        w.linear(x, torch.empty(9, n), None, 1)


def test_the_gguf_path_serves_an_f16_tensor_and_the_quantised_method_does_not_take_it():
    """An F16 linear layer of a GGUF file is served by the gguf path from its 2-byte tiles (no float32 copy);
    --quantization quantises its values here instead (the integer kernels read no F16)."""
    from types import SimpleNamespace

    from pagedserve.model.gguf_format import GGUFBlocks
    from pagedserve.model.gguf_linear import GGUFFloatLinear, GGUFFloatMethod
    from pagedserve.model.linear import DenseMethod, LinearChoice
    from pagedserve.model.quantization import QuantizedMethod

    n, k = 48, 64
    data = np.where(np.isinf(float_tensor("f16", n, k, seed=9)), 0.5, float_tensor("f16", n, k, seed=9))
    data = data.astype(np.float16)
    lin = torch.nn.Linear(k, n, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(data.astype(np.float32)))
    blocks = GGUFBlocks("unused.gguf", {"blk.0.ffn_down.weight": (data, "f16")}, "gemma3")
    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=1)
    method = GGUFFloatMethod(blocks, config, DenseMethod(LinearChoice("torch", "test")))
    layer, what = method.build([lin], ["model.layers.0.mlp.down_proj"])
    assert isinstance(layer, GGUFFloatLinear) and what == "F16 blocks expanded exactly to float32"
    assert layer.nbytes == n * k * 2
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(4))
    want = torch.nn.functional.linear(x.double(), lin.weight.double(), lin.bias.double())
    assert torch.allclose(layer(x).double(), want, rtol=1e-5, atol=1e-5)
    quantized = QuantizedMethod("q4", config, blocks)
    qlayer, qwhat = quantized.build([lin], ["model.layers.0.mlp.down_proj"])
    assert qwhat == "Q4_1 blocks, quantised here, int8 activations", qwhat
    assert quantized.requantized == 1 and quantized.native == 0


@pytest.mark.parametrize("name", TYPES)
def test_linear_with_int8_activations_runs_every_type(quant_variant, name):
    """linear (int8 activations) on each type's tiles: x @ W.T of gguf-py's de-quantised weights, up to the
    activations' rounding (at most half a step xd / 2 per element: bounded by sum |w| xd / 2 per group)."""
    n, k = 37, 512
    raw = random_blocks(name, n, k, seed=7)
    w = cpu.QuantizedWeight(torch.from_numpy(raw), name, n, k)
    weights = reference(name, raw).double()
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(3))
    out = torch.empty(5, n)
    w.linear(x, out, None, 2)
    xd = x.reshape(5, k // 32, 32).abs().amax(-1).double() / 127  # [5, groups]
    bound = (weights.abs().reshape(n, k // 32, 32).sum(-1) @ xd.T).T / 2  # [5, n]
    err = (out.double() - x.double() @ weights.T).abs()
    assert bool((err <= bound * 1.001 + 1e-4 * (x.double().abs() @ weights.abs().T)).all()), float((err / bound).max())


def test_the_quantised_method_runs_a_files_k_quant_blocks_as_they_are():
    """--quantization on a GGUF file takes each layer's own blocks in any type the kernels read (here Q4_K),
    whatever the quantisation named: no second rounding of weights the file already quantised."""
    from types import SimpleNamespace

    from pagedserve.model.gguf_format import GGUFBlocks
    from pagedserve.model.quantization import QuantizedMethod

    n, k = 48, 256
    raw = random_blocks("q4_k", n, k, seed=11)
    lin = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(reference("q4_k", raw))
    blocks = GGUFBlocks("unused.gguf", {"blk.0.ffn_down.weight": (raw, "q4_k")}, "gemma3")
    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=1)
    for quantization in ("q4", "int8"):
        method = QuantizedMethod(quantization, config, blocks)
        layer, what = method.build([lin], ["model.layers.0.mlp.down_proj"])
        assert layer.qtype == "q4_k" and what == "Q4_K blocks, the file's own, int8 activations"
        assert torch.equal(layer.dequantize(), lin.weight.detach()) and method.native == 1
        other, what = method.build([torch.nn.Linear(k, n)], ["model.layers.0.mlp.up_proj"])  # not in the file
        assert other.qtype == {"q4": "q4_1", "int8": "q8_0"}[quantization] and "quantised here" in what


def test_a_fused_layer_of_mixed_types_keeps_each_parts_own_blocks():
    """A Q4_K_M file stores attn_v as Q6_K where q and k are Q4_K: the fused qkv layer of --quantization keeps
    each part's blocks (one kernel call per type, into its columns), none quantised a second time."""
    from types import SimpleNamespace

    from pagedserve.model.gguf_format import GGUFBlocks
    from pagedserve.model.quantization import QuantizedMethod

    k = 256
    raws = {"q": random_blocks("q4_k", 64, k, seed=1), "k": random_blocks("q4_k", 16, k, seed=2),
            "v": random_blocks("q6_k", 16, k, seed=3)}
    types = {"q": "q4_k", "k": "q4_k", "v": "q6_k"}
    lins = []
    for part, raw in raws.items():
        lin = torch.nn.Linear(k, raw.shape[0], bias=part == "k")
        with torch.no_grad():
            lin.weight.copy_(reference(types[part], raw))
        lins.append(lin)
    blocks = GGUFBlocks("unused.gguf", {f"blk.2.attn_{p}.weight": (r, types[p]) for p, r in raws.items()}, "qwen3")
    method = QuantizedMethod("q4", SimpleNamespace(num_attention_heads=4, num_key_value_heads=1), blocks)
    layer, what = method.build(lins, [f"model.layers.2.self_attn.{p}_proj" for p in "qkv"])
    assert what == "Q4_K+Q6_K blocks, the file's own, int8 activations" and layer.qtype == "q4_k+q6_k"
    assert method.native == 3 and method.requantized == 0 and len(layer.weights) == 2
    assert torch.equal(layer.dequantize(), torch.cat([lin.weight.detach() for lin in lins]))
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
    want = torch.cat([lin(x) for lin in lins], dim=-1).detach()
    got = layer(x)
    assert got.shape == (3, 96)
    # each part's columns are that part alone on its own weight (the same kernel call)
    alone = torch.empty(3, 16)
    layer.weights[1].linear(x, alone, None, 1)
    assert torch.equal(got[:, 80:], alone)
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05 * float(want.abs().max()))
