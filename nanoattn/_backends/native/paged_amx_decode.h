// The paged pass's task of few query vectors on AMX tiles (amx.h): a decode token's G
// query heads of each key/value head (or a few rows of a short chunk), at least
// kAmxFewVectors of them (and not served by paged_task_amx: several heads, or int8), bfloat16 or float32 queries over a bfloat16 or int8 pool. The
// same task as paged_task's, tile after tile of kPagedKeys keys, its products on tiles:
//
//   - scores: the keys are the left operand, 16 of them a tile, loaded straight from the
//     pool where the 16 token rows are evenly spaced (a page of 16 or more: the token
//     row is the stride) and copied (int8: widened to bfloat16, exactly) otherwise; the
//     query vectors, four a group, the right operand (packed once a task; float32 ones
//     as three bfloat16 pieces whose products the tile sums: exact, as the weights'). The
//     16 x 4 scores go back to each vector's row of w.s (amx_decode_scores), times the
//     scale and the keys' scales;
//   - the online softmax as paged_tile's (paged_tile_softmax, in natural units, the
//     weights of quantized values times their scales);
//   - outputs: a group's 4 weight rows as three bfloat16 pieces each (amx_split: the
//     float32 weights exactly) are the left operand, the values packed in key pairs
//     (amx_values_pack, int8 widened) the right one, and the outputs w.o the
//     accumulators (4 rows of 16 numbers a tile, loaded and stored once a tile of keys).
//
// A tile product costs about the same for 4 rows of A as for 1 and half of one of 16 (a
// loop of products, 2-core Intel Xeon, family 6 model 207: 2.5-2.7 ns against 5.2), so
// groups of 4 vectors waste little of it. Where the vector units widen every number and
// multiply it G times, a tile takes 16 keys x 32 numbers x 4 vectors in one product;
// where G is 4 the widening and packing the tiles need cost as much as they save.
//
// Included by paged.h after paged_amx.h (attention.cc's one translation unit, unnamed
// namespace).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "amx.h"
#include "simd.h"

namespace {

// The queries' and pools' types the decode tiles take.
template <class Q, class In>
constexpr bool kAmxFewTypes = (std::is_same_v<Q, uint16_t> || std::is_same_v<Q, float>) &&
                              (std::is_same_v<In, uint16_t> || std::is_same_v<In, int8_t>);

#if NANOATTN_AMX

// bfloat16 pieces of a query number: 1 for bfloat16, 3 for float32 (amx_split's, exact).
template <class Q>
constexpr int64_t kAmxQueryPieces = std::is_same_v<Q, float> ? kAmxPieces : 1;

// Tiles of the decode task: 0, 1 and 2 of 16 rows of 64 bytes (the scores: 16 keys x 16
// columns, the first 4 a group's vectors; keys, 16 x 32 numbers; a group's queries, 16
// pairs of numbers x 16 columns, 4 of them real; the values: 16 pairs of keys x 16
// numbers, two tiles at once), 3 to 7 of 4 rows (outputs, 4 vectors x 16 numbers in
// float32, two at once: 3 and 5; the weights' three pieces, 4 vectors x 32 keys: 4, 6
// and 7). Tiles of one shape take either role, so the values' products run as two
// chains (each a load, three products and a store: alone, a chain waits on each step).
const AmxConfig kAmxFew = {1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64},
                           {16, 16, 16, 4, 4, 4, 4, 4}};

// The query vectors a head of a task needs for the decode tiles. Against the vector
// units on one thread (2-core Intel Xeon, family 6 model 207, three alternations with
// the build before them): the B = 16 decode (512-8192 keys, H = 128) at G = 16 (N = 32
// on K = 2) 12.1-13.4 ms against 14.0-16.6, at G = 8 18.1-19.5 against 17.2-19.9 (no
// gain); MLA's absorbed decode over int8 pages (G = 16, H = 576, Hv = 512, 32768 keys,
// float32 queries) 10.3-12.1 against 12.7-14.3. At G = 4 no gain either (bfloat16 and
// int8, on two threads).
constexpr int64_t kAmxFewVectors = 16;

