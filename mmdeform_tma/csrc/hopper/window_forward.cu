// `tma_ws` forward: the window pipeline's consumers interpolate every point of their queries,
// level by level, and store each query's output after its last level. Two kernels: the windowed
// one (configs with a value window, or problems past 32-bit offsets) and a windowless one for the
// `_l1` configs, which leaves out the window's registers and work (below).
#include "../common/dtype_dispatch.cuh"
#include "../common/launchers.h"
#include "region_forward.h"
#include "tensor_core_forward.h"
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

// False, with the output poisoned (loud, and nothing is read), when the level metadata is inconsistent.
template <typename scalar_t>
__device__ __forceinline__ bool level_metadata_ok(const Problem<scalar_t>& p, scalar_t* output) {
  if (level_geometry_ok(p.spatial_shapes, p.level_start, p.levels, p.num_keys)) return true;
  poison_outputs(p, output);
  return false;
}

constexpr int kChunkBytes = 16;  // a lane's share of a corner row in the forward
template <typename scalar_t>
constexpr int kVec = kChunkBytes / static_cast<int>(sizeof(scalar_t));

template <typename scalar_t>
__global__ void __launch_bounds__(kMaxThreads, min_blocks_per_multiprocessor<scalar_t>()) forward_kernel(
    const __grid_constant__ CUtensorMap value_map, const __grid_constant__ Problem<scalar_t> p,
    const __grid_constant__ LaunchShape s,
    scalar_t* __restrict__ output) {
#if MMDEFORM_TMA_HOPPER_DEVICE
  using coord_t = coord_type<scalar_t>;
  using acc_t = acc_type<scalar_t>;
  constexpr int VEC = kVec<scalar_t>;
  constexpr int kSlots = max_forward_slots_per_team(VEC);
  extern __shared__ __align__(128) char dynamic_smem[];

  if (!level_metadata_ok(p, output)) return;
  const Ring<coord_t> ring{dynamic_smem, &s};
  const int groups = tile_groups(p, s);
  const int num_tiles = tile_count(p, groups);
  init_ring(ring, &value_map);
  if (threadIdx.x < 32) {
    run_producer(p, ring, &value_map, groups, num_tiles);
    return;
  }

  const ConsumerLane cl = consumer_lane(s);
  const int64_t key_stride = static_cast<int64_t>(p.heads) * p.channels;
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
            load_point<scalar_t, VEC>(m, w.rows > 0, window, s, cl, lane_value, key_stride, row_stride);
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

// ---------------------------------------------------------------------------------------------
// Windowless forward: the kernel for configs without a value window (the default `_l1` ones).
// It keeps none of the window's work: no footprint box, no TMA, no shared-memory corner path
// (corners outside the level are zeros in registers), and 32-bit offsets (the host checks that
// they fit). Per stage point i the
// producer leaves, side by side (a 16-byte and a 4-byte shared load for the consumer):
//   weights[i]  attention x bilinear weight per corner (Corner order), as the windowed kernel's
//   corners[i]  byte offset of the top-left corner's head row from value's start, with the
//               corners' validity bits in the low 4 bits (a head row is a multiple of 16 bytes)
// and, in a tile's last stage, rows[slot]: the output row of each query slot (-1: none), so that
// consumers keep no tile state across the stages.
// Offsets are taken modulo 2^32: a top-left corner outside the level may wrap, its in-level
// corners are its offset plus one key and/or one level row, computed in 32 bits too.

template <typename coord_t>
struct alignas(16) CornerWeights {
  coord_t w[4];
};

// Per point: weights and corners, plus 4 bytes that hold rows[] (slots <= points x slots).
template <typename coord_t>
constexpr int lean_meta_size() {
  return static_cast<int>(sizeof(CornerWeights<coord_t>) + 2 * sizeof(uint32_t));
}

template <typename coord_t>
struct LeanStage {
  CornerWeights<coord_t>* weights;
  uint32_t* corners;
  int* rows;
};

template <typename coord_t>
__device__ __forceinline__ LeanStage<coord_t> lean_stage(const Ring<coord_t>& ring, int stage, int n) {
  char* base = reinterpret_cast<char*>(ring.meta(stage));
  uint32_t* corners = reinterpret_cast<uint32_t*>(base + n * static_cast<int>(sizeof(CornerWeights<coord_t>)));
  return {reinterpret_cast<CornerWeights<coord_t>*>(base), corners, reinterpret_cast<int*>(corners + n)};
}

// The stage header holds one level row's bytes (width x key bytes).
template <typename coord_t>
__device__ __forceinline__ uint32_t* lean_row_bytes(const Ring<coord_t>& ring, int stage) {
  return reinterpret_cast<uint32_t*>(ring.header(stage));
}

#if MMDEFORM_TMA_HOPPER_DEVICE

// One point's metadata (LeanStage): the same weights as produce_stage, with 32-bit indices.
template <typename coord_t>
struct LeanPoint {
  CornerWeights<coord_t> weights;
  uint32_t corners;
};

template <typename coord_t>
__device__ __forceinline__ LeanPoint<coord_t> lean_point(const LevelGeometry& g, int key0, uint32_t key_bytes,
                                                         uint32_t column, coord_t x, coord_t y, coord_t a,
                                                         bool present) {
  // A point that misses the level keeps weight a on every corner and reads zeros (a x 0,
  // NaN for a non-finite weight, as the reference); an empty slot has weight 0.
  LeanPoint<coord_t> m;
  m.weights.w[0] = m.weights.w[1] = m.weights.w[2] = m.weights.w[3] = a;
  m.corners = 0u;
  if (present) {
    const Bilinear<coord_t> bl = bilinear(x, y, g.height, g.width);
    if (bl.valid) {
      m.corners = (static_cast<uint32_t>(key0 + bl.y0 * g.width + bl.x0) * key_bytes + column) | bl.valid;
#pragma unroll
      for (int c = 0; c < 4; ++c) m.weights.w[c] = a * bl.weight(c);
    }
  }
  return m;
}

template <typename coord_t>
__device__ __forceinline__ void write_lean_point(const LeanStage<coord_t>& meta, const LevelGeometry& g, int key0,
                                                 uint32_t key_bytes, uint32_t column, int i, coord_t x, coord_t y,
                                                 coord_t a, bool present) {
  const LeanPoint<coord_t> m = lean_point(g, key0, key_bytes, column, x, y, a, present);
  meta.weights[i] = m.weights;
  meta.corners[i] = m.corners;
}

// A stage's end: the output rows at the tile's last level, the level row's bytes, the arrival.
template <typename scalar_t>
__device__ __forceinline__ void finish_lean_stage(const Problem<scalar_t>& p, const Ring<coord_type<scalar_t>>& ring,
                                                  const LeanStage<coord_type<scalar_t>>& meta, const Tile& t,
                                                  const LevelGeometry& g, int level, int stage, uint32_t key_bytes) {
  const LaunchShape& s = *ring.s;
  const int lane = threadIdx.x & 31;
  if (level == p.levels - 1) {
    for (int slot = lane; slot < s.slots; slot += 32) {
      const int query = tile_query(t, s, slot, p.queries);
      meta.rows[slot] = query >= 0 ? (t.batch * p.queries + query) * p.heads + t.head : -1;
    }
  }
  if (lane == 0) *lean_row_bytes(ring, stage) = static_cast<uint32_t>(g.width) * key_bytes;
  mbarrier_arrive(ring.full(stage));
}

// One stage of the windowless producer, in batches of kBatch points per lane.
template <int kBatch, typename scalar_t>
__device__ __forceinline__ void produce_lean_stage(const Problem<scalar_t>& p, const Ring<coord_type<scalar_t>>& ring,
                                                   const Tile& t, int level, int stage, uint32_t key_bytes) {
  using coord_t = coord_type<scalar_t>;
  const LaunchShape& s = *ring.s;
  const int lane = threadIdx.x & 31;
  const LevelGeometry g = level_geometry(p.spatial_shapes, p.level_start, level);
  const int n = s.slots * p.points;
  const LeanStage<coord_t> meta = lean_stage(ring, stage, n);
  const int key0 = t.batch * p.num_keys + static_cast<int>(g.start);
  const uint32_t column = static_cast<uint32_t>(t.head * s.row_bytes);
  const int query_stride = p.heads * p.levels * p.points;
  const int at0 = ((t.batch * p.queries * p.heads + t.head) * p.levels + level) * p.points;

  const float inv_points = 1.0f / static_cast<float>(p.points);  // exact slot = i / points for i < 2^20
  for (int first = 0; first < n; first += 32 * kBatch) {
    coord_t x[kBatch], y[kBatch], a[kBatch];
    bool present[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int i = first + 32 * k + lane;
      const int slot = static_cast<int>((static_cast<float>(i) + 0.5f) * inv_points);
      const int query = i < n ? tile_query(t, s, slot, p.queries) : -1;
      present[k] = query >= 0;
      x[k] = y[k] = a[k] = coord_t(0);
      if (present[k]) {
        const int at = at0 + query * query_stride + (i - slot * p.points);
        x[k] = p.locations[2 * at];
        y[k] = p.locations[2 * at + 1];
        a[k] = p.weights[at];
      }
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int i = first + 32 * k + lane;
      if (i >= n) break;
      write_lean_point(meta, g, key0, key_bytes, column, i, x[k], y[k], a[k], present[k]);
    }
  }
  finish_lean_stage(p, ring, meta, t, g, level, stage, key_bytes);
}

// The most levels whose points a one-slot producer holds at once (two a lane each). Five made
// DINO's five-level decoder forward 3 % slower (20.2 -> 20.8 us) and gained nothing on four.
constexpr int kLeanTileLevels = 4;

// A tile's locations and weights of every level, loaded at its first stage, so that the
// producer's chain has one round trip a tile instead of one a level: for the one-slot decoder
// tiles of at most 64 points a level (DINO's: one wave). DINO bs 2 fp16 16.95 -> 16.7 us, bf16
// 16.75 -> 16.55 (H100, 2026-11-27; perf_notes.md, item 100); the two-slot kernels' machine code
// is unchanged (tools/kernel_code_diff.py).
// Lane point k of a level is stage point k x 32 + lane; level l's are in [0] after l shifts.
template <typename coord_t>
struct LeanTilePoints {
  coord_t x[kLeanTileLevels][2], y[kLeanTileLevels][2], a[kLeanTileLevels][2];
  bool present[2];

  template <typename scalar_t>
  __device__ __forceinline__ void load(const Problem<scalar_t>& p, const LaunchShape& s, const Tile& t) {
    const int lane = threadIdx.x & 31;
    const int n = s.slots * p.points;
    const int first_at = (t.batch * p.queries * p.heads + t.head) * p.levels * p.points;
    const int query_stride = p.heads * p.levels * p.points;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int i = 32 * k + lane;
      const int slot = i / p.points;
      const int query = i < n ? tile_query(t, s, slot, p.queries) : -1;
      present[k] = query >= 0;
      const int at = first_at + query * query_stride + (i - slot * p.points);
#pragma unroll
      for (int l = 0; l < kLeanTileLevels; ++l) {
        x[l][k] = y[l][k] = a[l][k] = coord_t(0);
        if (present[k] && l < p.levels) {
          x[l][k] = p.locations[2 * (at + l * p.points)];
          y[l][k] = p.locations[2 * (at + l * p.points) + 1];
          a[l][k] = p.weights[at + l * p.points];
        }
      }
    }
  }

  __device__ __forceinline__ void shift() {
#pragma unroll
    for (int l = 0; l + 1 < kLeanTileLevels; ++l) {
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        x[l][k] = x[l + 1][k];
        y[l][k] = y[l + 1][k];
        a[l][k] = a[l + 1][k];
      }
    }
  }
};

