// `tma_ws` backend: warp-specialised, persistent.
//
// A CTA is `producers` producer warps and 8 - producers consumer warps. A tile is one item group
// per consumer warp; a stage holds `points_per_stage` points of every item of a tile. Producers
// compute each point's metadata once, write it to shared memory and issue its TMA boxes; consumers
// interpolate (forward) or scatter gradients (backward) from shared memory.
//
// Hand-over per stage: `full[s]` (arrival count = producer threads, plus the TMA bytes) and
// `empty[s]` (arrival count = consumer threads). Every producer thread arrives on every full barrier
// and every consumer thread on every empty barrier, whatever the stage holds (a partial last tile,
// items past the end, points missing every level): arrival counts never depend on the data, which
// is what the earlier prototype's hang violated. Each thread's own arrive releases its own shared
// memory accesses, so the hand-over needs no warp-level reasoning (and compute-sanitizer's
// racecheck can follow it). CTAs walk a static, strided tile schedule, so both
// roles know the number of stages without talking to each other.
#include <c10/cuda/CUDAException.h>

#include "../common/cuda_runtime_utils.h"
#include "../common/dtype_dispatch.cuh"
#include "../common/kernel_catalog.h"
#include "../common/launchers.h"
#include "point_pipeline.cuh"
#include "tensor_map.h"

namespace mmdeform_tma {
namespace tma_ws {
namespace {

using hopper::LaneRole;
using hopper::PointMeta;
using hopper::TeamShape;

constexpr int kWarps = 8;

struct Config {
  std::string name;
  int producers;
  int stages;
  int points_per_stage;
};

const std::vector<Config>& configs() {
  static const std::vector<Config> all = [] {
    std::vector<Config> list;
    // The first entry is the default; the rest is the autotuner's search space.
    list.push_back({"p2c6_s3_q2", 2, 3, 2});
    for (int producers : {1, 2, 3, 4})
      for (int stages : {2, 3, 4})
        for (int points_per_stage : {1, 2, 4}) {
          const std::string name = "p" + std::to_string(producers) + "c" + std::to_string(kWarps - producers) + "_s" +
                                   std::to_string(stages) + "_q" + std::to_string(points_per_stage);
          if (name != list.front().name) list.push_back({name, producers, stages, points_per_stage});
        }
    return list;
  }();
  return all;
}

std::vector<std::string> config_names() {
  std::vector<std::string> names;
  for (const auto& c : configs()) names.push_back(c.name);
  return names;
}

const KernelConfigRegistration kForward("tma_ws", "forward", config_names());
const KernelConfigRegistration kBackward("tma_ws", "backward", config_names());

struct Layout {
  int tile_items;   // consumer warps x items per warp
  int stage_slots;  // tile_items x points_per_stage
  int data_bytes, meta_bytes, bar_bytes;
  __host__ __device__ int bytes() const { return data_bytes + meta_bytes + bar_bytes; }
};

template <typename coord_t>
__host__ __device__ inline Layout smem_layout(const TeamShape& s, int producers, int stages, int points_per_stage) {
  auto round = [](int x) { return (x + 127) / 128 * 128; };
  Layout l;
  l.tile_items = (kWarps - producers) * s.items_per_warp;
  l.stage_slots = l.tile_items * points_per_stage;
  l.data_bytes = round(stages * l.stage_slots * 2 * s.slot_bytes);
  l.meta_bytes = round(stages * l.stage_slots * static_cast<int>(sizeof(PointMeta<coord_t>)));
  l.bar_bytes = round(2 * stages * 8);
  return l;
}

// kChunkBytes: bytes of a corner row per lane (hopper::backward_chunk_bytes).
template <typename scalar_t, bool kBackward, int kChunkBytes, typename Sink>
__global__ void __launch_bounds__(kWarps * 32, 1) tma_ws_kernel(
    const __grid_constant__ CUtensorMap value_map,
    const Problem<scalar_t> p,
    const int producers,
    const int stages,
    const int points_per_stage,
    scalar_t* __restrict__ output,
    const scalar_t* __restrict__ grad_output,
    Sink sink,
    coord_type<scalar_t>* __restrict__ grad_locations,
    coord_type<scalar_t>* __restrict__ grad_weights) {
#if MMDEFORM_TMA_HOPPER_DEVICE
  using coord_t = coord_type<scalar_t>;
  using acc_t = acc_type<scalar_t>;
  constexpr int VEC = kChunkBytes / sizeof(scalar_t);
  static_assert(kChunkBytes == 16 || (kBackward && sizeof(scalar_t) == 2 && kChunkBytes == 8), "unplanned chunk size");
  extern __shared__ char dynamic_smem[];

  const TeamShape s = hopper::team_shape(p.channels, sizeof(scalar_t), kChunkBytes);
  const Layout layout = smem_layout<coord_t>(s, producers, stages, points_per_stage);
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int points = p.levels * p.points;
  const int chunks = (points + points_per_stage - 1) / points_per_stage;
  const int num_tiles = (p.num_items + layout.tile_items - 1) / layout.tile_items;
  const int tiles_mine = blockIdx.x < num_tiles ? (num_tiles - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  const int total = tiles_mine * chunks;
  const bool is_producer = warp < producers;
  const int consumer = warp - producers;
  const LaneRole role = hopper::lane_role(s);
  const int item_local = consumer * s.items_per_warp + role.group;  // consumers only

  if (!level_geometry_ok(p.spatial_shapes, p.level_start, p.levels, p.num_keys)) {
    if (is_producer) return;  // inconsistent level metadata: consumers poison their outputs, nothing is read
    for (int k = 0; k < tiles_mine; ++k) {
      const int item = (blockIdx.x + k * gridDim.x) * layout.tile_items + item_local;
      if (!role.active || item >= p.num_items) continue;
      const int64_t base = static_cast<int64_t>(item) * points;
      if constexpr (kBackward) {
        for (int i = role.lane; i < points; i += s.team) {
          grad_weights[base + i] = quiet_nan<coord_t>();
          grad_locations[2 * (base + i)] = grad_locations[2 * (base + i) + 1] = quiet_nan<coord_t>();
        }
      } else {
        for (int c = role.lane; c < p.channels; c += s.team) output[static_cast<int64_t>(item) * p.channels + c] = quiet_nan<scalar_t>();
      }
    }
    return;
  }

  char* smem = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(dynamic_smem) + 127) & ~uintptr_t(127));
  char* data = smem;
  PointMeta<coord_t>* meta = reinterpret_cast<PointMeta<coord_t>*>(smem + layout.data_bytes);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + layout.data_bytes + layout.meta_bytes);
  uint64_t* empty = full + stages;
  auto slot = [&](int stage, int index, int row) {
    return data + ((stage * layout.stage_slots + index) * 2 + row) * s.slot_bytes;
  };

