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
        info = _extension.build_info()
        if not info.loaded:
            return [f"not built: {info.error}; {_extension.BUILD_HINT}"]
        if not info.with_cuda:
            return [f"not built: the extension was compiled without CUDA kernels; {_extension.BUILD_HINT}"]
        if self.needs_hopper_build and not info.with_hopper:
            return [f"not built: the extension has no sm_90a (Hopper) kernels; {_extension.BUILD_HINT}"]
        reasons = []
        if inputs.device.type == "cuda" and not info.supports_device(device_capability(inputs.device)):
            major, minor = device_capability(inputs.device)
            reasons.append(
                f"not built for this GPU (compute capability {major}.{minor}; built for {', '.join(info.cuda_archs)}); "
                f"rebuild with TORCH_CUDA_ARCH_LIST including {major}.{minor}"
            )
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
