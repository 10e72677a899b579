// Where the value gradient goes. Every backward kernel scatters  attention x bilinear x grad_output
// into the four corners of each sampling point; two policies decide how:
//   AtomicSink       fp32 (fp64 for an fp64 value) buffer with vector atomics: fast, the order of
//                    additions varies from run to run;
//   FixedPointSink   64-bit fixed point with integer atomics: integer addition is associative, so
//                    the result is bitwise identical on every run (torch deterministic mode).
//
// Fixed point: a destination element receives at most queries x points contributions (a point's
// four corners are distinct keys), each at most max|attention| x max|grad_output| in magnitude.
// Scaling by 2^62 / (queries x points x max|a| x max|g|) therefore cannot overflow int64, and the
// quantum is that bound times 2^-62. Non-finite contributions set per-element flags instead, which
// the finalize step turns back into NaN / +Inf / -Inf exactly as IEEE addition would.
//
// Either buffer is dense (one accumulator row per (batch, key, head) cell of value) or holds only
// the touched rows: when the sampling points' corners cover few of value's cells (decoders), a
// claim pass gives each touched cell a row of a compact buffer, and the final pass writes the
// whole gradient in value's dtype from it. A half-precision decoder then never zeroes, reads and
// converts a dense fp32 buffer, which was half of its backward (perf_notes, session 14).
#pragma once

#include <ATen/ATen.h>

#include <type_traits>

#include "device_utils.cuh"
#include "dtype_dispatch.cuh"
#include "launchers.h"

namespace mmdeform_tma {

__device__ __forceinline__ void red_add_f32x4(float* dst, float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
  atomicAdd(dst + 2, c);
  atomicAdd(dst + 3, d);
#endif
}

__device__ __forceinline__ void red_add_f32x2(float* dst, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(dst), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
#endif
}

// N consecutive floats, 4N-byte aligned: vector reductions of 16 (or 8) bytes on sm_90.
template <int N>
__device__ __forceinline__ void atomic_add_vec(float* dst, const float (&v)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 4) red_add_f32x4(dst + i, v[i], v[i + 1], v[i + 2], v[i + 3]);
  } else if constexpr (N % 2 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 2) red_add_f32x2(dst + i, v[i], v[i + 1]);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) atomicAdd(dst + i, v[i]);
  }
}

template <int N>
__device__ __forceinline__ void atomic_add_vec(double* dst, const double (&v)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) atomicAdd(dst + i, v[i]);
}

// Where a cell's accumulator row lives. `slot` null: the dense buffer, element index unchanged;
// otherwise slot[cell] is the cell's row in the compact buffer (channels a power of two), or -1
// for a cell no corner touches. Only the MMA backward adds to such cells, and only exact zeros
// (it reduces whole windows), so those adds are dropped.
struct TouchedRows {
  const int* __restrict__ slot;
  int channels_log2;

  // The accumulator index of value element `index`, or -1 to drop the add.
  __device__ __forceinline__ int64_t operator()(int64_t index) const {
    if (slot == nullptr) return index;
    const int row = __ldg(slot + (index >> channels_log2));  // written by an earlier launch
    if (row < 0) return -1;
    return (static_cast<int64_t>(row) << channels_log2) | (index & ((int64_t(1) << channels_log2) - 1));
  }
};

// The dense layout fixed at compile time: for kernels that run only with it (the MMA backward,
// whose registers have no room for the lookup).
struct DenseRows {
  __device__ __forceinline__ int64_t operator()(int64_t index) const { return index; }
};

template <typename acc_t, typename Rows = TouchedRows>
struct AtomicSink {
  acc_t* __restrict__ grad;  // [batch, num_keys, heads, channels], or the touched rows
  Rows rows;

  // This sink as a dense-only one.
  AtomicSink<acc_t, DenseRows> dense() const {
    TORCH_INTERNAL_ASSERT(rows.slot == nullptr, "a dense-only kernel got touched rows");
    return {grad, {}};
  }