  if (threadIdx.x == 0) {
    hopper::prefetch_tensor_map(&value_map);
    for (int i = 0; i < stages; ++i) {
      hopper::mbarrier_init(&full[i], producers * 32);
      hopper::mbarrier_init(&empty[i], (kWarps - producers) * 32);
    }
    hopper::fence_mbarrier_init();
  }
  __syncthreads();  // the last CTA-wide barrier: the roles below never wait for each other's exit

  if (is_producer) {
    const int pairs = layout.stage_slots;
    int stage = 0, tile = blockIdx.x, chunk = 0;
    uint32_t round = 0;
    for (int f = 0; f < total; ++f) {
      if (round > 0) hopper::mbarrier_wait(&empty[stage], (round - 1) & 1u);
      uint32_t bytes = 0;
      for (int pair = warp * 32 + lane; pair < pairs; pair += producers * 32) {
        const int index = pair / points_per_stage;
        const int point = chunk * points_per_stage + pair % points_per_stage;
        const int item = tile * layout.tile_items + index;
        PointMeta<coord_t> m = hopper::point_meta(p, point < points ? item : p.num_items, point);
        meta[stage * pairs + pair] = m;
        bytes += hopper::point_load_bytes(m, s);
      }
      bytes = __reduce_add_sync(0xffffffffu, bytes);
      if (lane == 0) {
        hopper::mbarrier_arrive_expect_tx(&full[stage], bytes);
      } else {
        hopper::mbarrier_arrive(&full[stage]);
      }
      __syncwarp();  // the expected bytes are posted before any of this warp's loads is issued
      hopper::fence_proxy_async_shared();
      for (int pair = warp * 32 + lane; pair < pairs; pair += producers * 32) {
        const PointMeta<coord_t>& m = meta[stage * pairs + pair];
        if (!m.valid) continue;
        const int item = tile * layout.tile_items + pair / points_per_stage;
        hopper::issue_point_loads(m, &value_map, item % p.heads, p.channels, slot(stage, pair, 0), slot(stage, pair, 1),
                                  &full[stage]);
      }
      if (++stage == stages) {
        stage = 0;
        ++round;
      }
      if (++chunk == chunks) {
        chunk = 0;
        tile += gridDim.x;
      }
    }
    return;
  }

