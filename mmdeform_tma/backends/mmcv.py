"""`mmcv`: mmcv's own compiled CUDA op, the baseline, unchanged in what it computes.

Like mmcv it casts the sampling locations and attention weights to value's dtype (in fp16 that
costs about 2e-2 relative error) and accumulates fp16 gradients with fp16 atomics. It is wrapped
as `torch.library` custom ops so that torch.compile traces it without graph breaks. mmcv's
`im2col_step` batch-divisibility rule is avoided by always passing the whole batch as one step.
"""

from __future__ import annotations

import functools

import torch

from ..inputs import MSDAInputs
from .base import Backend, Launch, on_device


@functools.cache
def _mmcv_ext():
    """mmcv's compiled `_ext` module with the two MSDA functions, or the reason it is unusable."""
    try:
        from mmcv.utils import ext_loader

        return ext_loader.load_ext("_ext", ["ms_deform_attn_forward", "ms_deform_attn_backward"]), None
    except Exception as exc:  # mmcv missing, mmcv-lite without ops, or an ABI mismatch
        return None, f"mmcv's compiled ops cannot be loaded ({type(exc).__name__}: {exc})"


@torch.compiler.assume_constant_result
def _mmcv_unavailable_reason() -> str:
    return _mmcv_ext()[1] or ""


@torch.library.custom_op("mmdeform_tma::mmcv_forward", mutates_args=())
def mmcv_forward(
    value: torch.Tensor,
    spatial_shapes: torch.Tensor,
    level_start_index: torch.Tensor,
    sampling_locations: torch.Tensor,
    attention_weights: torch.Tensor,
) -> torch.Tensor:
    ext, _ = _mmcv_ext()
    return ext.ms_deform_attn_forward(
        value,
        spatial_shapes,
        level_start_index,
        sampling_locations.to(value.dtype).contiguous(),
        attention_weights.to(value.dtype).contiguous(),
        im2col_step=max(1, value.shape[0]),
    )


@mmcv_forward.register_fake
def _(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    bs, queries, heads = sampling_locations.shape[:3]
    return value.new_empty((bs, queries, heads * value.shape[3]))


@torch.library.custom_op("mmdeform_tma::mmcv_backward", mutates_args=())
def mmcv_backward(
    grad_output: torch.Tensor,
    value: torch.Tensor,
    spatial_shapes: torch.Tensor,
    level_start_index: torch.Tensor,
    sampling_locations: torch.Tensor,
    attention_weights: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ext, _ = _mmcv_ext()
    locations = sampling_locations.to(value.dtype).contiguous()
    weights = attention_weights.to(value.dtype).contiguous()
    grad_value = torch.zeros_like(value)
    grad_locations = torch.zeros_like(locations)
    grad_weights = torch.zeros_like(weights)
    ext.ms_deform_attn_backward(
        value,
        spatial_shapes,
        level_start_index,
        locations,
        weights,
        grad_output.contiguous(),
        grad_value,
        grad_locations,
        grad_weights,
        im2col_step=max(1, value.shape[0]),
    )
    return grad_value, grad_locations.to(sampling_locations.dtype), grad_weights.to(attention_weights.dtype)


@mmcv_backward.register_fake
def _(grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    return torch.empty_like(value), torch.empty_like(sampling_locations), torch.empty_like(attention_weights)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad_output):
    grad_value, grad_locations, grad_weights = mmcv_backward(grad_output, *ctx.saved_tensors)
    return grad_value, None, None, grad_locations, grad_weights


mmcv_forward.register_autograd(_backward, setup_context=_setup_context)


class MMCVBackend(Backend):
    name = "mmcv"
    summary = "mmcv 2.x's compiled CUDA op (the baseline); fp16 locations, no bf16"
    devices = frozenset({"cuda"})
    dtypes = frozenset({torch.float16, torch.float32, torch.float64})
    deterministic = False

    def extra_reasons(self, inputs: MSDAInputs) -> list[str]:
        error = _mmcv_unavailable_reason()
        reasons = [error] if error else []
        if 0 in (inputs.batch, inputs.num_queries, inputs.num_heads, inputs.channels):
            reasons.append("mmcv's op cannot take an empty batch, query, head or channel dimension")
        return reasons

    def launcher(self, inputs: MSDAInputs, backward: Backend) -> Launch:
        shapes, starts = on_device(inputs.spatial_shapes, inputs.device), on_device(inputs.level_start_index, inputs.device)

        def launch(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
            return mmcv_forward(
                value.contiguous(), shapes(spatial_shapes), starts(level_start_index),
                sampling_locations.contiguous(), attention_weights.contiguous(),
            )

        return launch
