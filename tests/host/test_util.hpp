// Helpers shared by the host tests: error capture, substring checks, forked ranks with hard time limits.
#pragma once
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <thread>

#include "weft/runtime/error.hpp"

namespace weft_test {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

inline long long ms_since(Clock::time_point t0) {
  return std::chrono::duration_cast<milliseconds>(Clock::now() - t0).count();
}

// Runs f and returns the message of the weft::Error it throws; "<no exception>" if it returns normally.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const weft::Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("<not a weft::Error> ") + e.what();
  }
  return "<no exception>";
}

inline ::testing::AssertionResult HasSubstrPred(const char* hay_expr, const char* needle_expr,
                                                const std::string& hay, const std::string& needle) {
  if (hay.find(needle) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << hay_expr << " does not contain " << needle_expr << "\n  actual: \""
                                       << hay << "\"\n  wanted: \"" << needle << "\"";
}
#define EXPECT_HAS(hay, needle) EXPECT_PRED_FORMAT2(::weft_test::HasSubstrPred, hay, needle)
#define EXPECT_LACKS(hay, needle) EXPECT_EQ(std::string(hay).find(needle), std::string::npos) << (hay)

// A job id no other test (or concurrent run of this binary) uses.
inline std::string unique_job(const std::string& tag) {
  static std::atomic<int> counter{0};
  return "t-" + tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
}

inline bool contains(const std::string& hay, const std::string& needle) {
  return hay.find(needle) != std::string::npos;
}

// In a forked child: report a failed expectation on stderr and pick an exit code.
inline void child_note(const std::string& what) {
  const std::string line = "[forked child " + std::to_string(::getpid()) + "] " + what + "\n";
  [[maybe_unused]] ssize_t n = ::write(2, line.data(), line.size());
}

// Forks a child that runs body() and _exits with its return value (never returns into gtest). An exception
// becomes exit code 100; SIGALRM kills the child if it is still running after `limit_s` seconds.
template <class F>
pid_t fork_child(F&& body, unsigned limit_s = 15) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  ::alarm(limit_s);
  int code = 101;
  try {
    code = body();
  } catch (const std::exception& e) {
    child_note(std::string("uncaught exception: ") + e.what());
    code = 100;
  } catch (...) {
    child_note("uncaught non-standard exception");
    code = 100;
  }
  ::_exit(code);
}

// Waits for `pid`; kills it (and fails the test) if it runs past `limit`. Returns the exit code, or
// 128 + signal for a child killed by a signal, or -1 when the wait itself failed.
inline int wait_child(pid_t pid, milliseconds limit = milliseconds(10000)) {
  const auto deadline = Clock::now() + limit;
  for (;;) {
    int st = 0;
    const pid_t r = ::waitpid(pid, &st, WNOHANG);
    if (r == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    if (r < 0) {
      ADD_FAILURE() << "waitpid(" << pid << "): " << std::strerror(errno);
      return -1;
    }
    if (Clock::now() >= deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &st, 0);
      ADD_FAILURE() << "child " << pid << " still running after " << limit.count() << " ms: killed";
      return -1;
    }
    std::this_thread::sleep_for(milliseconds(2));
  }
}

// A TCP port free on 127.0.0.1 a moment ago (bound to port 0, read, closed): for a listener that other
// processes must know in advance. 0 if none could be bound.
inline int free_tcp_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

}  // namespace weft_test
