// GPU tests of weft::flash_decode against a double-precision host reference: each sequence's cache split over
// the team in uneven contiguous parts (a rank may hold none of a sequence), odd lengths that differ across
// the batch, q_len 1 and 3 causal among the new tokens, GQA 4:1, MQA and 8:1, head_dim 64 and 128, bf16 and
// fp16, contiguous and paged caches (shuffled block tables); outputs poisoned first; repeated calls (the
// inboxes alternate); a length past the capacity fails the call with its reason. Runs at W = 1 and on every
// team.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "harness.hpp"
#include "weft/ops/flash_decode.hpp"
#include "weft/timeline.hpp"

using namespace weft;
using weft::test::download;
using weft::test::poison;
using weft::test::RankBuffers;
using weft::test::TestContext;
using weft::test::upload;

namespace {

uint16_t to_half_bits(float f, DType t) {
  if (t == DType::kFP16) {
    const __half h = __float2half_rn(f);
    uint16_t b;
    std::memcpy(&b, &h, 2);
    return b;
  }
  const __nv_bfloat16 h = __float2bfloat16_rn(f);
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}
float from_half_bits(uint16_t b, DType t) {
  if (t == DType::kFP16) {
    __half h;
    std::memcpy(&h, &b, 2);
    return __half2float(h);
  }
  __nv_bfloat16 h;
  std::memcpy(&h, &b, 2);
  return __bfloat162float(h);
}

struct Case {
  int64_t batch, q_len, heads, kv_heads, d;
  std::vector<int> lengths;  // global length of each sequence, the new tokens included
  DType dtype = DType::kBF16;
  bool paged = false;
  int block_size = 16;
  uint64_t seed = 1;
  bool causal = true;
};

// Rank r's contiguous part [first, first + count) of a sequence of n tokens: uneven parts, rank 0 the
// smallest (none at all when n < W), so that empty parts and parts of one token occur.
std::pair<int, int> part_of(int n, int r, int W) {
  std::vector<int> cut(W + 1, 0);
  for (int i = 1; i <= W; ++i) cut[i] = int(int64_t(n) * i * (i + 1) / (W * (W + 1)));
  cut[W] = n;
  return {cut[r], cut[r + 1] - cut[r]};
}

// One case on the team: the inputs on every local rank, the double reference, the outputs.
struct Prepared {
  Case c;
  DecodeShape shape;
  int max_blocks = 0;
  int64_t num_blocks = 0;
  std::unique_ptr<RankBuffers> q, out, lse, k, v, meta, table;
  std::vector<double> ref_o, ref_lse;
  int out_rank = -1;         // DecodeOptions::out_rank of the calls
  bool null_others = false;  // with out_rank: the other ranks pass null out and lse
};

// min_max_local: the cache's capacity at least this (another case's layout, for data swapped into its
// buffers).
std::unique_ptr<Prepared> prepare(Communicator& comm, const Case& c, int min_max_local = 1) {
  auto pr = std::make_unique<Prepared>();
  pr->c = c;
  const int W = comm.world();
  const int64_t B = c.batch, Lq = c.q_len, H = c.heads, Hkv = c.kv_heads, D = c.d, group = H / Hkv;
  std::mt19937_64 g(c.seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  // Global data (every process makes the same): q [B, Lq, H, D]; K / V per sequence [n, Hkv, D].
  std::vector<uint16_t> q(B * Lq * H * D);
  for (auto& x : q) x = to_half_bits(u(g), c.dtype);
  std::vector<std::vector<uint16_t>> k(B), v(B);
  for (int64_t b = 0; b < B; ++b) {
    k[b].resize(size_t(c.lengths[b]) * Hkv * D);
    v[b].resize(k[b].size());
    for (auto& x : k[b]) x = to_half_bits(u(g), c.dtype);
    for (auto& x : v[b]) x = to_half_bits(u(g), c.dtype);
  }
  int max_local = min_max_local;
  for (int64_t b = 0; b < B; ++b)
    for (int r = 0; r < W; ++r) max_local = std::max(max_local, part_of(c.lengths[b], r, W).second);
  const int max_blocks = (max_local + c.block_size - 1) / c.block_size;
  if (c.paged) max_local = max_blocks * c.block_size;
  const int64_t num_blocks = B * max_blocks + 3;  // a few never used
  const int64_t slots = c.paged ? num_blocks * c.block_size : B * max_local;
  const size_t tok = size_t(Hkv * D);
  pr->shape = DecodeShape{B, Lq, H, Hkv, D, max_local};
  pr->max_blocks = max_blocks;
  pr->num_blocks = num_blocks;
  pr->q = std::make_unique<RankBuffers>(comm, q.size() * 2, false);
  pr->out = std::make_unique<RankBuffers>(comm, q.size() * 2, false);
  pr->lse = std::make_unique<RankBuffers>(comm, B * Lq * H * 4, false);
  pr->k = std::make_unique<RankBuffers>(comm, slots * tok * 2, false);
  pr->v = std::make_unique<RankBuffers>(comm, slots * tok * 2, false);
  pr->meta = std::make_unique<RankBuffers>(comm, 3 * B * 4, false);
  pr->table = std::make_unique<RankBuffers>(comm, std::max<int64_t>(1, B * max_blocks) * 4, false);
  for (int i = 0; i < comm.num_local(); ++i) {
    const int r = comm.local(i).rank();
    std::vector<uint16_t> kc(slots * tok, 0), vc(slots * tok, 0);
    std::vector<int32_t> meta(3 * B), table(B * max_blocks);
    // A shuffled block table: sequence b's j-th block somewhere in the pool.
    std::vector<int32_t> pool(num_blocks);
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), std::mt19937_64(c.seed + 17 * r));
    for (int64_t b = 0; b < B; ++b) {
      const auto [first, count] = part_of(c.lengths[b], r, W);
      meta[b] = count;                 // seqlens
      meta[B + b] = first;             // offsets
      meta[2 * B + b] = c.lengths[b];  // seq_total
      for (int j = 0; j < max_blocks; ++j) table[b * max_blocks + j] = pool[b * max_blocks + j];
      for (int t = 0; t < count; ++t) {
        const int64_t slot =
            c.paged ? int64_t(table[b * max_blocks + t / c.block_size]) * c.block_size + t % c.block_size
                    : b * max_local + t;
        std::memcpy(&kc[slot * tok], &k[b][size_t(first + t) * tok], tok * 2);
        std::memcpy(&vc[slot * tok], &v[b][size_t(first + t) * tok], tok * 2);
      }
    }
    upload(comm, i, pr->q->ptr[i], q.data(), q.size() * 2);
    upload(comm, i, pr->k->ptr[i], kc.data(), kc.size() * 2);
    upload(comm, i, pr->v->ptr[i], vc.data(), vc.size() * 2);
    upload(comm, i, pr->meta->ptr[i], meta.data(), meta.size() * 4);
    upload(comm, i, pr->table->ptr[i], table.data(), table.size() * 4);
  }
  // Host reference (double): query qi of sequence b sees global positions <= n - Lq + qi (all, not causal).
  pr->ref_o.assign(q.size(), 0.0);
  pr->ref_lse.assign(B * Lq * H, 0.0);
  const double scale = 1.0 / std::sqrt(double(D));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t qi = 0; qi < Lq; ++qi)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t kh = h / group, o = (b * Lq + qi) * H + h;
        const int64_t last = c.causal ? c.lengths[b] - Lq + qi : c.lengths[b] - 1;
        std::vector<double> sc(std::max<int64_t>(0, last + 1));
        double mx = -INFINITY;
        for (int64_t t = 0; t <= last; ++t) {
          double acc = 0;
          for (int64_t d = 0; d < D; ++d)
            acc += double(from_half_bits(q[o * D + d], c.dtype)) *
                   from_half_bits(k[b][(t * Hkv + kh) * D + d], c.dtype);
          sc[t] = acc * scale;
          mx = std::max(mx, sc[t]);
        }
        double sum = 0;
        for (auto& x : sc) sum += (x = std::exp(x - mx));
        for (int64_t d = 0; d < D; ++d) {
          double acc = 0;
          for (int64_t t = 0; t <= last; ++t)
            acc += sc[t] * from_half_bits(v[b][(t * Hkv + kh) * D + d], c.dtype);
          pr->ref_o[o * D + d] = sum > 0 ? acc / sum : 0;
        }
        pr->ref_lse[o] = sum > 0 ? mx + std::log(sum) : -INFINITY;
      }
  return pr;
}

