"""`pytorch`: the reference (`mmdeform_tma.reference`, grid_sample) as a backend; any device,
any float dtype. Called as the `mmdeform_tma::reference_forward` op, whose backward is the
reference's explicit gradient (grid_sample's own backward).
"""

from __future__ import annotations

import torch

from .. import library  # noqa: F401  (defines the reference ops)
from ..inputs import VALUE_DTYPES, MSDAInputs
from .base import Backend, Launch


class PyTorchBackend(Backend):
    name = "pytorch"
    summary = "reference: grid_sample per level, autograd by PyTorch"
    devices = frozenset({"cpu", "cuda"})
    dtypes = frozenset(VALUE_DTYPES)
    deterministic = True

    def is_deterministic(self, inputs: MSDAInputs) -> bool:
        return inputs.device.type == "cpu"  # grid_sample's CUDA backward accumulates with atomics

    def launcher(self, inputs: MSDAInputs, backward: Backend) -> Launch:
        op = torch.ops.mmdeform_tma.reference_forward.default

        def launch(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
            return op(value, spatial_shapes, sampling_locations, attention_weights)

        return launch
