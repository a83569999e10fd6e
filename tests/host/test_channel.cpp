// Rendezvous and host collectives between fake ranks, as threads of this process and as forked processes.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <condition_variable>
#include <fstream>
#include <functional>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "test_util.hpp"
#include "weft/runtime/channel.hpp"

using weft::Channel;
using weft_test::Clock;
using weft_test::contains;
using weft_test::error_of;
using weft_test::fork_child;
using weft_test::milliseconds;
using weft_test::ms_since;
using weft_test::unique_job;
using weft_test::wait_child;

namespace {

constexpr milliseconds kJoin{5000};  // generous rendezvous limit for tests that expect success

// Runs body(rank) on one thread per rank; returns each rank's error message ("" when it returned normally).
std::vector<std::string> run_threads(int n, const std::function<void(int)>& body) {
  std::vector<std::string> errs(n);
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      try {
        body(r);
      } catch (const weft::Error& e) {
        errs[r] = e.what();
      } catch (const std::exception& e) {
        errs[r] = std::string("<not a weft::Error> ") + e.what();
      }
    });
  for (auto& t : ts) t.join();
  return errs;
}

// True once an abstract socket named @weft.<job> exists (rank 0 has bound it), polling up to `limit`.
bool wait_for_listener(const std::string& job, milliseconds limit = milliseconds(3000)) {
  const std::string want = "@weft." + job;
  const auto deadline = Clock::now() + limit;
  while (Clock::now() < deadline) {
    std::ifstream f("/proc/net/unix");
    std::string line;
    while (std::getline(f, line))
      if (line.size() >= want.size() && line.compare(line.size() - want.size(), want.size(), want) == 0)
        return true;
    std::this_thread::sleep_for(milliseconds(2));
  }
  return false;
}

// Connects a raw socket to a job's rendezvous address, as a stray program or hand-written peer would.
int raw_connect(const std::string& job) {
  const std::string name = "weft." + job;
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::memcpy(a.sun_path + 1, name.data(), name.size());
  const socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  const int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) return -1;
  if (::connect(s, reinterpret_cast<sockaddr*>(&a), len) != 0) {
    ::close(s);
    return -1;
  }
  return s;
}

int count_open_fds() {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd"))
    n += e.path().filename() != "." ? 1 : 0;
  return n;
}

// Polls until pred() or the limit; returns pred().
template <class P>
bool eventually(P pred, milliseconds limit) {
  const auto deadline = Clock::now() + limit;
  while (!pred() && Clock::now() < deadline) std::this_thread::sleep_for(milliseconds(2));
  return pred();
}

std::string payload_for(int rank, int round, size_t size = 0) {
  std::string s = "rank" + std::to_string(rank) + "/round" + std::to_string(round);
  if (size > s.size()) {
    s.resize(size);
    for (size_t i = 16; i < size; ++i) s[i] = static_cast<char>((i * 131 + rank * 7 + round) & 0xff);
  }
  return s;
}

int make_memfd(const std::string& content) {
  const int fd = ::memfd_create("weft-test", MFD_CLOEXEC);
  if (fd < 0) return -1;
  if (::write(fd, content.data(), content.size()) != static_cast<ssize_t>(content.size())) {
    ::close(fd);
    return -1;
  }
  return fd;
}

std::string read_fd_from_start(int fd) {
  std::string s(256, '\0');
  const ssize_t n = ::pread(fd, s.data(), s.size(), 0);
  s.resize(n > 0 ? static_cast<size_t>(n) : 0);
  return s;
}

// Records on_peer_lost calls (they come from the monitor thread).
struct LossLog {
  std::mutex mu;
  std::vector<std::string> calls;
  void attach(Channel& ch) {
    ch.set_on_peer_lost([this](const std::string& why) {
      std::lock_guard<std::mutex> lk(mu);
      calls.push_back(why);
    });
  }
  size_t count() {
    std::lock_guard<std::mutex> lk(mu);
    return calls.size();
  }
  std::string first() {
    std::lock_guard<std::mutex> lk(mu);
    return calls.empty() ? "" : calls.front();
  }
};

}  // namespace

// ---- basics --------------------------------------------------------------------------------------------

TEST(Channel, WorldOfOneNeedsNoPeers) {
  const std::string job = unique_job("solo");
  const auto t0 = Clock::now();
  Channel ch(job, 0, 1, milliseconds(2000));
  Channel again(job, 0, 1, milliseconds(2000));  // nothing was bound: the same id can be used twice
  EXPECT_LT(ms_since(t0), 500);                  // and nothing was waited for
  EXPECT_EQ(ch.rank(), 0);
  EXPECT_EQ(ch.world(), 1);
  EXPECT_HAS(ch.socket_name(), job);
  const int fd = make_memfd("x");
  ASSERT_GE(fd, 0);
  Channel::Gathered g = ch.allgather("only me", fd);
  ASSERT_EQ(g.data.size(), 1u);
  EXPECT_EQ(g.data[0], "only me");
  ASSERT_EQ(g.fds.size(), 1u);
  EXPECT_EQ(g.fds[0], -1);  // one's own descriptor is not handed back
  ::close(fd);
  ch.barrier();
  EXPECT_EQ(ch.lost_reason(), "");
}

