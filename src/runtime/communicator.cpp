#include "weft/runtime/communicator.hpp"
#include "weft/runtime/current_device.hpp"
#include "weft/runtime/kernel_preload.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "driver.hpp"
#include "kernels.hpp"
#include "weft/runtime/channel.hpp"
#include "weft/runtime/heap_allocator.hpp"

namespace weft {

namespace {

using detail::CurrentDeviceGuard;

// The slot of Communicator::device_barrier.
const char* const kDeviceBarrier = "Communicator::device_barrier";
const ResourceDeclaration kDeviceBarrierSlot{{kDeviceBarrier, 0, 1}};

std::chrono::milliseconds resolve_timeout(std::chrono::milliseconds t) {
  if (t.count() > 0) return t;
  if (auto v = process_env()("WEFT_TIMEOUT_MS"))
    return std::chrono::milliseconds(parse_int(*v, "WEFT_TIMEOUT_MS", 1, 86'400'000));
  return std::chrono::milliseconds(10000);
}

// Ranks per GPU of a single-process team: the option, else WEFT_RANKS_PER_GPU, else 1.
int resolve_ranks_per_gpu(int v) {
  WEFT_CHECK(v >= 0 && v <= kMaxWorld,
             "Options::ranks_per_gpu must be 0 (WEFT_RANKS_PER_GPU, else 1) or 1.." +
                 std::to_string(kMaxWorld) + ", got " + std::to_string(v));
  if (v > 0) return v;
  if (auto e = process_env()("WEFT_RANKS_PER_GPU")) return parse_int(*e, "WEFT_RANKS_PER_GPU", 1, kMaxWorld);
  return 1;
}

// The SM budget asked for: the option, else WEFT_SM_BUDGET, else 0 (the GPU's share).
int requested_sm_budget(int v) {
  WEFT_CHECK(v >= 0,
             "Options::sm_budget must be 0 (WEFT_SM_BUDGET, else the GPU's SMs / ranks on it) or "
             "positive, got " +
                 std::to_string(v));
  if (v > 0) return v;
  if (auto e = process_env()("WEFT_SM_BUDGET")) return parse_int(*e, "WEFT_SM_BUDGET", 1, 1 << 16);
  return 0;
}

// Virtual ranks' streams share their GPU's hardware work queues (CUDA_DEVICE_MAX_CONNECTIONS of them, 8 by
// default), which the driver deals out to streams in turn. A stream that waits for a peer (a spinning kernel
// with work queued behind it, a stream wait) blocks its queue, and a peer's stream dealt the same queue then
// never runs: two ranks on one H100 hung this way replaying the pipelined ops' CUDA graphs, and passed with
// 32 queues. So virtual ranks need the most queues the driver gives (32), asked for before CUDA starts.
void check_work_queues_for_virtual_ranks() {
  const char* v = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  if (v && std::atoi(v) >= 32) return;
  throw_error(
      std::string("weft: virtual ranks (several ranks on one GPU) need CUDA_DEVICE_MAX_CONNECTIONS=32 in "
                  "the environment before the process first uses CUDA (it is ") +
      (v ? std::string("'") + v + "'" : std::string("unset, i.e. 8")) +
      "): the ranks' streams share the GPU's hardware work queues, and a stream waiting for a peer "
      "blocks the queue it sits in, so with few queues a peer's work can end up stuck behind it. "
      "weft-gpu-tests and weft-bench set it themselves when given --ranks");
}

// Why one process per rank cannot share a GPU, and what to do instead.
const char* kOneGpuPerProcess =
    "one process per rank needs a GPU per rank: kernels of different processes take turns on a GPU (time "
    "slices, without MPS) instead of running side by side, so a rank whose kernel waits for a peer on the "
    "same GPU would stall the team. To run more ranks than GPUs, drive them from one process as virtual "
    "ranks: run without a launcher and set WEFT_RANKS_PER_GPU=k (Options::ranks_per_gpu; weft-gpu-tests and "
    "weft-bench take --ranks W)";

uint64_t parse_bytes(const std::string& s, const char* what) {
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  uint64_t mult = 1;
  std::string unit = end ? std::string(end) : "";
  if (unit == "" || unit == "B")
    mult = 1;
  else if (unit == "K" || unit == "KiB" || unit == "k")
    mult = 1ull << 10;
  else if (unit == "M" || unit == "MiB")
    mult = 1ull << 20;
  else if (unit == "G" || unit == "GiB")
    mult = 1ull << 30;
  else
    throw_error(std::string("weft: ") + what + "='" + s + "': use a number with an optional K/M/G suffix");
  WEFT_CHECK(v > 0, std::string(what) + "='" + s + "' must be positive");
  return static_cast<uint64_t>(v * static_cast<double>(mult));
}

std::string device_name(int dev) {
  char bus[32] = "?";
  cudaDeviceGetPCIBusId(bus, sizeof(bus), dev);
  return "GPU " + std::to_string(dev) + " (" + bus + ")";
}

void init_driver() {
  if (const std::string why = cuda_unavailable_reason(); !why.empty()) throw_error("weft: " + why);
  WEFT_CU_CHECK(driver().cuInit(0));
}

void check_device_capabilities(int dev, bool need_fd_handles) {
  int major = 0, minor = 0, vmm = 0, fd = 0;
  WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  if (major < 9)
    throw_error("weft: " + device_name(dev) + " has compute capability " + std::to_string(major) + "." +
                std::to_string(minor) + "; weft needs 9.0 (Hopper) or newer");
  CUdevice cu;
  WEFT_CU_CHECK(driver().cuDeviceGet(&cu, dev));
  WEFT_CU_CHECK(
      driver().cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, cu));
  WEFT_CHECK(vmm, device_name(dev) + " does not support CUDA virtual memory management");
  if (need_fd_handles) {
    WEFT_CU_CHECK(driver().cuDeviceGetAttribute(
        &fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, cu));
    WEFT_CHECK(
        fd, device_name(dev) +
                " cannot export memory as POSIX file descriptors (needed between processes and for virtual "
                "ranks)");
  }
}

CUmemAllocationProp allocation_prop(int dev, bool exportable) {
  CUmemAllocationProp p{};
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = dev;
  p.requestedHandleTypes = exportable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
  return p;
}

template <class T>
std::string as_bytes(const T& v) {
  return std::string(reinterpret_cast<const char*>(&v), sizeof(T));
}
struct OffsetSize {
  uint64_t a, b;
};
template <class T>
T from_bytes(const std::string& s) {
  T v{};
  std::memcpy(static_cast<void*>(&v), s.data(), std::min(sizeof(T), s.size()));
  return v;
}

}  // namespace

