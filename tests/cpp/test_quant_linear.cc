// QuantizedWeight (csrc/backends/cpu/gemm/quant_linear.h): every quantized-kernel
// variant this CPU runs against (a) a scalar reference of the same integer
// math written here from the raw GGUF bytes (tight tolerance) and (b) the
// float32 matmul of the dequantised weights (a bound from the int8 activation
// rounding); dequantize bit-exact; typed errors for bad arguments.
// Built with -ffp-contract=off (tests/cpp/CMakeLists.txt): the reference's
// d * q + m must round twice, as numpy does.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "backends/cpu/runtime/cpu_features.h"
#include "backends/cpu/runtime/isa_registry.h"
#include "backends/cpu/gemm/greedy_logits.h"
#include "backends/cpu/gemm/quant_linear.h"
#include "core/errors.h"
#include "contiguous_arg.h"
#include "greedy_check.h"

using namespace pagedserve;
using namespace pagedserve::cpu;

namespace {

using pagedserve::test_support::arg;
using pagedserve::test_support::greedy_against_full;

float half_to_float(uint16_t h) {
  const int exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  float v;
  if (exp == 0) v = std::ldexp(static_cast<float>(man), -24);
  else if (exp == 31) v = man ? NAN : INFINITY;
  else v = std::ldexp(static_cast<float>(man + 1024), exp - 25);
  return (h & 0x8000) ? -v : v;
}

// float -> half, truncating the mantissa (values in the normal half range).
uint16_t float_to_half(float f) {
  if (f == 0.f) return 0;
  uint32_t b;
  std::memcpy(&b, &f, 4);
  const uint32_t sign = (b >> 16) & 0x8000u;
  int exp = static_cast<int>((b >> 23) & 0xFF) - 127 + 15;
  if (exp < 1) exp = 1;
  if (exp > 30) exp = 30;
  return static_cast<uint16_t>(sign | (static_cast<uint32_t>(exp) << 10) | ((b >> 13) & 0x3FF));
}

float bf16_round(float f) {  // float -> bfloat16 -> float, nearest even
  uint32_t b;
  std::memcpy(&b, &f, 4);
  b += 0x7FFF + ((b >> 16) & 1);
  b &= 0xFFFF0000u;
  std::memcpy(&f, &b, 4);
  return f;
}

uint16_t to_bf16_bits(float f) {
  f = bf16_round(f);
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return static_cast<uint16_t>(b >> 16);
}

float from_bf16_bits(uint16_t h) {
  const uint32_t b = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

int64_t block_bytes(QType q) { return q == QType::kQ4_1 ? 20 : 34; }

// Random GGUF blocks for an [n, k] weight; `extreme` mixes in saturated quants,
// negative / tiny / large scales.
std::vector<uint8_t> random_blocks(QType q, int64_t n, int64_t k, std::mt19937& rng, bool extreme = false) {
  const int64_t nb = k / 32, bb = block_bytes(q);
  std::vector<uint8_t> raw(n * nb * bb);
  std::uniform_real_distribution<float> ud(0.001f, 0.05f), um(-0.4f, 0.1f);
  std::uniform_int_distribution<int> byte(0, 255), pick(0, 5);
  for (int64_t i = 0; i < n * nb; ++i) {
    uint8_t* b = raw.data() + i * bb;
    float d = ud(rng), m = um(rng);
    int mode = extreme ? pick(rng) : 5;
    if (mode == 0) d = -d;
    if (mode == 1) d = 60000.f;
    if (mode == 2) d = 1e-4f;
    const uint16_t dh = float_to_half(d), mh = float_to_half(m);
    std::memcpy(b, &dh, 2);
    if (q == QType::kQ4_1) {
      std::memcpy(b + 2, &mh, 2);
      for (int j = 0; j < 16; ++j) b[4 + j] = static_cast<uint8_t>(mode == 3 ? 0xFF : mode == 4 ? 0x00 : byte(rng));
    } else {
      for (int j = 0; j < 32; ++j) {
        b[2 + j] = static_cast<uint8_t>(mode == 3 ? 0x80 : mode == 4 ? 0x7F : byte(rng));  // -128 / 127 too
      }
    }
  }
  return raw;
}

// Element (row, col) of the dequantised weight (numpy's formula, float32).
float weight_at(const std::vector<uint8_t>& raw, QType q, int64_t k, int64_t row, int64_t col) {
  const int64_t nb = k / 32;
  const uint8_t* b = raw.data() + (row * nb + col / 32) * block_bytes(q);
  const int e = static_cast<int>(col % 32);
  uint16_t dh;
  std::memcpy(&dh, b, 2);
  const float d = half_to_float(dh);
  if (q == QType::kQ4_1) {
    uint16_t mh;
    std::memcpy(&mh, b + 2, 2);
    const int qv = e < 16 ? (b[4 + e] & 0x0F) : (b[4 + e - 16] >> 4);
    const float prod = d * static_cast<float>(qv);
    return prod + half_to_float(mh);
  }
  return d * static_cast<float>(static_cast<int8_t>(b[2 + e]));
}

int weight_q(const std::vector<uint8_t>& raw, QType q, int64_t k, int64_t row, int64_t col) {
  const uint8_t* b = raw.data() + (row * (k / 32) + col / 32) * block_bytes(q);
  const int e = static_cast<int>(col % 32);
  if (q == QType::kQ4_1) return e < 16 ? (b[4 + e] & 0x0F) : (b[4 + e - 16] >> 4);
  return static_cast<int8_t>(b[2 + e]);
}

struct RefOut {
  std::vector<double> value;  // [m, n] the integer-math result
  std::vector<double> scale;  // [m, n] sum of |terms|: the tight tolerance's scale
  std::vector<double> qerr;   // [m, n] bound of the activation rounding's effect
};

// The same integer math as the kernels, in double: x quantised per 32-group
// (d = amax / 127, q = nearest-even(x / d) as x * (1 / d)), per block
// d_w * xd * sum(q_w * xq) (+ m * xd * sum(xq) for Q4_1).
RefOut reference(const std::vector<uint8_t>& raw, QType q, int64_t n, int64_t k, const std::vector<float>& x,
                 int64_t m, const std::vector<float>* bias) {
  RefOut r;
  r.value.assign(m * n, 0.0);
  r.scale.assign(m * n, 0.0);
  r.qerr.assign(m * n, 0.0);
  const int64_t nb = k / 32;
  std::vector<int> xq(k);
  std::vector<float> xd(nb);
  std::vector<int> xsum(nb);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      float amax = 0.f;
      for (int e = 0; e < 32; ++e) amax = std::max(amax, std::fabs(x[i * k + b * 32 + e]));
      const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
      xd[b] = d;
      xsum[b] = 0;
      for (int e = 0; e < 32; ++e) {
        float t = x[i * k + b * 32 + e] * id;
        t = std::min(127.f, std::max(-127.f, t));
        xq[b * 32 + e] = static_cast<int>(std::nearbyint(t));
        xsum[b] += xq[b * 32 + e];
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0, sc = 0, qe = 0;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = raw.data() + (j * nb + b) * block_bytes(q);
        uint16_t dh;
        std::memcpy(&dh, blk, 2);
        const double dw = half_to_float(dh);
        long isum = 0;
        double wabs = 0;
        for (int e = 0; e < 32; ++e) {
          isum += static_cast<long>(weight_q(raw, q, k, j, b * 32 + e)) * xq[b * 32 + e];
          wabs += std::fabs(weight_at(raw, q, k, j, b * 32 + e));
        }
        double t = dw * xd[b] * static_cast<double>(isum);
        acc += t;
        sc += std::fabs(t);
        if (q == QType::kQ4_1) {
          uint16_t mh;
          std::memcpy(&mh, blk + 2, 2);
          const double tm = static_cast<double>(half_to_float(mh)) * (static_cast<double>(xd[b]) * xsum[b]);
          acc += tm;
          sc += std::fabs(tm);
        }
        qe += wabs * xd[b] * 0.5;  // |x - xd * xq| <= xd / 2 per element
      }
      if (bias) {
        acc += (*bias)[j];
        sc += std::fabs((*bias)[j]);
      }
      r.value[i * n + j] = acc;
      r.scale[i * n + j] = sc;
      r.qerr[i * n + j] = qe;
    }
  }
  return r;
}