  sink.prepare();
  acc_t acc[VEC];
  acc_t go[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) acc[k] = go[k] = acc_t(0);
  const int index_base = (role.active ? item_local : 0) * points_per_stage;
  int stage = 0, chunk = 0;
  int item = blockIdx.x * layout.tile_items + item_local;
  int64_t head_offset = static_cast<int64_t>(item % p.heads) * p.channels;
  uint32_t phase = 0;
  for (int f = 0; f < total; ++f) {
    const bool item_valid = role.active && item < p.num_items;
    if constexpr (kBackward) {
      if (chunk == 0 && item_valid) {
        to_acc(load_vec<scalar_t, VEC>(grad_output + static_cast<int64_t>(item) * p.channels + role.chunk * VEC), go);
      }
    }
    hopper::mbarrier_wait(&full[stage], phase);
    for (int q = 0; q < points_per_stage; ++q) {
      const int point = chunk * points_per_stage + q;
      if (point >= points) break;
      const int index = index_base + q;
      const PointMeta<coord_t>& m = meta[stage * layout.stage_slots + index];
      const char* row0 = slot(stage, index, 0);
      const char* row1 = slot(stage, index, 1);
      if constexpr (kBackward) {
        acc_t ga, gx, gy;
        hopper::backward_point<scalar_t, VEC>(m, row0, row1, role, s, go, head_offset, p.heads, p.channels, sink, ga, gx,
                                              gy);
        const int64_t at = static_cast<int64_t>(item) * points + point;
        hopper::store_point_gradients(m, ga, gx, gy, role, s, item_valid, grad_locations + 2 * at, grad_weights + at);
      } else {
        hopper::accumulate_point<scalar_t, VEC>(m, row0, row1, role, s, acc);
      }
    }
    hopper::mbarrier_arrive(&empty[stage]);
    if constexpr (!kBackward) {
      if (chunk == chunks - 1) {
        hopper::store_item_output<scalar_t, VEC>(acc, role, s, item_valid, output + static_cast<int64_t>(item) * p.channels);
      }
    }
    if (++stage == stages) {
      stage = 0;
      phase ^= 1u;
    }
    if (++chunk == chunks) {
      chunk = 0;
      item += gridDim.x * layout.tile_items;
      head_offset = static_cast<int64_t>(item % p.heads) * p.channels;
    }
  }
#else
  __trap();
#endif
}

Config choose_config(int64_t config) {
  if (config < 0) return configs()[0];
  TORCH_CHECK(config < static_cast<int64_t>(configs().size()), "mmdeform_tma tma_ws: config ", num(config), " out of range");
  return configs()[config];
}

// One CTA per SM slot the shared memory allows (persistent), each walking tiles blockIdx.x,
// blockIdx.x + gridDim.x, ...
template <typename scalar_t, bool kBackward, int kChunkBytes, typename Sink>
void launch(const ProblemTensors& problem, const Config& config, scalar_t* output, const scalar_t* grad_output,
            Sink sink, coord_type<scalar_t>* grad_locations, coord_type<scalar_t>* grad_weights) {
  using coord_t = coord_type<scalar_t>;
  const TeamShape s = hopper::team_shape(static_cast<int>(problem.channels), sizeof(scalar_t), kChunkBytes);
  const Layout layout = smem_layout<coord_t>(s, config.producers, config.stages, config.points_per_stage);
  const int smem = layout.bytes() + 128;
  auto kernel = tma_ws_kernel<scalar_t, kBackward, kChunkBytes, Sink>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int blocks_per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, kWarps * 32, smem));
  TORCH_CHECK(blocks_per_sm > 0, "mmdeform_tma tma_ws: config ", config.name, " does not fit on an SM");
  const int64_t tiles = (problem.num_items() + layout.tile_items - 1) / layout.tile_items;
  const int64_t blocks = std::min<int64_t>(tiles, static_cast<int64_t>(blocks_per_sm) * multiprocessor_count());
  const at::Tensor source = problem.batch * problem.num_keys > 0
                                ? problem.value
                                : at::zeros({1, 1, problem.heads, problem.channels}, problem.value.options());
  const CUtensorMap map = hopper::value_tensor_map(source);
  kernel<<<static_cast<unsigned>(blocks), kWarps * 32, smem, current_stream()>>>(
      map, problem.problem<scalar_t>(), config.producers, config.stages, config.points_per_stage, output, grad_output,
      sink, grad_locations, grad_weights);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void check_problem_for_tma_ws(const ProblemTensors& problem) {
  hopper::require_hopper("tma_ws");
  hopper::require_tma_channels(problem.value, "tma_ws");
}

}  // namespace

at::Tensor forward(const ProblemTensors& problem, int64_t config) {
  at::Tensor output = at::empty({problem.batch, problem.queries, problem.heads * problem.channels}, problem.value.options());
  if (problem.empty_output()) return output;
  if (problem.levels * problem.points == 0) return output.zero_();
  check_problem_for_tma_ws(problem);
  const Config cfg = choose_config(config);
  MMDEFORM_TMA_DISPATCH_VALUE_TYPES(problem.value.scalar_type(), "mmdeform_tma tma_ws forward", [&] {
    launch<scalar_t, false, 16>(problem, cfg, reinterpret_cast<scalar_t*>(output.data_ptr()), nullptr,
                                hopper::NoSink{}, nullptr, nullptr);
  });
  return output;
}

Gradients backward(const ProblemTensors& problem, const at::Tensor& grad_output, int64_t config, bool deterministic) {
  return run_backward(problem, grad_output, deterministic, "mmdeform_tma tma_ws backward",
                      [&](auto sink, const auto* go, auto* grad_locations, auto* grad_weights) {
    using scalar_t = ScalarOf<decltype(go)>;
    check_problem_for_tma_ws(problem);
    const Config cfg = choose_config(config);
    hopper::with_backward_chunk<scalar_t>(static_cast<int>(problem.channels), [&](auto chunk) {
      launch<scalar_t, true, decltype(chunk)::value>(problem, cfg, nullptr, go, sink, grad_locations, grad_weights);
    });
  });
}

}  // namespace tma_ws
}  // namespace mmdeform_tma
