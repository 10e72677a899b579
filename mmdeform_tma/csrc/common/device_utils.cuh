// Device helpers shared by every backend: vector loads and dtype conversion, bilinear sampling
// geometry, the level-geometry check, and reductions inside a team of lanes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "problem.h"

namespace mmdeform_tma {

// Programmatic dependent launch (launch_as_dependent), no-ops before sm_90: a kernel lets the
// stream's next kernel start, and a dependent waits for the kernel before it (to complete, its
// writes visible).
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Quotients by a divisor fixed for a launch: a multiply-high, an add and a shift (round-up
// multiplier) for n < 2^31, instead of an integer division's instruction sequence.
struct FastDivisor {
  uint32_t multiplier, shift;
  __device__ __forceinline__ uint32_t divide(uint32_t n) const { return (__umulhi(n, multiplier) + n) >> shift; }
};

inline FastDivisor fast_divisor(uint32_t d) {  // 0 < d < 2^31
  uint32_t shift = 0;
  while ((1u << shift) < d) ++shift;
  const uint64_t multiplier = ((uint64_t{1} << 32) * ((uint64_t{1} << shift) - d)) / d + 1;
  return {static_cast<uint32_t>(multiplier), shift};
}

// Accumulators are fp32 (fp64 for an fp64 value).
template <typename scalar_t>
using acc_type = coord_type<scalar_t>;

// ---------------------------------------------------------------------------------------------
// Vectors of N elements, moved with one load/store of N * sizeof(scalar_t) bytes.

template <int BYTES>
struct RawVec;
template <>
struct RawVec<16> {
  using type = uint4;
};
template <>
struct RawVec<8> {
  using type = uint2;
};
template <>
struct RawVec<4> {
  using type = uint32_t;
};
template <>
struct RawVec<2> {
  using type = uint16_t;
};

template <typename scalar_t, int N>
struct alignas(N * sizeof(scalar_t)) Vec {
  scalar_t v[N];
};

template <typename scalar_t, int N>
__device__ __forceinline__ Vec<scalar_t, N> load_vec(const scalar_t* ptr) {
  using raw_t = typename RawVec<N * sizeof(scalar_t)>::type;
  Vec<scalar_t, N> out;
  *reinterpret_cast<raw_t*>(&out) = __ldg(reinterpret_cast<const raw_t*>(ptr));
  return out;
}

// An explicit ld.shared: through a generic pointer ptxas emits generic loads (LD, tracked on the
// long scoreboard like global loads) for data that is always in shared memory. Volatile, so it is
// never moved above the mbarrier wait that makes the data visible.
template <typename scalar_t, int N>
__device__ __forceinline__ Vec<scalar_t, N> load_shared_vec(const scalar_t* ptr) {
  constexpr int kBytes = N * sizeof(scalar_t);
  Vec<scalar_t, N> out;
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(ptr));
  if constexpr (kBytes == 16) {
    uint4 raw;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(raw.x), "=r"(raw.y), "=r"(raw.z), "=r"(raw.w)
                 : "r"(address));
    *reinterpret_cast<uint4*>(&out) = raw;
  } else if constexpr (kBytes == 8) {
    uint2 raw;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(raw.x), "=r"(raw.y) : "r"(address));
    *reinterpret_cast<uint2*>(&out) = raw;
  } else {
    out = *reinterpret_cast<const Vec<scalar_t, N>*>(ptr);
  }
  return out;
}

template <typename scalar_t, int N>
__device__ __forceinline__ void store_vec(scalar_t* ptr, const Vec<scalar_t, N>& vec) {
  *reinterpret_cast<Vec<scalar_t, N>*>(ptr) = vec;
}

// Element conversion to the accumulator type; pairs of halves convert with one instruction.
template <typename scalar_t, int N>
__device__ __forceinline__ void to_acc(const Vec<scalar_t, N>& in, acc_type<scalar_t> (&out)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = static_cast<acc_type<scalar_t>>(in.v[i]);
}

template <int N>
__device__ __forceinline__ void to_acc(const Vec<__half, N>& in, float (&out)[N]) {
  if constexpr (N % 2 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 2) {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&in.v[i]));
      out[i] = f.x;
      out[i + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = __half2float(in.v[i]);
  }
}