// The name of the first registry variant whose GEMM table is the scalar one (the reference).
std::string scalar_gemm_variant() {
  for (const IsaVariant& v : compiled_isas()) {
    if (std::string(v.gemm().name) == "scalar") return v.name;
  }
  ADD_FAILURE() << "no variant runs the scalar GEMM";
  return "";
}

// Restores the active quantized variant after a test that switches it.
struct QuantIsaGuard {
  std::string saved = active_isa().name;
  ~QuantIsaGuard() { set_active_isa(saved); }
};

const IsaVariant* find_variant(const std::string& name) {
  for (const IsaVariant& v : compiled_isas()) {
    if (name == v.name) return &v;
  }
  return nullptr;
}

class QuantLinearVariant : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const IsaVariant* v = find_variant(GetParam());
    if (v == nullptr) GTEST_SKIP() << "variant " << GetParam() << " is not compiled into this build";
    if (!v->supported()) GTEST_SKIP() << "this CPU cannot run " << GetParam() << ": it needs " << v->requires_;
    std::cout << "[ isa ] quantized variant " << GetParam() << " runs\n";
  }
};

// Runs one case under the active variant and checks both references.
void check_case(QType q, int64_t n, int64_t k, int64_t m, bool with_bias, bool bf16, int threads, uint32_t seed,
                bool extreme, double zero_row_fraction = 0.0) {
  SCOPED_TRACE(std::string(qtype_name(q)) + " n=" + std::to_string(n) + " k=" + std::to_string(k) +
               " m=" + std::to_string(m) + " bias=" + std::to_string(with_bias) + " bf16=" + std::to_string(bf16) +
               " threads=" + std::to_string(threads) + " extreme=" + std::to_string(extreme));
  std::mt19937 rng(seed);
  std::vector<uint8_t> raw = random_blocks(q, n, k, rng, extreme);
  QuantizedWeight w(raw.data(), q, n, k);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> u01(0.f, 1.f);
  std::vector<float> x(m * k);
  for (int64_t i = 0; i < m; ++i) {
    const bool zero = u01(rng) < zero_row_fraction;
    for (int64_t e = 0; e < k; ++e) {
      float v = zero ? 0.f : nd(rng);
      if (extreme && e % 37 == 0) v *= 1000.f;  // outliers
      x[i * k + e] = bf16 ? bf16_round(v) : v;
    }
  }
  std::vector<float> bias(n);
  for (auto& b : bias) b = nd(rng);
  std::vector<float> out_f(m * n, -7.f);
  std::vector<uint16_t> xb(m * k), out_b(m * n, 0);
  for (int64_t i = 0; i < m * k; ++i) xb[i] = to_bf16_bits(x[i]);
  auto bias_arg = arg(bias, {n}, DType::kFloat32, "bias");
  if (bf16) {
    w.linear(arg(xb, {m, k}, DType::kBFloat16, "x"), arg(out_b, {m, n}, DType::kBFloat16, "out"),
             with_bias ? &bias_arg : nullptr, threads);
    for (int64_t i = 0; i < m * n; ++i) out_f[i] = from_bf16_bits(out_b[i]);
  } else {
    w.linear(arg(x, {m, k}, DType::kFloat32, "x"), arg(out_f, {m, n}, DType::kFloat32, "out"),
             with_bias ? &bias_arg : nullptr, threads);
  }
  const RefOut ref = reference(raw, q, n, k, x, m, with_bias ? &bias : nullptr);
  // float reference: x (as given) . dequantised W^T
  int bad = 0;
  for (int64_t i = 0; i < m && bad < 5; ++i) {
    for (int64_t j = 0; j < n && bad < 5; ++j) {
      const double got = out_f[i * n + j], want = ref.value[i * n + j];
      const double out_round = bf16 ? std::fabs(want) * (1.0 / 256) : 0.0;
      const double tight = 2e-6 * ref.scale[i * n + j] + out_round + 1e-30;
      if (!(std::fabs(got - want) <= tight)) {
        ADD_FAILURE() << "integer reference mismatch at [" << i << ", " << j << "]: got " << got << " want " << want
                      << " tol " << tight;
        ++bad;
      }
      double fl = with_bias ? bias[j] : 0.0;
      for (int64_t e = 0; e < k; ++e) fl += static_cast<double>(x[i * k + e]) * weight_at(raw, q, k, j, e);
      const double loose = ref.qerr[i * n + j] * 1.001 + tight;
      if (!(std::fabs(got - fl) <= loose)) {
        ADD_FAILURE() << "float reference mismatch at [" << i << ", " << j << "]: got " << got << " want " << fl
                      << " tol " << loose;
        ++bad;
      }
    }
  }
}

TEST_P(QuantLinearVariant, MatchesTheIntegerAndFloatReferences) {
  QuantIsaGuard guard;
  set_active_isa(GetParam());
  uint32_t seed = 1;
  const int64_t shapes[][2] = {{13, 32}, {40, 96}, {77, 576}};
  for (QType q : {QType::kQ4_1, QType::kQ8_0}) {
    for (const auto& s : shapes) {
      for (int64_t m : {1, 2, 7, 32, 33, 128}) {
        const bool with_bias = (seed % 2) == 0, bf16 = (seed % 3) == 0;
        check_case(q, s[0], s[1], m, with_bias, bf16, seed % 4 == 1 ? 1 : 3, seed, false);
        ++seed;
        if (HasFailure()) return;
      }
    }
  }
}

