// ThreadPool: a small persistent pool for the CPU kernels. run(n, fn) calls
// fn(item, worker) for item in [0, n) on up to num_threads threads (the caller
// is worker 0) with dynamic (atomic counter) scheduling, and returns when all
// items are done. Idle workers sleep on a condition variable, so they do not
// compete with torch's own threads between calls.
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
  // replaces it, while callers still holding the old one finish on it.
  static std::shared_ptr<ThreadPool> get(int num_threads);

 private:
  void worker_loop(int worker_id);
  void stop_all();
  void drain(int worker_id);

  std::vector<std::thread> workers_;
  std::mutex run_mu_;  // one run() at a time
  std::mutex mu_;
  std::condition_variable cv_start_, cv_done_;
  const std::function<void(int64_t, int)>* fn_ = nullptr;
  int64_t num_items_ = 0;
  std::atomic<int64_t> next_{0};
  int active_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

}  // namespace cpu
}  // namespace pagedserve
