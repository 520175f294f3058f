"""Issue 31 part 3: --trace-steps records every call into the scheduler; a
trace of a mixed workload (chunked prefill, preemption, n > 1, an abort,
shared prefixes, speculative drafts) replays through a fresh C++ scheduler to
identical decisions, and a replay under another policy or pool fails at the
first differing step."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.experiments.replay import replay


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def trace(tiny_llama_dir, tmp_path_factory):
    """(path, the engine that wrote it) after a mixed workload in a 10-block pool."""
    path = str(tmp_path_factory.mktemp("trace") / "steps.jsonl")
    llm = LLM(model=tiny_llama_dir, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=10,
              max_num_batched_tokens=32, trace_steps=path, speculative="ngram")
    eng = llm.engine
    shared = _prompt(0, 32)
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    eng.add_request(shared + _prompt(1, 10), greedy, "shared-1")
    eng.add_request(_prompt(2, 50), greedy, "long")
    eng.add_request(_prompt(3, 8), SamplingParams(n=2, max_tokens=30, temperature=0.8, seed=5, ignore_eos=True),
                    "parallel")
    eng.add_request(_prompt(4, 20), greedy, "aborted")
    with pytest.raises(ValueError):
        eng.add_request(_prompt(5, 400), greedy, "too-long")  # more blocks than the pool: refused, and traced
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
        if steps == 6:
            eng.abort_request("aborted")
        if steps == 10:
            eng.add_request(shared + _prompt(6, 12), greedy, "shared-2")
    assert eng.num_preemptions > 0
    eng.scheduler.close()
    return path, eng


def test_trace_records_every_call(trace):
    path, eng = trace
    ops = [json.loads(line)["op"] for line in open(path)]
    assert ops[0] == "config"
    for op in ("add_request", "schedule", "update", "abort", "add_draft_tokens", "accept_draft_tokens"):
        assert op in ops, op
    records = [json.loads(line) for line in open(path)]
    refused = [r for r in records if r["op"] == "add_request" and r["request_id"] == "too-long"]
    assert refused and refused[0]["error"] == "RequestRejectedError"
    numbered = [r["step"] for r in records if r["op"] == "schedule" and r["decision"]["request_ids"]]
    assert numbered == list(range(1, eng.num_steps + 1))  # the engine's step numbers
    assert any(r["decision"]["preempted_request_ids"] for r in records if r["op"] == "schedule")


def test_replay_reproduces_every_decision(trace):
    path, eng = trace
    res = replay(path)
    assert res.reproduced, res.first_difference
    assert len(res.step_shapes) == eng.num_steps and res.num_steps >= eng.num_steps
    assert len(res.recorded_step_times) == eng.num_steps and all(t > 0 for t in res.recorded_step_times)


@pytest.mark.parametrize("override", [{"policy": "memory-aware"}, {"num_blocks": 12},
                                      {"max_num_batched_tokens": 16}])
def test_changed_scheduler_fails_at_the_first_differing_step(trace, override):
    path, _ = trace
    res = replay(path, **override)
    assert not res.reproduced
    step, field, recorded, replayed = res.first_difference
    assert recorded != replayed
    # every step before it was the same
    assert len(res.step_shapes) == step - 1 or field not in ("request_ids", "num_scheduled_tokens")


def test_replay_command(trace, tmp_path):
    path, _ = trace
    ok = subprocess.run([sys.executable, "-m", "pagedserve.cli", "replay", path], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.startswith("reproduced:"), ok.stdout + ok.stderr
    bad = subprocess.run([sys.executable, "-m", "pagedserve.cli", "replay", path, "--scheduling-policy",
                          "memory-aware"], capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stdout.startswith("NOT reproduced: step "), bad.stdout + bad.stderr
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"a": 0.01, "b": 0.001, "c": 0.0, "source": "test constants"}))
    timed = subprocess.run([sys.executable, "-m", "pagedserve.cli", "replay", path, "--step-cost", str(cost)],
                           capture_output=True, text=True)
    assert timed.returncode == 0 and "re-timed with" in timed.stdout, timed.stdout + timed.stderr
    not_a_trace = tmp_path / "x.jsonl"
    not_a_trace.write_text('{"op": "schedule"}\n')
    err = subprocess.run([sys.executable, "-m", "pagedserve.cli", "replay", str(not_a_trace)], capture_output=True,
                         text=True)
    assert err.returncode == 2 and "not a step trace" in err.stderr


def test_bad_traces_and_options_exit_2_with_file_and_line(trace, tmp_path):
    path, _ = trace
    lines = open(path).read().splitlines()

    def run(*args):
        return subprocess.run([sys.executable, "-m", "pagedserve.cli", "replay", *args], capture_output=True,
                              text=True)

    cases = {
        "cut.jsonl": "\n".join(lines[:40]) + "\n" + lines[40][:len(lines[40]) // 2],  # cut mid-line
        "list.jsonl": lines[0] + "\n[1, 2]\n",
        "first.jsonl": '"config"\n',
        "blocks.jsonl": lines[0].replace('"num_blocks":10', '"num_blocks":"x"') + "\n",
        "reason.jsonl": lines[0] + '\n{"op":"finish_sequence","request_id":"a","index":0,"reason":"BOGUS"}\n',
        "types.jsonl": lines[0] + '\n{"op":"abort","request_id":[1]}\n',
        "flags.jsonl": lines[0] + '\n{"op":"update","sampled_token_ids":[],"finished_by_caller":null}\n',
        "flag.jsonl": lines[0] + '\n{"op":"update","sampled_token_ids":[],"finished_by_caller":["BOGUS"]}\n',
    }
    for name, text in cases.items():
        f = tmp_path / name
        f.write_text(text)
        r = run(str(f))
        assert r.returncode == 2 and "Traceback" not in r.stderr and str(f) in r.stderr, (name, r.stderr)
    cut = run(str(tmp_path / "cut.jsonl"))
    assert f"cut.jsonl:{41}:" in cut.stderr and "cut short" in cut.stderr
    for opts in (["--num-kv-blocks", "0"], ["--step-cost", str(tmp_path / "missing.json")]):
        r = run(path, *opts)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (opts, r.stderr)
