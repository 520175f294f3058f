// The kernels the Metal host dispatches and their host names: each kernel in
// metal/*.metal is instantiated for float, half and bfloat as
// "<kernel>_<type>" (e.g. "paged_attention_decode_half"). Plain C++ (no Metal
// types): tests/metal_source checks on every platform that the embedded source
// instantiates every name listed here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "backends/common/dtype.h"

namespace pagedserve {
namespace metal {

enum class MetalKernel : uint8_t {
  kReshapeAndCache,
  kPagedAttentionDecode,
  kPagedAttentionMerge,
  kPagedAttentionPrefill,
};

constexpr MetalKernel kMetalKernels[] = {MetalKernel::kReshapeAndCache, MetalKernel::kPagedAttentionDecode,
                                         MetalKernel::kPagedAttentionMerge, MetalKernel::kPagedAttentionPrefill};
// The cache dtypes the kernels are instantiated for (query and out share the cache's).
constexpr DType kMetalDTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

// "reshape_and_cache", "paged_attention_decode", ...
const char* metal_kernel_name(MetalKernel kernel);
// "float", "half", "bfloat". Throws KernelArgumentError for another dtype.
const char* metal_type_name(DType dtype);
// "<kernel>_<type>". Throws KernelArgumentError for a dtype the kernels lack.
std::string metal_kernel_host_name(MetalKernel kernel, DType dtype);
// Every host name the host code can dispatch (4 kernels x 3 dtypes).
std::vector<std::string> metal_dispatched_host_names();
// Bytes of one element (float32 4, float16/bfloat16 2, int32 4, int64 8).
size_t dtype_size(DType dtype);

}  // namespace metal
}  // namespace pagedserve
