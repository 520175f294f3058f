// The Metal device through metal-cpp: Apple only, and the only translation
// unit of the project that includes metal-cpp (and defines its private
// implementation). Kept thin: everything it is handed (grids, argument structs,
// buffer bindings) was planned and packed in plain C++ (metal_plan.cc,
// metal_attention.cc). Ownership follows metal-cpp's rules: objects from
// alloc/new/copy are released here; convenience objects (command buffers,
// encoders, strings, errors) are autoreleased, so every call that makes them
// runs inside its own NS::AutoreleasePool.
#define NS_PRIVATE_IMPLEMENTATION
#define MTL_PRIVATE_IMPLEMENTATION
#include <Foundation/Foundation.hpp>
#include <Metal/Metal.hpp>

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "core/errors.h"
#include "metal_device.h"
#include "metal_kernels.h"
#include "metal_library.h"
#include "metal_source.h"
#include "pagedserve_args.h"

namespace pagedserve {
namespace metal {

namespace pm = pagedserve_metal;

namespace {

// Owns one +1 reference of a metal-cpp object (from alloc/new/copy).
template <typename T>
class Owned {
 public:
  Owned() = default;
  explicit Owned(T* p) : p_(p) {}
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;
  ~Owned() { reset(); }
  void reset(T* p = nullptr) {
    if (p_ != nullptr) p_->release();
    p_ = p;
  }
  T* get() const { return p_; }
  T* operator->() const { return p_; }
  explicit operator bool() const { return p_ != nullptr; }

 private:
  T* p_ = nullptr;
};

// An autorelease pool for the duration of a scope.
class PoolScope {
 public:
  PoolScope() : pool_(NS::AutoreleasePool::alloc()->init()) {}
  PoolScope(const PoolScope&) = delete;
  PoolScope& operator=(const PoolScope&) = delete;
  ~PoolScope() { pool_->release(); }

 private:
  NS::AutoreleasePool* pool_;
};

std::string text(const NS::String* s) {
  return s != nullptr && s->utf8String() != nullptr ? std::string(s->utf8String()) : std::string();
}

std::string error_text(const NS::Error* e) {
  const std::string t = e != nullptr ? text(e->localizedDescription()) : std::string();
  return t.empty() ? "no description from Metal" : t;
}

NS::String* ns_string(const char* s) { return NS::String::string(s, NS::UTF8StringEncoding); }

class MtlBuffer final : public DeviceBuffer {
 public:
  explicit MtlBuffer(MTL::Buffer* buffer) : DeviceBuffer(buffer->length()), buffer_(buffer) {}
  ~MtlBuffer() override { buffer_->release(); }
  void* contents() const override { return buffer_->contents(); }
  size_t size() const override { return buffer_->length(); }
  MTL::Buffer* native() const { return buffer_; }

 private:
  MTL::Buffer* buffer_;
};

class MtlDevice final : public MetalDevice {
 public:
  MtlDevice() {
    PoolScope pool;
    device_.reset(MTL::CreateSystemDefaultDevice());
    if (!device_) throw PagedServeError("no Metal device: MTLCreateSystemDefaultDevice() found none");
    queue_.reset(device_->newCommandQueue());
    if (!queue_) throw PagedServeError("the Metal device gave no command queue");
    load_library();
  }

  ~MtlDevice() override {
    for (auto& entry : pipelines_) entry.second->release();
  }

  DeviceInfo info() const override {
    PoolScope pool;
    DeviceInfo i;
    i.name = text(device_->name());
    i.library = library_description_;
    i.max_buffer_length = device_->maxBufferLength();
    i.recommended_working_set = device_->recommendedMaxWorkingSetSize();
    i.unified_memory = device_->hasUnifiedMemory();
    return i;
  }

  std::shared_ptr<DeviceBuffer> new_shared_buffer(size_t bytes) override {
    const size_t limit = device_->maxBufferLength();
    if (bytes == 0 || bytes > limit) {
      throw std::runtime_error("cannot allocate a shared Metal buffer of " + std::to_string(bytes) +
                               " bytes: this device's limit for one buffer (maxBufferLength) is " +
                               std::to_string(limit) + " bytes");
    }
    MTL::Buffer* buffer = device_->newBuffer(bytes, MTL::ResourceStorageModeShared);
    if (buffer == nullptr) {
      throw std::runtime_error("the Metal device could not allocate a shared buffer of " + std::to_string(bytes) +
                               " bytes");
    }
    auto out = std::make_shared<MtlBuffer>(buffer);
    std::memset(out->contents(), 0, out->size());  // zeroed whatever the allocator did
    return out;
  }

