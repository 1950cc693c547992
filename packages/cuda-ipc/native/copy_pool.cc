#include "copy_pool.h"

#include <sched.h>

namespace tw {

CopyPool::~CopyPool() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : threads_) t.join();
}

void CopyPool::Drain(Fn fn, void* ctx, uint32_t pieces) {
  for (;;) {
    uint32_t p = next_.fetch_add(1, std::memory_order_relaxed);
    if (p >= pieces) return;
    fn(p, ctx);
  }
}

void CopyPool::Run(uint32_t pieces, uint32_t threads, Fn fn, void* ctx) {
  // One Run at a time: a caller that finds the pool serving another copy (one off the
  // JavaScript thread, or one on it) copies its pieces itself.
  std::unique_lock<std::mutex> busy(run_mu_, std::try_to_lock);
  if (!busy.owns_lock()) {
    for (uint32_t p = 0; p < pieces; p++) fn(p, ctx);
    return;
  }
  uint32_t helpers = threads < pieces ? threads : pieces;
  helpers = helpers > 0 ? helpers - 1 : 0;
  if (helpers > kMaxThreads) helpers = kMaxThreads;
  if (threads_.size() < helpers && !spawn_failed_) {
    try {
      while (threads_.size() < helpers) threads_.emplace_back([this] { Loop(); });
    } catch (...) {
      // Out of threads: run with those there are from now on (none: the caller copies every
      // piece), rather than trying again on every batch.
      spawn_failed_ = true;
    }
  }
  if (helpers > threads_.size()) helpers = static_cast<uint32_t>(threads_.size());
  if (helpers == 0) {
    for (uint32_t p = 0; p < pieces; p++) fn(p, ctx);
    return;
  }
  {
    std::lock_guard<std::mutex> l(mu_);
    fn_ = fn;
    ctx_ = ctx;
    pieces_ = pieces;
    seats_ = helpers;
    next_.store(0, std::memory_order_relaxed);
    epoch_++;
  }
  for (uint32_t i = 0; i < helpers; i++) wake_.notify_one();
  Drain(fn, ctx, pieces);
  {
    // Close the Run: a pool thread that wakes from now on does not join it.
    std::lock_guard<std::mutex> l(mu_);
    fn_ = nullptr;
    ctx_ = nullptr;
  }
  // Pool threads still inside are finishing their last piece: spin briefly, then sleep.
  for (uint32_t spins = 0; inside_.load(std::memory_order_acquire) != 0; spins++) {
    if (spins < 2000) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    } else if (spins < 2100) {
      sched_yield();
    } else {
      std::unique_lock<std::mutex> l(mu_);
      left_cv_.wait(l, [this] { return inside_.load(std::memory_order_acquire) == 0; });
      break;
    }
  }
}

void CopyPool::Loop() {
  uint64_t seen = 0;
  for (;;) {
    Fn fn;
    void* ctx;
    uint32_t pieces;
    {
      std::unique_lock<std::mutex> l(mu_);
      wake_.wait(l, [&] { return stop_ || (fn_ != nullptr && epoch_ != seen && seats_ > 0); });
      if (stop_) return;
      seen = epoch_;
      seats_--;
      // Counted under the mutex, so the Run cannot close and return without waiting for us.
      inside_.fetch_add(1, std::memory_order_relaxed);
      fn = fn_;
      ctx = ctx_;
      pieces = pieces_;
    }
    Drain(fn, ctx, pieces);
    // Release: this thread's copies (and loads) happen before Run sees inside_ reach 0.
    if (inside_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> l(mu_);
      left_cv_.notify_one();
    }
  }
}

}  // namespace tw
