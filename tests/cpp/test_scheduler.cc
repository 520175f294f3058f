#include <gtest/gtest.h>

#include <map>
#include <set>

#include "core/errors.h"
#include "core/model_input.h"
#include "core/scheduler.h"
#include "scheduler_requests.h"

using namespace pagedserve;
using namespace pagedserve::test_support;

namespace {


// Runs steps until idle with a fake model that samples a token derived from
// the sampled position (never EOS). Checks per-step invariants and returns the
// output tokens per request.
struct Driver {
  Scheduler& s;
  std::map<std::string, std::vector<int32_t>> outputs;
  std::map<std::string, std::string> finish;
  int steps = 0;
  int64_t max_tokens_in_step = 0;

  void step() {
    auto out = s.schedule();
    ++steps;
    ASSERT_FALSE(out->empty()) << "scheduler idle while requests remain";
    const ModelInput in = build_model_input(*out);
    const int32_t B = out->num_seqs();
    ASSERT_EQ(static_cast<int32_t>(in.query_start_loc.size()), B + 1);
    ASSERT_LE(out->total_num_scheduled_tokens(), s.config().max_num_batched_tokens);
    ASSERT_LE(B, s.config().max_num_seqs);
    max_tokens_in_step = std::max<int64_t>(max_tokens_in_step, out->total_num_scheduled_tokens());
    std::set<int64_t> slots(in.slot_mapping.begin(), in.slot_mapping.end());
    ASSERT_EQ(static_cast<int32_t>(slots.size()), out->total_num_scheduled_tokens());
    for (int32_t b = 0; b < B; ++b) {
      const int32_t q0 = in.query_start_loc[b];
      ASSERT_EQ(in.query_start_loc[b + 1] - q0, out->num_scheduled_tokens[b]);
      ASSERT_EQ(in.seq_lens[b], out->num_computed_tokens[b] + out->num_scheduled_tokens[b]);
      for (int32_t i = 0; i < out->num_scheduled_tokens[b]; ++i) {
        const int32_t pos = out->num_computed_tokens[b] + i;
        ASSERT_EQ(in.positions[q0 + i], pos);
        ASSERT_EQ(in.input_ids[q0 + i], out->token_ids[q0 + i]);
        const int32_t blk = in.block_tables[b * in.max_num_blocks_per_seq + pos / 16];
        ASSERT_EQ(blk, out->block_ids[out->block_table_offsets[b] + pos / 16]);
        ASSERT_EQ(in.slot_mapping[q0 + i], static_cast<int64_t>(blk) * 16 + pos % 16);
      }
    }
    std::vector<int32_t> sampled;
    for (int64_t idx : in.logits_indices) sampled.push_back(100 + static_cast<int32_t>(in.positions[idx] % 50));
    for (const auto& u : s.update(sampled)) {
      outputs[u.request_id].push_back(u.token_id);
      if (u.finish_reason != FinishReason::kNone) finish[u.request_id] = finish_reason_str(u.finish_reason);
    }
  }
  void run(int max_steps = 10000) {
    while (s.has_unfinished_requests() && steps < max_steps) step();
    ASSERT_FALSE(s.has_unfinished_requests());
  }
};

void expect_all_free(const Scheduler& s) {
  EXPECT_EQ(s.kv_cache_manager().num_free_blocks(), s.kv_cache_manager().num_blocks());
}

// The expected fake-model output of a prompt of n tokens: token at position p
// is 100 + (p - 1) % 50 for the p-th position sampled.
std::vector<int32_t> expected_output(int32_t n, int32_t max_tokens) {
  std::vector<int32_t> o;
  for (int32_t p = n - 1; p < n - 1 + max_tokens; ++p) o.push_back(100 + p % 50);
  return o;
}

}  // namespace

TEST(Scheduler, SingleRequestRunsToLength) {
  Scheduler s({4, 64, 256}, 16, 16);
  s.add_request("a", prompt(5), stop_after(3));
  Driver d{s};
  d.run();
  EXPECT_EQ(d.outputs["a"], expected_output(5, 3));
  EXPECT_EQ(d.finish["a"], "length");
  EXPECT_EQ(d.steps, 3);  // one prefill, two decodes
  expect_all_free(s);
}

TEST(Scheduler, EosAndStopTokenIdsFinishWithStop) {
  Scheduler s({4, 64, 256}, 16, 16);
  StopCriteria st = stop_after(10);
  st.stop_token_ids = {101};  // sampled at position 1 -> second output token
  s.add_request("a", prompt(1), st);
  Driver d{s};
  d.run();
  EXPECT_EQ(d.outputs["a"], (std::vector<int32_t>{100, 101}));
  EXPECT_EQ(d.finish["a"], "stop");
  expect_all_free(s);
}

