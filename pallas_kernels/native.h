// What the native CPU kernels share (see native.py): the FFI header and a parallel loop over XLA's
// intra-op threads.
#pragma once

#include <algorithm>
#include <atomic>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

namespace ffi = xla::ffi;

// Runs fn(0) ... fn(total - 1) on the calling thread and the pool's threads. Units are taken from a
// shared counter, so a pool thread that starts late (busy with other work of the step) finds none
// left and returns at once, and the caller waits only for units that another thread is running:
// no wait on a task still queued, which could otherwise deadlock a pool whose threads all wait.
template <typename F>
void ParallelFor(ffi::ThreadPool& pool, int total, const F& fn) {
  const int threads = static_cast<int>(pool.num_threads());
  if (threads <= 1 || total <= 1) {
    for (int i = 0; i < total; ++i) fn(i);
    return;
  }
  struct Shared {
    std::atomic<int> next{0};
    std::atomic<int> done{0};
    int total = 0;
    const F* fn = nullptr;
  };
  auto shared = std::make_shared<Shared>();
  shared->total = total;
  shared->fn = &fn;
  auto run = [](Shared& s) {
    for (int i; (i = s.next.fetch_add(1, std::memory_order_relaxed)) < s.total;) {
      (*s.fn)(i);
      s.done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int h = 0; h < std::min(threads, total) - 1; ++h) pool.Schedule([shared, run] { run(*shared); });
  run(*shared);
  while (shared->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
}

}  // namespace jaxserve
