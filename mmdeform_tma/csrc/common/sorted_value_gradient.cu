#include "sorted_value_gradient.h"

// The toolkit's cub: its symbols sit in a namespace versioned by release and architecture
// (cub::CUB_300001_SM_900 with CUDA 13.0), torch's copy in at_cuda_detail, so the two cannot clash.
#include <cub/device/device_radix_sort.cuh>

#include "cuda_runtime_utils.h"
#include <c10/cuda/CUDAException.h>

#include <climits>
#include <cstdint>

#include "device_utils.cuh"
#include "dtype_dispatch.cuh"
#include "launchers.h"

namespace mmdeform_tma {
namespace {

constexpr int kThreads = 256;

// A lane's vector: 16 bytes where the row is whole 16-byte chunks, else one element.
template <typename scalar_t>
constexpr int wide_vec() {
  return 16 / static_cast<int>(sizeof(scalar_t));
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

int vec_elements(const ProblemTensors& problem, const at::Tensor& grad_output) {
  const int64_t wide = 16 / problem.value.element_size();
  const bool fits = problem.channels % wide == 0 && aligned16(problem.value) && aligned16(grad_output);
  return fits ? static_cast<int>(wide) : 1;
}

int team_log2_for(int64_t lanes) {
  int log2 = 0;
  while ((int64_t{1} << log2) < lanes) ++log2;
  return log2;
}

// Step 1: a team per sampling point (item, level, point), numbered as locations are. Lane 0
// writes the point's gradients and its four entries; the team's lanes share the dot products.
template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kThreads) sorted_point_gradients_kernel(
    const Problem<scalar_t> p, const scalar_t* __restrict__ grad_output, coord_type<scalar_t>* __restrict__ grad_locations,
    coord_type<scalar_t>* __restrict__ grad_weights, int32_t* __restrict__ keys, int32_t* __restrict__ entry_index,
    acc_type<scalar_t>* __restrict__ entry_weights, int32_t no_cell, int team_log2) {
  using coord_t = coord_type<scalar_t>;
  using acc_t = acc_type<scalar_t>;
  const int team = 1 << team_log2;
  const int lane = threadIdx.x & (team - 1);
  const int64_t point = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> team_log2;
  const int64_t points_per_item = static_cast<int64_t>(p.levels) * p.points;
  if (point >= p.num_items * points_per_item) return;  // whole teams: team divides the block
  int32_t* point_keys = keys + 4 * point;
  acc_t* point_weights = entry_weights + 4 * point;
  if (lane == 0) {  // the sort's payload: each entry's own index
    const int32_t e = static_cast<int32_t>(4 * point);
    *reinterpret_cast<int4*>(entry_index + 4 * point) = make_int4(e, e + 1, e + 2, e + 3);
  }
  const auto no_entries = [&] {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      point_keys[c] = no_cell;
      point_weights[c] = acc_t(0);
    }
  };
  if (!level_geometry_ok(p.spatial_shapes, p.level_start, p.levels, p.num_keys)) {
    if (lane == 0) {  // as every backward kernel: NaN coordinate gradients, value gradients zero
      grad_weights[point] = quiet_nan<coord_t>();
      grad_locations[2 * point] = grad_locations[2 * point + 1] = quiet_nan<coord_t>();
      no_entries();
    }
    return;
  }
  const int item = static_cast<int>(point / points_per_item);
  const int level = static_cast<int>((point / p.points) % p.levels);
  const int head = item % p.heads;
  const int batch = item / (p.queries * p.heads);
  const LevelGeometry g = level_geometry(p.spatial_shapes, p.level_start, level);
  const coord_t a = p.weights[point];
  const Bilinear<coord_t> bl = bilinear(p.locations[2 * point], p.locations[2 * point + 1], g.height, g.width);
  if (!bl.valid) {  // uniform across the team
    if (lane == 0) {
      grad_weights[point] = coord_t(0);
      grad_locations[2 * point] = grad_locations[2 * point + 1] = coord_t(0);
      no_entries();
    }
    return;
  }
  const int channel = lane * VEC;
  const bool active = channel < p.channels;
  acc_t go[VEC];
  if (active) {
    to_acc(load_vec<scalar_t, VEC>(grad_output + static_cast<int64_t>(item) * p.channels + channel), go);
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) go[k] = acc_t(0);
  }
  const int64_t cell00 =
      (static_cast<int64_t>(batch) * p.num_keys + g.start + static_cast<int64_t>(bl.y0) * g.width + bl.x0) * p.heads + head;
  const int64_t row_cells = static_cast<int64_t>(g.width) * p.heads;
  int64_t cells[4];
  Vec<scalar_t, VEC> raw[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) {  // all four loads in flight before the dots
    cells[c] = cell00 + ((c & 1) ? p.heads : 0) + ((c & 2) ? row_cells : 0);
    raw[c] = (bl.valid & (1u << c)) && active ? load_vec<scalar_t, VEC>(p.value + cells[c] * p.channels + channel)
                                              : Vec<scalar_t, VEC>{};
  }
  acc_t dot[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    acc_t v[VEC];
    to_acc(raw[c], v);
    dot[c] = acc_t(0);
#pragma unroll
    for (int k = 0; k < VEC; ++k) dot[c] = fma(go[k], v[k], dot[c]);
  }
  const unsigned mask = team_mask(team);
  const CornerDotGradients<acc_t> grads = team_corner_dot_gradients(bl, dot, mask, team);
  if (lane == 0) {
    grad_weights[point] = grads.attention;
    grad_locations[2 * point] = a * coord_t(g.width) * grads.x;
    grad_locations[2 * point + 1] = a * coord_t(g.height) * grads.y;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const bool valid = bl.valid & (1u << c);
      point_keys[c] = valid ? static_cast<int32_t>(cells[c]) : no_cell;
      point_weights[c] = valid ? static_cast<acc_t>(a * bl.weight(c)) : acc_t(0);
    }
  }
}