TEST(Channel, InvalidArgumentsAreRejected) {
  EXPECT_HAS(error_of([] { Channel c(unique_job("bad"), 2, 2, milliseconds(100)); }),
             "rank 2 is outside world size 2");
  EXPECT_HAS(error_of([] { Channel c(unique_job("bad"), -1, 2, milliseconds(100)); }), "outside world size");
  EXPECT_HAS(error_of([] { Channel c(unique_job("bad"), 0, 0, milliseconds(100)); }), "outside world size");
  EXPECT_HAS(error_of([] { Channel c("", 0, 2, milliseconds(100)); }), "empty job id");
}

TEST(Channel, ThreadsAllgatherInRankOrder) {
  constexpr int kWorld = 4;
  const std::string job = unique_job("order");
  const auto errs = run_threads(kWorld, [&](int r) {
    Channel ch(job, r, kWorld, kJoin);
    EXPECT_EQ(ch.rank(), r);
    EXPECT_EQ(ch.world(), kWorld);
    Channel::Gathered g = ch.allgather(payload_for(r, 0));
    ASSERT_EQ(g.data.size(), size_t{kWorld});
    ASSERT_EQ(g.fds.size(), size_t{kWorld});
    for (int s = 0; s < kWorld; ++s) {
      EXPECT_EQ(g.data[s], payload_for(s, 0)) << "rank " << r << " sees rank " << s;
      EXPECT_EQ(g.fds[s], -1);
    }
    ch.barrier();
    EXPECT_EQ(ch.lost_reason(), "");
  });
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(errs[r], "") << "rank " << r;
}

TEST(Channel, ManyAllgathersInARowWithVaryingSizes) {
  constexpr int kWorld = 3;
  const std::string job = unique_job("rounds");
  const size_t sizes[] = {0,      1,       17, 4096,
                          100000, 3 << 20, 5,  0};  // includes payloads far over a socket buffer
  const auto errs = run_threads(kWorld, [&](int r) {
    Channel ch(job, r, kWorld, kJoin);
    for (int round = 0; round < 40; ++round) {
      const size_t size = sizes[round % 8];
      const std::string mine = size == 0 ? std::string() : payload_for(r, round, size);
      Channel::Gathered g = ch.allgather(mine);
      ASSERT_EQ(g.data.size(), size_t{kWorld});
      for (int s = 0; s < kWorld; ++s) {
        const std::string want = size == 0 ? std::string() : payload_for(s, round, size);
        ASSERT_EQ(g.data[s].size(), want.size()) << "round " << round;
        ASSERT_TRUE(g.data[s] == want) << "rank " << r << " round " << round << " data of rank " << s;
      }
    }
  });
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(errs[r], "") << "rank " << r;
}

TEST(Channel, BarrierHoldsEveryRankUntilAllArrive) {
  constexpr int kWorld = 4, kPhases = 8;
  const std::string job = unique_job("barrier");
  std::atomic<int> arrived[kPhases] = {};
  const auto errs = run_threads(kWorld, [&](int r) {
    Channel ch(job, r, kWorld, kJoin);
    for (int p = 0; p < kPhases; ++p) {
      // Ranks arrive at different times; nobody may leave before the last one came.
      std::this_thread::sleep_for(milliseconds(((r + p) % kWorld) * 5));
      arrived[p]++;
      ch.barrier();
      EXPECT_EQ(arrived[p].load(), kWorld) << "rank " << r << " left barrier " << p << " early";
    }
  });
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(errs[r], "") << "rank " << r;
}

TEST(Channel, ForkedProcessesRendezvousAndAllgather) {
  constexpr int kWorld = 4;
  const std::string job = unique_job("procs");
  std::vector<pid_t> kids;
  for (int r = 1; r < kWorld; ++r)
    kids.push_back(fork_child([&, r] {
      Channel ch(job, r, kWorld, kJoin);
      for (int round = 0; round < 3; ++round) {
        Channel::Gathered g = ch.allgather(std::to_string(::getpid()) + ":" + std::to_string(round));
        if (g.data[0] != std::to_string(::getppid()) + ":" + std::to_string(round))
          return 10;  // rank 0 = parent
        for (int s = 1; s < kWorld; ++s)
          if (g.data[s].find(":" + std::to_string(round)) == std::string::npos) return 11;
        if (g.data[r] != std::to_string(::getpid()) + ":" + std::to_string(round)) return 12;
      }
      ch.barrier();
      return 0;
    }));
  {
    Channel ch(job, 0, kWorld, kJoin);
    for (int round = 0; round < 3; ++round) {
      Channel::Gathered g = ch.allgather(std::to_string(::getpid()) + ":" + std::to_string(round));
      for (int r = 1; r < kWorld; ++r)
        EXPECT_EQ(g.data[r], std::to_string(kids[r - 1]) + ":" + std::to_string(round)) << "round " << round;
    }
    ch.barrier();
  }
  for (pid_t k : kids) EXPECT_EQ(wait_child(k), 0);
}

