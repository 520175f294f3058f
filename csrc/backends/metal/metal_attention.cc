#include "metal_attention.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "backends/common/attention_checks.h"
#include "core/errors.h"

namespace pagedserve {
namespace metal {

namespace pm = pagedserve_metal;

// ---- DeviceBuffer accounting and PipelineKey --------------------------------------------
namespace {
std::atomic<int64_t> g_live_count{0};
std::atomic<int64_t> g_live_bytes{0};
}  // namespace

DeviceBuffer::DeviceBuffer(size_t bytes) : accounted_bytes_(bytes) {
  g_live_count.fetch_add(1);
  g_live_bytes.fetch_add(static_cast<int64_t>(bytes));
}

DeviceBuffer::~DeviceBuffer() {
  g_live_count.fetch_sub(1);
  g_live_bytes.fetch_sub(static_cast<int64_t>(accounted_bytes_));
}

int64_t DeviceBuffer::live_count() { return g_live_count.load(); }
int64_t DeviceBuffer::live_bytes() { return g_live_bytes.load(); }

bool PipelineKey::operator<(const PipelineKey& o) const {
  if (kernel != o.kernel) return kernel < o.kernel;
  if (dtype != o.dtype) return dtype < o.dtype;
  if (head_size != o.head_size) return head_size < o.head_size;
  return block_size < o.block_size;
}

bool PipelineKey::operator==(const PipelineKey& o) const {
  return kernel == o.kernel && dtype == o.dtype && head_size == o.head_size && block_size == o.block_size;
}

namespace {

constexpr size_t kAlign = 256;  // staging regions start on 256 bytes (any element type, any offset rule)

size_t align_up(size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

// Byte regions of one staging buffer, each 256-byte aligned.
struct Regions {
  size_t total = 0;
  size_t add(size_t bytes) {
    const size_t at = total;
    total = align_up(total + bytes);
    return at;
  }
};

size_t checked_bytes(std::initializer_list<int64_t> factors, size_t elem, const char* what) {
  size_t n = elem;
  for (int64_t f : factors) {
    if (f < 0 || (f != 0 && n > std::numeric_limits<size_t>::max() / static_cast<size_t>(f))) {
      throw InvalidArgumentError(std::string(what) + " is too large to allocate");
    }
    n *= static_cast<size_t>(f);
  }
  return n;
}

// ---- the registry of live KV stores (any backend instance) -------------------------------
std::mutex g_stores_mu;
std::vector<std::weak_ptr<DeviceBuffer>> g_stores;

void register_store(const std::shared_ptr<DeviceBuffer>& store) {
  std::lock_guard<std::mutex> lock(g_stores_mu);
  g_stores.erase(std::remove_if(g_stores.begin(), g_stores.end(), [](const auto& w) { return w.expired(); }),
                 g_stores.end());
  g_stores.push_back(store);
}

// Copies a [T, heads, D] tensor with a contiguous last dimension into dst as
// contiguous rows (or back: to_tensor), elem bytes per element.
void copy_rows(unsigned char* staging, const TensorArg& t, size_t elem, bool to_tensor) {
  const int64_t tokens = t.size(0), heads = t.size(1), d = t.size(2);
  const size_t row = static_cast<size_t>(d) * elem;
  if (t.is_contiguous()) {
    const size_t bytes = row * static_cast<size_t>(tokens * heads);
    if (to_tensor) std::memcpy(t.data, staging, bytes);
    else std::memcpy(staging, t.data, bytes);
    return;
  }
  auto* base = static_cast<unsigned char*>(t.data);
  for (int64_t i = 0; i < tokens; ++i) {
    for (int64_t h = 0; h < heads; ++h) {
      unsigned char* tensor_row = base + static_cast<ptrdiff_t>((i * t.strides[0] + h * t.strides[1]) * elem);
      unsigned char* staged = staging + static_cast<size_t>(i * heads + h) * row;
      if (to_tensor) std::memcpy(tensor_row, staged, row);
      else std::memcpy(staged, tensor_row, row);
    }
  }
}

std::atomic<uint64_t> g_next_plan_id{1};

}  // namespace

StoreRef find_kv_store(const void* data, size_t bytes, const std::string& name) {
  const auto* p = static_cast<const unsigned char*>(data);
  std::lock_guard<std::mutex> lock(g_stores_mu);
  for (const auto& w : g_stores) {
    std::shared_ptr<DeviceBuffer> b = w.lock();
    if (!b) continue;
    const auto* begin = static_cast<const unsigned char*>(b->contents());
    if (p >= begin && p < begin + b->size()) {
      const size_t offset = static_cast<size_t>(p - begin);
      if (bytes > b->size() - offset) {
        throw KernelArgumentError(name + " runs past the end of its Metal KV store");
      }
      return StoreRef{std::move(b), offset};
    }
  }
  throw KernelArgumentError(name + " is not a view of a Metal KV store: the metal backend reads the cache in "
                                   "place on the GPU, so it must come from this backend's allocate_kv_cache");
}

// ---- MetalStepPlan ---------------------------------------------------------------------------
MetalStepPlan::MetalStepPlan(const MetalAttentionConfig& c, const TensorArg& query_start_loc,
                             const TensorArg& seq_lens, const TensorArg& block_tables, bool causal,
                             const MetalPlanOptions& options)
    : plan_(make_metal_plan(query_start_loc, seq_lens, block_tables, c.num_heads, c.num_kv_heads, c.head_size,
                            c.block_size, c.num_blocks, causal, 1.0f, options)),
      id_(g_next_plan_id.fetch_add(1)) {
  const AttentionGeometry& g = plan_.geometry;
  const int32_t* q = query_start_loc.ptr<int32_t>();
  query_start_loc_.assign(q, q + g.num_seqs + 1);
  const int32_t* s = seq_lens.ptr<int32_t>();
  seq_lens_.assign(s, s + g.num_seqs);
  const int32_t* t = block_tables.ptr<int32_t>();
  block_tables_.assign(t, t + g.num_seqs * g.max_blocks);
}

// ---- StagingBuffer -----------------------------------------------------------------------------
void StagingBuffer::reserve(MetalDevice& device, size_t bytes) {
  if (bytes <= capacity()) return;
  const size_t want = std::max({bytes, 2 * capacity(), kMinBytes});
  buffer_.reset();  // the GPU is idle between calls: the old buffer can go first
  buffer_ = device.new_shared_buffer(want);
  ++allocations_;
}

unsigned char* StagingBuffer::data() const {
  return buffer_ ? static_cast<unsigned char*>(buffer_->contents()) : nullptr;
}

// ---- MetalAttention ----------------------------------------------------------------------------
MetalAttention::MetalAttention(std::shared_ptr<MetalDevice> device, const MetalAttentionConfig& config)
    : device_(std::move(device)), config_(config) {
  const MetalAttentionConfig& c = config_;
  elem_ = dtype_size(c.dtype);
  metal_type_name(c.dtype);  // throws for a dtype the kernels lack
  if (c.num_heads < 1 || c.num_kv_heads < 1 || c.num_heads % c.num_kv_heads != 0 || c.num_heads > kMaxHeads) {
    throw KernelArgumentError("num_heads " + std::to_string(c.num_heads) + " must be a multiple of num_kv_heads " +
                              std::to_string(c.num_kv_heads) + " (both in [1, " + std::to_string(kMaxHeads) + "])");
  }
  if (c.head_size < 1 || c.head_size > pm::kMaxHeadSize) {
    throw KernelArgumentError("head_size must be in [1, " + std::to_string(pm::kMaxHeadSize) +
                              "] for the Metal kernels, got " + std::to_string(c.head_size));
  }
  if (c.block_size < 1 || c.block_size > kMaxBlockSize || c.num_blocks < 1) {
    throw KernelArgumentError("block_size must be in [1, " + std::to_string(kMaxBlockSize) +
                              "] and num_blocks >= 1, got " + std::to_string(c.block_size) + " and " +
                              std::to_string(c.num_blocks));
  }
  // one layer's K (or V) is indexed with int32 element offsets in the kernels
  if (c.num_blocks > std::numeric_limits<int32_t>::max() / (c.num_kv_heads * c.block_size * c.head_size)) {
    throw KernelArgumentError("num_blocks " + std::to_string(c.num_blocks) + " makes one layer's K cache " +
                              "larger than the Metal kernels' int32 indexing allows");
  }
  dummy_ = device_->new_shared_buffer(kAlign);
}

std::vector<int64_t> MetalAttention::kv_cache_shape() const {
  const MetalAttentionConfig& c = config_;
  return {2, c.num_blocks, c.num_kv_heads, c.block_size, c.head_size};
}

std::shared_ptr<DeviceBuffer> MetalAttention::allocate_kv_store(int64_t num_layers) {
  if (num_layers < 1) {
    throw InvalidArgumentError("the KV store needs at least one layer, got " + std::to_string(num_layers));
  }
  const MetalAttentionConfig& c = config_;
  const size_t bytes =
      checked_bytes({num_layers, 2, c.num_blocks, c.num_kv_heads, c.block_size, c.head_size}, elem_, "the KV store");
  std::shared_ptr<DeviceBuffer> store = device_->new_shared_buffer(bytes);
  register_store(store);
  return store;
}

StoreRef MetalAttention::cache_ref(const TensorArg& cache) const {
  const MetalAttentionConfig& c = config_;
  cache.check_dtype(c.dtype);
  cache.check_shape({c.num_blocks, c.num_kv_heads, c.block_size, c.head_size});
  cache.check_contiguous();
  return find_kv_store(cache.data, static_cast<size_t>(cache.numel()) * elem_, cache.name);
}

void MetalAttention::reshape_and_cache(const TensorArg& key, const TensorArg& value, const TensorArg& k_cache,
                                       const TensorArg& v_cache, const TensorArg& slot_mapping) {
  const MetalAttentionConfig& c = config_;
  check_token_heads(key, -1, c.num_kv_heads, c.head_size, c.dtype);
  const int64_t tokens = key.size(0);
  check_token_heads(value, tokens, c.num_kv_heads, c.head_size, c.dtype);
  const StoreRef kc = cache_ref(k_cache), vc = cache_ref(v_cache);
  const std::vector<int64_t> slots = check_slot_mapping(slot_mapping, tokens, c.num_blocks * c.block_size);
  if (tokens == 0) return;
  // staging holds key and value as contiguous [T, Hkv, D]
  const int64_t token_stride = c.num_kv_heads * c.head_size;
  const ReshapeAndCacheLaunch r = make_reshape_and_cache_launch(tokens, c.num_kv_heads, c.head_size, c.block_size,
                                                                c.num_blocks, token_stride, c.head_size, token_stride,
                                                                c.head_size);

  std::lock_guard<std::mutex> lock(mu_);
  const size_t kv_bytes = static_cast<size_t>(tokens * c.num_kv_heads * c.head_size) * elem_;
  Regions regions;
  const size_t key_at = regions.add(kv_bytes), value_at = regions.add(kv_bytes);
  const size_t slots_at = regions.add(static_cast<size_t>(tokens) * sizeof(int64_t));
  io_.reserve(*device_, regions.total);
  copy_rows(io_.data() + key_at, key, elem_, false);
  copy_rows(io_.data() + value_at, value, elem_, false);
  std::memcpy(io_.data() + slots_at, slots.data(), slots.size() * sizeof(int64_t));

  Dispatch d;
  d.pipeline = PipelineKey{MetalKernel::kReshapeAndCache, c.dtype, static_cast<int32_t>(c.head_size),
                           static_cast<int32_t>(c.block_size)};
  d.launch = r.launch;
  d.set_args(r.args);
  d.bind(1, io_.buffer(), key_at);
  d.bind(2, io_.buffer(), value_at);
  d.bind(3, kc.buffer.get(), kc.offset);
  d.bind(4, vc.buffer.get(), vc.offset);
  d.bind(5, io_.buffer(), slots_at);
  last_gpu_seconds_ = device_->run(&d, 1);
  ++command_buffers_;
}

void MetalAttention::upload_metadata(const MetalStepPlan& plan) {
  if (metadata_plan_ == plan.id()) return;
  const MetalAttentionPlan& p = plan.plan();
  const auto bytes = [](const std::vector<int32_t>& v) { return v.size() * sizeof(int32_t); };
  Regions regions;
  md_block_tables_ = regions.add(bytes(plan.block_tables()));
  md_seq_lens_ = regions.add(bytes(plan.seq_lens()));
  md_query_start_loc_ = regions.add(bytes(plan.query_start_loc()));
  md_decode_work_ = regions.add(bytes(p.decode_work));
  md_prefill_work_ = regions.add(bytes(p.prefill_work));
  metadata_plan_ = 0;  // not valid until the copies below are done
  metadata_.reserve(*device_, regions.total);
  unsigned char* base = metadata_.data();
  const auto put = [&](size_t at, const std::vector<int32_t>& v) {
    if (!v.empty()) std::memcpy(base + at, v.data(), bytes(v));
  };
  put(md_block_tables_, plan.block_tables());
  put(md_seq_lens_, plan.seq_lens());
  put(md_query_start_loc_, plan.query_start_loc());
  put(md_decode_work_, p.decode_work);
  put(md_prefill_work_, p.prefill_work);
  metadata_plan_ = plan.id();
  ++metadata_uploads_;
}

void MetalAttention::paged_attention(const TensorArg& out, const TensorArg& query, const TensorArg& k_cache,
                                     const TensorArg& v_cache, const MetalStepPlan& plan, float scale) {
  const MetalAttentionConfig& c = config_;
  const MetalAttentionPlan& p = plan.plan();
  const AttentionGeometry& g = p.geometry;
  if (g.num_heads != c.num_heads || g.num_kv_heads != c.num_kv_heads || g.head_dim != c.head_size ||
      g.block_size != c.block_size || g.num_blocks != c.num_blocks) {
    throw KernelArgumentError("the plan was made for another attention geometry than this backend's");
  }
  check_token_heads(query, g.num_tokens, c.num_heads, c.head_size, c.dtype);
  check_token_heads(out, g.num_tokens, c.num_heads, c.head_size, c.dtype);
  out.check_no_overlap();
  const StoreRef kc = cache_ref(k_cache), vc = cache_ref(v_cache);

  std::lock_guard<std::mutex> lock(mu_);
  if (g.num_tokens == 0) {
    last_gpu_seconds_ = 0.0;
    return;
  }
  upload_metadata(plan);
  const size_t qo_bytes = static_cast<size_t>(g.num_tokens * c.num_heads * c.head_size) * elem_;
  Regions io_regions;
  const size_t query_at = io_regions.add(qo_bytes), out_at = io_regions.add(qo_bytes);
  io_.reserve(*device_, io_regions.total);
  copy_rows(io_.data() + query_at, query, elem_, false);
  Regions scratch_regions;
  size_t partial_out_at = 0, partial_lse_at = 0;
  if (p.split) {
    partial_out_at = scratch_regions.add(p.partial_out_floats * sizeof(float));
    partial_lse_at = scratch_regions.add(p.partial_lse_floats * sizeof(float));
    scratch_.reserve(*device_, scratch_regions.total);
  }

  // staging holds query and out as contiguous [T, H, D]
  pm::PagedAttentionArgs decode_args = p.decode_args, prefill_args = p.prefill_args;
  for (pm::PagedAttentionArgs* a : {&decode_args, &prefill_args}) {
    a->scale = scale;
    a->query_token_stride = a->out_token_stride = static_cast<int32_t>(c.num_heads * c.head_size);
    a->query_head_stride = a->out_head_stride = static_cast<int32_t>(c.head_size);
  }
  const DeviceBuffer* io = io_.buffer();
  const DeviceBuffer* md = metadata_.buffer();
  const DeviceBuffer* dummy = dummy_.get();
  const auto meta = [&](size_t at, size_t count) -> BufferBinding {
    return count == 0 ? BufferBinding{dummy, 0} : BufferBinding{md, at};
  };
  const BufferBinding block_tables = meta(md_block_tables_, plan.block_tables().size());
  const BufferBinding seq_lens = meta(md_seq_lens_, plan.seq_lens().size());
  const BufferBinding qsl = meta(md_query_start_loc_, plan.query_start_loc().size());
  const BufferBinding decode_work = meta(md_decode_work_, p.decode_work.size());
  const BufferBinding prefill_work = meta(md_prefill_work_, p.prefill_work.size());
  const BufferBinding partial_out =
      p.split ? BufferBinding{scratch_.buffer(), partial_out_at} : BufferBinding{dummy, 0};
  const BufferBinding partial_lse =
      p.split ? BufferBinding{scratch_.buffer(), partial_lse_at} : BufferBinding{dummy, 0};
  const int32_t head_size = static_cast<int32_t>(c.head_size), block_size = static_cast<int32_t>(c.block_size);

  // Buffers 1-8 of the decode and prefill kernels (the same signature up to
  // their work lists; metal/paged_attention_{decode,prefill}.metal).
  const auto bind_attention_inputs = [&](Dispatch& d, const BufferBinding& work) {
    d.bind(1, io, query_at);
    d.bind(2, kc.buffer.get(), kc.offset);
    d.bind(3, vc.buffer.get(), vc.offset);
    d.bind(4, block_tables.buffer, block_tables.offset);
    d.bind(5, seq_lens.buffer, seq_lens.offset);
    d.bind(6, qsl.buffer, qsl.offset);
    d.bind(7, work.buffer, work.offset);
    d.bind(8, io, out_at);
  };

  Dispatch dispatches[3];
  size_t n = 0;
  if (!p.decode.empty()) {
    Dispatch& d = dispatches[n++];
    d.pipeline = PipelineKey{MetalKernel::kPagedAttentionDecode, c.dtype, head_size, block_size};
    d.launch = p.decode;
    d.set_args(decode_args);
    bind_attention_inputs(d, decode_work);
    d.bind(9, partial_out.buffer, partial_out.offset);
    d.bind(10, partial_lse.buffer, partial_lse.offset);
  }
  if (p.split && !p.merge.empty()) {
    Dispatch& d = dispatches[n++];
    d.pipeline = PipelineKey{MetalKernel::kPagedAttentionMerge, c.dtype, head_size, block_size};
    d.launch = p.merge;
    d.set_args(decode_args);
    d.bind(1, partial_out.buffer, partial_out.offset);
    d.bind(2, partial_lse.buffer, partial_lse.offset);
    d.bind(3, seq_lens.buffer, seq_lens.offset);
    d.bind(4, qsl.buffer, qsl.offset);
    d.bind(5, decode_work.buffer, decode_work.offset);
    d.bind(6, io, out_at);
  }
  if (!p.prefill.empty()) {
    Dispatch& d = dispatches[n++];
    d.pipeline = PipelineKey{MetalKernel::kPagedAttentionPrefill, c.dtype, head_size, block_size};
    d.launch = p.prefill;
    d.set_args(prefill_args);
    bind_attention_inputs(d, prefill_work);
  }
  last_gpu_seconds_ = device_->run(dispatches, n);
  ++command_buffers_;
  copy_rows(io_.data() + out_at, out, elem_, true);
}

double MetalAttention::last_gpu_seconds() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_gpu_seconds_;
}

StagingStats MetalAttention::staging_stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  StagingStats s;
  s.io_allocations = io_.allocations();
  s.metadata_allocations = metadata_.allocations();
  s.scratch_allocations = scratch_.allocations();
  s.io_bytes = io_.capacity();
  s.metadata_bytes = metadata_.capacity();
  s.scratch_bytes = scratch_.capacity();
  s.metadata_uploads = metadata_uploads_;
  s.command_buffers = command_buffers_;
  return s;
}

}  // namespace metal
}  // namespace pagedserve
