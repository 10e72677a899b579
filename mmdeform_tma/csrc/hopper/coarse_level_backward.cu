// The deterministic `tma_ws` backward's value gradient on the coarse levels (see the header).
//
// A CTA takes one (batch, head), one coarse level, one window of 256 consecutive keys of that level
// and a run of queries. Per group of 32 queries its teams of four lanes (one lane per corner) write
// each point's corner weights that fall in the window into A (32 slots x 256 cells, hi + lo 16-bit
// parts, as the window kernel's A), and stage the group's output-gradient rows; each warp then adds
// A^T G for its m-tiles (16 consecutive keys) into accumulators that live across the whole run.
// The run ends with one fixed-point flush of the window (flush_fixed_point_row). Every point of the
// run's queries is read by each window of its level; a corner belongs to exactly one window.
// Corners of non-finite output-gradient rows and of weights beyond |1| take the sink directly, as in
// the window kernel, so A and G stay finite. The order of the fp32 sums depends only on the launch,
// and the fixed-point additions are associative: the result is bitwise reproducible.
#include "coarse_level_backward.h"

#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <type_traits>

#include "../common/cuda_runtime_utils.h"
#include "../common/device_utils.cuh"
#include "fixed_point_flush.cuh"
#include "mma_fragments.cuh"
#include "tensor_map.h"
#include "tma_primitives.cuh"

namespace mmdeform_tma {
namespace tma_ws {
namespace {

using namespace hopper;

constexpr int kWarps = 4;
constexpr int kSlots = 32;                          // queries per group: two k-steps of the MMA
constexpr int kWindowKeys = 256;                    // 16 m-tiles of 16 consecutive keys
constexpr int kTilesPerWarp = kWindowKeys / 16 / kWarps;
constexpr int kMaxWindows = kCoarseLevelKeys / kWindowKeys;
constexpr int kChannels = 32;
constexpr int kPrefetchPoints = 4;  // DETR, DINO, Mask2Former: 4 points a level
constexpr int kAStride = 2 * kWindowKeys + 16;      // bytes per slot; 16 of padding: ldmatrix rows in distinct banks
constexpr int kABytes = kSlots * kAStride;
constexpr int kGStride = 2 * kChannels + 16;
constexpr int kGBytes = kSlots * kGStride;
constexpr int kFlushRowBytes = 16 * kFixedPointBoxColumns * 8;  // one m-tile's sums in fixed point
static_assert(kWarps * kFlushRowBytes <= 2 * kABytes, "the flush stages in A's bytes");
static_assert(kChannels == kFixedPointBoxColumns, "a box row is a head's channels");

// CTAs per (batch, head) and level window: enough runs for about four CTAs per SM.
constexpr int kCtasPerSm = 4;

#if MMDEFORM_TMA_HOPPER_DEVICE

template <typename scalar_t>
__device__ __forceinline__ void add_weight(uint32_t a_hi, int slot, int cell, float weight) {
  using mma_t = scalar_t;  // fp16 or bf16 operands
  const uint32_t hi = a_hi + static_cast<uint32_t>(slot * kAStride + 2 * cell), lo = hi + kABytes;
  const SplitWeight<mma_t> sum =
      split_weight<mma_t>(static_cast<float>(ld_shared_16<mma_t>(hi)) + static_cast<float>(ld_shared_16<mma_t>(lo)) + weight);
  st_shared_16(hi, sum.hi);
  st_shared_16(lo, sum.lo);
}

// 8 channels of a 16-byte chunk of the row, as floats.
template <typename scalar_t>
__device__ __forceinline__ void chunk_values(uint4 chunk, float (&v)[8]) {
  const uint32_t r[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<scalar_t, __half>) {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&r[i]));
      v[2 * i] = f.x;
      v[2 * i + 1] = f.y;
    } else {
      v[2 * i] = __uint_as_float(r[i] << 16);
      v[2 * i + 1] = __uint_as_float(r[i] & 0xFFFF0000u);
    }
  }
}

#endif  // MMDEFORM_TMA_HOPPER_DEVICE

