#include "weft/runtime/channel.hpp"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <set>

#include "weft/runtime/error.hpp"

namespace weft {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint32_t kMagic = 0x74666577;  // "weft"

enum class MsgType : uint32_t { kHello = 1, kWelcome = 2, kData = 3, kError = 4, kBye = 5 };

struct Header {
  uint32_t magic;
  uint32_t type;
  uint32_t seq;
  int32_t src;
  uint64_t len;
  int32_t has_fd;
  int32_t reserved;
};

struct Frame {
  Header h{};
  std::string payload;
  int fd = -1;
};

// Thrown inside this file for a peer that went away; turned into a weft::Error by the caller.
struct PeerClosed {
  int rank;
};
struct TimedOut {
  int rank;
};

std::string errno_text() {
  return std::strerror(errno);
}

// The process at the other end of a connected Unix socket (the kernel's record, not what it claims).
ucred peer_credentials(int sock) {
  ucred c{};
  socklen_t len = sizeof c;
  if (::getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &c, &len) != 0) c.uid = static_cast<uid_t>(-1);
  return c;
}
// Abstract sockets carry no file permissions: any local process of any user can reach one. Only processes of
// this process's uid take part in a rendezvous (they are sent the job's GPU memory handles).
bool same_user(const ucred& c) {
  return c.uid == ::getuid();
}
std::string describe(const ucred& c) {
  return "uid " + std::to_string(c.uid) + " (pid " + std::to_string(c.pid) + ")";
}

// 64 bits of a hash of the job secret, in hex, for the socket's name: a name that another process cannot take
// first without the secret. Abstract socket names are listed in /proc/net/unix, so the name must not be the
// secret itself; the greeting carries the secret, and rank 0 compares that, not the name.
std::string secret_tag(const std::string& secret) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a, then a final avalanche (splitmix64's)
  for (unsigned char c : secret) h = (h ^ c) * 0x100000001b3ull;
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebull;
  h ^= h >> 31;
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return hex;
}
// Compares in time that does not depend on where the strings differ.

sockaddr_un abstract_address(const std::string& name, socklen_t* len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  a.sun_path[0] = '\0';  // abstract namespace: nothing on disk, released when the socket closes
  std::memcpy(a.sun_path + 1, name.data(), std::min(name.size(), sizeof(a.sun_path) - 2));
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 +
                                std::min(name.size(), sizeof(a.sun_path) - 2));
  return a;
}

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<long long>(left, 1 << 30));
}

// Waits until `sock` is readable; throws TimedOut at the deadline.
void wait_readable(int sock, Clock::time_point deadline, int peer_rank) {
  for (;;) {
    pollfd p{sock, POLLIN, 0};
    const int n = ::poll(&p, 1, remaining_ms(deadline));
    if (n > 0) return;
    if (n == 0) throw TimedOut{peer_rank};
    if (errno != EINTR) throw_error("weft: poll failed: " + errno_text());
  }
}

void send_all(int sock, const char* data, size_t len, int peer_rank) {
  while (len > 0) {
    const ssize_t n = ::send(sock, data, len, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EPIPE || errno == ECONNRESET) throw PeerClosed{peer_rank};
      throw_error("weft: send failed: " + errno_text());
    }
    data += n;
    len -= static_cast<size_t>(n);
  }
}

