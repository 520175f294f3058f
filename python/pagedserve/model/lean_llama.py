"""PagedServe's lean forward for Llama-family decoders (``--model-impl``).

The Hugging Face modules run one Python ``forward`` per module per layer and
several small torch ops per norm, rotary embedding and activation. This path
runs the same weights as one flat loop over the step's T tokens:

  per layer:  [fused add +] RMSNorm -> qkv_proj (q, k, v fused in one GEMM)
              -> RoPE on q and k in place -> reshape_and_cache + paged attention
              -> o_proj -> fused add + RMSNorm -> gate_up_proj (one GEMM)
              -> SiLU-and-mul -> down_proj

(the Llama row of decoder.FAMILIES with fused qkv and gate_up layers: its
two executors, the native step and the Python one, are decoder.py's), with
RMSNorm (Zhang & Sennrich 2019), RoPE (Su et al. 2021) and SiLU-and-mul
done by the C++ CPU ops of ``kernels/cpu_core.py`` (the names and the fused-residual
scheme are vLLM's). Everything else — weights, their GEMM path (the chooser's
or a quantised one), the attention backend — is what the Hugging Face path
uses, so in float32 the two differ only in summation order (tests check the
greedy tokens are the same and the logits within 1e-4). The Hugging Face
modules stay the reference (the start-up check compares with them) and the
path for every other architecture.
"""

from __future__ import annotations

from typing import Callable

import torch

from .attention import ForwardContext
from .decoder import DecoderLayer, DecoderShape, build_native, python_forward, why_not_native
from .linear import count_shapes

# rope types whose frequencies do not depend on the sequence length (a table per position is exact)
STATIC_ROPE_TYPES = ("default", "linear", "llama3")

# Builds the module computing x @ cat(W_i).T (+ cat(b_i)) from the listed layers (same in_features), as the
# engine runs linear layers: a LinearMethodTable (pagedserve.model.linear_method). names: the qualified names.
FuseLinear = Callable[[list[torch.nn.Linear], list[str]], torch.nn.Module]


def why_not_lean(config, device: torch.device) -> str | None:
    """Why the lean forward cannot serve a model with this transformers config
    on ``device``, or None if it can (Llama architecture, SiLU MLP, no tensor
    parallel split, a rope whose table per position is exact)."""
    if device.type != "cpu":
        return f"its ops are CPU ops (device {device})"
    if getattr(config, "model_type", None) != "llama":
        return f"it implements the Llama architecture only (this model: {getattr(config, 'model_type', None)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"the MLP activation is {config.hidden_act}, not silu"
    if (getattr(config, "pretraining_tp", 1) or 1) != 1:
        return "pretraining_tp > 1 splits the linear layers"
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope type {rope_type} is not a fixed table per position"
    return None


_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # a LeanLlamaLayer's linear layers


def fused_groups(layer) -> dict[str, list[torch.nn.Linear]]:
    """The lean layer's linear layers (qkv_proj, o_proj, gate_up_proj, down_proj),
    each as the Hugging Face layer's nn.Linear modules it concatenates."""
    a, m = layer.self_attn, layer.mlp
    return {"qkv_proj": [a.q_proj, a.k_proj, a.v_proj], "o_proj": [a.o_proj],
            "gate_up_proj": [m.gate_proj, m.up_proj], "down_proj": [m.down_proj]}


def lean_linear_shapes(hf_model) -> list[tuple[int, int, bool, int]]:
    """The distinct linear shapes the lean forward runs — fused layers and the
    lm_head — as pagedserve.model.linear.linear_shapes gives them for a model:
    [(in_features, out_features, has_bias, count)], sorted."""
    groups = [g for layer in hf_model.model.layers for g in fused_groups(layer).values()] + [[hf_model.lm_head]]
    return count_shapes((group[0].in_features, sum(lin.out_features for lin in group),
                         any(lin.bias is not None for lin in group)) for group in groups)


class LeanLlamaLayer(torch.nn.Module):
    """One decoder layer's weights in the lean path's form.

    Attributes:
        qkv_proj: [T, hidden] -> [T, (Hq + 2 Hkv) D] (q, k, v rows concatenated).
        o_proj: [T, Hq D] -> [T, hidden].
        gate_up_proj: [T, hidden] -> [T, 2 I] (gate rows, then up rows).
        down_proj: [T, I] -> [T, hidden].
        input_layernorm, post_attention_layernorm: [hidden] RMSNorm weights.
    """

    def __init__(self, layer, fuse: FuseLinear, prefix: str) -> None:
        super().__init__()
        names = {id(mod): name for name, mod in layer.named_modules()}
        for attr, linears in fused_groups(layer).items():
            setattr(self, attr, fuse(linears, [f"{prefix}.{names[id(lin)]}" for lin in linears]))
        self.input_layernorm = layer.input_layernorm.weight.detach()
        self.post_attention_layernorm = layer.post_attention_layernorm.weight.detach()
        self.eps = float(layer.input_layernorm.variance_epsilon)
        self.eps_post = float(layer.post_attention_layernorm.variance_epsilon)

    def described(self) -> DecoderLayer:
        """The layer as the Llama family's description states it (decoder.DecoderLayer: fused qkv and gate_up)."""
        return DecoderLayer([self.qkv_proj], self.o_proj, [self.gate_up_proj], self.down_proj, self.input_layernorm,
                            self.post_attention_layernorm, self.eps, self.eps_post)


