"""Batch invariance of the engine (issue 28, part 1): a request's logits are the
same bits whatever else its steps hold: alone, beside 31 other requests,
with its prompt cut into 16-token chunks, and on one or two threads. Checked on
the logprob of every emitted token (a function of that row's logits alone), in
each dtype and quantisation the default model is served in.

float32 (the default) and bfloat16 run on the GGUF's blocks, whose float32 GEMM
sums each output in k order whatever the call's row count
(tests/cpp/test_quant_linear.cc); a float checkpoint's weights run the same
GEMM from dense tiles (tests/cpp/test_gguf_types.cc); bfloat16 activations are widened exactly and
the sums rounded once. --quantization q4 rounds each activation row to int8 on
its own and stays on the integer kernel for every call size. The CPU attention
kernel scores each query row the same way in any tile
(tests/cpp/test_attention_cpu.cc)."""
from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(5, 60, (32,), generator=g).tolist()
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lens]


def _run(llm: LLM, prompts: list[list[int]], batched: bool) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    if batched:
        outs = llm.generate(prompts, params, use_tqdm=False)
    else:
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    result = []
    for o in outs:
        c = o.outputs[0]
        result.append((list(c.token_ids), [lp.logprob for lp in c.logprobs]))
    return result


# Each batched run serves all 32 prompts; every ALONE_EVERY-th of them (11 of every load's sizes and
# positions) is also served alone, the reference its rows in the batch must equal bit for bit (serving all 32
# alone, one request at a time, took half of these tests' time)
ALONE_EVERY = 3

