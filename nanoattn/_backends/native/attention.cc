// nanoattn's native CPU attention kernel, called from JAX through XLA's FFI.
//
// Forward: online softmax over key blocks (FlashAttention-2), one task per
// (batch row b, query head n, up to eight query blocks), each key block read once for
// all the task's query blocks (from L3 once, not once per block). Backward: one task
// per (b, key/value head, up to four key blocks) accumulates dK and dV for every query
// head of its group, each query block read once for all its key blocks; dQ goes to
// one buffer per lane, summed at the end in lane order. The tasks are dealt
// into lanes (one per thread) by their cost before the pass, and a lane runs its tasks
// in a fixed order, so the backward pass is bitwise the same from run to run for a given
// thread count (docs/conventions.md, "Reproducibility"). A short call (a group's tiles
// in kGroupBytes, four groups per thread at least) runs one task per (b, key/value
// head) in both passes instead: it packs its group's tiles and runs all their blocks
// while they are in cache; the backward's sums its group's dQ alone, in key-block
// order. The forward's logits are in units of log2 e (exp2, the factor folded into the
// queries' scale or the soft cap). Nothing of size T x S exists.
//
// Axis legend (docs/conventions.md): B batch, T queries, S keys, N query heads,
// K key/value heads, G = N / K query heads per key/value head (contiguous
// groups), H head width. Inputs are float32 or bfloat16 (one pair of handlers each),
// row-major: q (B, T, N, H), k and v (B, S, K, H); leading axes before the last three
// are flattened into B (that is how a vmapped call arrives). bfloat16 is widened to
// float32 when packed, and the statistics, products and accumulators are float32
// for both. The output stays float32 (the caller rounds it, and the backward pass
// needs it unrounded); the gradients are rounded to the inputs' type once, at the end.
//
// Visibility, the contract of the other backends: query i (position
// p = q_offset[b] + i) sees key j when p - left <= j <= p + right (a side of -1 is
// unbounded; causality is right = 0), j < kv_lengths[b], and, with segment ids,
// q_segment_ids[b, i] == kv_segment_ids[b, j], and, with a mask_fn, where its bits say
// so. A mask_fn arrives classified (docs/conventions.md, "Masks and scores as
// functions"): one kind per (b, n, query block, key block), empty, full or partial, and
// for each partial block its BQ x BK bits, packed twice (rows of queries over keys, and
// rows of keys over queries, for the two layouts of the scores). An empty block is
// skipped; a full one is masked by the other rules only; a partial one by the bits too.
// A query that sees no key gives zeros and zero gradients; a key that no query of its
// row (and, with a mask_fn, of its key/value head's group) sees is never read, so NaN
// or inf there cannot reach any result.
//
// The generic pieces are in headers beside this file: simd.h (vectors, bfloat16),
// gemm.h (the block products' micro-kernels), threads.h (work sharing on XLA's
// thread pool) and visibility.h (the problem, the blocks, who sees what); paged.h
// holds the forward pass of nanoattn.paged_attention (keys read through a page table),
// quantized.h the int8 and float8 keys and values that both forward passes read with
// their scales (one more forward handler each: float32 queries, quantized keys).
// This file keeps the packing, the two passes and the FFI bindings.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

#include "gemm.h"
#include "paged.h"
#include "quantized.h"
#include "simd.h"
#include "threads.h"
#include "visibility.h"

namespace ffi = xla::ffi;

