"""The native decode step over Hugging Face modules (pagedserve/model/
native_step.py; csrc/backends/cpu/step/native_decoder.h): Gemma 3, Qwen 2 and
Qwen 3 decoders whose linear layers are on GGUF blocks run each step as one
C++ call. Its logits must be the Python executor's of the same description
(decoder.py) bit for bit, equal the Hugging Face modules' (the same blocks;
the norms' summation order and gelu's last bits may differ) and its greedy
tokens must be theirs, on tiny random models of each family (prompts longer
than the sliding window included), and the GeGLU kernel it adds must equal
torch's gelu(approximate="tanh")."""

from __future__ import annotations

import pytest
import torch

import families
from pagedserve import LLM, SamplingParams, _core
from pagedserve.errors import KernelArgumentError
from pagedserve.model.native_step import NativeStepDecoder, why_no_native_step
from pagedserve.model.startup_check import check_logits, check_prompt

from test_lean_llama import prompts
from test_native_decoder import q8_gguf_linear

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
NATIVE_FAMILIES = [f for f in ("gemma3", "qwen2", "qwen3") if f in families.available()]


class CountingNative:
    """The C++ decoder with its forward calls (and whether a window plan came with them) counted."""

    def __init__(self, native) -> None:
        self.native, self.calls, self.window_plans = native, 0, 0
        self.hidden_size = native.hidden_size

    def forward(self, *args) -> None:
        self.calls += 1
        self.window_plans += args[8] is not None  # (input_ids, ..., num_threads, window_plan, rope_rows)
        self.native.forward(*args)


