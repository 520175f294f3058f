"""A GGUF file read in place: the transformers model of its config built with
empty parameters, its linear layers and embedding put straight on the file's
own blocks (GGUFFloatLinear, GGUFEmbedding: each tensor read once and held in
the kernel's layout), and only the small tensors (norms, biases) de-quantised.
No float32 copy of the weights exists, on disk or in memory: a model starts
in about the time it takes to read its file, in about its file's memory.

The names: gguf-py's tensor name map of the architecture, applied to each
parameter as transformers' ``get_gguf_hf_weights_map`` applies it, and
transformers' per-architecture tensor processors for the small tensors
(Gemma's norms are stored as 1 + w); the linear layers' rows of a ``llama``
file are moved out of llama.cpp's rotary order on the blocks themselves
(GGUFBlocks.hf_row_order). Where a layer's type is one the
kernels do not read, that layer alone is de-quantised into a float32
nn.Linear (named in the start-up log).

Which files take this path: IN_PLACE_ARCHITECTURES (the families whose
decoder the native step describes); ``why_not_in_place`` says why another
setup converts the file once instead (loader.convert_gguf).
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..config import QUANTIZATIONS
from ..errors import ModelLoadError
from ..hardware import release_free_memory
from ..kernels import cpu_core
from .gguf_format import F32_KERNEL_QTYPES, GGUFBlocks
from .gguf_linear import UNBOUNDED_ROWS, GGUFEmbedding, GGUFFloatLinear
from .linear_method import LinearMethod, LinearMethodTable

logger = logging.getLogger(__name__)

LOAD_THREADS = 8  # at most this many tensors read and repacked at once (one per core below that)
TRIM_BYTES = 64 << 20  # weights built between two trims of the C heap (_Trim)
# GGUF architectures read in place (general.architecture); their transformers model types are decoder.FAMILIES'
IN_PLACE_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")


def why_not_in_place(gguf: Path | None, architecture: str, dtype: torch.dtype, device: torch.device,
                     linear_impl: str) -> str | None:
    """Why this start cannot read ``gguf`` in place (the file is then converted
    to a float32 folder once, as before), or None if it can.

    Args:
        gguf: the GGUF file, or None (a folder or hub id: nothing to read in place).
        architecture: the file's general.architecture.
        dtype, device, linear_impl: the engine's resolved arguments.
    """
    if gguf is None:
        return "not a GGUF file"
    if torch.device(device).type != "cpu":
        return f"its blocks are read by CPU kernels (device {device})"
    if dtype != torch.float32:
        return (f"--dtype {str(dtype).removeprefix('torch.')}: the model's other tensors come from a converted "
                "float copy (its linear layers still read the file's blocks where they are exact)")
    if linear_impl in QUANTIZATIONS:
        return (f"--linear-impl {linear_impl} builds its layers beside a converted float copy (the file's own "
                "blocks where its kernels read them, the rest quantised from that copy)")
    if linear_impl not in ("auto", "gguf"):
        return f"--linear-impl {linear_impl} computes on float weights"
    if architecture not in IN_PLACE_ARCHITECTURES:
        return (f"the {architecture or 'unnamed'} architecture is not one PagedServe reads in place "
                f"({', '.join(IN_PLACE_ARCHITECTURES)})")
    return None


def _gguf_names(model: torch.nn.Module, architecture: str, config) -> tuple[dict, object]:
    """({transformers parameter name: GGUF tensor name}, the architecture's
    transformers tensor processor) for ``model``: gguf-py's tensor name map of
    the architecture (built once; transformers' get_gguf_hf_weights_map builds
    one per submodule, 7 s for SmolLM2) applied to each parameter's name, as
    that function applies it."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == architecture), None)
    if arch is None:
        raise ModelLoadError(f"gguf-py does not know the architecture '{architecture}'")
    name_map = get_tensor_name_map(arch, config.get_text_config().num_hidden_layers)
    names = {}
    for hf_name, _ in model.named_parameters(remove_duplicate=False):
        base, suffix = hf_name, ""
        if hf_name.endswith((".weight", ".bias")):
            base, suffix = hf_name.rsplit(".", 1)
            suffix = "." + suffix
        gguf_name = name_map.get_name(processor.preprocess_name(base))
        if gguf_name is not None:
            names[hf_name] = gguf_name + suffix
    return names, processor


