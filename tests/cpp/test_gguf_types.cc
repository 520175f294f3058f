// The GGUF block types beyond Q4_1 / Q8_0 (Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K,
// and the unquantised F32 / F16 / BF16:
// csrc/backends/cpu/gemm/gguf_types.h): hand-built blocks de-quantise to the values
// ggml's formats define (checked here element by element); on random blocks
// every kernel variant this CPU runs gives, through linear_f32, exactly the
// de-quantised weights for one-hot rows, a row's result is the same bits in
// any batch and on any thread count, and general rows match a double
// reference. (The Python tests check dequantize against gguf-py itself.)
// Built with -ffp-contract=off: the references round d * q and + m separately.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backends/cpu/gemm/gguf_types.h"
#include "backends/cpu/gemm/greedy_logits.h"
#include "backends/cpu/gemm/quant_linear.h"
#include "backends/cpu/runtime/isa_registry.h"
#include "contiguous_arg.h"
#include "greedy_check.h"
#include "core/errors.h"

using namespace pagedserve;
using namespace pagedserve::cpu;
using pagedserve::test_support::arg;
using pagedserve::test_support::greedy_against_full;

namespace {

// The types linear_f32 reads beyond Q4_1 / Q8_0 (test_quant_linear.cc): the other quantised ones and the
// unquantised F32 / F16 / BF16 (dense tiles).
const QType kTypes[] = {QType::kQ4_0, QType::kQ5_0, QType::kQ5_1, QType::kQ4_K, QType::kQ5_K,
                        QType::kQ6_K, QType::kF32,  QType::kF16,  QType::kBF16};

bool dense_type(QType q) { return q == QType::kF32 || q == QType::kF16 || q == QType::kBF16; }

void put_half(uint8_t* p, uint16_t h) { std::memcpy(p, &h, 2); }

// Random blocks of type q for an [n, k] weight: random quant bytes, scales as
// fp16 of moderate size (negative ones too, for the types whose d is signed).
// F32 / F16 / BF16: the row-major matrix of random finite values (float32:
// any mantissa, exponents of about [2^-8, 2^2); the 16-bit types: random bits
// of such values, either sign).
std::vector<uint8_t> random_blocks(QType q, int64_t n, int64_t k, std::mt19937& rng) {
  const int64_t be = qtype_block_elements(q), bb = qtype_block_bytes(q), nb = n * (k / be);
  std::vector<uint8_t> raw(static_cast<size_t>(nb * bb));
  std::uniform_int_distribution<int> byte(0, 255), mant(0, 1023), expo(9, 15);
  for (auto& b : raw) b = static_cast<uint8_t>(byte(rng));
  const auto half = [&](bool sign) {  // fp16 in about [2^-6, 2^1)
    return static_cast<uint16_t>((sign ? 0x8000 : 0) | (expo(rng) << 10) | mant(rng));
  };
  if (dense_type(q)) {
    std::uniform_int_distribution<uint32_t> bits(0, 0xFFFFFFFFu);
    std::uniform_int_distribution<uint32_t> fexp(119, 128);
    for (int64_t i = 0; i < n * k; ++i) {
      const uint32_t v = (bits(rng) & 0x807FFFFFu) | fexp(rng) << 23;  // a float32 of about [2^-8, 2^2)
      if (q == QType::kF32) {
        std::memcpy(raw.data() + 4 * i, &v, 4);
      } else if (q == QType::kBF16) {
        put_half(raw.data() + 2 * i, static_cast<uint16_t>(v >> 16));
      } else {
        put_half(raw.data() + 2 * i, half(byte(rng) & 1));
      }
    }
    return raw;
  }
  for (int64_t i = 0; i < nb; ++i) {
    uint8_t* b = raw.data() + i * bb;
    switch (q) {
      case QType::kQ4_0:
      case QType::kQ5_0: put_half(b, half(byte(rng) & 1)); break;
      case QType::kQ5_1:
      case QType::kQ4_1: put_half(b, half(false)); put_half(b + 2, half(true)); break;
      case QType::kQ8_0: put_half(b, half(byte(rng) & 1)); break;
      case QType::kQ4_K:
      case QType::kQ5_K: put_half(b, half(false)); put_half(b + 2, half(false)); break;
      case QType::kQ6_K: put_half(b + 208, half(false)); break;
      default: break;
    }
  }
  return raw;
}

// The name of the first registry variant whose GEMM table is the scalar one (the reference).
std::string scalar_gemm_variant() {
  for (const IsaVariant& v : compiled_isas()) {
    if (std::string(v.gemm().name) == "scalar") return v.name;
  }
  ADD_FAILURE() << "no variant runs the scalar GEMM";
  return "";
}

struct ActiveVariant {  // restores the active quantized variant
  std::string saved = active_isa().name;
  ~ActiveVariant() { set_active_isa(saved); }
};

std::vector<float> dequantized(const QuantizedWeight& w) {
  std::vector<float> out(static_cast<size_t>(w.out_features() * w.in_features()), NAN);
  w.dequantize(arg(out, {w.out_features(), w.in_features()}, DType::kFloat32, "out"));
  return out;
}

// ---- hand-built blocks: the formats' definitions, element by element ----

TEST(GGUFTypes, NamesSizesAndFormats) {
  EXPECT_EQ(parse_qtype("Q6_K"), QType::kQ6_K);
  EXPECT_STREQ(qtype_name(QType::kQ5_1), "q5_1");
  EXPECT_EQ(qtype_block_bytes(QType::kQ4_0), 18);
  EXPECT_EQ(qtype_block_bytes(QType::kQ5_K), 176);
  EXPECT_EQ(qtype_block_elements(QType::kQ4_K), 256);
  EXPECT_EQ(qtype_block_elements(QType::kQ5_0), 32);
  EXPECT_EQ(tile_format_of(QType::kQ8_0), TileFormat::kQ8_0);
  EXPECT_EQ(tile_format_of(QType::kQ6_K), TileFormat::kI6F);
  EXPECT_EQ(tile_format_of(QType::kQ5_0), TileFormat::kQ8_0);
  EXPECT_EQ(tile_format_of(QType::kQ4_0), TileFormat::kQ4_1);
  EXPECT_EQ(tile_format_of(QType::kQ4_K), TileFormat::kU4K);
  EXPECT_EQ(tile_format_of(QType::kQ5_K), TileFormat::kU5F);
  EXPECT_EQ(tile_format_of(QType::kQ5_1), TileFormat::kU5F);
  EXPECT_THROW(parse_qtype("q3_k"), KernelArgumentError);
  EXPECT_EQ(parse_qtype("BF16"), QType::kBF16);
  EXPECT_EQ(qtype_block_bytes(QType::kF32), 128);
  EXPECT_EQ(qtype_block_bytes(QType::kF16), 64);
  EXPECT_EQ(qtype_block_elements(QType::kBF16), 32);
  EXPECT_EQ(tile_format_of(QType::kF32), TileFormat::kF32);
  EXPECT_EQ(tile_format_of(QType::kF16), TileFormat::kF16);
  EXPECT_EQ(tile_format_of(QType::kBF16), TileFormat::kBF16);
}

// F32 / F16 / BF16: dequantize gives the stored values widened (float32 bit
// for bit, IEEE half and bfloat16 exactly: infinities, negative zero and
// subnormals included), the tiles take 4 / 2 / 2 bytes a weight, and linear
// (int8 activations) refuses them with a typed error.
TEST(GGUFTypes, UnquantisedTypesHoldTheirValuesExactly) {
  const int64_t n = 17, k = 64;  // a partial second row group
  std::mt19937 rng(5);
  std::uniform_int_distribution<uint32_t> bits(0, 0xFFFFFFFFu);
  for (QType q : {QType::kF32, QType::kF16, QType::kBF16}) {
    const int64_t es = q == QType::kF32 ? 4 : 2;
    std::vector<uint8_t> raw(static_cast<size_t>(n * k * es));
    std::vector<float> want(static_cast<size_t>(n * k));
    for (int64_t i = 0; i < n * k; ++i) {
      uint32_t v = bits(rng);
      if (i % 13 == 0) v = 0x80000000u;                     // -0
      if (i % 17 == 0) v = 0x7F800000u;                     // inf
      if (i % 19 == 0) v = 0x00000001u | (v & 0x80000000u);  // the smallest float32 subnormal
      if (q == QType::kF32) {
        if ((v & 0x7F800000u) == 0x7F800000u && (v & 0x007FFFFFu) != 0) v &= 0xFF800000u;  // inf, not NaN
        std::memcpy(raw.data() + 4 * i, &v, 4);
        std::memcpy(&want[static_cast<size_t>(i)], &v, 4);
        continue;
      }
      uint16_t h = static_cast<uint16_t>(v >> 16);
      if (q == QType::kF16) {
        h = static_cast<uint16_t>(v & 0xFFFF);
        if ((h & 0x7C00) == 0x7C00) h = static_cast<uint16_t>(h & 0xFC00);  // inf, not NaN
        // IEEE half: sign, 5-bit exponent (bias 15), 10-bit mantissa; subnormals m * 2^-24
        const int e = (h >> 10) & 0x1F, mt = h & 0x3FF;
        float f = e == 0 ? std::ldexp(static_cast<float>(mt), -24)
                  : e == 31 ? INFINITY : std::ldexp(static_cast<float>(mt + 1024), e - 25);
        want[static_cast<size_t>(i)] = (h & 0x8000) ? -f : f;
      } else {
        if ((h & 0x7F80) == 0x7F80) h = static_cast<uint16_t>(h & 0xFF80);  // inf, not NaN
        const uint32_t b = static_cast<uint32_t>(h) << 16;
        std::memcpy(&want[static_cast<size_t>(i)], &b, 4);
      }
      put_half(raw.data() + 2 * i, h);
    }
    const QuantizedWeight w(raw.data(), q, n, k);
    EXPECT_FALSE(w.integer_kernels()) << qtype_name(q);
    EXPECT_EQ(w.nbytes(), 32 * k * es) << qtype_name(q);  // two row groups of 16 rows
    const std::vector<float> got = dequantized(w);
    ASSERT_EQ(std::memcmp(got.data(), want.data(), want.size() * 4), 0) << qtype_name(q);
    std::vector<float> x(k, 1.f), out(n);
    EXPECT_THROW(w.linear(arg(x, {1, k}, DType::kFloat32, "x"), arg(out, {1, n}, DType::kFloat32, "out"), nullptr, 1),
                 KernelArgumentError)
        << qtype_name(q);
  }
  std::vector<uint8_t> raw(16 * 48 * 4);
  EXPECT_THROW(QuantizedWeight(raw.data(), QType::kF32, 16, 48), KernelArgumentError);  // K not a multiple of 32
}

TEST(GGUFTypes, Q4_0AndQ5_0AndQ5_1BlocksDecodeAsDefined) {
  // d = 0.5 (fp16 0x3800), m = -1.0 (0xBC00); qs[j] = j | (15 - j) << 4; qh bits set for even elements
  std::vector<uint8_t> q40(18), q50(22), q51(24);
  put_half(q40.data(), 0x3800);
  put_half(q50.data(), 0x3800);
  put_half(q51.data(), 0x3800);
  put_half(q51.data() + 2, 0xBC00);
  const uint32_t qh = 0x55555555u;
  std::memcpy(q50.data() + 2, &qh, 4);
  std::memcpy(q51.data() + 4, &qh, 4);
  for (int j = 0; j < 16; ++j) {
    const uint8_t v = static_cast<uint8_t>(j | (15 - j) << 4);
    q40[2 + j] = v;
    q50[6 + j] = v;
    q51[8 + j] = v;
  }
  const QuantizedWeight w40(q40.data(), QType::kQ4_0, 1, 32), w50(q50.data(), QType::kQ5_0, 1, 32),
      w51(q51.data(), QType::kQ5_1, 1, 32);
  const std::vector<float> d40 = dequantized(w40), d50 = dequantized(w50), d51 = dequantized(w51);
  for (int e = 0; e < 32; ++e) {
    const int nib = e < 16 ? e : 15 - (e - 16), hi = (e % 2 == 0) ? 16 : 0;
    EXPECT_EQ(d40[e], 0.5f * static_cast<float>(nib - 8)) << e;
    EXPECT_EQ(d50[e], 0.5f * static_cast<float>((nib | hi) - 16)) << e;
    EXPECT_EQ(d51[e], 0.5f * static_cast<float>(nib | hi) - 1.0f) << e;
  }
}

// Q4_0 runs on Q4_1 tiles (m = -8 d) unless some -8 d is no float16; then, as Q5_0 always, on Q8_0 tiles:
// the same values either way, and the integer kernels read them.
TEST(GGUFTypes, Q4_0AndQ5_0RunOnTheQ4_1AndQ8_0Tiles) {
  std::vector<uint8_t> small(2 * 18), large(2 * 18);
  put_half(small.data(), 0x3800);         // d = 0.5: m = -4 is a float16
  put_half(small.data() + 18, 0x8001);    // d = -2^-24 (subnormal): m = 2^-21, a float16 too
  put_half(large.data(), 0x3800);
  put_half(large.data() + 18, 0x7BFF);    // d = 65504: -8 d overflows float16
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 16; ++j) small[18 * i + 2 + j] = large[18 * i + 2 + j] = static_cast<uint8_t>(j | (15 - j) << 4);
  }
  const QuantizedWeight ws(small.data(), QType::kQ4_0, 2, 32), wl(large.data(), QType::kQ4_0, 2, 32);
  EXPECT_EQ(ws.tile_format(), TileFormat::kQ4_1);
  EXPECT_EQ(wl.tile_format(), TileFormat::kQ8_0);
  const float ds[2] = {0.5f, -0x1p-24f}, dl[2] = {0.5f, 65504.f};
  const std::vector<float> vs = dequantized(ws), vl = dequantized(wl);
  for (int r = 0; r < 2; ++r) {
    for (int e = 0; e < 32; ++e) {
      const int q = (e < 16 ? e : 15 - (e - 16)) - 8;
      EXPECT_EQ(vs[32 * r + e], ds[r] * static_cast<float>(q)) << r << " " << e;
      EXPECT_EQ(vl[32 * r + e], dl[r] * static_cast<float>(q)) << r << " " << e;
    }
  }
  std::vector<uint8_t> q50(22, 0);
  put_half(q50.data(), 0x3C00);
  const QuantizedWeight w50(q50.data(), QType::kQ5_0, 1, 32);
  EXPECT_EQ(w50.tile_format(), TileFormat::kQ8_0);
  for (float v : dequantized(w50)) EXPECT_EQ(v, -16.f);
}

