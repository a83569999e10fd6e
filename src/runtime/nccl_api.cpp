#include "nccl_api.hpp"

#include <dlfcn.h>

#include <cstdlib>

#include "weft/runtime/error.hpp"

namespace weft::nccl {

const Api& api() {
  static const Api loaded = [] {
    const char* given = std::getenv("WEFT_NCCL_LIBRARY");
    const std::string name = given && *given ? given : "libnccl.so.2";
    void* lib = ::dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr && !(given && *given)) lib = ::dlopen("libnccl.so", RTLD_NOW | RTLD_LOCAL);
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
    resolve("ncclAllReduce", &a.AllReduce);
    resolve("ncclAllGather", &a.AllGather);
    resolve("ncclReduceScatter", &a.ReduceScatter);
    resolve("ncclGetErrorString", &a.GetErrorString);
    resolve("ncclGetVersion", &a.GetVersion);
    a.GetVersion(&a.version);
    if (a.version < 20000)
      throw_error("weft: " + name + " is NCCL " + std::to_string(a.version) + ": NCCL 2 needed");
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
