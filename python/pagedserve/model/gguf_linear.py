"""The ``gguf`` GEMM path: float32 linear layers computed from the GGUF's own
blocks (``--linear-impl gguf``; ``auto`` takes it where it measures faster),
of any type in F32_KERNEL_QTYPES (the quantised ones and F32 / F16 / BF16).

A model converted from a GGUF file has float32 weights that are exactly the
blocks' values (Q4_1: w = d q + m, Q8_0: w = d q, Q6_K: w = d sc (q - 32),
...: gguf-py's de-quantisation; F16, BF16: the values widened).
The kernel ``QuantizedWeight.linear_f32`` expands each block to those float32
values in registers and multiplies them with the float32 activations,
accumulating in float32: the products of a float32 GEMM on the dense weights,
summed in another order, while reading 4.5 (Q4_1), 8.5 (Q8_0), 5 (Q4_0, held
as Q4_1), 8.5 (Q5_0, held as Q8_0), 6 (Q4_K: 4-bit quants with float32
scales), 7 (Q5_1, Q5_K: 5-bit ones) or 12 (Q6_K: int8 with float32 scales per
16), 16 (F16, BF16) bits per weight instead of 32. A decode step (a few to a few dozen rows per call) is
bound by reading the weights, so this is where it pays; calls of more than
``max_rows`` rows (prefill chunks) go to the dense float32 layer the module
keeps (the model's own weights on the measured dense path). Unlike
``--quantization``, nothing is rounded: a layer takes this path only if its
de-quantised blocks equal the model's float32 weights bit for bit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..kernels import cpu_core
from . import tuner
from .gguf_format import F32_KERNEL_QTYPES, GGUFBlocks, raw_bytes
from .linear_method import LinearLayer, LinearMethod, fused_bias
from .settle import settle

logger = logging.getLogger(__name__)

# Row counts the start-up measurement times (decode batch sizes, and one prefill-like size).
TUNE_ROWS = (1, 8, 32, 128)
CACHE_NAME = "gguf_rows"  # $PAGEDSERVE_CACHE/gguf_rows.json
# max_rows of layers whose blocks serve every call: asked for by name (--linear-impl gguf), or no measured row
# count gave them up (row_bound; the largest, 128 rows, is already compute-bound on both paths: larger calls
# do the same work per row)
UNBOUNDED_ROWS = 2**31 - 1
FORCED_MAX_ROWS = UNBOUNDED_ROWS  # --linear-impl gguf: no measurement, the blocks serve every call
# How much faster (ratio of ms per pass) the dense path must measure at a row count for the blocks to give
# that count up. A dense layer holds a float32 copy of the weights, 4-7x the file's bytes (Gemma 3 270M:
# 1.9 GiB beside a 241 MiB file); a few percent at prefill sizes is not worth that, nor worth calling two
# paths' summation orders one model's (docs/benchmarks.md, "Behind the code").
DENSE_MIN_GAIN = 1.25
# The blocks kernels' revision, part of the tuner cache's key: raised whenever their speed changes (the
# package version does not change between commits), so a measurement of the older kernels is taken again.
# 2: linear_f32's scratch path runs tiles of 3 row groups x 8 rows.
BLOCKS_KERNEL_REVISION = 2


@dataclass
class GGUFTuning:
    """What GGUFFloatMethod.tune decided from.

    Attributes:
        ms: {"gguf": {rows: ms}, "dense": {rows: ms}}: one pass over the layers
            on each path (from the cache when the result was cached).
        source: "measured", "measured, not cached: <why>" or where the cached result came from.
    """

    ms: dict
    source: str


class GGUFFloatLinear(LinearLayer):
    """x [..., in_features] float32 or bfloat16 -> [..., out_features] in x's
    dtype = x @ W.T + b with W the GGUF blocks' exact float32 values: calls of
    at most ``max_rows`` rows run QuantizedWeight.linear_f32 on the blocks
    (a bfloat16 x widened to float32 exactly, the float32 sums rounded to
    bfloat16 once), larger ones run ``dense``, which holds the model's weights
    (the same values in a float32 model, rounded to bfloat16 in a bfloat16 one).

    Args:
        weight: cpu_core.QuantizedWeight of the blocks, [out_features, in_features].
        bias: [out_features] float32, or None.
        dense: a module computing the same layer on dense float32 weights, or
            None once released (GGUFFloatMethod.release_dense): the blocks then
            serve every call.
        max_rows: the largest call (rows) the blocks serve; 0: never.
    """

    def __init__(self, weight, bias: torch.Tensor | None, dense: torch.nn.Module, max_rows: int) -> None:
        super().__init__()
        self.weight_blocks, self.dense, self.max_rows = weight, dense, max_rows
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)

    @property
    def nbytes(self) -> int:
        """Bytes of the weight blocks (as the kernel stores them)."""
        return self.weight_blocks.nbytes

    @property
    def row_invariant(self) -> bool:
        """LinearLayer.row_invariant: the blocks serve every call (no dense layer
        takes the larger ones)."""
        return self.dense is None or self.max_rows >= UNBOUNDED_ROWS

    @property
    def float_logits(self) -> bool:
        """LinearLayer.float_logits: the blocks serve every call (the dense layer computes in the model's dtype)."""
        return self.dense is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # a decode step's calls are 2-D already
        if self.dense is not None and x2.shape[0] > self.max_rows:
            return self.dense(x)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        # bfloat16 rows are widened and the results rounded inside the kernel call (torch's parallel conversions
        # would leave OpenMP threads spinning on the cores the kernel's pool needs)
        out = torch.empty((x2.shape[0], self.out_features), dtype=x2.dtype)
        self.weight_blocks.linear_f32(x2, out, self.bias, torch.get_num_threads())
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)

    @property
    def prunes_greedy_logits(self) -> bool:
        """Whether greedy_logits skips work here: the blocks serve every call
        (no dense copy), no bias, Q8_0 blocks (the tied output layers of the
        packaged SmolLM2 and Gemma 3 files)."""
        return self.dense is None and self.bias is None and self.weight_blocks.prunes_greedy_logits

    def greedy_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in_features] float32 -> [M, out_features] float32 for rows that
        only take their argmax (greedy decoding): each entry is forward(x)'s
        value bit for bit or -inf, and every entry that could be its row's
        maximum holds its value, so argmax per row is forward(x)'s. An int8
        pass with a worst-case error bound per output picks the few outputs
        that could be the maximum, and only those run the exact kernel
        (QuantizedWeight.greedy_logits; csrc/backends/cpu/gemm/greedy_logits.h
        has the bound). forward(x) where prunes_greedy_logits is false."""
        if not self.prunes_greedy_logits or x.dtype != torch.float32 or x.dim() != 2:
            return self(x)
        out = torch.empty((x.shape[0], self.out_features), dtype=torch.float32)
        self.weight_blocks.greedy_logits(x.contiguous(), out, torch.get_num_threads())
        return out


class GGUFEmbedding(torch.nn.Module):
    """An embedding lookup on GGUF blocks: input_ids [T] int64 -> [T, hidden]
    ``dtype``, the rows de-quantised to exactly the model's float32 embedding
    (QuantizedWeight.embedding), times ``embed_scale`` where the model scales
    its embedding (Gemma: sqrt(hidden), as its own module does), in float32,
    then rounded once to ``dtype`` (in bfloat16 the module rounds the weight
    first: round(round(w) * s), one rounding more than here). With a tied
    output layer the blocks are the output layer's own (one copy for both).

    Args:
        weight: cpu_core.QuantizedWeight [vocab, hidden].
        embed_scale: a float32 scalar tensor, or None.
        dtype: the model's activation dtype (torch.float32 or torch.bfloat16).
    Raises (forward): KernelArgumentError for an id outside the vocabulary.
    """

    def __init__(self, weight, embed_scale: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight_blocks, self.dtype = weight, dtype
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features
        self.register_buffer("embed_scale", None if embed_scale is None else embed_scale.detach().float().clone(),
                             persistent=False)

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks (shared with a tied output layer: counted once by weight_bytes)."""
        return self.weight_blocks.nbytes

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        if ids.dtype != torch.int64 or not ids.is_contiguous():
            ids = ids.to(torch.int64).contiguous()
        out = torch.empty((ids.shape[0], self.embedding_dim), dtype=torch.float32)
        self.weight_blocks.embedding(ids, out)
        if self.embed_scale is not None:
            out = out * self.embed_scale
        if self.dtype != torch.float32:
            out = out.to(self.dtype)
        return out.reshape(*input_ids.shape, self.embedding_dim)