// Whether the decode tiles serve a task of `vectors` query vectors a head: bfloat16 or
// float32 queries over bfloat16 or int8 pools (kAmxFewTypes), rows of whole 32-number
// slices, and a process that may use the tiles.
template <class Q, class In>
inline bool amx_decode_serves(const Paged& p, int64_t vectors) {
  return kAmxFewTypes<Q, In> && vectors >= kAmxFewVectors && p.H == p.Hp && p.H % 32 == 0 &&
         p.Hv == p.Hvp && p.Hv % 32 == 0 && amx_ready();
}

// A query vector's H numbers as bfloat16 pieces (pieces, H) whose sum is each: the
// numbers themselves, or amx_split's three (the weights' split: exact).
inline const uint16_t* amx_query_pieces(const uint16_t* x, int64_t, uint16_t*) { return x; }
inline const uint16_t* amx_query_pieces(const float* x, int64_t H, uint16_t* out) {
  for (int64_t h = 0; h < H; h += 32)
    amx_split(_mm512_loadu_ps(x + h), _mm512_loadu_ps(x + h + 16), out + h, H);
  return out;
}

// The task's query vectors (unscaled, padding vectors 0) as right operands: a.q's tile
// (head hh, group of 4 vectors, piece, slice of 32 numbers) holds, row i, the pairs of
// numbers (32 slice + 2i, + 1) of the group's 4 vectors in its first 4 columns (of 16).
template <class Q>
void amx_decode_queries(const Paged& p, const Q* q, const PagedTask& task, const PagedWork& w,
                        AmxScratch& a) {
  constexpr int64_t pieces = kAmxQueryPieces<Q>;
  const int64_t G = p.G, H = p.H, groups = w.padded / 4, tile = H * 16;  // a piece's tiles
  const int64_t size = w.heads * groups * pieces * tile;
  a.q.fit(size);
  std::memset(a.q.data(), 0, size * 2);
  uint16_t* split = a.k.data();  // a vector's pieces (pieces, H): a.k is free until the keys
  for (int64_t hh = 0; hh < w.heads; ++hh)
    for (int64_t v = 0; v < w.padded; ++v) {
      const int64_t r = v / G;
      if (r >= w.rows || !p.real[task.r0 + r]) continue;
      const Q* src = q + ((task.r0 + r) * p.N + (task.kh0 + hh) * G + v % G) * H;
      const uint16_t* parts = amx_query_pieces(src, H, split);
      uint16_t* dst = a.q.data() + (hh * groups + v / 4) * pieces * tile + (v % 4) * 2;
      for (int64_t i = 0; i < pieces; ++i)
        for (int64_t h = 0; h < H; ++h) dst[i * tile + (h / 2) * 32 + h % 2] = parts[i * H + h];
    }
}

// The rows of 16 keys krow[c] + offset (c < m) as a left operand: where bfloat16 rows are
// evenly spaced (m = 16), where they lie (`stride` bytes apart); otherwise copied into
// a.k (int8 widened), zeros from m on.
template <class In>
const uint16_t* amx_decode_keys(const In* const* krow, int64_t m, int64_t offset, int64_t H,
                                AmxScratch& a, int64_t& stride) {
  if constexpr (std::is_same_v<In, uint16_t>) {
    const int64_t step = m == 16 ? krow[1] - krow[0] : 0;
    bool even = step > 0;
    for (int64_t c = 2; even && c < 16; ++c) even = krow[c] - krow[c - 1] == step;
    if (even) {
      stride = step * 2;
      return krow[0] + offset;
    }
  }
  uint16_t* dst = a.k.data();
  for (int64_t c = 0; c < 16; ++c)
    for (int64_t h = 0; h < H; h += 32)
      _mm512_storeu_si512(dst + c * H + h, c < m ? amx_bf16x32(krow[c] + offset + h)
                                                 : _mm512_setzero_si512());
  stride = H * 2;
  return dst;
}

