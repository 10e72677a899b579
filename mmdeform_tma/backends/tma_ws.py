"""`tma_ws`: warp-specialised, persistent Hopper kernels.

Producer warps compute each sampling point's metadata once, write it to shared memory and issue
the TMA loads; consumer warps interpolate and accumulate. One CTA per SM walks a static tile
schedule; full/empty mbarrier rings hand the stages over.
"""

from .hopper import HopperKernelBackend


class TmaWarpSpecializedBackend(HopperKernelBackend):
    name = "tma_ws"
    summary = "warp-specialised producer/consumer TMA pipeline, persistent CTAs (sm_90a)"
