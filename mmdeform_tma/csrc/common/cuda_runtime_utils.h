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

}  // namespace mmdeform_tma
