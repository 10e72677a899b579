// A design probe for the encoder forward (perf_notes item 142), not a backend: the item-141 tensor-core sum,
// fed by TMA windows that serve every query whose reference point lies in one spatial region.
//
// A CTA takes one (batch, head, region). Its queries are every query, of any level, whose reference point
// falls in the region (tools/window_tma_forward_probe.py lists them and places the windows), so a region's
// level-l window serves all of them: about 170 queries for an 8 x 16 block of level 0. Thread 0 copies each
// level's window with one TMA box a window row (SWIZZLE_64B, the row pitch a width of 4k + 2 pixels: every
// ldmatrix phase is conflict-free) into one of two buffers, level l + 2's while level l + 1 is summed.
//
// Each lane owns one query. Per level and group of four points it turns its points into records, kept in the
// warp's own shared memory (no CTA barrier): the corner weights as hi + lo halves and the four corners'
// swizzled row addresses (a corner outside the level reads a zero row). Then the warp sums its 16 pairs of
// queries (2 pair and 2 pair + 1), one point of each query of a pair a step, as in item 141:
//
//   D[m][n] += A[m][k] B[k][n],  m16 n8 k16,  k = 8 pk + 4 ck + corner,  n = 4 pn + 2 cn + h
//
// with one 16-byte load of the B words and one of the addresses for four steps. A point whose corners leave
// its window is summed from global memory by the lanes that hold its query's accumulators.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#ifndef PROBE_KERNEL_ONLY  // nvcc -DPROBE_KERNEL_ONLY -I mmdeform_tma/csrc/hopper -I <torch include>: kernels alone
#include <ATen/cuda/CUDAContext.h>
#include <cudaTypedefs.h>
#include <torch/extension.h>
#endif

#include <cstdint>

#include "mma_fragments.cuh"   // the package's tensor-core pieces
#include "tma_primitives.cuh"  // and its mbarrier and TMA wrappers
#include "window_probe_common.cuh"

namespace {

using mmdeform_tma::hopper::ldmatrix_x4_trans;
using mmdeform_tma::hopper::mma_16x8x16;

constexpr int kMaxLevels = 4;
constexpr int kRowBytes = 64;           // 32 channels of 2 bytes
// Records: of each kind (B words, corner addresses) 16-byte units of four steps; lane L's slot s at unit
// L + kSlotStride s. Its writes (one s, 8 consecutive lanes a phase) and a pair's reads (units 2 pair + point
// of pair + kSlotStride s, s = B word or corner) each fall in 8 distinct bank groups (kSlotStride = 2 mod 8),
// and a reader's unit is its pair's plus a lane constant.
constexpr int kSlotStride = 34;
constexpr int kRecordBytes = (31 + 3 * kSlotStride + 1) * 16;
constexpr int kWarpRecordBytes = 2 * kRecordBytes;

struct LevelMaps {
  CUtensorMap map[kMaxLevels];  // value as (batch x keys) rows of heads x 32 elements; box 32 x box_width
};

struct Level {
  int height, width, start, box_width, pitch;  // pitch: bytes from one window row to the next
};

struct Params {
  const void* value;
  const float* locations;
  const float* weights;
  const int32_t* tiles;    // [ctas][warps x 32] query ids, -1 padded
  const int32_t* windows;  // [ctas][levels][3]: window origin x, y and rows
  void* out;
  Level level[kMaxLevels];
  int num_keys, num_queries, heads, levels;
  int buffer_bytes[2];     // even levels' windows in buffer 0, odd levels' in buffer 1
  int box_swizzle;         // 1 if the TMA swizzles from each box's start, not from the shared address
};

using window_probe::HalfPair;

__device__ __forceinline__ void ld_shared_v4(uint32_t address, uint4& v) {
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(address)
               : "memory");
}

