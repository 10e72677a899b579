#include "cuda_runtime_utils.h"
#include <c10/cuda/CUDAException.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "dtype_dispatch.cuh"
#include "grad_accumulation.cuh"

namespace mmdeform_tma {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float abs_if_finite(float x) { return isfinite(x) ? fabsf(x) : 0.0f; }

// |x| as a float no smaller than it (0 for a non-finite x): exact below fp64, rounded up from fp64.
template <typename T>
__device__ __forceinline__ float abs_bound(T x) {
  if constexpr (std::is_same_v<T, double>) {
    return abs_if_finite(__double2float_ru(fabs(x)));
  } else {
    return abs_if_finite(static_cast<float>(x));
  }
}

// The largest abs_bound over p[0, n), this thread's share of a grid-stride loop: 16-byte loads where
// p is 16-byte aligned, four in flight. One element a load left the pass latency-bound (41.5 us for
// the fp16 bs 2 DETR encoder's 31 MB, H100; perf_notes item 118).
template <typename T>
__device__ __forceinline__ float max_abs_bound(const T* __restrict__ p, int64_t n, int64_t thread, int64_t threads) {
  constexpr int kPerLoad = 16 / sizeof(T);
  constexpr int kInFlight = 4;
  float m = 0.0f;
  const int64_t loads = reinterpret_cast<uintptr_t>(p) % 16 == 0 ? n / kPerLoad : 0;
  int64_t c = thread;
  for (; c + (kInFlight - 1) * threads < loads; c += kInFlight * threads) {
    Vec<T, kPerLoad> v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) v[u] = load_vec<T, kPerLoad>(p + (c + u * threads) * kPerLoad);
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
#pragma unroll
      for (int k = 0; k < kPerLoad; ++k) m = fmaxf(m, abs_bound(v[u].v[k]));
    }
  }
  for (; c < loads; c += threads) {
    const Vec<T, kPerLoad> v = load_vec<T, kPerLoad>(p + c * kPerLoad);
#pragma unroll
    for (int k = 0; k < kPerLoad; ++k) m = fmaxf(m, abs_bound(v.v[k]));
  }
  for (int64_t i = loads * kPerLoad + thread; i < n; i += threads) m = fmaxf(m, abs_bound(p[i]));
  return m;
}

// Touched cells, one byte per (batch, key, head) cell, nonzero when touched. `marks` null: every
// cell counts as touched.
struct TouchedCells {
  const uint8_t* __restrict__ marks;
  int64_t channels;

  __device__ __forceinline__ bool has_element(int64_t element) const {
    return marks == nullptr || __ldg(marks + element / channels) != 0;
  }
};

// Zeroes words [0, n) of p, this thread's share of a grid-stride loop: 16-byte stores, then the tail.
__device__ __forceinline__ void zero_words(uint32_t* __restrict__ p, int64_t n, int64_t thread, int64_t threads) {
  const int64_t vectors = n / 4;  // p is 16-byte aligned (a fresh allocation)
  for (int64_t i = thread; i < vectors; i += threads) reinterpret_cast<uint4*>(p)[i] = make_uint4(0u, 0u, 0u, 0u);
  for (int64_t i = vectors * 4 + thread; i < n; i += threads) p[i] = 0u;
}

