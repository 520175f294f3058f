// Speculative decoding in the scheduler (Scheduler::add_draft_tokens /
// accept_draft_tokens): drafts are computed with the last token, the verified
// prefix is kept, rejected slots and blocks are given back, nothing unverified
// reaches the prefix cache, and greedy outputs equal those without drafts.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "core/errors.h"
#include "core/model_input.h"
#include "core/scheduler.h"
#include "scheduler_requests.h"

using namespace pagedserve;
using namespace pagedserve::test_support;

namespace {

constexpr int32_t kBlock = 16;

// The fake model: the token it predicts after the input token at position p.
int32_t target(int32_t p) { return 100 + p % 50; }

SchedulerConfig config(int32_t max_num_batched_tokens = 256) {
  SchedulerConfig c;
  c.max_num_seqs = 8;
  c.max_num_batched_tokens = max_num_batched_tokens;
  c.max_model_len = 512;
  return c;
}

}  // namespace

TEST(SpeculativeScheduling, DraftsAreComputedWithTheLastTokenAndTheVerifiedPrefixKept) {
  Scheduler s(config(), 64, kBlock);
  s.add_request("a", prompt(20), stop_after(30));
  auto out = s.schedule();
  ASSERT_EQ(out->num_scheduled_tokens[0], 20);
  EXPECT_EQ(out->num_draft_tokens[0], 0);
  s.update({500});
  EXPECT_EQ(s.add_draft_tokens("a", 0, {501, 502, 503}), 3);
  EXPECT_EQ(s.add_draft_tokens("a", 0, {9}), 0);  // one set of drafts at a time
  out = s.schedule();
  ASSERT_EQ(out->num_seqs(), 1);
  EXPECT_EQ(out->num_scheduled_tokens[0], 4);
  EXPECT_EQ(out->num_computed_tokens[0], 20);
  EXPECT_EQ(out->num_draft_tokens[0], 3);
  EXPECT_EQ(std::vector<int32_t>(out->token_ids.begin(), out->token_ids.end()),
            (std::vector<int32_t>{500, 501, 502, 503}));
  ASSERT_EQ(out->sampling_seq_indices.size(), 1u);
  EXPECT_EQ(out->num_samples[0], 1);
  EXPECT_EQ(s.kv_cache_manager().num_tokens(0), 24);
  s.accept_draft_tokens("a", 0, 1);
  EXPECT_EQ(s.kv_cache_manager().num_tokens(0), 22);  // the two rejected slots given back
  const auto ups = s.update({777});
  ASSERT_EQ(ups.size(), 1u);
  EXPECT_EQ(ups[0].token_id, 777);
  EXPECT_EQ(s.output_token_ids("a"), (std::vector<int32_t>{500, 501, 777}));
  EXPECT_EQ(s.num_draft_tokens(), 3);
  EXPECT_EQ(s.num_accepted_tokens(), 1);
  out = s.schedule();  // a plain decode of the sampled token after the kept ones
  EXPECT_EQ(out->num_computed_tokens[0], 22);
  EXPECT_EQ(out->num_scheduled_tokens[0], 1);
  EXPECT_EQ(out->token_ids[0], 777);
  EXPECT_THROW(s.accept_draft_tokens("a", 0, 0), InvalidArgumentError);  // no drafts this step
  EXPECT_THROW(s.add_draft_tokens("nope", 0, {1}), UnknownRequestError);
  s.update({778});
  s.abort("a");
  EXPECT_EQ(s.kv_cache_manager().num_free_blocks(), 64);
}

