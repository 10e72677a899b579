// Where the value gradient goes. Every backward kernel scatters  attention x bilinear x grad_output
// into the four corners of each sampling point; two policies decide how:
//   AtomicSink       fp32 (fp64 for an fp64 value) buffer with vector atomics: fast, the order of
//                    additions varies from run to run;
//   FixedPointSink   64-bit fixed point with integer atomics: integer addition is associative, so
//                    the result is bitwise identical on every run (torch deterministic mode).
//
// Fixed point: a destination element receives at most queries x points contributions (a point's
// four corners are distinct keys), each at most max|attention| x max|grad_output| in magnitude.
// Scaling by 2^e, the largest power of two with (queries x points x max|a| x max|g|) x 2^e <= 2^62,
// therefore cannot overflow int64, and the quantum is 2^-e, at most that bound times 2^-61. A
// power of two makes the scaling exact in the value's own precision, so the one rounding is to the
// integer. Non-finite contributions set per-element flags instead, which the finalize step turns
// back into NaN / +Inf / -Inf exactly as IEEE addition would.
//
// The deterministic backward of sparse problems takes neither sink: it sorts its contributions by
// cell instead (sorted_value_gradient.h).
//
// Either buffer is zeroed whole (dense), or only in the rows of the (batch, key, head) cells that
// a valid corner touches (touched cells): when the corners cover few of value's cells, as in
// decoders, two passes mark those cells and zero their rows, and the final pass writes the whole
// gradient in value's dtype, zero for every other cell. Kernels add to the same addresses either
// way. A half-precision decoder then never zeroes, reads and converts the whole fp32 buffer,
// which was half of its backward (perf_notes, session 14).
#pragma once

#include <ATen/ATen.h>

#include <type_traits>

#include "device_utils.cuh"
#include "dtype_dispatch.cuh"
#include "launchers.h"
#include "sorted_value_gradient.h"

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

template <typename acc_t>
struct AtomicSink {
  acc_t* __restrict__ grad;  // [batch, num_keys, heads, channels]

  __device__ __forceinline__ void prepare() {}

  template <int N>
  __device__ __forceinline__ void add(int64_t index, const acc_t (&v)[N]) const {
    atomic_add_vec(grad + index, v);
  }
};

enum NonFiniteFlag : uint32_t { kNaN = 1u, kPosInf = 2u, kNegInf = 4u };

// Finite maxima of |attention_weights| and |grad_output| as float bit patterns (monotonic for >= 0).
struct FixedPointBounds {
  unsigned int max_abs_weight_bits;
  unsigned int max_abs_grad_bits;
};

// The exponent e of the fixed-point scale 2^e (see the top of this file); 0 when nothing can be added.
__device__ __forceinline__ int fixed_point_exponent(const FixedPointBounds* bounds, int64_t contributions_per_element) {
  const double a = static_cast<double>(__uint_as_float(bounds->max_abs_weight_bits));
  const double g = static_cast<double>(__uint_as_float(bounds->max_abs_grad_bits));
  const double bound = static_cast<double>(contributions_per_element > 0 ? contributions_per_element : 1) * a * g;
  if (!(bound > 0.0)) return 0;
  int k;
  frexp(bound, &k);  // bound = m x 2^k, 0.5 <= m < 1: bound x 2^(62 - k) < 2^62
  return 62 - k;
}

template <typename acc_t>
struct FixedPointSink {
  unsigned long long* __restrict__ grad;  // int64 two's complement, [batch, num_keys, heads, channels]
  uint32_t* __restrict__ nonfinite;       // 8 flag bits per element, four elements per word
  const FixedPointBounds* __restrict__ bounds;
  int64_t contributions_per_element;
  // 2^e as two factors, each a normal number of acc_t, so that x scale_a x scale_b is exact in
  // acc_t: fp32 sums convert with one multiply pair and F2I, no fp64 (perf_notes, item 118).
  // float's exponent range holds every e from finite fp32 bounds down to bound = 2^-192.
  acc_t scale_a, scale_b;

