// The Metal kernels (metal/*.metal), run on the CPU through the emulator, against
// a float64 reference and the C++ CPU kernel (csrc/backends/cpu/) on the same
// data: every sequence length 1..256 plus 1000 and 2048, block sizes 16 and 32,
// MHA / GQA / MQA, shuffled block tables with spare blocks, partly filled last
// blocks (unwritten slots hold NaN, so reading one fails the test), chunked
// prefill with earlier context mixed with decodes, split-KV on and off,
// float32 / float16 / bfloat16, several lane execution orders. The plans come
// from the host's own planner (csrc/backends/metal/metal_plan.cc).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backends/cpu/attention/attention_cpu.h"
#include "backends/metal/metal_plan.h"
#include "core/errors.h"
#include "kernel_launchers.h"
#include "../cpp/contiguous_arg.h"

namespace {

namespace mk = metal_emu_kernels;
namespace pmetal = pagedserve::metal;
using pagedserve::DType;
using pagedserve::TensorArg;

using pagedserve::test_support::arg;

const char* dtype_name(mk::Dtype d) {
  return d == mk::Dtype::kFloat32 ? "float32" : d == mk::Dtype::kFloat16 ? "float16" : "bfloat16";
}

size_t elem_bytes(mk::Dtype d) { return d == mk::Dtype::kFloat32 ? 4 : 2; }

// Rounds through the dtype (what the kernels will read).
float round_to(mk::Dtype d, float x) {
  switch (d) {
    case mk::Dtype::kFloat32: return x;
    case mk::Dtype::kFloat16: return static_cast<float>(static_cast<_Float16>(x));
    case mk::Dtype::kBFloat16: return static_cast<float>(static_cast<__bf16>(x));
  }
  return x;
}

// A buffer of n elements of dtype d (float32, or 16-bit storage).
struct Buffer {
  mk::Dtype dtype;
  std::vector<uint8_t> bytes;
  Buffer(mk::Dtype d, size_t n) : dtype(d), bytes(n * elem_bytes(d)) {}
  size_t size() const { return bytes.size() / elem_bytes(dtype); }
  void* data() { return bytes.data(); }
  const void* data() const { return bytes.data(); }
  void set(size_t i, float x) {
    if (dtype == mk::Dtype::kFloat32) std::memcpy(&bytes[i * 4], &x, 4);
    else if (dtype == mk::Dtype::kFloat16) { _Float16 h = static_cast<_Float16>(x); std::memcpy(&bytes[i * 2], &h, 2); }
    else { __bf16 h = static_cast<__bf16>(x); std::memcpy(&bytes[i * 2], &h, 2); }
  }
  float get(size_t i) const {
    if (dtype == mk::Dtype::kFloat32) { float x; std::memcpy(&x, &bytes[i * 4], 4); return x; }
    if (dtype == mk::Dtype::kFloat16) { _Float16 h; std::memcpy(&h, &bytes[i * 2], 2); return static_cast<float>(h); }
    __bf16 h; std::memcpy(&h, &bytes[i * 2], 2); return static_cast<float>(h);
  }
  void fill(float x) { for (size_t i = 0; i < size(); ++i) set(i, x); }
};

// A buffer with NaN guard zones of kGuard elements on both sides: a kernel
// writing out of bounds fails a check with a message (instead of corrupting
// the heap, or landing in allocator slack nobody looks at).
constexpr size_t kGuard = 4096;
struct GuardedBuffer {
  Buffer buf;
  size_t n;
  GuardedBuffer(mk::Dtype d, size_t count) : buf(d, count + 2 * kGuard), n(count) {
    buf.fill(std::numeric_limits<float>::quiet_NaN());
  }
  void* data() { return buf.bytes.data() + kGuard * elem_bytes(buf.dtype); }
  float get(size_t i) const { return buf.get(kGuard + i); }
  void set(size_t i, float x) { buf.set(kGuard + i, x); }
  // Elements of the guard zones that are no longer NaN.
  size_t guard_writes() const {
    size_t bad = 0;
    for (size_t i = 0; i < kGuard; ++i) {
      bad += !std::isnan(buf.get(i));
      bad += !std::isnan(buf.get(kGuard + n + i));
    }
    return bad;
  }
};

struct Shape {
  int H, Hkv, D, bs;
};

struct Result {
  double max_err_ref = 0;  // max |metal - float64 reference| / (atol + rtol |ref|)
  double max_err_cpu = 0;  // the same against the CPU kernel (float32 / bfloat16 caches)
  bool cpu_compared = false;
  bool nan = false;
  pmetal::MetalAttentionPlan plan;
  std::vector<float> out;  // the Metal kernels' output, as float
  mk::Counters counters;
};

struct Tolerance {
  double atol, rtol;
};

// Stated tolerances: float32 1e-5 absolute; float16 and bfloat16 outputs are
// rounded to their 11- and 8-bit significands (2^-11, 2^-8 relative), plus a
// little absolute slack for the accumulation order.
Tolerance tolerance(mk::Dtype d) {
  switch (d) {
    case mk::Dtype::kFloat32: return {1e-5, 0.0};
    case mk::Dtype::kFloat16: return {1e-3, 1e-3};
    case mk::Dtype::kBFloat16: return {8e-3, 8e-3};
  }
  return {0, 0};
}

// One step: sequences with seq_lens[b] keys of which the last q_lens[b] are this
// step's queries. Writes every position's K/V through the emulated
// reshape_and_cache (checked against the source), then runs the planned
// attention and compares.
Result run_case(const Shape& s, const std::vector<int>& seq_lens, const std::vector<int>& q_lens, mk::Dtype dtype,
                const pmetal::MetalPlanOptions& options, const mk::LaunchOptions& launch, uint32_t seed,
                bool causal = true, bool strided_io = false) {
  const int B = static_cast<int>(seq_lens.size());
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;

  // Block tables: each sequence's blocks drawn from a shuffled pool with spares.
  std::vector<int> nb(B);
  int num_blocks = 7, max_blocks = 1;
  for (int b = 0; b < B; ++b) {
    nb[b] = (seq_lens[b] + s.bs - 1) / s.bs;
    num_blocks += nb[b];
    max_blocks = std::max(max_blocks, nb[b]);
  }
  std::vector<int32_t> perm(num_blocks);
  for (int i = 0; i < num_blocks; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> tables(static_cast<size_t>(B) * max_blocks, -1);
  for (int b = 0, next = 0; b < B; ++b) {
    for (int j = 0; j < nb[b]; ++j) tables[static_cast<size_t>(b) * max_blocks + j] = perm[next++];
  }

  // K/V of every position, rounded to the dtype; a few tokens with slot -1 that
  // must not be written.
  std::vector<float> kv_src;  // [P, 2, Hkv, D]
  std::vector<int64_t> slots;
  std::vector<std::pair<int, int>> pos_of;  // (b, position) of each written token
  for (int b = 0; b < B; ++b) {
    for (int p = 0; p < seq_lens[b]; ++p) {
      if (rng() % 97 == 0) {  // a skipped token
        for (int i = 0; i < 2 * s.Hkv * s.D; ++i) kv_src.push_back(round_to(dtype, 100.f + normal(rng)));
        slots.push_back(-1);
        pos_of.push_back({-1, -1});
      }
      for (int i = 0; i < 2 * s.Hkv * s.D; ++i) kv_src.push_back(round_to(dtype, normal(rng)));
      slots.push_back(static_cast<int64_t>(tables[static_cast<size_t>(b) * max_blocks + p / s.bs]) * s.bs + p % s.bs);
      pos_of.push_back({b, p});
    }
  }
  const int P = static_cast<int>(slots.size());
  Buffer kv_in(dtype, kv_src.size());
  for (size_t i = 0; i < kv_src.size(); ++i) kv_in.set(i, kv_src[i]);
  const size_t cache_elems = static_cast<size_t>(num_blocks) * s.Hkv * s.bs * s.D;
  GuardedBuffer k_cache(dtype, cache_elems), v_cache(dtype, cache_elems);  // NaN everywhere
  // key and value are strided views into kv_in [P, 2, Hkv, D] (as a fused qkv projection would give)
  const auto rc = pmetal::make_reshape_and_cache_launch(P, s.Hkv, s.D, s.bs, num_blocks, 2 * s.Hkv * s.D, s.D,
                                                        2 * s.Hkv * s.D, s.D);
  const uint8_t* kv_bytes = kv_in.bytes.data();
  mk::reshape_and_cache(dtype, rc, kv_bytes, kv_bytes + s.Hkv * s.D * elem_bytes(dtype), k_cache.data(),
                        v_cache.data(), slots.data(), launch);
  // every written slot holds its token's K/V; the others are still NaN
  std::vector<char> written(static_cast<size_t>(num_blocks) * s.bs, 0);
  for (int t = 0; t < P; ++t) {
    if (slots[t] < 0) continue;
    written[slots[t]] = 1;
    const int64_t blk = slots[t] / s.bs, off = slots[t] % s.bs;
    for (int h = 0; h < s.Hkv; ++h) {
      for (int d = 0; d < s.D; ++d) {
        const size_t c = ((static_cast<size_t>(blk) * s.Hkv + h) * s.bs + off) * s.D + d;
        const size_t src = ((static_cast<size_t>(t) * 2) * s.Hkv + h) * s.D + d;
        EXPECT_EQ(k_cache.get(c), kv_src[src]);
        EXPECT_EQ(v_cache.get(c), kv_src[src + static_cast<size_t>(s.Hkv) * s.D]);
      }
    }
  }
  for (size_t slot = 0; slot < written.size(); ++slot) {
    if (!written[slot]) EXPECT_TRUE(std::isnan(k_cache.get(slot / s.bs * s.Hkv * s.bs * s.D + (slot % s.bs) * s.D)));
  }
  EXPECT_EQ(k_cache.guard_writes() + v_cache.guard_writes(), 0u) << "reshape_and_cache wrote outside the caches";

  // Queries and metadata.
  std::vector<int32_t> qsl{0}, lens(seq_lens.begin(), seq_lens.end());
  for (int b = 0; b < B; ++b) qsl.push_back(qsl.back() + q_lens[b]);
  const int T = qsl.back();
  std::vector<float> q(static_cast<size_t>(T) * s.H * s.D);
  for (float& x : q) x = round_to(dtype, normal(rng));
  // Contiguous [T, H, D] query and output; with strided_io the query is
  // head-major (token stride D, head stride T * D, as the transpose of an
  // [H, T, D] projection) and the output padded per head (head stride D + 8),
  // so every query/out stride differs and the plan's set_strides matters.
  const int64_t q_tok = strided_io ? s.D : static_cast<int64_t>(s.H) * s.D;
  const int64_t q_head = strided_io ? static_cast<int64_t>(T) * s.D : s.D;
  const int64_t o_head = strided_io ? s.D + 8 : s.D;
  const int64_t o_tok = static_cast<int64_t>(s.H) * o_head;
  Buffer q_buf(dtype, q.size()), q_io(dtype, q.size());
  GuardedBuffer out_buf(dtype, static_cast<size_t>(T) * o_tok);
  for (size_t i = 0; i < q.size(); ++i) q_buf.set(i, q[i]);
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < s.H; ++h) {
      for (int d = 0; d < s.D; ++d) q_io.set(t * q_tok + h * q_head + d, q[(static_cast<size_t>(t) * s.H + h) * s.D + d]);
    }
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.D));

  Result r;
  r.plan = pmetal::make_metal_plan(arg(qsl, {B + 1}, DType::kInt32, "query_start_loc"),
                                   arg(lens, {B}, DType::kInt32, "seq_lens"),
                                   arg(tables, {B, max_blocks}, DType::kInt32, "block_tables"), s.H, s.Hkv, s.D, s.bs,
                                   num_blocks, causal, scale, options);
  r.plan.set_strides(q_tok, q_head, o_tok, o_head);
  mk::AttentionBuffers bufs;
  bufs.query = q_io.data();
  bufs.k_cache = k_cache.data();
  bufs.v_cache = v_cache.data();
  bufs.block_tables = tables.data();
  bufs.seq_lens = lens.data();
  bufs.query_start_loc = qsl.data();
  bufs.out = out_buf.data();
  mk::paged_attention(dtype, r.plan, bufs, launch);
  r.counters = mk::last_counters();
  r.out.resize(q.size());
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < s.H; ++h) {
      for (int d = 0; d < s.D; ++d) r.out[(static_cast<size_t>(t) * s.H + h) * s.D + d] = out_buf.get(t * o_tok + h * o_head + d);
    }
  }
  EXPECT_EQ(out_buf.guard_writes(), 0u) << "the attention kernels wrote outside out";
  if (strided_io) {  // nothing is written into the padding between heads
    for (int64_t i = 0; i < T * o_tok; ++i) {
      if (i % o_head >= s.D) EXPECT_TRUE(std::isnan(out_buf.get(i))) << "write into head padding at " << i;
    }
  }

  // float64 reference from the same rounded K/V: position p of sequence b is
  // the last written token with pos_of == (b, p).
  std::vector<std::vector<int>> token_of(B);
  for (int b = 0; b < B; ++b) token_of[b].assign(seq_lens[b], -1);
  for (int t = 0; t < P; ++t) {
    if (pos_of[t].first >= 0) token_of[pos_of[t].first][pos_of[t].second] = t;
  }
  const Tolerance tol = tolerance(dtype);
  const int group = s.H / s.Hkv;
  std::vector<double> scores, acc(s.D);
  for (int b = 0; b < B; ++b) {
    for (int i = 0; i < q_lens[b]; ++i) {
      const int t = qsl[b] + i;
      const int pos = seq_lens[b] - q_lens[b] + i;
      const int n_keys = causal ? pos + 1 : seq_lens[b];
      for (int h = 0; h < s.H; ++h) {
        const int hk = h / group;
        scores.assign(n_keys, 0.0);
        double m = -INFINITY;
        for (int k = 0; k < n_keys; ++k) {
          const size_t src = (static_cast<size_t>(token_of[b][k]) * 2 * s.Hkv + hk) * s.D;
          double dot = 0;
          for (int d = 0; d < s.D; ++d) dot += static_cast<double>(q[(static_cast<size_t>(t) * s.H + h) * s.D + d]) * kv_src[src + d];
          scores[k] = dot * scale;
          m = std::max(m, scores[k]);
        }
        double l = 0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int k = 0; k < n_keys; ++k) {
          const double p = std::exp(scores[k] - m);
          l += p;
          const size_t src = (static_cast<size_t>(token_of[b][k]) * 2 * s.Hkv + hk) * s.D + static_cast<size_t>(s.Hkv) * s.D;
          for (int d = 0; d < s.D; ++d) acc[d] += p * kv_src[src + d];
        }
        for (int d = 0; d < s.D; ++d) {
          const double ref = acc[d] / l;
          const double got = r.out[(static_cast<size_t>(t) * s.H + h) * s.D + d];
          if (std::isnan(got)) r.nan = true;
          r.max_err_ref = std::max(r.max_err_ref, std::fabs(got - ref) / (tol.atol + tol.rtol * std::fabs(ref)));
        }
      }
    }
  }

  // The C++ CPU kernel on the same data (it has float32 and bfloat16 caches;
  // its K layout is transposed per block, so it gets its own caches).
  if (dtype != mk::Dtype::kFloat16) {
    const DType dt = dtype == mk::Dtype::kFloat32 ? DType::kFloat32 : DType::kBFloat16;
    Buffer ck(dtype, cache_elems), cv(dtype, cache_elems), cout(dtype, q.size());
    ck.fill(0.f);
    cv.fill(0.f);
    auto targ = [&](Buffer& buf, std::vector<int64_t> shape, std::vector<int64_t> strides, const char* name) {
      TensorArg a;
      a.data = buf.data();
      a.dtype = dt;
      a.shape = shape;
      a.strides = strides;
      a.name = name;
      return a;
    };
    const int64_t hd = s.Hkv * s.D;
    auto kc = targ(ck, {num_blocks, s.Hkv, s.D, s.bs}, {static_cast<int64_t>(s.Hkv) * s.D * s.bs, s.D * s.bs, s.bs, 1}, "k_cache");
    auto vc = targ(cv, {num_blocks, s.Hkv, s.bs, s.D}, {static_cast<int64_t>(s.Hkv) * s.D * s.bs, s.D * s.bs, s.D, 1}, "v_cache");
    auto key = targ(kv_in, {P, s.Hkv, s.D}, {2 * hd, s.D, 1}, "key");
    TensorArg value = key;
    value.data = kv_in.bytes.data() + hd * elem_bytes(dtype);
    value.name = "value";
    pagedserve::cpu::reshape_and_cache(key, value, kc, vc, arg(slots, {P}, DType::kInt64, "slot_mapping"));
    pagedserve::cpu::AttentionPlan cplan(arg(qsl, {B + 1}, DType::kInt32, "query_start_loc"),
                                         arg(lens, {B}, DType::kInt32, "seq_lens"),
                                         arg(tables, {B, max_blocks}, DType::kInt32, "block_tables"), s.H, s.Hkv, s.D,
                                         s.bs, num_blocks, causal, 2);
    cplan.run(targ(cout, {T, s.H, s.D}, {static_cast<int64_t>(s.H) * s.D, s.D, 1}, "out"),
              targ(q_buf, {T, s.H, s.D}, {static_cast<int64_t>(s.H) * s.D, s.D, 1}, "query"), kc, vc, scale);
    r.cpu_compared = true;
    for (size_t i = 0; i < q.size(); ++i) {
      const double c = cout.get(i);
      r.max_err_cpu = std::max(r.max_err_cpu, std::fabs(r.out[i] - c) / (2 * (tol.atol + tol.rtol * std::fabs(c))));
    }
  }
  return r;
}

