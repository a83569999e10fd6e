// weft._weft: the C++ side of the Python package. It owns the communicator, hands out symmetric tensors
// through DLPack, reads any DLPack tensor, and runs the ops on raw pointers. Argument checking that needs
// no GPU (dtypes, shapes, devices) happens in weft/__init__.py; this layer re-checks what the C++ API
// cannot see (pointers, alignment) through the ops' own weft::Error messages.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "weft/ops/attention.hpp"
#include "weft/ops/collectives.hpp"
#include "weft/ops/context_attention.hpp"
#include "weft/ops/fused.hpp"
#include "weft/ops/flash_decode.hpp"
#include "weft/ops/gemm.hpp"
#include "weft/ops/hierarchical.hpp"
#include "weft/ops/moe.hpp"
#include "weft/runtime/communicator.hpp"
#include "weft/runtime/multi_node.hpp"

namespace py = pybind11;

namespace {

// ---- DLPack ABI (v0.x "dltensor" capsules), declared from the public specification ----------------
struct DLDevice {
  int32_t device_type;  // 1 CPU, 2 CUDA, 3 CUDA host, 13 CUDA managed
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;  // 0 int, 1 uint, 2 float, 4 bfloat
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; null means compact row-major
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};
constexpr int32_t kDLCUDA = 2;

weft::DType parse_dtype(const std::string& s) {
  if (s == "bf16") return weft::DType::kBF16;
  if (s == "fp16") return weft::DType::kFP16;
  if (s == "fp32") return weft::DType::kFP32;
  throw py::type_error("weft: unsupported dtype '" + s + "' (bf16, fp16 or fp32)");
}
// An activation's name ("" or "none": none); the op refuses the ones it does not apply.
weft::Activation parse_activation(const std::string& s) {
  if (s.empty() || s == "none") return weft::Activation::kNone;
  if (s == "swiglu") return weft::Activation::kSwiGLU;
  if (s == "silu") return weft::Activation::kSiLU;
  if (s == "gelu") return weft::Activation::kGELU;
  if (s == "relu") return weft::Activation::kReLU;
  throw weft::Error("weft: the activation must be 'none', 'swiglu', 'silu', 'gelu' or 'relu', got '" + s +
                    "'");
}
weft::ReduceOp parse_op(const std::string& s) {
  if (s == "sum") return weft::ReduceOp::kSum;
  if (s == "max") return weft::ReduceOp::kMax;
  if (s == "min") return weft::ReduceOp::kMin;
  throw py::value_error("weft: unsupported reduction op '" + s + "' (sum, max or min)");
}

// A symmetric allocation kept alive by every DLPack export of it.
struct SymMemory {
  std::shared_ptr<weft::Communicator> comm;
  weft::SymmetricBuffer buf;
  ~SymMemory() {
    try {
      comm->free(buf);
    } catch (...) {
    }
  }
};

// The allocations of a virtual team (several ranks in this process): Communicator::alloc maps a buffer on
// every local rank at once, while each rank's Python object calls empty() on its own. The k-th call of
// every rank gets the k-th allocation, so the collective contract (every rank asks for the same sizes in the
// same order) reads as it does between processes; an allocation leaves the queue once every rank took it.
struct TeamAllocations {
  std::deque<std::shared_ptr<SymMemory>> pending;  // allocations some rank has not taken yet
  std::vector<uint64_t> taken;                     // allocations rank i took so far
  uint64_t made = 0;                               // allocations made so far
};

// One rank of this process's communicator: the only one under a launcher, or one of its virtual ranks.
struct Comm {
  std::shared_ptr<weft::Communicator> comm;
  int index = 0;  // which local rank
  std::shared_ptr<TeamAllocations> allocations;
  weft::Rank* sub = nullptr;  // a sub-team's rank (Communicator::subteam), else null: the team's own

  weft::Rank& rank() const { return sub ? *sub : comm->local(index); }
  // Team-wide host calls (symmetric allocations, the host barrier) belong to the whole team's ranks.
  void whole_team(const char* what) const {
    if (sub)
      throw weft::Error(std::string("weft: ") + what +
                        " is a call of the whole team: make it on the team's " +
                        "communicator, not on a sub-team's (subteam / group)");
  }
  // The caller's stream. 0 is torch's default, the legacy default stream: pass that, since a null stream
  // means "weft's own stream" to the C++ ops (unordered with the caller's work). Virtual ranks need a
  // stream each: on a shared stream a rank's kernel waiting for a peer would sit in front of the peer's part.
  cudaStream_t stream(uintptr_t s) const {
    if (s == 0 && comm->num_local() > 1)
      throw weft::Error(
          "weft: rank " + std::to_string(rank().rank()) +
          " of a virtual team was called on the default stream: each virtual rank needs a stream "
          "of its own (Team.run(fn) runs fn on each rank's stream)");
    return s ? reinterpret_cast<cudaStream_t>(s) : cudaStreamLegacy;
  }
  // The symmetric allocation of this rank's next empty() call (see TeamAllocations).
  std::shared_ptr<SymMemory> next_allocation(uint64_t bytes) const {
    TeamAllocations& a = *allocations;
    const uint64_t k = a.taken[index];
    if (k == a.made) {
      auto mem = std::make_shared<SymMemory>();
      mem->comm = comm;
      mem->buf = comm->alloc(bytes);
      a.pending.push_back(std::move(mem));
      ++a.made;
    }
    std::shared_ptr<SymMemory> mem = a.pending[k - (a.made - a.pending.size())];
    if (mem->buf.bytes < bytes)
      throw py::value_error("weft: rank " + std::to_string(rank().rank()) + " asked for " +
                            std::to_string(bytes) + " bytes in symmetric allocation " + std::to_string(k) +
                            ", another rank for " + std::to_string(mem->buf.bytes) +
                            ": every rank must call empty() with the same shapes in the same order");
    ++a.taken[index];
    const uint64_t least = *std::min_element(a.taken.begin(), a.taken.end());
    while (!a.pending.empty() && a.made - a.pending.size() < least) a.pending.pop_front();
    return mem;
  }
  // One Comm per local rank of c.
  static std::vector<Comm> of(std::shared_ptr<weft::Communicator> c) {
    auto allocations = std::make_shared<TeamAllocations>();
    allocations->taken.assign(c->num_local(), 0);
    std::vector<Comm> out;
    for (int i = 0; i < c->num_local(); ++i) out.push_back(Comm{c, i, allocations});
    return out;
  }
};

// A tensor in symmetric memory: one rank's part of an allocation (`mem`, `view` = the part), or a view into a
// workspace area of an op (`view`, kept valid by the op's contract, e.g. until the next MoE dispatch; `keep`
// holds the communicator).
struct SymTensor {
  std::shared_ptr<SymMemory> mem;
  std::vector<int64_t> shape;
  std::string dtype;
  int device = 0;
  void* view = nullptr;
  std::shared_ptr<weft::Communicator> keep;

  void* data() const { return view; }
  uintptr_t data_ptr() const { return reinterpret_cast<uintptr_t>(data()); }

  py::capsule dlpack(py::object /*stream*/) const {
    // The export owns: the DLManagedTensor, a copy of the shape, and a reference to the memory.
    struct Ctx {
      std::shared_ptr<SymMemory> mem;
      std::shared_ptr<weft::Communicator> keep;
      std::vector<int64_t> shape;
      DLManagedTensor managed;
    };
    auto* ctx = new Ctx{mem, keep, shape, {}};
    DLTensor& t = ctx->managed.dl_tensor;
    t.data = data();
    t.device = DLDevice{kDLCUDA, device};
    t.ndim = static_cast<int32_t>(ctx->shape.size());
    t.dtype = dtype == "bf16"    ? DLDataType{4, 16, 1}
              : dtype == "fp16"  ? DLDataType{2, 16, 1}
              : dtype == "int32" ? DLDataType{0, 32, 1}
              : dtype == "uint8" ? DLDataType{1, 8, 1}
                                 : DLDataType{2, 32, 1};
    t.shape = ctx->shape.data();
    t.strides = nullptr;
    t.byte_offset = 0;
    ctx->managed.manager_ctx = ctx;
    ctx->managed.deleter = [](DLManagedTensor* m) { delete static_cast<Ctx*>(m->manager_ctx); };
    return py::capsule(&ctx->managed, "dltensor", [](PyObject* cap) {
      // Deleter of an export nobody consumed (a consumer renames the capsule to "used_dltensor").
      if (PyCapsule_IsValid(cap, "dltensor")) {
        auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, "dltensor"));
        if (m && m->deleter) m->deleter(m);
      }
    });
  }
};