void send_frame(int sock, MsgType type, uint32_t seq, int src, std::string_view payload, int fd,
                int peer_rank) {
  Header h{kMagic, static_cast<uint32_t>(type), seq, src, payload.size(), fd >= 0 ? 1 : 0, 0};
  iovec iov{&h, sizeof(h)};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char ctrl[CMSG_SPACE(sizeof(int))] = {};
  if (fd >= 0) {
    msg.msg_control = ctrl;
    msg.msg_controllen = sizeof(ctrl);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  ssize_t n;
  do {
    n = ::sendmsg(sock, &msg, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    if (errno == EPIPE || errno == ECONNRESET) throw PeerClosed{peer_rank};
    throw_error("weft: sendmsg failed: " + errno_text());
  }
  send_all(sock, reinterpret_cast<const char*>(&h) + n, sizeof(h) - static_cast<size_t>(n), peer_rank);
  send_all(sock, payload.data(), payload.size(), peer_rank);
}

void recv_all(int sock, char* data, size_t len, Clock::time_point deadline, int peer_rank) {
  while (len > 0) {
    wait_readable(sock, deadline, peer_rank);
    const ssize_t n = ::recv(sock, data, len, 0);
    if (n == 0) throw PeerClosed{peer_rank};
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      if (errno == ECONNRESET) throw PeerClosed{peer_rank};
      throw_error("weft: recv failed: " + errno_text());
    }
    data += n;
    len -= static_cast<size_t>(n);
  }
}

Frame recv_frame(int sock, Clock::time_point deadline, int peer_rank) {
  Frame f;
  wait_readable(sock, deadline, peer_rank);
  iovec iov{&f.h, sizeof(f.h)};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char ctrl[CMSG_SPACE(sizeof(int))] = {};
  msg.msg_control = ctrl;
  msg.msg_controllen = sizeof(ctrl);
  ssize_t n;
  do {
    n = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n == 0 || (n < 0 && errno == ECONNRESET)) throw PeerClosed{peer_rank};
  if (n < 0) throw_error("weft: recvmsg failed: " + errno_text());
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c))
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
      std::memcpy(&f.fd, CMSG_DATA(c), sizeof(int));
  recv_all(sock, reinterpret_cast<char*>(&f.h) + n, sizeof(f.h) - static_cast<size_t>(n), deadline,
           peer_rank);
  if (f.h.magic != kMagic) {
    if (f.fd >= 0) ::close(f.fd);
    throw_error("weft: rendezvous: garbage from rank " + std::to_string(peer_rank) +
                " (another program on this socket name? set WEFT_JOB_ID to a unique value)");
  }
  f.payload.resize(f.h.len);
  recv_all(sock, f.payload.data(), f.payload.size(), deadline, peer_rank);
  return f;
}

std::string pack_ints(std::initializer_list<long> v) {
  std::string s;
  for (long x : v) s.append(reinterpret_cast<const char*>(&x), sizeof(x));
  return s;
}
long unpack_int(const std::string& s, size_t i) {
  long x = 0;
  if (s.size() >= (i + 1) * sizeof(long)) std::memcpy(&x, s.data() + i * sizeof(long), sizeof(long));
  return x;
}

// A failure report relayed by rank 0 already starts with "weft: "; fail() adds it again.
std::string relayed(const std::string& payload) {
  return payload.rfind("weft: ", 0) == 0 ? payload.substr(6) : payload;
}

}  // namespace

Channel::Channel(std::string job_id, int rank, int world, std::chrono::milliseconds timeout,
                 std::string secret)
    : job_id_(std::move(job_id)),
      secret_(std::move(secret)),
      rank_(rank),
      world_(world),
      op_timeout_(timeout) {
  WEFT_CHECK(world >= 1 && rank >= 0 && rank < world,
             "rendezvous: rank " + std::to_string(rank) + " is outside world size " + std::to_string(world));
  WEFT_CHECK(!job_id_.empty(), "rendezvous: empty job id");
  name_ = "weft." + job_id_;
  if (!secret_.empty()) name_.append(1, '.').append(secret_tag(secret_));
  const auto deadline = Clock::now() + timeout;
  peers_.resize(rank == 0 ? world : 1);
  if (world_ == 1) return;
  try {
    if (rank_ == 0)
      hub_accept(deadline);
    else
      client_connect(deadline);
  } catch (...) {
    for (auto& p : peers_)
      if (p.sock >= 0) ::close(p.sock);
    if (listen_sock_ >= 0) ::close(listen_sock_);
    throw;
  }
  if (listen_sock_ >= 0) {
    ::close(listen_sock_);  // late or stray connects now fail at once instead of waiting for us
    listen_sock_ = -1;
  }
  monitor_ = std::thread([this] { monitor_loop(); });
}

