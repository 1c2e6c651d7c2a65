// DeepSeek-V3.2's indexer scores (nanoattn/_layers/indexer.py): for every query t of a
// row and every key s of the same row,
//
//   out[t, s] = sum_h w[t, h] * relu(scale * q[t, h, :] . keys[s, :])
//
// float32 throughout. The query's heads are the vector lanes (its matrix transposed once
// per task, (d, HP), HP the heads padded with zero heads of zero weight to whole register
// tiles) and the keys are read in place, one float at a time broadcast over the lanes:
// no copy of the keys, no sum across lanes but one per key. A NaN anywhere in a product
// stays NaN through the ReLU (as jax.nn.relu) and reaches that key's score.
//
// Axis letters: G rows (leading axes flattened), T queries, S keys, Hi the indexer's
// heads, d their width.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "simd.h"
#include "threads.h"

namespace {

// A register tile: kIndexKeys keys by kIndexHeadVectors vectors of heads (AVX-512: 4 x 4
// accumulators of 32 registers; AVX2: 4 x 2 of 16), beside the keys' running sums.
constexpr int kIndexKeys = 4;
#if defined(__AVX512F__)
constexpr int kIndexHeadVectors = 4;
#else
constexpr int kIndexHeadVectors = 2;
#endif
constexpr int64_t kIndexHeadTile = kIndexHeadVectors * VW;
constexpr int64_t kIndexTaskKeys = 512;  // keys a task scores: one query's (d, HP) reused

struct IndexProblem {
  int64_t G, T, Hi, d, S;
  float scale;
  int64_t HP() const { return (Hi + kIndexHeadTile - 1) / kIndexHeadTile * kIndexHeadTile; }
};

// KJ keys (rows of d floats) scored against the transposed query qt (d, HP) with the
// padded weights w (HP,).
template <int KJ>
inline void index_tile(const float* qt, const float* w, int64_t HP, int64_t d,
                       const float* keys, float* out) {
  constexpr int HV = kIndexHeadVectors;
  vf total[KJ] = {};
  for (int64_t h0 = 0; h0 < HP; h0 += kIndexHeadTile) {
    vf acc[KJ][HV] = {};
    for (int64_t c = 0; c < d; ++c) {
      vf qv[HV];
      for (int v = 0; v < HV; ++v) qv[v] = load(qt + c * HP + h0 + v * VW);
      for (int j = 0; j < KJ; ++j) {
        const vf k = splat(keys[j * d + c]);
        for (int v = 0; v < HV; ++v) acc[j][v] += qv[v] * k;
      }
    }
    for (int j = 0; j < KJ; ++j)
      for (int v = 0; v < HV; ++v) {
        const vf a = acc[j][v] < splat(0.0f) ? vf{} : acc[j][v];  // NaN stays NaN
        total[j] += a * load(w + h0 + v * VW);
      }
  }
  for (int j = 0; j < KJ; ++j) out[j] = hsum(total[j]);
}

// Keys [s0, s1) of row g for query t: the query transposed and scaled into qt, the
// weights padded into w (both the worker's scratch), then the keys in tiles.
inline void index_task(const IndexProblem& p, const float* q, const float* wts,
                       const float* keys, float* out, int64_t g, int64_t t, int64_t s0,
                       int64_t s1, float* qt, float* w) {
  const int64_t HP = p.HP(), row = g * p.T + t;
  const float* qr = q + row * p.Hi * p.d;  // (Hi, d)
  std::fill(qt, qt + p.d * HP, 0.0f);
  for (int64_t h = 0; h < p.Hi; ++h)
    for (int64_t c = 0; c < p.d; ++c) qt[c * HP + h] = p.scale * qr[h * p.d + c];
  std::fill(w, w + HP, 0.0f);
  std::copy(wts + row * p.Hi, wts + (row + 1) * p.Hi, w);
  const float* kr = keys + g * p.S * p.d;
  float* o = out + row * p.S;
  int64_t s = s0;
  for (; s + kIndexKeys <= s1; s += kIndexKeys)
    index_tile<kIndexKeys>(qt, w, HP, p.d, kr + s * p.d, o + s);
  for (; s < s1; ++s) index_tile<1>(qt, w, HP, p.d, kr + s * p.d, o + s);
}

// Every (row, query, chunk of kIndexTaskKeys keys) a task, shared among the threads.
inline void index_scores(xla::ffi::ThreadPool& pool, const IndexProblem& p, const float* q,
                         const float* w, const float* keys, float* out) {
  const int threads = max_threads(pool);
  const int64_t chunks = (p.S + kIndexTaskKeys - 1) / kIndexTaskKeys;
  const int64_t HP = p.HP();
  std::vector<std::vector<float>> scratch(threads, std::vector<float>((p.d + 1) * HP));
  parallel_for(pool, threads, p.G * p.T * chunks, [&](int64_t task, int worker) {
    const int64_t chunk = task % chunks, query = task / chunks;
    const int64_t s0 = chunk * kIndexTaskKeys, s1 = std::min(p.S, s0 + kIndexTaskKeys);
    float* qt = scratch[worker].data();
    index_task(p, q, w, keys, out, query / p.T, query % p.T, s0, s1, qt, qt + p.d * HP);
  });
}

}  // namespace
