// `tma_ws` backward: the window pipeline's consumers scatter each point's value-gradient
// contributions and reduce its location and attention gradients.
//
// For fp16 / bf16 values, the contributions of window points are first summed per tile in a
// shared-memory window of 32-bit fixed-point integers; after the stage the consumers flush it, one
// 16-byte fp32 vector reduction per non-zero chunk, and clear it. A window cell hit by several
// corners of a tile then costs one global reduction instead of one per corner. Integers, because
// sm_90 has no native shared-memory float addition (ptxas emits a compare-and-swap loop, measured
// 8x slower than the direct global reductions); their quantum is tiles' worst case, slots x points
// x max|attention| x max|grad_output| / 2^30, about 1e-6 of the largest contribution: far below
// half-precision rounding, but not below fp32's, so fp32 / fp64 values (and the deterministic
// fixed-point sink, whose exact sums must not depend on tiles) reduce every contribution directly.
#include <type_traits>

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

__device__ __forceinline__ void shared_add(uint32_t address, int v) {
  asm volatile("red.shared.add.s32 [%0], %1;" ::"r"(address), "r"(v) : "memory");
}

// 2^30 / (contributions a window cell can receive in a stage x the largest finite contribution):
// a cell's sum never leaves the int32 range.
__device__ __forceinline__ float window_scale(const FixedPointBounds* bounds, int contributions_per_cell) {
  const double bound = static_cast<double>(contributions_per_cell) * __uint_as_float(bounds->max_abs_weight_bits) *
                       __uint_as_float(bounds->max_abs_grad_bits);
  return bound > 0.0 ? static_cast<float>(1073741824.0 / bound) : 1.0f;
}

// Adds the stage's fixed-point gradient window to global memory and clears it (consumer threads).
__device__ __forceinline__ void flush_gradient_window(char* grad_window, const StageWindow& w, const LaunchShape& s,
                                                      int channels, int64_t key_stride, int64_t head_offset,
                                                      float inv_scale, float* __restrict__ grad) {
  const int chunks_log2 = __ffs(channels / 4) - 1;  // 4 integers per chunk; channels / 4 is a power of two
  const int cols_log2 = __ffs(s.window_cols) - 1;
  const int total = (w.rows * s.window_cols) << chunks_log2;
  const uint32_t base = smem_address(grad_window);
  for (int i = threadIdx.x - 32; i < total; i += s.consumer_warps * 32) {
    const int cell = i >> chunks_log2, part = i & ((1 << chunks_log2) - 1);
    const int row = cell >> cols_log2, col = cell & (s.window_cols - 1);
    if (col >= w.cols) continue;  // past the level's right edge: never written
    int4 sum;
    asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(sum.x), "=r"(sum.y), "=r"(sum.z), "=r"(sum.w)
                 : "r"(base + 16 * i));
    if ((sum.x | sum.y | sum.z | sum.w) == 0) continue;  // untouched, or summed to exactly zero
    const int64_t key = static_cast<int64_t>(w.key0) + static_cast<int64_t>(row) * w.width + col;
    red_add_f32x4(grad + key * key_stride + head_offset + part * 4, sum.x * inv_scale, sum.y * inv_scale,
                  sum.z * inv_scale, sum.w * inv_scale);
    asm volatile("st.shared.v4.s32 [%0], {%1, %1, %1, %1};" ::"r"(base + 16 * i), "r"(0) : "memory");
  }
}

// Whether a kernel sums window contributions in shared memory (see the top of this file).
template <typename scalar_t, typename Sink>
constexpr bool aggregates() {
  return sizeof(scalar_t) == 2 && std::is_same_v<Sink, AtomicSink<acc_type<scalar_t>>>;
}

template <typename scalar_t, int kChunkBytes, typename Sink>
__global__ void __launch_bounds__(kMaxThreads, min_blocks_per_multiprocessor<scalar_t, sizeof(scalar_t) == 2 && kChunkBytes == 16>())
    backward_kernel(
    const __grid_constant__ CUtensorMap value_map, const __grid_constant__ Problem<scalar_t> p,
    const __grid_constant__ LaunchShape s,
    const scalar_t* __restrict__ grad_output, Sink sink, coord_type<scalar_t>* __restrict__ grad_locations,
    coord_type<scalar_t>* __restrict__ grad_weights) {
#if MMDEFORM_TMA_HOPPER_DEVICE
  using coord_t = coord_type<scalar_t>;
  using acc_t = acc_type<scalar_t>;
  constexpr int VEC = kChunkBytes / static_cast<int>(sizeof(scalar_t));
  constexpr bool kAggregate = aggregates<scalar_t, Sink>();
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
  const uint32_t grad_window = smem_address(ring.grad_window());
  const int points = p.levels * p.points;
  float scale = 1.0f;
  if constexpr (kAggregate) {
    if (s.grad_bytes > 0) scale = window_scale(sink.bounds, s.slots * p.points);
  }

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
        const bool in_window = kAggregate && w.rows > 0 && m.cell >= 0;
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
          if (in_window) {
            const int cell = m.cell + (c & 1) + ((c & 2) ? s.window_cols : 0);
            const uint32_t at_cell = grad_window + static_cast<uint32_t>((cell * p.channels + cl.lane * VEC) * 4);
            const int64_t key = static_cast<int64_t>(m.key) + (c & 1) + ((c & 2) ? w.width : 0);
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
              if (isfinite(contribution[k])) {
                shared_add(at_cell + 4 * k, __float2int_rn(contribution[k] * scale));
              } else {  // NaN / Inf cannot be fixed point: straight to global memory, as IEEE adds it
                atomicAdd(sink.grad + key * key_stride + head_offset + k, contribution[k]);
              }
            }
          } else {
            const int64_t key = static_cast<int64_t>(m.key) + (c & 1) + ((c & 2) ? w.width : 0);
            sink.add(key * key_stride + head_offset, contribution);
          }
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
    if constexpr (kAggregate) {
      if (w.rows > 0) {
        consumer_barrier(s);  // every contribution of the stage is in the window
        flush_gradient_window(ring.grad_window(), w, s, p.channels, key_stride, static_cast<int64_t>(t.head) * p.channels,
                              1.0f / scale, sink.grad);
        consumer_barrier(s);  // cleared before the next stage adds to it
      }
    }
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
  const bool aggregate = element == 2 && !deterministic;
  const LaunchShape s =
      launch_shape(problem, config, chunk_bytes, meta_size, kMaxBackwardSlotsPerTeam, true, aggregate);
  return run_backward(
      problem, grad_output, deterministic, "mmdeform_tma tma_ws backward",
      [&](auto sink, const auto* go, auto* grad_locations, auto* grad_weights) {
        using scalar_t = ScalarOf<decltype(go)>;
        hopper::with_backward_chunk<scalar_t>(static_cast<int>(problem.channels), [&](auto chunk) {
          launch_persistent<scalar_t>(backward_kernel<scalar_t, decltype(chunk)::value, decltype(sink)>, problem, s, go,
                                      sink, grad_locations, grad_weights);
        });
      },
      /*atomic_bounds=*/s.grad_bytes > 0);
}

}  // namespace tma_ws
}  // namespace mmdeform_tma
