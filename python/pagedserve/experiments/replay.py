"""Replay a step trace (--trace-steps PATH, engine/step_trace.py) through the
real C++ scheduler and block pool, without the model: every recorded call is
made again on a fresh scheduler of the recorded configuration (or of one the
flags change), and each schedule() decision is compared with the recorded
one. A scheduler regression test any user can record on their own workload.

    pagedserve replay TRACE [--scheduling-policy P] [--num-kv-blocks N]
        [--max-num-batched-tokens N] [--max-num-seqs N] [--step-cost FILE]

Exit status 0 when every decision is reproduced, 1 at the first that is not
(the step, the field and both values are printed). --step-cost re-times the
trace with the simulator's step-cost model (experiments/step_cost.py:
cost = a + b * tokens + c * context tokens per step) beside the recorded step
times.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field

from .. import _core
from ..engine.step_trace import DECISION_FIELDS, decision_of, finish_reason


@dataclass
class ReplayResult:
    """What a replay found.

    Attributes:
        num_steps: decisions compared (empty ones included).
        first_difference: None when every decision was reproduced, else
            (step, field, recorded value, replayed value); the replay stops there.
        recorded_step_times: each non-empty step's recorded wall time (seconds).
        step_shapes: each non-empty replayed step's (scheduled tokens, sum of
            seq_lens), what the step-cost model takes.
    """

    num_steps: int = 0
    first_difference: tuple | None = None
    recorded_step_times: list[float] = field(default_factory=list)
    step_shapes: list[tuple[int, int]] = field(default_factory=list)

    @property
    def reproduced(self) -> bool:
        return self.first_difference is None


def _scheduler(config: dict, overrides: dict) -> _core.Scheduler:
    c = {**config, **{k: v for k, v in overrides.items() if v is not None}}
    cfg = _core.SchedulerConfig(c["max_num_seqs"], c["max_num_batched_tokens"], c["max_model_len"],
                                c["enable_prefix_caching"], c["policy"], c["watermark"], c["high_watermark"])
    return _core.Scheduler(cfg, c["num_blocks"], c["block_size"])


def _call(record: dict, fn, *args):
    """Makes a recorded call; an exception the recording saw is expected again
    (by class name). Returns (result, the class name of an unexpected outcome or None)."""
    try:
        result = fn(*args)
    except Exception as e:  # noqa: BLE001 - compared by name with the recording
        return None, None if record.get("error") == type(e).__name__ else f"raised {type(e).__name__}: {e}"
    return result, None if "error" not in record else f"did not raise {record['error']}"


def replay(path: str, **overrides) -> ReplayResult:
    """Replays the trace at `path`. overrides: SchedulerConfig fields or the
    pool's num_blocks / block_size to change (None keeps the recorded one).
    Raises ValueError for a file that is not a step trace."""
    result = ReplayResult()
    with open(path, encoding="utf-8") as f:
        lines = (json.loads(line) for line in f if line.strip())
        config = next(lines, None)
        if not config or config.get("op") != "config":
            raise ValueError(f"{path} is not a step trace: its first line is not the scheduler's config")
        sched = _scheduler(config, overrides)
        for record in lines:
            op = record["op"]
            rid = record.get("request_id")
            if op == "schedule":
                result.num_steps += 1
                out = sched.schedule()
                got, want = decision_of(out), record["decision"]
                for name in DECISION_FIELDS:
                    if got[name] != want[name]:
                        result.first_difference = (record["step"], name, want[name], got[name])
                        return result
                if not out.empty:
                    seq_lens = sum(c + s for c, s in zip(got["num_computed_tokens"], got["num_scheduled_tokens"]))
                    result.step_shapes.append((sum(got["num_scheduled_tokens"]), seq_lens))
                continue
            if op == "update":
                _, bad = _call(record, sched.update, record["sampled_token_ids"])
                if record.get("step_time_s") is not None:
                    result.recorded_step_times.append(record["step_time_s"])
            elif op == "add_request":
                stop = _core.StopCriteria(record["max_tokens"], record["ignore_eos"], record["eos_token_ids"],
                                          record["stop_token_ids"])
                _, bad = _call(record, sched.add_request, rid, record["prompt_token_ids"], stop, record["cache_salt"],
                               record["n_seqs"], record["skip_reading_prefix_cache"], record["priority"])
            elif op == "abort":
                _, bad = _call(record, sched.abort, rid)
            elif op in ("finish_sequence", "finish_request"):
                args = (rid, record["index"]) if op == "finish_sequence" else (rid,)
                _, bad = _call(record, getattr(sched, op), *args, finish_reason(record["reason"]))
            elif op == "add_draft_tokens":
                _, bad = _call(record, sched.add_draft_tokens, rid, record["index"], record["draft"])
            elif op == "accept_draft_tokens":
                _, bad = _call(record, sched.accept_draft_tokens, rid, record["index"], record["num_accepted"])
            else:
                raise ValueError(f"{path}: unknown operation {op!r}")
            if bad is not None:
                result.first_difference = (record.get("step"), op, record.get("error", "no error"), bad)
                return result
    return result


def main(argv: list[str] | None = None, prog: str = "pagedserve replay") -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a file written by --trace-steps")
    parser.add_argument("--scheduling-policy", dest="policy", choices=list(_core.SCHEDULING_POLICIES),
                        help="replay under another policy (the recorded one by default)")
    parser.add_argument("--num-kv-blocks", dest="num_blocks", type=int, help="another KV pool size, in blocks")
    parser.add_argument("--max-num-batched-tokens", type=int, help="another token budget per step")
    parser.add_argument("--max-num-seqs", type=int, help="another limit on running sequences")
    parser.add_argument("--step-cost", help="a step-cost file (experiments.scheduler calibrate) to re-time "
                                            "the trace with")
    args = parser.parse_args(argv)
    try:
        res = replay(args.trace, policy=args.policy, num_blocks=args.num_blocks,
                     max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs)
    except (OSError, ValueError, KeyError) as e:
        parser.exit(2, f"{prog}: error: {e}\n")
    if res.first_difference is not None:
        step, name, want, got = res.first_difference
        print(f"NOT reproduced: step {step}, {name}: recorded {want}, replayed {got}")
        sys.exit(1)
    recorded = sum(res.recorded_step_times)
    print(f"reproduced: {res.num_steps} scheduling decisions ({len(res.step_shapes)} steps that ran), "
          f"recorded step time {recorded:.3f} s")
    if args.step_cost:
        from .step_cost import StepCost

        cost = StepCost.load(args.step_cost)
        predicted = sum(cost.predict(t, s) for t, s in res.step_shapes)
        print(f"re-timed with {args.step_cost} ({cost.source}): {predicted:.3f} s predicted vs {recorded:.3f} s "
              "recorded")


if __name__ == "__main__":
    main()