Channel::~Channel() {
  stop_monitor();
  // Say goodbye, so peers tell a normal departure from a crash; leaving on an exception is a failure that
  // the peers should hear at once (they may be waiting for work this rank will never do).
  const bool unwinding = std::uncaught_exceptions() > 0;
  const std::string failing = "weft: rank " + std::to_string(rank_) +
                              " left the job on an error (its communicator was destroyed while an exception "
                              "was propagating)";
  for (int r = 0; r < static_cast<int>(peers_.size()); ++r) {
    if (peers_[r].sock < 0) continue;
    if (lost_.empty()) {
      try {
        if (unwinding)
          send_frame(peers_[r].sock, MsgType::kError, 0, rank_, failing, -1, r);
        else
          send_frame(peers_[r].sock, MsgType::kBye, 0, rank_, {}, -1, r);
      } catch (...) {
      }
    }
    ::close(peers_[r].sock);
  }
  if (listen_sock_ >= 0) ::close(listen_sock_);
}

void Channel::stop_monitor() {
  stop_ = true;
  if (monitor_.joinable()) monitor_.join();
}

void Channel::hub_accept(Clock::time_point deadline) {
  listen_sock_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listen_sock_ < 0) throw_error("weft: socket() failed: " + errno_text());
  socklen_t len;
  sockaddr_un addr = abstract_address(name_, &len);
  if (::bind(listen_sock_, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    if (errno == EADDRINUSE)
      throw_error("weft: rendezvous socket @" + name_ +
                  " is already in use by another live job on this node; give each job a unique WEFT_JOB_ID");
    throw_error("weft: bind(@" + name_ + ") failed: " + errno_text());
  }
  if (::listen(listen_sock_, world_) != 0) throw_error("weft: listen failed: " + errno_text());
  int joined = 1;
  while (joined < world_) {
    pollfd p{listen_sock_, POLLIN, 0};
    const int n = ::poll(&p, 1, remaining_ms(deadline));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      std::string missing;
      for (int r = 1; r < world_; ++r)
        if (peers_[r].sock < 0) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      fail("rendezvous timed out: rank(s) " + missing + " never joined job '" + job_id_ + "' (socket @" +
           name_ + "); did they start, with the same world size and job id?");
    }
    const int s = ::accept4(listen_sock_, nullptr, nullptr, SOCK_CLOEXEC);
    if (s < 0) continue;
    const ucred peer = peer_credentials(s);
    if (!same_user(peer)) {  // refused; the real rank may still come
      std::fprintf(stderr,
                   "weft: rendezvous of job '%s' (socket @%s): refused a connection from %s: only processes "
                   "of uid %u (this job's user) may join\n",
                   job_id_.c_str(), name_.c_str(), describe(peer).c_str(), static_cast<unsigned>(::getuid()));
      ::close(s);
      continue;
    }
    Frame hello;
    try {
      hello = recv_frame(s, std::min(deadline, Clock::now() + std::chrono::seconds(10)), -1);
    } catch (...) {
      ::close(s);  // a stray or dying connection: ignore it, the real rank will come
      continue;
    }
    const int r = hello.h.src;
    const size_t ints = 2 * sizeof(long);  // world size, pid; then the job secret
    if (static_cast<MsgType>(hello.h.type) != MsgType::kHello || hello.payload.size() < ints ||
        !secrets_equal(hello.payload.substr(ints), secret_)) {  // refused; the real rank may still come
      std::fprintf(
          stderr,
          "weft: rendezvous of job '%s' (socket @%s): refused a connection from %s claiming rank %d: "
          "it did not present the job's secret (WEFT_JOB_SECRET)\n",
          job_id_.c_str(), name_.c_str(), describe(peer).c_str(), r);
      ::close(s);
      continue;
    }
    const long w = unpack_int(hello.payload, 0);
    std::string why;  // a process of this job's user, with its secret, that was started wrongly
    if (w != world_)
      why = "rank " + std::to_string(r) + " was started with world size " + std::to_string(w) +
            ", rank 0 with " + std::to_string(world_);
    else if (r <= 0 || r >= world_)
      why = "a process claims rank " + std::to_string(r) + " in a world of " + std::to_string(world_);
    else if (peers_[r].sock >= 0)
      why = "two processes claim rank " + std::to_string(r) + " (pids " + std::to_string(peers_[r].pid) +
            " and " + std::to_string(unpack_int(hello.payload, 1)) + ")";
    if (!why.empty()) {
      try {
        send_frame(s, MsgType::kError, 0, 0, "weft: rendezvous: " + why, -1, r);
      } catch (...) {
      }
      ::close(s);
      fail("rendezvous: " + why);
    }
    peers_[r] = Peer{s, unpack_int(hello.payload, 1)};
    ++joined;
  }
  for (int r = 1; r < world_; ++r) {
    try {
      send_frame(peers_[r].sock, MsgType::kWelcome, 0, 0, {}, -1, r);
    } catch (PeerClosed&) {
      fail("rendezvous: rank " + std::to_string(r) + " disconnected while joining");
    }
  }
}

