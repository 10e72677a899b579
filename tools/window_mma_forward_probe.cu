// A design probe for the encoder forward (perf_notes item 141), not a backend: windows of value rows in
// shared memory, read by ldmatrix and summed on the tensor cores.
//
// A CTA takes one (batch, head, tile of up to 64 queries). Per level, its 128 threads turn the tile's points
// into records (the four corner weights as half hi + lo pairs, the top-left corner's window pixel), take the
// points' bounding box, and copy that window of 64-byte value rows into shared memory with cp.async (zero fill
// outside the level: MSDA's padding). Then each warp sums 16 queries as 8 pairs, one point of each query of a
// pair a step:
//
//   D[m][n] += A[m][k] B[k][n],  m16 n8 k16:
//   k = 8 pk + 4 ck + corner   (pk: the pair's query, ck: which 16 channels, corner: TL TR BL BR)
//   A[m][k] = value[corner of pk][16 ck + m]           (one ldmatrix.x4.trans: the two points' 8 rows)
//   n = 4 pn + 2 cn + h,  B[k][n] = weight_h(corner)  if pk = pn and ck = cn, else 0 (h: hi or lo half)
//   D[m][n] = query pn's channel 16 cn + m, hi or lo sum; the output is hi + lo.
//
// Each ldmatrix phase reads one point's four corners at two 16-byte chunks; the chunk of a row is stored at
// chunk ^ (y & 1), so the phase's eight rows fall in eight distinct 16-byte bank groups. A point whose
// corners leave the window (capped at max_pixels rows) is summed from global memory on the CUDA cores.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#ifndef PROBE_KERNEL_ONLY  // for a resource report on a machine without torch's CUDA headers (nvcc -DPROBE_KERNEL_ONLY
                           // -I mmdeform_tma/csrc/hopper -I <torch include>): the kernels alone
#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>
#endif

#include <climits>
#include <cstdint>

#include "mma_fragments.cuh"  // tools/window_mma_forward_probe.py puts mmdeform_tma/csrc/hopper on the include path
#include "window_probe_common.cuh"

namespace {

constexpr int kThreads = 128;
constexpr int kTileQueries = 64;
constexpr int kRowBytes = 64;  // 32 channels of 2 bytes
constexpr int kMaxLevels = 8;
constexpr int kStageBytes = 4 * 16 * kRowBytes;  // each warp's 16 output rows, staged in the records

using window_probe::HalfPair;
using mmdeform_tma::hopper::ldmatrix_x4_trans;  // the package's tensor-core pieces (mma_fragments.cuh)
using mmdeform_tma::hopper::mma_16x8x16;

__device__ __forceinline__ void copy_16_or_zero(uint32_t dst, const void* src, bool inside) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(inside ? 16 : 0));
}

struct Level {
  int height, width, start;
};

// One point's weight at one corner from global memory, with mmcv's bounds (the slow path).
template <typename T>
__device__ float corner_value(const T* value, int64_t row0, const Level& lv, int y, int x, int heads, int head,
                              int channel) {
  if (y < 0 || x < 0 || y >= lv.height || x >= lv.width) return 0.f;
  const int64_t key = row0 + lv.start + static_cast<int64_t>(y) * lv.width + x;
  return HalfPair<T>::to_float(value[(key * heads + head) * 32 + channel]);
}


struct Window {
  int x0, y0, width, height;
};

constexpr int kSlots = 3;  // records, pixels and boxes of three levels: the overlapped schedule prepares level
                           // l + 2 while level l is summed and level l + 1's window fills
constexpr int kBoxWords = 5;  // x min, x max, y min, y max, any point outside the window

// A CTA's shared state and its coordinates.
template <typename T, int kPoints>
struct TileState {
  static constexpr int kTilePoints = kTileQueries * kPoints;
  static constexpr int kPointsPerThread = kTilePoints / kThreads;
  static_assert(kTilePoints % kThreads == 0, "points must be even");
  const T* value;
  const float* locations;
  const float* weights;
  const Level* level_of;
  const int* queries;
  uint4* records;  // [kSlots][kTilePoints]: hi top, lo top, hi bottom, lo bottom
  int* pixels;     // [kSlots][kTilePoints]: -1 no contribution, -2 outside the window, else pixel << 1 | y & 1
  int* boxes;      // [kSlots][kBoxWords]
  uint32_t zero_s;
  int64_t row0;
  int tid, batch, head, heads, levels, num_queries, max_pixels, max_width;

