"""The one seam through which every linear layer of a served model is built.

A ``LinearMethod`` builds the module that computes one (possibly fused) linear
layer, x @ cat(W_i).T (+ cat(b_i)), from the model's ``nn.Linear`` parts, or
declines the layer and says why (the split of vLLM's ``LinearMethodBase``:
the method creates the layer's weights and its ``apply``; here the module it
returns is the apply). The methods:

  DenseMethod      (linear.py)        the float weights on a measured GEMM path
                                      (torch's default or oneDNN pre-packed)
  GGUFFloatMethod  (gguf_linear.py)   the GGUF's own blocks expanded exactly to
                                      float32 in registers (declines a layer
                                      whose blocks are not its float32 weights)
  FloatTilesMethod (float_tiles.py)   a float checkpoint's own float32 / bfloat16
                                      weights in the same kernel's dense tiles
                                      (batch invariance without GGUF blocks)
  QuantizedMethod  (quantization.py)  a GGUF's own blocks of any type (else
                                      Q4_1 / Q8_0 quantised here), int8
                                      activations (--quantization: lossy, opt-in)

A ``LinearMethodTable`` is the decision table: its methods in order of
preference; each layer takes the first that does not decline it. The lean
forward calls the table for its fused layers, and ``install`` puts it on a
Hugging Face model's own ``nn.Linear`` modules: there is no other route.
The table records, per layer type, which method built it and why the
preferred ones declined; ``summary()`` is the start-up log's line.

A method owns its layers' whole life: ``build`` creates each layer's weights
from the model's parts (or the GGUF's blocks), ``finish`` settles the model
once every layer is built (the gguf method measures its row bound there,
drops the dense copies and moves the embedding onto the blocks),
``describe`` is the start-up log's account of the path, and the modules it
builds answer the ``LinearLayer`` questions (their bytes, whether a row's
result depends on the call's row count, the blocks the native step runs, the
pruned greedy output layer), so no code outside a method asks a layer's class.
"""

from __future__ import annotations

import re
import threading
from abc import ABC, abstractmethod

import torch

_LAYER_INDEX = re.compile(r"^model\.layers\.\d+\.")


class LinearLayer(torch.nn.Module):
    """What every linear module a method builds answers (x [..., in_features]
    -> [..., out_features] in its forward), so that code outside the methods
    never asks a layer's class. A plain ``nn.Linear`` (or transformers'
    ``Conv1D``) left in a model is a library GEMM: linear.is_library_gemm.

    Attributes:
        weight_blocks: the cpu_core.QuantizedWeight whose ``linear_f32``
            computes this layer exactly for every call (the native step runs
            it, a tied embedding can share it), or None.
        float_logits: as an output layer it reads float32 rows whatever the
            model's dtype (a bfloat16 row is widened exactly) and writes
            float32 logits: the runner widens the hidden states before it.
    """

    weight_blocks = None
    float_logits = False

    @property
    def nbytes(self) -> int:
        """Bytes of the weights held outside the module's parameters and
        buffers (blocks in C++ memory); 0 where there are none."""
        return 0

    @property
    def row_invariant(self) -> bool:
        """Whether a row's result is the same in a call of any row count (our
        kernels sum each row in one order; a library GEMM picks its blocking,
        and so its summation order, by the call's rows)."""
        return True

    def greedy_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in_features] -> [M, out_features] for rows that only take their
        argmax: forward(x) here; a layer that can prune (GGUFFloatLinear) keeps
        only the values that could be a row's maximum exact."""
        return self(x)


class LinearMethod(ABC):
    """One way to compute linear layers.

    Attributes:
        name: the method's name in logs and tables ("torch", "onednn", "gguf",
            "tiles", "q4", "int8").
        ours: its layers run our CPU kernels (cpu_core.QuantizedWeight): our
            thread pool polls between back-to-back calls while it serves.
        native_step: its layers give the native C++ step their blocks
            (LinearLayer.weight_blocks).
    """

    name: str = ""
    ours: bool = False
    native_step: bool = False

    @property
    def serves(self) -> bool:
        """Whether the layers it built serve calls (the gguf method's measured
        row bound can leave all of them to its dense layers)."""
        return True

    def finish(self, model: torch.nn.Module, lean) -> None:
        """Called once on the table's first method after every layer is built
        and installed: settles what is the method's to settle (measurements,
        dense copies dropped, the embedding on its blocks, the native step
        rebuilt on them). ``lean``: the lean decoder or None. Default: nothing."""

    def describe(self) -> str:
        """The start-up log's account of the path (one line), as the table's first method."""
        return self.name

    def note(self) -> str | None:
        """What the start-up log adds to every layer-type line of this method
        (e.g. the calls it serves), or None."""
        return None

    @abstractmethod
    def build(self, linears: list[torch.nn.Linear], names: list[str]) -> tuple[torch.nn.Module | None, str]:
        """Builds the module computing the listed layers side by side.

        Args:
            linears: the parts, same in_features; their weights are [out_i,
                in_features] in the model's dtype, biases [out_i] or None
                (a missing bias counts as zeros when another part has one).
            names: their qualified names in the transformers model
                (``model.layers.3.self_attn.q_proj``, ``lm_head``).
        Returns:
            (module, what): module maps [..., in_features] -> [..., sum out_i]
            and ``what`` says what it runs on (e.g. "Q4_1 blocks"); or (None,
            why) when this method does not take the layer.
        Raises:
            ValueError: the layer cannot be built on this method at all (a
                start-up error, e.g. in_features not a multiple of 32 for
                --quantization).
        """