// The 12 scale bytes of Q4_K / Q5_K holding sc[j], mn[j] (6 bits each, j < 8).
void pack_scales_k4(uint8_t* s, const int* sc, const int* mn) {
  for (int j = 0; j < 4; ++j) {
    s[j] = static_cast<uint8_t>((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
    s[j + 4] = static_cast<uint8_t>((mn[j] & 63) | ((mn[j + 4] >> 4) << 6));
    s[j + 8] = static_cast<uint8_t>((sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4));
  }
}

TEST(GGUFTypes, Q4_KAndQ5_KBlocksDecodeAsDefined) {
  const int sc[8] = {1, 63, 17, 32, 5, 48, 63, 33}, mn[8] = {0, 7, 63, 1, 62, 16, 9, 40};
  std::vector<uint8_t> q4(144), q5(176);
  for (auto* b : {&q4, &q5}) {
    put_half(b->data(), 0x3400);      // d = 0.25
    put_half(b->data() + 2, 0x2C00);  // dmin = 0.0625
    pack_scales_k4(b->data() + 4, sc, mn);
  }
  for (int i = 0; i < 128; ++i) {  // byte i of the nibbles: sub-block 2 (i / 32) low, 2 (i / 32) + 1 high
    q4[16 + i] = q5[48 + i] = static_cast<uint8_t>((i % 16) | ((15 - i % 16) << 4));
  }
  for (int i = 0; i < 32; ++i) q5[16 + i] = static_cast<uint8_t>(i * 37);  // bit s of qh[i]: sub-block s's bit 4
  const QuantizedWeight w4(q4.data(), QType::kQ4_K, 1, 256), w5(q5.data(), QType::kQ5_K, 1, 256);
  const std::vector<float> d4 = dequantized(w4), d5 = dequantized(w5);
  for (int f = 0; f < 256; ++f) {
    const int s = f / 32, i = f % 32, byte = 32 * (s / 2) + i;
    const int nib = s % 2 == 0 ? byte % 16 : 15 - byte % 16;
    const int hi = ((static_cast<uint8_t>(i * 37) >> s) & 1) << 4;
    const float ds = 0.25f * static_cast<float>(sc[s]), dm = 0.0625f * static_cast<float>(mn[s]);
    EXPECT_EQ(d4[f], ds * static_cast<float>(nib) - dm) << f;
    EXPECT_EQ(d5[f], ds * static_cast<float>(nib | hi) - dm) << f;
  }
}

TEST(GGUFTypes, Q6_KBlocksDecodeAsDefined) {
  std::vector<uint8_t> b(210);
  for (int i = 0; i < 128; ++i) b[i] = static_cast<uint8_t>(i * 29 + 3);        // ql
  for (int i = 0; i < 64; ++i) b[128 + i] = static_cast<uint8_t>(i * 53 + 11);  // qh
  const int8_t scales[16] = {1, -1, 127, -128, 3, 64, -7, 0, 12, -33, 100, 5, -90, 8, 77, -2};
  std::memcpy(b.data() + 192, scales, 16);
  put_half(b.data() + 208, 0x3000);  // d = 0.125
  const QuantizedWeight w(b.data(), QType::kQ6_K, 1, 256);
  const std::vector<float> d = dequantized(w);
  for (int f = 0; f < 256; ++f) {
    const int h = f / 128, j = f % 128;
    const int lo = (b[64 * h + j % 64] >> (4 * (j / 64))) & 15, hi = (b[128 + 32 * h + j % 32] >> (2 * (j / 32))) & 3;
    const float scale = 0.125f * static_cast<float>(scales[f / 16]);
    EXPECT_EQ(d[f], scale * static_cast<float>((lo | hi << 4) - 32)) << f;
  }
}

// The repacked tiles against the blocks' own decoding (decode_row: d[e / 16]
// q + m[e / 16], rounded as numpy rounds it), bit for bit (the sign of zero
// included), for the K-quants held in tiles of their own layout (Q4_K in u4k
// with its super-block table, Q6_K in i6f) over a partial second row group
// and two super-blocks: a misplaced scale, field or table entry shows here.
TEST(GGUFTypes, KQuantTilesHoldEachRowsDecodedValues) {
  std::mt19937 rng(61);
  for (QType q : {QType::kQ4_K, QType::kQ6_K}) {
    const int64_t n = 17, k = 512, row_bytes = k / 256 * qtype_block_bytes(q);
    const std::vector<uint8_t> raw = random_blocks(q, n, k, rng);
    const std::vector<float> got = dequantized(QuantizedWeight(raw.data(), q, n, k));
    std::vector<int8_t> qs(k);
    std::vector<float> d(k / 16), m(k / 16);
    for (int64_t row = 0; row < n; ++row) {
      decode_row(q, raw.data() + row * row_bytes, k, qs.data(), d.data(), m.data());
      for (int64_t e = 0; e < k; ++e) {
        const float prod = d[e / 16] * static_cast<float>(qs[e]);
        const float want = prod + m[e / 16];
        ASSERT_EQ(std::memcmp(&got[row * k + e], &want, 4), 0)
            << qtype_name(q) << " [" << row << ", " << e << "]: " << got[row * k + e] << " vs " << want;
      }
    }
  }
}

TEST(GGUFTypes, BadShapesRaise) {
  std::mt19937 rng(3);
  std::vector<uint8_t> raw = random_blocks(QType::kQ4_K, 2, 256, rng);
  EXPECT_THROW(QuantizedWeight(arg(raw, {2, 144}, DType::kUInt8, "raw"), "q4_k", 2, 128), KernelArgumentError);
  EXPECT_THROW(QuantizedWeight(arg(raw, {2, 144}, DType::kUInt8, "raw"), "q5_k", 2, 256), KernelArgumentError);
  QuantizedWeight w(arg(raw, {2, 144}, DType::kUInt8, "raw"), "q4_k", 2, 256);
  EXPECT_EQ(w.nbytes(), 8 * kU4KTileBytes + kU4KSuperBytes);  // one row group: 8 u4k tiles, one super-block
  EXPECT_TRUE(w.integer_kernels());  // every GGUF type runs with int8 activations too
  std::vector<float> x(256, 1.f), out(3);
  EXPECT_THROW(w.linear(arg(x, {1, 256}, DType::kFloat32, "x"), arg(out, {1, 3}, DType::kFloat32, "out"), nullptr, 1),
               KernelArgumentError);
}

// run(r0, rows, threads) computes rows [r0, r0 + rows) of a batch alone: each
// slice's output, on 1 and 2 threads, must be the bits of those rows of `all`
// (the whole batch's [M, n] output).
template <typename Run>
void expect_slices_are_the_batchs_rows(const Run& run, const std::vector<float>& all, int64_t n,
                                       std::initializer_list<std::array<int64_t, 2>> slices, QType q) {
  for (const auto& sb : slices) {
    for (int threads : {1, 2}) {
      const std::vector<float> part = run(sb[0], sb[1], threads);
      ASSERT_EQ(std::memcmp(part.data(), all.data() + sb[0] * n, part.size() * 4), 0)
          << qtype_name(q) << " rows [" << sb[0] << ", " << sb[0] + sb[1] << ") threads " << threads;
    }
  }
}

// ---- every variant: linear_f32 on every tile format ----

class GGUFTypesVariant : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    for (const IsaVariant& v : compiled_isas()) {
      if (GetParam() == v.name) {
        if (!v.supported()) GTEST_SKIP() << "this CPU cannot run " << GetParam() << ": it needs " << v.requires_;
        return;
      }
    }
    GTEST_SKIP() << "variant " << GetParam() << " is not compiled into this build";
  }
};

