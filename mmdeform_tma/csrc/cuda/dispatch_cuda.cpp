// The CUDA kernels of the mmdeform_tma ops: checks the arguments once and routes by `backend`.
// Inputs are made contiguous here (a no-op for contiguous ones), so callers need no copies.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <optional>

#include "../common/launchers.h"

namespace mmdeform_tma {
namespace {

at::Tensor forward_cuda(
    const at::Tensor& value,
    const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index,
    const at::Tensor& sampling_locations,
    const at::Tensor& attention_weights,
    c10::string_view backend,
    int64_t config,
    std::optional<c10::string_view> /*backward_backend: autograd's (csrc/autograd.cpp)*/,
    int64_t /*backward_config: autograd's*/) {
  const c10::cuda::CUDAGuard guard(value.device());
  const ProblemTensors problem = check_problem(
      value.contiguous(), spatial_shapes.contiguous(), level_start_index.contiguous(),
      sampling_locations.contiguous(), attention_weights.contiguous(), "ms_deform_attn_forward");
  if (backend == "cuda") return portable::forward(problem, config);
  if (backend == "tma_ws") return tma_ws::forward(problem, config);
  TORCH_CHECK(false, "ms_deform_attn_forward: the CUDA kernels are 'cuda' and 'tma_ws', not '", backend, "'");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cuda(
    const at::Tensor& grad_output,
    const at::Tensor& value,
    const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index,
    const at::Tensor& sampling_locations,
    const at::Tensor& attention_weights,
    c10::string_view backend,
    int64_t config,
    bool deterministic) {
  const c10::cuda::CUDAGuard guard(value.device());
  const ProblemTensors problem = check_problem(
      value.contiguous(), spatial_shapes.contiguous(), level_start_index.contiguous(),
      sampling_locations.contiguous(), attention_weights.contiguous(), "ms_deform_attn_backward");
  TORCH_CHECK(
      grad_output.scalar_type() == value.scalar_type() && grad_output.device() == value.device() &&
          grad_output.is_contiguous() &&
          grad_output.sizes() == at::IntArrayRef({problem.batch, problem.queries, problem.heads * problem.channels}),
      "ms_deform_attn_backward: grad_output must be a contiguous (bs, queries, heads * channels) tensor of value's "
      "dtype and device");
  Gradients grads;
  if (backend == "cuda") {
    grads = portable::backward(problem, grad_output, config, deterministic);
  } else if (backend == "tma_ws") {
    grads = tma_ws::backward(problem, grad_output, config, deterministic);
  } else {
    TORCH_CHECK(false, "ms_deform_attn_backward: the CUDA kernels are 'cuda' and 'tma_ws', not '", backend, "'");
  }
  auto& [grad_value, grad_locations, grad_weights] = grads;
  return {grad_value, grad_locations.to(sampling_locations.scalar_type()), grad_weights.to(attention_weights.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_IMPL(mmdeform_tma, CUDA, m) {
  m.impl("ms_deform_attn_forward", &forward_cuda);
  m.impl("ms_deform_attn_backward", &backward_cuda);
}

}  // namespace mmdeform_tma
