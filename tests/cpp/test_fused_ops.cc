// The fused elementwise CPU ops (csrc/backends/cpu/ops/fused_ops.h) against plain
// scalar references that spell out the torch roundings they must reproduce,
// under every kernel variant this CPU executes; argument checks; threading.
// (tests/python/test_fused_ops.py checks them against Hugging Face's modules.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backends/cpu/runtime/isa_registry.h"
#include "backends/cpu/ops/fused_ops.h"
#include "core/errors.h"

namespace pagedserve {
namespace cpu {
namespace {

using bf16 = uint16_t;

float bf2f(bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
bf16 f2bf(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return static_cast<bf16>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// A host buffer of float32 or bfloat16 values with the TensorArg that views it.
struct Buf {
  DType dtype;
  std::vector<float> f;
  std::vector<bf16> b;
  Buf(DType d, int64_t n) : dtype(d), f(d == DType::kFloat32 ? n : 0), b(d == DType::kBFloat16 ? n : 0) {}
  void* data() { return dtype == DType::kFloat32 ? static_cast<void*>(f.data()) : static_cast<void*>(b.data()); }
  float get(int64_t i) const { return dtype == DType::kFloat32 ? f[i] : bf2f(b[i]); }
  void set(int64_t i, float v) {
    if (dtype == DType::kFloat32) {
      f[i] = v;
    } else {
      b[i] = f2bf(v);
    }
  }
  // The value v takes once stored in this dtype.
  float round(float v) const { return dtype == DType::kFloat32 ? v : bf2f(f2bf(v)); }
  TensorArg arg(const char* name, std::vector<int64_t> shape, std::vector<int64_t> strides = {}) {
    if (strides.empty()) {
      strides.assign(shape.size(), 1);
      for (int64_t i = static_cast<int64_t>(shape.size()) - 2; i >= 0; --i) strides[i] = strides[i + 1] * shape[i + 1];
    }
    TensorArg t;
    t.data = data();
    t.dtype = dtype;
    t.shape = std::move(shape);
    t.strides = std::move(strides);
    t.name = name;
    return t;
  }
};

Buf random_buf(DType d, int64_t n, float scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, scale);
  Buf b(d, n);
  for (int64_t i = 0; i < n; ++i) b.set(i, dist(rng));
  return b;
}

TensorArg int64_arg(std::vector<int64_t>& v, const char* name) {
  TensorArg t;
  t.data = v.data();
  t.dtype = DType::kInt64;
  t.shape = {static_cast<int64_t>(v.size())};
  t.strides = {1};
  t.name = name;
  return t;
}

TensorArg float_arg(std::vector<float>& v, std::vector<int64_t> shape, const char* name) {
  Buf dummy(DType::kFloat32, 0);
  TensorArg t = dummy.arg(name, shape);
  t.data = v.data();
  return t;
}

// float32: within 1e-6 relative (summation order, exp's last bits). bfloat16:
// a float32 intermediate ~1e-7 off can flip one rounding to bfloat16 by one
// ulp (<= 2^-7 relative: the normalised value, silu); the next rounded product
// carries it with its own half ulp of either result: <= 1.5 * 2^-7 < 2^-6
// relative. Such flips are rare, so nearly every value is bit-identical.
void expect_close(const Buf& got, const std::vector<float>& want, int64_t n, const std::string& what) {
  const float rtol = got.dtype == DType::kFloat32 ? 1e-6f : 0.015625f;
  int64_t bad = 0, differ = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float g = got.get(i), w = want[i];
    if (g != w) ++differ;
    if (!(std::fabs(g - w) <= rtol * std::fabs(w) + 1e-30f)) {
      if (++bad <= 5) ADD_FAILURE() << what << " [" << i << "]: got " << g << ", want " << w;
    }
  }
  EXPECT_EQ(bad, 0) << what;
  if (got.dtype == DType::kBFloat16) EXPECT_LE(differ, std::max<int64_t>(1, n / 100)) << what;
}

// The test body under each kernel variant this CPU runs (restored afterwards).
template <typename F>
void for_each_isa(const F& body) {
  const std::string before = active_isa().name;
  for (const std::string& name : variants_for(KernelFamily::kOps)) {  // one per ops table this CPU runs
    set_active_isa(name);
    SCOPED_TRACE(name);
    body();
  }
  set_active_isa(before);
}

const DType kDtypes[] = {DType::kFloat32, DType::kBFloat16};
const int64_t kShapes[][2] = {{1, 576}, {3, 1536}, {64, 576}, {3, 7}, {1, 7}};

// ---- references: the torch expressions, one rounding per torch op ----

std::vector<float> ref_rms_norm(const Buf& x, const Buf& w, int64_t T, int64_t H, float eps) {
  std::vector<float> out(T * H);
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0;  // the exact mean of squares (torch's float sum is within 1e-7 of it)
    for (int64_t i = 0; i < H; ++i) ss += static_cast<double>(x.get(t * H + i)) * x.get(t * H + i);
    const float inv = 1.f / std::sqrt(static_cast<float>(ss / H) + eps);
    for (int64_t i = 0; i < H; ++i) {
      const float n = x.round(x.get(t * H + i) * inv);  // hidden_states.to(input_dtype)
      out[t * H + i] = x.round(w.get(i) * n);          // weight * ...
    }
  }
  return out;
}

TEST(FusedOps, RmsNormMatchesReference) {
  for_each_isa([] {
    for (DType d : kDtypes) {
      for (const auto& s : kShapes) {
        const int64_t T = s[0], H = s[1];
        Buf x = random_buf(d, T * H, 3.f, 1), w = random_buf(d, H, 0.5f, 2), out(d, T * H);
        for (int64_t i = 0; i < H; ++i) w.set(i, 1.f + w.get(i));
        rms_norm(out.arg("out", {T, H}), x.arg("x", {T, H}), w.arg("w", {H}), 1e-5f);
        expect_close(out, ref_rms_norm(x, w, T, H, 1e-5f), T * H, "rms_norm " + std::to_string(H));
        // in place gives the same values
        rms_norm(x.arg("out", {T, H}), x.arg("x", {T, H}), w.arg("w", {H}), 1e-5f);
        for (int64_t i = 0; i < T * H; ++i) ASSERT_EQ(x.get(i), out.get(i));
      }
    }
  });
}

TEST(FusedOps, FusedAddRmsNormMatchesReference) {
  for_each_isa([] {
    for (DType d : kDtypes) {
      for (const auto& s : kShapes) {
        const int64_t T = s[0], H = s[1];
        Buf x = random_buf(d, T * H, 1.f, 3), res = random_buf(d, T * H, 2.f, 4), w = random_buf(d, H, 1.f, 5);
        Buf sum(d, T * H);
        for (int64_t i = 0; i < T * H; ++i) sum.set(i, res.get(i) + x.get(i));  // residual + hidden_states
        const std::vector<float> want = ref_rms_norm(sum, w, T, H, 1e-6f);
        fused_add_rms_norm(x.arg("x", {T, H}), res.arg("residual", {T, H}), w.arg("w", {H}), 1e-6f, 2);
        for (int64_t i = 0; i < T * H; ++i) ASSERT_EQ(res.get(i), sum.get(i)) << i;
        expect_close(x, want, T * H, "fused_add_rms_norm");
      }
    }
  });
}

TEST(FusedOps, SiluAndMulMatchesReference) {
  for_each_isa([] {
    for (DType d : kDtypes) {
      for (const auto& s : kShapes) {
        const int64_t T = s[0], I = s[1];
        Buf x = random_buf(d, T * 2 * I, 4.f, 6), out(d, T * I);
        x.set(0, -100.f);  // exp(-g) overflows in torch: silu = -0
        std::vector<float> want(T * I);
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t i = 0; i < I; ++i) {
            const float g = x.get(t * 2 * I + i), u = x.get(t * 2 * I + I + i);
            const float silu = x.round(g / (1.f + std::exp(-g)));  // act_fn(gate) in the dtype
            want[t * I + i] = x.round(silu * u);
          }
        }
        silu_and_mul(out.arg("out", {T, I}), x.arg("x", {T, 2 * I}));
        expect_close(out, want, T * I, "silu_and_mul");
        EXPECT_EQ(out.get(0), 0.f);
      }
    }
  });
}

