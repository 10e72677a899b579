// `tma_ws` forward, the tensor-core gather configs (`tc_*`): fp16/bf16 rows of 32 channels. No
// window, TMA or shared memory: one warp per item (batch, query, head), its corners gathered from
// global memory through L1 and summed by m16n8k16 products. It wins on decoders, where a tile's
// queries share no window and the pipelined kernels' producer is latency on the critical path:
// DETR decoder bs 2 fp16, 13.3 us against 17.3 for the pipelined kernel's table config; it loses
// on encoders (208 against 156 us), whose pipelined kernel hides the gathers' latency behind its
// producer (H100, 2026-11-26, commit 8036bfa; perf_notes.md, session 29).
//
// The product, per warp and step (8 points: two slots of four, each slot one query-head's points):
//   A (16 x 16): row r = a channel of one slot, k = a corner: lane (g, t) loads the 16-byte chunk
//     `chunk` of point t's four corners in slot `slot`, and the k pairs (2t, 2t + 1) = (top-left,
//     top-right), (2t + 8, 2t + 9) = (bottom-left, bottom-right) come from one byte permute of two
//     corners' registers. Four products cover the chunk's 8 channels (rows g and g + 8 each).
//   B (16 x 8): column n < 4 is slot n / 2's corner weights, hi (n even) or lo (n odd): an fp32 weight
//     as two 16-bit numbers (mma_fragments.cuh); columns 4-7 are zero. A slot's output is its rows
//     times its two columns; the other slot's columns land in lanes nobody reads.
// Both slots are the same item's points (steps of 8 over its levels x points), so the item's output
// is the sum of the two slots' results, one shuffle apart.
#include <c10/cuda/CUDAException.h>

#include "../common/cuda_runtime_utils.h"
#include "mma_fragments.cuh"
#include "tensor_core_forward.h"
#include "tensor_map.h"
#include "tma_primitives.cuh"

namespace mmdeform_tma {
namespace tma_ws {
namespace {

using hopper::window::TensorCoreForwardConfig;

constexpr int kChannels = 32;     // a head row: 64 bytes, four 16-byte chunks
constexpr int kPointsPerStep = 8;  // two slots of four points
constexpr int kMaxUnrolledSteps = 4;
constexpr int kMaxWarps = 8;  // the configs' largest CTA (tensor_core_forward_configs)

struct Args {
  const char* value;
  const int64_t* spatial_shapes;
  const int64_t* level_start;
  const float* locations;
  const float* weights;
  char* output;
  int num_items, num_keys, heads, levels, points, items_per_cta;
  FastDivisor by_heads, by_queries;
};

__device__ __align__(16) uint4 g_zero_chunk;  // zero-initialised: corners outside their level read it

#if MMDEFORM_TMA_HOPPER_DEVICE

__device__ __forceinline__ uint64_t mad_wide_s32(int a, int b, uint64_t c) {
  uint64_t d;
  asm("mad.wide.s32 %0, %1, %2, %3;" : "=l"(d) : "r"(a), "r"(b), "l"(c));
  return d;
}

__device__ __forceinline__ uint64_t mad_wide_u32(uint32_t a, uint32_t b, uint64_t c) {
  uint64_t d;
  asm("mad.wide.u32 %0, %1, %2, %3;" : "=l"(d) : "r"(a), "r"(b), "l"(c));
  return d;
}

__device__ __forceinline__ uint4 load_chunk(uint64_t address) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(address));
  return v;
}

__device__ __forceinline__ uint32_t byte_permute(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(selector));
  return r;
}

using hopper::pack_pair;
using hopper::unpack_pair;

// Two weights as this lane's B pair: hi parts, or (lo lanes) what the hi parts leave, 0 where
// the hi part is not finite so that an infinite weight is not turned into NaN.
template <typename scalar_t>
__device__ __forceinline__ uint32_t weight_pair(float w0, float w1, bool lo_lane) {
  const uint32_t hi = pack_pair<scalar_t>(w0, w1);
  if (!lo_lane) return hi;
  const float2 h = unpack_pair<scalar_t>(hi);
  return pack_pair<scalar_t>(isfinite(h.x) ? w0 - h.x : 0.f, isfinite(h.y) ? w1 - h.y : 0.f);
}

