"""What every backend declares, and the checks that follow from the declaration."""

from __future__ import annotations

import functools
from typing import ClassVar

import torch

from ..inputs import MSDAInputs


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


@torch.compiler.assume_constant_result
def device_capability(device: torch.device) -> tuple[int, int]:
    """Compute capability of a CUDA device, queried once (and constant under torch.compile)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Backend:
    """A named implementation of multi-scale deformable attention.

    Capabilities are class attributes; `not_supported_reasons` turns them, and anything a backend
    adds in `extra_reasons`, into readable sentences. An empty list means the backend can run.
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    devices: ClassVar[frozenset[str]]
    dtypes: ClassVar[frozenset[torch.dtype]]
    min_compute_capability: ClassVar[tuple[int, int] | None] = None
    # The backward is bitwise reproducible under torch.use_deterministic_algorithms(True).
    deterministic: ClassVar[bool]

    def not_supported_reasons(self, inputs: MSDAInputs) -> list[str]:
        reasons = []
        device = inputs.device
        if device.type not in self.devices:
            reasons.append(f"runs on {'/'.join(sorted(self.devices))}, not {device.type}")
        if inputs.dtype not in self.dtypes:
            supported = ", ".join(sorted(dtype_name(d) for d in self.dtypes))
            reasons.append(f"value dtype {dtype_name(inputs.dtype)} is not supported (supported: {supported})")
        if device.type == "cuda" and self.min_compute_capability is not None and not reasons:
            capability = device_capability(device)
            if capability < self.min_compute_capability:
                need = ".".join(map(str, self.min_compute_capability))
                reasons.append(f"needs compute capability {need} or newer, the GPU has {capability[0]}.{capability[1]}")
        if inputs.needs_grad and torch.are_deterministic_algorithms_enabled() and not self.is_deterministic(inputs):
            reasons.append(
                "its backward is not deterministic and torch.use_deterministic_algorithms(True) is set"
            )
        return reasons + self.extra_reasons(inputs)

    def is_deterministic(self, inputs: MSDAInputs) -> bool:
        return self.deterministic

    def extra_reasons(self, inputs: MSDAInputs) -> list[str]:
        return []

    def forward(self, inputs: MSDAInputs) -> torch.Tensor:
        """Differentiable output of shape (bs, queries, heads * channels)."""
        raise NotImplementedError