def why_no_gguf_path(dtype: torch.dtype, device: torch.device, gguf: GGUFBlocks | None) -> str | None:
    """Why the gguf path cannot serve this model, or None if it can (some of
    its layers may still stay dense: GGUFFloatMethod checks each)."""
    if torch.device(device).type != "cpu":
        return f"it runs on the CPU only (device {device})"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"it takes float32 or bfloat16 activations (dtype {str(dtype).removeprefix('torch.')})"
    if gguf is None:
        return "the model was not loaded from a GGUF file"
    if not any(t in F32_KERNEL_QTYPES for _, t in gguf.tensors.values()):
        return f"{gguf.path.name} has no tensors of a type the kernel reads ({', '.join(F32_KERNEL_QTYPES)})"
    return None


def step_kernel_between(num_threads: int, tokens: int = 32, num_kv_heads: int = 3, head_size: int = 64):
    """A call that runs one of the step's own pool kernels as a decode step does
    between two GEMMs: reshape_and_cache of ``tokens`` tokens' K/V ([tokens,
    num_kv_heads, head_size] float32, large enough to go parallel) into a small
    paged store, on num_threads threads. Returns the zero-argument callable."""
    g = torch.Generator().manual_seed(0)
    key = torch.randn(tokens, num_kv_heads, head_size, generator=g)
    value = torch.randn(tokens, num_kv_heads, head_size, generator=g)
    block_size = 16
    blocks = (tokens + block_size - 1) // block_size
    k_cache = torch.zeros(blocks, num_kv_heads, head_size, block_size)
    v_cache = torch.zeros(blocks, num_kv_heads, block_size, head_size)
    slots = torch.arange(tokens, dtype=torch.int64)
    return lambda: cpu_core.reshape_and_cache(key, value, k_cache, v_cache, slots, num_threads)


