// GPU tests of the collectives against an fp64 host reference: every rank's input is generated from a
// seed on every process, so each rank can compute the exact expected result on its own. Outputs are
// poisoned (NaN bytes) before each run; NaN never passes; data movement (all-gather, all-to-all) must
// be bit-exact, reductions within bf16/fp16 rounding.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <tuple>

#include "harness.hpp"
#include "ops/one_shot.hpp"  // one_shot_min_blocks: what a forced one-shot needs of the SM budget
#include "weft/ops/collectives.hpp"

using namespace weft;
using weft::test::DeviceBuffer;
using weft::test::TestContext;

namespace {

float to_float(DType t, const void* p) {
  if (t == DType::kFP32) return *static_cast<const float*>(p);
  uint16_t h;
  std::memcpy(&h, p, 2);
  if (t == DType::kBF16) {
    uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  return __half2float(*reinterpret_cast<const __half*>(&h));
}
void from_float(DType t, float f, void* p) {
  if (t == DType::kFP32)
    std::memcpy(p, &f, 4);
  else if (t == DType::kBF16)
    *static_cast<__nv_bfloat16*>(p) = __float2bfloat16_rn(f);
  else
    *static_cast<__half*>(p) = __float2half_rn(f);
}

// Rank r's input for one test case: values in [-1, 1], exactly representable in the dtype. Made in parts of
// 64 Ki elements, each from its own generator (so in parallel), and kept for the next asks of the same
// case (the reference and the upload want every rank's input).
std::vector<char> make_input(DType t, size_t count, int rank, uint64_t seed) {
  static std::mutex mu;
  static std::map<std::tuple<int, size_t, int, uint64_t>, std::vector<char>> made;
  const auto key = std::tuple{int(t), count, rank, seed};
  {
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = made.find(key); it != made.end()) return it->second;
  }
  constexpr size_t kPart = 64 << 10;
  std::vector<char> v(count * dtype_size(t));
  weft::test::parallel_for(
      (count + kPart - 1) / kPart,
      [&](size_t p0, size_t p1) {
        for (size_t p = p0; p < p1; ++p) {
          std::mt19937_64 rng(seed * 1000003 + rank * 7919 + count + p * 0x9E3779B97F4A7C15ull);
          std::uniform_real_distribution<float> u(-1.f, 1.f);
          for (size_t i = p * kPart; i < std::min(count, (p + 1) * kPart); ++i)
            from_float(t, u(rng), v.data() + i * dtype_size(t));
        }
      },
      1);  // a part (kPart values) is worth a thread: the inputs of a W-rank case are W x count values
  std::lock_guard<std::mutex> lock(mu);
  if (made.size() >= 64) made.clear();
  made[key] = v;
  return v;
}

double reduce(ReduceOp op, double a, double b) {
  return op == ReduceOp::kSum ? a + b : op == ReduceOp::kMax ? std::max(a, b) : std::min(a, b);
}

using weft::test::keeping_plan;
using weft::test::poison;
using weft::test::RankBuffers;

void upload(Communicator& c, int i, char* dst, const std::vector<char>& host) {
  weft::test::upload(c, i, dst, host.data(), host.size());
}
std::vector<char> download(Communicator& c, int i, const char* src, uint64_t bytes) {
  std::vector<char> v(bytes);
  weft::test::download(c, i, v.data(), src, bytes);
  return v;
}

// Compares got (dtype t) with an fp64 reference: NaN fails; exact ops need bit equality of the rounded
// reference; reductions need relative L2 error <= tol, and fp32 sums of `terms` inputs in [-1, 1] every
// element within the rounding bound of any summation order, terms^2 * 2^-24 (the relative L2 error of a
// result near zero says little: 8 ranks' fp32 sum of one element missed 1e-6 by rounding alone).
std::string compare(DType t, const std::vector<char>& got, const std::vector<double>& ref, bool exact,
                    int terms = 0) {
  const size_t es = dtype_size(t);
  const bool fp32_sum = t == DType::kFP32 && !exact && terms > 0;
  const double bound = double(terms) * terms * 0x1p-24;
  // The first bad element in [i0, i1) ("" when none), and the part's sums of squares.
  struct Part {
    std::string bad;
    double num = 0, den = 0;
  };
  const auto check = [&](size_t i0, size_t i1) {
    Part part;
    for (size_t i = i0; i < i1; ++i) {
      const float g = to_float(t, got.data() + i * es);
      if (std::isnan(g)) {
        part.bad = "NaN at element " + std::to_string(i) + " (not written?)";
        return part;
      }
      if (fp32_sum) {
        if (std::fabs(g - ref[i]) > bound) {
          part.bad = "element " + std::to_string(i) + ": got " + std::to_string(g) + ", want " +
                     std::to_string(ref[i]) + " (beyond the fp32 rounding bound " + std::to_string(bound) +
                     ")";
          return part;
        }
        continue;
      }
      if (exact) {
        char want[4];
        from_float(t, static_cast<float>(ref[i]), want);
        if (std::memcmp(want, got.data() + i * es, es) != 0) {
          part.bad = "element " + std::to_string(i) + ": got " + std::to_string(g) + ", want " +
                     std::to_string(ref[i]);
          return part;
        }
      }
      part.num += (g - ref[i]) * (g - ref[i]);
      part.den += ref[i] * ref[i];
    }
    return part;
  };
  // In parts on the host's cores (a large team's outputs hold millions of elements), the first bad element
  // reported as a serial walk would (the lowest part with one).
  constexpr size_t kPart = 1 << 16;
  std::vector<Part> parts((ref.size() + kPart - 1) / kPart);
  weft::test::parallel_for(
      parts.size(),
      [&](size_t p0, size_t p1) {
        for (size_t p = p0; p < p1; ++p) parts[p] = check(p * kPart, std::min(ref.size(), (p + 1) * kPart));
      },
      1);
  double num = 0, den = 0;
  for (const Part& part : parts) {
    if (!part.bad.empty()) return part.bad;
    num += part.num;
    den += part.den;
  }
  if (fp32_sum) return {};
  const double tol = t == DType::kFP32 ? 1e-6 : 1e-2;
  const double err = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  if (err > tol) return "relative error " + std::to_string(err) + " > " + std::to_string(tol);
  return {};
}

// ref[k] = value(k) for k in [0, n), on the host's cores.
template <class F>
std::vector<double> reference(size_t n, F&& value) {
  std::vector<double> ref(n);
  weft::test::parallel_for(
      n,
      [&](size_t k0, size_t k1) {
        for (size_t k = k0; k < k1; ++k) ref[k] = value(k);
      },
      size_t(1) << 16);
  return ref;
}

const DType kTypes[] = {DType::kBF16, DType::kFP16, DType::kFP32};

template <class F>
void for_each_local(Communicator& c, F&& f) {
  for (int i = 0; i < c.num_local(); ++i) f(c.local(i), i);
}

void all_reduce_case(TestContext& ctx, DType t, size_t count, ReduceOp op, bool sym, bool in_place,
                     CollectiveOptions options, uint64_t seed) {
  const AllReduceAlgo algo = options.algo;
  Communicator& c = ctx.comm();
  const int W = c.world();
  const uint64_t bytes = count * dtype_size(t);
  RankBuffers in(c, bytes, sym), out(c, bytes, sym);
  // A small SM budget (--sm-budget) cannot hold a forced one-shot's blocks: refused before any launch.
  if (algo == AllReduceAlgo::kOneShot && ops::one_shot_min_blocks(W, bytes) > c.local(0).sm_budget()) {
    for_each_local(c, [&](Rank& r, int i) {
      std::string msg;
      try {
        all_reduce(c, r, in.ptr[i], out.ptr[i], count, t, op, nullptr, algo);
      } catch (const Error& e) {
        msg = e.what();
      }
      WEFT_EXPECT(msg.find("SM budget") != std::string::npos, "forced one-shot: got '" << msg << "'");
    });
    return;
  }
  std::vector<std::vector<char>> inputs;
  for (int r = 0; r < W; ++r) inputs.push_back(make_input(t, count, r, seed));
  const std::vector<double> ref = reference(count, [&](size_t i) {
    double a = to_float(t, inputs[0].data() + i * dtype_size(t));
    for (int r = 1; r < W; ++r) a = reduce(op, a, to_float(t, inputs[r].data() + i * dtype_size(t)));
    return a;
  });
  for_each_local(c, [&](Rank& r, int i) {
    upload(c, i, in.ptr[i], inputs[r.rank()]);
    if (!in_place) poison(c, i, out.ptr[i], bytes);
  });
  c.host_barrier();
  for_each_local(c, [&](Rank& r, int i) {
    void* dst = in_place ? in.ptr[i] : out.ptr[i];
    const Plan plan = keeping_plan(c, all_reduce_plan(c, r, in.ptr[i], dst, count, t, op, nullptr, options),
                                   [&] { all_reduce(c, r, in.ptr[i], dst, count, t, op, nullptr, options); });
    WEFT_EXPECT(algo != AllReduceAlgo::kOneShot || plan.path == "one-shot", describe(plan));
    WEFT_EXPECT(algo != AllReduceAlgo::kTwoShot || plan.path.rfind("two-shot", 0) == 0 ||
                    count * dtype_size(t) < 16 * size_t(W),
                describe(plan));
  });
  c.synchronize();
  for_each_local(c, [&](Rank& r, int i) {
    auto got = download(c, i, in_place ? in.ptr[i] : out.ptr[i], bytes);
    const std::string err = compare(t, got, ref, op != ReduceOp::kSum, W);
    WEFT_EXPECT(err.empty(), "all_reduce " << dtype_name(t) << " " << reduce_op_name(op) << " count " << count
                                           << (sym ? " symmetric" : " device")
                                           << (in_place ? " in-place" : "") << " algo " << int(algo)
                                           << " rank " << r.rank() << ": " << err);
  });
  c.host_barrier();
}

}  // namespace