// Thread 0: level l's window rows that lie in the level, into buffer l & 1, on that buffer's mbarrier.
__device__ void issue_window(const LevelMaps& maps, const Params& p, int l, const int32_t* window,
                             unsigned char* buffer, uint64_t* bar) {
#if MMDEFORM_TMA_HOPPER_DEVICE
  const Level lv = p.level[l];
  const int ox = window[0], oy = window[1], rows = window[2];
  const int first = max(0, -oy), last = min(rows, lv.height - oy);
  const int count = max(0, last - first);
  mmdeform_tma::hopper::mbarrier_arrive_expect_tx(bar, static_cast<uint32_t>(count * lv.box_width * kRowBytes));
  const int key0 = static_cast<int>(blockIdx.z) * p.num_keys + lv.start + ox;
  for (int r = first; r < last; ++r) {
    mmdeform_tma::hopper::tma_load_2d(buffer + r * lv.pitch, &maps.map[l], static_cast<int>(blockIdx.y) * 32,
                                      key0 + (oy + r) * lv.width, bar);
  }
#endif
}

// kLean (item 143): pairs in branch-free blocks of four and no CTA barrier between levels. kShuffle (item 144,
// lean too): no address records; a step's lanes take their point's top-left word from its owning lane by
// `shfl` and form their corner's swizzled address themselves (fewer shared-memory wavefronts, more instructions).
template <typename T, int kPoints, int kWarps, bool kLean, bool kShuffle>
__global__ void __launch_bounds__(kWarps * 32, 2)
    window_tma_forward(const __grid_constant__ LevelMaps maps, const __grid_constant__ Params p) {
#if MMDEFORM_TMA_HOPPER_DEVICE
  static_assert(kPoints % 4 == 0, "points in groups of four");
  constexpr int kGroups = kPoints / 4;
  extern __shared__ __align__(1024) unsigned char smem[];
  __shared__ __align__(8) uint64_t full[2];
  __shared__ unsigned released[2];  // kLean: warps that have left each buffer's windows
  __shared__ __align__(128) unsigned char zero_row[kRowBytes];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const uint32_t smem_s = mmdeform_tma::hopper::smem_address(smem);
  unsigned char* const buffer1 = smem + p.buffer_bytes[0];
  const uint32_t buffer1_s = smem_s + static_cast<uint32_t>(p.buffer_bytes[0]);
  const uint32_t records_s = buffer1_s + p.buffer_bytes[1] + warp * kWarpRecordBytes;
  const uint32_t zero_s = mmdeform_tma::hopper::smem_address(zero_row);
  const int32_t* windows = p.windows + static_cast<int64_t>(blockIdx.x) * p.levels * 3;
  if (tid < kRowBytes / 4) reinterpret_cast<uint32_t*>(zero_row)[tid] = 0u;
  if (tid < 2) released[tid] = 0u;
  if (tid == 0) {
    mmdeform_tma::hopper::prefetch_tensor_map(&maps.map[0]);
    mmdeform_tma::hopper::mbarrier_init(&full[0], 1);
    mmdeform_tma::hopper::mbarrier_init(&full[1], 1);
    mmdeform_tma::hopper::fence_mbarrier_init();
  }
  __syncthreads();
  if (tid == 0) {
    issue_window(maps, p, 0, windows, smem, &full[0]);
    if (p.levels > 1) issue_window(maps, p, 1, windows + 3, buffer1, &full[1]);
  }

  // The lane's query, and where its points' locations start.
  const int q = p.tiles[static_cast<int64_t>(blockIdx.x) * kWarps * 32 + tid];
  const uint32_t live_queries = __ballot_sync(~0u, q >= 0);
  const int64_t point0 = q < 0 ? 0
                               : (((static_cast<int64_t>(blockIdx.z) * p.num_queries + q) * p.heads + blockIdx.y) *
                                  p.levels) * kPoints;
  auto fetch = [&](int item, float4 (&loc)[2], float4& w) {
    if (q < 0) {
      loc[0] = loc[1] = make_float4(-10.f, -10.f, -10.f, -10.f);  // outside every level: no contribution
      w = make_float4(0.f, 0.f, 0.f, 0.f);
      return;
    }
    const int64_t at = point0 + (item / kGroups) * kPoints + 4 * (item % kGroups);
    loc[0] = __ldg(reinterpret_cast<const float4*>(p.locations + 2 * at));
    loc[1] = __ldg(reinterpret_cast<const float4*>(p.locations + 2 * at) + 1);
    w = __ldg(reinterpret_cast<const float4*>(p.weights + at));
  };

  // The lane's slots: it writes its query's records; it reads B word `word` of its point of the pair and the
  // address of corner `lane & 3`, at its pair's units plus these constants.
  const int pn = lane >> 4, word = 2 * (t & 1) + (g & 1), corner = lane & 3;
  const bool b_live = ((g >> 1) & 1) == (t >> 1);
  const uint32_t mask0 = (b_live && g < 4) ? ~0u : 0u, mask1 = (b_live && g >= 4) ? ~0u : 0u;
  const uint32_t chunk_bits = (2 * ((lane >> 2) & 1) + ((lane >> 3) & 1)) << 4;
  const uint32_t b_read_s = records_s + (pn + kSlotStride * word) * 16;
  const uint32_t address_read_s = records_s + kRecordBytes + (pn + kSlotStride * corner) * 16;

  float acc[16][4];
#pragma unroll
  for (int i = 0; i < 16; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;

  float4 next_loc[2], next_w;
  fetch(0, next_loc, next_w);
  for (int item = 0; item < p.levels * kGroups; ++item) {
    const int l = item / kGroups;
    const float4 loc[2] = {next_loc[0], next_loc[1]};  // x, y of points 4 g .. 4 g + 3
    const float4 wgt = next_w;
    if (item + 1 < p.levels * kGroups) fetch(item + 1, next_loc, next_w);
    const Level lv = p.level[l];
    const int ox = windows[3 * l], oy = windows[3 * l + 1], rows = windows[3 * l + 2];
    const uint32_t window_s = (l & 1) ? buffer1_s : smem_s;

    // Records of the lane's four points.
    uint32_t b_words[4][4], corner_words[4][4], top_left_words[4];
    unsigned outside = 0;  // points summed from global memory
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float lx = i == 0 ? loc[0].x : i == 1 ? loc[0].z : i == 2 ? loc[1].x : loc[1].z;
      const float ly = i == 0 ? loc[0].y : i == 1 ? loc[0].w : i == 2 ? loc[1].y : loc[1].w;
      const float a = i == 0 ? wgt.x : i == 1 ? wgt.y : i == 2 ? wgt.z : wgt.w;
      const float x = lx * lv.width - 0.5f, y = ly * lv.height - 0.5f;
      const bool valid = x > -1.f && y > -1.f && x < lv.width && y < lv.height;  // mmcv's test: NaN is outside
      const int ix = valid ? __float2int_rd(x) : 0, iy = valid ? __float2int_rd(y) : 0;
      const int xr = ix - ox, yr = iy - oy;
      const bool summed = valid && static_cast<unsigned>(xr) < static_cast<unsigned>(lv.box_width - 1) &&
                          static_cast<unsigned>(yr) < static_cast<unsigned>(rows - 1);
      if (valid && !summed) outside |= 1u << i;
      const float fx = summed ? x - ix : 0.f, fy = summed ? y - iy : 0.f, as = summed ? a : 0.f;
      const float left = (1.f - fx) * as, right = fx * as;
      const float w[4] = {left * (1.f - fy), right * (1.f - fy), left * fy, right * fy};
      const uint32_t hi_top = HalfPair<T>::pack(w[0], w[1]), hi_bottom = HalfPair<T>::pack(w[2], w[3]);
      const float2 top = HalfPair<T>::unpack(hi_top), bottom = HalfPair<T>::unpack(hi_bottom);
      b_words[0][i] = hi_top;
      b_words[1][i] = HalfPair<T>::pack(w[0] - top.x, w[1] - top.y);
      b_words[2][i] = hi_bottom;
      b_words[3][i] = HalfPair<T>::pack(w[2] - bottom.x, w[3] - bottom.y);
      // A row's 16-byte chunk j sits at j ^ (address bits 7-8): SWIZZLE_64B on the shared address.
      const bool x_in[2] = {ix >= 0, ix + 1 < lv.width}, y_in[2] = {iy >= 0, iy + 1 < lv.height};
      const uint32_t top_left = window_s + yr * lv.pitch + xr * kRowBytes;
      if constexpr (kShuffle) {  // the top-left row (a multiple of 64) and which corners lie in the level
        const uint32_t in_level = (x_in[0] && y_in[0] ? 1u : 0u) | (x_in[1] && y_in[0] ? 2u : 0u) |
                                  (x_in[0] && y_in[1] ? 4u : 0u) | (x_in[1] && y_in[1] ? 8u : 0u);
        top_left_words[i] = summed ? top_left | in_level : 0u;
      } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const uint32_t row = top_left + (k >> 1) * lv.pitch + (k & 1) * kRowBytes;
          const uint32_t swizzle = p.box_swizzle ? ((xr + (k & 1)) << 3) & 0x30u : (row >> 3) & 0x30u;
          corner_words[k][i] = (summed && x_in[k & 1] && y_in[k >> 1]) ? row ^ swizzle : zero_s;
        }
      }
    }
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const uint32_t slot = (lane + kSlotStride * s) * 16;
      mmdeform_tma::hopper::st_shared_v4(records_s + slot,
                                         make_uint4(b_words[s][0], b_words[s][1], b_words[s][2], b_words[s][3]));
      if constexpr (!kShuffle) {
        mmdeform_tma::hopper::st_shared_v4(records_s + kRecordBytes + slot, make_uint4(corner_words[s][0],
                                           corner_words[s][1], corner_words[s][2], corner_words[s][3]));
      }
    }
    __syncwarp();
    if (item % kGroups == 0) mmdeform_tma::hopper::mbarrier_wait(&full[l & 1], (l >> 1) & 1);

    const uint32_t corner_offset = (corner >> 1) * lv.pitch + (corner & 1) * kRowBytes;  // kShuffle
    auto pair_steps = [&](int pr) {
      uint4 b, address = make_uint4(0u, 0u, 0u, 0u);
      ld_shared_v4(b_read_s + 32 * pr, b);
      if constexpr (!kShuffle) ld_shared_v4(address_read_s + 32 * pr, address);
      const uint32_t bs[4] = {b.x, b.y, b.z, b.w}, as[4] = {address.x, address.y, address.z, address.w};
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        uint32_t row_address = as[s];
        if constexpr (kShuffle) {
          const uint32_t word = __shfl_sync(~0u, top_left_words[s], 2 * pr + pn);
          const uint32_t row = (word & ~63u) + corner_offset;
          row_address = ((word >> corner) & 1u) ? row ^ ((row >> 3) & 0x30u) : zero_s;
        }
        uint32_t a[4];
        ldmatrix_x4_trans(a, row_address ^ chunk_bits);
        mma_16x8x16<T>(acc[pr], a, bs[s] & mask0, bs[s] & mask1);
      }
    };
    if constexpr (kLean) {  // blocks of four pairs without a branch: the compiler interleaves their chains
#pragma unroll
      for (int block = 0; block < 4; ++block) {
        if (((live_queries >> (8 * block)) & 0xFFu) == 0) continue;  // warp-uniform: eight padding queries
#pragma unroll
        for (int pr = 4 * block; pr < 4 * block + 4; ++pr) pair_steps(pr);
      }
    } else {
#pragma unroll
      for (int pr = 0; pr < 16; ++pr) {
        if (((live_queries >> (2 * pr)) & 3u) == 0) continue;  // warp-uniform: two padding queries
        pair_steps(pr);
      }
    }

    // Points outside their window: the 16 lanes holding the query's sums add them from global memory.
    unsigned pending = __ballot_sync(~0u, outside != 0);
    while (pending) {
      const int src = __ffs(pending) - 1;
      pending &= pending - 1;
      const unsigned which = __shfl_sync(~0u, outside, src);
      const int64_t src_point = __shfl_sync(~0u, point0, src) + l * kPoints + 4 * (item % kGroups);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (!((which >> i) & 1) || (t >> 1) != (src & 1)) continue;
        const float2 xy = *reinterpret_cast<const float2*>(p.locations + 2 * (src_point + i));
        const float a = p.weights[src_point + i];
        const float x = xy.x * lv.width - 0.5f, y = xy.y * lv.height - 0.5f;
        const float x0 = floorf(x), y0 = floorf(y), fx = x - x0, fy = y - y0;
        const float wc[4] = {(1.f - fx) * (1.f - fy) * a, fx * (1.f - fy) * a, (1.f - fx) * fy * a, fx * fy * a};
        const int c0 = 16 * (t & 1) + g;
        const T* base = static_cast<const T*>(p.value) +
                        ((static_cast<int64_t>(blockIdx.z) * p.num_keys + lv.start) * p.heads + blockIdx.y) * 32;
        float v0 = 0.f, v1 = 0.f;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int yy = static_cast<int>(y0) + (k >> 1), xx = static_cast<int>(x0) + (k & 1);
          if (yy < 0 || xx < 0 || yy >= lv.height || xx >= lv.width) continue;
          const T* row = base + (static_cast<int64_t>(yy) * lv.width + xx) * p.heads * 32;
          v0 += wc[k] * HalfPair<T>::to_float(row[c0]);
          v1 += wc[k] * HalfPair<T>::to_float(row[c0 + 8]);
        }
        const int target = src >> 1;
