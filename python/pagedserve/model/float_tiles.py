"""The ``tiles`` linear method: a float checkpoint's own weights on our exact
GEMM, so that batch invariance covers models that come without GGUF blocks.

Torch's and oneDNN's GEMMs choose their blocking, and with it the order in
which a row's products are summed, by the call's row count: the same token
gets other logits alone than in a 40-row step (dense_gemm_layers in
prepare.py). Our kernel ``QuantizedWeight.linear_f32`` sums each output along
k in order, one float32 fused multiply-add per k, in any call. Its dense tiles
(csrc/backends/cpu/gemm/kernel_table.h: ``f32``, ``bf16``) hold the weights as they are (float32: 4
bytes a weight, bfloat16: 2, widened exactly), reordered into its 16-row
tiles, so the same kernel that serves a GGUF's blocks serves a float32 or
bfloat16 checkpoint: the layers become GGUFFloatLinear modules without a dense
fallback, and the native decode step can run on them.

Used only with batch invariance on (EngineArgs.batch_invariant), on the CPU,
for float32 and bfloat16 models; ``--no-batch-invariant`` keeps the measured
library GEMM. What it costs against that GEMM is measured by
``bench/throughput.py --model DIR`` with and without ``--no-batch-invariant``
(docs/benchmarks.md).
"""

from __future__ import annotations

import torch

from ..kernels import cpu_core
from .gguf_linear import UNBOUNDED_ROWS, GGUFEmbedding, GGUFFloatLinear
from .linear_method import LinearMethod, fused_bias
from .settle import settle

# the model dtypes the tiles take, and their QuantizedWeight type
TILE_QTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
K_STEP = 32  # the tiles' k-step: in_features must be a multiple of it


def why_no_tiles(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the tiles cannot serve a model of ``dtype`` on ``device``, or None."""
    if torch.device(device).type != "cpu":
        return f"our GEMM runs on the CPU only (device {device})"
    if dtype not in TILE_QTYPES:
        return f"our GEMM takes float32 or bfloat16 weights (dtype {str(dtype).removeprefix('torch.')})"
    return None


class FloatTilesMethod(LinearMethod):
    """A LinearMethod: each (fused) layer's float weights, concatenated by rows,
    repacked into QuantizedWeight's dense tiles (``f32`` for a float32 model,
    ``bf16`` for a bfloat16 one) and computed by linear_f32 for calls of every
    size (GGUFFloatLinear without a dense layer). Declines a layer whose
    in_features is not a multiple of 32 or whose weights are not of the
    model's dtype (the table's next method, the dense one, builds it).

    Args:
        dtype: the model's dtype, torch.float32 or torch.bfloat16 (why_no_tiles).
        dense: the method that builds the layers it declines (named by describe()), or None.
    Attributes:
        native: layers (before fusion) on the tiles.
        declined: layers declined.
        layers: the GGUFFloatLinear modules built (each serves calls of every size).
        released: what finish() changed, for the log ("" or "; the embedding read from the tiles ...").
    Raises:
        ValueError: a dtype the tiles do not take.
    """

    name = "tiles"
    ours = True
    native_step = True

    def __init__(self, dtype: torch.dtype, dense: LinearMethod | None = None) -> None:
        if dtype not in TILE_QTYPES:
            raise ValueError(why_no_tiles(dtype, torch.device("cpu")))
        self.dtype, self.qtype, self.dense = dtype, TILE_QTYPES[dtype], dense
        self.released = ""
        self.native, self.declined = 0, 0
        self.layers: list[GGUFFloatLinear] = []
        self.tied_source: torch.Tensor | None = None  # the weight the output layer ("lm_head") was built from

    def build(self, linears: list[torch.nn.Linear], names: list[str]) -> tuple[torch.nn.Module | None, str]:
        """See LinearMethod.build: a GGUFFloatLinear on the parts' weights in
        dense tiles; or (None, why)."""
        k = linears[0].in_features
        dtypes = {lin.weight.dtype for lin in linears}
        why = None
        if k % K_STEP:
            why = f"in_features {k} is not a multiple of {K_STEP} (the tiles' k-step)"
        elif dtypes != {self.dtype}:
            why = f"its weights are {', '.join(sorted(str(d).removeprefix('torch.') for d in dtypes))}"
        if why is not None:
            self.declined += len(linears)
            return None, why
        if names == ["lm_head"]:
            self.tied_source = linears[0].weight
        weight = torch.cat([lin.weight.detach() for lin in linears]).contiguous()
        n = weight.shape[0]
        tiles = cpu_core.QuantizedWeight(weight.view(torch.uint8), self.qtype, n, k)
        layer = GGUFFloatLinear(tiles, fused_bias(linears), None, UNBOUNDED_ROWS)
        self.native += len(linears)
        self.layers.append(layer)
        return layer, f"the model's {str(self.dtype).removeprefix('torch.')} weights in our exact GEMM's tiles"

    def tied_embedding(self, embed: torch.nn.Embedding, lm_head: torch.nn.Module) -> GGUFEmbedding | None:
        """The embedding as lookups in the tied output layer's tiles (one copy of
        the table, not two), where ``lm_head`` is on the tiles of ``embed``'s
        very weight; else None. The lookup gives the module's values bit for
        bit: GGUFEmbedding multiplies by the scale (Gemma's sqrt(hidden)) in
        float32 and rounds once to the model's dtype; a bfloat16 module
        multiplies by its scale rounded to bfloat16 (the product of two
        bfloat16 values is exact in float32), so that rounded scale is the one
        passed."""
        weight = getattr(embed, "weight", None)
        if weight is None or not any(lm_head is layer for layer in self.layers):
            return None
        if self.tied_source is not weight:
            return None
        scale = getattr(embed, "embed_scale", None)
        if scale is not None:
            scale = torch.as_tensor(scale).detach().to(self.dtype).float()
        return GGUFEmbedding(lm_head.weight_blocks, scale, self.dtype)

    @property
    def serves(self) -> bool:
        """LinearMethod.serves: some layer is on the tiles."""
        return bool(self.layers)

    def finish(self, model: torch.nn.Module, lean) -> None:
        """LinearMethod.finish: the embedding becomes lookups in the tied output
        layer's tiles where they give its values (tied_embedding), and the
        model's remaining tensors get memory of their own (settle)."""
        if not self.layers:
            return
        embedding = self.tied_embedding(model.get_input_embeddings(), model.lm_head)
        settle(model, lean, embedding)
        if embedding is not None:
            self.released = "; the embedding read from the tiles of the tied output layer"

    def describe(self) -> str:
        """LinearMethod.describe: the layers on the tiles, and what serves the others."""
        rest = self.dense.describe() if self.dense is not None else "the table's next method"
        if not self.layers:
            return rest
        return (f"tiles: {self.native} layers on the model's own {str(self.dtype).removeprefix('torch.')} weights "
                f"in our exact GEMM's tiles, calls of every size (batch invariance; --no-batch-invariant takes the "
                f"measured library GEMM){self.released}; {self.declined} layers dense: {rest}")

    def note(self) -> str | None:
        """LinearMethod.note: the tiles serve every call."""
        return "calls of every size" if self.layers else None
