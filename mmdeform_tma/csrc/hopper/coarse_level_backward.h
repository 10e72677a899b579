// The deterministic `tma_ws` backward's value gradient on the coarse levels (coarse_level_backward.cu).
//
// The window kernel flushes each (tile, level) stage's window rows into the int64 accumulator. On a
// coarse level every tile's window covers most of the level (sampling spreads a few level pixels,
// and the level has few of them), so the same cells were flushed by hundreds of tiles: levels 2-3
// of the DETR encoder cost 13 % of the fp16 deterministic backward in their flushes alone
// (perf_notes.md, item 126), the int64 bytes being what the flush costs (items 129-130). Here a CTA
// keeps a window of 256 consecutive keys of one coarse level in MMA accumulators (registers) over
// a run of queries of one (batch, head) and flushes it once.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "../common/grad_accumulation.cuh"
#include "../common/problem.h"

namespace mmdeform_tma {
namespace tma_ws {

// Levels of at most this many keys are coarse (four windows of 256 keys): DETR's 25 x 38 and 13 x 19.
constexpr int kCoarseLevelKeys = 1024;

// Adds the value gradient of every coarse level's points to `sink` (the window kernel, launched
// with LaunchShape::coarse_level_keys, leaves those levels out). fp16 and bf16 rows of 32 channels.
// `weight_scale`: A's scale (LaunchShape::weight_scale), a power of two.
template <typename scalar_t>
void launch_coarse_level_backward(const ProblemTensors& problem, const scalar_t* grad_output,
                                  const FixedPointSink<float>& sink, const CUtensorMap& flush_map, float weight_scale);

}  // namespace tma_ws
}  // namespace mmdeform_tma