TEST(SpeculativeScheduling, DraftsOnlyForADecodeAndWithinMaxTokensAndTheBudget) {
  Scheduler s(config(/*max_num_batched_tokens=*/8), 64, kBlock);
  s.add_request("a", prompt(20), stop_after(4));
  EXPECT_EQ(s.add_draft_tokens("a", 0, {1, 2}), 0);  // waiting: nothing to draft after
  s.schedule();  // the first 8 of the prompt
  EXPECT_EQ(s.add_draft_tokens("a", 0, {1, 2}), 0);  // prefilling
  s.update({});
  s.schedule();
  s.update({});
  s.schedule();
  s.update({500});
  // max_tokens 4 with 1 output: at most 2 drafts (the sampled token after them is the 4th)
  EXPECT_EQ(s.add_draft_tokens("a", 0, {501, 502, 503, 504}), 2);
  auto out = s.schedule();
  EXPECT_EQ(out->num_draft_tokens[0], 2);
  EXPECT_EQ(s.output_token_ids("a"), (std::vector<int32_t>{500}));  // drafts are not output
  s.accept_draft_tokens("a", 0, 2);
  const auto ups = s.update({600});
  ASSERT_EQ(ups.size(), 1u);
  EXPECT_EQ(ups[0].finish_reason, FinishReason::kLength);  // 500, 501, 502, 600: max_tokens
  EXPECT_FALSE(s.has_unfinished_requests());
  EXPECT_EQ(s.num_accepted_tokens(), 2);

  // update() without accept_draft_tokens: the drafts are unverified, so none is kept
  Scheduler u(config(), 64, kBlock);
  u.add_request("a", prompt(20), stop_after(10));
  u.schedule();
  u.update({500});
  ASSERT_EQ(u.add_draft_tokens("a", 0, {501, 502}), 2);
  u.schedule();
  u.update({600});
  EXPECT_EQ(u.output_token_ids("a"), (std::vector<int32_t>{500, 600}));
  EXPECT_EQ(u.kv_cache_manager().num_tokens(0), 21);  // the drafts' slots given back
  EXPECT_EQ(u.num_draft_tokens(), 2);
  EXPECT_EQ(u.num_accepted_tokens(), 0);

  // the budget: 8 tokens a step, another sequence's prefill chunk first in the queue takes 6 of them
  Scheduler t(config(8), 64, kBlock);
  t.add_request("a", prompt(4), stop_after(50));
  t.schedule();
  t.update({500});
  t.add_request("b", prompt(30, 20), stop_after(5));
  auto o = t.schedule();  // a's decode (1) + b's first chunk (7)
  t.update({501});
  EXPECT_EQ(t.add_draft_tokens("a", 0, {1, 2, 3, 4, 5, 6, 7, 8}), 8);
  o = t.schedule();  // real tokens first: a's 1 and b's next 7-token chunk use the budget, a's drafts are dropped
  ASSERT_EQ(o->num_seqs(), 2);
  EXPECT_EQ(o->num_scheduled_tokens[0], 1);
  EXPECT_EQ(o->num_draft_tokens[0], 0);
  EXPECT_EQ(o->num_scheduled_tokens[1], 7);
  t.update({502});
  EXPECT_EQ(t.output_token_ids("a"), (std::vector<int32_t>{500, 501, 502}));
  EXPECT_EQ(t.add_draft_tokens("a", 0, {1, 2, 3, 4, 5, 6, 7, 8}), 8);
  o = t.schedule();  // b's 16 remaining prompt tokens: 7 of them; then nothing left for drafts again
  EXPECT_EQ(o->num_draft_tokens[0], 0);
  t.update({503});
  for (int i = 0; i < 3; ++i) {  // b's prefill done (its first token), then both decode: drafts fit from now on
    const auto step = t.schedule();
    t.update(std::vector<int32_t>(step->sampling_seq_indices.size(), 504 + i));
  }
  EXPECT_EQ(t.add_draft_tokens("a", 0, {1, 2, 3}), 3);
  o = t.schedule();
  EXPECT_EQ(o->num_draft_tokens[0], 3);
  EXPECT_EQ(o->num_scheduled_tokens[0], 4);
}

