"""Turns a loaded transformers model into what the engine runs: the linear
layers built by one decision table of linear methods (linear_method.py:
the GGUF's blocks, a float checkpoint's weights in our GEMM's tiles, the
float weights on a measured GEMM path, or quantised weights), and the
decoder on PagedServe's lean forward or native step where the architecture
has one (``--model-impl``). Runs after the start-up check's reference logits
were taken from the model as loaded."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.pytorch_utils import Conv1D

from ..kernels import cpu_core
from .gguf_format import GGUFBlocks
from .float_tiles import FloatTilesMethod, why_no_tiles
from .gguf_linear import UNBOUNDED_ROWS, GGUFEmbedding, GGUFFloatLinear, GGUFFloatMethod, why_no_gguf_path
from .lean_llama import LeanLlamaDecoder, lean_linear_shapes, why_not_lean
from .linear import DenseMethod, LinearChoice, OneDNNLinear, choose_linear_impl, describe
from .linear_method import LinearMethodTable, layer_type
from .native_step import NativeStepDecoder, why_no_native_step
from .quantization import DENSE_MIN_ROWS, QuantizedMethod, QuantLinear

logger = logging.getLogger(__name__)

QUANTIZED_POOL_SPIN_US = 100  # microseconds the CPU kernels' idle threads poll before sleeping (quantised path)


@dataclass
class PreparedModel:
    """What prepare_model did.

    Attributes:
        lean: what ModelRunner calls instead of the Hugging Face decoder: the
            lean Llama decoder, or the native step over the Hugging
            Face modules (NativeStepDecoder: Gemma 3, Qwen 2 and 3); or None.
        model_impl: "pagedserve" or "transformers", and why (for the log).
        linear_impl: the GEMM path ("torch", "onednn", "gguf", "tiles") or the quantisation ("q4", "int8").
        linear_path: one line naming the linear layers' path and why.
        weight_bytes: bytes of the weights the engine computes with.
        linear_layers: per layer type, the method that runs it and why
            (LinearMethodTable.summary: one line each).
        dense_gemm_layers: names of the linear layers some of whose calls run torch's or oneDNN's GEMM
            (dense_gemm_layers()): their bits depend on the call's row count, so batch invariance does not
            cover them.
    """

    lean: LeanLlamaDecoder | None
    model_impl: str
    linear_impl: str
    linear_path: str
    weight_bytes: int
    linear_layers: str = ""
    dense_gemm_layers: tuple[str, ...] = ()


def dense_gemm_layers(model: torch.nn.Module) -> list[str]:
    """Names (in ``model``) of the linear layers some of whose calls run a
    library GEMM (torch.nn.Linear, transformers' Conv1D (GPT-2's projections:
    torch.addmm), OneDNNLinear, or a GGUFFloatLinear's dense layer above its
    row bound): MKL and oneDNN choose their blocking, and so
    the summation order of a row, by the call's row count (checked on this
    CPU: every row of a float32 F.linear alone had other bits than in a 40-row
    call), so batch invariance does not hold for them. The GGUF blocks'
    kernels and QuantLinear's integer kernel (without its bfloat16 prefill)
    reduce each row in the same order in any call and are not listed."""
    names, covered = [], set()
    for name, module in model.named_modules():
        if isinstance(module, GGUFFloatLinear):
            if module.dense is not None:
                covered.add(id(module.dense))
                if module.max_rows < UNBOUNDED_ROWS:
                    names.append(name)
        elif isinstance(module, QuantLinear):
            if module.dense_prefill:
                names.append(name)
        elif isinstance(module, (torch.nn.Linear, Conv1D, OneDNNLinear)) and id(module) not in covered:
            names.append(name)
    return names


def describe_batch_invariance(batch_invariant: bool, backend: str, dense_layers) -> str:
    """The start-up log's account of batch invariance (EngineArgs.batch_invariant):
    "on", "off (...)", or "on, except ..." naming what does not keep it: the
    attention backend (only the cpu backend implements it) and the linear
    layers of dense_gemm_layers() (dense_layers: their names)."""
    if not batch_invariant:
        return "off (--no-batch-invariant: split-KV decodes, measured GEMM bounds)"
    gaps = []
    if backend != "cpu":
        gaps.append(f"the {backend} backend's attention (only the cpu backend's kernels reduce a query row the "
                    "same way in any step)")
    if dense_layers:
        gaps.append(f"{len(dense_layers)} linear layers on a library GEMM whose bits depend on the call's rows "
                    f"(e.g. {dense_layers[0]}; our GEMM takes GGUF blocks, or nn.Linear float32 / bfloat16 "
                    "weights whose in_features is a multiple of 32, on the CPU)")
    return "on" if not gaps else "on, except " + "; ".join(gaps)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct tensors (parameters and buffers) and quantised blocks
    a model holds; tied weights count once."""
    seen, total = set(), 0
    blocks = set()  # QuantizedWeight objects counted (a tied embedding shares its output layer's)
    for module in model.modules():
        if isinstance(module, (GGUFFloatLinear, GGUFEmbedding)):
            if id(module.weight_blocks) not in blocks:
                blocks.add(id(module.weight_blocks))
                total += module.nbytes
        elif isinstance(module, QuantLinear):
            total += module.nbytes
    for t in list(model.parameters()) + list(model.buffers()):
        try:
            key = (t.untyped_storage().data_ptr(), t.dtype)
        except (RuntimeError, NotImplementedError):  # opaque layouts
            key = id(t)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def prepare_model(model: torch.nn.Module, dtype: torch.dtype, device: torch.device, max_model_len: int, *,
                  linear_impl: str = "auto", quantization: str = "none", model_impl: str = "auto",
                  gguf_path: Path | None = None, native_step: bool = True,
                  batch_invariant: bool = True) -> PreparedModel:
    """Prepares ``model`` (a transformers causal LM on ``device``) in place.

    Args:
        linear_impl, quantization, model_impl, native_step, batch_invariant: EngineArgs' fields of the same
            names (batch_invariant: where the GGUF's blocks serve some call sizes, they serve every size, so
            a row's result never depends on which GEMM its call's row count picked).
        gguf_path: the GGUF file the model was converted from, or None (its own
            blocks serve the gguf path and --quantization).
    Raises:
        ValueError: a quantisation off the CPU, a named GEMM path that cannot run
            here, --model-impl pagedserve for an architecture without a lean forward.
    """
    config = model.config
    builder = None  # the gguf path's layer builder, where it applies
    released = ""  # what _serve_from_blocks dropped
    if model_impl == "transformers":
        why_lean = "--model-impl transformers"
    else:
        why_lean = why_not_lean(config, device)
        if why_lean is not None and model_impl == "pagedserve":
            raise ValueError(f"--model-impl pagedserve: no lean forward for this model: {why_lean}")
    table, choice = linear_methods(model, dtype, device, linear_impl, quantization, gguf_path,
                                   lean_shapes=why_lean is None, batch_invariant=batch_invariant)
    quantizer, builder, tiles = table.method(quantization), table.method("gguf"), table.method("tiles")
    impl = table.methods[0].name
    lean = None
    if why_lean is None:
        lean = LeanLlamaDecoder(model, table, max_model_len)
        model.lm_head = table([model.lm_head], ["lm_head"])
        model.model.layers = torch.nn.ModuleList()  # the lean layers hold what they need; the rest is freed
        model.pagedserve_decoder = lean
        why = "pagedserve (lean Llama forward; " + (
            "asked for)" if model_impl == "pagedserve" else "auto: a Llama-architecture model)")
    else:
        # the Hugging Face modules' own linear layers; with the tiles GPT-2's Conv1D projections too (else they
        # would stay on torch's GEMM, outside batch invariance)
        table.install(model, conv1d=tiles is not None)
        why = f"transformers ({why_lean})"
    # our kernels make all of a quantised (or gguf-path) decode step's GEMMs: their thread pool polls between
    # back-to-back calls instead of sleeping; with torch's GEMMs in between, polling would take the cores from
    # OpenMP's threads
    ours = quantization != "none" or builder is not None or tiles is not None
    cpu_core.set_thread_pool_spin_us(QUANTIZED_POOL_SPIN_US if ours else 0)
    if builder is not None:
        invariance_cost = False  # batch invariance keeps the blocks though the dense path measured much faster
        if linear_impl == "gguf" or not builder.layers:  # by name: the blocks serve every call; or none to time
            gguf_ms = None
        else:
            gguf_ms = builder.tune()
            if batch_invariant and builder.max_rows < UNBOUNDED_ROWS:
                # one GEMM for every call size, ours (a library GEMM's bits depend on the call's rows): batch
                # invariance, even where the dense path measured faster (the log gives both times)
                invariance_cost = builder.max_rows == 0
                builder.set_max_rows(UNBOUNDED_ROWS)
        if builder.max_rows > 0 and builder.native:
            if builder.serves_all and builder.declined == 0:
                released = _serve_from_blocks(model, lean, builder)
        else:
            impl = choice.impl
            cpu_core.set_thread_pool_spin_us(0)
            if lean is not None:  # the blocks serve no call: neither does the native step built on them
                lean.native, lean.why_not_native = None, "the dense path measured much faster at one row"
    if builder is None and tiles is not None and tiles.layers:
        released = _serve_from_tiles(model, lean, tiles)
    on_our_gemm = builder.max_rows > 0 if builder is not None else tiles is not None and bool(tiles.layers)
    if lean is None and on_our_gemm and model_impl != "transformers" and why_no_native_step(config, device) is None:
        # the Hugging Face modules, now on the blocks or the tiles, under a native step (they serve what it does not)
        lean = NativeStepDecoder(model, max_model_len)
    if lean is not None:
        if not native_step:
            lean.native, lean.why_not_native = None, "--no-native-step"
        why = why[:-1] + f"; {lean.describe_native()})"
    if quantization != "none":
        large = (f"; calls of {DENSE_MIN_ROWS}+ rows: de-quantised to bfloat16, torch's bfloat16 GEMM"
                 if quantizer.dense_prefill else "")
        path = (f"{quantization}: int8 activations; {quantizer.native} layers on the GGUF's own blocks, "
                f"{quantizer.requantized} quantised here to {quantizer.qtype} (kernel {_kernel_isa()}{large})")
    elif impl == "gguf":
        measured = "" if gguf_ms is None else (
            f"; {gguf_ms.source}: ms per pass at " + "/".join(map(str, gguf_ms.ms["gguf"])) + " rows: " +
            ", ".join(f"{k} " + "/".join(f"{v:.2f}" for v in t.values()) for k, t in gguf_ms.ms.items()))
        larger = (f"no dense copy kept ({released})" if released else f"larger calls: {describe(choice)}")
        if invariance_cost:
            larger += ("; batch invariance keeps every call on the blocks though the dense path measured much "
                       "faster here (--no-batch-invariant takes it)")
        path = (f"gguf: {builder.native} layers on the GGUF's own blocks expanded exactly to float32 in registers, "
                f"{_rows_served(builder)} ({builder.declined} layers dense{measured}); {larger}")
    elif impl == "tiles":
        path = (f"tiles: {tiles.native} layers on the model's own {str(dtype).removeprefix('torch.')} weights in "
                f"our exact GEMM's tiles, calls of every size (batch invariance; --no-batch-invariant takes the "
                f"measured library GEMM){released}; {tiles.declined} layers dense: {describe(choice)}")
    else:
        path = describe(choice)
        if builder is not None:
            path += (" (no layer's GGUF blocks are the model's float32 weights)" if gguf_ms is None else
                     f" (the dense path measured much faster here, {gguf_ms.source}: {gguf_ms.ms})")
    notes = {}
    if tiles is not None and tiles.layers:
        notes["tiles"] = "calls of every size"
    if builder is not None and builder.layers:
        notes["gguf"] = (_rows_served(builder) + ("" if builder.serves_all else ", larger ones dense")
                         if builder.max_rows > 0 else
                         "the dense path measured much faster at one row: it serves every call")
    return PreparedModel(lean, why, impl, path, weight_bytes(model), table.summary(notes),
                         tuple(dense_gemm_layers(model)))


