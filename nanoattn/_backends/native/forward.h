// The forward pass: online softmax over key blocks (FlashAttention-2), one task per
// (batch row b, query head n, up to eight query blocks), each key block read once for
// all the task's query blocks (from L3 once, not once per block). The tasks are dealt
// to the threads costliest first. A short call (a group's tiles in kGroupBytes, four
// groups per thread at least) runs one task per (b, key/value head) instead: it packs
// its group's tiles and runs all their blocks while they are in cache. The logits are in
// units of log2 e (exp2, the factor folded into the queries' scale or the soft cap). A
// decode step (fewer than VW queries) scores rows of queries; the other calls score
// columns of queries (keys x queries), so that every per-query statistic is a vector.
// Nothing of size T x S exists.
//
// Included by attention.cc only, in its one translation unit: the code sits in an
// unnamed namespace there as here, so that every function keeps internal linkage.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

#include "gemm.h"
#include "logits.h"
#include "pack.h"
#include "simd.h"
#include "threads.h"
#include "visibility.h"

namespace {

// The inputs of a forward pass: queries of type In, keys and values of type Kv (In
// again, or int8 / float8 with their scales (B, S, K); null for float keys).
template <class In, class Kv>
struct ForwardIn {
  const In* q;      // (B, T, N, H)
  const Kv *k, *v;  // (B, S, K, H)
  const float *key_scales, *value_scales;
};

// The output stays float32 for every input type: the backward pass's row term
// rowsum(dout * out) from an output rounded to bfloat16 would cancel badly.
struct ForwardOut {
  float* out;  // (B, T, N, H)
  float* lse;  // (B, T, N): log-sum-exp of the visible logits; -inf for a blind row
};

// Each query's output o / l and log-sum-exp m * unit + log l (o[r * r_stride + h *
// h_stride] for query i0 + r; `unit` ln 2 where m is in units of log2 e), or zeros and
// -inf for a query that saw nothing.
void finish(const Problem& p, ForwardOut res, int64_t b, int64_t n, int64_t i0, int64_t rows,
            const float* m, const float* l, const float* o, int64_t r_stride, int64_t h_stride,
            float unit = 1.0f) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = i0 + r;
    float* dst = res.out + ((b * p.T + i) * p.N + n) * p.H;
    float* lse = res.lse + (b * p.T + i) * p.N + n;
    if (l[r] != 0) {  // l >= 1 for a query that sees a key; NaN from NaN or inf content
      const float inv = 1.0f / l[r];
      for (int64_t h = 0; h < p.H; ++h) dst[h] = o[r * r_stride + h * h_stride] * inv;
      *lse = m[r] * unit + std::log(l[r]);
    } else {
      std::fill(dst, dst + p.H, 0.0f);
      *lse = -kInf;  // the log-sum-exp of no logit, as in the flash kernel and jax.nn
    }
  }
}

