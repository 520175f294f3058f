#include "scheduler.h"

#include <algorithm>
#include <cmath>

#include "errors.h"

namespace pagedserve {

Scheduler::Scheduler(const SchedulerConfig& config, int32_t num_blocks, int32_t block_size)
    : config_(config), kv_(num_blocks, block_size, config.enable_prefix_caching) {
  if (config.max_num_seqs < 1 || config.max_num_batched_tokens < 1 || config.max_model_len < 1) {
    throw InvalidArgumentError(
        "max_num_seqs, max_num_batched_tokens and max_model_len must all be >= 1");
  }
  if (!(config.watermark >= 0.0 && config.watermark < 1.0)) {
    throw InvalidArgumentError("watermark must be in [0, 1), got " + std::to_string(config.watermark));
  }
  if (!(config.high_watermark > 0.0 && config.high_watermark <= 1.0)) {
    throw InvalidArgumentError("high_watermark must be in (0, 1], got " + std::to_string(config.high_watermark));
  }
}

void Scheduler::add_request(const std::string& request_id,
                            const std::vector<int32_t>& prompt_token_ids, const StopCriteria& stop,
                            const std::string& cache_salt, int32_t n_seqs,
                            bool skip_reading_prefix_cache, int32_t priority) {
  const auto n = static_cast<int64_t>(prompt_token_ids.size());
  if (n == 0) throw RequestRejectedError("the prompt is empty");
  if (requests_.count(request_id)) {
    throw RequestRejectedError("request id '" + request_id + "' is already in use");
  }
  if (n_seqs < 1) throw RequestRejectedError("n must be at least 1, got " + std::to_string(n_seqs));
  if (n_seqs > config_.max_num_seqs) {
    throw RequestRejectedError("n = " + std::to_string(n_seqs) + " exceeds max_num_seqs (" +
                               std::to_string(config_.max_num_seqs) + "): its sequences could never run at once");
  }
  if (priority != 0 && config_.policy != SchedulingPolicy::kPriority) {
    throw RequestRejectedError("priority " + std::to_string(priority) +
                               " is only honoured with the priority scheduling policy (this engine runs " +
                               scheduling_policy_name(config_.policy) + ")");
  }
  if (stop.max_tokens < 1) {
    throw RequestRejectedError("max_tokens must be at least 1, got " +
                               std::to_string(stop.max_tokens));
  }
  if (n + stop.max_tokens > config_.max_model_len) {
    throw RequestRejectedError(
        "this model's maximum context length is " + std::to_string(config_.max_model_len) +
        " tokens, but " + std::to_string(n) + " prompt tokens + " +
        std::to_string(stop.max_tokens) + " max_tokens = " + std::to_string(n + stop.max_tokens) +
        " were requested");
  }
  const int32_t need = BlockTable::num_blocks_for(static_cast<int32_t>(n) + stop.max_tokens,
                                                  kv_.block_size());
  if (need > kv_.num_blocks()) {
    throw RequestRejectedError("request needs " + std::to_string(need) +
                               " KV blocks but the whole cache has " +
                               std::to_string(kv_.num_blocks()));
  }
  auto seq = std::make_shared<Sequence>();
  seq->request_id = request_id;
  seq->seq_id = next_seq_id_++;
  seq->token_ids = prompt_token_ids;
  seq->num_prompt_tokens = static_cast<int32_t>(n);
  seq->stop = stop;
  seq->cache_salt = cache_salt;
  seq->num_forks = n_seqs;
  seq->skip_reading_prefix_cache = skip_reading_prefix_cache;
  seq->priority = priority;
  seq->arrival = next_arrival_++;
  requests_[request_id].push_back(seq);
  enqueue_waiting(seq, /*at_head=*/false);
}

int64_t Scheduler::num_running_slots() const {
  int64_t n = 0;
  for (const SeqPtr& r : running_) n += r->num_forks;  // a sequence that will fork holds n slots
  return n;
}

void Scheduler::enqueue_waiting(const SeqPtr& seq, bool at_head) {
  if (config_.policy == SchedulingPolicy::kPriority) {  // sorted by (priority, arrival)
    auto pos = std::upper_bound(waiting_.begin(), waiting_.end(), seq,
                                [](const SeqPtr& a, const SeqPtr& b) { return served_before(*a, *b); });
    waiting_.insert(pos, seq);
  } else if (at_head) {
    waiting_.push_front(seq);
  } else {
    waiting_.push_back(seq);
  }
}

void Scheduler::insert_running(const SeqPtr& seq) {
  if (config_.policy == SchedulingPolicy::kPriority) {
    auto pos = std::upper_bound(running_.begin(), running_.end(), seq,
                                [](const SeqPtr& a, const SeqPtr& b) { return served_before(*a, *b); });
    running_.insert(pos, seq);
  } else {
    running_.push_back(seq);
  }
}

void Scheduler::preempt(const SeqPtr& seq) {
  drop_drafts(*seq, seq->num_draft_tokens);  // unverified: never recomputed as if they were output
  kv_.free(seq->seq_id);
  seq->num_computed_tokens = 0;
  seq->status = SequenceStatus::kWaiting;
  ++seq->num_preemptions;
  ++num_preemptions_;
  enqueue_waiting(seq, /*at_head=*/true);
}

bool Scheduler::memory_aware_admits(const Sequence& seq, int32_t num_tokens, const PrefixMatch& match) const {
  const int32_t bs = kv_.block_size();
  const double mean = mean_output_tokens();
  int64_t reserve = 0;  // blocks the running sequences are expected to still take
  for (const SeqPtr& r : running_) {
    const int32_t target = expected_final_tokens(*r, mean, config_.max_model_len);
    reserve += std::max(0, BlockTable::num_blocks_for(target, bs) -
                               BlockTable::num_blocks_for(kv_.num_tokens(r->seq_id), bs));
  }
  const int32_t target = expected_final_tokens(seq, mean, config_.max_model_len);
  reserve += static_cast<int64_t>(std::max(0, BlockTable::num_blocks_for(target, bs) -
                                                  BlockTable::num_blocks_for(num_tokens, bs))) *
             seq.num_forks;
  const int64_t left = static_cast<int64_t>(kv_.num_free_blocks()) - kv_.num_blocks_to_allocate(num_tokens, match) -
                       reserve;
  return left >= static_cast<int64_t>(std::ceil(config_.watermark * kv_.num_blocks()));
}

bool Scheduler::preempt_for(const Sequence& seq, int32_t num_tokens, const PrefixMatch& match,
                            std::vector<std::pair<SeqPtr, int32_t>>& scheduled, int32_t& budget,
                            SchedulerOutput& out) {
  // Count the victims (worst first, strictly worse priority only) that make room.
  int64_t seqs_free = static_cast<int64_t>(config_.max_num_seqs) - num_running_slots();
  int64_t blocks_free = kv_.num_free_blocks();
  const int32_t need = kv_.num_blocks_to_allocate(num_tokens, match);
  size_t k = 0;
  for (auto it = running_.rbegin(); it != running_.rend() && (*it)->priority > seq.priority; ++it) {
    if (seqs_free >= seq.num_forks && blocks_free >= need) break;
    seqs_free += (*it)->num_forks;
    blocks_free += kv_.num_exclusive_blocks((*it)->seq_id);  // shared blocks stay held: a lower bound
    ++k;
  }
  if (k == 0 || seqs_free < seq.num_forks || blocks_free < need) return false;
  for (; k > 0; --k) {
    SeqPtr victim = running_.back();
    running_.pop_back();
    auto in_step = std::find_if(scheduled.begin(), scheduled.end(),
                                [&](const std::pair<SeqPtr, int32_t>& p) { return p.first == victim; });
    if (in_step != scheduled.end()) {  // scheduled earlier in this step: give its tokens back
      budget += in_step->second;
      scheduled.erase(in_step);
    }
    preempt(victim);
    out.preempted_request_ids.push_back(victim->request_id);
    out.preemption_reasons.emplace_back("priority");
  }
  return true;
}

std::vector<BlockOwner> Scheduler::block_owners() const {
  std::vector<BlockOwner> owners;
  const auto add = [&](const SeqPtr& seq) {
    if (kv_.has_sequence(seq->seq_id)) {
      owners.push_back({seq->request_id, seq->index, kv_.block_table(seq->seq_id).block_ids()});
    }
  };
  for (const SeqPtr& seq : running_) add(seq);
  for (const SeqPtr& seq : waiting_) add(seq);  // none hold blocks today (preemption frees all); kept general
  return owners;
}

std::shared_ptr<SchedulerOutput> Scheduler::schedule() {
  auto out = std::make_shared<SchedulerOutput>();
  std::vector<std::pair<SeqPtr, int32_t>> scheduled;
  int32_t budget = config_.max_num_batched_tokens;
  bool preempted = false;

  // memory-aware: above the high-water mark prefills advance one block per step
  const bool throttle = config_.policy == SchedulingPolicy::kMemoryAware && kv_.usage() > config_.high_watermark;

  // 1. Running sequences in queue order; preempt from the back (newest / worst).
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    SeqPtr seq = running_[i];
    // the real tokens only: drafts come last (3.), from what every real token and admission left
    int32_t num_new = std::min(seq->num_tokens() - seq->num_draft_tokens - seq->num_computed_tokens, budget);
    if (throttle) num_new = std::min(num_new, kv_.block_size());
    bool keep = true;
    while (!kv_.can_append(seq->seq_id, num_new)) {
      SeqPtr victim = running_.back();
      running_.pop_back();
      preempt(victim);
      out->preempted_request_ids.push_back(victim->request_id);
      out->preemption_reasons.emplace_back("kv_blocks");
      preempted = true;
      if (victim == seq) {
        keep = false;
        break;
      }
    }
    if (!keep) break;
    kv_.append(seq->seq_id, num_new);
    scheduled.emplace_back(seq, num_new);
    budget -= num_new;
    ++i;
  }