  __device__ __forceinline__ void prepare() {
    const int e = fixed_point_exponent(bounds, contributions_per_element);
    constexpr int kMaxExponent = std::is_same_v<acc_t, double> ? 1023 : 127;
    const int ea = max(-kMaxExponent + 1, min(kMaxExponent, e));
    const int eb = max(-kMaxExponent + 1, min(kMaxExponent, e - ea));
    scale_a = static_cast<acc_t>(ldexp(1.0, ea));
    scale_b = static_cast<acc_t>(ldexp(1.0, eb));
  }

  // |v x 2^e| below this converts to int64 (the bounds put every finite sum at or below 2^62).
  static constexpr acc_t kRepresentable = static_cast<acc_t>(9.0e18);

  __device__ __forceinline__ acc_t scaled(acc_t v) const { return v * scale_a * scale_b; }

  // scaled(v x 2^k) as (v x a) x b, for sums that still carry an operand scale 2^-k: one multiply
  // instead of one per scale. As in prepare(), a takes as much of the exponent as a normal number
  // holds, so each product is exact wherever the result can round to a nonzero integer.
  struct Factors {
    acc_t a, b;
  };
  __device__ __forceinline__ Factors factors_with_pow2(int k) const {
    constexpr int kMaxExponent = std::is_same_v<acc_t, double> ? 1023 : 127;
    const int e = ilogb(scale_a) + ilogb(scale_b) + k;  // both are powers of two
    const int ea = max(-kMaxExponent + 1, min(kMaxExponent, e));
    const int eb = max(-kMaxExponent + 1, min(kMaxExponent, e - ea));
    return Factors{ldexp(acc_t(1), ea), ldexp(acc_t(1), eb)};
  }

  // x = scaled(v) rounded to the nearest integer; representable(x) must hold.
  static __device__ __forceinline__ unsigned long long round_to_fixed(acc_t x) {
    if constexpr (std::is_same_v<acc_t, double>) {
      return static_cast<unsigned long long>(__double2ll_rn(x));
    } else {
      return static_cast<unsigned long long>(__float2ll_rn(x));
    }
  }
  static __device__ __forceinline__ bool representable(acc_t x) { return fabs(x) < kRepresentable; }  // false for NaN

  // x = scaled(v) for element e, made representable: a value that has no fixed point (NaN, +-Inf,
  // and values beyond the bounds' range) sets e's flag instead and adds 0.
  __device__ __forceinline__ void keep_representable(acc_t& x, acc_t v, int64_t e) const {
    if (representable(x)) return;
    const uint32_t flag = isnan(v) ? kNaN : (v > 0 ? kPosInf : kNegInf);
    atomicOr(nonfinite + (e >> 2), flag << (8 * (e & 3)));
    x = acc_t(0);
  }

  // Whether every x[i] of N converts, in one test: the sum of |x| propagates NaN and Inf, and a
  // tree of additions is not the chain of dependent predicates that N tests made. A sum past the
  // limit only sends the values through keep_representable, which then tests each.
  template <int N>
  static __device__ __forceinline__ bool all_representable(const acc_t (&x)[N]) {
    acc_t sum[N];
#pragma unroll
    for (int i = 0; i < N; ++i) sum[i] = fabs(x[i]);
#pragma unroll
    for (int width = 1; width < N; width *= 2) {
#pragma unroll
      for (int i = 0; i + width < N; i += 2 * width) sum[i] += sum[i + width];
    }
    return representable(sum[0]);
  }

  // One test for all N values and one run of conversions and atomics for both outcomes: a test and
  // branch around each conversion made the MMA kernels' direct path (4 corners x 2 adds a point)
  // long enough to add instruction-cache misses to the whole kernel (perf_notes, item 123).
  template <int N>
  __device__ __forceinline__ void add(int64_t index, const acc_t (&v)[N]) const {
    acc_t x[N];
#pragma unroll
    for (int i = 0; i < N; ++i) x[i] = scaled(v[i]);
    if (!all_representable(x)) {
#pragma unroll
      for (int i = 0; i < N; ++i) keep_representable(x[i], v[i], index + i);
    }
#pragma unroll
    for (int i = 0; i < N; ++i) atomicAdd(grad + index + i, round_to_fixed(x[i]));
  }
};

// How much of the value gradient's accumulator is initialised (see the top of this file), or, for
// the deterministic backward only, no accumulator: contributions sorted by cell.
enum class GradValueLayout { kDense, kTouchedCells, kSorted };