// Step 3: a warp per chunk of 32 sorted entries. The warp stages the chunk's keys, output-gradient
// rows and weights in shared memory (coalesced keys, one gather of weights for all 32), and its
// teams take the cells that start in the chunk in turn: each sums weight x row over the cell's
// entries in sorted order and writes the cell's row. A cell that runs past the chunk reads its
// further entries from global memory. A team per entry instead, with the loads of index, weight and
// row chained per entry, took 26-30 us at DETR's decoder and 84-101 at DINO's (H100, session 31).
template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kThreads) sorted_cell_sums_kernel(
    const int32_t* __restrict__ sorted_keys, const int32_t* __restrict__ order,
    const acc_type<scalar_t>* __restrict__ entry_weights, int64_t entries, const scalar_t* __restrict__ grad_output,
    int channels, int entries_per_item, int32_t no_cell, int team_log2, scalar_t* __restrict__ grad_value) {
  using acc_t = acc_type<scalar_t>;
  constexpr int kWarps = kThreads / 32;
  __shared__ int32_t chunk_keys[kWarps][32];
  __shared__ int32_t chunk_rows[kWarps][32];
  __shared__ acc_t chunk_weights[kWarps][32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int64_t base = (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * 32;
  if (base >= entries) return;  // the whole warp
  const int64_t i = base + lane;
  const bool inside = i < entries;
  const int32_t key = inside ? sorted_keys[i] : no_cell;
  int32_t before = __shfl_up_sync(0xffffffffu, key, 1);
  if (lane == 0) before = base > 0 ? sorted_keys[base - 1] : -1;
  const int32_t entry = inside ? order[i] : 0;
  chunk_keys[warp][lane] = key;
  chunk_rows[warp][lane] = entry / entries_per_item;
  chunk_weights[warp][lane] = inside ? entry_weights[entry] : acc_t(0);
  const unsigned boundaries = __ballot_sync(0xffffffffu, key != before);  // a cell, or the invalid corners, begins
  const unsigned starts = __ballot_sync(0xffffffffu, key != before && key != no_cell);
  __syncwarp();
  const int teams = 32 >> team_log2;
  const int channel = (lane & ((1 << team_log2) - 1)) * VEC;
  if (channel >= channels) return;  // no collectives below
  int k = 0;
  for (unsigned pending = starts; pending != 0u; pending &= pending - 1u, ++k) {
    if (k % teams != (lane >> team_log2)) continue;
    const int first = __ffs(pending) - 1;
    const unsigned later = first == 31 ? 0u : boundaries & ~((2u << first) - 1u);
    const int end = later != 0u ? __ffs(later) - 1 : 32;  // the next boundary in the chunk
    const int32_t cell = chunk_keys[warp][first];
    acc_t sum[VEC];
#pragma unroll
    for (int v = 0; v < VEC; ++v) sum[v] = acc_t(0);
    const auto add = [&](int32_t row, acc_t weight) {
      acc_t go[VEC];
      to_acc(load_vec<scalar_t, VEC>(grad_output + static_cast<int64_t>(row) * channels + channel), go);
#pragma unroll
      for (int v = 0; v < VEC; ++v) sum[v] = fma(weight, go[v], sum[v]);
    };
#pragma unroll 4
    for (int j = first; j < end; ++j) add(chunk_rows[warp][j], chunk_weights[warp][j]);
    if (end == 32) {
      for (int64_t j = base + 32; j < entries && sorted_keys[j] == cell; ++j) {
        const int32_t e = order[j];
        add(e / entries_per_item, entry_weights[e]);
      }
    }
    store_vec(grad_value + static_cast<int64_t>(cell) * channels + channel, from_acc_vec<scalar_t, VEC>(sum));
  }
}

// Step 2: a stable radix sort of the entries by cell over the bits the cells need (cub's sort is
// stable: equal keys keep their input order).
void sort_entries(const at::Tensor& keys, const at::Tensor& index, at::Tensor& sorted_keys, at::Tensor& order, int end_bit) {
  const int n = static_cast<int>(keys.numel());
  size_t temp_bytes = 0;
  const auto stream = current_stream();
  C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys.data_ptr<int32_t>(), sorted_keys.data_ptr<int32_t>(),
                                                 index.data_ptr<int32_t>(), order.data_ptr<int32_t>(), n, 0, end_bit, stream));
  const at::Tensor temp = uninitialized({static_cast<int64_t>(temp_bytes)}, keys.options().dtype(at::kByte));
  C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.data_ptr(), temp_bytes, keys.data_ptr<int32_t>(),
                                                 sorted_keys.data_ptr<int32_t>(), index.data_ptr<int32_t>(),
                                                 order.data_ptr<int32_t>(), n, 0, end_bit, stream));
}