TEST(Channel, FileDescriptorsTravelBetweenProcesses) {
  constexpr int kWorld = 3;
  const std::string job = unique_job("fds");
  auto content = [](int r) { return "memfd content of rank " + std::to_string(r); };
  auto check = [&](int me, const Channel::Gathered& g) -> int {
    for (int s = 0; s < kWorld; ++s) {
      if (s == me) {
        if (g.fds[s] != -1) return 20;
        continue;
      }
      if (g.fds[s] < 0) return 21;
      if (read_fd_from_start(g.fds[s]) != content(s)) return 22;
      if (g.data[s] != "rank" + std::to_string(s)) return 23;
      ::close(g.fds[s]);
    }
    return 0;
  };
  std::vector<pid_t> kids;
  for (int r = 1; r < kWorld; ++r)
    kids.push_back(fork_child([&, r] {
      Channel ch(job, r, kWorld, kJoin);
      const int fd = make_memfd(content(r));
      if (fd < 0) return 30;
      const int rc = check(r, ch.allgather("rank" + std::to_string(r), fd));
      // The sender keeps its own descriptor.
      if (rc == 0 && read_fd_from_start(fd) != content(r)) return 31;
      ch.barrier();
      return rc;
    }));
  {
    Channel ch(job, 0, kWorld, kJoin);
    const int fd = make_memfd(content(0));
    ASSERT_GE(fd, 0);
    EXPECT_EQ(check(0, ch.allgather("rank0", fd)), 0);
    EXPECT_EQ(read_fd_from_start(fd), content(0));
    ::close(fd);
    ch.barrier();
  }
  for (pid_t k : kids) EXPECT_EQ(wait_child(k), 0);
}

TEST(Channel, PipeEndPassedAlongIsUsable) {
  const std::string job = unique_job("pipe");
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  struct stat orig {};
  ASSERT_EQ(::fstat(p[1], &orig), 0);
  std::string got;
  const auto errs = run_threads(2, [&](int r) {
    Channel ch(job, r, 2, kJoin);
    if (r == 1) {
      Channel::Gathered g = ch.allgather("write end", p[1]);
      EXPECT_EQ(g.fds[0], -1);  // rank 0 sent none
      EXPECT_EQ(g.fds[1], -1);
      ::close(p[1]);  // rank 0 now holds its own duplicate
      char buf[64] = {};
      ssize_t n = 0, k;
      while ((k = ::read(p[0], buf + n, sizeof(buf) - 1 - static_cast<size_t>(n))) > 0) n += k;
      got.assign(buf, static_cast<size_t>(n));
      ::close(p[0]);
    } else {
      Channel::Gathered g = ch.allgather("reader");
      ASSERT_GE(g.fds[1], 0);
      EXPECT_NE(g.fds[1], p[1]);  // a new descriptor ...
      struct stat st {};
      ASSERT_EQ(::fstat(g.fds[1], &st), 0);
      EXPECT_EQ(st.st_ino, orig.st_ino);  // ... for the same pipe
      EXPECT_EQ(::write(g.fds[1], "through the channel", 19), 19);
      ::close(g.fds[1]);
    }
  });
  EXPECT_EQ(errs[0], "");
  EXPECT_EQ(errs[1], "");
  EXPECT_EQ(got, "through the channel");
}

// ---- rendezvous failures -------------------------------------------------------------------------------

TEST(Channel, RendezvousTimesOutNamingMissingRanks) {
  const std::string job = unique_job("missing");
  long long rank0_ms = -1;
  // World of 4 with ranks 1 and 3 absent.
  const auto errs = run_threads(2, [&](int i) {
    if (i == 0) {
      const auto t0 = Clock::now();
      try {
        Channel ch(job, 0, 4, milliseconds(600));
      } catch (...) {
        rank0_ms = ms_since(t0);
        throw;
      }
    } else {
      Channel ch(job, 2, 4, milliseconds(3000));  // outlives rank 0's limit: hears rank 0's verdict
    }
  });
  EXPECT_HAS(errs[0], "rendezvous timed out");
  EXPECT_HAS(errs[0], "rank(s) 1, 3 never joined");
  EXPECT_HAS(errs[0], job);
  EXPECT_GE(rank0_ms, 550);
  EXPECT_LT(rank0_ms, 2500);
  EXPECT_HAS(errs[1], "rank(s) 1, 3 never joined");  // forwarded to the rank that did come
}

TEST(Channel, ClientTimesOutWhenRankZeroNeverStarts) {
  const std::string job = unique_job("norank0");
  const auto t0 = Clock::now();
  const std::string msg = error_of([&] { Channel ch(job, 1, 2, milliseconds(400)); });
  const long long ms = ms_since(t0);
  EXPECT_HAS(msg, "rendezvous timed out");
  EXPECT_HAS(msg, "rank 1 could not reach rank 0");
  EXPECT_HAS(msg, job);
  EXPECT_GE(ms, 380);
  EXPECT_LT(ms, 2500);
}

TEST(Channel, MismatchedWorldSizeIsReported) {
  const std::string job = unique_job("worlds");
  const auto t0 = Clock::now();
  const auto errs = run_threads(2, [&](int r) {
    if (r == 1) wait_for_listener(job);
    Channel ch(job, r, r == 0 ? 2 : 3, milliseconds(4000));
  });
  EXPECT_HAS(errs[0], "rank 1 was started with world size 3, rank 0 with 2");
  EXPECT_HAS(errs[1], "world size 3");
  EXPECT_LT(ms_since(t0), 2000);  // reported at once, not by timing out
}