// neox rotary reference on a [T, H, D] buffer with row stride rs (elements).
std::vector<float> ref_rope(const Buf& x, const std::vector<int64_t>& pos, const std::vector<float>& cache,
                            int64_t H, int64_t D, int64_t rs) {
  std::vector<float> out(x.dtype == DType::kFloat32 ? x.f.size() : x.b.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = x.get(i);
  const int64_t half = D / 2;
  for (size_t t = 0; t < pos.size(); ++t) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t base = t * rs + h * D;
      for (int64_t i = 0; i < half; ++i) {
        const float c = x.round(cache[pos[t] * D + i]), s = x.round(cache[pos[t] * D + half + i]);
        const float x1 = x.get(base + i), x2 = x.get(base + half + i);
        out[base + i] = x.round(x.round(x1 * c) + x.round(-x2 * s));
        out[base + half + i] = x.round(x.round(x2 * c) + x.round(x1 * s));
      }
    }
  }
  return out;
}

std::vector<float> rope_cache(int64_t max_pos, int64_t D) {
  std::vector<float> cache(max_pos * D);
  for (int64_t p = 0; p < max_pos; ++p) {
    for (int64_t i = 0; i < D / 2; ++i) {
      const float f = static_cast<float>(p) * std::pow(10000.f, -2.f * i / D);
      cache[p * D + i] = std::cos(f);
      cache[p * D + D / 2 + i] = std::sin(f);
    }
  }
  return cache;
}