void poison_outputs(Communicator& comm, Prepared& pr) {
  for (int i = 0; i < comm.num_local(); ++i) {
    poison(comm, i, pr.out->ptr[i], pr.ref_o.size() * 2);
    poison(comm, i, pr.lse->ptr[i], pr.ref_lse.size() * 4);
  }
}

// The call on local rank i, on its stream.
void enqueue_rank(Communicator& comm, Prepared& pr, int i) {
  const int64_t B = pr.c.batch;
  {
    const auto* meta = reinterpret_cast<const int32_t*>(pr.meta->ptr[i]);
    DecodeCache cache;
    cache.k = pr.k->ptr[i];
    cache.v = pr.v->ptr[i];
    if (pr.c.paged) {
      cache.block_table = reinterpret_cast<const int32_t*>(pr.table->ptr[i]);
      cache.block_size = pr.c.block_size;
      cache.max_blocks = pr.max_blocks;
      cache.num_blocks = pr.num_blocks;
    }
    cache.seqlens = meta;
    cache.offsets = meta + B;
    cache.seq_total = meta + 2 * B;
    DecodeOptions o;
    o.causal = pr.c.causal;
    o.out_rank = pr.out_rank;
    const bool none = pr.null_others && pr.out_rank >= 0 && comm.local(i).rank() != pr.out_rank;
    flash_decode(comm, comm.local(i), pr.q->ptr[i], cache, none ? nullptr : pr.out->ptr[i],
                 none ? nullptr : reinterpret_cast<float*>(pr.lse->ptr[i]), pr.shape, pr.c.dtype, nullptr, o);
  }
}