TEST_P(QuantLinearVariant, ExtremeBlocksZeroRowsAndBfloat16) {
  QuantIsaGuard guard;
  set_active_isa(GetParam());
  for (QType q : {QType::kQ4_1, QType::kQ8_0}) {
    check_case(q, 33, 128, 33, true, false, 2, 11, true, 0.3);
    check_case(q, 33, 128, 7, false, true, 1, 12, true, 0.3);
    check_case(q, 50, 64, 128, true, true, 3, 13, false, 0.5);
  }
}

TEST_P(QuantLinearVariant, AZeroRowGivesTheBiasExactly) {
  QuantIsaGuard guard;
  set_active_isa(GetParam());
  for (QType q : {QType::kQ4_1, QType::kQ8_0}) {
    std::mt19937 rng(3);
    const int64_t n = 21, k = 64, m = 3;
    std::vector<uint8_t> raw = random_blocks(q, n, k, rng);
    QuantizedWeight w(raw.data(), q, n, k);
    std::vector<float> x(m * k, 0.f), out(m * n, 1.f), bias(n);
    for (int64_t j = 0; j < n; ++j) bias[j] = 0.25f * static_cast<float>(j) - 2.f;
    auto b = arg(bias, {n}, DType::kFloat32, "bias");
    w.linear(arg(x, {m, k}, DType::kFloat32, "x"), arg(out, {m, n}, DType::kFloat32, "out"), &b, 1);
    for (int64_t i = 0; i < m * n; ++i) EXPECT_EQ(out[i], bias[i % n]);
    w.linear(arg(x, {m, k}, DType::kFloat32, "x"), arg(out, {m, n}, DType::kFloat32, "out"), nullptr, 2);
    for (int64_t i = 0; i < m * n; ++i) EXPECT_EQ(out[i], 0.f);
  }
}

TEST_P(QuantLinearVariant, GivesTheScalarVariantsResultClosely) {
  QuantIsaGuard guard;
  std::mt19937 rng(5);
  const int64_t n = 100, k = 320, m = 37;
  for (QType q : {QType::kQ4_1, QType::kQ8_0}) {
    std::vector<uint8_t> raw = random_blocks(q, n, k, rng);
    QuantizedWeight w(raw.data(), q, n, k);
    std::vector<float> x(m * k), a(m * n), b(m * n);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (auto& v : x) v = nd(rng);
    set_active_isa(scalar_gemm_variant());
    w.linear(arg(x, {m, k}, DType::kFloat32, "x"), arg(a, {m, n}, DType::kFloat32, "out"), nullptr, 2);
    set_active_isa(GetParam());
    w.linear(arg(x, {m, k}, DType::kFloat32, "x"), arg(b, {m, n}, DType::kFloat32, "out"), nullptr, 2);
    double num = 0, den = 0;
    for (int64_t i = 0; i < m * n; ++i) {
      num += (a[i] - b[i]) * (a[i] - b[i]);
      den += a[i] * a[i];
    }
    EXPECT_LT(std::sqrt(num / den), 1e-6) << qtype_name(q);
  }
}

// A row's output is bit-identical whatever batch, pass size (the SIMD variants
// take up to 8 rows per pass, then the rest), work split or thread count
// computed it: every row of an M-row call against the same row run alone and
// in other sub-batches.
TEST_P(QuantLinearVariant, ARowsResultDoesNotDependOnItsBatchOrThreads) {
  QuantIsaGuard guard;
  set_active_isa(GetParam());
  std::mt19937 rng(21);
  const int64_t n = 83, k = 160, m = 29;  // N: 5 full row groups + 3 columns; M: passes of 8, 8, 8 and 5
  std::normal_distribution<float> nd(0.f, 1.f);
  for (QType q : {QType::kQ4_1, QType::kQ8_0}) {
    std::vector<uint8_t> raw = random_blocks(q, n, k, rng, true);
    QuantizedWeight w(raw.data(), q, n, k);
    std::vector<float> x(m * k), bias(n);
    for (auto& v : x) v = nd(rng);
    for (auto& v : bias) v = nd(rng);
    auto b = arg(bias, {n}, DType::kFloat32, "bias");
    for (bool bf16 : {false, true}) {
      std::vector<uint16_t> xb(m * k);
      for (int64_t i = 0; i < m * k; ++i) xb[i] = to_bf16_bits(x[i]);
      // out[r0 .. r0+rows) for rows r0.. of x, as raw bits (float32 or bfloat16)
      const auto run = [&](int64_t r0, int64_t rows, int threads) {
        std::vector<uint32_t> bits(rows * n);
        if (bf16) {
          std::vector<uint16_t> xs(xb.begin() + r0 * k, xb.begin() + (r0 + rows) * k), o(rows * n);
          w.linear(arg(xs, {rows, k}, DType::kBFloat16, "x"), arg(o, {rows, n}, DType::kBFloat16, "out"), &b,
                   threads);
          for (int64_t i = 0; i < rows * n; ++i) bits[i] = o[i];
        } else {
          std::vector<float> xs(x.begin() + r0 * k, x.begin() + (r0 + rows) * k), o(rows * n);
          w.linear(arg(xs, {rows, k}, DType::kFloat32, "x"), arg(o, {rows, n}, DType::kFloat32, "out"), &b,
                   threads);
          std::memcpy(bits.data(), o.data(), o.size() * 4);
        }
        return bits;
      };
      const std::vector<uint32_t> all = run(0, m, 3);
      EXPECT_EQ(run(0, m, 1), all) << qtype_name(q) << " bf16=" << bf16 << ": 1 vs 3 threads";
      const int64_t subs[][2] = {{0, 1}, {5, 1}, {28, 1}, {3, 7}, {10, 9}, {1, 16}, {13, 2}};
      for (const auto& sb : subs) {
        const std::vector<uint32_t> part = run(sb[0], sb[1], 2);
        for (int64_t i = 0; i < sb[1] * n; ++i) {
          ASSERT_EQ(part[i], all[sb[0] * n + i]) << qtype_name(q) << " bf16=" << bf16 << " rows [" << sb[0] << ", "
                                                 << sb[0] + sb[1] << ") element " << i;
        }
      }
    }
  }
}

