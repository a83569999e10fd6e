#include "nccl_api.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <vector>

#include "weft/runtime/error.hpp"

namespace weft::nccl {

const Api& api() {
  static const Api loaded = [] {
    const char* given = std::getenv("WEFT_NCCL_LIBRARY");
    const std::string name = given && *given ? given : "libnccl.so.2";
    void* lib = ::dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    // Not on the loader's path: the NCCL weft was built beside (WEFT_NCCL_HINT, where CMake found one), the
    // CUDA toolkit's.
    std::vector<std::string> elsewhere = {"libnccl.so"};
#ifdef WEFT_NCCL_HINT
    elsewhere.push_back(WEFT_NCCL_HINT);
#endif
    elsewhere.push_back("/usr/local/cuda/lib64/libnccl.so.2");
    for (size_t i = 0; lib == nullptr && !(given && *given) && i < elsewhere.size(); ++i)
      lib = ::dlopen(elsewhere[i].c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* why = ::dlerror();
      throw_error("weft: a team spanning nodes needs NCCL (the legs between nodes), and " + name +
                  " could not be loaded (" + (why ? why : "?") +
                  "): install NCCL 2, put its lib/ on LD_LIBRARY_PATH, or set WEFT_NCCL_LIBRARY to its path "
                  "(PyTorch wheels ship one in site-packages/nvidia/nccl/lib)");
    }
    Api a;
    auto resolve = [&](const char* symbol, auto** fn) {
      *reinterpret_cast<void**>(fn) = ::dlsym(lib, symbol);
      if (*fn == nullptr)
        throw_error("weft: " + name + " has no " + symbol + ": an NCCL 2 library is needed");
    };
    resolve("ncclGetUniqueId", &a.GetUniqueId);
    resolve("ncclCommInitRank", &a.CommInitRank);
    resolve("ncclCommDestroy", &a.CommDestroy);
    resolve("ncclCommAbort", &a.CommAbort);
    resolve("ncclCommGetAsyncError", &a.CommGetAsyncError);
    resolve("ncclAllReduce", &a.AllReduce);
    resolve("ncclAllGather", &a.AllGather);
    resolve("ncclReduceScatter", &a.ReduceScatter);
    resolve("ncclBroadcast", &a.Broadcast);
    resolve("ncclSend", &a.Send);
    resolve("ncclRecv", &a.Recv);
    resolve("ncclGroupStart", &a.GroupStart);
    resolve("ncclGroupEnd", &a.GroupEnd);
    resolve("ncclGetErrorString", &a.GetErrorString);
    resolve("ncclGetVersion", &a.GetVersion);
    // Version codes: major x 10000 + minor x 100 + patch from 2.9 on (x 1000 before); bf16 needs 2.10.
    if (a.GetVersion(&a.version) != 0 || a.version < 21000)
      throw_error("weft: the NCCL loaded (" + name + ", version code " + std::to_string(a.version) +
                  ") is older than 2.10, which teams spanning nodes need (bf16)");
    return a;
  }();
  return loaded;
}

void check(int result, const std::string& what) {
  if (result == 0) return;
  const char* text = api().GetErrorString ? api().GetErrorString(result) : "?";
  throw_error(what + ": NCCL error " + std::to_string(result) + " (" + (text ? text : "?") + ")");
}

DataType data_type(DType t) {
  switch (t) {
    case DType::kBF16:
      return kBfloat16;
    case DType::kFP16:
      return kFloat16;
    case DType::kFP32:
      return kFloat32;
  }
  throw_error("weft: no NCCL type for this dtype");
}

}  // namespace weft::nccl