def _small_tensor(blocks: GGUFBlocks, gname: str, processor, config_dict: dict, shape) -> torch.Tensor:
    """A small tensor (a norm's weight, a bias) de-quantised to float32 and
    processed as transformers' GGUF reader processes it, in ``shape``."""
    values = blocks.dequantized(gname)
    values = processor.process(weights=values, name=gname, tensor_key_mapping={},
                               parsed_parameters={"config": config_dict, "tensors": {}}).weights
    t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    if t.numel() != int(np.prod(shape)):
        raise ModelLoadError(f"{blocks.path.name}: {gname} holds {tuple(t.shape)}, the model wants {tuple(shape)}")
    return t.reshape(shape).clone()


class _Trim:
    """Hands the C heap's free pages back to the OS (release_free_memory) every
    TRIM_BYTES of weights built: each tensor's read buffer and the kernel's
    repacking scratch are freed into glibc's heap, which keeps them (measured:
    a peak 240 MiB above what the 0.5B model holds after loading without it)."""

    def __init__(self) -> None:
        self.pending = 0

    def add(self, nbytes: int) -> None:
        self.pending += nbytes
        if self.pending >= TRIM_BYTES:
            release_free_memory()
            self.pending = 0


def _read_weight(blocks: GGUFBlocks, gname: str, num_heads: int, num_kv_heads: int, name: str,
                 out_features: int, in_features: int):
    """The QuantizedWeight of one linear layer's tensor (read, rows in Hugging Face's order, repacked)."""
    raw, qtype = blocks.rows(gname)
    if raw.shape[0] != out_features:
        raise ModelLoadError(f"{blocks.path.name}: {gname} has {raw.shape[0]} rows, {name} wants {out_features}")
    raw = blocks.hf_row_order(gname, raw, num_heads, num_kv_heads)
    return cpu_core.QuantizedWeight(raw, qtype, out_features, in_features)


class FileBlocksMethod(LinearMethod):
    """The linear method of a GGUF read in place: a layer's tensor read from
    the file (pread), its rows put in Hugging Face's order, repacked into the
    kernel's layout (QuantizedWeight) and served by a GGUFFloatLinear for
    calls of every size (no dense copy exists). Declines a tensor of a type
    the kernels do not read (not in F32_KERNEL_QTYPES). Safe to call from
    several threads at once (the table's loader does).

    Args:
        blocks: the file's GGUFBlocks.
        plan: {layer name: (GGUF tensor name, bias [out] float32 or None)}.
        num_heads, num_kv_heads: the config's (llama.cpp's rotary row order of q and k).
    Raises (build): ModelLoadError for a tensor of another row count than the layer.
    """

    name = "gguf"
    ours = True
    native_step = True

    def __init__(self, blocks: GGUFBlocks, plan: dict, num_heads: int, num_kv_heads: int) -> None:
        self.blocks, self.plan, self.num_heads, self.num_kv_heads = blocks, plan, num_heads, num_kv_heads

    def build(self, linears: list[torch.nn.Linear], names: list[str]) -> tuple[torch.nn.Module | None, str]:
        """See LinearMethod.build (one part: the loader builds each layer alone)."""
        (linear,), (name,) = linears, names
        gname, bias = self.plan[name]
        qtype = self.blocks.index[gname][4]
        if qtype not in F32_KERNEL_QTYPES:
            return None, f"{qtype.upper()} is not a type the kernels read"
        weight = _read_weight(self.blocks, gname, self.num_heads, self.num_kv_heads, name, linear.out_features,
                              linear.in_features)
        return GGUFFloatLinear(weight, bias, None, UNBOUNDED_ROWS), f"{qtype.upper()} blocks, read in place"

    def note(self) -> str | None:
        """LinearMethod.note: the blocks serve every call."""
        return "calls of every size"