// The fixed-point set-up in one pass: zeroes the int64 sums and the flags (`sum_words` and
// `flag_words` 32-bit words; 0 where the touched-cells layout zeroes its own rows) and takes the
// bounds. The memsets and the bounds pass ran one after another, 29.6 + 21 us for the fp16 bs 2 DETR
// encoder (H100), the bounds' reads at half their bandwidth; here they overlap the stores (perf_notes,
// item 124).
template <typename coord_t, typename scalar_t>
__global__ void __launch_bounds__(kThreads) fixed_point_setup_kernel(
    const coord_t* __restrict__ weights, int64_t num_weights, const scalar_t* __restrict__ grad, int64_t num_grad,
    FixedPointBounds* __restrict__ bounds, uint32_t* __restrict__ sums, int64_t sum_words,
    uint32_t* __restrict__ flags, int64_t flag_words) {
  const int64_t thread = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  float max_weight = max_abs_bound(weights, num_weights, thread, threads);
  float max_grad = max_abs_bound(grad, num_grad, thread, threads);
  zero_words(sums, sum_words, thread, threads);  // after the bounds: before them, the fp64 kernel spilled
  zero_words(flags, flag_words, thread, threads);
  for (int offset = 16; offset > 0; offset >>= 1) {
    max_weight = fmaxf(max_weight, __shfl_xor_sync(0xffffffffu, max_weight, offset));
    max_grad = fmaxf(max_grad, __shfl_xor_sync(0xffffffffu, max_grad, offset));
  }
  // One atomic pair a block, not a warp: atomics on one address serialise in the L2, and a warp's
  // pair (8 K of them) kept the pass at 30 us after its loads were widened (perf_notes item 118).
  __shared__ float warp_max[2][kThreads / 32];
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  if ((threadIdx.x & 31) == 0) {
    warp_max[0][warp] = max_weight;
    warp_max[1][warp] = max_grad;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < warps; ++w) {
      max_weight = fmaxf(max_weight, warp_max[0][w]);
      max_grad = fmaxf(max_grad, warp_max[1][w]);
    }
    atomicMax(&bounds->max_abs_weight_bits, __float_as_uint(max_weight));
    atomicMax(&bounds->max_abs_grad_bits, __float_as_uint(max_grad));
  }
}

// One element of the fixed-point sum in value's dtype; `flag` is its byte of non-finite flags.
template <typename scalar_t>
__device__ __forceinline__ scalar_t fixed_point_value(long long fixed, uint32_t flag, double inv_scale) {
  double x;
  if (flag == 0) {
    x = static_cast<double>(fixed) * inv_scale;
  } else if ((flag & kNaN) || ((flag & kPosInf) && (flag & kNegInf))) {
    x = quiet_nan<double>();
  } else {
    x = (flag & kPosInf) ? INFINITY : -INFINITY;
  }
  return static_cast<scalar_t>(static_cast<acc_type<scalar_t>>(x));
}

// Four elements a thread, the four of one flags word and of one cell (touched cells need channels %
// 8 == 0): two 16-byte loads of the sums where the whole group is in range (the buffers come from the
// allocator, 16-byte aligned). One element a thread was latency-bound, 56.7 us for the fp16 bs 2
// DETR encoder's 103 MB (H100; perf_notes item 118).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) fixed_point_finalize_kernel(
    const long long* __restrict__ fixed, const uint32_t* __restrict__ flags, const FixedPointBounds* __restrict__ bounds,
    int64_t contributions_per_element, TouchedCells touched, int64_t numel, scalar_t* __restrict__ out) {
  const double inv_scale = ldexp(1.0, -fixed_point_exponent(bounds, contributions_per_element));
  const int64_t groups = (numel + 3) / 4;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < groups; g += stride) {
    const int64_t i = 4 * g;
    const bool whole = i + 4 <= numel;
    // Never zeroed where untouched: nothing was added there. fp64 is never in touched cells
    // (touched_cells_unsupported); its kernel skips the test, whose 64-bit division is a call that
    // spilled around it.
    if (!std::is_same_v<scalar_t, double> && !touched.has_element(i)) {
      for (int64_t k = 0; k < 4 && i + k < numel; ++k) out[i + k] = static_cast<scalar_t>(0.0f);
      continue;
    }
    const uint32_t word = flags[g];
    if (whole) {
      const longlong2 lo = *reinterpret_cast<const longlong2*>(fixed + i);
      const longlong2 hi = *reinterpret_cast<const longlong2*>(fixed + i + 2);
      const long long v[4] = {lo.x, lo.y, hi.x, hi.y};
      if constexpr (sizeof(scalar_t) <= 4) {
        Vec<scalar_t, 4> r;
#pragma unroll
        for (int k = 0; k < 4; ++k) r.v[k] = fixed_point_value<scalar_t>(v[k], (word >> (8 * k)) & 0xffu, inv_scale);
        store_vec(out + i, r);
      } else {  // fp64: no 32-byte store
#pragma unroll
        for (int k = 0; k < 4; ++k) out[i + k] = fixed_point_value<scalar_t>(v[k], (word >> (8 * k)) & 0xffu, inv_scale);
      }
    } else {
      for (int64_t k = 0; i + k < numel; ++k) {
        out[i + k] = fixed_point_value<scalar_t>(fixed[i + k], (word >> (8 * k)) & 0xffu, inv_scale);
      }
    }
  }
}