def prepare_in_place(model: torch.nn.Module, max_model_len: int, counts: dict, *, model_impl: str = "auto",
                     native_step: bool = True) -> PreparedModel:
    """Prepares a model read in place from a GGUF file (gguf_load.load_gguf_in_place:
    its linear layers and embedding already on the file's blocks, which serve
    calls of every size) in place: the native step over its modules where its
    family has one (native_step.FAMILIES), else the Hugging Face modules.

    Args:
        counts: what load_gguf_in_place built ({"blocks", "dense", "embedding"}).
        model_impl: "auto" or "pagedserve" (the native step), "transformers" (the modules alone).
        native_step: False: the modules serve every step (--no-native-step).
    Raises:
        ValueError: --model-impl pagedserve for a family without a native step.
    """
    config = model.config
    why_native = "--model-impl transformers" if model_impl == "transformers" else why_no_native_step(config, "cpu")
    if why_native is not None and model_impl == "pagedserve":
        raise ValueError(f"--model-impl pagedserve: no native step for this model: {why_native}")
    cpu_core.set_thread_pool_spin_us(QUANTIZED_POOL_SPIN_US)
    lean = None
    if why_native is None:
        lean = NativeStepDecoder(model, max_model_len)
        if not native_step:
            lean.native, lean.why_not_native = None, "--no-native-step"
        why = f"pagedserve ({config.model_type} from its decoder description; {lean.describe_native()})"
    else:
        why = f"transformers ({why_native})"
    dense = f"; {counts['dense']} layers of a type the kernels do not read de-quantised to float32" if counts[
        "dense"] else ""
    path = (f"gguf: {counts['blocks']} layers on the GGUF's own blocks, read in place and expanded exactly to "
            f"float32 in registers, calls of every size; the embedding on {counts['embedding']}{dense}")
    kinds: dict[tuple[str, str], int] = {}
    for name, module in model.named_modules():
        if isinstance(module, GGUFFloatLinear):
            key = (layer_type([name]), f"gguf ({module.weight_blocks.qtype.upper()} blocks)")
        elif type(module) is torch.nn.Linear:
            key = (layer_type([name]), "torch (de-quantised float32)")
        else:
            continue
        kinds[key] = kinds.get(key, 0) + 1
    summary = "\n".join(f"{kind} x{n}: {what}" for (kind, what), n in kinds.items())
    return PreparedModel(lean, why, "gguf", path, weight_bytes(model), summary, tuple(dense_gemm_layers(model)))


