// Test support for the C++ kernel tests: a TensorArg viewing a std::vector as
// a contiguous (row-major) tensor of the given shape.
#pragma once

#include <cstdint>
#include <vector>

#include "backends/common/tensor_arg.h"

namespace pagedserve {
namespace test_support {

template <typename T>
TensorArg arg(const std::vector<T>& v, std::vector<int64_t> shape, DType dtype, const char* name) {
  TensorArg a;
  a.data = const_cast<T*>(v.data());
  a.dtype = dtype;
  a.shape = shape;
  a.strides.assign(shape.size(), 1);
  for (size_t i = shape.size(); i-- > 1;) a.strides[i - 1] = a.strides[i] * shape[i];
  a.name = name;
  return a;
}

}  // namespace test_support
}  // namespace pagedserve
