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
from .hopper import HopperKernelBackend

# A (tile, level) stage keeps every point's metadata in shared memory; the smallest tile holds
# this many points per level within an SM's shared memory at any channel width and dtype.
MAX_POINTS_PER_LEVEL = 32


class TmaWarpSpecializedBackend(HopperKernelBackend):
    name = "tma_ws"
    summary = "warp-specialised window pipeline over query tiles, persistent CTAs (sm_90a)"

    def shape_reasons(self, inputs: MSDAInputs) -> list[str]:
        reasons = super().shape_reasons(inputs)
        if inputs.num_points > MAX_POINTS_PER_LEVEL:
            reasons.append(
                f"{inputs.num_points} points per level exceed the window pipeline's {MAX_POINTS_PER_LEVEL} "
                "(their metadata must fit in shared memory)"
            )
        return reasons
