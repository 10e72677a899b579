// `tma_ws` forward, the region config (`rg_r8x16`): fp16/bf16 heads of 32 channels in encoder
// self-attention (one query per key: query q samples around pixel q of its level). perf_notes.md,
// items 142-145: its design probe (the record version) took 0.131 ms against 0.145 for the table's
// `tma_ws` config and 0.170 for DCNv4 on the fp16 DETR encoder at bs 2 (H100, 2026-12-07, session 58,
// probe at f204db2; docs/measurements/window_tma_probe_h100_lean.json). This config took 0.288 ms there,
// 2x the table's 0.148 and the probe's shuffle version's 0.133 in the same run (H100, 2026-12-07,
// session 60, 813545c; docs/measurements/region_forward_h100_s60.md): no table names it until the
// cause is found (perf_notes.md, after item 147).
//
// A work item is one (batch, head, region). A region is an 8 x 16 block of the first level's pixels
// with every query, of any level, whose pixel centre lies in it: 170 queries on the DETR encoder, so
// that one window a level serves them all. Persistent CTAs of six warps take the items in turn, a
// query a lane (a region of more than 192 queries in passes). A stage is one (item, pass, level): its
// window, the region's extent in that level widened by kMargin pixels for the sampling offsets, is
// copied by TMA, a box a window row with SWIZZLE_64B, into buffer level & 1 (a pass of an odd level
// count ends with an empty stage). The last warp to leave stage n's buffer copies stage n + 2 into
// it; there is no CTA barrier. region_plan.h holds the plan's arithmetic, tested on the CPU.
//
// Each lane turns its query's points into records in its warp's shared memory (the corner weights
// as hi + lo halves) and top-left words in registers (from which the lanes of a step form the
// corners' swizzled row addresses; a corner outside the level reads a zero row), and the warp sums
// its 16 pairs of queries on the tensor cores, one point of each query of a pair a step:
//   D[m][n] += A[m][k] B[k][n],  m16 n8 k16,  k = 8 pk + 4 ck + corner,  n = 4 pn + 2 cn + h
// The window pitch is 2 mod 4 rows of 64 bytes, which makes every ldmatrix phase conflict-free.
// A point whose corners leave its window is summed from global memory by the lanes that hold its
// query's sums. The pairs' sums spread a NaN or Inf of one query's corner to its partner (0 x Inf),
// so a query whose sums are not finite, or which has a weight that is not, is summed again on the
// CUDA cores exactly as the reference does.
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <limits>

#include "../common/cuda_runtime_utils.h"
#include "mma_fragments.cuh"
#include "region_forward.h"
#include "region_plan.h"
#include "tensor_core_forward.h"
#include "tensor_map.h"
#include "tma_primitives.cuh"
#include "window_launch.cuh"