WEFT_GPU_TEST(all_reduce_matches_fp64_reference) {
  // 262208 (16-byte multiple, 512 KiB in bf16): the staged one-shot at 2 GPUs; 3 << 20: the pipelined push.
  std::vector<size_t> counts = {1, 2, 7, 8, 33, 1000, 4097, 65536 + 3, 262208, (1 << 20) + 5, 3 << 20};
  if (ctx.quick) counts = {1, 7, 1000, 65536 + 3};
  uint64_t seed = 1;
  for (DType t : kTypes)
    for (size_t n : counts) {
      all_reduce_case(ctx, t, n, ReduceOp::kSum, true, false, CollectiveOptions{}, seed++);
      all_reduce_case(ctx, t, n, ReduceOp::kSum, false, false, CollectiveOptions{}, seed++);
    }
  // 160 MiB: the push two-shot's blocks walk several groups, odd blocks shifted by half a group.
  if (!ctx.quick)
    all_reduce_case(ctx, DType::kBF16, 80 << 20, ReduceOp::kSum, true, false, CollectiveOptions{}, seed++);
}

// Every reduce flow forced on the two-shot all-reduce (the automatic choice and tuning rely on each being
// right at any size): pull, stepwise pull and the pipelined push, symmetric and not.
WEFT_GPU_TEST(all_reduce_every_reduce_flow) {
  uint64_t seed = 1300;
  for (ReduceFlow f : {ReduceFlow::kPull, ReduceFlow::kSteps, ReduceFlow::kPush}) {
    CollectiveOptions o;
    o.algo = AllReduceAlgo::kTwoShot;
    o.flow = f;
    for (bool sym : {true, false})
      for (size_t n : {size_t(4097), size_t(ctx.quick ? 1 << 16 : 3 << 20)})
        all_reduce_case(ctx, DType::kBF16, n, ReduceOp::kSum, sym, false, o, seed++);
  }
}

WEFT_GPU_TEST(all_reduce_algorithms_ops_and_in_place) {
  const size_t n = ctx.quick ? 5000 : 50001;
  uint64_t seed = 100;
  for (DType t : kTypes)
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin})
      for (AllReduceAlgo a : {AllReduceAlgo::kOneShot, AllReduceAlgo::kTwoShot}) {
        all_reduce_case(ctx, t, n, op, true, false, CollectiveOptions{a}, seed++);
        all_reduce_case(ctx, t, n, op, true, true, CollectiveOptions{a}, seed++);
        all_reduce_case(ctx, t, n, op, false, true, CollectiveOptions{a}, seed++);
      }
}

