// Fused elementwise CPU ops of a Llama decoder layer, under vLLM's op names
// (vllm/_custom_ops.py: rms_norm, fused_add_rms_norm, silu_and_mul,
// rotary_embedding), on raw CPU buffers (TensorArg), in float32 or bfloat16.
//
// Numerics: each op reproduces the eager PyTorch / Hugging Face transformers
// expression it replaces, rounding to the tensor's dtype at the same points
// (every value is computed in float32; a bfloat16 result is rounded once per
// torch op, round to nearest even). In float32 the results equal torch's up to
// the order of the mean-of-squares summation and exp's last bit (silu); in
// bfloat16 a value differs, if at all, by one bfloat16 ulp where such a float32
// difference crosses a rounding boundary.
//
// Threading: the rows are split over ThreadPool::get(num_threads) (shared with
// the attention backend: pass the same num_threads, usually
// torch.get_num_threads(), or the process-wide pool is rebuilt) only when each
// of at least two threads gets >= kFusedMinElemsPerTask elements while the
// pool's workers poll (ThreadPool::set_spin_micros > 0), or >=
// kFusedMinElemsPerTaskAsleep while they sleep (waking one costs more than a
// decode step's work: docs/benchmarks.md, "Behind the code"); fewer rows (a decode step)
// run on the calling thread with no hand-off.
//
// Every function validates all arguments (and, for rotary_embedding, every
// position) before it writes anything, and throws KernelArgumentError naming
// the offending tensor; no input can make it read or write out of bounds.
// The kernels are compiled per ISA variant (ops/kernel_table.h); the active
// variant is runtime/isa_registry.h's active_isa().
#pragma once

#include <algorithm>
#include <cstdint>

#include "backends/common/tensor_arg.h"
#include "backends/cpu/runtime/thread_pool.h"

