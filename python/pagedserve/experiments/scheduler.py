"""Scheduling-policy simulator: the real C++ scheduler (pagedserve._core.Scheduler)
without a model. A seeded workload (experiments.workload) arrives on a
simulated clock; each step the scheduler decides, the clock advances by the
step-cost model fitted from real engine steps (experiments.step_cost), and a
synthetic model samples one token per sampling sequence (EOS at the request's
drawn output length). Per policy and load it reports throughput, TTFT, TPOT,
queue time, preemptions and KV usage: FCFS against memory-aware admission
(adaptive admission control under KV pressure) and vLLM's priority policy.

    python -m pagedserve.experiments.scheduler calibrate [--model M] [--dtype D]
    python -m pagedserve.experiments.scheduler run [--policies fcfs priority memory-aware]
        [--rates 0.3 0.5 0.7] [--num-requests 300] [--lengths bimodal] [--plot PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field

import numpy as np

from .. import _core
from ..errors import PagedServeError
from . import plots
from .step_cost import StepCost, default_path, prediction_error, record_steps
from .workload import EOS_TOKEN_ID, WORKLOADS, SimRequest, generate

# Used when no calibration file exists: fitted by `calibrate` on the machine the
# README's numbers come from (see docs/scheduling.md). Calibrate to
# simulate another machine.
FALLBACK_COST = StepCost(a=0.0661656085129109, b=0.0009118062227757252, c=1.025282952739811e-05,
                         source="fallback: SmolLM2-135M bfloat16, 2-core Xeon (AVX-512), 2026-11-30")


@dataclass
class SimConfig:
    """The simulated engine: the scheduler's limits, KV pool (blocks of
    block_size tokens) and policy settings, as EngineArgs names them."""

    num_kv_blocks: int = 512
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    watermark: float = 0.05
    high_watermark: float = 0.90


@dataclass
class SimResult:
    """One simulation. Times in simulated seconds from the first arrival; per
    request: arrival, first scheduled, first token, finish, output tokens."""

    policy: str
    requests: dict[str, SimRequest]
    first_scheduled: dict[str, float] = field(default_factory=dict)
    first_token: dict[str, float] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)
    num_output: dict[str, int] = field(default_factory=dict)
    usage: list[tuple[float, float]] = field(default_factory=list)  # (time, KV usage 0..1) after each step
    steps: int = 0
    preemptions: int = 0
    prefix_hit_tokens: int = 0

    def summary(self) -> dict[str, float]:
        """Throughput (output tokens / s from first arrival to last finish),
        TTFT / TPOT / queue time p50 and p99 (seconds), preemptions, mean and max KV
        usage, steps; and TTFT p50/p99 per priority when there are several."""
        ids = list(self.requests)
        arrival = {r: self.requests[r].arrival_s for r in ids}
        ttft = np.array([self.first_token[r] - arrival[r] for r in ids])
        queue = np.array([self.first_scheduled[r] - arrival[r] for r in ids])
        tpot = np.array([(self.finished[r] - self.first_token[r]) / (self.num_output[r] - 1)
                         for r in ids if self.num_output[r] > 1] or [0.0])
        span = max(self.finished.values()) - min(arrival.values())
        use = np.array([u for _, u in self.usage] or [0.0])
        out = {"throughput_tok_s": sum(self.num_output.values()) / span, "ttft_p50": _p(ttft, 50),
               "ttft_p99": _p(ttft, 99), "tpot_p50": _p(tpot, 50), "tpot_p99": _p(tpot, 99),
               "queue_p50": _p(queue, 50), "queue_p99": _p(queue, 99), "preemptions": self.preemptions,
               "kv_usage_mean": float(use.mean()), "kv_usage_max": float(use.max()), "steps": self.steps,
               "makespan_s": span}
        prios = sorted({self.requests[r].priority for r in ids})
        if len(prios) > 1:
            for p in prios:
                t = np.array([self.first_token[r] - arrival[r] for r in ids if self.requests[r].priority == p])
                out[f"ttft_p50[priority={p}]"], out[f"ttft_p99[priority={p}]"] = _p(t, 50), _p(t, 99)
        return out


def _p(x: np.ndarray, q: float) -> float:
    return float(np.percentile(x, q))


def simulate(requests: list[SimRequest], policy: str, cost: StepCost, cfg: SimConfig | None = None) -> SimResult:
    """Runs the requests (sorted by arrival) through a fresh _core.Scheduler
    under `policy` until all finish. Priorities are sent only to the priority
    policy (the others refuse them). Raises RuntimeError if the scheduler stops
    making progress, and the core's errors for a request it can never serve."""
    cfg = cfg or SimConfig()
    sched = _core.Scheduler(
        _core.SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len,
                              cfg.enable_prefix_caching, policy, cfg.watermark, cfg.high_watermark),
        cfg.num_kv_blocks, cfg.block_size)
    reqs = sorted(requests, key=lambda r: r.arrival_s)
    res = SimResult(policy, {r.request_id: r for r in reqs})
    res.num_output = {r.request_id: 0 for r in reqs}
    kv = sched.kv_cache_manager
    t, i = reqs[0].arrival_s, 0
    while i < len(reqs) or sched.has_unfinished_requests():
        while i < len(reqs) and reqs[i].arrival_s <= t:
            r = reqs[i]
            sched.add_request(r.request_id, r.prompt_token_ids,
                              _core.StopCriteria(r.max_tokens, False, [EOS_TOKEN_ID]), "", 1, False,
                              r.priority if policy == "priority" else 0)
            i += 1
        if not sched.has_unfinished_requests():
            t = reqs[i].arrival_s
            continue
        out = sched.schedule()
        if out.empty:
            raise RuntimeError(f"{policy}: the scheduler scheduled nothing with {sched.num_waiting} waiting "
                               f"and {sched.num_running} running")
        start = t
        n_tok = out.total_num_scheduled_tokens
        t += cost.predict(n_tok, int(out.num_computed_tokens.sum()) + n_tok)
        request_ids = out.request_ids
        for rid in request_ids:
            res.first_scheduled.setdefault(rid, start)
        sampled = []
        for b, k in zip(out.sampling_seq_indices.tolist(), out.num_samples.tolist()):
            rid = request_ids[b]
            nth = res.num_output[rid] + 1  # the token about to be sampled
            sampled += [EOS_TOKEN_ID if nth >= res.requests[rid].output_len else 3 + nth % 1000] * k
        for u in sched.update(sampled):
            res.num_output[u.request_id] += 1
            res.first_token.setdefault(u.request_id, t)
            if u.finished:
                res.finished[u.request_id] = t
        res.steps += 1
        res.usage.append((t, kv.usage))
    res.preemptions = sched.num_preemptions
    res.prefix_hit_tokens = sched.prefix_cache_stats.hits
    return res


