"""The reference multi-scale deformable attention, written with `grid_sample`.

Non-finite inputs follow out = sum(attention x bilinear sample), where a sample reads only the
corners inside the level: NaN / Inf in value reach every output whose point has that corner
inside (even with bilinear weight 0); NaN / Inf attention weights make their output non-finite
even for a point outside the level (Inf x 0 = NaN); a NaN / Inf sampling location lies outside
every level, so its sample is zero, as are its location gradients. Which outputs are non-finite
is the contract every backend keeps; NaN against Inf may differ with the order of operations.

It computes in the widest dtype of its inputs (fp32 locations with an fp16 value sample in fp32)
and returns value's dtype. It reads the level shapes on the host, so with `spatial_shapes` on a
GPU it synchronises once per call. `ms_deform_attn_reference_backward` is its explicit gradient
(no autograd inside), the CPU kernel of the backward op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_BILINEAR, _ZEROS = 0, 0  # grid_sampler_2d's interpolation and padding codes


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _levels(value, spatial_shapes, sampling_locations, dtype):
    """Per level: value as (bs*heads, ch, h, w) and the grid as (bs*heads, queries, points, 2)."""
    bs, _, heads, channels = value.shape
    shapes = [(int(h), int(w)) for h, w in spatial_shapes.tolist()]
    values = value.to(dtype).split([h * w for h, w in shapes], dim=1)
    locations = sampling_locations.to(dtype)
    grids = 2 * locations - 1
    for level, (h, w) in enumerate(shapes):
        # mmcv's and the kernels' rule: a point is sampled only when -1 < pixel coordinate < size.
        # grid_sample would also read a point exactly at -1 (its far corner, with weight 0, passes
        # on a NaN there) and NaN / Inf locations (its CPU path returns NaN); both move to -3,
        # outside every level, where sample and location gradients are zero.
        x, y = locations[..., level, :, 0] * w - 0.5, locations[..., level, :, 1] * h - 0.5
        inside = ((x > -1) & (x < w) & (y > -1) & (y < h))[..., None]
        level_grid = torch.where(inside, grids[:, :, :, level], torch.full_like(grids[:, :, :, level], -3.0))
        level_value = values[level].flatten(2).transpose(1, 2).reshape(bs * heads, channels, h, w)
        yield level_value, level_grid.transpose(1, 2).flatten(0, 1)


def _is_empty(value, sampling_locations) -> bool:
    return value.shape[0] == 0 or value.shape[2] == 0 or value.shape[3] == 0 or 0 in sampling_locations.shape[1:5]


def ms_deform_attn_reference(
    value: torch.Tensor,
    spatial_shapes: torch.Tensor,
    sampling_locations: torch.Tensor,
    attention_weights: torch.Tensor,
) -> torch.Tensor:
    """Multi-scale deformable attention as bilinear `grid_sample` per level (align_corners=False,
    zero padding), weighted by the attention weights and summed over levels and points."""
    bs, _, heads, channels = value.shape
    _, queries, _, levels, points, _ = sampling_locations.shape
    if _is_empty(value, sampling_locations):
        return value.new_zeros((bs, queries, heads * channels))
    dtype = _compute_dtype(value, sampling_locations, attention_weights)
    sampled = []
    for level_value, level_grid in _levels(value, spatial_shapes, sampling_locations, dtype):
        if level_value.numel() == 0:  # a 0 x w level: every corner is outside it
            sampled.append(level_value.new_zeros((bs * heads, channels, queries, points)))
        else:
            sampled.append(F.grid_sample(level_value, level_grid, mode="bilinear", padding_mode="zeros", align_corners=False))
    # (bs, queries, heads, levels, points) -> (bs*heads, 1, queries, levels*points)
    weights = attention_weights.to(dtype).transpose(1, 2).reshape(bs * heads, 1, queries, levels * points)
    output = (torch.stack(sampled, dim=-2).flatten(-2) * weights).sum(-1)
    return output.view(bs, heads * channels, queries).transpose(1, 2).contiguous().to(value.dtype)


def ms_deform_attn_reference_backward(
    grad_output: torch.Tensor,
    value: torch.Tensor,
    spatial_shapes: torch.Tensor,
    sampling_locations: torch.Tensor,
    attention_weights: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `ms_deform_attn_reference` with respect to value, locations and weights."""
    bs, num_keys, heads, channels = value.shape
    _, queries, _, levels, points, _ = sampling_locations.shape
    if _is_empty(value, sampling_locations):
        return torch.zeros_like(value), torch.zeros_like(sampling_locations), torch.zeros_like(attention_weights)
    dtype = _compute_dtype(value, sampling_locations, attention_weights, grad_output)
    # (bs, queries, heads*ch) -> (bs*heads, ch, queries, 1)
    grad = grad_output.to(dtype).view(bs, queries, heads, channels).permute(0, 2, 3, 1).reshape(bs * heads, channels, queries, 1)
    weights = attention_weights.to(dtype).transpose(1, 2).reshape(bs * heads, queries, levels, points)
    grad_values, grad_grids, grad_weights = [], [], []
    for level, (level_value, level_grid) in enumerate(_levels(value, spatial_shapes, sampling_locations, dtype)):
        if level_value.numel() == 0:
            grad_values.append(level_value.new_zeros(level_value.shape))
            grad_grids.append(level_grid.new_zeros(level_grid.shape))
            grad_weights.append(level_grid.new_zeros((bs * heads, queries, points)))
            continue
        sampled = F.grid_sample(level_value, level_grid, mode="bilinear", padding_mode="zeros", align_corners=False)
        grad_weights.append((grad * sampled).sum(1))  # (bs*heads, queries, points)
        grad_sampled = grad * weights[:, None, :, level]  # (bs*heads, ch, queries, points)
        grad_value, grad_grid = torch.ops.aten.grid_sampler_2d_backward(
            grad_sampled, level_value, level_grid, _BILINEAR, _ZEROS, False, [True, True]
        )
        grad_values.append(grad_value)
        grad_grids.append(grad_grid)
    # (bs*heads, ch, h, w) per level -> (bs, num_keys, heads, ch)
    grad_value = torch.cat([g.flatten(2) for g in grad_values], dim=2).view(bs, heads, channels, num_keys).permute(0, 3, 1, 2)
    # (bs*heads, queries, points, 2) per level -> (bs, queries, heads, levels, points, 2); d grid / d loc = 2
    grad_locations = 2 * torch.stack(grad_grids, dim=2).view(bs, heads, queries, levels, points, 2).transpose(1, 2)
    grad_attention = torch.stack(grad_weights, dim=2).view(bs, heads, queries, levels, points).transpose(1, 2)
    return (
        grad_value.contiguous().to(value.dtype),
        grad_locations.contiguous().to(sampling_locations.dtype),
        grad_attention.contiguous().to(attention_weights.dtype),
    )
