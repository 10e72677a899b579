#include "sorted_value_gradient.h"

// The toolkit's cub: its symbols sit in a namespace versioned by release and architecture
// (cub::CUB_300001_SM_900 with CUDA 13.0), torch's copy in at_cuda_detail, so the two cannot clash.
#include <cub/block/block_radix_rank.cuh>
#include <cub/device/device_radix_sort.cuh>

#include "cuda_runtime_utils.h"
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <tuple>
#include <type_traits>

#include "device_utils.cuh"
#include "dtype_dispatch.cuh"
#include "launchers.h"

namespace mmdeform_tma {
namespace {

constexpr int kThreads = 256;

// A lane's elements of a row: 8 where channels and alignment allow (16 bytes of fp16/bf16; 32 or 64
// bytes of fp32/fp64, moved in 16-byte pieces), so a team of 4 lanes covers 32 channels in every
// dtype and a warp sums 8 pieces at once; else one element.
constexpr int kLaneElements = 8;

template <typename scalar_t, int N>
constexpr int piece_elements() {
  return N < 16 / static_cast<int>(sizeof(scalar_t)) ? N : 16 / static_cast<int>(sizeof(scalar_t));
}

// A lane's N elements, each 16-byte piece read by read_piece (from global or shared memory).
template <typename scalar_t, int N, typename ReadPiece>
__device__ __forceinline__ Vec<scalar_t, N> load_in_pieces(const scalar_t* ptr, ReadPiece read_piece) {
  constexpr int kPiece = piece_elements<scalar_t, N>();
  Vec<scalar_t, N> out;
#pragma unroll
  for (int i = 0; i < N; i += kPiece) {
    const Vec<scalar_t, kPiece> piece = read_piece(ptr + i);
#pragma unroll
    for (int k = 0; k < kPiece; ++k) out.v[i + k] = piece.v[k];
  }
  return out;
}

template <typename scalar_t, int N>
__device__ __forceinline__ Vec<scalar_t, N> load_lane(const scalar_t* ptr) {
  return load_in_pieces<scalar_t, N>(ptr, [](const scalar_t* at) { return load_vec<scalar_t, piece_elements<scalar_t, N>()>(at); });
}

template <typename scalar_t, int N>
__device__ __forceinline__ Vec<scalar_t, N> load_shared_lane(const scalar_t* ptr) {
  return load_in_pieces<scalar_t, N>(
      ptr, [](const scalar_t* at) { return load_shared_vec<scalar_t, piece_elements<scalar_t, N>()>(at); });
}

template <typename scalar_t, int N>
__device__ __forceinline__ void store_lane(scalar_t* ptr, const Vec<scalar_t, N>& vec) {
  constexpr int kPiece = piece_elements<scalar_t, N>();
#pragma unroll
  for (int i = 0; i < N; i += kPiece) {
    Vec<scalar_t, kPiece> piece;
#pragma unroll
    for (int k = 0; k < kPiece; ++k) piece.v[k] = vec.v[i + k];
    store_vec(ptr + i, piece);
  }
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

int lane_elements(const ProblemTensors& problem, const at::Tensor& grad_output) {
  const bool fits = problem.channels % kLaneElements == 0 && aligned16(problem.value) && aligned16(grad_output);
  return fits ? kLaneElements : 1;
}

int team_log2_for(int64_t lanes) {
  int log2 = 0;
  while ((int64_t{1} << log2) < lanes) ++log2;
  return log2;
}

// The entries' order before the sort: a (batch, head) at a time, then the points' own order,
// (query, level, point, corner). The sort's key is the corner's pixel only: being stable, it leaves
// each pixel's entries in that order, so a (batch, pixel, head) cell's entries are contiguous and in
// (query, level, point, corner) order. A pixel key needs fewer bits than a cell key (15 against 19 on
// DETR's bs 2 decoder), and cub's sort one pass fewer.
struct EntryOrder {
  int queries, heads, corners_per_query;  // corners_per_query: levels x points x 4
  FastDivisor by_queries, by_heads, by_corners;

  __device__ __forceinline__ int64_t first_entry(int item, int level_point) const {
    const int batch_query = static_cast<int>(by_heads.divide(item));
    const int head = item - batch_query * heads;
    const int batch = static_cast<int>(by_queries.divide(batch_query));
    const int query = batch_query - batch * queries;
    return ((static_cast<int64_t>(batch) * heads + head) * queries + query) * corners_per_query + 4 * level_point;
  }
  // The (batch, head) group of an entry, and its item (the row of grad_output it multiplies).
  __device__ __forceinline__ int group(int32_t entry) const {
    return static_cast<int>(by_queries.divide(by_corners.divide(entry)));
  }
  __device__ __forceinline__ int item(int32_t entry) const {
    const int group_query = static_cast<int>(by_corners.divide(entry));
    const int group = static_cast<int>(by_queries.divide(group_query));
    const int batch = static_cast<int>(by_heads.divide(group));
    return ((batch * queries) + group_query - group * queries) * heads + group - batch * heads;
  }
};

EntryOrder entry_order_of(const ProblemTensors& problem) {
  const auto queries = static_cast<uint32_t>(problem.queries), heads = static_cast<uint32_t>(problem.heads);
  const auto corners = static_cast<uint32_t>(4 * problem.levels * problem.points);
  return {static_cast<int>(queries), static_cast<int>(heads), static_cast<int>(corners),
          fast_divisor(queries), fast_divisor(heads), fast_divisor(corners)};
}

// A point's (item, level x points + point) and its level, by multiply-high.
struct PointIndex {
  FastDivisor by_points_per_item, by_points;
};

// Blocks of 256 threads per SM, by the bytes a lane loads per corner: five where 16 or fewer (48
// registers), four where 32 (64). The point kernel waits on its loads; left to itself ptxas took
// 54-56 registers for 16 bytes (four blocks) and 72 for 32 (three) (H100, session 41).
template <typename scalar_t, int LANE>
constexpr int point_kernel_min_blocks() {
  if (sizeof(scalar_t) == 8) return 1;  // fp64: the reference dtype, left to ptxas
  return LANE * sizeof(scalar_t) <= 16 ? 5 : LANE * sizeof(scalar_t) <= 32 ? 4 : 1;
}

// Step 1: a team per sampling point (item, level, point), numbered as locations are. Lane 0
// writes the point's gradients and its four entries; the team's lanes share the dot products.
// First, where step 3 does not zero the untouched rows itself (UnsampledRows::in_place), every
// thread of the grid zeroes its share of grad_value: stores that overlap the points' loads (a
// memset before the kernel took 6 (fp16) to 12 us (fp32) of DETR's decoder on its own; fused, the
// kernel grew by 4-5 us: H100, session 32). The first thread also zeroes the count of listed
// gaps that step 3 appends to. kFill false: the fill's loop is not compiled in. Only fp16/bf16 take
// that kernel where step 3 zeroes in place: on DINO's decoder fp16 ran 0.1248 -> 0.1188 ms without
// the loop and bf16 0.1209 -> 0.1200, while fp32's kernel without it was 2.6 % slower there and
// 3.2 % on DETR's bs 8 decoder, ptxas giving it 54 registers against 44 (H100, 2026-11-26, branch
// e895030 against c70d853 in one call; perf_notes item 83). The kernel waits on its loads, so it is
// kept lean: the level geometry checked once per block, 32-bit indices divided by multiply-high,
// the five row loads issued together, 48 registers: 20.9 -> 13.3 us on DETR's bs 2 fp16 decoder,
// 42.6 -> 24.7 on DINO's (H100, session 41, item 89). Lanes of 16 elements (half the teams) halved
// its instructions but not its time, at four blocks per SM.
template <typename scalar_t, int LANE, bool kFill = true>
__global__ void __launch_bounds__(kThreads, point_kernel_min_blocks<scalar_t, LANE>()) sorted_point_gradients_kernel(
    const Problem<scalar_t> p, const scalar_t* __restrict__ grad_output, coord_type<scalar_t>* __restrict__ grad_locations,
    coord_type<scalar_t>* __restrict__ grad_weights, int32_t* __restrict__ keys, int32_t* __restrict__ entry_index,
    acc_type<scalar_t>* __restrict__ entry_weights, const EntryOrder order, const PointIndex index, int team_log2,
    int32_t* __restrict__ long_gaps, uint4* __restrict__ zero_fill, int64_t zero_vectors) {
  using coord_t = coord_type<scalar_t>;
  using acc_t = acc_type<scalar_t>;
  allow_dependent_launch();  // the sums' blocks may start their staging once every block here has begun
  if constexpr (kFill) {
    const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < zero_vectors; i += threads) {
      zero_fill[i] = make_uint4(0u, 0u, 0u, 0u);
    }
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) *long_gaps = 0;
  if (!block_level_geometry_ok(p.spatial_shapes, p.level_start, p.levels, p.num_keys)) {  // uniform over the grid
    const int64_t points = static_cast<int64_t>(p.num_items) * p.levels * p.points;
    for (int64_t point = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; point < points;
         point += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      // As every backward kernel: NaN coordinate gradients, value gradients zero.
      grad_weights[point] = quiet_nan<coord_t>();
      grad_locations[2 * point] = grad_locations[2 * point + 1] = quiet_nan<coord_t>();
      // No entries: entries are whole fours, so these cover every one whatever its point.
      const int32_t e = static_cast<int32_t>(4 * point);
      *reinterpret_cast<int4*>(keys + e) = make_int4(p.num_keys, p.num_keys, p.num_keys, p.num_keys);
      store_vec(entry_weights + e, Vec<acc_t, 4>{});
      if (entry_index != nullptr) *reinterpret_cast<int4*>(entry_index + e) = make_int4(e, e + 1, e + 2, e + 3);
    }
    return;
  }
  const int team = 1 << team_log2;
  const int lane = threadIdx.x & (team - 1);
  // 32-bit indices (the corners number fewer than 2^31: sorted_backward_unsupported), and no lane
  // leaves before the team's sums, so that they shuffle over the whole warp with a constant mask.
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int points_per_item = p.levels * p.points;
  const bool in_range = thread < (static_cast<int64_t>(p.num_items) * points_per_item << team_log2);  // whole teams
  const int point = in_range ? static_cast<int>(thread >> team_log2) : 0;
  const int item = static_cast<int>(index.by_points_per_item.divide(point));
  const int level_point = point - item * points_per_item;
  const int level = static_cast<int>(index.by_points.divide(level_point));
  const int first_entry = static_cast<int>(order.first_entry(item, level_point));  // its 4 entries
  const LevelGeometry g = level_geometry(p.spatial_shapes, p.level_start, level);
  const coord_t a = p.weights[point];
  Bilinear<coord_t> bl = bilinear(p.locations[2 * point], p.locations[2 * point + 1], g.height, g.width);
  if (!in_range) bl.valid = 0u;
  const int channel = lane * LANE;
  const bool active = channel < p.channels;
  const int batch_query = static_cast<int>(order.by_heads.divide(item));
  const int head = item - batch_query * p.heads;
  const int batch = static_cast<int>(order.by_queries.divide(batch_query));
  const int pixel00 = static_cast<int>(g.start) + bl.y0 * g.width + bl.x0;
  const auto pixel_of = [&](int c) { return pixel00 + ((c & 1) ? 1 : 0) + ((c & 2) ? g.width : 0); };
  acc_t dot[4] = {acc_t(0), acc_t(0), acc_t(0), acc_t(0)};
  if (bl.valid != 0u) {  // uniform over the team
    // Every load unconditional, from rows clamped into the level and lanes past the channels
    // reading channel 0, their dots dropped after: with predicated loads into zeroed registers
    // ptxas issued two of the five after the first dots, a second round trip (SASS, session 41).
    const int lane_channel = active ? channel : 0;
    const Vec<scalar_t, LANE> go = load_lane<scalar_t, LANE>(grad_output + static_cast<int64_t>(item) * p.channels + lane_channel);
    const int x0 = max(bl.x0, 0), x1 = min(bl.x0 + 1, g.width - 1);
    const int y0 = max(bl.y0, 0), y1 = min(bl.y0 + 1, g.height - 1);
    const int64_t key_row = static_cast<int64_t>(p.heads) * p.channels;
    const scalar_t* base = p.value + (static_cast<int64_t>(batch) * p.num_keys + g.start) * key_row +
                           static_cast<int64_t>(head) * p.channels + lane_channel;
    Vec<scalar_t, LANE> raw[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {  // all five loads in flight before the dots
      const int pixel = ((c & 2) ? y1 : y0) * g.width + ((c & 1) ? x1 : x0);
      raw[c] = load_lane<scalar_t, LANE>(base + pixel * key_row);
    }
    acc_t g_acc[LANE];
    to_acc(go, g_acc);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      acc_t v[LANE];
      to_acc(raw[c], v);
      acc_t d = acc_t(0);
#pragma unroll
      for (int k = 0; k < LANE; ++k) d = fma(g_acc[k], v[k], d);
      dot[c] = active && (bl.valid & (1u << c)) ? d : acc_t(0);
    }
  }
  const coord_t ly = bl.ly, lx = bl.lx, hy = coord_t(1) - ly, hx = coord_t(1) - lx;
  const acc_t grad_a = warp_team_sum<acc_t>(hy * hx * dot[0] + hy * lx * dot[1] + ly * hx * dot[2] + ly * lx * dot[3], team);
  const acc_t grad_x = warp_team_sum<acc_t>(hy * (dot[1] - dot[0]) + ly * (dot[3] - dot[2]), team);
  const acc_t grad_y = warp_team_sum<acc_t>(hx * (dot[2] - dot[0]) + lx * (dot[3] - dot[1]), team);
  if (lane == 0 && in_range) {  // a point that misses its level: zero gradients and no entries
    const bool sampled = bl.valid != 0u;
    grad_weights[point] = grad_a;
    grad_locations[2 * point] = sampled ? a * coord_t(g.width) * grad_x : coord_t(0);
    grad_locations[2 * point + 1] = sampled ? a * coord_t(g.height) * grad_y : coord_t(0);
    int key[4];
    acc_t weight[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const bool valid = bl.valid & (1u << c);
      key[c] = valid ? pixel_of(c) : p.num_keys;
      weight[c] = valid ? static_cast<acc_t>(a * bl.weight(c)) : acc_t(0);
    }
    // A point's four entries are consecutive and start at a multiple of 4: one vector store each.
    *reinterpret_cast<int4*>(keys + first_entry) = make_int4(key[0], key[1], key[2], key[3]);
    store_vec(entry_weights + first_entry, Vec<acc_t, 4>{{weight[0], weight[1], weight[2], weight[3]}});
    if (entry_index != nullptr) {  // cub's payload: each entry's own index
      *reinterpret_cast<int4*>(entry_index + first_entry) =
          make_int4(first_entry, first_entry + 1, first_entry + 2, first_entry + 3);
    }
  }
}

// The point kernel to launch: without the fill's loop for fp16/bf16 in place, so that no other
// dtype instantiates it.
template <typename scalar_t, int LANE>
auto point_gradients_kernel(bool in_place) {
  if constexpr (sizeof(scalar_t) == 2) {
    if (in_place) return sorted_point_gradients_kernel<scalar_t, LANE, false>;
  }
  return sorted_point_gradients_kernel<scalar_t, LANE, true>;
}

// The cells no corner touches: the ranks between consecutive distinct ranks of the sorted entries
// (and before the first, and after the last up to the invalid corners' rank). Where few rows are
// untouched, or an fp32 fill would not stay in the L2, their rows are zeroed where they are found
// instead of filling all of grad_value first (UnsampledRows::in_place, chosen on the host): on
// DINO's fp32 decoder the fill was 8.7 us of the deterministic backward's 137, in the point kernel
// and in the write-backs that slowed the sums; zeroing in place saved 6 us there and 17 us on
// DETR's bs 8 decoder, but cost 12 us on DETR's bs 2 one, where about 4 in 10 rows are untouched and
// the 41 MB fill stays in the L2 (H100, 2026-11-26, perf_notes item 82). A chunk's warp zeroes
// its gaps of up to kInlineGapRows rows; longer ones are cut into segments of kListedGapRows,
// listed, and zeroed by the carry launch's blocks, one segment each, so that a large untouched
// region (a problem whose corners all miss, say) is spread over the GPU. The inline bound keeps a
// warp's wait bounded and lists only gaps that real sampling rarely leaves (raising it from 256
// did not change the chunk kernel's time on DETR's decoder: 39 us in place either way).
constexpr int kInlineGapRows = 4096;
constexpr int kListedGapRows = 256;

// Not "touched": the touched-cells layout's kernels are told apart by that word in their names.
struct UnsampledRows {
  bool in_place;  // false: the point kernel fills grad_value, and nothing below runs
  char* grad_value;
  int num_keys, groups, heads;  // a rank is pixel x groups + (batch x heads + head)
  FastDivisor by_groups, by_heads;
  int row_units, unit_bytes;  // a row of grad_value as row_units stores of unit_bytes (16, 8, 4 or 2)
  FastDivisor by_row_units;
  int32_t* count;    // [0]: listed segments; then (first rank, rows) pairs
  int64_t capacity;  // segments the list holds

