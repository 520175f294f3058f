"""Every attention backend against dense causal attention on gathered K/V
(and the C++ kernel against the PyTorch reference), over the cases the
contract covers: lengths 1..256 and long ones, block sizes 16 and 32,
MHA/GQA/MQA, shuffled block tables, partial last blocks, chunked prefill with
earlier context, mixed batches, float32 and bfloat16."""

import random

import pytest
import torch

from pagedserve import _core
from pagedserve.errors import KernelArgumentError
from pagedserve.kernels import cpu, get_backend, torch_ref

BACKENDS = ["torch", "cpu"]


def build_case(seed, q_lens, seq_lens, block_size, h, hkv, d=32, dtype=torch.float32):
    """Random K/V written through reshape_and_cache into shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = list(range(num_blocks))
    rng.shuffle(perm)  # non-contiguous, shuffled block tables
    k_cache = torch.zeros(num_blocks, hkv, d, block_size, dtype=dtype)
    v_cache = torch.zeros(num_blocks, hkv, block_size, d, dtype=dtype)
    max_blocks = max(blocks_per_seq)
    tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    slots, keys, values = [], [], []
    i = 0
    for b, n in enumerate(seq_lens):
        ids = perm[i:i + blocks_per_seq[b]]
        i += blocks_per_seq[b]
        tables[b, :len(ids)] = torch.tensor(ids)
        slots += [ids[p // block_size] * block_size + p % block_size for p in range(n)]
    slots = torch.tensor(slots)
    keys = torch.randn(len(slots), hkv, d, generator=g).to(dtype)
    values = torch.randn(len(slots), hkv, d, generator=g).to(dtype)
    torch_ref.reshape_and_cache(keys, values, k_cache, v_cache, slots)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), h, d, generator=g).to(dtype)
    return query, k_cache, v_cache, qsl, torch.tensor(seq_lens, dtype=torch.int32), tables


# bfloat16 stores K/V/Q with an 8-bit mantissa (relative step 2^-8 = 0.4%); with
# float32 accumulation the outputs (weighted means of unit-variance values)
# stay within 2e-2 absolute of the float32 dense result computed from the same
# bfloat16 inputs.
BF16_TOL = 2e-2


def check(case, backend, atol=1e-5, rtol=1e-5, **kw):
    query, k_cache, v_cache, qsl, seq_lens, tables = case
    scale = query.shape[-1] ** -0.5
    got = get_backend(backend).paged_attention(query, k_cache, v_cache, qsl, seq_lens, tables, scale, **kw)
    want = torch_ref.dense_attention(query, k_cache, v_cache, qsl, seq_lens, tables, scale, **kw)
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)
    if backend != "torch":
        ref = torch_ref.paged_attention(query, k_cache, v_cache, qsl, seq_lens, tables, scale, **kw)
        torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("h,hkv", [(4, 4), (8, 2), (6, 1)])  # MHA, GQA, MQA
def test_decode_every_length_up_to_256(backend, block_size, h, hkv):
    lens = list(range(1, 257))
    check(build_case(1, [1] * len(lens), lens, block_size, h, hkv, d=64), backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [16, 32])
def test_long_sequences(backend, block_size):
    # a lone long decode is split along the KV length by the C++ kernel
    check(build_case(2, [1], [2048], block_size, 8, 2, d=64), backend)
    check(build_case(2, [1, 1, 7], [1000, 2048, 1500], block_size, 8, 2, d=64), backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 200])
def test_prefill_from_scratch(backend, n):
    check(build_case(3, [n], [n], 16, 4, 2), backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("d", [32, 64, 128])  # 64 and 128 take the kernel's fixed-size path
def test_chunked_prefill_with_earlier_context_and_mixed_batch(backend, d):
    # decodes, a chunk after 40 cached tokens, a full prefill, a chunk ending mid-block
    q_lens = [1, 24, 33, 1, 5]
    seq_lens = [77, 64, 33, 16, 130]
    check(build_case(4, q_lens, seq_lens, 16, 8, 4, d=d), backend)
    check(build_case(4, q_lens, seq_lens, 32, 8, 4, d=d), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_causal_sees_every_key(backend):
    check(build_case(5, [3, 1], [20, 9], 16, 4, 2), backend, causal=False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("d", [48, 64])
def test_bfloat16_cache_within_tolerance(backend, d):
    check(build_case(6, [1, 9, 1, 20], [300, 40, 17, 2048], 16, 8, 2, d=d, dtype=torch.bfloat16), backend,
          atol=BF16_TOL, rtol=BF16_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reshape_and_cache_writes_only_the_named_slots(backend):
    k_cache = torch.zeros(4, 2, 8, 16)
    v_cache = torch.zeros(4, 2, 16, 8)
    key = torch.arange(16.0).view(1, 2, 8).repeat(2, 1, 1)
    get_backend(backend).reshape_and_cache(key, 2 * key, k_cache, v_cache, torch.tensor([17, 63]))
    assert k_cache.sum() == 2 * key[0].sum() and v_cache.sum() == 4 * key[0].sum()
    assert torch.equal(k_cache[1, :, :, 1], key[0])  # keys transposed: [D, block_size]
    assert torch.equal(v_cache[3, :, 15], 2 * key[0])


def test_cpu_kernel_rejects_bad_arguments_instead_of_reading_out_of_bounds():
    query, k_cache, v_cache, qsl, seq_lens, tables = build_case(7, [1, 1], [20, 33], 16, 4, 2)
    bad_tables = tables.clone()
    bad_tables[1, 2] = k_cache.shape[0]  # one past the last block
    with pytest.raises(KernelArgumentError, match="outside"):
        cpu.paged_attention(query, k_cache, v_cache, qsl, seq_lens, bad_tables, 0.1)
    with pytest.raises(KernelArgumentError, match="columns"):
        cpu.paged_attention(query, k_cache, v_cache, qsl, seq_lens + 40, tables, 0.1)
    with pytest.raises(KernelArgumentError, match="int32"):
        cpu.paged_attention(query, k_cache, v_cache, qsl.long(), seq_lens, tables, 0.1)
    with pytest.raises(KernelArgumentError, match="contiguous"):
        cpu.paged_attention(query, k_cache.transpose(2, 3), v_cache, qsl, seq_lens, tables, 0.1)
    with pytest.raises(KernelArgumentError, match="slot_mapping"):
        cpu.reshape_and_cache(query[:, :2], query[:, :2], k_cache, v_cache,
                              torch.tensor([0, k_cache.shape[0] * 16]))


def test_cpu_kernel_takes_the_cache_without_copying():
    query, k_cache, v_cache, qsl, seq_lens, tables = build_case(8, [1], [40], 16, 4, 2)
    scale = 0.125
    before = cpu.paged_attention(query, k_cache, v_cache, qsl, seq_lens, tables, scale)
    k_cache.mul_(2.0)  # an in-place change of the caller's tensor is seen by the next call
    after = cpu.paged_attention(query, k_cache, v_cache, qsl, seq_lens, tables, scale)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, torch_ref.paged_attention(query, k_cache, v_cache, qsl, seq_lens, tables, scale))


def test_cpu_kernel_scratch_is_independent_of_sequence_length():
    # decodes of length 128 and 2048 run with the same per-worker scratch, O(block_size x heads)
    small = _core.paged_attention_scratch_bytes(12, 12, 64, 16)
    assert small == cpu.scratch_bytes(12, 12, 64, 16)
    assert small <= 4 * (16 * 64 * 2 + 16 * 2 * 64 + 16 * 4)  # K/V block + row state per worker
    assert _core.paged_attention_scratch_bytes(12, 12, 64, 32) > small
