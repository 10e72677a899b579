"""What every backend declares, and the checks that follow from the declaration."""

from __future__ import annotations

from typing import Callable, ClassVar

import torch

from .._extension import device_capability
from ..inputs import MSDAInputs

__all__ = ["Backend", "Launch", "clear_device_copies", "device_capability", "device_copy", "dtype_name", "on_device"]

# (value, spatial_shapes, level_start_index, sampling_locations, attention_weights) -> output
Launch = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# Device copies of CPU level geometry, per (device, dtype, shape, values); few distinct ones exist.
# Bounded like dispatch.PLANS; a plan keeps its own copies alive.
_DEVICE_COPIES: dict[tuple, torch.Tensor] = {}
MAX_DEVICE_COPIES = 1024


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _as_given(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def device_copy(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The cached copy on `device` of a small CPU int tensor, made once per device and values."""
    key = (device, tensor.dtype, tuple(tensor.shape), tuple(tensor.reshape(-1).tolist()))
    copy = _DEVICE_COPIES.get(key)
    if copy is None:
        if len(_DEVICE_COPIES) >= MAX_DEVICE_COPIES:
            _DEVICE_COPIES.clear()
        with torch.inference_mode(False):  # an inference tensor could not be saved for a later backward
            copy = torch.tensor(key[3], dtype=tensor.dtype).reshape(key[2]).to(device, non_blocking=True)
        _DEVICE_COPIES[key] = copy
    return copy


def clear_device_copies() -> None:
    _DEVICE_COPIES.clear()


def on_device(tensor: torch.Tensor, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """How a launch passes level geometry (`spatial_shapes`, `level_start_index`) to a kernel on
    `device`, decided once per call signature: as given when it is there already; else the cached
    copy of its values (the values are part of the signature), so no call copies host to device.
    Under torch.compile (values unknown while tracing), a dispatch mode or a tensor subclass (the
    copy would not be what the mode expects) it is copied per call, as before caching."""
    if tensor.device == device:
        return _as_given
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() or type(tensor) is not torch.Tensor:
        return lambda t: t.to(device, non_blocking=True)
    copy = device_copy(tensor, device)
    return lambda _: copy


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

    def launcher(self, inputs: MSDAInputs, backward: Backend) -> Launch:
        """The call this backend makes for inputs of this signature, with everything that follows
        from metadata bound (kernel configs, device copies of CPU level geometry); `backward` is
        the backend whose backward the call's autograd runs (another compiled backend or itself;
        `mmcv` and `pytorch` always run their own). Its result is differentiable, of shape
        (bs, queries, heads * channels). It is cached per signature, so it must hold no input tensor."""
        raise NotImplementedError
