// The fused elementwise ops' kernels (ops/kernel_table.h), compiled once per
// ISA variant like attention/kernels.cc: CMake builds this file with PAGEDSERVE_ISA set
// to baseline, avx2, avx512, neon or native and that variant's -m flags; the
// loops are plain C++ with `omp simd` hints that the compiler vectorises.
//
// Rounding contract (what the tests check against Hugging Face's modules):
// every value is computed in float32, and a bfloat16 result is rounded to
// bfloat16 (round to nearest even) exactly where the PyTorch expression it
// replaces rounds, so each op reproduces the eager torch / transformers
// sequence of roundings, not merely its real-number value. This file is built
// with -ffp-contract=off (CMakeLists.txt): a fused multiply-add would skip a
// rounding the torch expression performs; and -fno-trapping-math, so silu's
// clamps and selects vectorise without AVX-512 masks (no value changes).
//
// Everything but the table getter has internal linkage and no standard-library
// template is used (tests/cpp/check_isa_objects.cmake verifies the objects).
#include <math.h>
#include <string.h>

#include <cstdint>

#include "backends/cpu/ops/kernel_table.h"
#include "backends/cpu/runtime/scalar_convert.h"

#ifndef PAGEDSERVE_ISA
#error "PAGEDSERVE_ISA must name the variant this file is compiled for"
#endif

namespace pagedserve {
namespace cpu {
namespace {


inline float ld(float x) { return x; }
inline float ld(bf16 x) { return bf16_to_float(x); }

inline void st(float v, float* p) { *p = v; }
inline void st(float v, bf16* p) { *p = float_to_bf16(v); }

// The value a float32 intermediate has once torch stores it in dtype T.
inline float rnd(float v, const float*) { return v; }
inline float rnd(float v, const bf16*) { return ld(float_to_bf16(v)); }

// silu(g) = g / (1 + exp(-g)), torch's formula. Where torch's exp(-g)
// overflows to inf (-g > ln(FLT_MAX) = 88.7228) the result is g * 0, as
// torch's g / inf (-0 for g < 0); exp's argument is clamped to [-88, 88]
// otherwise (for -g in (88, 88.7228] the result, |.| < 1e-36, is a few ulp
// off torch's). NaN propagates through g.
inline float silu(float g) {
  float t = -g;
  const bool overflow = t > 88.7228f;
  t = t > 88.f ? 88.f : t;
  t = t < -88.f ? -88.f : t;
  t = t == t ? t : 0.f;
  // both computed unconditionally: a select, so the loops vectorise without masks (AVX2, SSE2)
  const float zero = g * 0.f;
  const float s = g / (1.f + exp_poly(t));
  return overflow ? zero : s;
}

// gelu with the tanh approximation (Hendrycks & Gimpel 2016; torch's
// gelu(approximate="tanh"), Gemma's gelu_pytorch_tanh), in torch's form:
//   0.5 g (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3),
// with tanh(u) = sign(u) (1 - 2 / (exp(2|u|) + 1)) (exp's argument clamped to
// 88, where tanh is 1 in float32). Keeping torch's form keeps its rounding
// where it matters: for g below about -3, 1 + tanh(u) cancels, and torch's
// value carries that cancellation (up to returning 0 where the true value is
// ~1e-7); an expression without it (g / (1 + exp(-2u))) is more accurate but
// moved 13% of bfloat16 results by an ulp. Within a few float32 ulp of
// 1 + tanh(u) of torch's, which calls a vectorised tanh. NaN propagates.
inline float gelu_tanh(float g) {
  const float u = 0.7978845608028654f * (g + 0.044715f * (g * g * g));
  float a = 2.f * (u < 0.f ? -u : u);
  a = a > 88.f ? 88.f : a;
  a = a == a ? a : 0.f;
  float t = 1.f - 2.f / (exp_poly(a) + 1.f);
  t = u < 0.f ? -t : t;
  return 0.5f * g * (1.f + t);
}

// ---- rms_norm (Zhang & Sennrich 2019), Hugging Face LlamaRMSNorm semantics ----

// 1 / sqrt(mean + eps) from the row's sum of squares, as torch evaluates
// `torch.rsqrt(x.pow(2).mean(-1) + eps)` (mean = sum / h).
inline float inv_rms(float sum_sq, int64_t h, float eps) {
  const float var = sum_sq / static_cast<float>(h);
  return 1.f / sqrtf(var + eps);
}

// out = weight * to_dtype(v * inv) over one row (v read from src, which may be out).
template <typename T>
void norm_store(const T* src, const T* w, T* out, int64_t h, float inv) {
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) {
    const float n = rnd(ld(src[i]) * inv, out);
    st(ld(w[i]) * n, out + i);
  }
}

template <typename T>
void rms_norm_typed(const NormArgs& a, int64_t r0, int64_t r1) {
  const int64_t h = a.h;
  const T* w = static_cast<const T*>(a.weight);
  for (int64_t r = r0; r < r1; ++r) {
    const T* x = static_cast<const T*>(a.x) + r * a.x_stride;
    T* out = static_cast<T*>(a.out) + r * a.out_stride;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < h; ++i) {
      const float v = ld(x[i]);
      ss += v * v;
    }
    norm_store(x, w, out, h, inv_rms(ss, h, a.eps));
  }
}

template <typename T>
void fused_add_rms_norm_typed(const NormArgs& a, int64_t r0, int64_t r1) {
  const int64_t h = a.h;
  const T* w = static_cast<const T*>(a.weight);
  for (int64_t r = r0; r < r1; ++r) {
    T* x = static_cast<T*>(a.out) + r * a.out_stride;
    T* res = static_cast<T*>(a.residual) + r * a.residual_stride;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < h; ++i) {
      const float v = rnd(ld(res[i]) + ld(x[i]), res);  // `residual + hidden_states` in dtype T
      st(v, res + i);
      ss += v * v;
    }
    norm_store(res, w, x, h, inv_rms(ss, h, a.eps));
  }
}