// Prompt lengths at and around multiples of block_size (16) and of the chunk
// size (max_num_batched_tokens = 32).
class PromptLengths : public ::testing::TestWithParam<int32_t> {};

TEST_P(PromptLengths, ChunkedPrefillGivesSameTokensAndFreesAll) {
  const int32_t n = GetParam();
  Scheduler s({8, 32, 512}, 64, 16);
  s.add_request("a", prompt(n), stop_after(5));
  s.add_request("b", prompt(7, 30), stop_after(20));
  Driver d{s};
  d.run();
  EXPECT_EQ(d.outputs["a"], expected_output(n, 5));
  EXPECT_EQ(d.outputs["b"], expected_output(7, 20));
  EXPECT_LE(d.max_tokens_in_step, 32);
  expect_all_free(s);
}

INSTANTIATE_TEST_SUITE_P(AroundBoundaries, PromptLengths,
                         ::testing::Values(1, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65, 95,
                                           96, 97));

TEST(Scheduler, LongPromptIsChunkedAndMixedWithDecodes) {
  Scheduler s({8, 16, 512}, 64, 16);
  s.add_request("short", prompt(4), stop_after(8));
  auto first = s.schedule();
  ASSERT_EQ(first->num_seqs(), 1);
  s.update({123});
  s.add_request("long", prompt(40), stop_after(2));
  auto out = s.schedule();
  // decode of "short" first, then a 15-token chunk of "long"
  ASSERT_EQ(out->num_seqs(), 2);
  EXPECT_EQ(out->request_ids[0], "short");
  EXPECT_EQ(out->num_scheduled_tokens[0], 1);
  EXPECT_EQ(out->num_scheduled_tokens[1], 15);
  EXPECT_EQ(out->sampling_seq_indices.size(), 1u);  // the chunk does not sample
  EXPECT_EQ(build_model_input(*out).logits_indices, (std::vector<int64_t>{0}));
  s.update({124});
  Driver d{s};
  d.run();
  EXPECT_EQ(d.outputs["long"], expected_output(40, 2));
  expect_all_free(s);
}

TEST(Scheduler, MaxNumSeqsBoundsTheBatch) {
  Scheduler s({2, 256, 256}, 64, 16);
  for (int i = 0; i < 5; ++i) s.add_request("r" + std::to_string(i), prompt(3), stop_after(4));
  auto out = s.schedule();
  EXPECT_EQ(out->num_seqs(), 2);
  EXPECT_EQ(s.num_waiting(), 3);
  s.update({1, 1});
  Driver d{s};
  d.run();
  EXPECT_EQ(d.outputs.size(), 5u);
  expect_all_free(s);
}

TEST(Scheduler, PoolExhaustionPreemptsNewestThenResumes) {
  // 6 blocks of 16: three requests of 17 prompt tokens need 2 blocks each, and a
  // third block once they pass 32 tokens -> someone must be preempted.
  Scheduler s({8, 256, 512}, 6, 16);
  for (auto id : {"a", "b", "c"}) s.add_request(id, prompt(17), stop_after(30));
  Driver d{s};
  d.run();
  EXPECT_GT(s.num_preemptions(), 0);
  for (auto id : {"a", "b", "c"}) {
    EXPECT_EQ(d.outputs[id], expected_output(17, 30)) << id;
    EXPECT_EQ(d.finish[id], "length");
  }
  expect_all_free(s);
}

TEST(Scheduler, PreemptedSequenceKeepsItsTokensAndGoesToHeadOfWaiting) {
  Scheduler s({8, 256, 512}, 4, 16);
  s.add_request("old", prompt(16), stop_after(40));
  s.add_request("new", prompt(16), stop_after(40));
  Driver d{s};
  std::vector<std::string> preempted;
  while (s.has_unfinished_requests() && d.steps < 1000) {
    auto out = s.schedule();
    ++d.steps;
    for (auto& id : out->preempted_request_ids) preempted.push_back(id);
    ASSERT_EQ(out->preemption_reasons, std::vector<std::string>(out->preempted_request_ids.size(), "kv_blocks"));
    const ModelInput in = build_model_input(*out);
    std::vector<int32_t> sampled;
    for (int64_t idx : in.logits_indices) sampled.push_back(100 + static_cast<int32_t>(in.positions[idx] % 50));
    for (const auto& u : s.update(sampled)) d.outputs[u.request_id].push_back(u.token_id);
  }
  ASSERT_FALSE(preempted.empty());
  EXPECT_EQ(preempted.front(), "new");  // the newest goes first
  EXPECT_EQ(d.outputs["old"], expected_output(16, 40));
  EXPECT_EQ(d.outputs["new"], expected_output(16, 40));
  expect_all_free(s);
}

