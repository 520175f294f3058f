// The interface between the CPU backend's dispatcher (attention_cpu.cc,
// built for the baseline ISA) and its kernel translation unit (kernels.cc),
// which CMake compiles once per instruction set: baseline (SSE2), AVX2+FMA
// (x86-64-v3) and AVX-512 (x86-64-v4) on x86-64, NEON (the arm64 baseline),
// plain C++ elsewhere ("baseline"), plus -march=native when the
// opt-in PAGEDSERVE_NATIVE_ARCH option is on. The registry
// (runtime/isa_registry.h) picks one at run time from the CPU's features.
//
// Only plain structs and function declarations live here: an inline function
// compiled into an AVX-512 object could be chosen by the linker for every
// caller and crash an older CPU (tests/cpp check the kernel objects define no
// weak symbols).
#pragma once

#include <cstdint>

#include "backends/common/dtype.h"

namespace pagedserve {
namespace cpu {

constexpr int kQueryChunk = 16;         // query tokens per work item
constexpr int kMinBlocksPerSplit = 16;  // KV blocks a decode split covers at least
constexpr int kTileKeys = 32;           // keys a tile step of attention/kernels.cc covers at most (two blocks of 16)

// One unit of work: sequence b's query tokens [q0, q1) (relative to the
// sequence's first query token) for the query heads [g0, g1) of KV head hk's
// group, over its KV blocks [j0, j1). split >= 0 marks a partial result (a
// split-KV decode, always the whole group) that merge_splits combines.
struct WorkItem {
  int32_t b, hk, q0, q1, j0, j1, split, g0, g1;
};

struct Partial {  // online-softmax state of one row, for split merging
  float m, l;
};

// Everything a kernel reads, as raw pointers (validated by the dispatcher).
// Caches: k_cache [num_blocks, Hkv, D, block_size] (keys transposed per block),
// v_cache [num_blocks, Hkv, block_size, D]; query/out [T, H, D] with the given
// strides (elements); metadata int32.
struct KernelArgs {
  DType dtype;  // kFloat32 or kBFloat16 (query, out and caches alike)
  const void* query;
  int64_t query_stride_token, query_stride_head;
  void* out;
  int64_t out_stride_token, out_stride_head;
  const void* k_cache;
  const void* v_cache;
  const int32_t* query_start_loc;
  const int32_t* seq_lens;
  const int32_t* block_tables;
  int64_t num_kv_heads, group, head_dim, block_size, max_blocks;
  float scale;
  bool causal;
  // 0: none. Else a query at position q sees keys at positions > q - sliding_window
  // (transformers' sliding-window mask; Mistral, Gemma 2/3).
  int64_t sliding_window;
  // 0: none. Else each scaled score s becomes softcap * tanh(s / softcap) (Gemma 2).
  float softcap;
};

// Scratch floats one worker needs for run_item/merge_splits.
int64_t kernel_scratch_floats(int64_t group, int64_t head_dim, int64_t block_size);

// One ISA variant of the kernels.
struct KernelTable {
  const char* isa;
  // Runs one work item; partial_acc [G*q_len, D] / partial_ml receive a split
  // item's unnormalised state (both nullptr for a whole item, written to out).
  // next: the item the caller runs next on this thread, or nullptr; its first
  // KV blocks are prefetched while this item's last ones are computed.
  void (*run_item)(const KernelArgs& args, const WorkItem& item, const WorkItem* next, float* scratch,
                   float* partial_acc, Partial* partial_ml);
  // Merges `splits` partial states of decode row group (b, hk) into out.
  void (*merge_splits)(const KernelArgs& args, int32_t b, int32_t hk, int32_t splits, const float* partial_acc,
                       const Partial* partial_ml, float* scratch);
};

// One getter per compiled variant (defined in kernels.cc under PAGEDSERVE_ISA).
const KernelTable& kernel_table_baseline();
const KernelTable& kernel_table_avx2();
const KernelTable& kernel_table_avx512();
const KernelTable& kernel_table_neon();
const KernelTable& kernel_table_native();

}  // namespace cpu
}  // namespace pagedserve
