// A row of logits before its softmax: the soft cap, then the mask (the positional
// rules, lengths and segment ids of visibility.h, and a partial mask_fn block's bits),
// which sets every logit its query may not see to -inf. Read by the passes whose scores
// are rows of queries (forward.h's decode step, backward.h); the transposed forward
// masks its columns of scores itself (forward_step).
//
// Included by attention.cc only, in its one translation unit: the code sits in an
// unnamed namespace there as here, so that every function keeps internal linkage.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "simd.h"
#include "visibility.h"

namespace {

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

}  // namespace
