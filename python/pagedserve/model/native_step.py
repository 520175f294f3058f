"""The native decode step over a Hugging Face model's own modules, for the
decoder families without a lean forward: Gemma 3 (Gemma Team 2025, "Gemma 3
Technical Report"), Qwen 2 and Qwen 3. It is built once the gguf path has put
the modules' linear layers on the GGUF's blocks, and shares those blocks.

The C++ decoder (csrc/backends/cpu/step/native_decoder.h) takes what differs
between the families as options, read here from the modules (FAMILIES):

- Gemma 3: a scaled embedding (sqrt(hidden)), RMSNorm factors (1 + w),
  "sandwich" norms on the attention and MLP outputs, per-head q/k RMSNorm,
  GeGLU with tanh-approximated gelu, one rotary table per layer type (local
  layers base 10k, global 1M), sliding-window attention on the local layers,
  softmax scale query_pre_attn_scalar^-0.5.
- Qwen 2: Llama's layer with q/k/v biases (and sliding windows where the
  config has them); Qwen 3: per-head q/k RMSNorm instead of the biases.

Both executors of the family's description (decoder.py) run over the
modules' own weights: the native step, and the Python executor for the steps
it does not take (another attention backend, more tokens than the blocks' row
bound, ``--no-native-step``). The Hugging Face modules stay in place: they
are the reference (tests compare the logits) and serve a bfloat16 model's
steps.
"""

from __future__ import annotations

import torch

from .attention import ForwardContext, forward_context
from .decoder import FAMILIES, DecoderLayer, DecoderShape, build_native, python_forward, why_not_native
from .lean_llama import STATIC_ROPE_TYPES, NativeStepInfo

_ATTN = ("q_proj", "k_proj", "v_proj")
_MLP = ("gate_proj", "up_proj")


def _activation_name(config) -> str | None:
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)


def _rope_types(config) -> dict:
    """{layer type or "": rope parameters} of the config (one entry when every layer shares one table)."""
    params = getattr(config, "rope_parameters", None) or {}
    if params and all(isinstance(v, dict) or v is None for v in params.values()):
        return {k: v or {} for k, v in params.items()}  # per layer type (Gemma 3)
    return {"": params}


def why_no_native_step(config, device: torch.device) -> str | None:
    """Why no native step can serve a model of this transformers config on
    ``device``, or None if its family has one (its linear layers must still be
    on GGUF blocks: NativeStepDecoder checks that)."""
    if torch.device(device).type != "cpu":
        return f"its ops are CPU ops (device {device})"
    family = FAMILIES.get(getattr(config, "model_type", None))
    if family is None:
        return f"no native step for {getattr(config, 'model_type', None)} (it has one for {', '.join(FAMILIES)})"
    if _activation_name(config) not in family.activations:
        return f"the MLP activation is {_activation_name(config)}"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "attention logit soft-capping is not in the native step"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    for layer_type, params in _rope_types(config).items():
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in STATIC_ROPE_TYPES:
            return f"the {layer_type or 'model'}'s rope type {rope_type} is not a fixed table per position"
    return None


def _eps(norm: torch.nn.Module) -> float:
    """An RMSNorm module's eps (Llama-style modules call it variance_epsilon)."""
    eps = getattr(norm, "variance_epsilon", None)
    return float(norm.eps if eps is None else eps)