class NativeStepInfo:
    """What a decoder with a native decode step says about it: ``native`` (the
    C++ NativeDecoder, or None with ``why_not_native``) runs on the GGUF
    layers ``_native_linears``; ``native_label`` names it in the log."""

    native_label = "native C++ step"

    def native_max_rows(self) -> int:
        """The largest step (tokens) the native decode step serves: the GGUF
        layers' row bound (0 without a native step)."""
        if self.native is None:
            return 0
        return min(module.max_rows for module in self._native_linears)

    def describe_native(self) -> str:
        """One line for the start-up log: where the native decode step runs, or why not."""
        if self.native is None:
            return f"no native decode step ({self.why_not_native})"
        from .gguf_linear import UNBOUNDED_ROWS

        rows = self.native_max_rows()
        return f"{self.native_label} for steps of " + ("every size" if rows >= UNBOUNDED_ROWS
                                                         else f"up to {rows} tokens")


class LeanLlamaDecoder(NativeStepInfo, torch.nn.Module):
    """The Llama decoder (embeddings, layers, final norm) as one flat loop.

    Args:
        hf_model: a transformers LlamaForCausalLM (why_not_lean(config) is None).
        fuse: how to build each (fused) linear layer (see FuseLinear).
        max_model_len: positions the rotary table covers (tokens).
    Raises:
        ValueError if why_not_lean(config, cpu) gives a reason.
    """

    def __init__(self, hf_model, fuse: FuseLinear, max_model_len: int) -> None:
        super().__init__()
        config = hf_model.config
        why = why_not_lean(config, torch.device("cpu"))
        if why is not None:
            raise ValueError(f"no lean forward for this model: {why}")
        inner = hf_model.model
        self.embed_tokens = inner.embed_tokens
        self.layers = torch.nn.ModuleList(LeanLlamaLayer(layer, fuse, f"model.layers.{i}")
                                          for i, layer in enumerate(inner.layers))
        self.norm = inner.norm.weight.detach()
        self.norm_eps = float(inner.norm.variance_epsilon)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_dim ** -0.5
        # the same float32 cos/sin Hugging Face's rotary module computes for each position (times its attention
        # scaling), as vLLM's cos_sin_cache: [max_model_len, D] = cos of the D/2 frequencies, then their sin
        positions = torch.arange(max_model_len)[None]
        probe = torch.zeros(1, dtype=torch.float32)
        cos, sin = inner.rotary_emb(probe, position_ids=positions)
        half = self.head_dim // 2
        self.register_buffer("cos_sin_cache", torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1).float()
                             .contiguous(), persistent=False)
        self.build_native()

    def build_native(self) -> None:
        """(Re)builds both executors of the Llama description from the layers
        as they are now (decoder.py): the Python one, and the native step
        (``self.native``; None, with ``self.why_not_native``, where it cannot
        run). Call it after changing a layer."""
        self.described = [layer.described() for layer in self.layers]
        self.shape = DecoderShape(self.num_heads, self.num_kv_heads, self.head_dim, self.scale, "silu", self.norm,
                                  self.norm_eps)
        # the layers whose row bound (set by the gguf tuner) bounds the native step
        self._native_linears = [m for layer in self.described for m in layer.linears()]
        self.native, self.why_not_native = None, why_not_native(self.described, self.shape, self.embed_tokens)
        if self.why_not_native is None:
            try:
                self.native = build_native(self.shape, self.described, self.embed_tokens, self.cos_sin_cache)
            except ValueError as e:  # KernelArgumentError: a shape the C++ decoder does not take; Python serves
                self.why_not_native = f"the native decoder refused the weights ({e})"

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions: [T] int64 (the step's flat batch) -> final hidden
        states [T, hidden] in the model's dtype. Writes each layer's K/V into the
        paged store at ctx.slot_mapping and attends with ctx.plan (counted in
        ctx.calls, as the Hugging Face path's attention hook does). Raises
        KernelArgumentError (a ValueError) on a position past the rotary table."""
        t = input_ids.shape[0]
        if (self.native is not None and t <= self.native_max_rows() and ctx.backend.name == "cpu"
                and ctx.kv_cache.store.dtype == torch.float32):
            # the same kernels in the same order in one C++ call (native_decoder.h): bit-identical hidden states
            out = torch.empty((t, self.native.hidden_size), dtype=torch.float32)
            self.native.forward(input_ids, positions, ctx.slot_mapping, ctx.kv_cache.store, ctx.plan.for_window(None),
                                out, self.scale, torch.get_num_threads())
            ctx.calls += len(self.layers)
            ctx.windows.add(None)
            return out
        return python_forward(self.shape, self.described, self.embed_tokens, input_ids, positions,
                              [self.cos_sin_cache], ctx)