// The call on every local rank, no synchronisation.
void enqueue(Communicator& comm, Prepared& pr) {
  for (int i = 0; i < comm.num_local(); ++i) enqueue_rank(comm, pr, i);
}

// Every rank's out and lse against the reference; with pr.out_rank set, that rank's, and the others' left as
// poisoned (not written).
void check(Communicator& comm, Prepared& pr, const std::string& label) {
  const Case& c = pr.c;
  for (int i = 0; i < comm.num_local(); ++i) {
    std::vector<uint16_t> out(pr.ref_o.size());
    std::vector<float> lse(pr.ref_lse.size());
    download(comm, i, out.data(), pr.out->ptr[i], out.size() * 2);
    download(comm, i, lse.data(), pr.lse->ptr[i], lse.size() * 4);
    if (pr.out_rank >= 0 && comm.local(i).rank() != pr.out_rank) {
      const bool untouched = std::all_of(out.begin(), out.end(), [](uint16_t x) { return x == 0xffff; }) &&
                             std::all_of(lse.begin(), lse.end(), [](float x) { return std::isnan(x); });
      WEFT_EXPECT(untouched, label << ": rank " << comm.local(i).rank() << " wrote out or lse (out_rank "
                                   << pr.out_rank << ")");
      continue;
    }
    double e2 = 0, r2 = 0, lse_err = 0;
    int64_t bad = 0, bad_lse = 0;
    for (size_t j = 0; j < out.size(); ++j) {
      const double x = from_half_bits(out[j], c.dtype);
      if (!std::isfinite(x)) ++bad;
      e2 += (x - pr.ref_o[j]) * (x - pr.ref_o[j]);
      r2 += pr.ref_o[j] * pr.ref_o[j];
    }
    for (size_t j = 0; j < lse.size(); ++j) {
      if (std::isinf(pr.ref_lse[j])) {  // an empty row: -inf exactly
        bad_lse += !(std::isinf(lse[j]) && lse[j] < 0);
        continue;
      }
      if (!std::isfinite(lse[j])) {
        ++bad_lse;
        continue;
      }
      lse_err = std::max(lse_err, std::fabs(double(lse[j]) - pr.ref_lse[j]));
    }
    const double rel = std::sqrt(e2 / std::max(r2, 1e-30));
    const std::string what = label + ": B=" + std::to_string(c.batch) + " q_len=" + std::to_string(c.q_len) +
                             " heads " + std::to_string(c.heads) + "/" + std::to_string(c.kv_heads) +
                             " D=" + std::to_string(c.d) + (c.dtype == DType::kFP16 ? " fp16" : " bf16") +
                             (c.paged ? " paged" : "") + (c.causal ? "" : " not causal") + " rank " +
                             std::to_string(comm.local(i).rank());
    WEFT_EXPECT(bad == 0, what << ": " << bad << " outputs not finite");
    WEFT_EXPECT(rel <= 1e-2, what << ": relative error " << rel);
    WEFT_EXPECT(bad_lse == 0,
                what << ": " << bad_lse << " lse values not finite (or not -inf for an empty row)");
    WEFT_EXPECT(lse_err <= 2e-3, what << ": lse off by " << lse_err);
  }
}