#pragma unroll
        for (int pr = 0; pr < 16; ++pr) {  // every pair, so that acc stays in registers (no indexing)
          acc[pr][0] += pr == target ? v0 : 0.f;
          acc[pr][2] += pr == target ? v1 : 0.f;
        }
      }
    }

    // After a level's last group every warp leaves its window, which is then filled with level l + 2's:
    // kLean: by the last warp to leave (a count in shared memory; the others go on to level l + 1),
    // otherwise by thread 0 after a CTA barrier.
    if (item % kGroups == kGroups - 1 && l + 2 < p.levels) {
      if constexpr (kLean) {
        __syncwarp();
        unsigned before = 0;
        if (lane == 0) {
          __threadfence_block();  // this warp's window reads before its count
          before = atomicAdd(&released[l & 1], 1u);
        }
        if (lane == 0 && before == (static_cast<unsigned>(l >> 1) + 1) * kWarps - 1) {
          __threadfence_block();
          mmdeform_tma::hopper::fence_proxy_async_shared();
          issue_window(maps, p, l + 2, windows + 3 * (l + 2), (l & 1) ? buffer1 : smem, &full[l & 1]);
        }
      } else {
        __syncthreads();
        if (tid == 0) {
          mmdeform_tma::hopper::fence_proxy_async_shared();
          issue_window(maps, p, l + 2, windows + 3 * (l + 2), (l & 1) ? buffer1 : smem, &full[l & 1]);
        }
      }
    }
  }

  // D: lane (g, t) holds query 2 pr + (t >> 1), channels 16 (t & 1) + g (d0 hi, d1 lo) and + 8 (d2, d3).
  __syncwarp();
  T* stage = reinterpret_cast<T*>(smem + (records_s - smem_s));
  window_probe::stage_pair_sums<T, 16>(acc, stage, g, t);
  __syncwarp();
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int c = lane + 32 * i, row = c >> 2, j = c & 3;
    const int query = __shfl_sync(~0u, q, row);
    if (query >= 0) {
      T* out = static_cast<T*>(p.out) +
               ((static_cast<int64_t>(blockIdx.z) * p.num_queries + query) * p.heads + blockIdx.y) * 32;
      reinterpret_cast<uint4*>(out)[j] = reinterpret_cast<const uint4*>(stage + row * 32)[j];
    }
  }