TEST(SpeculativeScheduling, RejectedDraftsGiveTheirBlocksBackAndNeverReachThePrefixCache) {
  Scheduler s(config(), 16, kBlock);
  s.add_request("a", prompt(14), stop_after(40));
  s.schedule();
  s.update({500});  // 15 tokens, 14 computed
  const int32_t free_before = s.kv_cache_manager().num_free_blocks();
  // drafts 501..520 reach into the next two blocks
  std::vector<int32_t> draft;
  for (int32_t i = 0; i < 20; ++i) draft.push_back(501 + i);
  ASSERT_EQ(s.add_draft_tokens("a", 0, draft), 20);
  auto out = s.schedule();
  EXPECT_EQ(out->num_scheduled_tokens[0], 21);
  EXPECT_EQ(s.kv_cache_manager().num_free_blocks(), free_before - 2);
  s.accept_draft_tokens("a", 0, 0);
  EXPECT_EQ(s.kv_cache_manager().num_free_blocks(), free_before);  // both blocks given back
  s.update({600});  // block 0 now holds prompt(14), 500 and (to be computed) 600
  out = s.schedule();
  ASSERT_EQ(out->token_ids[0], 600);
  s.update({601});  // 600's K/V computed: block 0 full and cached with 500, 600 in it
  // a prompt that follows the rejected draft (501 at position 15) must not hit block 0; the verified one does
  std::vector<int32_t> wrong = prompt(14);
  wrong.insert(wrong.end(), {500, 501, 502, 503});
  std::vector<int32_t> right = prompt(14);
  right.insert(right.end(), {500, 600, 601, 7});
  s.add_request("wrong", wrong, stop_after(1));
  s.schedule();
  EXPECT_EQ(s.prefix_cache_stats().hits, 0);
  s.update({1, 1});
  s.add_request("right", right, stop_after(1));
  s.schedule();
  EXPECT_EQ(s.prefix_cache_stats().hits, kBlock);
}

TEST(SpeculativeScheduling, DraftsWithoutBlocksGoBeforeAnyPreemptionAndAPreemptedSequenceLosesItsDrafts) {
  // 4 blocks of 16: a holds 2 (28 tokens), b holds 2; a's drafts need a third block: dropped, no preemption
  Scheduler s(config(), 4, kBlock);
  s.add_request("a", prompt(28), stop_after(12));
  s.add_request("b", prompt(20, 30), stop_after(12));
  s.schedule();
  s.update({500, 500});
  ASSERT_EQ(s.add_draft_tokens("a", 0, std::vector<int32_t>(16, 7)), 10);  // max_tokens 12 - 1 output - 1
  auto out = s.schedule();
  EXPECT_TRUE(out->preempted_request_ids.empty());
  EXPECT_EQ(out->num_draft_tokens[0], 0);
  EXPECT_EQ(out->num_scheduled_tokens[0], 1);
  s.update({501, 501});
  EXPECT_EQ(s.output_token_ids("a"), (std::vector<int32_t>{500, 501}));

  // another sequence's real token comes before a's drafts: a (16 tokens, 15 computed, 1 block), b (33 tokens,
  // 2 blocks), 1 block free; a's drafts would need it, b's next token needs it: b gets it, nobody is preempted
  Scheduler v(config(), 4, kBlock);
  v.add_request("a", prompt(15), stop_after(12));
  v.add_request("b", prompt(32, 30), stop_after(12));
  v.schedule();
  v.update({500, 500});
  ASSERT_EQ(v.add_draft_tokens("a", 0, {7, 8, 9, 10}), 4);
  out = v.schedule();
  EXPECT_TRUE(out->preempted_request_ids.empty());
  ASSERT_EQ(out->num_seqs(), 2);
  EXPECT_EQ(out->num_draft_tokens[0], 0);
  EXPECT_EQ(out->num_scheduled_tokens[1], 1);
  EXPECT_EQ(v.kv_cache_manager().num_free_blocks(), 0);

  // a sequence preempted with drafts loses them: only verified tokens are recomputed on resume
  Scheduler t(config(), 4, kBlock);
  t.add_request("a", prompt(32), stop_after(12));
  t.add_request("b", prompt(20, 30), stop_after(12));
  t.schedule();
  t.update({500, 500});  // a: 33 tokens, its next one needs a third block; b: 21 in 2 blocks
  ASSERT_EQ(t.add_draft_tokens("b", 0, {7, 8}), 2);
  out = t.schedule();
  ASSERT_EQ(out->preempted_request_ids, (std::vector<std::string>{"b"}));
  EXPECT_EQ(t.output_token_ids("b"), (std::vector<int32_t>{500}));
}

