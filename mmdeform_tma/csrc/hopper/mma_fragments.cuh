// Warp-level tensor-core pieces of the `tma_ws` MMA backward: ldmatrix loads, the m16n8k16 product
// with fp32 accumulators, and the hi/lo split that keeps an fp32 weight exact enough in two 16-bit
// operands.
//
// Fragment layouts (PTX ISA, mma.m16n8k16, 16-bit A/B): with g = lane / 4 and t = lane % 4,
//   A (16 x 16, row-major): a0 = (g, 2t..2t+1), a1 = (g + 8, 2t..), a2 = (g, 2t + 8..), a3 = (g + 8, 2t + 8..)
//   B (16 x 8, k x n):      b0 = (2t..2t+1, g), b1 = (2t + 8.., g)
//   D (16 x 8, fp32):       d0, d1 = (g, 2t..2t+1), d2, d3 = (g + 8, 2t..2t+1)
// ldmatrix .trans hands lane l the elements (rows 2t, 2t + 1; column g) of each 8 x 8 matrix, so an
// operand stored k-major (rows of k, columns of m or n) loads straight into these layouts.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "../common/device_utils.cuh"

namespace mmdeform_tma {
namespace hopper {

// Four 8 x 8 matrices of 16-bit elements, transposed: lanes 8i..8i+7 give the row addresses of
// matrix i, which lands in r[i]. The memory clobber keeps it between the barriers that order it.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address)
               : "memory");
}

// Shared-memory accesses by 32-bit address (no generic-to-shared conversion per access).
__device__ __forceinline__ void st_shared_v4(uint32_t address, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(address), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ void st_shared_u32(uint32_t address, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;" ::"r"(address), "r"(v) : "memory");
}

__device__ __forceinline__ void st_shared_v2(uint32_t address, uint2 v) {
  asm volatile("st.shared.v2.u32 [%0], {%1, %2};" ::"r"(address), "r"(v.x), "r"(v.y) : "memory");
}

template <typename scalar_t>
__device__ __forceinline__ scalar_t ld_shared_16(uint32_t address) {
  unsigned short bits;
  asm volatile("ld.shared.u16 %0, [%1];" : "=h"(bits) : "r"(address) : "memory");
  if constexpr (std::is_same_v<scalar_t, __half>) {
    return __ushort_as_half(bits);
  } else {
    return __ushort_as_bfloat16(bits);
  }
}

template <typename scalar_t>
__device__ __forceinline__ void st_shared_16(uint32_t address, scalar_t x) {
  unsigned short bits;
  if constexpr (std::is_same_v<scalar_t, __half>) {
    bits = __half_as_ushort(x);
  } else {
    bits = __bfloat16_as_ushort(x);
  }
  asm volatile("st.shared.u16 [%0], %1;" ::"r"(address), "h"(bits) : "memory");
}

// d += a b on the tensor cores: A 16 x 16, B 16 x 8 of fp16 or bf16, fp32 accumulators.
template <typename scalar_t>
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  static_assert(std::is_same_v<scalar_t, __half> || std::is_same_v<scalar_t, __nv_bfloat16>, "16-bit operands only");
  if constexpr (std::is_same_v<scalar_t, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats as one register of two 16-bit numbers of value's type (`low_half` in bits 0-15), and back.
template <typename scalar_t>
__device__ __forceinline__ uint32_t pack_pair(float low_half, float high_half) {
  if constexpr (std::is_same_v<scalar_t, __half>) {
    const __half2 h = __floats2half2_rn(low_half, high_half);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(low_half, high_half);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

template <typename scalar_t>
__device__ __forceinline__ float2 unpack_pair(uint32_t r) {
  if constexpr (std::is_same_v<scalar_t, __half>) {
    return __half22float2(*reinterpret_cast<const __half2*>(&r));
  } else {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&r));
  }
}

// An fp32 number as hi + lo, two 16-bit numbers of value's type: hi is the number rounded, lo the
// rest rounded, so hi + lo carries about twice the type's significand (fp16: 22 bits, bf16: 16).
template <typename scalar_t>
struct SplitWeight {
  scalar_t hi, lo;
};

template <typename scalar_t>
__device__ __forceinline__ SplitWeight<scalar_t> split_weight(float x) {
  const scalar_t hi = from_acc<scalar_t>(x);
  return {hi, from_acc<scalar_t>(x - static_cast<float>(hi))};
}

}  // namespace hopper
}  // namespace mmdeform_tma
