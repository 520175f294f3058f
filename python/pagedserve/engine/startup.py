"""Engine start-up (LLMEngine's builder): from EngineArgs to the parts a step
uses, in order, each decision logged with its reason:

1. device and dtype ("auto" resolved from the CPU); the model's config, its
   max_model_len and attention features; the attention backend class and its
   kernel variant;
2. the model and tokenizer (transformers), with our attention function; the
   start-up check's reference logits, from the model exactly as loaded;
3. prepare_model: the linear-layer methods, the decoder forward, the weights'
   memory;
4. the KV store (its blocks sized from kv_cache_memory), the C++ scheduler,
   the ModelRunner with its Sampler, the speculative decoder;
5. the start-up check (model/startup_check.py): a short prompt through the
   whole path against the Hugging Face forward; a model the engine would
   compute wrongly is refused here.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch
from transformers import AutoConfig

from .. import _core
from ..config import QUANTIZATIONS, EngineArgs
from ..errors import ModelLoadError
from ..hardware import cpu_capabilities, release_free_memory, resolve_dtype
from ..kernels import resolve_backend
from ..kernels.backend import AttentionSpec
from ..model.attention import register as register_attention
from ..model.features import attention_features, dynamic_rope_limit
from ..model.kv_cache import KVCache
from ..model.gguf_format import read_tensor_index
from ..model.gguf_load import InPlaceLoad, load_gguf_in_place, why_not_in_place
from ..model.loader import LoadedModel, load_config, load_model
from ..model.prepare import describe_batch_invariance, prepare_in_place, prepare_model
from ..model.source import ModelSource, resolve_source
from ..model.runner import ModelRunner
from ..model.sampler import Sampler
from ..model.startup_check import check_prompt, hf_reference_logits, refuse_what_the_check_saw, startup_check
from ..reasoning import get_parser
from ..templates import load_chat_template
from .spec_decode import make_speculative_decoder

logger = logging.getLogger(__name__)


class EngineParts:
    """What start-up built (build_engine), for LLMEngine.

    Attributes:
        device: torch.device; dtype: the resolved torch dtype; max_model_len: tokens per sequence at most.
        model, tokenizer (None with skip_tokenizer_init), model_path (its folder), model_name (as served).
        linear_impl, linear_path, linear_layers, model_impl: what prepare_model chose, in words.
        weight_bytes: the weights' memory in bytes; batch_invariance: "on" or what it excludes.
        backend: the AttentionBackend instance; kv_cache: the KVCache of the paged store.
        scheduler: pagedserve._core.Scheduler (TracingScheduler under --trace-steps).
        runner: the ModelRunner; eos_token_ids: the model's EOS ids (sorted).
        spec_decoder: the SpeculativeDecoder, or None; reasoning_parser: the reasoning parser, or None.
        kv_events: the KVEventPublisher of --kv-events-endpoint, or None.
    """


def eos_token_ids(model, tokenizer) -> list[int]:
    """The model's EOS token ids: its generation config's and the tokenizer's, sorted."""
    ids = set()
    for src in (model.generation_config.eos_token_id, getattr(tokenizer, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(src)
    return sorted(ids)


def load_in_place(source: ModelSource, path: str, hf_config,
                  skip_tokenizer_init: bool) -> tuple[LoadedModel, InPlaceLoad]:
    """The model of a GGUF read in place (gguf_load.load_gguf_in_place) with
    our attention function, and its tokenizer from the file's metadata folder
    ``path`` (None with skip_tokenizer_init). Returns (the LoadedModel, what
    load_gguf_in_place built). Raises ModelLoadError as it does."""
    from transformers import AutoTokenizer

    attention = register_attention()
    try:
        model, load = load_gguf_in_place(source.gguf, hf_config, attn_implementation=attention)
    except KeyError as e:  # transformers looks our attention function up by name; some families cannot
        if str(e).strip("'\"") != attention:
            raise
        raise ModelLoadError(f"{source.name}'s architecture does not take a custom attention implementation "
                             f"(transformers' attention interface), which PagedServe plugs into") from e
    tokenizer = None if skip_tokenizer_init else AutoTokenizer.from_pretrained(path)
    return LoadedModel(model=model, tokenizer=tokenizer, name=source.name, path=Path(path)), load


def build_engine(args: EngineArgs) -> EngineParts:
    """Builds and checks every part of an engine (the module's steps). Raises
    what LLMEngine documents."""
    parts = EngineParts()
    parts.device = torch.device(args.device)
    if parts.device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but torch sees no CUDA device")
    if parts.device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device 'mps' asked for, but torch sees no MPS device")
    parts.dtype, why_dtype = resolve_dtype(args.dtype, args.device)
    source = resolve_source(args.model)
    architecture = read_tensor_index(source.gguf)["architecture"] if source.gguf else ""
    why_converted = why_not_in_place(source.gguf, architecture, parts.dtype, parts.device, args.linear_impl)
    if why_converted is None:  # config and tokenizer from the file's metadata; the weights read below
        path, name = source.config_path(), source.name
        hf_config = AutoConfig.from_pretrained(path)
    else:
        if source.gguf is not None:
            logger.info("%s: converted to a float32 folder once, not read in place: %s", source.gguf.name,
                        why_converted)
        try:
            path, name, hf_config = load_config(args.model)
        except (KeyError, ValueError, AssertionError) as e:
            if source.gguf is None or isinstance(e, ModelLoadError):
                raise
            raise ModelLoadError(f"transformers cannot convert {source.gguf.name} ({type(e).__name__}: {e})") from e
    hf = hf_config.get_text_config()
    max_model_len = args.max_model_len or getattr(hf, "max_position_embeddings", None)
    features = attention_features(hf_config, max_model_len or sys.maxsize)
    backend_cls = resolve_backend(args.attention_backend, parts.device, parts.dtype, features)
    if max_model_len is None:
        raise ValueError(f"{name}'s config sets no max_position_embeddings: give max_model_len")
    limit = getattr(hf, "max_position_embeddings", None)
    if limit is not None and max_model_len > limit:
        raise ValueError(f"max_model_len {max_model_len} exceeds {name}'s max_position_embeddings ({limit})")
    parts.max_model_len = int(max_model_len)
    rope = dynamic_rope_limit(hf_config)
    if rope is not None and parts.max_model_len > rope[1]:
        raise ModelLoadError(
            f"{name} uses {rope[0]} RoPE scaling, whose frequencies follow the longest position in each "
            f"forward pass; in a packed batch that is another sequence's, so it is served exactly only with "
            f"max_model_len <= {rope[1]} (asked: {parts.max_model_len})")
    variant = backend_cls.active_variant()  # raises for a kernel variant this CPU cannot run
    if why_converted is None:
        loaded, in_place = load_in_place(source, path, hf_config, args.skip_tokenizer_init)
    else:
        in_place = None
        loaded = load_model(path, name, hf_config, dtype=parts.dtype, device=parts.device,
                            attn_implementation=register_attention(), skip_tokenizer_init=args.skip_tokenizer_init)
    parts.model, parts.tokenizer, parts.model_path = loaded.model, loaded.tokenizer, loaded.path
    if args.chat_template is not None:
        if parts.tokenizer is None:
            raise ValueError("chat_template needs the model's tokenizer (do not skip_tokenizer_init)")
        parts.tokenizer.chat_template = load_chat_template(args.chat_template)
    late = backend_cls.unsupported_features(attention_features(hf_config, parts.max_model_len, parts.model))
    if late:  # parameters the config did not announce (attention sinks)
        raise ModelLoadError(f"{name} needs {', '.join(late)}, which the {backend_cls.name} backend does "
                             "not implement")
    # the start-up check's reference: the model exactly as loaded, before the engine changes anything
    check_ids = check_prompt(hf.vocab_size, args.block_size, parts.max_model_len)
    try:
        reference, noise = hf_reference_logits(parts.model, check_ids)
    except Exception as e:
        raise ModelLoadError(f"{name}: the Hugging Face forward itself failed on the start-up check prompt "
                             f"({type(e).__name__}: {e})") from e
    if not torch.isfinite(reference).all():  # the weights themselves (a corrupt file), not our path
        raise ModelLoadError(f"{name}: the model's own forward gives non-finite logits on the start-up check "
                             "prompt: its weights hold NaN or infinite values (a corrupt file?)")
    if in_place is not None:
        prepared = prepare_in_place(parts.model, parts.max_model_len, in_place, model_impl=args.model_impl,
                                    native_step=args.native_step)
    else:
        prepared = prepare_model(parts.model, parts.dtype, parts.device, parts.max_model_len,
                                 linear_impl=args.linear_impl, model_impl=args.model_impl, gguf_path=source.gguf,
                                 native_step=args.native_step, batch_invariant=args.batch_invariant)
    parts.linear_impl, parts.linear_path = prepared.linear_impl, prepared.linear_path
    parts.model_impl, parts.weight_bytes = prepared.model_impl, prepared.weight_bytes
    parts.linear_layers = prepared.linear_layers
    parts.batch_invariance = describe_batch_invariance(args.batch_invariant, backend_cls.name,
                                                      prepared.dense_gemm_layers)
    parts.model_name = args.served_model_name or loaded.name
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads  # GPT-2: MHA
    block_size = args.block_size
    block_bytes = KVCache.bytes_per_block(hf.num_hidden_layers, block_size, num_kv_heads, head_dim, parts.dtype)
    num_blocks = args.num_kv_blocks or max(1, min(args.kv_cache_memory // block_bytes, 2**31 - 1))
    parts.backend = backend_cls(AttentionSpec(hf.num_attention_heads, num_kv_heads, head_dim,
                                             block_size, num_blocks, parts.dtype, parts.device,
                                             batch_invariant=args.batch_invariant))
    try:
        parts.kv_cache = KVCache(hf.num_hidden_layers, parts.backend)
    except (RuntimeError, MemoryError) as e:  # the allocator refused
        raise ValueError(f"cannot allocate a KV store of {num_blocks} blocks "
                         f"({num_blocks * block_bytes / 2**30:.1f} GiB): {e}") from e
    parts.scheduler = _core.Scheduler(
        _core.SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, parts.max_model_len,
                              args.enable_prefix_caching, args.scheduling_policy, args.watermark,
                              args.high_watermark),
        num_blocks, block_size)
    parts.scheduler.record_kv_events = args.kv_events_endpoint is not None
    if args.trace_steps is not None:  # every call into the scheduler, for `pagedserve replay`
        from .step_trace import TracingScheduler

        parts.scheduler = TracingScheduler(parts.scheduler, args.trace_steps)
    parts.eos_token_ids = eos_token_ids(parts.model, parts.tokenizer)
    parts.runner = ModelRunner(parts.model, parts.kv_cache, parts.backend, parts.max_model_len, prepared.lean,
                              Sampler(parts.eos_token_ids))
    parts.spec_decoder = make_speculative_decoder(args, parts.scheduler, parts.eos_token_ids)
    parts.reasoning_parser = get_parser(args.reasoning_parser)
    if parts.reasoning_parser is not None and parts.tokenizer is None:
        raise ValueError("--reasoning-parser needs the model's tokenizer")
    why_backend = ("auto: the highest-priority backend available here" if args.attention_backend in (None, "auto")
                   else "asked for")
    if variant:
        forced = os.environ.get("PAGEDSERVE_CPU_ISA")
        why_backend += f"; kernel variant {variant}, " + (
            "forced by PAGEDSERVE_CPU_ISA" if forced else "the best this CPU runs")
    caps = cpu_capabilities() if parts.device.type == "cpu" else None
    logger.info("dtype %s (%s)", str(parts.dtype).removeprefix("torch."), why_dtype)
    logger.info("attention backend %s on %s (%s)%s", backend_cls.name, parts.device, why_backend,
                f"; CPU {caps.arch}: {' '.join(caps.features) or 'baseline ISA only'}" if caps else "")
    logger.info("decoder forward: %s", parts.model_impl)
    logger.info("linear layers: %s", parts.linear_path)
    logger.info("linear layers by type:\n  %s", parts.linear_layers.replace("\n", "\n  "))
    logger.info("batch invariance: %s", parts.batch_invariance)
    if parts.spec_decoder is not None:
        logger.info("speculative decoding: %s, %d draft tokens, n-grams of %d..%d tokens", args.speculative,
                    args.num_speculative_tokens, args.prompt_lookup_min, args.prompt_lookup_max)
        if parts.batch_invariance != "on":
            logger.warning("speculative decoding without full batch invariance (%s): a verified token can "
                           "differ from decoding without speculation where a row's logits depend on the rows "
                           "beside it", parts.batch_invariance)
    logger.info("memory: weights %.1f MiB, KV cache %d blocks x %d tokens (%.1f MiB), max_model_len %d",
                parts.weight_bytes / 2**20, num_blocks, block_size, parts.kv_cache.nbytes / 2**20,
                parts.max_model_len)
    logger.info("scheduler: %s policy%s, max_num_seqs %d, max_num_batched_tokens %d, prefix caching %s",
                args.scheduling_policy,
                f" (watermark {args.watermark:g}, high watermark {args.high_watermark:g})"
                if args.scheduling_policy == "memory-aware" else "",
                args.max_num_seqs, args.max_num_batched_tokens, "on" if args.enable_prefix_caching else "off")
    try:
        check = startup_check(parts.runner, check_ids, reference, noise, quantized=args.linear_impl in QUANTIZATIONS)
    except Exception as e:
        raise RuntimeError(f"start-up check step failed with dtype {parts.dtype}, attention backend "
                           f"{backend_cls.name}, linear layers {parts.linear_path} ({type(e).__name__}: {e}); "
                           f"if the model's decoder is not a transformers decoder model, PagedServe cannot "
                           f"serve it") from e
    refuse_what_the_check_saw(name, check, features, hf.num_hidden_layers)
    release_free_memory()  # what loading and preparing the model freed goes back to the OS
    parts.kv_events = None
    if args.kv_events_endpoint is not None:  # last: a start-up that fails above binds no socket
        from .kv_events import KVEventPublisher

        parts.kv_events = KVEventPublisher(args.kv_events_endpoint, args.kv_events_replay_endpoint)
        parts.kv_events.publish_cleared()
        logger.info("KV-cache events: published on %s%s (vLLM's schema, docs/kv-events.md)",
                    parts.kv_events.endpoint,
                    f", replay on {parts.kv_events.replay_endpoint}" if parts.kv_events.replay_endpoint else "")
    return parts
