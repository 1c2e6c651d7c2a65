// The paged forward pass (nanoattn.paged_attention): the queries of B sequences,
// token-major, against keys and values read straight from a pool of pages through
// each sequence's page table; no gathered copy of any sequence's keys exists.
//
// Shapes (docs/conventions.md's letters): q (Tq, N, H); key and value pages (P,
// page_size, K, H); table (B, M) int32, sequence b's j-th page; kv_lengths (B,), the keys
// sequence b holds; starts (B + 1,), sequence b's queries are rows starts[b] ..
// starts[b+1] - 1, at positions kv_lengths[b] - q_len + i; real (Tq,) uint8, the rows
// that belong to exactly one valid sequence (the others are padding, or broken rows the
// caller poisons). Outputs, float32 whatever the inputs' type: out (Tq, N, H) and the
// log-sum-exp (Tq, N); a row that is not real, or sees no key, gives zeros and -inf.
//
// One task per (sequence b, key/value head kh, block of up to kPagedVectors / G of b's
// query rows): the G query heads of kh and the block's rows are its query vectors, so
// each key and value row of the pool is read once per task (once per (b, kh) in a decode
// step), a tile of kPagedKeys keys at a time, and dotted with every query vector
// (bfloat16, int8 and float8 widened in registers), then the online softmax
// (FlashAttention-2) in float32. A decode step's task takes several key/value heads
// (those side by side in a token row: one run of memory a token, which the hardware
// streams, where one head's rows are scattered K * H apart).
// A task reads only the keys its rows may see (keys 0 .. kv_lengths[b] - 1, narrowed by
// the causal band or the window): never a page past those the sequence holds, nor a
// slot past its length. Every page id is clamped into [0, P), lengths into [0, M *
// page_size] and starts into [0, Tq], so that no input, however wrong, reads outside
// the arrays (the caller also replaces bad ids and makes those rows NaN).
//
// Included by attention.cc only, in its one translation unit: the code sits in an
// unnamed namespace there as here, so that every function keeps internal linkage.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

#include "quantized.h"
#include "simd.h"
#include "threads.h"