// linear_f32: out = x . W^T (+ bias) with W the exactly dequantised weights,
// against a double-precision reference from dequantize's float32 output
// (|error| <= 1e-5 * sum_k |x w| + 1e-6), for every M tiling (one row tile,
// several, a partial last one, M split over work items), N not a multiple of
// 16 or 32, and threads 1 and 2 bit-identical.
TEST_P(QuantLinearVariant, LinearF32MatchesTheDequantisedWeightsInDouble) {
  QuantIsaGuard guard;
  set_active_isa(GetParam());
  std::mt19937 rng(31);
  std::normal_distribution<float> nd(0.f, 1.f);
  // N = 960 at K = 576 (60 row groups, several K ranges, the pool's split) at
  // fewer M: the emulated-CPU runs (qemu-user AVX2) of the full grid take minutes; M = 200: several
  // row chunks per call on the pool (96 rows each)
  const std::vector<int64_t> all_m = {0, 1, 3, 5, 8, 12, 13, 32, 33, 100, 200}, few_m = {1, 8, 13, 33};
  const int64_t max_m = 200;
  for (QType q : {QType::kQ4_1, QType::kQ8_0}) {
    for (int64_t n : {16, 40, 960}) {
      for (int64_t k : {32, 576}) {
        const std::vector<int64_t>& ms = n * k > 100000 ? few_m : all_m;
        // the columns checked against the reference: all but for N = 960 the first and last two row
        // groups and every 7th (threads 1 vs 2 compare all of them bit for bit)
        const auto checked = [n](int64_t j) { return n < 100 || j < 32 || j >= n - 32 || j % 7 == 0; };
        std::vector<uint8_t> raw = random_blocks(q, n, k, rng, n == 40);
        QuantizedWeight w(raw.data(), q, n, k);
        std::vector<float> wd(n * k);
        w.dequantize(arg(wd, {n, k}, DType::kFloat32, "out"));
        std::vector<float> bias(n), x(max_m * k);
        for (auto& v : bias) v = nd(rng);
        for (auto& v : x) v = nd(rng);
        auto b = arg(bias, {n}, DType::kFloat32, "bias");
        // each M takes the first M rows of x: one reference (without the bias) for all
        std::vector<double> ref(max_m * n), scale(max_m * n);
        for (int64_t i = 0; i < ms.back(); ++i) {
          for (int64_t j = 0; j < n; ++j) {
            if (!checked(j)) continue;
            double sum = 0.0, abs_sum = 0.0;
            const float* xi = x.data() + i * k;
            const float* wj = wd.data() + j * k;
            for (int64_t e = 0; e < k; ++e) {
              const double t = static_cast<double>(xi[e]) * wj[e];
              sum += t;
              abs_sum += std::fabs(t);
            }
            ref[i * n + j] = sum;
            scale[i * n + j] = abs_sum;
          }
        }
        for (int64_t m : ms) {
          for (bool with_bias : {false, true}) {
            SCOPED_TRACE(std::string(qtype_name(q)) + " n=" + std::to_string(n) + " k=" + std::to_string(k) +
                         " m=" + std::to_string(m) + " bias=" + std::to_string(with_bias));
            std::vector<float> out1(m * n, NAN), out2(m * n, NAN);
            w.linear_f32(arg(x, {m, k}, DType::kFloat32, "x"), arg(out1, {m, n}, DType::kFloat32, "out"),
                         with_bias ? &b : nullptr, 1);
            w.linear_f32(arg(x, {m, k}, DType::kFloat32, "x"), arg(out2, {m, n}, DType::kFloat32, "out"),
                         with_bias ? &b : nullptr, 2);
            if (m > 0) {  // (memcmp on an empty vector's null data() is undefined behaviour: UBSan)
              ASSERT_EQ(std::memcmp(out1.data(), out2.data(), out1.size() * 4), 0) << "threads 1 vs 2";
            }
            int bad = 0;
            for (int64_t i = 0; i < m * n && bad < 5; ++i) {
              if (!checked(i % n)) continue;
              const double want = ref[i] + (with_bias ? bias[i % n] : 0.0);
              const double tol = 1e-5 * scale[i] + 1e-6;
              if (!(std::fabs(out1[i] - want) <= tol)) {
                ADD_FAILURE() << "[" << i / n << ", " << i % n << "]: got " << out1[i] << " want " << want
                              << " tol " << tol;
                ++bad;
              }
            }
          }
        }
      }
    }
  }
}

// linear_f32: a row's result is the same bits whatever else is in the call
// (one row alone, which takes the AVX2 kernel's two-group single-row pass, or
// any slice of rows) and on any thread count, for N of an odd number of row
// groups (a pair and a lone last group) and a partial last group.
TEST_P(QuantLinearVariant, LinearF32ARowsResultDoesNotDependOnItsBatchOrThreads) {
  QuantIsaGuard guard;
  set_active_isa(GetParam());
  std::mt19937 rng(41);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int64_t k = 96, m = 27;
  for (QType q : {QType::kQ4_1, QType::kQ8_0}) {
    for (int64_t n : {16, 40, 83, 160}) {  // 1, 3 (pair + one, partial), 6 (partial), 10 groups
      std::vector<uint8_t> raw = random_blocks(q, n, k, rng, true);
      QuantizedWeight w(raw.data(), q, n, k);
      std::vector<float> x(m * k), bias(n);
      for (auto& v : x) v = nd(rng);
      for (auto& v : bias) v = nd(rng);
      auto b = arg(bias, {n}, DType::kFloat32, "bias");
      const auto run = [&](int64_t r0, int64_t rows, int threads) {
        std::vector<float> xs(x.begin() + r0 * k, x.begin() + (r0 + rows) * k), o(rows * n);
        w.linear_f32(arg(xs, {rows, k}, DType::kFloat32, "x"), arg(o, {rows, n}, DType::kFloat32, "out"), &b,
                     threads);
        std::vector<uint32_t> bits(rows * n);
        std::memcpy(bits.data(), o.data(), o.size() * 4);
        return bits;
      };
      const std::vector<uint32_t> all = run(0, m, 1);
      EXPECT_EQ(run(0, m, 2), all) << qtype_name(q) << " n=" << n << ": 1 vs 2 threads";
      const int64_t subs[][2] = {{0, 1}, {7, 1}, {26, 1}, {3, 2}, {4, 5}, {10, 13}};
      for (const auto& sb : subs) {
        for (int threads : {1, 2}) {
          const std::vector<uint32_t> part = run(sb[0], sb[1], threads);
          for (int64_t i = 0; i < sb[1] * n; ++i) {
            ASSERT_EQ(part[i], all[sb[0] * n + i]) << qtype_name(q) << " n=" << n << " rows [" << sb[0] << ", "
                                                   << sb[0] + sb[1] << ") threads " << threads << " element " << i;
          }
        }
      }
    }
  }
}

