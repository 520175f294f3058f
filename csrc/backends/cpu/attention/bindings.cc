// pybind11 bindings of the CPU attention backend (attention_cpu.h), added to
// the submodule pagedserve._core.cpu through binding_registry.h:
// reshape_and_cache, AttentionPlan, paged_attention_scratch_bytes.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>

#include "backends/cpu/attention/attention_cpu.h"
#include "binding_registry.h"

namespace py = pybind11;

namespace pagedserve {
namespace cpu {
namespace {

void bind_attention(py::module_& m) {
  m.def(
      "reshape_and_cache",
      [](py::handle key, py::handle value, py::handle k_cache, py::handle v_cache, py::handle slot_mapping,
         int num_threads) {
        auto k = tensor_arg(key, "key"), v = tensor_arg(value, "value");
        auto kc = tensor_arg(k_cache, "k_cache"), vc = tensor_arg(v_cache, "v_cache");
        auto sm = tensor_arg(slot_mapping, "slot_mapping");
        py::gil_scoped_release release;
        reshape_and_cache(k, v, kc, vc, sm, num_threads);
      },
      py::arg("key"), py::arg("value"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"),
      py::arg("num_threads") = 1,
      "Writes key/value [T, Hkv, D] into k_cache [N, Hkv, D, block_size] (transposed) and v_cache "
      "[N, Hkv, block_size, D] at slot_mapping [T] int64 (negative: skipped; of two tokens naming one slot the "
      "later wins), on up to num_threads threads when the call is large enough. Raises KernelArgumentError.");

  py::class_<AttentionPlan, std::shared_ptr<AttentionPlan>>(m, "AttentionPlan",
                                                            "One step's validated metadata and work partition.")
      .def(py::init([](py::handle qsl, py::handle seq_lens, py::handle block_tables, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks, bool causal,
                       int num_threads, int64_t sliding_window, bool split_kv) {
             auto q = tensor_arg(qsl, "query_start_loc"), s = tensor_arg(seq_lens, "seq_lens");
             auto t = tensor_arg(block_tables, "block_tables");
             return std::make_shared<AttentionPlan>(q, s, t, num_heads, num_kv_heads, head_dim, block_size,
                                                    num_blocks, causal, num_threads, sliding_window, split_kv);
           }),
           py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("block_tables"), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("block_size"), py::arg("num_blocks"),
           py::arg("causal") = true, py::arg("num_threads") = 1, py::arg("sliding_window") = 0,
           py::arg("split_kv") = false)
      .def_property_readonly("isa", [](const AttentionPlan& p) { return std::string(p.isa()); })
      .def_property_readonly("num_work_items", &AttentionPlan::num_work_items)
      .def_property_readonly("num_split_groups", &AttentionPlan::num_split_groups)
      .def_property_readonly("num_threads", &AttentionPlan::num_threads)
      .def_property_readonly("sliding_window", &AttentionPlan::sliding_window)
      .def_property_readonly("num_blocks_visited", &AttentionPlan::num_blocks_visited)
      .def_property_readonly("runs_inline", &AttentionPlan::runs_inline)
      .def_property_readonly("num_tokens", [](const AttentionPlan& p) { return p.geometry().num_tokens; })
      .def(
          "run",
          [](AttentionPlan& p, py::handle out, py::handle query, py::handle k_cache, py::handle v_cache,
             float scale, float softcap) {
            auto o = tensor_arg(out, "out"), q = tensor_arg(query, "query");
            auto kc = tensor_arg(k_cache, "k_cache"), vc = tensor_arg(v_cache, "v_cache");
            py::gil_scoped_release release;
            p.run(o, q, kc, vc, scale, softcap);
          },
          py::arg("out"), py::arg("query"), py::arg("k_cache"), py::arg("v_cache"), py::arg("scale"),
          py::arg("softcap") = 0.f,
          "out [T, H, D] = paged attention of query [T, H, D] over one layer's caches. Raises KernelArgumentError.");

  m.def("paged_attention_scratch_bytes", &paged_attention_scratch_bytes, py::arg("num_heads"),
        py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("block_size"),
        "Scratch bytes one worker of paged_attention uses, independent of sequence length.");
}

const BackendBinding registration("cpu", &bind_attention);

}  // namespace
}  // namespace cpu
}  // namespace pagedserve
