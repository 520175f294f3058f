// The native decode step (native_decoder.h): a decoder layer's op sequence,
// kernel for kernel, without a Python call between the ops.
#include "backends/cpu/step/native_decoder.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>

#include "backends/cpu/attention/attention_cpu.h"
#include "core/errors.h"
#include "backends/cpu/ops/fused_ops.h"
#include "backends/cpu/gemm/quant_linear.h"
#include "backends/cpu/runtime/isa_registry.h"

namespace pagedserve {
namespace cpu {
namespace {

// A float32 view of caller-owned memory (no copy; shape and strides in elements).
TensorArg view(const float* p, std::vector<int64_t> shape, std::vector<int64_t> strides, const char* name) {
  TensorArg t;
  t.data = const_cast<float*>(p);
  t.dtype = DType::kFloat32;
  t.shape = std::move(shape);
  t.strides = std::move(strides);
  t.name = name;
  return t;
}

TensorArg vec_view(const std::vector<float>& v, const char* name) {
  return view(v.data(), {static_cast<int64_t>(v.size())}, {1}, name);
}

// A [rows, cols] contiguous view.
TensorArg rows_view(const float* p, int64_t rows, int64_t cols, const char* name) {
  return view(p, {rows, cols}, {cols, 1}, name);
}

// Steps of more tokens than this release their scratch when they end (decode steps keep and reuse theirs).
constexpr int64_t kKeptScratchTokens = 256;

void require(bool ok, const std::string& what) {
  if (!ok) throw KernelArgumentError("NativeDecoder: " + what);
}

// Checks a 1-d int64 contiguous tensor of n elements (n < 0: any) and returns its length.
int64_t check_ids(const TensorArg& t, int64_t n) {
  t.check_dim(1);
  t.check_dtype(DType::kInt64);
  t.check_contiguous();
  require(n < 0 || t.size(0) == n, t.name + " has " + std::to_string(t.size(0)) + " elements, expected " +
                                       std::to_string(n));
  return t.size(0);
}

// A [rows, cols] view with row stride `stride` (elements).
TensorArg strided_rows(const float* p, int64_t rows, int64_t cols, int64_t stride, const char* name) {
  return view(p, {rows, cols}, {stride, 1}, name);
}

// Checks a norm factor: `n` elements, or none where `optional`.
void check_norm(const std::vector<float>& w, int64_t n, bool optional, const char* name) {
  require((optional && w.empty()) || static_cast<int64_t>(w.size()) == n,
          std::string(name) + " must have " + std::to_string(n) + " elements" + (optional ? " or none" : "") +
              ", got " + std::to_string(w.size()));
}

}  // namespace

int64_t NativeLinear::in_features() const { return parts.empty() ? 0 : parts.front()->in_features(); }

int64_t NativeLinear::out_features() const {
  int64_t n = 0;
  for (const auto& p : parts) n += p->out_features();
  return n;
}

NativeDecoder::NativeDecoder(const TensorArg* embed_tokens, std::shared_ptr<const QuantizedWeight> embed_blocks,
                             const std::vector<TensorArg>& cos_sin_caches, std::vector<float> final_norm,
                             float final_norm_eps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                             float embed_scale, NativeActivation activation)
    : embed_blocks_(std::move(embed_blocks)),
      final_norm_(std::move(final_norm)),
      final_norm_eps_(final_norm_eps),
      num_heads_(num_heads),
      num_kv_heads_(num_kv_heads),
      head_dim_(head_dim),
      embed_scale_(embed_scale),
      activation_(activation) {
  if (embed_tokens != nullptr) {
    embed_tokens->check_dim(2);
    embed_tokens->check_dtype(DType::kFloat32);
    embed_tokens->check_contiguous();
    embed_ = embed_tokens->ptr<const float>();
    vocab_ = embed_tokens->size(0);
    hidden_ = embed_tokens->size(1);
  } else {
    require(embed_blocks_ != nullptr, "an embedding table or its blocks is needed");
    vocab_ = embed_blocks_->out_features();
    hidden_ = embed_blocks_->in_features();
  }
  require(std::isfinite(embed_scale), "embed_scale must be finite");
  require(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
          "num_heads must be a positive multiple of num_kv_heads");
  max_position_ = !cos_sin_caches.empty() && cos_sin_caches.front().dim() == 2 ? cos_sin_caches.front().size(0) : 0;
  for (const TensorArg& cache : cos_sin_caches) {
    cache.check_dim(2);
    cache.check_dtype(DType::kFloat32);
    cache.check_contiguous();
    require(head_dim > 0 && cache.size(1) == head_dim && cache.size(0) == max_position_,
            "every cos_sin_cache must be [max_position, head_dim], the same shape");
    const float* cs = cache.ptr<const float>();
    cos_sin_.emplace_back(cs, cs + max_position_ * head_dim);
  }
  check_norm(final_norm_, hidden_, false, "final_norm");
}

NativeDecoder::~NativeDecoder() = default;

void NativeDecoder::add_layer(NativeLayer layer) {
  const int64_t q = num_heads_ * head_dim_, kv = num_kv_heads_ * head_dim_;
  for (const NativeLinear* lin : {&layer.qkv_proj, &layer.o_proj, &layer.gate_up_proj, &layer.down_proj}) {
    require(!lin->parts.empty(), "a layer needs qkv_proj, o_proj, gate_up_proj and down_proj");
    for (const auto& p : lin->parts) {
      require(p != nullptr && p->in_features() == lin->in_features(),
              "the parts of a linear layer must be weights of the same in_features");
    }
    require(lin->bias.empty() || static_cast<int64_t>(lin->bias.size()) == lin->out_features(),
            "a bias must be empty or have out_features elements");
  }
  const NativeLinear &qkv = layer.qkv_proj, &o = layer.o_proj, &gu = layer.gate_up_proj, &down = layer.down_proj;
  require(qkv.in_features() == hidden_ && qkv.out_features() == q + 2 * kv,
          "qkv_proj must be [(num_heads + 2 num_kv_heads) head_dim, hidden_size]");
  require(o.in_features() == q && o.out_features() == hidden_, "o_proj must be [hidden_size, num_heads head_dim]");
  require(gu.in_features() == hidden_ && gu.out_features() % 2 == 0, "gate_up_proj must be [2 I, hidden_size]");
  const int64_t inter = gu.out_features() / 2;
  require(down.in_features() == inter && down.out_features() == hidden_, "down_proj must be [hidden_size, I]");
  require(layers_.empty() || inter == intermediate_, "every layer must have the same intermediate size");
  check_norm(layer.input_layernorm, hidden_, false, "input_layernorm");
  check_norm(layer.pre_mlp_layernorm, hidden_, false, "pre_mlp_layernorm");
  check_norm(layer.post_attn_layernorm, hidden_, true, "post_attn_layernorm");
  check_norm(layer.post_mlp_layernorm, hidden_, true, "post_mlp_layernorm");
  check_norm(layer.q_norm, head_dim_, true, "q_norm");
  check_norm(layer.k_norm, head_dim_, true, "k_norm");
  require(layer.rope_table >= 0 && (cos_sin_.empty() || layer.rope_table < static_cast<int64_t>(cos_sin_.size())),
          "rope_table " + std::to_string(layer.rope_table) + " is not one of the " +
              std::to_string(cos_sin_.size()) + " rotary tables");
  rope_tables_used_ = std::max(rope_tables_used_, layer.rope_table + 1);
  require(layer.sliding_window >= 0, "sliding_window must be >= 0");
  require(layer.sliding_window == 0 || max_window_ == 0 || layer.sliding_window == max_window_,
          "the layers' sliding windows must be one value (the step has one window plan)");
  if (layer.sliding_window > 0) max_window_ = layer.sliding_window;
  intermediate_ = inter;
  layers_.push_back(std::move(layer));
}

void NativeDecoder::run_linear(const NativeLinear& linear, const TensorArg& x, float* out, int64_t out_stride,
                               int num_threads) {
  const int64_t t = x.size(0);
  const float* bias = linear.bias.empty() ? nullptr : linear.bias.data();
  if (linear.parts.size() == 1 && out_stride == linear.out_features()) {
    const QuantizedWeight& w = *linear.parts.front();
    const TensorArg o = rows_view(out, t, w.out_features(), "out");
    if (bias == nullptr) {
      w.linear_f32(x, o, nullptr, num_threads);
    } else {
      const TensorArg b = view(bias, {w.out_features()}, {1}, "bias");
      w.linear_f32(x, o, &b, num_threads);
    }
    return;
  }
  // several parts (different block types): one dispatch, each part into its columns of out
  std::vector<const QuantizedWeight*> parts;
  parts.reserve(linear.parts.size());
  for (const auto& part : linear.parts) parts.push_back(part.get());
  QuantizedWeight::linear_f32_parts(parts, x.ptr<float>(), t, out, out_stride, bias, num_threads,
                                    active_isa().gemm());
}

void NativeDecoder::forward(const TensorArg& input_ids, const TensorArg& positions, const TensorArg& slot_mapping,
                            const TensorArg& kv_store, AttentionPlan& plan, AttentionPlan* window_plan,
                            const TensorArg& out, float scale, int num_threads,
                            const std::vector<TensorArg>& rope_tables) {
  require(!layers_.empty(), "no layers");
  const int64_t t = check_ids(input_ids, -1);
  check_ids(positions, t);
  check_ids(slot_mapping, t);
  out.check_dtype(DType::kFloat32);
  out.check_contiguous();
  out.check_shape({t, hidden_});
  const int64_t num_layers = this->num_layers(), d = head_dim_;
  kv_store.check_dim(5);
  kv_store.check_dtype(DType::kFloat32);
  kv_store.check_contiguous();
  require(kv_store.size(0) == num_layers && kv_store.size(1) == 2 && kv_store.size(3) == num_kv_heads_ &&
              kv_store.size(4) % d == 0,
          "kv_store must be [num_layers, 2, num_blocks, num_kv_heads, block_size * head_dim]");
  const int64_t num_blocks = kv_store.size(2), block_size = kv_store.size(4) / d;
  auto fits = [&](const AttentionPlan& p, int64_t window) {
    const AttentionGeometry& g = p.geometry();
    return g.num_tokens == t && g.num_heads == num_heads_ && g.num_kv_heads == num_kv_heads_ && g.head_dim == d &&
           g.block_size == block_size && g.num_blocks == num_blocks && p.sliding_window() == window;
  };
  require(fits(plan, 0),
          "the plan was not built for this step, these heads and this KV store (or has a sliding window)");
  require(max_window_ == 0 || (window_plan != nullptr && fits(*window_plan, max_window_)),
          "the layers with a sliding window of " + std::to_string(max_window_) +
              " need the step's plan with that window (window_plan)");
  const bool step_rows = !rope_tables.empty();
  require(step_rows || !cos_sin_.empty(), "this decoder was built without rotary tables: pass the step's rope_tables");
  require(!step_rows || static_cast<int64_t>(rope_tables.size()) >= rope_tables_used_,
          "rope_tables: the layers use " + std::to_string(rope_tables_used_) + " tables, got " +
              std::to_string(rope_tables.size()));
  for (const TensorArg& table : rope_tables) {
    table.check_dtype(DType::kFloat32);
    table.check_contiguous();
    table.check_shape({t, d});
  }
  const int64_t* ids = input_ids.ptr<const int64_t>();
  for (int64_t i = 0; i < t; ++i) {
    require(ids[i] >= 0 && ids[i] < vocab_, "input_ids[" + std::to_string(i) + "] = " + std::to_string(ids[i]) +
                                                " is outside the vocabulary [0, " + std::to_string(vocab_) + ")");
  }
  if (t == 0) return;

  const int64_t hq = num_heads_ * d, hk = num_kv_heads_ * d, width = hq + 2 * hk, inter = intermediate_;
  residual_.resize(static_cast<size_t>(t * hidden_));
  attn_.resize(static_cast<size_t>(t * hq));
  qkv_.resize(static_cast<size_t>(t * width));
  gate_up_.resize(static_cast<size_t>(t * 2 * inter));
  act_.resize(static_cast<size_t>(t * inter));
  const TensorArg h = out, residual = rows_view(residual_.data(), t, hidden_, "residual");
  if (embed_ != nullptr) {
    for (int64_t i = 0; i < t; ++i) {
      std::memcpy(residual_.data() + i * hidden_, embed_ + ids[i] * hidden_, sizeof(float) * hidden_);
    }
  } else {
    embed_blocks_->embedding(input_ids, residual);
  }
  if (embed_scale_ != 1.f) {  // Gemma: embedding(ids) * embed_scale, one float32 product per element
    for (float& v : residual_) v *= embed_scale_;
  }
  const TensorArg q2 = strided_rows(qkv_.data(), t, hq, width, "query");
  const TensorArg k2 = strided_rows(qkv_.data() + hq, t, hk, width, "key");
  const TensorArg q3 = view(qkv_.data(), {t, num_heads_, d}, {width, d, 1}, "query");
  const TensorArg k3 = view(qkv_.data() + hq, {t, num_kv_heads_, d}, {width, d, 1}, "key");
  const TensorArg v3 = view(qkv_.data() + hq + hk, {t, num_kv_heads_, d}, {width, d, 1}, "value");
  const TensorArg attn3 = view(attn_.data(), {t, num_heads_, d}, {hq, d, 1}, "attn");
  const TensorArg attn2 = rows_view(attn_.data(), t, hq, "attn");
  const TensorArg gate_up = rows_view(gate_up_.data(), t, 2 * inter, "gate_up");
  const TensorArg act = rows_view(act_.data(), t, inter, "act");
  if (step_rows && static_cast<int64_t>(token_index_.size()) < t) {
    token_index_.resize(static_cast<size_t>(t));
    for (int64_t i = 0; i < t; ++i) token_index_[static_cast<size_t>(i)] = i;
  }
  TensorArg rope_positions;
  rope_positions.data = token_index_.data();
  rope_positions.dtype = DType::kInt64;
  rope_positions.shape = {t};
  rope_positions.strides = {1};
  rope_positions.name = "positions";
  const int64_t slab = num_blocks * num_kv_heads_ * block_size * d;  // elements of one layer's K (or V)
  const float* store = kv_store.ptr<const float>();
  for (int64_t i = 0; i < num_layers; ++i) {
    const NativeLayer& L = layers_[static_cast<size_t>(i)];
    const TensorArg in_norm = vec_view(L.input_layernorm, "input_layernorm");
    if (i == 0) {
      rms_norm(h, residual, in_norm, L.eps, num_threads);
    } else {
      fused_add_rms_norm(h, residual, in_norm, L.eps, num_threads);
    }
    run_linear(L.qkv_proj, h, qkv_.data(), width, num_threads);
    // per-head norms of q and k, in place: one call per head over the step's tokens (rows `width` apart)
    for (int64_t head = 0; head < (L.q_norm.empty() ? 0 : num_heads_); ++head) {
      const TensorArg qh = strided_rows(qkv_.data() + head * d, t, d, width, "q_head");
      rms_norm(qh, qh, vec_view(L.q_norm, "q_norm"), L.eps, num_threads);
    }
    for (int64_t head = 0; head < (L.k_norm.empty() ? 0 : num_kv_heads_); ++head) {
      const TensorArg kh = strided_rows(qkv_.data() + hq + head * d, t, d, width, "k_head");
      rms_norm(kh, kh, vec_view(L.k_norm, "k_norm"), L.eps, num_threads);
    }
    if (step_rows) {  // row i of the step's table is token i's
      rotary_embedding(rope_positions, q2, &k2, d, rope_tables[static_cast<size_t>(L.rope_table)], true, num_threads);
    } else {
      const std::vector<float>& table = cos_sin_[static_cast<size_t>(L.rope_table)];
      rotary_embedding(positions, q2, &k2, d, rows_view(table.data(), max_position_, d, "cos_sin_cache"), true,
                       num_threads);
    }
    const TensorArg k_cache = view(store + (2 * i) * slab, {num_blocks, num_kv_heads_, d, block_size},
                                   {num_kv_heads_ * d * block_size, d * block_size, block_size, 1}, "k_cache");
    const TensorArg v_cache = view(store + (2 * i + 1) * slab, {num_blocks, num_kv_heads_, block_size, d},
                                   {num_kv_heads_ * block_size * d, block_size * d, d, 1}, "v_cache");
    reshape_and_cache(k3, v3, k_cache, v_cache, slot_mapping, num_threads);
    (L.sliding_window > 0 ? *window_plan : plan).run(attn3, q3, k_cache, v_cache, scale, 0.f);
    run_linear(L.o_proj, attn2, h.ptr<float>(), hidden_, num_threads);
    if (!L.post_attn_layernorm.empty()) {
      rms_norm(h, h, vec_view(L.post_attn_layernorm, "post_attn_layernorm"), L.eps, num_threads);
    }
    fused_add_rms_norm(h, residual, vec_view(L.pre_mlp_layernorm, "pre_mlp_layernorm"), L.eps_post, num_threads);
    run_linear(L.gate_up_proj, h, gate_up_.data(), 2 * inter, num_threads);
    if (activation_ == NativeActivation::kGeluTanhAndMul) {
      gelu_tanh_and_mul(act, gate_up, num_threads);
    } else {
      silu_and_mul(act, gate_up, num_threads);
    }
    run_linear(L.down_proj, act, h.ptr<float>(), hidden_, num_threads);
    if (!L.post_mlp_layernorm.empty()) {
      rms_norm(h, h, vec_view(L.post_mlp_layernorm, "post_mlp_layernorm"), L.eps, num_threads);
    }
  }
  fused_add_rms_norm(h, residual, vec_view(final_norm_, "norm"), final_norm_eps_, num_threads);
  if (t > kKeptScratchTokens) {  // a prefill's scratch (tens of MiB at 2048 tokens) is not kept for the decodes
    for (std::vector<float>* v : {&residual_, &attn_, &qkv_, &gate_up_, &act_}) {
      v->clear();
      v->shrink_to_fit();
    }
    token_index_.clear();
    token_index_.shrink_to_fit();
  }
}

}  // namespace cpu
}  // namespace pagedserve
