// The scheduling policies' admission and preemption decisions on small
// hand-made scenarios (scheduling_policy.h). Every scenario runs to the end and
// checks that every KV block came back.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "core/errors.h"
#include "core/scheduler.h"

using namespace pagedserve;

namespace {

StopCriteria max_tokens(int32_t n) {
  StopCriteria s;
  s.max_tokens = n;
  return s;
}

// n distinct tokens starting at `base` (distinct bases never share cached blocks).
std::vector<int32_t> tokens(int32_t n, int32_t base) {
  std::vector<int32_t> p(n);
  for (int32_t i = 0; i < n; ++i) p[i] = base * 1000 + i;
  return p;
}

SchedulerConfig config(SchedulingPolicy policy, int32_t max_num_seqs = 8, int32_t max_num_batched_tokens = 256) {
  SchedulerConfig c;
  c.policy = policy;
  c.max_num_seqs = max_num_seqs;
  c.max_num_batched_tokens = max_num_batched_tokens;
  c.enable_prefix_caching = false;
  return c;
}

// One step with a fake model: every sampling row gets num_samples tokens (7).
// Returns (request id -> tokens scheduled this step) and records preemptions.
struct Stepper {
  Scheduler& s;
  std::vector<std::string> first_token_order;  // requests in the order they got their first token
  std::map<std::string, int> got;
  std::vector<std::string> preempted;
  int64_t max_slots = 0;

  std::map<std::string, int32_t> step() {
    auto out = s.schedule();
    std::map<std::string, int32_t> sched;
    for (int32_t b = 0; b < out->num_seqs(); ++b) sched[out->request_ids[b]] += out->num_scheduled_tokens[b];
    for (const auto& id : out->preempted_request_ids) preempted.push_back(id);
    int32_t n = 0;
    for (int32_t k : out->num_samples) n += k;
    for (const auto& u : s.update(std::vector<int32_t>(n, 7))) {
      if (got[u.request_id]++ == 0) first_token_order.push_back(u.request_id);
    }
    max_slots = std::max<int64_t>(max_slots, s.num_running());
    return sched;
  }
  void run(int max_steps = 10000) {
    for (int i = 0; i < max_steps && s.has_unfinished_requests(); ++i) step();
    ASSERT_FALSE(s.has_unfinished_requests());
    EXPECT_EQ(s.kv_cache_manager().num_free_blocks(), s.kv_cache_manager().num_blocks());
  }
};

}  // namespace

TEST(SchedulingPolicy, NamesRoundTripAndUnknownIsRefused) {
  for (auto p : {SchedulingPolicy::kFcfs, SchedulingPolicy::kPriority, SchedulingPolicy::kMemoryAware}) {
    EXPECT_EQ(parse_scheduling_policy(scheduling_policy_name(p)), p);
  }
  EXPECT_THROW(parse_scheduling_policy("lifo"), InvalidArgumentError);
}

TEST(SchedulingPolicy, WatermarksOutOfRangeAreRefused) {
  SchedulerConfig c;
  c.watermark = 1.0;
  EXPECT_THROW(Scheduler(c, 8, 16), InvalidArgumentError);
  c.watermark = -0.1;
  EXPECT_THROW(Scheduler(c, 8, 16), InvalidArgumentError);
  c.watermark = 0.0;
  c.high_watermark = 0.0;
  EXPECT_THROW(Scheduler(c, 8, 16), InvalidArgumentError);
}

TEST(SchedulingPolicy, PriorityNeedsThePriorityPolicy) {
  for (auto p : {SchedulingPolicy::kFcfs, SchedulingPolicy::kMemoryAware}) {
    Scheduler s(config(p), 16, 16);
    EXPECT_THROW(s.add_request("a", tokens(4, 1), max_tokens(2), "", 1, false, 3), RequestRejectedError);
    s.add_request("b", tokens(4, 1), max_tokens(2), "", 1, false, 0);
  }
  Scheduler s(config(SchedulingPolicy::kPriority), 16, 16);
  s.add_request("a", tokens(4, 1), max_tokens(2), "", 1, false, -5);  // negative: served before 0
}

TEST(SchedulingPolicy, NMoreThanMaxNumSeqsIsRefused) {
  Scheduler s(config(SchedulingPolicy::kFcfs, 4), 64, 16);
  EXPECT_THROW(s.add_request("a", tokens(4, 1), max_tokens(2), "", 5), RequestRejectedError);
}

