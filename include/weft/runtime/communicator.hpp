// The host runtime: a team of ranks, their symmetric heaps, and device error reporting.
//
// Two ways to make one:
//   single-process   one process drives every chosen GPU (default: all visible). Kernels synchronize through
//                    device flags, so one host thread may launch a collective on each device in turn.
//                    With ranks_per_gpu = k > 1 each GPU hosts k "virtual ranks" (a team of k x GPUs ranks,
//                    e.g. 4 ranks on one GPU): each has its own heap, signal pad, workspace and stream, and
//                    maps its peers' memory through exported handles as processes do, so every multi-rank
//                    protocol runs on a single GPU. They share one L2 and one memory, so a missing
//                    system-scope fence can pass there that fails between GPUs.
//   one per process  torchrun / mpirun / weft-launch start one process per GPU; the processes meet through
//                    a Unix-socket rendezvous (weft/runtime/channel.hpp) and exchange CUDA VMM handles.
// Communicator::create() picks the mode from the environment.
//
// Symmetric heap: each rank reserves the same virtual span; every collective alloc() lands at the same
// offset on every rank and is mapped into every rank's address space, so a kernel reaches a peer's copy at
// peer_base[r] + offset (TeamView::peer_ptr).
//
// SM budget: the SMs that one rank's kernels may occupy at once. Every kernel of weft that waits for peers
// (or is persistent) sizes its grid from it, so that the blocks of every rank sharing a GPU are resident
// together (a spinning block whose peer cannot be scheduled waits for ever). Default: the GPU's SMs divided
// by the ranks on it; on real GPUs a smaller budget leaves SMs to concurrent work (NCCL's max CTAs, DeepEP's
// num_sms). The same on every rank of a team (the smallest asked for).
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>

#include <chrono>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/resources.hpp"
#include "weft/team_view.hpp"
#include "weft/timeline.hpp"

namespace weft {

class Channel;
class HeapAllocator;

// Why CUDA cannot be used here ("" when at least one GPU is visible): no NVIDIA driver, a driver older than
// the CUDA runtime weft was built with, or no visible GPU. Every weft entry point that finds no GPU says
// this.
std::string cuda_unavailable_reason();

struct Options {
  std::vector<int> devices;  // single-process: CUDA device ordinals (default: all visible)
  int ranks_per_gpu = 0;     // single-process: ranks on each device (0: WEFT_RANKS_PER_GPU, else 1)
  int sm_budget = 0;         // SMs per rank (0: WEFT_SM_BUDGET, else SMs / ranks on the GPU)
  uint64_t heap_bytes = 0;   // virtual span per rank (0: WEFT_HEAP_BYTES, else the GPU's memory)
  std::chrono::milliseconds timeout{0};  // device waits and host collectives (0: WEFT_TIMEOUT_MS, else 10 s)
  std::optional<LaunchEnv> env;          // one-per-process: overrides the process environment (tests)
};

// What a rank's kernels recorded between Communicator::timeline_start and timeline_take (weft/timeline.hpp).
struct TimelineRecord {
  int rank = 0;                       // the team rank
  std::vector<TimelineEvent> events;  // by time
  uint64_t dropped = 0;               // marks past the buffer's capacity (not stored)
};
// The events a timeline buffer in device memory (of the current device) holds, by time; its stream's work
// complete. What timeline_take returns; also for buffers an op was handed directly
// (AttentionOptions::timeline).
TimelineRecord read_timeline(const TimelineBuffer* buffer, int rank = 0);

// A collective allocation: the same offset and size on every rank.
struct SymmetricBuffer {
  uint64_t offset = 0;
  uint64_t bytes = 0;        // rounded up to the heap granularity
  std::vector<char*> local;  // local[i]: the buffer on this process's i-th rank
  explicit operator bool() const { return bytes != 0; }
};

class Rank {
 public:
  int rank() const { return view_.rank; }
  int world() const { return view_.world; }
  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  // SMs this rank's kernels may occupy at once (the grid of a kernel that waits for peers); the same on
  // every rank of the team.
  int sm_budget() const { return sm_budget_; }
  // The multiprocessors of this rank's GPU.
  int device_sms() const { return device_sms_; }
  // The device view to pass to kernels.
  const TeamView& view() const { return view_; }
  // Rank r's heap as mapped in this rank's address space.
  char* heap_of(int r) const { return heap_of_[r]; }
  // Rank r's copy of `local`, a pointer into this rank's heap (host side of TeamView::peer_ptr).
  template <class T>
  T* peer_ptr(T* local, int r) const {
    return reinterpret_cast<T*>(heap_of_[r] + (reinterpret_cast<const char*>(local) - heap_of_[view_.rank]));
  }
  template <class T = char>
  T* at(const SymmetricBuffer& b, int r, uint64_t byte_offset = 0) const {
    return reinterpret_cast<T*>(heap_of_[r] + b.offset + byte_offset);
  }
  // Sub-teams (Communicator::subteam). The rank of the whole team this one stands for (itself when it is
  // one), the team rank of member r, and the name of its split ("": the whole team), which suffixes the
  // names of the resources and workspace areas its ops are granted.
  const Rank& team_rank() const { return team_rank_ != nullptr ? *team_rank_ : *this; }
  int team_rank_of(int r) const { return view_.peer_first + r * view_.peer_stride; }
  const std::string& scope() const { return scope_; }

