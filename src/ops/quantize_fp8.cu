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
  ops::fp8::ScaleSteps steps;  // kBlock, operand A
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
    ops::fp8::quantize_groups_kernel<T, kE5M2, true><<<blocks, 256, 0, q.stream>>>(
        in, q.ld_in, q.out, q.ld_out, q.scales, ops::fp8::ScaleSteps{1, 0}, q.rows, q.cols);
  } else {
    detail::preload<&ops::fp8::quantize_groups_kernel<T, kE5M2, false>>();
    ops::fp8::quantize_groups_kernel<T, kE5M2, false>
        <<<blocks, 256, 0, q.stream>>>(in, q.ld_in, q.out, q.ld_out, q.scales, q.steps, q.rows, q.cols);
  }
  WEFT_CUDA_CHECK(cudaGetLastError());
}

// activate_quantize_fp8's launch, its arguments checked.
struct Activated {
  const void* in;
  int64_t ld_in;
  void* out;
  int64_t ld_out;
  float* scales;
  ops::fp8::ScaleSteps steps;
  int64_t rows, cols;
  Fp8QuantizeRows which;
  cudaStream_t stream;
};

template <class T, bool kE5M2, Activation kAct>
void launch_activated(const Activated& a) {
  constexpr auto kernel = &ops::fp8::activate_quantize_kernel<T, kE5M2, kAct>;
  detail::preload<kernel>();
  kernel<<<4 * ops::device_facts().sms, 256, 0, a.stream>>>(
      static_cast<const T*>(a.in), a.ld_in, static_cast<uint8_t*>(a.out), a.ld_out, a.scales, a.steps, a.rows,
      a.cols, ops::fp8::QuantizedRows{a.which.group_end, a.which.group_rows, a.which.groups});
  WEFT_CUDA_CHECK(cudaGetLastError());
}

// The kernel of `activation`, one of kActs.
template <class T, bool kE5M2, Activation... kActs>
void launch_activated_one_of(Activation activation, const Activated& a) {
  ((activation == kActs && (launch_activated<T, kE5M2, kActs>(a), true)) || ...);
}

template <class T, bool kE5M2>
void launch_activated(Activation activation, const Activated& a) {
  using A = Activation;
  launch_activated_one_of<T, kE5M2, A::kNone, A::kSwiGLU, A::kSiLU, A::kGELU, A::kReLU>(activation, a);
}

// Calls run.template operator()<T, kE5M2>() with in_type's element type and out_type's format.
template <class Run>
void by_types(DType in_type, Fp8Type out_type, Run&& run) {
  const bool e5m2 = out_type == Fp8Type::kE5M2;
  if (in_type == DType::kBF16)
    e5m2 ? run.template operator()<__nv_bfloat16, true>() : run.template operator()<__nv_bfloat16, false>();
  else
    e5m2 ? run.template operator()<__half, true>() : run.template operator()<__half, false>();
}

// Where A's block scales go (ops::fp8::ScaleSteps): M-major with scale_m_stride, rows of scale_row_stride
// floats, or dense row-major; the strides checked here for both entry points.
ops::fp8::ScaleSteps block_scale_steps(int64_t rows, int64_t cols, int64_t scale_m_stride,
                                       int64_t scale_row_stride, const std::string& where) {
  const int64_t groups = (cols + kFp8ScaleBlock - 1) / kFp8ScaleBlock;
  WEFT_CHECK(scale_m_stride == 0 || scale_row_stride == 0,
             where + "scale_m_stride and scale_row_stride are two layouts: give one");
  WEFT_CHECK(scale_m_stride == 0 || scale_m_stride >= rows,
             where + "scale_m_stride (" + std::to_string(scale_m_stride) + ") must be 0 or at least rows");
  WEFT_CHECK(scale_row_stride == 0 || scale_row_stride >= groups,
             where + "scale_row_stride (" + std::to_string(scale_row_stride) +
                 ") must be 0 or at least the row's 128-column groups (" + std::to_string(groups) + ")");
  if (scale_m_stride > 0) return {1, scale_m_stride};
  return {scale_row_stride > 0 ? scale_row_stride : groups, 1};
}

}  // namespace

