// Test support for the scheduler tests: requests' stop criteria and prompts.
#pragma once

#include <cstdint>
#include <vector>

#include "core/sequence.h"

namespace pagedserve {
namespace test_support {

constexpr int32_t kEos = 2;

// Stop after max_tokens output tokens or at kEos.
inline StopCriteria stop_after(int32_t max_tokens) {
  StopCriteria s;
  s.max_tokens = max_tokens;
  s.eos_token_ids = {kEos};
  return s;
}

// n prompt tokens: base, base + 1, ... cycling every 50 (never kEos for base > 2).
inline std::vector<int32_t> prompt(int32_t n, int32_t base = 10) {
  std::vector<int32_t> p(n);
  for (int32_t i = 0; i < n; ++i) p[i] = base + i % 50;
  return p;
}

}  // namespace test_support
}  // namespace pagedserve
