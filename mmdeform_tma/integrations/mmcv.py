"""Makes mmcv's `MultiScaleDeformableAttention` accept `backend=`.

mmdet's layers import the class directly and call it with the config dict as keyword arguments,
Co-DETR builds it through the registry, and `init_weights` finds it with `isinstance`. So the class
object itself is patched in place (not replaced): `__init__` takes `backend` and `forward`
dispatches through `mmdeform_tma.multi_scale_deformable_attn`. Parameters, their names and their
initialisation are untouched, so state dicts load both ways with stock mmcv.

`backend` is one of 'auto', 'tma_ws', 'cuda', 'mmcv', 'pytorch'. `MMDEFORM_TMA_BACKEND`, when
set, decides it for every module built in the process, whatever the config says: one switch to
run the same config on another kernel. With neither, the module keeps mmcv's own forward exactly.
The patched forward differs from mmcv's only where mmcv is wrong or slow: no host-synchronising
`assert` on the shapes, the attention softmax is taken in fp32, and the sampling locations and
attention weights are never downcast to value's dtype (they stay fp32 under AMP).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

ENV_VAR = "MMDEFORM_TMA_BACKEND"
_install_error: str | None = None


def install_error() -> str | None:
    """Why the patch could not be installed (None when installed or mmcv is absent)."""
    return _install_error


def resolve_backend(backend: str | None) -> str | None:
    """The module's backend: MMDEFORM_TMA_BACKEND if set, else the argument, else None (mmcv's own)."""
    from ..dispatch import BACKEND_CHOICES, unknown_backend_message

    if os.environ.get(ENV_VAR):
        backend, source = os.environ[ENV_VAR], f"from {ENV_VAR}"
    else:
        source = "from its backend argument"
    if backend is not None and backend not in BACKEND_CHOICES:
        raise ValueError(f"MultiScaleDeformableAttention {source}: {unknown_backend_message(backend)}")
    return backend


def sampling_locations_from(reference_points, sampling_offsets, spatial_shapes, num_points):
    """mmcv's location formula: offsets in pixels of each level, or relative to a reference box."""
    if reference_points.shape[-1] == 2:
        offset_normalizer = torch.stack([spatial_shapes[..., 1], spatial_shapes[..., 0]], -1)
        return (
            reference_points[:, :, None, :, None, :]
            + sampling_offsets / offset_normalizer[None, None, None, :, None, :]
        )
    if reference_points.shape[-1] == 4:
        return (
            reference_points[:, :, None, :, None, :2]
            + sampling_offsets / num_points * reference_points[:, :, None, :, None, 2:] * 0.5
        )
    raise ValueError(f"Last dim of reference_points must be 2 or 4, but get {reference_points.shape[-1]} instead.")


def backend_forward(
    self,
    query,
    key=None,
    value=None,
    identity=None,
    query_pos=None,
    key_padding_mask=None,
    reference_points=None,
    spatial_shapes=None,
    level_start_index=None,
    **kwargs,
):
    """mmcv's forward with the kernel chosen by `self.backend`."""
    from ..functional import multi_scale_deformable_attn

    if value is None:
        value = query
    if identity is None:
        identity = query
    if query_pos is not None:
        query = query + query_pos
    if not self.batch_first:
        query = query.permute(1, 0, 2)
        value = value.permute(1, 0, 2)
    bs, num_query, _ = query.shape
    _, num_value, _ = value.shape

    value = self.value_proj(value)
    if key_padding_mask is not None:
        value = value.masked_fill(key_padding_mask[..., None], 0.0)
    value = value.view(bs, num_value, self.num_heads, -1)
    sampling_offsets = self.sampling_offsets(query).view(
        bs, num_query, self.num_heads, self.num_levels, self.num_points, 2
    )
    attention_weights = self.attention_weights(query).view(bs, num_query, self.num_heads, self.num_levels * self.num_points)
    # softmax in fp32 whatever autocast does (CUDA's already does; CPU's would keep bf16)
    attention_weights = attention_weights.float().softmax(-1).view(
        bs, num_query, self.num_heads, self.num_levels, self.num_points
    )
    sampling_locations = sampling_locations_from(reference_points, sampling_offsets, spatial_shapes, self.num_points)
    output = multi_scale_deformable_attn(
        value,
        spatial_shapes,
        level_start_index,
        sampling_locations,
        attention_weights,
        backend=self.backend,
        im2col_step=self.im2col_step,
    )
    output = self.output_proj(output)
    if not self.batch_first:
        output = output.permute(1, 0, 2)
    return self.dropout(output) + identity


def install_bf16_focal_loss() -> None:
    """mmcv's sigmoid focal loss has no bf16 CUDA kernel, and under bf16 AMP the DETR heads' class
    scores are bf16: compute that loss in fp32 (its gradient returns in bf16) instead of failing.
    The one non-MSDA patch here; without it no DETR-family model trains with --amp bf16."""
    from mmcv.ops import focal_loss

    cls = focal_loss.SigmoidFocalLossFunction
    if getattr(cls, "_mmdeform_tma_bf16", False):
        return
    mmcv_forward = cls.forward

    def forward(ctx, input, target, gamma=2.0, alpha=0.25, weight=None, reduction="mean"):
        if input.dtype == torch.bfloat16:
            input = input.float()
            weight = weight.float() if weight is not None and weight.dtype == torch.bfloat16 else weight
        return mmcv_forward(ctx, input, target, gamma, alpha, weight, reduction)

    cls.forward = staticmethod(forward)
    cls._mmdeform_tma_bf16 = True


def install() -> None:
    """Patch mmcv.ops.MultiScaleDeformableAttention in place (idempotent)."""
    from mmcv.ops import multi_scale_deform_attn
    from mmengine.utils import deprecated_api_warning

    cls = multi_scale_deform_attn.MultiScaleDeformableAttention
    if getattr(cls, "_mmdeform_tma_installed", False):
        return
    mmcv_init = cls.__init__
    mmcv_forward = cls.forward

    @functools.wraps(mmcv_init)
    def __init__(self, *args, backend: str | None = None, **kwargs):
        mmcv_init(self, *args, **kwargs)
        self.backend = resolve_backend(backend)

    @deprecated_api_warning({"residual": "identity"}, cls_name="MultiScaleDeformableAttention")
    def forward(self, *args, **kwargs):
        if getattr(self, "backend", None) is None:
            return mmcv_forward(self, *args, **kwargs)
        return backend_forward(self, *args, **kwargs)

    forward.__doc__ = mmcv_forward.__doc__
    cls.__init__ = __init__
    cls.forward = forward
    cls._mmdeform_tma_installed = True
    install_bf16_focal_loss()


def install_if_available() -> None:
    global _install_error
    if importlib.util.find_spec("mmcv") is None:
        return
    try:
        install()
    except Exception as exc:  # e.g. mmcv-lite (no mmcv.ops) or a broken mmcv build
        _install_error = f"{type(exc).__name__}: {exc}"