// One lane's point of one step: where it sits in the item's (level, point) list and its level.
struct StepPoint {
  int index;  // -1: past the item's points (a padding lane: weight 0, zero corners)
  int height, width;
  uint32_t start;      // the level's first key
  uint32_t row_bytes;  // one level row of keys
};

__device__ __forceinline__ StepPoint step_point(const Args& p, int step, int slot, int t, uint32_t key_bytes) {
  StepPoint s{-1, 0, 0, 0u, 0u};
  const int index = step * kPointsPerStep + slot * 4 + t;
  if (index < p.levels * p.points) {
    const int level = index / p.points;
    s.index = index;
    s.height = static_cast<int>(__ldg(p.spatial_shapes + 2 * level));
    s.width = static_cast<int>(__ldg(p.spatial_shapes + 2 * level + 1));
    s.start = static_cast<uint32_t>(__ldg(p.level_start + level));
    s.row_bytes = static_cast<uint32_t>(s.width) * key_bytes;
  }
  return s;
}

struct Sample {
  float x, y, weight;
};

__device__ __forceinline__ Sample load_sample(const Args& p, const StepPoint& s, int item, bool present) {
  Sample m{__int_as_float(0x7fffffff), __int_as_float(0x7fffffff), 0.f};  // NaN misses every level
  if (present && s.index >= 0) {
    const int64_t at = static_cast<int64_t>(item) * p.levels * p.points + s.index;
    const float2 xy = __ldg(reinterpret_cast<const float2*>(p.locations) + at);
    m = Sample{xy.x, xy.y, __ldg(p.weights + at)};
  }
  return m;
}

// A step's operands: the four corners' chunks and the B pair of each corner row.
struct StepOperands {
  uint4 corner[4];  // top-left, top-right, bottom-left, bottom-right
  uint32_t b0, b1;
};

// Bilinear sampling as device_utils.cuh's bilinear(): a point outside the level keeps weight `a`
// on every corner and reads zeros (a x 0; NaN for a non-finite weight, as the reference).
template <typename scalar_t>
__device__ __forceinline__ StepOperands gather_step(const Sample& m, const StepPoint& s, uint64_t item_base,
                                                    uint32_t key_bytes, float scale, bool provides_b, bool lo_lane) {
  const float a = provides_b ? m.weight * scale : 0.f;
  const float fh = static_cast<float>(s.height), fw = static_cast<float>(s.width);
  const float h_im = m.y * fh - 0.5f, w_im = m.x * fw - 0.5f;
  const bool inside = h_im > -1.f && w_im > -1.f && h_im < fh && w_im < fw;  // false for NaN
  const float yf = floorf(h_im), xf = floorf(w_im);
  const int y0 = inside ? static_cast<int>(yf) : -2, x0 = inside ? static_cast<int>(xf) : -2;
  float wtl = a, wtr = a, wbl = a, wbr = a;
  if (inside) {
    const float ly = h_im - yf, lx = w_im - xf;
    const float top = a * (1.f - ly), bottom = a * ly;
    wtl = top * (1.f - lx);
    wtr = top * lx;
    wbl = bottom * (1.f - lx);
    wbr = bottom * lx;
  }
  // Unsigned compares: -1 and -2 fail as the level's height or width does.
  const bool top = static_cast<unsigned>(y0) < static_cast<unsigned>(s.height);
  const bool bottom = static_cast<unsigned>(y0 + 1) < static_cast<unsigned>(s.height);
  const bool left = static_cast<unsigned>(x0) < static_cast<unsigned>(s.width);
  const bool right = static_cast<unsigned>(x0 + 1) < static_cast<unsigned>(s.width);
  const uint64_t level_base = mad_wide_u32(s.start, key_bytes, item_base);
  const uint64_t tl = mad_wide_s32(y0 * s.width + x0, static_cast<int>(key_bytes), level_base);
  const uint64_t tr = mad_wide_u32(key_bytes, 1u, tl);
  const uint64_t bl = mad_wide_u32(s.row_bytes, 1u, tl);
  const uint64_t br = mad_wide_u32(key_bytes, 1u, bl);
  const uint64_t zero = reinterpret_cast<uint64_t>(&g_zero_chunk);
  StepOperands o;
  o.corner[0] = load_chunk(top && left ? tl : zero);
  o.corner[1] = load_chunk(top && right ? tr : zero);
  o.corner[2] = load_chunk(bottom && left ? bl : zero);
  o.corner[3] = load_chunk(bottom && right ? br : zero);
  o.b0 = weight_pair<scalar_t>(wtl, wtr, lo_lane);
  o.b1 = weight_pair<scalar_t>(wbl, wbr, lo_lane);
  return o;
}