namespace {

static_assert(BQ % MR == 0 && BQ % VW == 0 && BK % VW == 0 && VW % MR == 0,
              "blocks must tile the products");

// n rounded up to a multiple of m: the rows and columns a block's products cover
// (a decode step's single query row is not padded to a whole block).
inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// ---------------------------------------------------------------------------
// Packing blocks into padded, contiguous scratch.

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

// The positional rules, lengths and segments on the first `width` logits of one row.
void mask_row(const Problem& p, const Geometry& g, int64_t b, int64_t i, int64_t j0,
              int64_t width, Block kind, float* row) {
  if (kind == Block::kFull && j0 + width <= p.S) return;
  if (kind == Block::kPartial && p.q_seg) {
    for (int c = 0; c < width; ++c)
      if (j0 + c >= p.S || !visible(p, g, b, i, j0 + c)) row[c] = -kInf;
    return;
  }
  // Without segments a row sees one interval of keys: columns [first, last] of the
  // block, compared a vector at a time (width is a multiple of VW).
  const int64_t lo = kind == Block::kFull ? j0 : g.lo[i];
  const int64_t hi = std::min(kind == Block::kFull ? p.S - 1 : g.hi[i], p.S - 1);
  const vi first = splat_int(static_cast<int32_t>(std::clamp<int64_t>(lo - j0, 0, width)));
  const vi last = splat_int(static_cast<int32_t>(std::clamp<int64_t>(hi - j0, -1, width)));
  vi column;
  for (int c = 0; c < VW; ++c) column[c] = c;
  for (int c = 0; c < width; c += VW, column += VW) {
    const vf x = load(row + c);
    store(row + c, (column < first) | (column > last) ? splat(-kInf) : x);
  }
}

// Soft-capping and the mask on the first `width` logits of one row, in place: the other
// rules, then the row's bits of a partial mask_fn block (`bits`: its BK / 8 bytes, or
// null). `tanh_out` keeps tanh(logit / cap) for the backward pass.
void cap_and_mask(const Problem& p, const Geometry& g, int64_t b, int64_t i, int64_t j0,
                  int64_t width, Block kind, const uint8_t* bits, float* row, float* tanh_out) {
  if (p.soft_cap > 0) {
    for (int c = 0; c < width; ++c) {
      float t = std::tanh(row[c] / p.soft_cap);
      if (tanh_out) tanh_out[c] = t;
      row[c] = p.soft_cap * t;
    }
  }
  mask_row(p, g, b, i, j0, width, kind, row);
  if (!bits) return;
  for (int c = 0; c < width; c += VW) {
    const vf x = load(row + c);
    store(row + c, lane_bits(bits + c / 8) == 0 ? splat(-kInf) : x);
  }
}

// ---------------------------------------------------------------------------
// Forward.

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

// ---------------------------------------------------------------------------
// Backward.

template <class In>
struct BackwardIn {
  const In *k, *v;     // (B, S, K, H)
  const float* lse;  // (B, T, N)
};

template <class In>
struct BackwardOut {
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

// ---------------------------------------------------------------------------
// The FFI boundary: shapes, then the passes.

// A mask_fn's kinds (V, xB, xN, nQ, nK), slots (the same) and bits (V, P, kBitsBytes),
// checked against the call (B0 the call's own batch, B = V * B0) and against each other.
ffi::Error mask_fn_of(const ffi::Buffer<ffi::S8>& kind, const ffi::Buffer<ffi::S32>& slot,
                      const ffi::Buffer<ffi::U8>& bits, int64_t B0, Problem& p) {
  const auto kd = kind.dimensions(), bd = bits.dimensions();
  const size_t rank = kd.size(), bits_rank = bd.size();
  auto bad = [](const char* what) {
    return ffi::Error::InvalidArgument(std::string("nanoattn native: mask_fn's ") + what);
  };
  if (rank < 4 || bits_rank < 2 || bits_rank - 2 != rank - 4)
    return bad("kinds need (xB, xN, nQ, nK) and bits (P, bytes), after the same mapped axes");
  int64_t V = 1;
  for (size_t a = 0; a + 4 < rank; ++a) {
    if (kd[a] != bd[a]) return bad("kinds and bits have different mapped axes");
    V *= kd[a];
  }
  const int64_t xB = kd[rank - 4], xN = kd[rank - 3];
  if (V * B0 != p.B || (xB != 1 && xB != B0) || (xN != 1 && xN != p.N) ||
      kd[rank - 2] != p.n_q() || kd[rank - 1] != p.n_k())
    return bad("kinds need (1 or B, 1 or N, ceil(T / BQ), ceil(S / BK)) blocks");
  if (bd[bits_rank - 1] != kBitsBytes) return bad("bits need 2 * BQ * BK / 8 bytes a block");
  if (slot.element_count() != kind.element_count()) return bad("slots need one per block");
  const int64_t P = bd[bits_rank - 2];
  const int8_t* kinds = kind.typed_data();
  const int32_t* slots = slot.typed_data();
  for (size_t t = 0; t < kind.element_count(); ++t) {
    if (kinds[t] != kFnEmpty && kinds[t] != kFnPartial && kinds[t] != kFnFull)
      return bad("kinds must be 0 (empty), 1 (partial) or 2 (full)");
    if (kinds[t] == kFnPartial && (slots[t] < 0 || slots[t] >= P))
      return bad("partial blocks need a slot in the bits");
  }
  p.fn = MaskFn{kinds, slots, bits.typed_data(), B0, xB, xN, P};
  return ffi::Error::Success();
}

// The sizes, rules and per-row inputs of a call, checked against each other.
template <class QBuf, class KBuf>
ffi::Error make_problem(const QBuf& q, const KBuf& k, const KBuf& v,
                        const ffi::Buffer<ffi::S32>& q_offset,
                        const ffi::Buffer<ffi::S32>& kv_lengths,
                        const ffi::Buffer<ffi::S32>& q_seg, const ffi::Buffer<ffi::S32>& kv_seg,
                        const ffi::Buffer<ffi::S8>& fn_kind, const ffi::Buffer<ffi::S32>& fn_slot,
                        const ffi::Buffer<ffi::U8>& fn_bits, float scale, float soft_cap,
                        int64_t left, int64_t right, Problem& p) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const size_t rank = qd.size();
  if (rank < 4 || kd.size() != rank || vd.size() != rank)
    return ffi::Error::InvalidArgument("nanoattn native: q, k, v need the same rank >= 4");
  int64_t B = 1;
  for (size_t a = 0; a + 3 < rank; ++a) {
    if (qd[a] != kd[a] || qd[a] != vd[a])
      return ffi::Error::InvalidArgument("nanoattn native: q, k, v batch axes differ");
    B *= qd[a];
  }
  p.B = B;
  p.T = qd[rank - 3];
  p.N = qd[rank - 2];
  p.H = qd[rank - 1];
  p.S = kd[rank - 3];
  p.K = kd[rank - 2];
  for (size_t a = rank - 3; a < rank; ++a)
    if (kd[a] != vd[a]) return ffi::Error::InvalidArgument("nanoattn native: k and v differ");
  if (kd[rank - 1] != p.H || p.K == 0 || p.N % p.K)
    return ffi::Error::InvalidArgument("nanoattn native: bad head counts or widths");
  p.G = p.N / p.K;
  p.Hp = (p.H + VW - 1) / VW * VW;
  if (static_cast<int64_t>(q_offset.element_count()) != B ||
      static_cast<int64_t>(kv_lengths.element_count()) != B)
    return ffi::Error::InvalidArgument("nanoattn native: q_offset and kv_lengths need B values");
  const bool segments = q_seg.element_count() > 0;
  if (segments && (static_cast<int64_t>(q_seg.element_count()) != B * p.T ||
                   static_cast<int64_t>(kv_seg.element_count()) != B * p.S))
    return ffi::Error::InvalidArgument("nanoattn native: segment ids need (B, T) and (B, S)");
  p.scale = scale;
  p.soft_cap = soft_cap;
  p.left = left;
  p.right = right;
  p.q_offset = q_offset.typed_data();
  p.kv_lengths = kv_lengths.typed_data();
  p.q_seg = segments ? q_seg.typed_data() : nullptr;
  p.kv_seg = segments ? kv_seg.typed_data() : nullptr;
  p.fn = MaskFn{};
  if (fn_kind.element_count() == 0) return ffi::Error::Success();  // empty: no mask_fn
  return mask_fn_of(fn_kind, fn_slot, fn_bits, qd[rank - 4], p);
}

std::vector<Geometry> all_geometry(ffi::ThreadPool& pool, int threads, const Problem& p) {
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

// The forward pass of a checked problem: queries of type In, keys and values of type Kv
// (In again, or int8 / float8 with their scales (B, S, K), null for float keys).
template <class In, class Kv>
void forward_run(ffi::ThreadPool& pool, const Problem& p, const In* q, const Kv* k, const Kv* v,
                 const float* key_scales, const float* value_scales, ForwardOut res) {
  if (p.B * p.T * p.N == 0) return;
  const int threads = max_threads(pool);
  const std::vector<Geometry> geo = all_geometry(pool, threads, p);
  // Keys as (BK, Hp) rows for the transposed scores, or transposed (Hp, BK) for a
  // decode step's, and values as (BK, Hp) rows, packed once for every query block: only
  // the key blocks some query of the row may see (a decoding step over a cache of S
  // slots packs what the row holds, not the capacity), which are all any task reads.
  const bool decode = p.T < VW;
  std::vector<std::pair<int64_t, int64_t>> held(p.B);
  for (int64_t b = 0; b < p.B; ++b) held[b] = key_blocks(p, geo[b], 0, p.T);
  auto pack = [&](int64_t b, int64_t kh, int64_t kb, float* key_tile, float* value_tile) {
    // The transposed scores of bfloat16 read the keys as pairs where the CPU has
    // AVX512_BF16 (forward_task); a decode step reads them transposed.
    constexpr bool pairs = kPairs && std::is_same_v<In, uint16_t> && std::is_same_v<Kv, uint16_t>;
    if constexpr (pairs) {
      if (!decode) {
        pack_key_pairs(p, k, geo[b], b, kh, kb * BK, reinterpret_cast<uint32_t*>(key_tile));
        pack_keys(p, v, geo[b], b, kh, kb * BK, value_tile, nullptr);
        return;
      }
    }
    pack_keys(p, k, geo[b], b, kh, kb * BK, decode ? nullptr : key_tile,
              decode ? key_tile : nullptr, key_scales);
    pack_keys(p, v, geo[b], b, kh, kb * BK, value_tile, nullptr, value_scales);
  };
  const int64_t tile = BK * p.Hp;
  // A short call (a group's tiles in L2, and groups enough to share among the threads):
  // one task per (b, key/value head) packs its group's tiles and runs every query block
  // of the group's heads while they are in cache, where tiles packed for the whole call
  // would have left the cache before their readers came.
  const bool grouped = !decode && p.n_k() * tile * 2 * sizeof(float) <= kGroupBytes &&
                       p.B * p.K >= 4 * threads;
  if (grouped) {
    parallel_for(pool, threads, p.B * p.K, [&](int64_t group, int) {
      const int64_t b = group / p.K, kh = group % p.K;
      float* keys = scratch(kGroupKeys, p.n_k() * tile);
      float* values = scratch(kGroupValues, p.n_k() * tile);
      for (int64_t kb = held[b].first; kb <= held[b].second; ++kb)
        pack(b, kh, kb, keys + kb * tile, values + kb * tile);
      for (int64_t n = kh * p.G; n < (kh + 1) * p.G; ++n)
        for (int64_t qb = 0; qb < p.n_q(); ++qb)  // the tiles in cache: one block a task
          forward_task(p, geo, q, keys, values, res, b, n, qb, 1);
    });
    return;
  }
  // Tasks of `group` query blocks of one (b, n) share each key block (forward_task):
  // as many blocks as leave eight tasks per thread at least (one for a decode step). A
  // query block's cost is the number of key blocks it may see (those a mask_fn leaves),
  // a task's the sum of its blocks': causal work balances without a static split.
  const int64_t group = decode ? 1 : blocks_per_task(kQueryGroup, p.B * p.N, p.n_q(), threads);
  const int64_t n_groups = (p.n_q() + group - 1) / group;
  const std::vector<int64_t> order = costliest_first(p.B * p.N * n_groups, [&](int64_t t) {
    const int64_t qg = t % n_groups, n = (t / n_groups) % p.N, b = t / (n_groups * p.N);
    int64_t cost = 0;
    for (int64_t qb = qg * group; qb < std::min((qg + 1) * group, p.n_q()); ++qb) {
      const int64_t i0 = qb * BQ, i1 = std::min(i0 + BQ, p.T);
      auto [first, last] = key_blocks(p, geo[b], i0, i1);
      if (!p.fn.kind && !p.q_seg) {
        cost += last - first + 1;
        continue;
      }
      for (int64_t kb = first; kb <= last; ++kb) {
        const int64_t j0 = kb * BK, j1 = std::min(j0 + BK, p.S);
        cost += combine(classify(p, geo[b], i0, i1, j0, j1), fn_block(p, b, n, qb, kb)) !=
                Block::kSkip;
      }
    }
    return cost;
  });
  Tiles keys(p.B * p.K * p.n_k(), tile, kShared0), values(p.B * p.K * p.n_k(), tile, kShared1);
  parallel_for(pool, threads, p.B * p.K * p.n_k(), [&](int64_t t, int) {
    const int64_t kb = t % p.n_k(), kh = (t / p.n_k()) % p.K, b = t / (p.n_k() * p.K);
    if (kb >= held[b].first && kb <= held[b].second) pack(b, kh, kb, keys.at(t), values.at(t));
  });
  parallel_for(pool, threads, p.B * p.N * n_groups, [&](int64_t t, int) {
    if (decode) {  // group 1: the task is (b, n, query block)
      forward_rows_task(p, geo, q, keys, values, res, order[t]);
      return;
    }
    const int64_t qg = order[t] % n_groups, n = (order[t] / n_groups) % p.N;
    const int64_t b = order[t] / (n_groups * p.N), qb = qg * group;
    const int64_t first = key_tile(p, b, n / p.G, 0);
    forward_task(p, geo, q, keys.at(first), values.at(first), res, b, n, qb,
                 std::min(group, p.n_q() - qb));
  });
}

// The forward pass, for inputs of type DT (F32 or BF16); out and lse are float32.
template <ffi::DataType DT>
ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<DT> q, ffi::Buffer<DT> k, ffi::Buffer<DT> v,
                   ffi::Buffer<ffi::S32> q_offset, ffi::Buffer<ffi::S32> kv_lengths,
                   ffi::Buffer<ffi::S32> q_seg, ffi::Buffer<ffi::S32> kv_seg,
                   ffi::Buffer<ffi::S8> fn_kind, ffi::Buffer<ffi::S32> fn_slot,
                   ffi::Buffer<ffi::U8> fn_bits, float scale, float soft_cap, int64_t left,
                   int64_t right, ffi::ResultBuffer<ffi::F32> out,
                   ffi::ResultBuffer<ffi::F32> lse) {
  Problem p;
  ffi::Error err = make_problem(q, k, v, q_offset, kv_lengths, q_seg, kv_seg, fn_kind, fn_slot,
                                fn_bits, scale, soft_cap, left, right, p);
  if (err.failure()) return err;
  forward_run(pool, p, q.typed_data(), k.typed_data(), v.typed_data(), nullptr, nullptr,
              ForwardOut{out->typed_data(), lse->typed_data()});
  return ffi::Error::Success();
}

// The forward pass of float32 queries over quantized keys and values (int8 or
// float8_e4m3fn, both the same) with their scales (B, S, K); out and lse float32.
ffi::Error ForwardQuantized(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::Buffer<ffi::F32> key_scales,
                            ffi::Buffer<ffi::F32> value_scales, ffi::Buffer<ffi::S32> q_offset,
                            ffi::Buffer<ffi::S32> kv_lengths, ffi::Buffer<ffi::S32> q_seg,
                            ffi::Buffer<ffi::S32> kv_seg, ffi::Buffer<ffi::S8> fn_kind,
                            ffi::Buffer<ffi::S32> fn_slot, ffi::Buffer<ffi::U8> fn_bits,
                            float scale, float soft_cap, int64_t left, int64_t right,
                            ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse) {
  Problem p;
  ffi::Error err = make_problem(q, k, v, q_offset, kv_lengths, q_seg, kv_seg, fn_kind, fn_slot,
                                fn_bits, scale, soft_cap, left, right, p);
  if (err.failure()) return err;
  const size_t tokens = static_cast<size_t>(p.B * p.S * p.K);
  if (k.element_type() != v.element_type() || key_scales.element_count() != tokens ||
      value_scales.element_count() != tokens)
    return ffi::Error::InvalidArgument(
        "nanoattn native: quantized k and v need one type and scales (B, S, K)");
  const bool served = with_storage(k.element_type(), [&](auto stored) {
    using Kv = std::remove_const_t<std::remove_pointer_t<decltype(stored)>>;
    forward_run(pool, p, q.typed_data(), static_cast<const Kv*>(k.untyped_data()),
                static_cast<const Kv*>(v.untyped_data()), key_scales.typed_data(),
                value_scales.typed_data(), ForwardOut{out->typed_data(), lse->typed_data()});
  });
  if (!served)
    return ffi::Error::InvalidArgument("nanoattn native: quantized k and v must be int8 or float8_e4m3fn");
  return ffi::Error::Success();
}

// The backward pass: q, k, v, dout and the gradients of type DT; out, lse, dlse float32.
template <ffi::DataType DT>
ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<DT> q, ffi::Buffer<DT> k,
                    ffi::Buffer<DT> v, ffi::Buffer<ffi::F32> out, ffi::Buffer<ffi::F32> lse,
                    ffi::Buffer<DT> dout, ffi::Buffer<ffi::F32> dlse,
                    ffi::Buffer<ffi::S32> q_offset, ffi::Buffer<ffi::S32> kv_lengths,
                    ffi::Buffer<ffi::S32> q_seg, ffi::Buffer<ffi::S32> kv_seg,
                    ffi::Buffer<ffi::S8> fn_kind, ffi::Buffer<ffi::S32> fn_slot,
                    ffi::Buffer<ffi::U8> fn_bits, float scale, float soft_cap, int64_t left,
                    int64_t right, ffi::ResultBuffer<DT> dq, ffi::ResultBuffer<DT> dk,
                    ffi::ResultBuffer<DT> dv) {
  using In = ffi::NativeType<DT>;
  Problem p;
  ffi::Error err = make_problem(q, k, v, q_offset, kv_lengths, q_seg, kv_seg, fn_kind, fn_slot,
                                fn_bits, scale, soft_cap, left, right, p);
  if (err.failure()) return err;
  if (out.element_count() != q.element_count() || dout.element_count() != q.element_count() ||
      static_cast<int64_t>(lse.element_count()) != p.B * p.T * p.N ||
      dlse.element_count() != lse.element_count())
    return ffi::Error::InvalidArgument(
        "nanoattn native: out, dout, lse or dlse has the wrong size");
  In* dq_out = dq->typed_data();
  const In zero = narrow<In>(0.0f);
  if (p.B * p.S * p.K == 0 || p.B * p.T * p.N == 0) {
    std::fill(dq_out, dq_out + q.element_count(), zero);
    std::fill(dk->typed_data(), dk->typed_data() + k.element_count(), zero);
    std::fill(dv->typed_data(), dv->typed_data() + v.element_count(), zero);
    return ffi::Error::Success();
  }
  const int threads = max_threads(pool);
  const std::vector<Geometry> geo = all_geometry(pool, threads, p);
  // delta = rowsum(dout * out) - dlse, per (b, i, n): d lse / d logits is the softmax,
  // so the log-sum-exp's cotangent shifts the row term of dS = P (dP - delta).
  std::vector<float> delta(p.B * p.T * p.N);
  const float* o = out.typed_data();
  const In* dO = dout.typed_data();
  const float* d_lse = dlse.typed_data();
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
  BackwardIn<In> in{k.typed_data(), v.typed_data(), lse.typed_data()};
  BackwardOut<In> res{dk->typed_data(), dv->typed_data(), delta.data()};
  const int64_t tile = BQ * p.Hp, Tp = p.n_q() * BQ;
  // Query i's dq = scale * the sum of `parts` at `offset` (dQ rows (Tp, heads, Hp) of
  // heads [n0, n0 + heads) in batch row b), in their order, VW widths at a time.
  auto write_dq = [&](int64_t b, int64_t n0, int64_t heads, const std::vector<const float*>& parts,
                      int64_t offset, int64_t i) {
    for (int64_t n = n0; n < n0 + heads; ++n) {
      In* dst = dq_out + ((b * p.T + i) * p.N + n) * p.H;
      const int64_t at = offset + (i * heads + n - n0) * p.Hp;
      for (int64_t h = 0; h < p.H; h += VW) {
        vf acc = vf{};
        for (const float* part : parts) acc += load(part + at + h);
        alignas(64) float sum[VW];
        store(sum, acc * p.scale);
        for (int64_t l = 0; l < VW && h + l < p.H; ++l) dst[h + l] = narrow<In>(sum[l]);
      }
    }
  };
  // A short call (a group's query tiles and dQ in L2, groups enough to share among the
  // threads): one task per (b, key/value head) packs its group's queries, runs every key
  // block in order and writes the group's dQ, which no other task touches.
  const int64_t group_floats = 2 * p.G * p.n_q() * tile + Tp * p.G * p.Hp;
  if (group_floats * sizeof(float) <= kGroupBytes && p.B * p.K >= 4 * threads) {
    parallel_for(pool, threads, p.B * p.K, [&](int64_t group, int) {
      const int64_t b = group / p.K, kh = group % p.K, n0 = kh * p.G;
      float* const held = scratch(kGroupKeys, group_floats);
      const QueryView view{held, held + p.G * p.n_q() * tile, held + 2 * p.G * p.n_q() * tile,
                           n0, p.G};
      for (int64_t n = n0; n < n0 + p.G; ++n)
        for (int64_t qb = 0; qb < p.n_q(); ++qb) {
          pack_rows(p, q.typed_data(), geo[b], b, n, qb * BQ, p.scale, view.q_tile(p, n, qb));
          pack_rows(p, dO, geo[b], b, n, qb * BQ, 1.0f, view.dout_tile(p, n, qb));
        }
      std::fill(view.dq, view.dq + Tp * p.G * p.Hp, 0.0f);
      for (int64_t kb = 0; kb < p.n_k(); ++kb)  // the tiles in cache: one block a task
        backward_task(p, geo, in, view, res, b, kh, kb, 1);
      const std::vector<const float*> parts{view.dq};
      for (int64_t i = 0; i < p.T; ++i) write_dq(b, n0, p.G, parts, 0, i);
    });
    return ffi::Error::Success();
  }
  // Tasks of `group` key blocks of one (b, key/value head) share each query block
  // (backward_task): as many blocks as leave eight tasks per thread at least.
  const int64_t group = blocks_per_task(kKeyGroup, p.B * p.K, p.n_k(), threads);
  const int64_t n_groups = (p.n_k() + group - 1) / group, total = p.B * p.K * n_groups;
  // Each lane: the tasks of one thread, by their cost (the blocks they may see), in a
  // fixed order, and its own dQ buffer (the memory of one buffer per thread).
  const std::vector<std::vector<int64_t>> lanes = fixed_lanes(total, threads, [&](int64_t t) {
    const int64_t kg = t % n_groups, kh = (t / n_groups) % p.K, b = t / (n_groups * p.K);
    int64_t cost = 0;
    for (int64_t kb = kg * group; kb < std::min((kg + 1) * group, p.n_k()); ++kb) {
      const int64_t j0 = kb * BK, j1 = std::min(j0 + BK, p.S);
      auto [first, last] = query_blocks(p, geo[b], j0, j1);
      if (!p.fn.kind && !p.q_seg) {
        cost += last - first + 1;
        continue;
      }
      for (int64_t n = kh * p.G; n < (kh + 1) * p.G; ++n)
        for (int64_t qb = first; qb <= last; ++qb) {
          const int64_t i0 = qb * BQ, i1 = std::min(i0 + BQ, p.T);
          cost += combine(classify(p, geo[b], i0, i1, j0, j1), fn_block(p, b, n, qb, kb)) !=
                  Block::kSkip;
        }
    }
    return cost;
  });
  std::vector<std::unique_ptr<Aligned>> parts(lanes.size());  // per lane: (B, Tp, N, Hp)
  // Queries (times scale) and output cotangents as (BQ, Hp) blocks, packed once for
  // every key block.
  Tiles queries(p.B * p.N * p.n_q(), tile, kShared0), d_out(p.B * p.N * p.n_q(), tile, kShared1);
  parallel_for(pool, threads, p.B * p.N * p.n_q(), [&](int64_t t, int) {
    const int64_t qb = t % p.n_q(), n = (t / p.n_q()) % p.N, b = t / (p.n_q() * p.N);
    pack_rows(p, q.typed_data(), geo[b], b, n, qb * BQ, p.scale, queries.at(t));
    pack_rows(p, dO, geo[b], b, n, qb * BQ, 1.0f, d_out.at(t));
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
    write_dq(bt / p.T, 0, p.N, held, bt / p.T * Tp * p.N * p.Hp, bt % p.T);
  });
  return ffi::Error::Success();
}

}  // namespace