// Forks count against max_num_seqs before they happen: A (n=3) and B (n=2)
// cannot run together with max_num_seqs 4.
TEST(SchedulingPolicy, ForksNeverExceedMaxNumSeqs) {
  for (auto p : {SchedulingPolicy::kFcfs, SchedulingPolicy::kPriority, SchedulingPolicy::kMemoryAware}) {
    Scheduler s(config(p, 4), 64, 16);
    s.add_request("a", tokens(8, 1), max_tokens(4), "", 3);
    s.add_request("b", tokens(8, 2), max_tokens(4), "", 2);
    Stepper st{s};
    auto first = st.step();
    EXPECT_EQ(first.count("a"), 1u);
    EXPECT_EQ(first.count("b"), 0u) << scheduling_policy_name(p);
    st.run();
    EXPECT_LE(st.max_slots, 4) << scheduling_policy_name(p);
  }
}

// FCFS admits in arrival order and preempts the newest running sequence.
TEST(SchedulingPolicy, FcfsAdmitsInArrivalOrderAndPreemptsTheNewest) {
  // 6 blocks of 16: a and b each start with 2 blocks (32-token prompts) and
  // grow by one block after 16 outputs; together they need 2 * 3 = 6 + 1 > 6
  // at some point only if outputs reach 33 tokens: give them 40 each.
  Scheduler s(config(SchedulingPolicy::kFcfs), 6, 16);
  s.add_request("a", tokens(32, 1), max_tokens(40));
  s.add_request("b", tokens(32, 2), max_tokens(40));
  Stepper st{s};
  st.run();
  EXPECT_EQ(st.first_token_order, (std::vector<std::string>{"a", "b"}));
  ASSERT_FALSE(st.preempted.empty());
  EXPECT_EQ(st.preempted.front(), "b");  // the newest
}

// Priority: lower first, ties by arrival, whatever the arrival order.
TEST(SchedulingPolicy, PriorityAdmitsBestFirstTiesByArrival) {
  Scheduler s(config(SchedulingPolicy::kPriority, 1), 64, 16);
  s.add_request("low", tokens(8, 1), max_tokens(2), "", 1, false, 5);
  s.add_request("mid1", tokens(8, 2), max_tokens(2), "", 1, false, 1);
  s.add_request("mid2", tokens(8, 3), max_tokens(2), "", 1, false, 1);
  s.add_request("high", tokens(8, 4), max_tokens(2), "", 1, false, 0);
  Stepper st{s};
  st.run();
  EXPECT_EQ(st.first_token_order, (std::vector<std::string>{"high", "mid1", "mid2", "low"}));
  EXPECT_TRUE(st.preempted.empty());
}

// Priority inversion: a low-priority request holds the only sequence slot when a
// high-priority one arrives. The high one preempts it at once; the low one
// resumes afterwards and still finishes with all its tokens.
TEST(SchedulingPolicy, PriorityArrivalPreemptsWorseRunningWork) {
  Scheduler s(config(SchedulingPolicy::kPriority, 1), 64, 16);
  s.add_request("low", tokens(8, 1), max_tokens(20), "", 1, false, 10);
  Stepper st{s};
  for (int i = 0; i < 5; ++i) st.step();
  s.add_request("high", tokens(8, 2), max_tokens(3), "", 1, false, 0);
  auto sched = st.step();
  EXPECT_EQ(sched.count("high"), 1u);
  EXPECT_EQ(sched.count("low"), 0u);
  EXPECT_EQ(st.preempted, (std::vector<std::string>{"low"}));
  EXPECT_EQ(s.num_preemptions(), 1);
  st.run();
  EXPECT_EQ(st.got["low"], 20);
  EXPECT_EQ(st.got["high"], 3);
}

// The same with blocks as the scarce resource: slots are free but the pool is
// held by low-priority work.
TEST(SchedulingPolicy, PriorityArrivalPreemptsForBlocks) {
  Scheduler s(config(SchedulingPolicy::kPriority, 8), 4, 16);  // 4 blocks
  s.add_request("low", tokens(48, 1), max_tokens(10), "", 1, false, 3);  // 3 blocks, a 4th when decoding
  Stepper st{s};
  st.step();
  st.step();
  s.add_request("high", tokens(40, 2), max_tokens(2), "", 1, false, 1);  // needs 3 blocks
  auto sched = st.step();
  EXPECT_EQ(sched.count("high"), 1u);
  EXPECT_EQ(st.preempted, (std::vector<std::string>{"low"}));
  st.run();
  EXPECT_EQ(st.got["low"], 10);
}

