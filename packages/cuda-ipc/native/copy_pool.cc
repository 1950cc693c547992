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

bool CopyPool::Run(uint32_t n, Fn fn, void* ctx) {
  if (n <= 1) {
    fn(0, ctx);
    return true;
  }
  if (n - 1 > kMaxThreads) n = kMaxThreads + 1;
  try {
    while (threads_.size() < n - 1) {
      uint32_t index = static_cast<uint32_t>(threads_.size()) + 1;
      threads_.emplace_back([this, index] { Loop(index); });
    }
  } catch (...) {
    if (threads_.empty()) return false;
    n = static_cast<uint32_t>(threads_.size()) + 1;
  }
  {
    std::lock_guard<std::mutex> l(mu_);
    fn_ = fn;
    ctx_ = ctx;
    shares_ = n;
    pending_.store(n - 1, std::memory_order_relaxed);
    epoch_++;
  }
  wake_.notify_all();
  fn(0, ctx);
  // The other shares: spin briefly (they usually end about when this one does), then sleep.
  for (uint32_t spins = 0; pending_.load(std::memory_order_acquire) != 0; spins++) {
    if (spins < 2000) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    } else if (spins < 2100) {
      sched_yield();
    } else {
      std::unique_lock<std::mutex> l(mu_);
      done_cv_.wait(l, [this] { return pending_.load(std::memory_order_acquire) == 0; });
      break;
    }
  }
  return true;
}

void CopyPool::Loop(uint32_t index) {
  uint64_t seen = 0;
  for (;;) {
    Fn fn;
    void* ctx;
    {
      std::unique_lock<std::mutex> l(mu_);
      wake_.wait(l, [&] { return stop_ || epoch_ != seen; });
      if (stop_) return;
      seen = epoch_;
      if (index >= shares_) continue;  // not part of this Run
      fn = fn_;
      ctx = ctx_;
    }
    fn(index, ctx);
    // Release: this share's copies (and loads) happen before Run sees pending reach 0.
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> l(mu_);
      done_cv_.notify_one();
    }
  }
}

}  // namespace tw
