#include "scheduling_policy.h"

#include <algorithm>
#include <cmath>

#include "errors.h"

namespace pagedserve {

const char* scheduling_policy_name(SchedulingPolicy p) {
  switch (p) {
    case SchedulingPolicy::kPriority: return "priority";
    case SchedulingPolicy::kMemoryAware: return "memory-aware";
    default: return "fcfs";
  }
}

SchedulingPolicy parse_scheduling_policy(const std::string& name) {
  for (SchedulingPolicy p : {SchedulingPolicy::kFcfs, SchedulingPolicy::kPriority, SchedulingPolicy::kMemoryAware}) {
    if (name == scheduling_policy_name(p)) return p;
  }
  throw InvalidArgumentError("unknown scheduling policy '" + name + "': choose fcfs, priority or memory-aware");
}

int32_t expected_final_tokens(const Sequence& seq, double mean_output_tokens, int32_t max_model_len) {
  const int32_t max_out = seq.stop.max_tokens;
  int32_t out = mean_output_tokens > 0 ? static_cast<int32_t>(std::ceil(mean_output_tokens)) : max_out;
  out = std::min(std::max(out, seq.num_output_tokens() + 1), max_out);
  return std::min(seq.num_prompt_tokens + out, max_model_len);
}

}  // namespace pagedserve
