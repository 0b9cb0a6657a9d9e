// One request at a time, in arrival order, with a bounded waiting line. A request takes a
// ticket on arrival (refused when the line is full), waits for its turn, and gives the engine
// back when its ticket is destroyed, whether it finished, failed or was abandoned.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>

namespace tansy {

class Scheduler {
 public:
  explicit Scheduler(int max_waiting) : max_waiting_(max_waiting) {}

  class Ticket {
   public:
    ~Ticket();
    Ticket(const Ticket&) = delete;
    Ticket& operator=(const Ticket&) = delete;

   private:
    friend class Scheduler;
    Ticket(Scheduler& s, uint64_t id) : s_(s), id_(id) {}
    Scheduler& s_;
    uint64_t id_;
  };

  // A place in line, or null when max_waiting requests are already waiting.
  std::unique_ptr<Ticket> enqueue();
  // Blocks until it is this ticket's turn (true) or until give_up() returns true (false);
  // give_up is polled every `poll`, with the scheduler's lock held (it must not call the scheduler).
  bool wait_turn(Ticket& t, const std::function<bool()>& give_up,
                 std::chrono::milliseconds poll = std::chrono::milliseconds(20));

  int waiting() const;
  bool busy() const;

 private:
  void release(uint64_t id);
  const int max_waiting_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<uint64_t> line_;
  uint64_t running_ = 0, next_id_ = 1;
};

}  // namespace tansy
