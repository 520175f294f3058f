"""The Metal backend (pagedserve.kernels.metal, csrc/backends/metal/).

Everywhere: the registry lists `metal` with the reason it is unavailable here,
`LLM` and the server refuse `--attention-backend metal` at start-up with that
reason, and the benchmark says it was skipped and exits 0.

Marked `metal` (they run only where the backend is available: macOS on Apple
silicon, built with PAGEDSERVE_METAL; elsewhere skipped with the reason): the
installed .metallib and the embedded source both load (PAGEDSERVE_METALLIB and
PAGEDSERVE_METAL_SOURCE=1 force each), the GPU equals the CPU backend on the
parity cases (decode, prefill with earlier context, split-KV on and off, GQA,
float32/float16/bfloat16), the shared KV store aliases both ways without a copy
and lives as long as any view of it, nothing is allocated per layer call, and
the engine's greedy output on SmolLM2 equals the CPU backend's. (The parity
suite, test_attention.py, also runs every case of the contract on `metal`
where it is available.)
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import platform
import random
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedserve import LLM, SamplingParams, _core
from pagedserve.errors import BackendUnavailableError
from pagedserve.kernels import available_backends, backend_names, get_backend_class, resolve_backend, why_not
from pagedserve.kernels.backend import AttentionFeatures, AttentionMetadata, AttentionSpec
from pagedserve.kernels.cpu import CpuAttentionBackend
from pagedserve.kernels.metal import MetalAttentionBackend

REPO = Path(__file__).resolve().parents[2]
AVAILABLE = MetalAttentionBackend.availability()


def metal(test):
    """Marks a test `metal` and skips it, with the reason, where the backend is unavailable."""
    skip = pytest.mark.skipif(not AVAILABLE.available, reason=f"metal backend unavailable: {AVAILABLE.reason}")
    return pytest.mark.metal(skip(test))


unavailable_only = pytest.mark.skipif(AVAILABLE.available, reason="the metal backend is available here")


# ---- everywhere ---------------------------------------------------------------------------------
def test_the_registry_lists_metal_with_the_reason_it_is_unavailable_here():
    assert "metal" in backend_names()
    cls = get_backend_class("metal")
    assert cls is MetalAttentionBackend
    assert cls.priority > CpuAttentionBackend.priority  # `auto` prefers the GPU where it runs
    assert cls.devices == ("cpu",) and set(cls.dtypes) == {torch.float32, torch.bfloat16, torch.float16}
    every = AttentionFeatures(sliding_window=8, logit_softcap=5.0, alibi=True, sinks=True)
    assert len(cls.unsupported_features(every)) == 4  # windows, soft-capping, ALiBi, sinks: not implemented
    if AVAILABLE.available:
        assert available_backends("cpu")[0] == "metal"
        return
    assert AVAILABLE.reason and why_not(cls, "cpu") == AVAILABLE.reason
    assert "metal" not in available_backends("cpu")
    assert "PAGEDSERVE_METAL" in AVAILABLE.reason
    if not (sys.platform == "darwin" and platform.machine() == "arm64"):
        assert AVAILABLE.reason.startswith("this build has no Metal backend: it needs macOS on Apple silicon")
    with pytest.raises(BackendUnavailableError, match=re.escape(AVAILABLE.reason)):
        resolve_backend("metal", "cpu")
    with pytest.raises(BackendUnavailableError, match=re.escape(AVAILABLE.reason)):
        MetalAttentionBackend(AttentionSpec(4, 2, 32, 16, 8, torch.float32))
    assert resolve_backend("auto", "cpu", torch.float32) is CpuAttentionBackend


def test_the_cli_offers_metal():
    from pagedserve.server.__main__ import build_parser

    action = next(a for a in build_parser()._actions if a.dest == "attention_backend")
    assert "metal" in action.choices


@unavailable_only
def test_llm_and_the_server_refuse_metal_at_start_up_with_the_reason(tiny_llama_dir):
    with pytest.raises(BackendUnavailableError, match=re.escape(AVAILABLE.reason)):
        LLM(model=tiny_llama_dir, attention_backend="metal", skip_tokenizer_init=True)
    from pagedserve.server import __main__ as server_main

    with pytest.raises(SystemExit) as e:
        server_main.main(["--model", tiny_llama_dir, "--attention-backend", "metal", "--skip-tokenizer-init"])
    message = str(e.value.code)
    assert message.startswith("pagedserve: cannot start:") and AVAILABLE.reason in message


@unavailable_only
def test_the_benchmark_says_it_was_skipped_and_exits_0(capsys):
    from pagedserve.cli import main as cli_main

    cli_main(["bench", "metal-attention"])
    assert capsys.readouterr().out == f"metal-attention: skipped: {AVAILABLE.reason}\n"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "metal_attention.py"), "--seq-lens", "128"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("metal-attention: skipped: this build has no Metal backend")


def test_the_benchmark_script_calls_the_packaged_benchmark_and_knows_the_chips():
    shim = runpy.run_path(str(REPO / "bench" / "metal_attention.py"), run_name="shim")
    bench = importlib.import_module("pagedserve.bench.metal_attention")
    assert shim["main"] is bench.main
    assert bench.chip_bandwidth_gbs("Apple M2 Pro") == 200
    assert bench.chip_bandwidth_gbs("Apple M3 Max") == 400
    assert bench.chip_bandwidth_gbs("Apple M1") == 68.25
    assert bench.chip_bandwidth_gbs("Apple M4 Pro") == 273
    assert bench.chip_bandwidth_gbs("AMD Radeon Pro 5500M") is None
    # B=16, H=12, D=64, S=128, float16: K and V dominate
    assert bench.bytes_read(16, 12, 128, 64, 2, 16) == 2 * 16 * 128 * 12 * 64 * 2 + 16 * 12 * 64 * 2 + 16 * 8 * 4


# ---- where the backend runs ------------------------------------------------------------------------
def make_inputs(seed, q_lens, seq_lens, block_size, h, hkv, d, dtype):
    """Random K/V/queries (dtype-rounded) in shuffled blocks, and the step's metadata."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(per_seq) + 3
    perm = list(range(num_blocks))
    rng.shuffle(perm)
    tables = torch.full((len(seq_lens), max(per_seq)), -1, dtype=torch.int32)
    slots, i = [], 0
    for b, n in enumerate(seq_lens):
        ids = perm[i:i + per_seq[b]]
        i += per_seq[b]
        tables[b, :len(ids)] = torch.tensor(ids)
        slots += [ids[p // block_size] * block_size + p % block_size for p in range(n)]
    total = sum(seq_lens)
    keys = torch.randn(total, hkv, d, generator=g).to(dtype)
    values = torch.randn(total, hkv, d, generator=g).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), h, d, generator=g).to(dtype)
    md = AttentionMetadata(torch.tensor(slots), qsl, torch.tensor(seq_lens, dtype=torch.int32), tables)
    return num_blocks, keys, values, query, md


