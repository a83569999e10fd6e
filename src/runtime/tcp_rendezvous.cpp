#include "weft/runtime/tcp_rendezvous.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fcntl.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <thread>

#include "weft/runtime/channel.hpp"
#include "weft/runtime/error.hpp"

namespace weft {
namespace {

using Clock = std::chrono::steady_clock;
constexpr char kMagic[8] = {'w', 'e', 'f', 't', 't', 'c', 'p', '1'};
constexpr uint32_t kMostFrame = 1u << 30;
constexpr uint32_t kMostGreeting = 16 + 4096;  // read before the secret is checked: kept small
enum Reply : uint32_t { kData = 0, kRefused = 1 };

std::string where(int rank) {
  return "weft: TCP rendezvous, rank " + std::to_string(rank) + ": ";
}

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left > 0 ? static_cast<int>(left) : 0;
}

// Waits until fd is readable (or writable); false at the deadline.
bool ready(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, remaining_ms(deadline));
    if (n > 0) return true;
    if (n == 0) return false;
    if (errno != EINTR) return false;
  }
}

// Exactly n bytes, or false (closed, failed or past the deadline).
bool read_all(int fd, void* data, size_t n, Clock::time_point deadline) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    if (!ready(fd, POLLIN, deadline)) return false;
    const ssize_t got = ::recv(fd, p, n, 0);
    if (got <= 0 && !(got < 0 && (errno == EINTR || errno == EAGAIN))) return false;
    if (got > 0) p += got, n -= static_cast<size_t>(got);
  }
  return true;
}
bool write_all(int fd, const void* data, size_t n, Clock::time_point deadline) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    if (!ready(fd, POLLOUT, deadline)) return false;
    const ssize_t put = ::send(fd, p, n, MSG_NOSIGNAL);
    if (put < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (put <= 0) return false;
    p += put, n -= static_cast<size_t>(put);
  }
  return true;
}

// A frame: its length (4 bytes, network order), then its bytes.
bool send_frame(int fd, const std::string& bytes, Clock::time_point deadline) {
  const uint32_t n = htonl(static_cast<uint32_t>(bytes.size()));
  return write_all(fd, &n, 4, deadline) && write_all(fd, bytes.data(), bytes.size(), deadline);
}
bool recv_frame(int fd, std::string* bytes, Clock::time_point deadline, uint32_t most = kMostFrame) {
  uint32_t n = 0;
  if (!read_all(fd, &n, 4, deadline)) return false;
  n = ntohl(n);
  if (n > most) return false;
  bytes->resize(n);
  return read_all(fd, bytes->data(), n, deadline);
}

std::string u32(uint32_t v) {
  v = htonl(v);
  return std::string(reinterpret_cast<const char*>(&v), 4);
}
uint32_t u32_at(const std::string& s, size_t at) {
  uint32_t v = 0;
  std::memcpy(&v, s.data() + at, 4);
  return ntohl(v);
}

std::string peer_address(const sockaddr_storage& a) {
  char text[INET6_ADDRSTRLEN] = "?";
  if (a.ss_family == AF_INET)
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in&>(a).sin_addr, text, sizeof text);
  else if (a.ss_family == AF_INET6)
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6&>(a).sin6_addr, text, sizeof text);
  return text;
}

void no_delay(int fd) {
  const int on = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);
}

// Rank 0's socket: every interface at `port` (IPv6 and IPv4 where the host has both), so that ranks on
// other hosts reach it whatever rank 0's own name resolves to locally (often a loopback address).
int listen_anywhere(int port, int world, int* bound_port) {
  int fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  const int on = 1, off = 0;
  if (fd >= 0) {
    ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof off);
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_any;
    a.sin6_port = htons(static_cast<uint16_t>(port));
    if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) ::close(fd), fd = -1;
  }
  if (fd < 0) {  // no IPv6 here
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return -1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(static_cast<uint16_t>(port));
    if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      const int err = errno;
      ::close(fd);
      errno = err;
      return -1;
    }
  }
  if (::listen(fd, std::max(SOMAXCONN, world)) != 0) {
    const int err = errno;
    ::close(fd);
    errno = err;
    return -1;
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  *bound_port = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6&>(bound).sin6_port
                                                  : reinterpret_cast<sockaddr_in&>(bound).sin_port);
  return fd;
}

// One connection attempt to host:port within `until` (non-blocking connect); -1 if none succeeded.
int connect_once(const std::string& host, int port, Clock::time_point until) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* list = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &list) != 0) return -1;
  int fd = -1;
  for (addrinfo* a = list; a && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) continue;
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) break;
    int err = errno == EINPROGRESS ? 0 : errno;
    socklen_t len = sizeof err;
    if (err == 0 && ready(fd, POLLOUT, until))
      ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    else if (err == 0)
      err = ETIMEDOUT;
    if (err != 0) ::close(fd), fd = -1;
  }
  ::freeaddrinfo(list);
  return fd;
}

}  // namespace

