#include "backends/cpu/runtime/huge_pages.h"

#include <algorithm>
#include <fstream>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace pagedserve {
namespace cpu {
namespace {

// Chunks are this large unless one allocation needs more (tens of small layers share one).
constexpr size_t kChunkBytes = size_t{32} << 20;
constexpr size_t kAlign = 64;

struct Chunk {
  char* base;
  size_t size;
  size_t used;   // bytes handed out from base (shared chunks only)
  int64_t live;  // allocations not yet freed
  bool shared;   // takes small allocations (else one large one)
};

struct Arena {
  std::mutex mu;
  std::vector<Chunk> chunks;  // the last one takes new small allocations
};

Arena& arena() {
  static Arena* a = new Arena;  // never destroyed: weights may outlive static destruction
  return *a;
}

size_t round_up(size_t v, size_t to) { return (v + to - 1) / to * to; }

Chunk new_chunk(size_t size, bool shared) {
  char* base = static_cast<char*>(::operator new(size, std::align_val_t(kHugePageBytes)));
  advise_huge_pages(base, static_cast<int64_t>(size));
  return Chunk{base, size, 0, 0, shared};
}

void delete_chunk(const Chunk& c) { ::operator delete(c.base, std::align_val_t(kHugePageBytes)); }

}  // namespace

bool huge_pages_available() {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  static const bool available = [] {
    std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
    std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    return !s.empty() && s.find("[never]") == std::string::npos;
  }();
  return available;
#else
  return false;
#endif
}

int64_t advise_huge_pages(void* p, int64_t nbytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (p == nullptr || nbytes <= 0 || !huge_pages_available()) return 0;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t lo = round_up(a, kHugePageBytes), hi = (a + static_cast<uintptr_t>(nbytes)) / kHugePageBytes *
                                                             kHugePageBytes;
  if (hi <= lo) return 0;
  if (madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE) != 0) return 0;
  return static_cast<int64_t>(hi - lo);
#else
  (void)p;
  (void)nbytes;
  return 0;
#endif
}

void* huge_page_alloc(size_t nbytes) {
  if (nbytes == 0) nbytes = 1;
  const size_t size = round_up(nbytes, kAlign);
  Arena& a = arena();
  std::lock_guard<std::mutex> lock(a.mu);
  if (size > kChunkBytes / 2) {  // a chunk of its own, put before the current shared chunk
    Chunk c = new_chunk(round_up(size, kHugePageBytes), false);
    c.live = 1;
    const bool shared_last = !a.chunks.empty() && a.chunks.back().shared;
    a.chunks.insert(shared_last ? a.chunks.end() - 1 : a.chunks.end(), c);
    return c.base;
  }
  if (a.chunks.empty() || !a.chunks.back().shared || a.chunks.back().used + size > kChunkBytes) {
    a.chunks.push_back(new_chunk(kChunkBytes, true));
  }
  Chunk& c = a.chunks.back();
  char* p = c.base + c.used;
  c.used += size;
  ++c.live;
  return p;
}

void huge_page_free(void* p) {
  if (p == nullptr) return;
  Arena& a = arena();
  std::lock_guard<std::mutex> lock(a.mu);
  const char* q = static_cast<const char*>(p);
  auto it = std::find_if(a.chunks.begin(), a.chunks.end(),
                         [&](const Chunk& c) { return q >= c.base && q < c.base + c.size; });
  if (it == a.chunks.end()) return;  // not ours (cannot happen through QuantizedWeight)
  if (--it->live > 0) return;
  if (it + 1 == a.chunks.end() && it->shared) {
    it->used = 0;  // the current shared chunk: reused from its start
    return;
  }
  delete_chunk(*it);
  a.chunks.erase(it);
}

}  // namespace cpu
}  // namespace pagedserve
