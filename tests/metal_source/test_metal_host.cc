// The Metal backend's plain C++ on any platform: the embedded kernel source
// lists every kernel the host dispatches, the library search order, and the
// host code (KV store, staging, plans, dispatch lists) end to end through a
// recording device that checks each binding against the kernel contract and
// executes that contract in float32 (recording_device.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backends/metal/metal_attention.h"
#include "backends/metal/metal_kernels.h"
#include "backends/metal/metal_library.h"
#include "backends/metal/metal_source.h"
#include "core/errors.h"
#include "recording_device.h"

namespace pagedserve {
namespace metal {
namespace {

using testing::RecordingDevice;

// ---- the embedded source ----------------------------------------------------------------------
TEST(MetalEmbeddedSource, ListsEveryKernelTheHostDispatches) {
  const std::string source = kMetalKernelSource;
  ASSERT_FALSE(source.empty()) << "no metal/*.metal kernel file was found when the source was embedded: "
                                  "reshape_and_cache.metal, paged_attention_decode.metal, "
                                  "paged_attention_merge.metal and paged_attention_prefill.metal are missing";
  std::vector<std::string> names(kMetalKernelNames, kMetalKernelNames + kNumMetalKernelNames);
  EXPECT_EQ(kMetalKernelNames[kNumMetalKernelNames], nullptr);
  std::vector<std::string> missing;
  for (const std::string& name : metal_dispatched_host_names()) {
    if (std::find(names.begin(), names.end(), name) == names.end()) missing.push_back(name);
  }
  std::string list;
  for (const std::string& m : missing) list += " " + m;
  EXPECT_TRUE(missing.empty()) << "the host dispatches kernels the embedded source does not instantiate "
                                  "(template [[host_name(\"...\")]]):"
                               << list << "\nembedded files: " << kMetalSourceFiles;
  EXPECT_EQ(metal_dispatched_host_names().size(), 12u);
}

TEST(MetalEmbeddedSource, InlinesTheLocalHeadersOnceInAFixedOrder) {
  const std::string source = kMetalKernelSource;
  ASSERT_FALSE(source.empty()) << "no metal/*.metal kernel file was found when the source was embedded";
  size_t count = 0;
  for (size_t at = source.find("struct PagedAttentionArgs {"); at != std::string::npos;
       at = source.find("struct PagedAttentionArgs {", at + 1)) {
    ++count;
  }
  EXPECT_EQ(count, 1u) << "pagedserve_args.h must be inlined exactly once";
  EXPECT_EQ(source.find("#include \""), std::string::npos) << "a local include was left in the embedded source";
  EXPECT_EQ(source.find("#pragma once"), std::string::npos);
  const std::string files = kMetalSourceFiles;
  EXPECT_EQ(files.rfind("reshape_and_cache.metal paged_attention_decode.metal paged_attention_merge.metal "
                        "paged_attention_prefill.metal",
                        0),
            0u)
      << files;
}

TEST(MetalKernelNames, HostNamesAndDTypes) {
  EXPECT_EQ(metal_kernel_host_name(MetalKernel::kPagedAttentionDecode, DType::kBFloat16),
            "paged_attention_decode_bfloat");
  EXPECT_EQ(metal_kernel_host_name(MetalKernel::kReshapeAndCache, DType::kFloat16), "reshape_and_cache_half");
  EXPECT_EQ(metal_kernel_host_name(MetalKernel::kPagedAttentionMerge, DType::kFloat32), "paged_attention_merge_float");
  EXPECT_THROW(metal_kernel_host_name(MetalKernel::kPagedAttentionPrefill, DType::kInt32), KernelArgumentError);
}

// ---- the library search order -------------------------------------------------------------------
TEST(MetalLibrarySearch, OrderAndOverrides) {
  const std::vector<std::string> dirs = {"/a", "/b"};
  auto c = library_candidates(nullptr, nullptr, dirs);
  ASSERT_EQ(c.size(), 3u);
  EXPECT_EQ(c[0].path, "/a/pagedserve.metallib");
  EXPECT_EQ(c[1].path, "/b/pagedserve.metallib");
  EXPECT_EQ(c[2].kind, LibraryCandidate::Kind::kEmbeddedSource);
  EXPECT_FALSE(c[0].required || c[1].required || c[2].required);

  c = library_candidates("/x/my.metallib", "", dirs);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_TRUE(c[0].required);
  EXPECT_EQ(c[0].path, "/x/my.metallib");
  EXPECT_NE(c[0].describe().find("PAGEDSERVE_METALLIB"), std::string::npos);

  c = library_candidates(nullptr, "1", dirs);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].kind, LibraryCandidate::Kind::kEmbeddedSource);
  EXPECT_TRUE(c[0].required);
  EXPECT_EQ(library_candidates("", "0", dirs).size(), 3u);

