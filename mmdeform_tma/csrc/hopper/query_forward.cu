// `tma_ws` forward of the `q_warp` config, for strips of unordered queries (decoders): one warp per
// (batch, query, head), its lane groups sharing out the query's points, every group's corner loads
// in flight at once.
//
// Why: a decoder has few queries (300-900 per image), so the window pipeline gives an SM 2-3 CTAs
// of 3 warps, and each consumer lane walks all of its query's points one after another. ncu (H100,
// 2026-11-24, fp16 DETR decoder at bs 2): the windowless kernel ran 15.8 us at 15 % occupancy, IPC
// 0.8, DRAM 16 %, stalled on long scoreboard. Here a query's points are spread over the warp (a
// group of `team` lanes moves one corner row, 32 / team groups per warp): one round of location
// loads, one of corner loads and a shuffle sum, with 8x the warps. Each point's geometry is computed
// once, by one lane, and shuffled to the group that loads it.
//
// Measured (perf_notes.md, session 14): 2-10 % faster than the best pipeline config on the DETR
// decoder at bs 2 and 8, 3-36 % slower at 900 queries and at bs 1; the tuning table picks it per
// shape, and the default never does.
#include <c10/cuda/CUDAException.h>

#include "../common/cuda_runtime_utils.h"
#include "../common/dtype_dispatch.cuh"
#include "../common/device_utils.cuh"
#include "query_forward.h"