// Reads a "dltensor" capsule produced by any framework: (data pointer, shape, strides or None, dtype, device
// type, device id). The capsule is consumed and released at once; the caller keeps the producer's tensor
// alive for as long as the pointer is used.
py::tuple dlpack_info(py::capsule cap) {
  if (!PyCapsule_IsValid(cap.ptr(), "dltensor"))
    throw py::type_error("weft: expected an unconsumed DLPack capsule named 'dltensor'");
  auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap.ptr(), "dltensor"));
  const DLTensor& t = m->dl_tensor;
  std::vector<int64_t> shape(t.shape, t.shape + t.ndim);
  py::object strides = py::none();
  if (t.strides) strides = py::cast(std::vector<int64_t>(t.strides, t.strides + t.ndim));
  std::string dtype = "unsupported";
  if (t.dtype.lanes == 1) {
    if (t.dtype.code == 4 && t.dtype.bits == 16)
      dtype = "bf16";
    else if (t.dtype.code == 2 && t.dtype.bits == 16)
      dtype = "fp16";
    else if (t.dtype.code == 2 && t.dtype.bits == 32)
      dtype = "fp32";
  }
  const uintptr_t ptr = reinterpret_cast<uintptr_t>(t.data) + t.byte_offset;
  py::tuple out = py::make_tuple(ptr, shape, strides, dtype, t.device.device_type, t.device.device_id);
  PyCapsule_SetName(cap.ptr(), "used_dltensor");
  if (m->deleter) m->deleter(m);
  return out;
}

// Makes `device` current for the call and gives the caller's current device back.
struct OnDevice {
  int saved = 0;
  explicit OnDevice(int device) {
    cudaGetDevice(&saved);
    if (saved != device && cudaSetDevice(device) != cudaSuccess)
      throw weft::Error("weft: cannot make cuda:" + std::to_string(device) + " current");
  }
  ~OnDevice() { cudaSetDevice(saved); }
};

// (batch, seq_q, seq_k, heads, kv_heads, head_dim)
weft::AttentionShape attention_shape(py::tuple s) {
  return weft::AttentionShape{s[0].cast<int64_t>(), s[1].cast<int64_t>(), s[2].cast<int64_t>(),
                              s[3].cast<int64_t>(), s[4].cast<int64_t>(), s[5].cast<int64_t>()};
}

// segments: () for dense tensors, or (q_begin, q_end, k_begin, k_end, total_q, total_k) (device int32
// pointers, then row counts) for packed sequences; accumulate: () or (o, lse) fp32 device pointers.
weft::AttentionOptions attention_options(bool causal, float scale, py::tuple seg, py::tuple acc) {
  weft::AttentionOptions o;
  o.causal = causal;
  o.softmax_scale = scale;
  auto i32 = [](py::handle h) { return reinterpret_cast<const int32_t*>(h.cast<uintptr_t>()); };
  if (seg.size() == 6)
    o.segments = {i32(seg[0]),           i32(seg[1]), i32(seg[2]), i32(seg[3]), seg[4].cast<int64_t>(),
                  seg[5].cast<int64_t>()};
  else if (seg.size() != 0)
    throw weft::Error("weft: segments must be () or (q_begin, q_end, k_begin, k_end, total_q, total_k)");
  if (acc.size() == 2)
    o.accumulate = {reinterpret_cast<float*>(acc[0].cast<uintptr_t>()),
                    reinterpret_cast<float*>(acc[1].cast<uintptr_t>())};
  else if (acc.size() != 0)
    throw weft::Error("weft: accumulate must be () or (o, lse)");
  return o;
}

// Checks a sequence-parallel method name; true for "ulysses".
bool ulysses(const std::string& method) {
  if (method != "all_gather" && method != "ring" && method != "ulysses" && method.rfind("hybrid:", 0) != 0)
    throw weft::Error(
        "weft: context attention method must be 'all_gather', 'ring', 'ulysses' or 'hybrid:U', got '" +
        method + "'");
  return method == "ulysses";
}

// A sequence-parallel method name's layout suffix: "<method>/contiguous" asks for contiguous causal shards
// (AttentionOptions::contiguous_shards). Returns the method without it.
std::string without_layout(const std::string& method, bool* contiguous) {
  const std::string suffix = "/contiguous";
  *contiguous = method.size() > suffix.size() &&
                method.compare(method.size() - suffix.size(), suffix.size(), suffix) == 0;
  return *contiguous ? method.substr(0, method.size() - suffix.size()) : method;
}

// The Ulysses size of "hybrid:U", else 0.
int hybrid(const std::string& method) {
  if (method.rfind("hybrid:", 0) != 0) return 0;
  try {
    size_t used = 0;
    const int u = std::stoi(method.substr(7), &used);
    if (used == method.size() - 7 && u > 0) return u;
  } catch (const std::exception&) {
  }
  throw weft::Error("weft: context attention method 'hybrid:U' needs a positive Ulysses size U, got '" +
                    method + "'");
}

// (tokens, max_tokens, hidden, num_experts, top_k, align[, zero_padding[, low_latency]])
weft::MoeShape moe_shape(py::tuple s) {
  weft::MoeShape m{s[0].cast<int64_t>(), s[1].cast<int64_t>(), s[2].cast<int64_t>(),
                   s[3].cast<int>(),     s[4].cast<int>(),     s[5].cast<int>()};
  if (s.size() > 6) m.zero_padding = s[6].cast<int>() != 0;
  if (s.size() > 7) m.low_latency = s[7].cast<int>() != 0;
  return m;
}

// A SymTensor view of p, in c's heap (kept alive by the view).
SymTensor view_of(const Comm& c, void* p, std::vector<int64_t> shape, const std::string& dtype) {
  SymTensor t;
  t.shape = std::move(shape);
  t.dtype = dtype;
  t.device = c.rank().device();
  t.view = p;
  t.keep = c.comm;
  return t;
}

// b_layout "kn" ([K, N] row-major) or "nk" (an [N, K] weight).
weft::BLayout layout(const std::string& l) {
  return l == "nk" ? weft::BLayout::kNK : weft::BLayout::kKN;
}

// The launcher's environment of this process, with `secret` (shared by the Python side through torch's store)
// where WEFT_JOB_SECRET did not set one; throws naming `who` when there is no launcher.
weft::LaunchEnv launch_env(const std::string& who, const std::string& secret) {
  auto env = weft::parse_launch_env(weft::process_env(), static_cast<long>(::getppid()));
  if (!env)
    throw weft::Error(who +
                      ": no launcher environment: start one process per GPU with torchrun, mpirun or "
                      "weft-launch (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE)");
  if (env->secret.empty() && !secret.empty()) {  // WEFT_JOB_SECRET, when set, wins
    if (secret.size() < 16)
      throw weft::Error(who + ": a job secret must hold at least 16 characters, got " +
                        std::to_string(secret.size()));
    env->secret = secret;
  }
  return *env;
}