TEST(Channel, DuplicateRankIsReported) {
  const std::string job = unique_job("dup");
  const auto t0 = Clock::now();
  const auto errs = run_threads(3, [&](int i) {
    if (i > 0) wait_for_listener(job);
    Channel ch(job, i == 0 ? 0 : 1, 3, milliseconds(4000));  // threads 1 and 2 both claim rank 1
  });
  EXPECT_HAS(errs[0], "two processes claim rank 1");
  EXPECT_HAS(errs[1], "two processes claim rank 1");
  EXPECT_HAS(errs[2], "two processes claim rank 1");
  EXPECT_LT(ms_since(t0), 2500);
}

TEST(Channel, ConcurrentJobsDoNotInterfere) {
  constexpr int kWorld = 3;
  const std::string jobs[2] = {unique_job("jobA"), unique_job("jobB")};
  const auto errs = run_threads(2 * kWorld, [&](int i) {
    const int j = i / kWorld, r = i % kWorld;
    Channel ch(jobs[j], r, kWorld, kJoin);
    for (int round = 0; round < 10; ++round) {
      Channel::Gathered g = ch.allgather(jobs[j] + "#" + std::to_string(r) + "#" + std::to_string(round));
      for (int s = 0; s < kWorld; ++s)
        ASSERT_EQ(g.data[s], jobs[j] + "#" + std::to_string(s) + "#" + std::to_string(round));
    }
    ch.barrier();
  });
  for (int i = 0; i < 2 * kWorld; ++i) EXPECT_EQ(errs[i], "") << "thread " << i;
}

TEST(Channel, SameJobIdTwiceIsAlreadyInUse) {
  const std::string job = unique_job("twice");
  std::string first_err = "<not run>";
  std::jthread first([&] {
    first_err = error_of([&] {
      Channel ch(job, 0, 2, milliseconds(4000));
      ch.barrier();
    });
  });
  ASSERT_TRUE(wait_for_listener(job));
  const auto t0 = Clock::now();
  const std::string second = error_of([&] { Channel ch(job, 0, 2, milliseconds(2000)); });
  EXPECT_LT(ms_since(t0), 500);
  EXPECT_HAS(second, "already in use");
  EXPECT_HAS(second, "WEFT_JOB_ID");
  // The first job is unharmed: its rank 1 joins it.
  const std::string joiner = error_of([&] {
    Channel ch(job, 1, 2, milliseconds(4000));
    ch.barrier();
  });
  first.join();
  EXPECT_EQ(joiner, "<no exception>");
  EXPECT_EQ(first_err, "<no exception>");
}

TEST(Channel, StrayConnectionsDuringRendezvousAreIgnored) {
  const std::string job = unique_job("stray");
  std::string hub_err = "<not run>";
  std::jthread hub([&] {
    hub_err = error_of([&] {
      Channel ch(job, 0, 2, milliseconds(4000));
      EXPECT_EQ(ch.allgather("zero").data[1], "one");
    });
  });
  ASSERT_TRUE(wait_for_listener(job));
  const int quiet = raw_connect(job);  // connects and hangs up at once
  ASSERT_GE(quiet, 0);
  ::close(quiet);
  const int noisy = raw_connect(job);  // sends a header's worth of garbage
  ASSERT_GE(noisy, 0);
  const std::string junk(64, 'x');
  EXPECT_EQ(::send(noisy, junk.data(), junk.size(), MSG_NOSIGNAL), static_cast<ssize_t>(junk.size()));
  const auto t0 = Clock::now();
  const std::string client = error_of([&] {
    Channel ch(job, 1, 2, milliseconds(4000));
    EXPECT_EQ(ch.allgather("one").data[0], "zero");
  });
  hub.join();
  ::close(noisy);
  EXPECT_EQ(client, "<no exception>");
  EXPECT_EQ(hub_err, "<no exception>");
  EXPECT_LT(ms_since(t0), 2000);
}

// Abstract sockets carry no file permissions: the rendezvous checks who is at the other end (SO_PEERCRED).
// A process of another user reaching a job's socket is sent nothing and the job's real rank still joins; a
// process of another user holding the socket first is refused by the job's ranks, by name.
// Whether a forked child can become uid 65534 here (root, with the capability to change uid).
static bool can_become_nobody() {
  if (::geteuid() != 0) return false;
  return wait_child(fork_child([] { return ::setgid(65534) == 0 && ::setuid(65534) == 0 ? 0 : 1; })) == 0;
}

TEST(Channel, ProcessOfAnotherUserIsRefusedAndTheJobCompletes) {
  if (!can_become_nobody()) GTEST_SKIP() << "needs root able to run a process as another user (uid 65534)";
  const std::string job = unique_job("uid");
  std::string hub_err = "<not run>";
  std::jthread hub([&] {
    hub_err = error_of([&] {
      Channel ch(job, 0, 2, milliseconds(6000));
      EXPECT_EQ(ch.allgather("zero").data[1], "one");
    });
  });
  ASSERT_TRUE(wait_for_listener(job));
  const pid_t intruder = fork_child([&] {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) return 3;
    const std::string err = error_of([&] { Channel ch(job, 1, 2, milliseconds(1500)); });
    if (contains(err, "held by uid 0") || contains(err, "closed the connection")) return 0;
    weft_test::child_note("intruder: " + err);
    return 4;
  });
  EXPECT_EQ(wait_child(intruder), 0);
  const std::string client = error_of([&] {
    Channel ch(job, 1, 2, milliseconds(4000));
    EXPECT_EQ(ch.allgather("one").data[0], "zero");
  });
  hub.join();
  EXPECT_EQ(client, "<no exception>");
  EXPECT_EQ(hub_err, "<no exception>");
}

