#include "cublas_gemm.hpp"

#include <cublasLt.h>
#include <cublas_v2.h>

#include <array>
#include <climits>
#include <map>
#include <mutex>
#include <set>

#include "weft/runtime/error.hpp"

namespace weft::ops {
namespace {

constexpr int kMaxDevices = 64;
constexpr size_t kWorkspaceBytes = 32 << 20;  // cuBLAS's recommendation for Hopper

// Per-device handle with a workspace of ours: cuBLAS then allocates nothing inside a graph capture. Never
// destroyed: a static destructor at exit may run after the CUDA context is gone.
cublasHandle_t handle_for(int device, bool capturing, const std::string& where) {
  static std::mutex mu;
  static cublasHandle_t handles[kMaxDevices] = {};
  WEFT_CHECK(device >= 0 && device < kMaxDevices,
             where + "device index out of range for the cuBLAS fallback");
  std::lock_guard<std::mutex> lock(mu);
  if (handles[device]) return handles[device];
  WEFT_CHECK(!capturing,
             where +
                 "the first sequential-path call on a GPU creates its cuBLAS handle, which a CUDA "
                 "graph capture does not allow: make one call before capturing");
  cublasHandle_t h = nullptr;
  WEFT_CHECK(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS, where + "cublasCreate failed");
  void* ws = nullptr;
  WEFT_CUDA_CHECK(cudaMalloc(&ws, kWorkspaceBytes));
  WEFT_CHECK(cublasSetWorkspace(h, ws, kWorkspaceBytes) == CUBLAS_STATUS_SUCCESS,
             where + "cublasSetWorkspace failed");
  handles[device] = h;
  return h;
}

// The largest power of two up to 256 dividing the address: cublasLt's heuristic must not pick a kernel that
// needs more alignment than the operands have.
uint32_t alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t v = 256;
  while (v > 2 && a % v != 0) v /= 2;
  return v;
}

// cublasLt for out = a . b + addend: one handle and workspace per device, made on the device's first call
// (which allocates, so not under capture); one plan (descriptors and the heuristic's algorithm) per shape and
// operand alignment, made on first use (host work only, so also under capture).
struct LtPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
};
struct LtDevice {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::map<std::array<int64_t, 5>, LtPlan> plans;  // (m, n, k, layout, alignments)
};

// Row-major C [M,N] = A . B is column-major C^T [N,M] = B^T . A^T (as in cublas_gemm_bf16 below): cuBLAS's
// "A" is our b, its "B" our a.
const LtPlan& lt_plan(LtDevice& d, const void* a, const void* b, const void* addend, const void* out,
                      int64_t m, int64_t n, int64_t k, BLayout layout, const std::string& where) {
  const bool weight = layout == BLayout::kNK;
  const uint32_t al[4] = {alignment(b), alignment(a), alignment(addend), alignment(out)};
  const std::array<int64_t, 5> key = {m, n, k, weight ? 1 : 0,
                                      int64_t(al[0]) << 27 | int64_t(al[1]) << 18 | al[2] << 9 | al[3]};
  if (auto it = d.plans.find(key); it != d.plans.end()) return it->second;
  auto ok = [&](cublasStatus_t st, const char* what) {
    WEFT_CHECK(st == CUBLAS_STATUS_SUCCESS,
               where + what + " failed (cuBLAS status " + std::to_string(int(st)) + ")");
  };
  LtPlan p;
  ok(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  const cublasOperation_t ta = weight ? CUBLAS_OP_T : CUBLAS_OP_N;
  ok(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)), "set TRANSA");
  ok(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, weight ? k : n, weight ? n : k, weight ? k : n),
     "cublasLtMatrixLayoutCreate");
  ok(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, k, m, k), "cublasLtMatrixLayoutCreate");
  ok(cublasLtMatrixLayoutCreate(&p.c, CUDA_R_16BF, n, m, n), "cublasLtMatrixLayoutCreate");
  cublasLtMatmulPreference_t pref = nullptr;
  ok(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
  const uint64_t ws = kWorkspaceBytes;
  ok(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)),
     "set workspace");
  const cublasLtMatmulPreferenceAttributes_t align_attr[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i)
    ok(cublasLtMatmulPreferenceSetAttribute(pref, align_attr[i], &al[i], sizeof(al[i])), "set alignment");
  cublasLtMatmulHeuristicResult_t res{};
  int found = 0;
  ok(cublasLtMatmulAlgoGetHeuristic(d.handle, p.op, p.a, p.b, p.c, p.c, pref, 1, &res, &found),
     "cublasLtMatmulAlgoGetHeuristic");
  cublasLtMatmulPreferenceDestroy(pref);
  WEFT_CHECK(found > 0, where + "cublasLt has no algorithm for this GEMM with an addend");
  p.algo = res.algo;
  return d.plans.emplace(key, p).first->second;
}