// The most points a level for which the consumers compute the first level themselves (below).
constexpr int kOwnLevelPoints = 4;

// The CTA's first tile's first level, computed by its consumers rather than staged by the
// producer: a team's lanes each load its query's points of level 0 (the same addresses) before the
// metadata check, so that the coordinates' round trip overlaps the check's, and the first gathers
// wait on no hand-off through shared memory. One-slot strip tiles of 2-4 levels, at most
// kOwnLevelPoints points a level, whose producer holds the tile's points. It runs before the tile
// loop: inside it, its registers cost the loop's gathers their issue order (perf_notes.md, items
// 107-108).
template <typename coord_t>
struct OwnFirstLevel {
  coord_t x[kOwnLevelPoints], y[kOwnLevelPoints], a[kOwnLevelPoints];
  Tile t;
  int query;  // -1: an empty slot (nothing to gather)

  template <typename scalar_t>
  static __device__ __forceinline__ bool applies(const Problem<scalar_t>& p, const LaunchShape& s, int num_tiles) {
    return !s.pixel_tiles && s.slots * p.points <= 32 * 2 && p.levels >= 2 && p.levels <= kLeanTileLevels &&
           p.points <= kOwnLevelPoints && static_cast<int>(blockIdx.x) < num_tiles;
  }

