#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "attention_cpu.h"
#include "errors.h"

using namespace pagedserve;

namespace {

template <typename T>
TensorArg arg(std::vector<T>& v, std::vector<int64_t> shape, DType dtype, const char* name) {
  TensorArg a;
  a.data = v.data();
  a.dtype = dtype;
  a.shape = shape;
  a.strides.assign(shape.size(), 1);
  for (size_t i = shape.size(); i-- > 1;) a.strides[i - 1] = a.strides[i] * shape[i];
  a.name = name;
  return a;
}

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
  void run() {
    paged_attention(arg(out, {1, 1, 2}, DType::kFloat32, "out"), arg(query, {1, 1, 2}, DType::kFloat32, "query"),
                    kc(), vc(), arg(qsl, {2}, DType::kInt32, "qsl"), arg(lens, {1}, DType::kInt32, "seq_lens"),
                    arg(tables, {1, 2}, DType::kInt32, "block_tables"), 1.0f, true, 2);
  }
};

}  // namespace

TEST(AttentionCpu, SmallExactCase) {
  Tiny t;
  t.run();
  // scores: q.k = 0.5, -0.5, 0 -> softmax weights w_i = e^s_i / sum
  const double e0 = std::exp(0.5), e1 = std::exp(-0.5), e2 = 1.0, z = e0 + e1 + e2;
  EXPECT_NEAR(t.out[0], (1 * e0 + 3 * e1 + 5 * e2) / z, 1e-6);
  EXPECT_NEAR(t.out[1], (2 * e0 + 4 * e1 + 6 * e2) / z, 1e-6);
}

TEST(AttentionCpu, BlockIdOutOfRangeIsRejected) {
  Tiny t;
  t.tables = {1, 7};
  EXPECT_THROW(t.run(), KernelArgumentError);
  t.tables = {-1, 0};
  EXPECT_THROW(t.run(), KernelArgumentError);
}

TEST(AttentionCpu, TooFewBlockTableColumnsIsRejected) {
  Tiny t;
  t.lens = {5};  // needs 3 blocks, table has 2 columns
  EXPECT_THROW(t.run(), KernelArgumentError);
}

TEST(AttentionCpu, QueryLongerThanSequenceIsRejected) {
  Tiny t;
  t.lens = {0};
  EXPECT_THROW(t.run(), KernelArgumentError);
  t.lens = {3};
  t.qsl = {0, 2};  // claims 2 query tokens, query has 1
  EXPECT_THROW(t.run(), KernelArgumentError);
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
  EXPECT_THROW(paged_attention(arg(o3, {1, 1, 3}, DType::kFloat32, "out"), arg(q3, {1, 1, 3}, DType::kFloat32, "query"),
                               t.kc(), t.vc(), arg(t.qsl, {2}, DType::kInt32, "qsl"),
                               arg(t.lens, {1}, DType::kInt32, "seq_lens"),
                               arg(t.tables, {1, 2}, DType::kInt32, "block_tables"), 1.0f, true, 1),
               KernelArgumentError);
  std::vector<int64_t> qsl64{0, 1};
  EXPECT_THROW(paged_attention(arg(t.out, {1, 1, 2}, DType::kFloat32, "out"),
                               arg(t.query, {1, 1, 2}, DType::kFloat32, "query"), t.kc(), t.vc(),
                               arg(qsl64, {2}, DType::kInt64, "qsl"), arg(t.lens, {1}, DType::kInt32, "seq_lens"),
                               arg(t.tables, {1, 2}, DType::kInt32, "block_tables"), 1.0f, true, 1),
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
