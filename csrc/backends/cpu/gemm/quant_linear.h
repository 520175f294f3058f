// Native linear layers for GGUF-quantised weights on the CPU. Every common
// GGUF block type is read (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K):
// linear_f32 computes with its exact float32 values for all of them; the
// integer path (linear) runs Q4_1 and Q8_0 (the default SmolLM2 GGUF: Q4_1
// projections, a Q8_0 tied embedding / lm_head) the way llama.cpp runs them (our own code, not theirs): the
// weights stay in their blocks, the activations are quantised per row in
// groups of 32 to int8 (a scale and the group's sum per group, llama.cpp's Q8_1
// idea), and the block dot products are integer SIMD: AVX512-VNNI / AVX-VNNI
// vpdpbusd, AVX2 vpmaddubsw + vpmaddwd, plain C++ elsewhere. linear_f32 is the
// lossless alternative: float32 activations times the weights expanded in
// registers to their exact float32 values (AVX-512 / AVX2 FMA, plain C++).
//
// The kernels run with the GEMM table of the CPU backend's active ISA variant
// (runtime/isa_registry.h: the best this build has and this CPU executes, or
// PAGEDSERVE_CPU_ISA's), one file per ISA (gemm/kernels_*.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backends/common/tensor_arg.h"
#include "backends/cpu/gemm/kernel_table.h"

namespace pagedserve {
namespace cpu {

// The checks of a linear call (x's dtype is checked by the caller): x [M, k]
// and out [M, n] of x's dtype, both 2-d and contiguous, out not overlapping;
// bias float32 [n] contiguous or null; num_threads in [1, 1024]. Returns M.
// Throws KernelArgumentError.
int64_t check_linear_args(const TensorArg& x, const TensorArg& out, const TensorArg* bias, int num_threads,
                          int64_t n, int64_t k);

// The GGUF block types a QuantizedWeight reads (ggml's formats, as gguf-py
// de-quantises them).
// F32, F16 and BF16 are GGUF's unquantised types (or a float checkpoint's own
// weights): linear_f32, dequantize and embedding read them; linear does not.
enum class QType { kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ8_0, kQ4_K, kQ5_K, kQ6_K, kF32, kF16, kBF16 };

// "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "f32",
// "f16", "bf16" (either case) -> the type; anything else throws KernelArgumentError.
QType parse_qtype(const std::string& name);
const char* qtype_name(QType q);  // "q4_1", "q6_k", ...
// Bytes of one GGUF block: 18 (Q4_0), 20 (Q4_1), 22 (Q5_0), 24 (Q5_1), 34
// (Q8_0), 144 (Q4_K), 176 (Q5_K), 210 (Q6_K); for the unquantised types a
// "block" is 32 consecutive elements: 128 (F32), 64 (F16, BF16).
int64_t qtype_block_bytes(QType q);
// Elements of one GGUF block: 32, or 256 for the K-quants (Q4_K, Q5_K, Q6_K).
int64_t qtype_block_elements(QType q);
// The tile format a type is repacked into (gemm/kernel_table.h): Q4_1 and Q8_0 their
// own; Q4_0 Q4_1's (Q8_0's where some -8 d is no float16: QuantizedWeight
// decides per weight) and Q5_0 Q8_0's (gguf_types.h: as_stored_blocks); Q4_K
// u4k; Q5_1 and Q5_K u5f; Q6_K i6f; F32, F16, BF16 their own dense tiles.
TileFormat tile_format_of(QType q);

// A GGUF-quantized weight matrix W [N out, K in], repacked once into the
// interleaved 16-row tiles of gemm/kernel_table.h (aligned memory it owns; the raw
// bytes are not kept). Q4_1 and Q8_0 keep their blocks' bytes; Q4_0 and Q5_0
// are rewritten as Q4_1 (0.625 bytes per weight) and Q8_0 (1.0625) blocks of
// the same values; the other types become u4k (Q4_K, 0.59 bytes per weight),
// u5f (Q5_1, Q5_K: 0.875) or i6f (Q6_K: 1.0) tiles of exactly the same values;
// F32 / F16 / BF16 rows (4 / 2 / 2 bytes per weight) are reordered into dense
// tiles as they are.
class QuantizedWeight {
 public:
  // raw: uint8 [N, K / block_elements * block_bytes], contiguous: each row's
  // GGUF blocks along K (what gguf.GGUFReader gives for a tensor of shape
  // [N, K]; for F32 / F16 / BF16 the row-major matrix's bytes). qtype one of
  // parse_qtype's names; K a positive multiple of the type's block_elements
  // (32, K-quants 256); N >= 1.
  // Throws KernelArgumentError for a wrong dtype, shape, layout or qtype.
  QuantizedWeight(const TensorArg& raw, const std::string& qtype, int64_t out_features, int64_t in_features);
  // The same from a pointer to N * K / block_elements * block_bytes bytes (no checks on the memory itself).
  QuantizedWeight(const uint8_t* raw, QType qtype, int64_t out_features, int64_t in_features);
  ~QuantizedWeight();
  QuantizedWeight(const QuantizedWeight&) = delete;
  QuantizedWeight& operator=(const QuantizedWeight&) = delete;

