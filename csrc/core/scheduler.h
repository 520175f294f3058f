// Scheduler: continuous batching over a paged KV cache with chunked prefill
// and preemption by recompute (Orca's iteration-level scheduling, vLLM v1's
// token-budget scheduler, nano-vllm's decide/commit split), under one of three
// policies (scheduling_policy.h: fcfs, priority, memory-aware).
//
// schedule() decides one step and reserves its KV slots (build_model_input()
// lays the decision out for the model); update() commits the
// sampled tokens. Between them the caller runs the model. Not thread-safe: one
// engine thread owns it.
//
// Policy of schedule():
//  1. Running sequences, in queue order (fcfs/memory-aware: admission order;
//     priority: best (priority, arrival) first), each get min(remaining,
//     budget) tokens: 1 for a decode (then up to its draft tokens, after step 2:
//     speculative decoding), a chunk of the prompt for an unfinished
//     prefill (memory-aware above high_watermark: at most one block's worth).
//     If a sequence cannot get its blocks, the last running sequence (newest;
//     priority: worst) is preempted (blocks freed, num_computed_tokens = 0,
//     back into the waiting queue at its place: the head for fcfs; generated
//     tokens kept and recomputed on resume), possibly itself.
//  2. If nothing was preempted, waiting requests are admitted in queue order
//     while running (counting the n sequences a request will fork into) + its
//     n <= max_num_seqs, budget remains and
//     can_allocate() holds for their first chunk; memory-aware also needs the
//     watermark to hold (scheduling_policy.h), except when nothing runs (so a
//     large request is never stuck); priority may preempt strictly worse
//     running sequences to make room. With prefix caching, admission first
//     matches the longest cached prefix of full blocks; those tokens are not
//     computed again (num_computed_tokens starts after them).
// update() registers blocks that became full in the prefix cache.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "kv_cache_manager.h"
#include "scheduler_output.h"
#include "scheduling_policy.h"
#include "sequence.h"

namespace pagedserve {

// The engine's scheduling limits. These defaults are the project's only ones:
// Python's EngineArgs reads them from here (pagedserve.config).
struct SchedulerConfig {
  int32_t max_num_seqs = 64;              // sequences running at once
  int32_t max_num_batched_tokens = 2048;  // tokens per step; longer prompts are prefilled in chunks
  int32_t max_model_len = 2048;           // prompt + output tokens per sequence
  bool enable_prefix_caching = true;      // reuse cached full blocks of equal prefixes
  SchedulingPolicy policy = SchedulingPolicy::kFcfs;
  double watermark = 0.05;       // memory-aware: share of the KV blocks admission leaves free, [0, 1)
  double high_watermark = 0.90;  // memory-aware: KV usage above which prefill chunks are throttled, (0, 1]
};

// Prefix-cache counters (vLLM's prefix_cache_queries / prefix_cache_hits, in tokens).
struct PrefixCacheStats {
  int64_t queries = 0;    // tokens looked up at admission
  int64_t hits = 0;       // of those, tokens found cached (not computed)
  int64_t evictions = 0;  // cached blocks evicted to make room
};

// One sequence's blocks (Scheduler::block_owners).
struct BlockOwner {
  std::string request_id;
  int32_t index = 0;               // choice index within its request
  std::vector<int32_t> block_ids;  // its block table
};

class Scheduler {
 public:
  // Throws InvalidArgumentError on a bad config (a limit < 1, a watermark out of range).
  Scheduler(const SchedulerConfig& config, int32_t num_blocks, int32_t block_size);

