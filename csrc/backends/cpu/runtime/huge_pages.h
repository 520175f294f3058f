// Memory for the data a decode step streams through every step (the weight
// tiles of the quantised and gguf paths, the paged KV store), backed by
// transparent huge pages where the OS offers them.
//
// Why: a decode step touches tens of MB of weights and KV blocks spread over
// thousands of 4 KiB pages, more than the TLB holds, and in a virtual machine
// each TLB miss walks two page tables. Backing the same bytes with 2 MiB pages
// (Linux madvise(MADV_HUGEPAGE), honoured when
// /sys/kernel/mm/transparent_hugepage/enabled is "always" or "madvise") takes
// those walks away (docs/benchmarks.md, "Behind the code").
// Elsewhere (other OSes, THP "never") the memory is ordinary.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pagedserve {
namespace cpu {

// Bytes of one huge page (x86-64 and arm64 Linux with 4 KiB base pages).
constexpr size_t kHugePageBytes = size_t{2} << 20;

// nbytes (> 0) of 64-byte aligned, uninitialised memory from a process-wide
// arena of kHugePageBytes-aligned chunks advised for huge pages (small
// allocations share a chunk; a chunk is released when its last allocation
// is). Thread-safe. Throws std::bad_alloc.
void* huge_page_alloc(size_t nbytes);

// Releases memory from huge_page_alloc (nullptr: nothing).
void huge_page_free(void* p);

// Asks the OS to back the whole huge pages inside [p, p + nbytes) with huge
// pages (on first touch: call it before writing). Returns the bytes advised
// (0 where the OS has no such advice or refuses it).
int64_t advise_huge_pages(void* p, int64_t nbytes);

// Whether advise_huge_pages can do anything here (Linux with THP not "never").
bool huge_pages_available();

}  // namespace cpu
}  // namespace pagedserve