// The forward pass of one (b, n, query block) with scores (queries, keys) = Q K^T:
// for calls of fewer than VW queries (a decode step), where the transposed layout
// below would compute VW query columns for each real one.
template <class In>
void forward_rows_task(const Problem& p, const std::vector<Geometry>& geo, const In* q,
                       const Tiles& keys_t, const Tiles& values, ForwardOut res, int64_t task) {
  const int64_t qb = task % p.n_q(), n = (task / p.n_q()) % p.N, b = task / (p.n_q() * p.N);
  const int64_t kh = n / p.G, i0 = qb * BQ, i1 = std::min(i0 + BQ, p.T), rows = i1 - i0;
  const int64_t mr = round_up(rows, MR);
  const Geometry& g = geo[b];
  const int64_t Hp = p.Hp;
  float* const qs = scratch(kTask, 2 * BQ * Hp + BQ * BK);
  float* const o = qs + BQ * Hp;
  float* const s = o + BQ * Hp;
  alignas(64) float m[BQ], l[BQ];
  std::fill(m, m + BQ, -kInf);
  std::fill(l, l + BQ, 0.0f);
  std::fill(o, o + BQ * Hp, 0.0f);
  pack_rows(p, q, g, b, n, i0, p.scale, qs);
  const uint8_t* q_sees = sees(p, g, n);
  auto [first, last] = key_blocks(p, g, i0, i1);
  for (int64_t kb = first; kb <= last; ++kb) {
    const int64_t j0 = kb * BK, j1 = std::min(j0 + BK, p.S), kc = round_up(j1 - j0, VW);
    const FnBlock fn = fn_block(p, b, n, qb, kb);
    const Block kind = combine(classify(p, g, i0, i1, j0, j1), fn);
    if (kind == Block::kSkip) continue;
    gemm(mr, kc, Hp, qs, Hp, 1, keys_t.at(key_tile(p, b, kh, kb)), BK, s, BK, false);
    // Each row's new maximum; maxima keep a NaN: a row whose logits are all NaN (a NaN
    // query, say) is not a row that sees nothing, and its NaN must reach the output
    // (docs/conventions.md).
    alignas(64) float m_new[BQ];
    for (int64_t r = 0; r < BQ; ++r) {
      m_new[r] = m[r];
      if (r >= rows || !q_sees[i0 + r]) continue;
      float* row = s + r * BK;
      const uint8_t* bits = fn.rows ? fn.rows + r * (BK / 8) : nullptr;
      cap_and_mask(p, g, b, i0 + r, j0, kc, kind, bits, row, nullptr);
      vf mx = splat(-kInf);
      for (int c = 0; c < kc; c += VW) mx = nan_max(load(row + c), mx);
      m_new[r] = nan_max(m[r], hmax(mx));
    }
    // The rescale of what the rows summed so far, exp(m - m_new), VW rows at a time:
    // 0 when m is -inf, 1 for a row that still sees nothing (m_new -inf).
    alignas(64) float alpha[BQ];
    for (int r = 0; r < BQ; r += VW) {
      const vf old_max = load(m + r), new_max = load(m_new + r);
      store(alpha + r, new_max == -kInf ? splat(1.0f) : vexp(old_max - new_max));
    }
    for (int64_t r = 0; r < mr; ++r) {
      float* row = s + r * BK;
      if (m_new[r] == -kInf) {  // a padded or blind row, or nothing visible so far
        std::fill(row, row + kc, 0.0f);
        continue;
      }
      vf sum = vf{};
      const vf shift = splat(m_new[r]);
      for (int c = 0; c < kc; c += VW) {
        vf e = vexp(load(row + c) - shift);
        store(row + c, e);
        sum += e;
      }
      l[r] = l[r] * alpha[r] + hsum(sum);
      m[r] = m_new[r];
      if (alpha[r] != 1.0f) {
        float* orow = o + r * Hp;
        const vf a = splat(alpha[r]);
        for (int64_t h = 0; h < Hp; h += VW) store(orow + h, load(orow + h) * a);
      }
    }
    gemm(mr, Hp, kc, s, BK, 1, values.at(key_tile(p, b, kh, kb)), Hp, o, Hp, true);
  }
  finish(p, res, b, n, i0, rows, m, l, o, Hp, 1);
}


// Which keys each query column of a block sees, as vectors over the columns: the
// interval [lo, hi] (empty for padded and blind columns) and the segment id.
struct Columns {
  alignas(64) int32_t lo[BQ], hi[BQ], seg[BQ];
};

Columns columns(const Problem& p, const Geometry& g, int64_t b, int64_t n, int64_t i0) {
  Columns c;
  const uint8_t* q_sees = sees(p, g, n);
  for (int64_t r = 0; r < BQ; ++r) {
    const int64_t i = i0 + r;
    const bool real = i < p.T && q_sees[i];
    c.lo[r] = real ? static_cast<int32_t>(g.lo[i]) : 1;
    c.hi[r] = real ? static_cast<int32_t>(g.hi[i]) : 0;
    c.seg[r] = real && p.q_seg ? p.q_seg[b * p.T + i] : 0;
  }
  return c;
}