// One-hot rows select each weight: the expansion is exact, in a full batch
// (several row tiles: the scratch path) and one row at a time (in registers).
TEST_P(GGUFTypesVariant, LinearF32OfOneHotRowsIsTheDequantisedWeightExactly) {
  ActiveVariant guard;
  set_active_isa(GetParam());
  std::mt19937 rng(17);
  for (QType q : kTypes) {
    const int64_t n = 40, k = 256;
    std::vector<uint8_t> raw = random_blocks(q, n, k, rng);
    const QuantizedWeight w(raw.data(), q, n, k);
    const std::vector<float> wd = dequantized(w);
    for (int64_t k0 : {int64_t{0}, int64_t{96}, int64_t{240}}) {  // 16 one-hot rows from column k0
      const int64_t m = 16;
      std::vector<float> x(m * k, 0.f), out(m * n, NAN), one(n, NAN);
      for (int64_t i = 0; i < m; ++i) x[i * k + k0 + i] = 1.f;
      w.linear_f32(arg(x, {m, k}, DType::kFloat32, "x"), arg(out, {m, n}, DType::kFloat32, "out"), nullptr, 2);
      for (int64_t i = 0; i < m; ++i) {
        std::vector<float> xi(x.begin() + i * k, x.begin() + (i + 1) * k);
        w.linear_f32(arg(xi, {1, k}, DType::kFloat32, "x"), arg(one, {1, n}, DType::kFloat32, "out"), nullptr, 1);
        for (int64_t j = 0; j < n; ++j) {
          const float want = wd[j * k + k0 + i];
          ASSERT_EQ(out[i * n + j], want) << qtype_name(q) << " [" << k0 + i << ", " << j << "]";
          ASSERT_EQ(one[j], want) << qtype_name(q) << " row alone [" << k0 + i << ", " << j << "]";
        }
      }
    }
  }
}

