// Host side of weft::ulysses_attention_forward / _backward (weft/ops/context_attention.hpp): every rank
// pushes each rank's head share of its rows straight into that rank's natural-order buffers (the
// communicator's workspace area "ulysses attention", symmetric), attends its heads over the whole sequence
// in one packed call over whole documents, and pulls its rows of every head back from the ranks that hold
// them.
#include <algorithm>
#include <string>
#include <vector>

#include "op_args.hpp"
#include "sequence_parallel.hpp"
#include "weft/ops/context_attention.hpp"
#include "weft/runtime/error.hpp"

namespace weft {
namespace {

using ops::round256;
const char* const kArea = "ulysses attention";

// The sizes of a call, the symmetric area's carving (natural order, this rank's heads: q, out, dout, dq,
// k, v, LSE, fp32 dK, dV) and the caller's workspace (local -> natural rows, document offsets, the
// attention backward's own).
struct Sizes {
  ops::RingLayout L;
  int world = 0;
  int64_t max_local = 0, total = 0, local = 0, docs = 0, heads = 0, kv_heads = 0, head_dim = 0;
  ops::HeadShare q_share, kv_share;
  Sizes(int w, int rank, const std::vector<int64_t>& doc_lengths, bool causal, int64_t h, int64_t kv,
        int64_t d)
      : L(ops::ring_layout(doc_lengths, w, causal)),
        world(w),
        heads(h),
        kv_heads(kv),
        head_dim(d),
        q_share(ops::HeadShare::split(h, w)),
        kv_share(ops::HeadShare::split(kv, w)) {
    max_local = ops::max_local_rows(L);
    for (int64_t n : doc_lengths) total += n;
    local = L.local_rows(rank);
    docs = static_cast<int64_t>(doc_lengths.size());
  }
  size_t q_bytes() const { return round256(size_t(total * q_share.width * head_dim) * 2); }
  size_t kv_bytes() const { return round256(size_t(total * kv_share.width * head_dim) * 2); }
  size_t lse_bytes() const { return round256(size_t(total * q_share.width) * 4); }
  size_t area_bytes() const { return 4 * q_bytes() + 2 * kv_bytes() + lse_bytes() + 4 * kv_bytes(); }
  struct Area {
    char *q, *out, *dout, *dq, *k, *v;
    float *lse, *dk32, *dv32;
  };
  Area carve(char* a) const {
    Area r{};
    r.q = a, r.out = a + q_bytes(), r.dout = a + 2 * q_bytes(), r.dq = a + 3 * q_bytes();
    r.k = a + 4 * q_bytes(), r.v = r.k + kv_bytes();
    r.lse = reinterpret_cast<float*>(r.v + kv_bytes());
    r.dk32 = reinterpret_cast<float*>(reinterpret_cast<char*>(r.lse) + lse_bytes());
    r.dv32 = reinterpret_cast<float*>(reinterpret_cast<char*>(r.dk32) + 2 * kv_bytes());
    return r;
  }
  size_t index_bytes() const { return round256(size_t(std::max<int64_t>(max_local, 1)) * 4); }
  size_t offsets_bytes() const { return round256(size_t(docs + 1) * 4); }
  AttentionShape shape() const {
    int64_t longest = 1;
    for (int64_t n : L.doc_length) longest = std::max(longest, n);
    return {docs, longest, longest, q_share.width, kv_share.width, head_dim};
  }
  AttentionSegments segments(const int32_t* cu) const {
    return varlen_segments(cu, cu, std::max<int64_t>(total, 1), std::max<int64_t>(total, 1));
  }
  size_t attention_backward(const AttentionOptions& options) const {
    static const int32_t kAny[2] = {};  // the size does not read the ranges
    AttentionOptions o = options;
    o.segments = segments(kAny);
    return round256(flash_attention_backward_workspace_bytes(shape(), o));
  }
};

// Checks; then the area, the local -> natural rows and the document offsets. Returns the area.
Sizes::Area start(Communicator& comm, Rank& rank, const Sizes& z, const AttentionOptions& options,
                  void* workspace, size_t workspace_bytes, size_t need, DType dtype, cudaStream_t stream,
                  const std::string& where) {
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
  char* area = ops::workspace_on(comm, rank, z.area_bytes(), stream, where, kArea);
  auto* local_nat = static_cast<int32_t*>(workspace);
  ops::write_local_to_natural(z.L, rank.rank(), local_nat, stream);
  std::vector<int32_t> cu(1, 0);
  for (int64_t n : z.L.doc_length) cu.push_back(static_cast<int32_t>(cu.back() + n));
  ops::upload_words(local_nat + z.index_bytes() / 4, cu, stream);
  return z.carve(area);
}

}  // namespace

size_t ulysses_attention_workspace_bytes(int world, const std::vector<int64_t>& doc_lengths, bool causal,
                                         int64_t heads, int64_t kv_heads, int64_t head_dim) {
  const Sizes z(world, 0, doc_lengths, causal, heads, kv_heads, head_dim);
  return z.index_bytes() + z.offsets_bytes();
}

size_t ulysses_attention_backward_workspace_bytes(int world, const std::vector<int64_t>& doc_lengths,
                                                  bool causal, int64_t heads, int64_t kv_heads,
                                                  int64_t head_dim) {
  const Sizes z(world, 0, doc_lengths, causal, heads, kv_heads, head_dim);
  AttentionOptions o;
  o.causal = causal;
  return z.index_bytes() + z.offsets_bytes() + z.attention_backward(o);
}

void ulysses_attention_forward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v,
                               void* out, float* lse, const std::vector<int64_t>& doc_lengths, int64_t heads,
                               int64_t kv_heads, int64_t head_dim, void* workspace, size_t workspace_bytes,
                               DType dtype, cudaStream_t stream, const AttentionOptions& options) {
  const std::string where = ops::team_where("weft::ulysses_attention_forward", rank);
  const Sizes z(rank.world(), rank.rank(), doc_lengths, options.causal, heads, kv_heads, head_dim);
  if (stream == nullptr) stream = rank.stream();
  const Sizes::Area a = start(comm, rank, z, options, workspace, workspace_bytes,
                              z.index_bytes() + z.offsets_bytes(), dtype, stream, where);
  if (z.total == 0) return;
  const auto* local_nat = static_cast<const int32_t*>(workspace);
  const auto* offsets = reinterpret_cast<const int32_t*>(static_cast<char*>(workspace) + z.index_bytes());
  ops::push_rows(comm, rank, q, z.local, a.q, local_nat, z.q_share, head_dim, z.max_local, stream);
  ops::push_rows(comm, rank, k, z.local, a.k, local_nat, z.kv_share, head_dim, z.max_local, stream);
  ops::push_rows(comm, rank, v, z.local, a.v, local_nat, z.kv_share, head_dim, z.max_local, stream);
  AttentionOptions o = options;
  o.segments = z.segments(offsets);
  flash_attention_forward(a.q, a.k, a.v, a.out, a.lse, z.shape(), dtype, stream, o);
  ops::pull_rows(comm, rank, a.out, false, out, z.local, local_nat, z.q_share, head_dim, z.max_local, dtype,
                 stream);
  if (lse != nullptr) ops::pull_lse(rank, a.lse, lse, z.local, local_nat, heads, z.total, stream);
}

