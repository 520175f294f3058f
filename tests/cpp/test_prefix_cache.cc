#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <string>

#include "core/errors.h"
#include "core/kv_cache_manager.h"
#include "core/prefix_cache.h"
#include "core/scheduler.h"
#include "core/sha256.h"

using namespace pagedserve;

namespace {

std::vector<int32_t> tokens(int32_t n, int32_t base = 100) {
  std::vector<int32_t> t(n);
  std::iota(t.begin(), t.end(), base);
  return t;
}

void expect_all_available(const KVCacheManager& kv) {
  EXPECT_EQ(kv.num_free_blocks(), kv.num_blocks());  // free + evictable == total
  for (int32_t b = 0; b < kv.num_blocks(); ++b) EXPECT_EQ(kv.block_pool().refcount(b), 0);
}

}  // namespace

TEST(Sha256, NistVectors) {
  const std::string abc = "abc", empty, two = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  EXPECT_EQ(to_hex(sha256(abc.data(), abc.size())),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(to_hex(sha256(empty.data(), 0)), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(to_hex(sha256(two.data(), two.size())),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  std::string million(1000000, 'a');
  EXPECT_EQ(to_hex(sha256(million.data(), million.size())),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(PrefixCache, HashesChainAndSeparateSalts) {
  auto t = tokens(16);
  const BlockHash a = PrefixCache::hash_block(nullptr, t.data(), 16, "");
  const BlockHash b = PrefixCache::hash_block(&a, t.data(), 16, "");
  const BlockHash c = PrefixCache::hash_block(&b, t.data(), 16, "");
  EXPECT_NE(a, b);  // same tokens, different parents
  EXPECT_NE(b, c);
  EXPECT_EQ(b, PrefixCache::hash_block(&a, t.data(), 16, ""));  // deterministic
  EXPECT_NE(a, PrefixCache::hash_block(nullptr, t.data(), 16, "tenant-1"));
  EXPECT_NE(PrefixCache::hash_block(nullptr, t.data(), 16, "tenant-1"),
            PrefixCache::hash_block(nullptr, t.data(), 16, "tenant-2"));
}

TEST(KVCacheManagerPrefix, SecondSequenceReusesFullBlocksOnly) {
  KVCacheManager kv(8, 16, true);
  auto p = tokens(40);  // 2 full blocks + 8 tokens
  EXPECT_TRUE(kv.match_prefix(p, "").block_ids.empty());
  kv.allocate(1, 40);
  kv.cache_full_blocks(1, p, 40);
  auto m = kv.match_prefix(p, "");
  ASSERT_EQ(m.block_ids.size(), 2u);
  EXPECT_EQ(m.block_ids, (std::vector<int32_t>(kv.block_table(1).block_ids().begin(),
                                               kv.block_table(1).block_ids().begin() + 2)));
  EXPECT_TRUE(kv.match_prefix(p, "other-salt").block_ids.empty());
  kv.allocate(2, 40, m);
  EXPECT_EQ(kv.block_pool().refcount(m.block_ids[0]), 2);  // shared
  EXPECT_EQ(kv.num_free_blocks(), 8 - 3 - 1);
  kv.free(1);
  kv.free(2);
  expect_all_available(kv);
  EXPECT_EQ(kv.num_evictable_blocks(), 2);  // the two cached blocks stay evictable
}

TEST(KVCacheManagerPrefix, WholePromptCachedStillComputesTheLastBlock) {
  KVCacheManager kv(8, 16, true);
  auto p = tokens(32);  // exactly 2 blocks
  kv.allocate(1, 32);
  kv.cache_full_blocks(1, p, 32);
  EXPECT_EQ(kv.match_prefix(p, "").block_ids.size(), 1u);  // at most 31 tokens may be cached
  kv.free(1);
  expect_all_available(kv);
}

TEST(KVCacheManagerPrefix, ForcedHashCollisionNeverMatchesOtherTokens) {
  KVCacheManager kv(8, 16, true);
  kv.prefix_cache().set_hash_fn([](const BlockHash*, const int32_t*, int32_t, const std::string&) {
    return BlockHash{};  // every block hashes the same
  });
  auto p = tokens(17), q = tokens(17, 500);
  kv.allocate(1, 17);
  kv.cache_full_blocks(1, p, 17);
  EXPECT_EQ(kv.match_prefix(p, "").block_ids.size(), 1u);
  EXPECT_TRUE(kv.match_prefix(q, "").block_ids.empty());  // same hash, other tokens: no hit
  kv.allocate(2, 17);
  kv.cache_full_blocks(2, q, 17);  // the hash is taken: q's block stays private
  EXPECT_TRUE(kv.match_prefix(q, "").block_ids.empty());
  kv.free(1);
  kv.free(2);
  expect_all_available(kv);
  EXPECT_EQ(kv.num_evictable_blocks(), 1);
}

TEST(KVCacheManagerPrefix, EvictionIsLeastRecentlyUsedAndRevivalSkipsEviction) {
  KVCacheManager kv(4, 16, true);
  auto a = tokens(17, 100), b = tokens(17, 200);
  kv.allocate(1, 17);
  kv.cache_full_blocks(1, a, 17);
  const int32_t a_block = kv.block_table(1).block_ids()[0];
  kv.allocate(2, 17);
  kv.cache_full_blocks(2, b, 17);
  kv.free(1);  // a's block freed first: least recently used
  kv.free(2);
  EXPECT_EQ(kv.num_evictable_blocks(), 2);
  // revive b's block: it leaves the evictable list
  auto mb = kv.match_prefix(b, "");
  ASSERT_EQ(mb.block_ids.size(), 1u);
  kv.allocate(3, 17, mb);
  EXPECT_EQ(kv.num_evictable_blocks(), 1);
  EXPECT_EQ(kv.num_evictions(), 0);
  // pressure: 2 blocks needed, 1 truly free + 1 evictable -> a's block is evicted
  EXPECT_EQ(kv.num_free_blocks(), 2);
  kv.allocate(4, 32);
  EXPECT_EQ(kv.num_evictions(), 1);
  EXPECT_TRUE(kv.match_prefix(a, "").block_ids.empty());
  EXPECT_FALSE(kv.block_table(4).block_ids().empty());
  EXPECT_NE(std::find(kv.block_table(4).block_ids().begin(), kv.block_table(4).block_ids().end(), a_block),
            kv.block_table(4).block_ids().end());
  kv.free(3);
  kv.free(4);
  expect_all_available(kv);
}

TEST(KVCacheManagerPrefix, AdmissionCountsEvictableBlocksAsAvailable) {
  KVCacheManager kv(2, 16, true);
  auto a = tokens(32);
  kv.allocate(1, 32);
  kv.cache_full_blocks(1, a, 32);
  kv.free(1);
  EXPECT_EQ(kv.num_evictable_blocks(), 2);
  EXPECT_TRUE(kv.can_allocate(32));  // both cached blocks can be evicted
  auto m = kv.match_prefix(a, "");  // 1 block (the last must be computed)
  EXPECT_TRUE(kv.can_allocate(32, m));
  EXPECT_FALSE(kv.can_allocate(33, m));
}

TEST(SchedulerPrefix, SamePromptTwiceComputesOnlyTheUncachedTail) {
  Scheduler s({4, 256, 512, true}, 32, 16);
  StopCriteria st;
  st.max_tokens = 2;
  auto p = tokens(50);
  s.add_request("a", p, st);
  auto out = s.schedule();
  EXPECT_EQ(out->num_scheduled_tokens[0], 50);
  s.update({7});
  s.update({});  // nothing scheduled
  out = s.schedule();
  s.update({8});  // "a" finished: its 3 full blocks stay cached
  s.add_request("b", p, st, "");
  out = s.schedule();
  ASSERT_EQ(out->num_seqs(), 1);
  EXPECT_EQ(out->num_computed_tokens[0], 48);
  EXPECT_EQ(out->num_scheduled_tokens[0], 2);
  auto ups = s.update({9});
  EXPECT_EQ(ups[0].num_cached_tokens, 48);
  EXPECT_EQ(s.prefix_cache_stats().hits, 48);
  EXPECT_EQ(s.prefix_cache_stats().queries, 100);
  s.add_request("c", p, st, "salted");
  out = s.schedule();
  EXPECT_EQ(out->num_computed_tokens.back(), 0);  // another salt: no hit
  s.abort("b");
  s.abort("c");
  EXPECT_EQ(s.kv_cache_manager().num_free_blocks(), s.kv_cache_manager().num_blocks());
}

TEST(SchedulerPrefix, SkipReadingPrefixCacheComputesTheWholePrompt) {
  Scheduler s({4, 256, 512, true}, 32, 16);
  StopCriteria st;
  st.max_tokens = 1;
  auto p = tokens(50);
  s.add_request("a", p, st);
  s.schedule();
  s.update({7});  // "a" finished: its 3 full blocks stay cached
  s.add_request("b", p, st, "", 1, /*skip_reading_prefix_cache=*/true);
  auto out = s.schedule();
  ASSERT_EQ(out->num_seqs(), 1);
  EXPECT_EQ(out->num_computed_tokens[0], 0);
  EXPECT_EQ(out->num_scheduled_tokens[0], 50);
  auto ups = s.update({9});
  EXPECT_EQ(ups[0].num_cached_tokens, 0);
  EXPECT_EQ(s.prefix_cache_stats().queries, 50);  // "b" never looked up
  s.add_request("c", p, st);  // an ordinary request still hits
  out = s.schedule();
  EXPECT_EQ(out->num_computed_tokens[0], 48);
}

TEST(KVCacheManagerFork, ForkSharesBlocksAndCopyOnWriteSplitsThePartialOne) {
  KVCacheManager kv(8, 16, true);
  kv.allocate(1, 20);  // blocks: one full, one with 4 tokens
  const auto parent = kv.block_table(1).block_ids();
  kv.fork(1, 2);
  EXPECT_EQ(kv.block_table(2).block_ids(), parent);
  EXPECT_EQ(kv.block_pool().refcount(parent[0]), 2);
  EXPECT_EQ(kv.block_pool().refcount(parent[1]), 2);
  ASSERT_TRUE(kv.can_append(1, 1));
  kv.append(1, 1);  // token 21 goes into the shared partial block: copy it first
  const auto copies = kv.take_pending_copies();
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].first, parent[1]);
  EXPECT_EQ(kv.block_table(1).block_ids()[1], copies[0].second);
  EXPECT_EQ(kv.block_table(1).block_ids()[0], parent[0]);  // full block stays shared
  EXPECT_EQ(kv.block_table(2).block_ids(), parent);         // the other sequence keeps its data
  EXPECT_EQ(kv.block_pool().refcount(parent[1]), 1);
  kv.append(2, 1);  // now sole owner: no copy
  EXPECT_TRUE(kv.take_pending_copies().empty());
  EXPECT_EQ(kv.num_cow_copies(), 1);
  kv.free(1);
  kv.free(2);
  expect_all_available(kv);
}

TEST(KVCacheManagerFork, ForkAtABlockBoundaryNeedsNoCopy) {
  KVCacheManager kv(8, 16, false);
  kv.allocate(1, 16);
  kv.fork(1, 2);
  kv.append(1, 1);
  kv.append(2, 1);
  EXPECT_TRUE(kv.take_pending_copies().empty());
  EXPECT_NE(kv.block_table(1).block_ids()[1], kv.block_table(2).block_ids()[1]);
  kv.free(2);
  kv.free(1);
  expect_all_available(kv);
}

TEST(SchedulerFork, ParallelSamplingForksAtTheFirstSampleAndCopiesOnWrite) {
  Scheduler s({8, 256, 512, true}, 16, 16);
  StopCriteria st;
  st.max_tokens = 3;
  s.add_request("r", tokens(20), st, "", 3);
  auto out = s.schedule();
  ASSERT_EQ(out->num_samples.size(), 1u);
  EXPECT_EQ(out->num_samples[0], 3);
  EXPECT_THROW(s.update({1}), InvalidArgumentError);
  auto ups = s.update({1, 2, 3});
  ASSERT_EQ(ups.size(), 3u);
  EXPECT_EQ(ups[1].index, 1);
  EXPECT_EQ(ups[2].token_id, 3);
  EXPECT_EQ(s.num_running(), 3);
  out = s.schedule();  // three decodes into the shared partial block: two of them copy it
  EXPECT_EQ(out->num_seqs(), 3);
  EXPECT_EQ(out->num_block_copies(), 2);
  EXPECT_EQ(out->seq_indices[2], 2);
  s.update({4, 5, 6});
  EXPECT_EQ(s.output_token_ids("r", 1), (std::vector<int32_t>{2, 5}));
  EXPECT_TRUE(s.finish_sequence("r", 1, FinishReason::kStop));
  EXPECT_EQ(s.num_running(), 2);
  EXPECT_TRUE(s.abort("r"));
  EXPECT_FALSE(s.has_unfinished_requests());
  EXPECT_EQ(s.kv_cache_manager().num_free_blocks(), s.kv_cache_manager().num_blocks());
}

// The block hash's bytes are pinned: this value is what any router computing
// PagedServe's hashes itself must get (tests/python/test_kv_events.py checks
// the same value through hashlib and _core.hash_block).
TEST(PrefixCache, BlockHashMatchesThePinnedReferenceValue) {
  const auto hex = [](const BlockHash& h) {
    static const char* d = "0123456789abcdef";
    std::string s;
    for (uint8_t b : h) s += std::string{d[b >> 4], d[b & 15]};
    return s;
  };
  const std::vector<int32_t> first = tokens(16, 0), second = tokens(16, 16);
  const BlockHash a = PrefixCache::hash_block(nullptr, first.data(), 16, "");
  EXPECT_EQ(hex(a), "5d553336f3c34e3bca69563207eca2b59250b964d8840a2c19adcf0392ead861");
  const BlockHash b = PrefixCache::hash_block(&a, second.data(), 16, "tenant-a");
  EXPECT_EQ(hex(b), "c90880cbb1459630967077500707b3ba9bfb1d852ea4c086771a9f5f512849b2");
}

TEST(KVCacheEvents, StoredForNewlyCachedBlocksRemovedOnEvictionNothingWhenOff) {
  KVCacheManager kv(4, 16, true);
  auto a = tokens(40, 100), b = tokens(33, 100);  // b shares a's first two blocks
  kv.allocate(1, 40);
  kv.cache_full_blocks(1, a, 40);
  EXPECT_TRUE(kv.take_events().empty());  // recording is off by default
  kv.free(1);
  KVCacheManager rec(4, 16, true);
  rec.set_record_events(true);
  rec.allocate(1, 40);
  rec.cache_full_blocks(1, a, 20);  // one full block computed so far
  rec.cache_full_blocks(1, a, 40);  // the second
  std::vector<KVCacheEvent> ev = rec.take_events();
  ASSERT_EQ(ev.size(), 2u);
  const BlockHash h0 = PrefixCache::hash_block(nullptr, a.data(), 16, "");
  const BlockHash h1 = PrefixCache::hash_block(&h0, a.data() + 16, 16, "");
  EXPECT_EQ(ev[0].type, KVEventType::kBlockStored);
  EXPECT_EQ(ev[0].block_hashes, std::vector<BlockHash>{h0});
  EXPECT_FALSE(ev[0].has_parent);
  EXPECT_EQ(ev[0].token_ids, std::vector<int32_t>(a.begin(), a.begin() + 16));
  EXPECT_EQ(ev[0].block_size, 16);
  EXPECT_EQ(ev[1].block_hashes, std::vector<BlockHash>{h1});
  EXPECT_TRUE(ev[1].has_parent);
  EXPECT_EQ(ev[1].parent_block_hash, h0);
  EXPECT_EQ(ev[1].token_ids, std::vector<int32_t>(a.begin() + 16, a.begin() + 32));
  EXPECT_TRUE(rec.take_events().empty());  // taken: cleared
  // b's first two blocks are already cached (a hit, or a duplicate insert): no event for them
  auto mb = rec.match_prefix(b, "");
  rec.allocate(2, 33, mb);
  rec.cache_full_blocks(2, b, 33);
  EXPECT_TRUE(rec.take_events().empty());
  rec.free(1);
  rec.free(2);
  // 4 blocks needed: the two cached ones (h1 freed first... either order) are evicted, in one event
  rec.allocate(3, 64);
  ev = rec.take_events();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].type, KVEventType::kBlockRemoved);
  std::vector<BlockHash> removed = ev[0].block_hashes;
  std::sort(removed.begin(), removed.end());
  std::vector<BlockHash> want{h0, h1};
  std::sort(want.begin(), want.end());
  EXPECT_EQ(removed, want);
  EXPECT_EQ(std::string(kv_event_type_str(KVEventType::kAllBlocksCleared)), "AllBlocksCleared");
}
