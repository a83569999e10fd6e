// Host side of weft::quantize_fp8: checks and launches (device code: weft/ops/quantize_fp8.cuh).
#include <algorithm>
#include <climits>
#include <string>

#include "op_args.hpp"
#include "weft/ops/gemm.hpp"
#include "weft/ops/quantize_fp8.cuh"
#include "weft/runtime/error.hpp"
#include "weft/runtime/kernel_preload.hpp"

namespace weft {
namespace {

struct Quantize {
  const void* in;
  int64_t ld_in;
  uint8_t* out;
  int64_t ld_out;
  float* scales;
  int64_t scale_m_stride;
  int64_t rows, cols;
  Fp8Scaling kind;
  Fp8Operand operand;
  cudaStream_t stream;
};

template <class T, bool kE5M2>
void launch(const Quantize& q) {
  const T* in = static_cast<const T*>(q.in);
  const int blocks = 4 * ops::device_facts().sms;
  if (q.kind == Fp8Scaling::kBlock && q.operand == Fp8Operand::kB) {
    const auto grid = unsigned(((q.cols + kFp8ScaleBlock - 1) / kFp8ScaleBlock) *
                               ((q.rows + kFp8ScaleBlock - 1) / kFp8ScaleBlock));
    detail::preload<&ops::fp8::quantize_blocks_kernel<T, kE5M2>>();
    ops::fp8::quantize_blocks_kernel<T, kE5M2>
        <<<grid, 256, 0, q.stream>>>(in, q.ld_in, q.out, q.ld_out, q.scales, q.rows, q.cols);
  } else if (q.kind == Fp8Scaling::kTensor) {
    auto* amax = reinterpret_cast<unsigned int*>(q.scales);
    WEFT_CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float), q.stream));
    detail::preload<&ops::fp8::amax_kernel<T>>();
    ops::fp8::amax_kernel<T><<<blocks, 256, 0, q.stream>>>(in, q.ld_in, q.rows, q.cols, amax);
    detail::preload<&ops::fp8::quantize_tensor_kernel<T, kE5M2>>();
    ops::fp8::quantize_tensor_kernel<T, kE5M2>
        <<<blocks, 256, 0, q.stream>>>(in, q.ld_in, q.out, q.ld_out, amax, q.rows, q.cols);
    detail::preload<&ops::fp8::finish_tensor_scale<kE5M2>>();
    ops::fp8::finish_tensor_scale<kE5M2><<<1, 1, 0, q.stream>>>(q.scales);
  } else if (q.kind == Fp8Scaling::kRowCol) {
    detail::preload<&ops::fp8::quantize_groups_kernel<T, kE5M2, true>>();
    ops::fp8::quantize_groups_kernel<T, kE5M2, true>
        <<<blocks, 256, 0, q.stream>>>(in, q.ld_in, q.out, q.ld_out, q.scales, 0, q.rows, q.cols);
  } else {
    detail::preload<&ops::fp8::quantize_groups_kernel<T, kE5M2, false>>();
    ops::fp8::quantize_groups_kernel<T, kE5M2, false><<<blocks, 256, 0, q.stream>>>(
        in, q.ld_in, q.out, q.ld_out, q.scales, q.scale_m_stride, q.rows, q.cols);
  }
  WEFT_CUDA_CHECK(cudaGetLastError());
}

template <class T, bool kE5M2, Fp8Activation kAct>
void launch_activated(const void* in, int64_t ld_in, void* out, int64_t ld_out, float* scales,
                      int64_t scale_m_stride, int64_t rows, int64_t cols, const Fp8QuantizeRows& which,
                      cudaStream_t stream) {
  constexpr auto kernel = &ops::fp8::activate_quantize_kernel<T, kE5M2, kAct>;
  detail::preload<kernel>();
  kernel<<<4 * ops::device_facts().sms, 256, 0, stream>>>(
      static_cast<const T*>(in), ld_in, static_cast<uint8_t*>(out), ld_out, scales, scale_m_stride, rows,
      cols, ops::fp8::QuantizedRows{which.group_end, which.group_rows, which.groups});
  WEFT_CUDA_CHECK(cudaGetLastError());
}