  __device__ float3 fetch(int level, int i) const {
    const int n = tid + i * kThreads, q = queries[n / kPoints];
    if (q < 0) return make_float3(-10.f, -10.f, 0.f);  // outside every level: no contribution
    const int64_t at =
        ((((static_cast<int64_t>(batch) * num_queries + q) * heads + head) * levels + level) * kPoints) + n % kPoints;
    const float2 xy = *reinterpret_cast<const float2*>(locations + 2 * at);
    return make_float3(xy.x, xy.y, weights[at]);
  }

  // Level `level`'s records and the top-left corners (y0 + 1) << 16 | (x0 + 1); the box by atomics.
  __device__ void prepare(int level, const float3 (&point)[kPointsPerThread]) const {
    const Level lv = level_of[level];
    const int slot = level % kSlots;
    int xmin = INT_MAX, xmax = INT_MIN, ymin = INT_MAX, ymax = INT_MIN;
#pragma unroll
    for (int i = 0; i < kPointsPerThread; ++i) {
      const int n = tid + i * kThreads;
      float w[4] = {0.f, 0.f, 0.f, 0.f};
      int corner = -1;
      const float x = point[i].x * lv.width - 0.5f, y = point[i].y * lv.height - 0.5f, a = point[i].z;
      if (x > -1.f && y > -1.f && x < lv.width && y < lv.height) {  // mmcv's test: NaN is outside
        const float x0 = floorf(x), y0 = floorf(y), fx = x - x0, fy = y - y0;
        const int ix = static_cast<int>(x0), iy = static_cast<int>(y0);
        corner = ((iy + 1) << 16) | (ix + 1);
        w[0] = (1.f - fx) * (1.f - fy) * a;
        w[1] = fx * (1.f - fy) * a;
        w[2] = (1.f - fx) * fy * a;
        w[3] = fx * fy * a;
        xmin = min(xmin, ix);
        xmax = max(xmax, ix + 1);
        ymin = min(ymin, iy);
        ymax = max(ymax, iy + 1);
      }
      const uint32_t hi_top = HalfPair<T>::pack(w[0], w[1]), hi_bottom = HalfPair<T>::pack(w[2], w[3]);
      const float2 top = HalfPair<T>::unpack(hi_top), bottom = HalfPair<T>::unpack(hi_bottom);
      records[slot * kTilePoints + n] = make_uint4(hi_top, HalfPair<T>::pack(w[0] - top.x, w[1] - top.y), hi_bottom,
                                                   HalfPair<T>::pack(w[2] - bottom.x, w[3] - bottom.y));
      pixels[slot * kTilePoints + n] = corner;
    }
    xmin = __reduce_min_sync(~0u, xmin);
    xmax = __reduce_max_sync(~0u, xmax);
    ymin = __reduce_min_sync(~0u, ymin);
    ymax = __reduce_max_sync(~0u, ymax);
    if ((tid & 31) == 0) {
      int* box = boxes + slot * kBoxWords;
      atomicMin(box + 0, xmin);
      atomicMax(box + 1, xmax);
      atomicMin(box + 2, ymin);
      atomicMax(box + 3, ymax);
    }
  }

  __device__ Window window_of(int level) const {
    const int* box = boxes + (level % kSlots) * kBoxWords;
    if (box[0] > box[1]) return {0, 0, 1, 1};  // no point contributes
    Window w{box[0], box[2], min(box[1] - box[0] + 1, max_width), 0};
    w.height = min(box[3] - box[2] + 1, max_pixels / w.width);
    return w;
  }

  __device__ void reset_box(int level) const {
    if (tid < 4) boxes[(level % kSlots) * kBoxWords + tid] = (tid & 1) ? INT_MIN : INT_MAX;
  }
  __device__ void reset_outside_flag(int level) const {
    if (tid == 0) boxes[(level % kSlots) * kBoxWords + 4] = 0;
  }
  __device__ bool any_outside(int level) const { return boxes[(level % kSlots) * kBoxWords + 4] != 0; }