// The sorted deterministic backward runs on cross-attention (fewer queries than keys) where a
// (batch, head) has at most this many corners per key: DETR's decoder has 0.95, DINO's 2.85, and
// with 4 levels x 4 points every cross-attention has fewer than 64. On an H100 (2026-11-26,
// ca5016c / 1e6b27a; perf_notes item 71) sorting was 3.5-3.8x faster than fixed point from 8.6 to
// 63 corners per key (63: 1.86 against 6.98 ms in fp16) and 4 % slower on the encoder (64: 1.87
// against the windowed fixed-point MMA kernel's 1.79), whose windows sum neighbouring queries;
// encoders are also excluded by their query count. Denser cross-attention is unmeasured.
constexpr int64_t kSortedCornersPerKey = 64;

// The fast backward takes the sorted path too (sorted_fast_backward in grad_accumulation.cu):
//  - half-precision values, sparse (at most one corner per key of a (batch, head)), where one block
//    sorts each level run (sorts_level_runs), or where cub sorts a problem of at least
//    kSortedFastCells (batch, key, head) cells and fewer than kSortedFastKeys keys (16 bits with
//    the invalid key: two radix passes);
//  - half-precision values with up to four corners per key where blocks sort the level runs of at
//    least kSortedFastDenserCells cells;
//  - fp32 values where blocks sort the level runs: sparse ones whose runs are at most
//    kSortedFastFp32RunEntries entries, and up to four corners per key with at least
//    kSortedFastFp32LongRuns runs: a block sorts all of its run, so a long run pays a sort's latency
//    that a few runs' dense sums do not.
// Sorted over the automatic layout, `tma_ws`, H100, with the blocks' own sums (session 40, perf_notes
// item 87), fp16 / bf16: DINO's decoder (900 queries, 2.85 corners per key) bs 1 1.03 / 0.99, bs 2
// 0.86 / 0.81, bs 4 0.76 / 0.71; 300 queries over levels of half DETR's sides (3.8 corners per key,
// 81 K cells) 1.05 / 1.00; 7.6 corners per key 1.05-1.08 / 1.00-1.03; 14.9: 1.16 / 1.13. fp32,
// sparse: DETR's decoder bs 1 0.94, bs 2 1.02, bs 3 0.83, bs 4 0.80, bs 8 0.86; 2 points at bs 4
// 0.89; 4 heads x 64 channels at bs 2 1.04; DINO's five levels, 900 queries, bs 2 (14,400-entry
// runs) 1.10; 8 points there at bs 1 0.88.
// With the block sort but the sums in separate launches (session 39, item 86), fp16 / bf16 over
// touched cells: DETR's decoder bs 1 0.98 / 0.93, bs 2 0.93 / 0.86, bs 4 0.69 / 0.65; 100 queries
// bs 1 0.80 / 0.78; 2 points at bs 4 0.79 / 0.73; 4 heads x 64 channels 0.54 / 0.51.
// With cub's sort (2026-11-26; item 78, measurements/ab_sorted_fast_backward_s35.md):
//   DETR's decoder (300 queries, 0.95 corners per key), H100: bs 3 (485 K cells) 1.06 / 1.02,
//   bs 4 (646 K) 0.94 / 0.90, bs 8 (1.29 M) 0.80 / 0.76, bs 16 0.75 / 0.71; H200: bs 4 1.07 / 1.04,
//   bs 8 0.92 / 0.87, bs 16 0.87 / 0.82. 100 queries at bs 8: H100 0.84 / 0.82, H200 0.93 / 0.89.
//   900 queries over DINO's five levels (89,023 keys) at bs 2: H100 0.91 / 0.87, H200 1.05 / 1.01.
//   In the sweeps, 2 points at bs 4 (646 K cells) and 8 points at bs 1 (712 K) lost 10-26 %.
// fp32 with items 91-92's sort (H100, session 42), sorted over dense: DETR's decoder bs 1 0.88,
// bs 2 0.92; 100 queries 0.76; 4 heads x 64 channels 0.92; DINO's decoder (2.85 corners per key,
// 14,400-entry runs) bs 2 0.86, bs 1 (32 runs) 0.88 (1.05 before item 92). The L2 bound of
// session 40's rule went: with the lean point kernel (item 89) sorting won where grad_value fits
// the L2 too.
// The H200's bandwidth favours the touched cells' passes, hence 2^20 cells, where both GPUs gain.
constexpr int64_t kSortedFastCells = int64_t{1} << 20;
constexpr int64_t kSortedFastKeys = int64_t{1} << 16;
// Up to four corners per key, 2^17 cells: DINO's bs 1 decoder (161 K cells, 2.85 corners per key)
// sorted 0.77x / 0.80x the touched cells in fp16 / bf16 with items 89-91 (H100, session 42).
constexpr int64_t kSortedFastDenserCells = int64_t{1} << 17;
constexpr int64_t kSortedFastFp32RunEntries = 5632;  // the 11-key block sort
constexpr int64_t kSortedFastFp32LongRuns = 32;      // DINO's bs 1 decoder: 8 heads x 4 levels

