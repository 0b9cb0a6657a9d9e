#include "server/http_listener.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>

#include "core/error.h"

namespace tansy::server {

namespace {

using Clock = std::chrono::steady_clock;

Clock::time_point after(double seconds) {
  return Clock::now() + std::chrono::microseconds(int64_t(seconds * 1e6));
}

int ms_until(Clock::time_point t) {
  auto ms = std::chrono::ceil<std::chrono::milliseconds>(t - Clock::now()).count();
  return ms <= 0 ? 0 : int(std::min<int64_t>(ms, 1 << 30));
}

std::pair<std::string, int> address(const sockaddr_storage& ss) {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (ss.ss_family == AF_INET) {
    auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &a->sin_addr, buf, sizeof(buf));
    return {buf, ntohs(a->sin_port)};
  }
  if (ss.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &a->sin6_addr, buf, sizeof(buf));
    return {buf, ntohs(a->sin6_port)};
  }
  return {"", -1};
}

// A connection's stream for httplib's request processing. Reads wait at most until the current
// deadline (the end of the head's or the body's time), so a trickling client is cut off when its
// time is up however regularly it sends.
class DeadlineStream : public httplib::Stream {
 public:
  DeadlineStream(int fd, std::string ip, int port, double write_timeout_s)
      : fd_(fd), ip_(std::move(ip)), port_(port), write_timeout_ms_(int(write_timeout_s * 1000)) {}

  Clock::time_point deadline = Clock::time_point::max();
  bool timed_out = false;

  bool is_readable() const override { return pending() > 0 || wait(POLLIN, ms_until(deadline)); }
  bool is_writable() const override {
    if (!wait(POLLOUT, write_timeout_ms_)) return false;
    pollfd p{fd_, short(POLLIN | POLLRDHUP), 0};
    return !(poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLERR | POLLRDHUP | POLLNVAL)));
  }
  ssize_t read(char* ptr, size_t size) override {
    if (pending() == 0) {
      if (!wait(POLLIN, ms_until(deadline))) {
        timed_out = true;  // (or the connection failed): either way it is closed after this request
        return -1;
      }
      ssize_t n;
      do n = recv(fd_, buf_, sizeof(buf_), 0);
      while (n < 0 && errno == EINTR);
      if (n <= 0) return n;
      off_ = 0;
      len_ = size_t(n);
    }
    size_t k = std::min(size, pending());
    std::memcpy(ptr, buf_ + off_, k);
    off_ += k;
    return ssize_t(k);
  }
  ssize_t write(const char* ptr, size_t size) override {
    if (!wait(POLLOUT, write_timeout_ms_)) return -1;
    ssize_t n;
    do n = send(fd_, ptr, size, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    return n;
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    ip = ip_;
    port = port_;
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    if (getsockname(fd_, reinterpret_cast<sockaddr*>(&ss), &len) == 0) std::tie(ip, port) = address(ss);
  }
  socket_t socket() const override { return fd_; }

  size_t pending() const { return len_ - off_; }
  // Waits up to ms for the next request's first byte (or for one already buffered).
  bool wait_request(int ms) const { return pending() > 0 || wait(POLLIN, ms); }

 private:
  bool wait(short events, int ms) const {
    pollfd p{fd_, events, 0};
    int rc;
    do rc = poll(&p, 1, ms);
    while (rc < 0 && errno == EINTR);
    return rc > 0 && (p.revents & (events | POLLHUP | POLLERR));
  }

  int fd_;
  std::string ip_;
  int port_;
  int write_timeout_ms_;
  char buf_[4096];
  size_t off_ = 0, len_ = 0;
};

}  // namespace

GuardedHttpServer::GuardedHttpServer(ConnectionLimits limits) : limits_(limits) {
  // Only for the Keep-Alive header httplib writes: the loop below enforces both.
  set_keep_alive_max_count(limits_.max_requests_per_connection);
  set_keep_alive_timeout(time_t(std::ceil(limits_.idle_timeout_s)));
}

GuardedHttpServer::~GuardedHttpServer() {
  if (listen_fd_ >= 0) ::close(listen_fd_);
  for (int fd : wake_)
    if (fd >= 0) ::close(fd);
}

int GuardedHttpServer::bind_exclusive(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  if (int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &res); rc != 0)
    fail("cannot bind {}:{}: {}", host, port, gai_strerror(rc));
  std::string why = "no address";
  for (addrinfo* a = res; a; a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      why = std::strerror(errno);
      continue;
    }
    // SO_REUSEADDR only lets a restarted server reuse a port whose old connections linger in
    // TIME_WAIT; on Linux it never lets two sockets listen on one port (SO_REUSEPORT would).
    int yes = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 128) == 0) {
      listen_fd_ = fd;
      break;
    }
    why = std::strerror(errno);
    ::close(fd);
  }
  freeaddrinfo(res);
  if (listen_fd_ < 0) fail("cannot bind {}:{}: {}", host, port, why);
  // httplib's response writers stop streaming once svr_sock_ is invalid (the server stopping).
  svr_sock_ = listen_fd_;
  fcntl(listen_fd_, F_SETFL, fcntl(listen_fd_, F_GETFL) | O_NONBLOCK);
  if (pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) fail("cannot create a pipe: {}", std::strerror(errno));
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len);
  return address(ss).second;
}