  // The thread's own points of `level`: top-left corner -> window pixel word, or -2 outside the window.
  __device__ void place(int level, const Window& win) const {
    const int slot = level % kSlots;
#pragma unroll
    for (int i = 0; i < kPointsPerThread; ++i) {
      int* at = pixels + slot * kTilePoints + tid + i * kThreads;
      const int corner = *at;
      if (corner < 0) continue;
      const int iy = (corner >> 16) - 1, xr = (corner & 0xFFFF) - 1 - win.x0, yr = iy - win.y0;
      const bool inside = xr >= 0 && yr >= 0 && xr + 1 < win.width && yr + 1 < win.height;
      *at = inside ? (((yr * win.width + xr) << 1) | (iy & 1)) : -2;
      if (!inside) boxes[slot * kBoxWords + 4] = 1;
    }
  }

  // cp.async of the window's rows, zero outside the level; the caller commits and waits.
  __device__ void fill(int level, const Window& win, uint32_t window_s) const {
    const Level lv = level_of[level];
    const int warp = tid >> 5, lane = tid & 31;
    for (int r = warp; r < win.height; r += kThreads / 32) {
      const int gy = win.y0 + r;
      for (int c = lane; c < 4 * win.width; c += 32) {
        const int gx = win.x0 + (c >> 2), j = c & 3;
        const bool inside = gx >= 0 && gy >= 0 && gx < lv.width && gy < lv.height;
        const T* src = inside ? value + ((row0 + lv.start + static_cast<int64_t>(gy) * lv.width + gx) * heads + head) *
                                            32 + 8 * j
                              : value;
        copy_16_or_zero(window_s + (r * win.width + (c >> 2)) * kRowBytes + ((j ^ (gy & 1)) << 4), src, inside);
      }
    }
    asm volatile("cp.async.commit_group;\n" ::);
  }

  // The warp's 16 queries (8 pairs) over one level's points.
  __device__ void sum(int level, const Window& win, uint32_t window_s, float (&acc)[8][4]) const {
    const int slot = level % kSlots, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    // ldmatrix: lane i gives row (i & 7) of matrix i >> 3: the pair's query i >> 4, corner i & 3, chunk
    // 2 ((i >> 2) & 1) + ((i >> 3) & 1). B: lane (g, t) holds n = g (query g >> 2, chunk half (g >> 1) & 1,
    // hi or lo g & 1) at k = 2t, 2t + 1 (b0) and 2t + 8, 2t + 9 (b1): corners 2 (t & 1), + 1 at chunk half
    // t >> 1 of query 0 (b0) or 1 (b1).
    const int my_point = lane >> 4, corner_dy = (lane >> 1) & 1;
    const int chunk = 2 * ((lane >> 2) & 1) + ((lane >> 3) & 1);
    const int word = 2 * (t & 1) + (g & 1);
    const bool live = ((g >> 1) & 1) == (t >> 1);
    const uint32_t mask0 = (live && g < 4) ? ~0u : 0u, mask1 = (live && g >= 4) ? ~0u : 0u;
    const int corner_offset = corner_dy * win.width + (lane & 1);
    const uint4* rec = records + slot * kTilePoints;
    const int* pix = pixels + slot * kTilePoints;
#pragma unroll
    for (int pr = 0; pr < 8; ++pr) {
      const int q_local = 16 * warp + 2 * pr;
      if (queries[q_local] < 0 && queries[q_local + 1] < 0) continue;
#pragma unroll
      for (int p = 0; p < kPoints; ++p) {
        const int n = (q_local + my_point) * kPoints + p;
        const uint32_t wword = reinterpret_cast<const uint32_t*>(rec + n)[word];
        const int pw = pix[n];
        const uint32_t address =
            pw >= 0 ? window_s + ((pw >> 1) + corner_offset) * kRowBytes + ((chunk ^ ((pw ^ corner_dy) & 1)) << 4)
                    : zero_s;
        uint32_t a[4];
        ldmatrix_x4_trans(a, address);
        mma_16x8x16<T>(acc[pr], a, wword & mask0, wword & mask1);
      }
    }
    if (!any_outside(level)) return;
    // Points outside the window: the lanes holding their query's sums add them from global memory.
    const Level lv = level_of[level];
#pragma unroll
    for (int pr = 0; pr < 8; ++pr) {
      const int q_local = 16 * warp + 2 * pr + (t >> 1);
      for (int p = 0; p < kPoints; ++p) {
        if (pix[q_local * kPoints + p] != -2) continue;
        const int64_t at =
            ((((static_cast<int64_t>(batch) * num_queries + queries[q_local]) * heads + head) * levels + level) *
             kPoints) + p;
        const float2 xy = *reinterpret_cast<const float2*>(locations + 2 * at);
        const float a_w = weights[at];
        const float x = xy.x * lv.width - 0.5f, y = xy.y * lv.height - 0.5f;
        const float x0 = floorf(x), y0 = floorf(y), fx = x - x0, fy = y - y0;
        const float wc[4] = {(1.f - fx) * (1.f - fy) * a_w, fx * (1.f - fy) * a_w, (1.f - fx) * fy * a_w,
                             fx * fy * a_w};
        const int c0 = 16 * (t & 1) + g;
        for (int k = 0; k < 4; ++k) {
          const int yy = static_cast<int>(y0) + (k >> 1), xx = static_cast<int>(x0) + (k & 1);
          acc[pr][0] += wc[k] * corner_value(value, row0, lv, yy, xx, heads, head, c0);
          acc[pr][2] += wc[k] * corner_value(value, row0, lv, yy, xx, heads, head, c0 + 8);
        }
      }
    }
  }
};

