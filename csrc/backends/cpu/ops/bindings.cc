// pybind11 bindings of the fused elementwise CPU ops (fused_ops.h) into
// pagedserve._core.cpu, next to the attention backend's (registered through
// binding_registry.h under the same submodule name). Each releases the GIL
// while it runs and raises KernelArgumentError (pagedserve.errors) on a bad
// argument.
#include <pybind11/pybind11.h>

#include <string>

#include "binding_registry.h"
#include "backends/cpu/ops/fused_ops.h"

namespace py = pybind11;

namespace pagedserve {
namespace cpu {
namespace {

void bind_fused(py::module_& m) {
  m.def(
      "rms_norm",
      [](py::handle out, py::handle input, py::handle weight, float eps, int num_threads) {
        auto o = tensor_arg(out, "out"), x = tensor_arg(input, "input"), w = tensor_arg(weight, "weight");
        py::gil_scoped_release release;
        rms_norm(o, x, w, eps, num_threads);
      },
      py::arg("out"), py::arg("input"), py::arg("weight"), py::arg("eps"), py::arg("num_threads") = 1,
      "out [T, H] = weight * to_dtype(input * rsqrt(mean(input^2, -1) + eps)) (RMSNorm, Zhang & Sennrich 2019, "
      "with Hugging Face LlamaRMSNorm's roundings; vLLM's rms_norm). float32 or bfloat16, all alike; out may be "
      "input. Raises KernelArgumentError.");
  m.def(
      "fused_add_rms_norm",
      [](py::handle input, py::handle residual, py::handle weight, float eps, int num_threads) {
        auto x = tensor_arg(input, "input"), r = tensor_arg(residual, "residual");
        auto w = tensor_arg(weight, "weight");
        py::gil_scoped_release release;
        fused_add_rms_norm(x, r, w, eps, num_threads);
      },
      py::arg("input"), py::arg("residual"), py::arg("weight"), py::arg("eps"), py::arg("num_threads") = 1,
      "In place: residual [T, H] = input + residual (in the dtype), then input = rms_norm(residual) "
      "(vLLM's fused_add_rms_norm). Raises KernelArgumentError.");
  m.def(
      "silu_and_mul",
      [](py::handle out, py::handle input, int num_threads) {
        auto o = tensor_arg(out, "out"), x = tensor_arg(input, "input");
        py::gil_scoped_release release;
        silu_and_mul(o, x, num_threads);
      },
      py::arg("out"), py::arg("input"), py::arg("num_threads") = 1,
      "out [T, I] = silu(input[:, :I]) * input[:, I:] for input [T, 2I] (SwiGLU's gate, rounded as Hugging Face's "
      "act_fn(gate) * up; vLLM's silu_and_mul). Raises KernelArgumentError.");
  m.def(
      "gelu_tanh_and_mul",
      [](py::handle out, py::handle input, int num_threads) {
        auto o = tensor_arg(out, "out"), x = tensor_arg(input, "input");
        py::gil_scoped_release release;
        gelu_tanh_and_mul(o, x, num_threads);
      },
      py::arg("out"), py::arg("input"), py::arg("num_threads") = 1,
      "out [T, I] = gelu_tanh(input[:, :I]) * input[:, I:] for input [T, 2I] (GeGLU's gate with torch's "
      "tanh-approximated gelu, rounded as Hugging Face's act_fn(gate) * up; vLLM's gelu_tanh_and_mul). Raises "
      "KernelArgumentError.");
  m.def(
      "rotary_embedding",
      [](py::handle positions, py::handle query, py::object key, int64_t head_size, py::handle cos_sin_cache,
         bool is_neox, int num_threads) {
        auto p = tensor_arg(positions, "positions"), q = tensor_arg(query, "query");
        auto c = tensor_arg(cos_sin_cache, "cos_sin_cache");
        const bool has_key = !key.is_none();
        TensorArg k;
        if (has_key) k = tensor_arg(key, "key");
        py::gil_scoped_release release;
        rotary_embedding(p, q, has_key ? &k : nullptr, head_size, c, is_neox, num_threads);
      },
      py::arg("positions"), py::arg("query"), py::arg("key"), py::arg("head_size"), py::arg("cos_sin_cache"),
      py::arg("is_neox") = true, py::arg("num_threads") = 1,
      "Rotary position embedding (RoPE, Su et al. 2021) in place on query [T, Hq*D] or [T, Hq, D] and key "
      "(or None), views allowed (last dimension contiguous), at positions [T] int64 from cos_sin_cache "
      "[max_position, rot_dim] float32 (cos | sin halves, as vLLM). is_neox: rotate_half (Hugging Face "
      "apply_rotary_pos_emb's roundings), else GPT-J pairs. Raises KernelArgumentError (also for a position "
      "outside the cache, before anything is written).");
}

const BackendBinding registration("cpu", &bind_fused);

}  // namespace
}  // namespace cpu
}  // namespace pagedserve