// The parts the bindings share: the dense passes' per-row arguments (q_offset,
// kv_lengths, segment ids, mask_fn's kinds, slots and bits), the paged pass's (page
// table, kv_lengths, query starts, real rows), the static rules, a forward's outputs.
#define NANOATTN_ROW_ARGS                                                             \
  .Arg<ffi::Buffer<ffi::S32>>()     /* q_offset */                                    \
      .Arg<ffi::Buffer<ffi::S32>>() /* kv_lengths */                                  \
      .Arg<ffi::Buffer<ffi::S32>>() /* q_segment_ids */                               \
      .Arg<ffi::Buffer<ffi::S32>>() /* kv_segment_ids */                              \
      .Arg<ffi::Buffer<ffi::S8>>()  /* mask_fn kinds */                               \
      .Arg<ffi::Buffer<ffi::S32>>() /* mask_fn slots */                               \
      .Arg<ffi::Buffer<ffi::U8>>()  /* mask_fn bits */
#define NANOATTN_PAGED_ARGS                                                           \
  .Arg<ffi::Buffer<ffi::S32>>()     /* page_table */                                  \
      .Arg<ffi::Buffer<ffi::S32>>() /* kv_lengths */                                  \
      .Arg<ffi::Buffer<ffi::S32>>() /* query_starts */                                \
      .Arg<ffi::Buffer<ffi::U8>>()  /* real rows */
