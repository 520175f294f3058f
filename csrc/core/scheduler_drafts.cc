// Speculative decoding's part of the Scheduler (scheduler.h): draft tokens
// appended before schedule(), the verified prefix kept after the forward pass.
#include <algorithm>
#include <string>

#include "errors.h"
#include "scheduler.h"

namespace pagedserve {

Scheduler::SeqPtr Scheduler::find_sequence(const std::string& request_id, int32_t index) const {
  auto it = requests_.find(request_id);
  if (it != requests_.end()) {
    for (const SeqPtr& seq : it->second) {
      if (seq->index == index) return seq;
    }
  }
  throw UnknownRequestError("unknown request '" + request_id + "' or choice " + std::to_string(index));
}

void Scheduler::drop_drafts(Sequence& seq, int32_t count) {
  count = std::min(count, seq.num_draft_tokens);
  if (count <= 0) return;
  seq.token_ids.resize(seq.token_ids.size() - static_cast<size_t>(count));
  seq.num_draft_tokens -= count;
}

int32_t Scheduler::add_draft_tokens(const std::string& request_id, int32_t index,
                                    const std::vector<int32_t>& draft) {
  const SeqPtr seq = find_sequence(request_id, index);
  if (seq->status != SequenceStatus::kRunning || seq->num_draft_tokens > 0 || seq->num_forks > 1 ||
      seq->num_computed_tokens != seq->num_tokens() - 1 || seq->num_output_tokens() < 1) {
    return 0;
  }
  // the sampled token after the drafts is output too: drafts + 1 within max_tokens and max_model_len
  const int32_t room = std::min(seq->stop.max_tokens - seq->num_output_tokens() - 1,
                                config_.max_model_len - seq->num_tokens() - 1);
  const int32_t n = std::max(0, std::min(room, static_cast<int32_t>(draft.size())));
  seq->token_ids.insert(seq->token_ids.end(), draft.begin(), draft.begin() + n);
  seq->num_draft_tokens = n;
  return n;
}

int32_t Scheduler::reject_drafts(Sequence& seq, int32_t count) {
  count = std::min(count, seq.num_draft_tokens);
  if (count <= 0) return 0;
  num_drafts_verified_ += count;
  drop_drafts(seq, count);
  kv_.truncate(seq.seq_id, kv_.num_tokens(seq.seq_id) - count);  // their slots, and blocks wholly past the rest
  return count;
}

void Scheduler::schedule_drafts(std::vector<std::pair<SeqPtr, int32_t>>& scheduled, int32_t& budget,
                                bool throttle) {
  for (auto& [seq, n] : scheduled) {
    if (seq->num_draft_tokens == 0) continue;
    // a decode's real token is scheduled (n == 1): its drafts follow it if the budget and the blocks allow
    int32_t d = throttle || seq->num_computed_tokens + n + seq->num_draft_tokens != seq->num_tokens()
                    ? 0
                    : std::min(seq->num_draft_tokens, budget);
    if (d > 0 && !kv_.can_append(seq->seq_id, d)) d = 0;
    drop_drafts(*seq, seq->num_draft_tokens - d);
    if (d > 0) {
      kv_.append(seq->seq_id, d);
      n += d;
      budget -= d;
    }
  }
  // a running sequence this step did not reach keeps no drafts (they would be stale by its next turn)
  for (const SeqPtr& seq : running_) {
    if (seq->num_draft_tokens == 0) continue;
    const bool in_step = std::any_of(scheduled.begin(), scheduled.end(),
                                     [&](const std::pair<SeqPtr, int32_t>& s) { return s.first == seq; });
    if (!in_step) drop_drafts(*seq, seq->num_draft_tokens);
  }
}

void Scheduler::accept_draft_tokens(const std::string& request_id, int32_t index, int32_t num_accepted) {
  const SeqPtr seq = find_sequence(request_id, index);
  auto it = std::find_if(last_scheduled_.begin(), last_scheduled_.end(),
                         [&](const std::pair<SeqPtr, int32_t>& s) { return s.first == seq; });
  if (it == last_scheduled_.end() || seq->num_draft_tokens == 0) {
    throw InvalidArgumentError("request '" + request_id + "' choice " + std::to_string(index) +
                               " was not scheduled with draft tokens in the last step");
  }
  if (num_accepted < 0 || num_accepted > seq->num_draft_tokens) {
    throw InvalidArgumentError("num_accepted " + std::to_string(num_accepted) + " outside [0, " +
                               std::to_string(seq->num_draft_tokens) + "]");
  }
  num_drafts_verified_ += num_accepted;
  num_drafts_accepted_ += num_accepted;
  it->second -= reject_drafts(*seq, seq->num_draft_tokens - num_accepted);
  seq->num_draft_tokens = 0;  // the kept ones are output tokens now
}

}  // namespace pagedserve
