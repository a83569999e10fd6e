// The rendezvous of a job whose ranks span hosts (the multi-node runtime's first piece, issue 58): rank 0
// listens on a TCP port (MASTER_ADDR:MASTER_PORT-style, the address every rank can reach), every other rank
// connects, and each allgather() hands every rank every rank's bytes (the NCCL unique id, host names, ...).
//
// What it trusts: TCP peers carry no credentials to check (unlike the node-local Channel's SO_PEERCRED), so a
// connection counts only once its hello carries the job's secret (WEFT_JOB_SECRET; required: an empty secret
// is refused at construction). A connection with a wrong secret, another world size, a rank out of range or
// one already taken is refused (said on stderr with the peer's address) and the real rank is still awaited.
// A rank that has not come within the timeout fails every waiting rank with the missing ranks named; a peer
// that closes mid-call fails the call.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace weft {

class TcpRendezvous {
 public:
  // Rank 0 listens on `port` on every interface (port 0: a free one, see port()); the others connect to
  // host:port (retrying lookups and connections until the timeout: rank 0 may start later) and greet.
  // Throws weft::Error with the reason.
  TcpRendezvous(const std::string& host, int port, int rank, int world, std::string secret,
                std::chrono::milliseconds timeout);
  ~TcpRendezvous();
  TcpRendezvous(const TcpRendezvous&) = delete;
  TcpRendezvous& operator=(const TcpRendezvous&) = delete;

  // Every rank's `mine`, by rank. Collective: every rank calls it, the same number of times. Rank 0's first
  // call also admits the other ranks.
  std::vector<std::string> allgather(const std::string& mine);

  int port() const { return port_; }  // the port rank 0 listens on
  int rank() const { return rank_; }
  int world() const { return world_; }

 private:
  void admit();  // rank 0: accept greetings until every rank is in
  std::string judge(const std::string& hello, int* rank) const;
  int rank_, world_, port_ = 0;
  std::string secret_;
  std::chrono::milliseconds timeout_;
  int listen_fd_ = -1;
  std::vector<int> peers_;  // rank 0: the socket of rank r (index r; -1 for itself); others: [0] to rank 0
  bool admitted_ = false;
  uint32_t calls_ = 0;  // allgather calls made
};

}  // namespace weft