# ---- CLI ------------------------------------------------------------------------------
COLUMNS = [("throughput_tok_s", "output tok/s", "{:.1f}"), ("ttft_p50", "TTFT p50 s", "{:.2f}"),
           ("ttft_p99", "TTFT p99 s", "{:.2f}"), ("tpot_p50", "TPOT p50 ms", "ms"),
           ("tpot_p99", "TPOT p99 ms", "ms"), ("queue_p99", "queue p99 s", "{:.2f}"),
           ("preemptions", "preemptions", "{:.0f}"), ("kv_usage_mean", "KV usage mean", "{:.0%}")]


def _fmt(v: float, f: str) -> str:
    return f"{v * 1000:.1f}" if f == "ms" else f.format(v)


def print_table(rows: list[tuple[float, str, dict]]) -> None:
    """Markdown table: one row per (rate, policy, summary)."""
    print("| rate req/s | policy | " + " | ".join(h for _, h, _ in COLUMNS) + " |")
    print("|---:|---|" + "---:|" * len(COLUMNS))
    for rate, policy, s in rows:
        print(f"| {rate:g} | {policy} | " + " | ".join(_fmt(s[k], f) for k, _, f in COLUMNS) + " |")
    extra = [(rate, p, {k: v for k, v in s.items() if "[priority=" in k}) for rate, p, s in rows]
    for rate, p, per_class in extra:
        if per_class:
            print(f"  rate {rate:g} {p}: " + ", ".join(f"{k} {v:.2f}s" for k, v in per_class.items()))


