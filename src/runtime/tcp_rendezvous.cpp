#include "weft/runtime/tcp_rendezvous.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

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
    if (got <= 0 && !(got < 0 && errno == EINTR)) return false;
    if (got > 0) p += got, n -= static_cast<size_t>(got);
  }
  return true;
}
bool write_all(int fd, const void* data, size_t n, Clock::time_point deadline) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    if (!ready(fd, POLLOUT, deadline)) return false;
    const ssize_t put = ::send(fd, p, n, MSG_NOSIGNAL);
    if (put < 0 && errno == EINTR) continue;
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
bool recv_frame(int fd, std::string* bytes, Clock::time_point deadline) {
  uint32_t n = 0;
  if (!read_all(fd, &n, 4, deadline)) return false;
  n = ntohl(n);
  if (n > kMostFrame) return false;
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

// The addresses host:port resolves to (TCP).
addrinfo* resolve(const std::string& host, int port, bool passive, int rank) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* list = nullptr;
  const int rc =
      ::getaddrinfo(host.empty() ? nullptr : host.c_str(), std::to_string(port).c_str(), &hints, &list);
  if (rc != 0) throw_error(where(rank) + "cannot resolve " + host + ": " + ::gai_strerror(rc));
  return list;
}

std::string peer_address(const sockaddr_storage& a) {
  char text[INET6_ADDRSTRLEN] = "?";
  if (a.ss_family == AF_INET)
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in&>(a).sin_addr, text, sizeof text);
  else if (a.ss_family == AF_INET6)
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6&>(a).sin6_addr, text, sizeof text);
  return text;
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
    addrinfo* list = resolve(host, port, true, rank);
    for (addrinfo* a = list; a && listen_fd_ < 0; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      const int on = 1;
      ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
      if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, world) == 0)
        listen_fd_ = fd;
      else
        ::close(fd);
    }
    ::freeaddrinfo(list);
    WEFT_CHECK(listen_fd_ >= 0, "TCP rendezvous: rank 0 cannot listen on " + host + ":" +
                                    std::to_string(port) + " (" + std::strerror(errno) + ")");
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &len);
    port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6&>(bound).sin6_port
                                              : reinterpret_cast<sockaddr_in&>(bound).sin_port);
    peers_.assign(world, -1);
    return;
  }
  // Connect, retrying until rank 0 listens, then greet.
  int fd = -1;
  while (fd < 0) {
    addrinfo* list = resolve(host, port, false, rank);
    for (addrinfo* a = list; a && fd < 0; a = a->ai_next) {
      fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd >= 0 && ::connect(fd, a->ai_addr, a->ai_addrlen) != 0) ::close(fd), fd = -1;
    }
    ::freeaddrinfo(list);
    if (fd >= 0) break;
    WEFT_CHECK(Clock::now() < deadline, "TCP rendezvous: rank " + std::to_string(rank) +
                                            " found no rank 0 at " + host + ":" + std::to_string(port) +
                                            " within " + std::to_string(timeout_.count()) + " ms");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const int on = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);
  peers_.assign(1, fd);
  const std::string hello = std::string(kMagic, 8) + u32(rank) + u32(world) + secret_;
  WEFT_CHECK(send_frame(fd, hello, deadline),
             "TCP rendezvous: rank " + std::to_string(rank) + " could not greet rank 0");
}

TcpRendezvous::~TcpRendezvous() {
  for (int fd : peers_)
    if (fd >= 0) ::close(fd);
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

void TcpRendezvous::admit() {
  const auto deadline = Clock::now() + timeout_;
  int missing = world_ - 1;
  while (missing > 0) {
    if (!ready(listen_fd_, POLLIN, deadline)) {
      std::string who;
      for (int r = 1; r < world_; ++r)
        if (peers_[r] < 0) who += (who.empty() ? "" : ", ") + std::to_string(r);
      throw_error(where(0) + "ranks " + who + " did not join within " + std::to_string(timeout_.count()) +
                  " ms (started? the same MASTER_ADDR / port and WEFT_JOB_SECRET on every rank?)");
    }
    sockaddr_storage from{};
    socklen_t len = sizeof from;
    const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&from), &len, SOCK_CLOEXEC);
    if (fd < 0) continue;
    // A greeting within a second: a silent connection must not hold up the rendezvous.
    std::string hello;
    const bool got = recv_frame(fd, &hello, std::min(deadline, Clock::now() + std::chrono::seconds(1)));
    std::string why;
    int r = -1;
    if (!got || hello.size() < 16 || std::memcmp(hello.data(), kMagic, 8) != 0) {
      why = "not a weft greeting";
    } else {
      r = static_cast<int>(u32_at(hello, 8));
      const int w = static_cast<int>(u32_at(hello, 12));
      if (!secrets_equal(hello.substr(16), secret_))
        why = "it did not present the job's secret (WEFT_JOB_SECRET)";
      else if (w != world_)
        why = "it belongs to a job of " + std::to_string(w) + " ranks, not " + std::to_string(world_);
      else if (r < 1 || r >= world_)
        why = "rank " + std::to_string(r) + " is not a rank of this job";
      else if (peers_[r] >= 0)
        why = "rank " + std::to_string(r) + " has already joined";
    }
    if (!why.empty()) {
      std::fprintf(stderr, "%srefused a connection from %s: %s\n", where(0).c_str(),
                   peer_address(from).c_str(), why.c_str());
      ::close(fd);
      continue;
    }
    const int on = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);
    peers_[r] = fd;
    --missing;
  }
  admitted_ = true;
}

std::vector<std::string> TcpRendezvous::allgather(const std::string& mine) {
  const auto deadline = Clock::now() + timeout_;
  std::vector<std::string> all(world_);
  if (rank_ != 0) {
    WEFT_CHECK(
        send_frame(peers_[0], mine, deadline) && recv_frame(peers_[0], &all[0], deadline),
        "TCP rendezvous: rank " + std::to_string(rank_) + " lost rank 0 (it failed, left or timed out)");
    std::string packed = std::move(all[0]);  // every rank's frame, by rank
    size_t at = 0;
    for (int r = 0; r < world_; ++r) {
      WEFT_CHECK(at + 4 <= packed.size(), "TCP rendezvous: a malformed reply from rank 0");
      const uint32_t n = u32_at(packed, at);
      WEFT_CHECK(at + 4 + n <= packed.size(), "TCP rendezvous: a malformed reply from rank 0");
      all[r] = packed.substr(at + 4, n);
      at += 4 + n;
    }
    return all;
  }
  if (!admitted_) admit();
  all[0] = mine;
  for (int r = 1; r < world_; ++r)
    WEFT_CHECK(recv_frame(peers_[r], &all[r], deadline),
               "TCP rendezvous: rank 0 lost rank " + std::to_string(r) + " (it failed, left or timed out)");
  std::string packed;
  for (const std::string& s : all) packed += u32(static_cast<uint32_t>(s.size())) + s;
  for (int r = 1; r < world_; ++r)
    WEFT_CHECK(send_frame(peers_[r], packed, deadline),
               "TCP rendezvous: rank 0 could not reach rank " + std::to_string(r));
  return all;
}

}  // namespace weft
