// The Metal backend's host side in plain C++ (no Metal types; it drives a
// MetalDevice, metal_device.h): the shared KV store, the per-step plan with
// its metadata, the staging buffers that carry query/out/key/value/metadata
// across, and the dispatch lists of each layer call. metal_plan.h sizes and
// packs; this file binds buffers and moves bytes. Compiled and tested on Linux
// through a recording device (tests/metal_source/).
//
// Per layer call (reshape_and_cache or paged_attention): the inputs are copied
// into shared staging buffers (allocated once per backend instance, grown
// geometrically when a step needs more, never per call), one command buffer
// runs the kernels and is waited on, and paged_attention copies the output out.
// The KV store itself is shared memory: no copy in or out, ever.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backends/common/tensor_arg.h"
#include "metal_device.h"
#include "metal_plan.h"

namespace pagedserve {
namespace metal {

// What one backend instance serves (pagedserve.kernels.backend.AttentionSpec).
struct MetalAttentionConfig {
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_size = 0;
  int64_t block_size = 0;
  int64_t num_blocks = 0;
  DType dtype = DType::kFloat32;  // cache, query and out
};

// One step's plan (make_metal_plan) with its own copy of the metadata the
// kernels read (block tables, seq_lens, query_start_loc): built once per step,
// shared by every layer, uploaded to the GPU-visible staging once (on the first
// layer that uses it).
class MetalStepPlan {
 public:
  // Validates the metadata (check_attention_metadata and the kernels' limits).
  // Throws KernelArgumentError.
  MetalStepPlan(const MetalAttentionConfig& config, const TensorArg& query_start_loc, const TensorArg& seq_lens,
                const TensorArg& block_tables, bool causal, const MetalPlanOptions& options = {});

  const MetalAttentionPlan& plan() const { return plan_; }
  uint64_t id() const { return id_; }
  int64_t num_tokens() const { return plan_.geometry.num_tokens; }
  const std::vector<int32_t>& query_start_loc() const { return query_start_loc_; }
  const std::vector<int32_t>& seq_lens() const { return seq_lens_; }
  const std::vector<int32_t>& block_tables() const { return block_tables_; }

 private:
  MetalAttentionPlan plan_;
  std::vector<int32_t> query_start_loc_, seq_lens_, block_tables_;
  uint64_t id_;
};

// A staging buffer: shared memory the CPU fills and the GPU reads (or the
// reverse). Grows to max(needed, 2 x current) when a call needs more; never
// shrinks; its old contents are not kept (every call refills what it uses).
class StagingBuffer {
 public:
  explicit StagingBuffer(std::string name) : name_(std::move(name)) {}
  void reserve(MetalDevice& device, size_t bytes);
  const DeviceBuffer* buffer() const { return buffer_.get(); }
  unsigned char* data() const;
  size_t capacity() const { return buffer_ ? buffer_->size() : 0; }
  int64_t allocations() const { return allocations_; }
  const std::string& name() const { return name_; }

  static constexpr size_t kMinBytes = 64 * 1024;

 private:
  std::string name_;
  std::shared_ptr<DeviceBuffer> buffer_;
  int64_t allocations_ = 0;
};

// Counters of one backend instance, for the tests ("no per-call allocation").
struct StagingStats {
  int64_t io_allocations = 0, metadata_allocations = 0, scratch_allocations = 0;
  size_t io_bytes = 0, metadata_bytes = 0, scratch_bytes = 0;
  int64_t metadata_uploads = 0;  // plans copied to the staging (once per plan unless plans alternate)
  int64_t command_buffers = 0;   // layer calls that ran on the GPU
};

// The KV store's buffer behind a tensor: (buffer, byte offset of the tensor's
// first element). Every store allocate_kv_store made and that is still alive
// can be found; anything else is a KernelArgumentError.
struct StoreRef {
  std::shared_ptr<DeviceBuffer> buffer;
  size_t offset = 0;
};
StoreRef find_kv_store(const void* data, size_t bytes, const std::string& name);

class MetalAttention {
 public:
  // Throws KernelArgumentError for a geometry the kernels do not take.
  MetalAttention(std::shared_ptr<MetalDevice> device, const MetalAttentionConfig& config);

  const MetalAttentionConfig& config() const { return config_; }
  MetalDevice& device() const { return *device_; }

  // One layer's tensor in this backend's layout: [2, num_blocks, Hkv, block_size, D].
  std::vector<int64_t> kv_cache_shape() const;
  // The whole store, num_layers x kv_cache_shape() elements of the dtype,
  // zeroed, in one shared buffer. Throws InvalidArgumentError for
  // num_layers < 1, std::runtime_error when the device cannot allocate it.
  std::shared_ptr<DeviceBuffer> allocate_kv_store(int64_t num_layers);

  // key/value [T, Hkv, D] (the cache dtype, last dimension contiguous, any
  // token/head strides) into k_cache/v_cache [num_blocks, Hkv, block_size, D]
  // (views of a store from allocate_kv_store) at slot_mapping [T] int64 (or
  // int32; negative: skip). Throws KernelArgumentError.
  void reshape_and_cache(const TensorArg& key, const TensorArg& value, const TensorArg& k_cache,
                         const TensorArg& v_cache, const TensorArg& slot_mapping);

  // out [T, H, D] = attention of query [T, H, D] (the cache dtype, last
  // dimension contiguous) over the layer's caches, for `plan`'s step.
  // Throws KernelArgumentError.
  void paged_attention(const TensorArg& out, const TensorArg& query, const TensorArg& k_cache,
                       const TensorArg& v_cache, const MetalStepPlan& plan, float scale);

  // GPU time of the last command buffer (seconds; 0 if the last call ran nothing).
  double last_gpu_seconds() const;
  StagingStats staging_stats() const;

 private:
  StoreRef cache_ref(const TensorArg& cache) const;
  void upload_metadata(const MetalStepPlan& plan);

  std::shared_ptr<MetalDevice> device_;
  MetalAttentionConfig config_;
  size_t elem_ = 0;
  mutable std::mutex mu_;  // one layer call at a time per instance (the staging is shared)
  StagingBuffer io_{"io"};           // query/out or key/value/slot_mapping of the current call
  StagingBuffer metadata_{"metadata"};  // the current plan's block tables, seq_lens, query_start_loc, work lists
  StagingBuffer scratch_{"scratch"};  // split-KV partial outputs and log-sum-exps (float32)
  std::shared_ptr<DeviceBuffer> dummy_;  // bound where a kernel reads nothing in this launch
  uint64_t metadata_plan_ = 0;  // id of the plan in metadata_ (0: none)
  size_t md_block_tables_ = 0, md_seq_lens_ = 0, md_query_start_loc_ = 0, md_decode_work_ = 0,
         md_prefill_work_ = 0;  // byte offsets in metadata_
  double last_gpu_seconds_ = 0.0;
  int64_t metadata_uploads_ = 0, command_buffers_ = 0;
};

}  // namespace metal
}  // namespace pagedserve
