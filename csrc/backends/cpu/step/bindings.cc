// pybind11 bindings of the native decode step (native_decoder.h) into
// pagedserve._core.cpu:
//   NativeDecoder(embed_tokens, cos_sin_cache, norm, norm_eps, num_heads, num_kv_heads, head_dim,
//                 embed_scale=1.0, activation="silu")
//     .add_layer(qkv_proj, o_proj, gate_up_proj, down_proj, qkv_bias, o_bias, gate_up_bias, down_bias,
//                input_layernorm, pre_mlp_layernorm, eps, eps_post, post_attn_layernorm=None,
//                post_mlp_layernorm=None, q_norm=None, k_norm=None, rope_table=0, sliding_window=0)
//     .forward(input_ids, positions, slot_mapping, kv_store, plan, out, scale, num_threads, window_plan=None,
//              rope_tables=None)
//     .num_layers, .hidden_size
// A linear layer is a QuantizedWeight or a list of them (parts, concatenated
// outputs); cos_sin_cache a tensor or a list of tensors. forward releases the
// GIL; every error is a KernelArgumentError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "backends/cpu/attention/attention_cpu.h"
#include "binding_registry.h"
#include "core/errors.h"
#include "backends/cpu/step/native_decoder.h"
#include "backends/cpu/gemm/quant_linear.h"

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

// A linear layer: one QuantizedWeight, or a list (tuple) of them whose outputs are concatenated.
NativeLinear native_linear(const py::handle& w, const py::handle& bias, const char* name) {
  NativeLinear lin;
  auto weight = [name](const py::handle& part) {
    if (!py::isinstance<QuantizedWeight>(part)) {
      throw KernelArgumentError(std::string(name) + "_proj: expected a QuantizedWeight or a list of them");
    }
    return part.cast<std::shared_ptr<QuantizedWeight>>();
  };
  if (py::isinstance<py::list>(w) || py::isinstance<py::tuple>(w)) {
    for (const py::handle& part : w) lin.parts.push_back(weight(part));
  } else {
    lin.parts.push_back(weight(w));
  }
  lin.bias = floats(bias, (std::string(name) + "_bias").c_str());
  return lin;
}

NativeActivation parse_activation(const std::string& name) {
  if (name == "silu") return NativeActivation::kSiluAndMul;
  if (name == "gelu_tanh") return NativeActivation::kGeluTanhAndMul;
  throw KernelArgumentError("activation must be \"silu\" or \"gelu_tanh\", got \"" + name + "\"");
}

