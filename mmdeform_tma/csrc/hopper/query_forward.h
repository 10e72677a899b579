// The `tma_ws` forward of the `q_warp` config: one warp per (batch, query, head), for strips of
// unordered queries (decoders). query_forward.cu says why.
#pragma once

#include <ATen/ATen.h>

#include "../common/problem.h"

namespace mmdeform_tma {
namespace tma_ws {

// Writes every row of `output` ([batch, queries, heads * channels], value's dtype).
void query_warp_forward(const ProblemTensors& problem, at::Tensor& output);

}  // namespace tma_ws
}  // namespace mmdeform_tma
