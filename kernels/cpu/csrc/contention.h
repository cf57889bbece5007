// How many of the fused stack's team threads (team.h) a step should run, given what other
// processes take of the CPUs this process may use.
//
// Why: a team step waits for every thread at each of its ~150 kernels. A thread that shares
// its CPU with a process that wants that CPU whole (a busy neighbour on a shared host, a
// hypervisor's other guest) runs a time slice at a time: thread 0 waits for it, or does its
// chunks after a spin, in every kernel. On CPUs the neighbours leave free, fewer threads do
// better than the whole team (benchmarks/RESULTS.md, "CPU contention").
//
// How it tells: every kPeriodNs of steps thread 0 reads the busy time of the CPUs in its
// affinity mask (/proc/stat; steal included) and this process's own CPU time
// (CLOCK_PROCESS_CPUTIME_ID). Busy minus own, over the wall time between the reads, is the
// CPUs that others took: `foreign`. Two properties make this the signal rather than the
// team's own stalls (thread 0 waiting past the spin on a worker's chunk):
// - this process's own threads never count: the HTTP event loop, which takes a core now and
//   then at 16 rows a step and stalls a worker, is not a neighbour;
// - running narrow does not hide the neighbour: the CPU a narrow team leaves is taken by the
//   neighbour, which then shows whole. So there is no need to probe the wide team again.
//
// Invariants:
// - The threads a step runs are between 1 and the team's size; they change only at a sample,
//   and narrowing and widening have thresholds apart (kNarrowAt, kWidenAt), so that a
//   neighbour near one does not make the team flap between sizes every period.
// - A sample spanning more than kStaleNs that began before an idle gap of more than kStaleNs
//   (no step ran: the server was idle; or this is the first step) is not used: it starts a
//   new period. One long step (a long prompt beside a neighbour takes seconds) is no gap: its
//   period is used, or the team would never narrow for a run of such steps.
// - Where /proc/stat cannot be read (not Linux, a sandbox), the team is never narrowed.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <fcntl.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>
#endif

namespace pagedserve_cpu {

class CpuContention {
 public:
  static constexpr int64_t kPeriodNs = 200'000'000;  // 20 USER_HZ ticks on each CPU
  static constexpr int64_t kStaleNs = 2'000'000'000;
  // Others hold a CPU once they take kNarrowAt of one (a second at 1 + kNarrowAt, ...), and
  // give it back once they take kWidenAt or less. Why these: while the team is whole, its
  // worker takes part of the neighbour's CPU, so a busy neighbour shows as less than a whole
  // CPU (the worker's share); once narrowed, it shows whole, far from kWidenAt.
  static constexpr double kNarrowAt = 0.5;
  static constexpr double kWidenAt = 0.3;

  // Thread 0, before a step of `team` threads (a team step, or a larger one that would run
  // parallel regions of that many threads): how many of them to run (>= 1).
  int64_t threads_for_step(int64_t team) {
    if (team <= 1) return 1;
    // Sampled whether or not it decides (read() reports it either way).
    const int64_t now = now_ns();
    if (now >= next_sample_ns_.load(std::memory_order_relaxed)) {
      std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
      if (lock.owns_lock()) {
        next_sample_ns_.store(now + kPeriodNs, std::memory_order_relaxed);
        sample(now, team);
      }
    }
    const int64_t forced = forced_.load(std::memory_order_relaxed);
    const int64_t active = active_.load(std::memory_order_relaxed);
    int64_t threads = team;
    if (forced > 0) threads = std::min(forced, team);
    else if (enabled_.load(std::memory_order_relaxed) && active > 0) threads = std::clamp<int64_t>(active, 1, team);
    last_threads_.store(threads, std::memory_order_relaxed);
    return threads;
  }

  // Thread 0, after each step it asked threads_for_step about: when the process last ran one.
  void step_done() { last_step_end_ns_.store(now_ns(), std::memory_order_relaxed); }

  bool set_enabled(bool on) {
    const bool before = enabled_.exchange(on);
    std::lock_guard<std::mutex> lock(mutex_);
    last_ = Reading{};
    next_sample_ns_.store(INT64_MIN);
    active_.store(0);  // 0: the whole team, until a sample says otherwise
    return before;
  }

  // n > 0: every team step runs min(n, team) threads, whatever the neighbours do (tests, A/B
  // measurements); 0: the samples decide. Returns the previous value.
  int64_t force(int64_t n) { return forced_.exchange(std::max<int64_t>(n, 0)); }

