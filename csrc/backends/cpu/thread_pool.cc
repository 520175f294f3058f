#include "thread_pool.h"

namespace pagedserve {
namespace cpu {

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
    stop_ = true;
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
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_start_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    drain(worker_id);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--active_ == 0) cv_done_.notify_one();
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
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    num_items_ = num_items;
    next_ = 0;
    error_ = nullptr;
    active_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  cv_start_.notify_all();
  drain(0);
  std::unique_lock<std::mutex> lock(mu_);
  cv_done_.wait(lock, [&] { return active_ == 0; });
  fn_ = nullptr;
  if (error_) std::rethrow_exception(error_);
}

std::shared_ptr<ThreadPool> ThreadPool::get(int num_threads) {
  static std::mutex mu;
  static std::shared_ptr<ThreadPool> pool;
  std::lock_guard<std::mutex> lock(mu);
  if (num_threads < 1) num_threads = 1;
  if (!pool || pool->num_threads() != num_threads) pool = std::make_shared<ThreadPool>(num_threads);
  return pool;
}

}  // namespace cpu
}  // namespace pagedserve
