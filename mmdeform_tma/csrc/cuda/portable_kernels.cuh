// The portable (sm_80+) kernels: one team of lanes per (batch, query, head) item, 16-byte vector
// gathers of the four corners straight from global memory, fp32 accumulation.
#pragma once

#include <type_traits>

#include "../common/device_utils.cuh"
#include "../common/grad_accumulation.cuh"
#include "team_layout.h"

namespace mmdeform_tma {
namespace portable {

constexpr int kMaxThreads = 256;

// Calls fn(integral_constant<VEC>, integral_constant<NV>) for the layout's compiled shape.
template <typename scalar_t, typename Fn>
void with_vector_shape(const TeamLayout& layout, Fn&& fn) {
  constexpr int kVec16 = 16 / static_cast<int>(sizeof(scalar_t));
  using std::integral_constant;
  switch (layout.config.vec) {
    case VecKind::k16Bytes:
      switch (layout.config.nv) {
        case 1:
          return fn(integral_constant<int, kVec16>{}, integral_constant<int, 1>{});
        case 2:
          return fn(integral_constant<int, kVec16>{}, integral_constant<int, 2>{});
        default:
          return fn(integral_constant<int, kVec16>{}, integral_constant<int, 4>{});
      }
    case VecKind::k8Bytes:
      return fn(integral_constant<int, 8 / static_cast<int>(sizeof(scalar_t))>{}, integral_constant<int, 1>{});
    case VecKind::kPair:
      return fn(integral_constant<int, 2>{}, integral_constant<int, 4>{});
    default:
      return fn(integral_constant<int, 1>{}, integral_constant<int, 8>{});
  }
}

// Where an item's data lives. Threads enumerate items in query-major order ((b, q, h), the
// tensors' own order) or head-major order ((b, h, q): neighbouring teams sample neighbouring
// places of one head's value, which the L1 cache rewards).
struct ItemAddress {
  int64_t row;           // (b * queries + q) * heads + h: indexes locations, weights and output
  int64_t value_offset;  // element offset of (batch b, key 0, head h, channel 0) in value
  int64_t key_stride;    // elements between consecutive keys (heads * channels)
};

template <typename scalar_t>
__device__ __forceinline__ ItemAddress item_address(const Problem<scalar_t>& p, int b, int q, int h) {
  const int64_t key_stride = static_cast<int64_t>(p.heads) * p.channels;
  return ItemAddress{(static_cast<int64_t>(b) * p.queries + q) * p.heads + h,
                     static_cast<int64_t>(b) * p.num_keys * key_stride + static_cast<int64_t>(h) * p.channels, key_stride};
}

template <typename scalar_t>
__device__ __forceinline__ ItemAddress item_address(const Problem<scalar_t>& p, int item, bool head_major) {
  int b, q, h;  // 32-bit: items < 2^31 (checked on the host)
  if (head_major) {
    q = item % p.queries;
    const int bh = item / p.queries;
    h = bh % p.heads;
    b = bh / p.heads;
  } else {
    h = item % p.heads;
    const int bq = item / p.heads;
    q = bq % p.queries;
    b = bq / p.queries;
  }
  return item_address(p, b, q, h);
}

template <typename scalar_t, int VEC, int NV>
__global__ void __launch_bounds__(kMaxThreads, 1)
    forward_kernel(const Problem<scalar_t> p, scalar_t* __restrict__ output, const int team_log2, const bool head_major) {
  using coord_t = coord_type<scalar_t>;
  using acc_t = acc_type<scalar_t>;
  const int team = 1 << team_log2;
  const int lane = threadIdx.x & (team - 1);
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if ((thread >> team_log2) >= p.num_items) return;
  const int item = static_cast<int>(thread >> team_log2);

  // Vector j of this lane starts at channel (j * team + lane) * VEC = first_channel + j * channel_step.
  const int first_channel = lane * VEC, channel_step = team * VEC;
  const ItemAddress addr = item_address(p, item, head_major);
  scalar_t* out = output + addr.row * p.channels;

  acc_t acc[NV][VEC];
#pragma unroll
  for (int j = 0; j < NV; ++j)
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[j][k] = acc_t(0);

  if (level_geometry_ok(p.spatial_shapes, p.level_start, p.levels, p.num_keys)) {
    const coord_t* loc = p.locations + addr.row * p.levels * p.points * 2;
    const coord_t* attn = p.weights + addr.row * p.levels * p.points;
    for (int l = 0; l < p.levels; ++l) {
      const LevelGeometry g = level_geometry(p.spatial_shapes, p.level_start, l);
      const scalar_t* level_value = p.value + addr.value_offset + g.start * addr.key_stride;
      const int64_t row_stride = static_cast<int64_t>(g.width) * addr.key_stride;
#pragma unroll 2
      for (int pt = 0; pt < p.points; ++pt) {
        const int idx = l * p.points + pt;
        const coord_t a = attn[idx];
        const Bilinear<coord_t> bl = bilinear(loc[2 * idx], loc[2 * idx + 1], g.height, g.width);
        if (!bl.valid) {  // the sample is zero; attention x 0 still carries a NaN / Inf weight
          const acc_t poison = static_cast<acc_t>(a) * acc_t(0);
#pragma unroll
          for (int j = 0; j < NV; ++j)
#pragma unroll
            for (int k = 0; k < VEC; ++k) acc[j][k] += poison;
          continue;
        }
        const scalar_t* corner00 = level_value + (static_cast<int64_t>(bl.y0) * g.width + bl.x0) * addr.key_stride;
        // All loads first (up to 4 x NV in flight), raw; converted next to their FMAs.
        Vec<scalar_t, VEC> raw[4][NV];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const scalar_t* corner = corner00 + ((c & 2) ? row_stride : 0) + ((c & 1) ? addr.key_stride : 0);
#pragma unroll
          for (int j = 0; j < NV; ++j) {
            const int ch = first_channel + j * channel_step;
            raw[c][j] = (bl.valid & (1u << c)) && ch < p.channels ? load_vec<scalar_t, VEC>(corner + ch)
                                                                 : Vec<scalar_t, VEC>{};
          }
        }
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const acc_t w = static_cast<acc_t>(a * bl.weight(c));
#pragma unroll
          for (int j = 0; j < NV; ++j) {
            acc_t v[VEC];
            to_acc(raw[c][j], v);
#pragma unroll
            for (int k = 0; k < VEC; ++k) acc[j][k] = fma(w, v[k], acc[j][k]);
          }
        }
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < NV; ++j)
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc[j][k] = quiet_nan<acc_t>();
  }
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int ch = first_channel + j * channel_step;
    if (ch < p.channels) store_vec(out + ch, from_acc_vec<scalar_t, VEC>(acc[j]));
  }
}

