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

// Runs fn(piece, ctx) exactly once for every piece in [0, pieces). The calling thread starts on
// the pieces at once; up to `threads - 1` pool threads are woken and join it when they get a
// core. Every participant claims the next piece from one atomic counter, so the caller never
// waits for a piece nobody has started: a pool thread that is slow to wake (a busy host) finds
// the pieces taken and leaves, and the caller ends up copying them itself. Run returns only
// after every piece has returned and no pool thread is inside this Run any more (nothing the
// pieces touch is used by a pool thread after Run: a batch leaves its grants only after that).
// One Run at a time per pool: a Run that finds another one open (a copy on the JS thread and one
// off it, copyPlannedAsync) runs every piece on its calling thread instead. The mutex orders the
// caller's earlier loads and stores before every piece a pool thread runs; a pool thread's
// leaving is a release that Run acquires.
class CopyPool {
 public:
  using Fn = void (*)(uint32_t piece, void* ctx);
  // Threads beyond the caller, at most.
  static constexpr uint32_t kMaxThreads = 15;
  CopyPool() = default;
  ~CopyPool();
  CopyPool(const CopyPool&) = delete;
  CopyPool& operator=(const CopyPool&) = delete;
  // Pool threads are started on first need (up to min(threads, pieces) - 1, at most
  // kMaxThreads). When one cannot be started, the pool keeps those it has and tries no more;
  // with none, the caller runs every piece.
  void Run(uint32_t pieces, uint32_t threads, Fn fn, void* ctx);

 private:
  void Loop();
  // Claim and run pieces until none is left.
  void Drain(Fn fn, void* ctx, uint32_t pieces);
  std::mutex mu_;
  // Held by the open Run (try-locked: a second caller copies alone rather than wait).
  std::mutex run_mu_;
  std::condition_variable wake_;
  std::condition_variable left_cv_;
  std::vector<std::thread> threads_;
  // Under mu_: the open Run (fn_ null when none), its number, how many pool threads may still join.
  Fn fn_ = nullptr;
  void* ctx_ = nullptr;
  uint32_t pieces_ = 0;
  uint64_t epoch_ = 0;
  uint32_t seats_ = 0;
  bool stop_ = false;
  // Under run_mu_: a thread could not be started once, so no more are tried.
  bool spawn_failed_ = false;
  std::atomic<uint32_t> next_{0};    // the next unclaimed piece of the open Run
  std::atomic<uint32_t> inside_{0};  // pool threads inside the open Run
};

}  // namespace tw
