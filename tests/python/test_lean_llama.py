"""PagedServe's lean Llama forward (--model-impl, pagedserve/model/lean_llama.py)
equals the Hugging Face modules it replaces: the same greedy tokens, and in
float32 logits within 1e-4 of those modules' on the same GEMM path, on tiny random
Llamas (GQA, MHA, biases, llama3 rope scaling) and on SmolLM2."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedserve import LLM, SamplingParams
from pagedserve.model.lean_llama import LeanLlamaDecoder, why_not_lean
from pagedserve.model.startup_check import check_logits, check_prompt

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts(vocab: int, lengths=(1, 5, 17, 40)) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def make_llama(path, **overrides) -> str:
    torch.manual_seed(0)
    kw = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              initializer_range=0.15)
    kw.update(overrides)
    LlamaForCausalLM(LlamaConfig(**kw)).save_pretrained(path)
    return str(path)


def lean_and_reference(model_dir: str, dtype: str = "float32", **kwargs):
    lean = LLM(model=model_dir, dtype=dtype, skip_tokenizer_init=True, num_kv_blocks=64, model_impl="pagedserve",
               **kwargs)
    ref = LLM(model=model_dir, dtype=dtype, skip_tokenizer_init=True, num_kv_blocks=64, model_impl="transformers",
              **kwargs)
    return lean, ref


def logits_gap(lean: LLM, ref: LLM, n: int = 8) -> float:
    """Largest |lean logit - reference logit| over a prefill of n tokens and one
    decode step that reads them back from the paged store (float32), the
    reference being the Hugging Face modules on the same GEMM path. (Against
    the plain Hugging Face model, torch's default GEMMs, the gap also holds
    the GEMM paths' own summation-order difference: on a 2-core AMD EPYC host,
    oneDNN against MKL moved SmolLM2's logits by 1.1e-4 with the Hugging Face
    modules on both sides, while lean against those modules on oneDNN differed
    by 5.1e-5. The engine's start-up check compares with that model, at a
    tolerance relative to the logits.)"""
    ids = check_prompt(lean.engine.model.config.vocab_size, 16, 64)[: n + 1]
    got = check_logits(lean.engine.runner, ids)[0]
    want = check_logits(ref.engine.runner, ids)[0]
    assert ref.engine.runner.lean is None and lean.engine.linear_impl == ref.engine.linear_impl
    return float((got - want).abs().max())


@pytest.mark.parametrize("overrides", [
    {},
    {"num_key_value_heads": 4},
    {"num_key_value_heads": 1, "attention_bias": True, "mlp_bias": True},
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}},
    {"tie_word_embeddings": True, "rms_norm_eps": 1e-5},
], ids=["gqa", "mha", "mqa-bias", "llama3-rope", "tied"])
def test_lean_equals_transformers_on_tiny_llamas(tmp_path, overrides):
    model_dir = make_llama(tmp_path, **overrides)
    lean, ref = lean_and_reference(model_dir, linear_impl="torch")
    assert lean.engine.runner.lean is not None and ref.engine.runner.lean is None
    assert lean.engine.model_impl.startswith("pagedserve")
    ps = prompts(512)
    got = [o.outputs[0].token_ids for o in lean.generate(ps, GREEDY, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in ref.generate(ps, GREEDY, use_tqdm=False)]
    assert got == want
    assert logits_gap(lean, ref) <= 1e-4


@pytest.mark.parametrize("impl", ["torch", "onednn"])
def test_lean_equals_transformers_on_smollm2(smollm2_dir, impl):
    lean, ref = lean_and_reference(smollm2_dir, linear_impl=impl)
    ps = prompts(49152, lengths=(3, 30, 70))
    got = [o.outputs[0].token_ids for o in lean.generate(ps, GREEDY, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in ref.generate(ps, GREEDY, use_tqdm=False)]
    assert got == want
    assert logits_gap(lean, ref) <= 1e-4


def test_lean_in_bfloat16_agrees_with_transformers_in_bfloat16(tmp_path):
    model_dir = make_llama(tmp_path)
    lean, ref = lean_and_reference(model_dir, dtype="bfloat16", linear_impl="torch")
    ps = prompts(512)
    got = [o.outputs[0].token_ids for o in lean.generate(ps, GREEDY, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in ref.generate(ps, GREEDY, use_tqdm=False)]
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    assert same >= 0.9 * sum(map(len, want))  # the same roundings, in another order


def test_model_impl_auto_picks_lean_for_llama_only_and_pagedserve_refuses_others(tmp_path):
    from transformers import MistralConfig, MistralForCausalLM

    llama = LLM(model=make_llama(tmp_path / "llama"), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=16)
    assert llama.engine.runner.lean is not None
    torch.manual_seed(0)
    MistralForCausalLM(MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                     sliding_window=None)).save_pretrained(tmp_path / "mistral")
    mistral = LLM(model=str(tmp_path / "mistral"), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=16)
    assert mistral.engine.runner.lean is None and "Llama architecture only" in mistral.engine.model_impl
    with pytest.raises(ValueError, match="--model-impl pagedserve: no PagedServe decoder for this model .the lean "
                       "forward: it implements the Llama architecture only .this model: mistral.; the decoder "
                       "description: no native step for mistral"):
        LLM(model=str(tmp_path / "mistral"), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=16,
            model_impl="pagedserve")


def test_why_not_lean_names_what_it_cannot_do():
    assert why_not_lean(LlamaConfig(), torch.device("cpu")) is None
    assert "CPU ops" in why_not_lean(LlamaConfig(), torch.device("meta"))
    assert "gelu" in why_not_lean(LlamaConfig(hidden_act="gelu"), torch.device("cpu"))
    assert "pretraining_tp" in why_not_lean(LlamaConfig(pretraining_tp=2), torch.device("cpu"))
    dyn = LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert "dynamic" in why_not_lean(dyn, torch.device("cpu"))
    with pytest.raises(ValueError, match="no lean forward"):
        LeanLlamaDecoder(LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                                      num_attention_heads=4, vocab_size=64, hidden_act="gelu")),
                         lambda lins, names: lins[0], 16)


def test_a_position_past_the_rotary_table_is_an_error_not_a_crash(tmp_path):
    from pagedserve.errors import KernelArgumentError

    llm = LLM(model=make_llama(tmp_path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=16,
              max_model_len=32)
    lean = llm.engine.runner.lean
    with pytest.raises(KernelArgumentError):
        q = torch.zeros(1, 64)
        k = torch.zeros(1, 32)
        from pagedserve import _core

        _core.cpu.rotary_embedding(torch.tensor([32]), q, k, lean.head_dim, lean.cos_sin_cache, True, 1)


def test_the_chooser_measures_the_fused_shapes_the_lean_forward_runs(tmp_path, monkeypatch):
    """With the lean forward the GEMM-path chooser times qkv_proj and
    gate_up_proj as one layer each (the shapes the engine runs), not the
    Hugging Face model's separate q/k/v and gate/up layers."""
    from pagedserve.model import linear

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    seen = []
    cases = linear.path_cases
    monkeypatch.setattr(linear, "path_cases", lambda impl, shapes, *a, **k: seen.append(shapes) or cases(
        impl, shapes, *a, **k))
    LLM(model=make_llama(tmp_path / "m", attention_bias=True), dtype="float32", skip_tokenizer_init=True,
        num_kv_blocks=16)
    # hidden 64, 4 heads and 2 KV heads of 16, intermediate 96, 3 layers, vocab 512
    want = [[64, 64, True, 3], [64, 128, True, 3], [64, 192, False, 3], [64, 512, False, 1], [96, 64, False, 3]]
    assert seen and all(sorted(s) == want for s in seen)
