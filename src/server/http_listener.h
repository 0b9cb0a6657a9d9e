// The connection side of tansy serve: an exclusive listening socket and connection threads with
// deadlines and bounds, feeding cpp-httplib's request processing (routing, handlers, responses).
//
// httplib 0.11's own accept loop runs every connection on a fixed pool whose reads time out per
// recv() only, so a few clients trickling bytes hold every thread, and it binds with SO_REUSEPORT,
// so a second server on the port starts and takes part of the traffic. Here each accepted
// connection gets its own thread (up to max_connections in all, max_per_client per client
// address; more are answered 503 at once by the accept thread), the request head and body each
// have a deadline for the whole of them, and the port is bound without SO_REUSEPORT.
#pragma once
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace tansy::server {

struct ConnectionLimits {
  int max_connections = 256;     // open connections in all
  int max_per_client = 64;       // open connections from one client address
  double header_timeout_s = 10;  // from the first byte of a request to the end of its head
  double body_timeout_s = 60;    // from the end of the head to the end of the body
  double idle_timeout_s = 5;     // a kept-alive connection waiting for its next request
  double write_timeout_s = 30;   // one write of the response not accepted by the client
  size_t max_requests_per_connection = 100;
};

class GuardedHttpServer : public httplib::Server {
 public:
  explicit GuardedHttpServer(ConnectionLimits limits);
  ~GuardedHttpServer() override;

  // Binds host:port (port 0: any free port) and returns the port. Throws tansy::Error naming the
  // address when it cannot be bound, e.g. because another process listens on it.
  int bind_exclusive(const std::string& host, int port);
  // Accepts and serves connections until stop_serving(); returns once every connection has ended.
  void serve();
  void stop_serving();

  const ConnectionLimits& limits() const { return limits_; }
  int open_connections() const;

  // The socket of the connection whose request the calling thread is handling (handlers and
  // content providers run on their connection's thread), or -1 outside one.
  static int current_socket();

  // Called with a one-line description of each connection refused for a bound.
  std::function<void(const std::string&)> on_refused;

 private:
  void connection(int fd, std::string ip, int port);
  void refuse(int fd, const std::string& why);

  ConnectionLimits limits_;
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};
  std::atomic<bool> stopping_{false};
  mutable std::mutex mu_;
  std::condition_variable idle_cv_;
  int open_ = 0;
  std::map<std::string, int> per_client_;
  std::set<int> fds_;
  std::vector<std::pair<int, std::chrono::steady_clock::time_point>> refusing_;  // accept thread only
};

}  // namespace tansy::server