// Gradients of the item at `addr`, by its team of `team` lanes (`mask` its lanes in the warp; every
// lane of the team calls this). grad_locations / grad_weights are written for every (level, point);
// value gradients go to `sink`. The caller checks the level geometry.
template <typename scalar_t, int VEC, int NV, typename Sink>
__device__ __forceinline__ void backward_item(const Problem<scalar_t>& p,
                                              const scalar_t* __restrict__ grad_output,
                                              const Sink& sink,
                                              coord_type<scalar_t>* __restrict__ grad_locations,
                                              coord_type<scalar_t>* __restrict__ grad_weights,
                                              const ItemAddress& addr,
                                              const int lane,
                                              const int team,
                                              const unsigned mask) {
  using coord_t = coord_type<scalar_t>;
  using acc_t = acc_type<scalar_t>;
  coord_t* g_loc = grad_locations + addr.row * p.levels * p.points * 2;
  coord_t* g_attn = grad_weights + addr.row * p.levels * p.points;
  const int first_channel = lane * VEC, channel_step = team * VEC;
  acc_t go[NV][VEC];
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int ch = first_channel + j * channel_step;
    if (ch < p.channels) {
      to_acc(load_vec<scalar_t, VEC>(grad_output + addr.row * p.channels + ch), go[j]);
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) go[j][k] = acc_t(0);
    }
  }

  const coord_t* loc = p.locations + addr.row * p.levels * p.points * 2;
  const coord_t* attn = p.weights + addr.row * p.levels * p.points;
  for (int l = 0; l < p.levels; ++l) {
    const LevelGeometry g = level_geometry(p.spatial_shapes, p.level_start, l);
    const int64_t level_offset = addr.value_offset + g.start * addr.key_stride;
    const int64_t row_stride = static_cast<int64_t>(g.width) * addr.key_stride;
    for (int pt = 0; pt < p.points; ++pt) {
      const int idx = l * p.points + pt;
      const coord_t a = attn[idx];
      const Bilinear<coord_t> bl = bilinear(loc[2 * idx], loc[2 * idx + 1], g.height, g.width);
      if (!bl.valid) {  // the same for the whole team: no shuffle is skipped by part of it
        if (lane == 0) {
          g_attn[idx] = coord_t(0);
          g_loc[2 * idx] = g_loc[2 * idx + 1] = coord_t(0);
        }
        continue;
      }
      const int64_t offset00 = level_offset + (static_cast<int64_t>(bl.y0) * g.width + bl.x0) * addr.key_stride;
      acc_t dot[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        dot[c] = acc_t(0);
        const int64_t corner = offset00 + ((c & 2) ? row_stride : 0) + ((c & 1) ? addr.key_stride : 0);
        const acc_t w = static_cast<acc_t>(a * bl.weight(c));
#pragma unroll
        for (int j = 0; j < NV; ++j) {
          const int ch = first_channel + j * channel_step;
          if (!(bl.valid & (1u << c)) || ch >= p.channels) continue;
          acc_t v[VEC], contribution[VEC];
          to_acc(load_vec<scalar_t, VEC>(p.value + corner + ch), v);
#pragma unroll
          for (int k = 0; k < VEC; ++k) {
            dot[c] = fma(go[j][k], v[k], dot[c]);
            contribution[k] = w * go[j][k];
          }
          sink.add(corner + ch, contribution);
        }
      }
      const CornerDotGradients<acc_t> grads = team_corner_dot_gradients(bl, dot, mask, team);
      if (lane == 0) {
        g_attn[idx] = grads.attention;
        g_loc[2 * idx] = a * coord_t(g.width) * grads.x;
        g_loc[2 * idx + 1] = a * coord_t(g.height) * grads.y;
      }
    }
  }
}