void activate_quantize_fp8(const void* in, DType in_type, Activation activation, void* out, Fp8Type out_type,
                           float* scales, int64_t rows, int64_t cols, cudaStream_t stream, int64_t ld_in,
                           int64_t ld_out, int64_t scale_m_stride, const Fp8QuantizeRows& which) {
  const std::string where =
      "weft::activate_quantize_fp8(rows=" + std::to_string(rows) + ", cols=" + std::to_string(cols) + "): ";
  WEFT_CHECK(in_type == DType::kBF16 || in_type == DType::kFP16, where + "in must be bf16 or fp16");
  WEFT_CHECK(out_type == Fp8Type::kE4M3 || out_type == Fp8Type::kE5M2,
             where + "out_type must be e4m3 or e5m2");
  WEFT_CHECK(activation >= Activation::kNone && activation <= Activation::kReLU,
             where + "unknown Activation");
  WEFT_CHECK(rows > 0 && cols > 0 && rows <= INT32_MAX && cols <= INT32_MAX,
             where + "rows and cols must be in [1, 2^31 - 1]");
  const int64_t in_cols = activation == Activation::kSwiGLU ? 2 * cols : cols;
  ld_in = ld_in ? ld_in : in_cols;
  ld_out = ld_out ? ld_out : cols;
  WEFT_CHECK(cols % 4 == 0 && ld_in % 4 == 0 && ld_out % 4 == 0,
             where +
                 "cols, ld_in and ld_out must be multiples of 4 (a lane moves four elements), got ld_in " +
                 std::to_string(ld_in) + ", ld_out " + std::to_string(ld_out));
  WEFT_CHECK(ld_in >= in_cols && ld_out >= cols,
             where + "ld_in must be at least " + std::to_string(in_cols) + " and ld_out at least cols");
  const ops::fp8::ScaleSteps steps = block_scale_steps(rows, cols, scale_m_stride, 0, where);
  ops::check_pointer_alignment(in, "in", 8, where);  // (each: not null, and aligned)
  ops::check_pointer_alignment(out, "out", 4, where);
  ops::check_pointer_alignment(scales, "scales", 4, where);
  if (which.group_rows != nullptr) {
    WEFT_CHECK(which.group_end != nullptr && which.groups >= 1,
               where + "which.group_rows needs which.group_end and groups >= 1");
    ops::check_pointer_alignment(which.group_end, "which.group_end", 4, where);
    ops::check_pointer_alignment(which.group_rows, "which.group_rows", 4, where);
  }
  const Activated a{in, ld_in, out, ld_out, scales, steps, rows, cols, which, stream};
  by_types(in_type, out_type, [&]<class T, bool kE5M2>() { launch_activated<T, kE5M2>(activation, a); });
}

void quantize_fp8(const void* in, DType in_type, void* out, Fp8Type out_type, float* scales, int64_t rows,
                  int64_t cols, Fp8Scaling kind, Fp8Operand operand, cudaStream_t stream, int64_t ld_in,
                  int64_t ld_out, int64_t scale_m_stride, int64_t scale_row_stride) {
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
  WEFT_CHECK((scale_m_stride == 0 && scale_row_stride == 0) ||
                 (kind == Fp8Scaling::kBlock && operand == Fp8Operand::kA),
             where + "scale_m_stride and scale_row_stride are for block scales of operand A, got " +
                 std::to_string(scale_m_stride) + " and " + std::to_string(scale_row_stride));
  const ops::fp8::ScaleSteps steps = block_scale_steps(rows, cols, scale_m_stride, scale_row_stride, where);
  WEFT_CHECK(in && out && scales, where + "in, out and scales must not be null");
  ops::check_pointer_alignment(in, "in", 2, where);
  ops::check_pointer_alignment(scales, "scales", 4, where);
  const Quantize q{in,      ld_in, static_cast<uint8_t*>(out), ld_out, scales, steps, rows, cols, kind,
                   operand, stream};
  by_types(in_type, out_type, [&]<class T, bool kE5M2>() { launch<T, kE5M2>(q); });
}

}  // namespace weft
