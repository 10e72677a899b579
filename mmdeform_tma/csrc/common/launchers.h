// Entry points of each compiled backend, called by the CUDA dispatch (csrc/cuda/dispatch_cuda.cpp).
// `config` indexes the backend's registered variants; -1 lets the launcher choose.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/EmptyTensor.h>

#include "problem.h"

namespace mmdeform_tma {

#define MMDEFORM_TMA_DECLARE_BACKEND(NS)                                                              \
  namespace NS {                                                                                      \
  at::Tensor forward(const ProblemTensors& problem, int64_t config);                                  \
  Gradients backward(const ProblemTensors& problem, const at::Tensor& grad_output, int64_t config,    \
                     bool deterministic);                                                             \
  }

MMDEFORM_TMA_DECLARE_BACKEND(portable)
MMDEFORM_TMA_DECLARE_BACKEND(tma_ws)

#undef MMDEFORM_TMA_DECLARE_BACKEND

// A contiguous CUDA tensor that kernels write in full before anything reads it. at::empty would
// also do, but under torch's deterministic mode it fills new memory (fill_uninitialized_memory, a
// guard against reads of garbage): ~35 µs per deterministic decoder backward (perf_notes,
// session 15), for memory that is overwritten anyway.
inline at::Tensor uninitialized(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return at::Tensor(at::detail::empty_cuda(sizes, options));
}

// Grad tensors for locations and weights, in the coord dtype the kernels write.
inline std::pair<at::Tensor, at::Tensor> coordinate_gradients(const ProblemTensors& problem) {
  return {uninitialized(problem.sampling_locations.sizes(), problem.sampling_locations.options()),
          uninitialized(problem.attention_weights.sizes(), problem.attention_weights.options())};
}

}  // namespace mmdeform_tma
