// One OpenMP team held for a whole decoder_layers call, its work handed out through one
// cache line instead of a parallel region a kernel.
//
// Why: every at::parallel_for opens an OpenMP parallel region and joins it, which costs
// about as much as a small one-row matmul itself, even with the other thread already
// spinning. A batch-1 decode step runs several such regions a layer (four matmuls and
// attention, then the head), enough to be a visible share of the step. Inside a team,
// thread 0 runs the stack as before and each parallel kernel publishes its range on one
// cache line that the other threads watch; handing out and joining a kernel then costs a
// cache line's round trip between the cores.
//
// Sharing a host: a worker that has lost its core (another process wants it, or the team is
// larger than the CPUs it gets) must not hold thread 0 up. So the chunks of a range are
// claimed, not assigned: thread 0 takes the first, and then, like every worker, claims any
// chunk still unclaimed; a descheduled worker claims nothing and thread 0 does its share.
// And nobody spins for long: a waiting thread spins for spin_ns() (a kernel's gap) and then
// sleeps on a futex, so that a core left idle by a waiter can run the thread it waits for.
// A team narrowed to one thread (contention.h) runs solo (set_solo): thread 0 runs every
// chunk, in the same split, with no region and nobody to wait for.
// It does not spin at all when the thread it waits for last ran on its own CPU: spinning
// there only keeps that thread from running (after a busy neighbour went away, two threads
// of the team left on one CPU slowed batch-1 steps several times over until they did not
// spin).
//
// Invariants:
// - Work is split exactly as at::parallel_for splits it (chunks of ceil(n / threads)), so a
//   kernel's output is the same, bit for bit, with or without a team, whichever thread runs
//   a chunk: no kernel's result depends on the thread that computes a range.
// - Only thread 0 publishes, and it waits until every chunk of a range is done before it
//   publishes the next, so the function and range a claimed chunk points to are alive while
//   it runs. A chunk is claimed by one compare-and-swap on `claim_`, which holds the range's
//   generation beside its counters: a worker that wakes late cannot claim a chunk of a range
//   other than the one it read.
// - The team lives inside one decoder_layers call: nothing waits between steps.
// - Inside the team at::in_parallel_region() is true on every thread, so an ATen op a kernel
//   calls runs on the calling thread alone: decoder_layers uses a team for small steps, whose
//   kernels are all this extension's own (g_team_rows in decoder_layer.cpp), and for larger
//   ones only while narrowed (contention.h), where a region's thread beside a neighbour
//   would cost more than an ATen op (a few lookups and copies) on one thread.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstdint>
#include <exception>
#include <memory>
#include <thread>
#include <utility>

#if defined(__linux__)
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace pagedserve_cpu {

inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// Sleep while *word == expected (or until a wake-up, or spuriously: callers re-check).
inline void futex_wait(std::atomic<uint32_t>& word, uint32_t expected) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
#else
  if (word.load(std::memory_order_acquire) == expected) std::this_thread::yield();
#endif
}

// The CPU the calling thread runs on, or -1 where unknown.
inline int32_t current_cpu() {
#if defined(__linux__)
  return sched_getcpu();
#else
  return -1;
#endif
}

inline void futex_wake_all(std::atomic<uint32_t>& word) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
#else
  (void)word;
#endif
}

// The chunk length at::parallel_for(begin, begin + n, grain, fn) cuts over `threads`
// threads (n > grain, n > 1, threads > 1): ceil(n / parts) for parts = min(threads,
// ceil(n / grain)).
inline int64_t split_chunk(int64_t n, int64_t grain, int64_t threads) {
  const int64_t parts = grain > 0 ? std::min(threads, (n + grain - 1) / grain) : threads;
  return (n + parts - 1) / parts;
}

class Team {
 public:
  // max_threads: the most threads the OpenMP region may have (its size() is at most this).
  explicit Team(int64_t max_threads) : slots_(new Slot[size_t(std::max<int64_t>(max_threads, 1))]) {}

