// Host side of weft::ulysses_attention_forward / _backward (weft/ops/context_attention.hpp): rows of the
// ring layout to head groups over the whole sequence (split by head group, all-to-all, rows into natural
// order), one packed attention call per rank over whole documents, and the way back.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <string>
#include <vector>

#include "op_args.hpp"
#include "sequence_parallel.hpp"
#include "weft/ops/collectives.hpp"
#include "weft/ops/context_attention.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/kernel_preload.hpp"

namespace weft {
namespace {

using ops::round256;

// Rank j's heads of a tensor with `groups` heads: [j * groups / W, that + width) (the kernels compute the
// first). With fewer heads than ranks (K / V of GQA), W / groups consecutive ranks share one.
struct HeadSplit {
  int64_t groups = 0, width = 0;
  HeadSplit(int64_t g, int w) : groups(g), width(std::max<int64_t>(1, g / w)) {}
};

// send[j][x] = this rank's row x, heads of rank j (rows x < n; the padding rows up to max_local are not
// written), in 16-byte vectors; `head_vecs` vectors per head.
__global__ void split_heads(const uint4* src, uint4* send, int64_t n, int64_t max_local, int world,
                            int64_t groups, int64_t width, int head_vecs) {
  const int64_t row_vecs = width * head_vecs, per_rank = n * row_vecs, total = per_rank * world;
  for (int64_t x = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; x < total;
       x += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = x / per_rank, rest = x - j * per_rank, row = rest / row_vecs, c = rest - row * row_vecs;
    send[(j * max_local + row) * row_vecs + c] = src[(row * groups + j * groups / world) * head_vecs + c];
  }
}

// dst row x, head g = the sum over source ranks s holding head g of recv[s][x][g - first(s)] (one source
// unless K / V heads were shared), in fp32, rounded once to Out.
template <class In, class Out>
__global__ void merge_heads(const In* recv, Out* dst, int64_t n, int64_t max_local, int world, int64_t groups,
                            int64_t width, int head_dim) {
  const int64_t row = groups * head_dim, total = n * row;
  for (int64_t x = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; x < total;
       x += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = x / row, e = x - r * row, g = e / head_dim, d = e - g * head_dim;
    float sum = 0.f;
    for (int s = 0; s < world; ++s) {
      const int64_t first = s * groups / world;
      if (g >= first && g < first + width)
        sum += static_cast<float>(recv[((s * max_local + r) * width + (g - first)) * head_dim + d]);
    }
    dst[x] = static_cast<Out>(sum);
  }
}

int grid_for(int64_t n) {
  return static_cast<int>(std::clamp<int64_t>((n + 255) / 256, 1, 1056));
}

// The sizes and the carving of one rank's workspace.
struct Sizes {
  ops::RingLayout L;
  int world = 0;
  int64_t max_local = 0, total = 0, docs = 0, heads = 0, kv_heads = 0, head_dim = 0;
  HeadSplit q_split, kv_split;
  Sizes(int w, const std::vector<int64_t>& doc_lengths, bool causal, int64_t h, int64_t kv, int64_t d)
      : L(ops::ring_layout(doc_lengths, w, causal)),
        world(w),
        heads(h),
        kv_heads(kv),
        head_dim(d),
        q_split(h, w),
        kv_split(kv, w) {
    max_local = ops::max_local_rows(L);
    for (int64_t n : doc_lengths) total += n;
    docs = static_cast<int64_t>(doc_lengths.size());
  }
  // Bytes of one natural-order row of this rank's query heads / K-V heads (16-bit), and of a transfer
  // buffer [W][max_local] of the widest row (`elem` bytes per value).
  size_t q_row() const { return size_t(q_split.width * head_dim) * 2; }
  size_t kv_row() const { return size_t(kv_split.width * head_dim) * 2; }
  size_t transfer(size_t elem) const {
    return round256(size_t(world * max_local) * std::max(q_split.width, kv_split.width) * head_dim * elem);
  }
  size_t lse_ranked() const { return round256(size_t(world * max_local * q_split.width) * 4); }
  size_t lse_natural() const { return round256(size_t(total * q_split.width) * 4); }
  size_t index() const { return round256(size_t(total) * 4); }
  size_t offsets() const { return round256(size_t(docs + 1) * 4); }
  size_t nat_q() const { return round256(total * q_row()); }
  size_t nat_kv() const { return round256(total * kv_row()); }
  AttentionShape shape() const {
    int64_t longest = 1;
    for (int64_t n : L.doc_length) longest = std::max(longest, n);
    return {docs, longest, longest, q_split.width, kv_split.width, head_dim};
  }
  AttentionSegments segments(const int32_t* cu) const {
    return varlen_segments(cu, cu, std::max<int64_t>(total, 1), std::max<int64_t>(total, 1));
  }
  // Forward: index, offsets, two transfer buffers, natural q / k / v / out, natural LSE, two LSE transfers.
  size_t forward_bytes() const {
    return index() + offsets() + 2 * transfer(2) + 2 * nat_q() + 2 * nat_kv() + lse_natural() +
           2 * lse_ranked();
  }
  // Backward: the same plus natural dout and dq, fp32 dK / dV, fp32-wide transfers and the attention
  // backward's workspace.
  size_t attention_backward(const AttentionOptions& o) const {
    AttentionOptions a = o;
    static const int32_t kAny[2] = {};  // the size does not read the ranges
    a.segments = segments(kAny);
    return round256(flash_attention_backward_workspace_bytes(shape(), a));
  }
  size_t backward_bytes(bool causal) const {
    AttentionOptions o;
    o.causal = causal;
    return index() + offsets() + 2 * transfer(4) + 4 * nat_q() + 2 * nat_kv() + lse_natural() +
           2 * lse_ranked() + 2 * round256(total * kv_row() * 2) + attention_backward(o);
  }
};

void check(const Sizes& z, Rank& rank, const AttentionOptions& options, void* workspace,
           size_t workspace_bytes, size_t need, DType dtype, const std::string& where) {
  WEFT_CHECK(z.world == rank.world(), where + "the layout's world size differs from the team's");
  WEFT_CHECK(z.heads > 0 && z.heads % z.world == 0, where + "heads (" + std::to_string(z.heads) +
                                                        ") must be a multiple of the world size (" +
                                                        std::to_string(z.world) + ")");
  WEFT_CHECK(z.kv_heads > 0 && z.heads % z.kv_heads == 0, where + "heads must be a multiple of kv_heads");
  WEFT_CHECK(z.kv_heads % z.world == 0 || z.world % z.kv_heads == 0,
             where + "kv_heads (" + std::to_string(z.kv_heads) + ") and the world size (" +
                 std::to_string(z.world) + ") must divide one another");
  WEFT_CHECK(z.head_dim == 64 || z.head_dim == 128, where + "head_dim must be 64 or 128");
  WEFT_CHECK(dtype == DType::kBF16 || dtype == DType::kFP16, where + "tensors must be bf16 or fp16");
  WEFT_CHECK(
      !options.segments.packed() && !options.accumulate.enabled() && !options.accumulate_grads.enabled(),
      where + "options.segments / accumulate / accumulate_grads are set by the op itself; leave them empty");
  WEFT_CHECK(workspace != nullptr && workspace_bytes >= need,
             where + "the workspace must hold " + std::to_string(need) +
                 " bytes (the op's workspace_bytes()), got " + std::to_string(workspace_bytes));
  ops::check_pointer_alignment(workspace, "workspace", 256, where);
}

// The shared start of both passes: the index and the document offsets.
void write_layout(const Sizes& z, int32_t* index, int32_t* offsets, cudaStream_t stream) {
  ops::write_rank_order_index(z.L, z.max_local, index, stream);
  std::vector<int32_t> cu(1, 0);
  for (int64_t n : z.L.doc_length) cu.push_back(static_cast<int32_t>(cu.back() + n));
  ops::upload_words(offsets, cu, stream);
}

// This rank's rows of `src` ([n][split.groups][head_dim], 16-bit) to every rank's head share over the whole
// sequence, natural order: `natural` [total][split.width][head_dim].
void to_head_groups(Communicator& comm, Rank& rank, const Sizes& z, const HeadSplit& split, const void* src,
                    void* natural, void* send, void* recv, const int32_t* index, DType dtype,
                    cudaStream_t stream) {
  const int64_t n = z.L.local_rows(rank.rank());
  const int head_vecs = static_cast<int>(z.head_dim * 2 / 16);
  detail::preload<&split_heads>();
  if (n > 0) {
    split_heads<<<grid_for(n * z.world * split.width * head_vecs), 256, 0, stream>>>(
        static_cast<const uint4*>(src), static_cast<uint4*>(send), n, z.max_local, z.world, split.groups,
        split.width, head_vecs);
    WEFT_CUDA_CHECK(cudaGetLastError());
  }
  all_to_all(comm, rank, send, recv, size_t(z.max_local * split.width * z.head_dim), dtype, stream);
  ops::rows_to_natural(recv, natural, index, z.total, size_t(split.width * z.head_dim) * 2, stream);
}

// The way back: `natural` ([total][split.width][head_dim], `elem` bytes per value: 16-bit or fp32) to this
// rank's rows `dst` ([n][split.groups][head_dim], 16-bit), summing shared heads in fp32.
void from_head_groups(Communicator& comm, Rank& rank, const Sizes& z, const HeadSplit& split,
                      const void* natural, size_t elem, void* dst, void* send, void* recv,
                      const int32_t* index, DType dtype, cudaStream_t stream) {
  const int64_t n = z.L.local_rows(rank.rank());
  ops::rows_to_ranked(natural, send, index, z.total, size_t(split.width * z.head_dim) * elem, stream);
  all_to_all(comm, rank, send, recv, size_t(z.max_local * split.width * z.head_dim),
             elem == 4 ? DType::kFP32 : dtype, stream);
  if (n == 0) return;
  const int64_t count = n * split.groups * z.head_dim;
  const int D = static_cast<int>(z.head_dim);
  auto launch = [&](auto* in, auto* out) {
    constexpr auto kernel = &merge_heads<std::remove_cv_t<std::remove_pointer_t<decltype(in)>>,
                                         std::remove_pointer_t<decltype(out)>>;
    detail::preload<kernel>();
    kernel<<<grid_for(count), 256, 0, stream>>>(in, out, n, z.max_local, z.world, split.groups, split.width,
                                                D);
  };
  const bool half = dtype == DType::kFP16;
  if (elem == 4 && half) launch(static_cast<const float*>(recv), static_cast<__half*>(dst));
  if (elem == 4 && !half) launch(static_cast<const float*>(recv), static_cast<__nv_bfloat16*>(dst));
  if (elem == 2 && half) launch(static_cast<const __half*>(recv), static_cast<__half*>(dst));
  if (elem == 2 && !half) launch(static_cast<const __nv_bfloat16*>(recv), static_cast<__nv_bfloat16*>(dst));
  WEFT_CUDA_CHECK(cudaGetLastError());
}

// The collectives' workspace, before any of them is enqueued (the planned calls read only the pointers'
// kind: the workspace's).
void reserve(Communicator& comm, Rank& rank, const Sizes& z, void* workspace, DType dtype, bool backward,
             cudaStream_t stream) {
  char* a = static_cast<char*>(workspace);
  char* b = a + z.transfer(4);  // past the largest transfer
  std::vector<Plan> plans = {
      all_to_all_plan(comm, rank, a, b,
                      size_t(z.max_local * std::max(z.q_split.width, z.kv_split.width) * z.head_dim), dtype,
                      stream),
      all_to_all_plan(comm, rank, a, b, size_t(z.q_split.width * z.max_local), DType::kFP32, stream)};
  if (backward)
    plans.push_back(all_to_all_plan(comm, rank, a, b, size_t(z.max_local * z.kv_split.width * z.head_dim),
                                    DType::kFP32, stream));
  ops::reserve_collective_workspace(comm, plans, stream);
}

// A bump allocator over the workspace.
struct Carve {
  char* p;
  template <class T = char>
  T* take(size_t bytes) {
    T* r = reinterpret_cast<T*>(p);
    p += bytes;
    return r;
  }
};

std::string where_of(const char* op, const Rank& rank) {
  return std::string(op) + "(rank " + std::to_string(rank.rank()) + " of " + std::to_string(rank.world()) +
         "): ";
}

}  // namespace

size_t ulysses_attention_workspace_bytes(int world, const std::vector<int64_t>& doc_lengths, bool causal,
                                         int64_t heads, int64_t kv_heads, int64_t head_dim) {
  return Sizes(world, doc_lengths, causal, heads, kv_heads, head_dim).forward_bytes();
}

size_t ulysses_attention_backward_workspace_bytes(int world, const std::vector<int64_t>& doc_lengths,
                                                  bool causal, int64_t heads, int64_t kv_heads,
                                                  int64_t head_dim) {
  return Sizes(world, doc_lengths, causal, heads, kv_heads, head_dim).backward_bytes(causal);
}

void ulysses_attention_forward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v,
                               void* out, float* lse, const std::vector<int64_t>& doc_lengths, int64_t heads,
                               int64_t kv_heads, int64_t head_dim, void* workspace, size_t workspace_bytes,
                               DType dtype, cudaStream_t stream, const AttentionOptions& options) {
  const std::string where = where_of("weft::ulysses_attention_forward", rank);
  const Sizes z(rank.world(), doc_lengths, options.causal, heads, kv_heads, head_dim);
  check(z, rank, options, workspace, workspace_bytes, z.forward_bytes(), dtype, where);
  if (z.total == 0) return;
  if (stream == nullptr) stream = rank.stream();
  Carve ws{static_cast<char*>(workspace)};
  auto* index = ws.take<int32_t>(z.index());
  auto* offsets = ws.take<int32_t>(z.offsets());
  void* send = ws.take(z.transfer(2));
  void* recv = ws.take(z.transfer(2));
  void *nat_q = ws.take(z.nat_q()), *nat_out = ws.take(z.nat_q());
  void *nat_k = ws.take(z.nat_kv()), *nat_v = ws.take(z.nat_kv());
  auto* lse_nat = ws.take<float>(z.lse_natural());
  auto* lse_send = ws.take<float>(z.lse_ranked());
  auto* lse_recv = ws.take<float>(z.lse_ranked());

  reserve(comm, rank, z, workspace, dtype, false, stream);
  write_layout(z, index, offsets, stream);
  to_head_groups(comm, rank, z, z.q_split, q, nat_q, send, recv, index, dtype, stream);
  to_head_groups(comm, rank, z, z.kv_split, k, nat_k, send, recv, index, dtype, stream);
  to_head_groups(comm, rank, z, z.kv_split, v, nat_v, send, recv, index, dtype, stream);
  AttentionOptions o = options;
  o.segments = z.segments(offsets);
  flash_attention_forward(nat_q, nat_k, nat_v, nat_out, lse_nat, z.shape(), dtype, stream, o);
  from_head_groups(comm, rank, z, z.q_split, nat_out, 2, out, send, recv, index, dtype, stream);
  if (lse == nullptr) return;
  // LSE [heads / W][total] -> per owner [W][heads / W][max_local] -> back: [W sources][heads / W][max_local]
  // is [heads][max_local], this rank's rows of every head.
  ops::lse_to_ranked(lse_nat, lse_send, index, z.q_split.width, z.total, z.max_local, stream);
  all_to_all(comm, rank, lse_send, lse_recv, size_t(z.q_split.width * z.max_local), DType::kFP32, stream);
  const int64_t n = z.L.local_rows(rank.rank());
  if (n > 0)
    WEFT_CUDA_CHECK(cudaMemcpy2DAsync(lse, n * 4, lse_recv, z.max_local * 4, n * 4, heads,
                                      cudaMemcpyDeviceToDevice, stream));
}

