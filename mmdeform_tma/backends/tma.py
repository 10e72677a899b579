"""`tma`: Hopper kernels in which every warp runs its own TMA + mbarrier pipeline (no warp roles).

Each sampling point's two 2 x channels corner rows are fetched with `cp.async.bulk.tensor` into a
STAGES-deep shared-memory ring per warp; the lanes then interpolate from shared memory.
"""

from .hopper import HopperKernelBackend


class TmaBackend(HopperKernelBackend):
    name = "tma"
    summary = "per-warp TMA/mbarrier pipeline (sm_90a), STAGES 1-4"