std::vector<int> every_length() {
  std::vector<int> v;
  for (int n = 1; n <= 256; ++n) v.push_back(n);
  v.push_back(1000);
  v.push_back(2048);
  return v;
}

pmetal::MetalPlanOptions split(pmetal::SplitKv mode, int partition_size = 128) {
  pmetal::MetalPlanOptions o;
  o.split = mode;
  o.partition_size = partition_size;
  return o;
}

void expect_close(const Result& r, const std::string& what) {
  EXPECT_FALSE(r.nan) << what << ": NaN in the output (a kernel read an unwritten slot or skipped a query)";
  EXPECT_LE(r.max_err_ref, 1.0) << what << ": error vs the float64 reference, in units of the stated tolerance";
  if (r.cpu_compared) EXPECT_LE(r.max_err_cpu, 1.0) << what << ": error vs the C++ CPU kernel, in tolerance units";
}

// ---- decode: every sequence length in one batch --------------------------------
// Forward lane order, then again under reverse (block size 16) or shuffled (32).

struct DecodeParam {
  Shape shape;
  const char* layout;
  bool split;
};

class DecodeEveryLength : public ::testing::TestWithParam<DecodeParam> {};

TEST_P(DecodeEveryLength, MatchesReferenceAndCpuKernel) {
  const DecodeParam& p = GetParam();
  const std::vector<int> lens = every_length();
  const std::vector<int> q_lens(lens.size(), 1);
  const Result r = run_case(p.shape, lens, q_lens, mk::Dtype::kFloat32,
                            split(p.split ? pmetal::SplitKv::kOn : pmetal::SplitKv::kOff), {}, 11);
  EXPECT_EQ(r.plan.split, p.split);
  if (p.split) EXPECT_EQ(r.plan.decode_args.max_partitions, 2048 / 128);
  EXPECT_EQ(r.plan.decode_work.size(), lens.size());
  EXPECT_TRUE(r.plan.prefill_work.empty());
  expect_close(r, p.layout);
  // A second lane order over the same sweep: bit-identical output.
  const Result other = run_case(p.shape, lens, q_lens, mk::Dtype::kFloat32,
                                split(p.split ? pmetal::SplitKv::kOn : pmetal::SplitKv::kOff),
                                {p.shape.bs == 16 ? mk::Order::kReverse : mk::Order::kShuffled, 3, false}, 11);
  EXPECT_EQ(std::memcmp(other.out.data(), r.out.data(), r.out.size() * sizeof(float)), 0);
}