 private:
  friend class Communicator;
  int device_ = -1;
  int sm_budget_ = 0, device_sms_ = 0;
  cudaStream_t stream_ = nullptr;
  TeamView view_{};
  std::vector<char*> heap_of_;
  const Rank* team_rank_ = nullptr;
  std::string scope_;
};

class Communicator {
 public:
  // Picks the mode: one rank per process if launcher variables are present, else single-process.
  static std::unique_ptr<Communicator> create(Options opts = {});
  static std::unique_ptr<Communicator> create_single_process(Options opts = {});
  static std::unique_ptr<Communicator> create_from_launcher(const LaunchEnv& env, Options opts = {});
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int world() const { return world_; }
  bool is_single_process() const { return channel_ == nullptr; }
  // Ranks sharing each GPU (single-process virtual ranks; 1 otherwise).
  int ranks_per_gpu() const { return ranks_per_gpu_; }
  // Whether ranks a and b run on one GPU (virtual ranks of a single-process team): memory between them is
  // local, not across links.
  bool same_gpu(int a, int b) const { return a / ranks_per_gpu_ == b / ranks_per_gpu_; }
  Launcher launcher() const { return launcher_; }
  int num_local() const { return static_cast<int>(ranks_.size()); }
  Rank& local(int i) { return *ranks_.at(i); }
  const Rank& local(int i) const { return *ranks_.at(i); }
  // The sub-team of `rank` with `size` ranks `stride` apart: the team's ranks arranged as [W / (size x
  // stride)][size][stride], the ranks that differ only in the middle index (on a team of 4, size 2 stride 1:
  // {0, 1} and {2, 3}; size 2 stride 2: {0, 2} and {1, 3}). The Rank it returns is a rank of a team of
  // `size` (its rank(), world(), view(), heap_of()) on the same GPU, stream and SM budget, for any op: each
  // split (size, stride) is granted flags, barrier slots and workspace areas of its own, under the names
  // suffixed with Rank::scope(), which its disjoint sub-teams share (no rank belongs to two of them). Ops on
  // a sub-team must be called by every rank of the team, in the same order (the grants are collective).
  // The Rank lives as long as the communicator; size == W (stride 1) gives `rank` itself. lane k >= 1:
  // another instance of the split, with flags, barrier slots and workspace areas of its own again (size == W:
  // the whole team once more), for work in flight at once with lane 0's on the same ranks: e.g. two
  // micro-batches' MoE dispatch and combine interleaved (dispatch A, dispatch B, combine A, combine B), each
  // on its own lane, so that neither's rows nor outputs overwrite the other's. A lane's ops are ordered
  // against another lane's only by the caller's streams. Not split further (hybrid attention's inner splits
  // need the team's own rank).
  Rank& subteam(Rank& rank, int size, int stride = 1, int lane = 0);
  uint64_t heap_capacity() const;
  uint64_t heap_granularity() const;
  uint64_t heap_in_use() const;
  std::chrono::milliseconds timeout() const { return timeout_; }