#else
  __trap();
#endif
}

// The swizzle model's check: one window row box (box_width keys of head 0 from key 0) copied to shared memory
// at byte `offset` (a multiple of 128, not of 512), and the shared bytes [0, offset + box) written out raw.
__global__ void swizzle_dump(const __grid_constant__ CUtensorMap map, int bytes, int offset, uint32_t* out) {
#if MMDEFORM_TMA_HOPPER_DEVICE
  extern __shared__ __align__(1024) unsigned char smem[];
  __shared__ __align__(8) uint64_t bar;
  for (int i = threadIdx.x; i < (offset + bytes) / 4; i += blockDim.x) reinterpret_cast<uint32_t*>(smem)[i] = 0u;
  if (threadIdx.x == 0) {
    mmdeform_tma::hopper::mbarrier_init(&bar, 1);
    mmdeform_tma::hopper::fence_mbarrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    mmdeform_tma::hopper::fence_proxy_async_shared();
    mmdeform_tma::hopper::mbarrier_arrive_expect_tx(&bar, static_cast<uint32_t>(bytes));
    mmdeform_tma::hopper::tma_load_2d(smem + offset, &map, 0, 0, &bar);
  }
  mmdeform_tma::hopper::mbarrier_wait(&bar, 0);
  for (int i = threadIdx.x; i < (offset + bytes) / 4; i += blockDim.x) out[i] = reinterpret_cast<uint32_t*>(smem)[i];
#else
  __trap();
#endif
}