// The expanded weights are exact: x = one-hot rows (row i selects column i of
// W^T) gives the dequantised weight bit for bit (plus the bias: one float add).
TEST_P(QuantLinearVariant, LinearF32OfOneHotRowsIsTheDequantisedWeightExactly) {
  QuantIsaGuard guard;
  set_active_isa(GetParam());
  std::mt19937 rng(37);
  for (QType q : {QType::kQ4_1, QType::kQ8_0}) {
    for (bool extreme : {false, true}) {
      const int64_t n = 40, k = 64, m = k;  // every k once; M = 64: several row tiles
      std::vector<uint8_t> raw = random_blocks(q, n, k, rng, extreme);
      const uint16_t sub = 0x0003, negzero = 0x8000;  // a subnormal and a negative zero scale
      std::memcpy(raw.data(), &sub, 2);
      std::memcpy(raw.data() + block_bytes(q) * (k / 32), &negzero, 2);
      QuantizedWeight w(raw.data(), q, n, k);
      std::vector<float> x(m * k, 0.f), bias(n), out(m * n, NAN), outb(m * n, NAN);
      for (int64_t i = 0; i < m; ++i) x[i * k + i] = 1.f;
      std::normal_distribution<float> nd(0.f, 1.f);
      for (auto& v : bias) v = nd(rng);
      auto b = arg(bias, {n}, DType::kFloat32, "bias");
      w.linear_f32(arg(x, {m, k}, DType::kFloat32, "x"), arg(out, {m, n}, DType::kFloat32, "out"), nullptr, 2);
      w.linear_f32(arg(x, {m, k}, DType::kFloat32, "x"), arg(outb, {m, n}, DType::kFloat32, "out"), &b, 1);
      // one row at a time too (the in-register expansion path of a single row tile). Values compare
      // with ==: bit for bit but for the sign of a zero weight (a float sum from +0 is +0)
      std::vector<float> one(n, NAN);
      for (int64_t i = 0; i < m; ++i) {
        std::vector<float> xi(x.begin() + i * k, x.begin() + (i + 1) * k);
        w.linear_f32(arg(xi, {1, k}, DType::kFloat32, "x"), arg(one, {1, n}, DType::kFloat32, "out"), nullptr, 1);
        for (int64_t j = 0; j < n; ++j) {
          const float want = weight_at(raw, q, k, j, i), wantb = want + bias[j];
          ASSERT_EQ(out[i * n + j], want) << qtype_name(q) << " [" << i << ", " << j << "]";
          ASSERT_EQ(one[j], want) << qtype_name(q) << " row alone [" << i << ", " << j << "]";
          ASSERT_EQ(outb[i * n + j], wantb) << qtype_name(q) << " bias [" << i << ", " << j << "]";
        }
      }
    }
  }
}