// acc[j] += A_j B for the chunk's register j (channels 2j, 2j + 1 in rows g, g + 8).
template <typename scalar_t>
__device__ __forceinline__ void multiply_step(float (&acc)[4][4], const StepOperands& o) {
  const uint32_t* tl = reinterpret_cast<const uint32_t*>(&o.corner[0]);
  const uint32_t* tr = reinterpret_cast<const uint32_t*>(&o.corner[1]);
  const uint32_t* bl = reinterpret_cast<const uint32_t*>(&o.corner[2]);
  const uint32_t* br = reinterpret_cast<const uint32_t*>(&o.corner[3]);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t a[4] = {byte_permute(tl[j], tr[j], 0x5410), byte_permute(tl[j], tr[j], 0x7632),
                           byte_permute(bl[j], br[j], 0x5410), byte_permute(bl[j], br[j], 0x7632)};
    hopper::mma_16x8x16<scalar_t>(acc[j], a, o.b0, o.b1);
  }
}

// A slot's weights scaled by a power of two that brings its largest finite one into [1, 2): fp16
// then holds every weight's hi part (no overflow past 65504, no subnormal loss for small ones),
// and the slot's output is scaled back exactly. Per slot, not per item: a slot's points are its
// four t lanes' in every step, and its B columns meet only its own rows' results.
// `largest`: the largest finite |weight| of this lane's own points.
__device__ __forceinline__ float slot_scale(float largest) {
  largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, 1));
  largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, 2));
  if (largest == 0.f) return 1.f;
  const int exponent = min(max(((__float_as_int(largest) >> 23) & 0xff) - 127, -126), 126);
  return __int_as_float((127 - exponent) << 23);
}

__device__ __forceinline__ float largest_finite(float largest, float weight) {
  return fmaxf(largest, isfinite(weight) ? fabsf(weight) : 0.f);
}

template <typename scalar_t>
__device__ __forceinline__ void store_item(const Args& p, float (&acc)[4][4], int item, int t, int slot, int chunk,
                                           float unscale) {
  uint32_t out[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    // hi + lo, unless hi is infinite: a lo column of 0 x Inf is NaN where the reference has Inf
    float r0 = (isinf(acc[j][0]) ? acc[j][0] : acc[j][0] + acc[j][1]) * unscale;
    float r1 = (isinf(acc[j][2]) ? acc[j][2] : acc[j][2] + acc[j][3]) * unscale;
    r0 += __shfl_xor_sync(0xffffffffu, r0, 9);  // the other slot's lane: g ^ 2, t ^ 1
    r1 += __shfl_xor_sync(0xffffffffu, r1, 9);
    out[j] = pack_pair<scalar_t>(r0, r1);
  }
  if (t == 0 && slot == 0) {
    *reinterpret_cast<uint4*>(p.output + static_cast<int64_t>(item) * (kChannels * sizeof(scalar_t)) + chunk * 16) =
        make_uint4(out[0], out[1], out[2], out[3]);
  }
}

#endif  // MMDEFORM_TMA_HOPPER_DEVICE

