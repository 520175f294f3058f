// What the tests of greedy_logits (gemm/greedy_logits.h) check on every
// output it gives: each entry is linear_f32's very bits or -inf, an entry is
// -inf only where linear_f32's value lies below its row's maximum, and each
// row's first maximum (argmax) is linear_f32's.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "backends/cpu/gemm/greedy_logits.h"
#include "backends/cpu/gemm/quant_linear.h"
#include "contiguous_arg.h"

namespace pagedserve {
namespace test_support {

// full = linear_f32's [m, n] output, got = greedy_logits' for the same x.
// Returns the -inf entries of got (the pruned ones) and sets first[i] to row
// i's first maximum; a fatal failure returns early (the caller checks
// HasFatalFailure()).
inline int64_t check_greedy_rows(const std::vector<float>& full, const std::vector<float>& got, int64_t m,
                                 int64_t n, std::vector<int64_t>* first) {
  int64_t pruned = 0;
  first->assign(static_cast<size_t>(m), -1);
  for (int64_t i = 0; i < m; ++i) {
    const float* f = full.data() + i * n;
    const int64_t top = std::max_element(f, f + n) - f;  // the first maximum, as argmax
    for (int64_t j = 0; j < n; ++j) {
      const int64_t at = i * n + j;
      if (got[at] == -INFINITY && full[at] != -INFINITY) {
        ++pruned;
        EXPECT_LT(full[at], f[top]) << "a row maximum was dropped at [" << i << ", " << j << "]";
      } else {
        EXPECT_EQ(std::memcmp(&got[at], &full[at], 4), 0) << "a kept value differs at [" << i << ", " << j << "]";
      }
      if (::testing::Test::HasFailure()) return pruned;
    }
    const float* g = got.data() + i * n;
    EXPECT_EQ(std::max_element(g, g + n) - g, top) << "row " << i;
    (*first)[static_cast<size_t>(i)] = top;
  }
  return pruned;
}

// Runs linear_f32 and greedy_logits of w on x [m, k] (threads threads) and
// checks greedy_logits' output as check_greedy_rows does; got: its output
// [m, n]. Returns the pruned entries.
inline int64_t greedy_against_full(const cpu::QuantizedWeight& w, const std::vector<float>& x, int64_t m,
                                   int threads, std::vector<float>* got, std::vector<int64_t>* first) {
  const int64_t n = w.out_features(), k = w.in_features();
  std::vector<float> full(static_cast<size_t>(m * n));
  got->assign(static_cast<size_t>(m * n), 42.f);
  w.linear_f32(arg(x, {m, k}, DType::kFloat32, "x"), arg(full, {m, n}, DType::kFloat32, "out"), nullptr, threads);
  cpu::greedy_logits(w, arg(x, {m, k}, DType::kFloat32, "x"), arg(*got, {m, n}, DType::kFloat32, "out"), threads);
  return check_greedy_rows(full, *got, m, n, first);
}

}  // namespace test_support
}  // namespace pagedserve