namespace mmdeform_tma {
namespace tma_ws {
namespace {

using hopper::window::RegionForwardConfig;
using namespace region_plan;  // NOLINT: the plan's constants and arithmetic are this kernel's

constexpr int kChannels = 32;
constexpr int kWarps = 6;
constexpr int kThreads = kWarps * 32;  // a pass: a query a lane
// Records: the B words in 16-byte units of four steps; lane L's slot s at unit L + kSlotStride s.
// Writes (one s, 8 consecutive lanes a phase) and a pair's reads each fall in 8 distinct bank groups
// (kSlotStride = 2 mod 8). The corner addresses are not recorded: a lane forms its corner's from the
// point's top-left word, which it takes from the owning lane by shfl (item 144: the records' loads
// were a third of the shared-memory wavefronts). The area also stages the warp's output rows (2 KiB).
constexpr int kSlotStride = 34;
constexpr int kWarpRecordBytes = (31 + 3 * kSlotStride + 1) * 16;
constexpr int kSharedBytes = buffer_bytes(0) + buffer_bytes(1) + kWarps * kWarpRecordBytes;

struct RegionMaps {
  CUtensorMap box[kBoxes];  // value as (batch x keys) rows of heads x 32 elements; boxes of 32 x box_width(i)
};

struct RegionArgs {
  const char* value;
  const int64_t* spatial_shapes;
  const int64_t* level_start;
  const float* locations;
  const float* weights;
  char* output;
  int* spread_flag;  // set where the sampling leaves the windows (region_forward.h)
  int batch, num_keys, heads, levels;  // queries == num_keys
};

#if MMDEFORM_TMA_HOPPER_DEVICE

using hopper::ldmatrix_x4_trans;
using hopper::mma_16x8x16;
using hopper::pack_pair;
using hopper::unpack_pair;

// The window's rows that lie in the level, into `buffer`, on `bar` (one thread).
__device__ __forceinline__ void issue_window(const RegionMaps& maps, const RegionArgs& p, int batch, int head,
                                             const LevelShape& lv, const Window& win, uint32_t buffer,
                                             uint64_t* bar) {
  const int width = box_width(win.box);
  const int first = max(0, -win.y), last = min(win.rows, lv.height - win.y);
  const int count = max(0, last - first);
  hopper::mbarrier_arrive_expect_tx(bar, static_cast<uint32_t>(count * width * kRowBytes));
  // Columns left or right of the level land on the neighbouring rows' keys (or zeros past the
  // tensor): the records never address them.
  const int key0 = batch * p.num_keys + lv.start + win.x;
  for (int r = first; r < last; ++r) {
    hopper::tma_load_2d(buffer + static_cast<uint32_t>(r * width * kRowBytes), &maps.box[win.box], head * kChannels,
                        key0 + (win.y + r) * lv.width, bar);
  }
}

// A warp's copy of its item's plan (no CTA barrier: each warp computes its own).
struct WarpPlan {
  int batch, head;
  Window windows[kMaxLevels];  // level l's, sized for buffer l & 1 (stages_a_pass)
  RegionQueries queries[kMaxLevels];
  Window next_windows[2];  // the next item's first two levels, for the copies ahead
  int next_batch, next_head;
};

// Corner k's row address from a point's top-left word (row address | bit k set where corner k lies in
// the level; 0 for a point summed elsewhere): the row with SWIZZLE_64B's chunk order (chunk j at
// j ^ address bits 7-8), or the zero row.
__device__ __forceinline__ uint32_t corner_address(uint32_t top_left_word, int k, int pitch, uint32_t zero_row) {
  const uint32_t row = (top_left_word & ~63u) + (k >> 1) * pitch + (k & 1) * kRowBytes;
  return ((top_left_word >> k) & 1u) ? row ^ ((row >> 3) & 0x30u) : zero_row;
}

__device__ __forceinline__ void ld_shared_v4(uint32_t address, uint4& v) {
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(address)
               : "memory");
}

// One query's output row summed on the CUDA cores, a channel a lane, as device_utils.cuh's bilinear
// sampling and the reference: a point outside its level adds weight x 0 (NaN for a weight that is
// not finite), a corner inside it weight x corner weight x value.
template <typename T, int kPoints>
__device__ void sum_query_exactly(const RegionArgs& p, const LevelShape* levels, int batch, int head, int query,
                                  int channel) {
  const int64_t point0 = ((static_cast<int64_t>(batch) * p.num_keys + query) * p.heads + head) * p.levels * kPoints;
  const T* value = reinterpret_cast<const T*>(p.value);
  float sum = 0.f;
  for (int l = 0; l < p.levels; ++l) {
    const LevelShape lv = levels[l];
    const T* level_value =
        value + ((static_cast<int64_t>(batch) * p.num_keys + lv.start) * p.heads + head) * kChannels + channel;
#pragma unroll
    for (int i = 0; i < kPoints; ++i) {
      const int64_t at = point0 + l * kPoints + i;
      const float2 xy = __ldg(reinterpret_cast<const float2*>(p.locations) + at);
      const float a = __ldg(p.weights + at);
      const Bilinear<float> b = bilinear(xy.x, xy.y, lv.height, lv.width);
      float sampled = 0.f;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        if ((b.valid >> c) & 1u) {
          const int64_t key = static_cast<int64_t>(b.y0 + (c >> 1)) * lv.width + b.x0 + (c & 1);
          sampled += b.weight(c) * static_cast<float>(level_value[key * p.heads * kChannels]);
        }
      }
      sum += a * sampled;
    }
  }
  T* out = reinterpret_cast<T*>(p.output) +
           ((static_cast<int64_t>(batch) * p.num_keys + query) * p.heads + head) * kChannels + channel;
  *out = from_acc<T>(sum);
}

#endif  // MMDEFORM_TMA_HOPPER_DEVICE

template <typename T, int kPoints>
__global__ void __launch_bounds__(kThreads, 2)
    region_forward_kernel(const __grid_constant__ RegionMaps maps, const __grid_constant__ RegionArgs p) {
#if MMDEFORM_TMA_HOPPER_DEVICE
  static_assert(kPoints % 4 == 0, "points in groups of four");
  constexpr int kGroups = kPoints / 4;
  extern __shared__ __align__(1024) unsigned char smem[];
  __shared__ __align__(8) uint64_t full[2];
  __shared__ unsigned released[2];  // warps that have left each buffer's stages
  __shared__ int spread;            // a warp found its points outside their windows: sum nothing more
  __shared__ __align__(128) unsigned char zero_row[kRowBytes];
  __shared__ LevelShape levels[kMaxLevels];
  __shared__ WarpPlan plans[kWarps];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  if (tid < p.levels) {
    levels[tid] = LevelShape{static_cast<int>(__ldg(p.spatial_shapes + 2 * tid)),
                             static_cast<int>(__ldg(p.spatial_shapes + 2 * tid + 1)),
                             static_cast<int>(__ldg(p.level_start + tid))};
  }
  if (tid < kRowBytes / 4) reinterpret_cast<uint32_t*>(zero_row)[tid] = 0u;
  if (tid < 2) released[tid] = 0u;
  if (tid == 0) spread = 0;
  if (tid == 0) {
    hopper::mbarrier_init(&full[0], 1);
    hopper::mbarrier_init(&full[1], 1);
    hopper::fence_mbarrier_init();
  }
  const int64_t outputs = static_cast<int64_t>(p.batch) * p.num_keys * p.heads * kChannels;
  if (!block_level_geometry_ok(p.spatial_shapes, p.level_start, p.levels, p.num_keys)) {  // a CTA barrier
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + tid; i < outputs;
         i += static_cast<int64_t>(gridDim.x) * kThreads) {
      reinterpret_cast<T*>(p.output)[i] = quiet_nan<T>();
    }
    return;
  }
  // Items: < batch x queries x heads < 2^31. The grid is read again from `levels` where needed (registers).
  const int total = [&] {
    const RegionGrid grid = region_grid(levels);
    return p.batch * p.heads * grid.rows * grid.cols;
  }();
  if (static_cast<int>(blockIdx.x) >= total) return;

