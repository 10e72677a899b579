// The operator schema of mmdeform_tma, and what the extension was built with.
//
// Implementations register beside their kernels:
//   CUDA       csrc/cuda/dispatch_cuda.cpp (routes to the cuda and tma_ws kernels)
//   Autograd   csrc/autograd.cpp (C++, so a call's backward runs no Python)
//   CPU, fake  mmdeform_tma/library.py (the CPU kernel is the PyTorch reference)
#include <torch/extension.h>
#include <torch/library.h>

#include "common/kernel_catalog.h"

#ifndef MMDEFORM_TMA_WITH_CUDA
#define MMDEFORM_TMA_WITH_CUDA 0
#endif
#if MMDEFORM_TMA_WITH_CUDA
#include <cuda.h>  // CUDA_VERSION
#endif
#ifndef MMDEFORM_TMA_WITH_HOPPER
#define MMDEFORM_TMA_WITH_HOPPER 0
#endif
#if MMDEFORM_TMA_WITH_HOPPER
#include <c10/cuda/CUDAGuard.h>

#include "hopper/region_forward.h"
#endif
#define MMDEFORM_TMA_STRINGIFY_ARGS(...) #__VA_ARGS__
#define MMDEFORM_TMA_STRINGIFY(...) MMDEFORM_TMA_STRINGIFY_ARGS(__VA_ARGS__)

TORCH_LIBRARY(mmdeform_tma, m) {
  m.set_python_module("mmdeform_tma.library");
  // `backend` names the kernel family ("cuda", "tma_ws" on CUDA; "pytorch" on CPU).
  // `config` indexes that family's kernel variants (kernel_configs); -1 lets the kernel choose.
  // The forward carries its backward's choice (None: the forward's backend), decided with the
  // forward's and per direction, so that autograd needs no lookup when the backward runs.
  m.def(
      "ms_deform_attn_forward(Tensor value, Tensor spatial_shapes, Tensor level_start_index, "
      "Tensor sampling_locations, Tensor attention_weights, str backend, int config, "
      "str? backward_backend=None, int backward_config=-1) -> Tensor");
  m.def(
      "ms_deform_attn_backward(Tensor grad_output, Tensor value, Tensor spatial_shapes, "
      "Tensor level_start_index, Tensor sampling_locations, Tensor attention_weights, str backend, "
      "int config, bool deterministic) -> (Tensor, Tensor, Tensor)");
}

namespace {

pybind11::dict build_info() {
  pybind11::dict info;
  info["with_cuda"] = static_cast<bool>(MMDEFORM_TMA_WITH_CUDA);
  info["with_hopper"] = static_cast<bool>(MMDEFORM_TMA_WITH_HOPPER);
#if MMDEFORM_TMA_WITH_CUDA
  info["cuda_archs"] = std::string(MMDEFORM_TMA_STRINGIFY(MMDEFORM_TMA_CUDA_ARCHS));
  info["cuda_version"] = CUDA_VERSION;
#else
  info["cuda_archs"] = std::string();
  info["cuda_version"] = pybind11::none();
#endif
  info["torch_version"] = std::string(TORCH_VERSION);
  return info;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mmdeform_tma compiled extension: operator schema and CUDA kernels";
  m.def("build_info", &build_info, "What this extension was compiled with");
  m.def(
      "kernel_configs",
      [](const std::string& backend, const std::string& direction) {
        return mmdeform_tma::kernel_config_names(backend, direction);
      },
      "Names of a backend's compiled kernel variants for 'forward' or 'backward', in `config` order");
#if MMDEFORM_TMA_WITH_HOPPER
  m.def(
      "_region_forward_alone",
      [](const at::Tensor& value, const at::Tensor& spatial_shapes, const at::Tensor& level_start_index,
         const at::Tensor& sampling_locations, const at::Tensor& attention_weights, const std::string& config) {
        const c10::cuda::CUDAGuard guard(value.device());
        const mmdeform_tma::ProblemTensors problem = mmdeform_tma::check_problem(
            value.contiguous(), spatial_shapes.contiguous(), level_start_index.contiguous(),
            sampling_locations.contiguous(), attention_weights.contiguous(), "_region_forward_alone");
        return mmdeform_tma::tma_ws::region_forward_alone(problem, config);
      },
      "Test hook: a region forward config's kernel without its fallback: (output, spread flag)");
#endif
}
