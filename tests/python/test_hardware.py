"""CPU capabilities decide, never a crash: --dtype auto, the linear layers'
GEMM path, the attention kernel's ISA variant; and whatever cannot run here
fails at start-up with the reason, never at the first request. The last test
runs the engine on an emulated AVX2-only CPU (qemu-user), whatever CPU runs
the suite."""

import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys

import pytest
import torch

from pagedserve import LLM, SamplingParams, _core, hardware
from pagedserve.model.linear import OneDNNLinear
from conftest import hf_greedy

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 50)), list(range(200, 217))]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def fake_caps(monkeypatch, **changes):
    caps = dataclasses.replace(hardware.cpu_capabilities(), **changes)
    monkeypatch.setattr(hardware, "cpu_capabilities", lambda: caps)
    return caps


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for s, t in zip(a, b) for x, y in zip(s, t)]
    return sum(x == y for x, y in pairs) / len(pairs)


def test_dtype_auto_is_float32_the_exact_path_on_every_cpu(tiny_llama_dir):
    caps = hardware.cpu_capabilities()
    dtype, why = hardware.resolve_dtype("auto")
    print(f"this CPU: {caps.arch}, native bf16 {caps.native_bf16}, kernel variant {_core.cpu.kernel_isa()} -> {dtype}")
    assert dtype == torch.float32 and why.startswith("auto: float32, the exact path")
    assert caps.native_bf16 == any(f in caps.features for f in ("avx512_bf16", "amx_bf16", "bf16"))
    llm = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=16)  # dtype auto is the default
    assert llm.engine.dtype == torch.float32 and llm.engine.kv_cache.store.dtype == torch.float32


def test_dtype_auto_stays_float32_where_the_cpu_has_bfloat16_and_says_how_to_opt_in(monkeypatch):
    fake_caps(monkeypatch, native_bf16=False, features=("avx", "avx2", "fma"))
    assert hardware.resolve_dtype("auto") == (torch.float32, "auto: float32, the exact path (this CPU has no "
                                              "native bfloat16 arithmetic)")
    fake_caps(monkeypatch, native_bf16=True, features=("avx2", "avx512_bf16"))
    dtype, why = hardware.resolve_dtype("auto")
    assert dtype == torch.float32 and "avx512_bf16" in why and "--dtype bfloat16" in why
    assert hardware.resolve_dtype("bfloat16") == (torch.bfloat16, "asked for")
    assert hardware.resolve_dtype("float32")[0] == torch.float32


def test_bfloat16_without_the_onednn_path_serves_with_torchs_gemm(tiny_llama_dir, monkeypatch):
    """What an AVX2-only CPU gets for --dtype bfloat16: torch's own bf16 GEMM,
    chosen at start-up and logged, and correct outputs."""
    fake_caps(monkeypatch, onednn_bf16=False)
    llm = LLM(model=tiny_llama_dir, dtype="bfloat16", skip_tokenizer_init=True, num_kv_blocks=32)
    assert "torch's default GEMM" in llm.engine.linear_path and "avx512bw" in llm.engine.linear_path
    assert not any(isinstance(m, OneDNNLinear) for m in llm.engine.model.modules())
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    want = hf_greedy(tiny_llama_dir, PROMPTS, 8)
    # bfloat16 rounds differently from the float32 reference (a broken path would agree ~1 in 512)
    assert agreement(got, want) >= 0.5


def test_the_onednn_path_is_used_only_where_it_runs(tiny_llama_dir):
    """Asked for where it cannot run, the oneDNN path is a start-up error naming
    the reason; where it runs, every linear layer takes it."""
    if hardware.cpu_capabilities().onednn_bf16:
        llm = LLM(model=tiny_llama_dir, dtype="bfloat16", skip_tokenizer_init=True, num_kv_blocks=16,
                  linear_impl="onednn")
        assert any(isinstance(m, OneDNNLinear) for m in llm.engine.model.modules())
    else:
        with pytest.raises(ValueError, match="--linear-impl onednn cannot run here: oneDNN's bfloat16"):
            LLM(model=tiny_llama_dir, dtype="bfloat16", skip_tokenizer_init=True, num_kv_blocks=16,
                linear_impl="onednn")
    llm = LLM(model=tiny_llama_dir, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=16,
              linear_impl="onednn")
    assert any(isinstance(m, OneDNNLinear) for m in llm.engine.model.modules())  # fp32 oneDNN runs on any x86
    assert not any(type(m) is torch.nn.Linear for m in llm.engine.model.modules())


