// GGUF block-type knowledge for the CPU kernels: each type's block size and
// bytes, the tile format it is repacked into (gemm/kernel_table.h) and the exact
// decoding of a row of blocks into int8 quants with, per 16 elements, a
// float32 scale d and minimum m, w = d * q + m equal bit for bit to gguf-py's
// de-quantised value (ggml's block formats; our own code). QuantizedWeight
// packs that into u5f, u4k or i6f tiles, and runs Q4_0 / Q5_0 on the Q4_1 / Q8_0
// tiles after as_stored_blocks.
#pragma once

#include <cstdint>

#include "backends/cpu/gemm/quant_linear.h"

namespace pagedserve {
namespace cpu {

// Decodes one row of K elements stored as `q` blocks (K a multiple of the
// type's block_elements; q not Q4_1 / Q8_0, which keep their own tiles) into
// qs [K] int8 and, per 16 elements h (K / 16 of them), d [h] and m [h]:
//   Q4_0  q - 8,  d,           m = -0.0     Q5_0  q - 16, d,       m = -0.0
//   Q5_1  q,      d,           m            Q6_K  q - 32, d * sc,  m = -0.0
//   Q4_K / Q5_K   q, d * sc,   m = -(dmin * mn)   (sc, mn: the 6-bit pair)
// Every product above is exact in float32 (at most 11 + 8 significant bits),
// and d * q (at most 23 bits) too, so one rounding of d * q + m equals numpy's
// round(d * q + m) or round(d * q - dm); -0.0 keeps d * q's sign of zero.
void decode_row(QType q, const uint8_t* row, int64_t k, int8_t* qs, float* d, float* m);

// One Q4_K block's scales as stored: the fp16 d and dmin widened, and the
// eight 6-bit scale / minimum pairs of its 32-element sub-blocks (sc[8],
// mn[8], 0..63); its element i of sub-block s is d * sc[s] * q - dmin * mn[s].
void q4_k_scales(const uint8_t* block, float* d, float* dmin, uint8_t* sc, uint8_t* mn);

// Rewrites `blocks` Q4_0 or Q5_0 blocks (src) as blocks of a type with its own
// tiles holding exactly the same values, into dst, and returns that type:
//   Q4_0 d (q - 8)  -> Q4_1 with the same d and m = -8 d (d q + m is exact:
//                      the sum is a representable multiple of d), 20 bytes;
//                      Q8_0 where some -8 d is not a float16 (|d| > 8188);
//   Q5_0 d (q - 16) -> Q8_0 with the same d and q - 16 in [-16, 15], 34 bytes.
// Numerically the same values as gguf-py's (a zero may change sign). dst holds
// blocks * qtype_block_bytes(returned type) bytes (34 per block always suffices).
// Why: their own 5-bit tiles took twice the instructions per weight to expand
// (docs/benchmarks.md, "Behind the code").
QType as_stored_blocks(QType q, const uint8_t* src, int64_t blocks, uint8_t* dst);

}  // namespace cpu
}  // namespace pagedserve