// greedy_logits (gemm/greedy_logits.h): every value it keeps is linear_f32's
// bit for bit, every row maximum of linear_f32 (ties included) is kept, so
// the first maximum's index is the same; it does skip work (-inf entries) on
// Q8_0 at several rows, and gives linear_f32 in full for one row, a non-finite
// x and a Q4_1 weight. A duplicated weight row makes an exact tie at the top.
TEST_P(QuantLinearVariant, GreedyLogitsKeepEveryRowMaximumExactly) {
  QuantIsaGuard guard;
  set_active_isa(GetParam());
  std::mt19937 rng(53);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int64_t k = 128;
  const auto bits_of = [](const std::vector<float>& v) {
    std::vector<uint32_t> b(v.size());
    std::memcpy(b.data(), v.data(), v.size() * 4);
    return b;
  };
  for (QType q : {QType::kQ8_0, QType::kQ4_1}) {
    for (int64_t n : {1000, 2048}) {
      std::vector<uint8_t> raw = random_blocks(q, n, k, rng);
      // row 0 of x points at the weight row `top` of the largest norm; an exact twin of it ties there
      const int64_t rb = k / 32 * block_bytes(q), twin = n - 3, rival = 500;
      int64_t top = 0;
      double best = -1.0;
      for (int64_t j = 0; j < rival - 16; ++j) {  // not in the rival's row group
        double sq = 0.0;
        for (int64_t e = 0; e < k; ++e) sq += std::pow(static_cast<double>(weight_at(raw, q, k, j, e)), 2);
        if (sq > best) best = sq, top = j;
      }
      std::memcpy(raw.data() + twin * rb, raw.data() + top * rb, static_cast<size_t>(rb));
      std::vector<float> x0(k);
      for (int64_t e = 0; e < k; ++e) x0[e] = weight_at(raw, q, k, top, e) * 8.f;
      int64_t want = top;  // row 0's first maximum
      if (q == QType::kQ8_0) {
        // A rival the int8 pass ranks below `top` that is above it exactly: two elements of x's first block
        // set just below and just above half its int8 step (they round to 0 and to 1), the rival = top with
        // the quants there +2 and -1: exactly d (2 * 0.499 - 0.501) s > 0 more, by the int8 pass d s less.
        std::vector<int64_t> small;
        for (int64_t e = 0; e < 32 && small.size() < 2; ++e) {
          const int8_t qe = static_cast<int8_t>(raw[static_cast<size_t>(top * rb + 2 + e)]);
          if (std::abs(qe) < 100) small.push_back(e);
        }
        ASSERT_EQ(small.size(), 2u);
        float amax = 0.f;
        for (int64_t e = 0; e < 32; ++e) {
          if (e != small[0] && e != small[1]) amax = std::max(amax, std::fabs(x0[e]));
        }
        const float step = amax / 127.f;  // the int8 scale quantize_rows gives the block
        x0[small[0]] = 0.499f * step;
        x0[small[1]] = 0.501f * step;
        std::memcpy(raw.data() + rival * rb, raw.data() + top * rb, static_cast<size_t>(rb));
        raw[static_cast<size_t>(rival * rb + 2 + small[0])] += 2;
        raw[static_cast<size_t>(rival * rb + 2 + small[1])] -= 1;
        want = rival;
        // and n / 40 exact copies of `top` (each in a row group of its own), which the int8 pass ranks above the
        // rival: keeping "the top 2% by the first pass" would drop the row's maximum
        for (int64_t c = 0; c < n / 40; ++c) {
          std::memcpy(raw.data() + (520 + 16 * c) * rb, raw.data() + top * rb, static_cast<size_t>(rb));
        }
      }
      QuantizedWeight w(raw.data(), q, n, k);
      for (int64_t m : {1, 2, 9}) {
        for (int threads : {1, 2}) {
          SCOPED_TRACE(std::string(qtype_name(q)) + " n=" + std::to_string(n) + " m=" + std::to_string(m) +
                       " threads=" + std::to_string(threads));
          std::vector<float> x(m * k);
          for (int64_t i = 0; i < m; ++i) {
            for (int64_t e = 0; e < k; ++e) {
              x[i * k + e] = i == 0 ? x0[e] : nd(rng);  // row 0 built above, the others random
            }
          }
          std::vector<float> got;
          std::vector<int64_t> first;
          const int64_t pruned = greedy_against_full(w, x, m, threads, &got, &first);
          ASSERT_FALSE(HasFailure());
          ASSERT_EQ(first[0], want) << "row 0 is not the near tie it was built to be";
          const bool expect_pruned = q == QType::kQ8_0 && m > 1;
          EXPECT_EQ(prunes_greedy_logits(w), q == QType::kQ8_0);
          if (expect_pruned) {
            EXPECT_GT(pruned, m * n / 2) << "greedy_logits skipped too little";
          } else {
            EXPECT_EQ(pruned, 0) << "linear_f32 in full expected";
          }
        }
      }
      // a non-finite activation: linear_f32 in full, NaN where it gives NaN
      const int64_t m = 3;
      std::vector<float> x(m * k);
      for (auto& v : x) v = nd(rng);
      x[k + 5] = NAN;
      std::vector<float> full(m * n), got(m * n, 42.f);
      w.linear_f32(arg(x, {m, k}, DType::kFloat32, "x"), arg(full, {m, n}, DType::kFloat32, "out"), nullptr, 2);
      greedy_logits(w, arg(x, {m, k}, DType::kFloat32, "x"), arg(got, {m, n}, DType::kFloat32, "out"), 2);
      EXPECT_EQ(bits_of(got), bits_of(full)) << qtype_name(q) << " with a NaN in x";
    }
  }
  // Extremes (hand-built Q8_0 rows, K = 32): (a) near underflow, a subnormal-scaled row whose int8 scale
  // product d * xd flushes to zero is x's maximum; (b) where the exact pass overflows (+inf or NaN), the output
  // is linear_f32's in full. In both every kept value is linear_f32's and argmax is the same.
  // row j's fp16 scale and 32 quants from row(j, &d, q)
  const auto q8_rows = [](int64_t n, const std::function<void(int64_t, uint16_t*, int8_t*)>& row) {
    std::vector<uint8_t> raw(static_cast<size_t>(n * 34));
    for (int64_t j = 0; j < n; ++j) {
      uint16_t d = 0;
      int8_t qs[32] = {};
      row(j, &d, qs);
      std::memcpy(raw.data() + j * 34, &d, 2);
      std::memcpy(raw.data() + j * 34 + 2, qs, 32);
    }
    return raw;
  };
  for (int extreme = 0; extreme < 2; ++extreme) {
    const int64_t n = 80, kk = 32, m = 2;
    std::vector<float> x(m * kk);
    for (auto& v : x) v = nd(rng);
    std::vector<uint8_t> raw;
    if (extreme == 0) {
      // row 5: d = 2^-24, q = 127 (its x . w ~ 2^-131, the row's maximum; the int8 pass's d * xd = 2^-150
      // flushes to 0); row 40: d = 3 * 2^-24, q = 1; the others d = 2^-12, q = -(1 + j): below zero here,
      // and distinct in row 1 (random x), which has a clear maximum
      raw = q8_rows(n, [](int64_t j, uint16_t* d, int8_t* q) {
        *d = j == 5 ? 0x0001 : j == 40 ? 0x0003 : 0x0C00;
        for (int e = 0; e < 32; ++e) q[e] = static_cast<int8_t>(j == 5 ? 127 : j == 40 ? 1 : -(1 + j));
      });
      for (int64_t e = 0; e < kk; ++e) x[e] = 127.f * 0x1p-126f;
    } else {
      // x = (3e38, -3e38, 0, ...): row 7 (1.98 at k = 0 and 1) overflows in the exact pass (+inf, or NaN
      // where the product rounds first) while its int8 sum cancels to 0; the others (0.01 + j 2^-12, -0.01)
      raw = q8_rows(n, [](int64_t j, uint16_t* d, int8_t* q) {
        *d = j == 7 ? 0x2400 : 0x0C00;  // 1/64, 2^-12
        q[0] = static_cast<int8_t>(j == 7 ? 127 : 41 + j);
        q[1] = static_cast<int8_t>(j == 7 ? 127 : -41);
      });
      for (int64_t e = 0; e < kk; ++e) x[e] = e == 0 ? 3e38f : e == 1 ? -3e38f : 0.f;
    }
    QuantizedWeight w(raw.data(), QType::kQ8_0, n, kk);
    std::vector<float> full(m * n), got(m * n, 42.f);
    w.linear_f32(arg(x, {m, kk}, DType::kFloat32, "x"), arg(full, {m, n}, DType::kFloat32, "out"), nullptr, 2);
    greedy_logits(w, arg(x, {m, kk}, DType::kFloat32, "x"), arg(got, {m, n}, DType::kFloat32, "out"), 2);
    const std::vector<uint32_t> fb = bits_of(full), gb = bits_of(got);
    for (int64_t i = 0; i < m; ++i) {
      const float* f = full.data() + i * n;
      for (int64_t j = 0; j < n; ++j) {
        if (!(got[i * n + j] == -INFINITY && full[i * n + j] != -INFINITY)) {
          ASSERT_EQ(gb[i * n + j], fb[i * n + j]) << "extreme " << extreme << " [" << i << ", " << j << "]";
        }
      }
      const float* g = got.data() + i * n;
      // argmax with NaN counting as the maximum (numpy's, torch's): the first NaN, else the first maximum
      const auto argmax = [n](const float* v) {
        for (int64_t j = 0; j < n; ++j) {
          if (std::isnan(v[j])) return j;
        }
        return static_cast<int64_t>(std::max_element(v, v + n) - v);
      };
      ASSERT_EQ(argmax(g), argmax(f)) << "extreme " << extreme << " row " << i;
      if (i == 0) ASSERT_EQ(argmax(f), extreme == 0 ? 5 : 7) << "the case is not the one built";
    }
  }

  // bad arguments: typed errors before anything is written
  std::vector<uint8_t> raw = random_blocks(QType::kQ8_0, 40, k, rng);
  QuantizedWeight w(raw.data(), QType::kQ8_0, 40, k);
  std::vector<float> x(2 * k, 1.f), out(2 * 40, 42.f);
  std::vector<uint16_t> xb(2 * k);
  EXPECT_THROW(greedy_logits(w, arg(xb, {2, k}, DType::kBFloat16, "x"), arg(out, {2, 40}, DType::kFloat32, "out"), 1),
               KernelArgumentError);
  EXPECT_THROW(greedy_logits(w, arg(x, {2, k}, DType::kFloat32, "x"), arg(out, {2, 39}, DType::kFloat32, "out"), 1),
               KernelArgumentError);
  EXPECT_THROW(greedy_logits(w, arg(x, {2, k}, DType::kFloat32, "x"), arg(out, {2, 40}, DType::kFloat32, "out"), 0),
               KernelArgumentError);
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float v) { return v == 42.f; }));
}

INSTANTIATE_TEST_SUITE_P(Variants, QuantLinearVariant,
                         ::testing::Values("baseline", "neon", "neon_dotprod", "avx2", "avx_vnni", "avx512_vnni"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

TEST(QuantLinear, DequantizeIsBitExact) {
  std::mt19937 rng(9);
  for (QType q : {QType::kQ4_1, QType::kQ8_0}) {
    for (bool extreme : {false, true}) {
      const int64_t n = 37, k = 96;
      std::vector<uint8_t> raw = random_blocks(q, n, k, rng, extreme);
      // a subnormal scale and a negative zero scale too
      const uint16_t sub = 0x0003, negzero = 0x8000;
      std::memcpy(raw.data(), &sub, 2);
      std::memcpy(raw.data() + block_bytes(q), &negzero, 2);
      QuantizedWeight w(raw.data(), q, n, k);
      EXPECT_EQ(w.nbytes(), (n + 15) / 16 * 16 * (k / 32) * block_bytes(q));
      std::vector<float> out(n * k, NAN);
      w.dequantize(arg(out, {n, k}, DType::kFloat32, "out"));
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t c = 0; c < k; ++c) {
          const float want = weight_at(raw, q, k, r, c), got = out[r * k + c];
          ASSERT_EQ(std::memcmp(&want, &got, 4), 0) << qtype_name(q) << " [" << r << ", " << c << "] " << got
                                                     << " vs " << want;
        }
      }
    }
  }
}

