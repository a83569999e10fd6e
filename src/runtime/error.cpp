#include "weft/runtime/error.hpp"

namespace weft {

void throw_error(const std::string& what) {
  throw Error(what);
}

void throw_cuda_error(int code, const char* name, const char* text, const char* expr, const char* file,
                      int line) {
  throw Error(std::string("weft: CUDA error ") + std::to_string(code) + " " + name + " (" + text + ") in " +
              expr + " at " + file + ":" + std::to_string(line));
}

}  // namespace weft
