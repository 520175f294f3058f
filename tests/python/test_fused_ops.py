"""The fused elementwise CPU ops (_core.cpu.rms_norm, fused_add_rms_norm,
silu_and_mul, rotary_embedding; csrc/backends/cpu/ops/fused_ops.h) against the
Hugging Face modules they replace: LlamaRMSNorm, the decoder layer's
`residual + hidden_states` then norm, ACT2FN['silu'](gate) * up, and
LlamaRotaryEmbedding + apply_rotary_pos_emb (default and llama3 rope scaling,
the cos/sin cache built from the HF rotary module's own output).

Tolerances. float32: the kernels perform the same float32 operations as the
torch expressions, in the same order per element (built with -ffp-contract=off);
what differs is the summation order of mean(x^2) (vector lanes vs torch's
reduction) and silu's exp (a vectorised polynomial vs Sleef, both within ~2
ulp), so results agree within 1e-6 relative. bfloat16: every torch rounding
to bfloat16 is reproduced, so a result differs only where one of those float32
differences (~1e-7 relative) moves an intermediate across a bfloat16 rounding
boundary: that intermediate (the normalised value, silu(gate)) is then one
bfloat16 ulp off (<= 2^-7 relative), and the next rounded product carries it
with its own half ulp of either result: <= 1.5 * 2^-7 < 2^-6 relative. Such
flips are rare (about 2e-5 of rms_norm's values, none seen in silu or RoPE),
so all but a small fraction of the values must also be bit-identical.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from pagedserve import _core
from pagedserve.errors import KernelArgumentError

cpu = _core.cpu
DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-5


def assert_matches(got: torch.Tensor, want: torch.Tensor, max_mismatch: float = 0.01) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30)
        return
    g, w = got.float(), want.float()
    torch.testing.assert_close(g, w, rtol=2.0**-6, atol=1e-30)
    differ = int((g != w).sum())
    assert differ <= max(1, max_mismatch * g.numel()), f"{differ} of {g.numel()} bfloat16 values differ from torch's"


@pytest.fixture(params=cpu.variants_for("ops"))
def isa(request):
    """Runs the test under each fused-op kernel table this CPU executes (one registry variant per table)."""
    before = cpu.kernel_isa()
    cpu.set_kernel_isa(request.param)
    try:
        assert cpu.kernel_tables()["ops"] == request.param
        yield request.param
    finally:
        cpu.set_kernel_isa(before)


# ---------------------------------------------------------------- rms_norm


def hf_norm(h: int, dtype: torch.dtype, seed: int = 0) -> LlamaRMSNorm:
    torch.manual_seed(seed)
    norm = LlamaRMSNorm(h, eps=EPS)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.5 * torch.randn(h))
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h", [(1, 576), (3, 1536), (64, 576), (3, 7), (1, 7), (64, 1536)])
def test_rms_norm_matches_llama_rms_norm(isa, dtype, t, h):
    norm = hf_norm(h, dtype)
    x = (3.0 * torch.randn(t, h)).to(dtype)
    with torch.no_grad():
        want = norm(x)
    out = torch.empty_like(x)
    cpu.rms_norm(out, x, norm.weight.data, EPS)
    assert_matches(out, want)
    cpu.rms_norm(x, x, norm.weight.data, EPS)  # in place
    assert torch.equal(x, out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_on_strided_rows_and_threads(dtype):
    norm = hf_norm(576, dtype)
    big = torch.randn(256, 700).to(dtype)
    x = big[:, 100:676]  # a view: row stride 700
    with torch.no_grad():
        want = norm(x)
    outs = []
    for threads in (1, 2, 4):
        out_big = torch.zeros(256, 600, dtype=dtype)
        out = out_big[:, :576]
        cpu.rms_norm(out, x, norm.weight.data, EPS, threads)
        assert torch.count_nonzero(out_big[:, 576:]) == 0  # nothing written past the view
        outs.append(out.clone())
    assert_matches(outs[0], want)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])  # rows are independent: threads change nothing


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h", [(1, 576), (3, 1536), (64, 576), (3, 7)])
def test_fused_add_rms_norm_matches_residual_add_then_norm(isa, dtype, t, h):
    norm = hf_norm(h, dtype)
    x = torch.randn(t, h).to(dtype)
    residual = (2.0 * torch.randn(t, h)).to(dtype)
    with torch.no_grad():
        want_residual = residual + x  # LlamaDecoderLayer: hidden_states = residual + hidden_states
        want_x = norm(want_residual)
    cpu.fused_add_rms_norm(x, residual, norm.weight.data, EPS, 2)
    assert torch.equal(residual, want_residual)  # one rounding of the exact sum: bit-identical
    assert_matches(x, want_x)


# ---------------------------------------------------------------- silu_and_mul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,i", [(1, 1536), (3, 1536), (64, 1536), (3, 7), (1, 576)])
def test_silu_and_mul_matches_act_fn_gate_times_up(isa, dtype, t, i):
    torch.manual_seed(1)
    x = (4.0 * torch.randn(t, 2 * i)).to(dtype)
    if i >= 3:
        x[0, :3] = torch.tensor([-100.0, 100.0, 0.0], dtype=dtype)  # exp's clamp, and silu(0) = 0
    want = ACT2FN["silu"](x[:, :i]) * x[:, i:]  # LlamaMLP: act_fn(gate_proj(x)) * up_proj(x)
    out = torch.empty(t, i, dtype=dtype)
    cpu.silu_and_mul(out, x, 2)
    assert_matches(out, want)


def test_silu_and_mul_on_views():
    x_big = torch.randn(32, 3200)
    x = x_big[:, 64 : 64 + 3072]
    out_big = torch.zeros(32, 1600)
    out = out_big[:, 10 : 10 + 1536]
    cpu.silu_and_mul(out, x)
    assert_matches(out, torch.nn.functional.silu(x[:, :1536]) * x[:, 1536:])
    assert torch.count_nonzero(out_big[:, :10]) == 0 and torch.count_nonzero(out_big[:, 1546:]) == 0


# ---------------------------------------------------------------- rotary_embedding

ROPE_DEFAULT = {"rope_type": "default", "rope_theta": 10000.0}
ROPE_LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def llama_config(hq: int, hk: int, d: int, rope: dict, max_pos: int = 300) -> LlamaConfig:
    return LlamaConfig(hidden_size=hq * d, intermediate_size=4 * d, num_attention_heads=hq, num_key_value_heads=hk,
                       head_dim=d, max_position_embeddings=max_pos, rope_parameters=dict(rope))


def cos_sin_cache_from_hf(rotary: LlamaRotaryEmbedding, max_pos: int, d: int) -> torch.Tensor:
    """[max_pos, d] float32: cos | sin halves, as the model code builds it from HF's module."""
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(max_pos)[None])
    return torch.cat([cos[0, :, : d // 2], sin[0, :, : d // 2]], dim=-1).contiguous()


def hf_rope(rotary, q, k, positions, d):
    """HF's apply_rotary_pos_emb on q [T, Hq*D], k [T, Hk*D] (copies)."""
    t = q.shape[0]
    qh = q.reshape(t, -1, d).transpose(0, 1)[None]  # [1, H, T, D]
    kh = k.reshape(t, -1, d).transpose(0, 1)[None]
    cos, sin = rotary(qh, positions[None])
    q_embed, k_embed = apply_rotary_pos_emb(qh, kh, cos, sin)
    return q_embed[0].transpose(0, 1).reshape(t, -1), k_embed[0].transpose(0, 1).reshape(t, -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope", [ROPE_DEFAULT, ROPE_LLAMA3], ids=["default", "llama3"])
@pytest.mark.parametrize("t,hq,hk,d", [(1, 9, 3, 64), (3, 4, 2, 16), (64, 9, 3, 64), (3, 2, 1, 128)])
def test_rotary_embedding_matches_hf_on_qkv_views(isa, dtype, rope, t, hq, hk, d):
    max_pos = 300
    config = llama_config(hq, hk, d, rope, max_pos)
    rotary = LlamaRotaryEmbedding(config)
    cache = cos_sin_cache_from_hf(rotary, max_pos, d)
    torch.manual_seed(2)
    positions = torch.randint(0, max_pos, (t,), dtype=torch.int64)
    positions[0] = max_pos - 1
    qkv = torch.randn(t, (hq + 2 * hk) * d).to(dtype)  # one fused projection's output
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)  # views, row stride (hq + 2hk) * d
    v_before = v.clone()
    with torch.no_grad():
        want_q, want_k = hf_rope(rotary, q.clone(), k.clone(), positions, d)
    cpu.rotary_embedding(positions, q, k, d, cache, True, 2)
    assert_matches(q, want_q)
    assert_matches(k, want_k)
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding_three_dim_views_and_no_key(dtype):
    t, hq, hk, d, max_pos = 5, 4, 2, 32, 64
    rotary = LlamaRotaryEmbedding(llama_config(hq, hk, d, ROPE_DEFAULT, max_pos))
    cache = cos_sin_cache_from_hf(rotary, max_pos, d)
    positions = torch.tensor([0, 1, 17, 63, 5])
    qkv = torch.randn(t, (hq + 2 * hk) * d).to(dtype)
    q3 = qkv[:, : hq * d].view(t, hq, d)
    k3 = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    with torch.no_grad():
        want_q, want_k = hf_rope(rotary, q3.reshape(t, -1).clone(), k3.reshape(t, -1).clone(), positions, d)
    q_only = qkv[:, : hq * d].clone()
    cpu.rotary_embedding(positions, q3, k3, d, cache)
    assert_matches(q3.reshape(t, -1), want_q)
    assert_matches(k3.reshape(t, -1), want_k)
    cpu.rotary_embedding(positions, q_only, None, d, cache)
    assert torch.equal(q_only, q3.reshape(t, -1))


def test_rotary_embedding_gptj_and_partial_rotary_match_vllm_formulas():
    t, h, d, rot, max_pos = 7, 3, 64, 32, 50
    torch.manual_seed(3)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    positions = torch.randint(0, max_pos, (t,))
    cos, sin = cache[positions, : rot // 2][:, None], cache[positions, rot // 2 :][:, None]
    x = torch.randn(t, h * d)
    xh = x.view(t, h, d)
    # neox on the first rot dims of each head, the rest untouched (vLLM's partial rotary)
    x1, x2 = xh[..., : rot // 2], xh[..., rot // 2 : rot]
    want_neox = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, xh[..., rot:]], dim=-1).reshape(t, -1)
    # GPT-J: pairs (2i, 2i+1)
    e, o = xh[..., :rot:2], xh[..., 1:rot:2]
    want_gptj = torch.cat([torch.stack([e * cos - o * sin, o * cos + e * sin], -1).flatten(-2), xh[..., rot:]], -1)
    got = x.clone()
    cpu.rotary_embedding(positions, got, None, d, cache, True)
    assert_matches(got, want_neox)
    got = x.clone()
    cpu.rotary_embedding(positions, got, None, d, cache, False)
    assert_matches(got, want_gptj.reshape(t, -1))


def test_rotary_embedding_threads_change_nothing():
    t, hq, hk, d, max_pos = 200, 9, 3, 64, 512
    rotary = LlamaRotaryEmbedding(llama_config(hq, hk, d, ROPE_LLAMA3, max_pos))
    cache = cos_sin_cache_from_hf(rotary, max_pos, d)
    positions = torch.randint(0, max_pos, (t,))
    qkv = torch.randn(t, (hq + 2 * hk) * d).to(torch.bfloat16)
    results = []
    for threads in (1, 3):
        buf = qkv.clone()
        q, k, _ = buf.split([hq * d, hk * d, hk * d], dim=-1)
        cpu.rotary_embedding(positions, q, k, d, cache, True, threads)
        results.append(buf)
    assert torch.equal(results[0], results[1])


# ---------------------------------------------------------------- bad inputs


def test_bad_inputs_raise_kernel_argument_error_and_write_nothing():
    x = torch.randn(3, 16)
    w = torch.ones(16)
    out = torch.empty(3, 16)
    bad_norm = [
        (out, x.half(), w.half()),  # dtype
        (out, x.to(torch.bfloat16), w),  # weight dtype differs from x
        (out.to(torch.bfloat16), x, w),  # out dtype differs from x
        (out, x, torch.ones(15)),  # weight size
        (out, x, torch.ones(32)[::2]),  # weight not contiguous
        (torch.empty(3, 15), x, w),  # out shape
        (torch.empty(2, 16), x, w),  # out rows
        (out, torch.randn(16, 3).t(), w),  # last dim not contiguous
        (out, torch.randn(3, 16, 1), w),  # rank
        (torch.empty(16).expand(3, 16), x, w),  # out rows overlap (stride 0)
        (out, x.int(), w),  # integer
    ]
    for args in bad_norm:
        with pytest.raises(KernelArgumentError):
            cpu.rms_norm(*args, EPS)
    with pytest.raises(KernelArgumentError):
        cpu.rms_norm(out, x, w, -1.0)
    with pytest.raises(KernelArgumentError):
        cpu.rms_norm(out, x, w, float("nan"))
    with pytest.raises(KernelArgumentError):
        cpu.rms_norm(out, x, w, EPS, 0)  # num_threads
    with pytest.raises(KernelArgumentError):
        cpu.rms_norm("not a tensor", x, w, EPS)
    buf = torch.randn(4, 16)
    with pytest.raises(KernelArgumentError, match="overlaps"):
        cpu.rms_norm(buf[1:], buf[:3], w, EPS)  # shifted overlap

    residual = torch.randn(3, 16)
    with pytest.raises(KernelArgumentError):
        cpu.fused_add_rms_norm(x, x, w, EPS)  # x is residual
    with pytest.raises(KernelArgumentError):
        cpu.fused_add_rms_norm(x, residual[:2], w, EPS)
    with pytest.raises(KernelArgumentError):
        cpu.fused_add_rms_norm(x, residual.to(torch.bfloat16), w, EPS)

    with pytest.raises(KernelArgumentError, match="even"):
        cpu.silu_and_mul(torch.empty(3, 7), torch.randn(3, 15))
    with pytest.raises(KernelArgumentError):
        cpu.silu_and_mul(torch.empty(3, 7), torch.randn(3, 16))
    with pytest.raises(KernelArgumentError):
        cpu.silu_and_mul(torch.empty(3, 8, dtype=torch.bfloat16), torch.randn(3, 16))
    gate_up = torch.randn(3, 16)
    with pytest.raises(KernelArgumentError, match="overlaps"):
        cpu.silu_and_mul(gate_up[:, :8], gate_up)

    d, max_pos = 8, 10
    cache = torch.randn(max_pos, d)
    q, k = torch.randn(4, 2 * d), torch.randn(4, d)
    q0, k0 = q.clone(), k.clone()
    pos = torch.tensor([0, 1, 2, 3])
    bad_rope = [
        (torch.tensor([0, 1, 10, 3]), q, k, d, cache),  # position == max_position
        (torch.tensor([0, -1, 2, 3]), q, k, d, cache),  # negative position
        (pos.int(), q, k, d, cache),  # positions int32
        (pos[:3], q, k, d, cache),  # T mismatch
        (pos, q, k, 3, cache),  # head_size does not divide
        (pos, q, k, 0, cache),  # head_size 0
        (pos, q, k, 4, cache),  # rot_dim > head_size
        (pos, q, k, d, cache.double()),  # cache dtype
        (pos, q, k, d, cache.to(torch.bfloat16)),
        (pos, q, k, d, torch.randn(max_pos, 7)),  # odd rot_dim
        (pos, q, k, d, torch.randn(d, max_pos).t()),  # cache not contiguous
        (pos, q, k.to(torch.bfloat16), d, cache),  # key dtype differs
        (pos, q.half(), k.half(), d, cache),  # dtype
        (pos, torch.randn(2 * d, 4).t(), k, d, cache),  # last dim not contiguous
        (pos, q, torch.randn(4, d + 1), d, cache),
    ]
    for args in bad_rope:
        with pytest.raises(KernelArgumentError):
            cpu.rotary_embedding(*args)
    assert torch.equal(q, q0) and torch.equal(k, k0)  # checked before anything was written
    with pytest.raises(KernelArgumentError, match=r"positions\[2\] = 10"):
        cpu.rotary_embedding(torch.tensor([0, 1, 10, 3]), q, k, d, cache)
    with pytest.raises(KernelArgumentError):
        cpu.rotary_embedding(pos, q, k, d, cache, True, 100000)  # num_threads


def test_empty_inputs_are_no_ops():
    w = torch.ones(16)
    cpu.rms_norm(torch.empty(0, 16), torch.empty(0, 16), w, EPS)
    cpu.fused_add_rms_norm(torch.empty(0, 16), torch.empty(0, 16), w, EPS)
    cpu.silu_and_mul(torch.empty(0, 8), torch.empty(0, 16))
    cpu.rotary_embedding(torch.empty(0, dtype=torch.int64), torch.empty(0, 16), None, 8, torch.randn(4, 8))
