"""Step trace (--trace-steps PATH): every call the engine makes into the C++
scheduler, as JSON lines, so that `pagedserve replay PATH`
(experiments/replay.py) can re-run them through a fresh scheduler and block
pool without the model and check that every decision is reproduced.

The first line is the scheduler's configuration ({"op": "config", ...});
then, in call order, "add_request", "abort", "finish_sequence",
"add_draft_tokens", "accept_draft_tokens", "finish_request", "schedule"
(the SchedulerOutput: `decision`, with the step number, as the engine and the
timelines count steps, which an empty decision does not advance, and the time) and
"update" (the sampled token ids, what the engine found for each — `finished_by_caller`, CallerFinish
names — and the step's wall time since its
schedule() in `step_time_s`). The scheduler is deterministic given these calls
(no clock, no randomness), so a replay that differs is a change in the
scheduler or its configuration.
"""

from __future__ import annotations

import json
import time


# SchedulerOutput's fields, as the trace records them (every array as a list)
DECISION_FIELDS = ("request_ids", "seq_indices", "num_scheduled_tokens", "num_computed_tokens", "num_draft_tokens",
                   "block_ids", "block_table_offsets", "sampling_seq_indices", "num_samples", "blocks_to_copy",
                   "preempted_request_ids", "preemption_reasons")


def decision_of(out) -> dict:
    """A SchedulerOutput as JSON-ready lists (blocks_to_copy [C, 2] flattened)."""
    d = {}
    for name in DECISION_FIELDS:
        value = getattr(out, name)
        d[name] = value.reshape(-1).tolist() if hasattr(value, "tolist") else list(value)
    return d


def config_of(config, num_blocks: int, block_size: int) -> dict:
    """The trace's first line: a SchedulerConfig and the pool's shape."""
    return {"op": "config", "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens, "max_model_len": config.max_model_len,
            "enable_prefix_caching": config.enable_prefix_caching, "policy": config.policy,
            "watermark": config.watermark, "high_watermark": config.high_watermark,
            "num_blocks": num_blocks, "block_size": block_size}


class TracingScheduler:
    """A pagedserve._core.Scheduler that writes every mutating call to a JSON
    lines file before forwarding it; reads (properties, has_unfinished_requests)
    pass through untouched. Costs nothing when not used: the engine wraps its
    scheduler only under --trace-steps.

    Args:
        scheduler: the _core.Scheduler (its config and pool shape head the file).
        path: the file to write (truncated). Raises OSError if it cannot be opened.
    """

    def __init__(self, scheduler, path: str) -> None:
        self._scheduler = scheduler
        self._file = open(path, "w", buffering=1, encoding="utf-8")  # line-buffered: a crash keeps what ran
        self._step = 0
        self._scheduled_at: float | None = None
        kv = scheduler.kv_cache_manager
        self._write(config_of(scheduler.config, kv.num_blocks, kv.block_size))

    def __getattr__(self, name):
        return getattr(self._scheduler, name)

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def _call(self, record: dict, fn, *args):
        """Runs fn(*args) and writes the record, with the exception's class name
        in "error" when it raised (a refused request is part of the trace)."""
        try:
            result = fn(*args)
        except Exception as e:
            record["error"] = type(e).__name__
            self._write(record)
            raise
        self._write(record)
        return result

    def close(self) -> None:
        self._file.close()

    def add_request(self, request_id, prompt_token_ids, stop, cache_salt="", n_seqs=1,
                    skip_reading_prefix_cache=False, priority=0):
        record = {"op": "add_request", "request_id": request_id, "prompt_token_ids": list(prompt_token_ids),
                  "max_tokens": stop.max_tokens, "ignore_eos": stop.ignore_eos,
                  "eos_token_ids": list(stop.eos_token_ids), "stop_token_ids": list(stop.stop_token_ids),
                  "cache_salt": cache_salt, "n_seqs": n_seqs, "skip_reading_prefix_cache": skip_reading_prefix_cache,
                  "priority": priority}
        return self._call(record, self._scheduler.add_request, request_id, prompt_token_ids, stop, cache_salt,
                          n_seqs, skip_reading_prefix_cache, priority)

    def abort(self, request_id):
        return self._call({"op": "abort", "request_id": request_id}, self._scheduler.abort, request_id)

    def finish_sequence(self, request_id, index, reason):
        record = {"op": "finish_sequence", "request_id": request_id, "index": index, "reason": reason.name}
        return self._call(record, self._scheduler.finish_sequence, request_id, index, reason)

    def finish_request(self, request_id, reason):
        record = {"op": "finish_request", "request_id": request_id, "reason": reason.name}
        return self._call(record, self._scheduler.finish_request, request_id, reason)

    def add_draft_tokens(self, request_id, index, draft):
        record = {"op": "add_draft_tokens", "request_id": request_id, "index": index, "draft": list(draft)}
        return self._call(record, self._scheduler.add_draft_tokens, request_id, index, draft)

    def accept_draft_tokens(self, request_id, index, num_accepted):
        record = {"op": "accept_draft_tokens", "request_id": request_id, "index": index, "num_accepted": num_accepted}
        return self._call(record, self._scheduler.accept_draft_tokens, request_id, index, num_accepted)

    def schedule(self):
        out = self._scheduler.schedule()
        if not out.empty:  # numbered as the engine numbers its steps (LLMEngine.num_steps, timelines)
            self._step += 1
        self._scheduled_at = time.monotonic()
        self._write({"op": "schedule", "step": self._step, "time": time.time(), "decision": decision_of(out)})
        return out

    def update(self, sampled_token_ids, finished_by_caller=()):
        elapsed = None if self._scheduled_at is None else time.monotonic() - self._scheduled_at
        record = {"op": "update", "step": self._step, "sampled_token_ids": list(sampled_token_ids),
                  "finished_by_caller": [f.name for f in finished_by_caller], "step_time_s": elapsed}
        return self._call(record, self._scheduler.update, sampled_token_ids, list(finished_by_caller))

