// pybind11 bindings of the quantized linear kernels (quant_linear.h), added to
// the submodule pagedserve._core.cpu through binding_registry.h:
//   QuantizedWeight(raw, qtype, out_features, in_features)
//     .dequantize(out), .linear(x, out, bias, num_threads),
//     .linear_f32(x, out, bias, num_threads), .greedy_logits(x, out, num_threads),
//     .prunes_greedy_logits, .nbytes, .qtype,
//     .in_features, .out_features
//   (the variant they run with: runtime/bindings.cc's kernel_isa(), kernel_tables())
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>

#include "binding_registry.h"
#include "backends/cpu/gemm/greedy_logits.h"
#include "backends/cpu/gemm/quant_linear.h"
#include "backends/cpu/runtime/isa_registry.h"
#include "core/errors.h"

namespace py = pybind11;

namespace pagedserve {
namespace cpu {
namespace {

void bind_quant(py::module_& m) {
  py::class_<QuantizedWeight, std::shared_ptr<QuantizedWeight>>(
      m, "QuantizedWeight",
      "A GGUF-quantised weight matrix [out_features, in_features] (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or "
      "Q6_K) kept in 16-row interleaved tiles of its exact values: linear_f32 multiplies float32 activations with "
      "them (every type); linear quantises activations per row and 32-group to int8 (llama.cpp's Q8_1 scheme) "
      "for integer block dots by AVX512-VNNI / AVX-VNNI vpdpbusd, AVX2 vpmaddubsw or scalar C++ (every type).")
      .def(py::init([](py::handle raw, const std::string& qtype, int64_t out_features, int64_t in_features) {
             auto r = tensor_arg(raw, "raw");
             py::gil_scoped_release release;
             return std::make_shared<QuantizedWeight>(r, qtype, out_features, in_features);
           }),
           py::arg("raw"), py::arg("qtype"), py::arg("out_features"), py::arg("in_features"),
           "raw: uint8 [out_features, in_features / block_elements * block_bytes] contiguous, the tensor's GGUF "
           "blocks row by row (per block of 32 elements: Q4_0 18 bytes, Q4_1 20, Q5_0 22, Q5_1 24, Q8_0 34; per "
           "256: Q4_K 144, Q5_K 176, Q6_K 210), or for 'f32', 'f16', 'bf16' the row-major matrix's bytes; qtype "
           "'q4_0', 'q4_1', 'q5_0', 'q5_1', 'q8_0', 'q4_k', 'q5_k', 'q6_k', 'f32', 'f16' or 'bf16'; in_features "
           "a multiple of the block's elements (32; the K-quants 256). The bytes are copied (Q4_1 and Q8_0 as they "
           "are; Q4_0 as Q4_1 blocks, 0.625 bytes per weight, and Q5_0 as Q8_0 blocks, 1.0625, of the same "
           "values; Q4_K as 4-bit quants with float32 scales, 0.75; Q5_1, Q5_K as 5-bit ones, 0.875; Q6_K as int8 "
           "quants with float32 scales per 16 elements, 1.5; F32, F16, BF16 as they are in dense tiles, 4 / 2 / 2: "
           "linear_f32, dequantize and embedding only). "
           "Raises KernelArgumentError.")
      .def(
          "dequantize",
          [](const QuantizedWeight& w, py::handle out, int num_threads) {
            auto o = tensor_arg(out, "out");
            py::gil_scoped_release release;
            w.dequantize(o, num_threads);
          },
          py::arg("out"), py::arg("num_threads") = 1,
          "out [out_features, in_features] = the dequantised weights: float32 bit-identical to "
          "gguf.quants.dequantize (e.g. d * q + m, rounded twice), or bfloat16 (those rounded to nearest even); rows "
          "split over num_threads threads. Raises KernelArgumentError.")
      .def(
          "linear",
          [](const QuantizedWeight& w, py::handle x, py::handle out, py::object bias, int num_threads) {
            auto xa = tensor_arg(x, "x"), o = tensor_arg(out, "out");
            std::optional<TensorArg> b;
            if (!bias.is_none()) b = tensor_arg(bias, "bias");
            py::gil_scoped_release release;
            w.linear(xa, o, b ? &*b : nullptr, num_threads);
          },
          py::arg("x"), py::arg("out"), py::arg("bias") = py::none(), py::arg("num_threads") = 1,
          "out [M, out_features] = x [M, in_features] @ W.T (+ bias float32 [out_features]); x and out float32 "
          "or bfloat16 (the same), contiguous; x quantised to int8 per row and 32-group (scale amax/127), integer "
          "block dots, float32 accumulation. Q4_1 and Q8_0 weights only. num_threads in [1, 1024]. Raises "
          "KernelArgumentError.")
      .def(
          "linear_f32",
          [](const QuantizedWeight& w, py::handle x, py::handle out, py::object bias, int num_threads) {
            auto xa = tensor_arg(x, "x"), o = tensor_arg(out, "out");
            std::optional<TensorArg> b;
            if (!bias.is_none()) b = tensor_arg(bias, "bias");
            py::gil_scoped_release release;
            w.linear_f32(xa, o, b ? &*b : nullptr, num_threads);
          },
          py::arg("x"), py::arg("out"), py::arg("bias") = py::none(), py::arg("num_threads") = 1,
          "out [M, out_features] = x [M, in_features] @ W.T (+ bias float32 [out_features]) in float32, W the "
          "exactly dequantised weights (dequantize's float32 values, expanded from the blocks in registers: "
          "lossless for weights whose float32 values are these); x and out float32, or both bfloat16 (x widened "
          "exactly, each float32 result rounded once to nearest even), contiguous; x not quantised; "
          "float32 accumulation along in_features in order, so the result does not depend on num_threads. "
          "num_threads in [1, 1024]. Raises KernelArgumentError.")
      .def(
          "greedy_logits",
          [](const QuantizedWeight& w, py::handle x, py::handle out, int num_threads) {
            auto xa = tensor_arg(x, "x"), o = tensor_arg(out, "out");
            py::gil_scoped_release release;
            greedy_logits(w, xa, o, num_threads);
          },
          py::arg("x"), py::arg("out"), py::arg("num_threads") = 1,
          "out [M, out_features] float32 for greedy decoding, x [M, in_features] float32 (contiguous, no bias): "
          "each entry is linear_f32's value bit for bit or -inf, and every entry that could be its row's maximum "
          "holds its value, so argmax per row equals linear_f32's. An int8 pass with a worst-case error bound per "
          "output picks the candidates (gemm/greedy_logits.h); linear_f32 in full for one row (M = 1), where the "
          "weight is not Q8_0, x or a first-pass value is not finite, a partial sum could overflow, or more than a "
          "quarter of the row groups are candidates. num_threads in [1, 1024]. Raises KernelArgumentError.")
      .def_property_readonly("prunes_greedy_logits", &prunes_greedy_logits,
                             "Whether greedy_logits skips work on this weight (Q8_0 blocks); else it is linear_f32.")
      .def(
          "embedding",
          [](const QuantizedWeight& w, py::handle ids, py::handle out) {
            auto i = tensor_arg(ids, "ids"), o = tensor_arg(out, "out");
            py::gil_scoped_release release;
            w.embedding(i, o);
          },
          py::arg("ids"), py::arg("out"),
          "out [T, in_features] float32 = the de-quantised rows ids [T] int64 (dequantize's values, bit for bit): "
          "an embedding lookup on the blocks. Raises KernelArgumentError (an id outside [0, out_features)).")
      .def_property_readonly("nbytes", &QuantizedWeight::nbytes,
                             "Bytes of weight storage held (rows padded to a multiple of 16).")
      .def_property_readonly("qtype", [](const QuantizedWeight& w) { return std::string(qtype_name(w.qtype())); },
                             "The GGUF block type the weight was given in ('q4_1', 'q6_k', ...).")
      .def_property_readonly(
          "integer_kernels", &QuantizedWeight::integer_kernels,
          "Whether linear (int8 activations) runs this weight (every GGUF type the kernels read); linear_f32 runs "
          "every type.")
      .def_property_readonly("in_features", &QuantizedWeight::in_features)
      .def_property_readonly("out_features", &QuantizedWeight::out_features);

  m.def(
      "peak_ops",
      [](const std::string& kind, int64_t iters) {
        int k;
        if (kind == "fma") {
          k = kPeakFma;
        } else if (kind == "int8_dot") {
          k = kPeakInt8Dot;
        } else {
          throw InvalidArgumentError("peak_ops: kind must be 'fma' or 'int8_dot', got '" + kind + "'");
        }
        if (iters < 1) throw InvalidArgumentError("peak_ops: iters must be >= 1");
        const auto fn = active_isa().gemm().peak_ops;
        py::gil_scoped_release release;
        return fn(k, iters);
      },
      py::arg("kind"), py::arg("iters"),
      "The roofline's compute probe on the calling thread, with the active variant's GEMM table "
      "(gemm/kernel_table.h, peak_ops): `iters` rounds of independent register-resident float32 fused "
      "multiply-adds ('fma') or u8 x s8 multiply-accumulates as the integer kernels issue them ('int8_dot'); "
      "returns the operations done (2 per multiply-add lane), so that divided by the seconds taken it is this "
      "core's peak in op/s. Call it from several threads at once for the machine's. Raises InvalidArgumentError.");
}

const BackendBinding registration("cpu", &bind_quant);

}  // namespace
}  // namespace cpu
}  // namespace pagedserve