std::string cuda_unavailable_reason() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e == cudaSuccess && n > 0) return {};
  cudaGetLastError();
  int drv = 0, rt = 0;
  cudaDriverGetVersion(&drv);  // 0 when no driver is loaded
  cudaRuntimeGetVersion(&rt);
  auto version = [](int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); };
  if (drv == 0)
    return "no NVIDIA driver on this machine (libcuda.so.1 not found): weft needs an NVIDIA GPU (Hopper, "
           "sm_90) with its driver";
  if (e == cudaErrorInsufficientDriver)
    return "the NVIDIA driver supports CUDA up to " + version(drv) + " but weft was built with the CUDA " +
           version(rt) + " runtime: update the driver";
  if (e == cudaErrorNoDevice || e == cudaSuccess)
    return "no CUDA GPU is visible (check that this machine has one, its driver, and CUDA_VISIBLE_DEVICES)";
  return std::string("CUDA cannot be used: ") + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
}

// ---- creation --------------------------------------------------------------------------------

std::unique_ptr<Communicator> Communicator::create(Options opts) {
  std::optional<LaunchEnv> env =
      opts.env ? opts.env : parse_launch_env(process_env(), static_cast<long>(::getppid()));
  if (env) return create_from_launcher(*env, std::move(opts));
  return create_single_process(std::move(opts));
}

std::unique_ptr<Communicator> Communicator::create_single_process(Options opts) {
  init_driver();
  std::vector<int> devices = opts.devices;
  int n = 0;
  WEFT_CUDA_CHECK(cudaGetDeviceCount(&n));
  if (devices.empty())
    for (int d = 0; d < n; ++d) devices.push_back(d);
  const int per_gpu = resolve_ranks_per_gpu(opts.ranks_per_gpu);
  if (per_gpu > 1) check_work_queues_for_virtual_ranks();
  WEFT_CHECK(static_cast<int>(devices.size()) * per_gpu <= kMaxWorld,
             "at most " + std::to_string(kMaxWorld) + " ranks per team (" + std::to_string(devices.size()) +
                 " GPUs x " + std::to_string(per_gpu) + " ranks per GPU asked for)");
  for (size_t i = 0; i < devices.size(); ++i) {
    WEFT_CHECK(devices[i] >= 0 && devices[i] < n, "device " + std::to_string(devices[i]) +
                                                      " does not exist (" + std::to_string(n) + " visible)");
    for (size_t j = 0; j < i; ++j)
      WEFT_CHECK(devices[i] != devices[j],
                 "device " + std::to_string(devices[i]) +
                     " listed twice (to put several ranks on one GPU, set Options::ranks_per_gpu)");
  }
  // Ranks g * per_gpu .. (g + 1) * per_gpu - 1 run on devices[g].
  std::vector<int> rank_devices;
  for (int d : devices)
    for (int j = 0; j < per_gpu; ++j) rank_devices.push_back(d);
  std::unique_ptr<Communicator> c(new Communicator());
  c->timeout_ = resolve_timeout(opts.timeout);
  c->world_ = static_cast<int>(rank_devices.size());
  c->ranks_per_gpu_ = per_gpu;
  c->per_rank_views_ = per_gpu > 1;
  try {
    c->init_devices(rank_devices, 0, c->world_, opts.sm_budget);
    c->check_peer_access_single_process();
    c->init_heap(opts.heap_bytes);
    c->init_signal_pads();
    c->grant_declared_resources();
    // One host thread drives several ranks here, so a GPU may hold a kernel that waits for a rank this
    // thread has not launched yet: what needs the GPU idle on its first use gets ready now.
    if (c->world_ > 1)
      for (const ResourceRequest& d : declared_resources())
        if (d.ready_rank)
          for (const auto& r : c->ranks_) {
            WEFT_CUDA_CHECK(cudaSetDevice(r->device_));
            d.ready_rank(r->rank());
          }
  } catch (...) {
    c->release_all();
    throw;
  }
  return c;
}