  template <typename scalar_t>
  __device__ __forceinline__ void load(const Problem<scalar_t>& p, const LaunchShape& s, int groups, int slot) {
    t = tile_at(p, s, groups, static_cast<int>(blockIdx.x));
    query = tile_query(t, s, slot, p.queries);
    const int at = ((t.batch * p.queries + query) * p.heads + t.head) * p.levels * p.points;
#pragma unroll
    for (int i = 0; i < kOwnLevelPoints; ++i) {
      x[i] = y[i] = a[i] = coord_t(0);
      if (query >= 0 && i < p.points) {
        x[i] = p.locations[2 * (at + i)];
        y[i] = p.locations[2 * (at + i) + 1];
        a[i] = p.weights[at + i];
      }
    }
  }
};

// One stage from the held points of its level.
template <typename scalar_t>
__device__ __forceinline__ void produce_lean_stage_held(const Problem<scalar_t>& p, const Ring<coord_type<scalar_t>>& ring,
                                                        const Tile& t, int level, int stage, uint32_t key_bytes,
                                                        const LeanTilePoints<coord_type<scalar_t>>& held) {
  const LaunchShape& s = *ring.s;
  const int lane = threadIdx.x & 31;
  const LevelGeometry g = level_geometry(p.spatial_shapes, p.level_start, level);
  const int n = s.slots * p.points;
  const LeanStage<coord_type<scalar_t>> meta = lean_stage(ring, stage, n);
  const int key0 = t.batch * p.num_keys + static_cast<int>(g.start);
  const uint32_t column = static_cast<uint32_t>(t.head * s.row_bytes);
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int i = 32 * k + lane;
    if (i < n) write_lean_point(meta, g, key0, key_bytes, column, i, held.x[0][k], held.y[0][k], held.a[0][k], held.present[k]);
  }
  finish_lean_stage(p, ring, meta, t, g, level, stage, key_bytes);
}

