// Admission: a bound on the requests inside the server, so that a flood gets 503 at once instead
// of an ever longer wait. A request takes a ticket on arrival (refused when `capacity` are
// already in, running or waiting for a place in the engine) and gives it back when the ticket is
// destroyed, whether it finished, failed or was abandoned. The engine decides who runs when.
#pragma once
#include <memory>
#include <mutex>

namespace tansy {

class Scheduler {
 public:
  explicit Scheduler(int capacity) : capacity_(capacity) {}

  class Ticket {
   public:
    ~Ticket();
    Ticket(const Ticket&) = delete;
    Ticket& operator=(const Ticket&) = delete;

   private:
    friend class Scheduler;
    explicit Ticket(Scheduler& s) : s_(s) {}
    Scheduler& s_;
  };

  // A ticket, or null when `capacity` requests are already in.
  std::unique_ptr<Ticket> enqueue();
  int inside() const;

 private:
  const int capacity_;
  mutable std::mutex mu_;
  int inside_ = 0;
};

}  // namespace tansy