def test_a_path_that_cannot_run_fails_at_start_up_not_at_the_first_request(tiny_llama_dir, monkeypatch):
    def crash(self, x):
        raise RuntimeError("mkldnn_linear: bf16 path needs the cpu support avx_ne_convert or avx512bw")

    monkeypatch.setattr(OneDNNLinear, "forward", crash)
    with pytest.raises(RuntimeError, match="start-up check step failed.*avx_ne_convert"):
        LLM(model=tiny_llama_dir, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=16, linear_impl="onednn")


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **env})


def test_an_environment_variable_forces_a_lower_kernel_variant_and_never_a_missing_one(tiny_llama_dir):
    compiled = _core.cpu.compiled_isas()
    lowest = compiled[0][0]
    r = _run("from pagedserve import _core; print(_core.cpu.kernel_isa())", {"PAGEDSERVE_CPU_ISA": lowest})
    assert r.stdout.strip() == lowest, r.stderr
    for name, ok, needs in compiled + [("avx9000", False, "")]:
        if ok:
            continue
        r = subprocess.run([sys.executable, "-m", "pagedserve.server", "--model", tiny_llama_dir,
                            "--skip-tokenizer-init", "--port", "1"], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "HF_HUB_OFFLINE": "1", "PAGEDSERVE_CPU_ISA": name})
        assert r.returncode != 0
        assert f"cannot start: PAGEDSERVE_CPU_ISA names CPU kernel variant '{name}'" in r.stderr, r.stderr[-2000:]


QEMU = shutil.which("qemu-x86_64")
EMULATED = """
import json, sys
from pagedserve import LLM, SamplingParams
from pagedserve import _core
from pagedserve.hardware import cpu_capabilities
caps = cpu_capabilities()
res = {"isa": _core.cpu.kernel_isa(), "onednn_bf16": caps.onednn_bf16, "native_bf16": caps.native_bf16}
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
prompts = json.loads(sys.argv[2])

def answers(outs):
    return [[(t, lp.logprob) for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]

for dtype, quantization in (("auto", "none"), ("bfloat16", "none"), ("q4", "q4")):
    llm = LLM(model=sys.argv[1], dtype="auto" if dtype == "q4" else dtype, quantization=quantization,
              skip_tokenizer_init=True, num_kv_blocks=32, enable_prefix_caching=False)
    batched = answers(llm.generate(prompts, params, use_tqdm=False))
    alone = [answers(llm.generate([p], params, use_tqdm=False))[0] for p in prompts]
    res[dtype] = {"dtype": str(llm.engine.dtype), "linear": llm.engine.linear_path,
                  "invariance": llm.engine.batch_invariance, "tokens": [[t for t, _ in a] for a in batched],
                  "alone": alone, "batched": batched}
print("RESULT " + json.dumps(res))
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="emulates an x86-64 CPU")
@pytest.mark.skipif(QEMU is None, reason="qemu-x86_64 (Debian's qemu-user) is not installed: cannot emulate an "
                                         "AVX2-only CPU")
def test_the_engine_on_an_emulated_avx2_only_cpu(tiny_llama_dir):
    """qemu-user's Haswell has AVX2 and FMA but no AVX-512 and no bf16, like the
    CPUs where main once crashed: the kernels must pick avx2, --dtype auto
    float32, and both dtypes must produce the right tokens; the engine is
    batch invariant there too (a float checkpoint on our GEMM's tiles in
    float32 and bfloat16, and --quantization q4: each request's tokens and
    logprob bits alone as in the batch of three)."""
    r = subprocess.run([QEMU, "-cpu", "Haswell-v4", sys.executable, "-c", EMULATED, tiny_llama_dir,
                        json.dumps(PROMPTS)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))[7:])
    print(res)
    assert res["isa"] == "avx2" and not res["onednn_bf16"] and not res["native_bf16"]
    assert res["auto"]["dtype"] == "torch.float32"
    assert res["bfloat16"]["dtype"] == "torch.bfloat16" and res["bfloat16"]["linear"].startswith("tiles")
    assert res["q4"]["linear"].startswith("q4")
    for dtype in ("auto", "bfloat16", "q4"):
        assert res[dtype]["invariance"] == "on" and res[dtype]["alone"] == res[dtype]["batched"], dtype
    want = hf_greedy(tiny_llama_dir, PROMPTS, 8)
    assert res["auto"]["tokens"] == want  # float32 on the emulated CPU: the reference's tokens
    assert agreement(res["bfloat16"]["tokens"], want) >= 0.5