class FileDequantizedMethod(LinearMethod):
    """The fallback of a GGUF read in place: a layer whose tensor the kernels
    do not read (Q2_K, Q3_K, the IQ types) de-quantised by gguf-py into a
    float32 ``nn.Linear`` of its own (torch's GEMM). Takes every layer.

    Args:
        blocks, plan: as FileBlocksMethod's.
        processor, config_dict: transformers' tensor processor of the architecture and the config as a dict.
    """

    name = "torch"

    def __init__(self, blocks: GGUFBlocks, plan: dict, processor, config_dict: dict) -> None:
        self.blocks, self.plan, self.processor, self.config_dict = blocks, plan, processor, config_dict

    def build(self, linears: list[torch.nn.Linear], names: list[str]) -> tuple[torch.nn.Module, str]:
        """See LinearMethod.build; never declines."""
        (linear,), (name,) = linears, names
        gname, bias = self.plan[name]
        dense = torch.nn.Linear(linear.in_features, linear.out_features, bias=bias is not None)
        dense.weight = torch.nn.Parameter(_small_tensor(self.blocks, gname, self.processor, self.config_dict,
                                                        (linear.out_features, linear.in_features)),
                                          requires_grad=False)
        if bias is not None:
            dense.bias = torch.nn.Parameter(bias, requires_grad=False)
        return dense, "de-quantised float32, torch's GEMM"


@dataclass
class InPlaceLoad:
    """What load_gguf_in_place built.

    Attributes:
        table: the decision table its linear layers were built by
            ([FileBlocksMethod, FileDequantizedMethod]; summary() is the log's).
        embedding: "blocks" (lookups in the file's blocks) or "dense".
    """

    table: LinearMethodTable
    embedding: str

    @property
    def blocks(self) -> int:
        """Linear layers on the file's blocks."""
        return self.table.built(FileBlocksMethod.name)

    @property
    def dense(self) -> int:
        """Linear layers de-quantised to float32."""
        return self.table.built(FileDequantizedMethod.name)