# (engine arguments, what the engine must resolve them to); bfloat16 names the gguf path so that no start-up
# measurement runs (the rule that gives the blocks every call size is tested below)
CONFIGS = {
    "float32 (default)": ({}, torch.float32, "gguf"),
    "bfloat16": ({"dtype": "bfloat16", "linear_impl": "gguf"}, torch.bfloat16, "gguf"),
    "q4": ({"quantization": "q4"}, None, "q4"),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_each_request_gets_the_same_logit_bits_under_any_load(config):
    kwargs, dtype, path = CONFIGS[config]
    prompts = _prompts()
    llm = LLM(enable_prefix_caching=False, **kwargs)
    assert llm.engine.linear_path.startswith(path) and dtype in (None, llm.engine.dtype)
    assert "bfloat16 GEMM" not in llm.engine.linear_path  # q4's large calls stay on the integer kernel
    assert llm.engine.batch_invariance == "on"
    alone = _run(llm, prompts[::ALONE_EVERY], batched=False)
    # all at once: one prefill of 32 prompts, then shared decodes
    assert _run(llm, prompts, batched=True)[::ALONE_EVERY] == alone
    del llm
    chunked = LLM(enable_prefix_caching=False, max_num_batched_tokens=16, **kwargs)
    # prompts cut at other boundaries, mixed with decodes
    assert _run(chunked, prompts, batched=True)[::ALONE_EVERY] == alone
    del chunked
    threads = torch.get_num_threads()
    if threads > 1:
        torch.set_num_threads(1)
        try:
            one = LLM(enable_prefix_caching=False, **kwargs)
            assert _run(one, prompts, batched=True)[::ALONE_EVERY] == alone
            del one
        finally:
            torch.set_num_threads(threads)


def test_where_the_blocks_serve_some_call_sizes_they_serve_every_size(monkeypatch):
    """A start-up measurement that gives the dense path the large calls (the blocks up to 128 rows here)
    would make a row's GEMM depend on its step's size: with batch invariance (the default) the blocks
    serve every call; --no-batch-invariant keeps the measured bound. Where the dense path measures much
    faster at every size, batch invariance still keeps the blocks (and says what it costs). The measurement
    runs where a GGUF is converted to a float model (bfloat16 here); a file read in place (float32) has no
    dense copy to measure, and its blocks serve every call either way."""
    from pagedserve.model import gguf_linear

    def bounded(self, *args, **kwargs):
        self.set_max_rows(128)
        return gguf_linear.GGUFTuning({"gguf": {1: 1.0, 128: 9.0}, "dense": {1: 3.0, 128: 5.0}}, "injected")

    monkeypatch.setattr(gguf_linear.GGUFFloatMethod, "tune", bounded)
    in_place = LLM(enable_prefix_caching=False, batch_invariant=False, skip_tokenizer_init=True, num_kv_blocks=16)
    assert "read in place" in in_place.engine.linear_path and "calls of every size" in in_place.engine.linear_path
    del in_place
    on = LLM(enable_prefix_caching=False, dtype="bfloat16")
    assert "calls of every size" in on.engine.linear_path
    del on
    off = LLM(enable_prefix_caching=False, batch_invariant=False, dtype="bfloat16")
    assert "calls of up to 128 rows" in off.engine.linear_path
    del off

    def never(self, *args, **kwargs):  # the dense path much faster at every size (our scalar kernels' case)
        self.set_max_rows(0)
        return gguf_linear.GGUFTuning({"gguf": {1: 9.0, 128: 99.0}, "dense": {1: 1.0, 128: 5.0}}, "injected")

    monkeypatch.setattr(gguf_linear.GGUFFloatMethod, "tune", never)
    on = LLM(enable_prefix_caching=False, dtype="bfloat16")
    assert on.engine.linear_path.startswith("gguf") and "calls of every size" in on.engine.linear_path
    assert "batch invariance keeps every call on the blocks though the dense path" in on.engine.linear_path
    assert on.engine.batch_invariance == "on"
    del on
    off = LLM(enable_prefix_caching=False, batch_invariant=False, dtype="bfloat16")
    assert not off.engine.linear_path.startswith("gguf")


def _token_prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    lens = torch.randint(5, 60, (32,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


@pytest.mark.parametrize("family,dtype", [("llama", "float32"), ("llama", "bfloat16"), ("gemma3", "float32")])
def test_a_float_checkpoint_runs_our_gemm_and_gets_the_same_bits_under_any_load(tmp_path, family, dtype):
    """A float checkpoint (no GGUF blocks) takes our GEMM on its own weights (the ``tiles`` method: float32
    or bfloat16 weights in the kernel's dense tiles) for every linear layer: batch invariance is "on", and a
    request's tokens and logprob bits are the same alone, beside 31 others and in 16-token chunks. Llama
    runs the lean forward, Gemma 3 the Hugging Face modules under the native step (float32), its scaled
    embedding as lookups in the tied output layer's tiles."""
    import families

    path = families.build(family, tmp_path / family)
    kwargs = dict(model=path, skip_tokenizer_init=True, dtype=dtype, enable_prefix_caching=False, num_kv_blocks=128)
    prompts = _token_prompts(256)
    llm = LLM(**kwargs)
    assert llm.engine.linear_path.startswith("tiles: 15 layers") and "0 layers dense" in llm.engine.linear_path
    assert llm.engine.batch_invariance == "on"
    if dtype == "float32":
        assert "native C++ step" in llm.engine.runner.lean.describe_native()
    tied = family == "gemma3"  # (Gemma 3 ties its output layer to the embedding; the tiny Llama does not)
    assert ("the embedding read from the tiles of the tied output layer" in llm.engine.linear_path) == tied
    alone = _run(llm, prompts, batched=False)
    assert _run(llm, prompts, batched=True) == alone
    del llm
    chunked = LLM(max_num_batched_tokens=16, **kwargs)
    assert _run(chunked, prompts, batched=True) == alone


def test_the_start_up_log_names_what_batch_invariance_does_not_cover(tiny_llama_dir):
    """A float checkpoint's linear layers on a library GEMM (asked for: --linear-impl torch; MKL / oneDNN
    block by row count): the engine says so rather than claiming invariance; --no-batch-invariant says it
    is off and keeps the measured library GEMM."""
    dense = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=16, linear_impl="torch")
    assert dense.engine.batch_invariance.startswith("on, except ")
    assert "linear modules on a library GEMM" in dense.engine.batch_invariance
    del dense
    off = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=16, batch_invariant=False)
    assert off.engine.batch_invariance.startswith("off")
    assert not off.engine.linear_path.startswith("tiles")


def test_gpt2s_conv1d_projections_take_the_tiles_or_are_named_as_on_a_library_gemm(tmp_path):
    """GPT-2's projections are transformers' Conv1D (x @ W + b by torch.addmm), not nn.Linear: under batch
    invariance they take the tiles as the nn.Linear of W.T, and the model is invariant; with --linear-impl torch
    the start-up log names them as on a library GEMM."""
    import families

    path = families.build("gpt2", tmp_path / "gpt2")
    kwargs = dict(model=path, skip_tokenizer_init=True, num_kv_blocks=128, enable_prefix_caching=False)
    llm = LLM(**kwargs)
    assert llm.engine.linear_path.startswith("tiles: 9 layers") and llm.engine.batch_invariance == "on"
    prompts = _token_prompts(256)
    alone = _run(llm, prompts, batched=False)
    assert _run(llm, prompts, batched=True) == alone
    del llm
    dense = LLM(linear_impl="torch", **kwargs)
    assert dense.engine.batch_invariance.startswith("on, except 9 linear modules on a library GEMM"), \
        dense.engine.batch_invariance
    assert "transformer.h.0.attn.c_attn" in dense.engine.batch_invariance


_VARIANT = """
import json, sys
import torch
from pagedserve import LLM, SamplingParams, _core
prompts = json.loads(sys.argv[1])
params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0)

def run(llm, batched, prompts=prompts):
    outs = llm.generate(prompts, params, use_tqdm=False) if batched else [
        llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    return [[(t, lp.logprob) for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]

llm = LLM(enable_prefix_caching=False, linear_impl="gguf")  # gguf: what batch invariance picks, untimed
res = {"isa": _core.cpu.kernel_isa(), "invariance": llm.engine.batch_invariance,
       "alone": run(llm, False), "batched": run(llm, True)}
del llm
res["chunked"] = run(LLM(enable_prefix_caching=False, linear_impl="gguf", max_num_batched_tokens=16), True)
# a tiny float checkpoint in the other dtype and quantisation: 32 prompts each
tiny = json.loads(sys.argv[3])
for name, kw in {"bfloat16": {"dtype": "bfloat16"}, "q4": {"quantization": "q4"}}.items():
    args = dict(model=sys.argv[2], skip_tokenizer_init=True, enable_prefix_caching=False, num_kv_blocks=128, **kw)
    llm = LLM(**args)
    res[name] = {"invariance": llm.engine.batch_invariance, "path": llm.engine.linear_path,
                 "alone": run(llm, False, tiny), "batched": run(llm, True, tiny)}
    del llm
    res[name]["chunked"] = run(LLM(max_num_batched_tokens=16, **args), True, tiny)
print("RESULT " + json.dumps(res))
"""


def _lower_variants() -> list[str]:
    """The variants below the active one this CPU runs, lowest first, each bringing an attention or GEMM table
    no variant before it (the active one included) ran: avx2 and baseline on an AVX-512 machine (avx512 runs
    tables those two and avx512_vnni cover), avx_vnni too where the CPU has it."""
    from pagedserve import _core
    active = _core.cpu.kernel_isa()
    seen = {(family, _core.cpu.kernel_tables(active)[family]) for family in ("attention", "gemm")}
    lower = []
    for name, ok, _ in _core.cpu.compiled_isas():
        tables = {(family, _core.cpu.kernel_tables(name)[family]) for family in ("attention", "gemm")}
        if ok and name != active and not tables <= seen:
            lower.append(name)
            seen |= tables
    return lower


@pytest.mark.parametrize("isa", _lower_variants() or ["none"])
def test_every_kernel_variant_this_cpu_runs_gives_the_same_bits_under_any_load(isa, tmp_path):
    """The default engine (float32 on the GGUF's blocks, where batch invariance keeps every call even on the
    scalar variant), and a tiny float checkpoint in bfloat16 (our GEMM's tiles) and --quantization q4 (32
    prompts each), on each lower kernel variant this CPU executes (PAGEDSERVE_CPU_ISA, a fresh process: avx2
    and baseline on an AVX-512 machine): alone, batched and in 16-token chunks give each request the same
    tokens and logprob bits. (An emulated AVX2-only CPU runs the engine too: test_hardware.py; the qemu-user
    runs of tests/cpp check the kernels' row invariance: test_quant_linear, test_gguf_types,
    test_attention_cpu.)"""
    if isa == "none":
        pytest.skip("this CPU executes only one compiled kernel variant: the tests above cover it")
    import json
    import os
    import subprocess
    import sys

    import families
    # initializer_range 0.1: at the families' 0.15 q4's rounding moves this tiny model's logits past the
    # start-up check's bound (any kernel variant)
    tiny = families.build("llama", tmp_path / "llama", overrides={"initializer_range": 0.1})
    prompts = _prompts()[:5]
    r = subprocess.run([sys.executable, "-c", _VARIANT, json.dumps(prompts), tiny, json.dumps(_token_prompts(256))],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "PAGEDSERVE_CPU_ISA": isa})
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert res["isa"] == isa and res["invariance"] == "on"
    assert res["batched"] == res["alone"] and res["chunked"] == res["alone"]
    assert res["bfloat16"]["path"].startswith("tiles") and res["q4"]["path"].startswith("q4")
    for name in ("bfloat16", "q4"):
        assert res[name]["invariance"] == "on", res[name]["invariance"]
        assert res[name]["batched"] == res[name]["alone"] and res[name]["chunked"] == res[name]["alone"], name
