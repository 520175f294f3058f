// pybind11 bindings of the core: with the backends' own bindings files
// (binding_registry.h) the only code that knows about Python. Names match the
// C++ ones. SchedulerOutput and ModelInput arrays are exposed as numpy views
// into the C++ vectors (no copy); each view keeps its owner alive through its
// base object. Every core error is a Python class deriving from
// PagedServeError and from the matching builtin (ValueError, KeyError).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <optional>
#include <string>
#include <type_traits>

#include "backends/common/attention_checks.h"
#include "backends/common/tensor_arg.h"
#include "binding_registry.h"
#include "core/block_pool.h"
#include "core/block_table.h"
#include "core/errors.h"
#include "core/kv_cache_manager.h"
#include "core/model_input.h"
#include "core/scheduler.h"

namespace py = pybind11;
using namespace pagedserve;

namespace pagedserve {

BackendBinding::BackendBinding(const char* n, BindFn f) : name(n), fn(f) { backend_bindings().push_back(this); }

std::vector<const BackendBinding*>& backend_bindings() {
  static std::vector<const BackendBinding*> all;
  return all;
}

TensorArg tensor_arg(const py::handle& t, const char* name) {
  // torch's singletons, looked up once: each check below is an identity test or
  // one attribute read (a decode step converts hundreds of tensors, so string
  // comparisons per tensor would show in one user's time per token)
  struct Torch {
    py::object tensor, strided, float32, bfloat16, float16, int32, int64, uint8;
  };
  static const Torch* torch_objs = [] {
    py::module_ torch = py::module_::import("torch");
    return new Torch{torch.attr("Tensor"), torch.attr("strided"), torch.attr("float32"), torch.attr("bfloat16"),
                     torch.attr("float16"), torch.attr("int32"), torch.attr("int64"), torch.attr("uint8")};
  }();
  const Torch& T = *torch_objs;
  if (!py::isinstance(t, T.tensor)) throw KernelArgumentError(std::string(name) + " must be a torch tensor");
  const py::object layout = t.attr("layout");
  if (!layout.is(T.strided)) {
    throw KernelArgumentError(std::string(name) + " must be a dense (strided) tensor, got layout " +
                              py::str(layout).cast<std::string>());
  }
  if (t.attr("is_neg")().cast<bool>() || t.attr("is_conj")().cast<bool>()) {
    throw KernelArgumentError(std::string(name) + " is a lazy negated or conjugated view: materialise it first");
  }
  if (!t.attr("is_cpu").cast<bool>()) throw KernelArgumentError(std::string(name) + " must be a CPU tensor");
  TensorArg a;
  a.name = name;
  const py::object dtype = t.attr("dtype");
  if (dtype.is(T.float32)) a.dtype = DType::kFloat32;
  else if (dtype.is(T.bfloat16)) a.dtype = DType::kBFloat16;
  else if (dtype.is(T.float16)) a.dtype = DType::kFloat16;
  else if (dtype.is(T.int32)) a.dtype = DType::kInt32;
  else if (dtype.is(T.int64)) a.dtype = DType::kInt64;
  else if (dtype.is(T.uint8)) a.dtype = DType::kUInt8;
  else throw KernelArgumentError(std::string(name) + " has unsupported dtype " + py::str(dtype).cast<std::string>());
  a.shape = t.attr("shape").cast<std::vector<int64_t>>();
  a.strides = t.attr("stride")().cast<std::vector<int64_t>>();
  a.data = reinterpret_cast<void*>(t.attr("data_ptr")().cast<uintptr_t>());
  return a;
}

}  // namespace pagedserve