// Touched cells in two passes. A level is marked whole when a (batch, head) has at least as many
// corners there as the level has keys (4 x queries x points >= height x width: the DETR
// decoder's three coarse levels); otherwise cell by cell, where corners land.
__device__ __forceinline__ bool marked_whole(const LevelGeometry& g, uint32_t queries, uint32_t points) {
  return 4 * static_cast<int64_t>(queries) * points >= static_cast<int64_t>(g.height) * g.width;
}

// Marking: one thread per sampling point (item, level, point) of a level marked cell by cell
// stores a 1 into the byte of each of its valid corners' cells. The corners come from the same
// `bilinear` as every backward kernel's, so the marked cells are exactly the cells the kernels
// add to. Bytes with plain stores: every writer writes the same value. Hundreds of corners share
// each line of a coarse level's bytes, and the L2 took their writes (as it took atomics on a
// bitmap) one at a time: 16-24 µs at DETR bs 2 (perf_notes 27-32), hence whole coarse levels.
// 32-bit index arithmetic (the host keeps num_points < 2^31), and no level-geometry check, only a
// bound on the cell: with inconsistent geometry the kernels add nothing, every marked row stays
// zero, and the gradient is zero as in the dense layout.
template <typename coord_t>
__global__ void __launch_bounds__(kThreads) mark_touched_cells_kernel(
    const coord_t* __restrict__ locations, const int64_t* __restrict__ shapes, const int64_t* __restrict__ starts,
    uint32_t num_points, uint32_t queries, uint32_t heads, uint32_t levels, uint32_t points, int64_t num_keys,
    int64_t cells, uint8_t* __restrict__ touched) {
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < num_points; i += stride) {
    const uint32_t item = i / (levels * points);
    const int level = static_cast<int>((i / points) % levels);
    const LevelGeometry g = level_geometry(shapes, starts, level);
    if (marked_whole(g, queries, points)) continue;
    const Bilinear<coord_t> bl = bilinear(locations[2 * static_cast<int64_t>(i)], locations[2 * static_cast<int64_t>(i) + 1],
                                          g.height, g.width);
    if (!bl.valid) continue;
    const uint32_t batch = item / (queries * heads);
    const uint32_t head = item % heads;
    const int64_t top_left = batch * num_keys + g.start + static_cast<int64_t>(bl.y0) * g.width + bl.x0;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      if (!(bl.valid & (1u << c))) continue;
      const int64_t cell = (top_left + (c & 1) + ((c & 2) ? g.width : 0)) * heads + head;
      if (cell >= 0 && cell < cells) touched[cell] = 1;
    }
  }
}

// The rows of 32 consecutive cells, zeroed by a warp where `bits` has the cell's bit: consecutive
// lanes write consecutive `Chunk`s of the cells' contiguous rows.
template <typename Chunk>
__device__ __forceinline__ void zero_marked_rows(Chunk* rows, int chunks_per_row, uint32_t bits, int lane) {
  for (int k = lane; k < 32 * chunks_per_row; k += 32) {
    if ((bits >> (k / chunks_per_row)) & 1u) rows[k] = Chunk{};
  }
}

// Zeroing: a warp per 32 consecutive cells. A cell of a level marked whole gets its byte here (for
// the final pass); then the accumulator rows (16-byte chunks) and, for fixed point, the flag
// bytes (8-byte chunks) of the marked cells are zeroed.
__global__ void __launch_bounds__(kThreads) zero_touched_rows_kernel(
    const int64_t* __restrict__ shapes, const int64_t* __restrict__ starts, uint32_t queries, uint32_t heads,
    uint32_t levels, uint32_t points, int64_t num_keys, uint8_t* __restrict__ touched, int64_t cells,
    uint4* __restrict__ rows, int row_chunks, uint2* __restrict__ flag_rows, int flag_chunks) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t words = (cells + 31) / 32;
  for (int64_t w = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; w < words; w += warps) {
    const int64_t cell = 32 * w + lane;
    bool marked = false;
    if (cell < cells) {
      marked = touched[cell] != 0;
      if (!marked) {
        const int64_t key = (cell / heads) % num_keys;
        int level = 0;  // the last level starting at or before the key
        for (uint32_t l = 1; l < levels; ++l) level = __ldg(starts + l) <= key ? static_cast<int>(l) : level;
        if (marked_whole(level_geometry(shapes, starts, level), queries, points)) {
          marked = true;
          touched[cell] = 1;
        }
      }
    }
    const uint32_t bits = __ballot_sync(0xffffffffu, marked);
    if (bits == 0u) continue;
    zero_marked_rows(rows + w * 32 * row_chunks, row_chunks, bits, lane);
    if (flag_rows != nullptr) zero_marked_rows(flag_rows + w * 32 * flag_chunks, flag_chunks, bits, lane);
  }
}