// General rows against a double reference of the de-quantised weights, and a
// row's bits the same alone, in any slice of the batch and on 1 or 2 threads.
TEST_P(GGUFTypesVariant, LinearF32MatchesADoubleReferenceAndIsBatchInvariant) {
  ActiveVariant guard;
  set_active_isa(GetParam());
  std::mt19937 rng(23);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (QType q : kTypes) {
    const int64_t n = 83, k = 512, m = 19;  // a partial last row group, two super-blocks per row
    std::vector<uint8_t> raw = random_blocks(q, n, k, rng);
    const QuantizedWeight w(raw.data(), q, n, k);
    const std::vector<float> wd = dequantized(w);
    std::vector<float> x(m * k), bias(n);
    for (auto& v : x) v = nd(rng);
    for (auto& v : bias) v = nd(rng);
    auto b = arg(bias, {n}, DType::kFloat32, "bias");
    const auto run = [&](int64_t r0, int64_t rows, int threads) {
      std::vector<float> xs(x.begin() + r0 * k, x.begin() + (r0 + rows) * k), o(rows * n);
      w.linear_f32(arg(xs, {rows, k}, DType::kFloat32, "x"), arg(o, {rows, n}, DType::kFloat32, "out"), &b, threads);
      return o;
    };
    const std::vector<float> all = run(0, m, 1);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double sum = bias[j], scale = std::fabs(bias[j]);
        for (int64_t e = 0; e < k; ++e) {
          const double t = static_cast<double>(x[i * k + e]) * wd[j * k + e];
          sum += t;
          scale += std::fabs(t);
        }
        ASSERT_NEAR(all[i * n + j], sum, 1e-5 * scale + 1e-6) << qtype_name(q) << " [" << i << ", " << j << "]";
      }
    }
    expect_slices_are_the_batchs_rows(run, all, n, {{0, m}, {0, 1}, {18, 1}, {3, 2}, {4, 13}}, q);
    if (HasFatalFailure()) return;
  }
}