  EXPECT_THROW(library_candidates("/x/my.metallib", "1", dirs), InvalidArgumentError);
  EXPECT_THROW(library_candidates(nullptr, "yes", dirs), InvalidArgumentError);
  EXPECT_EQ(library_candidates(nullptr, nullptr, {"/a", "/a"}).size(), 2u);

  const std::string msg = library_failure_message({{c[0], "compiling it failed: boom"}});
  EXPECT_NE(msg.find("embedded source"), std::string::npos);
  EXPECT_NE(msg.find("boom"), std::string::npos);
}

TEST(MetalLibrarySearch, ModuleDirectoriesNameThisBinary) {
  const std::vector<std::string> dirs = module_directories();
#if defined(PAGEDSERVE_STATIC_EXECUTABLES)
  if (dirs.empty()) GTEST_SKIP() << "a statically linked test binary (the arm64 cross build) has no module for dladdr";
#endif
  ASSERT_FALSE(dirs.empty());
  EXPECT_FALSE(dirs[0].empty());
}

// ---- the host code, through the recording device ------------------------------------------------
TensorArg tensor(void* data, DType dtype, std::vector<int64_t> shape, std::vector<int64_t> strides = {},
                 const char* name = "t") {
  TensorArg t;
  t.data = data;
  t.dtype = dtype;
  t.shape = std::move(shape);
  if (strides.empty()) {
    strides.assign(t.shape.size(), 1);
    for (size_t i = t.shape.size(); i-- > 1;) strides[i - 1] = strides[i] * t.shape[i];
  }
  t.strides = std::move(strides);
  t.name = name;
  return t;
}

struct Case {
  int64_t h, hkv, d, block_size;
  std::vector<int> q_lens, seq_lens;
  bool causal = true;
};

// A store written through reshape_and_cache (the device executes it), metadata
// with shuffled block tables, and a dense reference.
struct Fixture {
  std::shared_ptr<RecordingDevice> device = std::make_shared<RecordingDevice>();
  MetalAttentionConfig config;
  std::unique_ptr<MetalAttention> attn;
  std::shared_ptr<DeviceBuffer> store;
  int num_layers = 2;
  std::vector<int32_t> qsl, lens, tables;
  int64_t max_blocks = 0;
  std::vector<std::vector<float>> keys, values;  // per sequence [n, Hkv, D]
  std::vector<float> query;                      // [H, T, D] (so [T, H, D] is a strided view)
  Case c;

