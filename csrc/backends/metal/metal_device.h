// The Metal device as the rest of the backend sees it: opaque handles only, no
// NS:: or MTL:: type (ggml-metal's rule), so everything but metal_device.cc
// (Apple only, the one translation unit that includes metal-cpp) is plain C++
// that also compiles, and is tested, on Linux (tests/metal_source/ drives the
// host code through a recording implementation of this interface).
//
// What a MetalDevice does: hands out shared-storage buffers (CPU and GPU see
// the same memory: Apple silicon's unified memory), builds compute pipelines
// on demand (cached by kernel, dtype and function constants), and runs a list
// of dispatches as one command buffer, committed and waited on.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "backends/common/dtype.h"
#include "metal_kernels.h"
#include "metal_plan.h"

namespace pagedserve {
namespace metal {

// A shared-storage MTLBuffer: contents() is CPU-visible for the buffer's whole
// life (and page aligned), the GPU reads and writes the same bytes. Released
// when the last shared_ptr goes (the Python views of the KV store hold one).
class DeviceBuffer {
 public:
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  virtual ~DeviceBuffer();
  virtual void* contents() const = 0;
  virtual size_t size() const = 0;

  // Buffers alive in this process and their bytes (every implementation).
  static int64_t live_count();
  static int64_t live_bytes();

 protected:
  explicit DeviceBuffer(size_t bytes);

 private:
  size_t accounted_bytes_;
};

// A compute pipeline: one kernel for one dtype, specialised with the function
// constants head_size (index kFunctionConstantHeadSize) and block_size
// (kFunctionConstantBlockSize).
struct PipelineKey {
  MetalKernel kernel = MetalKernel::kReshapeAndCache;
  DType dtype = DType::kFloat32;
  int32_t head_size = 0;
  int32_t block_size = 0;
  bool operator<(const PipelineKey& o) const;
  bool operator==(const PipelineKey& o) const;
};

// A buffer bound at one index: (buffer, byte offset). Offsets are multiples of
// the element size the kernel reads there (every staging region is 256-byte aligned).
struct BufferBinding {
  const DeviceBuffer* buffer = nullptr;
  size_t offset = 0;
};

// One kernel launch: the argument struct (setBytes at index 0, by value), the
// buffers at indices 1..num_buffers-1, the grid from the plan. Fixed size: a
// layer call builds its dispatches without allocating.
struct Dispatch {
  static constexpr int kMaxBuffers = 11;    // paged_attention_decode binds 0..10
  static constexpr size_t kMaxArgBytes = 128;

  PipelineKey pipeline;
  MetalLaunch launch;
  alignas(16) unsigned char args[kMaxArgBytes] = {};
  uint32_t args_size = 0;
  BufferBinding buffers[kMaxBuffers];
  int num_buffers = 1;  // index 0 holds the args

  template <typename Args>
  void set_args(const Args& a) {
    static_assert(sizeof(Args) <= kMaxArgBytes, "argument struct too large for Dispatch");
    const auto* p = reinterpret_cast<const unsigned char*>(&a);
    for (size_t i = 0; i < sizeof(Args); ++i) args[i] = p[i];
    args_size = static_cast<uint32_t>(sizeof(Args));
  }
  void bind(int index, const DeviceBuffer* buffer, size_t offset) {
    buffers[index] = BufferBinding{buffer, offset};
    if (index + 1 > num_buffers) num_buffers = index + 1;
  }
};

// What the device reports about itself (pagedserve._core.metal.device_info()).
struct DeviceInfo {
  std::string name;                  // e.g. "Apple M2 Pro"
  std::string library;               // where the kernels came from: "metallib <path>" or "embedded source"
  uint64_t max_buffer_length = 0;    // bytes one MTLBuffer may hold
  uint64_t recommended_working_set = 0;
  bool unified_memory = false;
};

class MetalDevice {
 public:
  virtual ~MetalDevice() = default;
  virtual DeviceInfo info() const = 0;
  // A zero-filled shared buffer of at least `bytes` (> 0). Throws
  // std::runtime_error when the device cannot allocate it (past
  // max_buffer_length, or out of memory).
  virtual std::shared_ptr<DeviceBuffer> new_shared_buffer(size_t bytes) = 0;
  // Encodes the dispatches in order (skipping those whose grid is empty) into
  // one compute encoder of one command buffer (serial dispatch: each sees the
  // previous one's writes), commits it and waits until it completes. Builds
  // each pipeline on first use. Returns the GPU time of the command buffer
  // (GPUEndTime - GPUStartTime, seconds; 0 when nothing ran). Throws
  // PagedServeError when a pipeline cannot be built or the GPU reports an error.
  virtual double run(const Dispatch* dispatches, size_t count) = 0;
};

// The process's Metal device, opened on first call with its command queue and
// kernel library (loaded in metal_library.h's order). Throws PagedServeError
// saying why when there is none (no Metal GPU, no kernel library). Defined by
// metal_device.cc (Apple only); the Linux tests define their own.
std::shared_ptr<MetalDevice> open_metal_device();

}  // namespace metal
}  // namespace pagedserve