int64_t blocks_for(int64_t threads) { return (threads + kThreads - 1) / kThreads; }

}  // namespace

std::string sorted_backward_unsupported(const ProblemTensors& problem, const at::Tensor& grad_output) {
  const int vec = vec_elements(problem, grad_output);
  if (problem.channels > 32 * vec) {
    return "channels per head (" + num(problem.channels) + ") exceed a warp's one vector per lane (" + num(32 * vec) + ")";
  }
  if (problem.batch * problem.num_keys * problem.heads >= INT32_MAX) return "2^31 or more (batch, key, head) cells";
  if (4 * problem.num_items() * problem.levels * problem.points >= INT32_MAX) return "2^31 or more sampled corners";
  return {};
}

Gradients sorted_deterministic_backward(const ProblemTensors& problem, const at::Tensor& grad_output) {
  const auto coordinate_grads = coordinate_gradients(problem);
  const at::Tensor& grad_locations = coordinate_grads.first;
  const at::Tensor& grad_weights = coordinate_grads.second;
  // Untouched cells stay zero. A memset: at::zeros would also fill under torch's deterministic mode.
  at::Tensor grad_value = uninitialized(problem.value.sizes(), problem.value.options());
  C10_CUDA_CHECK(cudaMemsetAsync(grad_value.data_ptr(), 0, grad_value.nbytes(), current_stream()));
  const int64_t points = problem.num_items() * problem.levels * problem.points;
  if (problem.empty_output() || points == 0) {
    grad_locations.zero_();
    grad_weights.zero_();
    return {grad_value, grad_locations, grad_weights};
  }
  const int64_t entries = 4 * points;
  const auto acc_dtype = problem.value.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto int_options = problem.value.options().dtype(at::kInt);
  const at::Tensor keys = uninitialized({entries}, int_options), index = uninitialized({entries}, int_options);
  at::Tensor sorted_keys = uninitialized({entries}, int_options), order = uninitialized({entries}, int_options);
  const at::Tensor entry_weights = uninitialized({entries}, problem.value.options().dtype(acc_dtype));
  // Invalid corners take the key one past the last cell, which sorts last and bounds the sort's bits.
  const int32_t no_cell = static_cast<int32_t>(problem.batch * problem.num_keys * problem.heads);
  int end_bit = 1;
  while (end_bit < 31 && (int64_t{1} << end_bit) <= no_cell) ++end_bit;
  const int vec = vec_elements(problem, grad_output);
  const int team_log2 = team_log2_for((problem.channels + vec - 1) / vec);
  const auto stream = current_stream();
  MMDEFORM_TMA_DISPATCH_VALUE_TYPES(problem.value.scalar_type(), "mmdeform_tma sorted backward", [&] {
    using coord_t = coord_type<scalar_t>;
    using acc_t = acc_type<scalar_t>;
    const auto* go = reinterpret_cast<const scalar_t*>(grad_output.data_ptr());
    const auto launch_points = [&](auto kernel) {
      kernel<<<blocks_for(points << team_log2), kThreads, 0, stream>>>(
          problem.problem<scalar_t>(), go, grad_locations.data_ptr<coord_t>(), grad_weights.data_ptr<coord_t>(),
          keys.data_ptr<int32_t>(), index.data_ptr<int32_t>(), entry_weights.data_ptr<acc_t>(), no_cell, team_log2);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (vec > 1) {
      launch_points(sorted_point_gradients_kernel<scalar_t, wide_vec<scalar_t>()>);
    } else {
      launch_points(sorted_point_gradients_kernel<scalar_t, 1>);
    }
    sort_entries(keys, index, sorted_keys, order, end_bit);
    const auto launch_sums = [&](auto kernel) {
      kernel<<<blocks_for(entries), kThreads, 0, stream>>>(
          sorted_keys.data_ptr<int32_t>(), order.data_ptr<int32_t>(), entry_weights.data_ptr<acc_t>(), entries, go,
          static_cast<int>(problem.channels), static_cast<int>(4 * problem.levels * problem.points), no_cell, team_log2,
          reinterpret_cast<scalar_t*>(grad_value.data_ptr()));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (vec > 1) {
      launch_sums(sorted_cell_sums_kernel<scalar_t, wide_vec<scalar_t>()>);
    } else {
      launch_sums(sorted_cell_sums_kernel<scalar_t, 1>);
    }
  });
  return {grad_value, grad_locations, grad_weights};
}

}  // namespace mmdeform_tma