// Back-to-back calls with no host synchronization in between (what a training step does): each call's
// inputs, op and size differ, every output has its own buffer, one check at the end. A race between one
// call's reads and the next call's writes shows up here and not in the one-call-at-a-time tests.
WEFT_GPU_TEST(all_reduce_back_to_back) {
  Communicator& c = ctx.comm();
  const int W = c.world();
  const DType t = DType::kBF16;
  const ReduceOp ops[] = {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin};
  // Sizes alternate between the one-shot protocols (LL, staged at 2 GPUs) and the two-shot ones: a call
  // must never write where a slower rank still reads the previous call's data.
  const size_t counts[] = {65536 + 3, 1000, 100000, 262208, 7, (1 << 20) + 5};
  const size_t kCounts = sizeof(counts) / sizeof(counts[0]);
  const int calls = ctx.quick ? 6 : 30;
  for (bool sym : {false, true}) {
    std::vector<std::unique_ptr<RankBuffers>> in, out;
    std::vector<std::vector<double>> refs;
    for (int q = 0; q < calls; ++q) {
      const size_t n = counts[q % kCounts];
      const ReduceOp op = ops[q % 3];
      in.push_back(std::make_unique<RankBuffers>(c, n * 2, sym));
      out.push_back(std::make_unique<RankBuffers>(c, n * 2, sym));
      std::vector<std::vector<char>> inputs;
      for (int r = 0; r < W; ++r) inputs.push_back(make_input(t, n, r, 900 + q));
      refs.push_back(reference(n, [&](size_t i) {
        double a = to_float(t, inputs[0].data() + i * 2);
        for (int r = 1; r < W; ++r) a = reduce(op, a, to_float(t, inputs[r].data() + i * 2));
        return a;
      }));
      for_each_local(c, [&](Rank& r, int i) {
        upload(c, i, in[q]->ptr[i], make_input(t, n, r.rank(), 900 + q));
        poison(c, i, out[q]->ptr[i], n * 2);
      });
    }
    c.host_barrier();
    for (int q = 0; q < calls; ++q)
      for_each_local(c, [&](Rank& r, int i) {
        all_reduce(c, r, in[q]->ptr[i], out[q]->ptr[i], counts[q % kCounts], t, ops[q % 3], nullptr);
      });
    c.synchronize();
    for (int q = 0; q < calls; ++q)
      for_each_local(c, [&](Rank& r, int i) {
        auto got = download(c, i, out[q]->ptr[i], counts[q % kCounts] * 2);
        const std::string err = compare(t, got, refs[q], ops[q % 3] != ReduceOp::kSum, W);
        WEFT_EXPECT(err.empty(), "back-to-back call " << q << " " << reduce_op_name(ops[q % 3]) << " count "
                                                      << counts[q % kCounts]
                                                      << (sym ? " symmetric" : " device") << " rank "
                                                      << r.rank() << ": " << err);
      });
    c.host_barrier();
  }
}

WEFT_GPU_TEST(all_gather_both_dims) {
  Communicator& c = ctx.comm();
  const int W = c.world();
  std::vector<Shape2D> shapes = {{1, 1}, {3, 5}, {64, 128}, {1000, 77}, {513, 1024}, {1 << 20, 1}};
  if (ctx.quick) shapes = {{3, 5}, {64, 128}, {1000, 77}};
  uint64_t seed = 200;
  for (DType t : kTypes)
    for (Shape2D s : shapes)
      for (int dim : {0, 1})
        for (bool sym : {true, false})
          for (bool in_place : {false, true}) {
            if (in_place && dim == 1) continue;
            const uint64_t es = dtype_size(t), in_bytes = s.count() * es;
            RankBuffers out(c, in_bytes * W, sym);
            RankBuffers in(c, in_bytes, true);
            std::vector<std::vector<char>> inputs;
            for (int r = 0; r < W; ++r) inputs.push_back(make_input(t, s.count(), r, seed));
            for_each_local(c, [&](Rank& r, int i) {
              poison(c, i, out.ptr[i], in_bytes * W);
              upload(c, i, in_place ? out.ptr[i] + r.rank() * in_bytes : in.ptr[i], inputs[r.rank()]);
            });
            c.host_barrier();
            for_each_local(c, [&](Rank& r, int i) {
              const void* src = in_place ? out.ptr[i] + r.rank() * in_bytes : in.ptr[i];
              keeping_plan(c, all_gather_plan(c, r, src, out.ptr[i], s, dim, t),
                           [&] { all_gather(c, r, src, out.ptr[i], s, dim, t); });
            });
            c.synchronize();
            // Output element o of rank r's part, row i, column j (dim 0: parts stacked; dim 1: side by side).
            const std::vector<double> ref = reference(s.count() * W, [&](size_t o) {
              const size_t row = dim == 0 ? o / s.cols : o / (s.cols * W),
                           col = dim == 0 ? o % s.cols : o % (s.cols * W);
              const size_t r = dim == 0 ? row / s.rows : col / s.cols, i = dim == 0 ? row % s.rows : row,
                           j = dim == 0 ? col : col % s.cols;
              return double(to_float(t, inputs[r].data() + (i * s.cols + j) * es));
            });
            for_each_local(c, [&](Rank& r, int i) {
              const std::string err = compare(t, download(c, i, out.ptr[i], in_bytes * W), ref, true);
              WEFT_EXPECT(err.empty(), "all_gather " << dtype_name(t) << " [" << s.rows << "," << s.cols
                                                     << "] dim " << dim << (sym ? " symmetric" : " device")
                                                     << (in_place ? " in-place" : "") << " rank " << r.rank()
                                                     << ": " << err);
            });
            c.host_barrier();
            ++seed;
          }
}

WEFT_GPU_TEST(reduce_scatter_both_dims) {
  Communicator& c = ctx.comm();
  const int W = c.world();
  std::vector<Shape2D> shapes = {{1, 1}, {3, 5}, {64, 128}, {1000, 77}, {513, 1024}, {1 << 20, 1}};
  if (ctx.quick) shapes = {{3, 5}, {64, 128}, {1000, 77}};
  uint64_t seed = 300;
  for (DType t : kTypes)
    for (Shape2D s : shapes)
      for (int dim : {0, 1})
        for (bool sym : {true, false})
          for (bool in_place : {false, true}) {
            if (in_place && dim == 1) continue;
            const uint64_t es = dtype_size(t), out_bytes = s.count() * es;
            RankBuffers in(c, out_bytes * W, sym), out(c, out_bytes, sym);
            const Shape2D in_shape = dim == 0 ? Shape2D{s.rows * W, s.cols} : Shape2D{s.rows, s.cols * W};
            std::vector<std::vector<char>> inputs;
            for (int r = 0; r < W; ++r) inputs.push_back(make_input(t, in_shape.count(), r, seed));
            for_each_local(c, [&](Rank& r, int i) {
              upload(c, i, in.ptr[i], inputs[r.rank()]);
              if (!in_place) poison(c, i, out.ptr[i], out_bytes);
            });
            c.host_barrier();
            for_each_local(c, [&](Rank& r, int i) {
              char* o = in_place ? in.ptr[i] + r.rank() * out_bytes : out.ptr[i];
              keeping_plan(c, reduce_scatter_plan(c, r, in.ptr[i], o, s, dim, t),
                           [&] { reduce_scatter(c, r, in.ptr[i], o, s, dim, t); });
            });
            c.synchronize();
            for_each_local(c, [&](Rank& r, int i) {
              const std::vector<double> ref = reference(s.count(), [&](size_t e) {
                const size_t a = e / s.cols, b = e % s.cols;
                const size_t src =
                    dim == 0 ? (r.rank() * s.rows + a) * s.cols + b : a * s.cols * W + r.rank() * s.cols + b;
                double sum = 0;
                for (int q = 0; q < W; ++q) sum += to_float(t, inputs[q].data() + src * es);
                return sum;
              });
              const char* o = in_place ? in.ptr[i] + r.rank() * out_bytes : out.ptr[i];
              const std::string err = compare(t, download(c, i, o, out_bytes), ref, false, W);
              WEFT_EXPECT(err.empty(), "reduce_scatter "
                                           << dtype_name(t) << " [" << s.rows << "," << s.cols << "] dim "
                                           << dim << (sym ? " symmetric" : " device")
                                           << (in_place ? " in-place" : "") << " rank " << r.rank() << ": "
                                           << err);
            });
            c.host_barrier();
            ++seed;
          }
}

