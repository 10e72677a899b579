// The deterministic MMA kernels' fixed-point flush of a window row: the TMA adds its int64 sums to
// the value gradient (window_backward.cu).
#pragma once

#include <cstdint>

#include "../common/grad_accumulation.cuh"
#include "mma_fragments.cuh"
#include "tensor_map.h"
#include "tma_primitives.cuh"

namespace mmdeform_tma {
namespace hopper {

#if MMDEFORM_TMA_HOPPER_DEVICE

// The deterministic MMA kernels' flush of one window row's sums (16 cells x 32 channels: d[j] is
// the n-tile of channels 8j..8j+7): the warp converts them to fixed point, stages them in its buffer
// `staging` as boxes of kFixedPointBoxKeys cells x 32 channels (fixed_point_tensor_map), and lane 0
// has the TMA add each box that holds a touched cell. At most 16 / kFixedPointBoxKeys bulk
// operations per row replace the lanes' 16 scalar 64-bit atomics each (integer addition keeps the
// result bitwise reproducible). Smaller boxes send fewer untouched cells (perf_notes.md, item 130);
// the int64 bytes, not the operations, are what the fp16 kernel's flush costs (items 129 and 130).
// The fp32 sums of the fast kernels stay with vector reductions: there the same flush was slower
// (perf_notes, session 24). `key` is the row's first cell, `row_index` its element of channel 0.
// `f`: the sink's scale with the operand scales the sums still carry (the weight scale, fp32's row
// scale) folded in (FixedPointSink::factors_with_pow2): two multiplies a value where there were
// three (four in fp32). Skipping the second where it is 1 (almost always) spilled fp16's 4-CTA
// kernel.
// The lanes stage the sums where the MMA left them: lane (g, t) holds channels 8j + 2t, 8j + 2t + 1
// of cells g (d[j][0..1]) and g + 8 (d[j][2..3]), one 16-byte chunk of a box row each, so no lane
// pairs swap halves. kHalves (the 4-CTA kernels, whose shared memory holds 2 KB a warp): the buffer
// holds cells 0-7, and cells 8-15 follow once the TMA has read them.
// A half (8 cells) with no nonzero sum is neither converted nor staged, and a box without one is
// not sent: the MMA leaves exact zeros in the cells no point touched.
template <typename Sink, bool kHalves = false>
__device__ __forceinline__ void flush_fixed_point_row(const Sink& sink, const float (&d)[4][4], uint32_t staging,
                                                      const CUtensorMap* map, int column, int key, int64_t row_index,
                                                      int64_t key_stride, typename Sink::Factors f) {
  constexpr int kHalfBytes = 8 * kFixedPointBoxColumns * 8;  // cells 8h..8h + 7, every channel
  constexpr int kBoxBytes = kFixedPointBoxKeys * kFixedPointBoxColumns * 8;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  constexpr int kBoxesPerHalf = 8 / kFixedPointBoxKeys;
  constexpr int kLanesPerBox = 4 * kFixedPointBoxKeys;  // lane (g, t) holds cell g of the half
  constexpr unsigned kBoxLanes = (1u << kLanesPerBox) - 1u;
  static_assert(8 % kFixedPointBoxKeys == 0 && kLanesPerBox < 32, "whole boxes, at least two a half");
  // The boxes of cells 8h..8h + 7 (from `from`) that hold a touched cell (boxes: bit b).
  const auto issue = [&](int h, uint32_t from, unsigned boxes) {
    fence_proxy_async_shared();  // this lane's stores before the TMA's reads
    __syncwarp();
    if (lane == 0) {
#pragma unroll
      for (int b = 0; b < kBoxesPerHalf; ++b) {
        if (boxes & (1u << b)) {
          tma_reduce_add_2d(map, from + b * kBoxBytes, column, key + 8 * h + kFixedPointBoxKeys * b);
        }
      }
    }
    bulk_commit_group();  // an empty group in the other lanes; inside the branch, fp16's 4-CTA kernel spilled
  };
  unsigned boxes[2];  // per half, the boxes (bit b: cells kFixedPointBoxKeys * b onwards) with a touched cell
  bool waited = false;
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // cells g (h = 0) and g + 8
    uint32_t bits = 0u;
#pragma unroll
    for (int j = 0; j < 4; ++j) bits |= __float_as_uint(d[j][2 * h]) | __float_as_uint(d[j][2 * h + 1]);
    const unsigned touched = __ballot_sync(0xffffffffu, (bits << 1) != 0u);  // +-0 in every sum: untouched
    boxes[h] = 0u;
#pragma unroll
    for (int b = 0; b < kBoxesPerHalf; ++b) {
      boxes[h] |= ((touched >> (b * kLanesPerBox)) & kBoxLanes) != 0u ? 1u << b : 0u;
    }
    if (boxes[h] == 0u) continue;  // warp-uniform
    const uint32_t half = staging + static_cast<uint32_t>((kHalves ? 0 : h) * kHalfBytes);
    const int64_t element = row_index + (g + 8 * h) * key_stride + 2 * t;  // this lane's cell, channel 2t
    float x[8];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      x[2 * j] = d[j][2 * h] * f.a * f.b;
      x[2 * j + 1] = d[j][2 * h + 1] * f.a * f.b;
    }
    // One test per eight values instead of a branch around each conversion: only a lane holding a
    // value without fixed point (NaN, +-Inf) takes the flag path, and both share the conversions.
    // The factors are powers of two, so the fp32 products are exact and F2I rounds once; a value
    // keeps its sign and NaN through them, which is all the flag reads.
    if (!Sink::all_representable(x)) {
#pragma unroll
      for (int i = 0; i < 8; ++i) sink.keep_representable(x[i], x[i], element + 8 * (i >> 1) + (i & 1));
    }
    unsigned long long q[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = Sink::round_to_fixed(x[i]);
    // The buffer's earlier boxes must have left it; converted first, so that their reads overlap
    // the conversions.
    if (kHalves || !waited) {
      if (lane == 0) bulk_wait_group_read_all();
      __syncwarp();
      waited = true;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // channels 8j + 2t, + 1 of cell g's 256-byte box row
      st_shared_v4(half + static_cast<uint32_t>(g * kFixedPointBoxColumns * 8 + 64 * j + 16 * t),
                   make_uint4(static_cast<uint32_t>(q[2 * j]), static_cast<uint32_t>(q[2 * j] >> 32),
                              static_cast<uint32_t>(q[2 * j + 1]), static_cast<uint32_t>(q[2 * j + 1] >> 32)));
    }
    if constexpr (kHalves) issue(h, half, boxes[h]);
  }
  if constexpr (!kHalves) {
    if ((boxes[0] | boxes[1]) == 0u) return;
    fence_proxy_async_shared();  // this lane's stores before the TMA's reads
    __syncwarp();
    if (lane == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int b = 0; b < kBoxesPerHalf; ++b) {
          if (boxes[h] & (1u << b)) {
            tma_reduce_add_2d(map, staging + static_cast<uint32_t>(h * kHalfBytes + b * kBoxBytes), column,
                              key + 8 * h + kFixedPointBoxKeys * b);
          }
        }
      }
    }
    bulk_commit_group();
  }
}

#endif  // MMDEFORM_TMA_HOPPER_DEVICE

}  // namespace hopper
}  // namespace mmdeform_tma