void Channel::client_connect(Clock::time_point deadline) {
  socklen_t len;
  sockaddr_un addr = abstract_address(name_, &len);
  for (;;) {
    const int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0) throw_error("weft: socket() failed: " + errno_text());
    if (::connect(s, reinterpret_cast<sockaddr*>(&addr), len) == 0) {
      if (const ucred c = peer_credentials(s); !same_user(c)) {
        ::close(s);  // nothing sent: the rank's handles go to this job's rank 0 only
        throw_error("weft: rendezvous socket @" + name_ + " of job '" + job_id_ + "' is held by " +
                    describe(c) + ", not by a process of this job's user (uid " + std::to_string(::getuid()) +
                    "): refusing to join it; run the job under another WEFT_JOB_ID");
      }
      peers_[0].sock = s;
      break;
    }
    const int err = errno;
    ::close(s);
    if (err != ECONNREFUSED && err != ENOENT && err != EAGAIN && err != EINTR)
      throw_error("weft: connect(@" + name_ + ") failed: " + std::strerror(err));
    if (Clock::now() >= deadline)
      throw_error("weft: rendezvous timed out: rank " + std::to_string(rank_) +
                  " could not reach rank 0 of job '" + job_id_ + "' (socket @" + name_ +
                  "); is rank 0 running with the same job id?");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  try {
    send_frame(peers_[0].sock, MsgType::kHello, 0, rank_,
               pack_ints({world_, static_cast<long>(::getpid())}) + secret_, -1, 0);
    Frame f = recv_frame(peers_[0].sock, deadline, 0);
    if (static_cast<MsgType>(f.h.type) == MsgType::kError) throw_error(f.payload);
    WEFT_CHECK(static_cast<MsgType>(f.h.type) == MsgType::kWelcome,
               "rendezvous: unexpected reply from rank 0");
  } catch (PeerClosed&) {
    throw_error("weft: rendezvous: rank 0 of job '" + job_id_ + "' closed the connection while rank " +
                std::to_string(rank_) + " was joining (it failed or rejected this rank)");
  } catch (TimedOut&) {
    throw_error("weft: rendezvous timed out: rank 0 of job '" + job_id_ + "' accepted rank " +
                std::to_string(rank_) + " but the other ranks never all joined");
  }
}

void Channel::fail(const std::string& why) {
  if (lost_.empty()) lost_ = "weft: " + why;
  if (rank_ == 0) {
    for (int r = 1; r < static_cast<int>(peers_.size()); ++r) {
      if (peers_[r].sock < 0) continue;
      try {
        send_frame(peers_[r].sock, MsgType::kError, 0, 0, lost_ + " (reported by rank 0)", -1, r);
      } catch (...) {
      }
      ::shutdown(peers_[r].sock, SHUT_RDWR);
    }
  } else if (peers_[0].sock >= 0) {
    ::shutdown(peers_[0].sock, SHUT_RDWR);
  }
  if (on_lost_) on_lost_(lost_);
  throw Error(lost_);
}

