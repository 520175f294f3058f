"""pagedserve._core.cpu.QuantizedWeight.linear_f32 on random GGUF Q4_1 / Q8_0
blocks (quantised by gguf-py): the float32 linear layer of the exactly
dequantised weights, in every kernel variant this CPU runs. It agrees with
torch's F.linear on gguf-py's dequantisation, gives the dequantised weights
bit for bit for one-hot rows, does not depend on the thread count, and bad
arguments raise the typed KernelArgumentError."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve import _core
from pagedserve.errors import KernelArgumentError

cpu = _core.cpu

pytest.importorskip("gguf", reason="gguf-py is not installed")
from pagedserve.model.gguf_format import dequantize_rows, quantize_rows  # noqa: E402


def weights(qtype, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    blocks = quantize_rows(torch.randn(n, k, generator=g) * 0.05 + 0.01, qtype)
    return cpu.QuantizedWeight(blocks, qtype, n, k), dequantize_rows(blocks, qtype)


@pytest.mark.parametrize("qtype", ["q4_1", "q8_0"])
@pytest.mark.parametrize("n,k", [(40, 64), (960, 576), (576, 1536)])
@pytest.mark.parametrize("m", [1, 5, 12, 13, 32, 100])
def test_linear_f32_matches_torch_on_the_dequantised_weights(quant_variant, qtype, n, k, m):
    w, dense = weights(qtype, n, k, seed=n + k)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g) if m % 2 else None
    out = torch.full((m, n), float("nan"))
    w.linear_f32(x, out, bias, 2)
    torch.testing.assert_close(out, F.linear(x, dense, bias), rtol=1e-5, atol=1e-5)
    again = torch.full((m, n), float("nan"))
    w.linear_f32(x, again, bias, 1)
    assert torch.equal(out, again), f"{quant_variant}: 1 and 2 threads differ"


@pytest.mark.parametrize("qtype", ["q4_1", "q8_0"])
def test_linear_f32_of_one_hot_rows_is_the_dequantised_weight(quant_variant, qtype):
    n, k = 72, 96
    w, dense = weights(qtype, n, k, seed=3)
    eye = torch.eye(k)
    out = torch.empty(k, n)
    w.linear_f32(eye, out, None, 2)
    assert torch.equal(out, dense.T)  # bit for bit: the expansion is exact
    bias = torch.randn(n, generator=torch.Generator().manual_seed(4))
    w.linear_f32(eye[5:6].contiguous(), out[:1], bias, 1)
    assert torch.equal(out[0], dense[:, 5] + bias)


def test_linear_f32_bad_arguments_raise_kernel_argument_error():
    n, k = 40, 64
    w, _dense = weights("q4_1", n, k, seed=5)
    x = torch.randn(3, k)
    out = torch.empty(3, n)
    w.linear_f32(x, out)  # defaults: no bias, one thread
    ob = out.bfloat16()
    w.linear_f32(x.bfloat16(), ob, None, 1)  # both bfloat16: the float32 result of the widened rows, rounded once
    ref = torch.empty(3, n)
    w.linear_f32(x.bfloat16().float(), ref, None, 1)
    assert torch.equal(ob, ref.bfloat16())
    with pytest.raises(KernelArgumentError):
        w.linear_f32(x.half(), out.half(), None, 1)  # float32 or bfloat16 only
    with pytest.raises(KernelArgumentError):
        w.linear_f32(x.bfloat16(), out, None, 1)
    with pytest.raises(KernelArgumentError):
        w.linear_f32(x, out.bfloat16(), None, 1)
    with pytest.raises(KernelArgumentError):
        w.linear_f32(x[:, :-32], out, None, 1)  # wrong K
    with pytest.raises(KernelArgumentError):
        w.linear_f32(torch.randn(k, 3).T, out, None, 1)  # non-contiguous x
    with pytest.raises(KernelArgumentError):
        w.linear_f32(x, torch.empty(n, 3).T, None, 1)  # non-contiguous out
    with pytest.raises(KernelArgumentError):
        w.linear_f32(x, torch.empty(3, n + 1), None, 1)
    with pytest.raises(KernelArgumentError):
        w.linear_f32(x, out, torch.randn(n + 1), 1)
    with pytest.raises(KernelArgumentError):
        w.linear_f32(x, out, torch.randn(n).bfloat16(), 1)
    with pytest.raises(KernelArgumentError):
        w.linear_f32(x, out, None, 0)
    w.linear_f32(torch.empty(0, k), torch.empty(0, n), None, 2)  # M = 0: nothing to do
