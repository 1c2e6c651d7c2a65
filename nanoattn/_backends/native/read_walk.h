// A yardstick for the paged decode, not a pass of attention: the read bandwidth of a
// walk over a pool's pages in a given order (nanoattn.bench._bandwidth's page walk).
// A decode step reads each page of its sequences once, front to back, the pages in
// whatever order the table gives; this reads float32 chunks the same way, a thread per
// part of the order, with vector loads into several sums (no arithmetic to wait on), so
// that its time is the memory's alone. Included by attention.cc only.
#pragma once

#include <cstdint>
#include <thread>
#include <vector>

#include "simd.h"

namespace {

// The sum of chunks order[i] (each chunk_floats floats at data + order[i] *
// chunk_floats) for i in [from, to): four vectors at a time, a chunk's tail one number
// at a time.
inline double walk_part(const float* data, int64_t chunk_floats, const int64_t* order,
                        int64_t from, int64_t to) {
  vf sums[4] = {};
  double total = 0;
  const int64_t whole = chunk_floats - chunk_floats % (4 * VW);
  for (int64_t i = from; i < to; ++i) {
    const float* chunk = data + order[i] * chunk_floats;
    for (int64_t h = 0; h < whole; h += 4 * VW)
      for (int j = 0; j < 4; ++j) sums[j] += load(chunk + h + j * VW);
    for (int64_t h = whole; h < chunk_floats; ++h) total += chunk[h];
  }
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < VW; ++l) total += sums[j][l];
  return total;
}

// The walk of `count` chunks in `order` over `threads` threads, each a contiguous part
// of the order; returns the sum of every number read (the caller's check that each
// chunk was read once).
inline double read_walk(const float* data, int64_t count, int64_t chunk_floats,
                        const int64_t* order, int threads) {
  std::vector<double> totals(threads);
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t)
    workers.emplace_back([&, t] {
      totals[t] = walk_part(data, chunk_floats, order, count * t / threads,
                            count * (t + 1) / threads);
    });
  double total = 0;
  for (int t = 0; t < threads; ++t) workers[t].join(), total += totals[t];
  return total;
}

}  // namespace
