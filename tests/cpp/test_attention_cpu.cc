#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <cstdlib>
#include <algorithm>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "backends/cpu/attention/attention_cpu.h"
#include "backends/cpu/runtime/cpu_features.h"
#include "backends/cpu/runtime/isa_registry.h"
#include "core/errors.h"
#include "contiguous_arg.h"

using namespace pagedserve;
using namespace pagedserve::cpu;

namespace {

using pagedserve::test_support::arg;

// One sequence, one head, D = 2, block_size 2, 3 tokens in blocks {1, 0}
// (square blocks: k_cache [2, 1, D, bs] and v_cache [2, 1, bs, D] look alike).
struct Tiny {
  std::vector<float> k_cache = std::vector<float>(2 * 1 * 2 * 2, 0.f), v_cache = k_cache;
  std::vector<float> query, out;
  std::vector<int32_t> qsl{0, 1}, lens{3}, tables{1, 0};
  Tiny() {
    // keys at positions 0,1 (block 1) and 2 (block 0, offset 0)
    std::vector<float> key{1, 0, 0, 1, 1, 1}, value{1, 2, 3, 4, 5, 6};
    std::vector<int64_t> slots{2, 3, 0};
    reshape_and_cache(arg(key, {3, 1, 2}, DType::kFloat32, "key"), arg(value, {3, 1, 2}, DType::kFloat32, "value"),
                      kc(), vc(), arg(slots, {3}, DType::kInt64, "slot_mapping"));
    query = {0.5f, -0.5f};
    out.assign(2, 0.f);
  }
  TensorArg kc() { return arg(k_cache, {2, 1, 2, 2}, DType::kFloat32, "k_cache"); }
  TensorArg vc() { return arg(v_cache, {2, 1, 2, 2}, DType::kFloat32, "v_cache"); }
  AttentionPlan plan() {
    return AttentionPlan(arg(qsl, {2}, DType::kInt32, "qsl"), arg(lens, {1}, DType::kInt32, "seq_lens"),
                         arg(tables, {1, 2}, DType::kInt32, "block_tables"), 1, 1, 2, 2, 2, true, 2);
  }
  void run() {
    plan().run(arg(out, {1, 1, 2}, DType::kFloat32, "out"), arg(query, {1, 1, 2}, DType::kFloat32, "query"), kc(),
               vc(), 1.0f);
  }
};

// Restores the active ISA variant after a test that switches it.
struct IsaGuard {
  std::string saved = active_isa().name;
  ~IsaGuard() { set_active_isa(saved); }
};

// A random mixed batch (decodes, a chunk with earlier context, a long decode
// that is split along the KV length), run under the active variant: H query
// heads on Hkv KV heads of head_dim D.
std::vector<float> random_case_output(uint32_t seed, int64_t H = 8, int64_t Hkv = 2, int64_t D = 64) {
  const int64_t bs = 16;
  std::vector<int32_t> q_lens{1, 24, 1, 5}, seq_lens{77, 64, 700, 130};
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  int64_t num_blocks = 0;
  std::vector<int32_t> nb;
  for (int32_t n : seq_lens) nb.push_back(static_cast<int32_t>((n + bs - 1) / bs)), num_blocks += nb.back();
  num_blocks += 3;
  std::vector<int32_t> perm(num_blocks);
  for (int32_t i = 0; i < num_blocks; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  const int32_t max_blocks = *std::max_element(nb.begin(), nb.end());
  std::vector<int32_t> tables(seq_lens.size() * max_blocks, -1), qsl{0};
  std::vector<int64_t> slots;
  size_t next = 0;
  for (size_t b = 0; b < seq_lens.size(); ++b) {
    for (int32_t j = 0; j < nb[b]; ++j) tables[b * max_blocks + j] = perm[next++];
    for (int32_t p = 0; p < seq_lens[b]; ++p) slots.push_back(tables[b * max_blocks + p / bs] * bs + p % bs);
    qsl.push_back(qsl.back() + q_lens[b]);
  }
  std::vector<float> k_cache(num_blocks * Hkv * D * bs, 0.f), v_cache = k_cache;
  std::vector<float> key(slots.size() * Hkv * D), value(key.size()), query(qsl.back() * H * D), out(query.size());
  for (float& x : key) x = normal(rng);
  for (float& x : value) x = normal(rng);
  for (float& x : query) x = normal(rng);
  const int64_t T = static_cast<int64_t>(slots.size());
  auto kc = arg(k_cache, {num_blocks, Hkv, D, bs}, DType::kFloat32, "k_cache");
  auto vc = arg(v_cache, {num_blocks, Hkv, bs, D}, DType::kFloat32, "v_cache");
  reshape_and_cache(arg(key, {T, Hkv, D}, DType::kFloat32, "key"), arg(value, {T, Hkv, D}, DType::kFloat32, "value"),
                    kc, vc, arg(slots, {T}, DType::kInt64, "slot_mapping"));
  const int64_t B = static_cast<int64_t>(seq_lens.size());
  AttentionPlan plan(arg(qsl, {B + 1}, DType::kInt32, "qsl"), arg(seq_lens, {B}, DType::kInt32, "seq_lens"),
                     arg(tables, {B, max_blocks}, DType::kInt32, "block_tables"), H, Hkv, D, bs, num_blocks, true, 4,
                     0, /*split_kv=*/true);
  EXPECT_GT(plan.num_split_groups(), 0);  // the long decode is split
  const int64_t nq = qsl.back();
  plan.run(arg(out, {nq, H, D}, DType::kFloat32, "out"), arg(query, {nq, H, D}, DType::kFloat32, "query"), kc, vc,
           1.f / std::sqrt(static_cast<float>(D)));
  return out;
}

}  // namespace

TEST(AttentionCpu, SmallExactCase) {
  Tiny t;
  t.run();
  // scores: q.k = 0.5, -0.5, 0 -> softmax weights w_i = e^s_i / sum
  const double e0 = std::exp(0.5), e1 = std::exp(-0.5), e2 = 1.0, z = e0 + e1 + e2;
  EXPECT_NEAR(t.out[0], (1 * e0 + 3 * e1 + 5 * e2) / z, 1e-6);
  EXPECT_NEAR(t.out[1], (2 * e0 + 4 * e1 + 6 * e2) / z, 1e-6);
}

TEST(AttentionCpu, BlockIdOutOfRangeIsRejectedWhenThePlanIsBuilt) {
  Tiny t;
  t.tables = {1, 7};
  EXPECT_THROW(t.plan(), KernelArgumentError);
  t.tables = {-1, 0};
  EXPECT_THROW(t.plan(), KernelArgumentError);
}

TEST(AttentionCpu, AbsurdGeometryIsRejectedBeforeAnyIndexIsComputed) {
  Tiny t;
  const auto make = [&](int64_t h, int64_t hkv, int64_t d, int64_t bs, int64_t nb, int threads) {
    return AttentionPlan(arg(t.qsl, {2}, DType::kInt32, "qsl"), arg(t.lens, {1}, DType::kInt32, "seq_lens"),
                         arg(t.tables, {1, 2}, DType::kInt32, "block_tables"), h, hkv, d, bs, nb, true, threads);
  };
  EXPECT_THROW(make(1, 1, 2, INT64_MAX, 2, 1), KernelArgumentError);  // (len + bs - 1) would overflow
  EXPECT_THROW(make(1, 1, int64_t{1} << 40, 2, 2, 1), KernelArgumentError);
  EXPECT_THROW(make(int64_t{1} << 40, 1, 2, 2, 2, 1), KernelArgumentError);
  EXPECT_THROW(make(1, 1, 2, 2, int64_t{1} << 33, 1), KernelArgumentError);
  EXPECT_THROW(make(1, 1, 2, 2, 2, 0), KernelArgumentError);
  EXPECT_THROW(make(1, 1, 2, 2, 2, 100000), KernelArgumentError);
  EXPECT_NO_THROW(make(1, 1, 2, 2, 2, 3));
}

TEST(AttentionCpu, TooFewBlockTableColumnsIsRejected) {
  Tiny t;
  t.lens = {5};  // needs 3 blocks, table has 2 columns
  EXPECT_THROW(t.plan(), KernelArgumentError);
}

TEST(AttentionCpu, QueryLongerThanSequenceIsRejected) {
  Tiny t;
  t.lens = {0};
  EXPECT_THROW(t.plan(), KernelArgumentError);
  t.lens = {3};
  t.qsl = {0, 2};  // claims 2 query tokens, query has 1: caught when a layer runs
  AttentionPlan p = t.plan();
  EXPECT_THROW(p.run(arg(t.out, {1, 1, 2}, DType::kFloat32, "out"),
                     arg(t.query, {1, 1, 2}, DType::kFloat32, "query"), t.kc(), t.vc(), 1.0f),
               KernelArgumentError);
}

TEST(AttentionCpu, SlotOutOfRangeIsRejectedBeforeWriting) {
  Tiny t;
  std::vector<float> key{9, 9, 9, 9}, value = key;
  std::vector<int64_t> slots{1, 4};  // 4 slots in the cache: 4 is outside
  EXPECT_THROW(reshape_and_cache(arg(key, {2, 1, 2}, DType::kFloat32, "key"),
                                 arg(value, {2, 1, 2}, DType::kFloat32, "value"), t.kc(), t.vc(),
                                 arg(slots, {2}, DType::kInt64, "slot_mapping")),
               KernelArgumentError);
  EXPECT_EQ(t.v_cache[2], 0.f);  // slot 1 (block 0, offset 1) was valid but not written
  EXPECT_EQ(t.v_cache[3], 0.f);
  EXPECT_EQ(t.k_cache[1], 0.f);
}

TEST(AttentionCpu, WrongDtypeOrShapeIsRejected) {
  Tiny t;
  std::vector<float> q3(3, 0.f), o3(3, 0.f);
  AttentionPlan p = t.plan();
  EXPECT_THROW(p.run(arg(o3, {1, 1, 3}, DType::kFloat32, "out"), arg(q3, {1, 1, 3}, DType::kFloat32, "query"),
                     t.kc(), t.vc(), 1.0f),
               KernelArgumentError);
  std::vector<int64_t> qsl64{0, 1};
  EXPECT_THROW(AttentionPlan(arg(qsl64, {2}, DType::kInt64, "qsl"), arg(t.lens, {1}, DType::kInt32, "seq_lens"),
                             arg(t.tables, {1, 2}, DType::kInt32, "block_tables"), 1, 1, 2, 2, 2, true, 1),
               KernelArgumentError);
  std::vector<float> small(4, 0.f);  // a cache with fewer blocks than the plan was built for
  EXPECT_THROW(p.run(arg(t.out, {1, 1, 2}, DType::kFloat32, "out"), arg(t.query, {1, 1, 2}, DType::kFloat32, "query"),
                     arg(small, {1, 1, 2, 2}, DType::kFloat32, "k_cache"), t.vc(), 1.0f),
               KernelArgumentError);
}

TEST(AttentionCpu, KeysAreStoredTransposedPerBlock) {
  Tiny t;
  // block 1 holds positions 0 (key 1,0) and 1 (key 0,1): K^T rows are (1,0), (0,1);
  // block 0 offset 0 holds position 2 (key 1,1): K^T column 0 = (1,1)
  EXPECT_EQ((std::vector<float>(t.k_cache.begin() + 4, t.k_cache.end())), (std::vector<float>{1, 0, 0, 1}));
  EXPECT_EQ(t.k_cache[0], 1.f);
  EXPECT_EQ(t.k_cache[2], 1.f);
  EXPECT_EQ(t.v_cache[0], 5.f);  // V rows stay [bs, D]
  EXPECT_EQ(t.v_cache[1], 6.f);
}

TEST(AttentionCpu, ScratchDoesNotDependOnSequenceLength) {
  // the signature has no length at all; check it is small and grows with block size
  EXPECT_LT(paged_attention_scratch_bytes(12, 12, 64, 16), 64u * 1024);
  EXPECT_GT(paged_attention_scratch_bytes(12, 12, 64, 32), paged_attention_scratch_bytes(12, 12, 64, 16));
}

TEST(CpuIsa, TheBestSupportedVariantIsActiveUnlessForced) {
  const auto& all = compiled_isas();
  ASSERT_FALSE(all.empty());
  const char* forced = std::getenv("PAGEDSERVE_CPU_ISA");
  std::string best;
  for (const IsaVariant& v : all) {
    if (v.supported()) best = v.name;
  }
  const std::string active = active_isa().name;
  EXPECT_EQ(active, forced != nullptr && *forced ? std::string(forced) : best);
  // Runs under emulated CPUs (tests/cpp/CMakeLists.txt) say which variant they expect.
  if (const char* expect = std::getenv("PAGEDSERVE_EXPECT_ISA")) EXPECT_EQ(active, expect);
  std::string features;
  for (const auto& f : cpu_features().names()) features += f + " ";
  std::cout << "[ isa ] active CPU kernel variant: " << active << " (CPU features: " << features << ")\n";
  if (cpu_features().x86_64_v4()) EXPECT_TRUE(cpu_features().x86_64_v3());
}

TEST(CpuIsa, EveryRunnableVariantGivesTheSameResult) {
  IsaGuard guard;
  std::vector<float> reference;
  std::string reference_isa;
  int ran = 0;
  for (const IsaVariant& v : compiled_isas()) {
    if (!v.supported()) std::cout << "[ isa ] skipped " << v.name << ": this CPU lacks " << v.requires_ << "\n";
  }
  for (const std::string& name : variants_for(KernelFamily::kAttention)) {  // each attention table once
    set_active_isa(name);
    Tiny t;
    t.run();
    const double e0 = std::exp(0.5), e1 = std::exp(-0.5), z = e0 + e1 + 1.0;
    EXPECT_NEAR(t.out[0], (1 * e0 + 3 * e1 + 5) / z, 1e-6) << name;
    std::vector<float> out = random_case_output(7);
    const std::vector<float> mqa = random_case_output(8, 4, 1, 256);  // Gemma 3's heads: the D = 256 tiles
    out.insert(out.end(), mqa.begin(), mqa.end());
    if (reference.empty()) {
      reference = out;
      reference_isa = name;
    } else {
      for (size_t i = 0; i < out.size(); ++i) {
        ASSERT_NEAR(out[i], reference[i], 1e-5) << name << " vs " << reference_isa << " at " << i;
      }
    }
    std::cout << "[ isa ] ran " << name << "\n";
    ++ran;
  }
  EXPECT_GE(ran, 1);
}

TEST(CpuIsa, AVariantThisCpuCannotRunIsRefusedNotExecuted) {
  IsaGuard guard;
  EXPECT_THROW(set_active_isa("no-such-isa"), InvalidArgumentError);
  for (const IsaVariant& v : compiled_isas()) {
    if (!v.supported()) EXPECT_THROW(set_active_isa(v.name), InvalidArgumentError) << v.name;
  }
}

namespace {

// The bits of query token `row` (all heads) of `seq` in a step of several
// sequences: sequence b has q_lens[b] query tokens, the last of its
// seq_lens[b] positions; every sequence's K/V are the same random rows
// (position p of any sequence holds key p, value p, of each KV head), so a
// query token sees the same keys whichever sequence and step it is in.
std::vector<uint32_t> row_bits(const std::vector<int32_t>& q_lens, const std::vector<int32_t>& seq_lens, int64_t seq,
                               int64_t row, int64_t H, int64_t Hkv, int64_t D, int threads, int64_t window = 0) {
  const int64_t bs = 16, max_len = 300;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  std::vector<float> key(max_len * Hkv * D), value(key.size()), qrow(max_len * H * D);
  for (float& x : key) x = normal(rng);
  for (float& x : value) x = normal(rng);
  for (float& x : qrow) x = normal(rng);  // the query of position p: qrow[p]
  const int64_t B = static_cast<int64_t>(seq_lens.size());
  const int32_t max_blocks = static_cast<int32_t>((max_len + bs - 1) / bs);
  const int64_t num_blocks = B * max_blocks;
  std::vector<int32_t> tables(B * max_blocks), qsl{0};
  for (int64_t i = 0; i < B * max_blocks; ++i) tables[i] = static_cast<int32_t>(num_blocks - 1 - i);  // scattered
  std::vector<float> k_cache(num_blocks * Hkv * D * bs, 0.f), v_cache = k_cache, query;
  auto kc = arg(k_cache, {num_blocks, Hkv, D, bs}, DType::kFloat32, "k_cache");
  auto vc = arg(v_cache, {num_blocks, Hkv, bs, D}, DType::kFloat32, "v_cache");
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int64_t> slots;
    for (int32_t p = 0; p < seq_lens[b]; ++p) slots.push_back(tables[b * max_blocks + p / bs] * int64_t{bs} + p % bs);
    const int64_t T = seq_lens[b];
    std::vector<float> kb(key.begin(), key.begin() + T * Hkv * D), vb(value.begin(), value.begin() + T * Hkv * D);
    reshape_and_cache(arg(kb, {T, Hkv, D}, DType::kFloat32, "key"), arg(vb, {T, Hkv, D}, DType::kFloat32, "value"),
                      kc, vc, arg(slots, {T}, DType::kInt64, "slot_mapping"));
    for (int32_t p = seq_lens[b] - q_lens[b]; p < seq_lens[b]; ++p) {
      query.insert(query.end(), qrow.begin() + p * H * D, qrow.begin() + (p + 1) * H * D);
    }
    qsl.push_back(qsl.back() + q_lens[b]);
  }
  const int64_t nq = qsl.back();
  std::vector<float> out(query.size());
  AttentionPlan plan(arg(qsl, {B + 1}, DType::kInt32, "qsl"), arg(seq_lens, {B}, DType::kInt32, "seq_lens"),
                     arg(tables, {B, max_blocks}, DType::kInt32, "block_tables"), H, Hkv, D, bs, num_blocks, true,
                     threads, window);
  EXPECT_EQ(plan.num_split_groups(), 0);  // never split along the KV length unless asked (split_kv)
  if (threads > 1 && B == 1 && q_lens[0] == 1 && H > Hkv) {
    EXPECT_GT(plan.num_work_items(), Hkv);  // a lone decode's items are split over their query heads
  }
  plan.run(arg(out, {nq, H, D}, DType::kFloat32, "out"), arg(query, {nq, H, D}, DType::kFloat32, "query"), kc, vc,
           0.125f);
  std::vector<uint32_t> bits(H * D);
  std::memcpy(bits.data(), out.data() + (qsl[seq] + row) * H * D, bits.size() * sizeof(float));
  return bits;
}

}  // namespace

