// Greedy decoding's output layer without most of its float32 work: the
// logits of a row are needed only where they could be the row's maximum.
//
// A first pass runs the layer with int8 activations (QuantizedWeight::linear,
// about 4x less arithmetic than the float32 pass at a batch of rows). Its
// outputs differ from the exact float32 ones by at most B[r, j] = norm[j] *
// C[r]: norm[j] = |W[j, :]| (QuantizedWeight::row_norms) and C[r] = (|e| +
// (K + c K / 32 + 8) 2^-23 (|x| + |e|)) (1 + 2^-20), c = 2 for Q8_0 tiles and
// 4 for i6f ones (below), e = x~ - x the row's
// int8 rounding error (x~ the de-quantised int8 activations, recomputed here
// with the pass's own quantize_rows): by Cauchy-Schwarz |W[j] . e| <= norm[j]
// |e|, and the float32 roundings of both passes add the second term: a sum of
// n rounded terms is within gamma_n = n u / (1 - n u) (u = 2^-24) of the sum
// of their magnitudes, here at most norm[j] |x| (the exact pass, n = K + 1;
// its scalar variant rounds each product and each sum: within the same
// gamma) and norm[j] |x~| (the int8 pass, n <= c K / 32 + 4: a scale product,
// then a multiply-add or a product and a sum per block, or per 16 elements
// in Q6_K's i6f tiles, a scale each); 2^-23 a term, twice
// u, covers gamma_n while n u <= 1/2 (K up to 2^22; larger K takes the full
// layer). Where values come near underflow, an absolute 2^-100 in the
// comparison covers what subnormal results can lose; where a partial sum could
// come near overflow (norm[j] C 2^23 above 2^120), the full layer. An output
// whose upper bound a + B lies below the largest lower bound a - B of its row
// cannot be the row's maximum in the exact pass; the others (the candidates,
// usually a few of a vocabulary) are computed exactly by linear_f32's own
// kernel (QuantizedWeight::linear_f32_groups, whole 16-row groups). The bound holds
// for every rounding, so the result never depends on how close the logits
// are: an exact tie stays a tie.
//
// The same idea as exact top-k search with bounds (e.g. the threshold
// algorithm, Fagin, Lotem and Naor 2001); this file's bound is our own.
#pragma once
#include <cstdint>

#include "backends/common/tensor_arg.h"
#include "backends/cpu/gemm/kernel_table.h"
#include "backends/cpu/gemm/quant_linear.h"

namespace pagedserve {
namespace cpu {

// Whether greedy_logits can skip work on this weight: Q8_0 or i6f (Q6_K)
// tiles (no minimum term, so the int8 pass's per-term magnitudes are the
// weights') that the integer kernels run. Other weights get linear_f32 in full.
bool prunes_greedy_logits(const QuantizedWeight& w);

// out [M, N] float32 for x [M, K] float32 (both contiguous; no bias): every
// entry is linear_f32(x)'s very value (bit for bit) or -inf, and every entry
// that could be its row's maximum, or equal to it, holds its value; so the
// first maximum's index per row (torch.argmax, numpy argmax) is linear_f32's.
// Falls back to linear_f32 in full (all values) for a single row (M = 1: no
// faster there), K above 2^22, where prunes_greedy_logits is false, where a
// partial sum could overflow (above), where x holds a value that is not finite
// (NaN must win argmax as it does there), where a first-pass value is not
// finite, or where more than a quarter of the row groups are candidates.
// num_threads in [1, 1024]. Throws KernelArgumentError (before writing
// anything).
void greedy_logits(const QuantizedWeight& w, const TensorArg& x, const TensorArg& out, int num_threads);

// The same on raw pointers (checked by the caller) with the given variant's kernels.
void greedy_logits_raw(const QuantizedWeight& w, const float* x, int64_t m, float* out, int num_threads,
                       const QuantKernelTable& kernels);

}  // namespace cpu
}  // namespace pagedserve
