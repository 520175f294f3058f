"""The attention parity suite: every registered backend, under every kernel
variant it has (the CPU backend's ISA builds), against dense causal attention
over the raw K/V (no paging), over the cases the contract covers: lengths
1..256 and long ones, block sizes 16 and 32, MHA/GQA/MQA, shuffled block
tables, partial last blocks, chunked prefill with earlier context, mixed
batches, float32 and bfloat16. Each backend writes the K/V through its own
reshape_and_cache into its own layout. A variant or backend this machine
cannot run is skipped with the reason."""

import random
from dataclasses import dataclass

import pytest
import torch

from pagedserve import _core
from pagedserve.errors import KernelArgumentError
from pagedserve.kernels import backend_names, get_backend_class, why_not
from pagedserve.kernels import cpu as cpu_backend
from pagedserve.kernels.backend import AttentionFeatures, AttentionMetadata, AttentionSpec
from pagedserve.kernels.torch_ref import dense_attention


def kernel_params():
    """One pytest param per (backend, kernel variant) in the registry, with skip
    marks naming why this machine cannot run it."""
    params = []
    for name in backend_names():
        cls = get_backend_class(name)
        why = why_not(cls, "cpu")
        variants = cls.variants() or [None]
        for v in variants:
            vid = name if v is None else f"{name}-{v.name}"
            reason = why or (None if v is None or v.available else f"{vid}: {v.reason}")
            marks = [pytest.mark.skip(reason=reason)] if reason else []
            params.append(pytest.param((name, v.name if v else None), id=vid, marks=marks))
    return params


@pytest.fixture(params=kernel_params())
def backend_cls(request):
    """The backend class, with the param's kernel variant active for the test."""
    name, variant = request.param
    cls = get_backend_class(name)
    before = cls.active_variant()
    if variant is not None:
        cls.use_variant(variant)
    yield cls
    if variant is not None:
        cls.use_variant(before)


@dataclass
class Case:
    backend: object
    query: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    md: AttentionMetadata
    keys: list  # per sequence [seq_len, Hkv, D], as stored (dtype-rounded)
    values: list