template <class T, bool kE5M2>
void launch_activated(Fp8Activation activation, const void* in, int64_t ld_in, void* out, int64_t ld_out,
                      float* scales, int64_t scale_m_stride, int64_t rows, int64_t cols,
                      const Fp8QuantizeRows& which, cudaStream_t stream) {
  switch (activation) {
    case Fp8Activation::kSwiGLU:
      return launch_activated<T, kE5M2, Fp8Activation::kSwiGLU>(in, ld_in, out, ld_out, scales,
                                                                scale_m_stride, rows, cols, which, stream);
    case Fp8Activation::kSiLU:
      return launch_activated<T, kE5M2, Fp8Activation::kSiLU>(in, ld_in, out, ld_out, scales, scale_m_stride,
                                                              rows, cols, which, stream);
    case Fp8Activation::kGELU:
      return launch_activated<T, kE5M2, Fp8Activation::kGELU>(in, ld_in, out, ld_out, scales, scale_m_stride,
                                                              rows, cols, which, stream);
    case Fp8Activation::kReLU:
      return launch_activated<T, kE5M2, Fp8Activation::kReLU>(in, ld_in, out, ld_out, scales, scale_m_stride,
                                                              rows, cols, which, stream);
    default:
      return launch_activated<T, kE5M2, Fp8Activation::kNone>(in, ld_in, out, ld_out, scales, scale_m_stride,
                                                              rows, cols, which, stream);
  }
}

}  // namespace

void activate_quantize_fp8(const void* in, DType in_type, Fp8Activation activation, void* out,
                           Fp8Type out_type, float* scales, int64_t rows, int64_t cols, cudaStream_t stream,
                           int64_t ld_in, int64_t ld_out, int64_t scale_m_stride,
                           const Fp8QuantizeRows& which) {
  const std::string where =
      "weft::activate_quantize_fp8(rows=" + std::to_string(rows) + ", cols=" + std::to_string(cols) + "): ";
  WEFT_CHECK(in_type == DType::kBF16 || in_type == DType::kFP16, where + "in must be bf16 or fp16");
  WEFT_CHECK(out_type == Fp8Type::kE4M3 || out_type == Fp8Type::kE5M2,
             where + "out_type must be e4m3 or e5m2");
  WEFT_CHECK(activation >= Fp8Activation::kNone && activation <= Fp8Activation::kReLU,
             where + "unknown Fp8Activation");
  WEFT_CHECK(rows > 0 && cols > 0 && rows <= INT32_MAX && cols <= INT32_MAX,
             where + "rows and cols must be in [1, 2^31 - 1]");
  const int64_t in_cols = activation == Fp8Activation::kSwiGLU ? 2 * cols : cols;
  ld_in = ld_in ? ld_in : in_cols;
  ld_out = ld_out ? ld_out : cols;
  WEFT_CHECK(cols % 4 == 0 && ld_in % 4 == 0 && ld_out % 4 == 0,
             where +
                 "cols, ld_in and ld_out must be multiples of 4 (a lane moves four elements), got ld_in " +
                 std::to_string(ld_in) + ", ld_out " + std::to_string(ld_out));
  WEFT_CHECK(ld_in >= in_cols && ld_out >= cols,
             where + "ld_in must be at least " + std::to_string(in_cols) + " and ld_out at least cols");
  WEFT_CHECK(scale_m_stride == 0 || scale_m_stride >= rows,
             where + "scale_m_stride (" + std::to_string(scale_m_stride) + ") must be 0 or at least rows");
  WEFT_CHECK(in && out && scales, where + "in, out and scales must not be null");
  ops::check_pointer_alignment(in, "in", 8, where);
  ops::check_pointer_alignment(out, "out", 4, where);
  ops::check_pointer_alignment(scales, "scales", 4, where);
  if (which.group_rows != nullptr) {
    WEFT_CHECK(which.group_end != nullptr && which.groups >= 1,
               where + "which.group_rows needs which.group_end and groups >= 1");
    ops::check_pointer_alignment(which.group_end, "which.group_end", 4, where);
    ops::check_pointer_alignment(which.group_rows, "which.group_rows", 4, where);
  }
  const bool e5m2 = out_type == Fp8Type::kE5M2;
  if (in_type == DType::kBF16)
    e5m2 ? launch_activated<__nv_bfloat16, true>(activation, in, ld_in, out, ld_out, scales, scale_m_stride,
                                                 rows, cols, which, stream)
         : launch_activated<__nv_bfloat16, false>(activation, in, ld_in, out, ld_out, scales, scale_m_stride,
                                                  rows, cols, which, stream);
  else
    e5m2 ? launch_activated<__half, true>(activation, in, ld_in, out, ld_out, scales, scale_m_stride, rows,
                                          cols, which, stream)
         : launch_activated<__half, false>(activation, in, ld_in, out, ld_out, scales, scale_m_stride, rows,
                                           cols, which, stream);
}