def plot(rows: list[tuple[float, str, dict]], usage: dict[str, list[tuple[float, float]]], path: str,
         title: str = "") -> str:
    """Six panels written to path (PNG): TTFT p99, TPOT p99, preemptions and
    output throughput vs arrival rate (one line per policy), KV usage over
    simulated time at the highest rate, and TTFT p99 per priority class (when
    the workload has classes). Returns path."""
    policies = list(dict.fromkeys(p for _, p, _ in rows))
    rates = sorted({r for r, _, _ in rows})

    def series(key, scale=1.0):
        return {p: [scale * next(s[key] for r2, p2, s in rows if r2 == r and p2 == p) for r in rates]
                for p in policies}

    fig, axes = plots.new_figure(ncols=3, nrows=2)
    x = "arrival rate (req/s)"
    plots.draw_lines(axes[0], rates, series("ttft_p99"), xlabel=x, ylabel="TTFT p99 (s)",
                     title="time to first token, p99")
    plots.draw_lines(axes[1], rates, series("tpot_p99", 1e3), xlabel=x, ylabel="TPOT p99 (ms)",
                     title="time per output token, p99")
    plots.draw_lines(axes[2], rates, series("preemptions"), xlabel=x, ylabel="preemptions",
                     title="preemptions (recompute)")
    plots.draw_lines(axes[3], rates, series("throughput_tok_s"), xlabel=x, ylabel="output tokens/s",
                     title="throughput")
    ax = axes[4]
    for p, points in usage.items():
        ax.plot([t for t, _ in points], [100 * u for _, u in points], label=p, linewidth=0.8)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("KV blocks in use (%)")
    ax.set_title(f"KV usage at {max(rates):g} req/s")
    ax.grid(True, alpha=0.3)
    plots.legend_below(ax)
    classes = sorted({k for _, _, s in rows for k in s if k.startswith("ttft_p99[")})
    if classes:  # colour = policy (as in the other panels), line style = class
        ax = axes[5]
        for i, p in enumerate(policies):
            for j, k in enumerate(classes):
                ys = [next(s[k] for r2, p2, s in rows if r2 == r and p2 == p) for r in rates]
                ax.plot(rates, ys, color=f"C{i}", linestyle=("-", "--", ":", "-.")[j % 4], marker="o",
                        label=f"{p}, {k[9:-1].replace('=', ' ')}")
        ax.set_xlabel(x)
        ax.set_ylabel("TTFT p99 (s)")
        ax.set_title("TTFT p99 per priority class")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    else:
        axes[5].set_visible(False)
    return plots.save(fig, path, suptitle=title)


def _load_cost(path: str | None) -> StepCost:
    if path is not None:  # asked for: it must be there
        return StepCost.load(path)
    path = default_path()
    if os.path.exists(path):
        return StepCost.load(path)
    print(f"no calibration at {path}: using {FALLBACK_COST.source} (run `calibrate` for this machine)",
          file=sys.stderr)
    return FALLBACK_COST