  explicit Fixture(const Case& cs, int layer = 1, uint32_t seed = 1) : c(cs) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    int64_t blocks = 0;
    for (int n : c.seq_lens) {
      const int64_t b = (n + c.block_size - 1) / c.block_size;
      max_blocks = std::max(max_blocks, b);
      blocks += b;
    }
    config = MetalAttentionConfig{c.h, c.hkv, c.d, c.block_size, blocks + 3, DType::kFloat32};
    attn = std::make_unique<MetalAttention>(device, config);
    store = attn->allocate_kv_store(num_layers);
    std::vector<int32_t> perm(static_cast<size_t>(config.num_blocks));
    for (size_t i = 0; i < perm.size(); ++i) perm[i] = static_cast<int32_t>(i);
    std::shuffle(perm.begin(), perm.end(), rng);
    tables.assign(c.seq_lens.size() * static_cast<size_t>(max_blocks), -1);
    qsl.push_back(0);
    std::vector<int64_t> slots;
    std::vector<float> all_k, all_v;
    size_t next = 0;
    for (size_t s = 0; s < c.seq_lens.size(); ++s) {
      const int n = c.seq_lens[s];
      for (int64_t b = 0; b < (n + c.block_size - 1) / c.block_size; ++b) tables[s * max_blocks + b] = perm[next++];
      std::vector<float> k(static_cast<size_t>(n * c.hkv * c.d)), v(k.size());
      for (float& x : k) x = normal(rng);
      for (float& x : v) x = normal(rng);
      for (int p = 0; p < n; ++p) {
        slots.push_back(static_cast<int64_t>(tables[s * max_blocks + p / c.block_size]) * c.block_size +
                        p % c.block_size);
      }
      all_k.insert(all_k.end(), k.begin(), k.end());
      all_v.insert(all_v.end(), v.begin(), v.end());
      keys.push_back(std::move(k));
      values.push_back(std::move(v));
      lens.push_back(n);
      qsl.push_back(qsl.back() + c.q_lens[s]);
    }
    const int64_t total = static_cast<int64_t>(slots.size());
    auto [kc, vc] = caches(layer);
    attn->reshape_and_cache(tensor(all_k.data(), DType::kFloat32, {total, c.hkv, c.d}, {}, "key"),
                            tensor(all_v.data(), DType::kFloat32, {total, c.hkv, c.d}, {}, "value"), kc, vc,
                            tensor(slots.data(), DType::kInt64, {total}, {}, "slot_mapping"));
    query.resize(static_cast<size_t>(qsl.back() * c.h * c.d));
    for (float& x : query) x = normal(rng);
  }

  int64_t tokens() const { return qsl.back(); }
  std::pair<TensorArg, TensorArg> caches(int layer) {
    const int64_t per = config.num_blocks * c.hkv * c.block_size * c.d;
    auto* base = static_cast<float*>(store->contents()) + layer * 2 * per;
    const std::vector<int64_t> shape = {config.num_blocks, c.hkv, c.block_size, c.d};
    return {tensor(base, DType::kFloat32, shape, {}, "k_cache"),
            tensor(base + per, DType::kFloat32, shape, {}, "v_cache")};
  }
  std::shared_ptr<MetalStepPlan> plan(SplitKv split = SplitKv::kAuto, int32_t partition = 512) {
    MetalPlanOptions o;
    o.split = split;
    o.partition_size = partition;
    const int64_t b = static_cast<int64_t>(lens.size());
    return std::make_shared<MetalStepPlan>(config, tensor(qsl.data(), DType::kInt32, {b + 1}),
                                           tensor(lens.data(), DType::kInt32, {b}),
                                           tensor(tables.data(), DType::kInt32, {b, max_blocks}), c.causal, o);
  }
  // query as a [T, H, D] view of [H, T, D] memory (the model's transposed layout)
  TensorArg query_view() {
    return tensor(query.data(), DType::kFloat32, {tokens(), c.h, c.d}, {c.d, tokens() * c.d, 1}, "query");
  }
  float q_at(int64_t t, int64_t h, int64_t i) const { return query[(h * tokens() + t) * c.d + i]; }

