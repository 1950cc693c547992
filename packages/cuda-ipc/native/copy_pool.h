// A small persistent pool of copy threads for large batches (copyBatch's `threads`). No
// Node-API here: the Addon owns one per environment and joins it on teardown.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace tw {

// Runs fn(share, ctx) for share 0..n-1 at once: share 0 on the calling thread, the others on
// pool threads; Run returns only after every share has returned (so nothing the shares touch
// is used by a pool thread after Run: a batch leaves its grants only after that). One Run at a
// time per pool (copyBatch is synchronous on its JS thread, and a pool belongs to one
// environment). The dispatch (mutex) orders the caller's earlier loads and stores before each
// share; each share's end is a release store that Run acquires.
class CopyPool {
 public:
  using Fn = void (*)(uint32_t share, void* ctx);
  // Threads beyond the caller, at most.
  static constexpr uint32_t kMaxThreads = 15;
  CopyPool() = default;
  ~CopyPool();
  CopyPool(const CopyPool&) = delete;
  CopyPool& operator=(const CopyPool&) = delete;
  // n >= 1 shares; pool threads are started on first need (n - 1 of them, up to kMaxThreads).
  // Returns false (nothing ran) when a thread could not be started; the caller then copies inline.
  bool Run(uint32_t n, Fn fn, void* ctx);
  uint32_t started() const { return static_cast<uint32_t>(threads_.size()); }

 private:
  void Loop(uint32_t index);
  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable done_cv_;
  std::vector<std::thread> threads_;
  uint64_t epoch_ = 0;    // under mu_: bumped per Run
  uint32_t shares_ = 0;   // under mu_: shares of the current Run
  Fn fn_ = nullptr;
  void* ctx_ = nullptr;
  std::atomic<uint32_t> pending_{0};
  bool stop_ = false;
};

}  // namespace tw