// ---- silu_and_mul (SwiGLU's gate) and gelu_tanh_and_mul (GeGLU's: Gemma's MLP);
// Shazeer 2020, vLLM's ops ----

template <typename T, float (*Act)(float)>
void gated_and_mul_typed(const SiluMulArgs& a, int64_t r0, int64_t r1) {
  const int64_t d = a.d;
  for (int64_t r = r0; r < r1; ++r) {
    const T* gate = static_cast<const T*>(a.x) + r * a.x_stride;
    const T* up = gate + d;
    T* out = static_cast<T*>(a.out) + r * a.out_stride;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) {
      const float s = rnd(Act(ld(gate[i])), out);  // act_fn(gate) stored in dtype T
      st(s * ld(up[i]), out + i);
    }
  }
}

// ---- rotary_embedding (RoPE, Su et al. 2021) ----

// One head, neox style (rotate_half): x1 = x[:half], x2 = x[half:2half];
// x1' = x1*cos + (-x2)*sin, x2' = x2*cos + x1*sin, each product and the sum
// rounded to T (HF apply_rotary_pos_emb: (q * cos) + (rotate_half(q) * sin)).
template <typename T>
void rope_neox(T* x, const float* c, const float* s, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = ld(x[i]), x2 = ld(x[half + i]);
    const float o1 = rnd(x1 * c[i], x) + rnd(-x2 * s[i], x);
    const float o2 = rnd(x2 * c[i], x) + rnd(x1 * s[i], x);
    st(o1, x + i);
    st(o2, x + half + i);
  }
}

// GPT-J style (vLLM is_neox=False): pairs (x[2i], x[2i+1]) rotate by angle i.
template <typename T>
void rope_gptj(T* x, const float* c, const float* s, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = ld(x[2 * i]), x2 = ld(x[2 * i + 1]);
    const float o1 = rnd(x1 * c[i], x) - rnd(x2 * s[i], x);
    const float o2 = rnd(x2 * c[i], x) + rnd(x1 * s[i], x);
    st(o1, x + 2 * i);
    st(o2, x + 2 * i + 1);
  }
}

template <typename T>
void rotary_typed(const RotaryArgs& a, int64_t r0, int64_t r1) {
  const int64_t half = a.rot_dim / 2;
  float cs[kMaxRotaryDim];  // cos and sin as dtype T values (HF: cos.to(x.dtype))
  for (int64_t r = r0; r < r1; ++r) {
    const float* row = a.cos_sin_cache + a.positions[r] * a.rot_dim;
    T* x = static_cast<T*>(a.x) + r * a.row_stride;
#pragma omp simd
    for (int64_t i = 0; i < a.rot_dim; ++i) cs[i] = rnd(row[i], x);
    for (int64_t hd = 0; hd < a.num_heads; ++hd) {
      if (a.is_neox) {
        rope_neox(x + hd * a.head_stride, cs, cs + half, half);
      } else {
        rope_gptj(x + hd * a.head_stride, cs, cs + half, half);
      }
    }
  }
}

void rms_norm(const NormArgs& a, int64_t r0, int64_t r1) {
  if (a.dtype == DType::kFloat32) {
    rms_norm_typed<float>(a, r0, r1);
  } else {
    rms_norm_typed<bf16>(a, r0, r1);
  }
}

void fused_add_rms_norm(const NormArgs& a, int64_t r0, int64_t r1) {
  if (a.dtype == DType::kFloat32) {
    fused_add_rms_norm_typed<float>(a, r0, r1);
  } else {
    fused_add_rms_norm_typed<bf16>(a, r0, r1);
  }
}

void silu_and_mul(const SiluMulArgs& a, int64_t r0, int64_t r1) {
  if (a.dtype == DType::kFloat32) {
    gated_and_mul_typed<float, silu>(a, r0, r1);
  } else {
    gated_and_mul_typed<bf16, silu>(a, r0, r1);
  }
}

void gelu_tanh_and_mul(const SiluMulArgs& a, int64_t r0, int64_t r1) {
  if (a.dtype == DType::kFloat32) {
    gated_and_mul_typed<float, gelu_tanh>(a, r0, r1);
  } else {
    gated_and_mul_typed<bf16, gelu_tanh>(a, r0, r1);
  }
}

void rotary_embedding(const RotaryArgs& a, int64_t r0, int64_t r1) {
  if (a.dtype == DType::kFloat32) {
    rotary_typed<float>(a, r0, r1);
  } else {
    rotary_typed<bf16>(a, r0, r1);
  }
}

const FusedKernelTable kTable{PS_STR(PAGEDSERVE_ISA), &rms_norm, &fused_add_rms_norm, &silu_and_mul,
                              &gelu_tanh_and_mul, &rotary_embedding};

}  // namespace

const FusedKernelTable& PS_CAT(fused_kernel_table_, PAGEDSERVE_ISA)() { return kTable; }

}  // namespace cpu
}  // namespace pagedserve