def _priority_classes(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        classes = [int(c) for c in text.split(",")]
    except ValueError:
        raise ValueError(f"--priority-classes must be comma-separated integers, got '{text}'") from None
    if not all(-2**31 <= c < 2**31 for c in classes):
        raise ValueError(f"--priority-classes must be int32 values, got '{text}'")
    return classes


def cmd_run(args: argparse.Namespace) -> None:
    classes = _priority_classes(args.priority_classes)
    cost = _load_cost(args.step_cost)
    cfg = SimConfig(args.num_kv_blocks, args.block_size, args.max_num_seqs, args.max_num_batched_tokens,
                    args.max_model_len, not args.no_prefix_caching, args.watermark, args.high_watermark)
    print(f"step cost: {cost.a * 1e3:.2f} ms + {cost.b * 1e6:.1f} us/token + {cost.c * 1e9:.1f} ns/context token "
          f"({cost.source})")
    print(f"workload: {args.num_requests} requests, {args.lengths} lengths, max_model_len {cfg.max_model_len}, "
          f"max_tokens {args.max_tokens or 'what the context leaves'}, seed {args.seed}"
          + (f", priority classes {classes}" if classes else "")
          + (f", {args.num_prefixes} shared prefixes of {args.shared_prefix_len}" if args.shared_prefix_len else ""))
    print(f"engine: {cfg.num_kv_blocks} KV blocks x {cfg.block_size}, max_num_seqs {cfg.max_num_seqs}, "
          f"max_num_batched_tokens {cfg.max_num_batched_tokens}; memory-aware watermark {cfg.watermark}, "
          f"high watermark {cfg.high_watermark}\n")
    rows, usage = [], {}
    for rate in args.rates:
        reqs = generate(args.num_requests, rate, lengths=args.lengths, max_model_len=cfg.max_model_len,
                        max_tokens=args.max_tokens, priority_classes=classes,
                        shared_prefix_len=args.shared_prefix_len, num_prefixes=args.num_prefixes, seed=args.seed)
        for policy in args.policies:
            res = simulate(reqs, policy, cost, cfg)
            rows.append((rate, policy, res.summary()))
            if rate == max(args.rates):
                usage[policy] = res.usage
    print_table(rows)
    if args.plot:
        plot(rows, usage, args.plot, title=f"{args.num_requests} {args.lengths} requests, {cfg.num_kv_blocks} KV "
             f"blocks x {cfg.block_size}, simulated with the C++ scheduler")
        print(f"\nfigure: {args.plot}")


def cmd_calibrate(args: argparse.Namespace) -> None:
    from ..config import EngineArgs
    from ..engine.llm_engine import LLMEngine

    if args.num_requests < 4:
        raise ValueError(f"--num-requests must be at least 4 (three waves of requests), got {args.num_requests}")
    engine = LLMEngine(EngineArgs(model=args.model, dtype=args.dtype, skip_tokenizer_init=True))
    # warm-up, not used: oneDNN builds its kernels for each padded step size on first use
    record_steps(engine, args.num_requests, seed=args.seed + 100)
    fit_on = record_steps(engine, args.num_requests, seed=args.seed)
    held_out = record_steps(engine, args.num_requests, seed=args.seed + 1)
    source = (f"{engine.model_name} {str(engine.dtype).removeprefix('torch.')}, {len(fit_on)} steps, "
              f"{os.cpu_count()} CPUs, {default_path().rsplit('step_cost-', 1)[1].removesuffix('.json')}")
    cost = StepCost.fit(fit_on, source=source)
    print(f"fitted on {len(fit_on)} steps: cost = {cost.a * 1e3:.3f} ms + {cost.b * 1e6:.2f} us x num_batched_tokens "
          f"+ {cost.c * 1e9:.2f} ns x sum(seq_lens)")
    for name, samples in (("fit run", fit_on), ("held-out run", held_out)):
        e = prediction_error(cost, samples)
        print(f"{name}: {e['steps']} steps, measured {e['measured_s']:.2f} s, predicted {e['predicted_s']:.2f} s "
              f"(ratio {e['total_ratio']:.3f}); per step |error| median {e['median_step_error']:.1%}, "
              f"mean {e['mean_step_error']:.1%}")
    if abs(e["total_ratio"] - 1) > 0.2 or e["median_step_error"] > 0.2:
        print("WARNING: the held-out run is predicted worse than 20%: step times were noisy (another job on "
              "these cores?); calibrate again on a quiet machine before trusting the simulation", file=sys.stderr)
    out = args.out or default_path()
    cost.save(out)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pagedserve.experiments.scheduler", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    fmt = type("Fmt", (argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter), {})
    run = sub.add_parser("run", help="simulate policies at several loads", formatter_class=fmt)
    run.add_argument("--policies", nargs="+", default=list(_core.SCHEDULING_POLICIES),
                     choices=list(_core.SCHEDULING_POLICIES))
    run.add_argument("--rates", nargs="+", type=float, default=[0.3, 0.5, 0.7], help="arrivals per second")
    run.add_argument("--num-requests", type=int, default=300)
    run.add_argument("--lengths", choices=WORKLOADS, default="bimodal")
    run.add_argument("--max-tokens", type=int, default=None, help="cap per request (default: what the context leaves)")
    run.add_argument("--priority-classes", default=None, help="e.g. 0,1,2: each request draws one")
    run.add_argument("--shared-prefix-len", type=int, default=0)
    run.add_argument("--num-prefixes", type=int, default=1)
    run.add_argument("--seed", type=int, default=0)
    defaults = SimConfig()
    run.add_argument("--num-kv-blocks", type=int, default=defaults.num_kv_blocks)
    run.add_argument("--block-size", type=int, default=defaults.block_size)
    run.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    run.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    run.add_argument("--max-model-len", type=int, default=defaults.max_model_len)
    run.add_argument("--no-prefix-caching", action="store_true")
    run.add_argument("--watermark", type=float, default=defaults.watermark)
    run.add_argument("--high-watermark", type=float, default=defaults.high_watermark)
    run.add_argument("--step-cost", default=None, help=f"calibration file (default {default_path()})")
    run.add_argument("--plot", metavar="PATH", help="also write the figures as a PNG to PATH")
    run.set_defaults(fn=cmd_run)
    cal = sub.add_parser("calibrate", help="fit the step-cost model from real engine steps on this machine",
                         formatter_class=fmt)
    cal.add_argument("--model", default=None, help="as the server's --model (default: SmolLM2-135M-Instruct)")
    cal.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    cal.add_argument("--num-requests", type=int, default=16,
                     help="requests per run (a warm-up run, the fit run and the held-out run)")
    cal.add_argument("--seed", type=int, default=0)
    cal.add_argument("--out", default=None, help=f"where to write the constants (default {default_path()})")
    cal.set_defaults(fn=cmd_calibrate)
    args = ap.parse_args(argv)
    plots.require_writable(ap, getattr(args, "plot", None))
    try:
        args.fn(args)
    except (ValueError, OSError, PagedServeError) as e:  # bad flags or files: one line, no traceback
        ap.exit(2, f"{ap.prog} {args.cmd}: error: {e}\n")


if __name__ == "__main__":
    main()
