#include "weft/runtime/multi_node.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "nccl_api.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/job_rendezvous.hpp"

namespace weft {

namespace {

// An NCCL communicator of `size` ranks (this one `rank`) whose id the rank `maker` (a global rank) drew:
// every rank of the job takes part in the allgather that carries the ids, whichever communicator it joins.
nccl::Comm make_comm(JobRendezvous& job, bool draws, int maker, int size, int rank, const std::string& what) {
  std::string mine;
  if (draws) {
    nccl::UniqueId id{};
    nccl::check(nccl::api().GetUniqueId(&id), "weft: ncclGetUniqueId (" + what + ")");
    mine.assign(id.internal, sizeof id.internal);
  }
  const std::vector<std::string> ids = job.allgather(mine);
  WEFT_CHECK(ids[maker].size() == sizeof(nccl::UniqueId),
             "multi-node team: rank " + std::to_string(maker) + " sent no NCCL id for " + what);
  nccl::UniqueId id{};
  std::memcpy(id.internal, ids[maker].data(), sizeof id.internal);
  nccl::Comm comm = nullptr;
  nccl::check(nccl::api().CommInitRank(&comm, size, id, rank), "weft: ncclCommInitRank (" + what + ")");
  return comm;
}

}  // namespace

std::unique_ptr<MultiNodeTeam> MultiNodeTeam::create(Options opts) {
  const auto env = opts.env ? opts.env : parse_launch_env(process_env(), static_cast<long>(::getppid()));
  WEFT_CHECK(env.has_value(),
             "a multi-node team needs a launcher (torchrun, mpirun or weft-launch): its ranks "
             "are processes");
  return create_from_launcher(*env, std::move(opts));
}

std::unique_ptr<MultiNodeTeam> MultiNodeTeam::create_from_launcher(const LaunchEnv& env, Options opts) {
  std::unique_ptr<MultiNodeTeam> t(new MultiNodeTeam());
  t->rank_ = env.rank;
  t->world_ = env.world;
  t->node_index_ = env.node;
  t->nodes_ = env.nodes;
  t->node_size_ = env.node_size;
  const auto timeout = std::max(opts.timeout, std::chrono::milliseconds(60000));
  RendezvousAddress leaders;
  if (env.nodes > 1) leaders = leaders_address(process_env(), env.launcher);
  if (env.nodes > 1) nccl::api();  // NCCL missing: say so before anything waits on the other ranks
  t->job_ = std::make_unique<JobRendezvous>(env, leaders, timeout);
  // This node's team: the node's ranks only (its own rendezvous name, so fake nodes of one host stay apart);
  // local_rank still picks the GPU.
  LaunchEnv in_node = env;
  in_node.rank = env.rank % env.node_size;
  in_node.world = env.node_size;
  in_node.node = 0;
  in_node.nodes = 1;
  if (env.nodes > 1) in_node.job_id = env.job_id + ".team" + std::to_string(env.node);
  t->node_ = Communicator::create_from_launcher(in_node, opts);
  WEFT_CUDA_CHECK(cudaSetDevice(t->node_rank().device()));
  // NCCL: every rank (rank 0 draws the id), then the i-th ranks of the nodes (node 0's i-th rank draws).
  const int i = env.rank % env.node_size;
  t->all_ = make_comm(*t->job_, env.rank == 0, 0, env.world, env.rank, "every rank");
  t->across_ = make_comm(*t->job_, env.node == 0, i, env.nodes, env.node,
                         "rank " + std::to_string(i) + " of every node");
  t->job_.reset();  // the rendezvous is over: its sockets closed (the node team keeps its own channel)
  t->watchdog_ = std::thread([self = t.get()] { self->watch(); });
  return t;
}

namespace {
// Aborts both communicators at once (one thread each): each abort raises its own kernels' flag first, then
// waits for them, and a kernel of one may sit on the stream in front of the other's.
void abort_both(nccl::Comm a, nccl::Comm b) {
  std::thread second([b] {
    if (b) nccl::api().CommAbort(b);
  });
  if (a) nccl::api().CommAbort(a);
  second.join();
}
}  // namespace

// Teardown aborts the communicators rather than destroying them: ncclCommDestroy waits for queued work, which
// waits for ever if a peer died after the last call (synchronize() first: work still queued is cut off).
MultiNodeTeam::~MultiNodeTeam() {
  stop_ = true;
  if (watchdog_.joinable()) watchdog_.join();
  if (node_) cudaSetDevice(node_rank().device());  // (none when the construction failed before it)
  abort_both(static_cast<nccl::Comm>(across_), static_cast<nccl::Comm>(all_));
  if (scratch_ || !retired_.empty() || side_.stream) cudaDeviceSynchronize();
  for (void* p : retired_) cudaFree(p);
  if (scratch_) cudaFree(scratch_);
  if (side_.stream) {
    for (int p = 0; p < kSidePieces; ++p) {
      cudaEventDestroy(side_.fork[p]);
      cudaEventDestroy(side_.join[p]);
    }
    cudaStreamDestroy(side_.stream);
  }
}

// The node team first (its kernels stop waiting), then the communicators, outside the lock: a thread blocked
// in an NCCL enqueue (it holds no lock; see nccl_call) returns once its communicator's abort flag is up.
void MultiNodeTeam::fail(const std::string& why) {
  void *across = nullptr, *all = nullptr;
  {
    std::lock_guard<std::mutex> hold(nccl_lock_);
    if (!failure_.empty()) return;
    failure_ = why;
    std::swap(across, across_);
    std::swap(all, all_);
  }
  node_->abort(why);
  cudaSetDevice(node_rank().device());
  abort_both(static_cast<nccl::Comm>(across), static_cast<nccl::Comm>(all));
}

void MultiNodeTeam::watch() {
  const std::pair<void*, const char*> comms[] = {{across_, "between nodes"}, {all_, "over every rank"}};
  // The node team's device error record, read through a stream of the watchdog's own into pinned memory: a
  // device wait that failed inside the node (a timeout, a peer's failure) fails the NCCL legs too, which
  // would otherwise wait for this rank's part for ever. This thread's CUDA calls in relaxed capture mode:
  // they touch only its own stream and memory, and must not disturb a CUDA graph another thread is capturing
  // (global mode's rule). A failure of the probe itself stops the probing, not the team.
  cudaStream_t probe = nullptr;
  DeviceError* seen = nullptr;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  if (cudaThreadExchangeStreamCaptureMode(&mode) != cudaSuccess ||
      cudaSetDevice(node_rank().device()) != cudaSuccess ||
      cudaStreamCreateWithFlags(&probe, cudaStreamNonBlocking) != cudaSuccess ||
      cudaMallocHost(&seen, sizeof(DeviceError)) != cudaSuccess) {
    if (probe) cudaStreamDestroy(probe);
    probe = nullptr;  // then only NCCL's errors and the node team's abort flag are watched
    cudaGetLastError();
  }
  const auto device_failed = [&] {
    const DeviceError* record = node_rank().view().error;
    if (!probe || !record) return false;
    if (cudaMemcpyAsync(seen, record, sizeof(DeviceError), cudaMemcpyDeviceToHost, probe) != cudaSuccess ||
        cudaStreamSynchronize(probe) != cudaSuccess) {
      cudaGetLastError();
      cudaStreamDestroy(probe);
      probe = nullptr;
      return false;
    }
    return seen->code != static_cast<uint32_t>(DeviceErrorCode::kNone);
  };
  while (!stop_) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (node_->aborted()) {
      fail("weft: rank " + std::to_string(rank_) + ": the node's team gave up (a rank of node " +
           std::to_string(node_index_) + " was lost or failed); the NCCL communicators were aborted");
      break;
    }
    if (device_failed()) {
      std::string why = "its error record says so";
      try {
        node_->check_device_errors(probe);
      } catch (const std::exception& e) {
        why = e.what();
      }
      fail("weft: rank " + std::to_string(rank_) + ": a device wait of node " + std::to_string(node_index_) +
           "'s team failed (" + why + "); the NCCL communicators were aborted");
      break;
    }
    for (auto [comm, what] : comms) {
      int status = nccl::kSuccess;
      if (nccl::api().CommGetAsyncError(static_cast<nccl::Comm>(comm), &status) != nccl::kSuccess) continue;
      if (status != nccl::kSuccess && status != nccl::kInProgress) {
        const char* text = nccl::api().GetErrorString(status);
        fail("weft: rank " + std::to_string(rank_) + ": NCCL reported error " + std::to_string(status) +
             " (" + (text ? text : "?") + ") on its communicator " + what +
             " (a rank of another node died or its network failed); the team was aborted");
        stop_ = true;
        break;
      }
    }
  }
  if (probe) cudaStreamDestroy(probe);
  if (seen) cudaFreeHost(seen);
}