  // 2. Admit waiting requests (not in a step that had to preempt for blocks).
  while (!preempted && !waiting_.empty() && budget > 0) {
    SeqPtr seq = waiting_.front();
    const PrefixMatch match = seq->skip_reading_prefix_cache
                                  ? PrefixMatch{}
                                  : kv_.match_prefix(seq->token_ids, seq->cache_salt);
    const int32_t num_cached = match.num_tokens(kv_.block_size());
    const int32_t num_new = std::min(seq->num_tokens() - num_cached, budget);
    const int32_t num_tokens = num_cached + num_new;
    const bool fits = num_running_slots() + seq->num_forks <= config_.max_num_seqs &&
                      kv_.can_allocate(num_tokens, match);
    if (!fits) {
      if (config_.policy == SchedulingPolicy::kPriority && preempt_for(*seq, num_tokens, match, scheduled, budget, *out)) {
        continue;  // room was made: decide again (the match may have changed)
      }
      break;
    }
    if (config_.policy == SchedulingPolicy::kMemoryAware && !running_.empty() &&
        !memory_aware_admits(*seq, num_tokens, match)) {
      break;
    }
    waiting_.pop_front();
    kv_.allocate(seq->seq_id, num_cached + num_new, match, seq->cache_salt);
    seq->num_computed_tokens = num_cached;
    if (seq->num_cached_tokens < 0) seq->num_cached_tokens = num_cached;
    if (kv_.prefix_caching_enabled() && !seq->skip_reading_prefix_cache) {
      prefix_queries_ += seq->num_tokens();
      prefix_hits_ += num_cached;
    }
    seq->status = SequenceStatus::kRunning;
    insert_running(seq);
    scheduled.emplace_back(seq, num_new);
    budget -= num_new;
  }