  std::vector<float> reference(float scale) const {
    std::vector<float> out(static_cast<size_t>(tokens() * c.h * c.d), 0.f);
    const int64_t group = c.h / c.hkv;
    for (size_t s = 0; s < lens.size(); ++s) {
      const int64_t n = lens[s], q_len = qsl[s + 1] - qsl[s];
      for (int64_t qi = 0; qi < q_len; ++qi) {
        const int64_t t = qsl[s] + qi, pos = n - q_len + qi, visible = c.causal ? pos + 1 : n;
        for (int64_t h = 0; h < c.h; ++h) {
          const int64_t kvh = h / group;
          std::vector<double> sc(static_cast<size_t>(visible));
          double m = -1e300;
          for (int64_t k = 0; k < visible; ++k) {
            double dot = 0;
            for (int64_t i = 0; i < c.d; ++i) dot += q_at(t, h, i) * keys[s][(k * c.hkv + kvh) * c.d + i];
            sc[k] = dot * scale;
            m = std::max(m, sc[k]);
          }
          double l = 0;
          std::vector<double> o(static_cast<size_t>(c.d), 0.0);
          for (int64_t k = 0; k < visible; ++k) {
            const double p = std::exp(sc[k] - m);
            l += p;
            for (int64_t i = 0; i < c.d; ++i) o[i] += p * values[s][(k * c.hkv + kvh) * c.d + i];
          }
          for (int64_t i = 0; i < c.d; ++i) out[(t * c.h + h) * c.d + i] = static_cast<float>(o[i] / l);
        }
      }
    }
    return out;
  }

  std::vector<float> run(const MetalStepPlan& plan, float scale, int layer = 1) {
    std::vector<float> out(static_cast<size_t>(tokens() * c.h * c.d), -7.f);
    auto [kc, vc] = caches(layer);
    attn->paged_attention(tensor(out.data(), DType::kFloat32, {tokens(), c.h, c.d}, {}, "out"), query_view(), kc, vc,
                          plan, scale);
    return out;
  }
};

void expect_close(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], 1e-4f + 1e-4f * std::fabs(want[i])) << "element " << i;
  }
}

const Case kMixed{8, 2, 32, 16, {1, 1, 7, 5, 1}, {40, 1, 33, 5, 100}};

TEST(MetalHost, ParityOnDecodePrefillGqaSplitAndNonCausal) {
  const std::vector<Case> cases = {
      kMixed,
      {4, 4, 64, 16, {1, 1, 1}, {1, 17, 1300}},           // decode only, MHA, long
      {6, 1, 16, 32, {9}, {9}},                           // prefill from scratch, MQA
      {16, 1, 32, 16, {3, 1}, {20, 70}},                  // group 16 > 8 heads per threadgroup: two head tiles
      {4, 2, 32, 16, {3, 1}, {20, 9}, /*causal=*/false},  // non-causal
  };
  for (const Case& c : cases) {
    for (SplitKv split : {SplitKv::kOff, SplitKv::kOn, SplitKv::kAuto}) {
      Fixture f(c);
      const auto plan = f.plan(split, 32);
      if (split != SplitKv::kAuto) {
        EXPECT_EQ(plan->plan().split, split == SplitKv::kOn && !plan->plan().decode_work.empty());
      }
      const float scale = 1.f / std::sqrt(static_cast<float>(c.d));
      expect_close(f.run(*plan, scale), f.reference(scale));
    }
  }
}

