// How a backend adds its functions to the pagedserve._core module without
// editing bindings.cc: its own bindings file (compiled into the module by the
// backend's CMakeLists) declares
//   static const pagedserve::BackendBinding reg("cpu", &bind_cpu);
// and bindings.cc calls every registered function with the submodule
// _core.<name> when the module is imported.
#pragma once

#include <pybind11/pybind11.h>

#include <vector>

#include "backends/common/tensor_arg.h"

namespace pagedserve {

using BindFn = void (*)(pybind11::module_& m);

struct BackendBinding {
  BackendBinding(const char* name, BindFn fn);
  const char* name;
  BindFn fn;
};

// Every backend registered so far (filled during static initialisation).
std::vector<const BackendBinding*>& backend_bindings();

// Wraps a CPU torch tensor's memory in a TensorArg without copying (no torch
// headers: the tensor's data_ptr / dtype / shape / stride are read). Throws
// KernelArgumentError for anything else.
TensorArg tensor_arg(const pybind11::handle& t, const char* name);

}  // namespace pagedserve