std::unique_ptr<Communicator> Communicator::create_from_launcher(const LaunchEnv& env, Options opts) {
  WEFT_CHECK(env.nodes == 1, "teams spanning nodes (multi-node jobs) are not supported yet: " +
                                 std::to_string(env.nodes) + " nodes of " + std::to_string(env.node_size) +
                                 " ranks (world size " + std::to_string(env.world) + ")" +
                                 (env.node_size != env.local_world
                                      ? " (WEFT_NODE_SIZE=" + std::to_string(env.node_size) +
                                            " splits this host into fake nodes: unset it)"
                                      : std::string("; run one team per node (docs/DESIGN.md, scale-out)")));
  WEFT_CHECK(resolve_ranks_per_gpu(opts.ranks_per_gpu) == 1,
             "virtual ranks (Options::ranks_per_gpu / WEFT_RANKS_PER_GPU above 1) are a single-process mode: "
             "one process drives all of them. Under a launcher every process is one rank with a GPU of its "
             "own");
  init_driver();
  int n = 0;
  WEFT_CUDA_CHECK(cudaGetDeviceCount(&n));
  int dev;
  if (n == env.local_world || n > env.local_rank)
    dev = env.local_rank;
  else if (n == 1)
    dev = 0;  // the launcher gave each process its own CUDA_VISIBLE_DEVICES
  else
    throw_error("weft: local rank " + std::to_string(env.local_rank) + " has no GPU: only " +
                std::to_string(n) + " visible for " + std::to_string(env.local_world) + " local ranks; " +
                kOneGpuPerProcess);
  std::unique_ptr<Communicator> c(new Communicator());
  c->timeout_ = resolve_timeout(opts.timeout);
  c->world_ = env.world;
  c->launcher_ = env.launcher;
  c->per_rank_views_ = true;
  try {
    // The rendezvous may wait for slow starters longer than a device wait would.
    // Teams of one job are created in the same order on every rank; numbering them keeps a new team's
    // rendezvous apart from a previous one that a slow rank may still be leaving.
    static std::atomic<int> generation{0};
    const std::string job = env.job_id + "." + std::to_string(generation++);
    c->channel_ = std::make_unique<Channel>(
        job, env.rank, env.world, std::max(c->timeout_, std::chrono::milliseconds(60000)), env.secret);
    c->channel_->set_op_timeout(std::max(c->timeout_, std::chrono::milliseconds(30000)));
    Communicator* self = c.get();
    c->channel_->set_on_peer_lost([self](const std::string&) {
      if (self->abort_flag_) *reinterpret_cast<volatile int32_t*>(self->abort_flag_) = 1;
    });
    c->init_devices({dev}, env.rank, env.world, opts.sm_budget);
    c->check_peer_access_multi_process();
    c->init_heap(opts.heap_bytes);
    c->init_signal_pads();
    c->grant_declared_resources();
  } catch (...) {
    c->release_all();
    throw;
  }
  return c;
}

void Communicator::init_devices(const std::vector<int>& devices, int first_rank, int world, int sm_budget) {
  // The abort flag lives in host-mapped memory: the host raises it while kernels run.
  void* host = nullptr;
  WEFT_CUDA_CHECK(cudaSetDevice(devices[0]));
  WEFT_CUDA_CHECK(cudaHostAlloc(&host, 64, cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(host, 0, 64);
  abort_flag_ = static_cast<int32_t*>(host);

  std::map<int, int> ranks_on;  // ranks per device
  for (int d : devices) ++ranks_on[d];
  const int asked = requested_sm_budget(sm_budget);
  int budget = INT32_MAX;
  for (size_t i = 0; i < devices.size(); ++i) {
    const int dev = devices[i];
    // Peers map this rank's memory through exported handles between processes and with virtual ranks.
    check_device_capabilities(dev, per_rank_views_);
    auto r = std::make_unique<Rank>();
    r->device_ = dev;
    WEFT_CUDA_CHECK(cudaSetDevice(dev));
    WEFT_CUDA_CHECK(cudaFree(nullptr));  // create the primary context now, not inside a timed region
    if (std::find(devices.begin(), devices.end(), dev) == devices.begin() + i)
      detail::preload_registered_kernels();  // no lazy loading between launches of spinning kernels
    WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&r->device_sms_, cudaDevAttrMultiProcessorCount, dev));
    // Every rank on this GPU may have a whole grid resident at once.
    const int share = r->device_sms_ / ranks_on[dev];
    WEFT_CHECK(share >= 1, device_name(dev) + " has " + std::to_string(r->device_sms_) + " SMs for " +
                               std::to_string(ranks_on[dev]) + " ranks: at most one rank per SM");
    if (asked > share)
      throw_error("weft: an SM budget of " + std::to_string(asked) + " SMs per rank does not fit " +
                  device_name(dev) + ": its " + std::to_string(r->device_sms_) + " SMs hold " +
                  std::to_string(ranks_on[dev]) + " rank" + (ranks_on[dev] > 1 ? "s'" : "'s") +
                  " kernels resident together only up to " + std::to_string(share) +
                  " SMs each (a waiting block whose peer cannot be scheduled would wait for ever); ask for "
                  "at most " +
                  std::to_string(share) + " (Options::sm_budget, WEFT_SM_BUDGET)");
    budget = std::min(budget, asked > 0 ? asked : share);
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&r->stream_, cudaStreamNonBlocking));
    r->view_.rank = first_rank + static_cast<int>(i);
    r->view_.world = world;
    r->view_.timeout_ns = static_cast<uint64_t>(timeout_.count()) * 1000000ull;
    // Unified addressing: pinned host memory has the same address on the host and every device.
    r->view_.abort = abort_flag_;
    ranks_.push_back(std::move(r));
  }
  // One budget for the team: block b of every rank meets its counterparts, so grids must match.
  if (channel_)
    for (const std::string& s : channel_->allgather(std::to_string(budget)).data)
      budget = std::min(budget, std::stoi(s));
  for (auto& r : ranks_) r->sm_budget_ = budget;
}

void Communicator::check_peer_access_single_process() const {
  for (auto& a : ranks_)
    for (auto& b : ranks_) {
      if (a->device_ == b->device_) continue;
      int can = 0;
      WEFT_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, a->device_, b->device_));
      if (!can)
        throw_error(
            "weft: " + device_name(a->device_) + " cannot access " + device_name(b->device_) +
            " as a peer (no P2P between them; weft needs peer access between every pair of its GPUs)");
    }
}

