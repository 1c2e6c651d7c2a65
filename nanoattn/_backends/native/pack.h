// Packing blocks of the inputs into padded, contiguous scratch: the scratch itself
// (kept per thread from call to call), the tiles shared by a call's tasks, and the
// packers: rows of queries or output cotangents (BQ, Hp), keys and values as rows
// (BK, Hp) or transposed (Hp, BK), queries transposed (Hp, BQ), and, for AVX512_BF16's
// products, bfloat16 keys and queries as pairs along the width. bfloat16, int8 and
// float8 are widened to float32 as they are packed (quantized keys times their scales);
// rows and columns past the inputs' ends, or of queries and keys that see nothing, are 0.
//
// Included by attention.cc only, in its one translation unit: the code sits in an
// unnamed namespace there as here, so that every function keeps internal linkage.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "gemm.h"
#include "quantized.h"
#include "simd.h"
#include "visibility.h"

namespace {

static_assert(BQ % MR == 0 && BQ % VW == 0 && BK % VW == 0 && VW % MR == 0,
              "blocks must tile the products");

// n rounded up to a multiple of m: the rows and columns a block's products cover
// (a decode step's single query row is not padded to a whole block).
inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// n floats, 64-byte aligned, freed with it.
struct Aligned {
  float* data = nullptr;
  explicit Aligned(size_t n) {
    data = static_cast<float*>(std::aligned_alloc(64, ((n * 4 + 63) / 64) * 64));
  }
  ~Aligned() { std::free(data); }
  Aligned(const Aligned&) = delete;
  Aligned& operator=(const Aligned&) = delete;
};

// Scratch kept from call to call, per calling thread and slot: a call as large as an
// earlier one touches no new page (a fresh allocation of this size per call spent more
// time in page faults than a decode step in arithmetic). It grows to the largest call's
// need, O(T + S). Slots: 0 and 1 the call's shared tiles (Tiles), 2 and 3 a group's
// tiles (the short calls' groups), 4 a task's own blocks.
enum Slot { kShared0, kShared1, kGroupKeys, kGroupValues, kTask, kSlots };
constexpr size_t kGroupBytes = 256 << 10;  // a short call's group of tiles, at most
float* scratch(int slot, size_t floats) {
  thread_local std::unique_ptr<Aligned> slots[kSlots];
  thread_local size_t sizes[kSlots] = {};
  floats = std::max<size_t>(floats, VW);  // a call with no key still gets a buffer
  if (sizes[slot] < floats) {
    slots[slot].reset();
    slots[slot] = std::make_unique<Aligned>(floats);
    sizes[slot] = floats;
  }
  return slots[slot]->data;
}

// Blocks packed once per call and shared by every task that reads them (each key block
// by every query block and every query head of its group): `count` tiles of `size`
// floats in scratch slot `slot`.
struct Tiles {
  Tiles(int64_t count, int64_t size, int slot) : size(size), all(scratch(slot, count * size)) {}
  float* at(int64_t index) const { return all + index * size; }
  const int64_t size;
  float* const all;
};

// The tile index of key block kb of key/value head kh, and of query block qb of query
// head n, in batch row b.
inline int64_t key_tile(const Problem& p, int64_t b, int64_t kh, int64_t kb) {
  return (b * p.K + kh) * p.n_k() + kb;
}
inline int64_t query_tile(const Problem& p, int64_t b, int64_t n, int64_t qb) {
  return (b * p.N + n) * p.n_q() + qb;
}

// rows [i0, i0 + BQ) of head n, times `factor`, as (BQ, Hp); rows past T or blind are 0.
template <class In>
void pack_rows(const Problem& p, const In* x, const Geometry& g, int64_t b, int64_t n,
               int64_t i0, float factor, float* out) {
  const uint8_t* q_sees = sees(p, g, n);
  for (int64_t r = 0; r < BQ; ++r) {
    float* dst = out + r * p.Hp;
    const int64_t i = i0 + r;
    if (i < p.T && q_sees[i]) {
      const In* src = x + ((b * p.T + i) * p.N + n) * p.H;
      for (int64_t h = 0; h < p.H; ++h) dst[h] = widen(src[h]) * factor;
      std::fill(dst + p.H, dst + p.Hp, 0.0f);
    } else {
      std::fill(dst, dst + p.Hp, 0.0f);
    }
  }
}

// Asks for `rows` rows of `width` elements each, `stride` elements apart, ahead of a
// packer that reads them one after the other: their cache misses overlap, where each
// row's would otherwise wait behind the stores of the row before it.
template <class In>
void prefetch_rows(const In* first, int64_t rows, int64_t stride, int64_t width) {
  const char* at = reinterpret_cast<const char*>(first);
  for (int64_t r = 0; r < rows; ++r, at += stride * sizeof(In))
    for (int64_t offset = 0; offset < width * int64_t{sizeof(In)}; offset += 64)
      __builtin_prefetch(at + offset);
}

// The rows of queries [i0, i0 + BQ) of head n in batch row b (those before T), for the
// query packers.
template <class In>
void prefetch_queries(const Problem& p, const In* x, int64_t b, int64_t n, int64_t i0) {
  prefetch_rows(x + ((b * p.T + i0) * p.N + n) * p.H, std::min<int64_t>(BQ, p.T - i0),
                p.N * p.H, p.H);
}

// keys [j0, j0 + BK) of head kh as (BK, Hp) rows, or transposed as (Hp, BK); keys
// past S or unseen are 0. Quantized keys (int8, float8) are multiplied by their
// `scales` (B, S, K) as they are packed (null for float keys).
template <class In>
void pack_keys(const Problem& p, const In* x, const Geometry& g, int64_t b, int64_t kh,
               int64_t j0, float* rows, float* cols, const float* scales = nullptr) {
  if (cols && p.Hp > p.H) std::fill(cols + p.H * BK, cols + p.Hp * BK, 0.0f);  // padded widths
  const uint8_t* k_seen = seen(p, g, kh);
  alignas(64) float factor[BK];  // each key's scale (1 for float keys, 0 unseen)
  const In* base = x + ((b * p.S + j0) * p.K + kh) * p.H;
  const int64_t stride = p.K * p.H;
  prefetch_rows(base, std::min<int64_t>(BK, p.S - j0), stride, p.H);
  for (int64_t c = 0; c < BK; ++c) {
    const int64_t j = j0 + c;
    const bool real = j < p.S && k_seen[j];
    factor[c] = !real ? 0.0f : scales ? scales[(b * p.S + j) * p.K + kh] : 1.0f;
    const In* src = real ? x + ((b * p.S + j) * p.K + kh) * p.H : nullptr;
    if (rows) {
      float* dst = rows + c * p.Hp;
      if (real && scales)
        for (int64_t h = 0; h < p.H; ++h) dst[h] = widen(src[h]) * factor[c];
      else if (real)
        for (int64_t h = 0; h < p.H; ++h) dst[h] = widen(src[h]);
      std::fill(dst + (real ? p.H : 0), dst + p.Hp, 0.0f);
    }
  }
  if (!cols) return;
  // Transposed: each width h a contiguous row of BK keys (the keys' rows, BK of them,
  // stay in L1 while every h reads them).
  for (int64_t h = 0; h < p.H; ++h) {
    float* dst = cols + h * BK;
    for (int64_t c = 0; c < BK; ++c) {
      const int64_t j = j0 + c;
      dst[c] = j < p.S && k_seen[j] ? widen(base[c * stride + h]) * factor[c] : 0.0f;
    }
  }
}

// Queries [i0, i0 + BQ) of head n, times `factor`, transposed: (Hp, BQ), column c
// holding query i0 + c; columns past T or of blind queries are 0.
template <class In>
void pack_queries_t(const Problem& p, const In* x, const Geometry& g, int64_t b, int64_t n,
                    int64_t i0, float factor, float* out) {
  std::fill(out, out + p.Hp * BQ, 0.0f);
  const uint8_t* q_sees = sees(p, g, n);
  prefetch_queries(p, x, b, n, i0);
  for (int64_t c = 0; c < BQ && i0 + c < p.T; ++c) {
    if (!q_sees[i0 + c]) continue;
    const In* src = x + ((b * p.T + i0 + c) * p.N + n) * p.H;
    for (int64_t h = 0; h < p.H; ++h) out[h * BQ + c] = widen(src[h]) * factor;
  }
}

// For PairStep: two bfloat16 in one 32-bit word, the first in the low half.
inline uint32_t pair(uint16_t first, uint16_t second) {
  return uint32_t{first} | uint32_t{second} << 16;
}

// Keys [j0, j0 + BK) of head kh as (BK, Hp / 2) pairs of bfloat16 along the width;
// unseen keys and padded widths are 0.
void pack_key_pairs(const Problem& p, const uint16_t* x, const Geometry& g, int64_t b,
                    int64_t kh, int64_t j0, uint32_t* out) {
  const int64_t W = p.Hp / 2;
  const uint8_t* k_seen = seen(p, g, kh);
  for (int64_t c = 0; c < BK; ++c) {
    const int64_t j = j0 + c;
    const uint16_t* src = x + ((b * p.S + j) * p.K + kh) * p.H;
    const bool real = j < p.S && k_seen[j];
    for (int64_t w = 0; w < W; ++w) {
      const uint16_t first = real && 2 * w < p.H ? src[2 * w] : 0;
      const uint16_t second = real && 2 * w + 1 < p.H ? src[2 * w + 1] : 0;
      out[c * W + w] = pair(first, second);
    }
  }
}

// Queries [i0, i0 + BQ) of head n transposed as (Hp / 2, BQ) pairs along the width
// (not scaled: the scale multiplies the scores); padded and blind columns are 0.
void pack_query_pairs(const Problem& p, const uint16_t* x, const Geometry& g, int64_t b,
                      int64_t n, int64_t i0, uint32_t* out) {
  const int64_t W = p.Hp / 2;
  std::fill(out, out + W * BQ, 0u);
  const uint8_t* q_sees = sees(p, g, n);
  prefetch_queries(p, x, b, n, i0);
  for (int64_t c = 0; c < BQ && i0 + c < p.T; ++c) {
    if (!q_sees[i0 + c]) continue;
    const uint16_t* src = x + ((b * p.T + i0 + c) * p.N + n) * p.H;
    for (int64_t w = 0; w < W; ++w) {
      const uint16_t first = 2 * w < p.H ? src[2 * w] : 0;
      const uint16_t second = 2 * w + 1 < p.H ? src[2 * w + 1] : 0;
      out[w * BQ + c] = pair(first, second);
    }
  }
}

}  // namespace
