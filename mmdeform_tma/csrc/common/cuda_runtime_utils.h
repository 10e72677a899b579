// Small CUDA runtime queries for launchers (kept free of ATen/cuda/CUDAContext.h, which pulls in
// the cuBLAS/cuSPARSE headers).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <utility>

namespace mmdeform_tma {

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

inline int current_device_attribute(cudaDeviceAttr attribute) {
  int device = 0, value = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attribute, device));
  return value;
}

inline int multiprocessor_count() { return current_device_attribute(cudaDevAttrMultiProcessorCount); }

// The dynamic shared memory `kernel` may take beside its static shared memory on the current device;
// the first call per (kernel, device) raises the kernel's limit to it.
inline int dynamic_shared_limit(const void* kernel) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int> limits;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(kernel, device);
  const auto it = limits.find(key);
  if (it != limits.end()) return it->second;
  cudaFuncAttributes attributes{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
  const int limit =
      current_device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin) - static_cast<int>(attributes.sharedSizeBytes);
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, limit));
  limits.emplace(key, limit);
  return limit;
}

// Launches `kernel` as a programmatic dependent of the stream's previous kernel where the device
// has them (sm_90 and newer): its blocks may start once every block of that kernel has called
// allow_dependent_launch() (or exited), and must call wait_for_prior_grid() before they read what
// it wrote or write anything. Elsewhere, an ordinary launch.
template <typename... Params, typename... Args>
void launch_as_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                         Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  if (current_device_attribute(cudaDevAttrComputeCapabilityMajor) >= 9) {
    config.attrs = &attribute;
    config.numAttrs = 1;
  }
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace mmdeform_tma
