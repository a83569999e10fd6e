// weft-bench infrastructure: modes, result tables (readable and JSON), timing helpers.
#pragma once
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <memory>
#include <optional>
#include <vector>

#include "weft/runtime/communicator.hpp"

namespace weft::bench {

// Copies of a call's operands (`bytes` a copy) that together exceed three times the L2 cache of `device`, at
// least `fewest`, at most `most`: call k reads copy k % n, so no call finds its operands in L2 from the call
// before (a model's layers each read their own weights and caches).
inline int rotating_sets(uint64_t bytes, int device, int fewest = 1, int most = 8) {
  int l2 = 0;
  WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
  return int(
      std::clamp<uint64_t>((3ull * uint64_t(l2) + bytes - 1) / std::max<uint64_t>(bytes, 1), fewest, most));
}

class Table {
 public:
  Table(std::string title, std::vector<std::string> columns, std::string note = {})
      : title_(std::move(title)), note_(std::move(note)), columns_(std::move(columns)) {}
  void add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  void print(std::FILE* out) const;
  std::string json() const;
  const std::string& title() const { return title_; }
  void prefix_note(const std::string& s) { note_ = note_.empty() ? s : s + " " + note_; }

 private:
  std::string title_, note_;
  std::vector<std::string> columns_;
  std::vector<std::vector<std::string>> rows_;
};

struct Context {
  bool json = false;
  bool quick = false;
  int gpus = 0;                  // 0: all visible
  int ranks = 0;                 // --ranks W: a team of W virtual ranks over the GPUs (0: one rank per GPU)
  std::optional<LaunchEnv> env;  // set when started one rank per process (weft-launch / torchrun / mpirun)
  bool quiet = false;            // ranks other than 0 of a multi-process run print nothing
  // Developer flags for tuning and focused runs (empty / 0: the defaults).
  std::string ar_algo;  // --ar-algo oneshot|twoshot: forces weft's all-reduce algorithm
  std::string flow;     // --flow pull|steps|push: forces the reduce flow (CollectiveOptions)
  uint64_t min_bytes = 0, max_bytes = 0;  // --min-bytes / --max-bytes: collective sizes kept
  std::vector<int64_t> fused_m;           // --fused-m 4096,8192: the fused modes' M values
  std::vector<int64_t> gemm_shapes;       // --gemm-shapes MxNxK,...: gemm's shapes (3 per shape) instead
  std::string fused_ops;                  // --fused-ops ag,rs,ar: the fused ops run
  bool fused_progressive = false;         // --fused-progressive: also time the staged-progressive partials
  bool decode_grid = false;               // --decode-grid: flash_decode's one-GPU kernel over a grid
  bool fused_epilogue_sum = false;        // --fused-epilogue-sum: also time the epilogue-summed partials
  std::string cp_methods;                 // --cp-methods all-gather,ring,ulysses: context_attention's methods
  std::vector<int64_t> cp_seqs;           // --cp-seqs 4096,32768: context_attention's sequence lengths
  int cp_heads = 0, cp_kv_heads = 0;      // --cp-heads 32,8: context_attention's query / K-V heads
  int pipeline_pieces = 0;                // --pipeline-pieces n: FusedOptions::pipeline_pieces
  int ag_tile_n = 0;                      // --ag-tile-n 128|256: FusedOptions::tile_n (0: auto)
  int rs_store_ring = 0;                  // --rs-store-ring 2|5: FusedOptions::store_ring (0: auto)
  int ag_comm_blocks = 0;                 // --ag-comm-blocks n: FusedOptions::comm_blocks (0: helper warps)
  std::string timeline_dir;               // --timeline DIR: modes that can record one call's timeline there
  std::vector<Table> tables;
  // Prints to stderr so --json output stays clean.
  void progress(const char* fmt, ...) const;
  // Adds a table (virtual ranks: its note says that it is not a performance figure).
  void add(Table t);
  bool virtual_ranks() const { return ranks > gpus; }
  int team_size() const { return virtual_ranks() ? ranks : gpus; }
  // "4 GPUs (single-process)", "4 GPUs (one process per GPU)", "4 virtual ranks on 1 GPU (single-process)".
  std::string team_label() const;
};

struct Mode {
  const char* name;
  const char* help;
  void (*run)(Context&);
  int min_gpus;        // fewer GPUs (ranks, with virtual ranks) in use: weft-bench skips the mode, saying so
  bool virtual_ranks;  // runs on a team of virtual ranks (--ranks); else it needs one GPU per rank
  // In the default run (no modes named). A mode whose kernels have not yet run on a GPU is named only: the
  // main job must keep working on a fresh machine.
  bool by_default = true;
};
std::vector<Mode>& modes();
struct ModeRegistrar {
  ModeRegistrar(const char* name, const char* help, void (*run)(Context&), int min_gpus = 2,
                bool virtual_ranks = false, bool by_default = true) {
    modes().push_back({name, help, run, min_gpus, virtual_ranks, by_default});
  }
};

// A cuBLAS or cuBLASLt call (cublasStatus_t; CUBLAS_STATUS_SUCCESS is 0) that throws with the call and
// status.
#define WEFT_BLAS_CHECK(expr)                                                             \
  do {                                                                                    \
    const int weft_blas_st_ = static_cast<int>(expr);                                     \
    if (weft_blas_st_ != 0)                                                               \
      throw_error(fmt("weft-bench: %s failed (cuBLAS status %d)", #expr, weft_blas_st_)); \
  } while (0)

#define WEFT_NCCL_CHECK(expr)                                                                             \
  do {                                                                                                    \
    ncclResult_t weft_nccl_r_ = (expr);                                                                   \
    if (weft_nccl_r_ != ncclSuccess)                                                                      \
      ::weft::throw_error(std::string("NCCL error: ") + ncclGetErrorString(weft_nccl_r_) + " in " #expr); \
  } while (0)

// What a benchmark against NCCL runs on: the weft team (single-process over the first ctx.gpus GPUs, or
// this process's rank under a launcher), an NCCL communicator and a stream per local rank. Virtual ranks
// (ctx.ranks): no NCCL (it takes one rank per GPU); `nccl` is empty.
struct BenchTeam {
  std::unique_ptr<Communicator> comm;
  std::vector<ncclComm_t> nccl;
  std::vector<cudaStream_t> streams;
  explicit BenchTeam(const Context& ctx);
  ~BenchTeam();
  int world() const { return comm->world(); }
  int local() const { return comm->num_local(); }
  bool has_nccl() const { return !nccl.empty(); }
  // The slowest rank's value: across processes when there are several.
  double team_max(double x);
};

std::string fmt(const char* f, ...);
// cudaMalloc'd memory on the current GPU for the life of the object (at least 256 bytes).
struct DeviceBuffer {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t n) : bytes(n) { WEFT_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 256))); }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};
// Per-GPU egress (GB/s) of all-to-all 16-byte-store puts, `bytes_per_peer` to every peer at once: the
// link bandwidth the collectives are measured against (weft-bench transfer).
double measure_all_to_all_egress(Communicator& comm, uint64_t bytes_per_peer);
std::string human_bytes(uint64_t b);
// n bf16 values uniform in [-1, 1) from `seed` (bench/random.cu), queued on `stream`.
void fill_uniform_bf16(void* p, uint64_t n, uint64_t seed, cudaStream_t stream);
// ||x - y|| / ||y|| over n bf16 values on the device (bench/random.cu); -1 when y is all zeros. Synchronises
// `stream`.
double rel_err_bf16(const void* x, const void* y, uint64_t n, cudaStream_t stream);
float median(std::vector<float> v);
// One graph per local stream of what `enqueue` puts on the streams, captured together.
std::vector<cudaGraphExec_t> capture_graphs(Communicator& comm, const std::vector<cudaStream_t>& streams,
                                            const std::function<void()>& enqueue);
