// Host side of the Hopper backends: the TMA descriptor over `value`, and the checks that the GPU
// and the build can run sm_90a kernels.
#pragma once

#include <ATen/ATen.h>
#include <cuda.h>

#include <string>

namespace mmdeform_tma {
namespace hopper {

// `value` [batch, num_keys, heads, channels] seen as a 2-D tensor of batch*num_keys rows ("keys")
// by heads*channels columns. A box is `channels` columns (one head) by `box_keys` consecutive keys:
// one row of a window. Keys outside [0, batch*num_keys) read as zeros. Level geometry is applied by the
// kernels, so the map needs no level shapes on the host (no synchronisation, CUDA-graph
// capturable). Encoded per call; passed as a __grid_constant__.
CUtensorMap value_tensor_map(const at::Tensor& value, int box_keys);

// The same map for heads of 64 bytes (32 fp16/bf16 channels) with the 64-byte swizzle: a row's
// 16-byte chunk j lands at j ^ (shared address bits 7-8), so that ldmatrix reads of rows 128 bytes
// apart in a window of a pitch of 2 mod 4 rows meet no bank conflict (region_forward.cu).
CUtensorMap value_window_row_map(const at::Tensor& value, int box_keys);

// The deterministic backward's int64 fixed-point accumulator of the value gradient seen as `rows`
// keys by `columns` (heads x channels) elements, for TMA reductions (two's complement addition is
// unsigned addition). A box is `box_keys` keys by kFixedPointBoxColumns channels (a head of 32), one
// dense 256-byte row a key in shared memory, 128-byte aligned. No swizzle: the 128-byte one needs
// rows of 128 bytes (two boxes a head), and a warp's stores of its rows conflict as much in both.
constexpr int kFixedPointBoxColumns = 32;
constexpr int kFixedPointBoxKeys = 4;  // a quarter of a 16-cell window row
CUtensorMap fixed_point_tensor_map(void* data, int64_t rows, int64_t columns, int box_keys);

// Throws unless the current GPU is compute capability 9.x and the build holds sm_90a code.
void require_hopper(const std::string& backend);

// Throws unless a head's channels span 16, 32, 64, 128 or 256 bytes (the team layouts).
void require_tma_channels(const at::Tensor& value, const std::string& backend);

}  // namespace hopper
}  // namespace mmdeform_tma
