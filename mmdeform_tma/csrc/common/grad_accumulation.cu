#include "cuda_runtime_utils.h"
#include <c10/cuda/CUDAException.h>

#include "dtype_dispatch.cuh"
#include "grad_accumulation.cuh"

namespace mmdeform_tma {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float abs_if_finite(float x) { return isfinite(x) ? fabsf(x) : 0.0f; }

template <typename coord_t, typename scalar_t>
__global__ void __launch_bounds__(kThreads) fixed_point_bounds_kernel(
    const coord_t* __restrict__ weights, int64_t num_weights, const scalar_t* __restrict__ grad, int64_t num_grad,
    FixedPointBounds* __restrict__ bounds) {
  float max_weight = 0.0f, max_grad = 0.0f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < num_weights; i += stride) {
    // Rounded up to float: a slightly larger bound only costs a sliver of precision.
    max_weight = fmaxf(max_weight, abs_if_finite(__double2float_ru(fabs(static_cast<double>(weights[i])))));
  }
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < num_grad; i += stride) {
    max_grad = fmaxf(max_grad, abs_if_finite(__double2float_ru(fabs(static_cast<double>(grad[i])))));
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    max_weight = fmaxf(max_weight, __shfl_xor_sync(0xffffffffu, max_weight, offset));
    max_grad = fmaxf(max_grad, __shfl_xor_sync(0xffffffffu, max_grad, offset));
  }
  if ((threadIdx.x & 31) == 0) {
    atomicMax(&bounds->max_abs_weight_bits, __float_as_uint(max_weight));
    atomicMax(&bounds->max_abs_grad_bits, __float_as_uint(max_grad));
  }
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) fixed_point_finalize_kernel(
    const long long* __restrict__ fixed, const uint32_t* __restrict__ flags, const FixedPointBounds* __restrict__ bounds,
    int64_t contributions_per_element, int64_t numel, scalar_t* __restrict__ out) {
  const double inv_scale = 1.0 / fixed_point_scale(bounds, contributions_per_element);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < numel; i += stride) {
    const uint32_t flag = (flags[i >> 2] >> (8 * (i & 3))) & 0xffu;
    double x;
    if (flag == 0) {
      x = static_cast<double>(fixed[i]) * inv_scale;
    } else if ((flag & kNaN) || ((flag & kPosInf) && (flag & kNegInf))) {
      x = quiet_nan<double>();
    } else {
      x = (flag & kPosInf) ? INFINITY : -INFINITY;
    }
    out[i] = static_cast<scalar_t>(static_cast<acc_type<scalar_t>>(x));
  }
}

int grid_for(int64_t n) {
  const int64_t sms = multiprocessor_count();
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, sms * 8)));
}

}  // namespace

ValueGradient::ValueGradient(const ProblemTensors& problem, const at::Tensor& grad_output, bool deterministic)
    : value_(problem.value), deterministic_(deterministic) {
  const auto acc_dtype = problem.value.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  if (!deterministic) {
    buffer_ = at::zeros(problem.value.sizes(), problem.value.options().dtype(acc_dtype));
    return;
  }
  const int64_t numel = problem.value.numel();
  buffer_ = at::zeros(problem.value.sizes(), problem.value.options().dtype(at::kLong));
  flags_ = at::zeros({(numel + 3) / 4}, problem.value.options().dtype(at::kInt));
  bounds_ = at::zeros({2}, problem.value.options().dtype(at::kInt));
  contributions_per_element_ = problem.queries * problem.points;
  const auto stream = current_stream();
  MMDEFORM_TMA_DISPATCH_VALUE_TYPES(problem.value.scalar_type(), "fixed-point bounds", [&] {
    using coord_t = coord_type<scalar_t>;
    const int64_t n = std::max(problem.attention_weights.numel(), grad_output.numel());
    if (n == 0) return;
    fixed_point_bounds_kernel<coord_t, scalar_t><<<grid_for(n), kThreads, 0, stream>>>(
        problem.attention_weights.data_ptr<coord_t>(), problem.attention_weights.numel(),
        reinterpret_cast<const scalar_t*>(grad_output.data_ptr()), grad_output.numel(),
        reinterpret_cast<FixedPointBounds*>(bounds_.data_ptr<int32_t>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor ValueGradient::finish() {
  if (!deterministic_) {
    return buffer_.scalar_type() == value_.scalar_type() ? buffer_ : buffer_.to(value_.scalar_type());
  }
  at::Tensor out = at::empty_like(value_);
  const int64_t numel = out.numel();
  if (numel == 0) return out;
  const auto stream = current_stream();
  MMDEFORM_TMA_DISPATCH_VALUE_TYPES(value_.scalar_type(), "fixed-point finalize", [&] {
    fixed_point_finalize_kernel<scalar_t><<<grid_for(numel), kThreads, 0, stream>>>(
        reinterpret_cast<const long long*>(buffer_.data_ptr<int64_t>()),
        reinterpret_cast<const uint32_t*>(flags_.data_ptr<int32_t>()),
        reinterpret_cast<const FixedPointBounds*>(bounds_.data_ptr<int32_t>()), contributions_per_element_, numel,
        reinterpret_cast<scalar_t*>(out.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace mmdeform_tma
