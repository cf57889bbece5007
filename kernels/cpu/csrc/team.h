// One OpenMP team held for a whole decoder_layers call, its work handed out by spinning
// threads instead of a parallel region a kernel.
//
// Why: every at::parallel_for opens an OpenMP parallel region and joins it; with the other
// thread already spinning that costs ~1.7 us on these machines (a 2-panel one-row matmul
// took 3.6 us against 1.9 for 1 panel, which runs inline). A batch-1 decode step of the
// default model runs ~150 such regions (four matmuls and attention a layer, the head): ~0.25
// ms of a ~5.3 ms step. Inside a team, thread 0 runs the stack as before and each parallel
// kernel publishes its range on one cache line that the other threads spin on; handing out
// and joining a kernel then costs a cache line's round trip between the cores.
//
// Invariants:
// - Work is split exactly as at::parallel_for splits it (chunks of ceil(n / threads), thread
//   t the t-th), so a kernel's output is the same, bit for bit, with or without a team.
// - Only thread 0 publishes; it waits for every worker to finish one range before it
//   publishes the next, so the function a range points to is alive while a worker runs it.
// - The team lives inside one decoder_layers call: nothing spins between steps.
// - Inside the team at::in_parallel_region() is true on every thread, so an ATen op a kernel
//   calls runs on the calling thread alone: decoder_layers uses a team only for small steps,
//   whose kernels are all this extension's own (g_team_rows in decoder_layer.cpp).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <thread>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace pagedserve_cpu {

inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

class Team {
 public:
  // Threads in the team, thread 0 included: set by thread 0 before it publishes a range (the
  // workers never read it).
  void set_size(int64_t size) { size_ = size; }
  int64_t size() const { return size_; }

  // fn(begin, end) over [begin, end), as at::parallel_for(begin, end, grain, fn) would run it.
  template <class F>
  void run(int64_t begin, int64_t end, int64_t grain, const F& fn) {
    if (begin >= end) return;
    const int64_t n = end - begin;
    if (n <= grain || n <= 1 || size_ <= 1) {  // at::parallel_for runs these inline too
      fn(begin, end);
      return;
    }
    const int64_t parts = grain > 0 ? std::min(size_, (n + grain - 1) / grain) : size_;
    begin_ = begin;
    end_ = end;
    chunk_ = (n + parts - 1) / parts;
    ctx_ = &fn;
    call_ = [](const void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); };
    pending_.store(size_ - 1, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
    std::exception_ptr mine;
    try {
      fn(begin, std::min(end, begin + chunk_));
    } catch (...) {
      mine = std::current_exception();
    }
    wait_until([&] { return pending_.load(std::memory_order_acquire) == 0; });
    if (mine) std::rethrow_exception(mine);
    if (error_) {
      error_claimed_.clear();
      std::rethrow_exception(std::exchange(error_, nullptr));
    }
  }

  // Threads 1..size-1: run thread `tid`'s share of each published range until stop().
  void serve(int64_t tid) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t g = 0;
      wait_until([&] { return (g = generation_.load(std::memory_order_acquire)) != seen; });
      seen = g;
      if (stopping_) return;
      const int64_t b = begin_ + tid * chunk_;
      if (b < end_) {
        try {
          call_(ctx_, b, std::min(end_, b + chunk_));
        } catch (...) {
          if (!error_claimed_.test_and_set()) error_ = std::current_exception();
        }
      }
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  // Thread 0, once its work is done: releases the workers from serve().
  void stop() {
    stopping_ = true;
    generation_.fetch_add(1, std::memory_order_release);
  }

 private:
  // Spins (the wait is a kernel's length, microseconds), yielding now and then so that a
  // team larger than the cores it gets still moves.
  template <class Done>
  static void wait_until(const Done& done) {
    for (uint32_t spins = 0; !done(); ++spins) {
      spin_pause();
      if ((spins & 0xffff) == 0xffff) std::this_thread::yield();
    }
  }

  int64_t size_ = 1;
  // The published range; written by thread 0 before generation_ moves, read after.
  int64_t begin_ = 0, end_ = 0, chunk_ = 0;
  const void* ctx_ = nullptr;
  void (*call_)(const void*, int64_t, int64_t) = nullptr;
  bool stopping_ = false;
  std::exception_ptr error_;
  std::atomic_flag error_claimed_ = ATOMIC_FLAG_INIT;
  alignas(64) std::atomic<uint64_t> generation_{0};
  alignas(64) std::atomic<int64_t> pending_{0};
};

// The team the calling thread leads (set by decoder_layers on its thread 0), or null.
Team*& current_team();

// at::parallel_for, through the calling thread's team when it leads one.
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& fn) {
  if (Team* team = current_team()) team->run(begin, end, grain, fn);
  else at::parallel_for(begin, end, grain, fn);
}

// The threads a kernel splits its work over: its team's, or ATen's.
inline int64_t num_threads() {
  const Team* team = current_team();
  return team ? team->size() : at::get_num_threads();
}

}  // namespace pagedserve_cpu
