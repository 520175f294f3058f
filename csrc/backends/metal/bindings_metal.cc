// pybind11 bindings of the Metal backend: the submodule pagedserve._core.metal
// (registered through binding_registry.h, present only in builds with
// PAGEDSERVE_METAL; pagedserve.kernels.metal wraps it). No Metal type appears
// here: the device is behind metal_device.h's opaque interface.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "binding_registry.h"
#include "core/errors.h"
#include "metal_attention.h"
#include "metal_device.h"
#include "metal_kernels.h"
#include "metal_library.h"
#include "metal_source.h"

namespace py = pybind11;

namespace pagedserve {
namespace metal {
namespace {

DType parse_dtype(const std::string& name) {
  std::string n = name.rfind("torch.", 0) == 0 ? name.substr(6) : name;
  if (n == "float32") return DType::kFloat32;
  if (n == "float16") return DType::kFloat16;
  if (n == "bfloat16") return DType::kBFloat16;
  throw KernelArgumentError("the Metal backend takes float32, float16 or bfloat16, not " + name);
}

SplitKv parse_split(const std::string& s) {
  if (s == "auto") return SplitKv::kAuto;
  if (s == "on") return SplitKv::kOn;
  if (s == "off") return SplitKv::kOff;
  throw KernelArgumentError("split must be 'auto', 'on' or 'off', got '" + s + "'");
}

py::tuple grid(const MetalLaunch& l) {
  return py::make_tuple(l.threadgroups[0], l.threadgroups[1], l.threadgroups[2], l.threads_per_threadgroup);
}

void bind_metal(py::module_& m) {
  m.def(
      "device_info",
      [] {
        std::shared_ptr<MetalDevice> device;
        {
          py::gil_scoped_release release;  // the first call may compile the kernel source
          device = open_metal_device();
        }
        const DeviceInfo i = device->info();
        py::dict d;
        d["name"] = i.name;
        d["library"] = i.library;
        d["max_buffer_length"] = i.max_buffer_length;
        d["recommended_working_set"] = i.recommended_working_set;
        d["unified_memory"] = i.unified_memory;
        return d;
      },
      "Opens the Metal device and its kernel library (once per process) and describes them: name, library "
      "(where the kernels came from), max_buffer_length, recommended_working_set, unified_memory. Raises "
      "PagedServeError saying why when there is no usable device or library.");
  m.def("kernel_host_names", &metal_dispatched_host_names,
        "Every kernel host name the host code dispatches (4 kernels x float/half/bfloat).");
  m.def(
      "embedded_kernel_names",
      [] {
        std::vector<std::string> names;
        for (int i = 0; i < kNumMetalKernelNames; ++i) names.emplace_back(kMetalKernelNames[i]);
        return names;
      },
      "The [[host_name]]s of the kernel source embedded in this build.");
  m.def(
      "embedded_source_files", [] { return std::string(kMetalSourceFiles); },
      "The metal/*.metal files embedded in this build, in order.");
  m.def(
      "library_candidates",
      [] {
        std::vector<std::string> out;
        for (const LibraryCandidate& c :
             library_candidates(std::getenv(kMetallibEnv), std::getenv(kForceSourceEnv), module_directories())) {
          out.push_back(c.describe());
        }
        return out;
      },
      "Where the kernel library would be looked for now, in order (PAGEDSERVE_METALLIB, the installed "
      ".metallib, the embedded source; PAGEDSERVE_METAL_SOURCE=1 forces the source).");
  m.def(
      "live_buffers", [] { return py::make_tuple(DeviceBuffer::live_count(), DeviceBuffer::live_bytes()); },
      "(count, bytes) of the shared Metal buffers alive in this process (KV stores, staging).");

  py::class_<DeviceBuffer, std::shared_ptr<DeviceBuffer>>(m, "SharedBuffer", py::buffer_protocol(),
                                                          "A shared-storage MTLBuffer exposed as writable bytes "
                                                          "(buffer protocol): torch.frombuffer views it without a "
                                                          "copy and keeps it alive while any view exists.")
      .def_buffer([](DeviceBuffer& b) {
        return py::buffer_info(b.contents(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.size())}, {static_cast<py::ssize_t>(1)}, false);
      })
      .def_property_readonly("nbytes", [](const DeviceBuffer& b) { return b.size(); })
      .def_property_readonly("address", [](const DeviceBuffer& b) { return reinterpret_cast<uintptr_t>(b.contents()); },
                             "The CPU address of the first byte (the GPU sees the same memory).");

  py::class_<MetalStepPlan, std::shared_ptr<MetalStepPlan>>(m, "Plan",
                                                            "One step's validated metadata and Metal launches.")
      .def_property_readonly("num_tokens", &MetalStepPlan::num_tokens)
      .def_property_readonly("split", [](const MetalStepPlan& p) { return p.plan().split; })
      .def_property_readonly("decode_items", [](const MetalStepPlan& p) { return p.plan().decode_work.size(); })
      .def_property_readonly("prefill_tiles", [](const MetalStepPlan& p) { return p.plan().prefill_work.size() / 2; })
      .def_property_readonly("max_partitions",
                             [](const MetalStepPlan& p) { return p.plan().decode_args.max_partitions; })
      .def_property_readonly("partition_size",
                             [](const MetalStepPlan& p) { return p.plan().decode_args.partition_size; })
      .def_property_readonly("decode_grid", [](const MetalStepPlan& p) { return grid(p.plan().decode); },
                             "(x, y, z, threads per threadgroup)")
      .def_property_readonly("merge_grid", [](const MetalStepPlan& p) { return grid(p.plan().merge); })
      .def_property_readonly("prefill_grid", [](const MetalStepPlan& p) { return grid(p.plan().prefill); });

