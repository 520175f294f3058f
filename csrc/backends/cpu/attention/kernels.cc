// The CPU attention kernels, compiled once per ISA variant (kernel_table.h):
// CMake builds this file several times with PAGEDSERVE_ISA set to baseline,
// avx2, avx512 (x86-64) or native, each with its own -m flags; the hot loops
// are plain C++ with `omp simd` hints that the compiler vectorises for that ISA.
//
// Algorithm: online softmax over the blocks named by the block table (running
// max m, running sum l, float32 accumulator; Milakov & Gimelshein 2018,
// FlashAttention, Dao et al. 2022), K/V read in place. Long decodes split
// along the KV length are merged by log-sum-exp (flash-decoding, Dao et al. 2023).
//
// Block sizes 16 and 32 with head_dim 64, 128 or 256 take the tile path: a work
// item's (g1 - g0) * q_len query rows (its query heads of a KV head's group,
// each of its query tokens) go through each span of kTileKeys keys (two blocks of 16) in
// tiles of several rows, so every key and value row is loaded once per tile
// rather than once per row, and the tile's scores and accumulators stay in
// vector registers with enough independent FMA chains to hide their latency;
// the softmax sums are kept per key lane. The blocks the next tile step reads
// (the next work item's first ones at an item's end) are prefetched meanwhile:
// blocks sit anywhere in the pool, so the hardware prefetchers cannot guess
// them. bfloat16 blocks are widened to float once per tile. Other shapes take
// the generic path, one query row and one block at a time.
//
// Everything but the table getter has internal linkage and no standard-library
// template is used, so no symbol compiled for one ISA can stand in for
// another's (tests/cpp/check_isa_objects.cmake verifies the objects).
#include <math.h>
#include <string.h>

#include <cstdint>

#include "backends/cpu/attention/kernel_table.h"
#include "backends/cpu/runtime/scalar_convert.h"

#ifndef PAGEDSERVE_ISA
#error "PAGEDSERVE_ISA must name the variant this file is compiled for"
#endif

