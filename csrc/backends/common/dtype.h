// Element types of the tensors the kernels take (a plain enum: kernel
// translation units built for other ISAs include it, so it holds no inline code).
#pragma once

namespace pagedserve {

enum class DType { kFloat32, kBFloat16, kFloat16, kInt32, kInt64, kUInt8 };  // kUInt8: raw bytes (GGUF quantized blocks)

}  // namespace pagedserve