namespace {

constexpr int kPagedVectors = 64;  // query vectors (rows x heads of a group) per task
constexpr int kPagedKeys = 32;     // keys per tile
constexpr int kPagedBlock = 4;     // query vectors per register tile of the products
constexpr int kPagedAhead = 2;     // tiles whose lines are fetched ahead of the one computed
static_assert(kPagedKeys % VW == 0 && kPagedKeys % 2 == 0, "tiles must hold whole vectors");
static_assert(kPagedBlock == 4, "paged_dots sums 4 query vectors x 2 keys at once (hsum8)");

// A paged call: sizes, rules and the run-time inputs.
struct Paged {
  int64_t Tq, N, K, G, H, Hp, P, page_size, B, M;
  float scale, soft_cap;  // soft_cap 0: none
  int64_t left, right;    // the band, -1: unbounded
  const int32_t* table;   // (B, M)
  const int32_t* kv_lengths;  // (B,)
  const int32_t* starts;  // (B + 1,)
  const uint8_t* real;    // (Tq,)
  // quantized pools' scales (P, page_size, K), float32; null for float pools
  const float* key_scales = nullptr;
  const float* value_scales = nullptr;
  // sequence b's rows [first, end), clamped into [0, Tq] and never decreasing
  int64_t first(int64_t b) const { return std::clamp<int64_t>(starts[b], 0, Tq); }
  int64_t end(int64_t b) const { return std::clamp<int64_t>(starts[b + 1], first(b), Tq); }
  // the keys sequence b holds, clamped into [0, M * page_size] (none without a pool)
  int64_t length(int64_t b) const {
    return P == 0 ? 0 : std::clamp<int64_t>(kv_lengths[b], 0, M * page_size);
  }
  int64_t rows_per_task() const { return std::max<int64_t>(1, kPagedVectors / G); }
};

// One task: sequence b, key/value heads [kh0, kh1), rows [r0, r1) of the query.
struct PagedTask {
  int64_t b, kh0, kh1, r0, r1;
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

// s[i * kPagedKeys + c] = q_i . k_c for kPagedBlock query vectors (rows of q, Hp wide,
// zero past H) and the keys c < n (rows of H elements at krow[c]), times the key's scale
// kscale[c] where the keys are quantized (null: none).
template <class In>
void paged_dots(const float* q, int64_t Hp, int64_t H, const In* const* krow, int64_t n,
                const float* kscale, float* s) {
  int64_t c = 0;
  for (; c + 2 <= n; c += 2) {
    vf acc[kPagedBlock][2] = {};
    for (int64_t h = 0; h < Hp; h += VW) {
      const vf k0 = load_wide(krow[c] + h, H - h), k1 = load_wide(krow[c + 1] + h, H - h);
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
      const vf k0 = load_wide(krow[c] + h, H - h);
      for (int i = 0; i < kPagedBlock; ++i) acc[i] += load(q + i * Hp + h) * k0;
    }
    const float s0 = kscale ? kscale[c] : 1.0f;
    for (int i = 0; i < kPagedBlock; ++i) s[i * kPagedKeys + c] = hsum(acc[i]) * s0;
  }
}

// o[i] += sum_c p[i, c] v_c for kPagedBlock query vectors (o rows Hp wide) and the
// values c < n (rows of H elements at vrow[c]), two vectors of the width at a time.
template <class In>
void paged_values(const float* p, const In* const* vrow, int64_t n, int64_t Hp, int64_t H,
                  float* o) {
  int64_t h = 0;
  for (; h + 2 * VW <= Hp; h += 2 * VW) {
    vf acc[kPagedBlock][2];
    for (int i = 0; i < kPagedBlock; ++i)
      for (int v = 0; v < 2; ++v) acc[i][v] = load(o + i * Hp + h + v * VW);
    for (int64_t c = 0; c < n; ++c) {
      const vf v0 = load_wide(vrow[c] + h, H - h), v1 = load_wide(vrow[c] + h + VW, H - h - VW);
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
      const vf v0 = load_wide(vrow[c] + h, H - h);
      for (int i = 0; i < kPagedBlock; ++i) acc[i] += splat(p[i * kPagedKeys + c]) * v0;
    }
    for (int i = 0; i < kPagedBlock; ++i) store(o + i * Hp + h, acc[i]);
  }
}

// A task's scratch, kept per thread from call to call (grown to the largest need).
struct PagedScratch {
  std::vector<float> q, s, o, m, l, scales;
  void fit(int64_t vectors, int64_t Hp, int64_t heads) {
    const size_t n = static_cast<size_t>(vectors);
    if (q.size() < n * Hp) q.resize(n * Hp), o.resize(n * Hp);
    if (s.size() < n * kPagedKeys) s.resize(n * kPagedKeys);
    if (m.size() < n) m.resize(n), l.resize(n);
    const size_t tiles = kPagedAhead + 1;  // [tile % tiles][keys, values][head][key]
    if (scales.size() < tiles * 2 * heads * kPagedKeys) scales.resize(tiles * 2 * heads * kPagedKeys);
  }
};

// One task, queries of type Q, pools of type In (float32 and bfloat16 alike, or int8 and
// float8 with their scales). Its heads kh0 .. kh1 - 1 sit side by side in every token
// row of the pool, so a tile of keys is read as one run of memory per token.
template <class Q, class In>
void paged_task(const Paged& p, const Q* q, const In* kp, const In* vp, const PagedTask& task,
                float* out, float* lse) {
  const int64_t b = task.b, G = p.G, Hp = p.Hp, H = p.H;
  const int64_t heads = task.kh1 - task.kh0, rows = task.r1 - task.r0;
  // each head's query vectors (row r, head g at r * G + g), padded to register tiles
  const int64_t padded = (rows * G + kPagedBlock - 1) / kPagedBlock * kPagedBlock;
  const int64_t vectors = heads * padded;
  thread_local PagedScratch scratch;
  scratch.fit(vectors, Hp, heads);
  float *qs = scratch.q.data(), *s = scratch.s.data(), *o = scratch.o.data();
  float *m = scratch.m.data(), *l = scratch.l.data();
  // The rows' positions; the task's keys [lo, hi): every key some real row sees (the
  // rows' bands are intervals of one width at consecutive positions: their union is
  // one interval), so a key no row of the task sees is never read.
  const int64_t length = p.length(b), q_len = p.end(b) - p.first(b);
  const int64_t base = length - q_len + (task.r0 - p.first(b));  // position of row r0
  int64_t top = -1, bottom = -1;
  for (int64_t r = 0; r < rows; ++r)
    if (p.real[task.r0 + r]) top = base + r, bottom = bottom < 0 ? base + r : bottom;
  if (top < 0) return;  // no real row: nothing to write
  int64_t lo = 0, hi = length;
  if (p.right >= 0) hi = std::min(hi, top + p.right + 1);
  if (p.left >= 0) lo = std::max<int64_t>(lo, bottom - p.left);
  // Query vectors times the scale, head after head; padding vectors 0.
  std::fill(qs, qs + vectors * Hp, 0.0f);
  std::fill(o, o + vectors * Hp, 0.0f);
  std::fill(m, m + vectors, -kInf);
  std::fill(l, l + vectors, 0.0f);
  for (int64_t hh = 0; hh < heads; ++hh)
    for (int64_t r = 0; r < rows; ++r) {
      if (!p.real[task.r0 + r]) continue;
      const Q* src = q + ((task.r0 + r) * p.N + (task.kh0 + hh) * G) * H;
      float* dst = qs + (hh * padded + r * G) * Hp;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t h = 0; h < H; ++h) dst[g * Hp + h] = widen(src[g * H + h]) * p.scale;
    }
  // The rows of the tile being read (head kh0's; head kh0 + hh's are hh * H further),
  // and of the next one, whose lines are prefetched while this one is computed (its
  // pages sit anywhere in the pool); with a quantized pool, the tiles' key and value
  // scales too, [parity][keys, values][head][key] (0 past the tile's keys).
  const In* rows_of[kPagedAhead + 1][2][kPagedKeys];  // [tile % 3][keys, values][key]
  constexpr bool quantized = kQuantized<In>;
  float* scales = scratch.scales.data();
  auto scales_at = [&](int parity, int kind, int64_t hh) {
    return scales + ((parity * 2 + kind) * heads + hh) * kPagedKeys;
  };  // parity: the tile's index % (kPagedAhead + 1)
  const int32_t* pages = p.table + b * p.M;
  const int64_t run_bytes = heads * H * static_cast<int64_t>(sizeof(In));
  auto locate = [&](int64_t j0, int parity, bool prefetch) {
    const In** keys = rows_of[parity][0];
    const In** values = rows_of[parity][1];
    const int64_t n = std::min<int64_t>(kPagedKeys, hi - j0);
    int64_t entry = j0 / p.page_size, slot = j0 % p.page_size;  // one division a tile
    for (int64_t c = 0; c < n; ++c) {
      const int64_t page = std::clamp<int64_t>(pages[entry], 0, p.P - 1);
      const int64_t token = (page * p.page_size + slot) * p.K + task.kh0;
      keys[c] = kp + token * H;
      values[c] = vp + token * H;
      if constexpr (quantized)
        for (int64_t hh = 0; hh < heads; ++hh) {
          scales_at(parity, 0, hh)[c] = p.key_scales[token + hh];
          scales_at(parity, 1, hh)[c] = p.value_scales[token + hh];
        }
      if (prefetch)
        for (int64_t byte = 0; byte < run_bytes; byte += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(keys[c]) + byte);
          __builtin_prefetch(reinterpret_cast<const char*>(values[c]) + byte);
        }
      if (++slot == p.page_size) slot = 0, ++entry;
    }
    if constexpr (quantized)
      for (int64_t hh = 0; hh < heads; ++hh)
        for (int64_t c = n; c < kPagedKeys; ++c)
          scales_at(parity, 0, hh)[c] = scales_at(parity, 1, hh)[c] = 0;
  };
  vi column;
  for (int c = 0; c < VW; ++c) column[c] = c;
  for (int a = 0; a < kPagedAhead; ++a)
    if (lo + a * kPagedKeys < hi) locate(lo + a * kPagedKeys, a, a > 0);
  for (int64_t j0 = lo, tile = 0; j0 < hi; j0 += kPagedKeys, ++tile) {
    const int64_t n = std::min<int64_t>(kPagedKeys, hi - j0);
    const int parity = tile % (kPagedAhead + 1);
    if (j0 + kPagedAhead * kPagedKeys < hi)
      locate(j0 + kPagedAhead * kPagedKeys, (tile + kPagedAhead) % (kPagedAhead + 1), true);
    for (int64_t hh = 0; hh < heads; ++hh) {
      const int64_t shift_h = hh * H;  // head kh0 + hh within the token rows
      const In* krow[kPagedKeys];
      const In* vrow[kPagedKeys];
      for (int64_t c = 0; c < n; ++c)
        krow[c] = rows_of[parity][0][c] + shift_h, vrow[c] = rows_of[parity][1][c] + shift_h;
      const float* kscale = quantized ? scales_at(parity, 0, hh) : nullptr;
      const float* vscale = scales_at(parity, 1, hh);
      float* qh = qs + hh * padded * Hp;
      float* oh = o + hh * padded * Hp;
      for (int64_t i = 0; i < padded; i += kPagedBlock)
        paged_dots(qh + i * Hp, Hp, H, krow, n, kscale, s + i * kPagedKeys);
      for (int64_t i = 0; i < padded; ++i) {
        float* row = s + i * kPagedKeys;
        const int64_t r = i / G, v = hh * padded + i;
        if (r >= rows || !p.real[task.r0 + r]) {  // a padding vector or a row not written
          std::fill(row, row + kPagedKeys, 0.0f);
          continue;
        }
        if (p.soft_cap > 0)
          for (int64_t c = 0; c < n; ++c) row[c] = p.soft_cap * std::tanh(row[c] / p.soft_cap);
        // The row's keys [first, last] among the tile's columns; the others -inf.
        const int64_t pos = base + r;
        const int64_t first = p.left >= 0 ? pos - p.left : 0;
        const int64_t last = std::min(p.right >= 0 ? pos + p.right : hi - 1, j0 + n - 1);
        const vi from = splat_int(static_cast<int32_t>(std::clamp<int64_t>(first - j0, 0, n)));
        const vi to = splat_int(static_cast<int32_t>(std::clamp<int64_t>(last - j0, -1, n)));
        vi col = column;
        vf mx = splat(-kInf);
        for (int c = 0; c < kPagedKeys; c += VW, col += VW) {
          const vf x = (col < from) | (col > to) ? splat(-kInf) : load(row + c);
          store(row + c, x);
          mx = nan_max(x, mx);
        }
        // The online softmax, as the dense kernel's: maxima keep a NaN, and a row that
        // sees nothing yet keeps m = -inf and weights 0.
        const float m_new = nan_max(m[v], hmax(mx));
        if (m_new == -kInf) {
          std::fill(row, row + kPagedKeys, 0.0f);
          continue;
        }
        const float alpha = std::exp(m[v] - m_new);  // 0 when m was -inf
        vf sum = vf{};
        const vf shift = splat(m_new);
        for (int c = 0; c < kPagedKeys; c += VW) {
          const vf e = vexp(load(row + c) - shift);
          sum += e;
          // the weights of quantized values times their scales (the sum is the
          // weights'); a weight of 0 stays 0: a key outside this row's band is never read
          store(row + c, quantized ? (e != 0 ? e * load(vscale + c) : vf{}) : e);
        }
        l[v] = l[v] * alpha + hsum(sum);
        m[v] = m_new;
        if (alpha != 1.0f) {
          float* orow = o + v * Hp;
          const vf a = splat(alpha);
          for (int64_t h = 0; h < Hp; h += VW) store(orow + h, load(orow + h) * a);
        }
      }
      for (int64_t i = 0; i < padded; i += kPagedBlock)
        paged_values(s + i * kPagedKeys, vrow, n, Hp, H, oh + i * Hp);
    }
  }
  for (int64_t hh = 0; hh < heads; ++hh)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = task.r0 + r;
      if (!p.real[t]) continue;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t v = hh * padded + r * G + g, head = (task.kh0 + hh) * G + g;
        float* dst = out + (t * p.N + head) * H;
        if (l[v] != 0) {  // l >= 1 for a row that sees a key; NaN from NaN or inf content
          const float inv = 1.0f / l[v];
          for (int64_t h = 0; h < H; ++h) dst[h] = o[v * Hp + h] * inv;
          lse[t * p.N + head] = m[v] + std::log(l[v]);
        } else {
          std::fill(dst, dst + H, 0.0f);
          lse[t * p.N + head] = -kInf;  // the log-sum-exp of no logit
        }
      }
    }
}

