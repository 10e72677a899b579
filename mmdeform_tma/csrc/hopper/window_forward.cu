// `tma_ws` forward: the window pipeline's consumers interpolate every point of their queries,
// level by level, and store each query's output after its last level.
#include "../common/dtype_dispatch.cuh"
#include "../common/launchers.h"
#include "window_launch.cuh"
#include "window_pipeline.cuh"

namespace mmdeform_tma {
namespace tma_ws {
namespace {

using namespace hopper;
using namespace hopper::window;

template <typename scalar_t>
__device__ __forceinline__ void poison_outputs(const Problem<scalar_t>& p, scalar_t* output) {
  const int64_t total = static_cast<int64_t>(p.num_items) * p.channels;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    output[i] = quiet_nan<scalar_t>();
  }
}

template <typename scalar_t>
__global__ void __launch_bounds__(kMaxThreads, min_blocks_per_multiprocessor<scalar_t>()) forward_kernel(
    const __grid_constant__ CUtensorMap value_map, const __grid_constant__ Problem<scalar_t> p,
    const __grid_constant__ LaunchShape s,
    scalar_t* __restrict__ output) {
#if MMDEFORM_TMA_HOPPER_DEVICE
  using coord_t = coord_type<scalar_t>;
  using acc_t = acc_type<scalar_t>;
  constexpr int kChunkBytes = 16;
  constexpr int VEC = kChunkBytes / static_cast<int>(sizeof(scalar_t));
  constexpr int kSlots = max_forward_slots_per_team(VEC);
  extern __shared__ __align__(128) char dynamic_smem[];

  if (!level_geometry_ok(p.spatial_shapes, p.level_start, p.levels, p.num_keys)) {
    poison_outputs(p, output);  // inconsistent level metadata: loud, and nothing is read
    return;
  }
  const Ring<coord_t> ring{dynamic_smem, &s};
  const int groups = tile_groups(p, s);
  const int num_tiles = p.num_items / (p.queries * p.heads) * groups * p.heads;
  init_ring(ring, &value_map);
  if (threadIdx.x < 32) {
    run_producer(p, ring, &value_map, groups, num_tiles);
    return;
  }

  const ConsumerLane cl = consumer_lane(s);
  const int64_t key_stride = static_cast<int64_t>(p.heads) * p.channels;
  const uint32_t zeros = smem_address(ring.zeros());
  acc_t acc[kSlots][VEC];
#pragma unroll
  for (int j = 0; j < kSlots; ++j)
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[j][k] = acc_t(0);

  StageCursor at{static_cast<int>(blockIdx.x), 0, 0, 0u};
  Tile t{};
  while (at.tile < num_tiles) {
    if (at.level == 0) t = tile_at(p, s, groups, at.tile);
    mbarrier_wait(ring.full(at.stage), at.round & 1u);
    const StageWindow w = *ring.header(at.stage);
    const WindowPoint<coord_t>* meta = ring.meta(at.stage);
    const uint32_t window = smem_address(ring.window(at.stage));
    const scalar_t* lane_value = p.value + t.head * p.channels + cl.lane * VEC;
    const int64_t row_stride = static_cast<int64_t>(w.width) * key_stride;
#pragma unroll
    for (int j = 0; j < kSlots; ++j) {
      if (j >= s.slots_per_team) break;
      const WindowPoint<coord_t>* slot_meta = meta + (cl.team + j * cl.teams) * p.points;
#pragma unroll 1
      for (int point = 0; point < p.points; ++point) {  // branch-free: a missing point reads zeros
        const WindowPoint<coord_t> m = slot_meta[point];
        const auto corners =
            load_point<scalar_t, VEC>(m, w.rows > 0, window, zeros, s, cl, lane_value, key_stride, row_stride);
        use_corners<scalar_t, VEC>(corners, [&](int c, const acc_t (&v)[VEC]) {
          const acc_t weight = static_cast<acc_t>(m.weight[c]);
#pragma unroll
          for (int k = 0; k < VEC; ++k) acc[j][k] = fma(weight, v[k], acc[j][k]);
        });
      }
    }
    mbarrier_arrive(ring.empty(at.stage));
    if (at.level == p.levels - 1) {
#pragma unroll
      for (int j = 0; j < kSlots; ++j) {
        if (j >= s.slots_per_team) break;
        const int query = tile_query(t, s, cl.team + j * cl.teams, p.queries);
        if (query >= 0) {
          const int64_t row = (static_cast<int64_t>(t.batch) * p.queries + query) * p.heads + t.head;
          store_vec(output + row * p.channels + cl.lane * VEC, from_acc_vec<scalar_t, VEC>(acc[j]));
        }
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[j][k] = acc_t(0);
      }
    }
    at.advance(p.levels, s.stages);
  }
#else
  __trap();
#endif
}

}  // namespace

at::Tensor forward(const ProblemTensors& problem, int64_t config) {
  at::Tensor output = at::empty({problem.batch, problem.queries, problem.heads * problem.channels}, problem.value.options());
  if (problem.empty_output()) return output;
  if (problem.levels * problem.points == 0) return output.zero_();
  hopper::require_hopper("tma_ws");
  hopper::require_tma_channels(problem.value, "tma_ws");
  MMDEFORM_TMA_DISPATCH_VALUE_TYPES(problem.value.scalar_type(), "mmdeform_tma tma_ws forward", [&] {
    constexpr int kVec = 16 / static_cast<int>(sizeof(scalar_t));
    const LaunchShape s = launch_shape(problem, config, 16, sizeof(WindowPoint<coord_type<scalar_t>>),
                                       max_forward_slots_per_team(kVec), false);
    launch_persistent<scalar_t>(forward_kernel<scalar_t>, problem, s, reinterpret_cast<scalar_t*>(output.data_ptr()));
  });
  return output;
}

}  // namespace tma_ws
}  // namespace mmdeform_tma
