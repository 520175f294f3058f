"""The model-free scheduling simulator (pagedserve.experiments.scheduler) and
its step-cost model: it drives the real C++ scheduler to the end of every
workload, deterministically; the policies differ where they should."""

import json
import random

import numpy as np
import pytest

from pagedserve.experiments import scheduler as sim
from pagedserve.experiments.step_cost import StepCost, StepSample, prediction_error, record_steps
from pagedserve.experiments.workload import EOS_TOKEN_ID, generate

COST = StepCost(a=0.01, b=4e-4, c=1.5e-6, source="test constants")
# a small pool: FCFS must preempt at this load
CFG = sim.SimConfig(num_kv_blocks=256, max_num_seqs=32, max_model_len=2048)


def workload(rate=8.0, n=120, **kw):
    return generate(n, rate, lengths="bimodal", max_model_len=CFG.max_model_len, seed=5, **kw)


def test_workload_is_seeded_and_well_formed():
    a, b = workload(), workload()
    assert a == b
    assert a != generate(120, 8.0, lengths="bimodal", max_model_len=CFG.max_model_len, seed=6)
    arrivals = [r.arrival_s for r in a]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    for r in a:
        assert 1 <= r.output_len <= r.max_tokens and len(r.prompt_token_ids) + r.max_tokens <= CFG.max_model_len
        assert EOS_TOKEN_ID not in r.prompt_token_ids
    shared = generate(20, float("inf"), shared_prefix_len=32, num_prefixes=2, seed=1)
    assert len({tuple(r.prompt_token_ids[:32]) for r in shared}) == 2
    assert all(r.arrival_s == 0 for r in shared)
    with pytest.raises(ValueError):
        generate(5, 1.0, lengths="zipf")
    with pytest.raises(ValueError, match="bimodal"):
        generate(5, 1.0, lengths="bimodal", max_model_len=1024)


@pytest.mark.parametrize("policy", ["fcfs", "priority", "memory-aware"])
def test_every_request_runs_to_its_drawn_length(policy):
    reqs = workload(priority_classes=[0, 1])
    res = sim.simulate(reqs, policy, COST, CFG)
    assert set(res.finished) == {r.request_id for r in reqs}
    for r in reqs:
        assert res.num_output[r.request_id] == r.output_len  # EOS at the drawn length
        assert r.arrival_s <= res.first_scheduled[r.request_id] < res.first_token[r.request_id]
        assert res.first_token[r.request_id] <= res.finished[r.request_id]
    assert res.usage[-1][1] == 0.0  # every block back at the end
    s = res.summary()
    assert s["throughput_tok_s"] > 0 and s["ttft_p99"] >= s["ttft_p50"] > 0
    assert sim.simulate(reqs, policy, COST, CFG).summary() == s  # deterministic


def test_memory_aware_preempts_less_than_fcfs_where_fcfs_preempts():
    reqs = workload()
    fcfs = sim.simulate(reqs, "fcfs", COST, CFG).summary()
    aware = sim.simulate(reqs, "memory-aware", COST, CFG).summary()
    assert fcfs["preemptions"] > 0
    assert aware["preemptions"] < fcfs["preemptions"]


def test_priority_classes_are_served_in_order():
    reqs = workload(rate=12.0, priority_classes=[0, 5])
    s = sim.simulate(reqs, "priority", COST, CFG).summary()
    assert s["ttft_p99[priority=0]"] < s["ttft_p99[priority=5]"]
    fcfs = sim.simulate(reqs, "fcfs", COST, CFG).summary()  # priorities not sent: no per-class gap by design
    assert "ttft_p99[priority=0]" in fcfs


def test_step_cost_fit_recovers_constants_and_stays_non_negative():
    rng = random.Random(0)
    samples = []
    for _ in range(200):
        n, ctx = rng.randint(1, 2048), rng.randint(1, 60000)
        samples.append(StepSample(n, ctx, COST.predict(n, ctx)))
    fit = StepCost.fit(samples)
    assert np.allclose([fit.a, fit.b, fit.c], [COST.a, COST.b, COST.c], rtol=1e-6)
    e = prediction_error(fit, samples)
    assert e["median_step_error"] < 1e-6 and abs(e["total_ratio"] - 1) < 1e-6
    # context cost that falls with context: dropped rather than fitted negative
    falling = [StepSample(n, ctx, 0.01 + 1e-4 * n - 1e-7 * ctx) for n, ctx in ((1, 10), (50, 5000), (400, 100),
                                                                                (900, 20000), (30, 30000))]
    fit = StepCost.fit(falling)
    assert min(fit.a, fit.b, fit.c) >= 0 and fit.c == 0
    with pytest.raises(ValueError):
        StepCost.fit(falling[:2])


def test_calibrate_and_run_from_the_command_line(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "cost.json"
    sim.main(["calibrate", "--model", tiny_llama_dir, "--dtype", "float32", "--num-requests", "6",
              "--out", str(out)])
    text = capsys.readouterr().out
    assert "held-out run" in text and "measured" in text and "predicted" in text
    cost = StepCost.load(str(out))
    assert cost.a >= 0 and cost.b >= 0 and cost.c >= 0 and cost.predict(64, 640) > 0
    png = tmp_path / "policies.png"
    sim.main(["run", "--num-requests", "40", "--rates", "2", "8", "--num-kv-blocks", "256", "--step-cost", str(out), "--plot", str(png)])
    table = capsys.readouterr().out
    assert table.count("| memory-aware |") == 2 and table.count("| fcfs |") == 2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_record_steps_times_real_steps(tiny_llama_dir):
    from pagedserve.config import EngineArgs
    from pagedserve.engine.llm_engine import LLMEngine

    eng = LLMEngine(EngineArgs(model=tiny_llama_dir, dtype="float32", skip_tokenizer_init=True))
    samples = record_steps(eng, 5, seed=1, max_prompt=100, max_output=6)
    assert samples and all(s.seconds > 0 and 1 <= s.num_batched_tokens <= s.sum_seq_lens for s in samples)
    assert max(s.num_batched_tokens for s in samples) > 8  # some prefill steps
    assert eng.num_free_blocks == eng.num_kv_blocks


@pytest.mark.parametrize("flags", [["--rates", "0"], ["--rates", "nan"], ["--num-kv-blocks", "4"],
                                   ["--priority-classes", "a,b"], ["--max-tokens", "0"], ["--watermark", "1.0"],
                                   ["--step-cost", "/nonexistent/cost.json"], ["--plot", "/"]])
def test_bad_flags_are_one_line_errors(flags, capsys):
    with pytest.raises(SystemExit) as e:
        sim.main(["run", "--num-requests", "5", *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


def test_step_cost_constants_are_checked(tmp_path):
    for bad in ({"a": 0, "b": 0, "c": 0}, {"a": -1, "b": 0.1, "c": 0}, {"a": 1}):
        (tmp_path / "c.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError):
            StepCost.load(str(tmp_path / "c.json"))
