// The paged pass's task on AMX tiles (amx.h): one key/value head's many query vectors
// (a prefill chunk's rows x the head's G query heads, or the group pass of shared
// prefixes, whose rows are every member's decode token) over a bfloat16 pool, with
// bfloat16 queries. The same task as paged_task's, in steps of kAmxKeys keys:
//
//   1. the step's key and value rows located through the page table (as PagedTiles), the
//      next step's fetched, and both packed as the tiles' right operands;
//   2. for each block of 32 vectors: its scores against the step's keys (amx_scores);
//      each vector's row masked where the step is not wholly visible to it (paged_mask:
//      band, tree, keys past the step) and its online softmax on the vector units (in
//      units of log2 e), whose weights go to the tiles as three bfloat16 pieces
//      (amx_weights); its outputs (float32, in memory between steps) += weights x values
//      (amx_values).
//
// The running maximum moves lazily: a step's weights are made against it at once and
// kept while their sum stays below 2^kAmxLazy (so does every weight: nothing overflows);
// only past that (or where it is -inf, or a sum is NaN) is the step's maximum found and,
// where it exceeds the running one by more than kAmxLazy or the sum was refused, the sum
// and the outputs rescaled to it. Most steps rescale nothing. Any maximum gives the
// same softmax; the log-sum-exp is m + log l whichever m is kept (m in natural units at
// the end).
//
// Included by paged.h after the task's types (attention.cc's one translation unit,
// unnamed namespace).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "amx.h"
#include "simd.h"