WEFT_GPU_TEST(all_to_all_equal_splits) {
  Communicator& c = ctx.comm();
  const int W = c.world();
  // Parts of up to 64 KiB of whole 4-byte words go in one LL round, the rest (odd bf16 counts, larger
  // parts) through the exchange: 16384 fp32 elements are the LL round's largest part.
  std::vector<size_t> counts = {1, 5, 1000, 16384, 65536 + 1, 1 << 20};
  if (ctx.quick) counts = {1, 5, 1000, 16384};
  uint64_t seed = 400;
  for (DType t : kTypes)
    for (size_t n : counts)
      for (bool sym : {true, false})
        for (bool in_place : {false, true}) {
          const uint64_t es = dtype_size(t), bytes = n * es * W;
          RankBuffers in(c, bytes, sym), out(c, bytes, sym);
          std::vector<std::vector<char>> inputs;
          for (int r = 0; r < W; ++r) inputs.push_back(make_input(t, n * W, r, seed));
          for_each_local(c, [&](Rank& r, int i) {
            upload(c, i, in.ptr[i], inputs[r.rank()]);
            if (!in_place) poison(c, i, out.ptr[i], bytes);
          });
          c.host_barrier();
          for_each_local(c, [&](Rank& r, int i) {
            void* dst = in_place ? in.ptr[i] : out.ptr[i];
            keeping_plan(c, all_to_all_plan(c, r, in.ptr[i], dst, n, t),
                         [&] { all_to_all(c, r, in.ptr[i], dst, n, t); });
          });
          c.synchronize();
          for_each_local(c, [&](Rank& r, int i) {
            const std::vector<double> ref = reference(n * W, [&](size_t e) {
              return double(to_float(t, inputs[e / n].data() + (r.rank() * n + e % n) * es));
            });
            const std::string err =
                compare(t, download(c, i, in_place ? in.ptr[i] : out.ptr[i], bytes), ref, true);
            WEFT_EXPECT(err.empty(), "all_to_all " << dtype_name(t) << " " << n << " per rank"
                                                   << (sym ? " symmetric" : " device")
                                                   << (in_place ? " in-place" : "") << " rank " << r.rank()
                                                   << ": " << err);
          });
          c.host_barrier();
          ++seed;
        }
}

// broadcast, scatter, gather, reduce: every root, odd and large sizes, symmetric and device buffers, in place
// at the root; the outputs poisoned first and compared with the host (exact copies; reduce in fp64).
enum class Rooted { kBroadcast, kScatter, kGather, kReduce };
const char* rooted_name(Rooted k) {
  return k == Rooted::kBroadcast ? "broadcast"
         : k == Rooted::kScatter ? "scatter"
         : k == Rooted::kGather  ? "gather"
                                 : "reduce";
}
void rooted_case(TestContext& ctx, Rooted kind, DType t, size_t n, int root, bool sym, bool in_place,
                 uint64_t seed) {
  Communicator& c = ctx.comm();
  const int W = c.world();
  const uint64_t es = dtype_size(t), part = n * es, all = part * W;
  // in: the root's W parts (scatter), else one part; out: the root's W parts (gather), else one part.
  const uint64_t in_bytes = kind == Rooted::kScatter ? all : part,
                 out_bytes = kind == Rooted::kGather ? all : part;
  RankBuffers in(c, in_bytes, sym), out(c, out_bytes, sym);
  std::vector<std::vector<char>> inputs;
  for (int r = 0; r < W; ++r) inputs.push_back(make_input(t, in_bytes / es, r, seed));
  // In place: the root's data already sits in its out (broadcast, reduce: in == out; scatter: out is part
  // `root` of in; gather: in is part `root` of out).
  const auto in_of = [&](int i, int r) -> char* {
    if (!in_place || r != root) return in.ptr[i];
    return kind == Rooted::kGather    ? out.ptr[i] + root * part
           : kind == Rooted::kScatter ? in.ptr[i]
                                      : out.ptr[i];
  };
  const auto out_of = [&](int i, int r) -> char* {
    return in_place && r == root && kind == Rooted::kScatter ? in.ptr[i] + root * part : out.ptr[i];
  };
  // Poisoned on the rank streams, then uploaded (legacy stream) once the poison is done: in place, the
  // upload lands in the poisoned buffer.
  for_each_local(c, [&](Rank&, int i) { poison(c, i, out.ptr[i], out_bytes); });
  c.synchronize();
  for_each_local(c, [&](Rank& r, int i) { upload(c, i, in_of(i, r.rank()), inputs[r.rank()]); });
  c.host_barrier();
  for_each_local(c, [&](Rank& r, int i) {
    void* src = in_of(i, r.rank());
    void* dst = out_of(i, r.rank());
    switch (kind) {
      case Rooted::kBroadcast:
        keeping_plan(c, broadcast_plan(c, r, src, dst, n, t, root),
                     [&] { broadcast(c, r, src, dst, n, t, root); });
        break;
      case Rooted::kScatter:
        keeping_plan(c, scatter_plan(c, r, src, dst, n, t, root),
                     [&] { scatter(c, r, src, dst, n, t, root); });
        break;
      case Rooted::kGather:
        keeping_plan(c, gather_plan(c, r, src, dst, n, t, root), [&] { gather(c, r, src, dst, n, t, root); });
        break;
      case Rooted::kReduce:
        keeping_plan(c, reduce_plan(c, r, src, dst, n, t, ReduceOp::kSum, root),
                     [&] { reduce(c, r, src, dst, n, t, ReduceOp::kSum, root); });
        break;
    }
  });
  c.synchronize();
  for_each_local(c, [&](Rank& r, int i) {
    const bool receives = kind == Rooted::kBroadcast || kind == Rooted::kScatter || r.rank() == root;
    if (!receives) return;
    const std::vector<double> ref = reference(out_bytes / es, [&](size_t k) {
      if (kind == Rooted::kBroadcast) return double(to_float(t, inputs[root].data() + k * es));
      if (kind == Rooted::kScatter) return double(to_float(t, inputs[root].data() + (r.rank() * n + k) * es));
      if (kind == Rooted::kGather) return double(to_float(t, inputs[k / n].data() + (k % n) * es));
      double sum = 0;  // reduce
      for (int q = 0; q < W; ++q) sum += to_float(t, inputs[q].data() + k * es);
      return sum;
    });
    const char* got = kind == Rooted::kScatter ? out_of(i, r.rank()) : out.ptr[i];
    const std::string err = compare(t, download(c, i, got, out_bytes), ref, kind != Rooted::kReduce, W);
    WEFT_EXPECT(err.empty(), rooted_name(kind)
                                 << " " << dtype_name(t) << " " << n << " root " << root
                                 << (sym ? " symmetric" : " device") << (in_place ? " in-place" : "")
                                 << " rank " << r.rank() << ": " << err);
  });
  c.host_barrier();
}