int GuardedHttpServer::open_connections() const {
  std::lock_guard lk(mu_);
  return open_;
}

void GuardedHttpServer::refuse(int fd, const std::string& why) {
  static const std::string body =
      R"({"error":{"message":"too many open connections; retry later","type":"server_overloaded",)"
      R"("param":null,"code":"too_many_connections"}})";
  const std::string msg =
      "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
      "Retry-After: 1\r\nConnection: close\r\nContent-Length: " +
      std::to_string(body.size()) + "\r\n\r\n" + body;
  // Best effort without blocking the accept loop: a fresh socket's send buffer takes this whole.
  [[maybe_unused]] ssize_t n = send(fd, msg.data(), msg.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  ::shutdown(fd, SHUT_WR);
  // Closed once the client has read the answer and closed its side (or after a second): closing
  // with its request unread would reset the connection, and the client could lose the answer.
  if (refusing_.size() >= 256) {
    ::close(refusing_.front().first);
    refusing_.erase(refusing_.begin());
  }
  refusing_.emplace_back(fd, after(1.0));
  if (on_refused) on_refused(why);
}

void GuardedHttpServer::serve() {
  if (listen_fd_ < 0) fail("serve() before bind_exclusive()");
  std::vector<pollfd> p;
  while (!stopping_) {
    p.assign({{listen_fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}});
    for (auto& [fd, t] : refusing_) p.push_back({fd, POLLIN, 0});
    if (poll(p.data(), p.size(), refusing_.empty() ? -1 : 100) < 0) {
      if (errno == EINTR) continue;
      fail("poll on the listening socket failed: {}", std::strerror(errno));
    }
    if (stopping_) break;
    for (size_t i = 0; i < refusing_.size();) {
      char junk[4096];
      const bool done = recv(refusing_[i].first, junk, sizeof(junk), MSG_DONTWAIT) == 0 ||
                        (p[i + 2].revents & (POLLHUP | POLLERR)) || Clock::now() >= refusing_[i].second;
      if (done) {
        ::close(refusing_[i].first);
        refusing_.erase(refusing_.begin() + std::ptrdiff_t(i));
        p.erase(p.begin() + std::ptrdiff_t(i + 2));
      } else {
        ++i;
      }
    }
    if (!(p[0].revents & POLLIN)) continue;
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    int fd = accept4(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_CLOEXEC);
    if (fd < 0) {
      // Out of descriptors: wait instead of spinning; other errors concern that one connection.
      if (errno == EMFILE || errno == ENFILE) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    auto [ip, port] = address(ss);
    {
      std::unique_lock lk(mu_);
      int& mine = per_client_[ip];
      if (open_ >= limits_.max_connections || mine >= limits_.max_per_client) {
        const bool total = open_ >= limits_.max_connections;
        if (mine == 0) per_client_.erase(ip);
        lk.unlock();
        refuse(fd, total
                       ? "refused a connection from " + ip + ": " + std::to_string(limits_.max_connections) +
                             " connections are open (--max-connections)"
                       : "refused a connection from " + ip + ": it has " +
                             std::to_string(limits_.max_per_client) +
                             " connections open (--max-connections-per-client)");
        continue;
      }
      ++mine;
      ++open_;
      fds_.insert(fd);
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    std::thread([this, fd, ip = ip, port = port] { connection(fd, ip, port); }).detach();
  }
  for (auto& [fd, t] : refusing_) ::close(fd);
  refusing_.clear();
  // Connections end once their requests see the client gone (shut down below).
  std::unique_lock lk(mu_);
  for (int fd : fds_) ::shutdown(fd, SHUT_RDWR);
  idle_cv_.wait(lk, [&] { return open_ == 0; });
}

void GuardedHttpServer::stop_serving() {
  stopping_ = true;
  svr_sock_ = INVALID_SOCKET;
  if (wake_[1] >= 0) {
    char c = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_[1], &c, 1);
  }
}

namespace {
thread_local int t_socket = -1;  // the connection this thread serves
}  // namespace

int GuardedHttpServer::current_socket() { return t_socket; }

void GuardedHttpServer::connection(int fd, std::string ip, int port) {
  t_socket = fd;
  {
    DeadlineStream strm(fd, ip, port, limits_.write_timeout_s);
    const int idle_ms = int(limits_.idle_timeout_s * 1000);
    for (size_t n = 0; n < limits_.max_requests_per_connection && !stopping_; ++n) {
      if (!strm.wait_request(n == 0 ? int(limits_.header_timeout_s * 1000) : idle_ms)) break;
      strm.deadline = after(limits_.header_timeout_s);
      bool closed = false;
      const bool last = n + 1 == limits_.max_requests_per_connection;
      bool ok = process_request(strm, last, closed,
                                [&](httplib::Request&) { strm.deadline = after(limits_.body_timeout_s); });
      if (!ok || closed || strm.timed_out) break;
    }
  }
  t_socket = -1;
  std::lock_guard lk(mu_);  // held while closing: serve() shuts down only fds still open
  fds_.erase(fd);
  ::shutdown(fd, SHUT_RDWR);
  ::close(fd);
  if (--per_client_[ip] == 0) per_client_.erase(ip);
  if (--open_ == 0) idle_cv_.notify_all();
}

}  // namespace tansy::server