// Preemption only helps strictly better requests, and only when it frees
// enough: equal priority never preempts; a victim too small to make room is
// left running.
TEST(SchedulingPolicy, PriorityDoesNotPreemptEqualOrPointlessly) {
  {
    Scheduler s(config(SchedulingPolicy::kPriority, 1), 64, 16);
    s.add_request("first", tokens(8, 1), max_tokens(5), "", 1, false, 2);
    Stepper st{s};
    st.step();
    s.add_request("same", tokens(8, 2), max_tokens(5), "", 1, false, 2);
    st.run();
    EXPECT_TRUE(st.preempted.empty());
    EXPECT_EQ(st.first_token_order, (std::vector<std::string>{"first", "same"}));
  }
  {
    // 6 blocks: "best" (priority 0) holds 4, "worst" (priority 9) holds 1; "mid"
    // (priority 5) needs 3: preempting "worst" gives 2, not enough.
    Scheduler s(config(SchedulingPolicy::kPriority, 8), 6, 16);
    s.add_request("best", tokens(64, 1), max_tokens(8), "", 1, false, 0);
    s.add_request("worst", tokens(8, 2), max_tokens(8), "", 1, false, 9);
    Stepper st{s};
    st.step();
    s.add_request("mid", tokens(40, 3), max_tokens(2), "", 1, false, 5);
    auto sched = st.step();
    EXPECT_EQ(sched.count("mid"), 0u);
    EXPECT_EQ(sched.count("worst"), 1u);
    EXPECT_TRUE(st.preempted.empty());
    st.run();
  }
}

// Out of blocks while decoding, priority preempts the worst running sequence
// even when it is not the newest.
TEST(SchedulingPolicy, PriorityOutOfBlocksPreemptsTheWorstNotTheNewest) {
  Scheduler s(config(SchedulingPolicy::kPriority, 8), 5, 16);
  s.add_request("low", tokens(32, 1), max_tokens(30), "", 1, false, 7);   // 2 blocks, grows to 4
  Stepper st{s};
  st.step();
  s.add_request("high", tokens(32, 2), max_tokens(30), "", 1, false, 0);  // newest, best
  st.run();
  ASSERT_FALSE(st.preempted.empty());
  for (const auto& id : st.preempted) EXPECT_EQ(id, "low");
  EXPECT_EQ(st.got["high"], 30);
  EXPECT_EQ(st.got["low"], 30);
}

// Memory-aware admission at the watermark edge. 10 blocks of 16, watermark
// 0.1 (1 block stays free), no finished requests yet (expected output =
// max_tokens). "r": 32-token prompt, 32 outputs -> holds 2 blocks, will take 2
// more. "w": 32-token prompt (2 blocks now) and m outputs: admitted with r iff
// 10 - 2 - 2 - 2 - (blocks(32 + m) - 2) >= 1, i.e. 32 + m <= 80.
TEST(SchedulingPolicy, MemoryAwareWatermarkEdge) {
  for (int32_t m : {48, 49}) {
    SchedulerConfig c = config(SchedulingPolicy::kMemoryAware);
    c.watermark = 0.1;
    Scheduler s(c, 10, 16);
    s.add_request("r", tokens(32, 1), max_tokens(32));
    s.add_request("w", tokens(32, 2), max_tokens(m));
    Stepper st{s};
    auto sched = st.step();
    EXPECT_EQ(sched.count("r"), 1u);
    EXPECT_EQ(sched.count("w"), m == 48 ? 1u : 0u) << "max_tokens " << m;
    st.run();  // "w" (m = 49) is admitted once "r" is done
    EXPECT_EQ(st.got["w"], m);
    EXPECT_TRUE(st.preempted.empty());
  }
}