  QType qtype() const { return qtype_; }
  TileFormat tile_format() const { return format_; }
  int64_t out_features() const { return n_; }  // N
  int64_t in_features() const { return k_; }   // K
  // Bytes of weight storage held (the repacked tiles, N padded to a multiple of 16, and u4k's super-block scales).
  int64_t nbytes() const { return nbytes_; }
  // Whether linear (int8 activations) runs this weight: every quantised type,
  // never F32 / F16 / BF16.
  bool integer_kernels() const { return integer_ok_; }

  // out [N, K] = the dequantised weights. float32: bit-identical to gguf-py's
  // numpy dequantisation (Q4_1 d * q + m, Q8_0 d * q, Q4_K d * sc * q - dmin
  // * m, ...: the multiply and the add rounded separately, this file is built
  // with -ffp-contract=off); bfloat16:
  // those values rounded to nearest even. Rows are split over num_threads
  // (1 .. 1024) threads of the shared pool. Throws KernelArgumentError.
  void dequantize(const TensorArg& out, int num_threads = 1) const;

  // out [T, K] float32 contiguous: row i = dequantize's float32 row ids[i]
  // (ids [T] int64 contiguous, each in [0, N), checked before anything is
  // written): an embedding lookup on the blocks (a tied embedding / output
  // layer kept once). Throws KernelArgumentError.
  void embedding(const TensorArg& ids, const TensorArg& out) const;

  // out [M, N] = x [M, K] . W^T (+ bias [N]), x and out float32 or bfloat16
  // (the same dtype), contiguous; bias float32 [N] contiguous or nullptr.
  // x is quantised per row and 32-group to int8 (d = amax / 127, q =
  // round-half-even(x / d), all zero for an all-zero group), then the integer
  // block dots of the active variant, accumulated in float32 across blocks.
  // The work is split over N (row groups of 16) and, for large M, over M, on
  // num_threads (1 .. 1024) threads of the shared pool (thread_pool.h); small
  // problems run on the calling thread. M may be 0 (nothing happens).
  // Every type integer_kernels() is true for (the others throw). Throws
  // KernelArgumentError (before writing anything).
  void linear(const TensorArg& x, const TensorArg& out, const TensorArg* bias, int num_threads) const;

  // out [M, N] = x [M, K] . W^T (+ bias [N]) in float32 with the exactly
  // dequantised weights (dequantize's float32 values, expanded in registers
  // from the tiles): a lossless float32 linear layer for weights whose float32
  // values are these (the default model's). x and out float32, or both
  // bfloat16 (x widened exactly, each float32 result rounded once to
  // nearest even: torch's x.float() @ W.T then .bfloat16()), contiguous;
  // bias float32 [N] contiguous or nullptr. x is not quantised; per output the
  // sum over k runs in order, one float32 fused multiply-add per k (the scalar
  // variant rounds the product and the sum separately), + bias last, so the
  // result does not depend on num_threads or on the other rows of x. The work
  // is split over N (pairs of row groups) and, for large M, over M, on
  // num_threads (1 .. 1024) threads of the shared pool; small problems run on
  // the calling thread. M may be 0 (nothing happens). Throws
  // KernelArgumentError (before writing anything).
  void linear_f32(const TensorArg& x, const TensorArg& out, const TensorArg* bias, int num_threads) const;