// A paged call's sizes and run-time inputs, checked against each other, into p.
template <class QBuf, class PoolBuf>
xla::ffi::Error paged_problem(const QBuf& q, const PoolBuf& key_pages, const PoolBuf& value_pages,
                              const xla::ffi::Buffer<xla::ffi::S32>& table,
                              const xla::ffi::Buffer<xla::ffi::S32>& kv_lengths,
                              const xla::ffi::Buffer<xla::ffi::S32>& starts,
                              const xla::ffi::Buffer<xla::ffi::U8>& real, float scale,
                              float soft_cap, int64_t left, int64_t right, Paged& p) {
  const auto qd = q.dimensions(), kd = key_pages.dimensions(), vd = value_pages.dimensions();
  const auto td = table.dimensions();
  auto bad = [](const char* what) {
    return xla::ffi::Error::InvalidArgument(std::string("nanoattn native paged: ") + what);
  };
  if (qd.size() != 3 || kd.size() != 4 || vd.size() != 4 || td.size() != 2)
    return bad("q needs (Tq, N, H), the pages (P, page_size, K, H), the table (B, M)");
  for (size_t a = 0; a < 4; ++a)
    if (kd[a] != vd[a]) return bad("key and value pages differ");
  p.Tq = qd[0], p.N = qd[1], p.H = qd[2];
  p.P = kd[0], p.page_size = kd[1], p.K = kd[2];
  p.B = td[0], p.M = td[1];
  if (kd[3] != p.H || p.K == 0 || p.N % p.K || p.page_size == 0)
    return bad("bad head counts, widths or page size");
  if (static_cast<int64_t>(kv_lengths.element_count()) != p.B ||
      static_cast<int64_t>(starts.element_count()) != p.B + 1 ||
      static_cast<int64_t>(real.element_count()) != p.Tq)
    return bad("kv_lengths need (B,), starts (B + 1,) and real (Tq,)");
  p.G = p.N / p.K;
  p.Hp = (p.H + VW - 1) / VW * VW;
  p.scale = scale, p.soft_cap = soft_cap, p.left = left, p.right = right;
  p.table = table.typed_data(), p.kv_lengths = kv_lengths.typed_data();
  p.starts = starts.typed_data(), p.real = real.typed_data();
  return xla::ffi::Error::Success();
}