void run_case(TestContext& ctx, const Case& c) {
  Communicator& comm = ctx.comm();
  const auto pr = prepare(comm, c);
  {  // the plan: no launch, the two inboxes named, a grid
    DecodeCache cache;
    cache.k = pr->k->ptr[0];
    cache.v = pr->v->ptr[0];
    if (c.paged) {
      cache.block_table = reinterpret_cast<const int32_t*>(pr->table->ptr[0]);
      cache.block_size = c.block_size;
      cache.max_blocks = pr->max_blocks;
      cache.num_blocks = pr->num_blocks;
    }
    cache.seqlens = reinterpret_cast<const int32_t*>(pr->meta->ptr[0]);
    cache.offsets = cache.seqlens + c.batch;
    cache.seq_total = cache.seqlens + 2 * c.batch;
    DecodeOptions o;
    o.causal = c.causal;
    const Plan plan = flash_decode_plan(comm, comm.local(0), pr->q->ptr[0], cache, pr->out->ptr[0], nullptr,
                                        pr->shape, c.dtype, nullptr, o);
    WEFT_EXPECT(plan.op == "flash_decode" && plan.blocks > 0 && plan.workspace.size() == 2,
                "plan: " << describe(plan));
  }
  for (int rep = 0; rep < 3; ++rep) {  // the inboxes alternate between calls
    poison_outputs(comm, *pr);
    comm.host_barrier();
    enqueue(comm, *pr);
    comm.synchronize();
    check(comm, *pr, "rep " + std::to_string(rep));
    comm.host_barrier();
  }
  // The result on one rank (out_rank), each rank in turn and twice in a row (the others' outputs left
  // unwritten), then on every rank again.
  for (int root = 0; root < comm.world(); ++root) {
    pr->out_rank = root;
    poison_outputs(comm, *pr);
    comm.host_barrier();
    for (int rep = 0; rep < 2; ++rep) enqueue(comm, *pr);
    comm.synchronize();
    check(comm, *pr, "out_rank " + std::to_string(root));
    comm.host_barrier();
  }
  pr->out_rank = -1;
  poison_outputs(comm, *pr);
  comm.host_barrier();
  enqueue(comm, *pr);
  comm.synchronize();
  check(comm, *pr, "every rank after out_rank calls");
  comm.host_barrier();
  // Both modes back to back with no synchronisation between them (the released flags order the inboxes on
  // the device), the other ranks' out and lse null in the one-rank calls; every rank's result after the last.
  poison_outputs(comm, *pr);
  comm.host_barrier();
  for (int root = 0; root < comm.world(); ++root) {
    pr->out_rank = root;
    pr->null_others = true;
    enqueue(comm, *pr);
    pr->out_rank = -1;
    pr->null_others = false;
    enqueue(comm, *pr);
  }
  comm.synchronize();
  check(comm, *pr, "both modes back to back");
  comm.host_barrier();
}

