// The `tma_ws` region forward (region_forward.cu): the `rg_*` forward configs, for encoder
// self-attention in fp16 and bf16.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <tuple>

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

// A test hook (tests/backends/test_compiled_kernels.py): config `name`'s region kernel alone, without
// the fallback the config runs after it, which writes every output once the flag is set and so would
// hide a kernel that gives up on local sampling. Returns the output (NaN where nothing was written)
// and the spread flag (1: the kernel found sampling that leaves its windows).
std::tuple<at::Tensor, at::Tensor> region_forward_alone(const ProblemTensors& problem, const std::string& name);

}  // namespace tma_ws
}  // namespace mmdeform_tma
