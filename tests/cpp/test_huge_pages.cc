// The huge-page arena (csrc/backends/cpu/runtime/huge_pages.h): what it hands out is
// aligned, disjoint and writable whatever the sizes and the order of frees;
// chunks are reused or released as their allocations go.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "backends/cpu/runtime/huge_pages.h"

namespace pagedserve {
namespace cpu {
namespace {

struct Block {
  uint8_t* p;
  size_t n;
  uint8_t fill;
};

TEST(HugePages, AllocationsAreAlignedDisjointAndKeepTheirBytes) {
  std::mt19937 rng(7);
  // small layers share chunks; some allocations exceed half a chunk (their own chunk)
  std::vector<size_t> sizes = {1, 63, 64, 4096, 200000, size_t{17} << 20, 331, size_t{40} << 20, 1 << 20};
  for (int i = 0; i < 60; ++i) sizes.push_back(1 + rng() % (3 << 20));
  std::vector<Block> live;
  for (size_t i = 0; i < sizes.size(); ++i) {
    auto* p = static_cast<uint8_t*>(huge_page_alloc(sizes[i]));
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
    const auto fill = static_cast<uint8_t>(i * 37 + 1);
    std::memset(p, fill, sizes[i]);
    live.push_back({p, sizes[i], fill});
    if (i % 3 == 2) {  // free one at random: its neighbours must keep their bytes
      const size_t j = rng() % live.size();
      huge_page_free(live[j].p);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(j));
    }
  }
  for (const Block& b : live) {
    for (size_t k = 0; k < b.n; k += 997) ASSERT_EQ(b.p[k], b.fill);
    ASSERT_EQ(b.p[b.n - 1], b.fill);
  }
  for (const Block& b : live) huge_page_free(b.p);
  huge_page_free(nullptr);
}

TEST(HugePages, AdviceNeverChangesContentsAndCoversWholePagesOnly) {
  std::vector<uint8_t> v(3 * kHugePageBytes + 12345, 0x5a);
  const int64_t advised = advise_huge_pages(v.data(), static_cast<int64_t>(v.size()));
  EXPECT_GE(advised, 0);
  EXPECT_LE(advised, static_cast<int64_t>(v.size()));
  EXPECT_EQ(advised % static_cast<int64_t>(kHugePageBytes), 0);
  if (huge_pages_available()) EXPECT_GE(advised, static_cast<int64_t>(2 * kHugePageBytes));
  for (size_t k = 0; k < v.size(); k += 4093) ASSERT_EQ(v[k], 0x5a);
  EXPECT_EQ(advise_huge_pages(nullptr, 1 << 30), 0);
  EXPECT_EQ(advise_huge_pages(v.data(), 0), 0);
  EXPECT_EQ(advise_huge_pages(v.data(), 100), 0);  // no whole huge page inside
}

}  // namespace
}  // namespace cpu
}  // namespace pagedserve