TEST(MetalHost, ReshapeAndCacheWritesTheLayerInPlaceAndSkipsNegativeSlots) {
  Fixture f(kMixed, /*layer=*/1);
  const MetalAttentionConfig& cfg = f.config;
  const int64_t per = cfg.num_blocks * cfg.num_kv_heads * cfg.block_size * cfg.head_size;
  const auto* all = static_cast<const float*>(f.store->contents());
  // layer 0 untouched, layer 1 holds sequence 0's first key at its slot
  EXPECT_TRUE(std::all_of(all, all + 2 * per, [](float x) { return x == 0.f; }));
  const int64_t slot0 = static_cast<int64_t>(f.tables[0]) * cfg.block_size;
  EXPECT_EQ(all[2 * per + (slot0 / cfg.block_size * cfg.num_kv_heads) * cfg.block_size * cfg.head_size],
            f.keys[0][0]);
  // the command buffer bound the layer's caches at their byte offsets in the store
  const Dispatch& d = f.device->command_buffers.front().front();
  EXPECT_EQ(d.buffers[3].buffer, f.store.get());
  EXPECT_EQ(d.buffers[3].offset, static_cast<size_t>(2 * per) * 4);
  EXPECT_EQ(d.buffers[4].offset, static_cast<size_t>(3 * per) * 4);

  // a strided key/value ([Hkv, T, D] memory), a skipped token
  std::vector<float> kv(static_cast<size_t>(2 * cfg.num_kv_heads * cfg.head_size));
  for (size_t i = 0; i < kv.size(); ++i) kv[i] = 100.f + static_cast<float>(i);
  std::vector<int64_t> slots = {-1, 5};
  auto [kc, vc] = f.caches(0);
  const TensorArg key = tensor(kv.data(), DType::kFloat32, {2, cfg.num_kv_heads, cfg.head_size},
                               {cfg.head_size, 2 * cfg.head_size, 1}, "key");
  f.attn->reshape_and_cache(key, key, kc, vc, tensor(slots.data(), DType::kInt64, {2}));
  // token 1, kv head 1 -> block 0, offset 5
  const float* k0 = static_cast<const float*>(kc.data);
  EXPECT_EQ(k0[(1 * cfg.block_size + 5) * cfg.head_size], kv[(1 * 2 + 1) * cfg.head_size]);
  int64_t nonzero = 0;
  for (int64_t i = 0; i < per; ++i) nonzero += k0[i] != 0.f;
  EXPECT_EQ(nonzero, cfg.num_kv_heads * cfg.head_size);  // only token 1 was written
}

TEST(MetalHost, NoAllocationPerLayerCallAndMetadataUploadedOncePerPlan) {
  Fixture f(kMixed);
  const auto plan = f.plan(SplitKv::kOn, 32);
  const float scale = 0.17f;
  f.run(*plan, scale, 1);
  const int64_t after_first = f.device->allocations;
  const StagingStats first = f.attn->staging_stats();
  for (int layer = 0; layer < 2; ++layer) {
    for (int i = 0; i < 3; ++i) f.run(*plan, scale, layer);
  }
  EXPECT_EQ(f.device->allocations, after_first);
  const StagingStats s = f.attn->staging_stats();
  EXPECT_EQ(s.metadata_uploads, 1);
  EXPECT_EQ(s.io_allocations, first.io_allocations);
  EXPECT_EQ(s.scratch_allocations, 1);

  // a second plan, then the first again: each is uploaded when it is used
  const auto other = f.plan(SplitKv::kOff);
  f.run(*other, scale);
  expect_close(f.run(*plan, scale), f.reference(scale));
  EXPECT_EQ(f.attn->staging_stats().metadata_uploads, 3);
  EXPECT_EQ(f.device->allocations, after_first);
}

TEST(MetalHost, StagingGrowsGeometricallyForALargerStep) {
  Fixture small(Case{4, 2, 32, 16, {1}, {10}});
  small.run(*small.plan(), 0.2f);
  const StagingStats s0 = small.attn->staging_stats();
  EXPECT_EQ(s0.io_allocations, 1);  // reshape_and_cache's; attention's fits the minimum size
  EXPECT_GE(s0.io_bytes, StagingBuffer::kMinBytes);
  Fixture big(Case{4, 2, 32, 16, {600}, {600}});
  const size_t io_before = big.attn->staging_stats().io_bytes;
  big.run(*big.plan(), 0.2f);
  const StagingStats s1 = big.attn->staging_stats();
  EXPECT_GE(s1.io_bytes, io_before);
  big.run(*big.plan(), 0.2f);
  EXPECT_EQ(big.attn->staging_stats().io_allocations, s1.io_allocations);
}