#define NANOATTN_RULES \
  .Attr<float>("scale").Attr<float>("soft_cap").Attr<int64_t>("left").Attr<int64_t>("right")
#define NANOATTN_FORWARD_OUTPUTS \
  .Ret<ffi::Buffer<ffi::F32>>() /* out */.Ret<ffi::Buffer<ffi::F32>>() /* lse */

// One pair of handlers per element type.
#define NANOATTN_HANDLERS(FORWARD, BACKWARD, DT)                                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(FORWARD, Forward<DT>,                            \
                                ffi::Ffi::Bind()                                 \
                                    .Ctx<ffi::ThreadPool>()                      \
                                    .Arg<ffi::Buffer<DT>>() /* q */              \
                                    .Arg<ffi::Buffer<DT>>() /* k */              \
                                    .Arg<ffi::Buffer<DT>>() /* v */              \
                                        NANOATTN_ROW_ARGS NANOATTN_RULES         \
                                            NANOATTN_FORWARD_OUTPUTS);           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(BACKWARD, Backward<DT>,                          \
                                ffi::Ffi::Bind()                                 \
                                    .Ctx<ffi::ThreadPool>()                      \
                                    .Arg<ffi::Buffer<DT>>()       /* q */        \
                                    .Arg<ffi::Buffer<DT>>()       /* k */        \
                                    .Arg<ffi::Buffer<DT>>()       /* v */        \
                                    .Arg<ffi::Buffer<ffi::F32>>() /* out */      \
                                    .Arg<ffi::Buffer<ffi::F32>>() /* lse */      \
                                    .Arg<ffi::Buffer<DT>>()       /* dout */     \
                                    .Arg<ffi::Buffer<ffi::F32>>() /* dlse */     \
                                        NANOATTN_ROW_ARGS NANOATTN_RULES         \
                                    .Ret<ffi::Buffer<DT>>()  /* dq */            \
                                    .Ret<ffi::Buffer<DT>>()  /* dk */            \
                                    .Ret<ffi::Buffer<DT>>()) /* dv */

