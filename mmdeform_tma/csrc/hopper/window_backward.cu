// `tma_ws` backward: the window pipeline's consumers scatter each point's value-gradient
// contributions (vector reductions into global memory) and reduce its location and attention
// gradients; window points read their corners from shared memory.
//
// Summing a tile's contributions in a shared-memory window first, to reduce fewer times into L2,
// was measured and lost on every shape (docs/perf_notes.md): sm_90 has no native shared-memory
// float addition (ptxas emits a compare-and-swap loop), and native 32-bit integer reductions on
// fixed-point values still cost more per element than the global vector reductions they saved.
//
// The gather variant (configs with `gather`) sums without shared-memory additions: per stage the
// producer sorts the window points' corners by window cell (a counting sort; only its counters use
// integer atomics), and after their own points the consumers walk the touched cells, sum each
// cell's contributions in registers in the sorted order, and reduce once per cell. Corners of
// points outside the window are reduced directly, as in the plain kernel. The order within a cell
// depends only on the data, so with the fixed-point sink the result stays bitwise reproducible.
// The walk reads each entry's output-gradient row from shared memory, where the consumers stage
// the tile's rows in fp32 at its first level: ncu (H100, 2026-11-23, commit 5543177) had the
// walk's global load, 64-bit address and conversion per entry as what made the gather execute
// 1.38x the plain kernel's instructions.
//
// The MMA variant (configs with `mma`) sums on the tensor cores instead. Per stage the
// consumer teams write each window point's four corner weights into a dense (slot x window cell)
// matrix A, as hi + lo 16-bit parts (by estimate, one 16-bit weight alone would put the fp16
// result at about 1.4x its rounding error, against the 1.5x allowed); after a barrier, the window's value gradient is A^T (cells x slots)
// times the tile's output-gradient rows (slots x channels), and each warp reduces its cells' sums
// once, skipping untouched cells. Per point the consumers keep only the dot products (corners via
// L1) and the location and attention gradients: no reductions for window points. With teams of
// four lanes (32 channels) the dot products run on the tensor cores too (mma_point_dots). A warp
// zeroes the block of A it alone read; a second barrier orders that before the next stage's writes.
// Rows of non-finite output gradients, weights beyond |1| and points outside the window take the
// direct path, so A and the staged rows stay finite and a NaN reaches only the cells it touches.
// In the deterministic (fixed-point) MMA kernel for rows of 32 channels, a warp stages each window
// row's sums in fixed point and the TMA adds them (cp.reduce.async.bulk.tensor), in place of 64-bit
// atomics. fp32 rows run the same MMA on fp16 operands: A as for fp16, the output-gradient rows as
// hi + lo parts of the rows times one power of two per tile (tile_largest_finite), three products
// per step; their dots stay on the FMA units.
//
// Where sampling spreads over the image (no window pays), the fast 32-channel MMA kernels are slower
// than the plain kernel and `cuda`'s: their teams of four reduce each direct corner as two half
// lines. A CTA whose first stage spreads leaves its tiles to a fallback launched after it over the
// same tiles (LaunchShape::spread_role), whose blocks of the other CTAs exit at once: in fp16/bf16 the
// plain kernel on the same grid, in fp32 the portable kernel's teams (spread_fallback.cuh).
#include <cstddef>

#include "../common/grad_accumulation.cuh"
#include "../common/launchers.h"
#include "backward_chunk.h"
#include "fixed_point_flush.cuh"
#include "mma_fragments.cuh"
#include "spread_fallback.cuh"
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

// One corner of a window point, in the gather index: its contribution is weight x the output
// gradient row of its query, the tile's query slot `slot`.
template <typename coord_t>
struct alignas(2 * sizeof(coord_t)) GatherEntry {
  coord_t weight;
  int slot;
};

// Gather kernels are built for the usual lane chunk of each dtype but fp64 (gradcheck): 8 bytes
// for fp16/bf16 (rows of up to 64 channels), 16 for fp32. Other problems run the plain kernel.
constexpr bool gather_built(int element_size, int chunk_bytes) {
  return element_size == 2 ? chunk_bytes == 8 : element_size == 4;
}

template <typename coord_t>
__device__ __forceinline__ GatherEntry<coord_t>* gather_entries(const Ring<coord_t>& ring, int stage) {
  return reinterpret_cast<GatherEntry<coord_t>*>(ring.window(stage) + ring.s->entries_offset);
}
template <typename coord_t>
__device__ __forceinline__ uint32_t* gather_touched(const Ring<coord_t>& ring, int stage) {
  return reinterpret_cast<uint32_t*>(ring.window(stage) + ring.s->touched_offset);
}
// Touched cells of the stage, in the header after the StageWindow.
template <typename coord_t>
__device__ __forceinline__ int* gather_touched_count(const Ring<coord_t>& ring, int stage) {
  return reinterpret_cast<int*>(ring.header(stage) + 1);
}
template <typename coord_t>
__device__ __forceinline__ int* gather_counters(const Ring<coord_t>& ring) {
  return reinterpret_cast<int*>(ring.base + ring.s->scratch_offset);
}
// The tile's staged output-gradient rows (slot-major, fp32), buffer `parity` of two.
template <typename coord_t>
__device__ __forceinline__ float* gather_grad_rows(const Ring<coord_t>& ring, int parity) {
  return reinterpret_cast<float*>(ring.base + ring.s->grad_rows_offset + parity * ring.s->grad_rows_bytes);
}

#if MMDEFORM_TMA_HOPPER_DEVICE

// The producer's gather index of one stage, after the window pass (m.cell set for window points).
// Counting sort over the window points' corners: counts per cell (shared integer atomics), one
// warp scan that gives each touched cell its start and its place in the touched list (ascending
// cells), then a stable scatter: corners land in (point, corner) order within their cell. The
// counters are zero on entry and on exit.
template <typename scalar_t>
__device__ __forceinline__ void build_gather_index(const Problem<scalar_t>& p, const Ring<coord_type<scalar_t>>& ring,
                                                   const StageWindow& w, int stage) {
  using coord_t = coord_type<scalar_t>;
  const LaunchShape& s = *ring.s;
  const int lane = threadIdx.x & 31;
  if (w.rows == 0) {
    if (lane == 0) *gather_touched_count(ring, stage) = 0;
    return;
  }
  const WindowPoint<coord_t>* meta = ring.meta(stage);
  int* count = gather_counters(ring);
  uint32_t* touched = gather_touched(ring, stage);
  GatherEntry<coord_t>* entries = gather_entries(ring, stage);
  const int n = s.slots * p.points;
  const int down = s.window_cols;
  __syncwarp();
  for (int i = lane; i < n; i += 32) {
    const int cell = meta[i].cell;
    if (cell >= 0) {
      atomicAdd(count + cell, 1);
      atomicAdd(count + cell + 1, 1);
      atomicAdd(count + cell + down, 1);
      atomicAdd(count + cell + down + 1, 1);
    }
  }
  __syncwarp();

  // Lane L scans cells [L x per, (L + 1) x per); entries and touched cells are packed in one int
  // (each < 2^16, the host checks 4 n < 2^16).
  const int cells = w.rows * s.window_cols;
  const int per = (cells + 31) / 32;
  const int lo = min(lane * per, cells), hi = min(lo + per, cells);
  uint32_t packed = 0u;
  for (int c = lo; c < hi; ++c) {
    const int k = count[c];
    packed += (static_cast<uint32_t>(k) << 16) + (k > 0 ? 1u : 0u);
  }
  uint32_t inclusive = packed;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const uint32_t other = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += other;
  }
  int start = static_cast<int>((inclusive - packed) >> 16), place = static_cast<int>((inclusive - packed) & 0xFFFFu);
  for (int c = lo; c < hi; ++c) {
    const int k = count[c];
    if (k > 0) {
      touched[place++] = (static_cast<uint32_t>(start) << 16) | static_cast<uint32_t>(c);
      count[c] = start;  // from here on: the cell's next free entry
      start += k;
    }
  }
  if (lane == 31) {
    touched[place] = static_cast<uint32_t>(start) << 16;  // the end of the last cell
    *gather_touched_count(ring, stage) = place;
  }
  __syncwarp();

  const unsigned lower = (1u << lane) - 1u;
  const float inv_points = 1.0f / static_cast<float>(p.points);  // exact slot = i / points for i < 2^20
  for (int first = 0; first < n; first += 32) {
    const int i = first + lane;
    const int cell0 = i < n ? meta[i].cell : -1;
    if (__ballot_sync(0xffffffffu, cell0 >= 0) == 0u) continue;
    coord_t weight[4] = {coord_t(0), coord_t(0), coord_t(0), coord_t(0)};
    int slot = 0;
    if (cell0 >= 0) {
#pragma unroll
      for (int c = 0; c < 4; ++c) weight[c] = meta[i].weight[c];
      slot = static_cast<int>((static_cast<float>(i) + 0.5f) * inv_points);
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int cell = cell0 >= 0 ? cell0 + (c & 1) + ((c & 2) ? down : 0) : -1;
      const unsigned peers = __match_any_sync(0xffffffffu, cell);
      const int leader = __ffs(peers) - 1;
      int at = 0;
      if (cell >= 0 && lane == leader) {
        at = count[cell];
        count[cell] = at + __popc(peers);
      }
      at = __shfl_sync(0xffffffffu, at, leader) + __popc(peers & lower);
      if (cell >= 0) entries[at] = GatherEntry<coord_t>{weight[c], slot};
      __syncwarp();  // the next leader of this cell reads the count written here
    }
  }
  for (int c = lane; c < cells; c += 32) count[c] = 0;
  __syncwarp();
}

