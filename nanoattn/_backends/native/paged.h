// The paged forward pass (nanoattn.paged_attention): the queries of B sequences,
// token-major, against keys and values read straight from a pool of pages through
// each sequence's page table; no gathered copy of any sequence's keys exists.
//
// Shapes (docs/conventions.md's letters): q (Tq, N, H); key and value pages (P,
// page_size, K, H), or one combined pool (P, page_size, 2, K, H) whose token rows hold
// their keys then their values (Paged::key_row, value_row: the strides of token rows);
// table (B, M) int32, sequence b's j-th page; kv_lengths (B,), the keys
// sequence b holds; starts (B + 1,), sequence b's queries are rows starts[b] ..
// starts[b+1] - 1, at positions kv_lengths[b] - q_len + i; real (Tq,) uint8, the rows
// that belong to exactly one valid sequence (the others are padding, or broken rows the
// caller poisons). Outputs, float32 whatever the inputs' type: out (Tq, N, H) and the
// log-sum-exp (Tq, N); a row that is not real, or sees no key, gives zeros and -inf.
//
// One task per (sequence b, key/value head kh, block of up to kPagedVectors / G of b's
// query rows): the G query heads of kh and the block's rows are its query vectors, so
// each key and value row of the pool is read once per task (once per (b, kh) in a decode
// step), a tile of keys at a time (kPagedKeys), and dotted with every query vector
// (bfloat16, int8 and float8 widened in registers), then the online softmax
// (FlashAttention-2) in float32. A decode step's task takes several key/value heads
// (those side by side in a token row: one run of memory a token, which the hardware
// streams, where one head's rows are scattered K * H apart), its products walk a tile's
// rows front to back (paged_tile), and a long task is cut along its keys into pieces
// merged after (split_tasks).
// A task reads only the keys its rows may see (keys 0 .. kv_lengths[b] - 1, narrowed by
// the causal band or the window): never a page past those the sequence holds, nor a
// slot past its length. Every page id is clamped into [0, P), lengths into [0, M *
// page_size] and starts into [0, Tq], so that no input, however wrong, reads outside
// the arrays (the caller also replaces bad ids and makes those rows NaN).
//
// A token tree (tree_parents) gives each row a position of its own (the committed length
// plus its depth) and a bitmask of its ancestors in its chunk: the tiles that hold chunk
// keys are masked column by column (paged_mask), the others by the band as above.
//
// The FFI handlers that check a call and run this pass are attention.cc's.
//
// Included by attention.cc only, in its one translation unit: the code sits in an
// unnamed namespace there as here, so that every function keeps internal linkage.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

#include "quantized.h"
#include "simd.h"
#include "threads.h"

