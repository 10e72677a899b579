// The window pipeline shared by the `tma_ws` forward and backward kernels: tiles, the producer
// warp, the stage ring, and the corner loads of the consumers (host side: window_config.h).
//
// A CTA is one producer warp and `consumer_warps` consumer warps. It walks a static, strided tile
// schedule (persistent CTAs); each tile goes through the ring level by level, one stage per
// (tile, level). For a stage the producer
//   1. computes every point's sampling geometry once (metadata in shared memory),
//   2. takes the bounding box of the points' corner footprints, places a window of at most
//      window_rows x window_cols cells over it (centred on the box when the box is larger),
//   3. marks the points whose four corners lie inside the level and the window, and
//   4. loads the window with one TMA box per window row when it pays (at least as many corner
//      reads inside it as cells loaded); otherwise the stage has no window. The MMA backward's
//      window is not loaded (LaunchShape::load_window): it only places the cells it sums over.
// Consumers read a window point's corners from shared memory, any other point's corners from
// global memory through L1; corners outside the level are zeros.
//
// Hand-over: `full[s]` counts the producer warp's 32 arrivals plus the TMA bytes, `empty[s]` the
// consumers' arrivals. Every thread arrives on every stage whatever it holds, so the arrival
// counts never depend on the data. Window cells past the level's right edge hold the next row's
// keys (a box is a run of consecutive keys); no point ever reads them.
#pragma once

#include <climits>
#include <type_traits>

#include "../common/device_utils.cuh"
#include "tma_primitives.cuh"
#include "window_config.h"

