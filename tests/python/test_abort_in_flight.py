"""LLMEngine.abort_unscheduled: a request the forward pass in flight does not
compute ends at once, from another thread, while that forward runs (a queued
request of a client that left never waits for a long prefill step); one the
step computes is left to the step and aborted after it."""

from __future__ import annotations

import threading

from pagedserve import LLM, SamplingParams


def test_a_waiting_request_ends_while_the_forward_pass_runs(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
              max_num_batched_tokens=64)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i in range(3):  # 60 prompt tokens each: a 64-token step takes the first and 4 tokens of the second
        engine.add_request([5 + i] * 60, params, f"r{i}")
    entered, release = threading.Event(), threading.Event()
    execute = engine.runner.execute

    def slow_execute(inp):
        entered.set()
        assert release.wait(30)
        return execute(inp)

    engine.runner.execute = slow_execute
    outputs = []
    step = threading.Thread(target=lambda: outputs.extend(engine.step()))
    step.start()
    try:
        assert entered.wait(30)
        assert engine.scheduler.num_waiting == 1  # r2: not in this step
        # the gauges say what the forward pass computes while it runs (r0 and r1's first prefill: running)
        gauge = lambda name: engine.metrics.registry.get_sample_value(  # noqa: E731
            name, {"model_name": engine.metrics.model_name})
        assert gauge("vllm:num_requests_running") == 2 and gauge("vllm:num_requests_waiting") == 1
        assert not engine.abort_unscheduled("r0") and not engine.abort_unscheduled("r1")  # the step computes them
        assert engine.abort_unscheduled("r2")  # returns while the forward pass is still blocked
        assert step.is_alive() and engine.scheduler.num_waiting == 0 and "r2" not in engine.requests
        assert gauge("vllm:num_requests_waiting") == 0
        assert not engine.abort_unscheduled("r2") and not engine.abort_unscheduled("unknown")
    finally:
        release.set()
        step.join(30)
    engine.runner.execute = execute
    assert not step.is_alive()
    for rid in ("r0", "r1"):  # after the step: aborted as before, every block given back
        engine.abort_request(rid)
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks == engine.num_kv_blocks