  const uint32_t smem_s = hopper::smem_address(smem);
  const uint32_t buffer1_s = smem_s + buffer_bytes(0);
  const uint32_t records_s = smem_s + buffer_bytes(0) + buffer_bytes(1) + warp * kWarpRecordBytes;
  const uint32_t zero_s = hopper::smem_address(zero_row);
  if (tid == 0) {  // the first item's first two stages (every item has one pass at least, and two levels)
    hopper::prefetch_tensor_map(&maps.box[0]);
    const RegionGrid grid = region_grid(levels);
    const Item it = item_at(blockIdx.x, p.heads, grid);
    for (int l = 0; l < 2; ++l) {
      issue_window(maps, p, it.batch, it.head, levels[l], level_window(it, grid, levels[l], buffer_bytes(l)),
                   l ? buffer1_s : smem_s, &full[l]);
    }
  }
  WarpPlan& plan = plans[warp];
  int stage = 0;  // the CTA's stage count: buffer stage & 1, its phase (stage >> 1) & 1
  auto spread_found = [&] { return *reinterpret_cast<volatile int*>(&spread) != 0; };
  // The warp leaves stage s of (item, pass); the last warp to leave its buffer copies stage + 2 into
  // it (region_plan.h's next_copy). An empty stage, or any once the sampling is found spread, only
  // arrives on the buffer's barrier, with nothing to copy.
  auto leave_stage = [&](int item, int pass, int s, int passes) {
    __syncwarp();
    if (lane == 0) {
      __threadfence_block();  // this warp's window reads before its count
      const unsigned before = atomicAdd(&released[stage & 1], 1u);
      if (before == (static_cast<unsigned>(stage >> 1) + 1) * kWarps - 1) {
        const int parity = stage & 1;
        const NextCopy next = next_copy(s, p.levels, pass, passes, item + static_cast<int>(gridDim.x) < total);
        if (next.kind == NextCopy::kEmpty || (next.kind != NextCopy::kNone && spread_found())) {
          hopper::mbarrier_arrive(&full[parity]);
        } else if (next.kind != NextCopy::kNone) {
          const bool next_item = next.kind == NextCopy::kNextItem;
          __threadfence_block();
          hopper::fence_proxy_async_shared();
          issue_window(maps, p, next_item ? plan.next_batch : plan.batch, next_item ? plan.next_head : plan.head,
                       levels[next.level], next_item ? plan.next_windows[next.level] : plan.windows[next.level],
                       parity ? buffer1_s : smem_s, &full[parity]);
        }
      }
    }
    ++stage;
  };
  // A pass's empty stage after an odd level count: its arrival, then its hand-over.
  auto empty_stage = [&](int item, int pass, int passes) {
    if (p.levels & 1) {
      hopper::mbarrier_wait(&full[stage & 1], (stage >> 1) & 1);
      leave_stage(item, pass, p.levels, passes);
    }
  };

