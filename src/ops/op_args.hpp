// What every op launcher shares (internal to src/ops): the device-buffer checks, the workspace layout and
// the block-meeting slots.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "weft/runtime/communicator.hpp"
#include "weft/ops/plan.hpp"
#include "weft/runtime/current_device.hpp"

namespace weft::ops {

// Block-meeting slots: block b of a collective or fused kernel meets its counterparts on the other ranks in
// slot b. One run shared by the collectives and the fused kernels (they run one after another on a stream,
// and every slot's epochs advance alike on every rank).
inline constexpr int kMeetingSlots = 256;
inline const char* const kBlockMeetings = "block meetings (collectives, fused kernels)";
inline BarrierSlots meeting_slots(Communicator& comm, const Rank& rank) {
  return comm.resources(rank, kBlockMeetings).slots;
}

// Blocks of a collective-style kernel (one barrier slot each) moving `bytes`: one per 32 KiB, since one SM
// moves ~40 GB/s and even 1 MiB should spread wide, at most one per SM of the rank's budget and per
// barrier slot.
inline int max_collective_blocks(const Rank& rank) {
  return std::min(rank.sm_budget(), kMeetingSlots);
}
inline int collective_blocks(const Rank& rank, uint64_t bytes) {
  constexpr uint64_t kBytesPerBlock = 32 << 10;
  const uint64_t want = (bytes + kBytesPerBlock - 1) / kBytesPerBlock;
  return static_cast<int>(std::clamp<uint64_t>(want, 1, max_collective_blocks(rank)));
}

// Facts of the current device that every call needs, read once per device (the attribute queries are
// host calls on the launch path).
struct DeviceFacts {
  int device = 0;
  int cc = 0;   // compute capability, major * 10 + minor
  int sms = 0;  // multiprocessors
  int64_t l2_bytes = 0;
};
inline DeviceFacts device_facts() {
  return detail::once_per_device([](int dev) {
    int major = 0, minor = 0;
    DeviceFacts f;
    f.device = dev;
    WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&f.sms, cudaDevAttrMultiProcessorCount, dev));
    int l2 = 0;
    WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
    f.l2_bytes = l2;
    f.cc = major * 10 + minor;
    return f;
  });
}

// Throws weft::Error (prefixed with `where`) unless p is non-null and `align`-aligned.
inline void check_pointer_alignment(const void* p, const char* name, uint64_t align,
                                    const std::string& where) {
  if (p == nullptr) throw_error(where + name + " is null");
  if (reinterpret_cast<uintptr_t>(p) % align != 0)
    throw_error(where + name + " is not " + std::to_string(align) + "-byte aligned (" +
                std::to_string(reinterpret_cast<uintptr_t>(p) % align) + " bytes off)" +
                (align == 16
                     ? "; allocate it with cudaMalloc / the symmetric heap, or offset it by a multiple of 16 "
                       "bytes"
                     : ""));
}
// Throws unless the caller's workspace holds at least `need` bytes (as `sizer`, the op's public size
// function, computes them) and is 256-byte aligned (what every op's WorkspaceLayout carves from).
inline void check_workspace(const void* workspace, size_t workspace_bytes, size_t need,
                            const std::string& sizer, const std::string& where) {
  if (workspace == nullptr || workspace_bytes < need)
    throw_error(where + "the workspace must hold " + std::to_string(need) + " bytes (" + sizer + "), got " +
                std::to_string(workspace_bytes));
  check_pointer_alignment(workspace, "workspace", 256, where);
}
// Throws unless p points into device (or managed) memory, device memory on GPU `device`.
inline void check_device_memory(const void* p, const char* name, int device, const std::string& where) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess ||
      (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged)) {
    cudaGetLastError();
    throw_error(where + name + " is not device memory");
  }
  if (a.type == cudaMemoryTypeDevice && a.device != device)
    throw_error(where + name + " lives on GPU " + std::to_string(a.device) + " but the call runs on GPU " +
                std::to_string(device));
}

