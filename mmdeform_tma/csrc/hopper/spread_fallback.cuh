// The fp32 spread fallback of the fast 32-channel MMA backward (LaunchShape::spread_role). An MMA CTA
// whose first stage's points spread over the image (no accumulation window pays) records that in
// spread_flags[CTA] and leaves; this kernel then runs the queries of its tiles with the portable
// kernel's teams (cuda/portable_kernels.cuh, backward_item): eight lanes of four channels per query,
// every corner read through L1 and reduced as one whole 128-byte row.
//
// Without windows the backward waits on its gathers and reductions in the L2, so what it needs is
// `cuda`'s kernel: its warps in flight and its order. The blocks fill the SMs and take runs of 16
// (batch, head, query) items in `cuda`'s head-major order from a counter, as the hardware hands
// `cuda`'s one-shot blocks their items, and run those items whose MMA CTA left (all of them, without
// a look per item, where every CTA left). On an H100's uniformly sampled fp32 encoder (bs 4, under
// the profiler) this kernel takes 1.74 ms against `cuda`'s 1.81; the same blocks striding over the
// items took 2.02, and one-shot blocks 1.74 but 52 us where no CTA left, against these blocks' 3
// (docs/perf_notes.md, item 79). The plain pipelined kernel over the same tiles, fp16/bf16's
// fallback, was 7 % faster than the MMA kernel on an H100 but 4-9 % slower on an H200 in fp32
// (item 59).
#pragma once

#include <c10/cuda/CUDAException.h>

#include "../common/cuda_runtime_utils.h"
#include "../cuda/portable_kernels.cuh"
#include "window_launch.cuh"
#include "window_pipeline.cuh"

namespace mmdeform_tma {
namespace hopper {
namespace window {

constexpr int kSpreadTeamThreads = 128;
constexpr int kSpreadTeamLanes = 8;  // x 4 channels: the 32-channel rows of the MMA kernels that bail

// The run counter's word after the MMA CTAs' flags; the MMA kernel's first CTA zeroes it.
__device__ __forceinline__ int* spread_run_counter(const LaunchShape& s, int mma_blocks) {
  return s.spread_flags + mma_blocks;
}

template <typename scalar_t, typename Sink>
__global__ void __launch_bounds__(kSpreadTeamThreads) spread_team_kernel(
    const Problem<scalar_t> p, const LaunchShape s, const int mma_blocks, const scalar_t* __restrict__ grad_output,
    Sink sink, coord_type<scalar_t>* __restrict__ grad_locations, coord_type<scalar_t>* __restrict__ grad_weights) {
  constexpr int kVec = 32 / kSpreadTeamLanes;
  constexpr int kTeams = kSpreadTeamThreads / kSpreadTeamLanes;
  // Where no CTA left (the usual, local sampling), every block leaves after one look at the flags.
  int any = 0, all = 1;
  for (int c = threadIdx.x; c < mma_blocks; c += kSpreadTeamThreads) {
    const int flag = s.spread_flags[c];
    any |= flag;
    all &= flag;
  }
  if (!__syncthreads_or(any)) return;
  const bool every_cta_left = __syncthreads_and(all);
  const int lane = threadIdx.x % kSpreadTeamLanes, team = threadIdx.x / kSpreadTeamLanes;
  const unsigned mask = team_mask(kSpreadTeamLanes);
  sink.prepare();
  const int groups = tile_groups(p, s);
  int* counter = spread_run_counter(s, mma_blocks);
  // The next run is taken while this one runs; the barrier at the end of a run orders each slot's
  // reads before its next write.
  __shared__ int runs[2];
  if (threadIdx.x == 0) runs[0] = atomicAdd(counter, 1);
  __syncthreads();
  for (int slot = 0;; slot ^= 1) {
    // 64-bit: the blocks take up to one run each past the last item, which near the 2^31-item
    // limit would overflow a 32-bit product.
    const int64_t first = static_cast<int64_t>(runs[slot]) * kTeams;
    if (first >= p.num_items) break;  // the same for the whole block
    if (threadIdx.x == 0) runs[slot ^ 1] = atomicAdd(counter, 1);
    const int64_t run_item = first + team;  // head-major order, (batch, head, query), as `cuda`'s `_hm` configs
    const int item = static_cast<int>(min(run_item, static_cast<int64_t>(p.num_items) - 1));
    const int q = item % p.queries, bh = item / p.queries;
    const int head = bh % p.heads, batch = bh / p.heads;
    if (run_item < p.num_items &&
        (every_cta_left || s.spread_flags[tile_of_query(p, s, groups, batch, head, q) % mma_blocks] != 0)) {
      portable::backward_item<scalar_t, kVec, 1>(p, grad_output, sink, grad_locations, grad_weights,
                                                 portable::item_address(p, batch, q, head), lane, kSpreadTeamLanes,
                                                 mask);
    }
    __syncthreads();
  }
}

// Launches the fallback after an MMA kernel that ran on `mma_blocks` CTAs with shape `mma` (its
// spread_flags set, mma_blocks + 1 words): as many blocks as the SMs hold.
template <typename scalar_t, typename Sink>
void launch_spread_fallback(const ProblemTensors& problem, const LaunchShape& mma, int64_t mma_blocks,
                            const scalar_t* grad_output, Sink sink, coord_type<scalar_t>* grad_locations,
                            coord_type<scalar_t>* grad_weights) {
  TORCH_CHECK(problem.channels == 32 && mma.spread_flags != nullptr,
              "mmdeform_tma tma_ws: the spread fallback takes 32-channel rows after a flagging MMA kernel");
  const auto kernel = spread_team_kernel<scalar_t, Sink>;
  const int64_t resident =
      static_cast<int64_t>(blocks_per_multiprocessor(reinterpret_cast<const void*>(kernel), kSpreadTeamThreads, 0)) *
      multiprocessor_count();
  const int64_t runs = (problem.num_items() + kSpreadTeamThreads / kSpreadTeamLanes - 1) /
                       (kSpreadTeamThreads / kSpreadTeamLanes);
  const int64_t blocks = std::min(resident, runs);
  kernel<<<static_cast<unsigned>(blocks), kSpreadTeamThreads, 0, current_stream()>>>(
      problem.problem<scalar_t>(), mma, static_cast<int>(mma_blocks), grad_output, sink, grad_locations, grad_weights);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace window
}  // namespace hopper
}  // namespace mmdeform_tma