// With nothing running, memory-aware admits whatever fits, so a request larger
// than the watermark allows is never stuck.
TEST(SchedulingPolicy, MemoryAwareAdmitsAnythingThatFitsWhenIdle) {
  SchedulerConfig c = config(SchedulingPolicy::kMemoryAware);
  c.watermark = 0.5;
  Scheduler s(c, 8, 16);
  s.add_request("big", tokens(64, 1), max_tokens(60));  // 8 blocks at the end
  Stepper st{s};
  st.run();
  EXPECT_EQ(st.got["big"], 60);
}

// Above the high-water mark a running prefill advances one block per step;
// FCFS gives it the whole remaining budget.
TEST(SchedulingPolicy, MemoryAwareThrottlesPrefillAboveHighWater) {
  for (auto p : {SchedulingPolicy::kFcfs, SchedulingPolicy::kMemoryAware}) {
    SchedulerConfig c = config(p, 8, 64);
    c.watermark = 0.0;
    c.high_watermark = 0.5;
    Scheduler s(c, 16, 16);
    s.add_request("r", tokens(64, 1), max_tokens(8));   // step 1: whole prompt, 4 blocks
    s.add_request("p", tokens(128, 2), max_tokens(1));  // step 2: 63-token chunk; usage then 9/16
    Stepper st{s};
    st.step();
    auto second = st.step();
    ASSERT_EQ(second["p"], 63);
    auto third = st.step();
    EXPECT_EQ(third["r"], 1);
    EXPECT_EQ(third["p"], p == SchedulingPolicy::kMemoryAware ? 16 : 63) << scheduling_policy_name(p);
    st.run();
  }
}

// The expected output adapts: after requests finish, the mean of their outputs
// replaces max_tokens in the reserve.
TEST(SchedulingPolicy, MemoryAwareLearnsTheMeanOutputLength) {
  SchedulerConfig c = config(SchedulingPolicy::kMemoryAware);
  Scheduler s(c, 64, 16);
  EXPECT_EQ(s.mean_output_tokens(), 0.0);
  s.add_request("a", tokens(8, 1), max_tokens(4));
  s.add_request("b", tokens(8, 2), max_tokens(8));
  Stepper st{s};
  st.run();
  EXPECT_DOUBLE_EQ(s.mean_output_tokens(), 6.0);
  Sequence q;
  q.num_prompt_tokens = 10;
  q.token_ids.assign(12, 0);  // 2 outputs so far
  q.stop.max_tokens = 100;
  EXPECT_EQ(expected_final_tokens(q, 6.0, 2048), 16);
  EXPECT_EQ(expected_final_tokens(q, 0.0, 2048), 110);   // nothing finished: max_tokens
  EXPECT_EQ(expected_final_tokens(q, 1.0, 2048), 13);    // at least one more token
  EXPECT_EQ(expected_final_tokens(q, 0.0, 50), 50);      // capped by max_model_len
}

// A forked sequence preempted in the step that gave it its copy-on-write block
// leaves no copy into the freed block behind (priority preempts for a better
// arrival after the running sequences were scheduled).
TEST(SchedulingPolicy, PreemptedSequenceLeavesNoPendingCopy) {
  SchedulerConfig c = config(SchedulingPolicy::kPriority, 2);
  c.enable_prefix_caching = false;
  Scheduler s(c, 8, 4);
  s.add_request("low", {3, 4, 5}, max_tokens(8), "", 2, false, 5);
  auto out = s.schedule();
  s.update(std::vector<int32_t>(2, 6));  // forks: two sequences share a partial block
  s.add_request("high", {7, 8}, max_tokens(4), "", 2, false, 0);
  out = s.schedule();
  ASSERT_EQ(out->preempted_request_ids.size(), 2u);
  EXPECT_EQ(out->preemption_reasons, (std::vector<std::string>{"priority", "priority"}));
  std::vector<int32_t> held(out->block_ids.begin(), out->block_ids.end());
  for (size_t i = 0; i < out->blocks_to_copy.size(); i += 2) {
    EXPECT_NE(std::find(held.begin(), held.end(), out->blocks_to_copy[i + 1]), held.end())
        << "copy into block " << out->blocks_to_copy[i + 1] << " that no scheduled sequence holds";
  }
  EXPECT_TRUE(out->blocks_to_copy.empty());
  int32_t n = 0;
  for (int32_t k : out->num_samples) n += k;
  s.update(std::vector<int32_t>(n, 9));
  Stepper st{s};
  st.run();
}