namespace {

// A BlockHash as the 32 Python bytes every binding hands out (events, hash_block, cached_block_hashes).
py::bytes hash_bytes(const BlockHash& h) { return py::bytes(reinterpret_cast<const char*>(h.data()), h.size()); }

// A numpy view of a vector owned by `owner`. SchedulerOutput's views are
// read-only (C++ reads them again in build_model_input); ModelInput's are
// writable only so torch.from_numpy can wrap them without a copy.
template <typename T>
py::array view(const py::object& owner, const std::vector<T>& v, std::vector<py::ssize_t> shape, bool writable) {
  std::vector<py::ssize_t> strides(shape.size(), sizeof(T));
  for (size_t i = shape.size(); i-- > 1;) strides[i - 1] = strides[i] * shape[i];
  py::array a(py::dtype::of<T>(), shape, strides, v.data(), owner);
  if (!writable) a.attr("setflags")(py::arg("write") = false);
  return a;
}

template <typename Owner, typename T, std::vector<T> Owner::*Field>
py::array flat_view(const py::object& self) {
  const auto& v = self.cast<const Owner&>().*Field;
  return view(self, v, {static_cast<py::ssize_t>(v.size())}, std::is_same_v<Owner, ModelInput>);
}

// One Python exception class per core error: pagedserve._core.<name>, derived
// from every class in `bases`.
PyObject* make_error(py::module_& m, const char* name, std::initializer_list<PyObject*> bases, const char* doc) {
  py::tuple b(bases.size());
  size_t i = 0;
  for (PyObject* base : bases) b[i++] = py::handle(base);
  const std::string full = std::string("pagedserve._core.") + name;
  PyObject* cls = PyErr_NewExceptionWithDoc(full.c_str(), doc, b.ptr(), nullptr);
  if (cls == nullptr) throw py::error_already_set();
  m.add_object(name, py::handle(cls));
  return cls;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "PagedServe C++ core: block pool, block tables, KV cache manager, scheduler; backends as submodules.";

  static PyObject* const base = make_error(m, "PagedServeError", {PyExc_Exception},
                                           "Base class of every error the PagedServe core raises on purpose.");
  static PyObject* const block_pool = make_error(m, "BlockPoolError", {base},
                                                 "A block id out of range, freed twice or used after free.");
  static PyObject* const out_of_blocks = make_error(m, "OutOfBlocksError", {base},
                                                    "No free KV block: allocate/append without can_allocate/can_append.");
  static PyObject* const rejected = make_error(m, "RequestRejectedError", {base, PyExc_ValueError},
                                               "A request that can never be served.");
  static PyObject* const unknown = make_error(m, "UnknownRequestError", {base, PyExc_KeyError},
                                              "A request or sequence id the core does not hold.");
  static PyObject* const invalid = make_error(m, "InvalidArgumentError", {base, PyExc_ValueError},
                                              "An argument that breaks a documented precondition.");
  static PyObject* const kernel_arg = make_error(m, "KernelArgumentError", {base, PyExc_ValueError},
                                                 "A kernel argument with a wrong shape, dtype, layout or index.");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const BlockPoolError& e) {
      PyErr_SetString(block_pool, e.what());
    } catch (const OutOfBlocksError& e) {
      PyErr_SetString(out_of_blocks, e.what());
    } catch (const RequestRejectedError& e) {
      PyErr_SetString(rejected, e.what());
    } catch (const UnknownRequestError& e) {
      PyErr_SetString(unknown, e.what());
    } catch (const InvalidArgumentError& e) {
      PyErr_SetString(invalid, e.what());
    } catch (const KernelArgumentError& e) {
      PyErr_SetString(kernel_arg, e.what());
    } catch (const PagedServeError& e) {
      PyErr_SetString(base, e.what());
    }
  });

  m.def(
      "check_attention_metadata",
      [](py::handle qsl, py::handle seq_lens, py::handle block_tables, int64_t num_heads, int64_t num_kv_heads,
         int64_t head_dim, int64_t block_size, int64_t num_blocks) {
        auto q = tensor_arg(qsl, "query_start_loc"), s = tensor_arg(seq_lens, "seq_lens");
        auto t = tensor_arg(block_tables, "block_tables");
        return check_attention_metadata(q, s, t, num_heads, num_kv_heads, head_dim, block_size, num_blocks)
            .num_tokens;
      },
      py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("block_tables"), py::arg("num_heads"),
      py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("block_size"), py::arg("num_blocks"),
      "The attention-metadata checks every backend shares (csrc/backends/common/attention_checks.h) on host "
      "int32 tensors; returns the number of query tokens. Raises KernelArgumentError.");

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
      .def(
          "cached_block_hashes",
          [](const KVCacheManager& kv) {
            py::list out;
            for (const BlockHash& h : kv.cached_block_hashes()) out.append(hash_bytes(h));
            return out;
          },
          "The 32-byte hashes (hash_block's) of every block the prefix cache holds, in use or evictable, "
          "unordered: what a replica reports to a prefix-aware router.")
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
      .def("num_tokens", &KVCacheManager::num_tokens, py::arg("seq_id"))
      .def("block_map", [](const KVCacheManager& kv) {
             // (states uint8 [N], refcounts int32 [N], hash_prefixes uint64 [N]), copies as numpy arrays
             KVBlockMap map = kv.block_map();
             return py::make_tuple(py::array_t<uint8_t>(map.states.size(), map.states.data()),
                                   py::array_t<int32_t>(map.refcounts.size(), map.refcounts.data()),
                                   py::array_t<uint64_t>(map.hash_prefixes.size(), map.hash_prefixes.data()));
           },
           "The pool block by block: (states [num_blocks] uint8: 0 free, 1 evictable (cached, refcount 0), 2 in "
           "use, 3 in use and cached; refcounts [num_blocks] int32; hash_prefixes [num_blocks] uint64, the first 8 "
           "bytes of each block's prefix-cache hash, 0 for none)");

  py::enum_<FinishReason>(m, "FinishReason")
      .value("NONE", FinishReason::kNone)
      .value("STOP", FinishReason::kStop)
      .value("LENGTH", FinishReason::kLength)
      .value("ABORT", FinishReason::kAbort);

  py::enum_<CallerFinish>(m, "CallerFinish",
                          "What the caller of Scheduler.update found for one sampled token: NONE; STOP (a stop "
                          "string, a grammar's end, a pooled prompt: the sequence ends with STOP); "
                          "STOP_IF_FINISHED (a stop string completes in held-back text: LENGTH becomes STOP)")
      .value("NONE", CallerFinish::kNone)
      .value("STOP", CallerFinish::kStop)
      .value("STOP_IF_FINISHED", CallerFinish::kStopIfFinished);

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

  const SchedulerConfig defaults;  // the project's defaults live in the C++ struct
  py::class_<SchedulerConfig>(m, "SchedulerConfig")
      .def(py::init([](int32_t seqs, int32_t tokens, int32_t len, bool prefix, const std::string& policy,
                       double watermark, double high_watermark) {
             return SchedulerConfig{seqs, tokens, len, prefix, parse_scheduling_policy(policy), watermark,
                                    high_watermark};
           }),
           py::arg("max_num_seqs") = defaults.max_num_seqs,
           py::arg("max_num_batched_tokens") = defaults.max_num_batched_tokens,
           py::arg("max_model_len") = defaults.max_model_len,
           py::arg("enable_prefix_caching") = defaults.enable_prefix_caching,
           py::arg("policy") = scheduling_policy_name(defaults.policy),
           py::arg("watermark") = defaults.watermark,
           py::arg("high_watermark") = defaults.high_watermark)
      .def_readwrite("enable_prefix_caching", &SchedulerConfig::enable_prefix_caching)
      .def_readwrite("max_num_seqs", &SchedulerConfig::max_num_seqs)
      .def_readwrite("max_num_batched_tokens", &SchedulerConfig::max_num_batched_tokens)
      .def_readwrite("max_model_len", &SchedulerConfig::max_model_len)
      .def_property(
          "policy", [](const SchedulerConfig& c) { return std::string(scheduling_policy_name(c.policy)); },
          [](SchedulerConfig& c, const std::string& name) { c.policy = parse_scheduling_policy(name); },
          "'fcfs', 'priority' or 'memory-aware' (scheduling_policy.h)")
      .def_readwrite("watermark", &SchedulerConfig::watermark)
      .def_readwrite("high_watermark", &SchedulerConfig::high_watermark);
  m.attr("SCHEDULING_POLICIES") = py::make_tuple(scheduling_policy_name(SchedulingPolicy::kFcfs),
                                                 scheduling_policy_name(SchedulingPolicy::kPriority),
                                                 scheduling_policy_name(SchedulingPolicy::kMemoryAware));

  py::class_<PrefixCacheStats>(m, "PrefixCacheStats")
      .def_readonly("queries", &PrefixCacheStats::queries)
      .def_readonly("hits", &PrefixCacheStats::hits)
      .def_readonly("evictions", &PrefixCacheStats::evictions);

  using SO = SchedulerOutput;
  py::class_<SO, std::shared_ptr<SO>>(m, "SchedulerOutput")
      .def_readonly("block_size", &SO::block_size)
      .def_readonly("request_ids", &SO::request_ids)
      .def_readonly("preempted_request_ids", &SO::preempted_request_ids)
      .def_readonly("preemption_reasons", &SO::preemption_reasons)
      .def_property_readonly("num_seqs", &SO::num_seqs)
      .def_property_readonly("total_num_scheduled_tokens", &SO::total_num_scheduled_tokens)
      .def_property_readonly("empty", &SO::empty)
      .def_property_readonly("seq_indices", &flat_view<SO, int32_t, &SO::seq_indices>)
      .def_property_readonly("num_scheduled_tokens", &flat_view<SO, int32_t, &SO::num_scheduled_tokens>)
      .def_property_readonly("num_computed_tokens", &flat_view<SO, int32_t, &SO::num_computed_tokens>)
      .def_property_readonly("num_draft_tokens", &flat_view<SO, int32_t, &SO::num_draft_tokens>)
      .def_property_readonly("token_ids", &flat_view<SO, int32_t, &SO::token_ids>)
      .def_property_readonly("block_ids", &flat_view<SO, int32_t, &SO::block_ids>)
      .def_property_readonly("block_table_offsets", &flat_view<SO, int32_t, &SO::block_table_offsets>)
      .def_property_readonly("sampling_seq_indices", &flat_view<SO, int32_t, &SO::sampling_seq_indices>)
      .def_property_readonly("num_samples", &flat_view<SO, int32_t, &SO::num_samples>)
      .def_property_readonly("blocks_to_copy", [](const py::object& self) {
        const auto& o = self.cast<const SO&>();
        return view(self, o.blocks_to_copy, {static_cast<py::ssize_t>(o.num_block_copies()), 2}, false);
      });

  using MI = ModelInput;
  py::class_<MI, std::shared_ptr<MI>>(m, "ModelInput")
      .def(py::init([](const SO& out) { return std::make_shared<MI>(build_model_input(out)); }),
           py::arg("scheduler_output"), "Lays a SchedulerOutput out as the step's flat varlen batch.")
      .def_property_readonly("num_seqs", &MI::num_seqs)
      .def_property_readonly("num_tokens", &MI::num_tokens)
      .def_readonly("max_num_blocks_per_seq", &MI::max_num_blocks_per_seq)
      .def_property_readonly("input_ids", &flat_view<MI, int64_t, &MI::input_ids>)
      .def_property_readonly("positions", &flat_view<MI, int64_t, &MI::positions>)
      .def_property_readonly("query_start_loc", &flat_view<MI, int32_t, &MI::query_start_loc>)
      .def_property_readonly("seq_lens", &flat_view<MI, int32_t, &MI::seq_lens>)
      .def_property_readonly("slot_mapping", &flat_view<MI, int64_t, &MI::slot_mapping>)
      .def_property_readonly("logits_indices", &flat_view<MI, int64_t, &MI::logits_indices>)
      .def_property_readonly("block_tables", [](const py::object& self) {
        const auto& o = self.cast<const MI&>();
        return view(self, o.block_tables,
                    {static_cast<py::ssize_t>(o.num_seqs()), static_cast<py::ssize_t>(o.max_num_blocks_per_seq)},
                    true);
      })
      .def_property_readonly("blocks_to_copy", [](const py::object& self) {
        const auto& o = self.cast<const MI&>();
        return view(self, o.blocks_to_copy, {static_cast<py::ssize_t>(o.blocks_to_copy.size() / 2), 2}, true);
      });

  // Read-only: Python keeps a choice's record (SequenceUpdate.sequence) and reads its tokens from it.
  py::class_<Sequence, std::shared_ptr<Sequence>>(m, "Sequence")
      .def_readonly("request_id", &Sequence::request_id)
      .def_readonly("index", &Sequence::index)
      .def_readonly("num_prompt_tokens", &Sequence::num_prompt_tokens)
      .def_readonly("finish_reason", &Sequence::finish_reason)
      .def_property_readonly("num_output_tokens", &Sequence::num_output_tokens)
      .def_property_readonly("output_token_ids", &Sequence::output_token_ids);

  py::class_<SequenceUpdate>(m, "SequenceUpdate")
      .def_readonly("request_id", &SequenceUpdate::request_id)
      .def_readonly("index", &SequenceUpdate::index)
      .def_readonly("token_id", &SequenceUpdate::token_id)
      .def_readonly("finish_reason", &SequenceUpdate::finish_reason)
      .def_readonly("num_cached_tokens", &SequenceUpdate::num_cached_tokens)
      .def_property_readonly("sequence",
                             [](const SequenceUpdate& u) { return std::const_pointer_cast<Sequence>(u.sequence); })
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
           py::arg("skip_reading_prefix_cache") = false, py::arg("priority") = 0)
      .def("finish_sequence", &Scheduler::finish_sequence, py::arg("request_id"), py::arg("index"),
           py::arg("reason"))
      .def_property_readonly("prefix_cache_stats", &Scheduler::prefix_cache_stats)
      .def("schedule", &Scheduler::schedule)
      .def("update", &Scheduler::update, py::arg("sampled_token_ids"),
           py::arg("finished_by_caller") = std::vector<CallerFinish>{})
      .def("add_draft_tokens", &Scheduler::add_draft_tokens, py::arg("request_id"), py::arg("index"),
           py::arg("draft"))
      .def("accept_draft_tokens", &Scheduler::accept_draft_tokens, py::arg("request_id"), py::arg("index"),
           py::arg("num_accepted"))
      .def_property_readonly("num_draft_tokens", &Scheduler::num_draft_tokens)
      .def_property_readonly("num_accepted_tokens", &Scheduler::num_accepted_tokens)
      .def("finish_request", &Scheduler::finish_request, py::arg("request_id"), py::arg("reason"))
      .def("abort", &Scheduler::abort, py::arg("request_id"))
      .def("has_unfinished_requests", &Scheduler::has_unfinished_requests)
      .def_property_readonly("num_waiting", &Scheduler::num_waiting)
      .def_property_readonly("num_running", &Scheduler::num_running)
      .def_property_readonly("num_preemptions", &Scheduler::num_preemptions)
      .def_property_readonly("mean_output_tokens", &Scheduler::mean_output_tokens)
      .def("output_token_ids", &Scheduler::output_token_ids, py::arg("request_id"), py::arg("index") = 0)
      .def_property("record_kv_events", &Scheduler::record_kv_events, &Scheduler::set_record_kv_events,
                    "Whether the KV cache records KVCacheEvents (off by default).")
      .def("take_kv_events", &Scheduler::take_kv_events,
           "The KVCacheEvents recorded since the last call, in order (the list is cleared).")
      .def_property_readonly("kv_cache_manager", &Scheduler::kv_cache_manager,
                             py::return_value_policy::reference_internal)
      .def_property_readonly("config", &Scheduler::config)
      .def("block_owners", &Scheduler::block_owners);

  py::class_<KVCacheEvent>(m, "KVCacheEvent",
                           "One KV-cache event (csrc/core/kv_events.h; vLLM's schema, docs/kv-events.md).")
      .def_property_readonly("type", [](const KVCacheEvent& e) { return std::string(kv_event_type_str(e.type)); },
                             "'BlockStored', 'BlockRemoved' or 'AllBlocksCleared'.")
      .def_property_readonly(
          "block_hashes",
          [](const KVCacheEvent& e) {
            py::list out;
            for (const BlockHash& h : e.block_hashes) out.append(hash_bytes(h));
            return out;
          },
          "The blocks' chained SHA-256 hashes (32 bytes each, hash_block's value), in chain order.")
      .def_property_readonly(
          "parent_block_hash",
          [](const KVCacheEvent& e) -> py::object {
            if (!e.has_parent) return py::none();
            return hash_bytes(e.parent_block_hash);
          },
          "BlockStored: the hash of the block before the first one (None for a prompt's first block).")
      .def_readonly("token_ids", &KVCacheEvent::token_ids, "BlockStored: block_size tokens per block, in order.")
      .def_readonly("block_size", &KVCacheEvent::block_size, "BlockStored: tokens per block (0 otherwise).");

  m.def(
      "hash_block",
      [](const std::optional<std::string>& parent, const std::vector<int32_t>& token_ids,
                   const std::string& extra_key) {
        BlockHash p{};
        if (parent) {
          if (parent->size() != p.size()) {
            throw InvalidArgumentError("hash_block: parent must be 32 bytes, got " + std::to_string(parent->size()));
          }
          std::copy(parent->begin(), parent->end(), p.begin());
        }
        return hash_bytes(PrefixCache::hash_block(parent ? &p : nullptr, token_ids.data(),
                                                  static_cast<int32_t>(token_ids.size()), extra_key));
      },
      py::arg("parent"), py::arg("token_ids"), py::arg("extra_key") = "",
      "The prefix cache's hash of one full block, 32 bytes: SHA-256 of one byte (1 with a parent, 0 without), the "
      "parent's 32 bytes if any, each token id as 4 bytes little endian (int32), extra_key's length as 8 bytes "
      "little endian and its bytes (the request's cache_salt, UTF-8). A prompt's block i "
      "chains from block i-1 (parent None for the first). Raises InvalidArgumentError.");

  py::class_<BlockOwner>(m, "BlockOwner")
      .def_readonly("request_id", &BlockOwner::request_id)
      .def_readonly("index", &BlockOwner::index)
      .def_readonly("block_ids", &BlockOwner::block_ids);

  // Each compiled backend's functions under _core.<backend> (binding_registry.h).
  for (const BackendBinding* b : backend_bindings()) {
    py::module_ sub = m.def_submodule(b->name, (std::string(b->name) + " attention backend kernels").c_str());
    b->fn(sub);
  }
}