WEFT_GPU_TEST(rooted_collectives_match_reference) {
  Communicator& c = ctx.comm();
  const int W = c.world();
  // (1 << 20) + 5 fp32 and (1 << 21) + 5 take broadcast's forwarded kernel (from 4 MiB at W >= 3), with a
  // short last 16-byte unit; (1 << 19) + 24 and 1 << 20 reduce's owned kernel (from 1 MiB in whole 16-byte
  // units at W <= 8), its last part short.
  std::vector<size_t> counts = {1, 7, 4096 + 3, (1 << 19) + 24, 1 << 20, (1 << 21) + 5};
  if (ctx.quick) counts = {1, 7, 4096 + 3, (1 << 19) + 24, (1 << 20) + 5};
  uint64_t seed = 900;
  for (Rooted kind : {Rooted::kBroadcast, Rooted::kScatter, Rooted::kGather, Rooted::kReduce})
    for (DType t : kTypes)
      for (size_t n : counts)
        for (int root : {0, W - 1})
          for (bool sym : {true, false})
            for (bool in_place : {false, true}) {
              if (ctx.quick && (t == DType::kFP16 || (sym && in_place))) continue;
              rooted_case(ctx, kind, t, n, root, sym, in_place, seed++);
            }
  // Back to back without a host wait: large broadcasts from changing roots into device outs, each landing
  // in the same workspace (the forwarded kernel at W >= 3), then checked together.
  {
    const size_t n = (1 << 20) + 5;
    const DType t = DType::kFP32;
    constexpr int kReps = 3;
    std::vector<std::unique_ptr<RankBuffers>> outs;
    RankBuffers in(c, n * 4, false);
    std::vector<std::vector<char>> inputs;
    for (int r = 0; r < W; ++r) inputs.push_back(make_input(t, n, r, 2000));
    for_each_local(c, [&](Rank& r, int i) { upload(c, i, in.ptr[i], inputs[r.rank()]); });
    for (int rep = 0; rep < kReps; ++rep) {
      outs.push_back(std::make_unique<RankBuffers>(c, n * 4, false));
      for_each_local(c, [&](Rank&, int i) { poison(c, i, outs.back()->ptr[i], n * 4); });
    }
    c.synchronize();
    c.host_barrier();
    for (int rep = 0; rep < kReps; ++rep)
      for_each_local(c,
                     [&](Rank& r, int i) { broadcast(c, r, in.ptr[i], outs[rep]->ptr[i], n, t, rep % W); });
    c.synchronize();
    for (int rep = 0; rep < kReps; ++rep)
      for_each_local(c, [&](Rank& r, int i) {
        const std::vector<double> ref =
            reference(n, [&](size_t k) { return double(to_float(t, inputs[rep % W].data() + k * 4)); });
        const std::string err = compare(t, download(c, i, outs[rep]->ptr[i], n * 4), ref, true, W);
        WEFT_EXPECT(err.empty(), "broadcast back to back, call " << rep << " root " << rep % W << " rank "
                                                                 << r.rank() << ": " << err);
      });
    c.host_barrier();
  }
  // reduce's owned kernel with every rank's buffers at its own alignment (the path must not depend on it):
  // odd ranks' in 2 bytes past a 16-byte boundary (copied to alignment first), the root's out shifted in
  // calls 2 and 3 (written after the kernel), so that the root meets each mix of aligned and shifted in and
  // out; back to back from changing roots without a host wait, call 3 a max, checked together.
  {
    const size_t n = (1 << 19) + 24;
    const DType t = DType::kBF16;
    constexpr int kReps = 4;
    RankBuffers in(c, n * 2 + 16, false);
    std::vector<std::unique_ptr<RankBuffers>> outs;
    std::vector<std::vector<char>> inputs;
    const auto in_shift = [](int rank) { return rank % 2 ? 2 : 0; };
    const auto out_shift = [](int rep) { return rep / 2 % 2 ? 2 : 0; };
    const auto op_of = [](int rep) { return rep == 3 ? ReduceOp::kMax : ReduceOp::kSum; };
    for (int r = 0; r < W; ++r) inputs.push_back(make_input(t, n, r, 2100));
    for_each_local(c,
                   [&](Rank& r, int i) { upload(c, i, in.ptr[i] + in_shift(r.rank()), inputs[r.rank()]); });
    for (int rep = 0; rep < kReps; ++rep) {
      outs.push_back(std::make_unique<RankBuffers>(c, n * 2 + 16, false));
      for_each_local(c, [&](Rank&, int i) { poison(c, i, outs.back()->ptr[i], n * 2 + 16); });
    }
    c.synchronize();
    c.host_barrier();
    for (int rep = 0; rep < kReps; ++rep)
      for_each_local(c, [&](Rank& r, int i) {
        reduce(c, r, in.ptr[i] + in_shift(r.rank()), outs[rep]->ptr[i] + out_shift(rep), n, t, op_of(rep),
               rep % W);
      });
    c.synchronize();
    for (int rep = 0; rep < kReps; ++rep)
      for_each_local(c, [&](Rank& r, int i) {
        if (r.rank() != rep % W) return;
        const std::vector<double> ref = reference(n, [&](size_t k) {
          double v = to_float(t, inputs[0].data() + k * 2);
          for (int q = 1; q < W; ++q) {
            const double x = to_float(t, inputs[q].data() + k * 2);
            v = op_of(rep) == ReduceOp::kMax ? std::max(v, x) : v + x;
          }
          return v;
        });
        const std::string err = compare(t, download(c, i, outs[rep]->ptr[i] + out_shift(rep), n * 2), ref,
                                        op_of(rep) == ReduceOp::kMax, W);
        WEFT_EXPECT(err.empty(), "reduce at mixed alignments, call "
                                     << rep << " root " << rep % W << " in shifted " << in_shift(rep % W)
                                     << " out shifted " << out_shift(rep) << ": " << err);
      });
    c.host_barrier();
  }
  // Back to back without a host wait, checked together at the end: broadcast, scatter and gather from
  // changing roots, of changing sizes (so changing kernels and grids: the LL round up to one_shot_max_bytes,
  // the per-chunk tags of up to 8 ranks above it), into symmetric and device outs; each rank's buffers
  // `shift(rank)` bytes past their start (the kernels must not depend on a rank's alignment).
  struct Step {
    Rooted kind;
    size_t n;
    int root;
    bool sym;
  };
  const auto back_to_back = [&](DType t, const std::vector<Step>& steps, auto shift) {
    const uint64_t es = dtype_size(t);
    std::vector<std::unique_ptr<RankBuffers>> ins, outs;
    std::vector<std::vector<std::vector<char>>> inputs(steps.size());
    const auto elems = [&](const Step& st, bool in) {
      return st.kind == (in ? Rooted::kScatter : Rooted::kGather) ? st.n * W : st.n;
    };
    for (size_t k = 0; k < steps.size(); ++k) {
      const Step& st = steps[k];
      ins.push_back(std::make_unique<RankBuffers>(c, elems(st, true) * es + 16, st.sym));
      outs.push_back(std::make_unique<RankBuffers>(c, elems(st, false) * es + 16, st.sym));
      for (int q = 0; q < W; ++q) inputs[k].push_back(make_input(t, elems(st, true), q, 3000 + k));
      for_each_local(c, [&](Rank& rk, int i) {
        upload(c, i, ins[k]->ptr[i] + shift(rk.rank()), inputs[k][rk.rank()]);
        poison(c, i, outs[k]->ptr[i], elems(st, false) * es + 16);
      });
    }
    c.synchronize();
    c.host_barrier();
    for (size_t k = 0; k < steps.size(); ++k)
      for_each_local(c, [&](Rank& rk, int i) {
        const Step& st = steps[k];
        void* in = ins[k]->ptr[i] + shift(rk.rank());
        void* out = outs[k]->ptr[i] + shift(rk.rank());
        if (st.kind == Rooted::kBroadcast) broadcast(c, rk, in, out, st.n, t, st.root);
        if (st.kind == Rooted::kScatter) scatter(c, rk, in, out, st.n, t, st.root);
        if (st.kind == Rooted::kGather) gather(c, rk, in, out, st.n, t, st.root);
      });
    c.synchronize();
    for (size_t k = 0; k < steps.size(); ++k)
      for_each_local(c, [&](Rank& rk, int i) {
        const Step& st = steps[k];
        if (st.kind == Rooted::kGather && rk.rank() != st.root) return;
        const std::vector<double> ref = reference(elems(st, false), [&](size_t e) {
          if (st.kind == Rooted::kBroadcast) return double(to_float(t, inputs[k][st.root].data() + e * es));
          if (st.kind == Rooted::kScatter)
            return double(to_float(t, inputs[k][st.root].data() + (rk.rank() * st.n + e) * es));
          return double(to_float(t, inputs[k][e / st.n].data() + (e % st.n) * es));
        });
        const std::string err = compare(
            t, download(c, i, outs[k]->ptr[i] + shift(rk.rank()), elems(st, false) * es), ref, true, W);
        WEFT_EXPECT(err.empty(), rooted_name(st.kind)
                                     << " back to back, " << dtype_name(t) << " call " << k << " root "
                                     << st.root << (st.sym ? " symmetric" : " device") << " shifted "
                                     << shift(rk.rank()) << " rank " << rk.rank() << ": " << err);
      });
    c.host_barrier();
  };
  back_to_back(DType::kFP32,
               {{Rooted::kBroadcast, 1000, 0, true},
                {Rooted::kScatter, 70000, W - 1, false},
                {Rooted::kGather, 3, 1 % W, true},
                {Rooted::kBroadcast, 300001, W - 1, false},
                {Rooted::kGather, 50000, 0, false},
                {Rooted::kScatter, 5, 1 % W, true},
                {Rooted::kBroadcast, 200000, 1 % W, true},
                {Rooted::kGather, 9, W - 1, false},
                {Rooted::kBroadcast, 1, 0, false},
                {Rooted::kScatter, 333, 0, true},
                {Rooted::kBroadcast, 4097, W - 1, true},
                {Rooted::kGather, 64, 1 % W, false},
                {Rooted::kScatter, 2, W - 1, false},
                {Rooted::kBroadcast, 777, 1 % W, false}},
               [](int) { return 0; });
  // 16-bit elements at odd ranks' buffers 2 bytes past a 4-byte boundary, odd counts (a half-used last word);
  // device buffers only (a symmetric buffer lies at the same offset on every rank).
  back_to_back(DType::kBF16,
               {{Rooted::kBroadcast, 1001, W - 1, false},
                {Rooted::kGather, 7, 0, false},
                {Rooted::kScatter, 4099, 1 % W, false},
                {Rooted::kBroadcast, 33, 0, false},
                {Rooted::kGather, 20001, W - 1, false},
                {Rooted::kScatter, 1, 0, false},
                {Rooted::kBroadcast, 150001, 1 % W, false}},
               [](int rank) { return rank % 2 ? 2 : 0; });
  // Arguments: a root outside the team is refused by name.
  Rank& r = c.local(0);
  RankBuffers b(c, 64, true);
  WEFT_EXPECT_ERROR(broadcast(c, r, b.ptr[0], b.ptr[0], 4, DType::kFP32, W), "is not a rank of this team");
  WEFT_EXPECT_ERROR(gather(c, r, b.ptr[0], b.ptr[0], 4, DType::kFP32, -1), "is not a rank of this team");
  // A root's in and out that overlap without being equal (refused before anything is queued).
  WEFT_EXPECT_ERROR(reduce(c, r, b.ptr[0], b.ptr[0] + 4, 4, DType::kFP32, ReduceOp::kSum, r.rank()),
                    "overlap without being equal");
}

