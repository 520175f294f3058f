#include "backends/cpu/runtime/thread_pool.h"

#include <chrono>
#include <string>
#include <system_error>

#include "core/errors.h"
#include "backends/cpu/runtime/cpu_relax.h"

namespace pagedserve {
namespace cpu {
namespace {

std::atomic<int> g_spin_micros{0};

// Polls done() for up to spin_micros() microseconds; true if it became true.
template <typename Done>
bool spin_until(Done done) {
  const int micros = g_spin_micros.load(std::memory_order_relaxed);
  if (micros <= 0) return done();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(micros);
  while (true) {
    for (int i = 0; i < 64; ++i) {
      if (done()) return true;
      PAGEDSERVE_CPU_RELAX();
    }
    if (std::chrono::steady_clock::now() >= deadline) return done();
  }
}

}  // namespace

void ThreadPool::set_spin_micros(int micros) { g_spin_micros.store(micros < 0 ? 0 : micros); }
int ThreadPool::spin_micros() { return g_spin_micros.load(); }

ThreadPool::ThreadPool(int num_threads) {
  try {
    for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
  } catch (...) {  // the OS refused a thread: stop the ones started, then report
    stop_all();
    throw;
  }
}

ThreadPool::~ThreadPool() { stop_all(); }

void ThreadPool::stop_all() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true);
  }
  cv_start_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
}

void ThreadPool::drain(int worker_id) {
  for (int64_t i; (i = next_.fetch_add(1)) < num_items_;) {
    try {
      (*fn_)(i, worker_id);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_) error_ = std::current_exception();
      next_ = num_items_;  // stop handing out work
    }
  }
}

void ThreadPool::worker_loop(int worker_id) {
  uint64_t seen = 0;
  while (true) {
    const auto started = [&] { return stop_.load() || generation_.load(std::memory_order_acquire) != seen; };
    if (!spin_until(started)) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_start_.wait(lock, started);
    }
    if (stop_.load()) return;
    seen = generation_.load(std::memory_order_acquire);
    drain(worker_id);
    if (active_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lock(mu_);  // the caller may be between its check and its wait
      cv_done_.notify_one();
    }
  }
}

void ThreadPool::run(int64_t num_items, const std::function<void(int64_t, int)>& fn) {
  if (num_items <= 0) return;
  std::lock_guard<std::mutex> serial(run_mu_);
  if (workers_.empty() || num_items == 1) {
    for (int64_t i = 0; i < num_items; ++i) fn(i, 0);
    return;
  }
  // every worker of the previous run has finished (active_ was 0): nobody reads these now
  fn_ = &fn;
  num_items_ = num_items;
  next_.store(0);
  error_ = nullptr;
  active_.store(static_cast<int>(workers_.size()));
  {
    std::lock_guard<std::mutex> lock(mu_);  // a worker between its check and its wait cannot miss this
    generation_.fetch_add(1, std::memory_order_release);
  }
  cv_start_.notify_all();
  drain(0);
  const auto done = [&] { return active_.load(std::memory_order_acquire) == 0; };
  if (!spin_until(done)) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_done_.wait(lock, done);
  }
  fn_ = nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  if (error_) std::rethrow_exception(error_);
}

std::shared_ptr<ThreadPool> ThreadPool::get(int num_threads) {
  static std::mutex mu;
  static std::shared_ptr<ThreadPool> pool;
  std::lock_guard<std::mutex> lock(mu);
  if (num_threads < 1) num_threads = 1;
  if (!pool || pool->num_threads() != num_threads) {
    try {
      pool = std::make_shared<ThreadPool>(num_threads);
    } catch (const std::system_error& e) {
      throw KernelArgumentError("cannot start " + std::to_string(num_threads) + " worker threads: " + e.what());
    }
  }
  return pool;
}

}  // namespace cpu
}  // namespace pagedserve
