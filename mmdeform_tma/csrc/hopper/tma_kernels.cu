// `tma` backend: every warp runs its own software pipeline. Lanes that lead a team compute their
// item's next point, write its metadata to shared memory and issue its two TMA boxes into a
// STAGES-deep ring of the warp; one mbarrier per stage counts the bytes. The whole warp then
// interpolates the oldest stage from shared memory. The stream of (item group, point) pairs is
// flat, so the pipeline stays full across item boundaries (the next items' points are in flight
// while the current ones finish).
#include <c10/cuda/CUDAException.h>

#include "../common/cuda_runtime_utils.h"
#include "../common/dtype_dispatch.cuh"
#include "../common/kernel_catalog.h"
#include "../common/launchers.h"
#include "point_pipeline.cuh"
#include "tensor_map.h"

namespace mmdeform_tma {
namespace tma {
namespace {

using hopper::LaneRole;
using hopper::PointMeta;
using hopper::TeamShape;

constexpr int kMaxWarps = 8;

struct Config {
  const char* name;
  int stages;
  int warps;
};

const std::vector<Config>& configs() {
  static const std::vector<Config> all = {
      {"s2_w8", 2, 8}, {"s3_w8", 3, 8}, {"s4_w8", 4, 8}, {"s1_w8", 1, 8}, {"s2_w4", 2, 4}, {"s4_w4", 4, 4},
  };
  return all;
}

std::vector<std::string> config_names() {
  std::vector<std::string> names;
  for (const auto& c : configs()) names.emplace_back(c.name);
  return names;
}

const KernelConfigRegistration kForward("tma", "forward", config_names());
const KernelConfigRegistration kBackward("tma", "backward", config_names());

// Shared memory of one warp: [stage][item][row] box slots, then [stage][item] metadata, then
// [stage] mbarriers; each region 128-byte aligned.
struct WarpRing {
  int data_bytes, meta_bytes, bar_bytes;
  __host__ __device__ int bytes() const { return data_bytes + meta_bytes + bar_bytes; }
};

template <typename coord_t>
__host__ __device__ inline WarpRing warp_ring(const TeamShape& s, int stages) {
  auto round = [](int x) { return (x + 127) / 128 * 128; };
  return WarpRing{
      round(stages * s.items_per_warp * 2 * s.slot_bytes),
      round(stages * s.items_per_warp * static_cast<int>(sizeof(PointMeta<coord_t>))),
      round(stages * 8)};
}

// kChunkBytes: bytes of a corner row per lane (hopper::backward_chunk_bytes).
template <typename scalar_t, bool kBackward, int kChunkBytes, typename Sink>
__global__ void __launch_bounds__(kMaxWarps * 32, 1) tma_kernel(
    const __grid_constant__ CUtensorMap value_map,
    const Problem<scalar_t> p,
    const int stages,
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
  const LaneRole role = hopper::lane_role(s);
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int warps_per_block = blockDim.x / 32;
  const int points = p.levels * p.points;
  const int G = s.items_per_warp;
  const int num_groups = (p.num_items + G - 1) / G;
  const int warp_global = blockIdx.x * warps_per_block + warp;
  const int warps_total = gridDim.x * warps_per_block;
  const int groups_mine = warp_global < num_groups ? (num_groups - warp_global + warps_total - 1) / warps_total : 0;

  if (!level_geometry_ok(p.spatial_shapes, p.level_start, p.levels, p.num_keys)) {
    // Inconsistent level metadata on the device: poison this warp's outputs, read nothing.
    for (int k = 0; k < groups_mine; ++k) {
      const int item = (warp_global + k * warps_total) * G + role.group;
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

  const uintptr_t base_address = (reinterpret_cast<uintptr_t>(dynamic_smem) + 127) & ~uintptr_t(127);
  const WarpRing ring = warp_ring<coord_t>(s, stages);
  char* warp_smem = reinterpret_cast<char*>(base_address) + warp * ring.bytes();
  char* data = warp_smem;
  PointMeta<coord_t>* meta = reinterpret_cast<PointMeta<coord_t>*>(warp_smem + ring.data_bytes);
  uint64_t* bars = reinterpret_cast<uint64_t*>(warp_smem + ring.data_bytes + ring.meta_bytes);
  auto slot = [&](int stage, int group, int row) {
    return data + ((stage * G + group) * 2 + row) * s.slot_bytes;
  };

  if (lane == 0) {
    hopper::prefetch_tensor_map(&value_map);
    for (int i = 0; i < stages; ++i) hopper::mbarrier_init(&bars[i], 1);
    hopper::fence_mbarrier_init();
  }
  __syncwarp();
  sink.prepare();

  const int total = groups_mine * points;
  // Producer cursor: the next (group, point) to issue and its ring stage.
  int issue_group = 0, issue_point = 0, issue_stage = 0, issue_item = warp_global * G + lane;
  auto issue = [&]() {
    uint32_t bytes = 0;
    PointMeta<coord_t> m;
    if (lane < G) {
      m = hopper::point_meta(p, issue_item, issue_point);
      meta[issue_stage * G + lane] = m;
      bytes = hopper::point_load_bytes(m, s);
    }
    bytes = __reduce_add_sync(0xffffffffu, bytes);
    if (lane == 0) hopper::mbarrier_arrive_expect_tx(&bars[issue_stage], bytes);
    __syncwarp();
    if (lane < G && m.valid) {
      hopper::fence_proxy_async_shared();  // this warp's earlier reads of the slot come first
      hopper::issue_point_loads(m, &value_map, issue_item % p.heads, p.channels, slot(issue_stage, lane, 0),
                                slot(issue_stage, lane, 1), &bars[issue_stage]);
    }
    if (++issue_stage == stages) issue_stage = 0;
    if (++issue_point == points) {
      issue_point = 0;
      ++issue_group;
      issue_item += warps_total * G;
    }
  };

  for (int f = 0; f < stages - 1 && f < total; ++f) issue();

  acc_t acc[VEC];
  acc_t go[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) acc[k] = go[k] = acc_t(0);
  const int group = role.active ? role.group : 0;
  int item = warp_global * G + role.group, point = 0, stage = 0;
  int64_t head_offset = static_cast<int64_t>(item % p.heads) * p.channels;
  uint32_t phase = 0;
  for (int f = 0; f < total; ++f) {
    if (f + stages - 1 < total) issue();
    const bool item_valid = role.active && item < p.num_items;
    if constexpr (kBackward) {
      if (point == 0 && item_valid) {
        to_acc(load_vec<scalar_t, VEC>(grad_output + static_cast<int64_t>(item) * p.channels + role.chunk * VEC), go);
      }
    }
    hopper::mbarrier_wait(&bars[stage], phase);
    const PointMeta<coord_t>& m = meta[stage * G + group];  // read in place: fields are indexed by lane
    const char* row0 = slot(stage, group, 0);
    const char* row1 = slot(stage, group, 1);
    if constexpr (kBackward) {
      acc_t ga, gx, gy;
      hopper::backward_point<scalar_t, VEC>(m, row0, row1, role, s, go, head_offset, p.heads, p.channels, sink, ga, gx,
                                            gy);
      const int64_t at = static_cast<int64_t>(item) * points + point;
      hopper::store_point_gradients(m, ga, gx, gy, role, s, item_valid, grad_locations + 2 * at, grad_weights + at);
    } else {
      hopper::accumulate_point<scalar_t, VEC>(m, row0, row1, role, s, acc);
      if (point == points - 1) {
        hopper::store_item_output<scalar_t, VEC>(acc, role, s, item_valid, output + static_cast<int64_t>(item) * p.channels);
      }
    }
    __syncwarp();  // every lane is done with this stage before it is refilled
    if (++stage == stages) {
      stage = 0;
      phase ^= 1u;
    }
    if (++point == points) {
      point = 0;
      item += warps_total * G;
      head_offset = static_cast<int64_t>(item % p.heads) * p.channels;
    }
  }
#else
  __trap();
#endif
}

template <typename scalar_t>
void check_tma_problem(const ProblemTensors& problem, const char* what) {
  hopper::require_hopper(what);
  hopper::require_tma_channels(problem.value, what);
}

Config choose_config(int64_t config) {
  if (config < 0) return configs()[0];
  TORCH_CHECK(config < static_cast<int64_t>(configs().size()), "mmdeform_tma tma: config ", num(config), " out of range");
  return configs()[config];
}

// Launches one persistent-style grid: enough warps to fill every SM at the occupancy the shared
// memory allows, each walking its share of the item groups.
template <typename scalar_t, bool kBackward, int kChunkBytes, typename Sink>
void launch(const ProblemTensors& problem, const Config& config, scalar_t* output, const scalar_t* grad_output,
            Sink sink, coord_type<scalar_t>* grad_locations, coord_type<scalar_t>* grad_weights) {
  using coord_t = coord_type<scalar_t>;
  const TeamShape s = hopper::team_shape(static_cast<int>(problem.channels), sizeof(scalar_t), kChunkBytes);
  const int smem = config.warps * warp_ring<coord_t>(s, config.stages).bytes() + 128;
  auto kernel = tma_kernel<scalar_t, kBackward, kChunkBytes, Sink>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int blocks_per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, config.warps * 32, smem));
  TORCH_CHECK(blocks_per_sm > 0, "mmdeform_tma tma: config ", config.name, " does not fit on an SM");
  const int64_t groups = (problem.num_items() + s.items_per_warp - 1) / s.items_per_warp;
  const int64_t blocks = std::min<int64_t>((groups + config.warps - 1) / config.warps,
                                           static_cast<int64_t>(blocks_per_sm) * multiprocessor_count());
  const at::Tensor source = problem.batch * problem.num_keys > 0
                                ? problem.value
                                : at::zeros({1, 1, problem.heads, problem.channels}, problem.value.options());
  const CUtensorMap map = hopper::value_tensor_map(source, 2);
  kernel<<<static_cast<unsigned>(blocks), config.warps * 32, smem, current_stream()>>>(
      map, problem.problem<scalar_t>(), config.stages, output, grad_output, sink, grad_locations, grad_weights);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

at::Tensor forward(const ProblemTensors& problem, int64_t config) {
  at::Tensor output = uninitialized({problem.batch, problem.queries, problem.heads * problem.channels}, problem.value.options());
  if (problem.empty_output()) return output;
  if (problem.levels * problem.points == 0) return output.zero_();
  const Config cfg = choose_config(config);
  MMDEFORM_TMA_DISPATCH_VALUE_TYPES(problem.value.scalar_type(), "mmdeform_tma tma forward", [&] {
    check_tma_problem<scalar_t>(problem, "tma");
    launch<scalar_t, false, 16>(problem, cfg, reinterpret_cast<scalar_t*>(output.data_ptr()), nullptr,
                                hopper::NoSink{}, nullptr, nullptr);
  });
  return output;
}

Gradients backward(const ProblemTensors& problem, const at::Tensor& grad_output, int64_t config, bool deterministic) {
  return run_backward(problem, grad_output, deterministic, grad_value_layout(problem, deterministic),
                      "mmdeform_tma tma backward",
                      [&](auto sink, const auto* go, auto* grad_locations, auto* grad_weights) {
    using scalar_t = ScalarOf<decltype(go)>;
    check_tma_problem<scalar_t>(problem, "tma");
    const Config cfg = choose_config(config);
    hopper::with_backward_chunk<scalar_t>(static_cast<int>(problem.channels), [&](auto chunk) {
      launch<scalar_t, true, decltype(chunk)::value>(problem, cfg, nullptr, go, sink, grad_locations, grad_weights);
    });
  });
}

}  // namespace tma
}  // namespace mmdeform_tma