// linear (int8 activations) on every type: the activations quantised as the
// kernels do (per row and 32-group, d = amax / 127, q = nearest-even(x * (1 /
// d)) clamped to +-127), then sum over blocks of xd * sum(w * xq) with w the
// de-quantised weights, in double: the integer math's exact value (w = d q +
// m per element, so d xd isum + m xs per block). Within float32 rounding of
// the per-block terms (d q and m may cancel: 1e-5 of sum |w x|); a row's bits
// the same in any slice of the batch and on 1 or 2 threads; the scalar
// variant's result to float32 rounding.
TEST_P(GGUFTypesVariant, LinearMatchesTheIntegerReferenceOnEveryType) {
  ActiveVariant guard;
  std::mt19937 rng(29);
  std::normal_distribution<float> nd(0.f, 1.f);
  const QType all_types[] = {QType::kQ4_0, QType::kQ4_1, QType::kQ5_0, QType::kQ5_1, QType::kQ8_0,
                             QType::kQ4_K, QType::kQ5_K, QType::kQ6_K};
  for (QType q : all_types) {
    const int64_t n = 83, k = 512, m = 11;  // a partial last row group; passes of 4, 4 and 3 rows
    std::vector<uint8_t> raw = random_blocks(q, n, k, rng);
    const QuantizedWeight w(raw.data(), q, n, k);
    ASSERT_TRUE(w.integer_kernels()) << qtype_name(q);
    const std::vector<float> wd = dequantized(w);
    std::vector<float> x(m * k), bias(n);
    for (auto& v : x) v = nd(rng);
    for (int64_t e = 0; e < m * k; e += 37) x[e] *= 50.f;  // outliers: groups of very different scales
    for (auto& v : bias) v = nd(rng);
    auto b = arg(bias, {n}, DType::kFloat32, "bias");
    const auto run = [&](int64_t r0, int64_t rows, int threads) {
      std::vector<float> xs(x.begin() + r0 * k, x.begin() + (r0 + rows) * k), o(rows * n, NAN);
      w.linear(arg(xs, {rows, k}, DType::kFloat32, "x"), arg(o, {rows, n}, DType::kFloat32, "out"), &b, threads);
      return o;
    };
    set_active_isa(scalar_gemm_variant());
    const std::vector<float> scalar = run(0, m, 1);
    set_active_isa(GetParam());
    const std::vector<float> got = run(0, m, 2);
    std::vector<float> xr = x;  // x as the kernel sees it: xd * xq
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t bk = 0; bk < k / 32; ++bk) {  // quantise group bk of row i as the kernels do
        float amax = 0.f;
        for (int e = 0; e < 32; ++e) amax = std::max(amax, std::fabs(xr[i * k + bk * 32 + e]));
        const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
        for (int e = 0; e < 32; ++e) {
          float& v = xr[i * k + bk * 32 + e];
          v = d * std::nearbyint(std::min(127.f, std::max(-127.f, v * id)));
        }
      }
      for (int64_t j = 0; j < n; ++j) {
        double sum = bias[j], scale = std::fabs(bias[j]);
        for (int64_t bk = 0; bk < k / 32; ++bk) {
          double blk = 0, blk_abs = 0;
          for (int64_t e = bk * 32; e < bk * 32 + 32; ++e) {
            const double t = static_cast<double>(xr[i * k + e]) * wd[j * k + e];
            blk += t;
            blk_abs += std::fabs(t);
          }
          sum += blk;
          scale += blk_abs;
        }
        ASSERT_NEAR(got[i * n + j], sum, 1e-5 * scale + 1e-6) << qtype_name(q) << " [" << i << ", " << j << "]";
        ASSERT_NEAR(got[i * n + j], scalar[i * n + j], 1e-5 * scale + 1e-6)
            << qtype_name(q) << " against scalar [" << i << ", " << j << "]";
      }
    }
    expect_slices_are_the_batchs_rows(run, got, n, {{0, 1}, {10, 1}, {3, 5}, {4, 7}}, q);
    if (HasFatalFailure()) return;
  }
}