  for (int item = blockIdx.x; item < total; item += gridDim.x) {
    __syncwarp();  // the previous item's plan has been read
    {
      const RegionGrid grid = region_grid(levels);
      const Item it = item_at(item, p.heads, grid);
      const bool next_exists = item + static_cast<int>(gridDim.x) < total;
      if (lane < 16 && lane % 8 < p.levels) {  // lanes 0-4: windows, 8-12: queries
        const int l = lane % 8;
        if (lane < 8) {
          plan.windows[l] = level_window(it, grid, levels[l], buffer_bytes(l & 1));
        } else {
          plan.queries[l] = region_queries(it, grid, levels[l]);
        }
      } else if (lane >= 24 && lane < 26 && next_exists) {  // the next item's first two levels
        const int l = lane - 24;
        plan.next_windows[l] = level_window(item_at(item + gridDim.x, p.heads, grid), grid, levels[l], buffer_bytes(l));
      } else if (lane == 28 && next_exists) {
        const Item next = item_at(item + gridDim.x, p.heads, grid);
        plan.next_batch = next.batch;
        plan.next_head = next.head;
      } else if (lane == 29) {
        plan.batch = it.batch;
        plan.head = it.head;
      }
    }
    __syncwarp();
    int region_size = 0;
    for (int l = 0; l < p.levels; ++l) region_size += plan.queries[l].count;
    const int passes = (region_size + kThreads - 1) / kThreads;
    // Once the sampling is found to leave the windows (by this CTA or another), the fallback forward
    // writes every output: the warps only keep the stages' hand-over going (with empty copies).
    if (lane == 0 && *reinterpret_cast<volatile int*>(p.spread_flag) != 0) atomicExch(&spread, 1);
    bool skip = __shfl_sync(~0u, spread_found(), 0);

    for (int pass = 0; pass < passes; ++pass) {
      // The lane's slots: it writes its query's records; it reads B word `word` of its point of the pair
      // at its pair's units plus this constant, and forms the address of corner `lane & 3`. Computed
      // per pass, not kept live across the item loop: held there, one spilled around the plan.
      const int pn = lane >> 4, word = 2 * (t & 1) + (g & 1), corner = lane & 3;
      const bool b_live = ((g >> 1) & 1) == (t >> 1);
      const uint32_t mask0 = (b_live && g < 4) ? ~0u : 0u, mask1 = (b_live && g >= 4) ? ~0u : 0u;
      const uint32_t chunk_bits = (2 * ((lane >> 2) & 1) + ((lane >> 3) & 1)) << 4;
      const uint32_t b_read_s = records_s + (pn + kSlotStride * word) * 16;
      if (skip) {
        for (int l = 0; l < p.levels; ++l) {
          hopper::mbarrier_wait(&full[stage & 1], (stage >> 1) & 1);
          leave_stage(item, pass, l, passes);
        }
        empty_stage(item, pass, passes);
        continue;
      }
      // The lane's query: slot pass x 192 + tid of the region's queries, level by level.
      int q = -1;
      {
        int slot = pass * kThreads + tid;
        for (int l = 0; l < p.levels; ++l) {
          const RegionQueries r = plan.queries[l];
          if (q < 0 && slot >= 0 && slot < r.count) {
            const int row = slot / r.cols, col = slot - row * r.cols;
            q = levels[l].start + (r.row + row) * levels[l].width + r.col + col;
          }
          slot -= r.count;
        }
      }
      const uint32_t live_queries = __ballot_sync(~0u, q >= 0);
      // The query's first point; 32-bit: the fallback's check (lean_fits) bounds 2 x points below 2^31.
      const int point0 = q < 0 ? 0 : ((plan.batch * p.num_keys + q) * p.heads + plan.head) * p.levels * kPoints;
      // fp16: the query's weights scaled by a power of two that brings the largest finite one into
      // [1, 2), so that every corner weight's hi and lo halves stay in fp16's range.
      bool weights_finite = true;
      float largest = 0.f;
      if (q >= 0) {
        for (int i = 0; i < p.levels * kPoints; i += 4) {
          const float4 w = __ldg(reinterpret_cast<const float4*>(p.weights + point0 + i));
          const float v[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            weights_finite &= isfinite(v[j]);
            largest = fmaxf(largest, isfinite(v[j]) ? fabsf(v[j]) : 0.f);
          }
        }
      }
      float scale = 1.f;
      if constexpr (std::is_same_v<T, __half>) {
        if (largest > 0.f) {
          const int exponent = min(max(((__float_as_int(largest) >> 23) & 0xff) - 127, -126), 126);
          scale = __int_as_float((127 - exponent) << 23);
        }
      }
      auto fetch = [&](int step, float4 (&loc)[2], float4& w) {
        if (q < 0) {
          loc[0] = loc[1] = make_float4(-10.f, -10.f, -10.f, -10.f);  // outside every level
          w = make_float4(0.f, 0.f, 0.f, 0.f);
          return;
        }
        const int at = point0 + (step / kGroups) * kPoints + 4 * (step % kGroups);
        loc[0] = __ldg(reinterpret_cast<const float4*>(p.locations + 2 * at));
        loc[1] = __ldg(reinterpret_cast<const float4*>(p.locations + 2 * at) + 1);
        w = __ldg(reinterpret_cast<const float4*>(p.weights + at));
      };

      float acc[16][4];
#pragma unroll
      for (int i = 0; i < 16; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;

      float4 next_loc[2], next_w;
      fetch(0, next_loc, next_w);
      for (int step = 0; step < p.levels * kGroups; ++step) {
        const int l = step / kGroups;
        const LevelShape lv = levels[l];
        const Window win = plan.windows[l];
        const int width = box_width(win.box), pitch = width * kRowBytes;
        uint32_t top_left_words[4];
        unsigned outside = 0;  // points summed from global memory
        if (!skip) {
          const float4 loc[2] = {next_loc[0], next_loc[1]};  // x, y of points 4 group .. 4 group + 3
          const float4 wgt = next_w;
          if (step + 1 < p.levels * kGroups) fetch(step + 1, next_loc, next_w);
          const uint32_t window_s = (stage & 1) ? buffer1_s : smem_s;

          // Records of the lane's four points.
          uint32_t b_words[4][4];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float lx = i == 0 ? loc[0].x : i == 1 ? loc[0].z : i == 2 ? loc[1].x : loc[1].z;
            const float ly = i == 0 ? loc[0].y : i == 1 ? loc[0].w : i == 2 ? loc[1].y : loc[1].w;
            const float a = i == 0 ? wgt.x : i == 1 ? wgt.y : i == 2 ? wgt.z : wgt.w;
            const float x = lx * lv.width - 0.5f, y = ly * lv.height - 0.5f;
            const bool valid = x > -1.f && y > -1.f && x < lv.width && y < lv.height;  // NaN is outside
            const int ix = valid ? __float2int_rd(x) : 0, iy = valid ? __float2int_rd(y) : 0;
            const int xr = ix - win.x, yr = iy - win.y;
            const bool summed = valid && static_cast<unsigned>(xr) < static_cast<unsigned>(width - 1) &&
                                static_cast<unsigned>(yr) < static_cast<unsigned>(win.rows - 1);
            if (valid && !summed) outside |= 1u << i;
            const float fx = summed ? x - ix : 0.f, fy = summed ? y - iy : 0.f, as = summed ? a * scale : 0.f;
            const float left = (1.f - fx) * as, right = fx * as;
            const float w[4] = {left * (1.f - fy), right * (1.f - fy), left * fy, right * fy};
            const uint32_t hi_top = pack_pair<T>(w[0], w[1]), hi_bottom = pack_pair<T>(w[2], w[3]);
            const float2 top = unpack_pair<T>(hi_top), bottom = unpack_pair<T>(hi_bottom);
            b_words[0][i] = hi_top;
            b_words[1][i] = pack_pair<T>(w[0] - top.x, w[1] - top.y);
            b_words[2][i] = hi_bottom;
            b_words[3][i] = pack_pair<T>(w[2] - bottom.x, w[3] - bottom.y);
            // A row's 16-byte chunk j sits at j ^ (address bits 7-8): SWIZZLE_64B on the shared address.
            const bool x_in[2] = {ix >= 0, ix + 1 < lv.width}, y_in[2] = {iy >= 0, iy + 1 < lv.height};
            // The top-left row (a multiple of 64) and which corners lie in the level (bit k: corner k).
            const uint32_t top_left = window_s + yr * pitch + xr * kRowBytes;
            const uint32_t in_level = (x_in[0] && y_in[0] ? 1u : 0u) | (x_in[1] && y_in[0] ? 2u : 0u) |
                                      (x_in[0] && y_in[1] ? 4u : 0u) | (x_in[1] && y_in[1] ? 8u : 0u);
            top_left_words[i] = summed ? top_left | in_level : 0u;
          }
#pragma unroll
          for (int s = 0; s < 4; ++s) {
            const uint32_t slot = (lane + kSlotStride * s) * 16;
            hopper::st_shared_v4(records_s + slot,
                                 make_uint4(b_words[s][0], b_words[s][1], b_words[s][2], b_words[s][3]));
          }
          __syncwarp();
          if (step == 0) {  // most of the first points outside their windows: uniform sampling
            const int outside_points = static_cast<int>(__reduce_add_sync(~0u, __popc(outside)));
            if (2 * outside_points > 4 * __popc(live_queries)) {
              skip = true;
              if (lane == 0) {
                atomicExch(&spread, 1);
                atomicExch(p.spread_flag, 1);
              }
            }
          }
        }
        if (step % kGroups == 0) hopper::mbarrier_wait(&full[stage & 1], (stage >> 1) & 1);
        if (!skip) {
          auto pair_steps = [&](int pr) {
            uint4 b;
            ld_shared_v4(b_read_s + 32 * pr, b);
            const uint32_t bs[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int s = 0; s < 4; ++s) {
              const uint32_t row_address =
                  corner_address(__shfl_sync(~0u, top_left_words[s], 2 * pr + pn), corner, pitch, zero_s);
              uint32_t a[4];
              ldmatrix_x4_trans(a, row_address ^ chunk_bits);
              mma_16x8x16<T>(acc[pr], a, bs[s] & mask0, bs[s] & mask1);
            }
          };
          // Blocks of four pairs without a branch, so that the compiler interleaves their chains.
#pragma unroll
          for (int block = 0; block < 4; ++block) {
            if (((live_queries >> (8 * block)) & 0xFFu) == 0) continue;  // warp-uniform: eight padding queries
#pragma unroll
            for (int pr = 4 * block; pr < 4 * block + 4; ++pr) pair_steps(pr);
          }

          // Points outside their window: the 16 lanes holding the query's sums add them from global memory.
          unsigned pending = __ballot_sync(~0u, outside != 0);
          while (pending) {
            const int src = __ffs(pending) - 1;
            pending &= pending - 1;
            const unsigned which = __shfl_sync(~0u, outside, src);
            const float src_scale = __shfl_sync(~0u, scale, src);
            const int src_point = __shfl_sync(~0u, point0, src) + l * kPoints + 4 * (step % kGroups);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              if (!((which >> i) & 1) || (t >> 1) != (src & 1)) continue;
              const float2 xy = __ldg(reinterpret_cast<const float2*>(p.locations) + src_point + i);
              const float a = __ldg(p.weights + src_point + i) * src_scale;
              const float x = xy.x * lv.width - 0.5f, y = xy.y * lv.height - 0.5f;
              const float x0 = floorf(x), y0 = floorf(y), fx = x - x0, fy = y - y0;
              const float wc[4] = {(1.f - fx) * (1.f - fy) * a, fx * (1.f - fy) * a, (1.f - fx) * fy * a, fx * fy * a};
              const int c0 = 16 * (t & 1) + g;
              const int64_t level_row = static_cast<int64_t>(plan.batch) * p.num_keys + lv.start;
              const T* base = reinterpret_cast<const T*>(p.value) + (level_row * p.heads + plan.head) * kChannels;
              float v0 = 0.f, v1 = 0.f;
#pragma unroll
              for (int k = 0; k < 4; ++k) {
                const int yy = static_cast<int>(y0) + (k >> 1), xx = static_cast<int>(x0) + (k & 1);
                if (yy < 0 || xx < 0 || yy >= lv.height || xx >= lv.width) continue;
                const T* row = base + (static_cast<int64_t>(yy) * lv.width + xx) * p.heads * kChannels;
                v0 += wc[k] * static_cast<float>(row[c0]);
                v1 += wc[k] * static_cast<float>(row[c0 + 8]);
              }
              const int target = src >> 1;
#pragma unroll
              for (int pr = 0; pr < 16; ++pr) {  // every pair, so that acc stays in registers (no indexing)
                acc[pr][0] += pr == target ? v0 : 0.f;
                acc[pr][2] += pr == target ? v1 : 0.f;
              }
            }
          }
        }
        if (step % kGroups == kGroups - 1) leave_stage(item, pass, l, passes);
      }
      empty_stage(item, pass, passes);
      if (skip) continue;

      // Sums that are not finite, and weights that are not (a point outside its level with an Inf
      // weight is NaN in the reference, 0 here): those queries are summed again below.
      float probe = 0.f;
#pragma unroll
      for (int pr = 0; pr < 16; ++pr)
#pragma unroll
        for (int j = 0; j < 4; ++j) probe = fmaf(acc[pr][j], 0.f, probe);  // NaN iff one is not finite
      const unsigned bad_weights = __ballot_sync(~0u, !weights_finite);
      const bool redo_some = __any_sync(~0u, isnan(probe)) || bad_weights != 0u;

      // D: lane (g, t) holds query 2 pr + (t >> 1), channels 16 (t & 1) + g (d0 hi, d1 lo) and + 8 (d2, d3).
      __syncwarp();
      T* stage_rows = reinterpret_cast<T*>(smem + (records_s - smem_s));
#pragma unroll
      for (int pr = 0; pr < 16; ++pr) {
        const int row = 2 * pr + (t >> 1), c0 = 16 * (t & 1) + g;
        float unscale = 1.f;
        if constexpr (std::is_same_v<T, __half>) unscale = 1.f / __shfl_sync(~0u, scale, row);  // a power of two
        stage_rows[row * 32 + c0] = from_acc<T>((acc[pr][0] + acc[pr][1]) * unscale);
        stage_rows[row * 32 + c0 + 8] = from_acc<T>((acc[pr][2] + acc[pr][3]) * unscale);
      }
      __syncwarp();
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int c = lane + 32 * i, row = c >> 2, j = c & 3;
        const int query = __shfl_sync(~0u, q, row);
        if (query >= 0) {
          T* out = reinterpret_cast<T*>(p.output) +
                   ((static_cast<int64_t>(plan.batch) * p.num_keys + query) * p.heads + plan.head) * kChannels;
          reinterpret_cast<uint4*>(out)[j] = reinterpret_cast<const uint4*>(stage_rows + row * 32)[j];
        }
      }
      if (redo_some) {  // warp-uniform
        unsigned redo = bad_weights;
#pragma unroll
        for (int pr = 0; pr < 16; ++pr) {
          const bool finite =
              isfinite(acc[pr][0]) && isfinite(acc[pr][1]) && isfinite(acc[pr][2]) && isfinite(acc[pr][3]);
          if (__any_sync(~0u, !finite)) redo |= 3u << (2 * pr);
        }
        redo &= live_queries;
        __syncwarp();  // the rows stored above come first
        while (redo) {
          const int src = __ffs(redo) - 1;
          redo &= redo - 1;
          sum_query_exactly<T, kPoints>(p, levels, plan.batch, plan.head, __shfl_sync(~0u, q, src), lane);
        }
      }
      __syncwarp();  // the staged rows are read before the next pass's records overwrite them
    }
  }