// The scores of 16 keys (rows of 16 float32 numbers at `scores`, the first 4 a group's
// vectors) as 4 rows of 16 keys, times `scale` (key by key), at rows[j] for vector j.
inline void amx_decode_scores(const float* scores, __m512 scale, float* const (&rows)[4]) {
  alignas(64) static const int32_t kByVector[16] = {0, 4, 8, 12, 1, 5, 9, 13,
                                                    2, 6, 10, 14, 3, 7, 11, 15};
  const __m512i by_vector = _mm512_load_si512(kByVector);
  __m512 z[4];  // z[k]: keys 4k .. 4k + 3, then one 128-bit lane a vector
  for (int k = 0; k < 4; ++k) {
    const float* key = scores + 64 * k;
    __m512 x = _mm512_castps128_ps512(_mm_loadu_ps(key));
    x = _mm512_insertf32x4(x, _mm_loadu_ps(key + 16), 1);
    x = _mm512_insertf32x4(x, _mm_loadu_ps(key + 32), 2);
    x = _mm512_insertf32x4(x, _mm_loadu_ps(key + 48), 3);
    z[k] = _mm512_permutexvar_ps(by_vector, x);
  }
  const __m512 t0 = _mm512_shuffle_f32x4(z[0], z[1], 0x44), t1 = _mm512_shuffle_f32x4(z[0], z[1], 0xEE);
  const __m512 t2 = _mm512_shuffle_f32x4(z[2], z[3], 0x44), t3 = _mm512_shuffle_f32x4(z[2], z[3], 0xEE);
  _mm512_storeu_ps(rows[0], _mm512_mul_ps(_mm512_shuffle_f32x4(t0, t2, 0x88), scale));
  _mm512_storeu_ps(rows[1], _mm512_mul_ps(_mm512_shuffle_f32x4(t0, t2, 0xDD), scale));
  _mm512_storeu_ps(rows[2], _mm512_mul_ps(_mm512_shuffle_f32x4(t1, t3, 0x88), scale));
  _mm512_storeu_ps(rows[3], _mm512_mul_ps(_mm512_shuffle_f32x4(t1, t3, 0xDD), scale));
}