// The communicator: creation (launcher environment, virtual teams), sub-teams, allocations, host calls.
void bind_comm(py::module_& m) {
  py::class_<Comm>(m, "Comm")
      .def_static(
          "from_env",
          [](int timeout_ms, const std::string& secret) {
            const weft::LaunchEnv env = launch_env("weft.init()", secret);
            if (env.nodes > 1)
              throw weft::Error(
                  "weft.init(): a multi-node job (" + std::to_string(env.nodes) +
                  " nodes): weft.init_multi_node() makes its team (the node's weft team and NCCL "
                  "between the nodes)");
            weft::Options o;
            o.timeout = std::chrono::milliseconds(timeout_ms);
            py::gil_scoped_release release;  // the rendezvous waits for the other processes
            return Comm::of(
                std::shared_ptr<weft::Communicator>(weft::Communicator::create_from_launcher(env, o)))[0];
          },
          py::arg("timeout_ms") = 0, py::arg("secret") = std::string())
      .def_static(
          "virtual_team",
          [](int world, int device, int sm_budget, int timeout_ms) {
            if (world < 2)
              throw py::value_error("weft: a virtual team needs at least 2 ranks, got " +
                                    std::to_string(world));
            weft::Options o;
            o.devices = {device};
            o.ranks_per_gpu = world;
            o.sm_budget = sm_budget;
            o.timeout = std::chrono::milliseconds(timeout_ms);
            return Comm::of(
                std::shared_ptr<weft::Communicator>(weft::Communicator::create_single_process(o)));
          },
          py::arg("world"), py::arg("device"), py::arg("sm_budget") = 0, py::arg("timeout_ms") = 0,
          "W ranks on one GPU in this process (one Comm per rank)")
      .def_property_readonly("rank", [](const Comm& c) { return c.rank().rank(); })
      .def_property_readonly("world_size", [](const Comm& c) { return c.rank().world(); })
      // The sub-team of `size` ranks `stride` apart holding this rank (Communicator::subteam: size x stride
      // divides the world size; lane >= 1: another instance with resources of its own); ops called with it
      // run over that sub-team.
      .def(
          "subteam",
          [](const Comm& c, int size, int stride, int lane) {
            if (c.sub) throw weft::Error("weft: subteam of a sub-team: split the team's own communicator");
            Comm s = c;
            weft::Rank& r = c.comm->subteam(c.comm->local(c.index), size, stride, lane);
            s.sub = &r == &c.comm->local(c.index) ? nullptr : &r;
            return s;
          },
          py::arg("size"), py::arg("stride") = 1, py::arg("lane") = 0)
      .def_property_readonly("is_subteam", [](const Comm& c) { return c.sub != nullptr; })
      .def_property_readonly("device", [](const Comm& c) { return c.rank().device(); })
      .def_property_readonly("local_ranks", [](const Comm& c) { return c.comm->num_local(); })
      .def_property_readonly("stream",
                             [](const Comm& c) { return reinterpret_cast<uintptr_t>(c.rank().stream()); })
      .def("empty",
           [](const Comm& c, std::vector<int64_t> shape, const std::string& dtype) {
             c.whole_team("empty()");
             uint64_t n = 1;
             for (int64_t d : shape) {
               if (d < 0) throw py::value_error("weft: negative dimension in shape");
               n *= static_cast<uint64_t>(d);
             }
             SymTensor t;
             t.mem = c.next_allocation(std::max<uint64_t>(1, n * weft::dtype_size(parse_dtype(dtype))));
             t.view = t.mem->buf.local[c.index];
             t.shape = std::move(shape);
             t.dtype = dtype;
             t.device = c.rank().device();
             return t;
           })
      .def("in_heap",
           [](const Comm& c, uintptr_t p, uint64_t bytes) {
             return c.comm->in_heap(c.rank(), reinterpret_cast<void*>(p), bytes);
           })
      // A sub-team's ops use its own scope of the shared area.
      .def("reserve_workspace",
           [](const Comm& c, uint64_t bytes) { c.comm->reserve_workspace(bytes, c.rank().scope()); })
      .def("barrier",
           [](const Comm& c) {
             c.whole_team("barrier()");
             py::gil_scoped_release release;
             c.comm->host_barrier();
           })
      .def("synchronize", [](const Comm& c) {
        py::gil_scoped_release release;
        c.comm->synchronize();
      });
}

// Symmetric tensors, DLPack and layout helpers.
void bind_runtime(py::module_& m) {
  py::class_<SymTensor>(m, "SymTensor")
      .def_property_readonly("shape", [](const SymTensor& t) { return py::tuple(py::cast(t.shape)); })
      .def_property_readonly("dtype", [](const SymTensor& t) { return t.dtype; })
      .def_property_readonly("data_ptr", &SymTensor::data_ptr)
      .def("__dlpack__", &SymTensor::dlpack, py::arg("stream") = py::none())
      .def("__dlpack_device__", [](const SymTensor& t) { return py::make_tuple(kDLCUDA, t.device); });

  m.def(
      "ring_shard_tokens",
      [](const std::vector<int64_t>& doc_lengths, int world, int rank, bool causal, bool contiguous) {
        if (rank < 0 || rank >= world)
          throw std::invalid_argument("rank " + std::to_string(rank) + " outside a team of " +
                                      std::to_string(world));
        return weft::context_attention_local_tokens(world, rank, doc_lengths, causal, contiguous);
      },
      py::arg("doc_lengths"), py::arg("world"), py::arg("rank"), py::arg("causal"),
      py::arg("contiguous") = false,
      "Positions in the packed sequence of rank's local rows under ring attention's layout "
      "(weft::context_attention_local_tokens)");
  m.def("dlpack_info", &dlpack_info,
        "Reads (ptr, shape, strides, dtype, device_type, device_id) of a DLPack capsule");
  m.def(
      "capture_id",
      [](uintptr_t stream) -> unsigned long long {
        cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
        unsigned long long id = 0;
        if (cudaStreamGetCaptureInfo(reinterpret_cast<cudaStream_t>(stream), &status, &id) != cudaSuccess) {
          cudaGetLastError();
          return 0;
        }
        return status == cudaStreamCaptureStatusActive ? id : 0;
      },
      "The id of the CUDA graph capture the stream is in (unique per capture), 0 when not capturing");
}

// Ops on raw device pointers; the Python layer checks shapes and devices first.
void bind_collectives(py::module_& m) {
  m.def("all_reduce", [](const Comm& c, uintptr_t in, uintptr_t out, uint64_t count, const std::string& dtype,
                         const std::string& op, uintptr_t stream) {
    weft::all_reduce(*c.comm, c.rank(), reinterpret_cast<const void*>(in), reinterpret_cast<void*>(out),
                     count, parse_dtype(dtype), parse_op(op), c.stream(stream));
  });
  m.def("all_gather", [](const Comm& c, uintptr_t in, uintptr_t out, uint64_t rows, uint64_t cols, int dim,
                         const std::string& dtype, uintptr_t stream) {
    weft::all_gather(*c.comm, c.rank(), reinterpret_cast<const void*>(in), reinterpret_cast<void*>(out),
                     weft::Shape2D{rows, cols}, dim, parse_dtype(dtype), c.stream(stream));
  });
  m.def("reduce_scatter", [](const Comm& c, uintptr_t in, uintptr_t out, uint64_t rows, uint64_t cols,
                             int dim, const std::string& dtype, const std::string& op, uintptr_t stream) {
    weft::reduce_scatter(*c.comm, c.rank(), reinterpret_cast<const void*>(in), reinterpret_cast<void*>(out),
                         weft::Shape2D{rows, cols}, dim, parse_dtype(dtype), parse_op(op), c.stream(stream));
  });
  m.def("all_to_all", [](const Comm& c, uintptr_t in, uintptr_t out, uint64_t count_per_rank,
                         const std::string& dtype, uintptr_t stream) {
    weft::all_to_all(*c.comm, c.rank(), reinterpret_cast<const void*>(in), reinterpret_cast<void*>(out),
                     count_per_rank, parse_dtype(dtype), c.stream(stream));
  });
  m.def("all_to_all_v", [](const Comm& c, uintptr_t in, uintptr_t send_counts, uint64_t in_rows,
                           uintptr_t out, uintptr_t recv_counts, uint64_t out_rows, uint64_t row_elems,
                           const std::string& dtype, uintptr_t stream) {
    weft::all_to_all_v(*c.comm, c.rank(), reinterpret_cast<const void*>(in),
                       reinterpret_cast<const int64_t*>(send_counts), in_rows, reinterpret_cast<void*>(out),
                       reinterpret_cast<int64_t*>(recv_counts), out_rows, row_elems, parse_dtype(dtype),
                       c.stream(stream));
  });
  // Rooted: count elements per part; pointers only the root uses may be 0 elsewhere.
  using Rooted =
      void (*)(weft::Communicator&, weft::Rank&, const void*, void*, size_t, weft::DType, int, cudaStream_t);
  for (auto [name, fn] : {std::pair<const char*, Rooted>{"broadcast", &weft::broadcast},
                          {"scatter", &weft::scatter},
                          {"gather", &weft::gather}})
    m.def(name, [fn = fn](const Comm& c, uintptr_t in, uintptr_t out, uint64_t count,
                          const std::string& dtype, int root, uintptr_t stream) {
      fn(*c.comm, c.rank(), reinterpret_cast<const void*>(in), reinterpret_cast<void*>(out), count,
         parse_dtype(dtype), root, c.stream(stream));
    });
  m.def("reduce", [](const Comm& c, uintptr_t in, uintptr_t out, uint64_t count, const std::string& dtype,
                     const std::string& op, int root, uintptr_t stream) {
    weft::reduce(*c.comm, c.rank(), reinterpret_cast<const void*>(in), reinterpret_cast<void*>(out), count,
                 parse_dtype(dtype), parse_op(op), root, c.stream(stream));
  });
}