// Calls of two shapes back to back with no synchronisation (they alternate between the inboxes, each laid
// out for its own shape), three times: every result its own. Seeds `seed` and seed + 1.
void back_to_back(Communicator& comm, uint64_t seed, const std::string& label) {
  auto a = prepare(comm, Case{2, 1, 8, 2, 128, {700, 1500}, DType::kBF16, false, 16, seed});
  auto b = prepare(comm, Case{5, 2, 16, 4, 64, {9, 300, 64, 1, 2000}, DType::kBF16, true, 16, seed + 1});
  poison_outputs(comm, *a);
  poison_outputs(comm, *b);
  comm.host_barrier();
  for (int rep = 0; rep < 3; ++rep) {
    enqueue(comm, *a);
    enqueue(comm, *b);
  }
  comm.synchronize();
  check(comm, *a, label + " (a)");
  check(comm, *b, label + " (b)");
}

}  // namespace

WEFT_GPU_TEST_ANY_WORLD(flash_decode_matches_reference) {
  std::vector<Case> cases = {
      {3, 1, 8, 2, 128, {1, 300, 1027}},
      {2, 3, 8, 2, 128, {5, 700}},                     // causal among 3 new tokens
      {2, 1, 4, 1, 64, {129, 64}, DType::kFP16},       // MQA, D 64
      {1, 2, 16, 2, 128, {2048}, DType::kBF16, true},  // GQA 8:1 (16 rows), paged
      {4, 1, 8, 8, 64, {33, 1, 90, 257}, DType::kBF16, true, 32},
      {2, 2, 8, 2, 128, {3, 517}, DType::kBF16, true, 16, 0, false},  // not causal, paged, q_len 2
      {2, 1, 2, 1, 128, {100, 50}},                                   // 2 rows per item
      {1, 3, 32, 4, 128, {3000}},  // 24 rows: two row groups a pair (their splits merged together)
      {1, 1, 8, 2, 128, {40}},  // a short cache: one split at every world size (partials pushed as they are)
  };
  // Many rows with few parts each: the merge takes a row a warp (rows past the pair's in its last block).
  std::vector<int> many(40), many3(24);
  for (int i = 0; i < 40; ++i) many[i] = 1 + (37 * i + 11) % 700;
  for (int i = 0; i < 24; ++i) many3[i] = 3 + (53 * i + 5) % 400;
  cases.push_back({40, 1, 32, 8, 128, many});
  cases.push_back({24, 3, 16, 8, 64, many3, DType::kFP16});  // 6 rows a pair
  uint64_t seed = 1;
  for (Case c : cases) {
    c.seed = seed++;
    run_case(ctx, c);
  }
}

// A length past the capacity fails the call on the device, reported with the sequence and the limit.
WEFT_GPU_TEST_ANY_WORLD(flash_decode_refuses_bad_lengths) {
  auto cp = ctx.make_comm(std::chrono::milliseconds(2000));
  Communicator& comm = *cp;
  const DecodeShape shape{1, 1, 4, 1, 64, 16};
  RankBuffers q(comm, 4 * 64 * 2, false), out(comm, 4 * 64 * 2, false), kv(comm, 16 * 64 * 2, false),
      len(comm, 4, false);
  for (int i = 0; i < comm.num_local(); ++i) {
    const int32_t n = 17;  // one past max_local
    upload(comm, i, len.ptr[i], &n, 4);
    poison(comm, i, q.ptr[i], 4 * 64 * 2);
  }
  comm.host_barrier();
  std::string msg;
  try {
    for (int i = 0; i < comm.num_local(); ++i) {
      DecodeCache c;
      c.k = c.v = kv.ptr[i];
      c.seqlens = reinterpret_cast<const int32_t*>(len.ptr[i]);
      flash_decode(comm, comm.local(i), q.ptr[i], c, out.ptr[i], nullptr, shape, DType::kBF16);
    }
    comm.synchronize();
  } catch (const Error& e) {
    msg = e.what();
  }
  WEFT_EXPECT(msg.find("cache length 17") != std::string::npos, "got '" << msg << "'");
  // Shapes refused on the host, before anything is launched.
  auto refusal = [&](const DecodeShape& bad) {
    return weft::test::error_of([&] {
      DecodeCache c;
      c.k = c.v = kv.ptr[0];
      c.seqlens = reinterpret_cast<const int32_t*>(len.ptr[0]);
      flash_decode(comm, comm.local(0), q.ptr[0], c, out.ptr[0], nullptr, bad, DType::kBF16);
    });
  };
  std::string e = refusal(DecodeShape{1, 1, 6, 4, 64, 16});
  WEFT_EXPECT(e.find("multiple of kv_heads") != std::string::npos, "heads 6 / kv 4: got '" << e << "'");
  e = refusal(DecodeShape{1, 1, 4, 1, 96, 16});
  WEFT_EXPECT(e.find("head_dim must be 64 or 128") != std::string::npos, "head_dim 96: got '" << e << "'");
}

