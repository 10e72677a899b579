"""Python registrations of mmdeform_tma's custom ops.

`torch.ops.mmdeform_tma.ms_deform_attn_forward` / `ms_deform_attn_backward` (schema in
`csrc/ops.cpp`), the compiled kernels:
  - CUDA kernel: C++, `csrc/cuda/dispatch_cuda.cpp` (the cuda and tma_ws kernels);
  - autograd: C++, `csrc/autograd.cpp`: the forward's backward is the backward op, with the
    backend and config the forward carries; double backward raises;
  - CPU kernel (here): the PyTorch reference, so the op, its autograd and torch.compile run on any
    machine;
  - fake (meta) kernels (here) for torch.compile / FakeTensor.

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


def forward_op():
    """The differentiable forward op, as an OpOverload (called with validated inputs; see functional)."""
    if not OPS_LOADED:
        raise RuntimeError("mmdeform_tma._C is not loaded, so its ops do not exist; see `python -m mmdeform_tma.info`")
    return torch.ops.mmdeform_tma.ms_deform_attn_forward.default


def _require_cpu_backend(*backends: str | None) -> None:
    for backend in backends:
        if backend not in (_CPU_BACKEND, None):
            raise RuntimeError(
                f"the CPU kernel of mmdeform_tma's ops is the {_CPU_BACKEND!r} reference; backend {backend!r} runs on CUDA"
            )


def _forward_cpu(
    value, spatial_shapes, level_start_index, sampling_locations, attention_weights, backend, config,
    backward_backend=None, backward_config=-1,
):
    _require_cpu_backend(backend, backward_backend)
    return ms_deform_attn_reference(value, spatial_shapes, sampling_locations, attention_weights)


def _backward_cpu(
    grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights, backend, config, deterministic
):
    _require_cpu_backend(backend)
    return ms_deform_attn_reference_backward(grad_output, value, spatial_shapes, sampling_locations, attention_weights)


def _forward_fake(
    value, spatial_shapes, level_start_index, sampling_locations, attention_weights, backend, config,
    backward_backend=None, backward_config=-1,
):
    bs, queries, heads = sampling_locations.shape[:3]
    return value.new_empty((bs, queries, heads * value.shape[3]))


def _backward_fake(
    grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights, backend, config, deterministic
):
    return torch.empty_like(value), torch.empty_like(sampling_locations), torch.empty_like(attention_weights)


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
