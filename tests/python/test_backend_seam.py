"""The backend seam: a registry entry is all a backend needs (the fake one in
fake_backend.py lives only in the tests and reaches the CLI, the parity suite
and the engine), the KV store takes the backend's layout, the per-step plan is
built once per step, and an unusable backend is refused at start-up with the
reason."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.errors import BackendUnavailableError
from pagedserve.kernels import available_backends, backend_names, resolve_backend
from pagedserve.kernels.cpu import CpuAttentionBackend


def test_a_test_only_registry_entry_reaches_the_cli_and_the_parity_suite():
    from pagedserve.server.__main__ import build_parser

    assert "fake" in backend_names()
    action = next(a for a in build_parser()._actions if a.dest == "attention_backend")
    assert {"auto", "cpu", "torch", "fake"} <= set(action.choices)
    here = Path(__file__).parent
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                str(here / "test_attention.py")], cwd=here, capture_output=True, text=True,
                               check=True).stdout.splitlines()
    fake = {line.split("[")[0] for line in collected if "[fake" in line}
    torch_ref = {line.split("[")[0] for line in collected if "[torch" in line}
    assert len(torch_ref) >= 6 and fake == torch_ref, "the parity suite did not run every test for the fake backend"


def test_the_fake_backend_serves_the_engine_with_its_own_layout(tiny_llama_dir):
    prompts = [[5, 6, 7], list(range(10, 60)), list(range(100, 121))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = {}
    for name in ("cpu", "fake"):
        llm = LLM(model=tiny_llama_dir, dtype="float32", attention_backend=name, skip_tokenizer_init=True,
                  num_kv_blocks=32, max_num_batched_tokens=32)
        spec = llm.engine.backend.spec
        layer_shape = llm.engine.backend.kv_cache_shape()
        assert llm.engine.kv_cache.store.shape == (2, *layer_shape)  # the store asked the backend
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.num_free_blocks == spec.num_blocks
    assert llm.engine.kv_cache.store.shape[2:] == (32, 16, 2, 16)  # fake: [num_blocks, block_size, Hkv, D]
    assert outs["fake"] == outs["cpu"]


def test_the_plan_is_built_once_per_step_and_shared_by_every_layer(tiny_llama_dir, monkeypatch):
    # the layers' attention calls from Python (the native step, which a float32 checkpoint on our GEMM's
    # tiles takes, attends inside its one C++ call)
    llm = LLM(model=tiny_llama_dir, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=16, native_step=False)
    backend = llm.engine.backend
    calls = {"make_plan": 0, "paged_attention": 0, "plans": []}  # plans kept alive: ids stay unique
    make_plan, attend = backend.make_plan, backend.paged_attention

    def counting_make_plan(md):
        calls["make_plan"] += 1
        return make_plan(md)

    def counting_attend(query, k_cache, v_cache, plan, scale, **layer):
        calls["paged_attention"] += 1
        calls["plans"].append(plan)
        return attend(query, k_cache, v_cache, plan, scale, **layer)

    monkeypatch.setattr(backend, "make_plan", counting_make_plan)
    monkeypatch.setattr(backend, "paged_attention", counting_attend)
    llm.engine.add_request(list(range(5, 40)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    steps = 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        steps += 1
    layers = llm.engine.model.config.num_hidden_layers
    assert calls["make_plan"] == steps == 3
    assert calls["paged_attention"] == steps * layers
    assert len({id(p) for p in calls["plans"]}) == steps  # each step's layers shared one plan


def test_auto_picks_the_best_available_backend_and_a_named_one_must_fit():
    # metal (priority 200) where this build has it and a GPU loads, else cpu (100)
    from pagedserve.kernels.metal import MetalAttentionBackend
    metal_here = MetalAttentionBackend.availability().available
    assert available_backends("cpu")[0] == ("metal" if metal_here else "cpu")
    assert resolve_backend("auto", "cpu", torch.float32) is (MetalAttentionBackend if metal_here
                                                             else CpuAttentionBackend)
    with pytest.raises(BackendUnavailableError, match="runs on cpu, not cuda"):
        resolve_backend("cpu", "cuda", torch.float32)
    with pytest.raises(BackendUnavailableError, match="float16"):
        resolve_backend("cpu", "cpu", torch.float16)
    with pytest.raises(BackendUnavailableError, match="unknown attention backend 'nope'"):
        resolve_backend("nope", "cpu")


def test_an_unusable_backend_fails_at_start_up_with_the_reason(tiny_llama_dir):
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        LLM(model=tiny_llama_dir, attention_backend="nope", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="no CUDA device|runs on cpu"):
        LLM(model=tiny_llama_dir, device="cuda", attention_backend="cpu", skip_tokenizer_init=True)


def test_the_registry_refuses_broken_entries_and_auto_skips_a_backend_that_fails_to_load(tmp_path, monkeypatch):
    from pagedserve.kernels import register_backend
    from pagedserve.kernels.backend import AttentionBackend

    class Incomplete(AttentionBackend):
        name = "incomplete"

    for bad in (Incomplete, 42, "no-colon", ""):
        with pytest.raises(ValueError):
            register_backend("broken", bad)
    with pytest.raises(ValueError):
        register_backend("auto", "fake_backend:FakeGatherBackend")
    (tmp_path / "native_fails.py").write_text("raise OSError('libmissing.so: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    register_backend("native_fails", "native_fails:Backend")
    try:
        with pytest.raises(BackendUnavailableError, match="libmissing.so"):
            resolve_backend("native_fails")
        assert resolve_backend("auto") is CpuAttentionBackend  # skipped with its reason, not fatal
        assert "native_fails" not in available_backends()
    finally:
        from pagedserve.kernels import _REGISTRY

        _REGISTRY.pop("native_fails", None)