  // Queues a request. Throws RequestRejectedError if it can never be served:
  // empty prompt, duplicate request_id, max_tokens < 1, prompt + max_tokens >
  // max_model_len, more blocks than the whole pool, n > max_num_seqs, or a
  // priority other than 0 when the policy is not priority (as vLLM refuses it).
  // cache_salt: requests with different salts never share cached blocks.
  // n > 1 (parallel sampling): the prompt is prefilled once; at its first sample
  // the sequence forks into n sequences sharing the prompt's blocks.
  // skip_reading_prefix_cache: compute every prompt token even if cached (the
  // caller needs logits at every prompt position: prompt logprobs); its blocks
  // are still cached for later requests (vLLM's skip_reading_prefix_cache).
  // priority: lower is served first (priority policy only).
  void add_request(const std::string& request_id, const std::vector<int32_t>& prompt_token_ids,
                   const StopCriteria& stop, const std::string& cache_salt = "", int32_t n_seqs = 1,
                   bool skip_reading_prefix_cache = false, int32_t priority = 0);

  // Decides the next step (see class comment). Empty output when idle.
  std::shared_ptr<SchedulerOutput> schedule();

  // Commits the last schedule(): advances num_computed_tokens of every scheduled
  // sequence, gives each sampling sequence its next num_samples tokens of
  // sampled_token_ids (forking the extra ones into new sequences), decides
  // which end and why, and frees them. The one place a sequence ends in a step:
  // finished_by_caller (empty: all kNone; else one per sampled token, in the
  // same order) says what the caller found (stop strings, a grammar's end);
  // kStop wins, else the stop criteria (EOS, stop_token_ids: kStop; max_tokens,
  // max_model_len: kLength, turned into kStop by kStopIfFinished). Each update
  // carries its Sequence, the one record of the tokens: a caller reads output
  // tokens from it, also after the sequence finished and left the scheduler. Throws
  // InvalidArgumentError if a count differs from sum(num_samples) of the last output.
  std::vector<SequenceUpdate> update(const std::vector<int32_t>& sampled_token_ids,
                                     const std::vector<CallerFinish>& finished_by_caller = {});

  // Speculative decoding (scheduler_drafts.cc). Appends proposed tokens to
  // choice `index` of a request (prompt lookup: Saxena 2023; verification:
  // Leviathan et al. 2023, Chen et al. 2023); the next schedule() computes them
  // with the sequence's last token in one chunk, so the forward gives logits at
  // every one of their positions. schedule() takes drafts last: every real
  // token and admission first, then the drafts from the budget and free blocks
  // left (none above the memory-aware high-water mark), so speculation never
  // costs another sequence its turn or a preemption; drafts it cannot take, and
  // those of a sequence it does not schedule or preempts, are dropped. Returns how
  // many were appended: 0 unless the sequence runs and decodes (its last token
  // is its only uncomputed one), has no drafts and is not about to fork; at
  // most max_tokens - 1 - output tokens, and within max_model_len. Throws
  // UnknownRequestError for an unknown request or choice.
  int32_t add_draft_tokens(const std::string& request_id, int32_t index, const std::vector<int32_t>& draft);
  // Between schedule() and update(): keeps the first num_accepted of the drafts
  // the last schedule() computed for the choice and drops the rest (their slots
  // given back, blocks wholly past the kept tokens freed, nothing of them ever
  // registered in the prefix cache); update() then commits the kept tokens as
  // computed and appends the sampled token after them. Without this call
  // update() rejects every draft. The caller accepts no token past a stop token
  // (update() checks the stop criteria on the sampled token only). Throws
  // UnknownRequestError, InvalidArgumentError (not scheduled with drafts in the
  // last step, or num_accepted outside [0, its drafts]).
  void accept_draft_tokens(const std::string& request_id, int32_t index, int32_t num_accepted);
  // Speculative tokens proposed and accepted so far (vLLM's spec_decode
  // num_draft_tokens / num_accepted_tokens), counted when verified.
  int64_t num_draft_tokens() const { return num_drafts_verified_; }
  int64_t num_accepted_tokens() const { return num_drafts_accepted_; }

  // Ends a request in any state and frees its blocks at once. Returns false if
  // the id is unknown (already finished). reason: kStop (stop string) or kAbort.
  bool finish_request(const std::string& request_id, FinishReason reason);
  // Ends one sequence (choice `index`) of a request at once (outside a step's
  // update(), which takes the caller's stops itself).
  bool finish_sequence(const std::string& request_id, int32_t index, FinishReason reason);
  bool abort(const std::string& request_id) { return finish_request(request_id, FinishReason::kAbort); }