// One query block of a forward task: its queries transposed (Hp, BQ) times the scale,
// its output accumulated as O^T (Hp, BQ), the columns' running maxima and sums, which
// keys each column sees, and the key blocks [first, last] it may see.
struct ForwardBlock {
  int64_t qb, i0, rows, nc, first, last;
  float* qt;
  float* ot;
  alignas(64) float m[BQ], l[BQ];
  Columns cols;
};

// Query block `fb` against key block kb, transposed: scores S^T (keys, queries) = K Q^T,
// so that every per-query statistic (maximum, sum, rescale) is a vector over 16
// (AVX-512) or 8 query columns and no row is ever reduced across its lanes; then O^T
// (Hp, queries) += V^T P^T. `st` is the (BK, BQ) scores' scratch. The logits are in
// units of log2 e, for exp2: the factor rides on the queries' scale, or, under a soft
// cap (which applies to the logits themselves), on the cap.
template <class In>
void forward_step(const Problem& p, const Geometry& g, int64_t b, int64_t n, ForwardBlock& fb,
                  int64_t kb, const float* keys, const float* values, float* st) {
  const int64_t j0 = kb * BK, j1 = std::min(j0 + BK, p.S), kr = round_up(j1 - j0, MR);
  const int64_t i0 = fb.i0, nc = fb.nc, Hp = p.Hp;
  const FnBlock fn = fn_block(p, b, n, fb.qb, kb);
  const Block kind = combine(classify(p, g, i0, i0 + fb.rows, j0, j1), fn);
  if (kind == Block::kSkip) return;
  const bool capped = p.soft_cap > 0;
  float* const ot = fb.ot;
#if defined(__AVX512BF16__)
  // bfloat16 on a CPU with AVX512_BF16: the scores from pairs of bfloat16 (vdpbf16ps).
  if constexpr (kPairs && std::is_same_v<In, uint16_t>) {
    gemm<PairStep>(kr, nc, Hp / 2, reinterpret_cast<const uint32_t*>(keys + kb * BK * Hp),
                   Hp / 2, 1, reinterpret_cast<const uint32_t*>(fb.qt), BQ, st, BQ, false);
    const vf scale = splat(p.scale * (capped ? 1.0f : kLog2e));
    for (int64_t r = 0; r < kr; ++r)
      for (int64_t c = 0; c < nc; c += VW) store(st + r * BQ + c, load(st + r * BQ + c) * scale);
  } else
#endif
    gemm(kr, nc, Hp, keys + kb * BK * Hp, Hp, 1, fb.qt, BQ, st, BQ, false);
  if (capped)
    for (int64_t r = 0; r < kr; ++r)
      for (int64_t c = 0; c < nc; ++c) {
        float& x = st[r * BQ + c];
        x = p.soft_cap * kLog2e * std::tanh(x / p.soft_cap);
      }
  const bool mask = kind != Block::kFull || j0 + kr > p.S;
  for (int64_t c = 0; c < nc; c += VW) {
    // Mask, then the columns' new maxima, four rows at a time (four independent chains
    // of maxima). The maxima pass over NaN: a NaN logit still reaches its query's
    // output, through its exponential in the sum and the products (a query whose
    // logits are all NaN keeps the maximum -inf and gets exp2(NaN - 0): NaN, not
    // the zeros of a query that sees nothing; docs/conventions.md).
    const vi lo = *reinterpret_cast<const vi*>(fb.cols.lo + c);
    const vi hi = *reinterpret_cast<const vi*>(fb.cols.hi + c);
    const vi seg = *reinterpret_cast<const vi*>(fb.cols.seg + c);
    vf mx[MR];
    for (int u = 0; u < MR; ++u) mx[u] = splat(-kInf);
    for (int64_t r0 = 0; r0 < kr; r0 += MR)
      for (int u = 0; u < MR; ++u) {
        const int64_t r = r0 + u;
        float* at = st + r * BQ + c;
        vf x = load(at);
        if (mask) {
          const vi j = splat_int(static_cast<int32_t>(j0 + r));
          vi hidden = (j < lo) | (j > hi);
          if (p.q_seg) hidden |= seg != splat_int(j0 + r < p.S ? p.kv_seg[b * p.S + j0 + r] : 0);
          if (fn.cols) hidden |= lane_bits(fn.cols + r * (BQ / 8) + c / 8) == 0;
          x = hidden ? splat(-kInf) : x;
          store(at, x);
        }
        mx[u] = x > mx[u] ? x : mx[u];
      }
    for (int u = 1; u < MR; ++u) mx[0] = mx[u] > mx[0] ? mx[u] : mx[0];
    const vf old_max = load(fb.m + c), new_max = mx[0] > old_max ? mx[0] : old_max;
    const vi blind = new_max == -kInf;  // nothing visible in this column so far
    const vf alpha = blind ? splat(1.0f) : vexp2(old_max - new_max);  // 0 when m was -inf
    const vf shift = blind ? vf{} : new_max;
    vf sum = vf{};
    for (int64_t r = 0; r < kr; ++r) {
      float* at = st + r * BQ + c;
      const vf e = vexp2(load(at) - shift);
      store(at, e);
      sum += e;
    }
    store(fb.l + c, load(fb.l + c) * alpha + sum);
    store(fb.m + c, new_max);
    if (any(alpha != splat(1.0f)))  // the maxima moved: rescale what the columns summed
      for (int64_t h = 0; h < Hp; ++h) store(ot + h * BQ + c, load(ot + h * BQ + c) * alpha);
  }
  gemm(Hp, nc, kr, values + kb * BK * Hp, 1, Hp, st, BQ, ot, BQ, true);
}

