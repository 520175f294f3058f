// The native decode step (native_decoder.h): the lean Llama forward's op
// sequence, kernel for kernel, without a Python call between the ops.
#include "native_decoder.h"

#include <cstring>
#include <string>
#include <utility>

#include "attention_cpu.h"
#include "core/errors.h"
#include "fused_ops.h"
#include "quant_linear.h"

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

void linear(const QuantizedWeight& w, const TensorArg& x, const TensorArg& out, const std::vector<float>& bias,
            int num_threads) {
  if (bias.empty()) {
    w.linear_f32(x, out, nullptr, num_threads);
  } else {
    const TensorArg b = vec_view(bias, "bias");
    w.linear_f32(x, out, &b, num_threads);
  }
}

}  // namespace

NativeDecoder::NativeDecoder(const TensorArg* embed_tokens, std::shared_ptr<const QuantizedWeight> embed_blocks,
                             const TensorArg& cos_sin_cache, std::vector<float> final_norm, float final_norm_eps,
                             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim)
    : embed_blocks_(std::move(embed_blocks)),
      final_norm_(std::move(final_norm)),
      final_norm_eps_(final_norm_eps),
      num_heads_(num_heads),
      num_kv_heads_(num_kv_heads),
      head_dim_(head_dim) {
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
  cos_sin_cache.check_dim(2);
  cos_sin_cache.check_dtype(DType::kFloat32);
  cos_sin_cache.check_contiguous();
  require(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
          "num_heads must be a positive multiple of num_kv_heads");
  require(head_dim > 0 && cos_sin_cache.size(1) == head_dim, "cos_sin_cache must be [max_position, head_dim]");
  require(static_cast<int64_t>(final_norm_.size()) == hidden_, "final_norm must have hidden_size elements");
  max_position_ = cos_sin_cache.size(0);
  const float* cs = cos_sin_cache.ptr<const float>();
  cos_sin_.assign(cs, cs + max_position_ * head_dim);
}

NativeDecoder::~NativeDecoder() = default;

void NativeDecoder::add_layer(NativeLayer layer) {
  require(layer.qkv_proj && layer.o_proj && layer.gate_up_proj && layer.down_proj,
          "a layer needs qkv_proj, o_proj, gate_up_proj and down_proj");
  const int64_t q = num_heads_ * head_dim_, kv = num_kv_heads_ * head_dim_;
  const QuantizedWeight &qkv = *layer.qkv_proj, &o = *layer.o_proj, &gu = *layer.gate_up_proj,
                        &down = *layer.down_proj;
  require(qkv.in_features() == hidden_ && qkv.out_features() == q + 2 * kv,
          "qkv_proj must be [(num_heads + 2 num_kv_heads) head_dim, hidden_size]");
  require(o.in_features() == q && o.out_features() == hidden_, "o_proj must be [hidden_size, num_heads head_dim]");
  require(gu.in_features() == hidden_ && gu.out_features() % 2 == 0, "gate_up_proj must be [2 I, hidden_size]");
  const int64_t inter = gu.out_features() / 2;
  require(down.in_features() == inter && down.out_features() == hidden_, "down_proj must be [hidden_size, I]");
  require(layers_.empty() || inter == intermediate_, "every layer must have the same intermediate size");
  auto bias_ok = [](const std::vector<float>& b, int64_t n) { return b.empty() || static_cast<int64_t>(b.size()) == n; };
  require(bias_ok(layer.qkv_bias, q + 2 * kv) && bias_ok(layer.o_bias, hidden_) &&
              bias_ok(layer.gate_up_bias, 2 * inter) && bias_ok(layer.down_bias, hidden_),
          "a bias must be empty or have out_features elements");
  require(static_cast<int64_t>(layer.input_layernorm.size()) == hidden_ &&
              static_cast<int64_t>(layer.post_attention_layernorm.size()) == hidden_,
          "the layer norms must have hidden_size elements");
  intermediate_ = inter;
  layers_.push_back(std::move(layer));
}

void NativeDecoder::forward(const TensorArg& input_ids, const TensorArg& positions, const TensorArg& slot_mapping,
                            const TensorArg& kv_store, AttentionPlan& plan, const TensorArg& out, float scale,
                            int num_threads) {
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
  const AttentionGeometry& g = plan.geometry();
  require(g.num_tokens == t && g.num_heads == num_heads_ && g.num_kv_heads == num_kv_heads_ && g.head_dim == d &&
              g.block_size == block_size && g.num_blocks == num_blocks && plan.sliding_window() == 0,
          "the plan was not built for this step, these heads and this KV store (or has a sliding window)");
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
  const TensorArg qkv = rows_view(qkv_.data(), t, width, "qkv");
  const TensorArg q2 = view(qkv_.data(), {t, hq}, {width, 1}, "query");
  const TensorArg k2 = view(qkv_.data() + hq, {t, hk}, {width, 1}, "key");
  const TensorArg q3 = view(qkv_.data(), {t, num_heads_, d}, {width, d, 1}, "query");
  const TensorArg k3 = view(qkv_.data() + hq, {t, num_kv_heads_, d}, {width, d, 1}, "key");
  const TensorArg v3 = view(qkv_.data() + hq + hk, {t, num_kv_heads_, d}, {width, d, 1}, "value");
  const TensorArg attn3 = view(attn_.data(), {t, num_heads_, d}, {hq, d, 1}, "attn");
  const TensorArg attn2 = rows_view(attn_.data(), t, hq, "attn");
  const TensorArg gate_up = rows_view(gate_up_.data(), t, 2 * inter, "gate_up");
  const TensorArg act = rows_view(act_.data(), t, inter, "act");
  const TensorArg cos_sin = rows_view(cos_sin_.data(), max_position_, d, "cos_sin_cache");
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
    linear(*L.qkv_proj, h, qkv, L.qkv_bias, num_threads);
    rotary_embedding(positions, q2, &k2, d, cos_sin, true, num_threads);
    const TensorArg k_cache = view(store + (2 * i) * slab, {num_blocks, num_kv_heads_, d, block_size},
                                   {num_kv_heads_ * d * block_size, d * block_size, block_size, 1}, "k_cache");
    const TensorArg v_cache = view(store + (2 * i + 1) * slab, {num_blocks, num_kv_heads_, block_size, d},
                                   {num_kv_heads_ * block_size * d, block_size * d, d, 1}, "v_cache");
    reshape_and_cache(k3, v3, k_cache, v_cache, slot_mapping, num_threads);
    plan.run(attn3, q3, k_cache, v_cache, scale, 0.f);
    linear(*L.o_proj, attn2, h, L.o_bias, num_threads);
    fused_add_rms_norm(h, residual, vec_view(L.post_attention_layernorm, "post_attention_layernorm"), L.eps_post,
                       num_threads);
    linear(*L.gate_up_proj, h, gate_up, L.gate_up_bias, num_threads);
    silu_and_mul(act, gate_up, num_threads);
    linear(*L.down_proj, act, h, L.down_bias, num_threads);
  }
  fused_add_rms_norm(h, residual, vec_view(final_norm_, "norm"), final_norm_eps_, num_threads);
  if (t > kKeptScratchTokens) {  // a prefill's scratch (tens of MiB at 2048 tokens) is not kept for the decodes
    for (std::vector<float>* v : {&residual_, &attn_, &qkv_, &gate_up_, &act_}) {
      v->clear();
      v->shrink_to_fit();
    }
  }
}

}  // namespace cpu
}  // namespace pagedserve