  py::class_<MetalAttention, std::shared_ptr<MetalAttention>>(m, "Backend",
                                                              "The Metal attention kernels for one geometry and dtype.")
      .def(py::init([](int64_t num_heads, int64_t num_kv_heads, int64_t head_size, int64_t block_size,
                       int64_t num_blocks, const std::string& dtype) {
             MetalAttentionConfig c;
             c.num_heads = num_heads;
             c.num_kv_heads = num_kv_heads;
             c.head_size = head_size;
             c.block_size = block_size;
             c.num_blocks = num_blocks;
             c.dtype = parse_dtype(dtype);
             std::shared_ptr<MetalDevice> device;
             {
               py::gil_scoped_release release;
               device = open_metal_device();
             }
             return std::make_shared<MetalAttention>(std::move(device), c);
           }),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_size"), py::arg("block_size"),
           py::arg("num_blocks"), py::arg("dtype"),
           "dtype: 'float32', 'float16' or 'bfloat16'. Opens the device (device_info). Raises PagedServeError, "
           "KernelArgumentError.")
      .def_property_readonly("kv_cache_shape", &MetalAttention::kv_cache_shape,
                             "One layer's tensor: [2, num_blocks, num_kv_heads, block_size, head_size].")
      .def(
          "allocate_kv_store",
          [](MetalAttention& a, int64_t num_layers) {
            py::gil_scoped_release release;
            return a.allocate_kv_store(num_layers);
          },
          py::arg("num_layers"),
          "A zeroed SharedBuffer of num_layers x kv_cache_shape elements. Raises RuntimeError when the device "
          "cannot allocate it.")
      .def(
          "make_plan",
          [](MetalAttention& a, py::handle qsl, py::handle seq_lens, py::handle block_tables, bool causal,
             const std::string& split, int32_t partition_size, int32_t target_threadgroups) {
            auto q = tensor_arg(qsl, "query_start_loc"), s = tensor_arg(seq_lens, "seq_lens");
            auto t = tensor_arg(block_tables, "block_tables");
            MetalPlanOptions options;
            options.split = parse_split(split);
            options.partition_size = partition_size;
            options.target_threadgroups = target_threadgroups;
            return std::make_shared<MetalStepPlan>(a.config(), q, s, t, causal, options);
          },
          py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("block_tables"), py::arg("causal") = true,
          py::arg("split") = "auto", py::arg("partition_size") = 512, py::arg("target_threadgroups") = 64,
          "Validates the step's metadata and plans its launches (split: 'auto', 'on' or 'off' for split-KV "
          "decode). Raises KernelArgumentError.")
      .def(
          "reshape_and_cache",
          [](MetalAttention& a, py::handle key, py::handle value, py::handle k_cache, py::handle v_cache,
             py::handle slot_mapping) {
            auto k = tensor_arg(key, "key"), v = tensor_arg(value, "value");
            auto kc = tensor_arg(k_cache, "k_cache"), vc = tensor_arg(v_cache, "v_cache");
            auto sm = tensor_arg(slot_mapping, "slot_mapping");
            py::gil_scoped_release release;
            a.reshape_and_cache(k, v, kc, vc, sm);
          },
          py::arg("key"), py::arg("value"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"),
          "Writes key/value [T, Hkv, D] into the caches (views of a store from allocate_kv_store) at slot_mapping "
          "on the GPU. Raises KernelArgumentError.")
      .def(
          "paged_attention",
          [](MetalAttention& a, py::handle out, py::handle query, py::handle k_cache, py::handle v_cache,
             const MetalStepPlan& plan, float scale) {
            auto o = tensor_arg(out, "out"), q = tensor_arg(query, "query");
            auto kc = tensor_arg(k_cache, "k_cache"), vc = tensor_arg(v_cache, "v_cache");
            py::gil_scoped_release release;
            a.paged_attention(o, q, kc, vc, plan, scale);
          },
          py::arg("out"), py::arg("query"), py::arg("k_cache"), py::arg("v_cache"), py::arg("plan"),
          py::arg("scale"),
          "out [T, H, D] = paged attention of query [T, H, D] on the GPU. Raises KernelArgumentError.")
      .def_property_readonly("last_gpu_seconds", &MetalAttention::last_gpu_seconds,
                             "GPU time of the last call's command buffer (GPUEndTime - GPUStartTime), seconds.")
      .def_property_readonly(
          "staging_stats",
          [](const MetalAttention& a) {
            const StagingStats s = a.staging_stats();
            py::dict d;
            d["io_allocations"] = s.io_allocations;
            d["metadata_allocations"] = s.metadata_allocations;
            d["scratch_allocations"] = s.scratch_allocations;
            d["io_bytes"] = s.io_bytes;
            d["metadata_bytes"] = s.metadata_bytes;
            d["scratch_bytes"] = s.scratch_bytes;
            d["metadata_uploads"] = s.metadata_uploads;
            d["command_buffers"] = s.command_buffers;
            return d;
          },
          "Allocations and sizes of this instance's staging buffers, metadata uploads, command buffers run.");
}

const BackendBinding registration("metal", &bind_metal);

}  // namespace
}  // namespace metal
}  // namespace pagedserve