void Channel::report_failure(const std::string& why) {
  std::unique_lock<std::mutex> lk(io_mu_, std::try_to_lock);
  if (lk.owns_lock()) {
    if (!lost_.empty()) return;
    lost_ = "weft: rank " + std::to_string(rank_) + " gave up: " + why;
    for (int r = 0; r < static_cast<int>(peers_.size()); ++r) {
      if (peers_[r].sock < 0) continue;
      try {
        send_frame(peers_[r].sock, MsgType::kError, 0, rank_, lost_, -1, r);
      } catch (...) {
      }
      ::shutdown(peers_[r].sock, SHUT_RDWR);
    }
    return;
  }
  // The sockets stay open (closed by the destructor); shutting them down is safe beside another thread's use.
  for (const Peer& peer : peers_)
    if (peer.sock >= 0) ::shutdown(peer.sock, SHUT_RDWR);
}

std::string Channel::lost_reason() const {
  std::lock_guard<std::mutex> lk(io_mu_);
  return lost_;
}

std::string Channel::departed_reason() const {
  std::lock_guard<std::mutex> lk(io_mu_);
  return departed_;
}

void Channel::set_on_peer_lost(std::function<void(const std::string&)> cb) {
  std::lock_guard<std::mutex> lk(io_mu_);
  on_lost_ = std::move(cb);
}

Channel::Gathered Channel::allgather(std::string_view data, int fd) {
  std::lock_guard<std::mutex> lk(io_mu_);
  if (!lost_.empty()) throw Error(lost_);
  Gathered g;
  g.data.resize(world_);
  g.fds.assign(world_, -1);
  g.data[rank_] = std::string(data);
  if (world_ == 1) return g;
  const uint32_t seq = ++seq_;
  const auto deadline = Clock::now() + op_timeout_;
  auto describe = [&](int r) {
    return "rank " + std::to_string(r) +
           (rank_ == 0 && r > 0 ? " (pid " + std::to_string(peers_[r].pid) + ")" : "");
  };
  try {
    if (rank_ == 0) {
      std::set<int> pending;
      for (int r = 1; r < world_; ++r) pending.insert(r);
      while (!pending.empty()) {
        std::vector<int> ranks(pending.begin(), pending.end());
        std::vector<pollfd> pf;
        for (int r : ranks) pf.push_back(pollfd{peers_[r].sock, POLLIN, 0});
        const int n = ::poll(pf.data(), pf.size(), remaining_ms(deadline));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) throw TimedOut{ranks.front()};
        for (size_t i = 0; i < pf.size(); ++i) {
          if (pf[i].revents == 0) continue;
          const int r = ranks[i];
          Frame f = recv_frame(peers_[r].sock, deadline, r);
          if (static_cast<MsgType>(f.h.type) == MsgType::kError || f.h.seq != seq) {
            for (int x : g.fds)
              if (x >= 0) ::close(x);
            if (f.fd >= 0) ::close(f.fd);
          }
          if (static_cast<MsgType>(f.h.type) == MsgType::kError) fail(relayed(f.payload));
          if (static_cast<MsgType>(f.h.type) == MsgType::kBye)
            fail(describe(r) +
                 " left the job (destroyed its communicator) while the others were in a host collective");
          if (f.h.seq != seq)
            fail("host collectives out of order: " + describe(r) + " is in collective #" +
                 std::to_string(f.h.seq) + ", rank 0 in #" + std::to_string(seq) +
                 " (every rank must make the same collective calls)");
          g.data[r] = std::move(f.payload);
          g.fds[r] = f.fd;
          pending.erase(r);
        }
      }
      const int my_fd = fd;
      for (int c = 1; c < world_; ++c)
        for (int r = 0; r < world_; ++r)
          if (r != c)
            send_frame(peers_[c].sock, MsgType::kData, seq, r, g.data[r], r == 0 ? my_fd : g.fds[r], c);
    } else {
      send_frame(peers_[0].sock, MsgType::kData, seq, rank_, data, fd, 0);
      for (int k = 0; k < world_ - 1; ++k) {
        Frame f = recv_frame(peers_[0].sock, deadline, 0);
        if (static_cast<MsgType>(f.h.type) == MsgType::kBye)
          fail("rank 0 left the job (destroyed its communicator) during a host collective");
        const bool bad = f.h.seq != seq || f.h.src < 0 || f.h.src >= world_ || f.h.src == rank_;
        if (static_cast<MsgType>(f.h.type) == MsgType::kError || bad) {
          for (int x : g.fds)
            if (x >= 0) ::close(x);
          if (f.fd >= 0) ::close(f.fd);
        }
        if (static_cast<MsgType>(f.h.type) == MsgType::kError) fail(relayed(f.payload));
        if (bad)
          fail("host collectives out of order: rank " + std::to_string(rank_) + " is in collective #" +
               std::to_string(seq) + ", got #" + std::to_string(f.h.seq) + " from rank 0");
        g.data[f.h.src] = std::move(f.payload);
        g.fds[f.h.src] = f.fd;
      }
    }
  } catch (PeerClosed& e) {
    for (int& x : g.fds)
      if (x >= 0) ::close(x);
    if (rank_ == 0)
      fail(describe(e.rank) +
           " closed its connection during a host collective: the process exited or crashed");
    fail("lost the connection to rank 0 during a host collective: rank 0 exited or crashed");
  } catch (TimedOut& e) {
    for (int& x : g.fds)
      if (x >= 0) ::close(x);
    fail("host collective #" + std::to_string(seq) + " timed out after " +
         std::to_string(op_timeout_.count()) + " ms waiting for " + describe(e.rank) +
         " (is it stuck, or making different collective calls?)");
  }
  return g;
}