// A corner chunk from global memory (through L1) when `bit` of `corners` is set, else zeros. The
// zeros are set in registers, not read from the zero block: ncu (H100, 2026-11-24) had those
// shared loads at 30 % of the kernel's shared-memory wavefronts. Volatile: never moved above the
// wait that makes the stage visible.
template <int BIT>
__device__ __forceinline__ Chunk<16> load_corner_or_zero(uint32_t corners, const char* global) {
  Chunk<16> c;
  asm volatile(
      "{\n .reg .pred p;\n .reg .b32 t;\n and.b32 t, %4, %5;\n setp.ne.u32 p, t, 0;\n"
      " mov.b32 %0, 0;\n mov.b32 %1, 0;\n mov.b32 %2, 0;\n mov.b32 %3, 0;\n"
      " @p ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%6];\n}"
      : "=r"(c.r[0]), "=r"(c.r[1]), "=r"(c.r[2]), "=r"(c.r[3])
      : "r"(corners), "n"(BIT), "l"(global));
  return c;
}

// A lane's chunk of a point's four corner rows from `corners` (LeanStage's word for the point);
// `down` is a level row's bytes. Branch-free: a corner outside the level reads zeros.
__device__ __forceinline__ PointCorners<kChunkBytes> gather_lean_corners(const char* values, uint32_t corners,
                                                                         uint32_t chunk, uint32_t key_bytes,
                                                                         uint32_t down) {
  const uint32_t top = (corners & ~15u) + chunk;
  PointCorners<kChunkBytes> c;
  c.corner[kTopLeft] = load_corner_or_zero<1>(corners, values + top);
  c.corner[kTopRight] = load_corner_or_zero<2>(corners, values + (top + key_bytes));
  c.corner[kBottomLeft] = load_corner_or_zero<4>(corners, values + (top + down));
  c.corner[kBottomRight] = load_corner_or_zero<8>(corners, values + (top + down + key_bytes));
  return c;
}

