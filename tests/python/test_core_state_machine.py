"""Property-based (hypothesis stateful) tests of the torch-free C++ core.

``SchedulerMachine`` drives ``_core.Scheduler`` the way LLMEngine does (add a
request, schedule a step, update with sampled tokens, finish a choice on a
stop string, abort) with random configurations whose KV pool is tiny (2-16
blocks of 1-4 tokens) and whose token budget is small, so chunked prefill,
preemption, prefix-cache hits and evictions, parallel sampling (n > 1, fork)
and copy-on-write all happen within a few dozen steps. Requests get random
prompts, often an earlier prompt's or a finished sequence's prefix plus a new
tail (prefix caching), sometimes a cache salt, skip_reading_prefix_cache,
stop/EOS tokens, a reused request id or an invalid parameter (then the
RequestRejectedError is expected and nothing may change). ``schedule`` and
``update`` are separate rules, so aborts and finishes also land between them.

A Python model follows the scheduler and mirrors every block table: it takes
the block ids the core chose from each SchedulerOutput (the allocation order
is not the model's business) and checks everything else. After every rule:

* free + used == total: ``num_free_blocks`` == num_blocks - |blocks held by
  live block tables|; ``usage`` agrees;
* each live sequence's block table (``kv_cache_manager.block_table(seq_id)``,
  probed for every sequence id ever handed out) equals the model's, has no
  block twice, covers exactly ``num_tokens(seq_id)`` reserved slots and its
  ``slot()`` is block_ids[p // bs] * bs + p % bs; sequences without blocks
  (waiting, preempted, finished) have no table at all;
* refcounts: the bindings expose no refcount of the scheduler's pool (no
  ``block_pool`` accessor on KVCacheManager). The closest observable
  equivalent is checked instead: the model counts, per block, the live tables
  holding it; a block the core hands out as new must have count 0 (never a
  block still held), copy-on-write must happen exactly when the written
  block's count is > 1, a block written must have count 1, and the free count
  must equal the number of blocks with count 0 (a missing or extra reference
  shows up there at the latest when its last holder ends). The refcounts
  themselves are checked exactly on a bare ``_core.BlockPool``
  (``BlockPoolMachine``), which does expose ``refcount``;
* prefix cache: the model keeps which block holds which (salt, token prefix)
  and predicts every match exactly (num_computed_tokens at admission, the
  matched block ids, ``num_cached_tokens``), plus ``num_evictable_blocks``,
  ``num_evictions`` and ``prefix_cache_stats``;
* the scheduling policy: running sequences oldest first with min(remaining,
  budget) tokens, preemption of the newest exactly when ``can_append`` fails
  (computed by the model from the tables), FCFS admission exactly when
  ``can_allocate`` holds, no admission in a step that preempted, the sampling
  rows and num_samples, ``blocks_to_copy``, the token ids, and the result of
  ``update`` (token, finish reason: EOS / stop token / max_tokens /
  max_model_len, num_cached_tokens) for every sequence, forks included;
* ``ModelInput``: positions, query_start_loc, seq_lens, logits_indices, the
  padded block_tables, and slot_mapping: every slot lies in that sequence's
  own blocks, no slot is written twice in a step, no block written is shared
  or holds a prefix-cache entry;
* the K/V itself: a fake paged KV store records, per slot, which (salt,
  token prefix) was written there (copy-on-write copies applied first); every
  position a scheduled sequence attends to must hold exactly its own prefix,
  which catches a wrong prefix hit, a missing copy-on-write, a salt leak or a
  block reused while still needed;
* once every request has ended, free == total (teardown also runs all live
  requests to completion, within a step bound: liveness).

The model encodes the policy documented in csrc/core/scheduler.h and
kv_cache_manager.h (which sequence is preempted, when a prefix is matched,
LRU eviction); a deliberate policy change there needs the same change here.

Runs are deterministic (derandomize, no example database): 100 examples of up
to 40 rules per machine by default. Set PAGEDSERVE_HYPOTHESIS_EXAMPLES to run
more (e.g. 2000 for a soak; both machines).
"""

from __future__ import annotations

import os
import random
import sys

import pytest
from hypothesis import HealthCheck, event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from pagedserve import _core
from pagedserve.errors import BlockPoolError, InvalidArgumentError, OutOfBlocksError, UnknownRequestError

_EXAMPLES = int(os.environ.get("PAGEDSERVE_HYPOTHESIS_EXAMPLES", "0"))


