"""The PyTorch paged-attention reference against dense causal attention on
gathered K/V, over the cases the contract covers."""

import random

import pytest
import torch

from pagedserve.kernels import torch_ref


def build_case(seed, q_lens, seq_lens, block_size, h, hkv, d=32, dtype=torch.float32):
    """Random K/V written through reshape_and_cache into shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = list(range(num_blocks))
    rng.shuffle(perm)  # non-contiguous, shuffled block tables
    k_cache = torch.zeros(num_blocks, hkv, block_size, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
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


def check(case, atol=1e-5, rtol=1e-5, **kw):
    query, k_cache, v_cache, qsl, seq_lens, tables = case
    scale = query.shape[-1] ** -0.5
    got = torch_ref.paged_attention(query, k_cache, v_cache, qsl, seq_lens, tables, scale, **kw)
    want = torch_ref.dense_attention(query, k_cache, v_cache, qsl, seq_lens, tables, scale, **kw)
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("h,hkv", [(4, 4), (8, 2), (6, 1)])  # MHA, GQA, MQA
def test_decode_every_length_up_to_256(block_size, h, hkv):
    lens = list(range(1, 257))
    check(build_case(1, [1] * len(lens), lens, block_size, h, hkv))


@pytest.mark.parametrize("block_size", [16, 32])
def test_long_sequences_span_many_tiles(block_size):
    check(build_case(2, [1, 1, 7], [1000, 2048, 1500], block_size, 8, 2))


@pytest.mark.parametrize("n", [1, 15, 16, 17, 63, 64, 65, 200])
def test_prefill_from_scratch(n):
    check(build_case(3, [n], [n], 16, 4, 2))


def test_chunked_prefill_with_earlier_context_and_mixed_batch():
    # decodes, a chunk after 40 cached tokens, a full prefill, a chunk ending mid-block
    q_lens = [1, 24, 33, 1, 5]
    seq_lens = [77, 64, 33, 16, 130]
    check(build_case(4, q_lens, seq_lens, 16, 8, 4))


def test_non_causal_sees_every_key():
    check(build_case(5, [3, 1], [20, 9], 16, 4, 2), causal=False)


def test_bfloat16_cache_within_tolerance():
    check(build_case(6, [1, 9, 1], [300, 40, 17], 16, 8, 2, dtype=torch.bfloat16), atol=2e-2, rtol=2e-2)


def test_reshape_and_cache_writes_only_the_named_slots():
    k_cache = torch.zeros(4, 2, 16, 8)
    v_cache = torch.zeros_like(k_cache)
    key = torch.ones(2, 2, 8)
    torch_ref.reshape_and_cache(key, 2 * key, k_cache, v_cache, torch.tensor([17, 63]))
    assert k_cache.sum() == 2 * 2 * 8
    assert torch.equal(k_cache[1, :, 1], torch.ones(2, 8)) and torch.equal(v_cache[3, :, 15], 2 * torch.ones(2, 8))