// Query blocks run together by one forward task, at most: each key block, read from
// the shared tiles once, serves all of them while it is in L1 (a key block of 64 x 64
// floats comes from L3 once per task, not once per query block).
constexpr int64_t kQueryGroup = 8;

// The forward pass of query blocks [qb0, qb0 + count) of (b, n) (count <= kQueryGroup):
// online softmax over the key blocks any of them may see, each key block taken once
// by every query block that sees it, in key-block order for each (so the arithmetic of
// a query block is the same whatever the group).
template <class In>
void forward_task(const Problem& p, const std::vector<Geometry>& geo, const In* q,
                  const float* keys, const float* values, ForwardOut res, int64_t b,
                  int64_t n, int64_t qb0, int64_t count) {
  const Geometry& g = geo[b];
  const int64_t Hp = p.Hp;
  float* const work = scratch(kTask, count * 2 * Hp * BQ + BK * BQ);
  float* const st = work + count * 2 * Hp * BQ;
  const float to_log2 = p.soft_cap > 0 ? 1.0f : kLog2e;
  ForwardBlock blocks[kQueryGroup];
  int64_t first = p.n_k(), last = -1;
  for (int64_t u = 0; u < count; ++u) {
    ForwardBlock& fb = blocks[u];
    fb.qb = qb0 + u;
    fb.i0 = fb.qb * BQ;
    fb.rows = std::min(fb.i0 + BQ, p.T) - fb.i0;
    fb.nc = round_up(fb.rows, VW);  // query columns computed
    fb.qt = work + u * 2 * Hp * BQ;
    fb.ot = fb.qt + Hp * BQ;
    std::fill(fb.m, fb.m + BQ, -kInf);
    std::fill(fb.l, fb.l + BQ, 0.0f);
    std::fill(fb.ot, fb.ot + Hp * BQ, 0.0f);
    if constexpr (kPairs && std::is_same_v<In, uint16_t>)
      pack_query_pairs(p, reinterpret_cast<const uint16_t*>(q), g, b, n, fb.i0,
                       reinterpret_cast<uint32_t*>(fb.qt));
    else
      pack_queries_t(p, q, g, b, n, fb.i0, p.scale * to_log2, fb.qt);
    fb.cols = columns(p, g, b, n, fb.i0);
    std::tie(fb.first, fb.last) = key_blocks(p, g, fb.i0, fb.i0 + fb.rows);
    if (fb.first <= fb.last) first = std::min(first, fb.first), last = std::max(last, fb.last);
  }
  for (int64_t kb = first; kb <= last; ++kb)
    for (int64_t u = 0; u < count; ++u)
      if (blocks[u].first <= kb && kb <= blocks[u].last)
        forward_step<In>(p, g, b, n, blocks[u], kb, keys, values, st);
  for (int64_t u = 0; u < count; ++u) {
    const ForwardBlock& fb = blocks[u];
    finish(p, res, b, n, fb.i0, fb.rows, fb.m, fb.l, fb.ot, 1, BQ, kLn2);
  }
}