// The blocks of queries and keys of every pass (a mask_fn is classified at these).
extern "C" int NanoattnBlockQ() { return BQ; }
extern "C" int NanoattnBlockK() { return BK; }

// How the kernel classifies the (BQ, BK) blocks of one batch row by its positional
// rules, key length and segment ids (null for none), for tests: kinds (n_q, n_k) gets
// 0 (skipped), 1 (masked cell by cell) or 2 (full), as block_mask's kinds.
extern "C" void NanoattnClassify(int64_t T, int64_t S, int32_t q_offset, int32_t kv_length,
                                 int64_t left, int64_t right, const int32_t* q_seg,
                                 const int32_t* kv_seg, int8_t* kinds) {
  Problem p{};
  p.B = p.N = p.K = p.G = 1;
  p.T = T;
  p.S = S;
  p.left = left;
  p.right = right;
  p.q_offset = &q_offset;
  p.kv_lengths = &kv_length;
  p.q_seg = q_seg;
  p.kv_seg = q_seg ? kv_seg : nullptr;
  const Geometry g = geometry(p, 0);
  for (int64_t qb = 0; qb < p.n_q(); ++qb)
    for (int64_t kb = 0; kb < p.n_k(); ++kb) {
      const Block kind = classify(p, g, qb * BQ, std::min((qb + 1) * BQ, T), kb * BK,
                                  std::min((kb + 1) * BK, S));
      kinds[qb * p.n_k() + kb] =
          kind == Block::kSkip ? kFnEmpty : kind == Block::kFull ? kFnFull : kFnPartial;
    }
}