template <int N>
__device__ __forceinline__ void to_acc(const Vec<__nv_bfloat16, N>& in, float (&out)[N]) {
  if constexpr (N % 2 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 2) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&in.v[i]));
      out[i] = f.x;
      out[i + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = __bfloat162float(in.v[i]);
  }
}

template <typename scalar_t>
__device__ __forceinline__ scalar_t from_acc(acc_type<scalar_t> x) {
  return static_cast<scalar_t>(x);
}
template <>
__device__ __forceinline__ __half from_acc<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

template <typename scalar_t, int N>
__device__ __forceinline__ Vec<scalar_t, N> from_acc_vec(const acc_type<scalar_t> (&in)[N]) {
  Vec<scalar_t, N> out;
#pragma unroll
  for (int i = 0; i < N; ++i) out.v[i] = from_acc<scalar_t>(in[i]);
  return out;
}

template <typename T>
__device__ __forceinline__ T quiet_nan() {
  return static_cast<T>(__int_as_float(0x7fc00000));
}
template <>
__device__ __forceinline__ double quiet_nan<double>() {
  return __longlong_as_double(0x7ff8000000000000ll);
}

// ---------------------------------------------------------------------------------------------
// Bilinear sampling with align_corners=False and zero padding, as mmcv and grid_sample define it:
// pixel (h, w) of a level sits at normalised ((w + 0.5) / W, (h + 0.5) / H).

enum Corner : int { kTopLeft = 0, kTopRight = 1, kBottomLeft = 2, kBottomRight = 3 };

template <typename coord_t>
struct Bilinear {
  int y0, x0;          // the top-left corner
  coord_t ly, lx;      // distance from the top-left corner, in [0, 1)
  unsigned valid;      // bit c: corner c lies inside the level; 0 when the point misses it entirely

  __device__ __forceinline__ coord_t weight(int corner) const {
    const coord_t wy = (corner & 2) ? ly : coord_t(1) - ly;
    const coord_t wx = (corner & 1) ? lx : coord_t(1) - lx;
    return wy * wx;
  }
};

template <typename coord_t>
__device__ __forceinline__ Bilinear<coord_t> bilinear(coord_t x, coord_t y, int height, int width) {
  Bilinear<coord_t> b{0, 0, coord_t(0), coord_t(0), 0u};
  const coord_t h_im = y * coord_t(height) - coord_t(0.5);
  const coord_t w_im = x * coord_t(width) - coord_t(0.5);
  // Written so that NaN and +-Inf fail the test: such a point contributes nothing.
  if (!(h_im > coord_t(-1) && w_im > coord_t(-1) && h_im < coord_t(height) && w_im < coord_t(width))) return b;
  const coord_t yf = floor(h_im), xf = floor(w_im);
  b.y0 = static_cast<int>(yf);
  b.x0 = static_cast<int>(xf);
  b.ly = h_im - yf;
  b.lx = w_im - xf;
  const bool top = b.y0 >= 0, bottom = b.y0 + 1 < height, left = b.x0 >= 0, right = b.x0 + 1 < width;
  b.valid = (top && left ? 1u : 0u) | (top && right ? 2u : 0u) | (bottom && left ? 4u : 0u) | (bottom && right ? 8u : 0u);
  return b;
}

// h, w >= 0, level_start_index is the running sum of h*w, and it adds up to num_keys. Checked on
// the device (a few cached loads) so that inconsistent metadata never leads to reads outside value.
// Branch-free, so that the loads of four levels issue together: with an early return per level each
// level's loads waited for the previous level's, one L2 round trip per level at the start of every
// CTA of a kernel's first wave, which is all of a decoder-sized call (perf_notes.md, item 66).
__device__ __forceinline__ bool level_geometry_ok(
    const int64_t* __restrict__ shapes, const int64_t* __restrict__ starts, int levels, int64_t num_keys) {
  const uint64_t keys = static_cast<uint64_t>(num_keys);
  uint64_t expected = 0;  // unsigned: once a level fails, the sums may wrap harmlessly
  bool ok = true;
#pragma unroll 4
  for (int l = 0; l < levels; ++l) {
    const int64_t h = __ldg(shapes + 2 * l), w = __ldg(shapes + 2 * l + 1), start = __ldg(starts + l);
    ok &= h >= 0 && w >= 0 && h <= num_keys && w <= num_keys && static_cast<uint64_t>(start) == expected;
    expected += static_cast<uint64_t>(h) * static_cast<uint64_t>(w);
    ok &= expected <= keys;
  }
  return ok && expected == keys;
}