// Throws weft::Error (prefixed with `where`) unless p is a non-null, `align`-aligned pointer into the rank's
// symmetric heap or into device (or managed) memory on the rank's GPU.
inline void check_device_buffer(const Communicator& comm, const Rank& rank, const void* p, const char* name,
                                uint64_t bytes, uint64_t align, const std::string& where) {
  check_pointer_alignment(p, name, align, where);
  if (comm.in_heap(rank, p, bytes)) return;
  if (comm.in_heap(rank, p, 1))
    throw_error(where + name + " starts in rank " + std::to_string(rank.rank()) +
                "'s symmetric heap but its " + std::to_string(bytes) +
                " bytes run past the heap's end (a size too large?)");
  if (const std::string whose = comm.foreign_heap(rank, p); !whose.empty())
    throw_error(where + name + " points into " + whose + ", not into rank " + std::to_string(rank.rank()) +
                "'s own: pass each rank its own buffer (SymmetricBuffer::local[i], Rank::at(buffer, "
                "rank.rank()))");
  check_device_memory(p, name, rank.device(), where + "rank " + std::to_string(rank.rank()) + ": ");
}

// Bytes rounded up to a multiple of 256 (where every part of a workspace starts).
inline size_t round256(size_t b) {
  return (b + 255) / 256 * 256;
}

// A workspace (or workspace area) carved into parts, each starting on a 256-byte boundary. The function that
// sizes a workspace and the launcher that uses it run the same carving code: a layout without a base only
// adds the parts up (its pointers are null), one with a base hands them out, so the two cannot disagree.
class WorkspaceLayout {
 public:
  WorkspaceLayout() = default;  // sizing
  explicit WorkspaceLayout(void* base) : base_(static_cast<char*>(base)) {}
  // The next part, `bytes` long.
  template <class T = char>
  T* take(size_t bytes) {
    char* p = base_ ? base_ + bytes_ : nullptr;
    bytes_ += round256(bytes);
    return reinterpret_cast<T*>(p);
  }
  size_t bytes() const { return bytes_; }  // so far

 private:
  char* base_ = nullptr;
  size_t bytes_ = 0;
};

// The bytes a carving takes: `carve(layout)` run on a layout without a base.
template <class Carve>
size_t bytes_carved_by(Carve carve) {
  WorkspaceLayout sized;
  carve(sized);
  return sized.bytes();
}

// Index of `rank` among the communicator's local ranks.
inline int local_index(const Communicator& comm, const Rank& rank, const std::string& where) {
  for (int i = 0; i < comm.num_local(); ++i)
    if (&comm.local(i) == &rank.team_rank()) return i;
  throw_error(where + "the rank does not belong to this communicator");
}

// This rank's pointer to the communicator's workspace `area` ("": the shared one) of at least `bytes` (grown
// collectively if needed); nullptr when no area was ever needed (bytes 0).
inline char* workspace_of(Communicator& comm, const Rank& rank, uint64_t bytes, bool capturing,
                          const std::string& where, const std::string& area = {}) {
  const SymmetricBuffer& ws = comm.workspace(bytes, capturing, area + rank.scope());
  if (!ws) return nullptr;
  return ws.local[local_index(comm, rank, where)];
}

// workspace_of for a call enqueued on `stream`: refused to grow while the stream is being captured.
inline char* workspace_on(Communicator& comm, const Rank& rank, uint64_t bytes, cudaStream_t stream,
                          const std::string& where, const std::string& area) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  WEFT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  return workspace_of(comm, rank, bytes, capture != cudaStreamCaptureStatusNone, where, area);
}

// Grid of a grid-stride kernel over n units, `per_block` per block: at least 1, at most 8 blocks per SM of an
// H100 / H200.
inline int grid_stride_blocks(int64_t n, int per_block = 256) {
  return static_cast<int>(std::clamp<int64_t>((n + per_block - 1) / per_block, 1, 1056));
}
// The same for a team op's kernel: at most two blocks per SM of the rank's budget, so that ranks sharing a
// GPU (virtual ranks) do not flood it with blocks while a peer's persistent kernel is placing its own.
inline int grid_stride_blocks(const Rank& rank, int64_t n, int per_block = 256) {
  return std::min(grid_stride_blocks(n, per_block), 2 * rank.sm_budget());
}