void quantize_fp8(const void* in, DType in_type, void* out, Fp8Type out_type, float* scales, int64_t rows,
                  int64_t cols, Fp8Scaling kind, Fp8Operand operand, cudaStream_t stream, int64_t ld_in,
                  int64_t ld_out, int64_t scale_m_stride) {
  const std::string where =
      "weft::quantize_fp8(rows=" + std::to_string(rows) + ", cols=" + std::to_string(cols) + "): ";
  WEFT_CHECK(in_type == DType::kBF16 || in_type == DType::kFP16, where + "in must be bf16 or fp16");
  WEFT_CHECK(out_type == Fp8Type::kE4M3 || out_type == Fp8Type::kE5M2,
             where + "out_type must be e4m3 or e5m2");
  WEFT_CHECK(kind == Fp8Scaling::kTensor || kind == Fp8Scaling::kRowCol || kind == Fp8Scaling::kBlock,
             where + "unknown Fp8Scaling");
  WEFT_CHECK(operand == Fp8Operand::kA || operand == Fp8Operand::kB, where + "unknown Fp8Operand");
  WEFT_CHECK(rows > 0 && cols > 0, where + "rows and cols must be at least 1");
  const int64_t tiles =
      ((rows + kFp8ScaleBlock - 1) / kFp8ScaleBlock) * ((cols + kFp8ScaleBlock - 1) / kFp8ScaleBlock);
  WEFT_CHECK(tiles <= INT32_MAX && rows <= INT32_MAX && cols <= INT32_MAX,
             where + "more than 2^31 - 1 rows, columns or 128 x 128 tiles are not supported");
  ld_in = ld_in ? ld_in : cols;
  ld_out = ld_out ? ld_out : cols;
  WEFT_CHECK(ld_in >= cols && ld_out >= cols, where + "ld_in and ld_out must be at least cols");
  WEFT_CHECK(scale_m_stride == 0 || (kind == Fp8Scaling::kBlock && operand == Fp8Operand::kA),
             where + "scale_m_stride is for block scales of operand A, got " + std::to_string(scale_m_stride));
  WEFT_CHECK(scale_m_stride == 0 || scale_m_stride >= rows,
             where + "scale_m_stride (" + std::to_string(scale_m_stride) + ") must be 0 or at least rows");
  WEFT_CHECK(in && out && scales, where + "in, out and scales must not be null");
  ops::check_pointer_alignment(in, "in", 2, where);
  ops::check_pointer_alignment(scales, "scales", 4, where);
  const Quantize q{in,   ld_in, static_cast<uint8_t*>(out), ld_out, scales, scale_m_stride, rows, cols,
                   kind, operand, stream};
  const bool e5m2 = out_type == Fp8Type::kE5M2;
  if (in_type == DType::kBF16)
    e5m2 ? launch<__nv_bfloat16, true>(q) : launch<__nv_bfloat16, false>(q);
  else
    e5m2 ? launch<__half, true>(q) : launch<__half, false>(q);
}

}  // namespace weft