void MultiNodeTeam::check_alive() const {
  std::lock_guard<std::mutex> hold(nccl_lock_);
  if (!failure_.empty()) throw_error(failure_);
}

const MultiNodeTeam::SideStream& MultiNodeTeam::side_stream() {
  if (!side_.stream) {
    int caller_device = 0;
    WEFT_CUDA_CHECK(cudaGetDevice(&caller_device));
    WEFT_CUDA_CHECK(cudaSetDevice(node_rank().device()));
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&side_.stream, cudaStreamNonBlocking));
    for (int p = 0; p < kSidePieces; ++p) {
      WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&side_.fork[p], cudaEventDisableTiming));
      WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&side_.join[p], cudaEventDisableTiming));
    }
    WEFT_CUDA_CHECK(cudaSetDevice(caller_device));
  }
  return side_;
}

void* MultiNodeTeam::scratch(size_t bytes, cudaStream_t stream) {
  if (bytes > scratch_bytes_) {
    int caller_device = 0;
    WEFT_CUDA_CHECK(cudaGetDevice(&caller_device));
    WEFT_CUDA_CHECK(cudaSetDevice(node_rank().device()));
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    WEFT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
    WEFT_CHECK(capturing == cudaStreamCaptureStatusNone, "multi-node team: scratch of " +
                                                             std::to_string(bytes) +
                                                             " bytes needed during a graph capture: "
                                                             "run the call once before capturing");
    // The outgrown buffer stays allocated until the team ends: calls queued on any stream, or captured in a
    // graph, may still use it. Growth doubles, so they are few.
    if (scratch_) retired_.push_back(scratch_);
    scratch_ = nullptr;
    const size_t grown = std::max(bytes, 2 * scratch_bytes_);
    WEFT_CUDA_CHECK(cudaMalloc(&scratch_, grown));
    scratch_bytes_ = grown;
    WEFT_CUDA_CHECK(cudaSetDevice(caller_device));
  }
  return scratch_;
}

}  // namespace weft