// kOverlap: two windows, level l + 1's copied while level l is summed and level l + 2 prepared, one barrier a
// level. Otherwise one window: prepare, box, place, copy, wait, sum, two barriers a level.
template <typename T, int kPoints, bool kOverlap>
__global__ void __launch_bounds__(kThreads) window_mma_forward(
    const T* __restrict__ value, const int64_t* __restrict__ shapes, const int64_t* __restrict__ starts,
    const float* __restrict__ locations, const float* __restrict__ weights, const int32_t* __restrict__ tiles,
    T* __restrict__ out, int num_keys, int num_queries, int heads, int levels, int max_pixels, int max_width) {
  using State = TileState<T, kPoints>;
  constexpr int kTilePoints = State::kTilePoints, kPointsPerThread = State::kPointsPerThread;
  constexpr int kWindows = kOverlap ? 2 : 1;
  extern __shared__ __align__(128) unsigned char smem[];
  // kWindows windows of max_pixels rows, a zero row, records (at the end, the output stage), pixels, queries,
  // boxes
  unsigned char* zero_row = smem + kWindows * max_pixels * kRowBytes;
  uint4* records = reinterpret_cast<uint4*>(zero_row + kRowBytes);
  int* pixels = reinterpret_cast<int*>(records + kSlots * kTilePoints);
  int* queries = pixels + kSlots * kTilePoints;
  int* boxes = queries + kTileQueries;
  __shared__ Level level_of[kMaxLevels];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  if (tid < kTileQueries) queries[tid] = tiles[static_cast<int64_t>(blockIdx.x) * kTileQueries + tid];
  if (tid < levels) level_of[tid] = {static_cast<int>(shapes[2 * tid]), static_cast<int>(shapes[2 * tid + 1]),
                                     static_cast<int>(starts[tid])};
  if (tid < kSlots * kBoxWords) boxes[tid] = (tid % kBoxWords == 4) ? 0 : (tid % kBoxWords) & 1 ? INT_MIN : INT_MAX;
  if (tid < kRowBytes / 4) reinterpret_cast<uint32_t*>(zero_row)[tid] = 0u;
  const uint32_t window_s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const State st{value, locations, weights, level_of, queries, records, pixels, boxes,
                 static_cast<uint32_t>(__cvta_generic_to_shared(zero_row)),
                 static_cast<int64_t>(blockIdx.z) * num_keys, tid, static_cast<int>(blockIdx.z),
                 static_cast<int>(blockIdx.y), heads, levels, num_queries, max_pixels, max_width};
  __syncthreads();

  float acc[8][4];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
  float3 ahead[kPointsPerThread];  // a later level's locations and weights, loaded while this one is summed
#pragma unroll
  for (int i = 0; i < kPointsPerThread; ++i) ahead[i] = st.fetch(0, i);

  if constexpr (!kOverlap) {
    for (int l = 0; l < levels; ++l) {
      float3 current[kPointsPerThread];
#pragma unroll
      for (int i = 0; i < kPointsPerThread; ++i) {
        current[i] = ahead[i];
        if (l + 1 < levels) ahead[i] = st.fetch(l + 1, i);
      }
      st.reset_outside_flag(l);  // its last readers summed level l - 3 before two barriers
      st.prepare(l, current);
      __syncthreads();  // the box; every warp is past level l - 1's sum
      const Window win = st.window_of(l);
      st.place(l, win);
      st.fill(l, win, window_s);
      asm volatile("cp.async.wait_all;\n" ::);
      __syncthreads();  // the window and the pixels
      st.reset_box(l);  // read above by every thread, before the barrier
      st.sum(l, win, window_s, acc);
    }
  } else {
    st.prepare(0, ahead);
    if (levels > 1) {
#pragma unroll
      for (int i = 0; i < kPointsPerThread; ++i) ahead[i] = st.fetch(1, i);
      st.prepare(1, ahead);
    }
    __syncthreads();  // boxes 0 and 1
    Window win = st.window_of(0);
    st.place(0, win);
    st.fill(0, win, window_s);
    asm volatile("cp.async.wait_all;\n" ::);
    __syncthreads();  // window 0, its pixels
    for (int l = 0; l < levels; ++l) {
      st.reset_box(l);  // read by window_of(l) before the last barrier; next taken by level l + 3
      if (l > 0) st.reset_outside_flag(l - 1);  // level l - 1 summed before the last barrier
      Window next{};
      if (l + 1 < levels) {  // its buffer was summed (level l - 1) before the last barrier
        next = st.window_of(l + 1);
        st.place(l + 1, next);
        st.fill(l + 1, next, window_s + ((l + 1) & 1) * max_pixels * kRowBytes);
      }
      if (l + 2 < levels) {
#pragma unroll
        for (int i = 0; i < kPointsPerThread; ++i) ahead[i] = st.fetch(l + 2, i);
      }
      st.sum(l, win, window_s + (l & 1) * max_pixels * kRowBytes, acc);
      if (l + 2 < levels) st.prepare(l + 2, ahead);  // its slot was summed (level l - 1) before the last barrier
      asm volatile("cp.async.wait_all;\n" ::);
      __syncthreads();  // window l + 1, its pixels; box l + 2
      win = next;
    }
  }

  // D: lane (g, t) holds query t >> 1 of each pair, channels 16 (t & 1) + g (d0 hi, d1 lo) and + 8 (d2, d3).
  static_assert(kSlots * kTilePoints * sizeof(uint4) >= kStageBytes, "the stage takes the records' place");
  __syncthreads();  // every warp is past its last read of the records
  T* my_stage = reinterpret_cast<T*>(records) + warp * 16 * 32;
  window_probe::stage_pair_sums<T, 8>(acc, my_stage, g, t);
  __syncwarp();
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int c = lane + 32 * i, row = c >> 2, j = c & 3;
    const int q = queries[16 * warp + row];
    if (q >= 0) {
      reinterpret_cast<uint4*>(out + ((static_cast<int64_t>(blockIdx.z) * num_queries + q) * heads + blockIdx.y) *
                                         32)[j] = reinterpret_cast<const uint4*>(my_stage + row * 32)[j];
    }
  }
}

