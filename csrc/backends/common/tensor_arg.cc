#include "tensor_arg.h"

#include "core/errors.h"

namespace pagedserve {

const char* dtype_name(DType d) {
  switch (d) {
    case DType::kFloat32: return "float32";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
    case DType::kInt32: return "int32";
    case DType::kUInt8: return "uint8";
    default: return "int64";
  }
}

namespace {
std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}
}  // namespace

int64_t TensorArg::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

bool TensorArg::is_contiguous() const {
  if (numel() == 0) return true;  // nothing to lay out
  int64_t expect = 1;
  for (int64_t i = dim() - 1; i >= 0; --i) {
    if (shape[i] != 1 && strides[i] != expect) return false;
    expect *= shape[i];
  }
  return true;
}

void TensorArg::check_dim(int64_t d) const {
  if (dim() != d) {
    throw KernelArgumentError(name + " must have " + std::to_string(d) + " dimensions, got shape " +
                              shape_str(shape));
  }
}

void TensorArg::check_dtype(DType d) const {
  if (dtype != d) {
    throw KernelArgumentError(name + " must be " + dtype_name(d) + ", got " + dtype_name(dtype));
  }
}

void TensorArg::check_contiguous() const {
  if (!is_contiguous()) throw KernelArgumentError(name + " must be contiguous");
}

void TensorArg::check_last_dim_contiguous() const {
  if (dim() == 0 || (shape.back() > 1 && strides.back() != 1)) {
    throw KernelArgumentError(name + " must have a contiguous last dimension");
  }
}

void TensorArg::check_no_overlap() const {
  for (int64_t i = 0; i < dim(); ++i) {
    if (shape[i] > 1 && strides[i] == 0) {
      throw KernelArgumentError(name + " has overlapping elements (stride 0 in dimension " + std::to_string(i) +
                                "): it cannot be written");
    }
  }
}

void TensorArg::check_shape(const std::vector<int64_t>& want) const {
  if (shape != want) {
    throw KernelArgumentError(name + " must have shape " + shape_str(want) + ", got " + shape_str(shape));
  }
}

}  // namespace pagedserve