def attend(cls, inputs, h, hkv, d, block_size, dtype, split=None, partition_size=None):
    """`cls`'s paged attention of the inputs, K/V written through its own reshape_and_cache."""
    num_blocks, keys, values, query, md = inputs
    backend = cls(AttentionSpec(h, hkv, d, block_size, num_blocks, dtype))
    if split is not None:
        backend.split_kv, backend.partition_size = split, partition_size
    k_cache, v_cache = backend.split_kv_cache(backend.allocate_kv_cache(1)[0])
    backend.reshape_and_cache(keys.to(dtype), values.to(dtype), k_cache, v_cache, md.slot_mapping)
    plan = backend.make_plan(md)
    return backend, plan, backend.paged_attention(query.to(dtype), k_cache, v_cache, plan, d ** -0.5)


PARITY_CASES = {
    "decode": dict(q_lens=[1, 1, 1, 1], seq_lens=[1, 17, 300, 1300], h=8, hkv=2, d=64, block_size=16),
    "prefill_with_earlier_context_mixed": dict(q_lens=[1, 9, 1, 20], seq_lens=[300, 40, 17, 1000], h=8, hkv=2, d=64,
                                               block_size=16),
    "prefill_from_scratch_mha": dict(q_lens=[33], seq_lens=[33], h=4, hkv=4, d=128, block_size=32),
    "gqa_group_16": dict(q_lens=[1, 5], seq_lens=[700, 60], h=16, hkv=1, d=64, block_size=16),
}


