// The bytes of a value row one lane moves in the Hopper backward kernels (`tma_ws`).
#pragma once

#include <type_traits>

namespace mmdeform_tma {
namespace hopper {

// Bytes of a corner row one lane reads: 16, except in the backward of 2-byte dtypes. There a
// 16-byte chunk is 8 fp32 value-gradient contributions, two v4 reductions that each cover half of
// every 32-byte sector across the lanes: twice the L2 reduction operations. With 8-byte chunks a
// lane's contribution is one v4 reduction and 8 consecutive lanes cover 128 contiguous bytes. The
// team doubles, so this needs rows of at most 128 bytes (a team fits a warp).
inline int backward_chunk_bytes(int channels, int element_size) {
  return element_size == 2 && channels * element_size <= 128 ? 8 : 16;
}

// Calls launch(std::integral_constant<int, chunk bytes>{}) with the backward's chunk size; only
// the 2-byte dtypes instantiate the 8-byte variant.
template <typename scalar_t, typename Launch>
void with_backward_chunk(int channels, Launch&& launch) {
  if constexpr (sizeof(scalar_t) == 2) {
    if (backward_chunk_bytes(channels, sizeof(scalar_t)) == 8) {
      launch(std::integral_constant<int, 8>{});
      return;
    }
  }
  launch(std::integral_constant<int, 16>{});
}

}  // namespace hopper
}  // namespace mmdeform_tma