// all_to_all_v: random split sizes (zeros included) with the counts on the device, symmetric and device
// outs; out and recv_counts against the host's routing of every rank's input (exact).
WEFT_GPU_TEST(all_to_all_v_matches_reference) {
  Communicator& c = ctx.comm();
  const int W = c.world();
  std::vector<size_t> most = {1, 9, 5000, 300000};
  if (ctx.quick) most = {1, 9, 5000};
  uint64_t seed = 1300;
  for (DType t : kTypes)
    for (size_t hi : most)
      for (bool sym : {true, false}) {
        const uint64_t re = hi == 9 ? 24 : 1, es = dtype_size(t) * re;  // rows of re elements (tokens)
        // counts[s][q]: the rows rank s sends rank q, about one in five of them zero.
        std::mt19937_64 rng(seed);
        std::vector<std::vector<int64_t>> counts(W, std::vector<int64_t>(W));
        for (int s = 0; s < W; ++s)
          for (int q = 0; q < W; ++q) counts[s][q] = rng() % 5 == 0 ? 0 : int64_t(rng() % (hi + 1));
        size_t in_cap = 1, out_cap = 1;
        for (int s = 0; s < W; ++s) {
          size_t row = 0, col = 0;
          for (int q = 0; q < W; ++q) row += counts[s][q], col += counts[q][s];
          in_cap = std::max(in_cap, row + 3);
          out_cap = std::max(out_cap, col + 5);
        }
        RankBuffers in(c, in_cap * es, sym), out(c, out_cap * es, sym), cnt(c, 2 * W * 8, false);
        std::vector<std::vector<char>> inputs;
        for (int r = 0; r < W; ++r) inputs.push_back(make_input(t, in_cap * re, r, seed));
        for_each_local(c, [&](Rank& r, int i) {
          upload(c, i, in.ptr[i], inputs[r.rank()]);
          poison(c, i, out.ptr[i], out_cap * es);
          std::vector<char> send(W * 8);
          std::memcpy(send.data(), counts[r.rank()].data(), W * 8);
          upload(c, i, cnt.ptr[i], send);
          poison(c, i, cnt.ptr[i] + W * 8, W * 8);
        });
        c.host_barrier();
        for_each_local(c, [&](Rank& r, int i) {
          const auto* sc = reinterpret_cast<const int64_t*>(cnt.ptr[i]);
          auto* rc = reinterpret_cast<int64_t*>(cnt.ptr[i] + W * 8);
          keeping_plan(c, all_to_all_v_plan(c, r, in.ptr[i], sc, in_cap, out.ptr[i], rc, out_cap, re, t),
                       [&] { all_to_all_v(c, r, in.ptr[i], sc, in_cap, out.ptr[i], rc, out_cap, re, t); });
        });
        c.synchronize();
        for_each_local(c, [&](Rank& r, int i) {
          const int me = r.rank();
          std::vector<double> ref;
          std::vector<int64_t> want_counts(W);
          for (int s = 0; s < W; ++s) {
            size_t at = 0;
            for (int q = 0; q < me; ++q) at += counts[s][q];
            for (uint64_t k = 0; k < uint64_t(counts[s][me]) * re; ++k)
              ref.push_back(to_float(t, inputs[s].data() + (at * re + k) * dtype_size(t)));
            want_counts[s] = counts[s][me];
          }
          std::vector<char> got_counts = download(c, i, cnt.ptr[i] + W * 8, W * 8);
          WEFT_EXPECT(std::memcmp(got_counts.data(), want_counts.data(), W * 8) == 0,
                      "all_to_all_v recv_counts wrong at rank " << me);
          const std::string err =
              ref.empty() ? std::string()
                          : compare(t, download(c, i, out.ptr[i], ref.size() * dtype_size(t)), ref, true);
          WEFT_EXPECT(err.empty(), "all_to_all_v " << dtype_name(t) << " up to " << hi << " rows of " << re
                                                   << " per part" << (sym ? " symmetric" : " device")
                                                   << " rank " << me << ": " << err);
        });
        c.host_barrier();
        ++seed;
      }
}