TEST(MetalHost, OneCommandBufferPerCallEmptyGridsSkippedDummyForUnusedBuffers) {
  Fixture f(Case{4, 2, 32, 16, {1, 1}, {20, 30}});
  const size_t before = f.device->command_buffers.size();
  f.run(*f.plan(SplitKv::kOff), 0.2f);
  ASSERT_EQ(f.device->command_buffers.size(), before + 1);
  const std::vector<Dispatch>& cb = f.device->command_buffers.back();
  ASSERT_EQ(cb.size(), 1u);  // decode only: no merge (no split), no prefill (empty grid)
  EXPECT_EQ(cb[0].pipeline.kernel, MetalKernel::kPagedAttentionDecode);
  EXPECT_EQ(cb[0].num_buffers, 11);
  EXPECT_EQ(cb[0].buffers[9].buffer, cb[0].buffers[10].buffer);  // the dummy, twice
  EXPECT_NE(cb[0].buffers[9].buffer, cb[0].buffers[1].buffer);

  f.run(*f.plan(SplitKv::kOn, 32), 0.2f);
  const std::vector<Dispatch>& split = f.device->command_buffers.back();
  ASSERT_EQ(split.size(), 2u);
  EXPECT_EQ(split[1].pipeline.kernel, MetalKernel::kPagedAttentionMerge);
  EXPECT_EQ(split[1].num_buffers, 7);
  EXPECT_EQ(split[0].pipeline.head_size, 32);
  EXPECT_EQ(split[0].pipeline.block_size, 16);
}

TEST(MetalHost, EveryDTypeBindsWithinItsBuffers) {
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    auto device = std::make_shared<RecordingDevice>();
    MetalAttentionConfig cfg{8, 2, 64, 16, 20, dtype};
    MetalAttention attn(device, cfg);
    auto store = attn.allocate_kv_store(3);
    EXPECT_EQ(store->size(), static_cast<size_t>(3 * 2 * 20 * 2 * 16 * 64 * 2));
    const int64_t per = 20 * 2 * 16 * 64;
    auto* base = static_cast<uint16_t*>(store->contents()) + 2 * 2 * per;  // layer 2
    const std::vector<int64_t> shape = {20, 2, 16, 64};
    TensorArg kc = tensor(base, dtype, shape, {}, "k_cache"), vc = tensor(base + per, dtype, shape, {}, "v_cache");
    std::vector<uint16_t> kv(static_cast<size_t>(5 * 2 * 64), 0x3c00);
    std::vector<int64_t> slots = {0, 1, 2, 3, 40};
    attn.reshape_and_cache(tensor(kv.data(), dtype, {5, 2, 64}), tensor(kv.data(), dtype, {5, 2, 64}), kc, vc,
                           tensor(slots.data(), DType::kInt64, {5}));
    std::vector<int32_t> qsl = {0, 4, 5}, lens = {4, 41}, tables = {0, -1, -1, 1, 2, 3};
    MetalStepPlan plan(cfg, tensor(qsl.data(), DType::kInt32, {3}), tensor(lens.data(), DType::kInt32, {2}),
                       tensor(tables.data(), DType::kInt32, {2, 3}), true, MetalPlanOptions{SplitKv::kOn, 32, 64});
    std::vector<uint16_t> q(static_cast<size_t>(5 * 8 * 64), 0x3c00), out(q.size());
    attn.paged_attention(tensor(out.data(), dtype, {5, 8, 64}), tensor(q.data(), dtype, {5, 8, 64}), kc, vc, plan,
                         0.125f);
    const std::vector<Dispatch>& cb = device->command_buffers.back();
    ASSERT_EQ(cb.size(), 3u);  // decode, merge, prefill
    for (const Dispatch& d : cb) EXPECT_EQ(d.pipeline.dtype, dtype);
  }
}