namespace {

#if NANOATTN_AMX

constexpr int kAmxLazyBits = 12;
constexpr float kAmxLazy = kAmxLazyBits;  // in units of log2 e: weights below 2^12
constexpr float kAmxBound = 1 << kAmxLazyBits;  // 2^kAmxLazy
constexpr int64_t kAmxVectors = 128;  // query vectors a task (rows x G)

// Whether the tiles serve a task of `heads` key/value heads and `vectors` query vectors
// (rows x G) of this call: one head, a tile's 16 rows of vectors at least, a positive
// scale (a row's maximum is taken before scaling), rows that are whole slices of 32
// numbers, and a process that may use the tiles.
inline bool amx_serves(const Paged& p, int64_t heads, int64_t vectors) {
  return heads == 1 && vectors >= 16 && p.scale > 0 && p.H == p.Hp && p.H % 32 == 0 &&
         p.Hv == p.Hvp && p.Hv % 32 == 0 && amx_ready();
}

// A row's weights 2^(scale * row[c] - m) for its `cols` scores (in units of log2 e
// once scaled) into `weights` as pieces (amx_split); returns their lane sums (NaN where
// a score is NaN, inf where a weight overflows).
inline vf amx_exponentials(const float* row, int64_t cols, float scale, float m,
                           uint16_t* weights, int64_t piece) {
  const vf shift = splat(-m), times = splat(scale);
  vf sum = vf{};
  for (int64_t c = 0; c < cols; c += 32) {
    const vf e0 = vexp2(load(row + c) * times + shift);
    const vf e1 = vexp2(load(row + c + 16) * times + shift);
    sum += e0 + e1;
    amx_split(__builtin_bit_cast(__m512, e0), __builtin_bit_cast(__m512, e1), weights + c, piece);
  }
  return sum;
}

// The step's softmax: each real vector's scores a.s[v] against keys [j0, j0 + n) masked,
// its maximum, sum and output row moved on (lazily), its weights into a.w as pieces;
// vectors that are padding or rows not written get weights 0.
inline void amx_weights(const Paged& p, const PagedTask& task, const PagedWork& w,
                        AmxScratch& a, int64_t j0, int64_t n, int64_t v0) {
  const int64_t cols = (n + 31) / 32 * 32, piece = 32 * kAmxKeys;
  const float scale = p.scale * kLog2e, cap = p.soft_cap * kLog2e;
  for (int64_t v = v0; v < v0 + 32; ++v) {
    float* row = a.s.data() + (v - v0) * kAmxKeys;
    uint16_t* weights = a.w.data() + (v - v0) * kAmxKeys;
    const int64_t r = v / p.G, t = task.r0 + r;
    auto none = [&] {
      for (int i = 0; i < kAmxPieces; ++i) std::memset(weights + i * piece, 0, cols * 2);
    };
    if (r >= w.rows || !p.real[t]) {
      none();
      continue;
    }
    const int64_t pos = p.tree ? p.tree_position(t) : w.base + r;
    if (p.soft_cap > 0)  // in units of log2 e: cap * tanh(s / cap), both scaled
      for (int64_t c = 0; c < n; ++c) row[c] = cap * std::tanh(row[c] * scale / cap) / scale;
    // every key of the step seen by the row (no tree, the band holding the step, no
    // column past n): no mask; where the row has a finite maximum already, the weights
    // against it at once, kept unless their sum passes 2^kAmxLazy (then a weight may,
    // and the row's maximum moves: once more, below) or is NaN; else its maximum first
    const bool whole = !p.tree && n == cols && (p.left < 0 || pos - p.left <= j0) &&
                       (p.right < 0 || pos + p.right >= j0 + n - 1);
    float& m = w.m[v];
    // tried: the weights against m made first; past the `if`, they were refused
    const bool tried = whole && std::isfinite(m);
    if (tried) {
      const float sum = hsum(amx_exponentials(row, cols, scale, m, weights, piece));
      if (sum <= kAmxBound) {
        w.l[v] += sum;
        continue;
      }
    }
    float seen;
    if (whole) {
      vf x = load(row);
      for (int64_t c = VW; c < cols; c += VW) x = nan_max(load(row + c), x);
      seen = hmax(x) * scale;
    } else {
      seen = paged_mask(p, w, t, pos, j0, n, cols, row) * scale;
    }
    const float m_new = nan_max(m, seen);
    if (m_new == -kInf) {  // nothing seen yet
      none();
      continue;
    }
    // the first keys seen, a NaN, a maximum far above, or weights summing past the bound
    if (!(m_new <= m + kAmxLazy) || (tried && m_new > m)) {
      const float alpha = std::exp2(m - m_new);  // 0 when m was -inf
      w.l[v] *= alpha;
      paged_rescale(p, w, v, alpha);  // rows Hv wide: Hv == Hvp where the tiles serve
      m = m_new;
    }
    w.l[v] += hsum(amx_exponentials(row, cols, scale, m, weights, piece));
  }
}

// The task on tiles: its keys [w.lo, w.hi) a step at a time; w.o, w.m and w.l as
// paged_tile leaves them (w.o: a.o, fitted to the task), for paged_finish.
inline void paged_task_amx(const Paged& p, const uint16_t* q, const uint16_t* kp,
                           const uint16_t* vp, const PagedTask& task, const PagedWork& w,
                           AmxScratch& a) {
  const int64_t G = p.G, H = p.H, Hv = p.Hv;
  for (int64_t v = 0; v < w.padded; ++v) {  // the queries unscaled, padding 0
    const int64_t r = v / G;
    uint16_t* dst = a.q.data() + v * H;
    if (r < w.rows && p.real[task.r0 + r])
      std::memcpy(dst, q + ((task.r0 + r) * p.N + task.kh0 * G + v % G) * H, H * 2);
    else
      std::memset(dst, 0, H * 2);
  }
  amx_begin();
  const uint16_t* rows[2][2][kAmxKeys];  // [step parity][keys, values][key]
  // the step's rows from j0 at `parity`: n keys, through the page table
  auto locate = [&](int64_t j0, int parity) {
    const int64_t n = std::min<int64_t>(kAmxKeys, w.hi - j0);
    paged_walk(p, task.b, j0, n, [&](int64_t c, int64_t row) {
      rows[parity][0][c] = kp + row * p.key_row + task.kh0 * H;
      rows[parity][1][c] = vp + row * p.value_row + task.kh0 * Hv;
    });
    return n;
  };
  int64_t n = w.lo < w.hi ? locate(w.lo, 0) : 0;
  for (int64_t j0 = w.lo, step = 0; j0 < w.hi; j0 += kAmxKeys, ++step) {
    const int parity = step % 2;
    const int64_t next = j0 + kAmxKeys < w.hi ? locate(j0 + kAmxKeys, 1 - parity) : 0;
    amx_keys(rows[parity][0], n, H, a);
    fetch_rows(rows[1 - parity][0], next, 0, H * 2);  // the next step's, into L2
    amx_values_pack(rows[parity][1], n, Hv, a, [](int64_t) {});
    fetch_rows(rows[1 - parity][1], next, 0, Hv * 2);
    for (int64_t v0 = 0; v0 < w.padded; v0 += 32) {  // a block's scores, weights, outputs
      amx_scores(a, v0, H, n);
      amx_weights(p, task, w, a, j0, n, v0);
      amx_values(a, Hv, n, w.o + v0 * Hv);
    }
    n = next;
  }
  for (int64_t v = 0; v < w.padded; ++v) w.m[v] *= kLn2;  // the maxima in natural units
  amx_end();
}

#endif

}  // namespace
