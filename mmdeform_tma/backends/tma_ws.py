"""`tma_ws`: warp-specialised, persistent Hopper kernels over query tiles (window pipeline).

A tile is a block of queries of one (batch, head): 2-D pixel blocks of one level for encoder
self-attention (one query per pixel), strips of consecutive queries otherwise. A producer warp
computes every point's sampling geometry once per (tile, level) stage and can load a window of the
level that covers the tile's points with TMA; consumer warps interpolate (forward) or scatter the
gradients (backward), reading window points from shared memory and the others through L1.
full/empty mbarrier rings hand the stages over. Compiled variants (tile size, stages, window on or
off) are in `mmdeform_tma._C.kernel_configs('tma_ws', ...)`; docs/perf_notes.md says which win.
"""

from __future__ import annotations

from ..inputs import MSDAInputs
from .base import device_capability
from .compiled import CompiledKernelBackend

# One head's channels of a key are a TMA box row, read by a team of row_bytes / chunk lanes (window_config.h).
TMA_ROW_BYTES = (16, 32, 64, 128, 256)
# A (tile, level) stage keeps every point's metadata in shared memory; the smallest tile holds
# this many points per level within an SM's shared memory at any channel width and dtype.
MAX_POINTS_PER_LEVEL = 32


class TmaWarpSpecializedBackend(CompiledKernelBackend):
    name = "tma_ws"
    summary = "warp-specialised window pipeline over query tiles, persistent CTAs (sm_90a)"
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
        if inputs.num_points > MAX_POINTS_PER_LEVEL:
            reasons.append(
                f"{inputs.num_points} points per level exceed the window pipeline's {MAX_POINTS_PER_LEVEL} "
                "(their metadata must fit in shared memory)"
            )
        return reasons
