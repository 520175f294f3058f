"""Quantised linear layers (``--quantization q4|int8``): weights kept in GGUF's
block formats and run by the C++ kernel ``_core.cpu.QuantizedWeight``.

  q4:   Q4_1 blocks (32 weights: a float16 scale d and minimum m, 4-bit
        q; w = d q + m). For a GGUF checkpoint whose linear layers are Q4_1
        (the default SmolLM2) these are the file's own blocks, unchanged: the
        model computes with exactly the weights it ships (tests check the
        dequantised blocks equal the GGUF's values bit for bit). Its Q8_0
        output layer is used as it is too. Other checkpoints are quantised to
        Q4_1 here (gguf-py's quantiser, llama.cpp's rounding).
  int8: Q8_0 blocks (32 weights: a float16 scale, 8-bit q; w = d q), quantised
        here from the float weights, for float checkpoints.

The kernel quantises each activation row to int8 per group of 32 (a scale and
the group's sum, llama.cpp's Q8_1) and multiplies with integer dot products
(AVX-512 VNNI, AVX-VNNI, AVX2 or plain C++, chosen at run time), so the
results differ from a float matmul by the activations' rounding: the
accuracy this costs is measured, not assumed (bench/throughput.py prints
greedy agreement and perplexity against the float path).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .. import _core

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("none", "q4", "int8")
# GGUF block type of each quantisation's linear layers
QTYPE = {"q4": "q4_1", "int8": "q8_0"}
# GGUF tensor names of a Llama layer's linear layers (llama.cpp's convention)
_GGUF_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def _gguf_types():
    from gguf import GGMLQuantizationType

    return {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}


def quantize_rows(weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """weight [N, K] float (K a multiple of 32) -> GGUF blocks [N, K/32 * block bytes]
    uint8 of ``qtype`` ("q4_1" or "q8_0"), quantised by gguf-py (llama.cpp's
    rounding). Raises ValueError if K is not a multiple of 32."""
    from gguf.quants import quantize

    if weight.shape[-1] % 32:
        raise ValueError(f"{qtype} needs in_features to be a multiple of 32, got {weight.shape[-1]}")
    return torch.from_numpy(np.ascontiguousarray(quantize(weight.detach().float().numpy(), _gguf_types()[qtype])))


def dequantize_rows(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """GGUF blocks [N, bytes] uint8 -> float32 [N, K], by gguf-py (the reference
    the tests hold the C++ kernel's dequantize to)."""
    from gguf.quants import dequantize

    return torch.from_numpy(np.ascontiguousarray(dequantize(blocks.numpy(), _gguf_types()[qtype])))


def unpermute_rows(blocks: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp stores the q and k projections' rows of each head in
    interleaved rotary order; Hugging Face Llama wants them half-split. Undoes
    that on whole rows (blocks run along in_features, so rows move intact):
    [N, bytes] -> [N, bytes], N = num_heads * head_dim."""
    n = blocks.shape[0]
    return blocks.reshape(num_heads, n // num_heads // 2, 2, -1).transpose(1, 2).reshape(n, -1).contiguous()


@dataclass
class GGUFBlocks:
    """Raw blocks of a GGUF file's tensors.

    Attributes:
        path: the file.
        tensors: GGUF name -> (blocks [N, bytes] uint8 as stored, qtype name
            such as "q4_1", "q8_0", "q6_k", "f32").
        architecture: the file's ``general.architecture`` ("llama", "gemma3", ...).
    """

    path: Path
    tensors: dict = field(default_factory=dict)
    architecture: str = ""

    @classmethod
    def read(cls, path: Path) -> "GGUFBlocks":
        """Reads the tensor index of ``path`` (memory-mapped by gguf-py; the blocks
        are copied when used)."""
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        arch = reader.fields.get("general.architecture")
        architecture = bytes(arch.parts[arch.data[0]]).decode() if arch is not None else ""
        return cls(Path(path), {t.name: (t.data, t.tensor_type.name.lower()) for t in reader.tensors}, architecture)

    def gguf_name(self, name: str) -> str | None:
        """The GGUF tensor name of a decoder linear layer's qualified transformers
        name (``model.layers.{i}.self_attn.q_proj``, ``lm_head``: the Llama,
        Gemma and Qwen families name them alike), or None."""
        if name == "lm_head":
            return "output.weight" if "output.weight" in self.tensors else "token_embd.weight"
        parts = name.split(".")  # model.layers.{i}.{self_attn|mlp}.{proj}
        if len(parts) == 5 and parts[:2] == ["model", "layers"]:
            sub = _GGUF_LAYER.get(".".join(parts[3:]))
            return f"blk.{parts[2]}.{sub}.weight" if sub else None
        return None

    def layer_blocks(self, name: str, out_features: int, num_heads: int, num_kv_heads: int,
                     wanted: tuple[str, ...]) -> tuple[torch.Tensor, str] | None:
        """(blocks [out_features, bytes] uint8 in Hugging Face's row order, qtype)
        of the linear layer ``name`` as this file stores it, if it stores it in
        one of the ``wanted`` block types ("q4_1", "q8_0", ...) with
        out_features rows; else None. In a ``llama`` file the q and k
        projections' rows are moved from llama.cpp's rotary order
        (unpermute_rows; its converter permutes that architecture's only)."""
        gname = self.gguf_name(name)
        entry = self.tensors.get(gname) if gname else None
        if entry is None or entry[1] not in wanted:
            return None
        raw = torch.from_numpy(np.array(entry[0], dtype=np.uint8, copy=True))
        if raw.shape[0] != out_features:
            return None
        if self.architecture not in ("", "llama"):
            return raw, entry[1]
        if gname.endswith("attn_q.weight"):
            raw = unpermute_rows(raw, num_heads)
        elif gname.endswith("attn_k.weight"):
            raw = unpermute_rows(raw, num_kv_heads)
        return raw, entry[1]


# Calls of at least this many rows (prefill chunks) multiply the weights de-quantised to bfloat16 with oneDNN's
# bfloat16 GEMM where the CPU has native bfloat16 arithmetic: there the integer kernel is compute-bound and slower
# (this 2-core AVX-512-BF16 machine, 576 -> 1536 at 128 rows: 1.03 ms vs 0.39 ms for torch's bfloat16 GEMM)
DENSE_MIN_ROWS = 256


def dense_prefill_available() -> bool:
    """True where large calls take the de-quantise + bfloat16 GEMM path: native
    bfloat16 arithmetic and oneDNN's bfloat16 linear path on this CPU."""
    from ..hardware import cpu_capabilities

    caps = cpu_capabilities()
    return caps.native_bf16 and caps.onednn_bf16


class QuantLinear(torch.nn.Module):
    """A linear layer on GGUF blocks: x [..., in_features] float32 or bfloat16 ->
    [..., out_features] in x's dtype, x @ dequant(W).T + bias with x rounded to
    int8 per group of 32 (see the module docstring). With ``dense_prefill``,
    calls of DENSE_MIN_ROWS rows or more instead de-quantise the weights to
    bfloat16 for that call and use torch's bfloat16 GEMM (x rounded to
    bfloat16, float32 accumulation): the same weights, a faster path where
    the GEMM is compute-bound.

    Args:
        blocks: [out_features, in_features / 32 * block bytes] uint8.
        qtype: "q4_1" or "q8_0".
        in_features: K (a multiple of 32).
        bias: [out_features] or None (kept in float32).
        dense_prefill: take the bfloat16 path for large calls (dense_prefill_available()).
    Raises:
        pagedserve.errors.KernelArgumentError (a ValueError) on blocks of the wrong size.
    """

    def __init__(self, blocks: torch.Tensor, qtype: str, in_features: int, bias: torch.Tensor | None,
                 dense_prefill: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.qtype = in_features, blocks.shape[0], qtype
        self.dense_prefill = dense_prefill
        self.weight = _core.cpu.QuantizedWeight(blocks.contiguous(), qtype, self.out_features, in_features)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)

    @property
    def nbytes(self) -> int:
        """Bytes of the weight blocks (as the kernel stores them)."""
        return self.weight.nbytes

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
        self.weight.linear(x2, out, self.bias, torch.get_num_threads())
        return out.reshape(*lead, self.out_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weights the kernel multiplies with: [out_features, in_features]
        float32 (exactly gguf-py's values), or those rounded to bfloat16."""
        out = torch.empty((self.out_features, self.in_features), dtype=dtype)
        self.weight.dequantize(out, torch.get_num_threads())
        return out


class Quantizer:
    """Builds the quantised linear layers of one model.

    Args:
        quantization: "q4" or "int8".
        config: the transformers config (heads, for the GGUF q/k row order).
        gguf: the checkpoint's GGUF blocks, or None for a float checkpoint.
    Attributes:
        native: layers that run the checkpoint's own blocks unchanged.
        requantized: layers quantised here from float weights.
    """

    def __init__(self, quantization: str, config, gguf: GGUFBlocks | None) -> None:
        if quantization not in QTYPE:
            raise ValueError(f"quantization must be one of {', '.join(QTYPE)}, got '{quantization}'")
        self.quantization, self.qtype, self.gguf = quantization, QTYPE[quantization], gguf
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.native, self.requantized = 0, 0
        self.dense_prefill = dense_prefill_available()

    def blocks(self, linear: torch.nn.Linear, name: str) -> tuple[torch.Tensor, str]:
        """(blocks [N, bytes] uint8, qtype) for the layer ``name`` (its qualified
        name in the transformers model): the GGUF's own blocks when the file
        stores that tensor in this quantisation's type (the output layer: in
        Q4_1 or Q8_0), else the float weight quantised to it."""
        if self.gguf is not None:
            native = self.gguf.layer_blocks(name, linear.out_features, self.num_heads, self.num_kv_heads,
                                            ("q4_1", "q8_0") if name == "lm_head" else (self.qtype,))
            if native is not None:
                self.native += 1
                return native
        # an output layer quantised here gets 8 bits, as llama.cpp keeps it at higher precision than the layers
        qtype = "q8_0" if name == "lm_head" else self.qtype
        self.requantized += 1
        try:
            return quantize_rows(linear.weight, qtype), qtype
        except ValueError as e:
            raise ValueError(f"--quantization {self.quantization}: layer {name}: {e}; serve this model with "
                             "--quantization none") from e

    def linear(self, linears: list[torch.nn.Linear], names: list[str]) -> torch.nn.Module:
        """One QuantLinear computing the listed layers (same in_features) side by
        side: their blocks concatenated by rows (all of one qtype; else each is
        quantised to this quantisation's type). A pagedserve.model.lean_llama.FuseLinear."""
        parts = [self.blocks(lin, name) for lin, name in zip(linears, names)]
        if len({q for _, q in parts}) > 1:
            parts = [(quantize_rows(lin.weight, self.qtype), self.qtype) for lin in linears]
        bias = None
        if any(lin.bias is not None for lin in linears):
            bias = torch.cat([lin.bias.detach().float() if lin.bias is not None else torch.zeros(lin.out_features)
                              for lin in linears])
        return QuantLinear(torch.cat([b for b, _ in parts]), parts[0][1], linears[0].in_features, bias,
                           self.dense_prefill)


def quantize_model(model: torch.nn.Module, quantizer: Quantizer) -> int:
    """Replaces every plain nn.Linear of a transformers model (decoder layers and
    lm_head) with a QuantLinear, in place. Returns the bytes of weight blocks."""
    total = 0
    named = dict(model.named_modules())
    for name, module in list(named.items()):
        if type(module) is torch.nn.Linear:
            q = quantizer.linear([module], [name])
            parent_name, _, attr = name.rpartition(".")
            setattr(named[parent_name] if parent_name else model, attr, q)
            total += q.nbytes
    return total