#endif  // MMDEFORM_TMA_HOPPER_DEVICE

// A location gradient (x, y) in one vector store; grad_locations is allocated by the op, aligned.
template <typename coord_t>
__device__ __forceinline__ void store_pair(coord_t* at, coord_t x, coord_t y) {
  struct alignas(2 * sizeof(coord_t)) Pair {
    coord_t x, y;
  };
  *reinterpret_cast<Pair*>(at) = Pair{x, y};
}

// How a window point's value-gradient contributions reach memory (the kernel's variants).
enum class Aggregation {
  kDirect,  // one reduction per corner
  kGather,  // summed per window cell from the producer's index
  kMma,     // summed per window cell on the tensor cores
};

// The MMA kernel's lane chunk: 8 channels, 16 bytes of halves or 32 of floats, so a row of 32-128
// half channels is a team of 4-16 lanes; teams of at least 4 write a point's four corners at once.
// Teams of four (32 channels) hold eight points per warp, where 16-byte float chunks would hold four
// and pay each point's metadata, sums and stores twice per warp: the fp16 MMA kernel ran 24 %
// under the plain one, the fp32 one with 16-byte chunks 2 % (perf_notes, session 25). fp32 rows
// take it at 32 channels only: 32-byte chunks spill at 64 channels (the fixed-point kernel) and
// at 4 CTAs per SM, so the fp32 `_o4` configs run the 3-CTA kernel.
constexpr int mma_chunk_bytes(int element_size) { return 8 * element_size; }
constexpr bool mma_built(int element_size, int64_t channels) {
  if (element_size == 4) return channels == 32;
  return element_size == 2 && channels % 16 == 0 && channels * element_size >= 4 * mma_chunk_bytes(element_size) &&
         channels * element_size <= 256;
}
constexpr int kMmaMaxKSteps = kMmaMaxSlots / 16;

// The tensor cores' operand type: value's for fp16/bf16; fp16 (hi + lo parts) for fp32.
template <typename scalar_t>
using MmaElement = std::conditional_t<sizeof(scalar_t) == 2, scalar_t, __half>;

// fp32 MMA backward: the output-gradient rows of a tile enter the tensor cores as fp16 hi + lo parts
// of the rows times 2^k, one power of two per tile that puts its largest finite element below
// 2^14 (fp16's range holds hi + lo, and the products stay far inside fp32's). hi + lo carries 22
// bits of every element within 2^-17 of that largest one; the smaller ones keep an absolute error
// below 2^-39 of it. k is clamped so that 2^k and 2^-k are normal floats.
struct RowScale {
  float scale, unscale;
};

__device__ __forceinline__ RowScale row_scale_for(float largest) {
  const int e = max(static_cast<int>((__float_as_uint(largest) >> 23) & 0xFFu) - 126, -110);  // largest < 2^e
  return {__uint_as_float(static_cast<uint32_t>(127 + 14 - e) << 23), __uint_as_float(static_cast<uint32_t>(127 + e - 14) << 23)};
}

// The fp32 MMA kernels' tile scale, in the stage header after the StageWindow (the gather's
// touched count sits there in the gather kernels, which take no MMA).
template <typename coord_t>
__device__ __forceinline__ float* mma_tile_largest(const Ring<coord_t>& ring, int stage) {
  return reinterpret_cast<float*>(ring.header(stage) + 1);
}

#if MMDEFORM_TMA_HOPPER_DEVICE

// Adds `weight` (scaled by the caller, LaunchShape::weight_scale) to A[slot][cell], hi and lo. Only
// this team writes the slot's row, one point after another, so the read-modify-write needs no atomics.
template <typename scalar_t>
__device__ __forceinline__ void add_mma_weight(uint32_t smem_base, const LaunchShape& s, int slot, int cell, float weight) {
  using mma_t = MmaElement<scalar_t>;
  const uint32_t hi = smem_base + static_cast<uint32_t>(s.a_offset + slot * s.a_stride + 2 * cell);
  const uint32_t lo = hi + static_cast<uint32_t>(s.a_bytes);
  const SplitWeight<mma_t> sum =
      split_weight<mma_t>(static_cast<float>(ld_shared_16<mma_t>(hi)) + static_cast<float>(ld_shared_16<mma_t>(lo)) + weight);
  st_shared_16(hi, sum.hi);
  st_shared_16(lo, sum.lo);
}

// The MMA kernel's lanes hold a row in two halves: lane l of a team has channels [h l, h l + h)
// and [C / 2 + h l, C / 2 + h l + h), h = 4 (two 8-byte chunks). A point's direct contributions
// then leave as two vector reductions that each cover whole 32-byte sectors across the team, as
// the 8-byte-lane kernels' do; one 16-byte chunk per lane would cover half of every sector twice,
// twice the L2 operations on the path that uniform sampling (no window pays) takes for every point.
// fp32 lanes hold two 16-byte halves of four floats each, loaded and reduced as 16-byte vectors.
struct SplitLane {
  int lo, hi;  // the lane's first channel of each half
};

// A corner's two halves from global memory (through L1), or zeros (in registers, as load_corner)
// when `valid` is 0; the second half lies `half_bytes` after the first. Volatile: never moved
// above the wait that makes the stage visible.
template <int BYTES>
__device__ __forceinline__ Chunk<BYTES> load_split_corner(uint32_t valid, const void* global, uint32_t half_bytes) {
  static_assert(BYTES == 16 || BYTES == 32, "16-byte (halves) or 32-byte (floats) chunks");
  Chunk<BYTES> c;
  if constexpr (BYTES == 16) {
    asm volatile(
        "{\n .reg .pred p;\n .reg .b64 g;\n setp.ne.u32 p, %4, 0;\n"
        " cvt.u64.u32 g, %6;\n add.s64 g, g, %5;\n"
        " mov.b32 %0, 0;\n mov.b32 %1, 0;\n mov.b32 %2, 0;\n mov.b32 %3, 0;\n"
        " @p ld.global.nc.v2.u32 {%0, %1}, [%5];\n"
        " @p ld.global.nc.v2.u32 {%2, %3}, [g];\n}"
        : "=r"(c.r[0]), "=r"(c.r[1]), "=r"(c.r[2]), "=r"(c.r[3])
        : "r"(valid), "l"(global), "r"(half_bytes));
  } else {
    asm volatile(
        "{\n .reg .pred p;\n .reg .b64 g;\n setp.ne.u32 p, %8, 0;\n"
        " cvt.u64.u32 g, %10;\n add.s64 g, g, %9;\n"
        " mov.b32 %0, 0;\n mov.b32 %1, 0;\n mov.b32 %2, 0;\n mov.b32 %3, 0;\n"
        " mov.b32 %4, 0;\n mov.b32 %5, 0;\n mov.b32 %6, 0;\n mov.b32 %7, 0;\n"
        " @p ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%9];\n"
        " @p ld.global.nc.v4.u32 {%4, %5, %6, %7}, [g];\n}"
        : "=r"(c.r[0]), "=r"(c.r[1]), "=r"(c.r[2]), "=r"(c.r[3]), "=r"(c.r[4]), "=r"(c.r[5]), "=r"(c.r[6]),
          "=r"(c.r[7])
        : "r"(valid), "l"(global), "r"(half_bytes));
  }
  return c;
}

// The four corners of a point in the split layout; `value` points at the head's channel 0.
template <typename scalar_t, int BYTES>
__device__ __forceinline__ PointCorners<BYTES> load_split_point(const WindowPoint<float>& m, const SplitLane& lane,
                                                                const scalar_t* value, int64_t key_stride,
                                                                int64_t row_stride) {
  const scalar_t* corner = value + static_cast<int64_t>(m.key) * key_stride + lane.lo;
  const uint32_t half_bytes = static_cast<uint32_t>(sizeof(scalar_t)) * static_cast<uint32_t>(lane.hi - lane.lo);
  PointCorners<BYTES> c;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const scalar_t* at = corner + ((k & 1) ? key_stride : 0) + ((k & 2) ? row_stride : 0);
    c.corner[k] = load_split_corner<BYTES>(m.valid & (1u << k), at, half_bytes);
  }
  return c;
}