namespace pagedserve {
namespace cpu {
namespace {


inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
inline float fmax2(float a, float b) { return a > b ? a : b; }

inline void load(const float* src, float* dst, int64_t n) { memcpy(dst, src, n * sizeof(float)); }
inline void load(const bf16* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
}
inline void store(const float* src, float* dst, int64_t n) { memcpy(dst, src, n * sizeof(float)); }
inline void store(const float* src, bf16* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
}

// s[t] = q . k_t for t < n, from a transposed key block kt[i * bs + t]
// (generic path): vector FMAs across the keys, no horizontal sums.
void block_scores(const float* q, const float* kt, int n, int d, int bs, float* s) {
  for (int t = 0; t < n; ++t) s[t] = 0.f;
  for (int i = 0; i < d; ++i) {
    const float qi = q[i];
    const float* row = kt + static_cast<int64_t>(i) * bs;
#pragma omp simd
    for (int t = 0; t < n; ++t) s[t] += qi * row[t];
  }
}

// s[t] = cap * tanh(s[t] / cap) for t < n (attention logit soft-capping, Gemma 2).
void soft_cap(float* s, int n, float cap) {
  const float inv = 1.f / cap;
  for (int t = 0; t < n; ++t) s[t] = cap * tanhf(s[t] * inv);
}

// max_t s[t] (s non-empty).
float block_max(const float* s, int n) {
  float m = s[0];
#pragma omp simd reduction(max : m)
  for (int t = 1; t < n; ++t) m = s[t] > m ? s[t] : m;
  return m;
}

// exp(x) for x <= 0 (softmax arguments: a score minus the running max), 0 below
// -87 (where float32's exp is subnormal or 0); scalar_convert.h's exp_poly
// otherwise.
inline float exp_or_zero(float x) {
  const bool underflow = x < -87.0f;
  return underflow ? 0.f : exp_poly(underflow ? -87.0f : x);
}

// s[t] = exp(s[t] - m) for t < n (all s[t] <= m, finite); returns the sum.
float block_exp(float* s, int n, float m) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int t = 0; t < n; ++t) {
    s[t] = exp_or_zero(s[t] - m);
    sum += s[t];
  }
  return sum;
}

// acc = acc * alpha + sum_t p[t] * v[t]
void block_accumulate(float* acc, float alpha, const float* p, const float* v, int n, int d) {
#pragma omp simd
  for (int i = 0; i < d; ++i) acc[i] *= alpha;
  for (int t = 0; t < n; ++t) {
    const float pt = p[t];
    const float* vt = v + static_cast<int64_t>(t) * d;
#pragma omp simd
    for (int i = 0; i < d; ++i) acc[i] += pt * vt[i];
  }
}

// The online-softmax update for one row over a block's n scores: turns s into
// exp(s - m_new), updates the running max m and sum l, returns the factor
// alpha = exp(m_old - m_new) the accumulator must be scaled by (0 on the first block).
inline float online_softmax_step(float* s, int n, float* m, float* l) {
  const float m_new = fmax2(*m, block_max(s, n));
  const float alpha = __builtin_isinf(*m) ? 0.f : expf(*m - m_new);
  *l = *l * alpha + block_exp(s, n, m_new);
  *m = m_new;
  return alpha;
}

// Floats in one vector register of the ISA this object is compiled for; it
// only sizes the tiles below (the code itself is plain C++ the compiler
// vectorises).
#if defined(__AVX512F__)
constexpr int kVecFloats = 16;
#elif defined(__AVX__)
constexpr int kVecFloats = 8;
#else
constexpr int kVecFloats = 4;  // SSE2, NEON
#endif

// Vector registers a tile step keeps its scores or accumulators in: 16 of
// AVX-512's 32, 12 of the 16 of AVX2 and SSE2 (the rest hold the loaded keys
// or values and the broadcast query or probability).
constexpr int kAccRegs = kVecFloats >= 16 ? 16 : 12;
// Tile shapes: a tile step (below) scores kKeys(BS) keys, NB = kKeys / BS
// blocks, for up to kRows(BS) query rows at once.
constexpr int kMaxTileKeys = kVecFloats >= 8 ? kTileKeys : kTileKeys / 2;  // <= kTileKeys (the scratch)
constexpr int kKeys(int bs) { return bs < kMaxTileKeys ? kMaxTileKeys : bs; }
constexpr int kRows(int bs) {
  const int vecs = kKeys(bs) / kVecFloats;  // one row's score vectors
  const int rows = vecs >= kAccRegs ? 1 : kAccRegs / vecs;
  return rows < 8 ? rows : 8;
}
// How many tiles ahead a tile step prefetches KV blocks, and into which cache
// (__builtin_prefetch's locality: 2 = prefetcht1, L2; 1 tile into L2 measured
// best: docs/benchmarks.md, "Behind the code").
constexpr int kPrefetchTiles = 1;
constexpr int kPrefetchLocality = 2;

constexpr int pow2_floor(int x) { return x >= 2 ? 2 * pow2_floor(x / 2) : 1; }
constexpr int clamp_int(int x, int lo, int hi) { return x < lo ? lo : (x > hi ? hi : x); }

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return bf16_to_float(x); }
inline float from_float(float x, const float*) { return x; }
inline bf16 from_float(float x, const bf16*) { return float_to_bf16(x); }