void bind_native(py::module_& m) {
  py::class_<NativeDecoder, std::shared_ptr<NativeDecoder>>(
      m, "NativeDecoder",
      "A decoder's whole forward in one call (the native decode step; Llama family, Gemma 3, Qwen 2 and 3): the kernels the "
      "Python paths call (QuantizedWeight.linear_f32 on the GGUF's blocks, the fused ops, reshape_and_cache, the "
      "step's AttentionPlan) in a layer's order, without a Python call between them; for Llama bit-identical to "
      "the lean forward. float32.")
      .def(py::init([](py::handle embed_tokens, py::handle cos_sin_cache, py::handle norm, float norm_eps,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float embed_scale,
                       const std::string& activation) {
             std::shared_ptr<QuantizedWeight> blocks;
             TensorArg table;
             if (py::isinstance<QuantizedWeight>(embed_tokens)) {
               blocks = embed_tokens.cast<std::shared_ptr<QuantizedWeight>>();
             } else {
               table = tensor_arg(embed_tokens, "embed_tokens");
             }
             std::vector<TensorArg> caches;
             if (py::isinstance<py::list>(cos_sin_cache) || py::isinstance<py::tuple>(cos_sin_cache)) {
               for (const py::handle& c : cos_sin_cache) caches.push_back(tensor_arg(c, "cos_sin_cache"));
             } else {
               caches.push_back(tensor_arg(cos_sin_cache, "cos_sin_cache"));
             }
             return std::make_shared<NativeDecoder>(blocks ? nullptr : &table, blocks, caches, floats(norm, "norm"),
                                                    norm_eps, num_heads, num_kv_heads, head_dim, embed_scale,
                                                    parse_activation(activation));
           }),
           py::keep_alive<1, 2>(), py::arg("embed_tokens"), py::arg("cos_sin_cache"), py::arg("norm"),
           py::arg("norm_eps"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
           py::arg("embed_scale") = 1.f, py::arg("activation") = "silu",
           "embed_tokens: float32 [vocab, hidden] contiguous (kept alive by the decoder, not copied), or a "
           "QuantizedWeight [vocab, hidden] whose rows are de-quantised per token (a tied embedding kept once); "
           "cos_sin_cache: float32 [max_position, head_dim], or a list of such rotary tables (row p: cos then sin "
           "of p times the rotary frequencies; copied), or an empty list (each forward passes the step's rows); norm: the final RMSNorm factor [hidden] float32; "
           "embed_scale: each embedding row's factor (Gemma: sqrt(hidden)); activation: \"silu\" (SwiGLU) or "
           "\"gelu_tanh\" (GeGLU). Raises KernelArgumentError.")
      .def(
          "add_layer",
          [](NativeDecoder& d, py::handle qkv_proj, py::handle o_proj, py::handle gate_up_proj, py::handle down_proj,
             py::handle qkv_bias, py::handle o_bias, py::handle gate_up_bias, py::handle down_bias,
             py::handle input_layernorm, py::handle pre_mlp_layernorm, float eps, float eps_post,
             py::handle post_attn_layernorm, py::handle post_mlp_layernorm, py::handle q_norm, py::handle k_norm,
             int64_t rope_table, int64_t sliding_window) {
            NativeLayer layer;
            layer.qkv_proj = native_linear(qkv_proj, qkv_bias, "qkv");
            layer.o_proj = native_linear(o_proj, o_bias, "o");
            layer.gate_up_proj = native_linear(gate_up_proj, gate_up_bias, "gate_up");
            layer.down_proj = native_linear(down_proj, down_bias, "down");
            layer.input_layernorm = floats(input_layernorm, "input_layernorm");
            layer.pre_mlp_layernorm = floats(pre_mlp_layernorm, "pre_mlp_layernorm");
            layer.post_attn_layernorm = floats(post_attn_layernorm, "post_attn_layernorm");
            layer.post_mlp_layernorm = floats(post_mlp_layernorm, "post_mlp_layernorm");
            layer.q_norm = floats(q_norm, "q_norm");
            layer.k_norm = floats(k_norm, "k_norm");
            layer.eps = eps;
            layer.eps_post = eps_post;
            layer.rope_table = rope_table;
            layer.sliding_window = sliding_window;
            d.add_layer(std::move(layer));
          },
          py::arg("qkv_proj"), py::arg("o_proj"), py::arg("gate_up_proj"), py::arg("down_proj"),
          py::arg("qkv_bias"), py::arg("o_bias"), py::arg("gate_up_bias"), py::arg("down_bias"),
          py::arg("input_layernorm"), py::arg("pre_mlp_layernorm"), py::arg("eps"), py::arg("eps_post"),
          py::arg("post_attn_layernorm") = py::none(), py::arg("post_mlp_layernorm") = py::none(),
          py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(), py::arg("rope_table") = 0,
          py::arg("sliding_window") = 0,
          "Appends a layer: its linear layers, each a QuantizedWeight or a list of them (outputs concatenated): "
          "qkv [(Hq + 2 Hkv) D, hidden], o [hidden, Hq D], gate_up [2 I, hidden], down [hidden, I]; float32 "
          "biases or None; the RMSNorm factors [hidden] float32 (input_layernorm; pre_mlp_layernorm, before the "
          "MLP, with eps_post; optional post_attn_layernorm / post_mlp_layernorm on the attention / MLP output, "
          "and q_norm / k_norm [D] per head, with eps); rope_table: index of the layer's rotary table; "
          "sliding_window: tokens, 0 for none. Raises KernelArgumentError on a shape that does not fit.")
      .def(
          "forward",
          [](NativeDecoder& d, py::handle input_ids, py::handle positions, py::handle slot_mapping,
             py::handle kv_store, AttentionPlan& plan, py::handle out, float scale, int num_threads,
             AttentionPlan* window_plan, py::handle rope_tables) {
            auto ids = tensor_arg(input_ids, "input_ids"), pos = tensor_arg(positions, "positions");
            auto slots = tensor_arg(slot_mapping, "slot_mapping"), store = tensor_arg(kv_store, "kv_store");
            auto o = tensor_arg(out, "out");
            std::vector<TensorArg> tables;
            if (!rope_tables.is_none()) {
              for (const py::handle& table : rope_tables) tables.push_back(tensor_arg(table, "rope_tables"));
            }
            py::gil_scoped_release release;
            d.forward(ids, pos, slots, store, plan, window_plan, o, scale, num_threads, tables);
          },
          py::arg("input_ids"), py::arg("positions"), py::arg("slot_mapping"), py::arg("kv_store"),
          py::arg("plan"), py::arg("out"), py::arg("scale"), py::arg("num_threads") = 1,
          py::arg("window_plan") = py::none(), py::arg("rope_tables") = py::none(),
          "out [T, hidden] float32 = the final norm's output of the step's tokens: input_ids, positions, "
          "slot_mapping [T] int64; kv_store the CPU backend's store [layers, 2, num_blocks, Hkv, block_size * "
          "D] float32 (each layer's K/V written at slot_mapping, then read by the plan: the step's "
          "AttentionPlan without a sliding window, or window_plan, the step's plan with the layers' window, for "
          "the layers that have one). rope_tables: None (the tables given at construction, by position) or the "
          "step's rows of each table, float32 [T, D], row i for token i. Raises KernelArgumentError.")
      .def_property_readonly("num_layers", &NativeDecoder::num_layers)
      .def_property_readonly("hidden_size", &NativeDecoder::hidden_size);
}

const BackendBinding registration("cpu", &bind_native);

}  // namespace
}  // namespace cpu
}  // namespace pagedserve
