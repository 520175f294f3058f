"""A decoder family described once, and the two executors built from that
description over the same paged KV store.

``Family`` says what differs between the families the engine runs itself
(FAMILIES: Llama, Gemma 3, Qwen 2, Qwen 3): the activation, RMSNorm's
factor (w, or Gemma's 1 + w), which norm precedes the MLP, the "sandwich"
norms on the attention and MLP outputs, per-head q/k norms. The config gives
the rest (heads, head size, RoPE variant and scaling, sliding windows,
biases, the softmax scale, the embedding's scale). ``DecoderLayer`` is one
layer as both executors read it:

- the native step (``build_native``: csrc/backends/cpu/step/native_decoder.h),
  a step's whole forward in one C++ call, the default wherever every linear
  layer is on our kernel's blocks (LinearLayer.weight_blocks) in float32;
- the Python executor (``python_forward``): the same kernels (the C++ ops of
  kernels/cpu_core.py, the layers' own modules, the attention backend) called
  one at a time in the same order, for the steps the native one does not take
  (another attention backend, a bfloat16 model, ``--no-native-step``) and for
  reading and debugging. In float32 on the cpu backend its hidden states are
  the native step's bit for bit (tests/python/test_decoder.py).

The Hugging Face modules stay the reference the tests and the start-up check
compare with, and the decoder of every architecture outside FAMILIES.
RMSNorm: Zhang & Sennrich 2019; RoPE: Su et al. 2021 (the rotate-half form);
GeGLU / SwiGLU: Shazeer 2020; Gemma 3's norms: Gemma Team 2025.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import cpu_core
from .attention import ForwardContext, attend
from .linear_method import fused_bias


@dataclass(frozen=True)
class Family:
    """How a decoder family's layer is built, beyond what its config says.

    Attributes:
        activations: the config's hidden activation names -> the step's ("silu", "gelu_tanh").
        gemma_norms: RMSNorm multiplies by (1 + w) (Gemma) rather than w.
        pre_mlp: the layer's norm applied to the residual before the MLP.
        post_attn, post_mlp: the norms on the attention / MLP outputs, or None.
        qk_norm: the attention module has per-head q_norm and k_norm.
    """

    activations: dict
    gemma_norms: bool
    pre_mlp: str
    post_attn: str | None = None
    post_mlp: str | None = None
    qk_norm: bool = False


FAMILIES = {
    "llama": Family({"silu": "silu"}, False, "post_attention_layernorm"),
    "gemma3_text": Family({"gelu_pytorch_tanh": "gelu_tanh"}, True, "pre_feedforward_layernorm",
                          "post_attention_layernorm", "post_feedforward_layernorm", qk_norm=True),
    "qwen2": Family({"silu": "silu"}, False, "post_attention_layernorm"),
    "qwen3": Family({"silu": "silu"}, False, "post_attention_layernorm", qk_norm=True),
}


@dataclass
class DecoderLayer:
    """One decoder layer as both executors read it.

    Attributes:
        qkv: modules whose outputs, concatenated, are q | k | v: [T, hidden] ->
            [T, (Hq + 2 Hkv) D] (one fused module, or the q, k and v modules).
        o_proj: [T, Hq D] -> [T, hidden].
        gate_up: modules whose outputs, concatenated, are gate | up: [T, hidden] -> [T, 2 I].
        down_proj: [T, I] -> [T, hidden].
        input_layernorm, pre_mlp_layernorm: RMSNorm factors [hidden] (Gemma's
            1 + w already formed), in the dtype the layer computes in.
        eps, eps_post: the input norm's eps (also the q/k and output norms'), the pre-MLP norm's.
        post_attn_layernorm, post_mlp_layernorm: factors [hidden] on the attention / MLP outputs, or None.
        q_norm, k_norm: per-head factors [D], or None.
        rope_table: which of the decoder's rotary tables the layer reads.
        sliding_window: tokens a query sees back (0: every earlier token).
    """

    qkv: list
    o_proj: torch.nn.Module
    gate_up: list
    down_proj: torch.nn.Module
    input_layernorm: torch.Tensor
    pre_mlp_layernorm: torch.Tensor
    eps: float
    eps_post: float
    post_attn_layernorm: torch.Tensor | None = None
    post_mlp_layernorm: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    rope_table: int = 0
    sliding_window: int = 0

    def linears(self) -> list[torch.nn.Module]:
        """Every linear module of the layer (qkv parts, o, gate/up parts, down)."""
        return [*self.qkv, self.o_proj, *self.gate_up, self.down_proj]


@dataclass
class DecoderShape:
    """What both executors need beside the layers.

    Attributes:
        num_heads, num_kv_heads, head_dim: the attention's heads and head size D.
        scale: the softmax scale (D^-0.5, or Gemma's query_pre_attn_scalar^-0.5).
        activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU).
        norm, norm_eps: the final RMSNorm's factor [hidden] and eps.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    activation: str
    norm: torch.Tensor
    norm_eps: float