#ifndef PROBE_KERNEL_ONLY
PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status{};
    TORCH_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                                 &status) == cudaSuccess && fn != nullptr);
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// The package's value map (hopper/tensor_map.cpp) with SWIZZLE_64B and a box of a window row.
CUtensorMap window_row_map(const torch::Tensor& value, int box_width) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(value.size(2) * 32),
                              static_cast<cuuint64_t>(value.size(0) * value.size(1))};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(value.size(2) * 32 * 2)};
  const cuuint32_t box[2] = {32, static_cast<cuuint32_t>(box_width)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult result = encoder()(
      &map,
      value.scalar_type() == torch::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
      value.data_ptr(), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_64B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(result == CUDA_SUCCESS, "cuTensorMapEncodeTiled: ", static_cast<int>(result));
  return map;
}

template <typename T, int kPoints, int kWarps, bool kLean, bool kShuffle>
void launch(const LevelMaps& maps, const Params& p, int ctas, int heads, int batch, int64_t bytes) {
  auto kernel = window_tma_forward<T, kPoints, kWarps, kLean, kShuffle>;
  static int64_t allowed = 0;  // set once a size: not inside a graph capture
  if (bytes > allowed) {
    TORCH_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)) ==
                cudaSuccess, "shared memory: ", bytes, " bytes");
    allowed = bytes;
  }
  kernel<<<dim3(ctas, heads, batch), kWarps * 32, bytes, at::cuda::getCurrentCUDAStream()>>>(maps, p);
  TORCH_CHECK(cudaGetLastError() == cudaSuccess);
}

}  // namespace