// acc += the point's corner chunks, each times its weight.
template <typename scalar_t, int VEC>
__device__ __forceinline__ void accumulate_lean_corners(acc_type<scalar_t> (&acc)[VEC], const PointCorners<kChunkBytes>& c,
                                                        const CornerWeights<coord_type<scalar_t>>& w) {
  use_corners<scalar_t, VEC>(c, [&](int corner, const acc_type<scalar_t> (&v)[VEC]) {
    const acc_type<scalar_t> weight = static_cast<acc_type<scalar_t>>(w.w[corner]);
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = fma(weight, v[k], acc[k]);
  });
}

#endif  // MMDEFORM_TMA_HOPPER_DEVICE

// fp32 sizes the producer's batch to the stage: at 8 points a lane, a decoder stage of 64 points
// ran the loads' index math for 6 empty ones, and fp32's Q = 100 decoder forward took 10.4 us
// against 9.2. Half precision keeps 8, where the same change left the decoders flat and made ptxas
// schedule the fp16 encoder's gathers later, 5 % slower (H100, 2026-11-27; perf_notes.md, item 98).
template <typename scalar_t>
constexpr bool lean_batch_sized_to_stage() {
  return sizeof(scalar_t) == 4;
}

// 80 registers: 5 CTAs of 5 warps per SM by the register file (25 x 32 x 80 <= 65536), against 3
// at the windowed kernel's 119. Stated as a cap, not as __launch_bounds__ minimum blocks, which
// made ptxas budget only 72 registers here and spill; fp64 (gradcheck) is left uncapped. It is
// also the most at which a scheduler's 16,384 registers hold six warps, so that DINO's 900
// one-slot tiles of 3-warp CTAs run in one wave (8 CTAs a SM): at 87 the grid fell to 792 CTAs
// and the forward took 19.6 us against 16.7 (H100, 2026-11-27; perf_notes.md, item 101).
template <typename scalar_t>
constexpr int lean_max_registers() {
  return sizeof(scalar_t) == 8 ? 255 : 80;
}

