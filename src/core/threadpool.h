// A small fixed thread pool for the CPU backend's large matvecs.
#pragma once
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tansy {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads = 0);  // 0: hardware concurrency
  ~ThreadPool();
  int size() const { return int(workers_.size()) + 1; }
  // Calls fn(begin, end) over [0, n) split into contiguous ranges, one per thread; blocks until done.
  void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn);
  static ThreadPool& global();

 private:
  void worker(int idx);
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t n_ = 0;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
};

}  // namespace tansy