TEST(QuantLinear, BadArgumentsRaiseKernelArgumentError) {
  std::mt19937 rng(4);
  const int64_t n = 20, k = 64;
  std::vector<uint8_t> raw = random_blocks(QType::kQ4_1, n, k, rng);
  const int64_t rb = k / 32 * 20;
  auto raw_arg = arg(raw, {n, rb}, DType::kUInt8, "raw");
  EXPECT_THROW(QuantizedWeight(raw_arg, "q3_k", n, k), KernelArgumentError);  // not a type we read
  EXPECT_THROW(QuantizedWeight(raw_arg, "q4_0", n, k), KernelArgumentError);  // shape for q4_1
  EXPECT_THROW(QuantizedWeight(raw_arg, "q8_0", n, k), KernelArgumentError);  // shape for q4_1
  EXPECT_THROW(QuantizedWeight(raw_arg, "q4_1", n, 48), KernelArgumentError);  // K not a multiple of 32
  EXPECT_THROW(QuantizedWeight(raw_arg, "q4_1", n, 0), KernelArgumentError);
  EXPECT_THROW(QuantizedWeight(raw_arg, "q4_1", 0, k), KernelArgumentError);
  EXPECT_THROW(QuantizedWeight(raw_arg, "q4_1", n + 1, k), KernelArgumentError);
  EXPECT_THROW(QuantizedWeight(arg(raw, {n * rb}, DType::kUInt8, "raw"), "q4_1", n, k), KernelArgumentError);
  std::vector<int32_t> raw32(n * rb / 4);
  EXPECT_THROW(QuantizedWeight(arg(raw32, {n, rb / 4}, DType::kInt32, "raw"), "q4_1", n, k), KernelArgumentError);
  auto strided = raw_arg;
  strided.shape = {n / 2, rb};
  strided.strides = {2 * rb, 1};
  EXPECT_THROW(QuantizedWeight(strided, "q4_1", n / 2, k), KernelArgumentError);

  QuantizedWeight w(raw_arg, "q4_1", n, k);
  EXPECT_EQ(w.out_features(), n);
  EXPECT_EQ(w.in_features(), k);
  EXPECT_EQ(w.qtype(), QType::kQ4_1);
  const int64_t m = 3;
  std::vector<float> x(m * k, 1.f), out(m * n), bias(n), wide(m * (n + 1));
  std::vector<uint16_t> xb(m * k), outb(m * n);
  std::vector<int32_t> xi(m * k);
  auto X = arg(x, {m, k}, DType::kFloat32, "x");
  auto O = arg(out, {m, n}, DType::kFloat32, "out");
  auto B = arg(bias, {n}, DType::kFloat32, "bias");
  EXPECT_NO_THROW(w.linear(X, O, &B, 2));
  EXPECT_THROW(w.linear(arg(xi, {m, k}, DType::kInt32, "x"), O, nullptr, 1), KernelArgumentError);
  EXPECT_THROW(w.linear(arg(x, {m * k}, DType::kFloat32, "x"), O, nullptr, 1), KernelArgumentError);
  EXPECT_THROW(w.linear(arg(x, {m * 2, k / 2}, DType::kFloat32, "x"), O, nullptr, 1), KernelArgumentError);
  EXPECT_THROW(w.linear(X, arg(outb, {m, n}, DType::kBFloat16, "out"), nullptr, 1), KernelArgumentError);
  EXPECT_THROW(w.linear(arg(xb, {m, k}, DType::kBFloat16, "x"), O, nullptr, 1), KernelArgumentError);
  EXPECT_THROW(w.linear(X, arg(wide, {m, n + 1}, DType::kFloat32, "out"), nullptr, 1), KernelArgumentError);
  auto Ot = O;
  Ot.strides = {1, m};  // transposed view
  EXPECT_THROW(w.linear(X, Ot, nullptr, 1), KernelArgumentError);
  auto Ob = O;
  Ob.strides = {0, 1};  // broadcast rows: overlapping output
  EXPECT_THROW(w.linear(X, Ob, nullptr, 1), KernelArgumentError);
  auto Bs = arg(bias, {n - 1}, DType::kFloat32, "bias");
  EXPECT_THROW(w.linear(X, O, &Bs, 1), KernelArgumentError);
  auto Bb = arg(xb, {n}, DType::kBFloat16, "bias");
  EXPECT_THROW(w.linear(X, O, &Bb, 1), KernelArgumentError);
  EXPECT_THROW(w.linear(X, O, nullptr, 0), KernelArgumentError);
  EXPECT_THROW(w.linear(X, O, nullptr, 100000), KernelArgumentError);
  // linear_f32: float32, or bfloat16 in and out; the same shape / layout / bias / thread checks
  EXPECT_NO_THROW(w.linear_f32(X, O, &B, 2));
  EXPECT_NO_THROW(w.linear_f32(arg(xb, {m, k}, DType::kBFloat16, "x"), arg(outb, {m, n}, DType::kBFloat16, "out"),
                               nullptr, 1));
  EXPECT_THROW(w.linear_f32(arg(xb, {m, k}, DType::kFloat16, "x"), arg(outb, {m, n}, DType::kFloat16, "out"),
                            nullptr, 1),
               KernelArgumentError);
  EXPECT_THROW(w.linear_f32(arg(xb, {m, k}, DType::kBFloat16, "x"), O, nullptr, 1), KernelArgumentError);
  EXPECT_THROW(w.linear_f32(X, arg(outb, {m, n}, DType::kBFloat16, "out"), nullptr, 1), KernelArgumentError);
  EXPECT_THROW(w.linear_f32(arg(x, {m * 2, k / 2}, DType::kFloat32, "x"), O, nullptr, 1), KernelArgumentError);
  EXPECT_THROW(w.linear_f32(arg(x, {m * k}, DType::kFloat32, "x"), O, nullptr, 1), KernelArgumentError);
  EXPECT_THROW(w.linear_f32(X, arg(wide, {m, n + 1}, DType::kFloat32, "out"), nullptr, 1), KernelArgumentError);
  EXPECT_THROW(w.linear_f32(X, Ot, nullptr, 1), KernelArgumentError);
  EXPECT_THROW(w.linear_f32(X, Ob, nullptr, 1), KernelArgumentError);
  auto Xt = X;
  Xt.strides = {1, m};  // a transposed view: the right shape, not contiguous
  EXPECT_THROW(w.linear_f32(Xt, O, nullptr, 1), KernelArgumentError);
  EXPECT_THROW(w.linear_f32(X, O, &Bs, 1), KernelArgumentError);
  EXPECT_THROW(w.linear_f32(X, O, &Bb, 1), KernelArgumentError);
  EXPECT_THROW(w.linear_f32(X, O, nullptr, 0), KernelArgumentError);
  EXPECT_THROW(w.linear_f32(X, O, nullptr, 100000), KernelArgumentError);
  EXPECT_NO_THROW(w.linear_f32(arg(x, {0, k}, DType::kFloat32, "x"), arg(out, {0, n}, DType::kFloat32, "out"),
                               nullptr, 1));
  std::vector<float> d(n * k);
  EXPECT_THROW(w.dequantize(arg(d, {n, k - 32}, DType::kFloat32, "out")), KernelArgumentError);
  EXPECT_THROW(w.dequantize(arg(xb, {m, k}, DType::kBFloat16, "out")), KernelArgumentError);
  // M = 0 is allowed and writes nothing
  EXPECT_NO_THROW(w.linear(arg(x, {0, k}, DType::kFloat32, "x"), arg(out, {0, n}, DType::kFloat32, "out"), nullptr,
                           1));
}

