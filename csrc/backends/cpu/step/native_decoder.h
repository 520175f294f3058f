// The native decode step: a decoder's whole forward over one step's flat batch
// in one C++ call, for the Llama family, Gemma 3, Qwen 2 and Qwen 3 (and any decoder built
// from the same pieces). Per layer:
//
//   [fused add +] RMSNorm (input_layernorm) -> qkv_proj -> [per-head RMSNorm of
//   q and k (q_norm, k_norm: Gemma 3, Qwen 3)] -> RoPE (the layer's table) ->
//   reshape_and_cache -> paged attention (the step's plan, or its sliding-window
//   plan) -> o_proj -> [RMSNorm (post_attn_layernorm: Gemma's sandwich norm)]
//   -> fused add + RMSNorm (pre_mlp_layernorm) -> gate_up_proj -> SiLU- or
//   GELU(tanh)-and-mul -> down_proj -> [RMSNorm (post_mlp_layernorm)]
//
// then the final norm (fused with the last residual add). The embedding rows
// may be scaled (Gemma: sqrt(hidden)). RMSNorm weights are passed as the
// factor the normalised value is multiplied by: Gemma's (1 + w) is formed by
// the caller, in float32, as Hugging Face's Gemma3RMSNorm forms it.
//
// It runs the very kernels the Python paths call one by one —
// QuantizedWeight::linear_f32 on the GGUF's own blocks, the fused ops of
// fused_ops.h, reshape_and_cache and the step's AttentionPlan. For the Llama
// family they are the lean forward's (python/pagedserve/model/lean_llama.py)
// in its order, so the hidden states are bit-identical to it; for Gemma 3 the
// reference is Hugging Face's modules (the fallback path), which differ in
// the norms' summation order and gelu's last bits. What the step removes is
// the per-call cost between ops (a Python -> C++ call, argument parsing and a
// tensor allocation per op), which at one user is as large as the arithmetic
// (docs/benchmarks.md, "Behind the code").
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

// A linear layer of the step on GGUF blocks: one QuantizedWeight, or several
// (the same in_features) whose outputs are concatenated in order — a fused
// layer whose parts the file stores in different block types (Gemma 3's q, k
// and v in a Q4_K_M file). bias: float32 [sum of out_features], or empty.
struct NativeLinear {
  std::vector<std::shared_ptr<const QuantizedWeight>> parts;
  std::vector<float> bias;
  int64_t in_features() const;
  int64_t out_features() const;
};

// The gated activation of the MLP: act(gate) * up.
enum class NativeActivation { kSiluAndMul, kGeluTanhAndMul };

// One decoder layer's weights: the four linear layers (qkv_proj [(Hq + 2 Hkv)
// D, hidden], o_proj [hidden, Hq D], gate_up_proj [2 I, hidden], down_proj
// [hidden, I]); the RMSNorm factors, each [hidden] — input_layernorm,
// pre_mlp_layernorm (Llama's post_attention_layernorm, Gemma's
// pre_feedforward_layernorm) — and the optional ones (empty: none):
// post_attn_layernorm and post_mlp_layernorm [hidden] (Gemma's
// post_attention_layernorm and post_feedforward_layernorm), q_norm and k_norm
// [head_dim] (per head). eps serves every norm but pre_mlp_layernorm's
// (eps_post). rope_table: which of the decoder's rotary tables the layer
// uses; sliding_window: tokens (0: none), read through the step's window plan.
struct NativeLayer {
  NativeLinear qkv_proj, o_proj, gate_up_proj, down_proj;
  std::vector<float> input_layernorm, pre_mlp_layernorm, post_attn_layernorm, post_mlp_layernorm, q_norm, k_norm;
  float eps = 1e-6f, eps_post = 1e-6f;
  int64_t rope_table = 0;
  int64_t sliding_window = 0;
};

