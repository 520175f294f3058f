// The interface between QuantizedWeight (quant_linear.cc, built for the
// baseline ISA) and its kernels, one source per ISA that CMake compiles into
// the GEMM tables: "scalar" (kernels_scalar.cc: plain C++, every
// architecture), "avx2" (kernels_avx2.cc: x86-64-v3, vpmaddubsw + vpmaddwd),
// "avx_vnni" (kernels_avx2.cc again with AVX-VNNI: 256-bit vpdpbusd) and
// "avx512_vnni" (kernels_avx512.cc: x86-64-v4 + AVX512-VNNI, 512-bit
// vpdpbusd). The registry (runtime/isa_registry.h) names the table each ISA
// variant runs with. On AArch64: "neon" and "neon_dotprod" (kernels_neon.cc:
// smull + sadalp, or sdot where the CPU has the dot-product extension).
//
// As in attention/kernel_table.h, only plain structs, constants and function declarations
// live here: an inline function compiled into an AVX-512 object could be chosen
// by the linker for every caller (tests/cpp/check_isa_objects.cmake checks the
// objects define no weak symbols).
//
// Repacked weight layout (shared by every variant, so one QuantizedWeight runs
// under any of them): the N output rows are padded to a multiple of kQRows (16)
// with zero rows and cut into row groups; group g holds, for each 32-wide block
// kb along K (kb = 0 .. K/32-1), one tile of the 16 rows' blocks interleaved so
// lane j of a SIMD register is row 16g + j and each 32-bit lane holds 4
// consecutive k-elements (the operand shape of vpdpbusd):
//   q4_1 tile (320 bytes): uint16 d[16] (fp16), uint16 m[16] (fp16),
//         uint8 qs[4][16][4]: qs[p][j][b] = GGUF qs byte 4p+b of row j, i.e. its
//         low nibble is element 4p+b and its high nibble element 16+4p+b;
//   q8_0 tile (544 bytes): uint16 d[16] (fp16), int8 qs[8][16][4]:
//         qs[c][j][b] = element 4c+b of row j;
//   u5f tile (448 bytes): float d[16], float m[16], uint8 qs[4][16][4]
//         (q4_1's nibble order), uint32 qh[16] (bit e of row j's word: bit 4
//         of element e). Element e of row j is d * v + m, v = its nibble | its
//         qh bit << 4 (0..31);
//   u4k tile (288 bytes): uint8 sc[16], uint8 mn[16] (row j's 6-bit scale
//         and minimum of the block, Q4_K's), then uint8 qs[4][16][4] (q4_1's
//         nibble order). After all the tiles, per row group g and 256-element
//         super-block s of K, float d[16] and float nm[16] (row j's fp16 d and
//         -dmin widened): 128 bytes at u4k_super(w, n, k, g, 8 s). Element
//         e of row j is (d sc) q + (nm mn), q its nibble (0..15), both
//         products exact: 0.59 bytes a weight, against the 0.5625 of the Q4_K
//         blocks (until 2026-12-07 u4f: the products as float32, 0.75);
//   i6f tile (512 bytes): float d[2][16], then q4_1's nibble order uint8
//         qs[4][16][4] (the low 4 bits of v), then uint8 qh[2][16][4]: byte
//         qh[s][j][b] holds the 2 high bits of v for elements 4p+b (bits
//         4(p-2s) .. +1) and 16+4p+b (bits 4(p-2s)+2 .. +3) of row j, p = 2s and
//         2s+1. v is 0..63 and element e of row j is d[e / 16][j] * (v - 32)
//         (no minimum: Q6_K has none). 1.0 bytes a weight, against the 0.82 of
//         the Q6_K blocks (whose scales are 8-bit factors of one fp16 d);
//   f32 tile (2048 bytes): float w[32][16]: w[e][j] = element e of row j;
//   f16 / bf16 tile (1024 bytes): uint16 w[32][16], the same order, IEEE
//         half / bfloat16 bits (widened to float32 exactly). These dense tiles
//         hold unquantised weights (GGUF F32 / F16 / BF16 tensors, or a float
//         checkpoint's own weights) for gemm_f32 only: no scales, no integer kernel.
// The other GGUF block types are repacked exactly (gguf_types.h): Q4_0 (q - 8)
// into q4_1 (m = -8 d; q8_0 where that is no float16) and Q5_0 (q - 16) into
// q8_0, Q4_K into u4k, Q5_1 and Q5_K into u5f, Q6_K (q - 32,
// a scale per 16 elements) into i6f; their scales as the float32 products
// gguf-py computes (Q4_K / Q5_K d * sc and -(dmin * m), Q6_K d * sc; gguf-py's
// minimum for Q6_K is -0.0, so its d * q + m is d * q bit for bit).
// Tiles are stored group-major: tile(g, kb) at ((g * K/32) + kb) * tile_bytes.
#pragma once

#include <cstdint>

#include "backends/common/dtype.h"

