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

}  // namespace test_support
}  // namespace pagedserve
