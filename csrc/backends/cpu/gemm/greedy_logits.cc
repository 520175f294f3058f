#include "backends/cpu/gemm/greedy_logits.h"

#include <atomic>
#include <cfloat>
#include <cmath>
#include <vector>

#include "backends/cpu/runtime/isa_registry.h"
#include "backends/cpu/runtime/thread_pool.h"

namespace pagedserve {
namespace cpu {
namespace {

constexpr int64_t kGroupRows = kQRows;  // outputs per row group (16)

// C of the bound B[j] = norm[j] * C (greedy_logits.h) for row x [K] and its
// int8 quantisation (xq [K/32, M, 32], xd [K/32, M]: quantize_rows' layout,
// the row at index r of M), rounded up to float32; per_block: the int8 pass's
// roundings per 32-block counted in its term (2: Q8_0; 4: i6f, a scale per 16).
float bound_factor(const float* x, int64_t k, const int8_t* xq, const float* xd, int64_t m, int64_t r,
                   int64_t per_block) {
  const int64_t nb = k / kQBlock;
  double e2 = 0.0, x2 = 0.0;  // |x~ - x|^2 and |x|^2; each term exact in double, each sum within K 2^-53
  for (int64_t b = 0; b < nb; ++b) {
    const double d = xd[b * m + r];
    const int8_t* q = xq + (b * m + r) * kQBlock;
    for (int64_t e = 0; e < kQBlock; ++e) {
      const double v = x[b * kQBlock + e], err = v - d * q[e];
      e2 += err * err;
      x2 += v * v;
    }
  }
  const double en = std::sqrt(e2) * (1.0 + 0x1p-30), xn = std::sqrt(x2) * (1.0 + 0x1p-30);
  const double c = (en + static_cast<double>(k + per_block * nb + 8) * 0x1p-23 * (xn + en)) * (1.0 + 0x1p-20);
  float f = static_cast<float>(c);
  if (static_cast<double>(f) < c) f = std::nextafter(f, INFINITY);
  return f;
}

// Row r's candidate row groups (ascending) from its first-pass outputs a [N],
// with out's row set to -inf meanwhile (a and o may be the same memory).
// False where an output is not finite, or where a partial sum of the exact
// pass could overflow: each is at most norm[j] (|x| + |e|) <= norm[j] c 2^23
// / K (Cauchy-Schwarz), so the largest bound norm[j] c must stay below 2^97.
bool row_candidates(const float* a, const float* norms, int64_t n, float c, float* o, std::vector<int64_t>* groups) {
  float lmax = -FLT_MAX, amax = 0.f, bmax = 0.f;
  int bad = 0;
#pragma omp simd reduction(max : lmax, amax, bmax) reduction(| : bad)
  for (int64_t j = 0; j < n; ++j) {
    const float b = norms[j] * c, aj = a[j], mag = std::fabs(aj), lo = aj - b;
    bad |= !(mag <= FLT_MAX);
    lmax = lo > lmax ? lo : lmax;
    amax = mag > amax ? mag : amax;
    bmax = b > bmax ? b : bmax;
  }
  const bool finite = bad == 0;
  if (!finite || !(bmax <= 0x1p97f)) return false;
  // the float sums above and below round by at most 2^-24 (|a| + b) each: a margin of 2^-20 (amax + bmax) keeps
  // every output whose exact upper bound reaches the exact largest lower bound; 2^-100 more covers what
  // underflow can take from either pass and from the bound (subnormal products and sums: a few hundred
  // roundings of 2^-149 at most, or a scale product d * xd flushed to zero: below 2^-120 an output)
  const float threshold = lmax - (amax + bmax) * 0x1p-20f - 0x1p-100f;
  for (int64_t g0 = 0; g0 < n; g0 += kGroupRows) {
    const int64_t g1 = g0 + kGroupRows < n ? g0 + kGroupRows : n;
    int any = 0;
#pragma omp simd reduction(| : any)
    for (int64_t j = g0; j < g1; ++j) {
      any |= a[j] + norms[j] * c >= threshold;
      o[j] = -INFINITY;
    }
    if (any != 0) groups->push_back(g0 / kGroupRows);
  }
  return true;
}

}  // namespace

bool prunes_greedy_logits(const QuantizedWeight& w) {
  return (w.tile_format() == TileFormat::kQ8_0 || w.tile_format() == TileFormat::kI6F) && w.integer_kernels();
}

void greedy_logits(const QuantizedWeight& w, const TensorArg& x, const TensorArg& out, int num_threads) {
  x.check_dtype(DType::kFloat32);
  const int64_t m = check_linear_args(x, out, nullptr, num_threads, w.out_features(), w.in_features());
  if (m == 0) return;
  greedy_logits_raw(w, x.ptr<float>(), m, out.ptr<float>(), num_threads, active_isa().gemm());
}

void greedy_logits_raw(const QuantizedWeight& w, const float* x, int64_t m, float* out, int num_threads,
                       const QuantKernelTable& kernels) {
  const int64_t n = w.out_features(), k = w.in_features();
  const auto in_full = [&] {
    QuantizedWeight::linear_f32_parts({&w}, x, m, out, n, nullptr, num_threads, kernels);
  };
  // one row: the float32 pass of a large output layer reads its blocks from memory in about the time the int8
  // pass does, and the scans cost the rest (Gemma 3 270M's 262,144 rows: a token no faster, docs/benchmarks.md)
  // K above 2^22: the relative rounding terms of the bound (k 2^-23 with room to spare) would need more care
  if (m < 2 || k > (int64_t{1} << 22)) return in_full();
  const float* norms = prunes_greedy_logits(w) ? w.row_norms(num_threads) : nullptr;
  if (norms == nullptr) return in_full();
  for (int64_t i = 0; i < m * k; ++i) {
    if (!(std::fabs(x[i]) <= FLT_MAX)) return in_full();  // NaN / inf: argmax must see them as linear_f32 gives them
  }
  // the activations' int8 quantisation, as the first pass computes it (bit-identical in every variant)
  const int64_t nb = k / kQBlock;
  std::vector<int8_t> xq(static_cast<size_t>(m * k));
  std::vector<float> xd(static_cast<size_t>(m * nb)), xs(static_cast<size_t>(m * nb));
  std::vector<int32_t> xsum128(static_cast<size_t>(m * nb));
  kernels.quantize_rows(x, DType::kFloat32, k, m, 0, m, xq.data(), xd.data(), xsum128.data(), xs.data());
  std::vector<float> c(static_cast<size_t>(m));
  const int64_t per_block = w.tile_format() == TileFormat::kI6F ? 4 : 2;
  for (int64_t r = 0; r < m; ++r) {
    c[static_cast<size_t>(r)] = bound_factor(x + r * k, k, xq.data(), xd.data(), m, r, per_block);
  }
  w.linear_raw(x, DType::kFloat32, m, out, nullptr, num_threads, kernels);  // the int8 first pass
  std::vector<std::vector<int64_t>> groups(static_cast<size_t>(m));
  std::atomic<bool> ok{true};
  const auto one_row = [&](int64_t r, int) {
    float* o = out + r * n;
    if (!row_candidates(o, norms, n, c[static_cast<size_t>(r)], o, &groups[static_cast<size_t>(r)])) ok = false;
  };
  if (num_threads == 1 || m == 1) {
    for (int64_t r = 0; r < m; ++r) one_row(r, 0);
  } else {
    ThreadPool::get(num_threads)->run(m, one_row);
  }
  const int64_t num_groups = (n + kGroupRows - 1) / kGroupRows;
  std::vector<int64_t> items;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g : groups[static_cast<size_t>(r)]) items.push_back(r * num_groups + g);
  }
  if (!ok || static_cast<int64_t>(items.size()) * 4 > m * num_groups) return in_full();
  w.linear_f32_groups(x, m, out, items, num_threads, kernels);
}

}  // namespace cpu
}  // namespace pagedserve