namespace {

constexpr int kPagedVectors = 64;  // query vectors (rows x heads of a group) per task
// The keys of a tile (the scratch's columns), in every type (one order of summation: a
// widened bfloat16 step equals the float32 step on the widened numbers). 32 rather than
// 16 halves the online softmax's bookkeeping a key (maxima, rescaled outputs, a scalar
// exp): 2-core AMD EPYC Zen 4, the B = 16 decode with its pages in cache 9.2 against
// 9.9 ms (float32) and 9.6 against 10.8 (bfloat16) with 16.
constexpr int kPagedKeys = 32;
constexpr int kPagedBlock = 4;     // query vectors per register tile of the products
constexpr int kPagedChunk = 4;     // keys of a tile whose every head is computed before the next
// The keys whose values (every head of the task) are taken before the next ones: 4 on
// AVX-512, 8 on AVX2, where the outputs loaded and stored once a chunk cost more (2-core
// Zen 4 built for AVX2, the B = 16 bfloat16 decode 1.04x-1.06x with 8; with AVX-512,
// float32, 8 measured the same as 4).
constexpr int kValuesChunk = VW == 8 ? 8 : 4;
constexpr int kPagedAhead = 1;     // tiles whose lines are fetched ahead of the one computed
static_assert(kPagedKeys % VW == 0 && kPagedKeys % 2 == 0, "tiles must hold whole vectors");
static_assert(kPagedBlock == 4 && kPagedChunk == 4,
              "paged_dots sums 4 query vectors x 4 keys (hsum16) or x 2 keys (hsum8)");

// The next tile's every line is fetched a few rows at a time as a tile is computed
// (PagedTiles::fetch, spread over paged_tile's chunks): asked for at once, the lines
// stalled the core, and only the first lines of each row (256 bytes, leaving the
// hardware to stream the rest) left bfloat16 rows unfetched. The B = 16 decode (N = 32
// on K = 8, H = 128, 512-8192 keys, pages of 16), 2-core Intel Xeon (family 6 model 207,
// AVX-512), each way alone in turn, three rounds: bfloat16 16.2-20.0 ms against
// 23.3-31.0 with the first lines, float32 25.7-29.9 against 27.9-32.0; built for AVX2,
// 23.0-24.9 against 36.4-41.6 and 30.0-32.0 against 33.9-35.8; MHA (N = K = 8) float32
// 26.8-27.6 against 32.4-33.3; B = 1 at 32768 keys bfloat16 8.4-8.7 against 14.3-15.0.
// On the AMD EPYC Zen 4 int8 went from 15.4 to 12.2 ms so, float32 and bfloat16 within
// 3% (22.3 against 22.2 ms, 18.9 against 18.3).

// A paged call: sizes, rules and the run-time inputs. Hv (padded: Hvp) is the values'
// width, H's unless the values have a width of their own (multi-head latent attention).
struct Paged {
  int64_t Tq, N, K, G, H, Hp, Hv, Hvp, P, page_size, B, M;
  // The elements from one token's row of a pool to the next: K * H (keys) and K * Hv
  // (values) for two pools; 2 * K * H for a combined pool (P, page_size, 2, K, H), where
  // a token's values follow its keys and the values' pointer starts K * H in.
  int64_t key_row = 0, value_row = 0;
  bool combined = false;
  int64_t values_start() const { return combined ? K * H : 0; }
  float scale, soft_cap;  // soft_cap 0: none
  int64_t left, right;    // the band, -1: unbounded
  const int32_t* table;   // (B, M)
  const int32_t* kv_lengths;  // (B,)
  const int32_t* starts;  // (B + 1,)
  const uint8_t* real;    // (Tq,)
  // the position of each sequence's first query (B,); null: its last q_len positions,
  // kv_lengths[b] - q_len (a dense cache read in place gives its rows' offsets)
  const int32_t* offsets = nullptr;
  // quantized pools' scales (P, page_size, K), float32; null for float pools
  const float* key_scales = nullptr;
  const float* value_scales = nullptr;
  // a token tree (tree_parents): row t's position (its sequence's committed length plus
  // its depth) at tree[t * tree_stride], then the bits of its ancestors (itself
  // included) among its chunk's tokens, chunk token i at bit i % 32 of word 1 + i / 32
  // (a token past the row's words: not an ancestor); null: no tree (a row's position is
  // its slot). With offsets (a dense cache read in place) a row's chunk starts at its
  // offset, and its band must end by its chunk's last slot (the caller's: causal).
  const int32_t* tree = nullptr;
  int64_t tree_stride = 0;
  int64_t tree_position(int64_t t) const { return tree[t * tree_stride]; }
  bool tree_sees(int64_t t, int64_t i) const {
    if (i / 32 >= tree_stride - 1) return false;
    return (static_cast<uint32_t>(tree[t * tree_stride + 1 + i / 32]) >> (i % 32)) & 1u;
  }
  // sequence b's rows [first, end), clamped into [0, Tq] and never decreasing
  int64_t first(int64_t b) const { return std::clamp<int64_t>(starts[b], 0, Tq); }
  int64_t end(int64_t b) const { return std::clamp<int64_t>(starts[b + 1], first(b), Tq); }
  // the keys sequence b holds, clamped into [0, M * page_size] (none without a pool)
  int64_t length(int64_t b) const {
    return P == 0 ? 0 : std::clamp<int64_t>(kv_lengths[b], 0, M * page_size);
  }
  // query vectors (rows x G) a task of several rows: kPagedVectors, or kAmxVectors
  // where the tiles serve the call (paged_amx.h)
  int64_t vectors_per_task = kPagedVectors;
  int64_t rows_per_task() const { return std::max<int64_t>(1, vectors_per_task / G); }
};

// One task: sequence b, key/value heads [kh0, kh1), rows [r0, r1) of the query, and the
// piece [lo, hi) of the keys it reads (all of them unless the task is split: then its
// running maxima, sums and outputs go to `slot` of the call's pieces, merged after).
struct PagedTask {
  int64_t b, kh0, kh1, r0, r1;
  int64_t lo = 0, hi = INT64_MAX, slot = -1;
};

// VW elements from p as float32: bfloat16 widened in registers (a shift into the high
// half); `count` < VW reads only that many (the rest 0), never past a row's end.
inline vf load_wide(const float* p) { return load(p); }
inline vf load_wide(const uint16_t* p) {
  // by intrinsics where there are: GCC 12 splits the vector conversion into halves
#if defined(__AVX512F__)
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return __builtin_bit_cast(vf, _mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
#elif defined(__AVX2__)
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return __builtin_bit_cast(vf, _mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
#else
  typedef uint16_t vh __attribute__((vector_size(VW * 2), aligned(2), may_alias));
  typedef uint32_t vu __attribute__((vector_size(VW * 4)));
  const vu wide = __builtin_convertvector(*reinterpret_cast<const vh*>(p), vu) << 16;
  return __builtin_bit_cast(vf, wide);
#endif
}
template <class In>
inline vf load_wide(const In* p, int64_t count) {
  if (count >= VW) return load_wide(p);
  alignas(64) float part[VW] = {};
  for (int64_t i = 0; i < count; ++i) part[i] = widen(p[i]);
  return load(part);
}

// VW elements of a row at p as float32: whole vectors (kWhole: the row's width a
// multiple of VW) or up to `count` of them (the rest 0, never read past the row).
template <bool kWhole, class In>
inline vf row_vector(const In* p, int64_t count) {
  if constexpr (kWhole) return load_wide(p);
  return load_wide(p, count);
}

// s[i * kPagedKeys + c] = q_i . k_c for kPagedBlock query vectors (rows of q, Hp wide,
// zero past H) and the keys c < n (rows of H elements at krow[c]), times the key's scale
// kscale[c] where the keys are quantized (null: none). kWhole: H a multiple of VW (no
// tail: the loads need no count, and the accumulators stay in registers).
template <bool kWhole, class In>
void paged_dots(const float* q, int64_t Hp, int64_t H, const In* const* krow, int64_t n,
                const float* kscale, float* s) {
  int64_t c = 0;
#if defined(__AVX512F__)
  // four keys at once: 16 sums in one vector (hsum16), stored four to a query vector.
  // The four keys' and the four queries' vectors each loaded once a step and held
  // (in_register): left to itself the compiler loaded a query vector once a product,
  // 20 loads for 16 products (2-core AMD EPYC Zen 4, the B = 16 decode with its pages
  // in cache: 9.9 against 12.5 ms in float32).
  for (; c + 4 <= n; c += 4) {
    vf acc[16] = {};
    for (int64_t h = 0; h < Hp; h += VW) {
      vf k0 = row_vector<kWhole>(krow[c] + h, H - h), k1 = row_vector<kWhole>(krow[c + 1] + h, H - h);
      vf k2 = row_vector<kWhole>(krow[c + 2] + h, H - h), k3 = row_vector<kWhole>(krow[c + 3] + h, H - h);
      in_register(k0), in_register(k1), in_register(k2), in_register(k3);
      vf x0 = load(q + h), x1 = load(q + Hp + h), x2 = load(q + 2 * Hp + h), x3 = load(q + 3 * Hp + h);
      in_register(x0), in_register(x1), in_register(x2), in_register(x3);
      acc[0] += x0 * k0, acc[1] += x0 * k1, acc[2] += x0 * k2, acc[3] += x0 * k3;
      acc[4] += x1 * k0, acc[5] += x1 * k1, acc[6] += x1 * k2, acc[7] += x1 * k3;
      acc[8] += x2 * k0, acc[9] += x2 * k1, acc[10] += x2 * k2, acc[11] += x2 * k3;
      acc[12] += x3 * k0, acc[13] += x3 * k1, acc[14] += x3 * k2, acc[15] += x3 * k3;
    }
    vf sums = hsum16(acc);
    if (kscale) {
      v4 scale;
      std::memcpy(&scale, kscale + c, sizeof(scale));
      sums *= __builtin_shufflevector(scale, scale, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
    }
    alignas(64) float all[16];
    store(all, sums);
    for (int i = 0; i < kPagedBlock; ++i) std::memcpy(s + i * kPagedKeys + c, all + 4 * i, 16);
  }
#endif
  for (; c + 2 <= n; c += 2) {
    vf acc[kPagedBlock][2] = {};
    for (int64_t h = 0; h < Hp; h += VW) {
      vf k0 = row_vector<kWhole>(krow[c] + h, H - h);
      vf k1 = row_vector<kWhole>(krow[c + 1] + h, H - h);
      in_register(k0), in_register(k1);
      for (int i = 0; i < kPagedBlock; ++i) {
        const vf x = load(q + i * Hp + h);
        acc[i][0] += x * k0;
        acc[i][1] += x * k1;
      }
    }
    const float s0 = kscale ? kscale[c] : 1.0f, s1 = kscale ? kscale[c + 1] : 1.0f;
    const vf all[8] = {acc[0][0], acc[0][1], acc[1][0], acc[1][1],
                       acc[2][0], acc[2][1], acc[3][0], acc[3][1]};
    alignas(32) float sums[8];
    hsum8(all, sums);
    for (int i = 0; i < kPagedBlock; ++i) {
      s[i * kPagedKeys + c] = sums[2 * i] * s0;
      s[i * kPagedKeys + c + 1] = sums[2 * i + 1] * s1;
    }
  }
  for (; c < n; ++c) {
    vf acc[kPagedBlock] = {};
    for (int64_t h = 0; h < Hp; h += VW) {
      const vf k0 = row_vector<kWhole>(krow[c] + h, H - h);
      for (int i = 0; i < kPagedBlock; ++i) acc[i] += load(q + i * Hp + h) * k0;
    }
    const float s0 = kscale ? kscale[c] : 1.0f;
    for (int i = 0; i < kPagedBlock; ++i) s[i * kPagedKeys + c] = hsum(acc[i]) * s0;
  }
}

// o[i] += sum_c p[i, c] v_c for kPagedBlock query vectors (o rows Hp wide) and the
// values c < n (rows of H elements at vrow[c]), in the order of c (kWhole: as
// paged_dots). With AVX-512, four values at a time, their 16 weights held in registers
// across the width (2-core AMD EPYC Zen 4, the B = 16 decode with its pages in cache:
// 8.1 against 9.2 ms in float32, 8.2 against 9.6 in bfloat16); AVX2's 16 registers
// cannot hold them: there, two vectors of the width at a time over every value (the
// four-value order measured 1.05x-1.10x slower in bfloat16 on the same CPU built for AVX2).
template <bool kWhole, class In>
void paged_values(const float* p, const In* const* vrow, int64_t n, int64_t Hp, int64_t H,
                  float* o) {
#if defined(__AVX512F__)
  int64_t c = 0;
  for (; c + 4 <= n; c += 4) {
    vf w[kPagedBlock][4];
    for (int i = 0; i < kPagedBlock; ++i)
      for (int j = 0; j < 4; ++j) w[i][j] = splat(p[i * kPagedKeys + c + j]);
    for (int64_t h = 0; h < Hp; h += VW) {
      const vf v0 = row_vector<kWhole>(vrow[c] + h, H - h);
      const vf v1 = row_vector<kWhole>(vrow[c + 1] + h, H - h);
      const vf v2 = row_vector<kWhole>(vrow[c + 2] + h, H - h);
      const vf v3 = row_vector<kWhole>(vrow[c + 3] + h, H - h);
      for (int i = 0; i < kPagedBlock; ++i) {
        float* oi = o + i * Hp + h;
        store(oi, load(oi) + w[i][0] * v0 + w[i][1] * v1 + w[i][2] * v2 + w[i][3] * v3);
      }
    }
  }
  for (; c < n; ++c) {
    vf w[kPagedBlock];
    for (int i = 0; i < kPagedBlock; ++i) w[i] = splat(p[i * kPagedKeys + c]);
    for (int64_t h = 0; h < Hp; h += VW) {
      const vf v0 = row_vector<kWhole>(vrow[c] + h, H - h);
      for (int i = 0; i < kPagedBlock; ++i) {
        float* oi = o + i * Hp + h;
        store(oi, load(oi) + w[i] * v0);
      }
    }
  }
#else
  int64_t h = 0;
  for (; h + 2 * VW <= Hp; h += 2 * VW) {
    vf acc[kPagedBlock][2];
    for (int i = 0; i < kPagedBlock; ++i)
      for (int v = 0; v < 2; ++v) acc[i][v] = load(o + i * Hp + h + v * VW);
    for (int64_t c = 0; c < n; ++c) {
      const vf v0 = row_vector<kWhole>(vrow[c] + h, H - h);
      const vf v1 = row_vector<kWhole>(vrow[c] + h + VW, H - h - VW);
      for (int i = 0; i < kPagedBlock; ++i) {
        const vf w = splat(p[i * kPagedKeys + c]);
        acc[i][0] += w * v0;
        acc[i][1] += w * v1;
      }
    }
    for (int i = 0; i < kPagedBlock; ++i)
      for (int v = 0; v < 2; ++v) store(o + i * Hp + h + v * VW, acc[i][v]);
  }
  for (; h < Hp; h += VW) {
    vf acc[kPagedBlock];
    for (int i = 0; i < kPagedBlock; ++i) acc[i] = load(o + i * Hp + h);
    for (int64_t c = 0; c < n; ++c) {
      const vf v0 = row_vector<kWhole>(vrow[c] + h, H - h);
      for (int i = 0; i < kPagedBlock; ++i) acc[i] += splat(p[i * kPagedKeys + c]) * v0;
    }
    for (int i = 0; i < kPagedBlock; ++i) store(o + i * Hp + h, acc[i]);
  }
#endif
}

// paged_dots for one query vector (the rest of a register tile that is padding: a
// decode row of one query head a key/value head), up to kPagedChunk keys.
template <bool kWhole, class In>
void paged_dots1(const float* q, int64_t Hp, int64_t H, const In* const* krow, int64_t n,
                 const float* kscale, float* s) {
  static_assert(kPagedChunk == 4, "four keys at once");
  vf acc[8] = {};
  if (n == 4) {
    for (int64_t h = 0; h < Hp; h += VW) {
      const vf x = load(q + h);
      for (int c = 0; c < 4; ++c) acc[c] += x * row_vector<kWhole>(krow[c] + h, H - h);
    }
  } else {
    for (int64_t h = 0; h < Hp; h += VW) {
      const vf x = load(q + h);
      for (int64_t c = 0; c < n; ++c) acc[c] += x * row_vector<kWhole>(krow[c] + h, H - h);
    }
  }
  alignas(32) float sums[8];
  hsum8(acc, sums);
  for (int64_t c = 0; c < n; ++c) s[c] = sums[c] * (kscale ? kscale[c] : 1.0f);
}

// paged_values for one query vector, up to kPagedChunk values.
template <bool kWhole, class In>
void paged_values1(const float* p, const In* const* vrow, int64_t n, int64_t Hp, int64_t H,
                   float* o) {
  vf w[kPagedChunk];
  for (int64_t c = 0; c < n; ++c) w[c] = splat(p[c]);
  for (int64_t h = 0; h < Hp; h += VW) {
    vf acc = load(o + h);
    for (int64_t c = 0; c < n; ++c) acc += w[c] * row_vector<kWhole>(vrow[c] + h, H - h);
    store(o + h, acc);
  }
}

// A task's scratch, kept per thread from call to call (grown to the largest need).
struct PagedScratch {
  std::vector<float> q, s, o, m, l, scales;
  void fit(int64_t vectors, int64_t Hp, int64_t Hvp, int64_t heads) {
    const size_t n = static_cast<size_t>(vectors);
    if (q.size() < n * Hp) q.resize(n * Hp);
    if (o.size() < n * Hvp) o.resize(n * Hvp);
    if (s.size() < n * kPagedKeys) s.resize(n * kPagedKeys);
    if (m.size() < n) m.resize(n), l.resize(n);
    const size_t tiles = kPagedAhead + 1;  // [tile % tiles][keys, values][head][key]
    if (scales.size() < tiles * 2 * heads * kPagedKeys) scales.resize(tiles * 2 * heads * kPagedKeys);
  }
};

// What one task works on: its key/value heads and rows, each head's query vectors (row
// r, head g at r * G + g) padded to register tiles, the position of its first row, the
// keys [lo, hi) that its real rows see, and its scratch: the query vectors times the
// scale, a tile's scores (kPagedKeys a vector), the outputs, maxima and sums.
struct PagedWork {
  int64_t heads, rows, padded, vectors;
  int64_t base;    // the position (the slot, with a tree) of row r0
  int64_t chunk, first_row;  // the slot of the sequence's first query, and its row
  int64_t lo, hi;  // every key some real row of the task sees
  float *qs, *s, *o, *m, *l;
};

// The rows' positions and the task's keys [lo, hi) into w: every key some real row sees
// (the rows' bands are intervals of one width at consecutive positions: their union is
// one interval; with a tree, a row at its tree position sees no key before its band's
// start nor, in its chunk, past its own slot), so that a key no row of the task sees is
// never read. False when no row is real: the task has nothing to write.
inline bool paged_keys(const Paged& p, const PagedTask& task, PagedWork& w) {
  const int64_t b = task.b, length = p.length(b), q_len = p.end(b) - p.first(b);
  const int64_t start = p.offsets ? p.offsets[b] : length - q_len;  // position of row 0
  w.base = start + (task.r0 - p.first(b));  // position of row r0
  w.chunk = start, w.first_row = p.first(b);
  int64_t top = 0, bottom = 0;  // the last real row's slot and the least real position
  bool any = false;              // (any sign: a dense row's queries may sit before its keys)
  for (int64_t r = 0; r < w.rows; ++r) {
    if (!p.real[task.r0 + r]) continue;
    const int64_t pos = p.tree ? p.tree_position(task.r0 + r) : w.base + r;
    top = w.base + r, bottom = any ? std::min(bottom, pos) : pos, any = true;
  }
  if (!any) return false;
  w.lo = std::max<int64_t>(0, task.lo), w.hi = std::min(length, task.hi);
  if (p.right >= 0) w.hi = std::min(w.hi, top + p.right + 1);
  if (p.left >= 0) w.lo = std::max<int64_t>(w.lo, bottom - p.left);
  return true;
}

// The online softmax's start: outputs 0, maxima -inf, sums 0.
inline void paged_start(const Paged& p, const PagedWork& w) {
  std::fill(w.o, w.o + w.vectors * p.Hvp, 0.0f);
  std::fill(w.m, w.m + w.vectors, -kInf);
  std::fill(w.l, w.l + w.vectors, 0.0f);
}

// The query vectors times the scale, head after head (padding vectors 0).
template <class Q>
void paged_queries(const Paged& p, const Q* q, const PagedTask& task, const PagedWork& w) {
  const int64_t G = p.G, Hp = p.Hp, H = p.H;
  std::fill(w.qs, w.qs + w.vectors * Hp, 0.0f);
  for (int64_t hh = 0; hh < w.heads; ++hh)
    for (int64_t r = 0; r < w.rows; ++r) {
      if (!p.real[task.r0 + r]) continue;
      const Q* src = q + ((task.r0 + r) * p.N + (task.kh0 + hh) * G) * H;
      float* dst = w.qs + (hh * w.padded + r * G) * Hp;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t h = 0; h < H; ++h) dst[g * Hp + h] = widen(src[g * H + h]) * p.scale;
    }
}

// f(c, row) for the keys c < n of sequence b from key j0: `row`, the key's token row of
// the pool (page * page_size + slot), its page id clamped into [0, P).
template <class F>
void paged_walk(const Paged& p, int64_t b, int64_t j0, int64_t n, const F& f) {
  const int32_t* pages = p.table + b * p.M;
  int64_t entry = j0 / p.page_size, slot = j0 % p.page_size;  // one division a walk
  for (int64_t c = 0; c < n; ++c) {
    f(c, std::clamp<int64_t>(pages[entry], 0, p.P - 1) * p.page_size + slot);
    if (++slot == p.page_size) slot = 0, ++entry;
  }
}

// The line at p fetched into L2; kAsm: by an asm statement on x86. GCC 12 takes a
// function whose only effect is __builtin_prefetch for one with none and may drop the
// calls to it (the decode tiles' fetches, made through a lambda, vanished from the
// build); the vector tiles keep the builtin they were tuned with (with the asm
// statements their B = 16 bfloat16 decode read 0.9x as fast in three alternations, 2-core
// Intel Xeon, family 6 model 207: within that machine's noise, but no gain either).
template <bool kAsm>
inline void fetch_line(const char* p) {
#if defined(__x86_64__)
  if constexpr (kAsm) {
    asm volatile("prefetcht1 %0" : : "m"(*p));
    return;
  }
#endif
  __builtin_prefetch(p, 0, 2);
}

// Every line of the rows rows[c] + offset (bytes long each), c < n, fetched into L2.
template <bool kAsm = false, class In>
void fetch_rows(const In* const* rows, int64_t n, int64_t offset, int64_t bytes) {
  for (int64_t c = 0; c < n; ++c) {
    const char* row = reinterpret_cast<const char*>(rows[c] + offset);
    for (int64_t byte = 0; byte < bytes; byte += 64) fetch_line<kAsm>(row + byte);
  }
}

// Where a task's tiles of keys and values are: the rows of the tile being read (head
// kh0's; head kh0 + hh's are hh * H further), and of the next ones, whose lines are
// prefetched while it is computed (their pages sit anywhere in the pool); with a
// quantized pool, the tiles' key and value scales too, [parity][keys, values][head][key]
// (0 past a tile's keys). A tile's parity is its index % (kPagedAhead + 1).
template <class In>
struct PagedTiles {
  const Paged& p;
  const PagedTask& task;
  const In *kp, *vp;  // the pools
  int64_t heads, hi;  // the task's heads and the end of its keys
  float* scales;      // (kPagedAhead + 1, 2, heads, kPagedKeys)
  const In* rows_of[kPagedAhead + 1][2][kPagedKeys];  // [parity][keys, values][key]

  // Every line of the keys (kind 0) or values (1) [c0, c0 + m) of head hh at `parity`
  // (the next tile's, as this one is computed); kAsm as fetch_line's.
  template <bool kAsm = false>
  void fetch(int parity, int kind, int64_t c0, int64_t m, int64_t hh) const {
    const int64_t width = kind == 0 ? p.H : p.Hv;
    fetch_rows<kAsm>(rows_of[parity][kind] + c0, m, hh * width,
                     width * static_cast<int64_t>(sizeof(In)));
  }

  float* scales_at(int parity, int kind, int64_t hh) const {
    return scales + ((parity * 2 + kind) * heads + hh) * kPagedKeys;
  }

  // The tile of keys from j0 as `parity` (its lines are fetched by paged_tile).
  void locate(int64_t j0, int parity) {
    constexpr bool quantized = kQuantized<In>;
    const In** keys = rows_of[parity][0];
    const In** values = rows_of[parity][1];
    const int64_t n = std::min<int64_t>(kPagedKeys, hi - j0);
    paged_walk(p, task.b, j0, n, [&](int64_t c, int64_t row) {
      const int64_t token = row * p.K + task.kh0;
      keys[c] = kp + row * p.key_row + task.kh0 * p.H;
      values[c] = vp + row * p.value_row + task.kh0 * p.Hv;
      if constexpr (quantized)
        for (int64_t hh = 0; hh < heads; ++hh) {
          scales_at(parity, 0, hh)[c] = p.key_scales[token + hh];
          scales_at(parity, 1, hh)[c] = p.value_scales[token + hh];
        }
    });
    if constexpr (quantized)
      for (int64_t hh = 0; hh < heads; ++hh)
        for (int64_t c = n; c < kPagedKeys; ++c)
          scales_at(parity, 0, hh)[c] = scales_at(parity, 1, hh)[c] = 0;
  }
};

// Row t's scores `row` against the tile of keys [j0, j0 + n), its row at position
// `pos`, the keys it does not see made -inf; returns their maximum (NaN kept). A band:
// its keys [first, last] among the tile's columns. With a tree, a tile holding keys of
// the chunk: column by column, a chunk key seen where it is an ancestor of the row and
// inside the band at its own tree position (keys before the chunk: the band).
inline float paged_mask(const Paged& p, const PagedWork& w, int64_t t, int64_t pos, int64_t j0,
                        int64_t n, int64_t cols, float* row) {
  if (p.tree && j0 + n > w.chunk) {
    float mx = -kInf;
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t j = j0 + c, i = j - w.chunk;  // i: the key's token of the chunk
      const int64_t key = i < 0 ? j : p.tree_position(std::min(w.first_row + i, p.Tq - 1));
      const bool seen = c < n && j < w.hi && (i < 0 || p.tree_sees(t, i)) &&
                        (p.left < 0 || key >= pos - p.left) &&
                        (p.right < 0 || key <= pos + p.right);
      row[c] = seen ? row[c] : -kInf;
      mx = nan_max(row[c], mx);
    }
    return mx;
  }
  const int64_t first = p.left >= 0 ? pos - p.left : 0;
  const int64_t last = std::min(p.right >= 0 ? pos + p.right : w.hi - 1, j0 + n - 1);
  const vi from = splat_int(static_cast<int32_t>(std::clamp<int64_t>(first - j0, 0, n)));
  const vi to = splat_int(static_cast<int32_t>(std::clamp<int64_t>(last - j0, -1, n)));
  vi col;
  for (int c = 0; c < VW; ++c) col[c] = c;
  vf mx = splat(-kInf);
  for (int c = 0; c < cols; c += VW, col += VW) {
    const vf x = (col < from) | (col > to) ? splat(-kInf) : load(row + c);
    store(row + c, x);
    mx = nan_max(x, mx);
  }
  return hmax(mx);
}

// Vector v's output row times alpha (the online softmax's maximum moved), unless alpha
// is 1.
inline void paged_rescale(const Paged& p, const PagedWork& w, int64_t v, float alpha) {
  if (alpha == 1.0f) return;
  float* orow = w.o + v * p.Hvp;
  const vf a = splat(alpha);
  for (int64_t h = 0; h < p.Hvp; h += VW) store(orow + h, load(orow + h) * a);
}

// Query vector v's scores `row` (query row t, at position `pos`) against the tile of
// keys [j0, j0 + n), in place: the soft cap, the row's mask (paged_mask), then the
// online softmax, as the dense kernel's: maxima keep a NaN, and a row that sees nothing
// yet keeps m = -inf and weights 0. The weights of quantized values are times their
// scales `vscale`.
template <class In>
void paged_softmax(const Paged& p, const PagedWork& w, int64_t v, int64_t t, int64_t pos,
                   int64_t j0, int64_t n, const float* vscale, float* row) {
  constexpr bool quantized = kQuantized<In>;
  if (p.soft_cap > 0)
    for (int64_t c = 0; c < n; ++c) row[c] = p.soft_cap * std::tanh(row[c] / p.soft_cap);
  const float m_new = nan_max(w.m[v], paged_mask(p, w, t, pos, j0, n, kPagedKeys, row));
  if (m_new == -kInf) {
    std::fill(row, row + kPagedKeys, 0.0f);
    return;
  }
  const float alpha = std::exp(w.m[v] - m_new);  // 0 when m was -inf
  vf sum = vf{};
  const vf shift = splat(m_new);
  for (int c = 0; c < kPagedKeys; c += VW) {
    const vf e = vexp(load(row + c) - shift);
    sum += e;
    // the weights of quantized values times their scales (the sum is the
    // weights'); a weight of 0 stays 0: a key outside this row's band is never read
    store(row + c, quantized ? (e != 0 ? e * load(vscale + c) : vf{}) : e);
  }
  w.l[v] = w.l[v] * alpha + hsum(sum);
  w.m[v] = m_new;
  paged_rescale(p, w, v, alpha);
}

// f(std::true_type{}) where rows are whole vectors (their width a multiple of VW), else
// f(std::false_type{}): the products' kWhole, chosen once at run time.
template <class F>
void with_whole(bool whole, const F& f) {
  if (whole)
    f(std::true_type{});
  else
    f(std::false_type{});
}

// Every query vector's scores w.s (kPagedKeys a vector, head after head) against the
// tile of keys [j0, j0 + n) at `parity` made weights (paged_softmax); padding vectors and
// rows not written get weights 0.
template <class In>
void paged_tile_softmax(const Paged& p, const PagedTask& task, const PagedWork& w,
                        const PagedTiles<In>& tiles, int parity, int64_t j0, int64_t n) {
  const int64_t padded = w.padded;
  for (int64_t hh = 0; hh < w.heads; ++hh) {
    const float* vscale = tiles.scales_at(parity, 1, hh);
    for (int64_t i = 0; i < padded; ++i) {
      float* row = w.s + (hh * padded + i) * kPagedKeys;
      const int64_t r = i / p.G;
      if (r >= w.rows || !p.real[task.r0 + r]) {  // a padding vector or a row not written
        std::fill(row, row + kPagedKeys, 0.0f);
        continue;
      }
      const int64_t t = task.r0 + r, pos = p.tree ? p.tree_position(t) : w.base + r;
      paged_softmax<In>(p, w, hh * padded + i, t, pos, j0, n, vscale, row);
    }
  }
}

// f(parity, j0, n) for the task's tiles of keys [j0, j0 + n) in order, from w.lo to
// w.hi, each located kPagedAhead tiles before its turn (its lines fetched by f's work on
// the tile before it).
template <class In, class F>
void paged_tiles_walk(PagedTiles<In>& tiles, const PagedWork& w, const F& f) {
  constexpr int64_t width = kPagedKeys;
  for (int a = 0; a < kPagedAhead; ++a)
    if (w.lo + a * width < w.hi) tiles.locate(w.lo + a * width, a);
  for (int64_t j0 = w.lo, tile = 0; j0 < w.hi; j0 += width, ++tile) {
    const int64_t n = std::min<int64_t>(width, w.hi - j0);
    const int parity = tile % (kPagedAhead + 1);
    if (j0 + kPagedAhead * width < w.hi)
      tiles.locate(j0 + kPagedAhead * width, (tile + kPagedAhead) % (kPagedAhead + 1));
    f(parity, j0, n);
  }
}

// The task's heads against the tile of keys [j0, j0 + n) at `parity`: every query
// vector's scores, their online softmax, then the values. The products walk the tile in
// the order of memory: kPagedChunk keys at a time (kValuesChunk for the values), every
// head of those token rows (side by side in them) before the next keys, so that each
// row is read front to back and the hardware streams it ahead of the loads.
template <class In>
void paged_tile(const Paged& p, const PagedTask& task, const PagedWork& w,
                const PagedTiles<In>& tiles, int parity, int64_t j0, int64_t n) {
  constexpr bool quantized = kQuantized<In>;
  const int64_t G = p.G, Hp = p.Hp, H = p.H, Hvp = p.Hvp, padded = w.padded;
  const In* const* keys = tiles.rows_of[parity][0];
  const In* const* values = tiles.rows_of[parity][1];
  const int next = (parity + 1) % (kPagedAhead + 1);
  // the next tile's keys, whose every line is fetched over this tile
  const int64_t following = std::min<int64_t>(kPagedKeys, w.hi - j0 - n);
  for (int64_t c0 = 0; c0 < n; c0 += kPagedChunk) {
    const int64_t m = std::min<int64_t>(kPagedChunk, n - c0);
    for (int64_t hh = 0; hh < w.heads; ++hh) {
      if (c0 < following) tiles.fetch(next, 0, c0, std::min<int64_t>(kPagedChunk, following - c0), hh);
      const In* krow[kPagedChunk];
      for (int64_t c = 0; c < m; ++c) krow[c] = keys[c0 + c] + hh * H;
      const float* kscale = quantized ? tiles.scales_at(parity, 0, hh) + c0 : nullptr;
      const float* qh = w.qs + hh * padded * Hp;
      float* sh = w.s + hh * padded * kPagedKeys + c0;
      for (int64_t i = 0; i < padded; i += kPagedBlock) {
        const int64_t real = std::min<int64_t>(kPagedBlock, w.rows * G - i);
        with_whole(H == Hp, [&](auto whole) {
          if (real == kPagedBlock) {
            paged_dots<whole()>(qh + i * Hp, Hp, H, krow, m, kscale, sh + i * kPagedKeys);
            return;
          }
          for (int64_t v = i; v < i + real; ++v)  // the rest is padding, never softmaxed
            paged_dots1<whole()>(qh + v * Hp, Hp, H, krow, m, kscale, sh + v * kPagedKeys);
        });
      }
    }
  }
  paged_tile_softmax(p, task, w, tiles, parity, j0, n);
  // one head: its rows are in memory order already, and the tile's values at once keep
  // the outputs in registers across them
  const int64_t chunk = w.heads > 1 ? kValuesChunk : n;
  for (int64_t c0 = 0; c0 < n; c0 += chunk) {
    const int64_t m = std::min<int64_t>(chunk, n - c0);
    for (int64_t hh = 0; hh < w.heads; ++hh) {
      if (c0 < following) tiles.fetch(next, 1, c0, std::min<int64_t>(chunk, following - c0), hh);
      const In* vrow[kPagedKeys];
      for (int64_t c = 0; c < m; ++c) vrow[c] = values[c0 + c] + hh * p.Hv;
      const float* sh = w.s + hh * padded * kPagedKeys + c0;
      float* oh = w.o + hh * padded * Hvp;
      for (int64_t i = 0; i < padded; i += kPagedBlock) {
        const int64_t real = std::min<int64_t>(kPagedBlock, w.rows * G - i);
        with_whole(p.Hv == Hvp, [&](auto whole) {
          if (real == kPagedBlock) {
            paged_values<whole()>(sh + i * kPagedKeys, vrow, m, Hvp, p.Hv, oh + i * Hvp);
            return;
          }
          for (int64_t v = i; v < i + real; ++v)
            for (int64_t c1 = 0; c1 < m; c1 += kPagedChunk) {
              const int64_t m1 = std::min<int64_t>(kPagedChunk, m - c1);
              const float* sv = sh + v * kPagedKeys + c1;
              paged_values1<whole()>(sv, vrow + c1, m1, Hvp, p.Hv, oh + v * Hvp);
            }
        });
      }
    }
  }
}

// Query head `head` of row t's output o / l and log-sum-exp m + log l, or zeros and -inf
// for a row that saw nothing (o is Hvp wide).
inline void paged_output(const Paged& p, int64_t t, int64_t head, float m, float l,
                         const float* o, float* out, float* lse) {
  float* dst = out + (t * p.N + head) * p.Hv;
  if (l != 0) {  // l >= 1 for a row that sees a key; NaN from NaN or inf content
    const float inv = 1.0f / l;
    for (int64_t h = 0; h < p.Hv; ++h) dst[h] = o[h] * inv;
    lse[t * p.N + head] = m + std::log(l);
  } else {
    std::fill(dst, dst + p.Hv, 0.0f);
    lse[t * p.N + head] = -kInf;  // the log-sum-exp of no logit
  }
}

// The pieces of split tasks: per slot, each query vector's running maximum, sum and
// output (Hvp), as the piece left them; `at[slot]` is where a slot starts.
struct PagedPieces {
  int64_t stride = 0;  // floats a query vector: 2 + Hvp
  std::vector<int64_t> at;
  std::vector<float> data;
  float* vector(int64_t slot, int64_t v) { return data.data() + at[slot] + v * stride; }
};

// The task's real rows' outputs (paged_output), or, for a piece of a split task, its
// maxima, sums and outputs into its slot of `pieces`.
inline void paged_finish(const Paged& p, const PagedTask& task, const PagedWork& w,
                         PagedPieces& pieces, float* out, float* lse) {
  const int64_t G = p.G, Hvp = p.Hvp;
  for (int64_t hh = 0; hh < w.heads; ++hh)
    for (int64_t r = 0; r < w.rows; ++r) {
      const int64_t t = task.r0 + r;
      if (!p.real[t]) continue;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t v = hh * w.padded + r * G + g, head = (task.kh0 + hh) * G + g;
        if (task.slot < 0) {
          paged_output(p, t, head, w.m[v], w.l[v], w.o + v * Hvp, out, lse);
          continue;
        }
        float* dst = pieces.vector(task.slot, v);
        dst[0] = w.m[v], dst[1] = w.l[v];
        std::copy(w.o + v * Hvp, w.o + (v + 1) * Hvp, dst + 2);
      }
    }
}

}  // namespace

