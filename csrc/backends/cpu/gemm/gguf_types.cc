// GGUF block types (gguf_types.h, quant_linear.h): names, sizes and the exact
// decoding of the types kept as u4k / u5f / i6f tiles. Built with -ffp-contract=off (the
// products are written out; none may fuse with a later add).
#include "backends/cpu/gemm/gguf_types.h"

#include <cstring>
#include <string>

#include "core/errors.h"
#include "backends/cpu/runtime/scalar_convert.h"

namespace pagedserve {
namespace cpu {
namespace {

struct TypeInfo {
  QType type;
  const char* name;
  int64_t block_bytes, block_elements;
};

constexpr TypeInfo kTypes[] = {
    {QType::kQ4_0, "q4_0", 18, 32},   {QType::kQ4_1, "q4_1", 20, 32},   {QType::kQ5_0, "q5_0", 22, 32},
    {QType::kQ5_1, "q5_1", 24, 32},   {QType::kQ8_0, "q8_0", 34, 32},   {QType::kQ4_K, "q4_k", 144, 256},
    {QType::kQ5_K, "q5_k", 176, 256}, {QType::kQ6_K, "q6_k", 210, 256},
    // unquantised: a "block" is 32 consecutive elements (the tiles' k-step)
    {QType::kF32, "f32", 128, 32},    {QType::kF16, "f16", 64, 32},     {QType::kBF16, "bf16", 64, 32},
};

const TypeInfo& info(QType q) {
  for (const TypeInfo& t : kTypes) {
    if (t.type == q) return t;
  }
  throw KernelArgumentError("unknown GGUF block type");
}

float fp16_at(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return half_to_float(v);
}

// Q4_0 / Q4_1 / Q5_0 / Q5_1 (32 elements): element e < 16 is the low nibble of
// qs[e], e >= 16 the high nibble of qs[e - 16]; the 5-bit types add bit e of
// the little-endian uint32 qh as bit 4.
void decode_small(QType q, const uint8_t* b, int8_t* qs, float* d, float* m) {
  const bool has_min = q == QType::kQ5_1;
  const bool five = q != QType::kQ4_0;
  const int offset = q == QType::kQ4_0 ? 8 : q == QType::kQ5_0 ? 16 : 0;
  const float scale = fp16_at(b);
  const float minimum = has_min ? fp16_at(b + 2) : -0.0f;
  const uint8_t* p = b + (has_min ? 4 : 2);
  uint32_t qh = 0;
  if (five) {
    std::memcpy(&qh, p, 4);
    p += 4;
  }
  for (int e = 0; e < 32; ++e) {
    int v = e < 16 ? (p[e] & 0x0F) : (p[e - 16] >> 4);
    if (five) v |= static_cast<int>((qh >> e) & 1u) << 4;
    qs[e] = static_cast<int8_t>(v - offset);
  }
  d[0] = d[1] = scale;
  m[0] = m[1] = minimum;
}

// v as a float16, exactly (false where it is not one: out of range or too many bits).
bool exact_half(float v, uint16_t* out) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const float a = v < 0 ? -v : v;
  if (a == 0.f) {
    *out = sign;
    return true;
  }
  const int exp = static_cast<int>((bits >> 23) & 0xFF) - 127;
  if (exp >= -14 && exp <= 15) {  // a normal float16: the low 13 mantissa bits must be zero
    if ((bits & 0x1FFFu) != 0) return false;
    *out = static_cast<uint16_t>(sign | (exp + 15) << 10 | ((bits >> 13) & 0x3FFu));
    return true;
  }
  const float steps = a * 16777216.f;  // a subnormal float16: a multiple of 2^-24 below 2^-14
  if (exp > 15 || steps >= 1024.f || steps != static_cast<float>(static_cast<int>(steps))) return false;
  *out = static_cast<uint16_t>(sign | static_cast<int>(steps));
  return true;
}

// Q4_K / Q5_K's 6-bit scale and minimum of sub-block j (0..7) from the 12 scale bytes.
void scale_min_k4(const uint8_t* s, int j, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q4_K (144 bytes: fp16 d, fp16 dmin, 12 scale bytes, 128 nibble bytes) and
// Q5_K (176: the same with 32 high-bit bytes before the nibbles), 256
// elements in 8 sub-blocks of 32: sub-block 2c + h is nibble h of bytes
// 32c .. 32c + 31; Q5_K's bit 4 of element i of sub-block s is bit s of qh[i].
void decode_k4(QType q, const uint8_t* b, int8_t* qs, float* d, float* m) {
  const float dd = fp16_at(b), dmin = fp16_at(b + 2);
  const uint8_t* scales = b + 4;
  const bool five = q == QType::kQ5_K;
  const uint8_t* qh = b + 16;
  const uint8_t* ql = b + 16 + (five ? 32 : 0);
  for (int s = 0; s < 8; ++s) {
    int sc, mn;
    scale_min_k4(scales, s, &sc, &mn);
    const float ds = dd * static_cast<float>(sc);      // exact: 11 x 6 bits
    const float dm = dmin * static_cast<float>(mn);    // exact
    d[2 * s] = d[2 * s + 1] = ds;
    m[2 * s] = m[2 * s + 1] = -dm;
    for (int i = 0; i < 32; ++i) {
      int v = (ql[32 * (s / 2) + i] >> (4 * (s % 2))) & 0x0F;
      if (five) v |= ((qh[i] >> s) & 1) << 4;
      qs[32 * s + i] = static_cast<int8_t>(v);
    }
  }
}

// Q6_K (210 bytes: 128 low-nibble bytes ql, 64 high-2-bit bytes qh, 16 int8
// scales, fp16 d), 256 elements as two halves of 128: element j of half h
// has low bits (ql[64 h + j % 64] >> 4 (j / 64)) & 15 and high bits
// (qh[32 h + j % 32] >> 2 (j / 32)) & 3; q - 32 with scale d * scales[f / 16].
void decode_q6_k(const uint8_t* b, int8_t* qs, float* d, float* m) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float dd = fp16_at(b + 208);
  for (int h = 0; h < 2; ++h) {  // element j = 32 l + i of half h: each (h, l) a contiguous run of 32
    for (int l = 0; l < 4; ++l) {
      const uint8_t* low = ql + 64 * h + 32 * (l & 1);
      const int shift = 4 * (l >> 1);
      for (int i = 0; i < 32; ++i) {
        const int lo = (low[i] >> shift) & 0x0F;
        const int hi = (qh[32 * h + i] >> (2 * l)) & 0x03;
        qs[128 * h + 32 * l + i] = static_cast<int8_t>((lo | (hi << 4)) - 32);
      }
    }
  }
  for (int s = 0; s < 16; ++s) {
    d[s] = dd * static_cast<float>(scales[s]);  // exact: 11 x 8 bits
    m[s] = -0.0f;
  }
}

}  // namespace

QType parse_qtype(const std::string& name) {
  std::string lower = name;
  for (char& c : lower) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  for (const TypeInfo& t : kTypes) {
    if (lower == t.name) return t.type;
  }
  throw KernelArgumentError("qtype must be one of q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k, f32, f16, bf16, "
                            "got '" + name + "'");
}

const char* qtype_name(QType q) { return info(q).name; }

int64_t qtype_block_bytes(QType q) { return info(q).block_bytes; }

int64_t qtype_block_elements(QType q) { return info(q).block_elements; }

TileFormat tile_format_of(QType q) {
  switch (q) {
    case QType::kQ4_1: return TileFormat::kQ4_1;
    case QType::kQ8_0: return TileFormat::kQ8_0;
    case QType::kQ4_0: return TileFormat::kQ4_1;  // as_stored_blocks: m = -8 d (kQ8_0 where that is no float16)
    case QType::kQ5_0: return TileFormat::kQ8_0;  // as_stored_blocks: q - 16 as a byte
    case QType::kQ4_K: return TileFormat::kU4K;  // 0..15, 6-bit scales and minima of fp16 ones
    case QType::kQ5_1:
    case QType::kQ5_K: return TileFormat::kU5F;  // 0..31 with a minimum
    case QType::kQ6_K: return TileFormat::kI6F;  // q - 32 (6 bits), a scale per 16 elements
    case QType::kF32: return TileFormat::kF32;
    case QType::kF16: return TileFormat::kF16;
    case QType::kBF16: return TileFormat::kBF16;
  }
  return TileFormat::kI6F;
}

QType as_stored_blocks(QType q, const uint8_t* src, int64_t blocks, uint8_t* dst) {
  if (q != QType::kQ4_0 && q != QType::kQ5_0) throw KernelArgumentError("as_stored_blocks: Q4_0 or Q5_0 only");
  int8_t qs[32];
  float d[2], m[2];
  if (q == QType::kQ4_0) {  // Q4_1 where every -8 d is a float16: same d and nibbles, m = -8 d
    bool exact = true;
    for (int64_t i = 0; i < blocks && exact; ++i) {
      const uint8_t* b = src + i * 18;
      uint16_t mh = 0;  // meaningful only where exact_half says so
      exact = exact_half(-8.f * fp16_at(b), &mh);
      uint8_t* o = dst + i * 20;
      std::memcpy(o, b, 2);
      std::memcpy(o + 2, &mh, 2);
      std::memcpy(o + 4, b + 2, 16);
    }
    if (exact) return QType::kQ4_1;
  }
  for (int64_t i = 0; i < blocks; ++i) {  // Q8_0: the same d, the signed quant as a byte
    const uint8_t* b = src + i * qtype_block_bytes(q);
    decode_small(q, b, qs, d, m);
    uint8_t* o = dst + i * 34;
    std::memcpy(o, b, 2);
    std::memcpy(o + 2, qs, 32);
  }
  return QType::kQ8_0;
}

void q4_k_scales(const uint8_t* block, float* d, float* dmin, uint8_t* sc, uint8_t* mn) {
  *d = fp16_at(block);
  *dmin = fp16_at(block + 2);
  for (int s = 0; s < 8; ++s) {
    int a, b;
    scale_min_k4(block + 4, s, &a, &b);
    sc[s] = static_cast<uint8_t>(a);
    mn[s] = static_cast<uint8_t>(b);
  }
}

void decode_row(QType q, const uint8_t* row, int64_t k, int8_t* qs, float* d, float* m) {
  const int64_t be = qtype_block_elements(q), bb = qtype_block_bytes(q);
  for (int64_t b = 0; b < k / be; ++b, row += bb, qs += be, d += be / 16, m += be / 16) {
    switch (q) {
      case QType::kQ4_0:
      case QType::kQ5_0:
      case QType::kQ5_1: decode_small(q, row, qs, d, m); break;
      case QType::kQ4_K:
      case QType::kQ5_K: decode_k4(q, row, qs, d, m); break;
      case QType::kQ6_K: decode_q6_k(row, qs, d, m); break;
      default: throw KernelArgumentError(std::string(qtype_name(q)) + " keeps its own tiles (no decoding to quants and scales)");
    }
  }
}

}  // namespace cpu
}  // namespace pagedserve