namespace mmdeform_tma {
namespace tma_ws {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kLaneBytes = 16;  // a lane's share of a corner row
constexpr int kPointsPerRound = 2;  // per lane group: 8 corner loads in flight per lane

template <typename scalar_t>
constexpr int lane_elements() {
  return kLaneBytes / static_cast<int>(sizeof(scalar_t));
}

// Level l's geometry in lane l (levels <= 32), and whether the metadata is consistent: h, w >= 0
// and level_start_index the running sum of h x w, adding up to num_keys. One load per lane and a
// warp scan, where level_geometry_ok walks the levels one dependent load after another.
struct WarpLevels {
  int height, width;
  int64_t start;
  bool ok;
};

__device__ __forceinline__ WarpLevels warp_levels(const int64_t* shapes, const int64_t* starts, int levels,
                                                  int64_t num_keys) {
  const int lane = threadIdx.x & 31;
  int64_t h = 0, w = 0, start = 0;
  if (lane < levels) {
    h = __ldg(shapes + 2 * lane);
    w = __ldg(shapes + 2 * lane + 1);
    start = __ldg(starts + lane);
  }
  bool ok = h >= 0 && w >= 0 && h <= num_keys && w <= num_keys;
  int64_t running = ok ? h * w : 0;  // inclusive prefix sum of the level sizes
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int64_t before = __shfl_up_sync(0xffffffffu, running, offset);
    if (lane >= offset) running += before;
  }
  if (lane < levels) ok = ok && start == running - h * w && running <= num_keys;
  ok = __all_sync(0xffffffffu, ok) && __shfl_sync(0xffffffffu, running, 31) == num_keys;
  return WarpLevels{static_cast<int>(h), static_cast<int>(w), start, ok};
}

template <typename scalar_t>
__global__ void __launch_bounds__(32 * kWarpsPerBlock) query_warp_forward_kernel(
    const Problem<scalar_t> p, scalar_t* __restrict__ output, int team_log2) {
  using coord_t = coord_type<scalar_t>;
  using acc_t = acc_type<scalar_t>;
  constexpr int VEC = lane_elements<scalar_t>();
  const int item = static_cast<int>(blockIdx.x) * kWarpsPerBlock + static_cast<int>(threadIdx.x / 32);
  if (item >= p.num_items) return;  // whole warps leave together
  const int lane = threadIdx.x & 31;
  const int team = 1 << team_log2;
  const int chunk = (lane & (team - 1)) * VEC;  // first channel of this lane
  const int group = lane >> team_log2, groups = 32 >> team_log2;

  // item = (batch * queries + query) * heads + head, the output row
  const int head = item % p.heads;
  const int batch = item / (p.heads * p.queries);
  const int64_t key_stride = static_cast<int64_t>(p.heads) * p.channels;
  const scalar_t* head_value = p.value + static_cast<int64_t>(batch) * p.num_keys * key_stride + head * p.channels + chunk;
  const coord_t* locations = p.locations + static_cast<int64_t>(item) * p.levels * p.points * 2;
  const coord_t* weights = p.weights + static_cast<int64_t>(item) * p.levels * p.points;
  const int total = p.levels * p.points;

  acc_t acc[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) acc[k] = acc_t(0);
  const bool few_levels = p.levels <= 32;
  const WarpLevels levels = few_levels ? warp_levels(p.spatial_shapes, p.level_start, p.levels, p.num_keys)
                                       : WarpLevels{0, 0, 0, level_geometry_ok(p.spatial_shapes, p.level_start, p.levels, p.num_keys)};

  // Rounds of 32 points: lane l computes point `first + l` once (location, weight, bilinear), then
  // the lane groups take the round's points in turn, with the geometry shuffled from its lane.
  for (int first = 0; first < total && levels.ok; first += 32) {
    const int i = first + lane;
    int64_t top_left = 0;  // elements from head_value
    int width = 0;
    unsigned valid = 0u;
    coord_t a = coord_t(0), ly = coord_t(0), lx = coord_t(0);
    const int level = i < total ? i / p.points : 0;
    LevelGeometry g{0, 0, 0};
    if (few_levels) {  // the whole warp, converged
      g = LevelGeometry{__shfl_sync(0xffffffffu, levels.height, level), __shfl_sync(0xffffffffu, levels.width, level),
                        __shfl_sync(0xffffffffu, levels.start, level)};
    } else if (i < total) {
      g = level_geometry(p.spatial_shapes, p.level_start, level);
    }
    if (i < total) {
      a = weights[i];
      const Bilinear<coord_t> bl = bilinear(locations[2 * i], locations[2 * i + 1], g.height, g.width);
      valid = bl.valid;
      ly = bl.ly;
      lx = bl.lx;
      width = g.width;
      top_left = (g.start + static_cast<int64_t>(bl.y0) * g.width + bl.x0) * key_stride;
    }
    const int in_round = min(32, total - first);
    for (int step = 0; step < in_round; step += groups * kPointsPerRound) {  // warp-uniform: shuffles below
      const int k = step + group;
      Vec<scalar_t, VEC> raw[kPointsPerRound][4];
      coord_t corner_weight[kPointsPerRound][4];
#pragma unroll
      for (int u = 0; u < kPointsPerRound; ++u) {  // every load of the step before any use
        const int from = k + u * groups;  // the round's point, and the lane holding it
        const bool real = from < in_round;
        const int src = real ? from : 0;
        const int64_t at = __shfl_sync(0xffffffffu, top_left, src);
        const int64_t down = static_cast<int64_t>(__shfl_sync(0xffffffffu, width, src)) * key_stride;
        const unsigned their_valid = __shfl_sync(0xffffffffu, valid, src);  // every lane shuffles, then selects
        const coord_t their_a = __shfl_sync(0xffffffffu, a, src);
        const unsigned bits = real ? their_valid : 0u;
        const coord_t pa = real ? their_a : coord_t(0);
        const coord_t py = __shfl_sync(0xffffffffu, ly, src), px = __shfl_sync(0xffffffffu, lx, src);
        // A point that misses the level, or a corner outside it, reads zeros and keeps its weight:
        // a x 0 still carries a NaN / Inf weight, as the reference does.
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const coord_t wy = (c & 2) ? py : coord_t(1) - py, wx = (c & 1) ? px : coord_t(1) - px;
          corner_weight[u][c] = bits ? pa * (wy * wx) : pa;
          const scalar_t* corner = head_value + (at + ((c & 2) ? down : 0) + ((c & 1) ? key_stride : 0));
          raw[u][c] = (bits & (1u << c)) ? load_vec<scalar_t, VEC>(corner) : Vec<scalar_t, VEC>{};
        }
      }
#pragma unroll
      for (int u = 0; u < kPointsPerRound; ++u) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          acc_t v[VEC];
          to_acc(raw[u][c], v);
          const acc_t w = static_cast<acc_t>(corner_weight[u][c]);
#pragma unroll
          for (int k2 = 0; k2 < VEC; ++k2) acc[k2] = fma(w, v[k2], acc[k2]);
        }
      }
    }
  }
  // Past the last point a group adds nothing: the sum over groups is the query's.
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    for (int offset = team; offset < 32; offset <<= 1) acc[k] += __shfl_xor_sync(0xffffffffu, acc[k], offset);
    if (!levels.ok) acc[k] = quiet_nan<acc_t>();
  }
  if (group == 0) store_vec(output + static_cast<int64_t>(item) * p.channels + chunk, from_acc_vec<scalar_t, VEC>(acc));
}

}  // namespace

void query_warp_forward(const ProblemTensors& problem, at::Tensor& output) {
  MMDEFORM_TMA_DISPATCH_VALUE_TYPES(problem.value.scalar_type(), "mmdeform_tma tma_ws query-warp forward", [&] {
    const int row_bytes = static_cast<int>(problem.channels * problem.value.element_size());
    const int team = row_bytes / kLaneBytes;  // 1 to 16: require_tma_channels allows 16-256 byte rows
    TORCH_CHECK(team >= 1 && team <= 32 && (team & (team - 1)) == 0,
                "mmdeform_tma tma_ws: a head row of ", num(row_bytes), " bytes has no query-warp layout");
    int team_log2 = 0;
    while ((1 << team_log2) < team) ++team_log2;
    const int64_t blocks = (problem.num_items() + kWarpsPerBlock - 1) / kWarpsPerBlock;
    query_warp_forward_kernel<scalar_t><<<static_cast<unsigned>(blocks), 32 * kWarpsPerBlock, 0, current_stream()>>>(
        problem.problem<scalar_t>(), reinterpret_cast<scalar_t*>(output.data_ptr()), team_log2);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace tma_ws
}  // namespace mmdeform_tma