  // Collective over all ranks (every process must call it, in the same order, with the same size).
  SymmetricBuffer alloc(uint64_t bytes);
  // Waits for this process's GPUs, then unmaps. Not a rendezvous: peers' mappings keep the memory alive
  // until they free it too.
  void free(SymmetricBuffer& buf);

  // Scratch memory for ops: a symmetric buffer of at least `bytes`, grown collectively (every rank asks
  // for the same sizes in the same order, as it does when every rank makes the same op calls); a grown
  // buffer reads zero on every rank before any rank's next op (flag protocols rely on it). Growing
  // allocates (and, with one local rank, frees the old buffer, which synchronizes the GPU), so it is refused
  // while `capturing` (a CUDA graph capture is in progress): run the op once before capturing, or call
  // reserve_workspace. With several local ranks the outgrown buffer stays mapped until synchronize() (or
  // the communicator's end): freeing would wait for every local GPU while one of them may wait for a peer
  // whose part the calling thread has not queued yet.
  // Areas are separate buffers, named by the op that asks: the unnamed area serves the collectives and the
  // ops' staging; an op whose peers write into its scratch ahead of this rank's call (the fused ops'
  // copy-engine pipelines) names an area of its own, which nothing else then uses. Every rank asks for the
  // same areas in the same order (it makes the same op calls).
  // Once an op has been captured into a CUDA graph on this communicator (note_capture), an outgrown buffer is
  // never freed before the communicator's end: a graph captured earlier may still name it.
  const SymmetricBuffer& workspace(uint64_t bytes, bool capturing = false, const std::string& area = {});
  void note_capture() { captured_ = true; }
  void reserve_workspace(uint64_t bytes, const std::string& area = {}) { workspace(bytes, false, area); }
  // Workspace `area` as it is now, without growing it (op plans); nullptr before its first use.
  const SymmetricBuffer* current_workspace(const std::string& area = {}) const {
    auto it = workspaces_.find(area);
    return it == workspaces_.end() || !it->second ? nullptr : &it->second;
  }
  // Flag words, barrier slots and a workspace area, granted by name (weft/runtime/resources.hpp): the same
  // runs on every rank. Declared resources were granted at creation; others are granted on first request,
  // so every rank must ask in the same order. The second form looks a grant up (throws if there is none).
  const ResourceGrant& resources(const ResourceRequest& request);
  const ResourceGrant& resources(const std::string& owner) const;
  // The grant of `owner` for rank's team: on a sub-team (subteam()), one of the same counts under the name
  // suffixed with its scope, granted on first request. Ops that may run on sub-teams ask this way.
  const ResourceGrant& resources(const Rank& rank, const std::string& owner);

  // Whether [p, p + bytes) lies in rank's own symmetric heap (then peers reach it through
  // TeamView::peer_ptr).
  bool in_heap(const Rank& rank, const void* p, uint64_t bytes) const {
    const char* c = static_cast<const char*>(p);
    const char* base = rank.view().local_base;
    return c >= base && bytes <= capacity_ && c + bytes <= base + capacity_;
  }
  // If p lies in a symmetric heap other than rank's own (a peer's heap as some local rank maps it), says
  // whose ("rank 2's symmetric heap, as mapped by rank 0"); else "". Such a pointer is a mistake when passed
  // as rank's own buffer: on real GPUs it is another GPU's memory, with virtual ranks it is not caught by
  // the device check.
  std::string foreign_heap(const Rank& rank, const void* p) const;

  // Exchanges a small blob between the team's processes; entry p is process p's (one per rank in
  // one-rank-per-process mode; single-process: just `data`). Collective, like alloc.
  std::vector<std::string> host_allgather(const std::string& data);