  schedule_drafts(scheduled, budget, throttle);
  build_output(*out, scheduled);
  for (const auto& [src, dst] : kv_.take_pending_copies()) {
    out->blocks_to_copy.push_back(src);
    out->blocks_to_copy.push_back(dst);
  }
  last_num_samples_ = 0;
  for (int32_t k : out->num_samples) last_num_samples_ += k;
  last_scheduled_ = std::move(scheduled);
  return out;
}

void Scheduler::build_output(SchedulerOutput& out,
                             const std::vector<std::pair<SeqPtr, int32_t>>& scheduled) const {
  out.block_size = kv_.block_size();
  out.block_table_offsets.push_back(0);
  for (size_t b = 0; b < scheduled.size(); ++b) {
    const auto& [seq, n] = scheduled[b];
    const BlockTable& table = kv_.block_table(seq->seq_id);
    const int32_t start = seq->num_computed_tokens;
    out.request_ids.push_back(seq->request_id);
    out.seq_indices.push_back(seq->index);
    out.num_scheduled_tokens.push_back(n);
    out.num_computed_tokens.push_back(start);
    out.num_draft_tokens.push_back(seq->num_draft_tokens);
    out.token_ids.insert(out.token_ids.end(), seq->token_ids.begin() + start, seq->token_ids.begin() + start + n);
    out.block_ids.insert(out.block_ids.end(), table.block_ids().begin(), table.block_ids().end());
    out.block_table_offsets.push_back(static_cast<int32_t>(out.block_ids.size()));
    if (start + n == seq->num_tokens()) {  // all known tokens computed: sample the next
      out.sampling_seq_indices.push_back(static_cast<int32_t>(b));
      out.num_samples.push_back(seq->num_forks);
    }
  }
}

FinishReason Scheduler::check_stop(const Sequence& seq) const {
  const int32_t last = seq.token_ids.back();
  const auto& st = seq.stop;
  if (!st.ignore_eos &&
      std::find(st.eos_token_ids.begin(), st.eos_token_ids.end(), last) != st.eos_token_ids.end()) {
    return FinishReason::kStop;
  }
  if (std::find(st.stop_token_ids.begin(), st.stop_token_ids.end(), last) != st.stop_token_ids.end()) {
    return FinishReason::kStop;
  }
  if (seq.num_output_tokens() >= st.max_tokens || seq.num_tokens() >= config_.max_model_len) {
    return FinishReason::kLength;
  }
  return FinishReason::kNone;
}

