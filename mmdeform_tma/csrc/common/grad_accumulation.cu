#include "cuda_runtime_utils.h"
#include <c10/cuda/CUDAException.h>

#include <climits>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

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
    int64_t contributions_per_element, TouchedRows rows, int64_t numel, scalar_t* __restrict__ out) {
  const double inv_scale = 1.0 / fixed_point_scale(bounds, contributions_per_element);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < numel; i += stride) {
    const int64_t at = rows(i);
    if (at < 0) {
      out[i] = static_cast<scalar_t>(0.0f);
      continue;
    }
    const uint32_t flag = (flags[at >> 2] >> (8 * (at & 3))) & 0xffu;
    double x;
    if (flag == 0) {
      x = static_cast<double>(fixed[at]) * inv_scale;
    } else if ((flag & kNaN) || ((flag & kPosInf) && (flag & kNegInf))) {
      x = quiet_nan<double>();
    } else {
      x = (flag & kPosInf) ? INFINITY : -INFINITY;
    }
    out[i] = static_cast<scalar_t>(static_cast<acc_type<scalar_t>>(x));
  }
}

// One thread per sampling point (item, level, point): the cells of its valid corners get rows.
// The corners come from the same `bilinear` as every backward kernel's, so the claimed cells are
// exactly the cells the kernel adds to. The first claimer of a cell takes the next row and
// zeroes it (and its non-finite flags); rows are numbered from the counter, which starts at -1.
template <typename coord_t>
__global__ void __launch_bounds__(kThreads) claim_touched_rows_kernel(
    const coord_t* __restrict__ locations, const int64_t* __restrict__ shapes, const int64_t* __restrict__ starts,
    int64_t num_points, int queries, int heads, int levels, int points, int64_t num_keys, int* __restrict__ slot,
    int* __restrict__ row_counter, uint4* __restrict__ rows, int row_words, uint32_t* __restrict__ flag_rows,
    int flag_words) {
  if (!level_geometry_ok(shapes, starts, levels, num_keys)) return;  // the kernels add nothing either
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < num_points; i += stride) {
    const int64_t item = i / (static_cast<int64_t>(levels) * points);
    const int level = static_cast<int>((i / points) % levels);
    const int64_t batch = item / (static_cast<int64_t>(queries) * heads);
    const int head = static_cast<int>(item % heads);
    const LevelGeometry g = level_geometry(shapes, starts, level);
    const Bilinear<coord_t> bl = bilinear(locations[2 * i], locations[2 * i + 1], g.height, g.width);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      if (!(bl.valid & (1u << c))) continue;
      const int64_t key = batch * num_keys + g.start + static_cast<int64_t>(bl.y0 + (c >> 1)) * g.width + bl.x0 + (c & 1);
      int* cell = slot + key * heads + head;
      if (*cell != -1 || atomicCAS(cell, -1, -2) != -1) continue;  // a row is taken, or being taken
      const int row = atomicAdd(row_counter, 1) + 1;
      for (int w = 0; w < row_words; ++w) rows[static_cast<int64_t>(row) * row_words + w] = make_uint4(0u, 0u, 0u, 0u);
      for (int w = 0; w < flag_words; ++w) flag_rows[static_cast<int64_t>(row) * flag_words + w] = 0u;
      *cell = row;
    }
  }
}

// The fp32 touched rows into a dense gradient in value's dtype, 8 elements (a row's aligned
// eighth or less) per step; untouched cells are zero.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) touched_rows_to_dense_kernel(
    const float* __restrict__ rows_buffer, TouchedRows rows, int64_t numel, scalar_t* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * 8;
  for (int64_t i = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) * 8; i < numel; i += stride) {
    const int64_t at = rows(i);
    float v[8];
    if (at < 0) {
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = 0.0f;
    } else {
      const float4 lo = *reinterpret_cast<const float4*>(rows_buffer + at);
      const float4 hi = *reinterpret_cast<const float4*>(rows_buffer + at + 4);
      v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w, v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
    }
    Vec<scalar_t, 8> packed;
#pragma unroll
    for (int k = 0; k < 8; ++k) packed.v[k] = static_cast<scalar_t>(v[k]);
    if constexpr (sizeof(scalar_t) == 4) {
      reinterpret_cast<uint4*>(out + i)[0] = reinterpret_cast<const uint4*>(&packed)[0];
      reinterpret_cast<uint4*>(out + i)[1] = reinterpret_cast<const uint4*>(&packed)[1];
    } else {
      *reinterpret_cast<uint4*>(out + i) = *reinterpret_cast<const uint4*>(&packed);
    }
  }
}

int grid_for(int64_t n) {
  const int64_t sms = multiprocessor_count();
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, sms * 8)));
}

}  // namespace

namespace {

// Why the touched-rows layout cannot hold this problem's gradient, or empty.
std::string touched_rows_unsupported(const ProblemTensors& problem) {
  const int64_t c = problem.channels;
  if (problem.value.scalar_type() == at::kDouble) return "fp64 values accumulate densely";
  if (c < 8 || (c & (c - 1)) != 0) return "channels per head (" + num(c) + ") is not a power of two >= 8";
  if (problem.batch * problem.num_keys * problem.heads >= INT_MAX) return "value has 2^31 or more (batch, key, head) cells";
  return {};
}

}  // namespace