def _run(parts: list, x: torch.Tensor) -> torch.Tensor:
    return parts[0](x) if len(parts) == 1 else torch.cat([p(x) for p in parts], dim=-1)


def _norm_heads(qkv: torch.Tensor, start: int, heads: int, d: int, factor: torch.Tensor, eps: float,
                threads: int) -> None:
    """RMSNorm of each head's D values in place, one call per head over the step's tokens (as the native step)."""
    for head in range(heads):
        rows = qkv[:, start + head * d:start + (head + 1) * d]
        cpu_core.rms_norm(rows, rows, factor, eps, threads)


def python_forward(shape: DecoderShape, layers: list[DecoderLayer], embed_tokens: torch.nn.Module,
                   input_ids: torch.Tensor, rope_positions: torch.Tensor, rope_tables: list[torch.Tensor],
                   ctx: ForwardContext) -> torch.Tensor:
    """The Python executor: input_ids [T] int64 -> the final norm's output
    [T, hidden] in the layers' dtype, one kernel call at a time.

    Args:
        embed_tokens: the model's embedding module (it applies its own scale).
        rope_positions: [T] int64, each token's row of the rotary tables.
        rope_tables: per table, [rows, D] float32 (cos then sin of the D/2 frequencies).
        ctx: the step's ForwardContext: each layer's K/V is written at
            ctx.slot_mapping and attended with ctx.plan (attend; counted there).
    Raises:
        KernelArgumentError (a ValueError): an id outside the vocabulary, a position past a table.
    """
    ops, threads = cpu_core, torch.get_num_threads()
    t, d = input_ids.shape[0], shape.head_dim
    hq, hk = shape.num_heads * d, shape.num_kv_heads * d
    h = embed_tokens(input_ids)
    residual = None
    for i, layer in enumerate(layers):
        if residual is None:
            residual = h
            h = torch.empty_like(residual)
            ops.rms_norm(h, residual, layer.input_layernorm, layer.eps, threads)
        else:
            ops.fused_add_rms_norm(h, residual, layer.input_layernorm, layer.eps, threads)
        qkv = _run(layer.qkv, h)
        if layer.q_norm is not None:
            _norm_heads(qkv, 0, shape.num_heads, d, layer.q_norm, layer.eps, threads)
            _norm_heads(qkv, hq, shape.num_kv_heads, d, layer.k_norm, layer.eps, threads)
        q, k, v = qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:]
        ops.rotary_embedding(rope_positions, q, k, d, rope_tables[layer.rope_table], True, threads)
        attn = attend(ctx, i, q.view(t, shape.num_heads, d), k.view(t, shape.num_kv_heads, d),
                      v.view(t, shape.num_kv_heads, d), shape.scale, layer.sliding_window or None)
        h = layer.o_proj(attn.view(t, hq))
        if layer.post_attn_layernorm is not None:
            ops.rms_norm(h, h, layer.post_attn_layernorm, layer.eps, threads)
        ops.fused_add_rms_norm(h, residual, layer.pre_mlp_layernorm, layer.eps_post, threads)
        gate_up = _run(layer.gate_up, h)
        act = torch.empty((t, gate_up.shape[1] // 2), dtype=gate_up.dtype)
        (ops.gelu_tanh_and_mul if shape.activation == "gelu_tanh" else ops.silu_and_mul)(act, gate_up, threads)
        h = layer.down_proj(act)
        if layer.post_mlp_layernorm is not None:
            ops.rms_norm(h, h, layer.post_mlp_layernorm, layer.eps, threads)
    ops.fused_add_rms_norm(h, residual, shape.norm, shape.norm_eps, threads)
    return h


def why_not_native(layers: list[DecoderLayer], shape: DecoderShape, embed_tokens: torch.nn.Module) -> str | None:
    """Why the native step cannot run these layers, or None: every linear
    module must have weight_blocks (LinearLayer: our kernel computes it for
    every call), the model must compute in float32, and the embedding must be
    float32 or on blocks."""
    for i, layer in enumerate(layers):
        for module in layer.linears():
            if getattr(module, "weight_blocks", None) is None:
                return (f"model.layers.{i} has a linear layer ({type(module).__name__}) the native step cannot "
                        "compute (it takes float32 layers on GGUF blocks or our GEMM's tiles)")
    if shape.norm.dtype != torch.float32:
        return f"the model computes in {str(shape.norm.dtype).removeprefix('torch.')} (the native step in float32)"
    if getattr(embed_tokens, "weight_blocks", None) is None and embed_tokens.weight.dtype != torch.float32:
        return f"the embedding is {embed_tokens.weight.dtype}, not float32"
    return None


def build_native(shape: DecoderShape, layers: list[DecoderLayer], embed_tokens: torch.nn.Module,
                 cos_sin_cache: torch.Tensor | None = None):
    """The native step of the described decoder: a cpu_core.NativeDecoder
    sharing the layers' blocks (no copy) and the embedding (its blocks, or its
    float32 table borrowed), with the embedding's scale where the module has
    one (Gemma's sqrt(hidden)). ``cos_sin_cache``: one rotary table by position
    [max_position, D] float32, or None (each step passes its rows). Check
    why_not_native first. Raises ValueError (KernelArgumentError) on a shape
    the C++ decoder does not take."""
    blocks = getattr(embed_tokens, "weight_blocks", None)
    table = blocks if blocks is not None else embed_tokens.weight.detach().contiguous()
    scale = getattr(embed_tokens, "embed_scale", None)
    native = cpu_core.NativeDecoder(
        table, [] if cos_sin_cache is None else cos_sin_cache, shape.norm.float().contiguous(), shape.norm_eps,
        shape.num_heads, shape.num_kv_heads, shape.head_dim,
        embed_scale=1.0 if scale is None else float(torch.as_tensor(scale).float()), activation=shape.activation)
    f32 = (lambda t: None if t is None else t.float().contiguous())
    for layer in layers:
        native.add_layer(
            [m.weight_blocks for m in layer.qkv], layer.o_proj.weight_blocks, [m.weight_blocks for m in layer.gate_up],
            layer.down_proj.weight_blocks, fused_bias(layer.qkv), fused_bias([layer.o_proj]),
            fused_bias(layer.gate_up), fused_bias([layer.down_proj]), f32(layer.input_layernorm),
            f32(layer.pre_mlp_layernorm), layer.eps, layer.eps_post, post_attn_layernorm=f32(layer.post_attn_layernorm),
            post_mlp_layernorm=f32(layer.post_mlp_layernorm), q_norm=f32(layer.q_norm), k_norm=f32(layer.k_norm),
            rope_table=layer.rope_table, sliding_window=layer.sliding_window)
    return native


__all__ = ["FAMILIES", "DecoderLayer", "DecoderShape", "Family", "build_native", "python_forward", "why_not_native"]