  double run(const Dispatch* dispatches, size_t count) override {
    constexpr size_t kMaxDispatches = 8;
    if (count > kMaxDispatches) throw PagedServeError("too many dispatches for one Metal command buffer");
    // Everything that can fail is resolved before an encoder exists: an encoder
    // must be ended before its command buffer goes, so nothing may throw between.
    MTL::ComputePipelineState* pipelines[kMaxDispatches] = {};
    MTL::Buffer* buffers[kMaxDispatches][Dispatch::kMaxBuffers] = {};
    bool any = false;
    for (size_t i = 0; i < count; ++i) {
      const Dispatch& d = dispatches[i];
      if (d.launch.empty()) continue;
      pipelines[i] = pipeline(d.pipeline, d.launch.threads_per_threadgroup);
      for (int b = 1; b < d.num_buffers; ++b) {
        const auto* buffer = dynamic_cast<const MtlBuffer*>(d.buffers[b].buffer);
        if (buffer == nullptr) {
          throw PagedServeError(std::string("Metal kernel ") + metal_kernel_name(d.pipeline.kernel) +
                                ": buffer index " + std::to_string(b) + " is not bound to a Metal buffer");
        }
        buffers[i][b] = buffer->native();
      }
      any = true;
    }
    if (!any) return 0.0;

    PoolScope pool;
    MTL::CommandBuffer* command_buffer = queue_->commandBuffer();
    if (command_buffer == nullptr) throw PagedServeError("the Metal command queue gave no command buffer");
    MTL::ComputeCommandEncoder* encoder = command_buffer->computeCommandEncoder();  // serial dispatch
    if (encoder == nullptr) throw PagedServeError("the Metal command buffer gave no compute encoder");
    for (size_t i = 0; i < count; ++i) {
      const Dispatch& d = dispatches[i];
      if (pipelines[i] == nullptr) continue;
      encoder->setComputePipelineState(pipelines[i]);
      encoder->setBytes(d.args, d.args_size, 0);
      for (int b = 1; b < d.num_buffers; ++b) encoder->setBuffer(buffers[i][b], d.buffers[b].offset, b);
      encoder->dispatchThreadgroups(
          MTL::Size(d.launch.threadgroups[0], d.launch.threadgroups[1], d.launch.threadgroups[2]),
          MTL::Size(d.launch.threads_per_threadgroup, 1, 1));
    }
    encoder->endEncoding();
    command_buffer->commit();
    command_buffer->waitUntilCompleted();
    if (command_buffer->status() != MTL::CommandBufferStatusCompleted) {
      throw PagedServeError("a Metal command buffer failed: " + error_text(command_buffer->error()));
    }
    return command_buffer->GPUEndTime() - command_buffer->GPUStartTime();
  }

 private:
  // The pipeline for `key`, built and cached on first use. Throws PagedServeError.
  MTL::ComputePipelineState* pipeline(const PipelineKey& key, uint32_t threads) {
    std::lock_guard<std::mutex> lock(pipelines_mu_);
    auto it = pipelines_.find(key);
    if (it == pipelines_.end()) {
      PoolScope pool;
      const std::string name = metal_kernel_host_name(key.kernel, key.dtype);
      const std::string what = "Metal kernel " + name + " (head_size " + std::to_string(key.head_size) +
                               ", block_size " + std::to_string(key.block_size) + ")";
      Owned<MTL::FunctionConstantValues> constants(MTL::FunctionConstantValues::alloc()->init());
      const int32_t head_size = key.head_size, block_size = key.block_size;
      constants->setConstantValue(&head_size, MTL::DataTypeInt, NS::UInteger(pm::kFunctionConstantHeadSize));
      constants->setConstantValue(&block_size, MTL::DataTypeInt, NS::UInteger(pm::kFunctionConstantBlockSize));
      NS::Error* error = nullptr;
      Owned<MTL::Function> function(library_->newFunction(ns_string(name.c_str()), constants.get(), &error));
      if (!function) throw PagedServeError(what + " cannot be specialised: " + error_text(error));
      error = nullptr;
      MTL::ComputePipelineState* state = device_->newComputePipelineState(function.get(), &error);
      if (state == nullptr) throw PagedServeError(what + ": no compute pipeline: " + error_text(error));
      it = pipelines_.emplace(key, state).first;
    }
    const NS::UInteger most = it->second->maxTotalThreadsPerThreadgroup();
    if (threads > most) {
      throw PagedServeError("Metal kernel " + metal_kernel_host_name(key.kernel, key.dtype) + " runs at most " +
                            std::to_string(most) + " threads per threadgroup on this GPU; its launch needs " +
                            std::to_string(threads));
    }
    return it->second;
  }