// The GEMM the default variant runs, derived from the CPU's features and the
// builds this binary has (not from the registry's own ordering).
TEST(QuantIsa, TheActiveVariantsGemmIsTheBestThisCpuRuns) {
  const auto compiled = [](const char* variant) {
    for (const IsaVariant& v : compiled_isas()) {
      if (std::string(v.name) == variant) return true;
    }
    return false;
  };
  const CpuFeatures& f = cpu_features();
  std::string best = "scalar";
  if (f.x86_64_v4() && f.avx512_vnni && compiled("avx512_vnni")) {
    best = "avx512_vnni";
  } else if (f.x86_64_v3() && f.avx_vnni && compiled("avx_vnni")) {
    best = "avx_vnni";
  } else if (f.x86_64_v3() && compiled("avx2")) {
    best = "avx2";
  } else if (f.neon && f.arm_dotprod && compiled("neon_dotprod")) {
    best = "neon_dotprod";
  } else if (f.neon && compiled("neon")) {
    best = "neon";
  }
  const std::string active = active_isa().gemm().name;
  const char* forced = std::getenv("PAGEDSERVE_CPU_ISA");
  if (forced == nullptr || *forced == '\0') EXPECT_EQ(active, best);
  if (const char* expect = std::getenv("PAGEDSERVE_EXPECT_QUANT_ISA")) EXPECT_EQ(active, expect);
  std::cout << "[ isa ] active GEMM kernels: " << active << " (variant " << active_isa().name
            << ", avx512_vnni=" << f.avx512_vnni << ", avx_vnni=" << f.avx_vnni << ", dotprod=" << f.arm_dotprod
            << ")\n";
}

// The SIMD variants quantise the activations lane-wise with the scalar
// variant's steps: the same bytes and scales for ordinary values, NaN, +-inf,
// subnormals, all-zero groups, huge groups and exact .5 ties, float32 and
// bfloat16, rows written in two calls at once into a larger M.
TEST(QuantIsa, EveryVariantQuantisesActivationsBitIdentically) {
  const QuantKernelTable& ref = quant_kernel_table_scalar();
  const int64_t m = 7, k = 256, nb = k / 32;
  std::mt19937 rng(17);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(m * k);
  for (auto& v : x) v = nd(rng);
  for (int64_t e = 0; e < 32; ++e) x[32 + e] = 0.f;                    // row 0, group 1: all zero
  for (int64_t e = 0; e < 32; ++e) x[64 + e] = 1e-40f * (e - 16);      // subnormal group
  for (int64_t e = 0; e < 32; ++e) x[96 + e] = 3e38f * (e % 2 ? 1 : -1);
  x[128 + 3] = NAN;                                                     // a NaN in a group
  x[160 + 7] = INFINITY;                                                // inf: scale inf, quants 0 / NaN -> 0
  x[192 + 9] = -INFINITY;
  for (int64_t e = 0; e < 32; ++e) x[k + e] = static_cast<float>(e) - 15.5f;  // ties once scaled
  for (int64_t e = 0; e < 32; ++e) x[k + 32 + e] = e == 0 ? 127.f : static_cast<float>(e) + 0.5f;
  for (int64_t e = 0; e < 32; ++e) x[k + 64 + e] = NAN;                 // all NaN
  std::vector<uint16_t> xb(m * k);
  for (int64_t i = 0; i < m * k; ++i) xb[i] = std::isnan(x[i]) ? static_cast<uint16_t>(0x7FC0) : to_bf16_bits(x[i]);
  struct Out {
    std::vector<int8_t> xq;
    std::vector<float> xd, xs;
    std::vector<int32_t> xsum128;
  };
  const auto quantise = [&](const QuantKernelTable& t, bool bf16) {
    Out o{std::vector<int8_t>(m * k, -128), std::vector<float>(m * nb, -1.f), std::vector<float>(m * nb, -1.f),
          std::vector<int32_t>(m * nb, -1)};
    const void* src = bf16 ? static_cast<const void*>(xb.data()) : static_cast<const void*>(x.data());
    const DType dt = bf16 ? DType::kBFloat16 : DType::kFloat32;
    t.quantize_rows(src, dt, k, m, 0, 3, o.xq.data(), o.xd.data(), o.xsum128.data(), o.xs.data());
    t.quantize_rows(src, dt, k, m, 3, m, o.xq.data(), o.xd.data(), o.xsum128.data(), o.xs.data());
    return o;
  };
  for (bool bf16 : {false, true}) {
    const Out want = quantise(ref, bf16);
    EXPECT_EQ(std::count(want.xq.begin(), want.xq.end(), -128), 0);  // every element written (quants: [-127, 127])
    for (const IsaVariant& v : compiled_isas()) {
      if (!v.supported()) continue;
      const Out got = quantise(v.gemm(), bf16);
      EXPECT_EQ(got.xq, want.xq) << v.name << " bf16=" << bf16;
      EXPECT_EQ(got.xsum128, want.xsum128) << v.name << " bf16=" << bf16;
      EXPECT_EQ(std::memcmp(got.xd.data(), want.xd.data(), want.xd.size() * 4), 0) << v.name << " bf16=" << bf16;
      EXPECT_EQ(std::memcmp(got.xs.data(), want.xs.data(), want.xs.size() * 4), 0) << v.name << " bf16=" << bf16;
    }
  }
}

TEST(QuantIsa, AVariantThisCpuCannotRunIsRefusedNotExecuted) {
  QuantIsaGuard guard;
  EXPECT_THROW(set_active_isa("no-such-isa"), InvalidArgumentError);
  for (const IsaVariant& v : compiled_isas()) {
    if (!v.supported()) EXPECT_THROW(set_active_isa(v.name), InvalidArgumentError) << v.name;
  }
}

}  // namespace