// The same verdict from a whole block at once, a level per thread (start[l + 1] = start[l] + h x w,
// start[0] = 0, the last level ending at num_keys, every value within num_keys, so no product
// overflows): a kernel of many small blocks paid the loop's 64-bit compares, some 150
// instructions, in every thread (H100, session 41). Every thread of the block must call it.
__device__ __forceinline__ bool block_level_geometry_ok(
    const int64_t* __restrict__ shapes, const int64_t* __restrict__ starts, int levels, int64_t num_keys) {
  bool ok = true;
  for (int l = threadIdx.x; l < levels; l += blockDim.x) {
    const int64_t h = __ldg(shapes + 2 * l), w = __ldg(shapes + 2 * l + 1), start = __ldg(starts + l);
    const int64_t end = l + 1 < levels ? __ldg(starts + l + 1) : num_keys;
    ok &= h >= 0 && w >= 0 && h <= num_keys && w <= num_keys && start >= 0 && start <= num_keys &&
          (l > 0 || start == 0) && start + h * w == end;
  }
  return __syncthreads_and(ok) != 0;
}

struct LevelGeometry {
  int height, width;
  int64_t start;
};

__device__ __forceinline__ LevelGeometry level_geometry(const int64_t* shapes, const int64_t* starts, int level) {
  return LevelGeometry{
      static_cast<int>(__ldg(shapes + 2 * level)), static_cast<int>(__ldg(shapes + 2 * level + 1)), __ldg(starts + level)};
}

// ---------------------------------------------------------------------------------------------
// Teams: `team` consecutive lanes (a power of two, at most 32) share one item.

__device__ __forceinline__ unsigned team_mask(int team) {
  if (team == 32) return 0xffffffffu;
  const int lane = threadIdx.x & 31;
  return ((1u << team) - 1u) << (lane & ~(team - 1));
}

template <typename T>
__device__ __forceinline__ T team_sum(T x, unsigned mask, int team) {
  for (int offset = team >> 1; offset > 0; offset >>= 1) x += __shfl_xor_sync(mask, x, offset, team);
  return x;
}

// A point's gradients from the dot products of its four corners' value rows with the output-gradient
// row, each lane holding its share of the dots: the attention weight's, and the location's before
// the factors attention x level width / height; summed over the team (`mask`, `team` as team_sum's).
template <typename acc_t>
struct CornerDotGradients {
  acc_t attention, x, y;
};

template <typename coord_t, typename acc_t>
__device__ __forceinline__ CornerDotGradients<acc_t> team_corner_dot_gradients(const Bilinear<coord_t>& bl,
                                                                               const acc_t (&dot)[4], unsigned mask,
                                                                               int team) {
  const coord_t ly = bl.ly, lx = bl.lx, hy = coord_t(1) - ly, hx = coord_t(1) - lx;
  const acc_t attention =
      hy * hx * dot[kTopLeft] + hy * lx * dot[kTopRight] + ly * hx * dot[kBottomLeft] + ly * lx * dot[kBottomRight];
  const acc_t x = hy * (dot[kTopRight] - dot[kTopLeft]) + ly * (dot[kBottomRight] - dot[kBottomLeft]);
  const acc_t y = hx * (dot[kBottomLeft] - dot[kTopLeft]) + lx * (dot[kBottomRight] - dot[kTopRight]);
  return {team_sum(attention, mask, team), team_sum(x, mask, team), team_sum(y, mask, team)};
}

// The same sum with the whole warp taking part, converged. A team mask known only at run time
// makes the compiler emulate each shuffle in software (WARPSYNC.COLLECTIVE loops: 30 % of the
// tma_ws backward's instructions under ncu, H100, 2026-11-24); the constant full mask does not.
template <typename T>
__device__ __forceinline__ T warp_team_sum(T x, int team) {
  for (int offset = team >> 1; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// Whether `pred` holds on every lane of this lane's team (the whole warp converged).
__device__ __forceinline__ bool warp_team_all(bool pred, int team) {
  const unsigned failing = __ballot_sync(0xffffffffu, !pred);
  const int lane = threadIdx.x & 31;
  const unsigned mine = (team == 32 ? 0xffffffffu : ((1u << team) - 1u) << (lane & ~(team - 1)));
  return (failing & mine) == 0u;
}

}  // namespace mmdeform_tma