// A team's four dot products, held by one lane of the team (mma_point_dots).
struct MmaDots {
  float dot[4];
};

// Channels 8t..8t+7 of the team's row for lane t, from the split halves its team holds (lane u has
// 4u..4u+3 and C/2 + 4u..): eight shuffles per point, where keeping the chunk live across the
// points spilled at 96 registers.
__device__ __forceinline__ uint4 whole_chunk(uint2 lo, uint2 hi) {
  const int lane = threadIdx.x & 31, t = lane & 3;
  const int first = (lane & ~3) + 2 * (t & 1);
  const uint32_t lo0x = __shfl_sync(0xffffffffu, lo.x, first), lo0y = __shfl_sync(0xffffffffu, lo.y, first);
  const uint32_t lo1x = __shfl_sync(0xffffffffu, lo.x, first + 1), lo1y = __shfl_sync(0xffffffffu, lo.y, first + 1);
  const uint32_t hi0x = __shfl_sync(0xffffffffu, hi.x, first), hi0y = __shfl_sync(0xffffffffu, hi.y, first);
  const uint32_t hi1x = __shfl_sync(0xffffffffu, hi.x, first + 1), hi1y = __shfl_sync(0xffffffffu, hi.y, first + 1);
  return t < 2 ? make_uint4(lo0x, lo0y, lo1x, lo1y) : make_uint4(hi0x, hi0y, hi1x, hi1y);
}

constexpr uint32_t kMetaKeyOffset = offsetof(WindowPoint<float>, key);  // `valid` follows `key`
static_assert(offsetof(WindowPoint<float>, valid) == kMetaKeyOffset + 4, "key and valid are read as one pair");

// The lane's B chunks: for n-tile j, corner (g mod 4) of the point of team 2j + g / 4, whose
// metadata lies `team_meta_stride` bytes after team 0's; `lane_value` is the head's channel 8t.
// A key's offset is one signed 32 x 32 -> 64-bit multiply-add (`key_bytes` fits 32 bits): with
// the stride in 64 bits and in elements it took seven instructions a corner.
template <typename scalar_t>
__device__ __forceinline__ void load_mma_corners(Chunk<16> (&b)[4], uint32_t meta_of_team0, uint32_t team_meta_stride,
                                                 const scalar_t* lane_value, int key_bytes, int64_t row_bytes) {
  const int lane = threadIdx.x & 31;
  const int corner = (lane >> 2) & 3;
  const char* corner_base =
      reinterpret_cast<const char*>(lane_value) + ((corner & 1) ? key_bytes : 0) + ((corner & 2) ? row_bytes : 0);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t source = meta_of_team0 + static_cast<uint32_t>(2 * j + (lane >> 4)) * team_meta_stride;
    uint32_t key, valid;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(key), "=r"(valid) : "r"(source + kMetaKeyOffset));
    b[j] = load_global_corner<16>(valid & (1u << corner),
                                  corner_base + static_cast<int64_t>(static_cast<int>(key)) * static_cast<int64_t>(key_bytes));
  }
}

// A point's four dot products <grad_output row, corner row> on the tensor cores, for a warp of
// eight teams of four lanes (32 channels), each team at its own point. As a product D = G x V^T,
// the rows of G are the eight teams' output-gradient rows (rows 8-15 zero) and the columns of V^T
// the 32 corners, eight per n-tile: n-tile j holds the corners of teams 2j and 2j + 1. Only D's
// entries where a corner meets its own team's row are wanted (1/16 of the product): the tensor
// cores do in 8 instructions per warp what 64 conversions and FMAs per lane, and the team sums
// after them, did.
// Channels are k, and k's order inside a product is free: lane (g, t) gives k = 2t, 2t + 1, 2t + 8,
// 2t + 9 of k-tile 0 the channels 8t..8t+3 and of k-tile 1 the channels 8t+4..8t+7, in both
// operands. So the A fragment is one 16-byte chunk of the lane's own output-gradient row, and its B
// fragment one 16-byte chunk of a corner, the corner (g mod 4) of team 2j + g / 4's point, whose
// (key, valid) it reads from that point's metadata. Whole 16-byte chunks, not the split halves
// the direct path reduces: a warp's load then touches one line per 64-byte corner row, not two.
// Returns, in the lane with t = 2 (g mod 2), its team's four dots (the other lanes hold the
// partner team's or nothing).
template <typename scalar_t>
__device__ __forceinline__ MmaDots mma_point_dots(uint32_t meta_of_team0, uint32_t team_meta_stride,
                                                  const scalar_t* lane_value, int key_bytes, int64_t row_bytes,
                                                  uint4 go) {
  Chunk<16> b[4];
  load_mma_corners(b, meta_of_team0, team_meta_stride, lane_value, key_bytes, row_bytes);
  const int lane = threadIdx.x & 31;
  const uint32_t a0[4] = {go.x, 0u, go.y, 0u}, a1[4] = {go.z, 0u, go.w, 0u};
  float mine0 = 0.0f, mine1 = 0.0f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    mma_16x8x16<scalar_t>(d, a0, b[j].r[0], b[j].r[1]);
    mma_16x8x16<scalar_t>(d, a1, b[j].r[2], b[j].r[3]);
    if (j == (lane >> 3)) mine0 = d[0], mine1 = d[1];  // columns 2t, 2t + 1 of this team's n-tile
  }
  const float other0 = __shfl_xor_sync(0xffffffffu, mine0, 1), other1 = __shfl_xor_sync(0xffffffffu, mine1, 1);
  return MmaDots{{mine0, mine1, other0, other1}};
}

// The largest |element| of the tile's finite output-gradient rows, over the producer warp (a lane
// per slot). Rows with a NaN or an Inf, and empty slots, take no part in the MMA (they are staged
// as zeros), so they take none here either: the test is the consumers' finite_row, element-wise.
__device__ __forceinline__ float tile_largest_finite(const Problem<float>& p, const LaunchShape& s, const Tile& t,
                                                     const float* grad_output) {
  float largest = 0.0f;
  for (int slot = threadIdx.x & 31; slot < s.slots; slot += 32) {
    const int query = tile_query(t, s, slot, p.queries);
    if (query < 0) continue;
    const float4* row = reinterpret_cast<const float4*>(
        grad_output + ((static_cast<int64_t>(t.batch) * p.queries + query) * p.heads + t.head) * p.channels);
    float m = 0.0f;
    bool finite = true;
    for (int c = 0; c < p.channels / 4; ++c) {
      const float4 v = __ldg(row + c);
      finite = finite && isfinite(v.x) && isfinite(v.y) && isfinite(v.z) && isfinite(v.w);
      m = fmaxf(m, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
    }
    if (finite) largest = fmaxf(largest, m);
  }
  return __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(largest)));  // >= 0: bits order as values
}

// Two fp32 elements as fp16 hi parts (x) and lo parts (y), each pair packed as in memory.
__device__ __forceinline__ uint2 split_row_pair(float a, float b, float scale) {
  a *= scale;
  b *= scale;
  const __half ha = __float2half_rn(a), hb = __float2half_rn(b);
  const __half la = __float2half_rn(a - __half2float(ha)), lb = __float2half_rn(b - __half2float(hb));
  return make_uint2(static_cast<uint32_t>(__half_as_ushort(ha)) | (static_cast<uint32_t>(__half_as_ushort(hb)) << 16),
                    static_cast<uint32_t>(__half_as_ushort(la)) | (static_cast<uint32_t>(__half_as_ushort(lb)) << 16));
}

// The lane that holds its team's dots after mma_point_dots: t = 2 (g mod 2).
__device__ __forceinline__ bool holds_mma_dots() {
  const int lane = threadIdx.x & 31;
  return (lane & 3) == 2 * ((lane >> 2) & 1);
}

// Four MMA sums times the inverse of the weight scale (kScaled: fp16 A) and then of the tile's row
// scale (kRowScaled: fp32 rows); each factor alone keeps them normal.
template <bool kScaled, bool kRowScaled>
__device__ __forceinline__ void undo_operand_scales(float (&v)[4], float inverse_scale, float row_unscale) {
  if constexpr (kScaled) {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] *= inverse_scale;
  }
  if constexpr (kRowScaled) {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] *= row_unscale;
  }
}