void lt_gemm_bf16(const void* a, const void* b, const void* addend, void* out, int64_t m, int64_t n,
                  int64_t k, BLayout layout, cudaStream_t stream, bool capturing, const std::string& where) {
  static std::mutex mu;
  static LtDevice devices[kMaxDevices];
  int device = 0;
  WEFT_CUDA_CHECK(cudaGetDevice(&device));
  WEFT_CHECK(device >= 0 && device < kMaxDevices, where + "device index out of range for cublasLt");
  std::lock_guard<std::mutex> lock(mu);
  LtDevice& d = devices[device];
  if (!d.handle) {
    WEFT_CHECK(!capturing, where +
                               "the first pipelined call on a GPU creates its cublasLt handle, which a CUDA "
                               "graph capture does not allow: make one call before capturing");
    WEFT_CHECK(cublasLtCreate(&d.handle) == CUBLAS_STATUS_SUCCESS, where + "cublasLtCreate failed");
    WEFT_CUDA_CHECK(cudaMalloc(&d.workspace, kWorkspaceBytes));
  }
  const LtPlan& p = lt_plan(d, a, b, addend, out, m, n, k, layout, where);
  const float one = 1.f;
  const cublasStatus_t st = cublasLtMatmul(d.handle, p.op, &one, b, p.a, a, p.b, &one, addend, p.c, out, p.c,
                                           &p.algo, d.workspace, kWorkspaceBytes, stream);
  WEFT_CHECK(st == CUBLAS_STATUS_SUCCESS,
             where + "cublasLtMatmul failed (status " + std::to_string(int(st)) + ")");
}

}  // namespace

bool cublas_gemm_bf16(const void* a, const void* b, void* out, int64_t m, int64_t n, int64_t k,
                      BLayout layout, cudaStream_t stream, bool capturing, const std::string& where,
                      const void* addend) {
  if (m > INT_MAX || n > INT_MAX || k > INT_MAX) return false;
  if (addend) {
    lt_gemm_bf16(a, b, addend, out, m, n, k, layout, stream, capturing, where);
    return true;
  }
  int device = 0;
  WEFT_CUDA_CHECK(cudaGetDevice(&device));
  cublasHandle_t h = handle_for(device, capturing, where);
  WEFT_CHECK(cublasSetStream(h, stream) == CUBLAS_STATUS_SUCCESS, where + "cublasSetStream failed");
  // Row-major C [M,N] = A . B is column-major C^T [N,M] = B^T . A^T: B's row-major [N,K] (weight) is a
  // column-major [K,N] to transpose; B's row-major [K,N] is a column-major [N,K] as it is.
  const bool weight = layout == BLayout::kNK;
  const float one = 1.f, zero = 0.f;
  const cublasStatus_t st =
      cublasGemmEx(h, weight ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, int(n), int(m), int(k), &one, b,
                   CUDA_R_16BF, weight ? int(k) : int(n), a, CUDA_R_16BF, int(k), &zero, out, CUDA_R_16BF,
                   int(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  WEFT_CHECK(st == CUBLAS_STATUS_SUCCESS,
             where + "cublasGemmEx failed (status " + std::to_string(int(st)) + ")");
  return true;
}

void cublas_gemm_preload(const void* a, const void* b, void* out, int64_t m, int64_t n, int64_t k,
                         BLayout layout, cudaStream_t stream, bool capturing, const std::string& where,
                         const void* addend) {
  if (capturing) return;
  static std::mutex mu;
  static std::set<std::array<int64_t, 6>>
      seen;  // (device, m, n, k, layout, alignments of a, b, out, addend (none: 0))
  int device = 0;
  WEFT_CUDA_CHECK(cudaGetDevice(&device));
  const std::array<int64_t, 6> key = {device,
                                      m,
                                      n,
                                      k,
                                      layout == BLayout::kNK ? 1 : 0,
                                      int64_t(alignment(a)) | int64_t(alignment(b)) << 9 |
                                          int64_t(alignment(out)) << 18 |
                                          int64_t(addend ? alignment(addend) : 0) << 27};
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!seen.insert(key).second) return;
  }
  cublas_gemm_bf16(a, b, out, m, n, k, layout, stream, capturing, where, addend);
}

}  // namespace weft::ops