#ifndef PROBE_KERNEL_ONLY
template <typename T, int kPoints, bool kOverlap>
void launch(const torch::Tensor& value, const torch::Tensor& shapes, const torch::Tensor& starts,
            const torch::Tensor& locations, const torch::Tensor& weights, const torch::Tensor& tiles,
            torch::Tensor& out, int max_pixels, int max_width) {
  const int levels = static_cast<int>(shapes.size(0));
  const int64_t bytes = ((kOverlap ? 2 : 1) * max_pixels + 1) * kRowBytes +
                        kSlots * kTileQueries * kPoints * (16 + 4) + kTileQueries * 4 +
                        kSlots * kBoxWords * 4;
  auto kernel = window_mma_forward<T, kPoints, kOverlap>;
  static int64_t allowed = 0;  // set once a size: not inside a graph capture
  if (bytes > allowed) {
    TORCH_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(bytes)) == cudaSuccess, "shared memory: ", bytes, " bytes");
    allowed = bytes;
  }
  const dim3 grid(static_cast<unsigned>(tiles.size(0)), static_cast<unsigned>(value.size(2)),
                  static_cast<unsigned>(value.size(0)));
  kernel<<<grid, kThreads, bytes, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const T*>(value.data_ptr()), shapes.data_ptr<int64_t>(), starts.data_ptr<int64_t>(),
      locations.data_ptr<float>(), weights.data_ptr<float>(), tiles.data_ptr<int32_t>(),
      reinterpret_cast<T*>(out.data_ptr()), static_cast<int>(value.size(1)), static_cast<int>(locations.size(1)),
      static_cast<int>(value.size(2)), levels, max_pixels, max_width);
  TORCH_CHECK(cudaGetLastError() == cudaSuccess);
}