@metal
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("split", ["off", "on"])
@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_the_gpu_equals_the_cpu_backend(case, split, dtype):
    c = PARITY_CASES[case]
    geometry = (c["h"], c["hkv"], c["d"], c["block_size"])
    inputs = make_inputs(7, c["q_lens"], c["seq_lens"], c["block_size"], c["h"], c["hkv"], c["d"], dtype)
    _, plan, got = attend(MetalAttentionBackend, inputs, *geometry, dtype, split=split, partition_size=128)
    assert plan.plan.split == (split == "on" and plan.plan.decode_items > 0)
    # the CPU backend has no float16: it computes those from the same float16-rounded inputs in float32
    cpu_dtype = torch.float32 if dtype == torch.float16 else dtype
    _, _, want = attend(CpuAttentionBackend, inputs, *geometry, cpu_dtype)
    assert got.dtype == dtype and got.shape == want.shape
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def _installed_metallib() -> str | None:
    for entry in _core.metal.library_candidates():
        m = re.match(r"metallib (.+) \(installed next to _core\)$", entry)
        if m and os.path.isfile(m.group(1)):
            return m.group(1)
    return None


PROBE = """
import json, torch
from pagedserve.kernels.metal import MetalAttentionBackend, device_info
from pagedserve.kernels.cpu import CpuAttentionBackend
from test_metal_backend import attend, make_inputs
assert MetalAttentionBackend.availability().available, MetalAttentionBackend.availability().reason
inputs = make_inputs(3, [1, 6], [100, 40], 16, 8, 2, 64, torch.float32)
got = attend(MetalAttentionBackend, inputs, 8, 2, 64, 16, torch.float32)[2]
want = attend(CpuAttentionBackend, inputs, 8, 2, 64, 16, torch.float32)[2]
print(json.dumps({"library": device_info()["library"], "max_diff": float((got - want).abs().max())}))
"""


@metal
@pytest.mark.parametrize("source", ["installed metallib", "embedded source"])
def test_both_kernel_libraries_load_and_compute(source):
    env = {k: v for k, v in os.environ.items() if k not in ("PAGEDSERVE_METALLIB", "PAGEDSERVE_METAL_SOURCE")}
    if source == "installed metallib":
        path = _installed_metallib()
        if path is None:
            pytest.skip(f"no pagedserve.metallib next to _core (looked at: {_core.metal.library_candidates()})")
        env["PAGEDSERVE_METALLIB"] = path
        want = f"metallib {path}"
    else:
        env["PAGEDSERVE_METAL_SOURCE"] = "1"
        want = "embedded source"
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["library"].startswith(want), result
    assert result["max_diff"] < 1e-4, result


@metal
def test_a_missing_metallib_asked_for_is_an_error_naming_it(tmp_path):
    env = {**os.environ, "PAGEDSERVE_METALLIB": str(tmp_path / "nope.metallib")}
    env.pop("PAGEDSERVE_METAL_SOURCE", None)
    code = "from pagedserve.kernels.metal import MetalAttentionBackend as M; print(M.availability().reason)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "nope.metallib" in proc.stdout and "PAGEDSERVE_METALLIB" in proc.stdout