WEFT_GPU_TEST(collectives_replay_in_cuda_graphs) {
  Communicator& c = ctx.comm();
  const int W = c.world();
  const size_t n = 300001;
  const DType t = DType::kBF16;
  const uint64_t bytes = n * 2;
  RankBuffers in(c, bytes, true), out(c, bytes, true), gathered(c, bytes * W, true);
  // Size the workspace from the calls' plans outside capture, then capture one all-reduce + all-gather per
  // rank.
  for_each_local(c, [&](Rank& r, int i) {
    for (const Plan& p : {all_reduce_plan(c, r, in.ptr[i], out.ptr[i], n, t),
                          all_gather_plan(c, r, in.ptr[i], gathered.ptr[i], Shape2D{n, 1}, 0, t)})
      for (const auto& [area, bytes] : p.workspace) c.reserve_workspace(bytes, area);
  });
  c.synchronize();
  std::vector<cudaGraphExec_t> exec(c.num_local());
  for_each_local(c, [&](Rank& r, int i) {
    WEFT_CUDA_CHECK(cudaSetDevice(r.device()));
    cudaGraph_t g;
    WEFT_CUDA_CHECK(cudaStreamBeginCapture(r.stream(), cudaStreamCaptureModeThreadLocal));
    all_reduce(c, r, in.ptr[i], out.ptr[i], n, t);
    all_gather(c, r, in.ptr[i], gathered.ptr[i], Shape2D{n, 1}, 0, t);
    WEFT_CUDA_CHECK(cudaStreamEndCapture(r.stream(), &g));
    WEFT_CUDA_CHECK(cudaGraphInstantiate(&exec[i], g, 0));
    WEFT_CUDA_CHECK(cudaGraphDestroy(g));
  });
  for (int replay = 0; replay < 3; ++replay) {
    const uint64_t seed = 500 + replay;
    for_each_local(c, [&](Rank& r, int i) {
      upload(c, i, in.ptr[i], make_input(t, n, r.rank(), seed));
      poison(c, i, out.ptr[i], bytes);
      poison(c, i, gathered.ptr[i], bytes * W);
    });
    c.host_barrier();
    for_each_local(c, [&](Rank& r, int i) {
      WEFT_CUDA_CHECK(cudaSetDevice(r.device()));
      WEFT_CUDA_CHECK(cudaGraphLaunch(exec[i], r.stream()));
    });
    c.synchronize();
    std::vector<double> sum(n, 0.0), cat(n * W);
    for (int q = 0; q < W; ++q) {
      auto x = make_input(t, n, q, seed);
      for (size_t k = 0; k < n; ++k) {
        sum[k] += to_float(t, x.data() + k * 2);
        cat[q * n + k] = to_float(t, x.data() + k * 2);
      }
    }
    for_each_local(c, [&](Rank& r, int i) {
      std::string err = compare(t, download(c, i, out.ptr[i], bytes), sum, false, W);
      WEFT_EXPECT(err.empty(), "graph replay " << replay << " all_reduce rank " << r.rank() << ": " << err);
      err = compare(t, download(c, i, gathered.ptr[i], bytes * W), cat, true);
      WEFT_EXPECT(err.empty(), "graph replay " << replay << " all_gather rank " << r.rank() << ": " << err);
    });
    c.host_barrier();
  }
  for (auto& e : exec) cudaGraphExecDestroy(e);
}