def _rows_served(builder: GGUFFloatMethod) -> str:
    """Which calls the gguf layers serve, for the log: "calls of every size" or "calls of up to N rows"."""
    return "calls of every size" if builder.serves_all else f"calls of up to {builder.max_rows} rows"


def linear_methods(model: torch.nn.Module, dtype: torch.dtype, device: torch.device, linear_impl: str,
                   quantization: str, gguf_path: Path | None, lean_shapes: bool,
                   batch_invariant: bool = True) -> tuple[LinearMethodTable,
                                                                                          LinearChoice | None]:
    """The decision table of ``model``'s linear layers (not yet applied),
    with the dense GEMM path's choice (None under --quantization):

      --quantization q4|int8       [QuantizedMethod]            (lossy, opt-in)
      --linear-impl auto|gguf,     [GGUFFloatMethod, (FloatTilesMethod,) DenseMethod]
        float32 on the CPU, a GGUF   (exact: the blocks where they are the weights; the
                                     tiles take the rest under batch invariance)
      --linear-impl auto, batch    [FloatTilesMethod, DenseMethod] (exact: the model's own
        invariance, no GGUF          weights in our GEMM's tiles)
      otherwise                    [DenseMethod]                (the chooser's GEMM path)

    The dense path is measured on the shapes the engine runs (the lean
    forward's fused layers where ``lean_shapes``). Raises ValueError: a
    quantisation off the CPU, a named GEMM path that cannot run here."""
    config = model.config
    if quantization != "none":
        if device.type != "cpu":
            raise ValueError(f"--quantization {quantization} runs on the CPU only (device {device})")
        return LinearMethodTable([QuantizedMethod(quantization, config,
                                                  GGUFBlocks.read(gguf_path) if gguf_path else None,
                                                  batch_invariant=batch_invariant)]), None
    choice = choose_linear_impl(model, dtype, device, "auto" if linear_impl == "gguf" else linear_impl,
                                shapes=lean_linear_shapes(model) if lean_shapes else None)
    dense = DenseMethod(choice)
    # under batch invariance, layers without GGUF blocks take our GEMM on their own weights
    tiles = ([FloatTilesMethod(dtype)] if batch_invariant and linear_impl in ("auto", "gguf")
             and why_no_tiles(dtype, device) is None else [])
    if linear_impl in ("auto", "gguf"):
        gguf = GGUFBlocks.read(gguf_path) if gguf_path and torch.device(device).type == "cpu" else None
        why_gguf = why_no_gguf_path(dtype, device, gguf)
        if why_gguf is not None and linear_impl == "gguf":
            raise ValueError(f"--linear-impl gguf cannot run here: {why_gguf}")
        if why_gguf is None:
            return LinearMethodTable([GGUFFloatMethod(gguf, config, dense, dtype=dtype)] + tiles + [dense]), choice
    return LinearMethodTable(tiles + [dense]), choice


