"""Throughput: sequential HF generate() vs HF static batching vs PagedServe, in one process.

N requests of PROMPT_LEN random tokens, OUTPUT_LEN greedy output tokens each,
EOS ignored; the Hugging Face baselines run in float32, PagedServe in --dtype
(by default float32, so its greedy tokens can be compared with static
batching's: float32 rounding differs between a padded batch and a packed one,
so a near-tie can flip a token; with --quantization (--linear-impl q4|int8)
the engine's own default, auto, as `pagedserve serve --quantization ...` runs:
float32 on the CPU). Each system first runs a short untimed
warm-up; --repeat R alternates static batching and PagedServe R times and
keeps each one's fastest run. PagedServe runs with its prefix cache off: the
repeats send the same prompts again, and a cache hit there would skip prefill
work that static batching has to do. Prints tokens/s of each and the ratios, and how
many PagedServe outputs equal static batching's.

    pagedserve bench throughput [--num-requests 32] [--prompt-len 64] [--output-len 64] [--skip-sequential]
                                [--repeat R] [--dtype auto|float32|bfloat16] [--quantization none|q4|int8]
                                [--linear-impl auto|gguf|torch|onednn|q4|int8] [--model-impl auto|pagedserve|transformers]
                                [--plot PATH] [--constrained K]

(from a checkout, ``python bench/throughput.py`` takes the same flags)

The table's header names PagedServe's decoder forward and the GEMM path its
start-up chooser took (or the quantisation), and the weights' memory. With
--quantization or a bfloat16 --dtype the outputs are no longer float32's: the
script then prints the greedy agreement with static batching's float32
sequences and the perplexity of a fixed English text
(pagedserve/bench/data/perplexity.txt, written for this benchmark) under
PagedServe and under the float32 Hugging Face model.

--plot PATH also writes the table as a PNG figure (needs matplotlib, the
``bench`` extra): output tokens/s and wall time per system. --constrained K
adds a PagedServe run with K of the requests under a grammar (structured
outputs) and prints what that costs the whole batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from importlib import resources

import torch
from transformers import AutoModelForCausalLM

from pagedserve import LLM, SamplingParams
from pagedserve.config import LINEAR_METHODS, QUANTIZATIONS, EngineArgs
from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.baseline.hf_generate import generate_sequential, generate_static_batch
from pagedserve.experiments import plots
from pagedserve.kernels import backend_names


def plot(results: list[tuple[str, float, float]], path: str, title: str = "") -> str:
    """Writes a two-panel bar PNG to path and returns path. Left: output tokens/s
    of each system, labelled with its ratio to static batching where that ran;
    right: wall time of the timed run (s). results: (system, seconds, tokens/s) rows."""
    names = [n.replace(", ", ",\n") for n, _, _ in results]
    base = next((tps for n, _, tps in results if "static" in n), None)
    fig, (tps_ax, time_ax) = plots.new_figure(ncols=2)
    plots.draw_bars(tps_ax, names, {"output tokens/s": [tps for _, _, tps in results]}, ylabel="output tokens/s",
                    title="throughput (higher is better)")
    plots.label_bars(tps_ax, (lambda v: f"{v:.1f} ({v / base:.2f}x)") if base else "{:.1f}")
    plots.draw_bars(time_ax, names, {"wall time": [dt for _, dt, _ in results]}, ylabel="time (s)",
                    title="wall time (lower is better)")
    plots.label_bars(time_ax, "{:.2f}")
    for ax in (tps_ax, time_ax):
        ax.tick_params(axis="x", labelsize="small")
        ax.get_legend().remove()  # one series: the panel title says what it is
    return plots.save(fig, path, suptitle=title)


def constrained_row(llm, prompts, params, outs, k: int) -> None:
    """Measures the same batch with the first k requests constrained by a regex
    grammar (words and spaces) against it unconstrained, alternating the two
    runs twice (A B A B: a warm-up or a busy moment hits both) and keeping each
    one's best; tokens/s from the tokens really produced (the grammar may end a
    request early). Prints the ratio (not a table row: its runs are warmer than
    the table's) and checks that
    the unconstrained requests produced the same tokens as without it."""
    grammar = StructuredOutputsParams(regex=r"([a-zA-Z]+ )*[a-zA-Z]+")
    mixed = [dataclasses.replace(params, structured_outputs=grammar)] * k + [params] * (len(prompts) - k)
    best = {"plain": 0.0, "constrained": 0.0}
    for _ in range(2):
        for name, p in (("plain", params), ("constrained", mixed)):
            t0 = time.perf_counter()
            got = llm.generate(prompts, p, use_tqdm=False)
            dt = time.perf_counter() - t0
            best[name] = max(best[name], sum(len(o.outputs[0].token_ids) for o in got) / dt)
    free = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(got[k:], outs[k:]))
    ratio = best["constrained"] / best["plain"]
    print(f"{k} constrained request(s) of {len(prompts)}, best of two alternating runs each: "
          f"{best['constrained']:.1f} vs {best['plain']:.1f} output tokens/s unconstrained ({ratio:.3f}x, "
          f"cost {100 * (1 - ratio):.1f}%); unconstrained requests unchanged: {free}/{len(prompts) - k}")


def introspection_row(llm, prompts, params, repeat: int) -> None:
    """Times the same engine with introspection off and on (timelines of every
    request kept, a step trace written to a temporary file), alternating, best
    of `repeat` each, and prints the overhead."""
    import tempfile

    from ..engine.step_trace import TracingScheduler

    eng = llm.engine
    plain, keep = eng.scheduler, eng.timelines.keep
    with tempfile.TemporaryDirectory() as tmp:
        traced = TracingScheduler(plain, f"{tmp}/steps.jsonl")
        best = {"off": float("inf"), "on": float("inf")}
        try:
            for _ in range(repeat):
                for mode in ("off", "on"):
                    eng.scheduler, eng.timelines.keep = (traced, len(prompts)) if mode == "on" else (plain, keep)
                    t0 = time.perf_counter()
                    llm.generate(prompts, params, use_tqdm=False)
                    best[mode] = min(best[mode], time.perf_counter() - t0)
        finally:
            eng.scheduler, eng.timelines.keep = plain, keep
            traced.close()
    print(f"introspection (timelines of every request + step trace), best of {repeat} alternating runs: "
          f"off {best['off']:.2f} s, on {best['on']:.2f} s, overhead {100 * (best['on'] / best['off'] - 1):+.1f}%")


def perplexity_text() -> str:
    """The fixed English text (about 400 words, written for this benchmark) whose perplexity is reported."""
    return (resources.files("pagedserve.bench") / "data" / "perplexity.txt").read_text()


@torch.inference_mode()
def print_accuracy(llm, model, outs, reference: list[list[int]], output_len: int) -> None:
    """Prints what quantisation costs in accuracy: greedy agreement of PagedServe's
    outputs ``outs`` with the float32 reference sequences (static batching),
    and the perplexity of the fixed text under PagedServe (prompt logprobs)
    and under the float32 Hugging Face model."""
    got = [o.outputs[0].token_ids for o in outs]
    same = sum(g == r for g, r in zip(got, reference))
    prefix = [next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), len(r)) for g, r in zip(got, reference)]
    positions = sum(a == b for g, r in zip(got, reference) for a, b in zip(g, r))
    ids = llm.engine.tokenizer(perplexity_text())["input_ids"] if llm.engine.tokenizer else None
    what = f"{str(llm.engine.dtype).removeprefix('torch.')}, linear layers {llm.engine.linear_impl}"
    print(f"\naccuracy of PagedServe ({what}) against float32 (greedy, {len(got)} sequences of {output_len} "
          f"tokens): identical sequences {same}/{len(got)}; tokens before the first difference: mean "
          f"{sum(prefix) / len(prefix):.1f} of {output_len}; same token at the same position: "
          f"{positions / sum(map(len, reference)):.1%}")
    if ids is None:
        return
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ours = math.exp(-sum(lp.logprob for lp in out.prompt_logprobs[1:]) / (len(ids) - 1))
    logits = model(torch.tensor([ids])).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]))
    print(f"perplexity of the fixed text ({len(ids)} tokens, pagedserve/bench/data/perplexity.txt): "
          f"PagedServe ({what}) {ours:.3f}, float32 Hugging Face {math.exp(float(nll)):.3f}")


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Runs the benchmark with command-line flags argv (default sys.argv[1:]) and prints its table.
    prog: the command name --help shows (default: the script's file name)."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--model", default=None)
    ap.add_argument("--attention-backend", default="auto", choices=["auto", *backend_names()])
    ap.add_argument("--linear-impl", default="auto", choices=list(LINEAR_METHODS),
                    help="PagedServe's linear method (auto: measured at start-up; the table names the one chosen; "
                         "q4|int8: quantised, as --quantization)")
    ap.add_argument("--model-impl", default="auto", choices=["auto", "pagedserve", "transformers"],
                    help="PagedServe's decoder forward: its lean Llama forward or the Hugging Face modules")
    ap.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16"],
                    help="PagedServe's weights, activations and KV cache (the Hugging Face baselines stay float32); "
                         "default: float32, or with --quantization the engine's default (auto: float32 on the CPU); "
                         "with bfloat16 the outputs are no longer float32's and the accuracy "
                         "figures are printed")
    ap.add_argument("--quantization", default="none", choices=["none", *QUANTIZATIONS],
                    help="vLLM's spelling of --linear-impl q4|int8: PagedServe on quantised weights (q4: the GGUF's "
                         "own Q4_1 blocks); also prints accuracy figures: greedy agreement with the float32 path and "
                         "perplexity on a fixed text")
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True,
                    help="PagedServe's --batch-invariant (default on): --no-batch-invariant measures what it costs")
    ap.add_argument("--skip-sequential", action="store_true", help="skip the slow one-at-a-time baseline")
    ap.add_argument("--repeat", type=int, default=1, metavar="R",
                    help="run static batching and PagedServe alternately R times and keep each one's fastest run")
    ap.add_argument("--plot", metavar="PATH", help="also write the results as a PNG figure to PATH")
    ap.add_argument("--constrained", type=int, default=0, metavar="K",
                    help="also run PagedServe with K of the requests under a grammar (structured outputs: a regex "
                         "of words), the others as before, and print what the constraint costs")
    ap.add_argument("--introspection", action="store_true",
                    help="also run PagedServe alternately with and without issue 31's introspection (every request's "
                         "timeline recorded and kept, every scheduler call written to a step trace) and print the "
                         "overhead, best of --repeat runs each")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {args.repeat}")
    if not 0 <= args.constrained <= args.num_requests:
        ap.error(f"--constrained must be in [0, --num-requests], got {args.constrained}")
    plots.require_writable(ap, args.plot)

    try:  # one option: EngineArgs resolves the two spellings and refuses two different methods by name
        args.linear_impl = EngineArgs(linear_impl=args.linear_impl, quantization=args.quantization).linear_impl
    except ValueError as e:
        ap.error(str(e))
    args.quantization = args.linear_impl if args.linear_impl in QUANTIZATIONS else "none"
    if args.dtype is None:
        args.dtype = "float32" if args.quantization == "none" else "auto"
    # prefix caching off: --repeat sends the same prompts again (and the warm-up sends four of them), and a
    # cache hit would skip prefill that static batching has to redo; the prompts share no prefix otherwise
    llm = LLM(model=args.model, dtype=args.dtype, attention_backend=args.attention_backend,
              linear_impl=args.linear_impl, model_impl=args.model_impl,
              enable_prefix_caching=False, batch_invariant=args.batch_invariant)
    # the same weights, loaded as a plain Hugging Face model (HF attention, default GEMMs; a GGUF converted to a
    # float32 folder once for it: the engine reads the file in place)
    from pagedserve.model.loader import resolve_model_path

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(args.model)[0], dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [torch.randint(100, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.num_requests)]
    n_tokens = args.num_requests * args.output_len
    rows = []

    def timed(name, fn, warmup):
        warmup()  # first calls pay one-off costs (allocator, kernels' first use): not timed
        t0 = time.perf_counter()
        result = fn()
        dt = time.perf_counter() - t0
        rows.append((name, dt, n_tokens / dt))
        print(f"{name}: {dt:.2f} s", flush=True)
        return result

    few = prompts[:4]
    if not args.skip_sequential:
        timed("HF generate(), sequential", lambda: generate_sequential(model, prompts, args.output_len),
              lambda: generate_sequential(model, few[:1], 4))
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    # static batching and PagedServe alternate --repeat times; each keeps its fastest run (the one a burst of
    # other load on a shared machine disturbed least), so both face the same conditions
    generate_static_batch(model, few, 4)
    llm.generate(few, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    best = {"HF generate(), static batch": float("inf"), "PagedServe": float("inf")}
    for rep in range(args.repeat):
        t0 = time.perf_counter()
        static = generate_static_batch(model, prompts, args.output_len)
        t1 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        t2 = time.perf_counter()
        best["HF generate(), static batch"] = min(best["HF generate(), static batch"], t1 - t0)
        best["PagedServe"] = min(best["PagedServe"], t2 - t1)
        print(f"run {rep + 1}/{args.repeat}: HF generate(), static batch {t1 - t0:.2f} s, PagedServe {t2 - t1:.2f} s",
              flush=True)
    rows += [(name, dt, n_tokens / dt) for name, dt in best.items()]
    same = sum(o.outputs[0].token_ids == s for o, s in zip(outs, static))
    if args.constrained:
        constrained_row(llm, prompts, params, outs, args.constrained)

    if args.introspection:
        introspection_row(llm, prompts, params, args.repeat)

    static_tps = next(r[2] for r in rows if "static" in r[0])
    eng = llm.engine
    dtype = str(eng.dtype).removeprefix("torch.")  # what --dtype resolved to
    variant = type(eng.backend).active_variant()
    print(f"\n{args.num_requests} requests x ({args.prompt_len} prompt + {args.output_len} output) tokens, "
          f"greedy, {torch.get_num_threads()} threads; HF float32; PagedServe {dtype}: attention backend "
          f"{eng.backend.name}{f' ({variant} kernels)' if variant else ''}; decoder forward {eng.model_impl}; "
          f"batch invariance {'on' if args.batch_invariant else 'off'}; "
          f"linear layers: {eng.linear_path}; weights {eng.weight_bytes / 2**20:.0f} MiB")
    print("| system | time (s) | output tokens/s | vs static batching |")
    print("|---|---:|---:|---:|")
    for name, dt, tps in rows:
        print(f"| {name} | {dt:.2f} | {tps:.1f} | {tps / static_tps:.2f}x |")
    print(f"\nPagedServe outputs identical to static batching: {same}/{len(prompts)}")
    if args.quantization != "none" or dtype != "float32":
        print_accuracy(llm, model, outs, static, args.output_len)
    if args.plot:
        plot(rows, args.plot, title=f"{args.num_requests} requests x ({args.prompt_len} prompt + {args.output_len} "
             f"output) tokens, greedy, {torch.get_num_threads()} threads; PagedServe {dtype}"
             f"{'' if args.quantization == 'none' else ', ' + args.quantization}")


if __name__ == "__main__":
    main()
