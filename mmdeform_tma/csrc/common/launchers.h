// Entry points of each compiled backend, called by the CUDA dispatch (csrc/cuda/dispatch_cuda.cpp).
// `config` indexes the backend's registered variants; -1 lets the launcher choose.
#pragma once

#include <ATen/ATen.h>

#include "problem.h"

namespace mmdeform_tma {

#define MMDEFORM_TMA_DECLARE_BACKEND(NS)                                                              \
  namespace NS {                                                                                      \
  at::Tensor forward(const ProblemTensors& problem, int64_t config);                                  \
  Gradients backward(const ProblemTensors& problem, const at::Tensor& grad_output, int64_t config,    \
                     bool deterministic);                                                             \
  }

MMDEFORM_TMA_DECLARE_BACKEND(portable)
MMDEFORM_TMA_DECLARE_BACKEND(tma)
MMDEFORM_TMA_DECLARE_BACKEND(tma_ws)

#undef MMDEFORM_TMA_DECLARE_BACKEND

// Grad tensors for locations and weights, in the coord dtype the kernels write.
inline std::pair<at::Tensor, at::Tensor> coordinate_gradients(const ProblemTensors& problem) {
  return {at::empty_like(problem.sampling_locations), at::empty_like(problem.attention_weights)};
}

}  // namespace mmdeform_tma