// GeGLU (Gemma's MLP): 0.5 g (1 + tanh(u)) in torch's form; its 1 + tanh(u) is
// within a few float32 ulp of the exact one, so the error bound is |g| |up|
// times a few ulp of 1 (relative to the result where 1 + tanh(u) is large).
TEST(FusedOps, GeluTanhAndMulMatchesReference) {
  for_each_isa([] {
    for (DType d : kDtypes) {
      for (const auto& s : kShapes) {
        const int64_t T = s[0], I = s[1];
        Buf x = random_buf(d, T * 2 * I, 4.f, 7), out(d, T * I);
        std::vector<float> want(T * I), bound(T * I);
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t i = 0; i < I; ++i) {
            const double g = x.get(t * 2 * I + i), up = x.get(t * 2 * I + I + i);
            const double u = 0.7978845608028654 * (g + 0.044715 * g * g * g);
            const float act = x.round(static_cast<float>(0.5 * g * (1.0 + std::tanh(u))));
            want[t * I + i] = x.round(act * static_cast<float>(up));
            const double ulp = d == DType::kFloat32 ? 6e-8 : 0.0078125;
            bound[t * I + i] = static_cast<float>((std::fabs(g) * 4e-7 + ulp * std::fabs(act)) * std::fabs(up) +
                                                  ulp * std::fabs(want[t * I + i]));
          }
        }
        gelu_tanh_and_mul(out.arg("out", {T, I}), x.arg("x", {T, 2 * I}));
        int64_t bad = 0;
        for (int64_t i = 0; i < T * I; ++i) {
          if (!(std::fabs(out.get(i) - want[i]) <= bound[i])) {
            if (++bad <= 5) ADD_FAILURE() << "gelu_tanh_and_mul [" << i << "]: got " << out.get(i) << ", want " << want[i];
          }
        }
        EXPECT_EQ(bad, 0);
      }
    }
  });
}

TEST(FusedOps, RotaryEmbeddingOnQkvViewsMatchesReference) {
  for_each_isa([] {
    for (DType d : kDtypes) {
      for (int64_t T : {1, 3, 64}) {
        const int64_t Hq = 9, Hk = 3, D = 64, W = (Hq + 2 * Hk) * D, max_pos = 100;
        std::vector<float> cache = rope_cache(max_pos, D);
        std::vector<int64_t> pos(T);
        for (int64_t t = 0; t < T; ++t) pos[t] = (t * 37 + 5) % max_pos;
        pos[0] = max_pos - 1;
        Buf qkv = random_buf(d, T * W, 1.f, 7);
        const std::vector<float> want = ref_rope(qkv, pos, cache, Hq + Hk, D, W);  // q and k heads are adjacent
        TensorArg q = qkv.arg("query", {T, Hq * D}, {W, 1});
        TensorArg k = qkv.arg("key", {T, Hk * D}, {W, 1});
        k.data = static_cast<char*>(qkv.data()) + Hq * D * (d == DType::kFloat32 ? 4 : 2);
        rotary_embedding(int64_arg(pos, "positions"), q, &k, D, float_arg(cache, {max_pos, D}, "cache"), true,
                         T > 1 ? 2 : 1);
        expect_close(qkv, want, T * W, "rotary_embedding");  // v columns: untouched (want holds them as read)
      }
    }
  });
}

TEST(FusedOps, ThreadsChangeNothing) {
  const int64_t T = 300, H = 576;
  for (DType d : kDtypes) {
    Buf x = random_buf(d, T * H, 1.f, 8), w = random_buf(d, H, 1.f, 9), a(d, T * H), b(d, T * H);
    rms_norm(a.arg("out", {T, H}), x.arg("x", {T, H}), w.arg("w", {H}), 1e-5f, 1);
    rms_norm(b.arg("out", {T, H}), x.arg("x", {T, H}), w.arg("w", {H}), 1e-5f, 4);
    for (int64_t i = 0; i < T * H; ++i) ASSERT_EQ(a.get(i), b.get(i));
    Buf g = random_buf(d, T * 2 * H, 1.f, 10);
    silu_and_mul(a.arg("out", {T, H}), g.arg("x", {T, 2 * H}), 1);
    silu_and_mul(b.arg("out", {T, H}), g.arg("x", {T, 2 * H}), 3);
    for (int64_t i = 0; i < T * H; ++i) ASSERT_EQ(a.get(i), b.get(i));
  }
}