class NativeDecoder {
 public:
  // The embedding is either embed_tokens, float32 [vocab, hidden] contiguous,
  // borrowed (the caller keeps it alive and unchanged while the decoder
  // exists), or, when embed_tokens is null, embed_blocks [vocab, hidden] (its
  // rows de-quantised per token: QuantizedWeight::embedding); each row is
  // multiplied by embed_scale (float32) unless it is 1. cos_sin_caches: the
  // rotary tables, each float32 [max_position, head_dim] contiguous (the same
  // shape), row p = [cos(p f_0..), sin(p f_0..)] (copied); or none, and then
  // every forward passes the step's rows (rope_tables). final_norm: [hidden]
  // (copied). Throws KernelArgumentError on a bad shape or dtype.
  NativeDecoder(const TensorArg* embed_tokens, std::shared_ptr<const QuantizedWeight> embed_blocks,
                const std::vector<TensorArg>& cos_sin_caches, std::vector<float> final_norm, float final_norm_eps,
                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float embed_scale = 1.f,
                NativeActivation activation = NativeActivation::kSiluAndMul);
  ~NativeDecoder();
  NativeDecoder(const NativeDecoder&) = delete;
  NativeDecoder& operator=(const NativeDecoder&) = delete;

  // Appends layer i = num_layers(). Throws KernelArgumentError when a weight is
  // missing or its shape does not fit the others (a bias or norm of the wrong
  // length, a rope table out of range, a negative window included).
  void add_layer(NativeLayer layer);

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  int64_t hidden_size() const { return hidden_; }

  // out [T, hidden] float32 contiguous = the final norm's output for the step's
  // tokens: input_ids [T] int64 (each in [0, vocab)), positions [T] int64 (each
  // in [0, max_position)), slot_mapping [T] int64 (reshape_and_cache's), into
  // and from kv_store (layout above, `num_layers()` layers) with `plan` (the
  // step's, no sliding window, built for this decoder's heads and the store's
  // blocks) and, for the layers with a sliding window, `window_plan` (the same
  // step's plan with that window; may be null when no layer has one). scale:
  // the attention softmax scale. rope_tables: empty (the tables given at
  // construction, indexed by position), or the step's rows of every table the
  // layers use, each float32 [T, head_dim] contiguous, row i for token i (a
  // decoder built without tables needs them; a table per position would be
  // 32 MiB per table at Gemma 3's 32k positions). Everything is checked before
  // anything is written, except what the kernels check themselves (each
  // before it writes). Throws KernelArgumentError.
  void forward(const TensorArg& input_ids, const TensorArg& positions, const TensorArg& slot_mapping,
               const TensorArg& kv_store, AttentionPlan& plan, AttentionPlan* window_plan, const TensorArg& out,
               float scale, int num_threads, const std::vector<TensorArg>& rope_tables = {});

 private:
  // out [t, N] (row stride out_stride) = x [t, K] through `linear` (several parts: one dispatch, QuantizedWeight::linear_f32_parts).
  void run_linear(const NativeLinear& linear, const TensorArg& x, float* out, int64_t out_stride, int num_threads);
  const float* embed_ = nullptr;
  std::shared_ptr<const QuantizedWeight> embed_blocks_;
  int64_t vocab_ = 0, hidden_ = 0;
  std::vector<std::vector<float>> cos_sin_;
  int64_t max_position_;
  std::vector<float> final_norm_;
  float final_norm_eps_;
  int64_t num_heads_, num_kv_heads_, head_dim_, intermediate_ = 0;
  float embed_scale_;
  NativeActivation activation_;
  int64_t max_window_ = 0;  // the layers' sliding window (one value: the window plan's), 0: none
  int64_t rope_tables_used_ = 0;  // 1 + the largest rope_table of a layer
  std::vector<int64_t> token_index_;  // 0 .. T-1: the rows of per-step rope tables
  std::vector<NativeLayer> layers_;
  // per-step scratch, sized for the step's T: residual [T, hidden], attn [T, Hq D], qkv [T, (Hq + 2 Hkv) D],
  // gate_up [T, 2 I], act [T, I], part [T, widest part of a split layer]
  std::vector<float> residual_, attn_, qkv_, gate_up_, act_;
};

}  // namespace cpu
}  // namespace pagedserve
