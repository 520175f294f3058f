"""What a model's other tensors become once its linear layers are on our
kernel's blocks or tiles (the gguf and tiles methods' ``finish``): the
embedding as lookups in those blocks where they hold its values, tensors
with memory of their own, and the native step rebuilt on what the lean
forward now holds."""

from __future__ import annotations

import torch


def settle(model: torch.nn.Module, lean, embedding: torch.nn.Module | None) -> None:
    """Puts ``embedding`` (a GGUFEmbedding: lookups in the blocks; None: the
    model keeps its own) in the model and in ``lean`` (the lean decoder, or
    None), gives every tensor the model still holds memory of its own
    (own_memory), and rebuilds the lean decoder's native step."""
    if embedding is not None:
        model.set_input_embeddings(embedding)
        if lean is not None:
            lean.embed_tokens = embedding
    own_memory(model)
    if lean is not None:
        lean.build_native()


def own_memory(model: torch.nn.Module) -> None:
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


__all__ = ["own_memory", "settle"]