// Key block kb of (b, key/value head kh) packed into its tiles: the keys as (BK, Hp)
// rows for the transposed scores, or transposed (Hp, BK) for a decode step's, and the
// values as (BK, Hp) rows.
template <class In, class Kv>
void pack_tiles(const Problem& p, const Geometry& g, const ForwardIn<In, Kv>& in, bool decode,
                int64_t b, int64_t kh, int64_t kb, float* key_tile, float* value_tile) {
  // The transposed scores of bfloat16 read the keys as pairs where the CPU has
  // AVX512_BF16 (forward_task); a decode step reads them transposed.
  constexpr bool pairs = kPairs && std::is_same_v<In, uint16_t> && std::is_same_v<Kv, uint16_t>;
  if constexpr (pairs) {
    if (!decode) {
      pack_key_pairs(p, in.k, g, b, kh, kb * BK, reinterpret_cast<uint32_t*>(key_tile));
      pack_keys(p, in.v, g, b, kh, kb * BK, value_tile, nullptr);
      return;
    }
  }
  pack_keys(p, in.k, g, b, kh, kb * BK, decode ? nullptr : key_tile, decode ? key_tile : nullptr,
            in.key_scales);
  pack_keys(p, in.v, g, b, kh, kb * BK, value_tile, nullptr, in.value_scales);
}

// The key blocks [first, last] that some query of each batch row may see: the only
// ones packed (a decoding step over a cache of S slots packs what the row holds, not the
// capacity), which are all any task reads.
using HeldBlocks = std::vector<std::pair<int64_t, int64_t>>;

// Whether a call is short (a group's tiles in L2, and groups enough to share among the
// threads): then one task per (b, key/value head) packs its group's tiles and runs every
// query block of the group's heads while they are in cache (forward_by_groups), where
// tiles packed for the whole call would have left the cache before their readers came.
inline bool short_forward(const Problem& p, int threads, bool decode) {
  const int64_t tile = BK * p.Hp;
  return !decode && p.n_k() * tile * 2 * sizeof(float) <= kGroupBytes && p.B * p.K >= 4 * threads;
}

// A short call's pass, one task per (b, key/value head).
template <class In, class Kv>
void forward_by_groups(xla::ffi::ThreadPool& pool, int threads, const Problem& p,
                       const std::vector<Geometry>& geo, const ForwardIn<In, Kv>& in,
                       const HeldBlocks& held, ForwardOut res) {
  const int64_t tile = BK * p.Hp;
  parallel_for(pool, threads, p.B * p.K, [&](int64_t group, int) {
    const int64_t b = group / p.K, kh = group % p.K;
    float* keys = scratch(kGroupKeys, p.n_k() * tile);
    float* values = scratch(kGroupValues, p.n_k() * tile);
    for (int64_t kb = held[b].first; kb <= held[b].second; ++kb)
      pack_tiles(p, geo[b], in, false, b, kh, kb, keys + kb * tile, values + kb * tile);
    for (int64_t n = kh * p.G; n < (kh + 1) * p.G; ++n)
      for (int64_t qb = 0; qb < p.n_q(); ++qb)  // the tiles in cache: one block a task
        forward_task(p, geo, in.q, keys, values, res, b, n, qb, 1);
  });
}

