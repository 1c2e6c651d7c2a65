// Multi-head latent attention's absorbed products (nanoattn/_layers/absorbed.py): each
// head's vectors times that head's columns of the up-projection kernel W (R, N, C), read
// where they lie (XLA slices a head's columns into a copy first). Two products, float32:
//
//   rows     (the key projection absorbed):  out[m, n, i] = sum_h x[m, n, h] W[i, n, c0 + h]
//   columns  (the value projection after):   out[m, n, v] = sum_i x[m, n, i] W[i, n, c0 + v]
//
// Both split W's rows i among the tasks, so that each task streams its rows of W once
// (a decoding step's products read W and little else); the column product sums its
// tasks' parts in a fixed order at the end.
//
// Axis letters: M the rows of x (batch and queries flattened), N heads, R the kernel's
// rows (the latent width), C its columns per head, Hx the width a product takes of them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "simd.h"
#include "threads.h"

namespace {

constexpr int64_t kAbsorbedTaskRows = 32;  // rows of W a task reads

struct AbsorbedProblem {
  int64_t M, N, R, C, c0, Hx;  // x (M, N, Hx or R), W (R, N, C), columns [c0, c0 + Hx)
};

// Rows [i0, i0 + 8) of W (row stride ld) against the vector xv of width n: 8 sums.
inline void dot8(const float* xv, const float* w, int64_t ld, int64_t n, float* sums) {
  vf acc[8] = {};
  int64_t h = 0;
  for (; h + VW <= n; h += VW) {
    const vf xh = load(xv + h);
    for (int k = 0; k < 8; ++k) acc[k] += xh * load(w + k * ld + h);
  }
  hsum8(acc, sums);
  for (; h < n; ++h)
    for (int k = 0; k < 8; ++k) sums[k] += xv[h] * w[k * ld + h];
}

// out (M, N, R): W's rows against every head's vectors, eight rows at a time (one sum
// across lanes per eight outputs).
inline void absorbed_rows(xla::ffi::ThreadPool& pool, const AbsorbedProblem& p, const float* x,
                          const float* w, float* out) {
  const int64_t tasks = (p.R + kAbsorbedTaskRows - 1) / kAbsorbedTaskRows, ld = p.N * p.C;
  parallel_for(pool, max_threads(pool), tasks, [&](int64_t task, int) {
    const int64_t i1 = std::min(p.R, (task + 1) * kAbsorbedTaskRows);
    int64_t i = task * kAbsorbedTaskRows;
    for (; i + 8 <= i1; i += 8)
      for (int64_t n = 0; n < p.N; ++n)
        for (int64_t m = 0; m < p.M; ++m) {
          float sums[8];
          dot8(x + (m * p.N + n) * p.Hx, w + (i * p.N + n) * p.C + p.c0, ld, p.Hx, sums);
          for (int k = 0; k < 8; ++k) out[(m * p.N + n) * p.R + i + k] = sums[k];
        }
    for (; i < i1; ++i)
      for (int64_t n = 0; n < p.N; ++n)
        for (int64_t m = 0; m < p.M; ++m) {
          const float* xv = x + (m * p.N + n) * p.Hx;
          const float* wn = w + (i * p.N + n) * p.C + p.c0;
          float sum = 0.0f;
          for (int64_t h = 0; h < p.Hx; ++h) sum += xv[h] * wn[h];
          out[(m * p.N + n) * p.R + i] = sum;
        }
  });
}

// out (M, N, Hx): every head's columns summed over the rows of W, four rows at a time
// into a part of the task's own (read and written once per four rows), the parts then
// summed in task order.
inline void absorbed_columns(xla::ffi::ThreadPool& pool, const AbsorbedProblem& p,
                             const float* x, const float* w, float* out) {
  const int64_t tasks = (p.R + kAbsorbedTaskRows - 1) / kAbsorbedTaskRows, ld = p.N * p.C;
  const int64_t size = p.M * p.N * p.Hx, full = p.Hx / VW * VW;
  std::vector<float> parts(tasks * size, 0.0f);
  parallel_for(pool, max_threads(pool), tasks, [&](int64_t task, int) {
    float* part = parts.data() + task * size;
    const int64_t i1 = std::min(p.R, (task + 1) * kAbsorbedTaskRows);
    for (int64_t i = task * kAbsorbedTaskRows; i < i1; i += 4) {
      const int rows = static_cast<int>(std::min<int64_t>(4, i1 - i));
      for (int64_t n = 0; n < p.N; ++n) {
        const float* wn = w + (i * p.N + n) * p.C + p.c0;
        for (int64_t m = 0; m < p.M; ++m) {
          const float* xs = x + (m * p.N + n) * p.R + i;
          float* o = part + (m * p.N + n) * p.Hx;
          if (rows == 4) {
            const vf x0 = splat(xs[0]), x1 = splat(xs[1]), x2 = splat(xs[2]), x3 = splat(xs[3]);
            for (int64_t v = 0; v < full; v += VW)
              store(o + v, load(o + v) + x0 * load(wn + v) + x1 * load(wn + ld + v) +
                               x2 * load(wn + 2 * ld + v) + x3 * load(wn + 3 * ld + v));
            for (int64_t v = full; v < p.Hx; ++v)
              o[v] += xs[0] * wn[v] + xs[1] * wn[ld + v] + xs[2] * wn[2 * ld + v] +
                      xs[3] * wn[3 * ld + v];
          } else {
            for (int k = 0; k < rows; ++k)
              for (int64_t v = 0; v < p.Hx; ++v) o[v] += xs[k] * wn[k * ld + v];
          }
        }
      }
    }
  });
  std::fill(out, out + size, 0.0f);
  for (int64_t task = 0; task < tasks; ++task) {
    const float* part = parts.data() + task * size;
    for (int64_t e = 0; e < size; ++e) out[e] += part[e];
  }
}

}  // namespace