namespace pagedserve {
namespace cpu {

constexpr int kQBlock = 32;        // elements per GGUF block (and per activation group)
constexpr int kQRows = 16;         // output rows per interleaved row group
constexpr int kQ41TileBytes = 320; // 16 rows x (fp16 d + fp16 m + 16 nibble bytes)
constexpr int kQ80TileBytes = 544; // 16 rows x (fp16 d + 32 int8)
constexpr int kI6FTileBytes = 512; // 16 rows x (2 float d + 16 nibble bytes + 8 bytes of 2-bit fields)
constexpr int k5FTileBytes = 448;  // 16 rows x (float d + float m + 16 nibble bytes + uint32 high bits)
constexpr int kU4KTileBytes = 288; // 16 rows x (6-bit scale and minimum as bytes + 16 nibble bytes)
constexpr int kU4KNibbles = 32;    // byte offset of an u4k tile's nibbles
constexpr int kU4KSuperBytes = 128; // a row group's super-block scales: float d[16], nm[16]
constexpr int kI6FNibbles = 128;   // byte offsets in an i6f tile: the nibbles, then the 2-bit fields
constexpr int kI6FHigh = 384;
constexpr int k5FNibbles = 128;    // byte offsets in an u5f tile: the nibbles, then the high bits
constexpr int k5FHigh = 384;
constexpr int kF32TileBytes = 2048; // 16 rows x 32 float
constexpr int kF16TileBytes = 1024; // 16 rows x 32 half or bfloat16 (f16 and bf16 tiles)

// The tile formats the kernels read (above). q4_1 and q8_0 hold those GGUF
// types' blocks as stored (and Q4_0's, Q5_0's rewritten); u4k, u5f and i6f hold
// the other quantised types; f32, f16 and bf16 unquantised weights (gemm_f32 only).
enum class TileFormat { kQ4_1, kQ8_0, kU5F, kU4K, kI6F, kF32, kF16, kBF16 };

// These have internal linkage (an unnamed namespace), so even a run-time
// call from a per-ISA kernel object emits no weak symbol another object's
// caller could bind to.
namespace {

// Bytes of one tile of format f (the layouts above).
constexpr int tile_bytes(TileFormat f) {
  return f == TileFormat::kQ4_1 ? kQ41TileBytes : f == TileFormat::kQ8_0 ? kQ80TileBytes
         : f == TileFormat::kI6F ? kI6FTileBytes : f == TileFormat::kU4K ? kU4KTileBytes
         : f == TileFormat::kU5F ? k5FTileBytes : f == TileFormat::kF32 ? kF32TileBytes : kF16TileBytes;
}

// Whether f is a dense format (f32, f16, bf16): unquantised values, element e
// of row j at 16 e + j, no scales; gemm_f32 only.
constexpr bool dense_format(TileFormat f) {
  return f == TileFormat::kF32 || f == TileFormat::kF16 || f == TileFormat::kBF16;
}

// The super-block scales (float d[16], then nm[16]) of row group g at 32-block b in the u4k weight at w ([n, k]:
// the tiles of every group, then these, K / 256 per group).
inline const float* u4k_super(const uint8_t* w, int64_t n, int64_t k, int64_t g, int64_t b) {
  const int64_t groups = (n + kQRows - 1) / kQRows, nb = k / kQBlock;
  return reinterpret_cast<const float*>(w + groups * nb * kU4KTileBytes + (g * (nb / 8) + b / 8) * kU4KSuperBytes);
}

// Row j's (0..15) scale d = (d sc) and minimum m = (nm mn) of 32-block b of row group g in the u4k weight at w
// ([n, k]): both products exact (the layout above).
inline void u4k_scales(const uint8_t* w, int64_t n, int64_t k, int64_t g, int64_t b, int j, float* d, float* m) {
  const uint8_t* t = w + (g * (k / kQBlock) + b) * kU4KTileBytes;
  const float* super = u4k_super(w, n, k, g, b);
  *d = super[j] * static_cast<float>(t[j]);
  *m = super[kQRows + j] * static_cast<float>(t[kQRows + j]);
}

// The quant (v - 32, in -32 .. 31) of element e (0..31) of row j (0..15) in the i6f tile at t (the layout above).
inline int i6f_quant(const uint8_t* t, int j, int e) {
  const int p = (e & 15) >> 2, half = e >> 4, at = 4 * j + (e & 3);
  const int nibble = (t[kI6FNibbles + 64 * p + at] >> (4 * half)) & 0x0F;
  const int high = (t[kI6FHigh + 64 * (p >> 1) + at] >> (4 * (p & 1) + 2 * half)) & 0x03;
  return (nibble | high << 4) - 32;
}

}  // namespace

// Activations quantised per row in groups of 32 (llama.cpp's Q8_1 idea), stored
// group-major so that a pass over consecutive rows reads one contiguous run per
// group (one pointer, fixed offsets): for row r (0 .. M-1) and group b
// (0 .. K/32-1), xq[(b * M + r) * 32 + e] (e < 32) are the int8 quants in
// [-127, 127], and at index b * M + r: xd = amax / 127 (the scale), xs = xd *
// sum(the group's xq) (float) and xsum128 = -128 * that sum (int32: the start
// value of the Q8_0 VNNI sums, which multiply q + 128; a broadcast load).
struct QuantActivations {
  const int8_t* xq;        // [K/32, M, 32]
  const float* xd;         // [K/32, M]
  const int32_t* xsum128;  // [K/32, M]
  const float* xs;         // [K/32, M]
};

// One GEMM call: out [M, N] (row stride N, dtype float32 or bfloat16) =
// x . W^T (+ bias [N] float32, or nullptr).
struct QuantGemmArgs {
  TileFormat format;  // any quantised one (never f32 / f16 / bf16: QuantizedWeight checks)
  const uint8_t* w;  // repacked tiles (layout above)
  int64_t n, k;      // real N (unpadded) and K
  int64_t m;
  QuantActivations x;
  const float* bias;
  void* out;
  DType out_dtype;
};

// Activation rows per row tile of the exact float32 GEMM (gemm_f32): a tile
// broadcasts x[r, k] of its rows straight from x (row-major, not copied).
constexpr int kF32Rows = 12;

// One gemm_f32 call: out [M, N] float32 (row stride ldo) = x . W^T (+ bias [N]
// float32, or nullptr), W the exactly dequantised weights (gguf-py's float32
// values: Q4_1 d * q + m, Q8_0 d * q, u5f d * q + m, u4k (d sc) q + nm mn, i6f d * (v - 32); f32 / f16 /
// bf16 the stored values widened), accumulated in float32 along k in
// order (one fused multiply-add per k, the SIMD variants; the scalar one rounds
// the product and the sum separately).
struct QuantF32GemmArgs {
  TileFormat format;
  const uint8_t* w;  // repacked tiles (layout above)
  int64_t n, k;      // real N (unpadded) and K
  int64_t m;
  const float* x;    // [M, K] float32, row-major (row stride K)
  const float* bias;
  float* out;
  int64_t ldo;       // out's row stride (>= N: a column slice of a wider output)
};

// One variant of the quantized kernels.
struct QuantKernelTable {
  const char* name;  // "scalar", "avx2", "avx_vnni", "avx512_vnni", "neon", "neon_dotprod"
  // Quantises rows [r0, r1) of x [M, K] (float32 or bfloat16, contiguous) into
  // xq / xd / xsum128 / xs (QuantActivations' layout for M rows), rows r0..r1 written.
  // Bit-identical in every variant: the scalar one is plain C++ (built with
  // -ffp-contract=off), the SIMD ones do the same IEEE steps lane-wise.
  void (*quantize_rows)(const void* x, DType dtype, int64_t k, int64_t m, int64_t r0, int64_t r1, int8_t* xq,
                        float* xd, int32_t* xsum128, float* xs);
  // Computes out rows [m0, m1) x row groups [g0, g1) (columns 16*g0 ..
  // min(N, 16*g1)).
  void (*gemm)(const QuantGemmArgs& a, int64_t g0, int64_t g1, int64_t m0, int64_t m1);
  // Computes out rows [m0, m1) (m0 a multiple of kF32Rows) x row groups
  // [g0, g1) of gemm_f32. scratch: 64-byte aligned room for K * 48 floats
  // (the expanded weights of up to three row groups, reused by every row tile
  // when [m0, m1) spans more than one). A row's result does not depend on m0, m1,
  // g0, g1 or the thread.
  void (*gemm_f32)(const QuantF32GemmArgs& a, int64_t g0, int64_t g1, int64_t m0, int64_t m1, float* scratch);
  // The roofline's compute peaks (bench/roofline.py), on the calling thread:
  // `iters` rounds of independent register-resident chains of the variant's
  // widest float32 fused multiply-add (kind kPeakFma; the scalar variant a
  // multiply then an add) or of its u8 x s8 multiply-accumulate as the integer
  // kernels issue it (kind kPeakInt8Dot: vpdpbusd, or vpmaddubsw + vpmaddwd +
  // vpaddd on AVX2; sdot, or smull + sadalp (s8 x s8) on NEON; int32 += int8 *
  // int8 in the scalar one), enough chains to
  // cover the instruction's latency. Returns the operations done (2 per
  // multiply-add lane, as GFLOP/s and GOP/s count them).
  double (*peak_ops)(int kind, int64_t iters);
};

// peak_ops' kinds.
constexpr int kPeakFma = 0;
constexpr int kPeakInt8Dot = 1;

// One getter per compiled table (defined in kernels_*.cc under PAGEDSERVE_GEMM_ISA).
const QuantKernelTable& quant_kernel_table_scalar();
const QuantKernelTable& quant_kernel_table_avx2();
const QuantKernelTable& quant_kernel_table_avx_vnni();
const QuantKernelTable& quant_kernel_table_avx512_vnni();
const QuantKernelTable& quant_kernel_table_neon();
const QuantKernelTable& quant_kernel_table_neon_dotprod();

}  // namespace cpu
}  // namespace pagedserve