  __device__ __forceinline__ void zero_unit(int rank, int unit) const {
    const int pixel = static_cast<int>(by_groups.divide(rank)), group = rank - pixel * groups;
    const int batch = static_cast<int>(by_heads.divide(group)), head = group - batch * heads;
    const int64_t row = (static_cast<int64_t>(batch) * num_keys + pixel) * heads + head;
    char* at = grad_value + (row * row_units + unit) * unit_bytes;
    switch (unit_bytes) {
      case 16:
        *reinterpret_cast<uint4*>(at) = make_uint4(0u, 0u, 0u, 0u);
        break;
      case 8:
        *reinterpret_cast<uint2*>(at) = make_uint2(0u, 0u);
        break;
      case 4:
        *reinterpret_cast<uint32_t*>(at) = 0u;
        break;
      default:
        *reinterpret_cast<uint16_t*>(at) = 0u;
    }
  }
  // Rows [first, first + rows) of the rank order (rows <= kListedGapRows), by `threads` threads of
  // which this is `thread`.
  __device__ __forceinline__ void zero(int first, int rows, int thread, int threads) const {
    for (int u = thread; u < rows * row_units; u += threads) {
      const int row = static_cast<int>(by_row_units.divide(u));
      zero_unit(first + row, u - row * row_units);
    }
  }
  // A warp's gaps at once: lane l's gap holds `rows` rows from rank `first` (0 rows: none). The
  // warp's lanes walk the gaps' units as one run, each finding its gap by a binary search over
  // the lanes' running sums: on DETR's decoder a chunk has about nine short gaps, which one loop
  // per gap zeroed with a few lanes each.
  __device__ __forceinline__ void zero_warp_gaps(int first, int rows, int lane) const {
    int end = rows;  // inclusive running sum of the lanes' rows
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int below = __shfl_up_sync(0xffffffffu, end, offset);
      if (lane >= offset) end += below;
    }
    const int total = __shfl_sync(0xffffffffu, end, 31) * row_units;
    for (int base = 0; base < total; base += 32) {  // the same trip count on every lane
      const int u = base + lane;
      const int row = static_cast<int>(by_row_units.divide(u));
      int owner = 0;  // the first lane whose running sum passes `row`
#pragma unroll
      for (int step = 16; step > 0; step >>= 1) {
        const int probe = __shfl_sync(0xffffffffu, end, owner + step - 1);
        if (probe <= row) owner += step;
      }
      const int owner_first = __shfl_sync(0xffffffffu, first, owner);
      const int owner_start = __shfl_sync(0xffffffffu, end - rows, owner);
      if (u < total) zero_unit(owner_first + row - owner_start, u - row * row_units);
    }
  }
  __device__ __forceinline__ void list(int first, int rows) const {
    const int segments = (rows + kListedGapRows - 1) / kListedGapRows;
    const int at = atomicAdd(count, segments);
    for (int k = 0; k < segments && at + k < capacity; ++k) {
      count[1 + 2 * (at + k)] = first + k * kListedGapRows;
      count[2 + 2 * (at + k)] = min(kListedGapRows, rows - k * kListedGapRows);
    }
  }
};

// Step 3 in two launches. Each chunk of 32 sorted entries is cut into pieces, a piece being the
// chunk's entries of one cell. A cell inside one chunk is one piece; a cell that crosses chunk ends
// is a trailing piece (where it begins), lead pieces of the chunks after it, and its sum is those
// pieces' sums added in chunk order. No team walks a long cell (DINO's coarsest level holds 58
// entries per cell) entry by entry past its chunk. The pieces depend on the sorted order alone, so
// the sums stay bitwise reproducible.
enum ChunkFlags : int32_t { kTrailing = 1, kLeadEndsHere = 2 };

// A warp's chunk in dynamic shared memory: the output-gradient rows of its 32 entries (a team's
// lanes x LANE elements each), then the entries' cells, items and weights. A block stays within
// the default 48 KiB.
constexpr int kMaxStageBytes = 48 << 10;

__host__ __device__ constexpr int chunk_stage_bytes(int element_bytes, int acc_bytes, int row_elements) {
  return 32 * (row_elements * element_bytes + 2 * static_cast<int>(sizeof(int32_t)) + acc_bytes);
}

// The position of mask's n-th set bit (n from 0; mask has more than n set bits).
__device__ __forceinline__ int nth_set_bit(unsigned mask, int n) {
  int position = 0;
#pragma unroll
  for (int half = 16; half > 0; half >>= 1) {
    const int below = __popc(mask & ((1u << half) - 1u));
    if (n >= below) {
      n -= below;
      mask >>= half;
      position += half;
    }
  }
  return position;
}

// 3a: a warp per chunk reads its 32 sorted entries, finds where cells begin, and stages the entries'
// weights and output-gradient rows in shared memory, the chunk's row loads in flight together. Its
// teams then sum the chunk's pieces side by side, each in sorted order. A piece that is a whole
// cell writes the cell's row; the lead piece and the trailing piece go to the chunk's two partial
// rows, for 3b. Lane 0 writes the chunk's flags.
template <typename scalar_t, int LANE>
__global__ void __launch_bounds__(kThreads) sorted_chunk_sums_kernel(
    const int32_t* __restrict__ sorted_keys, const int32_t* __restrict__ order,
    const acc_type<scalar_t>* __restrict__ entry_weights, int64_t entries, const scalar_t* __restrict__ grad_output,
    const EntryOrder entry_order, int num_keys, int groups, int channels, int team_log2,
    acc_type<scalar_t>* __restrict__ partials, int32_t* __restrict__ chunk_flags, int32_t* __restrict__ trailing_cells,
    scalar_t* __restrict__ grad_value, const UnsampledRows untouched) {
  using acc_t = acc_type<scalar_t>;
  extern __shared__ __align__(16) unsigned char chunk_stage[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + warp;
  const int64_t base = chunk * 32;
  if (base >= entries) return;  // the whole warp
  const int row_elements = LANE << team_log2;
  scalar_t* rows = reinterpret_cast<scalar_t*>(chunk_stage + warp * chunk_stage_bytes(sizeof(scalar_t), sizeof(acc_t), row_elements));
  int32_t* cells = reinterpret_cast<int32_t*>(rows + 32 * row_elements);
  int32_t* items = cells + 32;
  acc_t* weights = reinterpret_cast<acc_t*>(items + 32);
  // A cell's rank in the sorted order: (pixel, batch x head); invalid corners share the last rank.
  const int32_t no_cell = num_keys * groups;
  const auto rank_of = [&](int32_t pixel, int32_t entry) {
    return pixel == num_keys ? no_cell : pixel * groups + entry_order.group(entry);
  };
  const int64_t i = base + lane;
  const bool inside = i < entries;
  const int32_t entry = inside ? order[i] : 0;
  const int32_t pixel = inside ? sorted_keys[i] : num_keys;
  const int32_t key = rank_of(pixel, entry);
  const int64_t edge = lane == 0 ? base - 1 : base + 32;  // lane 0: the entry before the chunk; lane 1: after it
  const int32_t edge_key = lane < 2 && edge >= 0 && edge < entries ? rank_of(sorted_keys[edge], order[edge]) : -1;
  const int group = entry_order.group(entry);
  const int batch = static_cast<int>(entry_order.by_heads.divide(group));
  const int32_t cell = (batch * num_keys + pixel) * entry_order.heads + group - batch * entry_order.heads;
  cells[lane] = cell;
  items[lane] = entry_order.item(entry);
  weights[lane] = inside ? entry_weights[entry] : acc_t(0);
  int32_t before = __shfl_up_sync(0xffffffffu, key, 1);
  const int32_t edge_before = __shfl_sync(0xffffffffu, edge_key, 0);
  const int32_t after = __shfl_sync(0xffffffffu, edge_key, 1);
  if (lane == 0) before = edge_before;
  const unsigned boundaries = __ballot_sync(0xffffffffu, key != before);  // a cell, or the invalid corners, begins
  const bool valid = pixel != num_keys;
  const unsigned starts = __ballot_sync(0xffffffffu, key != before && valid);
  const unsigned summed = __ballot_sync(0xffffffffu, valid);  // the entries whose rows are staged
  const bool lead = __shfl_sync(0xffffffffu, key == before && valid, 0);  // lane 0 continues a cell
  const int32_t first_key = __shfl_sync(0xffffffffu, key, 0);
  const int last_start = starts != 0u ? 31 - __clz(starts) : 0;
  const int32_t last_start_key = __shfl_sync(0xffffffffu, key, last_start);
  const int32_t last_start_cell = __shfl_sync(0xffffffffu, cell, last_start);
  const bool trailing = starts != 0u && (boundaries >> last_start) == 1u && after == last_start_key;
  const unsigned past_first = boundaries & ~1u;
  const bool lead_ends = lead && (past_first != 0u || after != first_key);
  if (lane == 0) {
    chunk_flags[chunk] = (trailing ? kTrailing : 0) | (lead_ends ? kLeadEndsHere : 0);
    if (trailing) trailing_cells[chunk] = last_start_cell;
  }
  // The untouched cells below each boundary's rank (lanes past the last entry carry the invalid
  // rank, so the last chunk's boundary there covers the cells after the last touched one; a full
  // last chunk's final lane covers them itself).
  if (untouched.in_place) {
    const int gap = key != before ? key - before - 1 : 0;
    if (gap > kInlineGapRows) untouched.list(before + 1, gap);
    untouched.zero_warp_gaps(before + 1, gap <= kInlineGapRows ? gap : 0, lane);
    if (base + 32 == entries) {  // a full last chunk: its last lane's key may not be the last rank
      const int final_gap = lane == 31 && key < no_cell ? no_cell - key - 1 : 0;
      if (final_gap > kInlineGapRows) untouched.list(key + 1, final_gap);
      untouched.zero_warp_gaps(key + 1, final_gap <= kInlineGapRows ? final_gap : 0, lane);
    }
  }
  // Orders the lanes' writes of cells, items and weights before other lanes read them below (the
  // shuffles above do not order shared memory; racecheck flagged its absence, session 38).
  __syncwarp();
  const int teams = 32 >> team_log2, team = lane >> team_log2;
  const int channel = (lane & ((1 << team_log2) - 1)) * LANE;
  const bool active = channel < channels;
  constexpr int kLoadsInFlight = 4;
  for (int j0 = team; j0 < 32; j0 += kLoadsInFlight * teams) {
    Vec<scalar_t, LANE> staged[kLoadsInFlight];
#pragma unroll
    for (int b = 0; b < kLoadsInFlight; ++b) {
      const int j = j0 + b * teams;
      if (j < 32 && active && ((summed >> j) & 1u)) {
        staged[b] = load_lane<scalar_t, LANE>(grad_output + static_cast<int64_t>(items[j]) * channels + channel);
      }
    }
#pragma unroll
    for (int b = 0; b < kLoadsInFlight; ++b) {
      const int j = j0 + b * teams;
      if (j < 32 && active && ((summed >> j) & 1u)) store_lane(rows + j * row_elements + channel, staged[b]);
    }
  }
  __syncwarp();
  // Piece r goes to team r mod teams, all teams at once. A loop over the pieces in which one team
  // summed while the others skipped ran them one after another: 30 us on DETR's fp16 decoder
  // against 13 us side by side (H100, session 32, perf_notes item 71).
  const unsigned pending = starts | (lead ? 1u : 0u);
  const int pieces = active ? __popc(pending) : 0;  // lanes past the channels sum nothing
  for (int r = team; r < pieces; r += teams) {
    const int first = nth_set_bit(pending, r);
    const unsigned later = first == 31 ? 0u : boundaries & ~((2u << first) - 1u);
    const int end = later != 0u ? __ffs(later) - 1 : 32;  // the next boundary in the chunk
    acc_t sum[LANE];
#pragma unroll
    for (int v = 0; v < LANE; ++v) sum[v] = acc_t(0);
#pragma unroll 4
    for (int j = first; j < end; ++j) {
      acc_t go[LANE];
      to_acc(load_shared_lane<scalar_t, LANE>(rows + j * row_elements + channel), go);
      const acc_t weight = weights[j];
#pragma unroll
      for (int v = 0; v < LANE; ++v) sum[v] = fma(weight, go[v], sum[v]);
    }
    const bool is_lead = first == 0 && lead;
    if (is_lead || (trailing && first == last_start)) {
      acc_t* partial = partials + (2 * chunk + (is_lead ? 0 : 1)) * channels + channel;
#pragma unroll
      for (int v = 0; v < LANE; ++v) partial[v] = sum[v];
    } else {
      store_lane(grad_value + static_cast<int64_t>(cells[first]) * channels + channel, from_acc_vec<scalar_t, LANE>(sum));
    }
  }
}

// 3b: a team per chunk with a trailing piece adds the lead partials of the chunks its cell runs
// through, in chunk order, and writes the cell's row.
template <typename scalar_t, int LANE>
__global__ void __launch_bounds__(kThreads) sorted_carry_kernel(
    const int32_t* __restrict__ trailing_cells, const acc_type<scalar_t>* __restrict__ partials,
    const int32_t* __restrict__ chunk_flags, int64_t chunks, int channels, int team_log2, scalar_t* __restrict__ grad_value,
    const UnsampledRows untouched) {
  using acc_t = acc_type<scalar_t>;
  const int64_t chunk = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> team_log2;
  const int channel = (threadIdx.x & ((1 << team_log2) - 1)) * LANE;
  if (chunk < chunks && channel < channels && (chunk_flags[chunk] & kTrailing)) {
    acc_t sum[LANE];
    const acc_t* own = partials + (2 * chunk + 1) * channels + channel;
#pragma unroll
    for (int v = 0; v < LANE; ++v) sum[v] = own[v];
    for (int64_t next = chunk + 1; next < chunks; ++next) {
      const acc_t* lead = partials + 2 * next * channels + channel;
#pragma unroll
      for (int v = 0; v < LANE; ++v) sum[v] += lead[v];
      if (chunk_flags[next] & kLeadEndsHere) break;
    }
    store_lane(grad_value + static_cast<int64_t>(trailing_cells[chunk]) * channels + channel, from_acc_vec<scalar_t, LANE>(sum));
  }
  // The listed long gaps, a block per segment.
  if (!untouched.in_place) return;
  const int segments = static_cast<int>(min(static_cast<int64_t>(*untouched.count), untouched.capacity));
  for (int segment = blockIdx.x; segment < segments; segment += gridDim.x) {
    untouched.zero(untouched.count[1 + 2 * segment], untouched.count[2 + 2 * segment], threadIdx.x, blockDim.x);
  }
}

// Step 2: a stable radix sort of the entries by pixel over the bits the pixels need (cub's sort is
// stable: equal keys keep their input order, EntryOrder's).
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

// Steps 2 and 3 where each (batch, head, level)'s entries (a level run) fit one block: a block sorts
// them by pixel in shared memory, and sums their cells there. A key packs (pixel << index bits |
// index in the level's run) and the sort reads the pixel's bits only: cub's block radix ranking, 5
// bits a pass, stable in the blocked arrangement, so a cell keeps its entries in EntryOrder's order,
// as cub's device sort does. The sort alone, in one launch of groups x levels blocks, took 9.1 us for
// DETR's bs 2 decoder (64 runs of 4,800 entries) against cub's 32.6 us with its memsets (H100,
// session 39, perf_notes item 86); summing in the same blocks then saved the chunk sums and the
// carry (item 87). Each pass scatters the keys by rank straight into the run's array, where the
// sums read them: cub's whole block sort, with its last pass to registers and a copy back to shared
// memory, took 38.6 us against 36.8 on DINO's fp16 decoder (H100, session 42, item 91).
constexpr int kLevelSortThreads = 512;
constexpr int kRadixBits = 5;
constexpr int kRadixDigits = 1 << kRadixBits;
using LevelRank = cub::BlockRadixRank<kLevelSortThreads, kRadixBits, false>;
// Keys a thread ranks: the smallest shape that holds a run, since a thread's keys set the sort's
// latency (DINO's five levels, 8 points, bs 1: 9,600-entry runs, fp16 backward 0.0698 ms in 20 keys
// a thread, 0.0781 in 29; H100, session 39). They hold up to 2,560, 5,632 (DETR's 300 queries x 4
// points), 7,680, 10,752 and 14,848 entries (900 x 4); odd, so that a warp's blocked reads of the
// run's array meet no bank conflicts; 29 keys a thread is the most that fits 512 threads' registers
// without spilling.
constexpr int kLevelSortItems[] = {5, 11, 15, 21, 29};
constexpr int index_bits_for(int capacity) { return capacity <= 1 ? 0 : 1 + index_bits_for((capacity + 1) / 2); }

// The most blocks that share a level run (each sorts all of it and sums a part), while the runs are
// fewer than the SMs.
constexpr int kMaxRunSplit = 4;

// The front of a block's dynamic shared memory: the ranking's counters during a pass, the run's keys
// between passes and sorted after the last, then the teams' lead sums (fp32 rows and a flag each).
__host__ __device__ constexpr int sort_region_bytes(int run_capacity) {
  constexpr int kRankBytes = static_cast<int>(sizeof(typename LevelRank::TempStorage));
  constexpr int kLeadBytes = (8 * static_cast<int>(sizeof(float)) + static_cast<int>(sizeof(int))) * kLevelSortThreads;
  const int keys = 4 * run_capacity;
  const int bytes = keys > kRankBytes ? keys : kRankBytes;
  return ((bytes > kLeadBytes ? bytes : kLeadBytes) + 15) / 16 * 16;
}

// cp.async of 16 bytes from global to shared memory: the staging loads stay in flight through the
// sort that follows them.
__device__ __forceinline__ void copy_16_async(void* shared, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(shared))),
               "l"(global)
               : "memory");
}