  // The kernel library, from the first candidate that loads (metal_library.h).
  void load_library() {
    const std::vector<LibraryCandidate> candidates =
        library_candidates(std::getenv(kMetallibEnv), std::getenv(kForceSourceEnv), module_directories());
    std::vector<std::pair<LibraryCandidate, std::string>> failures;
    for (const LibraryCandidate& c : candidates) {
      std::string why;
      MTL::Library* library = c.kind == LibraryCandidate::Kind::kMetallib ? load_metallib(c.path, &why)
                                                                           : compile_source(&why);
      if (library != nullptr) {
        const std::string missing = missing_kernels(library);
        if (missing.empty()) {
          library_.reset(library);
          library_description_ = c.describe();
          return;
        }
        library->release();
        why = "it lacks kernels " + missing + " (built from other sources?)";
      }
      failures.emplace_back(c, why);
      if (c.required) break;
    }
    throw PagedServeError(library_failure_message(failures));
  }

  MTL::Library* load_metallib(const std::string& path, std::string* why) {
    if (access(path.c_str(), R_OK) != 0) {
      *why = "no such readable file";
      return nullptr;
    }
    PoolScope pool;
    NS::Error* error = nullptr;
    MTL::Library* library = device_->newLibrary(NS::URL::fileURLWithPath(ns_string(path.c_str())), &error);
    if (library == nullptr) *why = "Metal cannot load it: " + error_text(error);
    return library;
  }

  MTL::Library* compile_source(std::string* why) {
    if (kMetalKernelSource[0] == '\0') {
      *why = "this build embeds no kernel source";
      return nullptr;
    }
    PoolScope pool;
    Owned<MTL::CompileOptions> options(MTL::CompileOptions::alloc()->init());
    options->setFastMathEnabled(false);  // IEEE semantics, as the offline build (-fno-fast-math)
    options->setLanguageVersion(MTL::LanguageVersion3_1);  // bfloat
    NS::Error* error = nullptr;
    MTL::Library* library = device_->newLibrary(ns_string(kMetalKernelSource), options.get(), &error);
    if (library == nullptr) *why = "compiling it failed: " + error_text(error);
    return library;
  }

  // The dispatched host names `library` lacks, comma-separated ("" if none).
  static std::string missing_kernels(MTL::Library* library) {
    PoolScope pool;
    std::set<std::string> present;
    const NS::Array* names = library->functionNames();
    for (NS::UInteger i = 0; names != nullptr && i < names->count(); ++i) {
      present.insert(text(names->object<NS::String>(i)));
    }
    std::string missing;
    for (const std::string& n : metal_dispatched_host_names()) {
      if (present.count(n) == 0) missing += (missing.empty() ? "" : ", ") + n;
    }
    return missing;
  }

  Owned<MTL::Device> device_;
  Owned<MTL::CommandQueue> queue_;
  Owned<MTL::Library> library_;
  std::string library_description_;
  std::mutex pipelines_mu_;
  std::map<PipelineKey, MTL::ComputePipelineState*> pipelines_;
};

}  // namespace

std::shared_ptr<MetalDevice> open_metal_device() {
  static std::mutex mu;
  // Never destroyed: Metal objects are not released during process exit, when
  // the order of static destructors (and of the framework's own) is unknown.
  static auto* device = new std::shared_ptr<MetalDevice>();
  static auto* failure = new std::string();
  std::lock_guard<std::mutex> lock(mu);
  if (*device) return *device;
  if (!failure->empty()) throw PagedServeError(*failure);
  try {
    *device = std::make_shared<MtlDevice>();
  } catch (const std::exception& e) {
    *failure = std::string("Metal backend unavailable: ") + e.what();
    throw PagedServeError(*failure);
  }
  return *device;
}

}  // namespace metal
}  // namespace pagedserve