// kSlots: the most query slots a team owns. Half precision also builds kSlots = 1 for the
// decoders' tiles of one slot a team: a second slot's accumulators, live through every tile,
// kept ptxas from issuing a pair of points' eight gathers before the first was used, and DINO's
// decoder forward took 17.3 us against 16.9 (bs 8: 46.7 against 44.3). fp32 lost 2-3 % with it
// (H100, 2026-11-27; perf_notes.md, item 98).
// It reads no tensor map and takes none: its parameters begin the parameter bank, in 3 of the
// bank's 64-byte lines instead of 6 (beside the driver's first line), and DINO bs 2 fp16 took 16.2-16.3 us against 16.6-16.7 (H100,
// 2026-11-27; perf_notes.md, item 106; launch_persistent_without_map).
template <typename scalar_t, int kSlots>
__global__ void __maxnreg__(lean_max_registers<scalar_t>()) forward_lean_kernel(
    scalar_t* __restrict__ output, const __grid_constant__ Problem<scalar_t> p, const __grid_constant__ LaunchShape s) {
#if MMDEFORM_TMA_HOPPER_DEVICE
  using coord_t = coord_type<scalar_t>;
  using acc_t = acc_type<scalar_t>;
  constexpr int VEC = kVec<scalar_t>;
  extern __shared__ __align__(128) char dynamic_smem[];
  if (s.spread_role == SpreadRole::kRunIfSpread && *s.spread_flags == 0) return;  // the region forward did it all

  const ConsumerLane cl = consumer_lane(s);
  const int groups = tile_groups(p, s);  // strips: from the parameters alone
  const int num_tiles = tile_count(p, groups);
  const bool own_first = kSlots == 1 && OwnFirstLevel<coord_t>::applies(p, s, num_tiles);
  OwnFirstLevel<coord_t> own;
  if (own_first && threadIdx.x >= 32) own.load(p, s, groups, cl.team);
  if (!level_metadata_ok(p, output)) return;
  const Ring<coord_t> ring{dynamic_smem, &s};
  const uint32_t key_bytes = static_cast<uint32_t>(p.heads * s.row_bytes);
  const int n = s.slots * p.points;
  init_ring(ring, static_cast<const CUtensorMap*>(nullptr));
  if (threadIdx.x < 32) {
    StageCursor at{static_cast<int>(blockIdx.x), 0, 0, 0u};
    Tile t{};
    if constexpr (kSlots == 1) {
      if (n <= 32 * 2 && p.levels <= kLeanTileLevels) {
        LeanTilePoints<coord_t> held;
        if (own_first) {  // the consumers take the first tile's level 0: stages start at its level 1
          t = tile_at(p, s, groups, at.tile);
          held.load(p, s, t);
          at.level = 1;
        }
        while (at.tile < num_tiles) {
          if (at.level == 0) {
            t = tile_at(p, s, groups, at.tile);
            held.load(p, s, t);
          } else {
            held.shift();
          }
          if (at.round > 0) mbarrier_wait(ring.empty(at.stage), (at.round - 1) & 1u);
          produce_lean_stage_held(p, ring, t, at.level, at.stage, key_bytes, held);
          at.advance(p.levels, s.stages);
        }
        return;
      }
    }
    while (at.tile < num_tiles) {
      if (at.level == 0) t = tile_at(p, s, groups, at.tile);
      if (at.round > 0) mbarrier_wait(ring.empty(at.stage), (at.round - 1) & 1u);
      if (lean_batch_sized_to_stage<scalar_t>() && n <= 32 * 2) {
        produce_lean_stage<2>(p, ring, t, at.level, at.stage, key_bytes);
      } else if (lean_batch_sized_to_stage<scalar_t>() && n <= 32 * 4) {
        produce_lean_stage<4>(p, ring, t, at.level, at.stage, key_bytes);
      } else {
        produce_lean_stage<8>(p, ring, t, at.level, at.stage, key_bytes);
      }
      at.advance(p.levels, s.stages);
    }
    return;
  }

  // One tile per outer iteration; the accumulators and the ring position cross tiles (registers).
  const char* values = reinterpret_cast<const char*>(p.value);
  const uint32_t chunk = static_cast<uint32_t>(cl.chunk_byte);
  int stage = 0;
  uint32_t phase = 0u;
  acc_t acc[kSlots][VEC];
#pragma unroll
  for (int j = 0; j < kSlots; ++j)
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[j][k] = acc_t(0);
  int first_level = 0;
  if (own_first) {  // before the tile loop, so that none of its registers is live in the loop
    first_level = 1;
    if (own.query >= 0) {
      const LevelGeometry g = level_geometry(p.spatial_shapes, p.level_start, 0);
      const int key0 = own.t.batch * p.num_keys + static_cast<int>(g.start);
      const uint32_t column = static_cast<uint32_t>(own.t.head * s.row_bytes);
      const uint32_t down = static_cast<uint32_t>(g.width) * key_bytes;
      auto gather = [&](const LeanPoint<coord_t>& m) {
        return gather_lean_corners(values, m.corners, chunk, key_bytes, down);
      };
      auto accumulate = [&](const PointCorners<kChunkBytes>& c, const LeanPoint<coord_t>& m) {
        accumulate_lean_corners<scalar_t, VEC>(acc[0], c, m.weights);
      };
#pragma unroll
      for (int i = 0; i < kOwnLevelPoints; i += 2) {
        if (i >= p.points) break;
        const LeanPoint<coord_t> m0 = lean_point(g, key0, key_bytes, column, own.x[i], own.y[i], own.a[i], true);
        const PointCorners<kChunkBytes> c0 = gather(m0);
        if (i + 1 < p.points) {
          const LeanPoint<coord_t> m1 =
              lean_point(g, key0, key_bytes, column, own.x[i + 1], own.y[i + 1], own.a[i + 1], true);
          const PointCorners<kChunkBytes> c1 = gather(m1);
          accumulate(c0, m0);
          accumulate(c1, m1);
        } else {
          accumulate(c0, m0);
        }
      }
    }
  }
  for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    for (int level = first_level;; ++level) {
      mbarrier_wait(ring.full(stage), phase);
      const uint32_t down = *lean_row_bytes(ring, stage);
      const LeanStage<coord_t> meta = lean_stage(ring, stage, n);
#pragma unroll
      for (int j = 0; j < kSlots; ++j) {
        if (j >= s.slots_per_team) break;
        const int first = (cl.team + j * cl.teams) * p.points;
        // Branch-free: a missing point reads zeros. Two points' gathers in flight before either is
        // summed: decoder-sized calls are one wave, where each gather's round trip is on the path.
        auto gather = [&](int i) { return gather_lean_corners(values, meta.corners[i], chunk, key_bytes, down); };
        auto accumulate = [&](const PointCorners<kChunkBytes>& c, int i) {
          const CornerWeights<coord_t> w = meta.weights[i];
          accumulate_lean_corners<scalar_t, VEC>(acc[j], c, w);
        };
        int point = 0;
#pragma unroll 1
        for (; point + 2 <= p.points; point += 2) {
          const PointCorners<kChunkBytes> c0 = gather(first + point);
          const PointCorners<kChunkBytes> c1 = gather(first + point + 1);
          accumulate(c0, first + point);
          accumulate(c1, first + point + 1);
        }
        if (point < p.points) accumulate(gather(first + point), first + point);
      }
      const bool last = level == p.levels - 1;
      int rows[kSlots];
#pragma unroll
      for (int j = 0; j < kSlots; ++j) {
        rows[j] = last && j < s.slots_per_team ? meta.rows[cl.team + j * cl.teams] : -1;  // read before the release
      }
      mbarrier_arrive(ring.empty(stage));
      if (++stage == s.stages) {
        stage = 0;
        phase ^= 1u;
      }
      if (last) {
#pragma unroll
        for (int j = 0; j < kSlots; ++j) {
          if (rows[j] >= 0) {
            store_vec(output + static_cast<int64_t>(rows[j]) * p.channels + cl.lane * VEC,
                      from_acc_vec<scalar_t, VEC>(acc[j]));
          }
        }
        break;
      }
    }
    first_level = 0;
#pragma unroll
    for (int j = 0; j < kSlots; ++j)
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc[j][k] = acc_t(0);
  }
