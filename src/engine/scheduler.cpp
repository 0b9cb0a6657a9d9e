#include "engine/scheduler.h"

namespace tansy {

Scheduler::Ticket::~Ticket() {
  std::lock_guard lk(s_.mu_);
  --s_.inside_;
}

std::unique_ptr<Scheduler::Ticket> Scheduler::enqueue() {
  std::lock_guard lk(mu_);
  if (inside_ >= capacity_) return nullptr;
  ++inside_;
  return std::unique_ptr<Ticket>(new Ticket(*this));
}

int Scheduler::inside() const {
  std::lock_guard lk(mu_);
  return inside_;
}

}  // namespace tansy