// The fp32 accumulator into the gradient in value's dtype, 8 elements (of one cell: channels is a
// multiple of 8) per step; cells nobody touched are zero.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) touched_cells_to_value_dtype_kernel(
    const float* __restrict__ buffer, TouchedCells touched, int64_t numel, scalar_t* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * 8;
  for (int64_t i = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) * 8; i < numel; i += stride) {
    float v[8] = {};
    if (touched.has_element(i)) {
      const float4 lo = *reinterpret_cast<const float4*>(buffer + i);
      const float4 hi = *reinterpret_cast<const float4*>(buffer + i + 4);
      v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w, v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
    }
    Vec<scalar_t, 8> packed;
#pragma unroll
    for (int k = 0; k < 8; ++k) packed.v[k] = static_cast<scalar_t>(v[k]);
    const uint4* from = reinterpret_cast<const uint4*>(&packed);
    uint4* to = reinterpret_cast<uint4*>(out + i);
#pragma unroll
    for (int k = 0; k < static_cast<int>(sizeof(packed) / 16); ++k) to[k] = from[k];
  }
}

int grid_for(int64_t n) {
  const int64_t sms = multiprocessor_count();
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, sms * 8)));
}

// Why touched cells cannot hold this problem's gradient, or empty.
std::string touched_cells_unsupported(const ProblemTensors& problem) {
  if (problem.value.scalar_type() == at::kDouble) return "fp64 values accumulate densely";
  if (problem.channels % 8 != 0) return "channels per head (" + num(problem.channels) + ") is not a multiple of 8";
  if (problem.num_items() * problem.levels * problem.points >= (int64_t(1) << 31)) return "2^31 or more sampling points";
  return {};
}

// The rules above kSortedFastCells (grad_accumulation.cuh). Half precision: the touched cells'
// marking, zeroing and final pass cost more than the sort where blocks sort and sum the level runs,
// or cub sorts a large problem, whose cost is mostly latency (perf_notes items 78, 86 and 87).
bool sorted_fast_backward(const ProblemTensors& problem, const at::Tensor& grad_output, int64_t corners_per_batch_head) {
  const bool half = problem.value.element_size() == 2, fp32 = problem.value.scalar_type() == at::kFloat;
  if ((!half && !fp32) || !sorted_backward_unsupported(problem, grad_output).empty()) return false;
  const bool sparse = corners_per_batch_head <= problem.num_keys;
  const bool blocks = sorts_level_runs(problem, grad_output);
  const int64_t cells = problem.batch * problem.num_keys * problem.heads;
  if (half) {
    return (sparse && (blocks || (problem.num_keys < kSortedFastKeys && cells >= kSortedFastCells))) ||
           (blocks && corners_per_batch_head <= 4 * problem.num_keys && cells >= kSortedFastDenserCells);
  }
  const int64_t runs = problem.batch * problem.heads * problem.levels;
  const bool short_runs = 4 * problem.queries * problem.points <= kSortedFastFp32RunEntries;
  return blocks && ((sparse && short_runs) ||
                    (corners_per_batch_head <= 4 * problem.num_keys && runs >= kSortedFastFp32LongRuns));
}

}  // namespace