@metal
def test_the_shared_store_aliases_both_ways_without_a_copy():
    h, hkv, d, bs = 4, 2, 32, 16
    backend = MetalAttentionBackend(AttentionSpec(h, hkv, d, bs, 6, torch.float32))
    store = backend.allocate_kv_cache(2)
    assert store.shape == (2, 2, 6, hkv, bs, d) and store.abs().sum() == 0
    k_cache, v_cache = backend.split_kv_cache(store[1])
    # the GPU writes (reshape_and_cache's kernel), the CPU tensor sees it
    key, value = torch.randn(3, hkv, d), torch.randn(3, hkv, d)
    backend.reshape_and_cache(key, value, k_cache, v_cache, torch.tensor([2 * bs + 5, -1, 7]))
    assert torch.equal(k_cache[2, :, 5], key[0]) and torch.equal(v_cache[0, :, 7], value[2])
    assert store[0].count_nonzero() == 0 and k_cache.count_nonzero() == 2 * hkv * d  # token 1 skipped
    # the CPU writes into the store, the GPU reads it: one sequence of 20 keys in blocks 4 and 1
    keys, values = torch.randn(20, hkv, d), torch.randn(20, hkv, d)
    for p in range(20):
        blk, off = (4, p) if p < bs else (1, p - bs)
        k_cache[blk, :, off], v_cache[blk, :, off] = keys[p], values[p]
    query = torch.randn(1, h, d)
    md = AttentionMetadata(torch.tensor([bs + 3]), torch.tensor([0, 1], dtype=torch.int32),
                           torch.tensor([20], dtype=torch.int32), torch.tensor([[4, 1]], dtype=torch.int32))
    got = backend.paged_attention(query, k_cache, v_cache, backend.make_plan(md), d ** -0.5)
    from pagedserve.kernels.torch_ref import dense_attention

    want = dense_attention(query, [keys], [values], md.query_start_loc, d ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # a copy of the cache is not the store: refused, nothing read through it
    with pytest.raises(ValueError, match="not a view of a Metal KV store"):
        backend.paged_attention(query, k_cache.clone(), v_cache, backend.make_plan(md), d ** -0.5)


@metal
def test_the_store_lives_as_long_as_any_view_of_it():
    backend = MetalAttentionBackend(AttentionSpec(4, 2, 32, 16, 8, torch.bfloat16))
    gc.collect()
    count, nbytes = _core.metal.live_buffers()
    store = backend.allocate_kv_cache(3)
    assert store.dtype == torch.bfloat16
    assert _core.metal.live_buffers() == (count + 1, nbytes + store.numel() * 2)
    view = backend.split_kv_cache(store[2])[1]
    del store
    gc.collect()
    assert _core.metal.live_buffers()[0] == count + 1  # the view holds the buffer
    view.fill_(1.5)
    assert view.float().sum() == 1.5 * view.numel()
    del view
    gc.collect()
    assert _core.metal.live_buffers() == (count, nbytes)


@metal
def test_no_allocation_per_layer_call_and_gpu_time_is_reported():
    c = PARITY_CASES["prefill_with_earlier_context_mixed"]
    inputs = make_inputs(5, c["q_lens"], c["seq_lens"], 16, 8, 2, 64, torch.float32)
    backend, plan, first = attend(MetalAttentionBackend, inputs, 8, 2, 64, 16, torch.float32, "on", 128)
    assert backend.last_gpu_seconds > 0
    stats, live = backend.staging_stats, _core.metal.live_buffers()[0]
    num_blocks, keys, values, query, md = inputs
    k_cache, v_cache = backend.split_kv_cache(backend.allocate_kv_cache(1)[0])
    backend.reshape_and_cache(keys, values, k_cache, v_cache, md.slot_mapping)
    live = _core.metal.live_buffers()[0]
    for _ in range(2 * 6):  # two steps' worth of layers sharing one plan
        backend.reshape_and_cache(keys, values, k_cache, v_cache, md.slot_mapping)
        out = backend.paged_attention(query, k_cache, v_cache, plan, 64 ** -0.5)
        assert 0 < backend.last_gpu_seconds < 10
    torch.testing.assert_close(out, first)
    after = backend.staging_stats
    for key in ("io_allocations", "metadata_allocations", "scratch_allocations", "metadata_uploads"):
        assert after[key] == stats[key], key
    assert after["command_buffers"] == stats["command_buffers"] + 1 + 2 * 2 * 6
    assert _core.metal.live_buffers()[0] == live


@metal
def test_smollm2_greedy_on_metal_equals_the_cpu_backend(smollm2_dir):
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (3, 17, 40, 95, 130, 9)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for name in ("cpu", "metal"):
        llm = LLM(dtype="float32", max_num_batched_tokens=64, attention_backend=name)
        assert llm.engine.backend.name == name
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.num_free_blocks == llm.engine.num_kv_blocks
    assert outs["metal"] == outs["cpu"]