// greedy_logits on Q6_K's i6f tiles (the output layer of most Q4_K_M files):
// every value it keeps is linear_f32's bit for bit, every row maximum
// (ties included) is kept, so argmax is linear_f32's; several rows skip most
// of the work, one row gets linear_f32 in full. Row 0 of x points at the
// weight row of the largest norm, and an exact twin of that row ties it.
TEST_P(GGUFTypesVariant, GreedyLogitsOnQ6_KKeepEveryRowMaximumExactly) {
  ActiveVariant guard;
  set_active_isa(GetParam());
  std::mt19937 rng(59);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int64_t n = 1000, k = 512, rb = k / 256 * 210, twin = n - 3;
  std::vector<uint8_t> raw = random_blocks(QType::kQ6_K, n, k, rng);
  std::vector<float> wd = dequantized(QuantizedWeight(raw.data(), QType::kQ6_K, n, k));
  int64_t top = 0;
  double best = -1.0;
  for (int64_t j = 0; j < twin - 16; ++j) {
    double sq = 0.0;
    for (int64_t e = 0; e < k; ++e) sq += static_cast<double>(wd[j * k + e]) * wd[j * k + e];
    if (sq > best) best = sq, top = j;
  }
  std::memcpy(raw.data() + twin * rb, raw.data() + top * rb, static_cast<size_t>(rb));
  const QuantizedWeight w(raw.data(), QType::kQ6_K, n, k);
  ASSERT_TRUE(prunes_greedy_logits(w));
  for (int64_t m : {1, 2, 9}) {
    for (int threads : {1, 2}) {
      SCOPED_TRACE("m=" + std::to_string(m) + " threads=" + std::to_string(threads));
      std::vector<float> x(m * k);
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t e = 0; e < k; ++e) x[i * k + e] = i == 0 ? wd[top * k + e] * 8.f : nd(rng);
      }
      std::vector<float> got;
      std::vector<int64_t> first;
      const int64_t pruned = greedy_against_full(w, x, m, threads, &got, &first);
      ASSERT_FALSE(HasFailure());
      ASSERT_EQ(first[0], top) << "row 0 points at the weight row of the largest norm";
      ASSERT_EQ(got[twin], got[top]) << "the twin row ties and is kept";
      if (m > 1) {
        EXPECT_GT(pruned, m * n / 2) << "greedy_logits skipped too little";
      } else {
        EXPECT_EQ(pruned, 0) << "one row: linear_f32 in full";
      }
    }
  }
}

