"""Batch invariance, kernel by kernel (issue 28): one row's result is the same
bits whether the call holds it alone or among 1..64 rows (at any position), on
one thread or two, for each CPU kernel a step runs per token: the fused
norms, RoPE and the gated activation (every ISA variant this CPU runs, float32
and bfloat16), the GGUF blocks' float32 GEMM (float32 and bfloat16 rows), the
int8 GEMM of --quantization, and the sampler's log_softmax over the vocabulary.
The attention kernel's own check is tests/cpp/test_attention_cpu.cc
(AQueryTokensOutputDoesNotDependOnTheRestOfItsStep); the engine's end to end
is test_batch_invariance.py."""
from __future__ import annotations

import pytest
import torch

from pagedserve import _core
from pagedserve.model.gguf_format import quantize_rows

cpu = _core.cpu
SIZES = (1, 2, 3, 7, 8, 9, 16, 17, 31, 32, 33, 63, 64)
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(params=cpu.variants_for("ops"))
def isa(request):
    """Runs the test under each fused-op kernel table this CPU executes (one registry variant per table)."""
    before = cpu.kernel_isa()
    cpu.set_kernel_isa(request.param)
    try:
        yield request.param
    finally:
        cpu.set_kernel_isa(before)


def batches(probe: torch.Tensor, seed: int):
    """(batch [B, ...], position of probe) for every B in SIZES: probe [...] at a
    seeded position among seeded random rows of its dtype."""
    g = torch.Generator().manual_seed(seed)
    for b in SIZES:
        rows = torch.randn(b, *probe.shape, generator=g).to(probe.dtype)
        at = int(torch.randint(0, b, (1,), generator=g))
        rows[at] = probe
        yield rows, at


def assert_row_invariant(fn, probe: torch.Tensor, seed: int = 0) -> None:
    """fn(batch [B, ...], threads) -> tuple of [B, ...] results: row `at`'s
    results must equal the probe's results alone on one thread, bit for bit."""
    alone = [r[0].clone() for r in fn(probe.unsqueeze(0).clone(), 1)]
    for threads in (1, 2):
        for rows, at in batches(probe, seed):
            got = fn(rows, threads)
            for want, out in zip(alone, got):
                assert torch.equal(out[at], want), f"{len(rows)} rows, row {at}, {threads} threads"


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_rope_and_activation_give_a_row_the_same_bits_in_any_call(isa, dtype):
    h, hq, hk, d, inter = 576, 9, 3, 64, 1536
    g = torch.Generator().manual_seed(1)
    weight = (1 + 0.3 * torch.randn(h, generator=g)).to(dtype)

    def norm(x, threads):
        out = torch.empty_like(x)
        cpu.rms_norm(out, x, weight, 1e-5, threads)
        return (out,)

    def add_norm(xr, threads):
        x, residual = xr[:, 0].contiguous(), xr[:, 1].contiguous()
        cpu.fused_add_rms_norm(x, residual, weight, 1e-5, threads)
        return x, residual

    assert_row_invariant(norm, torch.randn(h, generator=g).to(dtype))
    assert_row_invariant(add_norm, torch.randn(2, h, generator=g).to(dtype))

    def act(x, threads):
        out = torch.empty(x.shape[0], inter, dtype=x.dtype)
        cpu.silu_and_mul(out, x, threads)
        return (out,)

    assert_row_invariant(act, torch.randn(2 * inter, generator=g).to(dtype))

    max_pos = 4096
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [max_pos, d]: cos then sin halves

    def rope(qkv, threads):
        # the probe's position travels in its last element (the same for every row's copy)
        positions = qkv[:, -1].float().round().long().clamp(0, max_pos - 1)
        buf = qkv[:, :-1].contiguous()
        q, k, _ = buf.split([hq * d, hk * d, hk * d], dim=-1)
        cpu.rotary_embedding(positions, q, k, d, cache, True, threads)
        return (buf,)

    probe = torch.randn((hq + 2 * hk) * d + 1, generator=g)
    probe[-1] = 1232.0  # its position (exact in bfloat16 too)
    assert_row_invariant(rope, probe.to(dtype))


@pytest.mark.parametrize("qtype", ["q4_1", "q8_0"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_blocks_float32_gemm_gives_a_row_the_same_bits_in_any_call(qtype, dtype):
    n, k = 960, 576
    g = torch.Generator().manual_seed(2)
    w = cpu.QuantizedWeight(quantize_rows(torch.randn(n, k, generator=g) * 0.05, qtype), qtype, n, k)
    bias = torch.randn(n, generator=g)

    def gemm(x, threads):
        out = torch.empty(x.shape[0], n, dtype=x.dtype)
        w.linear_f32(x, out, bias, threads)
        return (out,)

    assert_row_invariant(gemm, torch.randn(k, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_int8_gemm_of_quantization_gives_a_row_the_same_bits_in_any_call(dtype):
    n, k = 960, 576
    g = torch.Generator().manual_seed(3)
    w = cpu.QuantizedWeight(quantize_rows(torch.randn(n, k, generator=g) * 0.05, "q4_1"), "q4_1", n, k)

    def gemm(x, threads):
        out = torch.empty(x.shape[0], n, dtype=x.dtype)
        w.linear(x, out, None, threads)
        return (out,)

    assert_row_invariant(gemm, torch.randn(k, generator=g).to(dtype))


def test_the_samplers_log_softmax_gives_a_row_the_same_bits_in_any_call():
    vocab = 49152
    g = torch.Generator().manual_seed(4)
    before = torch.get_num_threads()

    def logprobs(logits, threads):
        torch.set_num_threads(threads)
        try:
            return (torch.log_softmax(logits.float(), dim=-1),)
        finally:
            torch.set_num_threads(before)

    assert_row_invariant(logprobs, 8 * torch.randn(vocab, generator=g))