// The scores s[r][t] = q[r] . k_t of a tile step (below) for the keys of its
// first NBA of NB blocks (the others' lanes are set to 0: no row sees them);
// prefetches the blocks pf names (nullptr: none) meanwhile.
template <int BS, int D, int R, int NB, int NBA>
void tile_scores(const float* q, const float* const* kt, const float* const* pf, float (*s)[NB * BS]) {
  constexpr int KEYS = NB * BS;
  // One partial sum per score (the sum over i in order): a row's scores are then the same bits whatever
  // other rows share the tile (R) and whichever of its blocks the tile scores (NBA): batch invariance.
  // (KS = 12 / score vectors, up to 8, gave a lone row more FMA chains but other sums than in a full tile.)
  constexpr int KS = 1;
  constexpr int kRowBytes = BS * static_cast<int>(sizeof(float));  // one key row (i) of a block
  static_assert(D % KS == 0, "tile shape");
  float part[KS][R][NBA * BS];
  const char* next[2 * NB];  // local copies: the prefetches would make the compiler reload pf[b]
  for (int b = 0; b < 2 * NB; ++b) next[b] = pf != nullptr ? reinterpret_cast<const char*>(pf[b]) : nullptr;
  for (int i = 0; i < D; i += KS) {
    for (int k = 0; k < KS; ++k) {
      if (pf != nullptr && ((i + k) * kRowBytes) % 64 + kRowBytes >= 64) {
        // as many 64-byte lines of each next block per step as this step reads
        for (int b = 0; b < 2 * NB; ++b) {
          for (int o = 0; o < kRowBytes; o += 64) {
            __builtin_prefetch(next[b] + (i + k) * kRowBytes + o, 0, kPrefetchLocality);
          }
        }
      }
      for (int b = 0; b < NBA; ++b) {
        const float* krow = kt[b] + (i + k) * BS;
        if (i == 0) {  // first step: assign (a zeroing loop would become a memset call)
#pragma omp simd
          for (int t = 0; t < BS; ++t) {
            const float kv = krow[t];
            for (int r = 0; r < R; ++r) part[k][r][b * BS + t] = q[r * D + k] * kv;
          }
          continue;
        }
#pragma omp simd
        for (int t = 0; t < BS; ++t) {
          const float kv = krow[t];
          for (int r = 0; r < R; ++r) part[k][r][b * BS + t] += q[r * D + i + k] * kv;
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
#pragma omp simd
    for (int t = 0; t < NBA * BS; ++t) {
      float sum = part[0][r][t];
      for (int k = 1; k < KS; ++k) sum += part[k][r][t];
      s[r][t] = sum;
    }
    for (int t = NBA * BS; t < KEYS; ++t) s[r][t] = 0.f;
  }
}

// One tile step: R query rows against the KEYS = NB * BS keys of NB KV blocks
// (compile-time block_size BS, head_dim D; NB * BS = kKeys(BS)), the
// FlashAttention inner step for several rows at once. q, acc [R][D] and m [R]
// are the rows' scaled queries, accumulators and running maxima; lsum [R][KEYS]
// their running softmax sums, kept per key lane (summed once, at the end of
// the item, so no step pays for a horizontal sum). kt[b] / v[b] are block b's
// transposed keys [D][BS] and values [BS][D]. Row r sees keys [lo[r], n[r])
// of the tile (lo > 0 under a sliding window, n < KEYS at the causal edge or
// the end of the sequence) and is left unchanged when that range is empty;
// keys outside it get probability 0 whatever the cache holds there (slots past
// the sequence's end are never read as values). The value update runs over the
// union of the tile's rows' ranges, so a non-finite value row at a key one row
// sees and another does not reaches the other as 0 * inf = NaN, as it does in
// a dense masked softmax(QK^T) V; finite caches are unaffected.
// pf: nullptr, or the NB key and NB value blocks read next, prefetched while
// the scores are computed.
//
// Scores: each key row is loaded (and widened from bfloat16) once per step;
// a score is one sum over the head dimension in order, the same for a row
// whatever other rows share its tile (the R rows' score vectors are the
// independent FMA chains in flight). Softmax: the masked max, exp and sums run
// across the lanes. PV: the accumulator is updated in column chunks of DC
// floats held in registers, each value row loaded once per chunk.
template <int BS, int D, int R>
void tile_step(const float* q, const float* const* kt, const float* const* v, const int* lo, const int* n, float cap,
               const float* const* pf, float* m, float* lsum, float* acc) {
  constexpr int NB = kKeys(BS) / BS;
  constexpr int KEYS = NB * BS;
  constexpr int DC = clamp_int(pow2_floor(kAccRegs * kVecFloats / R), kVecFloats < D ? kVecFloats : D, D);
  static_assert(D % DC == 0, "tile shape");

  int kmin = KEYS, kmax = 0;  // the keys any row sees
  for (int r = 0; r < R; ++r) {
    if (n[r] <= lo[r]) continue;
    kmin = lo[r] < kmin ? lo[r] : kmin;
    kmax = n[r] > kmax ? n[r] : kmax;
  }
  float s[R][KEYS];
  // the causal edge or the item's end can hide the last block from every row
  if constexpr (NB > 1) {
    if (kmax <= (NB - 1) * BS) {
      tile_scores<BS, D, R, NB, NB - 1>(q, kt, pf, s);
    } else {
      tile_scores<BS, D, R, NB, NB>(q, kt, pf, s);
    }
  } else {
    tile_scores<BS, D, R, NB, NB>(q, kt, pf, s);
  }

  // online softmax per row
  float alpha[R];
  float p[R][KEYS];
  for (int r = 0; r < R; ++r) {
    const int lr = lo[r], nr = n[r];
    if (nr <= lr) {
      alpha[r] = 1.f;
      for (int t = 0; t < KEYS; ++t) p[r][t] = 0.f;
      continue;
    }
    if (cap > 0.f) soft_cap(s[r] + lr, nr - lr, cap);
    float bmax = -__builtin_inff();
#pragma omp simd reduction(max : bmax)
    for (int t = 0; t < KEYS; ++t) {
      const float x = t >= lr && t < nr ? s[r][t] : -__builtin_inff();
      bmax = x > bmax ? x : bmax;
    }
    const float m_old = m[r];
    const float m_new = fmax2(m_old, bmax);
    const float a = __builtin_isinf(m_old) ? 0.f : exp_or_zero(m_old - m_new);
    float* lr_sum = lsum + r * KEYS;
#pragma omp simd
    for (int t = 0; t < KEYS; ++t) {
      const float e = exp_or_zero(t >= lr && t < nr ? s[r][t] - m_new : -100.f);
      p[r][t] = e;
      lr_sum[t] = lr_sum[t] * a + e;
    }
    alpha[r] = a;
    m[r] = m_new;
  }
  if (kmax <= kmin) return;

  for (int c = 0; c < D; c += DC) {
    float o[R][DC];
    for (int r = 0; r < R; ++r) {
      const float ar = alpha[r];
#pragma omp simd
      for (int i = 0; i < DC; ++i) o[r][i] = acc[r * D + c + i] * ar;
    }
    for (int b = 0; b < NB; ++b) {  // per block, so the value rows' addresses are affine in t
      const int t0 = kmin > b * BS ? kmin - b * BS : 0;
      const int t1 = kmax < (b + 1) * BS ? kmax - b * BS : BS;
      for (int t = t0; t < t1; ++t) {
        const float* vt = v[b] + t * D + c;
        for (int r = 0; r < R; ++r) {
          const float pt = p[r][b * BS + t];
#pragma omp simd
          for (int i = 0; i < DC; ++i) o[r][i] += pt * vt[i];
        }
      }
    }
    for (int r = 0; r < R; ++r) {
#pragma omp simd
      for (int i = 0; i < DC; ++i) acc[r * D + c + i] = o[r][i];
    }
  }
}

using TileFn = void (*)(const float*, const float* const*, const float* const*, const int*, const int*, float,
                        const float* const*, float*, float*, float*);

// The tile step for R = rows (1..kRows(BS)) query rows.
template <int BS, int D, int R = 1>
TileFn tile_for_rows(int rows) {
  if constexpr (R > kRows(BS)) {
    return nullptr;
  } else {
    return rows == R ? &tile_step<BS, D, R> : tile_for_rows<BS, D, R + 1>(rows);
  }
}

// The specialised tile step for (block_size, head_dim, rows), or nullptr (generic path).
TileFn fixed_tile(int64_t bs, int64_t d, int rows) {
  if (bs == 16 && d == 64) return tile_for_rows<16, 64>(rows);
  if (bs == 16 && d == 128) return tile_for_rows<16, 128>(rows);
  if (bs == 32 && d == 64) return tile_for_rows<32, 64>(rows);
  if (bs == 32 && d == 128) return tile_for_rows<32, 128>(rows);
  if (bs == 16 && d == 256) return tile_for_rows<16, 256>(rows);  // Gemma 2 / 3
  if (bs == 32 && d == 256) return tile_for_rows<32, 256>(rows);
  return nullptr;
}

// Asks the cache hierarchy for n elements starting at p (one hint per 64-byte line).
template <typename T>
inline void prefetch_block(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(c + off);
}

// Scratch of one work item (kernel_scratch_floats sizes it), 64-byte aligned.
struct ItemScratch {
  float* qf;    // [rows][d] scaled queries
  float* acc;   // [rows][d] accumulators
  float* lsum;  // [rows][lanes] running sums per key lane (tile path)
  float* kf;    // [lanes * d] widened keys (bfloat16 caches)
  float* vf;    // [lanes * d] widened values
  float* m;     // [rows] running maxima
  float* l;     // [rows] running sums
  float* s;     // [bs] one row's scores (generic path)
};

ItemScratch carve_scratch(float* p, int64_t group, int64_t d, int64_t bs) {
  const int64_t rows = group * kQueryChunk, lanes = bs > kTileKeys ? bs : kTileKeys;
  ItemScratch sc;
  sc.qf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
  sc.acc = sc.qf + rows * d;
  sc.lsum = sc.acc + rows * d;
  sc.kf = sc.lsum + rows * lanes;
  sc.vf = sc.kf + lanes * d;
  sc.m = sc.vf + lanes * d;
  sc.l = sc.m + rows;
  sc.s = sc.l + rows;
  return sc;
}

// Where work item `it` reads its KV head's block j (K or V cache).
template <typename T>
inline const T* block_at(const KernelArgs& a, const T* cache, const WorkItem& it, int64_t j) {
  const int64_t block = a.block_tables[it.b * a.max_blocks + j];
  return cache + (block * a.num_kv_heads + it.hk) * a.block_size * a.head_dim;
}

// The first block of item `it`'s first tile. Tiles start at multiples of NB
// blocks wherever the item starts (under a sliding window, at the first block
// its first row sees): a row then meets the same tiles, the same online-softmax
// steps, in any item, alone or in a chunk (batch invariance); the leading
// blocks before the item's (at most NB - 1) are masked, as no row of the item
// sees them. Not a split's item: the keys before it are another split's.
template <int NB>
inline int64_t first_tile_block(const WorkItem& it) {
  return it.split >= 0 ? it.j0 : it.j0 - it.j0 % NB;
}

// The K and V blocks of the tile of item `it` starting at block j (NB blocks;
// before the item's first block or past its last, repeats of a block of the
// item, whose keys are masked: no row of the item sees those positions).
template <typename T, int NB>
inline void tile_blocks(const KernelArgs& a, const WorkItem& it, int64_t j, const T** k, const T** v) {
  const T* k_cache = static_cast<const T*>(a.k_cache);
  const T* v_cache = static_cast<const T*>(a.v_cache);
  for (int b = 0; b < NB; ++b) {
    const int64_t jb = j + b < it.j0 ? it.j0 : (j + b < it.j1 ? j + b : imax(j, it.j0));
    k[b] = block_at(a, k_cache, it, jb);
    v[b] = block_at(a, v_cache, it, jb);
  }
}

// dst[i] = src[i] for i < n (bfloat16 to float; n a multiple of 32), and a
// prefetch of the first pf_n elements of pf_a and pf_b (either may be
// nullptr) spread over the copy.
inline void widen(const bf16* src, float* dst, int64_t n, const bf16* pf_a, const bf16* pf_b, int64_t pf_n) {
  constexpr int kLine = 64 / sizeof(bf16);  // elements per 64-byte line
  const int64_t end = n > pf_n ? n : pf_n;
  for (int64_t c = 0; c < end; c += kLine) {
    if (pf_a != nullptr && c < pf_n) __builtin_prefetch(pf_a + c);
    if (pf_b != nullptr && c < pf_n) __builtin_prefetch(pf_b + c);
    if (c >= n) continue;
#pragma omp simd
    for (int i = 0; i < kLine; ++i) dst[c + i] = bf16_to_float(src[c + i]);
  }
}

// The keys [*lo, *n) of the n_valid keys starting at position k0 that a query
// at position qpos sees: causal, up to its own position; under a sliding
// window, not those at positions <= qpos - window.
inline void visible_keys(const KernelArgs& a, int64_t qpos, int64_t k0, int64_t n_valid, int64_t* lo, int64_t* n) {
  *n = a.causal ? imin(n_valid, qpos - k0 + 1) : n_valid;
  *lo = a.sliding_window > 0 ? imax(0, qpos - a.sliding_window + 1 - k0) : 0;
}

// The tile path (block_size and head_dim with a specialised tile step): walks
// the item's blocks NB at a time, each tile of kRows(BS) query rows in turn.
// next: the item this worker runs next (or nullptr); its first blocks are
// prefetched during this item's last tile.
template <typename T, int BS>
void run_tiles(const KernelArgs& a, const WorkItem& it, const WorkItem* next, const ItemScratch& sc,
               int64_t first_pos, int64_t seq_len) {
  constexpr int NB = kKeys(BS) / BS;
  constexpr int KEYS = NB * BS;
  constexpr int kTileRows = kRows(BS);
  const int64_t d = a.head_dim, nq = it.q1 - it.q0, rows = int64_t{it.g1 - it.g0} * nq;
  const int64_t ntiles = (rows + kTileRows - 1) / kTileRows;
  const TileFn full = fixed_tile(BS, d, static_cast<int>(imin(kTileRows, rows)));
  const TileFn last = fixed_tile(BS, d, static_cast<int>(rows - (ntiles - 1) * kTileRows));
  for (int64_t r = 0; r < rows * KEYS; ++r) sc.lsum[r] = 0.f;

  const int64_t j_first = first_tile_block<NB>(it), n_tiles = (it.j1 - j_first + NB - 1) / NB;
  for (int64_t j = j_first; j < it.j1; j += NB) {
    const T* kt[NB];
    const T* vt[NB];
    tile_blocks<T, NB>(a, it, j, kt, vt);
    // blocks sit anywhere in the pool: fetch the next tile's (this item's or the next one's) while computing
    const T* pf[2 * NB];
    bool has_next = true;
    {
      // kPrefetchTiles tiles ahead, in this item's tiles and then the next item's (from its own first tile)
      const int64_t ahead = (j - j_first) / NB + kPrefetchTiles - n_tiles;
      const int64_t next_first = next != nullptr ? first_tile_block<NB>(*next) : 0;
      if (ahead < 0) {
        tile_blocks<T, NB>(a, it, j + kPrefetchTiles * NB, pf, pf + NB);
      } else if (next != nullptr && next_first + ahead * NB < next->j1) {
        tile_blocks<T, NB>(a, *next, next_first + ahead * NB, pf, pf + NB);
      } else {
        has_next = false;
      }
    }
    // keys of this tile that exist and belong to the item
    const int64_t n_valid = imin(imin(KEYS, seq_len - j * BS), (it.j1 - j) * BS);
    const float* kf[NB];
    const float* vf[NB];
    const float* const* pf_tile = nullptr;  // what the first tile step prefetches
    if constexpr (sizeof(T) == sizeof(float)) {
      for (int b = 0; b < NB; ++b) {
        kf[b] = reinterpret_cast<const float*>(kt[b]);
        vf[b] = reinterpret_cast<const float*>(vt[b]);
      }
      if (has_next) pf_tile = reinterpret_cast<const float* const*>(pf);
    } else {  // bfloat16: widen the blocks once for every tile step, prefetching the next ones meanwhile
      for (int b = 0; b < NB; ++b) {
        kf[b] = sc.kf + b * BS * d;
        vf[b] = sc.vf + b * BS * d;
        const int64_t nv = imin(BS, n_valid - b * BS);  // <= 0: a repeated block, never read
        widen(kt[b], sc.kf + b * BS * d, nv > 0 ? BS * d : 0, has_next ? pf[b] : nullptr,
              has_next ? pf[NB + b] : nullptr, BS * d);
        widen(vt[b], sc.vf + b * BS * d, nv > 0 ? nv * d : 0, nullptr, nullptr, 0);
      }
    }
    int64_t qi = 0;  // query token (within the item) of the next row
    const float* const* pf_next = pf_tile;  // for the first tile step that runs
    for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
      const int R = static_cast<int>(imin(kTileRows, rows - r0));
      int lo[kTileRows], n[kTileRows];
      bool any = false;
      for (int k = 0; k < R; ++k) {
        int64_t lo_k, n_k;
        visible_keys(a, first_pos + it.q0 + qi, j * BS, n_valid, &lo_k, &n_k);
        if (++qi == nq) qi = 0;
        lo[k] = static_cast<int>(lo_k);
        n[k] = static_cast<int>(n_k);
        any = any || n[k] > lo[k];
      }
      if (!any) continue;
      (r0 + R == rows ? last : full)(sc.qf + r0 * d, kf, vf, lo, n, a.softcap, pf_next, sc.m + r0,
                                     sc.lsum + r0 * KEYS, sc.acc + r0 * d);
      pf_next = nullptr;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < KEYS; ++t) sum += sc.lsum[r * KEYS + t];
    sc.l[r] = sum;
  }
}

// The generic path: one query row and one block at a time.
template <typename T>
void run_rows(const KernelArgs& a, const WorkItem& it, const ItemScratch& sc, int64_t first_pos, int64_t seq_len) {
  const int64_t d = a.head_dim, bs = a.block_size, nq = it.q1 - it.q0, rows = int64_t{it.g1 - it.g0} * nq;
  const T* k_cache = static_cast<const T*>(a.k_cache);
  const T* v_cache = static_cast<const T*>(a.v_cache);
  for (int64_t j = it.j0; j < it.j1; ++j) {
    if (j + 1 < it.j1) {  // blocks sit anywhere in the pool: fetch the next one while computing this one
      prefetch_block(block_at(a, k_cache, it, j + 1), bs * d);
      prefetch_block(block_at(a, v_cache, it, j + 1), bs * d);
    }
    const int64_t n_valid = imin(bs, seq_len - j * bs);
    const float* kb;
    const float* vb;
    if constexpr (sizeof(T) == sizeof(float)) {
      kb = reinterpret_cast<const float*>(block_at(a, k_cache, it, j));
      vb = reinterpret_cast<const float*>(block_at(a, v_cache, it, j));
    } else {  // bf16: widen the block once, reuse it for every row
      load(block_at(a, k_cache, it, j), sc.kf, bs * d);
      load(block_at(a, v_cache, it, j), sc.vf, n_valid * d);
      kb = sc.kf;
      vb = sc.vf;
    }
    for (int64_t r = 0; r < rows; ++r) {
      int64_t lo, n;
      visible_keys(a, first_pos + it.q0 + r % nq, j * bs, n_valid, &lo, &n);
      if (n <= lo) continue;
      float* s = sc.s;
      block_scores(sc.qf + r * d, kb, static_cast<int>(n), static_cast<int>(d), static_cast<int>(bs), s);
      if (a.softcap > 0.f) soft_cap(s + lo, static_cast<int>(n - lo), a.softcap);
      const float alpha = online_softmax_step(s + lo, static_cast<int>(n - lo), sc.m + r, sc.l + r);
      block_accumulate(sc.acc + r * d, alpha, s + lo, vb + lo * d, static_cast<int>(n - lo), static_cast<int>(d));
    }
  }
}

template <typename T>
void run_item_typed(const KernelArgs& a, const WorkItem& it, const WorkItem* next, float* scratch,
                    float* partial_acc, Partial* partial_ml) {
  const int64_t d = a.head_dim, bs = a.block_size, G = a.group, heads = it.g1 - it.g0;
  const int64_t nq = it.q1 - it.q0, rows = heads * nq;
  const ItemScratch sc = carve_scratch(scratch, G, d, bs);
  const T* query = static_cast<const T*>(a.query);
  const int64_t seq_len = a.seq_lens[it.b];
  const int64_t q_start = a.query_start_loc[it.b];
  const int64_t q_len = a.query_start_loc[it.b + 1] - q_start;
  const int64_t first_pos = seq_len - q_len;  // position of query token 0

  for (int64_t gi = 0; gi < heads; ++gi) {
    for (int64_t qi = 0; qi < nq; ++qi) {
      const int64_t r = gi * nq + qi;
      const int64_t tok = q_start + it.q0 + qi, head = it.hk * G + it.g0 + gi;
      const T* src = query + tok * a.query_stride_token + head * a.query_stride_head;
      float* qr = sc.qf + r * d;
      float* acc = sc.acc + r * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) {
        qr[i] = to_float(src[i]) * a.scale;
        acc[i] = 0.f;
      }
      sc.m[r] = -__builtin_inff();
      sc.l[r] = 0.f;
    }
  }
  T* out = static_cast<T*>(a.out);
  if (bs == 16 && fixed_tile(bs, d, 1) != nullptr) {
    run_tiles<T, 16>(a, it, next, sc, first_pos, seq_len);
  } else if (bs == 32 && fixed_tile(bs, d, 1) != nullptr) {
    run_tiles<T, 32>(a, it, next, sc, first_pos, seq_len);
  } else {
    run_rows<T>(a, it, sc, first_pos, seq_len);
  }
  float* acc = sc.acc;
  for (int64_t r = 0; r < rows; ++r) {
    if (partial_acc != nullptr) {  // unnormalised state, merged later
      for (int64_t i = 0; i < d; ++i) partial_acc[r * d + i] = acc[r * d + i];
      partial_ml[r] = {sc.m[r], sc.l[r]};
      continue;
    }
    const float inv = sc.l[r] > 0.f ? 1.f / sc.l[r] : 0.f;
    const int64_t gi = r / nq, qi = r % nq;
    const int64_t tok = q_start + it.q0 + qi, head = it.hk * G + it.g0 + gi;
    T* dst = out + tok * a.out_stride_token + head * a.out_stride_head;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) dst[i] = from_float(acc[r * d + i] * inv, dst);
  }
}