#else
  __trap();
#endif
}

// 32-bit offsets hold every value byte and location index of the problem.
bool lean_fits(const ProblemTensors& problem) {
  constexpr int64_t kLimit = int64_t{1} << 31;
  return problem.value.numel() * problem.value.element_size() < kLimit &&
         problem.num_items() * problem.levels * problem.points * 2 < kLimit;
}

// The region forward (region_forward.cu), then the windowless forward, which runs only where the region
// forward found sampling that leaves its windows, and then writes every output. On uniform sampling the
// `_l1` configs' L1 gathers are the fastest forward (0.148 ms on the fp16 DETR encoder at bs 2; H100,
// 2026-12-07, session 56's sweep at b7eab28, docs/measurements/sweep_h100_401db80.md), and the region
// forward's path for points outside their windows, serial a point, would take several times that
// (estimated, perf_notes.md item 145).
template <typename scalar_t>
void region_forward_with_fallback(const ProblemTensors& problem, const hopper::window::RegionForwardConfig& config,
                                  at::Tensor& output) {
  using coord_t = coord_type<scalar_t>;
  constexpr int kSlots = max_forward_slots_per_team(kVec<scalar_t>);
  TORCH_CHECK(lean_fits(problem), "mmdeform_tma tma_ws: config ", config.name,
              ": the region forward's fallback takes a value under 2 GiB and under 2^31 location coordinates");
  at::Tensor spread = uninitialized({1}, problem.value.options().dtype(at::kInt));
  C10_CUDA_CHECK(cudaMemsetAsync(spread.data_ptr(), 0, sizeof(int), current_stream()));
  region_forward(problem, config, output, spread.data_ptr<int>());
  LaunchShape lean = launch_shape(problem, hopper::window::config_index(config.fallback), kChunkBytes,
                                  lean_meta_size<coord_t>(), kSlots, false);
  TORCH_CHECK(lean.window_rows == 0, "mmdeform_tma tma_ws: the region forward's fallback ", config.fallback,
              " must be a windowless config");
  lean.spread_role = SpreadRole::kRunIfSpread;
  lean.spread_flags = spread.data_ptr<int>();
  constexpr int kFewestSlots = sizeof(scalar_t) == 2 ? 1 : kSlots;
  launch_persistent_without_map<scalar_t>(lean.slots_per_team == 1 ? forward_lean_kernel<scalar_t, kFewestSlots>
                                                                   : forward_lean_kernel<scalar_t, kSlots>,
                                          problem, lean, reinterpret_cast<scalar_t*>(output.data_ptr()));
}

}  // namespace

