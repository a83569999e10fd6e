#include "cublas_gemm.hpp"

#include <cublas_v2.h>

#include <climits>
#include <map>
#include <mutex>

#include "weft/runtime/error.hpp"
#include "weft/runtime/resources.hpp"

namespace weft::ops {
namespace {

constexpr size_t kWorkspaceBytes = 32 << 20;  // cuBLAS's recommendation for Hopper

// A handle per device and rank (virtual ranks of one GPU run GEMMs at the same time, and a handle's
// workspace serves one at a time), with a workspace of ours: cuBLAS then allocates nothing inside a graph
// capture. Never destroyed: a static destructor at exit may run after the CUDA context is gone.
cublasHandle_t handle_for(int device, int rank, bool capturing, const std::string& where) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, cublasHandle_t> handles;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = handles.find({device, rank}); it != handles.end()) return it->second;
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
  handles[{device, rank}] = h;
  return h;
}

}  // namespace

bool cublas_gemm_bf16(const void* a, const void* b, void* out, int64_t m, int64_t n, int64_t k,
                      BLayout layout, cudaStream_t stream, int rank, bool capturing, const std::string& where,
                      bool accumulate) {
  if (m > INT_MAX || n > INT_MAX || k > INT_MAX) return false;
  int device = 0;
  WEFT_CUDA_CHECK(cudaGetDevice(&device));
  cublasHandle_t h = handle_for(device, rank, capturing, where);
  WEFT_CHECK(cublasSetStream(h, stream) == CUBLAS_STATUS_SUCCESS, where + "cublasSetStream failed");
  // Row-major C [M,N] = A . B is column-major C^T [N,M] = B^T . A^T: B's row-major [N,K] (weight) is a
  // column-major [K,N] to transpose; B's row-major [K,N] is a column-major [N,K] as it is.
  const bool weight = layout == BLayout::kNK;
  const float one = 1.f, beta = accumulate ? 1.f : 0.f;
  const cublasStatus_t st =
      cublasGemmEx(h, weight ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, int(n), int(m), int(k), &one, b,
                   CUDA_R_16BF, weight ? int(k) : int(n), a, CUDA_R_16BF, int(k), &beta, out, CUDA_R_16BF,
                   int(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  WEFT_CHECK(st == CUBLAS_STATUS_SUCCESS,
             where + "cublasGemmEx failed (status " + std::to_string(int(st)) + ")");
  return true;
}

void cublas_gemm_ready(int rank, const std::string& where) {
  int device = 0;
  WEFT_CUDA_CHECK(cudaGetDevice(&device));
  handle_for(device, rank, false, where);
}

namespace {
// Every rank's handle made when a single-process team is created (ResourceRequest::ready_rank says why).
void ready_at_team_creation(int rank) {
  cublas_gemm_ready(rank, "weft: Communicator::create: ");
}
const ResourceDeclaration kHandles{{.owner = "cuBLAS handles", .ready_rank = &ready_at_team_creation}};
}  // namespace

}  // namespace weft::ops
