"""The GEMM-path chooser (--linear-impl, pagedserve/model/linear.py): it picks
only paths that run and compute x @ W.T + b on this CPU, caches its choice per
machine, honours a named path, and the engine logs what it chose."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from pagedserve import LLM, hardware
from pagedserve.model import linear, tuner
from pagedserve.model.linear import CHOOSER_ROWS, OneDNNLinear, choose_linear_impl
from pagedserve.model.linear_method import LinearMethodTable


class QuietProbe(tuner.LoadProbe):
    """A load probe that reports an idle machine."""

    def share(self) -> float:
        return 0.0


class SteadyClock:
    """A clock that moves ``step`` seconds per reading: every timed call takes the same time."""

    def __init__(self, step: float = 1e-3) -> None:
        self.t, self.step = 0.0, step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    # whether a choice is cached must not depend on how quiet the test machine is: a clock whose rounds agree
    # and an idle load probe (the tests of the noise rules inject theirs)
    monkeypatch.setattr(tuner, "LoadProbe", QuietProbe)
    monkeypatch.setattr(tuner, "now", SteadyClock())
    return tmp_path


def small_model(bias: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96, bias=bias), torch.nn.Linear(96, 64, bias=bias))


def test_the_chosen_path_runs_here_and_computes_the_layer(cache):
    model = small_model(bias=True)
    choice = choose_linear_impl(model, torch.float32, "cpu")
    assert choice.impl in linear.LINEAR_IMPLS and not choice.cached
    assert set(choice.ms) | set(choice.refused) == set(linear.LINEAR_IMPLS)
    assert all(set(times) == set(CHOOSER_ROWS) and min(times.values()) > 0 for times in choice.ms.values())
    x = torch.randn(5, 64)
    want = model(x)
    LinearMethodTable([linear.DenseMethod(choice)]).install(model)
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)


def test_a_path_that_raises_is_never_chosen(cache, monkeypatch):
    def crash(self, x):
        raise RuntimeError("illegal instruction in a fake GEMM")

    monkeypatch.setattr(OneDNNLinear, "forward", crash)
    choice = choose_linear_impl(small_model(), torch.float32, "cpu")
    assert choice.impl == "torch"
    assert "illegal instruction" in choice.refused["onednn"]


def test_a_path_that_computes_something_else_is_never_chosen_even_if_faster(cache, monkeypatch):
    forward = OneDNNLinear.forward
    monkeypatch.setattr(OneDNNLinear, "forward", lambda self, x: forward(self, x) * 1.01)
    slow = torch.nn.functional.linear

    def slower(*args, **kwargs):  # the correct path made slow: a wrong one must still lose
        for _ in range(20):
            slow(*args, **kwargs)
        return slow(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "linear", slower)
    choice = choose_linear_impl(small_model(), torch.float32, "cpu")
    assert choice.impl == "torch"
    assert "differs from a float64 matmul" in choice.refused["onednn"]


def test_the_choice_is_cached_per_machine_and_reused_without_measuring(cache, monkeypatch):
    first = choose_linear_impl(small_model(), torch.float32, "cpu")
    saved = json.loads((cache / "linear_impl.json").read_text())
    assert [entry["impl"] for entry in saved.values()] == [first.impl]

    def no_timing(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(tuner, "time_cases", no_timing)
    again = choose_linear_impl(small_model(), torch.float32, "cpu")
    assert again.cached and again.impl == first.impl
    # other shapes are another entry: measured, not read (here every measurement fails, so nothing is chosen)
    with pytest.raises(RuntimeError, match="no GEMM path works on this machine.*measured again"):
        choose_linear_impl(torch.nn.Sequential(torch.nn.Linear(32, 32)), torch.float32, "cpu")


def test_a_named_path_is_used_without_measuring_and_refused_where_it_cannot_run(cache, monkeypatch):
    monkeypatch.setattr(tuner, "time_cases", lambda *a, **k: pytest.fail("measured"))
    assert choose_linear_impl(small_model(), torch.float32, "cpu", "torch").impl == "torch"
    assert choose_linear_impl(small_model(), torch.float32, "cpu", "onednn").impl == "onednn"
    fake = hardware.CpuCapabilities(arch="x86_64", features=("avx2",), native_bf16=False, onednn_bf16=False)
    monkeypatch.setattr(hardware, "cpu_capabilities", lambda: fake)
    with pytest.raises(ValueError, match="--linear-impl onednn cannot run here: oneDNN's bfloat16 linear needs"):
        choose_linear_impl(small_model(), torch.bfloat16, "cpu", "onednn")
    # auto with one path left takes it, and says why the other is out
    choice = choose_linear_impl(small_model(), torch.bfloat16, "cpu")
    assert choice.impl == "torch" and "avx512bw" in choice.reason
    with pytest.raises(ValueError, match="linear_impl must be"):
        choose_linear_impl(small_model(), torch.float32, "cpu", "blas")


def test_the_engine_logs_its_choice(tiny_llama_dir, cache, caplog):
    with caplog.at_level(logging.INFO, logger="pagedserve.engine"):
        llm = LLM(model=tiny_llama_dir, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=16)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("linear layers: ")]
    assert lines == [f"linear layers: {llm.engine.linear_path}"]
    assert "measured: ms per pass over the linear layers at 1/8/32/128 rows" in lines[0]
    assert any(r.getMessage().startswith("memory: weights ") for r in caplog.records)


def test_the_throughput_benchmark_reports_the_path_and_quantisations_accuracy(tiny_llama_dir, cache, capsys,
                                                                           monkeypatch):
    """bench/throughput.py names the GEMM path (or quantisation) in its table's
    header, alternates the systems --repeat times, runs PagedServe with its
    prefix cache off (the repeats resend the same prompts) and, with
    --quantization, in the engine's default dtype, and prints the greedy
    agreement with float32."""
    from pagedserve.bench import throughput

    made = []

    def spy(**kwargs):
        made.append(kwargs)
        return throughput_llm(**kwargs)

    throughput_llm = throughput.LLM
    monkeypatch.setattr(throughput, "LLM", spy)
    throughput.main(["--model", tiny_llama_dir, "--num-requests", "2", "--prompt-len", "4", "--output-len", "3",
                     "--skip-sequential", "--repeat", "2", "--quantization", "int8"])
    out = capsys.readouterr().out
    assert out.count("run ") == 2 and "run 2/2: HF generate(), static batch" in out
    assert "linear layers: int8: int8 activations; 0 layers on the GGUF's own blocks, 15 quantised here to q8_0" in out
    assert "decoder forward pagedserve (lean Llama forward; auto: a Llama-architecture model; " in out
    assert "| PagedServe |" in out and "| HF generate(), static batch |" in out
    assert made[0]["enable_prefix_caching"] is False and made[0]["dtype"] == "auto"
    dtype = "bfloat16" if "PagedServe bfloat16:" in out else "float32"
    assert f"accuracy of PagedServe ({dtype}, linear layers int8) against float32 (greedy, 2 sequences of 3" in out
    with pytest.raises(SystemExit):
        throughput.main(["--model", tiny_llama_dir, "--repeat", "0"])


@pytest.mark.parametrize("content", ["null", "[]", "123", '"x"', "{not json", '{"k": "onednn"}', '{"k": {"impl": 3}}'])
def test_a_malformed_cache_is_measured_again_not_an_error(cache, content):
    (cache / "linear_impl.json").write_text(content)
    choice = choose_linear_impl(small_model(), torch.float32, "cpu")
    assert not choice.cached and choice.impl in linear.LINEAR_IMPLS
    assert choose_linear_impl(small_model(), torch.float32, "cpu").cached  # and the file is whole again


def test_a_noisy_measurement_decides_this_start_but_is_never_cached(cache):
    """Rounds that disagree (an injected timer that slows down as it goes, as on a machine that gets busier) are
    measured again up to max_rounds; if they still disagree the choice is used once and not cached."""

    class SlowingClock(SteadyClock):
        n = 0

        def __call__(self) -> float:  # each call takes 1.5x longer every 200 readings: no two rounds agree
            self.n += 1
            self.t += self.step * 1.5 ** (self.n // 200)
            return self.t

    first = choose_linear_impl(small_model(), torch.float32, "cpu", clock=SlowingClock())
    assert first.impl in linear.LINEAR_IMPLS and not first.cached
    assert "not cached: its rounds disagree" in first.reason
    assert not (cache / "linear_impl.json").exists()
    again = choose_linear_impl(small_model(), torch.float32, "cpu")  # the steady clock: trusted, cached
    assert not again.cached and "not cached" not in again.reason
    assert choose_linear_impl(small_model(), torch.float32, "cpu").cached


def test_a_measurement_while_other_processes_ran_is_not_cached(cache):
    class BusyProbe(tuner.LoadProbe):
        def share(self) -> float:
            return 0.8  # another process took 80% of a core while the chooser measured

    choice = choose_linear_impl(small_model(), torch.float32, "cpu", probe=BusyProbe())
    assert "not cached: other processes used 80% of a core" in choice.reason
    assert not (cache / "linear_impl.json").exists()


def test_the_cache_records_the_cpu_and_library_versions_it_holds_for(cache, monkeypatch):
    choose_linear_impl(small_model(), torch.float32, "cpu")
    (entry,) = json.loads((cache / "linear_impl.json").read_text()).values()
    m = entry["machine"]
    assert m["torch"] == torch.__version__ and m["threads"] == torch.get_num_threads()
    assert {"cpu", "features", "kernel_isa", "onednn", "mkl", "pagedserve"} <= set(m)
    assert entry["for"]["dtype"] == "torch.float32" and entry["spread"] and entry["rounds"] >= 3
    # another library version is another machine: measured again, not read
    monkeypatch.setattr(tuner, "library_versions", lambda: {**m, "onednn": "0.0-other"})
    assert not choose_linear_impl(small_model(), torch.float32, "cpu").cached


def test_the_load_probe_sees_another_process_spin():
    """The real probe: a busy loop in another process while we sleep shows up as other load."""
    import subprocess
    import sys
    import time

    probe = tuner.LoadProbe()
    probe.start()
    time.sleep(0.3)
    idle = probe.share()
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<1.5: pass"])
    try:
        time.sleep(0.2)
        probe.start()
        time.sleep(0.8)
        busy = probe.share()
    finally:
        spinner.wait()
    if not _proc_stat():
        pytest.skip("no /proc/stat here: the probe reports 0 and only the rounds' spread guards the cache")
    assert busy > 0.5 and busy > idle, (idle, busy)


def _proc_stat() -> bool:
    import os

    return os.path.exists("/proc/stat")