#include "paged_amx.h"
#include "paged_amx_decode.h"

namespace {

// One task, queries of type Q, pools of type In (float32 and bfloat16 alike, or int8 and
// float8 with their scales). Its heads kh0 .. kh1 - 1 sit side by side in every token
// row of the pool, so a tile of keys is read as one run of memory per token; the tiles
// kPagedAhead ahead of the one computed are located and fetched.
template <class Q, class In>
void paged_task(const Paged& p, const Q* q, const In* kp, const In* vp, const PagedTask& task,
                PagedPieces& pieces, float* out, float* lse) {
  PagedWork w;
  w.heads = task.kh1 - task.kh0, w.rows = task.r1 - task.r0;
  w.padded = (w.rows * p.G + kPagedBlock - 1) / kPagedBlock * kPagedBlock;
#if NANOATTN_AMX
  constexpr bool bfloat16 = std::is_same_v<Q, uint16_t> && std::is_same_v<In, uint16_t>;
  const bool amx = bfloat16 && amx_serves(p, w.heads, w.rows * p.G);
  if (amx) w.padded = (w.rows * p.G + 31) / 32 * 32;  // whole 2 x 2 blocks of tiles
  const bool amx_few = !amx && amx_decode_serves<Q, In>(p, w.rows * p.G);  // paged_amx_decode.h
#endif
  w.vectors = w.heads * w.padded;
  thread_local PagedScratch scratch;
  scratch.fit(w.vectors, p.Hp, p.Hvp, w.heads);
  w.qs = scratch.q.data(), w.s = scratch.s.data(), w.o = scratch.o.data();
  w.m = scratch.m.data(), w.l = scratch.l.data();
#if NANOATTN_AMX
  thread_local AmxScratch operands;
  if (amx || amx_few)  // rows on 64 bytes
    operands.fit(w.vectors, p.H, p.Hv), w.o = operands.o.data();
#endif
  if (!paged_keys(p, task, w)) return;  // no real row: nothing to write
  paged_start(p, w);
#if NANOATTN_AMX
  if constexpr (bfloat16)
    if (amx) {  // its own queries, unscaled
      paged_task_amx(p, q, kp, vp, task, w, operands);
      paged_finish(p, task, w, pieces, out, lse);
      return;
    }
  if constexpr (kAmxFewTypes<Q, In>)
    if (amx_few) {
      paged_task_amx_decode(p, q, kp, vp, task, w, scratch.scales.data(), operands);
      paged_finish(p, task, w, pieces, out, lse);
      return;
    }
#endif
  paged_queries(p, q, task, w);
  PagedTiles<In> tiles{p, task, kp, vp, w.heads, w.hi, scratch.scales.data(), {}};
  paged_tiles_walk(tiles, w, [&](int parity, int64_t j0, int64_t n) {
    paged_tile(p, task, w, tiles, parity, j0, n);
  });
  paged_finish(p, task, w, pieces, out, lse);
}

// The keys [lo, hi) task's rows may see at most (its sequence's, narrowed by the band
// of its first and last rows; with a tree, from the least of its rows' positions), the
// size a scheduler weighs it by.
inline std::pair<int64_t, int64_t> task_keys(const Paged& p, const PagedTask& task) {
  const int64_t b = task.b, length = p.length(b), q_len = p.end(b) - p.first(b);
  const int64_t start = (p.offsets ? p.offsets[b] : length - q_len) + task.r0 - p.first(b);
  int64_t lo = 0, hi = length, least = start;  // least: the rows' least position
  if (p.tree)
    for (int64_t t = task.r0; t < task.r1; ++t) least = std::min<int64_t>(least, p.tree_position(t));
  if (p.right >= 0) hi = std::clamp<int64_t>(start + (task.r1 - task.r0 - 1) + p.right + 1, 0, hi);
  if (p.left >= 0) lo = std::clamp<int64_t>(least - p.left, 0, hi);
  return {lo, hi};
}

constexpr int64_t kPiecesPerThread = 4;   // split the keys into about this many a thread
constexpr int64_t kLeastPieceKeys = 512;  // a piece reads at least this many keys

// Whether split_tasks cuts tasks along their keys: with several threads, unless
// NANOATTN_SPLIT_KEYS is "0" (the bench's unsplit baseline).
inline bool splits_keys(int threads) {
  const char* off = std::getenv("NANOATTN_SPLIT_KEYS");
  return threads >= 2 && !(off && std::string(off) == "0");
}

// The tasks of a call: rows of one head each, or, for a few rows (a decode step), the
// rows of several heads side by side (their keys then one run of memory per token, not
// one row per head, which the hardware streams), as many as still give 4 tasks a thread
// once split_tasks has cut the long ones along their keys. Over pages of one key (a
// selection of scattered keys: every token row on a memory page of its own) one task a
// thread is enough: two tasks sharing a row each walk to it and open it (2048 of 32768
// keys, N = 32 on K = 8: 1.13x-1.23x a decode over 2048 keys, 1.42x-1.47x with 4 tasks a
// thread).
inline std::vector<PagedTask> paged_tasks(const Paged& p, int threads) {
  int64_t pieces = 0;  // of each head's rows, cut along the keys where split_tasks would
  const int64_t step = p.rows_per_task();
  const bool split = splits_keys(threads);
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t sets = (p.end(b) - p.first(b) + step - 1) / step;
    pieces += sets * (split ? std::max<int64_t>(1, p.length(b) / kLeastPieceKeys) : 1);
  }
  int64_t together = 1;  // heads per task: a divisor of K
  for (int64_t d = p.K; d > 1; --d)
    if (p.K % d == 0 && d * p.G <= kPagedVectors &&
        pieces * (p.K / d) >= (p.page_size == 1 ? 1 : kPiecesPerThread) * threads) {
      together = d;
      break;
    }
  std::vector<PagedTask> tasks;
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t r0 = p.first(b); r0 < p.end(b); r0 += step) {
      const int64_t r1 = std::min(r0 + step, p.end(b));
      const int64_t heads = r1 - r0 == 1 ? together : 1;  // several heads: one row
      for (int64_t kh = 0; kh < p.K; kh += heads) tasks.push_back({b, kh, kh + heads, r0, r1});
    }
  return tasks;
}

