"""The start-up check: before the engine serves, a short prompt goes through
its whole path (the prepared linear layers, the attention backend, the paged
KV store: a prefill, then a decode step that reads it back) and its logits are
compared with the Hugging Face forward of the model as loaded. Anything that
cannot run on this machine fails here, not at the first request, and a model
the engine would compute wrongly is refused with the reason."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from ..errors import ModelLoadError

logger = logging.getLogger(__name__)


@dataclass
class StartupCheck:
    """What startup_check saw.

    Attributes:
        attention_calls: attention layers that ran through our hook in one pass.
        windows: the sliding windows those layers asked for (None: none).
        max_abs_diff: largest |engine logit - Hugging Face logit| over the prompt.
        tolerance: the bound it must stay within for this dtype.
    """

    attention_calls: int
    windows: set
    max_abs_diff: float
    tolerance: float


def check_prompt(vocab_size: int, block_size: int, max_model_len: int) -> torch.Tensor:
    """The start-up check's tokens: [n + 1] int64 with n = min(8, block_size - 1,
    max_model_len - 1), fixed for reproducibility."""
    n = max(1, min(8, block_size - 1, max_model_len - 1))
    return (torch.arange(n + 1) * 7919 + 13) % vocab_size


@torch.inference_mode()
def hf_reference_logits(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The Hugging Face forward's logits of ``ids`` ([n, vocab] float32 on the
    CPU) with eager attention, and how far its sdpa attention lands from them
    (the rounding noise of this model in its dtype; 0 in float32 or where sdpa
    is unavailable). The model's attention implementation is restored after."""
    previous = model.config._attn_implementation
    device = next(model.parameters()).device

    def forward(impl: str) -> torch.Tensor:
        model.set_attn_implementation(impl)
        return model(input_ids=ids[None].to(device), use_cache=False).logits[0].float().cpu()

    try:
        eager = forward("eager")
        noise = 0.0
        if next(model.parameters()).dtype != torch.float32:
            try:
                noise = float((forward("sdpa") - eager).abs().max())
            except (ValueError, RuntimeError, NotImplementedError):  # no sdpa for this architecture
                noise = 0.0
    finally:
        model.set_attn_implementation(previous)
    return eager, noise


@torch.inference_mode()
def check_logits(runner, ids: torch.Tensor) -> tuple[torch.Tensor, int, set]:
    """The start-up check's two steps on ``ids`` ([n + 1] int64) through
    ``runner`` (a ModelRunner): a prefill of the first n tokens into blocks 0..
    (which no sequence holds yet), then one decode step of the last that reads
    them back from the paged store. Returns (logits [n + 1, vocab] float32 on
    the CPU, the attention layers the prefill ran, their sliding windows).
    Raises RuntimeError on a non-finite logit, and whatever the steps raise."""
    n, bs = ids.numel() - 1, runner.kv_cache.block_size
    blocks = np.arange((n + 1 + bs - 1) // bs, dtype=np.int32)[None, :]

    def step(start: int, count: int, logits_at: list[int]):
        return runner.forward(SimpleNamespace(
            input_ids=ids[start:start + count].numpy(), positions=np.arange(start, start + count),
            slot_mapping=np.arange(start, start + count), logits_indices=np.array(logits_at),
            query_start_loc=np.array([0, count], dtype=np.int32),
            seq_lens=np.array([start + count], dtype=np.int32),
            block_tables=blocks, blocks_to_copy=np.zeros((0, 2), dtype=np.int32)))[0]

    ours = [step(0, n, list(range(n)))]
    layers, windows = runner.last_forward.calls, set(runner.last_forward.windows)
    ours.append(step(n, 1, [0]))
    got = torch.cat(ours)
    if not bool(torch.isfinite(got).all()):
        raise RuntimeError("the start-up check step produced non-finite logits")
    return got, layers, windows


def startup_check(runner, ids: torch.Tensor, reference: torch.Tensor, noise: float = 0.0,
                  quantized: bool = False) -> StartupCheck:
    """Runs check_prompt's tokens through the engine's path (check_logits) and
    compares the logits with ``reference``. Raises whatever the steps raise.

    Args:
        runner: the engine's ModelRunner.
        ids: [n + 1] int64 token ids.
        reference: [n + 1, vocab] float32 logits of the Hugging Face forward
            (hf_reference_logits of the model as loaded, before the engine changed anything).
        noise: the spread of Hugging Face's own attention implementations on
            this prompt (bfloat16), added to the tolerance.
        quantized: the linear layers run on quantised weights and int8
            activations (--quantization): the check then only catches gross
            errors (a wrong block order, a broken kernel); accuracy is
            measured by bench/throughput.py --quantization.
    """
    got, layers, windows = check_logits(runner, ids)
    # float32 paths differ only in summation order; bfloat16 rounds every product, and its error grows
    # with depth (seen: 0.24 at 24 layers, 0.34 at 48 on tiny random models whose logits reach ~4), so in
    # bfloat16 the check catches only gross mismatches; float32 is the precise one
    depth = max(1.0, (layers / 8) ** 0.5)
    if quantized:  # 4-bit weights quantised from floats move logits by ~20% on random tiny models
        rel = 3e-1 * depth
    elif runner.backend.spec.dtype == torch.float32:
        rel = 1e-3
    else:
        rel = 5e-2 * depth
    tolerance = rel * (1.0 + float(reference.abs().max())) + 2.0 * noise
    return StartupCheck(layers, windows, float((got - reference).abs().max()), tolerance)


def refuse_what_the_check_saw(name: str, check: StartupCheck, features, num_layers: int) -> None:
    """Raises ModelLoadError when the start-up check shows the engine would
    not compute what the model computes: a layer whose attention bypassed
    our paged store, a configured sliding window no layer passed on, or
    logits that differ from the Hugging Face forward's; else logs what it saw.
    features: the model's AttentionFeatures (model/features.py)."""
    if check.attention_calls != num_layers:
        raise ModelLoadError(
            f"{name}: one forward pass made {check.attention_calls} calls to the attention function for "
            f"{num_layers} layers (PagedServe needs exactly one per layer): layers that bypass it (recurrent or "
            "custom) or call it more than once would not keep their state in the paged KV cache")
    if features.sliding_window is not None and check.windows == {None}:
        raise ModelLoadError(f"{name}'s config sets a sliding window of {features.sliding_window}, but no "
                             "layer passed it to the attention function: it cannot be applied exactly")
    if not check.max_abs_diff <= check.tolerance:
        raise ModelLoadError(
            f"{name}: the engine's logits differ from the Hugging Face forward's by {check.max_abs_diff:.3g} "
            f"(allowed {check.tolerance:.3g}) on the start-up check prompt: the architecture does something "
            "the engine does not replicate")
    logger.info("start-up check: %d attention layers through the paged store, logits within %.2g of "
                "Hugging Face's (allowed %.2g)", check.attention_calls, check.max_abs_diff, check.tolerance)