// geometry: per level height, width, first key, box width and window row pitch (bytes), from the host (no device
// read: the call is captured in CUDA graphs).
void run(torch::Tensor value, torch::Tensor locations, torch::Tensor weights, torch::Tensor tiles,
         torch::Tensor windows, std::vector<int64_t> geometry, std::vector<int64_t> buffer_bytes, torch::Tensor out,
         bool box_swizzle, int64_t version) {
  const int levels = static_cast<int>(geometry.size() / 5);
  TORCH_CHECK(value.size(3) == 32 && levels <= kMaxLevels && geometry.size() == 5u * levels,
              "the probe takes 32 channels and up to 4 levels");
  TORCH_CHECK(buffer_bytes.size() == 2 && locations.size(3) == levels);
  TORCH_CHECK(version != 2 || !box_swizzle, "the shuffle version takes the shared-address swizzle");
  const int points = static_cast<int>(locations.size(4)), warps = static_cast<int>(tiles.size(1) / 32);
  LevelMaps maps{};
  Params p{};
  p.value = value.data_ptr();
  p.locations = locations.data_ptr<float>();
  p.weights = weights.data_ptr<float>();
  p.tiles = tiles.data_ptr<int32_t>();
  p.windows = windows.data_ptr<int32_t>();
  p.out = out.data_ptr();
  for (int l = 0; l < levels; ++l) {
    const int64_t* g = geometry.data() + 5 * l;
    p.level[l] = {static_cast<int>(g[0]), static_cast<int>(g[1]), static_cast<int>(g[2]), static_cast<int>(g[3]),
                  static_cast<int>(g[4])};
    maps.map[l] = window_row_map(value, static_cast<int>(g[3]));
  }
  p.num_keys = static_cast<int>(value.size(1));
  p.num_queries = static_cast<int>(locations.size(1));
  p.heads = static_cast<int>(value.size(2));
  p.levels = levels;
  p.buffer_bytes[0] = static_cast<int>(buffer_bytes[0]);
  p.buffer_bytes[1] = static_cast<int>(buffer_bytes[1]);
  p.box_swizzle = box_swizzle ? 1 : 0;
  const int64_t bytes = buffer_bytes[0] + buffer_bytes[1] + warps * kWarpRecordBytes;
  const int ctas = static_cast<int>(tiles.size(0)), heads = p.heads, batch = static_cast<int>(value.size(0));
  const bool bf16 = value.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || value.scalar_type() == torch::kHalf, "fp16 or bf16");