// NaN location and attention gradients of the item at `addr` (its level geometry is inconsistent).
template <typename scalar_t>
__device__ __forceinline__ void poison_item(const Problem<scalar_t>& p, coord_type<scalar_t>* grad_locations,
                                            coord_type<scalar_t>* grad_weights, const ItemAddress& addr, int lane,
                                            int team) {
  using coord_t = coord_type<scalar_t>;
  coord_t* g_loc = grad_locations + addr.row * p.levels * p.points * 2;
  coord_t* g_attn = grad_weights + addr.row * p.levels * p.points;
  for (int i = lane; i < p.levels * p.points; i += team) {
    g_attn[i] = quiet_nan<coord_t>();
    g_loc[2 * i] = g_loc[2 * i + 1] = quiet_nan<coord_t>();
  }
}

// Gradients of one item per team.
template <typename scalar_t, int VEC, int NV, typename Sink>
__global__ void __launch_bounds__(kMaxThreads, 1) backward_kernel(
    const Problem<scalar_t> p,
    const scalar_t* __restrict__ grad_output,
    Sink sink,
    coord_type<scalar_t>* __restrict__ grad_locations,
    coord_type<scalar_t>* __restrict__ grad_weights,
    const int team_log2,
    const bool head_major) {
  const int team = 1 << team_log2;
  const int lane = threadIdx.x & (team - 1);
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if ((thread >> team_log2) >= p.num_items) return;
  const ItemAddress addr = item_address(p, static_cast<int>(thread >> team_log2), head_major);
  if (!level_geometry_ok(p.spatial_shapes, p.level_start, p.levels, p.num_keys)) {
    poison_item(p, grad_locations, grad_weights, addr, lane, team);
    return;
  }
  sink.prepare();
  backward_item<scalar_t, VEC, NV>(p, grad_output, sink, grad_locations, grad_weights, addr, lane, team,
                                   team_mask(team));
}

}  // namespace portable
}  // namespace mmdeform_tma