// Batch invariance of the kernel: a query token's output is the same bits
// whatever else its step holds: alone (a decode), as the last row of a chunk
// or of a whole prefill, beside other sequences' decodes and chunks, and on 1
// or 2 threads; for MHA (one row per KV head in a decode, a full tile of rows
// in a prefill) and GQA, in every variant this CPU runs; on 2 threads a lone
// decode's items are split over their query heads. Split-KV (split_kv, a long
// decode in a small step) is outside this: its merge sums in another order.
// One instance per (query heads, KV heads, sliding window): separate tests, so
// that a sharded run (the qemu-user runs, tests/cpp/CMakeLists.txt) spreads them.
struct RowIndependenceCase {
  int64_t num_heads, num_kv_heads, window;  // window 40: narrower than the longer sequences
};

class AttentionCpuRows : public ::testing::TestWithParam<RowIndependenceCase> {};

TEST_P(AttentionCpuRows, AQueryTokensOutputDoesNotDependOnTheRestOfItsStep) {
  IsaGuard guard;
  const int64_t H = GetParam().num_heads, Hkv = GetParam().num_kv_heads, window = GetParam().window, D = 64;
  int ran = 0;
  for (const IsaVariant& v : compiled_isas()) {
    if (!v.supported() || std::string(v.attention().isa) != v.name) continue;  // unsupported, or ran already
    set_active_isa(v.name);
    for (int32_t len : {1, 17, 70, 200}) {
      const auto row_bits = [&](const std::vector<int32_t>& q, const std::vector<int32_t>& l, int64_t seq,
                                int64_t row, int64_t h, int64_t hkv, int64_t d, int threads) {
        return ::row_bits(q, l, seq, row, h, hkv, d, threads, window);
      };
      const auto alone = row_bits({1}, {len}, 0, 0, H, Hkv, D, 1);
      const auto expect_same = [&](const std::vector<uint32_t>& got, const char* what) {
        EXPECT_EQ(got, alone) << v.name << " H=" << H << " Hkv=" << Hkv << " window=" << window << " len=" << len
                              << ": " << what;
      };
      expect_same(row_bits({1}, {len}, 0, 0, H, Hkv, D, 2), "alone on 2 threads");
      expect_same(row_bits({len}, {len}, 0, len - 1, H, Hkv, D, 2), "the last row of the whole prefill");
      if (len >= 5) expect_same(row_bits({5}, {len}, 0, 4, H, Hkv, D, 1), "the last row of a 5-token chunk");
      if (len >= 20) expect_same(row_bits({19}, {len}, 0, 18, H, Hkv, D, 2), "the last row of a 19-token chunk");
      expect_same(row_bits({3, 1, 1}, {40, 90, len}, 2, 0, H, Hkv, D, 2), "a decode beside a chunk and a decode");
      expect_same(row_bits({1, 1, 1, 1, 1, 1, 1, 1}, {len, 9, 33, 64, 65, 128, 250, 3}, 0, 0, H, Hkv, D, 2),
                  "the first of 8 decodes");
    }
    ++ran;
  }
  EXPECT_GE(ran, 1);
}

INSTANTIATE_TEST_SUITE_P(HeadsAndWindows, AttentionCpuRows,
                         ::testing::Values(RowIndependenceCase{4, 4, 0}, RowIndependenceCase{4, 4, 40},
                                           RowIndependenceCase{6, 2, 0}, RowIndependenceCase{6, 2, 40},
                                           RowIndependenceCase{4, 1, 0}, RowIndependenceCase{4, 1, 40}),
                         [](const ::testing::TestParamInfo<RowIndependenceCase>& info) {
                           const RowIndependenceCase& c = info.param;
                           return "heads" + std::to_string(c.num_heads) + "_kv" + std::to_string(c.num_kv_heads) +
                                  "_window" + std::to_string(c.window);
                         });
