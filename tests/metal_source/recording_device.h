// A MetalDevice for the Linux tests of the Metal backend's host code
// (csrc/backends/metal/metal_attention.h): buffers are page-aligned host
// memory, and run() records every command buffer, checks each binding against
// the extent the kernel contract (metal/pagedserve_args.h) says the kernel
// reads or writes there, and executes the kernels' contract on the CPU in
// float32, float16 or bfloat16 (a naive reading of pagedserve_args.h, not the
// kernels' code: the Metal emulator in tests/metal_emu/ runs those). So the
// staging copies, the offsets, the argument packing and the plan's launches
// are tested end to end without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backends/metal/metal_device.h"

namespace pagedserve {
namespace metal {
namespace testing {

class HostBuffer final : public DeviceBuffer {
 public:
  explicit HostBuffer(size_t bytes);
  ~HostBuffer() override;
  void* contents() const override { return data_; }
  size_t size() const override { return size_; }

 private:
  void* data_;
  size_t size_;
};

class RecordingDevice final : public MetalDevice {
 public:
  DeviceInfo info() const override;
  std::shared_ptr<DeviceBuffer> new_shared_buffer(size_t bytes) override;
  // Records, checks every binding (throws std::logic_error naming the kernel,
  // the index and the overrun) and executes the kernels' contract.
  double run(const Dispatch* dispatches, size_t count) override;

  bool execute = true;
  bool record = true;  // keep every command buffer in command_buffers
  std::string library = "none";  // what info() reports as the kernel library
  size_t max_buffer_length = size_t{1} << 34;
  int64_t allocations = 0;                               // new_shared_buffer calls
  std::vector<std::vector<Dispatch>> command_buffers;    // every run(), empty launches included
};

}  // namespace testing
}  // namespace metal
}  // namespace pagedserve
