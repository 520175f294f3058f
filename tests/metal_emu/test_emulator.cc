// Self-tests of the Metal kernel emulator (emu_runtime.h, include/metal_stdlib):
// barriers, SIMD-group collectives, the errors it reports, positions, exception
// propagation, and that real MSL syntax (kernels/emu_selftest.metal) compiles
// and runs. Kernels below are written in MSL style after <metal_stdlib>.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfenv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <math.h>  // the global C/C++ overloads must not make metal:: calls ambiguous
#include <numeric>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "emu_runtime.h"

#include <metal_stdlib>
using namespace metal;

namespace {

using metal_emu::DispatchOptions;
using metal_emu::EmulatorError;
using metal_emu::Grid;
using metal_emu::LaneOrder;
using metal_emu::ThreadPosition;

const LaneOrder kOrders[] = {LaneOrder::kForward, LaneOrder::kReverse, LaneOrder::kShuffled};

DispatchOptions with_order(LaneOrder order, uint64_t seed = 7) {
  DispatchOptions o;
  o.order = order;
  o.seed = seed;
  return o;
}

// Runs f and returns the EmulatorError's message ("" when none was thrown).
template <class F>
std::string emulator_error(F&& f) {
  try {
    f();
  } catch (const EmulatorError& e) {
    return e.what();
  }
  return "";
}

// ---------------------------------------------------------------------------
// Threadgroup reduction: every lane stores its value, (barrier), lane 0 sums.
constexpr uint kReduceThreads = 256;

template <bool kWithBarrier>
kernel void tg_reduce(device const float* in, device float* out, uint3 tgid, uint tid) {
  threadgroup float vals[kReduceThreads];
  vals[tid] = in[tgid.x * kReduceThreads + tid];
  if (kWithBarrier) threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0) {
    float s = 0.0f;
    for (uint i = 0; i < kReduceThreads; ++i) s += vals[i];
    out[tgid.x] = s;
  }
}

// Integer-valued inputs (exact float sums), different per threadgroup, so
// that reading another threadgroup's leftovers gives a wrong sum.
struct ReduceCase {
  static constexpr uint kGroups = 3;
  std::vector<float> in = std::vector<float>(kGroups * kReduceThreads);
  std::vector<float> expected = std::vector<float>(kGroups, 0.0f);
  ReduceCase() {
    for (uint g = 0; g < kGroups; ++g)
      for (uint i = 0; i < kReduceThreads; ++i) {
        in[g * kReduceThreads + i] = static_cast<float>((i * 7 + g * 13) % 23 + 1);
        expected[g] += in[g * kReduceThreads + i];
      }
  }
  template <bool kWithBarrier>
  std::vector<float> run(const DispatchOptions& options) const {
    std::vector<float> out(kGroups, -1.0f);
    metal_emu::dispatch({kGroups, 1, 1}, {kReduceThreads, 1, 1}, options, [&](const ThreadPosition& p) {
      tg_reduce<kWithBarrier>(metal_emu::to_device(in.data()), metal_emu::to_device(out.data()),
                              p.threadgroup_position_in_grid, p.thread_index_in_threadgroup);
    });
    return out;
  }
};

TEST(Barrier, ReductionIsRightUnderEveryOrder) {
  const ReduceCase c;
  for (LaneOrder order : kOrders) {
    SCOPED_TRACE(static_cast<int>(order));
    EXPECT_EQ(c.run<true>(with_order(order)), c.expected);
    const metal_emu::DispatchStats s = metal_emu::last_dispatch_stats();
    EXPECT_EQ(s.threadgroup_barriers, ReduceCase::kGroups);
    EXPECT_EQ(s.simd_collectives, 0u);
    // Two rounds per threadgroup (before and after the barrier), n + 1 switches each.
    EXPECT_EQ(s.switches, ReduceCase::kGroups * 2 * (kReduceThreads + 1));
  }
}

// The same kernel without its barrier. Forward order runs lane 0 (the
// reducer) before every other lane has stored its value: wrong sums. Reverse
// order runs lane 0 last, after all stores, so the bug goes unnoticed there;
// shuffled order catches it unless lane 0 happens to run last.
TEST(Barrier, MissingBarrierIsCaughtByForwardAndShuffledOrder) {
  const ReduceCase c;
  const std::vector<float> forward = c.run<false>(with_order(LaneOrder::kForward));
  for (uint g = 0; g < ReduceCase::kGroups; ++g) EXPECT_NE(forward[g], c.expected[g]) << "threadgroup " << g;
  EXPECT_EQ(c.run<false>(with_order(LaneOrder::kReverse)), c.expected);
  int shuffled_wrong = 0;
  for (uint64_t seed = 1; seed <= 4; ++seed) shuffled_wrong += c.run<false>(with_order(LaneOrder::kShuffled, seed)) != c.expected;
  EXPECT_GT(shuffled_wrong, 0);
  EXPECT_EQ(metal_emu::last_dispatch_stats().threadgroup_barriers, 0u);
}

