"""Bounded memory: a few hundred requests of a mixed load through the async
engine (the server's engine path) leave nothing behind. Python-side retained
memory (tracemalloc) and the objects a request creates return to their level
after a warm-up; the native side is covered by bench/soak.py (RSS of a real
server) and by OneDNNLinear's bounded set of GEMM shapes."""

import asyncio
import gc
import random
import tracemalloc

import torch

from pagedserve import LLM, SamplingParams
from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.engine.outputs import CompletionOutput, RequestOutput
from pagedserve.engine.request import Request
from pagedserve.model.linear import padded_rows

TRACKED = (Request, RequestOutput, CompletionOutput, torch.Generator, asyncio.Queue)
TOLERANCE_BYTES = 256 * 1024  # tracemalloc's own bookkeeping and interned strings wander this much


# A snapshot's own lists are traced too (attributed to tracemalloc.py); so is
# whatever the import system loads lazily. Neither is the engine's.
NOT_OURS = (tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib._bootstrap*>"),
            tracemalloc.Filter(False, "<unknown>"))


def traced() -> tracemalloc.Snapshot:
    gc.collect()
    return tracemalloc.take_snapshot().filter_traces(NOT_OURS)


def total(snapshot: tracemalloc.Snapshot) -> int:
    return sum(stat.size for stat in snapshot.statistics("filename"))


def request_objects() -> dict[str, int]:
    """Live objects of each TRACKED class (subclasses included). Reads each
    object's real type (type(o).__mro__), never isinstance: isinstance goes
    through __class__, which lazy-import proxies (e.g. the ones an installed
    `datasets` leaves in transformers) answer by importing modules, and those
    imports would be counted as growth."""
    gc.collect()
    counts = dict.fromkeys((t.__name__ for t in TRACKED), 0)
    for o in gc.get_objects():
        for c in type(o).__mro__:
            if c in TRACKED:
                counts[c.__name__] += 1
    return counts


async def drive(engine: AsyncLLMEngine, rng: random.Random, count: int, vocab: int) -> None:
    """`count` requests, 8 at a time: greedy and seeded sampling, n = 1 or 2,
    logprobs or not, half sharing a 40-token prefix, a fifth abandoned after
    their first output (as a client that disconnects)."""
    prefix = [rng.randrange(3, vocab) for _ in range(40)]
    gate = asyncio.Semaphore(8)

    async def one(i: int) -> None:
        prompt = (prefix if rng.random() < 0.5 else []) + [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 50))]
        params = SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(10**6),
                                max_tokens=rng.randrange(2, 20), n=rng.choice([1, 2]),
                                logprobs=rng.choice([None, 2]), ignore_eos=True)
        abandon = rng.random() < 0.2
        async with gate:
            stream = engine.generate(prompt, params, f"soak-{i}-{rng.random()}")
            async for out in stream:
                if abandon:
                    break
            await stream.aclose()

    await asyncio.gather(*(one(i) for i in range(count)))
    while engine.engine.has_unfinished_requests():  # aborts are applied by the engine thread
        await asyncio.sleep(0.01)


def test_a_mixed_load_leaves_nothing_behind(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=48, max_num_seqs=16)
    engine = AsyncLLMEngine(llm.engine)
    rng = random.Random(0)
    try:
        async def run():
            await drive(engine, rng, 60, 512)  # warm-up: caches, pools, interned strings
            tracemalloc.start()
            await drive(engine, rng, 60, 512)  # ... and what tracemalloc's own first traces hold
            base_objects, base = request_objects(), traced()
            for _ in range(4):
                await drive(engine, rng, 60, 512)
            end_objects, end = request_objects(), traced()
            grown = [str(s) for s in end.compare_to(base, "lineno")[:5]]
            return total(base), base_objects, total(end), end_objects, grown

        base_bytes, base_objects, end_bytes, end_objects, grown = asyncio.run(run())
    finally:
        tracemalloc.stop()
        engine.shutdown()
    print(f"traced after warm-up {base_bytes} B, after 240 more requests {end_bytes} B; objects {end_objects}")
    assert base_objects == dict.fromkeys(base_objects, 0), base_objects  # nothing of a finished request survives
    assert end_objects == base_objects, (base_objects, end_objects)
    assert end_objects["Request"] == 0 and end_objects["RequestOutput"] == 0
    assert end_bytes - base_bytes < TOLERANCE_BYTES, grown
    assert llm.engine.num_free_blocks == llm.engine.num_kv_blocks
    assert not llm.engine.requests


def test_the_linear_layers_see_a_bounded_set_of_row_counts():
    """oneDNN keeps per-shape state; the step's token count takes any value up
    to max_num_batched_tokens, the padded row count only 34."""
    rows = {padded_rows(m) for m in range(1, 2049)}
    assert len(rows) == 34 and all(padded_rows(m) >= m for m in range(1, 2049))
    assert padded_rows(1) == 8 and padded_rows(64) == 64 and padded_rows(65) == 96 and padded_rows(513) == 640