TEST(Channel, SocketHeldByAnotherUserIsRefused) {
  if (!can_become_nobody()) GTEST_SKIP() << "needs root able to run a process as another user (uid 65534)";
  const std::string job = unique_job("squat");
  const pid_t squatter = fork_child([&] {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) return 3;
    (void)error_of([&] { Channel ch(job, 0, 2, milliseconds(3000)); });  // binds the name, then waits
    return 0;
  });
  ASSERT_TRUE(wait_for_listener(job));
  const auto t0 = Clock::now();
  const std::string err = error_of([&] { Channel ch(job, 1, 2, milliseconds(2000)); });
  EXPECT_LT(ms_since(t0), 1000);
  EXPECT_HAS(err, "held by uid 65534");
  EXPECT_HAS(err, "WEFT_JOB_ID");
  ::kill(squatter, SIGKILL);
  wait_child(squatter);
}

// With a job secret: the ranks that know it meet on a socket whose name carries a hash of it (never the
// secret itself: abstract names are listed in /proc/net/unix); a process of the same user that found the name
// but lacks the secret is refused and sent nothing, and the real rank 1 still joins.
TEST(Channel, JobSecretAdmitsOnlyItsHolders) {
  const std::string job = unique_job("secret"), secret = "0123456789abcdef0123456789abcdef";
  std::string hub_err = "<not run>", name;
  std::jthread hub([&] {
    hub_err = error_of([&] {
      Channel ch(job, 0, 2, milliseconds(6000), secret);
      name = ch.socket_name();
      EXPECT_EQ(ch.allgather("zero").data[1], "one");
    });
  });
  std::string full;  // the socket's name, as a process listing /proc/net/unix sees it
  const auto deadline = Clock::now() + milliseconds(3000);
  while (full.empty() && Clock::now() < deadline) {
    std::ifstream f("/proc/net/unix");
    for (std::string line; std::getline(f, line);)
      if (const size_t at = line.find("@weft." + job + "."); at != std::string::npos)
        full = line.substr(at + 6);
    std::this_thread::sleep_for(milliseconds(2));
  }
  ASSERT_FALSE(full.empty()) << "no socket @weft." << job << ".<tag>";
  EXPECT_EQ(full.find(secret), std::string::npos) << full;
  // The name known, the secret not: a channel whose job id is the whole name greets without the secret.
  const std::string intruder = error_of([&] { Channel ch(full, 1, 2, milliseconds(1500)); });
  EXPECT_HAS(intruder, "closed the connection");
  const std::string wrong =
      error_of([&] { Channel ch(full, 1, 2, milliseconds(1500), "not the job's secret!!"); });
  EXPECT_NE(wrong, "<no exception>");  // another name (its own tag): it never reaches rank 0
  const std::string client = error_of([&] {
    Channel ch(job, 1, 2, milliseconds(4000), secret);
    EXPECT_EQ(ch.allgather("one").data[0], "zero");
  });
  hub.join();
  EXPECT_EQ(client, "<no exception>");
  EXPECT_EQ(hub_err, "<no exception>");
  EXPECT_EQ("weft." + full, name);
}

// ---- failures during and between collectives -----------------------------------------------------------

TEST(Channel, RankExitingDuringAllgatherFailsTheOthers) {
  constexpr int kWorld = 3;
  const std::string job = unique_job("midexit");
  const pid_t quitter = fork_child([&] {
    Channel ch(job, 2, kWorld, kJoin);
    ch.allgather("first");
    std::this_thread::sleep_for(milliseconds(200));  // the others are in the second allgather by now
    ::_exit(7);                                      // no destructor, no goodbye: like a crash
    return 0;
  });
  const pid_t survivor = fork_child([&] {
    Channel ch(job, 1, kWorld, kJoin);
    ch.set_op_timeout(milliseconds(10000));
    ch.allgather("first");
    const auto t0 = Clock::now();
    const std::string msg = error_of([&] { ch.allgather("second"); });
    if (ms_since(t0) > 3000) return 40;
    if (!contains(msg, "rank 2")) {
      weft_test::child_note("rank 1 got: " + msg);
      return 41;
    }
    if (contains(msg, "timed out")) return 42;
    if (msg.rfind("weft: weft:", 0) == 0) {
      weft_test::child_note("doubled prefix: " + msg);
      return 44;
    }
    if (ch.lost_reason() != msg) return 43;
    return 0;
  });
  Channel ch(job, 0, kWorld, kJoin);
  ch.set_op_timeout(milliseconds(10000));
  ch.allgather("first");
  const auto t0 = Clock::now();
  const std::string msg = error_of([&] { ch.allgather("second"); });
  EXPECT_LT(ms_since(t0), 3000);
  EXPECT_HAS(msg, "rank 2 (pid " + std::to_string(quitter) + ")");
  EXPECT_TRUE(contains(msg, "exited") || contains(msg, "closed")) << msg;
  EXPECT_LACKS(msg, "timed out");
  EXPECT_EQ(ch.lost_reason(), msg);
  EXPECT_EQ(error_of([&] { ch.barrier(); }), msg);  // every later collective throws the same
  EXPECT_EQ(wait_child(quitter), 7);
  EXPECT_EQ(wait_child(survivor), 0);
}