GradValueLayout grad_value_layout(const ProblemTensors& problem, const at::Tensor& grad_output, bool deterministic) {
  const char* forced = std::getenv("MMDEFORM_TMA_GRAD_VALUE_LAYOUT");
  if (forced != nullptr && std::strcmp(forced, "dense") == 0) return GradValueLayout::kDense;
  const int64_t corners_per_batch_head = 4 * problem.queries * problem.levels * problem.points;
  const bool forced_sorted = forced != nullptr && std::strcmp(forced, "sorted") == 0;
  const bool auto_choice = forced == nullptr || forced[0] == '\0' || std::strcmp(forced, "auto") == 0;
  const bool cross_attention = problem.queries < problem.num_keys;
  if (deterministic) {
    const std::string why = sorted_backward_unsupported(problem, grad_output);
    TORCH_CHECK(!forced_sorted || why.empty(), "MMDEFORM_TMA_GRAD_VALUE_LAYOUT=sorted: ", why);
    if (forced_sorted ||
        (auto_choice && why.empty() && cross_attention && corners_per_batch_head <= kSortedCornersPerKey * problem.num_keys)) {
      return GradValueLayout::kSorted;
    }
  } else if (auto_choice && cross_attention && sorted_fast_backward(problem, grad_output, corners_per_batch_head)) {
    return GradValueLayout::kSorted;
  }
  if (forced_sorted) forced = nullptr;  // the fast backward's automatic layout
  const std::string unsupported = touched_cells_unsupported(problem);
  if (forced != nullptr && std::strcmp(forced, "touched") == 0) {
    TORCH_CHECK(unsupported.empty(), "MMDEFORM_TMA_GRAD_VALUE_LAYOUT=touched: ", unsupported);
    return GradValueLayout::kTouchedCells;
  }
  TORCH_CHECK(forced == nullptr || forced[0] == '\0' || std::strcmp(forced, "auto") == 0,
              "MMDEFORM_TMA_GRAD_VALUE_LAYOUT is 'dense', 'touched', 'sorted' or 'auto', not '", forced, "'");
  // fp32's fast buffer is the result itself: there is no final pass to save. The deterministic
  // int64 buffer is twice fp32's, so touched cells pay off at more corners per key: DINO's
  // decoder (2.85 corners per key) gained 8 % there and nothing in fp16 (perf_notes 32).
  const bool sparse = corners_per_batch_head <= problem.num_keys;
  const bool fairly_sparse = corners_per_batch_head <= 4 * problem.num_keys;
  return unsupported.empty() && ((deterministic && fairly_sparse) || (problem.value.element_size() == 2 && sparse))
             ? GradValueLayout::kTouchedCells
             : GradValueLayout::kDense;
}

