"""`pytorch`: the reference (`mmdeform_tma.reference`, grid_sample) as a backend; any device,
any float dtype. Called as the `mmdeform_tma::reference_forward` op, whose backward is the
reference's explicit gradient (grid_sample's own backward).
"""

from __future__ import annotations

import torch

from .. import library
from ..inputs import VALUE_DTYPES, MSDAInputs
from .base import Backend


class PyTorchBackend(Backend):
    name = "pytorch"
    summary = "reference: grid_sample per level, autograd by PyTorch"
    devices = frozenset({"cpu", "cuda"})
    dtypes = frozenset(VALUE_DTYPES)
    deterministic = True

    def is_deterministic(self, inputs: MSDAInputs) -> bool:
        return inputs.device.type == "cpu"  # grid_sample's CUDA backward accumulates with atomics

    def forward(self, inputs: MSDAInputs) -> torch.Tensor:
        return library.reference_forward(
            inputs.value, inputs.spatial_shapes, inputs.sampling_locations, inputs.attention_weights
        )