// Records what one call does on every local rank (weft/timeline.hpp): `enqueue` puts one call on every
// local stream; it is captured with the ranks' timelines on into a graph per rank (as the timed runs are),
// replayed twice, and the second replay's phases are written to `path` (CSV: one span per line; under a
// launcher `path` gets this rank's number before its extension) and summarized in the table returned (per
// rank and phase: spans, lanes, first start, last end, mean and max span, busy time per lane).
Table record_timeline(Communicator& comm, const std::vector<cudaStream_t>& streams,
                      const std::function<void()>& enqueue, const std::string& label, std::string path);
// The same for one GPU's single-GPU op: `call` puts one call on `stream` with the buffer to record into
// (e.g. AttentionOptions::timeline); run twice, the second run's phases kept.
Table record_timeline_one_gpu(const std::function<void(TimelineBuffer*)>& call, cudaStream_t stream,
                              const std::string& label, const std::string& path);
// The CSV (at `path`) and the summary table of recorded timelines, one record per rank.
Table timeline_table(const std::vector<TimelineRecord>& records, const std::string& label,
                     const std::string& path);
// One GPU, one stream: the median of `iters` calls of `call`, each timed alone with its own pair of events,
// after 3 warm-up calls (ms).
float median_call_ms(const std::function<void()>& call, int iters, cudaStream_t stream);
// One GPU, one stream: each candidate's median time per call (ms), after 3 warm-up rounds, over `iters`
// rounds of one call of each in turn (candidate(i) runs round i: it rotates its inputs by i), each call
// timed with its own events, so clock and thermal drift hit all alike.
std::vector<float> time_in_turns(const std::vector<std::function<void(int)>>& candidates, int iters,
                                 cudaStream_t stream);
// Captures `iters` calls per local GPU (enqueue(k) enqueues call k on every local GPU) into one CUDA graph
// per GPU, replays it `reps` times after a warm-up, returns the slowest local rank's median time per call in
// us.
double time_graphs(Communicator& comm, const std::vector<cudaStream_t>& streams, int iters, int reps,
                   const std::function<void(int)>& enqueue);
// The same for several candidates, their graphs replayed in turn (rep 1 of each, rep 2 of each, ...) so
// that drift of the machine during the run does not bias their ratios; one time per candidate.
std::vector<double> time_graphs_alternating(Communicator& comm, const std::vector<cudaStream_t>& streams,
                                            int iters, int reps,
                                            const std::vector<std::function<void(int)>>& candidates);
// One call per candidate in `phases` phases (candidates[c](p) enqueues phase p on the local streams), with
// event nodes between the phases in each graph, replayed in turn as above. Returns per candidate the
// slowest local rank's median time of each phase, then of the whole call, in us (a phase's time on a rank
// includes its waits for peers at meetings). Each graph starts with a team barrier before its first event:
// one thread launches the ranks' graphs one after another, and without it the first rank's first phase
// would carry the launches of the others (a single call is too short to hide them).
std::vector<std::vector<double>> time_phases_alternating(
    Communicator& comm, const std::vector<cudaStream_t>& streams, int phases, int reps,
    const std::vector<std::function<void(int)>>& candidates);

}  // namespace weft::bench