  __device__ __forceinline__ void prepare() {}

  // Value element `index` (an untouched cell's add is dropped).
  template <int N>
  __device__ __forceinline__ void add(int64_t index, const acc_t (&v)[N]) const {
    const int64_t at = rows(index);
    if (at >= 0) add_at(at, v);
  }
  // Accumulator element `at`, from rows(index).
  template <int N>
  __device__ __forceinline__ void add_at(int64_t at, const acc_t (&v)[N]) const {
    atomic_add_vec(grad + at, v);
  }
};

enum NonFiniteFlag : uint32_t { kNaN = 1u, kPosInf = 2u, kNegInf = 4u };

// Finite maxima of |attention_weights| and |grad_output| as float bit patterns (monotonic for >= 0).
struct FixedPointBounds {
  unsigned int max_abs_weight_bits;
  unsigned int max_abs_grad_bits;
};

__device__ __forceinline__ double fixed_point_scale(const FixedPointBounds* bounds, int64_t contributions_per_element) {
  const double a = static_cast<double>(__uint_as_float(bounds->max_abs_weight_bits));
  const double g = static_cast<double>(__uint_as_float(bounds->max_abs_grad_bits));
  const double bound = static_cast<double>(contributions_per_element > 0 ? contributions_per_element : 1) * a * g;
  return bound > 0.0 ? 4611686018427387904.0 / bound : 1.0;  // 2^62 / bound
}

template <typename acc_t, typename Rows = TouchedRows>
struct FixedPointSink {
  unsigned long long* __restrict__ grad;  // int64 two's complement, [batch, num_keys, heads, channels] or rows
  uint32_t* __restrict__ nonfinite;       // 8 flag bits per element, four elements per word
  const FixedPointBounds* __restrict__ bounds;
  int64_t contributions_per_element;
  Rows rows;
  double scale;

  FixedPointSink<acc_t, DenseRows> dense() const {
    TORCH_INTERNAL_ASSERT(rows.slot == nullptr, "a dense-only kernel got touched rows");
    return {grad, nonfinite, bounds, contributions_per_element, {}, scale};
  }

  __device__ __forceinline__ void prepare() { scale = fixed_point_scale(bounds, contributions_per_element); }

  template <int N>
  __device__ __forceinline__ void add(int64_t index, const acc_t (&v)[N]) const {
    const int64_t at = rows(index);
    if (at >= 0) add_at(at, v);
  }
  template <int N>
  __device__ __forceinline__ void add_at(int64_t at, const acc_t (&v)[N]) const {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const double x = static_cast<double>(v[i]);
      const double q = x * scale;
      if (fabs(q) < 9.0e18) {  // false for NaN, +-Inf, and fp64 values beyond the float range of the bounds
        atomicAdd(grad + at + i, static_cast<unsigned long long>(__double2ll_rn(q)));
      } else {
        const uint32_t flag = isnan(x) ? kNaN : (x > 0 ? kPosInf : kNegInf);
        const int64_t e = at + i;
        atomicOr(nonfinite + (e >> 2), flag << (8 * (e & 3)));
      }
    }
  }
};

// How the value gradient's accumulator is laid out (see the top of this file).
enum class GradValueLayout { kDense, kTouchedRows };

// The layout for this problem. MMDEFORM_TMA_GRAD_VALUE_LAYOUT=dense|touched forces one (for
// measurements; forcing `touched` where it cannot run raises with the reason); unset or `auto`
// picks touched rows for half-precision values and for the deterministic backward when a
// (batch, head)'s corners are at most its keys: 4 x queries x levels x points <= num_keys.
GradValueLayout grad_value_layout(const ProblemTensors& problem, bool deterministic);

