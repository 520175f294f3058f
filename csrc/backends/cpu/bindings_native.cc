// pybind11 bindings of the native decode step (native_decoder.h) into
// pagedserve._core.cpu:
//   NativeDecoder(embed_tokens, cos_sin_cache, norm, norm_eps, num_heads, num_kv_heads, head_dim)
//     .add_layer(qkv_proj, o_proj, gate_up_proj, down_proj, qkv_bias, o_bias, gate_up_bias, down_bias,
//                input_layernorm, post_attention_layernorm, eps, eps_post)
//     .forward(input_ids, positions, slot_mapping, kv_store, plan, out, scale, num_threads)
//     .num_layers, .hidden_size
// forward releases the GIL; every error is a KernelArgumentError.
#include <pybind11/pybind11.h>

#include <memory>
#include <string>
#include <vector>

#include "attention_cpu.h"
#include "binding_registry.h"
#include "native_decoder.h"
#include "quant_linear.h"

namespace py = pybind11;

namespace pagedserve {
namespace cpu {
namespace {

// A float32 1-d contiguous tensor's values (None -> empty: no bias).
std::vector<float> floats(const py::handle& t, const char* name) {
  if (t.is_none()) return {};
  const TensorArg a = tensor_arg(t, name);
  a.check_dim(1);
  a.check_dtype(DType::kFloat32);
  a.check_contiguous();
  const float* p = a.ptr<const float>();
  return std::vector<float>(p, p + a.size(0));
}

void bind_native(py::module_& m) {
  py::class_<NativeDecoder, std::shared_ptr<NativeDecoder>>(
      m, "NativeDecoder",
      "A Llama-family decoder's whole forward in one call (the native decode step): the lean forward's kernels "
      "(QuantizedWeight.linear_f32 on the GGUF's blocks, the fused ops, reshape_and_cache, the step's "
      "AttentionPlan) in its order, so the hidden states are bit-identical to it. float32.")
      .def(py::init([](py::handle embed_tokens, py::handle cos_sin_cache, py::handle norm, float norm_eps,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
             std::shared_ptr<QuantizedWeight> blocks;
             TensorArg table;
             if (py::isinstance<QuantizedWeight>(embed_tokens)) {
               blocks = embed_tokens.cast<std::shared_ptr<QuantizedWeight>>();
             } else {
               table = tensor_arg(embed_tokens, "embed_tokens");
             }
             return std::make_shared<NativeDecoder>(blocks ? nullptr : &table, blocks,
                                                    tensor_arg(cos_sin_cache, "cos_sin_cache"),
                                                    floats(norm, "norm"), norm_eps, num_heads, num_kv_heads,
                                                    head_dim);
           }),
           py::keep_alive<1, 2>(), py::arg("embed_tokens"), py::arg("cos_sin_cache"), py::arg("norm"),
           py::arg("norm_eps"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
           "embed_tokens: float32 [vocab, hidden] contiguous (kept alive by the decoder, not copied), or a "
           "QuantizedWeight [vocab, hidden] whose rows are de-quantised per token (a tied embedding kept once); "
           "cos_sin_cache: float32 [max_position, head_dim] (row p: cos then sin of p times the rotary "
           "frequencies; copied); norm: the final RMSNorm weight [hidden] float32. Raises KernelArgumentError.")
      .def(
          "add_layer",
          [](NativeDecoder& d, std::shared_ptr<QuantizedWeight> qkv_proj, std::shared_ptr<QuantizedWeight> o_proj,
             std::shared_ptr<QuantizedWeight> gate_up_proj, std::shared_ptr<QuantizedWeight> down_proj,
             py::handle qkv_bias, py::handle o_bias, py::handle gate_up_bias, py::handle down_bias,
             py::handle input_layernorm, py::handle post_attention_layernorm, float eps, float eps_post) {
            NativeLayer layer;
            layer.qkv_proj = std::move(qkv_proj);
            layer.o_proj = std::move(o_proj);
            layer.gate_up_proj = std::move(gate_up_proj);
            layer.down_proj = std::move(down_proj);
            layer.qkv_bias = floats(qkv_bias, "qkv_bias");
            layer.o_bias = floats(o_bias, "o_bias");
            layer.gate_up_bias = floats(gate_up_bias, "gate_up_bias");
            layer.down_bias = floats(down_bias, "down_bias");
            layer.input_layernorm = floats(input_layernorm, "input_layernorm");
            layer.post_attention_layernorm = floats(post_attention_layernorm, "post_attention_layernorm");
            layer.eps = eps;
            layer.eps_post = eps_post;
            d.add_layer(std::move(layer));
          },
          py::arg("qkv_proj"), py::arg("o_proj"), py::arg("gate_up_proj"), py::arg("down_proj"),
          py::arg("qkv_bias"), py::arg("o_bias"), py::arg("gate_up_bias"), py::arg("down_bias"),
          py::arg("input_layernorm"), py::arg("post_attention_layernorm"), py::arg("eps"), py::arg("eps_post"),
          "Appends a layer: its fused linear layers as QuantizedWeight (qkv [(Hq + 2 Hkv) D, hidden], o "
          "[hidden, Hq D], gate_up [2 I, hidden], down [hidden, I]), float32 biases or None, the two RMSNorm "
          "weights [hidden] and their eps. Raises KernelArgumentError on a shape that does not fit.")
      .def(
          "forward",
          [](NativeDecoder& d, py::handle input_ids, py::handle positions, py::handle slot_mapping,
             py::handle kv_store, AttentionPlan& plan, py::handle out, float scale, int num_threads) {
            auto ids = tensor_arg(input_ids, "input_ids"), pos = tensor_arg(positions, "positions");
            auto slots = tensor_arg(slot_mapping, "slot_mapping"), store = tensor_arg(kv_store, "kv_store");
            auto o = tensor_arg(out, "out");
            py::gil_scoped_release release;
            d.forward(ids, pos, slots, store, plan, o, scale, num_threads);
          },
          py::arg("input_ids"), py::arg("positions"), py::arg("slot_mapping"), py::arg("kv_store"),
          py::arg("plan"), py::arg("out"), py::arg("scale"), py::arg("num_threads") = 1,
          "out [T, hidden] float32 = the final norm's output of the step's tokens: input_ids, positions, "
          "slot_mapping [T] int64; kv_store the CPU backend's store [layers, 2, num_blocks, Hkv, block_size * "
          "D] float32 (each layer's K/V written at slot_mapping, then read by the plan: the step's "
          "AttentionPlan without a sliding window). Raises KernelArgumentError.")
      .def_property_readonly("num_layers", &NativeDecoder::num_layers)
      .def_property_readonly("hidden_size", &NativeDecoder::hidden_size);
}

const BackendBinding registration("cpu", &bind_native);

}  // namespace
}  // namespace cpu
}  // namespace pagedserve