def build_case(cls, seed, q_lens, seq_lens, block_size, h, hkv, d=32, dtype=torch.float32, causal=True) -> Case:
    """Random K/V written through the backend's reshape_and_cache into shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = list(range(num_blocks))
    rng.shuffle(perm)  # non-contiguous, shuffled block tables
    backend = cls(AttentionSpec(h, hkv, d, block_size, num_blocks, dtype))
    k_cache, v_cache = backend.split_kv_cache(backend.allocate_kv_cache(1)[0])
    tables = torch.full((len(seq_lens), max(blocks_per_seq)), -1, dtype=torch.int32)
    slots, keys, values = [], [], []
    i = 0
    for b, n in enumerate(seq_lens):
        ids = perm[i:i + blocks_per_seq[b]]
        i += blocks_per_seq[b]
        tables[b, :len(ids)] = torch.tensor(ids)
        slots += [ids[p // block_size] * block_size + p % block_size for p in range(n)]
        keys.append(torch.randn(n, hkv, d, generator=g).to(dtype))
        values.append(torch.randn(n, hkv, d, generator=g).to(dtype))
    backend.reshape_and_cache(torch.cat(keys), torch.cat(values), k_cache, v_cache, torch.tensor(slots))
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), h, d, generator=g).to(dtype)
    md = AttentionMetadata(torch.tensor(slots), qsl, torch.tensor(seq_lens, dtype=torch.int32), tables, causal)
    return Case(backend, query, k_cache, v_cache, md, keys, values)


# bfloat16 stores K/V/Q with an 8-bit mantissa (relative step 2^-8 = 0.4%); with
# float32 accumulation the outputs (weighted means of unit-variance values,
# rounded to bfloat16 at the end) stay within 2e-2 of the float32 dense result
# computed from the same bfloat16 inputs.
BF16_TOL = 2e-2


def check(case: Case, atol=1e-5, rtol=1e-5, sliding_window=None, logit_softcap=None):
    features = AttentionFeatures(sliding_window=sliding_window, logit_softcap=logit_softcap)
    missing = type(case.backend).unsupported_features(features)
    if missing:
        pytest.skip(f"the {case.backend.name} backend does not implement {', '.join(missing)}")
    scale = case.query.shape[-1] ** -0.5
    plan = case.backend.make_plan(case.md)
    got = case.backend.paged_attention(case.query, case.k_cache, case.v_cache, plan, scale,
                                       sliding_window=sliding_window, logit_softcap=logit_softcap)
    want = dense_attention(case.query, case.keys, case.values, case.md.query_start_loc, scale, case.md.causal,
                           sliding_window, logit_softcap)
    assert got.shape == case.query.shape and got.dtype == case.query.dtype
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("h,hkv", [(4, 4), (8, 2), (6, 1)])  # MHA, GQA, MQA
def test_decode_every_length_up_to_256(backend_cls, block_size, h, hkv):
    lens = list(range(1, 257))
    check(build_case(backend_cls, 1, [1] * len(lens), lens, block_size, h, hkv, d=64))


@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_with_head_size_256_and_one_kv_head(backend_cls, block_size):
    # Gemma 3's shape (4 query heads on one KV head of 256): the fixed-size tile path, every length to 96
    lens = list(range(1, 97))
    check(build_case(backend_cls, 5, [1] * len(lens), lens, block_size, 4, 1, d=256))


@pytest.mark.parametrize("block_size", [16, 32])
def test_long_sequences(backend_cls, block_size):
    # a lone long decode is split over its query heads by the C++ kernel
    check(build_case(backend_cls, 2, [1], [2048], block_size, 8, 2, d=64))
    check(build_case(backend_cls, 2, [1, 1, 7], [1000, 2048, 1500], block_size, 8, 2, d=64))


@pytest.mark.parametrize("n", [1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 200])
def test_prefill_from_scratch(backend_cls, n):
    check(build_case(backend_cls, 3, [n], [n], 16, 4, 2))


@pytest.mark.parametrize("d", [32, 64, 128, 256])  # 64, 128 and 256 take the C++ kernel's fixed-size path
def test_chunked_prefill_with_earlier_context_and_mixed_batch(backend_cls, d):
    # decodes, a chunk after 40 cached tokens, a full prefill, a chunk ending mid-block
    q_lens = [1, 24, 33, 1, 5]
    seq_lens = [77, 64, 33, 16, 130]
    check(build_case(backend_cls, 4, q_lens, seq_lens, 16, 8, 4, d=d))
    check(build_case(backend_cls, 4, q_lens, seq_lens, 32, 8, 4, d=d))


def test_non_causal_sees_every_key(backend_cls):
    check(build_case(backend_cls, 5, [3, 1], [20, 9], 16, 4, 2, causal=False))


@pytest.mark.parametrize("d", [48, 64])
def test_bfloat16_cache_within_tolerance(backend_cls, d):
    check(build_case(backend_cls, 6, [1, 9, 1, 20], [300, 40, 17, 2048], 16, 8, 2, d=d, dtype=torch.bfloat16),
          atol=BF16_TOL, rtol=BF16_TOL)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window", [1, 17, 40])
def test_sliding_window_decode_every_length_up_to_256(backend_cls, block_size, window):
    lens = list(range(1, 257))
    check(build_case(backend_cls, 13, [1] * len(lens), lens, block_size, 8, 2, d=64), sliding_window=window)


@pytest.mark.parametrize("block_size", [16, 32])
def test_sliding_window_long_sequences_and_chunked_prefill(backend_cls, block_size):
    # a long decode (split along the KV length inside the window), chunks that start past the window
    q_lens, seq_lens = [1, 1, 40, 7, 33], [1000, 2048, 300, 1000, 70]
    check(build_case(backend_cls, 14, q_lens, seq_lens, block_size, 8, 2, d=64), sliding_window=64)
    check(build_case(backend_cls, 14, q_lens, seq_lens, block_size, 8, 2, d=64), sliding_window=500)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("cap", [5.0, 50.0])
def test_logit_softcap_every_length_up_to_256_and_1000(backend_cls, block_size, cap):
    lens = list(range(1, 257)) + [1000]
    case = build_case(backend_cls, 15, [1] * len(lens), lens, block_size, 4, 2, d=64)
    case.query.mul_(4.0)  # scores of a few units: the cap bends them
    check(case, logit_softcap=cap)
    check(build_case(backend_cls, 16, [24, 1, 33], [64, 1000, 33], block_size, 8, 4, d=64), logit_softcap=cap)


def test_window_and_softcap_together_in_bfloat16(backend_cls):
    """Gemma 2's sliding layers: both at once, bfloat16 cache."""
    check(build_case(backend_cls, 17, [1, 9, 1, 20], [300, 40, 17, 1000], 16, 8, 2, d=64, dtype=torch.bfloat16),
          atol=BF16_TOL, rtol=BF16_TOL, sliding_window=48, logit_softcap=50.0)


