// SchedulingPolicy: how the Scheduler orders, admits and preempts sequences.
//
//  fcfs          arrival order; preemption takes the newest running sequence
//                (the scheduler's original behaviour).
//  priority      lower `priority` value first, ties by arrival (vLLM's
//                --scheduling-policy priority). The waiting and running queues
//                are kept sorted by (priority, arrival); preemption takes the
//                running sequence with the worst key; a waiting request that
//                cannot be admitted (no free slot in max_num_seqs or too few
//                blocks) preempts running sequences of strictly worse priority
//                when that frees enough room for it. Strict: no aging, so a
//                low-priority request waits as long as better work keeps the
//                engine full.
//  memory-aware  FCFS order with adaptive admission control: a waiting request
//                is admitted only if, after its prompt's blocks and a reserve
//                for the expected output of it and of every running sequence,
//                `watermark` of the pool stays free (vLLM v0's watermark, with
//                the output reserve added); while KV usage is above
//                `high_watermark`, running prefills advance at most one block
//                per step so decodes keep their blocks.
#pragma once

#include <cstdint>
#include <string>

#include "sequence.h"

namespace pagedserve {

enum class SchedulingPolicy { kFcfs, kPriority, kMemoryAware };

// "fcfs", "priority", "memory-aware".
const char* scheduling_policy_name(SchedulingPolicy p);
// The inverse of scheduling_policy_name. Throws InvalidArgumentError naming the choices.
SchedulingPolicy parse_scheduling_policy(const std::string& name);

// Strict weak order of the priority policy: (priority, arrival) ascending.
inline bool served_before(const Sequence& a, const Sequence& b) {
  return a.priority != b.priority ? a.priority < b.priority : a.arrival < b.arrival;
}

// Output tokens the memory-aware policy expects a sequence to still produce:
// the mean output length of finished requests (mean_output_tokens; <= 0 when
// none finished yet, then max_tokens), at least one more token than it has,
// at most its max_tokens and what max_model_len leaves. Returned as the
// sequence's expected final length in tokens (prompt + output).
int32_t expected_final_tokens(const Sequence& seq, double mean_output_tokens, int32_t max_model_len);

}  // namespace pagedserve