std::vector<DecodeParam> decode_params() {
  std::vector<DecodeParam> v;
  for (int bs : {16, 32}) {
    for (bool sp : {false, true}) {
      v.push_back({{4, 4, 64, bs}, "MHA", sp});
      v.push_back({{6, 2, 64, bs}, "GQA", sp});
      v.push_back({{10, 1, 64, bs}, "MQA", sp});  // 10 heads: two head tiles (8 + 2)
    }
  }
  return v;
}

std::string decode_name(const ::testing::TestParamInfo<DecodeParam>& info) {
  const DecodeParam& p = info.param;
  return std::string(p.layout) + "_bs" + std::to_string(p.shape.bs) + (p.split ? "_split" : "_nosplit");
}

INSTANTIATE_TEST_SUITE_P(Shapes, DecodeEveryLength, ::testing::ValuesIn(decode_params()), decode_name);

// ---- prefill with earlier context, mixed with decodes -----------------------------

// (context already in the cache, query tokens this step): a fresh prompt, chunks
// after earlier chunks or a prefix-cache hit, chunks crossing and filling blocks.
void mixed_batch(std::vector<int>& lens, std::vector<int>& q_lens) {
  const int pairs[][2] = {{0, 2},   {0, 7},   {0, 33},  {1, 2},    {15, 5},  {16, 16}, {17, 40}, {31, 1},
                          {63, 9},  {100, 37}, {250, 6}, {255, 1},  {0, 64},  {1000, 33}, {2000, 48}, {5, 1},
                          {2047, 1}, {128, 3}};
  for (const auto& pr : pairs) {
    lens.push_back(pr[0] + pr[1]);
    q_lens.push_back(pr[1]);
  }
}