#else
  __trap();
#endif
}

template <typename T, int kPoints>
void launch(const RegionMaps& maps, const RegionArgs& args, const ProblemTensors& problem) {
  const auto kernel = region_forward_kernel<T, kPoints>;
  const int resident = hopper::window::blocks_per_multiprocessor(reinterpret_cast<const void*>(kernel), kThreads,
                                                                 kSharedBytes);
  // At most one CTA a (batch, head, key): a bound on the items (regions hold one key at least).
  const int64_t blocks = std::min<int64_t>(static_cast<int64_t>(resident) * multiprocessor_count(),
                                           problem.batch * problem.heads * problem.num_keys);
  kernel<<<static_cast<unsigned>(blocks), kThreads, kSharedBytes, current_stream()>>>(maps, args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// A tensor's data as 16-byte aligned (the kernel reads four points' locations and weights at once):
// itself, or a copy for a view that starts elsewhere.
at::Tensor aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 ? t : t.clone();
}

}  // namespace

std::string region_forward_unsupported(const ProblemTensors& problem) {
  if (std::string reason = half_heads_of_32_unsupported(problem, "the region forward"); !reason.empty()) {
    return reason;
  }
  if (problem.queries != problem.num_keys) {
    return "the region forward takes encoder self-attention (one query per key), not " + num(problem.queries) +
           " queries over " + num(problem.num_keys) + " keys";
  }
  if (problem.points != 4 && problem.points != 8) {
    return "the region forward takes 4 or 8 points a level, not " + num(problem.points);
  }
  if (problem.levels < 2 || problem.levels > kMaxLevels) {
    return "the region forward takes 2 to " + num(kMaxLevels) + " levels, not " + num(problem.levels);
  }
  return {};
}