class NativeStepDecoder(NativeStepInfo, torch.nn.Module):
    """A decoder (a family of FAMILIES) whose steps run as one C++ call where
    they can, and on the Hugging Face decoder otherwise.

    Args:
        hf_model: a transformers causal LM whose why_no_native_step is None.
        max_model_len: positions the rotary tables cover (tokens).
    Attributes:
        native: the C++ NativeDecoder, or None (``why_not_native`` says why).
    """

    def __init__(self, hf_model, max_model_len: int) -> None:
        super().__init__()
        config = hf_model.config
        self.decoder = hf_model.model
        self.family = FAMILIES[config.model_type]
        self.max_model_len = max_model_len
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        scalar = getattr(config, "query_pre_attn_scalar", None)
        self.scale = float(scalar) ** -0.5 if scalar else self.head_dim ** -0.5
        self.native_label = "native C++ step over the modules' blocks"
        self.layer_types = list(getattr(config, "layer_types", None) or
                                ["full_attention"] * config.num_hidden_layers)
        window = getattr(config, "sliding_window", None) or 0
        self.window = window if 0 < window < max_model_len else 0  # as the attention hook: none if it masks nothing
        # the tables: one per layer type the layers have where the rope is per type (the rotary module builds
        # only those), else one for every layer ("")
        per_type = "" not in _rope_types(config)
        self.rope_types = sorted(set(self.layer_types)) if per_type else [""]
        self.rope_index = {lt: self.rope_types.index(lt) if per_type else 0 for lt in self.layer_types}
        self._probe = torch.zeros(1, dtype=torch.float32)  # the rotary module reads only its dtype and device
        self._native_linears: list[torch.nn.Module] = []
        self.build_native()

    def _factor(self, norm: torch.nn.Module) -> torch.Tensor:
        """The float32 factor an RMSNorm module multiplies the normalised value
        by, formed as the module forms it: 1 + w (Gemma) or w."""
        w = norm.weight.detach().float()
        return ((1.0 + w) if self.family.gemma_norms else w).contiguous()

    def describe_layers(self) -> list[DecoderLayer]:
        """The modules' layers as the family's description states them (decoder.DecoderLayer): the modules'
        own linear layers, float32 norm factors, each layer's rotary table and sliding window."""
        fam, layers = self.family, []
        for layer, layer_type in zip(self.decoder.layers, self.layer_types):
            a, m = layer.self_attn, layer.mlp
            pre_mlp = getattr(layer, fam.pre_mlp)
            optional = {}
            if fam.post_attn:
                optional["post_attn_layernorm"] = self._factor(getattr(layer, fam.post_attn))
            if fam.post_mlp:
                optional["post_mlp_layernorm"] = self._factor(getattr(layer, fam.post_mlp))
            if fam.qk_norm:
                optional["q_norm"], optional["k_norm"] = self._factor(a.q_norm), self._factor(a.k_norm)
            layers.append(DecoderLayer(
                [getattr(a, n) for n in _ATTN], a.o_proj, [getattr(m, n) for n in _MLP], m.down_proj,
                self._factor(layer.input_layernorm), self._factor(pre_mlp), _eps(layer.input_layernorm),
                _eps(pre_mlp), rope_table=self.rope_index[layer_type],
                sliding_window=self.window if layer_type == "sliding_attention" else 0, **optional))
        return layers

    def _rope_rows(self, positions: torch.Tensor) -> list[torch.Tensor]:
        """The step's rows of each rotary table: [T, D] float32 (cos then sin of
        each token's position times the frequencies), computed by the model's
        own rotary module as its forward does (so the very values), one per
        entry of ``self.rope_types``. Per step, not per position: at Gemma 3's
        32k positions a table would hold 32 MiB."""
        rotary = self.decoder.rotary_emb
        rows = []
        for layer_type in self.rope_types:
            cos, sin = (rotary(self._probe, positions[None], layer_type) if layer_type
                        else rotary(self._probe, positions[None]))
            half = cos.shape[-1] // 2
            rows.append(torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1).float().contiguous())
        return rows

    @torch.inference_mode()
    def build_native(self) -> None:
        """(Re)builds both executors from the modules as they are now: the
        Python one (``described``: the layers as decoder.DecoderLayer; None for
        a model that does not compute in float32, whose steps the modules run)
        and the native step (``native``; None where decoder.why_not_native, or
        the C++ decoder, refuses, with ``why_not_native`` saying why). The C++
        decoder shares the blocks (no copy)."""
        self.native, self.why_not_native, self._native_linears, self.described = None, None, [], None
        if not list(self.decoder.layers):
            self.why_not_native = "no decoder layers"
            return
        norm = self.decoder.norm
        if norm.weight.dtype == torch.float32:
            self.described = self.describe_layers()
        activation = self.family.activations[_activation_name(self.decoder.config)]
        self.shape = DecoderShape(self.num_heads, self.num_kv_heads, self.head_dim, self.scale, activation,
                                  self._factor(norm), _eps(norm))
        why = (f"the model computes in {str(norm.weight.dtype).removeprefix('torch.')} (the native step in float32)"
               if self.described is None else why_not_native(self.described, self.shape, self.decoder.embed_tokens))
        if why is not None:
            self.why_not_native = why
            return
        self._native_linears = [m for layer in self.described for m in layer.linears()]
        try:
            self.native = build_native(self.shape, self.described, self.decoder.embed_tokens)
        except ValueError as e:  # KernelArgumentError: a shape the C++ decoder does not take; Python serves
            self.why_not_native = f"the native decoder refused the weights ({e})"
            self._native_linears = []

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions: [T] int64 (the step's flat batch) -> final hidden
        states [T, hidden]: the native step where it serves this step (float32
        store, CPU backend, T within the row bound), else the Python executor
        of the same description (float32 models), else the Hugging Face decoder. Writes each layer's K/V at ctx.slot_mapping (counted in
        ctx.calls and ctx.windows, as the attention hook does). Raises
        KernelArgumentError (a ValueError) on bad ids or positions."""
        t = input_ids.shape[0]
        if (self.native is not None and t <= self.native_max_rows() and ctx.backend.name == "cpu"
                and ctx.kv_cache.store.dtype == torch.float32):
            out = torch.empty((t, self.native.hidden_size), dtype=torch.float32)
            window_plan = ctx.plan.for_window(self.window) if self.window else None
            self.native.forward(input_ids, positions, ctx.slot_mapping, ctx.kv_cache.store,
                                ctx.plan.for_window(None), out, self.scale, torch.get_num_threads(), window_plan,
                                self._rope_rows(positions))
            ctx.calls += len(self.layer_types)
            ctx.windows.update({self.window if (lt == "sliding_attention" and self.window) else None
                                for lt in self.layer_types})
            return out
        if self.described is not None:
            return python_forward(self.shape, self.described, self.decoder.embed_tokens, input_ids,
                                  torch.arange(t), self._rope_rows(positions), ctx)
        with forward_context(ctx):
            return self.decoder(input_ids=input_ids[None], position_ids=positions[None],
                                use_cache=False).last_hidden_state[0]