// Host side of the value gradient: allocation, the claim pass of the touched rows, the
// fixed-point bounds pass and the final pass into value's dtype.
class ValueGradient {
 public:
  // `deterministic` picks the fixed-point sink; otherwise fp32 atomics, straight into the result
  // when value is fp32/fp64 and dense, else into a buffer that finish() turns into value's dtype.
  ValueGradient(const ProblemTensors& problem, const at::Tensor& grad_output, bool deterministic,
                GradValueLayout layout);

  template <typename scalar_t>
  AtomicSink<acc_type<scalar_t>> atomic_sink() const {
    return AtomicSink<acc_type<scalar_t>>{buffer_.data_ptr<acc_type<scalar_t>>(), rows()};
  }
  template <typename scalar_t>
  FixedPointSink<acc_type<scalar_t>> fixed_point_sink() const {
    return FixedPointSink<acc_type<scalar_t>>{
        reinterpret_cast<unsigned long long*>(buffer_.data_ptr<int64_t>()),
        reinterpret_cast<uint32_t*>(flags_.data_ptr<int32_t>()),
        reinterpret_cast<const FixedPointBounds*>(bounds_.data_ptr<int32_t>()),
        contributions_per_element_,
        rows(),
        0.0};
  }
  bool deterministic() const { return deterministic_; }
  bool dense() const { return !slot_.defined(); }

  // The gradient in value's dtype.
  at::Tensor finish();

 private:
  TouchedRows rows() const {
    return TouchedRows{slot_.defined() ? slot_.data_ptr<int32_t>() : nullptr, channels_log2_};
  }
  void claim_touched_rows(const ProblemTensors& problem);

  at::Tensor value_;
  at::Tensor buffer_;  // fp32/fp64 accumulator, or int64 fixed point; dense or touched rows
  at::Tensor flags_;   // non-finite flags (fixed point only)
  at::Tensor bounds_;  // FixedPointBounds (fixed point only)
  at::Tensor slot_;    // touched rows only: [cells + 1], each cell's row (-1: none), then the row count - 1
  int64_t contributions_per_element_ = 0;
  int channels_log2_ = 0;
  bool deterministic_;
};

// What every compiled backend's backward shares: the gradient tensors, the answer for problems
// with nothing to sample, the dtype dispatch, and the value-gradient sink `deterministic` asks for.
// `launch(sink, grad_output, grad_locations, grad_weights)` gets typed pointers (the value type is
// grad_output's pointee, see ScalarOf) and launches the backend's kernel; `layout` is
// grad_value_layout's answer, which a backend may need first to choose its kernel.
template <typename Pointer>
using ScalarOf = std::remove_const_t<std::remove_pointer_t<Pointer>>;

template <typename Launch>
Gradients run_backward(const ProblemTensors& problem, const at::Tensor& grad_output, bool deterministic,
                       GradValueLayout layout, const char* what, Launch&& launch) {
  const auto coordinate_grads = coordinate_gradients(problem);
  const at::Tensor& grad_locations = coordinate_grads.first;
  const at::Tensor& grad_weights = coordinate_grads.second;
  ValueGradient grad_value(problem, grad_output, deterministic, layout);
  if (problem.empty_output() || problem.levels == 0 || problem.points == 0) {
    grad_locations.zero_();
    grad_weights.zero_();
    return {grad_value.finish(), grad_locations, grad_weights};
  }
  MMDEFORM_TMA_DISPATCH_VALUE_TYPES(problem.value.scalar_type(), what, [&] {
    using coord_t = coord_type<scalar_t>;
    const auto* go = reinterpret_cast<const scalar_t*>(grad_output.data_ptr());
    if (deterministic) {
      launch(grad_value.fixed_point_sink<scalar_t>(), go, grad_locations.data_ptr<coord_t>(),
             grad_weights.data_ptr<coord_t>());
    } else {
      launch(grad_value.atomic_sink<scalar_t>(), go, grad_locations.data_ptr<coord_t>(),
             grad_weights.data_ptr<coord_t>());
    }
  });
  return {grad_value.finish(), grad_locations, grad_weights};
}

}  // namespace mmdeform_tma