TEST(Channel, RankDyingWhileIdleIsNoticedByMonitor) {
  constexpr int kWorld = 3;
  const std::string job = unique_job("idledeath");
  const pid_t victim = fork_child([&] {
    Channel ch(job, 2, kWorld, kJoin);
    ch.barrier();
    ::_exit(0);
    return 0;
  });
  const pid_t survivor = fork_child([&] {
    Channel ch(job, 1, kWorld, kJoin);
    LossLog log;
    log.attach(ch);
    ch.barrier();
    if (!eventually([&] { return !ch.lost_reason().empty(); }, milliseconds(3000))) return 50;
    if (!eventually([&] { return log.count() > 0; }, milliseconds(500))) return 51;
    const std::string why = ch.lost_reason();
    if (!contains(why, "rank 2")) {  // rank 0 forwards what happened, not just that something did
      weft_test::child_note("rank 1 lost_reason: " + why);
      return 52;
    }
    if (log.first() != why || log.count() != 1) return 53;
    if (error_of([&] { ch.barrier(); }) != why) return 54;
    return 0;
  });
  Channel ch(job, 0, kWorld, kJoin);
  LossLog log;
  log.attach(ch);
  ch.barrier();
  const auto t0 = Clock::now();
  ASSERT_TRUE(eventually([&] { return !ch.lost_reason().empty(); }, milliseconds(3000)));
  EXPECT_LT(ms_since(t0), 1000);
  const std::string why = ch.lost_reason();
  EXPECT_HAS(why, "rank 2 (pid " + std::to_string(victim) + ")");
  EXPECT_HAS(why, "exited");
  ASSERT_TRUE(eventually([&] { return log.count() > 0; }, milliseconds(500)));
  std::this_thread::sleep_for(milliseconds(100));
  EXPECT_EQ(log.count(), 1u);  // once
  EXPECT_EQ(log.first(), why);
  EXPECT_EQ(error_of([&] { ch.allgather("late"); }), why);
  EXPECT_EQ(wait_child(victim), 0);
  EXPECT_EQ(wait_child(survivor), 0);
}

TEST(Channel, RankZeroExitDuringAllgatherFailsClients) {
  const std::string job = unique_job("hubexit");
  const pid_t hub = fork_child([&] {
    Channel ch(job, 0, 2, kJoin);
    ch.barrier();
    std::this_thread::sleep_for(milliseconds(150));
    ::_exit(0);
    return 0;
  });
  Channel ch(job, 1, 2, kJoin);
  ch.set_op_timeout(milliseconds(10000));
  ch.barrier();
  const auto t0 = Clock::now();
  const std::string msg = error_of([&] { ch.allgather("x"); });
  EXPECT_LT(ms_since(t0), 3000);
  EXPECT_HAS(msg, "rank 0");
  EXPECT_TRUE(contains(msg, "exited") || contains(msg, "crashed")) << msg;
  EXPECT_LACKS(msg, "timed out");
  EXPECT_EQ(ch.lost_reason(), msg);
  EXPECT_EQ(wait_child(hub), 0);
}

TEST(Channel, RankZeroExitWhileIdleIsNoticedByClients) {
  const std::string job = unique_job("hubidle");
  const pid_t hub = fork_child([&] {
    Channel ch(job, 0, 3, kJoin);
    ch.barrier();
    ::_exit(0);
    return 0;
  });
  const pid_t other = fork_child([&] {
    Channel ch(job, 2, 3, kJoin);
    ch.barrier();
    return eventually([&] { return !ch.lost_reason().empty(); }, milliseconds(3000)) ? 0 : 60;
  });
  Channel ch(job, 1, 3, kJoin);
  LossLog log;
  log.attach(ch);
  ch.barrier();
  const auto t0 = Clock::now();
  ASSERT_TRUE(eventually([&] { return log.count() > 0; }, milliseconds(3000)));
  EXPECT_LT(ms_since(t0), 1000);
  EXPECT_HAS(log.first(), "rank 0");
  EXPECT_EQ(ch.lost_reason(), log.first());
  EXPECT_EQ(error_of([&] { ch.barrier(); }), log.first());
  EXPECT_EQ(wait_child(hub), 0);
  EXPECT_EQ(wait_child(other), 0);
}

TEST(Channel, SkippedCollectiveTimesOutInsteadOfHanging) {
  const std::string job = unique_job("skip");
  std::atomic<bool> rank0_done{false};
  long long waited = -1;
  std::string rank1_lost;
  const auto errs = run_threads(2, [&](int r) {
    Channel ch(job, r, 2, kJoin);
    ch.set_op_timeout(milliseconds(400));
    ch.barrier();
    if (r == 0) {
      const auto t0 = Clock::now();
      try {
        ch.allgather("a collective rank 1 never makes");
      } catch (...) {
        waited = ms_since(t0);
        rank0_done = true;
        throw;
      }
      rank0_done = true;
    } else {
      eventually([&] { return rank0_done.load(); }, milliseconds(4000));
      // Rank 0 gave up and told us why; our monitor picks that up while we are idle.
      eventually([&] { return !ch.lost_reason().empty(); }, milliseconds(2000));
      rank1_lost = ch.lost_reason();
    }
  });
  EXPECT_HAS(errs[0], "host collective #2 timed out after 400 ms waiting for rank 1");
  EXPECT_GE(waited, 350);
  EXPECT_LT(waited, 2500);
  EXPECT_EQ(errs[1], "");
  EXPECT_HAS(rank1_lost, "timed out");
}