// grid: x = (batch x heads) x runs, y = levels x kMaxWindows.
template <typename scalar_t, typename Sink>
__global__ void __launch_bounds__(32 * kWarps, 3) coarse_level_kernel(const __grid_constant__ CUtensorMap flush_map,
                                                                   const __grid_constant__ Problem<scalar_t> p,
                                                                   const scalar_t* __restrict__ grad_output, Sink sink,
                                                                   int run_queries, int runs, float weight_scale) {
#if MMDEFORM_TMA_HOPPER_DEVICE
  using mma_t = scalar_t;  // fp16 or bf16 operands
  __shared__ __align__(1024) char smem[2 * kABytes + kGBytes];
  __shared__ unsigned touched_tiles[2];  // per group parity: bit i, m-tile i holds a weight

  const int level = static_cast<int>(blockIdx.y) / kMaxWindows, window = static_cast<int>(blockIdx.y) % kMaxWindows;
  if (level >= p.levels) return;
  const LevelGeometry g = level_geometry(p.spatial_shapes, p.level_start, level);
  const int64_t level_keys = static_cast<int64_t>(g.height) * g.width;
  const int first_cell = window * kWindowKeys;  // the window's first key within the level
  if (level_keys > kCoarseLevelKeys || first_cell >= level_keys) return;  // most CTAs of the grid: at once
  if (!block_level_geometry_ok(p.spatial_shapes, p.level_start, p.levels, p.num_keys)) return;  // the window kernel poisons
  const int run = static_cast<int>(blockIdx.x) % runs, pair = static_cast<int>(blockIdx.x) / runs;
  const int head = pair % p.heads, batch = pair / p.heads;
  const int q_begin = run * run_queries, q_end = min(p.queries, q_begin + run_queries);
  if (q_begin >= q_end) return;

  const uint32_t a_hi = smem_address(smem), a_lo = a_hi + kABytes, rows = a_hi + 2 * kABytes;
  for (int i = threadIdx.x * 16; i < 2 * kABytes; i += blockDim.x * 16) st_shared_v4(a_hi + i, make_uint4(0u, 0u, 0u, 0u));
  if (threadIdx.x < 2) touched_tiles[threadIdx.x] = 0u;
  sink.prepare();
  __syncthreads();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int slot = threadIdx.x >> 2, corner = threadIdx.x & 3;
  const int64_t key_stride = static_cast<int64_t>(p.heads) * kChannels;
  const int64_t head_column = static_cast<int64_t>(head) * kChannels;
  const int64_t level_key0 = static_cast<int64_t>(batch) * p.num_keys + g.start;  // value-map row of the level's key 0
  // ldmatrix rows of this lane: A^T's (slot, cell), G's (slot, channel), as the window kernel's.
  const int a_slot = (lane & 7) + ((lane >> 4) << 3), a_cell = ((lane >> 3) & 1) * 8;
  const int b_slot = (lane & 7) + (((lane >> 3) & 1) << 3), b_channel = (lane >> 4) * 8;

  // A lane's inputs of a group: its 16 bytes of the slot's row (as two 8-byte loads: rows need only
  // be 8-byte aligned) and the first kPrefetchPoints points. The next group's are loaded while this
  // one is summed: a group's loads otherwise stood between every two groups of a CTA.
  struct Inputs {
    uint2 lo, hi;
    float x[kPrefetchPoints], y[kPrefetchPoints], a[kPrefetchPoints];
  };
  const auto row_of = [&](int query) {
    return (static_cast<int64_t>(batch) * p.queries + query) * p.heads + head;
  };
  const auto load_inputs = [&](int q0) {
    Inputs in{};
    const int query = q0 + slot;
    if (query < q_end) {
      const int64_t row = row_of(query);
      const uint2* chunk = reinterpret_cast<const uint2*>(grad_output + row * kChannels + 8 * corner);
      in.lo = __ldg(chunk);
      in.hi = __ldg(chunk + 1);
      const int64_t first_point = (row * p.levels + level) * p.points;
#pragma unroll
      for (int i = 0; i < kPrefetchPoints; ++i) {
        if (i < p.points) {
          in.x[i] = __ldg(p.locations + 2 * (first_point + i));
          in.y[i] = __ldg(p.locations + 2 * (first_point + i) + 1);
          in.a[i] = __ldg(p.weights + first_point + i);
        }
      }
    }
    return in;
  };

  float d[kTilesPerWarp][4][4] = {};
  unsigned flushed_tiles = 0u;  // m-tiles that ever held a weight
  int parity = 0;
  Inputs next = load_inputs(q_begin);
  for (int q0 = q_begin; q0 < q_end; q0 += kSlots, parity ^= 1) {
    const Inputs in = next;
    if (q0 + kSlots < q_end) next = load_inputs(q0 + kSlots);
    // Points: lane `corner` of the slot's team adds that corner of each point in turn.
    const int query = q0 + slot;
    const bool live = query < q_end;
    const int64_t row = row_of(live ? query : q_begin);
    const uint4 chunk = make_uint4(in.lo.x, in.lo.y, in.hi.x, in.hi.y);
    float v[8];
    chunk_values<scalar_t>(chunk, v);
    bool finite = live;
#pragma unroll
    for (int i = 0; i < 8; ++i) finite = finite && isfinite(v[i]);
    const bool finite_row = warp_team_all(finite, 4);
    st_shared_v4(rows + static_cast<uint32_t>(slot * kGStride + 16 * corner), finite_row ? chunk : make_uint4(0u, 0u, 0u, 0u));
    const int64_t first_point = (row * p.levels + level) * p.points;
    unsigned tiles = 0u;
    const auto add_point = [&](float x, float y, float a) {
      const Bilinear<float> bl = bilinear(x, y, g.height, g.width);
      const int cell = (bl.y0 + (corner >> 1)) * g.width + bl.x0 + (corner & 1) - first_cell;
      if (live && ((bl.valid >> corner) & 1u) && cell >= 0 && cell < kWindowKeys) {
        const float weight = a * bl.weight(corner);
        if (finite_row && fabsf(a) <= 1.0f) {
          add_weight<scalar_t>(a_hi, slot, cell, weight * weight_scale);
          tiles |= 1u << (cell >> 4);
        } else {  // the direct path: this corner's whole row, through the sink
          const int64_t element = (level_key0 + first_cell + cell) * key_stride + head_column;
          const uint2* source = reinterpret_cast<const uint2*>(grad_output + row * kChannels);
#pragma unroll 1
          for (int c = 0; c < 4; ++c) {
            float part[8];
            const uint2 lo = __ldg(source + 2 * c), hi = __ldg(source + 2 * c + 1);
            chunk_values<scalar_t>(make_uint4(lo.x, lo.y, hi.x, hi.y), part);
#pragma unroll
            for (int i = 0; i < 8; ++i) part[i] *= weight;
            sink.add(element + 8 * c, part);
          }
        }
      }
      __syncwarp();  // the next point's corners may share a cell of this slot
    };
#pragma unroll
    for (int i = 0; i < kPrefetchPoints; ++i) {
      if (i < p.points) add_point(in.x[i], in.y[i], in.a[i]);
    }
#pragma unroll 1
    for (int point = kPrefetchPoints; point < p.points; ++point) {
      float x = 0.0f, y = 0.0f, a = 0.0f;
      if (live) {
        x = __ldg(p.locations + 2 * (first_point + point));
        y = __ldg(p.locations + 2 * (first_point + point) + 1);
        a = __ldg(p.weights + first_point + point);
      }
      add_point(x, y, a);
    }
    tiles = __reduce_or_sync(0xffffffffu, tiles);
    if (lane == 0 && tiles != 0u) atomicOr(&touched_tiles[parity], tiles);
    __syncthreads();  // A, G and the touched tiles are complete

    tiles = touched_tiles[parity];
    flushed_tiles |= tiles;
    if (threadIdx.x == 0) touched_tiles[parity ^ 1] = 0u;  // last read before the previous barrier
    uint32_t gf[2][2][4];  // G's fragments: k-step, 16-channel group
#pragma unroll
    for (int k = 0; k < 2; ++k) {
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        ldmatrix_x4_trans(gf[k][q], rows + static_cast<uint32_t>((16 * k + b_slot) * kGStride + (16 * q + b_channel) * 2));
      }
    }
#pragma unroll
    for (int i = 0; i < kTilesPerWarp; ++i) {
      const int tile = warp + kWarps * i;  // interleaved: a window's touched rows spread over the warps
      if (!((tiles >> tile) & 1u)) continue;
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        uint32_t hi[4], lo[4];
        const uint32_t at = static_cast<uint32_t>((16 * k + a_slot) * kAStride + (16 * tile + a_cell) * 2);
        ldmatrix_x4_trans(hi, a_hi + at);
        ldmatrix_x4_trans(lo, a_lo + at);
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          mma_16x8x16<mma_t>(d[i][2 * q], hi, gf[k][q][0], gf[k][q][1]);
          mma_16x8x16<mma_t>(d[i][2 * q], lo, gf[k][q][0], gf[k][q][1]);
          mma_16x8x16<mma_t>(d[i][2 * q + 1], hi, gf[k][q][2], gf[k][q][3]);
          mma_16x8x16<mma_t>(d[i][2 * q + 1], lo, gf[k][q][2], gf[k][q][3]);
        }
      }
      __syncwarp();  // every lane's reads of the m-tile's block are done
      const uint32_t zero_at = static_cast<uint32_t>(lane * kAStride + 32 * tile);  // lane = slot
      st_shared_v4(a_hi + zero_at, make_uint4(0u, 0u, 0u, 0u));
      st_shared_v4(a_hi + zero_at + 16, make_uint4(0u, 0u, 0u, 0u));
      st_shared_v4(a_lo + zero_at, make_uint4(0u, 0u, 0u, 0u));
      st_shared_v4(a_lo + zero_at + 16, make_uint4(0u, 0u, 0u, 0u));
    }
    __syncthreads();  // A is zero again and G read before the next group writes them
  }

  // One flush of the window: each warp stages its m-tiles in its share of A's bytes.
  const int k = std::is_same_v<mma_t, __half> ? -ilogbf(weight_scale) : 0;
  const typename Sink::Factors f = sink.factors_with_pow2(k);
  const uint32_t staging = a_hi + static_cast<uint32_t>(warp * kFlushRowBytes);