// Flash attention (bf16, [batch, seq, heads, dim] tensors on GPU `device`), no communicator: the call runs
// with `device` current and gives the caller's current device back.
void bind_one_gpu_ops(py::module_& m) {
  m.def(
      "flash_attention_forward",
      [](int device, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out, uintptr_t lse, py::tuple shape,
         bool causal, float scale, uintptr_t stream, py::tuple segments, py::tuple accumulate,
         const std::string& dtype) {
        OnDevice on(device);
        weft::flash_attention_forward(reinterpret_cast<const void*>(q), reinterpret_cast<const void*>(k),
                                      reinterpret_cast<const void*>(v), reinterpret_cast<void*>(out),
                                      reinterpret_cast<float*>(lse), attention_shape(shape),
                                      parse_dtype(dtype), reinterpret_cast<cudaStream_t>(stream),
                                      attention_options(causal, scale, segments, accumulate));
      },
      py::arg("device"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"),
      py::arg("shape"), py::arg("causal"), py::arg("scale"), py::arg("stream"),
      py::arg("segments") = py::tuple(), py::arg("accumulate") = py::tuple(), py::arg("dtype") = "bf16");
  // Grouped GEMM on one GPU (weft/ops/gemm.hpp): c [rows, n] = a [rows, k] . b_e per group e of rows; b
  // [groups, n, k] ("nk") or [groups, k, n] ("kn"); rows past the last group's end zeroed or left;
  // activation "swiglu": b's columns gate / up in blocks of 128, c [rows, n / 2] (Activation::kSwiGLU).
  m.def(
      "grouped_gemm",
      [](int device, uintptr_t a, uintptr_t b, uintptr_t c, uintptr_t group_end, int groups, int64_t rows,
         int64_t n, int64_t k, const std::string& b_layout, const std::string& c_dtype, bool zero_unused_rows,
         const std::string& activation, uintptr_t stream, uintptr_t group_rows) {
        OnDevice on(device);
        weft::GemmOptions o;
        o.zero_unused_rows = zero_unused_rows;
        o.group_rows = reinterpret_cast<const int32_t*>(group_rows);
        o.activation = parse_activation(activation);
        weft::grouped_gemm(reinterpret_cast<const void*>(a), reinterpret_cast<const void*>(b),
                           reinterpret_cast<void*>(c), reinterpret_cast<const int32_t*>(group_end), groups,
                           rows, n, k, b_layout == "nk" ? weft::BLayout::kNK : weft::BLayout::kKN,
                           parse_dtype(c_dtype), reinterpret_cast<cudaStream_t>(stream), o);
      },
      py::arg("device"), py::arg("a"), py::arg("b"), py::arg("c"), py::arg("group_end"), py::arg("groups"),
      py::arg("rows"), py::arg("n"), py::arg("k"), py::arg("b_layout"), py::arg("c_dtype"),
      py::arg("zero_unused_rows"), py::arg("activation"), py::arg("stream"), py::arg("group_rows") = 0);
  m.def(
      "flash_attention_backward_workspace_bytes",
      [](py::tuple shape, py::tuple segments, bool deterministic) {
        weft::AttentionOptions o = attention_options(false, 0.f, segments, py::tuple());
        o.deterministic = deterministic;
        return weft::flash_attention_backward_workspace_bytes(attention_shape(shape), o);
      },
      py::arg("shape"), py::arg("segments") = py::tuple(), py::arg("deterministic") = false);
  m.def(
      "flash_attention_backward",
      [](int device, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out, uintptr_t dout, uintptr_t lse,
         uintptr_t dq, uintptr_t dk, uintptr_t dv, uintptr_t workspace, uint64_t workspace_bytes,
         py::tuple shape, bool causal, float scale, uintptr_t stream, py::tuple segments,
         const std::string& dtype, bool deterministic) {
        OnDevice on(device);
        weft::AttentionOptions o = attention_options(causal, scale, segments, py::tuple());
        o.deterministic = deterministic;
        weft::flash_attention_backward(
            reinterpret_cast<const void*>(q), reinterpret_cast<const void*>(k),
            reinterpret_cast<const void*>(v), reinterpret_cast<const void*>(out),
            reinterpret_cast<const void*>(dout), reinterpret_cast<const float*>(lse),
            reinterpret_cast<void*>(dq), reinterpret_cast<void*>(dk), reinterpret_cast<void*>(dv),
            reinterpret_cast<void*>(workspace), workspace_bytes, attention_shape(shape), parse_dtype(dtype),
            reinterpret_cast<cudaStream_t>(stream), o);
      },
      py::arg("device"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("dout"),
      py::arg("lse"), py::arg("dq"), py::arg("dk"), py::arg("dv"), py::arg("workspace"),
      py::arg("workspace_bytes"), py::arg("shape"), py::arg("causal"), py::arg("scale"), py::arg("stream"),
      py::arg("segments") = py::tuple(), py::arg("dtype") = "bf16", py::arg("deterministic") = false);
}

void bind_decode(py::module_& m) {
  // Distributed flash-decode (weft/ops/flash_decode.hpp): block_table 0 for a contiguous cache; offsets and
  // seq_total 0 for a team of one; out_rank -1: out on every rank.
  m.def("flash_decode", [](const Comm& c, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t block_table,
                           int64_t block_size, int64_t max_blocks, int64_t num_blocks, uintptr_t seqlens,
                           uintptr_t offsets, uintptr_t seq_total, uintptr_t out, uintptr_t lse,
                           py::tuple shape, const std::string& dtype, uintptr_t stream, bool causal,
                           float scale, int out_rank) {
    weft::DecodeCache cache;
    cache.k = reinterpret_cast<const void*>(k);
    cache.v = reinterpret_cast<const void*>(v);
    cache.block_table = reinterpret_cast<const int32_t*>(block_table);
    cache.block_size = block_size;
    cache.max_blocks = max_blocks;
    cache.num_blocks = num_blocks;
    cache.seqlens = reinterpret_cast<const int32_t*>(seqlens);
    cache.offsets = reinterpret_cast<const int32_t*>(offsets);
    cache.seq_total = reinterpret_cast<const int32_t*>(seq_total);
    const weft::DecodeShape s{shape[0].cast<int64_t>(), shape[1].cast<int64_t>(), shape[2].cast<int64_t>(),
                              shape[3].cast<int64_t>(), shape[4].cast<int64_t>(), shape[5].cast<int64_t>()};
    weft::DecodeOptions o;
    o.causal = causal;
    o.scale = scale;
    o.out_rank = out_rank;
    weft::flash_decode(*c.comm, c.rank(), reinterpret_cast<const void*>(q), cache,
                       reinterpret_cast<void*>(out), reinterpret_cast<float*>(lse), s, parse_dtype(dtype),
                       c.stream(stream), o);
  });
}

// Sequence-parallel attention on this process's rank: method "all_gather" (weft::context_attention_*),
// "ring" (weft::ring_attention_*), "ulysses" or "hybrid:U" (weft::hybrid_attention_* with Ulysses size U);
// tensors in ring attention's layout of doc_lengths (weft/ops/context_attention.hpp).
void bind_sequence_parallel(py::module_& m) {
  m.def("context_attention_workspace_bytes",
        [](const std::string& named, int world, const std::vector<int64_t>& docs, bool causal, int64_t heads,
           int64_t kv_heads, int64_t head_dim, bool backward) -> uint64_t {
          bool contiguous = false;  // the sizes cover both layouts
          const std::string method = without_layout(named, &contiguous);
          if (const int u = hybrid(method))
            return backward ? weft::hybrid_attention_backward_workspace_bytes(world, u, docs, causal, heads,
                                                                              kv_heads, head_dim)
                            : weft::hybrid_attention_workspace_bytes(world, u, docs, causal, heads, kv_heads,
                                                                     head_dim);
          if (ulysses(method))
            return backward ? weft::ulysses_attention_backward_workspace_bytes(world, docs, causal, heads,
                                                                               kv_heads, head_dim)
                            : weft::ulysses_attention_workspace_bytes(world, docs, causal, heads, kv_heads,
                                                                      head_dim);
          if (backward)
            return method == "ring" ? weft::ring_attention_backward_workspace_bytes(world, docs, causal,
                                                                                    heads, kv_heads, head_dim)
                                    : weft::context_attention_backward_workspace_bytes(
                                          world, docs, causal, heads, kv_heads, head_dim);
          return method == "ring"
                     ? weft::ring_attention_workspace_bytes(world, docs, causal, kv_heads, head_dim)
                     : weft::context_attention_workspace_bytes(world, docs, causal, kv_heads, head_dim);
        });
  m.def(
      "context_attention_local_rows",
      [](int world, int rank, const std::vector<int64_t>& docs, bool causal, bool contiguous) {
        return weft::context_attention_local_rows(world, rank, docs, causal, contiguous);
      },
      py::arg("world"), py::arg("rank"), py::arg("docs"), py::arg("causal"), py::arg("contiguous") = false);
  m.def("context_attention_forward",
        [](const Comm& c, const std::string& named, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out,
           uintptr_t lse, const std::vector<int64_t>& docs, int64_t heads, int64_t kv_heads, int64_t head_dim,
           uintptr_t workspace, uint64_t workspace_bytes, const std::string& dtype, uintptr_t stream,
           bool causal, float scale) {
          weft::AttentionOptions o;
          o.causal = causal;
          o.softmax_scale = scale;
          const std::string method = without_layout(named, &o.contiguous_shards);
          if (const int u = hybrid(method))
            return weft::hybrid_attention_forward(
                *c.comm, c.rank(), reinterpret_cast<const void*>(q), reinterpret_cast<const void*>(k),
                reinterpret_cast<const void*>(v), reinterpret_cast<void*>(out), reinterpret_cast<float*>(lse),
                docs, heads, kv_heads, head_dim, u, reinterpret_cast<void*>(workspace), workspace_bytes,
                parse_dtype(dtype), c.stream(stream), o);
          auto* op = ulysses(method)    ? &weft::ulysses_attention_forward
                     : method == "ring" ? &weft::ring_attention_forward
                                        : &weft::context_attention_forward;
          op(*c.comm, c.rank(), reinterpret_cast<const void*>(q), reinterpret_cast<const void*>(k),
             reinterpret_cast<const void*>(v), reinterpret_cast<void*>(out), reinterpret_cast<float*>(lse),
             docs, heads, kv_heads, head_dim, reinterpret_cast<void*>(workspace), workspace_bytes,
             parse_dtype(dtype), c.stream(stream), o);
        });
  m.def("context_attention_backward",
        [](const Comm& c, const std::string& named, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out,
           uintptr_t dout, uintptr_t lse, uintptr_t dq, uintptr_t dk, uintptr_t dv,
           const std::vector<int64_t>& docs, int64_t heads, int64_t kv_heads, int64_t head_dim,
           uintptr_t workspace, uint64_t workspace_bytes, const std::string& dtype, uintptr_t stream,
           bool causal, float scale) {
          weft::AttentionOptions o;
          o.causal = causal;
          o.softmax_scale = scale;
          const std::string method = without_layout(named, &o.contiguous_shards);
          if (const int u = hybrid(method))
            return weft::hybrid_attention_backward(
                *c.comm, c.rank(), reinterpret_cast<const void*>(q), reinterpret_cast<const void*>(k),
                reinterpret_cast<const void*>(v), reinterpret_cast<const void*>(out),
                reinterpret_cast<const void*>(dout), reinterpret_cast<const float*>(lse),
                reinterpret_cast<void*>(dq), reinterpret_cast<void*>(dk), reinterpret_cast<void*>(dv), docs,
                heads, kv_heads, head_dim, u, reinterpret_cast<void*>(workspace), workspace_bytes,
                parse_dtype(dtype), c.stream(stream), o);
          auto* op = ulysses(method)    ? &weft::ulysses_attention_backward
                     : method == "ring" ? &weft::ring_attention_backward
                                        : &weft::context_attention_backward;
          op(*c.comm, c.rank(), reinterpret_cast<const void*>(q), reinterpret_cast<const void*>(k),
             reinterpret_cast<const void*>(v), reinterpret_cast<const void*>(out),
             reinterpret_cast<const void*>(dout), reinterpret_cast<const float*>(lse),
             reinterpret_cast<void*>(dq), reinterpret_cast<void*>(dk), reinterpret_cast<void*>(dv), docs,
             heads, kv_heads, head_dim, reinterpret_cast<void*>(workspace), workspace_bytes,
             parse_dtype(dtype), c.stream(stream), o);
        });
}

// moe_dispatch's result for Python (the binding's comment says what each value is).
py::tuple dispatched_tuple(const Comm& c, const weft::MoeDispatched& d, const weft::MoeShape& s,
                           const std::string& dtype) {
  const int64_t per = s.num_experts / c.rank().world();
  return py::make_tuple(
      view_of(c, const_cast<void*>(d.rows), {d.capacity, s.hidden}, dtype),
      view_of(c, const_cast<int32_t*>(d.group_end), {per}, "int32"), reinterpret_cast<uintptr_t>(d.row_of),
      reinterpret_cast<uintptr_t>(d.experts), d.capacity, reinterpret_cast<uintptr_t>(d.counts),
      reinterpret_cast<uintptr_t>(d.row_source),
      d.group_rows ? py::object(py::cast(view_of(c, const_cast<int32_t*>(d.group_rows), {per}, "int32")))
                   : py::object(py::none()));
}

// MoE expert parallelism on this process's rank (weft/ops/moe.hpp). shape: (tokens, max_tokens, hidden,
// num_experts, top_k, align). Views into the op's areas come back as SymTensor views.
void bind_moe(py::module_& m) {
  m.def("moe_capacity",
        [](int world, py::tuple shape) { return weft::moe_capacity(world, moe_shape(shape)); });
  m.def("moe_dispatch_workspace_bytes", [](int world, py::tuple shape) {
    return weft::moe_dispatch_workspace_bytes(world, moe_shape(shape));
  });
  // Returns (rows view [capacity, hidden], group_end view [experts per rank] int32, row_of pointer, experts
  // pointer, capacity, counts-table pointer, row-source pointer, group_rows view [experts per rank] int32:
  // the low-latency dispatch's rows per group, else None).
  m.def("moe_dispatch", [](const Comm& c, uintptr_t tokens, uintptr_t experts, py::tuple shape,
                           uintptr_t workspace, uint64_t workspace_bytes, const std::string& dtype,
                           uintptr_t stream) {
    const weft::MoeShape s = moe_shape(shape);
    const weft::MoeDispatched d = weft::moe_dispatch(
        *c.comm, c.rank(), reinterpret_cast<const void*>(tokens), reinterpret_cast<const int32_t*>(experts),
        s, reinterpret_cast<void*>(workspace), workspace_bytes, parse_dtype(dtype), c.stream(stream));
    return dispatched_tuple(c, d, s, dtype);
  });
  // The dispatch and the first expert GEMM in one (bf16): c [capacity, n] (or n / 2 with swiglu) = rows . b
  // per local expert, b [experts per rank, n, hidden] (b_nk) or [experts per rank, hidden, n]. Returns
  // moe_dispatch's tuple.
  m.def("moe_dispatch_grouped_gemm", [](const Comm& c, uintptr_t tokens, uintptr_t experts, py::tuple shape,
                                        uintptr_t workspace, uint64_t workspace_bytes, uintptr_t b, bool b_nk,
                                        int64_t n, bool swiglu, uintptr_t out, uintptr_t stream) {
    const weft::MoeShape s = moe_shape(shape);
    const weft::MoeDispatched d = weft::moe_dispatch_grouped_gemm(
        *c.comm, c.rank(), reinterpret_cast<const void*>(tokens), reinterpret_cast<const int32_t*>(experts),
        s, reinterpret_cast<void*>(workspace), workspace_bytes, reinterpret_cast<const void*>(b),
        b_nk ? weft::BLayout::kNK : weft::BLayout::kKN, n,
        swiglu ? weft::Activation::kSwiGLU : weft::Activation::kNone, reinterpret_cast<void*>(out),
        c.stream(stream));
    return dispatched_tuple(c, d, s, "bf16");
  });
  // The exact-count read-back of the last dispatch on this rank (synchronises its stream): (rows per local
  // expert, padded group ends, rows in use). counts: the dispatch's counts table (moe_dispatch's 6th value).
  m.def("moe_counts",
        [](const Comm& c, uintptr_t counts, uintptr_t group_end, py::tuple shape, uintptr_t stream) {
          weft::MoeDispatched d;
          d.counts = reinterpret_cast<const int32_t*>(counts);
          d.group_end = reinterpret_cast<const int32_t*>(group_end);
          const weft::MoeCounts n = weft::moe_counts(c.rank(), d, moe_shape(shape), c.stream(stream));
          return py::make_tuple(n.expert_rows, n.group_end, n.rows);
        });
  m.def("moe_combine_input", [](const Comm& c, py::tuple shape, const std::string& dtype) {
    const weft::MoeShape s = moe_shape(shape);
    void* p = weft::moe_combine_input(*c.comm, c.rank(), s, parse_dtype(dtype));
    return view_of(c, p, {weft::moe_capacity(c.rank().world(), s), s.hidden}, dtype);
  });
  // group_rows: the low-latency dispatch's (its handle), else 0.
  m.def("moe_combine",
        [](const Comm& c, uintptr_t expert_out, uintptr_t row_of, uintptr_t experts, uintptr_t weights,
           uintptr_t out, py::tuple shape, const std::string& dtype, uintptr_t stream, uintptr_t group_rows) {
          weft::MoeDispatched d;
          d.row_of = reinterpret_cast<const int32_t*>(row_of);
          d.experts = reinterpret_cast<const int32_t*>(experts);
          d.group_rows = reinterpret_cast<const int32_t*>(group_rows);
          weft::moe_combine(*c.comm, c.rank(), reinterpret_cast<const void*>(expert_out), d,
                            reinterpret_cast<const float*>(weights), reinterpret_cast<void*>(out),
                            moe_shape(shape), parse_dtype(dtype), c.stream(stream));
        });
  m.def("moe_grouped_gemm_combine",
        [](const Comm& c, uintptr_t a, uintptr_t b, bool b_nk, int64_t rows, int64_t inter,
           uintptr_t row_source, uintptr_t row_of, uintptr_t experts, uintptr_t group_end, int64_t capacity,
           uintptr_t weights, uintptr_t out, py::tuple shape, uintptr_t stream) {
          weft::MoeDispatched d;
          d.row_source = reinterpret_cast<const int32_t*>(row_source);
          d.row_of = reinterpret_cast<const int32_t*>(row_of);
          d.experts = reinterpret_cast<const int32_t*>(experts);
          d.group_end = reinterpret_cast<const int32_t*>(group_end);
          d.capacity = capacity;
          weft::moe_grouped_gemm_combine(*c.comm, c.rank(), reinterpret_cast<const void*>(a),
                                         reinterpret_cast<const void*>(b),
                                         b_nk ? weft::BLayout::kNK : weft::BLayout::kKN, rows, inter, d,
                                         reinterpret_cast<const float*>(weights),
                                         reinterpret_cast<void*>(out), moe_shape(shape), c.stream(stream));
        });
  m.def("moe_combine_grad_input", [](const Comm& c, py::tuple shape, const std::string& dtype) {
    const weft::MoeShape s = moe_shape(shape);
    void* p = weft::moe_combine_grad_input(*c.comm, c.rank(), s, parse_dtype(dtype));
    return view_of(c, p, {weft::moe_capacity(c.rank().world(), s), s.hidden}, dtype);
  });
  m.def("moe_combine_backward", [](const Comm& c, uintptr_t expert_out, int64_t expert_rows, uintptr_t row_of,
                                   uintptr_t experts, uintptr_t weights, uintptr_t dout,
                                   uintptr_t d_expert_out, uintptr_t d_weights, py::tuple shape,
                                   const std::string& dtype, uintptr_t stream) {
    weft::MoeDispatched d;
    d.row_of = reinterpret_cast<const int32_t*>(row_of);
    d.experts = reinterpret_cast<const int32_t*>(experts);
    weft::moe_combine_backward(*c.comm, c.rank(), reinterpret_cast<const void*>(expert_out), expert_rows, d,
                               reinterpret_cast<const float*>(weights), reinterpret_cast<const void*>(dout),
                               reinterpret_cast<void*>(d_expert_out), reinterpret_cast<float*>(d_weights),
                               moe_shape(shape), parse_dtype(dtype), c.stream(stream));
  });
}

// Fused tensor-parallel ops (bf16): b_layout "kn" ([K, N] row-major) or "nk" (an [N, K] weight); the
// return value names the path that ran ("fused" or "sequential").
void bind_tensor_parallel(py::module_& m) {
  m.def("all_gather_matmul",
        [](const Comm& c, uintptr_t a, uintptr_t b, uintptr_t out, uintptr_t gathered, int64_t m, int64_t n,
           int64_t k, const std::string& b_layout, uintptr_t stream) {
          return std::string(weft::fused_path_name(weft::all_gather_matmul(
              *c.comm, c.rank(), reinterpret_cast<const void*>(a), reinterpret_cast<const void*>(b),
              reinterpret_cast<void*>(out), reinterpret_cast<void*>(gathered), m, n, k, layout(b_layout),
              c.stream(stream))));
        });
  m.def("matmul_reduce_scatter", [](const Comm& c, uintptr_t a, uintptr_t b, uintptr_t out, int64_t m,
                                    int64_t n, int64_t k, const std::string& b_layout, uintptr_t stream) {
    return std::string(weft::fused_path_name(weft::matmul_reduce_scatter(
        *c.comm, c.rank(), reinterpret_cast<const void*>(a), reinterpret_cast<const void*>(b),
        reinterpret_cast<void*>(out), m, n, k, layout(b_layout), c.stream(stream))));
  });
  m.def("matmul_all_reduce", [](const Comm& c, uintptr_t a, uintptr_t b, uintptr_t out, int64_t m, int64_t n,
                                int64_t k, const std::string& b_layout, uintptr_t stream) {
    return std::string(weft::fused_path_name(weft::matmul_all_reduce(
        *c.comm, c.rank(), reinterpret_cast<const void*>(a), reinterpret_cast<const void*>(b),
        reinterpret_cast<void*>(out), m, n, k, layout(b_layout), c.stream(stream))));
  });
}

// FP8 on one GPU (weft/ops/gemm.hpp): gemm_fp8 and quantize_fp8. Types and scaling kinds by name:
// "e4m3" / "e5m2"; "tensor", "rowcol", "block"; operand "a" / "b".
weft::Fp8Type parse_fp8(const std::string& t) {
  if (t == "e4m3") return weft::Fp8Type::kE4M3;
  if (t == "e5m2") return weft::Fp8Type::kE5M2;
  throw weft::Error("weft: FP8 type must be 'e4m3' or 'e5m2', got '" + t + "'");
}
weft::Fp8Scaling parse_scaling(const std::string& s) {
  if (s == "tensor") return weft::Fp8Scaling::kTensor;
  if (s == "rowcol") return weft::Fp8Scaling::kRowCol;
  if (s == "block") return weft::Fp8Scaling::kBlock;
  throw weft::Error("weft: FP8 scaling must be 'tensor', 'rowcol' or 'block', got '" + s + "'");
}

// The one-GPU FP8 ops: gemm_fp8, grouped_gemm_fp8 (a [rows, K], b [groups, N, K] FP8, block scales, c [rows,
// N]) and quantize_fp8 (weft/ops/gemm.hpp).
void bind_fp8_gemm(py::module_& m) {
  m.def(
      "gemm_fp8",
      [](int device, uintptr_t a, uintptr_t b, uintptr_t c, int64_t m_rows, int64_t n, int64_t k,
         const std::string& ab_type, const std::string& scaling, uintptr_t scale_a, uintptr_t scale_b,
         const std::string& c_dtype, uintptr_t stream, int64_t scale_a_m_stride) {
        OnDevice on(device);
        weft::Fp8Scales scales{parse_scaling(scaling), reinterpret_cast<const float*>(scale_a),
                               reinterpret_cast<const float*>(scale_b)};
        scales.a_m_stride = scale_a_m_stride;
        weft::gemm_fp8(reinterpret_cast<const void*>(a), reinterpret_cast<const void*>(b),
                       reinterpret_cast<void*>(c), m_rows, n, k, parse_fp8(ab_type), scales,
                       parse_dtype(c_dtype), reinterpret_cast<cudaStream_t>(stream));
      },
      py::arg("device"), py::arg("a"), py::arg("b"), py::arg("c"), py::arg("m"), py::arg("n"), py::arg("k"),
      py::arg("ab_type"), py::arg("scaling"), py::arg("scale_a"), py::arg("scale_b"), py::arg("c_dtype"),
      py::arg("stream"), py::arg("scale_a_m_stride") = 0);
  // lda: a's row stride in bytes (0: dense); scale_a_stride: floats between rows of scale_a (0: dense),
  // scale_a_m_stride: its M-major stride instead (Fp8Scales); group_rows: options.group_rows (0: none).
  m.def(
      "grouped_gemm_fp8",
      [](int device, uintptr_t a, uintptr_t b, uintptr_t c, uintptr_t group_end, int groups, int64_t rows,
         int64_t n, int64_t k, const std::string& ab_type, uintptr_t scale_a, uintptr_t scale_b,
         const std::string& c_dtype, uintptr_t stream, int64_t lda, int64_t scale_a_stride,
         uintptr_t group_rows, int64_t scale_a_m_stride) {
        OnDevice on(device);
        weft::GemmOptions o;
        o.lda = lda;
        o.group_rows = reinterpret_cast<const int32_t*>(group_rows);
        weft::Fp8Scales scales{weft::Fp8Scaling::kBlock, reinterpret_cast<const float*>(scale_a),
                               reinterpret_cast<const float*>(scale_b)};
        scales.a_row_stride = scale_a_stride;
        scales.a_m_stride = scale_a_m_stride;
        weft::grouped_gemm_fp8(reinterpret_cast<const void*>(a), reinterpret_cast<const void*>(b),
                               reinterpret_cast<void*>(c), reinterpret_cast<const int32_t*>(group_end),
                               groups, rows, n, k, parse_fp8(ab_type), scales, parse_dtype(c_dtype),
                               reinterpret_cast<cudaStream_t>(stream), o);
      },
      py::arg("device"), py::arg("a"), py::arg("b"), py::arg("c"), py::arg("group_end"), py::arg("groups"),
      py::arg("rows"), py::arg("n"), py::arg("k"), py::arg("ab_type"), py::arg("scale_a"), py::arg("scale_b"),
      py::arg("c_dtype"), py::arg("stream"), py::arg("lda"), py::arg("scale_a_stride"), py::arg("group_rows"),
      py::arg("scale_a_m_stride") = 0);
  m.def(
      "quantize_fp8",
      [](int device, uintptr_t in, const std::string& in_dtype, uintptr_t out, const std::string& out_type,
         uintptr_t scales, int64_t rows, int64_t cols, const std::string& scaling, const std::string& operand,
         uintptr_t stream, int64_t scale_m_stride) {
        OnDevice on(device);
        weft::quantize_fp8(reinterpret_cast<const void*>(in), parse_dtype(in_dtype),
                           reinterpret_cast<void*>(out), parse_fp8(out_type),
                           reinterpret_cast<float*>(scales), rows, cols, parse_scaling(scaling),
                           operand == "b" ? weft::Fp8Operand::kB : weft::Fp8Operand::kA,
                           reinterpret_cast<cudaStream_t>(stream), 0, 0, scale_m_stride);
      },
      py::arg("device"), py::arg("input"), py::arg("in_dtype"), py::arg("out"), py::arg("out_type"),
      py::arg("scales"), py::arg("rows"), py::arg("cols"), py::arg("scaling"), py::arg("operand"),
      py::arg("stream"), py::arg("scale_m_stride") = 0);
  // activate_quantize_fp8: in [rows, cols or 2 cols] -> out [rows, cols] FP8 with A's block scales;
  // group_end / group_rows (0: every row) with `groups` of them.
  m.def(
      "activate_quantize_fp8",
      [](int device, uintptr_t in, const std::string& in_dtype, const std::string& activation, uintptr_t out,
         const std::string& out_type, uintptr_t scales, int64_t rows, int64_t cols, uintptr_t stream,
         int64_t scale_m_stride, uintptr_t group_end, uintptr_t group_rows, int groups) {
        OnDevice on(device);
        weft::activate_quantize_fp8(
            reinterpret_cast<const void*>(in), parse_dtype(in_dtype), parse_activation(activation),
            reinterpret_cast<void*>(out), parse_fp8(out_type), reinterpret_cast<float*>(scales), rows, cols,
            reinterpret_cast<cudaStream_t>(stream), 0, 0, scale_m_stride,
            weft::Fp8QuantizeRows{reinterpret_cast<const int32_t*>(group_end),
                                  reinterpret_cast<const int32_t*>(group_rows), groups});
      },
      py::arg("device"), py::arg("input"), py::arg("in_dtype"), py::arg("activation"), py::arg("out"),
      py::arg("out_type"), py::arg("scales"), py::arg("rows"), py::arg("cols"), py::arg("stream"),
      py::arg("scale_m_stride"), py::arg("group_end"), py::arg("group_rows"), py::arg("groups"));
}

// The team FP8 ops: all_gather_scaled_matmul, scaled_matmul_reduce_scatter / all_reduce, moe_dispatch_fp8.
void bind_fp8(py::module_& m) {
  // all_gather_scaled_matmul (weft/ops/fused.hpp): a_shard [M / W, K] and b [N, K] FP8, out [M, N] bf16.
  m.def("all_gather_scaled_matmul",
        [](const Comm& c, uintptr_t a, uintptr_t scale_a, uintptr_t b, uintptr_t scale_b, uintptr_t out,
           int64_t m, int64_t n, int64_t k, const std::string& ab_type, const std::string& scaling,
           uintptr_t stream) {
          return std::string(weft::fused_path_name(weft::all_gather_scaled_matmul(
              *c.comm, c.rank(), reinterpret_cast<const void*>(a), reinterpret_cast<const float*>(scale_a),
              reinterpret_cast<const void*>(b), reinterpret_cast<const float*>(scale_b),
              reinterpret_cast<void*>(out), m, n, k, parse_fp8(ab_type), parse_scaling(scaling),
              c.stream(stream))));
        });
  // scaled_matmul_reduce_scatter / all_reduce: a [M, K] and b [N, K] FP8; out [M / W, N] or [M, N].
  m.def("scaled_matmul_reduce",
        [](const Comm& c, uintptr_t a, uintptr_t scale_a, uintptr_t b, uintptr_t scale_b, uintptr_t out,
           int64_t m, int64_t n, int64_t k, const std::string& ab_type, const std::string& scaling,
           bool all_reduce, uintptr_t stream) {
          const auto op = all_reduce ? &weft::scaled_matmul_all_reduce : &weft::scaled_matmul_reduce_scatter;
          return std::string(weft::fused_path_name(
              op(*c.comm, c.rank(), reinterpret_cast<const void*>(a), reinterpret_cast<const float*>(scale_a),
                 reinterpret_cast<const void*>(b), reinterpret_cast<const float*>(scale_b),
                 reinterpret_cast<void*>(out), m, n, k, parse_fp8(ab_type), parse_scaling(scaling),
                 c.stream(stream), weft::FusedOptions{})));
        });
  // The FP8 dispatch: returns (packed rows view [capacity, row_bytes] uint8, group_end view, row_of pointer,
  // experts pointer, capacity, row_bytes, group_rows view [experts per rank] int32: the low-latency
  // dispatch's rows per group, else None).
  m.def("moe_dispatch_fp8_workspace_bytes", [](int world, py::tuple shape) {
    return weft::moe_dispatch_fp8_workspace_bytes(world, moe_shape(shape));
  });
  m.def("moe_dispatch_fp8", [](const Comm& c, uintptr_t tokens, uintptr_t experts, py::tuple shape,
                               uintptr_t workspace, uint64_t workspace_bytes, const std::string& dtype,
                               uintptr_t stream) {
    const weft::MoeShape s = moe_shape(shape);
    const weft::MoeDispatchedFp8 d = weft::moe_dispatch_fp8(
        *c.comm, c.rank(), reinterpret_cast<const void*>(tokens), reinterpret_cast<const int32_t*>(experts),
        s, reinterpret_cast<void*>(workspace), workspace_bytes, parse_dtype(dtype), c.stream(stream));
    const int64_t per = s.num_experts / c.rank().world();
    return py::make_tuple(
        view_of(c, const_cast<uint8_t*>(d.values), {d.dispatched.capacity, d.row_bytes}, "uint8"),
        view_of(c, const_cast<int32_t*>(d.dispatched.group_end), {per}, "int32"),
        reinterpret_cast<uintptr_t>(d.dispatched.row_of), reinterpret_cast<uintptr_t>(d.dispatched.experts),
        d.dispatched.capacity, d.row_bytes,
        d.dispatched.group_rows
            ? py::object(py::cast(view_of(c, const_cast<int32_t*>(d.dispatched.group_rows), {per}, "int32")))
            : py::object(py::none()));
  });
}

}  // namespace

// A team spanning nodes (weft.init_multi_node): the node's weft team as a Comm, the hierarchical collectives
// (weft inside the node, NCCL between nodes).
void bind_multi_node(py::module_& m) {
  using weft::MultiNodeTeam;
  py::class_<MultiNodeTeam, std::shared_ptr<MultiNodeTeam>>(m, "MultiNode")
      .def_static(
          "from_env",
          [](int timeout_ms, const std::string& secret) {
            const weft::LaunchEnv env = launch_env("weft.init_multi_node()", secret);
            weft::Options o;
            o.timeout = std::chrono::milliseconds(timeout_ms);
            py::gil_scoped_release release;  // the rendezvous waits for the other processes
            return std::shared_ptr<MultiNodeTeam>(MultiNodeTeam::create_from_launcher(env, o));
          },
          py::arg("timeout_ms") = 0, py::arg("secret") = std::string())
      .def_property_readonly("rank", &MultiNodeTeam::rank)
      .def_property_readonly("world_size", &MultiNodeTeam::world)
      .def_property_readonly("node", &MultiNodeTeam::node)
      .def_property_readonly("nodes", &MultiNodeTeam::nodes)
      .def_property_readonly("node_size", &MultiNodeTeam::node_size)
      .def_property_readonly("device", [](MultiNodeTeam& t) { return t.node_rank().device(); })
      // The node's team (it keeps the whole team alive).
      .def("node_comm",
           [](const std::shared_ptr<MultiNodeTeam>& t) {
             return Comm::of(std::shared_ptr<weft::Communicator>(t, &t->node_team()))[0];
           })
      .def("check_alive", &MultiNodeTeam::check_alive);
  // How many nodes the launcher's job spans (0: no launcher environment).
  m.def("launch_nodes", [] {
    const auto env = weft::parse_launch_env(weft::process_env(), static_cast<long>(::getppid()));
    return env ? env->nodes : 0;
  });
}

// The collectives, tensor-parallel GEMMs and MoE across nodes (weft/ops/hierarchical.hpp) on a MultiNode.
void bind_hierarchical(py::module_& m) {
  using weft::MultiNodeTeam;
  const auto stream = [](uintptr_t s) { return s ? reinterpret_cast<cudaStream_t>(s) : cudaStreamLegacy; };
  const auto ptr = [](uintptr_t p) { return reinterpret_cast<void*>(p); };
  m.def("hierarchical_all_reduce", [=](MultiNodeTeam& t, uintptr_t in, uintptr_t out, uint64_t count,
                                       const std::string& dtype, const std::string& op, uintptr_t s) {
    py::gil_scoped_release release;  // NCCL's enqueue may wait for the GPU to drain its queue
    weft::hierarchical_all_reduce(t, ptr(in), ptr(out), count, parse_dtype(dtype), parse_op(op), stream(s));
  });
  m.def("hierarchical_all_gather", [=](MultiNodeTeam& t, uintptr_t in, uintptr_t out, uint64_t count,
                                       const std::string& dtype, uintptr_t s) {
    py::gil_scoped_release release;  // NCCL's enqueue may wait for the GPU to drain its queue
    weft::hierarchical_all_gather(t, ptr(in), ptr(out), count, parse_dtype(dtype), stream(s));
  });
  m.def("hierarchical_reduce_scatter", [=](MultiNodeTeam& t, uintptr_t in, uintptr_t out, uint64_t count,
                                           const std::string& dtype, const std::string& op, uintptr_t s) {
    py::gil_scoped_release release;  // NCCL's enqueue may wait for the GPU to drain its queue
    weft::hierarchical_reduce_scatter(t, ptr(in), ptr(out), count, parse_dtype(dtype), parse_op(op),
                                      stream(s));
  });
  m.def("hierarchical_all_to_all", [=](MultiNodeTeam& t, uintptr_t in, uintptr_t out, uint64_t count,
                                       const std::string& dtype, uintptr_t s) {
    py::gil_scoped_release release;  // NCCL's enqueue may wait for the GPU to drain its queue
    weft::hierarchical_all_to_all(t, ptr(in), ptr(out), count, parse_dtype(dtype), stream(s));
  });
  m.def("hierarchical_all_gather_matmul",
        [=](MultiNodeTeam& t, uintptr_t a, uintptr_t b, uintptr_t out, uintptr_t gathered, int64_t rows,
            int64_t n, int64_t k, const std::string& b_layout, uintptr_t s) {
          py::gil_scoped_release release;  // NCCL's enqueue may wait for the GPU to drain its queue
          weft::hierarchical_all_gather_matmul(t, ptr(a), ptr(b), ptr(out), ptr(gathered), rows, n, k,
                                               layout(b_layout), stream(s));
        });
  m.def("hierarchical_matmul_reduce_scatter",
        [=](MultiNodeTeam& t, uintptr_t a, uintptr_t b, uintptr_t out, int64_t rows, int64_t n, int64_t k,
            const std::string& b_layout, uintptr_t s) {
          py::gil_scoped_release release;  // NCCL's enqueue may wait for the GPU to drain its queue
          weft::hierarchical_matmul_reduce_scatter(t, ptr(a), ptr(b), ptr(out), rows, n, k, layout(b_layout),
                                                   stream(s));
        });
  // The MoE across nodes: shape as moe_dispatch's (this rank's tokens; num_experts over the job). The
  // dispatch returns (rows view, group_end view, row_of, experts, capacity, weights, node_out, partials): the
  // in-node dispatch's views and what the combine takes back.
  m.def("hierarchical_moe_workspace_bytes", [](MultiNodeTeam& t, py::tuple shape, const std::string& dtype) {
    return weft::hierarchical_moe_workspace_bytes(t, moe_shape(shape), parse_dtype(dtype));
  });
  m.def("hierarchical_moe_dispatch", [=](MultiNodeTeam& t, const Comm& node, uintptr_t tokens,
                                         uintptr_t experts, uintptr_t weights, py::tuple shape,
                                         uintptr_t workspace, uint64_t workspace_bytes,
                                         const std::string& dtype, uintptr_t s) {
    const weft::MoeShape ms = moe_shape(shape);
    weft::HierarchicalMoeDispatched d;
    {
      py::gil_scoped_release release;  // NCCL's enqueue may wait for the GPU to drain its queue
      d = weft::hierarchical_moe_dispatch(t, ptr(tokens), reinterpret_cast<const int32_t*>(experts),
                                          reinterpret_cast<const float*>(weights), ms, ptr(workspace),
                                          workspace_bytes, parse_dtype(dtype), stream(s));
    }
    const int64_t per = d.node_shape.num_experts / t.node_size();
    const auto address = [](const void* p) { return reinterpret_cast<uintptr_t>(p); };
    return py::make_tuple(view_of(node, const_cast<void*>(d.node.rows), {d.node.capacity, ms.hidden}, dtype),
                          view_of(node, const_cast<int32_t*>(d.node.group_end), {per}, "int32"),
                          address(d.node.row_of), address(d.node.experts), d.node.capacity,
                          address(d.weights), address(d.node_out), address(d.partials));
  });
  m.def("hierarchical_moe_combine",
        [=](MultiNodeTeam& t, uintptr_t expert_out, py::tuple handle, uintptr_t out, py::tuple shape,
            const std::string& dtype, uintptr_t s) {
          const weft::MoeShape ms = moe_shape(shape);
          weft::HierarchicalMoeDispatched d;
          d.node.row_of = reinterpret_cast<const int32_t*>(handle[0].cast<uintptr_t>());
          d.node.experts = reinterpret_cast<const int32_t*>(handle[1].cast<uintptr_t>());
          d.node.capacity = handle[2].cast<int64_t>();
          d.weights = reinterpret_cast<const float*>(handle[3].cast<uintptr_t>());
          d.node_out = ptr(handle[4].cast<uintptr_t>());
          d.partials = ptr(handle[5].cast<uintptr_t>());
          d.node_shape = weft::hierarchical_moe_node_shape(t, ms);
          py::gil_scoped_release release;  // NCCL's enqueue may wait for the GPU to drain its queue
          weft::hierarchical_moe_combine(t, ptr(expert_out), d, ptr(out), ms, parse_dtype(dtype), stream(s));
        });
  m.def("hierarchical_broadcast", [=](MultiNodeTeam& t, uintptr_t in, uintptr_t out, uint64_t count,
                                      const std::string& dtype, int root, uintptr_t s) {
    py::gil_scoped_release release;  // NCCL's enqueue may wait for the GPU to drain its queue
    weft::hierarchical_broadcast(t, ptr(in), ptr(out), count, parse_dtype(dtype), root, stream(s));
  });
}

PYBIND11_MODULE(_weft, m) {
  m.doc() = "weft: overlapped multi-GPU kernels (C++ extension; use the weft package)";
  py::register_exception<weft::Error>(m, "WeftError", PyExc_RuntimeError);
  m.attr("__version__") = WEFT_VERSION;
  bind_comm(m);
  bind_runtime(m);
  bind_collectives(m);
  bind_one_gpu_ops(m);
  bind_fp8(m);
  bind_fp8_gemm(m);
  bind_sequence_parallel(m);
  bind_decode(m);
  bind_moe(m);
  bind_tensor_parallel(m);
  bind_multi_node(m);
  bind_hierarchical(m);
}