def load_gguf_in_place(gguf: Path, config, attn_implementation: str | None = None) -> tuple[torch.nn.Module,
                                                                                          InPlaceLoad]:
    """Builds the transformers causal LM of ``config`` (read from ``gguf``'s
    metadata: source.metadata_dir) on ``gguf``'s own tensors, in float32 on
    the CPU, in eval mode.

    Returns:
        (model, InPlaceLoad): what the decision table of FileBlocksMethod and
        FileDequantizedMethod built, and what the embedding is on.
    Raises:
        ModelLoadError naming the tensors when the file lacks a tensor the
        model needs or holds one of another shape.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    blocks = GGUFBlocks.read(gguf)
    arch = blocks.architecture
    kwargs = {"dtype": torch.float32}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    with init_empty_weights(include_buffers=False):  # parameters on the meta device, buffers (rotary) real
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    text = config.get_text_config()
    num_heads = text.num_attention_heads
    num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
    names, processor = _gguf_names(model, arch, config)
    config_dict = config.to_dict()
    trim = _Trim()
    embedding_on = "dense"
    missing: list[str] = []

    def tensor_for(hf_name: str) -> str | None:
        gname = names.get(hf_name)
        if gname is None or gname not in blocks.index:
            missing.append(hf_name)
            return None
        return gname

    embed = model.get_input_embeddings()
    tied = bool(getattr(text, "tie_word_embeddings", False)) or "output.weight" not in blocks.index
    embed_name = next(n for n, m in model.named_modules() if m is embed)
    jobs, plan = [], {}  # the linear layers: (module, child name, the meta nn.Linear, name); {name: (tensor, bias)}
    for qual, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            name = f"{qual}.{child_name}" if qual else child_name
            gname = ("token_embd.weight" if tied else "output.weight") if name == "lm_head" else tensor_for(
                f"{name}.weight")
            if gname is not None and gname not in blocks.index:  # a tied output layer without its embedding
                missing.append(f"{name}.weight ({gname})")
                gname = None
            if gname is None:
                continue
            bias = None
            if child.bias is not None:
                bname = tensor_for(f"{name}.bias")
                bias = None if bname is None else _small_tensor(blocks, bname, processor, config_dict,
                                                                (child.out_features,))
            plan[name] = (gname, bias)
            jobs.append((module, child_name, child, name))
    table = LinearMethodTable([FileBlocksMethod(blocks, plan, num_heads, num_kv_heads),
                               FileDequantizedMethod(blocks, plan, processor, config_dict)])

    def install(job, layer) -> None:
        module, child_name, _, _ = job
        trim.add(getattr(layer, "nbytes", 0))
        setattr(module, child_name, layer)

    # the large tensors (an embedding-sized output layer) one at a time, so no two large read buffers and
    # repacking scratches coexist; the rest on the workers: each tensor read (pread) and repacked
    # (QuantizedWeight's constructor) there, both release the GIL
    large = [blocks.index[plan[name][0]][1] >= TRIM_BYTES for *_, name in jobs]
    for job in (j for j, is_large in zip(jobs, large) if is_large):
        install(job, table([job[2]], [job[3]]))
    with ThreadPoolExecutor(max_workers=max(1, min(os.cpu_count() or 1, LOAD_THREADS))) as pool:
        futures = [(j, pool.submit(table, [j[2]], [j[3]])) for j, is_large in zip(jobs, large) if not is_large]
        for job, future in futures:  # in order, as each is read and repacked
            install(job, future.result())
    lm_head = model.get_output_embeddings()
    entry = blocks.index.get("token_embd.weight")
    if entry is not None and entry[4] in F32_KERNEL_QTYPES:
        scale = getattr(embed, "embed_scale", None)
        if tied and getattr(lm_head, "weight_blocks", None) is not None:
            weight = lm_head.weight_blocks  # one copy of the blocks for both
        else:
            raw, qtype = blocks.rows("token_embd.weight")
            weight = cpu_core.QuantizedWeight(raw, qtype, embed.num_embeddings, embed.embedding_dim)
        model.set_input_embeddings(GGUFEmbedding(weight, scale, torch.float32))
        embedding_on = "blocks"
    elif tensor_for(f"{embed_name}.weight") is not None:
        embed.weight = torch.nn.Parameter(_small_tensor(blocks, "token_embd.weight", processor, config_dict,
                                                        tuple(embed.weight.shape)), requires_grad=False)
    # what is still on the meta device: the norms (and any other small tensor)
    for qual, module in list(model.named_modules()):
        for pname, param in list(module._parameters.items()):
            if param is None or param.device.type != "meta":
                continue
            name = f"{qual}.{pname}" if qual else pname
            gname = tensor_for(name)
            if gname is not None:
                module._parameters[pname] = torch.nn.Parameter(
                    _small_tensor(blocks, gname, processor, config_dict, tuple(param.shape)), requires_grad=False)
    if missing:
        raise ModelLoadError(f"{gguf.name} holds no tensor for {sorted(set(missing))[:8]}"
                             f"{' ...' if len(set(missing)) > 8 else ''} ({len(set(missing))} in all)")
    release_free_memory()
    return model.eval(), InPlaceLoad(table, embedding_on)


__all__ = ["IN_PLACE_ARCHITECTURES", "load_gguf_in_place", "why_not_in_place"]