void ulysses_attention_backward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v,
                                const void* out, const void* dout, const float* lse, void* dq, void* dk,
                                void* dv, const std::vector<int64_t>& doc_lengths, int64_t heads,
                                int64_t kv_heads, int64_t head_dim, void* workspace, size_t workspace_bytes,
                                DType dtype, cudaStream_t stream, const AttentionOptions& options) {
  const std::string where = ops::team_where("weft::ulysses_attention_backward", rank);
  const Sizes z(rank.world(), rank.rank(), doc_lengths, options.causal, heads, kv_heads, head_dim);
  if (stream == nullptr) stream = rank.stream();
  const size_t head = z.index_bytes() + z.offsets_bytes(), attention_bytes = z.attention_backward(options);
  const Sizes::Area a =
      start(comm, rank, z, options, workspace, workspace_bytes, head + attention_bytes, dtype, stream, where);
  if (z.total == 0) return;
  const auto* local_nat = static_cast<const int32_t*>(workspace);
  const auto* offsets = reinterpret_cast<const int32_t*>(static_cast<char*>(workspace) + z.index_bytes());
  ops::push_rows(comm, rank, q, z.local, a.q, local_nat, z.q_share, head_dim, z.max_local, stream);
  // After the first push's meeting: every peer is done with its previous call's LSE and dK / dV sums.
  ops::push_lse(rank, lse, z.local, a.lse, local_nat, heads, z.total, stream);
  WEFT_CUDA_CHECK(cudaMemsetAsync(a.dk32, 0, 4 * z.kv_bytes(), stream));
  ops::push_rows(comm, rank, k, z.local, a.k, local_nat, z.kv_share, head_dim, z.max_local, stream);
  ops::push_rows(comm, rank, v, z.local, a.v, local_nat, z.kv_share, head_dim, z.max_local, stream);
  ops::push_rows(comm, rank, out, z.local, a.out, local_nat, z.q_share, head_dim, z.max_local, stream);
  ops::push_rows(comm, rank, dout, z.local, a.dout, local_nat, z.q_share, head_dim, z.max_local, stream);
  AttentionOptions o = options;
  o.segments = z.segments(offsets);
  o.accumulate_grads = {a.dk32, a.dv32};
  flash_attention_backward(a.q, a.k, a.v, a.out, a.dout, a.lse, a.dq, nullptr, nullptr,
                           static_cast<char*>(workspace) + head, attention_bytes, z.shape(), dtype, stream,
                           o);
  ops::pull_rows(comm, rank, a.dq, false, dq, z.local, local_nat, z.q_share, head_dim, z.max_local, dtype,
                 stream);
  ops::pull_rows(comm, rank, a.dk32, true, dk, z.local, local_nat, z.kv_share, head_dim, z.max_local, dtype,
                 stream);
  ops::pull_rows(comm, rank, a.dv32, true, dv, z.local, local_nat, z.kv_share, head_dim, z.max_local, dtype,
                 stream);
}

}  // namespace weft