namespace pagedserve {
namespace cpu {

constexpr int64_t kFusedMinElemsPerTask = 32768;  // elements a thread must get before the ops go parallel
constexpr int64_t kFusedMinElemsPerTaskAsleep = 131072;  // the same while the pool's workers sleep

// Runs fn(r0, r1) over [0, rows): inline when the rows hold too few elements
// for two tasks of kFusedMinElemsPerTask (kFusedMinElemsPerTaskAsleep while
// the pool's workers sleep: waking them costs more), no thread hand-off; else
// in chunks on the pool.
template <typename F>
inline void for_rows(int64_t rows, int64_t elems_per_row, int num_threads, const F& fn) {
  if (rows <= 0) return;
  const int64_t per_row = std::max<int64_t>(elems_per_row, 1);
  const int64_t min_elems = ThreadPool::spin_micros() > 0 ? kFusedMinElemsPerTask : kFusedMinElemsPerTaskAsleep;
  const int64_t rows_per_task = std::max<int64_t>(1, (min_elems + per_row - 1) / per_row);
  int64_t tasks = (rows + rows_per_task - 1) / rows_per_task;
  if (num_threads <= 1 || tasks < 2) {
    fn(int64_t{0}, rows);
    return;
  }
  tasks = std::min<int64_t>(tasks, 4 * static_cast<int64_t>(num_threads));  // dynamic scheduling evens them out
  const int64_t chunk = (rows + tasks - 1) / tasks;
  tasks = (rows + chunk - 1) / chunk;
  ThreadPool::get(num_threads)->run(tasks,
                                    [&](int64_t task, int) { fn(task * chunk, std::min(rows, (task + 1) * chunk)); });
}

// RMSNorm (Zhang & Sennrich 2019) with Hugging Face LlamaRMSNorm's semantics:
//   out = weight * to_dtype(x * rsqrt(mean(x^2, -1) + eps))
// with x^2, the mean and the normalisation in float32 and the product with the
// weight in the tensor dtype (rounded once). vLLM's `rms_norm(out, input, weight, eps)`.
// out, x: [T, H] float32 or bfloat16 (same dtype), last dimension contiguous,
// any row stride (out's rows must not overlap); out may be x itself (in place)
// but must not otherwise overlap it. weight: [H], same dtype, contiguous.
// eps: finite, >= 0. num_threads in [1, kMaxThreads]. T = 0 or H = 0: nothing happens.
// Throws KernelArgumentError.
void rms_norm(const TensorArg& out, const TensorArg& x, const TensorArg& weight, float eps, int num_threads = 1);

// vLLM's `fused_add_rms_norm(input, residual, weight, eps)`, both in place:
//   residual = to_dtype(x + residual)      (HF: hidden_states = residual + hidden_states)
//   x        = rms_norm(residual)          (as rms_norm above)
// x, residual: [T, H], same dtype (float32 or bfloat16), last dimension
// contiguous, rows not overlapping, x and residual disjoint. weight, eps,
// num_threads: as rms_norm. Throws KernelArgumentError.
void fused_add_rms_norm(const TensorArg& x, const TensorArg& residual, const TensorArg& weight, float eps,
                        int num_threads = 1);

// vLLM's `silu_and_mul(out, x)`, the SwiGLU gate (Shazeer 2020) of Llama's MLP:
//   out = to_dtype(to_dtype(silu(x[:, :I])) * x[:, I:])
// (HF LlamaMLP: act_fn(gate_proj(x)) * up_proj(x): silu rounded to the dtype,
// then the product rounded again). silu(g) = g / (1 + exp(-g)).
// x: [T, 2I], out: [T, I], same dtype (float32 or bfloat16), last dimensions
// contiguous, any row strides, out's rows not overlapping, out disjoint from x.
// num_threads in [1, kMaxThreads]. Throws KernelArgumentError.
void silu_and_mul(const TensorArg& out, const TensorArg& x, int num_threads = 1);

// vLLM's `gelu_tanh_and_mul(out, x)`, the GeGLU gate (Shazeer 2020) of Gemma's
// MLP (HF Gemma3MLP: act_fn(gate_proj(x)) * up_proj(x), act_fn
// gelu_pytorch_tanh): out = to_dtype(to_dtype(gelu_tanh(x[:, :I])) * x[:, I:]),
// gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), in torch's
// form (tanh from exp; within a few float32 ulp of 1 + tanh(u) of torch's,
// so its cancellation for g below about -3 is torch's too). Tensors, threads
// and errors: as silu_and_mul.
void gelu_tanh_and_mul(const TensorArg& out, const TensorArg& x, int num_threads = 1);

// vLLM's `rotary_embedding(positions, query, key, head_size, cos_sin_cache,
// is_neox)`: rotary position embedding (RoPE, Su et al. 2021) in place.
// positions: [T] int64, each in [0, max_position) (checked, before anything is
// written). cos_sin_cache: [max_position, rot_dim] float32 contiguous, row p =
// [cos(p * f_0..f_{rot_dim/2-1}), sin(...)] (any scaling, e.g. Llama 3's, and
// HF's attention_scaling already applied); rot_dim even, in [2, min(head_size,
// kMaxRotaryDim)]: the first rot_dim elements of each head rotate, the rest
// stay. query: [T, Hq * head_size] or [T, Hq, head_size]; key (may be null):
// the same with Hk heads; float32 or bfloat16 (both alike), last dimension
// contiguous, any row (and head) stride, so views into a fused qkv buffer work;
// rows and heads of one tensor must not overlap (query and key are not checked
// against each other). cos/sin are rounded to the tensor dtype first (HF:
// cos.to(x.dtype)). is_neox: rotate_half over the two halves of the rotated
// part (HF apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, each product
// and the sum rounded to the dtype); false: GPT-J style, pairs (2i, 2i+1).
// num_threads in [1, kMaxThreads]. Throws KernelArgumentError.
void rotary_embedding(const TensorArg& positions, const TensorArg& query, const TensorArg* key, int64_t head_size,
                      const TensorArg& cos_sin_cache, bool is_neox, int num_threads = 1);

}  // namespace cpu
}  // namespace pagedserve