// The prefix of a team op's error messages: "weft::op(rank r of W): ".
inline std::string team_where(const char* op, const Rank& rank) {
  return std::string(op) + "(rank " + std::to_string(rank.rank()) + " of " + std::to_string(rank.world()) +
         "): ";
}

// What every op call starts with: the rank's GPU made current (the caller's comes back at the end), the
// stream (the rank's when none is given), whether it is being captured, and the prefix of every error
// message ("weft::all_gather: "). With `into` the call only plans (weft/ops/plan.hpp): it runs the op's
// code up to its launches, recording the workspace it asks for and the path and grid it would launch,
// and grows nothing and launches nothing.
struct OpCall {
  Communicator& comm;
  Rank& rank;
  cudaStream_t stream;
  std::string where;
  bool capturing = false;
  Plan* plan = nullptr;
  detail::CurrentDeviceGuard keep_device;

  OpCall(Communicator& c, Rank& r, cudaStream_t s, std::string prefix, Plan* into = nullptr)
      : comm(c), rank(r), stream(s ? s : r.stream()), where(std::move(prefix)), plan(into) {
    WEFT_CUDA_CHECK(cudaSetDevice(r.device()));
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    WEFT_CUDA_CHECK(cudaStreamIsCapturing(stream, &st));
    capturing = st != cudaStreamCaptureStatusNone;
    if (capturing) c.note_capture();
  }
  bool planning() const { return plan != nullptr; }
  [[noreturn]] void fail(const std::string& why) const { throw_error(where + why); }
  // A device pointer on this rank's GPU (or in its symmetric heap), aligned to `align` bytes.
  void check_buffer(const void* p, const char* name, uint64_t bytes, uint64_t align = 16) const {
    check_device_buffer(comm, rank, p, name, bytes, align, where);
  }
  // This rank's part of workspace `area` ("": the shared one), at least `bytes`. Planning: recorded, and
  // the area as it is now where it is large enough; else a stand-in in the rank's symmetric heap (where the
  // grown area will be), assumed apart from the call's buffers as a fresh area is.
  char* workspace(uint64_t bytes, const std::string& area = {}) {
    if (!plan) return workspace_of(comm, rank, bytes, capturing, where, area);
    if (bytes == 0) return nullptr;
    uint64_t& need = plan->workspace[area + rank.scope()];
    need = std::max(need, bytes);
    const SymmetricBuffer* ws = comm.current_workspace(area + rank.scope());
    if (ws && ws->bytes >= bytes) return ws->local[local_index(comm, rank, where)];
    const uint64_t span = (bytes + 255) / 256 * 256;
    if (span > comm.heap_capacity())
      fail("needs " + std::to_string(bytes) + " bytes of workspace, more than the symmetric heap's " +
           std::to_string(comm.heap_capacity()) + " (Options::heap_bytes)");
    return rank.heap_of(rank.rank()) + (comm.heap_capacity() - span);
  }
  // Before a launch: planning, records `path` (joined to earlier launches' with " + ") and the largest grid,
  // and returns true (launch nothing); else false.
  bool planned(const std::string& path, int blocks = 0) const {
    if (!plan) return false;
    plan->path += (plan->path.empty() ? "" : " + ") + path;
    plan->blocks = std::max(plan->blocks, blocks);
    return true;
  }
  // The same, naming the op (where the plan names none yet: an op around another, e.g. a hybrid around its
  // ring, names itself first) and a kernel's dynamic shared memory (the largest so far).
  bool planned_op(const char* op, const std::string& path, int blocks, int smem_bytes) const {
    if (!plan) return false;
    if (plan->op.empty()) plan->op = op;
    plan->smem_bytes = std::max(plan->smem_bytes, smem_bytes);
    return planned(path, blocks);
  }
};

}  // namespace weft::ops