WEFT_GPU_TEST(collective_argument_errors) {
  Communicator& c = ctx.comm();
  Rank& r = c.local(0);
  SymmetricBuffer b = c.alloc(16 << 20);
  auto error_of = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const Error& e) {
      return e.what();
    }
    return "<no error>";
  };
  char* p = b.local[0];
  std::string e = error_of([&] { all_reduce(c, r, p + 2, p + 4096, 100, DType::kBF16); });
  WEFT_EXPECT(e.find("16-byte aligned") != std::string::npos, e);
  e = error_of([&] { all_gather(c, r, p + 1, p + 65536, Shape2D{10, 10}, 0, DType::kBF16); });
  WEFT_EXPECT(e.find("2-byte aligned") != std::string::npos, e);
  e = error_of([&] { all_gather(c, r, p, p + 65536, Shape2D{10, 10}, 2, DType::kFP32); });
  WEFT_EXPECT(e.find("dim must be 0 or 1") != std::string::npos, e);
  static float host_buffer[64];
  e = error_of([&] { all_reduce(c, r, host_buffer, p, 16, DType::kFP32); });
  WEFT_EXPECT(e.find("not device memory") != std::string::npos, e);
  e = error_of([&] { all_reduce(c, r, p, p + 64, 1000, DType::kFP32); });
  WEFT_EXPECT(e.find("overlap") != std::string::npos, e);
  e = error_of([&] {
    all_reduce(c, r, p, p + (8 << 20), 1 << 20, DType::kFP32, ReduceOp::kSum, nullptr,
               AllReduceAlgo::kOneShot);
  });
  WEFT_EXPECT(e.find("one-shot all-reduce is limited") != std::string::npos, e);
  c.free(b);
}

// Sub-teams (Communicator::subteam): every split of the team into sub-teams of 2 .. W / 2 ranks, 1 or more
// apart, all-reducing integer-valued fp32 (exact sums) over each sub-team, one-shot and two-shot sizes,
// with whole-team all-reduces interleaved and no host synchronization between calls: each split's
// meetings, flags and staging are its own, so neither a split nor the whole team reads another's.
WEFT_GPU_TEST(subteam_all_reduce_matches_reference) {
  Communicator& c = ctx.comm();
  const int W = c.world();
  std::vector<std::pair<int, int>> splits;  // (size, stride)
  for (int size = 2; size < W; ++size)
    for (int stride = 1; size * stride <= W; ++stride)
      if (W % (size * stride) == 0) splits.push_back({size, stride});
  if (splits.empty()) WEFT_SKIP("no sub-team of 2 .. W - 1 ranks tiles a team of " + std::to_string(W));
  const size_t counts[] = {1000, size_t(ctx.quick ? 1 << 16 : (1 << 20) + 5)};
  auto value = [](int r, size_t i, int call) {
    return float(int((r * 131 + i * 7 + call * 13) % 201) - 100);
  };
  struct Call {
    int size, stride;  // size W: the whole team
    size_t n;
  };
  std::vector<Call> calls;
  for (auto [size, stride] : splits)
    for (size_t n : counts) {
      calls.push_back({size, stride, n});
      calls.push_back({W, 1, n});
    }
  std::vector<std::vector<std::unique_ptr<DeviceBuffer>>> in(c.num_local()), out(c.num_local());
  for (int i = 0; i < c.num_local(); ++i) {
    const int r = c.local(i).rank();
    WEFT_CUDA_CHECK(cudaSetDevice(c.local(i).device()));
    for (size_t k = 0; k < calls.size(); ++k) {
      std::vector<float> v(calls[k].n);
      for (size_t e = 0; e < v.size(); ++e) v[e] = value(r, e, int(k));
      in[i].push_back(std::make_unique<DeviceBuffer>(v.size() * 4));
      out[i].push_back(std::make_unique<DeviceBuffer>(v.size() * 4));
      weft::test::upload(c, i, in[i].back()->p, v.data(), v.size() * 4);
      poison(c, i, out[i].back()->p, v.size() * 4);
    }
  }
  c.host_barrier();
  for (size_t k = 0; k < calls.size(); ++k)
    for (int i = 0; i < c.num_local(); ++i) {
      Rank& rank = c.subteam(c.local(i), calls[k].size, calls[k].stride);
      WEFT_EXPECT(rank.world() == calls[k].size, "a sub-team's world size");
      WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
      all_reduce(c, rank, in[i][k]->p, out[i][k]->p, calls[k].n, DType::kFP32);
    }
  c.synchronize();
  for (int i = 0; i < c.num_local(); ++i) {
    const int r = c.local(i).rank();
    for (size_t k = 0; k < calls.size(); ++k) {
      const int size = calls[k].size, stride = calls[k].stride, block = size * stride;
      const int first = r / block * block + r % stride;
      std::vector<float> got(calls[k].n);
      weft::test::download(c, i, got.data(), out[i][k]->p, got.size() * 4);
      size_t bad = 0;
      for (size_t e = 0; e < got.size(); ++e) {
        float want = 0;
        for (int m = 0; m < size; ++m) want += value(first + m * stride, e, int(k));
        bad += !(got[e] == want);
      }
      WEFT_EXPECT(bad == 0, "rank " + std::to_string(r) + ", sub-teams of " + std::to_string(size) +
                                " stride " + std::to_string(stride) + ", " + std::to_string(calls[k].n) +
                                " values: " + std::to_string(bad) + " differ from the sub-team's sum");
    }
  }
}