at::Tensor forward(const ProblemTensors& problem, int64_t config) {
  at::Tensor output = uninitialized({problem.batch, problem.queries, problem.heads * problem.channels}, problem.value.options());
  if (problem.empty_output()) return output;
  if (problem.levels * problem.points == 0) return output.zero_();
  const int64_t tensor_core_index = config - hopper::window::shared_config_count();
  const int64_t tensor_core_count = static_cast<int64_t>(hopper::window::tensor_core_forward_configs().size());
  if (tensor_core_index >= 0 && tensor_core_index < tensor_core_count) {
    tensor_core_forward(problem, hopper::window::tensor_core_forward_configs()[tensor_core_index], output);
    return output;
  }
  const int64_t region_index = tensor_core_index - tensor_core_count;
  if (region_index >= 0 && region_index < static_cast<int64_t>(hopper::window::region_forward_configs().size())) {
    const auto& region = hopper::window::region_forward_configs()[region_index];
    const std::string reason = region_forward_unsupported(problem);
    TORCH_CHECK(reason.empty(), "mmdeform_tma tma_ws: config ", region.name, ": ", reason);
    if (problem.value.scalar_type() == at::kHalf) {
      region_forward_with_fallback<__half>(problem, region, output);
    } else {
      region_forward_with_fallback<__nv_bfloat16>(problem, region, output);
    }
    return output;
  }
  hopper::require_hopper("tma_ws");
  hopper::require_tma_channels(problem.value, "tma_ws");
  MMDEFORM_TMA_DISPATCH_VALUE_TYPES(problem.value.scalar_type(), "mmdeform_tma tma_ws forward", [&] {
    constexpr int kSlots = max_forward_slots_per_team(kVec<scalar_t>);
    using coord_t = coord_type<scalar_t>;
    auto* out = reinterpret_cast<scalar_t*>(output.data_ptr());
    const LaunchShape s = launch_shape(problem, config, kChunkBytes, sizeof(WindowPoint<coord_t>), kSlots, false);
    if (s.window_rows == 0 && lean_fits(problem)) {
      const LaunchShape lean = launch_shape(problem, config, kChunkBytes, lean_meta_size<coord_t>(), kSlots, false);
      constexpr int kFewestSlots = sizeof(scalar_t) == 2 ? 1 : kSlots;
      launch_persistent_without_map<scalar_t>(lean.slots_per_team == 1 ? forward_lean_kernel<scalar_t, kFewestSlots>
                                                                       : forward_lean_kernel<scalar_t, kSlots>,
                                              problem, lean, out);
    } else {
      launch_persistent<scalar_t>(forward_kernel<scalar_t>, problem, s, out);
    }
  });
  return output;
}

}  // namespace tma_ws
}  // namespace mmdeform_tma