TEST(Channel, ClientAllgatherTimesOutWhenRankZeroIsLate) {
  const std::string job = unique_job("latehub");
  std::atomic<bool> client_done{false};
  const auto errs = run_threads(2, [&](int r) {
    Channel ch(job, r, 2, kJoin);
    if (r == 1) {
      ch.set_op_timeout(milliseconds(300));
      const auto t0 = Clock::now();
      const std::string msg = error_of([&] { ch.allgather("early"); });
      client_done = true;
      EXPECT_HAS(msg, "timed out after 300 ms waiting for rank 0");
      EXPECT_GE(ms_since(t0), 250);
      EXPECT_LT(ms_since(t0), 2000);
    } else {
      eventually([&] { return client_done.load(); }, milliseconds(4000));
      // Rank 1 gave up and hung up: rank 0 must not hang either.
      ch.set_op_timeout(milliseconds(3000));
      const auto t0 = Clock::now();
      EXPECT_NE(error_of([&] { ch.allgather("late"); }), "<no exception>");
      EXPECT_LT(ms_since(t0), 2000);
    }
  });
  EXPECT_EQ(errs[0], "");
  EXPECT_EQ(errs[1], "");
}

TEST(Channel, NoFalseAlarmWhileIdleOrWhenAPeerIsAhead) {
  const std::string job = unique_job("calm");
  std::atomic<bool> rank1_waiting{false};
  const auto errs = run_threads(2, [&](int r) {
    Channel ch(job, r, 2, kJoin);
    LossLog log;
    log.attach(ch);
    ch.barrier();
    std::this_thread::sleep_for(milliseconds(150));  // both idle: several monitor rounds
    EXPECT_EQ(ch.lost_reason(), "");
    if (r == 1) {
      rank1_waiting = true;
      EXPECT_EQ(ch.allgather("ahead").data[0], "behind");  // sent before rank 0 even started
    } else {
      eventually([&] { return rank1_waiting.load(); }, milliseconds(2000));
      std::this_thread::sleep_for(milliseconds(150));  // rank 1's data waits unread while we are idle
      EXPECT_EQ(ch.lost_reason(), "");
      EXPECT_EQ(ch.allgather("behind").data[1], "ahead");
    }
    ch.barrier();
    EXPECT_EQ(ch.lost_reason(), "");
    EXPECT_EQ(log.count(), 0u);
  });
  EXPECT_EQ(errs[0], "");
  EXPECT_EQ(errs[1], "");
}

// A hand-written peer that follows the wire format of channel.cpp (kept in sync with it) but sends the
// wrong collective number: rank 0 must report it instead of waiting.
TEST(Channel, OutOfOrderCollectiveIsReported) {
  struct Header {
    uint32_t magic, type, seq;
    int32_t src;
    uint64_t len;
    int32_t has_fd, reserved;
  };
  static_assert(sizeof(Header) == 32);
  const std::string job = unique_job("seq");
  const int fds_before = count_open_fds();
  std::string hub_err;
  std::jthread hub([&] {
    hub_err = error_of([&] {
      Channel ch(job, 0, 2, milliseconds(4000));
      ch.set_op_timeout(milliseconds(4000));
      ch.allgather("rank 0 in #1");
    });
  });
  ASSERT_TRUE(wait_for_listener(job));
  const int s = raw_connect(job);
  ASSERT_GE(s, 0);
  const long hello_payload[2] = {2, static_cast<long>(::getpid())};
  const Header hello{0x74666577, 1, 0, 1, sizeof(hello_payload), 0, 0};
  ASSERT_EQ(::send(s, &hello, sizeof(hello), MSG_NOSIGNAL), 32);
  ASSERT_EQ(::send(s, hello_payload, sizeof(hello_payload), MSG_NOSIGNAL), 16);
  Header welcome{};
  ASSERT_EQ(::recv(s, &welcome, sizeof(welcome), MSG_WAITALL), 32);
  EXPECT_EQ(welcome.type, 2u);
  // "Collective #9", with a descriptor attached: rank 0 must not keep it after rejecting the message.
  const int memfd = make_memfd("unwanted");
  ASSERT_GE(memfd, 0);
  const auto t0 = Clock::now();
  Header data{0x74666577, 3, 9, 1, 0, 1, 0};
  iovec iov{&data, sizeof(data)};
  alignas(cmsghdr) char ctrl[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = ctrl;
  msg.msg_controllen = sizeof(ctrl);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &memfd, sizeof(int));
  ASSERT_EQ(::sendmsg(s, &msg, MSG_NOSIGNAL), 32);
  ::close(memfd);
  hub.join();
  // The hub's Channel is gone; only our raw socket is left of the test's descriptors.
  EXPECT_EQ(count_open_fds(), fds_before + 1) << "a received descriptor leaked";
  EXPECT_LT(ms_since(t0), 2000);
  EXPECT_HAS(hub_err, "out of order");
  EXPECT_HAS(hub_err, "#9");
  EXPECT_HAS(hub_err, "#1");
  // Rank 0 tells the peer why before hanging up.
  Header err{};
  ASSERT_EQ(::recv(s, &err, sizeof(err), MSG_WAITALL), 32);
  EXPECT_EQ(err.type, 4u);
  std::string text(err.len, '\0');
  ASSERT_EQ(::recv(s, text.data(), text.size(), MSG_WAITALL), static_cast<ssize_t>(text.size()));
  EXPECT_HAS(text, "out of order");
  ::close(s);
}