// Several weights of different types in one dispatch (linear_f32_parts, the
// native step's qkv and gate_up of a mixed-type file): each part's columns of
// a wider output are the bits its own linear_f32 gives, bias included, for
// any row count and thread count; the columns beyond the parts are untouched.
TEST_P(GGUFTypesVariant, LinearF32PartsIsEachPartsOwnResult) {
  ActiveVariant guard;
  set_active_isa(GetParam());
  std::mt19937 rng(31);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int64_t k = 512;
  const QType types[] = {QType::kQ5_0, QType::kQ4_K, QType::kQ6_K, QType::kQ8_0, QType::kF16};
  const int64_t rows[] = {200, 64, 7, 97, 21};  // partial row groups between parts; 30+ rows: large enough for the pool
  std::vector<std::vector<uint8_t>> raws;
  std::vector<std::unique_ptr<QuantizedWeight>> ws;
  std::vector<const QuantizedWeight*> parts;
  int64_t n = 0;
  for (int i = 0; i < 5; ++i) {
    raws.push_back(random_blocks(types[i], rows[i], k, rng));
    ws.push_back(std::make_unique<QuantizedWeight>(raws.back().data(), types[i], rows[i], k));
    parts.push_back(ws.back().get());
    n += rows[i];
  }
  const int64_t ldo = n + 5;
  std::vector<float> bias(n);
  for (auto& v : bias) v = nd(rng);
  for (int64_t m : {int64_t{1}, int64_t{5}, int64_t{30}, int64_t{64}}) {
    std::vector<float> x(m * k);
    for (auto& v : x) v = nd(rng);
    for (int threads : {1, 2}) {
      std::vector<float> out(m * ldo, 123.f);
      QuantizedWeight::linear_f32_parts(parts, x.data(), m, out.data(), ldo, bias.data(), threads,
                                        active_isa().gemm());
      int64_t col = 0;
      for (int i = 0; i < 5; ++i) {
        std::vector<float> own(m * rows[i]), b(bias.begin() + col, bias.begin() + col + rows[i]);
        auto ba = arg(b, {rows[i]}, DType::kFloat32, "bias");
        ws[i]->linear_f32(arg(x, {m, k}, DType::kFloat32, "x"), arg(own, {m, rows[i]}, DType::kFloat32, "out"), &ba,
                          threads);
        for (int64_t r = 0; r < m; ++r) {
          ASSERT_EQ(std::memcmp(out.data() + r * ldo + col, own.data() + r * rows[i], rows[i] * 4), 0)
              << qtype_name(types[i]) << " m=" << m << " threads=" << threads << " row " << r;
        }
        col += rows[i];
      }
      for (int64_t r = 0; r < m; ++r) {
        for (int64_t j = n; j < ldo; ++j) ASSERT_EQ(out[r * ldo + j], 123.f) << "column " << j << " written";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, GGUFTypesVariant, ::testing::Values("baseline", "neon", "neon_dotprod", "avx2", "avx_vnni", "avx512_vnni"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
