"""Quantised linear layers (``--linear-impl q4|int8``, vLLM's ``--quantization``): weights kept in GGUF's
block formats and run by the C++ kernel ``cpu_core.QuantizedWeight``.

A GGUF checkpoint's layers run on the file's own blocks, unchanged, in
whichever type the file stores them (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
Q6_K: the model computes with exactly the weights it ships; tests check the
dequantised blocks equal the GGUF's values bit for bit). The quantisation
names the type of every other layer (a float checkpoint's, a file's F16/F32
tensors), quantised here by gguf-py (llama.cpp's rounding):

  q4:   Q4_1 blocks (32 weights: a float16 scale d and minimum m, 4-bit
        q; w = d q + m).
  int8: Q8_0 blocks (32 weights: a float16 scale, 8-bit q; w = d q).
  An output layer quantised here always gets Q8_0, as llama.cpp keeps it at
  higher precision.

The kernel quantises each activation row to int8 per group of 32 (a scale and
the group's sum, llama.cpp's Q8_1) and multiplies with integer dot products
(AVX-512 VNNI, AVX-VNNI, AVX2 or plain C++, chosen at run time), so the
results differ from a float matmul by the activations' rounding: the
accuracy this costs is measured, not assumed (bench/throughput.py prints
greedy agreement and perplexity against the float path).
"""

from __future__ import annotations

import logging

import torch

from ..kernels import cpu_core
from .gguf_format import NATIVE_QTYPES, GGUFBlocks, quantize_rows
from .linear_method import LinearLayer, LinearMethod, fused_bias

logger = logging.getLogger(__name__)

# GGUF block type of each quantisation's linear layers
QTYPE = {"q4": "q4_1", "int8": "q8_0"}
# Calls of at least this many rows (prefill chunks) multiply the weights de-quantised to bfloat16 with oneDNN's
# bfloat16 GEMM where the CPU has native bfloat16 arithmetic: there the integer kernel is compute-bound and slower
# (docs/benchmarks.md, "Behind the code")
DENSE_MIN_ROWS = 256


def dense_prefill_available() -> bool:
    """True where large calls take the de-quantise + bfloat16 GEMM path: native
    bfloat16 arithmetic and oneDNN's bfloat16 linear path on this CPU."""
    from ..hardware import cpu_capabilities

    caps = cpu_capabilities()
    return caps.native_bf16 and caps.onednn_bf16


