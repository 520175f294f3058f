// pybind11 bindings: the only file that knows about Python. Names match the C++
// ones. SchedulerOutput arrays are exposed as numpy views into the C++ vectors
// (no copy); each view keeps its SchedulerOutput alive through its base object.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "attention_cpu.h"
#include "block_pool.h"
#include "block_table.h"
#include "errors.h"
#include "kv_cache_manager.h"
#include "scheduler.h"

namespace py = pybind11;
using namespace pagedserve;

namespace {

// An int32 numpy view of a vector owned by `owner` (writable so torch.from_numpy
// can wrap it without a copy; the vector is rebuilt by the next schedule()).
py::array view(const py::object& owner, const std::vector<int32_t>& v,
               std::vector<py::ssize_t> shape) {
  std::vector<py::ssize_t> strides(shape.size(), sizeof(int32_t));
  for (size_t i = shape.size(); i-- > 1;) strides[i - 1] = strides[i] * shape[i];
  return py::array(py::dtype::of<int32_t>(), shape, strides, v.data(), owner);
}

// A TensorArg borrowing a CPU torch tensor's memory (no copy, no torch headers:
// the tensor's own data_ptr / dtype / shape / stride are read).
TensorArg tensor_arg(const py::handle& t, const char* name) {
  if (!py::hasattr(t, "data_ptr") || !py::hasattr(t, "stride")) {
    throw KernelArgumentError(std::string(name) + " must be a torch tensor");
  }
  if (py::str(t.attr("device").attr("type")).cast<std::string>() != "cpu") {
    throw KernelArgumentError(std::string(name) + " must be a CPU tensor");
  }
  TensorArg a;
  a.name = name;
  const auto dtype = py::str(t.attr("dtype")).cast<std::string>();
  if (dtype == "torch.float32") a.dtype = DType::kFloat32;
  else if (dtype == "torch.bfloat16") a.dtype = DType::kBFloat16;
  else if (dtype == "torch.int32") a.dtype = DType::kInt32;
  else if (dtype == "torch.int64") a.dtype = DType::kInt64;
  else throw KernelArgumentError(std::string(name) + " has unsupported dtype " + dtype);
  a.shape = t.attr("shape").cast<std::vector<int64_t>>();
  a.strides = t.attr("stride")().cast<std::vector<int64_t>>();
  a.data = reinterpret_cast<void*>(t.attr("data_ptr")().cast<uintptr_t>());
  return a;
}

template <std::vector<int32_t> SchedulerOutput::*Field>
py::array flat_view(const py::object& self) {
  const auto& v = self.cast<const SchedulerOutput&>().*Field;
  return view(self, v, {static_cast<py::ssize_t>(v.size())});
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "PagedServe C++ core: block pool, block tables, KV cache manager, scheduler.";

  auto base = py::register_exception<PagedServeError>(m, "PagedServeError", PyExc_RuntimeError);
  py::register_exception<BlockPoolError>(m, "BlockPoolError", base.ptr());
  py::register_exception<OutOfBlocksError>(m, "OutOfBlocksError", base.ptr());
  py::register_exception<RequestRejectedError>(m, "RequestRejectedError", PyExc_ValueError);
  py::register_exception<UnknownRequestError>(m, "UnknownRequestError", PyExc_KeyError);
  py::register_exception<KernelArgumentError>(m, "KernelArgumentError", PyExc_ValueError);

  m.def(
      "reshape_and_cache",
      [](py::handle key, py::handle value, py::handle k_cache, py::handle v_cache, py::handle slot_mapping) {
        auto k = tensor_arg(key, "key"), v = tensor_arg(value, "value");
        auto kc = tensor_arg(k_cache, "k_cache"), vc = tensor_arg(v_cache, "v_cache");
        auto sm = tensor_arg(slot_mapping, "slot_mapping");
        py::gil_scoped_release release;
        reshape_and_cache(k, v, kc, vc, sm);
      },
      py::arg("key"), py::arg("value"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"),
      "Writes key/value [T, Hkv, D] into the paged caches [num_blocks, Hkv, block_size, D] at slot_mapping [T].");
  m.def(
      "paged_attention",
      [](py::handle out, py::handle query, py::handle k_cache, py::handle v_cache, py::handle query_start_loc,
         py::handle seq_lens, py::handle block_tables, float scale, bool causal, int num_threads) {
        auto o = tensor_arg(out, "out"), q = tensor_arg(query, "query");
        auto kc = tensor_arg(k_cache, "k_cache"), vc = tensor_arg(v_cache, "v_cache");
        auto qsl = tensor_arg(query_start_loc, "query_start_loc"), sl = tensor_arg(seq_lens, "seq_lens");
        auto bt = tensor_arg(block_tables, "block_tables");
        py::gil_scoped_release release;
        paged_attention(o, q, kc, vc, qsl, sl, bt, scale, causal, num_threads);
      },
      py::arg("out"), py::arg("query"), py::arg("k_cache"), py::arg("v_cache"), py::arg("query_start_loc"),
      py::arg("seq_lens"), py::arg("block_tables"), py::arg("scale"), py::arg("causal") = true,
      py::arg("num_threads") = 1,
      "out [T, H, D] = causal paged attention of query [T, H, D] (see csrc/attention_cpu.h).");
  m.def("paged_attention_scratch_bytes", &paged_attention_scratch_bytes, py::arg("num_heads"),
        py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("block_size"),
        "Scratch bytes one worker of paged_attention uses, independent of sequence length.");

  py::class_<BlockPool>(m, "BlockPool")
      .def(py::init<int32_t>(), py::arg("num_blocks"))
      .def_property_readonly("num_blocks", &BlockPool::num_blocks)
      .def_property_readonly("num_free_blocks", &BlockPool::num_free_blocks)
      .def("allocate", &BlockPool::allocate)
      .def("incref", &BlockPool::incref, py::arg("block_id"))
      .def("free", &BlockPool::free, py::arg("block_id"))
      .def("refcount", &BlockPool::refcount, py::arg("block_id"))
      .def("acquire", &BlockPool::acquire, py::arg("block_id"))
      .def("mark_cached", &BlockPool::mark_cached, py::arg("block_id"))
      .def_property_readonly("num_evictable_blocks", &BlockPool::num_evictable_blocks)
      .def_property_readonly("num_evictions", &BlockPool::num_evictions);

  py::class_<PrefixMatch>(m, "PrefixMatch")
      .def(py::init<>())
      .def_readonly("block_ids", &PrefixMatch::block_ids)
      .def("num_tokens", &PrefixMatch::num_tokens, py::arg("block_size"));

  py::class_<BlockTable>(m, "BlockTable")
      .def_property_readonly("block_size", &BlockTable::block_size)
      .def_property_readonly("block_ids", &BlockTable::block_ids)
      .def_property_readonly("num_blocks", &BlockTable::num_blocks)
      .def("slot", &BlockTable::slot, py::arg("position"));

  py::class_<KVCacheManager>(m, "KVCacheManager")
      .def(py::init<int32_t, int32_t, bool>(), py::arg("num_blocks"), py::arg("block_size"),
           py::arg("enable_prefix_caching") = false)
      .def_property_readonly("num_evictable_blocks", &KVCacheManager::num_evictable_blocks)
      .def_property_readonly("num_evictions", &KVCacheManager::num_evictions)
      .def("match_prefix", &KVCacheManager::match_prefix, py::arg("tokens"), py::arg("cache_salt") = "")
      .def("fork", &KVCacheManager::fork, py::arg("parent_seq_id"), py::arg("child_seq_id"))
      .def("take_pending_copies", &KVCacheManager::take_pending_copies)
      .def_property_readonly("num_cow_copies", &KVCacheManager::num_cow_copies)
      .def("cache_full_blocks", &KVCacheManager::cache_full_blocks, py::arg("seq_id"), py::arg("tokens"),
           py::arg("num_computed_tokens"))
      .def_property_readonly("block_size", &KVCacheManager::block_size)
      .def_property_readonly("num_blocks", &KVCacheManager::num_blocks)
      .def_property_readonly("num_free_blocks", &KVCacheManager::num_free_blocks)
      .def_property_readonly("usage", &KVCacheManager::usage)
      .def("can_allocate", &KVCacheManager::can_allocate, py::arg("num_tokens"),
           py::arg("match") = PrefixMatch{})
      .def("allocate", &KVCacheManager::allocate, py::arg("seq_id"), py::arg("num_tokens"),
           py::arg("match") = PrefixMatch{}, py::arg("cache_salt") = "")
      .def("can_append", &KVCacheManager::can_append, py::arg("seq_id"), py::arg("num_new_tokens"))
      .def("append", &KVCacheManager::append, py::arg("seq_id"), py::arg("num_new_tokens"))
      .def("free", &KVCacheManager::free, py::arg("seq_id"))
      .def("block_table", &KVCacheManager::block_table, py::arg("seq_id"),
           py::return_value_policy::copy)
      .def("num_tokens", &KVCacheManager::num_tokens, py::arg("seq_id"));

  py::enum_<FinishReason>(m, "FinishReason")
      .value("NONE", FinishReason::kNone)
      .value("STOP", FinishReason::kStop)
      .value("LENGTH", FinishReason::kLength)
      .value("ABORT", FinishReason::kAbort);

  py::class_<StopCriteria>(m, "StopCriteria")
      .def(py::init<>())
      .def(py::init([](int32_t max_tokens, bool ignore_eos, std::vector<int32_t> eos,
                       std::vector<int32_t> stop_ids) {
             return StopCriteria{max_tokens, ignore_eos, std::move(eos), std::move(stop_ids)};
           }),
           py::arg("max_tokens"), py::arg("ignore_eos") = false,
           py::arg("eos_token_ids") = std::vector<int32_t>{},
           py::arg("stop_token_ids") = std::vector<int32_t>{})
      .def_readwrite("max_tokens", &StopCriteria::max_tokens)
      .def_readwrite("ignore_eos", &StopCriteria::ignore_eos)
      .def_readwrite("eos_token_ids", &StopCriteria::eos_token_ids)
      .def_readwrite("stop_token_ids", &StopCriteria::stop_token_ids);

  py::class_<SchedulerConfig>(m, "SchedulerConfig")
      .def(py::init([](int32_t seqs, int32_t tokens, int32_t len, bool prefix) {
             return SchedulerConfig{seqs, tokens, len, prefix};
           }),
           py::arg("max_num_seqs") = 64, py::arg("max_num_batched_tokens") = 512,
           py::arg("max_model_len") = 2048, py::arg("enable_prefix_caching") = false)
      .def_readwrite("enable_prefix_caching", &SchedulerConfig::enable_prefix_caching)
      .def_readwrite("max_num_seqs", &SchedulerConfig::max_num_seqs)
      .def_readwrite("max_num_batched_tokens", &SchedulerConfig::max_num_batched_tokens)
      .def_readwrite("max_model_len", &SchedulerConfig::max_model_len);

  py::class_<PrefixCacheStats>(m, "PrefixCacheStats")
      .def_readonly("queries", &PrefixCacheStats::queries)
      .def_readonly("hits", &PrefixCacheStats::hits)
      .def_readonly("evictions", &PrefixCacheStats::evictions);

  py::class_<SchedulerOutput, std::shared_ptr<SchedulerOutput>>(m, "SchedulerOutput")
      .def_readonly("request_ids", &SchedulerOutput::request_ids)
      .def_readonly("preempted_request_ids", &SchedulerOutput::preempted_request_ids)
      .def_readonly("max_num_blocks_per_seq", &SchedulerOutput::max_num_blocks_per_seq)
      .def_property_readonly("num_seqs", &SchedulerOutput::num_seqs)
      .def_property_readonly("seq_indices", &flat_view<&SchedulerOutput::seq_indices>)
      .def_property_readonly("num_samples", &flat_view<&SchedulerOutput::num_samples>)
      .def_property_readonly("blocks_to_copy", [](const py::object& self) {
        const auto& o = self.cast<const SchedulerOutput&>();
        return view(self, o.blocks_to_copy, {static_cast<py::ssize_t>(o.num_block_copies()), 2});
      })
      .def_property_readonly("total_num_scheduled_tokens", &SchedulerOutput::total_num_scheduled_tokens)
      .def_property_readonly("empty", &SchedulerOutput::empty)
      .def_property_readonly("num_scheduled_tokens", &flat_view<&SchedulerOutput::num_scheduled_tokens>)
      .def_property_readonly("num_computed_tokens", &flat_view<&SchedulerOutput::num_computed_tokens>)
      .def_property_readonly("query_start_loc", &flat_view<&SchedulerOutput::query_start_loc>)
      .def_property_readonly("seq_lens", &flat_view<&SchedulerOutput::seq_lens>)
      .def_property_readonly("input_ids", &flat_view<&SchedulerOutput::input_ids>)
      .def_property_readonly("positions", &flat_view<&SchedulerOutput::positions>)
      .def_property_readonly("slot_mapping", &flat_view<&SchedulerOutput::slot_mapping>)
      .def_property_readonly("logits_indices", &flat_view<&SchedulerOutput::logits_indices>)
      .def_property_readonly("sampling_seq_indices", &flat_view<&SchedulerOutput::sampling_seq_indices>)
      .def_property_readonly("block_tables", [](const py::object& self) {
        const auto& o = self.cast<const SchedulerOutput&>();
        return view(self, o.block_tables,
                    {static_cast<py::ssize_t>(o.num_seqs()),
                     static_cast<py::ssize_t>(o.max_num_blocks_per_seq)});
      });

  py::class_<SequenceUpdate>(m, "SequenceUpdate")
      .def_readonly("request_id", &SequenceUpdate::request_id)
      .def_readonly("index", &SequenceUpdate::index)
      .def_readonly("token_id", &SequenceUpdate::token_id)
      .def_readonly("finish_reason", &SequenceUpdate::finish_reason)
      .def_readonly("num_cached_tokens", &SequenceUpdate::num_cached_tokens)
      .def_property_readonly("finished",
                             [](const SequenceUpdate& u) { return u.finish_reason != FinishReason::kNone; })
      .def_property_readonly("finish_reason_str",
                             [](const SequenceUpdate& u) -> py::object {
                               if (u.finish_reason == FinishReason::kNone) return py::none();
                               return py::str(finish_reason_str(u.finish_reason));
                             });

  py::class_<Scheduler>(m, "Scheduler")
      .def(py::init<const SchedulerConfig&, int32_t, int32_t>(), py::arg("config"),
           py::arg("num_blocks"), py::arg("block_size"))
      .def("add_request", &Scheduler::add_request, py::arg("request_id"),
           py::arg("prompt_token_ids"), py::arg("stop"), py::arg("cache_salt") = "", py::arg("n_seqs") = 1,
           py::arg("skip_reading_prefix_cache") = false)
      .def("finish_sequence", &Scheduler::finish_sequence, py::arg("request_id"), py::arg("index"),
           py::arg("reason"))
      .def_property_readonly("prefix_cache_stats", &Scheduler::prefix_cache_stats)
      .def("schedule", &Scheduler::schedule)
      .def("update", &Scheduler::update, py::arg("sampled_token_ids"))
      .def("finish_request", &Scheduler::finish_request, py::arg("request_id"), py::arg("reason"))
      .def("abort", &Scheduler::abort, py::arg("request_id"))
      .def("has_unfinished_requests", &Scheduler::has_unfinished_requests)
      .def_property_readonly("num_waiting", &Scheduler::num_waiting)
      .def_property_readonly("num_running", &Scheduler::num_running)
      .def_property_readonly("num_preemptions", &Scheduler::num_preemptions)
      .def("output_token_ids", &Scheduler::output_token_ids, py::arg("request_id"), py::arg("index") = 0)
      .def_property_readonly("kv_cache_manager", &Scheduler::kv_cache_manager,
                             py::return_value_policy::reference_internal)
      .def_property_readonly("config", &Scheduler::config);
}
