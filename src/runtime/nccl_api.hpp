// NCCL, loaded at run time (dlopen of WEFT_NCCL_LIBRARY, else libnccl.so.2): weft needs it only for teams
// spanning nodes (the legs between nodes), so nothing else links it or needs its headers. The few types are
// declared here with NCCL 2's ABI (nccl.h: ncclUniqueId is 128 bytes passed by value, the enums are ints).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "weft/dtype.hpp"

namespace weft::nccl {

struct CommTag;
using Comm = CommTag*;  // ncclComm_t
struct UniqueId {
  char internal[128];
};
enum DataType : int { kUint8 = 1, kFloat16 = 6, kFloat32 = 7, kBfloat16 = 9 };  // ncclDataType_t
enum RedOp : int { kSum = 0, kMax = 2, kMin = 3 };                              // ncclRedOp_t
enum Status : int { kSuccess = 0, kInProgress = 7 };  // ncclResult_t: the two that are not errors

struct Api {
  int (*GetUniqueId)(UniqueId*) = nullptr;
  int (*CommInitRank)(Comm*, int, UniqueId, int) = nullptr;
  int (*CommDestroy)(Comm) = nullptr;
  int (*CommAbort)(Comm) = nullptr;
  int (*CommGetAsyncError)(Comm, int*) = nullptr;
  int (*AllReduce)(const void*, void*, size_t, int, int, Comm, cudaStream_t) = nullptr;
  int (*AllGather)(const void*, void*, size_t, int, Comm, cudaStream_t) = nullptr;
  int (*ReduceScatter)(const void*, void*, size_t, int, int, Comm, cudaStream_t) = nullptr;
  int (*Broadcast)(const void*, void*, size_t, int, int, Comm, cudaStream_t) = nullptr;
  int (*Send)(const void*, size_t, int, int, Comm, cudaStream_t) = nullptr;  // buf, count, type, peer
  int (*Recv)(void*, size_t, int, int, Comm, cudaStream_t) = nullptr;
  int (*GroupStart)() = nullptr;
  int (*GroupEnd)() = nullptr;
  const char* (*GetErrorString)(int) = nullptr;
  int (*GetVersion)(int*) = nullptr;
  int version = 0;  // NCCL_VERSION_CODE of the loaded library (e.g. 22809)
};

// Loads and resolves NCCL once (thread-safe); throws weft::Error saying what was looked for and how to point
// weft at it.
const Api& api();
// Throws weft::Error "<what>: <NCCL's message>" unless result is ncclSuccess.
void check(int result, const std::string& what);
DataType data_type(DType t);

}  // namespace weft::nccl
