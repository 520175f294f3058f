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

from ..config import QUANTIZATIONS
from ..kernels import cpu_core
from .gguf_format import GGUFBlocks
from .float_tiles import FloatTilesMethod, why_no_tiles
from .gguf_linear import GGUFFloatMethod, why_no_gguf_path
from .gguf_load import InPlaceLoad
from .lean_llama import LeanLlamaDecoder, lean_linear_shapes, why_not_lean
from .linear import DenseMethod, choose_linear_impl, is_library_gemm
from .linear_method import LinearLayer, LinearMethodTable
from .native_step import NativeStepDecoder, why_no_native_step
from .quantization import QuantizedMethod

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
        linear_impl: the serving method's name (LinearMethodTable.serving: "torch", "onednn", "gguf",
            "tiles", "q4", "int8").
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
    library GEMM: a method's layer that says it is not row-invariant
    (LinearLayer.row_invariant: OneDNNLinear, a gguf layer whose dense copy
    takes the calls above its row bound, a quantised layer's bfloat16 prefill)
    or a torch linear layer left as it is (linear.is_library_gemm). MKL and
    oneDNN choose their blocking, and so the summation order of a row, by the
    call's row count (checked on this CPU: every row of a float32 F.linear
    alone had other bits than in a 40-row call), so batch invariance does not
    hold for them. Our kernels reduce each row in the same order in any call
    and are not listed."""
    names, inside = [], set()
    for name, module in model.named_modules():
        if id(module) in inside:  # a method's layer's own dense fallback: counted with the layer
            continue
        if isinstance(module, LinearLayer):
            inside.update(id(m) for m in module.modules())
            if not module.row_invariant:
                names.append(name)
        elif is_library_gemm(module):
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
        gaps.append(f"{len(dense_layers)} linear modules on a library GEMM (a fused layer counts once) whose bits "
                    "depend on the call's rows "
                    f"(e.g. {dense_layers[0]}; our GEMM takes GGUF blocks, or nn.Linear float32 / bfloat16 "
                    "weights whose in_features is a multiple of 32, on the CPU)")
    return "on" if not gaps else "on, except " + "; ".join(gaps)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct tensors (parameters and buffers) and blocks a
    model holds (a method's layers and the GGUF embedding report the bytes
    they hold outside their tensors as ``nbytes``; blocks shared by a tied
    embedding and output layer count once)."""
    seen, total = set(), 0
    blocks = set()  # ids of the QuantizedWeight objects (or modules) counted
    for module in model.modules():
        nbytes = getattr(module, "nbytes", None)
        if isinstance(nbytes, int) and nbytes:
            key = id(getattr(module, "weight_blocks", None) or module)
            if key not in blocks:
                blocks.add(key)
                total += nbytes
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
                  linear_impl: str = "auto", model_impl: str = "auto", gguf_path: Path | None = None,
                  native_step: bool = True, batch_invariant: bool = True) -> PreparedModel:
    """Prepares ``model`` (a transformers causal LM on ``device``) in place: the
    decision table's methods build its linear layers (linear_methods), on the
    lean forward's fused layers or the modules' own; the table's first method
    finishes the model (LinearMethod.finish); the native step goes over the
    modules where the serving method's layers feed it.

    Args:
        linear_impl, model_impl, native_step, batch_invariant: EngineArgs' fields of the same names.
        gguf_path: the GGUF file the model was converted from, or None.
    Raises:
        ValueError: a quantisation off the CPU, a named GEMM path that cannot run
            here, --model-impl pagedserve for an architecture without a lean forward.
    """
    config = model.config
    why_lean = "--model-impl transformers" if model_impl == "transformers" else why_not_lean(config, device)
    table = linear_methods(model, dtype, device, linear_impl, gguf_path, lean_shapes=why_lean is None,
                           batch_invariant=batch_invariant)
    lean = None
    if why_lean is None:
        lean = LeanLlamaDecoder(model, table, max_model_len)
        model.lm_head = table([model.lm_head], ["lm_head"])
        model.model.layers = torch.nn.ModuleList()  # the lean layers hold what they need; the rest is freed
        model.pagedserve_decoder = lean
        why = "pagedserve (lean Llama forward; " + (
            "asked for)" if model_impl == "pagedserve" else "auto: a Llama-architecture model)")
    else:  # the modules' own linear layers; on the tiles GPT-2's Conv1D too (else outside batch invariance)
        table.install(model, conv1d=table.method("tiles") is not None)
    table.methods[0].finish(model, lean)
    serving = table.serving
    # where our kernels make a step's GEMMs, their pool polls between back-to-back calls instead of sleeping;
    # between torch's GEMMs polling would take the cores from OpenMP's threads
    cpu_core.set_thread_pool_spin_us(QUANTIZED_POOL_SPIN_US if serving.ours else 0)
    if lean is None:
        why_not = why_described(config, device, model_impl, serving)
        if why_not is None:  # the family's description over the modules' own (blocks or tiles) layers
            lean = NativeStepDecoder(model, max_model_len)
            why = f"pagedserve ({config.model_type} from its decoder description)"
        elif model_impl == "pagedserve":
            raise ValueError(f"--model-impl pagedserve: no PagedServe decoder for this model (the lean forward: "
                             f"{why_lean}; the decoder description: {why_not})")
        else:
            why = ("transformers (--model-impl transformers)" if model_impl == "transformers" else
                   f"transformers: the Hugging Face modules, as no PagedServe decoder applies (not the lean "
                   f"forward: {why_lean}; not the {config.model_type} description's executors: {why_not})")
    if lean is not None:
        if not native_step:
            lean.native, lean.why_not_native = None, "--no-native-step"
        why = why[:-1] + f"; {lean.describe_native()})"
    return PreparedModel(lean, why, serving.name, table.methods[0].describe(), weight_bytes(model),
                         table.summary(), tuple(dense_gemm_layers(model)))