TEST(Barrier, BarrierInBranchTakenByPartOfThreadgroupThrows) {
  std::vector<float> out(64);
  const std::string msg = emulator_error([&] {
    metal_emu::dispatch({2, 1, 1}, {64, 1, 1}, {}, [&](const ThreadPosition& p) {
      const uint tid = p.thread_index_in_threadgroup;
      if (tid < 40) threadgroup_barrier(mem_flags::mem_threadgroup);
      out[tid] = 1.0f;
    });
  });
  EXPECT_NE(msg.find("threadgroup_barrier reached by only part of the threadgroup"), std::string::npos) << msg;
  EXPECT_NE(msg.find("threadgroup (0, 0, 0)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("lanes 0-39 wait at threadgroup_barrier"), std::string::npos) << msg;
  EXPECT_NE(msg.find("lanes 40-63 finished the kernel"), std::string::npos) << msg;
}

TEST(Barrier, DeadlockBetweenBarrierAndCollectiveThrows) {
  const std::string msg = emulator_error([&] {
    metal_emu::dispatch({1, 1, 1}, {64, 1, 1}, {}, [&](const ThreadPosition& p) {
      if (p.thread_index_in_threadgroup < 16) {
        (void)simd_sum(1.0f);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    });
  });
  EXPECT_NE(msg.find("deadlock"), std::string::npos) << msg;
  EXPECT_NE(msg.find("lanes 0-15 wait at simd_sum<float>"), std::string::npos) << msg;
  EXPECT_NE(msg.find("lanes 16-63 wait at threadgroup_barrier"), std::string::npos) << msg;
}

TEST(Barrier, OutsideDispatchThrows) {
  EXPECT_THROW(threadgroup_barrier(mem_flags::mem_threadgroup), EmulatorError);
  EXPECT_THROW(simdgroup_barrier(mem_flags::mem_none), EmulatorError);
  EXPECT_THROW((void)simd_sum(1.0f), EmulatorError);
}

// Lanes of two SIMD groups meet at the same barrier several times; stores
// before a barrier are visible to every lane after it, in every order.
TEST(Barrier, RepeatedBarriersPublishStores) {
  for (LaneOrder order : kOrders) {
    std::vector<int> bad(96, 0);
    metal_emu::dispatch({2, 1, 1}, {96, 1, 1}, with_order(order), [&](const ThreadPosition& p) {
      threadgroup int tg[96];
      const uint tid = p.thread_index_in_threadgroup;
      for (int round = 0; round < 5; ++round) {
        tg[tid] = round * 1000 + static_cast<int>(tid);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        const uint peer = (tid * 37 + 11) % 96;
        if (tg[peer] != round * 1000 + static_cast<int>(peer)) bad[tid]++;
        threadgroup_barrier(mem_flags::mem_threadgroup);
      }
    });
    EXPECT_EQ(std::accumulate(bad.begin(), bad.end(), 0), 0) << static_cast<int>(order);
    EXPECT_EQ(metal_emu::last_dispatch_stats().threadgroup_barriers, 2u * 10u);
  }
}

// ---------------------------------------------------------------------------
// SIMD-group collectives over 48 lanes: SIMD group 0 full (32), group 1
// partial (16). Values are small integers, exact in half and bfloat.
enum Op { kSum, kMax, kMin, kXor1, kXor16, kShuffle, kBroadcast, kDown4, kUp3, kIncl, kExcl, kNumOps };
constexpr uint kCollectiveThreads = 48;

int input_value(uint tid) { return static_cast<int>((tid * 7) % 11) - 5 + static_cast<int>(tid / 32); }

template <typename T>
kernel void collectives(device T* out, uint tid, uint lane) {
  const T v = static_cast<T>(input_value(tid));
  device T* o = out + tid;
  o[kSum * kCollectiveThreads] = simd_sum(v);
  o[kMax * kCollectiveThreads] = simd_max(v);
  o[kMin * kCollectiveThreads] = simd_min(v);
  o[kXor1 * kCollectiveThreads] = simd_shuffle_xor(v, 1);
  o[kXor16 * kCollectiveThreads] = simd_shuffle_xor(v, 16);
  o[kShuffle * kCollectiveThreads] = simd_shuffle(v, static_cast<ushort>((lane * 5 + 3) % 32));
  o[kBroadcast * kCollectiveThreads] = simd_broadcast(v, 3);
  o[kDown4 * kCollectiveThreads] = simd_shuffle_down(v, 4);
  o[kUp3 * kCollectiveThreads] = simd_shuffle_up(v, 3);
  o[kIncl * kCollectiveThreads] = simd_prefix_inclusive_sum(v);
  o[kExcl * kCollectiveThreads] = simd_prefix_exclusive_sum(v);
}

constexpr int kPoison = 1 << 30;  // expected: "a lane that does not exist" (all-ones bits)

// Expected value of op at threadgroup lane tid (kPoison: all-ones bits).
int expected_collective(Op op, uint tid) {
  const uint first = tid / 32 * 32, count = std::min(32u, kCollectiveThreads - first), lane = tid - first;
  auto v = [&](uint l) { return l < count ? input_value(first + l) : kPoison; };
  int r = 0;
  switch (op) {
    case kSum:
      for (uint l = 0; l < count; ++l) r += v(l);
      return r;
    case kMax:
      r = v(0);
      for (uint l = 1; l < count; ++l) r = std::max(r, v(l));
      return r;
    case kMin:
      r = v(0);
      for (uint l = 1; l < count; ++l) r = std::min(r, v(l));
      return r;
    case kXor1: return v(lane ^ 1);
    case kXor16: return v(lane ^ 16);
    case kShuffle: return v((lane * 5 + 3) % 32);
    case kBroadcast: return v(3);
    case kDown4: return lane + 4 < 32 ? v(lane + 4) : v(lane);
    case kUp3: return lane >= 3 ? v(lane - 3) : v(lane);
    case kIncl:
      for (uint l = 0; l <= lane; ++l) r += v(l);
      return r;
    case kExcl:
      for (uint l = 0; l < lane; ++l) r += v(l);
      return r;
    case kNumOps: break;
  }
  return 0;
}

// Element types wrapped: gtest names typed tests with typeid, and libstdc++
// before GCC 13 has no type_info for _Float16 / __bf16 (a link error).
template <typename T>
struct Elem {
  using type = T;
};
template <typename E>
class SimdCollectives : public ::testing::Test {};
using CollectiveTypes = ::testing::Types<Elem<float>, Elem<half>, Elem<bfloat>, Elem<int>>;
TYPED_TEST_SUITE(SimdCollectives, CollectiveTypes);

TYPED_TEST(SimdCollectives, ValuesOverFullAndPartialSimdGroups) {
  using T = typename TypeParam::type;
  for (LaneOrder order : kOrders) {
    SCOPED_TRACE(static_cast<int>(order));
    std::vector<T> out(kNumOps * kCollectiveThreads, static_cast<T>(0));
    metal_emu::dispatch({2, 1, 1}, {kCollectiveThreads, 1, 1}, with_order(order), [&](const ThreadPosition& p) {
      collectives<T>(metal_emu::to_device(out.data()), p.thread_index_in_threadgroup, p.thread_index_in_simdgroup);
    });
    // 11 collectives per SIMD group, 2 SIMD groups, 2 threadgroups.
    EXPECT_EQ(metal_emu::last_dispatch_stats().simd_collectives, 11u * 2u * 2u);
    int poisons = 0;
    for (int op = 0; op < kNumOps; ++op) {
      for (uint tid = 0; tid < kCollectiveThreads; ++tid) {
        const T got = out[op * kCollectiveThreads + tid];
        const int want = expected_collective(static_cast<Op>(op), tid);
        if (want == kPoison) {
          ++poisons;
          if constexpr (std::is_same_v<T, int>) {
            EXPECT_EQ(got, -1) << "op " << op << " lane " << tid;
          } else {
            EXPECT_TRUE(std::isnan(static_cast<float>(got))) << "op " << op << " lane " << tid;
          }
        } else {
          EXPECT_EQ(static_cast<float>(got), static_cast<float>(want)) << "op " << op << " lane " << tid;
        }
      }
    }
    // xor 16 (16 lanes), shuffle and shuffle_down reach lanes 16-31 of the partial group.
    EXPECT_GT(poisons, 16);
  }
}

TEST(SimdCollectivesMore, VectorsBoolsAndBitwise) {
  std::vector<float4> sums(64);
  std::vector<int> all(64), any(64), ored(64), product(64), first(64);
  metal_emu::dispatch({1, 1, 1}, {64, 1, 1}, {}, [&](const ThreadPosition& p) {
    const uint tid = p.thread_index_in_threadgroup, lane = p.thread_index_in_simdgroup;
    sums[tid] = simd_sum(float4{1.0f, float(lane), -float(lane), 0.5f});
    all[tid] = simd_all(lane < 31 || tid < 32);
    any[tid] = simd_any(tid == 40);
    ored[tid] = static_cast<int>(simd_or(1u << (lane % 8)));
    product[tid] = simd_product(lane < 3 ? 2 : 1);
    first[tid] = simd_broadcast_first(static_cast<int>(tid));
  });
  for (uint tid = 0; tid < 64; ++tid) {
    EXPECT_EQ(sums[tid].x, 32.0f);
    EXPECT_EQ(sums[tid].y, 496.0f);
    EXPECT_EQ(sums[tid].z, -496.0f);
    EXPECT_EQ(sums[tid].w, 16.0f);
    EXPECT_EQ(all[tid], tid < 32 ? 1 : 0);
    EXPECT_EQ(any[tid], tid < 32 ? 0 : 1);
    EXPECT_EQ(ored[tid], 0xff);
    EXPECT_EQ(product[tid], 8);
    EXPECT_EQ(first[tid], tid < 32 ? 0 : 32);
  }
}

// simdgroup_barrier waits for the SIMD group only: SIMD group 1 runs through
// its barriers while group 0 is still before its own.
TEST(SimdCollectivesMore, SimdgroupBarrierSynchronisesOneSimdGroup) {
  for (LaneOrder order : kOrders) {
    std::vector<int> seen(64, -1);
    metal_emu::dispatch({1, 1, 1}, {64, 1, 1}, with_order(order), [&](const ThreadPosition& p) {
      threadgroup int tg[64];
      const uint tid = p.thread_index_in_threadgroup, lane = p.thread_index_in_simdgroup;
      const uint base = p.simdgroup_index_in_threadgroup * 32;
      tg[tid] = static_cast<int>(tid) + 1;
      simdgroup_barrier(mem_flags::mem_threadgroup);
      seen[tid] = tg[base + (lane + 1) % 32];
    });
    for (uint tid = 0; tid < 64; ++tid) EXPECT_EQ(seen[tid], static_cast<int>(tid / 32 * 32 + (tid % 32 + 1) % 32) + 1);
    EXPECT_EQ(metal_emu::last_dispatch_stats().simd_collectives, 2u);
    EXPECT_EQ(metal_emu::last_dispatch_stats().threadgroup_barriers, 0u);
  }
}

TEST(SimdErrors, MismatchedCollectivesThrow) {
  std::string msg = emulator_error([&] {
    metal_emu::dispatch({1, 1, 1}, {64, 1, 1}, {}, [&](const ThreadPosition& p) {
      const uint tid = p.thread_index_in_threadgroup;
      if (tid < 32) {
        (void)simd_sum(1.0f);  // SIMD group 0 agrees
      } else if (tid < 48) {
        (void)simd_sum(1.0f);
      } else {
        (void)simd_max(1.0f);
      }
    });
  });
  EXPECT_NE(msg.find("different collectives"), std::string::npos) << msg;
  EXPECT_NE(msg.find("SIMD group 1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("lanes 32-47 wait at simd_sum<float>"), std::string::npos) << msg;
  EXPECT_NE(msg.find("lanes 48-63 wait at simd_max<float>"), std::string::npos) << msg;

  // Same collective, different types.
  msg = emulator_error([&] {
    metal_emu::dispatch({1, 1, 1}, {32, 1, 1}, {}, [&](const ThreadPosition& p) {
      if (p.thread_index_in_simdgroup % 2) {
        (void)simd_sum(1.0f);
      } else {
        (void)simd_sum(1);
      }
    });
  });
  EXPECT_NE(msg.find("different collectives"), std::string::npos) << msg;
  EXPECT_NE(msg.find("simd_sum<int>"), std::string::npos) << msg;

  // A collective against a simdgroup_barrier.
  msg = emulator_error([&] {
    metal_emu::dispatch({1, 1, 1}, {32, 1, 1}, {}, [&](const ThreadPosition& p) {
      if (p.thread_index_in_simdgroup == 5) {
        simdgroup_barrier(mem_flags::mem_none);
      } else {
        (void)simd_shuffle_down(1.0f, 1);
      }
    });
  });
  EXPECT_NE(msg.find("lane 5 wait at simdgroup_barrier"), std::string::npos) << msg;
}

TEST(SimdErrors, LaneFinishingWhilePeersWaitThrows) {
  const std::string msg = emulator_error([&] {
    metal_emu::dispatch({1, 1, 1}, {48, 1, 1}, {}, [&](const ThreadPosition& p) {
      if (p.thread_index_in_threadgroup >= 40) return;  // lanes 40-47 of SIMD group 1 leave
      (void)simd_max(static_cast<int>(p.thread_index_in_threadgroup));
    });
  });
  EXPECT_NE(msg.find("SIMD group 1 (lanes 32-47)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("finished the kernel while its SIMD peers wait"), std::string::npos) << msg;
  EXPECT_NE(msg.find("lanes 40-47 finished the kernel"), std::string::npos) << msg;
}

TEST(SimdErrors, BadShuffleArgumentsThrow) {
  auto run = [](auto&& f) {
    return emulator_error([&] {
      metal_emu::dispatch({1, 1, 1}, {48, 1, 1}, {}, [&](const ThreadPosition& p) { f(p.thread_index_in_simdgroup); });
    });
  };
  EXPECT_NE(run([](uint lane) { (void)simd_broadcast(1.0f, static_cast<ushort>(lane % 2)); }).find("different lanes"),
            std::string::npos);
  EXPECT_NE(run([](uint) { (void)simd_broadcast(1.0f, 20); }).find("does not exist"), std::string::npos);
  EXPECT_NE(run([](uint lane) { (void)simd_shuffle_down(1.0f, static_cast<ushort>(lane)); }).find("different deltas"),
            std::string::npos);
  EXPECT_NE(run([](uint) { (void)simd_shuffle(1.0f, 32); }).find("not a lane"), std::string::npos);
  EXPECT_NE(run([](uint) { (void)simd_shuffle_xor(1.0f, 32); }).find("not a lane"), std::string::npos);
}

// ---------------------------------------------------------------------------
TEST(Dispatch, ThreadPositionsOver3dGridAnd3dThreadgroup) {
  const Grid grid{2, 3, 2}, tg{4, 2, 5};  // 40 lanes: SIMD groups of 32 and 8
  std::vector<ThreadPosition> seen;
  metal_emu::dispatch(grid, tg, {}, [&](const ThreadPosition& p) { seen.push_back(p); });
  ASSERT_EQ(seen.size(), 2u * 3 * 2 * 40);
  std::set<std::tuple<uint, uint, uint, uint, uint, uint>> unique;
  for (size_t k = 0; k < seen.size(); ++k) {
    const ThreadPosition& p = seen[k];
    // Threadgroups in grid order, x fastest; lanes of one threadgroup in order.
    const uint g = static_cast<uint>(k / 40), i = static_cast<uint>(k % 40);
    EXPECT_EQ(p.threadgroup_position_in_grid.x, g % 2);
    EXPECT_EQ(p.threadgroup_position_in_grid.y, g / 2 % 3);
    EXPECT_EQ(p.threadgroup_position_in_grid.z, g / 6);
    EXPECT_EQ(p.thread_index_in_threadgroup, i);
    EXPECT_EQ(p.thread_position_in_threadgroup.x, i % 4);
    EXPECT_EQ(p.thread_position_in_threadgroup.y, i / 4 % 2);
    EXPECT_EQ(p.thread_position_in_threadgroup.z, i / 8);
    EXPECT_EQ(p.thread_position_in_threadgroup.x + p.thread_position_in_threadgroup.y * 4 +
                  p.thread_position_in_threadgroup.z * 8,
              p.thread_index_in_threadgroup);
    EXPECT_EQ(p.simdgroup_index_in_threadgroup, i / 32);
    EXPECT_EQ(p.thread_index_in_simdgroup, i % 32);
    EXPECT_EQ(p.threads_per_simdgroup, 32u);
    EXPECT_EQ(p.simdgroups_per_threadgroup, 2u);
    EXPECT_TRUE(p.threadgroups_per_grid.x == 2 && p.threadgroups_per_grid.y == 3 && p.threadgroups_per_grid.z == 2);
    EXPECT_TRUE(p.threads_per_threadgroup.x == 4 && p.threads_per_threadgroup.y == 2 && p.threads_per_threadgroup.z == 5);
    EXPECT_EQ(p.thread_position_in_grid.x, p.threadgroup_position_in_grid.x * 4 + p.thread_position_in_threadgroup.x);
    EXPECT_EQ(p.thread_position_in_grid.y, p.threadgroup_position_in_grid.y * 2 + p.thread_position_in_threadgroup.y);
    EXPECT_EQ(p.thread_position_in_grid.z, p.threadgroup_position_in_grid.z * 5 + p.thread_position_in_threadgroup.z);
    unique.insert({p.threadgroup_position_in_grid.x, p.threadgroup_position_in_grid.y, p.threadgroup_position_in_grid.z,
                   p.thread_position_in_threadgroup.x, p.thread_position_in_threadgroup.y,
                   p.thread_position_in_threadgroup.z});
  }
  EXPECT_EQ(unique.size(), seen.size());
}

TEST(Dispatch, LaneOrders) {
  auto first_round = [](const DispatchOptions& o) {
    std::vector<uint> order;
    metal_emu::dispatch({1, 1, 1}, {40, 1, 1}, o, [&](const ThreadPosition& p) {
      order.push_back(p.thread_index_in_threadgroup);
      threadgroup_barrier(mem_flags::mem_none);
    });
    return order;
  };
  std::vector<uint> forward(40);
  std::iota(forward.begin(), forward.end(), 0u);
  EXPECT_EQ(first_round(with_order(LaneOrder::kForward)), forward);
  EXPECT_EQ(first_round(with_order(LaneOrder::kReverse)), std::vector<uint>(forward.rbegin(), forward.rend()));
  const std::vector<uint> s1 = first_round(with_order(LaneOrder::kShuffled, 1));
  EXPECT_EQ(first_round(with_order(LaneOrder::kShuffled, 1)), s1);  // reproducible
  EXPECT_NE(first_round(with_order(LaneOrder::kShuffled, 2)), s1);  // seeded
  EXPECT_NE(s1, forward);
  EXPECT_EQ(std::set<uint>(s1.begin(), s1.end()).size(), 40u);  // a permutation
}

// Permutations are fresh every round: lanes that meet at a barrier twice run
// in a different order after each.
TEST(Dispatch, ShuffledOrderChangesEveryRound) {
  std::vector<std::vector<uint>> rounds(3);
  metal_emu::dispatch({1, 1, 1}, {64, 1, 1}, with_order(LaneOrder::kShuffled, 3), [&](const ThreadPosition& p) {
    for (int r = 0; r < 3; ++r) {
      rounds[r].push_back(p.thread_index_in_threadgroup);
      threadgroup_barrier(mem_flags::mem_none);
    }
  });
  EXPECT_NE(rounds[0], rounds[1]);
  EXPECT_NE(rounds[1], rounds[2]);
}

TEST(Dispatch, InvalidSizesAndNestingThrow) {
  auto noop = [](const ThreadPosition&) {};
  EXPECT_THROW(metal_emu::dispatch({1, 1, 1}, {0, 1, 1}, {}, noop), EmulatorError);
  EXPECT_THROW(metal_emu::dispatch({1, 1, 1}, {1025, 1, 1}, {}, noop), EmulatorError);
  EXPECT_THROW(metal_emu::dispatch({1, 1, 1}, {32, 32, 2}, {}, noop), EmulatorError);
  EXPECT_NO_THROW(metal_emu::dispatch({1, 1, 1}, {32, 32, 1}, {}, noop));  // 1024 is the limit
  int runs = 0;
  metal_emu::dispatch({0, 4, 1}, {32, 1, 1}, {}, [&](const ThreadPosition&) { ++runs; });  // empty grid
  EXPECT_EQ(runs, 0);
  const std::string msg = emulator_error([&] {
    metal_emu::dispatch({1, 1, 1}, {2, 1, 1}, {}, [&](const ThreadPosition&) {
      metal_emu::dispatch({1, 1, 1}, {1, 1, 1}, {}, [](const ThreadPosition&) {});
    });
  });
  EXPECT_NE(msg.find("inside a kernel lane"), std::string::npos) << msg;
}

// A lane's exception propagates once the threadgroup is abandoned: the
// suspended lanes are unwound (their destructors run), later threadgroups do
// not run, and the emulator works afterwards.
TEST(Dispatch, LaneExceptionPropagatesAndEmulatorRecovers) {
  static int live = 0;
  struct Tracker {
    Tracker() { ++live; }
    ~Tracker() { --live; }
  };
  for (LaneOrder order : kOrders) {
    live = 0;
    std::vector<int> threadgroups_run(4, 0);
    try {
      metal_emu::dispatch({4, 1, 1}, {96, 1, 1}, with_order(order), [&](const ThreadPosition& p) {
        Tracker t;
        std::vector<int> heap(100, 1);  // freed by the unwinding
        threadgroups_run[p.threadgroup_position_in_grid.x] = 1;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (p.threadgroup_position_in_grid.x == 1 && p.thread_index_in_threadgroup == 37) {
          throw std::runtime_error("lane 37 gives up");
        }
        (void)simd_sum(heap[0]);
        threadgroup_barrier(mem_flags::mem_threadgroup);
      });
      ADD_FAILURE() << "no exception";
    } catch (const std::runtime_error& e) {
      EXPECT_STREQ(e.what(), "lane 37 gives up");
    }
    EXPECT_EQ(live, 0) << "suspended lanes were not unwound";
    EXPECT_EQ(threadgroups_run, (std::vector<int>{1, 1, 0, 0}));
  }
  // Usable afterwards, with barriers and collectives.
  const ReduceCase c;
  EXPECT_EQ(c.run<true>({}), c.expected);
  std::vector<float> out(64);
  metal_emu::dispatch({1, 1, 1}, {64, 1, 1}, {}, [&](const ThreadPosition& p) {
    out[p.thread_index_in_threadgroup] = simd_sum(1.0f);
  });
  EXPECT_EQ(out, std::vector<float>(64, 32.0f));
}

// EmulatorErrors abandon the threadgroup the same way.
TEST(Dispatch, EmulatorErrorUnwindsSuspendedLanes) {
  static int live = 0;
  struct Tracker {
    Tracker() { ++live; }
    ~Tracker() { --live; }
  };
  EXPECT_THROW(metal_emu::dispatch({1, 1, 1}, {64, 1, 1}, {}, [&](const ThreadPosition& p) {
    Tracker t;
    if (p.thread_index_in_threadgroup != 63) threadgroup_barrier(mem_flags::mem_threadgroup);
  }), EmulatorError);
  EXPECT_EQ(live, 0);
}

// Each fiber keeps its own floating-point control state (MXCSR for SSE
// arithmetic, the x87 control word fegetround reads): a lane that changes the
// rounding mode does not change its peers'.
TEST(Dispatch, RoundingModeIsPerLane) {
  std::vector<int> mode(64);
  std::vector<float> third(64);
  volatile float one = 1.0f, three = 3.0f;
  metal_emu::dispatch({1, 1, 1}, {64, 1, 1}, {}, [&](const ThreadPosition& p) {
    const uint tid = p.thread_index_in_threadgroup;
    if (tid == 5) std::fesetround(FE_DOWNWARD);
    threadgroup_barrier(mem_flags::mem_none);
    mode[tid] = std::fegetround();
    third[tid] = one / three;  // 0x3eaaaaab rounded to nearest, 0x3eaaaaaa downward
    if (tid == 5) std::fesetround(FE_TONEAREST);
  });
  for (uint tid = 0; tid < 64; ++tid) {
    EXPECT_EQ(mode[tid], tid == 5 ? FE_DOWNWARD : FE_TONEAREST) << tid;
    EXPECT_EQ(as_type<uint>(third[tid]), tid == 5 ? 0x3eaaaaaau : 0x3eaaaaabu) << tid;
  }
  EXPECT_EQ(std::fegetround(), FE_TONEAREST);
}

TEST(Dispatch, LargerStacks) {
  DispatchOptions o;
  o.stack_bytes = 2 << 20;
  std::vector<float> out(64);
  metal_emu::dispatch({1, 1, 1}, {64, 1, 1}, o, [&](const ThreadPosition& p) {
    volatile char big[1 << 20];  // more than the default 256 KiB
    big[0] = 1;
    big[sizeof(big) - 1] = 2;
    out[p.thread_index_in_threadgroup] = simd_sum(static_cast<float>(big[0] + big[sizeof(big) - 1]));
  });
  EXPECT_EQ(out, std::vector<float>(64, 96.0f));
}

TEST(Dispatch, ThreadgroupAtomics) {
  std::vector<uint> out(2);
  metal_emu::dispatch({2, 1, 1}, {100, 1, 1}, with_order(LaneOrder::kShuffled), [&](const ThreadPosition& p) {
    threadgroup atomic_uint counter;
    const uint tid = p.thread_index_in_threadgroup;
    if (tid == 0) atomic_store_explicit(&counter, 0u, memory_order_relaxed);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    atomic_fetch_add_explicit(&counter, tid, memory_order_relaxed);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid == 0) out[p.threadgroup_position_in_grid.x] = atomic_load_explicit(&counter, memory_order_relaxed);
  });
  EXPECT_EQ(out, (std::vector<uint>{4950, 4950}));
}

// The portable context switch (ucontext) runs the same kernels.
TEST(Dispatch, UcontextSwitchGivesTheSameResults) {
  setenv("METAL_EMU_CONTEXT_SWITCH", "ucontext", 1);
  EXPECT_STREQ(metal_emu::context_switch_kind(), "ucontext");
  const ReduceCase c;
  std::vector<float> forward;
  for (LaneOrder order : kOrders) EXPECT_EQ(c.run<true>(with_order(order)), c.expected);
  forward = c.run<false>(with_order(LaneOrder::kForward));
  std::vector<int> out(kNumOps * kCollectiveThreads);
  metal_emu::dispatch({1, 1, 1}, {kCollectiveThreads, 1, 1}, {}, [&](const ThreadPosition& p) {
    collectives<int>(metal_emu::to_device(out.data()), p.thread_index_in_threadgroup, p.thread_index_in_simdgroup);
  });
  const std::string msg = emulator_error([&] {
    metal_emu::dispatch({1, 1, 1}, {64, 1, 1}, {}, [&](const ThreadPosition& p) {
      if (p.thread_index_in_threadgroup < 40) threadgroup_barrier(mem_flags::mem_threadgroup);
    });
  });
  unsetenv("METAL_EMU_CONTEXT_SWITCH");
  EXPECT_NE(forward, c.expected);
  for (uint tid = 0; tid < kCollectiveThreads; ++tid) {
    EXPECT_EQ(out[kSum * kCollectiveThreads + tid], expected_collective(kSum, tid));
    EXPECT_EQ(out[kDown4 * kCollectiveThreads + tid],
              expected_collective(kDown4, tid) == kPoison ? -1 : expected_collective(kDown4, tid));
  }
  EXPECT_NE(msg.find("only part of the threadgroup"), std::string::npos) << msg;
}

// Fiber switch cost (printed for the record); the switch count is exact.
TEST(Dispatch, SwitchCost) {
  constexpr uint kThreads = 256, kGroups = 8, kBarriers = 200;
  for (const char* kind : {"default", "ucontext"}) {
    if (std::string(kind) == "ucontext") setenv("METAL_EMU_CONTEXT_SWITCH", "ucontext", 1);
    const auto t0 = std::chrono::steady_clock::now();
    metal_emu::dispatch({kGroups, 1, 1}, {kThreads, 1, 1}, {}, [&](const ThreadPosition&) {
      for (uint i = 0; i < kBarriers; ++i) threadgroup_barrier(mem_flags::mem_none);
    });
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const metal_emu::DispatchStats st = metal_emu::last_dispatch_stats();
    const char* what = metal_emu::context_switch_kind();
    unsetenv("METAL_EMU_CONTEXT_SWITCH");
    EXPECT_EQ(st.switches, uint64_t{kGroups} * (kBarriers + 1) * (kThreads + 1));
    EXPECT_EQ(st.threadgroup_barriers, uint64_t{kGroups} * kBarriers);
    std::printf("[ metal_emu ] %s context switch: %.1f ns per fiber switch (scheduling included, %llu switches)\n",
                what, s * 1e9 / static_cast<double>(st.switches), static_cast<unsigned long long>(st.switches));
  }
}

// ---------------------------------------------------------------------------
// The stand-in's types and math.
TEST(MetalStdlib, TypesAndMath) {
  static_assert(sizeof(half) == 2 && sizeof(bfloat) == 2 && sizeof(uint) == 4 && sizeof(ushort) == 2);
  static_assert(sizeof(float4) == 16 && sizeof(half4) == 8 && sizeof(uint3) == 16 && sizeof(ushort2) == 4);
  const float a = 1.5f, b = -2.0f;
  EXPECT_EQ(max(a, b), 1.5f);  // no ambiguity with std:: / C overloads (math.h is included)
  EXPECT_EQ(min(a, b), -2.0f);
  EXPECT_EQ(max(3, 4), 4);
  EXPECT_EQ(min(3u, 4u), 3u);
  EXPECT_EQ(fmax(a, NAN), 1.5f);
  EXPECT_EQ(max(NAN, a), 1.5f);  // MSL: fmax semantics on floats
  EXPECT_EQ(clamp(5.0f, 0.0f, 1.0f), 1.0f);
  EXPECT_EQ(abs(-3), 3);
  EXPECT_EQ(fabs(b), 2.0f);
  EXPECT_EQ(abs(b), 2.0f);
  EXPECT_FLOAT_EQ(exp(1.0f), std::exp(1.0f));
  EXPECT_FLOAT_EQ(precise::exp(1.0f), std::exp(1.0f));
  EXPECT_FLOAT_EQ(fast::exp(1.0f), std::exp(1.0f));
  EXPECT_FLOAT_EQ(exp2(3.0f), 8.0f);
  EXPECT_FLOAT_EQ(log(std::exp(2.0f)), 2.0f);
  EXPECT_FLOAT_EQ(log2(8.0f), 3.0f);
  EXPECT_FLOAT_EQ(sqrt(9.0f), 3.0f);
  EXPECT_FLOAT_EQ(rsqrt(4.0f), 0.5f);
  EXPECT_FLOAT_EQ(fma(2.0f, 3.0f, 1.0f), 7.0f);
  EXPECT_FLOAT_EQ(tanh(0.5f), std::tanh(0.5f));
  EXPECT_TRUE(isinf(-INFINITY));
  EXPECT_TRUE(isnan(NAN));
  EXPECT_FALSE(isnan(1.0f));
  EXPECT_EQ(-FLT_MAX < -1e38f, true);
  EXPECT_EQ(HUGE_VALF, INFINITY);
  // half and bfloat: computed in float, rounded back
  const half h = 1.5h;
  const bfloat bf = bfloat(1.5f);
  EXPECT_EQ(float(h), 1.5f);
  EXPECT_EQ(float(bf), 1.5f);
  EXPECT_EQ(float(exp(half(0.0f))), 1.0f);
  EXPECT_EQ(float(max(h, half(2.0f))), 2.0f);
  EXPECT_EQ(float(max(bf, bfloat(-1.0f))), 1.5f);
  EXPECT_EQ(float(sqrt(bfloat(4.0f))), 2.0f);
  EXPECT_TRUE(isinf(numeric_limits<half>::infinity()));
  EXPECT_EQ(float(numeric_limits<half>::max()), 65504.0f);
  EXPECT_EQ(float(HALF_MAX), 65504.0f);
  EXPECT_TRUE(isnan(numeric_limits<bfloat>::quiet_NaN()));
  EXPECT_EQ(numeric_limits<float>::max(), FLT_MAX);
  // vectors
  const float4 v = {1.0f, -2.0f, 3.0f, -4.0f};
  const float4 m = max(v, 0.0f);
  EXPECT_EQ(m.x + m.y + m.z + m.w, 4.0f);
  EXPECT_EQ(dot(v, v), 30.0f);
  EXPECT_EQ(abs(v).w, 4.0f);
  EXPECT_EQ(exp(float2{0.0f, 0.0f}).y, 1.0f);
  const int4 i4 = {1, 2, 3, 4};
  EXPECT_EQ(convert<float4>(i4).w, 4.0f);
  EXPECT_EQ(as_type<uint>(1.0f), 0x3f800000u);
  EXPECT_EQ(as_type<ushort>(half(1.0f)), 0x3c00);
  EXPECT_EQ((mem_flags::mem_device | mem_flags::mem_threadgroup), static_cast<mem_flags>(3));
}

}  // namespace

// ---------------------------------------------------------------------------
// kernels/emu_selftest.metal (compiled separately, as C++): its declarations.
struct SelftestArgs {
  int n;
  float bias;
};
extern constant int selftest_scale;
template <typename T>
kernel void selftest_reduce(constant SelftestArgs& args, device const T* in, device float* out, uint3 tgid,
                            uint3 threads, uint tid, uint sg, uint lane);
kernel void selftest_simd_max(device const float* in, device float* out, uint tid);

namespace {

template <typename T>
std::vector<float> run_selftest_reduce(uint threads, int n, float bias, LaneOrder order) {
  constexpr uint kGroups = 3;
  std::vector<T> in(kGroups * threads);
  for (uint i = 0; i < in.size(); ++i) in[i] = static_cast<T>(static_cast<float>(i % 9) - 3.0f);
  const SelftestArgs args{n, bias};
  std::vector<float> out(kGroups, -1.0f);
  metal_emu::dispatch({kGroups, 1, 1}, {threads, 1, 1}, with_order(order), [&](const ThreadPosition& p) {
    selftest_reduce<T>(metal_emu::to_constant(args), metal_emu::to_device(static_cast<const T*>(in.data())),
                       metal_emu::to_device(out.data()), p.threadgroup_position_in_grid, p.threads_per_threadgroup,
                       p.thread_index_in_threadgroup, p.simdgroup_index_in_threadgroup, p.thread_index_in_simdgroup);
  });
  std::vector<float> expected(kGroups, bias);
  for (uint g = 0; g < kGroups; ++g)
    for (int i = 0; i < n; ++i) expected[g] += static_cast<float>(in[g * threads + i]) * selftest_scale;
  EXPECT_EQ(out, expected);
  return out;
}

TEST(EmuSelftestKernel, MslSourceCompilesAndRuns) {
  for (LaneOrder order : kOrders) {
    selftest_scale = 3;
    run_selftest_reduce<float>(256, 200, 0.5f, order);
    run_selftest_reduce<float>(96, 96, 0.0f, order);
    selftest_scale = -2;
    run_selftest_reduce<half>(64, 50, 1.0f, order);
    run_selftest_reduce<half>(40, 40, 0.0f, order);  // partial SIMD group
  }
  std::vector<float> in(64), out(64);
  for (uint i = 0; i < 64; ++i) in[i] = static_cast<float>((i * 29) % 64);
  metal_emu::dispatch({1, 1, 1}, {64, 1, 1}, {}, [&](const ThreadPosition& p) {
    selftest_simd_max(metal_emu::to_device(static_cast<const float*>(in.data())), metal_emu::to_device(out.data()),
                      p.thread_index_in_threadgroup);
  });
  for (uint i = 0; i < 64; ++i) EXPECT_EQ(out[i], *std::max_element(in.begin() + i / 32 * 32, in.begin() + i / 32 * 32 + 32));
}

}  // namespace