// Split-key decode: with several threads, a task that reads more than its share of the
// call's keys (the whole call's key rows read, rows x heads x keys, over threads x
// kPiecesPerThread) is cut along its keys into near-equal pieces of whole tiles (at least
// kLeastPieceKeys each), each piece's maxima, sums and outputs kept in a slot of `pieces`
// and merged after (paged_merge). The pieces depend on the sizes and the thread count
// only: the same call on the same thread count sums in the same order.
inline std::vector<PagedTask> split_tasks(const Paged& p, const std::vector<PagedTask>& tasks,
                                          int threads, PagedPieces& pieces,
                                          std::vector<std::pair<int64_t, int64_t>>& groups) {
  if (!splits_keys(threads)) return tasks;
  int64_t total = 0;
  std::vector<int64_t> costs(tasks.size());
  for (size_t t = 0; t < tasks.size(); ++t) {
    auto [lo, hi] = task_keys(p, tasks[t]);
    costs[t] = (tasks[t].r1 - tasks[t].r0) * (tasks[t].kh1 - tasks[t].kh0) * (hi - lo);
    total += costs[t];
  }
  const int64_t share = std::max<int64_t>(1, total / (threads * kPiecesPerThread));
  std::vector<PagedTask> out;
  pieces.stride = 2 + p.Hvp;
  for (size_t t = 0; t < tasks.size(); ++t) {
    const PagedTask& task = tasks[t];
    auto [lo, hi] = task_keys(p, task);
    const int64_t tiles = (hi - lo + kPagedKeys - 1) / kPagedKeys;
    int64_t count = std::min((costs[t] + share - 1) / share, (hi - lo) / kLeastPieceKeys);
    count = std::min(count, tiles);
    if (count < 2) {
      out.push_back(task);
      continue;
    }
    const int64_t padded = ((task.r1 - task.r0) * p.G + kPagedBlock - 1) / kPagedBlock * kPagedBlock;
    const int64_t vectors = (task.kh1 - task.kh0) * padded;
    groups.push_back({static_cast<int64_t>(out.size()), count});
    for (int64_t i = 0; i < count; ++i) {
      PagedTask piece = task;
      piece.lo = lo + tiles * i / count * kPagedKeys;
      piece.hi = i + 1 < count ? lo + tiles * (i + 1) / count * kPagedKeys : hi;
      piece.slot = static_cast<int64_t>(pieces.at.size());
      pieces.at.push_back(static_cast<int64_t>(pieces.data.size()));
      pieces.data.resize(pieces.data.size() + vectors * pieces.stride);
      out.push_back(piece);
    }
  }
  return out;
}