def row_bound(ms: dict, rows) -> int:
    """The largest call (rows) the blocks serve, from tune's measurement: the
    largest measured row count up to which the dense path was not
    DENSE_MIN_GAIN times faster at any count (0: it was at one row already);
    UNBOUNDED_ROWS when that is every measured count.

    Args:
        ms: {"gguf": {rows: ms}, "dense": {rows: ms}}, ms per pass over the layers.
        rows: the measured row counts.
    """
    max_rows = 0
    for r in sorted(rows):
        if ms["gguf"][r] > DENSE_MIN_GAIN * ms["dense"][r]:
            break
        max_rows = r
    return UNBOUNDED_ROWS if max_rows == max(rows) else max_rows


class GGUFFloatMethod(LinearMethod):
    """The linear method of the ``gguf`` path (a LinearMethod): GGUFFloatLinear
    layers on the GGUF file's own blocks, for each (fused) layer whose parts
    the file stores in one of F32_KERNEL_QTYPES (one type) and whose blocks
    de-quantise to the model's float32 weights bit for bit; it declines every
    other layer (the table's next method, the dense one, builds it).

    Args:
        gguf: the checkpoint's GGUF blocks.
        config: the transformers config (heads, for the q/k row order).
        dense: the dense method: each layer's module for calls above max_rows.
        max_rows: GGUFFloatLinear.max_rows of the layers built (tune() measures it).
        dtype: the model's dtype (torch.float32 or torch.bfloat16: the layers take it, the blocks are
            checked against it, the measurement runs in it).
        measure: finish() measures the row bound (--linear-impl auto); False: the blocks serve every
            call (--linear-impl gguf).
        batch_invariant: finish() keeps every call on the blocks whatever the measurement (a library
            GEMM's bits depend on the call's rows).
    Attributes:
        native: layers (before fusion) that run on the GGUF's blocks.
        declined: layers the file holds that it declined (blocks of a type
            the kernels do not read, or not the same values; layers the file
            has no tensor for are not counted).
        layers: the GGUFFloatLinear modules built.
        tuning: finish()'s measurement (GGUFTuning), or None.
        invariance_cost: batch invariance kept the blocks though the dense path measured much faster.
        released: what finish() dropped and moved, for the log ("" when nothing).
    """

    name = "gguf"
    ours = True
    native_step = True

    def __init__(self, gguf: GGUFBlocks, config, dense: LinearMethod, max_rows: int = FORCED_MAX_ROWS,
                 dtype: torch.dtype = torch.float32, measure: bool = False, batch_invariant: bool = True) -> None:
        self.gguf, self.dense, self.max_rows, self.dtype = gguf, dense, max_rows, dtype
        self.measure, self.batch_invariant = measure, batch_invariant
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.native, self.declined = 0, 0
        self.layers: list[GGUFFloatLinear] = []
        self.tuning: GGUFTuning | None = None
        self.invariance_cost, self.released = False, ""

    def _why_not(self, linears: list[torch.nn.Linear], names: list[str], parts) -> str | None:
        for lin, name, part in zip(linears, names, parts):
            if part is None:
                gname = self.gguf.gguf_name(name)
                entry = self.gguf.tensors.get(gname) if gname else None
                if entry is None:
                    return f"the file holds no tensor for {name}"
                return f"{gname} is {entry[1].upper()}, not a block type the kernel reads"
        types = sorted({q for _, q in parts})
        if len(types) != 1:
            return f"its parts are of different block types ({', '.join(t.upper() for t in types)})"
        return None

    def build(self, linears: list[torch.nn.Linear], names: list[str]) -> tuple[torch.nn.Module | None, str]:
        """See LinearMethod.build: a GGUFFloatLinear over the parts' blocks
        concatenated by rows, its dense layer from ``dense``; or (None, why)."""
        parts = [self.gguf.layer_blocks(name, lin.out_features, self.num_heads, self.num_kv_heads, F32_KERNEL_QTYPES)
                 for lin, name in zip(linears, names)]
        why = self._why_not(linears, names, parts)
        if why is None:
            n, k = sum(lin.out_features for lin in linears), linears[0].in_features
            weight = cpu_core.QuantizedWeight(torch.cat([b for b, _ in parts]), parts[0][1], n, k)
            values = torch.empty((n, k), dtype=torch.float32)
            weight.dequantize(values, torch.get_num_threads())
            model = torch.cat([lin.weight.detach() for lin in linears])
            if not torch.equal(values.to(model.dtype), model):  # a bfloat16 model's weights: the blocks' rounded
                why = f"the GGUF's blocks are not the model's {str(model.dtype).removeprefix('torch.')} weights"
        if why is not None:
            # a layer the file has no tensor for at all (a router, a projector) was never the blocks' to serve
            self.declined += sum(self.gguf.gguf_name(name) is not None for name in names)
            return None, why
        bias = fused_bias(linears)
        dense, _ = self.dense.build(linears, names)
        layer = GGUFFloatLinear(weight, bias, dense, self.max_rows)
        self.native += len(linears)
        self.layers.append(layer)
        return layer, f"{parts[0][1].upper()} blocks expanded exactly to float32"

    @torch.inference_mode()
    def tune(self, rows=TUNE_ROWS, rounds: int = 3, max_rounds: int = 6, use_cache: bool = True,
             clock: tuner.Clock | None = None, probe: tuner.LoadProbe | None = None) -> GGUFTuning:
        """Measures, on the first layer of each distinct shape (counted as often as
        the model has it), one pass over the layers on the blocks and on the dense
        path at each row count (tuner.measure: alternating rounds, best of each),
        and sets every layer's max_rows by row_bound (the dense path must be
        DENSE_MIN_GAIN times faster to take a row count from the blocks;
        UNBOUNDED_ROWS where it never is, and release_dense may then drop the
        dense layers). The result is
        cached per machine and shape set by the tuner's rules (never a noisy
        measurement); a cached one is applied without measuring.

        Each layer call is timed together with a call of our thread pool after
        it (step_kernel_between), as in a decode step, where our attention and
        KV-cache kernels run between the GEMMs: a dense GEMM on torch's OpenMP
        threads leaves them spinning on the cores our pool's workers then need
        (measured on a 2-core machine without AVX-512: 37.4 vs 36.4 ms per pass
        alone, but 51 vs 73 ms per 32-sequence decode step, blocks vs oneDNN)."""
        by_shape: dict[tuple[int, int], list[GGUFFloatLinear]] = {}
        for layer in self.layers:
            by_shape.setdefault((layer.in_features, layer.out_features), []).append(layer)
        what = {"shapes": sorted([k, n, len(v), v[0].weight_blocks.qtype] for (k, n), v in by_shape.items()),
                "rows": list(rows), "dense": sorted({type(v[0].dense).__name__ for v in by_shape.values()}),
                "above_largest": "blocks",  # the rule for calls above the largest measured count
                "dense_min_gain": DENSE_MIN_GAIN, "blocks_kernel": BLOCKS_KERNEL_REVISION,
                "dtype": str(self.dtype).removeprefix("torch.")}
        cache = tuner.TunerCache(CACHE_NAME)
        entry = cache.get(what) if use_cache else None
        ms_ok = entry is not None and isinstance(entry.get("ms"), dict) and {"gguf", "dense"} <= set(entry["ms"])
        if ms_ok and isinstance(entry.get("max_rows"), int):  # anything else counts as absent: measured again
            self.set_max_rows(entry["max_rows"])
            return GGUFTuning(entry.get("ms", {}), f"measured on this machine before ({cache.path})")
        g = torch.Generator().manual_seed(0)
        gguf_cases, dense_cases = [], []
        for (k, _), layers in by_shape.items():
            x = torch.randn(max(rows), k, generator=g).to(self.dtype)
            layers[0].max_rows = max(rows)
            gguf_cases.append((layers[0], x, len(layers)))
            dense_cases.append((layers[0].dense, x, len(layers)))
        measured = tuner.measure({"gguf": gguf_cases, "dense": dense_cases}, rows, rounds=rounds,
                                 max_rounds=max_rounds, after=step_kernel_between(torch.get_num_threads()),
                                 clock=clock, probe=probe)
        ms = measured.ms
        max_rows = row_bound(ms, rows)
        self.set_max_rows(max_rows)
        if use_cache:
            cache.put(what, {"max_rows": max_rows, "ms": ms}, measured)
        return GGUFTuning(ms, "measured" if measured.trusted else f"measured, not cached: {measured.why_not}")

    @property
    def serves(self) -> bool:
        """LinearMethod.serves: some layer is on the blocks and they serve calls of at least one row."""
        return self.max_rows > 0 and self.native > 0

    def finish(self, model: torch.nn.Module, lean) -> None:
        """LinearMethod.finish: measures the row bound (where ``measure``; under
        batch invariance every call stays on the blocks whatever it measured);
        where the blocks then serve every call of every layer, drops the dense
        copies and moves the embedding onto the blocks (settle); where they
        serve no call, the lean decoder's native step (built on them) goes too."""
        if self.measure and self.layers:
            self.tuning = self.tune()
            if self.batch_invariant and self.max_rows < UNBOUNDED_ROWS:
                self.invariance_cost = self.max_rows == 0
                self.set_max_rows(UNBOUNDED_ROWS)
        if not self.serves:
            if lean is not None:
                lean.native, lean.why_not_native = None, "the dense path measured much faster at one row"
            return
        if not (self.serves_all and self.declined == 0):
            return
        self.released = f"the dense copies of its {self.release_dense()} modules (a fused layer counts once) dropped"
        embedding = self.embedding(model.get_input_embeddings(), model.lm_head)
        if embedding is not None:
            shared = embedding.weight_blocks is getattr(model.lm_head, "weight_blocks", None)
            self.released += ", the embedding read from the blocks" + (" of the tied output layer" if shared else "")
        settle(model, lean, embedding)

    def _rows_served(self) -> str:
        return "calls of every size" if self.serves_all else f"calls of up to {self.max_rows} rows"

    def describe(self) -> str:
        """LinearMethod.describe: the layers on the blocks, the calls they serve, the measurement, and what
        serves the rest."""
        if not self.serves:
            return self.dense.describe() + (
                " (no layer's GGUF blocks are the model's float32 weights)" if self.tuning is None else
                f" (the dense path measured much faster here, {self.tuning.source}: {self.tuning.ms})")
        measured = "" if self.tuning is None else (
            f"; {self.tuning.source}: ms per pass at " + "/".join(map(str, self.tuning.ms["gguf"])) + " rows: " +
            ", ".join(f"{k} " + "/".join(f"{v:.2f}" for v in t.values()) for k, t in self.tuning.ms.items()))
        larger = f"no dense copy kept ({self.released})" if self.released else f"larger calls: {self.dense.describe()}"
        if self.invariance_cost:
            larger += ("; batch invariance keeps every call on the blocks though the dense path measured much "
                       "faster here (--no-batch-invariant takes it)")
        return (f"gguf: {self.native} layers on the GGUF's own blocks expanded exactly to float32 in registers, "
                f"{self._rows_served()} ({self.declined} layers dense{measured}); {larger}")

    def note(self) -> str | None:
        """LinearMethod.note: the calls the blocks serve."""
        if not self.layers:
            return None
        if self.max_rows == 0:
            return "the dense path measured much faster at one row: it serves every call"
        return self._rows_served() + ("" if self.serves_all else ", larger ones dense")

    @property
    def serves_all(self) -> bool:
        """The blocks serve calls of any size (no measured row count gave them
        up, see row_bound): the dense layers are not needed."""
        return self.max_rows >= UNBOUNDED_ROWS

    def release_dense(self) -> int:
        """Drops every built layer's dense layer (their float32 copies of the
        weights), so the blocks serve every call; only where serves_all.
        Returns how many were dropped."""
        if not self.serves_all:
            raise RuntimeError("the dense layers still serve calls above the measured row bound")
        for layer in self.layers:
            layer.dense = None
        return len(self.layers)

    def embedding(self, embed: torch.nn.Embedding, lm_head: torch.nn.Module) -> GGUFEmbedding | None:
        """The model's embedding on the GGUF's ``token_embd`` blocks (a type of
        F32_KERNEL_QTYPES) where they de-quantise to ``embed``'s weights bit for
        bit, sharing the output layer's blocks when it is tied to them, with
        the module's ``embed_scale`` where it has one; else None."""
        entry = self.gguf.tensors.get("token_embd.weight")
        if entry is None or entry[1] not in F32_KERNEL_QTYPES:
            return None
        vocab, hidden = embed.weight.shape
        scale = getattr(embed, "embed_scale", None)
        if (self.tied and getattr(lm_head, "weight_blocks", None) is not None
                and self.gguf.gguf_name("lm_head") == "token_embd.weight"):
            # the same tensor's blocks, already checked against the output layer's weight, which is the embedding's
            return GGUFEmbedding(lm_head.weight_blocks, scale, embed.weight.dtype)
        raw = raw_bytes(entry[0])
        if raw.shape[0] != vocab:
            return None
        weight = cpu_core.QuantizedWeight(raw, entry[1], vocab, hidden)
        values = torch.empty((vocab, hidden), dtype=torch.float32)
        weight.dequantize(values, torch.get_num_threads())
        if not torch.equal(values.to(embed.weight.dtype), embed.weight.detach()):
            logger.info("token_embd: the GGUF's blocks are not the model's embedding; it stays dense")
            return None
        return GGUFEmbedding(weight, scale, embed.weight.dtype)

    def set_max_rows(self, max_rows: int) -> None:
        """Sets every built layer's max_rows (rows; 0: the blocks are never used)."""
        self.max_rows = max_rows
        for layer in self.layers:
            layer.max_rows = max_rows