TcpRendezvous::TcpRendezvous(const std::string& host, int port, int rank, int world, std::string secret,
                             std::chrono::milliseconds timeout)
    : rank_(rank), world_(world), port_(port), secret_(std::move(secret)), timeout_(timeout) {
  WEFT_CHECK(world >= 1 && rank >= 0 && rank < world,
             "TCP rendezvous: rank " + std::to_string(rank) + " of a world of " + std::to_string(world));
  WEFT_CHECK(secret_.size() >= 16,
             "TCP rendezvous: a job spanning hosts needs WEFT_JOB_SECRET (16 characters or "
             "more, the same on every rank): TCP peers carry no credentials to check");
  WEFT_CHECK(port >= 0 && port < 65536, "TCP rendezvous: port " + std::to_string(port) + " out of range");
  const auto deadline = Clock::now() + timeout_;
  if (rank == 0) {
    listen_fd_ = listen_anywhere(port, world, &port_);
    WEFT_CHECK(listen_fd_ >= 0, "TCP rendezvous: rank 0 cannot listen on port " + std::to_string(port) +
                                    " (" + std::strerror(errno) + ")");
    peers_.assign(world, -1);
    return;
  }
  // Connect (retrying lookups and connections until rank 0 listens, each attempt within a second), greet.
  int fd = -1;
  while ((fd = connect_once(host, port, std::min(deadline, Clock::now() + std::chrono::seconds(1)))) < 0) {
    WEFT_CHECK(Clock::now() < deadline, "TCP rendezvous: rank " + std::to_string(rank) +
                                            " found no rank 0 at " + host + ":" + std::to_string(port) +
                                            " within " + std::to_string(timeout_.count()) + " ms");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  no_delay(fd);
  const std::string hello = std::string(kMagic, 8) + u32(rank) + u32(world) + secret_;
  if (!send_frame(fd, hello, deadline)) {
    ::close(fd);
    throw_error(where(rank) + "could not greet rank 0");
  }
  peers_.assign(1, fd);
}

TcpRendezvous::~TcpRendezvous() {
  for (int fd : peers_)
    if (fd >= 0) ::close(fd);
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

// Why rank 0 refuses a greeting ("" when it admits it as *rank).
std::string TcpRendezvous::judge(const std::string& hello, int* rank) const {
  *rank = -1;
  if (hello.size() < 16 || std::memcmp(hello.data(), kMagic, 8) != 0) return "not a weft greeting";
  const int r = static_cast<int>(u32_at(hello, 8)), w = static_cast<int>(u32_at(hello, 12));
  if (!secrets_equal(hello.substr(16), secret_))
    return "it did not present the job's secret (WEFT_JOB_SECRET)";
  if (w != world_)
    return "it belongs to a job of " + std::to_string(w) + " ranks, not " + std::to_string(world_);
  if (r < 1 || r >= world_) return "rank " + std::to_string(r) + " is not a rank of this job";
  if (peers_[r] >= 0) return "rank " + std::to_string(r) + " has already joined";
  *rank = r;
  return {};
}

// Rank 0: accepts connections and reads their greetings side by side (a silent connection holds up no
// other), admitting each rank once; a connection that sends no greeting within a second is dropped.
void TcpRendezvous::admit() {
  struct Pending {
    int fd;
    std::string from;
    Clock::time_point until;
  };
  std::vector<Pending> pending;
  std::vector<int> refused;
  const auto deadline = Clock::now() + timeout_;
  int missing = world_ - 1;
  while (missing > 0) {
    const auto now = Clock::now();
    if (now >= deadline) {
      for (const Pending& p : pending) ::close(p.fd);
      for (int fd : refused) ::close(fd);
      std::string who;
      int count = 0;
      for (int r = 1; r < world_; ++r)
        if (peers_[r] < 0) who += (who.empty() ? "" : ", ") + std::to_string(r), ++count;
      throw_error(where(0) + (count == 1 ? "rank " : "ranks ") + who + " did not join within " +
                  std::to_string(timeout_.count()) +
                  " ms (started? the same MASTER_ADDR / port and WEFT_JOB_SECRET on every rank?)");
    }
    std::vector<pollfd> fds{{listen_fd_, POLLIN, 0}};
    for (const Pending& p : pending) fds.push_back({p.fd, POLLIN, 0});
    ::poll(fds.data(), fds.size(), std::min(50, remaining_ms(deadline)));
    for (size_t i = pending.size(); i-- > 0;) {
      Pending& p = pending[i];
      const bool readable = fds[i + 1].revents != 0;
      if (!readable && now < p.until) continue;
      std::string hello;
      int r = -1;
      const std::string why =
          !readable ? "it sent no greeting within a second"
          : !recv_frame(p.fd, &hello, Clock::now() + std::chrono::milliseconds(200), kMostGreeting)
              ? "not a weft greeting"
              : judge(hello, &r);
      if (why.empty()) {
        no_delay(p.fd);
        peers_[r] = p.fd;
        --missing;
      } else {
        std::fprintf(stderr, "%srefused a connection from %s: %s\n", where(0).c_str(), p.from.c_str(),
                     why.c_str());
        // Told why, then closed for writing only: closing outright while its first call is in flight would
        // reset the connection and lose the reason. Closed once admission ends.
        send_frame(p.fd, u32(kRefused) + why, Clock::now() + std::chrono::milliseconds(100));
        ::shutdown(p.fd, SHUT_WR);
        refused.push_back(p.fd);
      }
      pending.erase(pending.begin() + static_cast<long>(i));
    }
    if (fds[0].revents == 0) continue;
    for (;;) {  // every connection waiting
      sockaddr_storage from{};
      socklen_t len = sizeof from;
      const int fd =
          ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&from), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        if (errno != EAGAIN && errno != EINTR) std::this_thread::sleep_for(std::chrono::milliseconds(10));
        break;
      }
      pending.push_back({fd, peer_address(from), Clock::now() + std::chrono::seconds(1)});
    }
  }
  for (const Pending& p : pending) ::close(p.fd);
  for (int fd : refused) ::close(fd);
  admitted_ = true;
  ::close(listen_fd_);  // every rank is in: the port is free again (a later connection would only be refused)
  listen_fd_ = -1;
}