class QuantLinear(LinearLayer):
    """A linear layer on GGUF blocks: x [..., in_features] float32 or bfloat16 ->
    [..., out_features] in x's dtype, x @ dequant(W).T + bias with x rounded to
    int8 per group of 32 (see the module docstring). With ``dense_prefill``,
    calls of DENSE_MIN_ROWS rows or more instead de-quantise the weights to
    bfloat16 for that call and use torch's bfloat16 GEMM (x rounded to
    bfloat16, float32 accumulation): the same weights, a faster path where
    the GEMM is compute-bound.

    Args:
        blocks: [out_features, in_features / block elements * block bytes] uint8.
        qtype: the blocks' GGUF type (any of gguf_format.NATIVE_QTYPES).
        in_features: K (a multiple of 32).
        bias: [out_features] or None (kept in float32), over every part's rows.
        dense_prefill: take the bfloat16 path for large calls (dense_prefill_available()).
        parts: further (blocks, qtype) whose rows follow (a fused layer whose
            parts a file stores in different types: each part's own blocks, one
            kernel call each, into its columns of the output).
    Attributes:
        qtype: the parts' types joined by "+" ("q4_k+q6_k"), one name when they are one.
    Raises:
        pagedserve.errors.KernelArgumentError (a ValueError) on blocks of the wrong size.
    """

    def __init__(self, blocks: torch.Tensor, qtype: str, in_features: int, bias: torch.Tensor | None,
                 dense_prefill: bool = False, parts: list[tuple[torch.Tensor, str]] | None = None) -> None:
        super().__init__()
        every = [(blocks, qtype)] + list(parts or [])
        self.weights = [cpu_core.QuantizedWeight(b.contiguous(), q, b.shape[0], in_features) for b, q in every]
        self.weight = self.weights[0]
        self.in_features, self.out_features = in_features, sum(b.shape[0] for b, _ in every)
        self.qtype = "+".join(dict.fromkeys(q for _, q in every))
        self.dense_prefill = dense_prefill
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)
        starts = [0]
        for w in self.weights:
            starts.append(starts[-1] + w.out_features)
        self._columns = list(zip(starts[:-1], starts[1:]))
        self._biases = [None if self.bias is None else self.bias[a:b].contiguous() for a, b in self._columns]

    float_logits = True  # the kernel quantises the rows to int8 from float32 either way

    @property
    def nbytes(self) -> int:
        """Bytes of the weight blocks (as the kernel stores them)."""
        return sum(w.nbytes for w in self.weights)

    @property
    def row_invariant(self) -> bool:
        """LinearLayer.row_invariant: every call runs the integer kernel (no bfloat16 GEMM for large ones)."""
        return not self.dense_prefill

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        if self.dense_prefill and x2.shape[0] >= DENSE_MIN_ROWS:
            out = torch.nn.functional.linear(x2.to(torch.bfloat16), self.dequantize(torch.bfloat16))
            if self.bias is not None:
                out = out.float() + self.bias
            return out.to(x.dtype).reshape(*lead, self.out_features)
        out = torch.empty((x2.shape[0], self.out_features), dtype=x.dtype)
        threads = torch.get_num_threads()
        if len(self.weights) == 1:
            self.weight.linear(x2, out, self.bias, threads)
        else:
            for w, (a, b), bias in zip(self.weights, self._columns, self._biases):
                part = torch.empty((x2.shape[0], b - a), dtype=x.dtype)
                w.linear(x2, part, bias, threads)
                out[:, a:b] = part
        return out.reshape(*lead, self.out_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weights the kernel multiplies with: [out_features, in_features]
        float32 (exactly gguf-py's values), or those rounded to bfloat16."""
        out = torch.empty((self.out_features, self.in_features), dtype=dtype)
        for w, (a, b) in zip(self.weights, self._columns):
            w.dequantize(out[a:b], torch.get_num_threads())
        return out


class QuantizedMethod(LinearMethod):
    """The linear method of ``--linear-impl q4|int8``: QuantLinear layers on
    the GGUF file's own blocks where it stores a layer in a block type the
    kernels read (any of NATIVE_QTYPES, whatever the quantisation asked), else
    on the float weights quantised here by gguf-py to Q4_1 (q4) or Q8_0
    (int8; the output layer always). Takes every layer.

    Args:
        quantization: "q4" or "int8".
        config: the transformers config (heads, for the GGUF q/k row order).
        gguf: the checkpoint's GGUF blocks, or None for a float checkpoint.
        batch_invariant: every call runs the integer kernel (a row's result never depends on its
            call's size: the bfloat16 GEMM of large calls rounds and sums otherwise); False lets calls of
            DENSE_MIN_ROWS+ rows take the bfloat16 path where dense_prefill_available().
    Attributes:
        native: layers that run the checkpoint's own blocks unchanged.
        requantized: layers quantised here from float weights.
    Raises:
        ValueError: an unknown quantisation.
    """

    ours = True

    def __init__(self, quantization: str, config, gguf: GGUFBlocks | None, batch_invariant: bool = True) -> None:
        if quantization not in QTYPE:
            raise ValueError(f"quantization must be one of {', '.join(QTYPE)}, got '{quantization}'")
        self.name = quantization
        self.quantization, self.qtype, self.gguf = quantization, QTYPE[quantization], gguf
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.native, self.requantized = 0, 0
        self.dense_prefill = not batch_invariant and dense_prefill_available()

    def blocks(self, linear: torch.nn.Linear, name: str) -> tuple[torch.Tensor, str, bool]:
        """(blocks [N, bytes] uint8, qtype, the file's own) for the layer ``name``
        (its qualified name in the transformers model): the GGUF's own blocks
        when the file stores that tensor in a block type the integer kernels
        read (every type of NATIVE_QTYPES: Q4_0 ... Q6_K, as llama.cpp runs a
        file's types as they are), else the float weight quantised to this
        quantisation's type (the output layer: to Q8_0)."""
        if self.gguf is not None:
            native = self.gguf.layer_blocks(name, linear.out_features, self.num_heads, self.num_kv_heads,
                                            NATIVE_QTYPES)
            if native is not None:
                return native[0], native[1], True
        # an output layer quantised here gets 8 bits, as llama.cpp keeps it at higher precision than the layers
        qtype = "q8_0" if name == "lm_head" else self.qtype
        try:
            return quantize_rows(linear.weight, qtype), qtype, False
        except ValueError as e:
            raise ValueError(f"--linear-impl {self.quantization}: layer {name}: {e}; serve this model without "
                             "a quantisation (--linear-impl auto)") from e

    def build(self, linears: list[torch.nn.Linear], names: list[str]) -> tuple[torch.nn.Module, str]:
        """One QuantLinear computing the listed layers (same in_features) side by
        side: each part on its own blocks (the file's, or quantised here),
        parts of one type concatenated by rows into one weight, of several
        types one weight each. Never declines (LinearMethod.build)."""
        parts = [self.blocks(lin, name) for lin, name in zip(linears, names)]
        own = sum(1 for _, _, o in parts if o)
        self.native += own
        self.requantized += len(parts) - own
        bias = fused_bias(linears)
        runs = []  # consecutive parts of one type, their blocks concatenated: [(blocks, qtype)]
        for blocks, qtype, _ in parts:
            if runs and runs[-1][1] == qtype:
                runs[-1] = (torch.cat([runs[-1][0], blocks]), qtype)
            else:
                runs.append((blocks, qtype))
        source = ("the file's own" if own == len(parts) else "quantised here" if own == 0 else
                  f"{own} of {len(parts)} parts the file's own, the others quantised here")
        what = "+".join(q.upper() for _, q in runs) + f" blocks, {source}, int8 activations"
        layer = QuantLinear(runs[0][0], runs[0][1], linears[0].in_features, bias, self.dense_prefill, parts=runs[1:])
        return layer, what

    def describe(self) -> str:
        """LinearMethod.describe: the quantisation, how many layers run the file's own blocks and how many
        were quantised here, the kernel's ISA, and what large calls take."""
        large = (f"; calls of {DENSE_MIN_ROWS}+ rows: de-quantised to bfloat16, torch's bfloat16 GEMM"
                 if self.dense_prefill else "")
        return (f"{self.quantization}: int8 activations; {self.native} layers on the GGUF's own blocks, "
                f"{self.requantized} quantised here to {self.qtype} (kernel {cpu_core.kernel_tables()['gemm']}{large})")
