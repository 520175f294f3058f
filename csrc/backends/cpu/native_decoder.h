// The native decode step: a Llama-family decoder's whole forward over one
// step's flat batch in one C++ call (embedding lookup, per layer RMSNorm ->
// qkv_proj -> RoPE -> reshape_and_cache -> paged attention -> o_proj -> fused
// add + RMSNorm -> gate_up_proj -> SiLU-and-mul -> down_proj, final norm).
//
// It runs the very kernels the Python lean forward (python/pagedserve/model/
// lean_llama.py) calls one by one — QuantizedWeight::linear_f32 on the GGUF's
// own blocks, the fused ops of fused_ops.h, reshape_and_cache and the step's
// AttentionPlan — in the same order on the same buffers' values, so its
// hidden states are bit-identical to that path's; what it removes is the
// per-call cost between them (one Python -> C++ call, argument parsing and a
// tensor allocation per op: about 10 per layer), which at one user is as
// large as the arithmetic (measured on a 2-core EPYC without AVX-512: ~18 of
// a 38 ms step outside the GEMMs).
//
// float32 only (the gguf path's dtype); the KV store is the CPU backend's
// layout, [layers, 2, num_blocks, Hkv, block_size * D] float32 (k_cache of a
// layer [num_blocks, Hkv, D, block_size], v_cache [num_blocks, Hkv,
// block_size, D]; attention_cpu.h). Not thread-safe: one forward at a time
// (its scratch is reused across calls).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "backends/common/tensor_arg.h"

namespace pagedserve {
namespace cpu {

class AttentionPlan;
class QuantizedWeight;

// One decoder layer's weights: the fused linear layers on their GGUF blocks
// (qkv_proj [(Hq + 2 Hkv) D, hidden], o_proj [hidden, Hq D], gate_up_proj
// [2 I, hidden], down_proj [hidden, I]), their float32 biases (empty: none)
// and the two RMSNorm weights [hidden] with their eps.
struct NativeLayer {
  std::shared_ptr<const QuantizedWeight> qkv_proj, o_proj, gate_up_proj, down_proj;
  std::vector<float> qkv_bias, o_bias, gate_up_bias, down_bias;
  std::vector<float> input_layernorm, post_attention_layernorm;
  float eps = 1e-6f, eps_post = 1e-6f;
};

class NativeDecoder {
 public:
  // The embedding is either embed_tokens, float32 [vocab, hidden] contiguous,
  // borrowed (the caller keeps it alive and unchanged while the decoder
  // exists), or, when embed_tokens is null, embed_blocks [vocab, hidden] (its
  // rows de-quantised per token: QuantizedWeight::embedding). cos_sin_cache:
  // float32 [max_position, head_dim] contiguous, row p = [cos(p f_0..),
  // sin(p f_0..)] (copied). final_norm: [hidden] (copied). Throws
  // KernelArgumentError on a bad shape or dtype.
  NativeDecoder(const TensorArg* embed_tokens, std::shared_ptr<const QuantizedWeight> embed_blocks,
                const TensorArg& cos_sin_cache, std::vector<float> final_norm, float final_norm_eps,
                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim);
  ~NativeDecoder();
  NativeDecoder(const NativeDecoder&) = delete;
  NativeDecoder& operator=(const NativeDecoder&) = delete;

  // Appends layer i = num_layers(). Throws KernelArgumentError when a weight is
  // missing or its shape does not fit the others (a bias or norm of the wrong
  // length included).
  void add_layer(NativeLayer layer);

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  int64_t hidden_size() const { return hidden_; }

  // out [T, hidden] float32 contiguous = the final norm's output for the step's
  // tokens: input_ids [T] int64 (each in [0, vocab)), positions [T] int64 (each
  // in [0, max_position)), slot_mapping [T] int64 (reshape_and_cache's), into
  // and from kv_store (layout above, `num_layers()` layers) with `plan` (the
  // step's, no sliding window, built for this decoder's heads and the store's
  // blocks). scale: the attention softmax scale. Everything is checked before
  // anything is written, except what the kernels check themselves (each
  // before it writes). Throws KernelArgumentError.
  void forward(const TensorArg& input_ids, const TensorArg& positions, const TensorArg& slot_mapping,
               const TensorArg& kv_store, AttentionPlan& plan, const TensorArg& out, float scale,
               int num_threads);

 private:
  const float* embed_ = nullptr;
  std::shared_ptr<const QuantizedWeight> embed_blocks_;
  int64_t vocab_ = 0, hidden_ = 0;
  std::vector<float> cos_sin_;
  int64_t max_position_;
  std::vector<float> final_norm_;
  float final_norm_eps_;
  int64_t num_heads_, num_kv_heads_, head_dim_, intermediate_ = 0;
  std::vector<NativeLayer> layers_;
  // per-step scratch, sized for the step's T: residual [T, hidden], h [T, hidden]
  // (then the attention output [T, Hq D]), qkv [T, (Hq + 2 Hkv) D], gate_up [T, 2 I], act [T, I]
  std::vector<float> residual_, attn_, qkv_, gate_up_, act_;
};

}  // namespace cpu
}  // namespace pagedserve