def test_a_decode_past_the_window_reads_only_in_window_blocks():
    case = _cpu_case(18, [1], [1000], 16, 8, 2, d=64)
    plans = case.backend.make_plan(case.md)
    full, windowed = plans.for_window(None), plans.for_window(64)
    # 63 blocks per KV head without a window; the 64-key window spans at most 5 blocks of 16 (per work item:
    # on several threads a lone decode's items are split over the group's query heads, each reading the blocks)
    assert full.num_work_items % 2 == 0 and windowed.num_work_items % 2 == 0
    assert full.num_blocks_visited == full.num_work_items * 63
    assert windowed.num_blocks_visited <= windowed.num_work_items * 5
    assert plans.for_window(64) is windowed  # built once per step and window, shared by the layers


def test_one_plan_serves_every_layer(backend_cls):
    """The plan depends on the metadata only: built once, it serves a second
    layer with other K/V in the same slots (as the engine uses it) and each
    layer gets its own result."""
    case = build_case(backend_cls, 9, [1, 6], [40, 70], 16, 4, 2)
    b, scale = case.backend, 32 ** -0.5
    k2, v2 = b.split_kv_cache(b.allocate_kv_cache(1)[0])
    keys2 = [torch.randn(k.shape) for k in case.keys]
    values2 = [torch.randn(v.shape) for v in case.values]
    b.reshape_and_cache(torch.cat(keys2), torch.cat(values2), k2, v2, case.md.slot_mapping)
    plan = b.make_plan(case.md)
    for (k_cache, v_cache), keys, values in [((case.k_cache, case.v_cache), case.keys, case.values),
                                             ((k2, v2), keys2, values2)]:
        got = b.paged_attention(case.query, k_cache, v_cache, plan, scale)
        want = dense_attention(case.query, keys, values, case.md.query_start_loc, scale)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_reshape_and_cache_writes_only_the_named_slots(backend_cls):
    """Slots 17 and 63 hold the keys/values; a negative slot writes nothing; the
    rest of the store stays zero, and the attention of a query over exactly
    those positions reads them back."""
    backend = backend_cls(AttentionSpec(2, 2, 8, 16, 4, torch.float32))
    store = backend.allocate_kv_cache(1)
    k_cache, v_cache = backend.split_kv_cache(store[0])
    key = torch.arange(16.0).view(1, 2, 8).repeat(3, 1, 1)
    backend.reshape_and_cache(key, 2 * key, k_cache, v_cache, torch.tensor([17, 63, -1]))
    assert k_cache.sum() == 2 * key[0].sum() and v_cache.sum() == 4 * key[0].sum()
    assert store.abs().sum() == 6 * key[0].sum()


def test_cpu_kv_store_is_zeroed_and_on_huge_pages_where_the_os_offers_them():
    """The CPU backend's store is zeroed like every backend's; it asks for
    transparent huge pages before writing it, so on Linux with THP not
    'never' its pages are huge ones (AnonHugePages in the process's smaps
    grows by about its size) unless the kernel had none free."""
    import pathlib
    backend = cpu_backend.CpuAttentionBackend(AttentionSpec(4, 2, 64, 16, 512, torch.float32))

    def anon_huge_kb() -> int:
        rollup = pathlib.Path("/proc/self/smaps_rollup")
        if not rollup.exists():
            return 0
        return next((int(line.split()[1]) for line in rollup.read_text().splitlines()
                     if line.startswith("AnonHugePages:")), 0)

    before = anon_huge_kb()
    store = backend.allocate_kv_cache(3)  # 3 x 2 x 512 blocks x 16 x 128 floats: 24 MiB
    assert store.shape == (3, *backend.kv_cache_shape()) and not store.any()
    assert _core.cpu.advise_huge_pages(store.data_ptr(), 100) == 0  # no whole huge page inside
    if not _core.cpu.huge_pages_available():
        pytest.skip("the OS takes no huge-page advice here (not Linux, or transparent huge pages 'never')")
    assert _core.cpu.advise_huge_pages(store.data_ptr(), store.numel() * 4) >= 10 << 21
    store.fill_(1.0)  # the store's pages come at their first write (zero_store)
    gained = anon_huge_kb() - before
    if gained <= 0:
        pytest.skip("the kernel gave no huge pages (none free); the advice was taken")
    assert gained >= 8 << 10  # at least 8 MiB of the 24 MiB store