template <typename T, int kPoints>
void launch_schedule(bool overlap, const torch::Tensor& value, const torch::Tensor& shapes,
                     const torch::Tensor& starts, const torch::Tensor& locations, const torch::Tensor& weights,
                     const torch::Tensor& tiles, torch::Tensor& out, int max_pixels, int max_width) {
  if (overlap)
    launch<T, kPoints, true>(value, shapes, starts, locations, weights, tiles, out, max_pixels, max_width);
  else
    launch<T, kPoints, false>(value, shapes, starts, locations, weights, tiles, out, max_pixels, max_width);
}

}  // namespace

void run(torch::Tensor value, torch::Tensor shapes, torch::Tensor starts, torch::Tensor locations,
         torch::Tensor weights, torch::Tensor tiles, torch::Tensor out, int64_t max_pixels, int64_t max_width,
         bool overlap) {
  TORCH_CHECK(value.size(3) == 32 && shapes.size(0) <= kMaxLevels, "the probe takes 32 channels, up to 8 levels");
  TORCH_CHECK(max_width >= 2 && max_pixels >= 2 * max_width, "windows of at least two rows and columns");
  const int points = static_cast<int>(locations.size(4));
  const bool bf16 = value.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || value.scalar_type() == torch::kHalf, "fp16 or bf16");
  const int mp = static_cast<int>(max_pixels), mw = static_cast<int>(max_width);
#define PROBE_POINTS(P)                                                                                         \
  if (points == P) {                                                                                            \
    if (bf16)                                                                                                   \
      launch_schedule<__nv_bfloat16, P>(overlap, value, shapes, starts, locations, weights, tiles, out, mp, mw); \
    else                                                                                                        \
      launch_schedule<__half, P>(overlap, value, shapes, starts, locations, weights, tiles, out, mp, mw);       \
    return;                                                                                                     \
  }
  PROBE_POINTS(2)
  PROBE_POINTS(4)
  PROBE_POINTS(8)
#undef PROBE_POINTS
  TORCH_CHECK(false, "the probe takes 2, 4 or 8 points");
}
#else
template __global__ void window_mma_forward<__half, 4, false>(const __half*, const int64_t*, const int64_t*,
                                                             const float*, const float*, const int32_t*, __half*, int,
                                                             int, int, int, int, int);
template __global__ void window_mma_forward<__half, 4, true>(const __half*, const int64_t*, const int64_t*,
                                                            const float*, const float*, const int32_t*, __half*, int,
                                                            int, int, int, int, int);
template __global__ void window_mma_forward<__nv_bfloat16, 8, true>(const __nv_bfloat16*, const int64_t*,
                                                                   const int64_t*, const float*, const float*,
                                                                   const int32_t*, __nv_bfloat16*, int, int, int, int,
                                                                   int, int);
}  // namespace
#endif