  // How long a waiting thread spins before it sleeps: longer than the gap between two
  // kernels of a step (a few microseconds of thread 0's serial work), far shorter than a
  // scheduler's time slice (milliseconds), which is what a thread that cannot get a core
  // would otherwise burn. PAGEDSERVE_CPU_SPIN_US overrides it (read once).
  static int64_t spin_ns() {
    static const int64_t ns = [] {
      const char* text = std::getenv("PAGEDSERVE_CPU_SPIN_US");
      return text && *text ? int64_t(std::atof(text) * 1e3) : int64_t(50'000);
    }();
    return ns;
  }

  // Threads in the team, thread 0 included: set by thread 0 before it publishes a range (the
  // workers never read it).
  void set_size(int64_t size) { size_ = size; }
  int64_t size() const { return size_; }
  // Thread 0 runs every chunk itself, publishing nothing (no worker serves a solo team).
  void set_solo(bool solo) { solo_ = solo; }

  // fn(begin, end) over [begin, end), as at::parallel_for(begin, end, grain, fn) would run it.
  template <class F>
  void run(int64_t begin, int64_t end, int64_t grain, const F& fn) {
    if (begin >= end) return;
    const int64_t n = end - begin;
    if (n <= grain || n <= 1 || size_ <= 1) {  // at::parallel_for runs these inline too
      fn(begin, end);
      return;
    }
    const int64_t chunk = split_chunk(n, grain, size_);
    const uint64_t chunks = uint64_t((n + chunk - 1) / chunk);  // the non-empty ones
    if (solo_) {  // the same chunks, one after another
      for (int64_t b = begin; b < end; b += chunk) fn(b, std::min(end, b + chunk));
      return;
    }
    begin_ = begin;
    end_ = end;
    chunk_ = chunk;
    ctx_ = &fn;
    call_ = [](const void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); };
    done_.store(0, std::memory_order_relaxed);
    // Chunk 0 is thread 0's: the counter starts at 1.
    next_generation();
    slots_[0].cpu.store(current_cpu(), std::memory_order_relaxed);
    claim_.store(generation_ << 32 | chunks << 16 | 1, std::memory_order_seq_cst);
    wake_workers();
    std::exception_ptr mine;
    try {
      fn(begin, std::min(end, begin + chunk));
    } catch (...) {
      mine = std::current_exception();
    }
    done_.fetch_add(1, std::memory_order_acq_rel);
    // After a throw the range's result is lost anyway: the chunks nobody has claimed yet are
    // only counted, so that the wait below ends.
    if (mine) drain(generation_);
    else work_on(generation_, 0);
    wait_done(uint32_t(chunks));
    if (mine) std::rethrow_exception(mine);
    if (error_) {
      error_claimed_.clear();
      std::rethrow_exception(std::exchange(error_, nullptr));
    }
  }

  // Threads 1..size-1: help with each published range until stop().
  void serve(int64_t tid) {
    // Generation 0 is the team's state before thread 0 publishes anything. A worker may
    // arrive after thread 0 published ranges, or after stop(): it must see those as new.
    uint64_t seen = 0;
    for (;;) {
      uint64_t gen = seen;
      wait_for_range(seen, gen);
      seen = gen;
      if (stopping_.load(std::memory_order_acquire)) return;
      work_on(gen, tid);
    }
  }

  // Thread 0, once its work is done: releases the workers from serve().
  void stop() {
    stopping_.store(true, std::memory_order_release);
    next_generation();
    claim_.store(generation_ << 32, std::memory_order_seq_cst);
    wake_workers();
  }

 private:
  static uint64_t generation_of(uint64_t word) { return word >> 32; }

  // 32 bits in claim_, never 0 (serve()'s starting point).
  void next_generation() {
    generation_ = (generation_ + 1) & 0xffffffffu;
    if (generation_ == 0) generation_ = 1;
  }