void Communicator::check_peer_access_multi_process() {
  char bus[32] = {};
  const int dev = ranks_[0]->device_;
  WEFT_CUDA_CHECK(cudaDeviceGetPCIBusId(bus, sizeof(bus), dev));
  auto g = channel_->allgather(std::string(bus));
  for (int r = 0; r < world_; ++r) {
    if (r == ranks_[0]->rank()) continue;
    if (g.data[r] == bus)
      throw_error("weft: ranks " + std::to_string(std::min(r, ranks_[0]->rank())) + " and " +
                  std::to_string(std::max(r, ranks_[0]->rank())) + " both use GPU " + bus +
                  " (check LOCAL_RANK and CUDA_VISIBLE_DEVICES): " + kOneGpuPerProcess);
    int other = -1;
    if (cudaDeviceGetByPCIBusId(&other, g.data[r].c_str()) != cudaSuccess) {
      cudaGetLastError();
      continue;  // not visible to this process; mapping its memory below reports any problem
    }
    int can = 0;
    WEFT_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, dev, other));
    if (!can)
      throw_error("weft: rank " + std::to_string(ranks_[0]->rank()) + " on " + device_name(dev) +
                  " cannot access rank " + std::to_string(r) + "'s " + device_name(other) + " as a peer");
  }
}