// STEPS > 0: the item's steps unrolled, each lane's level geometry kept in registers and the
// next item's samples loaded while this one is gathered. STEPS == 0: any number of steps, one at
// a time (more than 32 points per item).
template <typename scalar_t, int STEPS>
__global__ void __launch_bounds__(kMaxWarps * 32) tensor_core_forward_kernel(const __grid_constant__ Args p) {
#if MMDEFORM_TMA_HOPPER_DEVICE
  const int first = blockIdx.x * p.items_per_cta;
  auto poisoned = [&] {  // inconsistent level geometry: NaN outputs, and nothing read from value
    if (level_geometry_ok(p.spatial_shapes, p.level_start, p.levels, p.num_keys)) return false;
    const int64_t end = min(static_cast<int64_t>(first) + p.items_per_cta, static_cast<int64_t>(p.num_items)) * kChannels;
    for (int64_t i = static_cast<int64_t>(first) * kChannels + threadIdx.x; i < end; i += blockDim.x) {
      reinterpret_cast<scalar_t*>(p.output)[i] = quiet_nan<scalar_t>();
    }
    return true;
  };
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int slot = (g >> 1) & 1;
  const int chunk = (g & 1) | ((g >> 2) << 1);
  const bool provides_b = g < 4;
  const bool lo_lane = provides_b && (g & 1);
  const uint32_t key_bytes = static_cast<uint32_t>(p.heads * kChannels * sizeof(scalar_t));
  const int last = min(first + p.items_per_cta, p.num_items);
  auto item_base = [&](int item) {
    const uint32_t bq = p.by_heads.divide(static_cast<uint32_t>(item));
    const uint32_t b = p.by_queries.divide(bq);
    const int head = item - static_cast<int>(bq) * p.heads;
    return reinterpret_cast<uint64_t>(p.value) +
           static_cast<uint64_t>((static_cast<int64_t>(b) * p.num_keys * p.heads + head) * (kChannels * sizeof(scalar_t))) +
           static_cast<uint64_t>(chunk * 16);
  };
  int item = first + warp;
  if constexpr (STEPS > 0) {
    StepPoint sp[STEPS];
#pragma unroll
    for (int i = 0; i < STEPS; ++i) sp[i] = step_point(p, i, slot, t, key_bytes);
    Sample m[STEPS];
#pragma unroll
    for (int i = 0; i < STEPS; ++i) m[i] = load_sample(p, sp[i], item, item < last);
    // Checked after the first samples are requested (locations and weights are in bounds whatever
    // the geometry), so that the two round trips overlap.
    if (poisoned()) return;
    for (; item < last; item += warps) {
      float largest = 0.f;
#pragma unroll
      for (int i = 0; i < STEPS; ++i) largest = largest_finite(largest, m[i].weight);
      const float scale = slot_scale(largest);
      const uint64_t base = item_base(item);
      StepOperands o[STEPS];
#pragma unroll
      for (int i = 0; i < STEPS; ++i) o[i] = gather_step<scalar_t>(m[i], sp[i], base, key_bytes, scale, provides_b, lo_lane);
      const int next = item + warps;
#pragma unroll
      for (int i = 0; i < STEPS; ++i) m[i] = load_sample(p, sp[i], next, next < last);
      float acc[4][4] = {};
#pragma unroll
      for (int i = 0; i < STEPS; ++i) multiply_step<scalar_t>(acc, o[i]);
      store_item<scalar_t>(p, acc, item, t, slot, chunk, 1.f / scale);
    }
  } else {
    if (poisoned()) return;
    const int steps = (p.levels * p.points + kPointsPerStep - 1) / kPointsPerStep;
    for (; item < last; item += warps) {
      float largest = 0.f;
      for (int i = slot * 4 + t; i < p.levels * p.points; i += kPointsPerStep) {  // the lane's points in every step
        largest = largest_finite(largest, __ldg(p.weights + static_cast<int64_t>(item) * p.levels * p.points + i));
      }
      const float scale = slot_scale(largest);
      const uint64_t base = item_base(item);
      float acc[4][4] = {};
      for (int i = 0; i < steps; ++i) {
        const StepPoint sp = step_point(p, i, slot, t, key_bytes);
        const Sample m = load_sample(p, sp, item, true);
        multiply_step<scalar_t>(acc, gather_step<scalar_t>(m, sp, base, key_bytes, scale, provides_b, lo_lane));
      }
      store_item<scalar_t>(p, acc, item, t, slot, chunk, 1.f / scale);
    }
  }
#else
  __trap();
#endif
}

