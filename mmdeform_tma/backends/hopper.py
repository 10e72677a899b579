"""Limits shared by the Hopper (TMA) backends."""

from __future__ import annotations

from ..inputs import MSDAInputs
from .base import device_capability
from .compiled import CompiledKernelBackend


# One corner of one head is a TMA box row; a team of 2 x row_bytes / 16 lanes (at most 32) reads it.
TMA_ROW_BYTES = (16, 32, 64, 128, 256)


class HopperKernelBackend(CompiledKernelBackend):
    min_compute_capability = (9, 0)
    needs_hopper_build = True

    def shape_reasons(self, inputs: MSDAInputs) -> list[str]:
        reasons = []
        if inputs.device.type == "cuda" and device_capability(inputs.device)[0] != 9:
            major, minor = device_capability(inputs.device)
            reasons.append(f"sm_90a kernels run on compute capability 9.x only, the GPU has {major}.{minor}")
        row_bytes = inputs.channels * inputs.value.element_size()
        if row_bytes not in TMA_ROW_BYTES:
            reasons.append(
                f"a head's channels must span 16, 32, 64, 128 or 256 bytes for the TMA team layout "
                f"({inputs.channels} x {inputs.value.element_size()} B = {row_bytes} B)"
            )
        if inputs.batch * inputs.num_keys >= 2**31:
            reasons.append(f"batch x num_keys = {inputs.batch * inputs.num_keys} exceeds TMA's 32-bit row coordinate")
        return reasons
