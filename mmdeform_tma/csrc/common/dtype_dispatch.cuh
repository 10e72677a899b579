// Runs a lambda with `scalar_t` bound to the CUDA type of value's dtype (__half, __nv_bfloat16,
// float, double), the types the device code is written in.
#pragma once

#include <ATen/ATen.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define MMDEFORM_TMA_DISPATCH_VALUE_TYPES(DTYPE, WHAT, ...)                              \
  [&] {                                                                                  \
    switch (DTYPE) {                                                                     \
      case at::kHalf: {                                                                  \
        using scalar_t = __half;                                                         \
        return __VA_ARGS__();                                                            \
      }                                                                                  \
      case at::kBFloat16: {                                                              \
        using scalar_t = __nv_bfloat16;                                                  \
        return __VA_ARGS__();                                                            \
      }                                                                                  \
      case at::kFloat: {                                                                 \
        using scalar_t = float;                                                          \
        return __VA_ARGS__();                                                            \
      }                                                                                  \
      case at::kDouble: {                                                                \
        using scalar_t = double;                                                         \
        return __VA_ARGS__();                                                            \
      }                                                                                  \
      default:                                                                           \
        TORCH_CHECK(false, WHAT, ": value dtype ", c10::toString(DTYPE), " is not supported"); \
    }                                                                                    \
  }()