TEST(MetalHost, TheStoreIsFoundByAddressAndFreedWithItsLastReference) {
  const int64_t live = DeviceBuffer::live_count();
  auto device = std::make_shared<RecordingDevice>();
  {
    MetalAttention attn(device, MetalAttentionConfig{4, 2, 32, 16, 8, DType::kFloat32});
    std::shared_ptr<DeviceBuffer> store = attn.allocate_kv_store(1);
    EXPECT_EQ(DeviceBuffer::live_count(), live + 2);  // the dummy and the store
    const auto* p = static_cast<const unsigned char*>(store->contents());
    {
      const StoreRef ref = find_kv_store(p + 4096, 64, "k_cache");
      EXPECT_EQ(ref.buffer, store);
      EXPECT_EQ(ref.offset, 4096u);
    }
    EXPECT_THROW(find_kv_store(p + store->size() - 8, 64, "k_cache"), KernelArgumentError);
    std::vector<float> elsewhere(64);
    try {
      find_kv_store(elsewhere.data(), 64, "k_cache");
      FAIL() << "a tensor outside every store was accepted";
    } catch (const KernelArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find("not a view of a Metal KV store"), std::string::npos);
    }
    std::weak_ptr<DeviceBuffer> weak = store;
    const void* address = store->contents();
    store.reset();
    EXPECT_TRUE(weak.expired());
    EXPECT_THROW(find_kv_store(address, 64, "k_cache"), KernelArgumentError);
  }
  EXPECT_EQ(DeviceBuffer::live_count(), live);
}

TEST(MetalHost, RefusesWhatTheKernelsCannotTake) {
  auto device = std::make_shared<RecordingDevice>();
  EXPECT_THROW(MetalAttention(device, MetalAttentionConfig{4, 2, 300, 16, 8, DType::kFloat32}), KernelArgumentError);
  EXPECT_THROW(MetalAttention(device, MetalAttentionConfig{4, 3, 32, 16, 8, DType::kFloat32}), KernelArgumentError);
  EXPECT_THROW(MetalAttention(device, MetalAttentionConfig{4, 2, 32, 16, 8, DType::kInt32}), KernelArgumentError);
  MetalAttention attn(device, MetalAttentionConfig{4, 2, 32, 16, 8, DType::kFloat32});
  EXPECT_THROW(attn.allocate_kv_store(0), InvalidArgumentError);
  device->max_buffer_length = 1024;
  EXPECT_THROW(attn.allocate_kv_store(1), std::runtime_error);

  Fixture f(kMixed);
  const auto plan = f.plan();
  Fixture g(Case{4, 2, 32, 16, {1}, {3}});  // another geometry
  std::vector<float> out(static_cast<size_t>(f.tokens() * 8 * 32));
  auto [kc, vc] = f.caches(0);
  EXPECT_THROW(g.attn->paged_attention(tensor(out.data(), DType::kFloat32, {f.tokens(), 8, 32}), f.query_view(), kc,
                                       vc, *plan, 1.f),
               KernelArgumentError);
  std::vector<float> not_a_cache(kc.numel());
  TensorArg stray = tensor(not_a_cache.data(), DType::kFloat32, kc.shape, {}, "k_cache");
  EXPECT_THROW(f.attn->paged_attention(tensor(out.data(), DType::kFloat32, {f.tokens(), 8, 32}), f.query_view(),
                                       stray, vc, *plan, 1.f),
               KernelArgumentError);
  std::vector<float> short_out(static_cast<size_t>(8 * 32));
  EXPECT_THROW(f.attn->paged_attention(tensor(short_out.data(), DType::kFloat32, {1, 8, 32}), f.query_view(), kc, vc,
                                       *plan, 1.f),
               KernelArgumentError);
}

}  // namespace
}  // namespace metal
}  // namespace pagedserve