// The pieces of one split task merged by their log-sum-exps, exactly: maxima M = max m,
// sums L = sum l exp(m - M), outputs O = sum o exp(m - M), in the pieces' order; then
// each real row's output O / L and log-sum-exp M + log L (paged_output). A NaN maximum
// (NaN content) makes the row NaN; a piece that saw nothing (m = -inf) adds nothing.
inline void paged_merge(const Paged& p, const std::vector<PagedTask>& tasks, int64_t first,
                        int64_t count, PagedPieces& pieces, float* out, float* lse) {
  const PagedTask& task = tasks[first];
  const int64_t G = p.G, Hvp = p.Hvp, rows = task.r1 - task.r0;
  const int64_t padded = (rows * G + kPagedBlock - 1) / kPagedBlock * kPagedBlock;
  std::vector<float> o(Hvp);
  for (int64_t hh = 0; hh < task.kh1 - task.kh0; ++hh)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = task.r0 + r;
      if (!p.real[t]) continue;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t v = hh * padded + r * G + g;
        float m = -kInf;
        for (int64_t i = 0; i < count; ++i)
          m = nan_max(pieces.vector(tasks[first + i].slot, v)[0], m);
        float l = 0;
        std::fill(o.begin(), o.end(), 0.0f);
        if (m != -kInf)
          for (int64_t i = 0; i < count; ++i) {
            const float* piece = pieces.vector(tasks[first + i].slot, v);
            const float a = piece[0] == -kInf ? 0.0f : std::exp(piece[0] - m);
            l += piece[1] * a;
            for (int64_t h = 0; h < Hvp; ++h) o[h] += piece[2 + h] * a;
          }
        paged_output(p, t, (task.kh0 + hh) * G + g, m, l, o.data(), out, lse);
      }
    }
}

