#include "metal_kernels.h"

#include <string>

#include "backends/common/tensor_arg.h"
#include "core/errors.h"

namespace pagedserve {
namespace metal {

const char* metal_kernel_name(MetalKernel kernel) {
  switch (kernel) {
    case MetalKernel::kReshapeAndCache: return "reshape_and_cache";
    case MetalKernel::kPagedAttentionDecode: return "paged_attention_decode";
    case MetalKernel::kPagedAttentionMerge: return "paged_attention_merge";
    case MetalKernel::kPagedAttentionPrefill: return "paged_attention_prefill";
  }
  return "?";
}

const char* metal_type_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float";
    case DType::kFloat16: return "half";
    case DType::kBFloat16: return "bfloat";
    default: break;
  }
  throw KernelArgumentError(std::string("the Metal kernels take float32, float16 or bfloat16, not ") +
                            dtype_name(dtype));
}

std::string metal_kernel_host_name(MetalKernel kernel, DType dtype) {
  return std::string(metal_kernel_name(kernel)) + "_" + metal_type_name(dtype);
}

std::vector<std::string> metal_dispatched_host_names() {
  std::vector<std::string> names;
  for (MetalKernel k : kMetalKernels) {
    for (DType d : kMetalDTypes) names.push_back(metal_kernel_host_name(k, d));
  }
  return names;
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kBFloat16: return 2;
    case DType::kFloat16: return 2;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kUInt8: return 1;
  }
  return 0;
}

}  // namespace metal
}  // namespace pagedserve