// Frames: a rank's contribution is (call number, bytes); rank 0's reply is (kData, call number, every rank's
// bytes), or (kRefused, why) to a connection it refused. A call number that differs from rank 0's fails the
// call naming both (the ranks made different numbers of calls).
std::vector<std::string> TcpRendezvous::allgather(const std::string& mine) {
  const uint32_t call = calls_++;
  std::vector<std::string> all(world_);
  if (rank_ != 0) {
    const auto deadline = Clock::now() + timeout_;
    std::string reply;
    const bool sent = send_frame(peers_[0], u32(call) + mine, deadline);  // a refusal may already be waiting
    WEFT_CHECK(
        recv_frame(peers_[0], &reply, deadline) && reply.size() >= 4 &&
            (sent || u32_at(reply, 0) == kRefused),
        "TCP rendezvous: rank " + std::to_string(rank_) + " lost rank 0 (it failed, left or timed out)");
    if (u32_at(reply, 0) == kRefused)
      throw_error(where(rank_) + "rank 0 refused this rank: " + reply.substr(4));
    WEFT_CHECK(reply.size() >= 8 && u32_at(reply, 4) == call,
               "TCP rendezvous: rank " + std::to_string(rank_) + " is at call " + std::to_string(call) +
                   ", rank 0 at another: the ranks made different numbers of calls");
    size_t at = 8;
    for (int r = 0; r < world_; ++r) {
      WEFT_CHECK(at + 4 <= reply.size(), "TCP rendezvous: a malformed reply from rank 0");
      const uint32_t n = u32_at(reply, at);
      WEFT_CHECK(at + 4 + n <= reply.size(), "TCP rendezvous: a malformed reply from rank 0");
      all[r] = reply.substr(at + 4, n);
      at += 4 + n;
    }
    return all;
  }
  if (!admitted_) admit();
  const auto deadline = Clock::now() + timeout_;
  all[0] = mine;
  for (int r = 1; r < world_; ++r) {
    std::string frame;
    WEFT_CHECK(recv_frame(peers_[r], &frame, deadline) && frame.size() >= 4,
               "TCP rendezvous: rank 0 lost rank " + std::to_string(r) + " (it failed, left or timed out)");
    WEFT_CHECK(u32_at(frame, 0) == call, "TCP rendezvous: rank " + std::to_string(r) + " is at call " +
                                             std::to_string(u32_at(frame, 0)) + ", rank 0 at " +
                                             std::to_string(call) +
                                             ": the ranks made different numbers of calls");
    all[r] = frame.substr(4);
  }
  std::string packed = u32(kData) + u32(call);
  for (const std::string& s : all) packed += u32(static_cast<uint32_t>(s.size())) + s;
  for (int r = 1; r < world_; ++r)
    WEFT_CHECK(send_frame(peers_[r], packed, deadline),
               "TCP rendezvous: rank 0 could not reach rank " + std::to_string(r));
  return all;
}

}  // namespace weft