def _serve_from_blocks(model: torch.nn.Module, lean: LeanLlamaDecoder | None, builder: GGUFFloatMethod) -> str:
    """Where the blocks serve every call: drops the dense float32 copies of the
    linear layers, moves the embedding onto the GGUF's blocks when they hold it
    exactly (shared with a tied output layer), and rebuilds the native step on
    them (lean forward) or leaves the Hugging Face decoder reading the
    swapped modules (lean None). Returns what was dropped, for the log."""
    dropped = builder.release_dense()
    what = f"{dropped} dense layers dropped"
    embedding = builder.embedding(model.get_input_embeddings(), model.lm_head)
    if embedding is not None:
        shared = embedding.weight_blocks is getattr(model.lm_head, "weight_blocks", None)
        what += ", the embedding read from the blocks" + (" of the tied output layer" if shared else "")
    _settle(model, lean, embedding)
    return what


def _serve_from_tiles(model: torch.nn.Module, lean: LeanLlamaDecoder | None, tiles: FloatTilesMethod) -> str:
    """Where a float checkpoint's layers are on our GEMM's tiles: the embedding
    becomes lookups in the tied output layer's tiles where they give its values
    (FloatTilesMethod.tied_embedding), and the tensors the model still holds
    get memory of their own (_own_memory). Returns what changed, for the log
    ("" or "; the embedding read from the tiles of the tied output layer")."""
    embedding = tiles.tied_embedding(model.get_input_embeddings(), model.lm_head)
    _settle(model, lean, embedding)
    return "" if embedding is None else "; the embedding read from the tiles of the tied output layer"