void region_forward(const ProblemTensors& problem, const RegionForwardConfig& config, at::Tensor& output,
                    int* spread_flag) {
  const std::string reason = region_forward_unsupported(problem);
  TORCH_CHECK(reason.empty(), "mmdeform_tma tma_ws: config ", config.name, ": ", reason);
  hopper::require_hopper("tma_ws");
  const at::Tensor locations = aligned16(problem.sampling_locations);
  const at::Tensor weights = aligned16(problem.attention_weights);
  RegionMaps maps;
  for (int i = 0; i < kBoxes; ++i) maps.box[i] = hopper::value_window_row_map(problem.value, box_width(i));
  const RegionArgs args{reinterpret_cast<const char*>(problem.value.data_ptr()),
                        problem.spatial_shapes.data_ptr<int64_t>(),
                        problem.level_start_index.data_ptr<int64_t>(),
                        locations.data_ptr<float>(),
                        weights.data_ptr<float>(),
                        reinterpret_cast<char*>(output.data_ptr()),
                        spread_flag,
                        static_cast<int>(problem.batch),
                        static_cast<int>(problem.num_keys),
                        static_cast<int>(problem.heads),
                        static_cast<int>(problem.levels)};
  const bool half = problem.value.scalar_type() == at::kHalf;
  if (problem.points == 4) {
    half ? launch<__half, 4>(maps, args, problem) : launch<__nv_bfloat16, 4>(maps, args, problem);
  } else {
    half ? launch<__half, 8>(maps, args, problem) : launch<__nv_bfloat16, 8>(maps, args, problem);
  }
}

std::tuple<at::Tensor, at::Tensor> region_forward_alone(const ProblemTensors& problem, const std::string& name) {
  const auto& configs = hopper::window::region_forward_configs();
  const auto config = std::find_if(configs.begin(), configs.end(), [&](const auto& c) { return c.name == name; });
  TORCH_CHECK(config != configs.end(), "mmdeform_tma tma_ws: no region forward config named ", name);
  TORCH_CHECK(!problem.empty_output(), "mmdeform_tma tma_ws: the region forward takes a non-empty problem");
  TORCH_CHECK(problem.num_items() * problem.levels * problem.points * 2 < (int64_t{1} << 31),
              "mmdeform_tma tma_ws: the region forward takes under 2^31 location coordinates");
  at::Tensor output = at::full({problem.batch, problem.queries, problem.heads * problem.channels},
                               std::numeric_limits<double>::quiet_NaN(), problem.value.options());
  at::Tensor spread = at::zeros({1}, problem.value.options().dtype(at::kInt));
  region_forward(problem, *config, output, spread.data_ptr<int>());
  return {output, spread};
}

}  // namespace tma_ws
}  // namespace mmdeform_tma