// How a 16 x 8 accumulator tile reaches the sink. The fast (fp32 atomic) sink takes the sums as
// the MMA left them: lane (g, t) holds channels 2t, 2t + 1 of cells g and g + 8, two 8-byte
// reductions. The other sinks take four consecutive channels of one cell a lane, after lane pairs
// swap halves (even lanes row g, odd lanes row g + 8): two shuffles and six selects a tile, which
// were 4 % of the fp16 encoder's fast backward (perf_notes.md, item 111).
template <typename Sink>
constexpr bool kPairReductions = std::is_same_v<Sink, AtomicSink<float>>;

// The lane's element for channel 0 of a window row's m-tile whose first cell is `key`: cell g
// (pairs) or g + 8 for odd lanes (swapped halves), and its first channel.
template <typename Sink>
__device__ __forceinline__ int64_t mma_tile_lane_index(int64_t key, int64_t key_stride, int64_t head_column) {
  const int lane = threadIdx.x & 31;
  if constexpr (kPairReductions<Sink>) return (key + (lane >> 2)) * key_stride + head_column + 2 * (lane & 3);
  return (key + (lane >> 2) + ((lane & 1) ? 8 : 0)) * key_stride + head_column + 4 * ((lane & 3) >> 1);
}

// Reduces one 16 x 8 accumulator tile (window cells x channels) into the sink, in the lane layout
// kPairReductions picks. `index` is the lane's element for channel 0 of the tile (mma_tile_lane_index), `cells8` the
// elements from a cell to the cell 8 after it; cells that no point touched sum to exactly zero and
// are skipped.
template <bool kScaled, typename Sink, bool kRowScaled = false>
__device__ __forceinline__ void reduce_mma_tile(const Sink& sink, const float (&d)[4], int64_t index, int64_t cells8,
                                                float inverse_scale, float row_unscale = 1.0f) {
  if constexpr (kPairReductions<Sink>) {
    float v[4] = {d[0], d[1], d[2], d[3]};
    undo_operand_scales<kScaled, kRowScaled>(v, inverse_scale, row_unscale);
    // +-0 in both (the bits past the sign), as every channel of an untouched cell is
    if (((__float_as_uint(d[0]) | __float_as_uint(d[1])) << 1) != 0u) sink.add(index, {v[0], v[1]});
    if (((__float_as_uint(d[2]) | __float_as_uint(d[3])) << 1) != 0u) sink.add(index + cells8, {v[2], v[3]});
  } else {
    const bool odd = threadIdx.x & 1;
    const float give0 = odd ? d[0] : d[2], give1 = odd ? d[1] : d[3];
    const float got0 = __shfl_xor_sync(0xffffffffu, give0, 1), got1 = __shfl_xor_sync(0xffffffffu, give1, 1);
    float v[4] = {odd ? got0 : d[0], odd ? got1 : d[1], odd ? d[2] : got0, odd ? d[3] : got1};
    const uint32_t bits = __float_as_uint(v[0]) | __float_as_uint(v[1]) | __float_as_uint(v[2]) | __float_as_uint(v[3]);
    if ((bits << 1) == 0u) return;
    undo_operand_scales<kScaled, kRowScaled>(v, inverse_scale, row_unscale);
    sink.add(index, v);
  }
}

// One warp's share of a stage's MMA: window rows of 16 cells (m-tiles) in turn, all slots (k),
// every channel (n, 16 at a time); then it zeroes the block of A it read. kTmaFlush (fixed point,
// 32 channels, kGroups 2: a row's sums in one pass): the row leaves through flush_fixed_point_row.
// fp32 (hi + lo rows): A^T G = A_hi^T G_hi + A_lo^T G_hi + A_hi^T G_lo, the sums times `row_unscale`;
// the dropped A_lo^T G_lo is below 2^-22 of the products.
// kRows32 (32 channels: kGroups 2 takes a row in one pass; every fp32 MMA kernel): the warp loads
// k-step 0's output-gradient fragments (slots 0-15; 8 registers, 16 for fp32's hi and lo parts)
// once per stage and keeps them across its m-tiles. ldmatrix was a third of the fp16 encoder
// backward's shared-memory wavefronts, and the LSU data pipe its busiest unit at 71 % (ncu); k-step
// 1's fragments too spilled at 4 CTAs per SM (perf_notes.md, items 114 and 116).
template <typename scalar_t, int kGroups, bool kTmaFlush, typename Sink, bool kRows32 = false, bool kHalfFlush = false>
__device__ __forceinline__ void reduce_window_mma(uint32_t smem_base, const LaunchShape& s, const StageWindow& w,
                                                  const Sink& sink, int64_t key_stride, int64_t head_column,
                                                  int channels, float inverse_scale, const CUtensorMap* flush_map,
                                                  float row_unscale = 1.0f) {
  using mma_t = MmaElement<scalar_t>;
  constexpr bool kHiLoRows = sizeof(scalar_t) == 4;
  static_assert(!kTmaFlush || kGroups == 2, "the TMA flush takes a row's 32 channels in one pass");
  const int warp = threadIdx.x / 32 - 1, lane = threadIdx.x & 31;
  const int k_steps = s.slots / 16;
  const uint32_t a_hi = smem_base + static_cast<uint32_t>(s.a_offset), a_lo = a_hi + static_cast<uint32_t>(s.a_bytes);
  const uint32_t rows = smem_base + static_cast<uint32_t>(s.g_offset);
  const uint32_t rows_lo = smem_base + static_cast<uint32_t>(s.g_lo_offset);  // kHiLoRows only
  // The rows this lane addresses for ldmatrix: A^T's (slot, cell), the output gradient's (slot, channel).
  const int a_slot = (lane & 7) + ((lane >> 4) << 3), a_cell = ((lane >> 3) & 1) * 8;
  const int b_slot = (lane & 7) + (((lane >> 3) & 1) << 3), b_channel = (lane >> 4) * 8;
  constexpr bool kCachedRows = kRows32;
  constexpr bool kCachedLoRows = kRows32 && kHiLoRows;  // fp32: the lo parts too (3 CTAs per SM, no spills)
  static_assert(!kCachedRows || kGroups == 2, "32 channels in one pass of two groups");
  uint32_t cached[kGroups][4];  // k-step 0 always exists: s.mma needs slots % 16 == 0
  uint32_t cached_lo[kCachedLoRows ? kGroups : 1][4];
  if constexpr (kCachedRows) {
#pragma unroll
    for (int q = 0; q < kGroups; ++q) {
      const uint32_t at = static_cast<uint32_t>(b_slot * s.g_stride + (16 * q + b_channel) * 2);
      ldmatrix_x4_trans(cached[q], rows + at);
      if constexpr (kCachedLoRows) ldmatrix_x4_trans(cached_lo[q], rows_lo + at);
    }
  }
  // kTmaFlush: the sink's scale with the operand scales the sums carry folded in, once a stage.
  const auto flush_factors = [&] {
    if constexpr (kTmaFlush) {
      int k = 0;
      if constexpr (std::is_same_v<mma_t, __half>) k += ilogb(inverse_scale);
      if constexpr (kHiLoRows) k += ilogb(row_unscale);
      return sink.factors_with_pow2(k);
    } else {
      return 0;
    }
  }();
  const int m_tiles = w.rows * s.window_cols / 16;
  for (int tile = warp; tile < m_tiles; tile += s.consumer_warps) {
    const int m0 = tile * 16;
    const int64_t row_key = static_cast<int64_t>(w.key0) + static_cast<int64_t>(tile) * w.width;  // an m-tile is a window row
    const int64_t index = mma_tile_lane_index<Sink>(row_key, key_stride, head_column);
    // kGroups x 16 channels at a time: each A block (hi, lo) is loaded once for kGroups 16-channel
    // groups of G (ncu, H100, 2026-11-24: ldmatrix was 15 % of the L1's wavefronts with one group
    // per load). Two groups need 8 more accumulator registers: at 4 CTAs per SM (96 registers) only
    // the kernels with MMA dots, whose point phase needs fewer, fit them.
    for (int c0 = 0; c0 < (kCachedRows ? 32 : channels); c0 += 16 * kGroups) {
      const int groups = kGroups == 1 ? 1 : min(kGroups, (channels - c0) / 16);  // channels % 16 == 0 (mma_built)
      float d[2 * kGroups][4] = {};
#pragma unroll
      for (int k = 0; k < kMmaMaxKSteps; ++k) {
        if (k >= k_steps) break;
        uint32_t hi[4], lo[4];
        const uint32_t a_at = static_cast<uint32_t>((16 * k + a_slot) * s.a_stride + (m0 + a_cell) * 2);
        ldmatrix_x4_trans(hi, a_hi + a_at);
        ldmatrix_x4_trans(lo, a_lo + a_at);
#pragma unroll
        for (int q = 0; q < kGroups; ++q) {
          if (q >= groups) break;
          uint32_t g[4];
          const uint32_t g_at = static_cast<uint32_t>((16 * k + b_slot) * s.g_stride + (c0 + 16 * q + b_channel) * 2);
          if (kCachedRows && k == 0) {
#pragma unroll
            for (int i = 0; i < 4; ++i) g[i] = cached[q][i];
          } else {
            ldmatrix_x4_trans(g, rows + g_at);
          }
          mma_16x8x16<mma_t>(d[2 * q], hi, g[0], g[1]);
          mma_16x8x16<mma_t>(d[2 * q], lo, g[0], g[1]);
          mma_16x8x16<mma_t>(d[2 * q + 1], hi, g[2], g[3]);
          mma_16x8x16<mma_t>(d[2 * q + 1], lo, g[2], g[3]);
          if constexpr (kHiLoRows) {
            if (kCachedLoRows && k == 0) {
#pragma unroll
              for (int i = 0; i < 4; ++i) g[i] = cached_lo[kCachedLoRows ? q : 0][i];
            } else {
              ldmatrix_x4_trans(g, rows_lo + g_at);
            }
            mma_16x8x16<mma_t>(d[2 * q], hi, g[0], g[1]);
            mma_16x8x16<mma_t>(d[2 * q + 1], hi, g[2], g[3]);
          }
        }
      }
      constexpr bool kScaled = std::is_same_v<mma_t, __half>;
      if constexpr (kTmaFlush) {
        const int row_key = w.key0 + tile * w.width;  // a window row is 16 consecutive keys
        flush_fixed_point_row<Sink, kHalfFlush>(
            sink, d, smem_base + static_cast<uint32_t>(s.flush_offset + warp * s.flush_bytes), flush_map,
            static_cast<int>(head_column), row_key, row_key * key_stride + head_column, key_stride,
            flush_factors);  // one pass: c0 + 32 >= channels
      } else {
#pragma unroll
        for (int q = 0; q < kGroups; ++q) {
          if (q >= groups) break;
          reduce_mma_tile<kScaled, Sink, kHiLoRows>(sink, d[2 * q], index + c0 + 16 * q, 8 * key_stride, inverse_scale,
                                                     row_unscale);
          reduce_mma_tile<kScaled, Sink, kHiLoRows>(sink, d[2 * q + 1], index + c0 + 16 * q + 8, 8 * key_stride,
                                                     inverse_scale, row_unscale);
        }
      }
    }
    __syncwarp();  // every lane's ldmatrix reads of the block are done
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    for (int slot = lane; slot < s.slots; slot += 32) {
      const uint32_t row = a_hi + static_cast<uint32_t>(slot * s.a_stride + m0 * 2);
      st_shared_v4(row, zero);
      st_shared_v4(row + 16, zero);
      st_shared_v4(row + s.a_bytes, zero);
      st_shared_v4(row + s.a_bytes + 16, zero);
    }
  }
}