TEST(FusedOps, BadArgumentsThrowAndWriteNothing) {
  const int64_t T = 4, H = 16, D = 8, max_pos = 10;
  Buf x = random_buf(DType::kFloat32, T * H, 1.f, 11), w(DType::kFloat32, H), out(DType::kFloat32, T * H);
  Buf xb(DType::kBFloat16, T * H), wb(DType::kBFloat16, H);
  EXPECT_THROW(rms_norm(out.arg("out", {T, H}), x.arg("x", {T, H}), wb.arg("w", {H}), 1e-5f), KernelArgumentError);
  EXPECT_THROW(rms_norm(out.arg("out", {T, H}), xb.arg("x", {T, H}), wb.arg("w", {H}), 1e-5f), KernelArgumentError);
  EXPECT_THROW(rms_norm(out.arg("out", {T, H - 1}), x.arg("x", {T, H}), w.arg("w", {H}), 1e-5f),
               KernelArgumentError);
  EXPECT_THROW(rms_norm(out.arg("out", {T, H}), x.arg("x", {T, H}), w.arg("w", {H - 1}), 1e-5f),
               KernelArgumentError);
  EXPECT_THROW(rms_norm(out.arg("out", {T, H}, {H, 2}), x.arg("x", {T, H}), w.arg("w", {H}), 1e-5f),
               KernelArgumentError);
  EXPECT_THROW(rms_norm(out.arg("out", {T, H}, {1, 1}), x.arg("x", {T, H}), w.arg("w", {H}), 1e-5f),
               KernelArgumentError);  // overlapping rows
  EXPECT_THROW(rms_norm(out.arg("out", {T, H}, {-H, 1}), x.arg("x", {T, H}), w.arg("w", {H}), 1e-5f),
               KernelArgumentError);  // negative stride
  EXPECT_THROW(rms_norm(out.arg("out", {T, H}), x.arg("x", {T, H}), w.arg("w", {H}), -1.f), KernelArgumentError);
  EXPECT_THROW(rms_norm(out.arg("out", {T, H}), x.arg("x", {T, H}), w.arg("w", {H}), 1e-5f, 0), KernelArgumentError);
  EXPECT_THROW(fused_add_rms_norm(x.arg("x", {T, H}), x.arg("residual", {T, H}), w.arg("w", {H}), 1e-5f),
               KernelArgumentError);  // aliasing
  EXPECT_THROW(silu_and_mul(out.arg("out", {T, H / 2}), x.arg("x", {T, H - 1}, {H, 1})), KernelArgumentError);
  EXPECT_THROW(silu_and_mul(x.arg("out", {T, H / 2}, {H, 1}), x.arg("x", {T, H})), KernelArgumentError);

  std::vector<float> cache = rope_cache(max_pos, D);
  std::vector<int64_t> pos = {0, 3, max_pos, 1};
  const std::vector<float> before = x.f;
  TensorArg q = x.arg("query", {T, H});
  EXPECT_THROW(rotary_embedding(int64_arg(pos, "positions"), q, nullptr, D, float_arg(cache, {max_pos, D}, "c"), true),
               KernelArgumentError);
  pos[2] = -1;
  EXPECT_THROW(rotary_embedding(int64_arg(pos, "positions"), q, nullptr, D, float_arg(cache, {max_pos, D}, "c"), true),
               KernelArgumentError);
  EXPECT_EQ(x.f, before);  // positions are checked before anything is written
  pos[2] = 2;
  EXPECT_THROW(rotary_embedding(int64_arg(pos, "positions"), q, nullptr, 5, float_arg(cache, {max_pos, D}, "c"), true),
               KernelArgumentError);  // head_size does not divide the columns
  EXPECT_THROW(rotary_embedding(int64_arg(pos, "positions"), q, nullptr, 4, float_arg(cache, {max_pos, D}, "c"), true),
               KernelArgumentError);  // rot_dim > head_size
  EXPECT_THROW(rotary_embedding(int64_arg(pos, "positions"), q, nullptr, D, float_arg(cache, {max_pos * 2, D / 2 + 1}, "c"),
                                true),
               KernelArgumentError);  // odd rot_dim
  EXPECT_THROW(rotary_embedding(int64_arg(pos, "positions"), x.arg("query", {T, H}, {H / 2, 1}), nullptr, D,
                                float_arg(cache, {max_pos, D}, "c"), true),
               KernelArgumentError);  // overlapping rows
  TensorArg kb = xb.arg("key", {T, D});
  EXPECT_THROW(rotary_embedding(int64_arg(pos, "positions"), q, &kb, D, float_arg(cache, {max_pos, D}, "c"), true),
               KernelArgumentError);  // key dtype differs
  EXPECT_EQ(x.f, before);
  EXPECT_NO_THROW(
      rotary_embedding(int64_arg(pos, "positions"), q, nullptr, D, float_arg(cache, {max_pos, D}, "c"), true));
}

}  // namespace
}  // namespace cpu
}  // namespace pagedserve
