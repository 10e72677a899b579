// The `tma_ws` region forward (region_forward.cu): the `rg_*` forward configs, for encoder
// self-attention in fp16 and bf16.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "../common/problem.h"
#include "window_config.h"

namespace mmdeform_tma {
namespace tma_ws {

// Why these inputs cannot run on the region forward; empty when they can.
std::string region_forward_unsupported(const ProblemTensors& problem);

// Writes the forward of a non-empty problem into `output` (batch, queries, heads x channels), unless
// it finds sampling that leaves its windows (uniform sampling): then it sets *spread_flag (zeroed by
// the caller) and leaves the output to a forward that the caller runs next where the flag is set.
void region_forward(const ProblemTensors& problem, const hopper::window::RegionForwardConfig& config,
                    at::Tensor& output, int* spread_flag);

}  // namespace tma_ws
}  // namespace mmdeform_tma