__device__ __forceinline__ void wait_copies_async() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// A row's elements in the accumulator type. bf16 pairs widen by a shift and a mask, one instruction
// an element: the intrinsic's unpack and shift took two, and made the bf16 walk 25 % longer than the
// fp16 one (ncu, DINO's decoder; H100, session 43).
template <typename scalar_t, int N>
__device__ __forceinline__ void widen_row(const Vec<scalar_t, N>& row, acc_type<scalar_t> (&out)[N]) {
  if constexpr (std::is_same_v<scalar_t, __nv_bfloat16> && N % 2 == 0) {
    const uint32_t* pairs = reinterpret_cast<const uint32_t*>(&row);
#pragma unroll
    for (int i = 0; i < N; i += 2) {
      out[i] = __uint_as_float(pairs[i / 2] << 16);
      out[i + 1] = __uint_as_float(pairs[i / 2] & 0xffff0000u);
    }
  } else {
    to_acc(row, out);
  }
}

// A pass's digit of a packed key.
struct PixelDigit {
  uint32_t first_bit, mask;
  __device__ __forceinline__ uint32_t Digit(uint32_t key) const { return (key >> first_bit) & mask; }
};

// A cell's entries all lie in one level run (a pixel belongs to one level), so the block that sorts a
// run can also sum its cells, and the sorted order never leaves shared memory. Before the sort the
// block stages, with asynchronous copies that overlap it, the run's entry weights and, where shared
// memory holds them, the (batch, head)'s output-gradient rows (a query's row serves its points x 4
// entries of the run). After the sort, teams of lanes sum equal ranges of the block's part of the
// run, weight x row in sorted order, and write the rows of the cells they hold whole; a cell that
// crosses ranges is finished in range order by the team where it begins.
template <typename scalar_t, int kItems>
__global__ void __launch_bounds__(kLevelSortThreads, 1) sort_and_sum_level_runs_kernel(
    const int32_t* __restrict__ keys, const acc_type<scalar_t>* __restrict__ entry_weights,
    const scalar_t* __restrict__ grad_output, const EntryOrder order, int levels, int run, FastDivisor by_run, int end_bit,
    int split, int index_bits, int num_keys, int channels, int team_log2, bool stage_rows,
    scalar_t* __restrict__ grad_value) {
  using acc_t = acc_type<scalar_t>;
  constexpr int LANE = kLaneElements;
  constexpr int kCapacity = kLevelSortThreads * kItems;
  static_assert(sizeof(acc_t) == sizeof(float), "the lead sums' region is sized for fp32 rows");
  extern __shared__ __align__(16) unsigned char level_stage[];
  const int level_run = static_cast<int>(blockIdx.x) / split, part = static_cast<int>(blockIdx.x) - level_run * split;
  const int group = level_run / levels, level = level_run - group * levels;
  const int batch = group / order.heads, head = group - batch * order.heads;
  const int queries = order.queries, level_entries = queries * run;
  const int32_t group_first = group * queries * order.corners_per_query;
  // A level's entries are a run of `run` (points x 4 corners) per query: local index q x run + r.
  const auto entry_of = [&](int local) {
    const int query = static_cast<int>(by_run.divide(local));
    return group_first + query * order.corners_per_query + level * run + (local - query * run);
  };
  uint32_t* sorted = reinterpret_cast<uint32_t*>(level_stage);
  auto& rank_storage = *reinterpret_cast<typename LevelRank::TempStorage*>(level_stage);
  const int region_bytes = sort_region_bytes(kCapacity);
  acc_t* weights = reinterpret_cast<acc_t*>(level_stage + region_bytes);
  scalar_t* staged_rows =
      reinterpret_cast<scalar_t*>(level_stage + region_bytes + (level_entries * sizeof(acc_t) + 15) / 16 * 16);
  const scalar_t* group_rows = grad_output + (static_cast<int64_t>(batch) * queries * order.heads + head) * channels;
  {
    // The output-gradient rows first: they do not depend on the point kernel, whose end the block
    // then waits for (launched as its dependent, it may begin while the point kernel drains).
    if (stage_rows) {
      constexpr int kElementsPerPiece = 16 / sizeof(scalar_t);
      const int row_pieces = channels / kElementsPerPiece;
      const int64_t row_stride = static_cast<int64_t>(order.heads) * channels;
      for (int piece = threadIdx.x; piece < queries * row_pieces; piece += kLevelSortThreads) {
        const int query = piece / row_pieces, at = (piece - query * row_pieces) * kElementsPerPiece;
        copy_16_async(staged_rows + query * channels + at, group_rows + query * row_stride + at);
      }
    }
    wait_for_prior_grid();
    // The run's keys into the key region, then its weights: a query's run of either is whole
    // 16-byte pieces (run is a multiple of 4), as is a row. Each thread reading its blocked keys
    // from global memory (a stride of kItems between lanes, 29 sectors a load) stalled the kernel
    // longer than a sort pass (ncu, DINO's fp16 decoder; H100, session 42, item 92).
    for (int piece = threadIdx.x; piece * 4 < level_entries; piece += kLevelSortThreads) {
      const int local = piece * 4;
      copy_16_async(sorted + local, keys + entry_of(local));
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    constexpr int kWeightsPerPiece = 16 / sizeof(acc_t);
    for (int piece = threadIdx.x; piece * kWeightsPerPiece < level_entries; piece += kLevelSortThreads) {
      const int local = piece * kWeightsPerPiece;
      copy_16_async(weights + local, entry_weights + entry_of(local));
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
  asm volatile("cp.async.wait_group 1;" ::: "memory");  // the keys (and rows) have landed, the weights may not
  __syncthreads();
  // The run's keys, blocked: thread x kItems + k.
  const int first_local = static_cast<int>(threadIdx.x) * kItems;
  uint32_t packed[kItems];
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int local = first_local + k;
    packed[k] = local < level_entries ? (sorted[local] << index_bits) | static_cast<uint32_t>(local)
                                      : 0xffffffffu;  // past the run: sorts last
  }
  __syncthreads();  // every key is read before the first pass's counters take the region
  // Least significant digit first; the last pass leaves the keys sorted in the run's array.
  for (int bit = index_bits, last = index_bits + end_bit; bit < last; bit += kRadixBits) {
    const PixelDigit digit{static_cast<uint32_t>(bit), (1u << min(kRadixBits, last - bit)) - 1u};
    int rank[kItems];
    LevelRank(rank_storage).RankKeys(packed, rank, digit);
    __syncthreads();  // every thread's counters are read: the keys take their place
#pragma unroll
    for (int k = 0; k < kItems; ++k) sorted[rank[k]] = packed[k];
    __syncthreads();
    if (bit + kRadixBits >= last) break;
#pragma unroll
    for (int k = 0; k < kItems; ++k) packed[k] = sorted[first_local + k];
    __syncthreads();  // read before the next pass's counters overwrite them
  }
  wait_copies_async();
  __syncthreads();  // every copy has landed
  const auto pixel_at = [&](int rank) { return static_cast<int>(sorted[rank] >> index_bits); };
  const uint32_t index_mask = (1u << index_bits) - 1u;
  // The run's `split` blocks each sum the cells of one part: from the first cell boundary at or
  // past part x entries / split, so no cell crosses blocks, to the next part's start. Where the
  // runs are fewer than the SMs, this keeps them busy: with one block per run the sums took 19 us
  // beyond the sort's 9 on DETR's bs 2 fp16 decoder, 64 runs on 132 SMs (H100, session 40).
  const auto part_start = [&](int k) {
    int lo = static_cast<int>(static_cast<int64_t>(k) * level_entries / split);
    if (lo == 0 || lo == level_entries) return lo;
    const int pixel = pixel_at(lo - 1);
    int hi = level_entries;  // the first rank past lo - 1's cell: pixels ascend
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (pixel_at(mid) <= pixel) lo = mid + 1; else hi = mid;
    }
    return lo;
  };
  const int part_begin = part_start(part), part_end = max(part_begin, part_start(part + 1));
  // Each team sums an equal range of the part's ranks, whatever the cells: a cell of thousands of
  // entries (the coarsest level gathers many queries' corners) is spread over teams as cub's pieces
  // are over chunks. A range's first piece that continues a cell begun before it (its lead) is left
  // for that cell's trailing team to add, in range order; a last piece that runs past the range
  // (trailing) is finished so. A team walking whole cells took 148 us on DINO's fp16 decoder (900
  // queries) against 25 us for the sort alone (H100, session 40).
  const int team_size = 1 << team_log2, teams = kLevelSortThreads >> team_log2;
  const int team = static_cast<int>(threadIdx.x) >> team_log2;
  const int channel = (static_cast<int>(threadIdx.x) & (team_size - 1)) * LANE;
  const bool active = channel < channels;
  const int span = (part_end - part_begin + teams - 1) / teams;
  const int begin = min(part_end, part_begin + team * span), end = min(part_end, begin + span);
  const auto write_row = [&](int pixel, const acc_t (&sum)[LANE]) {
    const int64_t cell = (static_cast<int64_t>(batch) * num_keys + pixel) * order.heads + head;
    if (active) store_lane(grad_value + cell * channels + channel, from_acc_vec<scalar_t, LANE>(sum));
  };
  int cell_pixel = begin < end ? pixel_at(begin) : num_keys;  // invalid corners (num_keys) end the run
  const bool lead = begin < end && begin > 0 && cell_pixel != num_keys && pixel_at(begin - 1) == cell_pixel;
  bool lead_ended = false;  // the lead piece ends inside the range
  acc_t sum[LANE], lead_sum[LANE];
#pragma unroll
  for (int v = 0; v < LANE; ++v) sum[v] = lead_sum[v] = acc_t(0);
  // The walk over the team's range, rows from shared memory or (kStaged false) through L1. The lead
  // piece is summed first, so that the main loop only sums and writes pieces: with the lead's copy
  // and one entry's loads carried ahead in the loop, ptxas moved some 40 registers an entry, and
  // the kernel took 17.3 us against 15.7 on DETR's bs 2 fp16 decoder (H100, session 40, item 88).
  const int read_channel = active ? channel : 0;  // in bounds for every lane
  const auto walk = [&](auto staged) {
    constexpr bool kStaged = decltype(staged)::value;
    using index_t = std::conditional_t<kStaged, int, int64_t>;  // staged rows fit shared memory
    const index_t row_stride = kStaged ? channels : static_cast<index_t>(order.heads) * channels;
    const auto add = [&](uint32_t key, acc_t (&into)[LANE]) {
      const uint32_t local = key & index_mask;
      const acc_t weight = weights[local];
      const index_t at = static_cast<index_t>(by_run.divide(local)) * row_stride + read_channel;
      const auto load_row = [&] {
        return kStaged ? *reinterpret_cast<const Vec<scalar_t, LANE>*>(staged_rows + at)
                       : load_lane<scalar_t, LANE>(group_rows + at);
      };
      // The row is copied whole: widened straight from shared memory, fp32's rows took eight 4-byte
      // loads instead of two 16-byte ones, and DINO's fp32 decoder kernel 56 us against 36. Half
      // precision loads without a branch (a lane past the channels reads channel 0's elements and
      // never writes its sums): DINO's fp16 decoder kernel 33.0 -> 31.9 us. fp32 keeps the branch,
      // which measured 2-3 % faster on DETR's decoder and DINO's five levels (H100, session 43).
      Vec<scalar_t, LANE> row{};
      if constexpr (sizeof(scalar_t) == 2) {
        row = load_row();
      } else if (active) {
        row = load_row();
      }
      acc_t go[LANE];
      widen_row(row, go);
#pragma unroll
      for (int v = 0; v < LANE; ++v) into[v] = fma(weight, go[v], into[v]);
    };
    int e = begin;
    if (lead) {
      for (; e < end; ++e) {
        const uint32_t key = sorted[e];
        if (static_cast<int>(key >> index_bits) != cell_pixel) break;
        add(key, lead_sum);
      }
      if (e < end) {
        lead_ended = true;
        cell_pixel = pixel_at(e);
      }
    }
#pragma unroll 2
    for (; e < end; ++e) {
      const uint32_t key = sorted[e];
      const int pixel = static_cast<int>(key >> index_bits);
      if (pixel != cell_pixel) {  // a piece ends
        if (cell_pixel != num_keys) write_row(cell_pixel, sum);
        cell_pixel = pixel;
#pragma unroll
        for (int v = 0; v < LANE; ++v) sum[v] = acc_t(0);
      }
      add(key, sum);
    }
  };
  if (stage_rows) {
    walk(std::true_type{});
  } else {
    walk(std::false_type{});
  }
  const bool continues = end < level_entries && cell_pixel != num_keys && pixel_at(end) == cell_pixel;
  const bool lead_ends = lead_ended || !continues;
  // The range's last piece: finished by the carry below where it runs past the range (trailing),
  // written here where it ends inside. A range that the lead fills has no other piece.
  const bool lead_only = lead && !lead_ended;
  const bool trailing = !lead_only && continues;
  if (!lead_only && !continues && begin < end && cell_pixel != num_keys) write_row(cell_pixel, sum);
  __syncthreads();  // every team is done with the sorted ranks: their storage takes the lead pieces
  acc_t* lead_sums = reinterpret_cast<acc_t*>(level_stage);  // [teams][channels]
  int* lead_ends_here = reinterpret_cast<int*>(lead_sums + teams * channels);
  if (lead && active) {
#pragma unroll
    for (int v = 0; v < LANE; ++v) lead_sums[team * channels + channel + v] = lead_sum[v];
  }
  if (channel == 0) lead_ends_here[team] = lead_ends ? 1 : 0;
  __syncthreads();
  if (trailing) {  // the cell ends in this block: parts start at cell boundaries
    for (int later = team + 1; later < teams; ++later) {
#pragma unroll
      for (int v = 0; v < LANE; ++v) sum[v] += active ? lead_sums[later * channels + channel + v] : acc_t(0);
      if (lead_ends_here[later]) break;
    }
    write_row(cell_pixel, sum);
  }
}

// The block shape that sorts the problem's level runs, keys a thread (0 where none applies: fp64
// values or single-element lanes, which cub sorts, runs longer than the large block, or pixel and
// index bits past 32) and the index bits of a key.
struct LevelSortShape {
  int items = 0, index_bits = 0;
};

LevelSortShape level_sort_shape(const ProblemTensors& problem, const at::Tensor& grad_output, int end_bit) {
  if (problem.value.scalar_type() == at::kDouble || lane_elements(problem, grad_output) != kLaneElements) return {};
  const int64_t run_entries = 4 * problem.queries * problem.points;
  for (const int items : kLevelSortItems) {
    const int capacity = kLevelSortThreads * items, index_bits = index_bits_for(capacity);
    if (run_entries <= capacity && end_bit + index_bits <= 32) return {items, index_bits};
  }
  return {};
}

template <typename scalar_t>
void sort_and_sum_level_runs(const ProblemTensors& problem, const LevelSortShape& shape, int end_bit,
                             const at::Tensor& keys, const at::Tensor& entry_weights, const scalar_t* grad_output,
                             const EntryOrder& order, int team_log2, const at::Tensor& grad_value) {
  using acc_t = acc_type<scalar_t>;
  const auto kernel = shape.items == kLevelSortItems[0]   ? sort_and_sum_level_runs_kernel<scalar_t, kLevelSortItems[0]>
                      : shape.items == kLevelSortItems[1] ? sort_and_sum_level_runs_kernel<scalar_t, kLevelSortItems[1]>
                      : shape.items == kLevelSortItems[2] ? sort_and_sum_level_runs_kernel<scalar_t, kLevelSortItems[2]>
                      : shape.items == kLevelSortItems[3] ? sort_and_sum_level_runs_kernel<scalar_t, kLevelSortItems[3]>
                                                          : sort_and_sum_level_runs_kernel<scalar_t, kLevelSortItems[4]>;
  const int run = static_cast<int>(4 * problem.points);
  const int region_bytes = sort_region_bytes(kLevelSortThreads * shape.items);
  const int weight_bytes = static_cast<int>((problem.queries * run * sizeof(acc_t) + 15) / 16 * 16);
  const int64_t row_bytes = problem.queries * problem.channels * static_cast<int64_t>(sizeof(scalar_t));
  const int limit = dynamic_shared_limit(reinterpret_cast<const void*>(kernel));
  TORCH_CHECK(region_bytes + weight_bytes <= limit,
              "mmdeform_tma sorted backward: a level run's keys and weights exceed shared memory");
  const bool stage_rows = region_bytes + weight_bytes + row_bytes <= limit;  // else the rows are read through L1
  const int levels = static_cast<int>(problem.levels);
  // Blocks per level run: up to kMaxRunSplit, while the runs leave SMs idle (a block fills an SM).
  const int64_t runs = problem.batch * problem.heads * levels;
  const int split = static_cast<int>(std::clamp<int64_t>(multiprocessor_count() / runs, 1, kMaxRunSplit));
  const unsigned blocks = static_cast<unsigned>(runs * split);
  const unsigned shared_bytes = region_bytes + weight_bytes + (stage_rows ? row_bytes : 0);
  const auto args = std::make_tuple(
      keys.data_ptr<int32_t>(), entry_weights.data_ptr<acc_t>(), grad_output, order, levels, run,
      fast_divisor(static_cast<uint32_t>(run)), end_bit, split, shape.index_bits, static_cast<int>(problem.num_keys),
      static_cast<int>(problem.channels), team_log2, stage_rows, reinterpret_cast<scalar_t*>(grad_value.data_ptr()));
  // A dependent launch: the blocks stage their output-gradient rows while the point kernel drains
  // (1-4 % of the decoder backwards, H100, session 41).
  std::apply([&](auto... arg) { launch_as_dependent(kernel, blocks, kLevelSortThreads, shared_bytes, current_stream(), arg...); },
             args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The sort's key bits: invalid corners take the key one past the last pixel, which sorts last.
int key_end_bit(const ProblemTensors& problem) {
  int end_bit = 1;
  while (end_bit < 31 && (int64_t{1} << end_bit) <= problem.num_keys) ++end_bit;
  return end_bit;
}

// Whether step 3 zeroes the untouched rows where it finds them instead of step 1 filling
// grad_value: only where cub sorts (the gaps assume pixel-major ranks), and there where a (batch,
// head) has at least two corners per key (at most e^-2 of its rows untouched), or where an fp32 (or
// wider) grad_value exceeds the L2 (the fill would go to DRAM; perf_notes item 82). Where the level
// runs fit a block, the fill with the block sort beat cub in place everywhere measured (H100,
// session 39, item 86): DINO's decoder fp32 / fp16 / bf16 0.131 / 0.119 / 0.120 -> 0.118 / 0.108 /
// 0.104 ms, DETR's bs 4 fp32 decoder 0.129 -> 0.097, a 512 x 512 image's 300-query decoder 0.071 ->
// 0.046 (5.5 corners per key).
bool zeroes_in_place(const ProblemTensors& problem, const at::Tensor& grad_output) {
  if (level_sort_shape(problem, grad_output, key_end_bit(problem)).items != 0) return false;
  return 4 * problem.queries * problem.levels * problem.points >= 2 * problem.num_keys ||
         (problem.value.element_size() >= 4 &&
          static_cast<int64_t>(problem.value.nbytes()) > current_device_attribute(cudaDevAttrL2CacheSize));
}

int64_t blocks_for(int64_t threads) { return (threads + kThreads - 1) / kThreads; }

}  // namespace

bool sorts_level_runs(const ProblemTensors& problem, const at::Tensor& grad_output) {
  return level_sort_shape(problem, grad_output, key_end_bit(problem)).items != 0;
}

std::string sorted_backward_unsupported(const ProblemTensors& problem, const at::Tensor& grad_output) {
  const int lane = lane_elements(problem, grad_output);
  if (problem.channels > 32 * lane) {
    return "channels per head (" + num(problem.channels) + ") exceed a warp's one vector per lane (" + num(32 * lane) + ")";
  }
  const int element_bytes = static_cast<int>(problem.value.element_size());
  const int stage_bytes = chunk_stage_bytes(element_bytes, element_bytes == 8 ? 8 : 4,
                                            lane << team_log2_for((problem.channels + lane - 1) / lane));
  if (stage_bytes > kMaxStageBytes) {
    return "a warp's 32 staged output-gradient rows (" + num(stage_bytes) + " bytes) exceed " + num(kMaxStageBytes) +
           " bytes of shared memory";
  }
  if ((problem.num_keys + 1) * problem.batch * problem.heads >= INT32_MAX) return "2^31 or more (batch, key, head) cells";
  if (4 * problem.num_items() * problem.levels * problem.points >= INT32_MAX) return "2^31 or more sampled corners";
  return {};
}

Gradients sorted_deterministic_backward(const ProblemTensors& problem, const at::Tensor& grad_output) {
  const auto coordinate_grads = coordinate_gradients(problem);
  const at::Tensor& grad_locations = coordinate_grads.first;
  const at::Tensor& grad_weights = coordinate_grads.second;
  // Every row is written: by step 3, summed or zeroed as untouched, or zeroed by the point kernel
  // first (at::zeros would also fill under torch's deterministic mode).
  at::Tensor grad_value = uninitialized(problem.value.sizes(), problem.value.options());
  const int64_t points = problem.num_items() * problem.levels * problem.points;
  const bool empty = problem.empty_output() || points == 0;
  if (empty) {
    C10_CUDA_CHECK(cudaMemsetAsync(grad_value.data_ptr(), 0, grad_value.nbytes(), current_stream()));
    grad_locations.zero_();
    grad_weights.zero_();
    return {grad_value, grad_locations, grad_weights};
  }
  const int64_t entries = 4 * points;
  const auto acc_dtype = problem.value.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto int_options = problem.value.options().dtype(at::kInt);
  const int end_bit = key_end_bit(problem);
  const LevelSortShape level_sort = level_sort_shape(problem, grad_output, end_bit);
  const bool sorts_in_blocks = level_sort.items != 0;
  const bool in_place = zeroes_in_place(problem, grad_output);
  const at::Tensor keys = uninitialized({entries}, int_options);
  // cub's payload and output; the blocks keep theirs in shared memory.
  const at::Tensor index = sorts_in_blocks ? at::Tensor() : uninitialized({entries}, int_options);
  at::Tensor sorted_keys = sorts_in_blocks ? at::Tensor() : uninitialized({entries}, int_options);
  at::Tensor order = sorts_in_blocks ? at::Tensor() : uninitialized({entries}, int_options);
  const at::Tensor entry_weights = uninitialized({entries}, problem.value.options().dtype(acc_dtype));
  const EntryOrder entry_order = entry_order_of(problem);
  const int lane = lane_elements(problem, grad_output);
  const int team_log2 = team_log2_for((problem.channels + lane - 1) / lane);
  const auto stream = current_stream();
  // The untouched rows' stores: the widest that divides a row and grad_value's alignment.
  const int64_t row_bytes = problem.channels * static_cast<int64_t>(problem.value.element_size());
  int unit_bytes = 16;
  while (unit_bytes > 2 &&
         (row_bytes % unit_bytes != 0 || reinterpret_cast<uintptr_t>(grad_value.data_ptr()) % unit_bytes != 0)) {
    unit_bytes /= 2;
  }
  // Listed gaps: a segment per kListedGapRows rows, and one more per gap.
  const int64_t cells = problem.batch * problem.num_keys * problem.heads;
  const int64_t capacity = 2 * (cells / kListedGapRows) + 4;
  const at::Tensor gap_list = uninitialized({1 + 2 * capacity}, int_options);
  const int groups = static_cast<int>(problem.batch * problem.heads), row_units = static_cast<int>(row_bytes / unit_bytes);
  // The fill's 16-byte stores, and the rest, under 16 bytes, by a memset.
  const int64_t zero_vectors = in_place ? 0 : grad_value.nbytes() / 16;
  const int64_t zero_tail = in_place ? 0 : grad_value.nbytes() - 16 * zero_vectors;
  if (zero_tail > 0) {
    C10_CUDA_CHECK(cudaMemsetAsync(static_cast<char*>(grad_value.data_ptr()) + 16 * zero_vectors, 0, zero_tail, stream));
  }
  const UnsampledRows untouched{in_place,
                                static_cast<char*>(grad_value.data_ptr()),
                                static_cast<int>(problem.num_keys),
                                groups,
                                static_cast<int>(problem.heads),
                                fast_divisor(static_cast<uint32_t>(groups)),
                                fast_divisor(static_cast<uint32_t>(problem.heads)),
                                row_units,
                                unit_bytes,
                                fast_divisor(static_cast<uint32_t>(row_units)),
                                gap_list.data_ptr<int32_t>(),
                                capacity};
  MMDEFORM_TMA_DISPATCH_VALUE_TYPES(problem.value.scalar_type(), "mmdeform_tma sorted backward", [&] {
    using coord_t = coord_type<scalar_t>;
    using acc_t = acc_type<scalar_t>;
    const auto* go = reinterpret_cast<const scalar_t*>(grad_output.data_ptr());
    const PointIndex point_index{fast_divisor(static_cast<uint32_t>(problem.levels * problem.points)),
                                 fast_divisor(static_cast<uint32_t>(problem.points))};
    const auto launch_points = [&](auto kernel) {
      // Enough threads that none zeroes more than 8 vectors when the points are few.
      const int64_t blocks = std::max(blocks_for(points << team_log2), blocks_for((zero_vectors + 7) / 8));
      kernel<<<blocks, kThreads, 0, stream>>>(
          problem.problem<scalar_t>(), go, grad_locations.data_ptr<coord_t>(), grad_weights.data_ptr<coord_t>(),
          keys.data_ptr<int32_t>(), sorts_in_blocks ? nullptr : index.data_ptr<int32_t>(), entry_weights.data_ptr<acc_t>(),
          entry_order, point_index, team_log2,
          gap_list.data_ptr<int32_t>(), reinterpret_cast<uint4*>(grad_value.data_ptr()), zero_vectors);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (lane > 1) {
      launch_points(point_gradients_kernel<scalar_t, kLaneElements>(in_place));
    } else {
      launch_points(point_gradients_kernel<scalar_t, 1>(in_place));
    }
    if constexpr (!std::is_same_v<scalar_t, double>) {  // fp64 never sorts in blocks
      if (sorts_in_blocks) {
        sort_and_sum_level_runs<scalar_t>(problem, level_sort, end_bit, keys, entry_weights, go, entry_order, team_log2,
                                          grad_value);
        return;
      }
    }
    sort_entries(keys, index, sorted_keys, order, end_bit);
    const int64_t chunks = (entries + 31) / 32;
    const at::Tensor partials = uninitialized({chunks, 2, problem.channels}, problem.value.options().dtype(acc_dtype));
    const at::Tensor chunk_flags = uninitialized({chunks}, int_options), trailing_cells = uninitialized({chunks}, int_options);
    const int row_elements = lane << team_log2;
    const auto launch_sums = [&](auto chunk_kernel, auto carry_kernel) {
      // As many warps per block as the stage allows (8 on every common shape).
      const int stage_bytes = chunk_stage_bytes(sizeof(scalar_t), sizeof(acc_t), row_elements);
      const int warps = std::min(kThreads / 32, kMaxStageBytes / stage_bytes);
      chunk_kernel<<<(chunks + warps - 1) / warps, 32 * warps, warps * stage_bytes, stream>>>(
          sorted_keys.data_ptr<int32_t>(), order.data_ptr<int32_t>(), entry_weights.data_ptr<acc_t>(), entries, go,
          entry_order, static_cast<int>(problem.num_keys), static_cast<int>(problem.batch * problem.heads),
          static_cast<int>(problem.channels), team_log2, partials.data_ptr<acc_t>(), chunk_flags.data_ptr<int32_t>(),
          trailing_cells.data_ptr<int32_t>(), reinterpret_cast<scalar_t*>(grad_value.data_ptr()), untouched);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      // At least two blocks per SM, for the listed gaps' segments.
      const int64_t carry_blocks = std::max<int64_t>(blocks_for(chunks << team_log2), 2 * multiprocessor_count());
      carry_kernel<<<carry_blocks, kThreads, 0, stream>>>(
          trailing_cells.data_ptr<int32_t>(), partials.data_ptr<acc_t>(), chunk_flags.data_ptr<int32_t>(), chunks,
          static_cast<int>(problem.channels), team_log2, reinterpret_cast<scalar_t*>(grad_value.data_ptr()), untouched);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (lane > 1) {
      launch_sums(sorted_chunk_sums_kernel<scalar_t, kLaneElements>, sorted_carry_kernel<scalar_t, kLaneElements>);
    } else {
      launch_sums(sorted_chunk_sums_kernel<scalar_t, 1>, sorted_carry_kernel<scalar_t, 1>);
    }
  });
  return {grad_value, grad_locations, grad_weights};
}

}  // namespace mmdeform_tma
