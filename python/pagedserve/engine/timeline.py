"""Per-request timelines: what the scheduler did for one request, step by step
(issue 31's "see inside"): the steps it was scheduled in with the tokens
computed in each (prefill chunks, decodes, the recompute after a
preemption), its preemptions and why, its prefix-cache hits, the KV blocks
it held, and its latencies. The engine records one for a request that asks
(`timeline: true`) or for every request under --request-timelines N, which
also keeps the last N finished ones (Timelines)."""

from __future__ import annotations

import time
from collections import OrderedDict


class RequestTimeline:
    """One request's record. Times are time.monotonic() seconds; the dict
    form (to_dict) gives them as seconds since the request arrived.

    Args:
        request_id: the engine's request id.
        num_prompt_tokens: the prompt's length in tokens.
        arrival_time: when the request arrived (time.monotonic()).
    """

    def __init__(self, request_id: str, num_prompt_tokens: int, arrival_time: float) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.arrival_time = arrival_time
        # one entry per (step, scheduled sequence): [step, t, index, phase, computed, scheduled, drafts, blocks]
        self.steps: list[list] = []
        self.events: list[dict] = []
        self._last_end: dict[int, int] = {}  # per choice: tokens known computed after its last scheduled step
        self._high: dict[int, int] = {}  # per choice: the most tokens it ever had computed
        self.num_preemptions = 0
        self.peak_blocks = 0
        self.summary: dict | None = None  # set when the request ends

    def on_scheduled(self, step: int, now: float, index: int, num_computed_tokens: int, num_scheduled_tokens: int,
                     num_draft_tokens: int, num_blocks: int) -> None:
        """Choice `index` runs in engine step `step` (num_computed_tokens: in the
        KV cache before it; num_blocks: the blocks its block table holds)."""
        t = now - self.arrival_time
        last = self._last_end.get(index)
        if last is None:
            # the first step of the request: what it starts with came from the prefix cache (not for a forked
            # choice, index > 0, which starts from its parent's blocks)
            if index == 0 and num_computed_tokens > 0:
                self.events.append({"step": step, "t": t, "event": "prefix_cache_hit", "index": index,
                                    "num_tokens": num_computed_tokens})
        elif num_computed_tokens < last:  # preempted since it last ran: this is the recompute
            self.events.append({"step": step, "t": t, "event": "recompute", "index": index,
                                "num_tokens_to_recompute": last - num_computed_tokens})
            if num_computed_tokens > 0:
                self.events.append({"step": step, "t": t, "event": "prefix_cache_hit", "index": index,
                                    "num_tokens": num_computed_tokens})
        high = self._high.get(index, 0)
        if num_computed_tokens < high:
            phase = "recompute"
        elif num_computed_tokens < self.num_prompt_tokens:
            phase = "prefill"
        else:
            phase = "decode"
        end = num_computed_tokens + num_scheduled_tokens - num_draft_tokens
        self._last_end[index] = end
        self._high[index] = max(high, end)
        self.peak_blocks = max(self.peak_blocks, num_blocks)
        self.steps.append([step, t, index, phase, num_computed_tokens, num_scheduled_tokens, num_draft_tokens,
                           num_blocks])

    def on_drafts_kept(self, index: int, num_kept: int) -> None:
        """Choice `index` kept num_kept of the drafts its last step verified:
        they are computed too (a recompute after a preemption redoes them)."""
        if index in self._last_end:
            self._last_end[index] += num_kept
            self._high[index] = max(self._high[index], self._last_end[index])

    def on_preempted(self, step: int, now: float, reason: str) -> None:
        """A sequence of the request lost its KV blocks while step `step` was
        scheduled (reason: the scheduler's, "kv_blocks" or "priority")."""
        self.num_preemptions += 1
        self.events.append({"step": step, "t": now - self.arrival_time, "event": "preempted", "reason": reason})

    def on_finished(self, req, step: int) -> None:
        """The request ended (req: its engine Request): its latencies, prefix-cache
        hit and finish reasons are fixed now."""
        now = req.finished_time or time.monotonic()
        if req.pooler is None:
            outputs = [c.num_output_tokens for c in req.choices]
            first, last = req.first_token_time, req.last_token_time
        else:  # an embedding request: no output tokens (its one sampled token is dropped)
            outputs, first, last = [0], None, None
        n = max(outputs, default=0)
        self.events.append({"step": step, "t": now - self.arrival_time, "event": "finished",
                            "finish_reasons": [c.finish_reason for c in req.choices]})
        self.summary = {
            "queue_time_s": None if req.first_scheduled_time is None else req.first_scheduled_time - self.arrival_time,
            "ttft_s": None if first is None else first - self.arrival_time,
            "tpot_s": (last - first) / (n - 1) if first is not None and last is not None and n > 1 else None,
            "e2e_s": now - self.arrival_time,
            "num_cached_tokens": req.num_cached_tokens,
            "num_output_tokens": outputs,
        }

    def to_dict(self) -> dict:
        """The timeline as JSON-ready data: `steps` as objects, times in
        seconds since arrival, `status` running or finished."""
        keys = ("step", "t", "index", "phase", "num_computed_tokens", "num_scheduled_tokens", "num_draft_tokens",
                "num_blocks")
        return {"request_id": self.request_id, "status": "running" if self.summary is None else "finished",
                "num_prompt_tokens": self.num_prompt_tokens, "num_preemptions": self.num_preemptions,
                "peak_num_blocks": self.peak_blocks, **(self.summary or {}),
                "steps": [dict(zip(keys, s)) for s in list(self.steps)], "events": list(self.events)}


