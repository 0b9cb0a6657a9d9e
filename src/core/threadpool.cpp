#include "core/threadpool.h"

#include <algorithm>
#include <cstdlib>

namespace tansy {

ThreadPool::ThreadPool(int n_threads) {
  if (n_threads <= 0) n_threads = int(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 1; i < n_threads; ++i) workers_.emplace_back([this, i] { worker(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

ThreadPool& ThreadPool::global() {
  static ThreadPool pool;
  return pool;
}

static void run_range(const std::function<void(int64_t, int64_t)>& fn, int64_t n, int idx, int parts) {
  int64_t b = n * idx / parts, e = n * (idx + 1) / parts;
  if (b < e) fn(b, e);
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1) {
    fn(0, n);
    return;
  }
  // One job at a time: concurrent callers (server threads) take turns.
  static std::mutex submit_mu;
  std::lock_guard submit(submit_mu);
  {
    std::lock_guard lk(mu_);
    job_ = &fn;
    n_ = n;
    pending_ = int(workers_.size());
    ++generation_;
  }
  cv_.notify_all();
  run_range(fn, n, 0, size());
  std::unique_lock lk(mu_);
  done_cv_.wait(lk, [&] { return pending_ == 0; });
  job_ = nullptr;
}

void ThreadPool::worker(int idx) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int64_t, int64_t)>* job;
    int64_t n;
    {
      std::unique_lock lk(mu_);
      cv_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
      n = n_;
    }
    run_range(*job, n, idx, size());
    {
      std::lock_guard lk(mu_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

}  // namespace tansy