#pragma unroll
  for (int i = 0; i < kTilesPerWarp; ++i) {
    const int tile = warp + kWarps * i;
    if (!((flushed_tiles >> tile) & 1u)) continue;
    const int key = static_cast<int>(level_key0) + first_cell + 16 * tile;
    flush_fixed_point_row<Sink>(sink, d[i], staging, &flush_map, static_cast<int>(head_column), key,
                                key * key_stride + head_column, key_stride, f);
  }
  if (lane == 0) bulk_wait_group_all();  // the staging is read before the CTA leaves
#endif
}

}  // namespace

template <typename scalar_t>
void launch_coarse_level_backward(const ProblemTensors& problem, const scalar_t* grad_output,
                                  const FixedPointSink<float>& sink, const CUtensorMap& flush_map, float weight_scale) {
  static_assert(std::is_same_v<scalar_t, __half> || std::is_same_v<scalar_t, __nv_bfloat16>, "fp16 and bf16 rows");
  TORCH_CHECK(problem.channels == kChannels, "mmdeform_tma tma_ws: the coarse-level backward takes rows of 32 channels");
  if (problem.empty_output() || problem.levels == 0) return;
  // Runs of queries: as long as they can be for about kCtasPerSm CTAs a SM per level window (one
  // flush a run), in whole groups.
  const int64_t pairs = problem.batch * problem.heads;
  const int64_t wanted = std::max<int64_t>(1, kCtasPerSm * static_cast<int64_t>(multiprocessor_count()) / pairs);
  int64_t run_queries = (problem.queries + wanted - 1) / wanted;
  run_queries = (run_queries + kSlots - 1) / kSlots * kSlots;
  const int64_t runs = (problem.queries + run_queries - 1) / run_queries;
  TORCH_CHECK(pairs * runs < (int64_t{1} << 31) && problem.levels * kMaxWindows <= 65535,
              "mmdeform_tma tma_ws: too many heads, batches or levels for the coarse-level backward");
  const dim3 grid(static_cast<unsigned>(pairs * runs), static_cast<unsigned>(problem.levels * kMaxWindows));
  coarse_level_kernel<scalar_t, FixedPointSink<float>><<<grid, 32 * kWarps, 0, current_stream()>>>(
      flush_map, problem.problem<scalar_t>(), grad_output, sink, static_cast<int>(run_queries), static_cast<int>(runs),
      weight_scale);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template void launch_coarse_level_backward<__half>(const ProblemTensors&, const __half*, const FixedPointSink<float>&,
                                                   const CUtensorMap&, float);
template void launch_coarse_level_backward<__nv_bfloat16>(const ProblemTensors&, const __nv_bfloat16*,
                                                          const FixedPointSink<float>&, const CUtensorMap&, float);

}  // namespace tma_ws
}  // namespace mmdeform_tma