def why_described(config, device: torch.device, model_impl: str, serving) -> str | None:
    """Why the executors of the model family's description (NativeStepDecoder)
    cannot run a model whose linear layers the table's method ``serving``
    built, or None if they can: the family must be in decoder.FAMILIES and its
    layers float32 ones on our kernel (the gguf or tiles methods)."""
    if model_impl == "transformers":
        return "--model-impl transformers"
    why = why_no_native_step(config, device)
    if why is None and not serving.native_step:
        why = f"its {serving.name} layers are not ones it takes (float32 layers on GGUF blocks or our GEMM's tiles)"
    return why


def prepare_in_place(model: torch.nn.Module, max_model_len: int, load: InPlaceLoad, *, model_impl: str = "auto",
                     native_step: bool = True) -> PreparedModel:
    """Prepares a model read in place from a GGUF file (gguf_load.load_gguf_in_place:
    its linear layers and embedding already on the file's blocks, which serve
    calls of every size) in place: the native step over its modules where its
    family has one (decoder.FAMILIES), else the Hugging Face modules.

    Args:
        load: what load_gguf_in_place built (its decision table, the embedding's place).
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
    dense = f"; {load.dense} layers of a type the kernels do not read de-quantised to float32" if load.dense else ""
    path = (f"gguf: {load.blocks} layers on the GGUF's own blocks, read in place and expanded exactly to "
            f"float32 in registers, calls of every size; the embedding on {load.embedding}{dense}")
    return PreparedModel(lean, why, "gguf", path, weight_bytes(model), load.table.summary(),
                         tuple(dense_gemm_layers(model)))


def linear_methods(model: torch.nn.Module, dtype: torch.dtype, device: torch.device, linear_impl: str,
                   gguf_path: Path | None, lean_shapes: bool, batch_invariant: bool = True) -> LinearMethodTable:
    """The decision table of ``model``'s linear layers (not yet applied):

      --linear-impl q4|int8        [QuantizedMethod]            (lossy, opt-in)
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
    if linear_impl in QUANTIZATIONS:
        if torch.device(device).type != "cpu":
            raise ValueError(f"--linear-impl {linear_impl} (a quantisation) runs on the CPU only (device {device})")
        return LinearMethodTable([QuantizedMethod(linear_impl, config,
                                                  GGUFBlocks.read(gguf_path) if gguf_path else None,
                                                  batch_invariant=batch_invariant)])
    choice = choose_linear_impl(model, dtype, device, "auto" if linear_impl == "gguf" else linear_impl,
                                shapes=lean_linear_shapes(model) if lean_shapes else None)
    dense = DenseMethod(choice)
    # under batch invariance, layers without GGUF blocks take our GEMM on their own weights
    tiles = ([FloatTilesMethod(dtype, dense)] if batch_invariant and linear_impl in ("auto", "gguf")
             and why_no_tiles(dtype, device) is None else [])
    if linear_impl in ("auto", "gguf"):
        gguf = GGUFBlocks.read(gguf_path) if gguf_path and torch.device(device).type == "cpu" else None
        why_gguf = why_no_gguf_path(dtype, device, gguf)
        if why_gguf is not None and linear_impl == "gguf":
            raise ValueError(f"--linear-impl gguf cannot run here: {why_gguf}")
        if why_gguf is None:
            return LinearMethodTable([GGUFFloatMethod(gguf, config, dense, dtype=dtype, measure=linear_impl == "auto",
                                                      batch_invariant=batch_invariant)] + tiles + [dense])
    return LinearMethodTable(tiles + [dense])
