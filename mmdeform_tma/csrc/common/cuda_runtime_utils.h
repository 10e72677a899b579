// Small CUDA runtime queries for launchers (kept free of ATen/cuda/CUDAContext.h, which pulls in
// the cuBLAS/cuSPARSE headers).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

namespace mmdeform_tma {

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

inline int current_device_attribute(cudaDeviceAttr attribute) {
  int device = 0, value = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attribute, device));
  return value;
}

inline int multiprocessor_count() { return current_device_attribute(cudaDevAttrMultiProcessorCount); }

}  // namespace mmdeform_tma