GradValueLayout grad_value_layout(const ProblemTensors& problem, bool deterministic) {
  const char* forced = std::getenv("MMDEFORM_TMA_GRAD_VALUE_LAYOUT");
  const std::string unsupported = touched_rows_unsupported(problem);
  if (forced != nullptr && std::strcmp(forced, "dense") == 0) return GradValueLayout::kDense;
  if (forced != nullptr && std::strcmp(forced, "touched") == 0) {
    TORCH_CHECK(unsupported.empty(), "MMDEFORM_TMA_GRAD_VALUE_LAYOUT=touched: ", unsupported);
    return GradValueLayout::kTouchedRows;
  }
  TORCH_CHECK(forced == nullptr || forced[0] == '\0' || std::strcmp(forced, "auto") == 0,
              "MMDEFORM_TMA_GRAD_VALUE_LAYOUT is 'dense', 'touched' or 'auto', not '", forced, "'");
  // fp32's dense buffer is the result itself: touched rows save it nothing.
  const bool dense_costs_a_pass = deterministic || problem.value.element_size() == 2;
  const int64_t corners_per_batch_head = 4 * problem.queries * problem.levels * problem.points;
  return unsupported.empty() && dense_costs_a_pass && corners_per_batch_head <= problem.num_keys
             ? GradValueLayout::kTouchedRows
             : GradValueLayout::kDense;
}

ValueGradient::ValueGradient(const ProblemTensors& problem, const at::Tensor& grad_output, bool deterministic,
                             GradValueLayout layout)
    : value_(problem.value), deterministic_(deterministic) {
  const auto acc_dtype = problem.value.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const bool touched = layout == GradValueLayout::kTouchedRows;
  std::vector<int64_t> shape(problem.value.sizes().begin(), problem.value.sizes().end());
  int64_t elements = problem.value.numel();
  if (touched) {
    // At most one row per cell, and at most four per sampling point.
    const int64_t cells = problem.batch * problem.num_keys * problem.heads;
    const int64_t rows = std::min(cells, 4 * problem.num_items() * problem.levels * problem.points);
    shape = {rows, problem.channels};
    elements = rows * problem.channels;
    while ((int64_t(1) << channels_log2_) < problem.channels) ++channels_log2_;
    slot_ = at::empty({cells + 1}, problem.value.options().dtype(at::kInt));
    C10_CUDA_CHECK(cudaMemsetAsync(slot_.data_ptr<int32_t>(), 0xFF, slot_.nbytes(), current_stream()));  // all -1
  }
  // Touched rows are zeroed when claimed.
  const auto allocate = [&](at::IntArrayRef sizes, at::ScalarType type) {
    return touched ? at::empty(sizes, problem.value.options().dtype(type))
                   : at::zeros(sizes, problem.value.options().dtype(type));
  };
  if (!deterministic) {
    buffer_ = allocate(shape, acc_dtype);
  } else {
    buffer_ = allocate(shape, at::kLong);
    flags_ = allocate({(elements + 3) / 4}, at::kInt);
    bounds_ = at::zeros({2}, problem.value.options().dtype(at::kInt));
    contributions_per_element_ = problem.queries * problem.points;
  }
  if (touched) claim_touched_rows(problem);
  if (!deterministic) return;
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

void ValueGradient::claim_touched_rows(const ProblemTensors& problem) {
  const int64_t num_points = problem.num_items() * problem.levels * problem.points;
  if (num_points == 0) return;
  // channels is a power of two >= 8: a row is whole 16-byte words, its flags (a byte per
  // element) whole 4-byte words.
  const int row_words = static_cast<int>(problem.channels * buffer_.element_size() / 16);
  const int flag_words = deterministic_ ? static_cast<int>(problem.channels / 4) : 0;
  claim_touched_rows_kernel<float><<<grid_for(num_points), kThreads, 0, current_stream()>>>(
      problem.sampling_locations.data_ptr<float>(), problem.spatial_shapes.data_ptr<int64_t>(),
      problem.level_start_index.data_ptr<int64_t>(), num_points, static_cast<int>(problem.queries),
      static_cast<int>(problem.heads), static_cast<int>(problem.levels), static_cast<int>(problem.points), problem.num_keys,
      slot_.data_ptr<int32_t>(), slot_.data_ptr<int32_t>() + (slot_.numel() - 1),
      reinterpret_cast<uint4*>(buffer_.data_ptr()), row_words,
      deterministic_ ? reinterpret_cast<uint32_t*>(flags_.data_ptr<int32_t>()) : nullptr, flag_words);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor ValueGradient::finish() {
  if (!deterministic_ && !slot_.defined()) {
    return buffer_.scalar_type() == value_.scalar_type() ? buffer_ : buffer_.to(value_.scalar_type());
  }
  at::Tensor out = at::empty_like(value_);
  const int64_t numel = out.numel();
  if (numel == 0) return out;
  const auto stream = current_stream();
  MMDEFORM_TMA_DISPATCH_VALUE_TYPES(value_.scalar_type(), "value gradient", [&] {
    if (!deterministic_) {
      if constexpr (!std::is_same_v<scalar_t, double>) {  // touched rows are never fp64
        touched_rows_to_dense_kernel<scalar_t><<<grid_for(numel / 8), kThreads, 0, stream>>>(
            buffer_.data_ptr<float>(), rows(), numel, reinterpret_cast<scalar_t*>(out.data_ptr()));
      }
    } else {
      fixed_point_finalize_kernel<scalar_t><<<grid_for(numel), kThreads, 0, stream>>>(
          reinterpret_cast<const long long*>(buffer_.data_ptr<int64_t>()),
          reinterpret_cast<const uint32_t*>(flags_.data_ptr<int32_t>()),
          reinterpret_cast<const FixedPointBounds*>(bounds_.data_ptr<int32_t>()), contributions_per_element_, rows(),
          numel, reinterpret_cast<scalar_t*>(out.data_ptr()));
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace mmdeform_tma