  // Threads the last team step ran (0: none yet).
  int64_t last_threads() const { return last_threads_.load(std::memory_order_relaxed); }
  // What force() set (0: the samples decide).
  int64_t forced() const { return forced_.load(std::memory_order_relaxed); }

  // [threads the last team step ran (0: none yet), CPUs others took in the last period,
  // periods sampled, periods that ended with the team narrowed]
  std::vector<double> read() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {double(last_threads_.load()), foreign_, double(samples_), double(narrow_samples_)};
  }

 private:
  struct Reading {
    int64_t wall_ns = INT64_MIN / 2;
    double busy_s = 0, own_s = 0;
    int64_t cpus = 0;
    bool ok = false;
  };

  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  void sample(int64_t now, int64_t team) {
    Reading r = take(now);
    const Reading before = std::exchange(last_, r);
    const bool idle = now - last_step_end_ns_.load(std::memory_order_relaxed) > kStaleNs;
    if (!r.ok || !before.ok || r.cpus != before.cpus || (now - before.wall_ns > kStaleNs && idle)) return;
    const double wall = double(now - before.wall_ns) * 1e-9;
    foreign_ = std::max(0.0, (r.busy_s - before.busy_s) - (r.own_s - before.own_s)) / wall;
    ++samples_;
    if (!enabled_.load(std::memory_order_relaxed)) return;
    int64_t active = active_.load(std::memory_order_relaxed);
    if (active <= 0) active = team;
    const auto left = [&](double held_at) {  // CPUs others leave, counting a CPU held from `held_at`
      return std::clamp<int64_t>(r.cpus - int64_t(std::floor(foreign_ + 1.0 - held_at)), 1, team);
    };
    if (left(kNarrowAt) < active) active = left(kNarrowAt);
    else if (left(kWidenAt) > active) active = left(kWidenAt);
    active_.store(active, std::memory_order_relaxed);
    if (active < team) ++narrow_samples_;
  }

  // The busy seconds of the CPUs in this thread's affinity mask and the process's CPU time.
  static Reading take(int64_t now) {
    Reading r;
    r.wall_ns = now;
#if defined(__linux__)
    cpu_set_t mask;
    CPU_ZERO(&mask);
    if (sched_getaffinity(0, sizeof(mask), &mask) != 0) return r;
    timespec own{};
    if (clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &own) != 0) return r;
    r.own_s = double(own.tv_sec) + double(own.tv_nsec) * 1e-9;
    const int fd = open("/proc/stat", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return r;
    std::string text;
    char buf[8192];
    for (ssize_t n; (n = ::read(fd, buf, sizeof(buf))) > 0;) text.append(buf, size_t(n));
    close(fd);
    static const double tick = double(sysconf(_SC_CLK_TCK) > 0 ? sysconf(_SC_CLK_TCK) : 100);
    // Lines "cpuN user nice system idle iowait irq softirq steal guest guest_nice"; guest time
    // is already in user. The first line ("cpu ") is the total: skipped.
    const char* p = text.c_str();
    while (*p) {
      const char* eol = p;
      while (*eol && *eol != '\n') ++eol;
      if (eol - p > 3 && p[0] == 'c' && p[1] == 'p' && p[2] == 'u' && p[3] >= '0' && p[3] <= '9') {
        char* q = nullptr;
        const long cpu = std::strtol(p + 3, &q, 10);
        if (cpu >= 0 && cpu < CPU_SETSIZE && CPU_ISSET(int(cpu), &mask)) {
          unsigned long long f[8] = {};
          for (int i = 0; i < 8 && q < eol; ++i) f[i] = std::strtoull(q, &q, 10);
          const unsigned long long busy = f[0] + f[1] + f[2] + f[5] + f[6] + f[7];  // not idle, iowait
          r.busy_s += double(busy) / tick;
          ++r.cpus;
        }
      }
      p = *eol ? eol + 1 : eol;
    }
    r.ok = r.cpus > 0;
#endif
    return r;
  }

  std::atomic<bool> enabled_{true};
  std::atomic<int64_t> forced_{0};
  std::atomic<int64_t> last_threads_{0};
  std::atomic<int64_t> active_{0};
  std::atomic<int64_t> next_sample_ns_{INT64_MIN};
  std::atomic<int64_t> last_step_end_ns_{INT64_MIN / 2};
  std::mutex mutex_;  // the rest: thread 0's between samples, guarded for read()
  Reading last_;
  double foreign_ = 0;
  int64_t samples_ = 0, narrow_samples_ = 0;
};

}  // namespace pagedserve_cpu