#define PROBE_CASE(P, VERSION, LEAN, SHUFFLE)                                                         \
  if (points == P && version == VERSION) {                                                            \
    if (bf16)                                                                                         \
      launch<__nv_bfloat16, P, 6, LEAN, SHUFFLE>(maps, p, ctas, heads, batch, bytes);                 \
    else                                                                                              \
      launch<__half, P, 6, LEAN, SHUFFLE>(maps, p, ctas, heads, batch, bytes);                        \
    return;                                                                                           \
  }
  PROBE_CASE(4, 1, true, false)
  PROBE_CASE(8, 1, true, false)
  PROBE_CASE(4, 2, true, true)
  PROBE_CASE(8, 2, true, true)
  PROBE_CASE(4, 0, false, false)
#undef PROBE_CASE
  TORCH_CHECK(false, "the probe takes 4 or 8 points (versions 1 lean and 2 shuffle) or 4 (version 0 barrier)");
}

torch::Tensor swizzle_check(torch::Tensor value, int64_t box_width, int64_t offset) {
  const CUtensorMap map = window_row_map(value, static_cast<int>(box_width));
  const int bytes = static_cast<int>(box_width) * kRowBytes;
  auto out = torch::empty({(offset + bytes) / 4}, value.options().dtype(torch::kInt32));
  TORCH_CHECK(cudaFuncSetAttribute(swizzle_dump, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   static_cast<int>(offset + bytes)) == cudaSuccess);
  swizzle_dump<<<1, 128, offset + bytes, at::cuda::getCurrentCUDAStream()>>>(
      map, bytes, static_cast<int>(offset), reinterpret_cast<uint32_t*>(out.data_ptr()));
  TORCH_CHECK(cudaGetLastError() == cudaSuccess);
  return out;
}
#else
template __global__ void window_tma_forward<__half, 4, 6, true, false>(const __grid_constant__ LevelMaps,
                                                                        const __grid_constant__ Params);
template __global__ void window_tma_forward<__half, 4, 6, true, true>(const __grid_constant__ LevelMaps,
                                                                       const __grid_constant__ Params);
template __global__ void window_tma_forward<__half, 4, 6, false, false>(const __grid_constant__ LevelMaps,
                                                                         const __grid_constant__ Params);
template __global__ void window_tma_forward<__nv_bfloat16, 8, 6, true, true>(const __grid_constant__ LevelMaps,
                                                                              const __grid_constant__ Params);
}  // namespace
#endif