// The layout for this problem. MMDEFORM_TMA_GRAD_VALUE_LAYOUT=dense|touched|sorted forces one (for
// measurements; forcing one where it cannot run raises with the reason; `sorted` applies to the
// deterministic backward, the fast one keeps its automatic layout). Unset or `auto`: sorted for
// the deterministic backward as kSortedCornersPerKey says, and for the fast backward as the rules
// above kSortedFastCells say; otherwise touched cells for half-precision values when a (batch,
// head)'s corners are at most its keys (4 x queries x levels x points <= num_keys), and for the
// deterministic backward when they are at most four times its keys.
GradValueLayout grad_value_layout(const ProblemTensors& problem, const at::Tensor& grad_output, bool deterministic);

// Host side of the value gradient: allocation, the marking of touched cells, the fixed-point
// bounds pass and the final pass into value's dtype.
class ValueGradient {
 public:
  // `deterministic` picks the fixed-point sink; otherwise fp32 atomics, straight into the result
  // when value is fp32/fp64 and dense, else into a buffer that finish() turns into value's dtype.
  ValueGradient(const ProblemTensors& problem, const at::Tensor& grad_output, bool deterministic,
                GradValueLayout layout);

  template <typename scalar_t>
  AtomicSink<acc_type<scalar_t>> atomic_sink() const {
    return AtomicSink<acc_type<scalar_t>>{buffer_.data_ptr<acc_type<scalar_t>>()};
  }
  template <typename scalar_t>
  FixedPointSink<acc_type<scalar_t>> fixed_point_sink() const {
    return FixedPointSink<acc_type<scalar_t>>{
        reinterpret_cast<unsigned long long*>(buffer_.data_ptr<int64_t>()),
        reinterpret_cast<uint32_t*>(flags_.data_ptr<int32_t>()),
        reinterpret_cast<const FixedPointBounds*>(bounds_.data_ptr<int32_t>()),
        contributions_per_element_,
        0,
        0};
  }
  bool deterministic() const { return deterministic_; }

  // The gradient in value's dtype.
  at::Tensor finish();

 private:
  void mark_touched_cells(const ProblemTensors& problem);  // and zeroes their rows

  at::Tensor value_;
  at::Tensor buffer_;   // fp32/fp64 accumulator, or int64 fixed point
  at::Tensor flags_;    // non-finite flags (fixed point only)
  at::Tensor bounds_;   // FixedPointBounds (fixed point only)
  at::Tensor touched_;  // touched cells only: a byte per (batch, key, head) cell, nonzero when touched
  int64_t contributions_per_element_ = 0;
  bool deterministic_;
};

// What every compiled backend's backward shares: the gradient tensors, the answer for problems
// with nothing to sample, the dtype dispatch, and the value-gradient sink `deterministic` asks for.
// `launch(sink, grad_output, grad_locations, grad_weights)` gets typed pointers (the value type is
// grad_output's pointee, see ScalarOf) and launches the backend's kernel; `layout` is
// grad_value_layout's answer.
template <typename Pointer>
using ScalarOf = std::remove_const_t<std::remove_pointer_t<Pointer>>;

template <typename Launch>
Gradients run_backward(const ProblemTensors& problem, const at::Tensor& grad_output, bool deterministic,
                       GradValueLayout layout, const char* what, Launch&& launch) {
  if (layout == GradValueLayout::kSorted) return sorted_deterministic_backward(problem, grad_output);
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