TEST(Channel, NormalDepartureIsToldApartFromACrash) {
  const std::string job = unique_job("bye");
  std::thread leaver([&] {
    Channel ch(job, 1, 2, kJoin);
    ch.barrier();
  });  // destroyed normally: says goodbye
  Channel ch(job, 0, 2, kJoin);
  ch.barrier();
  leaver.join();
  // A normal departure is noted, not a loss: this rank may still finish work that needs nothing more from
  // the peer (a slower rank checking its results while the faster one has already gone).
  ASSERT_TRUE(eventually([&] { return !ch.departed_reason().empty(); }, milliseconds(3000)));
  EXPECT_HAS(ch.departed_reason(), "rank 1 left the job");
  EXPECT_LACKS(ch.departed_reason(), "crashed");
  std::this_thread::sleep_for(milliseconds(100));  // several monitor rounds: still not lost
  EXPECT_EQ(ch.lost_reason(), "");
  // A collective with the departed rank fails at once, naming the departure.
  const auto t0 = std::chrono::steady_clock::now();
  const std::string err = error_of([&] { ch.barrier(); });
  EXPECT_HAS(err, "left the job");
  EXPECT_LT(ms_since(t0), 1000);
}

TEST(Channel, LeavingOnAnExceptionFailsThePeersFast) {
  const std::string job = unique_job("unwind");
  std::thread leaver([&] {
    try {
      Channel ch(job, 1, 2, kJoin);
      ch.barrier();
      throw std::runtime_error("the rank's own failure");
    } catch (std::runtime_error&) {
    }
  });  // destroyed while the exception propagates: an error report, not a goodbye
  Channel ch(job, 0, 2, kJoin);
  ch.barrier();
  leaver.join();
  ASSERT_TRUE(eventually([&] { return !ch.lost_reason().empty(); }, milliseconds(3000)));
  EXPECT_HAS(ch.lost_reason(), "rank 1 left the job on an error");
}

// A rank that gives up (Communicator::abort: report_failure) tells the others at once, through rank 0 for a
// client, with its reason; while idle and while a collective of another thread holds the channel.
TEST(Channel, ReportedFailureReachesEveryRankWithItsReason) {
  constexpr int kWorld = 3;
  const std::string job = unique_job("report");
  const pid_t reporter = fork_child([&] {
    Channel ch(job, 2, kWorld, kJoin);
    ch.barrier();
    ch.report_failure("its NCCL leg failed");
    if (!contains(ch.lost_reason(), "rank 2 gave up: its NCCL leg failed")) return 60;
    if (!contains(error_of([&] { ch.barrier(); }), "gave up")) return 61;
    std::this_thread::sleep_for(milliseconds(300));  // the report goes out before the goodbye
    return 0;
  });
  const pid_t other = fork_child([&] {
    Channel ch(job, 1, kWorld, kJoin);
    ch.barrier();
    if (!eventually([&] { return !ch.lost_reason().empty(); }, milliseconds(3000))) return 62;
    if (!contains(ch.lost_reason(), "its NCCL leg failed")) {
      weft_test::child_note("rank 1 lost_reason: " + ch.lost_reason());
      return 63;
    }
    return 0;
  });
  Channel ch(job, 0, kWorld, kJoin);
  ch.barrier();
  const auto t0 = Clock::now();
  ASSERT_TRUE(eventually([&] { return !ch.lost_reason().empty(); }, milliseconds(3000)));
  EXPECT_LT(ms_since(t0), 1000);
  EXPECT_HAS(ch.lost_reason(), "rank 2 gave up: its NCCL leg failed");
  EXPECT_EQ(wait_child(reporter), 0);
  EXPECT_EQ(wait_child(other), 0);
}

TEST(Channel, ReportedFailureDuringACollectiveFailsItAndThePeers) {
  const std::string job = unique_job("reportbusy");
  const pid_t peer = fork_child([&] {
    Channel ch(job, 1, 2, kJoin);
    ch.barrier();
    // Rank 0 is inside a barrier this rank never joins; the report closes the connection under it.
    if (!eventually([&] { return !ch.lost_reason().empty(); }, milliseconds(5000))) return 70;
    return 0;
  });
  Channel ch(job, 0, 2, kJoin);
  ch.barrier();
  std::string in_barrier;
  std::thread waiter([&] { in_barrier = error_of([&] { ch.barrier(); }); });
  std::this_thread::sleep_for(milliseconds(200));  // the barrier holds the channel now
  const auto t0 = Clock::now();
  ch.report_failure("a device wait failed");
  waiter.join();
  EXPECT_LT(ms_since(t0), 2000);
  EXPECT_FALSE(in_barrier.empty());
  EXPECT_EQ(wait_child(peer), 0);
}