def on_q8_blocks(llm: LLM, max_rows: int = 128) -> NativeStepDecoder:
    """Puts every nn.Linear of ``llm``'s decoder layers on Q8_0 blocks, as the gguf path's swap does, and makes
    the runner call a NativeStepDecoder over the modules."""
    model = llm.engine.model
    for module in list(model.model.layers.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(module, name, q8_gguf_linear(child, max_rows))
    decoder = NativeStepDecoder(model, llm.engine.max_model_len)
    assert decoder.native is not None, decoder.why_not_native
    llm.engine.runner.lean = decoder
    return decoder


CASES = [(f, None) for f in NATIVE_FAMILIES]
if "gemma3" in NATIVE_FAMILIES:  # every layer global: the rotary module builds that one table only
    CASES.append(("gemma3", {"layer_types": ["full_attention", "full_attention"]}))


@pytest.mark.parametrize("family,overrides", CASES, ids=[f + ("-global" if o else "") for f, o in CASES])
def test_the_native_step_equals_the_hugging_face_modules_on_tiny_models(tmp_path, family, overrides):
    path = families.build(family, tmp_path / family, overrides=overrides)
    llm = LLM(model=path, dtype="float32", linear_impl="torch", skip_tokenizer_init=True, num_kv_blocks=64,
              enable_prefix_caching=False)
    decoder = on_q8_blocks(llm)
    counting = decoder.native = CountingNative(decoder.native)
    ids = check_prompt(llm.engine.model.config.vocab_size, 16, 64)
    token_prompts = prompts(llm.engine.model.config.vocab_size, lengths=(1, 5, 30, 70))  # 30, 70 > the window
    native_logits = check_logits(llm.engine.runner, ids)[0]
    native_out = llm.generate(token_prompts, GREEDY)
    assert counting.calls > len(token_prompts), "the native step did not run"
    if families.windowed(family) and not overrides:
        assert counting.window_plans == counting.calls  # every step read its local layers through the window plan
    decoder.native = None  # the Python executor of the same description: the same kernels, one call at a time
    python_logits = check_logits(llm.engine.runner, ids)[0]
    python_out = llm.generate(token_prompts, GREEDY)
    assert torch.equal(native_logits, python_logits)
    assert [o.outputs[0].logprobs for o in native_out] == [o.outputs[0].logprobs for o in python_out]
    decoder.described = None  # the Hugging Face modules, on the same blocks
    hf_logits = check_logits(llm.engine.runner, ids)[0]
    hf_out = llm.generate(token_prompts, GREEDY)
    scale = hf_logits.abs().max()
    assert (native_logits - hf_logits).abs().max() <= 1e-5 * scale
    assert [o.outputs[0].token_ids for o in native_out] == [o.outputs[0].token_ids for o in hf_out]


def test_no_native_step_without_blocks_or_for_another_family(tmp_path):
    llm = LLM(model=families.build("gemma3", tmp_path / "g"), dtype="float32", linear_impl="torch",
              skip_tokenizer_init=True, num_kv_blocks=16)
    assert llm.engine.runner.lean is None  # no GGUF: the gguf path, and so the native step, does not apply
    decoder = NativeStepDecoder(llm.engine.model, llm.engine.max_model_len)
    assert decoder.native is None and "the native step cannot compute" in decoder.why_not_native
    assert "no native decode step" in decoder.describe_native()
    llama = llm.engine.model.config.__class__.__name__  # a family the table lacks names the ones it has
    config = type("C", (), {"model_type": "gpt2"})()
    assert "gemma3_text" in why_no_native_step(config, torch.device("cpu")), llama
    assert "CPU ops" in why_no_native_step(llm.engine.model.config, torch.device("meta"))


def test_a_step_without_its_window_plan_or_rope_rows_is_refused_before_the_store_is_written(tmp_path):
    llm = LLM(model=families.build("gemma3", tmp_path / "g"), dtype="float32", linear_impl="torch",
              skip_tokenizer_init=True, num_kv_blocks=8)
    decoder = on_q8_blocks(llm)
    engine = llm.engine
    from pagedserve.kernels.backend import AttentionMetadata

    meta = AttentionMetadata(slot_mapping=torch.tensor([0, 1], dtype=torch.int64),
                             query_start_loc=torch.tensor([0, 2], dtype=torch.int32),
                             seq_lens=torch.tensor([2], dtype=torch.int32),
                             block_tables=torch.tensor([[0]], dtype=torch.int32))
    plans = engine.backend.make_plan(meta)
    store, out = engine.kv_cache.store, torch.empty(2, decoder.native.hidden_size)
    before = store.clone()
    args = (torch.tensor([5, 7]), torch.tensor([0, 1]), meta.slot_mapping, store, plans.for_window(None), out,
            decoder.scale, 1)
    with pytest.raises(KernelArgumentError, match="need the step's plan with that window"):
        decoder.native.forward(*args)
    with pytest.raises(KernelArgumentError, match="need the step's plan with that window"):  # a wrong window
        decoder.native.forward(*args, plans.for_window(decoder.window + 1))
    window = plans.for_window(decoder.window)
    with pytest.raises(KernelArgumentError, match="built without rotary tables"):
        decoder.native.forward(*args, window)
    rows = decoder._rope_rows(args[1])
    with pytest.raises(KernelArgumentError):  # the step's rows of the wrong number of tokens
        decoder.native.forward(*args, window, [r[:1] for r in rows])
    with pytest.raises(KernelArgumentError, match="the layers use 2 tables"):
        decoder.native.forward(*args, window, rows[:1])
    with pytest.raises(KernelArgumentError, match="expected a QuantizedWeight"):
        decoder.native.add_layer(torch.zeros(3), None, None, None, None, None, None, None, None, None, 1e-6, 1e-6)
    assert torch.equal(store, before)
    decoder.native.forward(*args, window, rows)
    assert torch.isfinite(out).all() and not torch.equal(store, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_and_mul_equals_torch(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(33, 2 * 300, generator=g) * 4).to(dtype)
    x[0, :8] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 0.0, -0.0, -12.0]).to(dtype)
    out = torch.empty(33, 300, dtype=dtype)
    _core.cpu.gelu_tanh_and_mul(out, x, 2)
    gate = torch.nn.functional.gelu(x[:, :300], approximate="tanh")
    ref = gate * x[:, 300:]  # Hugging Face's act_fn(gate) * up, each rounded to the dtype
    torch.testing.assert_close(out[0, :8], ref[0, :8], rtol=0, atol=0, equal_nan=True)  # specials as torch's
    out, ref, x = out[1:], ref[1:], x[1:]
    if dtype == torch.float32:  # torch's 0.5 g (1 + tanh(u)) up to a few ulp of (1 + tanh(u))
        assert ((out - ref).abs() <= x[:, :300].abs() * x[:, 300:].abs() * 4e-7).all()
    else:  # at most one bfloat16 ulp, and rarely; or, where torch's 1 + tanh(u) cancelled to 0, a value as small
        diff = (out.float() - ref.float()).abs()
        tiny = x[:, :300].float().abs() * x[:, 300:].float().abs() * 1e-6
        assert (diff <= torch.maximum(ref.float().abs() * 2.0 ** -7, tiny)).all()
        assert (diff > 0).float().mean() < 0.02
    with pytest.raises(KernelArgumentError, match="even number of columns"):
        _core.cpu.gelu_tanh_and_mul(out, x[:, :-1], 1)