class Timelines:
    """The engine's timelines: those of running requests and the last
    `keep` finished ones (bounded memory: `keep` timelines at most).

    Args:
        keep: finished timelines kept for lookups (--request-timelines); 0
            records only requests that ask and keeps none after they end.
    """

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.live: dict[str, RequestTimeline] = {}
        self.finished: OrderedDict[str, RequestTimeline] = OrderedDict()

    def wants(self, asked: bool) -> bool:
        """Whether a new request records a timeline."""
        return asked or self.keep > 0

    def start(self, request_id: str, num_prompt_tokens: int, arrival_time: float) -> RequestTimeline:
        timeline = RequestTimeline(request_id, num_prompt_tokens, arrival_time)
        self.live[request_id] = timeline
        return timeline

    def record_step(self, step: int, now: float, out) -> None:
        """Notes the step's decision (out: SchedulerOutput) on every live
        timeline it touches. Costs nothing while no timeline is live."""
        if not self.live:
            return
        for rid, reason in zip(out.preempted_request_ids, out.preemption_reasons):
            if (tl := self.live.get(rid)) is not None:
                tl.on_preempted(step, now, reason)
        request_ids = out.request_ids
        if not any(rid in self.live for rid in request_ids):
            return
        index, computed = out.seq_indices.tolist(), out.num_computed_tokens.tolist()
        scheduled, drafts = out.num_scheduled_tokens.tolist(), out.num_draft_tokens.tolist()
        offsets = out.block_table_offsets.tolist()
        for b, rid in enumerate(request_ids):
            if (tl := self.live.get(rid)) is not None:
                tl.on_scheduled(step, now, index[b], computed[b], scheduled[b], drafts[b], offsets[b + 1] - offsets[b])

    def drafts_kept(self, kept: dict) -> None:
        """The step's kept speculative drafts, {(request_id, index): [(token, logprob), ...]}."""
        if self.live:
            for (rid, index), tokens in kept.items():
                if tokens and (tl := self.live.get(rid)) is not None:
                    tl.on_drafts_kept(index, len(tokens))

    def finish(self, req, step: int) -> RequestTimeline | None:
        """Ends the request's timeline (if it has one) and keeps it among the
        last `keep` finished; returns it."""
        tl = self.live.pop(req.request_id, None)
        if tl is None:
            return None
        tl.on_finished(req, step)
        if self.keep > 0:
            self.finished[req.request_id] = tl
            while len(self.finished) > self.keep:
                self.finished.popitem(last=False)
        return tl

    def get(self, request_id: str) -> RequestTimeline | None:
        """The timeline of a running request or of one of the last `keep` finished,
        by its engine id or by the response id of a request whose client chose
        its X-Request-Id (the engine id then carries an 8-hex-digit suffix: the
        most recent such request)."""
        found = self.live.get(request_id) or self.finished.get(request_id)
        if found is not None:
            return found
        for store in (self.live, self.finished):
            for rid in reversed(list(store)):
                tail = rid[len(request_id) + 1:]
                if rid.startswith(request_id + "-") and len(tail) == 8 and all(c in "0123456789abcdef" for c in tail):
                    return store.get(rid)
        return None