def fused_bias(modules: list[torch.nn.Module]) -> torch.Tensor | None:
    """The bias of fused parts: [sum out_features] float32, each part's bias
    (zeros for a part without one) in order; None when no part has one."""
    if all(getattr(m, "bias", None) is None for m in modules):
        return None
    return torch.cat([m.bias.detach().float() if m.bias is not None else torch.zeros(m.out_features)
                      for m in modules]).contiguous()


def as_linear(conv: torch.nn.Module) -> torch.nn.Linear:
    """transformers' Conv1D (weight [in, out], bias [out]) as the nn.Linear
    computing the same layer: weight [out, in] (a transposed copy), the same
    bias tensor."""
    linear = torch.nn.Linear(conv.nx, conv.nf, bias=False, device="meta")
    linear.weight = torch.nn.Parameter(conv.weight.detach().t().contiguous(), requires_grad=False)
    linear.bias = conv.bias
    return linear


def layer_type(names: list[str]) -> str:
    """The layer type of a (fused) layer's parts, for the log: their names
    without the layer index, joined by "+" (``self_attn.q_proj+self_attn.k_proj+
    self_attn.v_proj``, ``lm_head``)."""
    return "+".join(_LAYER_INDEX.sub("", n) for n in names)


class LinearMethodTable:
    """The decision table: ``methods`` in order of preference; a layer is built
    by the first that does not decline it. Callable as the lean forward's
    FuseLinear (linears, names) -> module.

    Args:
        methods: at least one; the last should take every layer (else
            building a layer raises ValueError naming each method's reason).
    Attributes:
        decisions: {(layer type, method name, what it runs on): [parts
            built, the reasons the preferred methods declined the first]}.
    """

    def __init__(self, methods: list[LinearMethod]) -> None:
        if not methods:
            raise ValueError("a LinearMethodTable needs at least one method")
        self.methods = list(methods)
        self.decisions: dict[str, list] = {}
        self._lock = threading.Lock()  # layers may be built on several threads (the in-place loader)

    def method(self, name: str) -> LinearMethod | None:
        """The table's method of that name, or None."""
        return next((m for m in self.methods if m.name == name), None)

    def built(self, name: str) -> int:
        """How many layers (parts, before fusion) the method ``name`` built."""
        return sum(n for (_, method, _), (n, _) in self.decisions.items() if method == name)

    @property
    def serving(self) -> LinearMethod:
        """The first method whose layers serve calls (LinearMethod.serves): the path the log names."""
        return next((m for m in self.methods if m.serves), self.methods[-1])

    def __call__(self, linears: list[torch.nn.Linear], names: list[str]) -> torch.nn.Module:
        declined = []
        for method in self.methods:
            module, what = method.build(linears, names)
            if module is None:
                declined.append(f"{method.name}: {what}")
                continue
            # one entry per (layer type, method, what it runs on): a layer type split over block types gets one each
            with self._lock:
                entry = self.decisions.setdefault((layer_type(names), method.name, what), [0, declined])
                entry[0] += len(linears)
            return module
        raise ValueError(f"no linear method takes {', '.join(names)}: {'; '.join(declined)}")

    def install(self, model: torch.nn.Module, conv1d: bool = False) -> int:
        """Replaces every plain ``nn.Linear`` of a transformers model (not
        subclasses: their forward may do more than x @ W.T + b) by what the
        table builds for it alone, in place; with ``conv1d`` also every
        transformers ``Conv1D`` (GPT-2's projections: x @ W + b, W [in, out]),
        which the table sees as the nn.Linear of W.T (as_linear). Returns how
        many were replaced."""
        from transformers.pytorch_utils import Conv1D

        n = 0
        for qual, module in list(model.named_modules()):
            for child_name, child in list(module.named_children()):
                if type(child) is torch.nn.Linear or (conv1d and type(child) is Conv1D):
                    name = f"{qual}.{child_name}" if qual else child_name
                    linear = child if type(child) is torch.nn.Linear else as_linear(child)
                    setattr(module, child_name, self([linear], [name]))
                    n += 1
        return n

    def summary(self) -> str:
        """One line per layer type for the start-up log: which method runs it,
        on what, how many parts, why the preferred methods declined, and the
        method's note (LinearMethod.note: e.g. the row bound a measurement set
        after the layers were built)."""
        notes = {m.name: m.note() for m in self.methods}
        lines, first = [], {}
        for kind, _, _ in self.decisions:
            first.setdefault(kind, len(first))
        for (kind, name, what), (n, declined) in sorted(self.decisions.items(), key=lambda e: first[e[0][0]]):
            note = (notes or {}).get(name)
            why = (f"; {note}" if note else "") + (f"; declined: {'; '.join(declined)}" if declined else "")
            lines.append(f"{kind} x{n}: {name} ({what}{why})")
        return "\n".join(lines)


__all__ = ["LinearLayer", "LinearMethod", "LinearMethodTable", "as_linear", "fused_bias", "layer_type"]