def _settings(examples: int, steps: int) -> settings:
    return settings(max_examples=max(examples, _EXAMPLES), stateful_step_count=steps, derandomize=True,
                    database=None, deadline=None, print_blob=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


PROMPT_VOCAB = 8  # prompt tokens 0..7: small, so equal prefixes also happen by chance
EOS, STOP_TOKEN = 9, 8  # sampled tokens are 0..9
_SAMPLED = list(range(STOP_TOKEN)) * 3 + [STOP_TOKEN, EOS]  # about 1 in 13 is a stop token or EOS
SAMPLED = st.sampled_from(_SAMPLED)
STOP, LENGTH, ABORT, NONE = (_core.FinishReason.STOP, _core.FinishReason.LENGTH, _core.FinishReason.ABORT,
                             _core.FinishReason.NONE)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Seq:
    """The model of one core Sequence (one choice of a request)."""

    def __init__(self, rid, index, seq_id, tokens, nprompt, salt, skip, max_tokens, ignore_eos, stop_ids, forks):
        self.rid, self.index, self.seq_id = rid, index, seq_id
        self.tokens, self.nprompt = tokens, nprompt
        self.salt, self.skip = salt, skip
        self.max_tokens, self.ignore_eos, self.stop_ids = max_tokens, ignore_eos, stop_ids
        self.num_forks = forks
        self.ncomp = 0  # tokens whose K/V are computed
        self.kvtok = 0  # slots reserved in the KV cache manager (num_tokens(seq_id))
        self.table: list[int] | None = None  # block table; None = no blocks
        self.nhashes = 0  # leading full blocks the core knows the prefix hash of
        self.num_cached = -1
        self.status = "waiting"

    def fork(self, index, seq_id):
        c = Seq(self.rid, index, seq_id, list(self.tokens), self.nprompt, self.salt, self.skip, self.max_tokens,
                self.ignore_eos, self.stop_ids, 1)
        c.ncomp, c.kvtok, c.table, c.nhashes = self.ncomp, self.kvtok, list(self.table), self.nhashes
        c.num_cached, c.status = self.num_cached, self.status
        return c

    def content(self, p):
        """What the K/V at position p depends on (plus the salt, so a leak across salts shows)."""
        return self.salt, tuple(self.tokens[:p + 1])

    def __repr__(self):
        return f"Seq({self.rid}#{self.index} id={self.seq_id} {self.status} n={len(self.tokens)} comp={self.ncomp})"


class SchedulerMachine(RuleBasedStateMachine):
    # ---- set-up ----------------------------------------------------------
    @initialize(bs=st.sampled_from([1, 2, 3, 4]), num_blocks=st.integers(2, 16), max_seqs=st.integers(1, 6),
                budget=st.integers(1, 16), max_len=st.integers(4, 32), caching=st.sampled_from([True, True, False]))
    def setup(self, bs, num_blocks, max_seqs, budget, max_len, caching):
        self.bs, self.num_blocks, self.max_seqs, self.budget, self.max_len = bs, num_blocks, max_seqs, budget, max_len
        self.caching = caching
        self.s = _core.Scheduler(_core.SchedulerConfig(max_seqs, budget, max_len, caching), num_blocks, bs)
        self.kv = self.s.kv_cache_manager
        self.requests: dict[str, list[Seq]] = {}  # live sequences per request, in the core's order
        self.by_id: list[Seq] = []  # every sequence ever, by seq_id
        self.running: list[Seq] = []
        self.waiting: list[Seq] = []
        self.refc: dict[int, int] = {}  # block -> live tables holding it
        self.cache: dict[tuple, int] = {}  # (salt, token prefix of whole blocks) -> block
        self.block_key: dict[int, tuple] = {}
        self.store: dict[int, tuple] = {}  # fake KV: slot -> content written there
        self.pending: list[tuple[Seq, int]] | None = None  # the last schedule(), not yet updated
        self.pending_samples = 0
        self.evictions = self.cow = self.preemptions = self.queries = self.hits = 0
        self.next_rid = 0
        self.ended_ids: list[str] = []
        self.histories: list[list[int]] = []  # prompts and finished sequences' tokens, to share prefixes with
        self.rng = random.Random(0)

    # ---- the model's block bookkeeping ---------------------------------------
    def _free_count(self):
        return self.num_blocks - len(self.refc)

    def _alloc(self, b, what):
        assert 0 <= b < self.num_blocks, f"{what}: block id {b} out of range"
        assert b not in self.refc, f"{what}: block {b} handed out while a live table still holds it"
        self.refc[b] = 1
        if b in self.block_key:  # a new block that held a cache entry: it was evicted
            del self.cache[self.block_key.pop(b)]
            self.evictions += 1
            event("prefix cache eviction")

    def _release(self, seq):
        for b in seq.table:
            self.refc[b] -= 1
            if self.refc[b] == 0:
                del self.refc[b]
        seq.table = None
        seq.kvtok = 0

    def _key(self, seq, i):
        return seq.salt, tuple(seq.tokens[:(i + 1) * self.bs])

    def _match(self, seq):
        if not self.caching or seq.skip:
            return []
        out = []
        for i in range((len(seq.tokens) - 1) // self.bs):
            b = self.cache.get(self._key(seq, i))
            if b is None:
                break
            out.append(b)
        return out

    def _cache_full_blocks(self, seq):
        if not self.caching:
            return
        full = seq.ncomp // self.bs
        for i in range(seq.nhashes, full):
            key, b = self._key(seq, i), seq.table[i]
            if key not in self.cache and b not in self.block_key:
                self.cache[key] = b
                self.block_key[b] = key
        seq.nhashes = max(seq.nhashes, full)

    def _can_append(self, seq, n):
        need = max(0, _cdiv(seq.kvtok + n, self.bs) - len(seq.table))
        if n > 0 and seq.kvtok % self.bs and self.refc[seq.table[seq.kvtok // self.bs]] > 1:
            need += 1  # copy-on-write of the shared, partially filled last block
        return need <= self._free_count()

    def _finish(self, seq):
        if seq.table is not None:
            self._release(seq)
        if seq.status == "running":
            self.running.remove(seq)
        elif seq.status == "waiting":
            self.waiting.remove(seq)
        seq.status = "ended"
        seqs = self.requests[seq.rid]
        seqs.remove(seq)
        if not seqs:
            del self.requests[seq.rid]
            if seq.rid not in self.ended_ids:
                self.ended_ids.append(seq.rid)
        self.histories.append(list(seq.tokens))

    def _find(self, rid, index):
        for seq in self.requests.get(rid, ()):
            if seq.index == index:
                return seq
        return None

    # ---- rules -----------------------------------------------------------
    @rule(data=st.data(), k=st.integers(1, 3))
    def add_requests(self, data, k):
        for _ in range(k):
            self._add_request(data)

    def _add_request(self, data):
        bs = self.bs
        limit = min(self.max_len, self.num_blocks * bs)  # prompt + max_tokens a request may have
        max_tokens = min(data.draw(st.integers(1, 8), label="max_tokens"), limit - 1)
        live = [list(q.tokens) for seqs in self.requests.values() for q in seqs]
        if self.histories and data.draw(st.sampled_from([True, True, False]), label="share prefix"):
            # a live sequence's tokens (its blocks are held: sharing) or an earlier prompt or ended sequence's
            src = data.draw(st.sampled_from(live + self.histories[-8:] if live and data.draw(st.booleans())
                                            else self.histories), label="source")
            cut = len(src) - data.draw(st.integers(0, len(src)), label="tokens dropped")
            prompt = src[:cut] + data.draw(st.lists(st.integers(0, PROMPT_VOCAB - 1), max_size=4), label="tail")
        else:
            prompt = data.draw(st.lists(st.integers(0, PROMPT_VOCAB - 1), min_size=1, max_size=12), label="prompt")
        prompt = prompt[:limit - max_tokens] or [0]
        n = data.draw(st.sampled_from([1, 1, 1, 2, 3]), label="n")
        salt = data.draw(st.sampled_from(["", "", "", "x", "y"]), label="salt")
        skip = data.draw(st.sampled_from([False] * 5 + [True]), label="skip_reading_prefix_cache")
        ignore_eos = data.draw(st.booleans(), label="ignore_eos")
        stop_ids = data.draw(st.sampled_from([[], [STOP_TOKEN]]), label="stop_token_ids")
        reusable = [r for r in self.ended_ids if r not in self.requests]
        if reusable and data.draw(st.booleans(), label="reuse an ended id"):
            rid = data.draw(st.sampled_from(reusable), label="rid")
        else:
            rid = f"r{self.next_rid}"
            self.next_rid += 1
        bad = data.draw(st.sampled_from([None] * 12 + ["empty", "dup", "n0", "max0", "long"]), label="invalid")
        if bad == "empty":
            prompt = []
        elif bad == "dup" and self.requests:
            rid = data.draw(st.sampled_from(sorted(self.requests)), label="live rid")
        elif bad == "n0":
            n = 0
        elif bad == "max0":
            max_tokens = 0
        elif bad == "long":
            prompt = (prompt * limit)[:limit - max_tokens + 1]
        stop = _core.StopCriteria(max_tokens, ignore_eos, [EOS], stop_ids)
        rejected = (not prompt or rid in self.requests or n < 1 or n > self.max_seqs or max_tokens < 1
                    or len(prompt) + max_tokens > self.max_len or _cdiv(len(prompt) + max_tokens, bs) > self.num_blocks)
        if rejected:
            event("request rejected")
            with pytest.raises(_core.RequestRejectedError):
                self.s.add_request(rid, prompt, stop, salt, n, skip)
            return
        self.s.add_request(rid, prompt, stop, salt, n, skip)
        seq = Seq(rid, 0, len(self.by_id), list(prompt), len(prompt), salt, skip, max_tokens, ignore_eos,
                  stop_ids, n)
        self.by_id.append(seq)
        self.requests[rid] = [seq]
        self.waiting.append(seq)
        self.histories.append(list(prompt))

    @precondition(lambda self: self.pending is None)
    @rule()
    def schedule(self):
        assert self.s.update([]) == [], "update() with nothing scheduled must be a no-op"
        self._schedule()

    @precondition(lambda self: self.pending is not None)
    @rule(data=st.data())
    def update(self, data):
        if data.draw(st.booleans(), label="first with the wrong count"):
            with pytest.raises(InvalidArgumentError):
                self.s.update([0] * (self.pending_samples + 1))
        self._update(data.draw(st.lists(SAMPLED, min_size=self.pending_samples, max_size=self.pending_samples),
                               label="sampled"))

    @precondition(lambda self: self.pending is None and self.requests)
    @rule(data=st.data(), steps=st.integers(1, 4))
    def step(self, data, steps):
        """schedule + update back to back, as LLMEngine.step does (a few times)."""
        for _ in range(steps):
            self._schedule()
            self._update(data.draw(st.lists(SAMPLED, min_size=self.pending_samples,
                                            max_size=self.pending_samples), label="sampled"))
            self.check_state()

    @rule(data=st.data(), how=st.sampled_from(["abort", "finish_request", "finish_sequence"]))
    def end(self, data, how):
        """abort (LLMEngine.abort_request), finish_request, or finish_sequence (LLMEngine finishes one
        choice when a stop string matches its text); also for unknown ids."""
        if how == "finish_sequence":
            live = [(rid, s.index) for rid, seqs in sorted(self.requests.items()) for s in seqs]
            rid, index = data.draw(st.sampled_from(live + [("unknown", 0), ("r0", 7)]), label="choice")
            seq = self._find(rid, index)
            assert self.s.finish_sequence(rid, index, STOP) == (seq is not None)
            ended = [seq] if seq is not None else []
        else:
            rid = data.draw(st.sampled_from(sorted(self.requests) + ["unknown"] + self.ended_ids[-2:]), label="rid")
            if how == "abort":
                got = self.s.abort(rid)
            else:
                got = self.s.finish_request(rid, data.draw(st.sampled_from([STOP, ABORT]), label="reason"))
            assert got == (rid in self.requests)
            ended = list(self.requests.get(rid, ()))
        if ended and self.pending is not None:
            event("sequence ended between schedule and update")
        for seq in ended:
            self._finish(seq)

    @precondition(lambda self: len(self.requests) >= 2)
    @rule()
    def run_until_idle(self):
        self._drain()

    # ---- schedule / update, checked against the model ----------------------
    def _schedule(self):
        bs = self.bs
        out = self.s.schedule()
        rids, idxs = list(out.request_ids), out.seq_indices.tolist()
        nsched, ncomp = out.num_scheduled_tokens.tolist(), out.num_computed_tokens.tolist()
        offs, bids = out.block_table_offsets.tolist(), out.block_ids.tolist()
        preempted, copies = list(out.preempted_request_ids), [tuple(c) for c in out.blocks_to_copy.tolist()]
        B = len(rids)
        assert out.block_size == bs and out.num_seqs == B and out.empty == (B == 0)
        assert len(idxs) == len(nsched) == len(ncomp) == B and len(offs) == B + 1
        assert offs[0] == 0 and offs[-1] == len(bids)
        tables = [bids[offs[b]:offs[b + 1]] for b in range(B)]
        note(f"schedule: rows={list(zip(rids, idxs, ncomp, nsched, tables))} preempted={preempted} copies={copies}")

        rows: list[tuple[Seq, int]] = []
        expected_copies = []
        budget, p, was_preempted = self.budget, 0, False

        def is_row(r, seq):
            return r < B and rids[r] == seq.rid and idxs[r] == seq.index

        # 1. running sequences, oldest first; preempt the newest while can_append fails
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(len(seq.tokens) - seq.ncomp, budget)
            assert n > 0, f"{seq} is running with nothing to compute"
            keep = True
            while not self._can_append(seq, n):
                victim = self.running.pop()
                assert p < len(preempted) and preempted[p] == victim.rid, (
                    f"{seq} cannot append {n} tokens: {victim} must be preempted, core preempted {preempted[p:]}")
                p += 1
                self._release(victim)
                victim.ncomp, victim.status = 0, "waiting"
                self.waiting.insert(0, victim)
                self.preemptions += 1
                was_preempted = True
                event("preemption")
                if victim is seq:
                    keep = False
                    break
            if not keep:
                break
            r = len(rows)
            assert is_row(r, seq), f"row {r} should be running {seq}, got {rids[r:r + 1]}"
            assert (ncomp[r], nsched[r]) == (seq.ncomp, n), f"{seq}: computed/scheduled {ncomp[r]}/{nsched[r]}"
            old, new = seq.table, tables[r]
            assert len(new) == max(len(old), _cdiv(seq.kvtok + n, bs)), f"{seq}: table {old} -> {new}"
            cow_at = seq.kvtok // bs if (seq.kvtok % bs and self.refc[old[seq.kvtok // bs]] > 1) else None
            for j, b in enumerate(old):
                if j == cow_at:
                    assert new[j] != b, f"{seq}: shared partial block {b} not copied before the write"
                    self.refc[b] -= 1  # still held by another table
                    self._alloc(new[j], f"copy-on-write for {seq}")
                    expected_copies.append((b, new[j]))
                    self.cow += 1
                    event("copy-on-write")
                else:
                    assert new[j] == b, f"{seq}: block {j} changed from {b} to {new[j]} without copy-on-write"
            for b in new[len(old):]:
                self._alloc(b, f"append to {seq}")
            seq.table, seq.kvtok = list(new), seq.kvtok + n
            rows.append((seq, n))
            budget -= n
            i += 1
        assert p == len(preempted), f"unexpected preemption of {preempted[p:]}"

        # 2. FCFS admission while can_allocate holds and the running sequences, counting
        # the n each unforked one becomes, leave room for its n (none in a step that preempted)
        while not was_preempted and self.waiting and budget > 0:
            seq = self.waiting[0]
            if sum(q.num_forks for q in self.running) + seq.num_forks > self.max_seqs:
                assert not is_row(len(rows), seq), f"{seq} admitted beyond max_num_seqs"
                break
            match = self._match(seq)
            m = len(match) * bs
            n = min(len(seq.tokens) - m, budget)
            fresh = _cdiv(m + n, bs) - len(match)
            revived = sum(1 for b in match if b not in self.refc)
            if fresh + revived > self._free_count():
                assert not is_row(len(rows), seq), f"{seq} admitted without room"
                break
            r = len(rows)
            assert is_row(r, seq), f"row {r} should admit {seq} (room for {fresh + revived}), got {rids[r:r + 1]}"
            assert ncomp[r] == m, f"{seq}: {ncomp[r]} tokens served from the prefix cache, expected {m} ({match})"
            assert nsched[r] == n
            table = tables[r]
            assert table[:len(match)] == match and len(table) == _cdiv(m + n, bs), f"{seq}: {table} vs {match}"
            for b in match:
                self.refc[b] = self.refc.get(b, 0) + 1
            for b in table[len(match):]:
                self._alloc(b, f"admission of {seq}")
            self.waiting.pop(0)
            self.running.append(seq)
            seq.status, seq.table, seq.kvtok, seq.ncomp, seq.nhashes = "running", list(table), m + n, m, len(match)
            if seq.num_cached < 0:
                seq.num_cached = m
            if self.caching and not seq.skip:
                self.queries += len(seq.tokens)
                self.hits += m
            if m:
                event("prefix cache hit")
            rows.append((seq, n))
            budget -= n
        assert len(rows) == B, f"unexpected rows {list(zip(rids, idxs))[len(rows):]}"
        assert copies == expected_copies, f"blocks_to_copy {copies}, expected {expected_copies}"
        assert sum(nsched) <= self.budget and out.total_num_scheduled_tokens == sum(nsched)

        # the decision's remaining arrays
        want_tokens, sampling, num_samples = [], [], []
        for b, (seq, n) in enumerate(rows):
            want_tokens += seq.tokens[ncomp[b]:ncomp[b] + n]
            if ncomp[b] + n == len(seq.tokens):
                sampling.append(b)
                num_samples.append(seq.num_forks)
        assert out.token_ids.tolist() == want_tokens
        assert out.sampling_seq_indices.tolist() == sampling and out.num_samples.tolist() == num_samples
        if B:
            self._check_model_input(out, rows, ncomp, tables, copies)
        self.pending, self.pending_samples = rows, sum(num_samples)

    def _check_model_input(self, out, rows, ncomp, tables, copies):
        bs = self.bs
        inp = _core.ModelInput(out)
        slots, positions, qsl, seq_lens = inp.slot_mapping.tolist(), inp.positions.tolist(), [0], []
        assert inp.input_ids.tolist() == out.token_ids.tolist()
        width = max(len(t) for t in tables)
        assert inp.max_num_blocks_per_seq == width
        assert inp.block_tables.tolist() == [t + [-1] * (width - len(t)) for t in tables]
        assert [tuple(c) for c in inp.blocks_to_copy.tolist()] == copies
        # the fake forward pass: copy-on-write copies, then every write, then every read
        for src, dst in copies:
            for o in range(bs):
                if src * bs + o in self.store:
                    self.store[dst * bs + o] = self.store[src * bs + o]
                else:
                    self.store.pop(dst * bs + o, None)
        t, written = 0, set()
        for b, (seq, n) in enumerate(rows):
            for pos in range(ncomp[b], ncomp[b] + n):
                blk = tables[b][pos // bs]
                slot = blk * bs + pos % bs
                assert positions[t] == pos and slots[t] == slot, f"{seq} position {pos}: slot {slots[t]}, want {slot}"
                assert slots[t] // bs in tables[b], f"{seq}: slot {slots[t]} outside its blocks {tables[b]}"
                assert slot not in written, f"slot {slot} written twice in one step"
                assert self.refc[blk] == 1, f"{seq} writes into block {blk}, shared by {self.refc[blk]} tables"
                assert blk not in self.block_key, f"{seq} writes into block {blk}, which holds a prefix-cache entry"
                written.add(slot)
                self.store[slot] = seq.content(pos)
                t += 1
            qsl.append(t)
            seq_lens.append(ncomp[b] + n)
        assert t == len(slots)
        assert inp.query_start_loc.tolist() == qsl and inp.seq_lens.tolist() == seq_lens
        assert inp.logits_indices.tolist() == [qsl[b + 1] - 1 for b in out.sampling_seq_indices.tolist()]
        for b, (seq, n) in enumerate(rows):
            for pos in range(ncomp[b] + n):
                got = self.store.get(tables[b][pos // bs] * bs + pos % bs)
                assert got == seq.content(pos), (
                    f"{seq} attends to position {pos} in block {tables[b][pos // bs]}, whose K/V are those of "
                    f"{got}, not of its own prefix {seq.content(pos)}")

    def _update(self, sampled):
        ups = self.s.update(sampled)
        want, s = [], 0

        def commit(seq, tok):
            seq.tokens.append(tok)
            if (tok == EOS and not seq.ignore_eos) or tok in seq.stop_ids:
                reason = STOP
            elif len(seq.tokens) - seq.nprompt >= seq.max_tokens or len(seq.tokens) >= self.max_len:
                reason = LENGTH
            else:
                reason = NONE
            want.append((seq.rid, seq.index, tok, reason, seq.num_cached))
            if reason != NONE:
                self._finish(seq)

        for seq, n in self.pending:
            samples = seq.ncomp + n == len(seq.tokens)
            k = seq.num_forks if samples else 0
            first, s = s, s + k
            if seq.status != "running":
                continue  # ended since schedule()
            seq.ncomp += n
            self._cache_full_blocks(seq)
            if not samples:
                continue
            children = []
            for i in range(1, k):  # the core forks before the parent's token goes in
                child = seq.fork(i, len(self.by_id))
                self.by_id.append(child)
                for b in child.table:
                    self.refc[b] += 1
                self.running.append(child)
                self.requests[seq.rid].append(child)
                children.append(child)
                event("fork")
            seq.num_forks = 1
            commit(seq, sampled[first])
            for i, child in enumerate(children, 1):
                commit(child, sampled[first + i])
        assert s == len(sampled)
        got = [(u.request_id, u.index, u.token_id, u.finish_reason, u.num_cached_tokens) for u in ups]
        assert got == want, f"update() returned {got}, expected {want}"
        for u in ups:
            assert u.finished == (u.finish_reason != NONE)
        self.pending, self.pending_samples = None, 0

    def _drain(self):
        """Steps (seeded random tokens) until every request has ended, within a bound (liveness)."""
        if self.pending is not None:
            self._update([self.rng.choice(_SAMPLED) for _ in range(self.pending_samples)])
        work = sum(len(s.tokens) + s.max_tokens for seqs in self.requests.values() for s in seqs)
        forks = sum(s.num_forks for seqs in self.requests.values() for s in seqs)
        bound = 20 * (work + 1) * (forks + 1) + 50
        steps = 0
        while self.requests:
            assert steps < bound, f"no progress: {self.requests} still live after {steps} steps"
            self._schedule()
            self._update([self.rng.choice(_SAMPLED) for _ in range(self.pending_samples)])
            self.check_state()
            steps += 1
        assert not self.s.has_unfinished_requests()
        assert self.kv.num_free_blocks == self.kv.num_blocks, "blocks leaked after every request ended"

    # ---- invariants --------------------------------------------------------
    @invariant()
    def check_state(self):
        kv, s, bs = self.kv, self.s, self.bs
        assert s.num_running <= self.max_seqs, f"{s.num_running} running, max_num_seqs {self.max_seqs}"
        for seq in self.by_id:  # every sequence id ever handed out
            if seq.table is None:
                try:
                    ids = kv.block_table(seq.seq_id).block_ids
                except UnknownRequestError:
                    continue
                raise AssertionError(f"{seq} should hold no blocks, the core gives it the table {ids}")
            bt = kv.block_table(seq.seq_id)
            ids = list(bt.block_ids)
            assert ids == seq.table, f"{seq}: core table {ids}, model {seq.table}"
            assert len(set(ids)) == len(ids), f"{seq}: block table {ids} holds a block twice"
            assert bt.num_blocks == len(ids) == _cdiv(seq.kvtok, bs), f"{seq}: {bt.num_blocks} blocks"
            assert kv.num_tokens(seq.seq_id) == seq.kvtok, f"{seq}: {kv.num_tokens(seq.seq_id)} reserved slots"
            for pos in range(len(ids) * bs):
                assert bt.slot(pos) == ids[pos // bs] * bs + pos % bs, f"{seq}: slot({pos}) = {bt.slot(pos)}"
            with pytest.raises(InvalidArgumentError):
                bt.slot(len(ids) * bs)
        assert kv.num_free_blocks == self._free_count(), (
            f"free {kv.num_free_blocks} + used {len(self.refc)} (blocks in live tables) != total {self.num_blocks}")
        assert abs(kv.usage - len(self.refc) / self.num_blocks) < 1e-9, f"usage {kv.usage}"
        evictable = sum(1 for b in self.block_key if b not in self.refc)
        assert kv.num_evictable_blocks == evictable, f"{kv.num_evictable_blocks} evictable blocks, want {evictable}"
        assert (kv.num_evictions, kv.num_cow_copies) == (self.evictions, self.cow), (
            f"evictions, copies {kv.num_evictions, kv.num_cow_copies}, want {self.evictions, self.cow}")
        st_ = s.prefix_cache_stats
        got = (st_.queries, st_.hits, st_.evictions)
        assert got == (self.queries, self.hits, self.evictions), f"prefix cache stats {got}"
        got = (s.num_running, s.num_waiting, s.num_preemptions)
        want = (len(self.running), len(self.waiting), self.preemptions)
        assert got == want, f"running, waiting, preemptions {got}, want {want}"
        assert s.has_unfinished_requests() == bool(self.requests)
        for rid, seqs in self.requests.items():
            for seq in seqs:
                got = s.output_token_ids(rid, seq.index)
                assert got == seq.tokens[seq.nprompt:], f"{seq}: output {got}"
        if not self.requests:
            assert kv.num_free_blocks == kv.num_blocks, "every request ended, yet blocks are still in use"

    def teardown(self):
        # Run everything to completion, unless a rule already failed (hypothesis calls teardown from a
        # finally block; the model is then out of step and the first failure is the one to report).
        if hasattr(self, "s") and sys.exc_info()[1] is None:
            self._drain()


class BlockPoolMachine(RuleBasedStateMachine):
    """A bare BlockPool against a model of its refcounts, cached flags and LRU."""

    @initialize(n=st.integers(1, 5))
    def setup(self, n):
        self.n = n
        self.pool = _core.BlockPool(n)
        self.refc = [0] * n
        self.cached = [False] * n
        self.lru: list[int] = []  # cached blocks with refcount 0, least recently freed first
        self.evictions = 0

    def ids(self, data):
        """Mostly a block in use, else any id (one out of range on each side)."""
        held = [b for b in range(self.n) if self.refc[b] > 0]
        if held and data.draw(st.booleans()):
            return data.draw(st.sampled_from(held))
        return data.draw(st.integers(-1, self.n))

    @rule()
    def allocate(self):
        truly_free = [b for b in range(self.n) if self.refc[b] == 0 and not self.cached[b]]
        if not truly_free and not self.lru:
            with pytest.raises(OutOfBlocksError):
                self.pool.allocate()
            return
        b = self.pool.allocate()
        if truly_free:
            assert b in truly_free, f"allocate() gave {b} while truly free blocks {truly_free} remain"
        else:
            assert b == self.lru[0], f"allocate() evicted {b}, not the least recently freed {self.lru[0]}"
            self.lru.pop(0)
            self.cached[b] = False
            self.evictions += 1
        self.refc[b] = 1

    @rule()
    def allocate_until_none_is_truly_free(self):
        while any(r == 0 and not c for r, c in zip(self.refc, self.cached)):
            self.allocate()

    @precondition(lambda self: any(self.refc))
    @rule(data=st.data())
    def cache_and_release(self, data):
        """What the KV cache manager does with a prompt block: cache it, then drop every reference."""
        b = data.draw(st.sampled_from([b for b in range(self.n) if self.refc[b] > 0]))
        self.pool.mark_cached(b)
        self.cached[b] = True
        while self.refc[b]:
            self.pool.free(b)
            self.refc[b] -= 1
        self.lru.append(b)

    def _bad(self, b):
        return not 0 <= b < self.n

    @rule(data=st.data())
    def incref(self, data):
        b = self.ids(data)
        if self._bad(b) or self.refc[b] == 0:
            with pytest.raises(BlockPoolError):
                self.pool.incref(b)
            return
        self.pool.incref(b)
        self.refc[b] += 1

    @rule(data=st.data())
    def acquire(self, data):
        b = self.ids(data)
        if self._bad(b) or (self.refc[b] == 0 and b not in self.lru):
            with pytest.raises(BlockPoolError):
                self.pool.acquire(b)
            return
        self.pool.acquire(b)
        if self.refc[b] == 0:
            self.lru.remove(b)
        self.refc[b] += 1

    @rule(data=st.data())
    def free(self, data):
        b = self.ids(data)
        if self._bad(b) or self.refc[b] == 0:
            with pytest.raises(BlockPoolError):
                self.pool.free(b)
            return
        self.pool.free(b)
        self.refc[b] -= 1
        if self.refc[b] == 0 and self.cached[b]:
            self.lru.append(b)

    @rule(data=st.data())
    def mark_cached(self, data):
        b = self.ids(data)
        if self._bad(b) or self.refc[b] == 0:
            with pytest.raises(BlockPoolError):
                self.pool.mark_cached(b)
            return
        self.pool.mark_cached(b)
        self.cached[b] = True

    @invariant()
    def check_refcounts(self):
        for b in range(self.n):
            assert self.pool.refcount(b) == self.refc[b], f"block {b}: refcount {self.pool.refcount(b)}"
        for b in (-1, self.n):
            with pytest.raises(BlockPoolError):
                self.pool.refcount(b)
        free = sum(1 for r in self.refc if r == 0)
        assert self.pool.num_blocks == self.n
        assert self.pool.num_free_blocks == free, f"{self.pool.num_free_blocks} free blocks, want {free}"
        assert self.pool.num_free_blocks + sum(1 for r in self.refc if r > 0) == self.n  # free + used == total
        assert self.pool.num_evictable_blocks == len(self.lru), f"{self.pool.num_evictable_blocks} evictable"
        assert self.pool.num_evictions == self.evictions, f"{self.pool.num_evictions} evictions"

    def teardown(self):
        if not hasattr(self, "pool") or sys.exc_info()[1] is not None:  # not after a failed rule
            return
        for b in range(self.n):  # give every reference back: the whole pool is free again
            for _ in range(self.refc[b]):
                self.pool.free(b)
        assert self.pool.num_free_blocks == self.n, f"{self.pool.num_free_blocks} of {self.n} blocks free at the end"


def test_scheduler_state_machine():
    run_state_machine_as_test(SchedulerMachine, settings=_settings(examples=100, steps=40))


def test_block_pool_state_machine():
    run_state_machine_as_test(BlockPoolMachine, settings=_settings(examples=100, steps=40))
