// Launcher-free rendezvous and host-side collectives between the processes of one job on one node.
//
// Rank 0 listens on an abstract Unix domain socket named after the job id ("\0weft.<job>": no file to clean
// up, gone when the process dies); the other ranks connect to it. Messages carry at most one file descriptor
// (SCM_RIGHTS), which is how the CUDA VMM handles of the symmetric heap travel. Rank 0 relays everything,
// so a W-rank job holds W-1 connections.
//
// A background monitor notices a peer process that dies (its socket closes without a goodbye) or fails (an
// error report) even while no collective is in flight, marks the channel lost and calls the on_peer_lost
// callback (the communicator raises the device abort flag there, so spinning kernels fail within
// milliseconds instead of hanging). Rank 0 forwards the loss to every other rank.
// A peer that leaves normally (the goodbye its destructor sends) has finished its part of the job, and a
// slower rank may still be finishing work of its own that needs nothing more from it: that is noted
// (departed_reason), not treated as a loss. A later collective with it fails at once; a device wait on it
// times out, and the communicator names the departure in that message. A destructor that runs while an
// exception unwinds sends an error report instead, so the peers fail fast.
#pragma once
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace weft {

// Whether two job secrets are equal, in time independent of where they differ.
bool secrets_equal(const std::string& a, const std::string& b);

class Channel {
 public:
  struct Gathered {
    std::vector<std::string> data;  // data[r]: what rank r contributed
    std::vector<int> fds;           // fds[r]: rank r's descriptor, owned by the caller (-1: none, or self)
  };

  // Blocks until all `world` ranks of `job_id` are connected, or throws after `timeout`. Only processes of
  // this process's uid take part (both ends check the kernel's record of the peer). With a `secret` (the
  // job's WEFT_JOB_SECRET), the socket's name also carries a hash of it (a name nobody without it can take
  // first) and rank 0 admits only connections whose greeting carries it; other connections are refused and
  // the real rank is still waited for.
  Channel(std::string job_id, int rank, int world, std::chrono::milliseconds timeout,
          std::string secret = {});
  ~Channel();
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  int rank() const { return rank_; }
  int world() const { return world_; }
  const std::string& socket_name() const { return name_; }

  // Every rank contributes `data` and optionally one descriptor (sent as a duplicate; the caller keeps its
  // own). All ranks must call the same sequence of collectives; a mismatch is reported, not hung on.
  Gathered allgather(std::string_view data, int fd = -1);
  void barrier();

  // Called once when the channel is lost: from the monitor thread while idle (a peer died or left), or
  // from the thread whose collective failed. It runs under the channel's lock: it must not call back
  // into the channel.
  void set_on_peer_lost(std::function<void(const std::string&)> cb);
  // Non-empty once the channel is lost; every later collective throws this message.
  std::string lost_reason() const;
  // Non-empty once a peer has left normally (its goodbye arrived while no collective was in flight).
  std::string departed_reason() const;
  // Tells every peer this rank gave up (`why`: an error report, as a destructor unwinding on an exception
  // sends; rank 0 relays it to every rank) and closes the connections: the peers' monitors raise their abort
  // flags within milliseconds instead of waiting for their timeouts. Thread-safe. Where a collective holds
  // the channel (waiting on its peers), no report can go in between: the connections are closed under it,
  // which fails it and which the peers read as this rank's loss. The channel is lost from then on.
  void report_failure(const std::string& why);
  // Per-collective wait limit (default: the constructor's timeout).
  void set_op_timeout(std::chrono::milliseconds t) { op_timeout_ = t; }

 private:
  struct Peer {
    int sock = -1;
    long pid = 0;
    bool departed = false;  // said goodbye: the monitor stops watching it
  };
  void hub_accept(std::chrono::steady_clock::time_point deadline);
  void client_connect(std::chrono::steady_clock::time_point deadline);
  [[noreturn]] void fail(const std::string& why);
  void monitor_loop();
  void stop_monitor();

  std::string job_id_, secret_, name_;
  int rank_ = 0, world_ = 1;
  int listen_sock_ = -1;
  std::vector<Peer> peers_;  // hub: indexed by rank (peers_[0] unused); client: peers_[0] is the hub
  uint32_t seq_ = 0;
  std::chrono::milliseconds op_timeout_;

  mutable std::mutex io_mu_;  // held by collectives; the monitor only looks when it is free
  std::string lost_;
  std::string departed_;
  std::function<void(const std::string&)> on_lost_;
  std::atomic<bool> stop_{false};
  std::thread monitor_;
};

}  // namespace weft