// Calls of two shapes back to back with no synchronisation: every result its own.
WEFT_GPU_TEST_ANY_WORLD(flash_decode_back_to_back_shapes) {
  back_to_back(ctx.comm(), 41, "back to back");
}

// Captured once per rank into a CUDA graph, replayed with other lengths and data (another case's, copied into
// the captured buffers) and then the first again: the call epoch and the inboxes' parity live on the device.
WEFT_GPU_TEST_ANY_WORLD(flash_decode_replays_in_cuda_graphs) {
  Communicator& comm = ctx.comm();
  auto a = prepare(comm, Case{2, 1, 8, 2, 128, {900, 40}, DType::kBF16, false, 16, 51});
  auto b =
      prepare(comm, Case{2, 1, 8, 2, 128, {301, 41}, DType::kBF16, false, 16, 52}, int(a->shape.max_local));
  WEFT_EXPECT(b->shape.max_local == a->shape.max_local, "the two cases' layouts differ");
  enqueue(comm, *a);  // the inboxes grow before the capture
  comm.synchronize();
  std::vector<cudaGraphExec_t> exec(comm.num_local());
  for (int i = 0; i < comm.num_local(); ++i) {
    WEFT_CUDA_CHECK(cudaSetDevice(comm.local(i).device()));
    cudaGraph_t g;
    WEFT_CUDA_CHECK(cudaStreamBeginCapture(comm.local(i).stream(), cudaStreamCaptureModeThreadLocal));
    enqueue_rank(comm, *a, i);
    WEFT_CUDA_CHECK(cudaStreamEndCapture(comm.local(i).stream(), &g));
    WEFT_CUDA_CHECK(cudaGraphInstantiate(&exec[i], g, 0));
    WEFT_CUDA_CHECK(cudaGraphDestroy(g));
  }
  auto copy = [&](RankBuffers& to, RankBuffers& from, size_t bytes) {
    for (int i = 0; i < comm.num_local(); ++i) {
      WEFT_CUDA_CHECK(cudaSetDevice(comm.local(i).device()));
      WEFT_CUDA_CHECK(cudaMemcpy(to.ptr[i], from.ptr[i], bytes, cudaMemcpyDeviceToDevice));
    }
  };
  const size_t q_bytes = a->ref_o.size() * 2, meta_bytes = 3 * 2 * 4;
  const size_t kv_bytes = size_t(2 * a->shape.max_local * 2 * 128) * 2;
  // Case a's data is in the buffers; then b's; then a's again.
  std::vector<std::unique_ptr<RankBuffers>> saved;
  for (const char* name : {"a", "b", "a again"}) {
    Prepared& want = name[0] == 'b' ? *b : *a;
    if (name[0] == 'b') {  // keep a's inputs, then put b's in their place
      for (RankBuffers* x : {a->q.get(), a->k.get(), a->v.get(), a->meta.get()})
        saved.push_back(std::make_unique<RankBuffers>(comm,
                                                      x == a->q.get()      ? q_bytes
                                                      : x == a->meta.get() ? meta_bytes
                                                                           : kv_bytes,
                                                      false));
      copy(*saved[0], *a->q, q_bytes);
      copy(*saved[1], *a->k, kv_bytes);
      copy(*saved[2], *a->v, kv_bytes);
      copy(*saved[3], *a->meta, meta_bytes);
      copy(*a->q, *b->q, q_bytes);
      copy(*a->k, *b->k, kv_bytes);
      copy(*a->v, *b->v, kv_bytes);
      copy(*a->meta, *b->meta, meta_bytes);
    } else if (!saved.empty()) {
      copy(*a->q, *saved[0], q_bytes);
      copy(*a->k, *saved[1], kv_bytes);
      copy(*a->v, *saved[2], kv_bytes);
      copy(*a->meta, *saved[3], meta_bytes);
    }
    poison_outputs(comm, *a);
    comm.host_barrier();
    for (int i = 0; i < comm.num_local(); ++i) {
      WEFT_CUDA_CHECK(cudaSetDevice(comm.local(i).device()));
      WEFT_CUDA_CHECK(cudaGraphLaunch(exec[i], comm.local(i).stream()));
    }
    comm.synchronize();
    // a's output buffers hold the replay's result; check them against the case whose data was in.
    want.out.swap(a->out);
    want.lse.swap(a->lse);
    check(comm, want, std::string("graph replay, case ") + name);
    want.out.swap(a->out);
    want.lse.swap(a->lse);
    comm.host_barrier();
  }
  for (auto& e : exec) cudaGraphExecDestroy(e);
}