  // Host-side barrier between processes (no-op in single-process mode).
  void host_barrier();
  // Enqueues an in-kernel barrier of the whole team on every local rank's stream.
  void device_barrier();
  // The same on the given streams, streams[i] for local rank i (e.g. streams being captured into graphs).
  void device_barrier(const std::vector<cudaStream_t>& streams);
  // Waits for every local stream, then throws if any rank's device wait failed or a peer process died.
  void synchronize();
  // Gives up on the team from outside its kernels (a team spanning nodes whose NCCL leg failed): raises the
  // abort flag, so every device wait of this process's ranks fails within milliseconds, and synchronize()
  // reports `why`; with one process per rank it also tells the other processes (Channel::report_failure),
  // whose waits fail as fast. Thread-safe; the first reason stays.
  void abort(const std::string& why);
  // Whether the team has given up (abort(), or a peer process lost: the rendezvous channel raised the flag).
  bool aborted() const;
  // Throws weft::Error describing the first device wait failure of a local rank, if any. `probe`: a
  // non-blocking stream on the local ranks' one GPU to read the error records through (a thread that must not
  // wait behind work queued on the legacy default stream, e.g. a watchdog); null: cudaMemcpy.
  void check_device_errors(cudaStream_t probe = nullptr) const;
  // Describes a heap offset for error messages ("flag 3 of 'all_gather_matmul: chunk arrivals'", "barrier
  // slot 0 of 'block meetings', arrival of rank 1", ...).
  std::string describe_offset(uint64_t offset) const;

  // Timelines (weft/timeline.hpp). From timeline_start on, the kernels this rank launches (and graphs
  // captured from then on) record their phases into a device buffer of `max_events` 16-byte events, as do
  // the rank's sub-teams. timeline_take waits for the rank's stream, stops the recording and returns what
  // was recorded. Not collective: each rank records on its own. Off by default (no buffer, no cost beyond
  // one branch per mark).
  void timeline_start(Rank& rank, uint32_t max_events = 1u << 20);
  TimelineRecord timeline_take(Rank& rank);

  // Live-mapping bookkeeping, for leak tests.
  size_t live_mappings() const { return live_maps_; }

 private:
  Communicator() = default;
  void init_devices(const std::vector<int>& devices, int first_rank, int world, int sm_budget);
  void init_heap(uint64_t heap_bytes);
  void init_signal_pads();
  void grant_declared_resources();
  void check_peer_access_single_process() const;
  void check_peer_access_multi_process();
  void map_range(char* va, uint64_t bytes, CUmemGenericAllocationHandle h, const std::vector<int>& devices);
  CUmemGenericAllocationHandle create_physical(int device, uint64_t size, bool exportable);
  void map_shared(uint64_t off, uint64_t size, std::vector<std::pair<char*, uint64_t>>& mapped);
  void map_everywhere(uint64_t off, uint64_t size, std::vector<std::pair<char*, uint64_t>>& mapped);
  void release_all() noexcept;

  int world_ = 0;
  int ranks_per_gpu_ = 1;
  // Every rank maps every heap at addresses of its own (between processes, and for virtual ranks so that
  // the same mapping path runs); otherwise (single-process, one rank per GPU) every rank sees each heap at
  // its owner's address.
  bool per_rank_views_ = false;
  Launcher launcher_ = Launcher::kNone;
  std::chrono::milliseconds timeout_{10000};
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::unique_ptr<Channel> channel_;
  std::unique_ptr<HeapAllocator> allocator_;
  uint64_t capacity_ = 0, granularity_ = 0;
  std::vector<CUdeviceptr> reservations_;  // (base, size) pairs reserved with cuMemAddressReserve
  std::vector<uint64_t> reservation_sizes_;
  std::vector<SymmetricBuffer> live_;  // for teardown
  size_t live_maps_ = 0;
  SymmetricBuffer pad_;
  ResourceRegistry registry_{kFlagWords, kBarrierSlots};
  std::map<std::string, SymmetricBuffer> workspaces_;  // by area name ("": the shared one)
  std::map<std::tuple<const Rank*, int, int, int>, std::unique_ptr<Rank>>
      subteams_;  // (rank, size, stride, lane)
  std::vector<SymmetricBuffer>
      retired_workspaces_;         // outgrown with several local ranks: freed by synchronize()
  std::atomic<bool> captured_{false};  // an op has been captured into a CUDA graph (note_capture)
  int32_t* abort_flag_ = nullptr;  // host-mapped
  mutable std::mutex abort_lock_;
  std::string abort_reason_;                          // abort()'s first reason
  std::map<const Rank*, TimelineBuffer*> timelines_;  // recording ranks' buffers (device memory)
  void set_timeline(Rank& rank, TimelineBuffer* buffer);
};

}  // namespace weft
