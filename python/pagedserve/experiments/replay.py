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
from ..engine.step_trace import DECISION_FIELDS, decision_of
from ..errors import PagedServeError


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


class TraceError(ValueError):
    """A file that is not a well-formed step trace (file:line: what is wrong)."""


def _scheduler(config: dict, overrides: dict, where: str) -> _core.Scheduler:
    c = {**config, **{k: v for k, v in overrides.items() if v is not None}}
    try:
        cfg = _core.SchedulerConfig(c["max_num_seqs"], c["max_num_batched_tokens"], c["max_model_len"],
                                    c["enable_prefix_caching"], c["policy"], c["watermark"], c["high_watermark"])
        return _core.Scheduler(cfg, c["num_blocks"], c["block_size"])
    except KeyError as e:
        raise TraceError(f"{where}: the config has no {e.args[0]!r}") from None
    except (TypeError, PagedServeError) as e:  # a value of the wrong type, or one the core refuses
        raise TraceError(f"{where}: the scheduler refuses this configuration: {e}") from None


def _call(record: dict, fn, *args):
    """Makes a recorded call; an exception the recording saw is expected again
    (by class name). Returns (result, a description of an unexpected outcome or
    None). Raises TraceError when the record's fields have the wrong types
    (pybind11's TypeError: the call never reached the scheduler)."""
    try:
        result = fn(*args)
    except TypeError as e:
        raise TraceError(f"a field of this {record.get('op')} record has the wrong type: {e}") from None
    except Exception as e:  # noqa: BLE001 - compared by name with the recording
        return None, None if record.get("error") == type(e).__name__ else f"raised {type(e).__name__}: {e}"
    return result, None if "error" not in record else f"did not raise {record['error']}"


def _records(f, path: str):
    """(where, record) per non-blank line: where is "path:line"."""
    for lineno, line in enumerate(f, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}: not JSON ({e.msg}; a trace cut short?)") from None
        if not isinstance(record, dict) or not isinstance(record.get("op"), str):
            raise TraceError(f"{where}: not a trace record (a JSON object with an \"op\")")
        yield where, record


def replay(path: str, **overrides) -> ReplayResult:
    """Replays the trace at `path`. overrides: SchedulerConfig fields or the
    pool's num_blocks / block_size to change (None keeps the recorded one).
    Raises OSError for a file that cannot be read, TraceError (a ValueError)
    for one that is not a well-formed step trace or a configuration the core
    refuses."""
    result = ReplayResult()
    step = 0  # the last decision's step number (where a later call differs)
    with open(path, encoding="utf-8") as f:
        records = _records(f, path)
        where, config = next(records, (path, None))
        if config is None or config["op"] != "config":
            raise TraceError(f"{where}: not a step trace: its first record is not the scheduler's config")
        sched = _scheduler(config, overrides, where)
        for where, record in records:
            try:
                bad = _replay_one(sched, record, result)
            except KeyError as e:
                raise TraceError(f"{where}: the {record['op']} record has no {e.args[0]!r}") from None
            except TraceError as e:
                raise TraceError(f"{where}: {e}") from None
            if record["op"] == "schedule":
                step = record["step"]
            if bad is not None:
                result.first_difference = bad if record["op"] == "schedule" else (
                    step, f"{record['op']} after it", record.get("error", "no error"), bad)
                return result
    return result


def _replay_one(sched, record: dict, result: ReplayResult):
    """Replays one record; returns the difference it found (see
    ReplayResult.first_difference for a decision, else a description) or None."""
    op = record["op"]
    rid = record.get("request_id")
    if op == "schedule":
        result.num_steps += 1
        out = sched.schedule()
        got, want = decision_of(out), record["decision"]
        if not isinstance(want, dict):
            raise TraceError("the decision is not a JSON object")
        for name in DECISION_FIELDS:
            if got[name] != want[name]:
                return record["step"], name, want[name], got[name]
        if not out.empty:
            seq_lens = sum(c + s for c, s in zip(got["num_computed_tokens"], got["num_scheduled_tokens"]))
            result.step_shapes.append((sum(got["num_scheduled_tokens"]), seq_lens))
        return None
    if op == "update":
        raw = record.get("finished_by_caller", [])  # absent in traces written before it existed
        names = _core.CallerFinish.__members__
        if not isinstance(raw, list) or not all(isinstance(f, str) and f in names for f in raw):
            raise TraceError(f"finished_by_caller must be a list of CallerFinish names, got {raw!r}")
        _, bad = _call(record, sched.update, record["sampled_token_ids"], [names[f] for f in raw])
        if isinstance(record.get("step_time_s"), (int, float)):
            result.recorded_step_times.append(record["step_time_s"])
        return bad
    if op == "add_request":
        stop = _call(record, _core.StopCriteria, record["max_tokens"], record["ignore_eos"],
                     record["eos_token_ids"], record["stop_token_ids"])[0]
        return _call(record, sched.add_request, rid, record["prompt_token_ids"], stop, record["cache_salt"],
                     record["n_seqs"], record["skip_reading_prefix_cache"], record["priority"])[1]
    if op == "abort":
        return _call(record, sched.abort, rid)[1]
    if op in ("finish_sequence", "finish_request"):
        reason = getattr(_core.FinishReason, str(record["reason"]), None)
        if not isinstance(reason, _core.FinishReason):
            raise TraceError(f"unknown finish reason {record['reason']!r}")
        args = (rid, record["index"]) if op == "finish_sequence" else (rid,)
        return _call(record, getattr(sched, op), *args, reason)[1]
    if op == "add_draft_tokens":
        return _call(record, sched.add_draft_tokens, rid, record["index"], record["draft"])[1]
    if op == "accept_draft_tokens":
        return _call(record, sched.accept_draft_tokens, rid, record["index"], record["num_accepted"])[1]
    raise TraceError(f"unknown operation {op!r}")


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
    cost = None
    if args.step_cost:
        from .step_cost import StepCost

        try:
            cost = StepCost.load(args.step_cost)
        except (OSError, ValueError) as e:
            parser.exit(2, f"{prog}: error: --step-cost: {e}\n")
    try:
        res = replay(args.trace, policy=args.policy, num_blocks=args.num_blocks,
                     max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs)
    except (OSError, ValueError) as e:
        parser.exit(2, f"{prog}: error: {e}\n")
    if res.first_difference is not None:
        step, name, want, got = res.first_difference
        print(f"NOT reproduced: step {step}, {name}: recorded {want}, replayed {got}")
        sys.exit(1)
    recorded = sum(res.recorded_step_times)
    print(f"reproduced: {res.num_steps} scheduling decisions ({len(res.step_shapes)} steps that ran), "
          f"recorded step time {recorded:.3f} s")
    if cost is not None:
        predicted = sum(cost.predict(t, s) for t, s in res.step_shapes)
        print(f"re-timed with {args.step_cost} ({cost.source}): {predicted:.3f} s predicted vs {recorded:.3f} s "
              "recorded")


if __name__ == "__main__":
    main()