ValueGradient::ValueGradient(const ProblemTensors& problem, const at::Tensor& grad_output, bool deterministic,
                             GradValueLayout layout)
    : value_(problem.value), deterministic_(deterministic) {
  const auto acc_dtype = problem.value.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const bool touched = layout == GradValueLayout::kTouchedCells;
  // Touched cells: only their rows are zeroed (mark_touched_cells); the rest is never read. Dense
  // fp32 sums: a memset; dense fixed-point sums and their flags: fixed_point_setup_kernel, beside
  // the bounds pass. Never at::zeros, which under torch's deterministic mode fills new memory twice
  // (fill_uninitialized_memory, then the zeros): 25 us for the fp16 bs 2 DETR encoder's int64
  // sums (H100; perf_notes item 118).
  const auto allocate = [&](at::IntArrayRef sizes, at::ScalarType type) {
    at::Tensor t = uninitialized(sizes, problem.value.options().dtype(type));
    if (!touched && !deterministic && t.nbytes() > 0) {
      C10_CUDA_CHECK(cudaMemsetAsync(t.data_ptr(), 0, t.nbytes(), current_stream()));
    }
    return t;
  };
  const int64_t numel = problem.value.numel();
  if (!deterministic) {
    buffer_ = allocate(problem.value.sizes(), acc_dtype);
  } else {
    buffer_ = allocate(problem.value.sizes(), at::kLong);
    flags_ = allocate({(numel + 3) / 4}, at::kInt);
    bounds_ = uninitialized({2}, problem.value.options().dtype(at::kInt));
    C10_CUDA_CHECK(cudaMemsetAsync(bounds_.data_ptr(), 0, bounds_.nbytes(), current_stream()));
    contributions_per_element_ = problem.queries * problem.points;
  }
  if (touched) mark_touched_cells(problem);
  if (!deterministic) return;
  const auto stream = current_stream();
  MMDEFORM_TMA_DISPATCH_VALUE_TYPES(problem.value.scalar_type(), "fixed-point set-up", [&] {
    using coord_t = coord_type<scalar_t>;
    const int64_t sum_words = touched ? 0 : buffer_.nbytes() / 4, flag_words = touched ? 0 : flags_.numel();
    const int64_t n = std::max({problem.attention_weights.numel(), grad_output.numel(), sum_words / 4});
    if (n == 0) return;
    fixed_point_setup_kernel<coord_t, scalar_t><<<grid_for(n), kThreads, 0, stream>>>(
        problem.attention_weights.data_ptr<coord_t>(), problem.attention_weights.numel(),
        reinterpret_cast<const scalar_t*>(grad_output.data_ptr()), grad_output.numel(),
        reinterpret_cast<FixedPointBounds*>(bounds_.data_ptr<int32_t>()),
        reinterpret_cast<uint32_t*>(buffer_.data_ptr()), sum_words, reinterpret_cast<uint32_t*>(flags_.data_ptr()),
        flag_words);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void ValueGradient::mark_touched_cells(const ProblemTensors& problem) {
  const int64_t cells = problem.batch * problem.num_keys * problem.heads;
  touched_ = uninitialized({cells}, problem.value.options().dtype(at::kByte));
  C10_CUDA_CHECK(cudaMemsetAsync(touched_.data_ptr(), 0, touched_.nbytes(), current_stream()));
  const int64_t num_points = problem.num_items() * problem.levels * problem.points;
  if (num_points == 0) return;
  const auto stream = current_stream();
  mark_touched_cells_kernel<float><<<grid_for(num_points), kThreads, 0, stream>>>(
      problem.sampling_locations.data_ptr<float>(), problem.spatial_shapes.data_ptr<int64_t>(),
      problem.level_start_index.data_ptr<int64_t>(), static_cast<uint32_t>(num_points),
      static_cast<uint32_t>(problem.queries), static_cast<uint32_t>(problem.heads), static_cast<uint32_t>(problem.levels),
      static_cast<uint32_t>(problem.points), problem.num_keys, cells, touched_.data_ptr<uint8_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // channels is a multiple of 8: a cell's row is whole 16-byte chunks, its flags (a byte per
  // element) whole 8-byte chunks.
  const int row_chunks = static_cast<int>(problem.channels * buffer_.element_size() / 16);
  const int flag_chunks = static_cast<int>(problem.channels / 8);
  zero_touched_rows_kernel<<<grid_for(cells), kThreads, 0, stream>>>(
      problem.spatial_shapes.data_ptr<int64_t>(), problem.level_start_index.data_ptr<int64_t>(),
      static_cast<uint32_t>(problem.queries), static_cast<uint32_t>(problem.heads), static_cast<uint32_t>(problem.levels),
      static_cast<uint32_t>(problem.points), problem.num_keys, touched_.data_ptr<uint8_t>(), cells,
      reinterpret_cast<uint4*>(buffer_.data_ptr()), row_chunks,
      deterministic_ ? reinterpret_cast<uint2*>(flags_.data_ptr<int32_t>()) : nullptr, flag_chunks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor ValueGradient::finish() {
  if (!deterministic_ && !touched_.defined()) {
    return buffer_.scalar_type() == value_.scalar_type() ? buffer_ : buffer_.to(value_.scalar_type());
  }
  at::Tensor out = uninitialized(value_.sizes(), value_.options());
  const int64_t numel = out.numel();
  if (numel == 0) return out;
  const TouchedCells touched{touched_.defined() ? touched_.data_ptr<uint8_t>() : nullptr, value_.size(-1)};
  const auto stream = current_stream();
  MMDEFORM_TMA_DISPATCH_VALUE_TYPES(value_.scalar_type(), "value gradient", [&] {
    if (deterministic_) {
      fixed_point_finalize_kernel<scalar_t><<<grid_for((numel + 3) / 4), kThreads, 0, stream>>>(
          reinterpret_cast<const long long*>(buffer_.data_ptr<int64_t>()),
          reinterpret_cast<const uint32_t*>(flags_.data_ptr<int32_t>()),
          reinterpret_cast<const FixedPointBounds*>(bounds_.data_ptr<int32_t>()), contributions_per_element_, touched,
          numel, reinterpret_cast<scalar_t*>(out.data_ptr()));
    } else if constexpr (!std::is_same_v<scalar_t, double>) {  // fp64 is never in touched cells
      touched_cells_to_value_dtype_kernel<scalar_t><<<grid_for(numel / 8), kThreads, 0, stream>>>(
          buffer_.data_ptr<float>(), touched, numel, reinterpret_cast<scalar_t*>(out.data_ptr()));
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace mmdeform_tma