template <typename T>
void merge_typed(const KernelArgs& a, int32_t b, int32_t hk, int32_t splits, const float* partial_acc,
                 const Partial* partial_ml, float* scratch) {
  const int64_t d = a.head_dim, G = a.group;
  T* out = static_cast<T*>(a.out);
  for (int64_t gi = 0; gi < G; ++gi) {
    float m_max = -__builtin_inff();
    for (int32_t sp = 0; sp < splits; ++sp) m_max = fmax2(m_max, partial_ml[sp * G + gi].m);
    for (int64_t i = 0; i < d; ++i) scratch[i] = 0.f;
    float l_sum = 0.f;
    for (int32_t sp = 0; sp < splits; ++sp) {
      const Partial& p = partial_ml[sp * G + gi];
      if (p.l == 0.f) continue;
      const float w = expf(p.m - m_max);
      l_sum += w * p.l;
      const float* acc = partial_acc + (sp * G + gi) * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) scratch[i] += w * acc[i];
    }
    const float inv = l_sum > 0.f ? 1.f / l_sum : 0.f;
    for (int64_t i = 0; i < d; ++i) scratch[i] *= inv;
    const int64_t tok = a.query_start_loc[b], head = hk * G + gi;
    store(scratch, out + tok * a.out_stride_token + head * a.out_stride_head, d);
  }
}

void run_item(const KernelArgs& a, const WorkItem& it, const WorkItem* next, float* scratch, float* partial_acc,
              Partial* partial_ml) {
  if (a.dtype == DType::kFloat32) {
    run_item_typed<float>(a, it, next, scratch, partial_acc, partial_ml);
  } else {
    run_item_typed<bf16>(a, it, next, scratch, partial_acc, partial_ml);
  }
}

void merge_splits(const KernelArgs& a, int32_t b, int32_t hk, int32_t splits, const float* partial_acc,
                  const Partial* partial_ml, float* scratch) {
  if (a.dtype == DType::kFloat32) {
    merge_typed<float>(a, b, hk, splits, partial_acc, partial_ml, scratch);
  } else {
    merge_typed<bf16>(a, b, hk, splits, partial_acc, partial_ml, scratch);
  }
}

const KernelTable kTable{PS_STR(PAGEDSERVE_ISA), &run_item, &merge_splits};

}  // namespace

const KernelTable& PS_CAT(kernel_table_, PAGEDSERVE_ISA)() { return kTable; }

}  // namespace cpu
}  // namespace pagedserve
