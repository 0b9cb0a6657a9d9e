#include "engine/scheduler.h"

#include <algorithm>

namespace tansy {

Scheduler::Ticket::~Ticket() { s_.release(id_); }

std::unique_ptr<Scheduler::Ticket> Scheduler::enqueue() {
  std::lock_guard lk(mu_);
  if (int(line_.size()) >= max_waiting_) return nullptr;
  uint64_t id = next_id_++;
  line_.push_back(id);
  return std::unique_ptr<Ticket>(new Ticket(*this, id));
}

bool Scheduler::wait_turn(Ticket& t, const std::function<bool()>& give_up, std::chrono::milliseconds poll) {
  std::unique_lock lk(mu_);
  for (;;) {
    if (running_ == t.id_) return true;
    if (running_ == 0 && !line_.empty() && line_.front() == t.id_) {
      line_.pop_front();
      running_ = t.id_;
      return true;
    }
    // give_up runs under the lock (it must not call back into the scheduler): a release between
    // an unlocked give_up and the wait would lose its notification and cost a whole poll period.
    if (give_up && give_up()) return false;
    cv_.wait_for(lk, poll);
  }
}

void Scheduler::release(uint64_t id) {
  {
    std::lock_guard lk(mu_);
    if (running_ == id)
      running_ = 0;
    else
      line_.erase(std::remove(line_.begin(), line_.end(), id), line_.end());
  }
  cv_.notify_all();
}

int Scheduler::waiting() const {
  std::lock_guard lk(mu_);
  return int(line_.size());
}

bool Scheduler::busy() const {
  std::lock_guard lk(mu_);
  return running_ != 0;
}

}  // namespace tansy
