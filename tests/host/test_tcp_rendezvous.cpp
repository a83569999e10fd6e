// TcpRendezvous (weft/runtime/tcp_rendezvous.hpp): ranks on 127.0.0.1 in threads of this process. Every rank
// gets every rank's bytes, call after call; a connection without the job's secret is refused while the real
// rank still joins; a rank that never comes fails rank 0 with its number; no secret, no rendezvous.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <future>
#include <memory>
#include <string>
#include <vector>

#include "weft/runtime/error.hpp"
#include "weft/runtime/tcp_rendezvous.hpp"

using weft::TcpRendezvous;
using namespace std::chrono_literals;

namespace {
const std::string kSecret = "0123456789abcdef-job";

// Ranks 1 .. world - 1 of a job whose rank 0 listens on `port`: each calls allgather `calls` times with
// "r<rank>c<call>" and returns what it got, flattened.
std::vector<std::future<std::vector<std::string>>> start_ranks(int port, int world, int calls) {
  std::vector<std::future<std::vector<std::string>>> out;
  for (int r = 1; r < world; ++r)
    out.push_back(std::async(std::launch::async, [=] {
      TcpRendezvous t("127.0.0.1", port, r, world, kSecret, 5000ms);
      std::vector<std::string> got;
      for (int c = 0; c < calls; ++c)
        for (const std::string& s : t.allgather("r" + std::to_string(r) + "c" + std::to_string(c)))
          got.push_back(s);
      return got;
    }));
  return out;
}

std::vector<std::string> expected(int world, int calls) {
  std::vector<std::string> want;
  for (int c = 0; c < calls; ++c)
    for (int r = 0; r < world; ++r) want.push_back("r" + std::to_string(r) + "c" + std::to_string(c));
  return want;
}
}  // namespace

TEST(TcpRendezvous, EveryRankGetsEveryRanksBytes) {
  for (int world : {1, 2, 4}) {
    TcpRendezvous root("127.0.0.1", 0, 0, world, kSecret, 5000ms);
    ASSERT_GT(root.port(), 0);
    auto others = start_ranks(root.port(), world, 3);
    std::vector<std::string> got;
    for (int c = 0; c < 3; ++c)
      for (const std::string& s : root.allgather("r0c" + std::to_string(c))) got.push_back(s);
    EXPECT_EQ(got, expected(world, 3));
    for (auto& f : others) EXPECT_EQ(f.get(), expected(world, 3));
  }
}

TEST(TcpRendezvous, WrongSecretIsRefusedAndTheRealRankStillJoins) {
  TcpRendezvous root("127.0.0.1", 0, 0, 2, kSecret, 5000ms);
  // An impostor claiming rank 1 with another secret has greeted first (its constructor returns once it has):
  // refused, and told so at its call.
  auto impostor =
      std::make_shared<TcpRendezvous>("127.0.0.1", root.port(), 1, 2, "another-secret-of-16+", 3000ms);
  auto refused = std::async(std::launch::async, [impostor] { return impostor->allgather("stolen?"); });
  auto real = start_ranks(root.port(), 2, 1);
  EXPECT_EQ(root.allgather("r0c0"), (std::vector<std::string>{"r0c0", "r1c0"}));
  EXPECT_EQ(real[0].get(), expected(2, 1));
  try {
    refused.get();
    FAIL() << "the impostor got data";
  } catch (const weft::Error& e) {
    EXPECT_NE(std::string(e.what()).find("refused this rank"), std::string::npos) << e.what();
  }
}

// A connection that never greets holds up no one: the real rank is admitted beside it.
TEST(TcpRendezvous, SilentConnectionsDoNotStallAdmission) {
  TcpRendezvous root("127.0.0.1", 0, 0, 2, kSecret, 5000ms);
  std::vector<int> silent;  // raw sockets that connect and stay silent
  for (int i = 0; i < 3; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(root.port()));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    silent.push_back(fd);
  }
  auto real = start_ranks(root.port(), 2, 1);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(root.allgather("r0c0"), (std::vector<std::string>{"r0c0", "r1c0"}));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 900ms);
  EXPECT_EQ(real[0].get(), expected(2, 1));
  for (int fd : silent) ::close(fd);
}

// A rank that makes more calls than rank 0 fails (once rank 0 is gone) instead of waiting for ever.
TEST(TcpRendezvous, ExtraCallsFailInsteadOfHanging) {
  auto root = std::make_unique<TcpRendezvous>("127.0.0.1", 0, 0, 2, kSecret, 5000ms);
  auto ahead = std::async(std::launch::async, [port = root->port()] {
    TcpRendezvous t("127.0.0.1", port, 1, 2, kSecret, 5000ms);
    t.allgather("a");
    t.allgather("b");  // rank 0 makes one call only
  });
  EXPECT_EQ(root->allgather("x").size(), 2u);
  const auto t0 = std::chrono::steady_clock::now();
  root.reset();
  EXPECT_THROW(ahead.get(), weft::Error);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2000ms);
}

TEST(TcpRendezvous, AMissingRankIsNamed) {
  TcpRendezvous root("127.0.0.1", 0, 0, 3, kSecret, 300ms);
  auto one = start_ranks(root.port(), 2, 0);  // rank 1 of a world of 2 greets: refused (world 3)
  try {
    root.allgather("x");
    FAIL() << "no error";
  } catch (const weft::Error& e) {
    EXPECT_NE(std::string(e.what()).find("ranks 1, 2 did not join"), std::string::npos) << e.what();
  }
  for (auto& f : one) f.get();
}

TEST(TcpRendezvous, NeedsASecret) {
  EXPECT_THROW(TcpRendezvous("127.0.0.1", 0, 0, 2, "", 100ms), weft::Error);
  EXPECT_THROW(TcpRendezvous("127.0.0.1", 0, 0, 2, "short", 100ms), weft::Error);
  EXPECT_THROW(TcpRendezvous("127.0.0.1", 0, 2, 2, kSecret, 100ms), weft::Error);
}