void Communicator::init_heap(uint64_t heap_bytes) {
  const bool mp = channel_ != nullptr;
  uint64_t gran = 0;
  for (auto& r : ranks_) {
    CUmemAllocationProp p = allocation_prop(r->device_, per_rank_views_);
    size_t g = 0;
    WEFT_CU_CHECK(driver().cuMemGetAllocationGranularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    gran = std::max<uint64_t>(gran, g);
  }
  if (heap_bytes == 0) {
    if (auto v = process_env()("WEFT_HEAP_BYTES")) heap_bytes = parse_bytes(*v, "WEFT_HEAP_BYTES");
  }
  if (heap_bytes == 0) {
    size_t total = 0;
    WEFT_CUDA_CHECK(cudaSetDevice(ranks_[0]->device_));
    size_t free_b = 0;
    WEFT_CUDA_CHECK(cudaMemGetInfo(&free_b, &total));
    // Virtual span only (physical memory is committed per allocation): the GPU's memory, shared by the
    // ranks on it.
    heap_bytes = total / ranks_per_gpu_;
  }
  if (mp) {  // every rank must use the same span and granularity
    auto g = channel_->allgather(as_bytes(OffsetSize{heap_bytes, gran}));
    for (auto& s : g.data) {
      auto [h, gr] = from_bytes<OffsetSize>(s);
      heap_bytes = std::max(heap_bytes, h);
      gran = std::max(gran, gr);
    }
  }
  granularity_ = gran;
  capacity_ = (heap_bytes + gran - 1) / gran * gran;
  allocator_ = std::make_unique<HeapAllocator>(capacity_, granularity_);

  auto reserve = [&](uint64_t bytes) {
    CUdeviceptr va = 0;
    WEFT_CU_CHECK(driver().cuMemAddressReserve(&va, bytes, granularity_, 0, 0));
    reservations_.push_back(va);
    reservation_sizes_.push_back(bytes);
    return reinterpret_cast<char*>(va);
  };
  if (per_rank_views_) {  // each rank: one span holding every rank's heap, rank p's at p * capacity
    for (auto& r : ranks_) {
      char* va = reserve(capacity_ * world_);
      r->heap_of_.resize(world_);
      for (int p = 0; p < world_; ++p) r->heap_of_[p] = va + capacity_ * p;
    }
  } else {  // one address space, every rank sees each heap at its owner's address
    std::vector<char*> bases(world_);
    for (int p = 0; p < world_; ++p) bases[p] = reserve(capacity_);
    for (auto& r : ranks_) r->heap_of_ = bases;
  }
  for (auto& r : ranks_) r->view_.local_base = r->heap_of_[r->rank()];
}

void Communicator::map_range(char* va, uint64_t bytes, CUmemGenericAllocationHandle h,
                             const std::vector<int>& devices) {
  WEFT_CU_CHECK(driver().cuMemMap(reinterpret_cast<CUdeviceptr>(va), bytes, 0, h, 0));
  ++live_maps_;
  std::vector<CUmemAccessDesc> access(devices.size());
  for (size_t i = 0; i < devices.size(); ++i) {
    access[i].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access[i].location.id = devices[i];
    access[i].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  CUresult res =
      driver().cuMemSetAccess(reinterpret_cast<CUdeviceptr>(va), bytes, access.data(), access.size());
  if (res != CUDA_SUCCESS) {
    driver().cuMemUnmap(reinterpret_cast<CUdeviceptr>(va), bytes);
    --live_maps_;
    WEFT_CU_CHECK(res);
  }
}

void Communicator::init_signal_pads() {
  pad_ = alloc(SignalPadLayout::kBytes);
  for (auto& r : ranks_) {
    r->view_.pad_offset = pad_.offset;
    char* pad = r->heap_of_[r->rank()] + pad_.offset;
    r->view_.error = reinterpret_cast<DeviceError*>(pad + SignalPadLayout::kErrorOffset);
    std::vector<uint64_t> table(kMaxWorld, 0);
    for (int p = 0; p < world_; ++p) table[p] = reinterpret_cast<uint64_t>(r->heap_of_[p]);
    WEFT_CUDA_CHECK(cudaSetDevice(r->device_));
    WEFT_CUDA_CHECK(cudaMemset(pad, 0, SignalPadLayout::kBytes));
    WEFT_CUDA_CHECK(cudaMemcpy(pad + SignalPadLayout::kPeerTableOffset, table.data(),
                               sizeof(uint64_t) * kMaxWorld, cudaMemcpyHostToDevice));
    WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  }
  host_barrier();  // nobody signals into a pad before its owner has zeroed it
}

// Every declaration, sorted by owner (declarations of one owner merged), so that every process grants the
// same runs whatever its static initialization order; declared areas are made now, before any capture.
void Communicator::grant_declared_resources() {
  std::vector<ResourceRequest> all = declared_resources();
  std::stable_sort(all.begin(), all.end(), [](auto& a, auto& b) { return a.owner < b.owner; });
  for (const ResourceRequest& r : all) {
    registry_.grant(r);
    if (r.area_bytes) reserve_workspace(r.area_bytes(world_), r.owner);
  }
}

Rank& Communicator::subteam(Rank& rank, int size, int stride, int lane) {
  const Rank& base = rank.team_rank();
  WEFT_CHECK(&base == &rank, "weft: Communicator::subteam of a sub-team's rank: split the team's own rank");
  WEFT_CHECK(size >= 1 && stride >= 1 && world_ % (int64_t(size) * stride) == 0,
             "weft: a sub-team of " + std::to_string(size) + " ranks " + std::to_string(stride) +
                 " apart does not tile a team of " + std::to_string(world_) +
                 " (size x stride must divide the world size)");
  WEFT_CHECK(lane >= 0, "weft: a sub-team's lane must be 0 or more, got " + std::to_string(lane));
  if (size == world_ && lane == 0) return rank;
  std::unique_ptr<Rank>& sub = subteams_[{&base, size, stride, lane}];
  if (sub) return *sub;
  sub = std::make_unique<Rank>();
  const int r = base.rank(), block = size * stride;
  const int first = r / block * block + r % stride;
  sub->device_ = base.device_;
  sub->sm_budget_ = base.sm_budget_;
  sub->device_sms_ = base.device_sms_;
  sub->stream_ = base.stream_;
  sub->view_ = base.view_;
  sub->view_.rank = (r / stride) % size;
  sub->view_.world = size;
  sub->view_.peer_first = first;
  sub->view_.peer_stride = stride;
  for (int i = 0; i < size; ++i) sub->heap_of_.push_back(base.heap_of_[first + i * stride]);
  sub->team_rank_ = &base;
  sub->scope_ = " [sub-teams of " + std::to_string(size) + ", stride " + std::to_string(stride) +
                (lane > 0 ? ", lane " + std::to_string(lane) : "") + "]";
  return *sub;
}

const ResourceGrant& Communicator::resources(const ResourceRequest& request) {
  return registry_.grant(request);
}

const ResourceGrant& Communicator::resources(const Rank& rank, const std::string& owner) {
  const ResourceGrant& team = resources(owner);
  if (rank.scope().empty()) return team;
  return resources(ResourceRequest{owner + rank.scope(), team.flags.count, team.slots.count});
}

const ResourceGrant& Communicator::resources(const std::string& owner) const {
  const ResourceGrant* g = registry_.find(owner);
  WEFT_CHECK(g != nullptr, "weft: no resources were granted to '" + owner +
                               "' (declare them with a ResourceDeclaration, or ask with "
                               "Communicator::resources(ResourceRequest))");
  return *g;
}

// ---- symmetric allocation ---------------------------------------------------------------------

SymmetricBuffer Communicator::alloc(uint64_t bytes) {
  const CurrentDeviceGuard keep_device;
  WEFT_CHECK(!channel_ || channel_->lost_reason().empty(), channel_->lost_reason());
  const bool mp = channel_ != nullptr;
  const uint64_t off = allocator_->allocate(bytes);
  const uint64_t size = allocator_->size_of(off);
  SymmetricBuffer buf;
  buf.offset = off;
  buf.bytes = size;
  std::vector<std::pair<char*, uint64_t>> mapped;
  auto undo = [&] {
    for (auto& [va, n] : mapped) {
      driver().cuMemUnmap(reinterpret_cast<CUdeviceptr>(va), n);
      --live_maps_;
    }
    allocator_->free(off);
  };
  try {
    if (mp) {
      auto g = channel_->allgather(as_bytes(OffsetSize{off, size}));
      for (int r = 0; r < world_; ++r) {
        auto [o, s] = from_bytes<OffsetSize>(g.data[r]);
        if (o != off || s != size)
          throw_error("weft: symmetric alloc mismatch: rank " + std::to_string(ranks_[0]->rank()) +
                      " allocates " + std::to_string(size) + " bytes at offset " + std::to_string(off) +
                      ", rank " + std::to_string(r) + " " + std::to_string(s) + " bytes at " +
                      std::to_string(o) +
                      " (alloc/free must be called by every rank, in the same order, with the same sizes)");
      }
    }
    if (per_rank_views_)
      map_everywhere(off, size, mapped);
    else
      map_shared(off, size, mapped);
  } catch (...) {
    undo();
    throw;
  }
  for (auto& r : ranks_) buf.local.push_back(r->heap_of_[r->rank()] + off);
  live_.push_back(buf);
  return buf;
}

// Single-process, one rank per GPU: each rank's memory mapped once, at its owner's address, open to every
// local GPU.
void Communicator::map_shared(uint64_t off, uint64_t size, std::vector<std::pair<char*, uint64_t>>& mapped) {
  std::vector<int> all_devices;
  for (auto& r : ranks_) all_devices.push_back(r->device_);
  for (auto& r : ranks_) {
    CUmemGenericAllocationHandle h = create_physical(r->device_, size, false);
    char* mine = r->heap_of_[r->rank()] + off;
    try {
      map_range(mine, size, h, all_devices);
    } catch (...) {
      driver().cuMemRelease(h);
      throw;
    }
    driver().cuMemRelease(h);  // the mapping keeps the memory alive
    mapped.emplace_back(mine, size);
  }
}

// Per-rank views (between processes, and virtual ranks): each rank maps its own memory, exports it as a
// POSIX file descriptor, and every rank maps every peer's memory at its own view of that peer's heap from the
// imported handle. Between processes the descriptors travel over the channel; virtual ranks import their
// local peers' descriptors in this process, so the same mapping path runs.
void Communicator::map_everywhere(uint64_t off, uint64_t size,
                                  std::vector<std::pair<char*, uint64_t>>& mapped) {
  std::vector<int> fds(world_, -1);
  struct CloseAll {
    std::vector<int>& fds;
    ~CloseAll() {
      for (int& x : fds)
        if (x >= 0) ::close(x), x = -1;
    }
  } close_all{fds};
  for (auto& r : ranks_) {
    CUmemGenericAllocationHandle h = create_physical(r->device_, size, true);
    char* mine = r->heap_of_[r->rank()] + off;
    int fd = -1;
    try {
      map_range(mine, size, h, {r->device_});
      mapped.emplace_back(mine, size);
      WEFT_CU_CHECK(
          driver().cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    } catch (...) {
      driver().cuMemRelease(h);
      throw;
    }
    driver().cuMemRelease(h);  // the mapping keeps the memory alive
    fds[r->rank()] = fd;
  }
  if (channel_) {  // one local rank: trade descriptors with the other processes
    const int me = ranks_[0]->rank();
    auto g = channel_->allgather({}, fds[me]);
    ::close(fds[me]);
    fds = std::move(g.fds);
    fds[me] = -1;
  }
  for (auto& r : ranks_)
    for (int p = 0; p < world_; ++p) {
      if (p == r->rank()) continue;
      if (fds[p] < 0) throw_error("weft: rank " + std::to_string(p) + " sent no memory handle");
      CUmemGenericAllocationHandle ph;
      WEFT_CU_CHECK(
          driver().cuMemImportFromShareableHandle(&ph, reinterpret_cast<void*>(static_cast<intptr_t>(fds[p])),
                                                  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
      try {
        map_range(r->heap_of_[p] + off, size, ph, {r->device_});
      } catch (...) {
        driver().cuMemRelease(ph);
        throw;
      }
      driver().cuMemRelease(ph);
      mapped.emplace_back(r->heap_of_[p] + off, size);
    }
}

CUmemGenericAllocationHandle Communicator::create_physical(int device, uint64_t size, bool exportable) {
  CUmemAllocationProp p = allocation_prop(device, exportable);
  CUmemGenericAllocationHandle h;
  CUresult res = driver().cuMemCreate(&h, size, &p, 0);
  if (res == CUDA_ERROR_OUT_OF_MEMORY)
    throw_error("weft: out of GPU memory allocating a " + std::to_string(size >> 20) +
                " MiB symmetric buffer on " + device_name(device));
  WEFT_CU_CHECK(res);
  return h;
}

std::string Communicator::foreign_heap(const Rank& sub, const void* p) const {
  const Rank& rank = sub.team_rank();
  const char* c = static_cast<const char*>(p);
  for (auto& q : ranks_)
    for (int owner = 0; owner < world_; ++owner) {
      const char* base = q->heap_of_[owner];
      // Rank's own heap (any local rank's view of it without per-rank views, where all views are one).
      if (c < base || c >= base + capacity_ ||
          (owner == rank.rank() && (q.get() == &rank || !per_rank_views_)))
        continue;
      std::string s = "rank " + std::to_string(owner) + "'s symmetric heap";
      if (per_rank_views_) s += ", as mapped by rank " + std::to_string(q->rank());
      return s;
    }
  return {};
}

void Communicator::free(SymmetricBuffer& buf) {
  const CurrentDeviceGuard keep_device;
  if (!buf) return;
  auto it = std::find_if(live_.begin(), live_.end(), [&](auto& b) { return b.offset == buf.offset; });
  WEFT_CHECK(it != live_.end(),
             "free of a buffer that this communicator did not allocate (or already freed)");
  for (auto& r : ranks_) {
    cudaSetDevice(r->device_);
    cudaDeviceSynchronize();  // no kernel of ours may still touch it
  }
  std::vector<char*> vas;
  for (auto& r : ranks_)
    for (int p = 0; p < world_; ++p)
      if (per_rank_views_ || p == r->rank()) vas.push_back(r->heap_of_[p] + buf.offset);
  for (char* va : vas) {
    WEFT_CU_CHECK(driver().cuMemUnmap(reinterpret_cast<CUdeviceptr>(va), buf.bytes));
    --live_maps_;
  }
  allocator_->free(buf.offset);
  live_.erase(it);
  buf = SymmetricBuffer{};
}

const SymmetricBuffer& Communicator::workspace(uint64_t bytes, bool capturing, const std::string& area) {
  SymmetricBuffer& ws = workspaces_[area];
  if (ws.bytes >= bytes) return ws;
  WEFT_CHECK(!capturing, "an op needs " + std::to_string(bytes >> 20) +
                             " MiB of workspace but the communicator has " + std::to_string(ws.bytes >> 20) +
                             " MiB, and it cannot grow during CUDA graph capture: run the op once before "
                             "capturing, or call Communicator::reserve_workspace");
  // Freeing waits for every local GPU to go idle. A thread driving several ranks may already have queued
  // work on one GPU that waits for a peer's part it has not queued yet (the fused ops' copy pipelines):
  // waiting now would hang. There the outgrown workspace lives on until the next synchronize().
  if (ws && captured_) {
    // A captured graph may name the outgrown buffer: it stays allocated (and listed) until the end.
  } else if (ws && num_local() > 1) {
    retired_workspaces_.push_back(ws);
  } else if (ws) {
    free(ws);
  }
  ws = alloc(bytes);
  // Zeroed before first use: flag protocols (the one-shot's LL words) must never find a matching value in
  // memory recycled from an earlier buffer. A stream of its own, so queued work is not waited for; the
  // host barrier keeps every peer from writing into a workspace its owner has not zeroed yet.
  const CurrentDeviceGuard keep_device;
  for (int i = 0; i < num_local(); ++i) {
    WEFT_CUDA_CHECK(cudaSetDevice(ranks_[i]->device_));
    cudaStream_t s = nullptr;
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const cudaError_t set = cudaMemsetAsync(ws.local[i], 0, ws.bytes, s);
    const cudaError_t done = cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
    WEFT_CUDA_CHECK(set);
    WEFT_CUDA_CHECK(done);
  }
  host_barrier();
  return ws;
}

uint64_t Communicator::heap_capacity() const {
  return capacity_;
}
uint64_t Communicator::heap_granularity() const {
  return granularity_;
}
uint64_t Communicator::heap_in_use() const {
  return allocator_ ? allocator_->bytes_in_use() : 0;
}

// ---- synchronization and errors ---------------------------------------------------------------

std::vector<std::string> Communicator::host_allgather(const std::string& data) {
  if (!channel_) return {data};
  return channel_->allgather(data).data;
}

void Communicator::host_barrier() {
  if (channel_) channel_->barrier();
}

void Communicator::device_barrier() {
  std::vector<cudaStream_t> streams;
  for (auto& r : ranks_) streams.push_back(r->stream_);
  device_barrier(streams);
}

void Communicator::device_barrier(const std::vector<cudaStream_t>& streams) {
  WEFT_CHECK(streams.size() == ranks_.size(),
             "Communicator::device_barrier: " + std::to_string(streams.size()) + " streams for " +
                 std::to_string(ranks_.size()) + " local ranks");
  const CurrentDeviceGuard keep_device;
  for (size_t i = 0; i < ranks_.size(); ++i) {
    WEFT_CUDA_CHECK(cudaSetDevice(ranks_[i]->device_));
    launch_team_barrier(ranks_[i]->view_, resources(kDeviceBarrier).slots[0], streams[i]);
  }
}

void Communicator::synchronize() {
  const CurrentDeviceGuard keep_device;
  for (auto& r : ranks_) {
    WEFT_CUDA_CHECK(cudaSetDevice(r->device_));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(r->stream_));
  }
  check_device_errors();
  for (SymmetricBuffer& b : retired_workspaces_) free(b);
  retired_workspaces_.clear();
}

void Communicator::abort(const std::string& why) {
  {
    std::lock_guard<std::mutex> hold(abort_lock_);
    if (abort_reason_.empty()) abort_reason_ = why;
  }
  if (abort_flag_) *reinterpret_cast<volatile int32_t*>(abort_flag_) = 1;
  if (channel_) channel_->report_failure(why);  // the other processes' kernels stop waiting too
}

bool Communicator::aborted() const {
  return abort_flag_ && *reinterpret_cast<volatile const int32_t*>(abort_flag_) != 0;
}

std::string Communicator::describe_offset(uint64_t offset) const {
  if (pad_ && offset >= pad_.offset && offset < pad_.offset + SignalPadLayout::kBytes) {
    const uint64_t o = offset - pad_.offset;
    using L = SignalPadLayout;
    if (o < L::kBarrierInboxOffset) return registry_.describe_flag(static_cast<int>(o / 8));
    if (o < L::kBarrierEpochOffset) {
      const uint64_t i = (o - L::kBarrierInboxOffset) / 8;
      return registry_.describe_slot(static_cast<int>(i / kMaxWorld)) + ", arrival of rank " +
             std::to_string(i % kMaxWorld);
    }
    if (o < L::kGridArriveOffset)
      return registry_.describe_slot(static_cast<int>((o - L::kBarrierEpochOffset) / 8)) + ", epoch";
    if (o < L::kGridGenerationOffset)
      return registry_.describe_slot(static_cast<int>((o - L::kGridArriveOffset) / 8)) + ", grid arrivals";
    if (o < L::kPeerTableOffset)
      return registry_.describe_slot(static_cast<int>((o - L::kGridGenerationOffset) / 8)) +
             ", grid generation";
    return o < L::kErrorOffset ? "signal pad peer table" : "device error record";
  }
  for (auto& [name, ws] : workspaces_)
    if (ws && offset >= ws.offset && offset < ws.offset + ws.bytes)
      return "byte " + std::to_string(offset - ws.offset) + " of " +
             (name.empty() ? std::string("the shared workspace") : "workspace area '" + name + "'");
  for (auto& b : live_)
    if (offset >= b.offset && offset < b.offset + b.bytes)
      return "byte " + std::to_string(offset - b.offset) + " of the symmetric buffer at heap offset " +
             std::to_string(b.offset);
  return "heap offset " + std::to_string(offset);
}

void Communicator::check_device_errors(cudaStream_t probe) const {
  const CurrentDeviceGuard keep_device;
  for (size_t i = 0; i < ranks_.size(); ++i) {
    if (!ranks_[i]->view_.error) continue;
    DeviceError e{};
    WEFT_CUDA_CHECK(cudaSetDevice(ranks_[i]->device_));
    if (probe) {
      WEFT_CUDA_CHECK(cudaMemcpyAsync(&e, ranks_[i]->view_.error, sizeof(e), cudaMemcpyDeviceToHost, probe));
      WEFT_CUDA_CHECK(cudaStreamSynchronize(probe));
    } else {
      WEFT_CUDA_CHECK(cudaMemcpy(&e, ranks_[i]->view_.error, sizeof(e), cudaMemcpyDeviceToHost));
    }
    const auto code = static_cast<DeviceErrorCode>(e.code);
    if (code == DeviceErrorCode::kNone) continue;
    // flash_decode's refusal of device-side input (ops::DecodeBadInput), on this rank or copied from a peer.
    if (code == DeviceErrorCode::kBadInput ||
        (code == DeviceErrorCode::kPeerFailed &&
         static_cast<DeviceErrorCode>(e.cause) == DeviceErrorCode::kBadInput)) {
      const std::string seq = "sequence " + std::to_string(e.block);
      throw Error(
          "weft::flash_decode: rank " + std::to_string(e.rank) + ": " + seq +
          (e.thread == 0 ? "'s cache length " + std::to_string(static_cast<int64_t>(e.observed)) +
                               " is outside 0.." + std::to_string(e.expected) + " (its capacity)"
                         : ": block_table holds block " + std::to_string(static_cast<int32_t>(e.observed)) +
                               ", outside the cache's " + std::to_string(e.expected) + " blocks") +
          "; the call's results are invalid on every rank and the team's device waits fail from here on" +
          (code == DeviceErrorCode::kPeerFailed
               ? " (reported to rank " + std::to_string(ranks_[i]->rank()) + ")"
               : ""));
    }
    if (code == DeviceErrorCode::kBadCounts) {
      const int64_t limit = static_cast<int64_t>(e.expected), needed = static_cast<int64_t>(e.observed);
      const std::string who = "rank " + std::to_string(e.block);
      std::string why;
      switch (e.thread) {  // coll::BadCounts
        case 0:
          why = who + " would receive " + std::to_string(needed) + " rows, more than out_capacity " +
                std::to_string(limit);
          break;
        case 1:
          why = who + "'s send_counts need " + std::to_string(needed) + " rows, more than its in holds (" +
                std::to_string(limit) + ")";
          break;
        case 2:
          why = who + " has a negative send count (" + std::to_string(needed) + ")";
          break;
        default:
          why = who + "'s out_capacity (" + std::to_string(needed) +
                ") or out's symmetry differs from rank 0's (" + std::to_string(limit) +
                "): every rank passes the same";
      }
      throw Error("weft::all_to_all_v: refused on every rank: " + why +
                  "; nothing was moved, recv_counts are zero, and the team's device waits fail from here on");
    }
    std::string msg = "weft: ";
    if (code == DeviceErrorCode::kPeerFailed)
      msg += "rank " + std::to_string(ranks_[i]->rank()) + " gave up: its call took work from rank " +
             std::to_string(e.rank) + ", whose wait failed (results of that call are invalid): ";
    msg += "rank " + std::to_string(e.rank) + " (block " + std::to_string(e.block) + ", thread " +
           std::to_string(e.thread) + ") ";
    const auto cause = code == DeviceErrorCode::kPeerFailed ? static_cast<DeviceErrorCode>(e.cause) : code;
    msg += cause == DeviceErrorCode::kTimeout ? "timed out after " : "gave up (abort) after ";
    msg += std::to_string(e.waited_ns / 1000000) + " ms waiting for " + describe_offset(e.flag_offset) +
           " to reach " + std::to_string(e.expected) + " (last saw " + std::to_string(e.observed) + ")";
    if (cause == DeviceErrorCode::kTimeout)
      msg += "; a peer is stuck, died, or skipped a matching signal (timeout: WEFT_TIMEOUT_MS)";
    if (channel_ && !channel_->lost_reason().empty()) msg += "; " + channel_->lost_reason();
    if (channel_ && !channel_->departed_reason().empty()) msg += "; " + channel_->departed_reason();
    std::lock_guard<std::mutex> hold(abort_lock_);
    if (!abort_reason_.empty()) msg += "; " + abort_reason_;
    throw Error(msg);
  }
  {
    std::lock_guard<std::mutex> hold(abort_lock_);
    if (!abort_reason_.empty()) throw Error(abort_reason_);
  }
  if (channel_) {
    std::string lost = channel_->lost_reason();
    if (!lost.empty()) throw Error(lost);
  }
}

// ---- teardown ---------------------------------------------------------------------------------

void Communicator::release_all() noexcept {
  for (auto& r : ranks_) {
    cudaSetDevice(r->device_);
    cudaDeviceSynchronize();
  }
  for (auto& [rank, buffer] : timelines_) {  // recordings never taken
    cudaSetDevice(rank->device());
    cudaFree(buffer);
  }
  timelines_.clear();
  while (!live_.empty()) {
    SymmetricBuffer b = live_.back();
    try {
      free(b);
    } catch (...) {
      live_.pop_back();
    }
  }
  for (size_t i = 0; i < reservations_.size(); ++i)
    driver().cuMemAddressFree(reservations_[i], reservation_sizes_[i]);
  reservations_.clear();
  for (auto& r : ranks_) {
    if (r->stream_) {
      cudaSetDevice(r->device_);
      cudaStreamDestroy(r->stream_);
    }
  }
  ranks_.clear();
  channel_.reset();
  if (abort_flag_) cudaFreeHost(abort_flag_);
  abort_flag_ = nullptr;
}

Communicator::~Communicator() {
  release_all();
}

}  // namespace weft