// The instruction set this build's vectors and tiles were chosen for.
extern "C" const char* NanoattnIsa() {
#if defined(__AVX512BF16__)
  return "AVX-512 (16 floats a vector, 6x4 register tiles; bfloat16 scores by AVX512_BF16 pairs)";
#elif defined(__AVX512F__)
  return "AVX-512 (16 floats a vector, 6x4 register tiles)";
#elif defined(__AVX2__)
  return "AVX2 (8 floats a vector, 6x2 register tiles)";
#else
  return "generic (8-float vectors in narrower registers, 6x2 register tiles)";
#endif
}

NANOATTN_HANDLERS(NanoattnForward, NanoattnBackward, ffi::F32);
NANOATTN_HANDLERS(NanoattnForwardBf16, NanoattnBackwardBf16, ffi::BF16);

// The paged forward pass (paged.h), one handler per element type; its backward pass is
// the flash kernel's (nanoattn/_backends/native/paged.py).
#define NANOATTN_PAGED_HANDLER(FORWARD, DT)                                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(FORWARD, PagedForward<DT>,                   \
                                ffi::Ffi::Bind()                             \
                                    .Ctx<ffi::ThreadPool>()                  \
                                    .Arg<ffi::Buffer<DT>>() /* q */          \
                                    .Arg<ffi::Buffer<DT>>() /* key_pages */  \
                                    .Arg<ffi::Buffer<DT>>() /* value_pages */\
                                        NANOATTN_PAGED_ARGS NANOATTN_RULES   \
                                            NANOATTN_FORWARD_OUTPUTS);