def test_cpu_kv_store_is_resident_only_once_written():
    """The store is fresh anonymous memory (cpu.zero_store): allocating 256 MiB of it touches none of its
    pages (a start does not pay for a KV store it has not used), reading it gives zeros, writing it makes it
    resident."""
    import pathlib

    status = pathlib.Path("/proc/self/status")
    if not status.exists():
        pytest.skip("no /proc/self/status to read the resident set size from")

    def rss() -> int:
        return next(int(line.split()[1]) for line in status.read_text().splitlines()
                    if line.startswith("VmRSS:")) * 1024

    before = rss()
    store = cpu_backend.zero_store((64, 1 << 20), torch.float32)  # 256 MiB
    assert rss() - before < 16 << 20
    assert store[::7, ::4099].abs().sum() == 0 and store.is_contiguous() and store.data_ptr() % (2 << 20) == 0
    store.fill_(2.0)
    assert rss() - before > 200 << 20 and float(store[63, -1]) == 2.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_reshape_and_cache_on_threads_writes_what_one_thread_writes(dtype):
    """The C++ reshape_and_cache splits a large call over the pool by (K or V,
    head, element range), each in token order: the caches equal a plain
    per-token reference, byte for byte, on 1 and 2 threads, with a repeated
    slot (the later token wins), skipped tokens (negative slots) and strided
    key/value views of one qkv tensor (the lean forward passes those)."""
    g = torch.Generator().manual_seed(3)
    t, hkv, d, bs, nb = 40, 3, 64, 16, 12
    qkv = torch.randn(t, (4 + 2 * hkv) * d, generator=g).to(dtype)
    key = qkv[:, 4 * d:(4 + hkv) * d].view(t, hkv, d)
    value = qkv[:, (4 + hkv) * d:].view(t, hkv, d)
    slots = torch.randperm(nb * bs, generator=g)[:t]
    slots[7], slots[30] = -1, -5
    slots[25] = slots[3]  # token 25 overwrites token 3
    k_ref, v_ref = torch.zeros(nb, hkv, d, bs, dtype=dtype), torch.zeros(nb, hkv, bs, d, dtype=dtype)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            k_ref[s // bs, :, :, s % bs] = key[i]
            v_ref[s // bs, :, s % bs, :] = value[i]
    for threads in (1, 2):
        k_cache, v_cache = torch.zeros_like(k_ref), torch.zeros_like(v_ref)
        _core.cpu.reshape_and_cache(key, value, k_cache, v_cache, slots, threads)
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref), threads
    with pytest.raises(KernelArgumentError, match="num_threads"):
        _core.cpu.reshape_and_cache(key, value, k_cache, v_cache, slots, 0)


@pytest.mark.parametrize("bad", ["hole", "short_table", "long_query", "block_out_of_range"])
def test_every_backend_refuses_bad_metadata_in_its_plan(backend_cls, bad):
    """The shared checks run in every backend's make_plan: no kernel reads
    through a bad index, whatever the backend."""
    case = build_case(backend_cls, 12, [1, 3], [20, 40], 16, 4, 2)
    md = case.md
    tables, lens, qsl = md.block_tables.clone(), md.seq_lens.clone(), md.query_start_loc.clone()
    if bad == "hole":
        tables[1, 1] = -1  # inside the used range
    elif bad == "short_table":
        lens[1] = 16 * tables.shape[1] + 1
    elif bad == "long_query":
        qsl[1:] += 30  # sequence 0 claims 31 query tokens of its 20
    else:
        tables[0, 0] = case.backend.spec.num_blocks
    with pytest.raises(KernelArgumentError):
        case.backend.make_plan(AttentionMetadata(md.slot_mapping, qsl, lens, tables))


@pytest.mark.parametrize("window,cap", [(0, None), (-3, None), (True, None), (2.5, None), (None, float("nan")),
                                        (None, float("inf")), (None, -1.0), (None, 1e-50), (None, True)])
def test_every_backend_refuses_bad_layer_parameters(backend_cls, window, cap):
    case = build_case(backend_cls, 19, [1], [40], 16, 4, 2)
    plan = case.backend.make_plan(case.md)
    with pytest.raises(KernelArgumentError):
        case.backend.paged_attention(case.query, case.k_cache, case.v_cache, plan, 0.1, sliding_window=window,
                                     logit_softcap=cap)


def test_stale_slots_past_a_sequence_never_leak_into_its_output(backend_cls):
    """Slots a sequence does not own (past its length in its last block) may
    hold anything a block's earlier owner left, NaN included."""
    case = build_case(backend_cls, 20, [1, 5], [21, 37], 16, 4, 2)
    store = case.backend.allocate_kv_cache(1)
    store.fill_(float("nan"))
    k_cache, v_cache = case.backend.split_kv_cache(store[0])
    case.backend.reshape_and_cache(torch.cat(case.keys), torch.cat(case.values), k_cache, v_cache,
                                   case.md.slot_mapping)
    case.k_cache, case.v_cache = k_cache, v_cache
    check(case)
    check(case, sliding_window=9, logit_softcap=7.0)


# ---- the C++ CPU backend's own checks --------------------------------------------

def _cpu_case(*args, **kw):
    return build_case(cpu_backend.CpuAttentionBackend, *args, **kw)


def test_cpu_plan_rejects_bad_metadata_instead_of_reading_out_of_bounds():
    case = _cpu_case(7, [1, 1], [20, 33], 16, 4, 2)
    md, b = case.md, case.backend
    bad_tables = md.block_tables.clone()
    bad_tables[1, 2] = case.k_cache.shape[0]  # one past the last block
    with pytest.raises(KernelArgumentError, match="outside"):
        b.make_plan(AttentionMetadata(md.slot_mapping, md.query_start_loc, md.seq_lens, bad_tables))
    with pytest.raises(KernelArgumentError, match="columns"):
        b.make_plan(AttentionMetadata(md.slot_mapping, md.query_start_loc, md.seq_lens + 40, md.block_tables))
    with pytest.raises(KernelArgumentError, match="int32"):
        b.make_plan(AttentionMetadata(md.slot_mapping, md.query_start_loc.long(), md.seq_lens, md.block_tables))
    plan = b.make_plan(md)
    with pytest.raises(KernelArgumentError, match="contiguous"):
        b.paged_attention(case.query, case.k_cache.transpose(2, 3), case.v_cache, plan, 0.1)
    with pytest.raises(KernelArgumentError, match="query"):  # a layer's tensors checked against the plan
        b.paged_attention(case.query[:1], case.k_cache, case.v_cache, plan, 0.1)
    with pytest.raises(KernelArgumentError, match="slot_mapping"):
        b.reshape_and_cache(case.query[:, :2], case.query[:, :2], case.k_cache, case.v_cache,
                            torch.tensor([0, case.k_cache.shape[0] * 16]))


def test_cpu_kernel_takes_the_cache_without_copying():
    case = _cpu_case(8, [1], [40], 16, 4, 2)
    b, scale = case.backend, 0.125
    plan = b.make_plan(case.md)
    before = b.paged_attention(case.query, case.k_cache, case.v_cache, plan, scale)
    case.k_cache.mul_(2.0)  # an in-place change of the caller's tensor is seen by the next call
    after = b.paged_attention(case.query, case.k_cache, case.v_cache, plan, scale)
    assert not torch.allclose(before, after)
    want = dense_attention(case.query, [2 * k for k in case.keys], case.values, case.md.query_start_loc, scale)
    torch.testing.assert_close(after, want, atol=1e-5, rtol=1e-5)


def test_cpu_kernel_scratch_is_independent_of_sequence_length():
    # decodes of length 128 and 2048 run with the same per-worker scratch, O(block_size x heads)
    small = _core.cpu.paged_attention_scratch_bytes(12, 12, 64, 16)
    assert small == cpu_backend.scratch_bytes(12, 12, 64, 16)
    # per worker: a K/V tile of two blocks, the rows' state (with per-key-lane sums), 64-byte alignment
    assert small <= 4 * (2 * 32 * 64 + 16 * (2 * 64 + 2 + 32) + 16 + 16)
    assert _core.cpu.paged_attention_scratch_bytes(12, 12, 64, 32) > small


def test_cpu_plan_reports_its_variant_and_splits_a_lone_decode_over_heads_or_kv_length():
    case = _cpu_case(11, [1], [2048], 16, 8, 2)
    plan = case.backend.make_plan(case.md).for_window(None)
    assert plan.isa == _core.cpu.kernel_isa()
    assert plan.num_split_groups == 0  # by default never along the KV length (batch invariance)
    if plan.num_threads > 1:
        assert plan.num_work_items > 2  # 2 KV heads cannot keep the threads busy: split over their query heads
    md, s = case.md, case.backend.spec
    split = _core.cpu.AttentionPlan(md.query_start_loc, md.seq_lens, md.block_tables, s.num_heads, s.num_kv_heads,
                                    s.head_dim, s.block_size, s.num_blocks, True, 2, 0, split_kv=True)
    assert split.num_split_groups > 0  # flash-decoding, when asked
    scale = s.head_dim ** -0.5
    out = torch.empty_like(case.query)
    split.run(out, case.query, case.k_cache, case.v_cache, scale, 0.0)
    torch.testing.assert_close(out, case.backend.paged_attention(case.query, case.k_cache, case.v_cache,
                                                                 case.backend.make_plan(md), scale))