// A timeline (weft/timeline.hpp) on every rank records flash_decode's steps (TimelinePhase::kDecode): every
// rank's partials and pushes, and on the merging ranks the waits for the partials and the merges, each step
// ended as often as begun; the result is still right.
WEFT_GPU_TEST_ANY_WORLD(flash_decode_timeline_records_its_steps) {
  Communicator& comm = ctx.comm();
  Case c{4, 1, 8, 2, 128, {1, 300, 1027, 64}};
  c.seed = 71;
  const auto pr = prepare(comm, c);
  poison_outputs(comm, *pr);
  comm.host_barrier();
  for (int i = 0; i < comm.num_local(); ++i) comm.timeline_start(comm.local(i), 1 << 16);
  enqueue(comm, *pr);
  comm.synchronize();
  for (int i = 0; i < comm.num_local(); ++i) {
    const int r = comm.local(i).rank();
    const TimelineRecord rec = comm.timeline_take(comm.local(i));
    WEFT_EXPECT(rec.dropped == 0, "rank " << r << ": " << rec.dropped << " marks dropped");
    std::map<uint32_t, int> begins, ends;  // per DecodeStep
    for (const TimelineEvent& e : rec.events)
      if ((e.edge & ~kTimelineEnd) == int(TimelinePhase::kDecode))
        (e.edge & kTimelineEnd ? ends : begins)[e.arg]++;
    // kMergeSplits only where a pair has several splits; then once a row block of each pair (batch 4 x 2 KV
    // heads; 4 rows a pair, one block or four) on every rank. On a team of one those merges write out: no
    // wait for partials, no merge of ranks' parts.
    const uint32_t splits = uint32_t(DecodeStep::kMergeSplits);
    const bool merged_alone = comm.world() == 1 && begins[splits] > 0;
    for (DecodeStep s :
         {DecodeStep::kPartial, DecodeStep::kPush, DecodeStep::kWaitPartials, DecodeStep::kMerge}) {
      const bool none = merged_alone && (s == DecodeStep::kWaitPartials || s == DecodeStep::kMerge);
      WEFT_EXPECT((none ? begins[uint32_t(s)] == 0 : begins[uint32_t(s)] > 0) &&
                      begins[uint32_t(s)] == ends[uint32_t(s)],
                  "rank " << r << ": " << decode_step_name(s) << " began " << begins[uint32_t(s)]
                          << " times, ended " << ends[uint32_t(s)] << (none ? " (expected none)" : ""));
    }
    WEFT_EXPECT(begins[splits] == ends[splits] &&
                    (begins[splits] == 0 || begins[splits] == 8 || begins[splits] == 32),
                "rank " << r << ": merge_splits began " << begins[splits] << " times, ended " << ends[splits]
                        << " (0, or once for each row block of the 8 pairs: 8 or 32)");
  }
  check(comm, *pr, "with a timeline");
  comm.host_barrier();
}