  // linear_f32 of several weights side by side (linear_f32 itself: one), in one dispatch to the pool:
  // out [m, sum N_i] (row stride ldo >= sum N_i) = x [m, K] . [W_0; W_1;
  // ...]^T (+ bias [sum N_i], or nullptr), part i into its columns. The parts
  // share K and may be of any types; each output is the very value the part's
  // own linear_f32 gives (the same kernel per row group). Raw pointers,
  // checked by the caller.
  static void linear_f32_parts(const std::vector<const QuantizedWeight*>& parts, const float* x, int64_t m,
                               float* out, int64_t ldo, const float* bias, int num_threads,
                               const QuantKernelTable& kernels);

  // linear_f32's values at chosen places: for each item i of items (r * G + g,
  // G = ceil(N / 16) row groups), out[r, 16 g .. min(16 g + 16, N)) = those
  // entries of linear_f32(x) (no bias), computed by the same kernel per row
  // group, so bit-identical; the other entries of out are not touched. x [m,
  // K] and out [m, N] float32 contiguous. Raw pointers, checked by the caller;
  // throws KernelArgumentError for num_threads outside [1, 1024].
  void linear_f32_groups(const float* x, int64_t m, float* out, const std::vector<int64_t>& items, int num_threads,
                         const QuantKernelTable& kernels) const;

  // [N] float32: the Euclidean norm sqrt(sum_k W[j, k]^2) of each output row j
  // of the dequantised weights (a double sum, rounded up to float32: never
  // below the exact norm), computed on the first call (on num_threads threads;
  // thread-safe); nullptr where some weight is not finite (a float16 scale of
  // inf or NaN). By Cauchy-Schwarz a change e of x moves output j by at most
  // norm_j * |e| (greedy_logits.h). Throws KernelArgumentError for num_threads
  // outside [1, 1024].
  const float* row_norms(int num_threads) const;

  // The same on raw pointers (checked by the caller): x [m, K], out [m, N] of
  // dtype `dtype`, bias [N] or nullptr, with the given variant's kernels.
  // Throws KernelArgumentError where integer_kernels() is false.
  void linear_raw(const void* x, DType dtype, int64_t m, void* out, const float* bias, int num_threads,
                  const QuantKernelTable& kernels) const;

 private:
  struct Free {
    void operator()(uint8_t* p) const;
  };
  // dst [K] = row `row` de-quantised to float32 (gguf-py's values, bit for bit).
  void dequantize_row(int64_t row, float* dst) const;
  // gemm_f32's arguments for this weight: x [m, K] float32, out [m, N] of row stride ldo, bias [N] or nullptr.
  QuantF32GemmArgs f32_args(const float* x, int64_t m, float* out, int64_t ldo, const float* bias) const;
  // Fills the u5f / u4k / i6f tiles from raw rows of a type gguf_types.cc decodes.
  void repack_decoded(const uint8_t* raw);
  // Fills the f32 / f16 / bf16 tiles from the raw row-major matrix.
  void repack_dense(const uint8_t* raw);
  QType qtype_;
  TileFormat format_;
  int64_t n_, k_, nbytes_;
  bool integer_ok_ = true;  // integer_kernels()
  mutable std::once_flag norms_once_;  // row_norms(), computed once
  mutable std::vector<float> norms_;
  mutable bool norms_finite_ = false;
  std::unique_ptr<uint8_t, Free> tiles_;
};

}  // namespace cpu
}  // namespace pagedserve