  // Thread `tid` claims and runs chunks of range `gen` until none is left unclaimed.
  void work_on(uint64_t gen, int64_t tid) {
    Slot& slot = slots_[size_t(tid)];
    uint64_t word = claim_.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t next = word & 0xffff, chunks = (word >> 16) & 0xffff;
      if (generation_of(word) != gen || next >= chunks) return;
      if (!claim_.compare_exchange_weak(word, word + 1, std::memory_order_acq_rel, std::memory_order_acquire))
        continue;  // `word` now holds the current value
      // Claimed: thread 0 waits for this chunk before it rewrites the range.
      slot.cpu.store(current_cpu(), std::memory_order_relaxed);
      slot.working.store(true, std::memory_order_relaxed);
      const int64_t b = begin_ + int64_t(next) * chunk_;
      try {
        call_(ctx_, b, std::min(end_, b + chunk_));
      } catch (...) {
        if (!error_claimed_.test_and_set()) error_ = std::current_exception();
      }
      slot.working.store(false, std::memory_order_relaxed);
      finish_one();
      word = claim_.load(std::memory_order_acquire);
    }
  }

  // Thread 0 after its own chunk threw: claims what is left without running it.
  void drain(uint64_t gen) {
    uint64_t word = claim_.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t next = word & 0xffff, chunks = (word >> 16) & 0xffff;
      if (generation_of(word) != gen || next >= chunks) return;
      if (claim_.compare_exchange_weak(word, word + 1, std::memory_order_acq_rel, std::memory_order_acquire))
        done_.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  void finish_one() {
    done_.fetch_add(1, std::memory_order_seq_cst);
    if (leader_sleeping_.load(std::memory_order_seq_cst)) futex_wake_all(done_);
  }

  void wake_workers() {
    // Pairs with wait_for_range: a worker announces itself in sleepers_ before it re-reads
    // claim_, and thread 0 stores claim_ before it reads sleepers_ (all seq_cst), so either
    // the worker sees the new range or thread 0 sees the sleeper and wakes it.
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      wake_seq_.fetch_add(1, std::memory_order_seq_cst);
      futex_wake_all(wake_seq_);
    }
  }

  // Until claim_ holds a generation other than `seen`; that generation into `gen`.
  void wait_for_range(uint64_t seen, uint64_t& gen) {
    const auto changed = [&] {
      gen = generation_of(claim_.load(std::memory_order_acquire));
      return gen != seen;
    };
    const int32_t cpu = current_cpu();
    const bool beside_leader = cpu >= 0 && slots_[0].cpu.load(std::memory_order_relaxed) == cpu;
    if (!beside_leader && spin_until(changed)) return;
    for (;;) {
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      const uint32_t seq = wake_seq_.load(std::memory_order_seq_cst);
      const bool ready = changed();
      if (!ready) futex_wait(wake_seq_, seq);
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
      if (ready || changed()) return;
    }
  }

  // Thread 0: until `chunks` chunks of the current range are done.
  void wait_done(uint32_t chunks) {
    const auto all = [&] { return done_.load(std::memory_order_acquire) >= chunks; };
    const int32_t cpu = current_cpu();
    bool beside_worker = false;
    for (int64_t t = 1; t < size_ && cpu >= 0; ++t)
      beside_worker |= slots_[size_t(t)].working.load(std::memory_order_relaxed) &&
                       slots_[size_t(t)].cpu.load(std::memory_order_relaxed) == cpu;
    if (!beside_worker && spin_until(all)) return;
    for (;;) {
      leader_sleeping_.store(true, std::memory_order_seq_cst);
      const uint32_t done = done_.load(std::memory_order_seq_cst);
      if (done < chunks) futex_wait(done_, done);
      leader_sleeping_.store(false, std::memory_order_relaxed);
      if (all()) return;
    }
  }

  // Spins up to spin_ns() for done(); whether it came true.
  template <class Done>
  static bool spin_until(const Done& done) {
    using Clock = std::chrono::steady_clock;
    const auto start = Clock::now();
    const int64_t limit = spin_ns();
    for (uint32_t spins = 1;; ++spins) {
      if (done()) return true;
      spin_pause();
      if ((spins & 63) == 0 &&
          std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count() > limit)
        return done();
    }
  }

  // Where each thread last ran and whether it is running a claimed chunk: hints for whether
  // spinning can help (a stale one costs a spin or a sleep, never correctness).
  struct Slot {
    alignas(64) std::atomic<int32_t> cpu{-1};
    std::atomic<bool> working{false};
  };
  std::unique_ptr<Slot[]> slots_;
  int64_t size_ = 1;
  bool solo_ = false;
  // The published range; written by thread 0 before claim_ moves to its generation, read by
  // a thread only after it claimed one of its chunks.
  int64_t begin_ = 0, end_ = 0, chunk_ = 0;
  const void* ctx_ = nullptr;
  void (*call_)(const void*, int64_t, int64_t) = nullptr;
  uint64_t generation_ = 0;  // thread 0's
  std::atomic<bool> stopping_{false};
  std::exception_ptr error_;
  std::atomic_flag error_claimed_ = ATOMIC_FLAG_INIT;
  // generation << 32 | chunks << 16 | next unclaimed chunk: the one line the workers watch.
  alignas(64) std::atomic<uint64_t> claim_{0};
  alignas(64) std::atomic<uint32_t> done_{0};  // chunks of the current range finished
  std::atomic<bool> leader_sleeping_{false};
  alignas(64) std::atomic<uint32_t> wake_seq_{0};  // the futex sleeping workers wait on
  std::atomic<int32_t> sleepers_{0};
};

// The team the calling thread leads (set by decoder_layers on its thread 0), or null.
Team*& current_team();

// Outside a team: the threads whose split a kernel runs on its calling thread alone, one chunk
// after another, or 0 to run it in an ATen parallel region (decoder_layer.cpp). Nonzero, the
// ATen thread count, while the fused stack's last step ran solo because other processes hold
// this process's other CPUs (contention.h): a kernel called between the stack's steps (the
// head and final norm of a prefill step, the sampler's argmax) would otherwise wait in its
// region for a thread that shares a CPU with the neighbour.
int64_t solo_split();

// at::parallel_for, through the calling thread's team when it leads one, or on the calling
// thread alone in at::parallel_for's chunks while the stack runs solo (solo_split). Either
// way the chunks are at::parallel_for's, so a kernel's output does not depend on the path.
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& fn) {
  if (Team* team = current_team()) {
    team->run(begin, end, grain, fn);
  } else if (const int64_t split = solo_split()) {
    const int64_t n = end - begin;
    if (n <= 0) return;
    if (n <= grain || n <= 1 || split <= 1) return fn(begin, end);  // inline in ATen too
    const int64_t chunk = split_chunk(n, grain, split);
    for (int64_t b = begin; b < end; b += chunk) fn(b, std::min(end, b + chunk));
  } else {
    at::parallel_for(begin, end, grain, fn);
  }
}

// The threads a kernel splits its work over: its team's, or ATen's.
inline int64_t num_threads() {
  const Team* team = current_team();
  return team ? team->size() : at::get_num_threads();
}

}  // namespace pagedserve_cpu
