"""`cuda`: the portable CUDA kernels (sm_80 and newer), the bar the Hopper kernels must clear.

Any batch, heads, levels, points and channels up to 256; 16-byte vector paths whenever
channels x element size is a multiple of 16 bytes. The backward accumulates grad_value with fp32
vector atomics, or, under torch.use_deterministic_algorithms(True), in 64-bit fixed point (or, on
cross-attention, by sorting its contributions by pixel: `csrc/common/sorted_value_gradient.h`).
"""

from .compiled import CompiledKernelBackend


class CudaBackend(CompiledKernelBackend):
    name = "cuda"
    summary = "portable CUDA kernels, 16-byte vector gathers, fp32 accumulation"
    min_compute_capability = (8, 0)