def _settle(model: torch.nn.Module, lean: LeanLlamaDecoder | None, embedding: GGUFEmbedding | None) -> None:
    """Once the linear layers are on our kernel's blocks or tiles: puts
    ``embedding`` (lookups in them; None: the model keeps its own) in the
    model and the lean forward (the float table has no other user left),
    gives the tensors the model still holds memory of their own, and rebuilds
    the native step on what the lean forward now holds."""
    if embedding is not None:
        model.set_input_embeddings(embedding)
        if lean is not None:
            lean.embed_tokens = embedding
    _own_memory(model)
    if lean is not None:
        lean.build_native()


def _own_memory(model: torch.nn.Module) -> None:
    """Copies every tensor the prepared model still holds (norm weights, rotary
    tables, the lean layers' norms) into memory of its own. transformers loads
    a safetensors checkpoint as views of one memory-mapped file, so a single
    tensor left pointing into it keeps the whole mapping, and every page the
    load touched, resident (measured: 513 MiB of SmolLM2's float32 file after
    its dense layers were dropped)."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = torch.nn.Parameter(p.detach().clone(), requires_grad=False)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = b.clone()
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and not name.startswith("_"):
                setattr(module, name, value.clone())


def _kernel_isa() -> str:
    return cpu_core.kernel_tables()["gemm"]
