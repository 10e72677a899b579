// `tma_ws` backward: the window pipeline's consumers scatter each point's value-gradient
// contributions (vector reductions into global memory) and reduce its location and attention
// gradients; window points read their corners from shared memory.
//
// Summing a tile's contributions in a shared-memory window first, to reduce fewer times into L2,
// was measured and lost on every shape (docs/perf_notes.md): sm_90 has no native shared-memory
// float addition (ptxas emits a compare-and-swap loop), and native 32-bit integer reductions on
// fixed-point values still cost more per element than the global vector reductions they saved.
#include "../common/grad_accumulation.cuh"
#include "../common/launchers.h"
#include "backward_chunk.h"
#include "window_launch.cuh"
#include "window_pipeline.cuh"

namespace mmdeform_tma {
namespace tma_ws {
namespace {

using namespace hopper;
using namespace hopper::window;

template <typename scalar_t>
__device__ __forceinline__ void poison_coordinate_gradients(const Problem<scalar_t>& p,
                                                            coord_type<scalar_t>* grad_locations,
                                                            coord_type<scalar_t>* grad_weights) {
  using coord_t = coord_type<scalar_t>;
  const int64_t total = static_cast<int64_t>(p.num_items) * p.levels * p.points;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    grad_weights[i] = grad_locations[2 * i] = grad_locations[2 * i + 1] = quiet_nan<coord_t>();
  }
}

template <typename scalar_t, int kChunkBytes, typename Sink>
__global__ void __launch_bounds__(kMaxThreads, min_blocks_per_multiprocessor<scalar_t>())
    backward_kernel(
    const __grid_constant__ CUtensorMap value_map, const __grid_constant__ Problem<scalar_t> p,
    const __grid_constant__ LaunchShape s,
    const scalar_t* __restrict__ grad_output, Sink sink, coord_type<scalar_t>* __restrict__ grad_locations,
    coord_type<scalar_t>* __restrict__ grad_weights) {
#if MMDEFORM_TMA_HOPPER_DEVICE
  using coord_t = coord_type<scalar_t>;
  using acc_t = acc_type<scalar_t>;
  constexpr int VEC = kChunkBytes / static_cast<int>(sizeof(scalar_t));
  extern __shared__ __align__(128) char dynamic_smem[];

  if (!level_geometry_ok(p.spatial_shapes, p.level_start, p.levels, p.num_keys)) {
    poison_coordinate_gradients(p, grad_locations, grad_weights);  // value gradients stay zero
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

  sink.prepare();
  const ConsumerLane cl = consumer_lane(s);
  const unsigned mask = team_mask(s.team);
  const int64_t key_stride = static_cast<int64_t>(p.heads) * p.channels;
  const uint32_t zeros = smem_address(ring.zeros());
  const int points = p.levels * p.points;

  StageCursor at{static_cast<int>(blockIdx.x), 0, 0, 0u};
  Tile t{};
  while (at.tile < num_tiles) {
    if (at.level == 0) t = tile_at(p, s, groups, at.tile);
    mbarrier_wait(ring.full(at.stage), at.round & 1u);
    const StageWindow w = *ring.header(at.stage);
    const WindowPoint<coord_t>* meta = ring.meta(at.stage);
    const uint32_t window = smem_address(ring.window(at.stage));
    const int64_t head_offset = static_cast<int64_t>(t.head) * p.channels + cl.lane * VEC;
    const scalar_t* lane_value = p.value + head_offset;
    const int64_t row_stride = static_cast<int64_t>(w.width) * key_stride;
    for (int j = 0; j < s.slots_per_team; ++j) {
      const int slot = cl.team + j * cl.teams;
      const int query = tile_query(t, s, slot, p.queries);
      const int64_t row = (static_cast<int64_t>(t.batch) * p.queries + max(query, 0)) * p.heads + t.head;
      coord_t* g_weights = grad_weights + row * points + at.level * p.points;
      coord_t* g_locations = grad_locations + 2 * (row * points + at.level * p.points);
      acc_t go[VEC];  // reloaded per level (an L1/L2 hit): registers stay free of the other queries
      to_acc(load_vec<scalar_t, VEC>(grad_output + row * p.channels + cl.lane * VEC), go);
      const WindowPoint<coord_t>* slot_meta = meta + slot * p.points;
#pragma unroll 1
      for (int point = 0; point < p.points; ++point) {
        const WindowPoint<coord_t> m = slot_meta[point];
        if (!m.valid) {  // the whole team skips: no shuffle below is left half-joined
          if (query >= 0 && cl.lane == 0) {
            g_weights[point] = coord_t(0);
            g_locations[2 * point] = g_locations[2 * point + 1] = coord_t(0);
          }
          continue;
        }
        acc_t dot[4];
        const auto corners =
            load_point<scalar_t, VEC>(m, w.rows > 0, window, zeros, s, cl, lane_value, key_stride, row_stride);
        use_corners<scalar_t, VEC>(corners, [&](int c, const acc_t (&v)[VEC]) {
          dot[c] = acc_t(0);
#pragma unroll
          for (int k = 0; k < VEC; ++k) dot[c] = fma(go[k], v[k], dot[c]);
          if (!(m.valid & (1u << c))) return;
          const acc_t weight = static_cast<acc_t>(m.weight[c]);
          acc_t contribution[VEC];
#pragma unroll
          for (int k = 0; k < VEC; ++k) contribution[k] = weight * go[k];
          const int64_t key = static_cast<int64_t>(m.key) + (c & 1) + ((c & 2) ? w.width : 0);
          sink.add(key * key_stride + head_offset, contribution);
        });
        const acc_t ly = m.ly, lx = m.lx, hy = acc_t(1) - ly, hx = acc_t(1) - lx;
        acc_t grad_a = hy * hx * dot[kTopLeft] + hy * lx * dot[kTopRight] + ly * hx * dot[kBottomLeft] +
                       ly * lx * dot[kBottomRight];
        acc_t grad_x = hy * (dot[kTopRight] - dot[kTopLeft]) + ly * (dot[kBottomRight] - dot[kBottomLeft]);
        acc_t grad_y = hx * (dot[kBottomLeft] - dot[kTopLeft]) + lx * (dot[kBottomRight] - dot[kTopRight]);
        grad_a = team_sum(grad_a, mask, s.team);
        grad_x = team_sum(grad_x, mask, s.team);
        grad_y = team_sum(grad_y, mask, s.team);
        if (query >= 0 && cl.lane == 0) {
          g_weights[point] = grad_a;
          g_locations[2 * point] = m.attention * coord_t(w.width) * grad_x;
          g_locations[2 * point + 1] = m.attention * coord_t(w.height) * grad_y;
        }
      }
    }
    mbarrier_arrive(ring.empty(at.stage));
    at.advance(p.levels, s.stages);
  }
#else
  __trap();
#endif
}

}  // namespace

Gradients backward(const ProblemTensors& problem, const at::Tensor& grad_output, int64_t config, bool deterministic) {
  hopper::require_hopper("tma_ws");
  hopper::require_tma_channels(problem.value, "tma_ws");
  const int element = static_cast<int>(problem.value.element_size());
  const int chunk_bytes = hopper::backward_chunk_bytes(static_cast<int>(problem.channels), element);
  const int meta_size = static_cast<int>(element == 8 ? sizeof(WindowPoint<double>) : sizeof(WindowPoint<float>));
  const LaunchShape s = launch_shape(problem, config, chunk_bytes, meta_size, kMaxBackwardSlotsPerTeam, true);
  return run_backward(
      problem, grad_output, deterministic, "mmdeform_tma tma_ws backward",
      [&](auto sink, const auto* go, auto* grad_locations, auto* grad_weights) {
        using scalar_t = ScalarOf<decltype(go)>;
        hopper::with_backward_chunk<scalar_t>(static_cast<int>(problem.channels), [&](auto chunk) {
          launch_persistent<scalar_t>(backward_kernel<scalar_t, decltype(chunk)::value, decltype(sink)>, problem, s, go,
                                      sink, grad_locations, grad_weights);
        });
      });
}

}  // namespace tma_ws
}  // namespace mmdeform_tma
