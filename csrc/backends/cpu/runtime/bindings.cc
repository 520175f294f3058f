// pybind11 bindings of the CPU backend's runtime (features, the ISA registry,
// the thread pool, huge pages), added to the submodule pagedserve._core.cpu
// through binding_registry.h; each kernel family's folder binds its own
// functions there too, and python/pagedserve/kernels/cpu_core.py is their one
// Python caller.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>

#include "binding_registry.h"
#include "core/errors.h"
#include "backends/cpu/runtime/cpu_features.h"
#include "backends/cpu/runtime/isa_registry.h"
#include "backends/cpu/runtime/huge_pages.h"
#include "backends/cpu/runtime/thread_pool.h"

namespace py = pybind11;

namespace pagedserve {
namespace cpu {
namespace {

void bind_cpu(py::module_& m) {
  m.def(
      "cpu_features", [] { return cpu_features().names(); },
      "Names of the features of this CPU the kernels and the dtype choice care about "
      "(CPUID/XGETBV on x86-64: a feature the OS does not enable counts as absent).");
  m.def("cpu_arch", [] { return cpu_features().arch; }, "'x86_64', 'arm64' or 'other'.");
  m.def(
      "native_bf16", [] { return cpu_features().native_bf16(); },
      "True if the CPU has native bfloat16 arithmetic (avx512_bf16, AMX-BF16 or Arm BF16).");
  m.def(
      "compiled_isas",
      [] {
        py::list out;
        for (const IsaVariant& v : compiled_isas()) {
          out.append(py::make_tuple(v.name, v.supported(), v.requires_));
        }
        return out;
      },
      "[(name, supported on this CPU, what it needs)] of the kernel variants in this build, lowest ISA first.");
  m.def(
      "kernel_isa", [] { return std::string(active_isa().name); },
      "The kernel variant every family uses (the best supported, or PAGEDSERVE_CPU_ISA's). Raises InvalidArgumentError "
      "if PAGEDSERVE_CPU_ISA names a variant that is not compiled in or that this CPU cannot execute.");
  m.def("set_thread_pool_spin_us", &ThreadPool::set_spin_micros, py::arg("micros"),
        "How long the CPU kernels' idle workers and waiting callers poll before they sleep, in microseconds "
        "(process-wide; 0, the default, sleeps at once). Worth it when our kernels make a step's calls back to back "
        "(the quantised path); it takes cores from torch's OpenMP threads when torch's GEMMs run between them.");
  m.def("thread_pool_spin_us", &ThreadPool::spin_micros, "The current setting of set_thread_pool_spin_us.");
  m.def("set_kernel_isa", &set_active_isa, py::arg("name"),
        "Switches the kernel variant of every family (attention plans built afterwards, the fused ops and the "
        "GEMM use it). Raises InvalidArgumentError.");
  m.def(
      "kernel_tables",
      [](const std::optional<std::string>& name) {
        const IsaVariant* v = &active_isa();
        if (name) {
          v = nullptr;
          for (const IsaVariant& c : compiled_isas()) {
            if (*name == c.name) v = &c;
          }
          if (v == nullptr) throw InvalidArgumentError("kernel_tables: no compiled CPU kernel variant '" + *name + "'");
        }
        py::dict out;
        out["attention"] = table_name(*v, KernelFamily::kAttention);
        out["ops"] = table_name(*v, KernelFamily::kOps);
        out["gemm"] = table_name(*v, KernelFamily::kGemm);
        return out;
      },
      py::arg("name") = py::none(),
      "{'attention', 'ops', 'gemm'}: the table each kernel family runs with under the named compiled variant, or "
      "the active one (e.g. avx_vnni: attention 'avx2', gemm 'avx_vnni'). Raises InvalidArgumentError (a name "
      "not compiled in; for the active one as kernel_isa() does).");
  m.def(
      "variants_for",
      [](const std::string& family) {
        if (family == "attention") return variants_for(KernelFamily::kAttention);
        if (family == "ops") return variants_for(KernelFamily::kOps);
        if (family == "gemm") return variants_for(KernelFamily::kGemm);
        throw InvalidArgumentError("variants_for: family must be 'attention', 'ops' or 'gemm', got '" + family + "'");
      },
      py::arg("family"),
      "Names of the variants this CPU runs, lowest first, one per distinct table of the family ('attention', "
      "'ops' or 'gemm'): what a parity test runs to cover each compiled table once. Raises InvalidArgumentError.");

  m.def(
      "advise_huge_pages",
      [](uintptr_t address, int64_t nbytes) { return advise_huge_pages(reinterpret_cast<void*>(address), nbytes); },
      py::arg("address"), py::arg("nbytes"),
      "Asks the OS to back the whole 2 MiB pages inside [address, address + nbytes) (e.g. a fresh tensor's "
      "data_ptr() and its bytes, before anything writes it) with transparent huge pages: fewer TLB misses for "
      "memory a decode step streams through (the KV store). Returns the bytes advised (0 where the OS offers no "
      "such advice, or refuses it); the memory's contents are unchanged either way.");
  m.def("huge_pages_available", &huge_pages_available,
        "Whether the OS takes huge-page advice here (Linux with transparent huge pages not 'never').");
}

const BackendBinding registration("cpu", &bind_cpu);

}  // namespace
}  // namespace cpu
}  // namespace pagedserve
