"""Loading refuses what would serve a wrong model: a checkpoint with a missing
or an extra tensor (transformers would initialise the missing one at random),
attention the backends do not compute (ALiBi, sinks) — refused from the
config, before any weight is read — and, through the start-up check against
the Hugging Face forward, any architecture the engine would compute wrongly."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve import LLM, SamplingParams
from pagedserve.errors import ModelLoadError, PagedServeError
from conftest import hf_greedy


@pytest.fixture
def tiny_copy(tiny_llama_dir, tmp_path):
    """A writable copy of the tiny Llama and its state dict."""
    import shutil

    path = tmp_path / "tiny"
    shutil.copytree(tiny_llama_dir, path)
    return path, load_file(path / "model.safetensors")


def _drop(sd):
    del sd["model.layers.1.mlp.up_proj.weight"]


def _add(sd):
    sd["model.layers.0.self_attn.surprise.weight"] = torch.zeros(4)


def _reshape(sd):
    sd["model.norm.weight"] = torch.ones(63)


@pytest.mark.parametrize("change,message", [
    (_drop, r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]"),
    (_add, r"unexpected tensors \['model.layers.0.self_attn.surprise.weight'\]"),
    (_reshape, r"tensors of the wrong shape.*model.norm.weight"),
], ids=["missing", "extra", "mis-shaped"])
def test_a_checkpoint_that_does_not_match_fails_naming_the_tensor(tiny_copy, change, message):
    path, sd = tiny_copy
    change(sd)
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=message):
        LLM(model=str(path), skip_tokenizer_init=True, num_kv_blocks=8)


def _config_only(tmp_path, config):
    config.save_pretrained(tmp_path)  # no weights: refusal must come before loading them
    return str(tmp_path)


def _small(cls, **kw):
    return cls(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, max_position_embeddings=256, **kw)


def test_a_window_no_request_can_exceed_is_served_exactly(tmp_path):
    """max_model_len <= window: the window never masks a key, so the model is
    served, and its greedy tokens equal Hugging Face's."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    MistralForCausalLM(_small(MistralConfig, sliding_window=64, initializer_range=0.15)).save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), max_model_len=64, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=16)
    prompts = [[3, 4, 5], list(range(10, 40))]
    got = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)]
    assert got == hf_greedy(str(tmp_path), prompts, 12)


@pytest.mark.parametrize("family,feature", [
    ("bloom", "ALiBi"),
    ("gpt_oss", "attention sinks"),
])
def test_attention_the_backends_lack_is_refused_with_the_reason(tmp_path, family, feature):
    import transformers

    if family == "bloom":
        config = transformers.BloomConfig(vocab_size=128, hidden_size=32, n_layer=2, n_head=4)
    else:
        config = _small(transformers.GptOssConfig, num_local_experts=2, num_experts_per_tok=1)
    with pytest.raises(PagedServeError, match=feature):
        LLM(model=_config_only(tmp_path, config), skip_tokenizer_init=True)


def test_a_model_whose_logits_the_engine_would_get_wrong_is_refused(tmp_path, monkeypatch):
    """The start-up check compares the engine's logits with the Hugging Face
    forward's: an architecture-specific step the engine did not replicate (here
    Granite's logits scaling, with the engine's handling of it switched off)
    refuses the model instead of serving wrong logits."""
    from families import build

    from pagedserve.model import runner

    path = build("granite", tmp_path)
    LLM(model=path, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=8)  # served: the engine replicates it
    monkeypatch.setattr(runner, "logits_transform", lambda config: None)
    with pytest.raises(ModelLoadError, match="logits differ from the Hugging Face forward"):
        LLM(model=path, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=8)


def test_a_layer_that_bypasses_the_paged_store_is_refused(tiny_llama_dir, monkeypatch):
    """A layer whose attention does not come through transformers' attention
    interface (a recurrent or custom layer) would compute over the current chunk
    only: refused at start-up, with how many layers came through."""
    from transformers.models.llama import modeling_llama

    forward = modeling_llama.LlamaAttention.forward

    def bypass_in_layer_1(self, hidden_states, *args, **kwargs):
        if self.layer_idx == 1:
            self.config._attn_implementation = "eager"
            try:
                return forward(self, hidden_states, *args, **kwargs)
            finally:
                self.config._attn_implementation = "pagedserve"
        return forward(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", bypass_in_layer_1)
    with pytest.raises(ModelLoadError, match="made 1 calls to the attention function for 2 layers"):
        LLM(model=tiny_llama_dir, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=8,
            model_impl="transformers")  # the Hugging Face layers (the lean forward has no hook to bypass)


def test_the_check_compares_with_the_model_as_loaded_not_as_the_engine_changed_it(tiny_llama_dir, monkeypatch):
    """The reference logits come from the model before the engine swaps its
    linear layers: a swapped layer that computed something else is caught."""
    from pagedserve.model import linear

    forward = linear.OneDNNLinear.forward
    monkeypatch.setattr(linear.OneDNNLinear, "forward", lambda self, x: forward(self, x) * 1.01)
    with pytest.raises(ModelLoadError, match="logits differ"):
        LLM(model=tiny_llama_dir, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=8, linear_impl="onednn")


def test_longrope_is_served_only_below_its_original_context(tmp_path):
    """Phi-3's longrope picks its frequencies from the longest position in a
    forward pass; in a packed batch that is another sequence's, so the engine
    refuses positions past the original context and is exact below it."""
    from transformers import Phi3Config, Phi3ForCausalLM

    from families import COMMON

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
            "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + 0.3 * i for i in range(8)]}
    torch.manual_seed(0)
    Phi3ForCausalLM(Phi3Config(**COMMON, rope_parameters=rope, original_max_position_embeddings=32)).save_pretrained(
        tmp_path)
    with pytest.raises(ModelLoadError, match="longrope.*max_model_len <= 32"):
        LLM(model=str(tmp_path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=16)
    llm = LLM(model=str(tmp_path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=16, max_model_len=32,
              max_num_batched_tokens=8)
    prompts = [[3, 4, 5, 6, 7], list(range(10, 30))]
    got = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)]
    assert got == hf_greedy(str(tmp_path), prompts, 8)


def test_a_configured_window_that_no_layer_uses_is_not_refused(tmp_path):
    """Qwen2 with use_sliding_window but max_window_layers covering every layer:
    layer_types says no layer slides, and transformers applies no window."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from families import COMMON

    torch.manual_seed(0)
    config = Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=12, max_window_layers=2)
    assert "sliding_attention" not in config.layer_types
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=16)
    prompts = [list(range(10, 50))]
    got = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)]
    assert got == hf_greedy(str(tmp_path), prompts, 6)


def test_a_family_without_the_attention_interface_is_refused_with_the_reason(tmp_path):
    # GPT-Neo computes attention in its own module (transformers 5.24 and 5.25); Falcon, this test's model
    # before, moved to the attention interface in transformers 5.25 and is now served
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    torch.manual_seed(0)
    GPTNeoForCausalLM(GPTNeoConfig(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4,
                                   attention_types=[[["global", "local"], 1]], window_size=16,
                                   max_position_embeddings=256, bos_token_id=1, eos_token_id=2)).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="does not take a custom attention implementation"):
        LLM(model=str(tmp_path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=8, max_model_len=64)


def test_a_deep_bfloat16_model_is_not_refused_for_rounding(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from families import COMMON

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**COMMON, "num_hidden_layers": 48})).save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="bfloat16", skip_tokenizer_init=True, num_kv_blocks=8)
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids) == 3