TEST(MetalPrefill, ChunkedPrefillWithEarlierContextMixedWithDecodes) {
  std::vector<int> lens, q_lens;
  mixed_batch(lens, q_lens);
  for (int bs : {16, 32}) {
    // the last shape: 2 KV heads with 2 decode head tiles (8 + 2) and 3 prefill tiles (4 + 4 + 2) each
    for (const Shape& s : {Shape{4, 4, 64, bs}, Shape{6, 2, 64, bs}, Shape{10, 1, 64, bs}, Shape{8, 2, 128, bs},
                           Shape{20, 2, 64, bs}}) {
      const Result r = run_case(s, lens, q_lens, mk::Dtype::kFloat32, split(pmetal::SplitKv::kOn), {}, 5);
      EXPECT_FALSE(r.plan.prefill_work.empty());
      EXPECT_EQ(r.plan.decode_work.size(), 4u);
      expect_close(r, "bs " + std::to_string(bs) + " H " + std::to_string(s.H) + " Hkv " + std::to_string(s.Hkv));
    }
  }
}

// Query and output with strides that all differ (the plan's set_strides),
// through decode, merge and prefill.
TEST(MetalStrides, StridedQueryAndPaddedOutput) {
  std::vector<int> lens, q_lens;
  mixed_batch(lens, q_lens);
  for (bool sp : {false, true}) {
    const Result r = run_case({20, 2, 64, 16}, lens, q_lens, mk::Dtype::kFloat32,
                              split(sp ? pmetal::SplitKv::kOn : pmetal::SplitKv::kOff), {}, 19, /*causal=*/true,
                              /*strided_io=*/true);
    EXPECT_EQ(r.plan.decode_args.head_tiles, 2);
    EXPECT_EQ(r.plan.prefill_args.head_tiles, 3);
    expect_close(r, std::string("strided query and out") + (sp ? ", split" : ""));
  }
}

