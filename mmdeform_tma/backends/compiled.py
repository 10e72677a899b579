"""Shared behaviour of the backends that run this project's compiled CUDA kernels."""

from __future__ import annotations

from typing import ClassVar

import torch

from .. import _extension, library, tuning
from ..inputs import MSDAInputs
from .base import Backend, Launch, device_capability, on_device


class CompiledKernelBackend(Backend):
    """Calls `torch.ops.mmdeform_tma.ms_deform_attn_forward` with `backend=self.name`.

    Autograd is the op's own (C++): the call carries the backward's backend and config, so the
    backward needs no lookup. Under torch.use_deterministic_algorithms(True), read when the
    backward runs, it takes the deterministic path (sorted contributions on cross-attention, fixed
    point elsewhere); the config is then the deterministic backward's tuned one (the flag is part
    of a call's plan key, `dispatch.signature`). Non-contiguous inputs are copied by the op.
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

    def launcher(self, inputs: MSDAInputs, backward: Backend) -> Launch:
        op = library.forward_op()
        name, config = self.name, tuning.kernel_config(self.name, "forward", inputs)
        backward_name, backward_config = backward.name, tuning.kernel_config(backward.name, tuning.backward_direction(), inputs)
        shapes, starts = on_device(inputs.spatial_shapes, inputs.device), on_device(inputs.level_start_index, inputs.device)

        def launch(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
            return op(
                value, shapes(spatial_shapes), starts(level_start_index), sampling_locations, attention_weights,
                name, config, backward_name, backward_config,
            )

        return launch
