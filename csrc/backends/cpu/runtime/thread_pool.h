// ThreadPool: a small persistent pool for the CPU kernels. run(n, fn) calls
// fn(item, worker) for item in [0, n) on up to num_threads threads (the caller
// is worker 0) with dynamic (atomic counter) scheduling, and returns when all
// items are done. Idle workers sleep on a condition variable, so they do not
// compete with torch's own (OpenMP) threads between calls. With
// set_spin_micros(us > 0) a worker that finished, and a caller waiting for the
// workers, first poll for that long (a pause instruction per poll) before they
// sleep: when our kernels make most of a step's calls back to back (the
// quantised decode makes ~150), waking a sleeping thread costs more than a
// small call's work. When torch's GEMMs run between our calls, spinning takes
// the cores from OpenMP's threads (docs/benchmarks.md, "Behind the code"), so it is off by default and
// the engine turns it on only for the quantised path (OpenMP's blocktime is
// the same idea).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace pagedserve {
namespace cpu {

class ThreadPool {
 public:
  // Starts num_threads - 1 workers. Rethrows std::system_error if the OS
  // refuses a thread (after joining the ones started).
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }
  // Runs fn(item, worker_id) for every item; rethrows the first exception.
  // Calls from several threads are serialised.
  void run(int64_t num_items, const std::function<void(int64_t, int)>& fn);

  // A process-wide pool of num_threads (>= 1) threads; asking for another size
  // replaces it, while callers still holding the old one finish on it. Throws
  // KernelArgumentError ("cannot start N worker threads: ...") if the OS refuses
  // a thread, so every kernel reports it the same way.
  static std::shared_ptr<ThreadPool> get(int num_threads);

  // How long idle workers and waiting callers poll before sleeping (process-wide;
  // 0, the default: they sleep at once). Negative values count as 0.
  static void set_spin_micros(int micros);
  static int spin_micros();

 private:
  void worker_loop(int worker_id);
  void stop_all();
  void drain(int worker_id);

  std::vector<std::thread> workers_;
  std::mutex run_mu_;  // one run() at a time
  std::mutex mu_;
  std::condition_variable cv_start_, cv_done_;
  const std::function<void(int64_t, int)>* fn_ = nullptr;  // published by generation_ (release/acquire)
  int64_t num_items_ = 0;
  std::atomic<int64_t> next_{0};
  std::atomic<int> active_{0};            // workers still in the current run
  std::atomic<uint64_t> generation_{0};  // bumped (under mu_) by each run that wakes workers
  std::atomic<bool> stop_{false};
  std::exception_ptr error_;
};

}  // namespace cpu
}  // namespace pagedserve
