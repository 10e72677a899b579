// Autograd of the mmdeform_tma ops, in C++ as torchvision registers its ops': the forward op's
// backward is the backward op, called from the autograd engine without entering Python. The
// backward's backend and config come with the forward call (chosen per direction by the Python
// dispatcher); `deterministic` is read when the backward runs, as PyTorch's own ops do.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

namespace mmdeform_tma {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor forward_op(
    const at::Tensor& value,
    const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index,
    const at::Tensor& sampling_locations,
    const at::Tensor& attention_weights,
    c10::string_view backend,
    int64_t config,
    std::optional<c10::string_view> backward_backend,
    int64_t backward_config) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mmdeform_tma::ms_deform_attn_forward", "")
                             .typed<decltype(forward_op)>();
  return op.call(
      value, spatial_shapes, level_start_index, sampling_locations, attention_weights, backend, config,
      backward_backend, backward_config);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_op(
    const at::Tensor& grad_output,
    const at::Tensor& value,
    const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index,
    const at::Tensor& sampling_locations,
    const at::Tensor& attention_weights,
    c10::string_view backend,
    int64_t config,
    bool deterministic) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mmdeform_tma::ms_deform_attn_backward", "")
                             .typed<decltype(backward_op)>();
  return op.call(
      grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights, backend, config,
      deterministic);
}

class MSDAFunction : public torch::autograd::Function<MSDAFunction> {
 public:
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& value,
      const at::Tensor& spatial_shapes,
      const at::Tensor& level_start_index,
      const at::Tensor& sampling_locations,
      const at::Tensor& attention_weights,
      c10::string_view backend,
      int64_t config,
      std::optional<c10::string_view> backward_backend,
      int64_t backward_config) {
    // Contiguous once here, so the backward reuses the copies of non-contiguous inputs.
    const at::Tensor v = value.contiguous(), shapes = spatial_shapes.contiguous(),
                     starts = level_start_index.contiguous(), loc = sampling_locations.contiguous(),
                     attn = attention_weights.contiguous();
    ctx->save_for_backward({v, shapes, starts, loc, attn});
    ctx->saved_data["backend"] = std::string(backward_backend.value_or(backend));
    ctx->saved_data["config"] = backward_config;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return forward_op(v, shapes, starts, loc, attn, backend, config, backward_backend, backward_config);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    auto [grad_value, grad_locations, grad_weights] = backward_op(
        grad_outputs[0].contiguous(), saved[0], saved[1], saved[2], saved[3], saved[4],
        ctx->saved_data["backend"].toStringRef(), ctx->saved_data["config"].toInt(),
        at::globalContext().deterministicAlgorithms());
    // One entry per forward argument; level geometry, names and configs have no gradient.
    return {grad_value, at::Tensor(), at::Tensor(), grad_locations, grad_weights,
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor forward_autograd(
    const at::Tensor& value,
    const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index,
    const at::Tensor& sampling_locations,
    const at::Tensor& attention_weights,
    c10::string_view backend,
    int64_t config,
    std::optional<c10::string_view> backward_backend,
    int64_t backward_config) {
  return MSDAFunction::apply(
      value, spatial_shapes, level_start_index, sampling_locations, attention_weights, backend, config,
      backward_backend, backward_config);
}

}  // namespace

TORCH_LIBRARY_IMPL(mmdeform_tma, Autograd, m) {
  m.impl("ms_deform_attn_forward", &forward_autograd);
  // No double backward: a graph through the gradients raises instead of treating them as constants.
  m.impl("ms_deform_attn_backward", torch::autograd::autogradNotImplementedFallback());
}

}  // namespace mmdeform_tma
