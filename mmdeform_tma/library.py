"""Python registrations of mmdeform_tma's custom ops.

`torch.ops.mmdeform_tma.ms_deform_attn_forward` / `ms_deform_attn_backward` (schema in
`csrc/ops.cpp`), the compiled kernels:
  - CUDA kernel: C++, `csrc/cuda/dispatch_cuda.cpp` (the cuda, tma and tma_ws kernels);
  - CPU kernel: the PyTorch reference, so the op, its autograd and torch.compile run on any machine;
  - fake (meta) kernels for torch.compile / FakeTensor;
  - autograd: the forward's backward is the backward op; double backward is not supported.

`torch.ops.mmdeform_tma.reference_forward` / `reference_backward` (defined here): the `pytorch`
backend as an op on every device, so that torch.compile treats it as one opaque call instead of
tracing grid_sample over level shapes that only exist as tensor values.
"""

from __future__ import annotations

import torch

from ._extension import extension
from .reference import ms_deform_attn_reference, ms_deform_attn_reference_backward

OPS_LOADED = extension() is not None
_CPU_BACKEND = "pytorch"


def ms_deform_attn(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, backend, config):
    """Differentiable call of the forward op (validated inputs; see mmdeform_tma.functional)."""
    if not OPS_LOADED:
        raise RuntimeError("mmdeform_tma._C is not loaded, so its ops do not exist; see `python -m mmdeform_tma.info`")
    return torch.ops.mmdeform_tma.ms_deform_attn_forward(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights, backend, config
    )


def _require_cpu_backend(backend: str) -> None:
    if backend != _CPU_BACKEND:
        raise RuntimeError(
            f"the CPU kernel of mmdeform_tma's ops is the {_CPU_BACKEND!r} reference; backend {backend!r} runs on CUDA"
        )


def _forward_cpu(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, backend, config):
    _require_cpu_backend(backend)
    return ms_deform_attn_reference(value, spatial_shapes, sampling_locations, attention_weights)


def _backward_cpu(
    grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights, backend, config, deterministic
):
    _require_cpu_backend(backend)
    return ms_deform_attn_reference_backward(grad_output, value, spatial_shapes, sampling_locations, attention_weights)


def _forward_fake(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, backend, config):
    bs, queries, heads = sampling_locations.shape[:3]
    return value.new_empty((bs, queries, heads * value.shape[3]))


def _backward_fake(
    grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights, backend, config, deterministic
):
    return torch.empty_like(value), torch.empty_like(sampling_locations), torch.empty_like(attention_weights)


def _setup_context(ctx, inputs, output):
    value, spatial_shapes, level_start_index, sampling_locations, attention_weights, backend, config = inputs
    ctx.save_for_backward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    ctx.backend = backend


def _backward(ctx, grad_output):
    from . import tuning
    from .inputs import MSDAInputs

    value, spatial_shapes, level_start_index, sampling_locations, attention_weights = ctx.saved_tensors
    config = tuning.kernel_config(
        ctx.backend, "backward", MSDAInputs.from_validated(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    )
    grad_value, grad_locations, grad_weights = torch.ops.mmdeform_tma.ms_deform_attn_backward(
        grad_output.contiguous(),
        value,
        spatial_shapes,
        level_start_index,
        sampling_locations,
        attention_weights,
        ctx.backend,
        config,
        torch.are_deterministic_algorithms_enabled(),
    )
    return grad_value, None, None, grad_locations, grad_weights, None, None


@torch.library.custom_op("mmdeform_tma::reference_forward", mutates_args=())
def reference_forward(
    value: torch.Tensor, spatial_shapes: torch.Tensor, sampling_locations: torch.Tensor, attention_weights: torch.Tensor
) -> torch.Tensor:
    return ms_deform_attn_reference(value, spatial_shapes, sampling_locations, attention_weights)


@reference_forward.register_fake
def _(value, spatial_shapes, sampling_locations, attention_weights):
    bs, queries, heads = sampling_locations.shape[:3]
    return value.new_empty((bs, queries, heads * value.shape[3]))


@torch.library.custom_op("mmdeform_tma::reference_backward", mutates_args=())
def reference_backward(
    grad_output: torch.Tensor,
    value: torch.Tensor,
    spatial_shapes: torch.Tensor,
    sampling_locations: torch.Tensor,
    attention_weights: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return ms_deform_attn_reference_backward(grad_output, value, spatial_shapes, sampling_locations, attention_weights)


@reference_backward.register_fake
def _(grad_output, value, spatial_shapes, sampling_locations, attention_weights):
    return torch.empty_like(value), torch.empty_like(sampling_locations), torch.empty_like(attention_weights)


def _reference_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _reference_backward(ctx, grad_output):
    value, spatial_shapes, sampling_locations, attention_weights = ctx.saved_tensors
    grad_value, grad_locations, grad_weights = reference_backward(
        grad_output.contiguous(), value, spatial_shapes, sampling_locations, attention_weights
    )
    return grad_value, None, grad_locations, grad_weights


reference_forward.register_autograd(_reference_backward, setup_context=_reference_setup_context)


if OPS_LOADED:
    _FORWARD = "mmdeform_tma::ms_deform_attn_forward"
    _BACKWARD = "mmdeform_tma::ms_deform_attn_backward"
    torch.library.register_kernel(_FORWARD, "cpu", _forward_cpu)
    torch.library.register_kernel(_BACKWARD, "cpu", _backward_cpu)
    torch.library.register_fake(_FORWARD, _forward_fake)
    torch.library.register_fake(_BACKWARD, _backward_fake)
    torch.library.register_autograd(_FORWARD, _backward, setup_context=_setup_context)