// The paged pass of a checked problem: queries of type Q, pools of type In.
template <class Q, class In>
xla::ffi::Error paged_run(xla::ffi::ThreadPool& pool, const Paged& p, const Q* qp, const In* kp,
                          const In* vp, float* o, float* l) {
  // Rows no task writes (padding, broken): zeros and -inf.
  for (int64_t t = 0; t < p.Tq; ++t) {
    if (p.real[t]) continue;
    std::fill(o + t * p.N * p.H, o + (t + 1) * p.N * p.H, 0.0f);
    std::fill(l + t * p.N, l + (t + 1) * p.N, -kInf);
  }
  // Tasks of up to kPagedVectors query vectors: rows of one head, or, for a few rows (a
  // decode step), the rows of several heads side by side, as many as keep 4 tasks a
  // thread (their keys are then one run of memory per token, not one row per head).
  const int threads = max_threads(pool);
  int64_t row_sets = 0;
  const int64_t step = p.rows_per_task();
  for (int64_t b = 0; b < p.B; ++b) row_sets += (p.end(b) - p.first(b) + step - 1) / step;
  int64_t together = 1;  // heads per task: a divisor of K
  for (int64_t d = p.K; d > 1; --d)
    if (p.K % d == 0 && d * p.G <= kPagedVectors && row_sets * (p.K / d) >= 4 * threads) {
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
  if (tasks.empty()) return xla::ffi::Error::Success();
  // The longest first: a prefill chunk's tasks start before the decode tokens'.
  const std::vector<int64_t> order =
      costliest_first(static_cast<int64_t>(tasks.size()), [&](int64_t t) {
        const PagedTask& task = tasks[t];
        return (task.r1 - task.r0) * (task.kh1 - task.kh0) * (p.length(task.b) + 1);
      });
  parallel_for(pool, threads, static_cast<int64_t>(tasks.size()),
               [&](int64_t t, int) { paged_task(p, qp, kp, vp, tasks[order[t]], o, l); });
  return xla::ffi::Error::Success();
}

// The paged forward pass for inputs of type DT (F32 or BF16); out and lse float32.
template <xla::ffi::DataType DT>
xla::ffi::Error PagedForward(xla::ffi::ThreadPool pool, xla::ffi::Buffer<DT> q,
                             xla::ffi::Buffer<DT> key_pages, xla::ffi::Buffer<DT> value_pages,
                             xla::ffi::Buffer<xla::ffi::S32> table,
                             xla::ffi::Buffer<xla::ffi::S32> kv_lengths,
                             xla::ffi::Buffer<xla::ffi::S32> starts,
                             xla::ffi::Buffer<xla::ffi::U8> real, float scale, float soft_cap,
                             int64_t left, int64_t right, xla::ffi::ResultBuffer<xla::ffi::F32> out,
                             xla::ffi::ResultBuffer<xla::ffi::F32> lse) {
  Paged p;
  xla::ffi::Error err = paged_problem(q, key_pages, value_pages, table, kv_lengths, starts, real,
                                      scale, soft_cap, left, right, p);
  if (err.failure()) return err;
  return paged_run(pool, p, q.typed_data(), key_pages.typed_data(), value_pages.typed_data(),
                   out->typed_data(), lse->typed_data());
}

// The paged forward pass over quantized pools (int8 or float8_e4m3fn, both the same) with
// their scales (P, page_size, K); the queries float32, out and lse float32.
xla::ffi::Error PagedForwardQuantized(
    xla::ffi::ThreadPool pool, xla::ffi::Buffer<xla::ffi::F32> q, xla::ffi::AnyBuffer key_pages,
    xla::ffi::AnyBuffer value_pages, xla::ffi::Buffer<xla::ffi::F32> key_scales,
    xla::ffi::Buffer<xla::ffi::F32> value_scales, xla::ffi::Buffer<xla::ffi::S32> table,
    xla::ffi::Buffer<xla::ffi::S32> kv_lengths, xla::ffi::Buffer<xla::ffi::S32> starts,
    xla::ffi::Buffer<xla::ffi::U8> real, float scale, float soft_cap, int64_t left, int64_t right,
    xla::ffi::ResultBuffer<xla::ffi::F32> out, xla::ffi::ResultBuffer<xla::ffi::F32> lse) {
  Paged p;
  xla::ffi::Error err = paged_problem(q, key_pages, value_pages, table, kv_lengths, starts, real,
                                      scale, soft_cap, left, right, p);
  if (err.failure()) return err;
  const size_t tokens = static_cast<size_t>(p.P * p.page_size * p.K);
  if (key_pages.element_type() != value_pages.element_type() ||
      key_scales.element_count() != tokens || value_scales.element_count() != tokens)
    return xla::ffi::Error::InvalidArgument(
        "nanoattn native paged: quantized pages need one type and scales (P, page_size, K)");
  p.key_scales = key_scales.typed_data(), p.value_scales = value_scales.typed_data();
  bool served = with_storage(key_pages.element_type(), [&](auto stored) {
    using In = std::remove_const_t<std::remove_pointer_t<decltype(stored)>>;
    err = paged_run(pool, p, q.typed_data(), static_cast<const In*>(key_pages.untyped_data()),
                    static_cast<const In*>(value_pages.untyped_data()), out->typed_data(),
                    lse->typed_data());
  });
  if (!served)
    return xla::ffi::Error::InvalidArgument(
        "nanoattn native paged: quantized pages must be int8 or float8_e4m3fn");
  return err;
}

}  // namespace
