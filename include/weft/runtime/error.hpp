// Host-side errors: every failure is a weft::Error whose message says what went wrong and, where it can,
// what to do about it.
#pragma once
#include <stdexcept>
#include <string>

namespace weft {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

[[noreturn]] void throw_error(const std::string& what);
[[noreturn]] void throw_cuda_error(int code, const char* name, const char* text, const char* expr,
                                   const char* file, int line);
std::string driver_error_text(int code);

}  // namespace weft

#define WEFT_CHECK(cond, msg)                                        \
  do {                                                               \
    if (!(cond)) ::weft::throw_error(std::string("weft: ") + (msg)); \
  } while (0)

// Runtime API calls.
#define WEFT_CUDA_CHECK(expr)                                                                              \
  do {                                                                                                     \
    cudaError_t weft_err_ = (expr);                                                                        \
    if (weft_err_ != cudaSuccess)                                                                          \
      ::weft::throw_cuda_error(int(weft_err_), cudaGetErrorName(weft_err_), cudaGetErrorString(weft_err_), \
                               #expr, __FILE__, __LINE__);                                                 \
  } while (0)

// Driver API calls (through weft's resolved driver table; see src/runtime/driver.hpp).
#define WEFT_CU_CHECK(expr)                                                                        \
  do {                                                                                             \
    CUresult weft_res_ = (expr);                                                                   \
    if (weft_res_ != CUDA_SUCCESS)                                                                 \
      ::weft::throw_error("weft: CUDA driver error " + ::weft::driver_error_text(int(weft_res_)) + \
                          " in " #expr " at " __FILE__ ":" + std::to_string(__LINE__));            \
  } while (0)
