"""Shared behaviour of the backends that run this project's compiled CUDA kernels."""

from __future__ import annotations

from typing import ClassVar

import torch

from .. import _extension, library, tuning
from ..inputs import MSDAInputs
from .base import Backend, device_capability


class CompiledKernelBackend(Backend):
    """Calls `torch.ops.mmdeform_tma.ms_deform_attn_forward` with `backend=self.name`.

    Autograd, the fake (meta) implementation and the backward op are registered in `library`.
    Under torch.use_deterministic_algorithms(True) the backward switches to its fixed-point path.
    """

    devices = frozenset({"cuda"})
    dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
    deterministic = True
    max_channels: ClassVar[int] = 256
    needs_hopper_build: ClassVar[bool] = False

    def extra_reasons(self, inputs: MSDAInputs) -> list[str]:
        not_built = _extension.build_reasons(self.needs_hopper_build)
        if not_built:
            return list(not_built)
        reasons = []
        if inputs.device.type == "cuda":
            major, minor = device_capability(inputs.device)
            if reason := _extension.device_reason(major, minor):
                reasons.append(reason)
        if inputs.channels > self.max_channels:
            reasons.append(f"channels per head {inputs.channels} exceed the kernels' limit of {self.max_channels}")
        if inputs.num_keys >= 2**31:
            reasons.append(f"num_keys {inputs.num_keys} does not fit the kernels' 32-bit key index")
        return reasons + self.shape_reasons(inputs)

    def shape_reasons(self, inputs: MSDAInputs) -> list[str]:
        return []

    def forward(self, inputs: MSDAInputs) -> torch.Tensor:
        device = inputs.device
        config = tuning.kernel_config(self.name, "forward", inputs)
        return library.ms_deform_attn(
            inputs.value.contiguous(),
            inputs.spatial_shapes.to(device, non_blocking=True).contiguous(),
            inputs.level_start_index.to(device, non_blocking=True).contiguous(),
            inputs.sampling_locations.contiguous(),
            inputs.attention_weights.contiguous(),
            self.name,
            config,
        )