NANOATTN_PAGED_HANDLER(NanoattnPagedForward, ffi::F32);
NANOATTN_PAGED_HANDLER(NanoattnPagedForwardBf16, ffi::BF16);

// Float32 queries over quantized keys and values (quantized.h), dense and paged: one
// handler each for int8 and float8_e4m3fn storage; no backward pass (gradients through
// a quantized cache are refused in Python).
XLA_FFI_DEFINE_HANDLER_SYMBOL(NanoattnForwardQuantized, ForwardQuantized,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>() /* q */
                                  .Arg<ffi::AnyBuffer>()        /* k */
                                  .Arg<ffi::AnyBuffer>()        /* v */
                                  .Arg<ffi::Buffer<ffi::F32>>() /* key_scales */
                                  .Arg<ffi::Buffer<ffi::F32>>() /* value_scales */
                                      NANOATTN_ROW_ARGS NANOATTN_RULES NANOATTN_FORWARD_OUTPUTS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(NanoattnPagedForwardQuantized, PagedForwardQuantized,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>() /* q */
                                  .Arg<ffi::AnyBuffer>()        /* key_pages */
                                  .Arg<ffi::AnyBuffer>()        /* value_pages */
                                  .Arg<ffi::Buffer<ffi::F32>>() /* key_scales */
                                  .Arg<ffi::Buffer<ffi::F32>>() /* value_scales */
                                      NANOATTN_PAGED_ARGS NANOATTN_RULES NANOATTN_FORWARD_OUTPUTS);