TEST(MetalPrefill, NonCausalSeesEveryKey) {
  std::vector<int> lens{5, 40, 1, 90}, q_lens{5, 7, 1, 33};
  const Result r = run_case({6, 2, 64, 16}, lens, q_lens, mk::Dtype::kFloat32, split(pmetal::SplitKv::kOff), {}, 9,
                            /*causal=*/false);
  expect_close(r, "non-causal");
}

TEST(MetalPrefill, OddHeadSizes) {
  std::vector<int> lens, q_lens;
  mixed_batch(lens, q_lens);
  for (int D : {32, 80, 256}) {
    const Result r = run_case({4, 2, D, 16}, lens, q_lens, mk::Dtype::kFloat32, split(pmetal::SplitKv::kOn), {}, 3);
    expect_close(r, "head_size " + std::to_string(D));
  }
}

// ---- float16 / bfloat16 ----------------------------------------------------------

TEST(MetalDtypes, HalfAndBfloatMatchWithinStatedTolerance) {
  std::vector<int> lens, q_lens;
  mixed_batch(lens, q_lens);
  for (int n = 1; n <= 256; n += 5) {
    lens.push_back(n);
    q_lens.push_back(1);
  }
  for (mk::Dtype dt : {mk::Dtype::kFloat16, mk::Dtype::kBFloat16}) {
    for (int bs : {16, 32}) {
      for (bool sp : {false, true}) {
        for (mk::Order order : {mk::Order::kForward, mk::Order::kShuffled}) {
          mk::LaunchOptions lo;
          lo.order = order;
          lo.seed = 7;
          const Result r = run_case({6, 2, 64, bs}, lens, q_lens, dt,
                                    split(sp ? pmetal::SplitKv::kOn : pmetal::SplitKv::kOff), lo, 21);
          expect_close(r, std::string(dtype_name(dt)) + " bs " + std::to_string(bs) + (sp ? " split" : ""));
        }
      }
    }
  }
}