TEST(Scheduler, AbortInEveryState) {
  Scheduler s({1, 8, 512}, 16, 16);
  s.add_request("waiting", prompt(4), stop_after(5));
  EXPECT_TRUE(s.abort("waiting"));  // waiting, never scheduled
  expect_all_free(s);

  s.add_request("prefilling", prompt(20), stop_after(5));
  s.add_request("queued", prompt(4), stop_after(5));
  auto out = s.schedule();  // 8-token chunk of "prefilling"
  ASSERT_EQ(out->num_seqs(), 1);
  EXPECT_TRUE(s.abort("prefilling"));  // between schedule and update
  s.update({});
  EXPECT_EQ(s.num_running(), 0);
  EXPECT_TRUE(s.abort("queued"));
  expect_all_free(s);

  s.add_request("decoding", prompt(4), stop_after(50));
  out = s.schedule();
  s.update({100});
  out = s.schedule();
  s.update({101});
  EXPECT_TRUE(s.abort("decoding"));
  EXPECT_FALSE(s.abort("decoding"));  // already gone
  EXPECT_FALSE(s.abort("never-existed"));
  expect_all_free(s);
  EXPECT_FALSE(s.has_unfinished_requests());
}

TEST(Scheduler, RejectsRequestsThatCanNeverRun) {
  Scheduler s({4, 64, 100}, 4, 16);  // pool: 64 tokens
  EXPECT_THROW(s.add_request("empty", {}, stop_after(1)), RequestRejectedError);
  EXPECT_THROW(s.add_request("ctx", prompt(90), stop_after(11)), RequestRejectedError);
  EXPECT_THROW(s.add_request("pool", prompt(60), stop_after(5)), RequestRejectedError);
  EXPECT_THROW(s.add_request("zero", prompt(5), stop_after(0)), RequestRejectedError);
  s.add_request("ok", prompt(60), stop_after(4));  // exactly 64 tokens = 4 blocks
  EXPECT_THROW(s.add_request("ok", prompt(2), stop_after(1)), RequestRejectedError);
  Driver d{s};
  d.run();
  EXPECT_EQ(d.outputs["ok"].size(), 4u);
  expect_all_free(s);
}

TEST(Scheduler, UpdateChecksTheSampledCount) {
  Scheduler s({4, 64, 256}, 16, 16);
  s.add_request("a", prompt(3), stop_after(3));
  s.schedule();
  EXPECT_THROW(s.update({}), InvalidArgumentError);
  EXPECT_THROW(s.update({1, 2}), InvalidArgumentError);
  s.update({5});
  EXPECT_EQ(s.output_token_ids("a"), (std::vector<int32_t>{5}));
}

// update() is the one place a sequence ends: the caller's STOP wins over
// running on, STOP_IF_FINISHED turns only a length finish into stop, EOS stays
// stop whatever the caller says, and n = 2 choices each take their own flag.
TEST(Scheduler, UpdateCombinesTheCallersStopsWithTheStopCriteria) {
  Scheduler s({8, 64, 256}, 16, 16);
  StopCriteria st = stop_after(2);
  st.eos_token_ids = {0};
  s.add_request("caller", prompt(3), st);     // the caller ends it at its first token
  s.add_request("if_finished", prompt(4), st);  // STOP_IF_FINISHED at the first token: runs on
  s.add_request("eos", prompt(5), st);        // EOS with no caller flag: stop
  s.add_request("forks", prompt(6), st, "", 2);  // n = 2: only choice 1 stopped by the caller
  s.schedule();
  auto ups = s.update({7, 7, 0, 7, 7}, {CallerFinish::kStop, CallerFinish::kStopIfFinished, CallerFinish::kNone,
                                        CallerFinish::kNone, CallerFinish::kStop});
  std::map<std::string, FinishReason> got;
  for (const auto& u : ups) got[u.request_id + ":" + std::to_string(u.index)] = u.finish_reason;
  EXPECT_EQ(got["caller:0"], FinishReason::kStop);
  EXPECT_EQ(got["if_finished:0"], FinishReason::kNone);
  EXPECT_EQ(got["eos:0"], FinishReason::kStop);
  EXPECT_EQ(got["forks:0"], FinishReason::kNone);
  EXPECT_EQ(got["forks:1"], FinishReason::kStop);
  s.schedule();  // if_finished:0 and forks:0 decode their second (last) token
  EXPECT_THROW(s.update({7, 7}, {CallerFinish::kNone}), InvalidArgumentError);  // one flag per sample
  ups = s.update({7, 7}, {CallerFinish::kStopIfFinished, CallerFinish::kNone});
  ASSERT_EQ(ups.size(), 2u);
  EXPECT_EQ(ups[0].request_id, "if_finished");
  EXPECT_EQ(ups[0].finish_reason, FinishReason::kStop);  // length, with a stop string in held-back text
  EXPECT_EQ(ups[1].finish_reason, FinishReason::kLength);
  EXPECT_FALSE(s.has_unfinished_requests());
  expect_all_free(s);
}

