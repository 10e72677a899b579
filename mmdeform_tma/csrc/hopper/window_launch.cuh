// Host side shared by the window kernels' launchers: occupancy (cached per kernel and launch
// shape, so a call costs no driver query), the persistent grid, and the value tensor map.
#pragma once

#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

#include "../common/cuda_runtime_utils.h"
#include "tensor_map.h"
#include "window_config.h"

namespace mmdeform_tma {
namespace hopper {
namespace window {

// CTAs of `kernel` one SM holds with `threads` threads and `bytes` of dynamic shared memory, cached
// per (kernel, device, threads, bytes): the first launch of a kernel on a device also raises its
// dynamic shared-memory limit to what the device leaves beside its static shared memory.
inline int blocks_per_multiprocessor(const void* kernel, int threads, int bytes) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, int, int>, int> cache;  // kernel, device, threads, bytes
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(kernel, device, threads, bytes);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  dynamic_shared_limit(kernel);
  int blocks = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, bytes));
  TORCH_CHECK(blocks > 0, "mmdeform_tma tma_ws: a CTA of ", num(threads), " threads and ", num(bytes),
              " bytes of shared memory does not fit on an SM");
  cache.emplace(key, blocks);
  return blocks;
}

// The same for a window kernel's launch shape.
inline int blocks_per_multiprocessor(const void* kernel, const LaunchShape& s) {
  return blocks_per_multiprocessor(kernel, 32 * (1 + s.consumer_warps), s.total_bytes);
}

// The persistent grid of `kernel`: as many CTAs as the SMs hold, fewer for small problems (at most
// one per (batch, head, key): the tile count's bound).
template <typename Kernel>
int64_t persistent_blocks(Kernel kernel, const ProblemTensors& problem, const LaunchShape& s) {
  const int64_t resident =
      static_cast<int64_t>(blocks_per_multiprocessor(reinterpret_cast<const void*>(kernel), s)) * multiprocessor_count();
  const int64_t bound = problem.batch * problem.heads * std::max<int64_t>(problem.queries, problem.num_keys);
  return std::max<int64_t>(1, std::min(resident, bound));
}

// Launches `kernel(map, problem, shape, args...)` on `blocks` CTAs. persistent_blocks must have run for
// the kernel and shape: it raises the kernel's shared-memory limit.
template <typename scalar_t, typename Kernel, typename... Args>
void launch_on_grid(Kernel kernel, int64_t blocks, const ProblemTensors& problem, const LaunchShape& s, Args... args) {
  const int threads = 32 * (1 + s.consumer_warps);
  const at::Tensor source = problem.batch * problem.num_keys > 0
                                ? problem.value
                                : at::zeros({1, 1, problem.heads, problem.channels}, problem.value.options());
  const CUtensorMap map = value_tensor_map(source, s.window_cols);
  kernel<<<static_cast<unsigned>(blocks), threads, s.total_bytes, current_stream()>>>(map, problem.problem<scalar_t>(), s,
                                                                                       args...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Launches `kernel(args..., problem, shape)`, a kernel that reads no tensor map, on its persistent
// grid: the host encodes no map, and the kernel's own parameters begin the parameter bank, not
// behind a 128-byte aligned map. Each 64-byte line of the bank that a warp's prologue first reads
// is a constant-cache miss, taken one after another (ncu, H100: 6 % of the windowless forward's
// stall samples; perf_notes.md, items 105-106).
template <typename scalar_t, typename Kernel, typename... Args>
void launch_persistent_without_map(Kernel kernel, const ProblemTensors& problem, const LaunchShape& s, Args... args) {
  const int64_t blocks = persistent_blocks(kernel, problem, s);
  const int threads = 32 * (1 + s.consumer_warps);
  kernel<<<static_cast<unsigned>(blocks), threads, s.total_bytes, current_stream()>>>(args..., problem.problem<scalar_t>(),
                                                                                       s);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Launches `kernel(map, problem, shape, args...)` on its persistent grid.
template <typename scalar_t, typename Kernel, typename... Args>
void launch_persistent(Kernel kernel, const ProblemTensors& problem, const LaunchShape& s, Args... args) {
  launch_on_grid<scalar_t>(kernel, persistent_blocks(kernel, problem, s), problem, s, args...);
}

}  // namespace window
}  // namespace hopper
}  // namespace mmdeform_tma