// The cost of forward task t, query blocks [qg * group, (qg + 1) * group) of one (b,
// n): the number of key blocks each may see (those a mask_fn leaves), summed.
inline int64_t query_group_cost(const Problem& p, const std::vector<Geometry>& geo,
                                int64_t group, int64_t n_groups, int64_t t) {
  const int64_t qg = t % n_groups, n = (t / n_groups) % p.N, b = t / (n_groups * p.N);
  auto range = [&](int64_t qb) {
    const int64_t i0 = qb * BQ;
    return key_blocks(p, geo[b], i0, std::min(i0 + BQ, p.T));
  };
  auto seen = [&](int64_t qb, int64_t kb) { return pair_seen(p, geo[b], b, n, qb, kb); };
  return task_cost(p, qg, group, p.n_q(), range, seen);
}

// The other calls: key and value tiles packed once for the whole call, then tasks of
// `group` query blocks of one (b, n) sharing each key block (forward_task): as many
// blocks as leave eight tasks per thread at least (one for a decode step), costliest
// first (causal work balances without a static split).
template <class In, class Kv>
void forward_by_blocks(xla::ffi::ThreadPool& pool, int threads, const Problem& p,
                       const std::vector<Geometry>& geo, const ForwardIn<In, Kv>& in,
                       const HeldBlocks& held, bool decode, ForwardOut res) {
  const int64_t tile = BK * p.Hp;
  const int64_t group = decode ? 1 : blocks_per_task(kQueryGroup, p.B * p.N, p.n_q(), threads);
  const int64_t n_groups = (p.n_q() + group - 1) / group;
  const std::vector<int64_t> order = costliest_first(p.B * p.N * n_groups, [&](int64_t t) {
    return query_group_cost(p, geo, group, n_groups, t);
  });
  Tiles keys(p.B * p.K * p.n_k(), tile, kShared0), values(p.B * p.K * p.n_k(), tile, kShared1);
  parallel_for(pool, threads, p.B * p.K * p.n_k(), [&](int64_t t, int) {
    const int64_t kb = t % p.n_k(), kh = (t / p.n_k()) % p.K, b = t / (p.n_k() * p.K);
    if (kb >= held[b].first && kb <= held[b].second)
      pack_tiles(p, geo[b], in, decode, b, kh, kb, keys.at(t), values.at(t));
  });
  parallel_for(pool, threads, p.B * p.N * n_groups, [&](int64_t t, int) {
    if (decode) {  // group 1: the task is (b, n, query block)
      forward_rows_task(p, geo, in.q, keys, values, res, order[t]);
      return;
    }
    const int64_t qg = order[t] % n_groups, n = (order[t] / n_groups) % p.N;
    const int64_t b = order[t] / (n_groups * p.N), qb = qg * group;
    const int64_t first = key_tile(p, b, n / p.G, 0);
    forward_task(p, geo, in.q, keys.at(first), values.at(first), res, b, n, qb,
                 std::min(group, p.n_q() - qb));
  });
}

// The forward pass of a checked problem: a decode step (fewer than VW queries) scores
// rows of queries (forward_rows_task), the others columns (forward_task).
template <class In, class Kv>
void forward_run(xla::ffi::ThreadPool& pool, const Problem& p, const ForwardIn<In, Kv>& in,
                 ForwardOut res) {
  if (p.B * p.T * p.N == 0) return;
  const int threads = max_threads(pool);
  const std::vector<Geometry> geo = all_geometry(pool, threads, p);
  const bool decode = p.T < VW;
  HeldBlocks held(p.B);
  for (int64_t b = 0; b < p.B; ++b) held[b] = key_blocks(p, geo[b], 0, p.T);
  if (short_forward(p, threads, decode))
    forward_by_groups(pool, threads, p, geo, in, held, res);
  else
    forward_by_blocks(pool, threads, p, geo, in, held, decode, res);
}

}  // namespace