void ulysses_attention_backward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v,
                                const void* out, const void* dout, const float* lse, void* dq, void* dk,
                                void* dv, const std::vector<int64_t>& doc_lengths, int64_t heads,
                                int64_t kv_heads, int64_t head_dim, void* workspace, size_t workspace_bytes,
                                DType dtype, cudaStream_t stream, const AttentionOptions& options) {
  const std::string where = where_of("weft::ulysses_attention_backward", rank);
  const Sizes z(rank.world(), doc_lengths, options.causal, heads, kv_heads, head_dim);
  check(z, rank, options, workspace, workspace_bytes, z.backward_bytes(options.causal), dtype, where);
  if (z.total == 0) return;
  if (stream == nullptr) stream = rank.stream();
  Carve ws{static_cast<char*>(workspace)};
  auto* index = ws.take<int32_t>(z.index());
  auto* offsets = ws.take<int32_t>(z.offsets());
  void* send = ws.take(z.transfer(4));
  void* recv = ws.take(z.transfer(4));
  void *nat_q = ws.take(z.nat_q()), *nat_out = ws.take(z.nat_q()), *nat_dout = ws.take(z.nat_q()),
       *nat_dq = ws.take(z.nat_q());
  void *nat_k = ws.take(z.nat_kv()), *nat_v = ws.take(z.nat_kv());
  auto* lse_nat = ws.take<float>(z.lse_natural());
  auto* lse_send = ws.take<float>(z.lse_ranked());
  auto* lse_recv = ws.take<float>(z.lse_ranked());
  const size_t grad32 = round256(z.total * z.kv_row() * 2);
  auto* dk32 = ws.take<float>(grad32);
  auto* dv32 = ws.take<float>(grad32);
  AttentionOptions o = options;
  o.segments = z.segments(offsets);
  const size_t attention_bytes = z.attention_backward(options);
  void* attention_ws = ws.take(attention_bytes);

  reserve(comm, rank, z, workspace, dtype, true, stream);
  write_layout(z, index, offsets, stream);
  to_head_groups(comm, rank, z, z.q_split, q, nat_q, send, recv, index, dtype, stream);
  to_head_groups(comm, rank, z, z.kv_split, k, nat_k, send, recv, index, dtype, stream);
  to_head_groups(comm, rank, z, z.kv_split, v, nat_v, send, recv, index, dtype, stream);
  to_head_groups(comm, rank, z, z.q_split, out, nat_out, send, recv, index, dtype, stream);
  to_head_groups(comm, rank, z, z.q_split, dout, nat_dout, send, recv, index, dtype, stream);
  const int64_t n = z.L.local_rows(rank.rank());
  if (n > 0)
    WEFT_CUDA_CHECK(cudaMemcpy2DAsync(lse_send, z.max_local * 4, lse, n * 4, n * 4, heads,
                                      cudaMemcpyDeviceToDevice, stream));
  all_to_all(comm, rank, lse_send, lse_recv, size_t(z.q_split.width * z.max_local), DType::kFP32, stream);
  ops::lse_to_natural(lse_recv, lse_nat, index, z.q_split.width, z.total, z.max_local, stream);

  WEFT_CUDA_CHECK(cudaMemsetAsync(dk32, 0, 2 * grad32, stream));
  o.accumulate_grads = {dk32, dv32};
  flash_attention_backward(nat_q, nat_k, nat_v, nat_out, nat_dout, lse_nat, nat_dq, nullptr, nullptr,
                           attention_ws, attention_bytes, z.shape(), dtype, stream, o);
  from_head_groups(comm, rank, z, z.q_split, nat_dq, 2, dq, send, recv, index, dtype, stream);
  from_head_groups(comm, rank, z, z.kv_split, dk32, 4, dk, send, recv, index, dtype, stream);
  from_head_groups(comm, rank, z, z.kv_split, dv32, 4, dv, send, recv, index, dtype, stream);
}

}  // namespace weft
