// The problem and who sees what: the blocks (BQ x BK, NANOATTN_BQ and NANOATTN_BK),
// the Problem of a call, a mask_fn's classified blocks and their bits, each batch
// row's Geometry (the keys each query sees, the queries and keys that see or are seen
// at all, each block's range of segment ids), computed for every row of a call on the
// thread pool (all_geometry), and how a block of queries meets a block of keys.
//
// Included by attention.cc only, in its one translation unit: the code sits in an
// unnamed namespace there as here, so that every function keeps internal linkage.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "simd.h"
#include "threads.h"

namespace {

#ifndef NANOATTN_BQ
#define NANOATTN_BQ 64
#define NANOATTN_BK 64
#endif
constexpr int BQ = NANOATTN_BQ;  // query rows per block
constexpr int BK = NANOATTN_BK;  // keys per block

// A mask_fn's blocks, as the Python side classified them: kind and slot (V, xB, xN, nQ,
// nK), where V is the product of the axes a vmap put in front of B0 (the call's own
// batch, B = V * B0), xB is 1 or B0 and xN is 1 or N (axes the mask does not depend
// on); bits (V, P, kBitsBytes), the P partial blocks' cells, slot[...] naming a partial
// block's (-1 for the others). kind null: no mask_fn.
enum : int8_t { kFnEmpty = 0, kFnPartial = 1, kFnFull = 2 };  // nanoattn._block_mask's
constexpr int64_t kBitsBytes = 2 * BQ * BK / 8;  // rows (BQ, BK / 8), then columns (BK, BQ / 8)
struct MaskFn {
  const int8_t* kind = nullptr;
  const int32_t* slot = nullptr;
  const uint8_t* bits = nullptr;
  int64_t B0 = 1, xB = 1, xN = 1, P = 0;
};

struct Problem {
  int64_t B, T, S, N, K, G, H, Hp;
  float scale, soft_cap;  // soft_cap 0: none
  int64_t left, right;    // -1: unbounded
  const int32_t* q_offset;  // (B,)
  const int32_t* kv_lengths;  // (B,)
  const int32_t* q_seg;  // (B, T) or null
  const int32_t* kv_seg;  // (B, S) or null
  MaskFn fn;
  int64_t n_q() const { return (T + BQ - 1) / BQ; }
  int64_t n_k() const { return (S + BK - 1) / BK; }
};

// One block of the mask_fn: its kind and, for a partial block, its bits: `rows` (BQ,
// BK / 8), bit c of row r (little-endian bytes) for query i0 + r and key j0 + c, and
// `cols` (BK, BQ / 8), the same cells with keys as rows. Without a mask_fn every block
// is full.
struct FnBlock {
  int8_t kind;
  const uint8_t* rows;
  const uint8_t* cols;
};

inline FnBlock fn_block(const Problem& p, int64_t b, int64_t n, int64_t qb, int64_t kb) {
  const MaskFn& f = p.fn;
  if (!f.kind) return {kFnFull, nullptr, nullptr};
  const int64_t v = b / f.B0, bb = f.xB > 1 ? b % f.B0 : 0, nn = f.xN > 1 ? n : 0;
  const int64_t at = (((v * f.xB + bb) * f.xN + nn) * p.n_q() + qb) * p.n_k() + kb;
  const int8_t kind = f.kind[at];
  if (kind != kFnPartial) return {kind, nullptr, nullptr};
  const uint8_t* bits = f.bits + (v * f.P + f.slot[at]) * kBitsBytes;
  return {kind, bits, bits + BQ * BK / 8};
}

// VW bits from `at` (little-endian bytes) as lanes of 0 or 1: lane l holds bit l.
inline vi lane_bits(const uint8_t* at) {
  uint32_t word = 0;
  std::memcpy(&word, at, VW / 8);
  vi lane;
  for (int l = 0; l < VW; ++l) lane[l] = l;
  return (splat_int(static_cast<int32_t>(word)) >> lane) & 1;
}

// Per batch row: query i sees keys in [lo[i], hi[i]] (empty when lo > hi), those
// of its segment only with segment ids; q_sees[i] and k_seen[j] say whether a
// query sees any key and whether any query sees a key. lo and hi never decrease
// with i, so the queries that may see key j are a contiguous range.
// With a mask_fn, fn_q_sees (N, T) and fn_k_seen (K, S) say the same by every rule
// together, per query head and per key/value head (some query of its group): q_sees and
// k_seen are what the positional rules and segments let through, a superset.
// With segment ids, q_ids (n_q) and k_ids (n_k) hold each query block's and key block's
// smallest and largest id: blocks whose ranges do not meet are skipped whole.
struct IdRange {
  int32_t min, max;
};
struct Geometry {
  std::vector<int64_t> lo, hi;
  std::vector<uint8_t> q_sees, k_seen;
  std::vector<uint8_t> fn_q_sees, fn_k_seen;
  std::vector<IdRange> q_ids, k_ids;
};

// Which queries of head n see a key, and which keys of head kh a query sees, by every rule.
inline const uint8_t* sees(const Problem& p, const Geometry& g, int64_t n) {
  return p.fn.kind ? g.fn_q_sees.data() + n * p.T : g.q_sees.data();
}
inline const uint8_t* seen(const Problem& p, const Geometry& g, int64_t kh) {
  return p.fn.kind ? g.fn_k_seen.data() + kh * p.S : g.k_seen.data();
}

// Whether some index in [first, last] of the sorted (id, index) pairs has this id.
bool has_id_in(const std::vector<std::pair<int32_t, int64_t>>& sorted, int32_t id, int64_t first,
               int64_t last) {
  if (first > last) return false;
  auto it = std::lower_bound(sorted.begin(), sorted.end(), std::make_pair(id, first));
  return it != sorted.end() && it->first == id && it->second <= last;
}

// The smallest and largest of ids[0, count) in each block of `block`.
std::vector<IdRange> id_ranges(const int32_t* ids, int64_t count, int64_t block) {
  std::vector<IdRange> ranges((count + block - 1) / block);
  for (size_t k = 0; k < ranges.size(); ++k) {
    const int64_t first = k * block, end = std::min<int64_t>(first + block, count);
    const auto [lo, hi] = std::minmax_element(ids + first, ids + end);
    ranges[k] = {*lo, *hi};
  }
  return ranges;
}

Geometry geometry(const Problem& p, int64_t b) {
  Geometry g;
  const int64_t T = p.T, S = p.S;
  const int64_t len = std::clamp<int64_t>(p.kv_lengths[b], 0, S);
  g.lo.resize(T);
  g.hi.resize(T);
  for (int64_t i = 0; i < T; ++i) {
    const int64_t pos = static_cast<int64_t>(p.q_offset[b]) + i;
    g.lo[i] = p.left < 0 ? 0 : std::max<int64_t>(0, pos - p.left);
    g.hi[i] = std::min(p.right < 0 ? S - 1 : pos + p.right, len - 1);
  }
  g.q_sees.assign(T, 0);
  g.k_seen.assign(S, 0);
  if (!p.q_seg) {
    std::vector<int64_t> cover(S + 1, 0);  // a difference array of the intervals
    for (int64_t i = 0; i < T; ++i) {
      if (g.lo[i] > g.hi[i]) continue;
      g.q_sees[i] = 1;
      cover[g.lo[i]] += 1;
      cover[g.hi[i] + 1] -= 1;
    }
    for (int64_t j = 0, c = 0; j < S; ++j) g.k_seen[j] = (c += cover[j]) > 0;
    return g;
  }
  const int32_t* qs = p.q_seg + b * T;
  const int32_t* ks = p.kv_seg + b * S;
  g.q_ids = id_ranges(qs, T, BQ);
  g.k_ids = id_ranges(ks, S, BK);
  std::vector<std::pair<int32_t, int64_t>> queries(T), keys(S);
  for (int64_t i = 0; i < T; ++i) queries[i] = {qs[i], i};
  for (int64_t j = 0; j < S; ++j) keys[j] = {ks[j], j};
  std::sort(queries.begin(), queries.end());
  std::sort(keys.begin(), keys.end());
  for (int64_t i = 0; i < T; ++i) g.q_sees[i] = has_id_in(keys, qs[i], g.lo[i], g.hi[i]);
  for (int64_t j = 0; j < S; ++j) {
    // Queries with hi >= j start at `first`; those with lo <= j end before `end`.
    int64_t first = std::lower_bound(g.hi.begin(), g.hi.end(), j) - g.hi.begin();
    int64_t end = std::upper_bound(g.lo.begin(), g.lo.end(), j) - g.lo.begin();
    g.k_seen[j] = has_id_in(queries, ks[j], first, end - 1);
  }
  return g;
}

enum class Block { kSkip, kFull, kPartial };

// How the rows of a query block [i0, i1) meet the keys of a key block [j0, j1) (i0 and
// j0 multiples of BQ and BK): none may see any (skip: outside the band, or, with
// segment ids, no id shared by the two blocks' id ranges), all see all (inside the band,
// and one and the same id in both blocks), or cell by cell.
Block classify(const Problem& p, const Geometry& g, int64_t i0, int64_t i1, int64_t j0,
               int64_t j1) {
  if (g.hi[i1 - 1] < j0 || g.lo[i0] > j1 - 1) return Block::kSkip;
  bool one_id = true;
  if (p.q_seg) {
    const IdRange q = g.q_ids[i0 / BQ], k = g.k_ids[j0 / BK];
    if (q.max < k.min || k.max < q.min) return Block::kSkip;
    one_id = q.min == q.max && k.min == k.max;  // and then the same id
  }
  if (one_id && g.lo[i1 - 1] <= j0 && g.hi[i0] >= j1 - 1) return Block::kFull;
  return Block::kPartial;
}

inline bool visible(const Problem& p, const Geometry& g, int64_t b, int64_t i, int64_t j) {
  if (j < g.lo[i] || j > g.hi[i]) return false;
  return !p.q_seg || p.q_seg[b * p.T + i] == p.kv_seg[b * p.S + j];
}

// The key blocks rows [i0, i1) may see: [first, last] (empty when first > last).
std::pair<int64_t, int64_t> key_blocks(const Problem& p, const Geometry& g, int64_t i0, int64_t i1) {
  int64_t lo = g.lo[i0], hi = g.hi[i1 - 1];
  if (hi < 0 || lo > hi) return {0, -1};
  return {lo / BK, std::min(hi / BK, p.n_k() - 1)};
}

// The query blocks that may see keys [j0, j1).
std::pair<int64_t, int64_t> query_blocks(const Problem& p, const Geometry& g, int64_t j0, int64_t j1) {
  int64_t first = std::lower_bound(g.hi.begin(), g.hi.end(), j0) - g.hi.begin();
  int64_t end = std::upper_bound(g.lo.begin(), g.lo.end(), j1 - 1) - g.lo.begin();
  if (first >= end) return {0, -1};
  return {first / BQ, (end - 1) / BQ};
}

// A block by every rule: skipped when the other rules or the mask_fn hide all of it,
// masked cell by cell when either shows only part of it.
inline Block combine(Block kind, const FnBlock& fn) {
  if (kind == Block::kSkip || fn.kind == kFnEmpty) return Block::kSkip;
  return fn.kind == kFnPartial ? Block::kPartial : kind;
}

// Whether head n of batch row b sees any cell of block pair (qb, kb), by every rule.
inline bool pair_seen(const Problem& p, const Geometry& g, int64_t b, int64_t n, int64_t qb,
                      int64_t kb) {
  const int64_t i0 = qb * BQ, i1 = std::min(i0 + BQ, p.T);
  const int64_t j0 = kb * BK, j1 = std::min(j0 + BK, p.S);
  return combine(classify(p, g, i0, i1, j0, j1), fn_block(p, b, n, qb, kb)) != Block::kSkip;
}

// The cost of a task of blocks [g * group, (g + 1) * group) along one axis (of
// `n_blocks`): for each block x, the blocks of the other axis `range(x)` = [first, last]
// that it may see, each counted by `seen(x, y)` (how many heads see the pair) where a
// mask_fn or segment ids may skip some, all of them otherwise.
template <class Range, class Seen>
inline int64_t task_cost(const Problem& p, int64_t g, int64_t group, int64_t n_blocks,
                         Range range, Seen seen) {
  int64_t cost = 0;
  for (int64_t x = g * group; x < std::min((g + 1) * group, n_blocks); ++x) {
    auto [first, last] = range(x);
    if (!p.fn.kind && !p.q_seg) {
      cost += last - first + 1;
      continue;
    }
    for (int64_t y = first; y <= last; ++y) cost += seen(x, y);
  }
  return cost;
}

// Bit c of row r of a partial block's rows layout.
inline bool bit(const uint8_t* rows, int64_t r, int64_t c) {
  return rows[r * (BK / 8) + c / 8] >> (c % 8) & 1;
}

// fn_q_sees of heads [n0, n1) and fn_k_seen of key/value head kh (those heads' keys) in
// batch row b, from every block the heads may see: a full one shows all its cells, a
// partial one is looked at cell by cell, skipping queries and keys already known to see
// or be seen.
void fn_sight(const Problem& p, Geometry& g, int64_t b, int64_t n0, int64_t n1, int64_t kh) {
  uint8_t* k_seen = g.fn_k_seen.data() + kh * p.S;
  for (int64_t n = n0; n < n1; ++n) {
    uint8_t* q_sees = g.fn_q_sees.data() + n * p.T;
    for (int64_t qb = 0; qb < p.n_q(); ++qb) {
      const int64_t i0 = qb * BQ, i1 = std::min(i0 + BQ, p.T);
      auto [first, last] = key_blocks(p, g, i0, i1);
      for (int64_t kb = first; kb <= last; ++kb) {
        const int64_t j0 = kb * BK, j1 = std::min(j0 + BK, p.S);
        const FnBlock fn = fn_block(p, b, n, qb, kb);
        const Block kind = combine(classify(p, g, i0, i1, j0, j1), fn);
        if (kind == Block::kSkip) continue;
        if (kind == Block::kFull) {
          std::fill(q_sees + i0, q_sees + i1, 1);
          std::fill(k_seen + j0, k_seen + j1, 1);
          continue;
        }
        auto shows = [&](int64_t i, int64_t j) {
          return visible(p, g, b, i, j) && (!fn.rows || bit(fn.rows, i - i0, j - j0));
        };
        for (int64_t i = i0; i < i1; ++i)
          for (int64_t j = j0; j < j1 && g.q_sees[i] && !q_sees[i]; ++j) q_sees[i] = shows(i, j);
        for (int64_t j = j0; j < j1; ++j)
          for (int64_t i = i0; i < i1 && g.k_seen[j] && !k_seen[j]; ++i) k_seen[j] = shows(i, j);
      }
    }
  }
}

// Every batch row's Geometry, on the pool: the positional rules and segments, then,
// with a mask_fn, who sees what by its blocks too.
std::vector<Geometry> all_geometry(xla::ffi::ThreadPool& pool, int threads, const Problem& p) {
  std::vector<Geometry> geo(p.B);
  parallel_for(pool, threads, p.B, [&](int64_t b, int) {
    geo[b] = geometry(p, b);
    if (p.fn.kind) {
      geo[b].fn_q_sees.assign(p.N * p.T, 0);
      geo[b].fn_k_seen.assign(p.K * p.S, 0);
    }
  });
  if (!p.fn.kind) return geo;
  // A mask the same for every head: its sight once per batch row, copied to every head.
  const bool per_head = p.fn.xN > 1;
  parallel_for(pool, threads, per_head ? p.B * p.K : p.B, [&](int64_t t, int) {
    if (per_head) {
      const int64_t b = t / p.K, kh = t % p.K;
      fn_sight(p, geo[b], b, kh * p.G, (kh + 1) * p.G, kh);
      return;
    }
    Geometry& g = geo[t];
    fn_sight(p, g, t, 0, 1, 0);
    for (int64_t n = 1; n < p.N; ++n)
      std::copy(g.fn_q_sees.begin(), g.fn_q_sees.begin() + p.T, g.fn_q_sees.begin() + n * p.T);
    for (int64_t kh = 1; kh < p.K; ++kh)
      std::copy(g.fn_k_seen.begin(), g.fn_k_seen.begin() + p.S, g.fn_k_seen.begin() + kh * p.S);
  });
  return geo;
}

}  // namespace
