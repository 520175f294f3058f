"""The native decode step (csrc/backends/cpu/step/native_decoder.h, used by
pagedserve/model/lean_llama.py): a Llama decoder's whole forward in one C++
call. It runs the lean forward's kernels in the lean forward's order, so its
hidden states, and so the logits and greedy tokens, must be bit-identical to
the Python lean forward's (which tests/python/test_lean_llama.py holds to the
Hugging Face modules) on tiny random Llamas put on GGUF blocks and on SmolLM2;
it must be what a default engine runs for decode steps, and bad input must
raise before the KV store is written."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams, _core
from pagedserve.errors import KernelArgumentError
from pagedserve.model.gguf_linear import GGUFFloatLinear
from pagedserve.model.lean_llama import _LINEARS
from pagedserve.model.gguf_format import quantize_rows
from pagedserve.model.startup_check import check_logits, check_prompt

from test_lean_llama import make_llama, prompts

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)


class CountingNative:
    """The native decoder with its forward calls counted."""

    def __init__(self, native) -> None:
        self.native, self.calls = native, 0
        self.hidden_size = native.hidden_size

    def forward(self, *args) -> None:
        self.calls += 1
        self.native.forward(*args)


def q8_gguf_linear(dense: torch.nn.Linear, max_rows: int = 128) -> GGUFFloatLinear:
    """``dense`` on Q8_0 blocks of its weight, whose float32 weights become the blocks' exact values (as a
    GGUF-loaded model's are), as the gguf path builds a layer."""
    n, k = dense.weight.shape
    weight = _core.cpu.QuantizedWeight(quantize_rows(dense.weight.detach(), "q8_0"), "q8_0", n, k)
    values = torch.empty(n, k)
    weight.dequantize(values)
    with torch.no_grad():
        dense.weight.copy_(values)
    return GGUFFloatLinear(weight, dense.bias, dense, max_rows)


def on_q8_blocks(llm: LLM) -> None:
    """Puts every linear layer of ``llm``'s lean decoder on Q8_0 blocks and builds the native step, as the
    gguf path does."""
    lean = llm.engine.runner.lean
    for layer in lean.layers:
        for attr in _LINEARS:
            setattr(layer, attr, q8_gguf_linear(getattr(layer, attr)))
    lean.build_native()
    assert lean.why_not_native is None and lean.native is not None


def native_and_python(llm: LLM, token_prompts):
    """(logits of the start-up check's prefill + decode, greedy outputs) with the native step, then without."""
    lean = llm.engine.runner.lean
    counting = CountingNative(lean.native)
    lean.native = counting
    ids = check_prompt(llm.engine.model.config.vocab_size, 16, 64)
    native_logits = check_logits(llm.engine.runner, ids)[0]
    native_out = llm.generate(token_prompts, GREEDY)
    assert counting.calls > len(token_prompts), "the native step did not run"
    lean.native = None
    python_logits = check_logits(llm.engine.runner, ids)[0]
    python_out = llm.generate(token_prompts, GREEDY)
    lean.native = counting.native
    return native_logits, python_logits, native_out, python_out


@pytest.mark.parametrize("overrides", [
    {},
    {"num_key_value_heads": 4},  # MHA
    {"num_key_value_heads": 1},  # MQA
    {"attention_bias": True, "mlp_bias": True},
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}},
], ids=["gqa", "mha", "mqa", "bias", "llama3-rope"])
def test_the_native_step_is_bit_identical_to_the_lean_forward_on_tiny_llamas(tmp_path, overrides):
    model_dir = make_llama(tmp_path / "m", **overrides)
    # no prefix caching: the second run must compute what the first did, not reuse its blocks
    llm = LLM(model=model_dir, dtype="float32", linear_impl="torch", skip_tokenizer_init=True, num_kv_blocks=64,
              enable_prefix_caching=False)
    on_q8_blocks(llm)
    token_prompts = prompts(512)
    native_logits, python_logits, native_out, python_out = native_and_python(llm, token_prompts)
    assert torch.equal(native_logits, python_logits)
    for a, b in zip(native_out, python_out):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [lp for lp in a.outputs[0].logprobs] == [lp for lp in b.outputs[0].logprobs]


def test_smollm2_decodes_on_the_native_step_by_default_with_the_same_tokens(smollm2_dir):
    llm = LLM(skip_tokenizer_init=True, num_kv_blocks=128, enable_prefix_caching=False)  # float32, the gguf path
    lean = llm.engine.runner.lean
    assert lean.native is not None and llm.engine.linear_impl == "gguf"
    assert "native C++ step" in llm.engine.model_impl and "for steps of every size" in llm.engine.model_impl
    # 300: a step of more than 256 tokens, after which the native step releases its scratch and decodes regrow it
    token_prompts = prompts(llm.engine.model.config.vocab_size, lengths=(3, 11, 30, 300))
    native_logits, python_logits, native_out, python_out = native_and_python(llm, token_prompts)
    # the file read in place: the Python executor of the Llama description over the modules' own blocks, the same
    # kernels one call at a time (the q, k and v layers apart where the native step fills one qkv buffer)
    assert torch.equal(native_logits, python_logits)
    assert [o.outputs[0].logprobs for o in native_out] == [o.outputs[0].logprobs for o in python_out]


def test_bad_input_raises_before_the_kv_store_is_written(tmp_path):
    llm = LLM(model=make_llama(tmp_path / "m"), dtype="float32", linear_impl="torch", skip_tokenizer_init=True,
              num_kv_blocks=8)
    on_q8_blocks(llm)
    lean, engine = llm.engine.runner.lean, llm.engine
    store = engine.kv_cache.store
    before = store.clone()
    from pagedserve.kernels.backend import AttentionMetadata

    meta = AttentionMetadata(slot_mapping=torch.tensor([0, 1], dtype=torch.int64),
                             query_start_loc=torch.tensor([0, 2], dtype=torch.int32),
                             seq_lens=torch.tensor([2], dtype=torch.int32),
                             block_tables=torch.tensor([[0]], dtype=torch.int32))
    plan = engine.backend.make_plan(meta).for_window(None)
    out = torch.empty(2, 64)
    ids, pos, slots = torch.tensor([5, 7]), torch.tensor([0, 1]), meta.slot_mapping
    with pytest.raises(KernelArgumentError, match="outside the vocabulary"):
        lean.native.forward(torch.tensor([5, 512]), pos, slots, store, plan, out, 0.25, 1)
    with pytest.raises(KernelArgumentError):  # a position past the rotary table
        lean.native.forward(ids, torch.tensor([0, 10**6]), slots, store, plan, out, 0.25, 1)
    with pytest.raises(KernelArgumentError):  # a slot past the store
        lean.native.forward(ids, pos, torch.tensor([0, 10**6]), store, plan, out, 0.25, 1)
    with pytest.raises(KernelArgumentError, match="plan was not built for this step"):
        lean.native.forward(torch.tensor([5]), torch.tensor([0]), torch.tensor([0]), store, plan, out[:1], 0.25, 1)
    with pytest.raises(KernelArgumentError):
        lean.native.forward(ids, pos, slots, store, plan, torch.empty(2, 63), 0.25, 1)
    assert torch.equal(store, before)
    lean.native.forward(ids, pos, slots, store, plan, out, 0.25, 1)  # and the decoder still works
    assert torch.isfinite(out).all() and not torch.equal(store, before)