namespace mmdeform_tma {
namespace hopper {
namespace window {

constexpr int kMaxConsumerWarps = 4;
constexpr int kMaxThreads = 32 * (1 + kMaxConsumerWarps);
// Stated so that ptxas budgets registers for it (up to 136 each at 3 CTAs) instead of capping them
// lower by its own occupancy guess, which spilled; fp64 (gradcheck) gets a CTA's whole budget.
template <typename scalar_t>
constexpr int min_blocks_per_multiprocessor() {
  return sizeof(scalar_t) == 8 ? 1 : 3;
}

// One sampling point as the producer leaves it for the consumers.
template <typename coord_t>
struct alignas(16) WindowPoint {
  coord_t weight[4];  // attention x bilinear weight per corner (Corner order), for valid corners
  int key;            // value-map row of the top-left corner: batch * num_keys + start + y0 * width + x0
  unsigned valid;     // corner bits (Corner order); 0: the point misses the level
  int cell;           // window cell of the top-left corner, or -1: corners come from global memory
  int x0, y0;         // top-left corner in level pixels
  coord_t ly, lx;     // bilinear fractions
  coord_t attention;
};

// The window of one stage, written by the producer next to the stage's metadata.
struct alignas(16) StageWindow {
  int key0;           // value-map row of cell (0, 0): batch * num_keys + start + wy0 * width + wx0
  int rows;           // window rows loaded; 0: this stage has no window
  int cols;           // window columns inside the level
  int width, height;  // the level's size
  // Under SpreadRole::kBailWhereSpread: 1 when the corners span more than four MMA accumulation
  // windows (sampling spread over the level, not clustered around the tile).
  int spread;
};

// Where a tile's queries are. Pixel blocks: the block's origin in its query level; strips: the
// first query.
struct Tile {
  int batch, head;
  int first;          // strips: first query; pixel blocks: key (= query) of the level's pixel (0, 0)
  int row0, col0;     // pixel blocks: the block's top-left pixel
  int width, height;  // pixel blocks: the query level's size
};

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Tiles per (batch, head): pixel blocks over every level, or strips of queries.
template <typename scalar_t>
__device__ __forceinline__ int tile_groups(const Problem<scalar_t>& p, const LaunchShape& s) {
  if (!s.pixel_tiles) return ceil_div(p.queries, s.slots);
  int groups = 0;
  for (int l = 0; l < p.levels; ++l) {
    const LevelGeometry g = level_geometry(p.spatial_shapes, p.level_start, l);
    groups += ceil_div(g.height, s.block_rows) * ceil_div(g.width, s.block_cols);
  }
  return groups;
}

// Tiles of a launch: every (batch, head) pair has `groups` of them.
template <typename scalar_t>
__device__ __forceinline__ int tile_count(const Problem<scalar_t>& p, int groups) {
  return p.num_items / (p.queries * p.heads) * groups * p.heads;
}

// Tiles are numbered ((batch * groups) + group) * heads + head (heads inner), or with
// LaunchShape::heads_outer ((batch * heads) + head) * groups + group. Heads outer keeps the tiles in
// flight on one head's value (and value gradient), a working set the L2 holds whatever the sampling
// spread; heads inner spreads them over every head of a region of value.
template <typename scalar_t>
__device__ __forceinline__ Tile tile_at(const Problem<scalar_t>& p, const LaunchShape& s, int groups, int index) {
  Tile t{};
  // One decode for both orders: selects, not branches, and the divisions of one order.
  const int inner_count = s.heads_outer ? groups : p.heads, outer_count = s.heads_outer ? p.heads : groups;
  const int rest = index / inner_count, inner = index - rest * inner_count, outer = rest % outer_count;
  t.head = s.heads_outer ? outer : inner;
  int group = s.heads_outer ? inner : outer;
  t.batch = rest / outer_count;
  if (!s.pixel_tiles) {
    t.first = group * s.slots;
    return t;
  }
  for (int l = 0; l < p.levels; ++l) {
    const LevelGeometry g = level_geometry(p.spatial_shapes, p.level_start, l);
    const int across = ceil_div(g.width, s.block_cols);
    const int blocks = ceil_div(g.height, s.block_rows) * across;
    if (group < blocks) {
      t.first = static_cast<int>(g.start);
      t.row0 = group / across * s.block_rows;
      t.col0 = group % across * s.block_cols;
      t.width = g.width;
      t.height = g.height;
      break;
    }
    group -= blocks;
  }
  return t;
}

// The query in `slot` of a tile, or -1 for a slot past the end of the level or of the queries.
__device__ __forceinline__ int tile_query(const Tile& t, const LaunchShape& s, int slot, int queries) {
  if (s.pixel_tiles) {
    const int y = t.row0 + (slot >> s.block_cols_log2), x = t.col0 + (slot & (s.block_cols - 1));
    return y < t.height && x < t.width ? t.first + y * t.width + x : -1;
  }
  const int q = t.first + slot;
  return q < queries ? q : -1;
}

// The tile that holds query q of (batch, head): the inverse of tile_at and tile_query.
template <typename scalar_t>
__device__ __forceinline__ int tile_of_query(const Problem<scalar_t>& p, const LaunchShape& s, int groups, int batch,
                                             int head, int q) {
  int group = q / s.slots;
  if (s.pixel_tiles) {
    group = 0;
    for (int l = 0; l < p.levels; ++l) {
      const LevelGeometry g = level_geometry(p.spatial_shapes, p.level_start, l);
      const int across = ceil_div(g.width, s.block_cols);
      const int pixel = q - static_cast<int>(g.start);
      if (pixel < g.height * g.width) {
        group += pixel / g.width / s.block_rows * across + pixel % g.width / s.block_cols;
        break;
      }
      group += ceil_div(g.height, s.block_rows) * across;
    }
  }
  return s.heads_outer ? (batch * p.heads + head) * groups + group : (batch * groups + group) * p.heads + head;
}

// Walks (tile, level) stages in the order both roles use: the tile's levels, then the CTA's next
// tile; the ring stage and its wrap count alongside.
struct StageCursor {
  int tile, level, stage;
  uint32_t round;