template <typename scalar_t>
void launch(const Args& args, int steps, int warps, int blocks) {
  const dim3 grid(static_cast<unsigned>(blocks)), block(static_cast<unsigned>(32 * warps));
  switch (steps) {
    case 1: tensor_core_forward_kernel<scalar_t, 1><<<grid, block, 0, current_stream()>>>(args); break;
    case 2: tensor_core_forward_kernel<scalar_t, 2><<<grid, block, 0, current_stream()>>>(args); break;
    case 3: tensor_core_forward_kernel<scalar_t, 3><<<grid, block, 0, current_stream()>>>(args); break;
    case 4: tensor_core_forward_kernel<scalar_t, 4><<<grid, block, 0, current_stream()>>>(args); break;
    default: tensor_core_forward_kernel<scalar_t, 0><<<grid, block, 0, current_stream()>>>(args); break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

std::string half_heads_of_32_unsupported(const ProblemTensors& problem, const std::string& forward) {
  const auto dtype = problem.value.scalar_type();
  if (dtype != at::kHalf && dtype != at::kBFloat16) {
    return forward + " takes float16 or bfloat16 values, not " + dtype_string(dtype);
  }
  if (problem.channels != kChannels) {
    return forward + " takes heads of 32 channels, not " + num(problem.channels);
  }
  return {};
}

std::string tensor_core_forward_unsupported(const ProblemTensors& problem) {
  return half_heads_of_32_unsupported(problem, "the tensor-core gather forward");
}

void tensor_core_forward(const ProblemTensors& problem, const TensorCoreForwardConfig& config, at::Tensor& output) {
  const std::string reason = tensor_core_forward_unsupported(problem);
  TORCH_CHECK(reason.empty(), "mmdeform_tma tma_ws: config ", config.name, ": ", reason);
  hopper::require_hopper("tma_ws");
  TORCH_CHECK(config.warps >= 1 && config.warps <= kMaxWarps, "mmdeform_tma tma_ws: config ", config.name, " has ",
              num(config.warps), " warps; the kernel is built for at most ", num(kMaxWarps));
  const int items_per_cta = config.warps * config.items_per_warp;
  const int64_t items = problem.num_items();
  const Args args{reinterpret_cast<const char*>(problem.value.data_ptr()),
                  problem.spatial_shapes.data_ptr<int64_t>(),
                  problem.level_start_index.data_ptr<int64_t>(),
                  problem.sampling_locations.data_ptr<float>(),
                  problem.attention_weights.data_ptr<float>(),
                  reinterpret_cast<char*>(output.data_ptr()),
                  static_cast<int>(items),
                  static_cast<int>(problem.num_keys),
                  static_cast<int>(problem.heads),
                  static_cast<int>(problem.levels),
                  static_cast<int>(problem.points),
                  items_per_cta,
                  fast_divisor(static_cast<uint32_t>(problem.heads)),
                  fast_divisor(static_cast<uint32_t>(problem.queries))};
  const int64_t steps = (problem.levels * problem.points + kPointsPerStep - 1) / kPointsPerStep;
  const int unrolled = steps <= kMaxUnrolledSteps ? static_cast<int>(steps) : 0;
  const int blocks = static_cast<int>((items + items_per_cta - 1) / items_per_cta);
  if (problem.value.scalar_type() == at::kHalf) {
    launch<__half>(args, unrolled, config.warps, blocks);
  } else {
    launch<__nv_bfloat16>(args, unrolled, config.warps, blocks);
  }
}

}  // namespace tma_ws
}  // namespace mmdeform_tma
