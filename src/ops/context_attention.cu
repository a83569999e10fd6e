// Host side of weft::context_attention_forward (weft/ops/context_attention.hpp): the layout and the call's
// segments from the ring plan, the gather of K / V (all-gather of every rank's rows padded to the longest
// rank, then a row permutation into natural order), and one packed attention call.
#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "attention_args.hpp"
#include "ring_attention_plan.hpp"
#include "weft/ops/collectives.hpp"
#include "weft/ops/context_attention.hpp"
#include "weft/runtime/error.hpp"

namespace weft {
namespace {

// dst row i = src row index[i], `row_bytes` each (a multiple of 16).
__global__ void gather_rows(const uint4* src, uint4* dst, const int32_t* index, int64_t rows, int row_vecs) {
  const int64_t n = rows * row_vecs;
  for (int64_t x = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; x < n;
       x += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = x / row_vecs;
    const int c = static_cast<int>(x - row * row_vecs);
    dst[x] = src[int64_t(__ldg(index + row)) * row_vecs + c];
  }
}

size_t round256(size_t b) {
  return (b + 255) / 256 * 256;
}

// The workspace: K and V padded to the longest rank, both gathered in rank order, both in natural order,
// the permutation, the segments.
struct Workspace {
  int64_t max_local = 0, total = 0, segments = 0;
  size_t row_bytes = 0, pad = 0, ranked = 0, natural = 0, index = 0, seg = 0;
  Workspace(const ops::RingLayout& L, int64_t kv_heads, int64_t head_dim, int64_t nseg) {
    for (int r = 0; r < L.world; ++r) max_local = std::max(max_local, L.local_rows(r));
    for (int64_t d : L.doc_length) total += d;
    segments = nseg;
    row_bytes = size_t(kv_heads * head_dim) * 2;
    pad = round256(max_local * row_bytes);
    ranked = round256(L.world * max_local * row_bytes);
    natural = round256(total * row_bytes);
    index = round256(total * 4);
    seg = round256(4 * std::max<int64_t>(nseg, 1) * 4);
  }
  size_t bytes() const { return 2 * (pad + ranked + natural) + index + seg; }
};

int64_t max_segments(const ops::RingLayout& L) {
  return int64_t(L.doc_length.size()) * (L.zigzag ? 2 : 1);
}

}  // namespace

int64_t context_attention_local_rows(int world, int rank, const std::vector<int64_t>& doc_lengths,
                                     bool causal) {
  return ops::ring_layout(doc_lengths, world, causal).local_rows(rank);
}

size_t context_attention_workspace_bytes(int world, const std::vector<int64_t>& doc_lengths, bool causal,
                                         int64_t kv_heads, int64_t head_dim) {
  const ops::RingLayout L = ops::ring_layout(doc_lengths, world, causal);
  return Workspace(L, kv_heads, head_dim, max_segments(L)).bytes();
}

void context_attention_forward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v,
                               void* out, float* lse, const std::vector<int64_t>& doc_lengths, int64_t heads,
                               int64_t kv_heads, int64_t head_dim, void* workspace, size_t workspace_bytes,
                               DType dtype, cudaStream_t stream, const AttentionOptions& options) {
  const std::string where = "weft::context_attention_forward(rank " + std::to_string(rank.rank()) + " of " +
                            std::to_string(rank.world()) + "): ";
  WEFT_CHECK(!options.segments.packed() && !options.accumulate.enabled(),
             where + "options.segments and options.accumulate are set by the op itself; leave them empty");
  WEFT_CHECK(dtype == DType::kBF16 || dtype == DType::kFP16, where + "tensors must be bf16 or fp16");
  const ops::RingLayout L = ops::ring_layout(doc_lengths, rank.world(), options.causal);
  const int r = rank.rank(), W = rank.world();
  const ops::RingCall call = ops::gathered_call_of(L, r);
  const Workspace ws(L, kv_heads, head_dim, max_segments(L));
  WEFT_CHECK(workspace != nullptr && workspace_bytes >= ws.bytes(),
             where + "the workspace must hold context_attention_workspace_bytes() = " +
                 std::to_string(ws.bytes()) + " bytes, got " + std::to_string(workspace_bytes));
  ops::check_pointer_alignment(workspace, "workspace", 256, where);
  WEFT_CHECK(ws.row_bytes % 16 == 0, where + "kv_heads x head_dim must be a multiple of 8");
  if (stream == nullptr) stream = rank.stream();
  const int64_t local = L.local_rows(r);

  char* p = static_cast<char*>(workspace);
  char *pad_k = p, *pad_v = p + ws.pad;
  p += 2 * ws.pad;
  char *ranked_k = p, *ranked_v = p + ws.ranked;
  p += 2 * ws.ranked;
  char *nat_k = p, *nat_v = p + ws.natural;
  p += 2 * ws.natural;
  auto* index = reinterpret_cast<int32_t*>(p);
  auto* seg = reinterpret_cast<int32_t*>(p + ws.index);

  // The permutation (natural row -> rank-order row) and the segments, from the host (pageable copies are
  // staged before cudaMemcpyAsync returns).
  std::vector<int32_t> perm(ws.total);
  for (int s = 0; s < W; ++s) {
    const std::vector<int64_t> tokens = ops::ring_tokens(L, s);
    for (size_t i = 0; i < tokens.size(); ++i) perm[tokens[i]] = static_cast<int32_t>(s * ws.max_local + i);
  }
  const int64_t nseg = static_cast<int64_t>(call.segments.size());
  std::vector<int32_t> segs(4 * std::max<int64_t>(nseg, 1), 0);
  int64_t max_q = 1, max_k = 1;
  for (int64_t i = 0; i < nseg; ++i) {
    const ops::RingSegment& s = call.segments[i];
    segs[i] = static_cast<int32_t>(s.q_begin);
    segs[nseg + i] = static_cast<int32_t>(s.q_end);
    segs[2 * nseg + i] = static_cast<int32_t>(s.k_begin);
    segs[3 * nseg + i] = static_cast<int32_t>(s.k_end);
    max_q = std::max(max_q, s.q_end - s.q_begin);
    max_k = std::max(max_k, s.k_end - s.k_begin);
  }
  WEFT_CUDA_CHECK(cudaMemcpyAsync(index, perm.data(), perm.size() * 4, cudaMemcpyHostToDevice, stream));
  WEFT_CUDA_CHECK(cudaMemcpyAsync(seg, segs.data(), segs.size() * 4, cudaMemcpyHostToDevice, stream));

  // K and V of every rank, padded to the longest rank's rows, in rank order; then in natural order.
  const Shape2D shape{size_t(ws.max_local), ws.row_bytes / 2};
  for (auto [src, padded, ranked, natural] :
       {std::tuple{k, pad_k, ranked_k, nat_k}, std::tuple{v, pad_v, ranked_v, nat_v}}) {
    if (local > 0)
      WEFT_CUDA_CHECK(cudaMemcpyAsync(padded, src, local * ws.row_bytes, cudaMemcpyDeviceToDevice, stream));
    all_gather(comm, rank, padded, ranked, shape, 0, dtype, stream);
    const int row_vecs = static_cast<int>(ws.row_bytes / 16);
    gather_rows<<<264, 256, 0, stream>>>(reinterpret_cast<const uint4*>(ranked),
                                         reinterpret_cast<uint4*>(natural), index, ws.total, row_vecs);
    WEFT_CUDA_CHECK(cudaGetLastError());
  }
  if (nseg == 0) return;  // no query rows here (short documents)

  AttentionOptions o = options;
  o.segments = {seg, seg + nseg, seg + 2 * nseg, seg + 3 * nseg, std::max<int64_t>(local, 1), ws.total};
  flash_attention_forward(q, nat_k, nat_v, out, lse,
                          AttentionShape{nseg, max_q, max_k, heads, kv_heads, head_dim}, dtype, stream, o);
}

}  // namespace weft