// paged_run's tasks on `threads` threads.
template <class Q, class In>
xla::ffi::Error paged_run_tasks(xla::ffi::ThreadPool& pool, const Paged& p, const Q* qp,
                                const In* kp, const In* vp, float* o, float* l, int threads) {
  PagedPieces pieces;
  std::vector<std::pair<int64_t, int64_t>> groups;  // split tasks: (first piece, count)
  const std::vector<PagedTask> tasks = split_tasks(p, paged_tasks(p, threads), threads,
                                                   pieces, groups);
  if (tasks.empty()) return xla::ffi::Error::Success();
  // The longest first: a prefill chunk's tasks start before the decode tokens'.
  const std::vector<int64_t> order =
      costliest_first(static_cast<int64_t>(tasks.size()), [&](int64_t t) {
        const PagedTask& task = tasks[t];
        auto [lo, hi] = task_keys(p, task);
        return (task.r1 - task.r0) * (task.kh1 - task.kh0) *
               (std::min(hi, task.hi) - std::max(lo, task.lo) + 1);
      });
  parallel_for(pool, threads, static_cast<int64_t>(tasks.size()), [&](int64_t t, int) {
    paged_task(p, qp, kp, vp, tasks[order[t]], pieces, o, l);
  });
  parallel_for(pool, threads, static_cast<int64_t>(groups.size()), [&](int64_t g, int) {
    paged_merge(p, tasks, groups[g].first, groups[g].second, pieces, o, l);
  });
  return xla::ffi::Error::Success();
}

// The paged pass of a checked problem: queries of type Q, pools of type In.
template <class Q, class In>
xla::ffi::Error paged_run(xla::ffi::ThreadPool& pool, const Paged& p, const Q* qp, const In* kp,
                          const In* vp, float* o, float* l) {
  // Rows no task writes (padding, broken): zeros and -inf.
  for (int64_t t = 0; t < p.Tq; ++t) {
    if (p.real[t]) continue;
    std::fill(o + t * p.N * p.Hv, o + (t + 1) * p.N * p.Hv, 0.0f);
    std::fill(l + t * p.N, l + (t + 1) * p.N, -kInf);
  }
  const int threads = max_threads(pool);
#if NANOATTN_AMX
  if constexpr (std::is_same_v<Q, uint16_t> && std::is_same_v<In, uint16_t>)
    if (amx_serves(p, 1, kAmxVectors)) {  // tasks of kAmxVectors vectors
      Paged tiled = p;
      tiled.vectors_per_task = kAmxVectors;
      return paged_run_tasks(pool, tiled, qp, kp, vp, o, l, threads);
    }
#endif
  return paged_run_tasks(pool, p, qp, kp, vp, o, l, threads);
}

}  // namespace