#endif  // MMDEFORM_TMA_HOPPER_DEVICE

// The plain kernels built at 4 CTAs per SM (`_o4` configs): those ptxas fits in 96 registers
// without spills. The fp16 16-byte-lane and fixed-point ones spill there and keep 3. (The MMA
// kernels' rule is at their launch, in backward().)
template <typename scalar_t, int kChunkBytes, typename Sink>
constexpr bool four_ctas_built() {
  return std::is_same_v<Sink, AtomicSink<float>> && (sizeof(scalar_t) == 4 || kChunkBytes == 8);
}

// kRows32: an MMA kernel for rows of 32 channels. In fp16/bf16 (teams of four lanes) it takes the
// point's dot products on the tensor cores too (mma_point_dots); in fixed point it flushes window
// rows through the TMA (flush_fixed_point_row).
template <typename scalar_t, int kChunkBytes, typename Sink, Aggregation kAggregation,
          int kCtasPerSm = min_blocks_per_multiprocessor<scalar_t>(), bool kRows32 = false>
__global__ void __launch_bounds__(kMaxThreads, kCtasPerSm)
    backward_kernel(
    const __grid_constant__ CUtensorMap value_map, const __grid_constant__ Problem<scalar_t> p,
    const __grid_constant__ LaunchShape s, const __grid_constant__ CUtensorMap flush_map,
    const scalar_t* __restrict__ grad_output, Sink sink, coord_type<scalar_t>* __restrict__ grad_locations,
    coord_type<scalar_t>* __restrict__ grad_weights) {
#if MMDEFORM_TMA_HOPPER_DEVICE
  using coord_t = coord_type<scalar_t>;
  using acc_t = acc_type<scalar_t>;
  constexpr int VEC = kChunkBytes / static_cast<int>(sizeof(scalar_t));
  constexpr bool kGather = kAggregation == Aggregation::kGather;
  constexpr bool kMma = kAggregation == Aggregation::kMma;
  constexpr bool kHiLoRows = kMma && sizeof(scalar_t) == 4;  // fp32 rows as fp16 hi + lo (tile_largest_finite)
  static_assert(!kMma || kChunkBytes == mma_chunk_bytes(sizeof(scalar_t)), "the MMA kernel's lanes hold 8 channels");
  static_assert(!kRows32 || kMma, "32-channel rows are an MMA kernel's");
  constexpr bool kMmaDots = kRows32 && sizeof(scalar_t) == 2;
  // The deterministic 32-channel MMA kernels flush window rows through the TMA (flush_fixed_point_row).
  constexpr bool kTmaFlush = kRows32 && !std::is_same_v<Sink, AtomicSink<float>>;
  // At 4 CTAs per SM a warp's flush buffer holds half a window row (LaunchShape::flush_bytes).
  constexpr bool kHalfFlush = kTmaFlush && kCtasPerSm == 4;
  // The fast MMA kernels of 32-channel rows leave a CTA's tiles to the spread fallback where its
  // sampling spreads (LaunchShape::spread_role): their teams of four reduce a direct corner as two
  // half lines, 40 % more L1 wavefronts than whole lines, and uniformly sampled encoders ran 10-14 %
  // slower than `cuda` (perf_notes.md, items 54, 57 and 79). fp32's MMA kernels take 32-channel rows
  // only (mma_built); their kRows32 marks the fixed-point one.
  constexpr bool kSpreadBail =
      kMma && std::is_same_v<Sink, AtomicSink<float>> && (kMmaDots || sizeof(scalar_t) == 4);
  extern __shared__ __align__(128) char dynamic_smem[];

  // The fp16/bf16 spread fallback (a 4-CTA plain kernel): only the CTAs the MMA kernel left.
  if constexpr (kAggregation == Aggregation::kDirect && kCtasPerSm == 4) {
    if (s.spread_role == SpreadRole::kRunFlaggedCtas && s.spread_flags[blockIdx.x] == 0) return;
  }
  if constexpr (kSpreadBail && sizeof(scalar_t) == 4) {  // the fp32 fallback's run counter, read after this kernel
    if (s.spread_role == SpreadRole::kBailWhereSpread && blockIdx.x == 0 && threadIdx.x == 0) {
      *spread_run_counter(s, static_cast<int>(gridDim.x)) = 0;
    }
  }
  if (!level_geometry_ok(p.spatial_shapes, p.level_start, p.levels, p.num_keys)) {
    if constexpr (kSpreadBail) {  // the fallback's CTAs read every flag
      if (s.spread_role == SpreadRole::kBailWhereSpread && threadIdx.x == 0) s.spread_flags[blockIdx.x] = 0;
    }
    poison_coordinate_gradients(p, grad_locations, grad_weights);  // value gradients stay zero
    return;
  }
  const Ring<coord_t> ring{dynamic_smem, &s};
  const int groups = tile_groups(p, s);
  const int num_tiles = tile_count(p, groups);
  if constexpr (kTmaFlush) {  // the flush boxes need 128-byte alignment (the host gives 1024) and their room
    constexpr int kFlushBytes = (kHalfFlush ? kMmaWindowSide / 2 : kMmaWindowSide) * 32 * 8;
    if ((smem_address(dynamic_smem) & 1023u) != 0u || s.flush_bytes != kFlushBytes) __trap();
  }
  if constexpr (kMma) {  // A starts zero; init_ring's barrier orders this before any use
    for (int i = threadIdx.x * 16; i < 2 * s.a_bytes; i += blockDim.x * 16) {
      *reinterpret_cast<uint4*>(dynamic_smem + s.a_offset + i) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
  init_ring(ring, &value_map);
  if (threadIdx.x < 32) {
    // Where the CTA may leave its tiles to the spread fallback (kSpreadBail), the producer stops after
    // the CTA's first stage if that stage spreads (StageWindow::spread); the consumers read the same
    // verdict in its header and leave.
    const auto first_stage_spreads = [](const StageCursor& at, const StageWindow& w) {
      return at.round == 0 && at.stage == 0 && w.spread != 0;
    };
    if constexpr (kGather) {
      int* count = gather_counters(ring);
      for (int c = threadIdx.x; c < s.window_rows * s.window_cols; c += 32) count[c] = 0;
      run_producer(p, ring, &value_map, groups, num_tiles, [&](const Tile&, const StageWindow& w, int stage) {
        build_gather_index(p, ring, w, stage);
      });
    } else if constexpr (kHiLoRows) {
      // Each stage of a tile carries the tile's largest row element (taken at its first level).
      int level = 0;
      float largest = 0.0f;
      const auto scale_rows = [&](const Tile& t, const StageWindow&, int stage) {
        if (level == 0) largest = tile_largest_finite(p, s, t, grad_output);
        if ((threadIdx.x & 31) == 0) *mma_tile_largest(ring, stage) = largest;
        level = level + 1 == p.levels ? 0 : level + 1;
      };
      if constexpr (kSpreadBail) {
        run_producer(p, ring, &value_map, groups, num_tiles, scale_rows, first_stage_spreads);
      } else {
        run_producer(p, ring, &value_map, groups, num_tiles, scale_rows);
      }
    } else if constexpr (kSpreadBail) {
      run_producer(p, ring, &value_map, groups, num_tiles, NoStageWork{}, first_stage_spreads);
    } else {
      run_producer(p, ring, &value_map, groups, num_tiles);
    }
    return;
  }

  if constexpr (kSpreadBail) {
    if (s.spread_role == SpreadRole::kBailWhereSpread) {
      // The CTA's first tile is one of the launch's first, at the finest level, where local sampling
      // keeps a tile's points within a window or two. A CTA with no tile leaves none. Where it
      // spreads, the producer made that stage alone, and this wait also sees its window loaded.
      bool spread = false;
      if (static_cast<int>(blockIdx.x) < num_tiles) {
        mbarrier_wait(ring.full(0), 0u);
        spread = ring.header(0)->spread != 0;
      }
      if (threadIdx.x == 32) s.spread_flags[blockIdx.x] = spread ? 1 : 0;
      if (spread) return;
    }
  }
  sink.prepare();
  const ConsumerLane cl = consumer_lane(s);
  const int64_t key_stride = static_cast<int64_t>(p.heads) * p.channels;
  const uint32_t smem_base = smem_address(dynamic_smem);
  const int points = p.levels * p.points;

  StageCursor at{static_cast<int>(blockIdx.x), 0, 0, 0u};
  Tile t{};
  int parity = 1;  // the gather's output-gradient buffer of the current tile
  while (at.tile < num_tiles) {
    if (at.level == 0) {
      t = tile_at(p, s, groups, at.tile);
      parity ^= 1;
    }
    mbarrier_wait(ring.full(at.stage), at.round & 1u);
    const StageWindow w = *ring.header(at.stage);
    RowScale row_scale{1.0f, 1.0f};
    if constexpr (kHiLoRows) row_scale = row_scale_for(*mma_tile_largest(ring, at.stage));  // read before the release
    const WindowPoint<coord_t>* meta = ring.meta(at.stage);
    const uint32_t window = smem_address(ring.window(at.stage));
    const int64_t head_offset = static_cast<int64_t>(t.head) * p.channels + cl.lane * VEC;
    const scalar_t* lane_value = p.value + head_offset;
    const SplitLane split{cl.lane * (VEC / 2), p.channels / 2 + cl.lane * (VEC / 2)};  // MMA only
    const int64_t head_column = static_cast<int64_t>(t.head) * p.channels;
    const int64_t row_stride = static_cast<int64_t>(w.width) * key_stride;
    for (int j = 0; j < s.slots_per_team; ++j) {
      const int slot = cl.team + j * cl.teams;
      const int query = tile_query(t, s, slot, p.queries);
      const int64_t row = (static_cast<int64_t>(t.batch) * p.queries + max(query, 0)) * p.heads + t.head;
      const int64_t first_point = row * points + at.level * p.points;  // of this slot's level, in grad_weights
      acc_t go[VEC];  // reloaded per level (an L1/L2 hit): registers stay free of the other queries
      bool finite_row = false;  // MMA: the slot's row is finite, so its window points may join A
      uint2 raw_lo{}, raw_hi{};  // MMA: the row's two split halves as loaded
      uint4 go_chunk{};  // MMA dots: the lane's 16-byte chunk of the row (whole_chunk), once per slot and level
      if constexpr (kMma) {
        constexpr int kHalf = VEC / 2;
        const scalar_t* go_row = grad_output + row * p.channels;
        const Vec<scalar_t, kHalf> lo = load_vec<scalar_t, kHalf>(go_row + split.lo);
        const Vec<scalar_t, kHalf> hi = load_vec<scalar_t, kHalf>(go_row + split.hi);
        raw_lo = *reinterpret_cast<const uint2*>(&lo);
        raw_hi = *reinterpret_cast<const uint2*>(&hi);
        if constexpr (kMmaDots) go_chunk = whole_chunk(raw_lo, raw_hi);
        acc_t half[kHalf];
        to_acc(lo, half);
#pragma unroll
        for (int k = 0; k < kHalf; ++k) go[k] = half[k];
        to_acc(hi, half);
#pragma unroll
        for (int k = 0; k < kHalf; ++k) go[kHalf + k] = half[k];
        bool finite = query >= 0;
#pragma unroll
        for (int k = 0; k < VEC; ++k) finite = finite && isfinite(go[k]);
        finite_row = warp_team_all(finite, s.team);
        if (at.level == 0) {  // the B operand: the row as it is, or zeros (never a NaN in the product)
          const uint32_t staged = smem_base + static_cast<uint32_t>(s.g_offset + slot * s.g_stride);
          if constexpr (kHiLoRows) {  // hi parts at g_offset, lo parts at g_lo_offset
            const uint32_t lo_rows = static_cast<uint32_t>(s.g_lo_offset - s.g_offset);
#pragma unroll
            for (int i = 0; i < VEC; i += 2) {
              const int channel = (i < kHalf ? split.lo : split.hi - kHalf) + i;
              const uint2 pair = finite_row ? split_row_pair(go[i], go[i + 1], row_scale.scale) : make_uint2(0u, 0u);
              st_shared_u32(staged + 2u * static_cast<uint32_t>(channel), pair.x);
              st_shared_u32(staged + lo_rows + 2u * static_cast<uint32_t>(channel), pair.y);
            }
          } else {
            st_shared_v2(staged + 2u * static_cast<uint32_t>(split.lo), finite_row ? raw_lo : make_uint2(0u, 0u));
            st_shared_v2(staged + 2u * static_cast<uint32_t>(split.hi), finite_row ? raw_hi : make_uint2(0u, 0u));
          }
        }
      } else {
        to_acc(load_vec<scalar_t, VEC>(grad_output + row * p.channels + cl.lane * VEC), go);
      }
      if constexpr (kGather) {
        static_assert(VEC == 4 && std::is_same_v<acc_t, float>, "the gather stages rows as float4 lanes");
        if (at.level == 0) {
          float* staged = gather_grad_rows(ring, parity) + slot * p.channels + cl.lane * VEC;
          *reinterpret_cast<float4*>(staged) =
              query >= 0 ? make_float4(go[0], go[1], go[2], go[3]) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
      }
      const WindowPoint<coord_t>* slot_meta = meta + slot * p.points;
      // A point's corner chunks (none for the MMA-dots kernels, which load their own).
      const auto load_corners = [&](int point) {
        const WindowPoint<coord_t> m = slot_meta[point];
        PointCorners<kChunkBytes> corners{};
        if constexpr (kMma) {
          if constexpr (!kMmaDots) {
            corners = load_split_point<scalar_t, kChunkBytes>(m, split, p.value + head_column, key_stride, row_stride);
          }
        } else {
          corners = load_point<scalar_t, VEC>(m, s.load_window && w.rows > 0, window, s, cl, lane_value, key_stride,
                                              row_stride);
        }
        return corners;
      };
      const auto process_point = [&](int point, const PointCorners<kChunkBytes>& corners) {
        // A point that misses the level runs through too (its corners read zeros, its gradients
        // are zero): the warp stays converged for the shuffles below.
        const WindowPoint<coord_t> m = slot_meta[point];
        // Window points whose contributions are summed per cell below (gather, MMA).
        bool gathered = false;
        if constexpr (kGather) gathered = w.rows > 0 && m.cell >= 0;
        // MMA: lane c of the team adds corner c of a gathered point to A, if c lies in the level
        // (the window holds those only: kMmaCellBias).
        const auto add_weights = [&] {
          if (gathered && cl.lane < 4 && (m.valid & (1u << cl.lane))) {
            const int c = cl.lane;
            // selected, not indexed: a run-time index would put the metadata on the stack
            const coord_t weight = c == 0 ? m.weight[0] : c == 1 ? m.weight[1] : c == 2 ? m.weight[2] : m.weight[3];
            add_mma_weight<scalar_t>(smem_base, s, slot, m.cell - kMmaCellBias + (c & 1) + ((c & 2) ? s.window_cols : 0),
                                     static_cast<float>(weight) * s.weight_scale);
          }
          __syncwarp();  // the next point's lanes see these weights
        };
        if constexpr (kMma) {
          gathered = w.rows > 0 && m.cell >= 0 && finite_row && fabsf(m.attention) <= 1.0f;
          if constexpr (!kMmaDots) add_weights();  // before the corners are converted: fewer live registers
        }
        // The direct path's contribution of corner c: one reduction per corner.
        const auto add_direct = [&](int c) {
          if (!(m.valid & (1u << c))) return;
          if constexpr (kGather || kMma) {
            if (gathered) return;
          }
          const acc_t weight = static_cast<acc_t>(m.weight[c]);
          const int64_t key = static_cast<int64_t>(m.key) + (c & 1) + ((c & 2) ? w.width : 0);
          if constexpr (kMma) {
            constexpr int kHalf = VEC / 2;
            acc_t lo[kHalf], hi[kHalf];
            if constexpr (kMmaDots) {  // from the row's halves as loaded: go[] is not kept live for this rarer path
              chunk_to_acc<scalar_t, kHalf>(Chunk<8>{{raw_lo.x, raw_lo.y}}, lo);
              chunk_to_acc<scalar_t, kHalf>(Chunk<8>{{raw_hi.x, raw_hi.y}}, hi);
            } else {
#pragma unroll
              for (int k = 0; k < kHalf; ++k) lo[k] = go[k], hi[k] = go[kHalf + k];
            }
#pragma unroll
            for (int k = 0; k < kHalf; ++k) {
              lo[k] *= weight;
              hi[k] *= weight;
            }
            sink.add(key * key_stride + head_column + split.lo, lo);
            sink.add(key * key_stride + head_column + split.hi, hi);
          } else {
            acc_t contribution[VEC];
#pragma unroll
            for (int k = 0; k < VEC; ++k) contribution[k] = weight * go[k];
            sink.add(key * key_stride + head_offset, contribution);
          }
        };
        acc_t dot[4];
        bool whole_dots = false;  // dot[] holds whole dot products, not this lane's share of them
        if constexpr (kMmaDots) {
          const uint32_t meta_of_team0 = smem_address(meta) + static_cast<uint32_t>(sizeof(WindowPoint<coord_t>)) *
                                         static_cast<uint32_t>((slot - (cl.team & 7)) * p.points + point);
          const MmaDots d = mma_point_dots<scalar_t>(
              meta_of_team0, static_cast<uint32_t>(sizeof(WindowPoint<coord_t>) * p.points),
              p.value + head_column + 8 * cl.lane, static_cast<int>(key_stride * sizeof(scalar_t)),
              row_stride * static_cast<int64_t>(sizeof(scalar_t)), go_chunk);
          add_weights();  // after the products: the chunks are dead by then
#pragma unroll
          for (int c = 0; c < 4; ++c) dot[c] = d.dot[c];
          whole_dots = true;
        }
        if (!whole_dots) {
          use_corners<scalar_t, VEC>(corners, [&](int c, const acc_t (&v)[VEC]) {
            dot[c] = acc_t(0);
#pragma unroll
            for (int k = 0; k < VEC; ++k) dot[c] = fma(go[k], v[k], dot[c]);
            if constexpr (!kMma) add_direct(c);
          });
        }
        if constexpr (kMma) {
          // One vote a warp for the direct path, which few of the MMA kernels' points take (corners
          // outside the window, a non-finite row): four tests and branches a point otherwise, about 4 %
          // of the fp16 encoder's instructions (perf_notes.md, item 111). The warp is converged here.
          if (__any_sync(0xffffffffu, !gathered && m.valid != 0u)) {
#pragma unroll
            for (int c = 0; c < 4; ++c) add_direct(c);
          }
        }
        const acc_t ly = m.ly, lx = m.lx, hy = acc_t(1) - ly, hx = acc_t(1) - lx;
        acc_t grad_a = hy * hx * dot[kTopLeft] + hy * lx * dot[kTopRight] + ly * hx * dot[kBottomLeft] +
                       ly * lx * dot[kBottomRight];
        acc_t grad_x = hy * (dot[kTopRight] - dot[kTopLeft]) + ly * (dot[kBottomRight] - dot[kBottomLeft]);
        acc_t grad_y = hx * (dot[kBottomLeft] - dot[kTopLeft]) + lx * (dot[kBottomRight] - dot[kTopRight]);
        if (!whole_dots) {
          grad_a = warp_team_sum(grad_a, s.team);
          grad_x = warp_team_sum(grad_x, s.team);
          grad_y = warp_team_sum(grad_y, s.team);
        }
        const bool store_lane = whole_dots ? holds_mma_dots() : cl.lane == 0;
        if (query >= 0 && store_lane) {  // a point that misses the level has zero gradients, even for a NaN row
          const bool sampled = m.valid != 0u;
          grad_weights[first_point + point] = sampled ? grad_a : coord_t(0);
          // (x, y) in one store: ncu (H100, 2026-11-24) had these scalar stores at 10 % of the L1's tag lookups
          store_pair(grad_locations + 2 * (first_point + point), sampled ? m.attention * coord_t(w.width) * grad_x : coord_t(0),
                     sampled ? m.attention * coord_t(w.height) * grad_y : coord_t(0));
        }
      };
      // The plain kernels with 8-byte lanes (fp16/bf16) issue the next point's gathers before this
      // point's dots and reductions: on a decoder (one wave) each point's round trip was on the path
      // (the forward: perf_notes.md, item 67). Two operand sets in turn, no register copies; the
      // 16-byte lanes' second set spilled.
      if constexpr (kAggregation == Aggregation::kDirect && kChunkBytes == 8) {
        PointCorners<kChunkBytes> a = load_corners(0);
        int point = 0;
#pragma unroll 1
        for (; point + 1 < p.points; point += 2) {
          const PointCorners<kChunkBytes> b = load_corners(point + 1);
          process_point(point, a);
          if (point + 2 < p.points) a = load_corners(point + 2);
          process_point(point + 1, b);
        }
        if (point < p.points) process_point(point, a);
      } else {
#pragma unroll 1
        for (int point = 0; point < p.points; ++point) process_point(point, load_corners(point));
      }
    }
    if constexpr (kMma) {
      if (w.rows > 0) {
        consumer_barrier(s.consumer_warps * 32);  // A and the staged rows are complete
        mbarrier_arrive(ring.empty(at.stage));
        // fp32's MMA kernels take 32-channel rows only (mma_built), whatever their kRows32
        reduce_window_mma<scalar_t, (kCtasPerSm < 4 || kMmaDots) ? 2 : 1, kTmaFlush, Sink, kRows32 || kHiLoRows,
                          kHalfFlush>(
            smem_base, s, w, sink, key_stride, static_cast<int64_t>(t.head) * p.channels, p.channels, s.inverse_weight_scale,
            &flush_map, row_scale.unscale);
        consumer_barrier(s.consumer_warps * 32);  // every warp has read and zeroed its blocks of A
      } else {
        mbarrier_arrive(ring.empty(at.stage));
      }
      at.advance(p.levels, s.stages);
      continue;
    }
    if constexpr (kGather) {
      // Every team's rows are staged before any team walks; a tile's rows are read through its
      // last level and rewritten two tiles later, after this barrier of the tile in between.
      if (at.level == 0) consumer_barrier(s.consumer_warps * 32);
      // Teams take the touched cells in turn; a lane sums its chunk of the cell's contributions
      // in the index's order and reduces the sum once.
      const int touched_cells = *gather_touched_count(ring, at.stage);
      const uint32_t* touched = gather_touched(ring, at.stage);
      const GatherEntry<coord_t>* entries = gather_entries(ring, at.stage);
      const float* lane_grad = gather_grad_rows(ring, parity) + cl.lane * VEC;
#pragma unroll 1
      for (int k = cl.team; k < touched_cells; k += cl.teams) {
        const uint32_t here = touched[k], end = touched[k + 1] >> 16;
        acc_t sum[VEC];
#pragma unroll
        for (int v = 0; v < VEC; ++v) sum[v] = acc_t(0);
#pragma unroll 1
        for (uint32_t e = here >> 16; e < end; ++e) {
          const GatherEntry<coord_t> entry = entries[e];
          const float4 g = *reinterpret_cast<const float4*>(lane_grad + entry.slot * p.channels);
          const acc_t weight = static_cast<acc_t>(entry.weight);
          sum[0] = fma(weight, g.x, sum[0]);
          sum[1] = fma(weight, g.y, sum[1]);
          sum[2] = fma(weight, g.z, sum[2]);
          sum[3] = fma(weight, g.w, sum[3]);
        }
        const int cell = static_cast<int>(here & 0xFFFFu);
        const int64_t key = static_cast<int64_t>(w.key0) + (cell >> s.window_cols_log2) * w.width +
                            (cell & (s.window_cols - 1));
        sink.add(key * key_stride + head_offset, sum);
      }
    }
    mbarrier_arrive(ring.empty(at.stage));
    at.advance(p.levels, s.stages);
  }
  if constexpr (kTmaFlush) {
    if ((threadIdx.x & 31) == 0) bulk_wait_group_all();  // the flush buffers are read before the CTA leaves
  }
#else
  __trap();
#endif
}

}  // namespace

// Calls f(std::bool_constant<rows32>): the run-time choice of the kRows32 kernels as a constant.
template <typename F>
void with_rows32(bool rows32, F&& f) {
  if (rows32) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

Gradients backward(const ProblemTensors& problem, const at::Tensor& grad_output, int64_t config, bool deterministic) {
  hopper::require_hopper("tma_ws");
  hopper::require_tma_channels(problem.value, "tma_ws");
  const int element = static_cast<int>(problem.value.element_size());
  const int chunk_bytes = hopper::backward_chunk_bytes(static_cast<int>(problem.channels), element);
  const int meta_size = static_cast<int>(element == 8 ? sizeof(WindowPoint<double>) : sizeof(WindowPoint<float>));
  const int entry_size = gather_built(element, chunk_bytes) ? static_cast<int>(sizeof(GatherEntry<float>)) : 0;
  LaunchShape s{};
  if ((config < 0 || is_mma_config(config)) && mma_built(element, problem.channels)) {
    s = launch_shape(problem, config, mma_chunk_bytes(element), meta_size, kMaxBackwardSlotsPerTeam, true, 0, true,
                     deterministic ? 8 : 0);
  }
  if (!s.mma) {  // any other config or problem; an MMA config whose tile the MMA cannot take runs without a window
    s = launch_shape(problem, config, chunk_bytes, meta_size, kMaxBackwardSlotsPerTeam, true, entry_size);
  }
  // The fast 32-channel MMA kernels hand the CTAs whose sampling spreads to a fallback over the same
  // tiles (LaunchShape::spread_role): in fp16/bf16 a plain kernel, where the team layout gives it the
  // same tiles; in fp32 the portable kernel's teams.
  LaunchShape plain_fallback{};
  bool spread_fallback = s.mma && !deterministic && problem.channels == 32 && element <= 4;
  if (spread_fallback && element == 2) {
    plain_fallback = spread_fallback_shape(problem, s, chunk_bytes, meta_size);
    spread_fallback = plain_fallback.slots == s.slots && plain_fallback.block_cols == s.block_cols;
  }
  return run_backward(
      problem, grad_output, deterministic, grad_value_layout(problem, grad_output, deterministic), "mmdeform_tma tma_ws backward",
      [&](auto sink, const auto* go, auto* grad_locations, auto* grad_weights) {
        using scalar_t = ScalarOf<decltype(go)>;
        // Named here: inside the nested `if constexpr`, gcc (the host pass) reads decltype(sink) as a
        // reference, which instantiates a host stub the device pass never registered (the launch
        // then fails with "invalid resource handle").
        using Sink = std::decay_t<decltype(sink)>;
        // The deterministic 32-channel MMA kernels' flush target (launch_shape gave their staging
        // room); unused elsewhere.
        CUtensorMap flush_map{};
        if (s.flush_bytes > 0) {
          flush_map = fixed_point_tensor_map(sink.grad, problem.batch * problem.num_keys, problem.heads * problem.channels,
                                             kFixedPointBoxKeys);
        }
        if constexpr (sizeof(scalar_t) <= 4) {
          // An MMA kernel, followed by the spread fallback on the same grid where it applies.
          const auto launch_mma = [&](auto kernel) {
            if (!spread_fallback) {
              launch_persistent<scalar_t>(kernel, problem, s, flush_map, go, sink, grad_locations, grad_weights);
              return;
            }
            const int64_t blocks = persistent_blocks(kernel, problem, s);
            const at::Tensor flags = at::empty({blocks + 1}, problem.value.options().dtype(at::kInt));  // + the run counter
            LaunchShape bailing = s;
            bailing.spread_role = SpreadRole::kBailWhereSpread;
            bailing.spread_flags = flags.data_ptr<int>();
            launch_on_grid<scalar_t>(kernel, blocks, problem, bailing, flush_map, go, sink, grad_locations, grad_weights);
            if constexpr (sizeof(scalar_t) == 4 && std::is_same_v<Sink, AtomicSink<float>>) {
              launch_spread_fallback<scalar_t>(problem, bailing, blocks, go, sink, grad_locations, grad_weights);
            } else {
              hopper::with_backward_chunk<scalar_t>(static_cast<int>(problem.channels), [&](auto chunk) {
                constexpr int kChunk = decltype(chunk)::value;
                if constexpr (four_ctas_built<scalar_t, kChunk, Sink>()) {
                  LaunchShape plain = plain_fallback;
                  plain.spread_role = SpreadRole::kRunFlaggedCtas;
                  plain.spread_flags = bailing.spread_flags;
                  const auto plain_kernel = backward_kernel<scalar_t, kChunk, Sink, Aggregation::kDirect, 4>;
                  persistent_blocks(plain_kernel, problem, plain);  // raises its shared-memory limit
                  launch_on_grid<scalar_t>(plain_kernel, blocks, problem, plain, flush_map, go, sink, grad_locations,
                                           grad_weights);
                } else {
                  TORCH_CHECK(false, "mmdeform_tma tma_ws: no plain kernel for the spread fallback");
                }
              });
            }
          };
          if (s.mma) {
            // Rows of 32 channels (fp32's only ones): in fp16/bf16 the dots on the tensor cores too;
            // deterministic, the TMA flush. fp32's fast kernel has neither, so it is built once.
            const bool rows32 = problem.channels == 32;
            TORCH_CHECK((rows32 && deterministic) == (s.flush_bytes > 0),
                        "mmdeform_tma tma_ws: the deterministic 32-channel MMA kernel without its flush room");
            constexpr bool kHalfRows = sizeof(scalar_t) == 2;
            constexpr bool kFixedPoint = !std::is_same_v<Sink, AtomicSink<float>>;
            with_rows32(rows32, [&](auto flag) {
              constexpr bool kRows32 = kHalfRows ? decltype(flag)::value : kFixedPoint;
              constexpr int kMinCtas = min_blocks_per_multiprocessor<scalar_t>();
              constexpr int kMmaChunkBytes = mma_chunk_bytes(sizeof(scalar_t));
              // At 96 registers fp32's 32-byte lanes spill, and so does bf16's fixed-point kernel of
              // 32-channel rows; fp16's stages half rows there (LaunchShape::flush_bytes).
              constexpr bool kFourCtas =
                  kHalfRows && !(kFixedPoint && kRows32 && std::is_same_v<scalar_t, __nv_bfloat16>);
              if constexpr (kFourCtas) {
                if (s.ctas_per_sm == 4) {
                  launch_mma(backward_kernel<scalar_t, kMmaChunkBytes, Sink, Aggregation::kMma, 4, kRows32>);
                  return;
                }
              }
              launch_mma(backward_kernel<scalar_t, kMmaChunkBytes, Sink, Aggregation::kMma, kMinCtas, kRows32>);
            });
            return;
          }
        }
        hopper::with_backward_chunk<scalar_t>(static_cast<int>(problem.channels), [&](auto chunk) {
          constexpr int kChunk = decltype(chunk)::value;
          if constexpr (gather_built(sizeof(scalar_t), kChunk)) {
            if (s.gather) {
              launch_persistent<scalar_t>(backward_kernel<scalar_t, kChunk, Sink, Aggregation::kGather>, problem, s,
                                          flush_map, go, sink, grad_locations, grad_weights);
              return;
            }
          }
          if constexpr (four_ctas_built<scalar_t, kChunk, Sink>()) {
            if (s.ctas_per_sm == 4) {
              launch_persistent<scalar_t>(backward_kernel<scalar_t, kChunk, Sink, Aggregation::kDirect, 4>, problem, s,
                                          flush_map, go, sink, grad_locations, grad_weights);
              return;
            }
          }
          launch_persistent<scalar_t>(backward_kernel<scalar_t, kChunk, Sink, Aggregation::kDirect>, problem, s,
                                      flush_map, go, sink, grad_locations, grad_weights);
        });
      });
}

}  // namespace tma_ws
}  // namespace mmdeform_tma
