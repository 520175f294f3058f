// TensorArg: a borrowed view of a tensor's memory (pointer, dtype, shape,
// strides in elements) so kernels take torch / numpy buffers without copying
// and without depending on torch. The bindings build it from a torch tensor.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dtype.h"

namespace pagedserve {

const char* dtype_name(DType d);

struct TensorArg {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // in elements
  std::string name;              // for error messages

  int64_t dim() const { return static_cast<int64_t>(shape.size()); }
  int64_t size(int i) const { return shape.at(i); }
  int64_t numel() const;
  bool is_contiguous() const;
  template <typename T>
  T* ptr() const { return static_cast<T*>(data); }

  // Each throws KernelArgumentError naming the tensor (argument checks shared
  // by every backend live here and in attention_checks.h).
  void check_dim(int64_t d) const;
  void check_dtype(DType d) const;
  void check_contiguous() const;
  void check_last_dim_contiguous() const;
  void check_no_overlap() const;  // for outputs: no dimension of size > 1 with stride 0
  void check_shape(const std::vector<int64_t>& want) const;
};

}  // namespace pagedserve
