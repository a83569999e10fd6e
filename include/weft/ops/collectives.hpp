// Collectives: all-reduce, all-gather, reduce-scatter, all-to-all (equal and variable splits), broadcast,
// scatter, gather, reduce, written as short compositions of the device primitives (weft/comm/*.cuh). Unicast
// NVLink only.
//
// Every rank of the team calls the same collective with the same arguments (in single-process mode: once
// per local rank, each call enqueueing on that rank's stream; the kernels meet on the devices). Work is
// enqueued on `stream` (default: the rank's own stream) with no host synchronization, so the calls can be
// captured in CUDA graphs once the communicator's workspace is large enough (reserve_workspace, or one
// call of the same size before capture).
//
// Buffers are device pointers on the rank's GPU. Inputs and outputs anywhere in device memory work: the
// kernels push from the local input into peers' symmetric memory (the output when it is symmetric,
// otherwise the communicator's workspace). In-place (in == out) is allowed everywhere.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "weft/dtype.hpp"
#include "weft/ops/plan.hpp"
#include "weft/runtime/communicator.hpp"

namespace weft {

enum class ReduceOp { kSum, kMax, kMin };
const char* reduce_op_name(ReduceOp op);

// A row-major 2-D tensor shape. A flat tensor of n elements is {n, 1}.
struct Shape2D {
  size_t rows = 0, cols = 1;
  size_t count() const { return rows * cols; }
};

// Which algorithm an all-reduce uses; kAuto picks by size and world size.
enum class AllReduceAlgo { kAuto, kOneShot, kTwoShot };
// How the two-shot all-reduce's reduce half and the reduce-scatter move their data; kAuto picks by size:
//   kPull   every rank reads its slice from all peers at once
//   kSteps  the same one peer at a time, in a permutation of the GPUs
//   kPush   ranks push slices into the owners' staging, pipelined in groups (16-byte aligned data only;
//           other layouts pull)
// A forced flow also keeps the reduce-scatter from its one-shot for small slices.
enum class ReduceFlow { kAuto, kPull, kSteps, kPush };

// Choices for tuning and tests; the defaults are the measured ones.
struct CollectiveOptions {
  AllReduceAlgo algo = AllReduceAlgo::kAuto;  // all_reduce only (a forced flow makes kAuto two-shot)
  ReduceFlow flow = ReduceFlow::kAuto;
};

// out[i] = op over ranks of in_r[i], for `count` elements.
void all_reduce(Communicator& comm, Rank& rank, const void* in, void* out, size_t count, DType dtype,
                ReduceOp op = ReduceOp::kSum, cudaStream_t stream = nullptr,
                const CollectiveOptions& options = {});
inline void all_reduce(Communicator& comm, Rank& rank, const void* in, void* out, size_t count, DType dtype,
                       ReduceOp op, cudaStream_t stream, AllReduceAlgo algo) {
  all_reduce(comm, rank, in, out, count, dtype, op, stream, CollectiveOptions{algo, ReduceFlow::kAuto});
}

// in: this rank's [rows, cols]. dim 0: out [W*rows, cols], rank r's rows at r*rows.
//                                dim 1: out [rows, W*cols], rank r's columns at r*cols.
void all_gather(Communicator& comm, Rank& rank, const void* in, void* out, Shape2D in_shape, int dim,
                DType dtype, cudaStream_t stream = nullptr);

// out: this rank's [rows, cols] of the reduced tensor. dim 0: in [W*rows, cols], rank r gets rows r*rows..;
//                                                       dim 1: in [rows, W*cols], rank r gets columns
//                                                       r*cols..
void reduce_scatter(Communicator& comm, Rank& rank, const void* in, void* out, Shape2D out_shape, int dim,
                    DType dtype, ReduceOp op = ReduceOp::kSum, cudaStream_t stream = nullptr,
                    const CollectiveOptions& options = {});

// Equal splits: in and out hold W blocks of `count_per_rank` elements; out block q on rank p is in block p
// of rank q.
void all_to_all(Communicator& comm, Rank& rank, const void* in, void* out, size_t count_per_rank, DType dtype,
                cudaStream_t stream = nullptr);

// Variable splits (torch's all_to_all_single with split sizes; MoE token routing), sizes on the device: no
// host synchronization, capturable in CUDA graphs. Sizes count rows of row_elems elements (1: elements; an
// MoE layer's tokens: hidden). in holds this rank's parts for ranks 0..W-1 back to back, part q of
// send_counts[q] rows (send_counts: device int64 [W]; in holds in_capacity rows). out receives the parts from
// ranks 0..W-1 back to back in rank order (out_capacity rows, the same on every rank), and recv_counts
// (device int64 [W]) their sizes. out symmetric (the same buffer on every rank) is pushed into directly;
// else through the workspace (out symmetric on every rank or on none). Counts that do not fit (a negative
// count, a row past its sender's in, a receiver's total past out_capacity) and unequal out capacities or
// out symmetry are refused on every rank before anything moves (recv_counts zero): the next synchronize()
// throws naming the offender, and the team's device waits fail from then on. Not in place.
void all_to_all_v(Communicator& comm, Rank& rank, const void* in, const int64_t* send_counts,
                  size_t in_capacity, void* out, int64_t* recv_counts, size_t out_capacity, size_t row_elems,
                  DType dtype, cudaStream_t stream = nullptr);

// Rooted collectives. `root` is a rank of the team; arguments only the root uses may be null elsewhere.
//   broadcast  out (count elements, every rank) = the root's in; in place at the root when in == out.
//   scatter    out (count elements) of rank p = part p of the root's in (world x count elements).
//   gather     part q of the root's out (world x count elements) = rank q's in (count elements).
//   reduce     the root's out = op over ranks of in (count elements each).
// broadcast pushes into every rank's out directly when out is symmetric (the same buffer on every rank; out
// symmetric on every rank or on none: then through the workspace); scatter and gather land in the
// workspace, then in out. reduce from 1 MiB in whole 16-byte units at 2..8 ranks: each non-root sums one
// part from every rank and pushes it to the root (each rank sends and receives about count elements); below,
// or past 8 ranks: the all-reduce into a workspace area of its own, then a copy to the root's out. in and out
// at the root are equal (in place) or apart. 16-byte aligned buffers move in 16-byte accesses, others in
// 2-byte ones.
void broadcast(Communicator& comm, Rank& rank, const void* in, void* out, size_t count, DType dtype, int root,
               cudaStream_t stream = nullptr);
void scatter(Communicator& comm, Rank& rank, const void* in, void* out, size_t count, DType dtype, int root,
             cudaStream_t stream = nullptr);
void gather(Communicator& comm, Rank& rank, const void* in, void* out, size_t count, DType dtype, int root,
            cudaStream_t stream = nullptr);
void reduce(Communicator& comm, Rank& rank, const void* in, void* out, size_t count, DType dtype, ReduceOp op,
            int root, cudaStream_t stream = nullptr);

// What each collective call with these arguments would do (weft/ops/plan.hpp): its algorithm, grid and
// workspace; it throws what the call would throw.
Plan all_reduce_plan(Communicator& comm, Rank& rank, const void* in, void* out, size_t count, DType dtype,
                     ReduceOp op = ReduceOp::kSum, cudaStream_t stream = nullptr,
                     const CollectiveOptions& options = {});
Plan all_gather_plan(Communicator& comm, Rank& rank, const void* in, void* out, Shape2D in_shape, int dim,
                     DType dtype, cudaStream_t stream = nullptr);
Plan reduce_scatter_plan(Communicator& comm, Rank& rank, const void* in, void* out, Shape2D out_shape,
                         int dim, DType dtype, ReduceOp op = ReduceOp::kSum, cudaStream_t stream = nullptr,
                         const CollectiveOptions& options = {});
Plan all_to_all_plan(Communicator& comm, Rank& rank, const void* in, void* out, size_t count_per_rank,
                     DType dtype, cudaStream_t stream = nullptr);
Plan all_to_all_v_plan(Communicator& comm, Rank& rank, const void* in, const int64_t* send_counts,
                       size_t in_capacity, void* out, int64_t* recv_counts, size_t out_capacity,
                       size_t row_elems, DType dtype, cudaStream_t stream = nullptr);
Plan broadcast_plan(Communicator& comm, Rank& rank, const void* in, void* out, size_t count, DType dtype,
                    int root, cudaStream_t stream = nullptr);
Plan scatter_plan(Communicator& comm, Rank& rank, const void* in, void* out, size_t count, DType dtype,
                  int root, cudaStream_t stream = nullptr);
Plan gather_plan(Communicator& comm, Rank& rank, const void* in, void* out, size_t count, DType dtype,
                 int root, cudaStream_t stream = nullptr);
Plan reduce_plan(Communicator& comm, Rank& rank, const void* in, void* out, size_t count, DType dtype,
                 ReduceOp op, int root, cudaStream_t stream = nullptr);

}  // namespace weft