void Channel::barrier() {
  allgather({});
}

void Channel::monitor_loop() {
  while (!stop_) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    std::unique_lock<std::mutex> lk(io_mu_, std::try_to_lock);
    if (!lk.owns_lock() || !lost_.empty()) continue;
    for (int r = 0; r < static_cast<int>(peers_.size()); ++r) {
      const int s = peers_[r].sock;
      if (s < 0 || peers_[r].departed) continue;
      pollfd p{s, POLLIN | POLLRDHUP, 0};
      if (::poll(&p, 1, 0) <= 0) continue;
      std::string why;
      // Rank 0 reports a failure just before it hangs up: read the report first, so the reason travels.
      Header h{};
      const ssize_t n = (p.revents & POLLIN) ? ::recv(s, &h, sizeof(h), MSG_PEEK | MSG_DONTWAIT) : -1;
      if (n == sizeof(h) && h.magic == kMagic && static_cast<MsgType>(h.type) == MsgType::kBye) {
        // Left normally: noted, not a loss. The goodbye stays unread, so a collective still fails on it.
        peers_[r].departed = true;
        if (departed_.empty())
          departed_ = "weft: rank " + std::to_string(h.src) + " left the job (it destroyed its communicator)";
        continue;
      }
      if (n == sizeof(h) && h.magic == kMagic && static_cast<MsgType>(h.type) == MsgType::kError) {
        try {
          Frame f = recv_frame(s, Clock::now() + std::chrono::seconds(1), r);
          if (f.fd >= 0) ::close(f.fd);
          why = relayed(f.payload);
        } catch (...) {
          why = "rank " + std::to_string(r) + " reported a failure";
        }
      } else if (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) {
        why = rank_ == 0 ? "rank " + std::to_string(r) + " (pid " + std::to_string(peers_[r].pid) +
                               ") exited or crashed: its connection closed"
                         : "lost the connection to rank 0: it exited, crashed, or reported a failure";
      } else if (n == 0) {
        why = "rank " + std::to_string(r) + " closed its connection";
      }
      if (why.empty()) continue;  // a peer already started the next collective; it will be read then
      try {
        fail(why);
      } catch (Error&) {
      }
      break;
    }
  }
}

bool secrets_equal(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ (i < b.size() ? b[i] : 0));
  return diff == 0;
}

}  // namespace weft
