"""The public functional API."""

from __future__ import annotations

import torch

from . import dispatch


def multi_scale_deformable_attn(
    value: torch.Tensor,
    spatial_shapes: torch.Tensor,
    level_start_index: torch.Tensor,
    sampling_locations: torch.Tensor,
    attention_weights: torch.Tensor,
    *,
    backend: str = "auto",
    im2col_step: int | None = None,
) -> torch.Tensor:
    """Multi-scale deformable attention with mmcv's shapes and semantics.

    Args:
        value: (bs, num_keys, heads, channels), float16 / bfloat16 / float32 / float64.
        spatial_shapes: (levels, 2) int64, each level's (h, w); on the CPU or value's device.
        level_start_index: (levels,) int64, the running sum of h * w.
        sampling_locations: (bs, queries, heads, levels, points, 2), normalised (x, y) with
            align_corners=False semantics; float32 or value's dtype, never downcast.
        attention_weights: (bs, queries, heads, levels, points), float32 or value's dtype.
        backend: 'auto', or one of 'tma_ws', 'cuda', 'mmcv', 'pytorch'. A named backend
            that cannot run the inputs raises BackendUnavailableError with its reasons.
        im2col_step: accepted for mmcv compatibility and ignored; no batch-divisibility rule.

    Returns:
        (bs, queries, heads * channels) in value's dtype, differentiable with respect to value,
        sampling_locations and attention_weights. Corners outside a level contribute zero.

    Non-contiguous and expanded inputs are accepted; the compiled backends copy them contiguous.
    Validation, backend choice and tuning are made once per call signature (`dispatch.plan`);
    a repeated eager call costs a key and a dictionary lookup on the host.
    """
    if im2col_step is not None and (not isinstance(im2col_step, int) or im2col_step <= 0):
        raise ValueError(f"im2col_step must be a positive int or None, got {im2col_step!r}")
    args = (value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    if torch.compiler.is_compiling():  # traced once; the graph holds the decisions
        return dispatch.plan(backend, *args)(*args)
    key = dispatch.signature(backend, *args)
    try:
        launch = dispatch.PLANS[key]
    except (KeyError, TypeError):  # a new signature, or arguments that planning will reject
        launch = dispatch.plan(backend, *args, key=key)
    return launch(*args)
