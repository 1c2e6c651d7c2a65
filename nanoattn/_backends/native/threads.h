// Work sharing on XLA's CPU thread pool: parallel_for, the number of threads
// (NANOATTN_NUM_THREADS caps it), an order of tasks costliest first, and a fixed
// split of tasks into lanes (for sums that must not depend on the schedule). The caller
// works too; a helper that starts after every task is taken returns without
// touching the caller's state, so the caller only waits for tasks, never for helpers.
//
// Included by attention.cc only, in its one translation unit: the code sits in an
// unnamed namespace there as here, so that every function keeps internal linkage.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <numeric>
#include <vector>

#include <sched.h>

#include "xla/ffi/api/ffi.h"

namespace {

struct Job {
  explicit Job(int64_t total) : total(total) {}
  const int64_t total;
  std::atomic<int64_t> next{0};
  std::atomic<int> workers{0};
  int64_t done = 0;
  std::mutex mu;
  std::condition_variable cv;
};

// The CPUs this process may run on (its affinity mask), once.
int usable_cpus() {
  static const int count = [] {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) != 0) return 0;
    return CPU_COUNT(&set);
  }();
  return count;
}

// The threads a call shares its work among: XLA's pool and the caller's, at most one a
// CPU (XLA's pool has one thread a CPU: the caller as well would put two threads on one
// CPU, each stopped in turn; on 2-core Zen 4, 2 threads against 3 gave the float32
// backward at T = 4096 1.2x, a decode over 32768 keys 1.1x), or NANOATTN_NUM_THREADS when
// set (tests take every count from 1 to twice the cores; a count above the pool's runs
// its lanes on the pool's threads in turn).
int max_threads(xla::ffi::ThreadPool& pool) {
  int n = static_cast<int>(pool.num_threads()) + 1;
  if (const int cpus = usable_cpus(); cpus > 0) n = std::min(n, cpus);
  if (const char* env = std::getenv("NANOATTN_NUM_THREADS")) {
    int count = std::atoi(env);
    if (count > 0) n = count;
  }
  return std::max(n, 1);
}

// Runs body(task, worker) for task in [0, total); worker < threads.
template <class Body>
void parallel_for(xla::ffi::ThreadPool& pool, int threads, int64_t total, const Body& body) {
  if (total <= 0) return;
  auto job = std::make_shared<Job>(total);
  const Body* fn = &body;
  auto work = [job, fn]() {
    int worker = job->workers.fetch_add(1);
    int64_t mine = 0;
    for (int64_t t; (t = job->next.fetch_add(1)) < job->total; ++mine) (*fn)(t, worker);
    if (mine) {
      std::lock_guard<std::mutex> lock(job->mu);
      job->done += mine;
      if (job->done == job->total) job->cv.notify_all();
    }
  };
  int helpers = static_cast<int>(std::min<int64_t>(threads, total)) - 1;
  for (int i = 0; i < helpers; ++i) pool.Schedule([work]() { work(); });
  work();
  std::unique_lock<std::mutex> lock(job->mu);
  job->cv.wait(lock, [&] { return job->done == job->total; });
}

// How many of a row's `blocks` blocks one task takes: `most` (a power of two), halved
// while `rows` rows of tasks so sized leave fewer than eight tasks per thread (1 at
// least). Fewer, larger tasks share what they read; enough of them keep every thread
// busy to the end.
inline int64_t blocks_per_task(int64_t most, int64_t rows, int64_t blocks, int threads) {
  int64_t group = most;
  while (group > 1 && rows * ((blocks + group - 1) / group) < 8 * threads) group /= 2;
  return group;
}

// Task indices [0, total) by decreasing cost(task), ties in index order: the
// costliest start first, so the last ones to start are short.
template <class Cost>
std::vector<int64_t> costliest_first(int64_t total, const Cost& cost) {
  std::vector<int64_t> costs(total), order(total);
  for (int64_t t = 0; t < total; ++t) costs[t] = cost(t);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t c) { return costs[a] > costs[c]; });
  return order;
}

// Tasks [0, total) dealt into at most `count` lanes, costliest first, each to the lane
// whose cost so far is least (ties: the lower lane; LPT scheduling), each lane's tasks
// in the order dealt. The split depends on the costs and the count only, never on which
// thread finishes first: what a lane sums, it sums in the same order on every run.
template <class Cost>
std::vector<std::vector<int64_t>> fixed_lanes(int64_t total, int count, const Cost& cost) {
  std::vector<int64_t> costs(total);
  for (int64_t t = 0; t < total; ++t) costs[t] = cost(t);
  const std::vector<int64_t> order = costliest_first(total, [&](int64_t t) { return costs[t]; });
  const int64_t n = std::max<int64_t>(1, std::min<int64_t>(count, total));
  std::vector<std::vector<int64_t>> lanes(n);
  std::vector<int64_t> load(n, 0);
  for (int64_t t : order) {
    const int64_t lane = std::min_element(load.begin(), load.end()) - load.begin();
    lanes[lane].push_back(t);
    load[lane] += std::max<int64_t>(costs[t], 1);  // a task that computes nothing still writes
  }
  return lanes;
}

}  // namespace