// ---- lane execution orders ---------------------------------------------------------

// The kernels synchronise correctly, so the order in which the emulator runs
// the lanes between synchronisation points must not change a single bit.
TEST(MetalLaneOrders, OutputIsBitIdenticalUnderEveryOrder) {
  std::vector<int> lens, q_lens;
  mixed_batch(lens, q_lens);
  const Shape s{10, 1, 64, 16};
  for (bool sp : {false, true}) {
    const auto opts = split(sp ? pmetal::SplitKv::kOn : pmetal::SplitKv::kOff);
    const Result fwd = run_case(s, lens, q_lens, mk::Dtype::kFloat32, opts, {mk::Order::kForward, 0, false}, 4);
    expect_close(fwd, "forward");
    EXPECT_GT(fwd.counters.threadgroup_barriers, 0u);
    EXPECT_GT(fwd.counters.simd_collectives, 0u);
    for (const mk::LaunchOptions& lo : {mk::LaunchOptions{mk::Order::kReverse, 0, false},
                                        mk::LaunchOptions{mk::Order::kShuffled, 1, false},
                                        mk::LaunchOptions{mk::Order::kShuffled, 2, false}}) {
      const Result other = run_case(s, lens, q_lens, mk::Dtype::kFloat32, opts, lo, 4);
      ASSERT_EQ(other.out.size(), fwd.out.size());
      EXPECT_EQ(std::memcmp(other.out.data(), fwd.out.data(), fwd.out.size() * sizeof(float)), 0)
          << "order " << static_cast<int>(lo.order) << " seed " << lo.seed << (sp ? " split" : "");
    }
  }
}

// ---- the broken variant -------------------------------------------------------------

// The decode kernel compiled without its threadgroup barriers must give wrong
// results under the emulator's lane orders: the proof that the emulator's
// barriers are real (a barrier-free emulator would pass this kernel).
TEST(MetalBrokenKernel, MissingBarrierIsCaught) {
  std::vector<int> lens;
  for (int n = 40; n <= 700; n += 37) lens.push_back(n);
  const std::vector<int> q_lens(lens.size(), 1);
  for (mk::Order order : {mk::Order::kForward, mk::Order::kReverse}) {
    const Result good = run_case({6, 2, 64, 16}, lens, q_lens, mk::Dtype::kFloat32, split(pmetal::SplitKv::kOff),
                                 {order, 0, false}, 8);
    expect_close(good, "correct kernel");
    const Result bad = run_case({6, 2, 64, 16}, lens, q_lens, mk::Dtype::kFloat32, split(pmetal::SplitKv::kOff),
                                {order, 0, true}, 8);
    EXPECT_TRUE(bad.nan || bad.max_err_ref > 100.0)
        << "order " << static_cast<int>(order) << ": the barrier-free decode kernel was not caught (error "
        << bad.max_err_ref << " tolerance units)";
  }
}

}  // namespace
