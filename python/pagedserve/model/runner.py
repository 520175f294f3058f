"""ModelRunner: runs the model once per engine step over the flat batch the
C++ scheduler decided, and returns logits only for the tokens that sample."""

from __future__ import annotations

import torch

from .attention import AttentionMetadata, ForwardContext, forward_context


class OneDNNLinear(torch.nn.Module):
    """nn.Linear computed by oneDNN (aten::mkldnn_linear) with its weight kept in
    oneDNN's blocked layout. x: [..., in_features] dense -> [..., out_features] dense,
    same dtype as the weight."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", linear.weight.detach().to_mkldnn(), persistent=False)
        bias = linear.bias.detach().to_mkldnn() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten.mkldnn_linear(x.contiguous().to_mkldnn(), self.weight, self.bias)
        return y.to_dense()


def use_onednn_linear(model: torch.nn.Module) -> torch.nn.Module:
    """Swaps the model's nn.Linear layers for OneDNNLinear, in place.

    On CPU, oneDNN's GEMM with pre-packed weights beats the default BLAS call at
    the small row counts of decode steps (measured on a 2-core AVX-512 machine:
    the 49152 x 576 lm_head at 32 rows, 25 ms -> 14 ms; a whole 32-sequence
    SmolLM2 decode, about 20% less time). Same dtype and math, another summation
    order. Returns the model; a no-op where oneDNN is unavailable.
    """
    if not torch.backends.mkldnn.is_available():
        return model
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, OneDNNLinear(child))
    return model


class ModelRunner:
    """Executes SchedulerOutputs on a Hugging Face causal LM.

    Args:
        model: transformers causal LM loaded with attn_implementation="pagedserve".
        kv_cache: the engine's KVCache.
        backend: an attention backend module (pagedserve.kernels.get_backend).
    """

    def __init__(self, model: torch.nn.Module, kv_cache, backend) -> None:
        self.model = model
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.kv_cache = kv_cache
        self.backend = backend

    @torch.inference_mode()
    def execute(self, out, extra_logits_indices: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward pass over all scheduled tokens of all sequences.

        Args:
            out: pagedserve._core.SchedulerOutput (numpy views, int32).
            extra_logits_indices: [E] int64 positions in the flat batch whose
                logits are wanted too (prompt logprobs), or None.
        Returns:
            (logits [S, vocab] float32, S = len(out.logits_indices), in the order
            of out.sampling_seq_indices; the final hidden states [E, hidden] at
            extra_logits_indices, or None: compute_logits turns them into logits,
            a slice at a time, so E x vocab floats never exist at once).
        """
        if out.blocks_to_copy.shape[0]:  # copy-on-write decided by the scheduler, before any write
            self.kv_cache.copy_blocks(torch.from_numpy(out.blocks_to_copy))
        input_ids = torch.from_numpy(out.input_ids).long().unsqueeze(0)
        positions = torch.from_numpy(out.positions).long().unsqueeze(0)
        md = AttentionMetadata(
            slot_mapping=torch.from_numpy(out.slot_mapping).long(),
            query_start_loc=torch.from_numpy(out.query_start_loc),
            seq_lens=torch.from_numpy(out.seq_lens),
            block_tables=torch.from_numpy(out.block_tables),
        )
        with forward_context(ForwardContext(md, self.kv_cache, self.backend)):
            hidden = self.decoder(input_ids=input_ids, position_ids=positions,
                                  use_cache=False).last_hidden_state[0]
        logits = self.compute_logits(hidden[torch.from_numpy(out.logits_indices).long()])
        extra = None
        if extra_logits_indices is not None and extra_logits_indices.numel():
            extra = hidden[extra_logits_indices]
        return logits, extra

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] (model dtype) -> logits [N, vocab] float32."""
        return self.lm_head(hidden).float()