  bool has_unfinished_requests() const { return !requests_.empty(); }
  int32_t num_waiting() const { return static_cast<int32_t>(waiting_.size()); }
  int32_t num_running() const { return static_cast<int32_t>(running_.size()); }
  int64_t num_preemptions() const { return num_preemptions_; }
  // Mean output tokens of the sequences that finished by stop or length (0 before
  // the first): the memory-aware policy's expected output length.
  double mean_output_tokens() const {
    return num_finished_ ? static_cast<double>(finished_output_tokens_) / num_finished_ : 0.0;
  }
  PrefixCacheStats prefix_cache_stats() const {
    return {prefix_queries_, prefix_hits_, kv_.num_evictions()};
  }
  // Output token ids so far of choice `index` (not its unverified drafts). Throws UnknownRequestError.
  std::vector<int32_t> output_token_ids(const std::string& request_id, int32_t index = 0) const;
  const KVCacheManager& kv_cache_manager() const { return kv_; }
  // KV-cache events (kv_events.h; KVCacheManager::set_record_events): off by default.
  void set_record_kv_events(bool on) { kv_.set_record_events(on); }
  bool record_kv_events() const { return kv_.record_events(); }
  // The events recorded since the last call (in order), handed over and cleared.
  std::vector<KVCacheEvent> take_kv_events() { return kv_.take_events(); }
  const SchedulerConfig& config() const { return config_; }
  // Every sequence that holds KV blocks (running ones, in queue order), with
  // its block table: with KVCacheManager::block_map, who owns each block.
  std::vector<BlockOwner> block_owners() const;

 private:
  using SeqPtr = std::shared_ptr<Sequence>;
  void preempt(const SeqPtr& seq);
  void enqueue_waiting(const SeqPtr& seq, bool at_head);
  int64_t num_running_slots() const;
  void insert_running(const SeqPtr& seq);
  bool memory_aware_admits(const Sequence& seq, int32_t num_tokens, const PrefixMatch& match) const;
  bool preempt_for(const Sequence& seq, int32_t num_tokens, const PrefixMatch& match,
                   std::vector<std::pair<SeqPtr, int32_t>>& scheduled, int32_t& budget, SchedulerOutput& out);
  void finish(const SeqPtr& seq, FinishReason reason);
  SeqPtr find_sequence(const std::string& request_id, int32_t index) const;
  static void drop_drafts(Sequence& seq, int32_t count);
  int32_t reject_drafts(Sequence& seq, int32_t count);
  void schedule_drafts(std::vector<std::pair<SeqPtr, int32_t>>& scheduled, int32_t& budget, bool throttle);
  SeqPtr fork(const SeqPtr& parent, int32_t index);
  FinishReason check_stop(const Sequence& seq) const;
  void build_output(SchedulerOutput& out, const std::vector<std::pair<SeqPtr, int32_t>>& scheduled) const;

  SchedulerConfig config_;
  KVCacheManager kv_;
  std::deque<SeqPtr> waiting_;
  std::vector<SeqPtr> running_;
  std::unordered_map<std::string, std::vector<SeqPtr>> requests_;  // unfinished sequences per request
  std::vector<std::pair<SeqPtr, int32_t>> last_scheduled_;  // (sequence, num_scheduled_tokens)
  size_t last_num_samples_ = 0;
  int64_t next_seq_id_ = 0;
  int64_t next_arrival_ = 0;
  int64_t finished_output_tokens_ = 0, num_finished_ = 0;
  int64_t num_preemptions_ = 0;
  int64_t prefix_queries_ = 0, prefix_hits_ = 0;
  int64_t num_drafts_verified_ = 0, num_drafts_accepted_ = 0;
};

}  // namespace pagedserve
