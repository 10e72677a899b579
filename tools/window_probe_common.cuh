// Pieces both window forward probes use (tools/window_mma_forward_probe.cu, tools/window_tma_forward_probe.cu):
// 16-bit pairs for the tensor cores' B words, and the D fragments' hi + lo sums staged as output rows.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "mma_fragments.cuh"  // mmdeform_tma::from_acc

namespace window_probe {

template <typename T>
struct HalfPair;  // two floats as one 32-bit pair of T, and back; one T to float (torch's extension flags
                  // turn the implicit conversions off)
template <>
struct HalfPair<__half> {
  __device__ static uint32_t pack(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ static float2 unpack(uint32_t u) { return __half22float2(*reinterpret_cast<__half2*>(&u)); }
  __device__ static float to_float(__half x) { return __half2float(x); }
};
template <>
struct HalfPair<__nv_bfloat16> {
  __device__ static uint32_t pack(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ static float2 unpack(uint32_t u) { return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&u)); }
  __device__ static float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
};

// D of kPairs pairs (columns n = 4 pn + 2 cn + h) into `stage`, rows of 32 channels: lane (g, t) holds query
// 2 pair + (t >> 1), channels 16 (t & 1) + g (d0 hi, d1 lo) and + 8 (d2, d3); g = lane / 4, t = lane % 4.
template <typename T, int kPairs>
__device__ __forceinline__ void stage_pair_sums(const float (&acc)[kPairs][4], T* stage, int g, int t) {
#pragma unroll
  for (int pr = 0; pr < kPairs; ++pr) {
    const int row = 2 * pr + (t >> 1), c0 = 16 * (t & 1) + g;
    stage[row * 32 + c0] = mmdeform_tma::from_acc<T>(acc[pr][0] + acc[pr][1]);
    stage[row * 32 + c0 + 8] = mmdeform_tma::from_acc<T>(acc[pr][2] + acc[pr][3]);
  }
}

}  // namespace window_probe
