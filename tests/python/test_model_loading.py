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
    with pytest.raises(ModelLoadError, match="1 of its 2 layers ran their attention through"):
        LLM(model=tiny_llama_dir, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=8)