// The task's heads against the tile of keys [j0, j0 + n) at `parity` on tiles: every
// query vector's scores into w.s, their online softmax, then outputs += weights x values.
// The next tile's lines are fetched a few rows at a time between the products (asked
// for at once, they stall the core, as paged_tile's).
template <class Q, class In>
void amx_decode_tile(const Paged& p, const PagedTask& task, const PagedWork& w,
                     const PagedTiles<In>& tiles, int parity, int64_t j0, int64_t n,
                     AmxScratch& a) {
  constexpr bool quantized = kQuantized<In>;
  constexpr int64_t pieces = kAmxQueryPieces<Q>;
  const int64_t H = p.H, Hv = p.Hv, groups = w.padded / 4, slices = H / 32;
  const int next = (parity + 1) % (kPagedAhead + 1);
  const int64_t following = std::min<int64_t>(kPagedKeys, w.hi - j0 - n);
  auto fetch = [&](int kind, int64_t c0, int64_t m, int64_t hh) {
    if (c0 < following)  // by asm statements, which GCC keeps (fetch_line)
      tiles.template fetch<true>(next, kind, c0, std::min(m, following - c0), hh);
  };
  const int64_t per_slice = (16 + slices - 1) / slices;  // next rows fetched a slice
  // the operands' buffers (thread-local: read once, not after every tile instruction)
  const uint16_t *queries = a.q.data(), *values = a.v.data();
  uint16_t* parts = a.w.data();  // a group's weights: (kAmxPieces, 4, 32)
  float* scores = a.s.data();
  for (int64_t hh = 0; hh < w.heads; ++hh) {
    const float* kscale = tiles.scales_at(parity, 0, hh);
    for (int64_t c0 = 0; c0 < n; c0 += 16) {
      int64_t stride;
      const uint16_t* k = amx_decode_keys(tiles.rows_of[parity][0] + c0,
                                          std::min<int64_t>(16, n - c0), hh * H, H, a, stride);
      const __m512 scale = quantized ? _mm512_mul_ps(_mm512_loadu_ps(kscale + c0), _mm512_set1_ps(p.scale))
                                     : _mm512_set1_ps(p.scale);
      for (int64_t g = 0; g < groups; ++g) {
        const uint16_t* qg = queries + (hh * groups + g) * pieces * H * 16;
        amx_fence();
        _tile_zero(0);
        for (int64_t s = 0; s < slices; ++s) {
          if (g == 0) fetch(0, c0 + s * per_slice, per_slice, hh);
          _tile_loadd(1, k + s * 32, stride);
          for (int64_t i = 0; i < pieces; ++i) {
            _tile_loadd(2, qg + (i * slices + s) * 512, 64);
            _tile_dpbf16ps(0, 1, 2);
          }
        }
        _tile_stored(0, scores, 64);
        amx_fence();
        float* const rows[4] = {w.s + (hh * w.padded + 4 * g) * kPagedKeys + c0,
                                w.s + (hh * w.padded + 4 * g + 1) * kPagedKeys + c0,
                                w.s + (hh * w.padded + 4 * g + 2) * kPagedKeys + c0,
                                w.s + (hh * w.padded + 4 * g + 3) * kPagedKeys + c0};
        amx_decode_scores(scores, scale, rows);
      }
    }
  }
  paged_tile_softmax(p, task, w, tiles, parity, j0, n);
  for (int64_t hh = 0; hh < w.heads; ++hh) {
    const In* vrow[kPagedKeys];
    for (int64_t c = 0; c < n; ++c) vrow[c] = tiles.rows_of[parity][1][c] + hh * Hv;
    amx_values_pack(vrow, n, Hv, a, [&](int64_t k0) { fetch(1, k0, 2, hh); });
    for (int64_t g = 0; g < groups; ++g) {
      for (int j = 0; j < 4; ++j) {
        const float* row = w.s + (hh * w.padded + 4 * g + j) * kPagedKeys;
        amx_split(_mm512_loadu_ps(row), _mm512_loadu_ps(row + 16), parts + j * 32, 4 * 32);
      }
      float* o = w.o + (hh * w.padded + 4 * g) * Hv;
      amx_fence();
      _tile_loadd(4, parts, 64);
      _tile_loadd(6, parts + 128, 64);
      _tile_loadd(7, parts + 256, 64);
      for (int64_t d = 0; d < Hv; d += 32) {  // two chains: numbers d .. d + 15, + 31
        _tile_loadd(3, o + d, Hv * 4);
        _tile_loadd(0, values + d * 32, 64);
        _tile_loadd(5, o + d + 16, Hv * 4);
        _tile_loadd(1, values + (d + 16) * 32, 64);
        _tile_dpbf16ps(3, 4, 0);
        _tile_dpbf16ps(5, 4, 1);
        _tile_dpbf16ps(3, 6, 0);
        _tile_dpbf16ps(5, 6, 1);
        _tile_dpbf16ps(3, 7, 0);
        _tile_dpbf16ps(5, 7, 1);
        _tile_stored(3, o + d, Hv * 4);
        _tile_stored(5, o + d + 16, Hv * 4);
      }
      amx_fence();
    }
  }
}

// The task on tiles: w as paged_start leaves it (w.o: a.o, rows on 64 bytes), its keys
// [w.lo, w.hi) tile after tile; w.o, w.m and w.l left for paged_finish.
template <class Q, class In>
void paged_task_amx_decode(const Paged& p, const Q* q, const In* kp, const In* vp,
                           const PagedTask& task, const PagedWork& w, float* scales,
                           AmxScratch& a) {
  static_assert(kAmxPieces == 3, "three tiles of weights");
  amx_decode_queries(p, q, task, w, a);
  PagedTiles<In> tiles{p, task, kp, vp, w.heads, w.hi, scales, {}};
  amx_begin(kAmxFew);
  paged_tiles_walk(tiles, w, [&](int parity, int64_t j0, int64_t n) {
    amx_decode_tile<Q>(p, task, w, tiles, parity, j0, n, a);
  });
  amx_end();
}

#endif

}  // namespace