// Runs 6 requests to idle through a pool small enough to preempt, with the fake
// model; with `speculate`, every decode first gets drafts: the model's next
// tokens for a varying number r in [0, 4], then one it never predicts.
// Verification accepts the leading drafts equal to the model's prediction at
// their position (greedy acceptance) and samples the model's token after them,
// as the engine does. Returns each request's output and the preemption count.
std::pair<std::map<std::string, std::vector<int32_t>>, int64_t> run_fake_model(bool speculate) {
  Scheduler s(config(48), 12, kBlock);
  std::map<int, int32_t> prompt_len;
  for (int i = 0; i < 6; ++i) {
    prompt_len[i] = 10 + 7 * i;
    s.add_request("r" + std::to_string(i), prompt(prompt_len[i], i), stop_after(25 + 3 * i));
  }
  std::map<std::string, std::vector<int32_t>> emitted;
  for (int step = 0; s.has_unfinished_requests() && step < 5000; ++step) {
    if (speculate) {
      for (auto& [rid, toks] : emitted) {
        if (toks.empty()) continue;
        const int32_t idx = std::stoi(rid.substr(1)), r = (step * 7 + idx) % 5;
        const int32_t pos = prompt_len[idx] + static_cast<int32_t>(toks.size()) - 1;  // the last output token's
        std::vector<int32_t> d;
        for (int32_t j = 0; j < r; ++j) d.push_back(target(pos + j));
        d.push_back(1);
        try {
          s.add_draft_tokens(rid, 0, d);
        } catch (const UnknownRequestError&) {  // finished
        }
      }
    }
    auto out = s.schedule();
    const ModelInput in = build_model_input(*out);
    std::vector<int32_t> sampled;
    std::map<std::string, std::vector<int32_t>> kept;
    size_t si = 0;
    for (int32_t b = 0; b < out->num_seqs(); ++b) {
      const bool samples = si < out->sampling_seq_indices.size() && out->sampling_seq_indices[si] == b;
      EXPECT_TRUE(samples || out->num_draft_tokens[b] == 0);
      if (!samples) continue;
      ++si;
      const int32_t q1 = in.query_start_loc[b + 1], drafts = out->num_draft_tokens[b];
      const int32_t first = q1 - drafts - 1;  // the last verified token, then the drafts
      int32_t accepted = 0;
      while (accepted < drafts &&
             out->token_ids[first + 1 + accepted] == target(static_cast<int32_t>(in.positions[first + accepted]))) {
        kept[out->request_ids[b]].push_back(out->token_ids[first + 1 + accepted]);
        ++accepted;
      }
      if (drafts > 0) s.accept_draft_tokens(out->request_ids[b], out->seq_indices[b], accepted);
      sampled.push_back(target(static_cast<int32_t>(in.positions[first + accepted])));
    }
    for (const auto& u : s.update(sampled)) {
      auto& toks = emitted[u.request_id];
      const auto& k = kept[u.request_id];
      toks.insert(toks.end(), k.begin(), k.end());
      toks.push_back(u.token_id);
    }
  }
  EXPECT_FALSE(s.has_unfinished_requests());
  EXPECT_EQ(s.kv_cache_manager().num_free_blocks(), 12);
  if (speculate) {
    EXPECT_GT(s.num_accepted_tokens(), 0);
    EXPECT_LT(s.num_accepted_tokens(), s.num_draft_tokens());
  }
  return {emitted, s.num_preemptions()};
}

TEST(SpeculativeScheduling, GreedyOutputsEqualThoseWithoutDrafts) {
  const auto plain = run_fake_model(false), spec = run_fake_model(true);
  EXPECT_GT(plain.second, 0);  // the pool is small enough to preempt
  EXPECT_GT(spec.second, 0);
  ASSERT_EQ(plain.first.size(), 6u);
  for (const auto& [rid, toks] : plain.first) {
    EXPECT_EQ(toks.size(), static_cast<size_t>(25 + 3 * std::stoi(rid.substr(1)))) << rid;
    EXPECT_EQ(spec.first.at(rid), toks) << rid;
  }
}