// Each update carries the sequence itself, the one record of its tokens: it
// holds every committed output token (the forks' own), and a finished
// sequence's record stays readable after the scheduler let go of it.
TEST(Scheduler, UpdatesCarryTheSequenceRecordThatOutlivesTheScheduler) {
  Scheduler s({8, 64, 256}, 16, 16);
  s.add_request("a", prompt(3), stop_after(2), "", 2);
  s.schedule();
  auto ups = s.update({7, 8});
  ASSERT_EQ(ups.size(), 2u);
  std::shared_ptr<const Sequence> first = ups[0].sequence, second = ups[1].sequence;
  ASSERT_TRUE(first && second);
  EXPECT_NE(first, second);
  EXPECT_EQ(second->index, 1);
  EXPECT_EQ(first->output_token_ids(), (std::vector<int32_t>{7}));
  EXPECT_EQ(second->output_token_ids(), (std::vector<int32_t>{8}));
  s.schedule();
  ups = s.update({9, 10});
  EXPECT_EQ(ups[0].sequence, first);  // the same record, one token longer
  EXPECT_EQ(first->output_token_ids(), (std::vector<int32_t>{7, 9}));
  EXPECT_EQ(first->finish_reason, FinishReason::kLength);
  EXPECT_FALSE(s.has_unfinished_requests());
  EXPECT_THROW(s.output_token_ids("a", 1), UnknownRequestError);  // the scheduler let go ...
  EXPECT_EQ(second->output_token_ids(), (std::vector<int32_t>{8, 10}));  // ... the record did not go
  expect_all_free(s);
}

TEST(Scheduler, ManyRequestsUnderPressureAllFinishAndFreeEverything) {
  Scheduler s({6, 40, 512}, 12, 16);
  std::map<std::string, std::pair<int32_t, int32_t>> spec;
  for (int i = 0; i < 20; ++i) {
    const int32_t n = 1 + (i * 37) % 70, m = 1 + (i * 13) % 60;
    spec["r" + std::to_string(i)] = {n, m};
    s.add_request("r" + std::to_string(i), prompt(n), stop_after(m));
  }
  Driver d{s};
  d.run();
  for (auto& [id, nm] : spec) EXPECT_EQ(d.outputs[id], expected_output(nm.first, nm.second)) << id;
  EXPECT_GT(s.num_preemptions(), 0);
  expect_all_free(s);
}

TEST(Scheduler, BadConfigIsATypedError) {
  EXPECT_THROW(Scheduler({0, 64, 256}, 16, 16), InvalidArgumentError);
  EXPECT_THROW(Scheduler({4, 0, 256}, 16, 16), InvalidArgumentError);
  EXPECT_THROW(Scheduler({4, 64, 256}, 0, 16), BlockPoolError);
}

TEST(ModelInput, SlotMappingIsInt64FromTheBlockTable) {
  // a block id whose slots pass 2^31: no narrowing between the table and the kernel
  SchedulerOutput out;
  out.block_size = 32;
  out.request_ids = {"a"};
  out.seq_indices = {0};
  out.num_scheduled_tokens = {2};
  out.num_computed_tokens = {31};
  out.token_ids = {7, 8};
  out.block_ids = {5, 80000000};
  out.block_table_offsets = {0, 2};
  out.sampling_seq_indices = {0};
  out.num_samples = {1};
  const ModelInput in = build_model_input(out);
  EXPECT_EQ(in.slot_mapping, (std::vector<int64_t>{5 * 32 + 31, int64_t{80000000} * 32}));
  EXPECT_EQ(in.positions, (std::vector<int64_t>{31, 32}));
  EXPECT_EQ(in.input_ids, (std::vector<int64_t>{7, 8}));
  EXPECT_EQ(in.seq_lens, (std::vector<int32_t>{33}));
  EXPECT_EQ(in.logits_indices, (std::vector<int64_t>{1}));
  out.block_ids = {5};  // too few blocks for 33 tokens
  out.block_table_offsets = {0, 1};
  EXPECT_THROW(build_model_input(out), InvalidArgumentError);
  out.block_table_offsets = {0, 100000000};  // offsets past the block ids: refused, not read
  EXPECT_THROW(build_model_input(out), InvalidArgumentError);
  out.block_ids = {5, 6};
  out.block_table_offsets = {0, 2};
  out.num_computed_tokens = {-17};
  EXPECT_THROW(build_model_input(out), InvalidArgumentError);
  out.num_computed_tokens = {31};
  out.token_ids = {7};  // fewer ids than scheduled tokens
  EXPECT_THROW(build_model_input(out), InvalidArgumentError);
}