std::vector<SequenceUpdate> Scheduler::update(const std::vector<int32_t>& sampled_token_ids,
                                              const std::vector<CallerFinish>& finished_by_caller) {
  if (sampled_token_ids.size() != last_num_samples_) {
    throw InvalidArgumentError("update() got " + std::to_string(sampled_token_ids.size()) +
                                " sampled tokens, the last schedule() asked for " +
                                std::to_string(last_num_samples_));
  }
  if (!finished_by_caller.empty() && finished_by_caller.size() != sampled_token_ids.size()) {
    throw InvalidArgumentError("update() got " + std::to_string(finished_by_caller.size()) +
                                " finished_by_caller flags for " + std::to_string(sampled_token_ids.size()) +
                                " sampled tokens");
  }
  std::vector<SequenceUpdate> updates;
  size_t s = 0;
  auto commit = [&](const SeqPtr& seq, size_t i) {
    const int32_t token = sampled_token_ids[i];
    const CallerFinish caller = finished_by_caller.empty() ? CallerFinish::kNone : finished_by_caller[i];
    seq->token_ids.push_back(token);
    FinishReason reason = caller == CallerFinish::kStop ? FinishReason::kStop : check_stop(*seq);
    if (reason == FinishReason::kLength && caller == CallerFinish::kStopIfFinished) reason = FinishReason::kStop;
    SequenceUpdate u{seq->request_id, seq->index, token, reason, seq->num_cached_tokens, seq};
    if (u.finish_reason != FinishReason::kNone) finish(seq, u.finish_reason);
    updates.push_back(std::move(u));
  };
  for (const auto& [seq, n] : last_scheduled_) {
    const bool samples = seq->num_computed_tokens + n == seq->num_tokens();
    const int32_t k = samples ? seq->num_forks : 0;
    const size_t first = s;
    s += k;
    if (seq->status != SequenceStatus::kRunning) continue;  // finished since schedule()
    // drafts not given to accept_draft_tokens are unverified: rejected
    const int32_t computed = n - reject_drafts(*seq, seq->num_draft_tokens);
    seq->num_computed_tokens += computed;
    kv_.cache_full_blocks(seq->seq_id, seq->token_ids, seq->num_computed_tokens);
    if (!samples) continue;
    std::vector<SeqPtr> children;  // fork before the parent's own token goes in
    for (int32_t i = 1; i < k; ++i) children.push_back(fork(seq, i));
    seq->num_forks = 1;
    commit(seq, first);
    for (int32_t i = 1; i < k; ++i) commit(children[i - 1], first + i);
  }
  last_scheduled_.clear();
  last_num_samples_ = 0;
  return updates;
}

Scheduler::SeqPtr Scheduler::fork(const SeqPtr& parent, int32_t index) {
  auto child = std::make_shared<Sequence>(*parent);
  child->seq_id = next_seq_id_++;
  child->index = index;
  child->num_forks = 1;
  kv_.fork(parent->seq_id, child->seq_id);
  insert_running(child);
  requests_[parent->request_id].push_back(child);
  return child;
}

void Scheduler::finish(const SeqPtr& seq, FinishReason reason) {
  drop_drafts(*seq, seq->num_draft_tokens);  // an abort between schedule() and update(): never output
  kv_.free(seq->seq_id);
  if (seq->status == SequenceStatus::kRunning) {
    running_.erase(std::find(running_.begin(), running_.end(), seq));
  } else if (seq->status == SequenceStatus::kWaiting) {
    waiting_.erase(std::find(waiting_.begin(), waiting_.end(), seq));
  }
  seq->status = SequenceStatus::kFinished;
  seq->finish_reason = reason;
  if (reason == FinishReason::kStop || reason == FinishReason::kLength) {
    finished_output_tokens_ += seq->num_output_tokens();
    ++num_finished_;
  }
  auto it = requests_.find(seq->request_id);
  if (it != requests_.end()) {
    auto& seqs = it->second;
    seqs.erase(std::remove(seqs.begin(), seqs.end(), seq), seqs.end());
    if (seqs.empty()) requests_.erase(it);
  }
}

bool Scheduler::finish_request(const std::string& request_id, FinishReason reason) {
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return false;
  const std::vector<SeqPtr> seqs = it->second;  // copy: finish() edits the map entry
  for (const SeqPtr& seq : seqs) finish(seq, reason);
  return true;
}

bool Scheduler::finish_sequence(const std::string& request_id, int32_t index, FinishReason reason) {
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return false;
  for (const SeqPtr& seq : it->second) {
    if (seq->index == index) {
      SeqPtr keep = seq;  // finish() may erase the vector holding it
      finish(keep, reason);
      return true;
    }
  }
  return false;
}

std::vector<int32_t> Scheduler::output_token_ids(const std::string& request_id, int32_t index) const {
  return find_sequence(request_id, index)->output_token_ids();
}

}  // namespace pagedserve
