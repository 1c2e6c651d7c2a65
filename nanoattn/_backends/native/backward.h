// The backward pass: one task per (b, key/value head, up to four key blocks)
// accumulates dK and dV for every query head of its group, each query block read once
// for all its key blocks; dQ goes to one buffer per lane, summed at the end in lane
// order. The tasks are dealt into lanes (one per thread) by their cost before the pass,
// and a lane runs its tasks in a fixed order, so the backward pass is bitwise the same
// from run to run for a given thread count (docs/conventions.md, "Reproducibility"). A
// short call (a group's tiles in kGroupBytes, four groups per thread at least) runs one
// task per (b, key/value head) instead: it packs its group's queries and output
// cotangents and runs all their blocks while they are in cache, and sums its group's
// dQ alone, in key-block order. P and dS are recomputed from the forward's log-sum-exp;
// the gradients are rounded to the inputs' type once, at the end.
//
// Included by attention.cc only, in its one translation unit: the code sits in an
// unnamed namespace there as here, so that every function keeps internal linkage.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <tuple>
#include <vector>

#include "xla/ffi/api/ffi.h"

#include "gemm.h"
#include "logits.h"
#include "pack.h"
#include "simd.h"
#include "threads.h"
#include "visibility.h"

namespace {

template <class In>
struct BackwardIn {
  const In *q, *dout;             // (B, T, N, H)
  const In *k, *v;                // (B, S, K, H)
  const float *out, *lse, *dlse;  // out (B, T, N, H); lse and its cotangent (B, T, N)
};

template <class In>
struct BackwardOut {
  In* dq;              // (B, T, N, H)
  In *dk, *dv;         // (B, S, K, H)
  const float* delta;  // (B, T, N): rowsum(dout * out) - dlse
};

// What a backward task of batch row b reads of the queries and where it adds dQ, for
// query heads [n0, n0 + heads): the packed queries (times scale) and output cotangents,
// (heads, n_q) tiles of (BQ, Hp) each, and dQ as (Tp, heads, Hp) float32 rows.
struct QueryView {
  float *q, *dout, *dq;
  int64_t n0, heads;
  float* q_tile(const Problem& p, int64_t n, int64_t qb) const {
    return q + ((n - n0) * p.n_q() + qb) * BQ * p.Hp;
  }
  float* dout_tile(const Problem& p, int64_t n, int64_t qb) const {
    return dout + ((n - n0) * p.n_q() + qb) * BQ * p.Hp;
  }
  float* dq_row(const Problem& p, int64_t n, int64_t i) const {
    return dq + (i * heads + n - n0) * p.Hp;
  }
};

// One key block of a backward task: its keys (BK, Hp) and keys and values transposed
// (Hp, BK), its dK and dV accumulated as (BK, Hp), and the query blocks [first, last]
// that may see it.
struct BackwardBlock {
  int64_t kb, j0, j1, kc, first, last;
  float *ks, *kt, *vt, *dk, *dv;
};

// Query block qb of head n against key block `kb_`: P and dS recomputed from the
// saved log-sum-exp, dV += P^T dO, dK += dS^T Q, and dQ += dS K into the view's
// rows. `ps`, `ds` and `th` are (BQ, BK) scratch: P, dS and tanh under a cap.
template <class In>
void backward_step(const Problem& p, const Geometry& g, const BackwardIn<In>& in,
                   const QueryView& view, const BackwardOut<In>& res, int64_t b, int64_t n,
                   int64_t qb, const BackwardBlock& kb_, float* ps, float* ds, float* th) {
  const int64_t i0 = qb * BQ, i1 = std::min(i0 + BQ, p.T), rows = i1 - i0;
  const int64_t mr = round_up(rows, MR), kc = kb_.kc, j0 = kb_.j0, Hp = p.Hp;
  const FnBlock fn = fn_block(p, b, n, qb, kb_.kb);
  const Block kind = combine(classify(p, g, i0, i1, j0, kb_.j1), fn);
  if (kind == Block::kSkip) return;
  const bool capped = p.soft_cap > 0;
  const uint8_t* q_sees = sees(p, g, n);
  const float* qs = view.q_tile(p, n, qb);
  const float* dos = view.dout_tile(p, n, qb);
  gemm(mr, kc, Hp, qs, Hp, 1, kb_.kt, BK, ps, BK, false);
  for (int64_t r = 0; r < mr; ++r) {
    float* row = ps + r * BK;
    const int64_t i = i0 + r;
    if (r >= rows || !q_sees[i]) {
      std::fill(row, row + kc, 0.0f);
      if (capped) std::fill(th + r * BK, th + r * BK + kc, 0.0f);
      continue;
    }
    const uint8_t* bits = fn.rows ? fn.rows + r * (BK / 8) : nullptr;
    cap_and_mask(p, g, b, i, j0, kc, kind, bits, row, capped ? th + r * BK : nullptr);
    // P = exp(s - lse) = exp2(s log2 e - lse log2 e): one FMA and the short exp2
    const vf shift = splat(in.lse[(b * p.T + i) * p.N + n] * kLog2e), unit = splat(kLog2e);
    for (int c = 0; c < kc; c += VW) store(row + c, vexp2(load(row + c) * unit - shift));
  }
  // dV += P^T dO
  gemm(kc, Hp, mr, ps, 1, BK, dos, Hp, kb_.dv, Hp, true);
  // dP = dO V^T, then dS = P (dP - delta), through the cap's tanh
  gemm(mr, kc, Hp, dos, Hp, 1, kb_.vt, BK, ds, BK, false);
  for (int64_t r = 0; r < mr; ++r) {
    float* drow = ds + r * BK;
    const float* prow = ps + r * BK;
    const float delta = r < rows ? res.delta[(b * p.T + i0 + r) * p.N + n] : 0.0f;
    const vf d = splat(delta);
    for (int c = 0; c < kc; c += VW) {
      vf x = load(prow + c) * (load(drow + c) - d);
      if (capped) {
        vf t = load(th + r * BK + c);
        x = x * (1.0f - t * t);
      }
      store(drow + c, x);
    }
  }
  // dK += dS^T (scale q); dQ += dS K (times scale at the end)
  gemm(kc, Hp, mr, ds, 1, BK, qs, Hp, kb_.dk, Hp, true);
  gemm(mr, Hp, kc, ds, BK, 1, kb_.ks, Hp, view.dq_row(p, n, i0), view.heads * Hp, true);
}

// Key blocks run together by one backward task, at most: each query block (its
// queries and output cotangents), read once, serves all of them, and its dQ rows take
// their parts while in cache.
constexpr int64_t kKeyGroup = 4;

// The backward pass of key blocks [kb0, kb0 + count) of (b, key/value head kh) (count
// <= kKeyGroup), for every query head of the group: for each head, each query block
// any of them may see, then each key block that it may see, in this fixed order (dQ's
// parts add up in it).
template <class In>
void backward_task(const Problem& p, const std::vector<Geometry>& geo, const BackwardIn<In>& in,
                   const QueryView& view, const BackwardOut<In>& res, int64_t b, int64_t kh,
                   int64_t kb0, int64_t count) {
  const Geometry& g = geo[b];
  const int64_t Hp = p.Hp;
  float* const work = scratch(kTask, count * 5 * BK * Hp + 3 * BQ * BK);
  float* const ps = work + count * 5 * BK * Hp;  // (BQ, BK) three times: P, dS, tanh
  float* const ds = ps + BQ * BK;
  float* const th = ds + BQ * BK;
  BackwardBlock blocks[kKeyGroup];
  int64_t first = p.n_q(), last = -1;
  for (int64_t u = 0; u < count; ++u) {
    BackwardBlock& kb_ = blocks[u];
    kb_.kb = kb0 + u;
    kb_.j0 = kb_.kb * BK;
    kb_.j1 = std::min(kb_.j0 + BK, p.S);
    kb_.kc = round_up(kb_.j1 - kb_.j0, VW);
    kb_.ks = work + u * 5 * BK * Hp;  // (BK, Hp) keys, then (Hp, BK) keys and values
    kb_.kt = kb_.ks + BK * Hp;
    kb_.vt = kb_.kt + Hp * BK;
    kb_.dk = kb_.vt + Hp * BK;  // (BK, Hp) twice
    kb_.dv = kb_.dk + BK * Hp;
    std::fill(kb_.dk, kb_.dk + 2 * BK * Hp, 0.0f);
    std::tie(kb_.first, kb_.last) = query_blocks(p, g, kb_.j0, kb_.j1);
    if (kb_.first > kb_.last) continue;
    pack_keys(p, in.k, g, b, kh, kb_.j0, kb_.ks, kb_.kt);
    pack_keys(p, in.v, g, b, kh, kb_.j0, nullptr, kb_.vt);
    first = std::min(first, kb_.first), last = std::max(last, kb_.last);
  }
  for (int64_t n = kh * p.G; n < (kh + 1) * p.G; ++n)
    for (int64_t qb = first; qb <= last; ++qb)
      for (int64_t u = 0; u < count; ++u)
        if (blocks[u].first <= qb && qb <= blocks[u].last)
          backward_step(p, g, in, view, res, b, n, qb, blocks[u], ps, ds, th);
  for (int64_t u = 0; u < count; ++u) {
    const BackwardBlock& kb_ = blocks[u];
    for (int64_t c = 0; c < BK && kb_.j0 + c < p.S; ++c) {
      const int64_t off = ((b * p.S + kb_.j0 + c) * p.K + kh) * p.H;
      for (int64_t h = 0; h < p.H; ++h) {
        res.dk[off + h] = narrow<In>(kb_.dk[c * Hp + h]);
        res.dv[off + h] = narrow<In>(kb_.dv[c * Hp + h]);
      }
    }
  }
}

// delta = rowsum(dout * out) - dlse, per (b, i, n): d lse / d logits is the softmax,
// so the log-sum-exp's cotangent shifts the row term of dS = P (dP - delta).
template <class In>
std::vector<float> row_terms(xla::ffi::ThreadPool& pool, int threads, const Problem& p,
                             const BackwardIn<In>& in) {
  std::vector<float> delta(p.B * p.T * p.N);
  const float* o = in.out;
  const In* dO = in.dout;
  const float* d_lse = in.dlse;
  parallel_for(pool, threads, p.B * p.T, [&](int64_t bt, int) {
    for (int64_t n = 0; n < p.N; ++n) {
      const int64_t at = (bt * p.N + n) * p.H;
      alignas(64) float d[VW];  // VW widths at a time in the lanes, then the tail
      int64_t h = 0;
      vf acc = vf{};
      for (; h + VW <= p.H; h += VW) {
        for (int l = 0; l < VW; ++l) d[l] = widen(dO[at + h + l]);
        acc += load(o + at + h) * load(d);
      }
      float sum = hsum(acc);
      for (; h < p.H; ++h) sum += o[at + h] * widen(dO[at + h]);
      delta[bt * p.N + n] = sum - d_lse[bt * p.N + n];
    }
  });
  return delta;
}

// Query i's dq = scale * the sum of `parts` at `offset` (dQ rows (Tp, heads, Hp) of
// heads [n0, n0 + heads) in batch row b), in their order, VW widths at a time.
template <class In>
void write_dq(const Problem& p, In* dq, int64_t b, int64_t n0, int64_t heads,
              const std::vector<const float*>& parts, int64_t offset, int64_t i) {
  for (int64_t n = n0; n < n0 + heads; ++n) {
    In* dst = dq + ((b * p.T + i) * p.N + n) * p.H;
    const int64_t at = offset + (i * heads + n - n0) * p.Hp;
    for (int64_t h = 0; h < p.H; h += VW) {
      vf acc = vf{};
      for (const float* part : parts) acc += load(part + at + h);
      alignas(64) float sum[VW];
      store(sum, acc * p.scale);
      for (int64_t l = 0; l < VW && h + l < p.H; ++l) dst[h + l] = narrow<In>(sum[l]);
    }
  }
}

// The floats a short call's group holds: its G heads' packed queries and output
// cotangents, and their dQ rows (Tp, G, Hp).
inline int64_t group_floats(const Problem& p) {
  const int64_t tile = BQ * p.Hp, Tp = p.n_q() * BQ;
  return 2 * p.G * p.n_q() * tile + Tp * p.G * p.Hp;
}

// Whether a call is short (a group's query tiles and dQ in L2, groups enough to share
// among the threads): then one task per (b, key/value head) packs its group's queries,
// runs every key block in order and writes the group's dQ, which no other task touches
// (backward_by_groups).
inline bool short_backward(const Problem& p, int threads) {
  return group_floats(p) * sizeof(float) <= kGroupBytes && p.B * p.K >= 4 * threads;
}

// A short call's pass, one task per (b, key/value head).
template <class In>
void backward_by_groups(xla::ffi::ThreadPool& pool, int threads, const Problem& p,
                        const std::vector<Geometry>& geo, const BackwardIn<In>& in,
                        const BackwardOut<In>& res) {
  const int64_t tile = BQ * p.Hp, Tp = p.n_q() * BQ, floats = group_floats(p);
  parallel_for(pool, threads, p.B * p.K, [&](int64_t group, int) {
    const int64_t b = group / p.K, kh = group % p.K, n0 = kh * p.G;
    float* const held = scratch(kGroupKeys, floats);
    const QueryView view{held, held + p.G * p.n_q() * tile, held + 2 * p.G * p.n_q() * tile,
                         n0, p.G};
    for (int64_t n = n0; n < n0 + p.G; ++n)
      for (int64_t qb = 0; qb < p.n_q(); ++qb) {
        pack_rows(p, in.q, geo[b], b, n, qb * BQ, p.scale, view.q_tile(p, n, qb));
        pack_rows(p, in.dout, geo[b], b, n, qb * BQ, 1.0f, view.dout_tile(p, n, qb));
      }
    std::fill(view.dq, view.dq + Tp * p.G * p.Hp, 0.0f);
    for (int64_t kb = 0; kb < p.n_k(); ++kb)  // the tiles in cache: one block a task
      backward_task(p, geo, in, view, res, b, kh, kb, 1);
    const std::vector<const float*> parts{view.dq};
    for (int64_t i = 0; i < p.T; ++i) write_dq(p, res.dq, b, n0, p.G, parts, 0, i);
  });
}

// The cost of backward task t, key blocks [kg * group, (kg + 1) * group) of one (b,
// key/value head): the query blocks each may see, for every query head of the group.
inline int64_t key_group_cost(const Problem& p, const std::vector<Geometry>& geo, int64_t group,
                              int64_t n_groups, int64_t t) {
  const int64_t kg = t % n_groups, kh = (t / n_groups) % p.K, b = t / (n_groups * p.K);
  auto range = [&](int64_t kb) {
    const int64_t j0 = kb * BK;
    return query_blocks(p, geo[b], j0, std::min(j0 + BK, p.S));
  };
  auto seen = [&](int64_t kb, int64_t qb) {
    int64_t heads = 0;
    for (int64_t n = kh * p.G; n < (kh + 1) * p.G; ++n)
      heads += pair_seen(p, geo[b], b, n, qb, kb);
    return heads;
  };
  return task_cost(p, kg, group, p.n_k(), range, seen);
}

// The other calls: queries (times scale) and output cotangents packed once for the
// whole call as (BQ, Hp) blocks, then tasks of `group` key blocks of one (b, key/value
// head) sharing each query block (backward_task): as many blocks as leave eight tasks
// per thread at least. Each lane runs the tasks of one thread, dealt by their cost (the
// blocks they may see) in a fixed order, into its own dQ buffer (the memory of one
// buffer per thread); dQ is the lanes' buffers summed in lane order.
template <class In>
void backward_by_lanes(xla::ffi::ThreadPool& pool, int threads, const Problem& p,
                       const std::vector<Geometry>& geo, const BackwardIn<In>& in,
                       const BackwardOut<In>& res) {
  const int64_t tile = BQ * p.Hp, Tp = p.n_q() * BQ;
  const int64_t group = blocks_per_task(kKeyGroup, p.B * p.K, p.n_k(), threads);
  const int64_t n_groups = (p.n_k() + group - 1) / group, total = p.B * p.K * n_groups;
  const std::vector<std::vector<int64_t>> lanes = fixed_lanes(total, threads, [&](int64_t t) {
    return key_group_cost(p, geo, group, n_groups, t);
  });
  std::vector<std::unique_ptr<Aligned>> parts(lanes.size());  // per lane: (B, Tp, N, Hp)
  Tiles queries(p.B * p.N * p.n_q(), tile, kShared0), d_out(p.B * p.N * p.n_q(), tile, kShared1);
  parallel_for(pool, threads, p.B * p.N * p.n_q(), [&](int64_t t, int) {
    const int64_t qb = t % p.n_q(), n = (t / p.n_q()) % p.N, b = t / (p.n_q() * p.N);
    pack_rows(p, in.q, geo[b], b, n, qb * BQ, p.scale, queries.at(t));
    pack_rows(p, in.dout, geo[b], b, n, qb * BQ, 1.0f, d_out.at(t));
  });
  parallel_for(pool, threads, lanes.size(), [&](int64_t lane, int) {
    if (lanes[lane].empty()) return;
    const size_t size = p.B * Tp * p.N * p.Hp;
    parts[lane] = std::make_unique<Aligned>(size);
    std::fill(parts[lane]->data, parts[lane]->data + size, 0.0f);
    for (int64_t t : lanes[lane]) {
      const int64_t kg = t % n_groups, kh = (t / n_groups) % p.K, b = t / (n_groups * p.K);
      const QueryView view{queries.at(query_tile(p, b, 0, 0)), d_out.at(query_tile(p, b, 0, 0)),
                           parts[lane]->data + b * Tp * p.N * p.Hp, 0, p.N};
      backward_task(p, geo, in, view, res, b, kh, kg * group,
                    std::min(group, p.n_k() - kg * group));
    }
  });
  // dq: the lanes' parts summed in lane order
  std::vector<const float*> held;
  for (const auto& part : parts)
    if (part) held.push_back(part->data);
  parallel_for(pool, threads, p.B * p.T, [&](int64_t bt, int) {
    write_dq(p, res.dq, bt / p.T, 0, p.N, held, bt / p.T * Tp * p.N * p.Hp, bt % p.T);
  });
}

// The backward pass of a checked problem: dq, dk and dv of type In (all zeros where
// there is no query or no key).
template <class In>
void backward_run(xla::ffi::ThreadPool& pool, const Problem& p, const BackwardIn<In>& in,
                  BackwardOut<In> res) {
  const In zero = narrow<In>(0.0f);
  if (p.B * p.S * p.K == 0 || p.B * p.T * p.N == 0) {
    std::fill(res.dq, res.dq + p.B * p.T * p.N * p.H, zero);
    std::fill(res.dk, res.dk + p.B * p.S * p.K * p.H, zero);
    std::fill(res.dv, res.dv + p.B * p.S * p.K * p.H, zero);
    return;
  }
  const int threads = max_threads(pool);
  const std::vector<Geometry> geo = all_geometry(pool, threads, p);
  const std::vector<float> delta = row_terms(pool, threads, p, in);
  res.delta = delta.data();
  if (short_backward(p, threads))
    backward_by_groups(pool, threads, p, geo, in, res);
  else
    backward_by_lanes(pool, threads, p, geo, in, res);
}

}  // namespace