  __device__ __forceinline__ void advance(int levels, int stages) {
    if (++stage == stages) {
      stage = 0;
      ++round;
    }
    if (++level == levels) {
      level = 0;
      tile += gridDim.x;
    }
  }
};

// Shared memory of the CTA, carved as LaunchShape says. The base is 128-byte aligned (the TMA
// destinations need it); the kernels check that at entry.
template <typename coord_t>
struct Ring {
  char* base;
  const LaunchShape* s;

  __device__ __forceinline__ char* window(int stage) const { return base + stage * s->stage_bytes; }
  __device__ __forceinline__ WindowPoint<coord_t>* meta(int stage) const {
    return reinterpret_cast<WindowPoint<coord_t>*>(base + stage * s->stage_bytes + s->meta_offset);
  }
  __device__ __forceinline__ StageWindow* header(int stage) const {
    return reinterpret_cast<StageWindow*>(base + stage * s->stage_bytes + s->header_offset);
  }
  __device__ __forceinline__ uint64_t* full(int stage) const {
    return reinterpret_cast<uint64_t*>(base + s->barrier_offset) + stage;
  }
  __device__ __forceinline__ uint64_t* empty(int stage) const {
    return reinterpret_cast<uint64_t*>(base + s->barrier_offset) + s->stages + stage;
  }
};

#if MMDEFORM_TMA_HOPPER_DEVICE

// Barriers, before the roles split. `map`: the value tensor map to prefetch, or nullptr for a kernel
// that reads none.
template <typename coord_t>
__device__ __forceinline__ void init_ring(const Ring<coord_t>& ring, const CUtensorMap* map) {
  const LaunchShape& s = *ring.s;
  if (threadIdx.x == 0) {
    if (smem_address(ring.base) & 127u) __trap();  // TMA destinations would be misaligned
    if (map != nullptr) prefetch_tensor_map(map);
    for (int i = 0; i < s.stages; ++i) {
      mbarrier_init(ring.full(i), 32);
      mbarrier_init(ring.empty(i), s.consumer_warps * 32);
    }
    fence_mbarrier_init();
  }
  __syncthreads();  // the last CTA-wide barrier: the roles never wait for each other's exit
}

// The producer's metadata of one point from its location (x, y) and attention weight a.
// `query` < 0: an empty slot. A point that misses the level keeps weight a on every corner: its
// corners read zeros, so it adds a x 0 (NaN for a non-finite weight, as the reference does).
template <typename coord_t>
__device__ __forceinline__ WindowPoint<coord_t> point_geometry(int batch, int64_t num_keys, const LevelGeometry& g,
                                                               int query, coord_t x, coord_t y, coord_t a) {
  WindowPoint<coord_t> m;
  m.key = 0;
  m.valid = 0u;
  m.cell = -1;
  m.x0 = m.y0 = 0;
  m.ly = m.lx = coord_t(0);
  m.attention = query >= 0 ? a : coord_t(0);
  m.weight[0] = m.weight[1] = m.weight[2] = m.weight[3] = m.attention;
  if (query < 0) return m;
  const Bilinear<coord_t> bl = bilinear(x, y, g.height, g.width);
  if (!bl.valid) return m;
  m.valid = bl.valid;
  m.x0 = bl.x0;
  m.y0 = bl.y0;
  m.ly = bl.ly;
  m.lx = bl.lx;
  m.key = static_cast<int>(batch * num_keys + g.start + static_cast<int64_t>(bl.y0) * g.width + bl.x0);
#pragma unroll
  for (int c = 0; c < 4; ++c) m.weight[c] = a * bl.weight(c);
  return m;
}

// Bits (Corner order) of the corners of a point with top-left corner (x0, y0) that lie in the
// window of cols x rows cells at (wx0, wy0).
__device__ __forceinline__ unsigned corners_in_window(int x0, int y0, int wx0, int wy0, int cols, int rows) {
  const bool left = x0 >= wx0 && x0 < wx0 + cols, right = x0 + 1 >= wx0 && x0 + 1 < wx0 + cols;
  const bool top = y0 >= wy0 && y0 < wy0 + rows, bottom = y0 + 1 >= wy0 && y0 + 1 < wy0 + rows;
  return (top && left ? 1u : 0u) | (top && right ? 2u : 0u) | (bottom && left ? 4u : 0u) | (bottom && right ? 8u : 0u);
}

// What produce_stage runs between the window pass and its arrival: nothing, unless a kernel adds
// its own per-stage work (the gather backward's cell index).
struct NoStageWork {
  __device__ __forceinline__ void operator()(const Tile&, const StageWindow&, int) const {}
};

// One stage of the producer warp: metadata, window, `work(t, w, stage)`, TMA loads, arrival on
// full[stage]. Returns the stage's window (its header).
template <typename scalar_t, typename StageWork = NoStageWork>
__device__ __forceinline__ StageWindow produce_stage(
    const Problem<scalar_t>& p, const Ring<coord_type<scalar_t>>& ring, const CUtensorMap* map, const Tile& t,
    int level, int stage, StageWork work = {}) {
  using coord_t = coord_type<scalar_t>;
  const LaunchShape& s = *ring.s;
  const int lane = threadIdx.x & 31;
  const LevelGeometry g = level_geometry(p.spatial_shapes, p.level_start, level);
  WindowPoint<coord_t>* meta = ring.meta(stage);

  // Stage point i = slot * points + point; lane takes i = lane + 32 k, so a warp's loads of a
  // query's locations are contiguous. Each batch loads all its inputs before computing any.
  constexpr int kBatch = 8;
  const int n = s.slots * p.points;
  const float inv_points = 1.0f / static_cast<float>(p.points);  // exact slot = i / points for i < 2^20
  int min_x = INT_MAX, min_y = INT_MAX, max_x = INT_MIN, max_y = INT_MIN;
  for (int first = 0; first < n; first += 32 * kBatch) {
    coord_t x[kBatch], y[kBatch], a[kBatch];
    int query[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int i = first + 32 * k + lane;
      const int slot = static_cast<int>((static_cast<float>(i) + 0.5f) * inv_points);
      query[k] = i < n ? tile_query(t, s, slot, p.queries) : -1;
      x[k] = y[k] = a[k] = coord_t(0);
      if (query[k] >= 0) {
        const int64_t row = (static_cast<int64_t>(t.batch) * p.queries + query[k]) * p.heads + t.head;
        const int64_t at = (row * p.levels + level) * p.points + (i - slot * p.points);
        x[k] = p.locations[2 * at];
        y[k] = p.locations[2 * at + 1];
        a[k] = p.weights[at];
      }
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int i = first + 32 * k + lane;
      if (i >= n) break;
      const WindowPoint<coord_t> m = point_geometry(t.batch, p.num_keys, g, query[k], x[k], y[k], a[k]);
      meta[i] = m;
      if (m.valid) {  // the footprint of the corners inside the level
        min_x = min(min_x, max(m.x0, 0));
        max_x = max(max_x, min(m.x0 + 1, g.width - 1));
        min_y = min(min_y, max(m.y0, 0));
        max_y = max(max_y, min(m.y0 + 1, g.height - 1));
      }
    }
  }
  min_x = __reduce_min_sync(0xffffffffu, min_x);
  max_x = __reduce_max_sync(0xffffffffu, max_x);
  min_y = __reduce_min_sync(0xffffffffu, min_y);
  max_y = __reduce_max_sync(0xffffffffu, max_y);

  StageWindow w{0, 0, 0, g.width, g.height, 0};
  if (s.spread_role == SpreadRole::kBailWhereSpread) {
    w.spread = min_x <= max_x && static_cast<int64_t>(max_x - min_x + 1) * (max_y - min_y + 1) >
                                     4 * kMmaWindowSide * kMmaWindowSide;
  }
  int wx0 = 0, wy0 = 0;
  if (s.window_rows > 0 && min_x <= max_x) {
    wx0 = max_x - min_x < s.window_cols ? min_x : max(0, min(g.width - s.window_cols, (min_x + max_x + 1 - s.window_cols) / 2));
    wy0 = max_y - min_y < s.window_rows ? min_y : max(0, min(g.height - s.window_rows, (min_y + max_y + 1 - s.window_rows) / 2));
    w.rows = min(s.window_rows, max_y - wy0 + 1);
    w.cols = min(s.window_cols, g.width - wx0);
  }
  int inside = 0;
  if (w.rows > 0) {
    // A loaded window serves all four corners of its points. The MMA's accumulation window (not
    // loaded) also takes a point with corners outside the level, which it never adds: only its
    // level's corners need lie in the window. Its cell is then kMmaCellBias past the top-left one,
    // which may lie outside the window (a corner at x or y = -1).
    const int bias = s.load_window ? 0 : kMmaCellBias;
    for (int i = lane; i < n; i += 32) {
      WindowPoint<coord_t>& m = meta[i];
      const unsigned needed = s.load_window ? 0xFu : m.valid;
      const unsigned held = corners_in_window(m.x0, m.y0, wx0, wy0, w.cols, w.rows);
      if (m.valid != 0u && (m.valid & needed) == needed && (held & needed) == needed) {
        m.cell = (m.y0 - wy0) * s.window_cols + (m.x0 - wx0) + bias;
        ++inside;
      }
    }
    inside = __reduce_add_sync(0xffffffffu, inside);
    if (4 * inside < w.rows * w.cols) w.rows = 0;  // fewer corner reads than cells: L1 serves them better
  }
  w.key0 = static_cast<int>(static_cast<int64_t>(t.batch) * p.num_keys + g.start + static_cast<int64_t>(wy0) * g.width + wx0);
  if (lane == 0) *ring.header(stage) = w;
  work(t, w, stage);

  const bool load = s.load_window && w.rows > 0;
  const uint32_t bytes = load ? static_cast<uint32_t>(w.rows * s.window_cols * s.row_bytes) : 0u;
  if (lane == 0) {
    mbarrier_arrive_expect_tx(ring.full(stage), bytes);
  } else {
    mbarrier_arrive(ring.full(stage));
  }
  if (load) {
    __syncwarp();  // the expected bytes are posted before any box lands
    fence_proxy_async_shared();
    const int column = t.head * p.channels;
    for (int r = lane; r < w.rows; r += 32) {
      tma_load_2d(ring.window(stage) + r * s.window_cols * s.row_bytes, map, column, w.key0 + r * g.width, ring.full(stage));
    }
  }
  return w;
}

// Whether the producer stops after the stage at `at` (a kernel's hook): never, by default.
struct NeverStop {
  __device__ __forceinline__ bool operator()(const StageCursor&, const StageWindow&) const { return false; }
};

// The producer warp's whole life: every stage of every tile of this CTA, or until `stop`.
template <typename scalar_t, typename StageWork = NoStageWork, typename Stop = NeverStop>
__device__ __forceinline__ void run_producer(
    const Problem<scalar_t>& p, const Ring<coord_type<scalar_t>>& ring, const CUtensorMap* map, int groups,
    int num_tiles, StageWork work = {}, Stop stop = {}) {
  const LaunchShape& s = *ring.s;
  StageCursor at{static_cast<int>(blockIdx.x), 0, 0, 0u};
  Tile t{};
  while (at.tile < num_tiles) {
    if (at.level == 0) t = tile_at(p, s, groups, at.tile);
    if (at.round > 0) mbarrier_wait(ring.empty(at.stage), (at.round - 1) & 1u);
    const StageWindow w = produce_stage(p, ring, map, t, at.level, at.stage, work);
    if (stop(at, w)) return;
    at.advance(p.levels, s.stages);
  }
}

// A lane's view of the consumers: which team it is in and which bytes of a cell it moves.
struct ConsumerLane {
  int team;        // team index among all consumer teams of the CTA
  int teams;       // consumer teams in the CTA
  int lane;        // lane within the team
  int chunk_byte;  // this lane's first byte within a cell
};

__device__ __forceinline__ ConsumerLane consumer_lane(const LaunchShape& s) {
  const int warp = threadIdx.x / 32 - 1, lane = threadIdx.x & 31;
  const int per_warp = 32 / s.team;
  return ConsumerLane{warp * per_warp + lane / s.team, s.consumer_warps * per_warp, lane % s.team,
                      (lane % s.team) * s.chunk_bytes};
}

template <int BYTES>
struct Chunk;
template <>
struct Chunk<16> {
  uint32_t r[4];
};
template <>
struct Chunk<8> {
  uint32_t r[2];
};
template <>
struct Chunk<32> {  // the fp32 MMA backward's lanes (window_backward.cu)
  uint32_t r[8];
};

// A corner chunk: from shared memory (the window) when `from_window`, else from global memory
// (through L1) when `from_global`, else zeros. The zeros are set in registers: reading them from
// a zero block cost shared-memory wavefronts whenever a warp had a corner outside its level
// (ncu, H100, 2026-11-24: 30 % of the windowless forward's). Volatile: never moved above the
// wait that makes the stage visible.
template <int BYTES>
__device__ __forceinline__ Chunk<BYTES> load_corner(bool from_window, bool from_global, uint32_t shared_address,
                                                    const void* global) {
  Chunk<BYTES> c;
  if constexpr (BYTES == 16) {
    asm volatile(
        "{\n .reg .pred w, g;\n setp.ne.u32 w, %4, 0;\n setp.ne.u32 g, %5, 0;\n"
        " mov.b32 %0, 0;\n mov.b32 %1, 0;\n mov.b32 %2, 0;\n mov.b32 %3, 0;\n"
        " @w ld.shared.v4.u32 {%0, %1, %2, %3}, [%6];\n"
        " @g ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%7];\n}"
        : "=r"(c.r[0]), "=r"(c.r[1]), "=r"(c.r[2]), "=r"(c.r[3])
        : "r"(static_cast<uint32_t>(from_window)), "r"(static_cast<uint32_t>(from_global)), "r"(shared_address),
          "l"(global));
  } else {
    asm volatile(
        "{\n .reg .pred w, g;\n setp.ne.u32 w, %2, 0;\n setp.ne.u32 g, %3, 0;\n"
        " mov.b32 %0, 0;\n mov.b32 %1, 0;\n"
        " @w ld.shared.v2.u32 {%0, %1}, [%4];\n"
        " @g ld.global.nc.v2.u32 {%0, %1}, [%5];\n}"
        : "=r"(c.r[0]), "=r"(c.r[1])
        : "r"(static_cast<uint32_t>(from_window)), "r"(static_cast<uint32_t>(from_global)), "r"(shared_address),
          "l"(global));
  }
  return c;
}

// A corner chunk from global memory when `from_global`, else zeros (as load_corner).
template <int BYTES>
__device__ __forceinline__ Chunk<BYTES> load_global_corner(bool from_global, const void* global) {
  Chunk<BYTES> c;
  static_assert(BYTES == 16, "16-byte chunks");
  asm volatile(
      "{\n .reg .pred g;\n setp.ne.u32 g, %4, 0;\n"
      " mov.b32 %0, 0;\n mov.b32 %1, 0;\n mov.b32 %2, 0;\n mov.b32 %3, 0;\n"
      " @g ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%5];\n}"
      : "=r"(c.r[0]), "=r"(c.r[1]), "=r"(c.r[2]), "=r"(c.r[3])
      : "r"(static_cast<uint32_t>(from_global)), "l"(global));
  return c;
}

// A loaded chunk as accumulator values, straight from the registers (no reinterpretation through
// memory, which would put the chunk on the stack).
template <typename scalar_t, int VEC>
__device__ __forceinline__ void chunk_to_acc(const Chunk<VEC * static_cast<int>(sizeof(scalar_t))>& c,
                                             acc_type<scalar_t> (&out)[VEC]) {
  if constexpr (std::is_same_v<scalar_t, __half>) {
#pragma unroll
    for (int i = 0; i < VEC / 2; ++i) {
      const float2 f = __half22float2(__halves2half2(__ushort_as_half(static_cast<unsigned short>(c.r[i] & 0xFFFFu)),
                                                     __ushort_as_half(static_cast<unsigned short>(c.r[i] >> 16))));
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  } else if constexpr (std::is_same_v<scalar_t, __nv_bfloat16>) {
#pragma unroll
    for (int i = 0; i < VEC / 2; ++i) {  // a bfloat16 is the upper half of a float
      out[2 * i] = __uint_as_float(c.r[i] << 16);
      out[2 * i + 1] = __uint_as_float(c.r[i] & 0xFFFF0000u);
    }
  } else if constexpr (std::is_same_v<scalar_t, float>) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] = __uint_as_float(c.r[i]);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] = __hiloint2double(static_cast<int>(c.r[2 * i + 1]), static_cast<int>(c.r[2 * i]));
  }
}

// The four corners of a point for this lane, as loaded.
template <int BYTES>
struct PointCorners {
  Chunk<BYTES> corner[4];  // Corner order
};

// Issues this lane's four corner loads of a point. Window points read the window; the others
// read global memory, and their corners outside the level (all four for a point that misses it)
// are zeros.
template <typename scalar_t, int VEC>
__device__ __forceinline__ PointCorners<VEC * static_cast<int>(sizeof(scalar_t))> load_point(
    const WindowPoint<coord_type<scalar_t>>& m, bool windowed, uint32_t window, const LaunchShape& s,
    const ConsumerLane& cl, const scalar_t* lane_value, int64_t key_stride, int64_t row_stride) {
  constexpr int kBytes = VEC * static_cast<int>(sizeof(scalar_t));
  const bool in_window = windowed && m.cell >= 0;
  const uint32_t base = window + static_cast<uint32_t>(m.cell * s.row_bytes) + cl.chunk_byte;
  const unsigned from_global = in_window ? 0u : m.valid;
  const scalar_t* corner = lane_value + static_cast<int64_t>(m.key) * key_stride;
  const uint32_t down = static_cast<uint32_t>(s.window_cols * s.row_bytes), right = static_cast<uint32_t>(s.row_bytes);
  PointCorners<kBytes> c;
  c.corner[kTopLeft] = load_corner<kBytes>(in_window, from_global & 1u, base, corner);
  c.corner[kTopRight] = load_corner<kBytes>(in_window, from_global & 2u, base + right, corner + key_stride);
  c.corner[kBottomLeft] = load_corner<kBytes>(in_window, from_global & 4u, base + down, corner + row_stride);
  c.corner[kBottomRight] =
      load_corner<kBytes>(in_window, from_global & 8u, base + down + right, corner + row_stride + key_stride);
  return c;
}

// Calls use(corner, values) for each loaded corner, converted to accumulator values only when
// it is used (fewer live registers).
template <typename scalar_t, int VEC, typename Use>
__device__ __forceinline__ void use_corners(const PointCorners<VEC * static_cast<int>(sizeof(scalar_t))>& c, Use&& use) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    acc_type<scalar_t> v[VEC];
    chunk_to_acc<scalar_t, VEC>(c.corner[k], v);
    use(k, v);
  }
}

#endif  // MMDEFORM_TMA_HOPPER_DEVICE

}  // namespace window
}  // namespace hopper
}  // namespace mmdeform_tma
