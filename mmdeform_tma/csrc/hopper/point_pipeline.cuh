// What the two Hopper backends share: the per-point metadata a producer writes to shared memory,
// the TMA loads of a point's corners, and the consumer-side math of one point.
//
// Team layout: one item (batch, query, head) per team of 2 x (channels x elsize / chunk) lanes. The
// left half of the team reads the left corner column (x0), the right half the right one (x0 + 1),
// one chunk of 16 or 8 bytes per lane, so a team reads its box as one contiguous run: 8 lanes
// (16-byte chunks) or 16 lanes (8-byte chunks) cover 128 bytes, one conflict-free shared-memory
// wavefront when boxes fill their 128-byte slots (rows of 64 bytes or more). A point's corners
// arrive as two boxes, one per row (y0, y0+1), each holding the two horizontally adjacent keys of
// that row. The chunk size only changes how consumers read a box: boxes, slots and the producers'
// work are the same for both.
#pragma once

#include <type_traits>

#include "../common/device_utils.cuh"
#include "../common/grad_accumulation.cuh"
#include "backward_chunk.h"
#include "tma_primitives.cuh"

namespace mmdeform_tma {
namespace hopper {

template <typename coord_t>
struct alignas(16) PointMeta {
  coord_t weight[4];  // attention x bilinear weight per corner; 0 outside the level
  coord_t ly, lx;     // bilinear fractions (backward)
  coord_t attention;  // (backward)
  int key;            // row of the top-left corner in value viewed as [batch * num_keys, heads * channels]
  int width, height;  // level size
  unsigned valid;     // corner bits (Corner order); 0: the point misses the level
};

// Sizes of the team layout; channels x elsize is 16, 32, 64, 128 or 256 bytes (checked on the host),
// and row_bytes / chunk_bytes x 2 lanes fit a warp (backward_chunk_bytes).
struct TeamShape {
  int row_bytes;        // one corner: channels x elsize
  int chunk_lanes;      // lanes per corner column: row_bytes / chunk bytes
  int team;             // lanes per item
  int items_per_warp;   // 32 / team
  int box_bytes;        // one TMA box: 2 keys of one head
  int slot_bytes;       // a box's place in shared memory, 128-byte aligned
};

__host__ __device__ inline TeamShape team_shape(int channels, int element_size, int chunk_bytes) {
  TeamShape s;
  s.row_bytes = channels * element_size;
  s.chunk_lanes = s.row_bytes / chunk_bytes;
  s.team = 2 * s.chunk_lanes;
  s.items_per_warp = 32 / s.team;
  s.box_bytes = 2 * s.row_bytes;
  s.slot_bytes = s.box_bytes < 128 ? 128 : s.box_bytes;
  return s;
}

// A lane's place in its team.
struct LaneRole {
  int group;   // which of the warp's items
  int lane;    // lane within the team
  int column;  // 0: left corners (x0), 1: right corners (x0 + 1)
  int chunk;   // which chunk of the channels
  bool active;
};

__device__ __forceinline__ LaneRole lane_role(const TeamShape& s) {
  const int warp_lane = threadIdx.x & 31;
  LaneRole r;
  r.group = warp_lane / s.team;
  r.lane = warp_lane % s.team;
  r.column = r.lane / s.chunk_lanes;
  r.chunk = r.lane % s.chunk_lanes;
  r.active = r.group < s.items_per_warp;
  return r;
}

#if MMDEFORM_TMA_HOPPER_DEVICE

// The producer's work for one (item, point): sampling geometry and weights. `point` runs over
// levels x points. An item past the end gives an empty (valid == 0) point.
template <typename scalar_t>
__device__ __forceinline__ PointMeta<coord_type<scalar_t>> point_meta(const Problem<scalar_t>& p, int item, int point) {
  using coord_t = coord_type<scalar_t>;
  PointMeta<coord_t> m;
  m.valid = 0u;
  m.key = 0;
  m.width = m.height = 0;
  m.ly = m.lx = m.attention = coord_t(0);
  m.weight[0] = m.weight[1] = m.weight[2] = m.weight[3] = coord_t(0);
  if (item >= p.num_items) return m;
  const int level = point / p.points;
  const int64_t base = static_cast<int64_t>(item) * p.levels * p.points + point;
  const coord_t a = p.weights[base];
  const LevelGeometry g = level_geometry(p.spatial_shapes, p.level_start, level);
  const Bilinear<coord_t> bl = bilinear(p.locations[2 * base], p.locations[2 * base + 1], g.height, g.width);
  m.width = g.width;
  m.height = g.height;
  m.attention = a;
  if (!bl.valid) return m;
  const int batch = item / (p.heads * p.queries);
  m.valid = bl.valid;
  m.ly = bl.ly;
  m.lx = bl.lx;
  m.key = static_cast<int>(static_cast<int64_t>(batch) * p.num_keys + g.start + static_cast<int64_t>(bl.y0) * g.width + bl.x0);
#pragma unroll
  for (int c = 0; c < 4; ++c) m.weight[c] = (bl.valid & (1u << c)) ? a * bl.weight(c) : coord_t(0);
  return m;
}

// Bytes the point's loads will deliver: one box per row that holds a valid corner.
template <typename coord_t>
__device__ __forceinline__ uint32_t point_load_bytes(const PointMeta<coord_t>& m, const TeamShape& s) {
  return (((m.valid & 3u) ? 1u : 0u) + ((m.valid & 12u) ? 1u : 0u)) * static_cast<uint32_t>(s.box_bytes);
}

template <typename coord_t>
__device__ __forceinline__ void issue_point_loads(
    const PointMeta<coord_t>& m, const CUtensorMap* map, int head, int channels, char* row0_slot, char* row1_slot,
    uint64_t* bar) {
  const int column = head * channels;
  if (m.valid & 3u) tma_load_2d(row0_slot, map, column, m.key, bar);
  if (m.valid & 12u) tma_load_2d(row1_slot, map, column, m.key + m.width, bar);
}

// This lane's chunk (VEC elements) of its column's two corners, zeroed where the corner is outside
// the level (the slot then holds stale or foreign data, which may even be non-finite).
template <typename scalar_t, int VEC>
__device__ __forceinline__ void load_lane_corners(
    const PointMeta<coord_type<scalar_t>>& m, const char* row0_slot, const char* row1_slot, const LaneRole& r,
    const TeamShape& s, Vec<scalar_t, VEC>& top, Vec<scalar_t, VEC>& bottom) {
  const int offset = r.column * s.row_bytes + r.chunk * static_cast<int>(VEC * sizeof(scalar_t));
  top = load_shared_vec<scalar_t, VEC>(reinterpret_cast<const scalar_t*>(row0_slot + offset));
  bottom = load_shared_vec<scalar_t, VEC>(reinterpret_cast<const scalar_t*>(row1_slot + offset));
  if (m.valid != 0xFu) {
    if (!(m.valid & (1u << r.column))) top = Vec<scalar_t, VEC>{};
    if (!(m.valid & (4u << r.column))) bottom = Vec<scalar_t, VEC>{};
  }
}

template <typename scalar_t, int VEC>
__device__ __forceinline__ void accumulate_point(
    const PointMeta<coord_type<scalar_t>>& m, const char* row0_slot, const char* row1_slot, const LaneRole& r,
    const TeamShape& s, acc_type<scalar_t> (&acc)[VEC]) {
  using acc_t = acc_type<scalar_t>;
  if (!m.valid) {  // the sample is zero; attention x 0 still carries a NaN / Inf weight
    const acc_t poison = static_cast<acc_t>(m.attention) * acc_t(0);
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] += poison;
    return;
  }
  Vec<scalar_t, VEC> top, bottom;
  load_lane_corners<scalar_t, VEC>(m, row0_slot, row1_slot, r, s, top, bottom);
  const acc_t w_top = m.weight[r.column], w_bottom = m.weight[2 + r.column];
  acc_t v[VEC];
  to_acc(top, v);
#pragma unroll
  for (int k = 0; k < VEC; ++k) acc[k] = fma(w_top, v[k], acc[k]);
  to_acc(bottom, v);
#pragma unroll
  for (int k = 0; k < VEC; ++k) acc[k] = fma(w_bottom, v[k], acc[k]);
}

// Left and right halves of a team hold partial sums of the same channels: add them, and let the
// left half store the item's output chunk.
template <typename scalar_t, int VEC>
__device__ __forceinline__ void store_item_output(
    acc_type<scalar_t> (&acc)[VEC], const LaneRole& r, const TeamShape& s, bool item_valid, scalar_t* out_item) {
#pragma unroll
  for (int k = 0; k < VEC; ++k) acc[k] += __shfl_down_sync(0xffffffffu, acc[k], s.chunk_lanes);
  if (r.active && item_valid && r.column == 0) {
    store_vec(out_item + r.chunk * VEC, from_acc_vec<scalar_t, VEC>(acc));
  }
#pragma unroll
  for (int k = 0; k < VEC; ++k) acc[k] = acc_type<scalar_t>(0);
}

// Backward of one point for this lane: value-gradient contributions of its two corners go to the
// sink; the partial sums of d/d(attention), d/dx, d/dy over its channels are returned.
template <typename scalar_t, int VEC, typename Sink>
__device__ __forceinline__ void backward_point(
    const PointMeta<coord_type<scalar_t>>& m, const char* row0_slot, const char* row1_slot, const LaneRole& r,
    const TeamShape& s, const acc_type<scalar_t> (&go)[VEC], int64_t head_offset, int heads, int channels,
    const Sink& sink, acc_type<scalar_t>& grad_a, acc_type<scalar_t>& grad_x, acc_type<scalar_t>& grad_y) {
  using acc_t = acc_type<scalar_t>;
  grad_a = grad_x = grad_y = acc_t(0);
  if (!m.valid) return;
  Vec<scalar_t, VEC> corner[2];
  load_lane_corners<scalar_t, VEC>(m, row0_slot, row1_slot, r, s, corner[0], corner[1]);
  const acc_t ly = m.ly, lx = m.lx;
  const acc_t wx = r.column ? lx : acc_t(1) - lx;      // this column's horizontal weight
  const acc_t sx = r.column ? acc_t(1) : acc_t(-1);    // d(wx)/dx
#pragma unroll
  for (int row = 0; row < 2; ++row) {
    const unsigned bit = 1u << (2 * row + r.column);
    if (!(m.valid & bit)) continue;
    acc_t v[VEC], contribution[VEC];
    to_acc(corner[row], v);
    acc_t dot = acc_t(0);
    const acc_t w = m.weight[2 * row + r.column];
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      dot = fma(go[k], v[k], dot);
      contribution[k] = w * go[k];
    }
    const int64_t key = static_cast<int64_t>(m.key) + row * m.width + r.column;
    sink.add((key * heads) * channels + head_offset + r.chunk * VEC, contribution);
    const acc_t wy = row ? ly : acc_t(1) - ly;
    const acc_t sy = row ? acc_t(1) : acc_t(-1);
    grad_a = fma(wy * wx, dot, grad_a);
    grad_x = fma(sx * wy, dot, grad_x);
    grad_y = fma(sy * wx, dot, grad_y);
  }
}

// Team-wide sums of the three partials; lane 0 of the team writes the point's gradients.
template <typename coord_t, typename acc_t>
__device__ __forceinline__ void store_point_gradients(
    const PointMeta<coord_t>& m, acc_t grad_a, acc_t grad_x, acc_t grad_y, const LaneRole& r, const TeamShape& s,
    bool item_valid, coord_t* grad_locations, coord_t* grad_weights) {
  for (int offset = s.team >> 1; offset > 0; offset >>= 1) {
    grad_a += __shfl_xor_sync(0xffffffffu, grad_a, offset);
    grad_x += __shfl_xor_sync(0xffffffffu, grad_x, offset);
    grad_y += __shfl_xor_sync(0xffffffffu, grad_y, offset);
  }
  if (r.active && item_valid && r.lane == 0) {
    *grad_weights = grad_a;
    grad_locations[0] = m.attention * coord_t(m.width) * grad_x;
    grad_locations[1] = m.attention * coord_t(m.height) * grad_y;
  }
}

#endif  // MMDEFORM_TMA_HOPPER_DEVICE

// Forward kernels take no value-gradient sink.
struct NoSink {
  __device__ __forceinline__ void prepare() {}
};

}  // namespace hopper
}  // namespace mmdeform_tma
